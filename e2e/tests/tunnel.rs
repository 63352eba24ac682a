//! The data plane end to end on loopback: a real server, real agents and real
//! targets over real mTLS, reached through both frontends.

use std::time::Duration;

use cluster_proxy_proto::transport::ALPN_HTTP11;
use proxy_server::RunningServer;
use simulated_cluster::targets::{EchoServer, closed_port};
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{
    AgentUnderTest, health_get, http_connect, http_connect_over, test_server_config, tunnel_client,
};
use tunnel_harness::loadgen::{BulkServer, download, echo_intact, pattern, request_download};
use tunnel_harness::pki::TestPki;

const LONG: Duration = Duration::from_secs(120);

async fn setup(clusters: &[&str]) -> (TestPki, RunningServer, Vec<AgentUnderTest>) {
    let pki = TestPki::new(clusters).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let mut agents = Vec::new();
    for cluster in clusters {
        agents.push(
            AgentUnderTest::start(&pki, cluster, server.agent_addr, &[(cluster, "127.0.0.1")])
                .await
                .unwrap(),
        );
    }
    assert!(
        wait_until(Duration::from_secs(10), || server.tunnel_count()
            == clusters.len())
        .await
    );
    (pki, server, agents)
}

#[tokio::test]
async fn echo_through_both_frontends_addressed_by_cluster_name() {
    let (pki, server, _agents) = setup(&["cluster-a", "cluster-b"]).await;
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    for cluster in ["cluster-a", "cluster-b"] {
        let mut s = client
            .dial(&format!("{cluster}:{}", echo.addr.port()))
            .await
            .unwrap();
        s.write_all(format!("hello {cluster}").as_bytes())
            .await
            .unwrap();
        let mut buf = vec![0u8; 6 + cluster.len()];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, format!("hello {cluster}").as_bytes());

        let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
        let mut s = http_connect(
            tls,
            server.client_addr,
            &format!("{cluster}:{}", echo.addr.port()),
        )
        .await
        .unwrap();
        s.write_all(b"via connect").await.unwrap();
        let mut buf = [0u8; 11];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"via connect");
    }
    server.shutdown().await;
}

#[tokio::test]
async fn moves_256_mib_each_way_intact() {
    let (pki, server, _agents) = setup(&["cluster-a"]).await;
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let stream = client
        .dial(&format!("cluster-a:{}", echo.addr.port()))
        .await
        .unwrap();
    echo_intact(stream, 256 * 1024 * 1024, LONG).await;
    server.shutdown().await;
}

#[tokio::test]
async fn a_thousand_concurrent_connections() {
    let (pki, server, _agents) = setup(&["cluster-a"]).await;
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let address = format!("cluster-a:{}", echo.addr.port());
    let mut tasks = Vec::new();
    for i in 0..1000u32 {
        let client = client.clone();
        let address = address.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = client.dial(&address).await.unwrap();
            let msg = format!("connection {i} {}", "x".repeat(1000));
            s.write_all(msg.as_bytes()).await.unwrap();
            let mut buf = vec![0u8; msg.len()];
            s.read_exact(&mut buf).await.unwrap();
            assert_eq!(buf, msg.as_bytes());
            s
        }));
    }
    let mut open = Vec::new();
    for t in tasks {
        open.push(tokio::time::timeout(LONG, t).await.unwrap().unwrap());
    }
    assert_eq!(server.connection_count(), 1000);
    drop(open);
    assert!(wait_until(Duration::from_secs(20), || server.connection_count() == 0).await);
    server.shutdown().await;
}

#[tokio::test]
async fn early_data_reaches_the_target_through_a_real_agent() {
    let (pki, server, _agents) = setup(&["cluster-a"]).await;
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    // A small first write, and one larger than a dial request carries
    // (the rest follows as DATA): each comes back whole and in order.
    for size in [1, cluster_proxy_proto::client::MAX_EARLY_DATA * 3 + 17] {
        let first = pattern(size);
        let mut stream = client
            .dial_with_early_data(
                &format!("cluster-a:{}", echo.addr.port()),
                bytes::Bytes::from(first.clone()),
            )
            .await
            .unwrap();
        stream.write_all(b"after").await.unwrap();
        let mut back = vec![0u8; size + 5];
        tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&back[..size], &first[..], "{size} bytes of early data");
        assert_eq!(&back[size..], b"after");
    }
    // A dial that fails reports the agent's error, early data or not.
    let port = closed_port().await.unwrap().port();
    let err = client
        .dial_with_early_data(
            &format!("cluster-a:{port}"),
            bytes::Bytes::from_static(b"GET /"),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("connection refused"), "{err}");
    server.shutdown().await;
}

