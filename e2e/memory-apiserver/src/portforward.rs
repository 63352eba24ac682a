//! `pods/portforward` over WebSocket, as kube-apiserver and the kubelet
//! serve it to kube-rs and other channel-protocol clients.
//!
//! * Authorization and the handshake: [`super::websocket`] (`get` and
//!   `create` on `pods/portforward`).
//! * Framing (kubelet's `wsstream`, subprotocol `v4.channel.k8s.io` or
//!   plain `channel.k8s.io`): every message is binary, its first byte the
//!   channel; port *i* of `?ports=` has data channel `2i` and error
//!   channel `2i+1`, and the first message on each carries the port as 2
//!   bytes little-endian. A port that cannot be reached gets its reason on
//!   its error channel, as the kubelet writes it.
//! * SPDY (`POST` with `Upgrade: SPDY/3.1`, what client-go's SPDY dialer
//!   and upstream's Go addon-agent use) and SPDY tunneled in WebSocket
//!   (`SPDY/3.1+portforward.k8s.io`, `kubectl port-forward` since 1.31):
//!   [`super::portforward_spdy`]. The base64 channel protocols are
//!   refused with a message saying so.
//!
//! Where a pod's port really is comes from [`super::pods::PodNetwork`],
//! which the kubelet stand-in fills.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response};
use hyper::body::Incoming;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;

use super::error::ApiError;
use super::pods::Endpoint;
use super::portforward_spdy;
use super::shared::{Body, Shared};
use super::spdy;
use super::store::User;
use super::websocket::{self, framed};

/// The WebSocket subprotocols served, preferred first: the binary
/// channel protocols and SPDY tunneled in WebSocket.
const SERVED: &[&str] = &[
    "v4.channel.k8s.io",
    "channel.k8s.io",
    portforward_spdy::TUNNEL_PROTOCOL,
];
/// Read size from a pod's port.
const CHUNK: usize = 32 * 1024;

/// The ports of `?ports=` (repeated or comma-separated), as the kubelet
/// parses them.
pub fn ports(query: Option<&str>) -> Result<Vec<u16>, ApiError> {
    let mut ports = Vec::new();
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if key != "ports" {
            continue;
        }
        for text in value.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let port: u16 = text.parse().map_err(|e| {
                ApiError::bad_request(format!("unable to parse {text:?} as a port: {e}"))
            })?;
            if port == 0 {
                return Err(ApiError::bad_request(format!("port {text:?} must be > 0")));
            }
            ports.push(port);
        }
    }
    if ports.is_empty() {
        return Err(ApiError::bad_request("at least one port must be specified"));
    }
    // Two channels per port, numbered by one byte.
    if ports.len() > 127 {
        return Err(ApiError::bad_request("at most 127 ports per request"));
    }
    Ok(ports)
}

/// Serves `GET|POST /api/v1/namespaces/{namespace}/pods/{name}/portforward`.
pub async fn serve(
    shared: &Shared,
    user: &User,
    mut request: Request<Incoming>,
    namespace: &str,
    name: &str,
) -> Result<Response<Body>, ApiError> {
    let t = super::pods::pod_type(&shared.store)?;
    websocket::authorize(
        shared,
        user,
        request.method(),
        &t,
        "portforward",
        namespace,
        name,
    )?;
    let pod = shared.store.get(&t, Some(namespace), name)?;
    let upgrade = request
        .headers()
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let pod_name = format!("{namespace}/{name}");
    let mut shutdown = shared.shutdown.clone();
    // Plain SPDY: client-go's SPDY dialer (and kubectl with
    // KUBECTL_PORT_FORWARD_WEBSOCKETS=false). The ports come in each
    // stream's headers.
    if upgrade == "spdy/3.1" && request.method() == http::Method::POST {
        let endpoint = running_endpoint(shared, &pod, namespace, name)?;
        let (response, on_upgrade, _) =
            spdy::accept(&mut request, &[portforward_spdy::STREAM_PROTOCOL], true)?;
        super::body::serve_upgraded(
            on_upgrade,
            format!("port-forward {pod_name}"),
            move |io| async move {
                tokio::select! {
                    () = portforward_spdy::serve(io, &pod_name, &endpoint) => {}
                    _ = shutdown.changed() => {}
                }
            },
        );
        return Ok(response);
    }
    websocket::require_websocket(&request, SERVED)?;
    let protocol = websocket::negotiate(&request, SERVED, true)?;
    let ports = if protocol == portforward_spdy::TUNNEL_PROTOCOL {
        Vec::new()
    } else {
        ports(request.uri().query())?
    };
    let endpoint = running_endpoint(shared, &pod, namespace, name)?;
    let (response, on_upgrade) = websocket::accept(&mut request, protocol)?;
    super::body::serve_upgraded(
        on_upgrade,
        format!("port-forward {pod_name}"),
        move |io| async move {
            let ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
            let served = async {
                if protocol == portforward_spdy::TUNNEL_PROTOCOL {
                    // kubectl 1.31+: SPDY inside WebSocket binary messages.
                    portforward_spdy::serve_tunneled(ws, &pod_name, &endpoint).await;
                } else {
                    relay(ws, &pod_name, &ports, &endpoint).await;
                }
            };
            tokio::select! {
                () = served => {}
                _ = shutdown.changed() => {}
            }
        },
    );
    Ok(response)
}

