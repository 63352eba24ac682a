//! An agent with a valid certificate that breaks the protocol on purpose:
//! floods of made-up connection ids, DIAL_RSP for dials never asked, empty
//! and huge DATA, CLOSE floods, too many tunnels, dials it never answers.
//! The server's queues stay within their configured bounds (read from its
//! metrics), and another agent's traffic on the same server keeps working
//! throughout. The process's RSS before and after the flood is printed.

use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::konnectivity::proxy_service_client::ProxyServiceClient;
use cluster_proxy_proto::packet;
use cluster_proxy_proto::transport::connect_channel;
use proxy_server::RunningServer;
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;
use tunnel_harness::in_process::{
    AgentUnderTest, RawAgent, RawAgentError, test_server_config, tunnel_client,
};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(10);
const MAX_STRAY_CLOSES: u32 = 64;

/// `cargo test` runs this file's tests on threads of one process, so the
/// tests that bound its RSS growth take turns: neither counts the other's
/// traffic.
static MEASURING_RSS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A sample of the server's metrics (`name{labels}` exactly), if exported.
fn metric(server: &RunningServer, sample: &str) -> Option<f64> {
    server.metrics_text().lines().find_map(|line| {
        line.strip_prefix(sample)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
    })
}

fn limited(server: &RunningServer, limit: &str) -> f64 {
    metric(
        server,
        &format!("cluster_proxy_server_limited_total{{limit=\"{limit}\"}}"),
    )
    .unwrap_or(0.0)
}

/// This process's resident set size in KiB, from /proc/self/status.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find_map(|l| {
                l.strip_prefix("VmRSS:")
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

async fn hostile(pki: &TestPki, server: &RunningServer) -> Result<RawAgent, RawAgentError> {
    RawAgent::connect(
        pki.agent_tls("cluster-evil").unwrap(),
        server.agent_addr,
        "evil-agent",
        "host=cluster-evil",
        None,
    )
    .await
}

/// A gRPC channel to the server's client port with the client windows.
async fn client_channel(pki: &TestPki, server: &RunningServer) -> tonic::transport::Channel {
    connect_channel(
        "localhost",
        server.client_addr.port(),
        pki.client_tls().unwrap(),
        STEP,
    )
    .await
    .unwrap()
}

