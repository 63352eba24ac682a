//! The addon-agent's port-forward proxy (the `PortForward` entrypoint)
//! against the in-memory Kubernetes API with RBAC on: two stand-in
//! proxy-server "pods" (TCP listeners that say who they are, then echo)
//! registered as the kubelet would, reached through `pods/portforward`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use addon_agent::portforward::PortForwardConfig;
use addon_agent::{AddonAgentConfig, ManagedApi, RunningAgent};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Api;
use kube::api::PostParams;
use memory_apiserver::pods::{KubeletPods, RunningPod};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(30);
const NAMESPACE: &str = "open-cluster-management-addon";
const AGENT_USER: &str =
    "system:open-cluster-management:cluster:cluster-x:addon:cluster-proxy:agent:addon-agent";
const AGENTS_GROUP: &str = "system:open-cluster-management:addon:cluster-proxy";

/// A "proxy-server": greets every connection with its name and a newline,
/// then echoes.
async fn echo_pod(name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind pod");
    let addr = listener.local_addr().expect("pod address");
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                if tcp.write_all(format!("{name}\n").as_bytes()).await.is_err() {
                    return;
                }
                let (mut read, mut write) = tcp.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    addr
}

struct Hub {
    api: KubeApi,
    kubelet: KubeletPods,
    agent_kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

/// The API with RBAC, the proxy-server namespace, and the port-forward
/// Role the addon-manager renders bound to the agents' group (`verbs`
/// on `pods/portforward`).
async fn hub(portforward_verbs: &[&str]) -> Hub {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut options = KubeApiOptions::new(dir.path());
    options.rbac = true;
    let api = KubeApi::start(options).await.expect("start the API");
    let admin = api.client().await.expect("admin client");
    let namespace: Namespace =
        serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).expect("namespace");
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create the namespace");
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "cluster-proxy-addon-agent:portforward"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
            {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": portforward_verbs},
        ],
    }))
    .expect("role");
    Api::<Role>::namespaced(admin.clone(), NAMESPACE)
        .create(&PostParams::default(), &role)
        .await
        .expect("create the Role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "cluster-proxy-addon-agent:portforward"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "cluster-proxy-addon-agent:portforward"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": AGENTS_GROUP}],
    }))
    .expect("binding");
    Api::<RoleBinding>::namespaced(admin, NAMESPACE)
        .create(&PostParams::default(), &binding)
        .await
        .expect("create the RoleBinding");
    let agent_kubeconfig = api
        .kubeconfig_for(AGENT_USER, &[AGENTS_GROUP])
        .expect("agent kubeconfig");
    Hub {
        kubelet: api.kubelet(),
        api,
        agent_kubeconfig,
        _dir: dir,
    }
}

fn run_pod(kubelet: &KubeletPods, name: &str, addr: SocketAddr) {
    kubelet
        .run(&RunningPod {
            namespace: NAMESPACE.into(),
            name: name.into(),
            labels: BTreeMap::from([(
                "proxy.open-cluster-management.io/component-name".to_owned(),
                "proxy-server".to_owned(),
            )]),
            ports: vec![("proxy-server".into(), 8091, addr)],
            ready: true,
            pod_ip: Some(addr.ip()),
            ..RunningPod::default()
        })
        .expect("run the pod");
}

async fn start_agent(hub_kubeconfig: &Path) -> RunningAgent {
    let mut port_forward = PortForwardConfig::new("127.0.0.1:0".parse().expect("addr"), NAMESPACE);
    port_forward.refresh = Duration::from_millis(200);
    port_forward.max_age = Duration::from_millis(100);
    addon_agent::start(AddonAgentConfig {
        hub_kubeconfig: Some(hub_kubeconfig.to_path_buf()),
        cluster_name: "cluster-x".into(),
        lease_name: "cluster-proxy".into(),
        lease_namespace: String::new(),
        managed: ManagedApi::None,
        holder_identity: "addon-agent-test".into(),
        proxy_agent_health_url: None,
        lease_duration: Duration::from_secs(30),
        health_addr: "127.0.0.1:0".parse().expect("addr"),
        port_forward: Some(port_forward),
        hub_egress: Default::default(),
    })
    .await
    .expect("start the agent")
}

/// A connection through the proxy: which pod greeted it.
struct Forwarded {
    pod: String,
    reader: BufReader<TcpStream>,
}

