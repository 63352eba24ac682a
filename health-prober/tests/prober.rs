//! Probe rounds against in-process proxy-servers and agents, recording in
//! the in-memory Kubernetes API.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::find_condition;
use cluster_proxy_runtime::reload;
use common::{Apiserver, Hub, Tunnel, WAIT};
use health_prober::metrics::{ClusterLabel, ProberMetrics};
use health_prober::probe::ProbeTarget;
use health_prober::prober::{FIELD_MANAGER, Prober, RoundReport};
use health_prober::replicas::Replica;
use kube::Api;
use kube::api::{Patch, PatchParams};
use simulated_cluster::wait::wait_until;

fn prober(hub: &Hub, tunnel: &Tunnel, apiserver: &Apiserver, metrics: ProberMetrics) -> Prober {
    let tls = reload::fixed(tunnel.pki.client_tls().unwrap());
    let replicas = (0..tunnel.servers.len())
        .map(|i| Replica::new(&tunnel.client_address(i), tls.clone()).unwrap())
        .collect();
    Prober::new(
        hub.client.clone(),
        replicas,
        ProbeTarget {
            port: apiserver.port,
            tls: health_prober::tls::target_client(None).unwrap(),
            timeout: Duration::from_secs(3),
        },
        64,
        metrics,
    )
    // A loaded test machine must not look like a latency change.
    .with_latency_floor(QUIET)
}

/// Latency differences the tests ignore.
const QUIET: Duration = Duration::from_secs(10);

async fn lose_tunnel(
    tunnel: &Tunnel,
    index: usize,
    agent: tunnel_harness::in_process::AgentUnderTest,
) {
    let server = &tunnel.servers[index];
    let before = server.tunnel_count();
    agent.kill();
    assert!(
        wait_until(WAIT, || server.tunnel_count() < before).await,
        "replica {index} still sees the killed agent"
    );
}

#[tokio::test]
async fn reachable_degraded_unreachable_and_back_writing_only_on_change() {
    let hub = Hub::start(&["cluster-a"]).await;
    let tunnel = Tunnel::start(&["cluster-a"], 2).await;
    let apiserver = Apiserver::start(&["cluster-a"]).await;
    let first = tunnel.agent("cluster-a", 0).await;
    let second = tunnel.agent("cluster-a", 1).await;
    let metrics = ProberMetrics::default();
    let prober = prober(&hub, &tunnel, &apiserver, metrics.clone());

    let report = prober.round().await.unwrap();
    assert_eq!(
        report,
        RoundReport {
            listed: 1,
            members: 1,
            clusters: 1,
            reachable: 1,
            writes: 1,
            write_errors: 0
        }
    );
    let (status, reason, message) = hub.reachability("cluster-a").await.unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Reachable"));
    assert!(message.starts_with("replicas=2/2 latency_ms="), "{message}");
    assert!(message.contains("status=200"), "{message}");

    // Nothing changed: the object is not rewritten.
    let version = hub.addon("cluster-a").await.metadata.resource_version;
    for _ in 0..5 {
        assert_eq!(prober.round().await.unwrap().writes, 0);
    }
    assert_eq!(
        hub.addon("cluster-a").await.metadata.resource_version,
        version
    );
    assert_eq!(metrics.status_writes.get(), 1);

    lose_tunnel(&tunnel, 1, second).await;
    let report = prober.round().await.unwrap();
    assert_eq!((report.reachable, report.writes), (0, 1));
    let (status, reason, message) = hub.reachability("cluster-a").await.unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("False", "Degraded"));
    let failing = tunnel.client_address(1);
    assert!(message.starts_with("replicas=1/2 "), "{message}");
    assert!(message.contains(&format!("failing={failing}")), "{message}");
    assert!(message.contains("no agent connected"), "{message}");

    lose_tunnel(&tunnel, 0, first).await;
    prober.round().await.unwrap();
    let (status, reason, message) = hub.reachability("cluster-a").await.unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("False", "Unreachable"));
    assert!(message.starts_with("replicas=0/2 "), "{message}");

    let _first = tunnel.agent("cluster-a", 0).await;
    let _second = tunnel.agent("cluster-a", 1).await;
    prober.round().await.unwrap();
    let (status, reason, _) = hub.reachability("cluster-a").await.unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Reachable"));
}

