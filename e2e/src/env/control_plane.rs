//! The environment with the real control plane: cert-authority (kubernetes
//! backend) and addon-manager run against the in-memory API, and the
//! environment plays only what a real hub and real clusters would run
//! besides them — the kubelet of the hub's proxy-server Deployment, OCM's
//! placement controller, and each managed cluster's registration and work
//! agents ([`ocm`](simulated_cluster::ocm)).
//!
//! A managed cluster is a `ManagedCluster` object: creating one (`e2e join`)
//! gives it a machine (a network namespace or a loopback address) with its
//! sample services, and from then on OCM's flow — placement decision,
//! `ManagedClusterAddOn`, CSR, `ManifestWork`, agent, Lease, `Available` —
//! runs through the real addon-manager and cert-authority. Deleting it
//! (`e2e leave`) stops its processes and removes its hub namespace.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::proxy::v1alpha1::LABEL_COMPONENT_NAME;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use super::common::{ADDON_NAMESPACE, EnvError, ReplicaPorts};
use super::registry::ProcessRecord;
use simulated_cluster::cluster_api::ClusterApi;
use simulated_cluster::kubelet::{DeploymentRunner, PodPlacement, RunnerStatus, SecretVolumes};
use simulated_cluster::ocm::{self, Klusterlet, Klusterlets, Machine, OcmContext};
use simulated_cluster::process::{ProcessSpec, Supervised};

/// How often the emulated controllers look at the API. The real ones
/// watch; a second here keeps every reaction within a couple of seconds.
const PASS: Duration = Duration::from_millis(500);

/// The most proxy-server replicas the agent load balancer knows ports for.
pub const MAX_REPLICAS: usize = 6;

/// The replicas the hub kubelet runs, by pod name.
pub type HubPods = Arc<Mutex<HubState>>;

/// What the hub's kubelet runs.
#[derive(Default)]
pub struct HubState {
    runners: BTreeMap<String, DeploymentRunner>,
    pub status: BTreeMap<String, RunnerStatus>,
}

impl HubState {
    /// The running proxy-server processes.
    pub fn processes(&self) -> impl Iterator<Item = &Supervised> {
        self.runners.values().flat_map(|r| r.processes())
    }

    /// The processes of pod `index` of Deployment `name` (tests kill them).
    pub fn pod_processes(&mut self, name: &str, index: usize) -> Option<&mut Vec<Supervised>> {
        self.runners.get_mut(name)?.pod_processes(index)
    }
}

struct ServerPlacement {
    hub_ip: IpAddr,
    netns: Option<String>,
    credential_reload_interval: String,
    /// The user-server's hub credential (its pod's ServiceAccount).
    user_server_kubeconfig: Option<PathBuf>,
    /// The API's kubelet side: the pods' Pod objects and port addresses.
    kubelet: Option<memory_apiserver::pods::KubeletPods>,
}

impl PodPlacement for ServerPlacement {
    fn extra_args(&self, index: usize, replicas: usize, container: &str) -> Vec<String> {
        if container == "user-server" {
            return self.user_server_args();
        }
        if container != "proxy-server" {
            return Vec::new();
        }
        let ip = self.hub_ip;
        let ports = ReplicaPorts::of(index);
        vec![
            format!("--server-bind-address={ip}"),
            format!("--server-port={}", ports.client),
            format!("--agent-bind-address={ip}"),
            format!("--agent-port={}", ports.agent),
            format!("--health-bind-address={ip}"),
            format!("--health-port={}", ports.health),
            format!("--admin-bind-address={ip}"),
            format!("--admin-port={}", ports.admin),
            format!(
                "--credential-reload-interval={}",
                self.credential_reload_interval
            ),
            "--graceful-shutdown-timeout=10s".into(),
            // The rendered `--server-count-source=dns:…` needs cluster DNS,
            // which the environment does not have.
            "--server-count-source=static".into(),
            format!("--server-count={}", replicas.max(1)),
        ]
    }

    fn netns(&self) -> Option<String> {
        self.netns.clone()
    }

    /// The proxy-server's named ports are where [`Self::extra_args`] put
    /// them: replica *i*'s own ports on the hub address.
    fn port_address(
        &self,
        index: usize,
        container: &str,
        name: Option<&str>,
        _port: u16,
    ) -> Option<SocketAddr> {
        if container == "user-server" {
            let port = match name? {
                "https" => USER_SERVER_PORT,
                "health" => USER_SERVER_HEALTH_PORT,
                _ => return None,
            };
            return Some(SocketAddr::new(self.hub_ip, port));
        }
        if container != "proxy-server" {
            return None;
        }
        let ports = ReplicaPorts::of(index);
        let port = match name? {
            "proxy-server" => ports.client,
            "agent-server" => ports.agent,
            "health" => ports.health,
            "admin" => ports.admin,
            _ => return None,
        };
        Some(SocketAddr::new(self.hub_ip, port))
    }

