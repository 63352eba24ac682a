//! proxy-server's `--keepalive-time`: an agent tunnel whose peer goes silent
//! without closing (a black-holed network path) is dropped once a ping goes
//! unanswered, so the replica stops routing dials to it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use simulated_cluster::wait::wait_until;
use tokio::net::{TcpListener, TcpStream};
use tunnel_harness::faults::pump_unless_silent;
use tunnel_harness::in_process::{AgentUnderTest, test_server_config};
use tunnel_harness::pki::TestPki;

/// A TCP relay that can stop carrying bytes in both directions while
/// keeping both connections open, as a partitioned network does.
struct BlackHole {
    addr: SocketAddr,
    silent: Arc<AtomicBool>,
}

impl BlackHole {
    async fn start(upstream: SocketAddr) -> BlackHole {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let silent = Arc::new(AtomicBool::new(false));
        let flag = silent.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (a_read, a_write) = inbound.into_split();
                let (b_read, b_write) = outbound.into_split();
                tokio::spawn(pump_unless_silent(
                    a_read,
                    b_write,
                    flag.clone(),
                    Arc::default(),
                ));
                tokio::spawn(pump_unless_silent(
                    b_read,
                    a_write,
                    flag.clone(),
                    Arc::default(),
                ));
            }
        });
        BlackHole { addr, silent }
    }

    fn go_silent(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_silent_agent_tunnel_is_dropped_after_an_unanswered_ping() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.keepalive_time = Duration::from_secs(1);
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let hole = BlackHole::start(server.agent_addr).await;
    let _agent = AgentUnderTest::start(&pki, "cluster-a", hole.addr, &[])
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || server.tunnel_count() == 1).await,
        "the agent did not connect through the relay"
    );
    // Idle for a few keepalive periods: pings are answered, the tunnel stays.
    let started = tokio::time::Instant::now();
    assert!(
        !wait_until(Duration::from_secs(3), || server.tunnel_count() == 0).await,
        "an answering agent's tunnel was dropped"
    );
    hole.go_silent();
    let silenced = tokio::time::Instant::now();
    // 1 s idle + 20 s to answer the ping, with room for a loaded machine;
    // the default (30 s idle) would take 50 s.
    assert!(
        wait_until(Duration::from_secs(35), || server.tunnel_count() == 0).await,
        "the silent tunnel is still registered {:?} after the path went silent",
        silenced.elapsed()
    );
    eprintln!(
        "tunnel dropped {:?} after the path went silent ({:?} after it connected)",
        silenced.elapsed(),
        started.elapsed()
    );
    server.shutdown().await;
}
