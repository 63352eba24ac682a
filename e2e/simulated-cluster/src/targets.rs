//! Target services that stand in for what lives inside a managed cluster.

use std::net::SocketAddr;

use std::future::Future;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A TCP server on an ephemeral 127.0.0.1 port that runs `handler` for
/// every accepted connection (with TCP_NODELAY). Stops when dropped.
pub struct TcpTarget {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl TcpTarget {
    pub async fn serve<F, Fut>(handler: F) -> std::io::Result<Self>
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        Self::serve_on(TcpListener::bind("127.0.0.1:0").await?, handler)
    }

    /// [`TcpTarget::serve`] on a listener the caller bound (in another
    /// network namespace, say: [`crate::netns::listen_in`]).
    pub fn serve_on<F, Fut>(listener: TcpListener, handler: F) -> std::io::Result<Self>
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let _ = socket.set_nodelay(true);
                tokio::spawn(handler(socket));
            }
        });
        Ok(TcpTarget { addr, task })
    }
}

impl Drop for TcpTarget {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TCP echo server on 127.0.0.1. Stops when dropped.
pub struct EchoServer {
    pub addr: SocketAddr,
    _target: TcpTarget,
}

impl EchoServer {
    pub async fn start() -> std::io::Result<Self> {
        Self::on(TcpListener::bind("127.0.0.1:0").await?)
    }

    /// An echo server on a listener the caller bound.
    pub fn on(listener: TcpListener) -> std::io::Result<Self> {
        let target = TcpTarget::serve_on(listener, |mut socket| async move {
            let (mut r, mut w) = socket.split();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = w.shutdown().await;
        })?;
        Ok(EchoServer {
            addr: target.addr,
            _target: target,
        })
    }
}

/// A minimal HTTP/1.1 server answering every request with `200` and a fixed
/// body, then closing — enough for curl and Python clients.
pub struct HttpServer {
    pub addr: SocketAddr,
    _target: TcpTarget,
}

impl HttpServer {
    pub async fn start(body: &'static str) -> std::io::Result<Self> {
        let target = TcpTarget::serve(move |mut socket| async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match socket.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
                if head.len() > 64 * 1024 {
                    return;
                }
            }
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
            let _ = socket.shutdown().await;
        })
        .await?;
        Ok(HttpServer {
            addr: target.addr,
            _target: target,
        })
    }
}

/// A port on 127.0.0.1 with nothing listening (bound, then released).
pub async fn closed_port() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    listener.local_addr()
}

/// A loopback TCP port that nothing listens on right now, for a process a
/// test starts later. It is taken below the kernel's ephemeral range
/// (32768 and up): a port from `bind(:0)` comes from that range, where any
/// outgoing connection of a test running beside this one may hold it by the
/// time the process binds it (CI saw `AddrInUse`).
pub fn free_port() -> u16 {
    (0..1000)
        .map(|_| 20_000 + rand::random::<u16>() % 12_000)
        .find(|candidate| std::net::TcpListener::bind(("127.0.0.1", *candidate)).is_ok())
        .unwrap_or_else(|| panic!("no free loopback port between 20000 and 32000"))
}
