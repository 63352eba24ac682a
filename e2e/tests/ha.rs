//! HA on loopback: proxy-server replicas behind the environment's load
//! balancer, agents that know only the balancer's address. Every agent must
//! reach every replica without relying on the balancer's luck, duplicate
//! tunnels must neither pile up nor fail dials, and a draining replica must
//! fail no client's dial.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_proxy_proto::transport::ALPN_HTTP11;
use proxy_agent::{ProxyAgentConfig, RunningAgent};
use simulated_cluster::balancer::{self, Selection};
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::http_connect;
use tunnel_harness::pki::TestPki;
use tunnel_harness::replicas::{DialLoop, Replicas, echo_once, start_agents, wait_full_mesh};

/// Long enough that an agent pacing its retries by the sync interval, as
/// upstream does after a duplicate, cannot make a second attempt within
/// [`CONVERGED`]; converging in time therefore cannot be the balancer's luck.
const SYNC_INTERVAL: Duration = Duration::from_secs(10);
const CONVERGED: Duration = Duration::from_secs(8);

fn clusters(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("cluster-{i}")).collect()
}

fn loopback_aliases(config: &mut ProxyAgentConfig, cluster: &str) {
    config
        .host_aliases
        .insert(cluster.to_owned(), IpAddr::V4(Ipv4Addr::LOCALHOST));
}

fn slow_sync(replicas: &Replicas, pki: &TestPki, cluster: &str) -> ProxyAgentConfig {
    let mut config = replicas.agent_config(pki, cluster).unwrap();
    config.sync_interval = SYNC_INTERVAL;
    config.sync_interval_cap = SYNC_INTERVAL;
    loopback_aliases(&mut config, cluster);
    config
}

/// Every agent reaches every replica within [`CONVERGED`], and each replica
/// ends up with exactly one tunnel per agent (duplicates are retired).
async fn converge(replica_count: usize, agent_count: usize, selection: Selection) {
    let names = clusters(agent_count);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let pki = TestPki::new(&refs).unwrap();
    let replicas = Replicas::start(&pki, replica_count, selection, |_| {})
        .await
        .unwrap();
    let configs = names
        .iter()
        .map(|c| slow_sync(&replicas, &pki, c))
        .collect();
    let started = Instant::now();
    let agents = start_agents(configs).await.unwrap();
    let took = wait_full_mesh(&agents, replica_count, started, CONVERGED).await;
    let Some(took) = took else {
        let held: Vec<Vec<String>> = agents.iter().map(RunningAgent::server_ids).collect();
        panic!(
            "{selection} balancer, {replica_count} replicas: not every agent reached every \
             replica within {CONVERGED:?}; held: {held:?}"
        );
    };
    eprintln!(
        "{selection}, {replica_count} replicas, {agent_count} agents: full mesh after {took:?}"
    );
    for server in &replicas.servers {
        assert!(
            wait_until(Duration::from_secs(10), || server.tunnel_count()
                == agent_count)
            .await,
            "{} keeps {} tunnels for {agent_count} agents",
            server.server_id,
            server.tunnel_count()
        );
    }
    for agent in agents {
        agent.shutdown().await;
    }
    replicas.shutdown().await;
}

