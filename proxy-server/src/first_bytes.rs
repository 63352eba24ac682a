//! Telling HTTP/2 from HTTP/1.1 by a connection's first bytes, where ALPN
//! did not: the client port's gRPC and HTTP CONNECT, the agent port's
//! gRPC and WebSocket upgrade.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::Version;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// What an HTTP/2 client sends first (RFC 9113, section 3.4).
pub(crate) const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the first bytes tell HTTP/2's preface from anything else
/// (HTTP/1.1); returns the version and what was read.
pub(crate) async fn read_version<IO: AsyncRead + Unpin>(
    io: &mut IO,
) -> std::io::Result<(Version, Bytes)> {
    let mut read = BytesMut::with_capacity(HTTP2_PREFACE.len());
    loop {
        if io.read_buf(&mut read).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if !HTTP2_PREFACE.starts_with(&read) {
            return Ok((Version::HTTP_11, read.freeze()));
        }
        if read.len() == HTTP2_PREFACE.len() {
            return Ok((Version::HTTP_2, read.freeze()));
        }
    }
}

/// A connection whose first bytes were already read: they are read again
/// first.
pub(crate) struct Rewind<IO> {
    read: Bytes,
    io: IO,
}

impl<IO> Rewind<IO> {
    pub(crate) fn new(io: IO, read: Bytes) -> Self {
        Rewind { read, io }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Rewind<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.read.is_empty() {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let n = this.read.len().min(buf.remaining());
        buf.put_slice(&this.read[..n]);
        this.read.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Rewind<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    #[tokio::test]
    async fn the_preface_tells_http2_and_what_was_read_is_read_again() {
        let (mut client, mut server) = tokio::io::duplex(1024);
        // The preface in two writes, as a slow client might send it.
        client.write_all(&HTTP2_PREFACE[..5]).await.unwrap();
        let detect = tokio::spawn(async move {
            let detected = read_version(&mut server).await.unwrap();
            (detected, server)
        });
        client.write_all(&HTTP2_PREFACE[5..]).await.unwrap();
        client.write_all(b"frames").await.unwrap();
        let ((version, read), server) = detect.await.unwrap();
        assert_eq!(version, Version::HTTP_2);
        let mut rewound = Rewind::new(server, read);
        let mut all = vec![0; HTTP2_PREFACE.len() + 6];
        rewound.read_exact(&mut all).await.unwrap();
        assert_eq!(&all[..HTTP2_PREFACE.len()], HTTP2_PREFACE);
        assert_eq!(&all[HTTP2_PREFACE.len()..], b"frames");
    }

    #[tokio::test]
    async fn anything_else_is_http1_as_soon_as_it_differs() {
        let (mut client, mut server) = tokio::io::duplex(1024);
        // "PR" could still be the preface; "PRO" cannot.
        client.write_all(b"PR").await.unwrap();
        let detect = tokio::spawn(async move { read_version(&mut server).await.unwrap() });
        client.write_all(b"OXY / HTTP/1.1").await.unwrap();
        let (version, read) = detect.await.unwrap();
        assert_eq!(version, Version::HTTP_11);
        assert!(read.starts_with(b"PR"), "{read:?}");
    }

    #[tokio::test]
    async fn a_connection_closed_before_its_first_bytes_is_an_error() {
        let (client, mut server) = tokio::io::duplex(1024);
        drop(client);
        let e = read_version(&mut server).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
