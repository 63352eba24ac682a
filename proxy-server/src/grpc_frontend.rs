//! `ProxyService.Proxy`: the konnectivity gRPC frontend. One dial per stream,
//! many streams per HTTP/2 connection.

use std::sync::Arc;

use cluster_proxy_proto::Packet;
use cluster_proxy_proto::konnectivity::proxy_service_server::ProxyService;
use cluster_proxy_proto::packet::{self, Frame, PROTOCOL_TCP};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use crate::dial::{DialFailure, Dialer};
use crate::metrics::{Metrics, Segment};
use crate::tunnel::{ConnReceiver, FrontendEvent};

type Out = mpsc::Sender<Result<Packet, Status>>;

pub struct GrpcFrontend {
    pub dialer: Arc<Dialer>,
    pub metrics: Arc<Metrics>,
}

#[tonic::async_trait]
impl ProxyService for GrpcFrontend {
    type ProxyStream = ReceiverStream<Result<Packet, Status>>;

    async fn proxy(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::ProxyStream>, Status> {
        let inbound = request.into_inner();
        // Small: flow control lives in the per-connection queues, this only
        // decouples the session from tonic's encoder.
        let (out, out_rx) = mpsc::channel(4);
        let dialer = self.dialer.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let _gauge = metrics.grpc_stream("Proxy");
            Session {
                dialer,
                metrics: metrics.clone(),
                out,
            }
            .run(inbound)
            .await;
        });
        Ok(Response::new(ReceiverStream::new(out_rx)))
    }
}

struct Session {
    dialer: Arc<Dialer>,
    metrics: Arc<Metrics>,
    out: Out,
}

impl Session {
    async fn send(&self, p: Packet) -> bool {
        self.metrics
            .packet(Segment::ToClient, packet::type_name(&p));
        self.out.send(Ok(p)).await.is_ok()
    }

    async fn next(&self, inbound: &mut Streaming<Packet>) -> Option<Frame> {
        match inbound.message().await {
            Ok(Some(p)) => {
                let frame = Frame::from_packet(p);
                self.metrics.packet(Segment::FromClient, frame.type_name());
                Some(frame)
            }
            Ok(None) => None,
            Err(status) => {
                debug!(error = %status.message(), "client stream failed");
                None
            }
        }
    }

    async fn run(self, mut inbound: Streaming<Packet>) {
        // 1. Wait for the dial request.
        let (address, random) = loop {
            match self.next(&mut inbound).await {
                None => return,
                Some(Frame::DialRequest {
                    protocol,
                    address,
                    random,
                }) => {
                    if protocol != PROTOCOL_TCP {
                        let error =
                            format!("unsupported protocol {protocol:?}: only \"tcp\" is supported");
                        self.send(packet::dial_response_error(random, error)).await;
                        return;
                    }
                    break (address, random);
                }
                Some(Frame::Data { connect_id, .. }) => {
                    self.send(packet::close_response(
                        connect_id,
                        "backend not initialized",
                    ))
                    .await;
                    return;
                }
                Some(Frame::CloseRequest { connect_id }) => {
                    self.send(packet::close_response(connect_id, "backend uninitialized"))
                        .await;
                    return;
                }
                Some(_) => {}
            }
        };

        // 2. Dial, while watching the client for DIAL_CLS or disconnect.
        //    Dropping the dial future cancels it (and tells the agent).
        let dial = self.dialer.dial(&address, random);
        tokio::pin!(dial);
        let established = loop {
            tokio::select! {
                result = &mut dial => match result {
                    Ok(established) => break established,
                    Err(failure) => {
                        debug!(address, error = %failure.message(), "dial failed");
                        let reply = match failure {
                            DialFailure::ClosedByAgent => packet::close_dial(random),
                            other => packet::dial_response_error(random, other.message()),
                        };
                        self.send(reply).await;
                        return;
                    }
                },
                frame = self.next(&mut inbound) => match frame {
                    None => return,
                    Some(Frame::CloseDial { random: r }) if r == random => return,
                    Some(_) => {}
                },
            }
        };
        let connect_id = established.connect_id();
        if !self
            .send(packet::dial_response_ok(random, connect_id))
            .await
        {
            return;
        }

        // 3. Relay.
        let (sender, receiver) = established.split();
        let downlink = tokio::spawn(downlink(receiver, self.out.clone(), self.metrics.clone()));
        tokio::pin!(downlink);
        loop {
            tokio::select! {
                _ = &mut downlink => return,
                frame = self.next(&mut inbound) => match frame {
                    None => break,
                    Some(Frame::Data { connect_id: 0, .. }) => {}
                    Some(Frame::Data { connect_id: id, data }) if id == connect_id => {
                        if sender.send(data).await.is_err() {
                            break;
                        }
                    }
                    Some(Frame::CloseRequest { connect_id: id }) if id == connect_id => sender.request_close(),
                    Some(Frame::Data { connect_id: id, .. }) | Some(Frame::CloseRequest { connect_id: id }) => {
                        self.send(packet::close_response(id, "mismatched connection IDs")).await;
                        break;
                    }
                    Some(Frame::DialRequest { random: r, .. }) => {
                        self.send(packet::dial_response_error(r, "only one dial per stream is supported")).await;
                    }
                    Some(_) => {}
                },
            }
        }
        // The client is gone or broke the contract: close towards the agent and
        // let the downlink deliver the agent's CLOSE_RSP, if anyone still listens.
        sender.request_close();
        let _ = downlink.await;
    }
}

/// Forwards the agent's bytes and the final CLOSE_RSP to the client.
async fn downlink(mut receiver: ConnReceiver, out: Out, metrics: Arc<Metrics>) {
    let connect_id = receiver.connect_id();
    while let Some(delivery) = receiver.recv().await {
        let (p, len) = match &delivery.event {
            FrontendEvent::Data(data) => (packet::data(connect_id, data.clone()), data.len()),
            FrontendEvent::Closed(error) => {
                metrics.packet(Segment::ToClient, "CLOSE_RSP");
                let _ = out
                    .send(Ok(packet::close_response(connect_id, error.clone())))
                    .await;
                return;
            }
        };
        metrics.packet(Segment::ToClient, "DATA");
        if out.send(Ok(p)).await.is_err() {
            return;
        }
        drop(delivery);
        receiver.consumed(len);
    }
}
