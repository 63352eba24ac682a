//! Prometheus metrics, named as upstream's `konnectivity_network_proxy_server_*`
//! where one exists. Counters on the data path are resolved once up front so
//! that counting a packet is a single atomic add.

use cluster_proxy_proto::status::go_code_name;
use cluster_proxy_runtime::accept::{AcceptGuard, Outcome};
use cluster_proxy_runtime::metrics::{StreamMetrics, encode_registry, register_counter};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, &'static str)>;

pub use cluster_proxy_runtime::metrics::Segment;

/// Upstream's `latencyBuckets` for the server's latency histograms.
const LATENCY_BUCKETS: [f64; 9] = [
    0.000_001, 0.000_01, 0.000_1, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5,
];

pub struct Metrics {
    registry: Registry,
    pub dial_duration: Histogram,
    /// How long writing one packet's bytes to a client took (HTTP CONNECT:
    /// the socket write; gRPC: from handing the packet to tonic until tonic
    /// asked for the next, which is when it had encoded and buffered it).
    pub frontend_write_duration: Histogram,
    dial_failures: Family<Labels, Counter>,
    pub pending_dials: Gauge,
    pub established: Gauge,
    /// How long established connections lived, observed when they close.
    pub connection_duration: Histogram,
    /// Upstream's lease garbage collector's count; there is no lease
    /// controller here, so it stays 0 for dashboards that sum it.
    pub culled_leases: Counter,
    grpc_connections: Family<Labels, Gauge>,
    pub http_connections: Gauge,
    ready_backends: Family<Labels, Gauge>,
    /// Upstream's deprecated total of connected agents (`ready_backends`
    /// of the `default` strategy).
    pub ready_backend_connections: Gauge,
    /// Streams whose bytes towards the other side wait for room (upstream:
    /// a full receive channel), by service method (`Proxy`, `Connect`).
    full_receive_channels: Family<Labels, Gauge>,
    pub agent_tunnels: Gauge,
    /// The replica count this replica tells agents.
    pub server_count: Gauge,
    /// Failed lookups of the peer replicas (`--server-count-source`).
    pub peer_lookup_failures: Counter,
    /// Times a configured bound refused or dropped something, by `limit`.
    limited: Family<Labels, Counter>,
    /// Connections whose TLS handshake failed, by `listener` and `reason`.
    tls_handshake_failures: Family<Labels, Counter>,
    /// Completed TLS handshakes, by `listener` and `kind` (full, resumed).
    tls_handshakes: Family<Labels, Counter>,
    /// Dials that carried early data, by who delivered it (`delivered_by`).
    early_data_dials: Family<Labels, Counter>,
    /// Failed `accept()` calls, by `port` and `reason`.
    accept_errors: Family<Labels, Counter>,
    /// Connections closed unserved because descriptors ran out, by `port`.
    accept_refused: Family<Labels, Counter>,
    /// Unknown connection ids whose CLOSE_RSP the server awaits, summed
    /// over tunnels (bounded by `--max-stray-closes-per-tunnel` each).
    pub stray_close_backlog: Gauge,
    /// Spans agents relayed through their tunnels, by `outcome` (counted
    /// by the forwarder, see `cluster_proxy_runtime::telemetry::relay`).
    relayed_spans: Family<Labels, Counter>,
    /// Relayed span batches refused before their spans were counted, by
    /// `reason`.
    relayed_batches_rejected: Family<Labels, Counter>,
    stream: StreamMetrics,
}

