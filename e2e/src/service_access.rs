//! Service access as one process holds it, for the scenario tests and the
//! benchmark: a hub (in-memory API with RBAC, ManagedClusters) and its
//! user-server; a proxy-server; cluster-a's proxy-agent and service-proxy
//! in front of cluster-a's own in-memory API (RBAC on, so impersonation
//! and denials are real); cluster-b registered but without an agent. Hub
//! user `alice` of group `team-a` may reach both clusters on the hub and
//! read ConfigMaps in cluster-a's `default` as `cluster:hub:alice`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::service_access;
use http_body_util::{BodyExt, Empty};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{DynamicObject, PostParams};
use kube::discovery::ApiResource;
use kube::{Api, Client};
use memory_apiserver::{KubeApi, KubeApiOptions};
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};
use tunnel_harness::in_process::{AgentUnderTest, LocalReplicas};

pub const CLUSTER_A: &str = "cluster-a";
pub const CLUSTER_B: &str = "cluster-b";
/// Where the user-server reads its exposed-services allowlist on the hub.
pub const EXPOSED_SERVICES_NAMESPACE: &str = "default";
/// Services of cluster-a the service-proxy finds on 127.0.0.1 (its host
/// aliases, as a pod's hostAliases would say), for the `proxy-service` path.
pub const LOOPBACK_SERVICES: &[&str] = &["hello.apps.svc", "secure.apps.svc"];

/// The in-memory fleet: a hub API, cluster-a's API, and the service-access
/// path between them.
pub struct Fleet {
    pub hub: KubeApi,
    pub managed: KubeApi,
    pub path: AccessPath,
    pub dir: tempfile::TempDir,
}

/// cluster-a's kube API as the service-proxy sees it.
pub struct ManagedApi {
    /// `https://host:port`.
    pub url: String,
    pub ca_pem: String,
    /// The service-proxy's ServiceAccount token (allowed to impersonate).
    pub token: String,
}

/// The path of service access for cluster-a, on any hub and managed API: a
/// proxy-server, cluster-a's proxy-agent and service-proxy, the hub's
/// user-server.
pub struct AccessPath {
    replicas: LocalReplicas,
    _agent: AgentUnderTest,
    pub service_proxy: service_proxy::RunningServiceProxy,
    pub user_server: user_server::RunningUserServer,
    dir: PathBuf,
    /// The CA of the user-server's serving certificate (and of every test
    /// certificate).
    pub ca: PathBuf,
    pub pki_ca_pem: String,
    pub proxy_client: (String, String),
    pub identity: (String, String),
    /// The hub's client CA: certificates it issues authenticate users at
    /// the user-server (CN the user, O the groups).
    hub_client_ca: rcgen::Issuer<'static, rcgen::KeyPair>,
}

/// A CA for hub users' client certificates, and its PEM.
fn hub_client_ca() -> anyhow::Result<(rcgen::Issuer<'static, rcgen::KeyPair>, String)> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "hub client CA");
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key)?;
    Ok((rcgen::Issuer::new(params, key), cert.pem()))
}

pub fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

pub fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
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
pub async fn create(client: &Client, object: Value) -> anyhow::Result<()> {
    let text = |field: &str| {
        object[field]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("the object has no {field}"))
    };
    let (api_version, kind) = (text("apiVersion")?, text("kind")?);
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
    api.create(&PostParams::default(), &serde_json::from_value(object)?)
        .await
        .with_context(|| format!("creating a {kind}"))?;
    Ok(())
}

pub fn cluster_role(name: &str, rules: Value) -> Value {
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
           "metadata": {"name": name}, "rules": rules})
}

