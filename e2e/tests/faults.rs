//! Fault injection on the multi-cluster environment (`e2e::env`), each
//! managed cluster in its own network namespace: a partitioned agent, a
//! replica killed with SIGKILL under load, a client that stops reading and a
//! target that never reads. Through each fault a healthy connection on
//! another path echoes a checksummed stream: it must lose or corrupt no byte;
//! its throughput before and during the fault is printed as a ratio (not
//! asserted: this machine's CPU is shared).
//!
//! Needs root and `ip netns`; under CI=true it must run, otherwise it skips
//! loudly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use e2e::env::client::{Frontend, HubClient, Stream};
use e2e::env::{EnvOptions, Environment, Isolation, IsolationChoice};
use simulated_cluster::sample;
use tokio::io::{AsyncReadExt, AsyncWriteExt, WriteHalf};
use tokio::task::JoinHandle;

const READY: Duration = Duration::from_secs(90);
/// How long throughput is measured before and during each fault.
const WINDOW: Duration = Duration::from_secs(3);
const CHUNK: usize = 16 * 1024;

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The byte at `offset` of every checked stream: position-dependent, so a
/// lost, duplicated or reordered chunk shows.
fn pattern(offset: u64) -> u8 {
    let x = offset.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (offset as u8)
}

/// Bytes written, and the write half kept open (closing it would end the echo).
type Written = (u64, WriteHalf<Box<dyn Stream>>);

/// A connection echoing a checked byte stream for as long as it runs.
struct Checked {
    name: String,
    verified: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    writer: JoinHandle<Result<Written, String>>,
    reader: JoinHandle<Result<u64, String>>,
}

