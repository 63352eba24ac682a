//! SPDY/3.1 framing, the server's half of what client-go's SPDY streams
//! (moby/spdystream) speak: `kubectl port-forward` sends it over a plain
//! `Upgrade: SPDY/3.1` connection or, since 1.31, tunneled in WebSocket
//! binary messages (`SPDY/3.1+portforward.k8s.io`).
//!
//! Hand-rolled because no Rust crate serves SPDY (the few that exist
//! dial, they do not accept streams). Only what those peers use is
//! here: SYN_STREAM / SYN_REPLY / RST_STREAM / PING / GOAWAY / DATA, with
//! header blocks in one zlib stream per direction that starts from the
//! SPDY/3 dictionary. SETTINGS, HEADERS and WINDOW_UPDATE are read and
//! dropped: spdystream does no flow control either.
//!
//! The dictionary: the reader's zlib stream names it by Adler-32
//! (`FDICT`), and neither miniz nor flate2's default backend takes a
//! preset dictionary. So the raw inflater is first fed a stored deflate
//! block holding the dictionary (its output is dropped): back-references
//! into the dictionary then land on those bytes, which is all a preset
//! dictionary is. Header blocks this side writes use no dictionary
//! (allowed: a zlib stream without `FDICT`).

use std::sync::OnceLock;

use bytes::Bytes;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use http::{Request, Response, header};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::shared::Body;

pub const TYPE_SYN_STREAM: u16 = 1;
pub const TYPE_SYN_REPLY: u16 = 2;
pub const TYPE_RST_STREAM: u16 = 3;
pub const TYPE_PING: u16 = 6;
pub const TYPE_GOAWAY: u16 = 7;
pub const FLAG_FIN: u8 = 0x01;
/// RST_STREAM statuses.
pub const PROTOCOL_ERROR: u32 = 1;
pub const REFUSED_STREAM: u32 = 3;
/// Header blocks larger than this, compressed or not, end the session:
/// a peer cannot make this side hold more.
const MAX_HEADER_BLOCK: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SpdyError {
    #[error("reading the SPDY connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("SPDY version {0} is not 3")]
    Version(u16),
    #[error("malformed {what} frame: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("header block: {0}")]
    Headers(String),
}

fn malformed(what: &'static str, detail: impl Into<String>) -> SpdyError {
    SpdyError::Malformed {
        what,
        detail: detail.into(),
    }
}

/// The SPDY/3 header dictionary (draft 3, section 2.6.10.1): the names
/// a request and response commonly carry, each after its 4-byte length,
/// then common values.
pub fn dictionary() -> &'static [u8] {
    static DICTIONARY: OnceLock<Vec<u8>> = OnceLock::new();
    DICTIONARY.get_or_init(|| {
        const NAMES: &[&str] = &[
            "options",
            "head",
            "post",
            "put",
            "delete",
            "trace",
            "accept",
            "accept-charset",
            "accept-encoding",
            "accept-language",
            "accept-ranges",
            "age",
            "allow",
            "authorization",
            "cache-control",
            "connection",
            "content-base",
            "content-encoding",
            "content-language",
            "content-length",
            "content-location",
            "content-md5",
            "content-range",
            "content-type",
            "date",
            "etag",
            "expect",
            "expires",
            "from",
            "host",
            "if-match",
            "if-modified-since",
            "if-none-match",
            "if-range",
            "if-unmodified-since",
            "last-modified",
            "location",
            "max-forwards",
            "pragma",
            "proxy-authenticate",
            "proxy-authorization",
            "range",
            "referer",
            "retry-after",
            "server",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "user-agent",
            "vary",
            "via",
            "warning",
            "www-authenticate",
            "method",
            "get",
            "status",
            "200 OK",
            "version",
            "HTTP/1.1",
            "url",
            "public",
            "set-cookie",
            "keep-alive",
            "origin",
        ];
        const VALUES: &str = concat!(
            "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505",
            "203 Non-Authoritative Information",
            "204 No Content",
            "301 Moved Permanently",
            "400 Bad Request",
            "401 Unauthorized",
            "403 Forbidden",
            "404 Not Found",
            "500 Internal Server Error",
            "501 Not Implemented",
            "503 Service Unavailable",
            "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec",
            " 00:00:00",
            " Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT",
            "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,public",
            "privatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
        );
        let mut bytes = Vec::with_capacity(1423);
        for name in NAMES {
            bytes.extend_from_slice(&(name.len() as u32).to_be_bytes());
            bytes.extend_from_slice(name.as_bytes());
        }
        bytes.extend_from_slice(VALUES.as_bytes());
        bytes
    })
}

