//! The tunnel's lean framing: one call's packets straight over TLS, for
//! hops where both ends are ours.
//!
//! A tunnel carries one long gRPC stream per connection, so HTTP/2's
//! streams, stream and connection windows, HPACK and frame queue are
//! bookkeeping on every packet that nothing needs: the tunnel's own flow
//! control bounds each tunneled connection ([`crate::flow`]) and TCP bounds
//! the whole. Measured in instructions, `h2` was the largest single cost a
//! round trip through the tunnel adds over two plain TLS relays.
//!
//! Negotiated with ALPN: an end that speaks this framing offers (client) or
//! prefers (server) [`ALPN_FRAMED`] ahead of `h2`; any other peer (upstream's
//! agents and servers, grpc-go, tonic) offers or selects only `h2` and gets
//! gRPC over HTTP/2 as before, with no extra round trip either way.
//!
//! On the wire, after the TLS handshake, both ends send frames of a 1-byte
//! kind and a 4-byte big-endian length, then that many bytes. Kind 0 is a
//! gRPC message exactly as gRPC frames it (the compressed flag 0 and the
//! length, then the `Packet`), so packets are encoded and decoded by
//! [`crate::grpc_framing`] as on HTTP/2. The other kinds stand for what
//! HTTP/2 carried:
//!
//! | kind | from | body | HTTP/2 equivalent |
//! |---|---|---|---|
//! | `0x80` hello | client, first | path (u16 length, bytes), then a header block | request HEADERS |
//! | `0x81` head | server, first | header block | response HEADERS; with `grpc-status`, a trailers-only answer |
//! | `0x82` end | either, last | header block | END_STREAM (client), trailers (server) |
//! | `0x83` ping | either | 8 bytes | PING |
//! | `0x84` pong | either | the ping's 8 bytes | PING ACK |
//!
//! A header block is a sequence of (u16 length, name, u16 length, value)
//! pairs, at most [`MAX_HEADER_BLOCK`] bytes. Anything else (another kind,
//! a hello or head out of turn, a malformed block) is a protocol error that
//! ends the connection.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::Stream;
use futures_util::task::AtomicWaker;
use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::Status;

use crate::Packet;
use crate::grpc_framing::{MESSAGE_PREFIX_LEN, PacketBody};
use crate::h2_driver::{PingSchedule, RecvBody, Sent};

/// The ALPN protocol of this framing.
pub const ALPN_FRAMED: &[u8] = b"cluster-proxy-tunnel/1";

/// The largest header block a peer may send (hyper's header-list limit,
/// which our HTTP/2 ports keep).
pub const MAX_HEADER_BLOCK: usize = 16 * 1024;

const KIND_MESSAGE: u8 = 0;
const KIND_HELLO: u8 = 0x80;
const KIND_HEAD: u8 = 0x81;
const KIND_END: u8 = 0x82;
const KIND_PING: u8 = 0x83;
const KIND_PONG: u8 = 0x84;

const PING_LEN: usize = 8;

/// Bytes read from the connection at a time when no frame of known length
/// is waiting for more.
const READ_CHUNK: usize = 16 * 1024;

/// Spare room below which a read between frames first reserves more.
const MIN_READ_SPACE: usize = 1024;

/// The most a read reserves at once for the rest of a frame: a whole
/// payload of our senders' largest (HTTP/2's frame size, which they keep).
const RESERVE_AT_ONCE: usize = crate::transport::MAX_FRAME_SIZE as usize + 1024;

/// Frames queued for the connection beyond which the body is not polled
/// for more until they are written (what h2's send buffer was).
const MAX_QUEUED: usize = 256 * 1024;

/// Slices handed to one vectored write.
const MAX_SLICES: usize = 32;

fn protocol_error(what: impl std::fmt::Display) -> Status {
    Status::internal(format!("protocol error: {what}"))
}

fn io_error(e: std::io::Error) -> Status {
    Status::unavailable(format!("connection error: {e}"))
}

/// A control frame: its prefix and `body`.
fn control_frame(kind: u8, body: &[u8]) -> Bytes {
    let mut frame = BytesMut::with_capacity(MESSAGE_PREFIX_LEN + body.len());
    frame.put_u8(kind);
    // Bodies of control frames are bounded far below u32::MAX.
    frame.put_u32(body.len() as u32);
    frame.put_slice(body);
    frame.freeze()
}

/// Appends `headers` as a header block.
fn put_header_block(headers: &HeaderMap, out: &mut BytesMut) -> Result<(), Status> {
    let start = out.len();
    for (name, value) in headers {
        for part in [name.as_str().as_bytes(), value.as_bytes()] {
            let len = u16::try_from(part.len())
                .map_err(|_| Status::internal(format!("header {name} too long to send")))?;
            out.put_u16(len);
            out.put_slice(part);
        }
    }
    if out.len() - start > MAX_HEADER_BLOCK {
        return Err(Status::internal(format!(
            "headers of {} bytes exceed the limit of {MAX_HEADER_BLOCK}",
            out.len() - start
        )));
    }
    Ok(())
}

