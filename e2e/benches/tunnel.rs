//! Tunnel benchmark: direct TCP vs the tunnel (gRPC client and HTTP CONNECT),
//! measured in one run on loopback with a real server, agent and mTLS.
//!
//! `cargo bench -p e2e --bench tunnel` (env: `CP_BENCH_MIB` bytes per
//! single-connection transfer, default 1024; `CP_BENCH_RTT` round trips,
//! default 10000; `CP_BENCH_CONNECTS`, default 2000; `CP_BENCH_IDLE`, default 1000).
//!
//! `CP_BENCH_TRACING=1` compares tracing off and on instead (see
//! [`compare_tracing`]): single-connection throughput and connects/s, in
//! `CP_BENCH_ROUNDS` (5) alternating rounds, reported as ratios.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use cluster_proxy_runtime::telemetry::{self, SamplerChoice, TelemetryConfig};
use e2e::harness::{http_connect, test_server_config, tunnel_client};
use e2e::loadgen::{BulkServer, download, rss_bytes, upload};
use e2e::pki::TestPki;
use e2e::targets::EchoServer;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type BoxIo = Box<dyn Io>;
type Dial = Box<dyn Fn(u16) -> Pin<Box<dyn Future<Output = BoxIo> + Send>> + Send + Sync>;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Path {
    name: &'static str,
    dial: Dial,
}

async fn throughput(path: &Path, port: u16, conns: u64, bytes_per_conn: u64, up: bool) -> f64 {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let io = (path.dial)(port);
        tasks.push(tokio::spawn(async move {
            let mut io = io.await;
            if up {
                upload(&mut io, bytes_per_conn).await.expect("upload");
            } else {
                download(&mut io, bytes_per_conn).await.expect("download");
            }
        }));
    }
    for t in tasks {
        t.await.expect("transfer task");
    }
    (conns * bytes_per_conn * 8) as f64 / started.elapsed().as_secs_f64() / 1e9
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

async fn round_trips(path: &Path, port: u16, count: u64) -> (Duration, Duration) {
    let mut io = (path.dial)(port).await;
    let mut byte = [7u8; 1];
    for _ in 0..200 {
        io.write_all(&byte).await.expect("write");
        io.read_exact(&mut byte).await.expect("read");
    }
    let mut samples = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let t = Instant::now();
        io.write_all(&byte).await.expect("write");
        io.read_exact(&mut byte).await.expect("read");
        samples.push(t.elapsed());
    }
    samples.sort();
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

/// Connections per second, each: connect, 1-byte echo, close; `parallel`
/// dialers at once (1 = sequential, latency-bound).
async fn connects_per_second(path: &Path, port: u16, count: u64, parallel: u64) -> f64 {
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..parallel {
        let dials: Vec<_> = (0..count / parallel).map(|_| (path.dial)(port)).collect();
        workers.push(tokio::spawn(async move {
            for dial in dials {
                let mut io = dial.await;
                let mut byte = [1u8; 1];
                io.write_all(&byte).await.expect("write");
                io.read_exact(&mut byte).await.expect("read");
            }
        }));
    }
    for w in workers {
        w.await.expect("connect worker");
    }
    (count / parallel * parallel) as f64 / started.elapsed().as_secs_f64()
}

/// Holds a PM QoS request so idle CPUs poll instead of sleeping, while alive
/// (`CP_BENCH_CPU_LATENCY=0`; needs root). On VMs whose idle vCPUs halt, the
/// wake-up cost otherwise dominates microsecond latencies.
fn hold_cpu_latency() -> Option<std::fs::File> {
    let value: i32 = std::env::var("CP_BENCH_CPU_LATENCY").ok()?.parse().ok()?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/cpu_dma_latency")
        .map_err(|e| eprintln!("CP_BENCH_CPU_LATENCY: /dev/cpu_dma_latency: {e}"))
        .ok()?;
    std::io::Write::write_all(&mut file, &value.to_ne_bytes()).ok()?;
    Some(file)
}

