//! The ManagedClusterAddOn controller: for each addon `cluster-proxy`, the
//! agent's ManifestWork, its hub RBAC and the status fields the addon
//! manager owns.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnDeploymentConfig, CONDITION_CONFIGURED, CONDITION_MANIFEST_APPLIED, CONDITION_PROGRESSING,
    CONDITION_REGISTRATION_APPLIED, ClusterManagementAddOn, ManagedClusterAddOn, REASON_COMPLETED,
    REASON_FAILED, REASON_MANIFESTS_APPLIED, REASON_MANIFESTS_APPLY_FAILED, REASON_PROGRESSING,
    REASON_SET_PERMISSION_APPLIED,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::proxy::v1alpha1::{
    ManagedProxyConfiguration, SERVICE_PROXY_SECRET_NAME,
};
use cluster_proxy_proto::api::work::v1::{self as work, ManifestWork};
use cluster_proxy_proto::api::{CONDITION_FALSE, CONDITION_TRUE, CONDITION_UNKNOWN};
use cluster_proxy_proto::identity::{ClusterName, is_dns1123_label};
use futures_util::{Stream, StreamExt, stream};
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, ResourceExt};

use super::applied::{ANNOTATION_APPLIED_CONFIGURATIONS, AppliedConfigurations};
use super::cache::{
    AddonCacheWriters, cached_or_read, get_opt, reflected_objects, reflected_triggers,
};
use super::config::{self, DeploymentConfigRef};
use super::context::Context;
use super::customize::{AgentCustomization, CustomizationError};
use super::error::{AddonError, requeue_failed};
use super::install;
use super::names::{
    ADDON_NAME, AGENT_RBAC_NAME, CA_BUNDLE_KEY, CA_BUNDLE_SECRET, MANIFEST_WORK_NAME,
};
use super::render::{self, AgentInputs};
use super::rollout;
use super::settings::InstallStrategy;
use super::status::{
    Decided, OwnedStatus, REASON_CA_NOT_FOUND, REASON_CLUSTER_NOT_FOUND,
    REASON_CONFIGURATION_NOT_FOUND, REASON_CONFIGURED, REASON_ENTRYPOINT_NOT_READY,
    REASON_INVALID_CLUSTER_NAME, REASON_INVALID_CONFIGURATION, REASON_INVALID_IMAGE_REGISTRIES,
    REASON_INVALID_INSTALL_NAMESPACE, REASON_INVALID_NODE_SELECTOR,
    REASON_INVALID_RESOURCE_REQUIREMENTS, REASON_MANIFEST_APPLYING,
};
use crate::apply;

const CONTROLLER: &str = "managedclusteraddon";
/// How often a pending load balancer is looked at again, in case its
/// Service is outside the watched namespace.
const ENTRYPOINT_RETRY: Duration = Duration::from_secs(15);

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// What one reconcile decided, before the status is written.
struct Outcome {
    status: OwnedStatus,
    requeue: Option<Duration>,
    /// The addon was deleted: nothing to write.
    deleted: bool,
}

/// Reconciles one ManagedClusterAddOn.
pub async fn reconcile(
    addon: Arc<ManagedClusterAddOn>,
    context: Arc<Context>,
) -> Result<Action, AddonError> {
    context.metrics.reconciled(CONTROLLER);
    if addon.name_any() != ADDON_NAME || addon.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let namespace = addon
        .metadata
        .namespace
        .clone()
        .ok_or(AddonError::Incomplete("metadata.namespace"))?;
    // Our last status write, if the controller's store does not show it yet.
    let statuses = &context.caches.addon.own_statuses;
    let addon = statuses
        .freshest(&ObjectRef::from_obj(addon.as_ref()), Some(addon.clone()))
        .unwrap_or(addon);
    let outcome = evaluate(&addon, &namespace, &context).await?;
    if !outcome.deleted && !outcome.status.is_current(&addon) {
        // Judged against a status older than our own last write, a current
        // one would be rewritten and its transition times moved; `addon` is
        // at least that write (`own_statuses`), even when the controller's
        // store has not shown it yet, so it is not read back first.
        let api = Api::<ManagedClusterAddOn>::namespaced(context.client.clone(), &namespace);
        let mut patch = ManagedClusterAddOn::new(ADDON_NAME, Default::default());
        patch.metadata.namespace = Some(namespace.clone());
        patch.status = Some(outcome.status.to_status());
        match apply::apply_status(&api, &patch).await {
            Ok(written) => {
                statuses.wrote(Some(&addon), written);
                context.progressions.changed();
            }
            // Deleted since the store showed it: nothing to write.
            Err(error) if error.api_error().is_some_and(apply::is_not_found) => {
                return Ok(Action::await_change());
            }
            Err(error) => return Err(error.into()),
        }
    }
    Ok(match outcome.requeue {
        Some(after) => Action::requeue(after),
        None => Action::await_change(),
    })
}