/// The kubelet's endpoint of `pod`, which must be bound to a node,
/// `Running`, and the one the kubelet stand-in runs under this uid (an
/// older pod of the same name is not this one).
pub(crate) fn running_endpoint(
    shared: &Shared,
    pod: &Value,
    namespace: &str,
    name: &str,
) -> Result<Endpoint, ApiError> {
    if pod
        .pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        return Err(ApiError::bad_request(format!(
            "pod {name} does not have a host assigned"
        )));
    }
    let phase = pod
        .pointer("/status/phase")
        .and_then(Value::as_str)
        .unwrap_or("Pending");
    if phase != "Running" {
        return Err(ApiError::new(
            500,
            "InternalError",
            format!(
                "unable to upgrade connection: pod {namespace}/{name} is not running (phase {phase})"
            ),
        ));
    }
    let uid = pod
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or_default();
    shared
        .pods
        .lookup(namespace, name)
        .filter(|e| e.uid == uid)
        .ok_or_else(|| {
            ApiError::new(
                500,
                "InternalError",
                format!("unable to upgrade connection: pod not found (\"{name}_{namespace}\")"),
            )
        })
}

/// What a port's reader tells the relay.
enum FromPod {
    Data(u8, Bytes),
    /// The port's connection ended (or never opened: the reason goes on
    /// its error channel).
    Done(usize, Option<String>),
}

async fn relay<S>(ws: WebSocketStream<S>, pod: &str, ports: &[u16], endpoint: &Endpoint)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut sink, mut stream) = ws.split();
    for (i, port) in ports.iter().enumerate() {
        let data = (2 * i) as u8;
        for channel in [data, data + 1] {
            if sink
                .send(framed(channel, &port.to_le_bytes()))
                .await
                .is_err()
            {
                return;
            }
        }
    }
    let (events, mut from_pods) = mpsc::channel::<FromPod>(16);
    let mut to_pods: BTreeMap<u8, mpsc::Sender<Bytes>> = BTreeMap::new();
    for (i, port) in ports.iter().enumerate() {
        let data = (2 * i) as u8;
        let target: Option<SocketAddr> = endpoint.target(*port);
        let (to_pod, rx) = mpsc::channel::<Bytes>(16);
        to_pods.insert(data, to_pod);
        tokio::spawn(port_task(
            i,
            data,
            *port,
            pod.to_string(),
            endpoint.clone(),
            target,
            rx,
            events.clone(),
        ));
    }
    drop(events);
    // The two directions run side by side: a pod that is slow to read
    // must not hold up what it sends to the client.
    let inbound = async {
        while let Some(message) = stream.next().await {
            match message {
                Ok(Message::Binary(bytes)) if bytes.len() > 1 => {
                    let channel = bytes[0];
                    // Error channels from the client carry nothing the
                    // kubelet acts on; unknown channels are dropped too.
                    if let Some(to_pod) = to_pods.get(&channel)
                        && to_pod.send(bytes.slice(1..)).await.is_err()
                    {
                        to_pods.remove(&channel);
                    }
                }
                Ok(Message::Close(_)) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let outbound = async {
        let mut open = ports.len();
        while let Some(event) = from_pods.recv().await {
            match event {
                FromPod::Data(channel, bytes) => {
                    if sink.send(framed(channel, &bytes)).await.is_err() {
                        return;
                    }
                }
                FromPod::Done(i, error) => {
                    if let Some(error) = error {
                        let channel = (2 * i + 1) as u8;
                        if sink.send(framed(channel, error.as_bytes())).await.is_err() {
                            return;
                        }
                    }
                    open = open.saturating_sub(1);
                    if open == 0 {
                        return;
                    }
                }
            }
        }
    };
    tokio::select! {
        () = inbound => {}
        () = outbound => {}
        () = endpoint.gone.cancelled() => {
            tracing::debug!(%pod, "pod gone; ending its port-forward");
        }
    }
    let _ = sink.send(websocket::normal_close()).await;
    let _ = sink.close().await;
}

#[allow(clippy::too_many_arguments)]
async fn port_task(
    index: usize,
    channel: u8,
    port: u16,
    pod: String,
    endpoint: Endpoint,
    target: Option<SocketAddr>,
    mut to_pod: mpsc::Receiver<Bytes>,
    events: mpsc::Sender<FromPod>,
) {
    let connected = match target {
        Some(addr) => endpoint
            .connect(addr)
            .await
            .map_err(|e| super::pods::dial_error(port, &e)),
        None => Err(format!(
            "dial tcp4 127.0.0.1:{port}: connect: connection refused"
        )),
    };
    let tcp = match connected {
        Ok(tcp) => tcp,
        Err(reason) => {
            let message = format!(
                "error forwarding port {port} to pod {pod}, uid {}: {reason}",
                endpoint.uid
            );
            let _ = events.send(FromPod::Done(index, Some(message))).await;
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    let (mut read, mut write) = tcp.into_split();
    let reader = {
        let events = events.clone();
        async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                match read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        let bytes = Bytes::copy_from_slice(&buf[..n]);
                        if events.send(FromPod::Data(channel, bytes)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some(bytes) = to_pod.recv().await {
            if write.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    // The channel protocol has no half-close: either direction ending
    // ends the port.
    tokio::select! {
        () = reader => {}
        () = writer => {}
    }
    let _ = events.send(FromPod::Done(index, None)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_parse_as_the_kubelet_does() {
        assert_eq!(ports(Some("ports=8091")).unwrap(), [8091]);
        assert_eq!(ports(Some("&ports=80%2C1234")).unwrap(), [80, 1234]);
        assert_eq!(ports(Some("ports=80&ports=81")).unwrap(), [80, 81]);
        for bad in [
            None,
            Some(""),
            Some("ports="),
            Some("ports=x"),
            Some("ports=0"),
            Some("ports=70000"),
        ] {
            assert_eq!(ports(bad).unwrap_err().code, 400, "{bad:?}");
        }
    }
}
