//! The client port: `ProxyService.Proxy` (gRPC over HTTP/2) and HTTP
//! CONNECT (HTTP/1.1) on one mTLS port, told apart per connection by its
//! first bytes. gRPC connections are driven by [`crate::grpc_port`], one
//! task each; HTTP/1.1 connections by hyper.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tracing::debug;

use crate::first_bytes::{Rewind, read_version};
use crate::grpc_frontend::GrpcFrontend;
use crate::grpc_port::GrpcConnections;
use crate::http_connect::ConnectFrontend;
use crate::listener::{
    self, FIRST_REQUEST_WINDOW, HEADER_READ_TIMEOUT, Http2Settings, HttpConnections, PeerInfo,
    ServeConnection,
};
use crate::policy::refusal;

type MakeService = Box<dyn Fn(Arc<PeerInfo>) -> ClientPortService + Send + Sync>;

/// Every connection of the client port.
pub struct ClientConnections {
    /// gRPC, when the port serves it (`--mode grpc` or `both`).
    grpc: Option<GrpcConnections<GrpcFrontend>>,
    /// HTTP/1.1 CONNECT, when the port serves it; with gRPC off, hyper also
    /// answers HTTP/2 connections (405).
    http: Option<HttpConnections<MakeService>>,
    shutdown: CancellationToken,
}

impl ClientConnections {
    /// The port serving `grpc`, `connect` or both; `http2` are the
    /// settings for hyper's HTTP/2 connections (gRPC's carry their own).
    pub fn new(
        grpc: Option<GrpcConnections<GrpcFrontend>>,
        connect: Option<Arc<ConnectFrontend>>,
        http2: Http2Settings,
        shutdown: CancellationToken,
    ) -> Self {
        let http = connect.map(|connect| {
            let service = ClientPortService {
                connect,
                refused: None,
                peer: None,
            };
            let make_service: MakeService =
                Box::new(move |peer: Arc<PeerInfo>| service.for_peer(&peer));
            listener::http("client", make_service, shutdown.clone(), http2)
        });
        ClientConnections {
            grpc,
            http,
            shutdown,
        }
    }
}

