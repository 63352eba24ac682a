//! The environment's stand-in for a kubelet and the Deployment controller:
//! it runs a rendered `Deployment` as local processes, one set per replica,
//! from the workspace's binaries.
//!
//! What a pod would get, the processes get:
//! * each container's `command[0]` names a binary by its file name
//!   (`/proxy-server` → `target/<profile>/proxy-server`);
//! * Secret volumes are directories under [`SecretVolumes`], one per
//!   Secret, one file per key, rewritten in place when the Secret changes
//!   (as the kubelet refreshes mounted Secrets); an argument that names a
//!   path under a `mountPath` is rewritten to the same file there;
//! * `env` values and the downward API's `metadata.name` /
//!   `metadata.namespace`, and `$(VAR)` references in args expanded from
//!   them, as Kubernetes does;
//! * a pod whose Secrets do not exist yet is not started (a real pod waits
//!   in `ContainerCreating`), and starts once they appear.
//!
//! * with a [`KubeletPods`] (the in-memory API's kubelet side), a `Pod`
//!   object per pod: the template's labels, `Running`, `podIP`, and a
//!   `Ready` condition that follows the containers' readiness probes (an
//!   HTTP GET of the probe's path on the port's real address, every sync);
//!   where each container port really listens, so `pods/portforward`
//!   reaches it; and each container's log file and where its commands
//!   run, so `pods/log` and `pods/exec` (and `kubectl cp`) reach them. The
//!   Pod goes when the pod's processes stop.
//!
//! What differs from a cluster, and why: pods are named `<deployment>-<i>`
//! with a stable index (the environment gives replica *i* its own ports, as a
//! pod would have its own IP), and a change of the pod template or of the
//! Secrets a pod needs replaces all pods at once (`Recreate`): the
//! environment has no Service endpoints to shift traffic gradually.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, PodSpec, Secret};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use memory_apiserver::pods::{ContainerRuntime, ExecContext, KubeletPods, RunningPod};

use crate::binaries::Binaries;
use crate::process::{Logs, ProcessError, ProcessSpec, ProcessState, Supervised};

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("Deployment {0} has no pod template spec")]
    NoPodSpec(String),
    #[error("container {container} of {deployment}: {detail}")]
    Container {
        deployment: String,
        container: String,
        detail: String,
    },
    #[error("writing Secret volume {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Process(#[from] ProcessError),
}

/// Where Secret volumes are kept: `<dir>/<secret name>/<key>`.
#[derive(Debug, Clone)]
pub struct SecretVolumes {
    dir: PathBuf,
}

