//! The local multi-cluster environment: a hub with a cert-authority, two (or
//! more) proxy-server replicas behind a load balancer, and N managed
//! clusters, each with a proxy-agent and sample services — every one a real
//! process, built from this workspace.
//!
//! Where the machine allows it (root and `ip netns`), each managed cluster
//! lives in its own network namespace that can reach only the hub's agent
//! port ([`netns`]); the hub cannot reach a cluster's services except
//! through the tunnel. Elsewhere everything runs on loopback addresses of
//! its own (127.18.x.y) and says so.
//!
//! `cargo run -p e2e -- up` drives this from the command line; the scenario
//! tests (`tests/scenarios.rs`) start the same environment in-process.

pub mod client;
mod common;
pub mod control_plane;
mod hub_lifecycle;

pub mod registry;

pub mod traces;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use self::common::{
    ADDON_NAMESPACE, AGENT_SERVICE_PORT, EnvError, KUBE_API_PORT, ReplicaPorts,
};
use self::common::{io, write_apiserver_pki};

use self::client::{Frontend, HubClient};
use self::registry::{ProcessRecord, Record};
use memory_apiserver::{KubeApi, KubeApiOptions};
use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::netns::Topology;
use simulated_cluster::ocm::AGENT_PORTS;
use simulated_cluster::process::{Logs, ProcessSpec, Supervised};
use simulated_cluster::{balancer, netns, sample};

/// How managed clusters are separated from the hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IsolationChoice {
    /// Network namespaces when possible, loopback otherwise.
    #[default]
    Auto,
    /// Network namespaces or fail.
    Netns,
    /// Loopback only.
    Loopback,
}

/// What an environment ended up with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Isolation {
    Netns,
    /// Everything on loopback, for the given reason.
    Loopback(String),
}

/// What to start.
#[derive(Debug, Clone)]
pub struct EnvOptions {
    pub clusters: Vec<String>,
    pub replicas: usize,
    /// Keep PKI and logs here; a temporary directory otherwise.
    pub state_dir: Option<PathBuf>,
    pub isolation: IsolationChoice,
    /// Print every process's log lines to stdout.
    pub echo_logs: bool,
    pub progress: Progress,
    /// Environment id (namespace and interface names); at most 8 characters
    /// of `[a-z0-9]`. Random when `None`.
    pub id: Option<String>,
    /// Third octet of the environment's addresses; a free one when `None`.
    pub slot: Option<u8>,
    /// Validity of leaf certificates (Go duration).
    pub leaf_validity: String,
    /// How often cert-authority checks the PKI (Go duration).
    pub ca_interval: String,
    /// How often servers and agents look for new credential files.
    pub credential_reload_interval: String,
    /// Start the in-memory Kubernetes API for the control plane.
    pub kube_api: bool,
    /// How the agent Service picks a replica for each agent connection.
    pub agent_balancer: balancer::Selection,
    /// Run the real control plane (addon-manager, cert-authority's
    /// kubernetes backend, OCM played by the environment) instead of
    /// starting servers and agents by hand with the files PKI.
    pub control_plane: bool,
    /// With the control plane: machines kept free for clusters that join
    /// later (`e2e join`).
    pub spare_machines: usize,
    /// With the control plane: run addon-manager, cert-authority and
    /// health-prober as ServiceAccounts under this RBAC (the API enforces
    /// RBAC); `None` means the chart's default RBAC.
    pub hub_rbac: Option<control_plane::HubRbac>,
    /// Keep every authorization decision of the API (tests of RBAC; it
    /// grows without bound, so `up` does not).
    pub record_requests: bool,
    /// Where the services send traces.
    pub traces: traces::TraceExport,
    /// Network namespaces only: the clusters whose network routes only to
    /// the hub's forward-proxy address ([`Environment::forward_proxy_addr`],
    /// where a test runs the proxy), not to the hub's agent address. With
    /// the control plane each gets a machine of its own when it joins.
    pub proxied_clusters: Vec<String>,
    /// With the control plane and network namespaces: the `Hostname`
    /// entrypoint (agents dial the agent Service's address) instead of the
    /// chart's default `PortForward`.
    pub hostname_entrypoint: bool,
}

impl EnvOptions {
    /// `n` clusters named `cluster-a`, `cluster-b`, … (then `cluster-27`, …).
    pub fn cluster_names(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| {
                if i < 26 {
                    format!("cluster-{}", (b'a' + i as u8) as char)
                } else {
                    format!("cluster-{}", i + 1)
                }
            })
            .collect()
    }

    pub fn new(clusters: usize) -> Self {
        EnvOptions {
            clusters: Self::cluster_names(clusters),
            replicas: 2,
            state_dir: None,
            isolation: IsolationChoice::Auto,
            echo_logs: false,
            progress: Progress::Quiet,
            id: None,
            slot: None,
            leaf_validity: "2160h".into(),
            ca_interval: "1m".into(),
            credential_reload_interval: "10s".into(),
            kube_api: true,
            agent_balancer: balancer::Selection::RoundRobin,
            control_plane: false,
            spare_machines: 2,
            hub_rbac: None,
            record_requests: false,
            traces: traces::TraceExport::Off,
            proxied_clusters: Vec::new(),
            hostname_entrypoint: false,
        }
    }
}

