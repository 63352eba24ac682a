//! The kubelet's side of pods: which pods run, whether they are ready,
//! and where their ports really are.
//!
//! The environment runs a "pod" as local processes (its kubelet stand-in,
//! `env::kubelet`), whose ports are wherever the environment placed them
//! (replica *i*'s agent port is `9091 + 100·i` on the hub address, not
//! 8091 on a pod IP). On a real cluster the apiserver does not know where
//! a container's port is either: it proxies `pods/portforward` to the
//! kubelet of the pod's node, and the kubelet dials the port inside the
//! pod's network namespace. So the mapping lives here, in a registry
//! only the kubelet stand-in fills ([`KubeletPods`]), next to the Pod
//! objects it writes; [`super::portforward`] plays the kubelet's
//! streaming server with it. Putting the real address into the Pod object
//! instead (an annotation, or `podIP` plus the real port) would let a
//! client skip the API and dial it, and would need ports that differ
//! from the container's, which no real Pod has.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::error::ApiError;
use super::store::{DeleteOptions, Store, User, WriteOptions};

/// Where one pod's container ports are, as its kubelet knows.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub uid: String,
    /// Container port → where it really listens.
    pub ports: BTreeMap<u16, SocketAddr>,
    /// Container name → what the kubelet knows of its process.
    pub containers: BTreeMap<String, ContainerRuntime>,
    /// Cancelled when the pod goes: its forwards end, as a dead
    /// container's connections do.
    pub gone: CancellationToken,
    /// How the kubelet reaches the pod's ports (`None`: from this
    /// process's own network).
    pub dialer: Option<PodDialer>,
    /// Where the pod's own loopback is, if it has one the kubelet can
    /// dial: a port not in `ports` is dialled there.
    pub loopback: Option<IpAddr>,
}

impl Endpoint {
    /// Where port `port` of the pod really listens: a declared port, else
    /// the port on the pod's loopback (a kubelet forwards to any port of
    /// the pod's network, declared or not).
    pub fn target(&self, port: u16) -> Option<SocketAddr> {
        self.ports
            .get(&port)
            .copied()
            .or_else(|| self.loopback.map(|ip| SocketAddr::new(ip, port)))
    }

    /// Connects to `addr`, one of this pod's port addresses, as its
    /// kubelet would: from inside the pod's network when it has its own.
    pub async fn connect(&self, addr: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
        match &self.dialer {
            Some(dialer) => (dialer.0)(addr).await,
            None => tokio::net::TcpStream::connect(addr).await,
        }
    }
}

/// Connects to a pod's port from where the pod's network is (another
/// network namespace, say): what a kubelet on the pod's node can do and
/// this process, elsewhere, cannot.
#[derive(Clone)]
pub struct PodDialer(
    pub  Arc<
        dyn Fn(
                SocketAddr,
            )
                -> futures_util::future::BoxFuture<'static, std::io::Result<tokio::net::TcpStream>>
            + Send
            + Sync,
    >,
);

impl std::fmt::Debug for PodDialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PodDialer")
    }
}

/// The registry of running pods' ports: `(namespace, name)` → endpoint.
#[derive(Clone, Default)]
pub struct PodNetwork {
    pods: Arc<Mutex<HashMap<(String, String), Endpoint>>>,
}

