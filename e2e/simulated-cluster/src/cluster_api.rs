//! A managed cluster's own kube-apiserver: the in-memory API with RBAC on,
//! serving on the cluster's service address inside the cluster's network
//! (port 6443, where the stand-in `/healthz` endpoint is without it), so
//! what reaches a cluster through the tunnel meets real authorization:
//! impersonation, denials, per-verb rules.
//!
//! This process reaches it on a loopback address of its own; pods reach it
//! at `https://<service address>:6443`. It plays the cluster's side of the
//! work agent (the ManifestWork's objects are applied to it) and of the
//! kubelet (pods it runs are Pod objects with logs, exec and port-forward;
//! a pod's ServiceAccount token is written where the pod reads it).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use kube::api::{DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::discovery::{self, ApiResource, Scope};
use kube::{Api, Client};
use memory_apiserver::pods::{KubeletPods, PodDialer};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::Value;

use crate::netns::Machine;

/// The port of every cluster's kube-apiserver, on its service address.
pub const KUBE_API_PORT: u16 = 6443;
/// The field manager of what the work agent applies.
const WORK_AGENT: &str = "work-agent";

/// Why the cluster's API could not start or do what the work asked.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ClusterApiError(String);

fn other(error: impl std::fmt::Display) -> ClusterApiError {
    ClusterApiError(error.to_string())
}

/// One object the work agent made, to delete it with the work.
#[derive(Debug, Clone)]
struct Applied {
    resource: ApiResource,
    namespaced: bool,
    namespace: Option<String>,
    name: String,
}

/// A managed cluster's kube-apiserver.
pub struct ClusterApi {
    api: KubeApi,
    /// The cluster administrator (the work agent's rights).
    admin: Client,
    machine: Machine,
    dir: PathBuf,
    /// What the work agent applied, by `group/resource/namespace/name` (the
    /// key of the work's manifest identifiers).
    applied: BTreeMap<String, Applied>,
}

impl ClusterApi {
    /// Starts the API of cluster `name` on `machine`, its files in `dir`.
    pub async fn start(name: &str, machine: &Machine, dir: &Path) -> Result<Self, ClusterApiError> {
        let service = SocketAddr::new(machine.service_ip, KUBE_API_PORT);
        let mut options = KubeApiOptions::new(dir.join("api"));
        options.rbac = true;
        // The names pods use for their cluster's API (the agent's host
        // aliases lead `<cluster>` here).
        options.extra_sans = vec![
            name.to_string(),
            "kubernetes".into(),
            "kubernetes.default".into(),
        ];
        match &machine.netns {
            // This process lives outside the cluster's network: it serves
            // pods on a socket made inside it, and itself on loopback.
            Some(netns) => {
                let listener = crate::netns::listen_in(netns, service)
                    .map_err(|e| other(format!("{name}'s kube-apiserver on {service}: {e}")))?;
                options.listeners = vec![std::sync::Arc::new(listener)];
            }
            None => options.bind = service,
        }
        let api = KubeApi::start(options).await.map_err(other)?;
        let admin = api.client().await.map_err(other)?;
        let cluster_api = ClusterApi {
            api,
            admin,
            machine: machine.clone(),
            dir: dir.to_path_buf(),
            applied: BTreeMap::new(),
        };
        cert_authority::files::write_atomically(
            &cluster_api.ca_path(),
            cluster_api.api.ca_pem(),
            false,
        )
        .map_err(other)?;
        Ok(cluster_api)
    }

    /// `https://<service address>:6443`: the API as the cluster's pods reach it.
    pub fn url(&self) -> String {
        format!(
            "https://{}",
            SocketAddr::new(self.machine.service_ip, KUBE_API_PORT)
        )
    }

    /// The API's CA bundle (what pods find in their ServiceAccount's `ca.crt`).
    pub fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The API itself (kubeconfigs, the kubelet side, tokens).
    pub fn api(&self) -> &KubeApi {
        &self.api
    }

