//! Tunnel benchmark: direct TCP vs the tunnel (gRPC client and HTTP CONNECT),
//! measured in one run on loopback with a real server, agent and mTLS, beside
//! two reference chains of two relays each (plain TCP, and mutual TLS with
//! the tunnel's own TLS configurations) that carry connections the same two
//! hops with no tunnel protocol.
//!
//! `cargo bench -p e2e --bench tunnel` (env: `CP_BENCH_MIB` bytes per
//! single-connection transfer, default 1024; `CP_BENCH_RTT` round trips,
//! default 10000; `CP_BENCH_CONNECTS`, default 2000; `CP_BENCH_IDLE`, default 1000;
//! `CP_BENCH_PATHS` the paths besides direct TCP; `CP_BENCH_WORKER_THREADS`;
//! `CP_BENCH_LEAN_FRAMING=0` runs the agent's tunnel on gRPC over HTTP/2
//! instead of the lean framing, as with an upstream server; processes
//! started from binaries take the agent's own `PROXY_AGENT_LEAN_FRAMING`).
//!
//! `CP_BENCH_TRACING=1` compares tracing off and on instead (see
//! [`compare_tracing`]): single-connection throughput, connects/s and round-trip time, in
//! `CP_BENCH_ROUNDS` (5) alternating rounds, reported as ratios
//! (`CP_BENCH_FIGURES` picks which of them each round measures).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::trace::BoxedTracer;
use cluster_proxy_runtime::telemetry::{self, SamplerChoice, TelemetryConfig};
use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::targets::EchoServer;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tunnel_harness::child::{ChildTunnel, ChildTunnelOptions};
use tunnel_harness::in_process::{http_connect, test_server_config, tunnel_client};
use tunnel_harness::loadgen::{BulkServer, download, knob, process_usage, rss_bytes, upload};
use tunnel_harness::pki::TestPki;

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type BoxIo = Box<dyn Io>;
type Dial = Box<dyn Fn(u16) -> Pin<Box<dyn Future<Output = BoxIo> + Send>> + Send + Sync>;

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

