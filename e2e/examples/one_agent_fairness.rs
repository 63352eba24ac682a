//! Benchmark: many concurrent connections through one agent, and how
//! fairly they share the tunnel.
//!
//! ```sh
//! cargo run --release -p e2e --example one_agent_fairness
//! ```
//!
//! One proxy-server and one proxy-agent run as child processes (their RSS
//! and CPU are their own, from `/proc`); this process runs the bulk target
//! the agent dials and the hub-side clients. `CP_FAIR_CONNS` (10000)
//! tunneled connections are opened through the gRPC frontend, spread over
//! `CP_FAIR_CLIENTS` (16) client HTTP/2 connections (the server allows
//! `--max-concurrent-streams` 1000 per connection), each asking the target
//! for an endless download, and read from the moment it opens (200 dials at
//! a time). Once every connection has received its first bytes, each one's
//! bytes are counted over `CP_FAIR_SECONDS` (10) seconds.
//!
//! `CP_FAIR_AGENT_RCVBUF` (0: the kernel's autotuning) is the agent's
//! `--target-receive-buffer`.
//!
//! `CP_FAIR_STALLED` (0) connections that ask for the same endless download
//! and are never read are then added on the same client connections and
//! tunnel; the running downloads are measured with them held and again
//! after they close, `CP_FAIR_STALL_ROUNDS` (3) times, and their throughput
//! with the stalled ones is reported against the mean of the windows just
//! before and after. They share the running downloads' client HTTP/2
//! connections, or with `CP_FAIR_STALLED_OWN_CLIENT=1` only the tunnel
//! (a client connection of their own). `CP_FAIR_STALLED_VIA` picks the
//! path of the stalled connections: `tunnel` (the default, as above),
//! `direct` (plain TCP to the same target, never read: what a stalled
//! connection costs this machine without the tunnel) or `none` (nothing
//! is opened: the ratio the alternating windows read on their own).
//!
//! Reported: the total throughput, beside one connection alone measured in
//! the same run over the same window; the per-connection distribution
//! (min, p1, median, max) as a share of the fair share (total / N); how many
//! connections got less than half their fair share; Jain's fairness index;
//! server and agent RSS with every connection open.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::identity::ClusterName;
use simulated_cluster::binaries::{Binaries, Progress};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tunnel_harness::child::{ChildTunnel, ChildTunnelOptions};
use tunnel_harness::in_process::tunnel_client;
use tunnel_harness::loadgen::{knob, pattern, process_usage, request_download};
use tunnel_harness::pki::TestPki;

const CLUSTER: &str = "cluster-a";

/// Targets that send without end, as fast as they are read. They stand in
/// for services on other machines: their send buffers would not count
/// against this kernel's TCP memory (`net.ipv4.tcp_mem`), so they are
/// capped (`CP_FAIR_TARGET_SNDBUF`, 128 KiB); with thousands of
/// connections, autotuned 4 MiB send buffers on this one machine pushed
/// the kernel into TCP memory pressure, which drops segments and stalled
/// every connection behind retransmission timeouts.
async fn start_endless_target(send_buffer: u32) -> anyhow::Result<std::net::SocketAddr> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    // Accepted sockets inherit the listener's buffer size.
    socket.set_send_buffer_size(send_buffer)?;
    socket.bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let listener = socket.listen(4096)?;
    let addr = listener.local_addr()?;
    let chunk = bytes::Bytes::from(pattern(64 * 1024));
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let chunk = chunk.clone();
            tokio::spawn(async move {
                // The 9-byte download request of `open_download`.
                let mut request = [0u8; 9];
                if socket.read_exact(&mut request).await.is_err() {
                    return;
                }
                while socket.write_all(&chunk).await.is_ok() {}
            });
        }
    });
    Ok(addr)
}

