//! Benchmark: how many agents one proxy-server replica holds.
//!
//! ```sh
//! cargo run --release -p e2e --example agents_scale
//! # 10,000 agents: every idle connection a gRPC stream (no server descriptor each)
//! CP_SCALE_AGENTS=10000 CP_SCALE_IDLE=0 CP_SCALE_IDLE_GRPC=2 CP_SCALE_DIALERS=1 \
//!     nice cargo run --release -p e2e --example agents_scale
//! ```
//!
//! One proxy-server binary runs as a child process (so its RSS, CPU and
//! open descriptors are its own, from `/proc`). `CP_SCALE_AGENTS` (2000)
//! proxy-agents, each with its own certificate and cluster name, run in
//! `CP_SCALE_AGENT_PROCS` agent-host processes (one per 2,000 agents by
//! default): this example executes itself again for each, with
//! `CP_SCALE_AGENT_HOST` set, and each host runs its share of the agents
//! and an echo target on a loopback address of its own
//! (`127.0.1.<host + 1>`, one port for all) that its clusters' names
//! resolve to. One process cannot hold 10,000 agents here: each agent takes
//! a tunnel and two local listeners (health, admin), and each idle
//! connection two more descriptors (the agent's socket to the target and
//! the target's), against a 20,000 open-file limit per process.
//!
//! Each agent then carries `CP_SCALE_IDLE` (2) idle tunneled connections
//! through HTTP CONNECT (a new mTLS connection each, a 1-byte echo, then
//! held open) and `CP_SCALE_IDLE_GRPC` (0) as gRPC streams on held client
//! connections (`CP_SCALE_STREAMS_PER_CLIENT`, 500, streams on each). In
//! the server, an agent costs one descriptor (its tunnel), an idle CONNECT
//! connection one (the client's TCP connection; the agent's side rides the
//! tunnel), an idle gRPC stream none (it shares its client's connection).
//! Before opening them, the example checks that the server's descriptors
//! will fit its open-file limit and stops with a message if they would not.
//!
//! With all of that held, `CP_SCALE_DIALS` (2000) dials, 4 at a time, each
//! a 1-byte echo, run twice on each frontend: first all to one cluster (the
//! baseline, measured in the same run), then to every cluster in turn.
//! HTTP CONNECT pays a new mTLS connection per dial; gRPC dials on one held
//! client connection, as a hub controller does.
//!
//! Reported: the time from starting every agent at once to every tunnel up;
//! the server's RSS and open descriptors with no agent, with every agent
//! connected, and with each kind of idle connection (per agent and per
//! connection); per phase the dials' latency p50/p99/max, the server's CPU
//! per dial and that of this process and the agent hosts together (client,
//! agents and targets); the p99 ratio of all clusters to the baseline. With
//! every dial's processes on two cores, a dial waits for the CPU the others
//! in flight take: `CP_SCALE_DIALERS=1` measures a dial's latency without
//! that queue.
//!
//! Knobs: `CP_SCALE_AGENTS` (2000); `CP_SCALE_AGENT_PROCS` (agents ÷ 2,000,
//! rounded up); `CP_SCALE_IDLE` (2) and `CP_SCALE_IDLE_GRPC` (0) idle
//! connections per agent; `CP_SCALE_STREAMS_PER_CLIENT` (500);
//! `CP_SCALE_DIALS` (2000); `CP_SCALE_DIALERS` (4) dials at once in the
//! dial phases; `CP_SCALE_PARALLEL` (50) idle connections opened at once;
//! `CP_SCALE_SERVER_BIN=<path>` runs that proxy-server instead of building
//! every workspace binary (`cargo build --release -p proxy-server`);
//! `CP_SCALE_SERVER_LOG=<file>` and `CP_SCALE_SERVER_RUST_LOG=<filter>` keep
//! the server's log; `CP_SCALE_STORM=restart|outage`, `CP_SCALE_OUTAGE_SECS`
//! and `CP_SCALE_REPLICAS` (1 or 2) end the run with a reconnect storm
//! (see `storm.rs`). Every stage of a connection (TCP, TLS, the CONNECT
//! answer, the echo) has a 30 s limit, and a failure prints the server's
//! metrics.
//!
//! Found with it (2026-11-23): with 200 agents and 50 CONNECTs at once,
//! about one run in five had a connection whose first byte never reached
//! the agent. `ss` showed the byte had never left this process: tokio's
//! cooperative budget had run out, the TLS stream kept the byte, and
//! nothing flushed it. The same hazard was in the server's CONNECT relay
//! (fixed; regression test `tunnel::connect_delivers_the_tail_of_a_burst_to_a_slow_reader`).

