//! OpenTelemetry traces of tunneled connections, received by an in-process
//! OTLP collector (a tonic `TraceService` from the published protos).
//!
//! One process-wide subscriber exports to the collector, so everything runs
//! in one test: the client's, the server's and the agent's spans of a
//! connection share a trace and link parent to child through the wire
//! (gRPC metadata, CONNECT headers, the negotiated DialRequest field); a
//! failed dial carries the agent's error; an agent that did not ask for trace
//! context gets plain konnectivity dial requests; with the collector gone,
//! connections still work.

use std::net::SocketAddr;
use std::time::Duration;

use cluster_proxy_proto::konnectivity::agent_service_client::AgentServiceClient;
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::packet::{self, Frame};
use cluster_proxy_proto::transport::{ALPN_HTTP11, connect_channel};
use cluster_proxy_runtime::logging::LogFormat;
use cluster_proxy_runtime::telemetry::{self, SamplerChoice, TelemetryConfig};
use prost::Message;
use simulated_cluster::otlp::{Collector, Received, WAIT};
use simulated_cluster::targets::{EchoServer, closed_port};
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tunnel_harness::child::{ChildTunnel, ChildTunnelOptions};
use tunnel_harness::in_process::{AgentUnderTest, RawAgent, test_server_config, tunnel_client};
use tunnel_harness::pki::TestPki;

fn attr<'a>(span: &'a Received, key: &str) -> &'a str {
    span.attributes
        .get(key)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("{} has no attribute {key}: {span:#?}", span.name))
}

/// An agent connection that advertises the trace-context extension, driven
/// packet by packet.
async fn tracing_raw_agent(pki: &TestPki, agent_addr: SocketAddr, cluster: &str) -> RawAgent {
    let channel = connect_channel(
        "localhost",
        agent_addr.port(),
        pki.agent_tls(cluster).unwrap(),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let (to_server, rx) = mpsc::channel(64);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    let md = request.metadata_mut();
    md.insert(
        metadata::AGENT_ID,
        format!("{cluster}-raw").parse().unwrap(),
    );
    md.insert(
        metadata::AGENT_IDENTIFIERS,
        format!("host={cluster}").parse().unwrap(),
    );
    md.insert(
        metadata::TRACE_CONTEXT,
        metadata::TRACE_CONTEXT_W3C.parse().unwrap(),
    );
    let response = AgentServiceClient::new(channel)
        .connect(request)
        .await
        .unwrap();
    let headers = response.metadata().clone();
    RawAgent {
        to_server,
        from_server: response.into_inner(),
        headers,
    }
}

async fn next_dial_request(agent: &mut RawAgent) -> cluster_proxy_proto::Packet {
    loop {
        let p = agent.recv(WAIT).await.expect("a packet from the server");
        if matches!(Frame::from_packet(p.clone()), Frame::DialRequest { .. }) {
            return p;
        }
    }
}

/// CONNECT with a `traceparent` header; returns the stream after the `200`.
async fn http_connect_traced(
    pki: &TestPki,
    server: SocketAddr,
    target: &str,
    traceparent: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(server).await.unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap())
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    stream
        .write_all(
            format!(
                "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\ntraceparent: {traceparent}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    stream.flush().await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(stream.read(&mut byte).await.unwrap(), 1, "response head");
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&head)
    );
    stream
}

