//! `cluster-proxy health`: every ManagedCluster, its `cluster-proxy` addon,
//! the stored `ClusterProxyReachable` result of health-prober, and
//! optionally a live probe through the proxy-servers.

use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::{CONDITION_TRUE, find_condition, is_condition_true};
use cluster_proxy_proto::connector::TunnelConnector;
use health_prober::probe::{ProbeOutcome, ProbeTarget, probe};
use health_prober::verdict::{CONDITION_TYPE, judge};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::ListParams;
use serde::Serialize;
use tokio::task::JoinSet;

/// The addon's name, also the name of its ManagedClusterAddOn in every
/// cluster namespace.
pub const ADDON_NAME: &str = "cluster-proxy";
/// OCM's availability condition of an addon.
pub const AVAILABLE: &str = "Available";

#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("cannot list ManagedClusters on the hub at {url}: {source}")]
    ListClusters {
        url: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot list ManagedClusterAddOns on the hub at {url}: {source}")]
    ListAddons {
        url: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot write the {format} document: {detail}")]
    Serialize {
        format: &'static str,
        detail: String,
    },
}

/// [`HealthReport::version`] of what this CLI writes.
pub const REPORT_VERSION: u32 = 1;

/// The `-o json|yaml` document.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HealthReport {
    /// The document's format version: raised only when a field changes
    /// meaning or goes away; new fields may appear within a version.
    pub version: u32,
    /// When the report was made (RFC 3339, UTC); ages count from here.
    pub generated_at: String,
    /// Whether `clusters[].probe` holds live results (`--probe`).
    pub probed: bool,
    /// The proxy-server addresses probed through, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub proxy_servers: Vec<String>,
    /// Every ManagedCluster, by name.
    pub clusters: Vec<ClusterHealth>,
}

/// One ManagedCluster.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterHealth {
    pub name: String,
    /// A ManagedClusterAddOn `cluster-proxy` exists in the cluster's namespace.
    pub installed: bool,
    /// Its `Available` condition is `True`.
    pub available: bool,
    /// The live probe (`--probe` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe: Option<LiveProbe>,
    /// health-prober's stored `ClusterProxyReachable` condition, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reachability: Option<StoredReachability>,
}

/// What a live probe through every given proxy-server saw.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LiveProbe {
    /// `/healthz` answered 200 through every proxy-server.
    pub healthy: bool,
    /// `Reachable`, `Degraded` or `Unreachable`, as health-prober judges.
    pub reason: String,
    /// Proxy-servers that got through, of those probed (`1/2`).
    pub replicas: String,
    /// The slowest working path: dial + TLS + first byte, milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dial_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_byte_ms: Option<f64>,
    /// The HTTP status of `/healthz`, when a request got that far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Every failing proxy-server failed by a timeout.
    pub timed_out: bool,
    /// The first failure, prefixed with its proxy-server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The stored condition, with its machine-readable message taken apart.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StoredReachability {
    /// The condition's status: `True`, `False` or `Unknown`.
    pub status: String,
    pub reason: String,
    /// `replicas=` of the message (`2/2`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dial_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_byte_ms: Option<u64>,
    /// `status=` of the message: `/healthz`'s HTTP status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_status: Option<u16>,
    /// `failing=` of the message: the proxy-servers that did not get through.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failing: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The whole message, as stored.
    pub message: String,
    /// The condition's lastTransitionTime (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// `probed_at=` of the message, when the prober records it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probed_at: Option<String>,
    /// Seconds from `probedAt` (else `lastTransitionTime`) to `generatedAt`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<i64>,
}

/// Reads every ManagedCluster and `cluster-proxy` ManagedClusterAddOn, as of `now`.
pub async fn collect(
    client: &kube::Client,
    hub_url: &str,
    now: Timestamp,
) -> Result<HealthReport, HealthError> {
    let clusters = Api::<ManagedCluster>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| HealthError::ListClusters {
            url: hub_url.to_owned(),
            source,
        })?;
    let addons = Api::<ManagedClusterAddOn>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| HealthError::ListAddons {
            url: hub_url.to_owned(),
            source,
        })?;
    let mut rows: Vec<ClusterHealth> = clusters
        .items
        .iter()
        .filter_map(|cluster| cluster.metadata.name.clone())
        .map(|name| {
            let addon = addons.items.iter().find(|addon| {
                addon.metadata.namespace.as_deref() == Some(name.as_str())
                    && addon.metadata.name.as_deref() == Some(ADDON_NAME)
            });
            ClusterHealth {
                installed: addon.is_some(),
                available: addon.is_some_and(|a| is_condition_true(a.conditions(), AVAILABLE)),
                probe: None,
                reachability: addon.and_then(|a| stored_reachability(a, now)),
                name,
            }
        })
        .collect();
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(HealthReport {
        version: REPORT_VERSION,
        generated_at: now.to_string(),
        probed: false,
        proxy_servers: Vec::new(),
        clusters: rows,
    })
}

