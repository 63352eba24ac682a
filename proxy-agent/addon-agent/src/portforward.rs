//! The port-forward proxy of the `PortForward` entrypoint (upstream F6):
//! the proxy-agent next to this container dials `127.0.0.1:8091`, and each
//! connection accepted there is relayed to port 8091 of a proxy-server pod
//! on the hub through the hub kube-apiserver's `pods/portforward`, so the
//! managed cluster needs no route to the hub but the one to its API.
//!
//! Which pod: one that is `Running` and not being deleted, preferring the
//! pod this agent forwards the fewest connections to (upstream takes any
//! `Running` one at random). The proxy-agent opens one connection at a
//! time until it holds one per server replica, so "fewest" puts its
//! successive connections on every replica in turn instead of leaving it
//! to chance how many attempts reach the last one.
//!
//! Not `Ready`: a proxy-server is ready once agents hold tunnels to it
//! (upstream's rule, and ours with a static server count) or once it holds
//! as many as its peers (with a counted one), so agents must reach
//! replicas that are not ready yet, which is why the Services agents dial
//! publish not-ready addresses. Requiring `Ready` here would leave a new
//! replica without agents, and so unready, for good. A terminating pod
//! (a `deletionTimestamp`: draining in a rolling update) is skipped.
//!
//! The pod list is read with `list` (what upstream's hub Role grants, no
//! `watch`): before a connection picks a pod when the last list is older
//! than [`PortForwardConfig::max_age`], and every
//! [`PortForwardConfig::refresh`] in the background. A list is also when
//! forwards to a pod that is gone, terminating or no longer `Running` are
//! closed, so the proxy-agent reconnects and lands on a live pod; a pod
//! whose process dies ends its forwards by itself. Polling rather than a
//! watch also follows the klusterlet's rotation of the hub kubeconfig for
//! free: every list reads it again ([`KubeconfigClient`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster_proxy_control::client::KubeconfigClient;
use cluster_proxy_egress::EgressSettings;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::user_agent::USER_AGENT;

/// Label of the proxy-server pods (upstream's selector).
pub const PROXY_SERVER_SELECTOR: &str =
    "proxy.open-cluster-management.io/component-name=proxy-server";
/// Where the proxy-agent dials with the `PortForward` entrypoint.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8091";
/// The proxy-servers' agent port inside their pods.
pub const SERVER_AGENT_PORT: u16 = 8091;
/// How long opening one forward may take before the connection is closed.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortForwardConfig {
    pub listen: SocketAddr,
    /// The hub namespace of the proxy-server pods.
    pub namespace: String,
    pub selector: String,
    /// The port forwarded to in the chosen pod.
    pub pod_port: u16,
    /// How often the pod list is read in the background.
    pub refresh: Duration,
    /// A list older than this is read again before a connection picks a pod.
    pub max_age: Duration,
}

