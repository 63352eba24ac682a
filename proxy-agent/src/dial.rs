//! Endpoint dials with Go-style error texts: the proxy-server's HTTP CONNECT
//! frontend (ours and upstream's) maps them to 502/503/504 by substring, and
//! operators grep logs for them.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cluster_proxy_proto::packet::split_host_port;
use tokio::net::TcpStream;

use crate::metrics::DialFailure;

/// A failed dial: the text for DIAL_RSP and the metric reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DialError {
    pub message: String,
    pub reason: DialFailure,
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DialError {}

fn unknown(message: String) -> DialError {
    DialError {
        message,
        reason: DialFailure::Unknown,
    }
}

/// What Go's `syscall.Errno.Error()` prints for the errors connect(2) returns.
fn connect_error_text(e: &io::Error) -> Option<&'static str> {
    Some(match e.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused",
        io::ErrorKind::ConnectionReset => "connection reset by peer",
        io::ErrorKind::HostUnreachable => "no route to host",
        io::ErrorKind::NetworkUnreachable => "network is unreachable",
        io::ErrorKind::AddrNotAvailable => "cannot assign requested address",
        io::ErrorKind::PermissionDenied => "permission denied",
        _ => return None,
    })
}

/// Connects to `addr`. A fixed receive buffer must be set before the
/// connection exists: the window scale is agreed in the handshake.
async fn connect(addr: SocketAddr, receive_buffer: Option<u32>) -> io::Result<TcpStream> {
    let Some(size) = receive_buffer else {
        return TcpStream::connect(addr).await;
    };
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_recv_buffer_size(size)?;
    socket.connect(addr).await
}

/// Names resolved locally before DNS, like a pod's `hostAliases`.
pub type HostAliases = HashMap<String, IpAddr>;

