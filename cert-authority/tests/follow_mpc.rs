//! cert-authority following a ManagedProxyConfiguration against the
//! in-memory Kubernetes API: the hub Secrets go where the MPC says, under
//! the names it gives, with its SANs and its entrypoint's address; the
//! three certificate conditions land on its status next to another
//! manager's; a missing MPC is waited for.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cert_authority::kubernetes::metrics::Metrics;
use cert_authority::kubernetes::{self, KubeError, KubeOptions, rbac};
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::{Condition, find_condition};
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use memory_apiserver::{KubeApi, KubeApiOptions};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use simulated_cluster::wait::eventually;
use tokio::sync::oneshot;
use x509_parser::extensions::GeneralName;

/// How long a test waits for an observable state.
const WAIT: Duration = Duration::from_secs(60);

const LEASE_NS: &str = "open-cluster-management-addon";
const HUB_NS: &str = "hub-proxy";
const MPC: &str = "cluster-proxy";
const CRD: &str = include_str!("../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml");

/// Every request a client made, as (method, path and query).
type RequestLog = Arc<Mutex<Vec<(String, String)>>>;

/// The in-memory API with both namespaces; an admin client, and a client
/// whose requests are logged (to check them against the RBAC rules).
struct Hub {
    api: KubeApi,
    admin: Client,
    _dir: tempfile::TempDir,
}

impl Hub {
    async fn start(with_crd: bool) -> Hub {
        let dir = tempfile::tempdir().unwrap();
        let api = KubeApi::start(KubeApiOptions::new(dir.path()))
            .await
            .unwrap();
        if with_crd {
            api.register_crds_from_yaml(CRD).unwrap();
        }
        let admin = api.client().await.unwrap();
        for name in [LEASE_NS, HUB_NS] {
            let namespace: Namespace =
                serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
            Api::<Namespace>::all(admin.clone())
                .create(&PostParams::default(), &namespace)
                .await
                .unwrap();
        }
        Hub {
            api,
            admin,
            _dir: dir,
        }
    }

    /// A client identified as cert-authority that records every request.
    async fn recording_client(&self) -> (Client, RequestLog) {
        let kubeconfig = kube::config::Kubeconfig::read_from(self.api.kubeconfig_path()).unwrap();
        let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        kubernetes::identify(&mut config);
        let log = RequestLog::default();
        let recorder = log.clone();
        let record =
            tower::util::MapRequestLayer::new(move |request: http::Request<kube::client::Body>| {
                let target = request
                    .uri()
                    .path_and_query()
                    .map(ToString::to_string)
                    .unwrap_or_default();
                recorder
                    .lock()
                    .unwrap()
                    .push((request.method().to_string(), target));
                request
            });
        let client = kube::client::ClientBuilder::try_from(config)
            .unwrap()
            .with_layer(&record)
            .build();
        (client, log)
    }

    fn mpcs(&self) -> Api<ManagedProxyConfiguration> {
        Api::all(self.admin.clone())
    }

    fn secrets(&self, namespace: &str) -> Api<Secret> {
        Api::namespaced(self.admin.clone(), namespace)
    }

    async fn apply_mpc(&self, spec: Value) {
        let mpc = json!({
            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": MPC},
            "spec": spec,
        });
        self.mpcs()
            .patch(
                MPC,
                &PatchParams::apply("helm").force(),
                &Patch::Apply(&mpc),
            )
            .await
            .unwrap();
    }

    async fn conditions(&self) -> Vec<Condition> {
        self.mpcs()
            .get(MPC)
            .await
            .unwrap()
            .status
            .map(|s| s.conditions)
            .unwrap_or_default()
    }
}

fn spec(additional_sans: &[&str], entrypoint: Value, secrets: Value) -> Value {
    json!({
        "authentication": {
            "signer": {"type": "SelfSigned", "selfSigned": {"additionalSANs": additional_sans}},
            "dump": {"secrets": secrets},
        },
        "proxyServer": {
            "image": "proxy-server:dev",
            "namespace": HUB_NS,
            "inClusterServiceName": "entry",
            "entrypoint": entrypoint,
        },
        "proxyAgent": {"image": "proxy-agent:dev"},
    })
}

fn hostname(value: &str) -> Value {
    json!({"type": "Hostname", "hostname": {"value": value}, "port": 8091})
}

