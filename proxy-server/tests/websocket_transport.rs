//! The tunnel over a WebSocket (`proxy-agent --transport websocket`,
//! `cluster_proxy_proto::websocket`): a real agent against a real server,
//! directly and through a TLS-terminating middlebox that speaks only
//! HTTP/1.1; its heartbeat; the errors of servers that do not upgrade.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::framed::ALPN_FRAMED;
use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11, connect_tls};
use cluster_proxy_proto::websocket::TUNNEL_PATH;
use http::{Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use proxy_agent::{ProxyAgentConfig, TlsSource, Transport};
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::{eventually, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tunnel_harness::faults::pump_unless_silent;
use tunnel_harness::in_process::{AgentUnderTest, health_get, test_server_config, tunnel_client};
use tunnel_harness::loadgen::echo_intact;
use tunnel_harness::pki::TestPki;

const WAIT: Duration = Duration::from_secs(15);
const CLUSTER: &str = "cluster-a";

fn agent_config(pki: &TestPki, port: u16, transport: Transport) -> ProxyAgentConfig {
    let mut config = ProxyAgentConfig::new(TlsSource::Config(pki.agent_tls(CLUSTER).unwrap()))
        .with_ephemeral_ports();
    config.proxy_server_host = "localhost".into();
    config.proxy_server_port = port;
    config.agent_id = format!("{CLUSTER}-agent");
    config.agent_identifiers = format!("host={CLUSTER}");
    config.sync_interval = Duration::from_millis(200);
    config.connect_timeout = Duration::from_secs(2);
    config.transport = transport;
    config
        .host_aliases
        .insert(CLUSTER.to_owned(), "127.0.0.1".parse().unwrap());
    config
}

async fn start_server(pki: &TestPki) -> proxy_server::RunningServer {
    proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap()
}

/// The agent's newest failure to open a tunnel, from its `/readyz`, once
/// there is one.
async fn connect_failure(agent: &AgentUnderTest) -> String {
    let health = agent.agent().unwrap().health_addr();
    eventually("a failed connect attempt on /readyz", WAIT, || async move {
        let (_, body) = health_get(health, "/readyz").await.ok()?;
        body.lines()
            .find(|line| line.contains("last-connect-attempt failed"))
            .map(str::to_owned)
    })
    .await
}

/// 1 MiB echoed through the agent's tunnel, from a hub client.
async fn echo_a_mebibyte(pki: &TestPki, server: &proxy_server::RunningServer) {
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let stream = client
        .dial(&format!("{CLUSTER}:{}", echo.addr.port()))
        .await
        .unwrap();
    echo_intact(stream, 1 << 20, Duration::from_secs(60)).await;
}

#[tokio::test]
async fn a_websocket_agent_carries_traffic_through_a_real_server() {
    let pki = TestPki::new(&[CLUSTER]).unwrap();
    let server = start_server(&pki).await;
    let _agent = AgentUnderTest::start_with(agent_config(
        &pki,
        server.agent_addr.port(),
        Transport::Websocket,
    ))
    .await
    .unwrap();
    assert!(wait_until(WAIT, || server.tunnel_count() == 1).await);
    echo_a_mebibyte(&pki, &server).await;
    server.shutdown().await;
}

/// A TLS-terminating middlebox that speaks only HTTP/1.1 and negotiates
/// no ALPN, like the L7 load balancers and TLS inspection that break
/// HTTP/2: each request goes on to the server over TLS of its own
/// (offering no ALPN either), and an upgrade is relayed byte for byte.
/// Real middleboxes cannot present the agent's client certificate; this
/// one holds the agent's credentials so that the server still sees the
/// agent's identity.
struct Http1Middlebox {
    port: u16,
    /// TCP connections accepted from agents.
    accepted: Arc<AtomicUsize>,
    /// Reads relayed from the agent after an upgrade.
    agent_reads: Arc<AtomicUsize>,
    /// Relays nothing more and accepts no one, holding what is open.
    silent: Arc<AtomicBool>,
}

#[derive(Clone)]
struct Upstream {
    addr: SocketAddr,
    tls: tokio_rustls::TlsConnector,
    agent_reads: Arc<AtomicUsize>,
    silent: Arc<AtomicBool>,
}

type RelayBody = Either<Incoming, Full<Bytes>>;

impl Http1Middlebox {
    async fn start(pki: &TestPki, server: SocketAddr) -> Http1Middlebox {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let acceptor = tokio_rustls::TlsAcceptor::from(pki.agent_port_config(&[]).unwrap());
        let upstream = Upstream {
            addr: server,
            tls: tokio_rustls::TlsConnector::from(pki.agent_tls_alpn(CLUSTER, &[]).unwrap()),
            agent_reads: Arc::default(),
            silent: Arc::default(),
        };
        let middlebox = Http1Middlebox {
            port,
            accepted: Arc::default(),
            agent_reads: upstream.agent_reads.clone(),
            silent: upstream.silent.clone(),
        };
        let accepted = middlebox.accepted.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                if upstream.silent.load(Ordering::SeqCst) {
                    continue;
                }
                accepted.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |request| {
                        let upstream = upstream.clone();
                        async move { Ok::<_, std::convert::Infallible>(upstream.forward(request).await) }
                    });
                    // HTTP/2's preface is a parse error here: the connection closes.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        middlebox
    }

    fn go_silent(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }
}

fn bad_gateway(why: String) -> Response<RelayBody> {
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(why))));
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
}