    fn pod_ip(&self, _index: usize) -> Option<IpAddr> {
        Some(self.hub_ip)
    }
}

impl ServerPlacement {
    /// The user-server on the hub address; the rendered `--host` names the
    /// proxy-servers' Service, which needs cluster DNS: replica 0's client
    /// port instead (every agent connects to every replica).
    fn user_server_args(&self) -> Vec<String> {
        let ip = self.hub_ip;
        let mut args = vec![
            format!("--host={ip}"),
            format!("--port={}", ReplicaPorts::of(0).client),
            format!("--bind-address={ip}"),
            format!("--server-port={USER_SERVER_PORT}"),
            format!("--health-bind-address={ip}"),
            format!("--health-port={USER_SERVER_HEALTH_PORT}"),
        ];
        if let Some(kubeconfig) = &self.user_server_kubeconfig {
            args.push(format!("--hub-kubeconfig={}", kubeconfig.display()));
        }
        args
    }
}

/// Machines for managed clusters, handed out as clusters join.
pub struct MachinePool {
    free: Vec<(usize, Machine)>,
    /// Machines only the named cluster takes (a network made for it).
    reserved: BTreeMap<String, (usize, Machine)>,
    /// Who each reserved machine (by index) is for.
    owners: BTreeMap<usize, String>,
    taken: BTreeMap<String, (usize, Machine)>,
}

impl MachinePool {
    /// `machines` by index; those `owners` names a cluster for go to that
    /// cluster only.
    pub fn new(machines: Vec<Machine>, owners: BTreeMap<usize, String>) -> Self {
        let mut free = Vec::new();
        let mut reserved = BTreeMap::new();
        for (index, machine) in machines.into_iter().enumerate() {
            match owners.get(&index) {
                Some(owner) => {
                    reserved.insert(owner.clone(), (index, machine));
                }
                None => free.push((index, machine)),
            }
        }
        free.reverse();
        MachinePool {
            free,
            reserved,
            owners,
            taken: BTreeMap::new(),
        }
    }

    fn take(&mut self, cluster: &str) -> Option<Machine> {
        let (index, machine) = match self.reserved.remove(cluster) {
            Some(entry) => entry,
            None => self.free.pop()?,
        };
        self.taken
            .insert(cluster.to_string(), (index, machine.clone()));
        Some(machine)
    }

    fn give_back(&mut self, cluster: &str) {
        let Some(entry) = self.taken.remove(cluster) else {
            return;
        };
        match self.owners.get(&entry.0) {
            Some(owner) => {
                self.reserved.insert(owner.clone(), entry);
            }
            None => {
                self.free.push(entry);
                self.free.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
            }
        }
    }
}

/// Everything the emulation needs.
pub struct ControlPlaneSetup {
    pub ocm: OcmContext,
    pub hub_namespace: String,
    pub hub_ip: IpAddr,
    pub hub_netns: Option<String>,
    pub machines: MachinePool,
    /// Where hub clients find the proxy-client credentials and the CA
    /// bundle, in `cert-authority init`'s layout.
    pub client_pki: PathBuf,
    /// The user-server's hub kubeconfig, with service access.
    pub user_server_kubeconfig: Option<PathBuf>,
    /// The in-memory API's kubelet side: the hub pods become Pod objects
    /// that `pods/portforward` reaches.
    pub kubelet: Option<memory_apiserver::pods::KubeletPods>,
}

/// The processes the emulation runs, by owner (`hub` or a cluster), so a
/// crashed `up` leaves `e2e down` a record of them.
pub type ProcessPids = Arc<std::sync::Mutex<BTreeMap<String, Vec<ProcessRecord>>>>;

fn records<'a>(processes: impl Iterator<Item = &'a Supervised>) -> Vec<ProcessRecord> {
    processes
        .filter_map(|p| {
            Some(ProcessRecord {
                pid: p.pid()?,
                exe: p.spec.program.clone(),
            })
        })
        .collect()
}

/// The running emulation.
pub struct ControlPlane {
    pub klusterlets: Klusterlets,
    pub hub: HubPods,
    pub pids: ProcessPids,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

async fn every_pass<F, Fut>(mut shutdown: watch::Receiver<bool>, mut pass: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        pass().await;
        tokio::select! {
            _ = tokio::time::sleep(PASS) => {}
            _ = shutdown.changed() => return,
        }
    }
}