/// zlib's Adler-32, to check the dictionary a stream asks for.
pub fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65521;
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5552) {
        for byte in chunk {
            a += u32::from(*byte);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

/// One direction's header name/value pairs; names lower case, values
/// with several entries joined by NUL as on the wire.
pub type Headers = Vec<(String, String)>;

/// Reads the peer's header blocks: one zlib stream across all of them.
pub struct HeaderReader {
    inflate: Decompress,
    /// The zlib header (and dictionary id) still to skip.
    header: Vec<u8>,
    started: bool,
}

impl Default for HeaderReader {
    fn default() -> Self {
        HeaderReader {
            inflate: Decompress::new(false),
            header: Vec::new(),
            started: false,
        }
    }
}

impl HeaderReader {
    fn inflate_all(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), SpdyError> {
        let mut chunk = vec![0u8; 4096];
        loop {
            let before_in = self.inflate.total_in();
            let before_out = self.inflate.total_out();
            let status = self
                .inflate
                .decompress(input, &mut chunk, FlushDecompress::Sync)
                .map_err(|e| SpdyError::Headers(e.to_string()))?;
            let read = (self.inflate.total_in() - before_in) as usize;
            let written = (self.inflate.total_out() - before_out) as usize;
            input = &input[read..];
            out.extend_from_slice(&chunk[..written]);
            if out.len() > MAX_HEADER_BLOCK {
                return Err(SpdyError::Headers("header block too large".into()));
            }
            if status == Status::StreamEnd {
                return Err(SpdyError::Headers("the header stream ended".into()));
            }
            if input.is_empty() && written < chunk.len() {
                return Ok(());
            }
            if read == 0 && written == 0 {
                return Err(SpdyError::Headers("the header stream is stuck".into()));
            }
        }
    }

    /// Decompresses and parses one header block.
    pub fn read(&mut self, block: &[u8]) -> Result<Headers, SpdyError> {
        let mut block = block;
        if !self.started {
            // CMF, FLG and, with FDICT, the dictionary's Adler-32.
            self.header.extend_from_slice(block);
            if self.header.len() < 2 {
                return Err(SpdyError::Headers("truncated zlib header".into()));
            }
            let (cmf, flg) = (self.header[0], self.header[1]);
            if cmf & 0x0f != 8 || (u16::from(cmf) << 8 | u16::from(flg)) % 31 != 0 {
                return Err(SpdyError::Headers("not a zlib stream".into()));
            }
            let mut skip = 2;
            if flg & 0x20 != 0 {
                let Some(id) = self.header.get(2..6) else {
                    return Err(SpdyError::Headers("truncated zlib dictionary id".into()));
                };
                let id = u32::from_be_bytes([id[0], id[1], id[2], id[3]]);
                if id != adler32(dictionary()) {
                    return Err(SpdyError::Headers(format!(
                        "zlib stream wants dictionary {id:#010x}, not SPDY/3's"
                    )));
                }
                skip = 6;
                // The preset dictionary, as a stored block whose output
                // is dropped.
                let dictionary = dictionary();
                let length = dictionary.len() as u16;
                let mut stored = vec![0u8];
                stored.extend_from_slice(&length.to_le_bytes());
                stored.extend_from_slice(&(!length).to_le_bytes());
                stored.extend_from_slice(dictionary);
                let mut primed = Vec::new();
                self.inflate_all(&stored, &mut primed)?;
            }
            block = &block[skip..];
            self.started = true;
            self.header.clear();
        }
        let mut plain = Vec::new();
        self.inflate_all(block, &mut plain)?;
        parse_headers(&plain)
    }
}

fn parse_headers(plain: &[u8]) -> Result<Headers, SpdyError> {
    let bad = |detail: &str| SpdyError::Headers(detail.to_string());
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], SpdyError> {
        let slice = plain.get(at..at + n).ok_or_else(|| bad("truncated"))?;
        at += n;
        Ok(slice)
    };
    let word = |bytes: &[u8]| u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let count = word(take(4)?);
    let mut headers = Vec::new();
    for _ in 0..count {
        let length = word(take(4)?);
        let name = String::from_utf8_lossy(take(length)?).to_ascii_lowercase();
        let length = word(take(4)?);
        let value = String::from_utf8_lossy(take(length)?).into_owned();
        headers.push((name, value));
    }
    Ok(headers)
}

/// Writes this side's header blocks: one zlib stream, sync-flushed per
/// block.
pub struct HeaderWriter {
    deflate: Compress,
}

impl Default for HeaderWriter {
    fn default() -> Self {
        HeaderWriter {
            deflate: Compress::new(Compression::default(), true),
        }
    }
}

impl HeaderWriter {
    pub fn write(&mut self, headers: &[(&str, &str)]) -> Result<Vec<u8>, SpdyError> {
        let mut plain = Vec::new();
        plain.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        for (name, value) in headers {
            for text in [name.to_ascii_lowercase().as_str(), value] {
                plain.extend_from_slice(&(text.len() as u32).to_be_bytes());
                plain.extend_from_slice(text.as_bytes());
            }
        }
        let mut out = Vec::with_capacity(plain.len() + 64);
        let mut input = &plain[..];
        loop {
            out.reserve(256);
            let before = self.deflate.total_in();
            self.deflate
                .compress_vec(input, &mut out, FlushCompress::Sync)
                .map_err(|e| SpdyError::Headers(e.to_string()))?;
            input = &input[(self.deflate.total_in() - before) as usize..];
            // Done once the input is in and the flush fitted.
            if input.is_empty() && out.len() < out.capacity() {
                return Ok(out);
            }
        }
    }
}

/// A frame as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    SynStream {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    RstStream {
        stream: u32,
        status: u32,
    },
    Ping(u32),
    GoAway,
    Data {
        stream: u32,
        fin: bool,
        data: Bytes,
    },
    /// SYN_REPLY, SETTINGS, HEADERS, WINDOW_UPDATE and unknown types: a
    /// server of client streams acts on none of them.
    Ignored,
}

