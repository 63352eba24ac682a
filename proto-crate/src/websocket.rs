//! The tunnel over a WebSocket: for networks whose middleboxes (TLS
//! inspection, L7 load balancers) strip ALPN or speak only HTTP/1.1, so
//! that neither HTTP/2 nor the lean framing's ALPN gets through.
//!
//! The agent opens the call with an HTTP/1.1 `GET` upgrade on
//! [`TUNNEL_PATH`] (subprotocol [`SUBPROTOCOL`]) whose headers carry the
//! call's metadata, as the lean framing's hello does; the server's `101`
//! answer stands for the hello, and from then on both ends speak the lean
//! framing ([`crate::framed`]) inside binary messages. [`WebSocketIo`]
//! presents the WebSocket as a byte stream so the framing's reader and
//! writer run on it unchanged: each write is one binary message, reads
//! join the messages' payloads, pings are answered, a close is the end.
//!
//! Middleboxes drop connections that stay idle for 60–350 s, and a quiet
//! tunnel is idle for hours: the agent's [`WebSocketIo`] sends a WebSocket
//! ping every heartbeat interval, and fails once nothing was heard for
//! [`MISSED_HEARTBEATS`] intervals (the peer's pong counts, as does any
//! message).

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Sink, Stream};
use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Message};

/// Where the agent port takes the WebSocket upgrade.
pub const TUNNEL_PATH: &str = "/cluster-proxy/tunnel/v1";

/// The `Sec-WebSocket-Protocol` both ends name: the lean framing inside
/// binary messages.
pub const SUBPROTOCOL: &str = "cluster-proxy-tunnel.v1";

/// The largest message a peer may send. Our writers send at most
/// [`MAX_WRITE_LEN`]; the rest is headroom, not an invitation.
pub const MAX_MESSAGE_LEN: usize = 1024 * 1024;

/// The most one write puts into one message; a longer write is taken in
/// part (the framing's writer writes the rest next).
pub const MAX_WRITE_LEN: usize = 256 * 1024;

/// The agent's default heartbeat interval (`--websocket-heartbeat`).
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(30);

/// Intervals without a word from the peer after which the connection is
/// taken for dead.
pub const MISSED_HEARTBEATS: u32 = 3;

/// The upgrade's own headers, which are not the call's metadata.
const UPGRADE_HEADERS: [&str; 10] = [
    "host",
    "connection",
    "upgrade",
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-protocol",
    "sec-websocket-extensions",
    "content-length",
    "transfer-encoding",
    "keep-alive",
];

fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE_LEN))
        .max_frame_size(Some(MAX_MESSAGE_LEN))
}

/// Why the WebSocket upgrade failed.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// The server, or a middlebox on the way, answered with something
    /// other than `101 Switching Protocols` (an old server: 404; a load
    /// balancer without a backend: 502).
    #[error("the WebSocket upgrade was answered with HTTP {status}{}", body_suffix(.body))]
    Refused { status: StatusCode, body: String },
    /// No HTTP/1.1 answer at all (a server that speaks only HTTP/2), or
    /// one that is not a valid upgrade.
    #[error("WebSocket upgrade: {0}")]
    Handshake(#[source] Box<tungstenite::Error>),
}

fn body_suffix(body: &str) -> String {
    if body.is_empty() {
        String::new()
    } else {
        format!(": {body}")
    }
}

/// The start of a refusal's body, as one printable line.
fn describe_body(body: &[u8]) -> String {
    const SHOWN: usize = 200;
    let text = String::from_utf8_lossy(&body[..body.len().min(SHOWN)]);
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Upgrades `io` (a TLS connection to `authority`) to the tunnel's
/// WebSocket, sending `metadata` as the request's headers; returns the
/// byte stream and the `101` answer's headers. With `heartbeat`, pings go
/// out every interval and reads fail once the server was silent for
/// [`MISSED_HEARTBEATS`] of them.
pub async fn connect<S>(
    io: S,
    authority: &str,
    metadata: HeaderMap,
    heartbeat: Option<Duration>,
) -> Result<(WebSocketIo<S>, HeaderMap), UpgradeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let handshake = |e: tungstenite::Error| UpgradeError::Handshake(Box::new(e));
    let mut request = format!("wss://{authority}{TUNNEL_PATH}")
        .into_client_request()
        .map_err(handshake)?;
    let headers = request.headers_mut();
    headers.insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(SUBPROTOCOL),
    );
    for (name, value) in &metadata {
        if !UPGRADE_HEADERS.contains(&name.as_str()) {
            headers.append(name, value.clone());
        }
    }
    let (ws, response) = tokio_tungstenite::client_async_with_config(request, io, Some(config()))
        .await
        .map_err(|e| match e {
            tungstenite::Error::Http(response) => UpgradeError::Refused {
                status: response.status(),
                body: response
                    .body()
                    .as_deref()
                    .map(describe_body)
                    .unwrap_or_default(),
            },
            other => handshake(other),
        })?;
    Ok((WebSocketIo::new(ws, heartbeat), response.headers().clone()))
}

