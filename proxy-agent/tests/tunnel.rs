//! The agent against a fake proxy-server (a real tonic `AgentService` over
//! mTLS) and a local TCP echo target.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use cert_authority::pki::{Authority, LeafRequest};
use cert_authority::tls::{self, Identity, Pem};
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::konnectivity::agent_service_server::{AgentService, AgentServiceServer};
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::packet::{self, Frame};
use cluster_proxy_proto::transport::ALPN_H2;
use proxy_agent::{ProxyAgentConfig, RunningAgent, TlsSource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::metadata::MetadataMap;
use tonic::transport::{Certificate, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

const STEP: Duration = Duration::from_secs(5);

struct Session {
    metadata: MetadataMap,
    inbound: Streaming<Packet>,
    outbound: mpsc::Sender<Result<Packet, Status>>,
}

impl Session {
    async fn send(&self, p: Packet) {
        self.outbound.send(Ok(p)).await.unwrap();
    }

    /// The next packet that is not a WINDOW_UPDATE.
    async fn next(&mut self) -> Frame {
        loop {
            let f = self.next_any().await;
            if !matches!(f, Frame::WindowUpdate { .. }) {
                return f;
            }
        }
    }

    async fn next_any(&mut self) -> Frame {
        let p = tokio::time::timeout(STEP, self.inbound.message())
            .await
            .expect("timed out waiting for a packet from the agent")
            .expect("stream error")
            .expect("stream ended");
        Frame::from_packet(p)
    }
}

struct FakeServer {
    /// Server ids handed out in turn, one per Connect.
    ids: Vec<String>,
    next: AtomicUsize,
    count: usize,
    window: Option<u32>,
    sessions: mpsc::UnboundedSender<(String, Session)>,
}

#[tonic::async_trait]
impl AgentService for FakeServer {
    type ConnectStream = ReceiverStream<Result<Packet, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let i = self.next.fetch_add(1, Ordering::SeqCst);
        let id = self.ids[i % self.ids.len()].clone();
        let metadata = request.metadata().clone();
        let (tx, rx) = mpsc::channel(64);
        let _ = self.sessions.send((
            id.clone(),
            Session {
                metadata,
                inbound: request.into_inner(),
                outbound: tx,
            },
        ));
        let mut response = Response::new(ReceiverStream::new(rx));
        let md = response.metadata_mut();
        md.insert(metadata::SERVER_ID, id.parse().unwrap());
        md.insert(
            metadata::SERVER_COUNT,
            self.count.to_string().parse().unwrap(),
        );
        if let Some(w) = self.window {
            md.insert(
                metadata::FLOW_CONTROL_WINDOW,
                w.to_string().parse().unwrap(),
            );
        }
        Ok(response)
    }
}

struct Pki {
    client: Arc<rustls::ClientConfig>,
    server: ServerTlsConfig,
}

fn pki() -> Pki {
    let ca = Authority::generate("test-ca", Duration::from_secs(3600)).unwrap();
    let server = ca
        .issue(&LeafRequest::server(
            "proxy-server",
            &["127.0.0.1", "localhost"],
        ))
        .unwrap();
    let agent = ca.issue(&LeafRequest::client("agent")).unwrap();
    let roots = tls::roots(&Pem::text("ca", ca.cert_pem())).unwrap();
    let identity = Identity::new(
        &Pem::text("agent.crt", &agent.cert_pem),
        &Pem::text("agent.key", &agent.key_pem),
    )
    .unwrap();
    let client = tls::client_config(roots, Some(identity), &[ALPN_H2]).unwrap();
    let server = ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(
            &server.cert_pem,
            &server.key_pem,
        ))
        .client_ca_root(Certificate::from_pem(ca.cert_pem()));
    Pki { client, server }
}

async fn fake_server(
    pki: &Pki,
    ids: &[&str],
    count: usize,
    window: Option<u32>,
) -> (SocketAddr, mpsc::UnboundedReceiver<(String, Session)>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let service = FakeServer {
        ids: ids.iter().map(|s| (*s).to_owned()).collect(),
        next: AtomicUsize::new(0),
        count,
        window,
        sessions: tx,
    };
    let router = Server::builder()
        .tls_config(pki.server.clone())
        .unwrap()
        .add_service(AgentServiceServer::new(service));
    tokio::spawn(router.serve_with_incoming(TcpListenerStream::new(listener)));
    (addr, rx)
}

async fn echo_target() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = tcp.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

