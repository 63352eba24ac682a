//! The ManagedClusterAddOn reconcile against a scripted API (tower-test):
//! which requests it sends, that it sends no write when everything is
//! current, that a 409 is retried at once and an API failure backs off.
//! The reconcile reads from its caches; the tests fill them with the fake's
//! objects, as the controller's watches would.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use addon_manager::addon::cache::{self, Caches};
use addon_manager::addon::reconcile::{error_policy, reconcile};
use addon_manager::addon::{AddonMetrics, AddonSettings, Context};
use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::Event;
use serde_json::{Value, json};

const HUB: &str = "open-cluster-management-addon";
const ADDON: &str = "/apis/addon.open-cluster-management.io/v1alpha1/namespaces/cluster-a/managedclusteraddons/cluster-proxy";
const WORK: &str = "/apis/work.open-cluster-management.io/v1/namespaces/cluster-a/manifestworks/addon-cluster-proxy-deploy-0";

/// Status codes to answer, by (method, path), each used once.
type Scripted = BTreeMap<(String, String), Vec<u16>>;

/// A tiny API: GET answers from `objects` (404 otherwise); PATCH stores the
/// applied body (status patches set `status`) unless a scripted failure
/// for that path is queued. Every request is recorded.
#[derive(Clone, Default)]
struct FakeApi {
    objects: Arc<Mutex<BTreeMap<String, Value>>>,
    /// Scripted answers by (method, path), used once each.
    failures: Arc<Mutex<Scripted>>,
    log: Arc<Mutex<Vec<(Method, String)>>>,
}

fn status_body(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("scripted {reason}"), "reason": reason, "code": code})
}

impl FakeApi {
    fn put(&self, path: &str, object: Value) {
        self.objects.lock().unwrap().insert(path.to_owned(), object);
    }

    fn fail_next(&self, method: Method, path: &str, code: u16) {
        self.failures
            .lock()
            .unwrap()
            .entry((method.to_string(), path.to_owned()))
            .or_default()
            .push(code);
    }

    fn writes(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(method, _)| method != Method::GET)
            .map(|(_, path)| path.clone())
            .collect()
    }

    fn clear_log(&self) {
        self.log.lock().unwrap().clear();
    }

    fn answer(&self, method: &Method, path: &str, body: &[u8]) -> (StatusCode, Value) {
        self.log
            .lock()
            .unwrap()
            .push((method.clone(), path.to_owned()));
        if let Some(code) = self
            .failures
            .lock()
            .unwrap()
            .get_mut(&(method.to_string(), path.to_owned()))
            .and_then(|queue| (!queue.is_empty()).then(|| queue.remove(0)))
        {
            let reason = if code == 409 {
                "Conflict"
            } else {
                "InternalError"
            };
            return (
                StatusCode::from_u16(code).unwrap(),
                status_body(code, reason),
            );
        }
        let mut objects = self.objects.lock().unwrap();
        match *method {
            Method::GET => match objects.get(path) {
                Some(object) => (StatusCode::OK, object.clone()),
                None => (StatusCode::NOT_FOUND, status_body(404, "NotFound")),
            },
            Method::PATCH => {
                let applied: Value = serde_json::from_slice(body).unwrap();
                let stored = match path.strip_suffix("/status") {
                    Some(main) => {
                        let mut object = objects.get(main).cloned().unwrap_or(applied.clone());
                        object["status"] = applied["status"].clone();
                        objects.insert(main.to_owned(), object.clone());
                        object
                    }
                    None => {
                        let mut object = applied;
                        object["metadata"]["uid"] = json!(format!("uid-{}", path.len()));
                        objects.insert(path.to_owned(), object.clone());
                        object
                    }
                };
                (StatusCode::OK, stored)
            }
            _ => (
                StatusCode::METHOD_NOT_ALLOWED,
                status_body(405, "MethodNotAllowed"),
            ),
        }
    }

    /// A kube client served by this fake.
    fn client(&self) -> kube::Client {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let fake = self.clone();
        tokio::spawn(async move {
            while let Some((request, respond)) = handle.next_request().await {
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.unwrap();
                let (status, value) = fake.answer(&parts.method, parts.uri.path(), &bytes);
                let response = Response::builder()
                    .status(status)
                    .body(Body::from(serde_json::to_vec(&value).unwrap()))
                    .unwrap();
                respond.send_response(response);
            }
        });
        kube::Client::new(service, "default")
    }
}

fn hub_objects(fake: &FakeApi) {
    fake.put(
        "/apis/cluster.open-cluster-management.io/v1/managedclusters/cluster-a",
        json!({"apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
            "metadata": {"name": "cluster-a"}, "spec": {"hubAcceptsClient": true}}),
    );
    fake.put(
        "/apis/proxy.open-cluster-management.io/v1alpha1/managedproxyconfigurations/cluster-proxy",
        json!({"apiVersion": "proxy.open-cluster-management.io/v1alpha1", "kind": "ManagedProxyConfiguration",
            "metadata": {"name": "cluster-proxy", "generation": 1},
            "spec": {"authentication": {},
                "proxyServer": {"image": "img:1", "namespace": HUB,
                    "entrypoint": {"type": "Hostname", "hostname": {"value": "proxy.hub"}, "port": 8091}},
                "proxyAgent": {"image": "img:1", "replicas": 1}}}),
    );
    fake.put(
        &format!("/api/v1/namespaces/{HUB}/secrets/proxy-server-ca"),
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "proxy-server-ca", "namespace": HUB},
            "data": {"ca.crt": "Q0E="}}),
    );
}

