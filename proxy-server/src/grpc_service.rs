//! The server end of the client port's streaming method
//! (`ProxyService.Proxy`) under hyper, framed by
//! [`cluster_proxy_proto::grpc_framing`] instead of tonic's codec so no
//! payload is copied on its way through the server. The HTTP/2 exchange is
//! what tonic's generated servers do: the request's headers become the
//! call's metadata, an error before the stream starts is a trailers-only
//! response, and the response ends with trailers carrying the status. (The
//! agent port's `AgentService.Connect` answers the same way, from a task
//! per connection: [`crate::agent_port`].)

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use cluster_proxy_proto::Packet;
use cluster_proxy_proto::grpc_framing::{Direction, PacketBody, PacketStream, Role};
use futures_util::Stream;
use tonic::body::Body;
use tonic::metadata::MetadataMap;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

/// The packets a client or agent sends on its stream.
pub type InboundPackets = PacketStream<Body>;

/// One bidirectional streaming method of packets.
pub trait PacketMethod: Send + Sync + 'static {
    /// The gRPC service name (`package.Service`).
    const SERVICE: &'static str;
    /// The method's path (`/package.Service/Method`).
    const PATH: &'static str;
    type Outbound: Stream<Item = Result<Packet, Status>> + Send + Unpin + 'static;

    fn call(
        &self,
        request: Request<InboundPackets>,
    ) -> impl Future<Output = Result<Response<Self::Outbound>, Status>> + Send;
}

/// A tower service serving one [`PacketMethod`], for tonic's `Routes`.
pub struct PacketService<M> {
    method: Arc<M>,
    max_decoding_message_size: usize,
    max_encoding_message_size: usize,
}

impl<M> Clone for PacketService<M> {
    fn clone(&self) -> Self {
        PacketService {
            method: self.method.clone(),
            max_decoding_message_size: self.max_decoding_message_size,
            max_encoding_message_size: self.max_encoding_message_size,
        }
    }
}

impl<M: PacketMethod> PacketService<M> {
    pub fn new(
        method: M,
        max_decoding_message_size: usize,
        max_encoding_message_size: usize,
    ) -> Self {
        PacketService {
            method: Arc::new(method),
            max_decoding_message_size,
            max_encoding_message_size,
        }
    }
}

impl<M: PacketMethod> NamedService for PacketService<M> {
    const NAME: &'static str = M::SERVICE;
}

/// What tonic answers for a message encoding it was not built with; our
/// peers and upstream's never compress.
pub(crate) fn unsupported_encoding(headers: &http::HeaderMap) -> Option<Status> {
    let encoding = headers.get("grpc-encoding")?;
    if encoding.as_bytes() == b"identity" {
        return None;
    }
    let mut status = Status::unimplemented(format!(
        "Content is compressed with `{}` which isn't supported",
        String::from_utf8_lossy(encoding.as_bytes())
    ));
    status.metadata_mut().insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("identity"),
    );
    Some(status)
}