fn word(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Reads the next frame; `None` at a clean end of the connection.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    headers: &mut HeaderReader,
) -> Result<Option<Frame>, SpdyError> {
    let mut head = [0u8; 8];
    match reader.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let flags = head[4];
    let length = (usize::from(head[5]) << 16) | (usize::from(head[6]) << 8) | usize::from(head[7]);
    if head[0] & 0x80 == 0 {
        let stream = word(&head[0..4]) & 0x7fff_ffff;
        let mut data = vec![0u8; length];
        reader.read_exact(&mut data).await?;
        return Ok(Some(Frame::Data {
            stream,
            fin: flags & FLAG_FIN != 0,
            data: Bytes::from(data),
        }));
    }
    let version = u16::from_be_bytes([head[0], head[1]]) & 0x7fff;
    if version != 3 {
        return Err(SpdyError::Version(version));
    }
    let kind = u16::from_be_bytes([head[2], head[3]]);
    if kind == TYPE_SYN_STREAM && length > MAX_HEADER_BLOCK {
        return Err(malformed("SYN_STREAM", "header block too large"));
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).await?;
    Ok(Some(match kind {
        TYPE_SYN_STREAM => {
            if body.len() < 10 {
                return Err(malformed("SYN_STREAM", format!("{} bytes", body.len())));
            }
            let stream = word(&body[0..4]) & 0x7fff_ffff;
            if stream == 0 {
                return Err(malformed("SYN_STREAM", "stream id 0"));
            }
            Frame::SynStream {
                stream,
                fin: flags & FLAG_FIN != 0,
                headers: headers.read(&body[10..])?,
            }
        }
        TYPE_RST_STREAM => {
            if body.len() != 8 {
                return Err(malformed("RST_STREAM", format!("{} bytes", body.len())));
            }
            Frame::RstStream {
                stream: word(&body[0..4]) & 0x7fff_ffff,
                status: word(&body[4..8]),
            }
        }
        TYPE_PING => {
            if body.len() != 4 {
                return Err(malformed("PING", format!("{} bytes", body.len())));
            }
            Frame::Ping(word(&body[0..4]))
        }
        TYPE_GOAWAY => Frame::GoAway,
        _ => Frame::Ignored,
    }))
}

fn control(kind: u16, flags: u8, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(8 + body.len());
    frame.extend_from_slice(&(0x8000u16 | 3).to_be_bytes());
    frame.extend_from_slice(&kind.to_be_bytes());
    frame.push(flags);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    frame.extend_from_slice(body);
    frame
}

/// SYN_REPLY accepting `stream`, with `headers`.
pub fn syn_reply(
    writer: &mut HeaderWriter,
    stream: u32,
    headers: &[(&str, &str)],
) -> Result<Vec<u8>, SpdyError> {
    let mut body = stream.to_be_bytes().to_vec();
    body.extend(writer.write(headers)?);
    Ok(control(TYPE_SYN_REPLY, 0, &body))
}

pub fn rst_stream(stream: u32, status: u32) -> Vec<u8> {
    let mut body = stream.to_be_bytes().to_vec();
    body.extend_from_slice(&status.to_be_bytes());
    control(TYPE_RST_STREAM, 0, &body)
}

pub fn ping(id: u32) -> Vec<u8> {
    control(TYPE_PING, 0, &id.to_be_bytes())
}

/// A DATA frame; with `fin`, this side's last on the stream. Payloads are
/// at most 16 MiB − 1 (the 24-bit length); callers send less.
pub fn data(stream: u32, fin: bool, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(8 + payload.len());
    frame.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    frame.push(if fin { FLAG_FIN } else { 0 });
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    frame.extend_from_slice(payload);
    frame
}

/// The header naming a SPDY upgrade's stream protocol.
const PROTOCOL_HEADER: &str = "x-stream-protocol-version";

