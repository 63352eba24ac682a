//! Upstream's URL grammar: `/<cluster>/<kube API path>` reaches a cluster's
//! kube-apiserver, and
//! `/<cluster>/api/v1/namespaces/<ns>/services/<[scheme:]name[:port]>/proxy-service/<path>`
//! a Service in it.

use cluster_proxy_proto::identity::ClusterName;

/// What a request path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub cluster: ClusterName,
    pub target: Target,
    /// The path (and query) the target gets, starting with `/`.
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The cluster's kube-apiserver.
    KubeApi,
    /// A Service of the cluster.
    Service {
        namespace: String,
        name: String,
        scheme: String,
        port: u16,
    },
}

impl Target {
    /// Upstream's four target headers: scheme, namespace, Service, port.
    pub fn headers(&self) -> (&str, &str, &str, u16) {
        match self {
            Target::KubeApi => ("https", "default", "kubernetes", 443),
            Target::Service {
                namespace,
                name,
                scheme,
                port,
            } => (scheme, namespace, name, *port),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("the path names no cluster: use /<cluster>/<kube API path>")]
    NoCluster,
    #[error("{0:?} is not a cluster name: {1}")]
    BadCluster(String, String),
    #[error("{0:?} is not [scheme:]name[:port]")]
    BadService(String),
}

/// Parses a request target (`/cluster-a/api/v1/pods?watch=1`).
pub fn parse(path_and_query: &str) -> Result<Route, RouteError> {
    let (path, query) = match path_and_query.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path_and_query, None),
    };
    let rest = path.strip_prefix('/').ok_or(RouteError::NoCluster)?;
    let (cluster, rest) = rest.split_once('/').unwrap_or((rest, ""));
    if cluster.is_empty() {
        return Err(RouteError::NoCluster);
    }
    let cluster = ClusterName::new(cluster)
        .map_err(|e| RouteError::BadCluster(cluster.to_owned(), e.to_string()))?;
    let segments: Vec<&str> = rest.split('/').collect();
    let with_query = |path: String| match query {
        Some(query) => format!("{path}?{query}"),
        None => path,
    };
    // api / v1 / namespaces / <ns> / services / <svc> / proxy-service / <path…>
    if let [
        "api",
        "v1",
        "namespaces",
        namespace,
        "services",
        service,
        "proxy-service",
        tail @ ..,
    ] = segments.as_slice()
    {
        let (scheme, name, port) = service_reference(service)?;
        return Ok(Route {
            cluster,
            target: Target::Service {
                namespace: (*namespace).to_owned(),
                name,
                scheme,
                port,
            },
            path: with_query(format!("/{}", tail.join("/"))),
        });
    }
    Ok(Route {
        cluster,
        target: Target::KubeApi,
        path: with_query(format!("/{rest}")),
    })
}

/// `[scheme:]name[:port]`; the scheme defaults to https and the port to the
/// scheme's.
fn service_reference(text: &str) -> Result<(String, String, u16), RouteError> {
    let bad = || RouteError::BadService(text.to_owned());
    let parts: Vec<&str> = text.split(':').collect();
    let (scheme, name, port) = match parts.as_slice() {
        [name] => ("https", *name, None),
        [scheme @ ("http" | "https"), name] => (*scheme, *name, None),
        [name, port] => ("https", *name, Some(*port)),
        [scheme @ ("http" | "https"), name, port] => (*scheme, *name, Some(*port)),
        _ => return Err(bad()),
    };
    if !cluster_proxy_proto::identity::is_dns1123_label(name) {
        return Err(bad());
    }
    let port = match port {
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(bad)?,
        None if scheme == "http" => 80,
        None => 443,
    };
    Ok((scheme.to_owned(), name.to_owned(), port))
}

