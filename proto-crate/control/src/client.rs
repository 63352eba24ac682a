//! Kubernetes clients that name their component in every request's
//! User-Agent, so audit logs and API priority rules can tell the services
//! apart.

use std::path::{Path, PathBuf};

use cluster_proxy_egress::{Egress, EgressConnector, EgressSettings};
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("User-Agent {0:?} is not a valid header value")]
    UserAgent(String),
    #[error("Kubernetes client configuration: {0}")]
    Config(String),
    #[error("reading kubeconfig {}: {source}", path.display())]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kubeconfig {}: {detail}", path.display())]
    BadKubeconfig { path: PathBuf, detail: String },
    #[error("building the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
    #[error("the way to the API server: {0}")]
    Egress(#[source] cluster_proxy_egress::EgressError),
}

/// Makes every request of a client built from `config` carry `user_agent`.
pub fn identify(config: &mut kube::Config, user_agent: &str) -> Result<(), ClientError> {
    let value = http::HeaderValue::from_str(user_agent)
        .map_err(|_| ClientError::UserAgent(user_agent.to_string()))?;
    config.headers.push((http::header::USER_AGENT, value));
    Ok(())
}

/// The client of `config`, reaching the API server by the proxy rules of
/// the environment (`HTTPS_PROXY`, `NO_PROXY`, as client-go does) or the
/// kubeconfig's `proxy-url`: see [`build_with`].
pub fn build(config: kube::Config) -> Result<Client, ClientError> {
    build_with(config, &EgressSettings::default())
}

/// The client of `config`: kube-rs's own stack (base URI, retries of
/// server errors, authentication, extra headers, connect/read/write
/// timeouts) over connections opened by [`Egress`]: straight to the API
/// server with TCP_NODELAY, as client-go's, or through the forward proxy
/// the rules name. kube-rs leaves Nagle's algorithm on, and an upgraded
/// stream's small writes then wait for the API server's delayed ACK:
/// through the `PortForward` entrypoint, which carries every agent's tunnel
/// over the hub API, each exchange of two small writes in a row (a TLS
/// client's Finished, then its request) took 40 ms more.
///
/// The proxy: `egress`'s URL, else the kubeconfig's `proxy-url`, else the
/// `*_PROXY` variables; `NO_PROXY` applies to each.
pub fn build_with(config: kube::Config, egress: &EgressSettings) -> Result<Client, ClientError> {
    use kube::client::ConfigExt;
    let mut settings = egress.clone();
    if settings.proxy_url.is_none() {
        settings.proxy_url = config.proxy_url.as_ref().map(ToString::to_string);
    }
    let user_agent = config
        .headers
        .iter()
        .rev()
        .find(|(name, _)| name == http::header::USER_AGENT)
        .and_then(|(_, value)| value.to_str().ok())
        .unwrap_or("cluster-proxy");
    let egress = Egress::from_env(&settings, user_agent).map_err(ClientError::Egress)?;
    let https = config.rustls_https_connector_with_connector(EgressConnector::new(egress))?;
    let mut timed = hyper_timeout::TimeoutConnector::new(https);
    timed.set_connect_timeout(config.connect_timeout);
    timed.set_read_timeout(config.read_timeout);
    timed.set_write_timeout(config.write_timeout);
    timed.set_reset_reader_on_write(config.reset_reader_on_write);
    let connections =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(timed);
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(connections);
    Ok(Client::new(service, config.default_namespace))
}

/// A client from the usual configuration inference (`KUBECONFIG`,
/// `~/.kube/config`, in-cluster), identifying itself as `user_agent`.
pub async fn client(user_agent: &str) -> Result<Client, ClientError> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|e| ClientError::Config(e.to_string()))?;
    identify(&mut config, user_agent)?;
    build(config)
}

/// A client from the in-cluster configuration (the pod's service account).
pub fn in_cluster(user_agent: &str) -> Result<Client, ClientError> {
    let mut config = kube::Config::incluster().map_err(|e| ClientError::Config(e.to_string()))?;
    identify(&mut config, user_agent)?;
    build(config)
}

/// A client from the current context of the kubeconfig at `path`; files it
/// names by relative paths are found next to it, as kubectl finds them.
pub async fn client_from(path: &Path, user_agent: &str) -> Result<Client, ClientError> {
    let kubeconfig = read_kubeconfig(path)?;
    client_from_kubeconfig(path, kubeconfig, user_agent, &EgressSettings::default()).await
}