mod storm;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use cert_authority::files::Layout;
use cert_authority::tls::{Identity, Pem};
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11};
use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::targets::EchoServer;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tunnel_harness::in_process::{ServerPorts, proxy_server_args};
use tunnel_harness::loadgen::{knob, process_usage};
use tunnel_harness::pki::TestPki;

/// Set in an agent host's environment: its index.
const AGENT_HOST: &str = "CP_SCALE_AGENT_HOST";
/// Each agent's health and admin ports in a host: from here, two apiece.
const LISTENER_PORT_BASE: usize = 12000;
/// Agents per host unless `CP_SCALE_AGENT_PROCS` says otherwise.
const AGENTS_PER_HOST: usize = 2000;

/// The soft open-file limit of process `pid` (`/proc/<pid>/limits`).
fn open_file_limit(pid: u32) -> anyhow::Result<usize> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|soft| soft.parse().ok())
        .ok_or_else(|| anyhow!("/proc/{pid}/limits: no open-file limit"))
}

/// Descriptors process `pid` holds open.
fn open_descriptors(pid: u32) -> anyhow::Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}

/// Raises this process's open-file limit to `wanted` if it is lower (and
/// the hard limit lets it), so the processes it starts inherit it.
fn raise_open_file_limit(wanted: usize) {
    if open_file_limit(std::process::id()).is_ok_and(|now| now >= wanted) {
        return;
    }
    let pid = std::process::id().to_string();
    let limit = format!("--nofile={wanted}:{wanted}");
    match std::process::Command::new("prlimit")
        .args(["--pid", &pid, &limit])
        .stderr(Stdio::null())
        .status()
    {
        Ok(status) if status.success() => {}
        other => eprintln!(
            "could not raise the open-file limit to {wanted} ({other:?}); more agent hosts (CP_SCALE_AGENT_PROCS) or fewer idle connections if descriptors run out"
        ),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

async fn open_echoed(
    tls: Arc<rustls::ClientConfig>,
    server: SocketAddr,
    target: &str,
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let stage =
        |what: &'static str| move |_| anyhow!("{target}: no progress within 30 s in {what}");
    let limit = Duration::from_secs(30);
    let tcp = tokio::time::timeout(limit, tokio::net::TcpStream::connect(server))
        .await
        .map_err(stage("TCP connect"))??;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let mut stream = tokio::time::timeout(
        limit,
        tokio_rustls::TlsConnector::from(tls).connect(name, tcp),
    )
    .await
    .map_err(stage("TLS handshake"))??;
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    stream.flush().await?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(limit, stream.read(&mut byte))
            .await
            .map_err(stage("reading the CONNECT answer"))??;
        if n == 0 {
            return Err(anyhow!(
                "{target}: closed: {}",
                String::from_utf8_lossy(&head)
            ));
        }
        head.push(byte[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        return Err(anyhow!("{target}: {}", String::from_utf8_lossy(&head)));
    }
    stream.write_all(b"x").await?;
    stream.flush().await?;
    let mut back = [0u8; 1];
    tokio::time::timeout(limit, stream.read_exact(&mut back))
        .await
        .map_err(stage("the echo"))??;
    Ok(stream)
}

/// A gRPC dial to `target` on `client` and a 1-byte echo through it,
/// the echo within `limit`; the stream stays open for the caller.
pub(crate) async fn grpc_echoed(
    client: &cluster_proxy_proto::client::TunnelClient,
    target: &str,
    limit: Duration,
) -> anyhow::Result<cluster_proxy_proto::client::TunnelStream> {
    let mut stream = client
        .dial(target)
        .await
        .with_context(|| format!("{target}: gRPC dial"))?;
    stream.write_all(b"x").await?;
    let mut back = [0u8; 1];
    tokio::time::timeout(limit, stream.read_exact(&mut back))
        .await
        .map_err(|_| anyhow!("{target}: no echo within {limit:?}"))??;
    Ok(stream)
}

/// Dial latencies of one phase and the CPU it took.
struct Latencies {
    sorted: Vec<Duration>,
    server_cpu: f64,
    /// This process's and the agent hosts': the client, the agents and the targets.
    local_cpu: f64,
}

impl Latencies {
    fn p99(&self) -> Duration {
        percentile(&self.sorted, 0.99)
    }

    fn describe(&self) -> String {
        format!(
            "p50 {} p99 {} max {}; CPU per dial: server {:.0} µs, client + agents + targets {:.0} µs",
            ms(percentile(&self.sorted, 0.5)),
            ms(self.p99()),
            ms(self.sorted.last().copied().unwrap_or_default()),
            self.server_cpu * 1e6 / self.sorted.len().max(1) as f64,
            self.local_cpu * 1e6 / self.sorted.len().max(1) as f64,
        )
    }
}

/// How a dial phase runs: `count` dials to the echo targets' `port`,
/// `dialers` at a time, the server's CPU read from `server_pid`, the
/// client's, agents' and targets' from `local_pids`.
struct Plan {
    port: u16,
    count: usize,
    dialers: usize,
    server_pid: u32,
    local_pids: Vec<u32>,
}

impl Plan {
    fn local_cpu(&self) -> anyhow::Result<f64> {
        let mut total = 0.0;
        for pid in &self.local_pids {
            total += process_usage(*pid)?.cpu_seconds;
        }
        Ok(total)
    }
}

/// One dial phase over both frontends: HTTP CONNECT (a new mTLS connection
/// per dial) and gRPC (a dial on the held client connection).
struct Dials {
    connect: Latencies,
    grpc: Latencies,
}

impl Dials {
    async fn run(
        tls: &Arc<rustls::ClientConfig>,
        grpc: &cluster_proxy_proto::client::TunnelClient,
        client_addr: SocketAddr,
        clusters: &[String],
        plan: &Plan,
    ) -> anyhow::Result<Dials> {
        let connect = Self::phase(clusters, plan, |target| {
            let tls = tls.clone();
            async move {
                open_echoed(tls, client_addr, &target).await?;
                Ok(())
            }
        })
        .await?;
        let grpc = Self::phase(clusters, plan, |target| async move {
            grpc_echoed(grpc, &target, Duration::from_secs(30)).await?;
            Ok(())
        })
        .await?;
        Ok(Dials { connect, grpc })
    }

    async fn phase<F, Fut>(clusters: &[String], plan: &Plan, dial: F) -> anyhow::Result<Latencies>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        let (port, count, dialers, server_pid) =
            (plan.port, plan.count, plan.dialers, plan.server_pid);
        let cpu_before = process_usage(server_pid)?.cpu_seconds;
        let local_before = plan.local_cpu()?;
        let per_dialer = count / dialers;
        let running = (0..dialers).map(|dialer| {
            let dial = &dial;
            async move {
                let mut latencies = Vec::with_capacity(per_dialer);
                for i in 0..per_dialer {
                    let cluster = &clusters[(dialer + i * dialers) % clusters.len()];
                    let dialed = Instant::now();
                    dial(format!("{cluster}:{port}")).await?;
                    latencies.push(dialed.elapsed());
                }
                anyhow::Ok(latencies)
            }
        });
        let mut sorted: Vec<Duration> = futures_util::future::try_join_all(running)
            .await?
            .into_iter()
            .flatten()
            .collect();
        sorted.sort();
        Ok(Latencies {
            sorted,
            server_cpu: process_usage(server_pid)?.cpu_seconds - cpu_before,
            local_cpu: plan.local_cpu()? - local_before,
        })
    }

    fn print(&self, label: &str) {
        println!("  {label}: CONNECT {}", self.connect.describe());
        println!("  {label}: gRPC    {}", self.grpc.describe());
    }
}

/// The loopback address agent host `index` serves its echo target on; its
/// clusters' names resolve to it.
fn host_address(index: usize) -> anyhow::Result<IpAddr> {
    let last = u8::try_from(index + 1)
        .ok()
        .filter(|b| *b < 255)
        .ok_or_else(|| anyhow!("at most 254 agent hosts"))?;
    Ok(IpAddr::from([127, 0, 1, last]))
}

/// What an agent host needs to know, passed in its environment.
struct HostPlan {
    index: usize,
    certs: PathBuf,
    first: usize,
    count: usize,
    agent_port: u16,
    echo_port: u16,
    /// With a storm: every replica's agent port, behind a balancer of the host's own.
    balanced: Option<String>,
}

impl HostPlan {
    fn from_env(index: usize) -> anyhow::Result<Self> {
        let var = |name: &str| std::env::var(name).with_context(|| format!("{name} unset"));
        Ok(HostPlan {
            index,
            certs: PathBuf::from(var("CP_SCALE_HOST_CERTS")?),
            first: var("CP_SCALE_HOST_FIRST")?.parse()?,
            count: var("CP_SCALE_HOST_COUNT")?.parse()?,
            agent_port: var("CP_SCALE_HOST_AGENT_PORT")?.parse()?,
            echo_port: var("CP_SCALE_HOST_ECHO_PORT")?.parse()?,
            balanced: std::env::var("CP_SCALE_HOST_BALANCED").ok(),
        })
    }

    fn command(&self, exe: &Path) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(exe);
        command
            .env(AGENT_HOST, self.index.to_string())
            .env("CP_SCALE_HOST_CERTS", &self.certs)
            .env("CP_SCALE_HOST_FIRST", self.first.to_string())
            .env("CP_SCALE_HOST_COUNT", self.count.to_string())
            .env("CP_SCALE_HOST_AGENT_PORT", self.agent_port.to_string())
            .env("CP_SCALE_HOST_ECHO_PORT", self.echo_port.to_string());
        if let Some(ports) = &self.balanced {
            command.env("CP_SCALE_HOST_BALANCED", ports);
        }
        command
    }
}

/// An agent host: loads its agents' certificates, serves its echo target,
/// says `ready`; on `go` starts every agent, says `connected <seconds>`
/// once each holds its tunnel; then answers the storm's commands (see
/// [`host_command`]); on the end of its input shuts the agents down.
async fn agent_host(plan: HostPlan) -> anyhow::Result<()> {
    // With a storm, the agents reach the replicas through a balancer whose
    // gate stands in for the network.
    let (agent_port, gate) = match &plan.balanced {
        Some(ports) => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let port = listener.local_addr()?.port();
            let gate = simulated_cluster::balancer::Gate::default();
            tokio::spawn(simulated_cluster::balancer::serve_gated(
                listener,
                simulated_cluster::balancer::Backends::new(storm::parse_ports(ports)?),
                simulated_cluster::balancer::Selection::Random,
                gate.clone(),
            ));
            (port, Some(gate))
        }
        None => (plan.agent_port, None),
    };
    let layout = Layout::new(&plan.certs);
    let roots = cert_authority::tls::roots(&Pem::file("CA certificate", &layout.ca().cert)?)?;
    let address = host_address(plan.index)?;
    let echo = EchoServer::on(tokio::net::TcpListener::bind((address, plan.echo_port)).await?)?;
    let mut agents_tls = Vec::with_capacity(plan.count);
    for i in plan.first..plan.first + plan.count {
        let cluster = ClusterName::new(format!("cluster-{i}"))?;
        let pair = layout.agent(&cluster);
        let identity = Identity::from_files(&pair.cert, &pair.key)?;
        let tls = cert_authority::tls::client_config(roots.clone(), Some(identity), &[ALPN_H2])?;
        agents_tls.push((cluster.as_str().to_owned(), tls));
    }
    let mut input = BufReader::new(tokio::io::stdin()).lines();
    println!("ready");
    if input.next_line().await?.as_deref() != Some("go") {
        return Ok(());
    }
    let started = Instant::now();
    let mut agents = Vec::with_capacity(plan.count);
    for (c, chunk) in agents_tls.chunks(100).enumerate() {
        let starts = chunk
            .iter()
            .enumerate()
            .map(|(i, (cluster, tls))| async move {
                let mut config =
                    proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Config(tls.clone()))
                        .with_ephemeral_ports();
                // Each agent's health and admin listeners on the host's own
                // address, on ports below the kernel's ephemeral range: 20,000
                // listeners on ephemeral ports of 127.0.0.1 leave too few ports
                // for the tunnels' and targets' connections (bind fails with
                // "Address already in use").
                let n = c * 100 + i;
                if let Some(port) = u16::try_from(LISTENER_PORT_BASE + 2 * n)
                    .ok()
                    .filter(|p| *p < 32767)
                {
                    config.health_server_host = address.to_string();
                    config.health_server_port = port;
                    config.admin_bind_address = address.to_string();
                    config.admin_server_port = port + 1;
                }
                config.proxy_server_host = "localhost".into();
                config.proxy_server_port = agent_port;
                config.agent_id = format!("{cluster}-agent");
                config.agent_identifiers = format!("host={cluster}");
                config.host_aliases.insert(cluster.clone(), address);
                anyhow::Ok(proxy_agent::start(config).await?)
            });
        agents.extend(futures_util::future::try_join_all(starts).await?);
    }
    let want = plan.balanced.as_deref().map_or(1, |p| p.split(',').count());
    for agent in &agents {
        if !agent.wait_for_tunnels(want, Duration::from_secs(120)).await {
            println!("failed {} did not connect", agent.agent_id());
            return Ok(());
        }
    }
    println!("connected {:.3}", started.elapsed().as_secs_f64());
    while let Some(line) = input.next_line().await? {
        println!("{}", host_command(&line, &agents, gate.as_ref()).await);
    }
    for agent in agents {
        agent.shutdown().await;
    }
    drop(echo);
    Ok(())
}

