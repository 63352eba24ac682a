//! A managed cluster whose only way out is a real forward proxy (issue 53).
//!
//! Every test fences a cluster off in network namespaces
//! ([`FencedCluster`]): the real proxy-agent binary runs in the cluster
//! namespace, whose only route is a /32 to the proxy's address
//! ([`PROXY_IP`]); the proxy-server's agent port listens on another hub
//! address ([`HUB_IP`]) that the cluster has no route to but the proxy
//! reaches. So a tunnel that comes up went through the proxy, and an agent
//! that ignores its proxy settings fails with "network unreachable". The
//! proxies are the real thing from Debian: tinyproxy (HTTP CONNECT, Basic
//! authentication, `ConnectPort`), stunnel4 in front of tinyproxy (an
//! `https://` proxy with a test CA) and microsocks (SOCKS5 with a user and
//! password). Besides the agent, a Kubernetes client of the services
//! (`cluster_proxy_control::client`) reaches an API server through the proxy.
//!
//! Without root, `ip netns` or one of the proxies a test skips loudly; under
//! `CI=true` (`.ci/run` installs the proxies) a skip is a failure.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cert_authority::files::Layout;
use cert_authority::pki::{Authority, LeafRequest};
use cluster_proxy_control::client::build_with;
use cluster_proxy_egress::EgressSettings;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::transport::ALPN_HTTP11;
use k8s_openapi::api::core::v1::Namespace;
use kube::{Api, ResourceExt};
use memory_apiserver::{KubeApi, KubeApiOptions};
use simulated_cluster::binaries::{Binaries, Progress};
use simulated_cluster::forward_proxy::{Tinyproxy, can_run, connect_requests};
use simulated_cluster::netns::{FencedCluster, connect_in, in_namespace, listen_in};
use simulated_cluster::process::{Logs, ProcessSpec, Supervised};
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::until_ok;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{
    ServerPorts, health_get_over, http_connect_over, proxy_agent_args_to,
    proxy_server_args_agents_on, tunnel_client,
};
use tunnel_harness::pki::TestPki;

/// The proxies' address: the one hub address the cluster routes to.
const PROXY_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The proxy-server's agent port: the cluster has no route here.
const HUB_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// The cluster's end of its only link.
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
/// Fresh namespaces have every port free, so the ports are fixed.
const SERVER_PORTS: ServerPorts = ServerPorts {
    client: 8090,
    agent: 8091,
    health: 8092,
    admin: 8093,
};
/// The echo target inside the cluster (on its loopback, where each agent's
/// `--host-alias <cluster>=127.0.0.1` points).
const ECHO_PORT: u16 = 7000;
const TINYPROXY_PORT: u16 = 3128;
const STUNNEL_PORT: u16 = 3129;
const SOCKS_PORT: u16 = 1080;
/// A proxy port nothing listens on.
const DEAD_PORT: u16 = 3999;
const USER: &str = "agent";
const PASSWORD: &str = "Pr0xy-s3cret-7731";

/// How long a process may take to listen, or an agent to get its tunnel
/// or its first failure.
const WAIT: Duration = Duration::from_secs(20);

fn binaries() -> Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES
        .get_or_init(|| Binaries::build(Progress::Quiet).expect("the service binaries build"))
        .clone()
}

/// Polls `check` until it gives a value; after [`WAIT`] fails with `what`
/// and the last reason `check` gave.
async fn wait_for<T, F, Fut>(what: &str, check: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    until_ok(what, WAIT, check).await
}

/// One proxy-agent process in the cluster namespace.
struct Agent {
    /// Its log's name in [`Fixture::logs`].
    name: String,
    health_port: u16,
}

/// A fenced cluster with a proxy-server in its hub namespace, an echo
/// target in the cluster, and the proxies and agents a test starts.
/// Fields drop in order: the processes, then the namespaces (whose removal
/// also kills whatever still runs in them).
struct Fixture {
    processes: Vec<Supervised>,
    _echo: EchoServer,
    logs: Logs,
    pki: TestPki,
    layout: Layout,
    dir: tempfile::TempDir,
    binaries: Binaries,
    next_agent_port: u16,
    net: FencedCluster,
}