impl ControlPlane {
    pub fn start(setup: ControlPlaneSetup) -> Self {
        let (shutdown, shutdown_rx) = watch::channel(false);
        let klusterlets: Klusterlets = Arc::default();
        let hub: HubPods = Arc::default();
        let pids: ProcessPids = Arc::default();
        let mut tasks = Vec::new();

        let client = setup.ocm.admin.clone();
        tasks.push(tokio::spawn(every_pass(shutdown_rx.clone(), move || {
            let client = client.clone();
            async move {
                if let Err(err) = ocm::sync_placements(&client).await {
                    tracing::warn!("placement: {err}");
                }
            }
        })));

        let hub_volumes = SecretVolumes::new(setup.ocm.state_dir.join("hub").join("secrets"));
        let placement = Arc::new(ServerPlacement {
            hub_ip: setup.hub_ip,
            netns: setup.hub_netns.clone(),
            credential_reload_interval: setup.ocm.credential_reload_interval.clone(),
            user_server_kubeconfig: setup.user_server_kubeconfig.clone(),
            kubelet: setup.kubelet.clone(),
        });
        {
            let ctx = setup.ocm.clone();
            let hub = hub.clone();
            let namespace = setup.hub_namespace.clone();
            let client_pki = setup.client_pki.clone();
            let pids = pids.clone();
            tasks.push(tokio::spawn(every_pass(shutdown_rx.clone(), move || {
                let ctx = ctx.clone();
                let hub = hub.clone();
                let namespace = namespace.clone();
                let volumes = hub_volumes.clone();
                let placement = placement.clone();
                let client_pki = client_pki.clone();
                let pids = pids.clone();
                async move {
                    if let Err(err) =
                        run_hub_pods(&ctx, &namespace, &hub, &volumes, placement.as_ref()).await
                    {
                        tracing::warn!("hub kubelet: {err}");
                    }
                    if let Err(err) = write_client_pki(&ctx, &namespace, &client_pki).await {
                        tracing::debug!("hub client credentials: {err}");
                    }
                    let running = records(hub.lock().await.processes());
                    pids.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert("hub".into(), running);
                }
            })));
        }

        let machines = Arc::new(Mutex::new(setup.machines));
        {
            let ctx = setup.ocm.clone();
            let klusterlets = klusterlets.clone();
            let pids = pids.clone();
            tasks.push(tokio::spawn(every_pass(shutdown_rx.clone(), move || {
                let ctx = ctx.clone();
                let klusterlets = klusterlets.clone();
                let machines = machines.clone();
                let pids = pids.clone();
                async move {
                    if let Err(err) = run_clusters(&ctx, &klusterlets, &machines).await {
                        tracing::warn!("managed clusters: {err}");
                    }
                    let klusterlets = klusterlets.lock().await;
                    let mut pids = pids.lock().unwrap_or_else(|p| p.into_inner());
                    pids.retain(|owner, _| owner == "hub");
                    for (name, klusterlet) in klusterlets.iter() {
                        pids.insert(name.clone(), records(klusterlet.processes()));
                    }
                }
            })));
        }
        ControlPlane {
            klusterlets,
            hub,
            pids,
            shutdown,
            tasks,
        }
    }

    /// Stops the emulation and every process it runs.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
        for (_, mut klusterlet) in std::mem::take(&mut *self.klusterlets.lock().await) {
            klusterlet.stop().await;
        }
        let mut hub = self.hub.lock().await;
        for runner in hub.runners.values_mut() {
            runner.stop_all().await;
        }
    }
}

async fn run_hub_pods(
    ctx: &OcmContext,
    namespace: &str,
    hub: &HubPods,
    volumes: &SecretVolumes,
    placement: &ServerPlacement,
) -> Result<(), ocm::OcmError> {
    let deployments: Api<Deployment> = Api::namespaced(ctx.admin.clone(), namespace);
    // The proxy-server Deployments (those whose pods carry the component
    // label; the Deployment itself carries only the addon label) and the
    // chart's user-server. The other hub services run as processes of
    // their own.
    let mut list = deployments.list(&ListParams::default()).await?;
    list.items.retain(|d| {
        d.metadata.name.as_deref() == Some(USER_SERVER_DEPLOYMENT)
            || d.spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.labels.as_ref())
                .and_then(|l| l.get(LABEL_COMPONENT_NAME))
                .is_some_and(|c| c == "proxy-server")
    });
    let secrets: Api<Secret> = Api::namespaced(ctx.admin.clone(), namespace);
    let mut wanted = std::collections::BTreeSet::new();
    for deployment in &list.items {
        wanted.extend(simulated_cluster::kubelet::required_secrets(deployment));
        for volume in deployment
            .spec
            .iter()
            .filter_map(|s| s.template.spec.as_ref())
            .flat_map(|s| s.volumes.iter().flatten())
        {
            if let Some(name) = volume.secret.as_ref().and_then(|s| s.secret_name.clone()) {
                wanted.insert(name);
            }
        }
    }
    for name in &wanted {
        match secrets.get_opt(name).await? {
            Some(secret) => {
                volumes
                    .write(&secret)
                    .map_err(|e| ocm::OcmError::Other(e.to_string()))?;
            }
            None => volumes.remove(name),
        }
    }
    let mut hub = hub.lock().await;
    let names: Vec<String> = list.items.iter().map(|d| d.name_any()).collect();
    let gone: Vec<String> = hub
        .runners
        .keys()
        .filter(|n| !names.contains(n))
        .cloned()
        .collect();
    for name in gone {
        if let Some(mut runner) = hub.runners.remove(&name) {
            runner.stop_all().await;
        }
        hub.status.remove(&name);
    }
    for deployment in &list.items {
        let name = deployment.name_any();
        let status = {
            let runner = hub.runners.entry(name.clone()).or_insert_with(|| {
                DeploymentRunner::new("hub").reporting_to(placement.kubelet.clone())
            });
            runner
                .sync(
                    Some(deployment),
                    &ctx.binaries,
                    &ctx.logs,
                    volumes,
                    placement,
                )
                .await
        };
        if hub.status.get(&name) != Some(&status)
            || deployment
                .status
                .as_ref()
                .and_then(|s| s.observed_generation)
                != deployment.metadata.generation
        {
            // The Deployment controller's part: status.
            let patch = json!({
                "status": {
                    "observedGeneration": deployment.metadata.generation,
                    "replicas": status.running,
                    "updatedReplicas": status.running,
                    "readyReplicas": status.running,
                    "availableReplicas": status.running,
                }
            });
            if let Err(err) = deployments
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                tracing::debug!("Deployment {name} status: {err}");
            }
            hub.status.insert(name, status);
        }
    }
    Ok(())
}

