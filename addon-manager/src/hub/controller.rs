//! The reconcile loop: validate the MPC, apply what [`render`] produces,
//! delete what it no longer produces, and write the conditions this
//! controller owns.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster_proxy_proto::api::proxy::v1alpha1::{
    CONDITION_PROXY_SERVER_DEPLOYED, InvalidSpec, ManagedProxyConfiguration,
    ManagedProxyConfigurationStatus, REASON_INVALID_SPEC, REASON_NOT_YET_DEPLOYED,
    REASON_SUCCESSFULLY_DEPLOYED,
};
use cluster_proxy_proto::api::{
    CONDITION_FALSE, CONDITION_TRUE, Condition, find_condition, is_condition_true,
};
use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::metrics::{HubMetrics, ReconcileResult};
use super::render::{
    ADDON_NAME, HubObjects, HubRenderOptions, LABEL_ADDON, RenderError, load_balancer_host,
    render_with,
};
use super::telemetry::ProxyServerTelemetry;
use super::tls_profile::{
    REASON_INVALID_TLS_PROFILE, TLS_PROFILE_CONFIGMAP, TlsProfile, TlsProfileError,
};
use crate::apply::{ApplyError, FIELD_MANAGER, apply, is_conflict, is_not_found};

/// How the hub controller paces itself.
#[derive(Debug, Clone)]
pub struct HubSettings {
    /// Reconcile every MPC this often even without events (a safety net; drift
    /// is healed from watch events).
    pub resync: Duration,
    /// How soon to look again while the LoadBalancer Service has no address.
    pub load_balancer_poll: Duration,
    /// First delay after a failed reconcile; doubled per consecutive failure.
    pub backoff_initial: Duration,
    /// Longest delay between retries of a failing reconcile.
    pub backoff_max: Duration,
    /// Conflicts (409) in a row that are retried at once before backing off.
    pub immediate_conflict_retries: u32,
    /// Where OCM's TLS profile ConfigMap ([`TLS_PROFILE_CONFIGMAP`]) is read
    /// and watched: addon-manager's own namespace. `None`: no profile.
    pub tls_profile_namespace: Option<String>,
    /// The proxy-server container's `imagePullPolicy`; `None`: Kubernetes'
    /// default.
    pub image_pull_policy: Option<String>,
    /// The proxy-servers' trace export (off by default).
    pub proxy_server_telemetry: ProxyServerTelemetry,
}

impl Default for HubSettings {
    fn default() -> Self {
        HubSettings {
            resync: Duration::from_secs(300),
            load_balancer_poll: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(300),
            immediate_conflict_retries: 3,
            tls_profile_namespace: None,
            image_pull_policy: None,
            proxy_server_telemetry: ProxyServerTelemetry::default(),
        }
    }
}

/// Why a reconcile failed; the error policy retries it.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Render(#[from] RenderError),
    #[error("{action} {kind} {name}: {source}")]
    Api {
        action: &'static str,
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl HubError {
    fn api(action: &'static str, kind: &str, name: &str, source: kube::Error) -> Self {
        HubError::Api {
            action,
            kind: kind.to_owned(),
            name: name.to_owned(),
            source,
        }
    }

    /// The API's answer behind this error, when there was one.
    pub fn api_error(&self) -> Option<&kube::Error> {
        match self {
            HubError::Apply(error) => error.api_error(),
            HubError::Api { source, .. } => Some(source),
            HubError::Render(_) => None,
        }
    }

    /// A 409: another writer changed the object; retrying with fresh data succeeds.
    pub fn is_conflict(&self) -> bool {
        self.api_error().is_some_and(is_conflict)
    }
}

struct Context {
    client: kube::Client,
    settings: HubSettings,
    metrics: HubMetrics,
    /// Consecutive failed reconciles per MPC name, for the backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    fn record_failure(&self, name: &str) -> u32 {
        let mut failures = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = failures.entry(name.to_owned()).or_default();
        *count = count.saturating_add(1);
        *count
    }

    fn clear_failures(&self, name: &str) {
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(name);
    }
}