impl Fixture {
    /// The fenced cluster of test `tag`, with a proxy-server listening and
    /// the echo target up; `None` (after saying why) when the test cannot
    /// run here.
    async fn start(tag: &str, clusters: &[&str], tools: &[&str]) -> Option<Fixture> {
        if !can_run(tag, tools) {
            return None;
        }
        let binaries = tokio::task::spawn_blocking(binaries)
            .await
            .expect("the build task");
        let id = format!("bp{:04x}-{tag}", rand::random::<u16>());
        let net = FencedCluster::create(&id, &[PROXY_IP, HUB_IP], CLUSTER_IP, &[PROXY_IP])
            .expect("the fenced cluster's namespaces");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let logs = Logs::new(dir.path().join("logs"), false);
        let pki = TestPki::with_server_sans(clusters, &[&HUB_IP.to_string()]).expect("test PKI");
        let pki_dir = dir.path().join("pki");
        std::fs::create_dir(&pki_dir).expect("the PKI directory");
        let layout = pki.write(&pki_dir).expect("the PKI files");
        let echo = listen_in(&net.cluster, SocketAddr::from(([127, 0, 0, 1], ECHO_PORT)))
            .and_then(|listener| {
                listener.set_nonblocking(true)?;
                tokio::net::TcpListener::from_std(listener)
            })
            .and_then(EchoServer::on)
            .expect("the echo target in the cluster");
        let mut fixture = Fixture {
            processes: Vec::new(),
            _echo: echo,
            logs,
            pki,
            layout,
            dir,
            binaries,
            next_agent_port: 9100,
            net,
        };
        let server = ProcessSpec::new("proxy-server", &fixture.binaries.proxy_server).args(
            proxy_server_args_agents_on("hub", &SERVER_PORTS, HUB_IP.into(), &fixture.layout),
        );
        fixture.start_in_hub(server);
        fixture
            .await_listening(
                "proxy-server",
                SocketAddr::new(HUB_IP.into(), SERVER_PORTS.agent),
            )
            .await;
        fixture
            .await_listening(
                "proxy-server",
                SocketAddr::from(([127, 0, 0, 1], SERVER_PORTS.client)),
            )
            .await;
        Some(fixture)
    }

    fn start_in_hub(&mut self, spec: ProcessSpec) {
        let spec = spec.in_netns(Some(self.net.hub.clone()));
        let process = Supervised::start(spec, &self.logs).expect("starting a hub process");
        self.processes.push(process);
    }

    /// Waits until `addr` in the hub namespace accepts a connection.
    async fn await_listening(&self, name: &str, addr: SocketAddr) {
        let hub = self.net.hub.clone();
        let result = wait_for(&format!("{name} listening on {addr}"), || {
            let hub = hub.clone();
            async move {
                connect_in(hub, addr)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        })
        .await;
        if let Err(e) = result {
            panic!("{e}\n{name}'s log:\n{}", self.logs.tail(name, 40));
        }
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents).expect("writing a test file");
        path
    }

    /// tinyproxy on `port` of [`PROXY_IP`]: with Basic authentication when
    /// `auth` is on, allowing CONNECT only to `connect_port` when given
    /// (others get 403).
    async fn tinyproxy(&mut self, port: u16, auth: bool, connect_port: Option<u16>) {
        let name = format!("tinyproxy-{port}");
        let mut proxy = Tinyproxy::new(SocketAddr::new(PROXY_IP.into(), port));
        if auth {
            proxy.basic_auth = Some((USER.to_owned(), PASSWORD.to_owned()));
        }
        proxy.connect_port = connect_port;
        let spec = proxy
            .spec(&name, self.dir.path())
            .expect("writing tinyproxy's configuration");
        self.start_in_hub(spec);
        self.await_listening(&name, SocketAddr::new(PROXY_IP.into(), port))
            .await;
    }