async fn connect(agent: &RunningAgent) -> Forwarded {
    let addr = agent.port_forward_addr().expect("the proxy listens");
    let tcp = TcpStream::connect(addr).await.expect("connect the proxy");
    let mut reader = BufReader::new(tcp);
    let mut pod = String::new();
    tokio::time::timeout(WAIT, reader.read_line(&mut pod))
        .await
        .expect("a greeting in time")
        .expect("read the greeting");
    assert!(pod.ends_with('\n'), "forwarded to no pod: {pod:?}");
    Forwarded {
        pod: pod.trim_end().to_owned(),
        reader,
    }
}

impl Forwarded {
    async fn echoes(&mut self, text: &str) {
        self.reader
            .get_mut()
            .write_all(text.as_bytes())
            .await
            .expect("send");
        let mut back = vec![0u8; text.len()];
        tokio::time::timeout(WAIT, self.reader.read_exact(&mut back))
            .await
            .expect("echo in time")
            .expect("echo");
        assert_eq!(back, text.as_bytes());
    }

    /// Waits until the proxy closes the connection.
    async fn closed(&mut self) {
        let mut rest = Vec::new();
        tokio::time::timeout(WAIT, self.reader.read_to_end(&mut rest))
            .await
            .unwrap_or_else(|_| panic!("the forward to {} stayed open", self.pod))
            .ok();
    }
}

/// The connection is closed before anything arrives.
async fn refused(agent: &RunningAgent) {
    let addr = agent.port_forward_addr().expect("the proxy listens");
    let mut tcp = TcpStream::connect(addr).await.expect("connect the proxy");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(WAIT, tcp.read_to_end(&mut buf))
        .await
        .expect("closed promptly");
    assert!(read.is_err() || buf.is_empty(), "got {buf:?}");
}

async fn readyz(agent: &RunningAgent) -> (u16, String) {
    let mut tcp = TcpStream::connect(agent.health_addr())
        .await
        .expect("connect health port");
    tcp.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("send");
    let mut response = String::new();
    tcp.read_to_string(&mut response).await.expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, response)
}

async fn wait_ready(agent: &RunningAgent, want: u16) -> String {
    wait_readyz(agent, want, "").await
}

