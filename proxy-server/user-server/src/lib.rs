//! user-server: the hub's HTTPS front door to every managed cluster's
//! kube-apiserver, for kubectl and any other kube client, as the hub user.
//!
//! A request for `/<cluster>/<kube API path>` is
//! 1. authenticated on the hub ([`authn`]: a bearer token by TokenReview,
//!    cached, or as an ID token of the OIDC issuer ([`oidc`]); or a client
//!    certificate of the hub's client CA),
//! 2. checked against the cluster list (404 for an unknown cluster) and the
//!    hub's RBAC ([`authz`]: `get` on `managedclusters/proxy` named after the
//!    cluster; 403 naming it) and, for a Service of the cluster, the
//!    exposed-services allowlist ([`exposed`]: default deny, 403),
//! 3. sent through the tunnel to the cluster's service-proxy over a pooled
//!    connection ([`upstream`]), with the user named in the headers of
//!    [`cluster_proxy_proto::service_access`] and every identity header the
//!    client sent removed (the hub token never leaves the hub),
//! 4. audited ([`audit`]) once its response has been sent.
//!
//! Upgraded streams (exec, attach, port-forward over SPDY or WebSocket) are
//! relayed after the 101.
#![forbid(unsafe_code)]

pub mod audit;
pub mod authn;
pub mod authz;
pub mod cache;
pub mod clusters;
pub mod exposed;
pub mod oidc;
pub mod route;
pub mod settings;
pub mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::service_access;
use cluster_proxy_runtime::http_proxy::{
    HttpsOptions, ProxyBody, full, relay_upgrade, serve_https, status_response, strip_hop_by_hop,
    take_upgrade,
};
use cluster_proxy_runtime::reload::{self, Watched};
use cluster_proxy_runtime::tls::{self, Identity, Pem, TlsError};
use cluster_proxy_runtime::{admin, metrics as runtime_metrics, net};
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::audit::{Audit, AuditedBody, CountedBody, Metrics, Record};
use crate::authn::{Authenticator, AuthnError, User};
use crate::authz::{Authorizer, AuthzError};
use crate::clusters::Clusters;
use crate::exposed::{Allowlist, AllowlistMetrics, Refused};
use crate::route::Target;
use crate::upstream::{DialerError, ServiceProxyClient, TunnelDialer};