fn options() -> KubeOptions {
    let mut options = KubeOptions::new(LEASE_NS);
    options.identity = "follower".into();
    options.renew_every = Duration::from_millis(200);
    options.lease_duration = Duration::from_secs(2);
    options.managed_proxy_configuration = Some(MPC.into());
    options
}

struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), KubeError>>,
}

impl Running {
    fn start(client: Client, metrics: Metrics) -> Running {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(kubernetes::run_with_metrics(
            client,
            options(),
            metrics,
            async {
                let _ = stopped.await;
            },
        ));
        Running {
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) {
        assert!(!self.task.is_finished(), "cert-authority stopped by itself");
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

fn certificate_pem(secret: &Secret) -> Option<String> {
    let pem = secret.data.as_ref()?.get("tls.crt")?;
    String::from_utf8(pem.0.clone()).ok()
}

/// The DNS and IP SANs of a PEM certificate, as text.
fn sans_of(pem: &str) -> Vec<String> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
    let certificate = block.parse_x509().unwrap();
    let Some(extension) = certificate.subject_alternative_name().unwrap() else {
        return Vec::new();
    };
    extension
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(dns) => Some((*dns).to_owned()),
            GeneralName::IPAddress(bytes) => match bytes.len() {
                4 => {
                    Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*bytes).unwrap()).to_string())
                }
                16 => Some(
                    std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*bytes).unwrap()).to_string(),
                ),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

fn expiry_of(pem: &str) -> String {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
    let not_after = block.parse_x509().unwrap().validity().not_after.timestamp();
    format!(
        "Expiry:{}",
        k8s_openapi::jiff::Timestamp::from_second(not_after).unwrap()
    )
}

/// The certificate in Secret `name` once its SANs satisfy `wanted`.
async fn certificate_when(
    hub: &Hub,
    name: &str,
    what: &str,
    wanted: impl Fn(&[String]) -> bool,
) -> String {
    let secrets = hub.secrets(HUB_NS);
    eventually(&format!("{name} with {what}"), WAIT, || {
        let secrets = secrets.clone();
        let wanted = &wanted;
        async move {
            let pem = certificate_pem(&secrets.get_opt(name).await.ok()??)?;
            wanted(&sans_of(&pem)).then_some(pem)
        }
    })
    .await
}

fn has(sans: &[String], san: &str) -> bool {
    sans.iter().any(|s| s == san)
}

/// The three certificate conditions once all are True with the expiry of
/// the certificates now stored.
async fn signed_conditions(hub: &Hub, names: [&str; 3]) -> BTreeMap<String, Condition> {
    eventually(
        "three True certificate conditions matching the Secrets",
        WAIT,
        || async {
            let conditions = hub.conditions().await;
            let mut found = BTreeMap::new();
            for (type_, secret) in [
                "ProxyServerSecretSigned",
                "AgentServerSecretSigned",
                "ProxyClientSecretSigned",
            ]
            .into_iter()
            .zip(names)
            {
                let condition = find_condition(&conditions, type_)?.clone();
                let pem = certificate_pem(&hub.secrets(HUB_NS).get_opt(secret).await.ok()??)?;
                let matches = condition.status == "True"
                    && condition.reason == "SuccessfullySigned"
                    && condition.message == expiry_of(&pem);
                if !matches {
                    return None;
                }
                found.insert(type_.to_owned(), condition);
            }
            Some(found)
        },
    )
    .await
}