impl SecretVolumes {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        SecretVolumes { dir: dir.into() }
    }

    pub fn path(&self, secret: &str) -> PathBuf {
        self.dir.join(secret)
    }

    pub fn exists(&self, secret: &str) -> bool {
        self.path(secret).is_dir()
    }

    /// Writes every key of `secret` (only those that changed, atomically);
    /// `true` when something changed. Keys that are gone are removed.
    pub fn write(&self, secret: &Secret) -> Result<bool, KubeletError> {
        let Some(name) = secret.metadata.name.as_deref() else {
            return Ok(false);
        };
        let mut data: BTreeMap<String, Vec<u8>> = secret
            .data
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.0.clone()))
            .collect();
        for (k, v) in secret.string_data.iter().flatten() {
            data.insert(k.clone(), v.clone().into_bytes());
        }
        self.write_data(name, &data)
    }

    /// Writes `data` as Secret `name`'s volume; `true` when it changed.
    pub fn write_data(
        &self,
        name: &str,
        data: &BTreeMap<String, Vec<u8>>,
    ) -> Result<bool, KubeletError> {
        let dir = self.path(name);
        let write_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| KubeletError::Write { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(write_err(&dir))?;
        let mut changed = false;
        for (key, value) in data {
            // Keys are file names: nothing that climbs out of the volume.
            if key.is_empty() || key.contains('/') || key == "." || key == ".." {
                continue;
            }
            let path = dir.join(key);
            if std::fs::read(&path).ok().as_deref() == Some(value.as_slice()) {
                continue;
            }
            let tmp = dir.join(format!(".{key}.tmp"));
            std::fs::write(&tmp, value).map_err(write_err(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(write_err(&path))?;
            changed = true;
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let file = entry.file_name().to_string_lossy().into_owned();
                if !file.starts_with('.') && !data.contains_key(&file) {
                    let _ = std::fs::remove_file(entry.path());
                    changed = true;
                }
            }
        }
        Ok(changed)
    }

    pub fn remove(&self, secret: &str) {
        let _ = std::fs::remove_dir_all(self.path(secret));
    }

    /// A fingerprint of the Secrets `names` as they are now (contents
    /// included), so that a pod can be replaced when they change.
    fn fingerprint(&self, names: &BTreeSet<String>) -> String {
        let mut hash = Sha256::new();
        for name in names {
            hash.update(name.as_bytes());
            let mut files: Vec<_> = std::fs::read_dir(self.path(name))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect();
            files.sort();
            for file in files {
                hash.update(file.to_string_lossy().as_bytes());
                hash.update(std::fs::read(&file).unwrap_or_default());
            }
        }
        hex::encode(&hash.finalize()[..8])
    }
}

/// One container as a process: the binary, its arguments and environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerPlan {
    pub container: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// What the environment adds to a pod's processes: its own addresses and
/// ports (flags appended last, so they win), and the network namespace.
pub trait PodPlacement: Send + Sync {
    /// Extra arguments for `container` of pod number `index` of `replicas`.
    fn extra_args(&self, index: usize, replicas: usize, container: &str) -> Vec<String>;
    /// The network namespace of the pod's processes.
    fn netns(&self) -> Option<String>;
    /// Where port `port` (named `name`) of `container` of pod `index`
    /// really listens; `None`: nowhere the environment placed it.
    fn port_address(
        &self,
        _index: usize,
        _container: &str,
        _name: Option<&str>,
        _port: u16,
    ) -> Option<SocketAddr> {
        None
    }
    /// How the kubelet reaches the pods' ports (`None`: directly).
    fn dialer(&self) -> Option<memory_apiserver::pods::PodDialer> {
        None
    }
    /// Where pod `index`'s own loopback is, if the kubelet may forward
    /// any port there (`None`: only the ports of [`Self::port_address`]).
    fn loopback(&self, _index: usize) -> Option<IpAddr> {
        None
    }
    /// The pod's `podIP`.
    fn pod_ip(&self, _index: usize) -> Option<IpAddr> {
        None
    }
}

/// How long one readiness probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// An HTTP GET of `path` on `addr`: whether it answers 2xx or 3xx, as the
/// kubelet's httpGet probe counts success.
async fn http_probe(addr: SocketAddr, path: &str) -> bool {
    let attempt = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        tcp.write_all(request.as_bytes()).await.ok()?;
        let mut head = [0u8; 12];
        tcp.read_exact(&mut head).await.ok()?;
        let status: u16 = std::str::from_utf8(&head[9..12]).ok()?.parse().ok()?;
        Some((200..400).contains(&status))
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, attempt).await,
        Ok(Some(true))
    )
}

/// The real address of every declared container port of pod `index`:
/// `(container, container port, address)`.
/// What `pods/log` and `pods/exec` reach of each container: its process's
/// log, and commands run beside it (in the pod's directory of logs, with
/// the container's environment, in its network namespace).
fn container_runtimes(processes: &[Supervised]) -> BTreeMap<String, ContainerRuntime> {
    processes
        .iter()
        .map(|process| {
            let log = process.log_path();
            let container = process
                .name()
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_string();
            let exec = log.parent().map(|dir| ExecContext {
                dir: dir.to_path_buf(),
                env: process.spec.env.clone(),
                netns: process.spec.netns.clone(),
            });
            (
                container,
                ContainerRuntime {
                    log: Some(log),
                    exec,
                },
            )
        })
        .collect()
}

fn pod_ports(
    spec: &PodSpec,
    index: usize,
    placement: &dyn PodPlacement,
) -> Vec<(String, u16, SocketAddr)> {
    let mut ports = Vec::new();
    for container in &spec.containers {
        for port in container.ports.iter().flatten() {
            let Ok(number) = u16::try_from(port.container_port) else {
                continue;
            };
            if let Some(addr) =
                placement.port_address(index, &container.name, port.name.as_deref(), number)
            {
                ports.push((container.name.clone(), number, addr));
            }
        }
    }
    ports
}