/// The CI failure of issue 13: two agents started together behind a
/// round-robin balancer in front of two replicas kept drawing the replica
/// they already held, one retry per sync interval, for over a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_in_step_behind_round_robin_reach_both_replicas() {
    converge(2, 2, Selection::RoundRobin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_agents_behind_round_robin_reach_three_replicas() {
    converge(3, 12, Selection::RoundRobin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_behind_a_random_balancer_reach_five_replicas() {
    converge(5, 6, Selection::Random).await;
}

/// An agent that keeps dialing the Service after it holds every replica
/// (`--sync-forever`, every 50 ms) lands a duplicate tunnel every few
/// milliseconds; a replica registers each before the agent sees it is one.
/// Dials the replica routes to a duplicate must still succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dials_racing_duplicate_tunnels_do_not_fail() {
    let pki = Arc::new(TestPki::new(&["cluster-a"]).unwrap());
    let replicas = Replicas::start(&pki, 2, Selection::RoundRobin, |_| {})
        .await
        .unwrap();
    let mut config = replicas.agent_config(&pki, "cluster-a").unwrap();
    config.sync_interval = Duration::from_millis(50);
    config.sync_forever = true;
    loopback_aliases(&mut config, "cluster-a");
    let agents = start_agents(vec![config]).await.unwrap();
    assert!(
        wait_full_mesh(&agents, 2, Instant::now(), Duration::from_secs(10))
            .await
            .is_some()
    );
    // Duplicates exist on the replicas while the dials run.
    assert!(
        wait_until(Duration::from_secs(10), || replicas
            .servers
            .iter()
            .all(|s| s.tunnel_count() > 1))
        .await,
        "the agent opens no duplicate tunnels"
    );
    let echo = EchoServer::start().await.unwrap();
    let target = format!("cluster-a:{}", echo.addr.port());
    // Several dialers at once, so dials often meet a fresh duplicate.
    let dialers = (0..4).map(|dialer| {
        let (pki, target) = (pki.clone(), target.clone());
        let vias: Vec<SocketAddr> = replicas.servers.iter().map(|s| s.client_addr).collect();
        tokio::spawn(async move {
            let mut failures = Vec::new();
            for n in 0..300 {
                let via = vias[(n + dialer) % vias.len()];
                if let Err(e) = echo_once(&pki, via, &target, n / 2 + dialer).await {
                    failures.push(format!("dialer {dialer}, dial {n}: {e}"));
                }
            }
            failures
        })
    });
    let mut failures = Vec::new();
    for dialer in futures_util::future::join_all(dialers).await {
        failures.extend(dialer.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} of 1200 failed: {failures:#?}",
        failures.len()
    );
    for agent in agents {
        agent.shutdown().await;
    }
    replicas.shutdown().await;
}

/// A replica stopping (what SIGTERM does) drains: its agents are told DRAIN,
/// it stops accepting, and connections it already carries run to their end.
/// Clients dialing through a balancer in front of the replicas' client ports
/// (the hub Service) see no failed dial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_fails_no_dial() {
    let grace = Duration::from_secs(60);
    let pki = Arc::new(TestPki::new(&["cluster-a", "cluster-b"]).unwrap());
    let mut replicas = Replicas::start(&pki, 2, Selection::RoundRobin, |config| {
        config.graceful_shutdown_timeout = grace;
    })
    .await
    .unwrap();
    let mut configs = Vec::new();
    for cluster in ["cluster-a", "cluster-b"] {
        let mut config = replicas.agent_config(&pki, cluster).unwrap();
        loopback_aliases(&mut config, cluster);
        configs.push(config);
    }
    let agents = start_agents(configs).await.unwrap();
    assert!(
        wait_full_mesh(&agents, 2, Instant::now(), Duration::from_secs(10))
            .await
            .is_some()
    );
    let echo = EchoServer::start().await.unwrap();
    let targets: Vec<String> = ["cluster-a", "cluster-b"]
        .iter()
        .map(|c| format!("{c}:{}", echo.addr.port()))
        .collect();

    let hub_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hub_service = hub_listener.local_addr().unwrap();
    let frontends = replicas.servers.iter().map(|s| s.client_addr).collect();
    let hub_balancer = tokio::spawn(balancer::serve(
        hub_listener,
        frontends,
        Selection::RoundRobin,
    ));

    // A connection through replica 0 that outlives the start of its drain.
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let mut long_lived = http_connect(tls, replicas.servers[0].client_addr, &targets[0])
        .await
        .unwrap();
    let mut round_trip = async |payload: &[u8]| {
        long_lived.write_all(payload).await.unwrap();
        let mut back = vec![0u8; payload.len()];
        long_lived.read_exact(&mut back).await.unwrap();
        assert_eq!(back, payload);
    };
    round_trip(b"before").await;

    let dials = DialLoop::start(pki.clone(), hub_service, targets.clone());
    dials.wait_for(50, Duration::from_secs(30)).await;

    let draining = replicas.servers.remove(0);
    let drained = tokio::spawn(draining.shutdown());
    assert!(
        wait_until(Duration::from_secs(10), || agents
            .iter()
            .all(|a| a.active_tunnel_count() == 1))
        .await,
        "agents did not take DRAIN from the stopping replica"
    );
    dials.wait_for(100, Duration::from_secs(30)).await;
    round_trip(b"while draining").await;
    dials.wait_for(100, Duration::from_secs(30)).await;

    // The drain ends when its last connection does, long before the grace.
    drop(long_lived);
    tokio::time::timeout(Duration::from_secs(15), drained)
        .await
        .expect("the drained replica stops once its connections are done")
        .unwrap();
    dials.wait_for(50, Duration::from_secs(30)).await;
    let (done, failures) = dials.finish().await;
    eprintln!("{done} dials while replica 0 drained and stopped");
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

/// A replacement that comes back under the draining replica's server id (a
/// restarted pod with a fixed `--server-id`) is a new replica to the agent,
/// not a duplicate: the agent holds it while the old one still drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_reusing_the_server_id_is_reached_while_the_old_one_drains() {
    let grace = Duration::from_secs(60);
    let configure = |config: &mut proxy_server::settings::ProxyServerSettings| {
        config.graceful_shutdown_timeout = grace;
    };
    let pki = TestPki::new(&["cluster-a"]).unwrap();
    let mut replicas = Replicas::start(&pki, 2, Selection::RoundRobin, configure)
        .await
        .unwrap();
    let mut config = replicas.agent_config(&pki, "cluster-a").unwrap();
    loopback_aliases(&mut config, "cluster-a");
    let agents = start_agents(vec![config]).await.unwrap();
    let agent = &agents[0];
    assert!(
        wait_full_mesh(&agents, 2, Instant::now(), Duration::from_secs(10))
            .await
            .is_some()
    );
    let echo = EchoServer::start().await.unwrap();
    let target = format!("cluster-a:{}", echo.addr.port());
    // Keeps the old replica draining for as long as the test needs.
    let tls = pki.client_tls_alpn(&[ALPN_HTTP11]).unwrap();
    let mut long_lived = http_connect(tls, replicas.servers[0].client_addr, &target)
        .await
        .unwrap();

    let old = replicas.servers.remove(0);
    let (client_addr, agent_addr) = (old.client_addr, old.agent_addr);
    let drained = tokio::spawn(old.shutdown());
    assert!(
        wait_until(Duration::from_secs(10), || agent.active_tunnel_count() == 1).await,
        "the agent did not take DRAIN"
    );
    replicas
        .replace(&pki, 0, client_addr, agent_addr, "server-0", configure)
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || agent.active_tunnel_count() == 2).await,
        "the agent does not hold the replacement; it holds {:?}",
        agent.server_ids()
    );
    assert!(
        !drained.is_finished(),
        "the old replica stopped draining early"
    );
    // Both the old replica's connection and the replacement carry traffic.
    long_lived.write_all(b"old").await.unwrap();
    let mut back = [0u8; 3];
    long_lived.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"old");
    echo_once(&pki, replicas.servers[0].client_addr, &target, 0)
        .await
        .unwrap();
    drop(long_lived);
    tokio::time::timeout(Duration::from_secs(15), drained)
        .await
        .expect("the old replica stops once its connection is done")
        .unwrap();
    echo_once(&pki, replicas.servers[0].client_addr, &target, 1)
        .await
        .unwrap();
    for agent in agents {
        agent.shutdown().await;
    }
    replicas.shutdown().await;
}
