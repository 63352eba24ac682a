//! Spans sent home through the tunnel: an agent with no trace collector of
//! its own hands its spans to the proxy-server it is connected to, which
//! forwards them to its collector (the `cluster-proxy-span-relay`
//! extension, see `cluster_proxy_proto::metadata::SPAN_RELAY`).
//!
//! The agent's side is a [`RelayQueue`]: its span exporter
//! ([`RelayExporter`], on the batch processor's thread) encodes each batch
//! as an OTLP `ExportTraceServiceRequest` of at most
//! [`MAX_SPAN_BATCH`] bytes and offers it to the queue, which holds at
//! most [`RELAY_QUEUE_BATCHES`] of them. Tunnels whose server answered the
//! extension take batches from it, each batch down one tunnel. Nothing
//! waits on the queue: with it full, or no tunnel to take from it, a batch
//! is dropped and counted (`reason`), as the OTLP exporter drops what a
//! collector does not take.
//!
//! The server's side is a [`SpanForwarder`]: the tunnel's reader only
//! checks a batch's size and outline ([`count_spans`], no allocation) and
//! offers it to a queue of at most [`FORWARD_QUEUE_BATCHES`] batches; a task
//! on a runtime and thread of its own (like the OTLP exporter's) decodes
//! each, stamps every resource with the cluster the agent's certificate
//! names ([`RELAYED_FROM`], overwriting whatever the agent put there) and
//! exports it with the server's own exporter settings. A collector that is
//! slow or gone fills that queue and costs relayed spans, never the
//! tunnel's time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytes::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prost::Message;
use tokio::sync::{Notify, mpsc};

pub use cluster_proxy_proto::packet::MAX_SPAN_BATCH;

use super::error::TelemetryError;
use super::export_runtime::ExportRuntime;
use super::otlp_encoding::SpanEncoder;
use super::otlp_exporter::{CollectorConfig, OtlpSpanExporter};

/// Encoded batches an agent holds for its tunnels at most (each at most
/// [`MAX_SPAN_BATCH`] bytes, so at most 8 MiB).
pub const RELAY_QUEUE_BATCHES: usize = 32;

/// Relayed batches a server holds for its collector at most (each at most
/// [`MAX_SPAN_BATCH`] bytes, so at most 16 MiB, whatever the number of
/// agents).
pub const FORWARD_QUEUE_BATCHES: usize = 64;

/// The resource attribute the server stamps on every relayed resource:
/// the name of the cluster the sending agent's certificate names. What an
/// agent says there itself is overwritten; its other resource attributes
/// (`service.name`, `OTEL_RESOURCE_ATTRIBUTES`) are its own claims.
pub const RELAYED_FROM: &str = "cluster_proxy.relayed_from";

/// Metric labels, as the services' metrics spell them.
pub type Labels = Vec<(&'static str, &'static str)>;

/// Why an agent dropped spans instead of relaying them (the `reason` label).
pub mod drop_reason {
    /// No tunnel negotiated the relay (none up, or only servers without a
    /// collector or of upstream).
    pub const NO_TUNNEL: &str = "no_tunnel";
    /// The queue held [`super::RELAY_QUEUE_BATCHES`] batches already.
    pub const QUEUE_FULL: &str = "queue_full";
    /// One span alone encodes to more than [`super::MAX_SPAN_BATCH`].
    pub const TOO_LARGE: &str = "too_large";
    /// The tunnel that took the batch closed before it was sent.
    pub const TUNNEL_CLOSED: &str = "tunnel_closed";
}

/// What became of relayed spans at the server (the `outcome` label).
pub mod outcome {
    /// The collector took them.
    pub const EXPORTED: &str = "exported";
    /// The export failed or timed out; the batch is dropped.
    pub const EXPORT_FAILED: &str = "export_failed";
    /// The forwarder's queue was full; the batch is dropped.
    pub const QUEUE_FULL: &str = "queue_full";
}

/// Why a server refused a relayed batch before counting its spans (the
/// `reason` label).
pub mod rejection {
    /// Not an OTLP `ExportTraceServiceRequest`.
    pub const MALFORMED: &str = "malformed";
    /// More than [`super::MAX_SPAN_BATCH`] bytes.
    pub const TOO_LARGE: &str = "too_large";
    /// Sent on a tunnel that did not negotiate the relay.
    pub const NOT_NEGOTIATED: &str = "not_negotiated";
}

/// The agent's relay counters, registered by its metrics.
#[derive(Debug, Clone, Default)]
pub struct RelayCounters {
    /// Spans handed to a tunnel.
    pub sent: Counter,
    /// Spans dropped, by `reason` ([`drop_reason`]).
    pub dropped: Family<Labels, Counter>,
}