/// The readiness probes of pod `index` that can be run here: `(address,
/// path)` of each container's httpGet probe, its port resolved by name or
/// number through the placement.
fn readiness_probes(
    spec: &PodSpec,
    index: usize,
    placement: &dyn PodPlacement,
) -> Vec<(SocketAddr, String)> {
    let mut probes = Vec::new();
    for container in &spec.containers {
        let Some(get) = container
            .readiness_probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
        else {
            continue;
        };
        let declared = container.ports.iter().flatten();
        let (name, number) = match &get.port {
            IntOrString::Int(number) => (None, u16::try_from(*number).ok()),
            IntOrString::String(name) => (
                Some(name.as_str()),
                declared
                    .clone()
                    .find(|p| p.name.as_deref() == Some(name.as_str()))
                    .and_then(|p| u16::try_from(p.container_port).ok()),
            ),
        };
        let name = name.or_else(|| {
            declared
                .clone()
                .find(|p| Some(p.container_port) == number.map(i32::from))
                .and_then(|p| p.name.as_deref())
        });
        let addr = number.and_then(|n| placement.port_address(index, &container.name, name, n));
        let path = get.path.clone().unwrap_or_else(|| "/".into());
        match addr {
            Some(addr) => probes.push((addr, path)),
            // A probe that cannot be run fails, as an unreachable one does.
            None => probes.push((SocketAddr::from(([127, 0, 0, 1], 0)), path)),
        }
    }
    probes
}

fn expand(text: &str, env: &BTreeMap<String, String>) -> String {
    // `$(VAR)` → the value, `$$(VAR)` → `$(VAR)`; unknown names stay as
    // written, as Kubernetes leaves them.
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("$(") {
        if rest[..at].ends_with('$') {
            out.push_str(&rest[..at - 1]);
            out.push_str("$(");
            rest = &rest[at + 2..];
            continue;
        }
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        match after.find(')') {
            Some(end) => {
                let name = &after[..end];
                match env.get(name) {
                    Some(value) => out.push_str(value),
                    None => {
                        out.push_str("$(");
                        out.push_str(name);
                        out.push(')');
                    }
                }
                rest = &after[end + 1..];
            }
            None => {
                out.push_str(&rest[at..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The Secrets the pod spec mounts: volume name → Secret name.
fn secret_volumes(spec: &PodSpec) -> BTreeMap<String, String> {
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            let secret = v.secret.as_ref()?.secret_name.clone()?;
            Some((v.name.clone(), secret))
        })
        .collect()
}

/// Secrets the pod cannot start without (optional ones excluded).
pub fn required_secrets(deployment: &Deployment) -> BTreeSet<String> {
    let Some(spec) = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
    else {
        return BTreeSet::new();
    };
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            let secret = v.secret.as_ref()?;
            if secret.optional == Some(true) {
                return None;
            }
            secret.secret_name.clone()
        })
        .collect()
}

fn plan_container(
    deployment_name: &str,
    namespace: &str,
    pod_name: &str,
    container: &Container,
    mounts_of: &BTreeMap<String, String>,
    binaries: &Binaries,
    volumes: &SecretVolumes,
) -> Result<ContainerPlan, KubeletError> {
    let fail = |detail: String| KubeletError::Container {
        deployment: deployment_name.to_string(),
        container: container.name.clone(),
        detail,
    };
    let mut command: Vec<String> = container.command.clone().unwrap_or_default();
    command.extend(container.args.clone().unwrap_or_default());
    let Some(entry) = command.first() else {
        return Err(fail(
            "no command: the image's entrypoint is unknown here".into(),
        ));
    };
    let binary = Path::new(entry)
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| fail(format!("command {entry:?} names no binary")))?;
    let program = binaries.dir.join(binary);
    if !program.is_file() {
        return Err(fail(format!(
            "command {entry:?}: no binary {} in this workspace's build",
            program.display()
        )));
    }

    let mut env = BTreeMap::new();
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), _) => expand(value, &env),
            (None, Some(from)) => match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                Some("metadata.name") => pod_name.to_string(),
                Some("metadata.namespace") => namespace.to_string(),
                Some(other) => return Err(fail(format!("unsupported fieldRef {other}"))),
                None => {
                    return Err(fail(format!(
                        "env {}: only fieldRef is supported",
                        var.name
                    )));
                }
            },
            (None, None) => String::new(),
        };
        env.insert(var.name.clone(), value);
    }

    // Longest mount path first, so `/etc/a/b` wins over `/etc/a`.
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        if let Some(secret) = mounts_of.get(&mount.name) {
            mounts.push((
                mount.mount_path.trim_end_matches('/').to_string(),
                volumes.path(secret),
            ));
        }
    }
    mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    let rewrite = |arg: String| {
        for (mount, local) in &mounts {
            let prefix = format!("{mount}/");
            if let Some(at) = arg.find(&prefix) {
                return format!(
                    "{}{}/{}",
                    &arg[..at],
                    local.display(),
                    &arg[at + prefix.len()..]
                );
            }
        }
        arg
    };
    let args = command[1..]
        .iter()
        .map(|a| rewrite(expand(a, &env)))
        .collect();
    Ok(ContainerPlan {
        container: container.name.clone(),
        program,
        args,
        env: env.into_iter().collect(),
    })
}

