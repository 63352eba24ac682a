//! The Rust `TunnelClient` over its own HTTP/2 connection (`H2Channel`):
//! what a tonic `Channel` did for it, it must do too: connect again once
//! the server closed the connection, and end a stream whose tunneled
//! connection was dropped.

use std::time::Duration;

use e2e::harness::{AgentUnderTest, test_server_config, tunnel_client, wait_until};
use e2e::pki::TestPki;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const STEP: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_client_connects_again_once_the_server_closed_its_connection() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let first = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let addr = first.client_addr;
    let client = tunnel_client(pki.client_tls().unwrap(), addr)
        .await
        .unwrap();
    let err = client.dial("cluster-a:80").await.unwrap_err().to_string();
    assert!(err.contains("No agent available"), "{err}");

    // The server goes away (GOAWAY, then the connection closes) and another
    // takes its port.
    first.shutdown().await;
    let mut config = test_server_config();
    config.server_port = addr.port();
    let second = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let err = tokio::time::timeout(STEP, client.dial("cluster-a:80"))
        .await
        .expect("the dial ends")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("No agent available"),
        "the new server answers the dial, not a dead connection: {err}"
    );
    second.shutdown().await;
}

#[tokio::test]
async fn dropping_a_stream_closes_its_tunneled_connection() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let _agent = AgentUnderTest::start(
        &pki,
        "cluster-a",
        server.agent_addr,
        &[("cluster-a", "127.0.0.1")],
    )
    .await
    .unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut stream = client
        .dial(&format!(
            "cluster-a:{}",
            target.local_addr().unwrap().port()
        ))
        .await
        .unwrap();
    let (mut accepted, _) = tokio::time::timeout(STEP, target.accept())
        .await
        .unwrap()
        .unwrap();
    stream.write_all(b"ping").await.unwrap();
    let mut ping = [0u8; 4];
    tokio::time::timeout(STEP, accepted.read_exact(&mut ping))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&ping, b"ping");

    // No shutdown: the stream is simply dropped, as a task that panicked or
    // was cancelled drops it.
    drop(stream);
    let mut rest = Vec::new();
    let read = tokio::time::timeout(STEP, accepted.read_to_end(&mut rest))
        .await
        .expect("the target's connection is closed")
        .unwrap();
    assert_eq!(read, 0, "{rest:?}");
    server.shutdown().await;
}