/// Opens a TCP connection to `address` (`host:port`) within `timeout`,
/// with a kernel receive buffer of `receive_buffer` bytes when given.
pub async fn dial_tcp(
    address: &str,
    timeout: Duration,
    aliases: &HostAliases,
    receive_buffer: Option<u32>,
) -> Result<TcpStream, DialError> {
    let Some((host, port)) = split_host_port(address) else {
        return Err(unknown(format!(
            "dial tcp: address {address}: missing port in address"
        )));
    };
    let Ok(port) = port.parse::<u16>() else {
        return Err(unknown(format!(
            "dial tcp: address {address}: invalid port"
        )));
    };
    // The address being connected to, for the timeout text: Go names the
    // resolved address (`dial tcp 10.0.0.1:443: i/o timeout`), or the lookup
    // when resolving took the time (`dial tcp: lookup host: i/o timeout`).
    let current = std::sync::Mutex::new(None::<SocketAddr>);
    let attempt = async {
        // Resolve separately so a DNS failure reads like Go's resolver error
        // rather than getaddrinfo's.
        let addrs: Vec<_> = match aliases.get(host) {
            Some(ip) => vec![SocketAddr::new(*ip, port)],
            None => tokio::net::lookup_host((host, port))
                .await
                .map_err(|_| unknown(format!("dial tcp: lookup {host}: no such host")))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(unknown(format!("dial tcp: lookup {host}: no such host")));
        }
        let mut last = None;
        // Like Go, try each resolved address in turn and report the last error.
        for addr in addrs {
            if let Ok(mut current) = current.lock() {
                *current = Some(addr);
            }
            match connect(addr, receive_buffer).await {
                Ok(tcp) => {
                    // A target that vanishes mid-connection is noticed by
                    // the kernel's probes, not held open for hours.
                    if let Err(e) = cluster_proxy_runtime::net::set_tcp_keepalive(&tcp) {
                        tracing::debug!(%addr, error = %e, "TCP keepalive not set");
                    }
                    return Ok(tcp);
                }
                Err(e) => last = Some((addr, e)),
            }
        }
        let (addr, e) = last.ok_or_else(|| unknown(format!("dial tcp {address}: no address")))?;
        // Go names the resolved address in connect errors.
        Err(unknown(match connect_error_text(&e) {
            Some(text) => format!("dial tcp {addr}: connect: {text}"),
            None => format!("dial tcp {addr}: {e}"),
        }))
    };
    let tcp = match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result?,
        Err(_) => {
            let connecting = current.lock().ok().and_then(|c| *c);
            return Err(DialError {
                message: match connecting {
                    Some(addr) => format!("dial tcp {addr}: i/o timeout"),
                    None => format!("dial tcp: lookup {host}: i/o timeout"),
                },
                reason: DialFailure::Timeout,
            });
        }
    };
    // Interactive protocols (kubectl exec, TLS handshakes) need small writes
    // to leave at once; a failure here only costs latency.
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// Writes a dial's early data (the connection's first bytes, sent with the
/// dial request) to the freshly connected target, within `timeout`: a target
/// that accepts and never reads fails the dial instead of holding it.
pub async fn write_early_data(
    mut tcp: TcpStream,
    early_data: &[u8],
    timeout: Duration,
    address: &str,
) -> Result<TcpStream, DialError> {
    use tokio::io::AsyncWriteExt;
    match tokio::time::timeout(timeout, tcp.write_all(early_data)).await {
        Ok(Ok(())) => Ok(tcp),
        Ok(Err(e)) => Err(unknown(format!("write tcp {address}: {e}"))),
        Err(_) => Err(DialError {
            message: format!("write tcp {address}: i/o timeout"),
            reason: DialFailure::Timeout,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refused_port_reads_like_go() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        drop(listener);
        let err = dial_tcp(&address, Duration::from_secs(5), &HostAliases::new(), None)
            .await
            .unwrap_err();
        assert_eq!(
            err.message,
            format!("dial tcp {address}: connect: connection refused")
        );
        assert_eq!(err.reason, DialFailure::Unknown);
    }

    #[tokio::test]
    async fn malformed_addresses_are_reported_not_panicked_on() {
        let err = dial_tcp("no-port", Duration::from_secs(1), &HostAliases::new(), None)
            .await
            .unwrap_err();
        assert_eq!(
            err.message,
            "dial tcp: address no-port: missing port in address"
        );
        let err = dial_tcp(
            "host:http99",
            Duration::from_secs(1),
            &HostAliases::new(),
            None,
        )
        .await
        .unwrap_err();
        assert!(err.message.contains("invalid port"), "{err}");
    }

    #[tokio::test]
    async fn unresolvable_host_reads_like_go() {
        let err = dial_tcp(
            "does-not-exist.invalid:80",
            Duration::from_secs(5),
            &HostAliases::new(),
            None,
        )
        .await
        .unwrap_err();
        // A sandbox without DNS may time out instead; both are Go texts.
        assert!(
            err.message == "dial tcp: lookup does-not-exist.invalid: no such host"
                || err.message == "dial tcp: lookup does-not-exist.invalid: i/o timeout",
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_timeout_names_the_resolved_address_like_go() {
        // A listener whose accept queue is full: the kernel drops further
        // SYNs, so a connect neither succeeds nor fails.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let target = listener.local_addr().unwrap();
        let mut fillers = Vec::new();
        loop {
            match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(target)).await
            {
                Ok(Ok(tcp)) => fillers.push(tcp),
                Ok(Err(e)) => panic!("filling the accept queue: {e}"),
                Err(_) => break,
            }
            assert!(fillers.len() < 64, "the accept queue never filled");
        }
        let aliases = HostAliases::from([("cluster-a".to_owned(), target.ip())]);
        let err = dial_tcp(
            &format!("cluster-a:{}", target.port()),
            Duration::from_millis(300),
            &aliases,
            None,
        )
        .await
        .unwrap_err();
        assert_eq!(err.message, format!("dial tcp {target}: i/o timeout"));
        assert_eq!(err.reason, DialFailure::Timeout);
    }

    #[tokio::test]
    async fn host_aliases_resolve_before_dns() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let aliases = HostAliases::from([("cluster-a".to_owned(), "127.0.0.1".parse().unwrap())]);
        dial_tcp(
            &format!("cluster-a:{port}"),
            Duration::from_secs(5),
            &aliases,
            None,
        )
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn connects_and_sets_nodelay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let tcp = dial_tcp(&address, Duration::from_secs(5), &HostAliases::new(), None)
            .await
            .unwrap();
        assert!(tcp.nodelay().unwrap());
    }

    #[tokio::test]
    async fn a_fixed_receive_buffer_is_set_before_connecting() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let fixed = dial_tcp(
            &address,
            Duration::from_secs(5),
            &HostAliases::new(),
            Some(32 * 1024),
        )
        .await
        .unwrap();
        // Linux doubles the value for its bookkeeping.
        assert_eq!(
            socket2::SockRef::from(&fixed).recv_buffer_size().unwrap(),
            64 * 1024
        );
        let autotuned = dial_tcp(&address, Duration::from_secs(5), &HostAliases::new(), None)
            .await
            .unwrap();
        assert_ne!(
            socket2::SockRef::from(&autotuned)
                .recv_buffer_size()
                .unwrap(),
            64 * 1024
        );
    }
}
