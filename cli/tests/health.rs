//! `cluster-proxy health` against the in-memory hub API: golden output for
//! fixed objects and a fixed "now", and live probes through in-process
//! proxy-servers and agents.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use cert_authority::pki::{Authority, LeafRequest};
use cluster_proxy_cli::health::{self, OutputFormat};
use common::{Hub, Tunnel, run, strings};
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use simulated_cluster::targets::{TcpTarget, closed_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NOW: &str = "2026-03-01T12:00:00Z";

fn condition(type_: &str, status: &str, reason: &str, message: &str, time: &str) -> Value {
    json!({
        "type": type_, "status": status, "reason": reason,
        "message": message, "lastTransitionTime": time,
    })
}

fn available(status: &str) -> Value {
    condition(
        "Available",
        status,
        "ManagedClusterAddOnLeaseUpdated",
        "cluster-proxy add-on is available.",
        "2026-02-01T00:00:00Z",
    )
}

/// Five clusters covering every state the table distinguishes.
async fn scripted_hub() -> Hub {
    let hub = Hub::start().await;
    for name in [
        "cluster-e",
        "cluster-a",
        "cluster-c",
        "cluster-b",
        "cluster-d",
    ] {
        hub.cluster(name).await;
    }
    hub.addon(
        "cluster-a",
        json!([
            available("True"),
            condition(
                "ClusterProxyReachable",
                "True",
                "Reachable",
                "replicas=2/2 latency_ms=3 dial_ms=1 tls_ms=1 first_byte_ms=1 status=200",
                "2026-03-01T11:57:40Z",
            ),
        ]),
    )
    .await;
    hub.addon(
        "cluster-b",
        json!([
            available("True"),
            condition(
                "ClusterProxyReachable",
                "False",
                "Degraded",
                r#"replicas=1/2 latency_ms=12 dial_ms=8 tls_ms=2 first_byte_ms=2 status=200 failing=10.0.0.2:8090 error="10.0.0.2:8090: dial: no agent connected""#,
                "2026-03-01T09:00:00Z",
            ),
        ]),
    )
    .await;
    hub.addon(
        "cluster-c",
        json!([
            available("False"),
            condition(
                "ClusterProxyReachable",
                "False",
                "Unreachable",
                r#"replicas=0/2 status=500 failing=a:8090,b:8090 error="a:8090: /healthz answered 500""#,
                "2026-02-20T12:00:00Z",
            ),
        ]),
    )
    .await;
    // Installed, not yet reported on; cluster-e has no addon at all.
    hub.addon("cluster-d", json!([])).await;
    hub
}

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

/// Compares with `tests/golden/<name>`; `UPDATE_GOLDEN=1` rewrites it.
fn assert_golden(name: &str, actual: &str) {
    let path = golden_path(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
    assert_eq!(
        actual, expected,
        "{name} differs from the golden file (UPDATE_GOLDEN=1 rewrites it)"
    );
}

#[tokio::test]
async fn stored_results_print_as_the_golden_files() {
    let hub = scripted_hub().await;
    let url = "https://hub";
    let now: Timestamp = NOW.parse().unwrap();
    let report = health::collect(&hub.client, url, now).await.unwrap();
    let names: Vec<&str> = report.clusters.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "cluster-a",
            "cluster-b",
            "cluster-c",
            "cluster-d",
            "cluster-e"
        ]
    );
    for (format, file) in [
        (OutputFormat::Table, "health.table.txt"),
        (OutputFormat::Wide, "health.wide.txt"),
        (OutputFormat::Json, "health.json"),
        (OutputFormat::Yaml, "health.yaml"),
    ] {
        assert_golden(file, &health::render(&report, format).unwrap());
    }

    // The binary prints the same, given the same clock.
    let kubeconfig = hub.kubeconfig().display().to_string();
    for (format, file) in [("table", "health.table.txt"), ("json", "health.json")] {
        let output = run(&strings(&[
            "health",
            "--kubeconfig",
            &kubeconfig,
            "--now",
            NOW,
            "-o",
            format,
        ]))
        .await;
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8(output.stdout).unwrap();
        let golden = std::fs::read_to_string(golden_path(file)).unwrap();
        assert_eq!(stdout, golden, "cluster-proxy health -o {format}");
    }
}

