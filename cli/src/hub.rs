//! The hub: a `kube::Client` from a kubeconfig, and the proxy-servers'
//! client credentials (files, or the hub Secret `proxy-client`, as
//! `clusteradm proxy health` reads them).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::connector::TunnelConnector;
use cluster_proxy_proto::h2_channel::H2Channel;
use cluster_proxy_proto::transport::{ALPN_H2, TransportError};
use cluster_proxy_runtime::tls::{self, Identity, Pem, TlsError};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::address::{AddressError, parse_host_port};

/// The ManagedProxyConfiguration the addon-manager and clusteradm use.
pub const DEFAULT_MPC: &str = "cluster-proxy";
/// The proxy-servers' client port.
pub const CLIENT_PORT: u16 = 8090;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig: {0}")]
    Infer(#[source] kube::config::KubeconfigError),
    #[error("hub client: {0}")]
    Client(#[source] kube::Error),
    #[error("cannot reach the hub at {url}: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: kube::Error,
    },
}

/// A client of the hub named by `kubeconfig` (default: `$KUBECONFIG`, then
/// `~/.kube/config`) and `context` (default: the current context), and the
/// hub's URL for error messages.
pub async fn client(
    kubeconfig: Option<&Path>,
    context: Option<&str>,
) -> Result<(kube::Client, String), HubError> {
    let options = KubeConfigOptions {
        context: context.map(str::to_owned),
        ..KubeConfigOptions::default()
    };
    let mut config = match kubeconfig {
        Some(path) => {
            let loaded = Kubeconfig::read_from(path).map_err(|source| HubError::Kubeconfig {
                path: path.to_owned(),
                source,
            })?;
            kube::Config::from_custom_kubeconfig(loaded, &options)
                .await
                .map_err(|source| HubError::Kubeconfig {
                    path: path.to_owned(),
                    source,
                })?
        }
        None => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(HubError::Infer)?,
    };
    // A workstation command should fail in seconds, not hang on a dead hub.
    config.connect_timeout = Some(Duration::from_secs(10));
    config.read_timeout = Some(Duration::from_secs(30));
    let url = config.cluster_url.to_string();
    let client = kube::Client::try_from(config).map_err(HubError::Client)?;
    Ok((client, url))
}

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error(
        "--proxy-ca-cert, --proxy-cert and --proxy-key go together (missing: {0}); \
         give all three, or none to read the hub Secret"
    )]
    Partial(String),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(
        "ManagedProxyConfiguration {name:?} not found on the hub; pass --mpc, or the client \
         credentials with --proxy-ca-cert, --proxy-cert and --proxy-key"
    )]
    NoConfiguration { name: String },
    #[error("cannot read ManagedProxyConfiguration {name:?} from the hub: {source}")]
    ReadConfiguration {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "cannot read Secret {namespace}/{name} ({source}); pass the client credentials \
         with --proxy-ca-cert, --proxy-cert and --proxy-key"
    )]
    Secret {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("Secret {namespace}/{name} has no {key:?}")]
    SecretKey {
        namespace: String,
        name: String,
        key: &'static str,
    },
}

/// Paths of the proxy-client credentials given on the command line.
#[derive(Debug, Clone, Default)]
pub struct CredentialFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl CredentialFiles {
    /// The three paths, `None` when none was given, an error when only some were.
    pub fn complete(&self) -> Result<Option<(&Path, &Path, &Path)>, CredentialsError> {
        match (&self.ca, &self.cert, &self.key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => Ok(Some((ca, cert, key))),
            _ => {
                let missing: Vec<&str> = [
                    ("--proxy-ca-cert", self.ca.is_none()),
                    ("--proxy-cert", self.cert.is_none()),
                    ("--proxy-key", self.key.is_none()),
                ]
                .into_iter()
                .filter(|(_, absent)| *absent)
                .map(|(flag, _)| flag)
                .collect();
                Err(CredentialsError::Partial(missing.join(", ")))
            }
        }
    }
}