impl RelayCounters {
    fn drop_spans(&self, reason: &'static str, spans: usize) {
        self.dropped
            .get_or_create(&vec![("reason", reason)])
            .inc_by(spans as u64);
    }
}

/// One encoded batch: an OTLP `ExportTraceServiceRequest` and how many
/// spans it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayedBatch {
    pub otlp: Bytes,
    pub spans: usize,
}

/// The agent's bounded queue of encoded batches (see the module docs).
#[derive(Debug)]
pub struct RelayQueue {
    batches: Mutex<VecDeque<RelayedBatch>>,
    capacity: usize,
    ready: Notify,
    /// Tunnels that negotiated the relay and take from the queue.
    drainers: AtomicUsize,
    counters: RelayCounters,
}

/// Counts a tunnel as taking from the queue while it lives.
#[derive(Debug)]
pub struct Drainer {
    queue: Arc<RelayQueue>,
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.queue.drainers.fetch_sub(1, Ordering::SeqCst);
    }
}

impl RelayQueue {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(RelayQueue {
            batches: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
            ready: Notify::new(),
            drainers: AtomicUsize::new(0),
            counters: RelayCounters::default(),
        })
    }

    fn batches(&self) -> std::sync::MutexGuard<'_, VecDeque<RelayedBatch>> {
        self.batches.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The counters the agent's metrics register.
    pub fn counters(&self) -> RelayCounters {
        self.counters.clone()
    }

    /// Whether some tunnel takes from the queue now.
    pub fn has_drainer(&self) -> bool {
        self.drainers.load(Ordering::SeqCst) > 0
    }

    /// Batches waiting.
    pub fn len(&self) -> usize {
        self.batches().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `batch` for a tunnel, or drops and counts it; never waits.
    pub fn offer(&self, batch: RelayedBatch) {
        if !self.has_drainer() {
            self.counters
                .drop_spans(drop_reason::NO_TUNNEL, batch.spans);
            return;
        }
        {
            let mut batches = self.batches();
            if batches.len() >= self.capacity {
                drop(batches);
                self.counters
                    .drop_spans(drop_reason::QUEUE_FULL, batch.spans);
                return;
            }
            batches.push_back(batch);
        }
        self.ready.notify_one();
    }

    /// Registers a tunnel that takes from the queue, for as long as the
    /// returned guard lives.
    pub fn drainer(self: &Arc<Self>) -> Drainer {
        self.drainers.fetch_add(1, Ordering::SeqCst);
        Drainer {
            queue: self.clone(),
        }
    }

    /// The next batch; waits while there is none. Several tunnels may wait
    /// at once: each batch goes to one of them.
    pub async fn next(&self) -> RelayedBatch {
        loop {
            let ready = self.ready.notified();
            let (batch, more) = {
                let mut batches = self.batches();
                (batches.pop_front(), !batches.is_empty())
            };
            if let Some(batch) = batch {
                // Another batch may be waiting for another tunnel.
                if more {
                    self.ready.notify_one();
                }
                return batch;
            }
            ready.await;
        }
    }

    /// `batch` went to a tunnel.
    pub fn sent(&self, batch: &RelayedBatch) {
        self.counters.sent.inc_by(batch.spans as u64);
    }

    /// The tunnel that took `batch` closed before sending it.
    pub fn lost(&self, batch: &RelayedBatch) {
        self.counters
            .drop_spans(drop_reason::TUNNEL_CLOSED, batch.spans);
    }
}

/// The process's relay queue, once [`super::init`] set up relaying.
static INSTALLED: OnceLock<Arc<RelayQueue>> = OnceLock::new();

/// The queue the process's spans go to when they are relayed (set by
/// [`super::init`] for an agent with no collector of its own); `None`
/// otherwise.
pub fn installed() -> Option<Arc<RelayQueue>> {
    INSTALLED.get().cloned()
}

pub(super) fn install(queue: Arc<RelayQueue>) -> bool {
    INSTALLED.set(queue).is_ok()
}

/// The span exporter of an agent that relays: encodes each batch (split
/// to fit [`MAX_SPAN_BATCH`]) and offers it to the queue.
#[derive(Debug)]
pub struct RelayExporter {
    queue: Arc<RelayQueue>,
    encoder: SpanEncoder,
    limit: usize,
}

impl RelayExporter {
    pub fn new(queue: Arc<RelayQueue>) -> Self {
        RelayExporter {
            queue,
            encoder: SpanEncoder::default(),
            limit: MAX_SPAN_BATCH,
        }
    }

