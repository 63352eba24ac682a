//! The Rust client's early data against a server that does not confirm it
//! (an upstream proxy-server drops the extension field): the client sends
//! the bytes as the connection's first DATA itself, so none are lost.

use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::konnectivity::proxy_service_server::{ProxyService, ProxyServiceServer};
use cluster_proxy_proto::packet::{self, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

const STEP: Duration = Duration::from_secs(5);

/// Answers each dial with connection id 7 and no early-data confirmation,
/// as a server without the extension does, and reports every packet after
/// the dial request.
struct UpstreamLikeServer {
    seen: mpsc::UnboundedSender<Frame>,
}

#[tonic::async_trait]
impl ProxyService for UpstreamLikeServer {
    type ProxyStream = ReceiverStream<Result<Packet, Status>>;

    async fn proxy(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::ProxyStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let seen = self.seen.clone();
        tokio::spawn(async move {
            while let Ok(Some(p)) = inbound.message().await {
                let frame = Frame::from_packet(p);
                if let Frame::DialRequest { random, .. } = &frame {
                    let _ = tx.send(Ok(packet::dial_response_ok(*random, 7))).await;
                }
                if let Frame::Data { connect_id, data } = &frame {
                    // Echo, so the client can read what arrived.
                    let _ = tx.send(Ok(packet::data(*connect_id, data.clone()))).await;
                }
                let _ = seen.send(frame);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

async fn next(seen: &mut mpsc::UnboundedReceiver<Frame>) -> Frame {
    tokio::time::timeout(STEP, seen.recv())
        .await
        .expect("a packet from the client")
        .expect("the server is running")
}

#[tokio::test]
async fn unconfirmed_early_data_is_sent_as_the_first_data() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ProxyServiceServer::new(UpstreamLikeServer {
                seen: seen_tx,
            }))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = TunnelClient::new(channel);
    let mut stream = client
        .dial_with_early_data("cluster-a:443", Bytes::from_static(b"hello"))
        .await
        .unwrap();
    let Frame::DialRequest { early_data, .. } = next(&mut seen).await else {
        panic!("expected DIAL_REQ first");
    };
    assert_eq!(
        &early_data[..],
        b"hello",
        "the dial request carries the bytes"
    );
    assert_eq!(
        next(&mut seen).await,
        Frame::Data {
            connect_id: 7,
            data: Bytes::from_static(b"hello")
        },
        "without a confirmation the client sends the bytes as DATA"
    );
    stream.write_all(b" world").await.unwrap();
    assert_eq!(
        next(&mut seen).await,
        Frame::Data {
            connect_id: 7,
            data: Bytes::from_static(b" world")
        }
    );
    let mut echoed = [0u8; 11];
    tokio::time::timeout(STEP, stream.read_exact(&mut echoed))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echoed, b"hello world");
}
