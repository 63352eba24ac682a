//! The addon-agent's Prometheus metrics.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// How one renewal attempt ended: the Lease renewed (`managed`, `hub`) or
/// `error`; or how one port-forward did (`opened`, `failed`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RenewalLabels {
    pub result: &'static str,
}

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    renewals: Family<RenewalLabels, Counter>,
    proxy_agent_ready: Gauge,
    port_forwards: Family<RenewalLabels, Counter>,
    port_forwards_active: Gauge,
    port_forward_pods: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let renewals = Family::<RenewalLabels, Counter>::default();
        cluster_proxy_runtime::metrics::register_counter(
            &mut registry,
            "addon_agent_lease_renewals_total",
            "Lease renewal attempts by result: managed or hub (the Lease renewed) or error.",
            renewals.clone(),
        );
        let proxy_agent_ready = Gauge::default();
        registry.register(
            "addon_agent_proxy_agent_ready",
            "1 while the proxy-agent reports ready (a tunnel to at least one proxy-server), else 0.",
            proxy_agent_ready.clone(),
        );
        let port_forwards = Family::<RenewalLabels, Counter>::default();
        cluster_proxy_runtime::metrics::register_counter(
            &mut registry,
            "addon_agent_port_forwards_total",
            "Port-forwards to proxy-server pods: opened (the hub API upgraded the connection), failed (no pod to forward to, refused by the API, or an error from the pod's port).",
            port_forwards.clone(),
        );
        let port_forwards_active = Gauge::default();
        registry.register(
            "addon_agent_port_forwards_active",
            "Connections of the proxy-agent being forwarded to a proxy-server pod now.",
            port_forwards_active.clone(),
        );
        let port_forward_pods = Gauge::default();
        registry.register(
            "addon_agent_port_forward_pods",
            "Running, not terminating proxy-server pods (ready or not) in the port-forward proxy's last list.",
            port_forward_pods.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            renewals,
            proxy_agent_ready,
            port_forwards,
            port_forwards_active,
            port_forward_pods,
        }
    }

    pub fn renewal(&self, result: &'static str) {
        self.renewals.get_or_create(&RenewalLabels { result }).inc();
    }

    pub fn renewals(&self, result: &'static str) -> u64 {
        self.renewals.get_or_create(&RenewalLabels { result }).get()
    }

    pub fn set_proxy_agent_ready(&self, ready: bool) {
        self.proxy_agent_ready.set(i64::from(ready));
    }

    pub fn proxy_agent_ready(&self) -> bool {
        self.proxy_agent_ready.get() == 1
    }

    /// A port-forward `opened` or `failed`.
    pub fn port_forward(&self, result: &'static str) {
        self.port_forwards
            .get_or_create(&RenewalLabels { result })
            .inc();
    }

    pub fn port_forwards(&self, result: &'static str) -> u64 {
        self.port_forwards
            .get_or_create(&RenewalLabels { result })
            .get()
    }

    pub(crate) fn forward_started(&self) {
        self.port_forwards_active.inc();
    }

    pub(crate) fn forward_closed(&self) {
        self.port_forwards_active.dec();
    }

    pub fn port_forwards_active(&self) -> i64 {
        self.port_forwards_active.get()
    }

    pub(crate) fn set_port_forward_pods(&self, pods: usize) {
        self.port_forward_pods
            .set(i64::try_from(pods).unwrap_or(i64::MAX));
    }

    /// The OpenMetrics exposition.
    pub fn encode(&self) -> String {
        cluster_proxy_runtime::metrics::encode_registry(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_as_documented() {
        let metrics = Metrics::new();
        metrics.renewal("hub");
        metrics.renewal("hub");
        metrics.renewal("error");
        metrics.set_proxy_agent_ready(true);
        metrics.port_forward("opened");
        metrics.forward_started();
        metrics.set_port_forward_pods(2);
        let text = metrics.encode();
        for line in [
            "addon_agent_lease_renewals_total{result=\"hub\"} 2",
            "addon_agent_lease_renewals_total{result=\"error\"} 1",
            "addon_agent_proxy_agent_ready 1",
            "addon_agent_port_forwards_total{result=\"opened\"} 1",
            "addon_agent_port_forwards_active 1",
            "addon_agent_port_forward_pods 2",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert_eq!(metrics.renewals("managed"), 0);
    }
}