/// Keeps the hub client's credentials (Secret `proxy-client` and the
/// bundle in `proxy-server-ca`) in `dir`, in `cert-authority init`'s
/// layout, as a hub client mounting those Secrets would see them.
async fn write_client_pki(
    ctx: &OcmContext,
    namespace: &str,
    dir: &std::path::Path,
) -> Result<(), ocm::OcmError> {
    let secrets: Api<Secret> = Api::namespaced(ctx.admin.clone(), namespace);
    let (Some(client), Some(bundle)) = (
        secrets.get_opt("proxy-client").await?,
        secrets.get_opt("proxy-server-ca").await?,
    ) else {
        return Ok(());
    };
    let key = |secret: &Secret, key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
    };
    let (Some(cert), Some(private), Some(ca)) = (
        key(&client, "tls.crt"),
        key(&client, "tls.key"),
        key(&bundle, "ca.crt"),
    ) else {
        return Ok(());
    };
    let write = |path: PathBuf, text: &str, private: bool| {
        if std::fs::read_to_string(&path).ok().as_deref() == Some(text) {
            return Ok(());
        }
        cert_authority::files::write_atomically(&path, text, private)
            .map_err(|e| ocm::OcmError::Other(e.to_string()))
    };
    write(dir.join("proxy-client/tls.crt"), &cert, false)?;
    write(dir.join("proxy-client/tls.key"), &private, true)?;
    write(dir.join("ca-bundle.crt"), &ca, false)
}

async fn run_clusters(
    ctx: &OcmContext,
    klusterlets: &Klusterlets,
    machines: &Mutex<MachinePool>,
) -> Result<(), ocm::OcmError> {
    let clusters = Api::<ManagedCluster>::all(ctx.admin.clone())
        .list(&ListParams::default())
        .await?;
    let present: Vec<String> = clusters
        .items
        .iter()
        .filter(|c| c.metadata.deletion_timestamp.is_none())
        .map(|c| c.name_any())
        .collect();
    let mut klusterlets = klusterlets.lock().await;
    let gone: Vec<String> = klusterlets
        .keys()
        .filter(|n| !present.contains(n))
        .cloned()
        .collect();
    for name in gone {
        if let Some(mut klusterlet) = klusterlets.remove(&name) {
            tracing::info!("{name}: left; stopping its agents and services");
            klusterlet.stop().await;
        }
        machines.lock().await.give_back(&name);
        ocm::forget_cluster(&ctx.admin, &name).await?;
    }
    for name in &present {
        if klusterlets.contains_key(name) {
            continue;
        }
        // A name that cannot be a namespace or a DNS label never gets a
        // machine; the ManagedCluster stays as it is.
        if cluster_proxy_proto::identity::ClusterName::new(name.as_str()).is_err() {
            continue;
        }
        let Some(machine) = machines.lock().await.take(name) else {
            tracing::warn!("{name}: no free machine for another managed cluster");
            continue;
        };
        match start_cluster(ctx, name, machine.clone()).await {
            Ok(klusterlet) => {
                tracing::info!("{name}: joined");
                klusterlets.insert(name.clone(), klusterlet);
            }
            Err(err) => {
                tracing::warn!("{name}: {err}");
                machines.lock().await.give_back(name);
            }
        }
    }
    for klusterlet in klusterlets.values_mut() {
        klusterlet.sync(ctx).await;
    }
    Ok(())
}

/// The cluster directory of `name` in the state directory.
pub fn cluster_dir(state_dir: &std::path::Path, name: &str) -> PathBuf {
    state_dir.join("clusters").join(name)
}

