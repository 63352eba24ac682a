//! Network namespaces that give every managed cluster its own network.
//!
//! One environment is a hub namespace and one namespace per managed cluster,
//! each cluster joined to the hub by its own veth pair, plus one veth pair
//! from the machine's own namespace to the hub so a user's shell reaches the
//! hub's ports. Every address comes from the benchmarking range
//! 198.18.0.0/15, and every route is a /32 device route: no namespace has a
//! default route, so no test packet can leave the machine.
//!
//! What each side can reach:
//! * a cluster routes only to the hub's agent address, where nothing but the
//!   agent Service (the load balancer in front of the replicas' agent ports)
//!   and the Kubernetes API's forwarder listen — the agent's ways out (the
//!   `PortForward` entrypoint goes through the API);
//! * a *proxied* cluster ([`Topology::proxied`]) routes only to the hub's
//!   proxy address instead, where a test runs a forward proxy: its only way
//!   out is that proxy, as on an enterprise network;
//! * the hub routes to each cluster's veth address (replies to the agent),
//!   but not to the cluster's service address, which lives on the cluster's
//!   loopback — exactly like a pod IP behind a NAT gateway;
//! * the machine routes only to the hub's client address, where the
//!   replicas' client, health and admin ports listen.
//!
//! Interface names are at most 15 bytes (`cp<id>h<n>`), so an environment id
//! is four hex digits.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Output};

/// Every namespace this crate creates starts with this, so `e2e down` finds
/// them after a crash.
pub const NETNS_PREFIX: &str = "cpe2e-";

/// The address every cluster's services listen on inside its own namespace
/// (the same in each cluster, as service IPs are in real clusters).
pub const CLUSTER_SERVICE_ADDR: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("running `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed: {stderr}")]
    Failed { command: String, stderr: String },
}

/// Whether this process may create network namespaces: root and a working
/// `ip netns`. The reason is returned when it may not.
pub fn availability() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not running as root".into());
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`ip netns list` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(err) => Err(format!("`ip` (iproute2) is not usable: {err}")),
    }
}

