//! `pods/portforward` over SPDY, as the kubelet's streaming server
//! serves it (`portforward.k8s.io`), on a plain upgraded connection or
//! tunneled in WebSocket binary messages.
//!
//! Per forwarded connection the client opens two streams with the same
//! `requestID` header: `streamType: error` (which it half-closes at once)
//! and `streamType: data`, both naming the `port`. Every stream gets a
//! SYN_REPLY (client-go waits for it). Once both are open the port is
//! dialled: data flows on the data stream; a port that cannot be reached
//! gets the kubelet's message on the error stream. The server then
//! closes both (a DATA frame with FIN), which kubectl waits for.

use std::collections::HashMap;
use std::net::SocketAddr;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

use super::pods::Endpoint;
use super::spdy::{self, Frame, HeaderReader, Outgoing, header};
use super::websocket;

/// The stream protocol of port-forwarding over SPDY.
pub const STREAM_PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocol of SPDY tunneled in WebSocket.
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
const CHUNK: usize = 32 * 1024;

/// From the client to one forwarded port: bytes, then `None` at its FIN.
type ToPod = mpsc::Sender<Option<Bytes>>;

#[derive(Default)]
struct Pair {
    error: Option<u32>,
    data: Option<(u32, Result<u16, String>)>,
}

fn parse_port(text: Option<&str>) -> Result<u16, String> {
    let text = text.ok_or("port header is missing")?;
    match text.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!("unable to parse {text:?} as a port")),
        Ok(port) => Ok(port),
    }
}

/// Serves one SPDY session until the client goes, says GOAWAY, breaks
/// the protocol, or the pod goes.
pub async fn serve<IO>(io: IO, pod: &str, endpoint: &Endpoint)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, writer) = tokio::io::split(io);
    let (out, outgoing) = mpsc::channel::<Outgoing>(64);
    let writes = spdy::write_frames(writer, outgoing);
    let reads = async {
        let mut headers = HeaderReader::default();
        let mut pairs: HashMap<String, Pair> = HashMap::new();
        let mut to_pods: HashMap<u32, ToPod> = HashMap::new();
        loop {
            let frame = match spdy::read_frame(&mut reader, &mut headers).await {
                Ok(Some(frame)) => frame,
                Ok(None) => return,
                Err(error) => {
                    tracing::debug!(%pod, %error, "SPDY port-forward session ends");
                    return;
                }
            };
            match frame {
                Frame::SynStream {
                    stream, headers, ..
                } => {
                    let request = header(&headers, "requestid").map(str::to_owned);
                    let kind = header(&headers, "streamtype");
                    let (Some(request), Some(kind @ ("error" | "data"))) = (request, kind) else {
                        let _ = out
                            .send(Outgoing::Frame(spdy::rst_stream(
                                stream,
                                spdy::REFUSED_STREAM,
                            )))
                            .await;
                        continue;
                    };
                    if out.send(Outgoing::Reply(stream)).await.is_err() {
                        return;
                    }
                    let pair = pairs.entry(request.clone()).or_default();
                    if kind == "error" {
                        pair.error = Some(stream);
                    } else {
                        pair.data = Some((stream, parse_port(header(&headers, "port"))));
                    }
                    if let Pair {
                        error: Some(error),
                        data: Some((data, port)),
                    } = pair
                    {
                        let (error, data, port) = (*error, *data, port.clone());
                        pairs.remove(&request);
                        let (to_pod, from_client) = mpsc::channel(16);
                        to_pods.insert(data, to_pod);
                        tokio::spawn(forward(
                            error,
                            data,
                            port,
                            pod.to_string(),
                            endpoint.clone(),
                            from_client,
                            out.clone(),
                        ));
                    }
                }
                Frame::Data { stream, fin, data } => {
                    if let Some(to_pod) = to_pods.get(&stream) {
                        let delivered = (data.is_empty() || to_pod.send(Some(data)).await.is_ok())
                            && (!fin || to_pod.send(None).await.is_ok());
                        if fin || !delivered {
                            to_pods.remove(&stream);
                        }
                    }
                }
                // A reset stream's forward ends (its sender dropped).
                Frame::RstStream { stream, .. } => {
                    to_pods.remove(&stream);
                }
                Frame::Ping(id) => {
                    if out.send(Outgoing::Frame(spdy::ping(id))).await.is_err() {
                        return;
                    }
                }
                Frame::GoAway => return,
                Frame::Ignored => {}
            }
        }
    };
    tokio::select! {
        () = reads => {}
        () = writes => {}
        () = endpoint.gone.cancelled() => {
            tracing::debug!(%pod, "pod gone; ending its port-forward");
        }
    }
}

