//! The addon controller: cluster-proxy as an OCM addon on every selected
//! managed cluster.
//!
//! Three kube-runtime controllers share one field manager
//! ([`crate::apply::FIELD_MANAGER`]):
//!
//! * [`install`]: keeps the `ClusterManagementAddOn` `cluster-proxy` and, for
//!   the `Placements` install strategy, one `ManagedClusterAddOn` per cluster
//!   the placements' decisions select (owned by the ClusterManagementAddOn,
//!   removed when the cluster leaves the placement or is deleted);
//! * [`reconcile`]: for every `ManagedClusterAddOn` `cluster-proxy`, the
//!   agent's `ManifestWork`, the hub RBAC of its registration and the status
//!   fields the addon manager owns (registrations, configuration references,
//!   `Configured`, `ManifestApplied`, `RegistrationApplied`; never
//!   `Available`, which OCM's registration agent owns);
//! * [`csr`]: approval of proxy-agent CSRs filed by the cluster's own
//!   registration identity for an accepted cluster.
//!
//! Bad input (a missing configuration, an invalid cluster name or MPC) is
//! reported as a `False` condition with a reason on the affected addon only;
//! API errors are retried with backoff.

pub mod applied;
pub mod cache;
pub mod config;
pub mod context;
pub mod csr;
pub mod customize;
pub mod error;
pub mod install;
pub mod metrics;
pub mod names;
pub mod own_writes;
pub mod progression;
pub mod reconcile;
pub mod render;
pub mod rollout;
pub mod settings;
pub mod status;

pub use context::{Context, PendingRemovals, ProgressionSignal};
pub use error::AddonError;
pub use metrics::AddonMetrics;
pub use names::*;
pub use settings::{AddonSettings, InstallStrategy, PlacementRef};

use std::future::Future;
use std::sync::Arc;

use futures_util::StreamExt;

/// Runs the three addon controllers, and the writer of the
/// ClusterManagementAddOn's `installProgressions`, until `shutdown` completes.
pub async fn run(
    client: kube::Client,
    settings: AddonSettings,
    metrics: AddonMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let signal = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        }
    };
    let (caches, writers) = cache::caches();
    tokio::spawn(caches.addon.clone().announce_filled(writers.addon_filled));
    tokio::spawn(
        caches
            .install
            .clone()
            .announce_filled(writers.install_filled),
    );
    let context = Arc::new(Context::new(client, settings, metrics, caches));
    let install = install::controller(context.clone(), writers.install, signal());
    let addons = reconcile::controller(context.clone(), writers.addon, signal());
    let csrs = csr::controller(context.clone(), signal());
    tokio::join!(
        install.for_each(|_| async {}),
        addons.for_each(|_| async {}),
        csrs.for_each(|_| async {}),
        progression::run(context, signal()),
    );
}
