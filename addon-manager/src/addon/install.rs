//! Installation: the ClusterManagementAddOn `cluster-proxy` and, with the
//! `Placements` strategy, a ManagedClusterAddOn for every cluster the
//! placements' decisions select.
//!
//! The controller reconciles ManagedClusters; any change of a
//! PlacementDecision or of the ClusterManagementAddOn reconciles them all,
//! and a change of a cluster's ManagedClusterAddOn reconciles its cluster.
//! It reads them from its caches ([`super::cache::InstallCache`]).
//! ManagedClusterAddOns it creates are owned by the ClusterManagementAddOn;
//! only those are ever deleted: when their cluster is deleting, or when it
//! has been out of every decision for the removal grace
//! ([`AddonSettings::removal_grace`], see [`PendingRemovals`]); a deleted
//! cluster's addon is removed by the addon controller. Addons users created
//! are left alone.

use std::future::Future;
use std::sync::Arc;

use cluster_proxy_proto::api::addon::v1alpha1::{
    ANNOTATION_LIFECYCLE, AddOnConfig, ClusterManagementAddOn, ClusterManagementAddOnSpec,
    ConfigMeta, ConfigReferent, INSTALL_STRATEGY_MANUAL, INSTALL_STRATEGY_PLACEMENTS,
    InstallStrategy as OcmInstallStrategy, LIFECYCLE_SELF, ManagedClusterAddOn,
    ManagedClusterAddOnSpec, PlacementStrategy,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::{LABEL_PLACEMENT, PlacementDecision};
use futures_util::{Stream, StreamExt, stream};
use kube::api::DeleteParams;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};

use super::cache::get_opt;
use super::cache::{
    InstallCacheWriters, cached_or_own_or_read, reflected_objects, reflected_triggers,
};
use super::config::{ADC_GROUP, ADC_RESOURCE, MPC_GROUP, MPC_RESOURCE};
use super::context::Context;
use super::error::{AddonError, requeue_failed};
use super::names::ADDON_NAME;
use super::settings::{AddonSettings, InstallStrategy};
use super::status::addon_meta;
use crate::apply;

const CONTROLLER: &str = "install";

/// The ClusterManagementAddOn `cluster-proxy` as addon-manager declares it
/// (upstream §8): metadata, supported configurations with the MPC
/// `cluster-proxy` as default, and the install strategy; and the lifecycle
/// annotation `self`, because this controller installs the addons and
/// writes their configuration references. Upstream says `addon-manager`,
/// which hands both to OCM's own addon-manager: with this controller doing
/// them too, the two would race to create and delete the same addons and
/// fight over `status.configReferences` (OCM sets `addon-manager` on every
/// ClusterManagementAddOn that does not say `self`).
pub fn cluster_management_addon(settings: &AddonSettings) -> ClusterManagementAddOn {
    let install_strategy = match &settings.install_strategy {
        InstallStrategy::Manual => OcmInstallStrategy {
            type_: Some(INSTALL_STRATEGY_MANUAL.into()),
            placements: None,
        },
        InstallStrategy::Placements(placements) => OcmInstallStrategy {
            type_: Some(INSTALL_STRATEGY_PLACEMENTS.into()),
            placements: Some(
                placements
                    .iter()
                    .map(|placement| PlacementStrategy {
                        namespace: placement.namespace.clone(),
                        name: placement.name.clone(),
                        ..PlacementStrategy::default()
                    })
                    .collect(),
            ),
        },
    };
    let mut addon = ClusterManagementAddOn::new(
        ADDON_NAME,
        ClusterManagementAddOnSpec {
            add_on_meta: Some(addon_meta()),
            supported_configs: Some(vec![
                ConfigMeta {
                    group: MPC_GROUP.into(),
                    resource: MPC_RESOURCE.into(),
                    default_config: Some(ConfigReferent {
                        namespace: None,
                        name: settings.managed_proxy_configuration.clone(),
                    }),
                },
                ConfigMeta {
                    group: ADC_GROUP.into(),
                    resource: ADC_RESOURCE.into(),
                    default_config: settings.default_deployment_config.as_ref().map(
                        |(namespace, name)| ConfigReferent {
                            namespace: Some(namespace.clone()),
                            name: name.clone(),
                        },
                    ),
                },
            ]),
            install_strategy: Some(install_strategy),
            ..ClusterManagementAddOnSpec::default()
        },
    );
    addon.metadata.annotations = Some(
        [(ANNOTATION_LIFECYCLE.to_owned(), LIFECYCLE_SELF.to_owned())]
            .into_iter()
            .collect(),
    );
    addon
}

