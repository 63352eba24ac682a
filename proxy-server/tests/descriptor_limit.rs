//! The proxy-server binary at its open-file limit: lowered to 64 on the
//! running process with `prlimit(1)`, then exceeded with held client
//! connections. Every port must refuse a connection beyond the limit at
//! once (its client sees the connection end, rather than waiting in the
//! listen queue until its own timeout), without a busy loop; the episode is
//! logged once with the limit and counted; once connections close, the
//! server serves again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_proxy_proto::transport::ALPN_HTTP11;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tunnel_harness::in_process::{ServerPorts, health_get, proxy_server_args};
use tunnel_harness::loadgen::process_usage;
use tunnel_harness::pki::TestPki;

const LIMIT: usize = 64;
/// Longest a connection may take to be served or refused.
const ANSWER: Duration = Duration::from_secs(5);

enum Attempt {
    Served(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    Refused,
}

/// A TLS handshake with `port`: finished, or the connection ended.
async fn handshake(tls: &Arc<rustls::ClientConfig>, port: u16) -> Attempt {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the listen queue takes the connection");
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let handshake = tokio_rustls::TlsConnector::from(tls.clone()).connect(name, tcp);
    match tokio::time::timeout(ANSWER, handshake).await {
        Ok(Ok(stream)) => Attempt::Served(Box::new(stream)),
        Ok(Err(_)) => Attempt::Refused,
        Err(_) => panic!(
            "port {port}: the connection was neither served nor refused within {ANSWER:?}: at its open-file limit the server must refuse, not leave clients waiting"
        ),
    }
}

/// A plain-HTTP request to `port` that must end without an answer.
async fn refused_http(port: u16) {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let _ = tcp
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut answer = Vec::new();
    match tokio::time::timeout(ANSWER, tcp.read_to_end(&mut answer)).await {
        Ok(_) => assert!(answer.is_empty(), "port {port} answered at the limit"),
        Err(_) => panic!("port {port}: no refusal within {ANSWER:?}"),
    }
}

fn counter(metrics: &str, name: &str, labels: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l.contains(labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn at_its_open_file_limit_the_server_refuses_without_spinning_and_serves_again() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let layout = pki.write(dir.path()).unwrap();
    let ports = ServerPorts::free();
    let log = dir.path().join("server.log");
    let mut server = tokio::process::Command::new(env!("CARGO_BIN_EXE_proxy-server"))
        .args(proxy_server_args("fd-limit", &ports, &layout))
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = server.id().unwrap();
    let health = SocketAddr::from(([127, 0, 0, 1], ports.health));
    let started = Instant::now();
    while health_get(health, "/healthz").await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no health port"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &pid.to_string(),
            &format!("--nofile={LIMIT}:{LIMIT}"),
        ])
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(status.success(), "prlimit lowered the limit");

    // Exceed it: held client connections until one is refused.
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let mut held = Vec::new();
    loop {
        match handshake(&tls, ports.client).await {
            Attempt::Served(stream) => held.push(stream),
            Attempt::Refused => break,
        }
        assert!(held.len() <= LIMIT, "no refusal after {LIMIT} connections");
    }
    assert!(
        held.len() > LIMIT / 2,
        "refused early, with {} connections held",
        held.len()
    );

    // Every port refuses, and a saturated second costs the server next to
    // no CPU: a refused connection every 50 ms (a measured window, each
    // attempt waited on until it is refused).
    let agent_tls = pki.agent_tls("cluster-a").unwrap();
    assert!(matches!(
        handshake(&agent_tls, ports.agent).await,
        Attempt::Refused
    ));
    refused_http(ports.health).await;
    refused_http(ports.admin).await;
    let cpu_before = process_usage(pid).unwrap().cpu_seconds;
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(1) {
        assert!(matches!(
            handshake(&tls, ports.client).await,
            Attempt::Refused
        ));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu = process_usage(pid).unwrap().cpu_seconds - cpu_before;
    let wall = window.elapsed().as_secs_f64();
    assert!(
        cpu < 0.25 * wall,
        "the server took {cpu:.2} s of CPU in {wall:.2} s at its limit: a busy loop"
    );
    assert!(
        server.try_wait().unwrap().is_none(),
        "the server is running"
    );

    // Descriptors free up: the server serves again.
    drop(held);
    let freed = Instant::now();
    loop {
        if let Attempt::Served(_) = handshake(&tls, ports.client).await {
            break;
        }
        assert!(
            freed.elapsed() < Duration::from_secs(10),
            "not serving 10 s after descriptors freed up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(matches!(
        handshake(&agent_tls, ports.agent).await,
        Attempt::Served(_)
    ));
    let (status, _) = health_get(health, "/healthz").await.unwrap();
    assert_eq!(status, 200);
    let (_, metrics) = health_get(health, "/metrics").await.unwrap();
    for port in ["client", "agent", "health", "admin"] {
        let labels = format!("port=\"{port}\"");
        assert!(
            counter(
                &metrics,
                "cluster_proxy_server_accept_refused_total",
                &labels
            ) >= 1.0,
            "refusals on the {port} port counted:\n{metrics}"
        );
        assert!(
            counter(
                &metrics,
                "cluster_proxy_server_accept_errors_total",
                &format!("{labels},reason=\"process_open_file_limit\"")
            ) >= 1.0,
            "failed accepts on the {port} port counted:\n{metrics}"
        );
    }

    // Logged once per port and episode, with the limit; and its end.
    let text = std::fs::read_to_string(&log).unwrap();
    let starts: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("cannot accept connections"))
        .collect();
    assert!(!starts.is_empty(), "the episode is logged:\n{text}");
    // Once per port and episode: no second start line before the port's
    // end line. (A port may have a second episode: while the server is
    // still closing the dropped connections, it can run out again.)
    for port in ["client", "agent", "health", "admin"] {
        let field = format!("port=\"{port}\"");
        let mut in_episode = false;
        for line in text.lines().filter(|l| l.contains(&field)) {
            if line.contains("cannot accept connections") {
                assert!(
                    !in_episode,
                    "port {port}: logged twice in one episode:\n{text}"
                );
                in_episode = true;
            } else if line.contains("accepting connections again") {
                in_episode = false;
            }
        }
    }
    assert!(
        starts
            .iter()
            .all(|l| l.contains(&format!("open_file_limit={LIMIT}"))),
        "the log names the limit:\n{text}"
    );
    assert!(
        text.contains("accepting connections again"),
        "the episode's end is logged:\n{text}"
    );
    assert!(
        server.try_wait().unwrap().is_none(),
        "the server is running"
    );
    let _ = server.kill().await;
}
