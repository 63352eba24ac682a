//! Prometheus metrics, named as upstream's `konnectivity_network_proxy_server_*`
//! where one exists. Counters on the data path are resolved once up front so
//! that counting a packet is a single atomic add.

use cluster_proxy_runtime::metrics::{encode_registry, register_counter};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, &'static str)>;

/// A gRPC code as Go's `codes.Code.String()` names it (tonic's Debug
/// spells `Cancelled`; Go and upstream's label say `Canceled`).
pub fn go_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// Where a packet crossed the server.
#[derive(Debug, Clone, Copy)]
pub enum Segment {
    FromClient = 0,
    ToClient = 1,
    FromAgent = 2,
    ToAgent = 3,
}

const SEGMENTS: [&str; 4] = ["from_client", "to_client", "from_agent", "to_agent"];
const PACKET_TYPES: [&str; 10] = [
    "DIAL_REQ",
    "DIAL_RSP",
    "CLOSE_REQ",
    "CLOSE_RSP",
    "DATA",
    "DIAL_CLS",
    "DRAIN",
    "WINDOW_UPDATE",
    "SERVER_COUNT",
    "UNKNOWN",
];

pub struct Metrics {
    registry: Registry,
    pub dial_duration: Histogram,
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
    pub agent_tunnels: Gauge,
    /// The replica count this replica tells agents.
    pub server_count: Gauge,
    /// Failed lookups of the peer replicas (`--server-count-source`).
    pub peer_lookup_failures: Counter,
    /// gRPC stream errors by segment, Go's code name and packet type.
    pub stream_errors: Family<Labels, Counter>,
    packets: Vec<Vec<Counter>>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("konnectivity_network_proxy_server");
        let dial_duration = Histogram::new([
            0.000_001, 0.000_01, 0.000_1, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5,
        ]);
        registry.register(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
            dial_duration.clone(),
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
        let packet_family = Family::<Labels, Counter>::default();
        register_counter(
            registry,
            "stream_packets_total",
            "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)",
            packet_family.clone(),
        );
        let packets = SEGMENTS
            .iter()
            .map(|segment| {
                PACKET_TYPES
                    .iter()
                    .map(|kind| {
                        packet_family
                            .get_or_create(&vec![("segment", *segment), ("packet_type", *kind)])
                            .clone()
                    })
                    .collect()
            })
            .collect();
        let stream_errors = Family::<Labels, Counter>::default();
        register_counter(
            registry,
            "stream_errors_total",
            "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)",
            stream_errors.clone(),
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
        Metrics {
            registry: root,
            dial_duration,
            dial_failures,
            pending_dials,
            established,
            connection_duration,
            culled_leases,
            grpc_connections,
            http_connections,
            ready_backends,
            agent_tunnels,
            server_count,
            peer_lookup_failures,
            stream_errors,
            packets,
        }
    }

    pub fn packet(&self, segment: Segment, type_name: &str) {
        let kind = PACKET_TYPES
            .iter()
            .position(|t| *t == type_name)
            .unwrap_or(PACKET_TYPES.len() - 1);
        self.packets[segment as usize][kind].inc();
    }

    /// A stream failed while receiving, so no packet is known (upstream's
    /// `ObserveStreamErrorNoPacket`: packet type `Unknown`).
    pub fn stream_error_no_packet(&self, segment: Segment, code: tonic::Code) {
        self.stream_errors
            .get_or_create(&vec![
                ("segment", SEGMENTS[segment as usize]),
                ("code", go_code_name(code)),
                ("packet_type", "Unknown"),
            ])
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
}
