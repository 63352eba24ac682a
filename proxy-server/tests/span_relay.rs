//! The span relay at the server (issue 53 item 4), driven by hand-written
//! agents: the server offers it only to an agent that asked, whose
//! certificate names its cluster, and only with a collector to forward to;
//! relayed spans reach that collector stamped with the cluster's name
//! (whatever the agent claimed); malformed, oversized and unnegotiated
//! batches are counted and dropped with the tunnel kept up; and a collector
//! that never answers costs relayed spans, never the tunnel's time.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::packet::{self, Frame, MAX_SPAN_BATCH};
use cluster_proxy_runtime::telemetry::relay::RELAYED_FROM;
use cluster_proxy_runtime::telemetry::{SamplerChoice, TelemetryConfig};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message;
use proxy_server::RunningServer;
use simulated_cluster::otlp::Collector;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{RawAgent, test_server_config, tunnel_client};
use tunnel_harness::pki::TestPki;

const STEP: Duration = Duration::from_secs(10);
const ASK: (&str, &str) = (metadata::SPAN_RELAY, metadata::SPAN_RELAY_OTLP_V1);

fn collector_config(addr: SocketAddr, export_timeout: Duration) -> TelemetryConfig {
    TelemetryConfig {
        endpoint: Some(format!("http://{addr}")),
        sampler: SamplerChoice::AlwaysOn,
        export_timeout,
        ..TelemetryConfig::off("proxy-server")
    }
}

async fn server_forwarding_to(pki: &TestPki, collector: Option<TelemetryConfig>) -> RunningServer {
    let mut config = test_server_config();
    config.relay_collector = collector;
    proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap()
}

async fn raw_agent(
    pki: &TestPki,
    server: &RunningServer,
    cluster: &str,
    extensions: &[(&'static str, &'static str)],
) -> RawAgent {
    let before = server.tunnel_count();
    let agent = RawAgent::connect_with(
        extensions,
        pki.agent_tls(cluster).unwrap(),
        server.agent_addr,
        &format!("agent-{cluster}"),
        &format!("host={cluster}"),
    )
    .await
    .unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() > before).await);
    agent
}

fn offered(agent: &RawAgent) -> Option<&str> {
    agent
        .headers
        .get(metadata::SPAN_RELAY)
        .and_then(|v| v.to_str().ok())
}

/// An OTLP request of `spans` spans named `name-<i>` from service
/// `service`, claiming to come from `claimed` when given.
fn otlp(service: &str, name: &str, spans: usize, claimed: Option<&str>) -> Bytes {
    let text = |value: &str| {
        Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        })
    };
    let mut attributes = vec![KeyValue {
        key: "service.name".into(),
        value: text(service),
        ..Default::default()
    }];
    if let Some(claimed) = claimed {
        attributes.push(KeyValue {
            key: RELAYED_FROM.into(),
            value: text(claimed),
            ..Default::default()
        });
    }
    let request = ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes,
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                spans: (0..spans)
                    .map(|i| Span {
                        trace_id: vec![1; 16],
                        span_id: (i as u64 + 1).to_be_bytes().to_vec(),
                        name: format!("{name}-{i}"),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        }],
    };
    Bytes::from(request.encode_to_vec())
}

/// The value of the metric line starting with `prefix` (0 when absent).
fn metric(server: &RunningServer, prefix: &str) -> f64 {
    server
        .metrics_text()
        .lines()
        .find(|line| line.starts_with(prefix))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn the_relay_is_offered_only_to_an_agent_that_asked_with_a_collector_to_forward_to() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let (_collector, addr, stop) = Collector::start().await.unwrap();
    let server = server_forwarding_to(&pki, Some(collector_config(addr, STEP))).await;

    let asking = raw_agent(&pki, &server, "cluster-a", &[ASK]).await;
    assert_eq!(offered(&asking), Some(metadata::SPAN_RELAY_OTLP_V1));
    // An upstream-style agent asks nothing and is told nothing new.
    let upstream = raw_agent(&pki, &server, "cluster-a", &[]).await;
    assert_eq!(offered(&upstream), None);
    let unknown_version = raw_agent(
        &pki,
        &server,
        "cluster-a",
        &[(metadata::SPAN_RELAY, "otlp-v9")],
    )
    .await;
    assert_eq!(offered(&unknown_version), None);
    server.shutdown().await;

    // Without a collector of its own the server offers nothing.
    let server = server_forwarding_to(&pki, None).await;
    let asking = raw_agent(&pki, &server, "cluster-a", &[ASK]).await;
    assert_eq!(offered(&asking), None);
    server.shutdown().await;

    // Nor when its packets may not be as large as a span batch.
    let mut config = test_server_config();
    config.relay_collector = Some(collector_config(addr, STEP));
    config.max_packet_size = u32::try_from(MAX_SPAN_BATCH).unwrap();
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let asking = raw_agent(&pki, &server, "cluster-a", &[ASK]).await;
    assert_eq!(offered(&asking), None);
    server.shutdown().await;
    stop.cancel();
}

