//! One gRPC channel per proxy-server replica, (re)connected lazily so that a
//! replica that is down at start, or comes back, is probed again.

use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::connector::TunnelConnector;
use cluster_proxy_proto::h2_channel::H2Channel;
use cluster_proxy_runtime::reload::Watched;
use tokio::sync::Mutex;
use tokio::time::Instant;

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

/// How long a replica that could not be reached is reported down without
/// trying again: a replica that is down (or black-holed) must not cost every
/// cluster's probe a connect timeout.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

enum State {
    Idle,
    Connected {
        connector: TunnelConnector,
        tls: Arc<rustls::ClientConfig>,
    },
    Down {
        since: Instant,
        error: String,
    },
}

/// Why a replica cannot be used right now.
#[derive(Debug, Clone, thiserror::Error)]
#[error("replica unavailable: {0}")]
pub struct Unavailable(pub String);

/// A proxy-server replica, named by its client address.
pub struct Replica {
    address: String,
    host: String,
    port: u16,
    tls: Watched<rustls::ClientConfig>,
    state: Mutex<State>,
}

impl Replica {
    pub fn new(address: &str, tls: Watched<rustls::ClientConfig>) -> Result<Self, AddressError> {
        let (host, port) = split_address(address)?;
        Ok(Replica {
            address: address.to_owned(),
            host,
            port,
            tls,
            state: Mutex::new(State::Idle),
        })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// A connector over this replica's channel, connecting first when there
    /// is none yet or the client credentials changed on disk; fails at once
    /// for [`RETRY_AFTER`] after the replica was found down.
    pub async fn connector(&self, timeout: Duration) -> Result<TunnelConnector, Unavailable> {
        let tls = self.tls.borrow().clone();
        let mut state = self.state.lock().await;
        match &*state {
            State::Connected {
                connector,
                tls: used,
            } if Arc::ptr_eq(used, &tls) => return Ok(connector.clone()),
            State::Down { since, error } if since.elapsed() < RETRY_AFTER => {
                return Err(Unavailable(error.clone()));
            }
            _ => {}
        }
        match H2Channel::connect(&self.host, self.port, tls.clone(), timeout).await {
            Ok(channel) => {
                let connector = TunnelConnector::new(
                    TunnelClient::over_h2(channel).with_dial_timeout(timeout),
                    timeout,
                );
                *state = State::Connected {
                    connector: connector.clone(),
                    tls,
                };
                Ok(connector)
            }
            Err(error) => {
                let error = error.to_string();
                *state = State::Down {
                    since: Instant::now(),
                    error: error.clone(),
                };
                Err(Unavailable(error))
            }
        }
    }

    /// Records that the replica failed as a whole (its gRPC stream, not one
    /// cluster's dial): the next probes fail at once, and then reconnect.
    pub async fn mark_down(&self, error: String) {
        *self.state.lock().await = State::Down {
            since: Instant::now(),
            error,
        };
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
