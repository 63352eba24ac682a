//! A probe's latency is the tunnel's and the target's, not a stall: through
//! an in-process proxy-server and agent to the in-memory kube-apiserver, its
//! first byte comes within a few milliseconds. It used to take 42–48 ms on
//! every probe (`e2e up`'s ClusterProxyReachable said so for every cluster):
//! the in-memory API left Nagle's algorithm on, so the second segment of a
//! response waited for the probe side's delayed ACK. A real kube-apiserver
//! (Go) turns Nagle off on every connection, and so does the stand-in now.

mod common;

use std::time::Duration;

use cluster_proxy_proto::connector::TunnelConnector;
use common::Tunnel;
use health_prober::probe::{ProbeTarget, probe};
use tunnel_harness::in_process::tunnel_client;

#[tokio::test]
async fn a_probes_first_byte_is_not_held_back_by_delayed_acks() {
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let _agent = tunnel.agent("cluster-a", 0).await;
    let dir = tempfile::tempdir().unwrap();
    let api = memory_apiserver::KubeApi::start(memory_apiserver::KubeApiOptions::new(dir.path()))
        .await
        .unwrap();
    let port = api.addr().port();
    let client = tunnel_client(
        tunnel.pki.client_tls().unwrap(),
        tunnel.servers[0].client_addr,
    )
    .await
    .unwrap();
    let connector = TunnelConnector::new(client, Duration::from_secs(5));
    let target = ProbeTarget {
        port,
        tls: health_prober::tls::target_client(None).unwrap(),
        timeout: Duration::from_secs(5),
    };
    let mut first_bytes = Vec::new();
    for _ in 0..10 {
        let outcome = probe(&connector, &target, "cluster-a").await;
        assert_eq!(outcome.status, Some(200), "{outcome:?}");
        first_bytes.push(outcome.first_byte.unwrap());
    }
    first_bytes.sort();
    let median = first_bytes[first_bytes.len() / 2];
    eprintln!("first byte of 10 probes: {first_bytes:?}");
    // A delayed ACK costs 40 ms; loopback with every hop in one process
    // answers in well under 10.
    assert!(
        median < Duration::from_millis(20),
        "the median probe waited {median:?} for its first byte: {first_bytes:?}"
    );
}
