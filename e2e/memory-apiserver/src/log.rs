//! `pods/log`: a container's output, from the file the kubelet stand-in
//! names for it ([`super::pods::ContainerRuntime::log`]), as
//! `text/plain`; with `follow=true` the response stays open and carries
//! what the process writes next, until the pod goes or the client does.
//!
//! Served: `container`, `follow`, `tailLines`, `limitBytes`, `previous`
//! (there is never a previous container: the kubelet's 400). Refused with
//! a 400 saying so: `timestamps`, `sinceSeconds` and `sinceTime`, which
//! need the time of every line, which a plain log file does not keep.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::error::ApiError;
use super::query::{container_of, parse_bool};
use super::rbac;
use super::shared::{Body, Shared};
use super::store::User;

/// How often a followed log is looked at for more output.
const FOLLOW_POLL: Duration = Duration::from_millis(100);
const CHUNK: usize = 32 * 1024;

/// The query of `pods/log` (`PodLogOptions`), what is served of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub container: Option<String>,
    pub follow: bool,
    pub previous: bool,
    pub tail_lines: Option<u64>,
    pub limit_bytes: Option<u64>,
}

pub fn options(query: Option<&str>) -> Result<LogOptions, ApiError> {
    let mut options = LogOptions::default();
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match key.as_ref() {
            "container" if !value.is_empty() => options.container = Some(value.into_owned()),
            "follow" => options.follow = parse_bool("follow", &value)?,
            "previous" => options.previous = parse_bool("previous", &value)?,
            "tailLines" => {
                let lines: i64 = value.parse().map_err(|_| {
                    ApiError::bad_request(format!("tailLines: invalid value {value:?}"))
                })?;
                options.tail_lines = Some(u64::try_from(lines).map_err(|_| {
                    ApiError::new(
                        422,
                        "Invalid",
                        format!(
                            "tailLines: Invalid value: {lines}: must be greater than or equal to 0"
                        ),
                    )
                })?);
            }
            "limitBytes" => {
                let bytes: i64 = value.parse().map_err(|_| {
                    ApiError::bad_request(format!("limitBytes: invalid value {value:?}"))
                })?;
                options.limit_bytes = Some(
                    u64::try_from(bytes)
                        .ok()
                        .filter(|b| *b > 0)
                        .ok_or_else(|| {
                            ApiError::new(
                                422,
                                "Invalid",
                                format!(
                                    "limitBytes: Invalid value: {bytes}: must be greater than 0"
                                ),
                            )
                        })?,
                );
            }
            "timestamps" if parse_bool("timestamps", &value)? => {
                return Err(ApiError::bad_request(
                    "timestamps are not recorded by this test API's kubelet",
                ));
            }
            "sinceSeconds" | "sinceTime" => {
                return Err(ApiError::bad_request(format!(
                    "{key} is not served by this test API's kubelet (it keeps no time per line)"
                )));
            }
            _ => {}
        }
    }
    Ok(options)
}

/// The last `lines` lines of `text` (a final line without its newline
/// counts), as the kubelet's tail does.
pub fn tail(text: &[u8], lines: u64) -> &[u8] {
    if lines == 0 {
        return &text[text.len()..];
    }
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let mut seen = 0u64;
    for (i, byte) in body.iter().enumerate().rev() {
        if *byte == b'\n' {
            seen += 1;
            if seen == lines {
                return &text[i + 1..];
            }
        }
    }
    text
}

