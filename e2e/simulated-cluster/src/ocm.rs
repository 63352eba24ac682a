//! The parts of OCM that no cluster here runs, played by the environment so
//! that the real control plane (addon-manager, cert-authority) can install
//! cluster-proxy on "managed clusters" that are only processes:
//!
//! * the **placement controller**: every `Placement` gets
//!   `PlacementDecision`s (`<placement>-decision-<n>`, labelled with the
//!   placement, 100 clusters each, written one after another as OCM does)
//!   listing the `ManagedCluster`s its predicates' label selectors match
//!   (all clusters when it has none);
//! * the **registration agent** of each managed cluster: it accepts the
//!   cluster (`hubAcceptsClient`, the cluster namespace, the cluster's
//!   conditions), asks for the addon's agent certificate with a CSR made as
//!   the cluster's own identity and with the subject the addon's
//!   `status.registrations` asks for (a changed subject — after a CA
//!   rollover — asks again), writes the addon's hub kubeconfig, and turns
//!   the addon Lease into the `Available` condition as OCM does (True while
//!   `renewTime` is within 5 lease durations, False after, Unknown without
//!   a Lease);
//! * the **work agent** of each managed cluster: it applies the addon's
//!   `ManifestWork` — every object to the cluster's own API when it has one
//!   ([`cluster_api`](super::cluster_api)), its Secrets become Secret
//!   volumes, its Deployment runs through [`kubelet`](super::kubelet) — and
//!   reports `Applied`/`Available` on the work.
//!
//! The addon-agent gets no in-cluster configuration here, so it renews the
//! hub Lease `<cluster>/cluster-proxy` (upstream's fallback) and the
//! registration agent reads that one.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::api::addon::v1alpha1::{
    CONDITION_AVAILABLE, ManagedClusterAddOn, REASON_LEASE_NOT_FOUND, REASON_LEASE_UPDATE_STOPPED,
    REASON_LEASE_UPDATED,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::{LABEL_PLACEMENT, Placement, PlacementDecision};
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::work::v1::{DeleteOption, ManifestWork};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use time::OffsetDateTime;

use crate::binaries::Binaries;
use crate::cluster_api::ClusterApi;
use crate::kubelet::{DeploymentRunner, PodPlacement, RunnerStatus, SecretVolumes};
use crate::process::{Logs, Supervised};
use memory_apiserver::selector::LabelSelector;

/// OCM's CustomResourceDefinitions as the in-memory API serves them
/// (`e2e/simulated-cluster/crds/ocm.yaml`): every OCM kind the control plane, the tests and
/// the environment use.
pub const CRDS: &str = include_str!("../crds/ocm.yaml");

/// A ManagedProxyConfiguration `cluster-proxy` for tests and examples of the
/// addon controllers: proxy-servers in `hub_namespace` reached at
/// `proxy.hub.example:8091`, `agent_replicas` agents, both on image
/// `registry.local/cluster-proxy:1`.
pub fn sample_managed_proxy_configuration(
    hub_namespace: &str,
    agent_replicas: i32,
) -> Result<ManagedProxyConfiguration, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "cluster-proxy"},
        "spec": {
            "authentication": {},
            "proxyServer": {
                "image": "registry.local/cluster-proxy:1",
                "namespace": hub_namespace,
                "entrypoint": {"type": "Hostname", "hostname": {"value": "proxy.hub.example"}, "port": 8091},
            },
            "proxyAgent": {"image": "registry.local/cluster-proxy:1", "replicas": agent_replicas},
        },
    }))
}

/// The hub CA bundle Secret `proxy-server-ca` (key `ca.crt`) as
/// cert-authority writes it, holding `ca_pem`.
pub fn ca_bundle_secret(namespace: &str, ca_pem: &str) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("proxy-server-ca".to_owned()),
            namespace: Some(namespace.to_owned()),
            ..Default::default()
        },
        data: Some(
            [(
                "ca.crt".to_owned(),
                k8s_openapi::ByteString(ca_pem.as_bytes().to_vec()),
            )]
            .into(),
        ),
        ..Default::default()
    }
}

/// An agent's health and admin ports (on its cluster's service address);
/// pod `index` adds `10 * index` ([`agent_ports`]).
pub const AGENT_PORTS: (u16, u16) = (8093, 8094);

/// The addon this environment installs.
pub const ADDON_NAME: &str = "cluster-proxy";
/// The ManifestWork addon-framework names for the addon's agent.
pub const AGENT_WORK_NAME: &str = "addon-cluster-proxy-deploy-0";
/// The agent Deployment in that work.
pub const AGENT_DEPLOYMENT: &str = "cluster-proxy-proxy-agent";
/// The Secret the registration agent keeps the agent certificate in.
pub const AGENT_CERT_SECRET: &str =
    "cluster-proxy-open-cluster-management.io-proxy-agent-signer-client-cert";
/// The Secret the registration agent keeps the addon's hub kubeconfig in.
pub const HUB_KUBECONFIG_SECRET: &str = "cluster-proxy-hub-kubeconfig";
const PROXY_AGENT_SIGNER: &str = "open-cluster-management.io/proxy-agent-signer";
const KUBE_CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client";
/// Field managers of the emulated OCM agents.
const REGISTRATION_MANAGER: &str = "registration-agent";
const WORK_MANAGER: &str = "work-agent";
const PLACEMENT_MANAGER: &str = "placement-controller";
/// OCM's grace: an addon is unavailable after this many lease durations.
const LEASE_GRACE_DURATIONS: i64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum OcmError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("the cluster's API: {0}")]
    ClusterApi(#[from] crate::cluster_api::ClusterApiError),
    #[error("{0}")]
    Other(String),
}

fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 404)
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 409)
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// A label selector object (`matchLabels`, `matchExpressions`) in the text
/// form the in-memory API's selector parses.
fn selector_text(selector: &Value) -> String {
    let mut terms = Vec::new();
    if let Some(labels) = selector.get("matchLabels").and_then(Value::as_object) {
        for (k, v) in labels {
            terms.push(format!("{k}={}", v.as_str().unwrap_or_default()));
        }
    }
    for expression in selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let key = expression.get("key").and_then(Value::as_str).unwrap_or("");
        let values: Vec<&str> = expression
            .get("values")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        match expression.get("operator").and_then(Value::as_str) {
            Some("In") => terms.push(format!("{key} in ({})", values.join(","))),
            Some("NotIn") => terms.push(format!("{key} notin ({})", values.join(","))),
            Some("Exists") => terms.push(key.to_string()),
            Some("DoesNotExist") => terms.push(format!("!{key}")),
            _ => {}
        }
    }
    terms.join(",")
}

/// The clusters `placement` selects among `clusters` (JSON objects).
pub fn placement_selects(placement: &Value, clusters: &[Value]) -> BTreeSet<String> {
    let predicates: Vec<&Value> = placement
        .pointer("/spec/predicates")
        .and_then(Value::as_array)
        .map(|p| p.iter().collect())
        .unwrap_or_default();
    let selectors: Vec<Option<LabelSelector>> = predicates
        .iter()
        .map(|p| {
            let selector = p.pointer("/requiredClusterSelector/labelSelector")?;
            LabelSelector::parse(&selector_text(selector)).ok()
        })
        .collect();
    clusters
        .iter()
        .filter(|c| c.pointer("/metadata/deletionTimestamp").is_none())
        .filter(|c| {
            selectors.is_empty()
                || selectors
                    .iter()
                    .any(|s| s.as_ref().is_none_or(|s| s.matches(c)))
        })
        .filter_map(|c| c.pointer("/metadata/name")?.as_str().map(String::from))
        .collect()
}

/// The most clusters OCM's placement controller puts in one
/// PlacementDecision (`maxNumOfClusterDecisions`).
pub const MAX_CLUSTERS_PER_DECISION: usize = 100;

/// One pass of the placement controller.
pub async fn sync_placements(client: &Client) -> Result<(), OcmError> {
    let clusters: Vec<Value> = Api::<ManagedCluster>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|c| serde_json::to_value(c).ok())
        .collect();
    let placements = Api::<Placement>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    for placement in placements.items {
        let (Some(name), Some(namespace)) = (
            placement.metadata.name.clone(),
            placement.metadata.namespace.clone(),
        ) else {
            continue;
        };
        let value = serde_json::to_value(&placement).unwrap_or(Value::Null);
        let selected = placement_selects(&value, &clusters);
        if write_decisions(client, &namespace, &name, &selected).await? {
            let placements: Api<Placement> = Api::namespaced(client.clone(), &namespace);
            let status = json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta1",
                "kind": "Placement",
                "metadata": {"name": name, "namespace": namespace},
                "status": {"numberOfSelectedClusters": selected.len()},
            });
            placements
                .patch_status(
                    &name,
                    &PatchParams::apply(PLACEMENT_MANAGER).force(),
                    &Patch::Apply(&status),
                )
                .await?;
        }
    }
    Ok(())
}

/// Writes `selected` as the decisions of `placement` the way OCM's
/// placement controller does: sorted by name, split into objects
/// `<placement>-decision-<n>` of at most [`MAX_CLUSTERS_PER_DECISION`] (one
/// empty object when nothing is selected), written one after another, and
/// objects past the last deleted. Like OCM's, the writes are not atomic:
/// a cluster moving from one object to the next is briefly in none.
/// Whether anything changed.
async fn write_decisions(
    client: &Client,
    namespace: &str,
    placement: &str,
    selected: &BTreeSet<String>,
) -> Result<bool, OcmError> {
    let decisions: Api<PlacementDecision> = Api::namespaced(client.clone(), namespace);
    let existing = decisions
        .list(&ListParams::default().labels(&format!("{LABEL_PLACEMENT}={placement}")))
        .await?;
    let clusters_of = |decision: &PlacementDecision| -> Vec<String> {
        decision
            .status
            .as_ref()
            .and_then(|s| s.decisions.as_ref())
            .into_iter()
            .flatten()
            .map(|d| d.cluster_name.clone())
            .collect()
    };
    let current: BTreeMap<String, Vec<String>> = existing
        .items
        .iter()
        .map(|d| (d.name_any(), clusters_of(d)))
        .collect();
    let selected: Vec<&String> = selected.iter().collect();
    let mut slices: Vec<&[&String]> = selected.chunks(MAX_CLUSTERS_PER_DECISION).collect();
    if slices.is_empty() {
        slices.push(&[]);
    }
    let params = PatchParams::apply(PLACEMENT_MANAGER).force();
    let mut changed = false;
    let mut wanted_names = BTreeSet::new();
    for (index, slice) in slices.iter().enumerate() {
        let decision_name = format!("{placement}-decision-{}", index + 1);
        wanted_names.insert(decision_name.clone());
        let wanted: Vec<String> = slice.iter().map(|c| (*c).clone()).collect();
        let current = current.get(&decision_name);
        if current.is_none() {
            let object = json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta1",
                "kind": "PlacementDecision",
                "metadata": {"name": decision_name, "namespace": namespace,
                    "labels": {LABEL_PLACEMENT: placement}},
            });
            decisions
                .patch(&decision_name, &params, &Patch::Apply(&object))
                .await?;
        }
        if current != Some(&wanted) {
            let entries: Vec<Value> = wanted
                .iter()
                .map(|c| json!({"clusterName": c, "reason": ""}))
                .collect();
            let status = json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta1",
                "kind": "PlacementDecision",
                "metadata": {"name": decision_name, "namespace": namespace},
                "status": {"decisions": entries},
            });
            decisions
                .patch_status(&decision_name, &params, &Patch::Apply(&status))
                .await?;
            changed = true;
        }
    }
    for stale in current.keys().filter(|name| !wanted_names.contains(*name)) {
        match decisions.delete(stale, &DeleteParams::default()).await {
            Ok(_) => changed = true,
            Err(error) if is_not_found(&error) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(changed)
}

/// Writes a kubeconfig for a user in groups and returns its path.
pub type KubeconfigFn = Arc<dyn Fn(&str, &[&str]) -> Result<PathBuf, String> + Send + Sync>;

/// A kubeconfig's text for a client certificate and its key.
pub type CertificateKubeconfigFn = Arc<dyn Fn(&str, &str) -> String + Send + Sync>;

pub use crate::netns::Machine;

/// What the emulated agents need to know about the environment.
#[derive(Clone)]
pub struct OcmContext {
    /// The hub API as administrator (the OCM controllers' own rights).
    pub admin: Client,
    /// Makes a kubeconfig for `user` in `groups` (for this process).
    pub kubeconfig_for: KubeconfigFn,
    /// A kubeconfig that authenticates with a client certificate (PEM
    /// certificate, PEM key) at the API's address as the managed clusters
    /// reach it: the hub kubeconfig the registration agent writes.
    pub cluster_kubeconfig_with_certificate: CertificateKubeconfigFn,
    pub binaries: Binaries,
    pub logs: Logs,
    pub state_dir: PathBuf,
    /// How often servers and agents look for new credential files.
    pub credential_reload_interval: String,
    /// The addon Lease duration the environment gives addon-agents (short,
    /// so `Available` follows quickly).
    pub lease_duration: Duration,
}

/// The status of one managed cluster, as `up` prints it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterStatus {
    pub agent: RunnerStatus,
    pub certificate: Option<String>,
    pub available: Option<String>,
}