/// How long to wait before retrying after the `failures`-th consecutive
/// failure: conflicts at once (a few times), everything else doubling from
/// `backoff_initial` up to `backoff_max`.
pub fn retry_delay(settings: &HubSettings, conflict: bool, failures: u32) -> Duration {
    if conflict && failures <= settings.immediate_conflict_retries {
        return Duration::ZERO;
    }
    let exponent = failures.saturating_sub(1).min(30);
    settings
        .backoff_initial
        .saturating_mul(1u32 << exponent)
        .min(settings.backoff_max)
}

/// Runs the hub controller until `shutdown` completes: every
/// `ManagedProxyConfiguration` is kept deployed as [`render`] says, and the
/// objects it owns are watched so that an edited or deleted one is put back
/// at once.
pub async fn run(
    client: kube::Client,
    settings: HubSettings,
    metrics: HubMetrics,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let owned = watcher::Config::default().labels(&format!("{LABEL_ADDON}={ADDON_NAME}"));
    let controller = Controller::new(
        Api::<ManagedProxyConfiguration>::all(client.clone()),
        watcher::Config::default(),
    );
    let configurations = controller.store();
    // Any change of the TLS profile concerns every configuration.
    let controller = match &settings.tls_profile_namespace {
        Some(namespace) => {
            let profile = watcher::Config::default()
                .fields(&format!("metadata.name={TLS_PROFILE_CONFIGMAP}"));
            let events = watcher(
                Api::<ConfigMap>::namespaced(client.clone(), namespace),
                profile,
            )
            .default_backoff()
            .filter_map(|event| async move { event.ok().map(|_| ()) });
            controller.reconcile_all_on(events)
        }
        None => controller,
    };
    let context = Arc::new(Context {
        client: client.clone(),
        settings,
        metrics,
        failures: Mutex::new(HashMap::new()),
    });
    controller
        .owns(Api::<Deployment>::all(client.clone()), owned.clone())
        .owns(Api::<Service>::all(client.clone()), owned.clone())
        .owns(Api::<ServiceAccount>::all(client.clone()), owned.clone())
        .owns(Api::<Role>::all(client.clone()), owned.clone())
        .owns(Api::<RoleBinding>::all(client.clone()), owned.clone())
        // The Namespace has no owner reference (see `render`), so it maps to
        // the configurations that deploy into it.
        .watches(Api::<Namespace>::all(client), owned, move |namespace| {
            let name = namespace.name_any();
            configurations
                .state()
                .into_iter()
                .filter(|mpc| mpc.spec.proxy_server.namespace == name)
                .map(|mpc| ObjectRef::from_obj(&*mpc))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(shutdown)
        .run(
            |object, context| crate::trace::traced("hub", object, context, reconcile),
            error_policy,
            context,
        )
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => tracing::debug!(configuration = %object.name, "reconciled"),
                Err(error) => tracing::warn!(%error, "hub controller"),
            }
        })
        .await;
}

async fn reconcile(
    mpc: Arc<ManagedProxyConfiguration>,
    context: Arc<Context>,
) -> Result<Action, HubError> {
    let started = Instant::now();
    let name = mpc.name_any();
    let outcome = reconcile_inner(&mpc, &context).await;
    let result = match &outcome {
        Ok(Outcome::Deployed(_)) => ReconcileResult::Success,
        Ok(Outcome::Invalid) => ReconcileResult::Invalid,
        Err(_) => ReconcileResult::Error,
    };
    context.metrics.observe(result, started.elapsed());
    match outcome {
        Ok(Outcome::Deployed(action)) => {
            context.clear_failures(&name);
            Ok(action)
        }
        Ok(Outcome::Invalid) => {
            context.clear_failures(&name);
            // Nothing changes until the user edits the spec, which is an event.
            Ok(Action::await_change())
        }
        Err(error) => Err(error),
    }
}

fn error_policy(
    mpc: Arc<ManagedProxyConfiguration>,
    error: &HubError,
    context: Arc<Context>,
) -> Action {
    let failures = context.record_failure(&mpc.name_any());
    let delay = retry_delay(&context.settings, error.is_conflict(), failures);
    tracing::warn!(
        configuration = %mpc.name_any(),
        %error,
        failures,
        retry_in = ?delay,
        "reconcile failed"
    );
    Action::requeue(delay)
}

enum Outcome {
    Deployed(Action),
    Invalid,
}

