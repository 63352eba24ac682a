//! mTLS gRPC channels with the HTTP/2 tuning every tunnel hop uses.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::transport::{Channel, Endpoint};

/// HTTP/2 receive windows of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpWindows {
    /// Bytes one stream may have in flight towards us.
    pub stream: u32,
    /// Bytes all streams together may have in flight towards us.
    pub connection: u32,
}

/// An agent's tunnel: one `Connect` stream carries every connection of the
/// tunnel, and per-connection fairness is enforced by [`crate::flow`], not
/// by HTTP/2, so the stream gets a large window.
pub const TUNNEL_WINDOWS: HttpWindows = HttpWindows {
    stream: 16 * 1024 * 1024,
    connection: 32 * 1024 * 1024,
};

/// A client's connection: one `Proxy` stream per tunneled connection, many
/// on one HTTP/2 connection. Bytes a stream's reader has not taken hold the
/// connection's window too, so the stream window is a small part of it:
/// twice what the agent's flow control lets through per round trip
/// ([`crate::flow::DEFAULT_WINDOW`]; one window measured 20 % slower for a
/// single download on loopback), and 32 streams whose readers stopped leave
/// the others room. (With 16 of 32 MiB, four stalled readers held the whole
/// window and no other connection on it, new dials included, moved.)
pub const CLIENT_WINDOWS: HttpWindows = HttpWindows {
    stream: 2 * crate::flow::DEFAULT_WINDOW,
    connection: 128 * 1024 * 1024,
};
/// Largest HTTP/2 frame our ends accept (SETTINGS_MAX_FRAME_SIZE; HTTP/2's
/// default is 16 KiB). With 16 KiB frames a 64 KiB DATA packet's payload
/// reached the receiver in four frames, which it then joined into one
/// buffer (a copy), and each frame with its 9-byte header was 9 bytes more
/// than a TLS record holds (rustls sealed a full record and a 9-byte one);
/// with larger frames the payload arrives in a frame of its own and is
/// decoded in place ([`crate::grpc_framing::ReceivedMessage`]).
/// Every HTTP/2 peer must honour the value it is sent, upstream's Go
/// peers included.
pub const MAX_FRAME_SIZE: u32 = 256 * 1024;
/// Largest gRPC message accepted. Upstream's limit is 4 MiB; we accept more
/// so a client that writes a large buffer in one DATA packet is not cut off.
pub const MAX_MESSAGE_SIZE: usize = 16 * 1024 * 1024;
pub use cluster_proxy_egress::tcp::{
    QuickAck, TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_INTERVAL, TCP_KEEPALIVE_RETRIES, acknowledge_now,
    set_tcp_keepalive,
};