    /// stunnel on [`STUNNEL_PORT`] in front of the tinyproxy on
    /// `upstream`: an `https://` proxy whose certificate (for [`PROXY_IP`])
    /// a fresh CA signed. Returns that CA's certificate file.
    async fn stunnel(&mut self, upstream: u16) -> PathBuf {
        let ca =
            Authority::generate("test proxy CA", Duration::from_secs(3600)).expect("the proxy CA");
        let leaf = ca
            .issue(&LeafRequest::server("proxy", &[&PROXY_IP.to_string()]))
            .expect("the proxy's certificate");
        let cert = self.write("stunnel.crt", &leaf.cert_pem);
        let key = self.write("stunnel.key", &leaf.key_pem);
        let config = self.write(
            "stunnel.conf",
            &format!(
                "foreground = yes\npid =\ndebug = info\n[https-proxy]\naccept = {PROXY_IP}:{STUNNEL_PORT}\nconnect = {PROXY_IP}:{upstream}\ncert = {}\nkey = {}\n",
                cert.display(),
                key.display()
            ),
        );
        let spec =
            ProcessSpec::new("stunnel", Path::new("stunnel4")).arg(config.display().to_string());
        self.start_in_hub(spec);
        self.await_listening("stunnel", SocketAddr::new(PROXY_IP.into(), STUNNEL_PORT))
            .await;
        self.write("proxy-ca.crt", ca.cert_pem())
    }

    /// microsocks on [`SOCKS_PORT`], asking for [`USER`] and [`PASSWORD`].
    async fn microsocks(&mut self) {
        let spec = ProcessSpec::new("microsocks", Path::new("microsocks")).args([
            "-i".to_owned(),
            PROXY_IP.to_string(),
            "-p".to_owned(),
            SOCKS_PORT.to_string(),
            "-u".to_owned(),
            USER.to_owned(),
            "-P".to_owned(),
            PASSWORD.to_owned(),
        ]);
        self.start_in_hub(spec);
        self.await_listening("microsocks", SocketAddr::new(PROXY_IP.into(), SOCKS_PORT))
            .await;
    }

    /// Starts a proxy-agent of `cluster` in the cluster namespace, dialing
    /// the hub's agent port with `args` and `env` added. Proxy variables
    /// this test process may have are blanked (an empty one counts as
    /// unset), so the agent sees only the ones given.
    fn agent(&mut self, name: &str, cluster: &str, args: &[String], env: &[(&str, &str)]) -> Agent {
        let health_port = self.next_agent_port;
        self.next_agent_port += 2;
        let cluster = ClusterName::new(cluster).expect("a cluster name");
        let mut spec = ProcessSpec::new(name, &self.binaries.proxy_agent)
            .args(proxy_agent_args_to(
                &cluster,
                name,
                SocketAddr::new(HUB_IP.into(), SERVER_PORTS.agent),
                (health_port, health_port + 1),
                &self.layout,
            ))
            .args(args.iter().cloned())
            .in_netns(Some(self.net.cluster.clone()));
        for variable in ["HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY"] {
            spec = spec.env(variable, "").env(&variable.to_lowercase(), "");
        }
        for (key, value) in env {
            spec = spec.env(key, *value);
        }
        let process = Supervised::start(spec, &self.logs).expect("starting proxy-agent");
        self.processes.push(process);
        Agent {
            name: name.to_owned(),
            health_port,
        }
    }

    /// GET `path` on the agent's health port, from inside the cluster.
    async fn agent_get(&self, agent: &Agent, path: &str) -> Result<(u16, String), String> {
        let addr = SocketAddr::from(([127, 0, 0, 1], agent.health_port));
        let tcp = connect_in(self.net.cluster.clone(), addr)
            .await
            .map_err(|e| format!("connect to the agent's health port: {e}"))?;
        health_get_over(tcp, path)
            .await
            .map_err(|e| format!("GET {path}: {e}"))
    }

    /// Every process's log, for a failure message.
    fn all_logs(&self) -> String {
        self.processes
            .iter()
            .map(|p| {
                format!(
                    "----- {} -----\n{}\n",
                    p.name(),
                    self.logs.tail(p.name(), 30)
                )
            })
            .collect()
    }

    /// Waits until the agent holds its tunnel (`/readyz` 200).
    async fn await_tunnel(&self, agent: &Agent) {
        let result = wait_for(&format!("{} holding a tunnel", agent.name), || async move {
            match self.agent_get(agent, "/readyz").await? {
                (200, _) => Ok(()),
                (status, body) => Err(format!("/readyz {status}: {body}")),
            }
        })
        .await;
        if let Err(e) = result {
            panic!("{e}\n{}", self.all_logs());
        }
    }

