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
    many_users(&fleet).await
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