/// The registration and work agents of one managed cluster.
pub struct Klusterlet {
    pub name: String,
    pub machine: Machine,
    pub services: Supervised,
    volumes: SecretVolumes,
    runner: DeploymentRunner,
    /// The proxy-agent's client certificate (our signer).
    agent_certificate: Credential,
    /// The addon-agent's hub kubeconfig (kube-apiserver-client).
    hub_kubeconfig: Credential,
    /// The objects the work agent made on the managed cluster
    /// (`group/resource/namespace/name`), and whether it deletes each with
    /// the work (the work's delete options at apply time, as OCM's).
    cluster_objects: BTreeMap<String, bool>,
    /// The cluster's own kube-apiserver, where the work's objects go.
    api: Option<ClusterApi>,
    /// The work (uid, generation) whose objects are all applied to `api`.
    applied_work: Option<(String, i64)>,
    pub status: ClusterStatus,
}

struct AgentPlacement {
    cluster: String,
    machine: Machine,
    namespace: String,
    credential_reload_interval: String,
    lease_duration: Duration,
    /// The cluster's API as the pods see it: URL, CA and the pod's
    /// ServiceAccount token (the service-proxy's in-cluster configuration).
    kube: Option<PodKube>,
    dialer: Option<memory_apiserver::pods::PodDialer>,
}

/// A pod's in-cluster view of its cluster's kube-apiserver.
struct PodKube {
    url: String,
    ca: PathBuf,
    token: PathBuf,
}

/// The proxy-agent's health and admin ports of pod `index`.
pub fn agent_ports(index: usize) -> (u16, u16) {
    let step = 10 * index as u16;
    (AGENT_PORTS.0 + step, AGENT_PORTS.1 + step)
}

impl PodPlacement for AgentPlacement {
    fn extra_args(&self, index: usize, _replicas: usize, container: &str) -> Vec<String> {
        let ip = self.machine.service_ip;
        let (health, admin) = agent_ports(index);
        match container {
            "proxy-agent" => vec![
                format!("--health-server-host={ip}"),
                format!("--health-server-port={health}"),
                format!("--admin-bind-address={ip}"),
                format!("--admin-server-port={admin}"),
                // The ExternalName Service `<cluster>` and its namespaced
                // name lead to the cluster's (stand-in) kube-apiserver.
                format!("--host-alias={}={ip}", self.cluster),
                format!("--host-alias={}.{}={ip}", self.cluster, self.namespace),
                format!(
                    "--credential-reload-interval={}",
                    self.credential_reload_interval
                ),
                "--keepalive-time=10s".into(),
                // The pod's hostAliases send the service-proxy's host to
                // the pod's own loopback, which is the cluster's service
                // address here.
                format!(
                    "--host-alias={}={ip}",
                    cluster_proxy_proto::identity::ClusterName::new(self.cluster.as_str())
                        .map(|c| c.service_proxy_host())
                        .unwrap_or_default()
                ),
            ],
            "addon-agent" => vec![
                format!("--proxy-agent-health-url=http://{ip}:{health}/readyz"),
                format!("--lease-duration={}s", self.lease_duration.as_secs().max(1)),
                "--health-port=0".into(),
            ],
            "service-proxy" => {
                let mut args = vec![
                    format!("--bind-address={ip}"),
                    format!("--health-bind-address={ip}"),
                ];
                if let Some(kube) = &self.kube {
                    args.extend([
                        format!("--kube-api={}", kube.url),
                        format!("--kube-ca={}", kube.ca.display()),
                        format!("--token-file={}", kube.token.display()),
                    ]);
                }
                args
            }
            _ => Vec::new(),
        }
    }

    fn netns(&self) -> Option<String> {
        self.machine.netns.clone()
    }

    fn dialer(&self) -> Option<memory_apiserver::pods::PodDialer> {
        self.dialer.clone()
    }

    /// The pods share the cluster's service address as their loopback
    /// (one agent pod per cluster here): any port there is the pod's.
    fn loopback(&self, _index: usize) -> Option<IpAddr> {
        Some(self.machine.service_ip)
    }