impl PodNetwork {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Endpoint>> {
        self.pods.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The endpoint of pod `namespace/name`, if a kubelet runs it.
    pub fn lookup(&self, namespace: &str, name: &str) -> Option<Endpoint> {
        self.lock()
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    fn insert(&self, namespace: &str, name: &str, endpoint: Endpoint) {
        if let Some(old) = self
            .lock()
            .insert((namespace.to_string(), name.to_string()), endpoint)
        {
            old.gone.cancel();
        }
    }

    fn remove(&self, namespace: &str, name: &str) {
        if let Some(old) = self
            .lock()
            .remove(&(namespace.to_string(), name.to_string()))
        {
            old.gone.cancel();
        }
    }
}

/// What a kubelet knows of a container's process, beyond its ports:
/// where its output goes (`pods/log`) and how to run a command beside it
/// (`pods/exec`). A container without them has an empty log and refuses
/// exec.
#[derive(Debug, Clone, Default)]
pub struct ContainerRuntime {
    /// The file the container's process writes its stdout and stderr to.
    pub log: Option<PathBuf>,
    /// Where `pods/exec` runs commands; `None`: exec is refused.
    pub exec: Option<ExecContext>,
}

/// How `pods/exec` runs a command "in" a container that is a local
/// process: in its working directory, with its environment, in its
/// network namespace (so the command sees the pod's network, as `exec` in
/// a real pod does). There is no separate filesystem: paths are the
/// machine's.
#[derive(Debug, Clone, Default)]
pub struct ExecContext {
    pub dir: PathBuf,
    pub env: Vec<(String, String)>,
    /// Run through `ip netns exec <netns>`.
    pub netns: Option<String>,
}

/// A failed dial as the kubelet words it: it dials the port on the pod's
/// loopback, and Go says `dial tcp4 …: connect: connection refused`.
pub fn dial_error(port: u16, error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::ConnectionRefused => {
            format!("dial tcp4 127.0.0.1:{port}: connect: connection refused")
        }
        _ => format!("dial tcp4 127.0.0.1:{port}: {error}"),
    }
}

/// The built-in Pod type of `store`.
pub(crate) fn pod_type(store: &Store) -> Result<super::resources::ResourceType, ApiError> {
    store
        .resource_type("", "v1", "pods")
        .ok_or_else(|| ApiError::new(500, "InternalError", "no pods type"))
}

/// A pod the kubelet stand-in runs.
#[derive(Debug, Clone, Default)]
pub struct RunningPod {
    pub namespace: String,
    pub name: String,
    /// From the pod template (what selectors find it by).
    pub labels: BTreeMap<String, String>,
    /// `(container name, container port, where it really listens)`.
    pub ports: Vec<(String, u16, SocketAddr)>,
    pub ready: bool,
    pub pod_ip: Option<IpAddr>,
    /// Containers' logs and exec (containers named here and not in
    /// `ports` are containers without ports).
    pub containers: BTreeMap<String, ContainerRuntime>,
    /// How `pods/portforward` reaches `ports` (`None`: directly).
    pub dialer: Option<PodDialer>,
    /// The pod's own loopback, where undeclared ports are forwarded.
    pub loopback: Option<IpAddr>,
}

/// The node every stand-in pod runs on.
pub const NODE_NAME: &str = "cluster-proxy-e2e-node";

/// What a kubelet writes: Pod objects and their status, and the registry
/// of their ports. From [`super::KubeApi::kubelet`].
#[derive(Clone)]
pub struct KubeletPods {
    pub(super) store: Arc<Store>,
    pub(super) network: PodNetwork,
}

fn kubelet_user() -> User {
    User {
        name: format!("system:node:{NODE_NAME}"),
        uid: String::new(),
        groups: vec!["system:nodes".into()],
    }
}

fn status(ready: bool, pod_ip: Option<IpAddr>) -> Value {
    let flag = if ready { "True" } else { "False" };
    let now = super::store::now_rfc3339();
    let mut status = json!({
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
            {"type": "Ready", "status": flag, "lastTransitionTime": now},
        ],
        "startTime": now,
    });
    if let Some(ip) = pod_ip {
        status["podIP"] = json!(ip.to_string());
        status["podIPs"] = json!([{"ip": ip.to_string()}]);
        status["hostIP"] = json!(ip.to_string());
    }
    status
}

impl KubeletPods {
    fn pod_type(&self) -> Result<super::resources::ResourceType, ApiError> {
        pod_type(&self.store)
    }