/// The server's side of an upgrade it answered with `101`: `io` is the
/// connection after the answer.
pub async fn accept<S>(io: S) -> WebSocketIo<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    WebSocketIo::new(
        WebSocketStream::from_raw_socket(io, Role::Server, Some(config())).await,
        None,
    )
}

/// `Sec-WebSocket-Accept` for a request's `Sec-WebSocket-Key`.
pub fn accept_key(request_key: &[u8]) -> String {
    tungstenite::handshake::derive_accept_key(request_key)
}

/// The call's metadata in an upgrade request's headers: all but the
/// upgrade's own.
pub fn call_metadata(request_headers: &HeaderMap) -> HeaderMap {
    let mut metadata = request_headers.clone();
    for name in UPGRADE_HEADERS {
        metadata.remove(name);
    }
    metadata
}

/// Whether a comma-separated header (`Connection`, `Upgrade`,
/// `Sec-WebSocket-Protocol`) lists `token`, in any case.
pub fn lists_token(headers: &HeaderMap, name: http::header::HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|value| {
        value.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|item| item.trim().eq_ignore_ascii_case(token))
        })
    })
}

fn io_error(e: tungstenite::Error) -> io::Error {
    match e {
        tungstenite::Error::Io(e) => e,
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "the WebSocket is closed")
        }
        e @ (tungstenite::Error::Capacity(_) | tungstenite::Error::Protocol(_)) => {
            io::Error::new(io::ErrorKind::InvalidData, format!("WebSocket: {e}"))
        }
        other => io::Error::other(format!("WebSocket: {other}")),
    }
}

/// Pings on a schedule, and the silence that ends the connection.
#[derive(Debug)]
struct Heartbeat {
    interval: Duration,
    timer: Pin<Box<Sleep>>,
    next_ping: Instant,
    last_heard: Instant,
    pings: u64,
}

impl Heartbeat {
    fn new(interval: Duration) -> Self {
        let now = Instant::now();
        Heartbeat {
            interval,
            timer: Box::pin(tokio::time::sleep_until(now + interval)),
            next_ping: now + interval,
            last_heard: now,
            pings: 0,
        }
    }

    fn silence_limit(&self) -> Duration {
        self.interval * MISSED_HEARTBEATS
    }
}

/// Wakes the reader that started a flush and the writer, whose own
/// flushes wait on the same connection: tokio-tungstenite keeps one waker
/// for all writing, and a flush the reading half started must not take
/// the writing half's place there.
struct BothWakers {
    reader: Waker,
    writer: Option<Waker>,
}

impl Wake for BothWakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.reader.wake_by_ref();
        if let Some(writer) = &self.writer {
            writer.wake_by_ref();
        }
    }
}

/// A WebSocket as a byte stream (see the module's documentation).
pub struct WebSocketIo<S> {
    ws: WebSocketStream<S>,
    /// What is left of the newest binary message.
    incoming: Bytes,
    /// The peer closed (or the connection ended): reads see the end.
    read_ended: bool,
    heartbeat: Option<Heartbeat>,
    /// The newest waker of a write, flush or shutdown.
    writer: Option<Waker>,
    /// A ping is queued but not yet flushed.
    flush_owed: bool,
}