/// A ClusterRoleBinding of `role` to one subject: a `User`, a `Group`, or
/// a `ServiceAccount` named `namespace/name`.
pub fn cluster_binding(name: &str, role: &str, subject_kind: &str, subject: &str) -> Value {
    let subject = match (subject_kind, subject.split_once('/')) {
        ("ServiceAccount", Some((namespace, account))) => {
            json!({"kind": "ServiceAccount", "namespace": namespace, "name": account})
        }
        _ => {
            json!({"kind": subject_kind, "name": subject, "apiGroup": "rbac.authorization.k8s.io"})
        }
    };
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
           "metadata": {"name": name},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
           "subjects": [subject]})
}

/// Lets `user` follow the exposed-services ConfigMap, as the chart's Role
/// does: list and watch of that one name (kube-apiserver authorizes a
/// watch pinned to a name by its field selector against resourceNames).
pub async fn grant_exposed_services_watch(admin: &Client, user: &str) -> anyhow::Result<()> {
    let name = format!("{user}-exposed-services");
    create(
        admin,
        cluster_role(
            &name,
            json!([{"apiGroups": [""], "resources": ["configmaps"],
                    "resourceNames": [user_server::exposed::DEFAULT_CONFIGMAP],
                    "verbs": ["list", "watch"]}]),
        ),
    )
    .await?;
    create(admin, cluster_binding(&name, &name, "User", user)).await
}

/// Grants hub group `group` the user-server's access to `cluster`.
pub async fn grant_hub_access(
    hub: &Client,
    name: &str,
    group: &str,
    cluster: &str,
) -> anyhow::Result<()> {
    create(
        hub,
        cluster_role(
            name,
            json!([{"apiGroups": ["cluster.open-cluster-management.io"],
                    "resources": ["managedclusters/proxy"], "resourceNames": [cluster],
                    "verbs": ["get"]}]),
        ),
    )
    .await?;
    create(hub, cluster_binding(name, name, "Group", group)).await
}

impl Fleet {
    pub async fn start() -> anyhow::Result<Fleet> {
        Fleet::start_with(|_| {}).await
    }