/// mTLS for the proxy-servers' client port from files. Expired or
/// not-yet-valid certificates are refused here, with their dates.
pub fn tls_from_files(
    ca: &Path,
    cert: &Path,
    key: &Path,
) -> Result<Arc<rustls::ClientConfig>, CredentialsError> {
    let roots = tls::roots(&Pem::file("proxy-server CA", ca)?)?;
    let identity = Identity::from_files(cert, key)?;
    Ok(tls::client_config(roots, Some(identity), &[ALPN_H2])?)
}

/// mTLS for the proxy-servers' client port from the Secret the
/// ManagedProxyConfiguration `mpc` names (`tls.crt`, `tls.key`, `ca.crt`).
pub async fn tls_from_hub(
    client: &kube::Client,
    mpc: &str,
) -> Result<Arc<rustls::ClientConfig>, CredentialsError> {
    let configuration = Api::<ManagedProxyConfiguration>::all(client.clone())
        .get(mpc)
        .await
        .map_err(|source| match &source {
            kube::Error::Api(status) if status.code == 404 => CredentialsError::NoConfiguration {
                name: mpc.to_owned(),
            },
            _ => CredentialsError::ReadConfiguration {
                name: mpc.to_owned(),
                source,
            },
        })?;
    let namespace = configuration.spec.proxy_server.namespace.clone();
    let name = configuration
        .spec
        .authentication
        .dump
        .secrets
        .signing_proxy_client_secret_name
        .clone();
    let secret = Api::<Secret>::namespaced(client.clone(), &namespace)
        .get(&name)
        .await
        .map_err(|source| CredentialsError::Secret {
            namespace: namespace.clone(),
            name: name.clone(),
            source,
        })?;
    let pem = |key: &'static str| -> Result<Pem, CredentialsError> {
        let bytes = secret
            .data
            .as_ref()
            .and_then(|data| data.get(key))
            .ok_or_else(|| CredentialsError::SecretKey {
                namespace: namespace.clone(),
                name: name.clone(),
                key,
            })?;
        let origin = format!("Secret {namespace}/{name} {key}");
        Ok(Pem::text(&origin, &String::from_utf8_lossy(&bytes.0)))
    };
    let roots = tls::roots(&pem("ca.crt")?)?;
    let identity = Identity::new(&pem("tls.crt")?, &pem("tls.key")?)?;
    Ok(tls::client_config(roots, Some(identity), &[ALPN_H2])?)
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyServerError {
    #[error(
        "no proxy-server address given. The proxy-servers' client port ({CLIENT_PORT}) is \
         inside the hub: forward it first, for example\n  \
         kubectl -n {namespace} port-forward service/{service} {CLIENT_PORT}:{CLIENT_PORT}\n\
         then pass --proxy-server localhost:{CLIENT_PORT} (repeat the flag to name each \
         replica, e.g. per-pod port-forwards)"
    )]
    NoAddress { namespace: String, service: String },
    #[error(transparent)]
    Address(#[from] AddressError),
    #[error("cannot connect to proxy-server {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: TransportError,
    },
}

/// Where the proxy-servers of the hub live, for the hint in
/// [`ProxyServerError::NoAddress`]; the upstream defaults when unknown.
pub async fn entrypoint_hint(client: Option<&kube::Client>, mpc: &str) -> (String, String) {
    let defaults = (
        "open-cluster-management-addon".to_owned(),
        "proxy-entrypoint".to_owned(),
    );
    let Some(client) = client else {
        return defaults;
    };
    match Api::<ManagedProxyConfiguration>::all(client.clone())
        .get(mpc)
        .await
    {
        Ok(configuration) => (
            configuration.spec.proxy_server.namespace,
            configuration.spec.proxy_server.in_cluster_service_name,
        ),
        Err(_) => defaults,
    }
}

/// A tunnel connector over a new connection to the proxy-server at `address`.
pub async fn connect(
    address: &str,
    tls: Arc<rustls::ClientConfig>,
    timeout: Duration,
) -> Result<TunnelConnector, ProxyServerError> {
    let (host, port) = parse_host_port(address)?;
    let channel = H2Channel::connect(&host, port, tls, timeout)
        .await
        .map_err(|source| ProxyServerError::Connect {
            address: address.to_owned(),
            source,
        })?;
    Ok(TunnelConnector::new(
        TunnelClient::over_h2(channel).with_dial_timeout(timeout),
        timeout,
    ))
}