/// [`connects_per_second`] through the gRPC client with the 1-byte request
/// sent with the dial ([`TunnelClient::dial_with_early_data`]): the agent
/// writes it to the target before answering, one tunneled round trip fewer.
async fn early_data_connects_per_second(
    client: &TunnelClient,
    port: u16,
    count: u64,
    parallel: u64,
) -> f64 {
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..parallel {
        let client = client.clone();
        let address = format!("bench:{port}");
        workers.push(tokio::spawn(async move {
            for _ in 0..count / parallel {
                let mut io = client
                    .dial_with_early_data(&address, bytes::Bytes::from_static(&[1]))
                    .await
                    .expect("dial");
                let mut byte = [0u8; 1];
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

/// The two ways through the client port at `client_addr` to cluster
/// `bench`: a held gRPC client connection (one stream per dial, traced with
/// `tracer` when given) and HTTP CONNECT (a new mTLS connection per dial).
async fn tunnel_paths(
    pki: &TestPki,
    client_addr: SocketAddr,
    tracer: Option<BoxedTracer>,
) -> [Path; 2] {
    let grpc = tunnel_client(pki.client_tls().expect("tls"), client_addr)
        .await
        .expect("grpc client");
    let grpc = match tracer {
        Some(tracer) => grpc.with_tracer(tracer),
        None => grpc,
    };
    let connect_tls = pki
        .client_tls_alpn(&[cluster_proxy_proto::transport::ALPN_HTTP11])
        .expect("tls");
    [
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
    ]
}

/// The TLS of the reference relays: the configurations the tunnel's own
/// ends use (the same certificates, cipher suites and session resumption).
struct RelayTls {
    /// What the hub relay serves to the client, as the server's client port.
    hub: Arc<rustls::ServerConfig>,
    /// What the hub relay presents when it opens the second hop.
    hop: Arc<rustls::ClientConfig>,
    /// What the cluster relay serves on the second hop.
    cluster: Arc<rustls::ServerConfig>,
}

/// Size of each relay's copy buffers, large enough that a TLS relay reads
/// and writes whole records.
const RELAY_BUFFER: usize = 64 * 1024;

/// Two relays in this process, a hub relay and a cluster relay, that carry
/// each connection the way the server and the agent do, client → hub relay
/// → cluster relay → target, with none of the tunnel's protocol: each
/// connection is its own TCP (or mutual-TLS) connection on both hops, and
/// the relays only copy bytes. The client names the target port in the
/// connection's first two bytes (big-endian). A reference for the tunnel's
/// figures: what two hops cost on this machine, without (`tls: None`) and
/// with the two TLS terminations per byte the tunnel also makes.
async fn start_relays(tls: Option<RelayTls>) -> std::io::Result<SocketAddr> {
    let tls = tls.map(Arc::new);
    let cluster = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let cluster_addr = cluster.local_addr()?;
    let cluster_tls = tls.as_ref().map(|t| t.cluster.clone());
    tokio::spawn(serve_relay(cluster, cluster_tls, move |port| async move {
        let target = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        target.set_nodelay(true)?;
        Ok(Box::new(target) as BoxIo)
    }));
    let hub = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let hub_addr = hub.local_addr()?;
    let hub_tls = tls.as_ref().map(|t| t.hub.clone());
    let hop_tls = tls.as_ref().map(|t| t.hop.clone());
    tokio::spawn(serve_relay(hub, hub_tls, move |port| {
        let hop_tls = hop_tls.clone();
        async move {
            let mut next = relay_dial(cluster_addr, hop_tls).await?;
            next.write_all(&port.to_be_bytes()).await?;
            Ok(next)
        }
    }));
    Ok(hub_addr)
}

/// Accepts connections on `listener` (terminating TLS with `tls` when
/// given), reads the target port each names, opens the next hop with
/// `onward` and copies bytes both ways until either side closes.
async fn serve_relay<F, Fut>(
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    onward: F,
) where
    F: Fn(u16) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = std::io::Result<BoxIo>> + Send,
{
    loop {
        let (tcp, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: let connections close
                // rather than spin on the error.
                eprintln!("relay: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let tls = tls.clone();
        let onward = onward.clone();
        tokio::spawn(async move {
            let relayed = async {
                tcp.set_nodelay(true)?;
                let mut inbound: BoxIo = match tls {
                    Some(config) => {
                        Box::new(tokio_rustls::TlsAcceptor::from(config).accept(tcp).await?)
                    }
                    None => Box::new(tcp),
                };
                let mut port = [0u8; 2];
                inbound.read_exact(&mut port).await?;
                let mut outbound = onward(u16::from_be_bytes(port)).await?;
                tokio::io::copy_bidirectional_with_sizes(
                    &mut inbound,
                    &mut outbound,
                    RELAY_BUFFER,
                    RELAY_BUFFER,
                )
                .await
                .map(drop)
            };
            if let Err(e) = relayed.await {
                // A peer closing mid-copy, or without TLS close_notify (the
                // benchmark drops its connections), ends the connection.
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
                ) {
                    eprintln!("relay: {e}");
                }
            }
        });
    }
}

/// A TCP connection to `addr`, inside mutual TLS when `tls` is given.
async fn relay_dial(
    addr: SocketAddr,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> std::io::Result<BoxIo> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    Ok(match tls {
        Some(config) => {
            let name = rustls::pki_types::ServerName::try_from("localhost")
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            Box::new(
                tokio_rustls::TlsConnector::from(config)
                    .connect(name, tcp)
                    .await?,
            )
        }
        None => Box::new(tcp),
    })
}

const TCP_RELAYS: &str = "two TCP relays (reference)";
const TLS_RELAYS: &str = "two mTLS relays (reference)";

/// A benchmark path through the relays at `hub` (see [`start_relays`]).
fn relay_path(name: &'static str, hub: SocketAddr, tls: Option<Arc<rustls::ClientConfig>>) -> Path {
    Path {
        name,
        dial: Box::new(move |port| {
            let tls = tls.clone();
            Box::pin(async move {
                let mut io = relay_dial(hub, tls).await.expect("relay dial");
                io.write_all(&port.to_be_bytes()).await.expect("relay port");
                io
            })
        }),
    }
}

type Rows = Vec<(&'static str, Vec<f64>)>;

fn main() {
    // The subscriber every service installs (`logging::init`, as with no
    // OTLP endpoint). Without one, `tracing`'s `log` feature (on through
    // kube-client) sends every disabled span's record and drop through its
    // `log` fallback: 19 % of the in-process CONNECT path's instructions,
    // a cost no deployed process pays.
    cluster_proxy_runtime::logging::init(0, cluster_proxy_runtime::logging::LogFormat::Text);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // `CP_BENCH_WORKER_THREADS`: the in-process run's worker threads (the
    // client, server, agent, relays and targets share them; default one per
    // CPU). With 1, every hand-off between tasks stays on one thread.
    let workers = knob("CP_BENCH_WORKER_THREADS", 0);
    if workers > 0 {
        builder.worker_threads(workers as usize);
    }
    let runtime = builder.enable_all().build().expect("tokio runtime");
    let tracing = std::env::var("CP_BENCH_TRACING").is_ok_and(|v| v == "1");
    if !tracing {
        print_table(&runtime.block_on(run()));
        return;
    }
    compare_tracing(&runtime);
}

/// Tracing off against tracing on, alternating, with the services as they
/// run in production: two proxy-server + proxy-agent pairs as child
/// processes, one without an OTLP endpoint, one whose processes export every
/// span (`OTEL_TRACES_SAMPLER=always_on`) to a collector in this process
/// that only counts them (the least a receiver does). The clients run here:
/// the "on" clients on a runtime of their own, exporting their `tunnel.dial`
/// spans too. Each of `CP_BENCH_ROUNDS` rounds measures every figure on
/// both pairs, in alternating order, so drift in this machine's speed hits
/// both alike. Reports the median of the per-round ratios and the spread,
/// and the server's and agent's CPU time over all rounds.
fn compare_tracing(runtime: &tokio::runtime::Runtime) {
    let mib = knob("CP_BENCH_MIB", 1024) as u64;
    let connects = knob("CP_BENCH_CONNECTS", 2_000) as u64;
    let rounds = (knob("CP_BENCH_ROUNDS", 5) as u64).max(1);
    let round_trip_count = knob("CP_BENCH_RTT", 10_000) as u64;
    let (collector, collector_addr, stop) = runtime
        .block_on(simulated_cluster::otlp::Collector::start_counting())
        .expect("collector");
    let endpoint = format!("http://{collector_addr}");
    let config = TelemetryConfig {
        endpoint: Some(endpoint.clone()),
        sampler: SamplerChoice::AlwaysOn,
        ..TelemetryConfig::off("bench-client")
    };
    let traced_parts =
        std::env::var("CP_BENCH_TRACED").unwrap_or_else(|_| "client,server,agent".to_owned());
    let traces = |part: &str| traced_parts.split(',').any(|p| p.trim() == part);
    let sampler = std::env::var("CP_BENCH_SAMPLER").unwrap_or_else(|_| "always_on".to_owned());
    // E.g. `0.1` with `parentbased_traceidratio`: the ratio of traces kept.
    let sampler_arg = std::env::var("CP_BENCH_SAMPLER_ARG").ok();
    let config = TelemetryConfig {
        sampler: SamplerChoice::parse(Some(&sampler), sampler_arg.as_deref())
            .expect("CP_BENCH_SAMPLER and CP_BENCH_SAMPLER_ARG"),
        ..config
    };
    let telemetry = {
        let _entered = runtime.enter();
        telemetry::exporter(&config)
            .expect("telemetry")
            .expect("an endpoint")
    };
    let client_tracer = traces("client")
        .then(|| telemetry.connection_tracer())
        .flatten();
    // The "on" side's clients, targets and tasks run on a runtime of their
    // own, so that each side's work stays on its own threads.
    let traced = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");

    let binaries = Binaries::build(Progress::Quiet).expect("building the services");
    let pki = TestPki::new(&["bench"]).expect("pki");
    let cluster = ClusterName::new("bench").expect("cluster name");
    let exporting = |part: &str| {
        if !traces(part) {
            return Vec::new();
        }
        let mut env = vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), endpoint.clone()),
            (
                "OTEL_SERVICE_NAME".to_owned(),
                format!("bench-proxy-{part}"),
            ),
            ("OTEL_TRACES_SAMPLER".to_owned(), sampler.clone()),
        ];
        if let Some(arg) = &sampler_arg {
            env.push(("OTEL_TRACES_SAMPLER_ARG".to_owned(), arg.clone()));
        }
        env
    };
    // `CP_BENCH_ON_ENV` (`NAME=value,NAME=value`): more variables for the
    // "on" side's server and agent, e.g. with `CP_BENCH_TRACED=none` to
    // compare a runtime setting instead of tracing.
    let on_env: Vec<(String, String)> = std::env::var("CP_BENCH_ON_ENV")
        .unwrap_or_default()
        .split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| {
            let (name, value) = pair
                .split_once('=')
                .expect("CP_BENCH_ON_ENV: NAME=value pairs separated by commas");
            (name.trim().to_owned(), value.trim().to_owned())
        })
        .collect();
    let off_options = ChildTunnelOptions::default();
    let on_options = ChildTunnelOptions {
        server_env: [exporting("server"), on_env.clone()].concat(),
        agent_env: [exporting("agent"), on_env.clone()].concat(),
        ..ChildTunnelOptions::default()
    };
    let off = runtime
        .block_on(ChildTunnel::start(
            &binaries,
            &pki,
            &cluster,
            "off",
            &off_options,
        ))
        .expect("processes without tracing");
    let on = traced
        .block_on(ChildTunnel::start(
            &binaries,
            &pki,
            &cluster,
            "on",
            &on_options,
        ))
        .expect("processes with tracing");
    // Each side's targets run on that side's runtime: a target on the other
    // runtime would add a cross-runtime wake-up to every round trip of one
    // side only.
    let targets = || async {
        (
            BulkServer::start().await.expect("bulk target"),
            EchoServer::start().await.expect("echo target"),
        )
    };
    let off_targets = runtime.block_on(targets());
    let on_targets = traced.block_on(targets());
    let _cpu_latency = hold_cpu_latency();
    let off_paths = runtime.block_on(tunnel_paths(&pki, off.client_addr(), None));
    let on_paths = traced.block_on(tunnel_paths(&pki, on.client_addr(), client_tracer));
    let bytes = mib * 1024 * 1024;

    let figures = [
        "1 conn up",
        "1 conn down",
        "connects/s",
        "connects/s (8 parallel)",
        "RTT p50 (lower is better)",
    ];
    // `CP_BENCH_FIGURES` (`up,down,connects,connects8,rtt`, default all):
    // the figures each round measures, e.g. only the connects, for more
    // rounds of them in the same time.
    let figure_names = ["up", "down", "connects", "connects8", "rtt"];
    let chosen = std::env::var("CP_BENCH_FIGURES").unwrap_or_else(|_| figure_names.join(","));
    let measured: Vec<bool> = figure_names
        .iter()
        .map(|name| chosen.split(',').any(|c| c.trim() == *name))
        .collect();
    assert!(
        chosen.split(',').all(|c| figure_names.contains(&c.trim())),
        "CP_BENCH_FIGURES: {chosen:?}; known: {figure_names:?}"
    );
    println!(
        "tracing off vs on (proxy-server and proxy-agent as processes), {rounds} rounds alternating, figures {chosen}; single transfers {mib} MiB, {connects} connects, {round_trip_count} round trips; traced: {traced_parts}, sampler {sampler} {}; more for the \"on\" side: {on_env:?}",
        sampler_arg.as_deref().unwrap_or("")
    );
    // ratios[path][figure][round]
    let mut ratios = vec![vec![Vec::new(); figures.len()]; 2];
    // The measured values, [path][figure][off, on][round].
    let mut values = vec![vec![[Vec::new(), Vec::new()]; figures.len()]; 2];
    // Server + agent CPU seconds, [off, on], per path.
    let mut cpu = [[0.0f64; 2]; 2];
    // CPU seconds of [server, agent, this process] during the connects
    // figures, [path][off, on].
    let mut connect_cpu = [[[0.0f64; 3]; 2]; 2];
    // The same during the single transfers, with their wall time:
    // [path][off, on].
    let mut transfer_cpu = [[[0.0f64; 3]; 2]; 2];
    let mut transfer_seconds = [[0.0f64; 2]; 2];
    let cpu_parts = |processes: &ChildTunnel| {
        let (server, agent) = processes.usage().expect("/proc of the services");
        let own = process_usage(std::process::id()).expect("/proc/self");
        [server.cpu_seconds, agent.cpu_seconds, own.cpu_seconds]
    };
    for round in 0..rounds {
        for (p, path_ratios) in ratios.iter_mut().enumerate() {
            for (f, figure_ratios) in path_ratios.iter_mut().enumerate() {
                if !measured[f] {
                    continue;
                }
                let mut measure = |on_side: bool| {
                    let (paths, rt, processes, (bulk, echo)) = if on_side {
                        (&on_paths, &traced, &on, &on_targets)
                    } else {
                        (&off_paths, runtime, &off, &off_targets)
                    };
                    let path = &paths[p];
                    let cpu_before = cpu_parts(processes);
                    let started = Instant::now();
                    let value = rt.block_on(async {
                        match f {
                            0 => throughput(path, bulk.addr.port(), 1, bytes, true).await,
                            1 => throughput(path, bulk.addr.port(), 1, bytes, false).await,
                            2 => connects_per_second(path, echo.addr.port(), connects, 1).await,
                            3 => connects_per_second(path, echo.addr.port(), connects, 8).await,
                            _ => round_trips(path, echo.addr.port(), round_trip_count)
                                .await
                                .0
                                .as_secs_f64(),
                        }
                    });
                    let cpu_after = cpu_parts(processes);
                    let side = usize::from(on_side);
                    cpu[p][side] += (cpu_after[0] - cpu_before[0]) + (cpu_after[1] - cpu_before[1]);
                    let parts = match f {
                        0 | 1 => {
                            transfer_seconds[p][side] += started.elapsed().as_secs_f64();
                            Some(&mut transfer_cpu[p][side])
                        }
                        2 | 3 => Some(&mut connect_cpu[p][side]),
                        _ => None,
                    };
                    for (part, total) in parts.into_iter().flatten().enumerate() {
                        *total += cpu_after[part] - cpu_before[part];
                    }
                    value
                };
                let (off_value, on_value) = if round % 2 == 0 {
                    let o = measure(false);
                    (o, measure(true))
                } else {
                    let n = measure(true);
                    (measure(false), n)
                };
                figure_ratios.push(on_value / off_value);
                values[p][f][0].push(off_value);
                values[p][f][1].push(on_value);
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    runtime.block_on(telemetry.shutdown());
    // SIGTERM flushes the services' last batches.
    traced
        .block_on(on.stop())
        .expect("stopping the traced processes");
    let counts = collector.counts();
    println!(
        "spans received: {} ({})\n",
        counts.values().sum::<u64>(),
        counts
            .iter()
            .map(|(name, count)| format!("{name} {count}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    stop.cancel();
    println!("| path | {} | server + agent CPU |", figures.join(" | "));
    println!("|---|{}---|", "---|".repeat(figures.len()));
    for (p, name) in off_paths.iter().map(|path| path.name).enumerate() {
        let cells: Vec<String> = ratios[p]
            .iter()
            .map(|per_round| {
                let sorted = sorted(per_round);
                match (sorted.first(), sorted.last()) {
                    (Some(lowest), Some(highest)) => format!(
                        "{:.1} % ({:.0}–{:.0})",
                        median(&sorted) * 100.0,
                        lowest * 100.0,
                        highest * 100.0
                    ),
                    _ => "—".to_owned(),
                }
            })
            .collect();
        println!(
            "| {name} | {} | {:.1} s off, {:.1} s on ({:+.1} %) |",
            cells.join(" | "),
            cpu[p][0],
            cpu[p][1],
            (cpu[p][1] / cpu[p][0].max(1e-9) - 1.0) * 100.0
        );
    }
    println!(
        "\nTracing on ÷ off: median of the rounds' ratios (lowest–highest round). CPU: the same work on both sides, summed over every round."
    );
    println!("\nThe values, median of the rounds, off → on:");
    println!("| path | {} |", figures.join(" | "));
    println!("|---|{}", "---|".repeat(figures.len()));
    for (p, name) in off_paths.iter().map(|path| path.name).enumerate() {
        let cells: Vec<String> = values[p]
            .iter()
            .enumerate()
            .map(|(f, sides)| {
                if !measured[f] {
                    return "—".to_owned();
                }
                let [off, on] = sides.each_ref().map(|v| median(&sorted(v)));
                match f {
                    0 | 1 => format!("{off:.2} → {on:.2} Gbit/s"),
                    2 | 3 => format!("{off:.0} → {on:.0} /s"),
                    _ => format!("{:.0} → {:.0} µs", off * 1e6, on * 1e6),
                }
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    // The connects figures measured, every round: rounds × connects each.
    let counted = |figures: &[usize]| figures.iter().filter(|f| measured[**f]).count() as u64;
    if counted(&[2, 3]) > 0 {
        print_connect_cpu(
            &off_paths,
            &connect_cpu,
            (counted(&[2, 3]) * rounds * connects) as f64,
        );
    }
    if counted(&[0, 1]) > 0 {
        print_transfer_cpu(
            &off_paths,
            &transfer_cpu,
            &transfer_seconds,
            (counted(&[0, 1]) * rounds * bytes) as f64 / 1e9,
        );
    }
}

/// CPU per connection of each process in the connects figures.
fn print_connect_cpu(paths: &[Path], connect_cpu: &[[[f64; 3]; 2]; 2], connections: f64) {
    println!("\nCPU per connection in the connects figures, µs, off → on:");
    println!("| path | proxy-server | proxy-agent | benchmark (clients, targets, receiver) |");
    println!("|---|---|---|---|");
    for (p, name) in paths.iter().map(|path| path.name).enumerate() {
        let cells: Vec<String> = (0..3)
            .map(|part| {
                format!(
                    "{:.0} → {:.0}",
                    connect_cpu[p][0][part] / connections * 1e6,
                    connect_cpu[p][1][part] / connections * 1e6
                )
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
}

/// CPU per GB of each process in the single transfers, and the cores
/// they kept busy.
fn print_transfer_cpu(
    paths: &[Path],
    transfer_cpu: &[[[f64; 3]; 2]; 2],
    transfer_seconds: &[[f64; 2]; 2],
    gigabytes: f64,
) {
    println!(
        "\nThe single transfers: CPU seconds per GB moved (decimal GB) and the cores all three processes kept busy, off → on:"
    );
    println!(
        "| path | proxy-server | proxy-agent | benchmark (client, target) | cores busy (of {}) |",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("|---|---|---|---|---|");
    for (p, name) in paths.iter().map(|path| path.name).enumerate() {
        let mut cells: Vec<String> = (0..3)
            .map(|part| {
                format!(
                    "{:.2} → {:.2}",
                    transfer_cpu[p][0][part] / gigabytes,
                    transfer_cpu[p][1][part] / gigabytes
                )
            })
            .collect();
        let busy = |side: usize| {
            transfer_cpu[p][side].iter().sum::<f64>() / transfer_seconds[p][side].max(1e-9)
        };
        cells.push(format!("{:.2} → {:.2}", busy(0), busy(1)));
        println!("| {name} | {} |", cells.join(" | "));
    }
}

/// `values` in ascending order.
fn sorted(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

/// The middle of `sorted` (the upper one of an even count).
fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

/// A server, an agent, the targets and the paths to them: direct, the two
/// reference relay chains and the tunnel's two front doors.
struct Setup {
    paths: [Path; 5],
    bulk: BulkServer,
    echo: EchoServer,
    cpu_latency: Option<std::fs::File>,
    /// A gRPC client of its own for the early-data connects.
    early: TunnelClient,
    _agent: proxy_agent::RunningAgent,
    _server: proxy_server::RunningServer,
}

/// `idle`: how many connections the idle-memory figure holds at once, all
/// streams of one gRPC client connection, so the server must allow that many
/// concurrent streams (beyond its limit a dial would wait for a free stream
/// forever).
async fn setup(idle: u64) -> Setup {
    let pki = TestPki::new(&["bench"]).expect("pki");
    let mut config = test_server_config();
    config.backend_dial_timeout = Duration::from_secs(30);
    let idle_streams = u32::try_from(idle).unwrap_or(u32::MAX);
    config.max_concurrent_streams = config.max_concurrent_streams.max(idle_streams);
    let server = proxy_server::start_with_tls(config, pki.server_tls().expect("tls"))
        .await
        .expect("server");
    let cpu_latency = hold_cpu_latency();
    let mut agent_config = proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Config(
        pki.agent_tls("bench").expect("tls"),
    ))
    .with_ephemeral_ports();
    agent_config.proxy_server_host = "localhost".into();
    agent_config.proxy_server_port = server.agent_addr.port();
    agent_config.agent_identifiers = "host=bench".into();
    agent_config.lean_framing = knob("CP_BENCH_LEAN_FRAMING", 1) != 0;
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

    let [grpc, connect] = tunnel_paths(&pki, server.client_addr, None).await;
    let tcp_relays = start_relays(None).await.expect("TCP relays");
    let relay_tls = RelayTls {
        hub: pki.frontend_server_config().expect("tls"),
        hop: pki.client_tls().expect("tls"),
        cluster: pki.frontend_server_config().expect("tls"),
    };
    let tls_relays = start_relays(Some(relay_tls)).await.expect("TLS relays");
    let early = tunnel_client(pki.client_tls().expect("tls"), server.client_addr)
        .await
        .expect("grpc client");
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
        relay_path(TCP_RELAYS, tcp_relays, None),
        relay_path(TLS_RELAYS, tls_relays, Some(pki.client_tls().expect("tls"))),
        grpc,
        connect,
    ];
    Setup {
        paths,
        bulk,
        echo,
        cpu_latency,
        early,
        _agent: agent,
        _server: server,
    }
}

async fn run() -> Rows {
    let mib = knob("CP_BENCH_MIB", 1024) as u64;
    let rtt_count = knob("CP_BENCH_RTT", 10_000) as u64;
    let connects = knob("CP_BENCH_CONNECTS", 2_000) as u64;
    let idle = knob("CP_BENCH_IDLE", 1_000) as u64;
    // `CP_BENCH_PATHS` (`tcp-relays,tls-relays,grpc,connect`, default all):
    // the paths measured besides direct TCP, the baseline of every ratio.
    let path_names = [
        ("direct", "direct TCP"),
        ("tcp-relays", TCP_RELAYS),
        ("tls-relays", TLS_RELAYS),
        ("grpc", "tunnel, gRPC client"),
        ("connect", "tunnel, HTTP CONNECT"),
    ];
    let chosen = std::env::var("CP_BENCH_PATHS").ok();
    if let Some(unknown) = chosen
        .iter()
        .flat_map(|c| c.split(','))
        .map(str::trim)
        .find(|c| !c.is_empty() && !path_names.iter().any(|(short, _)| short == c))
    {
        eprintln!(
            "CP_BENCH_PATHS: unknown path {unknown:?}; known: tcp-relays, tls-relays, grpc, connect"
        );
        std::process::exit(2);
    }
    let measured = |name: &str| {
        let short = path_names
            .iter()
            .find(|(_, long)| *long == name)
            .map_or("", |(short, _)| *short);
        short == "direct"
            || chosen
                .as_ref()
                .is_none_or(|chosen| chosen.split(',').any(|c| c.trim() == short))
    };
    let Setup {
        paths,
        bulk,
        echo,
        cpu_latency,
        early,
        ..
    } = &setup(idle).await;

    let bytes = mib * 1024 * 1024;
    println!(
        "cluster-proxy tunnel benchmark (loopback, {} CPUs, {} worker threads)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        tokio::runtime::Handle::current().metrics().num_workers()
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
    let mut early_rows = Vec::new();
    for path in paths.iter().filter(|path| measured(path.name)) {
        let up1 = throughput(path, bulk.addr.port(), 1, bytes, true).await;
        let down1 = throughput(path, bulk.addr.port(), 1, bytes, false).await;
        let up8 = throughput(path, bulk.addr.port(), 8, bytes / 8, true).await;
        let down8 = throughput(path, bulk.addr.port(), 8, bytes / 8, false).await;
        let (p50, p99) = round_trips(path, echo.addr.port(), rtt_count).await;
        let cps = connects_per_second(path, echo.addr.port(), connects, 1).await;
        let cps8 = connects_per_second(path, echo.addr.port(), connects, 8).await;
        // The relays' per-connection memory is their copy buffers, not a
        // reference for the tunnel's.
        let mem = if path.name == TCP_RELAYS || path.name == TLS_RELAYS {
            f64::NAN
        } else {
            idle_bytes_per_connection(path, echo.addr.port(), idle).await
        };
        eprintln!("measured {}", path.name);
        if path.name == "tunnel, gRPC client" {
            let early_cps =
                early_data_connects_per_second(early, echo.addr.port(), connects, 1).await;
            let early_cps8 =
                early_data_connects_per_second(early, echo.addr.port(), connects, 8).await;
            early_rows.push((early_cps, early_cps8, cps, cps8));
        }
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
    for (early_cps, early_cps8, cps, cps8) in early_rows {
        let direct = &rows[0].1;
        println!(
            "gRPC client, the 1-byte request sent with the dial (early data): {early_cps:.0} connects/s ({:.0} % of direct, {:.0} % of the plain dial above), {early_cps8:.0} with 8 dialers ({:.0} %, {:.0} %)\n",
            early_cps / direct[6] * 100.0,
            early_cps / cps * 100.0,
            early_cps8 / direct[7] * 100.0,
            early_cps8 / cps8 * 100.0,
        );
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
                if v.is_nan() {
                    "—".to_owned()
                } else if *name == "direct TCP" {
                    format!("{v:.2}")
                } else if matches!(i, 4 | 5 | 8) {
                    format!("{v:.1} ({:+.1})", v - direct[i])
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
    let Some((_, relays)) = rows.iter().find(|(name, _)| *name == TLS_RELAYS) else {
        return;
    };
    if !rows.iter().any(|(name, _)| name.starts_with("tunnel")) {
        return;
    }
    println!(
        "\nThe tunnel against two mTLS relays (the same TLS on both hops, no tunnel protocol; the relays handshake on both hops for every connection):"
    );
    for (name, v) in rows.iter().filter(|(name, _)| name.starts_with("tunnel")) {
        let share = |i: usize| v[i] / relays[i] * 100.0;
        println!(
            "{name}: 1 conn up {:.0} %, down {:.0} %; 8 conn up {:.0} %, down {:.0} %; RTT p50 {:+.1} µs, p99 {:+.1} µs; connects/s {:.0} %, 8 parallel {:.0} %",
            share(0),
            share(1),
            share(2),
            share(3),
            v[4] - relays[4],
            v[5] - relays[5],
            share(6),
            share(7),
        );
    }
}