impl Metrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("konnectivity_network_proxy_server");
        let dial_duration = Histogram::new(LATENCY_BUCKETS);
        registry.register(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
            dial_duration.clone(),
        );
        let frontend_write_duration = Histogram::new(LATENCY_BUCKETS);
        registry.register(
            "frontend_write_duration_seconds",
            "Latency of write to the frontend in seconds",
            frontend_write_duration.clone(),
        );
        let dial_failures = Family::<Labels, Counter>::default();
        register_counter(
            registry,
            "dial_failure_count",
            "Number of dial failures observed. Multiple failures can occur for a single dial request.",
            dial_failures.clone(),
        );
        let pending_dials = Gauge::default();
        registry.register(
            "pending_backend_dials",
            "Current number of pending backend dial requests",
            pending_dials.clone(),
        );
        let established = Gauge::default();
        registry.register(
            "established_connections",
            "Current number of established end-to-end connections (post-dial).",
            established.clone(),
        );
        // Upstream's buckets: 1 s to a day.
        let connection_duration = Histogram::new([
            1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 43200.0, 86400.0,
        ]);
        registry.register(
            "connection_duration_seconds",
            "Duration in seconds a proxied end-to-end connection was established (post-dial) before being closed.",
            connection_duration.clone(),
        );
        let culled_leases = Counter::default();
        register_counter(
            registry,
            "culled_leases_count",
            "Count of expired leases that the lease garbage collection controller has culled.",
            culled_leases.clone(),
        );
        let grpc_connections = Family::<Labels, Gauge>::default();
        registry.register(
            "grpc_connections",
            "Number of current grpc connections, partitioned by service method.",
            grpc_connections.clone(),
        );
        let http_connections = Gauge::default();
        registry.register(
            "http_connections",
            "Number of current HTTP CONNECT connections",
            http_connections.clone(),
        );
        let ready_backends = Family::<Labels, Gauge>::default();
        registry.register(
            "ready_backends",
            "Number of konnectivity agent connected to the proxy server",
            ready_backends.clone(),
        );
        let ready_backend_connections = Gauge::default();
        registry.register(
            "ready_backend_connections",
            "Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends",
            ready_backend_connections.clone(),
        );
        let full_receive_channels = Family::<Labels, Gauge>::default();
        registry.register(
            "full_receive_channels",
            "Number of current connections blocked by a full receive channel, partitioned by service method.",
            full_receive_channels.clone(),
        );
        let stream = StreamMetrics::register(
            registry,
            &[
                Segment::FromClient,
                Segment::ToClient,
                Segment::FromAgent,
                Segment::ToAgent,
            ],
        );
        // Ours, under our own prefix: upstream has no such metric.
        let agent_tunnels = Gauge::default();
        let ours = root.sub_registry_with_prefix("cluster_proxy_server");
        ours.register(
            "agent_tunnels",
            "Connected agent tunnels (gRPC Connect streams)",
            agent_tunnels.clone(),
        );
        let server_count = Gauge::default();
        ours.register(
            "server_count",
            "Proxy-server replicas this replica tells agents to hold a tunnel to (servercount)",
            server_count.clone(),
        );
        let peer_lookup_failures = Counter::default();
        register_counter(
            ours,
            "peer_lookup_failures",
            "Failed lookups of the proxy-server replicas (--server-count-source); the last count is kept",
            peer_lookup_failures.clone(),
        );
        let limited = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "limited_total",
            "Packets, streams, tunnels or dials refused or dropped because a configured bound (the limit label, named as its flag) was reached",
            limited.clone(),
        );
        let tls_handshake_failures = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "tls_handshake_failures",
            "Connections to a TLS port (the listener label: client, agent) closed without a usable TLS session, by reason: error (a failed handshake, e.g. an unknown CA or an expired certificate, or a peer closing before it finished, as TCP health checks do), timeout, expired_resumed_session (a resumed session whose client certificate has expired since)",
            tls_handshake_failures.clone(),
        );
        let tls_handshakes = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "tls_handshakes",
            "Completed TLS handshakes on a TLS port (the listener label: client, agent), by kind: full (the peer's certificate chain verified, a signature made and checked) or resumed (a session ticket of this replica's brought the verified identity back, at a fraction of the CPU); a reconnect storm's cost",
            tls_handshakes.clone(),
        );
        let early_data_dials = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "early_data_dials",
            "Established connections whose client sent early data (its first bytes with the dial request), by who delivered the bytes to the target: agent (in the dial request, to an agent that advertised the extension) or server (as the first DATA: an agent without the extension, or more than a dial request carries)",
            early_data_dials.clone(),
        );
        let accept_errors = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "accept_errors",
            "Failed accept() calls on a port (the port label: client, agent, health, admin), by reason: process_open_file_limit (EMFILE: this process is at its open-file limit), system_open_file_limit (ENFILE), no_memory, connection_aborted (the connection ended while queued), other",
            accept_errors.clone(),
        );
        let accept_refused = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "accept_refused",
            "Connections to a port (the port label) accepted and closed at once, unserved, because the process had run out of descriptors (a clear refusal instead of a wait in the listen queue)",
            accept_refused.clone(),
        );
        let stray_close_backlog = Gauge::default();
        ours.register(
            "stray_close_backlog",
            "Unknown connection ids the server asked agents to close and awaits CLOSE_RSP for",
            stray_close_backlog.clone(),
        );
        let relayed_spans = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "relayed_spans_total",
            "Spans agents without a collector of their own sent through their tunnels (the span relay), by outcome: exported (the collector took them), export_failed (the export failed or timed out), queue_full (the forwarder held as many batches as it may; dropped)",
            relayed_spans.clone(),
        );
        let relayed_batches_rejected = Family::<Labels, Counter>::default();
        register_counter(
            ours,
            "relayed_span_batches_rejected_total",
            "Span batches from agents refused unread, by reason: malformed (not an OTLP ExportTraceServiceRequest), too_large (over 256 KiB), not_negotiated (on a tunnel that did not negotiate the span relay)",
            relayed_batches_rejected.clone(),
        );
        Metrics {
            registry: root,
            dial_duration,
            frontend_write_duration,
            dial_failures,
            pending_dials,
            established,
            connection_duration,
            culled_leases,
            grpc_connections,
            http_connections,
            ready_backends,
            ready_backend_connections,
            full_receive_channels,
            agent_tunnels,
            server_count,
            peer_lookup_failures,
            limited,
            tls_handshake_failures,
            tls_handshakes,
            early_data_dials,
            accept_errors,
            accept_refused,
            stray_close_backlog,
            relayed_spans,
            relayed_batches_rejected,
            stream,
        }
    }

    pub fn packet(&self, segment: Segment, type_name: &str) {
        self.stream.packet(segment, type_name);
    }

    /// A stream failed while receiving, so no packet is known (upstream's
    /// `ObserveStreamErrorNoPacket`: packet type `Unknown`).
    pub fn stream_error_no_packet(&self, segment: Segment, code: tonic::Code) {
        self.stream.error_no_packet(segment, go_code_name(code));
    }

    /// Counts a stream of `method` as blocked while the guard lives.
    pub fn full_receive_channel(&self, method: &'static str) -> GaugeGuard {
        GaugeGuard::new(
            self.full_receive_channels
                .get_or_create(&vec![("service_method", method)])
                .clone(),
        )
    }

    /// The family the span forwarder counts relayed spans in, by `outcome`.
    pub fn relayed_spans(&self) -> Family<Labels, Counter> {
        self.relayed_spans.clone()
    }

    /// A relayed span batch was refused for `reason`.
    pub fn relayed_batch_rejected(&self, reason: &'static str) {
        self.relayed_batches_rejected
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    /// A bound named `limit` (its flag without `--max-`) refused or dropped something.
    pub fn limited(&self, limit: &'static str) {
        self.limited.get_or_create(&vec![("limit", limit)]).inc();
    }

    /// A connection to the TLS port `listener` ended without a usable TLS
    /// session, for `reason`.
    pub fn tls_handshake_failed(&self, listener: &'static str, reason: &'static str) {
        self.tls_handshake_failures
            .get_or_create(&vec![("listener", listener), ("reason", reason)])
            .inc();
    }

    /// A TLS handshake on the port `listener` completed, `resumed` or full.
    pub fn tls_handshake_completed(&self, listener: &'static str, resumed: bool) {
        let kind = if resumed { "resumed" } else { "full" };
        self.tls_handshakes
            .get_or_create(&vec![("listener", listener), ("kind", kind)])
            .inc();
    }

    /// The guard of the accept loop of `port`, counting in these metrics.
    pub fn accept_guard(self: &std::sync::Arc<Self>, port: &'static str) -> AcceptGuard {
        let metrics = self.clone();
        AcceptGuard::new(port).counting(move |port, reason, outcome| {
            let counter = match outcome {
                Outcome::Failed => metrics
                    .accept_errors
                    .get_or_create(&vec![("port", port), ("reason", reason)])
                    .clone(),
                Outcome::Refused => metrics
                    .accept_refused
                    .get_or_create(&vec![("port", port)])
                    .clone(),
            };
            counter.inc();
        })
    }

    /// A connection was established with early data, delivered to the target
    /// by the agent or by this server.
    pub fn early_data_dial(&self, delivered_by_agent: bool) {
        let by = if delivered_by_agent {
            "agent"
        } else {
            "server"
        };
        self.early_data_dials
            .get_or_create(&vec![("delivered_by", by)])
            .inc();
    }

    pub fn dial_failed(&self, reason: &'static str) {
        self.dial_failures
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    pub fn grpc_stream(&self, method: &'static str) -> GaugeGuard {
        let gauge = self
            .grpc_connections
            .get_or_create(&vec![("service_method", method)])
            .clone();
        GaugeGuard::new(gauge)
    }

    /// An established connection closed after `lived`.
    pub fn connection_closed(&self, lived: std::time::Duration) {
        self.established.dec();
        self.connection_duration.observe(lived.as_secs_f64());
    }

    pub fn set_ready_backends(&self, strategy: &'static str, n: usize) {
        self.ready_backends
            .get_or_create(&vec![("proxy_strategy", strategy)])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// The OpenMetrics text exposition (`/metrics` converts it to the
    /// Prometheus text format unless asked for OpenMetrics).
    pub fn encode(&self) -> String {
        encode_registry(&self.registry)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

pub use cluster_proxy_runtime::metrics::GaugeGuard;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_errors_carry_gos_code_names() {
        let m = Metrics::new();
        m.stream_error_no_packet(Segment::FromAgent, tonic::Code::Cancelled);
        m.stream_error_no_packet(Segment::FromClient, tonic::Code::Unavailable);
        let text = cluster_proxy_runtime::metrics::to_prometheus_text(&m.encode());
        for line in [
            "# TYPE konnectivity_network_proxy_server_stream_errors_total counter",
            r#"konnectivity_network_proxy_server_stream_errors_total{segment="from_agent",code="Canceled",packet_type="Unknown"} 1"#,
            r#"konnectivity_network_proxy_server_stream_errors_total{segment="from_client",code="Unavailable",packet_type="Unknown"} 1"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
    }

    #[test]
    fn a_blocked_stream_counts_while_it_waits() {
        let m = Metrics::new();
        let line =
            r#"konnectivity_network_proxy_server_full_receive_channels{service_method="Proxy"}"#;
        let value = |m: &Metrics| {
            let text = cluster_proxy_runtime::metrics::to_prometheus_text(&m.encode());
            text.lines()
                .find_map(|l| l.strip_prefix(line).map(|v| v.trim().to_owned()))
        };
        assert_eq!(value(&m), None, "exported before any stream blocked");
        let blocked = m.full_receive_channel("Proxy");
        assert_eq!(value(&m).as_deref(), Some("1"));
        drop(blocked);
        assert_eq!(value(&m).as_deref(), Some("0"));
    }
}