impl Upstream {
    async fn forward(&self, mut request: Request<Incoming>) -> Response<RelayBody> {
        let tcp = match TcpStream::connect(self.addr).await {
            Ok(tcp) => tcp,
            Err(e) => return bad_gateway(e.to_string()),
        };
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tls = match self.tls.connect(name, tcp).await {
            Ok(tls) => tls,
            Err(e) => return bad_gateway(e.to_string()),
        };
        let (mut sender, connection) =
            match hyper::client::conn::http1::handshake(TokioIo::new(tls)).await {
                Ok(handshake) => handshake,
                Err(e) => return bad_gateway(e.to_string()),
            };
        tokio::spawn(connection.with_upgrades());
        let from_agent = hyper::upgrade::on(&mut request);
        let mut response = match sender.send_request(request).await {
            Ok(response) => response,
            Err(e) => return bad_gateway(e.to_string()),
        };
        if response.status() == StatusCode::SWITCHING_PROTOCOLS {
            let from_server = hyper::upgrade::on(&mut response);
            let relay = self.clone();
            tokio::spawn(async move {
                if let (Ok(agent), Ok(server)) = tokio::join!(from_agent, from_server) {
                    let (agent_read, agent_write) = tokio::io::split(TokioIo::new(agent));
                    let (server_read, server_write) = tokio::io::split(TokioIo::new(server));
                    tokio::join!(
                        pump_unless_silent(
                            agent_read,
                            server_write,
                            relay.silent.clone(),
                            relay.agent_reads.clone()
                        ),
                        pump_unless_silent(
                            server_read,
                            agent_write,
                            relay.silent.clone(),
                            Arc::default()
                        ),
                    );
                }
            });
        }
        response.map(Either::Left)
    }
}

/// Through a middlebox that speaks only HTTP/1.1 and strips ALPN, the
/// default transport (HTTP/2 there) fails with an error that says so,
/// and the WebSocket transport carries the tunnel.
#[tokio::test]
async fn through_an_http1_only_middlebox_only_the_websocket_transport_works() {
    let pki = TestPki::new(&[CLUSTER]).unwrap();
    let server = start_server(&pki).await;
    let middlebox = Http1Middlebox::start(&pki, server.agent_addr).await;

    let auto = AgentUnderTest::start_with(agent_config(&pki, middlebox.port, Transport::Auto))
        .await
        .unwrap();
    let failure = connect_failure(&auto).await;
    eprintln!("the default transport through the middlebox: {failure}");
    assert!(failure.contains("HTTP/2 with"), "{failure}");
    assert_eq!(server.tunnel_count(), 0);
    auto.kill();

    let _websocket =
        AgentUnderTest::start_with(agent_config(&pki, middlebox.port, Transport::Websocket))
            .await
            .unwrap();
    assert!(wait_until(WAIT, || server.tunnel_count() == 1).await);
    echo_a_mebibyte(&pki, &server).await;
    server.shutdown().await;
}