/// Reads a header block that makes up all of `block`.
fn parse_header_block(mut block: &[u8]) -> Result<HeaderMap, Status> {
    fn part<'a>(block: &mut &'a [u8]) -> Result<&'a [u8], Status> {
        if block.len() < 2 {
            return Err(protocol_error("truncated header block"));
        }
        let len = usize::from(block.get_u16());
        if block.len() < len {
            return Err(protocol_error("truncated header block"));
        }
        let (part, rest) = block.split_at(len);
        *block = rest;
        Ok(part)
    }
    let mut headers = HeaderMap::new();
    while !block.is_empty() {
        let name = part(&mut block)?;
        let value = part(&mut block)?;
        let name = HeaderName::from_bytes(name).map_err(|_| {
            protocol_error(format!("invalid header name {:?}", name.escape_ascii()))
        })?;
        let value = HeaderValue::from_bytes(value)
            .map_err(|_| protocol_error(format!("invalid value for header {name}")))?;
        headers.append(name, value);
    }
    Ok(headers)
}

fn header_frame(kind: u8, prefix: &[u8], headers: &HeaderMap) -> Result<Bytes, Status> {
    let mut frame = BytesMut::new();
    frame.put_u8(kind);
    frame.put_u32(0);
    frame.put_slice(prefix);
    put_header_block(headers, &mut frame)?;
    let len = (frame.len() - MESSAGE_PREFIX_LEN) as u32;
    frame[1..MESSAGE_PREFIX_LEN].copy_from_slice(&len.to_be_bytes());
    Ok(frame.freeze())
}

/// A call's opening, as the client sends it.
#[derive(Debug, Clone, PartialEq)]
pub struct Hello {
    /// The method's path (`/package.Service/Method`).
    pub path: String,
    /// The call's metadata.
    pub headers: HeaderMap,
}

impl Hello {
    /// The hello frame.
    pub fn encode(&self) -> Result<Bytes, Status> {
        let path = u16::try_from(self.path.len())
            .map_err(|_| Status::internal("method path too long to send"))?;
        let mut prefix = Vec::with_capacity(2 + self.path.len());
        prefix.put_u16(path);
        prefix.put_slice(self.path.as_bytes());
        header_frame(KIND_HELLO, &prefix, &self.headers)
    }

    fn parse(mut body: &[u8]) -> Result<Hello, Status> {
        if body.len() < 2 {
            return Err(protocol_error("truncated hello"));
        }
        let len = usize::from(body.get_u16());
        if body.len() < len {
            return Err(protocol_error("truncated hello"));
        }
        let (path, block) = body.split_at(len);
        let path = std::str::from_utf8(path)
            .map_err(|_| protocol_error("method path is not UTF-8"))?
            .to_owned();
        Ok(Hello {
            path,
            headers: parse_header_block(block)?,
        })
    }
}

/// The server's answer to a hello: the response's metadata, or with
/// `grpc-status` a refusal (as a trailers-only response).
pub fn head_frame(headers: &HeaderMap) -> Result<Bytes, Status> {
    header_frame(KIND_HEAD, &[], headers)
}

/// An end frame: the end of a client's side (no headers) or a server's
/// trailers.
pub fn end_frame(trailers: &HeaderMap) -> Result<Bytes, Status> {
    header_frame(KIND_END, &[], trailers)
}

/// What the reading half tells the writing half and the keepalive: pongs
/// owed for the peer's pings, pongs heard for ours.
#[derive(Debug, Default)]
pub struct Control {
    /// Set with `pong_owed`, so a write pass looks at the lock only then.
    pong_due: AtomicBool,
    pong_owed: Mutex<Option<[u8; PING_LEN]>>,
    writer: AtomicWaker,
    /// The keepalive waiting for a pong.
    keepalive: AtomicWaker,
}

impl Control {
    fn owe_pong(&self, ping: [u8; PING_LEN]) {
        // Only the latest ping needs its answer: a pong tells the peer we
        // are alive, whichever it echoes.
        if let Ok(mut owed) = self.pong_owed.lock() {
            *owed = Some(ping);
            self.pong_due.store(true, Ordering::Release);
        }
        self.writer.wake();
    }

    fn take_pong(&self) -> Option<[u8; PING_LEN]> {
        if !self.pong_due.swap(false, Ordering::Acquire) {
            return None;
        }
        self.pong_owed.lock().ok()?.take()
    }
}

