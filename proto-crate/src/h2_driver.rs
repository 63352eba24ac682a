//! Parts for driving an HTTP/2 connection and its streams from one task.
//!
//! hyper runs a connection in one task and each stream's body in another,
//! so every packet crosses a hand-off between tasks in each process it goes
//! through: a wake, on a multi-threaded runtime often another thread's. The
//! tunnel's two ends instead poll the `h2` connection, its streams and the
//! packets to send from one task; these are the pieces both ends share.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use futures_util::task::AtomicWaker;
use http_body::{Body, Frame};
use tonic::Status;

use crate::Packet;
use crate::grpc_framing::PacketBody;

/// Time a keepalive PING has to be answered (gRPC's default, and hyper's).
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Passes over a connection's parts in one poll before the task lets others
/// run: a peer that keeps the connection busy cannot hold a worker.
const MAX_PASSES: usize = 32;

/// A gRPC call's request head as tonic's clients send it: POST to `uri`
/// with `metadata` as headers, `te: trailers`, `content-type:
/// application/grpc` and `user_agent`.
pub fn grpc_request(
    uri: &str,
    metadata: http::HeaderMap,
    user_agent: &'static str,
) -> Result<http::Request<()>, http::Error> {
    let mut request = http::Request::builder()
        .method(http::Method::POST)
        .uri(uri)
        .body(())?;
    *request.headers_mut() = metadata;
    let headers = request.headers_mut();
    headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    headers.insert(
        http::header::USER_AGENT,
        http::HeaderValue::from_static(user_agent),
    );
    Ok(request)
}

/// An `h2` error as the gRPC status a call that met it ends with.
pub fn h2_status(e: h2::Error) -> Status {
    Status::from_error(Box::new(e))
}

/// Polls a connection's parts in passes, each part with a waker of its
/// own. A wake raised while the task is inside its poll (a send waking the
/// connection, a frame read waking the stream's reader) asks for another
/// pass rather than waking the running task: a task woken while it runs is
/// rescheduled after its poll, and on a multi-threaded runtime another
/// worker is woken to take it. A wake from elsewhere wakes the task. A pass
/// polls only the parts woken since they were last polled ([`Parts::take`]):
/// most wakes concern one part, and polling an idle part is not free (an
/// `h2` stream or connection takes its lock, a channel registers its waker).
#[derive(Debug, Clone)]
pub struct Passes {
    shared: Arc<PassWaker>,
    parts: Arc<[Part]>,
}

#[derive(Debug)]
struct Part {
    state: Arc<PartWaker>,
    waker: Waker,
}

/// The parts of one pass, see [`Passes::poll`].
#[derive(Debug)]
pub struct Parts<'a> {
    parts: &'a [Part],
}

impl Parts<'_> {
    /// The context to poll part `part` with, if it was woken since it was
    /// last taken (every part starts woken). Taking it clears the mark, so a
    /// part must be polled once taken: until its poll registers the waker,
    /// nothing would wake it.
    pub fn take(&self, part: usize) -> Option<Context<'_>> {
        let part = self.parts.get(part)?;
        part.state
            .woken
            .swap(false, Ordering::SeqCst)
            .then(|| Context::from_waker(&part.waker))
    }

    /// Marks `part` woken, for a part that made progress and may have more
    /// without anything waking it again (a stream that returned one of
    /// several buffered messages, a new stream nothing polled yet): the next
    /// pass polls it.
    pub fn wake(&self, part: usize) {
        wake_part(self.parts, part);
    }
}

/// Wakes `part` of `parts` through its own waker (marks it, wakes the pass).
fn wake_part(parts: &[Part], part: usize) {
    if let Some(part) = parts.get(part) {
        part.waker.wake_by_ref();
    }
}

impl Passes {
    /// Passes over `parts` parts, numbered from 0.
    pub fn new(parts: usize) -> Self {
        let shared = Arc::new(PassWaker::default());
        let parts = (0..parts)
            .map(|_| {
                let state = Arc::new(PartWaker {
                    woken: AtomicBool::new(true),
                    pass: shared.clone(),
                });
                Part {
                    waker: Waker::from(state.clone()),
                    state,
                }
            })
            .collect();
        Passes { shared, parts }
    }

