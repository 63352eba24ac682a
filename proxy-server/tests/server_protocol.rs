//! The server's protocol handling, driven by hand-written agents and clients:
//! identity binding, headers, stray and malformed packets, dial failures.

use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::connector::ConnectError;
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::packet::{self, Frame};
use cluster_proxy_proto::transport::ALPN_HTTP11;
use proxy_server::RunningServer;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tunnel_harness::in_process::{RawAgent, RawAgentError, test_server_config, tunnel_client};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(5);

async fn server(pki: &TestPki) -> RunningServer {
    server_with(pki, test_server_config()).await
}

async fn server_with(
    pki: &TestPki,
    config: proxy_server::settings::ProxyServerSettings,
) -> RunningServer {
    proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap()
}

async fn agent(
    pki: &TestPki,
    server: &RunningServer,
    cluster: &str,
    window: Option<u32>,
) -> RawAgent {
    let agent = RawAgent::connect(
        pki.agent_tls(cluster).unwrap(),
        server.agent_addr,
        &format!("agent-{cluster}"),
        &format!("host={cluster}"),
        window,
    )
    .await
    .unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() > 0).await);
    agent
}

fn frame(p: Option<Packet>) -> Frame {
    Frame::from_packet(p.expect("expected a packet from the server"))
}

#[tokio::test]
async fn connect_returns_server_headers_and_negotiates_flow_control() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.server_id = "server-1".into();
    config.server_count = 3;
    let server = server_with(&pki, config).await;
    let with_fc = agent(&pki, &server, "cluster-a", Some(1 << 20)).await;
    assert_eq!(
        with_fc.headers.get(metadata::SERVER_ID).unwrap(),
        "server-1"
    );
    assert_eq!(with_fc.headers.get(metadata::SERVER_COUNT).unwrap(), "3");
    assert!(with_fc.headers.get(metadata::FLOW_CONTROL_WINDOW).is_some());
    let plain = agent(&pki, &server, "cluster-a", None).await;
    assert!(plain.headers.get(metadata::FLOW_CONTROL_WINDOW).is_none());
    server.shutdown().await;
}

#[tokio::test]
async fn agent_claiming_another_clusters_identity_is_refused() {
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let server = server(&pki).await;
    for claim in [
        "host=cluster-b",
        "host=cluster-a&host=cluster-b",
        "ipv4=10.0.0.1",
        "default-route=true",
    ] {
        let err = RawAgent::connect(
            pki.agent_tls("cluster-a").unwrap(),
            server.agent_addr,
            "a",
            claim,
            None,
        )
        .await
        .err()
        .unwrap_or_else(|| panic!("{claim} accepted"));
        match err {
            RawAgentError::Refused(status) => {
                assert_eq!(
                    status.code(),
                    tonic::Code::PermissionDenied,
                    "{claim}: {status:?}"
                );
                assert!(
                    status
                        .message()
                        .contains("does not belong to cluster \"cluster-a\""),
                    "{status:?}"
                );
            }
            other => panic!("{claim}: unexpected {other}"),
        }
    }
    assert_eq!(server.tunnel_count(), 0);
    // Its own identifiers, including the hashed service-proxy host, are fine.
    let own = cluster_proxy_proto::identity::ClusterName::new("cluster-a")
        .unwrap()
        .default_identifiers("open-cluster-management-agent-addon")
        .to_query();
    RawAgent::connect(
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "a",
        &own,
        None,
    )
    .await
    .unwrap();
    server.shutdown().await;
}

#[tokio::test]
async fn a_go_agent_refused_for_its_identity_is_told_why_where_it_looks() {
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let server = server(&pki).await;
    // grpc-go's `stream.Header()` is all a Go agent reads before giving up.
    let mut refused = RawAgent::connect_as(
        Some("grpc-go/1.72.0"),
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "a",
        "host=cluster-b",
        None,
    )
    .await
    .expect("a Go agent gets headers, then the status");
    let server_ids: Vec<&str> = refused
        .headers
        .get_all(metadata::SERVER_ID)
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(server_ids.len(), 2, "{server_ids:?}");
    assert_eq!(
        server_ids[0],
        proxy_server::agent_service::REFUSED_SERVER_ID
    );
    // What the Go agent logs: `expected one server ID in the context, got %v`.
    let logged = format!(
        "expected one server ID in the context, got [{}]",
        server_ids.join(" ")
    );
    assert!(
        logged.contains("refused: ") && logged.contains("does not belong to cluster \"cluster-a\""),
        "{logged}"
    );
    assert!(refused.headers.get(metadata::SERVER_COUNT).is_none());
    let status = refused.from_server.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert_eq!(status.message(), server_ids[1]);
    assert_eq!(server.tunnel_count(), 0);
    // Everyone else gets the plain status, as before.
    let err = RawAgent::connect(
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "a",
        "host=cluster-b",
        None,
    )
    .await
    .err()
    .expect("refused");
    assert!(matches!(err, RawAgentError::Refused(s) if s.code() == tonic::Code::PermissionDenied));
    // A Go agent with its own identifiers is admitted as usual.
    let admitted = RawAgent::connect_as(
        Some("grpc-go/1.72.0"),
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "a",
        "host=cluster-a",
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        admitted.headers.get_all(metadata::SERVER_ID).iter().count(),
        1
    );
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    server.shutdown().await;
}