/// Every container of `deployment` as it would run in pod `pod_name`.
pub fn plan(
    deployment: &Deployment,
    pod_name: &str,
    binaries: &Binaries,
    volumes: &SecretVolumes,
) -> Result<Vec<ContainerPlan>, KubeletError> {
    let name = deployment.metadata.name.clone().unwrap_or_default();
    let namespace = deployment.metadata.namespace.clone().unwrap_or_default();
    let spec = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .ok_or_else(|| KubeletError::NoPodSpec(name.clone()))?;
    let mounts_of = secret_volumes(spec);
    spec.containers
        .iter()
        .map(|c| {
            plan_container(
                &name, &namespace, pod_name, c, &mounts_of, binaries, volumes,
            )
        })
        .collect()
}

struct Pod {
    name: String,
    processes: Vec<Supervised>,
    /// The readiness last written to the Pod object (`None`: none written).
    reported: Option<bool>,
}

/// Runs one Deployment's pods and keeps them matching it.
pub struct DeploymentRunner {
    /// Prefix of process names (`<prefix>/<deployment>-<i>/<container>`).
    prefix: String,
    pods: Vec<Pod>,
    /// Template and Secrets the running pods were started from.
    revision: Option<String>,
    last_error: Option<String>,
    /// Where Pod objects are written, when the API has a kubelet side.
    kubelet: Option<KubeletPods>,
    namespace: String,
}

/// What a runner reports after a sync.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunnerStatus {
    pub desired: usize,
    pub running: usize,
    /// Why pods are not running (missing Secrets, a bad template).
    pub waiting: Option<String>,
}

impl DeploymentRunner {
    pub fn new(prefix: &str) -> Self {
        DeploymentRunner {
            prefix: prefix.to_string(),
            pods: Vec::new(),
            revision: None,
            last_error: None,
            kubelet: None,
            namespace: String::new(),
        }
    }

    /// Writes a Pod object per running pod (see the module's
    /// documentation).
    pub fn reporting_to(mut self, kubelet: Option<KubeletPods>) -> Self {
        self.kubelet = kubelet;
        self
    }

    /// Stops the pod: its Pod object goes first (no new forwards), its
    /// port registrations once its processes are gone.
    async fn stop_pod(&self, mut pod: Pod) {
        let kubelet = self.kubelet.as_ref().filter(|_| pod.reported.is_some());
        let log = |err: memory_apiserver::error::ApiError| {
            tracing::debug!("Pod {}/{}: {}", self.namespace, pod.name, err.message);
        };
        if let Some(Err(err)) = kubelet.map(|k| k.delete(&self.namespace, &pod.name)) {
            log(err);
        }
        for process in &mut pod.processes {
            process.stop(Duration::from_secs(15)).await;
        }
        if let Some(Err(err)) = kubelet.map(|k| k.remove(&self.namespace, &pod.name)) {
            log(err);
        }
    }