async fn reconcile_inner(
    mpc: &ManagedProxyConfiguration,
    context: &Context,
) -> Result<Outcome, HubError> {
    if mpc.metadata.deletion_timestamp.is_some() {
        // Garbage collection removes what the MPC owns.
        return Ok(Outcome::Deployed(Action::await_change()));
    }
    if let Some(invalid) = mpc.spec.validate().err().and_then(hub_problems) {
        tracing::info!(configuration = %mpc.name_any(), %invalid, "not deploying an invalid configuration");
        write_status(context, mpc, invalid_condition(&invalid)).await?;
        return Ok(Outcome::Invalid);
    }
    let tls = match read_tls_profile(context).await? {
        Ok(tls) => tls,
        Err(problem) => {
            tracing::warn!(configuration = %mpc.name_any(), %problem, "not deploying with a TLS profile the proxy-servers cannot follow");
            write_status(context, mpc, invalid_tls_profile_condition(&problem)).await?;
            return Ok(Outcome::Invalid);
        }
    };
    let options = HubRenderOptions {
        tls_profile: tls,
        image_pull_policy: context.settings.image_pull_policy.clone(),
        telemetry: context.settings.proxy_server_telemetry.clone(),
    };
    let objects = render_with(mpc, &options)?;
    match apply_all(mpc, &objects, context).await {
        Ok(action) => Ok(Outcome::Deployed(action)),
        Err(error) => {
            let deployed = mpc.status.as_ref().is_some_and(|status| {
                is_condition_true(&status.conditions, CONDITION_PROXY_SERVER_DEPLOYED)
            });
            if !deployed && !error.is_conflict() {
                // Best effort: the reconcile is retried whatever this write does.
                if let Err(status_error) =
                    write_status(context, mpc, not_yet_deployed_condition(error.to_string())).await
                {
                    tracing::debug!(%status_error, "could not report the failure in the status");
                }
            }
            Err(error)
        }
    }
}

async fn apply_all(
    mpc: &ManagedProxyConfiguration,
    objects: &HubObjects,
    context: &Context,
) -> Result<Action, HubError> {
    let client = &context.client;
    let namespace = super::render::namespace_of(mpc);

    apply(&Api::<Namespace>::all(client.clone()), &objects.namespace).await?;
    apply(
        &Api::<ServiceAccount>::namespaced(client.clone(), namespace),
        &objects.service_account,
    )
    .await?;
    let deployment = apply(
        &Api::<Deployment>::namespaced(client.clone(), namespace),
        &objects.deployment,
    )
    .await?;
    let services = Api::<Service>::namespaced(client.clone(), namespace);
    apply(&services, &objects.in_cluster_service).await?;
    apply(&services, &objects.peer_service).await?;
    let load_balancer = match &objects.load_balancer_service {
        Some(service) => Some(apply(&services, service).await?),
        None => None,
    };
    if let Some(role) = &objects.port_forward_role {
        apply(&Api::<Role>::namespaced(client.clone(), namespace), role).await?;
    }
    if let Some(binding) = &objects.port_forward_role_binding {
        apply(
            &Api::<RoleBinding>::namespaced(client.clone(), namespace),
            binding,
        )
        .await?;
    }
    prune_unwanted(client, mpc, objects).await?;

    let replicas = deployment
        .status
        .as_ref()
        .and_then(|status| status.replicas)
        .unwrap_or(0);
    let mut message = format!("Replicas: {replicas}");
    let mut action = Action::requeue(context.settings.resync);
    if let Some(service) = &load_balancer
        && load_balancer_host(service).is_none()
    {
        message.push_str(&format!(
            "; LoadBalancer Service {namespace}/{} has no address yet, so agents have nothing to dial",
            service.name_any()
        ));
        action = Action::requeue(context.settings.load_balancer_poll);
    }
    let condition = Condition {
        type_: CONDITION_PROXY_SERVER_DEPLOYED.to_owned(),
        status: CONDITION_TRUE.to_owned(),
        reason: REASON_SUCCESSFULLY_DEPLOYED.to_owned(),
        message,
        observed_generation: mpc.metadata.generation,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    };
    write_status(context, mpc, condition).await?;
    Ok(action)
}

/// Fields whose problems stop the proxy-server deployment. The rest of the
/// spec (the agent, the signer, SANs) is read by the addon controller and
/// cert-authority, which report their own problems; a bad agent image must
/// not take the hub's proxy-servers down with it.
const HUB_FIELDS: &[&str] = &[
    "spec.proxyServer",
    "spec.deploy",
    "spec.authentication.dump",
];

