//! The addon-agent against the in-memory Kubernetes API, with a stand-in
//! for the proxy-agent's /readyz.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use addon_agent::{AddonAgentConfig, ManagedApi, RunningAgent};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use memory_apiserver::{KubeApi, KubeApiOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const WAIT: Duration = Duration::from_secs(30);
const CLUSTER: &str = "cluster-x";
const LEASE: &str = "cluster-proxy";
/// The hub identity OCM's registration gives the addon's agent.
const AGENT_USER: &str =
    "system:open-cluster-management:cluster:cluster-x:addon:cluster-proxy:agent:addon-agent";
const AGENT_GROUPS: &[&str] = &[
    "system:open-cluster-management:cluster:cluster-x:addon:cluster-proxy",
    "system:open-cluster-management:addon:cluster-proxy",
    "system:authenticated",
];

/// Answers every request with 200 while `ready`, else 503, and counts the
/// requests answered.
struct FakeReadyz {
    addr: SocketAddr,
    ready: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
}

impl FakeReadyz {
    async fn start(ready: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind readyz");
        let addr = listener.local_addr().expect("readyz address");
        let ready = Arc::new(AtomicBool::new(ready));
        let answered = Arc::new(AtomicU64::new(0));
        let (state, count) = (ready.clone(), answered.clone());
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let (state, count) = (state.clone(), count.clone());
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let status = if state.load(Ordering::SeqCst) {
                        "200 OK"
                    } else {
                        "503 Service Unavailable"
                    };
                    let response = format!(
                        "HTTP/1.1 {status}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    );
                    if tcp.write_all(response.as_bytes()).await.is_ok() {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
        FakeReadyz {
            addr,
            ready,
            answered,
        }
    }

    fn url(&self) -> http::Uri {
        format!("http://{}/readyz", self.addr)
            .parse()
            .expect("readyz URL")
    }

    fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    fn answered(&self) -> u64 {
        self.answered.load(Ordering::SeqCst)
    }
}

async fn start_api(dir: &Path, bind: Option<SocketAddr>) -> KubeApi {
    let mut options = KubeApiOptions::new(dir);
    if let Some(bind) = bind {
        options.bind = bind;
    }
    KubeApi::start(options).await.expect("start the API")
}

async fn create_namespace(client: &kube::Client, name: &str) {
    let mut namespace = Namespace::default();
    namespace.metadata.name = Some(name.into());
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create namespace");
}

fn config(hub_kubeconfig: &Path, readyz: Option<&FakeReadyz>) -> AddonAgentConfig {
    AddonAgentConfig {
        hub_kubeconfig: Some(hub_kubeconfig.to_path_buf()),
        cluster_name: CLUSTER.into(),
        lease_name: LEASE.into(),
        lease_namespace: "open-cluster-management-agent-addon".into(),
        managed: ManagedApi::None,
        holder_identity: "addon-agent-test".into(),
        proxy_agent_health_url: readyz.map(FakeReadyz::url),
        lease_duration: Duration::from_secs(1),
        health_addr: "127.0.0.1:0".parse().expect("address"),
        port_forward: None,
        hub_egress: Default::default(),
    }
}

/// The Lease's `renewTime`, if it exists.
async fn renew_time(client: &kube::Client, namespace: &str) -> Option<Timestamp> {
    Api::<Lease>::namespaced(client.clone(), namespace)
        .get_opt(LEASE)
        .await
        .expect("read the Lease")
        .and_then(|lease| lease.spec)
        .and_then(|spec| spec.renew_time)
        .map(|time| time.0)
}

/// Waits until the Lease's renewTime differs from `than` (or exists).
async fn renewed_after(
    client: &kube::Client,
    namespace: &str,
    than: Option<Timestamp>,
) -> Timestamp {
    tokio::time::timeout(WAIT, async {
        loop {
            if let Some(now) = renew_time(client, namespace).await
                && Some(now) != than
            {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("Lease {namespace}/{LEASE} was not renewed after {than:?}"))
}

async fn wait_until(what: &str, condition: impl Fn() -> bool) {
    tokio::time::timeout(WAIT, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting until {what}"));
}

async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut tcp = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect health port");
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    tcp.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    tcp.read_to_string(&mut response).await.expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, response)
}

#[tokio::test]
async fn renews_the_hub_lease_only_while_the_proxy_agent_is_ready() {
    let dir = tempfile::tempdir().expect("temp dir");
    let api = start_api(dir.path(), None).await;
    let admin = api.client().await.expect("admin client");
    create_namespace(&admin, CLUSTER).await;
    let hub = api
        .kubeconfig_for(AGENT_USER, AGENT_GROUPS)
        .expect("kubeconfig");
    let readyz = FakeReadyz::start(true).await;
    let agent: RunningAgent = addon_agent::start(config(&hub, Some(&readyz)))
        .await
        .expect("start");

    let first = renewed_after(&admin, CLUSTER, None).await;
    let lease = Api::<Lease>::namespaced(admin.clone(), CLUSTER)
        .get(LEASE)
        .await
        .expect("Lease");
    let spec = lease.spec.expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("addon-agent-test"));
    assert_eq!(spec.lease_duration_seconds, Some(1));
    let second = renewed_after(&admin, CLUSTER, Some(first)).await;
    assert!(second > first, "{second} after {first}");
    assert!(agent.metrics().renewals("hub") >= 2);
    assert!(agent.metrics().proxy_agent_ready());

    // Not ready: once the agent has seen it, nothing renews, however often
    // it asks.
    readyz.set_ready(false);
    wait_until("the agent saw the proxy-agent not ready", || {
        !agent.metrics().proxy_agent_ready()
    })
    .await;
    let frozen = renew_time(&admin, CLUSTER).await.expect("Lease exists");
    let renewals = agent.metrics().renewals("hub");
    let asked = readyz.answered();
    wait_until("the agent asked three more times", || {
        readyz.answered() >= asked + 3
    })
    .await;
    assert_eq!(renew_time(&admin, CLUSTER).await, Some(frozen));
    assert_eq!(agent.metrics().renewals("hub"), renewals);
    let (status, metrics) = get(agent.health_addr(), "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("addon_agent_proxy_agent_ready 0"),
        "{metrics}"
    );
    // The agent's own probes do not depend on the proxy-agent.
    assert_eq!(get(agent.health_addr(), "/readyz").await.0, 200);
    assert_eq!(get(agent.health_addr(), "/healthz").await.0, 200);

    readyz.set_ready(true);
    let again = renewed_after(&admin, CLUSTER, Some(frozen)).await;
    assert!(again > frozen);
    agent.shutdown().await;
}

#[tokio::test]
async fn an_api_that_is_down_at_start_is_used_once_it_is_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A port nothing listens on yet; the API starts on it later.
    let port =
        std::net::SocketAddr::from(([127, 0, 0, 1], simulated_cluster::targets::free_port()));
    let hub = dir.path().join("kubeconfig-agent");
    std::fs::write(
        &hub,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: hub\n  cluster:\n    server: https://{port}\n    insecure-skip-tls-verify: true\nusers:\n- name: agent\n  user:\n    token: not-yet\ncontexts:\n- name: agent\n  context:\n    cluster: hub\n    user: agent\ncurrent-context: agent\n"
        ),
    )
    .expect("write kubeconfig");
    let agent = addon_agent::start(config(&hub, None)).await.expect("start");
    wait_until("renewing failed twice", || {
        agent.metrics().renewals("error") >= 2
    })
    .await;
    // The health port answers while the API is down.
    assert_eq!(get(agent.health_addr(), "/readyz").await.0, 200);

    let api = start_api(dir.path(), Some(port)).await;
    let admin = api.client().await.expect("admin client");
    create_namespace(&admin, CLUSTER).await;
    // The klusterlet's rotation: the same path, new content.
    let written = api
        .kubeconfig_for("agent", AGENT_GROUPS)
        .expect("kubeconfig");
    assert_eq!(written, hub);
    renewed_after(&admin, CLUSTER, None).await;
    assert!(agent.metrics().renewals("hub") >= 1);
    agent.shutdown().await;
}

#[tokio::test]
async fn the_managed_lease_is_renewed_and_a_missing_namespace_falls_back_to_the_hub() {
    let dir = tempfile::tempdir().expect("temp dir");
    let api = start_api(dir.path(), None).await;
    let admin = api.client().await.expect("admin client");
    create_namespace(&admin, CLUSTER).await;
    let hub = api
        .kubeconfig_for(AGENT_USER, AGENT_GROUPS)
        .expect("kubeconfig");
    // The same API plays the managed cluster, under another identity.
    let managed = api
        .kubeconfig_for(
            "system:serviceaccount:agent-ns:cluster-proxy",
            &["system:serviceaccounts"],
        )
        .expect("kubeconfig");
    let mut config = config(&hub, None);
    config.managed = ManagedApi::Kubeconfig(managed);
    config.lease_namespace = "agent-ns".into();
    let agent = addon_agent::start(config).await.expect("start");

    renewed_after(&admin, CLUSTER, None).await;
    assert_eq!(agent.metrics().renewals("managed"), 0);
    assert_eq!(renew_time(&admin, "agent-ns").await, None);

    create_namespace(&admin, "agent-ns").await;
    renewed_after(&admin, "agent-ns", None).await;
    assert!(agent.metrics().renewals("managed") >= 1);
    // From then on the hub Lease is left alone.
    let hub_renewals = agent.metrics().renewals("hub");
    let managed_renewals = agent.metrics().renewals("managed");
    wait_until("two more managed renewals", || {
        agent.metrics().renewals("managed") >= managed_renewals + 2
    })
    .await;
    assert_eq!(agent.metrics().renewals("hub"), hub_renewals);
    agent.shutdown().await;
}

fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_addon-agent"));
    command
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("POD_NAMESPACE")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    command
}

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_binary_renews_with_a_registration_kubeconfig_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("temp dir");
    let api = start_api(dir.path(), None).await;
    let admin = api.client().await.expect("admin client");
    create_namespace(&admin, CLUSTER).await;
    let hub: PathBuf = api
        .kubeconfig_for(AGENT_USER, AGENT_GROUPS)
        .expect("kubeconfig");
    let readyz = FakeReadyz::start(true).await;
    let mut process = Process(
        binary()
            .arg(format!("--hub-kubeconfig={}", hub.display()))
            .arg(format!("--cluster-name={CLUSTER}"))
            .arg("--lease-duration=1s")
            .arg(format!("--proxy-agent-health-url={}", readyz.url()))
            .args([
                "--health-bind-address=127.0.0.1",
                "--health-port=0",
                "--v=2",
            ])
            .env("POD_NAME", "cluster-proxy-addon-agent-abc12")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn addon-agent"),
    );
    let first = renewed_after(&admin, CLUSTER, None).await;
    renewed_after(&admin, CLUSTER, Some(first)).await;
    let holder = Api::<Lease>::namespaced(admin.clone(), CLUSTER)
        .get(LEASE)
        .await
        .expect("Lease")
        .spec
        .and_then(|s| s.holder_identity);
    assert_eq!(holder.as_deref(), Some("cluster-proxy-addon-agent-abc12"));

    let status = Command::new("kill")
        .args(["-TERM", &process.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let exited = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(status) = process.0.try_wait().expect("wait") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("addon-agent exits promptly on SIGTERM");
    assert!(exited.success(), "{exited:?}");
}

#[test]
fn bad_flags_are_refused_with_a_message_that_names_them() {
    for (args, named) in [
        (vec!["--cluster-name=c"], "--hub-kubeconfig"),
        (vec!["--hub-kubeconfig=/k"], "--cluster-name"),
        (
            vec![
                "--hub-kubeconfig=/k",
                "--cluster-name=c",
                "--lease-duration=soon",
            ],
            "--lease-duration",
        ),
        (
            vec![
                "--hub-kubeconfig=/k",
                "--cluster-name=c",
                "--health-port=99999",
            ],
            "--health-port",
        ),
        (
            vec!["--hub-kubeconfig=/k", "--cluster-name=c", "--no-such-flag"],
            "--no-such-flag",
        ),
    ] {
        let output = binary().args(&args).output().expect("run addon-agent");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
