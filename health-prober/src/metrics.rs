//! The prober's Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabel {
    pub cluster: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

fn phase_histogram() -> Histogram {
    // 1 ms .. ~16 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// Cheap to clone; every clone updates the same series.
#[derive(Clone)]
pub struct ProberMetrics {
    pub probe_duration: Family<PhaseLabel, Histogram, fn() -> Histogram>,
    pub cluster_reachable: Family<ClusterLabel, Gauge>,
    pub probes: Family<ResultLabel, Counter>,
    pub status_writes: Counter,
    pub round_duration: Histogram,
    /// Live probers this replica shares the clusters with, itself included.
    pub members: Gauge,
    /// Clusters this replica probed in its last round.
    pub shard_clusters: Gauge,
}

impl Default for ProberMetrics {
    fn default() -> Self {
        ProberMetrics {
            probe_duration: Family::new_with_constructor(phase_histogram),
            cluster_reachable: Family::default(),
            probes: Family::default(),
            status_writes: Counter::default(),
            round_duration: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            members: Gauge::default(),
            shard_clusters: Gauge::default(),
        }
    }
}

impl ProberMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "health_prober_probe_duration_seconds",
            "Duration of each probe phase (dial through the tunnel, TLS handshake, first byte of /healthz)",
            self.probe_duration.clone(),
        );
        registry.register(
            "health_prober_cluster_reachable",
            "1 when every proxy-server replica reaches the cluster's kube-apiserver, else 0 (degraded or unreachable)",
            self.cluster_reachable.clone(),
        );
        registry.register(
            "health_prober_probes",
            "Probes by result (success, failure), one per cluster and replica",
            self.probes.clone(),
        );
        registry.register(
            "health_prober_status_writes",
            "ClusterProxyReachable conditions written",
            self.status_writes.clone(),
        );
        registry.register(
            "health_prober_round_duration_seconds",
            "Duration of a probe round over this replica's clusters",
            self.round_duration.clone(),
        );
        registry.register(
            "health_prober_members",
            "Live health-prober replicas sharing the clusters as this replica last saw them, itself included (0 before it joined)",
            self.members.clone(),
        );
        registry.register(
            "health_prober_shard_clusters",
            "Clusters this replica probed in its last round: its share of every cluster with the add-on",
            self.shard_clusters.clone(),
        );
    }
}
