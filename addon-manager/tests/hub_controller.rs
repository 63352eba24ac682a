//! The hub controller against the in-memory Kubernetes API (real
//! server-side apply, watches, garbage collection and CRD validation):
//! create, no-op when current, spec changes, drift healed from watch events,
//! entrypoint switches, garbage collection, invalid specs, and API failures
//! (409 retried at once, 500 backed off) injected by a client layer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use addon_manager::hub::{self, HubMetrics, HubSettings, ReconcileResult};
use bytes::Bytes;
use cluster_proxy_proto::api::find_condition;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use memory_apiserver::lag::LaggingWatches;
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::{Value, json};
use simulated_cluster::wait::eventually;
use tokio::sync::oneshot;

const NS: &str = "open-cluster-management-cluster-proxy";
const CRD: &str = include_str!("../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml");
const WAIT: Duration = Duration::from_secs(20);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Fails PATCH requests for Deployments with `status` while `remaining` > 0,
/// and records when each failure was served; counts the MPC status writes.
#[derive(Default)]
struct Faults {
    status: AtomicU16,
    remaining: AtomicU32,
    served: Mutex<Vec<Instant>>,
    mpc_status_writes: AtomicU32,
}

impl Faults {
    fn fail_deployment_patches(&self, status: u16, times: u32) {
        self.status.store(status, Ordering::SeqCst);
        self.remaining.store(times, Ordering::SeqCst);
    }

    fn take(&self) -> Option<u16> {
        self.remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .ok()?;
        self.served
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Instant::now());
        Some(self.status.load(Ordering::SeqCst))
    }

    fn served(&self) -> Vec<Instant> {
        self.served
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

struct FaultService<S> {
    inner: S,
    faults: Arc<Faults>,
}

type FaultFuture = Pin<
    Box<
        dyn Future<Output = Result<http::Response<UnsyncBoxBody<Bytes, BoxError>>, BoxError>>
            + Send,
    >,
>;

impl<S, B> tower::Service<http::Request<kube::client::Body>> for FaultService<S>
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<UnsyncBoxBody<Bytes, BoxError>>;
    type Error = BoxError;
    type Future = FaultFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        let path = request.uri().path();
        let targeted = request.method() == http::Method::PATCH && path.contains("/deployments/");
        if request.method() == http::Method::PATCH
            && path.contains("/managedproxyconfigurations/")
            && path.ends_with("/status")
        {
            self.faults.mpc_status_writes.fetch_add(1, Ordering::SeqCst);
        }
        if targeted && let Some(code) = self.faults.take() {
            let status = json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": format!("injected failure {code}"), "reason": "Injected", "code": code
            });
            let body = http_body_util::Full::new(Bytes::from(status.to_string()))
                .map_err(|never| match never {})
                .boxed_unsync();
            let response = http::Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(body)
                .map_err(BoxError::from);
            return Box::pin(async move { response });
        }
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await.map_err(Into::into)?;
            Ok(response.map(|body| body.map_err(Into::into).boxed_unsync()))
        })
    }
}