async fn start_cluster(
    ctx: &OcmContext,
    name: &str,
    machine: Machine,
) -> Result<Klusterlet, ocm::OcmError> {
    let dir = cluster_dir(&ctx.state_dir, name);
    let api = ClusterApi::start(name, &machine, &dir).await?;
    grant_hub_administrator(api.admin()).await?;
    let services = Supervised::start(
        ProcessSpec::new(&format!("{name}/services"), &ctx.binaries.e2e)
            .args([
                "sample".to_string(),
                "--cluster".into(),
                name.to_string(),
                "--ip".into(),
                machine.service_ip.to_string(),
            ])
            .in_netns(machine.netns.clone()),
        &ctx.logs,
    )
    .map_err(|e| ocm::OcmError::Other(e.to_string()))?;
    let klusterlet = Klusterlet::new(name, machine, services, dir, Some(api));
    klusterlet.accept(ctx).await?;
    Ok(klusterlet)
}

/// The hub administrator as the user-server names it on a managed cluster.
pub fn hub_administrator() -> String {
    cluster_proxy_proto::service_access::managed_user(memory_apiserver::ADMIN_USER)
}

/// What a cluster's administrator would grant so that the hub's
/// administrator administers the cluster through the user-server: the
/// environment's choice, not cluster-proxy's (a real cluster grants hub
/// users what its owners decide).
async fn grant_hub_administrator(admin: &Client) -> Result<(), ocm::OcmError> {
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "hub-administrator"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": hub_administrator()}],
    });
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
        .patch(
            "hub-administrator",
            &PatchParams::apply("e2e"),
            &Patch::Apply(&binding),
        )
        .await?;
    Ok(())
}

/// Creates (or keeps) a ManagedCluster as a cluster administrator accepting
/// it on the hub: `hubAcceptsClient: true`, label `cluster.open-cluster-management.io/clusterset=global`.
pub async fn join(client: &Client, name: &str) -> Result<(), kube::Error> {
    let object = json!({
        "apiVersion": "cluster.open-cluster-management.io/v1",
        "kind": "ManagedCluster",
        "metadata": {"name": name, "labels": {
            "cluster.open-cluster-management.io/clusterset": "global",
            "name": name,
        }},
        "spec": {"hubAcceptsClient": true, "leaseDurationSeconds": 60},
    });
    Api::<ManagedCluster>::all(client.clone())
        .patch(
            name,
            &PatchParams::apply("cluster-admin"),
            &Patch::Apply(&object),
        )
        .await?;
    Ok(())
}

/// Deletes a ManagedCluster (the cluster leaves the hub).
pub async fn leave(client: &Client, name: &str) -> Result<(), kube::Error> {
    match Api::<ManagedCluster>::all(client.clone())
        .delete(name, &Default::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(err) => Err(err),
    }
}

/// The proxy-server client address of replica `index` (pod `<mpc>-<index>`).
pub fn replica_client_addr(hub_ip: IpAddr, index: usize) -> SocketAddr {
    SocketAddr::new(hub_ip, ReplicaPorts::of(index).client)
}

/// The proxy-server image name the environment's MPC names (the kubelet
/// runs the workspace's binary whatever the tag).
pub const DEV_IMAGE: &str = "localhost/cluster-proxy/proxy-server:dev";
/// The same for the agent.
pub const DEV_AGENT_IMAGE: &str = "localhost/cluster-proxy/proxy-agent:dev";
/// How long the environment's addon-agents make their Leases.
pub const ENV_LEASE_DURATION: Duration = Duration::from_secs(4);

/// How the environment's agents reach the proxy-servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentEntrypoint {
    /// The chart's default: each agent dials 127.0.0.1:8091, its
    /// addon-agent port-forwards to a proxy-server pod through the hub
    /// API. Needs a loopback per cluster, so network namespaces.
    PortForward,
    /// The agent Service (the load balancer in front of the replicas'
    /// agent ports) by address: on loopback every cluster would share one
    /// 127.0.0.1:8091.
    Hostname(SocketAddr),
}

impl AgentEntrypoint {
    fn spec(self) -> serde_json::Value {
        match self {
            AgentEntrypoint::PortForward => json!({"type": "PortForward"}),
            AgentEntrypoint::Hostname(addr) => json!({
                "type": "Hostname",
                "hostname": {"value": addr.ip().to_string()},
                "port": addr.port(),
            }),
        }
    }
}

/// The `ManagedProxyConfiguration` the environment installs, as a user's
/// values file would render it.
pub fn managed_proxy_configuration(
    replicas: usize,
    entrypoint: AgentEntrypoint,
    additional_sans: &[String],
    user_server_sans: Option<&[String]>,
) -> serde_json::Value {
    let mut mpc = json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "cluster-proxy"},
        "spec": {
            "authentication": {
                "signer": {"type": "SelfSigned", "selfSigned": {"additionalSANs": additional_sans}},
                "dump": {"secrets": {}},
            },
            "proxyServer": {
                "image": DEV_IMAGE,
                "replicas": replicas,
                "namespace": ADDON_NAMESPACE,
                "inClusterServiceName": "proxy-entrypoint",
                "entrypoint": entrypoint.spec(),
            },
            "proxyAgent": {"image": DEV_AGENT_IMAGE, "replicas": 1},
        },
    });
    if let Some(sans) = user_server_sans {
        mpc["spec"]["userServer"] = json!({"additionalSANs": sans});
    }
    mpc
}