#[tokio::test]
async fn relayed_spans_reach_the_collector_stamped_with_the_agents_cluster() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let (collector, addr, stop) = Collector::start().await.unwrap();
    let server = server_forwarding_to(&pki, Some(collector_config(addr, STEP))).await;
    let agent = raw_agent(&pki, &server, "cluster-a", &[ASK]).await;

    agent
        .to_server
        .send(packet::span_batch(otlp(
            "proxy-agent",
            "relayed",
            3,
            Some("cluster-b"),
        )))
        .await
        .unwrap();
    let span = collector.wait_for("relayed-2", |_| true).await;
    assert_eq!(span.service, "proxy-agent");
    assert_eq!(
        span.resource.get(RELAYED_FROM).map(String::as_str),
        Some("cluster-a"),
        "the server overwrites what the agent claimed: {span:#?}"
    );
    assert!(
        wait_until(STEP, || metric(
            &server,
            "cluster_proxy_server_relayed_spans_total{outcome=\"exported\"}"
        ) == 3.0)
        .await,
        "{}",
        server.metrics_text()
    );
    server.shutdown().await;
    stop.cancel();
}

#[tokio::test]
async fn bad_or_unnegotiated_batches_are_counted_and_the_tunnel_stays_up() {
    let pki = TestPki::new(&["cluster-a", "cluster-b"]).unwrap();
    let (collector, addr, stop) = Collector::start().await.unwrap();
    let server = server_forwarding_to(&pki, Some(collector_config(addr, STEP))).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut agent = raw_agent(&pki, &server, "cluster-a", &[ASK]).await;
    let mut upstream = raw_agent(&pki, &server, "cluster-b", &[]).await;

    let oversized = {
        let mut bytes = otlp("proxy-agent", "big", 1, None).to_vec();
        bytes.resize(MAX_SPAN_BATCH + 1, 0);
        Bytes::from(bytes)
    };
    for batch in [
        Bytes::from_static(&[0x0a, 0x05, 0x12]), // length beyond the message
        Bytes::from_static(&[0xff; 11]),         // overlong varint
        Bytes::from_static(&[0x0b]),             // a group: not OTLP
        oversized,
    ] {
        agent
            .to_server
            .send(packet::span_batch(batch))
            .await
            .unwrap();
    }
    // An agent that never negotiated the relay sends a good batch anyway.
    upstream
        .to_server
        .send(packet::span_batch(otlp("upstream", "unasked", 1, None)))
        .await
        .unwrap();
    let rejected = |reason: &str| {
        metric(
            &server,
            &format!(
                "cluster_proxy_server_relayed_span_batches_rejected_total{{reason=\"{reason}\"}}"
            ),
        )
    };
    assert!(
        wait_until(STEP, || rejected("malformed") == 3.0
            && rejected("too_large") == 1.0
            && rejected("not_negotiated") == 1.0)
        .await,
        "{}",
        server.metrics_text()
    );

    // Both tunnels still carry connections, and still relay a good batch.
    for (agent, cluster) in [(&mut agent, "cluster-a"), (&mut upstream, "cluster-b")] {
        let dialing = client.clone();
        let target = format!("{cluster}:80");
        let dial = tokio::spawn(async move { dialing.dial(&target).await });
        let random = loop {
            let p = agent.recv(STEP).await.expect("a DIAL_REQ");
            if let Frame::DialRequest { random, .. } = Frame::from_packet(p) {
                break random;
            }
        };
        agent
            .to_server
            .send(packet::dial_response_ok(random, 5))
            .await
            .unwrap();
        let mut stream = dial.await.unwrap().unwrap();
        stream.write_all(b"ping").await.unwrap();
        assert_eq!(
            Frame::from_packet(agent.recv(STEP).await.expect("DATA")),
            Frame::Data {
                connect_id: 5,
                data: Bytes::from_static(b"ping")
            }
        );
        agent
            .to_server
            .send(packet::data(5, Bytes::from_static(b"pong")))
            .await
            .unwrap();
        let mut pong = [0u8; 4];
        stream.read_exact(&mut pong).await.unwrap();
        assert_eq!(&pong, b"pong");
    }
    agent
        .to_server
        .send(packet::span_batch(otlp("proxy-agent", "after", 1, None)))
        .await
        .unwrap();
    collector.wait_for("after-0", |_| true).await;
    assert!(collector.find("unasked-0", |_| true).is_none());
    server.shutdown().await;
    stop.cancel();
}

