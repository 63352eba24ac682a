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
//! * The command runs where the kubelet stand-in says the container's
//!   process runs ([`super::pods::ExecContext`]): its directory, its
//!   environment, its network namespace.
//! * Channels (kubelet's `remotecommand`): 0 stdin, 1 stdout, 2 stderr,
//!   3 the final `Status` (JSON), 4 terminal resizes (dropped); v5 adds 255, on
//!   which the client closes a stream (`[255, 0]`: stdin is done, which
//!   is how `tar` in `kubectl cp` learns its input ended).
//! * A non-zero exit is a `Failure` Status with reason `NonZeroExitCode`
//!   and the code as its `ExitCode` cause, which kubectl exits with.
//! * `tty=true` allocates no terminal (that would take a pty): stderr is
//!   merged into stdout, as a terminal merges them, and resizes are read
//!   and dropped.

use std::process::Stdio;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;

use super::error::ApiError;
use super::pods::ExecContext;
use super::portforward::running_endpoint;
use super::shared::{Body, Shared};
use super::store::User;
use super::websocket::{self, framed};
use super::{exec_spdy, spdy};
use tokio_util::sync::CancellationToken;

/// The channel protocols served, preferred first. Both carry the final
/// Status as JSON on channel 3; only v5 can close stdin.
const PROTOCOLS: &[&str] = &["v5.channel.k8s.io", "v4.channel.k8s.io"];
const STDIN: u8 = 0;
pub(crate) const STDOUT: u8 = 1;
pub(crate) const STDERR: u8 = 2;
const ERROR: u8 = 3;
const CLOSE: u8 = 255;
/// Read size from the command's output.
const CHUNK: usize = 32 * 1024;

/// The query of `pods/exec` (`PodExecOptions`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOptions {
    pub command: Vec<String>,
    pub container: Option<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

/// A boolean query parameter, as Go's `strconv.ParseBool` reads it.
pub(crate) fn parse_bool(key: &str, value: &str) -> Result<bool, ApiError> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        other => Err(ApiError::bad_request(format!(
            "{key}: invalid boolean value {other:?}"
        ))),
    }
}

/// Parses `?command=…&stdout=true…`; unknown parameters are ignored, as
/// the apiserver's query decoder does.
pub fn options(query: Option<&str>) -> Result<ExecOptions, ApiError> {
    let mut options = ExecOptions::default();
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match key.as_ref() {
            "command" => options.command.push(value.into_owned()),
            "container" if !value.is_empty() => options.container = Some(value.into_owned()),
            "stdin" => options.stdin = parse_bool("stdin", &value)?,
            "stdout" => options.stdout = parse_bool("stdout", &value)?,
            "stderr" => options.stderr = parse_bool("stderr", &value)?,
            "tty" => options.tty = parse_bool("tty", &value)?,
            _ => {}
        }
    }
    Ok(options)
}

/// The container a connect or log request is for: the named one, which
/// must be in the pod, or the pod's only container.
pub(crate) fn container_of(
    pod: &Value,
    requested: Option<&str>,
    name: &str,
) -> Result<String, ApiError> {
    let containers: Vec<&str> = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|c| c.get("name").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default();
    match requested {
        Some(container) if containers.contains(&container) => Ok(container.to_string()),
        Some(container) => Err(ApiError::bad_request(format!(
            "container {container} is not valid for pod {name}"
        ))),
        None => match containers.as_slice() {
            [only] => Ok((*only).to_string()),
            [] => Err(ApiError::bad_request(format!(
                "pod {name} does not have any containers"
            ))),
            many => Err(ApiError::bad_request(format!(
                "a container name must be specified for pod {name}, choose one of: [{}]",
                many.join(" ")
            ))),
        },
    }
}

