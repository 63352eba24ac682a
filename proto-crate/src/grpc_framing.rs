//! gRPC message framing of konnectivity packets without copying payloads.
//!
//! tonic's `Streaming` copies every received HTTP/2 DATA frame into a buffer
//! of its own before decoding, and its `EncodeBody` copies every sent packet,
//! payload included, into another. At tunnel rates those two copies were a
//! sixth of the proxy-server's CPU (`perf`, 8 downloads through one agent).
//! Here a received message is decoded from the DATA frames it arrived in,
//! never joined: prost slices `Data.data` out of the frame that holds it
//! (see [`ReceivedMessage`]). A DATA packet's payload is sent as a frame of
//! its own after a small header frame, so HTTP/2 hands the caller's bytes to
//! TLS untouched, and the receiver finds the payload whole in that frame.
//!
//! The bytes on the wire are exactly what tonic and grpc-go send and accept:
//! a 5-byte prefix (compressed flag, big-endian length) and the protobuf
//! encoding of the packet; only how they are split into DATA frames differs,
//! which gRPC leaves to the sender.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::Stream;
use http::HeaderMap;
use http_body::{Body, Frame};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use tonic::Status;

use crate::Packet;
use crate::konnectivity::packet::Payload;

/// The paths of konnectivity's two streaming methods (its protos declare no
/// package).
pub const AGENT_CONNECT_PATH: &str = "/AgentService/Connect";
pub const PROXY_PATH: &str = "/ProxyService/Proxy";

/// The compressed flag and the big-endian message length before every message.
pub const MESSAGE_PREFIX_LEN: usize = 5;

/// `Packet.payload`'s field number for `Data`, and `Data.data`'s.
const PACKET_DATA_TAG: u32 = 4;
const DATA_PAYLOAD_TAG: u32 = 3;

/// Payloads at least this long are sent as frames of their own; shorter ones
/// are cheaper to copy than to send as a separate HTTP/2 frame.
const CHAIN_PAYLOAD_AT: usize = 1024;

/// Small packets ready at once are encoded into one frame up to this size,
/// as tonic does, so window updates and closes do not each cost a frame.
const COALESCE_UP_TO: usize = 32 * 1024;

/// One packet, encoded: the prefix and every field but a long DATA payload,
/// which follows by reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedPacket {
    pub head: Bytes,
    pub payload: Option<Bytes>,
}