async fn idle_bytes_per_connection(path: &Path, port: u16, count: u64) -> f64 {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_bytes().unwrap_or(0);
    let mut open = Vec::new();
    for _ in 0..count {
        let mut io = (path.dial)(port).await;
        let mut byte = [1u8; 1];
        io.write_all(&byte).await.expect("write");
        io.read_exact(&mut byte).await.expect("read");
        open.push(io);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = rss_bytes().unwrap_or(0);
    drop(open);
    tokio::time::sleep(Duration::from_millis(500)).await;
    after.saturating_sub(before) as f64 / count as f64
}

type Rows = Vec<(&'static str, Vec<f64>)>;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let tracing = std::env::var("CP_BENCH_TRACING").is_ok_and(|v| v == "1");
    if !tracing {
        print_table(&runtime.block_on(run()));
        return;
    }
    compare_tracing(&runtime);
}

/// Tracing off against tracing on, alternating: two server-and-agent
/// setups live side by side, one on a runtime without a subscriber (as
/// the services run without an OTLP endpoint), one on a runtime whose
/// threads export every span (100 % sampling) to an OTLP collector; each of
/// `CP_BENCH_ROUNDS` rounds measures every figure on both, in alternating
/// order, so drift in this machine's speed hits both alike. Reports the
/// median of the per-round ratios, and the spread.
fn compare_tracing(runtime: &tokio::runtime::Runtime) {
    let mib = env_u64("CP_BENCH_MIB", 1024);
    let connects = env_u64("CP_BENCH_CONNECTS", 2_000);
    let rounds = env_u64("CP_BENCH_ROUNDS", 5).max(1);
    let (collector, collector_addr, stop) = runtime
        .block_on(e2e::otlp::Collector::start())
        .expect("collector");
    let config = TelemetryConfig {
        endpoint: Some(format!("http://{collector_addr}")),
        sampler: SamplerChoice::AlwaysOn,
        ..TelemetryConfig::off("tunnel-bench")
    };
    let (dispatch, telemetry) = {
        let _entered = runtime.enter();
        telemetry::export_dispatch(&config)
            .expect("telemetry")
            .expect("an endpoint")
    };
    // With a single registered dispatcher, tracing computes a callsite's
    // interest from the subscriber of the thread that first hits it: the
    // off setup would then disable the connection spans for good. A second
    // registered (no-op) dispatcher makes it ask both. The off setup pays a
    // thread-local read per span callsite for it, as a process with tracing
    // configured but not on that thread would.
    let _second_dispatcher = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    // Every thread of this runtime (workers and blocking threads) exports;
    // the thread-local default lives as long as the thread, so its guard
    // is deliberately never dropped.
    let traced = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(move || std::mem::forget(tracing::dispatcher::set_default(&dispatch)))
        .build()
        .expect("tokio runtime");
    let off = runtime.block_on(setup());
    let on = traced.block_on(setup());
    let bytes = mib * 1024 * 1024;
    println!(
        "tracing off vs on, {rounds} rounds alternating; single transfers {mib} MiB, {connects} connects"
    );
    let figures = [
        "1 conn up",
        "1 conn down",
        "connects/s",
        "connects/s (8 parallel)",
    ];
    // ratios[path][figure][round]
    let mut ratios = vec![vec![Vec::new(); figures.len()]; 2];
    for round in 0..rounds {
        for (p, path_index) in [1usize, 2].into_iter().enumerate() {
            for (f, _) in figures.iter().enumerate() {
                let measure = |setup: &Setup, rt: &tokio::runtime::Runtime| {
                    let path = &setup.paths[path_index];
                    rt.block_on(async {
                        match f {
                            0 => throughput(path, setup.bulk.addr.port(), 1, bytes, true).await,
                            1 => throughput(path, setup.bulk.addr.port(), 1, bytes, false).await,
                            2 => {
                                connects_per_second(path, setup.echo.addr.port(), connects, 1).await
                            }
                            _ => {
                                connects_per_second(path, setup.echo.addr.port(), connects, 8).await
                            }
                        }
                    })
                };
                let (off_value, on_value) = if round % 2 == 0 {
                    let o = measure(&off, runtime);
                    (o, measure(&on, &traced))
                } else {
                    let n = measure(&on, &traced);
                    (measure(&off, runtime), n)
                };
                ratios[p][f].push(on_value / off_value);
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    runtime.block_on(telemetry.shutdown());
    println!(
        "spans received: {} (server `tunnel.connection` spans: {})\n",
        collector.spans().len(),
        collector
            .spans()
            .iter()
            .filter(|s| s.name == "tunnel.connection")
            .count()
    );
    stop.cancel();
    println!("| path | {} |", figures.join(" | "));
    println!("|---|{}", "---|".repeat(figures.len()));
    for (p, name) in ["tunnel, gRPC client", "tunnel, HTTP CONNECT"]
        .iter()
        .enumerate()
    {
        let cells: Vec<String> = ratios[p]
            .iter()
            .map(|per_round| {
                let mut sorted = per_round.clone();
                sorted.sort_by(f64::total_cmp);
                let median = sorted[sorted.len() / 2];
                format!(
                    "{:.1} % ({:.0}–{:.0})",
                    median * 100.0,
                    sorted[0] * 100.0,
                    sorted[sorted.len() - 1] * 100.0
                )
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    println!("\nTracing on ÷ off: median of the rounds' ratios (lowest–highest round).");
}

/// A server, an agent, the targets and the three paths to them.
struct Setup {
    paths: [Path; 3],
    bulk: BulkServer,
    echo: EchoServer,
    cpu_latency: Option<std::fs::File>,
    _agent: proxy_agent::RunningAgent,
    _server: proxy_server::RunningServer,
}

async fn setup() -> Setup {
    let pki = TestPki::new(&["bench"]).expect("pki");
    let mut config = test_server_config();
    config.backend_dial_timeout = Duration::from_secs(30);
    let server = proxy_server::start_with_tls(config, pki.server_tls().expect("tls"))
        .await
        .expect("server");
    let cpu_latency = hold_cpu_latency();
    let mut agent_config = proxy_agent::AgentConfig::new(proxy_agent::TlsSource::Config(
        pki.agent_tls("bench").expect("tls"),
    ))
    .with_ephemeral_ports();
    agent_config.proxy_server_host = "localhost".into();
    agent_config.proxy_server_port = server.agent_addr.port();
    agent_config.agent_identifiers = "host=bench".into();
    agent_config
        .host_aliases
        .insert("bench".into(), [127, 0, 0, 1].into());
    let agent = proxy_agent::start(agent_config).await.expect("agent");
    assert!(
        agent.wait_for_tunnels(1, Duration::from_secs(10)).await,
        "agent did not connect"
    );
    let bulk = BulkServer::start().await.expect("bulk target");
    let echo = EchoServer::start().await.expect("echo target");

    let grpc = tunnel_client(pki.client_tls().expect("tls"), server.client_addr)
        .await
        .expect("grpc client");
    let connect_tls = pki
        .client_tls_alpn(&[cluster_proxy_proto::transport::ALPN_HTTP11])
        .expect("tls");
    let client_addr = server.client_addr;
    let paths = [
        Path {
            name: "direct TCP",
            dial: Box::new(|port| {
                Box::pin(async move {
                    let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .expect("connect");
                    s.set_nodelay(true).expect("nodelay");
                    Box::new(s) as BoxIo
                })
            }),
        },
        Path {
            name: "tunnel, gRPC client",
            dial: Box::new(move |port| {
                let grpc = grpc.clone();
                Box::pin(async move {
                    Box::new(grpc.dial(&format!("bench:{port}")).await.expect("dial")) as BoxIo
                })
            }),
        },
        Path {
            name: "tunnel, HTTP CONNECT",
            dial: Box::new(move |port| {
                let tls = connect_tls.clone();
                Box::pin(async move {
                    Box::new(
                        http_connect(tls, client_addr, &format!("bench:{port}"))
                            .await
                            .expect("connect"),
                    ) as BoxIo
                })
            }),
        },
    ];
    Setup {
        paths,
        bulk,
        echo,
        cpu_latency,
        _agent: agent,
        _server: server,
    }
}

async fn run() -> Rows {
    let mib = env_u64("CP_BENCH_MIB", 1024);
    let rtt_count = env_u64("CP_BENCH_RTT", 10_000);
    let connects = env_u64("CP_BENCH_CONNECTS", 2_000);
    let idle = env_u64("CP_BENCH_IDLE", 1_000);
    let Setup {
        paths,
        bulk,
        echo,
        cpu_latency,
        ..
    } = &setup().await;

    let bytes = mib * 1024 * 1024;
    println!(
        "cluster-proxy tunnel benchmark (loopback, {} CPUs)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "idle CPUs: {}",
        if cpu_latency.is_some() {
            "held polling (CP_BENCH_CPU_LATENCY)"
        } else {
            "default (may halt; adds wake-up latency)"
        }
    );
    println!(
        "single transfers: {mib} MiB; 8 connections: {} MiB each; {rtt_count} round trips; {connects} connects; {idle} idle connections\n",
        mib / 8
    );
    let mut rows: Rows = Vec::new();
    for path in paths {
        let up1 = throughput(path, bulk.addr.port(), 1, bytes, true).await;
        let down1 = throughput(path, bulk.addr.port(), 1, bytes, false).await;
        let up8 = throughput(path, bulk.addr.port(), 8, bytes / 8, true).await;
        let down8 = throughput(path, bulk.addr.port(), 8, bytes / 8, false).await;
        let (p50, p99) = round_trips(path, echo.addr.port(), rtt_count).await;
        let cps = connects_per_second(path, echo.addr.port(), connects, 1).await;
        let cps8 = connects_per_second(path, echo.addr.port(), connects, 8).await;
        let mem = idle_bytes_per_connection(path, echo.addr.port(), idle).await;
        eprintln!("measured {}", path.name);
        rows.push((
            path.name,
            vec![
                up1,
                down1,
                up8,
                down8,
                p50.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6,
                cps,
                cps8,
                mem / 1024.0,
            ],
        ));
    }
    rows
}

fn print_table(rows: &Rows) {
    let headers = [
        "1 conn up Gbit/s",
        "1 conn down Gbit/s",
        "8 conn up Gbit/s",
        "8 conn down Gbit/s",
        "RTT p50 µs",
        "RTT p99 µs",
        "connects/s",
        "connects/s (8 parallel)",
        "idle KiB/conn",
    ];
    println!("| path | {} |", headers.join(" | "));
    println!("|---|{}", "---|".repeat(headers.len()));
    let direct = rows[0].1.clone();
    for (name, values) in rows {
        let cells: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if *name == "direct TCP" {
                    format!("{v:.2}")
                } else if matches!(i, 4 | 5 | 8) {
                    format!("{v:.1} (+{:.1})", v - direct[i])
                } else {
                    format!("{v:.2} ({:.0} %)", v / direct[i] * 100.0)
                }
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    println!(
        "\nThroughput and connects/s: percent of direct TCP. Latency and memory: added over direct TCP."
    );
    println!(
        "Idle memory is this process's RSS growth per open connection (client, server, agent and target together)."
    );
}
