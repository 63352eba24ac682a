//! Service access end to end, in one process: a hub (in-memory API with
//! RBAC, ManagedClusters) and its user-server; a proxy-server; cluster-a's
//! proxy-agent and service-proxy in front of cluster-a's own in-memory API
//! (RBAC on, so impersonation and denials are real); cluster-b registered
//! but without an agent. Users come as hub users (bearer tokens the hub's
//! TokenReview knows) and reach cluster-a with kube-rs and the real kubectl.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::service_access;
use http_body_util::{BodyExt, Empty};
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::api::{DeleteParams, DynamicObject, PostParams};
use kube::discovery::ApiResource;
use kube::{Api, Client};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::{Value, json};
use tunnel_harness::in_process::{AgentUnderTest, LocalReplicas};

const CLUSTER_A: &str = "cluster-a";
const CLUSTER_B: &str = "cluster-b";

struct Fleet {
    hub: KubeApi,
    managed: KubeApi,
    _replicas: LocalReplicas,
    _agent: AgentUnderTest,
    service_proxy: service_proxy::RunningServiceProxy,
    user_server: user_server::RunningUserServer,
    dir: tempfile::TempDir,
    /// The CA of the user-server's serving certificate (and of every test
    /// certificate).
    ca: PathBuf,
    pki_ca_pem: String,
    proxy_client: (String, String),
    identity: (String, String),
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: "v1".into(),
        api_version: if group.is_empty() {
            "v1".into()
        } else {
            format!("{group}/v1")
        },
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Creates `object` (JSON with apiVersion and kind) through `client`.
async fn create(client: &Client, object: Value) {
    let api_version = object["apiVersion"].as_str().unwrap().to_owned();
    let kind = object["kind"].as_str().unwrap().to_owned();
    let group = api_version.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
    let plural = format!("{}s", kind.to_lowercase());
    let resource = resource(group, &kind, &plural);
    let namespace = object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str);
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    api.create(
        &PostParams::default(),
        &serde_json::from_value(object).unwrap(),
    )
    .await
    .unwrap();
}

fn cluster_role(name: &str, rules: Value) -> Value {
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
           "metadata": {"name": name}, "rules": rules})
}

fn cluster_binding(name: &str, role: &str, subject_kind: &str, subject: &str) -> Value {
    let mut subject = json!({"kind": subject_kind, "name": subject});
    if subject_kind == "ServiceAccount" {
        let (ns, name) = subject["name"].as_str().unwrap().split_once('/').unwrap();
        subject = json!({"kind": "ServiceAccount", "namespace": ns, "name": name});
    } else {
        subject["apiGroup"] = json!("rbac.authorization.k8s.io");
    }
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
           "metadata": {"name": name},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
           "subjects": [subject]})
}

/// Grants hub group `group` the user-server's access to `cluster`.
async fn grant_hub_access(hub: &Client, name: &str, group: &str, cluster: &str) {
    create(
        hub,
        cluster_role(
            name,
            json!([{"apiGroups": ["cluster.open-cluster-management.io"],
                    "resources": ["managedclusters/proxy"], "resourceNames": [cluster],
                    "verbs": ["get"]}]),
        ),
    )
    .await;
    create(hub, cluster_binding(name, name, "Group", group)).await;
}