async fn echo_once(
    client: &cluster_proxy_proto::client::TunnelClient,
    target: &str,
    message: &[u8],
) {
    let mut stream = client.dial(target).await.unwrap();
    stream.write_all(message).await.unwrap();
    let mut back = vec![0u8; message.len()];
    stream.read_exact(&mut back).await.unwrap();
    assert_eq!(back, message);
    stream.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_per_tunneled_connection() {
    let (collector, collector_addr, stop_collector) = Collector::start().await.unwrap();
    let config = TelemetryConfig {
        endpoint: Some(format!("http://{collector_addr}")),
        sampler: SamplerChoice::AlwaysOn,
        ..TelemetryConfig::off("e2e-traces")
    };
    let telemetry = telemetry::init(0, LogFormat::Text, &config).unwrap();
    assert!(telemetry.exporting());

    let pki = TestPki::new(&["cluster-a", "cluster-b", "cluster-c"]).unwrap();
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
    assert!(wait_until(WAIT, || server.tunnel_count() == 1).await);
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();

    // 1. A gRPC connection: client → server → agent, one trace.
    echo_once(
        &client,
        &format!("cluster-a:{}", echo.addr.port()),
        b"hello",
    )
    .await;
    let dial = collector.wait_for("tunnel.dial", |_| true).await;
    let connection = collector
        .wait_for("tunnel.connection", |s| s.trace_id == dial.trace_id)
        .await;
    let agent_dial = collector
        .wait_for("agent.dial", |s| s.trace_id == dial.trace_id)
        .await;
    assert_eq!(
        connection.parent_span_id, dial.span_id,
        "server span is the client's child"
    );
    assert_eq!(
        agent_dial.parent_span_id, connection.span_id,
        "agent span is the server's child"
    );
    assert_eq!(attr(&connection, "cluster_proxy.cluster"), "cluster-a");
    assert_eq!(
        attr(&connection, "cluster_proxy.agent_id"),
        "cluster-a-agent"
    );
    assert_eq!(attr(&connection, "cluster_proxy.strategy"), "destHost");
    assert_eq!(attr(&connection, "cluster_proxy.frontend"), "grpc");
    assert_eq!(attr(&connection, "server.address"), "cluster-a");
    assert_eq!(attr(&connection, "cluster_proxy.bytes_to_agent"), "5");
    assert_eq!(attr(&connection, "cluster_proxy.bytes_from_agent"), "5");
    assert_eq!(
        attr(&connection, "cluster_proxy.end_reason"),
        "client_close"
    );
    assert_eq!(attr(&connection, "client.address"), "127.0.0.1");
    assert!(!attr(&connection, "cluster_proxy.client_identity").is_empty());
    assert!(!attr(&connection, "cluster_proxy.server_id").is_empty());
    assert!(
        attr(&connection, "cluster_proxy.dial_latency_ms")
            .parse::<f64>()
            .unwrap()
            >= 0.0
    );
    assert_eq!(attr(&agent_dial, "server.address"), "cluster-a");
    assert_eq!(attr(&agent_dial, "network.peer.address"), "127.0.0.1");
    assert_eq!(
        attr(&agent_dial, "cluster_proxy.end_reason"),
        "server_close"
    );

    // 1b. Early data: the client's and the agent's spans say how many bytes
    //     rode with the dial, and the server counts them as sent to the agent.
    let mut stream = client
        .dial_with_early_data(
            &format!("cluster-a:{}", echo.addr.port()),
            bytes::Bytes::from_static(b"early"),
        )
        .await
        .unwrap();
    let mut back = [0u8; 5];
    stream.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"early");
    stream.shutdown().await.unwrap();
    drop(stream);
    let early_dial = collector
        .wait_for("tunnel.dial", |s| {
            s.attributes.contains_key("cluster_proxy.early_data_bytes")
        })
        .await;
    assert_eq!(attr(&early_dial, "cluster_proxy.early_data_bytes"), "5");
    let early_agent = collector
        .wait_for("agent.dial", |s| s.trace_id == early_dial.trace_id)
        .await;
    assert_eq!(attr(&early_agent, "cluster_proxy.early_data_bytes"), "5");
    let early_connection = collector
        .wait_for("tunnel.connection", |s| s.trace_id == early_dial.trace_id)
        .await;
    assert_eq!(attr(&early_connection, "cluster_proxy.bytes_to_agent"), "5");
    assert_eq!(
        attr(&early_connection, "cluster_proxy.bytes_from_agent"),
        "5"
    );

    // 2. A failed dial: the server's and the agent's spans carry the agent's error.
    let closed = closed_port().await.unwrap();
    let refused = client.dial(&format!("cluster-a:{}", closed.port())).await;
    assert!(refused.is_err());
    let failed = collector
        .wait_for("tunnel.connection", |s| {
            s.attributes
                .get("cluster_proxy.end_reason")
                .map(String::as_str)
                == Some("error_response")
        })
        .await;
    assert!(
        attr(&failed, "error.message").contains("connection refused"),
        "{failed:#?}"
    );
    let failed_agent = collector
        .wait_for("agent.dial", |s| s.trace_id == failed.trace_id)
        .await;
    assert_eq!(failed_agent.parent_span_id, failed.span_id);
    assert!(attr(&failed_agent, "error.message").contains("connection refused"));
    assert!(
        failed.events.iter().any(|e| e.name == "dial failed"
            && e.attributes
                .get("cluster_proxy.end_reason")
                .map(String::as_str)
                == Some("error_response")),
        "the server's span has a dial-failed event: {failed:#?}"
    );
    assert!(
        failed_agent
            .events
            .iter()
            .any(|e| e.name == "endpoint dial failed"),
        "the agent's log line is an event of its span: {failed_agent:#?}"
    );
    let failed_client = collector
        .wait_for("tunnel.dial", |s| s.trace_id == failed.trace_id)
        .await;
    assert!(attr(&failed_client, "error.message").contains("connection refused"));

    // 3. HTTP CONNECT continues the trace named by its traceparent header.
    let traceparent_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut stream = http_connect_traced(
        &pki,
        server.client_addr,
        &format!("cluster-a:{}", echo.addr.port()),
        &format!("00-{traceparent_trace}-00f067aa0ba902b7-01"),
    )
    .await;
    stream.write_all(b"ping").await.unwrap();
    stream.flush().await.unwrap();
    let mut back = [0u8; 4];
    stream.read_exact(&mut back).await.unwrap();
    drop(stream);
    let connect = collector
        .wait_for("tunnel.connection", |s| s.trace_id == traceparent_trace)
        .await;
    assert_eq!(connect.parent_span_id, "00f067aa0ba902b7");
    assert_eq!(attr(&connect, "cluster_proxy.frontend"), "http-connect");
    collector
        .wait_for("agent.dial", |s| {
            s.trace_id == traceparent_trace && s.parent_span_id == connect.span_id
        })
        .await;

    // 4. Only an agent that asked for it is sent trace context.
    let mut upstream_style = RawAgent::connect(
        pki.agent_tls("cluster-b").unwrap(),
        server.agent_addr,
        "cluster-b-raw",
        "host=cluster-b",
        None,
    )
    .await
    .unwrap();
    let mut ours = tracing_raw_agent(&pki, server.agent_addr, "cluster-c").await;
    assert!(wait_until(WAIT, || server.tunnel_count() == 3).await);
    let plain_client = client.clone();
    let pending_b = tokio::spawn(async move { plain_client.dial("cluster-b:80").await });
    let plain = next_dial_request(&mut upstream_style).await;
    let Frame::DialRequest { random, trace, .. } = Frame::from_packet(plain.clone()) else {
        unreachable!()
    };
    assert_eq!(trace, None);
    assert_eq!(
        plain.encode_to_vec(),
        packet::dial_request("cluster-b:80", random).encode_to_vec(),
        "an upstream agent gets plain konnectivity bytes"
    );
    let traced_client = client.clone();
    let pending_c = tokio::spawn(async move { traced_client.dial("cluster-c:80").await });
    let traced = next_dial_request(&mut ours).await;
    let Frame::DialRequest {
        trace: Some(trace), ..
    } = Frame::from_packet(traced)
    else {
        panic!("an agent that advertised the extension gets trace context");
    };
    assert!(trace.to_context().is_some(), "{trace:?}");
    pending_b.abort();

    // 4b. cluster-c's agent never answers: the dial times out (the test
    // server's 5 s) and the server's span says so with an event.
    let timed_out = tokio::time::timeout(WAIT, pending_c)
        .await
        .expect("the dial ended")
        .unwrap();
    assert!(timed_out.is_err(), "a dial nobody answered succeeded");
    let timeout_span = collector
        .wait_for("tunnel.connection", |s| {
            s.attributes
                .get("cluster_proxy.cluster")
                .map(String::as_str)
                == Some("cluster-c")
                && s.events.iter().any(|e| e.name == "dial timeout")
        })
        .await;
    assert_eq!(
        attr(&timeout_span, "cluster_proxy.end_reason"),
        "backend_dial_timeout"
    );

    // 5. With the collector gone, connections still work, without stalling.
    stop_collector.cancel();
    tokio::time::timeout(WAIT, async {
        for i in 0..20u8 {
            echo_once(
                &client,
                &format!("cluster-a:{}", echo.addr.port()),
                &[i; 64],
            )
            .await;
        }
    })
    .await
    .expect("connections stall while the collector is down");
    telemetry.shutdown().await;
}