    fn pod_ip(&self, _index: usize) -> Option<IpAddr> {
        Some(self.machine.service_ip)
    }
}

impl Klusterlet {
    /// The cluster `name` on `machine`, with its own kube-apiserver `api`
    /// when it has one.
    pub fn new(
        name: &str,
        machine: Machine,
        services: Supervised,
        dir: PathBuf,
        api: Option<ClusterApi>,
    ) -> Self {
        let runner =
            DeploymentRunner::new(name).reporting_to(api.as_ref().map(ClusterApi::kubelet));
        Klusterlet {
            name: name.to_string(),
            machine,
            services,
            volumes: SecretVolumes::new(dir.join("secrets")),
            runner,
            agent_certificate: Credential::new(PROXY_AGENT_SIGNER, AGENT_CERT_SECRET),
            hub_kubeconfig: Credential::new(KUBE_CLIENT_SIGNER, HUB_KUBECONFIG_SECRET),
            cluster_objects: BTreeMap::new(),
            api,
            applied_work: None,
            status: ClusterStatus::default(),
        }
    }

    /// The cluster's own kube-apiserver, if it has one.
    pub fn api(&self) -> Option<&ClusterApi> {
        self.api.as_ref()
    }

    /// The cluster's own registration identity on the hub.
    fn registration_user(&self) -> String {
        format!(
            "system:open-cluster-management:{}:registration-agent",
            self.name
        )
    }

