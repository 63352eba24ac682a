//! A managed cluster whose only route is a real forward proxy joins and
//! serves traffic once an AddOnDeploymentConfig's `proxyConfig` names that
//! proxy (issue 53, item 2).
//!
//! The local environment with the real control plane and a network
//! namespace per cluster; [`PROXIED`]'s network routes only to the hub's
//! proxy address (`EnvOptions::proxied_clusters`), where this test runs
//! tinyproxy in the hub's namespace, and not to the hub's agent address,
//! where the agent Service and the hub API's forwarder listen. [`DIRECT`]
//! is a cluster as usual. With the `Hostname` entrypoint:
//!
//! 1. without an ADC, the proxied cluster's agent dials the hub and fails
//!    (reason `dial`, "unreachable"), and with an ADC naming a port where no
//!    proxy listens it fails with `proxy_unreachable`; its addon is not
//!    Available either time;
//! 2. with the ADC naming tinyproxy, both agent containers run with
//!    `HTTPS_PROXY` and `NO_PROXY`; tinyproxy's log has the agent's CONNECTs
//!    to the agent Service and the addon-agent's to the hub API (the Lease it
//!    renews there makes the addon Available); a hub client reaches the
//!    cluster's service through the tunnel;
//! 3. switched to the `PortForward` entrypoint, the agent dials its
//!    addon-agent on 127.0.0.1 directly (never through the proxy) and the
//!    addon-agent's port-forward to the proxy-servers, through the hub API,
//!    is the proxied cluster's only way out: through the proxy.
//!
//! Skips loudly without root, `ip netns` or tinyproxy; under `CI=true` that
//! is a failure.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use cluster_proxy_proto::api::addon::v1alpha1::{AddOnDeploymentConfig, ManagedClusterAddOn};
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use e2e::env::control_plane::addon_status;
use e2e::env::{AGENT_SERVICE_PORT, EnvOptions, Environment, IsolationChoice, KUBE_API_PORT};
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use simulated_cluster::forward_proxy::{Tinyproxy, can_run, connect_requests};
use simulated_cluster::netns::{CLUSTER_SERVICE_ADDR, connect_in};
use simulated_cluster::ocm::{ADDON_NAME, agent_ports};
use simulated_cluster::process::{ProcessSpec, Supervised};
use simulated_cluster::wait::until_ok;
use tunnel_harness::in_process::health_get_over;

/// A cluster as usual.
const DIRECT: &str = "cluster-a";
/// The cluster whose only route is the proxy.
const PROXIED: &str = "cluster-b";
const REPLICAS: usize = 2;
const TINYPROXY_PORT: u16 = 3128;
/// A port of the proxy address where nothing listens.
const DEAD_PORT: u16 = 3999;
/// The AddOnDeploymentConfig in the proxied cluster's namespace.
const ADC: &str = "behind-proxy";
/// The cluster's own addresses, which stay direct: its services and
/// kube-apiserver, and the agent's health port the addon-agent probes.
fn no_proxy() -> String {
    format!("localhost,127.0.0.1,{CLUSTER_SERVICE_ADDR},.svc,.cluster.local")
}
/// How long anything may take to happen.
const WAIT: Duration = Duration::from_secs(60);