/// A proxy-server and a proxy-agent process (for cluster-a), exporting to
/// `endpoint`: the server through the standard variables, the agent
/// through the matching flags. The agent runs Tokio's single-threaded
/// scheduler (`--worker-threads=1`) and the server the multi-threaded one,
/// so the span export, the tunnel and the SIGTERM flush are checked on both.
struct TracedProcesses {
    processes: ChildTunnel,
    client_addr: SocketAddr,
}

impl TracedProcesses {
    async fn start(pki: &TestPki, endpoint: &str) -> Self {
        use simulated_cluster::binaries::{Binaries, Progress};
        let binaries = tokio::task::spawn_blocking(|| Binaries::build(Progress::Quiet))
            .await
            .unwrap()
            .unwrap();
        let env = |name: &str, value: &str| (name.to_owned(), value.to_owned());
        let options = ChildTunnelOptions {
            server_env: vec![
                env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
                env("OTEL_SERVICE_NAME", "hub-proxy-server"),
                env("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test"),
            ],
            agent_args: vec![
                format!("--otlp-endpoint={endpoint}"),
                "--otel-service-name=cluster-a-proxy-agent".to_owned(),
                "--worker-threads=1".to_owned(),
            ],
            ..ChildTunnelOptions::default()
        };
        let cluster_a = cluster_proxy_proto::identity::ClusterName::new("cluster-a").unwrap();
        let processes = ChildTunnel::start(&binaries, pki, &cluster_a, "traced", &options)
            .await
            .unwrap();
        TracedProcesses {
            client_addr: processes.client_addr(),
            processes,
        }
    }

