//! Micro-benchmark: what one proxy-server connection span costs the thread
//! that makes it, by two paths, every span sampled and ended into a span
//! processor that only counts (no export, no receiver):
//!
//! - `layer`: the `tracing` span through the services' OpenTelemetry layer,
//!   recorded as the server records it ([`e2e::span_shapes`]);
//! - `sdk`: the same span built once, at the connection's end, from its
//!   final state with the OpenTelemetry SDK (what a connection span made
//!   outside `tracing` would cost).
//!
//! `CP_SPANS` (200000) spans per path, on one thread.
//!
//! ```sh
//! cargo run --release -p e2e --example span_paths
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use cluster_proxy_proto::trace::TraceHeaders;
use cluster_proxy_runtime::telemetry::span_layer;
use e2e::loadgen::{knob, process_usage};
use e2e::span_shapes::{grpc_origin, sampled_parent, server_connection_span};
use opentelemetry::trace::{SpanKind, TraceContextExt as _, Tracer, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanProcessor};
use tracing_subscriber::layer::SubscriberExt;

/// Counts the spans that end; exports nothing.
#[derive(Debug, Default)]
struct Counting(Arc<AtomicU64>);

impl SpanProcessor for Counting {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &Context) {}
    fn on_end(&self, _: SpanData) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The same span, its ids made when the dial starts (the agent needs the
/// context then) and the rest built at the end in one call.
fn through_sdk(tracer: &opentelemetry_sdk::trace::SdkTracer, parent: &TraceHeaders) -> bool {
    let parent = parent.to_context().unwrap_or_default();
    let started = SystemTime::now();
    let attributes = vec![
        KeyValue::new("network.transport", "tcp"),
        KeyValue::new("server.address", "bench"),
        KeyValue::new("server.port", "8080"),
        KeyValue::new("client.address", "127.0.0.1"),
        KeyValue::new("cluster_proxy.frontend", "grpc"),
        KeyValue::new("cluster_proxy.client_identity", "CN=client"),
        KeyValue::new("cluster_proxy.server_id", "server-1"),
        KeyValue::new("cluster_proxy.strategy", "destHost"),
        KeyValue::new("cluster_proxy.cluster", "bench"),
        KeyValue::new("cluster_proxy.agent_id", "bench-agent"),
        KeyValue::new("cluster_proxy.tunnel", 7i64),
        KeyValue::new("cluster_proxy.connect_id", 42i64),
        KeyValue::new("cluster_proxy.dial_latency_ms", 0.4f64),
        KeyValue::new("cluster_proxy.bytes_to_agent", 1i64),
        KeyValue::new("cluster_proxy.bytes_from_agent", 1i64),
        KeyValue::new("cluster_proxy.end_reason", "client_close"),
    ];
    let mut span = tracer
        .span_builder("tunnel.connection")
        .with_kind(SpanKind::Server)
        .with_start_time(started)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    let for_agent = TraceHeaders::from_context(
        &Context::new()
            .with_remote_span_context(opentelemetry::trace::Span::span_context(&span).clone()),
    );
    opentelemetry::trace::Span::end(&mut span);
    for_agent.is_some()
}

fn cpu_seconds() -> f64 {
    process_usage(std::process::id()).map_or(0.0, |usage| usage.cpu_seconds)
}

fn main() -> anyhow::Result<()> {
    let count = knob("CP_SPANS", 200_000);
    let ended = Arc::new(AtomicU64::new(0));
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Counting(ended.clone()))
        .with_sampler(Sampler::AlwaysOn)
        .build();
    let parent = sampled_parent();

    let subscriber = tracing_subscriber::registry().with(span_layer(provider.tracer("bench")));
    let origin = grpc_origin(&parent);
    let layer_cpu = tracing::subscriber::with_default(subscriber, || {
        let before = cpu_seconds();
        for _ in 0..count {
            anyhow::ensure!(
                server_connection_span(&origin).is_some(),
                "no context for the agent"
            );
        }
        Ok(cpu_seconds() - before)
    })?;
    let layer_ended = ended.swap(0, Ordering::Relaxed);

    let tracer = provider.tracer("bench");
    let started = Instant::now();
    let before = cpu_seconds();
    for _ in 0..count {
        anyhow::ensure!(through_sdk(&tracer, &parent), "no context for the agent");
    }
    let sdk_cpu = cpu_seconds() - before;
    let sdk_ended = ended.load(Ordering::Relaxed);
    anyhow::ensure!(
        layer_ended == count as u64 && sdk_ended == count as u64,
        "spans ended: {layer_ended} through the layer, {sdk_ended} through the SDK, of {count}"
    );
    println!(
        "{count} connection spans per path, all sampled, none exported: through the tracing layer {:.2} µs of CPU each, built with the SDK at the end {:.2} µs ({:.0} ms wall for the SDK path)",
        layer_cpu * 1e6 / count as f64,
        sdk_cpu * 1e6 / count as f64,
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