impl ServeConnection for ClientConnections {
    async fn serve<IO>(&self, mut io: IO, peer: PeerInfo, accepted_at: tokio::time::Instant)
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (grpc, http) = match (&self.grpc, &self.http) {
            (Some(grpc), None) => return grpc.serve(io, peer, accepted_at).await,
            (None, Some(http)) => return http.serve(io, peer, accepted_at).await,
            (Some(grpc), Some(http)) => (grpc, http),
            (None, None) => return,
        };
        let remote = peer.remote;
        let finish_from = async {
            self.shutdown.cancelled().await;
            tokio::time::sleep_until(accepted_at + FIRST_REQUEST_WINDOW).await;
        };
        let detected = tokio::select! {
            detected = tokio::time::timeout(HEADER_READ_TIMEOUT, read_version(&mut io)) => detected,
            // As hyper: a connection that has not sent its first bytes is dropped.
            _ = finish_from => return,
        };
        match detected {
            Ok(Ok((Version::HTTP_2, read))) => {
                grpc.serve(Rewind::new(io, read), peer, accepted_at).await
            }
            Ok(Ok((_, read))) => http.serve(Rewind::new(io, read), peer, accepted_at).await,
            Ok(Err(e)) => {
                debug!(listener = "client", %remote, error = %e, "connection ended before its first request")
            }
            Err(_) => {
                debug!(listener = "client", %remote, timeout = ?HEADER_READ_TIMEOUT, "no request in time; closing the connection")
            }
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// hyper's per-connection service on the client port: CONNECT over
/// HTTP/1.1; HTTP/2 requests reach it only with gRPC off.
#[derive(Clone)]
pub struct ClientPortService {
    connect: Arc<ConnectFrontend>,
    /// Why this connection's peer may not dial, if it may not.
    refused: Option<Arc<str>>,
    /// The client certificate of this connection, for the connection spans.
    peer: Option<Arc<PeerInfo>>,
}

impl ClientPortService {
    /// The service for one connection.
    fn for_peer(&self, peer: &Arc<PeerInfo>) -> Self {
        let mut service = self.clone();
        service.peer = Some(peer.clone());
        service.refused = refusal(peer).map(Arc::from);
        service
    }
}

impl tower::Service<Request<Incoming>> for ClientPortService {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<Incoming>) -> Self::Future {
        let http2 = request.version() == Version::HTTP_2;
        if let Some(peer) = &self.peer {
            request.extensions_mut().insert(peer.clone());
        }
        if let Some(reason) = &self.refused {
            let response = if http2 {
                tonic::Status::permission_denied(reason.to_string()).into_http()
            } else {
                let mut response = Response::new(Body::new(http_body_util::Full::new(
                    Bytes::from(format!("{reason}\n")),
                )));
                *response.status_mut() = StatusCode::FORBIDDEN;
                response
            };
            return Box::pin(async move { Ok(response) });
        }
        if http2 {
            return Box::pin(async {
                let mut response = Response::new(Body::empty());
                *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
                Ok(response)
            });
        }
        let connect = self.connect.clone();
        Box::pin(async move { Ok(connect.handle(request).await) })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cluster_proxy_proto::grpc_framing::{Direction, PROXY_PATH, PacketStream, encode};
    use cluster_proxy_proto::h2_driver::RecvBody;
    use cluster_proxy_proto::packet::{self, Frame};
    use futures_util::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::dial::Dialer;
    use crate::listener::serve_in_memory;
    use crate::metrics::Metrics;
    use crate::registry::{Registry, Strategy};

    /// The client port with both frontends, no agent and `shutdown`.
    fn port(shutdown: CancellationToken) -> ClientConnections {
        let metrics = Arc::new(Metrics::new());
        let dialer = Arc::new(Dialer {
            registry: Arc::new(Registry::new(vec![Strategy::DestHost])),
            metrics: metrics.clone(),
            timeout: Duration::from_secs(5),
            server_id: "test".into(),
            policy: None,
        });
        let http2 = Http2Settings {
            keepalive: None,
            max_concurrent_streams: 100,
            windows: cluster_proxy_proto::transport::CLIENT_WINDOWS,
        };
        let grpc = GrpcConnections {
            method: GrpcFrontend {
                dialer: dialer.clone(),
                metrics: metrics.clone(),
                first_packet_timeout: Duration::from_secs(5),
            },
            max_packet_size: 1 << 20,
            http2,
            shutdown: shutdown.clone(),
        };
        let connect = Arc::new(ConnectFrontend { dialer, metrics });
        ClientConnections::new(Some(grpc), Some(connect), http2, shutdown)
    }

    #[tokio::test]
    async fn http2_reaches_the_grpc_frontend_and_http1_reaches_hyper() {
        let (mut send, conn) =
            h2::client::handshake(serve_in_memory(port(CancellationToken::new())))
                .await
                .unwrap();
        tokio::spawn(conn);
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("http://server{PROXY_PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (response, mut body) = send.send_request(request, false).unwrap();
        let dial = encode(&packet::dial_request("nowhere:80", 7), usize::MAX).unwrap();
        body.send_data(dial.head, false).unwrap();
        let response = response.await.unwrap();
        let mut packets = PacketStream::new(
            RecvBody::new(response.into_body()),
            Direction::Response,
            1 << 20,
        );
        let answer = packets.next().await.expect("an answer").unwrap();
        match Frame::from_packet(answer) {
            Frame::DialResponse { random, error, .. } => {
                assert_eq!(random, 7);
                assert!(error.contains("No agent available"), "{error}");
            }
            other => panic!("expected a dial response, got {other:?}"),
        }

        let mut http1 = serve_in_memory(port(CancellationToken::new()));
        http1
            .write_all(b"GET / HTTP/1.1\r\nHost: server\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 12];
        http1.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 405");
    }

    /// A connection whose client never speaks holds a task and a socket;
    /// it gets what an HTTP/1.1 client gets for its request head.
    #[tokio::test(start_paused = true)]
    async fn a_connection_that_sends_nothing_is_closed_after_the_header_read_timeout() {
        let started = tokio::time::Instant::now();
        let mut silent = serve_in_memory(port(CancellationToken::new()));
        let mut buf = [0u8; 1];
        assert_eq!(silent.read(&mut buf).await.unwrap(), 0, "closed");
        assert!(
            started.elapsed() >= HEADER_READ_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
    }
}