    /// Waits until the agent has counted a failed connect for `reason`;
    /// returns its `/readyz` body then (which must be a 503).
    async fn await_failure(&self, agent: &Agent, reason: &str) -> String {
        let counted =
            format!("cluster_proxy_agent_server_connect_failures_total{{reason=\"{reason}\"}}");
        let counted = &counted;
        let result = wait_for(
            &format!("{} failing with {reason}", agent.name),
            || async move {
                let (_, metrics) = self.agent_get(agent, "/metrics").await?;
                let failures: Vec<&str> = metrics
                    .lines()
                    .filter(|l| l.starts_with("cluster_proxy_agent_server_connect_failures_total"))
                    .collect();
                if failures.iter().any(|l| l.starts_with(counted)) {
                    Ok(())
                } else {
                    Err(format!("failures counted: {failures:?}"))
                }
            },
        )
        .await;
        if let Err(e) = result {
            panic!("{e}\n{}", self.all_logs());
        }
        let (status, body) = self
            .agent_get(agent, "/readyz")
            .await
            .unwrap_or_else(|e| panic!("{}'s /readyz: {e}", agent.name));
        assert_eq!(status, 503, "{}'s /readyz: {body}", agent.name);
        assert!(
            body.contains("[-]last-connect-attempt failed: "),
            "{}'s /readyz says no reason: {body}",
            agent.name
        );
        body
    }

    /// What the agent logged so far: its log file without the line
    /// [`Supervised`] writes first, `# <command line>` (which has the
    /// flags, credentials in a `--proxy-url` too, as a shell history would).
    fn log_of(&self, agent: &Agent) -> String {
        std::fs::read_to_string(self.logs.path_of(&agent.name))
            .unwrap_or_default()
            .lines()
            .filter(|line| !line.starts_with("# "))
            .map(|line| format!("{line}\n"))
            .collect()
    }

    /// Sends `len` bytes through the proxy-server (HTTP CONNECT from the
    /// hub) to the echo target in `cluster` and checks they come back.
    async fn echo_through(&self, cluster: &str, len: usize) {
        let tcp = connect_in(
            self.net.hub.clone(),
            SocketAddr::from(([127, 0, 0, 1], SERVER_PORTS.client)),
        )
        .await
        .expect("connect to the proxy-server's client port");
        let tls = self
            .pki
            .client_tls_alpn(&[ALPN_HTTP11])
            .expect("client TLS");
        let stream = http_connect_over(tls, tcp, "localhost", &format!("{cluster}:{ECHO_PORT}"))
            .await
            .unwrap_or_else(|e| panic!("CONNECT to {cluster}: {e}\n{}", self.all_logs()));
        let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let (mut reader, mut writer) = tokio::io::split(stream);
        let sent = payload.clone();
        let writing = tokio::spawn(async move {
            writer.write_all(&sent).await?;
            writer.flush().await?;
            Ok::<_, std::io::Error>(writer)
        });
        let mut back = vec![0u8; len];
        tokio::time::timeout(WAIT, reader.read_exact(&mut back))
            .await
            .unwrap_or_else(|_| panic!("the echo of {len} bytes through {cluster} stalled"))
            .expect("reading the echo");
        writing
            .await
            .expect("the writing task")
            .expect("writing the payload");
        assert!(back == payload, "the echo through {cluster} differs");
    }
}

fn arg(flag: &str, value: impl std::fmt::Display) -> String {
    format!("--{flag}={value}")
}

/// Case 1: `HTTPS_PROXY` names tinyproxy and `NO_PROXY` does not match the
/// hub: the tunnel comes up through the proxy and carries a MiB both ways
/// to a target inside the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_proxy_variable_carries_the_tunnel_and_a_mib_round_trip() {
    let Some(mut f) = Fixture::start("connect", &["cluster-a"], &["tinyproxy"]).await else {
        return;
    };
    f.tinyproxy(TINYPROXY_PORT, false, None).await;
    let proxy = format!("http://{PROXY_IP}:{TINYPROXY_PORT}");
    let agent = f.agent(
        "agent-env",
        "cluster-a",
        &[],
        &[
            ("HTTPS_PROXY", proxy.as_str()),
            (
                "NO_PROXY",
                "localhost,.svc,.cluster.local,10.0.0.0/8,198.18.0.3",
            ),
        ],
    );
    f.await_tunnel(&agent).await;
    f.echo_through("cluster-a", 1024 * 1024).await;
    let proxy_log = f.logs.tail(&format!("tinyproxy-{TINYPROXY_PORT}"), 200);
    let hub = format!("{HUB_IP}:{}", SERVER_PORTS.agent);
    assert!(
        connect_requests(&proxy_log).contains(&hub),
        "tinyproxy never saw the CONNECT to the hub:\n{proxy_log}"
    );
}