async fn evaluate(
    addon: &ManagedClusterAddOn,
    cluster: &str,
    context: &Context,
) -> Result<Outcome, AddonError> {
    let cache = &context.caches.addon;
    cache.ready().await?;
    let now = now();
    let mut status = OwnedStatus::from_current(addon);
    let stop = |mut status: OwnedStatus, stop: Stop| match stop {
        Stop::Conditions(decided, requeue) => {
            for decided in decided {
                status.set(decided, &now);
            }
            Ok(Outcome {
                status,
                requeue,
                deleted: false,
            })
        }
        Stop::Deleted => Ok(Outcome {
            status,
            requeue: None,
            deleted: true,
        }),
    };
    // Each step goes on with what it found, or says why the reconcile stops.
    macro_rules! step {
        ($step:expr) => {
            match $step {
                Ok(found) => found,
                Err(why) => return stop(status, why),
            }
        };
    }

    let cluster_name = step!(valid_cluster_name(cluster)?);
    let managed_cluster = step!(managed_cluster(addon, cluster, context).await?);
    let configs = step!(configurations(addon, cluster, context).await?);
    // What this cluster has been told so far: kept while its change waits.
    let previous_references = status.config_references.clone();
    let previous_namespace = status.namespace.clone();
    let target = record_configurations(&mut status, &configs, &now)?;

    let ca_pem = step!(hub_ca_bundle(context).await?);
    let install_namespace = step!(valid_install_namespace(addon, &configs, context));
    status.registrations = Some(render::registrations(&ca_pem, cluster));
    status.namespace = Some(install_namespace.clone());
    let owner = apply::owner_reference(addon);
    apply_agent_rbac(context, cluster, owner.clone()).await?;
    status.set(
        Decided::new(
            CONDITION_REGISTRATION_APPLIED,
            CONDITION_TRUE,
            REASON_SET_PERMISSION_APPLIED,
            "Registration of the addon agent is configured",
        ),
        &now,
    );

    // Deployment: a valid MPC and a known entrypoint.
    let rendering = Rendering {
        context,
        cluster_name: &cluster_name,
        managed_cluster: Some(&*managed_cluster),
        ca_pem: &ca_pem,
        owner,
    };
    let desired = step!(desired_work(&rendering, &install_namespace, &configs, &target).await?);
    let works = Api::<ManifestWork>::namespaced(client_of(context), cluster);
    let work_key = ObjectRef::new(MANIFEST_WORK_NAME).within(cluster);
    let current = cache
        .own_works
        .freshest(&work_key, cache.works.get(&work_key))
        .as_deref()
        .cloned();

    // A configuration change reaches an installed agent when its
    // placement's rollout says so; until then its work stays rendered from
    // the configurations it has.
    let strategy = match configs
        .placement
        .as_ref()
        .map(|placement| &placement.strategy)
    {
        None => rollout::Strategy::all(),
        Some(Ok(strategy)) => strategy.clone(),
        // Changes wait (below); the rest of the rollout needs no strategy.
        Some(Err(_)) => rollout::Strategy::all(),
    };
    let changing = current
        .as_ref()
        .is_some_and(|current| rollout::work_config_spec_hash(current) != Some(target.as_str()));
    if let Some(current) = current.as_ref().filter(|_| changing)
        && let rollout::Admission::Wait(why) =
            change_admission(context, cluster, &configs, &target, &now)
    {
        tracing::debug!(%cluster, %why, "the configuration change waits for its turn");
        status.config_references = previous_references;
        let work = keep_previous_work(
            addon,
            cluster,
            context,
            &rendering,
            &configs,
            current,
            &mut status,
            previous_namespace,
        )
        .await?;
        status.set(manifest_applied(work.as_ref()), &now);
        return Ok(Outcome {
            status,
            requeue: Some(rollout::WAITING_RECHECK),
            deleted: false,
        });
    }

    let work = apply_work(cluster, context, &works, current, &desired).await?;
    status.set(manifest_applied(work.as_ref()), &now);
    let requeue = advance_rollout(
        addon,
        context,
        &configs,
        &strategy,
        &target,
        work.as_ref(),
        &mut status,
        &now,
    );
    Ok(Outcome {
        status,
        requeue,
        deleted: false,
    })
}

fn client_of(context: &Context) -> kube::Client {
    context.client.clone()
}

/// Why a reconcile stops before the agent's work is applied.
enum Stop {
    /// These conditions say why; look again after the duration, if any.
    Conditions(Vec<Decided>, Option<Duration>),
    /// The addon was removed with its cluster: no status to write.
    Deleted,
}

impl Stop {
    fn because(decided: Vec<Decided>) -> Self {
        Stop::Conditions(decided, None)
    }
}

/// The cluster's name, when the agent's Service can be named after it.
fn valid_cluster_name(cluster: &str) -> Result<Result<ClusterName, Stop>, AddonError> {
    if !render::is_dns1035_label(cluster) {
        let message = format!(
            "cluster name {cluster:?} is not a DNS-1035 label (a lowercase letter, then lowercase alphanumerics and '-', at most 63): the agent's Service cannot be named after it"
        );
        return Ok(Err(Stop::because(vec![
            Decided::new(
                CONDITION_MANIFEST_APPLIED,
                CONDITION_FALSE,
                REASON_INVALID_CLUSTER_NAME,
                &message,
            ),
            Decided::new(
                CONDITION_REGISTRATION_APPLIED,
                CONDITION_FALSE,
                REASON_INVALID_CLUSTER_NAME,
                message,
            ),
        ])));
    }
    ClusterName::new(cluster)
        .map(Ok)
        .map_err(|_| AddonError::Incomplete("a valid cluster name"))
}

