//! The lean framing between our own agent and server
//! (`cluster_proxy_proto::framed`): chosen by ALPN when both ends speak it,
//! gRPC over HTTP/2 with anyone else, and the same tunnel either way.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::framed::{ALPN_FRAMED, Control, FrameWriter, FramedBody, Hello};
use cluster_proxy_proto::grpc_framing::{AGENT_CONNECT_PATH, Direction, PacketStream};
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::transport::{ALPN_H2, connect_tls};
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue};
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tunnel_harness::in_process::{AgentUnderTest, test_server_config, tunnel_client};
use tunnel_harness::loadgen::echo_intact;
use tunnel_harness::pki::TestPki;

const WAIT: Duration = Duration::from_secs(10);

fn agent_config(
    pki: &TestPki,
    cluster: &str,
    port: u16,
    lean_framing: bool,
) -> proxy_agent::ProxyAgentConfig {
    let mut config = proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Config(
        pki.agent_tls(cluster).unwrap(),
    ))
    .with_ephemeral_ports();
    config.proxy_server_host = "localhost".into();
    config.proxy_server_port = port;
    config.agent_id = format!("{cluster}-agent");
    config.agent_identifiers = format!("host={cluster}");
    config.sync_interval = Duration::from_millis(200);
    config.lean_framing = lean_framing;
    config
        .host_aliases
        .insert(cluster.to_owned(), "127.0.0.1".parse().unwrap());
    config
}

/// What an agent offered to a stand-in server choosing from `server_alpn`:
/// the protocol chosen, and the hello if it was the lean framing.
async fn what_the_agent_opens(
    server_alpn: &[&[u8]],
    lean_framing: bool,
) -> (Option<Vec<u8>>, Option<Hello>) {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let acceptor = tokio_rustls::TlsAcceptor::from(pki.agent_port_config(server_alpn).unwrap());
    let _agent = AgentUnderTest::start_with(agent_config(&pki, "cluster-a", port, lean_framing))
        .await
        .unwrap();
    let (tcp, _) = tokio::time::timeout(WAIT, listener.accept())
        .await
        .expect("the agent did not connect")
        .unwrap();
    let tls = acceptor.accept(tcp).await.unwrap();
    let chosen = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    if chosen.as_deref() != Some(ALPN_FRAMED) {
        return (chosen, None);
    }
    let mut body = FramedBody::new(
        tls,
        Arc::new(Control::default()),
        Arc::new(AtomicU64::new(0)),
        1 << 20,
    );
    let hello = tokio::time::timeout(WAIT, body.hello())
        .await
        .expect("no hello")
        .unwrap();
    (chosen, Some(hello))
}

/// Our agent offers the lean framing first and opens its call with the
/// agent's metadata; with `--lean-framing=false`, or to a server that only
/// speaks gRPC (upstream's), it uses `h2`.
#[tokio::test]
async fn our_agent_offers_the_lean_framing_and_falls_back_to_grpc() {
    let (chosen, hello) = what_the_agent_opens(&[ALPN_FRAMED, ALPN_H2], true).await;
    assert_eq!(chosen.as_deref(), Some(ALPN_FRAMED));
    let hello = hello.unwrap();
    assert_eq!(hello.path, AGENT_CONNECT_PATH);
    assert_eq!(hello.headers[metadata::AGENT_ID], "cluster-a-agent");
    assert_eq!(hello.headers[metadata::AGENT_IDENTIFIERS], "host=cluster-a");
    let user_agent = hello.headers[metadata::USER_AGENT].to_str().unwrap();
    assert!(
        user_agent.starts_with("cluster-proxy-agent/"),
        "{user_agent}"
    );

    let (chosen, _) = what_the_agent_opens(&[ALPN_FRAMED, ALPN_H2], false).await;
    assert_eq!(chosen.as_deref(), Some(ALPN_H2), "--lean-framing=false");
    let (chosen, _) = what_the_agent_opens(&[ALPN_H2], true).await;
    assert_eq!(chosen.as_deref(), Some(ALPN_H2), "a gRPC-only server");
}

/// One server carries an agent in the lean framing and one on gRPC side by
/// side: small and bulk traffic through each arrives intact.
#[tokio::test]
async fn lean_and_grpc_agents_carry_the_same_traffic() {
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let port = server.agent_addr.port();
    let _lean = AgentUnderTest::start_with(agent_config(&pki, "cluster-a", port, true))
        .await
        .unwrap();
    let _grpc = AgentUnderTest::start_with(agent_config(&pki, "cluster-b", port, false))
        .await
        .unwrap();
    assert!(wait_until(WAIT, || server.tunnel_count() == 2).await);
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    for cluster in ["cluster-a", "cluster-b"] {
        let address = format!("{cluster}:{}", echo.addr.port());
        let mut s = client.dial(&address).await.unwrap();
        s.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        s.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"x");
        echo_intact(
            client.dial(&address).await.unwrap(),
            16 << 20,
            Duration::from_secs(60),
        )
        .await;
    }
    server.shutdown().await;
}