    /// [`Fleet::start`], with the user-server's configuration changed by
    /// `tweak` first.
    pub async fn start_with(
        tweak: impl FnOnce(&mut user_server::UserServerConfig),
    ) -> anyhow::Result<Fleet> {
        let dir = tempfile::tempdir()?;
        let api = |sub: &str| {
            let mut options = KubeApiOptions::new(dir.path().join(sub));
            options.rbac = true;
            options
        };
        let hub = KubeApi::start(api("hub")).await?;
        hub.register_crds_from_yaml(simulated_cluster::ocm::CRDS)?;
        let hub_admin = hub.client().await?;
        for cluster in [CLUSTER_A, CLUSTER_B] {
            create(
                &hub_admin,
                json!({"apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                       "metadata": {"name": cluster}, "spec": {"hubAcceptsClient": true}}),
            )
            .await?;
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
        .await?;
        create(
            &hub_admin,
            cluster_role(
                "user-server-clusters",
                json!([{"apiGroups": ["cluster.open-cluster-management.io"],
                        "resources": ["managedclusters"], "verbs": ["get", "list", "watch"]}]),
            ),
        )
        .await?;
        create(
            &hub_admin,
            cluster_binding(
                "user-server-clusters",
                "user-server-clusters",
                "User",
                "user-server",
            ),
        )
        .await?;
        grant_exposed_services_watch(&hub_admin, "user-server").await?;
        grant_hub_access(&hub_admin, "team-a-cluster-a", "team-a", CLUSTER_A).await?;
        grant_hub_access(&hub_admin, "team-a-cluster-b", "team-a", CLUSTER_B).await?;

        // cluster-a's own API: the service-proxy's ServiceAccount may
        // impersonate; the hub's alice may read ConfigMaps in default.
        let managed = KubeApi::start(api("cluster-a")).await?;
        let managed_admin = managed.client().await?;
        let account: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": "cluster-proxy"}}))?;
        Api::<ServiceAccount>::namespaced(managed_admin.clone(), "default")
            .create(&PostParams::default(), &account)
            .await?;
        let kubeconfig = managed
            .kubeconfigs(None)
            .write_service_account("default", "cluster-proxy")?;
        let token = std::fs::read_to_string(kubeconfig)?
            .lines()
            .find_map(|l| l.trim().strip_prefix("token: ").map(str::to_owned))
            .context("the ServiceAccount kubeconfig has no token")?;
        create(
            &managed_admin,
            cluster_role(
                "impersonator",
                json!([{"apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"]}]),
            ),
        )
        .await?;
        create(
            &managed_admin,
            cluster_binding(
                "impersonator",
                "impersonator",
                "ServiceAccount",
                "default/cluster-proxy",
            ),
        )
        .await?;
        create(
            &managed_admin,
            cluster_role(
                "configmap-reader",
                json!([{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]),
            ),
        )
        .await?;
        create(
            &managed_admin,
            cluster_binding(
                "hub-alice-reads",
                "configmap-reader",
                "User",
                "cluster:hub:alice",
            ),
        )
        .await?;

        let hub_identity = KubeApi::client_from(&hub.kubeconfig_for("user-server", &[])?).await?;
        let path = AccessPath::start_with(
            dir.path(),
            hub_identity,
            ManagedApi {
                url: format!("https://127.0.0.1:{}", managed.addr().port()),
                ca_pem: managed.ca_pem().to_owned(),
                token,
            },
            tweak,
        )
        .await?;
        Ok(Fleet {
            hub,
            managed,
            path,
            dir,
        })
    }

    /// Grants hub alice (as `cluster:hub:alice` on cluster-a) port-forwarding
    /// to the pods of `default`, and runs pod `echo-0` with an echo server on
    /// container port 7000.
    pub async fn echo_pod(&self) -> anyhow::Result<simulated_cluster::targets::EchoServer> {
        let managed = self.managed.client().await?;
        create(
            &managed,
            cluster_role(
                "port-forwarder",
                json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                       {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["get", "create"]}]),
            ),
        )
        .await?;
        create(
            &managed,
            cluster_binding(
                "hub-alice-forwards",
                "port-forwarder",
                "User",
                "cluster:hub:alice",
            ),
        )
        .await?;
        let echo = simulated_cluster::targets::EchoServer::start().await?;
        self.managed
            .kubelet()
            .run(&memory_apiserver::pods::RunningPod {
                namespace: "default".into(),
                name: "echo-0".into(),
                ports: vec![("echo".into(), 7000, echo.addr)],
                ready: true,
                pod_ip: Some(echo.addr.ip()),
                ..Default::default()
            })
            .map_err(|e| anyhow::anyhow!(e.message))?;
        Ok(echo)
    }

    /// A hub user with `groups` and a token of it.
    pub fn hub_user(&self, name: &str, groups: &[&str]) -> String {
        self.hub.kubeconfigs(None).token(name, groups)
    }
}

impl AccessPath {
    /// Starts the path for cluster-a in `dir`: the user-server asks the hub
    /// as `hub_identity`, the service-proxy sends to `managed`.
    pub async fn start(
        dir: &Path,
        hub_identity: Client,
        managed: ManagedApi,
    ) -> anyhow::Result<AccessPath> {
        AccessPath::start_with(dir, hub_identity, managed, |_| {}).await
    }