/// Accepts a SPDY upgrade (`POST` with `Upgrade: SPDY/3.1`) for the first
/// of `served` the client offers (`X-Stream-Protocol-Version`): the `101`
/// naming it, and the connection it turns into. No common protocol is
/// the kubelet's 403. A client that offers none gets `served[0]` when
/// `allow_none` (the kubelet's pre-versioning default, which port-forward
/// still is), unnamed in the response.
pub fn accept(
    request: &mut Request<Incoming>,
    served: &[&'static str],
    allow_none: bool,
) -> Result<(Response<Body>, OnUpgrade, &'static str), ApiError> {
    let offered = super::websocket::offered(request, PROTOCOL_HEADER);
    let chosen = if offered.is_empty() && allow_none {
        served.first().copied()
    } else {
        served
            .iter()
            .find(|p| offered.iter().any(|o| o == *p))
            .copied()
    };
    let Some(protocol) = chosen else {
        return Err(ApiError::new(
            403,
            "Forbidden",
            format!(
                "unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server supports {served:?}"
            ),
        ));
    };
    let on_upgrade = hyper::upgrade::on(request);
    let mut response = super::body::switching_protocols("SPDY/3.1");
    let headers = response.headers_mut();
    if !offered.is_empty() {
        headers.insert(PROTOCOL_HEADER, header::HeaderValue::from_static(protocol));
    }
    Ok((response, on_upgrade, protocol))
}

/// What a session writes, in order (one header compressor).
pub enum Outgoing {
    /// SYN_REPLY accepting the stream, no headers.
    Reply(u32),
    Frame(Vec<u8>),
}

/// Writes a session's frames until every sender is gone, then closes the
/// connection's write side.
pub async fn write_frames<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut outgoing: mpsc::Receiver<Outgoing>,
) {
    let mut headers = HeaderWriter::default();
    while let Some(item) = outgoing.recv().await {
        let bytes = match item {
            Outgoing::Reply(stream) => match syn_reply(&mut headers, stream, &[]) {
                Ok(bytes) => bytes,
                Err(error) => {
                    tracing::debug!(%error, "SPDY reply");
                    return;
                }
            },
            Outgoing::Frame(bytes) => bytes,
        };
        if writer.write_all(&bytes).await.is_err() {
            return;
        }
    }
    let _ = writer.shutdown().await;
}

/// A header's value (names are lower case on the wire).
pub fn header<'h>(headers: &'h Headers, name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dictionary_is_spdy3s() {
        let dictionary = dictionary();
        assert_eq!(dictionary.len(), 1423);
        assert_eq!(&dictionary[..11], b"\0\0\0\x07options");
        assert!(dictionary.ends_with(b"enq=0."));
        assert_eq!(adler32(b"Wikipedia"), 0x11e6_0398);
    }

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Two header blocks as spdystream writes them: one zlib stream
    /// (level 9) with the SPDY/3 dictionary preset (`FDICT`), sync-flushed
    /// per block; made with Python's zlib (`compressobj(zdict=…)`).
    #[test]
    fn reads_header_blocks_compressed_against_the_dictionary() {
        let mut reader = HeaderReader::default();
        let error = reader
            .read(&hex("78f9e3c6a7c202253a703a2b294a4dcc851625aca9a0808614cb45e01c606e606000a4398b20d198094ade8c0600000000ffff"))
            .unwrap();
        let pairs = |kind: &str| {
            vec![
                ("streamtype".to_string(), kind.to_string()),
                ("port".to_string(), "7000".to_string()),
                ("requestid".to_string(), "0".to_string()),
            ]
        };
        assert_eq!(error, pairs("error"));
        let data = reader.read(&hex("c2aa19540e2512d60b000000ffff")).unwrap();
        assert_eq!(data, pairs("data"));
    }

    #[test]
    fn header_blocks_this_side_writes_read_back_across_one_stream() {
        let mut writer = HeaderWriter::default();
        let mut reader = HeaderReader::default();
        for round in 0..3 {
            let port = format!("{}", 8000 + round);
            let block = writer
                .write(&[("streamType", "data"), ("port", &port)])
                .unwrap();
            let headers = reader.read(&block).unwrap();
            assert_eq!(
                headers,
                [
                    ("streamtype".to_string(), "data".to_string()),
                    ("port".to_string(), port)
                ]
            );
        }
    }

    #[test]
    fn a_stream_naming_another_dictionary_is_refused() {
        let mut reader = HeaderReader::default();
        // CMF 0x78, FLG with FDICT (0xbb: 0x78bb % 31 == 0), a wrong id.
        let error = reader.read(&[0x78, 0xbb, 0, 0, 0, 1, 0]).unwrap_err();
        assert!(error.to_string().contains("dictionary"), "{error}");
    }
}