/// Dials through a tunnel that runs through tinyproxy are not held by
/// delayed ACKs. tinyproxy relays with Nagle's algorithm on, so each small
/// write of a dial's exchange waited for the ACK of the one before, which
/// the agent and the server delayed: 25–40 ms per dial, 2–5 % of the direct
/// path's connects/s (`e2e/examples/agent_paths.rs`). Both ends now
/// acknowledge every read at once on such connections (TCP_QUICKACK), so a
/// dial with a 1-byte echo takes about what it takes direct.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dials_through_a_proxy_are_not_held_by_delayed_acks() {
    const DIALS: usize = 40;
    let Some(mut f) = Fixture::start("quickack", &["cluster-a"], &["tinyproxy"]).await else {
        return;
    };
    f.tinyproxy(TINYPROXY_PORT, false, None).await;
    let agent = f.agent(
        "agent-quickack",
        "cluster-a",
        &[format!("--proxy-url=http://{PROXY_IP}:{TINYPROXY_PORT}")],
        &[],
    );
    f.await_tunnel(&agent).await;
    let tls = f.pki.client_tls().expect("client TLS");
    let hub = f.net.hub.clone();
    // A held gRPC client connection, as hub controllers dial; its runtime
    // is built in the hub namespace, so its sockets are made there.
    let timed = tokio::task::spawn_blocking(move || {
        in_namespace(&hub, move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let client =
                    tunnel_client(tls, SocketAddr::from(([127, 0, 0, 1], SERVER_PORTS.client)))
                        .await
                        .map_err(std::io::Error::other)?;
                let mut took = Vec::with_capacity(DIALS);
                for _ in 0..DIALS + 5 {
                    let started = std::time::Instant::now();
                    let mut io = client
                        .dial(&format!("cluster-a:{ECHO_PORT}"))
                        .await
                        .map_err(std::io::Error::other)?;
                    let mut byte = [7u8; 1];
                    io.write_all(&byte).await?;
                    io.read_exact(&mut byte).await?;
                    drop(io);
                    took.push(started.elapsed());
                }
                // The first dials warm the connections up.
                Ok(took.split_off(5))
            })
        })
    })
    .await
    .expect("the client thread");
    let mut took =
        timed.unwrap_or_else(|e| panic!("dialing through the proxy: {e}\n{}", f.all_logs()));
    took.sort();
    let median = took[took.len() / 2];
    // Direct, a debug build's dial takes 1–5 ms here; a delayed ACK alone
    // is 40 ms on Linux, and the stall showed in nearly every dial.
    assert!(
        median < Duration::from_millis(15),
        "the median dial with a 1-byte echo through tinyproxy took {median:?} (sorted: {took:?}): \
         a delayed ACK is holding the proxy's writes"
    );
}

/// The WebSocket transport inside the proxy's CONNECT tunnel: the upgrade
/// and the framing go through tinyproxy like any TLS bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_websocket_transport_goes_through_the_proxy_too() {
    let Some(mut f) = Fixture::start("websocket", &["cluster-a"], &["tinyproxy"]).await else {
        return;
    };
    f.tinyproxy(TINYPROXY_PORT, false, None).await;
    let agent = f.agent(
        "agent-ws",
        "cluster-a",
        &[
            format!("--proxy-url=http://{PROXY_IP}:{TINYPROXY_PORT}"),
            "--transport=websocket".to_owned(),
        ],
        &[],
    );
    f.await_tunnel(&agent).await;
    f.echo_through("cluster-a", 1024 * 1024).await;
    let proxy_log = f.logs.tail(&format!("tinyproxy-{TINYPROXY_PORT}"), 200);
    assert!(
        proxy_log.contains(&format!("{HUB_IP}")),
        "tinyproxy never saw the CONNECT to the hub:\n{proxy_log}"
    );
    let agent_log = f.logs.tail("agent-ws", 200);
    assert!(
        agent_log.contains("websocket"),
        "the agent does not say it tunnels over WebSocket:\n{agent_log}"
    );
}