    /// Marks `part` woken from outside a pass, for a change the part's
    /// waker will not hear of (a graceful shutdown asked of the connection):
    /// the next pass polls it, and the task is woken to run one.
    pub fn wake(&self, part: usize) {
        wake_part(&self.parts, part);
    }

    /// Runs `pass` until it reports something (`Some`), nothing woke a part
    /// during the last pass (`Pending`, the task woken by whatever wakes a
    /// part next), the pass limit is reached or Tokio's cooperative budget is
    /// spent (`Pending`, the task woken at once to go on).
    pub fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        mut pass: impl FnMut(&Parts<'_>) -> Option<T>,
    ) -> Poll<T> {
        self.shared.task.register(cx.waker());
        let parts = Parts { parts: &self.parts };
        for _ in 0..MAX_PASSES {
            self.shared.polling.store(true, Ordering::SeqCst);
            self.shared.woken.store(false, Ordering::SeqCst);
            let outcome = pass(&parts);
            self.shared.polling.store(false, Ordering::SeqCst);
            if let Some(reported) = outcome {
                // A wake seen during this pass is served by the next one,
                // which the caller starts right after handling this.
                return Poll::Ready(reported);
            }
            if !self.shared.woken.swap(false, Ordering::SeqCst) {
                return Poll::Pending;
            }
            // Budget spent: every resource now answers Pending and wakes us,
            // so another pass would only spin. The scheduler refills the
            // budget when the task runs again.
            if !tokio::task::coop::has_budget_remaining() {
                break;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[derive(Debug, Default)]
struct PassWaker {
    task: AtomicWaker,
    polling: AtomicBool,
    woken: AtomicBool,
}

impl PassWaker {
    fn wake(&self) {
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

#[derive(Debug)]
struct PartWaker {
    woken: AtomicBool,
    pass: Arc<PassWaker>,
}

impl Wake for PartWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // The mark first: the pass or task this wake starts must see it.
        self.woken.store(true, Ordering::SeqCst);
        self.pass.wake();
    }
}

/// When a keepalive pings: once the peer was silent for `interval`; the
/// ping must then be answered within [`PING_TIMEOUT`], by its pong or by
/// anything else the peer sends. Shared by HTTP/2's [`KeepAlive`] and the
/// lean framing's ([`crate::framed::KeepAlive`]).
#[derive(Debug)]
pub struct PingSchedule {
    interval: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    awaiting: bool,
    /// What the peer had sent when the timer was set.
    heard_at_arm: u64,
}

impl PingSchedule {
    pub fn new(interval: Duration) -> Self {
        PingSchedule {
            interval,
            timer: Box::pin(tokio::time::sleep(interval)),
            awaiting: false,
            heard_at_arm: 0,
        }
    }

    /// Whether a ping was sent and not answered yet.
    pub fn awaiting(&self) -> bool {
        self.awaiting
    }

    fn arm(&mut self, after: Duration, heard: u64) {
        self.heard_at_arm = heard;
        self.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + after);
    }

    /// `heard` counts what the peer sent so far (any monotonic count), and
    /// `ponged` says the pong of the ping we await came. `Ok(true)`: send a
    /// ping now (it is then awaited); `Err` once one went unanswered.
    pub fn poll(&mut self, cx: &mut Context<'_>, heard: u64, ponged: bool) -> Result<bool, Status> {
        if self.awaiting && (ponged || heard != self.heard_at_arm) {
            self.awaiting = false;
            self.arm(self.interval, heard);
        }
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(false);
            }
            if self.awaiting {
                return Err(Status::unavailable(format!(
                    "keepalive ping not answered within {PING_TIMEOUT:?}"
                )));
            }
            if heard != self.heard_at_arm {
                self.arm(self.interval, heard);
                continue;
            }
            self.awaiting = true;
            self.arm(PING_TIMEOUT, heard);
            // Polled once more so the new deadline holds the waker.
            let _ = self.timer.as_mut().poll(cx);
            return Ok(true);
        }
    }
}

/// HTTP/2 keepalive as hyper does it: a PING once the peer was silent for
/// the interval, which must be answered within [`PING_TIMEOUT`].
pub struct KeepAlive {
    schedule: PingSchedule,
    ping_pong: h2::PingPong,
}

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeepAlive")
            .field("schedule", &self.schedule)
            .finish_non_exhaustive()
    }
}

