//! Long-lived TCP connections: keepalive and no Nagle.

use std::time::Duration;

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