/// Case 2: tinyproxy asks for Basic credentials; the agent gives them in
/// the proxy URL, or from a mounted `kubernetes.io/basic-auth` Secret's
/// directory. Neither way puts the password in the agent's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_auth_from_the_url_or_a_credentials_directory() {
    let Some(mut f) = Fixture::start("auth", &["cluster-a", "cluster-b"], &["tinyproxy"]).await
    else {
        return;
    };
    f.tinyproxy(TINYPROXY_PORT, true, None).await;
    let secret = f.dir.path().join("proxy-secret");
    std::fs::create_dir(&secret).expect("the Secret's directory");
    std::fs::write(secret.join("username"), USER).expect("username");
    std::fs::write(secret.join("password"), PASSWORD).expect("password");
    let in_url = f.agent(
        "agent-url",
        "cluster-a",
        &[arg(
            "proxy-url",
            format!("http://{USER}:{PASSWORD}@{PROXY_IP}:{TINYPROXY_PORT}"),
        )],
        &[],
    );
    let in_file = f.agent(
        "agent-file",
        "cluster-b",
        &[
            arg("proxy-url", format!("http://{PROXY_IP}:{TINYPROXY_PORT}")),
            arg("proxy-credentials-file", secret.display()),
        ],
        &[],
    );
    f.await_tunnel(&in_url).await;
    f.await_tunnel(&in_file).await;
    f.echo_through("cluster-a", 64 * 1024).await;
    f.echo_through("cluster-b", 64 * 1024).await;
    for agent in [&in_url, &in_file] {
        let log = f.log_of(agent);
        assert!(
            !log.contains(PASSWORD),
            "{}'s log has the password:\n{log}",
            agent.name
        );
    }
}

/// Case 3: an `https://` proxy (stunnel in front of tinyproxy) verified
/// against `--proxy-ca-cert`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_proxy_verified_by_its_own_ca() {
    let Some(mut f) = Fixture::start("tls", &["cluster-a"], &["tinyproxy", "stunnel4"]).await
    else {
        return;
    };
    f.tinyproxy(TINYPROXY_PORT, false, None).await;
    let proxy_ca = f.stunnel(TINYPROXY_PORT).await;
    let agent = f.agent(
        "agent-https",
        "cluster-a",
        &[
            arg("proxy-url", format!("https://{PROXY_IP}:{STUNNEL_PORT}")),
            arg("proxy-ca-cert", proxy_ca.display()),
        ],
        &[],
    );
    f.await_tunnel(&agent).await;
    f.echo_through("cluster-a", 64 * 1024).await;
}

/// Case 4: `socks5h://` through microsocks with a user and password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socks5h_proxy_with_a_password() {
    let Some(mut f) = Fixture::start("socks", &["cluster-a"], &["microsocks"]).await else {
        return;
    };
    f.microsocks().await;
    let agent = f.agent(
        "agent-socks",
        "cluster-a",
        &[arg(
            "proxy-url",
            format!("socks5h://{USER}:{PASSWORD}@{PROXY_IP}:{SOCKS_PORT}"),
        )],
        &[],
    );
    f.await_tunnel(&agent).await;
    f.echo_through("cluster-a", 64 * 1024).await;
    let log = f.log_of(&agent);
    assert!(
        !log.contains(PASSWORD),
        "the agent's log has the password:\n{log}"
    );
}

