//! A small OTLP/gRPC trace receiver (a tonic `TraceService` from the
//! published protos): the tests check the spans it received, and `e2e up`
//! runs one when no collector is given, writing every span as a JSON line
//! to a file of the environment (`e2e traces` prints them as trees).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use serde::{Deserialize, Serialize};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

use crate::wait::wait_until;

/// How long [`Collector::wait_for`] waits for a span.
pub const WAIT: Duration = Duration::from_secs(30);

/// A span as the collector received it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Received {
    /// The `service.name` of the process that sent it.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    /// `ERROR`, `OK` or empty (unset).
    pub status: String,
    pub status_message: String,
    pub attributes: BTreeMap<String, String>,
    /// The span's events: name and attributes.
    pub events: Vec<ReceivedEvent>,
    /// The attributes of the resource that sent it (`service.name`,
    /// `cluster_proxy.relayed_from`, …).
    #[serde(default)]
    pub resource: BTreeMap<String, String>,
}

/// An event of a [`Received`] span.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReceivedEvent {
    pub name: String,
    pub attributes: BTreeMap<String, String>,
}

impl Received {
    /// An attribute's value as text.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    /// The duration, from the span's own timestamps.
    pub fn duration(&self) -> Duration {
        Duration::from_nanos(self.end_unix_nanos.saturating_sub(self.start_unix_nanos))
    }
}