pub use settings::{Cli, UserServerConfig, UserServerSettings};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A client has this long to send a request's headers, and this much room
/// for them (kube-apiserver's own limit is 1 MiB; kubectl sends a few KiB).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_HEADER_BYTES: usize = 256 * 1024;
/// How long open requests may finish after SIGTERM.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
const USER_AGENT: &str = concat!("user-server/", env!("CARGO_PKG_VERSION"));

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Bind(#[from] net::BindError),
    #[error("OIDC: {0}")]
    Oidc(#[from] oidc::OidcError),
}

struct Shared {
    authn: Authenticator,
    authz: Authorizer,
    clusters: Clusters,
    exposed: Allowlist,
    /// ID tokens of the configured OIDC issuer (`--oidc-issuer-url`).
    oidc: Option<oidc::OidcAuthenticator>,
    dialer: TunnelDialer,
    /// The pooled client over the identity credentials, rebuilt when the
    /// identity certificate or the service-proxy CA changed on disk.
    client: reload::Derived<rustls::ClientConfig, ServiceProxyClient>,
    config: UserServerConfig,
    metrics: Metrics,
}

impl Shared {
    fn client(&self) -> ServiceProxyClient {
        self.client.get(|tls| {
            upstream::service_proxy_client(
                self.dialer.clone(),
                tls.clone(),
                self.config.max_idle_connections_per_cluster,
                self.config.idle_connection_timeout,
            )
        })
    }
}

/// A running user-server.
pub struct RunningUserServer {
    pub addr: SocketAddr,
    pub health_addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RunningUserServer {
    /// Tokens the cache holds (tests).
    pub fn cached_tokens(&self) -> usize {
        self.shared.authn.cached()
    }

    /// Stops accepting and lets open requests finish (up to 30 s).
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Loads the credentials (startup fails clearly on bad ones), follows the
/// hub's ManagedClusters with `hub`, binds the ports and serves until
/// [`RunningUserServer::shutdown`].
pub async fn start(
    config: UserServerConfig,
    hub: kube::Client,
) -> Result<RunningUserServer, StartError> {
    let serving = serving_tls(&config)?;
    let proxy_tls = watch_client_tls(
        "proxy-server client credentials",
        &config.proxy_ca_cert,
        &config.proxy_cert,
        &config.proxy_key,
        cluster_proxy_proto::transport::ALPN_H2,
        config.reload_interval,
    )?;
    let identity = watch_client_tls(
        "service-proxy identity credentials",
        &config.service_proxy_ca_cert,
        &config.identity_cert,
        &config.identity_key,
        cluster_proxy_proto::transport::ALPN_HTTP11,
        config.reload_interval,
    )?;
    let (host, port) = config.proxy_server.clone();
    let metrics = Metrics::default();
    let allowlist_metrics = AllowlistMetrics::default();
    let exposed = match &config.exposed_services {
        Some(source) => {
            let namespace = source
                .namespace
                .clone()
                .unwrap_or_else(|| hub.default_namespace().to_owned());
            Allowlist::follow(
                hub.clone(),
                &namespace,
                &source.name,
                allowlist_metrics.clone(),
            )
        }
        None => {
            tracing::info!(
                "no exposed-services ConfigMap (--exposed-services-configmap is empty): every Service is refused"
            );
            Allowlist::none(allowlist_metrics.clone())
        }
    };
    let shared = Arc::new(Shared {
        authn: Authenticator::new(
            hub.clone(),
            config.token_review_cache_ttl,
            config.cache_size,
            metrics.token_reviews.clone(),
        ),
        authz: Authorizer::new(
            hub.clone(),
            config.authorization_cache_ttl,
            config.cache_size,
        ),
        clusters: Clusters::follow(hub),
        exposed,
        oidc: config
            .oidc
            .clone()
            .map(oidc::OidcAuthenticator::new)
            .transpose()?,
        dialer: TunnelDialer::new(&host, port, proxy_tls, config.dial_timeout),
        client: reload::Derived::new(identity),
        config: config.clone(),
        metrics: metrics.clone(),
    });

    let stop = CancellationToken::new();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    allowlist_metrics.register(&mut registry);
    let registry = Arc::new(registry);
    let ready = shared.clone();
    let routes = admin::Routes::probes(move || {
        let waiting = if !ready.clusters.ready() {
            "the hub's ManagedClusters are not listed yet\n"
        } else if !ready.exposed.loaded() {
            "the exposed-services allowlist is not read yet\n"
        } else {
            return Ok(());
        };
        Err(admin::NotReady {
            status: StatusCode::SERVICE_UNAVAILABLE,
            body: waiting.into(),
        })
    })
    .with_metrics(move || runtime_metrics::encode_registry(&registry));
    let (health, health_addr) = net::bind(
        "health port",
        &config.health.ip().to_string(),
        config.health.port(),
    )
    .await?;
    tokio::spawn(admin::serve(health, routes, stop.clone()));
    let (listener, addr) = net::bind(
        "user-server port",
        &config.listen.ip().to_string(),
        config.listen.port(),
    )
    .await?;
    tracing::info!(%addr, proxy_server = %format!("{host}:{port}"), "serving users");
    let task = tokio::spawn(accept(listener, serving, shared.clone(), stop.clone()));
    Ok(RunningUserServer {
        addr,
        health_addr,
        shared,
        stop,
        task,
    })
}

/// The serving configuration: HTTP/2 and HTTP/1.1 (upgrades), client
/// certificates of `client_ca` accepted but not required.
fn serving_tls(config: &UserServerConfig) -> Result<Watched<rustls::ServerConfig>, TlsError> {
    let (cert, key, ca) = (
        config.server_cert.clone(),
        config.server_key.clone(),
        config.client_ca.clone(),
    );
    let mut paths = vec![cert.clone(), key.clone()];
    paths.extend(ca.clone());
    reload::watch_files(
        "user-server serving credentials",
        paths,
        config.reload_interval,
        move || {
            let identity = Identity::from_files(&cert, &key)?;
            let alpn: &[&[u8]] = &[b"h2", b"http/1.1"];
            match &ca {
                Some(ca) => tls::server_config_optional_clients(
                    identity,
                    tls::roots(&Pem::file("client CA", ca)?)?,
                    alpn,
                ),
                None => tls::server_config(identity, None, alpn),
            }
        },
    )
}

fn watch_client_tls(
    what: &'static str,
    ca: &std::path::Path,
    cert: &std::path::Path,
    key: &std::path::Path,
    alpn: &'static [u8],
    interval: Duration,
) -> Result<Watched<rustls::ClientConfig>, TlsError> {
    let (ca, cert, key) = (ca.to_owned(), cert.to_owned(), key.to_owned());
    reload::watch_files(
        what,
        vec![ca.clone(), cert.clone(), key.clone()],
        interval,
        move || {
            let roots = tls::roots(&Pem::file("CA bundle", &ca)?)?;
            tls::client_config(roots, Some(Identity::from_files(&cert, &key)?), &[alpn])
        },
    )
}

/// Serves until `stop`; a connection's verified client certificate (if
/// any) is read once, for its requests without a bearer token.
async fn accept(
    listener: TcpListener,
    tls: Watched<rustls::ServerConfig>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let options = HttpsOptions {
        http1_only: false,
        handshake_timeout: HANDSHAKE_TIMEOUT,
        header_read_timeout: HEADER_READ_TIMEOUT,
        max_header_bytes: MAX_HEADER_BYTES,
        drain_timeout: DRAIN_TIMEOUT,
    };
    serve_https(listener, tls, stop, options, move |connection, _peer| {
        let certificate_user = connection
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|leaf| authn::certificate_user(leaf));
        let shared = shared.clone();
        move |request| {
            let (shared, certificate_user) = (shared.clone(), certificate_user.clone());
            async move { handle(&shared, request, certificate_user).await }
        }
    })
    .await;
}

/// The trace id of a W3C `traceparent` header, if the client sent a valid one.
fn trace_id(request: &Request<Incoming>) -> String {
    request
        .headers()
        .get(cluster_proxy_proto::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| cluster_proxy_proto::trace::parse_traceparent(v).ok())
        .map(|context| context.trace_id().to_string())
        .unwrap_or_default()
}

fn bearer_token(request: &Request<Incoming>) -> Option<Result<&str, AuthnError>> {
    let value = request.headers().get(header::AUTHORIZATION)?;
    let token = value
        .to_str()
        .ok()
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|t| !t.is_empty());
    Some(token.ok_or_else(|| {
        AuthnError::Rejected(": the Authorization header is not a bearer token".into())
    }))
}

async fn handle(
    shared: &Shared,
    mut request: Request<Incoming>,
    certificate_user: Option<Result<User, AuthnError>>,
) -> Response<ProxyBody> {
    let path_and_query = request
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".into());
    let mut audit = Audit::new(
        Record {
            user: String::new(),
            groups: Vec::new(),
            cluster: String::new(),
            verb: String::new(),
            method: request.method().to_string(),
            path: path_and_query.clone(),
            code: 0,
            bytes_in: 0,
            bytes_out: 0,
            duration_ms: 0.0,
            trace_id: trace_id(&request),
            upgraded: false,
            passthrough: false,
        },
        shared.metrics.clone(),
    );
    let refuse = |mut audit: Audit, code: StatusCode, reason: &str, message: &str| {
        audit.record_mut().code = code.as_u16();
        drop(audit);
        status_response(code, reason, message)
    };

    let route = match route::parse(&path_and_query) {
        Ok(route) => route,
        Err(error) => {
            return refuse(
                audit,
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &error.to_string(),
            );
        }
    };
    audit.record_mut().cluster = route.cluster.to_string();
    audit.record_mut().verb = route::kube_verb(request.method(), &route.path).to_owned();

    let bearer = bearer_token(&request);
    // A token the hub does not know may go on to the cluster's kube-apiserver
    // (upstream's managed-token passthrough), when the operator allows it.
    let may_pass_through = shared.config.managed_token_passthrough
        && matches!(bearer, Some(Ok(_)))
        && route.target == Target::KubeApi;
    let user = match (bearer, certificate_user) {
        (Some(Ok(token)), _) => match &shared.oidc {
            Some(oidc) if oidc.claims_issuer(token) => oidc.verify(token).await,
            _ => shared.authn.token(token).await,
        },
        (Some(Err(error)), _) => Err(error),
        (None, Some(user)) => user,
        (None, None) => Err(AuthnError::NoCredentials),
    };
    let user = match user {
        Ok(user) => Some(user),
        Err(AuthnError::Rejected(_)) if may_pass_through => None,
        Err(error @ AuthnError::Issuer(_)) => {
            tracing::warn!(%error, "OIDC");
            return refuse(
                audit,
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                &format!("authenticating failed: {error}"),
            );
        }
        Err(AuthnError::Review(error)) => {
            tracing::warn!(%error, "the hub's TokenReview failed");
            return refuse(
                audit,
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                &format!("authenticating on the hub failed: {error}"),
            );
        }
        Err(error) => {
            return refuse(
                audit,
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                &error.to_string(),
            );
        }
    };
    match &user {
        Some(user) => {
            audit.record_mut().user = user.name.clone();
            audit.record_mut().groups = user.groups.clone();
        }
        None => audit.record_mut().passthrough = true,
    }

    let cluster = route.cluster.as_str();
    if !shared.clusters.ready() {
        return refuse(
            audit,
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the hub's ManagedClusters are not listed yet",
        );
    }
    if !shared.clusters.exists(cluster) {
        return refuse(
            audit,
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("managedclusters.cluster.open-cluster-management.io {cluster:?} not found"),
        );
    }
    let authorized = match &user {
        Some(user) => shared.authz.check(user, cluster).await,
        // Nobody the hub knows: the cluster authenticates and authorizes it.
        None => Ok(()),
    };
    match authorized {
        Ok(()) => {}
        Err(error @ AuthzError::Denied { .. }) => {
            return refuse(
                audit,
                StatusCode::FORBIDDEN,
                "Forbidden",
                &error.to_string(),
            );
        }
        Err(error @ AuthzError::Review(_)) => {
            tracing::warn!(%error, "the hub's SubjectAccessReview failed");
            return refuse(
                audit,
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                &error.to_string(),
            );
        }
    }

    if let Target::Service {
        namespace,
        name,
        scheme,
        port,
    } = &route.target
    {
        let wanted = exposed::Wanted {
            cluster,
            namespace,
            service: name,
            port: *port,
            protocol: scheme,
        };
        match shared.exposed.check(&wanted) {
            Ok(()) => {}
            Err(refused @ Refused::NotListed { .. }) => {
                return refuse(
                    audit,
                    StatusCode::FORBIDDEN,
                    "Forbidden",
                    &refused.to_string(),
                );
            }
            Err(refused @ Refused::NotLoaded(_)) => {
                return refuse(
                    audit,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailable",
                    &refused.to_string(),
                );
            }
        }
    }

    let client_upgrade = take_upgrade(&mut request);
    let (mut parts, body) = request.into_parts();
    let authority =
        upstream::service_proxy_authority(&route.cluster, shared.config.service_proxy_port);
    parts.uri = match http::Uri::builder()
        .scheme("https")
        .authority(authority.as_str())
        .path_and_query(route.path.as_str())
        .build()
    {
        Ok(uri) => uri,
        Err(error) => {
            return refuse(
                audit,
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("request path: {error}"),
            );
        }
    };
    if let Err(error) = forwarded_headers(&mut parts.headers, &route, user.as_ref()) {
        return refuse(audit, StatusCode::BAD_REQUEST, "BadRequest", &error);
    }
    // The service-proxies speak HTTP/1.1 (upgrades need it), whatever the
    // client spoke to us.
    parts.version = http::Version::HTTP_11;
    let body = CountedBody::new(body, audit.bytes_in.clone());
    let outgoing = Request::from_parts(parts, body);
    let client = shared.client();
    let answered = tokio::time::timeout(
        shared.config.response_header_timeout,
        client.request(outgoing),
    )
    .await;
    let mut response = match answered {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            let (code, reason, message) = classify(&error, cluster);
            tracing::info!(cluster, %error, "the request did not reach the cluster");
            return refuse(audit, code, reason, &message);
        }
        Err(_) => {
            return refuse(
                audit,
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                &format!(
                    "cluster {cluster:?} sent no response headers within {:?}",
                    shared.config.response_header_timeout
                ),
            );
        }
    };
    audit.record_mut().code = response.status().as_u16();
    if response.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        relay_upgrade(client_upgrade, &mut response, move |up, down| {
            audit.upgraded(up, down);
            drop(audit);
        });
        let (parts, _) = response.into_parts();
        return Response::from_parts(parts, full(bytes::Bytes::new()));
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, AuditedBody::new(body, audit).boxed())
}

