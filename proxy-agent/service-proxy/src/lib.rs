//! service-proxy: runs beside the proxy-agent in a managed cluster and
//! serves the hub user-server's requests, which reach it through the tunnel.
//!
//! The user-server has already authenticated the user and checked the hub's
//! RBAC; it names the user in headers ([`cluster_proxy_proto::service_access`]).
//! Those headers are believed only on a TLS connection whose client
//! certificate is the user-server's (its CA and common name are configured):
//! any other hub client of the proxy-server, which can reach this port too,
//! gets 403. A request is then sent to this cluster's kube-apiserver with
//! this pod's own ServiceAccount token, impersonating `cluster:hub:<user>`
//! and the user's groups prefixed the same way, so this cluster's RBAC
//! decides what the hub user may do. Every `Impersonate-*` and `X-Remote-*`
//! header the client sent is removed first. Upgraded streams (exec, attach,
//! port-forward over SPDY or WebSocket) are relayed after the 101.
//!
//! A request whose token the hub did not know (the user-server's
//! `--managed-token-passthrough`) goes to the kube-apiserver with that token
//! and nothing of this pod's: the kube-apiserver authenticates it.
//!
//! A request for another Service of the cluster (the user-server admitted it
//! by its exposed-services allowlist) goes to `<scheme>://<name>.<namespace>.svc:<port>`
//! with no credential of this pod's and no identity header: the Service
//! answers the request as it answers any unauthenticated client in the
//! cluster. https Services are verified against the kube-apiserver's CA and
//! `--additional-service-ca`.
#![forbid(unsafe_code)]

pub mod process;
pub mod settings;

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::service_access;
use cluster_proxy_proto::transport::ALPN_HTTP11;
use cluster_proxy_runtime::http_proxy::{
    HttpsOptions, ProxyBody, Schemes, pooled_client, relay_upgrade, serve_https, status_response,
    strip_hop_by_hop, take_upgrade,
};
use cluster_proxy_runtime::reload::{self, Watched};
use cluster_proxy_runtime::tls::{self, Identity, Pem, TlsError};
use cluster_proxy_runtime::{admin, net, peer};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::{GaiResolver, Name};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use settings::{Cli, ServiceProxyConfig, ServiceProxySettings};

/// How long a client has for its TLS handshake, and then for each
/// request's headers: a slow or idle peer cannot hold a task.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_HEADER_BYTES: usize = 256 * 1024;
/// How long open requests may finish after SIGTERM.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle connections kept to the kube-apiserver, and for how long.
const MAX_IDLE_PER_HOST: usize = 100;
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Bind(#[from] net::BindError),
    #[error("the ServiceAccount token {path}: {source}")]
    Token {
        path: String,
        source: std::io::Error,
    },
}

type Upstream = Client<hyper_rustls::HttpsConnector<HttpConnector<AliasResolver>>, Incoming>;

/// DNS, after the configured host aliases (a pod's hostAliases, for names
/// the cluster's DNS does not know).
#[derive(Clone)]
struct AliasResolver {
    aliases: Arc<HashMap<String, IpAddr>>,
    dns: GaiResolver,
}

type Resolving =
    Pin<Box<dyn Future<Output = Result<std::vec::IntoIter<SocketAddr>, std::io::Error>> + Send>>;

impl tower::Service<Name> for AliasResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = Resolving;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        // The connector puts the URI's port on every address.
        if let Some(ip) = self.aliases.get(name.as_str()) {
            let addresses = vec![SocketAddr::new(*ip, 0)];
            return Box::pin(std::future::ready(Ok(addresses.into_iter())));
        }
        let mut dns = self.dns.clone();
        Box::pin(async move {
            let addresses = tower::Service::call(&mut dns, name).await?;
            Ok(addresses.collect::<Vec<_>>().into_iter())
        })
    }
}

fn connector(aliases: &Arc<HashMap<String, IpAddr>>) -> HttpConnector<AliasResolver> {
    let mut http = HttpConnector::new_with_resolver(AliasResolver {
        aliases: aliases.clone(),
        dns: GaiResolver::new(),
    });
    http.enforce_http(false);
    http.set_connect_timeout(Some(HANDSHAKE_TIMEOUT));
    http
}

