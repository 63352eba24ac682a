//! An in-memory Kubernetes API server — a **test double** for the control
//! plane on machines with no kube-apiserver (this one, CI). The kind suite
//! remains the real thing.
//!
//! It speaks the real REST protocol over HTTPS to unmodified clients
//! (kube-rs `Api`, `watcher`, reflectors, `Controller`, `finalizer()`):
//! discovery (`/version`, `/api`, `/apis`, per group/version resource
//! lists), create / get / list / update / patch / delete /
//! deletecollection, the `status` subresource (and CSR `approval`),
//! `metadata.generation`, one global `resourceVersion` with optimistic
//! concurrency (409), `generateName`, label and field selectors, list
//! pagination (`limit`/`continue`), watches from a resourceVersion with
//! bookmarks, `sendInitialEvents`, selector transitions and "too old"
//! (an `ERROR` event with a 410 Status), finalizers and
//! `deletionTimestamp`. CustomResourceDefinitions are served as soon as they
//! are created (or loaded from YAML), and report `Established`.
//! CertificateSigningRequests get `spec.username`/`uid`/`groups` from the
//! authenticated requester, as on the real server.
//!
//! Where a controller could be fooled it answers as kube-apiserver does:
//! server-side apply with per-manager field sets ([`fields`]), garbage
//! collection and namespace termination ([`lifecycle`]), CRD schemas
//! ([`schema`]), per-type write rules ([`validate`]) and, when asked for,
//! RBAC ([`rbac`]).
//!
//! What it does **not** emulate:
//! * authorization unless [`KubeApiOptions::rbac`] is on (then [`rbac`]
//!   decides); authentication is by bearer token or by a client
//!   certificate of the API's CA (user = CN, groups = O, as the real x509
//!   authenticator), no TokenRequest, and RBAC has no escalation checks;
//! * admission webhooks, CRD schema rules beyond types, `required`,
//!   `enum`, ranges, lengths and item counts, and conversion webhooks;
//! * strategic merge beyond the common merge keys (no `$retainKeys`);
//! * controllers of built-in types (Deployments do not create Pods), but
//!   for kube-controller-manager's `kube-apiserver-client` CSR signer
//!   ([`signer`]);
//! * protobuf, server-side printing of built-in types' own columns
//!   (their Tables show Name and Age), OpenAPI documents, aggregated
//!   discovery, API priority and fairness, and persistence (`exec`,
//!   `attach` and `portforward` are served, over WebSocket and SPDY:
//!   [`exec`], [`portforward`]; `logs` too: [`log`]).

pub mod body;
pub mod error;
pub mod exec;
pub mod exec_spdy;
pub mod fields;
pub mod http;
pub mod lag;
pub mod lifecycle;
pub mod log;
pub mod openapi;
pub mod pods;
pub mod portforward;
pub mod portforward_spdy;
pub mod protobuf;
pub mod query;
pub mod rbac;
pub mod remotecommand;
pub mod resources;
pub mod reviews;
pub mod schema;
pub mod selector;
pub mod shared;
pub mod signer;
pub mod spdy;
pub mod store;
pub mod table;
pub mod validate;
pub mod websocket;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use cert_authority::pki::{Authority, LeafRequest};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use self::resources::Registry;
use self::shared::Shared;
use self::store::{Store, User};

#[derive(Debug, thiserror::Error)]
pub enum KubeApiError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("server certificate: {0}")]
    Pki(String),
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CRD YAML: {0}")]
    Crd(String),
    #[error("kube client: {0}")]
    Client(String),
}

/// Writes kubeconfigs that authenticate as users of one [`KubeApi`].
#[derive(Clone)]
pub struct KubeconfigWriter {
    shared: Arc<Shared>,
    ca_pem: String,
    dir: PathBuf,
    server: SocketAddr,
}