/// The addon's ManagedCluster; when it is gone, the addon we installed for
/// it is removed, and any other addon says so.
async fn managed_cluster(
    addon: &ManagedClusterAddOn,
    cluster: &str,
    context: &Context,
) -> Result<Result<Arc<ManagedCluster>, Stop>, AddonError> {
    let cache = &context.caches.addon;
    let managed_clusters = Api::<ManagedCluster>::all(client_of(context));
    if let Some(found) = cached_or_read(&cache.clusters, &managed_clusters, cluster).await? {
        return Ok(Ok(found));
    }
    let managements = Api::<ClusterManagementAddOn>::all(client_of(context));
    let management = cached_or_read(&cache.managements, &managements, ADDON_NAME).await?;
    if management
        .as_ref()
        .is_some_and(|management| install::installed_by(addon, management))
    {
        tracing::info!(%cluster, "the ManagedCluster is gone; removing the addon installed for it");
        install::delete_addon(&Api::namespaced(client_of(context), cluster)).await?;
        return Ok(Err(Stop::Deleted));
    }
    Ok(Err(Stop::because(vec![Decided::new(
        CONDITION_MANIFEST_APPLIED,
        CONDITION_FALSE,
        REASON_CLUSTER_NOT_FOUND,
        format!("ManagedCluster {cluster} does not exist"),
    )])))
}

/// What the agent is configured by: the MPC, and the AddOnDeploymentConfig
/// if one applies (through the cluster's placement, or the addon's own).
struct Configurations {
    mpc: Arc<ManagedProxyConfiguration>,
    management: Option<Arc<ClusterManagementAddOn>>,
    placement: Option<rollout::ClusterPlacement>,
    adc_ref: Option<DeploymentConfigRef>,
    adc: Option<Arc<AddOnDeploymentConfig>>,
}

/// Reads the configurations; stops when one that applies does not exist.
async fn configurations(
    addon: &ManagedClusterAddOn,
    cluster: &str,
    context: &Context,
) -> Result<Result<Configurations, Stop>, AddonError> {
    let cache = &context.caches.addon;
    let client = &context.client;
    let mpc_name = context.settings.managed_proxy_configuration.as_str();
    let mpc = cached_or_read(&cache.mpcs, &Api::all(client.clone()), mpc_name).await?;
    let Some(mpc) = mpc else {
        return Ok(Err(Stop::because(vec![Decided::new(
            CONDITION_CONFIGURED,
            CONDITION_FALSE,
            REASON_CONFIGURATION_NOT_FOUND,
            format!("ManagedProxyConfiguration {mpc_name} does not exist"),
        )])));
    };
    let managements = Api::<ClusterManagementAddOn>::all(client.clone());
    let management = cached_or_read(&cache.managements, &managements, ADDON_NAME).await?;
    let placement = rollout::placement_of(
        &context.settings,
        &context.caches,
        management.as_deref(),
        cluster,
    );
    let selection = match (&placement, &context.settings.install_strategy) {
        (Some(placement), _) => config::Selection::By(&placement.placement),
        (None, InstallStrategy::Placements(_)) => config::Selection::Unselected,
        (None, InstallStrategy::Manual) => config::Selection::NoPlacements,
    };
    let adc_ref = config::deployment_config_ref(addon, management.as_deref(), selection);
    let adc = match &adc_ref {
        None => None,
        Some(reference) => {
            let api = Api::namespaced(client.clone(), &reference.namespace);
            match cached_or_read(&cache.deployment_configs, &api, &reference.name).await? {
                Some(adc) => Some(adc),
                None => {
                    return Ok(Err(Stop::because(vec![Decided::new(
                        CONDITION_CONFIGURED,
                        CONDITION_FALSE,
                        REASON_CONFIGURATION_NOT_FOUND,
                        format!("AddOnDeploymentConfig {reference} does not exist"),
                    )])));
                }
            }
        }
    };
    Ok(Ok(Configurations {
        mpc,
        management,
        placement,
        adc_ref,
        adc,
    }))
}

/// Records the configurations in `status` (references, `Configured`) and
/// returns their hash, the work's target.
fn record_configurations(
    status: &mut OwnedStatus,
    configs: &Configurations,
    now: &Time,
) -> Result<String, AddonError> {
    let references = config_references(
        &configs.mpc,
        configs.adc_ref.as_ref(),
        configs.adc.as_deref(),
    )?;
    let target = rollout::config_spec_hash(&references);
    status.config_references = Some(references);
    status.set(
        Decided::new(
            CONDITION_CONFIGURED,
            CONDITION_TRUE,
            REASON_CONFIGURED,
            "Configurations configured",
        ),
        now,
    );
    Ok(target)
}

