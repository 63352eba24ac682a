//! Benchmark: the in-memory API's own requests per second at fleet size.
//!
//! ```sh
//! cargo run --release -p memory-apiserver --example api_throughput
//! CP_API_OBJECTS=10000 CP_API_WATCHERS=10 cargo run --release -p memory-apiserver --example api_throughput
//! ```
//!
//! The store holds `CP_API_OBJECTS` (10,000) ConfigMaps, one per namespace,
//! each owned (an ownerReference) by a ConfigMap beside it, as a hub holds
//! one addon, work and RoleBinding per cluster. `CP_API_WATCHERS` (10)
//! clients watch every ConfigMap, as controllers' caches do. Then
//! `CP_API_CLIENTS` (16) clients at once, each over its own connection, run
//! each phase: creates of owned objects, GETs, merge patches, lists of one
//! namespace, and deletions that the garbage collector follows up. Reported
//! per phase: requests per second, and how long until every watcher had
//! every change of the phase.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures_util::{AsyncBufReadExt as _, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchParams};
use kube::{Api, ResourceExt};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::json;

fn knob(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .with_context(|| format!("{name}={value:?} is not a number")),
        Err(_) => Ok(default),
    }
}

fn namespace(index: usize) -> String {
    format!("cluster-{index:05}")
}

/// Runs `request(i)` for every `i` in `0..count`, `clients` at a time, each
/// client on its own connection; requests per second.
async fn phase<F, Fut>(
    name: &str,
    count: usize,
    clients: &[kube::Client],
    request: F,
) -> anyhow::Result<f64>
where
    F: Fn(kube::Client, usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let started = Instant::now();
    let request = &request;
    futures_util::stream::iter(0..count)
        .map(|index| request(clients[index % clients.len()].clone(), index))
        .buffer_unordered(clients.len())
        .try_collect::<Vec<()>>()
        .await
        .with_context(|| format!("phase {name}"))?;
    let took = started.elapsed().as_secs_f64();
    Ok(count as f64 / took)
}

