//! `cluster-proxy port-forward` through in-process proxy-servers and agents.

mod common;

use std::process::Stdio;
use std::time::Duration;

use cluster_proxy_cli::address::ForwardTarget;
use cluster_proxy_cli::forward::PortForward;
use cluster_proxy_proto::connector::TunnelConnector;
use common::{Tunnel, WAIT, run, strings};
use simulated_cluster::targets::free_port;
use simulated_cluster::targets::{EchoServer, HttpServer, closed_port};
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tunnel_harness::in_process::tunnel_client;

/// Sends `size` patterned bytes and reads them back at the same time (an
/// echo only keeps up if both directions flow), then half-closes and
/// expects the end of the stream.
async fn echo_round_trip(address: std::net::SocketAddr, size: usize, seed: u8) {
    let stream = TcpStream::connect(address).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let sent: Vec<u8> = (0..size)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let expected = sent.clone();
    let write = tokio::spawn(async move {
        writer.write_all(&sent).await.unwrap();
        writer
    });
    let mut received = vec![0u8; size];
    tokio::time::timeout(WAIT, reader.read_exact(&mut received))
        .await
        .expect("the echo did not come back in time")
        .unwrap();
    assert!(received == expected, "the echo differs from what was sent");
    let mut writer = write.await.unwrap();
    writer.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(WAIT, reader.read_to_end(&mut rest))
        .await
        .expect("no end of stream after the half-close");
    assert!(read.is_ok() && rest.is_empty(), "{read:?} {rest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_carries_an_echo_and_stops_on_sigterm() {
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let _agent = tunnel.agent("cluster-a", 0).await;
    let echo = EchoServer::start().await.unwrap();
    let port = free_port();
    let mut args = strings(&["port-forward"]);
    args.push(format!("cluster-a:{}", echo.addr.port()));
    args.push(port.to_string());
    args.extend(["--proxy-server".into(), tunnel.client_address(0)]);
    args.extend(tunnel.credential_flags());
    // Tokio's single-threaded scheduler: everything below on one thread.
    args.push("--worker-threads=1".into());
    let mut child = tokio::process::Command::new(common::BIN)
        .args(&args)
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(WAIT, stdout.next_line())
        .await
        .expect("no address printed")
        .unwrap()
        .unwrap_or_default();
    assert_eq!(
        line,
        format!(
            "Forwarding from 127.0.0.1:{port} -> cluster-a:cluster-a:{}",
            echo.addr.port()
        )
    );
    let local = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    // Concurrent connections, each with more than the tunnel's windows in flight.
    tokio::join!(
        echo_round_trip(local, 4 << 20, 1),
        echo_round_trip(local, 4 << 20, 2),
        echo_round_trip(local, 1, 3),
    );

    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("port-forward did not stop on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// A GET sent at once after connecting; the response up to the target's close.
async fn http_get_until_close(local: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(local).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: cluster-a\r\n\r\n")
        .await
        .unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut response))
        .await
        .expect("the target's close did not reach the client")
        .unwrap();
    String::from_utf8_lossy(&response).into_owned()
}

/// A forward from a free local port to `cluster:port` through `tunnel`.
async fn forward_to(tunnel: &Tunnel, cluster: &str, port: u16) -> PortForward {
    let target = ForwardTarget::parse(&format!("{cluster}:{port}")).unwrap();
    PortForward::bind(
        "127.0.0.1:0".parse().unwrap(),
        connector(tunnel).await,
        target,
    )
    .await
    .unwrap()
}

async fn connector(tunnel: &Tunnel) -> TunnelConnector {
    let client = tunnel_client(
        tunnel.pki.client_tls().unwrap(),
        tunnel.servers[0].client_addr,
    )
    .await
    .unwrap();
    TunnelConnector::new(client, Duration::from_secs(5))
}

#[tokio::test]
async fn a_failed_connection_leaves_the_listener_serving() {
    let tunnel = Tunnel::start(&["cluster-b"], 1).await;
    let echo = EchoServer::start().await.unwrap();
    let forward = forward_to(&tunnel, "cluster-b", echo.addr.port()).await;
    let local = forward.local_addr().unwrap();
    let stats = forward.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(forward.run(async {
        let _ = stopped.await;
    }));

    // No agent serves cluster-b yet: the connection is closed, nothing else.
    let mut early = TcpStream::connect(local).await.unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(WAIT, early.read_to_end(&mut buf))
        .await
        .expect("a failed dial must close the local connection");
    assert!(buf.is_empty(), "{read:?}");
    assert!(
        wait_until(WAIT, || stats
            .failed
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1)
        .await
    );

    let _agent = tunnel.agent("cluster-b", 0).await;
    echo_round_trip(local, 256 << 10, 7).await;
    assert!(!running.is_finished());
    stop.send(()).unwrap();
    tokio::time::timeout(WAIT, running)
        .await
        .expect("the listener did not stop")
        .unwrap();
    assert!(TcpStream::connect(local).await.is_err());
}

#[tokio::test]
async fn a_target_that_closes_first_ends_the_local_connection_after_its_data() {
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let _agent = tunnel.agent("cluster-a", 0).await;
    let http = HttpServer::start("hello through the tunnel").await.unwrap();
    let forward = forward_to(&tunnel, "cluster-a", http.addr.port()).await;
    let local = forward.local_addr().unwrap();
    let running = tokio::spawn(forward.run(std::future::pending()));
    for _ in 0..3 {
        let response = http_get_until_close(local).await;
        assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
        assert!(response.ends_with("hello through the tunnel"), "{response}");
    }
    running.abort();
}

fn forward_args(target: &str, local: &str, extra: &[String]) -> Vec<String> {
    let mut args = strings(&["port-forward", target, local]);
    args.extend_from_slice(extra);
    args
}

async fn fails_saying(args: Vec<String>, expected: &str) {
    let output = run(&args).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{args:?} succeeded: {stderr}");
    assert!(
        stderr.contains(expected),
        "{args:?}: stderr does not say {expected:?}:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?} panicked:\n{stderr}");
}

#[tokio::test]
async fn bad_input_fails_with_a_clear_error() {
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let server = ["--proxy-server".to_owned(), tunnel.client_address(0)];
    let with_files = |extra: &[String]| {
        let mut flags = tunnel.credential_flags();
        flags.extend_from_slice(extra);
        flags
    };
    fails_saying(
        forward_args("Not_A_Cluster:443", "0", &with_files(&server)),
        "is not a cluster name",
    )
    .await;
    fails_saying(
        forward_args("cluster-a:443", "host:port", &with_files(&server)),
        "LOCAL_ADDR:LOCAL_PORT",
    )
    .await;
    fails_saying(
        forward_args("cluster-a:65536", "0", &with_files(&server)),
        "is not a port",
    )
    .await;
    for (count, complaint) in [("1025", "more than 1024"), ("two", "is not a thread count")] {
        let mut flags = with_files(&server);
        flags.extend(["--worker-threads".into(), count.into()]);
        fails_saying(forward_args("cluster-a:443", "0", &flags), complaint).await;
    }
    fails_saying(
        forward_args(
            "cluster-a:443",
            "0",
            &with_files(&strings(&["--proxy-server", "no-port"])),
        ),
        "is not HOST:PORT",
    )
    .await;
    // Without an address: how to reach the hub's proxy-server.
    fails_saying(
        forward_args(
            "cluster-a:443",
            "0",
            &with_files(&strings(&["--kubeconfig", "/nonexistent/kubeconfig"])),
        ),
        "kubectl -n open-cluster-management-addon port-forward service/proxy-entrypoint 8090:8090",
    )
    .await;
    let closed = closed_port().await.unwrap();
    fails_saying(
        forward_args(
            "cluster-a:443",
            "0",
            &with_files(&[
                "--proxy-server".into(),
                format!("localhost:{}", closed.port()),
            ]),
        ),
        "cannot connect to proxy-server",
    )
    .await;
    // Without credential flags they come from the hub, which must have them.
    let hub = common::Hub::start().await;
    let kubeconfig = hub.kubeconfig().display().to_string();
    let mut from_hub = strings(&["--kubeconfig", &kubeconfig]);
    from_hub.extend_from_slice(&server);
    fails_saying(
        forward_args("cluster-a:443", "0", &from_hub),
        "ManagedProxyConfiguration \"cluster-proxy\" not found on the hub",
    )
    .await;
    let dead_hub = hub
        .api
        .kubeconfigs(Some(closed_port().await.unwrap()))
        .write("someone", &[])
        .unwrap()
        .display()
        .to_string();
    let mut from_dead_hub = strings(&["--kubeconfig", &dead_hub]);
    from_dead_hub.extend_from_slice(&server);
    fails_saying(
        forward_args("cluster-a:443", "0", &from_dead_hub),
        "cannot read ManagedProxyConfiguration \"cluster-proxy\" from the hub",
    )
    .await;
    let mut expired = tunnel.expired_credential_flags();
    expired.extend_from_slice(&server);
    fails_saying(
        forward_args("cluster-a:443", "0", &expired),
        "certificate is not valid now",
    )
    .await;
    fails_saying(
        forward_args(
            "cluster-a:443",
            "0",
            &[
                "--proxy-cert".into(),
                tunnel.layout.proxy_client().cert.display().to_string(),
            ],
        ),
        "missing: --proxy-ca-cert, --proxy-key",
    )
    .await;
}

#[tokio::test]
async fn first_bytes_ride_with_the_dial_and_a_server_that_speaks_first_still_works() {
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let _agent = tunnel.agent("cluster-a", 0).await;

    // A client that speaks first: its request goes with the dial. The wait
    // is long here so that a loaded machine cannot make the count flaky.
    let http = HttpServer::start("hello early").await.unwrap();
    let forward = forward_to(&tunnel, "cluster-a", http.addr.port())
        .await
        .with_early_data_wait(WAIT);
    let local = forward.local_addr().unwrap();
    let stats = forward.stats();
    let running = tokio::spawn(forward.run(std::future::pending()));
    for _ in 0..3 {
        let response = http_get_until_close(local).await;
        assert!(response.ends_with("hello early"), "{response}");
    }
    assert_eq!(
        stats.early_data.load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    running.abort();

    // A server that speaks first: the dial goes once the wait is over.
    let banner = simulated_cluster::targets::TcpTarget::serve(|mut socket| async move {
        if socket.write_all(b"220 ready\r\n").await.is_ok() {
            let (mut r, mut w) = socket.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        }
    })
    .await
    .unwrap();
    let forward = forward_to(&tunnel, "cluster-a", banner.addr.port())
        .await
        .with_early_data_wait(Duration::from_millis(50));
    let local = forward.local_addr().unwrap();
    let stats = forward.stats();
    let running = tokio::spawn(forward.run(std::future::pending()));
    let mut stream = BufReader::new(TcpStream::connect(local).await.unwrap());
    let mut line = String::new();
    tokio::time::timeout(WAIT, stream.read_line(&mut line))
        .await
        .expect("no banner")
        .unwrap();
    assert_eq!(line, "220 ready\r\n");
    stream.get_mut().write_all(b"after").await.unwrap();
    let mut echoed = [0u8; 5];
    tokio::time::timeout(WAIT, stream.read_exact(&mut echoed))
        .await
        .expect("no echo")
        .unwrap();
    assert_eq!(&echoed, b"after");
    assert_eq!(
        stats.early_data.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    running.abort();
}