/// The problems of `invalid` that concern what this controller deploys.
pub fn hub_problems(invalid: InvalidSpec) -> Option<InvalidSpec> {
    let problems: Vec<_> = invalid
        .problems
        .into_iter()
        .filter(|problem| {
            HUB_FIELDS.iter().any(|prefix| {
                problem
                    .field
                    .strip_prefix(prefix)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
            })
        })
        .collect();
    (!problems.is_empty()).then_some(InvalidSpec { problems })
}

/// Longest condition message we write; the CRD allows 32768 and people read
/// it in `kubectl describe`.
const MAX_MESSAGE_BYTES: usize = 4096;

fn truncate_message(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str(" …");
    }
    message
}

/// OCM's TLS profile in [`HubSettings::tls_profile_namespace`]: none when
/// that is unset or the ConfigMap does not exist; the inner error when the
/// proxy-servers cannot follow it.
async fn read_tls_profile(
    context: &Context,
) -> Result<Result<TlsProfile, TlsProfileError>, HubError> {
    let Some(namespace) = &context.settings.tls_profile_namespace else {
        return Ok(Ok(TlsProfile::default()));
    };
    let configmap = Api::<ConfigMap>::namespaced(context.client.clone(), namespace)
        .get_opt(TLS_PROFILE_CONFIGMAP)
        .await
        .map_err(|source| HubError::api("reading", "ConfigMap", TLS_PROFILE_CONFIGMAP, source))?;
    Ok(match configmap.and_then(|configmap| configmap.data) {
        Some(data) => TlsProfile::from_data(&data),
        None => Ok(TlsProfile::default()),
    })
}

/// `ProxyServerDeployed=False` with `reason` and `message`.
fn not_deployed(reason: &str, message: String) -> Condition {
    Condition {
        type_: CONDITION_PROXY_SERVER_DEPLOYED.to_owned(),
        status: CONDITION_FALSE.to_owned(),
        reason: reason.to_owned(),
        message: truncate_message(message),
        observed_generation: None,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    }
}

fn invalid_tls_profile_condition(problem: &TlsProfileError) -> Condition {
    not_deployed(
        REASON_INVALID_TLS_PROFILE,
        format!("{problem}; the proxy-servers are left as they are"),
    )
}

fn invalid_condition(invalid: &InvalidSpec) -> Condition {
    not_deployed(REASON_INVALID_SPEC, invalid.to_string())
}

/// The `False` condition while the objects could not be applied.
fn not_yet_deployed_condition(message: String) -> Condition {
    not_deployed(REASON_NOT_YET_DEPLOYED, message)
}

/// `condition` as it is to be written over `status`: the transition time of
/// a condition whose status did not change is kept. `None` when `status`
/// already says exactly that, so there is nothing to write.
fn status_update(
    status: Option<&ManagedProxyConfigurationStatus>,
    generation: Option<i64>,
    mut condition: Condition,
) -> Option<Condition> {
    condition.observed_generation = generation;
    let current = status.and_then(|status| find_condition(&status.conditions, &condition.type_));
    if let Some(current) = current
        && current.status == condition.status
    {
        condition.last_transition_time = current.last_transition_time.clone();
    }
    let observed = status.and_then(|status| status.last_observed_generation);
    (current != Some(&condition) || observed != generation).then_some(condition)
}