    /// [`AccessPath::start`], with the user-server's configuration changed
    /// by `tweak` first.
    pub async fn start_with(
        dir: &Path,
        hub_identity: Client,
        managed: ManagedApi,
        tweak: impl FnOnce(&mut user_server::UserServerConfig),
    ) -> anyhow::Result<AccessPath> {
        // The tunnel, and the certificates of service access.
        let replicas = LocalReplicas::start(&[CLUSTER_A, CLUSTER_B], 1).await?;
        let ca = replicas.pki.ca.cert_pem().to_owned();
        let files = dir.join("pki");
        std::fs::create_dir_all(&files)?;
        let ca_path = write(&files, "ca.crt", &ca)?;
        let cluster_a = ClusterName::new(CLUSTER_A)?;
        let hashed = cluster_a.service_proxy_host();
        let issue = |request: cert_authority::pki::LeafRequest| replicas.pki.ca.issue(&request);
        let serving = issue(cert_authority::pki::LeafRequest::server(
            "service-proxy",
            &[hashed.as_str()],
        ))?;
        let identity = issue(cert_authority::pki::LeafRequest::client(
            service_access::USER_SERVER_IDENTITY,
        ))?;
        let (hub_client_ca, hub_client_ca_pem) = hub_client_ca()?;
        let user_serving = issue(cert_authority::pki::LeafRequest::server(
            "cluster-proxy-addon-user",
            &["localhost", "127.0.0.1"],
        ))?;

        let service_proxy = service_proxy::start(service_proxy::ServiceProxyConfig {
            cluster: cluster_a.clone(),
            listen: "127.0.0.1:0".parse()?,
            cert: write(&files, "service-proxy.crt", &serving.cert_pem)?,
            key: write(&files, "service-proxy.key", &serving.key_pem)?,
            user_server_ca: ca_path.clone(),
            user_server_name: service_access::USER_SERVER_IDENTITY.into(),
            kube_api: managed.url.parse()?,
            kube_ca: write(&files, "managed-ca.crt", &managed.ca_pem)?,
            token_file: write(&files, "token", &managed.token)?,
            impersonation: true,
            // https Services of the tests carry certificates of the test CA.
            additional_service_ca: Some(ca_path.clone()),
            host_aliases: LOOPBACK_SERVICES
                .iter()
                .map(|name| (name.to_string(), std::net::IpAddr::from([127, 0, 0, 1])))
                .collect(),
            health: "127.0.0.1:0".parse()?,
            reload_interval: Duration::from_millis(200),
        })
        .await?;

        let server = &replicas.servers[0];
        let before = server.tunnel_count();
        let mut agent = proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Config(
            replicas.pki.agent_tls(CLUSTER_A)?,
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
        let agent = AgentUnderTest::start_with(agent).await?;
        anyhow::ensure!(
            simulated_cluster::wait::wait_until(Duration::from_secs(10), || server.tunnel_count()
                > before)
            .await,
            "cluster-a's agent did not connect"
        );

        let config = user_server::UserServerConfig {
            proxy_server: ("localhost".into(), server.client_addr.port()),
            proxy_ca_cert: ca_path.clone(),
            proxy_cert: write(
                &files,
                "proxy-client.crt",
                &replicas.pki.proxy_client.cert_pem,
            )?,
            proxy_key: write(
                &files,
                "proxy-client.key",
                &replicas.pki.proxy_client.key_pem,
            )?,
            listen: "127.0.0.1:0".parse()?,
            server_cert: write(&files, "user.crt", &user_serving.cert_pem)?,
            server_key: write(&files, "user.key", &user_serving.key_pem)?,
            client_ca: Some(write(&files, "hub-client-ca.crt", &hub_client_ca_pem)?),
            service_proxy_ca_cert: ca_path.clone(),
            service_proxy_port: service_proxy.addr.port(),
            identity_cert: write(&files, "identity.crt", &identity.cert_pem)?,
            identity_key: write(&files, "identity.key", &identity.key_pem)?,
            hub_kubeconfig: None,
            token_review_cache_ttl: Duration::from_secs(60),
            authorization_cache_ttl: Duration::from_millis(300),
            cache_size: 1000,
            max_idle_connections_per_cluster: 32,
            idle_connection_timeout: Duration::from_secs(30),
            dial_timeout: Duration::from_secs(5),
            response_header_timeout: Duration::from_secs(10),
            exposed_services: Some(user_server::settings::ExposedServicesSource {
                namespace: Some(EXPOSED_SERVICES_NAMESPACE.into()),
                name: user_server::exposed::DEFAULT_CONFIGMAP.into(),
            }),
            managed_token_passthrough: false,
            oidc: None,
            health: "127.0.0.1:0".parse()?,
            reload_interval: Duration::from_millis(200),
        };
        let mut config = config;
        tweak(&mut config);
        let user_server = user_server::start(config, hub_identity).await?;
        let proxy_client = (
            replicas.pki.proxy_client.cert_pem.clone(),
            replicas.pki.proxy_client.key_pem.clone(),
        );
        let path = AccessPath {
            replicas,
            _agent: agent,
            service_proxy,
            user_server,
            ca: ca_path,
            pki_ca_pem: ca,
            proxy_client,
            identity: (identity.cert_pem.clone(), identity.key_pem.clone()),
            hub_client_ca,
            dir: dir.to_path_buf(),
        };
        let health = path.user_server.health_addr;
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
        Ok(path)
    }

    /// A connection to `127.0.0.1:port` on cluster-a through the L4
    /// tunnel alone (proxy-server → agent), as a konnectivity client
    /// dials: the baseline of what service access adds.
    pub async fn dial_l4(
        &self,
        port: u16,
    ) -> anyhow::Result<cluster_proxy_proto::client::TunnelStream> {
        let server = &self.replicas.servers[0];
        let client = tunnel_harness::in_process::tunnel_client(
            self.replicas.pki.client_tls()?,
            server.client_addr,
        )
        .await?;
        let host = ClusterName::new(CLUSTER_A)?.service_proxy_host();
        Ok(client.dial(&format!("{host}:{port}")).await?)
    }

    /// TLS serving configuration for an https Service of cluster-a at
    /// `host`, its certificate from the test CA (the service-proxy's
    /// additional Service CA).
    pub fn service_tls(&self, host: &str) -> anyhow::Result<Arc<rustls::ServerConfig>> {
        let leaf = self
            .replicas
            .pki
            .ca
            .issue(&cert_authority::pki::LeafRequest::server(host, &[host]))?;
        let identity = cluster_proxy_runtime::tls::Identity::new(
            &cluster_proxy_runtime::tls::Pem::text("service certificate", &leaf.cert_pem),
            &cluster_proxy_runtime::tls::Pem::text("service key", &leaf.key_pem),
        )?;
        Ok(cluster_proxy_runtime::tls::server_config(
            identity,
            None,
            &[b"http/1.1"],
        )?)
    }

    pub fn base(&self, cluster: &str) -> String {
        format!(
            "https://127.0.0.1:{}/{cluster}",
            self.user_server.addr.port()
        )
    }

    /// A client certificate (PEM certificate and key) of the hub's client
    /// CA for `user` in `group` (rcgen writes one O).
    pub fn client_certificate(&self, user: &str, group: &str) -> anyhow::Result<(String, String)> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, user);
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, group);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.hub_client_ca)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A kube-rs client of `cluster` through the user-server, as `token`.
    pub async fn client(&self, cluster: &str, token: &str) -> anyhow::Result<Client> {
        let mut config = kube::Config::new(self.base(cluster).parse()?);
        config.root_cert = Some(vec![
            rustls_pki_types::CertificateDer::from_pem_slice(self.pki_ca_pem.as_bytes())?.to_vec(),
        ]);
        config.auth_info.token = Some(token.to_owned().into());
        Ok(Client::try_from(config)?)
    }

    /// One request to the user-server: status and body.
    pub async fn request(
        &self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<(http::StatusCode, Value)> {
        let request = headers
            .iter()
            .fold(
                http::Request::get(format!(
                    "https://127.0.0.1:{}{path}",
                    self.user_server.addr.port()
                )),
                |request, (name, value)| request.header(*name, *value),
            )
            .body(Empty::<Bytes>::new())?;
        https_request(&self.pki_ca_pem, None, request).await
    }

    /// One request of `method` to `path` of `cluster` through the
    /// user-server as `token`, with `headers` and a JSON `body` (none when
    /// `null`): status and body.
    pub async fn request_as(
        &self,
        cluster: &str,
        token: &str,
        method: http::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Value,
    ) -> anyhow::Result<(http::StatusCode, Value)> {
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base(cluster)))
            .header("authorization", format!("Bearer {token}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let bytes = match body {
            Value::Null => Bytes::new(),
            body => {
                request = request.header("content-type", "application/json");
                Bytes::from(serde_json::to_vec(&body)?)
            }
        };
        let request = request.body(http_body_util::Full::new(bytes))?;
        https_request(&self.pki_ca_pem, None, request).await
    }

    /// kubectl against `cluster` through the user-server, as `token`.
    pub async fn kubectl(
        &self,
        cluster: &str,
        token: &str,
        args: &[&str],
    ) -> anyhow::Result<std::process::Output> {
        let mut command = self.kubectl_command(cluster, token, args);
        tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .context("kubectl did not finish within 60 s")?
            .context("running kubectl")
    }

    /// `kubectl port-forward` through the user-server, once it says where
    /// it listens: the child and its local port. `websockets` chooses
    /// kubectl's transport (SPDY tunneled in WebSocket, or plain SPDY).
    pub async fn kubectl_port_forward(
        &self,
        cluster: &str,
        token: &str,
        args: &[&str],
        websockets: bool,
    ) -> anyhow::Result<(tokio::process::Child, u16)> {
        use tokio::io::AsyncBufReadExt;
        let mut command = self.kubectl_command(cluster, token, args);
        command
            .env("KUBECTL_PORT_FORWARD_WEBSOCKETS", websockets.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit());
        let mut child = command.spawn().context("running kubectl port-forward")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let port = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await? {
                // "Forwarding from 127.0.0.1:40123 -> 7000"
                if let Some(port) = line
                    .strip_prefix("Forwarding from 127.0.0.1:")
                    .and_then(|rest| rest.split_whitespace().next())
                {
                    return Ok(port.parse::<u16>()?);
                }
            }
            anyhow::bail!("kubectl port-forward ended without forwarding")
        })
        .await
        .context("kubectl port-forward did not listen within 60 s")??;
        // Keep reading, or kubectl blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok((child, port))
    }

    /// The kubectl command line of [`AccessPath::kubectl`], to run with
    /// stdin or to stream from.
    pub fn kubectl_command(
        &self,
        cluster: &str,
        token: &str,
        args: &[&str],
    ) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("kubectl");
        command
            .env("KUBECONFIG", self.dir.join("no-kubeconfig"))
            .arg(format!("--server={}", self.base(cluster)))
            .arg(format!("--token={token}"))
            .arg(format!("--certificate-authority={}", self.ca.display()))
            .arg(format!(
                "--cache-dir={}",
                self.dir.join("kubectl-cache").display()
            ))
            .args(args)
            .kill_on_drop(true);
        command
    }
}

