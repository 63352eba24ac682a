//! HA measurements on loopback, in one process: proxy-server replicas behind
//! the environment's round-robin balancer, agents that know only its address.
//!
//! 1. Convergence: for 2, 3 and 5 replicas, `CP_HA_AGENTS` agents (default
//!    50) started at the same instant; the time until each holds a tunnel to
//!    every replica, over `CP_HA_ROUNDS` rounds (default 5).
//! 2. Rolling restart: 3 replicas, `CP_HA_ROLLING_AGENTS` agents (default
//!    10), every replica in turn drained and replaced (same ports, new server
//!    id) while a client dials `CP_HA_DIAL_RATE` times a second (default 100)
//!    through a round-robin balancer in front of the client ports: failed
//!    dials, dial latency, and how long agents take to hold each replacement.
//! 3. Scaling: 2 → 3 → 2 replicas that count each other (a peer set standing
//!    in for the headless Service's DNS), `CP_HA_ROLLING_AGENTS` agents, the
//!    same dialing through a client balancer that follows readiness: how long
//!    until every agent holds the new replica, and until every agent has
//!    settled on 2 after the scale-down; failed dials.
//!
//! `cargo run -p e2e --example ha_convergence` (an example rather than a
//! bench target: it measures seconds-long behaviour, not throughput)

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use cluster_proxy_proto::transport::ALPN_HTTP11;
use proxy_agent::{ProxyAgentConfig, RunningAgent};
use simulated_cluster::balancer::{self, Selection};
use simulated_cluster::targets::EchoServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;
use tunnel_harness::in_process::{health_get, http_connect};
use tunnel_harness::pki::TestPki;
use tunnel_harness::replicas::{Replicas, start_agents, wait_full_mesh};

const GRACE: Duration = Duration::from_secs(10);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn agent_configs(
    replicas: &Replicas,
    pki: &TestPki,
    clusters: &[String],
) -> anyhow::Result<Vec<ProxyAgentConfig>> {
    clusters
        .iter()
        .map(|cluster| {
            let mut config = replicas.agent_config(pki, cluster)?;
            config
                .host_aliases
                .insert(cluster.clone(), IpAddr::V4(Ipv4Addr::LOCALHOST));
            Ok(config)
        })
        .collect()
}

async fn stop_agents(agents: Vec<RunningAgent>) {
    futures_util::future::join_all(agents.into_iter().map(RunningAgent::shutdown)).await;
}

async fn convergence(pki: &TestPki, clusters: &[String], rounds: usize) -> anyhow::Result<()> {
    println!(
        "convergence to a full mesh: {} agents started at once, round-robin balancer, \
         --sync-interval 1s, {rounds} rounds",
        clusters.len()
    );
    println!(
        "{:<9} {:>9} {:>9} {:>9} {:>9}",
        "replicas", "p50", "p99", "max", "samples"
    );
    for replica_count in [2usize, 3, 5] {
        let mut all = Vec::new();
        for _ in 0..rounds {
            let replicas =
                Replicas::start(pki, replica_count, Selection::RoundRobin, |_| {}).await?;
            let configs = agent_configs(&replicas, pki, clusters)?;
            let started = Instant::now();
            let agents = start_agents(configs).await?;
            let took = wait_full_mesh(&agents, replica_count, started, Duration::from_secs(120))
                .await
                .ok_or_else(|| anyhow!("{replica_count} replicas: no full mesh within 120 s"))?;
            all.extend(took);
            stop_agents(agents).await;
            replicas.shutdown().await;
        }
        all.sort();
        println!(
            "{:<9} {:>9} {:>9} {:>9} {:>9}",
            replica_count,
            ms(percentile(&all, 0.5)),
            ms(percentile(&all, 0.99)),
            ms(*all.last().unwrap_or(&Duration::ZERO)),
            all.len()
        );
    }
    Ok(())
}

#[derive(Default)]
struct DialRecord {
    latencies: Vec<Duration>,
    failures: Vec<String>,
}