fn stored_reachability(addon: &ManagedClusterAddOn, now: Timestamp) -> Option<StoredReachability> {
    let condition = find_condition(addon.conditions(), CONDITION_TYPE)?;
    let mut stored = parse_message(&condition.message);
    stored.status = condition.status.clone();
    stored.reason = condition.reason.clone();
    let transition = condition.last_transition_time.0;
    // A zero time is what an unset field parses as.
    if transition.as_second() > 0 {
        stored.last_transition_time = Some(transition.to_string());
    }
    let since = stored
        .probed_at
        .as_deref()
        .and_then(|t| t.parse::<Timestamp>().ok())
        .or((transition.as_second() > 0).then_some(transition));
    stored.age_seconds = since.map(|t| (now.as_second() - t.as_second()).max(0));
    Some(stored)
}

/// Takes apart health-prober's `key=value … error="…"` message; unknown
/// keys are skipped, so a newer prober's message still reads.
pub fn parse_message(message: &str) -> StoredReachability {
    let mut stored = StoredReachability {
        message: message.to_owned(),
        ..StoredReachability::default()
    };
    let (fields, error) = match message.find("error=") {
        Some(at) if at == 0 || message[..at].ends_with(' ') => {
            (&message[..at], Some(&message[at + "error=".len()..]))
        }
        _ => (message, None),
    };
    for token in fields.split_whitespace() {
        let Some((name, value)) = token.split_once('=') else {
            continue;
        };
        match name {
            "replicas" => stored.replicas = Some(value.to_owned()),
            "latency_ms" => stored.latency_ms = value.parse().ok(),
            "dial_ms" => stored.dial_ms = value.parse().ok(),
            "tls_ms" => stored.tls_ms = value.parse().ok(),
            "first_byte_ms" => stored.first_byte_ms = value.parse().ok(),
            "status" => stored.http_status = value.parse().ok(),
            "failing" => {
                stored.failing = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            }
            "probed_at" => stored.probed_at = Some(value.to_owned()),
            _ => {}
        }
    }
    // The prober quotes the error as a Rust string literal; for what it
    // writes (no control characters besides escapes JSON shares) that is
    // a JSON string. Anything else is kept as written.
    stored.error = error
        .map(|quoted| serde_json::from_str::<String>(quoted).unwrap_or_else(|_| quoted.to_owned()));
    stored
}

/// A proxy-server to probe through: its connector, or why it could not be
/// connected (then every cluster's probe through it fails with that reason,
/// and the cluster shows degraded, naming it, as health-prober reports).
pub type Replica = (String, Result<TunnelConnector, String>);

/// How to probe live: one connector per proxy-server, and the target.
pub struct LiveProber {
    pub replicas: Vec<Replica>,
    pub target: ProbeTarget,
    /// Clusters probed at once.
    pub concurrency: usize,
}

impl LiveProber {
    /// Probes every cluster of `report` through every replica, as
    /// health-prober does, and fills `clusters[].probe`.
    pub async fn probe_all(&self, report: &mut HealthReport) {
        let replicas = Arc::new(self.replicas.clone());
        let target = self.target.clone();
        let permits = Arc::new(tokio::sync::Semaphore::new(self.concurrency.max(1)));
        let mut probes = JoinSet::new();
        for (index, cluster) in report.clusters.iter().enumerate() {
            let (replicas, target, permits) = (replicas.clone(), target.clone(), permits.clone());
            let name = cluster.name.clone();
            probes.spawn(async move {
                let _permit = permits.acquire_owned().await;
                let mut outcomes = Vec::with_capacity(replicas.len());
                for (address, connector) in replicas.iter() {
                    let outcome = match connector {
                        Ok(connector) => probe(connector, &target, &name).await,
                        Err(reason) => ProbeOutcome {
                            error: Some(reason.clone()),
                            replica_failed: true,
                            ..ProbeOutcome::default()
                        },
                    };
                    outcomes.push((address.clone(), outcome));
                }
                (index, live_probe(&outcomes))
            });
        }
        while let Some(joined) = probes.join_next().await {
            if let Ok((index, live)) = joined
                && let Some(cluster) = report.clusters.get_mut(index)
            {
                cluster.probe = Some(live);
            }
        }
        report.probed = true;
        report.proxy_servers = self.replicas.iter().map(|(a, _)| a.clone()).collect();
    }
}

