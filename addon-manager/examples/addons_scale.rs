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
//! The last phase adds `CP_ADDONS_JOINS` (5) clusters, each sorting first:
//! OCM's placement controller then moves one cluster from every decision
//! object to the next, one write at a time; it counts the addons deleted and
//! re-created on the way (`CP_ADDONS_REMOVAL_GRACE`, the controller's
//! removal grace).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use addon_manager::addon::{self, AddonMetrics, AddonSettings};
use anyhow::{Context as _, bail};
use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::Placement;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::work::v1::ManifestWork;
use e2e::env::ocm::sync_placements;
use e2e::kubeapi::{KubeApi, KubeApiOptions};
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::sync::oneshot;

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
        .filter(|request| request.user == CONTROLLER_USER)
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

fn report(phase: &str, took: Duration, clusters: usize, counts: &BTreeMap<String, usize>) {
    let total: usize = counts.values().sum();
    println!(
        "{phase}: {:.2} s, {total} API requests ({:.1} per cluster)",
        took.as_secs_f64(),
        total as f64 / clusters as f64
    );
    for (kind, count) in counts {
        println!("    {count:>7}  {kind}");
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
        // Each poll lists every work: polling faster would load the API the
        // controllers are measured against.
        tokio::time::sleep(Duration::from_millis(500)).await;
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

async fn works_with_replicas(client: &kube::Client, replicas: i64) -> anyhow::Result<usize> {
    let works = Api::<ManifestWork>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    Ok(works
        .items
        .iter()
        .filter(|work| replicas_of(work) == Some(replicas))
        .count())
}

/// Each cluster's addon UID.
async fn addon_uids(client: &kube::Client) -> anyhow::Result<BTreeMap<String, String>> {
    let addons = Api::<ManagedClusterAddOn>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    Ok(addons
        .items
        .into_iter()
        .filter_map(|addon| Some((addon.metadata.namespace?, addon.metadata.uid?)))
        .collect())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
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
        ..KubeApiOptions::new(dir.path())
    })
    .await?;
    api.register_crds_from_yaml(e2e::env::ocm::CRDS)?;
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
    let secret = e2e::env::ocm::ca_bundle_secret(HUB, CA_PEM);
    Api::<Secret>::namespaced(admin.clone(), HUB)
        .create(&PostParams::default(), &secret)
        .await?;
    let mpc = e2e::env::ocm::sample_managed_proxy_configuration(HUB, 1)?;
    let mpcs = Api::<ManagedProxyConfiguration>::all(admin.clone());
    mpcs.create(&PostParams::default(), &mpc).await?;
    let names: Vec<String> = (0..clusters)
        .map(|index| format!("cluster-{index:05}"))
        .collect();
    let managed_clusters = Api::<ManagedCluster>::all(admin.clone());
    for name in &names {
        create_namespace(name.clone()).await?;
        managed_clusters
            .create(
                &PostParams::default(),
                &object(json!({"metadata": {"name": name}, "spec": {"hubAcceptsClient": true}}))?,
            )
            .await?;
    }
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
    println!("{clusters} clusters; the addon controllers start");

    let controller_client =
        KubeApi::client_from(&api.kubeconfig_for(CONTROLLER_USER, &["system:masters"])?).await?;
    let (stop, stopped) = oneshot::channel::<()>();
    let controllers = tokio::spawn(addon::run(
        controller_client,
        AddonSettings {
            removal_grace,
            ..AddonSettings::new(HUB)
        },
        AddonMetrics::default(),
        async {
            let _ = stopped.await;
        },
    ));

    // Phase 1: from nothing to an addon, its status and its work per cluster.
    let (mark, _) = requests_since(&api, 0);
    let took = wait_for("works", clusters, limit, || works_with_replicas(&admin, 1)).await?;
    let addons = Api::<ManagedClusterAddOn>::all(admin.clone());
    let took = took
        + wait_for("addon statuses", clusters, limit, || async {
            let list = addons.list(&ListParams::default()).await?;
            Ok(list
                .items
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
    report("install", took, clusters, &counts);

    // Phase 2: one MPC change (the agent's replicas) reaches every work.
    let started = mark_after;
    mpcs.patch(
        "cluster-proxy",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"proxyAgent": {"replicas": 2}}})),
    )
    .await?;
    let took = wait_for("updated works", clusters, limit, || {
        works_with_replicas(&admin, 2)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (mark_after, counts) = requests_since(&api, started);
    report("MPC change", took, clusters, &counts);

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
    );

    // Phase 4: clusters join at the head of the sorted list, one after
    // another. With each, every decision object's last cluster moves to the
    // next object, the objects written one after another: each mover is
    // briefly in no decision.
    let started = mark_after;
    let uids = addon_uids(&admin).await?;
    let joins = env_usize("CP_ADDONS_JOINS", 5)?;
    let phase = Instant::now();
    let mut movers = 0;
    for join in 0..joins {
        let before = clusters + join;
        movers += before / e2e::env::ocm::MAX_CLUSTERS_PER_DECISION;
        // Each newcomer sorts before the previous one.
        let newcomer = format!("a-newcomer-{}", joins - join);
        create_namespace(newcomer.clone()).await?;
        managed_clusters
            .create(
                &PostParams::default(),
                &object(
                    json!({"metadata": {"name": newcomer}, "spec": {"hubAcceptsClient": true}}),
                )?,
            )
            .await?;
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
        works_with_replicas(&admin, 2)
    })
    .await?;
    let (_, counts) = requests_since(&api, started);
    let after = addon_uids(&admin).await?;
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
    );

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), controllers)
        .await
        .context("the controllers stop")??;
    api.shutdown().await;
    Ok(())
}
