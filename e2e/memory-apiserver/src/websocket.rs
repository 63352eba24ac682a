//! What `pods/portforward`, `pods/exec` and `pods/attach` share: the
//! connect subresources' authorization and the WebSocket handshake that
//! the apiserver passes through to the kubelet's streaming server.
//!
//! * Authorization: a WebSocket upgrade is a `GET`, which RBAC sees as
//!   `get` on the subresource; since v1.35 the apiserver also requires
//!   `create` on it (`AuthorizePodWebsocketUpgradeCreatePermission`, on by
//!   default), the verb a `POST` (SPDY) needs. Both are checked before
//!   the pod is looked up, with kube-apiserver 1.36's messages.
//! * Only binary channel protocols are served (every message's first byte
//!   is its channel); the base64 variants and SPDY (plain or tunneled in
//!   WebSocket) are refused with a message saying so.

use http::{Method, Request, Response, header};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use super::error::ApiError;
use super::rbac;
use super::resources::ResourceType;
use super::shared::{Body, Shared};
use super::store::User;

fn attributes(verb: &str, subresource: &str, namespace: &str, name: &str) -> rbac::Attributes {
    rbac::Attributes::Resource {
        verb: verb.into(),
        group: String::new(),
        resource: format!("pods/{subresource}"),
        namespace: Some(namespace.to_string()),
        name: Some(name.to_string()),
    }
}

/// The authorization of a connect subresource (`pods/<subresource>`) for
/// `method`, as kube-apiserver 1.36 decides it.
pub fn authorize(
    shared: &Shared,
    user: &User,
    method: &Method,
    pods: &ResourceType,
    subresource: &str,
    namespace: &str,
    name: &str,
) -> Result<(), ApiError> {
    match *method {
        Method::GET => {
            // The authorization filter's check, by the method's verb.
            shared.authorize(user, &attributes("get", subresource, namespace, name))?;
            // The REST handler's `ensureAuthorizedForVerb`: its denial
            // carries no RBAC reason (kube-apiserver 1.36, live).
            shared
                .authorize(user, &attributes("create", subresource, namespace, name))
                .map_err(|_| {
                    ApiError::new(403, "Forbidden", format!("pods {name:?} is forbidden: "))
                        .about(pods, name)
                })
        }
        Method::POST => shared.authorize(user, &attributes("create", subresource, namespace, name)),
        ref other => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{other} is not supported on pods/{subresource}"),
        )),
    }
}

fn header_text(request: &Request<Incoming>, name: header::HeaderName) -> Option<&str> {
    request.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Refuses what is not a WebSocket upgrade: SPDY (with a message naming
/// what is served instead) and plain requests.
pub fn require_websocket(request: &Request<Incoming>, served: &[&str]) -> Result<(), ApiError> {
    let upgrade = header_text(request, header::UPGRADE)
        .unwrap_or_default()
        .to_ascii_lowercase();
    if upgrade.starts_with("spdy/") {
        return Err(ApiError::bad_request(format!(
            "unable to upgrade connection: SPDY is not served by this test API; use WebSocket ({})",
            served.join(", ")
        )));
    }
    if request.method() != Method::GET || upgrade != "websocket" {
        return Err(ApiError::bad_request("Upgrade request required"));
    }
    Ok(())
}

/// The protocols a client offers in `name` (repeated or comma-separated).
pub fn offered(request: &Request<Incoming>, name: &str) -> Vec<String> {
    request
        .headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

/// The subprotocol to answer with, the first of `served` the client
/// offered: `Some("")` when the client offered none (the kubelet then
/// speaks plain binary channels) and `allow_none`.
pub fn negotiate(
    request: &Request<Incoming>,
    served: &[&'static str],
    allow_none: bool,
) -> Result<&'static str, ApiError> {
    let offered = offered(request, header::SEC_WEBSOCKET_PROTOCOL.as_str());
    if offered.is_empty() && allow_none {
        return Ok("");
    }
    for protocol in served {
        if offered.iter().any(|p| p == protocol) {
            return Ok(protocol);
        }
    }
    let spdy = if offered.iter().any(|p| p.starts_with("SPDY/")) {
        " (SPDY over WebSocket is not served by this test API)"
    } else {
        ""
    };
    Err(ApiError::bad_request(format!(
        "unable to upgrade connection: requested protocol(s) are not supported: {offered:?}; supports {served:?}{spdy}"
    )))
}

/// Accepts the upgrade: the `101` to answer with (naming `protocol`
/// unless empty) and the connection it turns into.
pub fn accept(
    request: &mut Request<Incoming>,
    protocol: &'static str,
) -> Result<(Response<Body>, OnUpgrade), ApiError> {
    if header_text(request, header::SEC_WEBSOCKET_VERSION) != Some("13") {
        return Err(ApiError::bad_request(
            "unable to upgrade connection: Sec-WebSocket-Version must be 13",
        ));
    }
    let key = header_text(request, header::SEC_WEBSOCKET_KEY).ok_or_else(|| {
        ApiError::bad_request("unable to upgrade connection: no Sec-WebSocket-Key")
    })?;
    let accept = derive_accept_key(key.as_bytes());
    let on_upgrade = hyper::upgrade::on(request);
    let mut response = super::body::switching_protocols("websocket");
    let headers = response.headers_mut();
    headers.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        header::HeaderValue::from_str(&accept)
            .map_err(|e| ApiError::new(500, "InternalError", e.to_string()))?,
    );
    if !protocol.is_empty() {
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            header::HeaderValue::from_static(protocol),
        );
    }
    Ok((response, on_upgrade))
}

/// One binary channel message: the channel byte, then the payload.
pub fn framed(channel: u8, payload: &[u8]) -> Message {
    let mut bytes = Vec::with_capacity(payload.len() + 1);
    bytes.push(channel);
    bytes.extend_from_slice(payload);
    Message::binary(bytes)
}

/// The close the kubelet sends when a stream is done: code 1000. A close
/// without a code (1005) is an error to client-go ("next reader:
/// websocket: close 1005"), which then loses the exit status.
pub fn normal_close() -> Message {
    use tokio_tungstenite::tungstenite::protocol::CloseFrame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
    Message::Close(Some(CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    }))
}