    /// Writes the Pod objects of the pods that have none and their
    /// readiness when it changed.
    async fn report(&mut self, deployment: &Deployment, placement: &dyn PodPlacement) {
        let Some(kubelet) = self.kubelet.clone() else {
            return;
        };
        let Some(spec) = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
        else {
            return;
        };
        let labels: BTreeMap<String, String> = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        let namespace = self.namespace.clone();
        for (index, pod) in self.pods.iter_mut().enumerate() {
            let running = pod
                .processes
                .iter_mut()
                .all(|p| matches!(p.state(), ProcessState::Running(_)));
            let mut ready = running;
            if running {
                for (addr, path) in readiness_probes(spec, index, placement) {
                    ready = ready && http_probe(addr, &path).await;
                }
            }
            let result = match pod.reported {
                None => kubelet
                    .run(&RunningPod {
                        namespace: namespace.clone(),
                        name: pod.name.clone(),
                        labels: labels.clone(),
                        ports: pod_ports(spec, index, placement),
                        ready,
                        pod_ip: placement.pod_ip(index),
                        containers: container_runtimes(&pod.processes),
                        dialer: placement.dialer(),
                        loopback: placement.loopback(index),
                    })
                    .map(|_| ()),
                Some(was) if was != ready => kubelet.set_ready(&namespace, &pod.name, ready),
                Some(_) => Ok(()),
            };
            match result {
                Ok(()) => pod.reported = Some(ready),
                Err(err) => tracing::debug!("Pod {namespace}/{}: {}", pod.name, err.message),
            }
        }
    }