#[tokio::test]
async fn agent_certificate_naming_no_cluster_needs_the_opt_out() {
    let pki = TestPki::new(&[]).unwrap();
    let server = server(&pki).await;
    let err = RawAgent::connect(
        pki.unbound_agent_tls().unwrap(),
        server.agent_addr,
        "a",
        "host=x",
        None,
    )
    .await
    .err()
    .unwrap();
    assert!(
        matches!(&err, RawAgentError::Refused(s) if s.code() == tonic::Code::PermissionDenied && s.message().contains("names no cluster")),
        "{err}"
    );
    server.shutdown().await;

    let mut config = test_server_config();
    config.allow_unbound_agents = true;
    let server = server_with(&pki, config).await;
    RawAgent::connect(
        pki.unbound_agent_tls().unwrap(),
        server.agent_addr,
        "a",
        "host=x",
        None,
    )
    .await
    .unwrap();
    server.shutdown().await;
}

#[tokio::test]
async fn agent_with_a_certificate_from_another_ca_is_refused() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let other = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    // Trusts our server, presents a certificate signed by a foreign CA.
    let foreign = cert_authority::tls::client_config(
        cert_authority::tls::roots(&cert_authority::tls::Pem::text("ca", pki.ca.cert_pem()))
            .unwrap(),
        Some(
            cert_authority::tls::Identity::new(
                &cert_authority::tls::Pem::text("c", &other.agents[0].1.cert_pem),
                &cert_authority::tls::Pem::text("k", &other.agents[0].1.key_pem),
            )
            .unwrap(),
        ),
        &[cluster_proxy_proto::transport::ALPN_H2],
    )
    .unwrap();
    assert!(
        RawAgent::connect(foreign, server.agent_addr, "a", "host=cluster-a", None)
            .await
            .is_err()
    );
    assert_eq!(server.tunnel_count(), 0);
    server.shutdown().await;
}

#[tokio::test]
async fn connect_without_agent_id_or_with_malformed_identifiers_is_refused() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let tls = pki.agent_tls("cluster-a").unwrap();
    let err = RawAgent::connect(tls.clone(), server.agent_addr, "", "host=cluster-a", None)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&err, RawAgentError::Refused(s) if s.code() == tonic::Code::InvalidArgument && s.message().contains("agent ID")),
        "{err}"
    );
    for bad in ["host=%zz", "host=a;b", "default-route=perhaps"] {
        let err = RawAgent::connect(tls.clone(), server.agent_addr, "a", bad, None)
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&err, RawAgentError::Refused(s) if s.code() == tonic::Code::InvalidArgument),
            "{bad}: {err}"
        );
    }
    let err = RawAgent::connect(tls, server.agent_addr, "a", "host=cluster-a", Some(10))
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&err, RawAgentError::Refused(s) if s.code() == tonic::Code::InvalidArgument),
        "{err}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn dial_data_and_close_round_trip_through_a_hand_driven_agent() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let mut agent = agent(&pki, &server, "cluster-a", None).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();

    let dial = tokio::spawn(async move { client.dial("cluster-a:8443").await });
    let Frame::DialRequest {
        protocol,
        address,
        random,
        trace,
        early_data,
    } = frame(agent.recv(STEP).await)
    else {
        panic!("expected DIAL_REQ");
    };
    assert_eq!(
        (protocol.as_str(), address.as_str()),
        ("tcp", "cluster-a:8443")
    );
    // This agent did not advertise the trace-context extension.
    assert_eq!(trace, None);
    assert!(early_data.is_empty());
    agent
        .to_server
        .send(packet::dial_response_ok(random, 7))
        .await
        .unwrap();
    let mut stream = dial.await.unwrap().unwrap();
    assert_eq!(stream.connect_id(), 7);

    stream.write_all(b"ping").await.unwrap();
    assert_eq!(
        frame(agent.recv(STEP).await),
        Frame::Data {
            connect_id: 7,
            data: Bytes::from_static(b"ping")
        }
    );
    agent
        .to_server
        .send(packet::data(7, Bytes::from_static(b"pong")))
        .await
        .unwrap();
    let mut buf = [0u8; 4];
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"pong");

    // Closing the client side sends CLOSE_REQ; the agent's CLOSE_RSP ends the stream.
    stream.shutdown().await.unwrap();
    assert_eq!(
        frame(agent.recv(STEP).await),
        Frame::CloseRequest { connect_id: 7 }
    );
    agent
        .to_server
        .send(packet::close_response(7, ""))
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(STEP, stream.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(wait_until(STEP, || server.connection_count() == 0).await);
    server.shutdown().await;
}