/// What every request needs.
struct Shared {
    cluster: ClusterName,
    user_server_name: String,
    kube_api: http::Uri,
    upstream: Upstream,
    token: Watched<String>,
    impersonation: bool,
    aliases: Arc<HashMap<String, IpAddr>>,
    /// The pooled client for Services (plain or TLS), rebuilt when the
    /// trusted CAs changed on disk.
    services: reload::Derived<rustls::ClientConfig, Upstream>,
}

impl Shared {
    fn services(&self) -> Upstream {
        self.services.get(|tls| {
            pooled_client(
                tls,
                connector(&self.aliases),
                Schemes::HttpAndHttps,
                MAX_IDLE_PER_HOST,
                IDLE_TIMEOUT,
            )
        })
    }
}

/// A running service-proxy.
pub struct RunningServiceProxy {
    pub addr: SocketAddr,
    pub health_addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RunningServiceProxy {
    /// Stops accepting, and closes the connections once their requests end
    /// (upgraded streams end with the process).
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Loads the credentials (startup fails clearly on bad ones), binds the
/// ports and serves until [`RunningServiceProxy::shutdown`].
pub async fn start(config: ServiceProxyConfig) -> Result<RunningServiceProxy, StartError> {
    let tls = serving_tls(&config)?;
    let kube_roots = tls::roots(&Pem::file("kube-apiserver CA", &config.kube_ca)?)?;
    let kube_tls = tls::client_config(kube_roots, None, &[ALPN_HTTP11])?;
    let token = watch_token(&config)?;
    let aliases = Arc::new(config.host_aliases.clone());
    let upstream = pooled_client(
        &kube_tls,
        connector(&aliases),
        Schemes::HttpsOnly,
        MAX_IDLE_PER_HOST,
        IDLE_TIMEOUT,
    );
    let shared = Arc::new(Shared {
        cluster: config.cluster.clone(),
        user_server_name: config.user_server_name.clone(),
        kube_api: config.kube_api.clone(),
        upstream,
        token,
        impersonation: config.impersonation,
        aliases,
        services: reload::Derived::new(service_tls(&config)?),
    });

    let stop = CancellationToken::new();
    let (health, health_addr) = net::bind(
        "health port",
        &config.health.ip().to_string(),
        config.health.port(),
    )
    .await?;
    tokio::spawn(admin::serve(
        health,
        admin::Routes::probes(|| Ok(())),
        stop.clone(),
    ));
    let (listener, addr) = net::bind(
        "service-proxy port",
        &config.listen.ip().to_string(),
        config.listen.port(),
    )
    .await?;
    tracing::info!(%addr, cluster = %config.cluster, kube_api = %config.kube_api, "serving the user-server's requests");
    let task = tokio::spawn(accept(listener, tls, shared, stop.clone()));
    Ok(RunningServiceProxy {
        addr,
        health_addr,
        stop,
        task,
    })
}

/// The serving configuration: this proxy's certificate, and client
/// certificates required from the user-server's CA; rebuilt when the files
/// change.
fn serving_tls(config: &ServiceProxyConfig) -> Result<Watched<rustls::ServerConfig>, TlsError> {
    let (cert, key, ca) = (
        config.cert.clone(),
        config.key.clone(),
        config.user_server_ca.clone(),
    );
    reload::watch_files(
        "service-proxy serving credentials",
        vec![cert.clone(), key.clone(), ca.clone()],
        config.reload_interval,
        move || {
            let identity = Identity::from_files(&cert, &key)?;
            let clients = tls::roots(&Pem::file("user-server CA", &ca)?)?;
            tls::server_config(identity, Some(clients), &[ALPN_HTTP11])
        },
    )
}

/// Trust for https Services: the kube-apiserver's CA (the cluster's own
/// serving certificates often come from it) and the additional CAs; re-read
/// when they change.
fn service_tls(config: &ServiceProxyConfig) -> Result<Watched<rustls::ClientConfig>, TlsError> {
    let mut paths: Vec<PathBuf> = vec![config.kube_ca.clone()];
    paths.extend(config.additional_service_ca.clone());
    let files = paths.clone();
    reload::watch_files("Service CAs", paths, config.reload_interval, move || {
        let mut bundle = String::new();
        for path in &files {
            let pem = std::fs::read_to_string(path).map_err(|e| {
                TlsError::Config(format!("Service CA bundle {}: {e}", path.display()))
            })?;
            bundle.push_str(&pem);
            bundle.push('\n');
        }
        let roots = tls::roots(&Pem::text("Service CAs", &bundle))?;
        tls::client_config(roots, None, &[ALPN_HTTP11])
    })
}

fn watch_token(config: &ServiceProxyConfig) -> Result<Watched<String>, StartError> {
    let path = config.token_file.clone();
    let read = {
        let path = path.clone();
        move || -> Result<Arc<String>, TlsError> {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                TlsError::Config(format!("the ServiceAccount token {}: {e}", path.display()))
            })?;
            Ok(Arc::new(text.trim().to_owned()))
        }
    };
    if let Err(source) = std::fs::metadata(&path) {
        return Err(StartError::Token {
            path: path.display().to_string(),
            source,
        });
    }
    Ok(reload::watch_files(
        "ServiceAccount token",
        vec![path],
        config.reload_interval,
        read,
    )?)
}