/// Reads frames from a connection, each whole frame in one buffer (so a
/// packet's payload is sliced out of it, never copied).
#[derive(Debug)]
struct FrameReader {
    buf: BytesMut,
    max_message_len: usize,
}

impl FrameReader {
    fn new(max_message_len: usize) -> Self {
        FrameReader {
            buf: BytesMut::new(),
            max_message_len,
        }
    }

    /// The next frame (kind and the whole frame, prefix included); `None`
    /// at a clean end of the connection between frames.
    fn poll_frame<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<(u8, Bytes)>, Status>> {
        loop {
            let wanted = match self.complete_frame_len()? {
                Some(len) if self.buf.len() >= len => {
                    let frame = self.buf.split_to(len).freeze();
                    return Poll::Ready(Ok(Some((frame[0], frame))));
                }
                // The whole frame in one allocation: moves only the part read.
                Some(len) => len - self.buf.len(),
                None => MIN_READ_SPACE,
            };
            // The frames split off share the allocation, so a reserve
            // beyond its spare room allocates anew: only when needed. What a
            // peer announces is not allocated before it arrives: a frame
            // beyond this grows as it is read.
            if self.buf.capacity() - self.buf.len() < wanted.min(RESERVE_AT_ONCE) {
                self.buf.reserve(wanted.clamp(READ_CHUNK, RESERVE_AT_ONCE));
            }
            let read = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut *io),
                cx,
                &mut self.buf
            ))
            .map_err(io_error)?;
            if read == 0 {
                return Poll::Ready(if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(Status::unavailable(
                        "connection closed in the middle of a frame",
                    ))
                });
            }
        }
    }

    /// The length of the frame at the front, once its prefix is in.
    fn complete_frame_len(&self) -> Result<Option<usize>, Status> {
        if self.buf.len() < MESSAGE_PREFIX_LEN {
            return Ok(None);
        }
        let kind = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        let max = match kind {
            KIND_MESSAGE => self.max_message_len,
            KIND_HELLO | KIND_HEAD | KIND_END => MAX_HEADER_BLOCK + 2 + u16::MAX as usize,
            KIND_PING | KIND_PONG if len == PING_LEN => PING_LEN,
            KIND_PING | KIND_PONG => {
                return Err(protocol_error(format!("a ping of {len} bytes")));
            }
            1 => {
                return Err(protocol_error(
                    "received message with compressed-flag but no grpc-encoding was specified",
                ));
            }
            other => return Err(protocol_error(format!("unknown frame kind {other:#04x}"))),
        };
        if len > max {
            return Err(if kind == KIND_MESSAGE {
                Status::out_of_range(format!(
                    "Error, decoded message length too large: found {len} bytes, the limit is: {max} bytes"
                ))
            } else {
                protocol_error(format!("a header frame of {len} bytes"))
            });
        }
        Ok(Some(MESSAGE_PREFIX_LEN + len))
    }
}

/// The peer's side of the call as an HTTP body, so
/// [`crate::grpc_framing::PacketStream`] reads it as it reads an HTTP/2
/// stream: messages as data, the end frame as trailers. Answers pings
/// through [`Control`] and counts the frames heard, for a [`KeepAlive`].
pub struct FramedBody<R> {
    io: R,
    reader: FrameReader,
    control: Arc<Control>,
    heard: Arc<AtomicU64>,
    ended: bool,
}

impl<R> std::fmt::Debug for FramedBody<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FramedBody")
            .field("buffered", &self.reader.buf.len())
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl<R: AsyncRead + Unpin> FramedBody<R> {
    /// Reads from `io`; messages up to `max_message_len`.
    pub fn new(
        io: R,
        control: Arc<Control>,
        heard: Arc<AtomicU64>,
        max_message_len: usize,
    ) -> Self {
        FramedBody {
            io,
            reader: FrameReader::new(max_message_len),
            control,
            heard,
            ended: false,
        }
    }

    /// The next frame other than a ping or pong.
    fn poll_call_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<(u8, Bytes)>, Status>> {
        loop {
            let Some((kind, frame)) = ready!(self.reader.poll_frame(&mut self.io, cx))? else {
                return Poll::Ready(Ok(None));
            };
            self.heard.fetch_add(1, Ordering::Relaxed);
            match kind {
                KIND_PING => {
                    let mut ping = [0; PING_LEN];
                    ping.copy_from_slice(&frame[MESSAGE_PREFIX_LEN..]);
                    self.control.owe_pong(ping);
                }
                KIND_PONG => self.control.keepalive.wake(),
                _ => return Poll::Ready(Ok(Some((kind, frame)))),
            }
        }
    }

    /// Reads the client's hello, which must come first (server side).
    pub async fn hello(&mut self) -> Result<Hello, Status> {
        let body = self.first_frame(KIND_HELLO, "a hello", "the hello").await?;
        Hello::parse(&body)
    }

    /// Reads the server's head, which must come first (client side).
    pub async fn head(&mut self) -> Result<HeaderMap, Status> {
        let body = self
            .first_frame(KIND_HEAD, "the response head", "the server answered")
            .await?;
        parse_header_block(&body)
    }

    /// The body of the call's first frame, which must be of `kind`.
    async fn first_frame(&mut self, kind: u8, what: &str, before: &str) -> Result<Bytes, Status> {
        match std::future::poll_fn(|cx| self.poll_call_frame(cx)).await? {
            Some((got, frame)) if got == kind => Ok(frame.slice(MESSAGE_PREFIX_LEN..)),
            Some((got, _)) => Err(protocol_error(format!(
                "expected {what}, got a frame of kind {got:#04x}"
            ))),
            None => Err(Status::unavailable(format!(
                "connection closed before {before}"
            ))),
        }
    }
}

