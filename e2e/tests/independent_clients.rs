//! Clients no one here wrote reach a target through our server and agent:
//! a Python grpcio client generated at test time from proto-crate's `.proto`
//! files, and curl as an HTTP CONNECT client. And an agent no one here wrote
//! (Python grpcio, gRPC's C core HTTP/2) serves a dial through our server's
//! agent port.
//!
//! Without python/grpcio or curl these tests skip loudly; under `CI=true` a
//! missing tool fails them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use simulated_cluster::targets::{HttpServer, closed_port};
use simulated_cluster::wait::wait_until;
use tunnel_harness::in_process::{AgentUnderTest, test_server_config};
use tunnel_harness::pki::TestPki;

const BODY: &str = "hello from inside cluster-a\n";

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Reports a missing tool: a failure under CI, a loud skip elsewhere.
fn missing(tool: &str, why: &str) {
    if under_ci() {
        panic!("{tool} is required under CI=true but unavailable: {why}");
    }
    eprintln!("SKIPPED: {tool} unavailable ({why}); run .ci/run or install it to run this test");
}

fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_dir().join("target"), PathBuf::from)
}

/// The grpcio venv under target/, created on first use.
fn python_with_grpcio() -> Result<PathBuf, String> {
    let venv = target_dir().join("py-venv");
    let python = venv.join("bin/python");
    let has_grpc = |p: &Path| {
        Command::new(p)
            .args(["-c", "import grpc, grpc_tools"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if python.exists() && has_grpc(&python) {
        return Ok(python);
    }
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .map_err(|e| format!("python3: {e}"))?;
    if !status.success() {
        return Err("python3 -m venv failed".into());
    }
    let requirements = workspace_dir().join("e2e/tests/python/requirements.txt");
    let status = Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(requirements)
        .status()
        .map_err(|e| format!("pip: {e}"))?;
    if !status.success() || !has_grpc(&python) {
        return Err("pip install grpcio grpcio-tools failed".into());
    }
    Ok(python)
}

/// Python modules for konnectivity's `.proto` files, generated with grpcio-tools.
fn python_stubs(python: &Path) -> tempfile::TempDir {
    let generated = tempfile::tempdir().unwrap();
    let proto_dir = workspace_dir().join("proto-crate/proto");
    let out = Command::new(python)
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto_dir)
        .arg(format!("--python_out={}", generated.path().display()))
        .arg(format!("--grpc_python_out={}", generated.path().display()))
        .arg(proto_dir.join("konnectivity/client.proto"))
        .arg(proto_dir.join("konnectivity/agent.proto"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "protoc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    generated
}

/// A server and an agent of `cluster-a` with PEM files on disk for the
/// external clients, an HTTP target and a port nothing listens on.
struct Setup {
    certs: tempfile::TempDir,
    server: proxy_server::RunningServer,
    _agent: AgentUnderTest,
    target: HttpServer,
    refused: std::net::SocketAddr,
}

async fn setup() -> Setup {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let certs = tempfile::tempdir().unwrap();
    pki.write(certs.path()).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let agent = AgentUnderTest::start(
        &pki,
        "cluster-a",
        server.agent_addr,
        &[("cluster-a", "127.0.0.1")],
    )
    .await
    .unwrap();
    assert!(wait_until(Duration::from_secs(10), || server.tunnel_count() == 1).await);
    Setup {
        certs,
        server,
        _agent: agent,
        target: HttpServer::start(BODY).await.unwrap(),
        refused: closed_port().await.unwrap(),
    }
}

#[tokio::test]
async fn python_grpcio_client_reaches_a_target_through_the_tunnel() {
    let python = match python_with_grpcio() {
        Ok(p) => p,
        Err(why) => return missing("python grpcio", &why),
    };
    let generated = python_stubs(&python);

    let Setup {
        certs,
        server,
        _agent,
        target,
        refused,
    } = setup().await;

    let run = |address: String| {
        let python = python.clone();
        let script = workspace_dir().join("e2e/tests/python/konnectivity_client.py");
        let gen_dir = generated.path().to_owned();
        let layout = cert_authority::files::Layout::new(certs.path());
        let server = format!("localhost:{}", server.client_addr.port());
        tokio::task::spawn_blocking(move || {
            Command::new(python)
                .arg(script)
                .arg(gen_dir)
                .arg(server)
                .arg(layout.bundle())
                .arg(layout.proxy_client().cert)
                .arg(layout.proxy_client().key)
                .arg(address)
                .output()
                .unwrap()
        })
    };
    let ok = run(format!("cluster-a:{}", target.addr.port()))
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(stdout.starts_with("HTTP/1.1 200 OK"), "{stdout}");
    assert!(stdout.ends_with(BODY), "{stdout}");

    let failed = run(format!("cluster-a:{}", refused.port())).await.unwrap();
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success());
    assert!(stderr.contains("connect: connection refused"), "{stderr}");
    server.shutdown().await;
}

#[tokio::test]
async fn curl_reaches_a_target_with_http_connect() {
    if Command::new("curl").arg("--version").output().is_err() {
        return missing("curl", "not on PATH");
    }
    let Setup {
        certs,
        server,
        _agent,
        target,
        refused,
    } = setup().await;

    let curl = |url: String| {
        let layout = cert_authority::files::Layout::new(certs.path());
        let proxy = format!("https://localhost:{}", server.client_addr.port());
        tokio::task::spawn_blocking(move || {
            Command::new("curl")
                .args([
                    "--silent",
                    "--show-error",
                    "--max-time",
                    "20",
                    "--proxytunnel",
                    "--proxy",
                ])
                .arg(proxy)
                .arg("--proxy-cacert")
                .arg(layout.bundle())
                .arg("--proxy-cert")
                .arg(layout.proxy_client().cert)
                .arg("--proxy-key")
                .arg(layout.proxy_client().key)
                .arg(url)
                .output()
                .unwrap()
        })
    };
    let ok = curl(format!("http://cluster-a:{}/", target.addr.port()))
        .await
        .unwrap();
    assert!(
        ok.status.success(),
        "curl: {}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&ok.stdout), BODY);

    let failed = curl(format!("http://cluster-a:{}/", refused.port()))
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success());
    assert!(stderr.contains("502"), "{stderr}");

    let no_agent = curl("http://cluster-z:80/".into()).await.unwrap();
    assert!(String::from_utf8_lossy(&no_agent.stderr).contains("500"));
    server.shutdown().await;
}

/// The Python agent of `cluster` claiming `identifiers`, started.
fn python_agent(
    python: &Path,
    generated: &Path,
    layout: &cert_authority::files::Layout,
    cluster: &str,
    server: std::net::SocketAddr,
    identifiers: &str,
) -> std::process::Child {
    let cluster = cluster_proxy_proto::identity::ClusterName::new(cluster).unwrap();
    Command::new(python)
        .arg(workspace_dir().join("e2e/tests/python/konnectivity_agent.py"))
        .arg(generated)
        .arg(format!("localhost:{}", server.port()))
        .arg(layout.bundle())
        .arg(layout.agent(&cluster).cert)
        .arg(layout.agent(&cluster).key)
        .arg("python-agent")
        .arg(identifiers)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

#[tokio::test]
async fn python_grpcio_agent_serves_a_dial_through_our_agent_port() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let python = match python_with_grpcio() {
        Ok(p) => p,
        Err(why) => return missing("python grpcio", &why),
    };
    let generated = python_stubs(&python);
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let certs = tempfile::tempdir().unwrap();
    let layout = pki.write(certs.path()).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let target = HttpServer::start(BODY).await.unwrap();

    // Claiming another cluster's identifiers: refused, and told why.
    let refused = python_agent(
        &python,
        generated.path(),
        &layout,
        "cluster-b",
        server.agent_addr,
        "host=cluster-a",
    );
    let refused = tokio::task::spawn_blocking(move || refused.wait_with_output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("refused: PERMISSION_DENIED")
            && stderr.contains("does not belong to cluster \"cluster-b\""),
        "{stderr}"
    );
    assert_eq!(server.tunnel_count(), 0);

    let mut agent = python_agent(
        &python,
        generated.path(),
        &layout,
        "cluster-b",
        server.agent_addr,
        "host=cluster-b",
    );
    let stdout = agent.stdout.take().unwrap();
    let answer = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).map(|_| line)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        answer.trim(),
        format!("serverid={} servercount=1", server.server_id),
        "the agent read the server's headers"
    );
    assert!(wait_until(Duration::from_secs(10), || server.tunnel_count() == 1).await);

    let client =
        tunnel_harness::in_process::tunnel_client(pki.client_tls().unwrap(), server.client_addr)
            .await
            .unwrap();
    let mut stream = client
        .dial(&format!("cluster-b:{}", target.addr.port()))
        .await
        .unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: cluster-b\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        stream.read_to_string(&mut response),
    )
    .await
    .expect("the response within 20 s")
    .unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    assert!(response.ends_with(BODY), "{response}");

    // The agent ends its stream after the dial; the server ends its side
    // with an OK status, which is what the agent waits for to exit 0.
    let done = tokio::task::spawn_blocking(move || agent.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(
        done.status.success(),
        "agent: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(wait_until(Duration::from_secs(10), || server.tunnel_count() == 0).await);
    server.shutdown().await;
}