/// One dial through the well-behaved agent and an echo round trip.
async fn echo_round_trip(
    client: &cluster_proxy_proto::client::TunnelClient,
    echo: &EchoServer,
    n: usize,
) {
    let mut stream = tokio::time::timeout(
        STEP,
        client.dial(&format!("cluster-good:{}", echo.addr.port())),
    )
    .await
    .expect("dial through the good agent timed out")
    .expect("dial through the good agent failed");
    let message = format!("round trip {n}");
    stream.write_all(message.as_bytes()).await.unwrap();
    let mut back = vec![0u8; message.len()];
    tokio::time::timeout(STEP, stream.read_exact(&mut back))
        .await
        .expect("echo timed out")
        .unwrap();
    assert_eq!(back, message.as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_agent_stays_within_the_bounds_and_another_agent_keeps_working() {
    let _alone = MEASURING_RSS.lock().await;
    let pki = TestPki::new(&["cluster-evil", "cluster-good"]).unwrap();
    let mut config = test_server_config();
    config.max_stray_closes_per_tunnel = MAX_STRAY_CLOSES;
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let good = AgentUnderTest::start(
        &pki,
        "cluster-good",
        server.agent_addr,
        &[("cluster-good", "127.0.0.1")],
    )
    .await
    .unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    echo_round_trip(&client, &echo, 0).await;

    // The hostile agent never reads what the server sends it: every answer
    // to its stray packets stays queued on the server.
    let evil = hostile(&pki, &server).await.unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() == 2).await);
    let rss_before = rss_kib();
    const ROUNDS: i64 = 10;
    const PER_ROUND: i64 = 5_000;
    let huge = Bytes::from(vec![0x5au8; 8 * 1024 * 1024]);
    for round in 0..ROUNDS {
        let base = 1_000_000 + round * PER_ROUND;
        for id in base..base + PER_ROUND {
            // DATA for a connection that never existed.
            evil.to_server
                .send(packet::data(id, Bytes::from_static(b"x")))
                .await
                .unwrap();
            // DIAL_RSP for a dial nobody asked for, naming a fresh connection.
            evil.to_server
                .send(packet::dial_response_ok(id, id + 500_000_000))
                .await
                .unwrap();
            // Packets an agent never sends, and closes for unknown ids.
            evil.to_server
                .send(packet::close_request(id))
                .await
                .unwrap();
            evil.to_server
                .send(packet::close_response(id + 7_000_000, ""))
                .await
                .unwrap();
            // Empty DATA: no payload, no flow-control cost.
            evil.to_server
                .send(packet::data(id, Bytes::new()))
                .await
                .unwrap();
        }
        // A huge DATA for an unknown id, within the packet size limit.
        evil.to_server
            .send(packet::data(base, huge.clone()))
            .await
            .unwrap();
        // Meanwhile the other agent's traffic goes on.
        echo_round_trip(&client, &echo, usize::try_from(round + 1).unwrap_or(0)).await;
    }
    // Every flooded packet has been read once all the empty DATA has.
    let empties = f64::from(u32::try_from(ROUNDS * PER_ROUND).unwrap_or(u32::MAX));
    assert!(
        wait_until(STEP, || limited(&server, "empty_data") >= empties).await,
        "empty DATA counted: {}",
        limited(&server, "empty_data")
    );
    let rss_after = rss_kib();
    let backlog = metric(&server, "cluster_proxy_server_stray_close_backlog").unwrap_or(-1.0);
    let dropped = limited(&server, "stray_closes_per_tunnel");
    println!(
        "hostile flood: {} stray packets; stray-close backlog {backlog} (bound {MAX_STRAY_CLOSES}); \
         answers dropped {dropped}; RSS before {rss_before} KiB, after {rss_after} KiB",
        ROUNDS * PER_ROUND * 5 + ROUNDS
    );
    // The backlog is full (entries older than 30 s may have been evicted
    // on a slow machine, making room for a few more answers).
    assert!(
        (1.0..=f64::from(MAX_STRAY_CLOSES)).contains(&backlog),
        "backlog {backlog}"
    );
    // 2 × 50,000 made-up ids, of which only a bounded few got an answer.
    assert!(dropped >= 90_000.0, "dropped {dropped}");
    // The flood cost the server no unbounded memory: the 80 MiB of huge
    // DATA and 250,000 packets left at most tens of MiB behind.
    assert!(
        rss_after.saturating_sub(rss_before) < 128 * 1024,
        "RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
    echo_round_trip(&client, &echo, 99).await;

    // A packet above --max-packet-size ends that agent's tunnel, counted.
    evil.to_server
        .send(packet::data(1, Bytes::from(vec![0u8; 17 * 1024 * 1024])))
        .await
        .unwrap();
    assert!(wait_until(STEP, || limited(&server, "packet_size") >= 1.0).await);
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    echo_round_trip(&client, &echo, 100).await;
    drop(evil);
    good.shutdown().await;
    server.shutdown().await;
}

#[tokio::test]
async fn tunnels_per_identity_and_pending_dials_per_tunnel_are_bounded() {
    let pki = TestPki::new(&["cluster-evil"]).unwrap();
    let mut config = test_server_config();
    config.max_tunnels_per_agent = 2;
    config.max_pending_dials_per_tunnel = 3;
    config.backend_dial_timeout = Duration::from_secs(60);
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let first = hostile(&pki, &server).await.unwrap();
    let _second = hostile(&pki, &server).await.unwrap();
    let Err(RawAgentError::Refused(status)) = hostile(&pki, &server).await else {
        panic!("a third tunnel of one identity was accepted");
    };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(
        status.message().contains("--max-tunnels-per-agent"),
        "{status:?}"
    );
    assert_eq!(limited(&server, "tunnels_per_agent"), 1.0);
    assert_eq!(server.tunnel_count(), 2);
    // Once one goes, its identity may connect again.
    drop(first);
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    let _third = hostile(&pki, &server).await.unwrap();

    // The agents never answer dials: three wait per tunnel, the next is refused.
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut waiting = Vec::new();
    for _ in 0..6 {
        let client = client.clone();
        waiting.push(tokio::spawn(
            async move { client.dial("cluster-evil:1").await },
        ));
    }
    let pending = "konnectivity_network_proxy_server_pending_backend_dials";
    assert!(wait_until(STEP, || metric(&server, pending) == Some(6.0)).await);
    let err = client.dial("cluster-evil:1").await.unwrap_err().to_string();
    assert!(err.contains("--max-pending-dials-per-tunnel"), "{err}");
    assert_eq!(limited(&server, "pending_dials_per_tunnel"), 1.0);
    assert_eq!(metric(&server, pending), Some(6.0));
    for dial in waiting {
        dial.abort();
    }
    server.shutdown().await;
}

#[tokio::test]
async fn a_proxy_stream_without_a_dial_request_is_ended() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.first_packet_timeout = Duration::from_millis(300);
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let channel = client_channel(&pki, &server).await;
    let (_to_server, rx) = tokio::sync::mpsc::channel::<Packet>(1);
    let response = ProxyServiceClient::new(channel)
        .proxy(ReceiverStream::new(rx))
        .await
        .unwrap();
    let mut from_server = response.into_inner();
    let end = tokio::time::timeout(STEP, from_server.message())
        .await
        .expect("the idle stream was never ended");
    assert!(matches!(end, Ok(None)), "{end:?}");
    assert_eq!(limited(&server, "first_packet_timeout"), 1.0);
    server.shutdown().await;
}

