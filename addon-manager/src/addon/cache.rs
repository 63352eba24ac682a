//! The addon controllers' read caches: every object a reconcile reads comes
//! from a reflector store fed by the same watch whose events trigger the
//! reconcile, so a reconcile sees at least the change that triggered it, and
//! reading costs the API server nothing. On a hub with thousands of clusters
//! one change to the ManagedProxyConfiguration reconciles every addon; with
//! a GET per object read that was several requests per cluster per pass.

use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnDeploymentConfig, ClusterManagementAddOn, ManagedClusterAddOn,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::PlacementDecision;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::work::v1::ManifestWork;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::runtime::reflector::store::Writer;
use kube::runtime::reflector::{self, Store};

use std::sync::Arc;

use tokio::sync::watch;

use futures_util::{Stream, StreamExt};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};

use super::error::AddonError;
use super::own_writes::OwnWrites;

/// Reads one object from the API server (no cache); `None` when it does not
/// exist. Here with the caches, which fall back to it.
pub(crate) async fn get_opt<K>(api: &Api<K>, name: &str) -> Result<Option<K>, AddonError>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name)
        .await
        .map_err(AddonError::api(format!("reading {} {name}", K::kind(&()))))
}

/// What the ManagedClusterAddOn controller reads.
#[derive(Clone)]
pub struct AddonCache {
    pub clusters: Store<ManagedCluster>,
    pub mpcs: Store<ManagedProxyConfiguration>,
    pub managements: Store<ClusterManagementAddOn>,
    pub deployment_configs: Store<AddOnDeploymentConfig>,
    /// The CA bundle Secret in the hub namespace.
    pub hub_secrets: Store<Secret>,
    /// cert-authority's service-proxy certificate in the hub namespace
    /// (watched apart: a watch selects one name).
    pub service_proxy_secrets: Store<Secret>,
    /// Services of the hub namespace (the agents' load balancer).
    pub hub_services: Store<Service>,
    /// The addon's ManifestWorks.
    pub works: Store<ManifestWork>,
    /// The addon-agent's hub Roles and RoleBindings.
    pub roles: Store<Role>,
    pub role_bindings: Store<RoleBinding>,
    /// Our writes of the works, Roles and RoleBindings the stores above
    /// may not show yet (forgotten by their watches' events).
    pub own_works: OwnWrites<ManifestWork>,
    pub own_roles: OwnWrites<Role>,
    pub own_role_bindings: OwnWrites<RoleBinding>,
    /// Our status writes of the addons, which the controller's own store
    /// may not show yet (forgotten when it shows another version).
    pub own_statuses: OwnWrites<ManagedClusterAddOn>,
    filled: watch::Receiver<bool>,
}

/// The writers of [`AddonCache`], for the watches that fill it.
pub struct AddonCacheWriters {
    pub clusters: Writer<ManagedCluster>,
    pub mpcs: Writer<ManagedProxyConfiguration>,
    pub managements: Writer<ClusterManagementAddOn>,
    pub deployment_configs: Writer<AddOnDeploymentConfig>,
    pub hub_secrets: Writer<Secret>,
    pub service_proxy_secrets: Writer<Secret>,
    pub hub_services: Writer<Service>,
    pub works: Writer<ManifestWork>,
    pub roles: Writer<Role>,
    pub role_bindings: Writer<RoleBinding>,
}

/// What the installation controller reads.
#[derive(Clone)]
pub struct InstallCache {
    pub decisions: Store<PlacementDecision>,
    pub managements: Store<ClusterManagementAddOn>,
    pub addons: Store<ManagedClusterAddOn>,
    /// Our writes (and reads) of the objects above the stores may not show
    /// yet.
    pub own_managements: OwnWrites<ClusterManagementAddOn>,
    pub own_addons: OwnWrites<ManagedClusterAddOn>,
    filled: watch::Receiver<bool>,
}