    /// Encodes `spans` into requests of at most `self.limit` bytes,
    /// halving a batch that is too big; a single span that is too big is
    /// dropped and counted.
    fn encode_within_limit(&self, spans: &[SpanData], out: &mut Vec<RelayedBatch>) {
        if spans.is_empty() {
            return;
        }
        let otlp = self.encoder.encode_request(spans);
        if otlp.len() <= self.limit {
            out.push(RelayedBatch {
                otlp: Bytes::from(otlp),
                spans: spans.len(),
            });
            return;
        }
        if spans.len() == 1 {
            self.queue.counters.drop_spans(drop_reason::TOO_LARGE, 1);
            return;
        }
        let (first, second) = spans.split_at(spans.len() / 2);
        self.encode_within_limit(first, out);
        self.encode_within_limit(second, out);
    }
}

impl SpanExporter for RelayExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        // Encoding costs; a batch no tunnel will take is dropped as is.
        if !self.queue.has_drainer() {
            self.queue
                .counters
                .drop_spans(drop_reason::NO_TUNNEL, batch.len());
            return Ok(());
        }
        let mut encoded = Vec::new();
        self.encode_within_limit(&batch, &mut encoded);
        drop(batch);
        for request in encoded {
            self.queue.offer(request);
        }
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: std::time::Duration) -> OTelSdkResult {
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.encoder = SpanEncoder::new(resource);
    }
}

/// Why a server refused a relayed batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RelayRejected {
    #[error("span batch of {0} bytes exceeds the limit of {MAX_SPAN_BATCH}")]
    TooLarge(usize),
    #[error("span batch is not an OTLP ExportTraceServiceRequest: {0}")]
    Malformed(&'static str),
}

impl RelayRejected {
    /// The `reason` label ([`rejection`]).
    pub fn reason(&self) -> &'static str {
        match self {
            RelayRejected::TooLarge(_) => rejection::TOO_LARGE,
            RelayRejected::Malformed(_) => rejection::MALFORMED,
        }
    }
}

/// Protobuf wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LENGTH_DELIMITED: u64 = 2;
const FIXED32: u64 = 5;

/// Reads a varint at `*at`, advancing it.
fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64, &'static str> {
    let mut value: u64 = 0;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = bytes.get(*at) else {
            return Err("truncated varint");
        };
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("varint longer than 10 bytes")
}

/// Calls `field(number, content)` for every length-delimited field of the
/// message `bytes` and skips the others; fails on anything that is not a
/// well-formed protobuf message.
fn each_delimited(
    bytes: &[u8],
    mut field: impl FnMut(u64, &[u8]) -> Result<(), &'static str>,
) -> Result<(), &'static str> {
    let mut at = 0;
    while at < bytes.len() {
        let key = read_varint(bytes, &mut at)?;
        let number = key >> 3;
        if number == 0 {
            return Err("field number 0");
        }
        match key & 7 {
            VARINT => {
                read_varint(bytes, &mut at)?;
            }
            FIXED64 => at = at.checked_add(8).ok_or("truncated field")?,
            FIXED32 => at = at.checked_add(4).ok_or("truncated field")?,
            LENGTH_DELIMITED => {
                let len = usize::try_from(read_varint(bytes, &mut at)?)
                    .map_err(|_| "length out of range")?;
                let end = at.checked_add(len).ok_or("length out of range")?;
                let content = bytes.get(at..end).ok_or("length beyond the message")?;
                field(number, content)?;
                at = end;
            }
            _ => return Err("unsupported wire type"),
        }
        if at > bytes.len() {
            return Err("truncated field");
        }
    }
    Ok(())
}

/// How many spans an encoded `ExportTraceServiceRequest` holds, from its
/// outline only (resource spans → scope spans → spans; nothing is copied
/// or decoded beyond that): cheap enough for a tunnel's reader, and it
/// refuses what is not a protobuf message of that shape.
pub fn count_spans(otlp: &[u8]) -> Result<usize, RelayRejected> {
    if otlp.len() > MAX_SPAN_BATCH {
        return Err(RelayRejected::TooLarge(otlp.len()));
    }
    let mut spans = 0usize;
    // ExportTraceServiceRequest.resource_spans = 1;
    // ResourceSpans.scope_spans = 2; ScopeSpans.spans = 2.
    each_delimited(otlp, |number, resource_spans| {
        if number != 1 {
            return Ok(());
        }
        each_delimited(resource_spans, |number, scope_spans| {
            if number != 2 {
                return Ok(());
            }
            each_delimited(scope_spans, |number, _span| {
                if number == 2 {
                    spans += 1;
                }
                Ok(())
            })
        })
    })
    .map_err(RelayRejected::Malformed)?;
    Ok(spans)
}