/// A process the kubelet runs for a container: its command line and
/// environment.
#[derive(Debug)]
struct Container {
    name: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// The environment, the proxied cluster's network and tinyproxy. Fields
/// drop in order: tinyproxy, then the environment (its processes, then its
/// namespaces).
struct Fixture {
    tinyproxy: Supervised,
    env: Environment,
    admin: kube::Client,
    /// The proxied cluster's network namespace.
    netns: String,
}

impl Fixture {
    async fn start() -> Option<Fixture> {
        if !can_run("adc_proxy", &["tinyproxy"]) {
            return None;
        }
        let mut options = EnvOptions::new(0);
        options.clusters = vec![DIRECT.to_owned(), PROXIED.to_owned()];
        options.proxied_clusters = vec![PROXIED.to_owned()];
        options.control_plane = true;
        options.hostname_entrypoint = true;
        options.isolation = IsolationChoice::Netns;
        options.spare_machines = 0;
        options.replicas = REPLICAS;
        let env = Environment::start(options)
            .await
            .unwrap_or_else(|e| panic!("starting the environment: {e}"));
        let admin = env.admin_client().await.expect("the admin client");
        let proxy_ip = env
            .forward_proxy_addr()
            .expect("a proxy address for the proxied cluster");
        let hub = env.summary.hub_netns.clone().expect("the hub's namespace");
        let listen = SocketAddr::new(proxy_ip.into(), TINYPROXY_PORT);
        let spec: ProcessSpec = Tinyproxy::new(listen)
            .spec("tinyproxy", &env.summary.state_dir)
            .expect("tinyproxy's configuration")
            .in_netns(Some(hub.clone()));
        let tinyproxy = Supervised::start(spec, &env.logs).expect("starting tinyproxy");
        let mut fixture = Fixture {
            tinyproxy,
            env,
            admin,
            netns: String::new(),
        };
        fixture
            .wait_for("tinyproxy listening", || async {
                connect_in(hub.clone(), listen)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            })
            .await;
        let env = &fixture.env;
        let machine = fixture
            .wait_for("the proxied cluster's machine", || async {
                env.machine_of(PROXIED)
                    .await
                    .ok_or_else(|| "not joined yet".to_owned())
            })
            .await;
        fixture.netns = machine.netns.expect("the proxied cluster's namespace");
        Some(fixture)
    }

    fn proxy_url(&self, port: u16) -> String {
        let ip = self.env.forward_proxy_addr().expect("the proxy address");
        format!("http://{ip}:{port}")
    }