struct Hub {
    api: KubeApi,
    client: kube::Client,
    metrics: HubMetrics,
    faults: Arc<Faults>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Hub {
    async fn start(settings: HubSettings) -> Hub {
        Hub::start_lagging(settings, Duration::ZERO).await
    }

    /// Starts the controller with its MPC watch events held back by
    /// `mpc_watch_lag`, so its cache trails the API.
    async fn start_lagging(settings: HubSettings, mpc_watch_lag: Duration) -> Hub {
        let dir = tempfile::tempdir().unwrap();
        let api = KubeApi::start(KubeApiOptions::new(dir.path()))
            .await
            .unwrap();
        api.register_crds_from_yaml(CRD).unwrap();
        let client = api.client().await.unwrap();

        let faults = Arc::new(Faults::default());
        let kubeconfig = kube::config::Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        let layer_faults = faults.clone();
        let controller_client = kube::client::ClientBuilder::try_from(config)
            .unwrap()
            .with_layer(&tower::layer::layer_fn(move |inner| FaultService {
                inner,
                faults: layer_faults.clone(),
            }))
            .with_layer(&LaggingWatches::new(
                "managedproxyconfigurations",
                mpc_watch_lag,
            ))
            .build();

        let metrics = HubMetrics::default();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(hub::run(
            controller_client,
            settings,
            metrics.clone(),
            async {
                let _ = stopped.await;
            },
        ));
        Hub {
            api,
            client,
            metrics,
            faults,
            stop: Some(stop),
            task: Some(task),
            _dir: dir,
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(WAIT, task)
                .await
                .expect("the controller stops on shutdown")
                .unwrap();
        }
        self.api.shutdown().await;
    }

    fn mpcs(&self) -> Api<ManagedProxyConfiguration> {
        Api::all(self.client.clone())
    }

    fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), NS)
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), NS)
    }

    async fn create_mpc(&self, name: &str, spec_patch: Value) -> ManagedProxyConfiguration {
        let mut object = json!({
            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": name},
            "spec": {
                "authentication": {},
                "proxyServer": {
                    "image": "quay.io/ocm/cluster-proxy:v1",
                    "replicas": 2,
                    "entrypoint": {"type": "Hostname", "hostname": {"value": "proxy.example.com"}}
                },
                "proxyAgent": {"image": "quay.io/ocm/cluster-proxy:v1"}
            }
        });
        merge(&mut object["spec"], spec_patch);
        let mpc: ManagedProxyConfiguration = serde_json::from_value(object).unwrap();
        self.mpcs()
            .create(&PostParams::default(), &mpc)
            .await
            .unwrap()
    }

    async fn patch_spec(&self, name: &str, spec_patch: Value) {
        self.mpcs()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": spec_patch})),
            )
            .await
            .unwrap();
    }

    /// Waits for `ProxyServerDeployed` to be `status` with `reason` at the
    /// MPC's current generation, and returns the MPC.
    async fn wait_condition(
        &self,
        name: &str,
        status: &str,
        reason: &str,
    ) -> ManagedProxyConfiguration {
        let mpcs = self.mpcs();
        eventually(
            &format!("{name}: ProxyServerDeployed={status} ({reason})"),
            WAIT,
            || {
                let mpcs = mpcs.clone();
                async move {
                    let mpc = mpcs.get(name).await.ok()?;
                    let current = mpc.status.as_ref()?;
                    let condition = find_condition(&current.conditions, "ProxyServerDeployed")?;
                    (condition.status == status
                        && condition.reason == reason
                        && condition.observed_generation == mpc.metadata.generation
                        && current.last_observed_generation == mpc.metadata.generation)
                        .then_some(mpc)
                }
            },
        )
        .await
    }
}

fn merge(target: &mut Value, patch: Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                merge(target.entry(key).or_insert(Value::Null), value);
            }
        }
        (target, patch) => *target = patch,
    }
}

fn quick_settings() -> HubSettings {
    HubSettings {
        // Long: healing must come from watch events, never from a resync.
        resync: Duration::from_secs(3600),
        load_balancer_poll: Duration::from_millis(200),
        backoff_initial: Duration::from_millis(100),
        backoff_max: Duration::from_secs(2),
        immediate_conflict_retries: 3,
        tls_profile_namespace: None,
        image_pull_policy: None,
        proxy_server_telemetry: Default::default(),
    }
}

/// The pod template's `tls-config-hash` annotation.
fn tls_config_hash(deployment: &Deployment) -> Option<String> {
    deployment
        .spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get("proxy.open-cluster-management.io/tls-config-hash")
        .cloned()
}

fn args(deployment: &Deployment) -> Vec<String> {
    deployment
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref())
        .and_then(|pod| pod.containers.first())
        .and_then(|container| container.args.clone())
        .unwrap_or_default()
}

fn deployed_message(mpc: &ManagedProxyConfiguration) -> String {
    mpc.status
        .as_ref()
        .and_then(|status| find_condition(&status.conditions, "ProxyServerDeployed"))
        .map(|condition| condition.message.clone())
        .unwrap_or_default()
}

async fn exists<K>(api: &Api<K>, name: &str) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name).await.unwrap().is_some()
}