/// Every change each watcher has seen so far (events other than bookmarks).
struct Watchers {
    seen: Vec<Arc<AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Watchers {
    async fn start(clients: &[kube::Client], count: usize) -> anyhow::Result<Self> {
        let mut seen = Vec::new();
        let mut tasks = Vec::new();
        for index in 0..count {
            let api = Api::<ConfigMap>::all(clients[index % clients.len()].clone());
            let version = api
                .list_metadata(&ListParams::default().limit(1))
                .await?
                .metadata
                .resource_version
                .context("a list's resourceVersion")?;
            let counter = Arc::new(AtomicU64::new(0));
            seen.push(counter.clone());
            let client = clients[index % clients.len()].clone();
            tasks.push(tokio::spawn(async move {
                // Lines counted, not decoded: decoding every event in
                // this process would measure the watchers, not the API.
                let request = kube::core::Request::new("/api/v1/configmaps")
                    .watch(&WatchParams::default().timeout(290), &version)?;
                let mut lines = client.request_stream(request).await?.lines();
                while let Some(line) = lines.next().await {
                    let line = line?;
                    if line.contains(r#""type":"ERROR""#) {
                        anyhow::bail!("watch ended: {line}");
                    }
                    if !line.contains(r#""type":"BOOKMARK""#) {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(())
            }));
        }
        Ok(Self { seen, tasks })
    }

    /// How long until every watcher has seen `total` changes.
    async fn caught_up(&mut self, total: u64, since: Instant) -> anyhow::Result<Duration> {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if self
                .seen
                .iter()
                .all(|seen| seen.load(Ordering::Relaxed) >= total)
            {
                return Ok(since.elapsed());
            }
            if let Some(ended) = self.tasks.iter().position(|task| task.is_finished()) {
                let why = match self.tasks.swap_remove(ended).await {
                    Ok(Err(error)) => error.to_string(),
                    Ok(Ok(())) => "the API closed it".into(),
                    Err(error) => error.to_string(),
                };
                anyhow::bail!("watcher {ended} ended early: {why}");
            }
            if Instant::now() > deadline {
                let least = self.seen.iter().map(|s| s.load(Ordering::Relaxed)).min();
                anyhow::bail!("watchers behind after 300 s: {least:?} of {total}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Watchers {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn config_map(name: &str, owner: Option<&ConfigMap>) -> anyhow::Result<ConfigMap> {
    let mut metadata = json!({"name": name});
    if let Some(owner) = owner {
        metadata["ownerReferences"] = json!([{
            "apiVersion": "v1", "kind": "ConfigMap",
            "name": owner.name_any(), "uid": owner.uid().context("owner uid")?,
        }]);
    }
    // About the size of an addon's status or a RoleBinding.
    let data: serde_json::Map<String, serde_json::Value> = (0..8)
        .map(|key| (format!("key-{key}"), json!("x".repeat(100))))
        .collect();
    Ok(serde_json::from_value(
        json!({"metadata": metadata, "data": data}),
    )?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let objects = knob("CP_API_OBJECTS", 10_000)?;
    let watchers = knob("CP_API_WATCHERS", 10)?;
    let clients = knob("CP_API_CLIENTS", 16)?;
    let dir = tempfile::tempdir()?;
    let api = KubeApi::start(KubeApiOptions::new(dir.path())).await?;
    let mut connections = Vec::new();
    for _ in 0..clients.max(1) {
        // A client of its own per connection: kube's clients share one
        // HTTP/2 connection otherwise.
        connections.push(api.client().await?);
    }
    let owners: Vec<ConfigMap> = {
        let started = Instant::now();
        let created = futures_util::stream::iter(0..objects)
            .map(|index| {
                let client = connections[index % connections.len()].clone();
                async move {
                    let ns = namespace(index);
                    Api::<Namespace>::all(client.clone())
                        .create(
                            &PostParams::default(),
                            &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
                        )
                        .await?;
                    let owner = Api::<ConfigMap>::namespaced(client, &ns)
                        .create(&PostParams::default(), &config_map("owner", None)?)
                        .await?;
                    anyhow::Ok(owner)
                }
            })
            .buffered(connections.len())
            .try_collect::<Vec<_>>()
            .await?;
        println!(
            "set-up: {objects} namespaces and owners in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        created
    };
    let mut watching = Watchers::start(&connections, watchers).await?;
    let owners = Arc::new(owners);
    let mut changes = 0u64;
    println!(
        "{objects} objects, {watchers} watchers of every ConfigMap, {} clients",
        connections.len()
    );
    println!("phase          requests/s   every watcher caught up after");

    let mut report = async |name: &str, rate: f64, new_changes: u64, started: Instant| {
        changes += new_changes;
        let caught_up = if new_changes > 0 {
            format!(
                "{:.2} s",
                watching.caught_up(changes, started).await?.as_secs_f64()
            )
        } else {
            "-".into()
        };
        println!("{name:<14} {rate:>10.0}   {caught_up}");
        anyhow::Ok(())
    };

    let started = Instant::now();
    let rate = phase("create", objects, &connections, |client, index| {
        let owners = owners.clone();
        async move {
            Api::<ConfigMap>::namespaced(client, &namespace(index))
                .create(
                    &PostParams::default(),
                    &config_map("dependent", Some(&owners[index]))?,
                )
                .await?;
            Ok(())
        }
    })
    .await?;
    report("create", rate, objects as u64, started).await?;

    let started = Instant::now();
    let rate = phase("get", objects, &connections, |client, index| async move {
        Api::<ConfigMap>::namespaced(client, &namespace(index))
            .get("dependent")
            .await?;
        Ok(())
    })
    .await?;
    report("get", rate, 0, started).await?;

    let started = Instant::now();
    let rate = phase("patch", objects, &connections, |client, index| async move {
        Api::<ConfigMap>::namespaced(client, &namespace(index))
            .patch(
                "dependent",
                &PatchParams::default(),
                &Patch::Merge(&json!({"data": {"patched": "yes"}})),
            )
            .await?;
        Ok(())
    })
    .await?;
    report("patch", rate, objects as u64, started).await?;

    let started = Instant::now();
    let rate = phase(
        "list 1 ns",
        objects,
        &connections,
        |client, index| async move {
            Api::<ConfigMap>::namespaced(client, &namespace(index))
                .list(&ListParams::default())
                .await?;
            Ok(())
        },
    )
    .await?;
    report("list 1 ns", rate, 0, started).await?;

    // Deleting an owner: the garbage collector deletes its dependent.
    let started = Instant::now();
    let rate = phase(
        "delete owner",
        objects,
        &connections,
        |client, index| async move {
            Api::<ConfigMap>::namespaced(client, &namespace(index))
                .delete("owner", &DeleteParams::default())
                .await?;
            Ok(())
        },
    )
    .await?;
    report("delete owner", rate, 2 * objects as u64, started).await?;

    drop(watching);
    api.shutdown().await;
    Ok(())
}
