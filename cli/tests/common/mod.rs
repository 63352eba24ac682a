//! What the CLI tests run against: in-process proxy-servers and agents on
//! loopback, the in-memory hub API, and the `cluster-proxy` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use cert_authority::files::{Layout, Pair, write_pair};
use cert_authority::pki::LeafRequest;
use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use memory_apiserver::{KubeApi, KubeApiOptions};
use tunnel_harness::in_process::{AgentUnderTest, LocalReplicas};

pub const WAIT: Duration = Duration::from_secs(10);
pub const BIN: &str = env!("CARGO_BIN_EXE_cluster-proxy");

/// The test's proxy-servers and agents ([`LocalReplicas`]), their PKI
/// written to disk for the binary; a setup failure fails the test.
pub struct Tunnel {
    replicas: LocalReplicas,
    pub layout: Layout,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Tunnel {
    type Target = LocalReplicas;
    fn deref(&self) -> &LocalReplicas {
        &self.replicas
    }
}

impl Tunnel {
    pub async fn start(clusters: &[&str], replicas: usize) -> Tunnel {
        let replicas = LocalReplicas::start(clusters, replicas).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let layout = replicas.pki.write(dir.path()).unwrap();
        Tunnel {
            replicas,
            layout,
            _dir: dir,
        }
    }

    pub async fn agent(&self, cluster: &str, index: usize) -> AgentUnderTest {
        self.replicas.agent(cluster, index).await.unwrap()
    }

    /// `--proxy-ca-cert … --proxy-cert … --proxy-key …` for the hub client certificate.
    pub fn credential_flags(&self) -> Vec<String> {
        credential_flags(&self.layout.bundle(), &self.layout.proxy_client())
    }

    /// The same flags with a client certificate that expired a day ago.
    pub fn expired_credential_flags(&self) -> Vec<String> {
        let day = Duration::from_secs(24 * 3600);
        let issued = time::OffsetDateTime::now_utc() - 2 * day;
        let expired = self
            .pki
            .ca
            .issue_at(
                &LeafRequest::client("proxy-client").with_validity(Duration::from_secs(3600)),
                issued,
            )
            .unwrap();
        let pair = Pair {
            cert: self.layout.dir.join("expired.crt"),
            key: self.layout.dir.join("expired.key"),
        };
        write_pair(&pair, &expired).unwrap();
        credential_flags(&self.layout.bundle(), &pair)
    }
}

fn credential_flags(ca: &Path, pair: &Pair) -> Vec<String> {
    vec![
        "--proxy-ca-cert".into(),
        ca.display().to_string(),
        "--proxy-cert".into(),
        pair.cert.display().to_string(),
        "--proxy-key".into(),
        pair.key.display().to_string(),
    ]
}

const MPC_CRD: &str =
    include_str!("../../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml");

/// The in-memory hub API with OCM's and our CRDs.
pub struct Hub {
    pub api: KubeApi,
    pub client: kube::Client,
    _dir: tempfile::TempDir,
}

impl Hub {
    pub async fn start() -> Hub {
        let dir = tempfile::tempdir().unwrap();
        let api = KubeApi::start(KubeApiOptions::new(dir.path()))
            .await
            .unwrap();
        api.register_crds_from_yaml(simulated_cluster::ocm::CRDS)
            .unwrap();
        api.register_crds_from_yaml(MPC_CRD).unwrap();
        let client = api.client().await.unwrap();
        Hub {
            api,
            client,
            _dir: dir,
        }
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.api.kubeconfig_path().to_owned()
    }

    pub async fn namespace(&self, name: &str) {
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
    }

    /// A ManagedCluster and its namespace.
    pub async fn cluster(&self, name: &str) {
        self.namespace(name).await;
        let cluster: ManagedCluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {"name": name},
            "spec": {"hubAcceptsClient": true},
        }))
        .unwrap();
        Api::<ManagedCluster>::all(self.client.clone())
            .create(&PostParams::default(), &cluster)
            .await
            .unwrap();
    }

    /// The `cluster-proxy` addon of `cluster` with these status conditions.
    pub async fn addon(&self, cluster: &str, conditions: serde_json::Value) {
        let addon: ManagedClusterAddOn = serde_json::from_value(serde_json::json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": "cluster-proxy", "namespace": cluster},
            "spec": {},
        }))
        .unwrap();
        let api = Api::<ManagedClusterAddOn>::namespaced(self.client.clone(), cluster);
        api.create(&PostParams::default(), &addon).await.unwrap();
        let status = serde_json::json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": "cluster-proxy", "namespace": cluster},
            "status": {"conditions": conditions},
        });
        api.patch_status(
            "cluster-proxy",
            &PatchParams::apply("test").force(),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
    }

    /// The ManagedProxyConfiguration `cluster-proxy` and its `proxy-client`
    /// Secret in `namespace`, holding the tunnel's hub client credentials.
    pub async fn proxy_client_secret(&self, tunnel: &Tunnel, namespace: &str) {
        self.namespace(namespace).await;
        let mpc = serde_json::json!({
            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": "cluster-proxy"},
            "spec": {
                "authentication": {"signer": {"type": "SelfSigned"}},
                "proxyServer": {"image": "proxy-server", "namespace": namespace},
                "proxyAgent": {"image": "proxy-agent"},
            },
        });
        let api = Api::<cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration>::all(
            self.client.clone(),
        );
        api.patch(
            "cluster-proxy",
            &PatchParams::apply("test").force(),
            &Patch::Apply(&mpc),
        )
        .await
        .unwrap();
        let data = [
            ("tls.crt", tunnel.pki.proxy_client.cert_pem.as_str()),
            ("tls.key", tunnel.pki.proxy_client.key_pem.as_str()),
            ("ca.crt", tunnel.pki.ca.cert_pem()),
        ]
        .into_iter()
        .map(|(key, pem)| (key.to_owned(), ByteString(pem.as_bytes().to_vec())))
        .collect();
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some("proxy-client".into()),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            type_: Some("kubernetes.io/tls".into()),
            data: Some(data),
            ..Default::default()
        };
        Api::<Secret>::namespaced(self.client.clone(), namespace)
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }
}

/// Runs the binary to completion (bounded: a hang fails the test).
pub async fn run(args: &[String]) -> Output {
    let mut command = tokio::process::Command::new(BIN);
    command
        .args(args)
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("cluster-proxy did not finish within 60 s")
        .unwrap()
}

/// The binary as a blocking command, for the long-running port-forward.
pub fn command(args: &[String]) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null());
    command
}

pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| (*a).to_owned()).collect()
}
