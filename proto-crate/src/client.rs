//! A tunnel dialer for Rust users: open a TCP connection to `host:port` inside
//! a managed cluster through a proxy-server's gRPC client port.
//!
//! Each dial is one `ProxyService.Proxy` stream (konnectivity's contract), and
//! many dials share one HTTP/2 connection. The returned [`TunnelStream`] is an
//! ordinary `AsyncRead + AsyncWrite`. Konnectivity has no half-close: shutting
//! down the write side closes the tunneled connection.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

use crate::Packet;
use crate::flow::READ_CHUNK;
use crate::konnectivity::proxy_service_client::ProxyServiceClient;
use crate::packet::{self, Frame};
use crate::transport::MAX_MESSAGE_SIZE;

/// Default time to wait for the agent's dial response (upstream's backstop).
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("open proxy stream: {0}")]
    Stream(#[from] tonic::Status),
    #[error("dial failed: {0}")]
    Refused(String),
    #[error("dial closed by the server")]
    DialClosed,
    #[error("tunnel closed before the dial completed")]
    TunnelClosed,
    #[error("dial timeout after {0:?}")]
    Timeout(Duration),
}

/// Dials through one proxy-server.
#[derive(Clone, Debug)]
pub struct TunnelClient {
    grpc: ProxyServiceClient<Channel>,
    dial_timeout: Duration,
}

impl TunnelClient {
    pub fn new(channel: Channel) -> Self {
        TunnelClient {
            grpc: ProxyServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
            dial_timeout: DEFAULT_DIAL_TIMEOUT,
        }
    }

    pub fn with_dial_timeout(mut self, timeout: Duration) -> Self {
        self.dial_timeout = timeout;
        self
    }

    /// Opens a connection to `address` (`host:port`, the host naming the
    /// cluster or a service the agent serves).
    pub async fn dial(&self, address: &str) -> Result<TunnelStream, DialError> {
        let (requests, request_rx) = mpsc::channel::<Packet>(16);
        // Non-negative and non-zero, like the Go client's rand.Int63().
        let random = (rand::random::<i64>() & i64::MAX).max(1);
        // The channel has room: this cannot fail before the stream starts.
        let _ = requests.try_send(packet::dial_request(address, random));
        let mut responses = self
            .grpc
            .clone()
            .proxy(ReceiverStream::new(request_rx))
            .await?
            .into_inner();
        let connect_id = match tokio::time::timeout(
            self.dial_timeout,
            wait_dial_response(&mut responses, random),
        )
        .await
        {
            Ok(result) => result?,
            Err(_) => {
                let _ = requests.try_send(packet::close_dial(random));
                return Err(DialError::Timeout(self.dial_timeout));
            }
        };
        let (user, bridge) = tokio::io::duplex(4 * READ_CHUNK);
        tokio::spawn(bridge_connection(bridge, requests, responses, connect_id));
        Ok(TunnelStream {
            io: user,
            connect_id,
        })
    }
}

async fn wait_dial_response(
    responses: &mut Streaming<Packet>,
    random: i64,
) -> Result<i64, DialError> {
    loop {
        let Some(p) = responses.message().await? else {
            return Err(DialError::TunnelClosed);
        };
        match Frame::from_packet(p) {
            Frame::DialResponse {
                error,
                connect_id,
                random: r,
            } if r == random => {
                return if error.is_empty() && connect_id != 0 {
                    Ok(connect_id)
                } else if error.is_empty() {
                    Err(DialError::Refused(
                        "dial response without a connection id".into(),
                    ))
                } else {
                    Err(DialError::Refused(error))
                };
            }
            Frame::CloseDial { random: r } if r == random => return Err(DialError::DialClosed),
            _ => {}
        }
    }
}

async fn bridge_connection(
    bridge: DuplexStream,
    requests: mpsc::Sender<Packet>,
    mut responses: Streaming<Packet>,
    connect_id: i64,
) {
    let (mut from_user, mut to_user) = tokio::io::split(bridge);
    let upload = async {
        loop {
            let mut buf = BytesMut::with_capacity(READ_CHUNK);
            match from_user.read_buf(&mut buf).await {
                Ok(n) if n > 0 => {
                    if requests
                        .send(packet::data(connect_id, buf.freeze()))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                _ => break,
            }
        }
        let _ = requests.send(packet::close_request(connect_id)).await;
        // Keep the request stream open until the server answers CLOSE_RSP.
        std::future::pending::<()>().await
    };
    let download = async {
        while let Ok(Some(p)) = responses.message().await {
            match Frame::from_packet(p) {
                Frame::Data {
                    connect_id: id,
                    data,
                } if id == connect_id => {
                    let written = to_user.write_all(&data).await;
                    if written.is_err() {
                        break;
                    }
                }
                Frame::CloseResponse { .. } => break,
                _ => {}
            }
        }
        let _ = to_user.shutdown().await;
    };
    tokio::select! {
        _ = upload => {}
        _ = download => {}
    }
}

/// A TCP connection tunneled through the proxy-server.
#[derive(Debug)]
pub struct TunnelStream {
    io: DuplexStream,
    connect_id: i64,
}

impl TunnelStream {
    /// The agent-assigned connection id.
    pub fn connect_id(&self) -> i64 {
        self.connect_id
    }
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
