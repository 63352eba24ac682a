//! The environment's hub side with the real control plane (see
//! [`super::control_plane`] for its parts): starting it, its CA and
//! health-prober; the admin client; the clusters' machines and readiness;
//! the clusters' summaries in `env.json`. It is `Environment`'s own code,
//! apart so that the control plane depends on nothing of the environment.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

use super::common::ReplicaPorts;
use super::control_plane::{
    AgentEntrypoint, ControlPlane, ControlPlaneSetup, ENV_LEASE_DURATION, HubRbac, MachinePool,
    PROBE_INTERVAL, USER_SERVER_DEPLOYMENT, addon_status, chart_user_server_deployment,
    cluster_dir, join, managed_proxy_configuration, reachable, replica_client_addr,
};
use simulated_cluster::ocm::{Machine, OcmContext};
use simulated_cluster::process::{ProcessSpec, Supervised};

impl super::Environment {
    /// Starts health-prober once the hub client credentials it mounts
    /// exist (cert-authority writes them within a second or two): every
    /// cluster's stand-in kube-apiserver (`:6443`) through each of the
    /// first `replicas` replicas.
    async fn start_health_prober(
        &self,
        client_pki: &std::path::Path,
        replicas: usize,
        hub_rbac: Option<&HubRbac>,
    ) -> Result<Supervised, super::EnvError> {
        let files = [
            client_pki.join("ca-bundle.crt"),
            client_pki.join("proxy-client/tls.crt"),
            client_pki.join("proxy-client/tls.key"),
        ];
        let started = std::time::Instant::now();
        while !files.iter().all(|f| f.is_file()) {
            if started.elapsed() > Duration::from_secs(120) {
                return Err(super::EnvError::NotReady(format!(
                    "no hub client credentials in {} after 120 s (is cert-authority writing the proxy-client Secret?)",
                    client_pki.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let api = self
            .kube_api
            .as_ref()
            .ok_or_else(|| super::EnvError::KubeApi("no in-memory API".into()))?;
        let addresses: Vec<String> = (0..replicas)
            .map(|i| replica_client_addr(self.summary.hub_addr, i).to_string())
            .collect();
        let kubeconfig = match hub_rbac {
            Some(rbac) => HubRbac::kubeconfig(api, &rbac.health_prober)?,
            None => api.kubeconfig_path().to_path_buf(),
        };
        let binary = self.binaries.dir.join("health-prober");
        Ok(Supervised::start(
            ProcessSpec::new("health-prober", &binary)
                .args([
                    format!("--namespace={}", super::ADDON_NAMESPACE),
                    format!("--proxy-server-addresses={}", addresses.join(",")),
                    format!("--proxy-ca-cert={}", files[0].display()),
                    format!("--proxy-cert={}", files[1].display()),
                    format!("--proxy-key={}", files[2].display()),
                    format!(
                        "--target-port={}",
                        simulated_cluster::sample::APISERVER_PORT
                    ),
                    format!("--interval={PROBE_INTERVAL}"),
                    "--timeout=2s".into(),
                    "--health-port=0".into(),
                    "--health-bind-address=127.0.0.1".into(),
                ])
                .env("KUBECONFIG", kubeconfig.display().to_string()),
            &self.logs,
        )?)
    }

    /// The control plane and OCM's stand-ins, then the initial clusters
    /// join through it.
    pub(super) async fn start_control_plane(
        &mut self,
        options: &super::EnvOptions,
        machine_names: &[String],
        slot: u8,
    ) -> Result<(), super::EnvError> {
        use super::EnvError;
        let api_err = |e: String| EnvError::KubeApi(e);
        let Some(api) = self.kube_api.as_ref() else {
            return Err(api_err("no in-memory API".into()));
        };
        api.register_crds_from_yaml(include_str!(
            "../../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml"
        ))
        .map_err(|e| api_err(e.to_string()))?;
        api.register_crds_from_yaml(simulated_cluster::ocm::CRDS)
            .map_err(|e| api_err(e.to_string()))?;
        let admin = api.client().await.map_err(|e| api_err(e.to_string()))?;

        // Where clusters reach the API: a forwarder on the hub's agent
        // address (network namespaces), or the API itself (loopback).
        let cluster_api_addr = match &self.topology {
            Some(t) => {
                let listen = SocketAddr::new(IpAddr::V4(t.hub_agent_addr()), super::KUBE_API_PORT);
                self.kube_forwarder = Some(Supervised::start(
                    ProcessSpec::new("kube-api-forwarder", &self.binaries.e2e)
                        .args([
                            "balance".to_string(),
                            "--listen".into(),
                            listen.to_string(),
                            "--backend".into(),
                            api.addr().to_string(),
                        ])
                        .in_netns(self.summary.hub_netns.clone()),
                    &self.logs,
                )?);
                listen
            }
            None => api.addr(),
        };
        let direct = api.kubeconfigs(None);
        let for_clusters = api.kubeconfigs(Some(cluster_api_addr));

        // What a user's `helm install` puts on the hub besides the
        // addon-manager's own objects: the MPC and the placement.
        let mut sans = vec![
            self.summary.hub_addr.to_string(),
            self.summary.agent_service_addr.ip().to_string(),
        ];
        sans.dedup();
        let entrypoint = if self.topology.is_some() && !options.hostname_entrypoint {
            AgentEntrypoint::PortForward
        } else {
            AgentEntrypoint::Hostname(self.summary.agent_service_addr)
        };
        // With service access, users reach the user-server on the hub
        // address: its certificate names it.
        let user_server = options
            .hub_rbac
            .as_ref()
            .and_then(|rbac| rbac.user_server.clone());
        let user_server_sans = [self.summary.hub_addr.to_string()];
        let mpc = managed_proxy_configuration(
            options.replicas,
            entrypoint,
            &sans,
            user_server.is_some().then_some(&user_server_sans[..]),
        );
        let mpcs: Api<cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration> =
            Api::all(admin.clone());
        mpcs.patch(
            "cluster-proxy",
            &PatchParams::apply("helm"),
            &Patch::Apply(&mpc),
        )
        .await
        .map_err(|e| api_err(format!("applying the ManagedProxyConfiguration: {e}")))?;
        let placement = json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta1",
            "kind": "Placement",
            "metadata": {"name": "cluster-proxy-placement", "namespace": super::ADDON_NAMESPACE},
            "spec": {"clusterSets": ["global"]},
        });
        Api::<cluster_proxy_proto::api::cluster::v1beta1::Placement>::namespaced(
            admin.clone(),
            super::ADDON_NAMESPACE,
        )
        .patch(
            "cluster-proxy-placement",
            &PatchParams::apply("helm"),
            &Patch::Apply(&placement),
        )
        .await
        .map_err(|e| api_err(format!("applying the Placement: {e}")))?;

        // The user-server's Deployment as `helm install` puts it on the
        // hub; the hub kubelet runs it once its Secrets exist.
        let user_server_kubeconfig = match &user_server {
            Some(account) => {
                let deployment = chart_user_server_deployment().map_err(api_err)?;
                Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(
                    admin.clone(),
                    super::ADDON_NAMESPACE,
                )
                .patch(
                    USER_SERVER_DEPLOYMENT,
                    &PatchParams::apply("helm"),
                    &Patch::Apply(&deployment),
                )
                .await
                .map_err(|e| api_err(format!("applying the user-server Deployment: {e}")))?;
                Some(HubRbac::kubeconfig(api, account)?)
            }
            None => None,
        };
        let addon_manager = self.binaries.dir.join("addon-manager");
        let addon_manager_kubeconfig = match &options.hub_rbac {
            Some(rbac) => HubRbac::kubeconfig(api, &rbac.addon_manager)?,
            None => api.kubeconfig_path().to_path_buf(),
        };
        self.addon_manager = Some(Supervised::start(
            ProcessSpec::new("addon-manager", &addon_manager)
                .args(super::addon_manager_args(user_server.is_some()))
                .env("KUBECONFIG", addon_manager_kubeconfig.display().to_string())
                .env("POD_NAMESPACE", super::ADDON_NAMESPACE)
                .in_netns(self.summary.hub_netns.clone()),
            &self.logs,
        )?);

        let machines = machine_names
            .iter()
            .enumerate()
            .map(|(i, _)| match &self.topology {
                Some(t) => Machine {
                    netns: Some(t.cluster_netns(i)),
                    service_ip: IpAddr::V4(simulated_cluster::netns::CLUSTER_SERVICE_ADDR),
                },
                None => Machine {
                    netns: None,
                    service_ip: IpAddr::V4(std::net::Ipv4Addr::new(127, 18, slot, 10 + i as u8)),
                },
            })
            .collect();
        // A proxied cluster's machine is its own (see `machine_names`).
        let owners = super::proxied_machines(options, machine_names)
            .map(|(index, name)| (index, name.clone()))
            .collect();
        let client_pki = self.summary.state_dir.join("hub").join("client-pki");
        let ocm = OcmContext {
            admin: admin.clone(),
            kubeconfig_for: Arc::new(move |user, groups| {
                direct.write(user, groups).map_err(|e| e.to_string())
            }),
            cluster_kubeconfig_with_certificate: Arc::new(move |cert, key| {
                for_clusters.certificate_kubeconfig(cert, key)
            }),
            binaries: self.binaries.clone(),
            logs: self.logs.clone(),
            state_dir: self.summary.state_dir.clone(),
            credential_reload_interval: options.credential_reload_interval.clone(),
            lease_duration: ENV_LEASE_DURATION,
        };
        self.control_plane = Some(ControlPlane::start(ControlPlaneSetup {
            ocm,
            hub_namespace: super::ADDON_NAMESPACE.to_string(),
            hub_ip: self.summary.hub_addr,
            hub_netns: self.summary.hub_netns.clone(),
            machines: MachinePool::new(machines, owners),
            client_pki: client_pki.clone(),
            user_server_kubeconfig,
            kubelet: self
                .kube_api
                .as_ref()
                .map(memory_apiserver::KubeApi::kubelet),
        }));
        for name in &options.clusters {
            join(&admin, name)
                .await
                .map_err(|e| api_err(format!("ManagedCluster {name}: {e}")))?;
        }
        self.health_prober = Some(
            self.start_health_prober(&client_pki, options.replicas, options.hub_rbac.as_ref())
                .await?,
        );
        self.summary.pki_dir = client_pki;
        self.summary.user_server = user_server.as_ref().map(|_| {
            SocketAddr::new(
                self.summary.hub_addr,
                super::control_plane::USER_SERVER_PORT,
            )
        });
        self.summary.servers = (0..options.replicas)
            .map(|i| (format!("cluster-proxy-{i}"), ReplicaPorts::of(i)))
            .collect();
        Ok(())
    }
}

impl super::Environment {
    /// The admin client of the in-memory API.
    pub async fn admin_client(&self) -> Result<Client, super::EnvError> {
        let api = self
            .kube_api
            .as_ref()
            .ok_or_else(|| super::EnvError::KubeApi("no in-memory API".into()))?;
        api.client()
            .await
            .map_err(|e| super::EnvError::KubeApi(e.to_string()))
    }

    /// The machine (service address) a joined cluster runs on.
    pub async fn machine_of(&self, cluster: &str) -> Option<Machine> {
        let control_plane = self.control_plane.as_ref()?;
        let klusterlets = control_plane.klusterlets.lock().await;
        klusterlets.get(cluster).map(|k| k.machine.clone())
    }

    /// Waits until the addon of every cluster in `clusters` is `Available`
    /// and each answers through every one of `replicas` proxy-server
    /// replicas: the whole control-plane path, end to end.
    pub async fn wait_clusters_ready(
        &self,
        clusters: &[String],
        replicas: usize,
        timeout: Duration,
    ) -> Result<Duration, super::EnvError> {
        let started = std::time::Instant::now();
        let admin = self.admin_client().await?;
        loop {
            let mut missing = Vec::new();
            let rows = addon_status(&admin).await.unwrap_or_default();
            for name in clusters {
                match rows.iter().find(|r| &r.name == name) {
                    Some(row) if row.available.starts_with("True") => {}
                    Some(row) => missing.push(format!("{name}: addon Available {}", row.available)),
                    None => missing.push(format!("{name}: no ManagedCluster")),
                }
            }
            if missing.is_empty() {
                match self.hub_client() {
                    Ok(client) => {
                        let client = client.with_timeout(Duration::from_secs(2));
                        for replica in 0..replicas {
                            let addr = replica_client_addr(self.summary.hub_addr, replica);
                            for name in clusters {
                                if let Err(err) = reachable(&client, addr, name).await {
                                    missing
                                        .push(format!("{name} via cluster-proxy-{replica}: {err}"));
                                }
                            }
                        }
                    }
                    Err(err) => missing.push(format!("hub client credentials: {err}")),
                }
            }
            if missing.is_empty() {
                return Ok(started.elapsed());
            }
            if started.elapsed() > timeout {
                return Err(super::EnvError::NotReady(format!(
                    "not ready after {timeout:?}:\n  {}",
                    missing.join("\n  ")
                )));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

impl super::Environment {
    /// With the control plane: `summary.clusters` (and `env.json`) from the
    /// clusters that have joined so far.
    pub async fn refresh_cluster_summaries(&mut self) -> Result<(), super::EnvError> {
        let Some(control_plane) = &self.control_plane else {
            return Ok(());
        };
        let clusters: Vec<super::ClusterSummary> = control_plane
            .klusterlets
            .lock()
            .await
            .values()
            .map(|k| super::ClusterSummary {
                name: k.name.clone(),
                netns: k.machine.netns.clone(),
                service_ip: k.machine.service_ip,
                apiserver_ca: cluster_dir(&self.summary.state_dir, &k.name).join("ca.crt"),
            })
            .collect();
        if clusters
            .iter()
            .map(|c| &c.name)
            .ne(self.summary.clusters.iter().map(|c| &c.name))
        {
            self.summary.clusters = clusters;
            let path = super::Summary::file(&self.summary.state_dir);
            let text = serde_json::to_string_pretty(&self.summary)
                .map_err(|e| super::EnvError::Pki(e.to_string()))?;
            std::fs::write(&path, text).map_err(super::io(path.display().to_string()))?;
        }
        Ok(())
    }
}