impl<R: AsyncRead + Unpin> Body for FramedBody<R> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let framed = match ready!(this.poll_call_frame(cx)) {
            Ok(Some((KIND_MESSAGE, frame))) => Ok(Frame::data(frame)),
            Ok(Some((KIND_END, frame))) => {
                this.ended = true;
                parse_header_block(&frame[MESSAGE_PREFIX_LEN..]).map(Frame::trailers)
            }
            Ok(Some((kind, _))) => Err(protocol_error(format!(
                "a frame of kind {kind:#04x} in the middle of the call"
            ))),
            Ok(None) => {
                this.ended = true;
                return Poll::Ready(None);
            }
            Err(status) => Err(status),
        };
        if framed.is_err() {
            this.ended = true;
        }
        Poll::Ready(Some(framed))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// A call's received side on either transport, for
/// [`crate::grpc_framing::PacketStream`]: an HTTP/2 stream or this
/// framing's frames. Errors keep their type (tonic maps an `h2` error to
/// its gRPC code as it always has).
#[derive(Debug)]
pub enum InboundBody<R> {
    Http2(RecvBody),
    Framed(FramedBody<R>),
}

impl<R: AsyncRead + Unpin> Body for InboundBody<R> {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            InboundBody::Http2(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            InboundBody::Framed(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            InboundBody::Http2(body) => body.is_end_stream(),
            InboundBody::Framed(body) => body.is_end_stream(),
        }
    }
}

/// Writes frames to a connection: our packets (from a [`PacketBody`]),
/// the end of our side, pings and the pongs [`Control`] owes.
pub struct FrameWriter<W> {
    io: W,
    queue: VecDeque<Bytes>,
    queued: usize,
    control: Arc<Control>,
    /// Written since the last flush.
    unflushed: bool,
    next_ping: u64,
    /// Set once the body's end is queued: how it ended.
    body_end: Option<Result<(), Status>>,
}