/// The Kubernetes verb of a kube-API request, for the audit record: `get`
/// or `list` by whether the path names one object, `watch` for watches.
pub fn kube_verb(method: &http::Method, path_and_query: &str) -> &'static str {
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    let watch = form_urlencoded::parse(query.as_bytes())
        .any(|(k, v)| k == "watch" && (v == "true" || v == "1"));
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    // After /api/<v> or /apis/<g>/<v>: [namespaces/<ns>/]<resource>[/<name>[/<sub>]].
    let rest: &[&str] = match segments.as_slice() {
        ["api", _, rest @ ..] => rest,
        ["apis", _, _, rest @ ..] => rest,
        _ => return non_resource_verb(method),
    };
    let rest = match rest {
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let named = rest.len() >= 2;
    match *method {
        http::Method::GET | http::Method::HEAD if watch => "watch",
        http::Method::GET | http::Method::HEAD if named => "get",
        http::Method::GET | http::Method::HEAD => "list",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE if named => "delete",
        http::Method::DELETE => "deletecollection",
        _ => "unknown",
    }
}

fn non_resource_verb(method: &http::Method) -> &'static str {
    match *method {
        http::Method::GET | http::Method::HEAD => "get",
        http::Method::POST => "post",
        http::Method::PUT => "put",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_api_paths_keep_their_rest_and_query() {
        let route = parse("/cluster-a/api/v1/namespaces/default/pods?watch=1&rv=5").unwrap();
        assert_eq!(route.cluster.as_str(), "cluster-a");
        assert_eq!(route.target, Target::KubeApi);
        assert_eq!(route.path, "/api/v1/namespaces/default/pods?watch=1&rv=5");
        assert_eq!(parse("/cluster-a").unwrap().path, "/");
        assert_eq!(parse("/cluster-a/").unwrap().path, "/");
        assert_eq!(parse("/cluster-a/version").unwrap().path, "/version");
    }

    #[test]
    fn service_paths_as_upstream_names_them() {
        let route =
            parse("/c1/api/v1/namespaces/apps/services/http:hello:8000/proxy-service/a/b?x=1")
                .unwrap();
        assert_eq!(
            route.target,
            Target::Service {
                namespace: "apps".into(),
                name: "hello".into(),
                scheme: "http".into(),
                port: 8000
            }
        );
        assert_eq!(route.path, "/a/b?x=1");
        let route = parse("/c1/api/v1/namespaces/apps/services/hello/proxy-service/").unwrap();
        assert_eq!(route.target.headers(), ("https", "apps", "hello", 443));
        // The kube API's own service proxy is a kube API path.
        let route = parse("/c1/api/v1/namespaces/apps/services/hello/proxy/x").unwrap();
        assert_eq!(route.target, Target::KubeApi);
    }

    #[test]
    fn malformed_paths_are_errors() {
        assert_eq!(parse("/"), Err(RouteError::NoCluster));
        assert_eq!(parse(""), Err(RouteError::NoCluster));
        assert!(matches!(
            parse("/Bad_Name/api"),
            Err(RouteError::BadCluster(..))
        ));
        for service in ["ftp:x:1", "x:0", "x:99999", "a:b:c:d", "Bad_Name"] {
            let path = format!("/c1/api/v1/namespaces/n/services/{service}/proxy-service/");
            assert!(
                matches!(parse(&path), Err(RouteError::BadService(_))),
                "{service}"
            );
        }
    }

    #[test]
    fn verbs_follow_the_path_and_method() {
        use http::Method;
        let cases = [
            (Method::GET, "/api/v1/namespaces/d/pods", "list"),
            (Method::GET, "/api/v1/namespaces/d/pods/p", "get"),
            (Method::GET, "/api/v1/namespaces/d/pods/p/log", "get"),
            (Method::GET, "/api/v1/namespaces/d/pods?watch=true", "watch"),
            (Method::GET, "/api/v1/namespaces", "list"),
            (Method::GET, "/api/v1/namespaces/d", "get"),
            (Method::GET, "/apis/apps/v1/deployments", "list"),
            (Method::POST, "/api/v1/namespaces/d/configmaps", "create"),
            (
                Method::DELETE,
                "/api/v1/namespaces/d/configmaps",
                "deletecollection",
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/d/configmaps/c",
                "delete",
            ),
            (
                Method::PATCH,
                "/apis/apps/v1/namespaces/d/deployments/x",
                "patch",
            ),
            (Method::GET, "/version", "get"),
        ];
        for (method, path, verb) in cases {
            assert_eq!(kube_verb(&method, path), verb, "{method} {path}");
        }
    }
}