    /// Makes the pods match `deployment` (none when `None`).
    pub async fn sync(
        &mut self,
        deployment: Option<&Deployment>,
        binaries: &Binaries,
        logs: &Logs,
        volumes: &SecretVolumes,
        placement: &dyn PodPlacement,
    ) -> RunnerStatus {
        let Some(deployment) = deployment.filter(|d| d.metadata.deletion_timestamp.is_none())
        else {
            self.stop_all().await;
            self.revision = None;
            return RunnerStatus::default();
        };
        let desired = deployment
            .spec
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(1)
            .max(0) as usize;
        let missing: Vec<String> = required_secrets(deployment)
            .into_iter()
            .filter(|s| !volumes.exists(s))
            .collect();
        if !missing.is_empty() {
            self.stop_all().await;
            self.revision = None;
            return RunnerStatus {
                desired,
                running: 0,
                waiting: Some(format!("waiting for Secret(s) {}", missing.join(", "))),
            };
        }
        let template = deployment
            .spec
            .as_ref()
            .map(|s| serde_json::to_string(&s.template).unwrap_or_default())
            .unwrap_or_default();
        let secrets = volumes.fingerprint(&required_secrets(deployment));
        // Placements may pass the replica count to the pods (the proxy-servers'
        // `--server-count`, the environment having no cluster DNS to count
        // them by), so a new count replaces the pods too.
        let revision = format!("{template}/{secrets}/{desired}");
        if self.revision.as_deref() != Some(revision.as_str()) {
            self.stop_all().await;
            self.revision = Some(revision);
        }
        while self.pods.len() > desired {
            if let Some(pod) = self.pods.pop() {
                self.stop_pod(pod).await;
            }
        }
        self.namespace = deployment.metadata.namespace.clone().unwrap_or_default();
        let name = deployment.metadata.name.clone().unwrap_or_default();
        let mut waiting = None;
        while self.pods.len() < desired {
            let index = self.pods.len();
            let pod_name = format!("{name}-{index}");
            match self.start_pod(
                deployment, &pod_name, index, binaries, logs, volumes, placement,
            ) {
                Ok(pod) => self.pods.push(pod),
                Err(err) => {
                    let text = err.to_string();
                    if self.last_error.as_deref() != Some(text.as_str()) {
                        tracing::warn!("{pod_name}: {text}");
                    }
                    self.last_error = Some(text.clone());
                    waiting = Some(text);
                    break;
                }
            }
        }
        self.report(deployment, placement).await;
        let mut running = 0;
        for pod in &mut self.pods {
            if pod
                .processes
                .iter_mut()
                .all(|p| matches!(p.state(), ProcessState::Running(_)))
            {
                running += 1;
            }
        }
        RunnerStatus {
            desired,
            running,
            waiting,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start_pod(
        &self,
        deployment: &Deployment,
        pod_name: &str,
        index: usize,
        binaries: &Binaries,
        logs: &Logs,
        volumes: &SecretVolumes,
        placement: &dyn PodPlacement,
    ) -> Result<Pod, KubeletError> {
        let plans = plan(deployment, pod_name, binaries, volumes)?;
        let replicas = deployment
            .spec
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(1)
            .max(0) as usize;
        let mut processes = Vec::new();
        for plan in plans {
            let mut spec = ProcessSpec::new(
                &format!("{}/{pod_name}/{}", self.prefix, plan.container),
                &plan.program,
            )
            .args(plan.args)
            .args(placement.extra_args(index, replicas, &plan.container))
            .in_netns(placement.netns());
            for (key, value) in plan.env {
                spec = spec.env(&key, value);
            }
            processes.push(Supervised::start(spec, logs)?);
        }
        Ok(Pod {
            name: pod_name.to_string(),
            processes,
            reported: None,
        })
    }

    /// Stops every pod (SIGTERM, then SIGKILL after the grace period).
    pub async fn stop_all(&mut self) {
        let pods: Vec<Pod> = self.pods.drain(..).collect();
        for pod in pods {
            self.stop_pod(pod).await;
        }
    }

    /// The processes of every pod (for logs and pid records).
    pub fn processes(&self) -> impl Iterator<Item = &Supervised> {
        self.pods.iter().flat_map(|p| p.processes.iter())
    }

    /// Mutable access to the processes of pod `index` (tests kill them).
    pub fn pod_processes(&mut self, index: usize) -> Option<&mut Vec<Supervised>> {
        self.pods.get_mut(index).map(|p| &mut p.processes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_variables_as_kubernetes_does() {
        let env: BTreeMap<String, String> =
            [("POD_NAME".to_string(), "cluster-proxy-1".to_string())].into();
        assert_eq!(
            expand("--server-id=$(POD_NAME)", &env),
            "--server-id=cluster-proxy-1"
        );
        assert_eq!(expand("$$(POD_NAME)", &env), "$(POD_NAME)");
        assert_eq!(expand("$(UNKNOWN)-x", &env), "$(UNKNOWN)-x");
        assert_eq!(expand("$(UNCLOSED", &env), "$(UNCLOSED");
    }

    fn binaries_in(dir: &Path) -> Binaries {
        for name in ["proxy-server", "proxy-agent", "cert-authority", "e2e"] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        Binaries::in_dir(dir).unwrap()
    }

    #[test]
    fn a_pod_runs_the_named_binary_with_mounts_and_env_resolved() {
        let bin = tempfile::tempdir().unwrap();
        let volumes_dir = tempfile::tempdir().unwrap();
        let volumes = SecretVolumes::new(volumes_dir.path());
        let binaries = binaries_in(bin.path());
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "cluster-proxy", "namespace": "hub"},
            "spec": {"replicas": 2, "selector": {}, "template": {"spec": {
                "containers": [{
                    "name": "proxy-server",
                    "command": ["/proxy-server"],
                    "args": ["--server-id=$(POD_NAME)", "--server-cert=/etc/server-pki/tls.crt",
                             "--server-ca-cert=/etc/server-ca-pki/ca.crt", "--ns=$(NS)"],
                    "env": [
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    ],
                    "volumeMounts": [
                        {"name": "server", "mountPath": "/etc/server-pki"},
                        {"name": "ca", "mountPath": "/etc/server-ca-pki/"},
                    ],
                }],
                "volumes": [
                    {"name": "server", "secret": {"secretName": "proxy-server"}},
                    {"name": "ca", "secret": {"secretName": "proxy-server-ca"}},
                ],
            }}},
        }))
        .unwrap();
        assert_eq!(
            required_secrets(&deployment),
            BTreeSet::from(["proxy-server".to_string(), "proxy-server-ca".to_string()])
        );
        let plans = plan(&deployment, "cluster-proxy-1", &binaries, &volumes).unwrap();
        assert_eq!(plans.len(), 1);
        let plan = &plans[0];
        assert_eq!(plan.program, bin.path().join("proxy-server"));
        let server = volumes_dir.path().join("proxy-server/tls.crt");
        let ca = volumes_dir.path().join("proxy-server-ca/ca.crt");
        assert_eq!(
            plan.args,
            vec![
                "--server-id=cluster-proxy-1".to_string(),
                format!("--server-cert={}", server.display()),
                format!("--server-ca-cert={}", ca.display()),
                "--ns=hub".to_string(),
            ]
        );
    }