impl Checked {
    fn start(name: &str, stream: Box<dyn Stream>) -> Checked {
        let (mut from, mut to) = tokio::io::split(stream);
        let verified = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut sent = 0u64;
                let mut chunk = vec![0u8; CHUNK];
                while !stop.load(Ordering::Relaxed) {
                    for (i, byte) in chunk.iter_mut().enumerate() {
                        *byte = pattern(sent + i as u64);
                    }
                    to.write_all(&chunk)
                        .await
                        .map_err(|e| format!("write at {sent}: {e}"))?;
                    sent += CHUNK as u64;
                }
                // No half-close: konnectivity's CLOSE_REQ ends both
                // directions, and the echo of the last bytes with it.
                Ok((sent, to))
            })
        };
        let reader = {
            let verified = verified.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; CHUNK];
                let mut offset = 0u64;
                loop {
                    let n = from
                        .read(&mut buf)
                        .await
                        .map_err(|e| format!("read at {offset}: {e}"))?;
                    if n == 0 {
                        return Ok(offset);
                    }
                    for (i, byte) in buf[..n].iter().enumerate() {
                        let at = offset + i as u64;
                        if *byte != pattern(at) {
                            return Err(format!("byte {at} corrupted"));
                        }
                    }
                    offset += n as u64;
                    verified.store(offset, Ordering::Relaxed);
                }
            })
        };
        Checked {
            name: name.to_owned(),
            verified,
            stop,
            writer,
            reader,
        }
    }

    /// Bytes echoed back and verified per second over `window`.
    async fn throughput(&self, window: Duration) -> f64 {
        let before = self.verified.load(Ordering::Relaxed);
        let started = Instant::now();
        tokio::time::sleep(window).await;
        let after = self.verified.load(Ordering::Relaxed);
        (after - before) as f64 / started.elapsed().as_secs_f64()
    }

    /// Stops writing, waits for the echo of everything written, and checks
    /// not a byte was lost.
    async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let name = self.name;
        let (sent, write_half) = tokio::time::timeout(Duration::from_secs(30), self.writer)
            .await
            .unwrap_or_else(|_| panic!("{name}: the writer hung"))
            .unwrap()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.verified.load(Ordering::Relaxed) < sent {
            if self.reader.is_finished() || Instant::now() > deadline {
                let received = self.verified.load(Ordering::Relaxed);
                let why = match self.reader.await {
                    Ok(Err(e)) => e,
                    _ => "the echo stopped".to_owned(),
                };
                panic!("{name}: {received} of {sent} bytes echoed back: {why}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.reader.abort();
        drop(write_half);
        sent
    }
}

struct Faults {
    env: Environment,
    client: HubClient,
}

impl Faults {
    async fn dial(&self, replica: usize, cluster: usize, port: u16) -> Box<dyn Stream> {
        let target = format!("{}:{port}", self.env.clusters[cluster].name);
        self.client
            .dial(Frontend::Grpc, self.env.client_addr(replica), &target)
            .await
            .unwrap_or_else(|e| panic!("dialing {target} via replica {replica}: {e}"))
    }

    async fn healthy(&self, replica: usize, cluster: usize) -> Checked {
        let name = format!("{} via replica {replica}", self.env.clusters[cluster].name);
        Checked::start(&name, self.dial(replica, cluster, sample::ECHO_PORT).await)
    }

    /// Measures `healthy` before and while `fault` is in effect, then lifts
    /// the fault with `heal`, checks no byte was lost and prints the ratio.
    async fn measure<F, H>(&mut self, what: &str, healthy: Checked, fault: F, heal: H) -> f64
    where
        F: AsyncFnOnce(&mut Faults),
        H: AsyncFnOnce(&mut Faults),
    {
        // A moment to ramp up before the first window.
        healthy.throughput(Duration::from_millis(500)).await;
        let before = healthy.throughput(WINDOW).await;
        fault(self).await;
        let during = healthy.throughput(WINDOW).await;
        heal(self).await;
        let bytes = healthy.finish().await;
        let ratio = during / before.max(1.0);
        println!(
            "FAULT {what}: healthy connection {:.1} MiB/s before, {:.1} MiB/s during: ratio {ratio:.2}; {:.1} MiB echoed, none lost",
            before / 1048576.0,
            during / 1048576.0,
            bytes as f64 / 1048576.0
        );
        if let Err(e) = self.env.wait_ready(READY).await {
            panic!("after {what}: {e}");
        }
        ratio
    }
}

/// The cluster's end of its veth to the hub (inside the cluster's namespace).
fn cluster_link(netns: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", netns, "ip", "-o", "link", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .find(|name| name != "lo")
        .unwrap_or_else(|| panic!("no veth in {netns}"))
}

fn ip_in(netns: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", netns, "ip"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {} in {netns}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A link's routes, which the kernel drops when the link goes down.
fn routes_of(netns: &str, link: &str) -> Vec<String> {
    let routes = ip_in(netns, &["-o", "route", "show", "dev", link]);
    routes.lines().map(str::to_owned).collect()
}

fn link_up(netns: &str, link: &str, routes: &[String]) {
    ip_in(netns, &["link", "set", link, "up"]);
    for route in routes {
        let mut args = vec!["route", "replace"];
        args.extend(route.split_whitespace());
        args.extend(["dev", link]);
        ip_in(netns, &args);
    }
}

/// Writes to `stream` without ever reading, until it blocks (or fails);
/// returns once the writes have stalled (every window on the way is full)
/// or after 10 s, with the writer still running.
async fn flood(mut stream: Box<dyn Stream>) -> JoinHandle<()> {
    let sent = Arc::new(AtomicU64::new(0));
    let writer = {
        let sent = sent.clone();
        tokio::spawn(async move {
            let chunk = vec![0x5au8; CHUNK];
            while stream.write_all(&chunk).await.is_ok() {
                sent.fetch_add(CHUNK as u64, Ordering::Relaxed);
            }
        })
    };
    let started = Instant::now();
    let mut last = u64::MAX;
    while started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = sent.load(Ordering::Relaxed);
        if now == last {
            println!("flood stalled after {:.1} MiB", now as f64 / 1048576.0);
            break;
        }
        last = now;
    }
    writer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_connections_keep_their_bytes_through_faults_on_other_paths() {
    let mut options = EnvOptions::new(2);
    options.isolation = if under_ci() {
        IsolationChoice::Netns
    } else {
        IsolationChoice::Auto
    };
    options.kube_api = false;
    options.spare_machines = 0;
    let env = Environment::start(options)
        .await
        .unwrap_or_else(|e| panic!("starting the environment: {e}"));
    if let Isolation::Loopback(reason) = &env.summary.isolation {
        assert!(!under_ci(), "CI=true requires network namespaces: {reason}");
        eprintln!(
            "SKIPPED: fault injection needs network namespaces (root and `ip netns`): {reason}"
        );
        return;
    }
    env.wait_ready(READY).await.unwrap();
    let client = env
        .hub_client()
        .unwrap()
        .with_timeout(Duration::from_secs(10));
    let mut faults = Faults { env, client };
    let (a, b) = (0, 1);
    let netns_a = faults.env.clusters[a].netns.clone().unwrap();
    let link_a = cluster_link(&netns_a);

    // 1. cluster-a's agent cut off from the hub; cluster-b keeps going.
    let routes = routes_of(&netns_a, &link_a);
    assert!(!routes.is_empty(), "no route on {link_a}");
    let healthy = faults.healthy(0, b).await;
    faults
        .measure(
            "partition cluster-a (veth down)",
            healthy,
            async |_| {
                ip_in(&netns_a, &["link", "set", &link_a, "down"]);
            },
            async |_| link_up(&netns_a, &link_a, &routes),
        )
        .await;

    // 2. Replica 1 killed with SIGKILL while it carries load; a connection
    //    through replica 0 keeps going.
    let load = Checked::start(
        "load via replica 1",
        faults.dial(1, a, sample::ECHO_PORT).await,
    );
    let healthy = faults.healthy(0, b).await;
    faults
        .measure(
            "kill -9 replica 1 under load",
            healthy,
            async |f| f.env.replicas[1].process.kill().await,
            async |f| f.env.replicas[1].process.restart().await.unwrap(),
        )
        .await;
    load.stop.store(true, Ordering::Relaxed);
    let ended = tokio::time::timeout(Duration::from_secs(30), load.reader).await;
    assert!(
        matches!(ended, Ok(Ok(_))),
        "the connection through the killed replica ended"
    );
    load.writer.abort();

    // 3. A client that writes to the echo service and never reads: its
    //    connection's window fills; another connection on the same tunnel
    //    (same agent, same replica) keeps going.
    let healthy = faults.healthy(0, a).await;
    let mut stalled = None;
    faults
        .measure(
            "slow reader on the same tunnel",
            healthy,
            async |f| stalled = Some(flood(f.dial(0, a, sample::ECHO_PORT).await).await),
            async |_| {},
        )
        .await;
    if let Some(stalled) = stalled {
        stalled.abort();
    }

    // 4. A target inside cluster-a that accepts and never reads.
    const SINK_PORT: u16 = 7001;
    let service_ip = faults.env.clusters[a].service_ip;
    let _sink = tokio::process::Command::new("ip")
        .args(["netns", "exec", &netns_a, "python3", "-c"])
        .arg(format!(
            "import socket, time\n\
             s = socket.socket()\n\
             s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             s.bind(('{service_ip}', {SINK_PORT}))\n\
             s.listen(16)\n\
             held = []\n\
             while True:\n    held.append(s.accept())\n"
        ))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let sink_target = format!("{}:{SINK_PORT}", faults.env.clusters[a].name);
    let started = Instant::now();
    let sink = loop {
        match faults
            .client
            .dial(Frontend::Grpc, faults.env.client_addr(0), &sink_target)
            .await
        {
            Ok(stream) => break stream,
            Err(e) if started.elapsed() > Duration::from_secs(20) => {
                panic!("the never-reading target never listened: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let healthy = faults.healthy(0, a).await;
    let mut blocked = None;
    faults
        .measure(
            "target that never reads, same tunnel",
            healthy,
            async |_| blocked = Some(flood(sink).await),
            async |_| {},
        )
        .await;
    if let Some(blocked) = blocked {
        blocked.abort();
    }
}
