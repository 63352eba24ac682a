//! `--client-policy`: a hub client reaches only the clusters its
//! certificate subject is given, over gRPC and HTTP CONNECT alike.

use std::time::Duration;

use cluster_proxy_proto::packet::Frame;
use cluster_proxy_proto::transport::ALPN_HTTP11;
use proxy_server::RunningServer;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tunnel_harness::in_process::{
    ConnectError, RawAgent, http_connect, test_server_config, tunnel_client,
};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(10);

async fn agent(pki: &TestPki, server: &RunningServer, cluster: &str) -> RawAgent {
    RawAgent::connect(
        pki.agent_tls(cluster).unwrap(),
        server.agent_addr,
        &format!("agent-{cluster}"),
        &format!("host={cluster}"),
        None,
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_client_reaches_only_the_clusters_the_policy_gives_it() {
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let cert = CertificateDer::from_pem_slice(pki.proxy_client.cert_pem.as_bytes()).unwrap();
    let subject = cluster_proxy_runtime::peer::subject_of(&cert);
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        format!("[[client]]\nsubject = {subject:?}\nclusters = [\"cluster-a\"]\n"),
    )
    .unwrap();
    let mut config = test_server_config();
    config.client_policy = Some(policy);
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let mut agent_a = agent(&pki, &server, "cluster-a").await;
    let mut agent_b = agent(&pki, &server, "cluster-b").await;
    assert!(simulated_cluster::wait::wait_until(STEP, || server.tunnel_count() == 2).await);

    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let err = client.dial("cluster-b:443").await.unwrap_err().to_string();
    assert!(
        err.contains("--client-policy") && err.contains("cluster-b"),
        "{err}"
    );
    let connect = http_connect(
        pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap(),
        server.client_addr,
        "cluster-b:443",
    )
    .await;
    match connect {
        Err(ConnectError::Status(head)) => {
            assert!(head.starts_with("HTTP/1.1 403"), "{head}")
        }
        Err(e) => panic!("CONNECT failed otherwise: {e}"),
        Ok(_) => panic!("CONNECT to a cluster outside the policy succeeded"),
    }
    // The allowed cluster's agent is asked to dial.
    let dial = tokio::spawn(async move { client.dial("cluster-a:443").await });
    let request = agent_a.recv(STEP).await.map(Frame::from_packet);
    assert!(
        matches!(&request, Some(Frame::DialRequest { address, .. }) if address == "cluster-a:443"),
        "{request:?}"
    );
    dial.abort();
    // Cluster B's agent never heard of the refused dials.
    assert!(agent_b.recv(Duration::from_millis(300)).await.is_none());
    server.shutdown().await;
}

#[tokio::test]
async fn an_unreadable_policy_stops_the_server_naming_the_file() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, "[[client]]\nsubject = \"CN=x\"\n").unwrap();
    let mut config = test_server_config();
    config.client_policy = Some(policy.clone());
    let err = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains(&policy.display().to_string()) && err.contains("clusters"),
        "{err}"
    );
}