#[tokio::test]
async fn stray_and_malformed_packets_from_an_agent_are_answered_or_ignored() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let mut agent = agent(&pki, &server, "cluster-a", None).await;
    // DATA for an unknown connection: the server asks the agent to close it.
    agent
        .to_server
        .send(packet::data(99, Bytes::from_static(b"x")))
        .await
        .unwrap();
    assert_eq!(
        frame(agent.recv(STEP).await),
        Frame::CloseRequest { connect_id: 99 }
    );
    // A DIAL_RSP nobody waits for, with a live connection id: closed too.
    agent
        .to_server
        .send(packet::dial_response_ok(12345, 5))
        .await
        .unwrap();
    assert_eq!(
        frame(agent.recv(STEP).await),
        Frame::CloseRequest { connect_id: 5 }
    );
    // Dropped silently: DATA with id 0, unknown types, payload/type mismatches,
    // CLOSE_RSP and WINDOW_UPDATE for unknown ids.
    agent
        .to_server
        .send(packet::data(0, Bytes::from_static(b"x")))
        .await
        .unwrap();
    agent
        .to_server
        .send(Packet {
            r#type: 42,
            payload: None,
        })
        .await
        .unwrap();
    agent
        .to_server
        .send(Packet {
            r#type: 1,
            payload: None,
        })
        .await
        .unwrap();
    agent
        .to_server
        .send(packet::close_response(77, ""))
        .await
        .unwrap();
    agent
        .to_server
        .send(packet::window_update(77, -1))
        .await
        .unwrap();
    assert!(agent.recv(Duration::from_millis(300)).await.is_none());
    // The tunnel still works.
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let dial = tokio::spawn(async move { client.dial("cluster-a:1").await });
    let Frame::DialRequest { random, .. } = frame(agent.recv(STEP).await) else {
        panic!("expected DIAL_REQ");
    };
    agent
        .to_server
        .send(packet::dial_response_error(
            random,
            "dial tcp cluster-a:1: connect: connection refused",
        ))
        .await
        .unwrap();
    let err = dial.await.unwrap().unwrap_err().to_string();
    assert!(err.contains("connection refused"), "{err}");
    assert_eq!(server.tunnel_count(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn pending_dials_fail_at_once_when_the_agent_disconnects() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.backend_dial_timeout = Duration::from_secs(60);
    let server = server_with(&pki, config).await;
    let mut agent = agent(&pki, &server, "cluster-a", None).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let dial = tokio::spawn(async move { client.dial("cluster-a:443").await });
    assert!(matches!(
        frame(agent.recv(STEP).await),
        Frame::DialRequest { .. }
    ));
    let started = std::time::Instant::now();
    drop(agent);
    let err = tokio::time::timeout(STEP, dial)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(err.contains("closed"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(wait_until(STEP, || server.tunnel_count() == 0).await);
    server.shutdown().await;
}

#[tokio::test]
async fn unanswered_dials_time_out_and_the_agent_is_told_to_cancel() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.backend_dial_timeout = Duration::from_millis(300);
    let server = server_with(&pki, config).await;
    let mut agent = agent(&pki, &server, "cluster-a", None).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let err = client.dial("cluster-a:443").await.unwrap_err().to_string();
    assert!(err.contains("timed out waiting for backend dial"), "{err}");
    let Frame::DialRequest { random, .. } = frame(agent.recv(STEP).await) else {
        panic!("expected DIAL_REQ");
    };
    assert_eq!(frame(agent.recv(STEP).await), Frame::CloseDial { random });
    assert!(
        server
            .metrics_text()
            .contains("konnectivity_network_proxy_server_pending_backend_dials 0")
    );
    server.shutdown().await;
}

#[tokio::test]
async fn agent_vanishing_mid_connection_closes_the_client_side() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let mut agent = agent(&pki, &server, "cluster-a", Some(1 << 20)).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let dial = tokio::spawn(async move { client.dial("cluster-a:443").await });
    let Frame::DialRequest { random, .. } = frame(agent.recv(STEP).await) else {
        panic!("expected DIAL_REQ");
    };
    agent
        .to_server
        .send(packet::dial_response_ok(random, 1))
        .await
        .unwrap();
    let mut stream = dial.await.unwrap().unwrap();
    agent
        .to_server
        .send(packet::data(1, Bytes::from_static(b"partial")))
        .await
        .unwrap();
    let mut buf = [0u8; 7];
    stream.read_exact(&mut buf).await.unwrap();
    drop(agent);
    let mut rest = Vec::new();
    let n = tokio::time::timeout(STEP, stream.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0);
    server.shutdown().await;
}

#[tokio::test]
async fn dial_to_a_host_no_agent_serves_fails_clearly() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let _agent = agent(&pki, &server, "cluster-a", None).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let err = client.dial("cluster-z:443").await.unwrap_err().to_string();
    assert!(err.contains("No agent available"), "{err}");
    server.shutdown().await;
}

#[tokio::test]
async fn client_without_a_certificate_is_refused() {
    let pki = TestPki::new(&[]).unwrap();
    let server = server(&pki).await;
    let refused = match tunnel_client(pki.anonymous_tls().unwrap(), server.client_addr).await {
        Err(_) => true,
        Ok(client) => client.dial("cluster-a:443").await.is_err(),
    };
    assert!(refused);
    server.shutdown().await;
}

