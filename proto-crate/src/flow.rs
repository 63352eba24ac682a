//! Per-connection flow control for the multiplexed agent tunnel.
//!
//! Upstream konnectivity carries every connection of an agent over one gRPC
//! stream with no flow control, so one slow reader stalls them all. We fix that
//! in two layers:
//!
//! * [`ReceiveQueue`] — every connection gets its own receive buffer, bounded in
//!   bytes. The tunnel's reader only ever pushes into these queues.
//! * [`SendCredit`] — when both ends negotiated the extension (metadata key
//!   [`crate::metadata::FLOW_CONTROL_WINDOW`]), a sender may only have as many
//!   unacknowledged bytes in flight per connection as the receiver's window;
//!   the receiver grants more with `WINDOW_UPDATE` as its consumer drains the
//!   queue ([`WindowTracker`]). The queue can then never fill, so the tunnel's
//!   reader never waits and a stalled connection stalls only itself.
//!
//! With a plain konnectivity peer there is no credit: the queue absorbs bursts
//! up to its bound, and past that the reader waits (upstream's behaviour, only
//! much later).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use bytes::{Bytes, BytesMut};
use futures_util::stream::Stream;
use futures_util::task::AtomicWaker;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::Packet;

/// Smallest window we accept or advertise: one maximal read chunk must fit.
pub const MIN_WINDOW: u32 = 64 * 1024;
/// Default per-connection receive window.
pub const DEFAULT_WINDOW: u32 = 2 * 1024 * 1024;
/// Read chunk size for sockets feeding the tunnel.
pub const READ_CHUNK: usize = 64 * 1024;
/// How long a plain peer's data may wait for room in a full connection
/// buffer before that one connection is closed to free the tunnel (the same
/// 10 s the upstream client gives a reader that does not drain).
pub const DEFAULT_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FlowError {
    #[error("peer sent {got} bytes beyond its flow-control window on connection {connect_id}")]
    WindowExceeded { connect_id: i64, got: usize },
    #[error("invalid window update of {0} bytes")]
    BadGrant(i64),
    #[error("connection closed")]
    Closed,
    #[error(
        "connection {connect_id} did not drain its buffer for {after:?}; closed to keep the tunnel moving"
    )]
    Stalled {
        connect_id: i64,
        after: std::time::Duration,
    },
    #[error(
        "invalid flow-control window {0:?}: want a number of bytes between 65536 and 1073741824"
    )]
    BadWindow(String),
}

/// Parses a window advertised in metadata.
pub fn parse_window(value: &str) -> Result<u32, FlowError> {
    value
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|w| (MIN_WINDOW..=1 << 30).contains(w))
        .ok_or_else(|| FlowError::BadWindow(value.to_owned()))
}

/// Credit for sending DATA on one connection.
#[derive(Clone, Debug)]
pub struct SendCredit(Option<Arc<Semaphore>>);

impl SendCredit {
    /// A plain konnectivity peer: no credit accounting.
    pub fn unlimited() -> Self {
        SendCredit(None)
    }

    /// A peer that granted `window` bytes up front.
    pub fn with_window(window: u32) -> Self {
        SendCredit(Some(Arc::new(Semaphore::new(window as usize))))
    }

    pub fn is_flow_controlled(&self) -> bool {
        self.0.is_some()
    }

    /// Waits until `n` bytes may be sent and consumes that much credit.
    pub async fn acquire(&self, n: usize) -> Result<(), FlowError> {
        let Some(sem) = &self.0 else { return Ok(()) };
        let n = u32::try_from(n).map_err(|_| FlowError::Closed)?;
        let permit = sem.acquire_many(n).await.map_err(|_| FlowError::Closed)?;
        permit.forget();
        Ok(())
    }