#[tokio::test]
async fn an_apiserver_answering_500_is_unreachable_with_the_code() {
    let hub = Hub::start(&["cluster-a"]).await;
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let apiserver = Apiserver::start(&["cluster-a"]).await;
    let _agent = tunnel.agent("cluster-a", 0).await;
    let prober = prober(&hub, &tunnel, &apiserver, ProberMetrics::default());

    apiserver.status.store(500, Ordering::SeqCst);
    prober.round().await.unwrap();
    let (status, reason, message) = hub.reachability("cluster-a").await.unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("False", "Unreachable"));
    assert!(message.contains("status=500"), "{message}");
    assert!(message.contains("/healthz answered 500"), "{message}");

    apiserver.status.store(200, Ordering::SeqCst);
    prober.round().await.unwrap();
    let (status, _, message) = hub.reachability("cluster-a").await.unwrap();
    assert_eq!(status, "True", "{message}");
}

#[tokio::test]
async fn other_managers_conditions_survive_and_every_cluster_is_probed() {
    let clusters = ["cluster-a", "cluster-b", "cluster-c"];
    let hub = Hub::start(&clusters).await;
    let tunnel = Tunnel::start(&clusters, 1).await;
    let apiserver = Apiserver::start(&clusters).await;
    // cluster-c has no agent.
    let _a = tunnel.agent("cluster-a", 0).await;
    let _b = tunnel.agent("cluster-b", 0).await;
    let available = serde_json::json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "ManagedClusterAddOn",
        "metadata": {"name": "cluster-proxy", "namespace": "cluster-a"},
        "status": {"conditions": [{
            "type": "Available", "status": "True", "reason": "ProbeAvailable",
            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]},
    });
    Api::<ManagedClusterAddOn>::namespaced(hub.client.clone(), "cluster-a")
        .patch_status(
            "cluster-proxy",
            &PatchParams::apply("addon-framework").force(),
            &Patch::Apply(&available),
        )
        .await
        .unwrap();
    let metrics = ProberMetrics::default();
    let prober = prober(&hub, &tunnel, &apiserver, metrics.clone());

    let report = prober.round().await.unwrap();
    assert_eq!(
        (report.clusters, report.reachable, report.writes),
        (3, 2, 3)
    );
    let addon = hub.addon("cluster-a").await;
    assert!(find_condition(addon.conditions(), "Available").is_some());
    let managers: Vec<_> = addon
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .collect();
    assert!(managers.iter().any(|m| m == FIELD_MANAGER), "{managers:?}");
    let (_, reason, message) = hub.reachability("cluster-c").await.unwrap();
    assert_eq!(reason, "Unreachable");
    assert!(message.contains("no agent connected"), "{message}");

    // A cluster whose addon is gone loses its reachability gauge.
    let gauge = |cluster: &str| {
        metrics
            .cluster_reachable
            .get(&ClusterLabel {
                cluster: cluster.into(),
            })
            .map(|g| g.get())
    };
    assert_eq!(gauge("cluster-c"), Some(0));
    assert_eq!(gauge("cluster-a"), Some(1));
    Api::<ManagedClusterAddOn>::namespaced(hub.client.clone(), "cluster-c")
        .delete("cluster-proxy", &Default::default())
        .await
        .unwrap();
    assert_eq!(prober.round().await.unwrap().clusters, 2);
    assert_eq!(gauge("cluster-c"), None);
    assert_eq!(gauge("cluster-a"), Some(1));
    drop(hub.api);
}

#[tokio::test]
async fn a_replica_that_cannot_be_reached_degrades_every_cluster_by_name() {
    let hub = Hub::start(&["cluster-a", "cluster-b"]).await;
    let tunnel = Tunnel::start(&["cluster-a", "cluster-b"], 1).await;
    let apiserver = Apiserver::start(&["cluster-a", "cluster-b"]).await;
    let _a = tunnel.agent("cluster-a", 0).await;
    let _b = tunnel.agent("cluster-b", 0).await;
    let tls = reload::fixed(tunnel.pki.client_tls().unwrap());
    let down = format!(
        "localhost:{}",
        simulated_cluster::targets::closed_port()
            .await
            .unwrap()
            .port()
    );
    let prober = Prober::new(
        hub.client.clone(),
        vec![
            Replica::new(&tunnel.client_address(0), tls.clone()).unwrap(),
            Replica::new(&down, tls).unwrap(),
        ],
        ProbeTarget {
            port: apiserver.port,
            tls: health_prober::tls::target_client(None).unwrap(),
            timeout: Duration::from_secs(3),
        },
        64,
        ProberMetrics::default(),
    )
    .with_latency_floor(QUIET);
    for round in 0..2 {
        let report = prober.round().await.unwrap();
        assert_eq!(report.writes, if round == 0 { 2 } else { 0 });
        for cluster in ["cluster-a", "cluster-b"] {
            let (status, reason, message) = hub.reachability(cluster).await.unwrap();
            assert_eq!((status.as_str(), reason.as_str()), ("False", "Degraded"));
            assert!(message.contains(&format!("failing={down} ")), "{message}");
            assert!(message.contains("replica unavailable"), "{message}");
        }
    }
}