/// Agents and hub clients share the CA: an agent's certificate on the client
/// port must not reach any cluster, not even its own, over either frontend.
#[tokio::test]
async fn an_agent_certificate_cannot_dial_through_the_client_port() {
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let server = server(&pki).await;
    let port = 8443;
    let mut agent_a = agent(&pki, &server, "cluster-a", None).await;
    let mut agent_b = agent(&pki, &server, "cluster-b", None).await;

    let impostor = tunnel_client(pki.agent_tls("cluster-a").unwrap(), server.client_addr)
        .await
        .unwrap();
    for host in ["cluster-b", "cluster-a"] {
        let err = impostor
            .dial(&format!("{host}:{port}"))
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("names cluster cluster-a"),
            "gRPC dial to {host} with an agent certificate: {err:?}"
        );
    }
    let connect_tls = pki.agent_tls_alpn("cluster-a", &[ALPN_HTTP11]).unwrap();
    let refusal = match tunnel_harness::in_process::http_connect(
        connect_tls,
        server.client_addr,
        &format!("cluster-b:{port}"),
    )
    .await
    {
        Err(tunnel_harness::in_process::ConnectError::Status(response)) => response,
        other => panic!("CONNECT with an agent certificate: {:?}", other.map(|_| ())),
    };
    assert!(refusal.starts_with("HTTP/1.1 403"), "{refusal}");
    assert!(refusal.contains("names cluster cluster-a"), "{refusal}");

    // Neither agent was asked to dial; the hub client certificate still is.
    assert!(agent_a.recv(Duration::from_millis(200)).await.is_none());
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let _dial = tokio::spawn(async move { client.dial(&format!("cluster-b:{port}")).await });
    assert!(
        matches!(frame(agent_b.recv(STEP).await), Frame::DialRequest { .. }),
        "the hub client's dial did not reach cluster-b"
    );
    server.shutdown().await;
}

async fn raw_http(pki: &TestPki, server: &RunningServer, request: &[u8]) -> String {
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let tcp = tokio::net::TcpStream::connect(server.client_addr)
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .unwrap();
    stream.write_all(request).await.unwrap();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(STEP, stream.read_to_end(&mut response)).await;
    String::from_utf8_lossy(&response).into_owned()
}

#[tokio::test]
async fn garbage_and_non_connect_requests_on_the_client_port_get_http_errors() {
    let pki = TestPki::new(&[]).unwrap();
    let server = server(&pki).await;
    let response = raw_http(
        &pki,
        &server,
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 405"), "{response}");
    assert!(response.contains("only supports CONNECT"), "{response}");
    let response = raw_http(&pki, &server, b"\x00\x01\x02 garbage \xff\r\n\r\n").await;
    assert!(
        response.is_empty() || response.starts_with("HTTP/1.1 400"),
        "{response}"
    );
    let response = raw_http(
        &pki,
        &server,
        b"CONNECT cluster-z:443 HTTP/1.1\r\nHost: cluster-z:443\r\n\r\n",
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 500"), "{response}");
    assert!(
        response.contains("currently no tunnels available"),
        "{response}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn health_endpoints_report_readiness() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let get = |path: &'static str| {
        let addr = server.health_addr;
        async move {
            let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            tcp.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut out = String::new();
            tcp.read_to_string(&mut out).await.unwrap();
            out
        }
    };
    assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
    assert!(get("/readyz").await.starts_with("HTTP/1.1 500"));
    let _agent = agent(&pki, &server, "cluster-a", None).await;
    assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
    let metrics = get("/metrics").await;
    assert!(
        metrics.contains(
            "konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"destHost\"} 1"
        ),
        "{metrics}"
    );
    server.shutdown().await;
}

/// Sends raw, possibly malformed, protobuf bodies on a gRPC stream.
#[derive(Clone, Default)]
struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let out = src.chunk().to_vec();
        src.advance(out.len());
        Ok(Some(out))
    }
}

async fn raw_stream(
    tls: std::sync::Arc<rustls::ClientConfig>,
    addr: std::net::SocketAddr,
    path: &'static str,
    garbage: Vec<u8>,
) -> Result<tonic::Streaming<Vec<u8>>, tonic::Status> {
    let channel =
        cluster_proxy_proto::transport::connect_channel("localhost", addr.port(), tls, STEP)
            .await
            .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(tokio_stream::iter(vec![garbage]));
    request
        .metadata_mut()
        .insert(metadata::AGENT_ID, "raw".parse().unwrap());
    request.metadata_mut().insert(
        metadata::AGENT_IDENTIFIERS,
        "host=cluster-a".parse().unwrap(),
    );
    let response = grpc
        .streaming(
            request,
            http::uri::PathAndQuery::from_static(path),
            RawCodec,
        )
        .await?;
    Ok(response.into_inner())
}