/// The hub CA bundle, whose hash is in the agent's subject: registration
/// needs it.
async fn hub_ca_bundle(context: &Context) -> Result<Result<Vec<u8>, Stop>, AddonError> {
    let cache = &context.caches.addon;
    let secrets = Api::namespaced(client_of(context), &context.settings.hub_namespace);
    let ca_pem = cached_or_read(&cache.hub_secrets, &secrets, CA_BUNDLE_SECRET)
        .await?
        .and_then(|secret| secret.data.as_ref()?.get(CA_BUNDLE_KEY).cloned())
        .map(|bytes| bytes.0)
        .filter(|pem| !pem.is_empty());
    Ok(ca_pem.ok_or_else(|| {
        let message = format!(
            "Secret {}/{CA_BUNDLE_SECRET} has no {CA_BUNDLE_KEY} yet",
            context.settings.hub_namespace
        );
        Stop::because(vec![
            Decided::new(
                CONDITION_REGISTRATION_APPLIED,
                CONDITION_FALSE,
                REASON_CA_NOT_FOUND,
                &message,
            ),
            Decided::new(
                CONDITION_MANIFEST_APPLIED,
                CONDITION_FALSE,
                REASON_CA_NOT_FOUND,
                message,
            ),
        ])
    }))
}

/// The namespace the agent is installed in, when it is a valid one.
fn valid_install_namespace(
    addon: &ManagedClusterAddOn,
    configs: &Configurations,
    context: &Context,
) -> Result<String, Stop> {
    let install_namespace = render::install_namespace(
        addon,
        configs.adc.as_deref(),
        &context.settings.agent_install_namespace,
    );
    if !is_dns1123_label(&install_namespace) {
        return Err(Stop::because(vec![Decided::new(
            CONDITION_MANIFEST_APPLIED,
            CONDITION_FALSE,
            REASON_INVALID_INSTALL_NAMESPACE,
            format!("install namespace {install_namespace:?} is not a DNS-1123 label"),
        )]));
    }
    Ok(install_namespace)
}

/// Applies the addon agent's Role and RoleBinding in the cluster's
/// namespace on the hub, unless they already are as rendered.
async fn apply_agent_rbac(
    context: &Context,
    cluster: &str,
    owner: Option<OwnerReference>,
) -> Result<(), AddonError> {
    let cache = &context.caches.addon;
    let (role, binding) = render::hub_agent_rbac(cluster, owner);
    let roles = Api::<Role>::namespaced(client_of(context), cluster);
    let role_key = ObjectRef::new(AGENT_RBAC_NAME).within(cluster);
    let current_role = cache
        .own_roles
        .freshest(&role_key, cache.roles.get(&role_key));
    if !current_role.as_ref().is_some_and(|current| {
        current.rules == role.rules
            && current.metadata.owner_references == role.metadata.owner_references
    }) {
        cache
            .own_roles
            .wrote(current_role.as_deref(), apply::apply(&roles, &role).await?);
    }
    let bindings = Api::<RoleBinding>::namespaced(client_of(context), cluster);
    let binding_key = ObjectRef::new(AGENT_RBAC_NAME).within(cluster);
    let current_binding = cache
        .own_role_bindings
        .freshest(&binding_key, cache.role_bindings.get(&binding_key));
    if !current_binding.as_ref().is_some_and(|current| {
        current.subjects == binding.subjects
            && current.role_ref == binding.role_ref
            && current.metadata.owner_references == binding.metadata.owner_references
    }) {
        cache.own_role_bindings.wrote(
            current_binding.as_deref(),
            apply::apply(&bindings, &binding).await?,
        );
    }
    Ok(())
}

/// The agent's work as the configurations render it; stops when they cannot.
async fn desired_work(
    rendering: &Rendering<'_>,
    install_namespace: &str,
    configs: &Configurations,
    target: &str,
) -> Result<Result<ManifestWork, Stop>, AddonError> {
    let applied = AppliedConfigurations::of(
        &configs.mpc,
        configs.adc_ref.as_ref(),
        configs.adc.as_deref(),
    )
    .to_annotation()
    .map_err(|error| AddonError::Render(work::ManifestError::Serialize(error)))?;
    Ok(rendering
        .work(
            install_namespace,
            &configs.mpc,
            configs.adc.as_deref(),
            target,
            &applied,
        )
        .await?
        .map_err(|refused| Stop::Conditions(vec![refused.condition], refused.requeue)))
}

/// Whether the placement's rollout lets the cluster's configuration change
/// through now.
fn change_admission(
    context: &Context,
    cluster: &str,
    configs: &Configurations,
    target: &str,
    now: &Time,
) -> rollout::Admission {
    match &configs.placement {
        Some(rollout::ClusterPlacement {
            strategy: Err(invalid),
            ..
        }) => {
            tracing::warn!(%cluster, %invalid, "the placement's rolloutStrategy cannot be followed; the configuration change waits");
            rollout::Admission::Wait(format!("invalid rolloutStrategy: {invalid}"))
        }
        Some(rollout::ClusterPlacement {
            placement,
            strategy: Ok(strategy),
        }) if strategy.kind != rollout::RolloutKind::All => context.rollouts.decide(
            placement,
            strategy,
            cluster,
            target,
            || {
                rollout::members(
                    &context.settings,
                    &context.caches,
                    placement,
                    strategy,
                    &configs.mpc,
                    configs.management.as_deref(),
                    now.0,
                )
            },
            now.0,
        ),
        _ => rollout::Admission::Admit,
    }
}