/// Serves until `stop`; each connection's requests are refused unless its
/// client certificate is the user-server's.
async fn accept(
    listener: TcpListener,
    tls: Watched<rustls::ServerConfig>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let options = HttpsOptions {
        http1_only: true,
        handshake_timeout: HANDSHAKE_TIMEOUT,
        header_read_timeout: HEADER_READ_TIMEOUT,
        max_header_bytes: MAX_HEADER_BYTES,
        drain_timeout: DRAIN_TIMEOUT,
    };
    serve_https(listener, tls, stop, options, move |connection, peer| {
        let trusted = client_is_user_server(connection, &shared.user_server_name);
        if let Err(reason) = &trusted {
            tracing::warn!(%peer, reason, "a client that is not the user-server; its requests are refused");
        }
        let shared = shared.clone();
        move |request| {
            let (shared, trusted) = (shared.clone(), trusted.clone());
            async move {
                match trusted {
                    Ok(()) => handle(&shared, request).await,
                    Err(reason) => status_response(
                        StatusCode::FORBIDDEN,
                        "Forbidden",
                        &format!("service-proxy serves only the hub's user-server: {reason}"),
                    ),
                }
            }
        }
    })
    .await;
}

/// Whether the TLS client certificate (already verified against the
/// user-server CA) names the user-server.
fn client_is_user_server(
    connection: &rustls::ServerConnection,
    expected: &str,
) -> Result<(), String> {
    let leaf = connection
        .peer_certificates()
        .and_then(|chain| chain.first())
        .ok_or_else(|| "no client certificate".to_owned())?;
    match peer::common_name_of(leaf) {
        Ok(Some(name)) if name == expected => Ok(()),
        Ok(Some(name)) => Err(format!(
            "the client certificate names {name:?}, not {expected:?}"
        )),
        Ok(None) => Err("the client certificate has no common name".to_owned()),
        Err(error) => Err(error.to_string()),
    }
}

/// Where a request goes, from the user-server's headers.
enum Routed {
    /// The kube-apiserver, as the named hub user.
    KubeApi { user: String, groups: Vec<String> },
    /// The kube-apiserver with the client's own token, which the hub does
    /// not know: the kube-apiserver authenticates it.
    Passthrough,
    /// A Service of this cluster: `scheme://name.namespace.svc:port`.
    Service { origin: String },
}

/// Why a request is refused, before anything is forwarded.
struct Refusal {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

impl Refusal {
    fn new(code: StatusCode, reason: &'static str, message: &str) -> Self {
        Refusal {
            code,
            reason,
            message: message.to_owned(),
        }
    }