fn agent_config(pki: &Pki, server: SocketAddr) -> ProxyAgentConfig {
    let mut c = ProxyAgentConfig::new(TlsSource::Config(pki.client.clone())).with_ephemeral_ports();
    c.proxy_server_host = server.ip().to_string();
    c.proxy_server_port = server.port();
    c.agent_id = "agent-under-test".into();
    c.agent_identifiers = "host=cluster-a&default-route=true".into();
    c.sync_interval = Duration::from_millis(100);
    c.sync_interval_cap = Duration::from_millis(500);
    c.flow_control_window = 65536;
    c.shutdown_grace = Duration::from_millis(200);
    c
}

async fn session(rx: &mut mpsc::UnboundedReceiver<(String, Session)>) -> (String, Session) {
    tokio::time::timeout(STEP, rx.recv())
        .await
        .expect("agent did not connect")
        .unwrap()
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    tokio::time::timeout(STEP, tcp.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

async fn dial(s: &mut Session, address: &str, random: i64) -> i64 {
    s.send(packet::dial_request(address, random)).await;
    match s.next().await {
        Frame::DialResponse {
            error,
            connect_id,
            random: r,
            early_data_written,
        } => {
            assert_eq!(r, random);
            assert!(!early_data_written, "no early data was sent");
            assert_eq!(error, "");
            assert!(connect_id > 0);
            connect_id
        }
        other => panic!("expected DIAL_RSP, got {other:?}"),
    }
}

/// Reads DATA for `connect_id` until `n` bytes arrived.
async fn read_data(s: &mut Session, connect_id: i64, n: usize) -> Vec<u8> {
    let mut got = Vec::new();
    while got.len() < n {
        match s.next().await {
            Frame::Data {
                connect_id: id,
                data,
            } => {
                assert_eq!(id, connect_id);
                got.extend_from_slice(&data);
            }
            other => panic!("expected DATA, got {other:?}"),
        }
    }
    got
}

async fn stop(agent: RunningAgent) {
    tokio::time::timeout(Duration::from_secs(15), agent.shutdown())
        .await
        .expect("shutdown hung");
}

#[tokio::test]
async fn serves_dials_data_and_closes_like_upstream() {
    let pki = pki();
    let (server, mut sessions) = fake_server(&pki, &["server-1"], 1, None).await;
    let target = echo_target().await;
    let agent = proxy_agent::start(agent_config(&pki, server))
        .await
        .unwrap();
    let (server_id, mut s) = session(&mut sessions).await;
    assert_eq!(server_id, "server-1");
    assert_eq!(
        s.metadata.get(metadata::AGENT_ID).unwrap(),
        "agent-under-test"
    );
    assert_eq!(
        s.metadata.get(metadata::AGENT_IDENTIFIERS).unwrap(),
        "host=cluster-a&default-route=true"
    );
    assert_eq!(
        s.metadata.get(metadata::FLOW_CONTROL_WINDOW).unwrap(),
        "65536"
    );
    assert!(agent.wait_for_tunnels(1, STEP).await);
    assert!(
        http_get(agent.health_addr(), "/readyz")
            .await
            .starts_with("HTTP/1.1 200")
    );

    // Dial, echo, close.
    let id = dial(&mut s, &target.to_string(), 42).await;
    s.send(packet::data(id, Bytes::from_static(b"hello"))).await;
    assert_eq!(read_data(&mut s, id, 5).await, b"hello");

    // Unknown ids and connectID 0.
    s.send(packet::data(0, Bytes::from_static(b"dropped")))
        .await;
    s.send(packet::data(999, Bytes::from_static(b"x"))).await;
    assert_eq!(
        s.next().await,
        Frame::CloseResponse {
            error: "unrecognized connectID".into(),
            connect_id: 999
        }
    );
    s.send(packet::close_request(12345)).await;
    assert_eq!(
        s.next().await,
        Frame::CloseResponse {
            error: "Unknown connectID".into(),
            connect_id: 12345
        }
    );

    // Data queued before CLOSE_REQ is still delivered, then CLOSE_RSP.
    s.send(packet::data(id, Bytes::from_static(b"bye"))).await;
    s.send(packet::close_request(id)).await;
    let mut echoed = Vec::new();
    loop {
        match s.next().await {
            Frame::Data { connect_id, data } => {
                assert_eq!(connect_id, id);
                echoed.extend_from_slice(&data);
            }
            Frame::CloseResponse { error, connect_id } => {
                assert_eq!((connect_id, error.as_str()), (id, ""));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(echoed.is_empty() || echoed == b"bye", "{echoed:?}");

    // Failed dials: refused port, unsupported protocol.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    s.send(packet::dial_request(closed.to_string(), 7)).await;
    assert_eq!(
        s.next().await,
        Frame::DialResponse {
            error: format!("dial tcp {closed}: connect: connection refused"),
            connect_id: 0,
            random: 7,
            early_data_written: false,
        }
    );
    let mut udp = packet::dial_request(target.to_string(), 8);
    if let Some(cluster_proxy_proto::konnectivity::packet::Payload::DialRequest(d)) =
        udp.payload.as_mut()
    {
        d.protocol = "udp".into();
    }
    s.send(udp).await;
    assert_eq!(
        s.next().await,
        Frame::DialResponse {
            error: "unsupported protocol \"udp\"".into(),
            connect_id: 0,
            random: 8,
            early_data_written: false,
        }
    );

    // A second connection gets the next id; a target FIN closes it.
    let id2 = dial(&mut s, &target.to_string(), 43).await;
    assert!(id2 > id);

    // Shutdown sends DRAIN.
    let stopping = tokio::spawn(stop(agent));
    loop {
        match s.next().await {
            Frame::Drain => break,
            Frame::CloseResponse { connect_id, .. } if connect_id == id2 => {}
            other => panic!("expected DRAIN, got {other:?}"),
        }
    }
    stopping.await.unwrap();
}

#[tokio::test]
async fn dial_close_cancels_a_pending_dial() {
    let pki = pki();
    let (server, mut sessions) = fake_server(&pki, &["server-1"], 1, None).await;
    let mut config = agent_config(&pki, server);
    config.dial_timeout = Duration::from_secs(3);
    let agent = proxy_agent::start(config).await.unwrap();
    let (_, mut s) = session(&mut sessions).await;
    // A non-routable address: the connect hangs until the timeout (or fails
    // at once in sandboxes without a route, which proves nothing either way).
    s.send(packet::dial_request("10.255.255.1:9", 77)).await;
    s.send(packet::close_dial(77)).await;
    s.send(packet::close_request(5555)).await;
    // The marker reply arrives; no DIAL_RSP for 77 may follow the cancel.
    match s.next().await {
        Frame::CloseResponse { connect_id, .. } => assert_eq!(connect_id, 5555),
        Frame::DialResponse { random, error, .. } => {
            assert_eq!(random, 77);
            assert!(!error.contains("i/o timeout"), "{error}");
            stop(agent).await;
            return;
        }
        other => panic!("unexpected {other:?}"),
    }
    let quiet = tokio::time::timeout(Duration::from_secs(4), s.inbound.message()).await;
    assert!(quiet.is_err(), "agent answered a cancelled dial: {quiet:?}");
    stop(agent).await;
}

#[tokio::test]
async fn flow_control_limits_sends_and_returns_credit() {
    let pki = pki();
    let (server, mut sessions) = fake_server(&pki, &["server-1"], 1, Some(65536)).await;
    let target = echo_target().await;
    let agent = proxy_agent::start(agent_config(&pki, server))
        .await
        .unwrap();
    let (_, mut s) = session(&mut sessions).await;
    let id = dial(&mut s, &target.to_string(), 1).await;

    // 60 KiB fits the agent's window; the agent echoes it (within our 64 KiB
    // credit) and grants credit back as it writes to the target.
    let chunk = Bytes::from(vec![7u8; 60 * 1024]);
    s.send(packet::data(id, chunk.clone())).await;
    let mut echoed = 0;
    let mut granted = 0i64;
    while echoed < chunk.len() {
        match s.next_any().await {
            Frame::Data { data, .. } => echoed += data.len(),
            Frame::WindowUpdate { connect_id, bytes } => {
                assert_eq!(connect_id, id);
                granted += bytes;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // Another 60 KiB: only 4 KiB of send credit is left, so the echo stalls.
    s.send(packet::data(id, chunk.clone())).await;
    let mut second = 0;
    loop {
        match tokio::time::timeout(Duration::from_millis(500), s.inbound.message()).await {
            Err(_) => break,
            Ok(m) => match Frame::from_packet(m.unwrap().unwrap()) {
                Frame::Data { data, .. } => second += data.len(),
                Frame::WindowUpdate { bytes, .. } => granted += bytes,
                other => panic!("unexpected {other:?}"),
            },
        }
    }
    assert!(second <= 4 * 1024, "agent exceeded our window: {second}");
    assert!(granted >= 16 * 1024, "agent returned no credit: {granted}");
    // Granting credit releases the rest.
    s.send(packet::window_update(id, 64 * 1024)).await;
    while second < chunk.len() {
        if let Frame::Data { data, .. } = s.next().await {
            second += data.len();
        }
    }

    // A nonsensical grant is a protocol violation for that connection only.
    // (Exceeding the agent's window is the same path; ReceiveQueue's own
    // tests cover the detection, and a fast echo target makes it racy here.)
    s.send(packet::window_update(id, -5)).await;
    loop {
        match s.next().await {
            Frame::CloseResponse { connect_id, error } => {
                assert_eq!(connect_id, id);
                assert!(error.contains("invalid window update"), "{error}");
                break;
            }
            Frame::Data { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // The tunnel itself is unaffected.
    let id2 = dial(&mut s, &target.to_string(), 2).await;
    s.send(packet::data(id2, Bytes::from_static(b"still here")))
        .await;
    assert_eq!(read_data(&mut s, id2, 10).await, b"still here");
    stop(agent).await;
}

#[tokio::test]
async fn keeps_one_tunnel_per_server_and_drops_duplicates() {
    let pki = pki();
    let (server, mut sessions) =
        fake_server(&pki, &["server-a", "server-a", "server-b"], 2, None).await;
    let agent = proxy_agent::start(agent_config(&pki, server))
        .await
        .unwrap();
    let mut kept = Vec::new();
    for _ in 0..3 {
        kept.push(session(&mut sessions).await);
    }
    assert!(agent.wait_for_tunnels(2, STEP).await);
    assert_eq!(agent.server_ids(), ["server-a", "server-b"]);
    // The duplicate is told DRAIN (dials the server sent it before that
    // would still be served), then closed by the agent once idle.
    let dup = &mut kept[1].1;
    let drain = tokio::time::timeout(STEP, dup.inbound.message())
        .await
        .unwrap();
    assert!(
        matches!(&drain, Ok(Some(p)) if matches!(Frame::from_packet(p.clone()), Frame::Drain)),
        "{drain:?}"
    );
    let end = tokio::time::timeout(STEP, dup.inbound.message())
        .await
        .unwrap();
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    let metrics = http_get(agent.admin_addr(), "/metrics").await;
    assert!(
        metrics.contains("konnectivity_network_proxy_agent_open_server_connections 2"),
        "{metrics}"
    );
    assert!(metrics.contains("konnectivity_network_proxy_agent_known_server_count 2"));
    // Losing a server makes the agent reconnect until it is back.
    let (_, lost) = kept.remove(2);
    drop(lost);
    let deadline = tokio::time::Instant::now() + STEP;
    let back = loop {
        let (id, s) = session(&mut sessions).await;
        if id == "server-b" {
            break s;
        }
        assert!(tokio::time::Instant::now() < deadline, "never reconnected");
    };
    assert!(agent.wait_for_tunnels(2, STEP).await);
    assert_eq!(agent.server_ids(), ["server-a", "server-b"]);
    drop(back);
    stop(agent).await;
}

#[tokio::test]
async fn not_ready_without_servers_and_files_are_checked() {
    let pki = pki();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let agent = proxy_agent::start(agent_config(&pki, closed))
        .await
        .unwrap();
    let ready = http_get(agent.health_addr(), "/readyz").await;
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(ready.contains("[+]ping ok\n[-]server-connected failed: no servers connected\n"));
    // After upstream's lines: why the newest attempt failed.
    let deadline = tokio::time::Instant::now() + STEP;
    let ready = loop {
        let ready = http_get(agent.health_addr(), "/readyz").await;
        if ready.contains("[-]last-connect-attempt failed:") {
            break ready;
        }
        assert!(tokio::time::Instant::now() < deadline, "{ready}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        ready.contains(&format!("connect to {closed}: Connection refused")),
        "{ready}"
    );
    let metrics = http_get(agent.health_addr(), "/metrics").await;
    assert!(
        metrics.contains("cluster_proxy_agent_server_connect_failures_total{reason=\"dial\"}"),
        "{metrics}"
    );
    assert!(
        http_get(agent.health_addr(), "/healthz")
            .await
            .ends_with("ok")
    );
    stop(agent).await;

    let mut config = agent_config(&pki, closed);
    config.tls = TlsSource::Files {
        ca_cert: "/nonexistent/ca.crt".into(),
        agent_cert: None,
        agent_key: None,
        alpn: Vec::new(),
    };
    let err = proxy_agent::start(config).await.unwrap_err().to_string();
    assert!(err.contains("/nonexistent/ca.crt"), "{err}");

    let mut config = agent_config(&pki, closed);
    config.agent_identifiers = "zone=eu".into();
    let err = proxy_agent::start(config).await.unwrap_err().to_string();
    assert!(err.contains("agent-identifiers"), "{err}");
}

fn stray_replies_dropped(agent: &RunningAgent) -> u64 {
    agent
        .metrics()
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix("cluster_proxy_agent_stray_replies_dropped_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A server that floods DATA and CLOSE_REQ for connection ids it made up
/// gets one CLOSE_RSP per id and at most `STRAY_CAPACITY` ids answered per
/// `STRAY_HOLD`; the rest are counted, not queued on the control lane
/// (which never waits, so it would grow by one reply per packet of a
/// server that stops reading). The tunnel still serves real dials after.
#[tokio::test]
async fn a_server_flooding_unknown_ids_gets_a_bounded_number_of_answers() {
    let pki = pki();
    let (server, mut sessions) = fake_server(&pki, &["server-1"], 1, None).await;
    let target = echo_target().await;
    let agent = proxy_agent::start(agent_config(&pki, server))
        .await
        .unwrap();
    let (_, mut s) = session(&mut sessions).await;
    let capacity = proxy_agent::tunnel::STRAY_CAPACITY;
    let flood = capacity * 4;
    for i in 0..flood {
        let id = 1_000_000 + i as i64;
        s.send(packet::data(id, bytes::Bytes::from_static(b"x")))
            .await;
        s.send(packet::close_request(id)).await;
    }
    let mut answered = std::collections::HashSet::new();
    while answered.len() < capacity {
        match s.next().await {
            Frame::CloseResponse { connect_id, .. } => {
                assert!(
                    answered.insert(connect_id),
                    "id {connect_id} answered twice"
                );
            }
            other => panic!("expected CLOSE_RSP, got {other:?}"),
        }
    }
    let dropped = (flood * 2 - capacity * 2) as u64;
    let counted = tokio::time::timeout(STEP, async {
        while stray_replies_dropped(&agent) < dropped {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        counted.is_ok(),
        "dropped answers counted: {} of {dropped}",
        stray_replies_dropped(&agent)
    );
    // Nothing beyond the bound was queued: the next packet is the answer to
    // a real dial.
    let connect_id = dial(&mut s, &target.to_string(), 7).await;
    s.send(packet::data(
        connect_id,
        bytes::Bytes::from_static(b"still here"),
    ))
    .await;
    assert_eq!(read_data(&mut s, connect_id, 10).await, b"still here");
    assert_eq!(stray_replies_dropped(&agent), dropped);
    stop(agent).await;
}

#[tokio::test]
async fn writes_early_data_to_the_target_before_answering_the_dial() {
    let pki = pki();
    let (server, mut sessions) = fake_server(&pki, &["server-1"], 1, Some(65536)).await;
    let target = echo_target().await;
    let agent = proxy_agent::start(agent_config(&pki, server))
        .await
        .unwrap();
    let (_, mut s) = session(&mut sessions).await;
    assert_eq!(
        s.metadata.get(metadata::EARLY_DATA).unwrap(),
        metadata::EARLY_DATA_V1,
        "the agent advertises the extension"
    );

    // The first bytes ride in the dial request; the answer confirms them,
    // and they reach the target before anything sent after the dial.
    s.send(packet::dial_request_with_early_data(
        target.to_string(),
        11,
        None,
        Bytes::from_static(b"first "),
    ))
    .await;
    let id = match s.next().await {
        Frame::DialResponse {
            error,
            connect_id,
            random: 11,
            early_data_written: true,
        } if error.is_empty() => connect_id,
        other => panic!("expected a DIAL_RSP confirming the early data, got {other:?}"),
    };
    s.send(packet::data(id, Bytes::from_static(b"then"))).await;
    assert_eq!(read_data(&mut s, id, 10).await, b"first then");

    // A dial that fails says nothing about the early data: it was dropped.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    s.send(packet::dial_request_with_early_data(
        closed.to_string(),
        12,
        None,
        Bytes::from_static(b"lost"),
    ))
    .await;
    assert_eq!(
        s.next().await,
        Frame::DialResponse {
            error: format!("dial tcp {closed}: connect: connection refused"),
            connect_id: 0,
            random: 12,
            early_data_written: false,
        }
    );
    stop(agent).await;
}