/// One forwarded connection: dial the port, then copy both ways until the
/// pod closes it or the client resets it; close both streams at the end.
async fn forward(
    error_stream: u32,
    data_stream: u32,
    port: Result<u16, String>,
    pod: String,
    endpoint: Endpoint,
    mut from_client: mpsc::Receiver<Option<Bytes>>,
    out: mpsc::Sender<Outgoing>,
) {
    let send = |bytes: Vec<u8>| {
        let out = out.clone();
        async move { out.send(Outgoing::Frame(bytes)).await.is_ok() }
    };
    let dialled = match port {
        Err(reason) => Err(reason),
        Ok(port) => {
            let target: Option<SocketAddr> = endpoint.target(port);
            match target {
                Some(addr) => endpoint
                    .connect(addr)
                    .await
                    .map_err(|e| super::pods::dial_error(port, &e))
                    .map_err(|reason| {
                        format!(
                            "error forwarding port {port} to pod {pod}, uid {}: {reason}",
                            endpoint.uid
                        )
                    }),
                None => Err(format!(
                    "error forwarding port {port} to pod {pod}, uid {}: dial tcp4 127.0.0.1:{port}: connect: connection refused",
                    endpoint.uid
                )),
            }
        }
    };
    let tcp = match dialled {
        Ok(tcp) => tcp,
        Err(message) => {
            let _ = send(spdy::data(error_stream, false, message.as_bytes())).await;
            let _ = send(spdy::data(error_stream, true, &[])).await;
            let _ = send(spdy::data(data_stream, true, &[])).await;
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    let (mut read, mut write) = tcp.into_split();
    let from_pod = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if !send(spdy::data(data_stream, false, &buf[..n])).await {
                        return;
                    }
                }
            }
        }
    };
    // `false`: the client reset the stream (or the session ended).
    let to_pod = async {
        while let Some(item) = from_client.recv().await {
            match item {
                Some(bytes) => {
                    if write.write_all(&bytes).await.is_err() {
                        return true;
                    }
                }
                None => {
                    let _ = write.shutdown().await;
                    // Half-closed: the pod may still answer.
                    std::future::pending::<()>().await;
                }
            }
        }
        false
    };
    tokio::select! {
        () = from_pod => {}
        _ = to_pod => {}
        // The session ended: nothing more can reach the client.
        () = out.closed() => return,
        () = endpoint.gone.cancelled() => {}
    }
    let _ = send(spdy::data(data_stream, true, &[])).await;
    let _ = send(spdy::data(error_stream, true, &[])).await;
}

/// SPDY tunneled in WebSocket: every binary message carries SPDY bytes.
pub async fn serve_tunneled<S>(ws: WebSocketStream<S>, pod: &str, endpoint: &Endpoint)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (session, tunnel) = tokio::io::duplex(256 * 1024);
    let (mut sink, mut stream) = ws.split();
    let (mut tunnel_read, mut tunnel_write) = tokio::io::split(tunnel);
    let inbound = async move {
        while let Some(message) = stream.next().await {
            match message {
                Ok(Message::Binary(bytes)) => {
                    if tunnel_write.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
                Ok(Message::Close(_)) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let outbound = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match tunnel_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if sink.send(Message::binary(buf[..n].to_vec())).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = sink.send(websocket::normal_close()).await;
        let _ = sink.close().await;
    };
    let session = serve(session, pod, endpoint);
    tokio::pin!(outbound);
    tokio::select! {
        () = session => {
            // Let what the session wrote last reach the client.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), &mut outbound).await;
        }
        () = inbound => {}
        () = &mut outbound => {}
    }
}