    /// Accepts the cluster as OCM's hub controllers and the cluster admin
    /// do: the cluster namespace, and the cluster's conditions.
    pub async fn accept(&self, ctx: &OcmContext) -> Result<(), OcmError> {
        let namespaces: Api<Namespace> = Api::all(ctx.admin.clone());
        let namespace = json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": self.name}});
        namespaces
            .patch(
                &self.name,
                &PatchParams::apply(REGISTRATION_MANAGER),
                &Patch::Apply(&namespace),
            )
            .await?;
        let now = rfc3339(OffsetDateTime::now_utc());
        let condition = |type_: &str, reason: &str| {
            json!({"type": type_, "status": "True", "reason": reason,
                "message": reason, "lastTransitionTime": now})
        };
        let status = json!({
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {"name": self.name},
            "status": {"conditions": [
                condition("HubAcceptedManagedCluster", "HubClusterAdminAccepted"),
                condition("ManagedClusterJoined", "ManagedClusterJoined"),
                condition("ManagedClusterConditionAvailable", "ManagedClusterAvailable"),
            ]},
        });
        let clusters: Api<ManagedCluster> = Api::all(ctx.admin.clone());
        let current = clusters.get(&self.name).await?;
        let joined = current.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "ManagedClusterJoined")
        });
        if !joined {
            clusters
                .patch_status(
                    &self.name,
                    &PatchParams::apply(REGISTRATION_MANAGER).force(),
                    &Patch::Apply(&status),
                )
                .await?;
        }
        Ok(())
    }

    /// One pass of the cluster's registration and work agents.
    pub async fn sync(&mut self, ctx: &OcmContext) {
        let addon = match Api::<ManagedClusterAddOn>::namespaced(ctx.admin.clone(), &self.name)
            .get_opt(ADDON_NAME)
            .await
        {
            Ok(addon) => addon,
            Err(err) => {
                tracing::debug!("{}: reading the addon: {err}", self.name);
                return;
            }
        };
        if let Some(addon) = &addon
            && let Err(err) = self.register(ctx, addon).await
        {
            tracing::warn!("{}: registration: {err}", self.name);
        }
        if let Err(err) = self.apply_work(ctx).await {
            tracing::warn!("{}: work: {err}", self.name);
        }
        if let Some(addon) = &addon
            && let Err(err) = self.report_lease(ctx, addon).await
        {
            tracing::warn!("{}: lease: {err}", self.name);
        }
    }

    /// The registration agent's part: each of the addon's registrations
    /// gets its credential through a CSR, as OCM's does.
    async fn register(
        &mut self,
        ctx: &OcmContext,
        addon: &ManagedClusterAddOn,
    ) -> Result<(), OcmError> {
        let client = memory_apiserver::KubeApi::client_from(
            &(ctx.kubeconfig_for)(
                &self.registration_user(),
                &[
                    &format!("system:open-cluster-management:{}", self.name),
                    "system:open-cluster-management:managed-clusters",
                    "system:authenticated",
                ],
            )
            .map_err(OcmError::Other)?,
        )
        .await
        .map_err(|e| OcmError::Other(e.to_string()))?;
        let csrs: Api<CertificateSigningRequest> = Api::all(client);
        let name = self.name.clone();
        let hub_kubeconfig = &ctx.cluster_kubeconfig_with_certificate;
        if let Some(subject) = Subject::of_registration(addon, KUBE_CLIENT_SIGNER, &name) {
            // Rejections and the CSR limit are logged where they happen.
            self.hub_kubeconfig
                .sync(&csrs, &name, subject, &self.volumes, |cert, key| {
                    let text = hub_kubeconfig(cert, key);
                    [("kubeconfig".to_string(), text.into_bytes())].into()
                })
                .await?;
        }
        if let Some(subject) = Subject::of_registration(addon, PROXY_AGENT_SIGNER, &name) {
            let issued = self
                .agent_certificate
                .sync(&csrs, &name, subject, &self.volumes, |cert, key| {
                    [
                        ("tls.crt".to_string(), cert.as_bytes().to_vec()),
                        ("tls.key".to_string(), key.as_bytes().to_vec()),
                    ]
                    .into()
                })
                .await?;
            self.status.certificate = Some(issued.describe());
        }
        Ok(())
    }

    async fn apply_work(&mut self, ctx: &OcmContext) -> Result<(), OcmError> {
        let works: Api<ManifestWork> = Api::namespaced(ctx.admin.clone(), &self.name);
        let work = works.get_opt(AGENT_WORK_NAME).await?;
        let work = work.filter(|w| w.metadata.deletion_timestamp.is_none());
        let mut deployment: Option<Deployment> = None;
        let mut namespace = String::new();
        match &work {
            // What the work made stays only where its delete options say so.
            None => {
                if let Some(api) = self.api.as_mut() {
                    for (key, _) in self.cluster_objects.iter().filter(|(_, deleted)| **deleted) {
                        api.delete(key).await?;
                    }
                }
                self.applied_work = None;
                self.cluster_objects
                    .retain(|_, deleted_with_work| !*deleted_with_work)
            }
            Some(work) => {
                let option = work.spec.delete_option.as_ref();
                for identifier in work
                    .spec
                    .workload
                    .iter()
                    .flat_map(|w| w.manifests.iter().flatten())
                    .filter_map(|m| m.identifier())
                {
                    let deleted = DeleteOption::deletes(option, &identifier);
                    let key = format!(
                        "{}/{}/{}/{}",
                        identifier.group,
                        identifier.resource,
                        identifier.namespace,
                        identifier.name
                    );
                    self.cluster_objects.insert(key, deleted);
                }
            }
        }
        if let (Some(api), Some(work)) = (self.api.as_mut(), &work) {
            let stamp = (
                work.metadata.uid.clone().unwrap_or_default(),
                work.metadata.generation.unwrap_or_default(),
            );
            if self.applied_work.as_ref() != Some(&stamp) {
                // In the work's order (its Namespace first); what fails is
                // tried again on the next pass, as the work agent retries.
                let mut complete = true;
                for manifest in work
                    .spec
                    .workload
                    .iter()
                    .flat_map(|w| w.manifests.iter().flatten())
                {
                    let Some(id) = manifest.identifier() else {
                        continue;
                    };
                    let key = format!("{}/{}/{}/{}", id.group, id.resource, id.namespace, id.name);
                    if let Err(err) = api.apply(&key, &manifest.0).await {
                        tracing::warn!("{}: work: {err}", self.name);
                        complete = false;
                    }
                }
                if complete {
                    self.applied_work = Some(stamp);
                }
            }
        }
        if let Some(work) = &work {
            for manifest in work
                .spec
                .workload
                .iter()
                .flat_map(|w| w.manifests.iter().flatten())
            {
                let value = &manifest.0;
                match value.get("kind").and_then(Value::as_str) {
                    Some("Secret") => {
                        if let Ok(secret) = serde_json::from_value::<Secret>(value.clone()) {
                            self.volumes
                                .write(&secret)
                                .map_err(|e| OcmError::Other(e.to_string()))?;
                        }
                    }
                    Some("Deployment")
                        if value.pointer("/metadata/name").and_then(Value::as_str)
                            == Some(AGENT_DEPLOYMENT) =>
                    {
                        let parsed: Deployment = serde_json::from_value(value.clone())
                            .map_err(|e| OcmError::Other(format!("agent Deployment: {e}")))?;
                        namespace = parsed.metadata.namespace.clone().unwrap_or_default();
                        deployment = Some(parsed);
                    }
                    _ => {}
                }
            }
        }
        // The kubelet projects the pod's ServiceAccount token; a pod
        // whose account is not there yet does not start (as a real pod
        // waits for its projected volume).
        let mut kube = None;
        if let (Some(api), Some(deployment)) = (&self.api, &deployment) {
            let account = deployment
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".into());
            let Some(token) = api.project_token(&namespace, &account) else {
                tracing::debug!(
                    "{}: no ServiceAccount {namespace}/{account} yet for the agent pods",
                    self.name
                );
                return Ok(());
            };
            kube = Some(PodKube {
                url: api.url(),
                ca: api.ca_path(),
                token,
            });
        }
        let placement = AgentPlacement {
            cluster: self.name.clone(),
            machine: self.machine.clone(),
            namespace,
            credential_reload_interval: ctx.credential_reload_interval.clone(),
            lease_duration: ctx.lease_duration,
            kube,
            dialer: self.api.as_ref().and_then(ClusterApi::pod_dialer),
        };
        let status = self
            .runner
            .sync(
                deployment.as_ref(),
                &ctx.binaries,
                &ctx.logs,
                &self.volumes,
                &placement,
            )
            .await;
        let changed = status != self.status.agent;
        self.status.agent = status.clone();
        if let (Some(work), true) = (work, changed) {
            let now = rfc3339(OffsetDateTime::now_utc());
            let available = status.waiting.is_none() && status.running == status.desired;
            let condition = |type_: &str, ok: bool, reason: &str, message: &str| {
                json!({"type": type_, "status": if ok {"True"} else {"False"},
                    "reason": reason, "message": message, "lastTransitionTime": now,
                    "observedGeneration": work.metadata.generation})
            };
            let message = status.waiting.clone().unwrap_or_else(|| {
                format!(
                    "{} of {} agent pods running",
                    status.running, status.desired
                )
            });
            let patch = json!({
                "apiVersion": "work.open-cluster-management.io/v1",
                "kind": "ManifestWork",
                "metadata": {"name": AGENT_WORK_NAME, "namespace": self.name},
                "status": {"conditions": [
                    condition("Applied", true, "AppliedManifestWorkComplete", "Apply manifest work complete"),
                    condition("Available", available,
                        if available {"ResourcesAvailable"} else {"ResourcesNotAvailable"}, &message),
                ]},
            });
            match works
                .patch_status(
                    AGENT_WORK_NAME,
                    &PatchParams::apply(WORK_MANAGER).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                Ok(_) => {}
                Err(err) if is_not_found(&err) || is_conflict(&err) => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(())
    }

    async fn report_lease(
        &mut self,
        ctx: &OcmContext,
        addon: &ManagedClusterAddOn,
    ) -> Result<(), OcmError> {
        let leases: Api<Lease> = Api::namespaced(ctx.admin.clone(), &self.name);
        let lease = leases.get_opt(ADDON_NAME).await?;
        let now = OffsetDateTime::now_utc();
        let (status, reason, message) = match lease.as_ref().and_then(|l| l.spec.as_ref()) {
            None => (
                "Unknown",
                REASON_LEASE_NOT_FOUND,
                format!("The status of {ADDON_NAME} add-on is unknown."),
            ),
            Some(spec) => {
                let duration = i64::from(spec.lease_duration_seconds.unwrap_or(60));
                let renewed = spec
                    .renew_time
                    .as_ref()
                    .map(|t| t.0.as_second())
                    .unwrap_or(0);
                if renewed + LEASE_GRACE_DURATIONS * duration > now.unix_timestamp() {
                    (
                        "True",
                        REASON_LEASE_UPDATED,
                        format!("{ADDON_NAME} add-on is available."),
                    )
                } else {
                    (
                        "False",
                        REASON_LEASE_UPDATE_STOPPED,
                        format!("{ADDON_NAME} add-on is not available."),
                    )
                }
            }
        };
        self.status.available = Some(format!("{status} ({reason})"));
        let current = addon.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == CONDITION_AVAILABLE)
                .cloned()
        });
        if current
            .as_ref()
            .is_some_and(|c| c.status == status && c.reason == reason)
        {
            return Ok(());
        }
        let patch = json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": ADDON_NAME, "namespace": self.name},
            "status": {"conditions": [{
                "type": CONDITION_AVAILABLE, "status": status, "reason": reason,
                "message": message, "lastTransitionTime": rfc3339(now),
            }]},
        });
        Api::<ManagedClusterAddOn>::namespaced(ctx.admin.clone(), &self.name)
            .patch_status(
                ADDON_NAME,
                &PatchParams::apply(REGISTRATION_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        Ok(())
    }

    /// Stops the cluster's agents and services.
    /// The objects on the managed cluster that the work agent made and
    /// has not deleted (`group/resource/namespace/name`).
    pub fn cluster_objects(&self) -> BTreeSet<String> {
        self.cluster_objects.keys().cloned().collect()
    }

    pub async fn stop(&mut self) {
        self.runner.stop_all().await;
        self.services.stop(Duration::from_secs(5)).await;
        if let Some(api) = self.api.take() {
            api.shutdown().await;
        }
    }

    /// The agent pods' processes.
    pub fn agent_processes(&self) -> impl Iterator<Item = &Supervised> {
        self.runner.processes()
    }

    /// Every process of the cluster: its services and its agent pods.
    pub fn processes(&self) -> impl Iterator<Item = &Supervised> {
        std::iter::once(&self.services).chain(self.runner.processes())
    }
}