impl EncodedPacket {
    /// The message's length on the wire, prefix included.
    pub fn len(&self) -> usize {
        self.head.len() + self.payload.as_ref().map_or(0, Bytes::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Appends `packet`, framed as a gRPC message, to `head`; a long DATA
/// payload is not copied but returned, to be sent right after `head`.
/// Fails when the message would exceed `max_message_len`.
pub fn encode_into(
    packet: &Packet,
    head: &mut BytesMut,
    max_message_len: usize,
) -> Result<Option<Bytes>, Status> {
    let chained = match &packet.payload {
        Some(Payload::Data(data)) if data.data.len() >= CHAIN_PAYLOAD_AT => data,
        _ => {
            let len = packet.encoded_len();
            check_len(len, max_message_len)?;
            head.reserve(MESSAGE_PREFIX_LEN + len);
            put_prefix(head, len);
            packet
                .encode(head)
                .map_err(|e| Status::internal(format!("encoding a packet: {e}")))?;
            return Ok(None);
        }
    };
    // `Data.data` is the last field of `Data`, and `Data` the last field of
    // `Packet`, in the order prost writes them: everything before the
    // payload's bytes is the packet with an empty payload plus the payload's
    // key and length.
    let payload = &chained.data;
    let data_without_payload = crate::konnectivity::Data {
        connect_id: chained.connect_id,
        error: chained.error.clone(),
        data: Bytes::new(),
    };
    let payload_field_len = key_len(DATA_PAYLOAD_TAG) + encoded_len_varint(payload.len() as u64);
    let data_len = data_without_payload.encoded_len() + payload_field_len + payload.len();
    let type_len = if packet.r#type == 0 {
        0
    } else {
        key_len(1) + encoded_len_varint(i64::from(packet.r#type) as u64)
    };
    let message_len =
        type_len + key_len(PACKET_DATA_TAG) + encoded_len_varint(data_len as u64) + data_len;
    check_len(message_len, max_message_len)?;
    head.reserve(MESSAGE_PREFIX_LEN + message_len - payload.len());
    put_prefix(head, message_len);
    if packet.r#type != 0 {
        encode_key(1, WireType::Varint, head);
        encode_varint(i64::from(packet.r#type) as u64, head);
    }
    encode_key(PACKET_DATA_TAG, WireType::LengthDelimited, head);
    encode_varint(data_len as u64, head);
    data_without_payload
        .encode(head)
        .map_err(|e| Status::internal(format!("encoding a packet: {e}")))?;
    encode_key(DATA_PAYLOAD_TAG, WireType::LengthDelimited, head);
    encode_varint(payload.len() as u64, head);
    Ok(Some(payload.clone()))
}

/// `packet` framed as one gRPC message (see [`encode_into`]).
pub fn encode(packet: &Packet, max_message_len: usize) -> Result<EncodedPacket, Status> {
    let mut head = BytesMut::new();
    let payload = encode_into(packet, &mut head, max_message_len)?;
    Ok(EncodedPacket {
        head: head.freeze(),
        payload,
    })
}

fn check_len(len: usize, max: usize) -> Result<(), Status> {
    if len > max {
        return Err(Status::out_of_range(format!(
            "Error, encoded message length too large: found {len} bytes, the limit is: {max} bytes"
        )));
    }
    if u32::try_from(len).is_err() {
        return Err(Status::out_of_range(format!(
            "Error, encoded message length too large: found {len} bytes"
        )));
    }
    Ok(())
}

fn put_prefix(head: &mut BytesMut, len: usize) {
    head.put_u8(0);
    // `check_len` bounded it to u32.
    head.put_u32(len as u32);
}

/// The message `chunk` holds if it is exactly one valid, uncompressed
/// message within `max_message_len` (anything else is left to
/// [`MessageSplitter`], which also reports the errors).
fn lone_message(chunk: &Bytes, max_message_len: usize) -> Option<Bytes> {
    let prefix = chunk.get(..MESSAGE_PREFIX_LEN)?;
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    (prefix[0] == 0 && len <= max_message_len && chunk.len() == MESSAGE_PREFIX_LEN + len)
        .then(|| chunk.slice(MESSAGE_PREFIX_LEN..))
}

/// Splits received bytes into gRPC messages, slicing a message out of the
/// chunk it arrived in when it lies within one.
#[derive(Debug, Default)]
pub struct MessageSplitter {
    chunks: VecDeque<Bytes>,
    buffered: usize,
    /// The length of the message whose prefix was read.
    expecting: Option<usize>,
}

impl MessageSplitter {
    pub fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.buffered += chunk.len();
            self.chunks.push_back(chunk);
        }
    }

    /// Whether bytes of an incomplete message are held.
    pub fn has_partial(&self) -> bool {
        self.buffered > 0 || self.expecting.is_some()
    }

    /// The next whole message, if one has arrived.
    pub fn next_message(
        &mut self,
        max_message_len: usize,
    ) -> Result<Option<ReceivedMessage>, Status> {
        let len = match self.expecting {
            Some(len) => len,
            None => {
                if self.buffered < MESSAGE_PREFIX_LEN {
                    return Ok(None);
                }
                let mut prefix = self.take_parts(MESSAGE_PREFIX_LEN);
                match prefix.get_u8() {
                    0 => {}
                    1 => {
                        return Err(Status::internal(
                            "protocol error: received message with compressed-flag but no grpc-encoding was specified",
                        ));
                    }
                    flag => {
                        return Err(Status::internal(format!(
                            "protocol error: received message with invalid compression flag: {flag} (valid flags are 0 and 1)"
                        )));
                    }
                }
                let len = prefix.get_u32() as usize;
                if len > max_message_len {
                    return Err(Status::out_of_range(format!(
                        "Error, decoded message length too large: found {len} bytes, the limit is: {max_message_len} bytes"
                    )));
                }
                self.expecting = Some(len);
                len
            }
        };
        if self.buffered < len {
            return Ok(None);
        }
        self.expecting = None;
        Ok(Some(self.take_parts(len)))
    }

    /// The first `len` buffered bytes as the chunks (or parts of chunks)
    /// they arrived in: moving `Bytes` handles, not copying bytes.
    fn take_parts(&mut self, len: usize) -> ReceivedMessage {
        debug_assert!(len <= self.buffered);
        self.buffered -= len;
        let mut message = ReceivedMessage::default();
        let mut wanted = len;
        while wanted > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            let part = if front.len() > wanted {
                front.split_to(wanted)
            } else {
                self.chunks.pop_front().unwrap_or_default()
            };
            wanted -= part.len();
            message.push(part);
        }
        message
    }
}

/// One received gRPC message (its prefix removed) as the DATA frames it
/// arrived in. Our senders put a long payload in a frame of its own after a
/// small header frame, so a message nearly always spans frames; decoding
/// through this `Buf` lets prost take `Data.data` as a slice of the frame
/// that holds it (`copy_to_bytes` copies only bytes that straddle frames),
/// where joining the frames first would copy every payload once more.
#[derive(Debug, Clone, Default)]
pub struct ReceivedMessage {
    /// The part being read; the later parts follow in `rest`.
    front: Bytes,
    rest: VecDeque<Bytes>,
    remaining: usize,
}

impl ReceivedMessage {
    fn push(&mut self, part: Bytes) {
        if part.is_empty() {
            return;
        }
        self.remaining += part.len();
        if self.front.is_empty() {
            self.front = part;
        } else {
            self.rest.push_back(part);
        }
    }

    /// The message's bytes in one buffer (a copy when it spans frames).
    pub fn into_contiguous(mut self) -> Bytes {
        let len = self.remaining;
        self.copy_to_bytes(len)
    }

    /// Moves to the next part once the front one is used up.
    fn refill(&mut self) {
        while self.front.is_empty() {
            match self.rest.pop_front() {
                Some(next) => self.front = next,
                None => break,
            }
        }
    }
}

impl Buf for ReceivedMessage {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        &self.front
    }

    fn advance(&mut self, mut cnt: usize) {
        // prost advances once per byte of a short varint: stay within the
        // front part without looking at the rest.
        if cnt < self.front.len() {
            self.remaining -= cnt;
            self.front.advance(cnt);
            return;
        }
        assert!(
            cnt <= self.remaining,
            "advanced {cnt} bytes past a message's {} remaining",
            self.remaining
        );
        self.remaining -= cnt;
        while cnt > 0 {
            let step = cnt.min(self.front.len());
            self.front.advance(step);
            cnt -= step;
            self.refill();
        }
        self.refill();
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(
            len <= self.remaining,
            "took {len} bytes of a message's {} remaining",
            self.remaining
        );
        if self.front.len() >= len {
            self.remaining -= len;
            let taken = self.front.split_to(len);
            self.refill();
            return taken;
        }
        let mut joined = BytesMut::with_capacity(len);
        joined.put(Buf::take(&mut *self, len));
        joined.freeze()
    }
}

/// Which end of the call a [`PacketStream`] reads: a response's trailers
/// carry the call's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

/// The packets of a received gRPC stream (a request or response body).
pub struct PacketStream<B> {
    body: B,
    splitter: MessageSplitter,
    max_message_len: usize,
    direction: Direction,
    done: bool,
}

impl<B> std::fmt::Debug for PacketStream<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketStream")
            .field("direction", &self.direction)
            .field("buffered", &self.splitter.buffered)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<B> PacketStream<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    pub fn new(body: B, direction: Direction, max_message_len: usize) -> Self {
        PacketStream {
            body,
            splitter: MessageSplitter::default(),
            max_message_len,
            direction,
            done: false,
        }
    }