/// The answer to one of the storm's commands: `shut` and `open` the gate;
/// `lost <n>`: when every agent holds fewer than `n` tunnels; `await <n>`:
/// when each holds `n` again (`back <ms since the epoch, per agent>`);
/// `attempts`: the gate's connection attempts per 100 ms.
async fn host_command(
    line: &str,
    agents: &[proxy_agent::RunningAgent],
    gate: Option<&simulated_cluster::balancer::Gate>,
) -> String {
    let mut words = line.split_whitespace();
    let (command, count) = (words.next(), words.next().and_then(|n| n.parse().ok()));
    let limit = Duration::from_secs(600);
    match (command, count, gate) {
        (Some("shut"), _, Some(gate)) => {
            gate.shut();
            "shut".to_owned()
        }
        (Some("open"), _, Some(gate)) => {
            gate.open();
            "open".to_owned()
        }
        (Some("attempts"), _, Some(gate)) => {
            format!("attempts {}", storm::format_attempts(&gate.attempts()))
        }
        (Some("lost"), Some(n), _) => {
            let times = storm::watch_agents(agents, |held| held < n, limit).await;
            let left = times.iter().filter(|t| t.is_none()).count();
            format!("lost {left}")
        }
        (Some("await"), Some(n), _) => {
            let times = storm::watch_agents(agents, |held| held >= n, limit).await;
            format!("back {}", storm::format_back(&times))
        }
        _ => format!("unknown command {line:?} (without a balancer: only lost and await)"),
    }
}