/// A collector that takes connections and never answers: every export
/// waits for the exporter's timeout.
async fn silent_collector() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_costs_relayed_spans_not_the_tunnels_time() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let (addr, silent) = silent_collector().await;
    // Each export would wait a minute: far longer than this test may take.
    let server =
        server_forwarding_to(&pki, Some(collector_config(addr, Duration::from_secs(60)))).await;
    let client = tunnel_client(pki.client_tls().unwrap(), server.client_addr)
        .await
        .unwrap();
    let mut agent = raw_agent(&pki, &server, "cluster-a", &[ASK]).await;

    // A dial waits for the agent's answer; the agent sends many more span
    // batches than the forwarder holds, then answers.
    let dial = tokio::spawn({
        let client = client.clone();
        async move { client.dial("cluster-a:80").await }
    });
    let random = loop {
        let p = agent.recv(STEP).await.expect("a DIAL_REQ");
        if let Frame::DialRequest { random, .. } = Frame::from_packet(p) {
            break random;
        }
    };
    const BATCHES: usize = 300;
    const SPANS_EACH: usize = 10;
    let batch = otlp("proxy-agent", "stalled", SPANS_EACH, None);
    let started = std::time::Instant::now();
    for _ in 0..BATCHES {
        agent
            .to_server
            .send(packet::span_batch(batch.clone()))
            .await
            .unwrap();
    }
    agent
        .to_server
        .send(packet::dial_response_ok(random, 9))
        .await
        .unwrap();
    let mut stream = tokio::time::timeout(STEP, dial)
        .await
        .expect("the dial completes while the collector stalls")
        .unwrap()
        .unwrap();
    // The tunnel's reader went through every batch without waiting for
    // the collector: the DIAL_RSP behind them arrived in seconds, not
    // after a minute per export.
    let took = started.elapsed();
    assert!(took < STEP, "the reader took {took:?}");
    stream.write_all(b"x").await.unwrap();
    assert!(matches!(
        Frame::from_packet(agent.recv(STEP).await.expect("DATA")),
        Frame::Data { connect_id: 9, .. }
    ));
    // Beyond what the forwarder holds (and the one batch in its export),
    // the batches were dropped and counted; none was exported.
    let dropped = "cluster_proxy_server_relayed_spans_total{outcome=\"queue_full\"}";
    let most_kept =
        (cluster_proxy_runtime::telemetry::relay::FORWARD_QUEUE_BATCHES + 1) * SPANS_EACH;
    assert!(
        wait_until(STEP, || metric(&server, dropped)
            >= ((BATCHES * SPANS_EACH) - most_kept) as f64)
        .await,
        "{}",
        server.metrics_text()
    );
    assert_eq!(
        metric(
            &server,
            "cluster_proxy_server_relayed_spans_total{outcome=\"exported\"}"
        ),
        0.0
    );
    // More dials keep flowing at once, each answered promptly.
    for connect_id in 10..20 {
        let dial = tokio::spawn({
            let client = client.clone();
            async move { client.dial("cluster-a:80").await }
        });
        let random = loop {
            let p = agent.recv(STEP).await.expect("a DIAL_REQ");
            if let Frame::DialRequest { random, .. } = Frame::from_packet(p) {
                break random;
            }
        };
        agent
            .to_server
            .send(packet::span_batch(batch.clone()))
            .await
            .unwrap();
        agent
            .to_server
            .send(packet::dial_response_ok(random, connect_id))
            .await
            .unwrap();
        let stream = tokio::time::timeout(STEP, dial)
            .await
            .expect("a dial while the collector stalls")
            .unwrap()
            .unwrap();
        assert_eq!(stream.connect_id(), connect_id);
    }
    tokio::time::timeout(STEP, server.shutdown())
        .await
        .expect("the server stops though its collector stalls");
    silent.abort();
}