#[tokio::test]
async fn malformed_protobuf_ends_only_the_offending_stream() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let garbage = vec![0x12, 0x7f, 0x01, 0xff, 0xff];
    // On the agent port: the tunnel is dropped, nothing else happens.
    let mut stream = raw_stream(
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "/AgentService/Connect",
        garbage.clone(),
    )
    .await
    .unwrap();
    let end = tokio::time::timeout(STEP, async {
        while let Ok(Some(_)) = stream.message().await {}
    })
    .await;
    assert!(end.is_ok(), "server kept a broken tunnel open");
    assert!(wait_until(STEP, || server.tunnel_count() == 0).await);
    // On the client port: the proxy stream ends.
    if let Ok(mut stream) = raw_stream(
        pki.client_tls().unwrap(),
        server.client_addr,
        "/ProxyService/Proxy",
        garbage,
    )
    .await
    {
        let end = tokio::time::timeout(STEP, async {
            while let Ok(Some(_)) = stream.message().await {}
        })
        .await;
        assert!(end.is_ok(), "server kept a broken proxy stream open");
    }
    // The server is unharmed.
    let _agent = agent(&pki, &server, "cluster-a", None).await;
    assert_eq!(server.tunnel_count(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn a_data_packet_larger_than_the_agents_window_is_forwarded_in_chunks() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    // The agent grants only 64 KiB per connection.
    let mut agent = agent(&pki, &server, "cluster-a", Some(64 * 1024)).await;
    let (to_server, mut from_server) =
        raw_proxy_stream(&pki, &server, packet::dial_request("cluster-a:1", 42)).await;
    let Frame::DialRequest { random, .. } = frame(agent.recv(STEP).await) else {
        panic!("expected DIAL_REQ");
    };
    agent
        .to_server
        .send(packet::dial_response_ok(random, 3))
        .await
        .unwrap();
    assert!(matches!(
        Frame::from_packet(from_server.message().await.unwrap().unwrap()),
        Frame::DialResponse { connect_id: 3, .. }
    ));
    // One 4 MiB DATA packet, as a Go client writing a large buffer sends.
    const SIZE: usize = 4 << 20;
    to_server
        .send(packet::data(3, Bytes::from(vec![7u8; SIZE])))
        .await
        .unwrap();
    let mut received = 0;
    while received < SIZE {
        match frame(agent.recv(STEP).await) {
            Frame::Data {
                connect_id: 3,
                data,
            } => {
                assert!(
                    data.len() <= 64 * 1024,
                    "chunk of {} bytes exceeds the window",
                    data.len()
                );
                received += data.len();
                agent
                    .to_server
                    .send(packet::window_update(3, data.len() as i64))
                    .await
                    .unwrap();
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(received, SIZE);
    server.shutdown().await;
}

#[tokio::test]
async fn dials_spread_over_an_identitys_agents_and_avoid_draining_ones() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let mut first = agent(&pki, &server, "cluster-a", None).await;
    let mut second = RawAgent::connect(
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "agent-2",
        "host=cluster-a",
        None,
    )
    .await
    .unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() == 2).await);
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();

    // Each dial goes to one of the two agents; count who received what.
    async fn count_dials(
        client: &cluster_proxy_proto::client::TunnelClient,
        agents: [&mut RawAgent; 2],
        n: usize,
    ) -> [usize; 2] {
        let mut counts = [0; 2];
        let [a, b] = agents;
        for _ in 0..n {
            let c = client.clone();
            let dial = tokio::spawn(async move { c.dial("cluster-a:1").await });
            // Aborted earlier dials send DIAL_CLS; wait for this dial's DIAL_REQ.
            loop {
                let (who, p) = tokio::select! {
                    p = a.recv(STEP) => (0, p),
                    p = b.recv(STEP) => (1, p),
                };
                match frame(p) {
                    Frame::DialRequest { .. } => {
                        counts[who] += 1;
                        break;
                    }
                    Frame::CloseDial { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            dial.abort();
        }
        counts
    }
    let counts = count_dials(&client, [&mut first, &mut second], 10).await;
    assert!(
        counts[0] > 0 && counts[1] > 0,
        "dials not spread: {counts:?}"
    );
    // After DRAIN, new dials avoid the draining agent.
    first.to_server.send(packet::drain()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let counts = count_dials(&client, [&mut first, &mut second], 6).await;
    assert_eq!(counts, [0, 6], "a draining agent got new dials");
    server.shutdown().await;
}

#[tokio::test]
async fn a_plain_agents_stalled_connection_is_closed_so_the_tunnel_keeps_moving() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.plain_peer_buffer = 64 * 1024;
    config.plain_peer_stall_timeout = Duration::from_millis(300);
    let server = server_with(&pki, config).await;
    // A plain konnectivity agent: no flow control, so the server must buffer.
    let mut agent = agent(&pki, &server, "cluster-a", None).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let dial = {
        let client = client.clone();
        tokio::spawn(async move { client.dial("cluster-a:1").await })
    };
    let Frame::DialRequest { random, .. } = frame(agent.recv(STEP).await) else {
        panic!("expected DIAL_REQ");
    };
    agent
        .to_server
        .send(packet::dial_response_ok(random, 1))
        .await
        .unwrap();
    // The client never reads connection 1; the agent keeps sending (more than
    // every HTTP/2 window on the way can hold).
    let _stalled = dial.await.unwrap().unwrap();
    let sender = agent.to_server.clone();
    let flood = tokio::spawn(async move {
        let chunk = Bytes::from(vec![1u8; 64 * 1024]);
        for _ in 0..1024 {
            if sender.send(packet::data(1, chunk.clone())).await.is_err() {
                return;
            }
        }
    });
    // The server gives up on connection 1 instead of stalling the tunnel ...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "stalled connection was never closed"
        );
        if let Frame::CloseRequest { connect_id: 1 } = frame(agent.recv(STEP).await) {
            break;
        }
    }
    flood.abort();
    // ... and new dials still reach the agent.
    let next = tokio::spawn(async move { client.dial("cluster-a:2").await });
    loop {
        match frame(agent.recv(STEP).await) {
            Frame::DialRequest { address, .. } if address == "cluster-a:2" => break,
            _ => {}
        }
    }
    next.abort();
    server.shutdown().await;
}

/// A `Proxy` stream written by hand: `first` is sent, then whatever goes
/// into the returned sender; large packets may be sent (8 MiB).
async fn raw_proxy_stream(
    pki: &TestPki,
    server: &RunningServer,
    first: Packet,
) -> (tokio::sync::mpsc::Sender<Packet>, tonic::Streaming<Packet>) {
    use cluster_proxy_proto::konnectivity::proxy_service_client::ProxyServiceClient;
    let channel = cluster_proxy_proto::transport::connect_channel(
        "localhost",
        server.client_addr.port(),
        pki.client_tls().unwrap(),
        STEP,
    )
    .await
    .unwrap();
    let (to_server, rx) = tokio::sync::mpsc::channel(4);
    to_server.send(first).await.unwrap();
    let from_server = ProxyServiceClient::new(channel)
        .max_encoding_message_size(8 << 20)
        .proxy(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (to_server, from_server)
}

/// The id and early data of the next dial request the agent gets.
async fn next_dial(agent: &mut RawAgent) -> (i64, Bytes) {
    match Frame::from_packet(next_dial_request(agent).await) {
        Frame::DialRequest {
            random, early_data, ..
        } => (random, early_data),
        _ => unreachable!("next_dial_request returns dial requests"),
    }
}

/// An agent, driven by hand, that advertised the early-data extension.
async fn early_data_agent(pki: &TestPki, server: &RunningServer, cluster: &str) -> RawAgent {
    let before = server.tunnel_count();
    let agent = RawAgent::connect_with(
        &[(metadata::EARLY_DATA, metadata::EARLY_DATA_V1)],
        pki.agent_tls(cluster).unwrap(),
        server.agent_addr,
        &format!("agent-{cluster}"),
        &format!("host={cluster}"),
    )
    .await
    .unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() > before).await);
    agent
}

/// The next DIAL_REQ's raw packet, skipping anything else the server sends.
async fn next_dial_request(agent: &mut RawAgent) -> Packet {
    loop {
        let p = agent.recv(STEP).await.expect("a DIAL_REQ from the server");
        if matches!(Frame::from_packet(p.clone()), Frame::DialRequest { .. }) {
            return p;
        }
    }
}

#[tokio::test]
async fn early_data_rides_in_the_dial_request_only_to_an_agent_that_advertised_it() {
    use prost::Message;
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let server = server(&pki).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();

    // An agent with the extension gets the bytes in DIAL_REQ (field 101)
    // and confirms writing them; nothing is sent twice.
    let mut with_extension = early_data_agent(&pki, &server, "cluster-a").await;
    let dialing = client.clone();
    let dial = tokio::spawn(async move {
        dialing
            .dial_with_early_data(
                "cluster-a:8443",
                Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n"),
            )
            .await
    });
    let (random, early_data) = next_dial(&mut with_extension).await;
    assert_eq!(&early_data[..], b"GET / HTTP/1.1\r\n\r\n");
    with_extension
        .to_server
        .send(packet::dial_response_connected(random, 7, true))
        .await
        .unwrap();
    let mut stream = dial.await.unwrap().unwrap();
    stream.write_all(b"next").await.unwrap();
    assert_eq!(
        frame(with_extension.recv(STEP).await),
        Frame::Data {
            connect_id: 7,
            data: Bytes::from_static(b"next")
        },
        "the early data must not follow as DATA too"
    );

    // An upstream-style agent (no extension) gets konnectivity's dial
    // request byte for byte, then the bytes as the connection's first DATA
    // from the server; the client, told they were delivered, does not
    // send them again.
    let mut upstream = agent(&pki, &server, "cluster-b", None).await;
    assert!(wait_until(STEP, || server.tunnel_count() == 2).await);
    let dialing = client.clone();
    let dial = tokio::spawn(async move {
        dialing
            .dial_with_early_data("cluster-b:8443", Bytes::from_static(b"hello"))
            .await
    });
    let request = next_dial_request(&mut upstream).await;
    let Frame::DialRequest { random, .. } = Frame::from_packet(request.clone()) else {
        unreachable!()
    };
    assert_eq!(
        request.encode_to_vec(),
        packet::dial_request("cluster-b:8443", random).encode_to_vec(),
        "an upstream agent gets plain konnectivity bytes"
    );
    upstream
        .to_server
        .send(packet::dial_response_ok(random, 9))
        .await
        .unwrap();
    let mut stream = dial.await.unwrap().unwrap();
    assert_eq!(
        frame(upstream.recv(STEP).await),
        Frame::Data {
            connect_id: 9,
            data: Bytes::from_static(b"hello")
        }
    );
    stream.write_all(b"world").await.unwrap();
    assert_eq!(
        frame(upstream.recv(STEP).await),
        Frame::Data {
            connect_id: 9,
            data: Bytes::from_static(b"world")
        }
    );

    let metrics = server.metrics_text();
    for by in ["agent", "server"] {
        let sample =
            format!("cluster_proxy_server_early_data_dials_total{{delivered_by=\"{by}\"}} 1");
        assert!(metrics.contains(&sample), "{sample} in\n{metrics}");
    }

    // A failed dial drops the bytes and reports the agent's error.
    let dialing = client.clone();
    let dial = tokio::spawn(async move {
        dialing
            .dial_with_early_data("cluster-a:1", Bytes::from_static(b"lost"))
            .await
    });
    let (random, _) = next_dial(&mut with_extension).await;
    with_extension
        .to_server
        .send(packet::dial_response_error(
            random,
            "dial tcp 127.0.0.1:1: connect: connection refused",
        ))
        .await
        .unwrap();
    let err = dial.await.unwrap().unwrap_err();
    assert!(err.to_string().contains("connection refused"), "{err}");
    server.shutdown().await;
}

#[tokio::test]
async fn early_data_beyond_the_limit_follows_as_flow_controlled_data() {
    use cluster_proxy_proto::client::MAX_EARLY_DATA;
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let mut with_extension = early_data_agent(&pki, &server, "cluster-a").await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    // More than one dial request may carry: the first MAX_EARLY_DATA bytes
    // ride with the dial, the rest follow as DATA, in order.
    let first: Vec<u8> = (0..MAX_EARLY_DATA + 5000)
        .map(|i| (i % 251) as u8)
        .collect();
    let sent = Bytes::from(first.clone());
    let dial =
        tokio::spawn(async move { client.dial_with_early_data("cluster-a:8443", sent).await });
    let (random, early_data) = next_dial(&mut with_extension).await;
    assert_eq!(early_data.len(), MAX_EARLY_DATA);
    with_extension
        .to_server
        .send(packet::dial_response_connected(random, 3, true))
        .await
        .unwrap();
    let _stream = dial.await.unwrap().unwrap();
    let mut received = early_data.to_vec();
    while received.len() < first.len() {
        match frame(with_extension.recv(STEP).await) {
            Frame::Data {
                connect_id: 3,
                data,
            } => received.extend_from_slice(&data),
            other => panic!("expected DATA, got {other:?}"),
        }
    }
    assert_eq!(received, first);

    // A hand-written client may put more in its dial request than our
    // client does; the server does not pass that past the agent's window
    // inside a dial request, but as DATA after it.
    let big = Bytes::from(vec![7u8; MAX_EARLY_DATA + 1]);
    let (_to_server, mut from_server) = raw_proxy_stream(
        &pki,
        &server,
        packet::dial_request_with_early_data("cluster-a:8443", 77, None, big.clone()),
    )
    .await;
    let (random, early_data) = next_dial(&mut with_extension).await;
    assert!(
        early_data.is_empty(),
        "{} bytes in the dial request",
        early_data.len()
    );
    with_extension
        .to_server
        .send(packet::dial_response_ok(random, 4))
        .await
        .unwrap();
    assert!(matches!(
        Frame::from_packet(from_server.message().await.unwrap().unwrap()),
        Frame::DialResponse {
            connect_id: 4,
            early_data_written: true,
            ..
        }
    ));
    let mut received = Vec::new();
    while received.len() < big.len() {
        match frame(with_extension.recv(STEP).await) {
            Frame::Data {
                connect_id: 4,
                data,
            } => received.extend_from_slice(&data),
            other => panic!("expected DATA, got {other:?}"),
        }
    }
    assert_eq!(received, big);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_streams_first_write_rides_in_the_dial_request() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki).await;
    let mut agent = early_data_agent(&pki, &server, "cluster-a").await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();

    // The first write returns at once and rides with the dial; a second
    // write and a read, in two tasks, both wait for the dial and both go on
    // once it is answered.
    let (mut reader, mut writer) = tokio::io::split(client.dial_lazily("cluster-a:8443"));
    writer.write_all(b"hello").await.unwrap();
    let writing = tokio::spawn(async move {
        writer.write_all(b"more").await.unwrap();
        writer
    });
    let reading = tokio::spawn(async move {
        let mut buf = [0u8; 4];
        reader.read_exact(&mut buf).await.unwrap();
        buf
    });
    let (random, early_data) = next_dial(&mut agent).await;
    assert_eq!(&early_data[..], b"hello");
    agent
        .to_server
        .send(packet::dial_response_connected(random, 5, true))
        .await
        .unwrap();
    agent
        .to_server
        .send(packet::data(5, Bytes::from_static(b"pong")))
        .await
        .unwrap();
    assert_eq!(
        frame(agent.recv(STEP).await),
        Frame::Data {
            connect_id: 5,
            data: Bytes::from_static(b"more")
        }
    );
    let _writer = tokio::time::timeout(STEP, writing)
        .await
        .expect("the waiting writer was woken")
        .unwrap();
    let read = tokio::time::timeout(STEP, reading)
        .await
        .expect("the waiting reader was woken")
        .unwrap();
    assert_eq!(&read, b"pong");

    // A protocol whose server speaks first: a read dials without data.
    let mut stream = client.dial_lazily("cluster-a:22");
    let reading = tokio::spawn(async move {
        let mut banner = [0u8; 7];
        stream.read_exact(&mut banner).await.unwrap();
        banner
    });
    let (random, early_data) = next_dial(&mut agent).await;
    assert!(early_data.is_empty());
    agent
        .to_server
        .send(packet::dial_response_ok(random, 6))
        .await
        .unwrap();
    agent
        .to_server
        .send(packet::data(6, Bytes::from_static(b"SSH-2.0")))
        .await
        .unwrap();
    assert_eq!(&reading.await.unwrap(), b"SSH-2.0");

    // A failed dial is the error of the next read, with the agent's text.
    let mut stream = client.dial_lazily("cluster-a:1");
    stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let (random, _) = next_dial(&mut agent).await;
    agent
        .to_server
        .send(packet::dial_response_error(
            random,
            "dial tcp 127.0.0.1:1: connect: connection refused",
        ))
        .await
        .unwrap();
    let mut buf = [0u8; 1];
    let err = stream.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(err.to_string().contains("connection refused"), "{err}");
    assert!(
        matches!(
            ConnectError::find_in(&err),
            Some(ConnectError::Refused { address, reason })
                if address == "cluster-a:1" && reason.contains("connection refused")
        ),
        "the I/O error carries the ConnectError a plain dial returns: {err:?}"
    );
    let err = stream.write_all(b"x").await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);

    // A writer and a reader waiting on the dial are both woken, even when
    // the one that polled last never polls again.
    let mut stream = client.dial_lazily("cluster-a:8443");
    stream.write_all(b"x").await.unwrap();
    let (writer_woken, writer_waker) = WakeFlag::waker();
    let (_, reader_waker) = WakeFlag::waker();
    assert!(
        std::pin::Pin::new(&mut stream)
            .poll_write(&mut std::task::Context::from_waker(&writer_waker), b"y")
            .is_pending()
    );
    let mut buf = [0u8; 1];
    let mut read_buf = tokio::io::ReadBuf::new(&mut buf);
    assert!(
        std::pin::Pin::new(&mut stream)
            .poll_read(
                &mut std::task::Context::from_waker(&reader_waker),
                &mut read_buf
            )
            .is_pending()
    );
    let (random, _) = next_dial(&mut agent).await;
    agent
        .to_server
        .send(packet::dial_response_connected(random, 8, true))
        .await
        .unwrap();
    assert!(
        wait_until(STEP, || writer_woken
            .load(std::sync::atomic::Ordering::SeqCst))
        .await,
        "the waiting writer was not woken"
    );
    stream.write_all(b"y").await.unwrap();
    assert_eq!(
        frame(agent.recv(STEP).await),
        Frame::Data {
            connect_id: 8,
            data: Bytes::from_static(b"y")
        }
    );

    // Shut down before any use: nothing is dialed.
    let mut unused = client.dial_lazily("cluster-a:8443");
    unused.shutdown().await.unwrap();
    assert!(unused.write_all(b"late").await.is_err());
    server.shutdown().await;
}

