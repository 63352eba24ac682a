//! Scenario tests on the local multi-cluster environment (`e2e::env`):
//! every service a real process, each managed cluster in its own network
//! namespace when the machine allows it (root and `ip netns`; CI=true
//! requires it), loopback otherwise.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use e2e::env::client::{Frontend, HubClient};
use e2e::env::{EnvOptions, Environment, Isolation, IsolationChoice};
use simulated_cluster::sample;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const READY: Duration = Duration::from_secs(60);

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Network namespaces where possible; under CI they are required.
fn options(clusters: usize) -> EnvOptions {
    let mut options = EnvOptions::new(clusters);
    options.isolation = if under_ci() {
        IsolationChoice::Netns
    } else {
        IsolationChoice::Auto
    };
    options
}

async fn start(options: EnvOptions) -> Environment {
    let env = Environment::start(options)
        .await
        .unwrap_or_else(|e| panic!("starting the environment: {e}"));
    if let Isolation::Loopback(reason) = &env.summary.isolation {
        eprintln!("NOTE: running on loopback without network isolation: {reason}");
    }
    if let Err(err) = env.wait_ready(READY).await {
        dump_logs(&env);
        panic!("{err}");
    }
    env
}

fn dump_logs(env: &Environment) {
    let mut names = vec![
        "cert-authority".to_string(),
        "cert-authority-kube".into(),
        "agent-lb".into(),
    ];
    names.extend(env.replicas.iter().map(|r| r.name.clone()));
    for cluster in &env.clusters {
        names.push(format!("{}/proxy-agent", cluster.name));
        names.push(format!("{}/services", cluster.name));
    }
    for name in names {
        eprintln!("----- {name} -----\n{}", env.logs.tail(&name, 30));
    }
}

/// `true` when the netns-only part of a test can run; otherwise says why
/// (and fails under CI, where namespaces are required).
fn netns_or_skip(env: &Environment, what: &str) -> bool {
    match &env.summary.isolation {
        Isolation::Netns => true,
        Isolation::Loopback(reason) => {
            assert!(
                !under_ci(),
                "CI=true requires network namespaces for {what}: {reason}"
            );
            eprintln!("SKIPPED: {what} needs network namespaces (root and `ip netns`): {reason}");
            false
        }
    }
}