/// For a cluster whose change waits: its work as rendered from the
/// configurations it has (applied again if it drifted), or as it is when
/// it cannot be rendered from them. Sets the status's namespace to match.
#[allow(clippy::too_many_arguments)]
async fn keep_previous_work(
    addon: &ManagedClusterAddOn,
    cluster: &str,
    context: &Context,
    rendering: &Rendering<'_>,
    configs: &Configurations,
    current: &ManifestWork,
    status: &mut OwnedStatus,
    previous_namespace: Option<String>,
) -> Result<Option<ManifestWork>, AddonError> {
    let cache = &context.caches.addon;
    Ok(
        match rendering
            .previous_work(addon, current, &configs.mpc)
            .await?
        {
            Ok(previous) if is_current(current, &previous.work) => {
                status.namespace = Some(previous.install_namespace);
                Some(current.clone())
            }
            Ok(previous) => {
                tracing::info!(%cluster, "applying the agent ManifestWork of a cluster waiting for its turn, from the configurations it has");
                status.namespace = Some(previous.install_namespace);
                let works = Api::<ManifestWork>::namespaced(client_of(context), cluster);
                let written = apply::apply(&works, &previous.work).await?;
                Some(Arc::unwrap_or_clone(
                    cache.own_works.wrote(Some(current), written),
                ))
            }
            Err(unrecorded @ NotRerendered::Unrecorded) => {
                tracing::debug!(%cluster, why = %unrecorded, "the work of a cluster waiting for its turn is left as it is");
                status.namespace = previous_namespace;
                Some(current.clone())
            }
            Err(why) => {
                tracing::warn!(%cluster, %why, "the work of a cluster waiting for its turn cannot be rendered from the configurations it has; it is left as it is");
                status.namespace = previous_namespace;
                Some(current.clone())
            }
        },
    )
}

/// Applies `desired` unless `current` already is it; the work as it is now.
async fn apply_work(
    cluster: &str,
    context: &Context,
    works: &Api<ManifestWork>,
    current: Option<ManifestWork>,
    desired: &ManifestWork,
) -> Result<Option<ManifestWork>, AddonError> {
    let up_to_date = current
        .as_ref()
        .is_some_and(|current| is_current(current, desired));
    if up_to_date {
        return Ok(current);
    }
    tracing::info!(%cluster, "applying the agent ManifestWork");
    let written = apply::apply(works, desired).await?;
    Ok(Some(Arc::unwrap_or_clone(
        context
            .caches
            .addon
            .own_works
            .wrote(current.as_ref(), written),
    )))
}

/// Records the rollout's phase of the cluster (`Progressing`), wakes a
/// cluster waiting for the place this one frees, and returns when to look
/// again.
#[allow(clippy::too_many_arguments)]
fn advance_rollout(
    addon: &ManagedClusterAddOn,
    context: &Context,
    configs: &Configurations,
    strategy: &rollout::Strategy,
    target: &str,
    work: Option<&ManifestWork>,
    status: &mut OwnedStatus,
    now: &Time,
) -> Option<Duration> {
    let rollout_strategy_valid = configs
        .placement
        .as_ref()
        .is_none_or(|placement| placement.strategy.is_ok());
    let phase = rollout::phase(target, work, addon, strategy, now.0);
    if let Some(progressing) = progressing_condition(&phase) {
        status.set(progressing, now);
    }
    let requeue = phase.next_check(strategy, now.0);
    let recorded =
        cluster_proxy_proto::api::find_condition(addon.conditions(), CONDITION_PROGRESSING);
    if let Some(placement) = configs
        .placement
        .as_ref()
        .filter(|_| rollout_strategy_valid && phase.frees_a_place(recorded, strategy, now.0))
    {
        // This cluster's progress may free a place for one waiting.
        context.rollouts.wake(
            &placement.placement,
            strategy,
            || {
                rollout::members(
                    &context.settings,
                    &context.caches,
                    &placement.placement,
                    strategy,
                    &configs.mpc,
                    configs.management.as_deref(),
                    now.0,
                )
            },
            now.0,
        );
    }
    requeue
}

/// Whether `current` already is `desired`: the same spec and owner, and
/// every label and annotation `desired` sets (others may add theirs).
fn is_current(current: &ManifestWork, desired: &ManifestWork) -> bool {
    current.spec == desired.spec
        && current.metadata.owner_references == desired.metadata.owner_references
        && desired
            .metadata
            .labels
            .iter()
            .flatten()
            .all(|(key, value)| current.labels().get(key) == Some(value))
        && desired
            .metadata
            .annotations
            .iter()
            .flatten()
            .all(|(key, value)| current.annotations().get(key) == Some(value))
}

