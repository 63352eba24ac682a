//! Benchmark: one `health-prober` process probing thousands of clusters.
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
//! name resolves to. The real `health-prober` binary runs as a child process
//! with the default concurrency, so its CPU time is its own (`/proc`).
//!
//! Reported: the first round (every condition written), each round after it,
//! and the steady state once latencies settled (from round 4, nothing
//! changing): round duration, the prober's CPU in cores, and status writes
//! per cluster per five minutes.
//!
//! Knobs: `CP_PROBE_CLUSTERS` (2000), `CP_PROBE_REPLICAS` (2),
//! `CP_PROBE_INTERVAL` (30s, the prober's default), `CP_PROBE_ROUNDS`
//! (5 rounds after the first; steady state is measured from round 4 on); `CP_PROBE_LOG=1` shows the prober's log.

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

async fn wait_rounds(port: u16, prober: &mut Child, rounds: f64, limit: Duration) -> Snapshot {
    let pid = prober.id();
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = prober.try_wait() {
            panic!("health-prober exited ({status}); run with CP_PROBE_LOG=1 to see why");
        }
        if let Some(text) = metrics(port).await
            && sample(&text, "health_prober_round_duration_seconds_count") >= rounds
        {
            return snapshot(port, pid).await;
        }
        assert!(
            Instant::now() < deadline,
            "the prober did not finish round {rounds} in {limit:?}"
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
    let health_port = free_port();
    let child = Command::new(prober_binary())
        .env("KUBECONFIG", hub.api.kubeconfig_path())
        .env("POD_NAME", "prober-0")
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
    let mut prober = ChildProber(child);

    let first = wait_rounds(health_port, &mut prober.0, 1.0, interval * 4).await;
    println!(
        "first round: {clusters} clusters x {replicas} replicas in {:.2} s, {} status writes, {} failed probes, prober CPU {:.2} s, RSS {:.0} MiB",
        first.round_seconds,
        first.writes,
        first.failures,
        first.cpu,
        rss_mib(pid)
    );

    // Each later round on its own, then the settled ones together: the
    // first rounds after a cold start still see latencies change as the
    // machine calms down, and those changes are real writes.
    let mut previous = first;
    let mut rounds = Vec::new();
    for round in 2..=1 + steady_rounds {
        let now = wait_rounds(health_port, &mut prober.0, round as f64, interval * 3).await;
        println!(
            "round {round}: {:.2} s, {} status writes, {} failed probes, prober CPU {:.2} s",
            now.round_seconds - previous.round_seconds,
            now.writes - previous.writes,
            now.failures - previous.failures,
            now.cpu - previous.cpu
        );
        rounds.push(now);
        previous = now;
    }
    // Steady state: after two rounds of settling (round 1 probes every
    // cluster at once from cold connections, so its latencies are inflated).
    if let (Some(from), Some(to)) = (rounds.get(1), rounds.last())
        && to.rounds > from.rounds
    {
        let n = to.rounds - from.rounds;
        let wall = to.at.duration_since(from.at).as_secs_f64();
        let cpu = to.cpu - from.cpu;
        let writes = to.writes - from.writes;
        println!(
            "steady (rounds {}..={}): mean round {:.2} s of a {}s interval, {:.0} probes, {} failed, prober CPU {:.2} s over {:.1} s = {:.3} cores, RSS {:.0} MiB",
            from.rounds + 1.0,
            to.rounds,
            (to.round_seconds - from.round_seconds) / n,
            interval.as_secs(),
            to.probes - from.probes,
            to.failures - from.failures,
            cpu,
            wall,
            cpu / wall,
            rss_mib(pid)
        );
        println!(
            "steady writes: {writes} = {:.4} per cluster per 5 minutes",
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
