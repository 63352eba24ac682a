//! Service-access benchmark: `GET` of one ConfigMap straight to a cluster's
//! API against the same request through the user-server, the tunnel and the
//! service-proxy (with TokenReview, SubjectAccessReview and impersonation),
//! in one run on loopback ([`e2e::service_access::Fleet`]).
//!
//! Then the hub's side of many users: `CP_BENCH_USERS` hub users (default
//! 100) at once, `CP_BENCH_USER_REQUESTS` sequential GETs each (default
//! 100): the TokenReviews and SubjectAccessReviews the hub answered, and
//! their peak per second (sampled every 100 ms).
//!
//! Then 1,000 concurrent watches through the user-server (memory, every
//! event delivered), and a 1 GiB echo through a pod's port: plain TCP, the
//! L4 tunnel, the API's port-forward, and the port-forward through the
//! user-server (`CP_BENCH_WATCHES`, `CP_BENCH_TRANSFER_MIB`).
//!
//! `cargo bench -p e2e --bench service_access` (env: `CP_BENCH_REQUESTS`
//! sequential requests per path for the latency, default 2000;
//! `CP_BENCH_SECONDS` per concurrency level for requests/s, default 3).

use std::time::{Duration, Instant};

use e2e::service_access::{CLUSTER_A, Fleet};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use tunnel_harness::loadgen::knob;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

async fn latencies(api: &Api<ConfigMap>, requests: usize) -> Vec<Duration> {
    let mut taken = Vec::with_capacity(requests);
    for _ in 0..requests {
        let started = Instant::now();
        api.get("greeting").await.expect("GET");
        taken.push(started.elapsed());
    }
    taken.sort();
    taken
}