/// Whether the ClusterManagementAddOn `current` already says what
/// `desired` says (fields others set are not compared).
fn management_is_current(
    current: &ClusterManagementAddOn,
    desired: &ClusterManagementAddOn,
) -> bool {
    current.spec.add_on_meta == desired.spec.add_on_meta
        && current.spec.supported_configs == desired.spec.supported_configs
        && current.spec.install_strategy == desired.spec.install_strategy
        && desired
            .annotations()
            .iter()
            .all(|(key, value)| current.annotations().get(key) == Some(value))
}

/// The ClusterManagementAddOn as it should be: the cached copy when it is
/// current, else the one written now. Only one reconcile at a time looks
/// closer, and it re-reads the object first, so a change seen by every
/// cluster's reconcile at once is written once.
pub async fn ensure_cluster_management_addon(
    context: &Context,
) -> Result<Arc<ClusterManagementAddOn>, AddonError> {
    let desired = cluster_management_addon(&context.settings);
    let cache = &context.caches.install;
    let key = ObjectRef::new(ADDON_NAME);
    let known_current = || {
        cache
            .own_managements
            .freshest(&key, cache.managements.get(&key))
            .filter(|current| {
                management_is_current(current, &with_user_choices_of(current, desired.clone()))
            })
    };
    if let Some(current) = known_current() {
        return Ok(current);
    }
    let _only_one = context.management_write.lock().await;
    // The reconcile that held the lock before may have written it.
    if let Some(current) = known_current() {
        return Ok(current);
    }
    let cached = cache.managements.get(&key);
    let api = Api::<ClusterManagementAddOn>::all(context.client.clone());
    let current = get_opt(&api, ADDON_NAME).await?;
    let desired = match &current {
        Some(current) => with_user_choices_of(current, desired),
        None => desired,
    };
    let newer = match current {
        Some(current) if management_is_current(&current, &desired) => current,
        _ => apply::apply(&api, &desired).await?,
    };
    Ok(cache.own_managements.wrote(cached.as_deref(), newer))
}

/// `desired` with the `rolloutStrategy` and the `configs` that `current`
/// gives each of its placements: how changes roll out and which
/// AddOnDeploymentConfig a placement's clusters get are the user's to choose
/// (by editing the object, or through the chart's
/// `addonManager.rolloutStrategy`), the placements are ours.
fn with_user_choices_of(
    current: &ClusterManagementAddOn,
    mut desired: ClusterManagementAddOn,
) -> ClusterManagementAddOn {
    let declared = current
        .spec
        .install_strategy
        .as_ref()
        .and_then(|strategy| strategy.placements.as_ref());
    let wanted = desired
        .spec
        .install_strategy
        .as_mut()
        .and_then(|strategy| strategy.placements.as_mut());
    if let (Some(declared), Some(wanted)) = (declared, wanted) {
        for placement in wanted {
            let declared = declared.iter().find(|declared| {
                declared.namespace == placement.namespace && declared.name == placement.name
            });
            placement.rollout_strategy =
                declared.and_then(|declared| declared.rollout_strategy.clone());
            placement.configs = declared.and_then(|declared| declared.configs.clone());
        }
    }
    desired
}

/// Whether the placements' decisions select `cluster` now. Each cluster's
/// reconcile asks, so it scans without building a set (a set of every
/// cluster per reconcile made installing a fleet quadratic).
pub fn is_selected(
    decisions: &Store<PlacementDecision>,
    settings: &AddonSettings,
    cluster: &str,
) -> bool {
    let InstallStrategy::Placements(placements) = &settings.install_strategy else {
        return false;
    };
    decisions.state().iter().any(|decision| {
        placements.iter().any(|placement| {
            decision.metadata.namespace.as_deref() == Some(placement.namespace.as_str())
                && decision.labels().get(LABEL_PLACEMENT) == Some(&placement.name)
        }) && decision.cluster_names().any(|name| name == cluster)
    })
}

/// Whether `addon` was created by the installer (owned by `management`).
pub fn installed_by(addon: &ManagedClusterAddOn, management: &ClusterManagementAddOn) -> bool {
    let Some(uid) = management.meta().uid.as_deref() else {
        return false;
    };
    addon
        .owner_references()
        .iter()
        .any(|owner| owner.uid == uid && owner.kind == ClusterManagementAddOn::kind(&()))
}

