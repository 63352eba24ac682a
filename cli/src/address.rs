//! The addresses the CLI takes: `CLUSTER:[HOST:]PORT` for what to reach
//! through the tunnel, `[LOCAL_ADDR:]LOCAL_PORT` for where to listen, and
//! `HOST:PORT` for a proxy-server.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use cluster_proxy_proto::identity::is_dns1123_label;
use cluster_proxy_proto::transport::host_port;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddressError {
    #[error(
        "{0:?} is not a cluster name: a managed cluster is named by a DNS-1123 label \
         (lower-case letters, digits and '-', at most 63 characters)"
    )]
    ClusterName(String),
    #[error("{0:?} is not CLUSTER:PORT or CLUSTER:HOST:PORT")]
    Target(String),
    #[error("{0:?} is not a DNS name or an IP address")]
    Host(String),
    #[error("{0:?} is not a port (1-65535)")]
    Port(String),
    #[error("{0:?} is not a local port (0-65535) or LOCAL_ADDR:LOCAL_PORT with an IP address")]
    Local(String),
    #[error("{0:?} is not HOST:PORT")]
    HostPort(String),
}

/// What a port-forward reaches: `host:port` dialed through the agent of `cluster`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardTarget {
    pub cluster: String,
    pub host: String,
    pub port: u16,
}

impl ForwardTarget {
    /// `CLUSTER:PORT` (the host is the cluster name, which its agent
    /// serves) or `CLUSTER:HOST:PORT` (an IPv6 host bracketed).
    pub fn parse(text: &str) -> Result<Self, AddressError> {
        let invalid = || AddressError::Target(text.to_owned());
        let (cluster, rest) = text.split_once(':').ok_or_else(invalid)?;
        let (host, port) = match rest.strip_prefix('[') {
            Some(bracketed) => bracketed.split_once("]:").ok_or_else(invalid)?,
            None => rest.split_once(':').unwrap_or((cluster, rest)),
        };
        if port.contains(':') {
            return Err(invalid());
        }
        if !is_dns1123_label(cluster) {
            return Err(AddressError::ClusterName(cluster.to_owned()));
        }
        if !is_host(host) {
            return Err(AddressError::Host(host.to_owned()));
        }
        Ok(ForwardTarget {
            cluster: cluster.to_owned(),
            host: host.to_owned(),
            port: parse_port(port)?,
        })
    }

    /// Whether the host is one the cluster's agent registers (`host=` agent
    /// identifiers, reference §5): the cluster name, `<cluster>.<namespace>`,
    /// or the hashed service-proxy host. The proxy-server routes a dial by its
    /// host, so another host reaches the cluster only with non-default routing.
    pub fn host_is_the_clusters(&self) -> bool {
        self.host == self.cluster
            || self
                .host
                .strip_prefix(self.cluster.as_str())
                .is_some_and(|rest| rest.starts_with('.'))
            || self.host.ends_with(".open-cluster-management.proxy")
    }

    /// The `host:port` the tunnel dials.
    pub fn dial_address(&self) -> String {
        host_port(&self.host, self.port)
    }
}

impl std::fmt::Display for ForwardTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.cluster, self.dial_address())
    }
}

/// `[LOCAL_ADDR:]LOCAL_PORT`; the address defaults to 127.0.0.1, as
/// `kubectl port-forward` listens on loopback unless told otherwise. Port 0
/// takes a free port (the bound address is printed).
pub fn parse_local(text: &str) -> Result<SocketAddr, AddressError> {
    let invalid = || AddressError::Local(text.to_owned());
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    let (address, port) = text.rsplit_once(':').ok_or_else(invalid)?;
    let address = address.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = match address {
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        other => other.parse().map_err(|_| invalid())?,
    };
    let port = port.parse::<u16>().map_err(|_| invalid())?;
    Ok(SocketAddr::new(ip, port))
}

/// A proxy-server client address, `HOST:PORT` (IPv6 hosts bracketed).
pub fn parse_host_port(text: &str) -> Result<(String, u16), AddressError> {
    let invalid = || AddressError::HostPort(text.to_owned());
    let (host, port) = text.rsplit_once(':').ok_or_else(invalid)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if !is_host(host) {
        return Err(invalid());
    }
    Ok((host.to_owned(), parse_port(port)?))
}