/// An agent host as the parent sees it.
struct Host {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    pid: u32,
}

impl Host {
    fn spawn(plan: &HostPlan, exe: &Path) -> anyhow::Result<Host> {
        let mut child = plan
            .command(exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().ok_or_else(|| anyhow!("agent host exited"))?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("agent host without stdout"))?;
        Ok(Host {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            pid,
        })
    }

    /// The host's next line, which must start with `expected`; returns the rest.
    async fn expect(&mut self, expected: &str) -> anyhow::Result<String> {
        let line = tokio::time::timeout(Duration::from_secs(600), self.lines.next_line())
            .await
            .map_err(|_| anyhow!("agent host {} silent for 10 min", self.pid))??
            .ok_or_else(|| anyhow!("agent host {} exited", self.pid))?;
        line.strip_prefix(expected)
            .map(|rest| rest.trim().to_owned())
            .ok_or_else(|| anyhow!("agent host {}: {line}", self.pid))
    }

    async fn send(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow!("agent host's input closed"))?;
        stdin.write_all(format!("{line}\n").as_bytes()).await?;
        stdin.flush().await?;
        Ok(())
    }
}

/// A proxy-server replica as a child process, which can be killed and
/// started again on the same ports.
pub(crate) struct ServerProcess {
    bin: PathBuf,
    args: Vec<String>,
    ports: ServerPorts,
    child: tokio::process::Child,
    pub(crate) pid: u32,
}

