//! Prometheus exposition and the one naming rule every service follows.
//!
//! Metric names keep upstream's (`konnectivity_network_proxy_server_*`,
//! `konnectivity_network_proxy_agent_*`) so dashboards keep working.
//! prometheus-client writes OpenMetrics, which requires counters to end in
//! `_total` and appends it itself: a counter is therefore registered through
//! [`register_counter`], which takes its name with or without the suffix and
//! always exposes exactly one `_total`.
//!
//! `/metrics` answers in the Prometheus text format (0.0.4) by default, as
//! upstream's Go binaries do, and in OpenMetrics only when the request's
//! `Accept` asks for it ([`wants_openmetrics`]). [`to_prometheus_text`]
//! derives the former from prometheus-client's OpenMetrics: counters are
//! typed `counter` under the name their samples carry (`x_total`, or the bare
//! name for upstream's counters without the suffix, [`BARE_COUNTERS`]), HELP
//! texts are the registered ones (prometheus-client appends a period), and
//! `# EOF`, `# UNIT` and `_created` samples are dropped.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};

/// The content type of [`encode_registry`]'s output.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of [`to_prometheus_text`]'s output.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Upstream counters whose names do not end in `_total` (Go's client allows
/// it, OpenMetrics does not): in the Prometheus text format they keep the
/// bare name dashboards and alerts use.
pub const BARE_COUNTERS: &[&str] = &[
    "konnectivity_network_proxy_server_dial_failure_count",
    "konnectivity_network_proxy_server_culled_leases_count",
    "konnectivity_network_proxy_agent_server_connection_failure_count",
];

/// Whether an `Accept` header asks for OpenMetrics (listed with a non-zero q).
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|accept| {
        accept.split(',').any(|range| {
            let mut params = range.split(';').map(str::trim);
            let media = params.next().unwrap_or_default();
            let refused = params.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
        })
    })
}

/// The Prometheus text format (0.0.4) of prometheus-client's OpenMetrics
/// `text` (see the module docs).
pub fn to_prometheus_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut help: Option<(&str, &str)> = None;
    // For the current counter family: its OpenMetrics sample name, the
    // name exposed instead, and the `_created` samples to drop.
    let mut counter: Option<(String, String, String)> = None;
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text.strip_suffix('.').unwrap_or(text)));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (exposed, kind) = match kind {
                "counter" => {
                    let exposed = if BARE_COUNTERS.contains(&name) {
                        name.to_owned()
                    } else {
                        format!("{name}_total")
                    };
                    counter = Some((
                        format!("{name}_total"),
                        exposed.clone(),
                        format!("{name}_created"),
                    ));
                    (exposed, "counter")
                }
                "gauge" | "histogram" | "summary" => {
                    counter = None;
                    (name.to_owned(), kind)
                }
                _ => {
                    counter = None;
                    (name.to_owned(), "untyped")
                }
            };
            if let Some((_, text)) = help.take().filter(|(n, _)| *n == name) {
                out.push_str(&format!("# HELP {exposed} {text}\n"));
            }
            out.push_str(&format!("# TYPE {exposed} {kind}\n"));
            continue;
        }
        if let Some((sample, exposed, created)) = &counter {
            if sample_of(line, created) {
                continue;
            }
            if sample_of(line, sample) {
                out.push_str(&go_floats(&format!("{exposed}{}", &line[sample.len()..])));
                out.push('\n');
                continue;
            }
        }
        out.push_str(&go_floats(line));
        out.push('\n');
    }
    out
}

/// A sample line with its floats written as Go's client writes them
/// (`strconv.FormatFloat(v, 'g', -1, 64)`): `le="10"` not `le="10.0"`,
/// `1e-06` not `0.000001`. Series differ by the exact `le` text, so a
/// dashboard or alert naming a bucket must see upstream's spelling.
fn go_floats(line: &str) -> String {
    let mut line = line.to_owned();
    for label in ["le=\"", "quantile=\""] {
        let Some(start) = line.find(label).map(|i| i + label.len()) else {
            continue;
        };
        let Some(len) = line[start..].find('"') else {
            continue;
        };
        if let Ok(v) = line[start..start + len].parse::<f64>() {
            line.replace_range(start..start + len, &go_float(v));
        }
    }
    let value = line
        .rsplit_once(' ')
        .filter(|(_, value)| value.contains(['.', 'e']))
        .and_then(|(series, value)| Some((series, value.parse::<f64>().ok()?)));
    match value {
        Some((series, v)) => format!("{series} {}", go_float(v)),
        None => line,
    }
}

