//! `pods/exec` and `pods/attach`, as kube-apiserver and the kubelet serve
//! them: over WebSocket here, to kubectl (1.30+ speaks
//! `v5.channel.k8s.io` first) and kube-rs (`v4.channel.k8s.io`), and over
//! SPDY in [`super::exec_spdy`]. `kubectl cp` is `exec` of `tar` and
//! rides the same path. `attach` shows the container's output from now
//! on (its log, stdout and stderr as one stream) until the pod goes; the
//! stand-in's processes read no stdin, so `attach -i` is refused.
//!
//! * Authorization and the handshake: [`super::websocket`] (`get` and
//!   `create` on `pods/exec`).
//! * What runs (the command, an attach's view of the log, the final
//!   Status): [`super::remotecommand`].
//! * Channels (kubelet's `remotecommand`): 0 stdin, 1 stdout, 2 stderr,
//!   3 the final `Status` (JSON), 4 terminal resizes (dropped); v5 adds 255, on
//!   which the client closes a stream (`[255, 0]`: stdin is done, which
//!   is how `tar` in `kubectl cp` learns its input ended).

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response};
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;

use super::error::ApiError;
use super::portforward::running_endpoint;
use super::query::container_of;
use super::remotecommand::{ExecOptions, Output, Work, final_status, options, run_work};
use super::shared::{Body, Shared};
use super::store::User;
use super::websocket::{self, framed};
use super::{exec_spdy, spdy};
use tokio_util::sync::CancellationToken;

/// The channel protocols served, preferred first. Both carry the final
/// Status as JSON on channel 3; only v5 can close stdin.
const PROTOCOLS: &[&str] = &["v5.channel.k8s.io", "v4.channel.k8s.io"];
const STDIN: u8 = 0;
const ERROR: u8 = 3;
const CLOSE: u8 = 255;

/// Which connect subresource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connect {
    Exec,
    Attach,
}

impl Connect {
    fn subresource(self) -> &'static str {
        match self {
            Connect::Exec => "exec",
            Connect::Attach => "attach",
        }
    }
}

/// Serves `GET|POST /api/v1/namespaces/{namespace}/pods/{name}/exec`
/// (and `/attach`).
pub async fn serve(
    shared: &Shared,
    user: &User,
    mut request: Request<Incoming>,
    namespace: &str,
    name: &str,
    connect: Connect,
) -> Result<Response<Body>, ApiError> {
    let t = super::pods::pod_type(&shared.store)?;
    let subresource = connect.subresource();
    websocket::authorize(
        shared,
        user,
        request.method(),
        &t,
        subresource,
        namespace,
        name,
    )?;
    let options = options(request.uri().query())?;
    let pod = shared.store.get(&t, Some(namespace), name)?;
    let container = container_of(&pod, options.container.as_deref(), name)?;
    if let Some(phase @ ("Succeeded" | "Failed")) =
        pod.pointer("/status/phase").and_then(Value::as_str)
    {
        return Err(ApiError::bad_request(format!(
            "cannot {subresource} into a container in a completed pod; current phase is {phase}"
        )));
    }
    if connect == Connect::Exec && options.command.is_empty() {
        return Err(ApiError::bad_request(
            "you must specify at least one command for the container",
        ));
    }
    if !(options.stdin || options.stdout || options.stderr) {
        return Err(ApiError::bad_request(
            "you must specify at least 1 of stdin, stdout, stderr",
        ));
    }
    let endpoint = running_endpoint(shared, &pod, namespace, name)?;
    let runtime = endpoint.containers.get(&container);
    let work = match connect {
        Connect::Exec => Work::Command(runtime.and_then(|c| c.exec.clone()).ok_or_else(|| {
            ApiError::new(
                500,
                "InternalError",
                format!(
                    "unable to upgrade connection: container {container} of pod {namespace}/{name} runs no commands in this test API"
                ),
            )
        })?),
        Connect::Attach => {
            if options.stdin {
                return Err(ApiError::bad_request(format!(
                    "container {container} of pod {namespace}/{name} takes no stdin: its process reads none in this test API"
                )));
            }
            Work::Attach(runtime.and_then(|c| c.log.clone()), endpoint.gone.clone())
        }
    };
    // An exec ends with its pod; an attach ends then too, with a Status.
    let gone = match connect {
        Connect::Exec => endpoint.gone.clone(),
        Connect::Attach => CancellationToken::new(),
    };
    let mut shutdown = shared.shutdown.clone();
    let pod_name = format!("{namespace}/{name}");
    let spdy_upgrade = request
        .headers()
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("spdy/3.1"));
    // `None`: SPDY; else WebSocket, whether v5.
    let (response, on_upgrade, websocket_v5) = if spdy_upgrade
        && request.method() == http::Method::POST
    {
        let (response, on_upgrade, _) = spdy::accept(&mut request, exec_spdy::PROTOCOLS, false)?;
        (response, on_upgrade, None)
    } else {
        // Last: the answer to a refused WebSocket upgrade must name the
        // problem, which kubectl shows after falling back to SPDY.
        websocket::require_websocket(&request, PROTOCOLS)?;
        let protocol = websocket::negotiate(&request, PROTOCOLS, false)?;
        let (response, on_upgrade) = websocket::accept(&mut request, protocol)?;
        (response, on_upgrade, Some(protocol == "v5.channel.k8s.io"))
    };
    super::body::serve_upgraded(
        on_upgrade,
        format!("{subresource} {pod_name}"),
        move |io| async move {
            let served = async {
                match websocket_v5 {
                    None => {
                        exec_spdy::serve(io, options.clone(), work.clone(), pod_name.clone()).await
                    }
                    Some(v5) => {
                        let ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
                        run(ws, &options, &work, v5).await;
                    }
                }
            };
            tokio::select! {
                () = served => {}
                () = gone.cancelled() => {
                    tracing::debug!(pod = %pod_name, "pod gone; ending its {subresource}");
                }
                _ = shutdown.changed() => {}
            }
        },
    );
    Ok(response)
}