#[tokio::test]
async fn deploys_keeps_still_when_current_and_follows_spec_changes() {
    let hub = Hub::start(quick_settings()).await;
    let created = hub.create_mpc("cluster-proxy", json!({})).await;

    let mpc = hub
        .wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    assert_eq!(deployed_message(&mpc), "Replicas: 0");
    let namespace = Api::<Namespace>::all(hub.client.clone())
        .get(NS)
        .await
        .unwrap();
    assert_eq!(
        namespace.labels()["open-cluster-management.io/addon"],
        "cluster-proxy"
    );
    let service_account = Api::<ServiceAccount>::namespaced(hub.client.clone(), NS)
        .get("cluster-proxy")
        .await
        .unwrap();
    assert_eq!(
        service_account.owner_references()[0].uid,
        created.uid().unwrap()
    );
    let deployment = hub.deployments().get("cluster-proxy").await.unwrap();
    assert_eq!(deployment.spec.as_ref().unwrap().replicas, Some(2));
    assert!(args(&deployment).contains(
        &"--server-count-source=dns:proxy-server-peers.open-cluster-management-cluster-proxy.svc"
            .to_owned()
    ));
    let service = hub.services().get("proxy-entrypoint").await.unwrap();
    let peers = hub.services().get("proxy-server-peers").await.unwrap();
    assert_eq!(
        peers.spec.as_ref().unwrap().cluster_ip.as_deref(),
        Some("None")
    );
    let managers: Vec<String> = deployment
        .managed_fields()
        .iter()
        .filter_map(|entry| entry.manager.clone())
        .collect();
    assert_eq!(managers, ["cluster-proxy-addon-manager"]);

    // An event that changes nothing we render (an annotation on the MPC)
    // must not write anything: resourceVersions and the transition time stay.
    let transition = find_condition(
        &mpc.status.as_ref().unwrap().conditions,
        "ProxyServerDeployed",
    )
    .unwrap()
    .last_transition_time
    .clone();
    let successes = hub.metrics.reconciles(ReconcileResult::Success);
    hub.mpcs()
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    eventually("a reconcile after the annotation", WAIT, || async {
        (hub.metrics.reconciles(ReconcileResult::Success) > successes).then_some(())
    })
    .await;
    let deployment_after = hub.deployments().get("cluster-proxy").await.unwrap();
    let service_after = hub.services().get("proxy-entrypoint").await.unwrap();
    assert_eq!(
        deployment_after.resource_version(),
        deployment.resource_version()
    );
    assert_eq!(service_after.resource_version(), service.resource_version());
    let mpc_after = hub.mpcs().get("cluster-proxy").await.unwrap();
    assert_eq!(mpc_after.status, mpc.status, "the status is not rewritten");
    assert_eq!(
        find_condition(&mpc_after.status.unwrap().conditions, "ProxyServerDeployed")
            .unwrap()
            .last_transition_time,
        transition
    );

    // replicas 2 -> 3 reaches the Deployment and leaves its pod template
    // alone: the replicas count each other, no pod restarts.
    let template_before = deployment.spec.as_ref().unwrap().template.clone();
    hub.patch_spec("cluster-proxy", json!({"proxyServer": {"replicas": 3}}))
        .await;
    let deployments = hub.deployments();
    let deployment = eventually("replicas 3", WAIT, || async {
        let deployment = deployments.get("cluster-proxy").await.ok()?;
        (deployment.spec.as_ref()?.replicas == Some(3)).then_some(deployment)
    })
    .await;
    assert_eq!(
        deployment.spec.as_ref().unwrap().template,
        template_before,
        "scaling changed the pod template"
    );
    assert_eq!(
        deployment.annotations()["proxy.open-cluster-management.io/configuration-generation"],
        "2"
    );
    let mpc = hub
        .wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    assert_eq!(mpc.status.unwrap().last_observed_generation, Some(2));

    hub.stop().await;
}

