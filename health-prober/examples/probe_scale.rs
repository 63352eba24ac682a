//! Benchmark: `health-prober` processes probing thousands of clusters.
//!
//! ```sh
//! cargo build --release -p health-prober --bins --examples
//! target/release/examples/probe_scale
//! ```
//!
//! This process runs the in-memory Kubernetes API (a namespace and a
//! `cluster-proxy` ManagedClusterAddOn per cluster), `CP_PROBE_REPLICAS`
//! proxy-servers, one in-process agent per cluster and replica (each with its
//! own certificate) and one HTTPS stand-in kube-apiserver that every cluster
//! name resolves to. The real `health-prober` binary runs as
//! `CP_PROBE_PROBERS` child processes with the default concurrency and
//! sharding on (member Leases in the in-memory API), so each one's CPU time
//! is its own (`/proc`).
//!
//! Reported, per prober: the first round once every prober sees all the
//! others (every condition written), each round after it, and the steady
//! state once latencies settled (from round 4, nothing changing): round
//! duration, clusters probed (its share), the prober's CPU in cores; and
//! status writes per cluster per five minutes over all probers.
//!
//! Knobs: `CP_PROBE_CLUSTERS` (2000), `CP_PROBE_REPLICAS` (2),
//! `CP_PROBE_PROBERS` (1), `CP_PROBE_INTERVAL` (30s, the prober's default),
//! `CP_PROBE_ROUNDS` (5 rounds after the first; steady state is measured
//! from round 4 on); `CP_PROBE_LOG=1` shows the probers' logs.

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Apiserver, Hub, Tunnel, metrics, sample};
use simulated_cluster::targets::free_port;
use simulated_cluster::wait::wait_until;

fn knob<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not valid")),
        Err(_) => default,
    }
}

struct ChildProber(Child);

impl Drop for ChildProber {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// User + system CPU seconds of `pid` so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("prober /proc stat");
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let after = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    // USER_HZ is 100 on Linux.
    ticks / 100.0
}

fn rss_mib(pid: u32) -> f64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("prober /proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kib| kib / 1024.0)
        .unwrap_or(f64::NAN)
}

#[derive(Clone, Copy)]
struct Snapshot {
    at: Instant,
    members: f64,
    shard: f64,
    rounds: f64,
    round_seconds: f64,
    writes: f64,
    probes: f64,
    failures: f64,
    cpu: f64,
}