/// Serves `GET /api/v1/namespaces/{namespace}/pods/{name}/log`.
pub async fn serve(
    shared: &Shared,
    user: &User,
    request: Request<Incoming>,
    namespace: &str,
    name: &str,
) -> Result<Response<Body>, ApiError> {
    if request.method() != http::Method::GET {
        return Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{} is not supported on pods/log", request.method()),
        ));
    }
    shared.authorize(
        user,
        &rbac::Attributes::Resource {
            verb: "get".into(),
            group: String::new(),
            resource: "pods/log".into(),
            namespace: Some(namespace.to_string()),
            name: Some(name.to_string()),
        },
    )?;
    let options = options(request.uri().query())?;
    let t = super::pods::pod_type(&shared.store)?;
    let pod = shared.store.get(&t, Some(namespace), name)?;
    let container = container_of(&pod, options.container.as_deref(), name)?;
    if options.previous {
        return Err(ApiError::bad_request(format!(
            "previous terminated container \"{container}\" in pod \"{name}\" not found"
        )));
    }
    let uid = pod
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let endpoint = shared
        .pods
        .lookup(namespace, name)
        .filter(|e| e.uid == uid)
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "container \"{container}\" in pod \"{name}\" is waiting to start: ContainerCreating"
            ))
        })?;
    let log = endpoint
        .containers
        .get(&container)
        .and_then(|c| c.log.clone());
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let mut shutdown = shared.shutdown.clone();
    let gone = endpoint.gone.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = stream_log(log, options, gone.clone(), tx) => {}
            () = gone.cancelled() => {}
            _ = shutdown.changed() => {}
        }
    });
    Ok(super::body::streamed_response(rx, "text/plain"))
}

pub(crate) async fn stream_log(
    log: Option<PathBuf>,
    options: LogOptions,
    gone: CancellationToken,
    tx: mpsc::Sender<Bytes>,
) {
    let Some(path) = log else {
        // No output recorded: an empty log (and, followed, one that stays
        // empty until the pod goes).
        if options.follow {
            tokio::select! {
                () = gone.cancelled() => {}
                () = tx.closed() => {}
            }
        }
        return;
    };
    let mut budget = options.limit_bytes.unwrap_or(u64::MAX);
    let mut send = async |bytes: &[u8]| -> bool {
        let take = usize::try_from(budget)
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        if take > 0
            && tx
                .send(Bytes::copy_from_slice(&bytes[..take]))
                .await
                .is_err()
        {
            return false;
        }
        budget -= take as u64;
        budget > 0
    };
    let Ok(mut file) = tokio::fs::File::open(&path).await else {
        return;
    };
    let mut text = Vec::new();
    if file.read_to_end(&mut text).await.is_err() {
        return;
    }
    let start = match options.tail_lines {
        Some(lines) => tail(&text, lines),
        None => &text[..],
    };
    if !send(start).await || !options.follow {
        return;
    }
    let mut offset = text.len() as u64;
    let mut buf = vec![0u8; CHUNK];
    loop {
        tokio::select! {
            () = tokio::time::sleep(FOLLOW_POLL) => {}
            () = tx.closed() => return,
        }
        // A log that shrank was rotated or truncated: read it from its
        // start again.
        let length = match tokio::fs::metadata(&path).await {
            Ok(meta) => meta.len(),
            Err(_) => continue,
        };
        if length < offset {
            offset = 0;
        }
        if length == offset {
            continue;
        }
        if file.seek(std::io::SeekFrom::Start(offset)).await.is_err() {
            return;
        }
        loop {
            match file.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    offset += n as u64;
                    if !send(&buf[..n]).await {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_counts_lines_as_the_kubelet_does() {
        assert_eq!(tail(b"a\nb\nc\n", 2), b"b\nc\n");
        assert_eq!(tail(b"a\nb\nc", 2), b"b\nc");
        assert_eq!(tail(b"a\nb\n", 5), b"a\nb\n");
        assert_eq!(tail(b"a\nb\n", 0), b"");
        assert_eq!(tail(b"", 3), b"");
    }

    #[test]
    fn unserved_options_are_refused_not_ignored() {
        assert_eq!(options(Some("timestamps=true")).unwrap_err().code, 400);
        assert_eq!(options(Some("sinceSeconds=5")).unwrap_err().code, 400);
        assert_eq!(options(Some("tailLines=-1")).unwrap_err().code, 422);
        assert_eq!(options(Some("limitBytes=0")).unwrap_err().code, 422);
        let parsed = options(Some("follow=true&tailLines=3&timestamps=false")).unwrap();
        assert!(parsed.follow);
        assert_eq!(parsed.tail_lines, Some(3));
    }
}