fn run(args: &[&str]) -> Result<Output, NetnsError> {
    let command = format!("ip {}", args.join(" "));
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| NetnsError::Spawn {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(NetnsError::Failed {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out)
}

fn run_in(ns: &str, args: &[&str]) -> Result<Output, NetnsError> {
    let mut full = vec!["netns", "exec", ns, "ip"];
    full.extend_from_slice(args);
    run(&full)
}

/// The addresses and namespace names of one environment.
#[derive(Debug, Clone)]
pub struct Topology {
    pub id: String,
    /// Third octet of every 198.18.x.y address of this environment.
    pub slot: u8,
    pub clusters: Vec<String>,
    /// The clusters (by index) whose only route is to the hub's proxy
    /// address ([`Topology::hub_proxy_addr`]) rather than its agent address.
    pub proxied: BTreeSet<usize>,
}

impl Topology {
    pub fn new(id: &str, slot: u8, clusters: &[String]) -> Self {
        Topology {
            id: id.to_string(),
            slot,
            clusters: clusters.to_vec(),
            proxied: BTreeSet::new(),
        }
    }

    /// The same with clusters `proxied` (indices) routing only to the hub's
    /// proxy address.
    pub fn with_proxied(mut self, proxied: impl IntoIterator<Item = usize>) -> Self {
        self.proxied = proxied.into_iter().collect();
        self
    }

    pub fn hub_netns(&self) -> String {
        format!("{NETNS_PREFIX}{}-hub", self.id)
    }

    pub fn cluster_netns(&self, index: usize) -> String {
        format!("{NETNS_PREFIX}{}-{}", self.id, self.clusters[index])
    }

    /// The hub address agents dial: only the agent Service listens here.
    pub fn hub_agent_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.slot, 1)
    }

    /// The hub address of the replicas' own ports (client, agent, health,
    /// admin), which no cluster has a route to.
    pub fn hub_client_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.slot, 2)
    }

    /// The hub address where a test runs the forward proxy of the proxied
    /// clusters: on the hub only when there are some.
    pub fn hub_proxy_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.slot, 3)
    }

    /// The hub address cluster `index` routes to: the agent address, or the
    /// proxy address for a proxied cluster.
    pub fn cluster_gateway(&self, index: usize) -> Ipv4Addr {
        if self.proxied.contains(&index) {
            self.hub_proxy_addr()
        } else {
            self.hub_agent_addr()
        }
    }

    /// The machine's own end of the link to the hub.
    pub fn host_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.slot, 254)
    }

    /// A cluster's outside address (the source of its agent's connection).
    pub fn cluster_link_addr(&self, index: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.slot, 10 + index as u8)
    }

    fn host_link(&self) -> (String, String) {
        (format!("cp{}x", self.id), format!("cp{}y", self.id))
    }

    fn cluster_link(&self, index: usize) -> (String, String) {
        (
            format!("cp{}h{index}", self.id),
            format!("cp{}c{index}", self.id),
        )
    }

    /// Creates every namespace, link, address and route. On failure what
    /// was created is removed again.
    pub fn create(&self) -> Result<(), NetnsError> {
        let result = self.try_create();
        if result.is_err() {
            self.destroy();
        }
        result
    }

    fn try_create(&self) -> Result<(), NetnsError> {
        let hub = self.hub_netns();
        let agent_ip = self.hub_agent_addr().to_string();
        let client_ip = self.hub_client_addr().to_string();
        run(&["netns", "add", &hub])?;
        run_in(&hub, &["link", "set", "lo", "up"])?;
        run_in(
            &hub,
            &["addr", "add", &format!("{agent_ip}/32"), "dev", "lo"],
        )?;
        run_in(
            &hub,
            &["addr", "add", &format!("{client_ip}/32"), "dev", "lo"],
        )?;
        if !self.proxied.is_empty() {
            let proxy_ip = self.hub_proxy_addr().to_string();
            run_in(
                &hub,
                &["addr", "add", &format!("{proxy_ip}/32"), "dev", "lo"],
            )?;
        }

        let (host_side, hub_side) = self.host_link();
        let host_ip = self.host_addr().to_string();
        run(&[
            "link", "add", &host_side, "type", "veth", "peer", "name", &hub_side, "netns", &hub,
        ])?;
        run(&["addr", "add", &format!("{host_ip}/32"), "dev", &host_side])?;
        run(&["link", "set", &host_side, "up"])?;
        run(&[
            "route",
            "add",
            &format!("{client_ip}/32"),
            "dev",
            &host_side,
            "src",
            &host_ip,
        ])?;
        run_in(&hub, &["link", "set", &hub_side, "up"])?;
        run_in(
            &hub,
            &[
                "route",
                "add",
                &format!("{host_ip}/32"),
                "dev",
                &hub_side,
                "src",
                &client_ip,
            ],
        )?;

        for index in 0..self.clusters.len() {
            let ns = self.cluster_netns(index);
            let (hub_end, cluster_end) = self.cluster_link(index);
            let link_ip = self.cluster_link_addr(index).to_string();
            let gateway_ip = self.cluster_gateway(index).to_string();
            run(&["netns", "add", &ns])?;
            run_in(&ns, &["link", "set", "lo", "up"])?;
            run_in(
                &ns,
                &[
                    "addr",
                    "add",
                    &format!("{CLUSTER_SERVICE_ADDR}/32"),
                    "dev",
                    "lo",
                ],
            )?;
            run_in(
                &hub,
                &[
                    "link",
                    "add",
                    &hub_end,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &cluster_end,
                    "netns",
                    &ns,
                ],
            )?;
            run_in(&hub, &["link", "set", &hub_end, "up"])?;
            run_in(
                &hub,
                &[
                    "route",
                    "add",
                    &format!("{link_ip}/32"),
                    "dev",
                    &hub_end,
                    "src",
                    &gateway_ip,
                ],
            )?;
            run_in(
                &ns,
                &["addr", "add", &format!("{link_ip}/32"), "dev", &cluster_end],
            )?;
            run_in(&ns, &["link", "set", &cluster_end, "up"])?;
            run_in(
                &ns,
                &[
                    "route",
                    "add",
                    &format!("{gateway_ip}/32"),
                    "dev",
                    &cluster_end,
                    "src",
                    &link_ip,
                ],
            )?;
        }
        Ok(())
    }

    /// Kills what runs inside and removes every namespace of this
    /// environment; the veths go with them. Never fails: what is already gone
    /// is fine.
    pub fn destroy(&self) {
        let mut names = vec![self.hub_netns()];
        names.extend((0..self.clusters.len()).map(|i| self.cluster_netns(i)));
        for name in names {
            remove_netns(&name);
        }
        // The host end normally dies with its peer; this covers a crash
        // between creating the pair and moving its peer.
        let _ = run(&["link", "del", &self.host_link().0]);
    }
}

/// A managed cluster fenced off behind one gateway: two namespaces, `hub`
/// and `cluster`, joined by one veth pair. The hub holds `hub_addrs` on its
/// loopback; the cluster has `cluster_addr` on its end of the link and a
/// /32 route to `reachable` (addresses of the hub) and to nothing else, so
/// the hub's other addresses are unreachable from the cluster while every
/// process in the hub reaches all of them. No default route anywhere.
/// Interface names are per namespace, so any number of these coexist.
/// Both namespaces (and what runs in them) go on drop, also on a panic.
#[derive(Debug)]
pub struct FencedCluster {
    pub hub: String,
    pub cluster: String,
}