/// Go's `strconv.FormatFloat(v, 'g', -1, 64)`, with Prometheus' `+Inf`.
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    if v == 0.0 {
        return "0".into();
    }
    let scientific = format!("{v:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    // Go: %e when the exponent is below -4 or at least the shortest
    // precision's 6 (then at least two exponent digits, with a sign).
    if !(-4..6).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    } else {
        format!("{v}")
    }
}

/// Whether `line` is a sample of the metric named exactly `name`.
fn sample_of(line: &str, name: &str) -> bool {
    line.strip_prefix(name)
        .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
}

/// The OpenMetrics text of `registry`.
/// Registers the gauge a leader-electing controller sets to 1 while it
/// leads and 0 otherwise.
pub fn register_leader_gauge(
    registry: &mut Registry,
    name: &str,
    help: &str,
) -> prometheus_client::metrics::gauge::Gauge<i64> {
    let leader = prometheus_client::metrics::gauge::Gauge::<i64>::default();
    registry.register(name, help, leader.clone());
    leader
}

pub fn encode_registry(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

/// Registers a counter (or a family of counters) as `<name>_total`, whether
/// `name` is given with the suffix or without.
pub fn register_counter(registry: &mut Registry, name: &str, help: &str, counter: impl Metric) {
    let base = name.strip_suffix("_total").unwrap_or(name);
    registry.register(base, help, counter);
}

/// Where a packet crossed the tunnel, as upstream's `segment` label names it:
/// the server sees all four; an agent sends `from_agent` and receives
/// `to_agent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    FromClient = 0,
    ToClient = 1,
    FromAgent = 2,
    ToAgent = 3,
}

const SEGMENTS: [&str; 4] = ["from_client", "to_client", "from_agent", "to_agent"];
const PACKET_TYPES: [&str; 11] = [
    "DIAL_REQ",
    "DIAL_RSP",
    "CLOSE_REQ",
    "CLOSE_RSP",
    "DATA",
    "DIAL_CLS",
    "DRAIN",
    "WINDOW_UPDATE",
    "SERVER_COUNT",
    "SPAN_BATCH",
    "UNKNOWN",
];

type Labels = Vec<(&'static str, &'static str)>;

/// Upstream's `stream_packets_total{segment,packet_type}` and
/// `stream_errors_total{segment,code,packet_type}`, shared by server and
/// agent. The counters of the segments a service crosses are resolved once
/// (and exported from the start, at 0), so counting a packet on the data
/// path is one atomic add.
#[derive(Debug)]
pub struct StreamMetrics {
    family: Family<Labels, Counter>,
    packets: [Vec<Counter>; 4],
    errors: Family<Labels, Counter>,
}

impl StreamMetrics {
    /// Registers both families in `registry` (which carries the service's
    /// prefix), with the packet counters of `segments` resolved.
    pub fn register(registry: &mut Registry, segments: &[Segment]) -> Self {
        let family = Family::<Labels, Counter>::default();
        register_counter(
            registry,
            "stream_packets_total",
            "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)",
            family.clone(),
        );
        let mut packets: [Vec<Counter>; 4] = Default::default();
        for segment in segments {
            packets[*segment as usize] = PACKET_TYPES
                .iter()
                .map(|kind| {
                    family
                        .get_or_create(&vec![
                            ("segment", SEGMENTS[*segment as usize]),
                            ("packet_type", *kind),
                        ])
                        .clone()
                })
                .collect();
        }
        let errors = Family::<Labels, Counter>::default();
        register_counter(
            registry,
            "stream_errors_total",
            "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)",
            errors.clone(),
        );
        StreamMetrics {
            family,
            packets,
            errors,
        }
    }

    /// Counts a packet by its type name (`Frame::type_name`, `packet::type_name`).
    pub fn packet(&self, segment: Segment, type_name: &str) {
        let kind = PACKET_TYPES
            .iter()
            .position(|t| *t == type_name)
            .unwrap_or(PACKET_TYPES.len() - 1);
        match self.packets[segment as usize].get(kind) {
            Some(counter) => counter.inc(),
            // A segment the service did not resolve: the family's slow path.
            None => self
                .family
                .get_or_create(&vec![
                    ("segment", SEGMENTS[segment as usize]),
                    ("packet_type", PACKET_TYPES[kind]),
                ])
                .inc(),
        };
    }

    /// A stream failed while receiving, so no packet is known (upstream's
    /// `ObserveStreamErrorNoPacket`: packet type `Unknown`). `code` as Go
    /// names it (`cluster_proxy_proto::status::go_code_name`).
    pub fn error_no_packet(&self, segment: Segment, code: &'static str) {
        self.errors
            .get_or_create(&vec![
                ("segment", SEGMENTS[segment as usize]),
                ("code", code),
                ("packet_type", "Unknown"),
            ])
            .inc();
    }
}

