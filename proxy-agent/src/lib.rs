//! cluster-proxy agent: a Rust reimplementation of the konnectivity
//! (apiserver-network-proxy) agent.
//!
//! The agent dials out to the proxy-servers (`AgentService.Connect`), holds one
//! tunnel per server replica, and opens the TCP connections the servers ask
//! for inside the managed cluster.
//!
//! Start one in-process with [`start`]; the returned [`RunningAgent`] reports
//! its bound addresses and tunnels and shuts down with DRAIN.
#![forbid(unsafe_code)]

mod agent_config;
mod connection;
pub mod dial;
mod manager;
pub mod metrics;
pub mod settings;
pub mod tunnel;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_egress::Egress;
use cluster_proxy_proto::identifiers::AgentIdentifiers;
use cluster_proxy_runtime::admin::{self, NotReady};
use cluster_proxy_runtime::net::{BindError, bind};
use cluster_proxy_runtime::reload;
use cluster_proxy_runtime::tls::{self, Identity, Pem, TlsError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use agent_config::{
    ProxyAgentConfig, TlsSource, TraceRelay, Transport, offered_alpn, offering_framing,
    offering_websocket,
};
pub use manager::ConnectError;
pub use metrics::Metrics;
pub use settings::{Cli, ConfigError, ProxyAgentSettings};

use crate::connection::USER_AGENT;
use crate::manager::Shared;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Names the offending file.
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("invalid --{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The proxy settings (`--proxy-url`, `HTTPS_PROXY`, the CA or
    /// credentials files).
    #[error(transparent)]
    Egress(#[from] cluster_proxy_egress::EgressError),
}

/// Builds `source`'s client configuration; errors name the offending file.
/// Here rather than on [`TlsSource`], whose module cannot name [`AgentError`].
fn client_config(source: &TlsSource) -> Result<Arc<rustls::ClientConfig>, AgentError> {
    match source {
        TlsSource::Config(config) => Ok(config.clone()),
        TlsSource::Files {
            ca_cert,
            agent_cert,
            agent_key,
            alpn,
        } => {
            let roots = tls::roots(&Pem::file("CA certificate (--ca-cert)", ca_cert)?)?;
            let identity = match (agent_cert, agent_key) {
                (Some(cert), Some(key)) => Some(Identity::new(
                    &Pem::file("agent certificate (--agent-cert)", cert)?,
                    &Pem::file("agent key (--agent-key)", key)?,
                )?),
                (None, None) => None,
                _ => {
                    return Err(AgentError::Invalid {
                        field: "agent-cert",
                        reason: "--agent-cert and --agent-key must be given together".into(),
                    });
                }
            };
            Ok(tls::client_config(roots, identity, &offered_alpn(alpn))?)
        }
    }
}

/// Upstream's readiness failure body, which probes and runbooks match on.
pub const NOT_READY_BODY: &str = "[+]ping ok\n[-]server-connected failed: no servers connected\n";

/// Upstream's body, then why the newest attempt failed (one line).
fn not_ready_body(last_failure: Option<&str>) -> String {
    match last_failure {
        None => NOT_READY_BODY.to_owned(),
        Some(failure) => format!(
            "{NOT_READY_BODY}[-]last-connect-attempt failed: {}\n",
            failure.replace(['\n', '\r'], " ")
        ),
    }
}

fn validate(config: &ProxyAgentConfig) -> Result<(), AgentError> {
    AgentIdentifiers::parse_like_upstream(&config.agent_identifiers).map_err(|e| {
        AgentError::Invalid {
            field: "agent-identifiers",
            reason: e.to_string(),
        }
    })?;
    if config.agent_id.is_empty() || config.agent_id.contains(|c: char| !c.is_ascii_graphic()) {
        return Err(AgentError::Invalid {
            field: "agent-id",
            reason: format!(
                "{:?} must be non-empty printable ASCII without spaces",
                config.agent_id
            ),
        });
    }
    if config.sync_interval.is_zero() || config.sync_interval_cap < config.sync_interval {
        return Err(AgentError::Invalid {
            field: "sync-interval-cap",
            reason: "must be greater than or equal to a non-zero --sync-interval".into(),
        });
    }
    Ok(())
}

/// A started agent.
pub struct RunningAgent {
    shared: Arc<Shared>,
    health_addr: SocketAddr,
    admin_addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RunningAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningAgent")
            .field("agent_id", &self.shared.agent_id())
            .field("health_addr", &self.health_addr)
            .field("admin_addr", &self.admin_addr)
            .finish_non_exhaustive()
    }
}

/// Loads credentials, binds the health and admin ports and starts connecting
/// to the proxy-server. Returns once the listeners are bound; tunnels come up
/// in the background (see [`RunningAgent::wait_for_tunnels`]).
pub async fn start(config: ProxyAgentConfig) -> Result<RunningAgent, AgentError> {
    validate(&config)?;
    let lean = config.lean_framing;
    let transport = config.transport;
    let offering = move |config| match transport {
        Transport::Auto => offering_framing(config, lean),
        Transport::Websocket => offering_websocket(config),
    };
    let tls = match &config.tls {
        TlsSource::Config(fixed) => reload::fixed(offering(fixed.clone())),
        files @ TlsSource::Files { .. } => {
            let paths = files.paths();
            let source = files.clone();
            reload::watch_files(
                "agent credentials",
                paths,
                config.credential_reload_interval,
                move || {
                    client_config(&source).map(offering).map_err(|e| match e {
                        AgentError::Tls(t) => t,
                        other => TlsError::Config(other.to_string()),
                    })
                },
            )?
        }
    };
    let (health, health_addr) = bind(
        "health server",
        &config.health_server_host,
        config.health_server_port,
    )
    .await?;
    let (admin, admin_addr) = bind(
        "admin server",
        &config.admin_bind_address,
        config.admin_server_port,
    )
    .await?;
    let egress = Egress::from_env(&config.egress, USER_AGENT)?;
    let route = egress.describe();
    let root = CancellationToken::new();
    let shared = Arc::new(Shared::new(config, tls, egress, root.clone()));
    tracing::info!(
        agent_id = %shared.agent_id(),
        server = %shared.server_address(),
        transport = shared.transport().as_str(),
        egress = %route,
        %health_addr,
        %admin_addr,
        "proxy-agent started"
    );
    let probed = shared.clone();
    let exposed = shared.clone();
    let health_routes = admin::Routes::probes(move || {
        if probed.tunnel_count() > 0 {
            Ok(())
        } else {
            Err(NotReady {
                status: http::StatusCode::SERVICE_UNAVAILABLE,
                body: not_ready_body(probed.last_failure().as_deref()),
            })
        }
    })
    .with_metrics(move || exposed.metrics().encode());
    let exposed = shared.clone();
    let admin_routes = admin::Routes::metrics_only(move || exposed.metrics().encode());
    let tasks = vec![
        tokio::spawn(admin::serve(health, health_routes, root.clone())),
        tokio::spawn(admin::serve(admin, admin_routes, root.clone())),
        tokio::spawn(manager::run(shared.clone())),
    ];
    Ok(RunningAgent {
        shared,
        health_addr,
        admin_addr,
        tasks,
    })
}

impl RunningAgent {
    pub fn agent_id(&self) -> &str {
        self.shared.agent_id()
    }

    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Tunnels open now (one per distinct proxy-server).
    pub fn tunnel_count(&self) -> usize {
        self.shared.tunnel_count()
    }

    /// Tunnels to servers that have not announced a drain: those count
    /// towards holding every replica.
    pub fn active_tunnel_count(&self) -> usize {
        self.shared.active_tunnel_count()
    }

    /// How many proxy-server replicas the agent works towards holding: the
    /// newest `servercount` header or SERVER_COUNT packet (0 before any).
    pub fn known_server_count(&self) -> usize {
        self.shared.known_server_count()
    }

    /// Ids of the proxy-servers this agent holds tunnels to, sorted.
    pub fn server_ids(&self) -> Vec<String> {
        self.shared.server_ids()
    }

    /// Endpoint connections open now.
    pub fn open_endpoint_connections(&self) -> i64 {
        self.shared.metrics().open_endpoint_connections.get()
    }

    pub fn metrics(&self) -> &Metrics {
        self.shared.metrics()
    }

    /// Waits until at least `n` tunnels are up; false on timeout.
    pub async fn wait_for_tunnels(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.tunnel_count() >= n {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends DRAIN on every tunnel and stops opening new ones; existing
    /// tunnels keep serving. Idempotent.
    pub fn drain(&self) {
        self.shared.drain();
    }

    /// Drains, waits up to the configured grace for endpoint connections to
    /// finish, then closes every tunnel and the health/admin servers.
    pub async fn shutdown(self) {
        self.drain();
        let deadline = tokio::time::Instant::now() + self.shared.shutdown_grace();
        // Let the DRAIN packets reach the servers before the streams close.
        tokio::time::sleep(Duration::from_millis(100)).await;
        while self.open_endpoint_connections() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.shared.cancel();
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        self.shared
            .wait_tunnels_closed(Duration::from_secs(5))
            .await;
        tracing::info!(agent_id = %self.shared.agent_id(), "proxy-agent stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cluster_proxy_proto::framed::ALPN_FRAMED;
    use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11};

    fn offering(alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    fn offered(config: &rustls::ClientConfig) -> Vec<&[u8]> {
        config.alpn_protocols.iter().map(Vec::as_slice).collect()
    }

    /// The lean framing goes first, once, ahead of what was offered
    /// (`--alpn-proto` values, `h2`); turned off, it is not offered at all.
    #[test]
    fn the_lean_framing_is_offered_first_unless_turned_off() {
        let extra: &[u8] = b"konnectivity";
        let lean = offering_framing(offering(&[extra, ALPN_H2]), true);
        assert_eq!(offered(&lean), [ALPN_FRAMED, extra, ALPN_H2]);
        let again = offering_framing(lean.clone(), true);
        assert!(
            Arc::ptr_eq(&again, &lean),
            "already offered first: unchanged"
        );
        let moved = offering_framing(offering(&[ALPN_H2, ALPN_FRAMED]), true);
        assert_eq!(offered(&moved), [ALPN_FRAMED, ALPN_H2]);
        let off = offering_framing(lean, false);
        assert_eq!(offered(&off), [extra, ALPN_H2]);
    }

    /// The WebSocket transport offers HTTP/1.1 alone: neither `h2` nor
    /// the lean framing, which HTTP/1.1-only middleboxes refuse.
    #[test]
    fn the_websocket_transport_offers_only_http11() {
        let websocket = offering_websocket(offering(&[ALPN_FRAMED, ALPN_H2]));
        assert_eq!(offered(&websocket), [ALPN_HTTP11]);
        let again = offering_websocket(websocket.clone());
        assert!(Arc::ptr_eq(&again, &websocket), "unchanged");
    }

    #[test]
    fn lean_framing_is_on_unless_the_flag_turns_it_off() {
        use clap::Parser;
        let load = |args: &[&str]| {
            let argv = std::iter::once("proxy-agent").chain(args.iter().copied());
            ProxyAgentSettings::load_with_env(&Cli::parse_from(argv), Vec::new()).unwrap()
        };
        assert!(load(&[]).lean_framing);
        assert!(!load(&["--lean-framing=false"]).lean_framing);
        assert!(load(&["--lean-framing"]).lean_framing);
    }
}