    /// Adds credit granted by a `WINDOW_UPDATE`.
    pub fn grant(&self, bytes: i64) -> Result<(), FlowError> {
        let Some(sem) = &self.0 else { return Ok(()) };
        let n = usize::try_from(bytes)
            .ok()
            .filter(|n| *n > 0 && *n <= 1 << 30)
            .ok_or(FlowError::BadGrant(bytes))?;
        if sem.available_permits() + n > Semaphore::MAX_PERMITS / 2 {
            return Err(FlowError::BadGrant(bytes));
        }
        sem.add_permits(n);
        Ok(())
    }

    /// Wakes any sender waiting for credit with [`FlowError::Closed`].
    pub fn close(&self) {
        if let Some(sem) = &self.0 {
            sem.close();
        }
    }
}

/// Payloads shorter than this are copied out of the buffer they were decoded
/// from before they are queued. A decoded payload is a slice of the HTTP/2
/// read buffer it arrived in, and a slice keeps that whole allocation (up to
/// a maximal frame and whatever was read with it) alive: a few bytes queued
/// for a reader that does not read would otherwise pin kilobytes each, far
/// beyond the bytes the window counts. Longer payloads stay zero-copy; each
/// pins at most about one read buffer per this many counted bytes.
pub const COPY_BELOW: usize = 16 * 1024;
/// Copied payloads are appended to the queue's last copied payload up to this
/// size, so the number of queued items, and their bookkeeping, stays bounded
/// by the bytes counted however small the packets are.
pub const COALESCE_UP_TO: usize = READ_CHUNK;

/// One item delivered to a connection's consumer. The bytes it carries stay
/// counted against the connection's buffer until it is dropped, so drop it
/// only after the payload was handed on.
#[derive(Debug)]
pub struct Delivery<E> {
    pub event: E,
    _budget: Option<OwnedSemaphorePermit>,
}

/// What waits in a connection's queue.
#[derive(Debug)]
enum Queued<E> {
    /// A payload still in the buffer it was decoded from.
    InPlace(Bytes, OwnedSemaphorePermit),
    /// Copied payloads (one, or several adjacent ones joined).
    Copied(BytesMut, OwnedSemaphorePermit),
    Event(E),
}

impl<E: From<Bytes>> Queued<E> {
    fn into_delivery(self) -> Delivery<E> {
        match self {
            Queued::InPlace(bytes, permit) => Delivery {
                event: E::from(bytes),
                _budget: Some(permit),
            },
            Queued::Copied(bytes, permit) => Delivery {
                event: E::from(bytes.freeze()),
                _budget: Some(permit),
            },
            Queued::Event(event) => Delivery {
                event,
                _budget: None,
            },
        }
    }
}

#[derive(Debug)]
struct QueueState<E> {
    items: VecDeque<Queued<E>>,
    /// Live [`ReceiveQueue`] handles; none left ends the consumer's stream.
    senders: usize,
    consumer_gone: bool,
    consumer: Option<Waker>,
}

impl<E> QueueState<E> {
    fn queue_data(&mut self, payload: Bytes, permit: OwnedSemaphorePermit) {
        if payload.len() >= COPY_BELOW {
            self.items.push_back(Queued::InPlace(payload, permit));
            return;
        }
        if let Some(Queued::Copied(joined, joined_permit)) = self.items.back_mut()
            && joined.len() + payload.len() <= COALESCE_UP_TO
        {
            joined.extend_from_slice(&payload);
            joined_permit.merge(permit);
            return;
        }
        self.items
            .push_back(Queued::Copied(BytesMut::from(&payload[..]), permit));
    }
}

#[derive(Debug)]
struct QueueShared<E> {
    state: Mutex<QueueState<E>>,
    budget: Arc<Semaphore>,
}