async fn requests_per_second(api: &Api<ConfigMap>, clients: usize, seconds: u64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let api = api.clone();
            tokio::spawn(async move {
                let mut done = 0u64;
                while Instant::now() < deadline {
                    api.get("greeting").await.expect("GET");
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("client task");
    }
    total as f64 / seconds as f64
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let requests = knob("CP_BENCH_REQUESTS", 2000);
    let seconds = knob("CP_BENCH_SECONDS", 3) as u64;
    let fleet = Fleet::start().await?;
    let greeting: ConfigMap = serde_json::from_value(
        serde_json::json!({"metadata": {"name": "greeting"}, "data": {"hello": "world"}}),
    )?;
    Api::<ConfigMap>::namespaced(fleet.managed.client().await?, "default")
        .create(&PostParams::default(), &greeting)
        .await?;
    // Direct: cluster-a's own API, as a user with the same rights.
    let direct_user = fleet.managed.kubeconfig_for("direct", &[])?;
    let managed_admin = fleet.managed.client().await?;
    e2e::service_access::create(
        &managed_admin,
        e2e::service_access::cluster_binding("direct-reads", "configmap-reader", "User", "direct"),
    )
    .await?;
    let direct = Api::<ConfigMap>::namespaced(
        memory_apiserver::KubeApi::client_from(&direct_user).await?,
        "default",
    );
    let alice = fleet.hub_user("alice", &["team-a"]);
    let through =
        Api::<ConfigMap>::namespaced(fleet.path.client(CLUSTER_A, &alice).await?, "default");
    // Warm both (connections, the caches), then measure.
    latencies(&direct, 50).await;
    latencies(&through, 50).await;
    let reviews_before = fleet.hub.token_reviews();

    let direct_latency = latencies(&direct, requests).await;
    let through_latency = latencies(&through, requests).await;
    println!(
        "GET one ConfigMap, {requests} sequential requests per path (loopback, this machine):"
    );
    println!("| path | p50 | p99 |");
    println!("|---|---|---|");
    for (name, taken) in [
        ("direct to the cluster's API", &direct_latency),
        ("through the user-server", &through_latency),
    ] {
        println!(
            "| {name} | {:.0} µs | {:.0} µs |",
            percentile(taken, 0.5).as_secs_f64() * 1e6,
            percentile(taken, 0.99).as_secs_f64() * 1e6
        );
    }
    println!(
        "added by the user-server path: p50 +{:.0} µs, p99 +{:.0} µs",
        (percentile(&through_latency, 0.5).as_secs_f64()
            - percentile(&direct_latency, 0.5).as_secs_f64())
            * 1e6,
        (percentile(&through_latency, 0.99).as_secs_f64()
            - percentile(&direct_latency, 0.99).as_secs_f64())
            * 1e6,
    );
    println!();
    println!("requests/s over {seconds} s:");
    println!("| clients | direct | through the user-server | ratio |");
    println!("|---|---|---|---|");
    for clients in [1, 32] {
        let direct_rate = requests_per_second(&direct, clients, seconds).await;
        let through_rate = requests_per_second(&through, clients, seconds).await;
        println!(
            "| {clients} | {direct_rate:.0} | {through_rate:.0} | {:.2} |",
            through_rate / direct_rate
        );
    }
    println!();
    println!(
        "hub TokenReviews during the measured requests: {} (one user, cached)",
        fleet.hub.token_reviews() - reviews_before
    );
    many_users(&fleet).await?;
    watches(&fleet).await?;
    transfers(&fleet).await
}

/// This process's resident memory, in bytes (Linux `statm`).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|text| text.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// `CP_BENCH_WATCHES` (default 1000) watches of cluster-a's ConfigMaps
/// through the user-server at once, from `CP_BENCH_WATCH_CLIENTS` (10)
/// clients; then `CP_BENCH_WATCH_EVENTS` (10) ConfigMaps are created and
/// every watch must see every one.
async fn watches(fleet: &Fleet) -> anyhow::Result<()> {
    use futures_util::StreamExt;
    use kube::api::{WatchEvent, WatchParams};
    let count = knob("CP_BENCH_WATCHES", 1000);
    let clients = knob("CP_BENCH_WATCH_CLIENTS", 10).max(1);
    let events = knob("CP_BENCH_WATCH_EVENTS", 10);
    let alice = fleet.hub_user("alice", &["team-a"]);
    let managed = Api::<ConfigMap>::namespaced(fleet.managed.client().await?, "default");
    let version = managed
        .list(&Default::default())
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    let mut apis = Vec::with_capacity(clients);
    for _ in 0..clients {
        apis.push(Api::<ConfigMap>::namespaced(
            fleet.path.client(CLUSTER_A, &alice).await?,
            "default",
        ));
    }
    let before = resident_bytes();
    let started = Instant::now();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<()>(count.max(1));
    let mut tasks = Vec::with_capacity(count);
    for index in 0..count {
        let api = apis[index % clients].clone();
        let version = version.clone();
        let ready = ready_tx.clone();
        tasks.push(tokio::spawn(async move {
            let params = WatchParams::default().labels("bench=watch").timeout(290);
            let mut stream = api.watch(&params, &version).await?.boxed();
            let _ = ready.send(()).await;
            let mut seen = 0usize;
            while seen < events {
                match stream.next().await {
                    Some(Ok(WatchEvent::Added(_))) => seen += 1,
                    Some(Ok(_)) => {}
                    Some(Err(error)) => anyhow::bail!("watch {index}: {error}"),
                    None => anyhow::bail!("watch {index} ended after {seen} events"),
                }
            }
            anyhow::Ok(seen)
        }));
    }
    drop(ready_tx);
    for _ in 0..count {
        ready_rx
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("a watch failed to start"))?;
    }
    let opened = started.elapsed();
    let during = resident_bytes();
    let sent = Instant::now();
    for event in 0..events {
        let object: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("watched-{event}"), "labels": {"bench": "watch"}},
        }))?;
        managed.create(&PostParams::default(), &object).await?;
    }
    let mut delivered = 0usize;
    for task in tasks {
        delivered += task.await??;
    }
    let all_seen = sent.elapsed();
    println!();
    println!(
        "{count} watches through the user-server ({clients} clients): open in {:.1} s; \
         resident memory +{:.1} KiB per watch (the whole fleet is this one process: clients, \
         user-server, proxy-server, agent, service-proxy, API); {events} new ConfigMaps: \
         {delivered} of {} events delivered, all within {:.2} s",
        opened.as_secs_f64(),
        during.saturating_sub(before) as f64 / 1024.0 / count.max(1) as f64,
        count * events,
        all_seen.as_secs_f64()
    );
    anyhow::ensure!(delivered == count * events, "events were lost");
    Ok(())
}

/// Echoes `total` bytes through `stream` (written and read back at once):
/// the time it took.
async fn echo_for<S>(stream: S, total: usize) -> anyhow::Result<Duration>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut read, mut write) = tokio::io::split(stream);
    let chunk = vec![0x5au8; 64 * 1024];
    let started = Instant::now();
    let writing = async {
        let mut sent = 0;
        while sent < total {
            let n = chunk.len().min(total - sent);
            write.write_all(&chunk[..n]).await?;
            sent += n;
        }
        write.flush().await?;
        anyhow::Ok(())
    };
    let reading = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0;
        while got < total {
            let n = read.read(&mut buf).await?;
            anyhow::ensure!(n > 0, "the echo ended after {got} of {total} bytes");
            got += n;
        }
        anyhow::Ok(())
    };
    let (written, read) = tokio::join!(writing, reading);
    written?;
    read?;
    Ok(started.elapsed())
}