/// Regression: a reconcile triggered by the owned objects' events ran on a
/// cached MPC that did not have the status just written yet, rewrote the
/// same condition and moved its transition time (a CI failure of
/// `deploys_keeps_still_when_current_and_follows_spec_changes`). Holding the
/// MPC watch back makes the cache lag every time.
#[tokio::test]
async fn a_lagging_cache_does_not_rewrite_the_status() {
    let hub = Hub::start_lagging(quick_settings(), Duration::from_secs(2)).await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    let mpc = hub
        .wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    // The first reconcile deploys and writes the status; the owned objects'
    // events queue a second one that runs on the lagging cache, and the
    // delayed status event a third.
    eventually("three reconciles", WAIT, || async {
        (hub.metrics.reconciles(ReconcileResult::Success) >= 3).then_some(())
    })
    .await;
    assert_eq!(
        hub.faults.mpc_status_writes.load(Ordering::SeqCst),
        1,
        "the status was written more than once"
    );
    let mpc_after = hub.mpcs().get("cluster-proxy").await.unwrap();
    assert_eq!(mpc_after.resource_version(), mpc.resource_version());
    hub.stop().await;
}

#[tokio::test]
async fn certificate_conditions_of_another_manager_are_kept() {
    let hub = Hub::start(quick_settings()).await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let signed = json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "cluster-proxy"},
        "status": {"conditions": [{
            "type": "ProxyServerSecretSigned", "status": "True", "reason": "SuccessfullySigned",
            "message": "Expiry:2027-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"
        }]}
    });
    hub.mpcs()
        .patch_status(
            "cluster-proxy",
            &PatchParams::apply("cert-authority").force(),
            &Patch::Apply(&signed),
        )
        .await
        .unwrap();
    // A spec change makes the hub controller write its condition again.
    hub.patch_spec("cluster-proxy", json!({"proxyServer": {"replicas": 1}}))
        .await;
    let mpc = hub
        .wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let conditions = mpc.status.unwrap().conditions;
    let types: Vec<&str> = conditions.iter().map(|c| c.type_.as_str()).collect();
    assert!(types.contains(&"ProxyServerSecretSigned"), "{types:?}");
    assert!(types.contains(&"ProxyServerDeployed"), "{types:?}");
    hub.stop().await;
}

#[tokio::test]
async fn deleted_and_edited_objects_are_healed_from_watch_events() {
    let hub = Hub::start(quick_settings()).await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let deployments = hub.deployments();
    let services = hub.services();

    let old = deployments.get("cluster-proxy").await.unwrap();
    deployments
        .delete("cluster-proxy", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the Deployment back", WAIT, || async {
        let deployment = deployments.get_opt("cluster-proxy").await.ok()??;
        (deployment.uid() != old.uid()).then_some(())
    })
    .await;

    services
        .delete("proxy-entrypoint", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the Service back", WAIT, || async {
        services.get_opt("proxy-entrypoint").await.ok()?.map(|_| ())
    })
    .await;

    // Someone else scales the Deployment: our value is applied again.
    deployments
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 9}})),
        )
        .await
        .unwrap();
    eventually("replicas back to 2", WAIT, || async {
        let deployment = deployments.get("cluster-proxy").await.ok()?;
        (deployment.spec?.replicas == Some(2)).then_some(())
    })
    .await;
    hub.stop().await;
}