/// A quiet tunnel stays up across many heartbeat intervals (the pings are
/// what crosses the middlebox); when the path goes silent, the agent
/// drops the tunnel within three intervals.
#[tokio::test]
async fn the_heartbeat_keeps_a_quiet_tunnel_and_notices_a_silent_path() {
    let interval = Duration::from_millis(200);
    let pki = TestPki::new(&[CLUSTER]).unwrap();
    let server = start_server(&pki).await;
    let middlebox = Http1Middlebox::start(&pki, server.agent_addr).await;
    let mut config = agent_config(&pki, middlebox.port, Transport::Websocket);
    config.websocket_heartbeat = interval;
    let agent = AgentUnderTest::start_with(config).await.unwrap();
    assert!(wait_until(WAIT, || server.tunnel_count() == 1).await);

    let before = middlebox.agent_reads.load(Ordering::SeqCst);
    assert!(
        wait_until(WAIT, || {
            middlebox.agent_reads.load(Ordering::SeqCst) >= before + 8
        })
        .await,
        "the agent sent no heartbeats"
    );
    assert_eq!(
        middlebox.accepted.load(Ordering::SeqCst),
        1,
        "the quiet tunnel was reconnected"
    );
    assert_eq!(server.tunnel_count(), 1);

    middlebox.go_silent();
    let silenced = tokio::time::Instant::now();
    let agent_ref = agent.agent().unwrap();
    assert!(
        wait_until(WAIT, || agent_ref.tunnel_count() == 0).await,
        "the agent kept a tunnel on a silent path"
    );
    let noticed = silenced.elapsed();
    eprintln!("a silent path noticed after {noticed:?} (heartbeat {interval:?})");
    // Three intervals after the last pong at most; one more for a loaded machine.
    assert!(noticed <= interval * 4, "noticed after {noticed:?}");
    server.shutdown().await;
}

/// A stand-in for the agent port: TLS choosing from `alpn`, then it reads
/// each request's head and answers `answer` (nothing at all if empty).
/// Reports the ALPN chosen and the head of each request.
async fn stand_in(
    pki: &TestPki,
    alpn: &[&[u8]],
    answer: &'static [u8],
) -> (u16, mpsc::UnboundedReceiver<(Option<Vec<u8>>, String)>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let acceptor = tokio_rustls::TlsAcceptor::from(pki.agent_port_config(alpn).unwrap());
    let (heads, received) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let heads = heads.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
                    match tls.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let _ = heads.send((alpn, String::from_utf8_lossy(&head).into_owned()));
                if !answer.is_empty() {
                    let _ = tls.write_all(answer).await;
                    let _ = tls.flush().await;
                }
                // Held open until the agent gives up.
                let _ = tls.read(&mut byte).await;
            });
        }
    });
    (port, received)
}

/// The agent offers only HTTP/1.1 and opens the call with an upgrade on
/// the tunnel's path that carries its metadata.
#[tokio::test]
async fn the_agent_asks_for_the_upgrade_with_its_metadata() {
    let pki = TestPki::new(&[CLUSTER]).unwrap();
    let (port, mut heads) = stand_in(&pki, &[ALPN_FRAMED, ALPN_H2, ALPN_HTTP11], b"").await;
    let _agent = AgentUnderTest::start_with(agent_config(&pki, port, Transport::Websocket))
        .await
        .unwrap();
    let (alpn, head) = tokio::time::timeout(WAIT, heads.recv())
        .await
        .expect("the agent did not connect")
        .unwrap();
    assert_eq!(alpn.as_deref(), Some(ALPN_HTTP11));
    let lower = head.to_ascii_lowercase();
    assert!(
        head.starts_with(&format!("GET {TUNNEL_PATH} HTTP/1.1\r\n")),
        "{head}"
    );
    for expected in [
        "upgrade: websocket",
        "sec-websocket-protocol: cluster-proxy-tunnel.v1",
        "agentid: cluster-a-agent",
        "agentidentifiers: host=cluster-a",
        "user-agent: cluster-proxy-agent/",
    ] {
        assert!(lower.contains(expected), "no {expected:?} in {head}");
    }
}

