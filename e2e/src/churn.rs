//! Connection churn through the real binaries: a proxy-server and a
//! proxy-agent as separate processes, and many short tunneled connections
//! opened and closed through them in a mix of ways (normal close over gRPC
//! and HTTP CONNECT, client reset with SO_LINGER 0, a refused target, and the
//! agent killed with SIGKILL mid-stream, then restarted). Afterwards the
//! processes' file descriptors, threads and resident memory, read from
//! `/proc`, must come back to their baseline within a tolerance.
//!
//! Used by `e2e/tests/churn.rs` (a CI-sized run) and `e2e/examples/churn.rs`
//! (the 100,000 connections).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::transport::ALPN_HTTP11;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::process::{Logs, ProcessSpec, Supervised};
use simulated_cluster::targets::{EchoServer, closed_port};
use tunnel_harness::in_process::{
    ServerPorts, http_connect_to, proxy_agent_args, proxy_server_args, tunnel_client,
};
use tunnel_harness::pki::TestPki;

const CLUSTER: &str = "cluster-a";
/// Longest any single step (a dial, an echo, a close) may take.
const STEP: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum ChurnError {
    #[error("setup: {0}")]
    Setup(String),
    #[error("reading /proc/{pid}: {detail}")]
    Proc { pid: u32, detail: String },
    #[error("{0}")]
    Unexpected(String),
}

fn setup(e: impl std::fmt::Display) -> ChurnError {
    ChurnError::Setup(e.to_string())
}

/// What the churn does.
#[derive(Debug, Clone)]
pub struct ChurnOptions {
    /// Tunneled connections opened and closed (besides warm-up and probes).
    pub connections: usize,
    /// Connections in flight at once.
    pub concurrency: usize,
    /// How often the agent is killed (SIGKILL, mid-stream) and restarted,
    /// spread evenly over the run.
    pub agent_kills: usize,
    /// How long the processes get to come back to their baseline.
    pub settle_deadline: Duration,
    pub tolerance: Tolerance,
}

impl ChurnOptions {
    pub fn new(connections: usize) -> Self {
        ChurnOptions {
            connections,
            concurrency: 32,
            agent_kills: 2,
            settle_deadline: Duration::from_secs(60),
            tolerance: Tolerance::default(),
        }
    }
}

/// How far above its baseline a process may stay after the churn.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    pub fds: usize,
    pub threads: usize,
    pub rss_kib: u64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance {
            fds: 4,
            threads: 2,
            rss_kib: 32 * 1024,
        }
    }
}

/// One look at a process in `/proc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessSample {
    pub fds: usize,
    pub threads: usize,
    pub rss_kib: u64,
}

impl ProcessSample {
    pub fn read(pid: u32) -> Result<Self, ChurnError> {
        let proc_err = |detail: String| ChurnError::Proc { pid, detail };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map_err(|e| proc_err(e.to_string()))?
            .count();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| proc_err(e.to_string()))?;
        let field = |name: &str| -> Result<u64, ChurnError> {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|value| value.parse().ok())
                .ok_or_else(|| proc_err(format!("no {name} in status")))
        };
        Ok(ProcessSample {
            fds,
            threads: usize::try_from(field("Threads:")?).unwrap_or(usize::MAX),
            rss_kib: field("VmRSS:")?,
        })
    }

    /// Whether `self` is no more than `tolerance` above `baseline`.
    pub fn within(&self, baseline: &ProcessSample, tolerance: &Tolerance) -> bool {
        self.fds <= baseline.fds + tolerance.fds
            && self.threads <= baseline.threads + tolerance.threads
            && self.rss_kib <= baseline.rss_kib + tolerance.rss_kib
    }
}

impl std::fmt::Display for ProcessSample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} fds, {} threads, {:.1} MiB RSS",
            self.fds,
            self.threads,
            self.rss_kib as f64 / 1024.0
        )
    }
}

/// How the connections ended, by kind (counted while the workers run).
#[derive(Debug, Default)]
struct Outcomes {
    grpc_closed: AtomicUsize,
    connect_closed: AtomicUsize,
    connect_reset: AtomicUsize,
    refused: AtomicUsize,
    agent_outage: AtomicUsize,
    killed_mid_stream: AtomicUsize,
}

impl Outcomes {
    fn reset(&self) {
        for counter in [
            &self.grpc_closed,
            &self.connect_closed,
            &self.connect_reset,
            &self.refused,
            &self.agent_outage,
            &self.killed_mid_stream,
        ] {
            counter.store(0, Ordering::SeqCst);
        }
    }