fn parse_port(text: &str) -> Result<u16, AddressError> {
    text.parse::<u16>()
        .ok()
        .filter(|port| *port != 0)
        .ok_or_else(|| AddressError::Port(text.to_owned()))
}

fn is_host(host: &str) -> bool {
    host.parse::<IpAddr>().is_ok()
        || (!host.is_empty()
            && host.len() <= 253
            && host
                .split('.')
                .all(|label| is_dns1123_label(&label.to_ascii_lowercase())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_names_the_cluster_and_optionally_a_host() {
        assert_eq!(
            ForwardTarget::parse("cluster-a:443").unwrap(),
            ForwardTarget {
                cluster: "cluster-a".into(),
                host: "cluster-a".into(),
                port: 443
            }
        );
        let service = ForwardTarget::parse("cluster-a:postgres.db.svc:5432").unwrap();
        assert_eq!(service.dial_address(), "postgres.db.svc:5432");
        assert_eq!(service.cluster, "cluster-a");
        assert!(!service.host_is_the_clusters());
        for routed in ["cluster-a:1", "cluster-a:cluster-a.agent-ns:1"] {
            assert!(ForwardTarget::parse(routed).unwrap().host_is_the_clusters());
        }
        assert!(
            !ForwardTarget::parse("cluster-a:cluster-ab:1")
                .unwrap()
                .host_is_the_clusters()
        );
    }

    #[test]
    fn bad_targets_say_what_is_wrong() {
        assert_eq!(
            ForwardTarget::parse("Cluster_A:443"),
            Err(AddressError::ClusterName("Cluster_A".into()))
        );
        assert_eq!(
            ForwardTarget::parse("cluster-a"),
            Err(AddressError::Target("cluster-a".into()))
        );
        assert_eq!(
            ForwardTarget::parse("a:b:c:1"),
            Err(AddressError::Target("a:b:c:1".into()))
        );
        assert_eq!(
            ForwardTarget::parse("a:[::1:1"),
            Err(AddressError::Target("a:[::1:1".into()))
        );
        assert_eq!(
            ForwardTarget::parse("cluster-a:0"),
            Err(AddressError::Port("0".into()))
        );
        assert_eq!(
            ForwardTarget::parse("cluster-a:99999"),
            Err(AddressError::Port("99999".into()))
        );
        assert_eq!(
            ForwardTarget::parse("cluster-a:bad_host:1"),
            Err(AddressError::Host("bad_host".into()))
        );
        let message = ForwardTarget::parse("UPPER:1").unwrap_err().to_string();
        assert!(message.contains("DNS-1123 label"), "{message}");
    }

    #[test]
    fn local_addresses_default_to_loopback() {
        assert_eq!(parse_local("8080").unwrap().to_string(), "127.0.0.1:8080");
        assert_eq!(parse_local("0").unwrap().to_string(), "127.0.0.1:0");
        assert_eq!(
            parse_local("0.0.0.0:9000").unwrap().to_string(),
            "0.0.0.0:9000"
        );
        assert_eq!(parse_local("[::1]:9000").unwrap().to_string(), "[::1]:9000");
        assert_eq!(
            parse_local("localhost:1").unwrap().to_string(),
            "127.0.0.1:1"
        );
        assert!(parse_local("x").is_err());
        assert!(parse_local("example.com:80").is_err());
        assert!(parse_local("127.0.0.1:70000").is_err());
    }

    #[test]
    fn proxy_server_addresses_are_host_and_port() {
        assert_eq!(
            parse_host_port("localhost:8090").unwrap(),
            ("localhost".into(), 8090)
        );
        assert_eq!(parse_host_port("[::1]:1").unwrap(), ("::1".into(), 1));
        assert!(parse_host_port("localhost").is_err());
        assert!(parse_host_port(":80").is_err());
        assert!(parse_host_port("a b:80").is_err());
    }
}