/// Why the agent cannot be rendered: the `ManifestApplied` condition that
/// says so, and when to look again.
struct Refused {
    condition: Decided,
    requeue: Option<Duration>,
}

impl Refused {
    fn new(reason: &str, message: impl Into<String>) -> Self {
        Self {
            condition: Decided::new(CONDITION_MANIFEST_APPLIED, CONDITION_FALSE, reason, message),
            requeue: None,
        }
    }
}

/// Why a waiting cluster's work is not rendered again.
#[derive(Debug, thiserror::Error)]
enum NotRerendered {
    /// Written by an addon-manager that did not record them.
    #[error("the work does not record the configurations it was rendered from")]
    Unrecorded,
    #[error(transparent)]
    Damaged(#[from] super::applied::AppliedConfigurationsError),
    #[error("{0}")]
    Refused(String),
}

/// A waiting cluster's work, rendered from the configurations it has.
struct PreviousWork {
    work: ManifestWork,
    install_namespace: String,
}

/// What one cluster's agent is rendered with, but for its configurations.
struct Rendering<'a> {
    context: &'a Context,
    cluster_name: &'a ClusterName,
    managed_cluster: Option<&'a ManagedCluster>,
    ca_pem: &'a [u8],
    owner: Option<OwnerReference>,
}

impl Rendering<'_> {
    /// The agent's work rendered from `mpc` and `adc`, annotated with them.
    async fn work(
        &self,
        install_namespace: &str,
        mpc: &ManagedProxyConfiguration,
        adc: Option<&AddOnDeploymentConfig>,
        config_spec_hash: &str,
        applied_configurations: &str,
    ) -> Result<Result<ManifestWork, Refused>, AddonError> {
        let context = self.context;
        if let Err(invalid) = mpc.spec.validate() {
            return Ok(Err(Refused::new(
                REASON_INVALID_CONFIGURATION,
                invalid.to_string(),
            )));
        }
        let agent_image = context.settings.agent_image.as_deref();
        let customization = match AgentCustomization::new(
            agent_image.unwrap_or(&mpc.spec.proxy_agent.image),
            adc,
            self.managed_cluster,
        ) {
            Ok(customization) => customization,
            Err(invalid) => {
                let reason = match invalid {
                    CustomizationError::ImageRegistries { .. } => REASON_INVALID_IMAGE_REGISTRIES,
                    CustomizationError::NodeSelector { .. } => REASON_INVALID_NODE_SELECTOR,
                    CustomizationError::ContainerIdShape { .. }
                    | CustomizationError::ContainerIdPattern { .. } => {
                        REASON_INVALID_RESOURCE_REQUIREMENTS
                    }
                };
                return Ok(Err(Refused::new(reason, invalid.to_string())));
            }
        };
        let load_balancer = match render::load_balancer_service(mpc) {
            None => None,
            // The hub namespace's Services are cached (and watched); a load
            // balancer elsewhere is read, and looked at again on a timer.
            Some((namespace, name)) if namespace == context.settings.hub_namespace => context
                .caches
                .addon
                .hub_services
                .get(&ObjectRef::new(&name).within(&namespace))
                .as_deref()
                .cloned(),
            Some((namespace, name)) => {
                get_opt(
                    &Api::<Service>::namespaced(context.client.clone(), &namespace),
                    &name,
                )
                .await?
            }
        };
        let entrypoint = match render::entrypoint(mpc, load_balancer.as_ref()) {
            Ok(entrypoint) => entrypoint,
            Err(pending) => {
                return Ok(Err(Refused {
                    requeue: Some(ENTRYPOINT_RETRY),
                    ..Refused::new(REASON_ENTRYPOINT_NOT_READY, pending.to_string())
                }));
            }
        };
        let service_proxy_secret = context
            .settings
            .enable_service_proxy
            .then(|| {
                context.caches.addon.service_proxy_secrets.get(
                    &ObjectRef::new(SERVICE_PROXY_SECRET_NAME)
                        .within(&context.settings.hub_namespace),
                )
            })
            .flatten();
        let service_proxy = service_proxy_secret.as_deref().and_then(|secret| {
            let data = secret.data.as_ref()?;
            Some(render::ServiceProxyInputs {
                cert_pem: &data.get("tls.crt")?.0,
                key_pem: &data.get("tls.key")?.0,
            })
        });
        if context.settings.enable_service_proxy && service_proxy.is_none() {
            // cert-authority issues it once the MPC sets spec.userServer;
            // its watch renders every agent again when it appears.
            tracing::debug!(
                cluster = %self.cluster_name,
                "no service-proxy certificate (Secret {}/{SERVICE_PROXY_SECRET_NAME}) yet: the agent goes without its service-proxy",
                context.settings.hub_namespace
            );
        }
        if let Err(invalid) = render::agent_transport(adc) {
            return Ok(Err(Refused::new(REASON_INVALID_CONFIGURATION, invalid)));
        }
        if let Err(invalid) = render::agent_telemetry(adc) {
            return Ok(Err(Refused::new(REASON_INVALID_CONFIGURATION, invalid)));
        }
        let impersonation = match service_proxy.map(|_| render::impersonation(adc)) {
            None => false,
            Some(Ok(impersonation)) => impersonation,
            Some(Err(invalid)) => {
                return Ok(Err(Refused::new(REASON_INVALID_CONFIGURATION, invalid)));
            }
        };
        let inputs = AgentInputs {
            cluster: self.cluster_name,
            install_namespace,
            mpc,
            deployment_config: adc,
            entrypoint: &entrypoint,
            ca_pem: self.ca_pem,
            customization: &customization,
            kube_api_proxy: context.settings.enable_kube_api_proxy,
            network_policy: context
                .settings
                .enable_network_policies
                .then_some(context.settings.agent_kube_apiserver_ports.as_slice()),
            image_pull_policy: context.settings.image_pull_policy.as_deref(),
            service_proxy,
            impersonation,
        };
        let mut desired = render::manifest_work(&inputs, self.owner.clone())?;
        let annotations = desired
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        annotations.insert(
            rollout::ANNOTATION_CONFIG_SPEC_HASH.to_owned(),
            config_spec_hash.to_owned(),
        );
        annotations.insert(
            ANNOTATION_APPLIED_CONFIGURATIONS.to_owned(),
            applied_configurations.to_owned(),
        );
        Ok(Ok(desired))
    }

    /// `current` rendered again from the configurations it records, with
    /// everything else as it is now; or why it cannot be.
    async fn previous_work(
        &self,
        addon: &ManagedClusterAddOn,
        current: &ManifestWork,
        mpc: &ManagedProxyConfiguration,
    ) -> Result<Result<PreviousWork, NotRerendered>, AddonError> {
        let applied = match AppliedConfigurations::of_work(current) {
            Ok(Some(applied)) => applied,
            Ok(None) => return Ok(Err(NotRerendered::Unrecorded)),
            Err(damaged) => return Ok(Err(damaged.into())),
        };
        let (Some(config_spec_hash), Some(applied_text)) = (
            rollout::work_config_spec_hash(current),
            current.annotations().get(ANNOTATION_APPLIED_CONFIGURATIONS),
        ) else {
            return Ok(Err(NotRerendered::Unrecorded));
        };
        let previous_mpc = applied.proxy_configuration(mpc);
        let previous_adc = applied.deployment_config();
        let install_namespace = render::install_namespace(
            addon,
            previous_adc.as_ref(),
            &self.context.settings.agent_install_namespace,
        );
        if !is_dns1123_label(&install_namespace) {
            return Ok(Err(NotRerendered::Refused(format!(
                "install namespace {install_namespace:?} is not a DNS-1123 label"
            ))));
        }
        Ok(self
            .work(
                &install_namespace,
                &previous_mpc,
                previous_adc.as_ref(),
                config_spec_hash,
                applied_text,
            )
            .await?
            .map(|work| PreviousWork {
                work,
                install_namespace,
            })
            .map_err(|refused| NotRerendered::Refused(refused.condition.message)))
    }
}