/// Writes `condition` (the only condition type this controller owns) and
/// `lastObservedGeneration`, by server-side apply of the status subresource,
/// so cert-authority's certificate conditions — a list-map entry per type,
/// owned by its own field manager — stay as they are. Nothing is written
/// when the status already says the same; an unchanged status keeps its
/// `lastTransitionTime`.
///
/// `mpc` comes from the controller's cache, which can lag behind our own
/// last status write (a reconcile triggered by an owned object's event runs
/// before the MPC's status event arrives). Before writing, the status is
/// read back from the API, so a stale cache neither rewrites a current
/// status nor moves its transition time.
async fn write_status(
    context: &Context,
    mpc: &ManagedProxyConfiguration,
    condition: Condition,
) -> Result<(), HubError> {
    let generation = mpc.metadata.generation;
    if status_update(mpc.status.as_ref(), generation, condition.clone()).is_none() {
        return Ok(());
    }
    let name = mpc.name_any();
    let api = Api::<ManagedProxyConfiguration>::all(context.client.clone());
    let live = api.get_opt(&name).await.map_err(|source| {
        HubError::api("reading back", "ManagedProxyConfiguration", &name, source)
    })?;
    // Gone, or a newer spec than the one this reconcile rendered: that
    // generation's own watch event brings the reconcile that reports on it.
    let Some(live) = live.filter(|live| live.metadata.generation == generation) else {
        return Ok(());
    };
    let Some(condition) = status_update(live.status.as_ref(), generation, condition) else {
        return Ok(());
    };
    let patch = json!({
        "apiVersion": ManagedProxyConfiguration::api_version(&()),
        "kind": ManagedProxyConfiguration::kind(&()),
        "metadata": { "name": name },
        "status": {
            "lastObservedGeneration": generation,
            "conditions": [condition],
        },
    });
    api.patch_status(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(|source| {
        HubError::api(
            "writing the status of",
            "ManagedProxyConfiguration",
            &name,
            source,
        )
    })?;
    Ok(())
}

/// Deletes the objects this MPC controls that the current rendering no
/// longer has: the LoadBalancer Service after the entrypoint type changed,
/// the port-forward RBAC, a renamed in-cluster Service, everything in the
/// old namespace after `spec.proxyServer.namespace` changed. Only objects
/// whose controller owner reference is this MPC are candidates.
async fn prune_unwanted(
    client: &kube::Client,
    mpc: &ManagedProxyConfiguration,
    objects: &HubObjects,
) -> Result<(), HubError> {
    let Some(uid) = mpc.metadata.uid.as_deref() else {
        return Ok(());
    };
    let wanted = |object: Option<&kube::api::ObjectMeta>| {
        object.map(|meta| {
            (
                meta.namespace.clone().unwrap_or_default(),
                meta.name.clone().unwrap_or_default(),
            )
        })
    };
    prune::<Deployment>(client, uid, [wanted(Some(&objects.deployment.metadata))]).await?;
    prune::<ServiceAccount>(
        client,
        uid,
        [wanted(Some(&objects.service_account.metadata))],
    )
    .await?;
    prune::<Service>(
        client,
        uid,
        [
            wanted(Some(&objects.in_cluster_service.metadata)),
            wanted(Some(&objects.peer_service.metadata)),
            wanted(
                objects
                    .load_balancer_service
                    .as_ref()
                    .map(|service| &service.metadata),
            ),
        ],
    )
    .await?;
    prune::<Role>(
        client,
        uid,
        [wanted(
            objects
                .port_forward_role
                .as_ref()
                .map(|role| &role.metadata),
        )],
    )
    .await?;
    prune::<RoleBinding>(
        client,
        uid,
        [wanted(
            objects
                .port_forward_role_binding
                .as_ref()
                .map(|binding| &binding.metadata),
        )],
    )
    .await?;
    Ok(())
}

async fn prune<K>(
    client: &kube::Client,
    owner_uid: &str,
    wanted: impl IntoIterator<Item = Option<(String, String)>>,
) -> Result<(), HubError>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + Serialize
        + DeserializeOwned,
{
    let kind = K::kind(&()).into_owned();
    let wanted: BTreeSet<(String, String)> = wanted.into_iter().flatten().collect();
    let listed = Api::<K>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{LABEL_ADDON}={ADDON_NAME}")))
        .await
        .map_err(|source| HubError::api("listing", &kind, "(all)", source))?;
    for object in listed {
        let controlled_by_us = object
            .owner_references()
            .iter()
            .any(|owner| owner.uid == owner_uid && owner.controller == Some(true));
        let namespace = object.namespace().unwrap_or_default();
        let name = object.name_any();
        if !controlled_by_us || wanted.contains(&(namespace.clone(), name.clone())) {
            continue;
        }
        tracing::info!(%kind, %namespace, %name, "deleting an object the configuration no longer asks for");
        match Api::<K>::namespaced(client.clone(), &namespace)
            .delete(&name, &DeleteParams::background())
            .await
        {
            Ok(_) => {}
            Err(error) if is_not_found(&error) => {}
            Err(source) => return Err(HubError::api("deleting", &kind, &name, source)),
        }
    }
    Ok(())
}
