//! One gRPC channel per proxy-server replica, (re)connected lazily so that a
//! replica that is down at start, or comes back, is probed again.

use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::connector::TunnelConnector;
use cluster_proxy_proto::transport::{TransportError, connect_channel};
use cluster_proxy_runtime::reload::Watched;
use tokio::sync::Mutex;

#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    #[error("{0:?} is not host:port")]
    NotHostPort(String),
    #[error("{0:?} has no valid port")]
    Port(String),
}

/// Splits `host:port` (IPv6 hosts bracketed).
pub fn split_address(address: &str) -> Result<(String, u16), AddressError> {
    let (host, port) = address
        .rsplit_once(':')
        .ok_or_else(|| AddressError::NotHostPort(address.to_owned()))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(AddressError::NotHostPort(address.to_owned()));
    }
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| AddressError::Port(address.to_owned()))?;
    Ok((host.to_owned(), port))
}

struct Connected {
    connector: TunnelConnector,
    tls: Arc<rustls::ClientConfig>,
}

/// A proxy-server replica, named by its client address.
pub struct Replica {
    address: String,
    host: String,
    port: u16,
    tls: Watched<rustls::ClientConfig>,
    connected: Mutex<Option<Connected>>,
}

impl Replica {
    pub fn new(address: &str, tls: Watched<rustls::ClientConfig>) -> Result<Self, AddressError> {
        let (host, port) = split_address(address)?;
        Ok(Replica {
            address: address.to_owned(),
            host,
            port,
            tls,
            connected: Mutex::new(None),
        })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// A connector over this replica's channel, connecting first when there
    /// is none yet or the client credentials changed on disk.
    pub async fn connector(&self, timeout: Duration) -> Result<TunnelConnector, TransportError> {
        let tls = self.tls.borrow().clone();
        let mut connected = self.connected.lock().await;
        if let Some(current) = connected.as_ref()
            && Arc::ptr_eq(&current.tls, &tls)
        {
            return Ok(current.connector.clone());
        }
        let channel = connect_channel(&self.host, self.port, tls.clone(), timeout).await?;
        let connector = TunnelConnector::new(
            TunnelClient::new(channel).with_dial_timeout(timeout),
            timeout,
        );
        *connected = Some(Connected {
            connector: connector.clone(),
            tls,
        });
        Ok(connector)
    }

    /// Drops the channel so the next probe reconnects (after the replica
    /// failed in a way a new connection may fix).
    pub async fn reset(&self) {
        *self.connected.lock().await = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_split_into_host_and_port() {
        assert_eq!(
            split_address("127.0.0.1:8090").unwrap(),
            ("127.0.0.1".into(), 8090)
        );
        assert_eq!(split_address("[::1]:1").unwrap(), ("::1".into(), 1));
        assert!(split_address("host").is_err());
        assert!(split_address("host:0").is_err());
        assert!(split_address(":80").is_err());
        assert!(split_address("host:http").is_err());
    }
}
