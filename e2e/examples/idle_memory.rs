//! Benchmark: what an idle tunneled connection costs the proxy-server and
//! the proxy-agent.
//!
//! ```sh
//! cargo run --release -p e2e --example idle_memory
//! ```
//!
//! For each frontend (gRPC, HTTP CONNECT), a fresh proxy-server and
//! proxy-agent run as child processes (their RSS is their own, from
//! `/proc`). After `CP_IDLE_WARMUP` (200) connections opened and closed,
//! `CP_IDLE_CONNS` (2000) connections are opened, each carrying a 1-byte
//! echo, and held; each process's RSS growth divided by the number of
//! connections is its cost per idle connection. gRPC connections share
//! client HTTP/2 connections, 500 streams each (the server allows 1,000);
//! every CONNECT is its own TLS connection, as HTTP/1.1 makes it. This
//! process's own growth (the clients and the echo target) is shown apart.

use std::time::Duration;

use anyhow::anyhow;
use cluster_proxy_proto::identity::ClusterName;
use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::targets::EchoServer;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tunnel_harness::child::{ChildTunnel, ChildTunnelOptions};
use tunnel_harness::in_process::{http_connect, tunnel_client};
use tunnel_harness::loadgen::{knob, rss_bytes};
use tunnel_harness::pki::TestPki;

const CLUSTER: &str = "cluster-a";
const STREAMS_PER_CLIENT: usize = 500;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frontend {
    Grpc,
    Connect,
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Opens `count` connections through `frontend`, each with a 1-byte echo.
async fn open(
    pki: &TestPki,
    processes: &ChildTunnel,
    frontend: Frontend,
    target: &str,
    count: usize,
) -> anyhow::Result<Vec<Box<dyn Io>>> {
    let mut held: Vec<Box<dyn Io>> = Vec::with_capacity(count);
    let mut clients = Vec::new();
    let connect_tls = pki.client_tls_alpn(&[cluster_proxy_proto::transport::ALPN_HTTP11])?;
    for i in 0..count {
        let mut io: Box<dyn Io> = match frontend {
            Frontend::Grpc => {
                if i % STREAMS_PER_CLIENT == 0 {
                    clients.push(tunnel_client(pki.client_tls()?, processes.client_addr()).await?);
                }
                let client = clients
                    .last()
                    .ok_or_else(|| anyhow!("no client connection"))?;
                Box::new(client.dial(target).await?)
            }
            Frontend::Connect => {
                Box::new(http_connect(connect_tls.clone(), processes.client_addr(), target).await?)
            }
        };
        let mut byte = [7u8; 1];
        io.write_all(&byte).await?;
        io.read_exact(&mut byte).await?;
        held.push(io);
    }
    Ok(held)
}

struct Cost {
    server_kib: f64,
    agent_kib: f64,
    this_process_kib: f64,
}

async fn measure(
    binaries: &Binaries,
    pki: &TestPki,
    echo: &EchoServer,
    frontend: Frontend,
    count: usize,
    warmup: usize,
) -> anyhow::Result<Cost> {
    let processes = ChildTunnel::start(
        binaries,
        pki,
        &ClusterName::new(CLUSTER)?,
        "idle",
        &ChildTunnelOptions::default(),
    )
    .await?;
    let target = format!("{CLUSTER}:{}", echo.addr.port());
    // One-time allocations (thread arenas, pools, the first client
    // connection's buffers) are not per-connection costs.
    drop(open(pki, &processes, frontend, &target, warmup).await?);
    let settle = Duration::from_millis(500);
    tokio::time::sleep(settle).await;
    let (server_before, agent_before) = processes.usage()?;
    let this_before = rss_bytes().unwrap_or(0);
    let held = open(pki, &processes, frontend, &target, count).await?;
    tokio::time::sleep(settle).await;
    let (server_after, agent_after) = processes.usage()?;
    let this_after = rss_bytes().unwrap_or(0);
    drop(held);
    let per_connection_kib = |before: f64, after: f64| (after - before) * 1024.0 / count as f64;
    Ok(Cost {
        server_kib: per_connection_kib(server_before.rss_mib, server_after.rss_mib),
        agent_kib: per_connection_kib(agent_before.rss_mib, agent_after.rss_mib),
        this_process_kib: this_after.saturating_sub(this_before) as f64 / 1024.0 / count as f64,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let count = knob("CP_IDLE_CONNS", 2_000).max(1);
    let warmup = knob("CP_IDLE_WARMUP", 200);
    let binaries = tokio::task::spawn_blocking(|| Binaries::build(Progress::Quiet)).await??;
    let pki = TestPki::new(&[CLUSTER])?;
    let echo = EchoServer::start().await?;
    println!(
        "{count} idle tunneled connections per frontend (after {warmup} opened and closed); proxy-server and proxy-agent as child processes, fresh for each frontend\n"
    );
    println!(
        "| frontend | server KiB/conn | agent KiB/conn | server + agent | clients + echo target (this process) |"
    );
    println!("|---|---|---|---|---|");
    for (frontend, name) in [
        (Frontend::Grpc, "gRPC"),
        (Frontend::Connect, "HTTP CONNECT"),
    ] {
        let cost = measure(&binaries, &pki, &echo, frontend, count, warmup).await?;
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} |",
            cost.server_kib,
            cost.agent_kib,
            cost.server_kib + cost.agent_kib,
            cost.this_process_kib
        );
    }
    Ok(())
}