/// Deletes the hub objects a departed cluster leaves behind, as OCM's hub
/// controllers do when a ManagedCluster goes: its namespace (with the
/// addon, the work and the Lease in it).
pub async fn forget_cluster(client: &Client, name: &str) -> Result<(), OcmError> {
    match Api::<Namespace>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A new key and a PEM CSR for the given subject.
fn make_csr(user: &str, groups: &[String], units: &[String]) -> Result<(String, String), OcmError> {
    let key = rcgen::KeyPair::generate().map_err(|e| OcmError::Other(e.to_string()))?;
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, user);
    // One attribute per group: rcgen keeps one value per attribute type, so
    // the second organization is written under its OID as a custom type.
    for (i, group) in groups.iter().enumerate() {
        let dn_type = match i {
            0 => rcgen::DnType::OrganizationName,
            1 => rcgen::DnType::CustomDnType(vec![2, 5, 4, 10]),
            _ => {
                return Err(OcmError::Other(format!(
                    "a subject of more than two groups ({groups:?}) cannot be requested here"
                )));
            }
        };
        params.distinguished_name.push(dn_type, group.as_str());
    }
    for unit in units {
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationalUnitName, unit.as_str());
    }
    let csr = params
        .serialize_request(&key)
        .and_then(|csr| csr.pem())
        .map_err(|e| OcmError::Other(e.to_string()))?;
    Ok((csr, key.serialize_pem()))
}

/// A certificate subject as OCM's registration agent requests and checks
/// it (`pkg/registration/register/csr/certificate.go`): the common name,
/// and organizations and organizational units compared as sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub user: String,
    pub groups: Vec<String>,
    pub units: Vec<String>,
}

impl Subject {
    /// The subject the addon's registration for `signer` asks for; for the
    /// kube-apiserver-client signer without one, OCM's default (the
    /// cluster's addon user and its one group).
    pub fn of_registration(
        addon: &ManagedClusterAddOn,
        signer: &str,
        cluster: &str,
    ) -> Option<Self> {
        let registrations = serde_json::to_value(addon.status.as_ref()?)
            .ok()?
            .get("registrations")?
            .clone();
        let registration = registrations
            .as_array()?
            .iter()
            .find(|r| r.get("signerName").and_then(Value::as_str) == Some(signer))?
            .clone();
        let Some(subject) = registration
            .get("subject")
            .filter(|s| s.get("user").is_some())
        else {
            if signer != KUBE_CLIENT_SIGNER {
                return None;
            }
            let group =
                format!("system:open-cluster-management:cluster:{cluster}:addon:{ADDON_NAME}");
            return Some(Subject {
                user: format!("{group}:agent:{ADDON_NAME}"),
                groups: vec![group],
                units: Vec::new(),
            });
        };
        let strings = |key: &str| -> Vec<String> {
            subject
                .get(key)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        };
        Some(Subject {
            user: subject.get("user").and_then(Value::as_str)?.to_string(),
            groups: strings("groups"),
            units: strings("organizationUnit"),
        })
    }