/// One HTTPS request verified against `ca_pem`, with a client certificate
/// when given; the status and the JSON body (`null` when not JSON).
pub async fn https_request<B>(
    ca_pem: &str,
    client_cert: Option<(&str, &str)>,
    request: http::Request<B>,
) -> anyhow::Result<(http::StatusCode, Value)>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use cluster_proxy_runtime::tls::{self, Identity, Pem};
    let roots = tls::roots(&Pem::text("ca", ca_pem))?;
    let identity = client_cert
        .map(|(cert, key)| Identity::new(&Pem::text("cert", cert), &Pem::text("key", key)))
        .transpose()?;
    let config = tls::client_config(roots, identity, &[b"http/1.1"])?;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    let client = cluster_proxy_runtime::http_proxy::pooled_client(
        &config,
        http,
        cluster_proxy_runtime::http_proxy::Schemes::HttpsOnly,
        1,
        Duration::from_secs(30),
    );
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .context("no answer within 20 s")?
        .context("the request was not answered")?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

/// A TokenRequest token (valid `seconds`) of ServiceAccount
/// `namespace/name`, for tests against a real API server.
pub async fn service_account_token(
    client: &Client,
    namespace: &str,
    name: &str,
    seconds: i64,
) -> anyhow::Result<String> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    let request = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(seconds),
            ..Default::default()
        },
        ..Default::default()
    };
    Ok(Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("TokenRequest for {namespace}/{name}"))?
        .status
        .context("a TokenRequest answers a token")?
        .token)
}