fn read_kubeconfig(path: &Path) -> Result<Kubeconfig, ClientError> {
    // Read once first so that a missing file is an I/O error, not a parse error.
    std::fs::metadata(path).map_err(|source| ClientError::ReadKubeconfig {
        path: path.to_path_buf(),
        source,
    })?;
    Kubeconfig::read_from(path).map_err(|e| ClientError::BadKubeconfig {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

async fn client_from_kubeconfig(
    path: &Path,
    kubeconfig: Kubeconfig,
    user_agent: &str,
    egress: &EgressSettings,
) -> Result<Client, ClientError> {
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| ClientError::BadKubeconfig {
                path: path.to_path_buf(),
                detail: e.to_string(),
            })?;
    identify(&mut config, user_agent)?;
    build_with(config, egress)
}

/// The kubeconfig's bytes and those of every file it names (CA, client
/// certificate and key, token file): the klusterlet rotates the client
/// certificate files without touching the kubeconfig itself.
fn fingerprint(path: &Path, kubeconfig: &Kubeconfig) -> Result<Vec<u8>, ClientError> {
    let mut bytes = std::fs::read(path).map_err(|source| ClientError::ReadKubeconfig {
        path: path.to_path_buf(),
        source,
    })?;
    let clusters = kubeconfig
        .clusters
        .iter()
        .filter_map(|named| named.cluster.as_ref())
        .filter_map(|cluster| cluster.certificate_authority.clone());
    let auth_files = kubeconfig
        .auth_infos
        .iter()
        .filter_map(|named| named.auth_info.as_ref())
        .flat_map(|auth| {
            [
                auth.client_certificate.clone(),
                auth.client_key.clone(),
                auth.token_file.clone(),
            ]
        })
        .flatten();
    for file in clusters.chain(auth_files) {
        bytes.extend_from_slice(b"\0");
        bytes.extend_from_slice(file.as_bytes());
        bytes.extend_from_slice(b"\0");
        // A missing file is left for the client build to report.
        bytes.extend(std::fs::read(&file).unwrap_or_default());
    }
    Ok(bytes)
}

/// A client from a kubeconfig file that another component rotates (the
/// klusterlet rewrites the addon's hub kubeconfig when its certificate is
/// renewed): every [`KubeconfigClient::get`] reads the file again and builds
/// a new client when its content changed. A file that is missing or broken
/// is an error for that call only; the next call looks again.
pub struct KubeconfigClient {
    path: PathBuf,
    user_agent: String,
    egress: EgressSettings,
    current: Option<(Vec<u8>, Client)>,
}

impl std::fmt::Debug for KubeconfigClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeconfigClient")
            .field("path", &self.path)
            .field("user_agent", &self.user_agent)
            .field("loaded", &self.current.is_some())
            .finish()
    }
}

impl KubeconfigClient {
    pub fn new(path: impl Into<PathBuf>, user_agent: impl Into<String>) -> Self {
        KubeconfigClient {
            path: path.into(),
            user_agent: user_agent.into(),
            egress: EgressSettings::default(),
            current: None,
        }
    }

    /// Reaches the API server by `egress` (the proxy flags) besides the
    /// environment's proxy variables.
    pub fn with_egress(mut self, egress: EgressSettings) -> Self {
        self.egress = egress;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The client for the current content of the file and the files it names.
    pub async fn get(&mut self) -> Result<Client, ClientError> {
        let kubeconfig = read_kubeconfig(&self.path)?;
        let seen_now = fingerprint(&self.path, &kubeconfig)?;
        if let Some((seen, client)) = &self.current
            && *seen == seen_now
        {
            return Ok(client.clone());
        }
        let client =
            client_from_kubeconfig(&self.path, kubeconfig, &self.user_agent, &self.egress).await?;
        if self.current.is_some() {
            tracing::info!(kubeconfig = %self.path.display(), "kubeconfig or its credentials changed; using the new ones");
        }
        self.current = Some((seen_now, client.clone()));
        Ok(client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_agent_that_is_not_a_header_value_is_refused() {
        let mut config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let err = identify(&mut config, "bad\nagent").unwrap_err();
        assert!(matches!(err, ClientError::UserAgent(_)), "{err}");
        identify(&mut config, "addon-agent/0.1.0").unwrap();
        assert_eq!(
            config.headers.last().map(|(_, v)| v.to_str().unwrap()),
            Some("addon-agent/0.1.0")
        );
    }

    #[tokio::test]
    async fn missing_and_broken_kubeconfigs_are_errors_that_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        let mut reloading = KubeconfigClient::new(&path, "test");
        let Err(err) = reloading.get().await else {
            panic!("a client from no usable kubeconfig")
        };
        assert!(
            matches!(err, ClientError::ReadKubeconfig { .. })
                && err.to_string().contains("kubeconfig"),
            "{err}"
        );
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters: {not a list\n",
        )
        .unwrap();
        let Err(err) = reloading.get().await else {
            panic!("a client from no usable kubeconfig")
        };
        assert!(matches!(err, ClientError::BadKubeconfig { .. }), "{err}");
        // No current context: parses, but names no cluster.
        std::fs::write(&path, "apiVersion: v1\nkind: Config\n").unwrap();
        let Err(err) = reloading.get().await else {
            panic!("a client from no usable kubeconfig")
        };
        assert!(matches!(err, ClientError::BadKubeconfig { .. }), "{err}");
    }

    #[test]
    fn rotating_a_credential_file_named_by_a_relative_path_changes_the_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: hub\n  cluster:\n    server: https://127.0.0.1:1\nusers:\n- name: agent\n  user:\n    client-certificate: tls.crt\n    client-key: tls.key\ncontexts:\n- name: agent\n  context:\n    cluster: hub\n    user: agent\ncurrent-context: agent\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("tls.crt"), "first certificate").unwrap();
        std::fs::write(dir.path().join("tls.key"), "first key").unwrap();
        let kubeconfig = read_kubeconfig(&path).unwrap();
        let first = fingerprint(&path, &kubeconfig).unwrap();
        assert_eq!(fingerprint(&path, &kubeconfig).unwrap(), first);
        std::fs::write(dir.path().join("tls.crt"), "second certificate").unwrap();
        let kubeconfig = read_kubeconfig(&path).unwrap();
        assert_ne!(fingerprint(&path, &kubeconfig).unwrap(), first);
    }
}