/// Another manager's condition, applied to the status as addon-manager
/// would.
async fn apply_deployed_condition(hub: &Hub) {
    let status = json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": MPC},
        "status": {"conditions": [{
            "type": "ProxyServerDeployed", "status": "True", "reason": "SuccessfullyDeployed",
            "message": "Replicas: 3", "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]},
    });
    hub.mpcs()
        .patch_status(
            MPC,
            &PatchParams::apply("someone-else"),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
}

/// Conditions of cert-authority's types as a previous run left them:
/// `True`, with an old expiry and transition time.
async fn apply_previous_run_conditions(hub: &Hub) {
    let conditions: Vec<Value> = [
        "ProxyServerSecretSigned",
        "AgentServerSecretSigned",
        "ProxyClientSecretSigned",
    ]
    .iter()
    .map(|type_| {
        json!({"type": type_, "status": "True", "reason": "SuccessfullySigned",
            "message": "Expiry:2020-06-01T00:00:00Z", "lastTransitionTime": PREVIOUS_TRANSITION})
    })
    .collect();
    let status = json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": MPC},
        "status": {"conditions": conditions},
    });
    hub.mpcs()
        .patch_status(
            MPC,
            &PatchParams::apply(kubernetes::FIELD_MANAGER),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
}

const PREVIOUS_TRANSITION: &str = "2020-01-01T00:00:00Z";

fn assert_transitioned_at(conditions: &BTreeMap<String, Condition>, at: &str) {
    for (type_, condition) in conditions {
        assert_eq!(
            serde_json::to_value(&condition.last_transition_time).unwrap(),
            json!(at),
            "{type_}: still True since the previous run, so no transition"
        );
    }
}

async fn assert_deployed_condition_kept(hub: &Hub) {
    let conditions = hub.conditions().await;
    let deployed = find_condition(&conditions, "ProxyServerDeployed")
        .unwrap_or_else(|| panic!("someone-else's condition is gone: {conditions:?}"));
    assert_eq!(deployed.message, "Replicas: 3");
    let mpc = hub.mpcs().get(MPC).await.unwrap();
    let managers: Vec<String> = mpc
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|entry| entry.subresource.as_deref() == Some("status"))
        .filter_map(|entry| entry.manager.clone())
        .collect();
    assert!(
        managers.iter().any(|m| m == "someone-else")
            && managers.iter().any(|m| m == "cluster-proxy-cert-authority"),
        "status managers: {managers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sans_names_namespace_and_conditions_follow_the_mpc() {
    let hub = Hub::start(true).await;
    hub.apply_mpc(spec(
        &["foo", "10.9.8.7"],
        hostname("proxy.example.com"),
        json!({
            "signingProxyServerSecretName": "my-proxy-server",
            "signingAgentServerSecretName": "my-agent-server",
            "signingProxyClientSecretName": "my-proxy-client",
        }),
    ))
    .await;
    apply_deployed_condition(&hub).await;
    apply_previous_run_conditions(&hub).await;
    let names = ["my-proxy-server", "my-agent-server", "my-proxy-client"];
    let authority = Running::start(hub.api.client().await.unwrap(), Metrics::default());

    let wanted = |sans: &[String]| {
        [
            "foo",
            "10.9.8.7",
            "proxy.example.com",
            "entry.hub-proxy",
            "entry.hub-proxy.svc",
            "localhost",
            "127.0.0.1",
        ]
        .iter()
        .all(|san| has(sans, san))
    };
    certificate_when(&hub, "my-proxy-server", "the MPC's SANs", wanted).await;
    certificate_when(&hub, "my-agent-server", "the MPC's SANs", wanted).await;
    let first = signed_conditions(&hub, names).await;
    assert_transitioned_at(&first, PREVIOUS_TRANSITION);
    assert_deployed_condition_kept(&hub).await;
    // Only the MPC's namespace and names are used.
    let client_pem =
        certificate_pem(&hub.secrets(HUB_NS).get("my-proxy-client").await.unwrap()).unwrap();
    assert!(
        sans_of(&client_pem).is_empty(),
        "a client certificate carries no SANs"
    );
    assert!(
        hub.secrets(HUB_NS)
            .get_opt("proxy-server-ca")
            .await
            .unwrap()
            .is_some()
    );
    for name in ["proxy-server", "agent-server", "proxy-client"] {
        assert!(
            hub.secrets(HUB_NS).get_opt(name).await.unwrap().is_none(),
            "{name}"
        );
        assert!(
            hub.secrets(LEASE_NS).get_opt(name).await.unwrap().is_none(),
            "{name}"
        );
    }
    assert!(
        hub.secrets(LEASE_NS)
            .get_opt("cluster-proxy-signer")
            .await
            .unwrap()
            .is_some()
    );

    // Another SAN: both server certificates are re-issued with it; the
    // conditions stay True with their transition time, and the other
    // manager's condition survives the rewrite.
    let old = certificate_pem(&hub.secrets(HUB_NS).get("my-proxy-server").await.unwrap()).unwrap();
    hub.apply_mpc(spec(
        &["bar"],
        hostname("proxy.example.com"),
        json!({
            "signingProxyServerSecretName": "my-proxy-server",
            "signingAgentServerSecretName": "my-agent-server",
            "signingProxyClientSecretName": "my-proxy-client",
        }),
    ))
    .await;
    let swapped = |sans: &[String]| has(sans, "bar") && !has(sans, "foo") && !has(sans, "10.9.8.7");
    let new = certificate_when(&hub, "my-proxy-server", "bar instead of foo", swapped).await;
    assert_ne!(new, old);
    certificate_when(&hub, "my-agent-server", "bar instead of foo", swapped).await;
    let second = signed_conditions(&hub, names).await;
    assert_transitioned_at(&second, PREVIOUS_TRANSITION);
    eventually(
        "the conditions to record the new generation",
        WAIT,
        || async {
            let generation = hub.mpcs().get(MPC).await.ok()?.metadata.generation;
            let conditions = hub.conditions().await;
            find_condition(&conditions, "ProxyServerSecretSigned")
                .is_some_and(|c| c.observed_generation == generation)
                .then_some(())
        },
    )
    .await;
    assert_deployed_condition_kept(&hub).await;
    authority.stop().await;
}

/// The common name and whether the certificate is for clients (ClientAuth)
/// and for servers (ServerAuth).
fn subject_and_usage(pem: &str) -> (String, bool, bool) {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
    let certificate = block.parse_x509().unwrap();
    let name = certificate
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or_default()
        .to_owned();
    let usage = certificate.extended_key_usage().unwrap().unwrap().value;
    (name, usage.client_auth, usage.server_auth)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_user_server_keeps_the_service_access_certificates() {
    let hub = Hub::start(true).await;
    let default_names = json!({});
    // Without spec.userServer a user-server certificate is the user's own:
    // never touched, and no condition speaks of it.
    let users_ca =
        cert_authority::pki::Authority::generate("the user's CA", Duration::from_secs(86400))
            .unwrap();
    let users = users_ca
        .issue(&cert_authority::pki::LeafRequest::server(
            "cluster-proxy-addon-user",
            &["users.example.com"],
        ))
        .unwrap();
    let own: Secret = serde_json::from_value(json!({
        "metadata": {"name": "cluster-proxy-user-serving-cert"},
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": users.cert_pem, "tls.key": users.key_pem},
    }))
    .unwrap();
    hub.secrets(HUB_NS)
        .create(&PostParams::default(), &own)
        .await
        .unwrap();
    hub.apply_mpc(spec(
        &[],
        hostname("proxy.example.com"),
        default_names.clone(),
    ))
    .await;
    let authority = Running::start(hub.api.client().await.unwrap(), Metrics::default());
    signed_conditions(&hub, ["proxy-server", "agent-server", "proxy-client"]).await;
    let untouched = hub
        .secrets(HUB_NS)
        .get("cluster-proxy-user-serving-cert")
        .await
        .unwrap();
    assert_eq!(
        untouched.data.unwrap()["tls.crt"].0,
        users.cert_pem.as_bytes(),
        "the user's Secret was rewritten"
    );
    for name in [
        "cluster-proxy-user-server-identity",
        "cluster-proxy-service-proxy-server-cert",
    ] {
        assert!(
            hub.secrets(HUB_NS).get_opt(name).await.unwrap().is_none(),
            "{name}"
        );
    }
    assert!(find_condition(&hub.conditions().await, "UserServerSecretSigned").is_none());

    // spec.userServer set: the three certificates, upstream's SANs plus
    // the valid additional ones, and the condition.
    let mut with_user_server = spec(&[], hostname("proxy.example.com"), default_names);
    with_user_server["userServer"] =
        json!({"additionalSANs": ["users.example.com", "not a name!"]});
    hub.apply_mpc(with_user_server).await;
    let serving = certificate_when(
        &hub,
        "cluster-proxy-user-serving-cert",
        "upstream's user SANs",
        |sans| {
            [
                "users.example.com",
                "cluster-proxy-addon-user",
                "cluster-proxy-addon-user.hub-proxy",
                "cluster-proxy-addon-user.hub-proxy.svc",
                "cluster-proxy-addon-user.hub-proxy.svc.cluster.local",
                "localhost",
                "127.0.0.1",
            ]
            .iter()
            .all(|san| has(sans, san))
        },
    )
    .await;
    assert!(!has(&sans_of(&serving), "not a name!"));
    assert_ne!(serving, users.cert_pem, "now the authority's own");
    assert!(
        !has(&sans_of(&serving), "proxy.example.com"),
        "the proxy-server's SANs are not the user-server's"
    );
    let (_, client, server) = subject_and_usage(&serving);
    assert!(server && !client, "a serving certificate");
    let identity = certificate_when(
        &hub,
        "cluster-proxy-user-server-identity",
        "no SANs",
        |sans| sans.is_empty(),
    )
    .await;
    assert_eq!(
        subject_and_usage(&identity),
        ("cluster-proxy-user-server".to_owned(), true, false),
        "the identity service-proxies believe"
    );
    let service_proxy = certificate_when(
        &hub,
        "cluster-proxy-service-proxy-server-cert",
        "every cluster's hashed host",
        |sans| has(sans, "*.open-cluster-management.proxy") && has(sans, "localhost"),
    )
    .await;
    assert!(subject_and_usage(&service_proxy).2);
    let bundle = hub
        .secrets(HUB_NS)
        .get("proxy-server-ca")
        .await
        .unwrap()
        .data
        .unwrap()["ca.crt"]
        .clone();
    for name in [
        "cluster-proxy-user-serving-cert",
        "cluster-proxy-user-server-identity",
        "cluster-proxy-service-proxy-server-cert",
    ] {
        let secret = hub.secrets(HUB_NS).get(name).await.unwrap();
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"), "{name}");
        assert_eq!(
            secret.data.unwrap().get("ca.crt"),
            Some(&bundle),
            "{name} carries the bundle"
        );
    }
    eventually(
        "UserServerSecretSigned True with the certificate's expiry",
        WAIT,
        || async {
            let conditions = hub.conditions().await;
            let pem = certificate_pem(
                &hub.secrets(HUB_NS)
                    .get("cluster-proxy-user-serving-cert")
                    .await
                    .ok()?,
            )?;
            find_condition(&conditions, "UserServerSecretSigned")
                .is_some_and(|c| c.status == "True" && c.message == expiry_of(&pem))
                .then_some(())
        },
    )
    .await;
    authority.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancer_address_joins_the_sans_once_published() {
    let hub = Hub::start(true).await;
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "proxy-agent-entrypoint", "namespace": HUB_NS},
        "spec": {"type": "LoadBalancer", "ports": [{"name": "agent", "port": 8091}]},
    }))
    .unwrap();
    let services: Api<Service> = Api::namespaced(hub.admin.clone(), HUB_NS);
    services
        .create(&PostParams::default(), &service)
        .await
        .unwrap();
    hub.apply_mpc(spec(
        &[],
        json!({"type": "LoadBalancerService", "port": 8091}),
        json!({}),
    ))
    .await;
    let authority = Running::start(hub.api.client().await.unwrap(), Metrics::default());

    // No address yet: issued with the in-cluster names only.
    let pem = certificate_when(&hub, "proxy-server", "the in-cluster names", |sans| {
        has(sans, "entry.hub-proxy.svc")
    })
    .await;
    assert!(!has(&sans_of(&pem), "203.0.113.7"));
    signed_conditions(&hub, ["proxy-server", "agent-server", "proxy-client"]).await;

    let publish = |ingress: Value| {
        let services = services.clone();
        async move {
            let status = json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "proxy-agent-entrypoint"},
                "status": {"loadBalancer": {"ingress": ingress}}});
            services
                .patch_status(
                    "proxy-agent-entrypoint",
                    &PatchParams::apply("cloud-controller").force(),
                    &Patch::Apply(&status),
                )
                .await
                .unwrap();
        }
    };
    publish(json!([{"ip": "203.0.113.7"}])).await;
    certificate_when(&hub, "proxy-server", "the load balancer's IP", |sans| {
        has(sans, "203.0.113.7")
    })
    .await;
    certificate_when(&hub, "agent-server", "the load balancer's IP", |sans| {
        has(sans, "203.0.113.7")
    })
    .await;
    // A load balancer that publishes only a host name.
    publish(json!([{"hostname": "lb.example.com"}])).await;
    certificate_when(
        &hub,
        "agent-server",
        "the load balancer's host name",
        |sans| has(sans, "lb.example.com") && !has(sans, "203.0.113.7"),
    )
    .await;
    signed_conditions(&hub, ["proxy-server", "agent-server", "proxy-client"]).await;
    authority.stop().await;
}