impl<S> std::fmt::Debug for WebSocketIo<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebSocketIo")
            .field("incoming", &self.incoming.len())
            .field("read_ended", &self.read_ended)
            .field("heartbeat", &self.heartbeat.as_ref().map(|h| h.interval))
            .finish_non_exhaustive()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> WebSocketIo<S> {
    /// `ws` as a byte stream; with `heartbeat`, pinging every interval.
    pub fn new(ws: WebSocketStream<S>, heartbeat: Option<Duration>) -> Self {
        WebSocketIo {
            ws,
            incoming: Bytes::new(),
            read_ended: false,
            heartbeat: heartbeat.filter(|i| !i.is_zero()).map(Heartbeat::new),
            writer: None,
            flush_owed: false,
        }
    }

    /// The connection underneath.
    pub fn get_ref(&self) -> &S {
        self.ws.get_ref()
    }

    fn note_writer(&mut self, cx: &Context<'_>) {
        match &self.writer {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => self.writer = Some(cx.waker().clone()),
        }
    }

    /// Reads messages until one has payload; `Pending` when none is there.
    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.incoming.is_empty() && !self.read_ended {
            let next = ready!(Pin::new(&mut self.ws).poll_next(cx));
            if let (Some(heartbeat), Some(Ok(_))) = (&mut self.heartbeat, &next) {
                heartbeat.last_heard = Instant::now();
            }
            match next {
                Some(Ok(Message::Binary(data))) => self.incoming = data,
                // tungstenite queued the pong; it goes out with the next read or flush.
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "WebSocket: a text message; the tunnel carries binary messages only",
                    )));
                }
                Some(Ok(Message::Close(_))) | None => self.read_ended = true,
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Pings when one is due and arms the timer for the next (it wakes
    /// `cx`); fails once the peer was silent too long.
    fn poll_heartbeat(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        loop {
            let Some(heartbeat) = &mut self.heartbeat else {
                return Ok(());
            };
            let now = Instant::now();
            let silent_until = heartbeat.last_heard + heartbeat.silence_limit();
            if now >= silent_until {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "WebSocket heartbeat: nothing heard from the peer for {:?} ({MISSED_HEARTBEATS} heartbeat intervals of {:?})",
                        now - heartbeat.last_heard,
                        heartbeat.interval
                    ),
                ));
            }
            if now >= heartbeat.next_ping {
                heartbeat.pings = heartbeat.pings.wrapping_add(1);
                heartbeat.next_ping = now + heartbeat.interval;
                let ping = Message::Ping(Bytes::copy_from_slice(&heartbeat.pings.to_be_bytes()));
                Pin::new(&mut self.ws).start_send(ping).map_err(io_error)?;
                self.flush_owed = true;
                continue;
            }
            let wake_at = heartbeat.next_ping.min(silent_until);
            if heartbeat.timer.deadline() != wake_at {
                heartbeat.timer.as_mut().reset(wake_at);
            }
            if heartbeat.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
        }
    }

    /// Flushes a ping the reading side queued, waking the writer too.
    fn poll_owed_flush(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.flush_owed {
            return Ok(());
        }
        let waker = Waker::from(Arc::new(BothWakers {
            reader: cx.waker().clone(),
            writer: self.writer.clone(),
        }));
        let mut both = Context::from_waker(&waker);
        if let Poll::Ready(flushed) = Pin::new(&mut self.ws).poll_flush(&mut both) {
            flushed.map_err(io_error)?;
            self.flush_owed = false;
        }
        Ok(())
    }

    fn send(&mut self, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        self.note_writer(cx);
        let len = bufs
            .iter()
            .map(|b| b.len())
            .sum::<usize>()
            .min(MAX_WRITE_LEN);
        if len == 0 {
            return Poll::Ready(Ok(0));
        }
        ready!(Pin::new(&mut self.ws).poll_ready(cx)).map_err(io_error)?;
        let mut message = BytesMut::with_capacity(len);
        for buf in bufs {
            let room = len - message.len();
            if room == 0 {
                break;
            }
            message.extend_from_slice(&buf[..buf.len().min(room)]);
        }
        Pin::new(&mut self.ws)
            .start_send(Message::Binary(message.freeze()))
            .map_err(io_error)?;
        Poll::Ready(Ok(len))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WebSocketIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.poll_owed_flush(cx)?;
        let read = this.poll_message(cx);
        if let Poll::Ready(Err(e)) = read {
            return Poll::Ready(Err(e));
        }
        if read.is_pending() {
            // Only a peer we have nothing from is judged silent: what is
            // already buffered was heard.
            this.poll_heartbeat(cx)?;
            this.poll_owed_flush(cx)?;
            return Poll::Pending;
        }
        let n = this.incoming.len().min(buf.remaining());
        buf.put_slice(&this.incoming[..n]);
        this.incoming.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WebSocketIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().send(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().send(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.note_writer(cx);
        ready!(Pin::new(&mut this.ws).poll_flush(cx)).map_err(io_error)?;
        this.flush_owed = false;
        Poll::Ready(Ok(()))
    }

    /// Sends the WebSocket close, then ends the connection underneath
    /// (TLS's close_notify), so the peer sees a clean end on both layers.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.note_writer(cx);
        ready!(Pin::new(&mut this.ws).poll_close(cx)).map_err(io_error)?;
        Pin::new(this.ws.get_mut()).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use futures_util::{SinkExt, StreamExt};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;

    type Raw = WebSocketStream<DuplexStream>;

    /// Our side (a client, as the agent is) and a plain WebSocket peer.
    async fn pair(heartbeat: Option<Duration>) -> (WebSocketIo<DuplexStream>, Raw) {
        let (ours, theirs) = tokio::io::duplex(1 << 20);
        let ours = WebSocketStream::from_raw_socket(ours, Role::Client, Some(config())).await;
        let peer_config = WebSocketConfig::default().max_message_size(Some(8 << 20));
        let theirs =
            WebSocketStream::from_raw_socket(theirs, Role::Server, Some(peer_config)).await;
        (WebSocketIo::new(ours, heartbeat), theirs)
    }

    async fn next_message(peer: &mut Raw) -> Message {
        tokio::time::timeout(Duration::from_secs(5), peer.next())
            .await
            .expect("no message")
            .expect("the stream ended")
            .expect("a WebSocket error")
    }

    /// Each write is one binary message; reads join messages however
    /// they were cut.
    #[tokio::test]
    async fn writes_are_messages_and_reads_join_them() {
        let (mut ours, mut peer) = pair(None).await;
        ours.write_all(b"abc").await.unwrap();
        ours.write_all(b"defgh").await.unwrap();
        ours.flush().await.unwrap();
        assert_eq!(next_message(&mut peer).await, Message::binary(&b"abc"[..]));
        assert_eq!(
            next_message(&mut peer).await,
            Message::binary(&b"defgh"[..])
        );

        for part in [&b"hel"[..], b"", b"lo wo", b"rld"] {
            peer.send(Message::binary(part)).await.unwrap();
        }
        let mut read = [0u8; 11];
        ours.read_exact(&mut read).await.unwrap();
        assert_eq!(&read, b"hello world");
    }

    /// Slices written together go in one message.
    #[tokio::test]
    async fn a_vectored_write_is_one_message() {
        let (mut ours, mut peer) = pair(None).await;
        let slices = [IoSlice::new(b"ab"), IoSlice::new(b""), IoSlice::new(b"cd")];
        let written = ours.write_vectored(&slices).await.unwrap();
        assert_eq!(written, 4);
        ours.flush().await.unwrap();
        assert_eq!(next_message(&mut peer).await, Message::binary(&b"abcd"[..]));
    }

    /// A write beyond [`MAX_WRITE_LEN`] is taken in parts, each a message
    /// the peer accepts; the bytes arrive whole and in order.
    #[tokio::test]
    async fn large_writes_are_cut_into_messages_of_bounded_size() {
        let (mut ours, mut peer) = pair(None).await;
        let sent: Vec<u8> = (0..(MAX_WRITE_LEN * 4 + 3)).map(|i| i as u8).collect();
        let writing = {
            let sent = sent.clone();
            tokio::spawn(async move {
                ours.write_all(&sent).await.unwrap();
                ours.flush().await.unwrap();
                ours
            })
        };
        let mut got = Vec::new();
        while got.len() < sent.len() {
            let Message::Binary(data) = next_message(&mut peer).await else {
                panic!("not a binary message");
            };
            assert!(data.len() <= MAX_WRITE_LEN, "{} bytes", data.len());
            got.extend_from_slice(&data);
        }
        assert_eq!(got, sent);
        writing.await.unwrap();
    }

    /// Two of ours move a MiB each way.
    #[tokio::test]
    async fn a_mebibyte_crosses_between_two_of_ours() {
        let (a, b) = tokio::io::duplex(64 * 1024);
        let client = connect_raw(a, Role::Client).await;
        let mut server = accept(b).await;
        let sent: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
        let (mut client_read, mut client_write) = tokio::io::split(client);
        let echo = tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 20];
            server.read_exact(&mut buf).await.unwrap();
            server.write_all(&buf).await.unwrap();
            server.flush().await.unwrap();
            server
        });
        let writing = {
            let sent = sent.clone();
            tokio::spawn(async move {
                client_write.write_all(&sent).await.unwrap();
                client_write.flush().await.unwrap();
                client_write
            })
        };
        let mut got = vec![0u8; 1 << 20];
        client_read.read_exact(&mut got).await.unwrap();
        assert_eq!(got, sent);
        writing.await.unwrap();
        echo.await.unwrap();
    }

    async fn connect_raw(io: DuplexStream, role: Role) -> WebSocketIo<DuplexStream> {
        WebSocketIo::new(
            WebSocketStream::from_raw_socket(io, role, Some(config())).await,
            None,
        )
    }

    /// The peer's close is the end of what we read; our shutdown is a
    /// close the peer sees.
    #[tokio::test]
    async fn close_is_the_end_both_ways() {
        let (mut ours, mut peer) = pair(None).await;
        peer.send(Message::binary(&b"last"[..])).await.unwrap();
        peer.close(None).await.unwrap();
        let mut read = Vec::new();
        ours.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"last");

        let (mut ours, mut peer) = pair(None).await;
        ours.shutdown().await.unwrap();
        assert!(matches!(next_message(&mut peer).await, Message::Close(_)));
        let after = tokio::time::timeout(Duration::from_secs(5), peer.next()).await;
        assert!(
            matches!(after, Ok(None)),
            "the connection underneath did not end: {after:?}"
        );
    }

    /// A ping is answered while we wait to read, and never shows up in
    /// what we read.
    #[tokio::test]
    async fn pings_are_answered_while_reading() {
        let (mut ours, mut peer) = pair(None).await;
        let reading = tokio::spawn(async move {
            let mut read = [0u8; 2];
            ours.read_exact(&mut read).await.unwrap();
            read
        });
        peer.send(Message::Ping(Bytes::from_static(b"are you there")))
            .await
            .unwrap();
        assert_eq!(
            next_message(&mut peer).await,
            Message::Pong(Bytes::from_static(b"are you there"))
        );
        peer.send(Message::binary(&b"ok"[..])).await.unwrap();
        assert_eq!(&reading.await.unwrap(), b"ok");
    }

    /// What the tunnel cannot carry is a clear error, never a panic or a
    /// wait: a text message, or a message beyond [`MAX_MESSAGE_LEN`].
    #[tokio::test]
    async fn text_and_oversized_messages_are_errors() {
        let (mut ours, mut peer) = pair(None).await;
        peer.send(Message::text("hello")).await.unwrap();
        let e = ours.read(&mut [0u8; 8]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("text message"), "{e}");

        let (mut ours, mut peer) = pair(None).await;
        let sending = tokio::spawn(async move {
            let _ = peer
                .send(Message::binary(vec![0u8; MAX_MESSAGE_LEN + 1]))
                .await;
            peer
        });
        let e = tokio::time::timeout(Duration::from_secs(5), ours.read(&mut [0u8; 8]))
            .await
            .expect("an oversized message must not be waited for")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("too long"), "{e}");
        drop(sending);
    }

    /// The call's metadata is the request's headers but the upgrade's own.
    #[test]
    fn call_metadata_drops_the_upgrade_headers() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("host", "hub:8091"),
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("sec-websocket-version", "13"),
            ("sec-websocket-protocol", SUBPROTOCOL),
            ("agentid", "cluster-a-agent"),
            ("agentidentifiers", "host=cluster-a"),
        ] {
            headers.insert(name, HeaderValue::from_static(value));
        }
        let metadata = call_metadata(&headers);
        let mut names: Vec<_> = metadata.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["agentid", "agentidentifiers"]);
        assert!(lists_token(&headers, http::header::CONNECTION, "upgrade"));
        assert!(!lists_token(&headers, http::header::UPGRADE, "h2c"));
    }

    /// A peer that answers pings keeps a quiet connection through many
    /// intervals; one that goes silent fails the read after
    /// [`MISSED_HEARTBEATS`] intervals, not before.
    #[tokio::test(start_paused = true)]
    async fn the_heartbeat_keeps_a_quiet_peer_and_drops_a_silent_one() {
        let interval = Duration::from_secs(1);
        let (mut ours, mut peer) = pair(Some(interval)).await;
        let answering = tokio::spawn(async move {
            let mut pings = 0;
            while let Some(Ok(message)) = peer.next().await {
                if matches!(message, Message::Ping(_)) {
                    pings += 1;
                }
                if pings == 10 {
                    break;
                }
            }
            // Stops answering, but keeps the connection open.
            (peer, pings)
        });
        let started = Instant::now();
        let e = ours.read(&mut [0u8; 8]).await.unwrap_err();
        let (_peer, pings) = answering.await.unwrap();
        assert_eq!(pings, 10);
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("heartbeat"), "{e}");
        // The tenth ping was answered at 10 s: silence from then on for 3 s.
        let failed_after = started.elapsed();
        assert!(
            failed_after >= interval * 12 && failed_after <= interval * 13,
            "failed after {failed_after:?}"
        );
    }
}