impl ServerProcess {
    async fn spawn(bin: &Path, args: Vec<String>, ports: ServerPorts) -> anyhow::Result<Self> {
        let child = Self::start(bin, &args)?;
        let pid = child.id().ok_or_else(|| anyhow!("proxy-server exited"))?;
        let server = ServerProcess {
            bin: bin.to_owned(),
            args,
            ports,
            child,
            pid,
        };
        server.wait_listening().await?;
        Ok(server)
    }

    fn start(bin: &Path, args: &[String]) -> anyhow::Result<tokio::process::Child> {
        Ok(tokio::process::Command::new(bin)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("CP_SCALE_SERVER_RUST_LOG").unwrap_or_default(),
            )
            .stdout(Stdio::null())
            .stderr(match std::env::var_os("CP_SCALE_SERVER_LOG") {
                Some(file) => Stdio::from(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(file)?,
                ),
                None => Stdio::null(),
            })
            .kill_on_drop(true)
            .spawn()?)
    }

    async fn wait_listening(&self) -> anyhow::Result<()> {
        let listening = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", self.ports.health))
            .await
            .is_err()
        {
            if listening.elapsed() > Duration::from_secs(30) {
                bail!("proxy-server did not listen within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGKILL, and wait until it is gone.
    pub(crate) async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// Started again with the same flags, once it listens.
    pub(crate) async fn respawn(&mut self) -> anyhow::Result<()> {
        self.child = Self::start(&self.bin, &self.args)?;
        self.pid = self
            .child
            .id()
            .ok_or_else(|| anyhow!("proxy-server exited"))?;
        self.wait_listening().await
    }

    pub(crate) fn client_addr(&self) -> SocketAddr {
        self.ports.client_addr()
    }

    pub(crate) fn health_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.ports.health))
    }
}