/// Waits until `/readyz` answers `want` with a body containing `saying`.
async fn wait_readyz(agent: &RunningAgent, want: u16, saying: &str) -> String {
    tokio::time::timeout(WAIT, async {
        loop {
            let (status, body) = readyz(agent).await;
            if status == want && body.contains(saying) {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("/readyz never answered {want}"))
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

#[tokio::test]
async fn successive_connections_reach_every_pod_and_relay_bytes() {
    let hub = hub(&["get", "create"]).await;
    run_pod(&hub.kubelet, "cluster-proxy-0", echo_pod("pod-0").await);
    run_pod(&hub.kubelet, "cluster-proxy-1", echo_pod("pod-1").await);
    let agent = start_agent(&hub.agent_kubeconfig).await;
    wait_ready(&agent, 200).await;

    let mut first = connect(&agent).await;
    let mut second = connect(&agent).await;
    let mut pods = [first.pod.clone(), second.pod.clone()];
    pods.sort();
    assert_eq!(pods, ["pod-0", "pod-1"], "one connection per pod");
    first.echoes("hello through the hub API").await;
    second.echoes(&"x".repeat(256 * 1024)).await;
    assert_eq!(agent.metrics().port_forwards("opened"), 2);
    assert_eq!(agent.metrics().port_forwards_active(), 2);
    let text = agent.metrics().encode();
    assert!(text.contains("addon_agent_port_forward_pods 2"), "{text}");

    // The proxy-agent closing its side ends the forward.
    drop(first);
    wait_until("the closed forward is released", || {
        agent.metrics().port_forwards_active() == 1
    })
    .await;
    // ...and the freed pod is the one the next connection gets.
    let third = connect(&agent).await;
    assert_ne!(third.pod, second.pod);
    agent.shutdown().await;
    hub.api.shutdown().await;
}

#[tokio::test]
async fn a_pod_that_goes_is_no_longer_chosen_and_its_forwards_close() {
    let hub = hub(&["get", "create"]).await;
    run_pod(&hub.kubelet, "cluster-proxy-0", echo_pod("pod-0").await);
    run_pod(&hub.kubelet, "cluster-proxy-1", echo_pod("pod-1").await);
    let agent = start_agent(&hub.agent_kubeconfig).await;
    wait_ready(&agent, 200).await;
    let mut a = connect(&agent).await;
    let mut b = connect(&agent).await;
    assert_ne!(a.pod, b.pod);
    let pod_name = |greeting: &str| {
        if greeting == "pod-0" {
            "cluster-proxy-0"
        } else {
            "cluster-proxy-1"
        }
    };
    let (name_of_a, name_of_b) = (pod_name(&a.pod), pod_name(&b.pod));

    // No longer Running: its forward closes, new connections go elsewhere.
    hub.kubelet
        .set_phase(NAMESPACE, name_of_b, "Failed")
        .expect("mark failed");
    b.closed().await;
    a.echoes("still here").await;
    for _ in 0..3 {
        assert_eq!(connect(&agent).await.pod, a.pod);
    }

    // Deleted (its processes gone): every forward to it closes, and with
    // no pod left the proxy is not ready and closes connections.
    let mut also_a = connect(&agent).await;
    hub.kubelet
        .remove(NAMESPACE, name_of_a)
        .expect("remove the pod");
    a.closed().await;
    also_a.closed().await;
    wait_readyz(&agent, 503, "no Running proxy-server pod").await;
    let failed = agent.metrics().port_forwards("failed");
    refused(&agent).await;
    wait_until("the refused connection is counted", || {
        agent.metrics().port_forwards("failed") > failed
    })
    .await;

    // Running again: forwarded again.
    hub.kubelet
        .set_phase(NAMESPACE, name_of_b, "Running")
        .expect("mark running");
    wait_ready(&agent, 200).await;
    let mut again = connect(&agent).await;
    assert_eq!(again.pod, b.pod);
    again.echoes("back").await;
    agent.shutdown().await;
    hub.api.shutdown().await;
}

#[tokio::test]
async fn pods_that_are_not_ready_yet_are_forwarded_to() {
    // A proxy-server is ready once agents reach it: requiring `Ready`
    // would leave new replicas without agents for good.
    let hub = hub(&["get", "create"]).await;
    for (name, greeting) in [("cluster-proxy-0", "pod-0"), ("cluster-proxy-1", "pod-1")] {
        run_pod(&hub.kubelet, name, echo_pod(greeting).await);
        hub.kubelet
            .set_ready(NAMESPACE, name, false)
            .expect("not ready");
    }
    let agent = start_agent(&hub.agent_kubeconfig).await;
    wait_ready(&agent, 200).await;
    let mut first = connect(&agent).await;
    let second = connect(&agent).await;
    assert_ne!(first.pod, second.pod);
    first.echoes("unready but reachable").await;
    agent.shutdown().await;
    hub.api.shutdown().await;
}

#[tokio::test]
async fn without_a_running_pod_connections_close_and_readiness_says_why() {
    let hub = hub(&["get", "create"]).await;
    let agent = start_agent(&hub.agent_kubeconfig).await;
    let body = wait_readyz(&agent, 503, "no Running proxy-server pod").await;
    assert!(body.contains(NAMESPACE), "{body}");
    refused(&agent).await;
    wait_until("the refused connection is counted", || {
        agent.metrics().port_forwards("failed") == 1
    })
    .await;
    assert_eq!(agent.metrics().port_forwards("opened"), 0);
    agent.shutdown().await;
    hub.api.shutdown().await;
}

#[tokio::test]
async fn an_agent_the_hub_does_not_let_port_forward_gets_no_forward() {
    // Upstream's Role: `create` only, which a WebSocket GET is not enough
    // for (it is authorized as `get` too).
    let hub = hub(&["create"]).await;
    run_pod(&hub.kubelet, "cluster-proxy-0", echo_pod("pod-0").await);
    let agent = start_agent(&hub.agent_kubeconfig).await;
    wait_ready(&agent, 200).await;
    refused(&agent).await;
    wait_until("the refused forward is counted", || {
        agent.metrics().port_forwards("failed") == 1
    })
    .await;
    assert_eq!(agent.metrics().port_forwards("opened"), 0);
    assert_eq!(agent.metrics().port_forwards_active(), 0);
    agent.shutdown().await;
    hub.api.shutdown().await;
}

#[tokio::test]
async fn a_pod_whose_port_refuses_closes_the_connection_as_a_failure() {
    let hub = hub(&["get", "create"]).await;
    // Running, but nothing listens on its port 8091 (yet): only another
    // port is known to the kubelet. (Not a closed ephemeral port: another
    // test could be given it meanwhile.)
    let other = echo_pod("pod-0").await;
    hub.kubelet
        .run(&RunningPod {
            namespace: NAMESPACE.into(),
            name: "cluster-proxy-0".into(),
            labels: BTreeMap::from([(
                "proxy.open-cluster-management.io/component-name".to_owned(),
                "proxy-server".to_owned(),
            )]),
            ports: vec![("proxy-server".into(), 8090, other)],
            ready: false,
            pod_ip: Some(other.ip()),
            ..RunningPod::default()
        })
        .expect("run the pod");
    let agent = start_agent(&hub.agent_kubeconfig).await;
    wait_ready(&agent, 200).await;
    refused(&agent).await;
    wait_until("the refused port is counted as a failure", || {
        agent.metrics().port_forwards("failed") == 1
    })
    .await;
    // The API did upgrade: the failure came on the port's error channel.
    assert_eq!(agent.metrics().port_forwards("opened"), 1);
    wait_until("the forward is released", || {
        agent.metrics().port_forwards_active() == 0
    })
    .await;
    agent.shutdown().await;
    hub.api.shutdown().await;
}

/// A "proxy-server" that greets, then answers each whole line it gets with
/// that line: it says nothing until a line is complete, as a TLS server
/// waits for a client's whole flight.
async fn line_pod() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind pod");
    let addr = listener.local_addr().expect("pod address");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            tokio::spawn(async move {
                let mut lines = BufReader::new(tcp);
                if lines.get_mut().write_all(b"line-pod\n").await.is_err() {
                    return;
                }
                let mut line = String::new();
                while matches!(lines.read_line(&mut line).await, Ok(n) if n > 0) {
                    if lines.get_mut().write_all(line.as_bytes()).await.is_err() {
                        return;
                    }
                    line.clear();
                }
            });
        }
    });
    addr
}

