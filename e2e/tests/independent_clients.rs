//! Clients no one here wrote reach a target through our server and agent:
//! a Python grpcio client generated at test time from proto-crate's `.proto`
//! files, and curl as an HTTP CONNECT client.
//!
//! Without python/grpcio or curl these tests skip loudly; under `CI=true` a
//! missing tool fails them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use e2e::harness::{AgentUnderTest, test_server_config, wait_until};
use e2e::pki::TestPki;
use e2e::targets::{HttpServer, closed_port};

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
    let generated = tempfile::tempdir().unwrap();
    let proto_dir = workspace_dir().join("proto-crate/proto");
    let out = Command::new(&python)
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto_dir)
        .arg(format!("--python_out={}", generated.path().display()))
        .arg(format!("--grpc_python_out={}", generated.path().display()))
        .arg(proto_dir.join("konnectivity/client.proto"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "protoc: {}",
        String::from_utf8_lossy(&out.stderr)
    );

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