impl<E> QueueShared<E> {
    fn lock(&self) -> MutexGuard<'_, QueueState<E>> {
        // The state stays consistent across a panic elsewhere: every
        // critical section is a single push, pop or flag change.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds to the queue unless the consumer is gone, then wakes the
    /// consumer outside the lock.
    fn enqueue(&self, add: impl FnOnce(&mut QueueState<E>)) -> Result<(), FlowError> {
        let waker = {
            let mut state = self.lock();
            if state.consumer_gone {
                return Err(FlowError::Closed);
            }
            add(&mut state);
            state.consumer.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }
}

/// The dispatching side of a connection's receive buffer. Data payloads are
/// queued by [`Self::push_data`] and reach the consumer as `E::from(bytes)`,
/// possibly joined with adjacent small payloads (a connection is a byte
/// stream: where one packet ended is not kept).
#[derive(Debug)]
pub struct ReceiveQueue<E> {
    shared: Arc<QueueShared<E>>,
    capacity: u32,
    strict: bool,
    stall_timeout: std::time::Duration,
}

impl<E> Clone for ReceiveQueue<E> {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        ReceiveQueue {
            shared: self.shared.clone(),
            capacity: self.capacity,
            strict: self.strict,
            stall_timeout: self.stall_timeout,
        }
    }
}

impl<E> Drop for ReceiveQueue<E> {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.shared.lock();
            state.senders -= 1;
            if state.senders == 0 {
                state.consumer.take()
            } else {
                None
            }
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The consuming side of a connection's receive buffer.
#[derive(Debug)]
pub struct ReceiveQueueRx<E> {
    shared: Arc<QueueShared<E>>,
}

impl<E> Drop for ReceiveQueueRx<E> {
    fn drop(&mut self) {
        let abandoned = {
            let mut state = self.shared.lock();
            state.consumer_gone = true;
            state.consumer = None;
            std::mem::take(&mut state.items)
        };
        // Returns their budget (and runs their drops) outside the lock.
        drop(abandoned);
    }
}

impl<E: From<Bytes>> ReceiveQueue<E> {
    /// A queue that holds at most `capacity` payload bytes. `flow_controlled`:
    /// the peer honours our window of `capacity` bytes, so exceeding it is a
    /// protocol violation rather than a reason to wait.
    pub fn new(capacity: u32, flow_controlled: bool) -> (Self, ReceiveQueueRx<E>) {
        let capacity = capacity.max(1);
        let shared = Arc::new(QueueShared {
            state: Mutex::new(QueueState {
                items: VecDeque::new(),
                senders: 1,
                consumer_gone: false,
                consumer: None,
            }),
            budget: Arc::new(Semaphore::new(capacity as usize)),
        });
        (
            ReceiveQueue {
                shared: shared.clone(),
                capacity,
                strict: flow_controlled,
                stall_timeout: DEFAULT_STALL_TIMEOUT,
            },
            ReceiveQueueRx { shared },
        )
    }

    /// How long [`Self::push_data`] may wait for room (plain peers only).
    pub fn with_stall_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.stall_timeout = timeout;
        self
    }

    /// Queues a payload. With flow control this never waits; without it, it
    /// waits while the buffer is full, up to the stall timeout
    /// ([`FlowError::Stalled`]): one stalled connection may hold up its
    /// tunnel only that long. An empty payload carries nothing and is not
    /// queued.
    pub async fn push_data(&self, payload: Bytes, connect_id: i64) -> Result<(), FlowError> {
        if payload.is_empty() {
            return Ok(());
        }
        // A single oversized chunk from a plain peer must not wait forever.
        let cost = u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .min(self.capacity);
        let permit = if self.strict {
            self.shared
                .budget
                .clone()
                .try_acquire_many_owned(cost)
                .map_err(|_| FlowError::WindowExceeded {
                    connect_id,
                    got: payload.len(),
                })?
        } else {
            let wait = self.shared.budget.clone().acquire_many_owned(cost);
            match tokio::time::timeout(self.stall_timeout, wait).await {
                Ok(permit) => permit.map_err(|_| FlowError::Closed)?,
                Err(_) => {
                    return Err(FlowError::Stalled {
                        connect_id,
                        after: self.stall_timeout,
                    });
                }
            }
        };
        self.shared
            .enqueue(|state| state.queue_data(payload, permit))
    }
}

