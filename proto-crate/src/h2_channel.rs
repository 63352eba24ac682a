//! An HTTP/2 connection to a proxy-server's client port for
//! [`crate::client::TunnelClient`], on `h2` directly.
//!
//! tonic's `Channel` (hyper) runs every request body in a task of its own,
//! so each write to a tunneled connection went from the writer's task to
//! that body's task and then to the connection's. Here the writer frames its
//! packets into the HTTP/2 stream itself; one task per connection reads and
//! writes the socket and keeps it alive with pings. As a `Channel`, it
//! connects when made and again, on the next dial, once its connection
//! closed (a server restarting, a GOAWAY, a keepalive ping unanswered).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tonic::Status;
use tracing::debug;

use crate::Packet;
use crate::grpc_framing::{Direction, PacketStream, check_response_head, encode};
use crate::h2_driver::{KeepAlive, RecvBody, grpc_request, h2_status, poll_send_capacity};
use crate::transport::{
    CLIENT_WINDOWS, HttpWindows, MAX_FRAME_SIZE, MAX_MESSAGE_SIZE, TransportError, connect_tls,
    dial_address,
};

/// What hyper buffers per stream beyond the peer's window (its default).
const MAX_SEND_BUFFER: usize = 1024 * 1024;

/// A connection to one proxy-server, shared by every dial of the clients
/// cloned from it; see the module docs.
#[derive(Clone)]
pub struct H2Channel {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for H2Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Channel")
            .field("address", &self.shared.settings.address)
            .finish_non_exhaustive()
    }
}

struct Shared {
    settings: Settings,
    current: tokio::sync::Mutex<Current>,
}

/// Where and how to connect.
struct Settings {
    host: String,
    port: u16,
    /// `host:port`, the requests' authority.
    address: String,
    tls: Arc<rustls::ClientConfig>,
    connect_timeout: Duration,
    windows: HttpWindows,
    keepalive: Option<Duration>,
}

/// The connection dials are opened on.
struct Current {
    /// Counts reconnections, so callers that all found the same connection
    /// closed replace it once.
    generation: u64,
    connection: Connection,
}

#[derive(Clone)]
struct Connection {
    requests: h2::client::SendRequest<Bytes>,
    /// Chunks received, for the keepalive.
    heard: Arc<AtomicU64>,
}

impl H2Channel {
    /// Connects to `host:port` over mTLS with a client's windows
    /// ([`CLIENT_WINDOWS`]); `tls` must offer ALPN `h2`.
    pub async fn connect(
        host: &str,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
        connect_timeout: Duration,
    ) -> Result<Self, TransportError> {
        Self::connect_with(host, port, tls, connect_timeout, CLIENT_WINDOWS, None).await
    }

    /// [`H2Channel::connect`] with the given receive windows, sending
    /// HTTP/2 pings after `keepalive` without a frame from the server (even
    /// with no dial open) and dropping a connection whose ping goes
    /// unanswered for 20 s.
    pub async fn connect_with(
        host: &str,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
        connect_timeout: Duration,
        windows: HttpWindows,
        keepalive: Option<Duration>,
    ) -> Result<Self, TransportError> {
        let settings = Settings {
            host: host.to_owned(),
            port,
            address: dial_address(host, port),
            tls,
            connect_timeout,
            windows,
            keepalive: keepalive.filter(|k| !k.is_zero()),
        };
        let connection = settings.open().await?;
        Ok(H2Channel {
            shared: Arc::new(Shared {
                settings,
                current: tokio::sync::Mutex::new(Current {
                    generation: 0,
                    connection,
                }),
            }),
        })
    }

    /// Opens a `path` stream with `headers` and sends `first` on it;
    /// returns the stream's sender and, once the server answered with its
    /// headers, the packets it sends.
    ///
    /// A stream the server did not take — refused by its GOAWAY (it is
    /// shutting down: the stream's id is above the last it processed) or
    /// with REFUSED_STREAM — never reached the server's handler, so it is
    /// opened once more (RFC 9113 §8.7), on a new connection: after a
    /// GOAWAY the old one takes no more streams, and a server that refused
    /// one stream may refuse the next on it too. Without that, a dial
    /// racing a server's graceful shutdown would fail although another
    /// connection would take it at once.
    pub(crate) async fn open_stream(
        &self,
        path: &str,
        headers: http::HeaderMap,
        first: &Packet,
    ) -> Result<(StreamSender, PacketStream<tonic::body::Body>), Status> {
        let request = grpc_request(
            &format!("https://{}{path}", self.shared.settings.address),
            headers,
            concat!("cluster-proxy-client/", env!("CARGO_PKG_VERSION")),
        )
        .map_err(|e| Status::internal(format!("request for {path}: {e}")))?;
        // The generation of a connection that did not take the stream.
        let mut refused_on = None;
        loop {
            let (generation, connection) = self.ready(refused_on).await?;
            match Self::open_on(connection, request.clone(), first).await {
                Ok(opened) => return Ok(opened),
                Err(Attempt::Failed(status)) => return Err(status),
                Err(Attempt::NotTaken(error)) if refused_on.is_none() => {
                    debug!(
                        address = self.shared.settings.address,
                        %error,
                        "the server did not take the stream; opening it again on a new connection"
                    );
                    refused_on = Some(generation);
                }
                Err(Attempt::NotTaken(error)) => return Err(h2_status(error)),
            }
        }
    }