impl Fleet {
    async fn start() -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let api = |sub: &str| {
            let mut options = KubeApiOptions::new(dir.path().join(sub));
            options.rbac = true;
            options
        };
        let hub = KubeApi::start(api("hub")).await.unwrap();
        hub.register_crds_from_yaml(simulated_cluster::ocm::CRDS)
            .unwrap();
        let hub_admin = hub.client().await.unwrap();
        for cluster in [CLUSTER_A, CLUSTER_B] {
            create(
                &hub_admin,
                json!({"apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                       "metadata": {"name": cluster}, "spec": {"hubAcceptsClient": true}}),
            )
            .await;
        }
        // The user-server's hub identity: reviews, and the cluster list.
        create(
            &hub_admin,
            cluster_binding(
                "user-server-auth",
                "system:auth-delegator",
                "User",
                "user-server",
            ),
        )
        .await;
        create(
            &hub_admin,
            cluster_role(
                "user-server-clusters",
                json!([{"apiGroups": ["cluster.open-cluster-management.io"],
                        "resources": ["managedclusters"], "verbs": ["get", "list", "watch"]}]),
            ),
        )
        .await;
        create(
            &hub_admin,
            cluster_binding(
                "user-server-clusters",
                "user-server-clusters",
                "User",
                "user-server",
            ),
        )
        .await;
        grant_hub_access(&hub_admin, "team-a-cluster-a", "team-a", CLUSTER_A).await;
        grant_hub_access(&hub_admin, "team-a-cluster-b", "team-a", CLUSTER_B).await;

        // cluster-a's own API: the service-proxy's ServiceAccount may
        // impersonate; the hub's alice may read ConfigMaps in default.
        let managed = KubeApi::start(api("cluster-a")).await.unwrap();
        let managed_admin = managed.client().await.unwrap();
        let account: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": "cluster-proxy"}})).unwrap();
        Api::<ServiceAccount>::namespaced(managed_admin.clone(), "default")
            .create(&PostParams::default(), &account)
            .await
            .unwrap();
        let kubeconfig = managed
            .kubeconfigs(None)
            .write_service_account("default", "cluster-proxy")
            .unwrap();
        let token = std::fs::read_to_string(kubeconfig)
            .unwrap()
            .lines()
            .find_map(|l| l.trim().strip_prefix("token: ").map(str::to_owned))
            .unwrap();
        create(
            &managed_admin,
            cluster_role(
                "impersonator",
                json!([{"apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"]}]),
            ),
        )
        .await;
        create(
            &managed_admin,
            cluster_binding(
                "impersonator",
                "impersonator",
                "ServiceAccount",
                "default/cluster-proxy",
            ),
        )
        .await;
        create(
            &managed_admin,
            cluster_role(
                "configmap-reader",
                json!([{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]),
            ),
        )
        .await;
        create(
            &managed_admin,
            cluster_binding(
                "hub-alice-reads",
                "configmap-reader",
                "User",
                "cluster:hub:alice",
            ),
        )
        .await;

        // The tunnel, and the certificates of service access.
        let replicas = LocalReplicas::start(&[CLUSTER_A, CLUSTER_B], 1)
            .await
            .unwrap();
        let ca = replicas.pki.ca.cert_pem().to_owned();
        let files = dir.path().join("pki");
        std::fs::create_dir_all(&files).unwrap();
        let ca_path = write(&files, "ca.crt", &ca);
        let cluster_a = ClusterName::new(CLUSTER_A).unwrap();
        let hashed = cluster_a.service_proxy_host();
        let issue =
            |request: cert_authority::pki::LeafRequest| replicas.pki.ca.issue(&request).unwrap();
        let serving = issue(cert_authority::pki::LeafRequest::server(
            "service-proxy",
            &[hashed.as_str()],
        ));
        let identity = issue(cert_authority::pki::LeafRequest::client(
            service_access::USER_SERVER_IDENTITY,
        ));
        let user_serving = issue(cert_authority::pki::LeafRequest::server(
            "cluster-proxy-addon-user",
            &["localhost", "127.0.0.1"],
        ));

        let service_proxy = service_proxy::start(service_proxy::ServiceProxyConfig {
            cluster: cluster_a.clone(),
            listen: "127.0.0.1:0".parse().unwrap(),
            cert: write(&files, "service-proxy.crt", &serving.cert_pem),
            key: write(&files, "service-proxy.key", &serving.key_pem),
            user_server_ca: ca_path.clone(),
            user_server_name: service_access::USER_SERVER_IDENTITY.into(),
            kube_api: format!("https://127.0.0.1:{}", managed.addr().port())
                .parse()
                .unwrap(),
            kube_ca: write(&files, "managed-ca.crt", managed.ca_pem()),
            token_file: write(&files, "token", &token),
            impersonation: true,
            health: "127.0.0.1:0".parse().unwrap(),
            reload_interval: Duration::from_millis(200),
        })
        .await
        .unwrap();

        let server = &replicas.servers[0];
        let before = server.tunnel_count();
        let mut agent = proxy_agent::AgentConfig::new(proxy_agent::TlsSource::Config(
            replicas.pki.agent_tls(CLUSTER_A).unwrap(),
        ))
        .with_ephemeral_ports();
        agent.proxy_server_host = "localhost".into();
        agent.proxy_server_port = server.agent_addr.port();
        agent.agent_id = "cluster-a-agent".into();
        agent.agent_identifiers = format!("host={CLUSTER_A}&host={hashed}");
        agent.sync_interval = Duration::from_millis(200);
        agent.host_aliases = [(hashed.clone(), std::net::IpAddr::from([127, 0, 0, 1]))]
            .into_iter()
            .collect();
        let agent = AgentUnderTest::start_with(agent).await.unwrap();
        assert!(
            simulated_cluster::wait::wait_until(Duration::from_secs(10), || server.tunnel_count()
                > before)
            .await,
            "cluster-a's agent did not connect"
        );

        let hub_user_server =
            KubeApi::client_from(&hub.kubeconfig_for("user-server", &[]).unwrap())
                .await
                .unwrap();
        let config = user_server::UserServerConfig {
            proxy_server: ("localhost".into(), server.client_addr.port()),
            proxy_ca_cert: ca_path.clone(),
            proxy_cert: write(
                &files,
                "proxy-client.crt",
                &replicas.pki.proxy_client.cert_pem,
            ),
            proxy_key: write(
                &files,
                "proxy-client.key",
                &replicas.pki.proxy_client.key_pem,
            ),
            listen: "127.0.0.1:0".parse().unwrap(),
            server_cert: write(&files, "user.crt", &user_serving.cert_pem),
            server_key: write(&files, "user.key", &user_serving.key_pem),
            client_ca: None,
            service_proxy_ca_cert: ca_path.clone(),
            service_proxy_port: service_proxy.addr.port(),
            identity_cert: write(&files, "identity.crt", &identity.cert_pem),
            identity_key: write(&files, "identity.key", &identity.key_pem),
            hub_kubeconfig: None,
            token_review_cache_ttl: Duration::from_secs(60),
            authorization_cache_ttl: Duration::from_millis(300),
            cache_size: 1000,
            max_idle_connections_per_cluster: 8,
            idle_connection_timeout: Duration::from_secs(30),
            dial_timeout: Duration::from_secs(5),
            response_header_timeout: Duration::from_secs(10),
            health: "127.0.0.1:0".parse().unwrap(),
            reload_interval: Duration::from_millis(200),
        };
        let user_server = user_server::start(config, hub_user_server).await.unwrap();
        let proxy_client = (
            replicas.pki.proxy_client.cert_pem.clone(),
            replicas.pki.proxy_client.key_pem.clone(),
        );
        let fleet = Fleet {
            hub,
            managed,
            _replicas: replicas,
            _agent: agent,
            service_proxy,
            user_server,
            ca: ca_path,
            pki_ca_pem: ca,
            proxy_client,
            identity: (identity.cert_pem.clone(), identity.key_pem.clone()),
            dir,
        };
        let health = fleet.user_server.health_addr;
        simulated_cluster::wait::eventually(
            "the user-server's readiness",
            Duration::from_secs(10),
            || async {
                matches!(
                    tunnel_harness::in_process::health_get(health, "/readyz").await,
                    Ok((200, _))
                )
                .then_some(())
            },
        )
        .await;
        fleet
    }

    fn base(&self, cluster: &str) -> String {
        format!(
            "https://127.0.0.1:{}/{cluster}",
            self.user_server.addr.port()
        )
    }

    /// A hub user with `groups` and a token of it.
    fn hub_user(&self, name: &str, groups: &[&str]) -> String {
        self.hub.kubeconfigs(None).token(name, groups)
    }

    /// A kube-rs client of `cluster` through the user-server, as `token`.
    async fn client(&self, cluster: &str, token: &str) -> Client {
        let mut config = kube::Config::new(self.base(cluster).parse().unwrap());
        config.root_cert = Some(vec![
            rustls_pki_types::CertificateDer::from_pem_slice(self.pki_ca_pem.as_bytes())
                .unwrap()
                .to_vec(),
        ]);
        config.auth_info.token = Some(token.to_owned().into());
        Client::try_from(config).unwrap()
    }

    /// One request to the user-server: status and body.
    async fn request(&self, path: &str, headers: &[(&str, &str)]) -> (http::StatusCode, Value) {
        let request = headers
            .iter()
            .fold(
                http::Request::get(format!(
                    "https://127.0.0.1:{}{path}",
                    self.user_server.addr.port()
                )),
                |request, (name, value)| request.header(*name, *value),
            )
            .body(Empty::<Bytes>::new())
            .unwrap();
        https_request(&self.pki_ca_pem, None, request).await
    }

    /// kubectl against `cluster` through the user-server, as `token`.
    async fn kubectl(&self, cluster: &str, token: &str, args: &[&str]) -> std::process::Output {
        let mut command = tokio::process::Command::new("kubectl");
        command
            .env("KUBECONFIG", self.dir.path().join("no-kubeconfig"))
            .arg(format!("--server={}", self.base(cluster)))
            .arg(format!("--token={token}"))
            .arg(format!("--certificate-authority={}", self.ca.display()))
            .arg(format!(
                "--cache-dir={}",
                self.dir.path().join("kubectl-cache").display()
            ))
            .args(args)
            .kill_on_drop(true);
        tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .expect("kubectl finishes within 60 s")
            .expect("kubectl runs")
    }
}

use rustls_pki_types::pem::PemObject;

/// One HTTPS request verified against `ca_pem`, with a client certificate
/// when given; the status and the JSON body (`null` when not JSON).
async fn https_request(
    ca_pem: &str,
    client_cert: Option<(&str, &str)>,
    request: http::Request<Empty<Bytes>>,
) -> (http::StatusCode, Value) {
    use cluster_proxy_runtime::tls::{self, Identity, Pem};
    let roots = tls::roots(&Pem::text("ca", ca_pem)).unwrap();
    let identity = client_cert.map(|(cert, key)| {
        Identity::new(&Pem::text("cert", cert), &Pem::text("key", key)).unwrap()
    });
    let config = tls::client_config(roots, identity, &[b"http/1.1"]).unwrap();
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    let mut config = (*config).clone();
    config.alpn_protocols.clear();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .wrap_connector(http);
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(connector);
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .expect("an answer within 20 s")
        .expect("the request is answered");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn kubectl_available() -> bool {
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").is_err(),
            "under CI kubectl must be installed (.ci/run installs it)"
        );
        eprintln!("SKIPPED the kubectl part: kubectl is not installed");
    }
    found
}

