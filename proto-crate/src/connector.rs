//! A hyper / tower connector that dials through the tunnel.
//!
//! [`TunnelConnector`] is a `tower::Service<http::Uri>`: for `https://<cluster>:<port>/…`
//! it opens one `ProxyService.Proxy` stream to `<cluster>:<port>` through one
//! proxy-server (one stream per connection) and returns the stream as hyper
//! IO. TLS to the target is the client's job: wrap the connector in a TLS
//! connector (for `kube::Client`, [`kube_client`] (feature `kube-api`) lets
//! kube put its own rustls on top, exactly as for a direct connection).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;

use crate::client::{TunnelClient, TunnelStream};
pub use crate::dial_error::ConnectError;

impl Connection for TunnelStream {
    fn connected(&self) -> Connected {
        // Not `proxy(true)`: that would make hyper send absolute-form request
        // targets, as to an HTTP proxy; the tunnel is a plain TCP connection
        // to the target, like one after CONNECT.
        Connected::new()
    }
}

/// Dials `host:port` of a request's URI through one proxy-server.
#[derive(Clone, Debug)]
pub struct TunnelConnector {
    client: TunnelClient,
    connect_timeout: Duration,
    early_data: bool,
}

impl TunnelConnector {
    /// A connector over `client`; `connect_timeout` bounds opening the stream
    /// and waiting for the agent's dial response together.
    pub fn new(client: TunnelClient, connect_timeout: Duration) -> Self {
        TunnelConnector {
            client,
            connect_timeout,
            early_data: false,
        }
    }

    /// Returns each connection at once and dials with its first write
    /// ([`TunnelClient::dial_lazily`]): a TLS ClientHello or an HTTP
    /// request rides in the dial request, which saves one round trip
    /// through the tunnel per new connection (a WAN round trip when the
    /// cluster is far from the hub). The price: a failed dial is not
    /// returned by the connector but is the I/O error of the connection's
    /// first read or write (kind `ConnectionRefused` or `TimedOut`), which
    /// hyper and kube report as a failed request; the `io::Error`'s inner
    /// error is the [`ConnectError`], which [`ConnectError::find_in`] finds
    /// in the request's error.
    pub fn with_early_data(mut self) -> Self {
        self.early_data = true;
        self.client = self.client.with_dial_timeout(self.connect_timeout);
        self
    }

    /// Opens a tunneled connection to `uri`'s host and port (the scheme's
    /// default port when it names none).
    pub async fn connect(&self, uri: &http::Uri) -> Result<TunnelStream, ConnectError> {
        if self.early_data {
            return Ok(self.client.dial_lazily(&target_address(uri)?));
        }
        self.connect_with_early_data(uri, bytes::Bytes::new()).await
    }

    /// [`TunnelConnector::connect`], sending `first` (the connection's first
    /// bytes, already read from its client) with the dial request
    /// ([`TunnelClient::dial_with_early_data`]); dial failures are
    /// [`ConnectError`]s as usual.
    pub async fn connect_with_early_data(
        &self,
        uri: &http::Uri,
        first: bytes::Bytes,
    ) -> Result<TunnelStream, ConnectError> {
        let address = target_address(uri)?;
        let dial = self.client.dial_with_early_data(&address, first);
        match tokio::time::timeout(self.connect_timeout, dial).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(error)) => Err(ConnectError::from_dial(address, error)),
            Err(_) => Err(ConnectError::Timeout {
                address,
                after: self.connect_timeout,
            }),
        }
    }
}

/// `host:port` for a URI, checking the host is a DNS name or an IP address.
pub fn target_address(uri: &http::Uri) -> Result<String, ConnectError> {
    let invalid = |reason| ConnectError::InvalidTarget {
        uri: uri.to_string(),
        reason,
    };
    let host = uri.host().ok_or_else(|| invalid("no host"))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let is_ip = bare.parse::<std::net::IpAddr>().is_ok();
    if !is_ip && !is_dns_name(bare) {
        return Err(invalid(
            "the host is neither an IP address nor a DNS name of DNS-1123 labels",
        ));
    }
    let port = match uri.port_u16() {
        Some(port) => port,
        None => match uri.scheme_str() {
            Some("https") | None => 443,
            Some("http") => 80,
            Some(_) => return Err(invalid("unknown scheme and no port")),
        },
    };
    Ok(crate::transport::host_port(bare, port))
}

