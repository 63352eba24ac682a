//! Raw HTTP/2 frames (RFC 9113 §4.1), for tests that stand in for a server
//! and must say or see exactly what an HTTP/2 library would not let them:
//! a GOAWAY with a chosen last stream id, a REFUSED_STREAM, the client's
//! SETTINGS as sent.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
/// The ACK flag of SETTINGS and PING.
pub const ACK: u8 = 0x1;
/// The client's connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The server side of a stand-in's TLS connection.
pub type StandInIo = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

/// One frame as received.
#[derive(Debug)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub payload: Vec<u8>,
}

/// Encodes one frame. Panics on a payload over 16 MiB (a test's bug).
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|len| *len < 1 << 24)
        .expect("a frame payload under 16 MiB")
        .to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Terminates TLS on `tcp` and reads the client's connection preface
/// (`InvalidData` if it is something else).
pub async fn accept_preface(
    acceptor: &tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
) -> std::io::Result<StandInIo> {
    let mut io = acceptor.accept(tcp).await?;
    let mut preface = [0u8; PREFACE.len()];
    io.read_exact(&mut preface).await?;
    if preface != PREFACE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not an HTTP/2 preface: {preface:?}"),
        ));
    }
    Ok(io)
}

/// Reads the next frame.
pub async fn read_frame(io: &mut StandInIo) -> std::io::Result<Frame> {
    let mut head = [0u8; 9];
    io.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    io.read_exact(&mut payload).await?;
    Ok(Frame {
        kind: head[3],
        flags: head[4],
        payload,
    })
}

/// Reads the next frame, acknowledging it first if it is the client's
/// SETTINGS (as a server must).
pub async fn read_frame_acking_settings(io: &mut StandInIo) -> std::io::Result<Frame> {
    let frame = read_frame(io).await?;
    if frame.kind == SETTINGS && frame.flags & ACK == 0 {
        io.write_all(&self::frame(SETTINGS, ACK, 0, &[])).await?;
    }
    Ok(frame)
}