#[tokio::test]
async fn entrypoint_switches_create_and_prune_their_objects() {
    let hub = Hub::start(quick_settings()).await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let services = hub.services();
    let roles = Api::<Role>::namespaced(hub.client.clone(), NS);
    let bindings = Api::<RoleBinding>::namespaced(hub.client.clone(), NS);
    assert!(!exists(&services, "proxy-agent-entrypoint").await);

    hub.patch_spec(
        "cluster-proxy",
        json!({"proxyServer": {"entrypoint": {"type": "LoadBalancerService", "hostname": null,
            "loadBalancerService": {"annotations": [{"key": "example.com/lb", "value": "internal"}]}}}}),
    )
    .await;
    let mpcs = hub.mpcs();
    eventually("the condition says the LB has no address", WAIT, || async {
        let mpc = mpcs.get("cluster-proxy").await.ok()?;
        deployed_message(&mpc)
            .contains("no address yet")
            .then_some(())
    })
    .await;
    let lb = services.get("proxy-agent-entrypoint").await.unwrap();
    assert_eq!(
        lb.spec.as_ref().unwrap().type_.as_deref(),
        Some("LoadBalancer")
    );
    assert_eq!(lb.annotations()["example.com/lb"], "internal");

    // The cloud publishes only a hostname (AWS): that is an address.
    services
        .patch_status(
            "proxy-agent-entrypoint",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": [{"hostname": "abc.elb.example.com"}]}}})),
        )
        .await
        .unwrap();
    eventually("the condition without the LB note", WAIT, || async {
        let mpc = mpcs.get("cluster-proxy").await.ok()?;
        (deployed_message(&mpc) == "Replicas: 0").then_some(())
    })
    .await;
    let lb = services.get("proxy-agent-entrypoint").await.unwrap();
    let mpc = mpcs.get("cluster-proxy").await.unwrap();
    assert_eq!(
        hub::entrypoint_address(&mpc, Some(&lb)),
        Ok(Some(("abc.elb.example.com".to_owned(), 8091)))
    );

    hub.patch_spec(
        "cluster-proxy",
        json!({"proxyServer": {"entrypoint": {"type": "PortForward", "loadBalancerService": null}}}),
    )
    .await;
    eventually(
        "the LB Service pruned and the RBAC created",
        WAIT,
        || async {
            let pruned = !exists(&services, "proxy-agent-entrypoint").await;
            let role = exists(&roles, "cluster-proxy-addon-agent:portforward").await;
            let binding = exists(&bindings, "cluster-proxy-addon-agent:portforward").await;
            (pruned && role && binding).then_some(())
        },
    )
    .await;
    assert!(exists(&services, "proxy-entrypoint").await);

    hub.patch_spec(
        "cluster-proxy",
        json!({"proxyServer": {"entrypoint": {"type": "Hostname", "hostname": {"value": "10.0.0.1"}}}}),
    )
    .await;
    eventually("the RBAC pruned", WAIT, || async {
        let role = exists(&roles, "cluster-proxy-addon-agent:portforward").await;
        let binding = exists(&bindings, "cluster-proxy-addon-agent:portforward").await;
        (!role && !binding).then_some(())
    })
    .await;
    hub.stop().await;
}

#[tokio::test]
async fn deleting_the_configuration_garbage_collects_its_objects_but_not_the_namespace() {
    let hub = Hub::start(quick_settings()).await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    hub.mpcs()
        .delete("cluster-proxy", &DeleteParams::foreground())
        .await
        .unwrap();
    let deployments = hub.deployments();
    let services = hub.services();
    let accounts = Api::<ServiceAccount>::namespaced(hub.client.clone(), NS);
    eventually("the owned objects gone", WAIT, || async {
        let deployment = exists(&deployments, "cluster-proxy").await;
        let service = exists(&services, "proxy-entrypoint").await;
        let account = exists(&accounts, "cluster-proxy").await;
        (!deployment && !service && !account).then_some(())
    })
    .await;
    let mpcs = hub.mpcs();
    eventually("the MPC gone", WAIT, || async {
        (!exists(&mpcs, "cluster-proxy").await).then_some(())
    })
    .await;
    assert!(exists(&Api::<Namespace>::all(hub.client.clone()), NS).await);
    hub.stop().await;
}

