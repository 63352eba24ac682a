//! Prometheus exposition and the one naming rule every service follows.
//!
//! Metric names keep upstream's (`konnectivity_network_proxy_server_*`,
//! `konnectivity_network_proxy_agent_*`) so dashboards keep working.
//! prometheus-client writes OpenMetrics, which requires counters to end in
//! `_total` and appends it itself: a counter is therefore registered through
//! [`register_counter`], which takes its name with or without the suffix and
//! always exposes exactly one `_total`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};

/// The content type of [`encode_registry`]'s output.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The OpenMetrics text of `registry`.
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
    use prometheus_client::metrics::counter::Counter;

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