    /// The next packet; `None` when the peer ended the stream cleanly.
    pub async fn message(&mut self) -> Result<Option<Packet>, Status> {
        std::future::poll_fn(|cx| self.poll_packet(cx)).await
    }

    fn poll_packet(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Packet>, Status>> {
        loop {
            if self.done {
                return Poll::Ready(Ok(None));
            }
            match self.splitter.next_message(self.max_message_len) {
                Ok(Some(message)) => return Poll::Ready(self.decode(message)),
                Ok(None) => {}
                Err(status) => return Poll::Ready(Err(self.fail(status))),
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => match lone_message(&data, self.max_message_len) {
                        // One whole message and nothing before it: decoded
                        // from the chunk itself, without the splitter's parts.
                        Some(message) if !self.splitter.has_partial() => {
                            return Poll::Ready(self.decode(message));
                        }
                        _ => self.splitter.push(data),
                    },
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            return Poll::Ready(self.end(Some(&trailers)));
                        }
                    }
                },
                Some(Err(e)) => {
                    let status = Status::from_error(e.into());
                    if self.direction == Direction::Request
                        && status.code() == tonic::Code::Cancelled
                    {
                        self.done = true;
                        return Poll::Ready(Ok(None));
                    }
                    return Poll::Ready(Err(self.fail(status)));
                }
                None => return Poll::Ready(self.end(None)),
            }
        }
    }

    fn decode(&mut self, message: impl Buf) -> Result<Option<Packet>, Status> {
        Packet::decode(message)
            .map(Some)
            .map_err(|e| self.fail(Status::internal(e.to_string())))
    }

    fn fail(&mut self, status: Status) -> Status {
        self.done = true;
        status
    }

    /// The body ended (with `trailers`, if any).
    fn end(&mut self, trailers: Option<&HeaderMap>) -> Result<Option<Packet>, Status> {
        self.done = true;
        if self.splitter.has_partial() {
            return Err(Status::internal("Unexpected EOF decoding stream."));
        }
        if self.direction == Direction::Response {
            return match trailers.and_then(Status::from_header_map) {
                Some(status) if status.code() != tonic::Code::Ok => Err(status),
                Some(_) => Ok(None),
                None => Err(Status::unknown(
                    "protocol error: missing grpc-status trailer, stream was terminated without a final status",
                )),
            };
        }
        Ok(None)
    }
}

impl<B> Stream for PacketStream<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Item = Result<Packet, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        this.poll_packet(cx).map(Result::transpose)
    }
}

/// Which end of the call a [`PacketBody`] sends: a server ends its response
/// with trailers that carry the call's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Client,
    Server,
}

/// An HTTP body sending a stream of packets as gRPC messages (see the
/// module docs).
pub struct PacketBody<S> {
    packets: S,
    role: Role,
    max_message_len: usize,
    /// A long payload to send before anything else.
    payload: Option<Bytes>,
    /// How the packet stream ended, seen while frames were still to send.
    pending_end: Option<Status>,
    ended: bool,
    /// The last frame ended because the packet stream answered Pending: it
    /// holds that poll's waker.
    waiting: bool,
}

impl<S> std::fmt::Debug for PacketBody<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketBody")
            .field("role", &self.role)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl<S> PacketBody<S>