/// How often the environment's health-prober probes every cluster.
pub const PROBE_INTERVAL: &str = "3s";

/// One managed cluster as `up` and `e2e status` show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterRow {
    pub name: String,
    /// The addon's `Available` condition: status and reason.
    pub available: String,
    /// health-prober's verdict: the `ClusterProxyReachable` reason with
    /// the replicas that reach the cluster and the latency, e.g.
    /// `Reachable 2/2 3ms`.
    pub probe: String,
    /// The addon's other conditions, `Type=Status` each.
    pub conditions: Vec<String>,
}

/// The condition health-prober writes on each addon.
pub const PROBE_CONDITION: &str = "ClusterProxyReachable";

/// `reason replicas latency` from health-prober's machine-readable message
/// (`replicas=2/2 latency_ms=3 …`).
fn probe_summary(condition: &cluster_proxy_proto::api::Condition) -> String {
    let field = |key: &str| {
        condition
            .message
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key))
            .map(str::to_owned)
    };
    let mut summary = condition.reason.clone();
    if let Some(replicas) = field("replicas=") {
        summary.push(' ');
        summary.push_str(&replicas);
    }
    if let Some(latency) = field("latency_ms=") {
        summary.push_str(&format!(" {latency}ms"));
    }
    summary
}

/// The addon status of every ManagedCluster, from the hub API.
pub async fn addon_status(client: &Client) -> Result<Vec<ClusterRow>, kube::Error> {
    use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
    let clusters = Api::<ManagedCluster>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let mut rows = Vec::new();
    for cluster in clusters.items {
        let name = cluster.name_any();
        let addon = Api::<ManagedClusterAddOn>::namespaced(client.clone(), &name)
            .get_opt(ocm::ADDON_NAME)
            .await
            .unwrap_or(None);
        let conditions: Vec<_> = addon
            .as_ref()
            .and_then(|a| a.status.as_ref())
            .map(|s| s.conditions.clone().unwrap_or_default())
            .unwrap_or_default();
        let available = conditions
            .iter()
            .find(|c| c.type_ == "Available")
            .map(|c| format!("{} ({})", c.status, c.reason))
            .unwrap_or_else(|| match addon {
                Some(_) => "no condition yet".into(),
                None => "not installed".into(),
            });
        let probe = conditions
            .iter()
            .find(|c| c.type_ == PROBE_CONDITION)
            .map(probe_summary)
            .unwrap_or_else(|| "not probed yet".into());
        rows.push(ClusterRow {
            name,
            available,
            probe,
            conditions: conditions
                .iter()
                .filter(|c| c.type_ != "Available" && c.type_ != PROBE_CONDITION)
                .map(|c| format!("{}={}", c.type_, c.status))
                .collect(),
        });
    }
    Ok(rows)
}

/// Whether cluster `name`'s sample HTTP service answers through the
/// replica at `addr` over gRPC.
pub async fn reachable(
    client: &super::client::HubClient,
    addr: SocketAddr,
    name: &str,
) -> Result<(), String> {
    let target = format!("{name}:{}", simulated_cluster::sample::HTTP_PORT);
    match client
        .http_get(super::client::Frontend::Grpc, addr, &target, "/")
        .await
    {
        Ok(body) if body == simulated_cluster::sample::greeting(name) => Ok(()),
        Ok(body) => Err(format!("{target} answered {body:?}")),
        Err(err) => Err(err.to_string()),
    }
}

/// The hub services as ServiceAccounts under RBAC (the environment option `hub_rbac`):
/// the API then authorizes every request and records every decision
/// ([`memory_apiserver::KubeApi::requests`]), so a test can hold a chart's
/// RBAC against what addon-manager, cert-authority and health-prober ask for.
#[derive(Debug, Clone, Default)]
pub struct HubRbac {
    /// Applied as the administrator before any service starts: Namespaces,
    /// ServiceAccounts, ClusterRoles, ClusterRoleBindings, Roles,
    /// RoleBindings and ConfigMaps (the RBAC part of a chart's render, and
    /// what the services read).
    pub objects: Vec<serde_json::Value>,
    /// Each service's user, `system:serviceaccount:<namespace>:<name>`.
    pub addon_manager: String,
    pub cert_authority: String,
    pub health_prober: String,
    /// The user-server's, when the chart installs it.
    pub user_server: Option<String>,
}

/// What OCM's cluster-manager grants the managed clusters' registration
/// agents on the hub, as far as the environment's stand-ins use it: their
/// CSRs (the addon-agent's Lease Role is the addon-manager's to write).
const REGISTRATION_AGENT_ROLE: &str = "e2e:open-cluster-management:registration-agent";