    struct Placed;

    impl PodPlacement for Placed {
        fn extra_args(&self, _: usize, _: usize, _: &str) -> Vec<String> {
            Vec::new()
        }
        fn netns(&self) -> Option<String> {
            None
        }
        fn port_address(
            &self,
            index: usize,
            container: &str,
            name: Option<&str>,
            _port: u16,
        ) -> Option<SocketAddr> {
            let base = 9000 + 100 * index as u16;
            let port = match (container, name?) {
                ("server", "agent") => base + 1,
                ("server", "health") => base + 2,
                _ => return None,
            };
            Some(SocketAddr::from(([10, 0, 0, 1], port)))
        }
    }

    #[test]
    fn ports_and_probes_resolve_to_where_the_placement_put_them() {
        let spec: PodSpec = serde_json::from_value(serde_json::json!({"containers": [{
            "name": "server",
            "ports": [
                {"name": "agent", "containerPort": 8091},
                {"name": "health", "containerPort": 8092},
                {"name": "unplaced", "containerPort": 8099},
            ],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "health"}},
        }, {
            "name": "sidecar",
            "readinessProbe": {"httpGet": {"path": "/ok", "port": 8092}},
        }]}))
        .unwrap();
        let at = |port| SocketAddr::from(([10, 0, 0, 1], port));
        assert_eq!(
            pod_ports(&spec, 1, &Placed),
            vec![
                ("server".to_string(), 8091, at(9101)),
                ("server".to_string(), 8092, at(9102)),
            ]
        );
        assert_eq!(
            readiness_probes(&spec, 1, &Placed),
            vec![
                (at(9102), "/readyz".to_string()),
                // Nowhere to probe: it fails, as an unreachable probe does.
                (SocketAddr::from(([127, 0, 0, 1], 0)), "/ok".to_string()),
            ]
        );
    }

    #[test]
    fn a_container_without_a_known_binary_is_an_error_not_a_guess() {
        let bin = tempfile::tempdir().unwrap();
        let binaries = binaries_in(bin.path());
        let volumes = SecretVolumes::new(bin.path().join("volumes"));
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "x"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "nginx", "image": "nginx"},
                {"name": "other", "command": ["/usr/bin/unknown-tool"]},
            ]}}},
        }))
        .unwrap();
        let err = plan(&deployment, "x-0", &binaries, &volumes).unwrap_err();
        assert!(err.to_string().contains("no command"), "{err}");
    }

    #[test]
    fn secret_volume_keys_cannot_escape_and_stale_keys_go() {
        let dir = tempfile::tempdir().unwrap();
        let volumes = SecretVolumes::new(dir.path());
        let data: BTreeMap<String, Vec<u8>> = [
            ("tls.crt".to_string(), b"cert".to_vec()),
            ("../evil".to_string(), b"x".to_vec()),
        ]
        .into();
        assert!(volumes.write_data("s", &data).unwrap());
        assert!(
            !volumes.write_data("s", &data).unwrap(),
            "unchanged data is no change"
        );
        assert_eq!(
            std::fs::read(dir.path().join("s/tls.crt")).unwrap(),
            b"cert"
        );
        assert!(!dir.path().join("evil").exists());
        let data: BTreeMap<String, Vec<u8>> = [("ca.crt".to_string(), b"ca".to_vec())].into();
        assert!(volumes.write_data("s", &data).unwrap());
        assert!(!dir.path().join("s/tls.crt").exists());
    }
}