impl<E> ReceiveQueue<E> {
    /// Queues a control event (close, error); these are not counted.
    pub fn push(&self, event: E) -> Result<(), FlowError> {
        self.shared
            .enqueue(|state| state.items.push_back(Queued::Event(event)))
    }

    /// Whether the consumer is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().consumer_gone
    }

    /// Bytes currently buffered.
    pub fn buffered(&self) -> usize {
        self.capacity as usize - self.shared.budget.available_permits()
    }
}

impl<E: From<Bytes>> ReceiveQueueRx<E> {
    pub async fn recv(&mut self) -> Option<Delivery<E>> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// The next item; `None` once the queue is empty and every
    /// [`ReceiveQueue`] handle is gone or [`Self::close`] was called.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Delivery<E>>> {
        let mut state = self.shared.lock();
        if let Some(item) = state.items.pop_front() {
            drop(state);
            return Poll::Ready(Some(item.into_delivery()));
        }
        if state.senders == 0 || state.consumer_gone {
            return Poll::Ready(None);
        }
        if !state
            .consumer
            .as_ref()
            .is_some_and(|waker| waker.will_wake(cx.waker()))
        {
            state.consumer = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl<E> ReceiveQueueRx<E> {
    /// Stops accepting new items; queued ones can still be received.
    pub fn close(&mut self) {
        self.shared.lock().consumer_gone = true;
    }
}

/// Decides when the receiver returns credit: after a quarter of the window
/// was consumed, so updates are few and the sender never runs dry on a fast path.
#[derive(Debug)]
pub struct WindowTracker {
    consumed: u64,
    threshold: u64,
}

impl WindowTracker {
    pub fn new(window: u32) -> Self {
        WindowTracker {
            consumed: 0,
            threshold: u64::from(window / 4).max(1),
        }
    }

    /// Records `n` consumed bytes; returns the grant to send, if it is time.
    pub fn consumed(&mut self, n: usize) -> Option<i64> {
        self.consumed += n as u64;
        if self.consumed >= self.threshold {
            let grant = std::mem::take(&mut self.consumed);
            i64::try_from(grant).ok()
        } else {
            None
        }
    }
}

/// Connection ids a tunnel recently answered as unknown. The control lane
/// never waits, so a peer that floods packets for ids it made up (and
/// stops reading) would grow it by one reply per packet; with this each id
/// is answered once, and at most `capacity` ids per `hold`.
#[derive(Debug)]
pub struct StrayIds {
    answered: std::collections::HashMap<i64, std::time::Instant>,
    capacity: usize,
    hold: std::time::Duration,
}

/// What to do with a packet for an unknown connection id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stray {
    /// Answer it (and remember the id).
    Answer,
    /// This id was answered within `hold`: drop the packet.
    AlreadyAnswered,
    /// `capacity` other ids were answered within `hold`: drop the packet
    /// unanswered (the bound bit).
    Full,
}

impl StrayIds {
    pub fn new(capacity: usize, hold: std::time::Duration) -> Self {
        StrayIds {
            answered: std::collections::HashMap::new(),
            capacity: capacity.max(1),
            hold,
        }
    }

    pub fn admit(&mut self, connect_id: i64, now: std::time::Instant) -> Stray {
        let hold = self.hold;
        let fresh = |at: &std::time::Instant| now.saturating_duration_since(*at) < hold;
        if self.answered.get(&connect_id).is_some_and(fresh) {
            return Stray::AlreadyAnswered;
        }
        if self.answered.len() >= self.capacity {
            self.answered.retain(|_, at| fresh(at));
            if self.answered.len() >= self.capacity {
                return Stray::Full;
            }
        }
        self.answered.insert(connect_id, now);
        Stray::Answer
    }