    /// Whether a certificate's subject is this one, as OCM checks it.
    pub fn matches(&self, certificate: &x509_parser::certificate::X509Certificate<'_>) -> bool {
        let subject = certificate.subject();
        let texts = |values: Vec<Option<&str>>| -> BTreeSet<String> {
            values.into_iter().flatten().map(str::to_string).collect()
        };
        let common_name = subject
            .iter_common_name()
            .next()
            .and_then(|a| a.as_str().ok());
        common_name == Some(self.user.as_str())
            && texts(
                subject
                    .iter_organization()
                    .map(|a| a.as_str().ok())
                    .collect(),
            ) == self.groups.iter().cloned().collect()
            && texts(
                subject
                    .iter_organizational_unit()
                    .map(|a| a.as_str().ok())
                    .collect(),
            ) == self.units.iter().cloned().collect()
    }
}

/// OCM stops asking for an addon's certificates once this many of its CSRs
/// exist on the hub (`addonCSRThreshold`), whatever their state.
pub const ADDON_CSR_THRESHOLD: usize = 10;

/// One registration's credential, as the registration agent keeps it.
struct Credential {
    signer: &'static str,
    secret: &'static str,
    /// The CSR in flight: name, key and subject.
    pending: Option<(String, String, Subject)>,
    /// The subject of the credential in the Secret.
    issued: Option<Subject>,
    not_before: Option<OffsetDateTime>,
    not_after: Option<OffsetDateTime>,
    /// The last certificate OCM would not take, and why.
    rejected: Option<String>,
    halted: bool,
}

/// Where a credential stands after a pass.
enum Standing {
    Issued(OffsetDateTime),
    Requested(String),
    Rejected(String),
    Halted,
}

impl Standing {
    fn describe(&self) -> String {
        match self {
            Standing::Issued(to) => format!("issued, valid until {}", rfc3339(*to)),
            Standing::Requested(csr) => {
                format!("requested (CSR {csr}), waiting for approval and signing")
            }
            Standing::Rejected(why) => format!("rejected: {why}; asked again"),
            Standing::Halted => {
                "Stop creating csr since there are too many csr created already on hub".into()
            }
        }
    }
}

impl Credential {
    fn new(signer: &'static str, secret: &'static str) -> Self {
        Credential {
            signer,
            secret,
            pending: None,
            issued: None,
            not_before: None,
            not_after: None,
            rejected: None,
            halted: false,
        }
    }

    /// One pass: keeps the credential for `subject` current in its Secret
    /// volume (`data` makes the Secret's keys from certificate and key),
    /// asking for a new one when there is none, the subject changed or
    /// 20 % of its life is left, as OCM's registration agent.
    async fn sync(
        &mut self,
        csrs: &Api<CertificateSigningRequest>,
        cluster: &str,
        subject: Subject,
        volumes: &SecretVolumes,
        data: impl FnOnce(&str, &str) -> BTreeMap<String, Vec<u8>>,
    ) -> Result<Standing, OcmError> {
        let now = OffsetDateTime::now_utc();
        let renew_due = match (self.not_before, self.not_after) {
            (Some(from), Some(to)) => now >= to - (to - from) * 0.2,
            _ => true,
        };
        if self.issued.as_ref() == Some(&subject) && volumes.exists(self.secret) && !renew_due {
            self.pending = None;
            if let Some(to) = self.not_after {
                return Ok(Standing::Issued(to));
            }
        }
        if let Some((name, key_pem, pending_subject)) = self.pending.clone()
            && pending_subject == subject
        {
            let Some(csr) = csrs.get_opt(&name).await? else {
                self.pending = None;
                return Ok(Standing::Requested(name));
            };
            let Some(cert) = csr.status.as_ref().and_then(|s| s.certificate.as_ref()) else {
                return Ok(Standing::Requested(name));
            };
            let pem = String::from_utf8_lossy(&cert.0).into_owned();
            self.pending = None;
            match check_issued(&pem, &subject, now) {
                Ok((from, to)) => {
                    volumes
                        .write_data(self.secret, &data(&pem, &key_pem))
                        .map_err(|e| OcmError::Other(e.to_string()))?;
                    self.issued = Some(subject);
                    self.not_before = Some(from);
                    self.not_after = Some(to);
                    self.rejected = None;
                    return Ok(Standing::Issued(to));
                }
                // OCM: "No valid client certificate … is found. Bootstrap is
                // required", and a new CSR.
                Err(why) => {
                    tracing::warn!(%cluster, csr = %name, signer = self.signer, "{why}");
                    self.rejected = Some(format!("CSR {name}: {why}"));
                }
            }
        }
        // OCM's halt: it counts every CSR of this cluster's addon on the hub.
        let labels = format!(
            "open-cluster-management.io/cluster-name={cluster},open-cluster-management.io/addon-name={ADDON_NAME}"
        );
        let existing = csrs.list(&ListParams::default().labels(&labels)).await?;
        if existing.items.len() >= ADDON_CSR_THRESHOLD {
            if !self.halted {
                tracing::warn!(%cluster, signer = self.signer, "too many csr created already on hub");
            }
            self.halted = true;
            return Ok(Standing::Halted);
        }
        self.halted = false;
        let (csr_pem, key_pem) = make_csr(&subject.user, &subject.groups, &subject.units)?;
        let object: CertificateSigningRequest = serde_json::from_value(json!({
            "metadata": {
                "generateName": format!("addon-{cluster}-{ADDON_NAME}-"),
                "labels": {
                    "open-cluster-management.io/cluster-name": cluster,
                    "open-cluster-management.io/addon-name": ADDON_NAME,
                },
            },
            "spec": {
                "signerName": self.signer,
                "request": base64_encode(csr_pem.as_bytes()),
                "usages": ["digital signature", "key encipherment", "client auth"],
            },
        }))
        .map_err(|e| OcmError::Other(e.to_string()))?;
        let created = csrs.create(&PostParams::default(), &object).await?;
        self.pending = Some((created.name_any(), key_pem, subject));
        Ok(match self.rejected.clone() {
            Some(why) => Standing::Rejected(why),
            None => Standing::Requested(created.name_any()),
        })
    }
}