impl KeepAlive {
    pub fn new(interval: Duration, ping_pong: h2::PingPong) -> Self {
        KeepAlive {
            schedule: PingSchedule::new(interval),
            ping_pong,
        }
    }

    /// `heard` counts what the peer sent so far (any monotonic count): a
    /// peer heard from since the timer was set is not pinged.
    pub fn poll(&mut self, cx: &mut Context<'_>, heard: u64) -> Result<(), Status> {
        loop {
            // Polled while awaited, so the PING ACK wakes us.
            let ponged = self.schedule.awaiting()
                && match self.ping_pong.poll_pong(cx) {
                    Poll::Ready(Ok(_)) => true,
                    Poll::Ready(Err(e)) => return Err(h2_status(e)),
                    Poll::Pending => false,
                };
            if !self.schedule.poll(cx, heard, ponged)? {
                return Ok(());
            }
            self.ping_pong
                .send_ping(h2::Ping::opaque())
                .map_err(h2_status)?;
        }
    }
}

/// A received stream as an HTTP body, giving its window back as soon as a
/// chunk is taken, as hyper does (the tunnel's own flow control bounds what
/// a peer may send per connection; see [`crate::flow`]). With a counter, it
/// counts the chunks taken, for a [`KeepAlive`].
#[derive(Debug)]
pub struct RecvBody {
    recv: h2::RecvStream,
    chunks: Option<Arc<AtomicU64>>,
}

impl RecvBody {
    pub fn new(recv: h2::RecvStream) -> Self {
        RecvBody { recv, chunks: None }
    }