async fn dial_once(
    tls: Arc<rustls::ClientConfig>,
    via: SocketAddr,
    target: &str,
) -> Result<(), String> {
    let mut stream = http_connect(tls, via, target)
        .await
        .map_err(|e| e.to_string())?;
    stream.write_all(b"x").await.map_err(|e| e.to_string())?;
    let mut back = [0u8; 1];
    stream
        .read_exact(&mut back)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Where the clients' dials go: through a balancer over every replica's
/// client port, or, with a readiness gate, straight to a replica picked in
/// turn among the ready ones (a Kubernetes Service whose endpoints follow
/// readiness: a stopping replica leaves at once, a new one joins once its
/// `/readyz` passes, which it does once it holds as many agents as its
/// peers).
#[derive(Clone)]
enum Route {
    Balancer(SocketAddr),
    Ready(Arc<std::sync::Mutex<ReadySet>>),
}

#[derive(Default)]
struct ReadySet {
    addrs: Vec<SocketAddr>,
    next: usize,
}

impl Route {
    fn pick(&self) -> SocketAddr {
        match self {
            Route::Balancer(addr) => *addr,
            Route::Ready(set) => {
                let mut set = set.lock().unwrap_or_else(|p| p.into_inner());
                set.next = set.next.wrapping_add(1);
                set.addrs[set.next % set.addrs.len()]
            }
        }
    }

    fn set_ready(&self, addr: SocketAddr, ready: bool) {
        if let Route::Ready(set) = self {
            let mut set = set.lock().unwrap_or_else(|p| p.into_inner());
            set.addrs.retain(|a| *a != addr);
            if ready {
                set.addrs.push(addr);
            }
        }
    }
}

async fn rolling_restart(
    pki: &TestPki,
    clusters: &[String],
    rate: usize,
    gated: bool,
) -> anyhow::Result<()> {
    let replica_count = 3;
    let configure = |config: &mut proxy_server::settings::ProxyServerSettings| {
        config.graceful_shutdown_timeout = GRACE;
    };
    // Gated: replicas that count each other, so `/readyz` waits for the
    // agents their peers hold.
    let mut replicas = if gated {
        Replicas::start_scalable(pki, replica_count, Selection::RoundRobin, configure).await?
    } else {
        Replicas::start(pki, replica_count, Selection::RoundRobin, configure).await?
    };
    let agents = start_agents(agent_configs(&replicas, pki, clusters)?).await?;
    wait_full_mesh(
        &agents,
        replica_count,
        Instant::now(),
        Duration::from_secs(60),
    )
    .await
    .context("no full mesh before the rollout")?;
    let echo = EchoServer::start().await?;
    let targets: Vec<String> = clusters
        .iter()
        .map(|c| format!("{c}:{}", echo.addr.port()))
        .collect();
    let hub_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let hub_service = hub_listener.local_addr()?;
    let frontends: Vec<SocketAddr> = replicas.servers.iter().map(|s| s.client_addr).collect();
    let route = if gated {
        Route::Ready(Arc::new(std::sync::Mutex::new(ReadySet {
            addrs: frontends,
            next: 0,
        })))
    } else {
        Route::Balancer(hub_service)
    };
    let hub_balancer = tokio::spawn(balancer::serve(
        hub_listener,
        replicas.servers.iter().map(|s| s.client_addr).collect(),
        Selection::RoundRobin,
    ));

    // Open-loop dialing: one dial every 1/rate s, each in its own task, so a
    // slow dial does not lower the rate.
    let record = Arc::new(Mutex::new(DialRecord::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let dialer = {
        let (record, stop, route) = (record.clone(), stop.clone(), route.clone());
        let tls = pki.client_tls_alpn(&[ALPN_HTTP11])?;
        let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(period);
            let mut inflight = Vec::new();
            let mut n = 0usize;
            while !stop.load(Ordering::SeqCst) {
                ticks.tick().await;
                let (tls, record) = (tls.clone(), record.clone());
                let target = targets[n % targets.len()].clone();
                let via = route.pick();
                n += 1;
                inflight.push(tokio::spawn(async move {
                    let started = Instant::now();
                    let result = dial_once(tls, via, &target).await;
                    let mut record = record.lock().await;
                    match result {
                        Ok(()) => record.latencies.push(started.elapsed()),
                        Err(e) => record.failures.push(format!("{target}: {e}")),
                    }
                }));
            }
            for task in inflight {
                let _ = task.await;
            }
        })
    };

    tokio::time::sleep(Duration::from_secs(2)).await;
    let rollout_started = Instant::now();
    let mut rejoin = Vec::new();
    let mut bound = Vec::new();
    let mut ready = Vec::new();
    for index in 0..replica_count {
        let old = replicas.servers.remove(index);
        let (client_addr, agent_addr) = (old.client_addr, old.agent_addr);
        route.set_ready(old.client_addr, false);
        let draining = tokio::spawn(old.shutdown());
        let replaced_at = Instant::now();
        let id = format!("server-{index}-next");
        replicas
            .replace(pki, index, client_addr, agent_addr, &id, configure)
            .await?;
        bound.push(replaced_at.elapsed());
        let health = replicas.servers[index].health_addr;
        let mut held_by_all = None;
        let mut ready_after = None;
        while held_by_all.is_none() || (gated && ready_after.is_none()) {
            if held_by_all.is_none() && agents.iter().all(|a| a.server_ids().contains(&id)) {
                held_by_all = Some(replaced_at.elapsed());
            }
            if gated
                && ready_after.is_none()
                && matches!(health_get(health, "/readyz").await, Ok((200, _)))
            {
                ready_after = Some(replaced_at.elapsed());
                route.set_ready(replicas.servers[index].client_addr, true);
            }
            if replaced_at.elapsed() > Duration::from_secs(60) {
                return Err(anyhow!("agents did not reach {id} within 60 s"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        rejoin.push(held_by_all.unwrap_or_default());
        ready.push(ready_after);
        draining.await?;
    }
    let rollout = rollout_started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    dialer.await?;
    hub_balancer.abort();
    stop_agents(agents).await;
    replicas.shutdown().await;

    let mut record = record.lock().await;
    record.latencies.sort();
    let total = record.latencies.len() + record.failures.len();
    let route = if gated {
        "straight to the ready replicas (a new replica once its /readyz passes)"
    } else {
        "through a round-robin balancer over every client port (no readiness gate)"
    };
    println!(
        "\nrolling restart of {replica_count} replicas (each drained, then replaced on its ports), \
         {} agents, {rate} dials/s (HTTP CONNECT + 1-byte echo) {route}",
        clusters.len()
    );
    println!("rollout took {}", ms(rollout));
    println!(
        "dials: {total}, failed: {}, latency p50 {} p99 {} max {}",
        record.failures.len(),
        ms(percentile(&record.latencies, 0.5)),
        ms(percentile(&record.latencies, 0.99)),
        ms(*record.latencies.last().unwrap_or(&Duration::ZERO)),
    );
    println!(
        "replacement listening after: {}; every agent held it after: {}",
        bound.iter().map(|d| ms(*d)).collect::<Vec<_>>().join(", "),
        rejoin.iter().map(|d| ms(*d)).collect::<Vec<_>>().join(", ")
    );
    if gated {
        println!(
            "replacement ready (/readyz 200) after: {}",
            ready
                .iter()
                .map(|d| d.map_or_else(|| "-".into(), ms))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for failure in record.failures.iter().take(10) {
        println!("  failed: {failure}");
    }
    Ok(())
}

/// Open-loop dialing at `rate` a second through `via` until `stop`.
fn dial_open_loop(
    pki: &TestPki,
    via: SocketAddr,
    targets: Vec<String>,
    rate: usize,
    record: Arc<Mutex<DialRecord>>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11])?;
    let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    Ok(tokio::spawn(async move {
        let mut ticks = tokio::time::interval(period);
        let mut inflight = Vec::new();
        let mut n = 0usize;
        while !stop.load(Ordering::SeqCst) {
            ticks.tick().await;
            let (tls, record) = (tls.clone(), record.clone());
            let target = targets[n % targets.len()].clone();
            n += 1;
            inflight.push(tokio::spawn(async move {
                let started = Instant::now();
                let result = dial_once(tls, via, &target).await;
                let mut record = record.lock().await;
                match result {
                    Ok(()) => record.latencies.push(started.elapsed()),
                    Err(e) => record.failures.push(format!("{target}: {e}")),
                }
            }));
        }
        for task in inflight {
            let _ = task.await;
        }
    }))
}

async fn wait_for(
    what: &str,
    timeout: Duration,
    condition: impl Fn() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !condition() {
        if Instant::now() > deadline {
            return Err(anyhow!("{what}: not within {timeout:?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

async fn scaling(pki: &TestPki, clusters: &[String], rate: usize) -> anyhow::Result<()> {
    let configure = |config: &mut proxy_server::settings::ProxyServerSettings| {
        config.graceful_shutdown_timeout = GRACE;
    };
    let mut replicas = Replicas::start_scalable(pki, 2, Selection::RoundRobin, configure).await?;
    let agents = start_agents(agent_configs(&replicas, pki, clusters)?).await?;
    wait_full_mesh(&agents, 2, Instant::now(), Duration::from_secs(60))
        .await
        .context("no full mesh before scaling")?;
    let echo = EchoServer::start().await?;
    let targets: Vec<String> = clusters
        .iter()
        .map(|c| format!("{c}:{}", echo.addr.port()))
        .collect();
    let hub_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let hub_service = hub_listener.local_addr()?;
    let ready = balancer::Backends::new(replicas.servers.iter().map(|s| s.client_addr).collect());
    let hub_balancer = tokio::spawn(balancer::serve_backends(
        hub_listener,
        ready.clone(),
        Selection::RoundRobin,
    ));
    let record = Arc::new(Mutex::new(DialRecord::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let dialer = dial_open_loop(
        pki,
        hub_service,
        targets,
        rate,
        record.clone(),
        stop.clone(),
    )?;

    tokio::time::sleep(Duration::from_secs(2)).await;
    let up = Instant::now();
    let index = replicas.scale_up(pki, configure).await?;
    let new_id = replicas.servers[index].server_id.clone();
    wait_for(
        "every agent holds the new replica",
        Duration::from_secs(60),
        || agents.iter().all(|a| a.server_ids().contains(&new_id)),
    )
    .await?;
    let up_took = up.elapsed();
    ready.add(replicas.servers[index].client_addr);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let down = Instant::now();
    ready.remove(replicas.servers[index].client_addr);
    let drained = replicas
        .scale_down()
        .ok_or_else(|| anyhow!("no replica to remove"))?;
    wait_for(
        "every agent settles on 2 replicas",
        Duration::from_secs(60),
        || {
            agents
                .iter()
                .all(|a| a.known_server_count() == 2 && a.active_tunnel_count() == 2)
        },
    )
    .await?;
    let down_took = down.elapsed();
    drained.await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    dialer.await?;
    hub_balancer.abort();
    stop_agents(agents).await;
    replicas.shutdown().await;

    let mut record = record.lock().await;
    record.latencies.sort();
    let total = record.latencies.len() + record.failures.len();
    println!(
        "\nscaling 2 → 3 → 2 replicas that count each other (peer lookups every {}), {} agents, \
         {rate} dials/s through a client balancer that follows readiness",
        ms(tunnel_harness::replicas::PEER_REFRESH),
        clusters.len()
    );
    println!(
        "every agent held the new replica {} after it started; every agent settled on 2 replicas {} after the scale-down began",
        ms(up_took),
        ms(down_took)
    );
    println!(
        "dials: {total}, failed: {}, latency p50 {} p99 {} max {}",
        record.failures.len(),
        ms(percentile(&record.latencies, 0.5)),
        ms(percentile(&record.latencies, 0.99)),
        ms(*record.latencies.last().unwrap_or(&Duration::ZERO)),
    );
    for failure in record.failures.iter().take(10) {
        println!("  failed: {failure}");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let agents = env_usize("CP_HA_AGENTS", 50);
    let rounds = env_usize("CP_HA_ROUNDS", 5);
    let rolling_agents = env_usize("CP_HA_ROLLING_AGENTS", 10);
    let rate = env_usize("CP_HA_DIAL_RATE", 100);
    let clusters: Vec<String> = (0..agents.max(rolling_agents))
        .map(|i| format!("cluster-{i}"))
        .collect();
    let names: Vec<&str> = clusters.iter().map(String::as_str).collect();
    let pki = TestPki::new(&names)?;
    let only_scaling = std::env::var_os("CP_HA_ONLY_SCALING").is_some();
    let only_rolling = std::env::var_os("CP_HA_ONLY_ROLLING").is_some();
    if !only_scaling && !only_rolling {
        convergence(&pki, &clusters[..agents], rounds).await?;
    }
    if !only_scaling {
        rolling_restart(&pki, &clusters[..rolling_agents], rate, false).await?;
        rolling_restart(&pki, &clusters[..rolling_agents], rate, true).await?;
    }
    if !only_rolling {
        scaling(&pki, &clusters[..rolling_agents], rate).await?;
    }
    Ok(())
}