    /// Ids remembered now (at most `capacity`).
    pub fn len(&self) -> usize {
        self.answered.len()
    }

    pub fn is_empty(&self) -> bool {
        self.answered.is_empty()
    }
}

/// The two lanes of packets towards a tunnel peer. `ordered` carries what
/// must keep its per-connection order (dial answers, DATA, closes) and is
/// bounded, so connection tasks wait when the stream is slow. `control`
/// (WINDOW_UPDATE, DIAL_CLS, replies to stray packets) is sent ahead of it and
/// never waits, so the tunnel's reader can always answer.
#[derive(Clone, Debug)]
pub struct Outbound {
    pub control: mpsc::UnboundedSender<Packet>,
    pub ordered: mpsc::Sender<Packet>,
}

/// The merged lanes, as a gRPC request or response stream: `control` ahead
/// of `ordered`, ending when the tunnel's `closed` token is cancelled (what
/// is still queued is dropped with the stream) or once both lanes' senders
/// are gone.
///
/// Polled several times per packet (the body coalesces what is queued, and
/// a poll that finds nothing registers for the next), so the cancellation is
/// watched through a waker of our own: the token's future is polled only
/// after it woke us, where polling it each time takes two locks.
#[derive(Debug)]
pub struct OutboundPackets {
    control: mpsc::UnboundedReceiver<Packet>,
    ordered: mpsc::Receiver<Packet>,
    control_open: bool,
    ordered_open: bool,
    closed: Pin<Box<WaitForCancellationFutureOwned>>,
    closed_wake: Arc<ClosedWake>,
    closed_waker: Waker,
    ended: bool,
}

/// Marks that the cancellation future woke us, and passes the wake on to
/// the task polling the stream.
#[derive(Debug)]
struct ClosedWake {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for ClosedWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::SeqCst);
        self.task.wake();
    }
}

impl OutboundPackets {
    /// Whether `closed` was cancelled, as far as its wakes tell.
    fn poll_closed(&mut self, cx: &mut Context<'_>) -> bool {
        // Registered before the mark is read, so a wake in between is seen
        // either here or by the task.
        self.closed_wake.task.register(cx.waker());
        if !self.closed_wake.fired.swap(false, Ordering::SeqCst) {
            return false;
        }
        let mut closed_cx = Context::from_waker(&self.closed_waker);
        self.closed.as_mut().poll(&mut closed_cx).is_ready()
    }
}

impl Stream for OutboundPackets {
    type Item = Packet;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Packet>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        if this.poll_closed(cx) {
            this.ended = true;
            return Poll::Ready(None);
        }
        if this.control_open {
            match this.control.poll_recv(cx) {
                Poll::Ready(Some(packet)) => return Poll::Ready(Some(packet)),
                Poll::Ready(None) => this.control_open = false,
                Poll::Pending => {}
            }
        }
        if this.ordered_open {
            match this.ordered.poll_recv(cx) {
                Poll::Ready(Some(packet)) => return Poll::Ready(Some(packet)),
                Poll::Ready(None) => this.ordered_open = false,
                Poll::Pending => {}
            }
        }
        if !this.control_open && !this.ordered_open {
            this.ended = true;
            return Poll::Ready(None);
        }
        Poll::Pending
    }
}

