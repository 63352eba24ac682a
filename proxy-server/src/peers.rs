//! How many proxy-server replicas exist: the `servercount` this replica
//! tells agents, so that scaling the Deployment needs no restart.
//!
//! `--server-count-source=static` (the default) keeps `--server-count`
//! fixed, as upstream. `--server-count-source=dns:<name>` resolves `<name>`,
//! a headless Service selecting every replica, every
//! `--server-count-refresh-interval`, and the count is the number of
//! distinct addresses it resolves to. A failed or empty lookup keeps the last
//! count (starting from `--server-count`), with a warning and
//! `cluster_proxy_server_peer_lookup_failures_total`; the count is never 0.
//!
//! Replicas count themselves rather than agents counting Leases (upstream's
//! `--count-server-leases`): agents run in managed clusters, where hub Leases
//! and hub DNS names are out of reach, and the data plane links no
//! Kubernetes client. Agents learn a changed count from the next Connect's
//! `servercount` header and, when they negotiated it, at once from a
//! `SERVER_COUNT` packet on every tunnel ([`crate::tunnel::AgentTunnel::announce_server_count`]).
//!
//! A lookup yields each replica's health endpoint (the address with this
//! replica's `--health-port`), which [`crate::readiness`] asks how many
//! agents it holds.

use std::collections::HashSet;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::registry::Registry;

/// Where the replica count comes from (`--server-count-source`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerCountSource {
    /// `--server-count`, fixed.
    Static,
    /// The number of addresses a DNS name resolves to.
    Dns(String),
}

/// A `--server-count-source` value that is neither `static` nor `dns:<name>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a server count source: use static or dns:<headless service name>")]
pub struct SourceParseError(String);

impl std::str::FromStr for ServerCountSource {
    type Err = SourceParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        if text.is_empty() || text == "static" {
            return Ok(ServerCountSource::Static);
        }
        match text.strip_prefix("dns:").map(str::trim) {
            Some(name) if valid_dns_name(name) => Ok(ServerCountSource::Dns(name.to_owned())),
            _ => Err(SourceParseError(text.to_owned())),
        }
    }
}

/// A host name as DNS resolvers accept it: dot-separated labels of ASCII
/// letters, digits and hyphens, at most 253 characters.
fn valid_dns_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Why a lookup of the peer replicas failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerLookupError {
    #[error("resolving {name}: {source}")]
    Resolve {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} resolves to no address")]
    NoAddress(String),
}

pub type LookupFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<SocketAddr>, PeerLookupError>> + Send + 'a>>;

/// Finds the replicas that exist now. Tests drive the set without DNS.
pub trait PeerLookup: Send + Sync + 'static {
    /// What the lookup asks for, for logs.
    fn describe(&self) -> String;
    /// Every replica's health endpoint, this one's included; none is
    /// reported as an error by the caller.
    fn lookup(&self) -> LookupFuture<'_>;
}

/// Resolves a headless Service name: one address per replica, each
/// replica's health endpoint on `health_port` (the same in every pod).
#[derive(Debug, Clone)]
pub struct DnsPeers {
    pub name: String,
    pub health_port: u16,
}

impl PeerLookup for DnsPeers {
    fn describe(&self) -> String {
        format!("dns:{}", self.name)
    }

    fn lookup(&self) -> LookupFuture<'_> {
        Box::pin(async move {
            let addresses = tokio::net::lookup_host((self.name.as_str(), 0))
                .await
                .map_err(|source| PeerLookupError::Resolve {
                    name: self.name.clone(),
                    source,
                })?;
            let distinct: HashSet<IpAddr> = addresses.map(|a| a.ip()).collect();
            Ok(distinct
                .into_iter()
                .map(|ip| SocketAddr::new(ip, self.health_port))
                .collect())
        })
    }
}

/// Keeps `count` at the number of replicas `lookup` reports and `found` at
/// their health endpoints, every `interval`, until `shutdown`; tells every
/// agent that negotiated it when the count changes.
pub(crate) async fn follow(
    lookup: Arc<dyn PeerLookup>,
    interval: Duration,
    count: watch::Sender<u32>,
    found: watch::Sender<Vec<SocketAddr>>,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let source = lookup.describe();
    let mut failing = false;
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let answer = tokio::select! {
            _ = shutdown.cancelled() => return,
            answer = lookup.lookup() => answer,
        };
        let answer = match answer {
            Ok(peers) if peers.is_empty() => Err(PeerLookupError::NoAddress(source.clone())),
            other => other,
        };
        let replicas = match answer {
            Ok(mut peers) => {
                peers.sort_unstable();
                peers.dedup();
                let replicas = u32::try_from(peers.len()).unwrap_or(u32::MAX);
                found.send_if_modified(|known| {
                    let changed = *known != peers;
                    *known = std::mem::take(&mut peers);
                    changed
                });
                replicas
            }
            Err(e) => {
                metrics.peer_lookup_failures.inc();
                let last = *count.borrow();
                // One warning per outage, not one per interval.
                if !failing {
                    warn!(%source, error = %e, server_count = last, "cannot count the proxy-server replicas; keeping the last count");
                }
                failing = true;
                continue;
            }
        };
        if failing {
            info!(%source, server_count = replicas, "counting the proxy-server replicas again");
            failing = false;
        }
        if count.send_if_modified(|current| std::mem::replace(current, replicas) != replicas) {
            metrics.server_count.set(i64::from(replicas));
            let tunnels = registry.all();
            info!(%source, server_count = replicas, agents = tunnels.len(), "proxy-server replica count changed");
            for tunnel in tunnels {
                tunnel.announce_server_count(replicas);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_and_bad_ones_are_named() {
        assert_eq!("static".parse(), Ok(ServerCountSource::Static));
        assert_eq!("".parse(), Ok(ServerCountSource::Static));
        assert_eq!(
            "dns:proxy-server-peers.open-cluster-management-addon.svc".parse(),
            Ok(ServerCountSource::Dns(
                "proxy-server-peers.open-cluster-management-addon.svc".into()
            ))
        );
        for bad in [
            "dns:", "dns:a..b", "dns:-a", "dns:a b", "leases", "dns:a:80",
        ] {
            let err = bad
                .parse::<ServerCountSource>()
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("dns:<headless")),
                "{bad}: {err:?}"
            );
        }
    }

    #[tokio::test]
    async fn localhost_resolves_to_at_least_one_address() {
        let peers = DnsPeers {
            name: "localhost".into(),
            health_port: 8092,
        };
        let found = peers.lookup().await.map_err(|e| e.to_string());
        assert!(
            matches!(&found, Ok(found) if !found.is_empty() && found.iter().all(|a| a.port() == 8092)),
            "{found:?}"
        );
    }
}
