//! The addon controllers on a hub with many clusters, against the in-memory
//! Kubernetes API with every request recorded: how long until every
//! cluster's agent ManifestWork exists, how long a ManagedProxyConfiguration
//! change takes to reach all of them, and what each phase costs the API
//! server (requests by verb and resource). At thousands of clusters the API
//! requests a reconcile makes are what a hub's apiserver pays.
//!
//! ```sh
//! cargo run --release -p addon-manager --example addons_scale
//! CP_ADDONS_CLUSTERS=500 cargo run --release -p addon-manager --example addons_scale
//! CP_ADDONS_REMOVAL_GRACE=0s cargo run --release -p addon-manager --example addons_scale
//! ```
//!
//! The controllers run in a child process (this example started again with
//! `CP_ADDONS_ROLE=controllers`), so the resident memory and CPU reported
//! for each phase are theirs alone. The example counts clusters from watches
//! of its own (a list of every work each poll would load the API the
//! controllers are measured against).
//!
//! The last phase adds `CP_ADDONS_JOINS` (5) clusters, each sorting first:
//! OCM's placement controller then moves one cluster from every decision
//! object to the next, one write at a time; it counts the addons deleted and
//! re-created on the way (`CP_ADDONS_REMOVAL_GRACE`, the controller's
//! removal grace).
//!
//! Then (unless `CP_ADDONS_PROGRESSIVE=0`) an MPC change rolls out `Progressive` with `maxConcurrency`
//! `CP_ADDONS_MAX_CONCURRENCY` (10%), a task playing every cluster's work
//! agent (each updated work applied and available after `CP_ADDONS_APPLY_MS`,
//! 200) and registration agent; it reports how long the rollout took and the
//! most clusters found updating at once, and fails if that exceeds the
//! limit.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use addon_manager::addon::{self, AddonMetrics, AddonSettings};
use anyhow::{Context as _, bail};
use cluster_proxy_proto::api::addon::v1alpha1::{ClusterManagementAddOn, ManagedClusterAddOn};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::Placement;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::work::v1::ManifestWork;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::{Value, json};
use simulated_cluster::ocm::sync_placements;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const HUB: &str = "open-cluster-management-addon";
const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBscaleCA\n-----END CERTIFICATE-----\n";
const MPC_CRD: &str =
    include_str!("../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml");

fn env_usize(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .with_context(|| format!("{name}={value:?} is not a number")),
        Err(_) => Ok(default),
    }
}

fn object<K: serde::de::DeserializeOwned>(value: Value) -> anyhow::Result<K> {
    Ok(serde_json::from_value(value)?)
}

/// The user the controllers run as: only its requests are counted.
const CONTROLLER_USER: &str = "cluster-proxy-addon-manager";

/// The controllers' requests recorded since `from`, counted by
/// "verb resource[/sub]"; and where the record ends now.
fn requests_since(api: &KubeApi, from: usize) -> (usize, BTreeMap<String, usize>) {
    let requests = api.requests();
    let mut counts = BTreeMap::new();
    for request in requests
        .iter()
        .skip(from)
        .filter(|request| request.user == CONTROLLER_USER && !request.further_check)
    {
        let resource = match &request.subresource {
            Some(sub) => format!("{}/{sub}", request.resource),
            None => request.resource.clone(),
        };
        *counts
            .entry(format!("{} {resource}", request.verb))
            .or_insert(0) += 1;
    }
    (requests.len(), counts)
}

fn report(
    phase: &str,
    took: Duration,
    clusters: usize,
    counts: &BTreeMap<String, usize>,
    controllers: &Usage,
) {
    let total: usize = counts.values().sum();
    let writes: usize = counts
        .iter()
        .filter(|(kind, _)| {
            ["create ", "update ", "patch ", "delete "]
                .iter()
                .any(|verb| kind.starts_with(verb))
        })
        .map(|(_, count)| count)
        .sum();
    println!(
        "{phase}: {:.2} s, {total} API requests ({:.1} per cluster, writes {:.1}); \
         controllers: {:.1} CPU-s, RSS {:.0} MiB (peak {:.0} MiB)",
        took.as_secs_f64(),
        total as f64 / clusters as f64,
        writes as f64 / clusters as f64,
        controllers.cpu_seconds,
        controllers.rss_mib,
        controllers.peak_rss_mib,
    );
    for (kind, count) in counts {
        println!("    {count:>7}  {kind}");
    }
}

