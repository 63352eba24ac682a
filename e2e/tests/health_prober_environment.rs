//! The prober against the control-plane environment (`e2e::env`; a cross-service scenario, so it lives in e2e): the real
//! addon-manager, proxy-server replicas and agents as processes, the stand-in
//! kube-apiserver at `<cluster>:6443`.

use std::time::{Duration, Instant};

use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::find_condition;
use cluster_proxy_runtime::reload;
use e2e::env::control_plane::replica_client_addr;
use e2e::env::{EnvOptions, Environment};
use health_prober::metrics::ProberMetrics;
use health_prober::probe::ProbeTarget;
use health_prober::prober::Prober;
use health_prober::replicas::Replica;
use health_prober::verdict::CONDITION_TYPE;
use kube::Api;
use simulated_cluster::sample::APISERVER_PORT;

const READY: Duration = Duration::from_secs(180);
const CHANGE: Duration = Duration::from_secs(30);

/// Runs rounds until the cluster's condition satisfies `done`; its message.
async fn rounds_until(
    prober: &Prober,
    client: &kube::Client,
    cluster: &str,
    what: &str,
    done: impl Fn(&str, &str) -> bool,
) -> String {
    let api = Api::<ManagedClusterAddOn>::namespaced(client.clone(), cluster);
    let started = Instant::now();
    loop {
        prober.round().await.unwrap();
        let addon = api.get("cluster-proxy").await.unwrap();
        let last = find_condition(addon.conditions(), CONDITION_TYPE)
            .map(|c| (c.reason.clone(), c.message.clone()));
        if let Some((reason, message)) = &last
            && done(reason, message)
        {
            return message.clone();
        }
        assert!(
            started.elapsed() < CHANGE,
            "{cluster}: never {what}; last {last:?}"
        );
    }
}

#[tokio::test]
async fn reachable_through_both_replicas_then_degraded_then_unreachable() {
    let mut options = EnvOptions::new(1);
    options.control_plane = true;
    let names = options.clusters.clone();
    let replica_count = options.replicas;
    let cluster = names[0].clone();
    let env = Environment::start(options).await.unwrap();
    env.wait_clusters_ready(&names, replica_count, READY)
        .await
        .unwrap();
    let client = env.admin_client().await.unwrap();
    let pki = &env.summary.pki_dir;
    let tls = reload::fixed(
        health_prober::tls::proxy_client(
            &pki.join("ca-bundle.crt"),
            &pki.join("proxy-client/tls.crt"),
            &pki.join("proxy-client/tls.key"),
        )
        .unwrap(),
    );
    let addresses: Vec<String> = (0..replica_count)
        .map(|i| replica_client_addr(env.summary.hub_addr, i).to_string())
        .collect();
    let replicas = addresses
        .iter()
        .map(|a| Replica::new(a, tls.clone()).unwrap())
        .collect();
    let prober = Prober::new(
        client.clone(),
        replicas,
        ProbeTarget {
            port: APISERVER_PORT,
            tls: health_prober::tls::target_client(None).unwrap(),
            timeout: Duration::from_secs(5),
        },
        64,
        ProberMetrics::default(),
    );

    let message = rounds_until(&prober, &client, &cluster, "reachable 2/2", |reason, m| {
        reason == "Reachable" && m.starts_with("replicas=2/2 ")
    })
    .await;
    assert!(message.contains("status=200"), "{message}");

    // Stop hub replica 1: the cluster is reachable through replica 0 only.
    {
        let control_plane = env.control_plane.as_ref().unwrap();
        let mut hub = control_plane.hub.lock().await;
        for process in hub.pod_processes("cluster-proxy", 1).unwrap() {
            process.kill().await;
        }
    }
    let message = rounds_until(&prober, &client, &cluster, "degraded 1/2", |reason, m| {
        reason == "Degraded" && m.starts_with("replicas=1/2 ")
    })
    .await;
    assert!(
        message.contains(&format!("failing={}", addresses[1])),
        "{message}"
    );

    // Kill the cluster's agents: nothing reaches it.
    {
        let control_plane = env.control_plane.as_ref().unwrap();
        let klusterlets = control_plane.klusterlets.lock().await;
        let pids: Vec<u32> = klusterlets[&cluster]
            .agent_processes()
            .filter_map(|p| p.pid())
            .collect();
        assert!(!pids.is_empty());
        for pid in pids {
            let killed = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status()
                .unwrap();
            assert!(killed.success());
        }
    }
    rounds_until(&prober, &client, &cluster, "unreachable", |reason, m| {
        reason == "Unreachable" && m.starts_with("replicas=0/2 ")
    })
    .await;
    env.shutdown().await;
}