/// The validity of an issued certificate when OCM's registration agent
/// takes it: unexpired, and with the subject it asked for.
fn check_issued(
    pem: &str,
    subject: &Subject,
    now: OffsetDateTime,
) -> Result<(OffsetDateTime, OffsetDateTime), String> {
    let (_, der) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .map_err(|e| format!("the issued certificate is not PEM: {e}"))?;
    let cert = der
        .parse_x509()
        .map_err(|e| format!("the issued certificate does not parse: {e}"))?;
    let (from, to) = (
        cert.validity().not_before.to_datetime(),
        cert.validity().not_after.to_datetime(),
    );
    if now > to {
        return Err(format!("the issued certificate expired at {}", rfc3339(to)));
    }
    if !subject.matches(&cert) {
        return Err(format!(
            "No valid client certificate is found: issued for {}, requested {subject:?}",
            cert.subject()
        ));
    }
    Ok((from, to))
}

/// Shared view of every klusterlet, for status printing and tests.
pub type Klusterlets = Arc<tokio::sync::Mutex<BTreeMap<String, Klusterlet>>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "labels": labels}})
    }

    #[test]
    fn a_placement_selects_by_its_predicates_label_selectors() {
        let clusters = vec![
            cluster("a", json!({"env": "prod", "name": "a"})),
            cluster("b", json!({"env": "dev", "name": "b"})),
            json!({"metadata": {"name": "gone", "deletionTimestamp": "2026-01-01T00:00:00Z"}}),
        ];
        let all = json!({"spec": {"clusterSets": ["global"]}});
        assert_eq!(
            placement_selects(&all, &clusters),
            BTreeSet::from(["a".to_string(), "b".to_string()])
        );
        let prod = json!({"spec": {"predicates": [{"requiredClusterSelector": {"labelSelector":
            {"matchLabels": {"env": "prod"}}}}]}});
        assert_eq!(
            placement_selects(&prod, &clusters),
            BTreeSet::from(["a".to_string()])
        );
        let not_b = json!({"spec": {"predicates": [{"requiredClusterSelector": {"labelSelector":
            {"matchExpressions": [{"key": "name", "operator": "NotIn", "values": ["b"]}]}}}]}});
        assert_eq!(
            placement_selects(&not_b, &clusters),
            BTreeSet::from(["a".to_string()])
        );
        let either = json!({"spec": {"predicates": [
            {"requiredClusterSelector": {"labelSelector": {"matchLabels": {"env": "dev"}}}},
            {"requiredClusterSelector": {"labelSelector": {"matchExpressions":
                [{"key": "env", "operator": "In", "values": ["prod"]}]}}},
        ]}});
        assert_eq!(placement_selects(&either, &clusters).len(), 2);
    }

    fn certificate(cn: &str, groups: &[&str], units: &[&str]) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::CommonName, cn);
        for (i, group) in groups.iter().enumerate() {
            let t = if i == 0 {
                rcgen::DnType::OrganizationName
            } else {
                rcgen::DnType::CustomDnType(vec![2, 5, 4, 10])
            };
            dn.push(t, *group);
        }
        for unit in units {
            dn.push(rcgen::DnType::OrganizationalUnitName, *unit);
        }
        params.distinguished_name = dn;
        params.self_signed(&key).unwrap().pem()
    }

    /// The registration agent takes a certificate only with the subject it
    /// asked for, as OCM compares them: the common name, and organizations
    /// and units as sets.
    #[test]
    fn an_issued_certificate_must_carry_the_requested_subject() {
        let wanted = Subject {
            user: "agent".into(),
            groups: vec!["g1".into(), "g2".into()],
            units: vec!["u".into()],
        };
        let now = OffsetDateTime::now_utc();
        assert!(check_issued(&certificate("agent", &["g2", "g1"], &["u"]), &wanted, now).is_ok());
        for (what, pem) in [
            (
                "common name",
                certificate("cluster-proxy-agent:c", &["g1", "g2"], &["u"]),
            ),
            ("organizations", certificate("agent", &["g1"], &["u"])),
            ("units", certificate("agent", &["g1", "g2"], &[])),
        ] {
            let error = check_issued(&pem, &wanted, now).expect_err(what);
            assert!(
                error.contains("No valid client certificate"),
                "{what}: {error}"
            );
        }
        // rcgen's default validity ends in 4096.
        let later = OffsetDateTime::new_utc(
            time::Date::from_calendar_date(4097, time::Month::January, 1).unwrap(),
            time::Time::MIDNIGHT,
        );
        let error = check_issued(&certificate("agent", &["g1", "g2"], &["u"]), &wanted, later)
            .expect_err("expired");
        assert!(error.contains("expired"), "{error}");
    }

    #[test]
    fn an_agent_csr_carries_the_requested_subject() {
        let (csr, key) = make_csr(
            "open-cluster-management:cluster-proxy:proxy-agent",
            &["open-cluster-management:cluster-proxy".to_string()],
            &["signer-abc".to_string()],
        )
        .unwrap();
        assert!(key.contains("PRIVATE KEY"));
        let (_, der) = x509_parser::pem::parse_x509_pem(csr.as_bytes()).unwrap();
        use x509_parser::prelude::FromDer;
        let (_, request) =
            x509_parser::certification_request::X509CertificationRequest::from_der(&der.contents)
                .unwrap();
        let subject = request.certification_request_info.subject.to_string();
        assert!(
            subject.contains("CN=open-cluster-management:cluster-proxy:proxy-agent"),
            "{subject}"
        );
        assert!(subject.contains("OU=signer-abc"), "{subject}");
        assert!(
            subject.contains("O=open-cluster-management:cluster-proxy"),
            "{subject}"
        );
    }
}