async fn wait_for<F, Fut>(timeout: Duration, mut check: F) -> Result<Duration, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(()) => return Ok(started.elapsed()),
            Err(err) if started.elapsed() > timeout => {
                return Err(format!("still failing after {timeout:?}: {err}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Waits until `cluster` answers through `replica` over gRPC; how long that
/// took. Fails the test with every log's tail otherwise.
async fn await_reach(
    env: &Environment,
    client: &HubClient,
    replica: usize,
    cluster: usize,
    within: Duration,
) -> Duration {
    wait_for(within, || {
        env.check_reachable(client, replica, cluster, Frontend::Grpc)
    })
    .await
    .unwrap_or_else(|e| {
        dump_logs(env);
        panic!(
            "{} not reachable through replica {replica}: {e}",
            env.clusters[cluster].name
        )
    })
}

fn client(env: &Environment) -> HubClient {
    env.hub_client()
        .expect("hub client credentials")
        .with_timeout(Duration::from_secs(5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cluster_answers_by_name_through_every_replica_and_frontend() {
    let env = start(options(3)).await;
    let client = client(&env);
    for replica in 0..env.replicas.len() {
        for cluster in &env.clusters {
            for frontend in [Frontend::Grpc, Frontend::HttpConnect] {
                let server = env.client_addr(replica);
                let http = format!("{}:{}", cluster.name, sample::HTTP_PORT);
                let body = client
                    .http_get(frontend, server, &http, "/")
                    .await
                    .unwrap_or_else(|e| panic!("{http} via replica {replica} ({frontend}): {e}"));
                assert_eq!(body, sample::greeting(&cluster.name), "via {frontend}");

                // TLS end to end to the stand-in kube-apiserver, verified
                // against the cluster's own CA (the proxy sees only bytes).
                let ca = std::fs::read_to_string(&cluster.apiserver_ca).unwrap();
                let https = format!("{}:{}", cluster.name, sample::APISERVER_PORT);
                let health = client
                    .https_get(frontend, server, &https, "/healthz", &ca)
                    .await
                    .unwrap_or_else(|e| panic!("{https} via replica {replica} ({frontend}): {e}"));
                assert_eq!(health, "ok");
            }
        }
    }
    // The environment's Kubernetes API answers with the kubeconfig it wrote.
    let kubeconfig = env.summary.kubeconfig.clone().expect("a kubeconfig");
    let kube = memory_apiserver::KubeApi::client_from(&kubeconfig)
        .await
        .unwrap();
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(kube);
    let names: Vec<String> = namespaces
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert!(names.contains(&"default".to_string()), "{names:?}");
    // cert-authority's kubernetes backend keeps the hub Secrets there.
    let kube = memory_apiserver::KubeApi::client_from(&kubeconfig)
        .await
        .unwrap();
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(kube, e2e::env::ADDON_NAMESPACE);
    let found = wait_for(Duration::from_secs(20), || {
        let secrets = secrets.clone();
        async move {
            match secrets.get_opt("proxy-server").await {
                Ok(Some(_)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    if let Err(err) = found {
        eprintln!("{}", env.logs.tail("cert-authority-kube", 40));
        panic!("no proxy-server Secret from cert-authority's kubernetes backend: {err}");
    }

    // A cluster no agent serves is refused, not routed elsewhere.
    let err = client
        .http_get(
            Frontend::HttpConnect,
            env.client_addr(0),
            "cluster-z:8080",
            "/",
        )
        .await
        .expect_err("no agent serves cluster-z");
    assert!(err.to_string().contains("500"), "{err}");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_reaches_managed_services_only_through_the_tunnel() {
    let env = start(options(2)).await;
    if !netns_or_skip(&env, "network isolation") {
        env.shutdown().await;
        return;
    }
    let service = SocketAddr::new(env.clusters[0].service_ip, sample::HTTP_PORT);

    // Inside the cluster the service answers (so a failure below is the
    // network, not a dead service) ...
    let (ok, detail) = env
        .probe_from(env.clusters[0].netns.as_deref(), service)
        .await
        .unwrap();
    assert!(
        ok,
        "the service must answer inside its own cluster: {detail}"
    );

    // ... but the hub has no route to it, nor to the cluster's outside
    // address on the service port.
    let (ok, detail) = env.probe_from_hub(service).await.unwrap();
    assert!(!ok, "the hub reached {service} directly: {detail}");
    for cluster in &env.clusters {
        let (ok, detail) = env
            .probe_from_hub(SocketAddr::new(cluster.service_ip, sample::ECHO_PORT))
            .await
            .unwrap();
        assert!(
            !ok,
            "the hub reached {}'s echo service: {detail}",
            cluster.name
        );
    }

    // A cluster reaches the hub only at the agent Service, not at the
    // replicas' client or health ports.
    let cluster_ns = env.clusters[0].netns.as_deref();
    let (ok, detail) = env
        .probe_from(cluster_ns, env.summary.agent_service_addr)
        .await
        .unwrap();
    assert!(
        ok,
        "the agent Service must be reachable from a cluster: {detail}"
    );
    for port in [env.replicas[0].ports.client, env.replicas[0].ports.health] {
        let addr = SocketAddr::new(env.summary.hub_addr, port);
        let (ok, detail) = env.probe_from(cluster_ns, addr).await.unwrap();
        assert!(!ok, "a cluster reached the hub's {addr}: {detail}");
    }

    // The control plane's Kubernetes API is reachable from the hub (where
    // hub services run), not from a managed cluster.
    let kube_api = env
        .summary
        .kube_api
        .expect("the environment starts a Kubernetes API");
    let (ok, detail) = env.probe_from_hub(kube_api).await.unwrap();
    assert!(ok, "the hub must reach the Kubernetes API: {detail}");
    let (ok, detail) = env.probe_from(cluster_ns, kube_api).await.unwrap();
    assert!(!ok, "a cluster reached the hub's Kubernetes API: {detail}");

    // And through the tunnel the same service answers by cluster name.
    let body = client(&env)
        .http_get(
            Frontend::Grpc,
            env.client_addr(0),
            &format!("{}:{}", env.clusters[0].name, sample::HTTP_PORT),
            "/",
        )
        .await
        .unwrap();
    assert_eq!(body, sample::greeting(&env.clusters[0].name));
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_restores_reach_within_seconds() {
    let mut env = start(options(2)).await;
    let client = client(&env);

    env.clusters[0].agent.kill().await;
    // Both replicas notice the tunnel is gone; dials fail at once instead of
    // hanging.
    for replica in 0..env.replicas.len() {
        let elapsed = wait_for(Duration::from_secs(10), || {
            let result = env.check_reachable(&client, replica, 0, Frontend::Grpc);
            async move {
                match result.await {
                    Ok(()) => Err("still reachable".to_string()),
                    Err(_) => Ok(()),
                }
            }
        })
        .await
        .unwrap();
        assert!(elapsed < Duration::from_secs(10));
    }
    // The other cluster is untouched.
    env.check_reachable(&client, 0, 1, Frontend::Grpc)
        .await
        .unwrap();

    env.clusters[0].agent.restart().await.unwrap();
    env.processes_changed();
    for replica in 0..env.replicas.len() {
        let restored = await_reach(&env, &client, replica, 0, Duration::from_secs(15)).await;
        eprintln!("reach through replica {replica} restored after {restored:?}");
    }
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cluster_stays_reachable_when_a_replica_dies() {
    let mut env = start(options(3)).await;
    let client = client(&env);
    env.replicas[0].process.kill().await;

    // The survivor already holds a tunnel from every agent: no waiting.
    for cluster in 0..env.clusters.len() {
        for frontend in [Frontend::Grpc, Frontend::HttpConnect] {
            env.check_reachable(&client, 1, cluster, frontend)
                .await
                .unwrap_or_else(|e| panic!("{} via the survivor: {e}", env.clusters[cluster].name));
        }
    }
    // The dead replica fails fast and clearly.
    let err = client
        .http_get(
            Frontend::Grpc,
            env.client_addr(0),
            &format!("{}:{}", env.clusters[0].name, sample::HTTP_PORT),
            "/",
        )
        .await
        .expect_err("replica 0 is dead");
    assert!(err.to_string().contains("proxy-server"), "{err}");

    // Brought back, it gets every agent again (they keep dialing the
    // Service until they hold a tunnel to each of `servercount` replicas).
    env.replicas[0].process.restart().await.unwrap();
    env.processes_changed();
    for cluster in 0..env.clusters.len() {
        await_reach(&env, &client, 0, cluster, Duration::from_secs(30)).await;
    }
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_claiming_another_cluster_is_refused() {
    let mut env = start(options(2)).await;
    let client = client(&env);
    let victim = env.clusters[1].name.clone();
    // cluster-a's certificate, registering as cluster-b, from inside
    // cluster-a (where "cluster-b" would resolve to cluster-a's services).
    let mut impostor = env.start_impostor(0, &victim).unwrap();
    let log_name = impostor.name().to_string();
    wait_for(Duration::from_secs(15), || {
        let log = env.logs.tail(&log_name, 50);
        async move {
            if log.contains("cannot connect to proxy-server") && log.contains("cluster") {
                Ok(())
            } else {
                Err(format!("no refusal in the impostor's log yet:\n{log}"))
            }
        }
    })
    .await
    .unwrap();
    let server_log = env.logs.tail("proxy-server-0", 200) + &env.logs.tail("proxy-server-1", 200);
    assert!(
        server_log.contains(&victim) && server_log.contains("refus"),
        "the servers say nothing about refusing the impostor:\n{server_log}"
    );

    // Every request for cluster-b still lands in cluster-b.
    for i in 0..20 {
        let replica = i % env.replicas.len();
        let body = client
            .http_get(
                Frontend::Grpc,
                env.client_addr(replica),
                &format!("{victim}:{}", sample::HTTP_PORT),
                "/",
            )
            .await
            .unwrap();
        assert_eq!(body, sample::greeting(&victim), "request {i}");
    }
    impostor.kill().await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_rotate_under_traffic_without_dropping_connections() {
    let mut options = options(1);
    // Leaves live 30 s and are renewed between 2/3 and 13/15 of that (20
    // to 26 s); servers and agents look for new files every second.
    options.leaf_validity = "30s".into();
    options.ca_interval = "1s".into();
    options.credential_reload_interval = "1s".into();
    let env = start(options).await;
    let client = client(&env);
    let pki = env.summary.pki_dir.clone();
    let server_cert = std::fs::read(pki.join("proxy-server/tls.crt")).unwrap();
    let agent_cert_path = pki.join(format!("agents/{}/tls.crt", env.clusters[0].name));
    let agent_cert = std::fs::read(&agent_cert_path).unwrap();

    // One long-lived connection through the tunnel, echoing all along.
    let target = format!("{}:{}", env.clusters[0].name, sample::ECHO_PORT);
    let mut stream = client
        .dial(Frontend::Grpc, env.client_addr(0), &target)
        .await
        .unwrap();
    let started = Instant::now();
    let mut rounds = 0u32;
    let mut rotated = false;
    while started.elapsed() < Duration::from_secs(45) {
        let message = format!("round {rounds}\n");
        stream.write_all(message.as_bytes()).await.unwrap();
        let mut echoed = vec![0u8; message.len()];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut echoed))
            .await
            .unwrap_or_else(|_| panic!("echo stalled in round {rounds}"))
            .unwrap_or_else(|e| panic!("connection dropped in round {rounds}: {e}"));
        assert_eq!(echoed, message.as_bytes());
        rounds += 1;
        let server_now = std::fs::read(pki.join("proxy-server/tls.crt")).unwrap();
        let agent_now = std::fs::read(&agent_cert_path).unwrap();
        if server_now != server_cert && agent_now != agent_cert {
            rotated = true;
            // Keep the traffic going past the reload interval so both ends
            // serve new handshakes with the new credentials meanwhile.
            if started.elapsed() > Duration::from_secs(3) && rounds.is_multiple_of(30) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(rotated, "cert-authority renewed nothing within 45 s");
    // New handshakes get the new server certificate (the reloader polls
    // every second), and new tunnels and client connections work.
    let current = std::fs::read(pki.join("proxy-server/tls.crt")).unwrap();
    wait_for(Duration::from_secs(10), || {
        let served = served_certificate(&env, 0);
        let current = current.clone();
        async move {
            let served = served.await?;
            let on_disk = pem_to_der(&current);
            if served == on_disk {
                Ok(())
            } else {
                Err("the server still presents the old certificate".to_string())
            }
        }
    })
    .await
    .unwrap();
    for replica in 0..env.replicas.len() {
        env.check_reachable(&client, replica, 0, Frontend::Grpc)
            .await
            .unwrap();
    }
    // The long-lived connection is still the same and still works.
    stream.write_all(b"after\n").await.unwrap();
    let mut echoed = [0u8; 6];
    stream.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"after\n");
    eprintln!("{rounds} echo rounds across the rotation, none dropped");
    env.shutdown().await;
}

fn pem_to_der(pem: &[u8]) -> Vec<u8> {
    use rustls_pki_types::pem::PemObject;
    rustls_pki_types::CertificateDer::pem_slice_iter(pem)
        .next()
        .expect("a certificate")
        .expect("valid PEM")
        .to_vec()
}

/// The certificate replica `replica` presents on a new handshake.
async fn served_certificate(env: &Environment, replica: usize) -> Result<Vec<u8>, String> {
    use cert_authority::tls::{self, Pem};
    let pki = &env.summary.pki_dir;
    let roots =
        tls::roots(&Pem::file("bundle", &pki.join("ca-bundle.crt")).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let identity = tls::Identity::from_files(
        &pki.join("proxy-client/tls.crt"),
        &pki.join("proxy-client/tls.key"),
    )
    .map_err(|e| e.to_string())?;
    let config = tls::client_config(roots, Some(identity), &[b"h2"]).map_err(|e| e.to_string())?;
    let addr = env.client_addr(replica);
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::from(addr.ip());
    let mut connection = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let mut tcp = tcp.into_std().map_err(|e| e.to_string())?;
    tcp.set_nonblocking(false).map_err(|e| e.to_string())?;
    tokio::task::spawn_blocking(move || {
        while connection.is_handshaking() {
            connection
                .complete_io(&mut tcp)
                .map_err(|e| e.to_string())?;
        }
        connection
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| cert.to_vec())
            .ok_or_else(|| "no server certificate".to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}