impl PortForwardConfig {
    pub fn new(listen: SocketAddr, namespace: impl Into<String>) -> Self {
        PortForwardConfig {
            listen,
            namespace: namespace.into(),
            selector: PROXY_SERVER_SELECTOR.into(),
            pod_port: SERVER_AGENT_PORT,
            refresh: Duration::from_secs(30),
            max_age: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("hub kubeconfig: {0}")]
    Client(#[from] cluster_proxy_control::client::ClientError),
    #[error("listing proxy-server pods in {namespace}: {source}")]
    List {
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error("no Running proxy-server pod ({selector}) in namespace {namespace}")]
    NoRunningPod { namespace: String, selector: String },
    #[error("port-forward to pod {namespace}/{pod}: {source}")]
    Open {
        namespace: String,
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("port-forward to pod {namespace}/{pod}: no answer within {OPEN_TIMEOUT:?}")]
    OpenTimeout { namespace: String, pod: String },
    #[error("port-forward to pod {namespace}/{pod}: {message}")]
    Remote {
        namespace: String,
        pod: String,
        message: String,
    },
    #[error("port-forward to pod {namespace}/{pod}: no stream for port {port}")]
    NoStream {
        namespace: String,
        pod: String,
        port: u16,
    },
}

/// A pod connections may be forwarded to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    /// Tells a pod from a later one of the same name.
    pub uid: String,
}

/// Whether `pod` may take connections: `Running`, not being deleted
/// (ready or not: see the module's documentation).
pub fn candidate(pod: &Pod) -> Option<Candidate> {
    let name = pod.metadata.name.clone()?;
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let uid = pod.metadata.uid.clone().unwrap_or_else(|| name.clone());
    Some(Candidate { name, uid })
}

/// Forwards in flight to one pod; `closed` ends them all.
struct Slot {
    count: usize,
    closed: CancellationToken,
}

#[derive(Default)]
struct State {
    pods: Vec<Candidate>,
    listed_at: Option<Instant>,
    /// Why the last list failed, until one succeeds.
    error: Option<String>,
    slots: HashMap<String, Slot>,
}

/// The forwarder's view of the pods and of its forwards, shared by the
/// accept loop, the refresher and `/readyz`.
#[derive(Clone)]
pub struct Forwarder {
    config: Arc<PortForwardConfig>,
    state: Arc<Mutex<State>>,
    client: Arc<tokio::sync::Mutex<KubeconfigClient>>,
    metrics: Metrics,
}

/// A pod chosen for one connection; counted until dropped.
struct Picked {
    forwarder: Forwarder,
    pod: Candidate,
    closed: CancellationToken,
}

impl Drop for Picked {
    fn drop(&mut self) {
        let mut state = self.forwarder.lock();
        if let Some(slot) = state.slots.get_mut(&self.pod.uid) {
            slot.count = slot.count.saturating_sub(1);
            if slot.count == 0 {
                state.slots.remove(&self.pod.uid);
            }
        }
        drop(state);
        self.forwarder.metrics.forward_closed();
    }
}

impl Forwarder {
    pub fn new(
        config: PortForwardConfig,
        hub_kubeconfig: PathBuf,
        hub_egress: EgressSettings,
        metrics: Metrics,
    ) -> Self {
        Forwarder {
            config: Arc::new(config),
            state: Arc::default(),
            client: Arc::new(tokio::sync::Mutex::new(
                KubeconfigClient::new(hub_kubeconfig, USER_AGENT).with_egress(hub_egress),
            )),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Ok` while there is a pod to forward to, else why not.
    pub fn readiness(&self) -> Result<(), String> {
        let state = self.lock();
        if let Some(error) = &state.error {
            return Err(format!("port-forward proxy: {error}"));
        }
        match (state.listed_at, state.pods.is_empty()) {
            (None, _) => Err("port-forward proxy: proxy-server pods not listed yet".into()),
            (Some(_), true) => Err(format!(
                "port-forward proxy: no Running proxy-server pod ({}) in namespace {}",
                self.config.selector, self.config.namespace
            )),
            (Some(_), false) => Ok(()),
        }
    }

    /// Reads the pod list and closes the forwards to pods no longer in it.
    pub async fn refresh(&self) -> Result<(), ForwardError> {
        let listed = self.list().await;
        let mut state = self.lock();
        match listed {
            Ok(pods) => {
                let live: HashSet<&str> = pods.iter().map(|p| p.uid.as_str()).collect();
                for (uid, slot) in &mut state.slots {
                    if !live.contains(uid.as_str()) {
                        tracing::info!(
                            pod_uid = %uid,
                            forwards = slot.count,
                            "proxy-server pod gone, terminating or not running; closing its forwards"
                        );
                        // A fresh token: should the pod be listed again,
                        // new forwards to it are not closed at once.
                        std::mem::replace(&mut slot.closed, CancellationToken::new()).cancel();
                    }
                }
                self.metrics.set_port_forward_pods(pods.len());
                state.pods = pods;
                state.listed_at = Some(Instant::now());
                state.error = None;
                Ok(())
            }
            Err(error) => {
                state.error = Some(error.to_string());
                Err(error)
            }
        }
    }

    async fn list(&self) -> Result<Vec<Candidate>, ForwardError> {
        let client = self.client.lock().await.get().await?;
        let pods: Api<Pod> = Api::namespaced(client, &self.config.namespace);
        // resourceVersion=0: served from the apiserver's watch cache, as
        // every agent of every cluster polls it.
        let params = ListParams::default()
            .labels(&self.config.selector)
            .match_any();
        let list = pods
            .list(&params)
            .await
            .map_err(|source| ForwardError::List {
                namespace: self.config.namespace.clone(),
                source,
            })?;
        let mut candidates: Vec<Candidate> = list.items.iter().filter_map(candidate).collect();
        candidates.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(candidates)
    }

    /// The pod with the fewest forwards of this agent (ties broken at
    /// random, as upstream picks), counted from now on.
    fn pick(&self) -> Option<Picked> {
        let mut state = self.lock();
        let load = |state: &State, uid: &str| state.slots.get(uid).map_or(0, |s| s.count);
        let fewest = state.pods.iter().map(|p| load(&state, &p.uid)).min()?;
        let tied: Vec<&Candidate> = state
            .pods
            .iter()
            .filter(|p| load(&state, &p.uid) == fewest)
            .collect();
        let pod = tied.get(rand::random_range(0..tied.len()))?;
        let pod = (*pod).clone();
        let slot = state.slots.entry(pod.uid.clone()).or_insert_with(|| Slot {
            count: 0,
            closed: CancellationToken::new(),
        });
        slot.count += 1;
        let closed = slot.closed.clone();
        drop(state);
        self.metrics.forward_started();
        Some(Picked {
            forwarder: self.clone(),
            pod,
            closed,
        })
    }

    fn stale(&self) -> bool {
        self.lock()
            .listed_at
            .is_none_or(|at| at.elapsed() >= self.config.max_age)
    }

    /// Relays `local` to a proxy-server pod until either side ends, the pod
    /// goes or `shutdown`.
    async fn forward(&self, mut local: TcpStream, shutdown: CancellationToken) {
        let peer = local.peer_addr().ok();
        match self.open_and_relay(&mut local, shutdown).await {
            Ok(pod) => tracing::debug!(?peer, %pod, "forward ended"),
            Err(error) => {
                self.metrics.port_forward("failed");
                tracing::warn!(?peer, %error, "closing the connection: no forward");
            }
        }
    }

    async fn open_and_relay(
        &self,
        local: &mut TcpStream,
        shutdown: CancellationToken,
    ) -> Result<String, ForwardError> {
        if self.stale()
            && let Err(error) = self.refresh().await
        {
            // An older list may still name a live pod; use it.
            tracing::warn!(%error, "refreshing the proxy-server pods");
        }
        let picked = self.pick().ok_or_else(|| ForwardError::NoRunningPod {
            namespace: self.config.namespace.clone(),
            selector: self.config.selector.clone(),
        })?;
        let namespace = self.config.namespace.clone();
        let name = picked.pod.name.clone();
        let port = self.config.pod_port;
        let client = self.client.lock().await.get().await?;
        let pods: Api<Pod> = Api::namespaced(client, &namespace);
        let mut forwarder = tokio::time::timeout(OPEN_TIMEOUT, pods.portforward(&name, &[port]))
            .await
            .map_err(|_| ForwardError::OpenTimeout {
                namespace: namespace.clone(),
                pod: name.clone(),
            })?
            .map_err(|source| ForwardError::Open {
                namespace: namespace.clone(),
                pod: name.clone(),
                source,
            })?;
        let (Some(remote), Some(remote_error)) =
            (forwarder.take_stream(port), forwarder.take_error(port))
        else {
            forwarder.abort();
            return Err(ForwardError::NoStream {
                namespace,
                pod: name,
                port,
            });
        };
        self.metrics.port_forward("opened");
        tracing::debug!(pod = %name, "forward opened");
        let (mut remote_read, mut remote_write) = tokio::io::split(remote);
        let (mut local_read, mut local_write) = local.split();
        // Either side ending ends both: the konnectivity stream has no
        // use for half a connection, and a half-open one would hold the
        // pod's slot.
        let mut reported = None;
        tokio::pin!(remote_error);
        tokio::select! {
            // First: the kubelet writes why the pod's port cannot be
            // reached before it ends the stream, and the reason matters
            // more than the end.
            biased;
            message = &mut remote_error => reported = message,
            result = tokio::io::copy(&mut local_read, &mut remote_write) => {
                tracing::debug!(pod = %name, ?result, "proxy-agent side ended");
            }
            result = tokio::io::copy(&mut remote_read, &mut local_write) => {
                tracing::debug!(pod = %name, ?result, "proxy-server side ended");
            }
            _ = picked.closed.cancelled() => {
                tracing::info!(pod = %name, "closing a forward to a pod that is gone or terminating");
            }
            _ = shutdown.cancelled() => {}
        }
        forwarder.abort();
        match reported {
            Some(message) => Err(ForwardError::Remote {
                namespace,
                pod: name,
                message,
            }),
            None => Ok(name),
        }
    }
}

/// Binds the proxy's listener.
pub async fn bind(config: &PortForwardConfig) -> std::io::Result<TcpListener> {
    TcpListener::bind(config.listen).await
}

/// Accepts connections on `listener` and forwards each, keeping the pod
/// list fresh, until `shutdown`.
pub async fn run(forwarder: Forwarder, listener: TcpListener, shutdown: CancellationToken) {
    let refresher = {
        let forwarder = forwarder.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            loop {
                if let Err(error) = forwarder.refresh().await {
                    tracing::warn!(%error, "refreshing the proxy-server pods");
                }
                tokio::select! {
                    _ = tokio::time::sleep(forwarder.config.refresh) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
        })
    };
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.cancelled() => break,
        };
        match accepted {
            Ok((local, _)) => {
                let _ = local.set_nodelay(true);
                let (forwarder, shutdown) = (forwarder.clone(), shutdown.clone());
                connections.spawn(async move { forwarder.forward(local, shutdown).await });
            }
            Err(error) => {
                // Out of descriptors and the like: wait rather than spin.
                tracing::warn!(%error, "accepting a port-forward connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
    let _ = refresher.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("a Pod")
    }

    #[test]
    fn running_pods_not_being_deleted_are_candidates_ready_or_not() {
        let ready = serde_json::json!({
            "metadata": {"name": "p", "uid": "u1"},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        });
        assert_eq!(
            candidate(&pod(ready.clone())),
            Some(Candidate {
                name: "p".into(),
                uid: "u1".into()
            })
        );
        let mut pending = ready.clone();
        pending["status"]["phase"] = "Pending".into();
        assert_eq!(candidate(&pod(pending)), None);
        let mut unready = ready.clone();
        unready["status"]["conditions"][0]["status"] = "False".into();
        assert!(candidate(&pod(unready)).is_some(), "agents make it ready");
        let mut failed = ready.clone();
        failed["status"]["phase"] = "Failed".into();
        assert_eq!(candidate(&pod(failed)), None);
        let mut deleting = ready.clone();
        deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        assert_eq!(candidate(&pod(deleting)), None);
        let mut no_status = ready;
        no_status["status"] = serde_json::Value::Null;
        assert_eq!(candidate(&pod(no_status)), None);
    }

    #[test]
    fn picks_spread_over_the_pods_and_follow_releases() {
        let forwarder = Forwarder::new(
            PortForwardConfig::new("127.0.0.1:0".parse().unwrap(), "ns"),
            "/nonexistent".into(),
            EgressSettings::default(),
            Metrics::new(),
        );
        assert!(forwarder.pick().is_none(), "no pods, no pick");
        forwarder.lock().pods = ["a", "b", "c"]
            .map(|n| Candidate {
                name: n.into(),
                uid: n.into(),
            })
            .to_vec();
        let picks: Vec<Picked> = (0..3).map(|_| forwarder.pick().unwrap()).collect();
        let mut names: Vec<&str> = picks.iter().map(|p| p.pod.name.as_str()).collect();
        names.sort();
        assert_eq!(names, ["a", "b", "c"], "one connection per pod first");
        let freed = picks[1].pod.name.clone();
        drop(picks);
        let again = forwarder.pick().unwrap();
        let other = forwarder.pick().unwrap();
        assert_ne!(again.pod.name, other.pod.name);
        drop((again, other));
        assert!(forwarder.lock().slots.is_empty(), "{freed}: released");
    }
}
