//! A probe round is a trace: the round's span, a child per probe through a
//! replica, and under each probe the tunnel client's dial, the server's
//! connection and the agent's dial, received by an in-process OTLP
//! collector. One test: the exporting subscriber is process-wide.

mod common;

use std::time::Duration;

use cluster_proxy_runtime::logging::LogFormat;
use cluster_proxy_runtime::reload;
use cluster_proxy_runtime::telemetry::{self, SamplerChoice, TelemetryConfig};
use common::{Apiserver, Hub, Tunnel};
use health_prober::metrics::ProberMetrics;
use health_prober::probe::ProbeTarget;
use health_prober::prober::Prober;
use health_prober::replicas::Replica;
use simulated_cluster::otlp::{Collector, Received};

fn attr<'a>(span: &'a Received, key: &str) -> &'a str {
    span.attribute(key)
        .unwrap_or_else(|| panic!("{} has no attribute {key}: {span:#?}", span.name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_is_followed_through_the_server_and_the_agent() {
    let (collector, collector_addr, _stop) = Collector::start().await.unwrap();
    let config = TelemetryConfig {
        endpoint: Some(format!("http://{collector_addr}")),
        sampler: SamplerChoice::AlwaysOn,
        ..TelemetryConfig::off("health-prober")
    };
    let telemetry = telemetry::init(0, LogFormat::Text, &config).unwrap();
    assert!(telemetry.exporting());

    // cluster-a has an agent on both replicas; cluster-b on none.
    let hub = Hub::start(&["cluster-a", "cluster-b"]).await;
    let tunnel = Tunnel::start(&["cluster-a", "cluster-b"], 2).await;
    let apiserver = Apiserver::start(&["cluster-a", "cluster-b"]).await;
    let _first = tunnel.agent("cluster-a", 0).await;
    let _second = tunnel.agent("cluster-a", 1).await;
    let tls = reload::fixed(tunnel.pki.client_tls().unwrap());
    let replicas = (0..2)
        .map(|i| Replica::new(&tunnel.client_address(i), tls.clone()).unwrap())
        .collect();
    let prober = Prober::new(
        hub.client.clone(),
        replicas,
        ProbeTarget {
            port: apiserver.port,
            tls: health_prober::tls::target_client(None).unwrap(),
            timeout: Duration::from_secs(3),
        },
        8,
        ProberMetrics::default(),
    );
    let report = prober.round().await.unwrap();
    assert_eq!((report.clusters, report.reachable), (2, 1));

    let round = collector
        .wait_for("health_prober.round", |s| {
            s.attribute("cluster_proxy.clusters") == Some("2")
        })
        .await;
    assert_eq!(round.service, "health-prober");
    assert_eq!(round.parent_span_id, "", "a round starts its own trace");
    assert_eq!(attr(&round, "cluster_proxy.reachable"), "1");

    // Every probe of cluster-a, through each replica, down to the agent.
    for replica in [tunnel.client_address(0), tunnel.client_address(1)] {
        let probe = collector
            .wait_for("health_prober.probe", |s| {
                s.trace_id == round.trace_id
                    && s.attribute("cluster_proxy.cluster") == Some("cluster-a")
                    && s.attribute("cluster_proxy.replica") == Some(replica.as_str())
            })
            .await;
        assert_eq!(probe.parent_span_id, round.span_id);
        assert_eq!(attr(&probe, "cluster_proxy.result"), "success");
        assert_eq!(attr(&probe, "http.response.status_code"), "200");
        for phase in [
            "cluster_proxy.dial_latency_ms",
            "cluster_proxy.tls_latency_ms",
            "cluster_proxy.first_byte_latency_ms",
        ] {
            assert!(
                attr(&probe, phase).parse::<f64>().unwrap() >= 0.0,
                "{phase}"
            );
        }
        let dial = collector
            .wait_for("tunnel.dial", |s| s.parent_span_id == probe.span_id)
            .await;
        assert_eq!(dial.trace_id, round.trace_id);
        let connection = collector
            .wait_for("tunnel.connection", |s| s.parent_span_id == dial.span_id)
            .await;
        assert_eq!(connection.trace_id, round.trace_id);
        assert_eq!(attr(&connection, "cluster_proxy.cluster"), "cluster-a");
        let agent = collector
            .wait_for("agent.dial", |s| s.parent_span_id == connection.span_id)
            .await;
        assert_eq!(agent.trace_id, round.trace_id);
    }

    // A failed probe carries its error, and so does the server's span.
    let failed = collector
        .wait_for("health_prober.probe", |s| {
            s.trace_id == round.trace_id
                && s.attribute("cluster_proxy.cluster") == Some("cluster-b")
        })
        .await;
    assert_eq!(attr(&failed, "cluster_proxy.result"), "failure");
    assert_eq!(failed.status, "ERROR");
    assert!(
        attr(&failed, "error.message").contains("no agent connected"),
        "{failed:#?}"
    );
    let refused = collector
        .wait_for("tunnel.connection", |s| {
            s.trace_id == round.trace_id && s.attribute("server.address") == Some("cluster-b")
        })
        .await;
    assert_eq!(attr(&refused, "cluster_proxy.end_reason"), "no_agent");
    assert_eq!(refused.status, "ERROR");
    telemetry.shutdown().await;
}