/// Milliseconds to the microsecond: finer digits are noise.
fn millis(duration: Option<Duration>) -> Option<f64> {
    duration.map(|d| (d.as_secs_f64() * 1_000_000.0).round() / 1000.0)
}

/// One cluster's live result from `(replica, outcome)` pairs.
pub fn live_probe(outcomes: &[(String, ProbeOutcome)]) -> LiveProbe {
    let verdict = judge(outcomes);
    let slowest = outcomes
        .iter()
        .map(|(_, outcome)| outcome)
        .filter(|outcome| outcome.healthy())
        .filter_map(|outcome| outcome.total().map(|total| (total, outcome)))
        .max_by_key(|(total, _)| *total);
    let failures: Vec<&ProbeOutcome> = outcomes
        .iter()
        .map(|(_, outcome)| outcome)
        .filter(|outcome| !outcome.healthy())
        .collect();
    LiveProbe {
        healthy: verdict.reachable,
        reason: verdict.reason.to_owned(),
        replicas: verdict.key.replicas,
        latency_ms: millis(slowest.map(|(total, _)| total)),
        dial_ms: slowest.and_then(|(_, o)| millis(o.dial)),
        tls_ms: slowest.and_then(|(_, o)| millis(o.tls)),
        first_byte_ms: slowest.and_then(|(_, o)| millis(o.first_byte)),
        status: verdict.key.status,
        timed_out: !failures.is_empty()
            && failures.iter().all(|outcome| {
                outcome
                    .error
                    .as_deref()
                    .is_some_and(|error| error.contains("timed out"))
            }),
        error: outcomes.iter().find_map(|(replica, outcome)| {
            outcome
                .error
                .as_ref()
                .map(|error| format!("{replica}: {error}"))
        }),
    }
}

/// How `health` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Wide,
    Json,
    Yaml,
}

/// The report as `format`, ending with a newline.
pub fn render(report: &HealthReport, format: OutputFormat) -> Result<String, HealthError> {
    match format {
        OutputFormat::Table => Ok(table(report, false)),
        OutputFormat::Wide => Ok(table(report, true)),
        OutputFormat::Json => serde_json::to_string_pretty(report)
            .map(|mut text| {
                text.push('\n');
                text
            })
            .map_err(|e| HealthError::Serialize {
                format: "json",
                detail: e.to_string(),
            }),
        OutputFormat::Yaml => serde_saphyr::to_string(report).map_err(|e| HealthError::Serialize {
            format: "yaml",
            detail: e.to_string(),
        }),
    }
}

const NONE: &str = "<none>";