/// The kinds of a chart's render that [`HubRbac`] applies: the RBAC, and
/// the ConfigMaps the services read (the user-server's exposed-services
/// allowlist), as `helm install` creates them.
const HUB_RBAC_KINDS: [&str; 7] = [
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ConfigMap",
];

/// Why the chart could not be rendered live.
#[derive(Debug, thiserror::Error)]
pub enum ChartRenderError {
    /// The chart venv (Helm's renderer) is not there.
    #[error(
        "no chart venv at {0} (python3 -m venv target/chart-venv && \
         target/chart-venv/bin/pip install -r charts/tests/requirements.txt)"
    )]
    NoVenv(PathBuf),
    #[error("rendering the chart: {0}")]
    Failed(String),
}

/// The chart rendered live with its default values, one JSON value per
/// object, by Helm's own library in the chart venv (`charts/tests/check.py`'s
/// renderer, which `.ci/run` installs at `target/chart-venv`).
pub fn render_chart_defaults() -> Result<Vec<serde_json::Value>, ChartRenderError> {
    render_chart(&serde_json::json!({}))
}

/// The chart rendered with `values` (as `--set`/`-f` would give them), as
/// [`render_chart_defaults`] does.
pub fn render_chart(
    values: &serde_json::Value,
) -> Result<Vec<serde_json::Value>, ChartRenderError> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    let python = root.join("target/chart-venv/bin/python");
    if !python.is_file() {
        return Err(ChartRenderError::NoVenv(python));
    }
    let script = "import json, sys\n\
                  sys.path.insert(0, 'charts/tests')\n\
                  import check\n\
                  print(json.dumps(check.documents(check.render(json.loads(sys.argv[1])))))\n";
    let output = std::process::Command::new(&python)
        .current_dir(&root)
        .args(["-c", script, &values.to_string()])
        .output()
        .map_err(|e| ChartRenderError::Failed(format!("running {}: {e}", python.display())))?;
    if !output.status.success() {
        return Err(ChartRenderError::Failed(
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ));
    }
    serde_json::from_slice(&output.stdout)
        .map_err(|e| ChartRenderError::Failed(format!("the renderer's output: {e}")))
}

/// The chart rendered with its default values, as `charts/tests/check.py`
/// keeps it (CI fails when the snapshot and the chart disagree).
const CHART_DEFAULT_RENDER: &str = include_str!("../../../charts/tests/snapshots/default.yaml");
/// The same with service access on (`charts/tests/values/service-access.yaml`):
/// what `e2e up` installs.
const CHART_SERVICE_ACCESS_RENDER: &str =
    include_str!("../../../charts/tests/snapshots/service-access.yaml");

/// The objects of a render snapshot of `charts/tests/check.py` (`label`
/// names it in errors).
fn snapshot_documents(render: &str, label: &str) -> Result<Vec<serde_json::Value>, String> {
    // The snapshot starts each template's output with its `# Source:`
    // line and separates its documents with `---`; NOTES.txt is text.
    let mut documents: Vec<serde_json::Value> = Vec::new();
    for section in render.split("# Source: ").skip(1) {
        let (source, body) = section.split_once('\n').unwrap_or((section, ""));
        if !source.trim_end().ends_with(".yaml") {
            continue;
        }
        let parsed: Vec<serde_json::Value> = serde_saphyr::from_multiple(body)
            .map_err(|e| format!("charts/tests/snapshots/{label}.yaml, {source}: {e}"))?;
        documents.extend(parsed);
    }
    Ok(documents.into_iter().filter(|d| !d.is_null()).collect())
}

/// The user-server Deployment the chart installs with service access on,
/// as `helm install` puts it on the hub (the hub kubelet runs it).
pub fn chart_user_server_deployment() -> Result<serde_json::Value, String> {
    snapshot_documents(CHART_SERVICE_ACCESS_RENDER, "service-access")?
        .into_iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == USER_SERVER_DEPLOYMENT)
        .ok_or_else(|| {
            format!("the service-access render has no Deployment {USER_SERVER_DEPLOYMENT}")
        })
}

/// The user-server's Deployment (and Service) in the chart.
pub const USER_SERVER_DEPLOYMENT: &str = "cluster-proxy-addon-user";
/// Where the environment's user-server serves users, on the hub address
/// (the chart's Service port).
pub const USER_SERVER_PORT: u16 = 9092;
/// The user-server's health port on the hub address.
pub const USER_SERVER_HEALTH_PORT: u16 = 9093;

