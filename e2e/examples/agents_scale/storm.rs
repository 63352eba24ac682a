//! The reconnect storm (`CP_SCALE_STORM`): every agent of replica 0 loses
//! its tunnel at once and comes back.
//!
//! - `restart`: replica 0's process is killed (SIGKILL, as an OOM kill or a
//!   node failure) and started again on the same ports after
//!   `CP_SCALE_OUTAGE_SECS` (0: at once).
//! - `outage`: the network between the agents and the hub fails for
//!   `CP_SCALE_OUTAGE_SECS` (300): every agent host's balancer cuts its
//!   open connections and closes new ones, while the servers keep running;
//!   then it lets them through again.
//!
//! Each agent host puts a balancer (random, as kube-proxy) in front of the
//! replicas' agent ports, which counts the connection attempts arriving
//! per 100 ms. With `CP_SCALE_REPLICAS=2` a second replica holds a tunnel
//! from every agent too, and one dial at a time runs through it for the
//! whole storm: it must never fail.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use simulated_cluster::balancer::{ATTEMPT_BUCKET, bucket_of};
use tunnel_harness::loadgen::process_usage;

use crate::{Host, ServerProcess, grpc_echoed, percentile};

/// How every agent loses its tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storm {
    Restart,
    Outage,
}

impl Storm {
    pub fn from_env() -> anyhow::Result<Option<Storm>> {
        match std::env::var("CP_SCALE_STORM").as_deref() {
            Err(_) | Ok("") => Ok(None),
            Ok("restart") => Ok(Some(Storm::Restart)),
            Ok("outage") => Ok(Some(Storm::Outage)),
            Ok(other) => bail!("CP_SCALE_STORM={other}: restart or outage"),
        }
    }

    pub fn default_outage(self) -> Duration {
        match self {
            Storm::Restart => Duration::ZERO,
            Storm::Outage => Duration::from_secs(300),
        }
    }
}

/// What an agent host answers to `await`: when each of its agents held
/// its tunnels again, in ms since the Unix epoch (`None`: not within the limit).
pub fn parse_back(line: &str) -> anyhow::Result<Vec<Option<u64>>> {
    line.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            if s == "-" {
                Ok(None)
            } else {
                Ok(Some(s.parse::<u64>().context("a reconnect time")?))
            }
        })
        .collect()
}

pub fn format_back(times: &[Option<u64>]) -> String {
    times
        .iter()
        .map(|t| t.map_or_else(|| "-".to_owned(), |t| t.to_string()))
        .collect::<Vec<_>>()
        .join(",")
}

/// A host's attempt counts: `bucket:count,...`.
pub fn format_attempts(attempts: &BTreeMap<u64, u32>) -> String {
    attempts
        .iter()
        .map(|(bucket, count)| format!("{bucket}:{count}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn parse_attempts(line: &str, into: &mut BTreeMap<u64, u32>) -> anyhow::Result<()> {
    for pair in line.split(',').filter(|s| !s.is_empty()) {
        let (bucket, count) = pair
            .split_once(':')
            .ok_or_else(|| anyhow!("attempts: {pair}"))?;
        *into.entry(bucket.parse()?).or_default() += count.parse::<u32>()?;
    }
    Ok(())
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// The agents' tunnels (want `want` each) as every host sees them:
/// `lost` until each agent holds fewer, `await` until each holds them all.
async fn ask_all(hosts: &mut [Host], command: &str, answer: &str) -> anyhow::Result<Vec<String>> {
    for host in hosts.iter_mut() {
        host.send(command).await?;
    }
    let mut answers = Vec::with_capacity(hosts.len());
    for host in hosts.iter_mut() {
        answers.push(host.expect(answer).await?);
    }
    Ok(answers)
}

/// A dial through the other replica slower than this is listed.
const SLOW_DIAL: Duration = Duration::from_secs(1);

/// One dial at a time through a replica, each a 1-byte echo, until stopped.
struct DialLoop {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(Vec<Duration>, Vec<String>, Vec<String>)>,
}

impl DialLoop {
    fn start(client: cluster_proxy_proto::client::TunnelClient, targets: Vec<String>) -> DialLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut failures = Vec::new();
            let mut slow = Vec::new();
            let started = Instant::now();
            let mut i = 0usize;
            while !stopped.load(Ordering::Relaxed) {
                let target = &targets[i % targets.len()];
                i += 1;
                let dialed = Instant::now();
                let outcome = grpc_echoed(&client, target, Duration::from_secs(10))
                    .await
                    .map(drop);
                let took = dialed.elapsed();
                match outcome {
                    Ok(()) if took < SLOW_DIAL => latencies.push(took),
                    Ok(()) => {
                        latencies.push(took);
                        slow.push(format!(
                            "{target}: {took:.1?}, started {:.1?} into the storm",
                            dialed.duration_since(started)
                        ));
                    }
                    Err(e) => failures.push(format!("{e:#}")),
                }
            }
            (latencies, failures, slow)
        });
        DialLoop { stop, task }
    }

    /// The sorted latencies, the failures, and the dials slower than [`SLOW_DIAL`].
    async fn finish(self) -> anyhow::Result<(Vec<Duration>, Vec<String>, Vec<String>)> {
        self.stop.store(true, Ordering::Relaxed);
        let (mut latencies, failures, slow) = self.task.await?;
        latencies.sort();
        Ok((latencies, failures, slow))
    }
}