/// The addon's `Progressing` condition for its cluster's rollout `phase`.
fn progressing_condition(phase: &rollout::Phase) -> Option<Decided> {
    match phase {
        rollout::Phase::ToApply => None,
        rollout::Phase::Progressing { .. } => Some(Decided::new(
            CONDITION_PROGRESSING,
            CONDITION_TRUE,
            REASON_PROGRESSING,
            "applying the configurations: waiting for the work to be applied and available and the addon to be Available",
        )),
        rollout::Phase::Succeeded { .. } => Some(Decided::new(
            CONDITION_PROGRESSING,
            CONDITION_FALSE,
            REASON_COMPLETED,
            "the configurations are applied and the addon is available",
        )),
        rollout::Phase::Failed { message } => Some(Decided::new(
            CONDITION_PROGRESSING,
            CONDITION_FALSE,
            REASON_FAILED,
            message.clone(),
        )),
    }
}

fn config_references(
    mpc: &ManagedProxyConfiguration,
    adc_ref: Option<&DeploymentConfigRef>,
    adc: Option<&AddOnDeploymentConfig>,
) -> Result<Vec<cluster_proxy_proto::api::addon::v1alpha1::ConfigReference>, AddonError> {
    let hash = |result: Result<String, serde_json::Error>| {
        result.map_err(|error| {
            AddonError::Render(cluster_proxy_proto::api::work::v1::ManifestError::Serialize(error))
        })
    };
    let mut references = vec![config::mpc_reference(
        &mpc.name_any(),
        hash(config::spec_hash(&mpc.spec))?,
    )];
    if let (Some(reference), Some(adc)) = (adc_ref, adc) {
        references.push(config::adc_reference(
            reference,
            hash(config::spec_hash(&adc.spec))?,
        ));
    }
    Ok(references)
}

