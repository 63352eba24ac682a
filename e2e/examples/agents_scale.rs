//! Benchmark: how many agents one proxy-server replica holds.
//!
//! ```sh
//! cargo run --release -p e2e --example agents_scale
//! ```
//!
//! One proxy-server binary runs as a child process (so its RSS and CPU are
//! its own, from `/proc`); this process runs `CP_SCALE_AGENTS` (2000)
//! proxy-agents, each with its own certificate and cluster name, and an
//! echo target every cluster name resolves to. Each agent then carries
//! `CP_SCALE_IDLE` (2) idle tunneled connections (HTTP CONNECT, a 1-byte
//! echo, then held open). With all of that held, `CP_SCALE_DIALS` (2000)
//! dials, 4 at a time, each a 1-byte echo, run twice on each frontend:
//! first all to one cluster (the baseline, measured in the same run), then
//! to every cluster in turn. HTTP CONNECT pays a new mTLS connection per
//! dial; gRPC dials on one held client connection, as a hub controller does.
//!
//! Reported: the server's RSS with no agent, with every agent connected,
//! and with the idle connections (per agent and per connection); per phase
//! the dials' latency p50/p99/max, the server's CPU per dial and this
//! process's (client, agents and target together); the p99 ratio of all
//! clusters to the baseline. With every dial's processes on two cores, a
//! dial waits for the CPU the others in flight take: `CP_SCALE_DIALERS=1`
//! measures a dial's latency without that queue.
//!
//! Knobs: `CP_SCALE_DIALERS` (4) dials at once in the dial phases;
//! `CP_SCALE_PARALLEL` (50) idle connections opened at once;
//! `CP_SCALE_SERVER_LOG=<file>` and `CP_SCALE_SERVER_RUST_LOG=<filter>` keep
//! the server's log. Every stage of a connection (TCP, TLS, the CONNECT
//! answer, the echo) has a 30 s limit, and a failure prints the server's
//! metrics.
//!
//! Found with it (2026-11-23): with 200 agents and 50 CONNECTs at once,
//! about one run in five had a connection whose first byte never reached
//! the agent. `ss` showed the byte had never left this process: tokio's
//! cooperative budget had run out, the TLS stream kept the byte, and
//! nothing flushed it. The same hazard was in the server's CONNECT relay
//! (fixed; regression test `tunnel::connect_delivers_the_tail_of_a_burst_to_a_slow_reader`).
//!
//! Each agent needs a tunnel and two local listeners (health, admin) and
//! each idle connection three descriptors here, so the example raises its
//! own open-file limit with `prlimit` (root) and says so if it cannot.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use cluster_proxy_proto::transport::ALPN_HTTP11;
use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::targets::EchoServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{ServerPorts, proxy_server_args};
use tunnel_harness::loadgen::{knob, process_usage};
use tunnel_harness::pki::TestPki;

