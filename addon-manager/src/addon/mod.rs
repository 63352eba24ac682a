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
pub mod csr;
pub mod customize;
pub mod install;
pub mod own_writes;
pub mod progression;
pub mod reconcile;
pub mod render;
pub mod rollout;
pub mod status;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::apply::ApplyError;

/// The addon's name: ClusterManagementAddOn, ManagedClusterAddOns, Lease.
pub const ADDON_NAME: &str = "cluster-proxy";
/// The ManifestWork that deploys the agent.
pub const MANIFEST_WORK_NAME: &str = "addon-cluster-proxy-deploy-0";
/// The agent Deployment on the managed cluster.
pub const AGENT_DEPLOYMENT: &str = "cluster-proxy-proxy-agent";
/// The agent's ServiceAccount.
pub const AGENT_SERVICE_ACCOUNT: &str = "cluster-proxy";
/// The agent's CA bundle Secret.
pub const AGENT_CA_SECRET: &str = "cluster-proxy-ca";
/// The proxy-agent's client certificate Secret (written by the klusterlet).
pub const AGENT_CLIENT_CERT_SECRET: &str =
    "cluster-proxy-open-cluster-management.io-proxy-agent-signer-client-cert";
/// The addon-agent's hub kubeconfig Secret (written by the klusterlet).
pub const HUB_KUBECONFIG_SECRET: &str = "cluster-proxy-hub-kubeconfig";
/// Role and RoleBinding of the agent, on the hub and on the managed cluster.
pub const AGENT_RBAC_NAME: &str = "cluster-proxy-addon-agent";
/// The placement of the default install strategy.
pub const DEFAULT_PLACEMENT: &str = "cluster-proxy-placement";
/// Where the agent is installed unless configured otherwise (upstream's
/// `--agent-install-namespace` default).
pub const DEFAULT_AGENT_INSTALL_NAMESPACE: &str = "open-cluster-management-cluster-proxy";
/// The hub CA bundle Secret (written by cert-authority) and its key.
pub const CA_BUNDLE_SECRET: &str = "proxy-server-ca";
pub const CA_BUNDLE_KEY: &str = "ca.crt";

/// How long a cluster must be out of every decision before its addon is
/// removed, unless configured otherwise ([`AddonSettings::removal_grace`]).
pub const DEFAULT_REMOVAL_GRACE: Duration = Duration::from_secs(10);

/// A Placement by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementRef {
    pub namespace: String,
    pub name: String,
}

/// How ManagedClusterAddOns come to exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstallStrategy {
    /// Users create them; the controller only serves them.
    Manual,
    /// One per cluster the placements' decisions select.
    Placements(Vec<PlacementRef>),
}

/// What the addon controller needs to know about its hub.
#[derive(Debug, Clone)]
pub struct AddonSettings {
    /// The namespace addon-manager runs in; holds the CA bundle Secret
    /// [`CA_BUNDLE_SECRET`].
    pub hub_namespace: String,
    /// Agent namespace when neither an AddOnDeploymentConfig nor the
    /// ManagedClusterAddOn names one.
    pub agent_install_namespace: String,
    /// The ClusterManagementAddOn's install strategy.
    pub install_strategy: InstallStrategy,
    /// The AddOnDeploymentConfig (namespace, name) every addon uses unless
    /// its `spec.configs` names one; declared as the ClusterManagementAddOn's
    /// default.
    pub default_deployment_config: Option<(String, String)>,
    /// How long a cluster must stay out of every decision of the placements
    /// before the installer removes its addon. OCM's placement controller
    /// writes a placement's PlacementDecisions (100 clusters each) one after
    /// another, so when the sorted list shifts, a cluster moving from one
    /// object to the next is in none of them between the two writes; without
    /// a grace its agent would be uninstalled and installed again.
    pub removal_grace: Duration,
    /// Make every cluster's kube-apiserver reachable through the tunnel by
    /// the cluster's name (upstream's `--enable-kube-api-proxy`, default
    /// true); see [`render::AgentInputs::kube_api_proxy`].
    pub enable_kube_api_proxy: bool,
    /// Ship a NetworkPolicy for the agent pods with every agent
    /// (upstream's `--enable-network-policies`, default false); see
    /// [`render::agent_network_policy`].
    pub enable_network_policies: bool,
    /// Put a service-proxy beside every agent (upstream's
    /// `--enable-service-proxy`; its chart's default, false): once
    /// cert-authority has issued its certificate (the MPC's
    /// `spec.userServer`), every agent's work carries it.
    pub enable_service_proxy: bool,
    /// The kube-apiserver ports that policy lets the agents reach
    /// (`--agent-kube-apiserver-ports`, default 443 and 6443).
    pub agent_kube_apiserver_ports: Vec<i32>,
    /// The ManagedProxyConfiguration the agents are rendered from and the
    /// ClusterManagementAddOn names as its default configuration
    /// (`--managed-proxy-configuration`, default `cluster-proxy`).
    pub managed_proxy_configuration: String,
    /// The agent image (`--agent-image-name`); `None`: the MPC's
    /// `spec.proxyAgent.image`. Image mirrors apply to it either way.
    pub agent_image: Option<String>,
    /// The agent containers' `imagePullPolicy` (`--image-pull-policy`);
    /// `None`: Kubernetes' default.
    pub image_pull_policy: Option<String>,
}