#[tokio::test]
async fn invalid_specs_get_a_false_condition_and_break_nothing_else() {
    let hub = Hub::start(quick_settings()).await;
    let cases = [
        (
            "no-image",
            json!({"proxyServer": {"image": ""}}),
            "spec.proxyServer.image",
        ),
        (
            "negative",
            json!({"proxyServer": {"replicas": -1}}),
            "spec.proxyServer.replicas",
        ),
        (
            "no-hostname",
            json!({"proxyServer": {"entrypoint": {"hostname": null}}}),
            "spec.proxyServer.entrypoint.hostname",
        ),
        (
            "bad-hostname",
            json!({"proxyServer": {"entrypoint": {"hostname": {"value": "not a host!"}}}}),
            "spec.proxyServer.entrypoint.hostname.value",
        ),
        (
            "bad-annotation",
            json!({"proxyServer": {"entrypoint": {"type": "LoadBalancerService", "hostname": null,
                "loadBalancerService": {"annotations": [{"key": "bad key", "value": "x"}]}}}}),
            "spec.proxyServer.entrypoint.loadBalancerService.annotations[0].key",
        ),
    ];
    for (index, (name, patch, _)) in cases.iter().enumerate() {
        let mut patch = patch.clone();
        merge(
            &mut patch,
            json!({"proxyServer": {"namespace": format!("ns-{index}")}}),
        );
        hub.create_mpc(name, patch).await;
    }
    // A valid configuration next to them deploys.
    hub.create_mpc("good", json!({})).await;
    hub.wait_condition("good", "True", "SuccessfullyDeployed")
        .await;

    for (index, (name, _, field)) in cases.iter().enumerate() {
        let mpc = hub.wait_condition(name, "False", "InvalidSpec").await;
        let message = deployed_message(&mpc);
        assert!(message.contains(field), "{name}: {message}");
        let deployments = Api::<Deployment>::namespaced(hub.client.clone(), &format!("ns-{index}"));
        assert!(
            !exists(&deployments, name).await,
            "{name}: nothing is deployed"
        );
    }
    assert!(hub.metrics.reconciles(ReconcileResult::Invalid) >= cases.len() as u64);

    // A deployed configuration that turns invalid keeps what it has.
    hub.patch_spec("good", json!({"proxyServer": {"replicas": -5}}))
        .await;
    hub.wait_condition("good", "False", "InvalidSpec").await;
    let deployment = hub.deployments().get("good").await.unwrap();
    assert_eq!(deployment.spec.unwrap().replicas, Some(2));
    // And recovers once fixed.
    hub.patch_spec("good", json!({"proxyServer": {"replicas": 1}}))
        .await;
    hub.wait_condition("good", "True", "SuccessfullyDeployed")
        .await;
    hub.stop().await;
}

#[tokio::test]
async fn conflicts_are_retried_at_once() {
    let settings = HubSettings {
        // A backoff would outlast the test's wait: only an immediate retry passes.
        backoff_initial: Duration::from_secs(60),
        backoff_max: Duration::from_secs(60),
        ..quick_settings()
    };
    let hub = Hub::start(settings).await;
    hub.faults.fail_deployment_patches(409, 2);
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    assert_eq!(hub.faults.served().len(), 2);
    assert_eq!(hub.metrics.reconciles(ReconcileResult::Error), 2);
    hub.stop().await;
}

#[tokio::test]
async fn server_errors_are_backed_off_exponentially_and_reported() {
    let hub = Hub::start(quick_settings()).await;
    hub.faults.fail_deployment_patches(500, 6);
    hub.create_mpc("cluster-proxy", json!({})).await;
    let mpc = hub
        .wait_condition("cluster-proxy", "False", "NotYetDeployed")
        .await;
    assert!(
        deployed_message(&mpc).contains("injected failure 500"),
        "{}",
        deployed_message(&mpc)
    );
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let served = hub.faults.served();
    assert_eq!(served.len(), 6);
    let gaps: Vec<Duration> = served
        .windows(2)
        .map(|pair| pair[1].duration_since(pair[0]))
        .collect();
    // Delays double from 100 ms per consecutive failure. The first attempts
    // come in a burst (the watch events of the objects applied before the
    // Deployment and of the status write), and kube-runtime's scheduler
    // keeps the earliest requeue of an object, so each attempt after the
    // burst runs on the previous failure's delay: 200, 400, 800 ms.
    assert!(gaps[2] >= Duration::from_millis(100), "{gaps:?}");
    assert!(gaps[3] >= Duration::from_millis(150), "{gaps:?}");
    assert!(gaps[4] >= Duration::from_millis(400), "{gaps:?}");
    assert!(gaps[4] >= gaps[2] * 2, "{gaps:?}");
    assert!(hub.metrics.reconciles(ReconcileResult::Error) >= 6);
    hub.stop().await;
}

#[tokio::test]
async fn problems_outside_the_hub_deployment_do_not_stop_it() {
    let hub = Hub::start(quick_settings()).await;
    hub.create_mpc("cluster-proxy", json!({"proxyAgent": {"image": ""}}))
        .await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    assert!(exists(&hub.deployments(), "cluster-proxy").await);
    hub.stop().await;
}