fn raise_open_file_limit(wanted: usize) {
    let pid = std::process::id().to_string();
    let limit = format!("--nofile={wanted}:{wanted}");
    match std::process::Command::new("prlimit")
        .args(["--pid", &pid, &limit])
        .status()
    {
        Ok(status) if status.success() => {}
        other => eprintln!(
            "could not raise the open-file limit to {wanted} ({other:?}); lower CP_SCALE_AGENTS or CP_SCALE_IDLE if descriptors run out"
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

/// Dial latencies of one phase and the CPU it took.
struct Latencies {
    sorted: Vec<Duration>,
    server_cpu: f64,
    /// This process's: the client, the agents and the target.
    local_cpu: f64,
}

impl Latencies {
    fn p99(&self) -> Duration {
        percentile(&self.sorted, 0.99)
    }

    fn describe(&self) -> String {
        format!(
            "p50 {} p99 {} max {}; CPU per dial: server {:.0} µs, client + agents + target {:.0} µs",
            ms(percentile(&self.sorted, 0.5)),
            ms(self.p99()),
            ms(self.sorted.last().copied().unwrap_or_default()),
            self.server_cpu * 1e6 / self.sorted.len().max(1) as f64,
            self.local_cpu * 1e6 / self.sorted.len().max(1) as f64,
        )
    }
}

/// How a dial phase runs: `count` dials to the echo target's `port`,
/// `dialers` at a time, the server's CPU read from `server_pid`.
struct Plan {
    port: u16,
    count: usize,
    dialers: usize,
    server_pid: u32,
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
            let mut stream = grpc.dial(&target).await?;
            stream.write_all(b"x").await?;
            let mut back = [0u8; 1];
            tokio::time::timeout(Duration::from_secs(30), stream.read_exact(&mut back))
                .await
                .map_err(|_| anyhow!("{target}: no echo within 30 s"))??;
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
        let Plan {
            port,
            count,
            dialers,
            server_pid,
        } = *plan;
        let cpu_before = process_usage(server_pid)?.cpu_seconds;
        let local_before = process_usage(std::process::id())?.cpu_seconds;
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
            local_cpu: process_usage(std::process::id())?.cpu_seconds - local_before,
        })
    }

    fn print(&self, label: &str) {
        println!("  {label}: CONNECT {}", self.connect.describe());
        println!("  {label}: gRPC    {}", self.grpc.describe());
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let agent_count = knob("CP_SCALE_AGENTS", 2000);
    let idle_per_agent = knob("CP_SCALE_IDLE", 2);
    let dial_count = knob("CP_SCALE_DIALS", 2000);
    let dialers = knob("CP_SCALE_DIALERS", 4).max(1);
    raise_open_file_limit(agent_count * (4 + 3 * idle_per_agent) + 4096);

    let binaries = tokio::task::spawn_blocking(|| Binaries::build(Progress::Quiet)).await??;
    let names: Vec<String> = (0..agent_count).map(|i| format!("cluster-{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let started = Instant::now();
    let pki = TestPki::new(&refs)?;
    eprintln!(
        "{agent_count} agent certificates in {:.1?}",
        started.elapsed()
    );
    let certs = tempfile::tempdir()?;
    let layout = pki.write(certs.path())?;
    let ports = ServerPorts::free();
    let (client_port, agent_port, health_port) = (ports.client, ports.agent, ports.health);
    let mut server = tokio::process::Command::new(&binaries.proxy_server)
        .args(proxy_server_args("scale", &ports, &layout))
        .env(
            "RUST_LOG",
            std::env::var("CP_SCALE_SERVER_RUST_LOG").unwrap_or_default(),
        )
        .stdout(Stdio::null())
        .stderr(match std::env::var_os("CP_SCALE_SERVER_LOG") {
            Some(file) => Stdio::from(std::fs::File::create(file)?),
            None => Stdio::null(),
        })
        .kill_on_drop(true)
        .spawn()?;
    let pid = server.id().ok_or_else(|| anyhow!("proxy-server exited"))?;
    let client_addr: SocketAddr = format!("127.0.0.1:{client_port}").parse()?;
    let echo = EchoServer::start().await?;
    // Wait until the server listens.
    let listening = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", agent_port))
        .await
        .is_err()
    {
        if listening.elapsed() > Duration::from_secs(30) {
            return Err(anyhow!("proxy-server did not listen within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_empty = process_usage(pid)?.rss_mib;

    let started = Instant::now();
    let mut agents = Vec::with_capacity(agent_count);
    for chunk in names.chunks(100) {
        let starts = chunk.iter().map(|cluster| {
            let pki = &pki;
            async move {
                let mut config = proxy_agent::ProxyAgentConfig::new(
                    proxy_agent::TlsSource::Config(pki.agent_tls(cluster)?),
                )
                .with_ephemeral_ports();
                config.proxy_server_host = "localhost".into();
                config.proxy_server_port = agent_port;
                config.agent_id = format!("{cluster}-agent");
                config.agent_identifiers = format!("host={cluster}");
                config
                    .host_aliases
                    .insert(cluster.clone(), [127, 0, 0, 1].into());
                anyhow::Ok(proxy_agent::start(config).await?)
            }
        });
        agents.extend(futures_util::future::try_join_all(starts).await?);
    }
    for agent in &agents {
        if !agent.wait_for_tunnels(1, Duration::from_secs(60)).await {
            return Err(anyhow!("{} did not connect", agent.agent_id()));
        }
    }
    let connected = started.elapsed();
    eprintln!("{agent_count} agents connected in {connected:.1?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_agents = process_usage(pid)?.rss_mib;

    let tls = pki.client_tls_alpn(&[ALPN_HTTP11])?;
    let started = Instant::now();
    let mut idle = Vec::with_capacity(agent_count * idle_per_agent);
    for round in 0..idle_per_agent {
        for chunk in names.chunks(knob("CP_SCALE_PARALLEL", 50)) {
            let opens = chunk.iter().map(|cluster| {
                let tls = tls.clone();
                let target = format!("{cluster}:{}", echo.addr.port());
                async move { open_echoed(tls, client_addr, &target).await }
            });
            match futures_util::future::try_join_all(opens).await {
                Ok(opened) => idle.extend(opened),
                Err(e) => {
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
                    return Err(e.context(format!("idle connections, round {round}")));
                }
            }
        }
    }
    let opened = started.elapsed();
    eprintln!("{} idle connections opened in {opened:.1?}", idle.len());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_idle = process_usage(pid)?.rss_mib;
    // One held gRPC connection, as a hub controller holds it.
    let grpc = tunnel_harness::in_process::tunnel_client(pki.client_tls()?, client_addr).await?;

    let plan = Plan {
        port: echo.addr.port(),
        count: dial_count,
        dialers,
        server_pid: pid,
    };
    let baseline = Dials::run(&tls, &grpc, client_addr, &names[..1], &plan).await?;
    let loaded = Dials::run(&tls, &grpc, client_addr, &names, &plan).await?;
    let rss_after = process_usage(pid)?.rss_mib;

    let kib_each = |delta_mib: f64, n: usize| delta_mib * 1024.0 / n.max(1) as f64;
    println!(
        "one proxy-server (child process), {agent_count} agents with their own certificates, {} idle tunneled connections ({idle_per_agent} per agent)",
        idle.len()
    );
    println!("agents connected in {connected:.1?}; idle connections opened in {opened:.1?}");
    println!(
        "server RSS: {rss_empty:.1} MiB empty, {rss_agents:.1} MiB with the agents (+{:.1} KiB per agent), {rss_idle:.1} MiB with the idle connections (+{:.1} KiB per connection), {rss_after:.1} MiB after the dials",
        kib_each(rss_agents - rss_empty, agent_count),
        kib_each(rss_idle - rss_agents, idle.len()),
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
    drop(idle);
    for agent in agents {
        agent.shutdown().await;
    }
    let _ = server.kill().await;
    Ok(())
}