/// The agent drives its tunnel's HTTP/2 connection itself; one that stops
/// ends its stream (END_STREAM) before closing the connection, so the
/// server sees the agent leave, not a broken stream.
#[tokio::test]
async fn an_agent_that_stops_ends_its_stream_cleanly() {
    let (pki, server, mut agents) = setup(&["cluster-a"]).await;
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut s = client
        .dial(&format!("cluster-a:{}", echo.addr.port()))
        .await
        .unwrap();
    s.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).await.unwrap();
    drop(s);
    if let Some(agent) = agents.pop() {
        agent.shutdown().await;
    }
    assert!(wait_until(Duration::from_secs(10), || server.tunnel_count() == 0).await);
    let (status, metrics) = health_get(server.health_addr, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    let broken: Vec<_> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("konnectivity_network_proxy_server_stream_errors_total")
                && l.contains(r#"segment="from_agent""#)
        })
        .collect();
    assert!(broken.is_empty(), "the agent's stream broke: {broken:?}");
}

#[tokio::test]
async fn dial_to_a_closed_port_reports_the_agents_error() {
    let (pki, server, _agents) = setup(&["cluster-a"]).await;
    let port = closed_port().await.unwrap().port();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let err = client
        .dial(&format!("cluster-a:{port}"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!(
            "dial tcp 127.0.0.1:{port}: connect: connection refused"
        )),
        "{err}"
    );
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let err = http_connect(tls, server.client_addr, &format!("cluster-a:{port}"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("502") && err.contains("connection refused"),
        "{err}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn killed_agent_closes_connections_and_fails_dials_at_once() {
    let (pki, server, mut agents) = setup(&["cluster-a"]).await;
    let bulk = BulkServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut s = client
        .dial(&format!("cluster-a:{}", bulk.addr.port()))
        .await
        .unwrap();
    // Start a transfer far larger than can finish, then kill the agent mid-way.
    let transfer = tokio::spawn(async move { download(&mut s, 64 * 1024 * 1024 * 1024).await });
    assert!(
        wait_until(Duration::from_secs(30), || bulk.bytes_sent() >= 1024 * 1024).await,
        "the transfer never started"
    );
    agents.pop().unwrap().kill();
    let result = tokio::time::timeout(Duration::from_secs(10), transfer)
        .await
        .expect("client hung")
        .unwrap();
    assert!(result.is_err(), "transfer should have been cut short");
    assert!(wait_until(Duration::from_secs(10), || server.tunnel_count() == 0).await);
    let started = std::time::Instant::now();
    let err = client
        .dial(&format!("cluster-a:{}", bulk.addr.port()))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("No agent available"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
    server.shutdown().await;
}

#[tokio::test]
async fn a_stalled_reader_does_not_slow_other_connections() {
    let (pki, server, _agents) = setup(&["cluster-a"]).await;
    let bulk = BulkServer::start().await.unwrap();
    let address = format!("cluster-a:{}", bulk.addr.port());
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    const SIZE: u64 = 64 * 1024 * 1024;
    // Connection A asks for 64 MiB and then does not read at all.
    let mut stalled = client.dial(&address).await.unwrap();
    request_download(&mut stalled, SIZE).await.unwrap();
    // Before the others start, A's whole path (target socket, agent,
    // tunnel, server, client stream) is full: the target can write no more.
    let mut last = (0u64, std::time::Instant::now());
    let full = wait_until(Duration::from_secs(30), || {
        let sent = bulk.bytes_sent();
        if sent != last.0 {
            last = (sent, std::time::Instant::now());
        }
        sent > 0 && last.1.elapsed() >= Duration::from_millis(200)
    })
    .await;
    assert!(
        full && bulk.bytes_sent() < SIZE,
        "the unread download never filled its path: the target sent {} of {SIZE} bytes",
        bulk.bytes_sent()
    );
    // Connections B (gRPC) and C (HTTP CONNECT) on the same tunnel move 64 MiB each meanwhile.
    let mut fast = client.dial(&address).await.unwrap();
    tokio::time::timeout(LONG, download(&mut fast, SIZE))
        .await
        .expect("gRPC transfer stalled")
        .unwrap();
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let mut fast = http_connect(tls, server.client_addr, &address)
        .await
        .unwrap();
    tokio::time::timeout(LONG, download(&mut fast, SIZE))
        .await
        .expect("CONNECT transfer stalled")
        .unwrap();
    // A was only paused: it still receives every byte once it reads.
    let mut buf = vec![0u8; 1024 * 1024];
    let mut got = 0u64;
    tokio::time::timeout(LONG, async {
        while got < SIZE {
            let n = stalled.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got += n as u64;
        }
    })
    .await
    .expect("stalled connection never resumed");
    server.shutdown().await;
}

/// Regression (found with `agents_scale`): the CONNECT relay wrote each
/// agent DATA into the client's TLS stream without flushing it. When the
/// client's socket was full, the TLS layer kept the last bytes of a burst in
/// its own buffer, and nothing wrote them out until the next DATA arrived or
/// the connection closed: a response's tail hung for as long as the target
/// stayed quiet. Bursts of 24 MiB to a client with a small receive buffer
/// outgrow the server's socket buffers (`tcp_wmem` max: 4 MiB), so the
/// socket is often full when a burst's last bytes are written: without the
/// flush, about one run in two hung in one of the 12 rounds.
#[tokio::test]
async fn connect_delivers_the_tail_of_a_burst_to_a_slow_reader() {
    let (pki, server, _agents) = setup(&["cluster-a"]).await;
    let bulk = BulkServer::start().await.unwrap();
    let address = format!("cluster-a:{}", bulk.addr.port());
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let tcp = socket.connect(server.client_addr).await.unwrap();
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let mut stream = http_connect_over(tls, tcp, "localhost", &address)
        .await
        .unwrap();
    // The bulk target keeps the connection open after each answer, so only
    // the relay's own flush can bring the last bytes out. A slow machine
    // only slows the reads; the bug stops them for good.
    const BURST: u64 = 24 * 1024 * 1024 + 7;
    let mut buf = vec![0u8; 64 * 1024];
    for round in 0..12 {
        request_download(&mut stream, BURST).await.unwrap();
        let mut left = BURST;
        while left > 0 {
            let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
            let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf[..want]))
                .await
                .unwrap_or_else(|_| {
                    panic!("round {round}: no byte for 10 s with {left} bytes of the burst to come")
                })
                .unwrap();
            assert!(
                n > 0,
                "round {round}: the stream ended with {left} bytes to come"
            );
            left -= n as u64;
        }
    }
    server.shutdown().await;
}

/// Regression: connections whose reader stopped must not stop the other
/// connections of their client's HTTP/2 connection. Their unread bytes hold
/// the connection-level window too; with 16 MiB stream windows in a 32 MiB
/// connection window, four stalled readers held all of it, and every other
/// stream on that connection, new dials included, stood still.
#[tokio::test]
async fn stalled_readers_leave_their_client_connection_usable() {
    let (pki, server, _agents) = setup(&["cluster-a"]).await;
    let bulk = BulkServer::start().await.unwrap();
    let address = format!("cluster-a:{}", bulk.addr.port());
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    const ENDLESS: u64 = 1 << 40;
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut s = client.dial(&address).await.unwrap();
        request_download(&mut s, ENDLESS).await.unwrap();
        stalled.push(s);
    }
    // The stalled streams fill their windows within a fraction of a second;
    // dials and transfers keep going on the same connection all that time
    // and well after.
    for round in 0..50 {
        let mut fast = tokio::time::timeout(Duration::from_secs(10), client.dial(&address))
            .await
            .unwrap_or_else(|_| panic!("round {round}: the dial stalled"))
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), download(&mut fast, 256 * 1024))
            .await
            .unwrap_or_else(|_| panic!("round {round}: the transfer stalled"))
            .unwrap();
    }
    drop(stalled);
    server.shutdown().await;
}

