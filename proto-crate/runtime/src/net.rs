//! Binding listeners, with errors that say which port could not be bound.

use std::net::SocketAddr;

use tokio::net::TcpListener;

pub use cluster_proxy_proto::transport::{
    TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_INTERVAL, TCP_KEEPALIVE_RETRIES, set_tcp_keepalive,
};

#[derive(Debug, thiserror::Error)]
#[error("bind {what} {address}: {source}")]
pub struct BindError {
    pub what: &'static str,
    pub address: String,
    #[source]
    pub source: std::io::Error,
}

/// `host:port` to listen on; an empty host is every IPv4 address, as
/// upstream's empty `--*-bind-address` means.
pub fn listen_address(host: &str, port: u16) -> String {
    let host = if host.is_empty() { "0.0.0.0" } else { host };
    cluster_proxy_proto::transport::host_port(host, port)
}

/// Binds `what` (e.g. "health port") on `host:port`; returns the listener and
/// the address it got (port 0 picks a free one).
pub async fn bind(
    what: &'static str,
    host: &str,
    port: u16,
) -> Result<(TcpListener, SocketAddr), BindError> {
    let address = listen_address(host, port);
    let error = |source| BindError {
        what,
        address: address.clone(),
        source,
    };
    let listener = TcpListener::bind(&address).await.map_err(error)?;
    let local = listener.local_addr().map_err(error)?;
    Ok((listener, local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_hosts_listen_everywhere_and_ipv6_is_bracketed() {
        assert_eq!(listen_address("", 8092), "0.0.0.0:8092");
        assert_eq!(listen_address("::1", 8092), "[::1]:8092");
        assert_eq!(listen_address("127.0.0.1", 0), "127.0.0.1:0");
    }

    #[tokio::test]
    async fn keepalive_is_set_with_the_documented_timing() {
        let (listener, address) = bind("test", "127.0.0.1", 0).await.unwrap();
        let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
        let _accepted = listener.accept().await.unwrap();
        let socket = socket2::SockRef::from(&tcp);
        assert!(!socket.keepalive().unwrap(), "off by default");
        set_tcp_keepalive(&tcp).unwrap();
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), TCP_KEEPALIVE_IDLE);
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            TCP_KEEPALIVE_INTERVAL
        );
        assert_eq!(
            socket.tcp_keepalive_retries().unwrap(),
            TCP_KEEPALIVE_RETRIES
        );
    }

    #[tokio::test]
    async fn a_taken_port_names_what_failed() {
        let (_held, address) = bind("health port", "127.0.0.1", 0).await.unwrap();
        let err = bind("health port", "127.0.0.1", address.port())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("health port") && err.contains(&address.to_string()),
            "{err}"
        );
        assert!(bind("admin port", "not an address", 1).await.is_err());
    }
}