/// The server's metrics on stderr, after a failure.
async fn print_server_metrics(health_port: u16) {
    if let Ok((_, metrics)) = tunnel_harness::in_process::health_get(
        SocketAddr::from(([127, 0, 0, 1], health_port)),
        "/metrics",
    )
    .await
    {
        for line in metrics.lines().filter(|l| !l.starts_with('#')) {
            eprintln!("server: {line}");
        }
    }
}

/// The server's RSS and open descriptors at one stage.
#[derive(Clone, Copy)]
struct Stage {
    rss_mib: f64,
    descriptors: usize,
}

impl Stage {
    async fn settled(pid: u32) -> anyhow::Result<Stage> {
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(Stage {
            rss_mib: process_usage(pid)?.rss_mib,
            descriptors: open_descriptors(pid)?,
        })
    }

    /// What `self` adds over `before`, per one of `n`.
    fn per(&self, before: &Stage, n: usize) -> String {
        let n = n.max(1) as f64;
        format!(
            "+{:.1} KiB and {:.2} descriptors each",
            (self.rss_mib - before.rss_mib) * 1024.0 / n,
            (self.descriptors as f64 - before.descriptors as f64) / n
        )
    }
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    match std::env::var(AGENT_HOST) {
        Ok(index) => runtime.block_on(agent_host(HostPlan::from_env(index.parse()?)?)),
        Err(_) => runtime.block_on(run()),
    }
}