fn is_dns_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host
            .split('.')
            .all(|label| crate::identity::is_dns1123_label(&label.to_ascii_lowercase()))
}

type ConnectFuture =
    Pin<Box<dyn Future<Output = Result<TokioIo<TunnelStream>, ConnectError>> + Send>>;

impl tower::Service<http::Uri> for TunnelConnector {
    type Response = TokioIo<TunnelStream>;
    type Error = ConnectError;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Every call opens its own stream on the shared HTTP/2 connection.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = self.clone();
        Box::pin(async move { connector.connect(&uri).await.map(TokioIo::new) })
    }
}

/// A `kube::Client` for `config` (its `cluster_url` naming the managed
/// cluster, e.g. `https://cluster1:443`) whose connections go through
/// `connector`. kube's own rustls (from `config`: CA, client certificate,
/// `accept_invalid_certs`, `tls_server_name`) runs on top of the tunnel, and
/// its authentication layer (token, exec) applies as usual.
#[cfg(feature = "kube-api")]
pub fn kube_client(
    config: &kube::Config,
    connector: TunnelConnector,
) -> Result<kube::Client, kube::Error> {
    use kube::client::ConfigExt;
    use tower::ServiceBuilder;

    let https = config.rustls_https_connector_with_connector(connector)?;
    let http: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(http);
    Ok(kube::Client::new(service, config.default_namespace.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dial_error::{DialError, NO_AGENT};

    fn address(uri: &str) -> Result<String, ConnectError> {
        target_address(&uri.parse().expect("test URIs parse"))
    }

    #[test]
    fn the_target_address_defaults_the_port_by_scheme() {
        assert_eq!(address("https://cluster1").unwrap(), "cluster1:443");
        assert_eq!(address("http://svc.ns").unwrap(), "svc.ns:80");
        assert_eq!(address("https://cluster1:6443/x").unwrap(), "cluster1:6443");
        assert_eq!(address("https://[::1]:8443").unwrap(), "[::1]:8443");
        assert_eq!(address("https://127.0.0.1").unwrap(), "127.0.0.1:443");
    }

    #[test]
    fn a_host_that_is_not_a_dns_name_is_refused_before_dialing() {
        for bad in ["https://Bad_Name:443", "https://-x:443", "https://a..b:443"] {
            let error = address(bad).expect_err(bad);
            assert!(
                matches!(error, ConnectError::InvalidTarget { .. }),
                "{bad}: {error}"
            );
        }
        assert!(matches!(
            address("/relative"),
            Err(ConnectError::InvalidTarget { .. })
        ));
    }

    #[test]
    fn dial_errors_map_to_what_the_user_can_act_on() {
        let no_agent = ConnectError::from_dial("c:443".into(), DialError::Refused(NO_AGENT.into()));
        assert!(
            matches!(no_agent, ConnectError::NoAgent { .. }),
            "{no_agent}"
        );
        let refused = ConnectError::from_dial(
            "c:443".into(),
            DialError::Refused("connect: connection refused".into()),
        );
        assert!(
            refused.to_string().contains("connection refused"),
            "{refused}"
        );
        let timeout =
            ConnectError::from_dial("c:443".into(), DialError::Timeout(Duration::from_secs(1)));
        assert!(matches!(timeout, ConnectError::Timeout { .. }), "{timeout}");
    }

    /// An error with a source, as hyper and TLS libraries wrap theirs.
    #[derive(Debug, thiserror::Error)]
    #[error("request failed")]
    struct Wrapper(#[source] Box<dyn std::error::Error + Send + Sync>);

    #[test]
    fn a_connect_error_is_found_inside_io_errors_and_wrappers() {
        let refused = ConnectError::from_dial(
            "c:443".into(),
            DialError::Refused("connect: connection refused".into()),
        );
        let io = std::io::Error::new(refused.io_kind(), refused.clone());
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        let wrapped = Wrapper(Box::new(Wrapper(Box::new(io))));
        let found = ConnectError::find_in(&wrapped).expect("found through two wrappers");
        assert!(
            matches!(found, ConnectError::Refused { address, .. } if address == "c:443"),
            "{found}"
        );
        let direct = Wrapper(Box::new(ConnectError::NoAgent {
            address: "c:443".into(),
        }));
        assert!(matches!(
            ConnectError::find_in(&direct),
            Some(ConnectError::NoAgent { .. })
        ));
        let other = Wrapper(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset by peer",
        )));
        assert!(ConnectError::find_in(&other).is_none());
    }
}