/// Case 5: each way a proxy fails is named on `/readyz` and counted by
/// reason: no password (407) and a wrong one (tinyproxy says 401; the
/// password is in neither the log nor the metrics), a proxy certificate the given CA did not sign, a
/// proxy port nothing listens on, and a proxy that allows CONNECT only to
/// another port (tinyproxy's `ConnectPort`: 403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_failures_are_named_and_counted() {
    let Some(mut f) = Fixture::start("errors", &["cluster-a"], &["tinyproxy", "stunnel4"]).await
    else {
        return;
    };
    const REFUSING_PORT: u16 = 3138;
    const WRONG_PASSWORD: &str = "Wr0ng-pa55word-4471";
    f.tinyproxy(TINYPROXY_PORT, true, None).await;
    f.tinyproxy(REFUSING_PORT, false, Some(443)).await;
    f.stunnel(TINYPROXY_PORT).await;
    let other_ca =
        Authority::generate("some other CA", Duration::from_secs(3600)).expect("another CA");
    let other_ca = f.write("other-ca.crt", other_ca.cert_pem());

    let wrong_password = f.agent(
        "agent-wrong-password",
        "cluster-a",
        &[arg(
            "proxy-url",
            format!("http://{USER}:{WRONG_PASSWORD}@{PROXY_IP}:{TINYPROXY_PORT}"),
        )],
        &[],
    );
    let no_password = f.agent(
        "agent-no-password",
        "cluster-a",
        &[arg(
            "proxy-url",
            format!("http://{PROXY_IP}:{TINYPROXY_PORT}"),
        )],
        &[],
    );
    let wrong_ca = f.agent(
        "agent-wrong-ca",
        "cluster-a",
        &[
            arg("proxy-url", format!("https://{PROXY_IP}:{STUNNEL_PORT}")),
            arg("proxy-ca-cert", other_ca.display()),
        ],
        &[],
    );
    let dead = f.agent(
        "agent-dead-proxy",
        "cluster-a",
        &[arg("proxy-url", format!("http://{PROXY_IP}:{DEAD_PORT}"))],
        &[],
    );
    let refused = f.agent(
        "agent-refused",
        "cluster-a",
        &[arg(
            "proxy-url",
            format!("http://{PROXY_IP}:{REFUSING_PORT}"),
        )],
        &[],
    );

    // tinyproxy says 407 only when no credentials came; wrong ones get 401.
    let readyz = f.await_failure(&no_password, "proxy_auth").await;
    assert!(readyz.contains("407"), "{readyz}");
    assert!(readyz.contains("no credentials were given"), "{readyz}");
    let readyz = f.await_failure(&wrong_password, "proxy_auth").await;
    assert!(readyz.contains("401"), "{readyz}");
    assert!(readyz.contains("not accepted"), "{readyz}");
    assert!(
        readyz.contains(&format!("http://{PROXY_IP}:{TINYPROXY_PORT}")),
        "the proxy is not named: {readyz}"
    );
    let (_, metrics) = f
        .agent_get(&wrong_password, "/metrics")
        .await
        .expect("the agent's metrics");
    // The log is written by another task: wait until it has the failure,
    // so that the password's absence means something.
    let (fixture, agent) = (&f, &wrong_password);
    let log = wait_for(
        "the wrong password's failure in the agent's log",
        || async move {
            let log = fixture.log_of(agent);
            if log.contains("401") {
                Ok(log)
            } else {
                Err(log)
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for (what, text) in [("log", &log), ("metrics", &metrics), ("/readyz", &readyz)] {
        assert!(
            !text.contains(WRONG_PASSWORD),
            "the password is in the agent's {what}:\n{text}"
        );
    }

    let readyz = f.await_failure(&wrong_ca, "proxy_tls").await;
    assert!(
        readyz.contains(&format!("https://{PROXY_IP}:{STUNNEL_PORT}")),
        "{readyz}"
    );
    let readyz = f.await_failure(&dead, "proxy_unreachable").await;
    assert!(
        readyz.contains(&format!("http://{PROXY_IP}:{DEAD_PORT}")),
        "{readyz}"
    );
    let readyz = f.await_failure(&refused, "proxy_refused").await;
    assert!(readyz.contains("403"), "{readyz}");
}

/// Case 6 and the negative control: without a proxy setting, or with
/// `NO_PROXY` naming the hub, the agent dials the hub directly, which the
/// fence makes impossible: reason `dial`, "unreachable".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_proxy_the_hub_is_unreachable() {
    let Some(mut f) = Fixture::start("direct", &["cluster-a"], &["tinyproxy"]).await else {
        return;
    };
    f.tinyproxy(TINYPROXY_PORT, false, None).await;
    let proxy = format!("http://{PROXY_IP}:{TINYPROXY_PORT}");
    let hub = HUB_IP.to_string();
    let no_setting = f.agent("agent-no-proxy", "cluster-a", &[], &[]);
    let bypassed = f.agent(
        "agent-no-proxy-match",
        "cluster-a",
        &[],
        &[("HTTPS_PROXY", proxy.as_str()), ("NO_PROXY", hub.as_str())],
    );
    for agent in [&no_setting, &bypassed] {
        let readyz = f.await_failure(agent, "dial").await;
        assert!(
            readyz.to_lowercase().contains("unreachable"),
            "{}: {readyz}",
            agent.name
        );
    }
    let proxy_log = f.logs.tail(&format!("tinyproxy-{TINYPROXY_PORT}"), 200);
    assert!(
        !proxy_log.contains(&HUB_IP.to_string()),
        "NO_PROXY matched the hub, yet the agent went through the proxy:\n{proxy_log}"
    );
}

/// `error` and every error beneath it (hyper's says only "client error
/// (Connect)"; why is in its sources).
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// The namespaces' names, listed by a client of the API server at
/// `kubeconfig` built by `build_with` with `proxy_url`, running in network
/// namespace `netns` (on a runtime of its own there, so every connection it
/// opens starts inside).
async fn namespaces_from(
    netns: &str,
    kubeconfig: &Path,
    proxy_url: Option<String>,
) -> Result<Vec<String>, String> {
    let (netns, kubeconfig) = (netns.to_owned(), kubeconfig.to_owned());
    let listed = tokio::task::spawn_blocking(move || {
        in_namespace(&netns, move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            Ok(runtime.block_on(async move {
                let kubeconfig = kube::config::Kubeconfig::read_from(&kubeconfig)
                    .map_err(|e| format!("the kubeconfig: {e}"))?;
                let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                    .await
                    .map_err(|e| format!("the client's configuration: {e}"))?;
                let egress = EgressSettings {
                    proxy_url,
                    ..EgressSettings::default()
                };
                let client = build_with(config, &egress).map_err(|e| e.to_string())?;
                let namespaces = Api::<Namespace>::all(client);
                let params = kube::api::ListParams::default();
                let list = tokio::time::timeout(WAIT, namespaces.list(&params))
                    .await
                    .map_err(|_| format!("no answer within {WAIT:?}"))?
                    .map_err(|e| format!("listing namespaces: {}", with_sources(&e)))?;
                Ok(list.items.iter().map(|n| n.name_any()).collect())
            }))
        })
    })
    .await
    .expect("the client's task");
    listed.map_err(|e| format!("in the cluster namespace: {e}"))?
}

