//! Benchmark: what a forward proxy and the WebSocket transport cost the
//! tunnel (issue 53), as ratios to the direct path in the same run.
//!
//! ```sh
//! cargo run --release -p e2e --example agent_paths     # as root
//! ```
//!
//! The topology is `behind_proxy`'s: a hub and a cluster network namespace
//! joined by one veth pair. The proxy-server listens for agents on a hub
//! address, tinyproxy (HTTP CONNECT) and microsocks (SOCKS5) on another.
//! One proxy-agent per path runs in the cluster namespace, each its own
//! cluster, and they differ only in how they reach the agent port:
//!
//! | path | agent flags |
//! |---|---|
//! | direct, lean framing (the baseline) | none: TLS, ALPN picks our framing |
//! | direct, gRPC over HTTP/2 | `--lean-framing=false` (what upstream servers get) |
//! | direct, WebSocket | `--transport=websocket` |
//! | HTTP proxy, lean framing | `--proxy-url=http://…` |
//! | HTTP proxy, WebSocket | `--proxy-url=http://…` `--transport=websocket` |
//! | SOCKS5 proxy, lean framing | `--proxy-url=socks5h://…` |
//!
//! A gRPC tunnel client in the hub namespace (a held connection, as hub
//! controllers dial) measures through each: one connection's upload and
//! download throughput (`CP_PATHS_MIB`, 256 MiB), the round-trip time of a
//! 1-byte echo (`CP_PATHS_RTT`, 5,000) and connects/s, each a dial and a
//! 1-byte echo (`CP_PATHS_CONNECTS`, 1,000; sequential and 8 at a time).
//! The targets run in the cluster namespace. `CP_PATHS_ROUNDS` (5) rounds
//! visit the paths in a rotating order, so drift in the machine's speed
//! hits every path alike; each cell is the median of its per-round ratios
//! to the baseline in the same round, with their range. Also reported: the
//! agent's, the proxy's and the server's CPU time per path over all rounds,
//! and how long each agent took from its start to a held tunnel.
//!
//! The proxy's idle timeout is raised to 10 min here, so that a quiet
//! tunnel is not cut while the other paths are measured: what the proxy
//! costs, not what its timeout does (that is `behind_proxy`'s and the
//! WebSocket heartbeat's business).
//!
//! `CP_PATHS_QUICKACK=cluster,hub` turns off delayed ACKs on that side's
//! routes (see [`quick_acks`]), to see what they cost through a proxy.
//!
//! Needs root, `ip netns`, tinyproxy and microsocks (Debian packages; the
//! SOCKS5 path is left out without microsocks).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::identity::ClusterName;
use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::forward_proxy::{Tinyproxy, on_path};
use simulated_cluster::netns::{self, FencedCluster, connect_in, in_namespace};
use simulated_cluster::process::{Logs, ProcessSpec, Supervised};
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::until_ok;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{
    ServerPorts, health_get_over, proxy_agent_args_to, proxy_server_args_agents_on, tunnel_client,
};
use tunnel_harness::loadgen::{BulkServer, download, knob, process_usage, upload};
use tunnel_harness::pki::TestPki;

/// The proxies' address.
const PROXY_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The proxy-server's agent port.
const HUB_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
const SERVER_PORTS: ServerPorts = ServerPorts {
    client: 8090,
    agent: 8091,
    health: 8092,
    admin: 8093,
};
const HTTP_PROXY_PORT: u16 = 3128;
const SOCKS_PORT: u16 = 1080;
const WAIT: Duration = Duration::from_secs(30);

/// One way for an agent to reach the hub.
struct PathSpec {
    name: &'static str,
    /// Its agent's cluster (a DNS label).
    cluster: &'static str,
    /// Which proxy process carries it, if any.
    proxy: Option<&'static str>,
    args: Vec<String>,
}

fn paths(socks: bool) -> Vec<PathSpec> {
    let http_proxy = format!("--proxy-url=http://{PROXY_IP}:{HTTP_PROXY_PORT}");
    let websocket = "--transport=websocket".to_owned();
    let mut paths = vec![
        PathSpec {
            name: "direct, lean framing (baseline)",
            cluster: "direct-lean",
            proxy: None,
            args: Vec::new(),
        },
        PathSpec {
            name: "direct, gRPC over HTTP/2",
            cluster: "direct-h2",
            proxy: None,
            args: vec!["--lean-framing=false".to_owned()],
        },
        PathSpec {
            name: "direct, WebSocket",
            cluster: "direct-ws",
            proxy: None,
            args: vec![websocket.clone()],
        },
        PathSpec {
            name: "HTTP proxy, lean framing",
            cluster: "proxied-lean",
            proxy: Some("tinyproxy"),
            args: vec![http_proxy.clone()],
        },
        PathSpec {
            name: "HTTP proxy, WebSocket",
            cluster: "proxied-ws",
            proxy: Some("tinyproxy"),
            args: vec![http_proxy, websocket],
        },
    ];
    if socks {
        paths.push(PathSpec {
            name: "SOCKS5 proxy, lean framing",
            cluster: "socks-lean",
            proxy: Some("microsocks"),
            args: vec![format!("--proxy-url=socks5h://{PROXY_IP}:{SOCKS_PORT}")],
        });
    }
    paths
}