    /// Writes `pod` as a `Running` Pod (replacing one of the same name: a
    /// new pod, with a new uid) and registers its ports. Returns the uid.
    pub fn run(&self, pod: &RunningPod) -> Result<String, ApiError> {
        let t = self.pod_type()?;
        let store = &self.store;
        let ns = Some(pod.namespace.as_str());
        self.network.remove(&pod.namespace, &pod.name);
        if store.get(&t, ns, &pod.name).is_ok() {
            store.delete(&t, ns, &pod.name, &DeleteOptions::default())?;
        }
        let mut containers: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
        for (container, port, _) in &pod.ports {
            containers
                .entry(container.as_str())
                .or_default()
                .push(json!({"containerPort": port, "protocol": "TCP"}));
        }
        for container in pod.containers.keys() {
            containers.entry(container.as_str()).or_default();
        }
        let containers: Vec<Value> = containers
            .into_iter()
            .map(
                |(name, ports)| json!({"name": name, "image": "cluster-proxy-e2e", "ports": ports}),
            )
            .collect();
        let body = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": pod.labels},
            "spec": {"nodeName": NODE_NAME, "containers": containers},
        });
        let options = WriteOptions {
            field_manager: Some("kubelet".into()),
            ..WriteOptions::default()
        };
        let created = store.create(&t, ns, body, &kubelet_user(), &options)?;
        let uid = created
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let pod_status = status(pod.ready, pod.pod_ip);
        store.mutate(&t, ns, &pod.name, "kubelet", |object| {
            object["status"] = pod_status;
        })?;
        self.network.insert(
            &pod.namespace,
            &pod.name,
            Endpoint {
                uid: uid.clone(),
                ports: pod.ports.iter().map(|(_, p, addr)| (*p, *addr)).collect(),
                containers: pod.containers.clone(),
                gone: CancellationToken::new(),
                dialer: pod.dialer.clone(),
                loopback: pod.loopback,
            },
        );
        Ok(uid)
    }

    /// Sets the pod's `Ready` (and `ContainersReady`) condition.
    pub fn set_ready(&self, namespace: &str, name: &str, ready: bool) -> Result<(), ApiError> {
        let t = self.pod_type()?;
        let flag = if ready { "True" } else { "False" };
        let now = super::store::now_rfc3339();
        self.store
            .mutate(&t, Some(namespace), name, "kubelet", |object| {
                if let Some(conditions) = object
                    .pointer_mut("/status/conditions")
                    .and_then(Value::as_array_mut)
                {
                    for condition in conditions {
                        let kind = condition.get("type").and_then(Value::as_str);
                        let changes = condition.get("status").and_then(Value::as_str) != Some(flag);
                        if matches!(kind, Some("Ready" | "ContainersReady")) && changes {
                            condition["status"] = json!(flag);
                            condition["lastTransitionTime"] = json!(now);
                        }
                    }
                }
            })
    }

    /// Sets the pod's `phase` (`Failed` once its processes exited for
    /// good, as the kubelet reports it).
    pub fn set_phase(&self, namespace: &str, name: &str, phase: &str) -> Result<(), ApiError> {
        let t = self.pod_type()?;
        self.store
            .mutate(&t, Some(namespace), name, "kubelet", |object| {
                object["status"]["phase"] = json!(phase);
            })
    }

    /// The pod's processes are gone: its forwards end and its Pod object
    /// is deleted (absent already is fine).
    pub fn remove(&self, namespace: &str, name: &str) -> Result<(), ApiError> {
        self.network.remove(namespace, name);
        self.delete(namespace, name)
    }

    /// The pod is being stopped: its Pod object goes, so no new forward
    /// reaches it, while forwards already open last until its processes
    /// exit ([`KubeletPods::remove`]), as a terminating pod's do.
    pub fn delete(&self, namespace: &str, name: &str) -> Result<(), ApiError> {
        let t = self.pod_type()?;
        match self
            .store
            .delete(&t, Some(namespace), name, &DeleteOptions::default())
        {
            Ok(_) => Ok(()),
            Err(error) if error.code == 404 => Ok(()),
            Err(error) => Err(error),
        }
    }
}