/// `CP_BENCH_TRANSFER_MIB` (default 1024) echoed by a pod's port: over
/// plain TCP, the L4 tunnel, the managed API's port-forward, and the
/// port-forward through the user-server and service-proxy.
async fn transfers(fleet: &Fleet) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Pod;
    let mib = knob("CP_BENCH_TRANSFER_MIB", 1024);
    let total = mib * 1024 * 1024;
    let managed = fleet.managed.client().await?;
    let echo = fleet.echo_pod().await?;
    let alice = fleet.hub_user("alice", &["team-a"]);

    let tcp = echo_for(tokio::net::TcpStream::connect(echo.addr).await?, total).await?;
    let l4 = echo_for(fleet.path.dial_l4(echo.addr.port()).await?, total).await?;
    let forward = |client: kube::Client| async move {
        let pods = Api::<Pod>::namespaced(client, "default");
        let mut forward = pods.portforward("echo-0", &[7000]).await?;
        let stream = forward
            .take_stream(7000)
            .ok_or_else(|| anyhow::anyhow!("no stream for port 7000"))?;
        let taken = echo_for(stream, total).await;
        forward.abort();
        taken
    };
    let direct = forward(managed.clone()).await?;
    let through = forward(fleet.path.client(CLUSTER_A, &alice).await?).await?;
    let rate = |taken: Duration| mib as f64 / taken.as_secs_f64();
    println!();
    println!("{mib} MiB echoed by a pod's port (each byte both ways), MiB/s one way:");
    println!("| path | MiB/s | vs the L4 tunnel |");
    println!("|---|---|---|");
    for (name, taken) in [
        ("plain TCP to the port (no tunnel)", tcp),
        ("the L4 tunnel (proxy-server → agent)", l4),
        ("port-forward, straight to the cluster's API", direct),
        (
            "port-forward through the user-server and service-proxy",
            through,
        ),
    ] {
        println!(
            "| {name} | {:.0} | {:.2} |",
            rate(taken),
            l4.as_secs_f64() / taken.as_secs_f64()
        );
    }
    Ok(())
}

/// `CP_BENCH_USERS` users at once, each `CP_BENCH_USER_REQUESTS` GETs: what
/// the hub answers for them.
async fn many_users(fleet: &Fleet) -> anyhow::Result<()> {
    let users = knob("CP_BENCH_USERS", 100);
    let per_user = knob("CP_BENCH_USER_REQUESTS", 100);
    // On cluster-a, team-a (as cluster:hub:team-a) reads ConfigMaps.
    e2e::service_access::create(
        &fleet.managed.client().await?,
        e2e::service_access::cluster_binding(
            "hub-team-a-reads",
            "configmap-reader",
            "Group",
            "cluster:hub:team-a",
        ),
    )
    .await?;
    let mut clients = Vec::with_capacity(users);
    for index in 0..users {
        let token = fleet.hub_user(&format!("user-{index}"), &["team-a"]);
        // Each user's own client (its own connection), as separate kubectls.
        clients.push(Api::<ConfigMap>::namespaced(
            fleet.path.client(CLUSTER_A, &token).await?,
            "default",
        ));
    }
    let hub = &fleet.hub;
    let reviews = || hub.token_reviews() + hub.subject_access_reviews();
    let (token_before, access_before) = (hub.token_reviews(), hub.subject_access_reviews());
    let (done_tx, mut done_rx) = tokio::sync::watch::channel(false);
    let sampler = {
        let mut last = reviews();
        let mut peak = 0u64;
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let now = reviews();
                        peak = peak.max((now - last) * 10);
                        last = now;
                    }
                    _ = done_rx.changed() => break,
                }
            }
            peak
        }
    };
    let started = Instant::now();
    let load = async {
        let tasks: Vec<_> = clients
            .into_iter()
            .map(|api| {
                tokio::spawn(async move {
                    for _ in 0..per_user {
                        api.get("greeting").await.expect("GET");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("user task");
        }
        let _ = done_tx.send(true);
    };
    let ((), peak) = tokio::join!(load, sampler);
    let elapsed = started.elapsed();
    let total = users * per_user;
    println!();
    println!(
        "{users} hub users at once, {per_user} GETs each ({total} requests in {:.1} s, {:.0}/s):",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    println!(
        "hub TokenReviews {}, SubjectAccessReviews {} (authorization cache 300 ms here; the \
         user-server's default is 10 s); hub review calls at peak {peak}/s",
        hub.token_reviews() - token_before,
        hub.subject_access_reviews() - access_before
    );
    Ok(())
}