/// Case 7: a Kubernetes client of the services
/// (`cluster_proxy_control::client::build_with`) given the proxy's URL
/// reaches an API server (memory-apiserver) on a hub address the cluster
/// has no route to, through tinyproxy; without the URL it cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kube_client_reaches_its_api_server_through_the_proxy_url() {
    let Some(mut f) = Fixture::start("kube", &["cluster-a"], &["tinyproxy"]).await else {
        return;
    };
    f.tinyproxy(TINYPROXY_PORT, false, None).await;
    let api_addr = SocketAddr::new(HUB_IP.into(), 6443);
    let mut options = KubeApiOptions::new(f.dir.path().join("api"));
    options.extra_sans = vec![HUB_IP.to_string()];
    options.listeners = vec![Arc::new(
        listen_in(&f.net.hub, api_addr).expect("the API's listener"),
    )];
    let api = KubeApi::start(options).await.expect("the API server");
    let kubeconfig = api
        .kubeconfigs(Some(api_addr))
        .write(memory_apiserver::ADMIN_USER, &["system:masters"])
        .expect("a kubeconfig for the API's hub address");
    let proxy = format!("http://{PROXY_IP}:{TINYPROXY_PORT}");
    let listed = namespaces_from(&f.net.cluster, &kubeconfig, Some(proxy)).await;
    assert!(
        listed
            .as_ref()
            .is_ok_and(|names| names.iter().any(|n| n == "default")),
        "{listed:?}"
    );
    let proxy_log = f.logs.tail(&format!("tinyproxy-{TINYPROXY_PORT}"), 200);
    assert!(
        connect_requests(&proxy_log).contains(&api_addr.to_string()),
        "tinyproxy never saw the CONNECT to the API server:\n{proxy_log}"
    );
    let direct = namespaces_from(&f.net.cluster, &kubeconfig, None).await;
    assert!(
        direct
            .as_ref()
            .is_err_and(|e| e.to_lowercase().contains("unreachable")),
        "without the proxy: {direct:?}"
    );
    api.shutdown().await;
}