impl HubRbac {
    /// The RBAC of a chart's render (one JSON value per object): its
    /// Namespaces, ServiceAccounts, (Cluster)Roles and bindings, and the
    /// ServiceAccounts the three hub Deployments run as.
    pub fn from_chart_documents(documents: &[serde_json::Value]) -> Result<Self, String> {
        let text = |object: &serde_json::Value, pointer: &str| {
            object
                .pointer(pointer)
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let objects = documents
            .iter()
            .filter(|d| HUB_RBAC_KINDS.contains(&text(d, "/kind").as_str()))
            .cloned()
            .collect();
        let service_account_of = |name: &str| -> Result<String, String> {
            let deployment = documents
                .iter()
                .find(|d| text(d, "/kind") == "Deployment" && text(d, "/metadata/name") == name)
                .ok_or_else(|| format!("the chart renders no Deployment {name}"))?;
            let account = text(deployment, "/spec/template/spec/serviceAccountName");
            if account.is_empty() {
                return Err(format!("Deployment {name} names no ServiceAccount"));
            }
            Ok(Self::service_account(
                &text(deployment, "/metadata/namespace"),
                &account,
            ))
        };
        let installs_user_server = documents.iter().any(|d| {
            text(d, "/kind") == "Deployment" && text(d, "/metadata/name") == USER_SERVER_DEPLOYMENT
        });
        Ok(HubRbac {
            objects,
            addon_manager: service_account_of("cluster-proxy-addon-manager")?,
            cert_authority: service_account_of("cluster-proxy-cert-authority")?,
            health_prober: service_account_of("cluster-proxy-health-prober")?,
            user_server: installs_user_server
                .then(|| service_account_of(USER_SERVER_DEPLOYMENT))
                .transpose()?,
        })
    }

    /// The RBAC `helm install` with default values creates, from the chart's
    /// checked render: what `e2e up` runs the hub services under.
    pub fn chart_defaults() -> Result<Self, String> {
        Self::from_chart_documents(&snapshot_documents(CHART_DEFAULT_RENDER, "default")?)
    }

    /// The RBAC of the chart with service access on (the user-server and
    /// the service-proxies): what `e2e up` installs.
    pub fn chart_service_access() -> Result<Self, String> {
        Self::from_chart_documents(&snapshot_documents(
            CHART_SERVICE_ACCESS_RENDER,
            "service-access",
        )?)
    }

    /// The user of ServiceAccount `name` in `namespace`.
    pub fn service_account(namespace: &str, name: &str) -> String {
        format!("system:serviceaccount:{namespace}:{name}")
    }

    /// A kubeconfig that authenticates as `user`, a ServiceAccount that
    /// [`HubRbac::apply`] created, with a token bound to it: deleting the
    /// account (say, by garbage collection) revokes it, as on a real hub.
    pub(super) fn kubeconfig(
        api: &memory_apiserver::KubeApi,
        user: &str,
    ) -> Result<PathBuf, EnvError> {
        let (namespace, name) = user
            .strip_prefix("system:serviceaccount:")
            .and_then(|rest| rest.split_once(':'))
            .ok_or_else(|| EnvError::KubeApi(format!("{user:?} is not a ServiceAccount")))?;
        api.kubeconfigs(None)
            .write_service_account(namespace, name)
            .map_err(|e| EnvError::KubeApi(e.to_string()))
    }

    /// Applies [`HubRbac::objects`] and the registration agents' stand-in
    /// RBAC as the administrator.
    pub(super) async fn apply(&self, admin: &Client) -> Result<(), EnvError> {
        use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
        let registration = [
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": REGISTRATION_AGENT_ROLE},
                "rules": [{"apiGroups": ["certificates.k8s.io"],
                           "resources": ["certificatesigningrequests"],
                           "verbs": ["create", "get", "list", "watch"]}],
            }),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": REGISTRATION_AGENT_ROLE},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": REGISTRATION_AGENT_ROLE},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                              "name": "system:open-cluster-management:managed-clusters"}],
            }),
        ];
        // Namespaces first: the Roles and bindings go into them.
        let mut objects: Vec<&serde_json::Value> =
            self.objects.iter().chain(registration.iter()).collect();
        objects.sort_by_key(|o| o["kind"] != "Namespace");
        for object in objects {
            let text = |pointer: &str| object.pointer(pointer).and_then(|v| v.as_str());
            let (Some(api_version), Some(kind), Some(name)) =
                (text("/apiVersion"), text("/kind"), text("/metadata/name"))
            else {
                return Err(EnvError::KubeApi(format!(
                    "hub RBAC: an object without apiVersion, kind or name: {object}"
                )));
            };
            if !HUB_RBAC_KINDS.contains(&kind) {
                return Err(EnvError::KubeApi(format!(
                    "hub RBAC: {kind} {name} is not a Namespace, ServiceAccount, RBAC object or ConfigMap"
                )));
            }
            let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
            let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
            let api: Api<DynamicObject> = match text("/metadata/namespace") {
                Some(namespace) => Api::namespaced_with(admin.clone(), namespace, &resource),
                None => Api::all_with(admin.clone(), &resource),
            };
            api.patch(name, &PatchParams::apply("helm"), &Patch::Apply(object))
                .await
                .map_err(|e| EnvError::KubeApi(format!("hub RBAC: {kind} {name}: {e}")))?;
        }
        Ok(())
    }
}