/// One proxy-server replica.
pub struct Replica {
    pub name: String,
    pub ports: ReplicaPorts,
    pub process: Supervised,
}

/// One managed cluster.
pub struct Cluster {
    pub name: String,
    pub netns: Option<String>,
    /// Where the cluster's sample services listen (inside its network).
    pub service_ip: IpAddr,
    pub agent: Supervised,
    pub services: Supervised,
    /// The CA of the cluster's stand-in kube-apiserver certificate.
    pub apiserver_ca: PathBuf,
}

/// What `e2e fetch` and users need to know about a running environment,
/// written to `<state>/env.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub id: String,
    pub isolation: Isolation,
    /// Where hub clients reach the replicas (client, health, admin ports).
    pub hub_addr: IpAddr,
    /// Where agents reach the hub (the agent Service).
    pub agent_service_addr: SocketAddr,
    pub pki_dir: PathBuf,
    pub state_dir: PathBuf,
    pub logs_dir: PathBuf,
    pub servers: Vec<(String, ReplicaPorts)>,
    pub clusters: Vec<ClusterSummary>,
    pub hub_netns: Option<String>,
    /// The in-memory Kubernetes API and the administrator's kubeconfig.
    pub kube_api: Option<SocketAddr>,
    pub kubeconfig: Option<PathBuf>,
    /// Where users reach the user-server (with service access).
    #[serde(default)]
    pub user_server: Option<SocketAddr>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterSummary {
    pub name: String,
    pub netns: Option<String>,
    pub service_ip: IpAddr,
    pub apiserver_ca: PathBuf,
}

impl Summary {
    pub fn file(state_dir: &Path) -> PathBuf {
        state_dir.join("env.json")
    }

    pub fn load(state_dir: &Path) -> Result<Self, EnvError> {
        let path = Self::file(state_dir);
        let text = std::fs::read_to_string(&path).map_err(io(path.display().to_string()))?;
        serde_json::from_str(&text).map_err(|e| EnvError::Io {
            what: path.display().to_string(),
            source: std::io::Error::other(e),
        })
    }

    pub fn client_addr(&self, replica: usize) -> Option<SocketAddr> {
        let (_, ports) = self.servers.get(replica)?;
        Some(SocketAddr::new(self.hub_addr, ports.client))
    }
}

/// A running environment. Dropping it kills every process and removes the
/// namespaces; [`Environment::shutdown`] does so gracefully.
pub struct Environment {
    pub summary: Summary,
    pub binaries: Binaries,
    pub logs: Logs,
    pub cert_authority: Supervised,
    /// cert-authority's `kubernetes` backend against the in-memory API:
    /// the hub Secrets and proxy-agent CSR signing, as in a real hub.
    pub control_plane_ca: Option<Supervised>,
    pub balancer: Supervised,
    pub replicas: Vec<Replica>,
    pub clusters: Vec<Cluster>,
    /// The control plane's Kubernetes API (in this process).
    pub kube_api: Option<KubeApi>,
    /// With the control plane: addon-manager, the API forwarder the
    /// clusters use, and the emulated OCM agents and kubelets.
    pub addon_manager: Option<Supervised>,
    pub health_prober: Option<Supervised>,
    pub kube_forwarder: Option<Supervised>,
    pub control_plane: Option<control_plane::ControlPlane>,
    /// The environment's own OTLP receiver, when it runs one.
    pub traces: Option<traces::TraceReceiver>,
    topology: Option<Topology>,
    record: Record,
    _temporary_state: Option<tempfile::TempDir>,
}

/// addon-manager's command line in the environment (besides `KUBECONFIG`
/// and `POD_NAMESPACE`): with service access, the chart's
/// `addonManager.enableServiceProxy`.
fn addon_manager_args(service_access: bool) -> Vec<String> {
    let mut args = vec!["--health-port=0".to_string()];
    if service_access {
        args.push("--enable-service-proxy=true".into());
    }
    args
}

fn random_id() -> String {
    format!("{:06x}", rand::random::<u32>() & 0xff_ffff)
}

fn choose_isolation(choice: IsolationChoice) -> Result<Isolation, EnvError> {
    match choice {
        IsolationChoice::Loopback => Ok(Isolation::Loopback("loopback was asked for".into())),
        IsolationChoice::Netns => netns::availability()
            .map(|()| Isolation::Netns)
            .map_err(EnvError::NetnsUnavailable),
        IsolationChoice::Auto => Ok(match netns::availability() {
            Ok(()) => Isolation::Netns,
            Err(reason) => Isolation::Loopback(reason),
        }),
    }
}

