//! HTTP CONNECT responses, byte for byte as upstream's proxy-server writes
//! them: clients parse them (kube-apiserver's egress dialer reads the status
//! line with Go's `http.ReadResponse` and refuses any byte buffered after a
//! `200`), so the success is the status line alone and error bodies are
//! upstream's texts. A hand-driven agent answers the dials.

use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::packet::{self, Frame};
use cluster_proxy_proto::transport::ALPN_HTTP11;
use proxy_server::RunningServer;
use proxy_server::http_connect::{DIAL_TIMEOUT_BODY, ESTABLISHED, TUNNEL_CLOSED_BODY};
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::client::TlsStream;
use tunnel_harness::in_process::{RawAgent, test_server_config};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(5);

async fn server(pki: &TestPki, dial_timeout: Duration) -> RunningServer {
    let mut config = test_server_config();
    config.backend_dial_timeout = dial_timeout;
    proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap()
}

async fn agent(pki: &TestPki, server: &RunningServer) -> RawAgent {
    let agent = RawAgent::connect(
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "agent-a",
        "host=cluster-a",
        None,
    )
    .await
    .unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() > 0).await);
    agent
}

/// Sends `CONNECT address` on a fresh mTLS connection to the client port.
async fn connect(
    pki: &TestPki,
    server: &RunningServer,
    address: &str,
) -> TlsStream<tokio::net::TcpStream> {
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let tcp = tokio::net::TcpStream::connect(server.client_addr)
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .unwrap();
    stream
        .write_all(format!("CONNECT {address} HTTP/1.1\r\nHost: {address}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    stream
}

/// Everything the server writes until it closes the connection.
async fn response(mut stream: TlsStream<tokio::net::TcpStream>) -> String {
    let mut bytes = Vec::new();
    let _ = tokio::time::timeout(STEP, stream.read_to_end(&mut bytes))
        .await
        .expect("the server closes the connection after an error response");
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn dial_request(agent: &mut RawAgent) -> i64 {
    match agent.recv(STEP).await.map(Frame::from_packet) {
        Some(Frame::DialRequest { random, .. }) => random,
        other => panic!("expected DIAL_REQ, got {other:?}"),
    }
}

/// Splits a response into its status line, header lines and body.
fn parts(response: &str) -> (&str, Vec<&str>, &str) {
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in {response:?}"));
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    (status, lines.collect(), body)
}

#[tokio::test]
async fn success_is_the_status_line_alone_then_raw_bytes() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki, STEP).await;
    let mut agent = agent(&pki, &server).await;
    let mut stream = connect(&pki, &server, "cluster-a:8443").await;
    let random = dial_request(&mut agent).await;
    agent
        .to_server
        .send(packet::dial_response_ok(random, 7))
        .await
        .unwrap();
    let mut head = vec![0u8; ESTABLISHED.len()];
    tokio::time::timeout(STEP, stream.read_exact(&mut head))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&head),
        "HTTP/1.1 200 Connection Established\r\n\r\n"
    );
    // Nothing follows the status line but the tunneled bytes.
    agent
        .to_server
        .send(packet::data(7, Bytes::from_static(b"pong")))
        .await
        .unwrap();
    let mut pong = [0u8; 4];
    tokio::time::timeout(STEP, stream.read_exact(&mut pong))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&pong, b"pong");
    stream.write_all(b"ping").await.unwrap();
    assert_eq!(
        agent.recv(STEP).await.map(Frame::from_packet),
        Some(Frame::Data {
            connect_id: 7,
            data: Bytes::from_static(b"ping")
        })
    );
    server.shutdown().await;
}

#[tokio::test]
async fn an_agents_dial_error_is_upstreams_response() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki, STEP).await;
    let mut agent = agent(&pki, &server).await;
    for (error, status) in [
        (
            "dial tcp 10.0.0.1:443: connect: connection refused",
            "HTTP/1.1 502 Bad Gateway",
        ),
        (
            "dial tcp 10.0.0.1:443: i/o timeout",
            "HTTP/1.1 504 Gateway Timeout",
        ),
    ] {
        let stream = connect(&pki, &server, "cluster-a:443").await;
        let random = dial_request(&mut agent).await;
        agent
            .to_server
            .send(packet::dial_response_error(random, error))
            .await
            .unwrap();
        let response = response(stream).await;
        let (status_line, headers, body) = parts(&response);
        assert_eq!(status_line, status, "{response:?}");
        assert!(
            headers.contains(&"Content-Type: text/plain; charset=utf-8"),
            "{response:?}"
        );
        assert!(
            !headers.iter().any(|h| h.starts_with("Date:")),
            "{response:?}"
        );
        assert_eq!(body, error);
    }
    server.shutdown().await;
}

#[tokio::test]
async fn no_agent_and_timeout_are_upstreams_responses() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki, Duration::from_millis(300)).await;

    let no_agent = response(connect(&pki, &server, "cluster-z:443").await).await;
    let (status, headers, body) = parts(&no_agent);
    assert_eq!(status, "HTTP/1.1 500 Internal Server Error");
    assert!(
        headers.contains(&"Content-Type: text/plain"),
        "{no_agent:?}"
    );
    assert_eq!(body, "currently no tunnels available: No agent available");

    let mut agent = agent(&pki, &server).await;
    let stream = connect(&pki, &server, "cluster-a:443").await;
    dial_request(&mut agent).await;
    let timed_out = response(stream).await;
    let (status, _, body) = parts(&timed_out);
    assert_eq!(status, "HTTP/1.1 504 Gateway Timeout");
    assert_eq!(body, DIAL_TIMEOUT_BODY);
    assert_eq!(
        body,
        "Backend dial timeout: timed out waiting for backend dial\r\n"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn a_tunnel_lost_before_the_dial_is_answered_is_upstreams_response() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki, Duration::from_secs(60)).await;
    let mut agent = agent(&pki, &server).await;
    let stream = connect(&pki, &server, "cluster-a:443").await;
    dial_request(&mut agent).await;
    drop(agent);
    let lost = response(stream).await;
    let (status, _, body) = parts(&lost);
    assert_eq!(status, "HTTP/1.1 502 Bad Gateway");
    assert_eq!(body, TUNNEL_CLOSED_BODY);
    assert_eq!(body, "Backend context error: context canceled\r\n");
    server.shutdown().await;
}