/// Creates both lanes; the merged stream ends when `closed` is cancelled, which
/// closes the HTTP/2 stream with the tunnel.
pub fn outbound(ordered_capacity: usize, closed: CancellationToken) -> (Outbound, OutboundPackets) {
    let (control, control_rx) = mpsc::unbounded_channel();
    let (ordered, ordered_rx) = mpsc::channel(ordered_capacity.max(1));
    let closed_wake = Arc::new(ClosedWake {
        // The first poll polls the token's future, registering our waker.
        fired: AtomicBool::new(true),
        task: AtomicWaker::new(),
    });
    let packets = OutboundPackets {
        control: control_rx,
        ordered: ordered_rx,
        control_open: true,
        ordered_open: true,
        closed: Box::pin(closed.cancelled_owned()),
        closed_waker: Waker::from(closed_wake.clone()),
        closed_wake,
        ended: false,
    };
    (Outbound { control, ordered }, packets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use std::time::Duration;

    #[test]
    fn stray_ids_answer_each_id_once_and_at_most_capacity_per_hold() {
        let start = std::time::Instant::now();
        let hold = Duration::from_secs(30);
        let mut stray = StrayIds::new(3, hold);
        assert_eq!(stray.admit(1, start), Stray::Answer);
        assert_eq!(stray.admit(1, start), Stray::AlreadyAnswered);
        assert_eq!(stray.admit(2, start), Stray::Answer);
        assert_eq!(stray.admit(3, start), Stray::Answer);
        for id in 4..10_000 {
            assert_eq!(stray.admit(id, start), Stray::Full);
        }
        assert_eq!(stray.len(), 3);
        let later = start + hold;
        assert_eq!(stray.admit(4, later), Stray::Answer);
        assert_eq!(
            stray.admit(1, later),
            Stray::Answer,
            "answered again once the hold passed"
        );
        assert!(stray.len() <= 3);
    }

    #[tokio::test]
    async fn credit_blocks_until_granted() {
        let credit = SendCredit::with_window(MIN_WINDOW);
        credit.acquire(MIN_WINDOW as usize).await.unwrap();
        let waiting = {
            let credit = credit.clone();
            tokio::spawn(async move { credit.acquire(10).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        credit.grant(10).unwrap();
        waiting.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn closing_credit_wakes_waiters() {
        let credit = SendCredit::with_window(MIN_WINDOW);
        credit.acquire(MIN_WINDOW as usize).await.unwrap();
        let waiting = {
            let credit = credit.clone();
            tokio::spawn(async move { credit.acquire(1).await })
        };
        credit.close();
        assert_eq!(waiting.await.unwrap(), Err(FlowError::Closed));
    }

    #[test]
    fn rejects_bad_grants() {
        let credit = SendCredit::with_window(MIN_WINDOW);
        assert_eq!(credit.grant(0), Err(FlowError::BadGrant(0)));
        assert_eq!(credit.grant(-5), Err(FlowError::BadGrant(-5)));
        assert_eq!(credit.grant(i64::MAX), Err(FlowError::BadGrant(i64::MAX)));
        SendCredit::unlimited().grant(-5).unwrap();
    }

    #[tokio::test]
    async fn strict_queue_refuses_bytes_beyond_the_window() {
        let (q, mut rx) = ReceiveQueue::<Bytes>::new(100, true);
        let chunk = Bytes::from(vec![0u8; 60]);
        q.push_data(chunk.clone(), 1).await.unwrap();
        assert_eq!(
            q.push_data(chunk.clone(), 1).await,
            Err(FlowError::WindowExceeded {
                connect_id: 1,
                got: 60
            })
        );
        assert_eq!(q.buffered(), 60);
        drop(rx.recv().await.unwrap());
        assert_eq!(q.buffered(), 0);
        q.push_data(chunk.clone(), 1).await.unwrap();
    }

    #[tokio::test]
    async fn lenient_queue_waits_when_full_and_never_deadlocks_on_huge_chunks() {
        let (q, mut rx) = ReceiveQueue::<Bytes>::new(100, false);
        let huge = Bytes::from(vec![7u8; 1000]);
        q.push_data(huge.clone(), 1).await.unwrap();
        let blocked = {
            let q = q.clone();
            tokio::spawn(async move { q.push_data(Bytes::from_static(b"x"), 1).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!blocked.is_finished());
        assert_eq!(rx.recv().await.unwrap().event, huge);
        blocked.await.unwrap().unwrap();
        assert_eq!(rx.recv().await.unwrap().event, Bytes::from_static(b"x"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_plain_connection_gives_up_after_the_stall_timeout() {
        let (q, _rx) = ReceiveQueue::<Bytes>::new(100, false);
        let q = q.with_stall_timeout(std::time::Duration::from_secs(3));
        let chunk = Bytes::from(vec![0u8; 100]);
        q.push_data(chunk.clone(), 9).await.unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            q.push_data(chunk, 9).await,
            Err(FlowError::Stalled {
                connect_id: 9,
                after: std::time::Duration::from_secs(3)
            })
        );
        assert_eq!(started.elapsed(), std::time::Duration::from_secs(3));
    }

    fn points_into(payload: &Bytes, buffer: &Bytes) -> bool {
        let range = buffer.as_ptr_range();
        range.contains(&payload.as_ptr())
    }

    /// A reader that does not read while an agent sends one byte per packet
    /// (each a slice of a large read buffer) costs about the bytes queued:
    /// none of the buffer stays pinned and the items are few.
    #[tokio::test]
    async fn tiny_payloads_are_copied_out_and_joined() {
        let (q, mut rx) = ReceiveQueue::<Bytes>::new(DEFAULT_WINDOW, true);
        let read_buffer = Bytes::from((0..=255u8).cycle().take(1 << 20).collect::<Vec<u8>>());
        const PACKETS: usize = 100_000;
        for i in 0..PACKETS {
            q.push_data(read_buffer.slice(i..i + 1), 3).await.unwrap();
        }
        assert_eq!(q.buffered(), PACKETS);
        drop(q);
        let mut deliveries = Vec::new();
        while let Some(delivery) = rx.recv().await {
            deliveries.push(delivery);
        }
        assert_eq!(deliveries.len(), PACKETS.div_ceil(COALESCE_UP_TO));
        let mut joined = Vec::new();
        for delivery in &deliveries {
            assert!(!points_into(&delivery.event, &read_buffer));
            joined.extend_from_slice(&delivery.event);
        }
        assert_eq!(joined, read_buffer[..PACKETS]);
    }

    #[tokio::test]
    async fn long_payloads_are_delivered_in_place_and_order_is_kept() {
        let (q, mut rx) = ReceiveQueue::<Bytes>::new(DEFAULT_WINDOW, true);
        let read_buffer = Bytes::from(vec![1u8; 1 << 20]);
        let long = read_buffer.slice(100..100 + COPY_BELOW);
        q.push_data(read_buffer.slice(0..10), 1).await.unwrap();
        q.push_data(long.clone(), 1).await.unwrap();
        q.push_data(read_buffer.slice(10..20), 1).await.unwrap();
        q.push_data(read_buffer.slice(20..30), 1).await.unwrap();
        let first = rx.recv().await.unwrap();
        assert_eq!(first.event.len(), 10);
        assert!(!points_into(&first.event, &read_buffer));
        let second = rx.recv().await.unwrap();
        assert_eq!(second.event.as_ptr(), long.as_ptr(), "no copy");
        assert_eq!(second.event.len(), COPY_BELOW);
        // The two short payloads after it are joined into one.
        assert_eq!(rx.recv().await.unwrap().event.len(), 20);
        assert_eq!(q.buffered(), 10 + COPY_BELOW);
        drop((first, second));
        assert_eq!(q.buffered(), 0);
    }

    #[tokio::test]
    async fn the_consumer_sees_the_end_after_the_queued_items() {
        let (q, mut rx) = ReceiveQueue::<Bytes>::new(100, true);
        let other = q.clone();
        q.push_data(Bytes::from_static(b"ab"), 1).await.unwrap();
        q.push(Bytes::from_static(b"end")).unwrap();
        drop(q);
        let waiting = tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some(delivery) = rx.recv().await {
                seen.push(delivery.event);
            }
            seen
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "one handle is left");
        drop(other);
        assert_eq!(
            waiting.await.unwrap(),
            vec![Bytes::from_static(b"ab"), Bytes::from_static(b"end")]
        );
    }

    #[tokio::test]
    async fn a_closed_or_dropped_consumer_refuses_data_and_returns_its_budget() {
        let (q, mut rx) = ReceiveQueue::<Bytes>::new(100, true);
        q.push_data(Bytes::from_static(b"abc"), 1).await.unwrap();
        rx.close();
        assert!(q.is_closed());
        assert_eq!(
            q.push_data(Bytes::from_static(b"d"), 1).await,
            Err(FlowError::Closed)
        );
        assert_eq!(q.push(Bytes::new()), Err(FlowError::Closed));
        assert_eq!(rx.recv().await.unwrap().event, Bytes::from_static(b"abc"));
        assert!(rx.recv().await.is_none());

        let (q, rx) = ReceiveQueue::<Bytes>::new(100, true);
        q.push_data(Bytes::from_static(b"abc"), 1).await.unwrap();
        assert_eq!(q.buffered(), 3);
        drop(rx);
        assert_eq!(q.buffered(), 0);
    }

    #[test]
    fn tracker_grants_after_a_quarter_window() {
        let mut t = WindowTracker::new(400);
        assert_eq!(t.consumed(50), None);
        assert_eq!(t.consumed(60), Some(110));
        assert_eq!(t.consumed(99), None);
    }

    #[tokio::test]
    async fn control_packets_overtake_ordered_ones_and_closing_ends_the_stream() {
        let closed = CancellationToken::new();
        let (out, mut packets) = outbound(4, closed.clone());
        out.ordered
            .send(crate::packet::data(1, Bytes::from_static(b"x")))
            .await
            .unwrap();
        out.control
            .send(crate::packet::window_update(1, 10))
            .unwrap();
        let first = packets.next().await.unwrap();
        assert_eq!(crate::packet::type_name(&first), "WINDOW_UPDATE");
        assert_eq!(
            crate::packet::type_name(&packets.next().await.unwrap()),
            "DATA"
        );
        closed.cancel();
        assert!(packets.next().await.is_none());
    }

    /// A stream waiting for packets is woken by the tunnel's cancellation
    /// and ends, dropping what was queued after it; one whose senders are
    /// all gone ends too.
    #[test]
    fn a_waiting_stream_is_woken_by_the_cancellation_and_ends() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(Count(Default::default()));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);

        let closed = CancellationToken::new();
        let (out, mut packets) = outbound(4, closed.clone());
        assert!(Pin::new(&mut packets).poll_next(&mut cx).is_pending());
        assert!(Pin::new(&mut packets).poll_next(&mut cx).is_pending());
        closed.cancel();
        assert!(
            count.0.load(Ordering::SeqCst) >= 1,
            "the cancellation woke the task"
        );
        out.control
            .send(crate::packet::window_update(1, 10))
            .unwrap();
        assert_eq!(Pin::new(&mut packets).poll_next(&mut cx), Poll::Ready(None));
        assert_eq!(Pin::new(&mut packets).poll_next(&mut cx), Poll::Ready(None));

        let (out, mut packets) = outbound(4, CancellationToken::new());
        out.ordered
            .try_send(crate::packet::data(1, Bytes::from_static(b"x")))
            .unwrap();
        drop(out);
        assert!(matches!(
            Pin::new(&mut packets).poll_next(&mut cx),
            Poll::Ready(Some(_))
        ));
        assert_eq!(
            Pin::new(&mut packets).poll_next(&mut cx),
            Poll::Ready(None),
            "both lanes' senders are gone"
        );
    }

    #[test]
    fn window_values_are_validated() {
        assert_eq!(parse_window("2097152"), Ok(2_097_152));
        assert!(parse_window("10").is_err());
        assert!(parse_window("x").is_err());
        assert!(parse_window("99999999999").is_err());
    }
}