#[tokio::test]
async fn a_deleted_namespace_is_recreated_with_its_objects() {
    let hub = Hub::start(quick_settings()).await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let namespaces = Api::<Namespace>::all(hub.client.clone());
    let old = namespaces.get(NS).await.unwrap();
    namespaces
        .delete(NS, &DeleteParams::default())
        .await
        .unwrap();
    let deployments = hub.deployments();
    eventually("the namespace and the Deployment back", WAIT, || async {
        let namespace = namespaces.get_opt(NS).await.ok()??;
        let fresh = namespace.uid() != old.uid() && namespace.metadata.deletion_timestamp.is_none();
        (fresh && exists(&deployments, "cluster-proxy").await).then_some(())
    })
    .await;
    hub.stop().await;
}

#[test]
fn retry_delays_double_up_to_the_maximum_and_conflicts_go_at_once() {
    let settings = HubSettings {
        backoff_initial: Duration::from_millis(500),
        backoff_max: Duration::from_secs(5),
        immediate_conflict_retries: 2,
        ..HubSettings::default()
    };
    let delays: Vec<Duration> = (1..=6)
        .map(|failures| hub::retry_delay(&settings, false, failures))
        .collect();
    assert_eq!(
        delays,
        [500, 1000, 2000, 4000, 5000, 5000].map(Duration::from_millis)
    );
    assert_eq!(hub::retry_delay(&settings, true, 1), Duration::ZERO);
    assert_eq!(hub::retry_delay(&settings, true, 2), Duration::ZERO);
    assert_eq!(
        hub::retry_delay(&settings, true, 3),
        Duration::from_secs(2),
        "conflicts that keep coming back off like any error"
    );
    assert_eq!(
        hub::retry_delay(&settings, false, u32::MAX),
        Duration::from_secs(5)
    );
}

#[test]
fn metrics_are_registered_under_the_hub_prefix() {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = HubMetrics::register(&mut registry);
    metrics.observe(ReconcileResult::Success, Duration::from_millis(20));
    metrics.observe(ReconcileResult::Invalid, Duration::from_millis(1));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("addon_manager_hub_reconciles_total{result=\"success\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("addon_manager_hub_reconciles_total{result=\"invalid\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("addon_manager_hub_reconcile_duration_seconds_count 2"),
        "{text}"
    );
}

#[tokio::test]
async fn an_edited_namespace_is_healed_from_its_own_watch_event() {
    let hub = Hub::start(quick_settings()).await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let namespaces = Api::<Namespace>::all(hub.client.clone());
    namespaces
        .patch(
            NS,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"open-cluster-management.io/addon": null}}}),
            ),
        )
        .await
        .unwrap();
    eventually("the namespace label back", WAIT, || async {
        let namespace = namespaces.get(NS).await.ok()?;
        (namespace.labels().get("open-cluster-management.io/addon")
            == Some(&"cluster-proxy".to_owned()))
        .then_some(())
    })
    .await;
    hub.stop().await;
}

