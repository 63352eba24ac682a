//! Scaling the proxy-server replicas with no restart and no flag change:
//! replicas count their peers (`--server-count-source`, here a peer set the
//! test drives instead of DNS) and tell agents that negotiated it at once
//! with a SERVER_COUNT packet; upstream-style agents never see one.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_proxy_proto::metadata;
use cluster_proxy_proto::packet::{self, Frame};
use prost::Message;
use proxy_agent::RunningAgent;
use proxy_server::RunningServer;
use proxy_server::peers::PeerLookup;
use simulated_cluster::balancer::{self, Backends, Selection};
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::wait_until;
use tunnel_harness::in_process::{RawAgent, health_get, test_server_config};
use tunnel_harness::pki::TestPki;
use tunnel_harness::replicas::{
    DialLoop, PEER_REFRESH, PeerSet, Replicas, start_agents, wait_full_mesh,
};

/// Agents wait this long between attempts once they hold every replica
/// they know of, so only the SERVER_COUNT packet can bring them to a new
/// replica within [`CONVERGED`].
const SYNC_INTERVAL: Duration = Duration::from_secs(10);
const CONVERGED: Duration = Duration::from_secs(8);
const STEP: Duration = Duration::from_secs(10);

fn clusters(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("cluster-{i}")).collect()
}

/// Waits until every agent holds `server_id` and knows of `count` replicas;
/// panics with what each holds otherwise.
async fn wait_all_hold(agents: &[RunningAgent], server_id: &str, count: usize, since: Instant) {
    let reached = wait_until(CONVERGED.saturating_sub(since.elapsed()), || {
        agents.iter().all(|a| {
            a.server_ids().iter().any(|id| id == server_id) && a.known_server_count() == count
        })
    })
    .await;
    assert!(
        reached,
        "not every agent reached {server_id} within {CONVERGED:?} of the scale-up; held: {:?}, known counts: {:?}",
        agents
            .iter()
            .map(RunningAgent::server_ids)
            .collect::<Vec<_>>(),
        agents
            .iter()
            .map(RunningAgent::known_server_count)
            .collect::<Vec<_>>()
    );
}