    async fn open_on(
        connection: Connection,
        request: http::Request<()>,
        first: &Packet,
    ) -> Result<(StreamSender, PacketStream<tonic::body::Body>), Attempt> {
        let mut requests = connection.requests;
        // Nothing was sent when this fails.
        let (response, send) = requests
            .send_request(request, false)
            .map_err(Attempt::NotTaken)?;
        let mut sender = StreamSender { send };
        sender.send(first).map_err(Attempt::Failed)?;
        let response = response.await.map_err(|e| {
            if not_taken(&e) {
                Attempt::NotTaken(e)
            } else {
                Attempt::Failed(h2_status(e))
            }
        })?;
        let (head, recv) = response.into_parts();
        check_response_head(head.status, &head.headers).map_err(Attempt::Failed)?;
        let body = tonic::body::Body::new(RecvBody::counted(recv, connection.heard));
        Ok((
            sender,
            PacketStream::new(body, Direction::Response, MAX_MESSAGE_SIZE),
        ))
    }

    /// A connection ready for a new stream, with its generation: the
    /// current one, or a new one when it closed or is the `stale`
    /// generation (it is going away).
    async fn ready(&self, stale: Option<u64>) -> Result<(u64, Connection), Status> {
        let (generation, connection) = {
            let current = self.shared.current.lock().await;
            (current.generation, current.connection.clone())
        };
        if stale != Some(generation) {
            let heard = connection.heard.clone();
            match connection.requests.ready().await {
                Ok(requests) => return Ok((generation, Connection { requests, heard })),
                Err(e) => {
                    debug!(address = self.shared.settings.address, error = %e, "connection closed; reconnecting")
                }
            }
        }
        let (generation, connection) = {
            let mut current = self.shared.current.lock().await;
            if current.generation == generation {
                current.connection = self
                    .shared
                    .settings
                    .open()
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
                current.generation += 1;
            }
            (current.generation, current.connection.clone())
        };
        let heard = connection.heard.clone();
        let requests = connection.requests.ready().await.map_err(h2_status)?;
        Ok((generation, Connection { requests, heard }))
    }
}

/// How an attempt to open a stream failed.
enum Attempt {
    /// The server did not take the stream: opening it again is safe.
    NotTaken(h2::Error),
    Failed(Status),
}

/// Whether the server refused a stream without processing it: above the
/// last stream id of its GOAWAY, or reset with REFUSED_STREAM.
fn not_taken(e: &h2::Error) -> bool {
    e.is_remote()
        && (e.is_go_away() || (e.is_reset() && e.reason() == Some(h2::Reason::REFUSED_STREAM)))
}

impl Settings {
    /// Connects and starts the connection's task.
    async fn open(&self) -> Result<Connection, TransportError> {
        let tls = connect_tls(
            &self.host,
            self.port,
            self.tls.clone(),
            self.connect_timeout,
        )
        .await?;
        let http2 = |source| TransportError::Http2 {
            address: self.address.clone(),
            source,
        };
        let handshake = h2::client::Builder::new()
            .initial_window_size(self.windows.stream)
            .initial_connection_window_size(self.windows.connection)
            .max_frame_size(MAX_FRAME_SIZE)
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .enable_push(false)
            .handshake::<_, Bytes>(tls);
        let (requests, mut conn) = tokio::time::timeout(self.connect_timeout, handshake)
            .await
            .map_err(|_| TransportError::Dial {
                address: self.address.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "HTTP/2 handshake timed out",
                ),
            })?
            .map_err(http2)?;
        let heard = Arc::new(AtomicU64::new(0));
        let mut keepalive = self
            .keepalive
            .zip(conn.ping_pong())
            .map(|(interval, ping_pong)| KeepAlive::new(interval, ping_pong));
        let counted = heard.clone();
        let address = self.address.clone();
        tokio::spawn(async move {
            let ended = std::future::poll_fn(|cx: &mut Context<'_>| {
                if let Some(keepalive) = keepalive.as_mut()
                    && let Err(status) = keepalive.poll(cx, counted.load(Ordering::Relaxed))
                {
                    return Poll::Ready(Err(status));
                }
                std::pin::Pin::new(&mut conn).poll(cx).map_err(h2_status)
            })
            .await;
            if let Err(status) = ended {
                debug!(address, error = %status.message(), "connection to the proxy-server ended");
            }
        });
        Ok(Connection { requests, heard })
    }
}

/// Our side of a stream: packets are framed into it by the caller's task.
/// Dropping it ends the stream (END_STREAM), as the end of a request body.
pub(crate) struct StreamSender {
    send: h2::SendStream<Bytes>,
}

impl StreamSender {
    /// Ready once the stream has window for another packet (h2 buffers a
    /// packet beyond it, as hyper does, up to [`MAX_SEND_BUFFER`]).
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        poll_send_capacity(&mut self.send, cx)
    }

    /// Frames `packet` into the stream, window or not.
    pub(crate) fn send(&mut self, packet: &Packet) -> Result<(), Status> {
        let encoded = encode(packet, MAX_MESSAGE_SIZE)?;
        self.send
            .send_data(encoded.head, false)
            .map_err(h2_status)?;
        if let Some(payload) = encoded.payload {
            self.send.send_data(payload, false).map_err(h2_status)?;
        }
        Ok(())
    }
}

impl Drop for StreamSender {
    fn drop(&mut self) {
        // Fails only on a stream already closed or reset.
        let _ = self.send.send_data(Bytes::new(), true);
    }
}