/// Opens a tunneled connection to the endless target and asks it for an
/// endless download; returns once the first bytes arrived.
async fn open_download(
    client: &TunnelClient,
    target: &str,
) -> anyhow::Result<cluster_proxy_proto::client::TunnelStream> {
    start_download(client.dial(target).await?).await
}

/// Asks the endless target on `stream` for an endless download and returns
/// the stream once the first byte arrived.
async fn start_download<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) -> anyhow::Result<S> {
    request_download(&mut stream, u64::MAX).await?;
    let mut first = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(60), stream.read_exact(&mut first))
        .await
        .map_err(|_| anyhow!("no first byte within 60 s"))??;
    Ok(stream)
}

/// Reads `stream` until `stop`, adding every byte to `counter`.
async fn drain(
    mut stream: cluster_proxy_proto::client::TunnelStream,
    counter: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            read = stream.read(&mut buf) => match read {
                Ok(n) if n > 0 => {
                    counter.fetch_add(n as u64, Ordering::Relaxed);
                }
                _ => return,
            },
        }
    }
}

/// Bytes each counter gained over `window`, once all are running.
async fn measure(counters: &[Arc<AtomicU64>], window: Duration) -> (Vec<u64>, Duration) {
    let before: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let elapsed = started.elapsed();
    let gained = counters
        .iter()
        .zip(before)
        .map(|(c, b)| c.load(Ordering::Relaxed) - b)
        .collect();
    (gained, elapsed)
}

/// The running downloads' throughput with stalled connections held, as a
/// share of the mean of the windows just before and just after, per round,
/// and what each window cost.
struct StalledEffect {
    ratios: Vec<f64>,
    /// CPU seconds per GiB moved in the windows with stalled connections.
    cost_with: Vec<WindowCost>,
    /// The same in the windows after them, without.
    cost_without: Vec<WindowCost>,
}

/// CPU seconds per GiB the running downloads moved in one window: the
/// server, the agent, and this process (the clients reading, the target).
#[derive(Clone, Copy)]
struct WindowCost {
    server: f64,
    agent: f64,
    benchmark: f64,
}

/// CPU time so far of the server, the agent and this process.
fn cpu_seconds(processes: &ChildTunnel) -> anyhow::Result<[f64; 3]> {
    let (server, agent) = processes.usage()?;
    let benchmark = process_usage(std::process::id())?;
    Ok([server.cpu_seconds, agent.cpu_seconds, benchmark.cpu_seconds])
}