impl<M: PacketMethod> tower::Service<http::Request<Body>> for PacketService<M> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            if request.uri().path() != M::PATH {
                return Ok(Status::unimplemented("").into_http());
            }
            if let Some(status) = unsupported_encoding(request.headers()) {
                return Ok(status.into_http());
            }
            let (parts, body) = request.into_parts();
            let inbound =
                PacketStream::new(body, Direction::Request, this.max_decoding_message_size);
            let request = Request::from_parts(
                MetadataMap::from_headers(parts.headers),
                parts.extensions,
                inbound,
            );
            let response = match this.method.call(request).await {
                Ok(response) => response,
                Err(status) => return Ok(status.into_http()),
            };
            let (metadata, outbound, extensions) = response.into_parts();
            let mut http = http::Response::new(Body::new(PacketBody::new(
                outbound,
                Role::Server,
                this.max_encoding_message_size,
            )));
            *http.headers_mut() = metadata.into_headers();
            http.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            *http.extensions_mut() = extensions;
            Ok(http)
        })
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use cluster_proxy_proto::grpc_framing::encode;
    use cluster_proxy_proto::packet;
    use futures_util::StreamExt;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    /// Answers every packet with itself, after a `seen` header naming the
    /// caller's `who` metadata; refuses callers without it.
    struct Echo;

    impl PacketMethod for Echo {
        const SERVICE: &'static str = "Echo";
        const PATH: &'static str = "/Echo/Stream";
        type Outbound = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

        async fn call(
            &self,
            request: Request<InboundPackets>,
        ) -> Result<Response<Self::Outbound>, Status> {
            let who = request
                .metadata()
                .get("who")
                .cloned()
                .ok_or_else(|| Status::unauthenticated("who are you"))?;
            let mut response = Response::new(Box::pin(request.into_inner()) as Self::Outbound);
            response.metadata_mut().insert("seen", who);
            Ok(response)
        }
    }

    fn service() -> PacketService<Echo> {
        PacketService::new(Echo, 1024 * 1024, 1024 * 1024)
    }

    fn request(path: &str, packets: &[Packet]) -> http::Request<Body> {
        let mut wire = Vec::new();
        for p in packets {
            let e = encode(p, usize::MAX).unwrap();
            wire.extend_from_slice(&e.head);
            wire.extend_from_slice(e.payload.as_deref().unwrap_or_default());
        }
        http::Request::builder()
            .uri(path)
            .header("content-type", "application/grpc")
            .header("who", "tester")
            .body(Body::new(
                http_body_util::Full::new(Bytes::from(wire)).map_err(|e| match e {}),
            ))
            .unwrap()
    }

    #[tokio::test]
    async fn packets_come_back_with_metadata_and_an_ok_status() {
        let sent = vec![
            packet::data(1, Bytes::from(vec![5u8; 10_000])),
            packet::close_request(1),
        ];
        let response = service()
            .oneshot(request("/Echo/Stream", &sent))
            .await
            .unwrap();
        assert_eq!(response.headers()["content-type"], "application/grpc");
        assert_eq!(response.headers()["seen"], "tester");
        let mut received = PacketStream::new(response.into_body(), Direction::Response, 1 << 20);
        let mut got = Vec::new();
        while let Some(p) = received.next().await {
            got.push(p.unwrap());
        }
        assert_eq!(got, sent);
    }

    #[tokio::test]
    async fn a_refused_call_is_a_trailers_only_response() {
        let mut refused = request("/Echo/Stream", &[]);
        refused.headers_mut().remove("who");
        let response = service().oneshot(refused).await.unwrap();
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(
            (status.code(), status.message()),
            (tonic::Code::Unauthenticated, "who are you")
        );
        assert!(
            response
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn unknown_methods_and_compressed_messages_are_unimplemented() {
        let response = service()
            .oneshot(request("/Echo/Other", &[]))
            .await
            .unwrap();
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unimplemented);

        let mut gzip = request("/Echo/Stream", &[]);
        gzip.headers_mut()
            .insert("grpc-encoding", http::HeaderValue::from_static("gzip"));
        let response = service().oneshot(gzip).await.unwrap();
        assert_eq!(response.headers()["grpc-accept-encoding"], "identity");
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unimplemented);
        assert!(status.message().contains("gzip"), "{status:?}");
    }

    #[tokio::test]
    async fn an_oversized_message_fails_the_call_with_out_of_range() {
        let service = PacketService::new(Echo, 100, 1 << 20);
        let big = packet::data(1, Bytes::from(vec![0u8; 1000]));
        let response = service
            .oneshot(request("/Echo/Stream", &[big]))
            .await
            .unwrap();
        let (frames, trailers) = {
            let collected = response.into_body().collect().await.unwrap();
            let trailers = collected.trailers().cloned();
            (collected.to_bytes(), trailers)
        };
        assert!(frames.is_empty());
        let status = Status::from_header_map(&trailers.unwrap()).unwrap();
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert!(status.message().contains("too large"), "{status:?}");
    }
}