/// The ManagedClusterAddOn the installer creates for `cluster`.
pub fn installed_addon(
    cluster: &str,
    settings: &AddonSettings,
    management: &ClusterManagementAddOn,
) -> ManagedClusterAddOn {
    let mut addon = ManagedClusterAddOn::new(
        ADDON_NAME,
        ManagedClusterAddOnSpec {
            install_namespace: Some(settings.agent_install_namespace.clone()),
            configs: None::<Vec<AddOnConfig>>,
        },
    );
    addon.metadata.namespace = Some(cluster.to_owned());
    addon.metadata.owner_references = apply::owner_reference(management).map(|owner| vec![owner]);
    addon
}

/// Reconciles one ManagedCluster's installation.
pub async fn reconcile(
    cluster: Arc<ManagedCluster>,
    context: Arc<Context>,
) -> Result<Action, AddonError> {
    context.metrics.reconciled(CONTROLLER);
    let cache = &context.caches.install;
    cache.ready().await?;
    let settings = &context.settings;
    let management = ensure_cluster_management_addon(&context).await?;
    if settings.install_strategy == InstallStrategy::Manual {
        return Ok(Action::await_change());
    }
    let name = cluster.name_any();
    let deleting = cluster.metadata.deletion_timestamp.is_some();
    let selected = is_selected(&cache.decisions, settings, &name);
    let wanted = !deleting && selected;
    let api = Api::<ManagedClusterAddOn>::namespaced(context.client.clone(), &name);
    let current = cached_or_own_or_read(&cache.addons, &cache.own_addons, &api, ADDON_NAME).await?;
    match current {
        Some(addon) if !wanted && installed_by(&addon, &management) => {
            if !deleting && let Some(wait) = context.removals.remaining(&name) {
                tracing::debug!(
                    cluster = %name,
                    remaining_ms = wait.as_millis() as u64,
                    "the cluster is in no decision; its addon stays for the removal grace"
                );
                return Ok(Action::requeue(wait));
            }
            if deleting {
                tracing::info!(cluster = %name, "the cluster is deleting; removing the addon");
            } else {
                tracing::info!(cluster = %name, "the cluster left the placements; removing the addon");
            }
            delete_addon(&api).await?;
        }
        None if wanted => {
            tracing::info!(cluster = %name, "installing the addon");
            let installed =
                apply::apply(&api, &installed_addon(&name, settings, &management)).await?;
            cache.own_addons.wrote(None, installed);
        }
        _ => {}
    }
    context.removals.forget(&name);
    Ok(Action::await_change())
}

/// Deletes the addon `cluster-proxy` through `api`; gone already is fine.
pub async fn delete_addon(api: &Api<ManagedClusterAddOn>) -> Result<(), AddonError> {
    match api.delete(ADDON_NAME, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(error) if apply::is_not_found(&error) => Ok(()),
        Err(error) => Err(AddonError::api("deleting the addon")(error)),
    }
}

fn error_policy(cluster: Arc<ManagedCluster>, error: &AddonError, context: Arc<Context>) -> Action {
    requeue_failed(&context.metrics, CONTROLLER, &cluster.name_any(), error)
}

/// The installation controller, as a stream of reconcile results.
pub fn controller(
    context: Arc<Context>,
    writers: InstallCacheWriters,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> impl Stream<Item = ()> + Send {
    let client = context.client.clone();
    let by_name = watcher::Config::default().fields(&format!("metadata.name={ADDON_NAME}"));
    // Each watch fills its cache before its event triggers a reconcile.
    let everything = stream::select_all(vec![
        reflected_triggers(
            writers.decisions,
            None,
            watcher(
                Api::<PlacementDecision>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .boxed(),
        reflected_triggers(
            writers.managements,
            Some(context.caches.install.own_managements.clone()),
            watcher(
                Api::<ClusterManagementAddOn>::all(client.clone()),
                by_name.clone(),
            ),
        )
        .boxed(),
    ]);
    let addons = reflected_objects(
        writers.addons,
        Some(context.caches.install.own_addons.clone()),
        watcher(Api::<ManagedClusterAddOn>::all(client.clone()), by_name),
    );
    Controller::new(
        Api::<ManagedCluster>::all(client),
        watcher::Config::default(),
    )
    .watches_stream(addons, |addon| {
        addon
            .metadata
            .namespace
            .map(|cluster| ObjectRef::<ManagedCluster>::new(&cluster))
    })
    .reconcile_all_on(everything)
    .graceful_shutdown_on(shutdown)
    .run(
        |object, context| crate::trace::traced(CONTROLLER, object, context, reconcile),
        error_policy,
        context,
    )
    .map(|result| {
        if let Err(error) = result {
            tracing::debug!(%error, "install controller event");
        }
    })
}