/// An HTTPS stand-in for the clusters' kube-apiservers answering `ok`.
async fn apiserver(names: &[&str]) -> TcpTarget {
    let ca = Authority::generate("test apiserver CA", Duration::from_secs(3600)).unwrap();
    let leaf = ca
        .issue(&LeafRequest::server("kube-apiserver", names))
        .unwrap();
    let acceptor =
        simulated_cluster::sample::tls_acceptor(&leaf.cert_pem, &leaf.key_pem, &[b"http/1.1"])
            .unwrap();
    TcpTarget::serve(move |socket| {
        let acceptor = acceptor.clone();
        async move {
            let Ok(mut tls) = acceptor.accept(socket).await else {
                return;
            };
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match tls.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let response = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
            let _ = tls.write_all(response.as_bytes()).await;
            let _ = tls.shutdown().await;
        }
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_goes_through_every_proxy_server_with_the_hub_secret() {
    let tunnel = Tunnel::start(&["cluster-a", "cluster-b", "cluster-c"], 2).await;
    // cluster-a through both replicas, cluster-b through the first only,
    // cluster-c not at all.
    let _a0 = tunnel.agent("cluster-a", 0).await;
    let _a1 = tunnel.agent("cluster-a", 1).await;
    let _b0 = tunnel.agent("cluster-b", 0).await;
    let target = apiserver(&["cluster-a", "cluster-b", "cluster-c"]).await;
    let hub = Hub::start().await;
    for name in ["cluster-a", "cluster-b", "cluster-c"] {
        hub.cluster(name).await;
        hub.addon(name, json!([available("True")])).await;
    }
    // No credential flags: the CLI reads the proxy-client Secret, as clusteradm does.
    hub.proxy_client_secret(&tunnel, "proxy-system").await;
    let kubeconfig = hub.kubeconfig().display().to_string();
    let port = target.addr.port().to_string();
    let mut args = strings(&[
        "health",
        "--kubeconfig",
        &kubeconfig,
        "--probe",
        "--target-port",
        &port,
        "--timeout",
        "5s",
    ]);
    let base = args.clone();
    let (first, second) = (tunnel.client_address(0), tunnel.client_address(1));
    args.extend(["--proxy-server".into(), first.clone()]);
    args.extend(["--proxy-server".into(), second.clone()]);

    let mut json_args = args.clone();
    json_args.extend(strings(&["-o", "json"]));
    let output = run(&json_args).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["probed"], true);
    assert_eq!(report["proxyServers"], json!([first, second]));
    let probe = |index: usize| report["clusters"][index]["probe"].clone();
    assert_eq!(report["clusters"][0]["name"], "cluster-a");
    assert_eq!(probe(0)["healthy"], true, "{report:#}");
    assert_eq!(probe(0)["reason"], "Reachable");
    assert_eq!(probe(0)["replicas"], "2/2");
    assert_eq!(probe(0)["status"], 200);
    assert!(probe(0)["latencyMs"].as_f64().unwrap() > 0.0);
    assert!(probe(0)["dialMs"].as_f64().is_some());
    assert_eq!(probe(1)["healthy"], false);
    assert_eq!(probe(1)["reason"], "Degraded");
    assert_eq!(probe(1)["replicas"], "1/2");
    let error = probe(1)["error"].as_str().unwrap().to_owned();
    assert!(
        error.starts_with(&second) && error.contains("no agent"),
        "{error}"
    );
    assert_eq!(probe(2)["reason"], "Unreachable");
    assert_eq!(probe(2)["replicas"], "0/2");
    assert!(probe(2).get("latencyMs").is_none());

    let output = run(&args).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8(output.stdout).unwrap();
    let cells = |cluster: &str| -> Vec<String> {
        table
            .lines()
            .find(|line| line.starts_with(cluster))
            .unwrap_or_else(|| panic!("no row for {cluster}:\n{table}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    // CLUSTER NAME, INSTALLED, AVAILABLE, PROBED HEALTH, LATENCY, then the stored columns.
    let a = cells("cluster-a");
    assert_eq!(a[1..4], ["true", "true", "true"], "{table}");
    assert!(a[4].ends_with("ms"), "{table}");
    assert_eq!(cells("cluster-b")[3..5], ["false", "<none>"], "{table}");
    assert_eq!(cells("cluster-c")[3..5], ["false", "<none>"], "{table}");

    // A proxy-server that cannot be connected makes every cluster degraded, named.
    let closed = format!("localhost:{}", closed_port().await.unwrap().port());
    let mut one_down = base;
    one_down.extend(["--proxy-server".into(), first.clone()]);
    one_down.extend(["--proxy-server".into(), closed.clone()]);
    one_down.extend(strings(&["-o", "json"]));
    let output = run(&one_down).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot connect to proxy-server"),
        "{stderr}"
    );
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    let probe = &report["clusters"][0]["probe"];
    assert_eq!(probe["reason"], "Degraded", "{report:#}");
    assert_eq!(probe["replicas"], "1/2");
    let error = probe["error"].as_str().unwrap();
    assert!(error.starts_with(&closed), "{error}");
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
    let hub = Hub::start().await;
    hub.cluster("cluster-a").await;
    hub.proxy_client_secret(&tunnel, "proxy-system").await;
    let kubeconfig = hub.kubeconfig().display().to_string();

    let closed = closed_port().await.unwrap();
    let dead_hub = hub
        .api
        .kubeconfigs(Some(closed))
        .write("someone", &[])
        .unwrap()
        .display()
        .to_string();
    fails_saying(
        strings(&["health", "--kubeconfig", &dead_hub]),
        &format!("cannot list ManagedClusters on the hub at https://{closed}"),
    )
    .await;
    fails_saying(
        strings(&["health", "--kubeconfig", "/nonexistent/kubeconfig"]),
        "/nonexistent/kubeconfig",
    )
    .await;
    // The hint names the namespace of the hub's ManagedProxyConfiguration.
    fails_saying(
        strings(&["health", "--kubeconfig", &kubeconfig, "--probe"]),
        "kubectl -n proxy-system port-forward service/proxy-entrypoint 8090:8090",
    )
    .await;
    let mut expired = strings(&["health", "--kubeconfig", &kubeconfig, "--probe"]);
    expired.extend(["--proxy-server".into(), tunnel.client_address(0)]);
    expired.extend(tunnel.expired_credential_flags());
    fails_saying(expired, "certificate is not valid now").await;
    let closed = format!("localhost:{}", closed_port().await.unwrap().port());
    fails_saying(
        strings(&[
            "health",
            "--kubeconfig",
            &kubeconfig,
            "--probe",
            "--proxy-server",
            &closed,
        ]),
        &format!("cannot connect to proxy-server {closed}"),
    )
    .await;
    fails_saying(
        strings(&["health", "--kubeconfig", &kubeconfig, "-o", "xml"]),
        "invalid value 'xml'",
    )
    .await;
    fails_saying(
        strings(&[
            "health",
            "--kubeconfig",
            &kubeconfig,
            "--probe",
            "--proxy-server",
            "localhost:0",
        ]),
        "is not a port",
    )
    .await;
}
