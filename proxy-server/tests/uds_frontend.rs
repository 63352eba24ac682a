//! `--uds-name`: the client frontend on a Unix socket, without TLS, as
//! upstream serves kube-apiserver's egress selector. gRPC and HTTP CONNECT
//! both reach an agent's target through it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cluster_proxy_proto::client::TunnelClient;
use hyper_util::rt::TokioIo;
use proxy_server::{RunningServer, ServerError};
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tunnel_harness::in_process::{AgentUnderTest, test_server_config};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(10);

async fn server(
    pki: &TestPki,
    socket: &Path,
    delete_existing: bool,
) -> Result<RunningServer, ServerError> {
    let mut config = test_server_config();
    config.uds_name = socket.display().to_string();
    config.delete_existing_uds_file = delete_existing;
    proxy_server::start_with_tls(config, pki.server_tls().unwrap()).await
}

struct Setup {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    server: RunningServer,
    _agent: AgentUnderTest,
    echo: EchoServer,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("konnectivity-server.socket");
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let server = server(&pki, &socket, true).await.unwrap();
    assert_eq!(server.client_socket.as_deref(), Some(socket.as_path()));
    let agent = AgentUnderTest::start(
        &pki,
        "cluster-a",
        server.agent_addr,
        &[("cluster-a", "127.0.0.1")],
    )
    .await
    .unwrap();
    assert!(
        wait_until(STEP, || server.tunnel_count() > 0).await,
        "the agent did not connect"
    );
    let echo = EchoServer::start().await.unwrap();
    Setup {
        _dir: dir,
        socket,
        server,
        _agent: agent,
        echo,
    }
}

async fn echoes<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(stream: &mut S) {
    stream.write_all(b"through the socket").await.unwrap();
    let mut back = [0u8; 18];
    tokio::time::timeout(STEP, stream.read_exact(&mut back))
        .await
        .expect("the echo came back")
        .unwrap();
    assert_eq!(&back, b"through the socket");
}

#[tokio::test]
async fn http_connect_over_the_unix_socket() {
    let setup = setup().await;
    let target = format!("cluster-a:{}", setup.echo.addr.port());
    let mut stream = UnixStream::connect(&setup.socket).await.unwrap();
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(
            stream.read(&mut byte).await.unwrap(),
            1,
            "closed after {head:?}"
        );
        head.push(byte[0]);
    }
    assert_eq!(head, b"HTTP/1.1 200 Connection Established\r\n\r\n");
    echoes(&mut stream).await;
    setup.server.shutdown().await;
}

#[tokio::test]
async fn grpc_over_the_unix_socket() {
    let setup = setup().await;
    let socket = setup.socket.clone();
    // The authority is not used: the connector always dials the socket.
    let channel = tonic::transport::Endpoint::from_static("http://konnectivity-server")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let socket = socket.clone();
            async move { UnixStream::connect(socket).await.map(TokioIo::new) }
        }))
        .await
        .unwrap();
    let client = TunnelClient::new(channel);
    let mut stream = client
        .dial(&format!("cluster-a:{}", setup.echo.addr.port()))
        .await
        .unwrap();
    echoes(&mut stream).await;
    setup.server.shutdown().await;
}

#[tokio::test]
async fn an_existing_file_is_replaced_or_named() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("stale.socket");
    std::fs::write(&socket, b"left by a crashed server").unwrap();
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let err = server(&pki, &socket, false)
        .await
        .err()
        .expect("an existing file is an error");
    let text = err.to_string();
    assert!(
        text.contains("stale.socket") && text.contains("--uds-name"),
        "{text}"
    );
    let server = server(&pki, &socket, true)
        .await
        .expect("--delete-existing-uds-file replaces it");
    UnixStream::connect(&socket)
        .await
        .expect("the new socket listens");
    server.shutdown().await;
}