/// The writers of [`InstallCache`].
pub struct InstallCacheWriters {
    pub decisions: Writer<PlacementDecision>,
    pub managements: Writer<ClusterManagementAddOn>,
    pub addons: Writer<ManagedClusterAddOn>,
}

/// Every cache of the addon controllers.
#[derive(Clone)]
pub struct Caches {
    pub addon: AddonCache,
    pub install: InstallCache,
}

/// The writers of [`Caches`].
pub struct CacheWriters {
    pub addon: AddonCacheWriters,
    pub install: InstallCacheWriters,
    /// Set once each cache has been filled: for [`AddonCache::announce_filled`]
    /// and [`InstallCache::announce_filled`].
    pub addon_filled: watch::Sender<bool>,
    pub install_filled: watch::Sender<bool>,
}

/// Empty caches and their writers.
pub fn caches() -> (Caches, CacheWriters) {
    let (clusters, clusters_writer) = reflector::store();
    let (mpcs, mpcs_writer) = reflector::store();
    let (managements, managements_writer) = reflector::store();
    let (deployment_configs, deployment_configs_writer) = reflector::store();
    let (hub_secrets, hub_secrets_writer) = reflector::store();
    let (service_proxy_secrets, service_proxy_secrets_writer) = reflector::store();
    let (hub_services, hub_services_writer) = reflector::store();
    let (works, works_writer) = reflector::store();
    let (roles, roles_writer) = reflector::store();
    let (role_bindings, role_bindings_writer) = reflector::store();
    let (decisions, decisions_writer) = reflector::store();
    let (install_managements, install_managements_writer) = reflector::store();
    let (addons, addons_writer) = reflector::store();
    let (addon_filled, addon_filled_rx) = watch::channel(false);
    let (install_filled, install_filled_rx) = watch::channel(false);
    (
        Caches {
            addon: AddonCache {
                clusters,
                mpcs,
                managements,
                deployment_configs,
                hub_secrets,
                service_proxy_secrets,
                hub_services,
                works,
                roles,
                role_bindings,
                own_works: OwnWrites::default(),
                own_roles: OwnWrites::default(),
                own_role_bindings: OwnWrites::default(),
                own_statuses: OwnWrites::default(),
                filled: addon_filled_rx,
            },
            install: InstallCache {
                decisions,
                managements: install_managements,
                addons,
                own_managements: OwnWrites::default(),
                own_addons: OwnWrites::default(),
                filled: install_filled_rx,
            },
        },
        CacheWriters {
            addon: AddonCacheWriters {
                clusters: clusters_writer,
                mpcs: mpcs_writer,
                managements: managements_writer,
                deployment_configs: deployment_configs_writer,
                hub_secrets: hub_secrets_writer,
                service_proxy_secrets: service_proxy_secrets_writer,
                hub_services: hub_services_writer,
                works: works_writer,
                roles: roles_writer,
                role_bindings: role_bindings_writer,
            },
            install: InstallCacheWriters {
                decisions: decisions_writer,
                managements: install_managements_writer,
                addons: addons_writer,
            },
            addon_filled,
            install_filled,
        },
    )
}

/// `stream`'s changed and deleted objects, each passed on only after
/// `writer`'s cache has taken it in: a reconcile they trigger reads at
/// least that change. Each event then ends `own`'s memory of the object.
pub(crate) fn reflected_objects<K, S>(
    writer: Writer<K>,
    own: Option<OwnWrites<K>>,
    stream: S,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + Send + Sync + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    stream
        .default_backoff()
        // No reconcile reads managedFields; server-side apply's record of
        // every field was most of what a cached object held (a work lists
        // each of its manifests' fields once more).
        .modify(|object| object.managed_fields_mut().clear())
        .reflect(writer)
        .inspect(move |event| {
            if let (Some(own), Ok(event)) = (&own, event) {
                own.seen(event);
            }
        })
        .touched_objects()
}