/// A TLS port's completed handshakes (full, resumed) in a server's metrics.
fn handshakes(metrics: &str, listener: &str) -> (u64, u64) {
    let count = |kind: &str| {
        let prefix = format!(
            "cluster_proxy_server_tls_handshakes_total{{listener=\"{listener}\",kind=\"{kind}\"}} "
        );
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    };
    (count("full"), count("resumed"))
}

async fn metrics_of(server: &ServerProcess) -> anyhow::Result<String> {
    let (_, text) =
        tunnel_harness::in_process::health_get(server.health_addr(), "/metrics").await?;
    Ok(text)
}

/// Runs `storm` on replica 0 of `servers` (every agent holding a tunnel to
/// each), with `targets` (one per cluster) for the dial loop through the
/// other replica; prints what it measured.
pub async fn run(
    storm: Storm,
    outage: Duration,
    servers: &mut [ServerProcess],
    hosts: &mut [Host],
    agent_count: usize,
    targets: Vec<String>,
    client_tls: Arc<rustls::ClientConfig>,
) -> anyhow::Result<()> {
    let want = servers.len();
    let dial_loop = match servers.get(1) {
        Some(other) => Some(DialLoop::start(
            tunnel_harness::in_process::tunnel_client(client_tls, other.client_addr()).await?,
            targets,
        )),
        None => None,
    };
    let other_before = match servers.get(1) {
        Some(other) => Some((
            handshakes(&metrics_of(other).await?, "agent"),
            process_usage(other.pid)?.cpu_seconds,
        )),
        None => None,
    };

    let lost_at = SystemTime::now();
    match storm {
        Storm::Restart => servers[0].kill().await?,
        Storm::Outage => {
            ask_all(hosts, "shut", "shut").await?;
        }
    }
    ask_all(hosts, &format!("lost {want}"), "lost").await?;
    let noticed = lost_at.elapsed().unwrap_or_default();
    // The scenario's length, not a wait for a condition.
    tokio::time::sleep(outage).await;
    let back_at = SystemTime::now();
    match storm {
        Storm::Restart => servers[0].respawn().await?,
        Storm::Outage => {
            ask_all(hosts, "open", "open").await?;
        }
    }
    let cpu_before = process_usage(servers[0].pid)?.cpu_seconds;
    let handshakes_before = handshakes(&metrics_of(&servers[0]).await?, "agent");
    let answers = ask_all(hosts, &format!("await {want}"), "back").await?;
    let mut back = Vec::with_capacity(agent_count);
    for answer in &answers {
        back.extend(parse_back(answer)?);
    }
    let back_ms = unix_ms(back_at);
    let mut delays: Vec<Duration> = back
        .iter()
        .flatten()
        .map(|t| Duration::from_millis(t.saturating_sub(back_ms)))
        .collect();
    delays.sort();
    let missing = back.iter().filter(|t| t.is_none()).count();
    let all_back = delays.last().copied().unwrap_or_default();
    let cpu = process_usage(servers[0].pid)?.cpu_seconds - cpu_before;
    let handshakes_after = handshakes(&metrics_of(&servers[0]).await?, "agent");
    let (full, resumed) = (
        handshakes_after.0 - handshakes_before.0,
        handshakes_after.1 - handshakes_before.1,
    );

    let mut attempts = BTreeMap::new();
    for answer in ask_all(hosts, "attempts", "attempts").await? {
        parse_attempts(&answer, &mut attempts)?;
    }
    let per_second = per_second_from(&attempts, lost_at);
    let recovery_from = (back_at
        .duration_since(lost_at)
        .unwrap_or_default()
        .as_secs()) as usize;
    let peak = per_second.iter().copied().max().unwrap_or(0);
    let peak_recovery = per_second
        .iter()
        .skip(recovery_from)
        .copied()
        .max()
        .unwrap_or(0);

    println!(
        "reconnect storm ({}): replica 0 of {want} holding {agent_count} agents; every agent without it within {noticed:.1?}; down for {outage:.0?}",
        match storm {
            Storm::Restart => "restart, SIGKILL",
            Storm::Outage => "hub outage, every connection cut and refused",
        }
    );
    println!(
        "  agents back ({want} tunnels each): {} of {agent_count} in {}; per agent after the hub was back: p50 {:.2} s, p99 {:.2} s, max {:.2} s{}",
        delays.len(),
        format_secs(all_back),
        percentile(&delays, 0.5).as_secs_f64(),
        percentile(&delays, 0.99).as_secs_f64(),
        all_back.as_secs_f64(),
        if missing > 0 {
            format!("; {missing} NOT back")
        } else {
            String::new()
        }
    );
    println!(
        "  connection attempts at the agents' balancers: {} in all; peak {peak}/s (in the recovery: {peak_recovery}/s); per second from the loss: {}",
        attempts.values().map(|c| u64::from(*c)).sum::<u64>(),
        per_second
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "  replica 0 in the recovery: {full} full and {resumed} resumed agent handshakes ({:.0}/s over {}), {cpu:.2} CPU-s ({:.0} µs per handshake)",
        (full + resumed) as f64 / all_back.as_secs_f64().max(1e-3),
        format_secs(all_back),
        cpu * 1e6 / (full + resumed).max(1) as f64,
    );
    if let (Some(dials), Some(((full0, resumed0), cpu0))) = (dial_loop, other_before) {
        let (full1, resumed1) = handshakes(&metrics_of(&servers[1]).await?, "agent");
        let cpu1 = process_usage(servers[1].pid)?.cpu_seconds;
        let (latencies, failures, slow) = dials.finish().await?;
        println!(
            "  replica 1 meanwhile: {} full and {} resumed agent handshakes (duplicates), {:.2} CPU-s; {} dials through it, {} failed; p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            full1 - full0,
            resumed1 - resumed0,
            cpu1 - cpu0,
            latencies.len() + failures.len(),
            failures.len(),
            percentile(&latencies, 0.5).as_secs_f64() * 1e3,
            percentile(&latencies, 0.99).as_secs_f64() * 1e3,
            latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        );
        for failure in failures.iter().take(5) {
            println!("    failed: {failure}");
        }
        for dial in slow.iter().take(5) {
            println!("    slower than {SLOW_DIAL:?}: {dial}");
        }
    }
    if missing > 0 {
        bail!("{missing} agents did not reconnect");
    }
    Ok(())
}