    fn response(&self) -> Response<ProxyBody> {
        status_response(self.code, self.reason, &self.message)
    }
}

/// Checks the user-server's headers: this cluster, a user, the kube API.
fn route(shared: &Shared, request: &Request<Incoming>) -> Result<Routed, Refusal> {
    let headers = request.headers();
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    match text(service_access::CLUSTER) {
        Some(cluster) if cluster == shared.cluster.as_str() => {}
        Some(cluster) => {
            return Err(Refusal::new(
                StatusCode::MISDIRECTED_REQUEST,
                "MisdirectedRequest",
                &format!(
                    "this is cluster {:?}'s service-proxy; the request is for {cluster:?}",
                    shared.cluster.as_str()
                ),
            ));
        }
        None => {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("no {} header", service_access::CLUSTER),
            ));
        }
    }
    match (
        text(service_access::NAMESPACE),
        text(service_access::SERVICE),
    ) {
        (None, None) | (Some("default"), Some("kubernetes")) => {}
        _ => return service_target(request.headers()).map(|origin| Routed::Service { origin }),
    }
    if let Some(credential) = text(service_access::CREDENTIAL) {
        if credential != service_access::PASSTHROUGH {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("unknown {} {credential:?}", service_access::CREDENTIAL),
            ));
        }
        if !headers.contains_key(header::AUTHORIZATION) {
            return Err(Refusal::new(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "a passed-through request carries no token",
            ));
        }
        return Ok(Routed::Passthrough);
    }
    let Some(user) = text(service_access::USER).filter(|u| !u.is_empty()) else {
        return Err(Refusal::new(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "the user-server named no hub user",
        ));
    };
    if !shared.impersonation {
        return Err(Refusal::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            "this cluster does not serve hub users (--enable-impersonation=false)",
        ));
    }
    let groups = headers
        .get_all(service_access::GROUP)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_owned)
        .collect();
    Ok(Routed::KubeApi {
        user: user.to_owned(),
        groups,
    })
}

/// The origin of the Service upstream's four target headers name; each
/// must be there and well formed (400 otherwise).
fn service_target(headers: &http::HeaderMap) -> Result<String, Refusal> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let bad = |message: String| Refusal {
        code: StatusCode::BAD_REQUEST,
        reason: "BadRequest",
        message,
    };
    let (Some(scheme), Some(namespace), Some(name), Some(port)) = (
        text(service_access::PROTO),
        text(service_access::NAMESPACE),
        text(service_access::SERVICE),
        text(service_access::PORT),
    ) else {
        return Err(bad(format!(
            "a Service request needs all of {}, {}, {} and {}",
            service_access::PROTO,
            service_access::NAMESPACE,
            service_access::SERVICE,
            service_access::PORT
        )));
    };
    if !matches!(scheme, "http" | "https") {
        return Err(bad(format!("scheme {scheme:?} is neither http nor https")));
    }
    for (what, value) in [("namespace", namespace), ("Service", name)] {
        if !cluster_proxy_proto::identity::is_dns1123_label(value) {
            return Err(bad(format!("{what} {value:?} is not a DNS-1123 label")));
        }
    }
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad(format!("port {port:?} is not a number from 1 to 65535")))?;
    Ok(format!("{scheme}://{name}.{namespace}.svc:{port}"))
}