impl FencedCluster {
    /// Creates `<NETNS_PREFIX><id>-hub` and `<NETNS_PREFIX><id>-cluster`.
    pub fn create(
        id: &str,
        hub_addrs: &[Ipv4Addr],
        cluster_addr: Ipv4Addr,
        reachable: &[Ipv4Addr],
    ) -> Result<Self, NetnsError> {
        let fenced = FencedCluster {
            hub: format!("{NETNS_PREFIX}{id}-hub"),
            cluster: format!("{NETNS_PREFIX}{id}-cluster"),
        };
        // On an error `fenced` drops, removing what was created.
        let (hub, cluster) = (fenced.hub.as_str(), fenced.cluster.as_str());
        let cluster_ip = cluster_addr.to_string();
        for ns in [hub, cluster] {
            run(&["netns", "add", ns])?;
            run_in(ns, &["link", "set", "lo", "up"])?;
        }
        for addr in hub_addrs {
            run_in(hub, &["addr", "add", &format!("{addr}/32"), "dev", "lo"])?;
        }
        run_in(
            hub,
            &[
                "link", "add", "gw", "type", "veth", "peer", "name", "uplink", "netns", cluster,
            ],
        )?;
        run_in(hub, &["link", "set", "gw", "up"])?;
        run_in(
            hub,
            &["route", "add", &format!("{cluster_ip}/32"), "dev", "gw"],
        )?;
        run_in(
            cluster,
            &["addr", "add", &format!("{cluster_ip}/32"), "dev", "uplink"],
        )?;
        run_in(cluster, &["link", "set", "uplink", "up"])?;
        for addr in reachable {
            run_in(
                cluster,
                &[
                    "route",
                    "add",
                    &format!("{addr}/32"),
                    "dev",
                    "uplink",
                    "src",
                    &cluster_ip,
                ],
            )?;
        }
        Ok(fenced)
    }
}

impl Drop for FencedCluster {
    fn drop(&mut self) {
        remove_netns(&self.cluster);
        remove_netns(&self.hub);
    }
}

/// The namespaces of this crate that exist now.
pub fn existing() -> Vec<String> {
    let Ok(out) = run(&["netns", "list"]) else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| name.starts_with(NETNS_PREFIX))
        .map(str::to_string)
        .collect()
}

/// Kills every process in the namespace and deletes it.
pub fn remove_netns(name: &str) {
    if let Ok(out) = run(&["netns", "pids", name]) {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
    let _ = run(&["netns", "del", name]);
}

/// Whether a 198.18.<slot>.0/24 is free on this machine (no address of ours
/// in the host namespace uses it).
pub fn slot_is_free(slot: u8) -> bool {
    let Ok(out) = run(&["-o", "-4", "addr", "show"]) else {
        return false;
    };
    let needle = format!(" 198.18.{slot}.");
    !String::from_utf8_lossy(&out.stdout).contains(&needle)
}

/// Runs `work` on a thread of its own that has entered network namespace
/// `name`: sockets made there belong to that namespace for good, whatever
/// thread then uses them. The thread ends with `work`, so no other code
/// ever runs in the namespace by accident (a test runs a client there on a
/// runtime of that thread's own, so that all its connections start there).
pub fn in_namespace<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let path = format!("/var/run/netns/{name}");
    let namespace = std::fs::File::open(&path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("network namespace {path}: {e}")))?;
    std::thread::Builder::new()
        .name(format!("netns-{name}"))
        .spawn(move || {
            nix::sched::setns(&namespace, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| std::io::Error::other(format!("entering {path}: {e}")))?;
            work()
        })?
        .join()
        .map_err(|_| std::io::Error::other("the network-namespace thread panicked"))?
}

/// A TCP listener bound to `addr` inside network namespace `name`.
pub fn listen_in(name: &str, addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    in_namespace(name, move || std::net::TcpListener::bind(addr))
}

/// A connection to `addr` made from inside network namespace `name` (what
/// a process there would dial), for async use.
pub async fn connect_in(
    name: String,
    addr: std::net::SocketAddr,
) -> std::io::Result<tokio::net::TcpStream> {
    const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
    let stream = tokio::task::spawn_blocking(move || {
        in_namespace(&name, move || {
            let stream = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
            stream.set_nonblocking(true)?;
            Ok(stream)
        })
    })
    .await
    .map_err(|e| std::io::Error::other(format!("the dialling task: {e}")))??;
    tokio::net::TcpStream::from_std(stream)
}

/// Where a managed cluster's processes live.
#[derive(Debug, Clone)]
pub struct Machine {
    /// The cluster's own network namespace, if it has one.
    pub netns: Option<String>,
    /// Where its services (and its agent's ports) listen.
    pub service_ip: IpAddr,
}