async fn snapshot(port: u16, pid: u32) -> Snapshot {
    let text = metrics(port).await.expect("prober metrics");
    Snapshot {
        at: Instant::now(),
        members: sample(&text, "health_prober_members"),
        shard: sample(&text, "health_prober_shard_clusters"),
        rounds: sample(&text, "health_prober_round_duration_seconds_count"),
        round_seconds: sample(&text, "health_prober_round_duration_seconds_sum"),
        writes: sample(&text, "health_prober_status_writes_total"),
        probes: sample(&text, "health_prober_probes_total"),
        failures: text
            .lines()
            .filter(|l| l.starts_with("health_prober_probes_total{") && l.contains("failure"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
            + 0.0,
        cpu: cpu_seconds(pid),
    }
}

/// Waits until the prober on `port` finished `rounds` rounds and the last
/// one saw `members` probers.
async fn wait_rounds(
    port: u16,
    prober: &mut Child,
    rounds: f64,
    members: f64,
    limit: Duration,
) -> Snapshot {
    let pid = prober.id();
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = prober.try_wait() {
            panic!("health-prober exited ({status}); run with CP_PROBE_LOG=1 to see why");
        }
        if let Some(text) = metrics(port).await
            && sample(&text, "health_prober_round_duration_seconds_count") >= rounds
            && sample(&text, "health_prober_members") == members
        {
            return snapshot(port, pid).await;
        }
        assert!(
            Instant::now() < deadline,
            "the prober on port {port} did not finish round {rounds} with {members} members in {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::main]
async fn main() {
    let clusters: usize = knob("CP_PROBE_CLUSTERS", 2000);
    let replicas: usize = knob("CP_PROBE_REPLICAS", 2);
    let interval = humantime_secs(&knob("CP_PROBE_INTERVAL", "30s".to_owned()));
    let steady_rounds: usize = knob("CP_PROBE_ROUNDS", 5);
    let probers_wanted: usize = knob("CP_PROBE_PROBERS", 1);
    assert!(probers_wanted >= 1, "CP_PROBE_PROBERS must be at least 1");

    let names: Vec<String> = (0..clusters).map(|i| format!("cluster-{i:04}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();

    let started = Instant::now();
    let hub = Hub::start(&refs).await;
    hub.namespace("open-cluster-management-addon").await;
    eprintln!("hub API with {clusters} addons: {:.1?}", started.elapsed());

    let started = Instant::now();
    let tunnel = Tunnel::start(&refs, replicas).await;
    let apiserver = Apiserver::start(&["kube-apiserver"]).await;
    let mut agents = Vec::with_capacity(clusters * replicas);
    for name in &names {
        for replica in 0..replicas {
            agents.push(tunnel.in_process_agent(name, replica).await);
        }
    }
    let expected = clusters;
    assert!(
        wait_until(Duration::from_secs(120), || tunnel
            .servers
            .iter()
            .all(|s| s.tunnel_count() >= expected))
        .await,
        "not every agent reached its replica"
    );
    eprintln!(
        "{} agents connected to {replicas} replicas: {:.1?}",
        agents.len(),
        started.elapsed()
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let layout = tunnel.pki.write(dir.path()).expect("PKI files");
    let client = layout.proxy_client();
    let addresses: Vec<String> = (0..replicas).map(|i| tunnel.client_address(i)).collect();
    let mut probers = Vec::with_capacity(probers_wanted);
    for index in 0..probers_wanted {
        let health_port = free_port();
        let child = Command::new(prober_binary())
            .env("KUBECONFIG", hub.api.kubeconfig_path())
            .env("POD_NAME", format!("prober-{index}"))
            .args([
                "--namespace=open-cluster-management-addon".to_owned(),
                format!("--proxy-server-addresses={}", addresses.join(",")),
                format!("--proxy-ca-cert={}", layout.bundle().display()),
                format!("--proxy-cert={}", client.cert.display()),
                format!("--proxy-key={}", client.key.display()),
                format!("--interval={}s", interval.as_secs()),
                format!("--timeout={}s", (interval.as_secs() / 2).clamp(1, 10)),
                format!("--target-port={}", apiserver.port),
                format!("--health-port={health_port}"),
                "--health-bind-address=127.0.0.1".into(),
                "--log-format=text".into(),
            ])
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("CP_PROBE_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("start health-prober (build it with the example: cargo build --release -p health-prober --bins --examples)");
        let pid = child.id();
        probers.push((ChildProber(child), health_port, pid));
    }
    let members = probers_wanted as f64;

    // The first round of each prober that saw every other one; a prober's
    // rounds before that (it joined first) probed more than its share.
    let mut previous = Vec::with_capacity(probers.len());
    for (index, (prober, port, pid)) in probers.iter_mut().enumerate() {
        let first = wait_rounds(*port, &mut prober.0, 1.0, members, interval * 4).await;
        println!(
            "prober {index} first round with {:.0} probers: {:.0} of {clusters} clusters x {replicas} replicas, rounds so far {} in {:.2} s, {} status writes, {} failed probes, CPU {:.2} s, RSS {:.0} MiB",
            first.members,
            first.shard,
            first.rounds,
            first.round_seconds,
            first.writes,
            first.failures,
            first.cpu,
            rss_mib(*pid)
        );
        previous.push(first);
    }
    let base: Vec<f64> = previous.iter().map(|s| s.rounds).collect();

    // Each later round on its own, then the settled ones together: the
    // first rounds after a cold start still see latencies change as the
    // machine calms down, and those changes are real writes.
    let mut rounds: Vec<Vec<Snapshot>> = Vec::new();
    for round in 2..=1 + steady_rounds {
        let mut these = Vec::with_capacity(probers.len());
        for (index, (prober, port, _)) in probers.iter_mut().enumerate() {
            let wanted = base[index] + (round - 1) as f64;
            let now = wait_rounds(*port, &mut prober.0, wanted, members, interval * 3).await;
            let before = previous[index];
            println!(
                "round {round} prober {index}: {:.0} clusters in {:.2} s, {} status writes, {} failed probes, CPU {:.2} s",
                now.shard,
                now.round_seconds - before.round_seconds,
                now.writes - before.writes,
                now.failures - before.failures,
                now.cpu - before.cpu
            );
            these.push(now);
        }
        previous.clone_from(&these);
        rounds.push(these);
    }
    // Steady state: after two rounds of settling (round 1 probes every
    // cluster at once from cold connections, so its latencies are inflated).
    if let (Some(from), Some(to)) = (rounds.get(1), rounds.last())
        && rounds.len() > 2
    {
        let mut writes = 0.0;
        let mut wall: f64 = 0.0;
        let mut cores = 0.0;
        for (index, (_, _, pid)) in probers.iter().enumerate() {
            let (from, to) = (from[index], to[index]);
            let n = to.rounds - from.rounds;
            let seconds = to.at.duration_since(from.at).as_secs_f64();
            let cpu = to.cpu - from.cpu;
            writes += to.writes - from.writes;
            wall = wall.max(seconds);
            cores += cpu / seconds;
            println!(
                "steady prober {index} (rounds {}..={}): {:.0} clusters, mean round {:.2} s of a {}s interval, {:.0} probes, {} failed, CPU {:.2} s over {:.1} s = {:.3} cores, RSS {:.0} MiB",
                from.rounds + 1.0,
                to.rounds,
                to.shard,
                (to.round_seconds - from.round_seconds) / n,
                interval.as_secs(),
                to.probes - from.probes,
                to.failures - from.failures,
                cpu,
                seconds,
                cpu / seconds,
                rss_mib(*pid)
            );
        }
        println!(
            "steady, all {probers_wanted} probers: {cores:.3} cores; {writes} status writes = {:.4} per cluster per 5 minutes",
            writes / clusters as f64 / (wall / 300.0)
        );
    }
    drop(agents);
}

/// The `health-prober` binary built beside this example
/// (`target/<profile>/examples/probe_scale` → `target/<profile>/health-prober`).
fn prober_binary() -> std::path::PathBuf {
    let example = std::env::current_exe().expect("the example's own path");
    example
        .parent()
        .and_then(|examples| examples.parent())
        .map(|profile| profile.join("health-prober"))
        .expect("the example runs from target/<profile>/examples")
}

fn humantime_secs(value: &str) -> Duration {
    let seconds: u64 = value
        .strip_suffix('s')
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("CP_PROBE_INTERVAL={value:?}: give whole seconds, e.g. 30s"));
    Duration::from_secs(seconds)
}