/// Two small writes in a row (a TLS client's Finished, then its request)
/// cross the hub API without waiting for a delayed ACK: with Nagle's
/// algorithm on the addon-agent's connection to the hub API (kube-rs leaves
/// it on), the second waited about 40 ms for the API's delayed ACK on every
/// such exchange of an agent's tunnel. client-go turns it off, and so do we.
#[tokio::test]
async fn small_writes_in_a_row_are_not_held_back_by_delayed_acks() {
    let hub = hub(&["get", "create"]).await;
    run_pod(&hub.kubelet, "cluster-proxy-0", line_pod().await);
    let agent = start_agent(&hub.agent_kubeconfig).await;
    wait_ready(&agent, 200).await;
    let mut forwarded = connect(&agent).await;
    assert_eq!(forwarded.pod, "line-pod");
    // As the proxy-agent's own connection to its entrypoint.
    forwarded
        .reader
        .get_mut()
        .set_nodelay(true)
        .expect("nodelay");
    let mut took = Vec::new();
    // The first exchanges warm the connection up (TCP acknowledges quickly
    // at first, then delays); only the later ones are measured.
    for round in 0..40 {
        let started = std::time::Instant::now();
        let stream = forwarded.reader.get_mut();
        stream.write_all(b"half").await.expect("send");
        // Apart, so that the agent reads and forwards them as two writes
        // (as the tunnel delivers a TLS client's two records), not one.
        tokio::time::sleep(Duration::from_millis(2)).await;
        stream.write_all(b" and the rest\n").await.expect("send");
        let mut line = String::new();
        tokio::time::timeout(WAIT, forwarded.reader.read_line(&mut line))
            .await
            .expect("the line back in time")
            .expect("read the line");
        assert_eq!(line, "half and the rest\n");
        if round >= 20 {
            took.push(started.elapsed());
        }
    }
    took.sort();
    let median = took[took.len() / 2];
    assert!(
        median < Duration::from_millis(20),
        "the median exchange took {median:?}: {took:?}"
    );
    agent.shutdown().await;
    hub.api.shutdown().await;
}