impl AddonSettings {
    /// Upstream's defaults: placement `cluster-proxy-placement` in
    /// `hub_namespace`, agents in `open-cluster-management-cluster-proxy`.
    pub fn new(hub_namespace: &str) -> Self {
        Self {
            hub_namespace: hub_namespace.to_owned(),
            agent_install_namespace: DEFAULT_AGENT_INSTALL_NAMESPACE.to_owned(),
            install_strategy: InstallStrategy::Placements(vec![PlacementRef {
                namespace: hub_namespace.to_owned(),
                name: DEFAULT_PLACEMENT.to_owned(),
            }]),
            default_deployment_config: None,
            removal_grace: DEFAULT_REMOVAL_GRACE,
            enable_kube_api_proxy: true,
            enable_network_policies: false,
            enable_service_proxy: false,
            agent_kube_apiserver_ports: render::KUBE_API_SERVER_PORTS.to_vec(),
            managed_proxy_configuration:
                cluster_proxy_proto::api::proxy::v1alpha1::MANAGED_PROXY_CONFIGURATION_NAME
                    .to_owned(),
            agent_image: None,
            image_pull_policy: None,
        }
    }
}

/// Errors that make a reconcile retry (with backoff). Bad input is not an
/// error here: it becomes a `False` condition.
#[derive(Debug, thiserror::Error)]
pub enum AddonError {
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("{action}: {source}")]
    Api {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error("rendering the agent manifests: {0}")]
    Render(#[from] cluster_proxy_proto::api::work::v1::ManifestError),
    #[error("object has no {0}")]
    Incomplete(&'static str),
    #[error("the controllers' caches are closed (shutting down)")]
    CacheClosed,
}

impl AddonError {
    pub(crate) fn api(action: impl Into<String>) -> impl FnOnce(kube::Error) -> AddonError {
        let action = action.into();
        move |source| AddonError::Api { action, source }
    }

    /// Whether the API answered 409 (stale data: retry at once).
    pub fn is_conflict(&self) -> bool {
        let error = match self {
            AddonError::Apply(apply) => apply.api_error(),
            AddonError::Api { source, .. } => Some(source),
            _ => None,
        };
        error.is_some_and(crate::apply::is_conflict)
    }
}

/// Prometheus metrics of the addon controllers.
#[derive(Debug, Clone, Default)]
pub struct AddonMetrics {
    reconciliations: Family<Vec<(String, String)>, Counter>,
    failures: Family<Vec<(String, String)>, Counter>,
    csr_decisions: Family<Vec<(String, String)>, Counter>,
    pending_removals: Gauge,
    rollout_waiting: Gauge,
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
    pub removals: install::PendingRemovals,
    pub rollouts: rollout::Rollouts,
    /// Wakes the writer of the ClusterManagementAddOn's `installProgressions`.
    pub progressions: progression::ProgressionSignal,
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
            install::PendingRemovals::new(settings.removal_grace, metrics.pending_removals.clone());
        let rollouts = rollout::Rollouts::new(metrics.rollout_waiting.clone());
        Self {
            client,
            settings,
            metrics,
            caches,
            management_write: tokio::sync::Mutex::new(()),
            removals,
            rollouts,
            progressions: progression::ProgressionSignal::default(),
        }
    }
}

/// How long to wait before retrying after an error: at once for a
/// conflict (someone else wrote; re-read and try again), else a short
/// backoff that keeps a broken API from being hammered.
pub(crate) fn retry_after(error: &AddonError) -> Duration {
    if error.is_conflict() {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(5)
    }
}

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