/// `ManifestApplied` from the work's `Applied` condition, which the
/// cluster's work agent writes.
fn manifest_applied(work: Option<&ManifestWork>) -> Decided {
    let applied = work
        .and_then(|work| work.status.as_ref())
        .and_then(|status| status.conditions.as_deref())
        .and_then(|conditions| {
            cluster_proxy_proto::api::find_condition(conditions, work::CONDITION_APPLIED)
        });
    match applied {
        Some(condition) if condition.status == CONDITION_TRUE => Decided::new(
            CONDITION_MANIFEST_APPLIED,
            CONDITION_TRUE,
            REASON_MANIFESTS_APPLIED,
            "manifests of addon are applied successfully",
        ),
        Some(condition) if condition.status == CONDITION_FALSE => Decided::new(
            CONDITION_MANIFEST_APPLIED,
            CONDITION_FALSE,
            REASON_MANIFESTS_APPLY_FAILED,
            format!(
                "work {MANIFEST_WORK_NAME} is not applied: {}",
                condition.message
            ),
        ),
        _ => Decided::new(
            CONDITION_MANIFEST_APPLIED,
            CONDITION_UNKNOWN,
            REASON_MANIFEST_APPLYING,
            format!("work {MANIFEST_WORK_NAME} is created; its agent has not reported yet"),
        ),
    }
}

/// Retries: at once after a conflict, else with a short backoff.
pub fn error_policy(
    addon: Arc<ManagedClusterAddOn>,
    error: &AddonError,
    context: Arc<Context>,
) -> Action {
    let namespace = addon.metadata.namespace.as_deref().unwrap_or_default();
    let object = format!("{namespace}/{}", addon.name_any());
    requeue_failed(&context.metrics, CONTROLLER, &object, error)
}

/// The ManagedClusterAddOn controller, as a stream of reconcile results.
/// Every watch fills a cache of [`super::cache::AddonCache`] before its
/// event triggers a reconcile.
pub fn controller(
    context: Arc<Context>,
    writers: AddonCacheWriters,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> impl Stream<Item = ()> + Send {
    let client = context.client.clone();
    let by_name = watcher::Config::default().fields(&format!("metadata.name={ADDON_NAME}"));
    let rbac_by_name =
        watcher::Config::default().fields(&format!("metadata.name={AGENT_RBAC_NAME}"));
    let hub_namespace = context.settings.hub_namespace.clone();
    let ca_secret = watcher::Config::default().fields(&format!("metadata.name={CA_BUNDLE_SECRET}"));
    let service_proxy_secret =
        watcher::Config::default().fields(&format!("metadata.name={SERVICE_PROXY_SECRET_NAME}"));
    // Any of these changes every addon's rendering.
    let everything = stream::select_all(vec![
        reflected_triggers(
            writers.mpcs,
            None,
            watcher(
                Api::<ManagedProxyConfiguration>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .boxed(),
        reflected_triggers(
            writers.hub_secrets,
            None,
            watcher(
                Api::<Secret>::namespaced(client.clone(), &hub_namespace),
                ca_secret,
            ),
        )
        .boxed(),
        reflected_triggers(
            writers.service_proxy_secrets,
            None,
            watcher(
                Api::<Secret>::namespaced(client.clone(), &hub_namespace),
                service_proxy_secret,
            ),
        )
        .boxed(),
        reflected_triggers(
            writers.deployment_configs,
            None,
            watcher(
                Api::<AddOnDeploymentConfig>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .boxed(),
        reflected_triggers(
            writers.managements,
            None,
            watcher(
                Api::<ClusterManagementAddOn>::all(client.clone()),
                by_name.clone(),
            ),
        )
        .boxed(),
        reflected_triggers(
            writers.hub_services,
            None,
            watcher(
                Api::<Service>::namespaced(client.clone(), &hub_namespace),
                watcher::Config::default(),
            ),
        )
        .boxed(),
    ]);
    let own = &context.caches.addon;
    let works = reflected_objects(
        writers.works,
        Some(own.own_works.clone()),
        watcher(
            Api::<ManifestWork>::all(client.clone()),
            watcher::Config::default().labels(&format!(
                "{}={ADDON_NAME}",
                cluster_proxy_proto::api::addon::v1alpha1::LABEL_ADDON_NAME
            )),
        ),
    );
    let roles = reflected_objects(
        writers.roles,
        Some(own.own_roles.clone()),
        watcher(Api::<Role>::all(client.clone()), rbac_by_name.clone()),
    );
    let role_bindings = reflected_objects(
        writers.role_bindings,
        Some(own.own_role_bindings.clone()),
        watcher(Api::<RoleBinding>::all(client.clone()), rbac_by_name),
    );
    let clusters = reflected_objects(
        writers.clusters,
        None,
        watcher(
            Api::<ManagedCluster>::all(client.clone()),
            watcher::Config::default(),
        ),
    );
    let mut controller = Controller::new(Api::<ManagedClusterAddOn>::all(client), by_name);
    if let Some(turns) = context.rollouts.triggers() {
        // Clusters whose turn in a rollout has come.
        controller = controller.reconcile_on(turns);
    }
    controller
        .owns_stream(works)
        .owns_stream(roles)
        .owns_stream(role_bindings)
        .watches_stream(clusters, |cluster| {
            Some(ObjectRef::<ManagedClusterAddOn>::new(ADDON_NAME).within(&cluster.name_any()))
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
                tracing::debug!(%error, "addon controller event");
            }
        })
}