/// A server or middlebox that answers the upgrade with anything but 101
/// gives an error naming the answer; one that answers no HTTP at all, or
/// nothing, gives an error too, within the connect timeout.
#[tokio::test]
async fn answers_other_than_an_upgrade_are_named() {
    let pki = TestPki::new(&[CLUSTER]).unwrap();
    let cases: [(&'static [u8], &str); 4] = [
        (
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot here\n",
            "answered with HTTP 404 Not Found",
        ),
        (
            b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n",
            "answered with HTTP 502 Bad Gateway",
        ),
        // An HTTP/2 SETTINGS frame: a server that speaks no HTTP/1.1.
        (&[0, 0, 0, 4, 0, 0, 0, 0, 0], "WebSocket upgrade:"),
        (b"", "timed out"),
    ];
    for (answer, says) in cases {
        let (port, _heads) = stand_in(&pki, &[ALPN_HTTP11], answer).await;
        let agent = AgentUnderTest::start_with(agent_config(&pki, port, Transport::Websocket))
            .await
            .unwrap();
        let failure = connect_failure(&agent).await;
        eprintln!("{failure}");
        assert!(failure.contains(says), "expected {says:?}: {failure}");
        agent.kill();
    }
}

/// What a plain HTTP/1.1 client gets from the agent port.
async fn http1_exchange(pki: &TestPki, port: u16, request: &str) -> String {
    let mut tls = connect_tls(
        "localhost",
        port,
        pki.agent_tls_alpn(CLUSTER, &[ALPN_HTTP11]).unwrap(),
        WAIT,
    )
    .await
    .unwrap();
    tls.write_all(request.as_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(WAIT, tls.read_to_end(&mut response))
        .await
        .expect("the agent port kept the connection open")
        .ok();
    String::from_utf8_lossy(&response).into_owned()
}

/// On HTTP/1.1 the agent port serves only the upgrade on the tunnel's
/// path: any other path is a 404, a request there that is no upgrade a
/// 400, and either closes the connection.
#[tokio::test]
async fn the_agent_port_refuses_other_http1_requests() {
    let pki = TestPki::new(&[CLUSTER]).unwrap();
    let server = start_server(&pki).await;
    let port = server.agent_addr.port();
    let response = http1_exchange(&pki, port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    assert!(response.contains(TUNNEL_PATH), "{response}");
    let response = http1_exchange(
        &pki,
        port,
        &format!("GET {TUNNEL_PATH} HTTP/1.1\r\nHost: x\r\n\r\n"),
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains("Upgrade: websocket"), "{response}");
    let response = http1_exchange(
        &pki,
        port,
        &format!(
            "GET {TUNNEL_PATH} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        ),
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains("cluster-proxy-tunnel.v1"), "{response}");
    assert_eq!(server.tunnel_count(), 0);
    server.shutdown().await;
}

/// A gRPC agent that negotiates no ALPN (behind a middlebox that strips
/// it, yet passes HTTP/2) still gets its call: the agent port tells
/// HTTP/2's preface from the WebSocket upgrade by the first bytes.
#[tokio::test]
async fn http2_without_alpn_is_still_grpc() {
    use cluster_proxy_proto::grpc_framing::AGENT_CONNECT_PATH;
    use cluster_proxy_proto::metadata;

    let pki = TestPki::new(&[CLUSTER]).unwrap();
    let server = start_server(&pki).await;
    let tls = connect_tls(
        "localhost",
        server.agent_addr.port(),
        pki.agent_tls_alpn(CLUSTER, &[]).unwrap(),
        WAIT,
    )
    .await
    .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), None);
    let (requests, connection) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(connection);
    let mut requests = requests.ready().await.unwrap();
    let request = Request::post(format!("https://localhost{AGENT_CONNECT_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header(metadata::AGENT_ID, "cluster-a-agent")
        .header(metadata::AGENT_IDENTIFIERS, "host=cluster-a")
        .body(())
        .unwrap();
    let (response, _stream) = requests.send_request(request, false).unwrap();
    let response = tokio::time::timeout(WAIT, response)
        .await
        .expect("no answer")
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers().contains_key(metadata::SERVER_ID),
        "{response:?}"
    );
    assert!(wait_until(WAIT, || server.tunnel_count() == 1).await);
    server.shutdown().await;
}