/// Why the collector could not start.
#[derive(Debug, thiserror::Error)]
pub enum CollectorError {
    #[error("binding the OTLP receiver on {address}: {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error("opening the span file {path}: {source}")]
    Sink {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Keeps what it receives, and appends it to a JSON-lines file when asked.
#[derive(Default, Clone)]
pub struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
    sink: Option<Arc<Mutex<std::fs::File>>>,
    /// Spans kept in memory at most (oldest dropped first); 0: no limit.
    keep: usize,
    /// Only count spans by name ([`Collector::start_counting`]).
    count_only: bool,
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
}

fn text_of(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn attributes_of(attributes: &[KeyValue]) -> BTreeMap<String, String> {
    attributes
        .iter()
        .map(|kv| {
            let value = kv.value.as_ref().and_then(|v| v.value.as_ref());
            (kv.key.clone(), text_of(value))
        })
        .collect()
}

fn received_from(request: ExportTraceServiceRequest) -> Vec<Received> {
    let mut received = Vec::new();
    for resource in request.resource_spans {
        let resource_attributes = resource
            .resource
            .as_ref()
            .map(|r| attributes_of(&r.attributes))
            .unwrap_or_default();
        let service = resource_attributes
            .get("service.name")
            .cloned()
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                let (status, status_message) = match &span.status {
                    Some(status) => (
                        match status.code {
                            1 => "OK",
                            2 => "ERROR",
                            _ => "",
                        }
                        .to_owned(),
                        status.message.clone(),
                    ),
                    None => (String::new(), String::new()),
                };
                received.push(Received {
                    service: service.clone(),
                    name: span.name.clone(),
                    trace_id: hex::encode(&span.trace_id),
                    span_id: hex::encode(&span.span_id),
                    parent_span_id: hex::encode(&span.parent_span_id),
                    start_unix_nanos: span.start_time_unix_nano,
                    end_unix_nanos: span.end_time_unix_nano,
                    status,
                    status_message,
                    attributes: attributes_of(&span.attributes),
                    events: span
                        .events
                        .iter()
                        .map(|event| ReceivedEvent {
                            name: event.name.clone(),
                            attributes: attributes_of(&event.attributes),
                        })
                        .collect(),
                    resource: resource_attributes.clone(),
                });
            }
        }
    }
    received
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let received = received_from(request.into_inner());
        if let Some(sink) = &self.sink {
            let mut lines = Vec::new();
            for span in &received {
                // Plain data: serialising cannot fail.
                if let Ok(line) = serde_json::to_string(span) {
                    lines.extend_from_slice(line.as_bytes());
                    lines.push(b'\n');
                }
            }
            let mut file = sink.lock().unwrap_or_else(PoisonError::into_inner);
            file.write_all(&lines)
                .map_err(|e| tonic::Status::internal(format!("writing spans: {e}")))?;
        }
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        spans.extend(received);
        if self.keep > 0 && spans.len() > self.keep {
            let excess = spans.len() - self.keep;
            spans.drain(..excess);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    /// A collector on a free loopback port that keeps every span in memory;
    /// cancel the token to stop it.
    pub async fn start() -> Result<(Self, SocketAddr, CancellationToken), CollectorError> {
        Collector::default().serve("127.0.0.1:0").await
    }

    /// A collector that only counts the spans it receives, by name (see
    /// [`Collector::counts`]): the least a receiver does (it decodes span
    /// names and skips everything else), so a benchmark sharing the machine
    /// with it measures the senders' cost.
    pub async fn start_counting() -> Result<(Self, SocketAddr, CancellationToken), CollectorError> {
        Collector {
            count_only: true,
            ..Collector::default()
        }
        .serve("127.0.0.1:0")
        .await
    }

    /// How many spans of each name a counting collector received.
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A collector on `address` that appends every span to `path` as a JSON
    /// line and keeps only the latest `keep` in memory (for `e2e up`).
    pub async fn start_with_file(
        address: &str,
        path: &Path,
        keep: usize,
    ) -> Result<(Self, SocketAddr, CancellationToken), CollectorError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| CollectorError::Sink {
                path: path.to_owned(),
                source,
            })?;
        Collector {
            sink: Some(Arc::new(Mutex::new(file))),
            keep,
            ..Collector::default()
        }
        .serve(address)
        .await
    }

    async fn serve(
        self,
        address: &str,
    ) -> Result<(Self, SocketAddr, CancellationToken), CollectorError> {
        let bind_error = |source| CollectorError::Bind {
            address: address.to_owned(),
            source,
        };
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let incoming = TcpListenerStream::new(listener);
        let mut builder = tonic::transport::Server::builder();
        if self.count_only {
            let service = counting::CountingTraceService {
                counts: self.counts.clone(),
            };
            tokio::spawn(async move {
                builder
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, stopped.cancelled_owned())
                    .await
            });
        } else {
            let service = TraceServiceServer::new(self.clone());
            tokio::spawn(async move {
                builder
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, stopped.cancelled_owned())
                    .await
            });
        }
        Ok((self, addr, stop))
    }

    /// Every span received so far (the latest `keep`, when limited).
    pub fn spans(&self) -> Vec<Received> {
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The first span called `name` that `pred` accepts.
    pub fn find(&self, name: &str, pred: impl Fn(&Received) -> bool) -> Option<Received> {
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|s| s.name == name && pred(s))
            .cloned()
    }

    /// Waits up to [`WAIT`] for a span called `name` that `pred` accepts;
    /// panics (with what arrived) when none does. For tests.
    pub async fn wait_for(&self, name: &str, pred: impl Fn(&Received) -> bool + Copy) -> Received {
        assert!(
            wait_until(WAIT, || self.find(name, pred).is_some()).await,
            "no {name} span arrived; got {:#?}",
            self.spans()
        );
        self.find(name, pred).unwrap_or_else(|| unreachable!())
    }
}

/// Reads a JSON-lines span file; lines that are not spans (a line cut off
/// by a crash) are skipped.
pub fn read_span_file(path: &Path) -> std::io::Result<Vec<Received>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect())
}

/// Prints the trace `trace_id` of `spans` as an indented tree, children
/// under their parent in start order, one line per span: name, service,
/// duration, status and attributes.
pub fn render_trace(spans: &[Received], trace_id: &str) -> String {
    let in_trace: Vec<&Received> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    let ids: std::collections::HashSet<&str> =
        in_trace.iter().map(|s| s.span_id.as_str()).collect();
    let mut children: HashMap<&str, Vec<&Received>> = HashMap::new();
    for span in &in_trace {
        // A span whose parent is in another process that did not export
        // (or not yet) is shown at the top.
        let parent = if ids.contains(span.parent_span_id.as_str()) {
            span.parent_span_id.as_str()
        } else {
            ""
        };
        children.entry(parent).or_default().push(span);
    }
    for list in children.values_mut() {
        list.sort_by_key(|s| s.start_unix_nanos);
    }
    let mut out = String::new();
    let mut stack: Vec<(&Received, usize)> = children
        .get("")
        .map(|roots| roots.iter().rev().map(|s| (*s, 0)).collect())
        .unwrap_or_default();
    while let Some((span, depth)) = stack.pop() {
        let status = match span.status.as_str() {
            "ERROR" => format!(" ERROR {}", span.status_message),
            _ => String::new(),
        };
        let attributes = span
            .attributes
            .iter()
            .filter(|(k, _)| !k.starts_with("code.") && !k.starts_with("thread."))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        out.push_str(&format!(
            "{:indent$}{} [{}] {:.3} ms{status}  {attributes}\n",
            "",
            span.name,
            span.service,
            span.duration().as_secs_f64() * 1000.0,
            indent = depth * 2
        ));
        for event in &span.events {
            out.push_str(&format!(
                "{:indent$}  · {} {}\n",
                "",
                event.name,
                event
                    .attributes
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                indent = depth * 2
            ));
        }
        if let Some(kids) = children.get(span.span_id.as_str()) {
            stack.extend(kids.iter().rev().map(|s| (*s, depth + 1)));
        }
    }
    out
}