impl KubeconfigWriter {
    /// A kubeconfig that authenticates with a client certificate of the
    /// API's CA (signed by its `kube-apiserver-client` signer).
    pub fn certificate_kubeconfig(&self, cert_pem: &str, key_pem: &str) -> String {
        let encode = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: hub\n  cluster:\n    server: https://{addr}\n    certificate-authority-data: {ca}\nusers:\n- name: addon\n  user:\n    client-certificate-data: {cert}\n    client-key-data: {key}\ncontexts:\n- name: addon\n  context:\n    cluster: hub\n    user: addon\ncurrent-context: addon\n",
            addr = self.server,
            ca = encode(&self.ca_pem),
            cert = encode(cert_pem),
            key = encode(key_pem),
        )
    }

    /// Adds a user with `groups` and writes a kubeconfig that authenticates
    /// as it. Kubeconfigs for another server address than the API's own
    /// are named after that address too.
    pub fn write(&self, user: &str, groups: &[&str]) -> Result<PathBuf, KubeApiError> {
        let token = self.token(user, groups);
        self.write_token(user, &token)
    }

    /// Adds a user with `groups` and returns a bearer token that
    /// authenticates as it.
    pub fn token(&self, user: &str, groups: &[&str]) -> String {
        let token = format!("{:032x}", rand::random::<u128>());
        self.shared
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                token.clone(),
                User {
                    name: user.to_string(),
                    uid: uuid::Uuid::new_v4().to_string(),
                    groups: groups.iter().map(|g| g.to_string()).collect(),
                },
            );
        token
    }

    /// Forgets `token`: it no longer authenticates (as a revoked or
    /// expired one).
    pub fn revoke(&self, token: &str) {
        self.shared
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(token);
    }

    /// Writes a kubeconfig with a token bound to ServiceAccount `name` in
    /// `namespace`, which must exist: the token stops authenticating when
    /// the account is deleted, as on a real API server.
    pub fn write_service_account(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<PathBuf, KubeApiError> {
        let token = self.service_account_token(namespace, name)?;
        self.write_token(&format!("system:serviceaccount:{namespace}:{name}"), &token)
    }

    /// A token bound to ServiceAccount `name` in `namespace`, which must
    /// exist (what the kubelet projects into a pod running as it).
    pub fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<String, KubeApiError> {
        self.shared.bound_token(namespace, name).ok_or_else(|| {
            KubeApiError::Client(format!(
                "no ServiceAccount {namespace}/{name} to issue a token for"
            ))
        })
    }

    fn write_token(&self, user: &str, token: &str) -> Result<PathBuf, KubeApiError> {
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: cluster-proxy-e2e\n  cluster:\n    server: https://{addr}\n    certificate-authority-data: {ca}\nusers:\n- name: {user:?}\n  user:\n    token: {token}\ncontexts:\n- name: {user:?}\n  context:\n    cluster: cluster-proxy-e2e\n    user: {user:?}\ncurrent-context: {user:?}\n",
            addr = self.server,
        );
        let file = if user == ADMIN_USER {
            "kubeconfig".to_string()
        } else {
            format!(
                "kubeconfig-{}",
                user.replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "_")
            )
        };
        let path = self.dir.join(file);
        cert_authority::files::write_atomically(&path, &text, true).map_err(|e| {
            KubeApiError::Write {
                path: path.clone(),
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        Ok(path)
    }
}

/// How to start the API.
#[derive(Debug, Clone)]
pub struct KubeApiOptions {
    pub bind: SocketAddr,
    /// Where the kubeconfig files are written.
    pub dir: PathBuf,
    /// How many past changes a watch can resume from.
    pub history: usize,
    pub bookmark_interval: Duration,
    /// Authorize every request by RBAC (off: any authenticated user may do
    /// anything).
    pub rbac: bool,
    /// More names and addresses for the serving certificate (forwarders
    /// that clients dial instead of `bind`).
    pub extra_sans: Vec<String>,
    /// Keep every authorization decision ([`KubeApi::requests`]): tests
    /// compare what services asked for with what their RBAC grants.
    pub record_requests: bool,
    /// More sockets the API serves on besides `bind`, bound already (in
    /// another network namespace, say): their addresses join the serving
    /// certificate.
    pub listeners: Vec<Arc<std::net::TcpListener>>,
}

impl KubeApiOptions {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KubeApiOptions {
            bind: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            dir: dir.into(),
            history: 1000,
            bookmark_interval: Duration::from_secs(5),
            rbac: false,
            extra_sans: Vec::new(),
            record_requests: false,
            listeners: Vec::new(),
        }
    }
}