    /// Dials cluster-a's `target` until a tunneled echo succeeds (the agent
    /// connects on its own schedule).
    async fn wait_connected(&self, pki: &TestPki, target: &str) {
        let connected = tokio::time::timeout(WAIT, async {
            loop {
                if echo_through(pki, self.client_addr, target).await.is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(connected.is_ok(), "no connection through the processes");
    }

    /// SIGTERM to both; each must stop.
    async fn stop(self) {
        self.processes
            .stop()
            .await
            .expect("both processes stop on SIGTERM");
    }
}

/// One gRPC tunnel, one dial, a 6-byte echo, a close.
async fn echo_through(pki: &TestPki, server: SocketAddr, target: &str) -> Result<(), String> {
    let client = tunnel_client(pki.client_tls().map_err(|e| e.to_string())?, server)
        .await
        .map_err(|e| e.to_string())?;
    let mut stream = client.dial(target).await.map_err(|e| e.to_string())?;
    stream
        .write_all(b"traced")
        .await
        .map_err(|e| e.to_string())?;
    let mut back = [0u8; 6];
    stream
        .read_exact(&mut back)
        .await
        .map_err(|e| e.to_string())?;
    if &back != b"traced" {
        return Err(format!("echo answered {back:?}"));
    }
    stream.shutdown().await.map_err(|e| e.to_string())
}

/// The real binaries, configured through the standard variables (server)
/// and the matching flags (agent), export to the collector; their spans of
/// one connection share a trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_and_agent_processes_export_linked_spans() {
    let (collector, collector_addr, _stop) = Collector::start().await.unwrap();
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let processes = TracedProcesses::start(&pki, &format!("http://{collector_addr}")).await;
    let echo = EchoServer::start().await.unwrap();
    let target = format!("cluster-a:{}", echo.addr.port());
    processes.wait_connected(&pki, &target).await;

    let server_span = collector
        .wait_for("tunnel.connection", |s| {
            s.service == "hub-proxy-server"
                && s.attributes
                    .get("cluster_proxy.end_reason")
                    .map(String::as_str)
                    == Some("client_close")
        })
        .await;
    assert_eq!(
        attr(&server_span, "cluster_proxy.server_id"),
        "traced-server"
    );
    assert_eq!(attr(&server_span, "cluster_proxy.bytes_to_agent"), "6");
    let agent_span = collector
        .wait_for("agent.dial", |s| {
            s.service == "cluster-a-proxy-agent" && s.trace_id == server_span.trace_id
        })
        .await;
    assert_eq!(agent_span.parent_span_id, server_span.span_id);
    processes.stop().await;
}

/// The server's and the agent's resident set, in KiB.
fn rss_kib(processes: &ChildTunnel) -> (u64, u64) {
    let (server, agent) = processes.usage().expect("/proc of both processes");
    let kib = |mib: f64| (mib * 1024.0).round() as u64;
    (kib(server.rss_mib), kib(agent.rss_mib))
}

/// Connections made `parallel` at a time, `count` in all; panics on the
/// first failure.
async fn echo_many(pki: &TestPki, server: SocketAddr, target: &str, count: usize, parallel: usize) {
    let per_worker = count.div_ceil(parallel);
    let workers = (0..parallel).map(|_| async move {
        for _ in 0..per_worker {
            echo_through(pki, server, target).await.unwrap();
        }
    });
    futures_util::future::join_all(workers).await;
}

/// A collector that accepts connections and never answers (the worst kind
/// of slow) neither stalls tunneled connections nor grows the server's or
/// the agent's memory with the spans it cannot take: past the exporter's
/// bounded queue ([`telemetry::MAX_QUEUE_SPANS`] spans) spans are dropped.
/// Without the bound the 12,000 connections after the warm-up would queue
/// about 48,000 more spans: measured once with an unbounded queue, the
/// server grew 13 MiB over 6,000 connections; with the bound, 7 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_stalls_nothing_and_memory_stays_bounded() {
    let black_hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", black_hole.local_addr().unwrap());
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let holder = {
        let held = held.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = black_hole.accept().await {
                held.lock().unwrap_or_else(|p| p.into_inner()).push(tcp);
            }
        })
    };
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let processes = TracedProcesses::start(&pki, &endpoint).await;
    let echo = EchoServer::start().await.unwrap();
    let target = format!("cluster-a:{}", echo.addr.port());
    processes.wait_connected(&pki, &target).await;

    // Enough to fill both exporters' queues, so what follows could only
    // grow memory if the queues were not bounded.
    let parallel = 8;
    echo_many(&pki, processes.client_addr, &target, 3_000, parallel).await;
    let (server_before, agent_before) = rss_kib(&processes.processes);
    let started = std::time::Instant::now();
    tokio::time::timeout(
        Duration::from_secs(300),
        echo_many(&pki, processes.client_addr, &target, 12_000, parallel),
    )
    .await
    .expect("connections stalled behind a collector that never answers");
    let took = started.elapsed();
    let (server_after, agent_after) = rss_kib(&processes.processes);
    eprintln!(
        "12,000 connections with a black-hole collector took {took:?}; RSS KiB server {server_before} -> {server_after}, agent {agent_before} -> {agent_after}; {} exporter connections held",
        held.lock().unwrap_or_else(|p| p.into_inner()).len()
    );
    assert!(
        !held.lock().unwrap_or_else(|p| p.into_inner()).is_empty(),
        "the exporters never tried the collector: the test proves nothing"
    );
    // Twice the connections of the unbounded measurement: over 26 MiB.
    let bound_kib = 16 * 1024;
    assert!(
        server_after.saturating_sub(server_before) < bound_kib,
        "server RSS grew {} KiB",
        server_after.saturating_sub(server_before)
    );
    assert!(
        agent_after.saturating_sub(agent_before) < bound_kib,
        "agent RSS grew {} KiB",
        agent_after.saturating_sub(agent_before)
    );
    processes.stop().await;
    holder.abort();
}