/// The figures, in table order; `higher` says which way is better.
const FIGURES: [(&str, bool); 6] = [
    ("1 conn up", true),
    ("1 conn down", true),
    ("RTT p50", false),
    ("RTT p99", false),
    ("connects/s", true),
    ("connects/s (8 parallel)", true),
];

struct Knobs {
    bytes: u64,
    round_trips: usize,
    connects: u64,
    rounds: usize,
}

fn main() -> anyhow::Result<()> {
    netns::availability().map_err(|why| anyhow!("agent_paths needs root and `ip netns`: {why}"))?;
    if !on_path("tinyproxy") {
        bail!("agent_paths needs tinyproxy (apt-get install tinyproxy)");
    }
    let socks = on_path("microsocks");
    if !socks {
        eprintln!("microsocks is not installed: the SOCKS5 path is left out");
    }
    let knobs = Knobs {
        bytes: knob("CP_PATHS_MIB", 256) as u64 * 1024 * 1024,
        round_trips: knob("CP_PATHS_RTT", 5_000),
        connects: knob("CP_PATHS_CONNECTS", 1_000) as u64,
        rounds: knob("CP_PATHS_ROUNDS", 5).max(1),
    };
    let paths = paths(socks);
    eprintln!("building the services (release)…");
    let binaries = Binaries::build(Progress::Quiet).context("building the services")?;

    let net = FencedCluster::create(
        &format!("ap{:04x}", rand::random::<u16>()),
        &[PROXY_IP, HUB_IP],
        CLUSTER_IP,
        &[PROXY_IP, HUB_IP],
    )
    .context("the network namespaces")?;
    quick_acks(&net)?;
    let dir = tempfile::tempdir()?;
    let logs = Logs::new(dir.path().join("logs"), false);
    let clusters: Vec<&str> = paths.iter().map(|p| p.cluster).collect();
    let pki = TestPki::with_server_sans(&clusters, &[&HUB_IP.to_string()])?;
    let pki_dir = dir.path().join("pki");
    std::fs::create_dir(&pki_dir)?;
    let layout = pki.write(&pki_dir)?;

    // The supervised processes' output is read on this runtime.
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    // Dropped before the namespaces, at the end.
    let mut processes: Vec<Supervised> = Vec::new();
    let in_hub = |spec: ProcessSpec| spec.in_netns(Some(net.hub.clone()));
    let in_cluster = |spec: ProcessSpec| spec.in_netns(Some(net.cluster.clone()));

    processes.push(Supervised::start(
        in_hub(
            ProcessSpec::new("proxy-server", &binaries.proxy_server).args(
                proxy_server_args_agents_on("hub", &SERVER_PORTS, HUB_IP.into(), &layout),
            ),
        ),
        &logs,
    )?);
    let mut proxy = Tinyproxy::new(SocketAddr::new(PROXY_IP.into(), HTTP_PROXY_PORT));
    proxy.idle_timeout_seconds = 600;
    processes.push(Supervised::start(
        in_hub(proxy.spec("tinyproxy", dir.path())?),
        &logs,
    )?);
    if socks {
        processes.push(Supervised::start(
            in_hub(
                ProcessSpec::new("microsocks", Path::new("microsocks")).args([
                    "-i".to_owned(),
                    PROXY_IP.to_string(),
                    "-p".to_owned(),
                    SOCKS_PORT.to_string(),
                ]),
            ),
            &logs,
        )?);
    }
    let hub_addresses = [
        SocketAddr::new(HUB_IP.into(), SERVER_PORTS.agent),
        SocketAddr::from(([127, 0, 0, 1], SERVER_PORTS.client)),
        SocketAddr::new(PROXY_IP.into(), HTTP_PROXY_PORT),
    ];
    for addr in hub_addresses {
        runtime
            .block_on(until_ok(&format!("{addr} listening"), WAIT, || {
                let hub = net.hub.clone();
                async move { connect_in(hub, addr).await.map_err(|e| e.to_string()) }
            }))
            .map_err(|e| anyhow!("{e}\n{}", all_logs(&processes, &logs)))?;
    }

    let targets = ClusterTargets::start(&net.cluster)?;

    let mut agents = Vec::new();
    let mut tunnel_up = Vec::new();
    for (index, path) in paths.iter().enumerate() {
        let health = 9100 + 2 * index as u16;
        let cluster = ClusterName::new(path.cluster)?;
        let mut spec = ProcessSpec::new(path.cluster, &binaries.proxy_agent)
            .args(proxy_agent_args_to(
                &cluster,
                path.cluster,
                SocketAddr::new(HUB_IP.into(), SERVER_PORTS.agent),
                (health, health + 1),
                &layout,
            ))
            .args(path.args.iter().cloned());
        for variable in ["HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY"] {
            spec = spec.env(variable, "").env(&variable.to_lowercase(), "");
        }
        let started = Instant::now();
        processes.push(Supervised::start(in_cluster(spec), &logs)?);
        agents.push(processes.len() - 1);
        let readyz = SocketAddr::from(([127, 0, 0, 1], health));
        runtime
            .block_on(until_ok(
                &format!("{} holding a tunnel", path.cluster),
                WAIT,
                || {
                    let cluster_ns = net.cluster.clone();
                    async move {
                        let tcp = connect_in(cluster_ns, readyz)
                            .await
                            .map_err(|e| e.to_string())?;
                        match health_get_over(tcp, "/readyz").await {
                            Ok((200, _)) => Ok(()),
                            Ok((status, body)) => Err(format!("/readyz {status}: {body}")),
                            Err(e) => Err(e.to_string()),
                        }
                    }
                },
            ))
            .map_err(|e| anyhow!("{e}\n{}", all_logs(&processes, &logs)))?;
        tunnel_up.push(started.elapsed());
    }

    let pid_of = |index: usize| {
        processes[index]
            .pid()
            .ok_or_else(|| anyhow!("{} is not running", processes[index].name()))
    };
    let server_pid = pid_of(0)?;
    let tinyproxy_pid = pid_of(1)?;
    let socks_pid = if socks { Some(pid_of(2)?) } else { None };
    let agent_pids: Vec<u32> = agents
        .iter()
        .map(|&i| pid_of(i))
        .collect::<Result<_, _>>()?;
    let proxy_pid = |path: &PathSpec| match path.proxy {
        Some("tinyproxy") => Some(tinyproxy_pid),
        Some(_) => socks_pid,
        None => None,
    };
    let proxy_pids: Vec<Option<u32>> = paths.iter().map(proxy_pid).collect();

    let pki_client = pki.client_tls()?;
    let names: Vec<&'static str> = paths.iter().map(|p| p.cluster).collect();
    let hub = net.hub.clone();
    println!(
        "agent paths, {} rounds; single transfers {} MiB, {} round trips, {} connects",
        knobs.rounds,
        knobs.bytes / (1024 * 1024),
        knobs.round_trips,
        knobs.connects
    );
    let measured = in_namespace(&hub, move || {
        // The client's runtime is built on this thread, so its worker
        // threads, and every socket they open, are in the hub namespace.
        let runtime = tokio::runtime::Runtime::new()?;
        runtime.block_on(measure(
            pki_client,
            &names,
            targets.ports,
            &knobs,
            Usage {
                server: server_pid,
                agents: agent_pids,
                proxies: proxy_pids,
            },
        ))
    })
    .map_err(|e| anyhow!("{e}\n{}", all_logs(&processes, &logs)))?;
    report(&paths, &measured, &tunnel_up);
    drop(targets);
    drop(processes);
    drop(net);
    Ok(())
}