/// The user the default kubeconfig authenticates as.
pub const ADMIN_USER: &str = "kubernetes-admin";
const NAMESPACES: &[&str] = &["default", "kube-system", "kube-public", "kube-node-lease"];

/// A running API server.
pub struct KubeApi {
    addr: SocketAddr,
    ca_pem: String,
    dir: PathBuf,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
    kubeconfig: PathBuf,
}

impl KubeApi {
    pub async fn start(options: KubeApiOptions) -> Result<Self, KubeApiError> {
        let listener =
            TcpListener::bind(options.bind)
                .await
                .map_err(|source| KubeApiError::Bind {
                    addr: options.bind,
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| KubeApiError::Bind {
            addr: options.bind,
            source,
        })?;
        let ca = Authority::generate(
            "cluster-proxy-e2e kube-apiserver CA",
            Duration::from_secs(86400 * 30),
        )
        .map_err(|e| KubeApiError::Pki(e.to_string()))?;
        let mut extra = Vec::new();
        for listener in &options.listeners {
            let bound = || -> std::io::Result<TcpListener> {
                let listener = listener.try_clone()?;
                listener.set_nonblocking(true)?;
                TcpListener::from_std(listener)
            };
            let listener = bound().map_err(|source| KubeApiError::Bind {
                addr: options.bind,
                source,
            })?;
            let local = listener.local_addr().map_err(|source| KubeApiError::Bind {
                addr: options.bind,
                source,
            })?;
            extra.push((listener, local.ip().to_string()));
        }
        let ip = addr.ip().to_string();
        let mut sans = vec![
            "localhost",
            "127.0.0.1",
            ip.as_str(),
            "kubernetes.default.svc",
        ];
        sans.extend(extra.iter().map(|(_, ip)| ip.as_str()));
        sans.extend(options.extra_sans.iter().map(String::as_str));
        let leaf = ca
            .issue(&LeafRequest::server("kube-apiserver", &sans))
            .map_err(|e| KubeApiError::Pki(e.to_string()))?;
        let acceptor = api_tls(&leaf.cert_pem, &leaf.key_pem, ca.cert_pem())
            .map_err(|e| KubeApiError::Pki(format!("the API's TLS configuration: {e}")))?;

        let store = Arc::new(Store::new(Registry::with_builtins(), options.history));
        let system = User {
            name: "system:apiserver".into(),
            uid: uuid::Uuid::new_v4().to_string(),
            groups: vec!["system:masters".into()],
        };
        let namespaces = store
            .registry()
            .get("", "v1", "namespaces")
            .cloned()
            .ok_or_else(|| KubeApiError::Pki("namespaces type missing".into()))?;
        for ns in NAMESPACES {
            let body = serde_json::json!({"metadata": {"name": ns}});
            let _ = store.create(&namespaces, None, body, &system, &Default::default());
        }
        rbac::bootstrap(&store, &system);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            store,
            tokens: Mutex::new(HashMap::new()),
            bound_tokens: Mutex::new(HashMap::new()),
            snapshots: Mutex::new(Default::default()),
            bookmark_interval: options.bookmark_interval,
            rbac: options.rbac,
            requests: options.record_requests.then(Default::default),
            shutdown: shutdown_rx.clone(),
            pods: Default::default(),
            token_reviews: Default::default(),
            subject_access_reviews: Default::default(),
        });
        tokio::spawn(lifecycle::run(shared.store.clone(), shutdown_rx.clone()));
        let ca_pem = ca.cert_pem().to_string();
        tokio::spawn(signer::run(
            shared.store.clone(),
            Arc::new(ca),
            shutdown_rx.clone(),
        ));
        for (listener, _) in extra {
            tokio::spawn(serve(
                listener,
                acceptor.clone(),
                shared.clone(),
                shutdown_rx.clone(),
            ));
        }
        let task = tokio::spawn(serve(listener, acceptor, shared.clone(), shutdown_rx));
        std::fs::create_dir_all(&options.dir).map_err(|source| KubeApiError::Write {
            path: options.dir.clone(),
            source,
        })?;
        let mut api = KubeApi {
            addr,
            ca_pem,
            dir: options.dir.clone(),
            shared,
            shutdown,
            task: Some(task),
            kubeconfig: PathBuf::new(),
        };
        api.kubeconfig = api.kubeconfig_for(ADMIN_USER, &["system:masters"])?;
        Ok(api)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The authorization decisions so far, oldest first (empty unless
    /// [`KubeApiOptions::record_requests`]).
    pub fn requests(&self) -> Vec<rbac::RequestRecord> {
        self.shared
            .requests
            .as_ref()
            .map(|r| r.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_default()
    }

    /// The CA certificate (PEM) the API's serving certificate chains to.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// How many TokenReviews the API has answered.
    pub fn token_reviews(&self) -> u64 {
        self.shared
            .token_reviews
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many SubjectAccessReviews the API has answered.
    pub fn subject_access_reviews(&self) -> u64 {
        self.shared
            .subject_access_reviews
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The kubelet's view of pods: what the kubelet stand-in writes (Pod
    /// objects, their readiness, where their ports are) so that
    /// `pods/portforward` reaches them.
    pub fn kubelet(&self) -> pods::KubeletPods {
        pods::KubeletPods {
            store: self.shared.store.clone(),
            network: self.shared.pods.clone(),
        }
    }

    /// The administrator's kubeconfig (`kubeconfig` in the directory).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// Adds a user with `groups` and writes a kubeconfig that authenticates
    /// as it (`kubeconfig-<user>` in the directory; the admin's is
    /// `kubeconfig`).
    pub fn kubeconfig_for(&self, user: &str, groups: &[&str]) -> Result<PathBuf, KubeApiError> {
        self.kubeconfigs(None).write(user, groups)
    }

    /// A writer of kubeconfigs for this server that outlives a borrow of
    /// it; `server` is the address clients dial when it is not
    /// [`KubeApi::addr`] (a forwarder; it must be among
    /// [`KubeApiOptions::extra_sans`]).
    pub fn kubeconfigs(&self, server: Option<SocketAddr>) -> KubeconfigWriter {
        KubeconfigWriter {
            shared: self.shared.clone(),
            ca_pem: self.ca_pem.clone(),
            dir: self.dir.clone(),
            server: server.unwrap_or(self.addr),
        }
    }

    /// A kube client from a kubeconfig this server wrote.
    pub async fn client_from(kubeconfig: &Path) -> Result<kube::Client, KubeApiError> {
        let config = kube::config::Kubeconfig::read_from(kubeconfig)
            .map_err(|e| KubeApiError::Client(e.to_string()))?;
        let config = kube::Config::from_custom_kubeconfig(config, &Default::default())
            .await
            .map_err(|e| KubeApiError::Client(e.to_string()))?;
        kube::Client::try_from(config).map_err(|e| KubeApiError::Client(e.to_string()))
    }

    /// A client authenticated as the administrator.
    pub async fn client(&self) -> Result<kube::Client, KubeApiError> {
        Self::client_from(&self.kubeconfig).await
    }

    /// The administrator's client, with the events of `plural`'s watches
    /// held back by `delay` ([`lag::LaggingWatches`]): a controller run on it
    /// has a cache that trails the API.
    pub async fn client_with_lagging_watches(
        &self,
        plural: &str,
        delay: Duration,
    ) -> Result<kube::Client, KubeApiError> {
        Self::lagging_client_from(&self.kubeconfig, plural, delay).await
    }

    /// [`KubeApi::client_with_lagging_watches`] for the user of
    /// `kubeconfig` (see [`KubeApi::kubeconfig_for`]), so its requests can
    /// be told from the test's own.
    pub async fn lagging_client_from(
        kubeconfig: &Path,
        plural: &str,
        delay: Duration,
    ) -> Result<kube::Client, KubeApiError> {
        let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig)
            .map_err(|e| KubeApiError::Client(e.to_string()))?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .map_err(|e| KubeApiError::Client(e.to_string()))?;
        Ok(kube::client::ClientBuilder::try_from(config)
            .map_err(|e| KubeApiError::Client(e.to_string()))?
            .with_layer(&lag::LaggingWatches::new(plural, delay))
            .build())
    }

    /// Serves the CustomResourceDefinitions in `yaml` (multi-document),
    /// creating them as a client would.
    pub fn register_crds_from_yaml(&self, yaml: &str) -> Result<usize, KubeApiError> {
        let documents: Vec<Value> =
            serde_saphyr::from_multiple(yaml).map_err(|e| KubeApiError::Crd(e.to_string()))?;
        let crd_type = self
            .shared
            .store
            .registry()
            .get("apiextensions.k8s.io", "v1", "customresourcedefinitions")
            .cloned()
            .ok_or_else(|| KubeApiError::Crd("no CRD type".into()))?;
        let admin = User {
            name: ADMIN_USER.into(),
            uid: String::new(),
            groups: vec!["system:masters".into()],
        };
        let mut count = 0;
        for document in documents.into_iter().filter(|d| !d.is_null()) {
            if document.get("kind").and_then(Value::as_str) != Some("CustomResourceDefinition") {
                return Err(KubeApiError::Crd(
                    "a document is not a CustomResourceDefinition".into(),
                ));
            }
            self.shared
                .store
                .create(&crd_type, None, document, &admin, &Default::default())
                .map_err(|e| KubeApiError::Crd(e.message))?;
            count += 1;
        }
        Ok(count)
    }

    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

async fn serve(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.changed() => return,
        };
        let Ok((socket, _)) = accepted else {
            continue;
        };
        // As Go's listeners (kube-apiserver's) leave every accepted socket.
        let _ = socket.set_nodelay(true);
        let acceptor = acceptor.clone();
        let shared = shared.clone();
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            let Ok(stream) = acceptor.accept(socket).await else {
                return;
            };
            let certificate_user = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|der| certificate_user(der.as_ref()));
            let service = hyper::service::service_fn(move |mut request: hyper::Request<_>| {
                if let Some(user) = &certificate_user {
                    request
                        .extensions_mut()
                        .insert(shared::CertificateUser(user.clone()));
                }
                http::handle(shared.clone(), request)
            });
            let builder = auto::Builder::new(TokioExecutor::new());
            // With upgrades: `pods/portforward` and `pods/exec` switch to WebSocket.
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = shutdown.changed() => connection.as_mut().graceful_shutdown(),
            }
        });
    }
}

/// The API's TLS: its serving certificate, and client certificates of its
/// CA accepted but not required (bearer tokens authenticate the rest).
fn api_tls(
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("serving certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("serving key: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(client_ca_pem.as_bytes()) {
        roots
            .add(certificate.map_err(|e| format!("client CA: {e}"))?)
            .map_err(|e| format!("client CA: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()
    .map_err(|e| e.to_string())?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| e.to_string())?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// The user a verified client certificate authenticates, as kube-apiserver's
/// x509 authenticator reads it: the common name, and the organizations as
/// groups. A certificate with no common name authenticates nobody.
fn certificate_user(der: &[u8]) -> Option<User> {
    let (_, certificate) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = certificate.subject();
    let name = subject
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok().map(str::to_string))
        .collect();
    Some(User {
        name,
        uid: String::new(),
        groups,
    })
}