async fn run() -> anyhow::Result<()> {
    let agent_count = knob("CP_SCALE_AGENTS", 2000).max(1);
    let idle_connect = knob("CP_SCALE_IDLE", 2);
    let idle_grpc = knob("CP_SCALE_IDLE_GRPC", 0);
    let streams_per_client = knob("CP_SCALE_STREAMS_PER_CLIENT", 500).max(1);
    let dial_count = knob("CP_SCALE_DIALS", 2000);
    let dialers = knob("CP_SCALE_DIALERS", 4).max(1);
    let parallel = knob("CP_SCALE_PARALLEL", 50).max(1);
    let storm = storm::Storm::from_env()?;
    let replicas = if storm.is_some() {
        knob("CP_SCALE_REPLICAS", 1).clamp(1, 2)
    } else {
        1
    };
    // Behind a host's balancer each tunnel takes three descriptors there
    // (the agent's socket and both of the balancer's), so hosts hold fewer.
    let per_host_default = if storm.is_some() {
        AGENTS_PER_HOST / 2
    } else {
        AGENTS_PER_HOST
    };
    let host_count = knob(
        "CP_SCALE_AGENT_PROCS",
        agent_count.div_ceil(per_host_default),
    )
    .clamp(1, agent_count);
    // This process holds each idle CONNECT connection's client end; each
    // host, per agent, its two listeners, its tunnels (three descriptors
    // each behind a balancer) and two per idle connection.
    let per_host = agent_count.div_ceil(host_count);
    let per_tunnel = if storm.is_some() { 3 } else { 1 };
    raise_open_file_limit(
        (agent_count * idle_connect)
            .max(per_host * (2 + per_tunnel * replicas + 2 * (idle_connect + idle_grpc)))
            + 4096,
    );

    let server_bin = match std::env::var_os("CP_SCALE_SERVER_BIN") {
        Some(path) => PathBuf::from(path),
        None => {
            tokio::task::spawn_blocking(|| Binaries::build(Progress::Quiet))
                .await??
                .proxy_server
        }
    };
    let names: Vec<String> = (0..agent_count).map(|i| format!("cluster-{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let started = Instant::now();
    let pki = TestPki::new(&refs)?;
    let certs = tempfile::tempdir()?;
    let layout = pki.write(certs.path())?;
    eprintln!(
        "{agent_count} agent certificates in {:.1?}",
        started.elapsed()
    );
    let mut servers = Vec::with_capacity(replicas);
    for replica in 0..replicas {
        let ports = ServerPorts::free();
        let mut args = proxy_server_args(&format!("scale-{replica}"), &ports, &layout);
        args.push(format!("--server-count={replicas}"));
        servers.push(ServerProcess::spawn(&server_bin, args, ports).await?);
    }
    let (client_port, agent_port, health_port) = {
        let ports = &servers[0].ports;
        (ports.client, ports.agent, ports.health)
    };
    let pid = servers[0].pid;
    let client_addr: SocketAddr = format!("127.0.0.1:{client_port}").parse()?;
    let server_limit = open_file_limit(pid)?;
    let grpc_clients = (agent_count * idle_grpc).div_ceil(streams_per_client);
    // One descriptor per agent tunnel and per idle CONNECT connection, one
    // per held gRPC client connection and per dial in flight, and the
    // server's own (listeners, epoll, its log): 64 are plenty.
    let projected = agent_count * (1 + idle_connect) + grpc_clients + 2 * dialers + 64;
    if projected > server_limit {
        bail!(
            "the server would need about {projected} descriptors ({agent_count} agent tunnels, {} idle CONNECT connections, {grpc_clients} gRPC client connections) against its open-file limit of {server_limit}: carry idle connections as gRPC streams (CP_SCALE_IDLE=0 CP_SCALE_IDLE_GRPC=2) or lower CP_SCALE_IDLE",
            agent_count * idle_connect
        );
    }
    let empty = Stage::settled(pid).await?;

    // The echo targets' port: free on 127.0.0.1, and so (as good as
    // certain) on each host's own loopback address; held here so no one
    // else takes it meanwhile.
    let echo_port_holder = std::net::TcpListener::bind("127.0.0.1:0")?;
    let echo_port = echo_port_holder.local_addr()?.port();
    let exe = std::env::current_exe()?;
    let mut hosts = Vec::with_capacity(host_count);
    for index in 0..host_count {
        let first = index * per_host;
        let count = per_host.min(agent_count.saturating_sub(first));
        if count == 0 {
            break;
        }
        let plan = HostPlan {
            index,
            certs: certs.path().to_owned(),
            first,
            count,
            agent_port,
            echo_port,
            balanced: storm.map(|_| {
                servers
                    .iter()
                    .map(|s| s.ports.agent.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            }),
        };
        hosts.push(Host::spawn(&plan, &exe)?);
    }
    for host in &mut hosts {
        host.expect("ready").await?;
    }
    let started = Instant::now();
    for host in &mut hosts {
        host.send("go").await?;
    }
    let mut per_host_secs = Vec::with_capacity(hosts.len());
    for host in &mut hosts {
        per_host_secs.push(host.expect("connected").await?);
    }
    let connected = started.elapsed();
    eprintln!(
        "{agent_count} agents in {} hosts connected in {connected:.1?} (each host: {} s)",
        hosts.len(),
        per_host_secs.join(", ")
    );
    let with_agents = Stage::settled(pid).await?;

    let tls = pki.client_tls_alpn(&[ALPN_HTTP11])?;
    let started = Instant::now();
    let mut idle = Vec::with_capacity(agent_count * idle_connect);
    for round in 0..idle_connect {
        for chunk in names.chunks(parallel) {
            let opens = chunk.iter().map(|cluster| {
                let tls = tls.clone();
                let target = format!("{cluster}:{echo_port}");
                async move { open_echoed(tls, client_addr, &target).await }
            });
            match futures_util::future::try_join_all(opens).await {
                Ok(opened) => idle.extend(opened),
                Err(e) => {
                    print_server_metrics(health_port).await;
                    return Err(e.context(format!("idle CONNECT connections, round {round}")));
                }
            }
        }
    }
    let opened_connect = started.elapsed();
    let with_connect = Stage::settled(pid).await?;

    let started = Instant::now();
    let mut clients = Vec::with_capacity(grpc_clients);
    for _ in 0..grpc_clients {
        clients
            .push(tunnel_harness::in_process::tunnel_client(pki.client_tls()?, client_addr).await?);
    }
    let mut streams = Vec::with_capacity(agent_count * idle_grpc);
    for round in 0..idle_grpc {
        for (c, chunk) in names.chunks(parallel).enumerate() {
            let opens = chunk.iter().enumerate().map(|(i, cluster)| {
                let n = round * agent_count + c * parallel + i;
                let client = &clients[n / streams_per_client];
                let target = format!("{cluster}:{echo_port}");
                async move { grpc_echoed(client, &target, Duration::from_secs(30)).await }
            });
            match futures_util::future::try_join_all(opens).await {
                Ok(opened) => streams.extend(opened),
                Err(e) => {
                    print_server_metrics(health_port).await;
                    return Err(e.context(format!("idle gRPC streams, round {round}")));
                }
            }
        }
    }
    let opened_grpc = started.elapsed();
    let with_grpc = Stage::settled(pid).await?;

    // One held gRPC connection, as a hub controller holds it.
    let grpc = tunnel_harness::in_process::tunnel_client(pki.client_tls()?, client_addr).await?;
    let mut local_pids = vec![std::process::id()];
    local_pids.extend(hosts.iter().map(|h| h.pid));
    let plan = Plan {
        port: echo_port,
        count: dial_count,
        dialers,
        server_pid: pid,
        local_pids,
    };
    let baseline = Dials::run(&tls, &grpc, client_addr, &names[..1], &plan).await?;
    let loaded = Dials::run(&tls, &grpc, client_addr, &names, &plan).await?;
    let after = Stage::settled(pid).await?;

    println!(
        "one proxy-server (child process, open-file limit {server_limit}); {agent_count} agents with their own certificates in {} agent-host processes; per agent {idle_connect} idle CONNECT connections ({} in all) and {idle_grpc} idle gRPC streams ({} in all, on {grpc_clients} client connections)",
        hosts.len(),
        idle.len(),
        streams.len(),
    );
    println!(
        "agents connected in {connected:.1?} (all started at once); idle connections opened in {opened_connect:.1?} (CONNECT), {opened_grpc:.1?} (gRPC)"
    );
    println!(
        "server RSS / descriptors: {:.1} MiB / {} empty; {:.1} MiB / {} with the agents ({}); {:.1} MiB / {} with the idle CONNECT connections ({}); {:.1} MiB / {} with the idle gRPC streams ({}); {:.1} MiB / {} after the dials",
        empty.rss_mib,
        empty.descriptors,
        with_agents.rss_mib,
        with_agents.descriptors,
        with_agents.per(&empty, agent_count),
        with_connect.rss_mib,
        with_connect.descriptors,
        with_connect.per(&with_agents, idle.len()),
        with_grpc.rss_mib,
        with_grpc.descriptors,
        with_grpc.per(&with_connect, streams.len()),
        after.rss_mib,
        after.descriptors,
    );
    println!(
        "dials, {dialers} at a time, each a 1-byte echo; first to one cluster with every agent connected (baseline), then to all {agent_count} clusters in turn:"
    );
    baseline.print("baseline, 1 cluster");
    loaded.print(&format!("{agent_count} clusters"));
    println!(
        "p99 ratio (all clusters / baseline): CONNECT {:.2}, gRPC {:.2}",
        loaded.connect.p99().as_secs_f64() / baseline.connect.p99().as_secs_f64().max(1e-9),
        loaded.grpc.p99().as_secs_f64() / baseline.grpc.p99().as_secs_f64().max(1e-9),
    );
    drop(streams);
    drop(clients);
    drop(idle);
    drop(grpc);
    if let Some(storm) = storm {
        let outage = std::env::var("CP_SCALE_OUTAGE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or_else(|| storm.default_outage(), Duration::from_secs);
        let targets = names.iter().map(|c| format!("{c}:{echo_port}")).collect();
        storm::run(
            storm,
            outage,
            &mut servers,
            &mut hosts,
            agent_count,
            targets,
            pki.client_tls()?,
        )
        .await?;
    }
    for mut host in hosts {
        let _ = host.child.kill().await;
    }
    drop(echo_port_holder);
    for mut server in servers {
        let _ = server.kill().await;
    }
    Ok(())
}