/// The API server's URL and CA (PEM) named by `kubeconfig`'s first cluster.
pub fn server_and_ca(kubeconfig: &kube::config::Kubeconfig) -> anyhow::Result<(String, String)> {
    use base64::Engine as _;
    let cluster = kubeconfig
        .clusters
        .first()
        .and_then(|c| c.cluster.as_ref())
        .context("the kubeconfig names no cluster")?;
    let url = cluster
        .server
        .clone()
        .context("the cluster has no server")?;
    let ca = match (
        &cluster.certificate_authority_data,
        &cluster.certificate_authority,
    ) {
        (Some(data), _) => String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(data)
                .context("certificate-authority-data is not base64")?,
        )
        .context("the CA is not PEM text")?,
        (None, Some(file)) => {
            std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?
        }
        (None, None) => anyhow::bail!("the kubeconfig's cluster carries no CA"),
    };
    Ok((url.trim_end_matches('/').to_owned(), ca))
}

/// A Service of cluster-a for the `proxy-service` path: it answers every
/// request with a JSON description of it (method, path and query, and every
/// header), over TLS with `tls`; it serves until the runtime ends.
pub async fn reflecting_service(
    tls: Option<Arc<rustls::ServerConfig>>,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    serve_json(listener, tls, |method, path, headers| {
        let headers: serde_json::Map<String, Value> = headers
            .iter()
            .map(|(name, value)| {
                (
                    name.to_string(),
                    Value::from(value.to_str().unwrap_or_default()),
                )
            })
            .collect();
        Some(json!({"method": method.as_str(), "path": path, "headers": headers}))
    });
    Ok(addr)
}