    /// A client with the cluster administrator's rights.
    pub fn admin(&self) -> &Client {
        &self.admin
    }

    /// The kubelet side: pods run on this cluster become its Pod objects.
    pub fn kubelet(&self) -> KubeletPods {
        self.api.kubelet()
    }

    /// How the kubelet reaches the cluster's pods: from inside the
    /// cluster's network when it has one of its own.
    pub fn pod_dialer(&self) -> Option<PodDialer> {
        let netns = self.machine.netns.clone()?;
        Some(PodDialer(std::sync::Arc::new(move |addr| {
            Box::pin(crate::netns::connect_in(netns.clone(), addr))
        })))
    }

    /// The cluster's service address.
    pub fn service_ip(&self) -> IpAddr {
        self.machine.service_ip
    }

    /// Applies one manifest of the work (server-side apply, as OCM's work
    /// agent with `ServerSideApply` does); `key` names it among the work's
    /// manifests.
    pub async fn apply(&mut self, key: &str, manifest: &Value) -> Result<(), ClusterApiError> {
        let text = |pointer: &str| manifest.pointer(pointer).and_then(Value::as_str);
        let (Some(api_version), Some(kind), Some(name)) =
            (text("/apiVersion"), text("/kind"), text("/metadata/name"))
        else {
            return Err(other(
                "a manifest without apiVersion, kind or metadata.name",
            ));
        };
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (resource, capabilities) = discovery::pinned_kind(&self.admin, &gvk)
            .await
            .map_err(|e| other(format!("{kind} {api_version}: {e}")))?;
        let namespaced = capabilities.scope == Scope::Namespaced;
        let namespace = text("/metadata/namespace").map(str::to_owned);
        let api: Api<DynamicObject> = match (&namespace, namespaced) {
            (Some(ns), true) => Api::namespaced_with(self.admin.clone(), ns, &resource),
            (None, true) => Api::default_namespaced_with(self.admin.clone(), &resource),
            (_, false) => Api::all_with(self.admin.clone(), &resource),
        };
        api.patch(
            name,
            &PatchParams::apply(WORK_AGENT).force(),
            &Patch::Apply(manifest),
        )
        .await
        .map_err(|e| other(format!("applying {kind} {name}: {e}")))?;
        self.applied.insert(
            key.to_string(),
            Applied {
                resource,
                namespaced,
                namespace,
                name: name.to_string(),
            },
        );
        Ok(())
    }

    /// Deletes what the work agent applied under `key`, if anything.
    pub async fn delete(&mut self, key: &str) -> Result<(), ClusterApiError> {
        let Some(applied) = self.applied.get(key).cloned() else {
            return Ok(());
        };
        let api: Api<DynamicObject> = match (&applied.namespace, applied.namespaced) {
            (Some(ns), true) => Api::namespaced_with(self.admin.clone(), ns, &applied.resource),
            (None, true) => Api::default_namespaced_with(self.admin.clone(), &applied.resource),
            (_, false) => Api::all_with(self.admin.clone(), &applied.resource),
        };
        match api.delete(&applied.name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(other(format!("deleting {}: {e}", applied.name))),
        }
        self.applied.remove(key);
        Ok(())
    }

    /// What the kubelet projects into a pod running as ServiceAccount
    /// `namespace/name`: a token bound to it, in a file (written once; it
    /// authenticates until the account goes). `None` until the account
    /// exists.
    pub fn project_token(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        let path = self
            .dir
            .join("serviceaccounts")
            .join(namespace)
            .join(name)
            .join("token");
        if path.is_file() {
            return Some(path);
        }
        let token = self
            .api
            .kubeconfigs(None)
            .service_account_token(namespace, name)
            .ok()?;
        cert_authority::files::write_atomically(&path, &token, true).ok()?;
        Some(path)
    }

    pub async fn shutdown(self) {
        self.api.shutdown().await;
    }
}