/// The bulk and echo targets in the cluster namespace, on a runtime of
/// their own (on a thread there); stop when dropped.
struct ClusterTargets {
    /// (bulk, echo) ports on the cluster's loopback.
    ports: (u16, u16),
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl ClusterTargets {
    fn start(cluster_ns: &str) -> anyhow::Result<Self> {
        let (ports_tx, ports_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let ns = cluster_ns.to_owned();
        let thread = std::thread::spawn(move || {
            in_namespace(&ns, move || {
                let runtime = tokio::runtime::Runtime::new()?;
                runtime.block_on(async move {
                    let bulk = BulkServer::start().await?;
                    let echo = EchoServer::start().await?;
                    let _ = ports_tx.send((bulk.addr.port(), echo.addr.port()));
                    let _ = stopped.await;
                    Ok(())
                })
            })
        });
        let ports = ports_rx
            .recv_timeout(WAIT)
            .map_err(|_| anyhow!("the targets in the cluster namespace did not start"))?;
        Ok(ClusterTargets {
            ports,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for ClusterTargets {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The processes whose CPU time is charged to the path being measured.
struct Usage {
    server: u32,
    agents: Vec<u32>,
    proxies: Vec<Option<u32>>,
}

fn cpu_seconds(pid: u32) -> std::io::Result<f64> {
    Ok(process_usage(pid)?.cpu_seconds)
}

/// What [`measure`] found: `values[path][figure][round]` and the CPU
/// seconds `[agent, proxy, server]` spent while each path was measured.
struct Measured {
    values: Vec<Vec<Vec<f64>>>,
    cpu: Vec<[f64; 3]>,
}

async fn measure(
    tls: std::sync::Arc<rustls::ClientConfig>,
    clusters: &[&str],
    (bulk, echo): (u16, u16),
    knobs: &Knobs,
    usage: Usage,
) -> std::io::Result<Measured> {
    let client = tunnel_client(tls, SocketAddr::from(([127, 0, 0, 1], SERVER_PORTS.client)))
        .await
        .map_err(std::io::Error::other)?;
    let mut values = vec![vec![Vec::new(); FIGURES.len()]; clusters.len()];
    let mut cpu = vec![[0.0f64; 3]; clusters.len()];
    for round in 0..knobs.rounds {
        for offset in 0..clusters.len() {
            let p = (round + offset) % clusters.len();
            let cluster = clusters[p];
            let usage_now = |p: usize| -> std::io::Result<[f64; 3]> {
                Ok([
                    cpu_seconds(usage.agents[p])?,
                    usage.proxies[p].map_or(Ok(0.0), cpu_seconds)?,
                    cpu_seconds(usage.server)?,
                ])
            };
            let before = usage_now(p)?;
            let figures = one_round(&client, cluster, bulk, echo, knobs).await?;
            let after = usage_now(p)?;
            for (part, total) in cpu[p].iter_mut().enumerate() {
                *total += after[part] - before[part];
            }
            for (f, value) in figures.into_iter().enumerate() {
                values[p][f].push(value);
            }
        }
        eprintln!("round {} of {} done", round + 1, knobs.rounds);
    }
    Ok(Measured { values, cpu })
}

/// Every figure of [`FIGURES`] once, through `cluster`'s agent.
async fn one_round(
    client: &TunnelClient,
    cluster: &str,
    bulk: u16,
    echo: u16,
    knobs: &Knobs,
) -> std::io::Result<Vec<f64>> {
    let dial = |port: u16| {
        let address = format!("{cluster}:{port}");
        async move {
            client
                .dial(&address)
                .await
                .map_err(|e| std::io::Error::other(format!("dial {address}: {e}")))
        }
    };
    let gbits = |seconds: f64| (knobs.bytes * 8) as f64 / seconds / 1e9;

    let mut io = dial(bulk).await?;
    let started = Instant::now();
    upload(&mut io, knobs.bytes).await?;
    let up = gbits(started.elapsed().as_secs_f64());
    drop(io);
    let mut io = dial(bulk).await?;
    let started = Instant::now();
    download(&mut io, knobs.bytes).await?;
    let down = gbits(started.elapsed().as_secs_f64());
    drop(io);

    let mut io = dial(echo).await?;
    let mut byte = [7u8; 1];
    for _ in 0..200 {
        io.write_all(&byte).await?;
        io.read_exact(&mut byte).await?;
    }
    let mut samples = Vec::with_capacity(knobs.round_trips);
    for _ in 0..knobs.round_trips {
        let t = Instant::now();
        io.write_all(&byte).await?;
        io.read_exact(&mut byte).await?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(io);
    samples.sort_by(f64::total_cmp);
    let rtt = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    let (p50, p99) = (rtt(0.5), rtt(0.99));

    let mut connects = [0.0f64; 2];
    for (slot, parallel) in [(0, 1u64), (1, 8)] {
        let per_worker = knobs.connects / parallel;
        let started = Instant::now();
        let workers = (0..parallel).map(|_| async {
            for _ in 0..per_worker {
                let mut io = dial(echo).await?;
                let mut byte = [1u8; 1];
                io.write_all(&byte).await?;
                io.read_exact(&mut byte).await?;
            }
            Ok::<_, std::io::Error>(())
        });
        for result in futures_util::future::join_all(workers).await {
            result?;
        }
        connects[slot] = (per_worker * parallel) as f64 / started.elapsed().as_secs_f64();
    }
    Ok(vec![up, down, p50, p99, connects[0], connects[1]])
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

fn report(paths: &[PathSpec], measured: &Measured, tunnel_up: &[Duration]) {
    let unit = |f: usize, value: f64| match f {
        0 | 1 => format!("{value:.2} Gbit/s"),
        2 | 3 => format!("{value:.0} µs"),
        _ => format!("{value:.0}"),
    };
    println!("\nMedians over the rounds (absolute):\n");
    let header: Vec<&str> = FIGURES.iter().map(|(name, _)| *name).collect();
    println!("| path | {} | tunnel up after start |", header.join(" | "));
    println!("|---|{}---|", "---|".repeat(FIGURES.len()));
    for (p, path) in paths.iter().enumerate() {
        let cells: Vec<String> = (0..FIGURES.len())
            .map(|f| unit(f, median(&measured.values[p][f])))
            .collect();
        println!(
            "| {} | {} | {:.0} ms |",
            path.name,
            cells.join(" | "),
            tunnel_up[p].as_secs_f64() * 1e3
        );
    }
    println!(
        "\nPer-round ratio to the baseline (`{}`), median (range); > 100 % is better for every figure \
         (RTT: baseline ÷ path):\n",
        paths[0].name
    );
    println!(
        "| path | {} | CPU agent / proxy / server, s |",
        header.join(" | ")
    );
    println!("|---|{}---|", "---|".repeat(FIGURES.len()));
    for (p, path) in paths.iter().enumerate() {
        let cells: Vec<String> = FIGURES
            .iter()
            .enumerate()
            .map(|(f, (_, higher))| {
                let ratios: Vec<f64> = measured.values[p][f]
                    .iter()
                    .zip(&measured.values[0][f])
                    .map(|(value, base)| if *higher { value / base } else { base / value })
                    .collect();
                let mut sorted = ratios.clone();
                sorted.sort_by(f64::total_cmp);
                format!(
                    "{:.1} % ({:.0}–{:.0})",
                    median(&ratios) * 100.0,
                    sorted[0] * 100.0,
                    sorted[sorted.len() - 1] * 100.0
                )
            })
            .collect();
        let [agent, proxy, server] = measured.cpu[p];
        println!(
            "| {} | {} | {agent:.2} / {proxy:.2} / {server:.2} |",
            path.name,
            cells.join(" | ")
        );
    }
}

/// `CP_PATHS_QUICKACK` (`cluster`, `hub` or both, comma-separated): the
/// routes of that namespace get `quickack 1`, so its sockets acknowledge
/// every segment at once instead of delaying the ACK. Proxies that leave
/// Nagle's algorithm on (tinyproxy and microsocks do) hold a small write
/// until the previous one is acknowledged, so a delayed ACK stalls them;
/// this shows how much of a path's cost that is.
fn quick_acks(net: &FencedCluster) -> anyhow::Result<()> {
    let Ok(sides) = std::env::var("CP_PATHS_QUICKACK") else {
        return Ok(());
    };
    let cluster_routes = [
        format!("{PROXY_IP}/32 dev uplink src {CLUSTER_IP} quickack 1"),
        format!("{HUB_IP}/32 dev uplink src {CLUSTER_IP} quickack 1"),
    ];
    let hub_routes = [
        format!("table local local {PROXY_IP} dev lo quickack 1"),
        format!("table local local {HUB_IP} dev lo quickack 1"),
        format!("{CLUSTER_IP}/32 dev gw quickack 1"),
    ];
    for side in sides.split(',').map(str::trim) {
        let (ns, routes) = match side {
            "cluster" => (&net.cluster, &cluster_routes[..]),
            "hub" => (&net.hub, &hub_routes[..]),
            other => bail!("CP_PATHS_QUICKACK: {other:?} is neither cluster nor hub"),
        };
        for route in routes {
            let mut command = std::process::Command::new("ip");
            command.args(["netns", "exec", ns, "ip", "route", "change"]);
            command.args(route.split(' '));
            let out = command.output().context("running ip")?;
            if !out.status.success() {
                bail!(
                    "ip route change {route} in {ns}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        eprintln!("quick ACKs on the {side} side");
    }
    Ok(())
}

fn all_logs(processes: &[Supervised], logs: &Logs) -> String {
    processes
        .iter()
        .map(|p| format!("----- {} -----\n{}\n", p.name(), logs.tail(p.name(), 30)))
        .collect()
}