/// Serves `listener` (over TLS with `tls`) until the runtime ends: each
/// request gets `answer(method, path and query, headers)` as JSON, or a 404
/// when it gives none.
fn serve_json<F>(
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    answer: F,
) where
    F: Fn(&http::Method, &str, &http::HeaderMap) -> Option<Value> + Clone + Send + Sync + 'static,
{
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, answer) = (acceptor.clone(), answer.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |request: http::Request<hyper::body::Incoming>| {
                        let path = request
                            .uri()
                            .path_and_query()
                            .map(|p| p.as_str())
                            .unwrap_or("/");
                        let answered = answer(request.method(), path, request.headers());
                        let (status, body) = match answered {
                            Some(value) => (http::StatusCode::OK, value.to_string()),
                            None => (http::StatusCode::NOT_FOUND, "{}".to_owned()),
                        };
                        std::future::ready(
                            http::Response::builder()
                                .status(status)
                                .header("content-type", "application/json")
                                .body(http_body_util::Full::new(Bytes::from(body))),
                        )
                    },
                );
                let http = hyper::server::conn::http1::Builder::new();
                let _ = match acceptor {
                    Some(acceptor) => match acceptor.accept(stream).await {
                        Ok(stream) => {
                            http.serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                                .await
                        }
                        Err(_) => return,
                    },
                    None => {
                        http.serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                            .await
                    }
                };
            });
        }
    });
}