/// A hand-driven client of the server's agent port in the lean framing.
struct FramedAgent {
    body: FramedBody<tokio::io::ReadHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>,
    writer:
        FrameWriter<tokio::io::WriteHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>,
}

impl FramedAgent {
    async fn connect(pki: &TestPki, cluster: &str, port: u16) -> FramedAgent {
        let tls = connect_tls(
            "localhost",
            port,
            pki.agent_tls_alpn(cluster, &[ALPN_FRAMED]).unwrap(),
            WAIT,
        )
        .await
        .unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(ALPN_FRAMED));
        let (read, write) = tokio::io::split(tls);
        let control = Arc::new(Control::default());
        FramedAgent {
            body: FramedBody::new(read, control.clone(), Arc::new(AtomicU64::new(0)), 1 << 20),
            writer: FrameWriter::new(write, control),
        }
    }

    async fn send(&mut self, frame: Bytes) {
        self.writer.queue(frame);
        std::future::poll_fn(|cx| self.writer.poll_write_queued(cx))
            .await
            .unwrap();
    }

    /// Sends a hello for `path` with `headers`; returns the server's head.
    async fn open(&mut self, path: &str, headers: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, HeaderValue::from_static(value));
        }
        let hello = Hello {
            path: path.to_owned(),
            headers: map,
        };
        self.send(hello.encode().unwrap()).await;
        tokio::time::timeout(WAIT, self.body.head())
            .await
            .expect("no head")
            .unwrap()
    }
}

const CLUSTER_A: &[(&str, &str)] = &[
    (metadata::AGENT_ID, "cluster-a-agent"),
    (metadata::AGENT_IDENTIFIERS, "host=cluster-a"),
];

/// The server admits a framed agent as it admits one on gRPC (its head
/// carries `serverid` and `servercount`), refuses what it would refuse
/// there with the same status, and ends the call with an OK end frame once
/// the agent ended its side.
#[tokio::test]
async fn the_server_admits_refuses_and_ends_framed_calls() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let port = server.agent_addr.port();

    let mut agent = FramedAgent::connect(&pki, "cluster-a", port).await;
    let head = agent.open("/AgentService/Other", CLUSTER_A).await;
    let status = tonic::Status::from_header_map(&head).expect("a refusal");
    assert_eq!(status.code(), tonic::Code::Unimplemented);

    let mut agent = FramedAgent::connect(&pki, "cluster-a", port).await;
    let head = agent
        .open(
            AGENT_CONNECT_PATH,
            &[
                (metadata::AGENT_ID, "cluster-a-agent"),
                (metadata::AGENT_IDENTIFIERS, "host=cluster-b"),
            ],
        )
        .await;
    let status = tonic::Status::from_header_map(&head).expect("a refusal");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert_eq!(server.tunnel_count(), 0);

    let mut agent = FramedAgent::connect(&pki, "cluster-a", port).await;
    let head = agent.open(AGENT_CONNECT_PATH, CLUSTER_A).await;
    assert!(tonic::Status::from_header_map(&head).is_none(), "{head:?}");
    assert!(head.contains_key(metadata::SERVER_ID), "{head:?}");
    assert_eq!(head[metadata::SERVER_COUNT], "1");
    assert!(wait_until(WAIT, || server.tunnel_count() == 1).await);

    // Our end (an empty end frame), then the server's: OK, and the tunnel is gone.
    let end = cluster_proxy_proto::framed::end_frame(&HeaderMap::new()).unwrap();
    agent.send(end).await;
    let mut packets = PacketStream::new(agent.body, Direction::Response, 1 << 20);
    let ended = tokio::time::timeout(WAIT, async {
        while let Some(next) = packets.next().await {
            next?;
        }
        Ok::<_, tonic::Status>(())
    })
    .await
    .expect("the server did not end the call");
    assert!(ended.is_ok(), "{ended:?}");
    assert!(wait_until(WAIT, || server.tunnel_count() == 0).await);
    server.shutdown().await;
}

/// Bytes that are not the framing end the agent's call and its tunnel,
/// and the server closes the connection rather than waiting on it.
#[tokio::test]
async fn a_malformed_frame_ends_the_call() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let mut agent = FramedAgent::connect(&pki, "cluster-a", server.agent_addr.port()).await;
    agent.open(AGENT_CONNECT_PATH, CLUSTER_A).await;
    assert!(wait_until(WAIT, || server.tunnel_count() == 1).await);

    agent.send(Bytes::from_static(&[0x42, 0, 0, 0, 0])).await;
    assert!(
        wait_until(WAIT, || server.tunnel_count() == 0).await,
        "the tunnel outlived a malformed frame"
    );
    let mut packets = PacketStream::new(agent.body, Direction::Response, 1 << 20);
    let closed = tokio::time::timeout(WAIT, async {
        while let Some(Ok(_)) = packets.next().await {}
    })
    .await;
    assert!(closed.is_ok(), "the server kept the connection open");
    server.shutdown().await;
}