/// Measures one window like [`measure`], with its [`WindowCost`].
async fn measure_with_cost(
    processes: &ChildTunnel,
    counters: &[Arc<AtomicU64>],
    window: Duration,
    label: &str,
) -> anyhow::Result<(f64, WindowCost)> {
    let before = cpu_seconds(processes)?;
    let started = unix_seconds();
    let (gained, elapsed) = measure(counters, window).await;
    if knob("CP_FAIR_PRINT_WINDOWS", 0) == 1 {
        // Wall-clock bounds, to cut a `perf record -k realtime` profile
        // taken over the whole run into its windows (`perf report --time`).
        eprintln!("window {label}: {started:.3},{:.3}", unix_seconds());
    }
    let after = cpu_seconds(processes)?;
    let bytes: u64 = gained.iter().sum();
    let gib = (bytes as f64 / (1u64 << 30) as f64).max(1e-9);
    let per_gib = |i: usize| (after[i] - before[i]) / gib;
    Ok((
        gbit_per_s(bytes, elapsed),
        WindowCost {
            server: per_gib(0),
            agent: per_gib(1),
            benchmark: per_gib(2),
        },
    ))
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The median of each process's CPU per GiB over `costs`.
fn median_cost(costs: &[WindowCost]) -> WindowCost {
    let median = |pick: fn(&WindowCost) -> f64| {
        let mut values: Vec<f64> = costs.iter().map(pick).collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
    };
    WindowCost {
        server: median(|c| c.server),
        agent: median(|c| c.agent),
        benchmark: median(|c| c.benchmark),
    }
}

/// The path the stalled connections take (`CP_FAIR_STALLED_VIA`).
#[derive(Clone, Copy, PartialEq)]
enum StalledVia {
    /// Tunneled like the running downloads.
    Tunnel,
    /// Plain TCP to the same target, bypassing the tunnel.
    Direct,
    /// Nothing is opened: the alternating windows' own reading.
    Nothing,
}

impl StalledVia {
    fn from_env() -> anyhow::Result<Self> {
        match std::env::var("CP_FAIR_STALLED_VIA").as_deref() {
            Err(std::env::VarError::NotPresent) | Ok("tunnel") => Ok(Self::Tunnel),
            Ok("direct") => Ok(Self::Direct),
            Ok("none") => Ok(Self::Nothing),
            Ok(other) => Err(anyhow!(
                "CP_FAIR_STALLED_VIA={other:?}: expected tunnel, direct or none"
            )),
            Err(e) => Err(anyhow!("CP_FAIR_STALLED_VIA: {e}")),
        }
    }
}

/// Opens one connection that asks the target for an endless download
/// along `via` and returns once its first byte arrived. It is held only to
/// be dropped (closed) later, never read.
async fn open_stalled(
    via: StalledVia,
    client: &TunnelClient,
    target: &str,
    target_addr: std::net::SocketAddr,
) -> anyhow::Result<Option<Box<dyn Send>>> {
    Ok(match via {
        StalledVia::Tunnel => Some(Box::new(open_download(client, target).await?)),
        StalledVia::Direct => Some(Box::new(
            start_download(tokio::net::TcpStream::connect(target_addr).await?).await?,
        )),
        StalledVia::Nothing => None,
    })
}

/// How long stalled connections get to fill every buffer their flow
/// windows allow (server, client HTTP/2 stream, agent) before the window
/// with them is measured, and to be gone after they close.
const STALL_SETTLE: Duration = Duration::from_secs(2);

/// `rounds` times: opens `count` connections that ask for an endless
/// download and are never read, spread over the same client connections
/// (and so the same tunnel) as the running downloads, measures the running
/// downloads with them held, closes them and measures again. `before` is
/// the throughput of the window just measured without them. Alternating
/// keeps this VM's drift (±10 % between windows) out of the ratios.
#[allow(clippy::too_many_arguments)]
async fn stalled_effect(
    processes: &ChildTunnel,
    tunnels: &[TunnelClient],
    target: &str,
    target_addr: std::net::SocketAddr,
    via: StalledVia,
    counters: &[Arc<AtomicU64>],
    count: usize,
    rounds: usize,
    window: Duration,
    before: f64,
) -> anyhow::Result<StalledEffect> {
    let mut ratios = Vec::with_capacity(rounds);
    let mut cost_with = Vec::with_capacity(rounds);
    let mut cost_without = Vec::with_capacity(rounds);
    let mut without = before;
    for _ in 0..rounds {
        let mut stalled = Vec::with_capacity(count);
        for i in 0..count {
            stalled
                .push(open_stalled(via, &tunnels[i % tunnels.len()], target, target_addr).await?);
        }
        tokio::time::sleep(STALL_SETTLE).await;
        let (with, with_cost) = measure_with_cost(processes, counters, window, "with").await?;
        drop(stalled);
        tokio::time::sleep(STALL_SETTLE).await;
        let (after, after_cost) = measure_with_cost(processes, counters, window, "without").await?;
        ratios.push(with / ((without + after) / 2.0).max(1e-9));
        cost_with.push(with_cost);
        cost_without.push(after_cost);
        without = after;
    }
    ratios.sort_by(f64::total_cmp);
    Ok(StalledEffect {
        ratios,
        cost_with,
        cost_without,
    })
}

fn gbit_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let connections = knob("CP_FAIR_CONNS", 10_000).max(1);
    let clients = knob("CP_FAIR_CLIENTS", 16).max(1);
    let window = Duration::from_secs(knob("CP_FAIR_SECONDS", 10) as u64);
    // A misspelt path fails here, not after the first measurements.
    let stalled_via = StalledVia::from_env()?;

    let binaries = tokio::task::spawn_blocking(|| Binaries::build(Progress::Quiet)).await??;
    let pki = TestPki::new(&[CLUSTER])?;
    let options = ChildTunnelOptions {
        agent_args: vec![format!(
            "--target-receive-buffer={}",
            knob("CP_FAIR_AGENT_RCVBUF", 0)
        )],
        ..ChildTunnelOptions::default()
    };
    let processes = ChildTunnel::start(
        &binaries,
        &pki,
        &ClusterName::new(CLUSTER)?,
        "fairness",
        &options,
    )
    .await?;
    eprintln!(
        "proxy-server metrics: http://{}/metrics",
        processes.ports.health_addr()
    );

    let target_addr = start_endless_target(
        u32::try_from(knob("CP_FAIR_TARGET_SNDBUF", 128 * 1024)).unwrap_or(u32::MAX),
    )
    .await?;
    let target = format!("{CLUSTER}:{}", target_addr.port());
    let mut tunnels = Vec::with_capacity(clients);
    for _ in 0..clients {
        tunnels.push(tunnel_client(pki.client_tls()?, processes.client_addr()).await?);
    }

    // Baseline: one connection alone, over the same window.
    let stop = CancellationToken::new();
    let single = Arc::new(AtomicU64::new(0));
    let stream = open_download(&tunnels[0], &target).await?;
    let reader = tokio::spawn(drain(stream, single.clone(), stop.clone()));
    let (alone, alone_elapsed) = measure(std::slice::from_ref(&single), window).await;
    stop.cancel();
    reader.await?;
    let alone_gbit = gbit_per_s(alone[0], alone_elapsed);

    // Every connection open and receiving before the window starts.
    let stop = CancellationToken::new();
    let counters: Vec<Arc<AtomicU64>> = (0..connections)
        .map(|_| Arc::new(AtomicU64::new(0)))
        .collect();
    let opening = Instant::now();
    // Each connection is read from the moment it opens: a stream nobody
    // reads holds its HTTP/2 window and slows its neighbours.
    let mut readers = Vec::with_capacity(connections);
    let (opened_tx, mut opened_rx) = tokio::sync::mpsc::channel::<anyhow::Result<()>>(connections);
    let dialing = Arc::new(tokio::sync::Semaphore::new(200));
    for (i, counter) in counters.iter().enumerate() {
        let client = tunnels[i % clients].clone();
        let (target, counter, stop) = (target.clone(), counter.clone(), stop.clone());
        let (opened_tx, dialing) = (opened_tx.clone(), dialing.clone());
        readers.push(tokio::spawn(async move {
            let permit = dialing.acquire_owned().await;
            match open_download(&client, &target).await {
                Ok(stream) => {
                    drop(permit);
                    let _ = opened_tx.send(Ok(())).await;
                    drain(stream, counter, stop).await;
                }
                Err(e) => {
                    let _ = opened_tx
                        .send(Err(e.context(format!("connection {i}"))))
                        .await;
                }
            }
        }));
    }
    for _ in 0..connections {
        opened_rx
            .recv()
            .await
            .ok_or_else(|| anyhow!("an opening task vanished"))??;
    }
    let opened = opening.elapsed();
    let (server_before, agent_before) = processes.usage()?;
    let (server_rss, agent_rss) = (server_before.rss_mib, agent_before.rss_mib);
    let (mut gained, elapsed) = measure(&counters, window).await;
    let (server_after, agent_after) = processes.usage()?;
    let (server_cpu, agent_cpu) = (
        server_after.cpu_seconds - server_before.cpu_seconds,
        agent_after.cpu_seconds - agent_before.cpu_seconds,
    );
    let stalled = knob("CP_FAIR_STALLED", 0);
    let stalled_effect = if stalled > 0 {
        let with_all = gbit_per_s(gained.iter().sum(), elapsed);
        let rounds = knob("CP_FAIR_STALL_ROUNDS", 3).max(1);
        let own_client = knob("CP_FAIR_STALLED_OWN_CLIENT", 0) == 1;
        let stalled_clients = if own_client {
            vec![tunnel_client(pki.client_tls()?, processes.client_addr()).await?]
        } else {
            tunnels.clone()
        };
        Some(
            stalled_effect(
                &processes,
                &stalled_clients,
                &target,
                target_addr,
                stalled_via,
                &counters,
                stalled,
                rounds,
                window,
                with_all,
            )
            .await?,
        )
    } else {
        None
    };
    stop.cancel();
    for reader in readers {
        reader.await?;
    }

    gained.sort_unstable();
    let total: u64 = gained.iter().sum();
    let fair = total as f64 / connections as f64;
    let share = |bytes: u64| bytes as f64 / fair.max(1.0);
    let at = |p: f64| gained[((gained.len() - 1) as f64 * p).round() as usize];
    let starved = gained.iter().filter(|&&b| share(b) < 0.5).count();
    let squares: f64 = gained.iter().map(|&b| (b as f64).powi(2)).sum();
    let jain = (total as f64).powi(2) / (connections as f64 * squares.max(1.0));
    let gib = total as f64 / (1u64 << 30) as f64;

    println!(
        "one proxy-server and one proxy-agent (child processes); {connections} concurrent downloads over {clients} gRPC client connections, opened in {opened:.1?}"
    );
    println!(
        "one connection alone: {alone_gbit:.2} Gbit/s; all {connections}: {:.2} Gbit/s in total ({:.0} % of one alone) over {elapsed:.1?}",
        gbit_per_s(total, elapsed),
        gbit_per_s(total, elapsed) / alone_gbit.max(1e-9) * 100.0,
    );
    println!(
        "per connection, as a share of the fair share ({:.1} KiB/s): min {:.2}, p1 {:.2}, median {:.2}, max {:.2}; below half: {starved}; Jain's index {jain:.3}",
        fair / elapsed.as_secs_f64() / 1024.0,
        share(gained[0]),
        share(at(0.01)),
        share(at(0.5)),
        share(gained[gained.len() - 1]),
    );
    println!(
        "RSS with every connection open: server {server_rss:.0} MiB, agent {agent_rss:.0} MiB; CPU per GiB moved in the window: server {:.2} s, agent {:.2} s",
        server_cpu / gib.max(1e-9),
        agent_cpu / gib.max(1e-9),
    );
    if let Some(effect) = stalled_effect {
        let ratios = &effect.ratios;
        println!(
            "with {stalled} stalled connections (never read; {}), the others' throughput against the windows around it, over {} rounds: median {:.1} % (lowest {:.1} %, highest {:.1} %)",
            match stalled_via {
                StalledVia::Nothing => "none opened: the windows' own reading",
                StalledVia::Direct => "plain TCP to the target, not tunneled",
                StalledVia::Tunnel if knob("CP_FAIR_STALLED_OWN_CLIENT", 0) == 1 =>
                    "sharing the tunnel only",
                StalledVia::Tunnel => "sharing the tunnel and the client connections",
            },
            ratios.len(),
            ratios[ratios.len() / 2] * 100.0,
            ratios[0] * 100.0,
            ratios[ratios.len() - 1] * 100.0,
        );
        for (what, costs) in [
            ("with", &effect.cost_with),
            ("without", &effect.cost_without),
        ] {
            let cost = median_cost(costs);
            println!(
                "  CPU per GiB the others moved, windows {what} stalled connections (median): server {:.2} s, agent {:.2} s, this process (clients, target) {:.2} s",
                cost.server, cost.agent, cost.benchmark,
            );
        }
    }
    drop(processes);
    Ok(())
}