/// What a connect request runs: a command beside the container
/// (`exec`), or the container's own output (`attach`).
#[derive(Debug, Clone)]
pub enum Work {
    Command(ExecContext),
    /// The container's log, followed from its end until the pod goes.
    Attach(Option<std::path::PathBuf>, CancellationToken),
}

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
    let t = shared
        .store
        .resource_type("", "v1", "pods")
        .ok_or_else(|| ApiError::new(500, "InternalError", "no pods type"))?;
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
    if spdy_upgrade && request.method() == http::Method::POST {
        let (response, on_upgrade, _) = spdy::accept(&mut request, exec_spdy::PROTOCOLS, false)?;
        tokio::spawn(async move {
            let upgraded = match on_upgrade.await {
                Ok(upgraded) => upgraded,
                Err(error) => {
                    tracing::debug!(pod = %pod_name, %error, "{subresource} upgrade failed");
                    return;
                }
            };
            tokio::select! {
                () = exec_spdy::serve(TokioIo::new(upgraded), options, work, pod_name.clone()) => {}
                () = gone.cancelled() => {
                    tracing::debug!(pod = %pod_name, "pod gone; ending its {subresource}");
                }
                _ = shutdown.changed() => {}
            }
        });
        return Ok(response);
    }
    // Last: the answer to a refused WebSocket upgrade must name the
    // problem, which kubectl shows after falling back to SPDY.
    websocket::require_websocket(&request, PROTOCOLS)?;
    let protocol = websocket::negotiate(&request, PROTOCOLS, false)?;
    let (response, on_upgrade) = websocket::accept(&mut request, protocol)?;
    let v5 = protocol == "v5.channel.k8s.io";
    tokio::spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(upgraded) => upgraded,
            Err(error) => {
                tracing::debug!(pod = %pod_name, %error, "{subresource} upgrade failed");
                return;
            }
        };
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        tokio::select! {
            () = run(ws, &options, &work, v5) => {}
            () = gone.cancelled() => {
                tracing::debug!(pod = %pod_name, "pod gone; ending its {subresource}");
            }
            _ = shutdown.changed() => {}
        }
    });
    Ok(response)
}

/// The final Status of a command that ran (`Ok(code)`) or could not start.
pub fn final_status(command: &[String], outcome: Result<i32, String>) -> Value {
    match outcome {
        Ok(0) => json!({"metadata": {}, "status": "Success"}),
        Ok(code) => json!({
            "metadata": {},
            "status": "Failure",
            "message": format!(
                "command terminated with non-zero exit code: error executing command [{}], exit code {code}",
                command.join(" ")
            ),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
        }),
        Err(reason) => json!({
            "metadata": {},
            "status": "Failure",
            "message": format!(
                "failed to exec in container: failed to start exec {:?}: {reason}",
                command.join(" ")
            ),
            "reason": "InternalError",
            "code": 500,
        }),
    }
}

fn command(options: &ExecOptions, context: &ExecContext) -> tokio::process::Command {
    let (program, args): (&str, Vec<&str>) = match &context.netns {
        Some(netns) => (
            "ip",
            ["netns", "exec", netns.as_str()]
                .into_iter()
                .chain(options.command.iter().map(String::as_str))
                .collect(),
        ),
        None => (
            options.command[0].as_str(),
            options.command[1..].iter().map(String::as_str).collect(),
        ),
    };
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .current_dir(&context.dir)
        .envs(context.env.iter().map(|(k, v)| (k, v)))
        .kill_on_drop(true);
    command
}

/// A chunk of the command's output: [`STDOUT`] or [`STDERR`], and bytes.
pub(crate) type Output = (u8, Bytes);