/// The headers the service-proxy gets: the client's, less hop-by-hop ones,
/// its credentials (the hub token stays on the hub) and every identity
/// header; plus the cluster, the user and the target. Without a `user` the
/// client's token is one the hub does not know, passed through: it is the
/// only credential kept.
fn forwarded_headers(
    headers: &mut http::HeaderMap,
    route: &route::Route,
    user: Option<&User>,
) -> Result<(), String> {
    let passed_through = match user {
        Some(_) => None,
        None => headers.get(header::AUTHORIZATION).cloned(),
    };
    strip_hop_by_hop(headers);
    let identity: Vec<HeaderName> = headers
        .keys()
        .filter(|name| service_access::is_identity_header(name.as_str()))
        .cloned()
        .collect();
    for name in identity {
        headers.remove(name);
    }
    headers.remove(header::AUTHORIZATION);
    headers.remove(header::HOST);
    headers.remove(header::COOKIE);
    let passing_through = passed_through.is_some();
    if let Some(token) = passed_through {
        headers.insert(header::AUTHORIZATION, token);
    }
    let value = |text: &str| {
        HeaderValue::from_str(text).map_err(|_| format!("{text:?} cannot be sent in a header"))
    };
    let (proto, namespace, service, port) = route.target.headers();
    let mut add = |name: &'static str, text: &str| -> Result<(), String> {
        headers.append(HeaderName::from_static(name), value(text)?);
        Ok(())
    };
    add(service_access::CLUSTER, route.cluster.as_str())?;
    match (user, passing_through) {
        (Some(user), _) => {
            add(service_access::USER, &user.name)?;
            if !user.uid.is_empty() {
                add(service_access::UID, &user.uid)?;
            }
            for group in &user.groups {
                add(service_access::GROUP, group)?;
            }
        }
        (None, true) => add(service_access::CREDENTIAL, service_access::PASSTHROUGH)?,
        (None, false) => return Err("no user and no token to pass through".into()),
    }
    add(service_access::PROTO, proto)?;
    add(service_access::NAMESPACE, namespace)?;
    add(service_access::SERVICE, service)?;
    add(service_access::PORT, &port.to_string())?;
    Ok(())
}