    fn counts(&self) -> OutcomeCounts {
        let n = |a: &AtomicUsize| a.load(Ordering::SeqCst);
        OutcomeCounts {
            grpc_closed: n(&self.grpc_closed),
            connect_closed: n(&self.connect_closed),
            connect_reset: n(&self.connect_reset),
            refused: n(&self.refused),
            agent_outage: n(&self.agent_outage),
            killed_mid_stream: n(&self.killed_mid_stream),
        }
    }
}

/// How the connections ended, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutcomeCounts {
    /// Echoed and closed normally over the gRPC frontend.
    pub grpc_closed: usize,
    /// Echoed and closed normally over HTTP CONNECT.
    pub connect_closed: usize,
    /// Reset by the client (SO_LINGER 0) with data in flight.
    pub connect_reset: usize,
    /// Dials to a closed port, refused by the agent as they must be.
    pub refused: usize,
    /// Connections that failed because the agent was being killed or
    /// restarted while they ran (expected).
    pub agent_outage: usize,
    /// Streams open when the agent was killed that the client saw end.
    pub killed_mid_stream: usize,
}

impl std::fmt::Display for OutcomeCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} gRPC closed, {} CONNECT closed, {} CONNECT reset, {} refused, {} failed during agent outages, {} ended by an agent kill mid-stream",
            self.grpc_closed,
            self.connect_closed,
            self.connect_reset,
            self.refused,
            self.agent_outage,
            self.killed_mid_stream
        )
    }
}

/// The numbers of one churn run.
#[derive(Debug)]
pub struct ChurnReport {
    pub connections: usize,
    pub elapsed: Duration,
    pub outcomes: OutcomeCounts,
    pub server_baseline: ProcessSample,
    pub server_peak: ProcessSample,
    pub server_after: ProcessSample,
    pub agent_baseline: ProcessSample,
    pub agent_peak: ProcessSample,
    pub agent_after: ProcessSample,
    /// How long after the last connection both were back within tolerance;
    /// `None` when they were not by the deadline.
    pub settled_after: Option<Duration>,
}

impl std::fmt::Display for ChurnReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} connections in {:.1} s ({:.0}/s): {}",
            self.connections,
            self.elapsed.as_secs_f64(),
            self.connections as f64 / self.elapsed.as_secs_f64().max(0.001),
            self.outcomes
        )?;
        writeln!(
            f,
            "proxy-server: baseline {}; peak {}; after {}",
            self.server_baseline, self.server_peak, self.server_after
        )?;
        writeln!(
            f,
            "proxy-agent:  baseline {}; peak {}; after {}",
            self.agent_baseline, self.agent_peak, self.agent_after
        )?;
        match self.settled_after {
            Some(after) => write!(
                f,
                "back within tolerance {:.1} s after the churn",
                after.as_secs_f64()
            ),
            None => write!(f, "NOT back within tolerance by the deadline"),
        }
    }
}

/// The server and agent processes and how to reach them.
struct Deployment {
    server: Supervised,
    agent: Mutex<Supervised>,
    client_addr: SocketAddr,
    logs: Logs,
}

fn start_processes(
    binaries: &Binaries,
    layout: &cert_authority::files::Layout,
    logs: &Logs,
) -> Result<Deployment, ChurnError> {
    let cluster = ClusterName::new(CLUSTER).map_err(setup)?;
    let ports = ServerPorts::free();
    let server = ProcessSpec::new("proxy-server", &binaries.proxy_server)
        .args(proxy_server_args("churn", &ports, layout));
    let agent = ProcessSpec::new("proxy-agent", &binaries.proxy_agent).args(proxy_agent_args(
        &cluster,
        "churn-agent",
        ports.agent,
        layout,
    ));
    let server = Supervised::start(server, logs).map_err(setup)?;
    let agent = Supervised::start(agent, logs).map_err(setup)?;
    Ok(Deployment {
        server,
        agent: Mutex::new(agent),
        client_addr: ports.client_addr(),
        logs: logs.clone(),
    })
}

/// Writes `payload`, reads it back, half-closes and reads the end.
async fn echo_and_close<S>(stream: &mut S, payload: &[u8]) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream
        .write_all(payload)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut back = vec![0u8; payload.len()];
    stream
        .read_exact(&mut back)
        .await
        .map_err(|e| format!("read: {e}"))?;
    if back != payload {
        return Err("echo returned different bytes".into());
    }
    stream
        .shutdown()
        .await
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut rest = Vec::new();
    stream
        .read_to_end(&mut rest)
        .await
        .map_err(|e| format!("reading the end: {e}"))?;
    if !rest.is_empty() {
        return Err(format!("{} unexpected bytes after the echo", rest.len()));
    }
    Ok(())
}