impl<W> std::fmt::Debug for FrameWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameWriter")
            .field("queued", &self.queued)
            .finish_non_exhaustive()
    }
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub fn new(io: W, control: Arc<Control>) -> Self {
        FrameWriter {
            io,
            queue: VecDeque::new(),
            queued: 0,
            control,
            unflushed: false,
            next_ping: 0,
            body_end: None,
        }
    }

    /// Queues a frame made elsewhere (a hello or head).
    pub fn queue(&mut self, frame: Bytes) {
        if !frame.is_empty() {
            self.queued += frame.len();
            self.queue.push_back(frame);
        }
    }

    /// Queues a ping.
    pub fn queue_ping(&mut self) {
        self.next_ping = self.next_ping.wrapping_add(1);
        self.queue(control_frame(KIND_PING, &self.next_ping.to_be_bytes()));
    }

    /// Writes and flushes everything queued.
    pub fn poll_write_queued(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.control.writer.register(cx.waker());
        if let Some(ping) = self.control.take_pong() {
            self.queue(control_frame(KIND_PONG, &ping));
        }
        while !self.queue.is_empty() {
            let mut slices = [IoSlice::new(&[]); MAX_SLICES];
            let mut count = 0;
            for (slot, frame) in slices.iter_mut().zip(self.queue.iter()) {
                *slot = IoSlice::new(frame);
                count += 1;
            }
            let written = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..count]))
                .map_err(io_error)?;
            if written == 0 {
                return Poll::Ready(Err(Status::unavailable(
                    "connection error: the connection accepts no more bytes",
                )));
            }
            self.unflushed = true;
            self.advance(written);
        }
        if self.unflushed {
            ready!(Pin::new(&mut self.io).poll_flush(cx)).map_err(io_error)?;
            self.unflushed = false;
        }
        Poll::Ready(Ok(()))
    }

    fn advance(&mut self, mut written: usize) {
        self.queued -= written;
        while written > 0 {
            let Some(front) = self.queue.front_mut() else {
                return;
            };
            if front.len() > written {
                front.advance(written);
                return;
            }
            written -= front.len();
            self.queue.pop_front();
        }
    }

    /// Moves `body` onto the connection as far as it writes: the body's
    /// frames as they are (gRPC messages), its trailers, or its end, as an
    /// end frame. A body that fails sends its status as the end and
    /// reports the failure once that is written.
    pub fn poll_send_body<S>(
        &mut self,
        mut body: Pin<&mut PacketBody<S>>,
        cx: &mut Context<'_>,
    ) -> Result<Sent, Status>
    where
        S: Stream<Item = Result<Packet, Status>> + Unpin,
    {
        loop {
            let mut drained = false;
            while self.body_end.is_none() && self.queued < MAX_QUEUED {
                match body.as_mut().poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => {
                            self.queue(data);
                            // As on HTTP/2 (`h2_driver::poll_send_body`): the
                            // packets will wake us; asking now hears Pending.
                            if body.waiting_for_packets() {
                                drained = true;
                                break;
                            }
                        }
                        Err(frame) => {
                            let trailers = frame.into_trailers().unwrap_or_default();
                            self.end_with(&trailers, Ok(()))?;
                        }
                    },
                    Poll::Ready(Some(Err(status))) => {
                        let mut trailers = HeaderMap::new();
                        status.add_header(&mut trailers)?;
                        self.end_with(&trailers, Err(status))?;
                    }
                    Poll::Ready(None) => self.end_with(&HeaderMap::new(), Ok(()))?,
                    Poll::Pending => {
                        drained = true;
                        break;
                    }
                }
            }
            match self.poll_write_queued(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(status)) => return Err(status),
                // The connection wakes us once it takes more.
                Poll::Pending => return Ok(Sent::Pending),
            }
            if let Some(end) = self.body_end.take() {
                self.body_end = Some(Ok(()));
                return end.map(|()| Sent::Ended);
            }
            if drained {
                return Ok(Sent::Pending);
            }
        }
    }

    fn end_with(&mut self, trailers: &HeaderMap, end: Result<(), Status>) -> Result<(), Status> {
        self.queue(header_frame(KIND_END, &[], trailers)?);
        self.body_end = Some(end);
        Ok(())
    }

    /// Ends the connection's writing side (TLS close_notify).
    pub async fn shutdown(&mut self) -> Result<(), Status> {
        tokio::io::AsyncWriteExt::shutdown(&mut self.io)
            .await
            .map_err(io_error)
    }
}

/// Keepalive as [`crate::h2_driver::KeepAlive`] does it on HTTP/2 (the same
/// [`PingSchedule`]): a ping once the peer was silent for `interval`, after
/// which the peer must be heard (its pong, or anything) within
/// [`PING_TIMEOUT`](crate::h2_driver::PING_TIMEOUT).
#[derive(Debug)]
pub struct KeepAlive {
    schedule: PingSchedule,
    /// Wakes us when a pong is heard, as HTTP/2's PING ACK wakes its
    /// keepalive: the next ping is due an interval after the answer.
    control: Arc<Control>,
}

impl KeepAlive {
    pub fn new(interval: Duration, control: Arc<Control>) -> Self {
        KeepAlive {
            schedule: PingSchedule::new(interval),
            control,
        }
    }