/// What the controllers' process used: CPU over a phase, memory at its end.
struct Usage {
    cpu_seconds: f64,
    rss_mib: f64,
    peak_rss_mib: f64,
}

/// The environment variable that makes this example the controllers' process.
const ROLE: &str = "CP_ADDONS_ROLE";
const CONTROLLERS_KUBECONFIG: &str = "CP_ADDONS_CONTROLLERS_KUBECONFIG";
const CONTROLLERS_REMOVAL_GRACE_MS: &str = "CP_ADDONS_CONTROLLERS_REMOVAL_GRACE_MS";

/// The addon controllers in a process of their own (this example, started
/// again): their memory and CPU are read from `/proc`, their reconciliation
/// counts from their `/metrics`. Closing its stdin stops it.
struct ControllerProcess {
    child: Child,
    metrics: SocketAddr,
    cpu_mark: f64,
}

impl ControllerProcess {
    fn spawn(kubeconfig: &Path, removal_grace: Duration) -> anyhow::Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .env(ROLE, "controllers")
            .env(CONTROLLERS_KUBECONFIG, kubeconfig)
            .env(
                CONTROLLERS_REMOVAL_GRACE_MS,
                removal_grace.as_millis().to_string(),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("start the controllers' process")?;
        let stdout = child.stdout.take().context("the controllers' stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let metrics = line
            .trim()
            .strip_prefix("metrics ")
            .with_context(|| format!("the controllers' first line: {line:?}"))?
            .parse()?;
        Ok(Self {
            child,
            metrics,
            cpu_mark: 0.0,
        })
    }

    fn proc_file(&self, file: &str) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(format!(
            "/proc/{}/{file}",
            self.child.id()
        ))?)
    }

    /// CPU since the last call, and memory now.
    fn usage(&mut self) -> anyhow::Result<Usage> {
        let stat = self.proc_file("stat")?;
        // utime and stime: fields 14 and 15, after the parenthesised name.
        let after = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest)
            .context("/proc stat format")?;
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks = |index: usize| -> anyhow::Result<f64> {
            Ok(fields.get(index).context("/proc stat fields")?.parse()?)
        };
        // USER_HZ is 100 on Linux.
        let cpu = (ticks(11)? + ticks(12)?) / 100.0;
        let status = self.proc_file("status")?;
        let kib = |field: &str| -> f64 {
            status
                .lines()
                .find_map(|line| line.strip_prefix(field))
                .and_then(|value| {
                    value
                        .trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
                .unwrap_or(f64::NAN)
        };
        let usage = Usage {
            cpu_seconds: cpu - self.cpu_mark,
            rss_mib: kib("VmRSS:") / 1024.0,
            peak_rss_mib: kib("VmHWM:") / 1024.0,
        };
        self.cpu_mark = cpu;
        Ok(usage)
    }

    /// The reconciliations of `controller` so far.
    async fn reconciliations(&self, controller: &str) -> anyhow::Result<u64> {
        let mut stream = tokio::net::TcpStream::connect(self.metrics).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        let sample = format!("addon_reconciliations_total{{controller=\"{controller}\"}} ");
        Ok(text
            .lines()
            .find_map(|line| line.strip_prefix(&sample))
            .map(str::parse)
            .transpose()?
            .unwrap_or(0))
    }

    /// Stops the controllers (stdin closed) and waits for them.
    fn stop(mut self) -> anyhow::Result<()> {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait()? {
                if !status.success() {
                    bail!("the controllers' process ended with {status}");
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                bail!("the controllers did not stop within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The controllers' process: `addon::run` until stdin closes, with its
/// metrics on a port it prints first.
async fn controllers_process() -> anyhow::Result<()> {
    let kubeconfig = std::env::var(CONTROLLERS_KUBECONFIG)?;
    let removal_grace =
        Duration::from_millis(std::env::var(CONTROLLERS_REMOVAL_GRACE_MS)?.parse::<u64>()?);
    let client = KubeApi::client_from(Path::new(&kubeconfig)).await?;
    let metrics = AddonMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let stop = tokio_util::sync::CancellationToken::new();
    let address = cluster_proxy_runtime::admin::serve_controller_health(
        "127.0.0.1",
        0,
        registry,
        stop.clone(),
    )
    .await?;
    println!("metrics {address}");
    let stdin_closed = async {
        let _ = tokio::task::spawn_blocking(|| {
            let mut rest = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut rest);
        })
        .await;
    };
    addon::run(
        client,
        AddonSettings {
            removal_grace,
            ..AddonSettings::new(HUB)
        },
        metrics,
        stdin_closed,
    )
    .await;
    stop.cancel();
    Ok(())
}

/// The example's own view of the works and addons, from watches, as a
/// dashboard has it.
struct Views {
    works: Store<ManifestWork>,
    addons: Store<ManagedClusterAddOn>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Views {
    async fn start(client: &kube::Client) -> anyhow::Result<Self> {
        let (works, works_writer) = reflector::store();
        let (addons, addons_writer) = reflector::store();
        let tasks = vec![
            mirror(works_writer, Api::<ManifestWork>::all(client.clone())),
            mirror(
                addons_writer,
                Api::<ManagedClusterAddOn>::all(client.clone()),
            ),
        ];
        works.wait_until_ready().await?;
        addons.wait_until_ready().await?;
        Ok(Self {
            works,
            addons,
            tasks,
        })
    }
}

/// Keeps `writer`'s store a mirror of every object `api` lists.
fn mirror<K>(writer: reflector::store::Writer<K>, api: Api<K>) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    tokio::spawn(async move {
        reflector::reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .applied_objects()
            .for_each(|_| async {})
            .await;
    })
}

impl Drop for Views {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Polls `done` (a count of clusters in the wanted state) until it reaches
/// `clusters`, or fails after `limit`.
async fn wait_for<F, Fut>(
    what: &str,
    clusters: usize,
    limit: Duration,
    mut done: F,
) -> anyhow::Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<usize>>,
{
    let started = Instant::now();
    loop {
        let count = done().await?;
        if count >= clusters {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            bail!("{what}: {count} of {clusters} after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn replicas_of(work: &ManifestWork) -> Option<i64> {
    work.spec
        .workload
        .as_ref()?
        .manifests
        .as_ref()?
        .iter()
        .find(|manifest| manifest.kind() == Some("Deployment"))?
        .0["spec"]["replicas"]
        .as_i64()
}

async fn works_with_replicas(views: &Views, replicas: i64) -> anyhow::Result<usize> {
    Ok(views
        .works
        .state()
        .iter()
        .filter(|work| replicas_of(work) == Some(replicas))
        .count())
}

/// Each cluster's addon UID.
fn addon_uids(views: &Views) -> BTreeMap<String, String> {
    views
        .addons
        .state()
        .iter()
        .filter_map(|addon| {
            Some((
                addon.metadata.namespace.clone()?,
                addon.metadata.uid.clone()?,
            ))
        })
        .collect()
}

/// How many addons have the `Progressing` condition with `reason`.
async fn addons_progressing(views: &Views, reason: &str) -> anyhow::Result<usize> {
    Ok(views
        .addons
        .state()
        .iter()
        .filter(|addon| {
            cluster_proxy_proto::api::find_condition(addon.conditions(), "Progressing")
                .is_some_and(|condition| condition.reason == reason)
        })
        .count())
}

/// How many addons the ClusterManagementAddOn's `installProgressions` says
/// completed, once its `Progressing` condition says `Completed` (else 0).
async fn summary_completed(client: &kube::Client) -> anyhow::Result<usize> {
    let management = Api::<ClusterManagementAddOn>::all(client.clone())
        .get("cluster-proxy")
        .await?;
    let progressions = management
        .status
        .and_then(|status| status.install_progressions)
        .unwrap_or_default();
    let done = progressions.first().and_then(|progression| {
        let condition = cluster_proxy_proto::api::find_condition(
            progression.conditions.as_deref()?,
            "Progressing",
        )?;
        if condition.reason != "Completed" {
            return None;
        }
        // "selected clusters N. configured addons done/configured completed ..."
        let counts = condition.message.split("configured addons ").nth(1)?;
        counts.split('/').next()?.parse::<usize>().ok()
    });
    Ok(done.unwrap_or(0))
}

/// Every cluster's work agent and registration agent, played by one task
/// that watches the works as the clusters' agents do: a work whose current
/// generation is not reported yet is reported applied and available once it
/// has waited the delay, and each addon is made `Available` once.
struct WorkAgents {
    stop: tokio::sync::watch::Sender<bool>,
    most_at_once: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl WorkAgents {
    fn start(client: kube::Client, delay: Duration) -> Self {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let most_at_once = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = most_at_once.clone();
        let task = tokio::spawn(async move {
            let mut works = std::pin::pin!(
                watcher(
                    Api::<ManifestWork>::all(client.clone()),
                    watcher::Config::default()
                )
                .default_backoff()
                .applied_objects()
            );
            // Works updated and not yet reported: their generation, since when.
            let mut updating: BTreeMap<String, (i64, Instant)> = BTreeMap::new();
            let mut available: std::collections::BTreeSet<String> = Default::default();
            let mut reported_generation: BTreeMap<String, i64> = BTreeMap::new();
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                tokio::select! {
                    _ = stopped.changed() => break,
                    event = works.next() => {
                        // A watch error (history expired under load) re-lists.
                        let Some(Ok(work)) = event else {
                            if event.is_none() { break } else { continue }
                        };
                        let generation = work.metadata.generation.unwrap_or_default();
                        let reported = work
                            .status
                            .as_ref()
                            .and_then(|status| status.conditions.as_deref())
                            .and_then(|conditions| {
                                cluster_proxy_proto::api::find_condition(conditions, "Applied")
                            })
                            .is_some_and(|applied| applied.observed_generation == Some(generation));
                        let cluster = work.namespace().unwrap_or_default();
                        let newer = reported_generation
                            .get(&cluster)
                            .is_none_or(|done| *done < generation);
                        if reported || !newer {
                            // Reported: by this task, an event that was
                            // still on its way.
                        } else if updating.get(&cluster).is_none_or(|(seen, _)| *seen != generation) {
                            updating.insert(cluster, (generation, Instant::now()));
                        }
                        most.fetch_max(updating.len(), std::sync::atomic::Ordering::Relaxed);
                    }
                    _ = tick.tick() => {
                        let due: Vec<(String, i64)> = updating
                            .iter()
                            .filter(|(_, (_, since))| since.elapsed() >= delay)
                            .map(|(cluster, (generation, _))| (cluster.clone(), *generation))
                            .collect();
                        for (cluster, generation) in &due {
                            updating.remove(cluster);
                            reported_generation.insert(cluster.clone(), *generation);
                        }
                        let first_report: Vec<bool> =
                            due.iter().map(|(cluster, _)| available.insert(cluster.clone())).collect();
                        // The clusters' agents report side by side.
                        let reports: Vec<(String, i64, bool)> = due
                            .into_iter()
                            .zip(first_report)
                            .map(|((cluster, generation), first)| (cluster, generation, first))
                            .collect();
                        futures_util::stream::iter(reports)
                            .map(|(cluster, generation, first)| {
                                let client = client.clone();
                                async move {
                                    report_applied(&client, &cluster, generation).await?;
                                    if first {
                                        report_available(&client, &cluster).await?;
                                    }
                                    anyhow::Ok(())
                                }
                            })
                            .buffer_unordered(16)
                            .collect::<Vec<_>>()
                            .await
                            .into_iter()
                            .collect::<anyhow::Result<Vec<()>>>()?;
                    }
                }
            }
            Ok(())
        });
        Self {
            stop,
            most_at_once,
            task,
        }
    }

    /// Starts counting the works updating at once afresh.
    fn reset_count(&self) {
        self.most_at_once
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stops the agents; the most works found updating at once since the
    /// last [`WorkAgents::reset_count`].
    async fn stop(self) -> anyhow::Result<usize> {
        let _ = self.stop.send(true);
        self.task.await??;
        Ok(self.most_at_once.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// The work agent of `cluster` reports its work applied and available at
/// `generation`.
async fn report_applied(
    client: &kube::Client,
    cluster: &str,
    generation: i64,
) -> anyhow::Result<()> {
    let condition = |type_: &str| {
        json!({"type": type_, "status": "True", "reason": "Done", "message": "done",
            "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": generation})
    };
    Api::<ManifestWork>::namespaced(client.clone(), cluster)
        .patch_status(
            addon::MANIFEST_WORK_NAME,
            &PatchParams::apply("work-agent").force(),
            &Patch::Apply(&json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": addon::MANIFEST_WORK_NAME, "namespace": cluster},
                "status": {"conditions": [condition("Applied"), condition("Available")]},
            })),
        )
        .await?;
    Ok(())
}

/// The registration agent of `cluster` reports the addon `Available`.
async fn report_available(client: &kube::Client, cluster: &str) -> anyhow::Result<()> {
    Api::<ManagedClusterAddOn>::namespaced(client.clone(), cluster)
        .patch_status(
            addon::ADDON_NAME,
            &PatchParams::apply("registration-agent").force(),
            &Patch::Apply(&json!({
                "apiVersion": "addon.open-cluster-management.io/v1alpha1",
                "kind": "ManagedClusterAddOn",
                "metadata": {"name": addon::ADDON_NAME, "namespace": cluster},
                "status": {"conditions": [{"type": "Available", "status": "True",
                    "reason": "ManagedClusterAddOnLeaseUpdated", "message": "renewed",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
            })),
        )
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if std::env::var(ROLE).as_deref() == Ok("controllers") {
        return controllers_process().await;
    }
    let clusters = env_usize("CP_ADDONS_CLUSTERS", 200)?;
    let removal_grace = match std::env::var("CP_ADDONS_REMOVAL_GRACE") {
        Ok(text) => cluster_proxy_proto::duration::parse_go_duration(&text)
            .with_context(|| format!("CP_ADDONS_REMOVAL_GRACE={text:?}"))?,
        Err(_) => addon::DEFAULT_REMOVAL_GRACE,
    };
    let limit = Duration::from_secs(env_usize("CP_ADDONS_TIMEOUT_SECS", 600)? as u64);
    let dir = tempfile::tempdir()?;
    let api = KubeApi::start(KubeApiOptions {
        record_requests: true,
        // A watch closed for falling behind resumes from the history; at
        // thousands of clusters a burst outruns the default 1,000 changes
        // (kube-apiserver's watch cache grows to 102,400 per type).
        history: 32_768,
        ..KubeApiOptions::new(dir.path())
    })
    .await?;
    api.register_crds_from_yaml(simulated_cluster::ocm::CRDS)?;
    api.register_crds_from_yaml(MPC_CRD)?;
    let admin = api.client().await?;

    // The hub: namespace, CA bundle, MPC, clusters and the placement's decisions.
    let namespaces = Api::<Namespace>::all(admin.clone());
    let create_namespace = |name: String| {
        let namespaces = namespaces.clone();
        async move {
            namespaces
                .create(
                    &PostParams::default(),
                    &object(json!({"metadata": {"name": name}}))?,
                )
                .await?;
            anyhow::Ok(())
        }
    };
    create_namespace(HUB.to_owned()).await?;
    let secret = simulated_cluster::ocm::ca_bundle_secret(HUB, CA_PEM);
    Api::<Secret>::namespaced(admin.clone(), HUB)
        .create(&PostParams::default(), &secret)
        .await?;
    let mpc = simulated_cluster::ocm::sample_managed_proxy_configuration(HUB, 1)?;
    let mpcs = Api::<ManagedProxyConfiguration>::all(admin.clone());
    mpcs.create(&PostParams::default(), &mpc).await?;
    let names: Vec<String> = (0..clusters)
        .map(|index| format!("cluster-{index:05}"))
        .collect();
    let managed_clusters = Api::<ManagedCluster>::all(admin.clone());
    // A cluster: its namespace and its accepted ManagedCluster.
    let add_cluster = |name: String| {
        let managed_clusters = managed_clusters.clone();
        let create_namespace = &create_namespace;
        async move {
            create_namespace(name.clone()).await?;
            managed_clusters
                .create(
                    &PostParams::default(),
                    &object(
                        json!({"metadata": {"name": name}, "spec": {"hubAcceptsClient": true}}),
                    )?,
                )
                .await?;
            anyhow::Ok(())
        }
    };
    let setup = Instant::now();
    futures_util::stream::iter(&names)
        .map(|name| add_cluster(name.clone()))
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<()>>>()?;
    let setup = setup.elapsed();
    // The placement selects every cluster; the environment's placement
    // controller writes its decisions as OCM's does (100 to an object).
    let placement: Placement = object(json!({
        "metadata": {"name": "cluster-proxy-placement", "namespace": HUB},
        "spec": {},
    }))?;
    Api::<Placement>::namespaced(admin.clone(), HUB)
        .create(&PostParams::default(), &placement)
        .await?;
    sync_placements(&admin).await?;
    let views = Views::start(&admin).await?;
    println!(
        "{clusters} clusters (namespaces and ManagedClusters created in {:.1} s, {:.0} requests/s); \
         the addon controllers start",
        setup.as_secs_f64(),
        (2 * clusters) as f64 / setup.as_secs_f64()
    );

    let mut controllers = ControllerProcess::spawn(
        &api.kubeconfig_for(CONTROLLER_USER, &["system:masters"])?,
        removal_grace,
    )?;

    // Phase 1: from nothing to an addon, its status and its work per cluster.
    let (mark, _) = requests_since(&api, 0);
    let took = wait_for("works", clusters, limit, || works_with_replicas(&views, 1)).await?;
    let took = took
        + wait_for("addon statuses", clusters, limit, || async {
            Ok(views
                .addons
                .state()
                .iter()
                .filter(|addon| {
                    addon
                        .status
                        .as_ref()
                        .and_then(|status| status.registrations.as_ref())
                        .is_some()
                })
                .count())
        })
        .await?;
    // Let the events of the controllers' own writes play out before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (mark_after, counts) = requests_since(&api, mark);
    report("install", took, clusters, &counts, &controllers.usage()?);

    // Phase 2: one MPC change (the agent's replicas) reaches every work.
    let started = mark_after;
    mpcs.patch(
        "cluster-proxy",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"proxyAgent": {"replicas": 2}}})),
    )
    .await?;
    let took = wait_for("updated works", clusters, limit, || {
        works_with_replicas(&views, 2)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (mark_after, counts) = requests_since(&api, started);
    report("MPC change", took, clusters, &counts, &controllers.usage()?);

    // Phase 3: a change that concerns no addon (a Service in the hub namespace).
    let started = mark_after;
    let service: Service = object(json!({
        "metadata": {"name": "unrelated", "namespace": HUB},
        "spec": {"ports": [{"port": 80}]},
    }))?;
    Api::<Service>::namespaced(admin.clone(), HUB)
        .create(&PostParams::default(), &service)
        .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_, counts) = requests_since(&api, started);
    report(
        "unrelated Service (5 s after)",
        Duration::from_secs(5),
        clusters,
        &counts,
        &controllers.usage()?,
    );

    // Phase 4: clusters join at the head of the sorted list, one after
    // another. With each, every decision object's last cluster moves to the
    // next object, the objects written one after another: each mover is
    // briefly in no decision.
    let started = mark_after;
    let uids = addon_uids(&views);
    let joins = env_usize("CP_ADDONS_JOINS", 5)?;
    let phase = Instant::now();
    let mut movers = 0;
    for join in 0..joins {
        let before = clusters + join;
        movers += before / simulated_cluster::ocm::MAX_CLUSTERS_PER_DECISION;
        // Each newcomer sorts before the previous one.
        let newcomer = format!("a-newcomer-{}", joins - join);
        add_cluster(newcomer.clone()).await?;
        sync_placements(&admin).await?;
        wait_for(&format!("{newcomer}'s work"), 1, limit, || async {
            let work = Api::<ManifestWork>::namespaced(admin.clone(), &newcomer)
                .get_opt(addon::MANIFEST_WORK_NAME)
                .await?;
            Ok(usize::from(work.is_some()))
        })
        .await?;
    }
    // Long enough for a flap to happen and be repaired.
    tokio::time::sleep(Duration::from_secs(2)).await;
    wait_for("every work", clusters + joins, limit, || {
        works_with_replicas(&views, 2)
    })
    .await?;
    let (_, counts) = requests_since(&api, started);
    let after = addon_uids(&views);
    let recreated = uids
        .iter()
        .filter(|(cluster, uid)| after.get(*cluster) != Some(*uid))
        .count();
    report(
        &format!(
            "{joins} clusters join at the head, {movers} clusters move between decision \
             objects (removal grace {removal_grace:?}); addons deleted and re-created: {recreated}"
        ),
        phase.elapsed(),
        clusters,
        &counts,
        &controllers.usage()?,
    );

    if env_usize("CP_ADDONS_PROGRESSIVE", 1)? == 0 {
        drop(views);
        tokio::task::spawn_blocking(move || controllers.stop()).await??;
        api.shutdown().await;
        return Ok(());
    }

    // Phase 5: a Progressive rollout of an MPC change, the clusters' work
    // and registration agents played by a task that reports each updated
    // work applied and available after `CP_ADDONS_APPLY_MS` (a pod rollout).
    let total = clusters + joins;
    let max_concurrency = std::env::var("CP_ADDONS_MAX_CONCURRENCY").unwrap_or("10%".into());
    let apply_delay = Duration::from_millis(env_usize("CP_ADDONS_APPLY_MS", 200)? as u64);
    let agents = WorkAgents::start(admin.clone(), apply_delay);
    wait_for("addons Completed before the rollout", total, limit, || {
        addons_progressing(&views, "Completed")
    })
    .await?;
    agents.reset_count();
    let started = requests_since(&api, 0).0;
    let limit_clusters = match max_concurrency.strip_suffix('%') {
        Some(percent) => (percent.parse::<usize>()? * total).div_ceil(100),
        None => max_concurrency.parse()?,
    };
    let concurrency: Value = match max_concurrency.parse::<i64>() {
        Ok(count) => json!(count),
        Err(_) => json!(max_concurrency),
    };
    let reconciled = controllers.reconciliations("managedclusteraddon").await?;
    Api::<ClusterManagementAddOn>::all(admin.clone())
        .patch(
            addon::ADDON_NAME,
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"spec": {"installStrategy": {"type": "Placements", "placements": [{
                "name": "cluster-proxy-placement", "namespace": HUB,
                "rolloutStrategy": {"type": "Progressive",
                    "progressive": {"maxConcurrency": concurrency}}}]}}}),
            ),
        )
        .await?;
    // The strategy applies to changes the controller sees after it: every
    // addon is reconciled once the ClusterManagementAddOn's event arrives.
    wait_for(
        "addons reconciled after the strategy",
        total,
        limit,
        || async {
            Ok(usize::try_from(
                controllers
                    .reconciliations("managedclusteraddon")
                    .await?
                    .saturating_sub(reconciled),
            )?)
        },
    )
    .await?;
    let phase = Instant::now();
    mpcs.patch(
        "cluster-proxy",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"proxyAgent": {"replicas": 3}}})),
    )
    .await?;
    wait_for("rolled-out works", total, limit, || {
        works_with_replicas(&views, 3)
    })
    .await?;
    wait_for("addons Completed after the rollout", total, limit, || {
        addons_progressing(&views, "Completed")
    })
    .await?;
    // The ClusterManagementAddOn's summary follows within a second or so.
    wait_for(
        "the ClusterManagementAddOn's installProgressions Completed",
        total,
        limit,
        || summary_completed(&admin),
    )
    .await?;
    let took = phase.elapsed();
    let most_at_once = agents.stop().await?;
    let (_, counts) = requests_since(&api, started);
    report(
        &format!(
            "Progressive rollout, maxConcurrency {max_concurrency} ({limit_clusters} clusters), \
             each applied after {apply_delay:?}; the most clusters updating at once: {most_at_once}"
        ),
        took,
        total,
        &counts,
        &controllers.usage()?,
    );
    if most_at_once > limit_clusters {
        bail!("{most_at_once} clusters updated at once, more than maxConcurrency {limit_clusters}");
    }

    drop(views);
    tokio::task::spawn_blocking(move || controllers.stop()).await??;
    api.shutdown().await;
    Ok(())
}