/// Sends the final Status and closes the connection as the kubelet does.
async fn finish<K>(sink: &mut K, status: &Value)
where
    K: futures_util::Sink<Message> + Unpin,
{
    let _ = sink
        .send(framed(ERROR, status.to_string().as_bytes()))
        .await;
    let _ = sink.send(websocket::normal_close()).await;
    let _ = sink.close().await;
}

/// The WebSocket side of a command: channel messages in and out.
async fn run<S>(ws: WebSocketStream<S>, options: &ExecOptions, work: &Work, v5: bool)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut sink, mut stream) = ws.split();
    let (to_stdin, stdin) = mpsc::channel::<Bytes>(16);
    let mut to_stdin = options.stdin.then_some(to_stdin);
    let (output, mut outgoing) = mpsc::channel::<Output>(16);
    let command = run_work(work, options, options.stdin.then_some(stdin), output);
    tokio::pin!(command);
    let mut outcome = None;
    loop {
        tokio::select! {
            done = &mut command, if outcome.is_none() => outcome = Some(done),
            chunk = outgoing.recv() => match chunk {
                Some((channel, bytes)) => {
                    if sink.send(framed(channel, &bytes)).await.is_err() {
                        return;
                    }
                }
                // Only once the command is done and its output all sent.
                None => break,
            },
            message = stream.next() => match message {
                Some(Ok(Message::Binary(bytes))) if !bytes.is_empty() => match bytes[0] {
                    STDIN if bytes.len() > 1 => {
                        if let Some(sender) = &to_stdin
                            && sender.send(bytes.slice(1..)).await.is_err()
                        {
                            to_stdin = None;
                        }
                    }
                    CLOSE if v5 && bytes.get(1) == Some(&STDIN) => to_stdin = None,
                    // There is no terminal to resize (RESIZE); other
                    // channels carry nothing from the client.
                    _ => {}
                },
                // The client went: so does the command (dropped, killed).
                Some(Ok(Message::Close(_)) | Err(_)) | None => return,
                Some(Ok(_)) => {}
            },
        }
    }
    let outcome = match outcome {
        Some(outcome) => outcome,
        None => command.await,
    };
    finish(&mut sink, &final_status(&options.command, outcome)).await;
}