fn loopback_slot_is_free(slot: u8) -> bool {
    let addr = SocketAddr::new(
        IpAddr::V4(Ipv4Addr::new(127, 18, slot, 1)),
        AGENT_SERVICE_PORT,
    );
    std::net::TcpListener::bind(addr).is_ok()
}

/// A free address slot for an environment started with `choice`.
pub fn free_slot(choice: IsolationChoice) -> Result<u8, EnvError> {
    choose_slot(&choose_isolation(choice)?, None)
}

fn choose_slot(isolation: &Isolation, wanted: Option<u8>) -> Result<u8, EnvError> {
    let free = |slot: u8| match isolation {
        Isolation::Netns => netns::slot_is_free(slot),
        Isolation::Loopback(_) => loopback_slot_is_free(slot),
    };
    if let Some(slot) = wanted {
        return Ok(slot);
    }
    let start = rand::random::<u8>() % 250;
    (0..250u16)
        .map(|offset| 1 + ((u16::from(start) + offset) % 250) as u8)
        .find(|slot| free(*slot))
        .ok_or(EnvError::NoSlot)
}

/// Where the hub's services listen and which network they run in.
struct HubAddresses {
    /// The replicas' and the hub services' address.
    hub_addr: IpAddr,
    /// The balancer in front of the replicas' agent ports.
    agent_service_addr: SocketAddr,
    netns: Option<String>,
}

/// The state directory asked for, or a temporary one removed on drop.
fn state_directory(
    wanted: Option<&Path>,
) -> Result<(Option<tempfile::TempDir>, PathBuf), EnvError> {
    match wanted {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(io(dir.display().to_string()))?;
            let dir = std::fs::canonicalize(dir).map_err(io(dir.display().to_string()))?;
            Ok((None, dir))
        }
        None => {
            let dir = tempfile::Builder::new()
                .prefix("cluster-proxy-e2e-")
                .tempdir()
                .map_err(io("temporary state directory"))?;
            let path = dir.path().to_path_buf();
            Ok((Some(dir), path))
        }
    }
}

/// One network per cluster; with the control plane, clusters come and go,
/// so the networks are machines that a joining cluster takes, and each
/// proxied cluster has one of its own, named after it.
fn machine_names(options: &EnvOptions) -> Vec<String> {
    if options.control_plane {
        (0..options.clusters.len() + options.spare_machines)
            .map(|i| format!("m{i}"))
            .chain(options.proxied_clusters.iter().cloned())
            .collect()
    } else {
        options.clusters.clone()
    }
}