/// Routing safety: with identity binding on, `default` would hand a dial
/// for one cluster to whichever agent comes next, so the server refuses to
/// start with it unless told otherwise.
#[tokio::test]
async fn strategies_that_ignore_the_cluster_are_refused_at_startup_under_identity_binding() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.proxy_strategies = "destHost,default".into();
    let err = proxy_server::start_with_tls(config.clone(), pki.server_tls().unwrap())
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("--allow-cross-cluster-routing"), "{err}");
    config.allow_cross_cluster_routing = true;
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    server.shutdown().await;
}

/// Opens a raw `Proxy` stream on `channel`; returns the sender of the
/// client's packets and the server's response stream.
async fn proxy_stream(
    channel: tonic::transport::Channel,
) -> Result<(tokio::sync::mpsc::Sender<Packet>, tonic::Streaming<Packet>), tonic::Status> {
    let (to_server, rx) = tokio::sync::mpsc::channel::<Packet>(1024);
    let response = ProxyServiceClient::new(channel)
        .proxy(ReceiverStream::new(rx))
        .await?;
    Ok((to_server, response.into_inner()))
}

/// A client that keeps asking for replies (a second DIAL_REQ on an
/// established stream, answered with an error each time) and never reads
/// them loses its stream once its replies pile up, and costs the server no
/// more than the reply queue meanwhile.
#[tokio::test]
async fn a_client_that_never_reads_its_replies_loses_its_stream() {
    let pki = TestPki::new(&["cluster-evil"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let mut agent = hostile(&pki, &server).await.unwrap();
    let (to_server, from_server) =
        dial_raw(&mut agent, client_channel(&pki, &server).await, 1, 5).await;
    // Now ask again and again without reading: the server's answers fill
    // the HTTP/2 window, then its reply queue, and the stream ends.
    let flood = tokio::spawn(async move {
        for random in 2..1_000_000 {
            if to_server
                .send(packet::dial_request("cluster-evil:1", random))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    assert!(
        wait_until(STEP * 3, || limited(&server, "reply_queue") >= 1.0).await,
        "the reply queue never filled"
    );
    // The session ended, so the agent is asked to close the connection.
    assert_eq!(
        agent
            .recv(STEP)
            .await
            .map(cluster_proxy_proto::packet::Frame::from_packet),
        Some(cluster_proxy_proto::packet::Frame::CloseRequest { connect_id: 5 })
    );
    flood.abort();
    drop(from_server);
    server.shutdown().await;
}

/// `--max-concurrent-streams`: the server announces the limit, so a third
/// stream on one connection waits until one of the first two is gone.
#[tokio::test]
async fn streams_per_connection_are_bounded() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.max_concurrent_streams = 2;
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let channel = client_channel(&pki, &server).await;
    let first = proxy_stream(channel.clone()).await.unwrap();
    let _second = proxy_stream(channel.clone()).await.unwrap();
    let streams = "konnectivity_network_proxy_server_grpc_connections{service_method=\"Proxy\"}";
    assert!(wait_until(STEP, || metric(&server, streams) == Some(2.0)).await);
    let third = tokio::spawn(proxy_stream(channel));
    // Bounded wait for something that must not happen: the third stream
    // staying unopened is the bound holding.
    assert!(
        !wait_until(Duration::from_millis(500), || third.is_finished()).await,
        "a third stream opened beyond --max-concurrent-streams=2"
    );
    assert_eq!(metric(&server, streams), Some(2.0));
    drop(first);
    let third = tokio::time::timeout(STEP, third)
        .await
        .expect("the third stream never opened after one ended")
        .unwrap();
    assert!(third.is_ok(), "{:?}", third.err());
    server.shutdown().await;
}

/// The dial deadline covers queueing DIAL_REQ: an agent that stops reading
/// lets the tunnel's ordered lane fill, and a new dial through it then fails
/// after `--backend-dial-timeout` instead of waiting for room forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_through_a_tunnel_whose_lane_stays_full_times_out() {
    let pki = TestPki::new(&["cluster-evil"]).unwrap();
    let mut config = test_server_config();
    config.backend_dial_timeout = Duration::from_secs(1);
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let mut agent = hostile(&pki, &server).await.unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let first = {
        let client = client.clone();
        tokio::spawn(async move { client.dial("cluster-evil:1").await })
    };
    let Some(cluster_proxy_proto::packet::Frame::DialRequest { random, .. }) = agent
        .recv(STEP)
        .await
        .map(cluster_proxy_proto::packet::Frame::from_packet)
    else {
        panic!("expected DIAL_REQ");
    };
    agent
        .to_server
        .send(packet::dial_response_ok(random, 1))
        .await
        .unwrap();
    let mut stream = first.await.unwrap().unwrap();
    // From now on the agent reads nothing; the client writes far more
    // than the HTTP/2 windows and the lane hold.
    let writer = tokio::spawn(async move {
        let chunk = vec![0u8; 1024 * 1024];
        for _ in 0..256 {
            if stream.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let blocked =
        "konnectivity_network_proxy_server_full_receive_channels{service_method=\"Proxy\"}";
    assert!(
        wait_until(STEP * 3, || metric(&server, blocked) == Some(1.0)).await,
        "the client's writes never blocked on the tunnel"
    );
    // The lane is full for good once the server stops handing DATA to the
    // agent's stream (its HTTP/2 window is used up) while the writer waits.
    let to_agent = "konnectivity_network_proxy_server_stream_packets_total{segment=\"to_agent\",packet_type=\"DATA\"}";
    let mut settled = false;
    for _ in 0..60 {
        let sent = metric(&server, to_agent);
        if !wait_until(Duration::from_millis(500), || {
            metric(&server, to_agent) != sent
        })
        .await
            && metric(&server, blocked) == Some(1.0)
        {
            settled = true;
            break;
        }
    }
    assert!(settled, "the tunnel kept draining");
    let started = std::time::Instant::now();
    let err = tokio::time::timeout(STEP, client.dial("cluster-evil:2"))
        .await
        .expect("the dial waited for the full lane past its deadline")
        .unwrap_err()
        .to_string();
    assert!(err.contains("timed out"), "{err}");
    assert!(started.elapsed() < STEP, "{:?}", started.elapsed());
    writer.abort();
    drop(agent);
    server.shutdown().await;
}

/// Asks the agent for a connection on a raw `Proxy` stream and answers the
/// dial with `connect_id`; returns the client's ends of the stream.
async fn dial_raw(
    agent: &mut RawAgent,
    channel: tonic::transport::Channel,
    random: i64,
    connect_id: i64,
) -> (tokio::sync::mpsc::Sender<Packet>, tonic::Streaming<Packet>) {
    use cluster_proxy_proto::packet::Frame;
    let (to_server, mut from_server) = proxy_stream(channel).await.unwrap();
    to_server
        .send(packet::dial_request("cluster-evil:1", random))
        .await
        .unwrap();
    let dial = agent.recv(STEP).await.map(Frame::from_packet);
    assert!(
        matches!(dial, Some(Frame::DialRequest { random: r, .. }) if r == random),
        "expected DIAL_REQ {random}, got {dial:?}"
    );
    agent
        .to_server
        .send(packet::dial_response_ok(random, connect_id))
        .await
        .unwrap();
    let answer = tokio::time::timeout(STEP, from_server.message())
        .await
        .unwrap()
        .unwrap()
        .map(Frame::from_packet);
    assert!(
        matches!(answer, Some(Frame::DialResponse { connect_id: c, .. }) if c == connect_id),
        "expected DIAL_RSP for {connect_id}, got {answer:?}"
    );
    (to_server, from_server)
}

/// A decoded payload is a slice of the buffer HTTP/2 read it into. One byte
/// queued for a client that does not read, sent between large packets for a
/// connection that is read, must not keep the large packets' buffer alive:
/// the queue holds what its window counts, not 64 KiB per byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_bytes_queued_for_a_stalled_client_do_not_pin_the_buffers_they_arrived_in() {
    use cluster_proxy_proto::packet::Frame;
    let _alone = MEASURING_RSS.lock().await;
    let pki = TestPki::new(&["cluster-evil"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let mut agent = hostile(&pki, &server).await.unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    // The stalled client's HTTP/2 stream window is small, so little of what
    // the agent sends it leaves the server's queue.
    let stalled_channel = cluster_proxy_proto::transport::connect_channel_with(
        "localhost",
        server.client_addr.port(),
        pki.client_tls().unwrap(),
        STEP,
        cluster_proxy_proto::transport::HttpWindows {
            stream: 65_535,
            connection: 1 << 20,
        },
        None,
    )
    .await
    .unwrap();
    let (_stalled_requests, _stalled_replies) = dial_raw(&mut agent, stalled_channel, 1, 5).await;
    let reading_channel = client_channel(&pki, &server).await;
    let (_reading_requests, mut reading_replies) =
        dial_raw(&mut agent, reading_channel, 2, 6).await;
    const PAIRS: usize = 6_000;
    const LARGE: usize = 64 * 1024;
    let reader = tokio::spawn(async move {
        let mut received = 0;
        while received < PAIRS * LARGE {
            match reading_replies.message().await {
                Ok(Some(p)) => {
                    if let Frame::Data { data, .. } = Frame::from_packet(p) {
                        received += data.len();
                    }
                }
                _ => break,
            }
        }
        received
    });
    // Fill what lies between the stalled connection's queue and its client.
    for _ in 0..4 {
        agent
            .to_server
            .send(packet::data(5, Bytes::from(vec![1u8; LARGE])))
            .await
            .unwrap();
    }
    let rss_before = rss_kib();
    let large = Bytes::from(vec![2u8; LARGE]);
    for _ in 0..PAIRS {
        agent
            .to_server
            .send(packet::data(5, Bytes::from_static(b"x")))
            .await
            .unwrap();
        agent
            .to_server
            .send(packet::data(6, large.clone()))
            .await
            .unwrap();
    }
    // The server's tunnel reader handles packets in order: once the read
    // connection got everything, every single byte has been queued.
    let received = tokio::time::timeout(STEP * 6, reader)
        .await
        .expect("the read connection's data stopped")
        .unwrap();
    assert_eq!(received, PAIRS * LARGE);
    let rss_after = rss_kib();
    let grown_mib = rss_after.saturating_sub(rss_before) / 1024;
    println!(
        "{PAIRS} single bytes queued between {} MiB read: RSS {rss_before} → {rss_after} KiB",
        (PAIRS * LARGE) >> 20
    );
    // Pinned, each byte would hold its 64 KiB neighbour: 375 MiB. What
    // flows through the buffers on the way (window, HTTP/2 buffers, the
    // allocator's retention) stays below 32 MiB.
    assert!(
        grown_mib < 96,
        "RSS grew by {grown_mib} MiB while {PAIRS} bytes were queued"
    );
    server.shutdown().await;
}
