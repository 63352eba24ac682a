//! Micro-benchmark: the CPU cost of one connection span (the proxy-server's
//! own `tunnel.connection` span: remote parent, attributes added as the
//! dial proceeds, context taken for the agent) with the services' real
//! exporter sending to a counting OTLP receiver in this process:
//! `CP_SPANS` (100000) spans, none dropped.
//!
//! ```sh
//! cargo run --release -p e2e --example span_cost
//! ```

use std::time::{Duration, Instant};

use cluster_proxy_runtime::telemetry::{self, SamplerChoice, TelemetryConfig};
use e2e::span_shapes::{grpc_origin, sampled_parent, server_connection_span};
use tunnel_harness::loadgen::{knob, process_usage};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let count = knob("CP_SPANS", 100_000);
    let (collector, addr, stop) = simulated_cluster::otlp::Collector::start_counting().await?;
    // `CP_SPAN_SAMPLER=always_off` measures making spans that are not
    // sampled: the work on the connection's own path, no export.
    let sampler = std::env::var("CP_SPAN_SAMPLER").unwrap_or_else(|_| "always_on".to_owned());
    let exported = sampler == "always_on";
    let config = TelemetryConfig {
        endpoint: Some(format!("http://{addr}")),
        sampler: SamplerChoice::parse(Some(&sampler), None)?,
        ..TelemetryConfig::off("span-cost")
    };
    let telemetry = telemetry::exporter(&config)?.ok_or_else(|| anyhow::anyhow!("no endpoint"))?;
    let tracer = telemetry
        .connection_tracer()
        .ok_or_else(|| anyhow::anyhow!("no tracer"))?;
    anyhow::ensure!(
        cluster_proxy_proto::trace::install_tracer(tracer).is_ok(),
        "a tracer was already installed"
    );
    let origin = grpc_origin(&sampled_parent());
    // Spans are made in chunks that fit the export queue, each chunk once
    // the receiver has the previous one, so none is dropped; the cost is
    // this process's CPU time (span code, the exporter's encoding and the
    // receiver's decoding) per span.
    let chunk = 1_024;
    let received = move || collector.counts().values().sum::<u64>() as usize;
    let before = process_usage(std::process::id())?;
    let started = Instant::now();
    let mut made = 0;
    while made < count {
        let origin = origin.clone();
        tokio::task::spawn_blocking(move || {
            for _ in 0..chunk {
                assert!(
                    server_connection_span(&origin).is_some(),
                    "no context to send on"
                );
            }
        })
        .await?;
        made += chunk;
        while exported && received() < made {
            if started.elapsed() > Duration::from_secs(120) {
                anyhow::bail!("the receiver got {} of {made} spans", received());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let cpu = process_usage(std::process::id())?.cpu_seconds - before.cpu_seconds;
    telemetry.shutdown().await;
    if exported {
        println!(
            "{made} server connection spans, every one exported and received: {:.1} µs of CPU each (span code, OTLP encoding and the receiver's decoding, in this process)",
            cpu * 1e6 / made as f64
        );
    } else {
        println!(
            "{made} server connection spans, sampler {sampler} (none exported): {:.2} µs of CPU each",
            cpu * 1e6 / made as f64
        );
    }
    stop.cancel();
    Ok(())
}
