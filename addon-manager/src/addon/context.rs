//! What the controllers' reconcilers share: the client, the settings, the
//! metrics, the caches, and the small state the controllers keep between
//! reconciles (removals waiting out their grace, rollouts, the progression
//! signal).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::cache;
use super::metrics::AddonMetrics;
use super::rollout;
use super::settings::AddonSettings;

/// Shared by the controllers' reconcilers.
pub struct Context {
    pub client: kube::Client,
    pub settings: AddonSettings,
    pub metrics: AddonMetrics,
    /// What the reconcilers read (see [`cache`]).
    pub caches: cache::Caches,
    /// Serializes writes of the ClusterManagementAddOn: every cluster's
    /// install reconcile checks it, and after a change only one of them
    /// needs to write it.
    pub management_write: tokio::sync::Mutex<()>,
    /// Clusters whose installed addon waits out the removal grace.
    pub removals: PendingRemovals,
    pub rollouts: rollout::Rollouts,
    /// Wakes the writer of the ClusterManagementAddOn's `installProgressions`.
    pub progressions: ProgressionSignal,
}

impl Context {
    /// A context reading from `caches`.
    pub fn new(
        client: kube::Client,
        settings: AddonSettings,
        metrics: AddonMetrics,
        caches: cache::Caches,
    ) -> Self {
        let removals =
            PendingRemovals::new(settings.removal_grace, metrics.pending_removals.clone());
        let rollouts = rollout::Rollouts::new(metrics.rollout_waiting.clone());
        Self {
            client,
            settings,
            metrics,
            caches,
            management_write: tokio::sync::Mutex::new(()),
            removals,
            rollouts,
            progressions: ProgressionSignal::default(),
        }
    }
}

/// The installed addons whose cluster left the placements, and since when.
///
/// A cluster out of every decision is not taken for gone at once: OCM's
/// placement controller writes a placement's decisions one object at a time,
/// and a cluster moving between two of them is briefly in neither. Its
/// addon is removed only once the cluster has stayed out for the grace;
/// seen in a decision again, it is forgotten.
pub struct PendingRemovals {
    grace: Duration,
    since: Mutex<HashMap<String, Instant>>,
    gauge: Gauge,
}

impl PendingRemovals {
    pub fn new(grace: Duration, gauge: Gauge) -> Self {
        Self {
            grace,
            since: Mutex::new(HashMap::new()),
            gauge,
        }
    }

    /// How long `cluster`, out of every decision now, still has to stay out
    /// before its addon goes; `None`: remove it now. The first call starts
    /// the grace.
    pub fn remaining(&self, cluster: &str) -> Option<Duration> {
        let mut since = self.lock();
        let left_at = *since.entry(cluster.to_owned()).or_insert_with(Instant::now);
        let remaining = self.grace.saturating_sub(left_at.elapsed());
        self.gauge.set(since.len() as i64);
        (!remaining.is_zero()).then_some(remaining)
    }

    /// `cluster` is selected again, or its addon is gone: nothing pending.
    pub fn forget(&self, cluster: &str) {
        let mut since = self.lock();
        if since.remove(cluster).is_some() {
            self.gauge.set(since.len() as i64);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        // The map holds plain data: a panic elsewhere leaves it consistent.
        self.since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Tells the summary task that an addon's rollout state may have changed.
#[derive(Default)]
pub struct ProgressionSignal {
    changed: Notify,
}

impl ProgressionSignal {
    /// Something the summary counts changed.
    pub fn changed(&self) {
        self.changed.notify_one();
    }

    /// Completes at the next [`ProgressionSignal::changed`] (or at once for
    /// one that came since the last wait).
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}