fn table(report: &HealthReport, wide: bool) -> String {
    let mut header = vec![
        "CLUSTER NAME",
        "INSTALLED",
        "AVAILABLE",
        "PROBED HEALTH",
        "LATENCY",
        "REACHABLE",
        "REPLICAS",
        "AGE",
    ];
    if wide {
        header.extend(["DIAL", "TLS", "FIRST BYTE", "ERROR"]);
    }
    let mut rows = vec![header.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>()];
    for cluster in &report.clusters {
        rows.push(row(cluster, report.probed, wide));
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|column| {
            rows.iter()
                .map(|r| r[column].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let last = row.len() - 1;
        for (column, cell) in row.iter().enumerate() {
            out.push_str(cell);
            if column < last {
                let pad = widths[column] - cell.chars().count() + 3;
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push('\n');
    }
    out
}

/// One table row. Without `--probe`, PROBED HEALTH and LATENCY show the
/// stored result (health-prober's last probe, AGE old at most since it
/// changed); with it, the live one.
fn row(cluster: &ClusterHealth, probed: bool, wide: bool) -> Vec<String> {
    let stored = cluster.reachability.as_ref();
    let live = cluster.probe.as_ref().filter(|_| probed);
    let (health, latency) = match (live, stored) {
        (Some(live), _) => (
            live.healthy.to_string(),
            match live.latency_ms {
                Some(ms) if live.healthy => format_ms(ms),
                _ if live.timed_out => "<timeout>".to_owned(),
                _ => NONE.to_owned(),
            },
        ),
        (None, Some(stored)) => (
            (stored.status == CONDITION_TRUE).to_string(),
            match stored.latency_ms {
                Some(ms) if stored.status == CONDITION_TRUE => format!("{ms}ms"),
                _ => NONE.to_owned(),
            },
        ),
        (None, None) => (NONE.to_owned(), NONE.to_owned()),
    };
    let mut cells = vec![
        cluster.name.clone(),
        cluster.installed.to_string(),
        cluster.available.to_string(),
        health,
        latency,
        stored.map_or(NONE.to_owned(), |s| s.reason.clone()),
        stored
            .and_then(|s| s.replicas.clone())
            .unwrap_or_else(|| NONE.to_owned()),
        stored
            .and_then(|s| s.age_seconds)
            .map_or(NONE.to_owned(), human_age),
    ];
    if wide {
        let phases = match (live, stored) {
            (Some(live), _) => {
                [live.dial_ms, live.tls_ms, live.first_byte_ms].map(|p| p.map(format_ms))
            }
            (None, Some(stored)) => [stored.dial_ms, stored.tls_ms, stored.first_byte_ms]
                .map(|p| p.map(|ms| format!("{ms}ms"))),
            (None, None) => [None, None, None],
        };
        cells.extend(phases.map(|p| p.unwrap_or_else(|| NONE.to_owned())));
        let error = match (live, stored) {
            (Some(live), _) => live.error.clone(),
            (None, Some(stored)) => stored.error.clone(),
            (None, None) => None,
        };
        cells.push(error.unwrap_or_else(|| NONE.to_owned()));
    }
    cells
}

/// Milliseconds as `0.42ms`, `3.1ms` or `250ms`.
pub fn format_ms(ms: f64) -> String {
    if ms < 1.0 {
        format!("{ms:.2}ms")
    } else if ms < 10.0 {
        format!("{ms:.1}ms")
    } else {
        format!("{ms:.0}ms")
    }
}

/// An age as kubectl prints one (`45s`, `3m20s`, `2h`, `5d`).
pub fn human_age(seconds: i64) -> String {
    let s = seconds.max(0);
    let (m, h, d) = (s / 60, s / 3600, s / 86_400);
    if s < 120 {
        format!("{s}s")
    } else if m < 10 {
        match s % 60 {
            0 => format!("{m}m"),
            rest => format!("{m}m{rest}s"),
        }
    } else if h < 3 {
        format!("{m}m")
    } else if h < 8 {
        match m % 60 {
            0 => format!("{h}h"),
            rest => format!("{h}h{rest}m"),
        }
    } else if h < 48 {
        format!("{h}h")
    } else if d < 8 {
        match h % 24 {
            0 => format!("{d}d"),
            rest => format!("{d}d{rest}h"),
        }
    } else if d < 365 * 2 {
        format!("{d}d")
    } else {
        format!("{}y", d / 365)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        assert_eq!(human_age(-5), "0s");
        assert_eq!(human_age(45), "45s");
        assert_eq!(human_age(119), "119s");
        assert_eq!(human_age(200), "3m20s");
        assert_eq!(human_age(600), "10m");
        assert_eq!(human_age(3 * 3600 + 120), "3h2m");
        assert_eq!(human_age(9 * 3600), "9h");
        assert_eq!(human_age(3 * 86_400 + 3600), "3d1h");
        assert_eq!(human_age(30 * 86_400), "30d");
        assert_eq!(human_age(800 * 86_400), "2y");
    }

    #[test]
    fn a_prober_message_comes_apart() {
        let stored = parse_message(
            r#"replicas=1/2 latency_ms=3 dial_ms=1 tls_ms=1 first_byte_ms=1 status=200 failing=a:1,b:1 error="a:1: dial: \"x\" y=z""#,
        );
        assert_eq!(stored.replicas.as_deref(), Some("1/2"));
        assert_eq!(stored.latency_ms, Some(3));
        assert_eq!(stored.http_status, Some(200));
        assert_eq!(stored.failing, ["a:1", "b:1"]);
        assert_eq!(stored.error.as_deref(), Some(r#"a:1: dial: "x" y=z"#));
        let odd = parse_message("free text without=structure");
        assert_eq!(odd.replicas, None);
        assert_eq!(odd.error, None);
    }

    #[test]
    fn milliseconds_keep_useful_precision() {
        assert_eq!(format_ms(0.4219), "0.42ms");
        assert_eq!(format_ms(3.04), "3.0ms");
        assert_eq!(format_ms(250.4), "250ms");
    }
}