/// The machines of the proxied clusters: index and name (the cluster's).
fn proxied_machines<'a>(
    options: &'a EnvOptions,
    machine_names: &'a [String],
) -> impl Iterator<Item = (usize, &'a String)> + 'a {
    // With the control plane, the shared machines (`m<i>`) come first.
    let shared = if options.control_plane {
        options.clusters.len() + options.spare_machines
    } else {
        0
    };
    machine_names
        .iter()
        .enumerate()
        .skip(shared)
        .filter(|(_, name)| options.proxied_clusters.contains(name))
}

/// The network namespaces (recorded before they exist, so `e2e down` finds
/// them after a crash), or none on loopback.
fn create_topology(
    isolation: &Isolation,
    id: &str,
    slot: u8,
    machine_names: &[String],
    proxied: impl IntoIterator<Item = usize>,
    record: &mut Record,
) -> Result<Option<Topology>, EnvError> {
    match isolation {
        Isolation::Netns => {
            let topology = Topology::new(id, slot, machine_names).with_proxied(proxied);
            record.netns.push(topology.hub_netns());
            record
                .netns
                .extend((0..machine_names.len()).map(|i| topology.cluster_netns(i)));
            record.save().map_err(io("environment record"))?;
            topology.create()?;
            Ok(Some(topology))
        }
        Isolation::Loopback(_) => {
            record.save().map_err(io("environment record"))?;
            Ok(None)
        }
    }
}

/// The hub's address and the agent Service's.
fn hub_addresses(topology: Option<&Topology>, slot: u8) -> (IpAddr, SocketAddr) {
    match topology {
        Some(t) => (
            IpAddr::V4(t.hub_client_addr()),
            SocketAddr::new(IpAddr::V4(t.hub_agent_addr()), AGENT_SERVICE_PORT),
        ),
        None => (
            IpAddr::V4(Ipv4Addr::new(127, 18, slot, 2)),
            SocketAddr::new(
                IpAddr::V4(Ipv4Addr::new(127, 18, slot, 1)),
                AGENT_SERVICE_PORT,
            ),
        ),
    }
}

/// The in-memory Kubernetes API, when asked for, at `ip`.
async fn start_kube_api(
    options: &EnvOptions,
    topology: Option<&Topology>,
    ip: IpAddr,
    state_dir: &Path,
) -> Result<Option<KubeApi>, EnvError> {
    if !options.kube_api {
        return Ok(None);
    }
    let mut api_options = KubeApiOptions::new(state_dir);
    if let Some(t) = topology {
        // Clusters reach the API through a forwarder on the hub's
        // agent address.
        api_options.extra_sans.push(t.hub_agent_addr().to_string());
    }
    api_options.bind = SocketAddr::new(ip, KUBE_API_PORT);
    api_options.rbac = options.hub_rbac.is_some();
    api_options.record_requests = options.record_requests;
    let api = KubeApi::start(api_options)
        .await
        .map_err(|e| EnvError::KubeApi(e.to_string()))?;
    Ok(Some(api))
}

/// The PKI: one command, as a user would run it (kept across restarts of
/// a named state directory).
fn init_pki(
    binaries: &Binaries,
    pki_dir: &Path,
    options: &EnvOptions,
    hub: &HubAddresses,
) -> Result<(), EnvError> {
    if pki_dir.join("ca-bundle.crt").exists() {
        return Ok(());
    }
    let out = std::process::Command::new(&binaries.cert_authority)
        .args(["init", "--dir"])
        .arg(pki_dir)
        .args(["--clusters", &options.clusters.join(",")])
        .args(hub.additional_sans())
        .args(["--leaf-validity", &options.leaf_validity])
        .output()
        .map_err(io("running cert-authority init"))?;
    if !out.status.success() {
        return Err(EnvError::Pki(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(())
}

impl HubAddresses {
    /// The hub's addresses as extra SANs of the server certificates.
    fn additional_sans(&self) -> [String; 4] {
        [
            "--additional-san".into(),
            self.hub_addr.to_string(),
            "--additional-san".into(),
            self.agent_service_addr.ip().to_string(),
        ]
    }
}

/// `cert-authority run --backend files` over the PKI directory: the
/// rotation every environment has.
fn start_files_cert_authority(
    binaries: &Binaries,
    pki_dir: &Path,
    options: &EnvOptions,
    hub: &HubAddresses,
    logs: &Logs,
) -> Result<Supervised, EnvError> {
    let spec = ProcessSpec::new("cert-authority", &binaries.cert_authority)
        .args(["run", "--backend", "files", "--dir"])
        .arg(pki_dir.display().to_string())
        .args(["--clusters", &options.clusters.join(",")])
        .args(hub.additional_sans())
        .args(["--interval", &options.ca_interval])
        .args(["--leaf-validity", &options.leaf_validity])
        .in_netns(hub.netns.clone());
    Ok(Supervised::start(spec, logs)?)
}

/// The Service in front of the replicas' agent ports: every replica the
/// environment may run is a backend (the control plane scales them).
fn start_agent_balancer(
    binaries: &Binaries,
    options: &EnvOptions,
    hub: &HubAddresses,
    logs: &Logs,
) -> Result<Supervised, EnvError> {
    let replicas = if options.control_plane {
        control_plane::MAX_REPLICAS
    } else {
        options.replicas
    };
    let backends = (0..replicas).flat_map(|r| {
        [
            "--backend".to_string(),
            SocketAddr::new(hub.hub_addr, ReplicaPorts::of(r).agent).to_string(),
        ]
    });
    let spec = ProcessSpec::new("agent-lb", &binaries.e2e)
        .args([
            "balance".to_string(),
            "--listen".into(),
            hub.agent_service_addr.to_string(),
        ])
        .args(backends)
        .args(["--selection", options.agent_balancer.name()])
        .in_netns(hub.netns.clone());
    Ok(Supervised::start(spec, logs)?)
}

impl Environment {
    /// Builds the binaries and starts everything; returns once every process
    /// is started (not yet ready: see [`Environment::wait_ready`]).
    pub async fn start(mut options: EnvOptions) -> Result<Self, EnvError> {
        Self::check_options(&mut options)?;
        registry::clean_orphans();
        let binaries = Binaries::build(options.progress)?;
        let isolation = choose_isolation(options.isolation)?;
        let id = options.id.clone().unwrap_or_else(random_id);
        if let Some(existing) = Record::all().into_iter().find(|r| r.id == id) {
            return Err(EnvError::AlreadyRunning {
                id,
                owner: existing.owner,
            });
        }
        let slot = choose_slot(&isolation, options.slot)?;
        let (temporary_state, state_dir) = state_directory(options.state_dir.as_deref())?;
        let logs_dir = state_dir.join("logs");
        std::fs::create_dir_all(&logs_dir).map_err(io(logs_dir.display().to_string()))?;
        let logs = Logs::new(&logs_dir, options.echo_logs);
        let mut record = Record {
            id: id.clone(),
            owner: std::process::id(),
            netns: Vec::new(),
            processes: Vec::new(),
            state_dir: state_dir.clone(),
            temporary_state: temporary_state.as_ref().map(|d| d.path().to_path_buf()),
        };
        if let Isolation::Loopback(reason) = &isolation
            && !options.proxied_clusters.is_empty()
        {
            return Err(EnvError::NetnsUnavailable(format!(
                "clusters behind a forward proxy need their own networks: {reason}"
            )));
        }
        let machine_names = machine_names(&options);
        let proxied = proxied_machines(&options, &machine_names).map(|(index, _)| index);
        let topology =
            create_topology(&isolation, &id, slot, &machine_names, proxied, &mut record)?;
        let (hub_addr, agent_service_addr) = hub_addresses(topology.as_ref(), slot);
        let hub_netns = topology.as_ref().map(Topology::hub_netns);
        // The API and the trace receiver sit on the machine's side of the hub
        // link, which every hub service reaches.
        let host_ip = match &topology {
            Some(t) => IpAddr::V4(t.host_addr()),
            None => IpAddr::V4(Ipv4Addr::new(127, 18, slot, 3)),
        };
        let kube_api = start_kube_api(&options, topology.as_ref(), host_ip, &state_dir).await?;
        let (trace_endpoint, trace_receiver) = traces::start(&options.traces, &state_dir, host_ip)
            .await
            .map_err(|e| io("trace receiver")(std::io::Error::other(e)))?;
        // Managed clusters have no route to the receiver: their agents send
        // their spans home through their tunnels (the span relay).
        let logs = logs
            .with_trace_endpoint(trace_endpoint)
            .with_trace_netns(hub_netns.clone());
        let hub = HubAddresses {
            hub_addr,
            agent_service_addr,
            netns: hub_netns.clone(),
        };
        let pki_dir = state_dir.join("pki");
        init_pki(&binaries, &pki_dir, &options, &hub)?;

        let mut environment = Environment {
            summary: Summary {
                id: id.clone(),
                isolation: isolation.clone(),
                hub_addr,
                agent_service_addr,
                pki_dir: pki_dir.clone(),
                state_dir: state_dir.clone(),
                logs_dir: logs_dir.clone(),
                servers: Vec::new(),
                clusters: Vec::new(),
                hub_netns: hub_netns.clone(),
                kube_api: kube_api.as_ref().map(KubeApi::addr),
                kubeconfig: kube_api.as_ref().map(|k| k.kubeconfig_path().to_path_buf()),
                user_server: None,
            },
            cert_authority: start_files_cert_authority(&binaries, &pki_dir, &options, &hub, &logs)?,
            balancer: start_agent_balancer(&binaries, &options, &hub, &logs)?,
            control_plane_ca: None,
            addon_manager: None,
            health_prober: None,
            kube_forwarder: None,
            control_plane: None,
            replicas: Vec::new(),
            clusters: Vec::new(),
            kube_api,
            binaries: binaries.clone(),
            logs: logs.clone(),
            topology,
            record,
            traces: trace_receiver,
            _temporary_state: temporary_state,
        };
        if let Some(api) = &environment.kube_api {
            environment.control_plane_ca = Some(
                Self::start_control_plane_ca(
                    api,
                    &binaries,
                    &logs,
                    hub_netns.clone(),
                    options.control_plane,
                    options.hub_rbac.as_ref(),
                )
                .await?,
            );
        }
        environment.remember_processes();

        if options.control_plane {
            environment
                .start_control_plane(&options, &machine_names, slot)
                .await?;
            environment.remember_processes();
        } else {
            environment.start_static_replicas(&options, &hub)?;
            environment.start_static_clusters(&options, slot)?;
        }
        environment.write_summary()?;
        Ok(environment)
    }

    /// Refuses what cannot start, and puts the control plane under the
    /// chart's RBAC unless told otherwise: as on a real hub, it runs as the
    /// chart's ServiceAccounts, of the chart with service access on (what
    /// `e2e up` installs: the user-server and the service-proxies).
    fn check_options(options: &mut EnvOptions) -> Result<(), EnvError> {
        if options.control_plane && options.hub_rbac.is_none() {
            options.hub_rbac =
                Some(control_plane::HubRbac::chart_service_access().map_err(EnvError::KubeApi)?);
        }
        for name in options.clusters.iter().chain(&options.proxied_clusters) {
            cluster_proxy_proto::identity::ClusterName::new(name)
                .map_err(|e| EnvError::ClusterName(name.clone(), e.to_string()))?;
        }
        // Without the control plane a cluster's network is made for it.
        if let Some(name) = options
            .proxied_clusters
            .iter()
            .find(|name| !options.control_plane && !options.clusters.contains(name))
        {
            return Err(EnvError::ClusterName(
                name.clone(),
                "a proxied cluster must be one of the environment's clusters".into(),
            ));
        }
        if options.control_plane && !options.kube_api {
            return Err(EnvError::KubeApi(
                "the control plane needs the in-memory Kubernetes API".into(),
            ));
        }
        Ok(())
    }

    /// Without the control plane: the proxy-server replicas, each a process
    /// started from flags over the files PKI.
    fn start_static_replicas(
        &mut self,
        options: &EnvOptions,
        hub: &HubAddresses,
    ) -> Result<(), EnvError> {
        let hub_ip = hub.hub_addr.to_string();
        let pki_dir = self.summary.pki_dir.clone();
        let pki = |rel: &str| pki_dir.join(rel).display().to_string();
        for r in 0..options.replicas {
            let name = format!("proxy-server-{r}");
            let ports = ReplicaPorts::of(r);
            let spec = ProcessSpec::new(&name, &self.binaries.proxy_server)
                .args([
                    format!("--server-id=server-{r}"),
                    format!("--server-count={}", options.replicas),
                    "--proxy-strategies=destHost".into(),
                    format!("--server-bind-address={hub_ip}"),
                    format!("--server-port={}", ports.client),
                    format!("--agent-bind-address={hub_ip}"),
                    format!("--agent-port={}", ports.agent),
                    format!("--health-bind-address={hub_ip}"),
                    format!("--health-port={}", ports.health),
                    format!("--admin-bind-address={hub_ip}"),
                    format!("--admin-port={}", ports.admin),
                    format!("--server-cert={}", pki("proxy-server/tls.crt")),
                    format!("--server-key={}", pki("proxy-server/tls.key")),
                    format!("--server-ca-cert={}", pki("ca-bundle.crt")),
                    format!("--cluster-cert={}", pki("agent-server/tls.crt")),
                    format!("--cluster-key={}", pki("agent-server/tls.key")),
                    format!("--cluster-ca-cert={}", pki("ca-bundle.crt")),
                    format!(
                        "--credential-reload-interval={}",
                        options.credential_reload_interval
                    ),
                    // SIGTERM drains: connections in flight get this long.
                    "--graceful-shutdown-timeout=10s".into(),
                ])
                .in_netns(hub.netns.clone());
            let process = Supervised::start(spec, &self.logs)?;
            self.replicas.push(Replica {
                name: name.clone(),
                ports,
                process,
            });
            self.summary.servers.push((name, ports));
            self.remember_processes();
        }
        Ok(())
    }

    /// Without the control plane: each cluster's sample services and agent,
    /// in the cluster's own network.
    fn start_static_clusters(&mut self, options: &EnvOptions, slot: u8) -> Result<(), EnvError> {
        for (index, name) in options.clusters.iter().enumerate() {
            let (cluster_netns, service_ip) = match &self.topology {
                Some(t) => (
                    Some(t.cluster_netns(index)),
                    IpAddr::V4(netns::CLUSTER_SERVICE_ADDR),
                ),
                None => (
                    None,
                    IpAddr::V4(Ipv4Addr::new(127, 18, slot, 10 + index as u8)),
                ),
            };
            let cluster_dir = self.summary.state_dir.join("clusters").join(name);
            let apiserver_ca = write_apiserver_pki(&cluster_dir, name, service_ip)?;
            let services = Supervised::start(
                ProcessSpec::new(&format!("{name}/services"), &self.binaries.e2e)
                    .args([
                        "sample".to_string(),
                        "--cluster".into(),
                        name.clone(),
                        "--ip".into(),
                        service_ip.to_string(),
                        "--cert".into(),
                        cluster_dir.join("tls.crt").display().to_string(),
                        "--key".into(),
                        cluster_dir.join("tls.key").display().to_string(),
                    ])
                    .in_netns(cluster_netns.clone()),
                &self.logs,
            )?;
            let agent = Supervised::start(
                Self::agent_spec(
                    &self.binaries,
                    &self.summary.pki_dir,
                    name,
                    name,
                    service_ip,
                    self.summary.agent_service_addr,
                    &options.credential_reload_interval,
                    AGENT_PORTS,
                )
                .in_netns(cluster_netns.clone()),
                &self.logs,
            )?;
            self.summary.clusters.push(ClusterSummary {
                name: name.clone(),
                netns: cluster_netns.clone(),
                service_ip,
                apiserver_ca: apiserver_ca.clone(),
            });
            self.clusters.push(Cluster {
                name: name.clone(),
                netns: cluster_netns,
                service_ip,
                agent,
                services,
                apiserver_ca,
            });
            self.remember_processes();
        }
        Ok(())
    }

    /// `summary.json` in the state directory, which `e2e status` and
    /// `fetch` read.
    fn write_summary(&self) -> Result<(), EnvError> {
        let summary_path = Summary::file(&self.summary.state_dir);
        let text = serde_json::to_string_pretty(&self.summary)
            .map_err(|e| EnvError::Pki(e.to_string()))?;
        std::fs::write(&summary_path, text).map_err(io(summary_path.display().to_string()))
    }

    /// Creates the addon namespace in the API and starts
    /// `cert-authority run --backend kubernetes` against it from the hub.
    async fn start_control_plane_ca(
        api: &KubeApi,
        binaries: &Binaries,
        logs: &Logs,
        hub_netns: Option<String>,
        follow_configuration: bool,
        hub_rbac: Option<&control_plane::HubRbac>,
    ) -> Result<Supervised, EnvError> {
        let client = api
            .client()
            .await
            .map_err(|e| EnvError::KubeApi(e.to_string()))?;
        let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
            kube::Api::all(client.clone());
        let namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": ADDON_NAMESPACE}}))
                .map_err(|e| EnvError::KubeApi(e.to_string()))?;
        match namespaces.create(&Default::default(), &namespace).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(e) => return Err(EnvError::KubeApi(e.to_string())),
        }
        let kubeconfig = match hub_rbac {
            Some(rbac) => {
                rbac.apply(&client).await?;
                control_plane::HubRbac::kubeconfig(api, &rbac.cert_authority)?
            }
            None => api.kubeconfig_path().to_path_buf(),
        };
        let spec = ProcessSpec::new("cert-authority-kube", &binaries.cert_authority)
            .args([
                "run",
                "--backend",
                "kubernetes",
                "--namespace",
                ADDON_NAMESPACE,
            ])
            .args(["--interval", "30s", "--health-port", "0"])
            // With the control plane it follows the ManagedProxyConfiguration
            // (namespace, Secret names, SANs); without, there is none.
            .arg(if follow_configuration {
                "--managed-proxy-configuration=cluster-proxy"
            } else {
                "--managed-proxy-configuration="
            })
            .env("KUBECONFIG", kubeconfig.display().to_string())
            .in_netns(hub_netns);
        Ok(Supervised::start(spec, logs)?)
    }

    #[allow(clippy::too_many_arguments)]
    /// The command line of a proxy-agent serving `cluster` with the
    /// certificate of `cert_cluster` (the same, except when a test
    /// impersonates another cluster).
    pub fn agent_spec(
        binaries: &Binaries,
        pki_dir: &Path,
        cluster: &str,
        cert_cluster: &str,
        service_ip: IpAddr,
        agent_service: SocketAddr,
        reload: &str,
        ports: (u16, u16),
    ) -> ProcessSpec {
        let pki = |rel: &str| pki_dir.join(rel).display().to_string();
        ProcessSpec::new(&format!("{cluster}/proxy-agent"), &binaries.proxy_agent).args([
            format!("--proxy-server-host={}", agent_service.ip()),
            format!("--proxy-server-port={}", agent_service.port()),
            format!("--ca-cert={}", pki("ca-bundle.crt")),
            format!(
                "--agent-cert={}",
                pki(&format!("agents/{cert_cluster}/tls.crt"))
            ),
            format!(
                "--agent-key={}",
                pki(&format!("agents/{cert_cluster}/tls.key"))
            ),
            format!("--agent-id={cluster}-agent"),
            format!("--agent-identifiers=host={cluster}"),
            format!("--host-alias={cluster}={service_ip}"),
            format!("--health-server-host={service_ip}"),
            format!("--health-server-port={}", ports.0),
            format!("--admin-bind-address={service_ip}"),
            format!("--admin-server-port={}", ports.1),
            format!("--credential-reload-interval={reload}"),
            "--keepalive-time=10s".into(),
        ])
    }

    fn remember_processes(&mut self) {
        let mut processes = Vec::new();
        let mut add = |process: &Supervised| {
            if let Some(pid) = process.pid() {
                processes.push(ProcessRecord {
                    pid,
                    exe: process.spec.program.clone(),
                });
            }
        };
        add(&self.cert_authority);
        if let Some(ca) = &self.control_plane_ca {
            add(ca);
        }
        add(&self.balancer);
        for process in self
            .addon_manager
            .iter()
            .chain(self.health_prober.iter())
            .chain(self.kube_forwarder.iter())
        {
            add(process);
        }

        for replica in &self.replicas {
            add(&replica.process);
        }
        for cluster in &self.clusters {
            add(&cluster.agent);
            add(&cluster.services);
        }
        if let Some(control_plane) = &self.control_plane {
            let pids = control_plane.pids.lock().unwrap_or_else(|p| p.into_inner());
            processes.extend(pids.values().flatten().cloned());
        }
        if self.record.processes != processes {
            self.record.processes = processes;
            let _ = self.record.save();
        }
    }

    /// Starts an extra proxy-agent inside cluster `cert_of`'s network with
    /// that cluster's certificate, registering as cluster `claims` — an
    /// agent that tries to take over another cluster's traffic.
    pub fn start_impostor(&mut self, cert_of: usize, claims: &str) -> Result<Supervised, EnvError> {
        let cluster = &self.clusters[cert_of];
        let spec = Self::agent_spec(
            &self.binaries,
            &self.summary.pki_dir,
            claims,
            &cluster.name,
            cluster.service_ip,
            self.summary.agent_service_addr,
            "10s",
            (AGENT_PORTS.0 + 10_000, AGENT_PORTS.1 + 10_000),
        );
        let spec = ProcessSpec {
            name: format!("impostor-{}-as-{claims}", cluster.name),
            ..spec
        }
        .in_netns(cluster.netns.clone());
        let process = Supervised::start(spec, &self.logs)?;
        if let Some(pid) = process.pid() {
            self.record.processes.push(ProcessRecord {
                pid,
                exe: process.spec.program.clone(),
            });
            let _ = self.record.save();
        }
        Ok(process)
    }

    /// Call after (re)starting a process so a crash cleanup finds it.
    pub fn processes_changed(&mut self) {
        self.remember_processes();
    }

    /// Where the proxied clusters' only route leads (a hub address where
    /// nothing listens until a test starts its forward proxy there, in the
    /// hub's network namespace); `None` without proxied clusters.
    pub fn forward_proxy_addr(&self) -> Option<Ipv4Addr> {
        self.topology
            .as_ref()
            .filter(|t| !t.proxied.is_empty())
            .map(Topology::hub_proxy_addr)
    }

    pub fn hub_client(&self) -> Result<HubClient, EnvError> {
        HubClient::from_pki_dir(&self.summary.pki_dir).map_err(|e| EnvError::Pki(e.to_string()))
    }

    pub fn client_addr(&self, replica: usize) -> SocketAddr {
        SocketAddr::new(self.summary.hub_addr, self.replicas[replica].ports.client)
    }

    /// Whether `cluster`'s HTTP service answers through `replica` via
    /// `frontend`; the error says why not.
    pub async fn check_reachable(
        &self,
        client: &HubClient,
        replica: usize,
        cluster: usize,
        frontend: Frontend,
    ) -> Result<(), String> {
        let name = &self.clusters[cluster].name;
        let target = format!("{name}:{}", sample::HTTP_PORT);
        match client
            .http_get(frontend, self.client_addr(replica), &target, "/")
            .await
        {
            Ok(body) if body == sample::greeting(name) => Ok(()),
            Ok(body) => Err(format!("{target} answered {body:?}")),
            Err(err) => Err(err.to_string()),
        }
    }

    /// Waits until every cluster answers through every live replica over
    /// gRPC, i.e. every agent holds a tunnel to every replica.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<Duration, EnvError> {
        let started = Instant::now();
        let client = self.hub_client()?.with_timeout(Duration::from_secs(2));
        loop {
            let mut missing = Vec::new();
            for replica in 0..self.replicas.len() {
                for cluster in 0..self.clusters.len() {
                    if let Err(err) = self
                        .check_reachable(&client, replica, cluster, Frontend::Grpc)
                        .await
                    {
                        missing.push(format!(
                            "{} via {}: {err}",
                            self.clusters[cluster].name, self.replicas[replica].name
                        ));
                    }
                }
            }
            if missing.is_empty() {
                return Ok(started.elapsed());
            }
            if started.elapsed() > timeout {
                return Err(EnvError::NotReady(format!(
                    "not ready after {timeout:?}:\n  {}",
                    missing.join("\n  ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Runs `e2e probe ADDR` from the hub's network (netns only): whether a
    /// TCP connection from the hub to `addr` succeeds, and what happened.
    pub async fn probe_from_hub(&self, addr: SocketAddr) -> Result<(bool, String), EnvError> {
        self.probe_from(self.summary.hub_netns.as_deref(), addr)
            .await
    }

    /// The same probe from inside a network namespace (`None`: this one).
    pub async fn probe_from(
        &self,
        netns: Option<&str>,
        addr: SocketAddr,
    ) -> Result<(bool, String), EnvError> {
        let mut command = match netns {
            Some(ns) => {
                let mut command = tokio::process::Command::new("ip");
                command.args(["netns", "exec", ns]).arg(&self.binaries.e2e);
                command
            }
            None => tokio::process::Command::new(&self.binaries.e2e),
        };
        let out = command
            .args(["probe", &addr.to_string()])
            .output()
            .await
            .map_err(io("running e2e probe"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.success(), text.trim().to_string()))
    }

    /// Stops everything: agents first (so servers see clean goodbyes), then
    /// the hub, then removes the namespaces and the record.
    pub async fn shutdown(mut self) {
        let grace = Duration::from_secs(5);
        if let Some(addon_manager) = self.addon_manager.as_mut() {
            addon_manager.stop(grace).await;
        }
        if let Some(prober) = self.health_prober.as_mut() {
            prober.stop(grace).await;
        }
        if let Some(control_plane) = self.control_plane.take() {
            control_plane.shutdown().await;
        }
        if let Some(forwarder) = self.kube_forwarder.as_mut() {
            forwarder.stop(grace).await;
        }
        for cluster in &mut self.clusters {
            cluster.agent.stop(grace).await;
            cluster.services.stop(grace).await;
        }
        for replica in &mut self.replicas {
            replica.process.stop(grace).await;
        }
        self.balancer.stop(grace).await;
        self.cert_authority.stop(grace).await;
        if let Some(ca) = self.control_plane_ca.as_mut() {
            ca.stop(grace).await;
        }
        if let Some(api) = self.kube_api.take() {
            api.shutdown().await;
        }
        // Drop removes the namespaces, the record and a temporary state dir.
    }
}

impl Drop for Environment {
    fn drop(&mut self) {
        // Processes die with their handles (kill_on_drop); the namespaces
        // would not.
        if let Some(topology) = &self.topology {
            topology.destroy();
        }
        Record::remove(&self.record.id);
    }
}