    /// `heard` counts the frames the peer sent so far. `Ok(true)`: send a
    /// ping now; `Err` once a ping went unanswered.
    pub fn poll(&mut self, cx: &mut Context<'_>, heard: u64) -> Result<bool, Status> {
        self.control.keepalive.register(cx.waker());
        // A pong is a frame heard: the schedule sees it in `heard`.
        self.schedule.poll(cx, heard, false)
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;
    use crate::grpc_framing::{Direction, PacketStream, Role};
    use crate::h2_driver::PING_TIMEOUT;
    use crate::packet;

    type Packets = futures_util::stream::Iter<std::vec::IntoIter<Result<Packet, Status>>>;

    fn body(packets: Vec<Result<Packet, Status>>, role: Role) -> PacketBody<Packets> {
        PacketBody::new(futures_util::stream::iter(packets), role, usize::MAX)
    }

    fn reader(io: DuplexStream, direction: Direction) -> PacketStream<FramedBody<DuplexStream>> {
        let body = FramedBody::new(
            io,
            Arc::new(Control::default()),
            Arc::new(AtomicU64::new(0)),
            1 << 20,
        );
        PacketStream::new(body, direction, 1 << 20)
    }

    /// Writes `packets` as `role` until the body's end is written.
    async fn send_all(
        io: DuplexStream,
        packets: Vec<Result<Packet, Status>>,
        role: Role,
    ) -> Result<Sent, Status> {
        let mut writer = FrameWriter::new(io, Arc::new(Control::default()));
        let mut body = body(packets, role);
        std::future::poll_fn(|cx| match writer.poll_send_body(Pin::new(&mut body), cx) {
            Ok(Sent::Pending) => Poll::Pending,
            done => Poll::Ready(done),
        })
        .await
    }

    async fn collect(
        mut stream: PacketStream<FramedBody<DuplexStream>>,
    ) -> (Vec<Packet>, Result<(), Status>) {
        let mut got = Vec::new();
        while let Some(p) = stream.next().await {
            match p {
                Ok(p) => got.push(p),
                Err(status) => return (got, Err(status)),
            }
        }
        (got, Ok(()))
    }

    fn sample() -> Vec<Packet> {
        vec![
            packet::dial_request("10.0.0.1:443", 7),
            packet::data(1, Bytes::from_static(b"x")),
            packet::data(1, Bytes::from(vec![9u8; 200_000])),
            packet::window_update(1, 65536),
            packet::close_request(1),
        ]
    }

    /// A server's packets and its OK status arrive as sent, through a
    /// connection that hands over a few bytes at a time.
    #[tokio::test]
    async fn packets_and_the_status_cross_in_small_pieces() {
        let (a, b) = tokio::io::duplex(7);
        let sent = sample();
        let writing = tokio::spawn(send_all(
            a,
            sent.iter().cloned().map(Ok).collect(),
            Role::Server,
        ));
        let (got, end) = collect(reader(b, Direction::Response)).await;
        assert_eq!(got, sent);
        assert!(end.is_ok(), "{end:?}");
        assert_eq!(writing.await.unwrap().unwrap(), Sent::Ended);
    }

    /// A server's failure is the status the client reads; a client's end
    /// is a clean end of the request.
    #[tokio::test]
    async fn a_failed_call_ends_with_its_status_and_a_client_with_a_clean_end() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let failure = Status::resource_exhausted("too many agents");
        let sent = vec![Ok(packet::close_request(3)), Err(failure)];
        let writing = tokio::spawn(send_all(a, sent, Role::Server));
        let (got, end) = collect(reader(b, Direction::Response)).await;
        assert_eq!(got, vec![packet::close_request(3)]);
        let status = end.unwrap_err();
        assert_eq!(
            (status.code(), status.message()),
            (tonic::Code::ResourceExhausted, "too many agents")
        );
        // A server's failure is its trailers, sent as any end is.
        assert_eq!(writing.await.unwrap().unwrap(), Sent::Ended);

        let (a, b) = tokio::io::duplex(1 << 16);
        let writing = tokio::spawn(send_all(a, vec![Ok(packet::drain())], Role::Client));
        let (got, end) = collect(reader(b, Direction::Request)).await;
        assert_eq!(got, vec![packet::drain()]);
        assert!(end.is_ok(), "{end:?}");
        assert_eq!(writing.await.unwrap().unwrap(), Sent::Ended);
    }

