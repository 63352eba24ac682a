//! A TCP load balancer standing in for the Kubernetes Service in front of the
//! proxy-server replicas' agent ports: each new connection goes to the next
//! backend in turn, skipping backends that refuse, so an agent that keeps
//! connecting meets every live replica (it learns how many exist from the
//! `servercount` header).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Accepts on `listener` forever and splices each connection to a backend.
pub async fn serve(listener: TcpListener, backends: Vec<SocketAddr>) -> std::io::Result<()> {
    let backends = Arc::new(backends);
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let (inbound, peer) = listener.accept().await?;
        let backends = backends.clone();
        let next = next.clone();
        tokio::spawn(async move {
            let start = next.fetch_add(1, Ordering::Relaxed);
            let Some(mut outbound) = connect_any(&backends, start).await else {
                tracing::warn!(%peer, "no backend accepts connections; closing");
                return;
            };
            let mut inbound = inbound;
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        });
    }
}

async fn connect_any(backends: &[SocketAddr], start: usize) -> Option<TcpStream> {
    for offset in 0..backends.len() {
        let backend = backends[(start + offset) % backends.len()];
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(backend)).await {
            Ok(Ok(stream)) => return Some(stream),
            Ok(Err(err)) => tracing::debug!(%backend, %err, "backend refused"),
            Err(_) => tracing::debug!(%backend, "backend connect timed out"),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn tagged_backend(tag: u8) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let _ = socket.write_all(&[tag]).await;
            }
        });
        addr
    }

    async fn first_byte(addr: SocketAddr) -> u8 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await.unwrap();
        byte[0]
    }

    #[tokio::test]
    async fn alternates_and_skips_dead_backends() {
        let a = tagged_backend(1).await;
        let b = tagged_backend(2).await;
        let dead = crate::targets::closed_port().await.unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, vec![a, dead, b]));
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(first_byte(front).await);
        }
        assert!(seen.contains(&1) && seen.contains(&2), "{seen:?}");
    }
}
