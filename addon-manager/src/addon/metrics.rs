//! The addon controllers' Prometheus metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Prometheus metrics of the addon controllers.
#[derive(Debug, Clone, Default)]
pub struct AddonMetrics {
    reconciliations: Family<Vec<(String, String)>, Counter>,
    failures: Family<Vec<(String, String)>, Counter>,
    csr_decisions: Family<Vec<(String, String)>, Counter>,
    pub(super) pending_removals: Gauge,
    pub(super) rollout_waiting: Gauge,
}

impl AddonMetrics {
    /// Registers the metrics under `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "addon_reconciliations",
            "Reconciliations by controller",
            self.reconciliations.clone(),
        );
        registry.register(
            "addon_reconcile_failures",
            "Failed reconciliations by controller",
            self.failures.clone(),
        );
        registry.register(
            "addon_csr_decisions",
            "Proxy-agent CSRs seen, by decision (approved or left)",
            self.csr_decisions.clone(),
        );
        registry.register(
            "addon_pending_removals",
            "Installed addons whose cluster left the placements, waiting out the removal grace",
            self.pending_removals.clone(),
        );
        registry.register(
            "addon_rollout_waiting",
            "Clusters whose configuration change waits for its turn in a Progressive or ProgressivePerGroup rollout",
            self.rollout_waiting.clone(),
        );
    }

    fn label(controller: &str) -> Vec<(String, String)> {
        vec![("controller".to_owned(), controller.to_owned())]
    }

    pub(crate) fn reconciled(&self, controller: &str) {
        self.reconciliations
            .get_or_create(&Self::label(controller))
            .inc();
    }

    pub(crate) fn failed(&self, controller: &str) {
        self.failures.get_or_create(&Self::label(controller)).inc();
    }

    pub(crate) fn csr_decision(&self, decision: &str) {
        self.csr_decisions
            .get_or_create(&vec![("decision".to_owned(), decision.to_owned())])
            .inc();
    }

    /// Proxy-agent CSRs decided `decision` (`approved` or `left`) so far.
    pub fn csr_decision_count(&self, decision: &str) -> u64 {
        self.csr_decisions
            .get_or_create(&vec![("decision".to_owned(), decision.to_owned())])
            .get()
    }

    /// Installed addons waiting out the removal grace now.
    pub fn pending_removal_count(&self) -> i64 {
        self.pending_removals.get()
    }

    pub fn rollout_waiting_count(&self) -> i64 {
        self.rollout_waiting.get()
    }

    /// Reconciliations of `controller` so far (for tests and diagnostics).
    pub fn reconciliation_count(&self, controller: &str) -> u64 {
        self.reconciliations
            .get_or_create(&Self::label(controller))
            .get()
    }
}
