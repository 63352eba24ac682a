//! One audit record per request: who (user, groups), where (cluster), what
//! (verb, path), the answer (code), bytes each way, how long, and the trace
//! id; written as a JSON log line (target `audit`) when the response has
//! been sent in full (or the client went away), and counted per cluster and
//! code in Prometheus.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::Serialize;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub cluster: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    pub cluster: String,
}

/// The user-server's metrics.
#[derive(Clone)]
pub struct Metrics {
    pub requests: Family<RequestLabels, Counter>,
    pub duration: Family<ClusterLabels, Histogram>,
    pub bytes_to_cluster: Family<ClusterLabels, Counter>,
    pub bytes_from_cluster: Family<ClusterLabels, Counter>,
    pub token_reviews: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 16))
            }),
            bytes_to_cluster: Family::default(),
            bytes_from_cluster: Family::default(),
            token_reviews: Counter::default(),
        }
    }
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "user_server_requests",
            "Requests answered, by cluster and status code (0: the client went away first)",
            self.requests.clone(),
        );
        registry.register(
            "user_server_request_duration_seconds",
            "From the request's arrival to the end of its response, by cluster",
            self.duration.clone(),
        );
        registry.register(
            "user_server_request_bytes",
            "Body bytes sent to the clusters",
            self.bytes_to_cluster.clone(),
        );
        registry.register(
            "user_server_response_bytes",
            "Body bytes received from the clusters",
            self.bytes_from_cluster.clone(),
        );
        registry.register(
            "user_server_token_reviews",
            "TokenReviews sent to the hub (cache misses)",
            self.token_reviews.clone(),
        );
    }
}

/// What the record says; filled in as the request goes.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub user: String,
    pub groups: Vec<String>,
    pub cluster: String,
    pub verb: String,
    pub method: String,
    pub path: String,
    pub code: u16,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub duration_ms: f64,
    pub trace_id: String,
    pub upgraded: bool,
    /// The client's own token went to the cluster, unknown to the hub
    /// (`--managed-token-passthrough`): `user` is empty, the cluster
    /// authenticated it.
    pub passthrough: bool,
}

/// A request's audit, written once when dropped.
pub struct Audit {
    record: Record,
    started: Instant,
    metrics: Metrics,
    /// Request body bytes, counted as the body is forwarded.
    pub bytes_in: Arc<AtomicU64>,
    bytes_out: u64,
}

impl Audit {
    pub fn new(record: Record, metrics: Metrics) -> Self {
        Audit {
            record,
            started: Instant::now(),
            metrics,
            bytes_in: Arc::default(),
            bytes_out: 0,
        }
    }

    pub fn record_mut(&mut self) -> &mut Record {
        &mut self.record
    }

    /// Upgraded streams: the bytes each way, known when the stream ends.
    pub fn upgraded(&mut self, up: u64, down: u64) {
        self.record.upgraded = true;
        self.bytes_in.fetch_add(up, Ordering::Relaxed);
        self.bytes_out += down;
    }
}

impl Drop for Audit {
    fn drop(&mut self) {
        let record = &mut self.record;
        record.bytes_in = self.bytes_in.load(Ordering::Relaxed);
        record.bytes_out = self.bytes_out;
        let elapsed = self.started.elapsed();
        record.duration_ms = elapsed.as_secs_f64() * 1000.0;
        let cluster = ClusterLabels {
            cluster: record.cluster.clone(),
        };
        self.metrics
            .requests
            .get_or_create(&RequestLabels {
                cluster: record.cluster.clone(),
                code: record.code.to_string(),
            })
            .inc();
        self.metrics
            .duration
            .get_or_create(&cluster)
            .observe(elapsed.as_secs_f64());
        self.metrics
            .bytes_to_cluster
            .get_or_create(&cluster)
            .inc_by(record.bytes_in);
        self.metrics
            .bytes_from_cluster
            .get_or_create(&cluster)
            .inc_by(record.bytes_out);
        match serde_json::to_string(&*record) {
            Ok(line) => tracing::info!(target: "audit", "{line}"),
            Err(error) => tracing::warn!(%error, "an audit record did not serialize"),
        }
    }
}

/// A response body that counts its bytes into an [`Audit`], which is
/// written when the body ends or is dropped.
pub struct AuditedBody<B> {
    inner: B,
    audit: Option<Audit>,
}

impl<B> AuditedBody<B> {
    pub fn new(inner: B, audit: Audit) -> Self {
        AuditedBody {
            inner,
            audit: Some(audit),
        }
    }
}

impl<B> Body for AuditedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(audit)) = (frame.data_ref(), self.audit.as_mut()) {
                    audit.bytes_out += data.len() as u64;
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => {
                // The end: write the record now, not when hyper drops us.
                self.audit.take();
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that counts its bytes.
pub struct CountedBody<B> {
    inner: B,
    count: Arc<AtomicU64>,
}

impl<B> CountedBody<B> {
    pub fn new(inner: B, count: Arc<AtomicU64>) -> Self {
        CountedBody { inner, count }
    }
}

impl<B> Body for CountedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.count.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