/// [`reflected_objects`] as bare triggers (for `reconcile_all_on`).
pub(crate) fn reflected_triggers<K, S>(
    writer: Writer<K>,
    own: Option<OwnWrites<K>>,
    stream: S,
) -> impl Stream<Item = ()> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + Send + Sync + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    reflected_objects(writer, own, stream)
        .filter_map(|result| async move { result.ok().map(|_| ()) })
}

/// `name` from `store`; when the cache does not have it, from the API. An
/// object another watch (or the installation controller) has just written
/// may not have reached this cache yet, and its absence would be reported
/// or rendered; absences are rare, so confirming them costs little.
pub(crate) async fn cached_or_read<K>(
    store: &Store<K>,
    api: &Api<K>,
    name: &str,
) -> Result<Option<Arc<K>>, AddonError>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match store.get(&key_of(api, name)) {
        Some(cached) => Ok(Some(cached)),
        None => Ok(get_opt(api, name).await?.map(Arc::new)),
    }
}

/// [`cached_or_read`], with this process's own writes the store may not
/// show yet: an object just created here is not read back.
pub(crate) async fn cached_or_own_or_read<K>(
    store: &Store<K>,
    own: &OwnWrites<K>,
    api: &Api<K>,
    name: &str,
) -> Result<Option<Arc<K>>, AddonError>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let key = key_of(api, name);
    match own.freshest(&key, store.get(&key)) {
        Some(known) => Ok(Some(known)),
        None => Ok(get_opt(api, name).await?.map(Arc::new)),
    }
}

/// The reference to `name` in `api`'s namespace (if any).
pub(crate) fn key_of<K: Resource<DynamicType = ()>>(api: &Api<K>, name: &str) -> ObjectRef<K> {
    match api.namespace() {
        Some(namespace) => ObjectRef::new(name).within(namespace),
        None => ObjectRef::new(name),
    }
}

/// Waits until `store` holds its watch's first complete list. Only one
/// task may wait on a store: `Store::wait_until_ready` wakes a single
/// waiter (its oneshot receiver keeps the last waker only), so reconciles
/// wait on [`AddonCache::ready`] / [`InstallCache::ready`] instead.
async fn filled<K>(store: &Store<K>) -> bool
where
    K: reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store.wait_until_ready().await.is_ok()
}

/// Waits until `filled` says so; an error once its sender is gone.
async fn wait_filled(filled: &watch::Receiver<bool>) -> Result<(), AddonError> {
    let mut filled = filled.clone();
    filled
        .wait_for(|filled| *filled)
        .await
        .map(|_| ())
        .map_err(|_| AddonError::CacheClosed)
}

impl AddonCache {
    /// Waits until every store has been filled once: before that an empty
    /// store would read as "missing" and a reconcile would report it.
    pub async fn ready(&self) -> Result<(), AddonError> {
        wait_filled(&self.filled).await
    }

    /// Sets `filled` once every store has been filled (run it as a task of
    /// its own); drops it if a store's watch ends first.
    pub async fn announce_filled(self, announce: watch::Sender<bool>) {
        let all = filled(&self.clusters).await
            && filled(&self.mpcs).await
            && filled(&self.managements).await
            && filled(&self.deployment_configs).await
            && filled(&self.hub_secrets).await
            && filled(&self.service_proxy_secrets).await
            && filled(&self.hub_services).await
            && filled(&self.works).await
            && filled(&self.roles).await
            && filled(&self.role_bindings).await;
        if all {
            announce.send_replace(true);
        }
    }
}

impl InstallCache {
    /// Waits until every store has been filled once.
    pub async fn ready(&self) -> Result<(), AddonError> {
        wait_filled(&self.filled).await
    }

    /// Sets `filled` once every store has been filled.
    pub async fn announce_filled(self, announce: watch::Sender<bool>) {
        let all = filled(&self.decisions).await
            && filled(&self.managements).await
            && filled(&self.addons).await;
        if all {
            announce.send_replace(true);
        }
    }
}
