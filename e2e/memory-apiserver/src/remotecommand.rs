//! What runs behind `pods/exec` and `pods/attach`, whatever carries its
//! streams (WebSocket: [`super::exec`], SPDY: [`super::exec_spdy`]): the
//! request's options, the command as a local process where the kubelet
//! stand-in says the container runs ([`super::pods::ExecContext`]), an
//! attach's view of the container's log, and the final Status.
//!
//! * A non-zero exit is a `Failure` Status with reason `NonZeroExitCode`
//!   and the code as its `ExitCode` cause, which kubectl exits with.
//! * `tty=true` allocates no terminal (that would take a pty): stderr is
//!   merged into stdout, as a terminal merges them.

use std::process::Stdio;

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::error::ApiError;
use super::pods::ExecContext;
use super::query::parse_bool;

/// The output channels (their numbers in the channel protocols).
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;
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

/// What a connect request runs: a command beside the container
/// (`exec`), or the container's own output (`attach`).
#[derive(Debug, Clone)]
pub enum Work {
    Command(ExecContext),
    /// The container's log, followed from its end until the pod goes.
    Attach(Option<std::path::PathBuf>, CancellationToken),
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
pub type Output = (u8, Bytes);

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
pub async fn run_command(
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
pub async fn run_work(
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