fn addon_object() -> ManagedClusterAddOn {
    serde_json::from_value(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1", "kind": "ManagedClusterAddOn",
        "metadata": {"name": "cluster-proxy", "namespace": "cluster-a", "uid": "addon-uid"},
        "spec": {},
    }))
    .unwrap()
}

/// Caches holding the fake's objects now, each filled by a complete list.
fn caches(fake: &FakeApi) -> Caches {
    fn fill<K>(writer: &mut Writer<K>, objects: &[Value], kind: &str)
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + 'static,
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        writer.apply_watcher_event(&Event::Init);
        for object in objects.iter().filter(|object| object["kind"] == kind) {
            let object: K = serde_json::from_value(object.clone()).unwrap();
            writer.apply_watcher_event(&Event::InitApply(object));
        }
        writer.apply_watcher_event(&Event::InitDone);
    }
    let objects: Vec<Value> = fake.objects.lock().unwrap().values().cloned().collect();
    let (caches, mut writers) = cache::caches();
    let addon = &mut writers.addon;
    fill(&mut addon.clusters, &objects, "ManagedCluster");
    fill(&mut addon.mpcs, &objects, "ManagedProxyConfiguration");
    fill(&mut addon.managements, &objects, "ClusterManagementAddOn");
    fill(
        &mut addon.deployment_configs,
        &objects,
        "AddOnDeploymentConfig",
    );
    fill(&mut addon.hub_secrets, &objects, "Secret");
    fill(&mut addon.hub_services, &objects, "Service");
    fill(&mut addon.works, &objects, "ManifestWork");
    fill(&mut addon.roles, &objects, "Role");
    fill(&mut addon.role_bindings, &objects, "RoleBinding");
    let install = &mut writers.install;
    fill(&mut install.decisions, &objects, "PlacementDecision");
    fill(&mut install.managements, &objects, "ClusterManagementAddOn");
    fill(&mut install.addons, &objects, "ManagedClusterAddOn");
    writers.addon_filled.send_replace(true);
    writers.install_filled.send_replace(true);
    caches
}

fn context_for(fake: &FakeApi) -> Arc<Context> {
    Arc::new(Context::new(
        fake.client(),
        AddonSettings::new(HUB),
        AddonMetrics::default(),
        caches(fake),
    ))
}

#[tokio::test]
async fn creates_then_writes_nothing_when_current() {
    let fake = FakeApi::default();
    hub_objects(&fake);
    let context = context_for(&fake);
    let addon = addon_object();
    fake.put(ADDON, serde_json::to_value(&addon).unwrap());

    let action = reconcile(Arc::new(addon), context.clone()).await.unwrap();
    assert_eq!(action, Action::await_change());
    let writes = fake.writes();
    assert_eq!(
        writes,
        vec![
            "/apis/rbac.authorization.k8s.io/v1/namespaces/cluster-a/roles/cluster-proxy-addon-agent".to_owned(),
            "/apis/rbac.authorization.k8s.io/v1/namespaces/cluster-a/rolebindings/cluster-proxy-addon-agent".to_owned(),
            WORK.to_owned(),
            format!("{ADDON}/status"),
        ]
    );

    // Second pass over what was stored, once the caches have caught up.
    fake.clear_log();
    let context = context_for(&fake);
    let stored: ManagedClusterAddOn =
        serde_json::from_value(fake.objects.lock().unwrap()[ADDON].clone()).unwrap();
    reconcile(Arc::new(stored), context).await.unwrap();
    assert_eq!(
        fake.writes(),
        Vec::<String>::new(),
        "no writes when current"
    );
}

#[tokio::test]
async fn a_conflict_is_retried_at_once_and_succeeds() {
    let fake = FakeApi::default();
    hub_objects(&fake);
    let context = context_for(&fake);
    let addon = Arc::new(addon_object());
    fake.fail_next(Method::PATCH, WORK, 409);

    let error = reconcile(addon.clone(), context.clone()).await.unwrap_err();
    assert!(error.is_conflict(), "{error}");
    assert_eq!(
        error_policy(addon.clone(), &error, context.clone()),
        Action::requeue(Duration::from_millis(200))
    );
    // The retry goes through.
    reconcile(addon, context).await.unwrap();
    assert!(fake.objects.lock().unwrap().contains_key(WORK));
    assert_eq!(fake.writes().iter().filter(|path| *path == WORK).count(), 2);
}

#[tokio::test]
async fn an_api_failure_backs_off() {
    let fake = FakeApi::default();
    hub_objects(&fake);
    let context = context_for(&fake);
    let addon = Arc::new(addon_object());
    let role =
        "/apis/rbac.authorization.k8s.io/v1/namespaces/cluster-a/roles/cluster-proxy-addon-agent";
    fake.fail_next(Method::PATCH, role, 500);
    let error = reconcile(addon.clone(), context.clone()).await.unwrap_err();
    assert!(!error.is_conflict());
    assert_eq!(
        error_policy(addon, &error, context),
        Action::requeue(Duration::from_secs(5))
    );
    assert_eq!(
        fake.writes(),
        vec![role.to_owned()],
        "nothing written after a failed write"
    );
}