/// Increments a gauge now and decrements it when dropped: counts what is open.
#[derive(Debug)]
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    pub fn new(gauge: Gauge) -> Self {
        gauge.inc();
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_get_exactly_one_total_suffix() {
        let mut registry = Registry::with_prefix("svc");
        let a = Counter::<u64>::default();
        let b = Counter::<u64>::default();
        register_counter(&mut registry, "dials", "Dials", a.clone());
        register_counter(&mut registry, "closes_total", "Closes", b.clone());
        a.inc();
        b.inc_by(2);
        let text = encode_registry(&registry);
        assert!(text.contains("svc_dials_total 1"), "{text}");
        assert!(text.contains("svc_closes_total 2"), "{text}");
        assert!(!text.contains("_total_total"), "{text}");
    }

    #[test]
    fn prometheus_text_types_counters_and_keeps_upstream_names() {
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::histogram::Histogram;
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("konnectivity_network_proxy_server");
        let failures = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        register_counter(
            registry,
            "dial_failure_count",
            "Number of dial failures observed. Multiple failures can occur for a single dial request.",
            failures.clone(),
        );
        let packets = Counter::<u64>::default();
        register_counter(
            registry,
            "stream_packets_total",
            "Count of packets",
            packets.clone(),
        );
        let open = Gauge::<i64>::default();
        registry.register(
            "http_connections",
            "Number of current HTTP CONNECT connections",
            open.clone(),
        );
        let latency = Histogram::new([0.5, 1.0]);
        registry.register(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
            latency.clone(),
        );
        failures.get_or_create(&vec![("reason", "no_agent")]).inc();
        packets.inc_by(3);
        open.set(2);
        latency.observe(0.7);
        let text = to_prometheus_text(&encode_registry(&root));
        assert_eq!(
            text,
            "# HELP konnectivity_network_proxy_server_dial_failure_count Number of dial failures observed. Multiple failures can occur for a single dial request.\n\
             # TYPE konnectivity_network_proxy_server_dial_failure_count counter\n\
             konnectivity_network_proxy_server_dial_failure_count{reason=\"no_agent\"} 1\n\
             # HELP konnectivity_network_proxy_server_stream_packets_total Count of packets\n\
             # TYPE konnectivity_network_proxy_server_stream_packets_total counter\n\
             konnectivity_network_proxy_server_stream_packets_total 3\n\
             # HELP konnectivity_network_proxy_server_http_connections Number of current HTTP CONNECT connections\n\
             # TYPE konnectivity_network_proxy_server_http_connections gauge\n\
             konnectivity_network_proxy_server_http_connections 2\n\
             # HELP konnectivity_network_proxy_server_dial_duration_seconds Latency of dial to the remote endpoint in seconds\n\
             # TYPE konnectivity_network_proxy_server_dial_duration_seconds histogram\n\
             konnectivity_network_proxy_server_dial_duration_seconds_sum 0.7\n\
             konnectivity_network_proxy_server_dial_duration_seconds_count 1\n\
             konnectivity_network_proxy_server_dial_duration_seconds_bucket{le=\"0.5\"} 0\n\
             konnectivity_network_proxy_server_dial_duration_seconds_bucket{le=\"1\"} 1\n\
             konnectivity_network_proxy_server_dial_duration_seconds_bucket{le=\"+Inf\"} 1\n"
        );
    }

    #[test]
    fn floats_are_written_as_gos_client_writes_them() {
        for (v, go) in [
            (10.0, "10"),
            (12.5, "12.5"),
            (0.000_001, "1e-06"),
            (0.000_01, "1e-05"),
            (0.000_1, "0.0001"),
            (0.005, "0.005"),
            (86_400.0, "86400"),
            (1_000_000.0, "1e+06"),
            (123_456_789.0, "1.23456789e+08"),
            (-2.5, "-2.5"),
            (0.0, "0"),
            (f64::INFINITY, "+Inf"),
        ] {
            assert_eq!(go_float(v), go, "{v}");
        }
        assert_eq!(
            go_floats("x_bucket{le=\"0.000001\"} 3"),
            "x_bucket{le=\"1e-06\"} 3"
        );
        assert_eq!(go_floats("x_sum 0.000012"), "x_sum 1.2e-05");
        assert_eq!(go_floats("x_count 12"), "x_count 12");
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(wants_openmetrics(Some(
            "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
        )));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=0, text/plain"
        )));
    }

    #[test]
    fn gauge_guards_count_what_is_open() {
        let gauge = Gauge::default();
        let first = GaugeGuard::new(gauge.clone());
        let second = GaugeGuard::new(gauge.clone());
        assert_eq!(gauge.get(), 2);
        drop(first);
        drop(second);
        assert_eq!(gauge.get(), 0);
    }
}