/// 2 → 3 → 2 replicas while a client dials continuously, agents behind a
/// round-robin balancer with a sync interval longer than the bound: every
/// agent holds the new replica within [`CONVERGED`] (the SERVER_COUNT
/// packet, not a periodic retry), stops counting the removed one, and no
/// dial fails. The client's balancer follows the replicas' `/readyz` as a
/// Service does: the new replica is not ready when it starts, becomes
/// ready only once it holds every agent its peers hold, and joins then; a
/// leaving one leaves before it drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_two_three_two_reaches_every_replica_and_fails_no_dial() {
    let agent_count = 6;
    let names = clusters(agent_count);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let pki = Arc::new(TestPki::new(&refs).unwrap());
    let grace = |config: &mut proxy_server::settings::ProxyServerSettings| {
        config.graceful_shutdown_timeout = Duration::from_secs(30);
    };
    let mut replicas = Replicas::start_scalable(&pki, 2, Selection::RoundRobin, grace)
        .await
        .unwrap();
    let configs = names
        .iter()
        .map(|cluster| {
            let mut config = replicas.agent_config(&pki, cluster).unwrap();
            config.sync_interval = SYNC_INTERVAL;
            config.sync_interval_cap = SYNC_INTERVAL;
            config
                .host_aliases
                .insert(cluster.clone(), IpAddr::V4(Ipv4Addr::LOCALHOST));
            config
        })
        .collect();
    let agents = start_agents(configs).await.unwrap();
    assert!(
        wait_full_mesh(&agents, 2, Instant::now(), STEP)
            .await
            .is_some(),
        "no full mesh of 2 replicas"
    );

    let echo = EchoServer::start().await.unwrap();
    let targets: Vec<String> = names
        .iter()
        .map(|c| format!("{c}:{}", echo.addr.port()))
        .collect();
    let hub_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hub_service = hub_listener.local_addr().unwrap();
    let ready = Backends::new(replicas.servers.iter().map(|s| s.client_addr).collect());
    let hub_balancer = tokio::spawn(balancer::serve_backends(
        hub_listener,
        ready.clone(),
        Selection::RoundRobin,
    ));
    let dials = DialLoop::start(pki.clone(), hub_service, targets);
    dials.wait_for(20, Duration::from_secs(30)).await;

    // Up: a third replica, counted by its peers a refresh later.
    let scaled_up = Instant::now();
    let index = replicas.scale_up(&pki, grace).await.unwrap();
    let new_id = replicas.servers[index].server_id.clone();
    let new_health = replicas.servers[index].health_addr;
    let (status, body) = health_get(new_health, "/readyz").await.unwrap();
    assert_eq!(
        status, 503,
        "a new replica was ready before any agent: {body}"
    );
    let became_ready = loop {
        let (status, body) = health_get(new_health, "/readyz").await.unwrap();
        if status == 200 {
            break scaled_up.elapsed();
        }
        assert!(body.starts_with("waiting for agents"), "{status} {body}");
        assert!(
            scaled_up.elapsed() < CONVERGED,
            "{new_id} not ready {CONVERGED:?} after the scale-up: {body}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let held = health_get(new_health, "/agent-count").await.unwrap();
    assert_eq!(
        held,
        (200, format!("{agent_count}\n")),
        "{new_id} became ready holding fewer agents than its peers"
    );
    wait_all_hold(&agents, &new_id, 3, scaled_up).await;
    eprintln!(
        "{new_id} ready {became_ready:?} after the scale-up; every agent held it {:?} after",
        scaled_up.elapsed()
    );
    ready.add(replicas.servers[index].client_addr);
    for server in &replicas.servers {
        assert_eq!(server.server_count(), 3, "{}", server.server_id);
        assert!(
            wait_until(STEP, || server.tunnel_count() == agent_count).await,
            "{} keeps {} tunnels for {agent_count} agents",
            server.server_id,
            server.tunnel_count()
        );
    }
    dials.wait_for(50, Duration::from_secs(30)).await;

    // Down: the last replica leaves the client Service, drains, and its
    // peers stop counting it.
    ready.remove(replicas.servers[index].client_addr);
    let drained = replicas.scale_down().unwrap();
    assert!(
        wait_until(STEP, || agents.iter().all(
            |a| a.known_server_count() == 2 && a.active_tunnel_count() == 2
        ))
        .await,
        "agents did not settle on 2 replicas: known {:?}, active {:?}",
        agents
            .iter()
            .map(RunningAgent::known_server_count)
            .collect::<Vec<_>>(),
        agents
            .iter()
            .map(RunningAgent::active_tunnel_count)
            .collect::<Vec<_>>()
    );
    tokio::time::timeout(Duration::from_secs(40), drained)
        .await
        .expect("the removed replica finished draining")
        .unwrap();
    // Agents stop looking for the removed replica: the duplicates they
    // drew while it drained are retired and none pile up.
    for server in &replicas.servers {
        assert!(
            wait_until(STEP, || server.tunnel_count() == agent_count).await,
            "{} keeps {} tunnels for {agent_count} agents after the scale-down",
            server.server_id,
            server.tunnel_count()
        );
    }
    dials.wait_for(50, Duration::from_secs(30)).await;
    let (done, failures) = dials.finish().await;
    eprintln!("{done} dials while scaling 2 → 3 → 2");
    assert!(
        failures.is_empty(),
        "{} of {done} dials failed: {failures:#?}",
        failures.len()
    );
    hub_balancer.abort();
    for agent in agents {
        agent.shutdown().await;
    }
    replicas.shutdown().await;
}

/// A replica its agents cannot reach (it is not behind their balancer)
/// still becomes ready once `--readiness-agent-wait` has passed, so a
/// broken path cannot stall a rollout; before that `/readyz` says what it
/// waits for.
#[tokio::test]
async fn a_replica_agents_cannot_reach_is_ready_after_the_agent_wait() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let wait = |config: &mut proxy_server::settings::ProxyServerSettings| {
        config.readiness_agent_wait = Duration::from_secs(2);
    };
    let mut replicas = Replicas::start_scalable(&pki, 1, Selection::RoundRobin, wait)
        .await
        .unwrap();
    let agents = start_agents(vec![replicas.agent_config(&pki, "cluster-a").unwrap()])
        .await
        .unwrap();
    assert!(
        wait_until(STEP, || replicas.servers[0].tunnel_count() == 1).await,
        "the agent never reached the first replica"
    );
    let first = replicas.servers[0].health_addr;
    assert!(
        wait_until_ready(first, STEP).await,
        "a replica holding every agent is not ready"
    );

    let index = replicas.scale_up(&pki, wait).await.unwrap();
    let unreachable = replicas.servers[index].agent_addr;
    replicas.agent_backends.remove(unreachable);
    let started = Instant::now();
    let health = replicas.servers[index].health_addr;
    let mut seen_waiting = None;
    while started.elapsed() < Duration::from_secs(1) {
        let (status, body) = health_get(health, "/readyz").await.unwrap();
        assert_eq!(status, 503, "ready before the wait passed: {body}");
        if body == "waiting for agents: holding 0 of the 1 another replica holds" {
            seen_waiting = Some(body);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        seen_waiting.is_some(),
        "/readyz never said what it waits for"
    );
    assert!(
        wait_until_ready(health, STEP).await,
        "not ready after the agent wait"
    );
    assert_eq!(replicas.servers[index].tunnel_count(), 0);
    for agent in agents {
        agent.shutdown().await;
    }
    replicas.shutdown().await;
}

async fn wait_until_ready(health: SocketAddr, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if matches!(health_get(health, "/readyz").await, Ok((200, _))) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

async fn scalable_server(pki: &TestPki, peers: &PeerSet, count: u32) -> RunningServer {
    let mut config = test_server_config();
    config.server_id = "server-0".into();
    config.server_count = count;
    config.server_count_refresh_interval = PEER_REFRESH;
    let lookup: Arc<dyn PeerLookup> = Arc::new(peers.clone());
    proxy_server::start_with_peers(config, pki.server_tls().unwrap(), Some(lookup))
        .await
        .unwrap()
}

async fn raw_agent(
    pki: &TestPki,
    server: &RunningServer,
    extensions: &[(&'static str, &'static str)],
) -> RawAgent {
    RawAgent::connect_with(
        extensions,
        pki.agent_tls("cluster-a").unwrap(),
        server.agent_addr,
        "agent-a",
        "host=cluster-a",
    )
    .await
    .unwrap()
}

/// The exact bytes of a SERVER_COUNT packet go only to an agent that
/// advertised the extension; an upstream-style agent on the same replica
/// gets nothing before the DRAIN of the shutdown, and learns the new count
/// from its next Connect's `servercount` header only.
#[tokio::test]
async fn only_agents_that_advertise_it_are_sent_the_server_count() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let peers = PeerSet::new(2);
    let server = scalable_server(&pki, &peers, 2).await;
    let mut upstream = raw_agent(&pki, &server, &[]).await;
    let mut extended = raw_agent(
        &pki,
        &server,
        &[(
            metadata::SERVER_COUNT_UPDATES,
            metadata::SERVER_COUNT_UPDATES_V1,
        )],
    )
    .await;
    assert_eq!(upstream.headers.get(metadata::SERVER_COUNT).unwrap(), "2");
    assert!(wait_until(STEP, || server.tunnel_count() == 2).await);

    peers.set_count(3);
    let update = extended.recv(STEP).await.expect("a SERVER_COUNT packet");
    // type 101, payload field 101, count 3.
    assert_eq!(
        update.encode_to_vec(),
        vec![0x08, 0x65, 0xaa, 0x06, 0x02, 0x08, 0x03]
    );
    assert_eq!(Frame::from_packet(update), Frame::ServerCount { count: 3 });
    assert_eq!(server.server_count(), 3);
    let later = raw_agent(&pki, &server, &[]).await;
    assert_eq!(later.headers.get(metadata::SERVER_COUNT).unwrap(), "3");

    server.shutdown().await;
    let first = upstream
        .recv(STEP)
        .await
        .expect("DRAIN from the stopping server");
    assert_eq!(
        first,
        packet::drain(),
        "an upstream-style agent got {first:?}"
    );
    drop(later);
}

fn peer_lookup_failures(server: &RunningServer) -> u64 {
    server
        .metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix("cluster_proxy_server_peer_lookup_failures_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A lookup that fails or finds no replica keeps the last count: agents
/// are told nothing (least of all 0), the failures are counted, and the
/// next good answer is announced as usual.
#[tokio::test]
async fn a_failed_or_empty_peer_lookup_keeps_the_last_count() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let peers = PeerSet::new(2);
    let server = scalable_server(&pki, &peers, 2).await;
    let mut extended = raw_agent(
        &pki,
        &server,
        &[(
            metadata::SERVER_COUNT_UPDATES,
            metadata::SERVER_COUNT_UPDATES_V1,
        )],
    )
    .await;
    peers.set(Err("no such host".into()));
    assert!(wait_until(STEP, || peer_lookup_failures(&server) >= 2).await);
    assert_eq!(server.server_count(), 2);
    peers.set(Ok(Vec::new()));
    let before = peer_lookup_failures(&server);
    assert!(wait_until(STEP, || peer_lookup_failures(&server) >= before + 2).await);
    assert_eq!(server.server_count(), 2);
    let header = raw_agent(&pki, &server, &[]).await;
    assert_eq!(header.headers.get(metadata::SERVER_COUNT).unwrap(), "2");

    peers.set_count(4);
    let update = extended.recv(STEP).await.expect("a SERVER_COUNT packet");
    assert_eq!(
        Frame::from_packet(update),
        Frame::ServerCount { count: 4 },
        "the first packet after the failures is the next good count"
    );
    server.shutdown().await;
}

/// `--server-count-source=dns:<name>` with a name that does not resolve:
/// the replica starts, keeps `--server-count`, warns and counts the failure.
#[tokio::test]
async fn an_unresolvable_dns_source_keeps_the_configured_count() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut config = test_server_config();
    config.server_count = 3;
    config.server_count_source = "dns:cluster-proxy-peers.invalid".into();
    config.server_count_refresh_interval = PEER_REFRESH;
    let server = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || peer_lookup_failures(&server)
            >= 1)
        .await,
        "no lookup failure counted"
    );
    assert_eq!(server.server_count(), 3);
    server.shutdown().await;
}

/// A malformed source is refused at startup, naming the flag.
#[tokio::test]
async fn a_malformed_server_count_source_is_refused() {
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    for source in ["dns:", "leases", "dns:two words"] {
        let mut config = test_server_config();
        config.server_count_source = source.into();
        let err = proxy_server::start_with_tls(config, pki.server_tls().unwrap())
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("server-count-source"), "{source}: {err}");
    }
}