where
    S: Stream<Item = Result<Packet, Status>> + Unpin,
{
    pub fn new(packets: S, role: Role, max_message_len: usize) -> Self {
        PacketBody {
            packets,
            role,
            max_message_len,
            payload: None,
            pending_end: None,
            ended: false,
            waiting: false,
        }
    }

    /// Whether the frame just returned ended because the packet stream had
    /// nothing more: it will wake the poll that returned the frame when it
    /// has, so polling again before that finds nothing.
    pub fn waiting_for_packets(&self) -> bool {
        self.waiting
    }

    fn finish(&mut self, status: Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.ended = true;
        match self.role {
            Role::Server => {
                let mut trailers = HeaderMap::new();
                Poll::Ready(Some(
                    status
                        .add_header(&mut trailers)
                        .map(|()| Frame::trailers(trailers)),
                ))
            }
            Role::Client if status.code() == tonic::Code::Ok => Poll::Ready(None),
            Role::Client => Poll::Ready(Some(Err(status))),
        }
    }
}

impl<S> Body for PacketBody<S>
where
    S: Stream<Item = Result<Packet, Status>> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        this.waiting = false;
        if let Some(payload) = this.payload.take() {
            return Poll::Ready(Some(Ok(Frame::data(payload))));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        if let Some(status) = this.pending_end.take() {
            return this.finish(status);
        }
        let mut head = BytesMut::new();
        loop {
            let packet = match Pin::new(&mut this.packets).poll_next(cx) {
                Poll::Ready(Some(Ok(packet))) => packet,
                Poll::Ready(Some(Err(status))) if head.is_empty() => return this.finish(status),
                Poll::Ready(None) if head.is_empty() => return this.finish(Status::ok("")),
                Poll::Pending if head.is_empty() => return Poll::Pending,
                // Send what is encoded first; the end follows on the next call.
                Poll::Ready(Some(Err(status))) => {
                    this.pending_end = Some(status);
                    break;
                }
                Poll::Ready(None) => {
                    this.pending_end = Some(Status::ok(""));
                    break;
                }
                Poll::Pending => {
                    this.waiting = true;
                    break;
                }
            };
            match encode_into(&packet, &mut head, this.max_message_len) {
                Ok(Some(payload)) => {
                    this.payload = Some(payload);
                    break;
                }
                Ok(None) if head.len() >= COALESCE_UP_TO => break,
                Ok(None) => {}
                Err(status) if head.is_empty() => return this.finish(status),
                Err(status) => {
                    this.pending_end = Some(status);
                    break;
                }
            }
        }
        Poll::Ready(Some(Ok(Frame::data(head.freeze()))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.payload.is_none()
    }
}

/// Opens a bidirectional streaming call of packets on `service` (a tonic
/// `Channel`), as tonic's generated clients do: `request`'s metadata become
/// headers, a trailers-only error or a non-gRPC HTTP answer is the call's
/// error, and the response's packets are read with [`PacketStream`].
pub async fn streaming_call<T, S>(
    service: &mut T,
    path: http::uri::PathAndQuery,
    request: tonic::Request<S>,
    max_decoding_message_size: usize,
    max_encoding_message_size: usize,
) -> Result<tonic::Response<PacketStream<T::ResponseBody>>, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::ResponseBody: Body<Data = Bytes> + Unpin,
    <T::ResponseBody as Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S: Stream<Item = Packet> + Send + Unpin + 'static,
{
    let (metadata, extensions, packets) = request.into_parts();
    let body = PacketBody::new(
        futures_util::StreamExt::map(packets, Ok),
        Role::Client,
        max_encoding_message_size,
    );
    let mut http = http::Request::new(tonic::body::Body::new(body));
    *http.method_mut() = http::Method::POST;
    *http.version_mut() = http::Version::HTTP_2;
    *http.uri_mut() = http::Uri::from(path);
    *http.headers_mut() = metadata.into_headers();
    *http.extensions_mut() = extensions;
    http.headers_mut()
        .insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    http.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    let response = service
        .call(http)
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    check_response_head(response.status(), response.headers())?;
    let (parts, body) = response.into_parts();
    Ok(tonic::Response::from_parts(
        tonic::metadata::MetadataMap::from_headers(parts.headers),
        PacketStream::new(body, Direction::Response, max_decoding_message_size),
        parts.extensions,
    ))
}

/// The call's error in a response's head: a trailers-only error's
/// `grpc-status`, or a non-gRPC HTTP answer mapped as tonic maps it.
pub fn check_response_head(status: http::StatusCode, headers: &HeaderMap) -> Result<(), Status> {
    match Status::from_header_map(headers) {
        Some(grpc) if grpc.code() != tonic::Code::Ok => Err(grpc),
        Some(_) => Ok(()),
        None if status != http::StatusCode::OK => Err(status_of_http(status)),
        None => Ok(()),
    }
}

/// The gRPC status of an HTTP answer without one (gRPC's
/// http-grpc-status-mapping, as tonic applies it).
fn status_of_http(status: http::StatusCode) -> Status {
    let code = match status {
        http::StatusCode::BAD_REQUEST => tonic::Code::Internal,
        http::StatusCode::UNAUTHORIZED => tonic::Code::Unauthenticated,
        http::StatusCode::FORBIDDEN => tonic::Code::PermissionDenied,
        http::StatusCode::NOT_FOUND => tonic::Code::Unimplemented,
        http::StatusCode::TOO_MANY_REQUESTS
        | http::StatusCode::BAD_GATEWAY
        | http::StatusCode::SERVICE_UNAVAILABLE
        | http::StatusCode::GATEWAY_TIMEOUT => tonic::Code::Unavailable,
        _ => tonic::Code::Unknown,
    };
    Status::new(
        code,
        format!(
            "grpc-status header missing, mapped from HTTP status code {}",
            status.as_u16()
        ),
    )
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use http_body_util::{BodyExt, StreamBody};

    use super::*;
    use crate::packet;

    const MAX: usize = 4 * 1024 * 1024;

    /// What tonic sends for `p`: the prefix and prost's encoding.
    fn tonic_framing(p: &Packet) -> Vec<u8> {
        let body = p.encode_to_vec();
        let mut framed = vec![0];
        framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
        framed.extend_from_slice(&body);
        framed
    }

    fn sample_packets() -> Vec<Packet> {
        let long = Bytes::from((0..70_000u32).map(|i| i as u8).collect::<Vec<_>>());
        let mut with_error = packet::data(9, long.slice(..2048));
        if let Some(Payload::Data(d)) = &mut with_error.payload {
            d.error = "agent: connection reset".into();
        }
        let mut untyped = packet::data(3, long.slice(..4096));
        untyped.r#type = 0;
        vec![
            packet::data(1, long.clone()),
            packet::data(i64::MAX, long.slice(..CHAIN_PAYLOAD_AT)),
            packet::data(-5, long.slice(..CHAIN_PAYLOAD_AT - 1)),
            packet::data(0, long.slice(..20_000)),
            packet::data(7, Bytes::new()),
            with_error,
            untyped,
            packet::dial_request("10.0.0.1:443", 42),
            packet::dial_response_error(42, "refused"),
            packet::close_request(7),
            packet::window_update(7, 65_536),
            packet::drain(),
            Packet::default(),
        ]
    }

    #[test]
    fn the_bytes_are_what_tonic_sends() {
        for p in sample_packets() {
            let encoded = encode(&p, MAX).unwrap();
            let mut sent = encoded.head.to_vec();
            if let Some(payload) = &encoded.payload {
                sent.extend_from_slice(payload);
            }
            assert_eq!(sent, tonic_framing(&p), "{p:?}");
            assert_eq!(encoded.len(), sent.len());
        }
    }

    #[test]
    fn a_long_payload_is_sent_by_reference() {
        let payload = Bytes::from(vec![7u8; 64 * 1024]);
        let encoded = encode(&packet::data(1, payload.clone()), MAX).unwrap();
        let sent = encoded.payload.expect("a long payload is chained");
        assert_eq!(sent.as_ptr(), payload.as_ptr());
        assert!(
            encoded.head.len() < 32,
            "head: {} bytes",
            encoded.head.len()
        );
        let short = encode(&packet::data(1, payload.slice(..100)), MAX).unwrap();
        assert_eq!(short.payload, None);
    }

    #[test]
    fn a_packet_above_the_limit_is_refused() {
        let p = packet::data(1, Bytes::from(vec![0u8; 10_000]));
        let e = encode(&p, 9_000).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
        assert!(e.message().contains("too large"), "{e}");
        let e = encode(&packet::dial_request("x".repeat(100), 1), 50).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
    }

    fn wire(packets: &[Packet]) -> Vec<u8> {
        packets.iter().flat_map(tonic_framing).collect()
    }

    fn split_all(splitter: &mut MessageSplitter) -> Vec<Packet> {
        let mut out = Vec::new();
        while let Some(m) = splitter.next_message(MAX).unwrap() {
            out.push(Packet::decode(m).unwrap());
        }
        out
    }

    #[test]
    fn messages_split_anywhere_across_chunks_decode_whole() {
        let packets = sample_packets();
        let bytes = wire(&packets);
        // Every chunk size, and splits at every offset around each message
        // boundary (inside prefixes included).
        for chunk in [1, 2, 3, 5, 7, 4096, 16_384, 65_535, bytes.len()] {
            let mut splitter = MessageSplitter::default();
            let mut got = Vec::new();
            for c in bytes.chunks(chunk) {
                splitter.push(Bytes::copy_from_slice(c));
                got.extend(split_all(&mut splitter));
            }
            assert_eq!(got, packets, "chunks of {chunk}");
            assert!(!splitter.has_partial());
        }
        let first = tonic_framing(&packets[7]).len();
        for cut in 0..=first + 6 {
            let mut splitter = MessageSplitter::default();
            splitter.push(Bytes::copy_from_slice(&bytes[..cut]));
            let mut got = split_all(&mut splitter);
            splitter.push(Bytes::copy_from_slice(&bytes[cut..]));
            got.extend(split_all(&mut splitter));
            assert_eq!(got, packets, "cut at {cut}");
        }
    }

    #[test]
    fn a_message_within_one_chunk_is_decoded_without_a_copy() {
        let payload = Bytes::from(vec![3u8; 64 * 1024]);
        let chunk = Bytes::from(wire(&[packet::data(5, payload), packet::close_request(5)]));
        let mut splitter = MessageSplitter::default();
        splitter.push(chunk.clone());
        let got = Packet::decode(splitter.next_message(MAX).unwrap().unwrap()).unwrap();
        let Some(Payload::Data(d)) = got.payload else {
            panic!("not data: {got:?}");
        };
        let range = chunk.as_ptr() as usize..chunk.as_ptr() as usize + chunk.len();
        assert!(
            range.contains(&(d.data.as_ptr() as usize)),
            "the payload was copied out of its chunk"
        );
        assert!(splitter.next_message(MAX).unwrap().is_some());
    }

    #[test]
    fn a_payload_in_a_frame_of_its_own_is_decoded_without_a_copy() {
        // As our senders frame it: the head (prefix, packet fields, the
        // payload's key and length) in one DATA frame, the payload in the
        // next; then a packet that starts inside the payload's frame.
        let payload = Bytes::from(vec![4u8; 64 * 1024]);
        let encoded = encode(&packet::data(6, payload.clone()), MAX).unwrap();
        let sent = encoded.payload.expect("a long payload is chained");
        let close = tonic_framing(&packet::close_request(6));
        let mut tail = sent.to_vec();
        tail.extend_from_slice(&close[..3]);
        let tail = Bytes::from(tail);
        let head_len = encoded.head.len();
        let mut splitter = MessageSplitter::default();
        splitter.push(encoded.head);
        splitter.push(tail.clone());
        splitter.push(Bytes::copy_from_slice(&close[3..]));
        let message = splitter.next_message(MAX).unwrap().unwrap();
        assert_eq!(
            message.remaining(),
            head_len - MESSAGE_PREFIX_LEN + sent.len()
        );
        let got = Packet::decode(message).unwrap();
        let Some(Payload::Data(d)) = &got.payload else {
            panic!("not data: {got:?}");
        };
        assert_eq!(d.data, payload);
        assert_eq!(
            d.data.as_ptr(),
            tail.as_ptr(),
            "the payload was copied out of its frame"
        );
        let next = splitter.next_message(MAX).unwrap().unwrap();
        assert_eq!(Packet::decode(next).unwrap(), packet::close_request(6));
        assert!(!splitter.has_partial());
    }

    #[test]
    fn a_message_reads_the_same_through_its_parts_as_joined() {
        let packets = sample_packets();
        let bytes = wire(&packets);
        for chunk in [1, 3, 700, 16_384] {
            let mut splitter = MessageSplitter::default();
            for c in bytes.chunks(chunk) {
                splitter.push(Bytes::copy_from_slice(c));
            }
            let mut offset = 0;
            while let Some(mut message) = splitter.next_message(MAX).unwrap() {
                let len = message.remaining();
                let expected = &bytes[offset + 5..offset + 5 + len];
                // Reading in uneven steps through `chunk`, `advance` and
                // `copy_to_bytes` yields the message's bytes in order.
                let mut read = Vec::with_capacity(len);
                let mut step = 1;
                while message.has_remaining() {
                    let n = step.min(message.remaining());
                    if step % 2 == 0 {
                        read.extend_from_slice(&message.copy_to_bytes(n));
                    } else {
                        let n = n.min(message.chunk().len());
                        read.extend_from_slice(&message.chunk()[..n]);
                        message.advance(n);
                    }
                    step = step * 3 % 1_000 + 1;
                }
                assert_eq!(read, expected, "chunks of {chunk}, message at {offset}");
                offset += 5 + len;
            }
            assert_eq!(offset, bytes.len());
        }
    }

    #[test]
    fn bad_prefixes_are_errors() {
        let mut splitter = MessageSplitter::default();
        splitter.push(Bytes::from_static(&[0, 0, 0x10, 0, 1]));
        let e = splitter.next_message(1024 * 1024).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
        assert!(e.message().contains("too large"), "{e}");

        let mut splitter = MessageSplitter::default();
        splitter.push(Bytes::from_static(&[1, 0, 0, 0, 1, 0]));
        let e = splitter.next_message(MAX).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal);
        assert!(e.message().contains("compressed-flag"), "{e}");

        let mut splitter = MessageSplitter::default();
        splitter.push(Bytes::from_static(&[9, 0, 0, 0, 0]));
        assert_eq!(
            splitter.next_message(MAX).unwrap_err().code(),
            tonic::Code::Internal
        );
    }

    type Frames = Vec<Result<Frame<Bytes>, Status>>;

    type FrameBody =
        StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Status>>>>;

    fn body(frames: Frames) -> FrameBody {
        StreamBody::new(futures_util::stream::iter(frames))
    }

    fn trailers(code: tonic::Code, message: &str) -> Frame<Bytes> {
        let mut map = HeaderMap::new();
        Status::new(code, message).add_header(&mut map).unwrap();
        Frame::trailers(map)
    }

    #[tokio::test]
    async fn a_request_stream_yields_its_packets_then_ends() {
        let packets = sample_packets();
        let bytes = Bytes::from(wire(&packets));
        let frames = vec![
            Ok(Frame::data(bytes.slice(..1000))),
            Ok(Frame::data(bytes.slice(1000..))),
        ];
        let stream = PacketStream::new(body(frames), Direction::Request, MAX);
        let got: Vec<_> = stream.map(Result::unwrap).collect().await;
        assert_eq!(got, packets);
    }

    #[tokio::test]
    async fn a_stream_that_stops_inside_a_message_is_an_error() {
        let bytes = Bytes::from(wire(&[packet::close_request(1)]));
        let frames = vec![Ok(Frame::data(bytes.slice(..bytes.len() - 1)))];
        let mut stream = PacketStream::new(body(frames), Direction::Request, MAX);
        let e = stream.message().await.unwrap_err();
        assert!(e.message().contains("Unexpected EOF"), "{e}");
        assert!(
            stream.message().await.unwrap().is_none(),
            "ends after its error"
        );
    }

    #[tokio::test]
    async fn a_response_ends_with_the_status_in_its_trailers() {
        let bytes = Bytes::from(wire(&[packet::drain()]));
        let ok = vec![
            Ok(Frame::data(bytes.clone())),
            Ok(trailers(tonic::Code::Ok, "")),
        ];
        let mut stream = PacketStream::new(body(ok), Direction::Response, MAX);
        assert_eq!(stream.message().await.unwrap(), Some(packet::drain()));
        assert_eq!(stream.message().await.unwrap(), None);

        let failed = vec![
            Ok(Frame::data(bytes.clone())),
            Ok(trailers(tonic::Code::PermissionDenied, "not yours")),
        ];
        let mut stream = PacketStream::new(body(failed), Direction::Response, MAX);
        assert_eq!(stream.message().await.unwrap(), Some(packet::drain()));
        let e = stream.message().await.unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (tonic::Code::PermissionDenied, "not yours")
        );

        let mut stream =
            PacketStream::new(body(vec![Ok(Frame::data(bytes))]), Direction::Response, MAX);
        stream.message().await.unwrap();
        assert!(
            stream.message().await.is_err(),
            "a response without a status"
        );
    }

    #[tokio::test]
    async fn a_cancelled_request_ends_quietly_and_other_errors_surface() {
        let mut stream = PacketStream::new(
            body(vec![Err(Status::cancelled("gone"))]),
            Direction::Request,
            MAX,
        );
        assert!(stream.message().await.unwrap().is_none());
        let mut stream = PacketStream::new(
            body(vec![Err(Status::unavailable("reset"))]),
            Direction::Request,
            MAX,
        );
        assert_eq!(
            stream.message().await.unwrap_err().code(),
            tonic::Code::Unavailable
        );
    }

    async fn collect(
        body: impl Body<Data = Bytes, Error = Status> + Unpin,
    ) -> (Vec<Bytes>, Option<HeaderMap>) {
        let mut body = body;
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(frame) = body.frame().await {
            match frame.unwrap().into_data() {
                Ok(d) => data.push(d),
                Err(f) => trailers = f.into_trailers().ok(),
            }
        }
        (data, trailers)
    }

    #[tokio::test]
    async fn a_server_body_sends_the_packets_then_an_ok_status() {
        let packets = sample_packets();
        let items: Vec<Result<Packet, Status>> = packets.iter().cloned().map(Ok).collect();
        let sent = PacketBody::new(futures_util::stream::iter(items), Role::Server, MAX);
        let (frames, trailers) = collect(sent).await;
        assert_eq!(frames.concat(), wire(&packets));
        // Short packets share frames; each long payload is a frame of its own.
        let long_payloads = packets
            .iter()
            .filter(|p| matches!(&p.payload, Some(Payload::Data(d)) if d.data.len() >= CHAIN_PAYLOAD_AT))
            .count();
        assert!(
            frames.len() <= 2 * long_payloads + 1,
            "{} frames",
            frames.len()
        );
        let status = Status::from_header_map(&trailers.expect("trailers")).unwrap();
        assert_eq!(status.code(), tonic::Code::Ok);
    }

    #[tokio::test]
    async fn a_failed_stream_ends_the_body_with_its_status() {
        let items = vec![
            Ok(packet::close_request(1)),
            Err(Status::resource_exhausted("too many")),
        ];
        let (frames, trailers) = collect(PacketBody::new(
            futures_util::stream::iter(items.clone()),
            Role::Server,
            MAX,
        ))
        .await;
        assert_eq!(frames.concat(), wire(&[packet::close_request(1)]));
        let status = Status::from_header_map(&trailers.unwrap()).unwrap();
        assert_eq!(
            (status.code(), status.message()),
            (tonic::Code::ResourceExhausted, "too many")
        );

        // A client cannot send trailers: its body fails, which resets the stream.
        let mut client = PacketBody::new(futures_util::stream::iter(items), Role::Client, MAX);
        assert!(client.frame().await.unwrap().is_ok());
        let e = client.frame().await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(client.frame().await.is_none());
    }

    /// A frame that ends because the packets ran out says so (their stream
    /// then holds the waker); one cut short by a long payload does not.
    #[test]
    fn a_frame_that_drained_the_packets_says_so() {
        let queue = std::sync::Arc::new(std::sync::Mutex::new(VecDeque::new()));
        let source = queue.clone();
        let packets = futures_util::stream::poll_fn(move |_| {
            match source.lock().expect("queue").pop_front() {
                Some(packet) => Poll::Ready(Some(Ok(packet))),
                None => Poll::Pending,
            }
        });
        let mut body = PacketBody::new(packets, Role::Client, MAX);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut poll = |body: &mut PacketBody<_>| match Pin::new(body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => Some(frame.into_data().expect("data")),
            Poll::Pending => None,
            other => panic!("unexpected {other:?}"),
        };

        queue
            .lock()
            .expect("queue")
            .extend([packet::close_request(1), packet::close_request(2)]);
        let frame = poll(&mut body).expect("a frame");
        assert_eq!(
            frame,
            wire(&[packet::close_request(1), packet::close_request(2)])
        );
        assert!(body.waiting_for_packets());
        assert!(poll(&mut body).is_none());

        let long = packet::data(3, Bytes::from(vec![7u8; CHAIN_PAYLOAD_AT]));
        queue.lock().expect("queue").push_back(long.clone());
        let head = poll(&mut body).expect("the payload's head");
        assert!(!body.waiting_for_packets(), "cut short by the payload");
        let payload = poll(&mut body).expect("the payload");
        assert!(!body.waiting_for_packets());
        assert_eq!([head, payload].concat(), wire(&[long]));
        assert!(poll(&mut body).is_none());
    }

    #[tokio::test]
    async fn a_client_body_ends_without_trailers() {
        let items = vec![Ok(packet::close_request(1))];
        let (frames, trailers) = collect(PacketBody::new(
            futures_util::stream::iter(items),
            Role::Client,
            MAX,
        ))
        .await;
        assert_eq!(frames.concat(), wire(&[packet::close_request(1)]));
        assert!(trailers.is_none());
    }

    /// A stand-in server: answers every call with `answer(request)`.
    fn server(
        answer: fn(&http::Request<tonic::body::Body>) -> http::Response<tonic::body::Body>,
    ) -> impl tonic::client::GrpcService<
        tonic::body::Body,
        ResponseBody = tonic::body::Body,
        Future = std::future::Ready<Result<http::Response<tonic::body::Body>, Status>>,
        Error = Status,
    > {
        tower::service_fn(move |request: http::Request<tonic::body::Body>| {
            std::future::ready(Ok(answer(&request)))
        })
    }

    fn call_request() -> tonic::Request<futures_util::stream::Iter<std::vec::IntoIter<Packet>>> {
        let mut request = tonic::Request::new(futures_util::stream::iter(vec![packet::drain()]));
        request.metadata_mut().insert(
            "agentid",
            tonic::metadata::MetadataValue::from_static("a-1"),
        );
        request
    }

    #[tokio::test]
    async fn a_call_sends_grpc_headers_and_reads_the_answer() {
        let mut ok = server(|request| {
            assert_eq!(request.uri().path(), AGENT_CONNECT_PATH);
            assert_eq!(request.method(), http::Method::POST);
            assert_eq!(request.headers()["te"], "trailers");
            assert_eq!(request.headers()["content-type"], "application/grpc");
            assert_eq!(request.headers()["agentid"], "a-1");
            let mut ok = HeaderMap::new();
            Status::ok("").add_header(&mut ok).unwrap();
            let frames = vec![
                Ok(Frame::data(Bytes::from(wire(&[packet::close_request(4)])))),
                Ok(Frame::trailers(ok)),
            ];
            let mut response = http::Response::new(tonic::body::Body::new(body(frames)));
            response
                .headers_mut()
                .insert("serverid", http::HeaderValue::from_static("s-1"));
            response
        });
        let path = http::uri::PathAndQuery::from_static(AGENT_CONNECT_PATH);
        let response = streaming_call(&mut ok, path, call_request(), MAX, MAX)
            .await
            .unwrap();
        assert_eq!(response.metadata().get("serverid").unwrap(), "s-1");
        let mut packets = response.into_inner();
        assert_eq!(
            packets.message().await.unwrap(),
            Some(packet::close_request(4))
        );
        assert_eq!(packets.message().await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_refused_call_is_the_servers_status_or_the_http_statuss() {
        let mut refused = server(|_| Status::permission_denied("not yours").into_http());
        let path = http::uri::PathAndQuery::from_static(PROXY_PATH);
        let e = streaming_call(&mut refused, path.clone(), call_request(), MAX, MAX)
            .await
            .unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (tonic::Code::PermissionDenied, "not yours")
        );

        let mut not_grpc = server(|_| {
            let mut response = http::Response::new(tonic::body::Body::empty());
            *response.status_mut() = http::StatusCode::NOT_FOUND;
            response
        });
        let e = streaming_call(&mut not_grpc, path, call_request(), MAX, MAX)
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented);
        assert!(e.message().contains("404"), "{e}");
    }
}
