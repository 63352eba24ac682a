//! The hub controller's Prometheus metrics.

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a reconcile ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReconcileResult {
    /// Every object applied and the status written.
    Success,
    /// The spec is invalid: a `False` condition was written, nothing applied.
    Invalid,
    /// An API call failed; the object is retried with backoff.
    Error,
}

impl ReconcileResult {
    /// The `result` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReconcileResult::Success => "success",
            ReconcileResult::Invalid => "invalid",
            ReconcileResult::Error => "error",
        }
    }
}

impl EncodeLabelValue for ReconcileResult {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: ReconcileResult,
}

/// Cheap to clone: every clone counts into the same metrics.
#[derive(Debug, Clone)]
pub struct HubMetrics {
    reconciles: Family<ResultLabels, Counter>,
    duration: Histogram,
}

impl Default for HubMetrics {
    fn default() -> Self {
        HubMetrics {
            reconciles: Family::default(),
            duration: Histogram::new([
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        }
    }
}

impl HubMetrics {
    /// New metrics, registered in `registry` under `addon_manager_hub_`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = HubMetrics::default();
        let registry = registry.sub_registry_with_prefix("addon_manager_hub");
        registry.register(
            "reconciles",
            "Reconciles of ManagedProxyConfigurations into proxy-server objects, by result (success, invalid, error)",
            metrics.reconciles.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "How long one reconcile of a ManagedProxyConfiguration took",
            metrics.duration.clone(),
        );
        metrics
    }

    /// Counts one reconcile that took `elapsed` and ended in `result`.
    pub fn observe(&self, result: ReconcileResult, elapsed: Duration) {
        self.reconciles
            .get_or_create(&ResultLabels { result })
            .inc();
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// Reconciles so far that ended in `result`.
    pub fn reconciles(&self, result: ReconcileResult) -> u64 {
        self.reconciles
            .get_or_create(&ResultLabels { result })
            .get()
    }
}