/// Why a request did not reach its cluster, as a status for the client.
fn classify(
    error: &hyper_util::client::legacy::Error,
    cluster: &str,
) -> (StatusCode, &'static str, String) {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(dialer) = current.downcast_ref::<DialerError>() {
            return match dialer {
                DialerError::ProxyServer { .. } => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailable",
                    dialer.to_string(),
                ),
                DialerError::Dial(cluster_proxy_proto::connector::ConnectError::NoAgent {
                    ..
                }) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailable",
                    format!("cluster {cluster:?} has no live agent: is its proxy-agent connected?"),
                ),
                DialerError::Dial(cluster_proxy_proto::connector::ConnectError::Timeout {
                    ..
                }) => (
                    StatusCode::GATEWAY_TIMEOUT,
                    "Timeout",
                    format!("cluster {cluster:?}: {dialer}"),
                ),
                DialerError::Dial(other) => (
                    StatusCode::BAD_GATEWAY,
                    "ServiceUnavailable",
                    format!("cluster {cluster:?}'s service-proxy cannot be reached: {other}"),
                ),
            };
        }
        source = current.source();
    }
    (
        StatusCode::BAD_GATEWAY,
        "ServiceUnavailable",
        format!("cluster {cluster:?}'s service-proxy did not answer: {error}"),
    )
}

/// The hub client the user-server uses: `kubeconfig`, or the usual
/// inference ($KUBECONFIG, ~/.kube/config, in-cluster).
pub async fn hub_client(
    kubeconfig: Option<&std::path::Path>,
) -> Result<kube::Client, cluster_proxy_control::client::ClientError> {
    match kubeconfig {
        Some(path) => cluster_proxy_control::client::client_from(path, USER_AGENT).await,
        None => cluster_proxy_control::client::client(USER_AGENT).await,
    }
}