/// An OIDC issuer for the tests: HTTPS on 127.0.0.1 with a self-signed
/// certificate for `localhost`, serving its discovery document and key set,
/// signing ID tokens with ES256 keys it can rotate.
pub struct OidcIssuer {
    /// The issuer URL (`https://localhost:<port>`), as tokens' `iss`.
    pub url: String,
    /// The PEM certificate to verify it with.
    pub ca_pem: String,
    keys: PublishedKeys,
}

/// An issuer's published keys, newest last: key id and key.
type PublishedKeys = Arc<std::sync::Mutex<Vec<(String, Arc<rcgen::KeyPair>)>>>;

impl OidcIssuer {
    pub async fn start() -> anyhow::Result<OidcIssuer> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("https://localhost:{}", listener.local_addr()?.port());
        let key = rcgen::KeyPair::generate()?;
        let cert =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()])?.self_signed(&key)?;
        let identity = cluster_proxy_runtime::tls::Identity::new(
            &cluster_proxy_runtime::tls::Pem::text("issuer certificate", &cert.pem()),
            &cluster_proxy_runtime::tls::Pem::text("issuer key", &key.serialize_pem()),
        )?;
        let tls = cluster_proxy_runtime::tls::server_config(identity, None, &[b"http/1.1"])?;
        let issuer = OidcIssuer {
            url: url.clone(),
            ca_pem: cert.pem(),
            keys: Arc::default(),
        };
        issuer.rotate()?;
        let keys = issuer.keys.clone();
        serve_json(listener, Some(tls), move |_, path, _| match path {
            "/.well-known/openid-configuration" => Some(json!({
                "issuer": url,
                "jwks_uri": format!("{url}/keys"),
                "id_token_signing_alg_values_supported": ["ES256"],
            })),
            "/keys" => {
                let keys = keys.lock().unwrap_or_else(|p| p.into_inner());
                let published: Vec<Value> = keys.iter().map(|(kid, key)| jwk(kid, key)).collect();
                Some(json!({"keys": published}))
            }
            _ => None,
        });
        Ok(issuer)
    }

    /// Publishes a new key, which signs tokens from now on; its key id.
    pub fn rotate(&self) -> anyhow::Result<String> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let kid = format!("key-{}", keys.len() + 1);
        keys.push((kid.clone(), Arc::new(rcgen::KeyPair::generate()?)));
        Ok(kid)
    }

    /// An ID token of `claims` (`iss` is added), signed by the newest key.
    pub fn token(&self, claims: Value) -> anyhow::Result<String> {
        let (kid, key) = self
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last()
            .cloned()
            .context("the issuer has no key")?;
        sign(&kid, &key, &self.url, claims)
    }

    /// An ID token naming the newest key's id but signed by another key: a
    /// forgery.
    pub fn forged_token(&self, claims: Value) -> anyhow::Result<String> {
        let kid = self
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last()
            .map(|(kid, _)| kid.clone())
            .context("the issuer has no key")?;
        sign(&kid, &rcgen::KeyPair::generate()?, &self.url, claims)
    }
}

fn sign(
    kid: &str,
    key: &rcgen::KeyPair,
    issuer: &str,
    mut claims: Value,
) -> anyhow::Result<String> {
    claims["iss"] = Value::from(issuer);
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
    header.kid = Some(kid.to_owned());
    let key = jsonwebtoken::EncodingKey::from_ec_der(&key.serialize_der());
    Ok(jsonwebtoken::encode(&header, &claims, &key)?)
}

/// The public JWK of an ECDSA P-256 key.
fn jwk(kid: &str, key: &rcgen::KeyPair) -> Value {
    use base64::Engine as _;
    // The uncompressed point: 0x04, then x and y, 32 bytes each.
    let point = key.public_key_raw();
    let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    json!({
        "kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": kid,
        "x": encode(point.get(1..33).unwrap_or_default()),
        "y": encode(point.get(33..65).unwrap_or_default()),
    })
}