/// ALPN protocol gRPC needs (grpc-go refuses TLS connections without it).
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN protocol HTTP CONNECT clients use.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("invalid server name {0:?}")]
    ServerName(String),
    #[error("invalid endpoint {address}: {source}")]
    Endpoint {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("connect to {address}: {source}")]
    Dial {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS with {address}: {source}")]
    Tls {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP/2 handshake with {address}: {source}")]
    Http2 {
        address: String,
        #[source]
        source: h2::Error,
    },
    #[error("connect to {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
}

/// Formats `host:port`, bracketing IPv6 literals.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The `host:port` to dial for `host` with or without IPv6 brackets.
pub(crate) fn dial_address(host: &str, port: u16) -> String {
    host_port(host.trim_start_matches('[').trim_end_matches(']'), port)
}

/// The name to verify the server's certificate against and the address to
/// dial, for `host` with or without IPv6 brackets.
fn server_name_and_address(
    host: &str,
    port: u16,
) -> Result<(ServerName<'static>, String), TransportError> {
    let bare_host = host.trim_start_matches('[').trim_end_matches(']');
    let server_name = ServerName::try_from(bare_host.to_owned())
        .map_err(|_| TransportError::ServerName(host.to_owned()))?;
    Ok((server_name, dial_address(host, port)))
}

/// Dials `address` over TCP (no delay, keepalive as [`set_tcp_keepalive`])
/// and completes the TLS handshake, all within `timeout`.
async fn dial_tls(
    address: &str,
    server_name: ServerName<'static>,
    connector: &TlsConnector,
    timeout: Duration,
) -> std::io::Result<TlsStream<TcpStream>> {
    tokio::time::timeout(timeout, async {
        let tcp = cluster_proxy_egress::tcp::connect(address).await?;
        connector.connect(server_name, tcp).await
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))?
}

/// An mTLS connection to `host:port` for a caller that speaks HTTP/2 itself
/// (the agent's tunnels); `tls` must offer ALPN `h2`.
pub async fn connect_tls(
    host: &str,
    port: u16,
    tls: Arc<rustls::ClientConfig>,
    connect_timeout: Duration,
) -> Result<TlsStream<TcpStream>, TransportError> {
    let (server_name, address) = server_name_and_address(host, port)?;
    dial_tls(
        &address,
        server_name,
        &TlsConnector::from(tls),
        connect_timeout,
    )
    .await
    .map_err(|source| TransportError::Dial { address, source })
}

/// The TLS handshake with `host:port` over `io`, a connection opened
/// already (straight to the server, or through a forward proxy's tunnel).
/// The server's certificate is verified against `tls` alone, whatever
/// carries the bytes.
pub async fn tls_over<IO>(
    io: IO,
    host: &str,
    port: u16,
    tls: Arc<rustls::ClientConfig>,
) -> Result<TlsStream<IO>, TransportError>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (server_name, address) = server_name_and_address(host, port)?;
    TlsConnector::from(tls)
        .connect(server_name, io)
        .await
        .map_err(|source| TransportError::Tls { address, source })
}

/// Opens a new HTTP/2 connection (never shared with other channels) to
/// `host:port` over mTLS, with a client's windows ([`CLIENT_WINDOWS`]). The
/// TLS config must offer ALPN `h2`.
pub async fn connect_channel(
    host: &str,
    port: u16,
    tls: Arc<rustls::ClientConfig>,
    connect_timeout: Duration,
) -> Result<Channel, TransportError> {
    connect_channel_with(host, port, tls, connect_timeout, CLIENT_WINDOWS, None).await
}

/// [`connect_channel`] with the given receive windows that also sends HTTP/2
/// pings every `keepalive` (even with no stream open) and drops the
/// connection when one goes unanswered for 20 s, so a peer that vanished
/// without closing is noticed.
pub async fn connect_channel_with(
    host: &str,
    port: u16,
    tls: Arc<rustls::ClientConfig>,
    connect_timeout: Duration,
    windows: HttpWindows,
    keepalive: Option<Duration>,
) -> Result<Channel, TransportError> {
    let (server_name, address) = server_name_and_address(host, port)?;
    let endpoint = Endpoint::from_shared(format!("http://{address}"))
        .map_err(|source| TransportError::Endpoint {
            address: address.clone(),
            source,
        })?
        .initial_stream_window_size(windows.stream)
        .initial_connection_window_size(windows.connection)
        .max_frame_size(MAX_FRAME_SIZE)
        .tcp_nodelay(true);
    let endpoint = match keepalive.filter(|k| !k.is_zero()) {
        Some(interval) => endpoint
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(true),
        None => endpoint,
    };
    let connector = TlsConnector::from(tls);
    let dial_address = address.clone();
    let connect = tower::service_fn(move |_uri: http::Uri| {
        let connector = connector.clone();
        let server_name = server_name.clone();
        let dial_address = dial_address.clone();
        async move {
            let io = dial_tls(&dial_address, server_name, &connector, connect_timeout).await?;
            Ok::<_, std::io::Error>(TokioIo::new(io))
        }
    });
    endpoint
        .connect_with_connector(connect)
        .await
        .map_err(|source| TransportError::Connect { address, source })
}