    /// A payload is a slice of the frame it arrived in, not a copy.
    #[tokio::test]
    async fn a_payload_is_read_without_a_copy() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let payload = Bytes::from(vec![4u8; 100_000]);
        send_all(a, vec![Ok(packet::data(2, payload.clone()))], Role::Client)
            .await
            .unwrap();
        let mut body = FramedBody::new(
            b,
            Arc::new(Control::default()),
            Arc::new(AtomicU64::new(0)),
            1 << 20,
        );
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap();
        let mut stream = PacketStream::new(
            http_body_util::StreamBody::new(futures_util::stream::iter([Ok::<_, Status>(
                Frame::data(frame.clone()),
            )])),
            Direction::Request,
            1 << 20,
        );
        let decoded = stream.next().await.unwrap().unwrap();
        let Some(crate::konnectivity::packet::Payload::Data(data)) = decoded.payload else {
            panic!("not a data packet: {decoded:?}");
        };
        assert_eq!(data.data, payload);
        let within = frame.as_ptr_range();
        assert!(
            within.contains(&data.data.as_ptr()),
            "the payload was copied out of its frame"
        );
    }

    #[tokio::test]
    async fn hello_and_head_carry_their_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("agentid", HeaderValue::from_static("cluster1"));
        headers.append("agentidentifiers", HeaderValue::from_static("host=a"));
        headers.append("agentidentifiers", HeaderValue::from_static("host=b"));
        let hello = Hello {
            path: "/AgentService/Connect".into(),
            headers: headers.clone(),
        };
        let (mut a, b) = tokio::io::duplex(1 << 16);
        a.write_all(&hello.encode().unwrap()).await.unwrap();
        a.write_all(&head_frame(&headers).unwrap()).await.unwrap();
        let mut body = FramedBody::new(
            b,
            Arc::new(Control::default()),
            Arc::new(AtomicU64::new(0)),
            1024,
        );
        assert_eq!(body.hello().await.unwrap(), hello);
        let head = body.head().await.unwrap();
        assert_eq!(head, headers);
        assert_eq!(head.get_all("agentidentifiers").iter().count(), 2);
    }

    /// Bytes that are not this framing, or not in its order, are a clear
    /// error, never a panic or a wait for bytes that will not come.
    #[tokio::test]
    async fn malformed_frames_are_errors() {
        async fn first_error(bytes: &[u8]) -> Status {
            let (mut a, b) = tokio::io::duplex(1 << 16);
            a.write_all(bytes).await.unwrap();
            drop(a);
            let mut body = FramedBody::new(
                b,
                Arc::new(Control::default()),
                Arc::new(AtomicU64::new(0)),
                100,
            );
            match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                Some(Err(status)) => status,
                other => panic!("not an error: {other:?}"),
            }
        }
        let cases: [(&[u8], tonic::Code, &str); 7] = [
            (
                &[0x42, 0, 0, 0, 0],
                tonic::Code::Internal,
                "unknown frame kind 0x42",
            ),
            (
                &[1, 0, 0, 0, 1, 0],
                tonic::Code::Internal,
                "compressed-flag",
            ),
            (&[0, 0, 0, 0, 200], tonic::Code::OutOfRange, "too large"),
            (
                &[KIND_PING, 0, 0, 0, 3, 1, 2, 3],
                tonic::Code::Internal,
                "a ping of 3 bytes",
            ),
            (
                &[KIND_END, 0, 0, 0, 3, 0, 9, b'a'],
                tonic::Code::Internal,
                "truncated header block",
            ),
            (
                &[KIND_END, 0, 0, 0, 6, 0, 2, b'a', b' ', 0, 0],
                tonic::Code::Internal,
                "invalid header name",
            ),
            (
                &[0, 0, 0, 0, 10, 1, 2],
                tonic::Code::Unavailable,
                "in the middle of a frame",
            ),
        ];
        for (bytes, code, says) in cases {
            let status = first_error(bytes).await;
            assert_eq!(status.code(), code, "{bytes:?}: {status:?}");
            assert!(status.message().contains(says), "{bytes:?}: {status:?}");
        }
        let status = first_error(&head_frame(&HeaderMap::new()).unwrap()).await;
        assert!(
            status.message().contains("in the middle of the call"),
            "{status:?}"
        );

        let (mut a, b) = tokio::io::duplex(1 << 16);
        a.write_all(&[KIND_MESSAGE, 0, 0, 0, 0]).await.unwrap();
        let mut body = FramedBody::new(
            b,
            Arc::new(Control::default()),
            Arc::new(AtomicU64::new(0)),
            100,
        );
        let status = body.hello().await.unwrap_err();
        assert!(status.message().contains("expected a hello"), "{status:?}");
    }

    /// A frame's announced length is not allocated before its bytes come:
    /// a peer cannot make us hold 16 MiB with a 5-byte prefix.
    #[tokio::test]
    async fn an_announced_length_is_not_allocated_up_front() {
        let (mut peer, ours) = tokio::io::duplex(1 << 16);
        let mut body = FramedBody::new(
            ours,
            Arc::new(Control::default()),
            Arc::new(AtomicU64::new(0)),
            16 << 20,
        );
        peer.write_all(&[KIND_MESSAGE, 0, 0xf0, 0, 0, 1, 2, 3])
            .await
            .unwrap();
        let polled = futures_util::FutureExt::now_or_never(std::future::poll_fn(|cx| {
            Poll::Ready(Pin::new(&mut body).poll_frame(cx).is_pending())
        }));
        assert_eq!(polled, Some(true), "a partial frame is not ready");
        let held = body.reader.buf.capacity();
        assert!(
            held <= RESERVE_AT_ONCE + READ_CHUNK,
            "holds {held} bytes for a 15 MiB announcement"
        );
    }

    /// A ping is answered with its pong by the writing half, which the
    /// reading half wakes; both count as heard.
    #[tokio::test]
    async fn a_ping_is_answered_by_the_writer() {
        let (ours, mut peer) = tokio::io::duplex(1 << 16);
        let (read, write) = tokio::io::split(ours);
        let control = Arc::new(Control::default());
        let heard = Arc::new(AtomicU64::new(0));
        let mut body = FramedBody::new(read, control.clone(), heard.clone(), 1024);
        let mut writer = FrameWriter::new(write, control);
        // The writer waits for something to write; nothing is queued yet.
        let mut packets = body_of_nothing();
        let writing = tokio::spawn(async move {
            std::future::poll_fn(
                |cx| match writer.poll_send_body(Pin::new(&mut packets), cx) {
                    Ok(Sent::Pending) => Poll::Pending,
                    done => Poll::Ready(done),
                },
            )
            .await
        });
        peer.write_all(&control_frame(KIND_PING, &[1, 2, 3, 4, 5, 6, 7, 8]))
            .await
            .unwrap();
        peer.write_all(&control_frame(KIND_PONG, &[0; 8]))
            .await
            .unwrap();
        peer.write_all(&header_frame(KIND_END, &[], &HeaderMap::new()).unwrap())
            .await
            .unwrap();
        // The body skips the ping and pong and ends with the end frame.
        let end = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        assert!(matches!(end, Some(Ok(ref f)) if f.is_trailers()), "{end:?}");
        assert_eq!(heard.load(Ordering::Relaxed), 3);
        let mut pong = [0u8; 13];
        peer.read_exact(&mut pong).await.unwrap();
        assert_eq!(pong, [KIND_PONG, 0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8]);
        writing.abort();
    }

    fn body_of_nothing() -> PacketBody<futures_util::stream::Pending<Result<Packet, Status>>> {
        PacketBody::new(futures_util::stream::pending(), Role::Client, usize::MAX)
    }

    /// Silence for the interval asks for a ping; the peer heard within the
    /// ping timeout keeps the connection, silence fails it.
    #[tokio::test(start_paused = true)]
    async fn keepalive_pings_a_silent_peer_and_gives_up_on_one_that_stays_silent() {
        let interval = Duration::from_secs(30);
        let mut keepalive = KeepAlive::new(interval, Arc::new(Control::default()));
        let poll = |keepalive: &mut KeepAlive, heard| {
            std::future::poll_fn(move |cx| Poll::Ready(keepalive.poll(cx, heard)))
                .now_or_never_ready()
        };
        assert!(!poll(&mut keepalive, 0).unwrap());
        tokio::time::advance(interval / 2).await;
        // Heard from: no ping at the interval's end, the timer restarts.
        assert!(!poll(&mut keepalive, 1).unwrap());
        tokio::time::advance(interval / 2 + Duration::from_millis(1)).await;
        assert!(!poll(&mut keepalive, 1).unwrap());
        tokio::time::advance(interval).await;
        assert!(poll(&mut keepalive, 1).unwrap(), "a silent peer is pinged");
        // Its pong (anything heard) re-arms the interval.
        tokio::time::advance(PING_TIMEOUT / 2).await;
        assert!(!poll(&mut keepalive, 2).unwrap());
        tokio::time::advance(interval + Duration::from_millis(1)).await;
        assert!(poll(&mut keepalive, 2).unwrap());
        tokio::time::advance(PING_TIMEOUT + Duration::from_millis(1)).await;
        let status = poll(&mut keepalive, 2).unwrap_err();
        assert!(status.message().contains("not answered"), "{status:?}");
    }

    /// A pong wakes the keepalive waiting for it, so the next ping follows
    /// an interval after the answer rather than after the ping timeout.
    #[tokio::test(start_paused = true)]
    async fn a_pong_wakes_the_keepalive() {
        struct Flag(std::sync::atomic::AtomicBool);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let control = Arc::new(Control::default());
        let interval = Duration::from_secs(1);
        let mut keepalive = KeepAlive::new(interval, control.clone());
        let flag = Arc::new(Flag(Default::default()));
        let waker = std::task::Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(!keepalive.poll(&mut cx, 0).unwrap());
        tokio::time::advance(interval).await;
        assert!(
            keepalive.poll(&mut cx, 0).unwrap(),
            "a silent peer is pinged"
        );
        flag.0.store(false, Ordering::SeqCst);

        let (mut peer, ours) = tokio::io::duplex(1 << 10);
        let heard = Arc::new(AtomicU64::new(0));
        let mut body = FramedBody::new(ours, control, heard.clone(), 1024);
        peer.write_all(&control_frame(KIND_PONG, &[0; 8]))
            .await
            .unwrap();
        drop(peer);
        let end = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        assert!(end.is_none(), "{end:?}");
        assert!(
            flag.0.load(Ordering::SeqCst),
            "the pong did not wake the keepalive"
        );
        // Answered: the next ping is an interval away.
        assert!(
            !keepalive
                .poll(&mut cx, heard.load(Ordering::Relaxed))
                .unwrap()
        );
        tokio::time::advance(interval).await;
        assert!(keepalive.poll(&mut cx, 1).unwrap());
    }

    trait NowOrNever: std::future::Future + Sized {
        fn now_or_never_ready(self) -> Self::Output {
            futures_util::FutureExt::now_or_never(self).expect("ready at once")
        }
    }
    impl<F: std::future::Future> NowOrNever for F {}
}