fn exported(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_mpc_it_waits_and_starts_when_one_appears() {
    // Not even the CRD at first.
    let hub = Hub::start(false).await;
    let error = kubernetes::run_once(&hub.api.client().await.unwrap(), &options())
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("ManagedProxyConfiguration cluster-proxy does not exist"),
        "{error}"
    );

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let authority = Running::start(hub.api.client().await.unwrap(), metrics);
    eventually("the leader to say it waits", WAIT, || async {
        let text = exported(&registry);
        (text.contains("cert_authority_leader 1")
            && text.contains("cert_authority_waiting_for_configuration 1"))
        .then_some(())
    })
    .await;
    for namespace in [LEASE_NS, HUB_NS] {
        let secrets = hub
            .secrets(namespace)
            .list(&Default::default())
            .await
            .unwrap();
        assert!(
            secrets.items.is_empty(),
            "{namespace}: nothing is written while waiting"
        );
    }
    assert!(!authority.task.is_finished());

    hub.api.register_crds_from_yaml(CRD).unwrap();
    hub.apply_mpc(spec(&["foo"], hostname("proxy.example.com"), json!({})))
        .await;
    certificate_when(&hub, "proxy-server", "foo", |sans| has(sans, "foo")).await;
    signed_conditions(&hub, ["proxy-server", "agent-server", "proxy-client"]).await;
    eventually("the wait to end", WAIT, || async {
        exported(&registry)
            .contains("cert_authority_waiting_for_configuration 0")
            .then_some(())
    })
    .await;
    authority.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mpc_that_cannot_be_followed_gets_false_conditions_and_nothing_else() {
    let hub = Hub::start(true).await;
    hub.apply_mpc(spec(
        &[],
        hostname("proxy.example.com"),
        json!({"signingProxyServerSecretName": "same", "signingAgentServerSecretName": "same"}),
    ))
    .await;
    apply_deployed_condition(&hub).await;
    apply_previous_run_conditions(&hub).await;
    let authority = Running::start(hub.api.client().await.unwrap(), Metrics::default());
    let conditions = eventually("three False conditions", WAIT, || async {
        let conditions = hub.conditions().await;
        let unsigned = [
            "ProxyServerSecretSigned",
            "AgentServerSecretSigned",
            "ProxyClientSecretSigned",
        ]
        .iter()
        .all(|t| {
            find_condition(&conditions, t)
                .is_some_and(|c| c.status == "False" && c.reason == "NotYetSigned")
        });
        unsigned.then_some(conditions)
    })
    .await;
    let message = &find_condition(&conditions, "AgentServerSecretSigned")
        .unwrap()
        .message;
    assert!(message.contains("both \"same\""), "{message}");
    assert!(
        hub.secrets(HUB_NS)
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert_deployed_condition_kept(&hub).await;

    // Fixed: the conditions turn True.
    hub.apply_mpc(spec(&[], hostname("proxy.example.com"), json!({})))
        .await;
    signed_conditions(&hub, ["proxy-server", "agent-server", "proxy-client"]).await;
    authority.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_writes_the_conditions_once_and_every_request_is_in_the_rbac_rules() {
    let hub = Hub::start(true).await;
    hub.apply_mpc(spec(&["foo"], hostname("proxy.example.com"), json!({})))
        .await;
    let (client, log) = hub.recording_client().await;
    kubernetes::run_once(&client, &options()).await.unwrap();
    signed_conditions(&hub, ["proxy-server", "agent-server", "proxy-client"]).await;
    let status_writes = |log: &RequestLog| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|(method, uri)| {
                method == "PATCH"
                    && uri.contains("/managedproxyconfigurations/cluster-proxy/status")
            })
            .count()
    };
    assert_eq!(status_writes(&log), 1);
    for (method, uri) in log.lock().unwrap().iter() {
        rbac::check(method, uri).unwrap();
    }
    log.lock().unwrap().clear();
    kubernetes::run_once(&client, &options()).await.unwrap();
    assert!(!log.lock().unwrap().is_empty());
    assert_eq!(
        status_writes(&log),
        0,
        "nothing changed, so nothing was written"
    );
}