fn format_secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Attempts per whole second from `from`, summed over the 100 ms buckets.
fn per_second_from(attempts: &BTreeMap<u64, u32>, from: SystemTime) -> Vec<u64> {
    let first = bucket_of(from);
    let per_second = (Duration::from_secs(1).as_millis() / ATTEMPT_BUCKET.as_millis()) as u64;
    let mut seconds: Vec<u64> = Vec::new();
    for (bucket, count) in attempts.range(first..) {
        let second = ((bucket - first) / per_second) as usize;
        if seconds.len() <= second {
            seconds.resize(second + 1, 0);
        }
        seconds[second] += u64::from(*count);
    }
    seconds
}

/// Each agent's `tunnel_count()`, polled every 50 ms: when each first
/// satisfied `done`, in ms since the Unix epoch (`None`: not within `limit`).
pub async fn watch_agents(
    agents: &[proxy_agent::RunningAgent],
    done: impl Fn(usize) -> bool,
    limit: Duration,
) -> Vec<Option<u64>> {
    let started = Instant::now();
    let mut times = vec![None; agents.len()];
    loop {
        let now = unix_ms(SystemTime::now());
        let mut left = 0;
        for (agent, time) in agents.iter().zip(times.iter_mut()) {
            if time.is_none() {
                if done(agent.tunnel_count()) {
                    *time = Some(now);
                } else {
                    left += 1;
                }
            }
        }
        if left == 0 || started.elapsed() > limit {
            return times;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The replicas' agent ports, as an agent host receives them.
pub fn parse_ports(list: &str) -> anyhow::Result<Vec<SocketAddr>> {
    list.split(',')
        .map(|p| Ok(SocketAddr::from(([127, 0, 0, 1], p.parse::<u16>()?))))
        .collect()
}