/// Our agent, over each transport (gRPC over HTTP/2, the lean framing, the
/// WebSocket upgrade): it asks for the relay, the server offers it, and a
/// batch put in the agent's relay queue reaches the server's collector
/// stamped with the agent's cluster. Against a server without a collector
/// the agent sends nothing and counts what it dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_agent_relays_its_queue_over_every_transport() {
    use cluster_proxy_runtime::telemetry::relay::{RelayQueue, RelayedBatch};
    use proxy_agent::{ProxyAgentConfig, TlsSource, Transport};

    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let (collector, addr, stop) = Collector::start().await.unwrap();
    let with_collector = server_forwarding_to(&pki, Some(collector_config(addr, STEP))).await;
    let without_collector = server_forwarding_to(&pki, None).await;
    let agent_config = |server: &RunningServer, transport: Transport, lean: bool| {
        let mut config =
            ProxyAgentConfig::new(TlsSource::Config(pki.agent_tls("cluster-a").unwrap()))
                .with_ephemeral_ports();
        config.proxy_server_host = "localhost".into();
        config.proxy_server_port = server.agent_addr.port();
        config.agent_identifiers = "host=cluster-a".into();
        config.transport = transport;
        config.lean_framing = lean;
        config
    };
    for (name, transport, lean) in [
        ("grpc", Transport::Auto, false),
        ("lean", Transport::Auto, true),
        ("websocket", Transport::Websocket, false),
    ] {
        let queue = RelayQueue::new(4);
        let mut config = agent_config(&with_collector, transport, lean);
        config.span_relay = Some(queue.clone());
        let before = with_collector.tunnel_count();
        let agent = proxy_agent::start(config).await.unwrap();
        assert!(wait_until(STEP, || with_collector.tunnel_count() > before).await);
        // The relay task registers once the tunnel is up.
        assert!(wait_until(STEP, || queue.has_drainer()).await, "{name}");
        let span = format!("via-{name}");
        queue.offer(RelayedBatch {
            otlp: otlp("proxy-agent", &span, 2, Some("forged")),
            spans: 2,
        });
        let wanted = format!("{span}-1");
        assert!(
            wait_until(STEP, || collector.find(&wanted, |_| true).is_some()).await,
            "{name}: nothing arrived; agent:\n{}\nserver:\n{}",
            agent.metrics().encode(),
            with_collector.metrics_text()
        );
        let received = collector.find(&wanted, |_| true).expect("arrived");
        assert_eq!(
            received.resource.get(RELAYED_FROM).map(String::as_str),
            Some("cluster-a"),
            "{name}"
        );
        assert!(
            agent
                .metrics()
                .encode()
                .contains("cluster_proxy_agent_relayed_spans_total 2"),
            "{name}: {}",
            agent.metrics().encode()
        );
        agent.shutdown().await;
    }

    // A server that forwards nothing: the agent asks, is not answered,
    // and drops its spans as having no tunnel to send them through.
    let queue = RelayQueue::new(4);
    let mut config = agent_config(&without_collector, Transport::Auto, true);
    config.span_relay = Some(queue.clone());
    let agent = proxy_agent::start(config).await.unwrap();
    assert!(wait_until(STEP, || without_collector.tunnel_count() == 1).await);
    assert!(!queue.has_drainer());
    queue.offer(RelayedBatch {
        otlp: otlp("proxy-agent", "nowhere", 3, None),
        spans: 3,
    });
    assert!(queue.is_empty());
    let text = agent.metrics().encode();
    assert!(
        text.contains("cluster_proxy_agent_relayed_spans_dropped_total{reason=\"no_tunnel\"} 3"),
        "{text}"
    );
    assert_eq!(
        metric(
            &without_collector,
            "konnectivity_network_proxy_server_stream_packets_total{segment=\"from_agent\",packet_type=\"SPAN_BATCH\"}"
        ),
        0.0
    );
    agent.shutdown().await;
    with_collector.shutdown().await;
    without_collector.shutdown().await;
    stop.cancel();
}
