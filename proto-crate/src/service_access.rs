//! The hop from the hub's user-server to a managed cluster's service-proxy:
//! what the user-server says about a request, and how the service-proxy
//! names the hub identity it acts for.
//!
//! The hop is HTTPS through the tunnel, and the service-proxy believes these
//! headers only from a client certificate that names the user-server: the
//! user-server has authenticated and authorized the user on the hub, the
//! service-proxy turns the identity into Kubernetes impersonation with its
//! own ServiceAccount. Anything a client sent under these names is removed
//! by the user-server before it adds its own.

/// The cluster the user-server routed the request to. A service-proxy
/// refuses (421) a request for any cluster but its own, so a routing
/// mistake can never run one cluster's request on another.
pub const CLUSTER: &str = "cluster-proxy-cluster";
/// The hub user the request is for (a TokenReview's or a certificate's
/// user name).
pub const USER: &str = "cluster-proxy-user";
/// That user's uid, when the hub knows one.
pub const UID: &str = "cluster-proxy-uid";
/// One of the user's hub groups; repeated.
pub const GROUP: &str = "cluster-proxy-group";
/// Upstream's target headers: the Service a request is for (the kube
/// API is `https`, `default`, `kubernetes`, `443`).
pub const PROTO: &str = "cluster-proxy-proto";
pub const NAMESPACE: &str = "cluster-proxy-namespace";
pub const SERVICE: &str = "cluster-proxy-service";
pub const PORT: &str = "cluster-proxy-port";

/// Set (to [`PASSTHROUGH`]) instead of [`USER`] when the user-server sends
/// the client's own bearer token on: a token the hub does not know, which
/// the managed kube-apiserver authenticates itself (upstream's managed-token
/// passthrough; the user-server's `--managed-token-passthrough`).
pub const CREDENTIAL: &str = "cluster-proxy-credential";
/// The value of [`CREDENTIAL`] for a passed-through token.
pub const PASSTHROUGH: &str = "managed-token";

/// Every header of this contract: a client's own copies are removed.
pub const ALL: &[&str] = &[
    CLUSTER, USER, UID, GROUP, PROTO, NAMESPACE, SERVICE, PORT, CREDENTIAL,
];

/// The service-proxy's port (upstream's).
pub const SERVICE_PROXY_PORT: u16 = 7443;

/// The argument under which the proxy-agent binary runs the service-proxy
/// (`/proxy-agent service-proxy <flags>`), as addon-manager renders it.
pub const SERVICE_PROXY_SUBCOMMAND: &str = "service-proxy";

/// The common name of the user-server's client certificate, which the
/// service-proxies require by default.
pub const USER_SERVER_IDENTITY: &str = "cluster-proxy-user-server";

/// Prefix of every hub identity on a managed cluster (upstream's, for
/// ServiceAccounts: `cluster:hub:system:serviceaccount:<ns>:<name>`).
pub const HUB_PREFIX: &str = "cluster:hub:";

/// The group every authenticated user is in; the managed API adds its own.
const AUTHENTICATED: &str = "system:authenticated";

/// Whether `name` is a header a client may not send through the proxy:
/// impersonation, the front-proxy identity headers, and this contract's.
pub fn is_identity_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name.starts_with("impersonate-")
        || name.starts_with("x-remote-")
        || ALL.contains(&name.as_str())
}

/// The managed-cluster user a hub user acts as. Every hub name is prefixed,
/// not only ServiceAccounts as upstream does: a hub user `alice` never
/// becomes the managed cluster's own `alice`.
pub fn managed_user(hub_user: &str) -> String {
    format!("{HUB_PREFIX}{hub_user}")
}

/// The managed-cluster groups of a hub user's groups: prefixed the same
/// way (a hub `system:masters` must not mean the managed one), without
/// `system:authenticated`, which the managed API adds to everyone.
pub fn managed_groups<'a>(hub_groups: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    hub_groups
        .into_iter()
        .filter(|g| *g != AUTHENTICATED)
        .map(|g| format!("{HUB_PREFIX}{g}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_headers_are_recognised_in_any_case() {
        for name in [
            "Impersonate-User",
            "impersonate-group",
            "Impersonate-Extra-Scopes",
            "X-Remote-User",
            "x-remote-extra-foo",
            "Cluster-Proxy-User",
            "cluster-proxy-cluster",
        ] {
            assert!(is_identity_header(name), "{name}");
        }
        for name in [
            "authorization",
            "content-type",
            "x-request-id",
            "impersonator",
        ] {
            assert!(!is_identity_header(name), "{name}");
        }
    }

    #[test]
    fn hub_identities_are_prefixed_and_the_authenticated_group_dropped() {
        assert_eq!(
            managed_user("system:serviceaccount:ns:sa"),
            "cluster:hub:system:serviceaccount:ns:sa"
        );
        assert_eq!(
            managed_groups(["system:masters", "system:authenticated", "team-a"]),
            vec!["cluster:hub:system:masters", "cluster:hub:team-a"]
        );
    }
}