/// A waker that only records that it was woken.
struct WakeFlag(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl WakeFlag {
    fn waker() -> (
        std::sync::Arc<std::sync::atomic::AtomicBool>,
        std::task::Waker,
    ) {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waker = std::task::Waker::from(std::sync::Arc::new(WakeFlag(flag.clone())));
        (flag, waker)
    }
}

impl std::task::Wake for WakeFlag {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The server reads an agent's packets whether or not the agent reads the
/// server's: the two directions of a tunnel are as independent as a TCP
/// connection's. (hyper polls a response body only while its stream has
/// send window, so reading the agent inside that body would stop both.)
#[tokio::test]
async fn an_agent_that_stops_reading_still_has_its_packets_read() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    // The held-up upload must not be closed for stalling during the test.
    config.plain_peer_stall_timeout = Duration::from_secs(300);
    let server = server_with(&pki, config).await;
    let mut agent = agent(&pki, &server, "cluster-a", None).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut streams = Vec::new();
    for connect_id in [1, 2] {
        let dial = {
            let client = client.clone();
            tokio::spawn(async move { client.dial("cluster-a:1").await })
        };
        let Frame::DialRequest { random, .. } = frame(agent.recv(STEP).await) else {
            panic!("expected DIAL_REQ");
        };
        agent
            .to_server
            .send(packet::dial_response_ok(random, connect_id))
            .await
            .unwrap();
        streams.push(dial.await.unwrap().unwrap());
    }
    let mut download = streams.pop().unwrap();
    let mut upload = streams.pop().unwrap();
    // From here on the agent reads nothing: connection 1's upload fills
    // every window between the client and the agent, until the server
    // holds the client's bytes back.
    let flood = tokio::spawn(async move {
        let chunk = vec![7u8; 64 * 1024];
        for _ in 0..512 {
            if upload.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let held_up = || {
        server.metrics_text().lines().any(|line| {
            line == "konnectivity_network_proxy_server_full_receive_channels{service_method=\"Proxy\"} 1"
        })
    };
    assert!(
        wait_until(Duration::from_secs(30), held_up).await,
        "the upload never filled the way to the agent"
    );
    const SENT: usize = 8 * 1024 * 1024;
    let sender = agent.to_server.clone();
    tokio::spawn(async move {
        let chunk = Bytes::from(vec![9u8; 64 * 1024]);
        for _ in 0..SENT / chunk.len() {
            if sender.send(packet::data(2, chunk.clone())).await.is_err() {
                return;
            }
        }
    });
    let mut received = vec![0u8; SENT];
    tokio::time::timeout(Duration::from_secs(30), download.read_exact(&mut received))
        .await
        .expect("connection 2's download stopped while the agent read nothing")
        .unwrap();
    assert!(received.iter().all(|b| *b == 9));
    assert!(held_up(), "the upload is still held up");
    flood.abort();
    server.shutdown().await;
}
