//! The byte stream a dial returns, however it got there.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::{Connected, Connection};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A connection to the target: a TCP stream, direct or through an HTTP
/// CONNECT or SOCKS5 proxy (which leave the TCP stream to us once the
/// tunnel is set up), or our TLS session with an `https://` proxy that
/// carries the tunnel inside it. Through a proxy every read is acknowledged
/// at once ([`crate::tcp::acknowledge_now`]): proxies relay with Nagle's
/// algorithm on, and our delayed ACK would stall them.
#[derive(Debug)]
pub enum EgressStream {
    Tcp(TcpStream),
    Proxied(TcpStream),
    ProxyTls(Box<TlsStream<TcpStream>>),
}

impl EgressStream {
    /// The TCP connection underneath (to the target or to the proxy).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            EgressStream::Tcp(tcp) | EgressStream::Proxied(tcp) => tcp,
            EgressStream::ProxyTls(tls) => tls.get_ref().0,
        }
    }

    /// Whether the bytes go through a proxy's TLS session.
    pub fn is_proxy_tls(&self) -> bool {
        matches!(self, EgressStream::ProxyTls(_))
    }
}

impl AsyncRead for EgressStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = self.get_mut();
        let polled = match this {
            EgressStream::Tcp(tcp) | EgressStream::Proxied(tcp) => Pin::new(tcp).poll_read(cx, buf),
            EgressStream::ProxyTls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        };
        if !matches!(this, EgressStream::Tcp(_))
            && matches!(polled, Poll::Ready(Ok(())))
            && buf.filled().len() > before
        {
            crate::tcp::acknowledge_now(this.tcp());
        }
        polled
    }
}

impl AsyncWrite for EgressStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            EgressStream::Tcp(tcp) | EgressStream::Proxied(tcp) => {
                Pin::new(tcp).poll_write(cx, buf)
            }
            EgressStream::ProxyTls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            EgressStream::Tcp(tcp) | EgressStream::Proxied(tcp) => {
                Pin::new(tcp).poll_write_vectored(cx, bufs)
            }
            EgressStream::ProxyTls(tls) => Pin::new(tls.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            EgressStream::Tcp(tcp) | EgressStream::Proxied(tcp) => tcp.is_write_vectored(),
            EgressStream::ProxyTls(tls) => tls.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            EgressStream::Tcp(tcp) | EgressStream::Proxied(tcp) => Pin::new(tcp).poll_flush(cx),
            EgressStream::ProxyTls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            EgressStream::Tcp(tcp) | EgressStream::Proxied(tcp) => Pin::new(tcp).poll_shutdown(cx),
            EgressStream::ProxyTls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

/// hyper's pooled client asks every connection how it was made; a tunnel
/// through a proxy is, for HTTP's purposes, a direct connection (requests
/// keep their origin form).
impl Connection for EgressStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}