async fn handle(shared: &Shared, mut request: Request<Incoming>) -> Response<ProxyBody> {
    let routed = match route(shared, &request) {
        Ok(routed) => routed,
        Err(refusal) => return refusal.response(),
    };
    let client_upgrade = take_upgrade(&mut request);
    let (mut parts, body) = request.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_owned();
    let (origin, what) = match &routed {
        Routed::KubeApi { .. } | Routed::Passthrough => (
            format!(
                "https://{}",
                shared
                    .kube_api
                    .authority()
                    .map(|a| a.as_str())
                    .unwrap_or_default()
            ),
            format!("cluster {:?}'s kube-apiserver", shared.cluster.as_str()),
        ),
        Routed::Service { origin } => (origin.clone(), format!("Service {origin}")),
    };
    let uri = match format!("{origin}{path}").parse::<http::Uri>() {
        Ok(uri) => uri,
        Err(error) => {
            return status_response(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("request path {path:?}: {error}"),
            );
        }
    };
    strip_hop_by_hop(&mut parts.headers);
    let names: Vec<_> = parts
        .headers
        .keys()
        .filter(|name| service_access::is_identity_header(name.as_str()))
        .cloned()
        .collect();
    for name in names {
        parts.headers.remove(name);
    }
    parts.headers.remove(header::HOST);
    let upstream = match &routed {
        Routed::KubeApi { user, groups } => {
            let credentials = match identity_headers(shared, user, groups) {
                Ok(credentials) => credentials,
                Err(error) => {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", &error);
                }
            };
            for (name, value) in credentials {
                parts.headers.append(name, value);
            }
            shared.upstream.clone()
        }
        // The client's token, as it came; nothing of this pod's.
        Routed::Passthrough => shared.upstream.clone(),
        // No credential of this pod's reaches a Service.
        Routed::Service { .. } => {
            parts.headers.remove(header::AUTHORIZATION);
            shared.services()
        }
    };
    parts.uri = uri;
    let outgoing = Request::from_parts(parts, body);
    match upstream.request(outgoing).await {
        Ok(mut response) => {
            if response.status() == StatusCode::SWITCHING_PROTOCOLS
                && let Some(client) = client_upgrade
            {
                relay_upgrade(client, &mut response, |up, down| {
                    tracing::debug!(up, down, "upgraded stream closed");
                });
                let (parts, _) = response.into_parts();
                return Response::from_parts(
                    parts,
                    cluster_proxy_runtime::http_proxy::full(bytes::Bytes::new()),
                );
            }
            let (mut parts, body) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, body.boxed())
        }
        Err(error) => {
            tracing::warn!(%error, destination = %what, "no answer");
            status_response(
                StatusCode::BAD_GATEWAY,
                "ServiceUnavailable",
                &format!("{what} did not answer: {error}"),
            )
        }
    }
}

/// This pod's token and the impersonation of the hub user.
fn identity_headers(
    shared: &Shared,
    user: &str,
    groups: &[String],
) -> Result<Vec<(http::HeaderName, HeaderValue)>, String> {
    let value = |text: &str| {
        HeaderValue::from_str(text).map_err(|_| format!("{text:?} is not a valid header value"))
    };
    let token = shared.token.borrow().clone();
    let mut headers = vec![
        (header::AUTHORIZATION, value(&format!("Bearer {token}"))?),
        (
            http::HeaderName::from_static("impersonate-user"),
            value(&service_access::managed_user(user))?,
        ),
    ];
    for group in service_access::managed_groups(groups.iter().map(String::as_str)) {
        headers.push((
            http::HeaderName::from_static("impersonate-group"),
            value(&group)?,
        ));
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn a_service_target_needs_all_four_headers_well_formed() {
        let target = |proto: &str, namespace: &str, service: &str, port: &str| {
            service_target(&headers(&[
                (service_access::PROTO, proto),
                (service_access::NAMESPACE, namespace),
                (service_access::SERVICE, service),
                (service_access::PORT, port),
            ]))
            .map_err(|refusal| (refusal.code, refusal.message))
        };
        assert_eq!(
            target("http", "apps", "hello", "8000").unwrap(),
            "http://hello.apps.svc:8000"
        );
        assert_eq!(
            target("https", "monitoring", "prometheus-k8s", "9091").unwrap(),
            "https://prometheus-k8s.monitoring.svc:9091"
        );
        for (proto, namespace, service, port, says) in [
            ("ftp", "apps", "hello", "21", "neither http nor https"),
            ("http", "Apps", "hello", "80", "namespace"),
            ("http", "apps", "hello.evil.com", "80", "Service"),
            ("http", "apps", "hello", "0", "port"),
            ("http", "apps", "hello", "80/x", "port"),
        ] {
            let (code, message) = target(proto, namespace, service, port).unwrap_err();
            assert_eq!(code, StatusCode::BAD_REQUEST, "{message}");
            assert!(message.contains(says), "{message} should say {says}");
        }
        let missing = service_target(&headers(&[
            (service_access::NAMESPACE, "apps"),
            (service_access::SERVICE, "hello"),
        ]))
        .map_err(|refusal| refusal.code);
        assert_eq!(missing, Err(StatusCode::BAD_REQUEST));
    }
}