    /// Polls `check` until it gives a value; after [`WAIT`] fails with the
    /// last reason and the logs.
    async fn wait_for<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, String>>,
    {
        until_ok(what, WAIT, check)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    /// The logs of tinyproxy and the proxied cluster's agent containers.
    fn logs(&self) -> String {
        let pod = format!("{PROXIED}/cluster-proxy-proxy-agent-0");
        ["tinyproxy", "addon-manager"]
            .into_iter()
            .map(str::to_owned)
            .chain(["proxy-agent", "addon-agent"].map(|c| format!("{pod}/{c}")))
            .map(|name| format!("----- {name} -----\n{}\n", self.env.logs.tail(&name, 30)))
            .collect()
    }

    /// The CONNECT targets tinyproxy was asked for so far.
    fn connects(&self) -> Vec<String> {
        let log = std::fs::read_to_string(self.tinyproxy.log_path()).unwrap_or_default();
        connect_requests(&log)
    }

    /// GET `path` on the proxied cluster's agent's health port, from inside
    /// the cluster.
    async fn agent_get(&self, path: &str) -> Result<(u16, String), String> {
        let addr = SocketAddr::new(IpAddr::V4(CLUSTER_SERVICE_ADDR), agent_ports(0).0);
        let tcp = connect_in(self.netns.clone(), addr)
            .await
            .map_err(|e| format!("the agent's health port: {e}"))?;
        health_get_over(tcp, path)
            .await
            .map_err(|e| format!("GET {path}: {e}"))
    }

    /// Waits until the proxied cluster's agent has counted a failed connect
    /// for `reason`; returns its `/readyz` then, which must say why.
    async fn await_failure(&self, reason: &str) -> String {
        let counted =
            format!("cluster_proxy_agent_server_connect_failures_total{{reason=\"{reason}\"}}");
        let counted = &counted;
        self.wait_for(&format!("the agent failing with {reason}"), || async move {
            let (_, metrics) = self.agent_get("/metrics").await?;
            if metrics.lines().any(|line| line.starts_with(counted)) {
                Ok(())
            } else {
                Err(format!("no {counted} in its metrics"))
            }
        })
        .await;
        let (status, readyz) = self
            .agent_get("/readyz")
            .await
            .expect("the agent's /readyz");
        assert_eq!(status, 503, "{readyz}");
        assert!(
            readyz.contains("[-]last-connect-attempt failed: "),
            "/readyz names no reason: {readyz}"
        );
        readyz
    }

    /// Waits until `cluster`'s addon is Available and its service answers
    /// through every replica (`how` says what the test expects it to take).
    async fn await_ready(&self, cluster: &str, how: &str) {
        if let Err(err) = self
            .env
            .wait_clusters_ready(&[cluster.to_owned()], REPLICAS, WAIT)
            .await
        {
            panic!("{cluster} {how}: {err}\n{}", self.logs());
        }
    }

    /// The proxied cluster's addon's `Available` condition (`status (reason)`).
    async fn available(&self) -> String {
        let rows = addon_status(&self.admin).await.expect("the addon status");
        rows.into_iter()
            .find(|row| row.name == PROXIED)
            .map(|row| row.available)
            .unwrap_or_default()
    }

    /// Asserts that the proxied cluster's addon is not Available.
    async fn assert_unavailable(&self, when: &str) {
        let available = self.available().await;
        assert!(
            !available.starts_with("True"),
            "{when}, the addon is Available: {available}\n{}",
            self.logs()
        );
    }

    /// The ADC with `https_proxy`, named by the proxied cluster's addon.
    async fn configure_proxy(&self, https_proxy: &str) {
        let adc = json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "AddOnDeploymentConfig",
            "metadata": {"name": ADC, "namespace": PROXIED},
            "spec": {"proxyConfig": {"httpsProxy": https_proxy, "noProxy": no_proxy()}},
        });
        let apply = PatchParams::apply("cluster-admin");
        Api::<AddOnDeploymentConfig>::namespaced(self.admin.clone(), PROXIED)
            .patch(ADC, &apply, &Patch::Apply(adc))
            .await
            .expect("applying the AddOnDeploymentConfig");
        let addon = json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": ADDON_NAME, "namespace": PROXIED},
            "spec": {"configs": [{"group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs", "name": ADC, "namespace": PROXIED}]},
        });
        Api::<ManagedClusterAddOn>::namespaced(self.admin.clone(), PROXIED)
            .patch(ADDON_NAME, &apply, &Patch::Apply(addon))
            .await
            .expect("naming the AddOnDeploymentConfig in the addon");
    }

    /// Each running container of the proxied cluster's agent pod (and its
    /// sample services).
    async fn containers(&self) -> Vec<Container> {
        let control_plane = self.env.control_plane.as_ref().expect("the control plane");
        let klusterlets = control_plane.klusterlets.lock().await;
        klusterlets
            .get(PROXIED)
            .into_iter()
            .flat_map(|k| k.processes())
            .filter_map(|p| {
                Some(Container {
                    name: p.name().rsplit('/').next()?.to_owned(),
                    args: p.spec.args.clone(),
                    env: p.spec.env.clone(),
                })
            })
            .collect()
    }

    /// Waits until the proxied cluster's agent pod runs with `HTTPS_PROXY`
    /// `https_proxy` in both agent containers.
    async fn await_rendered(&self, https_proxy: &str) {
        self.wait_for(
            &format!("the agent pod with HTTPS_PROXY={https_proxy}"),
            || async {
                let containers = self.containers().await;
                let with_env = |name: &str| {
                    containers.iter().any(|c| {
                        c.name == name
                            && c.env
                                .contains(&("HTTPS_PROXY".to_owned(), https_proxy.to_owned()))
                            && c.env.contains(&("NO_PROXY".to_owned(), no_proxy()))
                    })
                };
                let others = containers
                    .iter()
                    .filter(|c| {
                        c.env
                            .iter()
                            .any(|(k, v)| k == "HTTPS_PROXY" && v != https_proxy)
                    })
                    .count();
                if with_env("proxy-agent") && with_env("addon-agent") && others == 0 {
                    Ok(())
                } else {
                    Err(format!("{containers:?}"))
                }
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_behind_a_proxy_joins_with_the_adc_proxy_config() {
    let started = Instant::now();
    let Some(f) = Fixture::start().await else {
        return;
    };
    let agent_service = f.env.summary.agent_service_addr;
    assert_eq!(agent_service.port(), AGENT_SERVICE_PORT);
    let hub_api = SocketAddr::new(agent_service.ip(), KUBE_API_PORT);
    let (reaches, probe) = f
        .env
        .probe_from(Some(&f.netns), agent_service)
        .await
        .expect("probing from the proxied cluster");
    assert!(
        !reaches,
        "the proxied cluster reaches the agent Service directly: {probe}"
    );

    // 1. No ADC: the agent dials the hub directly, which is unreachable.
    let readyz = f.await_failure("dial").await;
    assert!(readyz.to_lowercase().contains("unreachable"), "{readyz}");
    f.await_ready(DIRECT, "not behind the proxy").await;
    f.assert_unavailable("without an ADC").await;
    // An ADC naming a port where no proxy listens.
    let dead = f.proxy_url(DEAD_PORT);
    f.configure_proxy(&dead).await;
    f.await_rendered(&dead).await;
    let readyz = f.await_failure("proxy_unreachable").await;
    assert!(readyz.contains(&dead), "the proxy is not named: {readyz}");
    f.assert_unavailable("with a dead proxy").await;
    assert!(f.connects().is_empty(), "{:?}", f.connects());
    let failing = started.elapsed();

    // 2. The ADC names tinyproxy.
    let proxy = f.proxy_url(TINYPROXY_PORT);
    f.configure_proxy(&proxy).await;
    f.await_rendered(&proxy).await;
    f.await_ready(PROXIED, &format!("through {proxy}")).await;
    let connects = f.connects();
    for (what, target) in [
        ("the agent's tunnels", agent_service),
        ("the addon-agent's Lease renewals", hub_api),
    ] {
        assert!(
            connects.contains(&target.to_string()),
            "no CONNECT to {target} ({what}) in tinyproxy's log: {connects:?}"
        );
    }
    let joined = started.elapsed();

    // 3. The PortForward entrypoint: the agent dials its addon-agent on
    // 127.0.0.1, which port-forwards through the hub API.
    let count = |connects: &[String], target: SocketAddr| {
        connects
            .iter()
            .filter(|c| **c == target.to_string())
            .count()
    };
    let before = count(&f.connects(), hub_api);
    Api::<ManagedProxyConfiguration>::all(f.admin.clone())
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"proxyServer": {"entrypoint":
                {"type": "PortForward", "hostname": null}}}})),
        )
        .await
        .expect("switching to the PortForward entrypoint");
    f.wait_for("the agent pod with the PortForward entrypoint", || async {
        let containers = f.containers().await;
        let has = |container: &Container, arg: &str| container.args.iter().any(|a| a == arg);
        let agents: Vec<&Container> = containers
            .iter()
            .filter(|c| c.name == "proxy-agent")
            .collect();
        let forwarding = containers
            .iter()
            .any(|c| c.name == "addon-agent" && has(c, "--enable-port-forward-proxy=true"));
        let local = agents
            .iter()
            .all(|c| has(c, "--proxy-server-host=127.0.0.1"));
        if forwarding && !agents.is_empty() && local {
            Ok(())
        } else {
            Err(format!("{containers:?}"))
        }
    })
    .await;
    let tunnels_through_the_proxy = count(&f.connects(), agent_service);
    f.wait_for("the agent holding its tunnel", || async {
        match f.agent_get("/readyz").await? {
            (200, _) => Ok(()),
            (status, body) => Err(format!("/readyz {status}: {body}")),
        }
    })
    .await;
    f.await_ready(PROXIED, "through the port-forward").await;
    let connects = f.connects();
    assert!(
        count(&connects, hub_api) > before,
        "the port-forward did not go through tinyproxy: {connects:?}"
    );
    assert_eq!(
        count(&connects, agent_service),
        tunnels_through_the_proxy,
        "with the PortForward entrypoint the agent still dialed the agent Service: {connects:?}"
    );
    assert!(
        !connects.iter().any(|c| c.starts_with("127.")),
        "loopback went through the proxy: {connects:?}"
    );
    eprintln!(
        "{PROXIED}: failing as it should after {:.1}s, joined through the proxy after {:.1}s, \
         through the port-forward after {:.1}s; tinyproxy CONNECTed {} times to the agent \
         Service, {} to the hub API",
        failing.as_secs_f64(),
        joined.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        count(&connects, agent_service),
        count(&connects, hub_api),
    );
    let Fixture { env, tinyproxy, .. } = f;
    drop(tinyproxy);
    env.shutdown().await;
}