/// Sets [`RELAYED_FROM`] on every resource of `request` to `cluster`,
/// replacing any value the sender gave.
pub fn stamp(request: &mut ExportTraceServiceRequest, cluster: &str) {
    for resource_spans in &mut request.resource_spans {
        let resource = resource_spans.resource.get_or_insert_with(Default::default);
        resource.attributes.retain(|kv| kv.key != RELAYED_FROM);
        resource.attributes.push(KeyValue {
            key: RELAYED_FROM.to_owned(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(cluster.to_owned())),
            }),
            ..Default::default()
        });
    }
}

/// A batch on its way to the collector.
struct Forwarded {
    otlp: Bytes,
    spans: usize,
    cluster: Arc<str>,
}

/// The server's bounded forwarder of relayed spans (see the module docs).
/// Stops, dropping what is queued, when dropped.
pub struct SpanForwarder {
    queue: mpsc::Sender<Forwarded>,
    spans: Family<Labels, Counter>,
    /// Declared last: its runtime outlives the sender above, so the task
    /// sees the queue close and ends.
    _runtime: ExportRuntime,
}

impl std::fmt::Debug for SpanForwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanForwarder")
            .field("capacity", &self.queue.max_capacity())
            .finish_non_exhaustive()
    }
}

impl SpanForwarder {
    /// A forwarder to `collector`, holding at most `capacity` batches,
    /// counting spans by `outcome` in `spans` (built by the telemetry
    /// module's `span_forwarder`, from a process's settings).
    pub(crate) fn start(
        collector: &CollectorConfig,
        capacity: usize,
        spans: Family<Labels, Counter>,
    ) -> Result<Self, TelemetryError> {
        let runtime = ExportRuntime::start("otel-relay")?;
        let exporter = {
            // The channel spawns its tasks on the runtime it is built in.
            let _entered = runtime.handle.enter();
            OtlpSpanExporter::new(collector)?
        };
        let (queue, batches) = mpsc::channel(capacity.max(1));
        runtime
            .handle
            .spawn(forward(batches, exporter, spans.clone()));
        Ok(SpanForwarder {
            queue,
            spans,
            _runtime: runtime,
        })
    }

    /// Checks `otlp` (size and outline) and queues it for the collector,
    /// stamped with `cluster`; never waits. Returns the spans it holds, or
    /// why it was refused. A full queue drops the batch (counted under
    /// `outcome="queue_full"`) and is not an error of the sender's.
    pub fn forward(&self, cluster: &Arc<str>, otlp: Bytes) -> Result<usize, RelayRejected> {
        let spans = count_spans(&otlp)?;
        if spans == 0 {
            return Ok(0);
        }
        let batch = Forwarded {
            otlp,
            spans,
            cluster: cluster.clone(),
        };
        if self.queue.try_send(batch).is_err() {
            count(&self.spans, outcome::QUEUE_FULL, spans);
        }
        Ok(spans)
    }
}

fn count(spans: &Family<Labels, Counter>, outcome: &'static str, n: usize) {
    spans
        .get_or_create(&vec![("outcome", outcome)])
        .inc_by(n as u64);
}

