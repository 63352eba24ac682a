//! How a certificate names a cluster, and which identifiers that cluster may claim.
//!
//! Convention (shared by cert-authority, which issues agent certificates, and
//! proxy-server, which checks them): an agent certificate carries exactly one
//! URI SAN `spiffe://cluster-proxy.open-cluster-management.io/cluster/<cluster>`.
//! OCM cluster names are also hub namespace names, so they are DNS-1123 labels.
//!
//! A cluster may claim, as `host=` identifiers, only:
//! * `<cluster>` and `<cluster>.<namespace>` (the kube-apiserver aliases
//!   upstream cluster-proxy registers), and
//! * `cluster-<first 48 hex of sha256(cluster)>.open-cluster-management.proxy`
//!   (upstream's service-proxy host).

use sha2::{Digest, Sha256};

use crate::identifiers::AgentIdentifiers;

/// Prefix of the URI SAN that names an agent's cluster.
pub const CLUSTER_URI_PREFIX: &str = "spiffe://cluster-proxy.open-cluster-management.io/cluster/";
/// DNS suffix of upstream's hashed per-cluster service-proxy host.
pub const SERVICE_PROXY_DOMAIN: &str = "open-cluster-management.proxy";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error(
        "invalid cluster name {0:?}: must be a DNS-1123 label (lowercase alphanumerics and '-', at most 63 characters)"
    )]
    InvalidClusterName(String),
    #[error("certificate URI SAN {0:?} is not a cluster identity")]
    NotAClusterUri(String),
    #[error("identifier {identifier} does not belong to cluster {cluster:?}")]
    NotPermitted { cluster: String, identifier: String },
}

/// Whether `s` is a DNS-1123 label.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Whether `value` is a DNS-1123 subdomain (dot-separated labels, at most
/// 253), as Kubernetes requires of most object names.
pub fn is_dns1123_subdomain(value: &str) -> bool {
    value.len() <= 253 && value.split('.').all(is_dns1123_label)
}

/// A validated OCM managed-cluster name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterName(String);

impl ClusterName {
    pub fn new(name: impl Into<String>) -> Result<Self, IdentityError> {
        let name = name.into();
        if is_dns1123_label(&name) {
            Ok(ClusterName(name))
        } else {
            Err(IdentityError::InvalidClusterName(name))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The URI SAN a certificate carries to name this cluster.
    pub fn to_uri(&self) -> String {
        format!("{CLUSTER_URI_PREFIX}{}", self.0)
    }

    /// Reads a URI SAN. `Ok(None)`: the URI is not ours (other SANs are allowed);
    /// an error: it claims to be a cluster identity but is malformed.
    pub fn from_uri(uri: &str) -> Result<Option<Self>, IdentityError> {
        match uri.strip_prefix(CLUSTER_URI_PREFIX) {
            None => Ok(None),
            Some(name) => ClusterName::new(name)
                .map(Some)
                .map_err(|_| IdentityError::NotAClusterUri(uri.to_owned())),
        }
    }

    /// Upstream's hashed service-proxy host for this cluster.
    pub fn service_proxy_host(&self) -> String {
        let digest = hex::encode(Sha256::digest(self.0.as_bytes()));
        format!("cluster-{}.{SERVICE_PROXY_DOMAIN}", &digest[..48])
    }

    /// Whether this cluster may claim `host` as a `host=` identifier.
    pub fn owns_host(&self, host: &str) -> bool {
        if host == self.0 || host == self.service_proxy_host() {
            return true;
        }
        host.strip_prefix(self.0.as_str())
            .and_then(|rest| rest.strip_prefix('.'))
            .is_some_and(is_dns1123_label)
    }

    /// The identifiers an agent of this cluster registers by default, the same
    /// set upstream cluster-proxy configures.
    pub fn default_identifiers(&self, agent_namespace: &str) -> AgentIdentifiers {
        AgentIdentifiers {
            hosts: vec![
                self.service_proxy_host(),
                self.0.clone(),
                format!("{}.{agent_namespace}", self.0),
            ],
            ..AgentIdentifiers::default()
        }
    }

    /// Checks every identifier an agent claims against this cluster. Only
    /// `host=` identifiers the cluster owns are allowed: IP, CIDR and
    /// default-route identifiers could capture other clusters' traffic.
    pub fn check_identifiers(&self, ids: &AgentIdentifiers) -> Result<(), IdentityError> {
        let refuse = |identifier: String| IdentityError::NotPermitted {
            cluster: self.0.clone(),
            identifier,
        };
        if let Some(h) = ids.hosts.iter().find(|h| !self.owns_host(h)) {
            return Err(refuse(format!("host={h}")));
        }
        if let Some(v) = ids.ipv4.first() {
            return Err(refuse(format!("ipv4={v}")));
        }
        if let Some(v) = ids.ipv6.first() {
            return Err(refuse(format!("ipv6={v}")));
        }
        if let Some(v) = ids.cidrs.first() {
            return Err(refuse(format!("cidr={v}")));
        }
        if ids.default_route {
            return Err(refuse("default-route=true".into()));
        }
        Ok(())
    }
}

impl std::fmt::Display for ClusterName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(name: &str) -> ClusterName {
        ClusterName::new(name).unwrap()
    }

    #[test]
    fn hashed_host_matches_upstream() {
        // Value from upstream cluster-proxy's documentation of `loopback`.
        assert_eq!(
            cluster("loopback").service_proxy_host(),
            "cluster-64edaa3fb9310e98cdb183cddbf156d9964a05c017fa7f8e.open-cluster-management.proxy"
        );
    }

    #[test]
    fn validates_cluster_names() {
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", &"x".repeat(64)] {
            assert!(ClusterName::new(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "cluster-a", "0abc", &"x".repeat(63)] {
            assert!(ClusterName::new(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn uri_round_trip() {
        let c = cluster("cluster-a");
        assert_eq!(ClusterName::from_uri(&c.to_uri()), Ok(Some(c)));
        assert_eq!(ClusterName::from_uri("spiffe://other/x"), Ok(None));
        assert!(ClusterName::from_uri(&format!("{CLUSTER_URI_PREFIX}Bad_Name")).is_err());
        assert!(ClusterName::from_uri(&format!("{CLUSTER_URI_PREFIX}a/b")).is_err());
    }

    #[test]
    fn a_cluster_owns_its_hosts_only() {
        let a = cluster("cluster-a");
        assert!(a.owns_host("cluster-a"));
        assert!(a.owns_host("cluster-a.open-cluster-management-agent-addon"));
        assert!(a.owns_host(&a.service_proxy_host()));
        assert!(!a.owns_host("cluster-b"));
        assert!(!a.owns_host("cluster-ab"));
        assert!(!a.owns_host("cluster-a."));
        assert!(!a.owns_host("cluster-a.x.y"));
        assert!(!a.owns_host(&cluster("cluster-b").service_proxy_host()));
    }

    #[test]
    fn default_identifiers_pass_the_check_and_foreign_ones_fail() {
        let a = cluster("cluster-a");
        a.check_identifiers(&a.default_identifiers("ns")).unwrap();
        let mut foreign = a.default_identifiers("ns");
        foreign.hosts.push("cluster-b".into());
        assert_eq!(
            a.check_identifiers(&foreign),
            Err(IdentityError::NotPermitted {
                cluster: "cluster-a".into(),
                identifier: "host=cluster-b".into()
            })
        );
        let default_route = AgentIdentifiers {
            default_route: true,
            ..AgentIdentifiers::default()
        };
        assert!(a.check_identifiers(&default_route).is_err());
    }
}
