//! `/metrics` of the server and the agent after a scripted workload, as a
//! Prometheus scraper without an OpenMetrics `Accept` sees them: the names,
//! types, labels and HELP texts dashboards and alerts built on upstream rely
//! on, and the values the workload must leave. Timing-dependent values are
//! left out: histogram sums, and the counts of buckets (their `le`
//! boundaries stay, as do the `_count`s).
//!
//! The golden files are `e2e/tests/golden/metrics_{server,agent}.txt`; after
//! an intended change, regenerate them with `CLUSTER_PROXY_BLESS=1`.

use std::time::Duration;

use simulated_cluster::targets::{EchoServer, closed_port};
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{AgentUnderTest, test_server_config, tunnel_client};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(10);

/// GET `/metrics` with `accept` (if any); returns the content type and body.
async fn scrape(addr: std::net::SocketAddr, accept: Option<&str>) -> (String, String) {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    tcp.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{accept}Connection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut response = String::new();
    tokio::time::timeout(STEP, tcp.read_to_string(&mut response))
        .await
        .unwrap()
        .unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let content_type = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type: ")
                .map(str::to_owned)
        })
        .unwrap_or_default();
    // hyper answers `Connection: close` requests with a plain body here.
    (content_type, body.to_owned())
}

/// The exposition without the timing-dependent samples, with each
/// family's samples sorted (prometheus-client keeps labelled samples in a
/// hash map, so their order varies from run to run).
fn stable(text: &str) -> String {
    let mut out = String::new();
    let mut samples: Vec<&str> = Vec::new();
    let flush = |samples: &mut Vec<&str>, out: &mut String| {
        samples.sort_unstable();
        for sample in samples.drain(..) {
            out.push_str(sample);
            out.push('\n');
        }
    };
    for line in text.lines() {
        if line.starts_with('#') {
            flush(&mut samples, &mut out);
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        if name.ends_with("_bucket") {
            // The bucket boundaries (`le`) are part of the contract; how
            // many dials fell into each is timing.
            samples.push(line.rsplit_once(' ').map_or(line, |(series, _)| series));
        } else if !name.ends_with("_sum") {
            samples.push(line);
        }
    }
    flush(&mut samples, &mut out);
    out
}

fn check_golden(file: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(file);
    if std::env::var_os("CLUSTER_PROXY_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (CLUSTER_PROXY_BLESS=1 writes it)", path.display()));
    if expected != actual {
        let diff: Vec<String> = expected
            .lines()
            .zip(actual.lines())
            .filter(|(e, a)| e != a)
            .map(|(e, a)| format!("- {e}\n+ {a}"))
            .take(10)
            .collect();
        panic!(
            "{file} differs (expected {} lines, got {}):\n{}\n\nactual:\n{actual}",
            expected.lines().count(),
            actual.lines().count(),
            diff.join("\n")
        );
    }
}

#[tokio::test]
async fn metrics_after_a_scripted_workload_match_the_golden_files() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
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
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);
    let agent_health = agent.agent().unwrap().health_addr();
    assert!(
        wait_until(STEP, || agent.agent().is_some_and(|a| a
            .metrics()
            .open_server_connections
            .get()
            == 1))
        .await
    );

    // The workload: one echo round trip, one dial the agent cannot make,
    // one dial to a cluster no agent serves.
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut stream = client
        .dial(&format!("cluster-a:{}", echo.addr.port()))
        .await
        .unwrap();
    stream.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    stream.read_exact(&mut buf).await.unwrap();
    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(STEP, stream.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    drop(stream);
    let refused = closed_port().await.unwrap();
    assert!(
        client
            .dial(&format!("cluster-a:{}", refused.port()))
            .await
            .is_err()
    );
    assert!(client.dial("cluster-z:443").await.is_err());
    assert!(wait_until(STEP, || server.connection_count() == 0).await);
    // A Proxy stream's gauge drops when its task ends, just after the client
    // has its answer.
    assert!(
        wait_until(STEP, || server
            .metrics_text()
            .contains("grpc_connections{service_method=\"Proxy\"} 0"))
        .await
    );
    assert!(
        wait_until(STEP, || agent.agent().is_some_and(|a| a
            .metrics()
            .open_endpoint_connections
            .get()
            == 0))
        .await
    );

    let (server_type, server_text) = scrape(server.health_addr, None).await;
    let (agent_type, agent_text) = scrape(agent_health, None).await;
    assert_eq!(server_type, "text/plain; version=0.0.4; charset=utf-8");
    assert_eq!(agent_type, server_type);
    check_golden("metrics_server.txt", &stable(&server_text));
    check_golden("metrics_agent.txt", &stable(&agent_text));

    // OpenMetrics only on request.
    let (om_type, om_text) = scrape(
        server.health_addr,
        Some("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3"),
    )
    .await;
    assert!(
        om_type.starts_with("application/openmetrics-text"),
        "{om_type}"
    );
    assert!(om_text.ends_with("# EOF\n"), "{om_text}");
    server.shutdown().await;
}
