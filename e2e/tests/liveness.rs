//! A tunnel whose other end goes silent — a relay in between stops
//! forwarding but keeps both TCP connections open, so neither FIN, RST nor
//! a TCP keepalive failure ever arrives — is noticed by the pings of
//! `--keepalive-time` on both sides, in either framing of the tunnel (the
//! lean framing between our own ends, gRPC's HTTP/2 with anyone else): the agent stops counting the tunnel
//! and the server drops it within keepalive + the 20 s ping timeout, and
//! the agent reconnects once the path works again.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use simulated_cluster::wait::wait_until;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tunnel_harness::in_process::{AgentUnderTest, test_server_config};
use tunnel_harness::pki::TestPki;

const KEEPALIVE: Duration = Duration::from_secs(1);
/// The fixed time both sides give a PING to be answered.
const PING_TIMEOUT: Duration = Duration::from_secs(20);
const STEP: Duration = Duration::from_secs(10);

/// A TCP relay to `upstream` that can be switched into a black hole: its
/// connections stop carrying bytes (and new ones carry none) until healed.
struct Relay {
    addr: SocketAddr,
    /// Cancelled when the current connections should go silent.
    forwarding: Arc<Mutex<CancellationToken>>,
    stop: CancellationToken,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let forwarding = Arc::new(Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        let relay = Relay {
            addr,
            forwarding: forwarding.clone(),
            stop: stop.clone(),
        };
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                let silence = forwarding.lock().unwrap().clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    // Held, never read, while the path is a black hole.
                    let held = client;
                    if silence.is_cancelled() {
                        stop.cancelled().await;
                        drop(held);
                        return;
                    }
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut client_read, mut client_write) = held.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    tokio::select! {
                        _ = tokio::io::copy(&mut client_read, &mut server_write) => {}
                        _ = tokio::io::copy(&mut server_read, &mut client_write) => {}
                        _ = silence.cancelled() => {
                            // Keep all four halves open, carrying nothing.
                            stop.cancelled().await;
                        }
                    }
                });
            }
        });
        relay
    }

    /// Every connection, current and new, stops carrying bytes.
    fn black_hole(&self) {
        self.forwarding.lock().unwrap().cancel();
    }

    /// New connections carry bytes again.
    fn heal(&self) {
        *self.forwarding.lock().unwrap() = CancellationToken::new();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_dead_path_is_noticed_by_both_sides_and_the_agent_reconnects() {
    silently_dead_path(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_on_grpc_over_http2() {
    silently_dead_path(false).await;
}

async fn silently_dead_path(lean_framing: bool) {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.keepalive_time = KEEPALIVE;
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    let relay = Relay::start(server.agent_addr).await;

    let mut agent_config = proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Config(
        pki.agent_tls("cluster-a").unwrap(),
    ))
    .with_ephemeral_ports();
    agent_config.proxy_server_host = "localhost".into();
    agent_config.proxy_server_port = relay.addr.port();
    agent_config.agent_id = "cluster-a-agent".into();
    agent_config.agent_identifiers = "host=cluster-a".into();
    agent_config.sync_interval = Duration::from_millis(200);
    agent_config.keepalive_time = KEEPALIVE;
    agent_config.lean_framing = lean_framing;
    let agent = AgentUnderTest::start_with(agent_config).await.unwrap();
    let agent_tunnels = || {
        agent
            .agent()
            .map_or(-1, |a| a.metrics().open_server_connections.get())
    };
    assert!(wait_until(STEP, || server.tunnel_count() == 1 && agent_tunnels() == 1).await);

    relay.black_hole();
    let silenced = Instant::now();
    let bound = KEEPALIVE + PING_TIMEOUT + STEP;
    assert!(
        wait_until(bound, || agent_tunnels() == 0).await,
        "the agent still counts its tunnel {:?} after the path went silent",
        silenced.elapsed()
    );
    let agent_noticed = silenced.elapsed();
    assert!(
        wait_until(bound.saturating_sub(agent_noticed), || server
            .tunnel_count()
            == 0)
        .await,
        "the server still holds the tunnel {:?} after the path went silent",
        silenced.elapsed()
    );
    let server_noticed = silenced.elapsed();
    println!(
        "silent path noticed: agent after {agent_noticed:?}, server after {server_noticed:?} \
         (keepalive {KEEPALIVE:?} + ping timeout {PING_TIMEOUT:?})"
    );

    relay.heal();
    assert!(
        wait_until(STEP * 2, || server.tunnel_count() == 1
            && agent_tunnels() == 1)
        .await,
        "the agent did not reconnect once the path worked again"
    );
    agent.shutdown().await;
    server.shutdown().await;
}
