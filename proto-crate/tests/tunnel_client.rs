//! The Rust `TunnelClient` over its own HTTP/2 connection (`H2Channel`):
//! what a tonic `Channel` did for it, it must do too: connect again once
//! the server closed the connection, and end a stream whose tunneled
//! connection was dropped; and, beyond it, open again a stream the server
//! did not take (a GOAWAY's unprocessed stream, REFUSED_STREAM).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cluster_proxy_proto::client::TunnelClient;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::h2_frames::{
    self, ACK, GOAWAY, HEADERS, PING, RST_STREAM, SETTINGS, StandInIo, accept_preface, frame,
    read_frame_acking_settings,
};
use tunnel_harness::in_process::{AgentUnderTest, test_server_config, tunnel_client};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(10);

/// How a dial to `cluster-a:80` (no agent serves it) fails, within [`STEP`].
async fn dial_error(client: &TunnelClient) -> String {
    tokio::time::timeout(STEP, client.dial("cluster-a:80"))
        .await
        .expect("the dial ends")
        .expect_err("no agent serves cluster-a")
        .to_string()
}

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
    let err = dial_error(&client).await;
    assert!(err.contains("No agent available"), "{err}");

    // The server goes away (GOAWAY, then the connection closes) and another
    // takes its port.
    first.shutdown().await;
    let mut config = test_server_config();
    config.server_port = addr.port();
    let second = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let err = dial_error(&client).await;
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

/// How the stand-in's first connection answers the first stream.
#[derive(Clone, Copy, Debug)]
enum FirstAnswer {
    /// GOAWAY with last stream id 0: the stream was not processed.
    GoAwayBefore,
    /// RST_STREAM with REFUSED_STREAM.
    RefusedStream,
    /// GOAWAY with last stream id 1, then the connection closes: the
    /// stream was taken, and is not opened again.
    GoAwayAfter,
}

/// Accepts the client's connection and sends our SETTINGS: the server's
/// half of an HTTP/2 connection's start.
async fn h2_handshake(tls: &tokio_rustls::TlsAcceptor, tcp: tokio::net::TcpStream) -> StandInIo {
    let mut io = accept_preface(tls, tcp).await.unwrap();
    io.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    io
}

/// A stand-in for a server whose first connection does not take the first
/// stream (`answer`) and whose later connections are relayed to `server`.
/// Returns its address and the number of connections it accepted.
async fn refusing_first_stream(
    pki: &TestPki,
    server: std::net::SocketAddr,
    answer: FirstAnswer,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let tls = tokio_rustls::TlsAcceptor::from(pki.frontend_server_config().unwrap());
    let counted = accepted.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            if counted.fetch_add(1, Ordering::SeqCst) > 0 {
                tokio::spawn(async move {
                    let mut upstream = tokio::net::TcpStream::connect(server).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut tcp, &mut upstream).await;
                });
                continue;
            }
            let mut io = h2_handshake(&tls, tcp).await;
            while read_frame_acking_settings(&mut io).await.unwrap().kind != HEADERS {}
            let reply = match answer {
                // Last stream id, then the error code NO_ERROR.
                FirstAnswer::GoAwayBefore => frame(GOAWAY, 0, 0, &[0; 8]),
                FirstAnswer::GoAwayAfter => frame(GOAWAY, 0, 0, &[0, 0, 0, 1, 0, 0, 0, 0]),
                FirstAnswer::RefusedStream => frame(RST_STREAM, 0, 1, &[0, 0, 0, 0x7]),
            };
            io.write_all(&reply).await.unwrap();
            io.flush().await.unwrap();
            if !matches!(answer, FirstAnswer::RefusedStream) {
                let _ = io.shutdown().await;
            } else {
                // Held open: the client leaves it for a new connection.
                tokio::spawn(async move {
                    let mut sink = Vec::new();
                    let _ = io.read_to_end(&mut sink).await;
                });
            }
        }
    });
    (addr, accepted)
}

/// A dial racing a server's shutdown: the server's GOAWAY (or its
/// REFUSED_STREAM) says it never processed the stream, so the client opens
/// it again on a new connection and the dial reaches a server that takes
/// it, instead of failing.
#[tokio::test]
async fn a_stream_the_server_did_not_take_is_opened_again_on_a_new_connection() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    for answer in [FirstAnswer::RefusedStream, FirstAnswer::GoAwayBefore] {
        let (addr, accepted) = refusing_first_stream(&pki, server.client_addr, answer).await;
        let client = tunnel_client(pki.client_tls().unwrap(), addr)
            .await
            .unwrap();
        let err = dial_error(&client).await;
        assert!(
            err.contains("No agent available"),
            "{answer:?}: the real server answers the dial opened again: {err}"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "{answer:?}");
    }
    server.shutdown().await;
}

/// A stream at or below the GOAWAY's last stream id was taken by the
/// server: it fails with the connection, and is not dialed twice.
#[tokio::test]
async fn a_stream_the_server_took_is_not_opened_again() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let (addr, accepted) =
        refusing_first_stream(&pki, server.client_addr, FirstAnswer::GoAwayAfter).await;
    let client = tunnel_client(pki.client_tls().unwrap(), addr)
        .await
        .unwrap();
    let err = dial_error(&client).await;
    assert!(!err.contains("No agent available"), "{err}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    // The next dial gets a new connection, and the server.
    let err = dial_error(&client).await;
    assert!(err.contains("No agent available"), "{err}");
    server.shutdown().await;
}

/// `H2Channel::connect_with`'s keepalive: with no dial open, the client
/// pings the server after each idle interval; answered pings keep the
/// connection, and one unanswered for `PING_TIMEOUT` (20 s) drops it (the
/// next dial then makes a new one, as after any close).
#[tokio::test]
async fn the_keepalive_pings_an_idle_connection_and_drops_it_when_unanswered() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tls = tokio_rustls::TlsAcceptor::from(pki.frontend_server_config().unwrap());
    let (events, mut observed) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut io = h2_handshake(&tls, tcp).await;
        let mut answered = 0;
        loop {
            let frame = read_frame_acking_settings(&mut io).await.unwrap();
            if frame.kind != PING || frame.flags & ACK != 0 {
                continue;
            }
            if answered < 3 {
                io.write_all(&h2_frames::frame(PING, ACK, 0, &frame.payload))
                    .await
                    .unwrap();
                answered += 1;
                events.send("answered").unwrap();
            } else {
                events.send("unanswered").unwrap();
                break;
            }
        }
        // From here nothing is answered: wait for the client to close.
        let mut rest = Vec::new();
        let _ = io.read_to_end(&mut rest).await;
        events.send("closed").unwrap();
    });
    let channel = cluster_proxy_proto::h2_channel::H2Channel::connect_with(
        "localhost",
        addr.port(),
        pki.client_tls().unwrap(),
        STEP,
        cluster_proxy_proto::transport::CLIENT_WINDOWS,
        Some(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    for expected in ["answered", "answered", "answered", "unanswered"] {
        let event = tokio::time::timeout(STEP, observed.recv()).await;
        assert_eq!(
            event,
            Ok(Some(expected)),
            "an idle connection is pinged at each interval on the same connection"
        );
    }
    let closed = tokio::time::timeout(
        cluster_proxy_proto::h2_driver::PING_TIMEOUT + STEP,
        observed.recv(),
    )
    .await;
    assert_eq!(
        closed,
        Ok(Some("closed")),
        "an unanswered ping drops the connection"
    );
    drop(channel);
}