/// OCM's TLS profile (upstream T1–T3): the ConfigMap `ocm-tls-profile` in
/// addon-manager's namespace becomes the proxy-servers' `--tls-min-version`
/// and `--cipher-suites` and a new `tls-config-hash` (so they roll); one
/// they cannot follow is a False condition and leaves them as they are; its
/// removal takes the flags away again.
#[tokio::test]
async fn the_ocm_tls_profile_reaches_the_proxy_servers() {
    const ADDON_NS: &str = "open-cluster-management-addon";
    let hub = Hub::start(HubSettings {
        tls_profile_namespace: Some(ADDON_NS.to_owned()),
        ..quick_settings()
    })
    .await;
    let namespace: Namespace =
        serde_json::from_value(json!({"metadata": {"name": ADDON_NS}})).unwrap();
    Api::<Namespace>::all(hub.client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let deployment = hub.deployments().get("cluster-proxy").await.unwrap();
    assert!(
        !args(&deployment)
            .iter()
            .any(|arg| arg.starts_with("--tls-min-version"))
    );
    assert_eq!(tls_config_hash(&deployment), None);

    let configmaps = Api::<ConfigMap>::namespaced(hub.client.clone(), ADDON_NS);
    let set_profile = |data: Value| {
        let configmaps = configmaps.clone();
        async move {
            let object = json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "ocm-tls-profile", "namespace": ADDON_NS},
                "data": data,
            });
            configmaps
                .patch(
                    "ocm-tls-profile",
                    &PatchParams::apply("tls-profile-sync").force(),
                    &Patch::Apply(&object),
                )
                .await
                .unwrap();
        }
    };
    let deployment_where = |what: &'static str, wanted: fn(&Deployment) -> bool| {
        let deployments = hub.deployments();
        eventually(what, WAIT, move || {
            let deployments = deployments.clone();
            async move {
                let deployment = deployments.get("cluster-proxy").await.ok()?;
                wanted(&deployment).then_some(deployment)
            }
        })
    };

    set_profile(json!({
        "minTLSVersion": "VersionTLS13",
        "cipherSuites": "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
    }))
    .await;
    let strict = deployment_where("the profile's flags", |deployment| {
        let args = args(deployment);
        args.contains(&"--tls-min-version=VersionTLS13".to_owned())
            && args.contains(&"--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256".to_owned())
    })
    .await;
    let strict_hash = tls_config_hash(&strict).expect("the template carries the profile's hash");
    assert_eq!(strict_hash.len(), 16);

    // A suite no TLS stack knows: reported, the servers left alone.
    set_profile(json!({"minTLSVersion": "VersionTLS13", "cipherSuites": "TLS_MADE_UP"})).await;
    let mpc = hub
        .wait_condition("cluster-proxy", "False", "InvalidTLSProfile")
        .await;
    assert!(
        deployed_message(&mpc).contains("TLS_MADE_UP"),
        "{}",
        deployed_message(&mpc)
    );
    let kept = hub.deployments().get("cluster-proxy").await.unwrap();
    assert_eq!(
        tls_config_hash(&kept).as_deref(),
        Some(strict_hash.as_str())
    );

    // TLS 1.0 is raised to 1.2, the oldest the proxy-server speaks.
    set_profile(json!({"minTLSVersion": "VersionTLS10", "cipherSuites": ""})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let relaxed = deployment_where("TLS 1.2 without a suite list", |deployment| {
        let args = args(deployment);
        args.contains(&"--tls-min-version=VersionTLS12".to_owned())
            && !args.iter().any(|arg| arg.starts_with("--cipher-suites"))
    })
    .await;
    assert_ne!(tls_config_hash(&relaxed), Some(strict_hash));

    // Without the profile, no flags and no hash.
    configmaps
        .delete("ocm-tls-profile", &DeleteParams::default())
        .await
        .unwrap();
    deployment_where("no TLS flags", |deployment| {
        !args(deployment)
            .iter()
            .any(|arg| arg.starts_with("--tls-min-version"))
            && tls_config_hash(deployment).is_none()
    })
    .await;
    hub.stop().await;
}

/// The proxy-servers' OTLP settings reach the Deployment the controller
/// applies: the variables (the headers by reference) and the template hash.
#[tokio::test]
async fn the_otlp_settings_reach_the_proxy_servers() {
    use addon_manager::hub::{KeyRef, ProxyServerTelemetry};
    let hub = Hub::start(HubSettings {
        proxy_server_telemetry: ProxyServerTelemetry {
            endpoint: Some("http://otel-collector.observability:4317".to_owned()),
            headers_secret: Some(KeyRef {
                name: "otlp-auth".to_owned(),
                key: "headers".to_owned(),
            }),
            ..ProxyServerTelemetry::default()
        },
        ..quick_settings()
    })
    .await;
    hub.create_mpc("cluster-proxy", json!({})).await;
    hub.wait_condition("cluster-proxy", "True", "SuccessfullyDeployed")
        .await;
    let deployment = hub.deployments().get("cluster-proxy").await.unwrap();
    let template = deployment.spec.unwrap().template;
    let env = serde_json::to_value(&template.spec.unwrap().containers[0].env).unwrap();
    assert_eq!(
        env[1],
        json!({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector.observability:4317"})
    );
    assert_eq!(
        env.as_array().and_then(|env| env.last()).cloned(),
        Some(
            json!({"name": "OTEL_EXPORTER_OTLP_HEADERS", "valueFrom": {"secretKeyRef":
            {"name": "otlp-auth", "key": "headers", "optional": true}}})
        )
    );
    let annotations = template.metadata.unwrap().annotations.unwrap_or_default();
    assert_eq!(
        annotations
            .get("proxy.open-cluster-management.io/otlp-config-hash")
            .map(String::len),
        Some(16)
    );
    hub.stop().await;
}