/// Our clients (and agents, through the same `connect_channel_with`) tell
/// the server they take HTTP/2 frames of `MAX_FRAME_SIZE`, so a DATA
/// packet's payload reaches them in one frame and is decoded in place
/// rather than arriving in 16 KiB pieces that are joined by a copy.
#[tokio::test]
async fn our_clients_accept_large_http2_frames() {
    use cluster_proxy_proto::transport::{MAX_FRAME_SIZE, connect_channel};
    use tunnel_harness::h2_frames::{SETTINGS, accept_preface, read_frame};

    const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(pki.frontend_server_config().unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let client = tokio::spawn(connect_channel(
        "localhost",
        port,
        pki.client_tls().unwrap(),
        Duration::from_secs(10),
    ));
    let first_frame = tokio::time::timeout(Duration::from_secs(10), async {
        let (tcp, _) = listener.accept().await?;
        let mut tls = accept_preface(&acceptor, tcp).await?;
        let frame = read_frame(&mut tls).await?;
        Ok::<_, std::io::Error>((frame.kind, frame.payload))
    })
    .await
    .expect("the client's preface within 10 s")
    .unwrap();
    client.abort();
    let (kind, settings) = first_frame;
    assert_eq!(kind, SETTINGS, "the preface is followed by SETTINGS");
    let max_frame_size = settings
        .chunks_exact(6)
        .find(|entry| u16::from_be_bytes([entry[0], entry[1]]) == SETTINGS_MAX_FRAME_SIZE)
        .map(|entry| u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]));
    assert_eq!(
        max_frame_size,
        Some(MAX_FRAME_SIZE),
        "settings: {settings:?}"
    );
}
