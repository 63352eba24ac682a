//! Prometheus metrics, named as upstream's `konnectivity_network_proxy_agent_*`
//! so existing dashboards keep working.

use cluster_proxy_proto::status::go_code_name;
pub use cluster_proxy_runtime::metrics::Segment;
use cluster_proxy_runtime::metrics::{StreamMetrics, encode_registry, register_counter};
use cluster_proxy_runtime::telemetry::relay::RelayCounters;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, &'static str)>;

/// Why an endpoint dial failed (upstream's label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialFailure {
    Timeout,
    Unknown,
}

impl DialFailure {
    pub(crate) fn label(self) -> &'static str {
        match self {
            DialFailure::Timeout => "timeout",
            DialFailure::Unknown => "unknown",
        }
    }
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub open_server_connections: Gauge,
    pub known_server_count: Gauge,
    pub open_endpoint_connections: Gauge,
    dial_failures: Family<Labels, Counter>,
    pub dial_duration: Histogram,
    /// Upstream's deprecated `server_connection_failure_count{direction}`.
    server_failures: Family<Labels, Counter>,
    stream: StreamMetrics,
    stray_replies_dropped: Counter,
    server_connect_failures: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self::with_relay(RelayCounters::default())
    }

    /// The metrics with `relay`'s counters of spans sent home through the
    /// tunnels (the span relay's queue counts them).
    pub fn with_relay(relay: RelayCounters) -> Self {
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("konnectivity_network_proxy_agent");
        let open_server_connections = Gauge::default();
        registry.register(
            "open_server_connections",
            "Current number of open server connections.",
            open_server_connections.clone(),
        );
        let known_server_count = Gauge::default();
        registry.register(
            "known_server_count",
            "Current number of servers agent is trying to connect to.",
            known_server_count.clone(),
        );
        let open_endpoint_connections = Gauge::default();
        registry.register(
            "open_endpoint_connections",
            "Current number of open endpoint connections.",
            open_endpoint_connections.clone(),
        );
        let dial_failures = Family::<Labels, Counter>::default();
        register_counter(
            registry,
            "endpoint_dial_failure_total",
            "Number of failures dialing the remote endpoint, by reason (example: timeout).",
            dial_failures.clone(),
        );
        let dial_duration = Histogram::new([0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 30.0]);
        registry.register(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
            dial_duration.clone(),
        );
        let server_failures = Family::<Labels, Counter>::default();
        register_counter(
            registry,
            "server_connection_failure_count",
            "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_events_error_total",
            server_failures.clone(),
        );
        let stream = StreamMetrics::register(registry, &[Segment::FromAgent, Segment::ToAgent]);
        let stray_replies_dropped = Counter::default();
        register_counter(
            root.sub_registry_with_prefix("cluster_proxy_agent"),
            "stray_replies_dropped_total",
            "Packets from a proxy-server for unknown connections left unanswered because the tunnel already answered its bound of unknown ids (1024 per 30 s).",
            stray_replies_dropped.clone(),
        );
        let server_connect_failures = Family::<Labels, Counter>::default();
        register_counter(
            root.sub_registry_with_prefix("cluster_proxy_agent"),
            "server_connect_failures_total",
            "Attempts to open a tunnel to a proxy-server that failed, by reason (proxy_unreachable, proxy_auth, proxy_refused, proxy_protocol, proxy_closed, proxy_tls, proxy_socks, proxy_config, resolve, dial, tls, timeout, protocol, rejected, token, config).",
            server_connect_failures.clone(),
        );
        let ours = root.sub_registry_with_prefix("cluster_proxy_agent");
        register_counter(
            ours,
            "relayed_spans_total",
            "Spans of the agent's own handed to a tunnel for the proxy-server to forward to its trace collector (the span relay: no collector of the agent's own, --trace-relay=auto).",
            relay.sent,
        );
        register_counter(
            ours,
            "relayed_spans_dropped_total",
            "Spans of the agent's own the span relay dropped, by reason: no_tunnel (no tunnel to a proxy-server that forwards spans), queue_full (32 batches waiting already), too_large (one span over 256 KiB encoded), tunnel_closed (the tunnel closed before sending the batch).",
            relay.dropped,
        );
        Metrics {
            registry: root,
            server_connect_failures,
            open_server_connections,
            known_server_count,
            open_endpoint_connections,
            dial_failures,
            dial_duration,
            server_failures,
            stream,
            stray_replies_dropped,
        }
    }

    pub fn dial_failed(&self, reason: DialFailure) {
        self.dial_failures
            .get_or_create(&vec![("reason", reason.label())])
            .inc();
    }

    /// An attempt to open a tunnel failed for `reason`.
    pub fn server_connect_failed(&self, reason: &'static str) {
        self.server_connect_failures
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    /// A packet for an unknown connection left unanswered (the bound bit).
    pub fn stray_reply_dropped(&self) {
        self.stray_replies_dropped.inc();
    }

    /// A packet sent to (`FromAgent`) or received from (`ToAgent`) a server.
    pub fn packet(&self, segment: Segment, type_name: &str) {
        self.stream.packet(segment, type_name);
    }

    /// Receiving from a server failed with `status` (the tunnel is lost).
    pub fn receive_failed(&self, status: &tonic::Status) {
        self.server_failures
            .get_or_create(&vec![("direction", "from_server")])
            .inc();
        self.stream
            .error_no_packet(Segment::ToAgent, go_code_name(status.code()));
    }

    /// The OpenMetrics text exposition (`/metrics` converts it to the
    /// Prometheus text format unless asked for OpenMetrics).
    pub fn encode(&self) -> String {
        encode_registry(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_upstream_names() {
        let m = Metrics::new();
        m.dial_failed(DialFailure::Timeout);
        m.open_server_connections.set(2);
        m.packet(Segment::ToAgent, "DIAL_REQ");
        m.receive_failed(&tonic::Status::cancelled("gone"));
        m.server_connect_failed("proxy_auth");
        let text = m.encode();
        for name in [
            "konnectivity_network_proxy_agent_open_server_connections 2",
            "konnectivity_network_proxy_agent_known_server_count",
            "konnectivity_network_proxy_agent_open_endpoint_connections",
            "konnectivity_network_proxy_agent_endpoint_dial_failure_total{reason=\"timeout\"} 1",
            "konnectivity_network_proxy_agent_dial_duration_seconds_bucket",
            "konnectivity_network_proxy_agent_stream_packets_total{segment=\"to_agent\",packet_type=\"DIAL_REQ\"} 1",
            "konnectivity_network_proxy_agent_stream_errors_total{segment=\"to_agent\",code=\"Canceled\",packet_type=\"Unknown\"} 1",
            "konnectivity_network_proxy_agent_server_connection_failure_count_total{direction=\"from_server\"} 1",
            "cluster_proxy_agent_server_connect_failures_total{reason=\"proxy_auth\"} 1",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }
}