/// The traces of `spans`, latest first: trace id, root span name, span count.
pub fn list_traces(spans: &[Received]) -> Vec<(String, String, usize)> {
    let mut traces: HashMap<&str, (u64, String, usize)> = HashMap::new();
    for span in spans {
        let entry = traces.entry(span.trace_id.as_str()).or_insert((
            span.start_unix_nanos,
            span.name.clone(),
            0,
        ));
        entry.2 += 1;
        if span.start_unix_nanos < entry.0 {
            entry.0 = span.start_unix_nanos;
            entry.1 = span.name.clone();
        }
    }
    let mut list: Vec<(u64, String, String, usize)> = traces
        .into_iter()
        .map(|(id, (start, root, count))| (start, id.to_owned(), root, count))
        .collect();
    list.sort_by_key(|entry| std::cmp::Reverse(entry.0));
    list.into_iter()
        .map(|(_, id, root, count)| (id, root, count))
        .collect()
}

/// The counting receiver: the OTLP trace service's one method, decoding
/// only what it counts. A collector runs on other machines than the
/// services it receives from; on the benchmark's shared cores, decoding
/// every attribute (allocating each key and value) cost about as much CPU
/// as making the span, and would be charged to the tunnel.
mod counting {
    use std::collections::BTreeMap;
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex, PoisonError};
    use std::task::{Context, Poll};

    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
    use tonic::codegen::{Body, BoxFuture, Service, StdError, http};
    use tonic::server::{Grpc, NamedService, UnaryService};

    const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

    /// `ExportTraceServiceRequest` with only the path to each span's name;
    /// prost skips every other field without decoding it.
    #[derive(Clone, PartialEq, prost::Message)]
    struct SpanNamesRequest {
        #[prost(message, repeated, tag = "1")]
        resource_spans: Vec<ResourceSpanNames>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct ResourceSpanNames {
        #[prost(message, repeated, tag = "2")]
        scope_spans: Vec<ScopeSpanNames>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct ScopeSpanNames {
        #[prost(message, repeated, tag = "2")]
        spans: Vec<SpanName>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct SpanName {
        #[prost(string, tag = "5")]
        name: String,
    }

    #[derive(Clone)]
    pub(super) struct CountingTraceService {
        pub(super) counts: Arc<Mutex<BTreeMap<String, u64>>>,
    }

    impl NamedService for CountingTraceService {
        const NAME: &'static str = "opentelemetry.proto.collector.trace.v1.TraceService";
    }

    impl UnaryService<SpanNamesRequest> for CountingTraceService {
        type Response = ExportTraceServiceResponse;
        type Future = BoxFuture<tonic::Response<Self::Response>, tonic::Status>;

        fn call(&mut self, request: tonic::Request<SpanNamesRequest>) -> Self::Future {
            let request = request.into_inner();
            {
                let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
                let names = request
                    .resource_spans
                    .iter()
                    .flat_map(|resource| &resource.scope_spans)
                    .flat_map(|scope| &scope.spans)
                    .map(|span| span.name.as_str());
                for name in names {
                    match counts.get_mut(name) {
                        Some(count) => *count += 1,
                        None => {
                            counts.insert(name.to_owned(), 1);
                        }
                    }
                }
            }
            Box::pin(async { Ok(tonic::Response::new(ExportTraceServiceResponse::default())) })
        }
    }

    impl<B> Service<http::Request<B>> for CountingTraceService
    where
        B: Body + Send + 'static,
        B::Error: Into<StdError> + Send + 'static,
    {
        type Response = http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<B>) -> Self::Future {
            let service = self.clone();
            Box::pin(async move {
                if request.uri().path() != EXPORT_PATH {
                    return Ok(tonic::Status::unimplemented(format!(
                        "{} is not served here",
                        request.uri().path()
                    ))
                    .into_http());
                }
                let codec = tonic_prost::ProstCodec::<ExportTraceServiceResponse, SpanNamesRequest>::default();
                Ok(Grpc::new(codec).unary(service, request).await)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, id: &str, parent: &str, start: u64) -> Received {
        Received {
            service: "svc".into(),
            name: name.into(),
            trace_id: "t1".into(),
            span_id: id.into(),
            parent_span_id: parent.into(),
            start_unix_nanos: start,
            end_unix_nanos: start + 2_000_000,
            status: String::new(),
            status_message: String::new(),
            attributes: BTreeMap::new(),
            events: Vec::new(),
            resource: BTreeMap::new(),
        }
    }

    #[test]
    fn a_trace_renders_as_a_tree_in_start_order() {
        let mut failed = span("agent.dial", "c", "b", 3);
        failed.status = "ERROR".into();
        failed.status_message = "connection refused".into();
        let spans = [
            failed,
            span("tunnel.connection", "b", "a", 2),
            span("tunnel.dial", "a", "", 1),
            span("other", "x", "", 0),
        ];
        let mut other_trace = spans[3].clone();
        other_trace.trace_id = "t2".into();
        let spans = [&spans[..3], &[other_trace]].concat();
        let tree = render_trace(&spans, "t1");
        let lines: Vec<&str> = tree.lines().collect();
        assert_eq!(lines.len(), 3, "{tree}");
        assert!(lines[0].starts_with("tunnel.dial [svc] 2.000 ms"), "{tree}");
        assert!(lines[1].starts_with("  tunnel.connection"), "{tree}");
        assert!(
            lines[2].starts_with("    agent.dial [svc] 2.000 ms ERROR connection refused"),
            "{tree}"
        );
        assert_eq!(
            list_traces(&spans),
            vec![
                ("t1".to_owned(), "tunnel.dial".to_owned(), 3),
                ("t2".to_owned(), "other".to_owned(), 1)
            ]
        );
    }

    /// The counting receiver decodes the real protocol's messages (span
    /// names at their field numbers, everything else skipped) and refuses
    /// what it does not serve.
    #[tokio::test]
    async fn the_counting_receiver_counts_spans_of_real_export_requests() {
        use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
        use opentelemetry_proto::tonic::common::v1::AnyValue;
        use opentelemetry_proto::tonic::resource::v1::Resource;
        use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

        let (collector, addr, stop) = Collector::start_counting().await.unwrap();
        let attribute = |key: &str, value: &str| KeyValue {
            key: key.into(),
            value: Some(AnyValue {
                value: Some(Value::StringValue(value.into())),
            }),
            ..KeyValue::default()
        };
        let span = |name: &str| Span {
            name: name.into(),
            trace_id: vec![1; 16],
            span_id: vec![2; 8],
            attributes: vec![attribute("cluster_proxy.cluster", "a"), attribute("k", "v")],
            ..Span::default()
        };
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource {
                    attributes: vec![attribute("service.name", "svc")],
                    ..Resource::default()
                }),
                scope_spans: vec![
                    ScopeSpans {
                        spans: vec![span("tunnel.connection"), span("agent.dial")],
                        ..ScopeSpans::default()
                    },
                    ScopeSpans {
                        spans: vec![span("tunnel.connection")],
                        ..ScopeSpans::default()
                    },
                ],
                ..ResourceSpans::default()
            }],
        };
        let mut client = TraceServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        client.export(request).await.unwrap();
        assert_eq!(
            collector.counts(),
            BTreeMap::from([
                ("agent.dial".to_owned(), 1),
                ("tunnel.connection".to_owned(), 2)
            ])
        );
        stop.cancel();
    }
}