fn payload(i: usize) -> Vec<u8> {
    let len = 1 + (i * 7919) % 8192;
    (0..len).map(|b| (b as u8) ^ (i as u8)).collect()
}

struct Shared {
    deployment: Deployment,
    connect_tls: Arc<rustls::ClientConfig>,
    echo_target: String,
    refused_target: String,
    outcomes: Outcomes,
    /// Odd while the agent is down: incremented at each kill and each recovery.
    outage_epoch: AtomicU64,
}

impl Shared {
    async fn one(&self, grpc: &TunnelClient, i: usize) -> Result<(), String> {
        let data = payload(i);
        match i % 8 {
            0 | 4 => {
                let mut stream = grpc
                    .dial(&self.echo_target)
                    .await
                    .map_err(|e| format!("gRPC dial: {e}"))?;
                echo_and_close(&mut stream, &data).await?;
                self.outcomes.grpc_closed.fetch_add(1, Ordering::Relaxed);
            }
            1 | 5 => {
                let mut stream = self.connect(&self.echo_target).await?;
                echo_and_close(&mut stream, &data).await?;
                self.outcomes.connect_closed.fetch_add(1, Ordering::Relaxed);
            }
            2 | 6 => {
                let mut stream = self.connect(&self.echo_target).await?;
                stream
                    .write_all(&data)
                    .await
                    .map_err(|e| format!("write: {e}"))?;
                let mut first = [0u8; 1];
                stream
                    .read_exact(&mut first)
                    .await
                    .map_err(|e| format!("read: {e}"))?;
                // RST instead of FIN, with the rest of the echo unread.
                stream
                    .get_ref()
                    .get_ref()
                    .0
                    .set_zero_linger()
                    .map_err(|e| format!("SO_LINGER: {e}"))?;
                drop(stream);
                self.outcomes.connect_reset.fetch_add(1, Ordering::Relaxed);
            }
            3 => match grpc.dial(&self.refused_target).await {
                Ok(_) => return Err("a dial to a closed port succeeded".into()),
                Err(e) if e.to_string().contains("refused") => {
                    self.outcomes.refused.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Err(format!("refused dial: {e}")),
            },
            _ => match self.connect(&self.refused_target).await {
                Ok(_) => return Err("a CONNECT to a closed port succeeded".into()),
                Err(e) if e.contains("502") => {
                    self.outcomes.refused.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Err(format!("refused CONNECT: {e}")),
            },
        }
        Ok(())
    }

    async fn connect(
        &self,
        target: &str,
    ) -> Result<tunnel_harness::in_process::ConnectStream, String> {
        http_connect_to(
            self.connect_tls.clone(),
            self.deployment.client_addr,
            "localhost",
            target,
        )
        .await
        .map_err(|e| format!("CONNECT: {e}"))
    }

    /// Opens a stream, kills the agent with SIGKILL while it is open,
    /// checks the client sees the stream end, restarts the agent and waits
    /// until a dial succeeds again.
    async fn kill_agent_mid_stream(&self, grpc: &TunnelClient) -> Result<(), ChurnError> {
        let mut stream = tokio::time::timeout(STEP, grpc.dial(&self.echo_target))
            .await
            .map_err(|_| ChurnError::Unexpected("dial before the kill timed out".into()))?
            .map_err(|e| ChurnError::Unexpected(format!("dial before the kill: {e}")))?;
        stream
            .write_all(b"mid-stream")
            .await
            .map_err(|e| ChurnError::Unexpected(e.to_string()))?;
        let mut back = [0u8; 10];
        stream
            .read_exact(&mut back)
            .await
            .map_err(|e| ChurnError::Unexpected(e.to_string()))?;
        self.outage_epoch.fetch_add(1, Ordering::SeqCst);
        let mut agent = self.deployment.agent.lock().await;
        agent.kill().await;
        // The server notices the tunnel is gone and ends its streams: the
        // client's read ends (EOF or error) instead of hanging.
        let mut rest = [0u8; 64];
        match tokio::time::timeout(STEP, stream.read(&mut rest)).await {
            Ok(Ok(0) | Err(_)) => {
                self.outcomes
                    .killed_mid_stream
                    .fetch_add(1, Ordering::Relaxed);
            }
            Ok(Ok(n)) => {
                return Err(ChurnError::Unexpected(format!(
                    "{n} bytes arrived on a stream whose agent was killed"
                )));
            }
            Err(_) => {
                return Err(ChurnError::Unexpected(
                    "a stream stayed open 20 s after its agent was killed".into(),
                ));
            }
        }
        drop(stream);
        agent.restart().await.map_err(setup)?;
        drop(agent);
        self.await_reachable(grpc).await?;
        self.outage_epoch.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn await_reachable(&self, grpc: &TunnelClient) -> Result<(), ChurnError> {
        let started = Instant::now();
        loop {
            let attempt = async {
                let mut stream = grpc
                    .dial(&self.echo_target)
                    .await
                    .map_err(|e| e.to_string())?;
                echo_and_close(&mut stream, b"probe").await
            };
            match tokio::time::timeout(STEP, attempt).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) if started.elapsed() > 2 * STEP => {
                    return Err(ChurnError::Unexpected(format!(
                        "the agent's cluster is unreachable: {e}\n{}",
                        self.logs_tail()
                    )));
                }
                Err(_) => {
                    return Err(ChurnError::Unexpected(format!(
                        "a probe through the tunnel hung\n{}",
                        self.logs_tail()
                    )));
                }
                Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    fn logs_tail(&self) -> String {
        let logs = &self.deployment.logs;
        format!(
            "----- proxy-server -----\n{}\n----- proxy-agent -----\n{}",
            logs.tail("proxy-server", 20),
            logs.tail("proxy-agent", 20)
        )
    }

    async fn agent_pid(&self) -> Result<u32, ChurnError> {
        self.deployment
            .agent
            .lock()
            .await
            .pid()
            .ok_or_else(|| ChurnError::Unexpected("the agent is not running".into()))
    }

    fn server_pid(&self) -> Result<u32, ChurnError> {
        self.deployment
            .server
            .pid()
            .ok_or_else(|| ChurnError::Unexpected("the server is not running".into()))
    }

    async fn samples(&self) -> Result<(ProcessSample, ProcessSample), ChurnError> {
        Ok((
            ProcessSample::read(self.server_pid()?)?,
            ProcessSample::read(self.agent_pid().await?)?,
        ))
    }
}

fn max_sample(a: ProcessSample, b: ProcessSample) -> ProcessSample {
    ProcessSample {
        fds: a.fds.max(b.fds),
        threads: a.threads.max(b.threads),
        rss_kib: a.rss_kib.max(b.rss_kib),
    }
}

/// Runs the churn; `Err` for setup failures and for connections that failed
/// in a way their kind does not allow. Whether the processes came back to
/// their baseline is in the report ([`ChurnReport::settled_after`]).
pub async fn run(options: &ChurnOptions, work_dir: &Path) -> Result<ChurnReport, ChurnError> {
    let binaries = tokio::task::spawn_blocking(|| Binaries::build(Progress::Quiet))
        .await
        .map_err(setup)?
        .map_err(setup)?;
    let pki = TestPki::new(&[CLUSTER]).map_err(setup)?;
    let layout = pki.write(&work_dir.join("pki")).map_err(setup)?;
    let logs = Logs::new(work_dir.join("logs"), false);
    let deployment = start_processes(&binaries, &layout, &logs)?;
    let echo = EchoServer::start().await.map_err(setup)?;
    let refused = closed_port().await.map_err(setup)?;
    let shared = Arc::new(Shared {
        connect_tls: pki.client_tls_alpn(&[ALPN_HTTP11]).map_err(setup)?,
        echo_target: format!("{CLUSTER}:{}", echo.addr.port()),
        refused_target: format!("{CLUSTER}:{}", refused.port()),
        deployment,
        outcomes: Outcomes::default(),
        outage_epoch: AtomicU64::new(0),
    });
    let grpc_tls = pki.client_tls().map_err(setup)?;
    let client_addr = shared.deployment.client_addr;
    // One gRPC connection per worker, open for the whole run (and so part of
    // the baseline): the churn is in streams, as with a real hub client.
    let mut clients = Vec::with_capacity(options.concurrency);
    let started = Instant::now();
    while clients.len() < options.concurrency.max(1) {
        match tunnel_client(grpc_tls.clone(), client_addr).await {
            Ok(client) => clients.push(Arc::new(client)),
            Err(e) if started.elapsed() > 2 * STEP => {
                return Err(ChurnError::Setup(format!(
                    "the server never accepted clients: {e}\n{}",
                    shared.logs_tail()
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    shared.await_reachable(&clients[0]).await?;

    // Warm-up: every kind once per worker and then some, so lazily built
    // state (TLS session caches, allocator arenas, pools) is in the baseline.
    let warm_up = (options.concurrency * 16).max(256);
    churn(&shared, &clients, 0..warm_up, None).await?;
    shared.outcomes.reset();
    let (server_baseline, agent_baseline) = settle_baseline(&shared).await?;

    let measured = Instant::now();
    let peaks = churn(
        &shared,
        &clients,
        warm_up..warm_up + options.connections,
        Some(options.agent_kills),
    )
    .await?;
    let elapsed = measured.elapsed();

    let after_churn = Instant::now();
    let (mut server_after, mut agent_after) = shared.samples().await?;
    let mut settled_after = None;
    while after_churn.elapsed() < options.settle_deadline {
        (server_after, agent_after) = shared.samples().await?;
        if server_after.within(&server_baseline, &options.tolerance)
            && agent_after.within(&agent_baseline, &options.tolerance)
        {
            settled_after = Some(after_churn.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let (server_peak, agent_peak) = peaks;
    let report = ChurnReport {
        connections: options.connections,
        elapsed,
        outcomes: shared.outcomes.counts(),
        server_baseline,
        server_peak: max_sample(server_peak, server_baseline),
        server_after,
        agent_baseline,
        agent_peak: max_sample(agent_peak, agent_baseline),
        agent_after,
        settled_after,
    };
    drop(clients);
    Ok(report)
}

/// The baseline once fds and threads have stopped moving (the tokio
/// blocking pool and closed sockets take a moment to wind down).
async fn settle_baseline(shared: &Shared) -> Result<(ProcessSample, ProcessSample), ChurnError> {
    let started = Instant::now();
    let mut last = shared.samples().await?;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = shared.samples().await?;
        let steady =
            |a: &ProcessSample, b: &ProcessSample| a.fds == b.fds && a.threads == b.threads;
        if (steady(&now.0, &last.0) && steady(&now.1, &last.1)) || started.elapsed() > STEP {
            return Ok(now);
        }
        last = now;
    }
}

/// Runs connections `range` on the workers; with `kills`, kills the agent
/// that many times along the way. Returns the peak samples seen.
async fn churn(
    shared: &Arc<Shared>,
    clients: &[Arc<TunnelClient>],
    range: std::ops::Range<usize>,
    kills: Option<usize>,
) -> Result<(ProcessSample, ProcessSample), ChurnError> {
    let next = Arc::new(AtomicUsize::new(range.start));
    let end = range.end;
    let total = range.len();
    let mut workers = tokio::task::JoinSet::new();
    for client in clients {
        let (shared, next, client) = (shared.clone(), next.clone(), client.clone());
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    return Ok::<(), ChurnError>(());
                }
                let epoch = shared.outage_epoch.load(Ordering::SeqCst);
                let result = match tokio::time::timeout(STEP, shared.one(&client, i)).await {
                    Ok(result) => result,
                    Err(_) => Err(format!("connection {i} hung for {STEP:?}")),
                };
                if let Err(e) = result {
                    let now = shared.outage_epoch.load(Ordering::SeqCst);
                    if epoch % 2 == 1 || now != epoch {
                        shared.outcomes.agent_outage.fetch_add(1, Ordering::Relaxed);
                        // Like a client with backoff: no point spinning
                        // through connections while the agent is down.
                        while shared.outage_epoch.load(Ordering::SeqCst) % 2 == 1 {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    } else {
                        return Err(ChurnError::Unexpected(format!(
                            "connection {i}: {e}\n{}",
                            shared.logs_tail()
                        )));
                    }
                }
            }
        });
    }
    let mut peaks = shared.samples().await?;
    let mut kills_done = 0;
    let kills = kills.unwrap_or(0);
    let mut sampled = Instant::now();
    let outcome = loop {
        let done = next.load(Ordering::Relaxed).saturating_sub(range.start);
        if kills_done < kills && done * (kills + 1) >= total * (kills_done + 1) {
            kills_done += 1;
            if let Err(e) = shared.kill_agent_mid_stream(&clients[0]).await {
                break Err(e);
            }
        }
        if sampled.elapsed() > Duration::from_millis(200) {
            sampled = Instant::now();
            if let Ok(now) = shared.samples().await {
                peaks = (max_sample(peaks.0, now.0), max_sample(peaks.1, now.1));
            }
        }
        match tokio::time::timeout(Duration::from_millis(50), workers.join_next()).await {
            Ok(None) => break Ok(()),
            Ok(Some(Ok(Ok(())))) | Err(_) => {}
            Ok(Some(Ok(Err(e)))) => break Err(e),
            Ok(Some(Err(e))) => break Err(ChurnError::Unexpected(format!("worker: {e}"))),
        }
    };
    workers.abort_all();
    outcome?;
    // The workers may finish between two looks at their progress.
    while kills_done < kills {
        kills_done += 1;
        shared.kill_agent_mid_stream(&clients[0]).await?;
    }
    Ok(peaks)
}
