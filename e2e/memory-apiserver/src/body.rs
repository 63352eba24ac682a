//! Request and response bodies: JSON answers, and request bodies in the
//! media types clients send (JSON, YAML for apply patches, protobuf).

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::Value;

use super::error::ApiError;
use super::protobuf::{self, ProtobufError};
use super::shared::Body;

/// Kubernetes' protobuf media type (typed clients' request bodies).
pub(crate) const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

/// Largest request body accepted (the real server's limit is 3 MiB).
pub(crate) const MAX_BODY: usize = 3 * 1024 * 1024;

/// A streamed response of `content_type`: each chunk from `chunks` as it
/// comes, ending when every sender is gone (watches, followed logs).
pub(crate) fn streamed_response(
    chunks: tokio::sync::mpsc::Receiver<Bytes>,
    content_type: &'static str,
) -> Response<Body> {
    let stream = futures_util::stream::unfold(chunks, |mut chunks| async move {
        chunks.recv().await.map(|bytes| {
            (
                Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(bytes)),
                chunks,
            )
        })
    });
    let mut response = Response::new(http_body_util::StreamBody::new(stream).boxed());
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

/// The `101 Switching Protocols` of an accepted upgrade to `upgrade`.
pub(crate) fn switching_protocols(upgrade: &'static str) -> Response<Body> {
    let mut response = Response::new(http_body_util::Empty::<Bytes>::new().boxed());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(header::UPGRADE, header::HeaderValue::from_static(upgrade));
    headers.insert(
        header::CONNECTION,
        header::HeaderValue::from_static("Upgrade"),
    );
    response
}

/// Serves an accepted upgrade once hyper hands the connection over (an
/// upgrade that never completes is logged with `what` and dropped).
pub(crate) fn serve_upgraded<F, Fut>(on_upgrade: hyper::upgrade::OnUpgrade, what: String, serve: F)
where
    F: FnOnce(hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => serve(hyper_util::rt::TokioIo::new(upgraded)).await,
            Err(error) => tracing::debug!(%what, %error, "an upgrade did not complete"),
        }
    });
}

pub(crate) fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    let mut response = Response::new(Full::new(Bytes::from(bytes)).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// The request's `Content-Type` without parameters (`application/json`), or "".
pub(crate) fn media_type(request: &Request<Incoming>) -> String {
    request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or_default().trim().to_string())
        .unwrap_or_default()
}

/// The request's body, at most [`MAX_BODY`] bytes.
pub(crate) async fn read_bytes(request: Request<Incoming>) -> Result<Bytes, ApiError> {
    Ok(Limited::new(request.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            ApiError::new(
                413,
                "RequestEntityTooLarge",
                format!("reading the body: {e}"),
            )
        })?
        .to_bytes())
}

pub(crate) async fn read_json(
    request: Request<Incoming>,
    content_type: &str,
) -> Result<Value, ApiError> {
    let bytes = read_bytes(request).await?;
    if content_type == "application/apply-patch+yaml" {
        // JSON is YAML; most clients (kube-rs included) send JSON here.
        if let Ok(value) = serde_json::from_slice(&bytes) {
            return Ok(value);
        }
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| ApiError::bad_request("the body is not UTF-8"))?;
        return serde_saphyr::from_str::<Value>(text)
            .map_err(|e| ApiError::bad_request(format!("invalid YAML body: {e}")));
    }
    if content_type == PROTOBUF {
        return protobuf::decode(&bytes).map_err(|e| match e {
            ProtobufError::NoMagic | ProtobufError::Malformed { .. } => {
                ApiError::bad_request(e.to_string())
            }
            ProtobufError::UnsupportedKind { .. } | ProtobufError::UnsupportedField { .. } => {
                ApiError::new(415, "UnsupportedMediaType", e.to_string())
            }
        });
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}