/// Exports queued batches one at a time until the forwarder is dropped.
async fn forward(
    mut batches: mpsc::Receiver<Forwarded>,
    exporter: OtlpSpanExporter,
    spans: Family<Labels, Counter>,
) {
    let mut failing = false;
    while let Some(batch) = batches.recv().await {
        // The outline was checked; a batch whose inside is broken is still
        // refused here, where decoding costs the tunnel nothing.
        let mut request = match ExportTraceServiceRequest::decode(batch.otlp) {
            Ok(request) => request,
            Err(error) => {
                tracing::debug!(cluster = %batch.cluster, %error, "dropping a relayed span batch that does not decode");
                count(&spans, outcome::EXPORT_FAILED, batch.spans);
                continue;
            }
        };
        stamp(&mut request, &batch.cluster);
        match exporter.send(request.encode_to_vec()).await {
            Ok(_) => {
                if std::mem::replace(&mut failing, false) {
                    tracing::info!("relayed spans reach the trace collector again");
                }
                count(&spans, outcome::EXPORTED, batch.spans);
            }
            Err(status) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(error = %status, "forwarding relayed spans failed; they are dropped until the trace collector answers");
                }
                count(&spans, outcome::EXPORT_FAILED, batch.spans);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::resource::v1::Resource as ProtoResource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

    fn request(resources: usize, spans_each: usize, relayed_from: Option<&str>) -> Vec<u8> {
        let attributes = relayed_from
            .map(|claimed| {
                vec![KeyValue {
                    key: RELAYED_FROM.to_owned(),
                    value: Some(AnyValue {
                        value: Some(any_value::Value::StringValue(claimed.to_owned())),
                    }),
                    ..Default::default()
                }]
            })
            .unwrap_or_default();
        ExportTraceServiceRequest {
            resource_spans: (0..resources)
                .map(|_| ResourceSpans {
                    resource: Some(ProtoResource {
                        attributes: attributes.clone(),
                        ..Default::default()
                    }),
                    scope_spans: vec![ScopeSpans {
                        spans: (0..spans_each)
                            .map(|i| Span {
                                name: format!("span-{i}"),
                                ..Default::default()
                            })
                            .collect(),
                        ..Default::default()
                    }],
                    ..Default::default()
                })
                .collect(),
        }
        .encode_to_vec()
    }

    #[test]
    fn spans_are_counted_from_the_outline() {
        assert_eq!(count_spans(&request(2, 3, None)), Ok(6));
        assert_eq!(count_spans(&[]), Ok(0));
        assert_eq!(count_spans(&request(1, 0, None)), Ok(0));
    }

    #[test]
    fn what_is_not_a_request_is_refused_not_a_panic() {
        let good = request(1, 2, None);
        for garbage in [
            vec![0x0a],             // truncated length
            vec![0x0a, 0x05, 0x12], // length beyond the message
            vec![0xff; 11],         // overlong varint
            vec![0x0b],             // group wire type
            vec![0x00, 0x01],       // field number 0
            good[..good.len() - 1].to_vec(),
            vec![0x09, 1, 2, 3], // truncated fixed64
        ] {
            assert!(
                matches!(count_spans(&garbage), Err(RelayRejected::Malformed(_))),
                "{garbage:02x?}"
            );
        }
        let big = vec![0u8; MAX_SPAN_BATCH + 1];
        assert_eq!(
            count_spans(&big),
            Err(RelayRejected::TooLarge(MAX_SPAN_BATCH + 1))
        );
    }

    #[test]
    fn stamping_overwrites_what_the_agent_claimed() {
        let mut decoded =
            ExportTraceServiceRequest::decode(request(2, 1, Some("someone-else")).as_slice())
                .unwrap();
        decoded.resource_spans.push(ResourceSpans::default());
        stamp(&mut decoded, "cluster-a");
        for resource in &decoded.resource_spans {
            let values: Vec<_> = resource
                .resource
                .as_ref()
                .unwrap()
                .attributes
                .iter()
                .filter(|kv| kv.key == RELAYED_FROM)
                .map(|kv| kv.value.clone())
                .collect();
            assert_eq!(
                values,
                [Some(AnyValue {
                    value: Some(any_value::Value::StringValue("cluster-a".into()))
                })]
            );
        }
    }

    fn batch(spans: usize) -> RelayedBatch {
        RelayedBatch {
            otlp: Bytes::from_static(b"x"),
            spans,
        }
    }

    fn dropped(queue: &RelayQueue, reason: &'static str) -> u64 {
        queue
            .counters
            .dropped
            .get_or_create(&vec![("reason", reason)])
            .get()
    }

    #[tokio::test]
    async fn the_queue_is_bounded_and_needs_a_tunnel() {
        let queue = RelayQueue::new(2);
        queue.offer(batch(5));
        assert_eq!(dropped(&queue, drop_reason::NO_TUNNEL), 5);
        assert!(queue.is_empty());
        let drainer = queue.drainer();
        queue.offer(batch(1));
        queue.offer(batch(2));
        queue.offer(batch(3));
        assert_eq!(dropped(&queue, drop_reason::QUEUE_FULL), 3);
        assert_eq!(queue.next().await, batch(1));
        assert_eq!(queue.next().await, batch(2));
        drop(drainer);
        assert!(!queue.has_drainer());
        queue.offer(batch(4));
        assert_eq!(dropped(&queue, drop_reason::NO_TUNNEL), 9);
    }

    #[tokio::test]
    async fn each_batch_goes_to_one_waiting_tunnel() {
        let queue = RelayQueue::new(8);
        let _drainer = queue.drainer();
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let queue = queue.clone();
                tokio::spawn(async move { queue.next().await })
            })
            .collect();
        queue.offer(batch(1));
        queue.offer(batch(2));
        let mut got = Vec::new();
        for taker in takers {
            got.push(taker.await.unwrap().spans);
        }
        got.sort_unstable();
        assert_eq!(got, [1, 2]);
    }
}
