//! `pods/exec` and `pods/attach` over SPDY (`v4.channel.k8s.io`), what client-go's SPDY
//! executor speaks: kubectl before 1.30, kubectl with
//! `KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false`, and kubectl's fallback when
//! a WebSocket upgrade is refused.
//!
//! The client opens one stream per standard stream it asked for, each
//! named by its `streamType` header: `error` always, `stdin`, `stdout`,
//! `stderr` (not with a terminal) and `resize` (with one). Once all are
//! open the command runs; stdin's FIN is its end of input. At the end the
//! output streams are closed, the final Status (JSON) goes on the error
//! stream, and the connection closes, as the kubelet does.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use super::remotecommand::{ExecOptions, Output, STDERR, STDOUT, Work, final_status, run_work};
use super::spdy::{self, Frame, HeaderReader, Outgoing, header};

/// The stream protocols served: v4's error stream carries a JSON Status
/// (exit codes); v3 and older carry text, which loses them.
pub const PROTOCOLS: &[&str] = &["v4.channel.k8s.io"];
/// How long the client has to open its streams (the kubelet's default
/// stream creation timeout).
const STREAMS_TIMEOUT: Duration = Duration::from_secs(30);

/// The streams of one command, by type.
#[derive(Default)]
struct Streams {
    error: Option<u32>,
    stdin: Option<u32>,
    stdout: Option<u32>,
    stderr: Option<u32>,
    resize: Option<u32>,
}

impl Streams {
    fn complete(&self, options: &ExecOptions) -> bool {
        self.error.is_some()
            && (!options.stdin || self.stdin.is_some())
            && (!options.stdout || self.stdout.is_some())
            && (!options.stderr || options.tty || self.stderr.is_some())
            && (!options.tty || self.resize.is_some())
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves one command over a SPDY connection.
pub async fn serve<IO>(io: IO, options: ExecOptions, work: Work, pod: String)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, writer) = tokio::io::split(io);
    let (out, outgoing) = mpsc::channel::<Outgoing>(64);
    let writes = tokio::spawn(spdy::write_frames(writer, outgoing));
    let mut headers = HeaderReader::default();

    // The client's streams, each accepted as it comes.
    let mut streams = Streams::default();
    let opened = tokio::time::timeout(STREAMS_TIMEOUT, async {
        while !streams.complete(&options) {
            match spdy::read_frame(&mut reader, &mut headers).await {
                Ok(Some(Frame::SynStream {
                    stream,
                    headers: stream_headers,
                    ..
                })) => {
                    let slot = match header(&stream_headers, "streamtype") {
                        Some("error") => &mut streams.error,
                        Some("stdin") => &mut streams.stdin,
                        Some("stdout") => &mut streams.stdout,
                        Some("stderr") => &mut streams.stderr,
                        Some("resize") => &mut streams.resize,
                        _ => {
                            let reset = spdy::rst_stream(stream, spdy::REFUSED_STREAM);
                            let _ = out.send(Outgoing::Frame(reset)).await;
                            continue;
                        }
                    };
                    *slot = Some(stream);
                    if out.send(Outgoing::Reply(stream)).await.is_err() {
                        return false;
                    }
                }
                Ok(Some(Frame::Ping(id))) => {
                    let _ = out.send(Outgoing::Frame(spdy::ping(id))).await;
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return false,
            }
        }
        true
    })
    .await;
    if opened != Ok(true) {
        tracing::debug!(%pod, "exec: the client's streams did not all open");
        return;
    }

    // Frames are read by their own task: a read cut off half-way (as a
    // `select!` would) would lose the framing.
    let (frames_in, mut frames) = mpsc::channel::<Frame>(16);
    let reading = tokio::spawn(async move {
        while let Ok(Some(frame)) = spdy::read_frame(&mut reader, &mut headers).await {
            if frames_in.send(frame).await.is_err() {
                return;
            }
        }
    });
    let _stop_reading = AbortOnDrop(reading);

    let (to_stdin, stdin) = mpsc::channel::<Bytes>(16);
    let mut to_stdin = streams.stdin.map(|_| to_stdin);
    let (output, mut chunks) = mpsc::channel::<Output>(16);
    let command = run_work(&work, &options, streams.stdin.map(|_| stdin), output);
    tokio::pin!(command);
    let mut outcome = None;
    let channels: HashMap<u8, u32> = [(STDOUT, streams.stdout), (STDERR, streams.stderr)]
        .into_iter()
        .filter_map(|(channel, stream)| stream.map(|s| (channel, s)))
        .collect();
    loop {
        tokio::select! {
            done = &mut command, if outcome.is_none() => outcome = Some(done),
            chunk = chunks.recv() => match chunk {
                Some((channel, bytes)) => {
                    // With a terminal, stderr is merged into stdout.
                    let Some(stream) = channels.get(&channel).or(streams.stdout.as_ref()) else {
                        continue;
                    };
                    if out.send(Outgoing::Frame(spdy::data(*stream, false, &bytes))).await.is_err() {
                        return;
                    }
                }
                None => break,
            },
            frame = frames.recv() => match frame {
                Some(Frame::Data { stream, fin, data }) if Some(stream) == streams.stdin => {
                    if let Some(sender) = &to_stdin
                        && !data.is_empty()
                        && sender.send(data).await.is_err()
                    {
                        to_stdin = None;
                    }
                    if fin {
                        to_stdin = None;
                    }
                }
                Some(Frame::RstStream { stream, .. }) if Some(stream) == streams.stdin => {
                    to_stdin = None;
                }
                Some(Frame::Ping(id)) => {
                    let _ = out.send(Outgoing::Frame(spdy::ping(id))).await;
                }
                // The client went: so does the command (dropped, killed).
                Some(Frame::GoAway) | None => return,
                Some(_) => {}
            },
        }
    }
    let outcome = match outcome {
        Some(outcome) => outcome,
        None => command.await,
    };
    for stream in [streams.stdout, streams.stderr].into_iter().flatten() {
        let _ = out
            .send(Outgoing::Frame(spdy::data(stream, true, &[])))
            .await;
    }
    if let Some(error) = streams.error {
        let status = final_status(&options.command, outcome).to_string();
        let _ = out
            .send(Outgoing::Frame(spdy::data(error, false, status.as_bytes())))
            .await;
        let _ = out
            .send(Outgoing::Frame(spdy::data(error, true, &[])))
            .await;
    }
    drop(out);
    // The writer closes the connection once everything above is out.
    let _ = writes.await;
}