fn stdout(output: &std::process::Output) -> String {
    assert!(
        output.status.success(),
        "kubectl failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr_of_failure(output: &std::process::Output) -> String {
    assert!(
        !output.status.success(),
        "kubectl succeeded: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn a_hub_user_reaches_a_cluster_as_itself_and_both_rbacs_decide() {
    let fleet = Fleet::start().await;
    let managed = fleet.managed.client().await.unwrap();
    let configmaps = Api::<ConfigMap>::namespaced(managed.clone(), "default");
    let greeting: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "greeting"}, "data": {"hello": "from cluster-a"}}),
    )
    .unwrap();
    configmaps
        .create(&PostParams::default(), &greeting)
        .await
        .unwrap();
    let alice = fleet.hub_user("alice", &["team-a"]);

    // kube-rs through the user-server: get, and a watch that sees a change.
    let through = fleet.client(CLUSTER_A, &alice).await;
    let remote = Api::<ConfigMap>::namespaced(through.clone(), "default");
    let got = remote.get("greeting").await.unwrap();
    assert_eq!(got.data.unwrap()["hello"], "from cluster-a");
    let mut watch = std::pin::pin!(kube::runtime::watcher(
        remote.clone(),
        kube::runtime::watcher::Config::default()
    ));
    use futures_util::StreamExt;
    let mut seen_init = false;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("watch events")
    {
        if matches!(event.unwrap(), kube::runtime::watcher::Event::InitDone) {
            seen_init = true;
            break;
        }
    }
    assert!(seen_init);
    let later: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "later"}})).unwrap();
    configmaps
        .create(&PostParams::default(), &later)
        .await
        .unwrap();
    let applied = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(event) = watch.next().await {
            if let Ok(kube::runtime::watcher::Event::Apply(cm)) = event {
                return cm.metadata.name;
            }
        }
        None
    })
    .await
    .expect("the watch delivers the new ConfigMap");
    assert_eq!(applied.as_deref(), Some("later"));

    // The managed cluster's RBAC: alice (as cluster:hub:alice) may not read Secrets.
    let secrets = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(through.clone(), "default");
    match secrets.list(&Default::default()).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403);
            assert!(
                status.message.contains("cluster:hub:alice"),
                "{}",
                status.message
            );
        }
        other => panic!("listing Secrets must be forbidden: {other:?}"),
    }

    if kubectl_available() {
        let listed = stdout(
            &fleet
                .kubectl(
                    CLUSTER_A,
                    &alice,
                    &["get", "configmaps", "-n", "default", "-o", "name"],
                )
                .await,
        );
        assert!(
            listed.contains("configmap/greeting") && listed.contains("configmap/later"),
            "{listed}"
        );
        // Who the managed cluster takes alice for; an injected
        // impersonation (kubectl --as) is removed, not honoured.
        for args in [
            &["auth", "whoami", "-o", "json"][..],
            &[
                "--as=system:admin",
                "--as-group=system:masters",
                "auth",
                "whoami",
                "-o",
                "json",
            ],
        ] {
            let whoami: Value =
                serde_json::from_str(&stdout(&fleet.kubectl(CLUSTER_A, &alice, args).await))
                    .unwrap();
            assert_eq!(
                whoami.pointer("/status/userInfo/username"),
                Some(&json!("cluster:hub:alice")),
                "{args:?}: {whoami}"
            );
            let groups = whoami
                .pointer("/status/userInfo/groups")
                .unwrap()
                .to_string();
            assert!(
                groups.contains("cluster:hub:team-a") && !groups.contains("system:masters"),
                "{groups}"
            );
        }
        // `cluster-proxy kubeconfig`: a context per cluster, alice's own
        // hub credential, the user-server's CA; kubectl just works.
        let alice_hub = fleet.hub.kubeconfig_for("alice", &["team-a"]).unwrap();
        let hub_config = kube::config::Kubeconfig::read_from(&alice_hub).unwrap();
        let written = cluster_proxy_cli::kubeconfig::for_clusters(
            &hub_config,
            None,
            &format!("https://127.0.0.1:{}", fleet.user_server.addr.port()),
            &fleet.pki_ca_pem,
            &[CLUSTER_A.to_owned(), CLUSTER_B.to_owned()],
        )
        .unwrap();
        let path = fleet.dir.path().join("clusters.kubeconfig");
        cluster_proxy_cli::kubeconfig::write(&written, &path).unwrap();
        let mut command = tokio::process::Command::new("kubectl");
        command
            .arg(format!("--kubeconfig={}", path.display()))
            .args([
                "--context",
                CLUSTER_A,
                "get",
                "configmap",
                "greeting",
                "-n",
                "default",
                "-o",
                "jsonpath={.data.hello}",
            ])
            .kill_on_drop(true);
        let output = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stdout(&output), "from cluster-a");

        let denied = stderr_of_failure(
            &fleet
                .kubectl(CLUSTER_A, &alice, &["get", "secrets", "-n", "default"])
                .await,
        );
        assert!(
            denied.contains("Forbidden") && denied.contains("cluster:hub:alice"),
            "{denied}"
        );
    }

    // Revoked on the hub: refused (403 naming the cluster) once the
    // authorization cache's 300 ms have passed.
    let hub = fleet.hub.client().await.unwrap();
    Api::<DynamicObject>::all_with(
        hub,
        &resource(
            "rbac.authorization.k8s.io",
            "ClusterRoleBinding",
            "clusterrolebindings",
        ),
    )
    .delete("team-a-cluster-a", &DeleteParams::default())
    .await
    .unwrap();
    simulated_cluster::wait::eventually("a revoked hub grant refused", Duration::from_secs(5), || async {
        matches!(remote.get("greeting").await, Err(kube::Error::Api(ref s)) if s.code == 403 && s.message.contains("cluster-a"))
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn bad_requests_get_kubernetes_status_answers() {
    let fleet = Fleet::start().await;
    let alice = fleet.hub_user("alice", &["team-a"]);
    let bob = fleet.hub_user("bob", &["team-b"]);
    let bearer = |token: &str| format!("Bearer {token}");
    let cases: Vec<(&str, Option<String>, u16, &str)> = vec![
        (
            "/cluster-a/api/v1/namespaces/default/configmaps",
            None,
            401,
            "no credentials",
        ),
        (
            "/cluster-a/api/v1/namespaces/default/configmaps",
            Some(bearer("not-a-token")),
            401,
            "not valid on the hub",
        ),
        ("/", Some(bearer(&alice)), 400, "names no cluster"),
        (
            "/Not_A_Cluster/api",
            Some(bearer(&alice)),
            400,
            "not a cluster name",
        ),
        (
            "/cluster-z/api/v1/namespaces",
            Some(bearer(&alice)),
            404,
            r#""cluster-z" not found"#,
        ),
        (
            "/cluster-b/api/v1/namespaces",
            Some(bearer(&alice)),
            503,
            "no live agent",
        ),
        (
            "/cluster-a/api/v1/namespaces",
            Some(bearer(&bob)),
            403,
            r#"may not reach cluster "cluster-a""#,
        ),
    ];
    for (path, authorization, code, message) in cases {
        let headers: Vec<(&str, &str)> = authorization
            .as_deref()
            .map(|a| vec![("authorization", a)])
            .unwrap_or_default();
        let (status, body) = fleet.request(path, &headers).await;
        assert_eq!(status.as_u16(), code, "{path}: {body}");
        assert_eq!(body["kind"], "Status", "{path}: {body}");
        assert_eq!(body["code"], code, "{path}: {body}");
        let text = body["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(message),
            "{path}: {text:?} should say {message:?}"
        );
    }

    // Identity headers a client sends are removed: the request runs as
    // cluster:hub:alice, not as the user it names.
    let (status, body) = fleet
        .request(
            "/cluster-a/api/v1/namespaces/default/configmaps",
            &[
                ("authorization", &bearer(&alice)),
                ("impersonate-user", "system:admin"),
                ("x-remote-user", "system:admin"),
                (service_access::USER, "system:admin"),
            ],
        )
        .await;
    assert_eq!(status, 200, "{body}");

    // Straight to the service-proxy with a hub certificate that is not the
    // user-server's: its claims are not believed.
    let direct = |cluster: &str| {
        http::Request::get(format!(
            "https://127.0.0.1:{}/api/v1/namespaces/default/configmaps",
            fleet.service_proxy.addr.port()
        ))
        .header(service_access::CLUSTER, cluster)
        .header(service_access::USER, "alice")
        .header(
            http::header::HOST,
            ClusterName::new(CLUSTER_A).unwrap().service_proxy_host(),
        )
        .body(Empty::<Bytes>::new())
        .unwrap()
    };
    let service_proxy_ca = fleet.pki_ca_pem.clone();
    let (cert, key) = &fleet.proxy_client;
    // rustls verifies the serving certificate for the hashed host; connect
    // by that name.
    let (status, body) = https_request_to(
        &service_proxy_ca,
        Some((cert, key)),
        direct(CLUSTER_A),
        &fleet,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("only the hub's user-server"),
        "{body}"
    );
    // With the user-server's identity but for another cluster: misdirected.
    let (cert, key) = &fleet.identity;
    let (status, body) = https_request_to(
        &service_proxy_ca,
        Some((cert, key)),
        direct(CLUSTER_B),
        &fleet,
    )
    .await;
    assert_eq!(status, 421, "{body}");

    // Every request above is audited: counted per cluster and code.
    let (code, metrics) =
        tunnel_harness::in_process::health_get(fleet.user_server.health_addr, "/metrics")
            .await
            .unwrap();
    assert_eq!(code, 200);
    for line in [
        r#"user_server_requests_total{cluster="cluster-z",code="404"} 1"#,
        r#"user_server_requests_total{cluster="cluster-b",code="503"} 1"#,
        r#"user_server_requests_total{cluster="cluster-a",code="403"} 1"#,
        r#"user_server_requests_total{cluster="cluster-a",code="401"} 2"#,
        r#"user_server_requests_total{cluster="cluster-a",code="200"} 1"#,
        r#"user_server_requests_total{cluster="",code="400"} 2"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    let received = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"user_server_response_bytes_total{cluster="cluster-a"} "#))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(received > 0, "the 200's body is counted:\n{metrics}");
}

/// [`https_request`] to the service-proxy's loopback port, verifying its
/// certificate for cluster-a's hashed host.
async fn https_request_to(
    ca_pem: &str,
    client_cert: Option<(&str, &str)>,
    request: http::Request<Empty<Bytes>>,
    fleet: &Fleet,
) -> (http::StatusCode, Value) {
    use cluster_proxy_runtime::tls::{self, Identity, Pem};
    let roots = tls::roots(&Pem::text("ca", ca_pem)).unwrap();
    let identity = client_cert.map(|(cert, key)| {
        Identity::new(&Pem::text("cert", cert), &Pem::text("key", key)).unwrap()
    });
    let config = tls::client_config(roots, identity, &[b"http/1.1"]).unwrap();
    let tcp = tokio::net::TcpStream::connect(fleet.service_proxy.addr)
        .await
        .unwrap();
    let name = rustls_pki_types::ServerName::try_from(
        ClusterName::new(CLUSTER_A).unwrap().service_proxy_host(),
    )
    .unwrap();
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(connection);
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_users_requests_cost_the_hub_one_token_review() {
    let fleet = Fleet::start().await;
    let alice = fleet.hub_user("alice", &["team-a"]);
    let before = fleet.hub.token_reviews();
    let through = fleet.client(CLUSTER_A, &alice).await;
    let remote = Api::<ConfigMap>::namespaced(through, "default");
    // Concurrent first requests share one review, later ones hit the cache.
    let params = kube::api::ListParams::default();
    let first: Vec<_> = futures_util::future::join_all((0..10).map(|_| remote.list(&params))).await;
    assert!(first.iter().all(Result::is_ok), "{first:?}");
    for _ in 0..40 {
        remote.list(&Default::default()).await.unwrap();
    }
    assert_eq!(
        fleet.hub.token_reviews() - before,
        1,
        "50 requests, one review"
    );
    assert_eq!(fleet.user_server.cached_tokens(), 1);
}

/// Grants hub alice (as `cluster:hub:alice` on cluster-a) port-forwarding
/// to the pods of `default`, and runs pod `echo-0` with an echo server on
/// container port 7000.
async fn echo_pod(fleet: &Fleet) -> simulated_cluster::targets::EchoServer {
    let managed = fleet.managed.client().await.unwrap();
    create(
        &managed,
        cluster_role(
            "port-forwarder",
            json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                   {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["get", "create"]}]),
        ),
    )
    .await;
    create(
        &managed,
        cluster_binding(
            "hub-alice-forwards",
            "port-forwarder",
            "User",
            "cluster:hub:alice",
        ),
    )
    .await;
    let echo = simulated_cluster::targets::EchoServer::start()
        .await
        .unwrap();
    fleet
        .managed
        .kubelet()
        .run(&memory_apiserver::pods::RunningPod {
            namespace: "default".into(),
            name: "echo-0".into(),
            ports: vec![("echo".into(), 7000, echo.addr)],
            ready: true,
            pod_ip: Some(echo.addr.ip()),
            ..Default::default()
        })
        .unwrap();
    echo
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_streams_through_the_user_server_and_the_service_proxy() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fleet = Fleet::start().await;
    let _echo = echo_pod(&fleet).await;
    let alice = fleet.hub_user("alice", &["team-a"]);

    // kube-rs's WebSocket port-forward: the upgrade crosses both proxies.
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(
        fleet.client(CLUSTER_A, &alice).await,
        "default",
    );
    let mut forward = pods.portforward("echo-0", &[7000]).await.unwrap();
    let mut stream = forward.take_stream(7000).unwrap();
    let payload: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let (mut read, mut write) = tokio::io::split(&mut stream);
    let sent = payload.clone();
    let (written, back) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(write.write_all(&sent), async {
            let mut back = vec![0u8; payload.len()];
            read.read_exact(&mut back).await.map(|_| back)
        })
    })
    .await
    .expect("4 MiB echoed through the port-forward within 30 s");
    written.unwrap();
    assert!(back.unwrap() == payload, "the echo differs");
    drop(stream);
    forward.abort();

    // kubectl's own port-forward (SPDY, or SPDY tunneled in WebSocket) is
    // not served by the in-memory API yet; the relay above is the same for
    // any upgrade.
}
