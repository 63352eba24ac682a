//! What the environment's modules share: its error, the hub's fixed names
//! and ports, and the stand-in kube-apiservers' certificates. A leaf: it
//! imports nothing of the environment.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cert_authority::pki::{Authority, LeafRequest};
use serde::{Deserialize, Serialize};
use simulated_cluster::binaries::BuildError;
use simulated_cluster::netns::NetnsError;
use simulated_cluster::process::ProcessError;

/// The namespace of the hub's cluster-proxy objects in the Kubernetes API.
pub const ADDON_NAMESPACE: &str = "open-cluster-management-addon";

/// Port of the in-memory Kubernetes API.
pub const KUBE_API_PORT: u16 = 6443;

/// Agent port of the load balancer in front of the replicas (the
/// Kubernetes Service an agent dials).
pub const AGENT_SERVICE_PORT: u16 = 8091;

/// The ports of replica `index` on the hub address.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ReplicaPorts {
    pub client: u16,
    pub agent: u16,
    pub health: u16,
    pub admin: u16,
}

impl ReplicaPorts {
    pub fn of(index: usize) -> Self {
        let step = 100 * index as u16;
        ReplicaPorts {
            client: 8090 + step,
            agent: 9091 + step,
            health: 8092 + step,
            admin: 8095 + step,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("network namespaces are required but unavailable: {0}")]
    NetnsUnavailable(String),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("PKI: {0}")]
    Pki(String),
    #[error("in-memory Kubernetes API: {0}")]
    KubeApi(String),
    #[error("invalid cluster name {0:?}: {1}")]
    ClusterName(String, String),
    #[error("no free address slot 198.18.x.0/24 (or 127.18.x.0/24) for a new environment")]
    NoSlot,
    #[error("{0}")]
    NotReady(String),
    #[error(
        "environment {id} is already running (supervised by pid {owner}); stop it with `cargo run -p e2e -- down`"
    )]
    AlreadyRunning { id: String, owner: u32 },
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> EnvError {
    let what = what.into();
    move |source| EnvError::Io { what, source }
}

/// The stand-in kube-apiserver credentials of one cluster, from a CA of the
/// cluster's own (as a real cluster has).
pub(crate) fn write_apiserver_pki(
    dir: &Path,
    cluster: &str,
    service_ip: IpAddr,
) -> Result<PathBuf, EnvError> {
    std::fs::create_dir_all(dir).map_err(io(dir.display().to_string()))?;
    let ca = Authority::generate(
        &format!("{cluster}-apiserver-ca"),
        Duration::from_secs(86400 * 365),
    )
    .map_err(|e| EnvError::Pki(e.to_string()))?;
    let ip = service_ip.to_string();
    let leaf = ca
        .issue(&LeafRequest::server(
            "kube-apiserver",
            &[cluster, "kubernetes", "kubernetes.default.svc", &ip],
        ))
        .map_err(|e| EnvError::Pki(e.to_string()))?;
    let write = |name: &str, content: &str, private: bool| {
        cert_authority::files::write_atomically(&dir.join(name), content, private)
            .map_err(|e| EnvError::Pki(e.to_string()))
    };
    write("ca.crt", ca.cert_pem(), false)?;
    write("tls.crt", &leaf.cert_pem, false)?;
    write("tls.key", &leaf.key_pem, true)?;
    Ok(dir.join("ca.crt"))
}