/// Forwards one output pipe as `channel`.
async fn pump<R: AsyncRead + Unpin>(mut pipe: R, channel: u8, out: mpsc::Sender<Output>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if out
                    .send((channel, Bytes::copy_from_slice(&buf[..n])))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

/// Runs the command, whatever carries its streams: input from `stdin`
/// (its sender dropped: the end of input), output to `output`. Returns
/// once the command exited and its output was all sent: its exit code,
/// or why it could not run. Dropping the future kills the command.
pub(crate) async fn run_command(
    options: &ExecOptions,
    context: &ExecContext,
    stdin: Option<mpsc::Receiver<Bytes>>,
    output: mpsc::Sender<Output>,
) -> Result<i32, String> {
    let mut command = command(options, context);
    command.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    // With a "terminal", stdout and stderr are one stream, as on a tty.
    let merged = if options.tty && options.stdout {
        let (reader, writer) = std::io::pipe().map_err(|e| e.to_string())?;
        let second = writer.try_clone().map_err(|e| e.to_string())?;
        command.stdout(writer).stderr(second);
        Some(reader)
    } else {
        let piped = |wanted: bool| {
            if wanted {
                Stdio::piped()
            } else {
                Stdio::null()
            }
        };
        command
            .stdout(piped(options.stdout))
            .stderr(piped(options.stderr));
        None
    };
    let mut child = command.spawn().map_err(|e| e.to_string())?;
    // The parent's copies of the pipe's write ends must go, or the
    // reader never sees the end of the output.
    drop(command);

    let mut pumps = Vec::new();
    if let Some(reader) = merged {
        let out = output.clone();
        // A std pipe has no async reader: a blocking thread reads it.
        pumps.push(tokio::task::spawn_blocking(move || {
            use std::io::Read;
            let mut reader = reader;
            let mut buf = vec![0u8; CHUNK];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if out
                            .blocking_send((STDOUT, Bytes::copy_from_slice(&buf[..n])))
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            }
        }));
    }
    if let Some(stdout) = child.stdout.take() {
        pumps.push(tokio::spawn(pump(stdout, STDOUT, output.clone())));
    }
    if let Some(stderr) = child.stderr.take() {
        pumps.push(tokio::spawn(pump(stderr, STDERR, output.clone())));
    }
    drop(output);
    // Stdin is written by its own task: a command that does not read its
    // input must not stop its output from reaching the client.
    if let (Some(mut pipe), Some(mut stdin)) = (child.stdin.take(), stdin) {
        tokio::spawn(async move {
            while let Some(bytes) = stdin.recv().await {
                if pipe.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            // Dropping the pipe is the end of input the command sees.
        });
    }
    for pump in pumps {
        let _ = pump.await;
    }
    let status = child.wait().await.map_err(|e| e.to_string())?;
    use std::os::unix::process::ExitStatusExt;
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

/// Runs `work` with the streams of [`run_command`]: an exec's command, or
/// an attach's view of the container's output (stdout: the log is one
/// stream of both), which ends, successfully, when the pod goes.
pub(crate) async fn run_work(
    work: &Work,
    options: &ExecOptions,
    stdin: Option<mpsc::Receiver<Bytes>>,
    output: mpsc::Sender<Output>,
) -> Result<i32, String> {
    match work {
        Work::Command(context) => run_command(options, context, stdin, output).await,
        Work::Attach(log, gone) => {
            let (chunks, mut followed) = mpsc::channel::<Bytes>(16);
            let follow_options = super::log::LogOptions {
                follow: true,
                tail_lines: Some(0),
                ..Default::default()
            };
            let follow = super::log::stream_log(log.clone(), follow_options, gone.clone(), chunks);
            tokio::pin!(follow);
            loop {
                tokio::select! {
                    () = &mut follow => {}
                    chunk = followed.recv() => match chunk {
                        Some(bytes) if options.stdout => {
                            if output.send((STDOUT, bytes)).await.is_err() {
                                break;
                            }
                        }
                        Some(_) => {}
                        None => break,
                    },
                    () = gone.cancelled() => break,
                }
            }
            Ok(0)
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_as_the_apiserver_decodes_them() {
        let parsed = options(Some(
            "command=sh&command=-c&command=echo%20hi&stdout=true&stderr=1&container=main",
        ))
        .unwrap();
        assert_eq!(parsed.command, ["sh", "-c", "echo hi"]);
        assert_eq!(parsed.container.as_deref(), Some("main"));
        assert!(parsed.stdout && parsed.stderr && !parsed.stdin && !parsed.tty);
        assert_eq!(options(Some("stdin=yes")).unwrap_err().code, 400);
    }

    #[test]
    fn the_container_is_named_or_the_only_one() {
        let pod = json!({"spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        assert_eq!(container_of(&pod, Some("b"), "p").unwrap(), "b");
        let many = container_of(&pod, None, "p").unwrap_err();
        assert_eq!(
            many.message,
            "a container name must be specified for pod p, choose one of: [a b]"
        );
        assert_eq!(container_of(&pod, Some("c"), "p").unwrap_err().code, 400);
        let one = json!({"spec": {"containers": [{"name": "a"}]}});
        assert_eq!(container_of(&one, None, "p").unwrap(), "a");
    }

    #[test]
    fn a_non_zero_exit_carries_its_code_as_kubectl_reads_it() {
        let command = ["sh".to_string(), "-c".to_string(), "exit 3".to_string()];
        let status = final_status(&command, Ok(3));
        assert_eq!(status["reason"], "NonZeroExitCode");
        assert_eq!(
            status.pointer("/details/causes/0/reason").unwrap(),
            "ExitCode"
        );
        assert_eq!(status.pointer("/details/causes/0/message").unwrap(), "3");
        assert_eq!(final_status(&command, Ok(0))["status"], "Success");
        assert_eq!(final_status(&command, Err("no".into()))["code"], 500);
    }
}
