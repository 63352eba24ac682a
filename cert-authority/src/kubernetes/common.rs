//! What every part of the `kubernetes` backend shares: its field manager
//! and names, its error, and its identified client.

use kube::Client;

use crate::authority::AuthorityError;

pub const FIELD_MANAGER: &str = "cluster-proxy-cert-authority";
pub const LEASE_NAME: &str = "cluster-proxy-cert-authority";
/// Label on every Secret the authority creates; its watch selects by it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Sent on every request, so audit logs name the component.
pub const USER_AGENT: &str = concat!("cert-authority/", env!("CARGO_PKG_VERSION"));

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("Kubernetes client configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    #[error("Secret {name}: {detail}")]
    BadSecret { name: String, detail: String },
    #[error("another replica ({0}) holds the lease")]
    NotLeader(String),
    #[error("cannot follow the ManagedProxyConfiguration: {0}")]
    Configuration(String),
    #[error("signer Secret {namespace}/{name}: {source}")]
    DamagedSigner {
        namespace: String,
        name: String,
        #[source]
        source: AuthorityError,
    },
}

impl KubeError {
    /// Whether the signer Secret holds damaged CA material: nothing is
    /// written until a person repairs it.
    pub fn is_damaged_signer(&self) -> bool {
        matches!(self, KubeError::DamagedSigner { .. })
    }
}

/// Makes every request of a client built from `config` carry
/// [`USER_AGENT`].
pub fn identify(config: &mut kube::Config) {
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(USER_AGENT),
    ));
}

/// A client from the usual configuration inference (`KUBECONFIG`,
/// `~/.kube/config`, in-cluster), identifying itself as [`USER_AGENT`].
pub async fn client() -> Result<Client, KubeError> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|e| KubeError::Config(e.to_string()))?;
    identify(&mut config);
    cluster_proxy_control::client::build(config).map_err(|e| KubeError::Config(e.to_string()))
}
