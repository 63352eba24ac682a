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

use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::{PollNext, Stream, StreamExt, select_with_strategy};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tokio_util::sync::CancellationToken;

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

/// One item delivered to a connection's consumer. The bytes it carries stay
/// counted against the connection's buffer until it is dropped, so drop it
/// only after the payload was handed on.
#[derive(Debug)]
pub struct Delivery<E> {
    pub event: E,
    _budget: Option<OwnedSemaphorePermit>,
}

/// The dispatching side of a connection's receive buffer.
#[derive(Debug)]
pub struct ReceiveQueue<E> {
    tx: mpsc::UnboundedSender<Delivery<E>>,
    budget: Arc<Semaphore>,
    capacity: u32,
    strict: bool,
    stall_timeout: std::time::Duration,
}

impl<E> Clone for ReceiveQueue<E> {
    fn clone(&self) -> Self {
        ReceiveQueue {
            tx: self.tx.clone(),
            budget: self.budget.clone(),
            capacity: self.capacity,
            strict: self.strict,
            stall_timeout: self.stall_timeout,
        }
    }
}

/// The consuming side of a connection's receive buffer.
#[derive(Debug)]
pub struct ReceiveQueueRx<E> {
    rx: mpsc::UnboundedReceiver<Delivery<E>>,
}

impl<E> ReceiveQueue<E> {
    /// A queue that holds at most `capacity` payload bytes. `flow_controlled`:
    /// the peer honours our window of `capacity` bytes, so exceeding it is a
    /// protocol violation rather than a reason to wait.
    pub fn new(capacity: u32, flow_controlled: bool) -> (Self, ReceiveQueueRx<E>) {
        let capacity = capacity.max(1);
        let (tx, rx) = mpsc::unbounded_channel();
        (
            ReceiveQueue {
                tx,
                budget: Arc::new(Semaphore::new(capacity as usize)),
                capacity,
                strict: flow_controlled,
                stall_timeout: DEFAULT_STALL_TIMEOUT,
            },
            ReceiveQueueRx { rx },
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
    /// tunnel only that long.
    pub async fn push_data(
        &self,
        bytes: &Bytes,
        connect_id: i64,
        event: E,
    ) -> Result<(), FlowError> {
        // A single oversized chunk from a plain peer must not wait forever.
        let cost = u32::try_from(bytes.len())
            .unwrap_or(u32::MAX)
            .min(self.capacity);
        let permit = if cost == 0 {
            None
        } else if self.strict {
            Some(
                self.budget
                    .clone()
                    .try_acquire_many_owned(cost)
                    .map_err(|_| FlowError::WindowExceeded {
                        connect_id,
                        got: bytes.len(),
                    })?,
            )
        } else {
            let wait = self.budget.clone().acquire_many_owned(cost);
            match tokio::time::timeout(self.stall_timeout, wait).await {
                Ok(permit) => Some(permit.map_err(|_| FlowError::Closed)?),
                Err(_) => {
                    return Err(FlowError::Stalled {
                        connect_id,
                        after: self.stall_timeout,
                    });
                }
            }
        };
        self.tx
            .send(Delivery {
                event,
                _budget: permit,
            })
            .map_err(|_| FlowError::Closed)
    }

    /// Queues a control event (close, error); these are not counted.
    pub fn push(&self, event: E) -> Result<(), FlowError> {
        self.tx
            .send(Delivery {
                event,
                _budget: None,
            })
            .map_err(|_| FlowError::Closed)
    }

    /// Whether the consumer is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Bytes currently buffered.
    pub fn buffered(&self) -> usize {
        self.capacity as usize - self.budget.available_permits()
    }
}

impl<E> ReceiveQueueRx<E> {
    pub async fn recv(&mut self) -> Option<Delivery<E>> {
        self.rx.recv().await
    }

    pub fn poll_recv(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Delivery<E>>> {
        self.rx.poll_recv(cx)
    }

    /// Stops accepting new items; queued ones can still be received.
    pub fn close(&mut self) {
        self.rx.close();
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

/// The merged lanes, as a gRPC request or response stream.
pub type OutboundPackets = Pin<Box<dyn Stream<Item = Packet> + Send + 'static>>;

/// Creates both lanes; the merged stream ends when `closed` is cancelled, which
/// closes the HTTP/2 stream with the tunnel.
pub fn outbound(ordered_capacity: usize, closed: CancellationToken) -> (Outbound, OutboundPackets) {
    let (control, control_rx) = mpsc::unbounded_channel();
    let (ordered, ordered_rx) = mpsc::channel(ordered_capacity.max(1));
    let merged = select_with_strategy(
        UnboundedReceiverStream::new(control_rx),
        ReceiverStream::new(ordered_rx),
        |_: &mut ()| PollNext::Left,
    )
    .take_until(closed.cancelled_owned());
    (Outbound { control, ordered }, Box::pin(merged))
}

#[cfg(test)]
mod tests {
    use super::*;
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
        q.push_data(&chunk, 1, chunk.clone()).await.unwrap();
        assert_eq!(
            q.push_data(&chunk, 1, chunk.clone()).await,
            Err(FlowError::WindowExceeded {
                connect_id: 1,
                got: 60
            })
        );
        assert_eq!(q.buffered(), 60);
        drop(rx.recv().await.unwrap());
        assert_eq!(q.buffered(), 0);
        q.push_data(&chunk, 1, chunk.clone()).await.unwrap();
    }

    #[tokio::test]
    async fn lenient_queue_waits_when_full_and_never_deadlocks_on_huge_chunks() {
        let (q, mut rx) = ReceiveQueue::<usize>::new(100, false);
        let huge = Bytes::from(vec![0u8; 1000]);
        q.push_data(&huge, 1, 1).await.unwrap();
        let blocked = {
            let q = q.clone();
            let small = Bytes::from_static(b"x");
            tokio::spawn(async move { q.push_data(&small, 1, 2).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!blocked.is_finished());
        assert_eq!(rx.recv().await.unwrap().event, 1);
        blocked.await.unwrap().unwrap();
        assert_eq!(rx.recv().await.unwrap().event, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_plain_connection_gives_up_after_the_stall_timeout() {
        let (q, _rx) = ReceiveQueue::<usize>::new(100, false);
        let q = q.with_stall_timeout(std::time::Duration::from_secs(3));
        let chunk = Bytes::from(vec![0u8; 100]);
        q.push_data(&chunk, 9, 1).await.unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            q.push_data(&chunk, 9, 2).await,
            Err(FlowError::Stalled {
                connect_id: 9,
                after: std::time::Duration::from_secs(3)
            })
        );
        assert_eq!(started.elapsed(), std::time::Duration::from_secs(3));
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

    #[test]
    fn window_values_are_validated() {
        assert_eq!(parse_window("2097152"), Ok(2_097_152));
        assert!(parse_window("10").is_err());
        assert!(parse_window("x").is_err());
        assert!(parse_window("99999999999").is_err());
    }
}
