//! Traces from isolated clusters (issue 53 item 4, its "done when"): in the
//! `e2e up` environment (the real control plane, a network namespace per
//! managed cluster, the environment's own OTLP receiver), a managed
//! cluster has no route to the receiver, so its proxy-agent runs without an
//! OTLP endpoint (the environment gives the endpoint only to processes that
//! reach it). A trace of one CONNECT through a proxy-server then holds the
//! agent's dial span all the same: the agent sent it home through its
//! tunnel, and the server forwarded it stamped with the cluster its
//! certificate names (`cluster_proxy.relayed_from`), which only the
//! server's relay does.
//!
//! Needs root and `ip netns`; skips loudly without, and under `CI=true`
//! that is a failure.

use std::time::Duration;

use cluster_proxy_runtime::telemetry::relay::RELAYED_FROM;
use e2e::env::client::Frontend;
use e2e::env::control_plane::replica_client_addr;
use e2e::env::traces::TraceExport;
use e2e::env::{EnvOptions, Environment, IsolationChoice};
use simulated_cluster::forward_proxy::can_run;
use simulated_cluster::otlp::Received;
use simulated_cluster::wait::until_ok;

const CLUSTER: &str = "cluster-a";
const WAIT: Duration = Duration::from_secs(90);

fn logs(env: &Environment) -> String {
    let mut names = vec!["addon-manager".to_owned()];
    if let Ok(entries) = std::fs::read_dir(env.logs.dir().join(CLUSTER)) {
        for entry in entries.flatten() {
            let pod = entry.file_name().to_string_lossy().into_owned();
            names.push(format!("{CLUSTER}/{pod}/proxy-agent"));
        }
    }
    if let Ok(entries) = std::fs::read_dir(env.logs.dir().join("hub")) {
        for entry in entries.flatten() {
            let pod = entry.file_name().to_string_lossy().into_owned();
            names.push(format!("hub/{pod}/proxy-server"));
        }
    }
    names
        .into_iter()
        .map(|name| format!("----- {name} -----\n{}\n", env.logs.tail(&name, 30)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_isolated_agents_span_comes_home_through_its_tunnel() {
    if !can_run("trace_relay", &[]) {
        return;
    }
    let mut options = EnvOptions::new(1);
    options.control_plane = true;
    options.isolation = IsolationChoice::Netns;
    options.traces = TraceExport::Receiver;
    options.spare_machines = 0;
    let env = Environment::start(options)
        .await
        .unwrap_or_else(|e| panic!("starting the environment: {e}"));
    if let Err(err) = env
        .wait_clusters_ready(&[CLUSTER.to_owned()], 2, WAIT)
        .await
    {
        panic!("{err}\n{}", logs(&env));
    }
    let receiver = env.traces.as_ref().expect("the environment's receiver");
    // The cluster's processes were not given the receiver's endpoint: the
    // receiver is on the machine's side of the hub link, where no managed
    // cluster has a route.
    let agent_netns = env
        .machine_of(CLUSTER)
        .await
        .and_then(|machine| machine.netns)
        .expect("the cluster's network namespace");
    assert!(!env.logs.reaches_trace_endpoint(Some(&agent_netns)));

    // One CONNECT through the first replica.
    let client = env
        .hub_client()
        .unwrap()
        .with_timeout(Duration::from_secs(5));
    let replica = replica_client_addr(env.summary.hub_addr, 0);
    let target = format!("{CLUSTER}:{}", simulated_cluster::sample::HTTP_PORT);
    let body = until_ok("a CONNECT to the cluster's service", WAIT, || async {
        client
            .http_get(Frontend::HttpConnect, replica, &target, "/")
            .await
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&env)));
    assert_eq!(body, simulated_cluster::sample::greeting(CLUSTER));

    // The server's span of that connection, then the agent's in its trace.
    let connection = until_ok("the server's connection span", WAIT, || async {
        receiver
            .collector
            .find("tunnel.connection", |s| {
                s.attribute("cluster_proxy.frontend") == Some("http-connect")
                    && s.attribute("server.address") == Some(CLUSTER)
            })
            .ok_or_else(|| "not received yet".to_owned())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&env)));
    let trace_id = connection.trace_id.clone();
    let agent_span: Received = until_ok("the agent's dial span in that trace", WAIT, || {
        let trace_id = trace_id.clone();
        async move {
            receiver
                .collector
                .find("agent.dial", |s| s.trace_id == trace_id)
                .ok_or_else(|| {
                    let services: Vec<String> = receiver
                        .collector
                        .spans()
                        .into_iter()
                        .map(|s| s.service)
                        .collect();
                    format!("not received yet; services seen: {services:?}")
                })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&env)));
    assert!(
        agent_span.service.contains("proxy-agent"),
        "the agent's own span: {agent_span:#?}"
    );
    assert_eq!(
        agent_span.resource.get(RELAYED_FROM).map(String::as_str),
        Some(CLUSTER),
        "stamped by the server that relayed it: {agent_span:#?}"
    );
    // The server's own spans are its own: not relayed.
    assert_eq!(connection.resource.get(RELAYED_FROM), None);
    assert!(
        agent_span.parent_span_id.len() == 16 && agent_span.parent_span_id != "0".repeat(16),
        "a child of the connection's trace: {agent_span:#?}"
    );
    env.shutdown().await;
}
