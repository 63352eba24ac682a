//! A tunnel on loopback for the prober and connector tests: in-process
//! proxy-servers, agents, an HTTPS stand-in kube-apiserver and the
//! in-memory Kubernetes API.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use cert_authority::pki::{Authority, LeafRequest};
use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::find_condition;
use health_prober::verdict::CONDITION_TYPE;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::PostParams;
use memory_apiserver::{KubeApi, KubeApiOptions};
use simulated_cluster::targets::TcpTarget;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{AgentUnderTest, LocalReplicas};

pub const WAIT: Duration = Duration::from_secs(10);

/// An HTTPS server answering every request with the status in `status`.
pub struct Apiserver {
    pub port: u16,
    pub status: Arc<AtomicU16>,
    _target: TcpTarget,
}

impl Apiserver {
    pub async fn start(names: &[&str]) -> Apiserver {
        let ca = Authority::generate("test apiserver CA", Duration::from_secs(3600)).unwrap();
        let leaf = ca
            .issue(&LeafRequest::server("kube-apiserver", names))
            .unwrap();
        let acceptor =
            simulated_cluster::sample::tls_acceptor(&leaf.cert_pem, &leaf.key_pem, &[b"http/1.1"])
                .unwrap();
        let status = Arc::new(AtomicU16::new(200));
        let answer = status.clone();
        let target = TcpTarget::serve(move |socket| {
            let acceptor = acceptor.clone();
            let answer = answer.clone();
            async move {
                let Ok(mut tls) = acceptor.accept(socket).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let code = answer.load(Ordering::SeqCst);
                let response = format!(
                    "HTTP/1.1 {code} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                );
                let _ = tls.write_all(response.as_bytes()).await;
                let _ = tls.shutdown().await;
            }
        })
        .await
        .unwrap();
        Apiserver {
            port: target.addr.port(),
            status,
            _target: target,
        }
    }
}

/// The test's proxy-servers and agents ([`LocalReplicas`]); a setup
/// failure fails the test.
pub struct Tunnel(LocalReplicas);

impl std::ops::Deref for Tunnel {
    type Target = LocalReplicas;
    fn deref(&self) -> &LocalReplicas {
        &self.0
    }
}

impl Tunnel {
    pub async fn start(clusters: &[&str], replicas: usize) -> Tunnel {
        Tunnel(LocalReplicas::start(clusters, replicas).await.unwrap())
    }

    pub async fn agent(&self, cluster: &str, index: usize) -> AgentUnderTest {
        self.0.agent(cluster, index).await.unwrap()
    }

    pub async fn in_process_agent(&self, cluster: &str, index: usize) -> proxy_agent::RunningAgent {
        self.0.in_process_agent(cluster, index).await.unwrap()
    }
}

pub struct Hub {
    pub api: KubeApi,
    pub client: kube::Client,
    _dir: tempfile::TempDir,
}

impl Hub {
    pub async fn start(clusters: &[&str]) -> Hub {
        let dir = tempfile::tempdir().unwrap();
        let api = KubeApi::start(KubeApiOptions::new(dir.path()))
            .await
            .unwrap();
        api.register_crds_from_yaml(simulated_cluster::ocm::CRDS)
            .unwrap();
        let client = api.client().await.unwrap();
        for cluster in clusters {
            create_namespace(&client, cluster).await;
            let addon: ManagedClusterAddOn = serde_json::from_value(serde_json::json!({
                "apiVersion": "addon.open-cluster-management.io/v1alpha1",
                "kind": "ManagedClusterAddOn",
                "metadata": {"name": "cluster-proxy", "namespace": cluster},
                "spec": {},
            }))
            .unwrap();
            Api::<ManagedClusterAddOn>::namespaced(client.clone(), cluster)
                .create(&PostParams::default(), &addon)
                .await
                .unwrap();
        }
        Hub {
            api,
            client,
            _dir: dir,
        }
    }

    pub async fn namespace(&self, name: &str) {
        create_namespace(&self.client, name).await;
    }

    pub async fn addon(&self, cluster: &str) -> ManagedClusterAddOn {
        Api::<ManagedClusterAddOn>::namespaced(self.client.clone(), cluster)
            .get("cluster-proxy")
            .await
            .unwrap()
    }

    /// (status, reason, message) of the prober's condition.
    pub async fn reachability(&self, cluster: &str) -> Option<(String, String, String)> {
        let addon = self.addon(cluster).await;
        find_condition(addon.conditions(), CONDITION_TYPE)
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    }
}

async fn create_namespace(client: &kube::Client, name: &str) {
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
}

/// The text of `/metrics` on 127.0.0.1:`port`, or `None` while it does not answer.
pub async fn metrics(port: u16) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    Some(text)
}

/// The value of the unlabelled sample `name`, or of the sum of its labelled samples.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
