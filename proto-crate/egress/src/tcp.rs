//! Long-lived TCP connections: keepalive, no Nagle, and (across a
//! middlebox) no delayed ACKs.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use tokio::net::TcpStream;

/// Idle time before the kernel probes a long-lived TCP connection.
pub const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Time between probes once probing started.
pub const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered probes after which the kernel resets the connection: a peer
/// that vanished without FIN or RST is noticed within idle + 3 × interval
/// (a minute) even where no HTTP/2 PING runs, e.g. a tunneled target.
pub const TCP_KEEPALIVE_RETRIES: u32 = 3;

/// Turns on TCP keepalive with the values above; every long-lived socket
/// (tunnels, client connections, connections to targets) goes through it.
pub fn set_tcp_keepalive(tcp: &TcpStream) -> std::io::Result<()> {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(TCP_KEEPALIVE_IDLE)
        .with_interval(TCP_KEEPALIVE_INTERVAL);
    #[cfg(not(windows))]
    let keepalive = keepalive.with_retries(TCP_KEEPALIVE_RETRIES);
    let socket = socket2::SockRef::from(tcp);
    socket.set_tcp_keepalive(&keepalive)?;
    // Data the peer never acknowledges (its host is gone while we send)
    // fails the connection as soon as an idle one would, instead of after
    // the kernel's fifteen minutes of retransmissions.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    socket.set_tcp_user_timeout(Some(
        TCP_KEEPALIVE_IDLE + TCP_KEEPALIVE_INTERVAL * TCP_KEEPALIVE_RETRIES,
    ))?;
    Ok(())
}

/// Connects to `address` (`host:port`, names resolved by the system) with
/// TCP_NODELAY and keepalive: every hop we open carries small writes that
/// must not wait for a delayed ACK.
pub async fn connect(address: &str) -> std::io::Result<TcpStream> {
    let tcp = TcpStream::connect(address).await?;
    tcp.set_nodelay(true)?;
    set_tcp_keepalive(&tcp)?;
    Ok(tcp)
}

/// Sends the ACK of what `tcp` has received now rather than after the
/// kernel's delayed-ACK timer (40 ms and more on Linux), and leaves
/// delayed-ACK mode for a while (`TCP_QUICKACK`; the kernel drops back into
/// it on its own, so callers re-arm it after every read).
///
/// Why: forward proxies commonly keep Nagle's algorithm on for the
/// connections they relay (tinyproxy and microsocks do), so a small write
/// of theirs waits until their previous one is acknowledged. A tunnel's
/// exchanges are small writes in a row (dial request, dial response, first
/// bytes), and with our ACK delayed each such pair stalls the proxy for up
/// to a delayed-ACK period: 2–5 % of the direct path's connects/s in
/// `e2e/examples/agent_paths.rs` (2026-12-07). A no-op off Linux.
pub fn acknowledge_now(tcp: &TcpStream) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // A failure (the socket is already closed) changes nothing the
        // next read would not report.
        let _ = socket2::SockRef::from(tcp).set_tcp_quickack(true);
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = tcp;
}

/// A TCP stream that acknowledges what it receives at once
/// ([`acknowledge_now`] after every read that returned bytes): for
/// connections that may come through a middlebox relaying with Nagle's
/// algorithm on, such as the proxy-server's agent port.
#[derive(Debug)]
pub struct QuickAck(pub TcpStream);

impl QuickAck {
    pub fn get_ref(&self) -> &TcpStream {
        &self.0
    }
}

impl AsyncRead for QuickAck {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.0).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            acknowledge_now(&this.0);
        }
        polled
    }
}

impl AsyncWrite for QuickAck {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}