    pub fn counted(recv: h2::RecvStream, chunks: Arc<AtomicU64>) -> Self {
        RecvBody {
            recv,
            chunks: Some(chunks),
        }
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = self.get_mut();
        let recv = &mut this.recv;
        match recv.poll_data(cx) {
            Poll::Ready(Some(Ok(data))) => {
                // Fails only once the stream is gone, which the next poll reports.
                let _ = recv.flow_control().release_capacity(data.len());
                if let Some(chunks) = &this.chunks {
                    chunks.fetch_add(1, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => match recv.poll_trailers(cx) {
                Poll::Ready(Ok(Some(trailers))) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                Poll::Ready(Ok(None)) => Poll::Ready(None),
                Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
                Poll::Pending => Poll::Pending,
            },
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

/// Ready once `send` has window for more (h2 buffers what is sent beyond
/// it, as hyper does, up to the connection's send-buffer limit); `Err`
/// once the stream is gone or the peer reset it.
pub fn poll_send_capacity(
    send: &mut h2::SendStream<Bytes>,
    cx: &mut Context<'_>,
) -> Poll<Result<(), Status>> {
    loop {
        send.reserve_capacity(1);
        if send.capacity() > 0 {
            return Poll::Ready(Ok(()));
        }
        match send.poll_capacity(cx) {
            Poll::Ready(Some(Ok(_))) => {}
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(h2_status(e))),
            Poll::Ready(None) => {
                return Poll::Ready(Err(Status::unavailable("the HTTP/2 stream closed")));
            }
            Poll::Pending => {
                // A peer that resets the stream gives no window back.
                if let Poll::Ready(reason) = send.poll_reset(cx) {
                    return Poll::Ready(Err(match reason {
                        Ok(reason) => h2_status(reason.into()),
                        Err(e) => h2_status(e),
                    }));
                }
                return Poll::Pending;
            }
        }
    }
}

/// How far [`poll_send_body`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// Waiting for the body or for send window.
    Pending,
    /// The body ended and the stream's end was sent.
    Ended,
}

/// Moves `body` into `send` as far as the stream's window allows, as hyper
/// does: the body is polled only with send capacity, and the end of the
/// stream goes with its trailers or an empty DATA frame. A body that fails
/// resets the stream (INTERNAL_ERROR) and reports the failure.
pub fn poll_send_body<S>(
    send: &mut h2::SendStream<Bytes>,
    mut body: Pin<&mut PacketBody<S>>,
    cx: &mut Context<'_>,
) -> Result<Sent, Status>
where
    S: Stream<Item = Result<Packet, Status>> + Unpin,
{
    loop {
        match poll_send_capacity(send, cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(status)) => return Err(status),
            Poll::Pending => return Ok(Sent::Pending),
        }
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    send.send_data(data, false).map_err(h2_status)?;
                    // The body found its packets drained while filling this
                    // frame, and they will wake us: asking again now would
                    // only hear Pending once more.
                    if body.waiting_for_packets() {
                        return Ok(Sent::Pending);
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        send.send_trailers(trailers).map_err(h2_status)?;
                        return Ok(Sent::Ended);
                    }
                }
            },
            Poll::Ready(Some(Err(status))) => {
                send.send_reset(h2::Reason::INTERNAL_ERROR);
                return Err(status);
            }
            Poll::Ready(None) => {
                send.send_data(Bytes::new(), true).map_err(h2_status)?;
                return Ok(Sent::Ended);
            }
            Poll::Pending => return Ok(Sent::Pending),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Count(std::sync::atomic::AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A wake from outside a pass reaches the task; one during a pass only
    /// asks for another pass.
    #[test]
    fn a_wake_during_a_pass_asks_for_another_and_one_after_it_wakes_the_task() {
        let count = Arc::new(Count(Default::default()));
        let task = Waker::from(count.clone());
        let mut cx = Context::from_waker(&task);
        let passes = Passes::new(1);

        let mut calls = 0;
        let mut woken_inside = None;
        let polled = passes.poll(&mut cx, |parts| {
            calls += 1;
            let part = parts.take(0).expect("the part is woken");
            if calls == 1 {
                // A part woken during the pass: the loop must run again.
                part.waker().wake_by_ref();
                woken_inside = Some(part.waker().clone());
                None
            } else {
                Some(calls)
            }
        });
        assert_eq!(polled, Poll::Ready(2));
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "the running task is not woken"
        );

        let waker = woken_inside.expect("the first pass ran");
        waker.wake_by_ref();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "an idle task is woken");

        let idle: Poll<()> = passes.poll(&mut cx, |parts| {
            assert!(parts.take(0).is_some(), "woken from outside");
            None
        });
        assert_eq!(idle, Poll::Pending, "nothing woke a part: wait");
    }

    /// A pass polls only the parts woken since they were last taken; every
    /// part starts woken, and `wake` marks one for the next pass.
    #[test]
    fn a_pass_takes_only_the_parts_woken_since_they_were_last_taken() {
        let count = Arc::new(Count(Default::default()));
        let task = Waker::from(count.clone());
        let mut cx = Context::from_waker(&task);
        let passes = Passes::new(3);
        let taken = |cx: &mut Context<'_>| {
            let mut taken = Vec::new();
            let _: Poll<()> = passes.poll(cx, |parts| {
                taken.extend((0..3).filter(|&part| parts.take(part).is_some()));
                None
            });
            taken
        };
        let mut wakers = Vec::new();
        let _: Poll<()> = passes.poll(&mut cx, |parts| {
            for part in 0..3 {
                let part_cx = parts.take(part).expect("every part starts woken");
                wakers.push(part_cx.waker().clone());
            }
            None
        });
        assert_eq!(taken(&mut cx), Vec::<usize>::new(), "nothing woke a part");

        wakers[2].wake_by_ref();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the task is woken");
        assert_eq!(taken(&mut cx), vec![2]);

        let mut first = true;
        let again = passes.poll(&mut cx, |parts| {
            if std::mem::take(&mut first) {
                parts.wake(1);
                return None;
            }
            Some(
                (0..3)
                    .filter(|&part| parts.take(part).is_some())
                    .collect::<Vec<_>>(),
            )
        });
        assert_eq!(
            again,
            Poll::Ready(vec![1]),
            "marked during a pass: taken by the next"
        );
        assert_eq!(taken(&mut cx), Vec::<usize>::new());
        assert!(
            passes
                .poll(&mut cx, |parts| parts.take(7).map(|_| ()))
                .is_pending(),
            "no such part"
        );
    }
}
