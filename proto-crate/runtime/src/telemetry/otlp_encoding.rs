//! Finished spans straight into the bytes of an OTLP
//! `ExportTraceServiceRequest` (protobuf, `opentelemetry/proto/collector/
//! trace/v1/trace_service.proto` and the messages it includes).
//!
//! Why not the `opentelemetry-proto` messages: the OTLP exporter turns
//! every batch into those first (a `String` for every attribute key and
//! value, a `Vec` for every id) and then encodes them (prost computes the
//! length of every nested message once per level it is nested in). With
//! every connection sampled that was most of what a span cost its
//! process. Here each message's length is computed once, from the spans
//! as they are (the `*_len` functions), and the request is then written in
//! one pass into one buffer of exactly that size, borrowing every
//! attribute: no intermediate messages and no copies.
//!
//! The field numbers are those of the published proto definitions. Each
//! `put_*` function has a `*_len` twin that must agree with it; the tests
//! compare the whole request byte for byte with what prost writes for the
//! SDK's own conversion of the same spans.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::BufMut;
use opentelemetry::trace::{Event, Link, SpanId, SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanData;

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LENGTH_DELIMITED: u32 = 2;
const FIXED32: u32 = 5;

/// `SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK`: the exporter knows
/// whether the parent was remote.
const CONTEXT_HAS_IS_REMOTE: u32 = 0x100;
/// `SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK`.
const CONTEXT_IS_REMOTE: u32 = 0x200;

fn varint_len(value: u64) -> usize {
    // One byte per started 7 bits, at least one.
    (64 - (value | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.put_u8((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    buf.put_u8(value as u8);
}

fn key_len(field: u32) -> usize {
    varint_len(u64::from(field << 3))
}

fn put_key(buf: &mut Vec<u8>, field: u32, wire_type: u32) {
    put_varint(buf, u64::from(field << 3 | wire_type));
}

/// A length-delimited field (`bytes`, `string` or an embedded message) of
/// `len` bytes.
fn delimited_len(field: u32, len: usize) -> usize {
    key_len(field) + varint_len(len as u64) + len
}

/// The key and length of a length-delimited field, before its content.
fn put_delimited_header(buf: &mut Vec<u8>, field: u32, len: usize) {
    put_key(buf, field, LENGTH_DELIMITED);
    put_varint(buf, len as u64);
}

fn put_bytes(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_delimited_header(buf, field, bytes.len());
    buf.put_slice(bytes);
}

/// A `string` or `bytes` field; proto3 leaves an empty one out.
fn nonempty_len(field: u32, len: usize) -> usize {
    if len == 0 {
        0
    } else {
        delimited_len(field, len)
    }
}

fn put_nonempty(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    if !bytes.is_empty() {
        put_bytes(buf, field, bytes);
    }
}

/// A `uint32`, `int64` or enum field; proto3 leaves a zero out.
fn uint_len(field: u32, value: u64) -> usize {
    if value == 0 {
        0
    } else {
        key_len(field) + varint_len(value)
    }
}

fn put_uint(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        put_key(buf, field, VARINT);
        put_varint(buf, value);
    }
}

fn fixed64_len(field: u32, value: u64) -> usize {
    if value == 0 { 0 } else { key_len(field) + 8 }
}

fn put_fixed64(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        put_key(buf, field, FIXED64);
        buf.put_u64_le(value);
    }
}

fn fixed32_len(field: u32, value: u32) -> usize {
    if value == 0 { 0 } else { key_len(field) + 4 }
}

fn put_fixed32(buf: &mut Vec<u8>, field: u32, value: u32) {
    if value != 0 {
        put_key(buf, field, FIXED32);
        buf.put_u32_le(value);
    }
}

fn unix_nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
    })
}

/// An `AnyValue` holding `value`. Every member of a oneof is written when
/// set, zero or empty included: it says which member is set.
fn any_value_len(value: &Value) -> usize {
    match value {
        Value::Bool(_) => key_len(2) + 1,
        Value::I64(i) => key_len(3) + varint_len(*i as u64),
        Value::F64(_) => key_len(4) + 8,
        Value::String(s) => delimited_len(1, s.as_str().len()),
        Value::Array(array) => delimited_len(5, array_value_len(array)),
        // A kind of value this exporter does not know yet goes as its text.
        other => delimited_len(1, other.as_str().len()),
    }
}

fn put_any_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Bool(b) => {
            put_key(buf, 2, VARINT);
            put_varint(buf, u64::from(*b));
        }
        Value::I64(i) => {
            put_key(buf, 3, VARINT);
            put_varint(buf, *i as u64);
        }
        Value::F64(f) => {
            put_key(buf, 4, FIXED64);
            buf.put_f64_le(*f);
        }
        Value::String(s) => put_bytes(buf, 1, s.as_str().as_bytes()),
        Value::Array(array) => {
            put_delimited_header(buf, 5, array_value_len(array));
            put_array_value(buf, array);
        }
        other => put_bytes(buf, 1, other.as_str().as_bytes()),
    }
}

/// The elements of an `ArrayValue` (field 1, each an `AnyValue`), as
/// values. Arrays are rare in spans; converting each element keeps one
/// encoder for values.
fn array_elements(array: &Array) -> Vec<Value> {
    match array {
        Array::Bool(values) => values.iter().map(|b| Value::Bool(*b)).collect(),
        Array::I64(values) => values.iter().map(|i| Value::I64(*i)).collect(),
        Array::F64(values) => values.iter().map(|f| Value::F64(*f)).collect(),
        Array::String(values) => values
            .iter()
            .map(|s: &StringValue| Value::String(s.clone()))
            .collect(),
        other => vec![Value::String(other.to_string().into())],
    }
}

fn array_value_len(array: &Array) -> usize {
    array_elements(array)
        .iter()
        .map(|value| delimited_len(1, any_value_len(value)))
        .sum()
}

fn put_array_value(buf: &mut Vec<u8>, array: &Array) {
    for value in array_elements(array) {
        put_delimited_header(buf, 1, any_value_len(&value));
        put_any_value(buf, &value);
    }
}

/// A `KeyValue`: the key, then an `AnyValue` of `value_len` bytes.
fn key_value_len(key: &str, value_len: usize) -> usize {
    nonempty_len(1, key.len()) + delimited_len(2, value_len)
}

/// One `KeyValue` field `field` per attribute.
fn attributes_len<'a>(field: u32, attributes: impl IntoIterator<Item = &'a KeyValue>) -> usize {
    attributes
        .into_iter()
        .map(|attribute| {
            let value_len = any_value_len(&attribute.value);
            delimited_len(field, key_value_len(attribute.key.as_str(), value_len))
        })
        .sum()
}

fn put_attributes<'a>(
    buf: &mut Vec<u8>,
    field: u32,
    attributes: impl IntoIterator<Item = &'a KeyValue>,
) {
    for attribute in attributes {
        // The value's length goes into two headers: computed once.
        let key = attribute.key.as_str();
        let value_len = any_value_len(&attribute.value);
        put_delimited_header(buf, field, key_value_len(key, value_len));
        put_nonempty(buf, 1, key.as_bytes());
        put_delimited_header(buf, 2, value_len);
        put_any_value(buf, &attribute.value);
    }
}

/// `InstrumentationScope`: name, version, attributes.
fn scope_len(scope: &InstrumentationScope) -> usize {
    nonempty_len(1, scope.name().len())
        + nonempty_len(2, scope.version().unwrap_or_default().len())
        + attributes_len(3, scope.attributes())
}

fn put_scope(buf: &mut Vec<u8>, scope: &InstrumentationScope) {
    put_nonempty(buf, 1, scope.name().as_bytes());
    put_nonempty(buf, 2, scope.version().unwrap_or_default().as_bytes());
    put_attributes(buf, 3, scope.attributes());
}

/// `Span.Event`.
fn event_len(event: &Event) -> usize {
    fixed64_len(1, unix_nanos(event.timestamp))
        + nonempty_len(2, event.name.len())
        + attributes_len(3, &event.attributes)
        + uint_len(4, u64::from(event.dropped_attributes_count))
}

fn put_event(buf: &mut Vec<u8>, event: &Event) {
    put_fixed64(buf, 1, unix_nanos(event.timestamp));
    put_nonempty(buf, 2, event.name.as_bytes());
    put_attributes(buf, 3, &event.attributes);
    put_uint(buf, 4, u64::from(event.dropped_attributes_count));
}

/// `Span.Link`.
fn link_len(link: &Link) -> usize {
    let linked = &link.span_context;
    delimited_len(1, 16)
        + delimited_len(2, 8)
        + nonempty_len(3, linked.trace_state().header().len())
        + attributes_len(4, &link.attributes)
        + uint_len(5, u64::from(link.dropped_attributes_count))
        + fixed32_len(
            6,
            span_flags(linked.trace_flags().to_u8(), linked.is_remote()),
        )
}

fn put_link(buf: &mut Vec<u8>, link: &Link) {
    let linked = &link.span_context;
    put_bytes(buf, 1, &linked.trace_id().to_bytes());
    put_bytes(buf, 2, &linked.span_id().to_bytes());
    put_nonempty(buf, 3, linked.trace_state().header().as_bytes());
    put_attributes(buf, 4, &link.attributes);
    put_uint(buf, 5, u64::from(link.dropped_attributes_count));
    put_fixed32(
        buf,
        6,
        span_flags(linked.trace_flags().to_u8(), linked.is_remote()),
    );
}

/// `Status`: the message (errors only), then the code.
fn status_len(status: &Status) -> usize {
    match status {
        Status::Unset => 0,
        Status::Ok => uint_len(3, 1),
        Status::Error { description } => nonempty_len(2, description.len()) + uint_len(3, 2),
    }
}

fn put_status(buf: &mut Vec<u8>, status: &Status) {
    match status {
        Status::Unset => {}
        Status::Ok => put_uint(buf, 3, 1),
        Status::Error { description } => {
            put_nonempty(buf, 2, description.as_bytes());
            put_uint(buf, 3, 2);
        }
    }
}

fn span_kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

fn span_flags(trace_flags: u8, parent_is_remote: bool) -> u32 {
    let remote = if parent_is_remote {
        CONTEXT_IS_REMOTE
    } else {
        0
    };
    u32::from(trace_flags) | CONTEXT_HAS_IS_REMOTE | remote
}

/// A span with what its encoding needs more than once.
struct SpanFields<'a> {
    span: &'a SpanData,
    /// `tracestate`, rendered once.
    trace_state: String,
    /// The length of its `Span` message.
    len: usize,
}

impl<'a> SpanFields<'a> {
    fn new(span: &'a SpanData) -> Self {
        let trace_state = span.span_context.trace_state().header();
        let mut fields = SpanFields {
            span,
            trace_state,
            len: 0,
        };
        fields.len = fields.compute_len();
        fields
    }

    fn flags(&self) -> u32 {
        span_flags(
            self.span.span_context.trace_flags().to_u8(),
            self.span.parent_span_is_remote,
        )
    }

    fn compute_len(&self) -> usize {
        let span = self.span;
        let parent = if span.parent_span_id != SpanId::INVALID {
            delimited_len(4, 8)
        } else {
            0
        };
        delimited_len(1, 16)
            + delimited_len(2, 8)
            + nonempty_len(3, self.trace_state.len())
            + parent
            + nonempty_len(5, span.name.len())
            + uint_len(6, span_kind(&span.span_kind))
            + fixed64_len(7, unix_nanos(span.start_time))
            + fixed64_len(8, unix_nanos(span.end_time))
            + attributes_len(9, &span.attributes)
            + uint_len(10, u64::from(span.dropped_attributes_count))
            + span
                .events
                .events
                .iter()
                .map(|event| delimited_len(11, event_len(event)))
                .sum::<usize>()
            + uint_len(12, u64::from(span.events.dropped_count))
            + span
                .links
                .links
                .iter()
                .map(|link| delimited_len(13, link_len(link)))
                .sum::<usize>()
            + uint_len(14, u64::from(span.links.dropped_count))
            // Always there, as the SDK's conversion has it.
            + delimited_len(15, status_len(&span.status))
            + fixed32_len(16, self.flags())
    }

    fn put(&self, buf: &mut Vec<u8>) {
        let span = self.span;
        let context = &span.span_context;
        put_bytes(buf, 1, &context.trace_id().to_bytes());
        put_bytes(buf, 2, &context.span_id().to_bytes());
        put_nonempty(buf, 3, self.trace_state.as_bytes());
        if span.parent_span_id != SpanId::INVALID {
            put_bytes(buf, 4, &span.parent_span_id.to_bytes());
        }
        put_nonempty(buf, 5, span.name.as_bytes());
        put_uint(buf, 6, span_kind(&span.span_kind));
        put_fixed64(buf, 7, unix_nanos(span.start_time));
        put_fixed64(buf, 8, unix_nanos(span.end_time));
        put_attributes(buf, 9, &span.attributes);
        put_uint(buf, 10, u64::from(span.dropped_attributes_count));
        for event in &span.events.events {
            put_delimited_header(buf, 11, event_len(event));
            put_event(buf, event);
        }
        put_uint(buf, 12, u64::from(span.events.dropped_count));
        for link in &span.links.links {
            put_delimited_header(buf, 13, link_len(link));
            put_link(buf, link);
        }
        put_uint(buf, 14, u64::from(span.links.dropped_count));
        put_delimited_header(buf, 15, status_len(&span.status));
        put_status(buf, &span.status);
        put_fixed32(buf, 16, self.flags());
    }
}

/// Encodes batches of spans of one process (one resource).
#[derive(Debug, Default)]
pub(crate) struct SpanEncoder {
    /// The `Resource` message's content, encoded once.
    resource: Vec<u8>,
    resource_schema_url: String,
}

impl SpanEncoder {
    pub(crate) fn new(resource: &Resource) -> Self {
        let attributes: Vec<KeyValue> = resource
            .iter()
            .map(|(key, value)| KeyValue::new(key.clone(), value.clone()))
            .collect();
        let mut encoded = Vec::with_capacity(attributes_len(1, &attributes));
        put_attributes(&mut encoded, 1, &attributes);
        SpanEncoder {
            resource: encoded,
            resource_schema_url: resource.schema_url().unwrap_or_default().to_owned(),
        }
    }

    /// `spans` as one `ExportTraceServiceRequest`: one `ResourceSpans`
    /// holding a `ScopeSpans` per instrumentation scope, in the order each
    /// scope first appears.
    pub(crate) fn encode_request(&self, spans: &[SpanData]) -> Vec<u8> {
        struct Scope<'a> {
            scope: &'a InstrumentationScope,
            spans: Vec<SpanFields<'a>>,
            len: usize,
        }
        let mut scopes: Vec<Scope<'_>> = Vec::new();
        for span in spans {
            let of = &span.instrumentation_scope;
            let index = match scopes.iter().position(|known| known.scope == of) {
                Some(index) => index,
                None => {
                    scopes.push(Scope {
                        scope: of,
                        spans: Vec::new(),
                        len: 0,
                    });
                    scopes.len() - 1
                }
            };
            scopes[index].spans.push(SpanFields::new(span));
        }
        for scope in &mut scopes {
            scope.len = delimited_len(1, scope_len(scope.scope))
                + scope
                    .spans
                    .iter()
                    .map(|span| delimited_len(2, span.len))
                    .sum::<usize>()
                + nonempty_len(3, scope.scope.schema_url().unwrap_or_default().len());
        }
        let resource_spans_len = delimited_len(1, self.resource.len())
            + scopes
                .iter()
                .map(|scope| delimited_len(2, scope.len))
                .sum::<usize>()
            + nonempty_len(3, self.resource_schema_url.len());
        let request_len = delimited_len(1, resource_spans_len);
        let mut request = Vec::with_capacity(request_len);
        put_delimited_header(&mut request, 1, resource_spans_len);
        put_bytes(&mut request, 1, &self.resource);
        for scope in &scopes {
            put_delimited_header(&mut request, 2, scope.len);
            put_delimited_header(&mut request, 1, scope_len(scope.scope));
            put_scope(&mut request, scope.scope);
            for span in &scope.spans {
                put_delimited_header(&mut request, 2, span.len);
                span.put(&mut request);
            }
            put_nonempty(
                &mut request,
                3,
                scope.scope.schema_url().unwrap_or_default().as_bytes(),
            );
        }
        put_nonempty(&mut request, 3, self.resource_schema_url.as_bytes());
        debug_assert_eq!(
            request.len(),
            request_len,
            "a *_len function disagrees with its put_*"
        );
        request
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::time::Duration;

    use opentelemetry::trace::{Event, Link, SpanContext, TraceFlags, TraceId, TraceState};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use tonic_prost::prost::Message;

    use super::*;

    fn context(trace: u128, span: u64, sampled: bool, remote: bool) -> SpanContext {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let state = TraceState::from_key_value([("vendor", "a1b2")]).expect("trace state");
        SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            flags,
            remote,
            state,
        )
    }

    fn at(seconds: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_nanos(seconds * 1_000_000_000 + 123_456_789)
    }

    /// Spans using every field and every kind of attribute value the API
    /// has, zero and negative values included, in two scopes.
    fn spans() -> Vec<SpanData> {
        let ours = InstrumentationScope::builder("cluster-proxy").build();
        let layer = InstrumentationScope::builder("tracing-opentelemetry")
            .with_version("0.34.0")
            .with_schema_url("https://opentelemetry.io/schemas/1.26.0")
            .with_attributes([KeyValue::new("scope.attribute", 7_i64)])
            .build();
        let attributes = vec![
            KeyValue::new("server.address", "10.0.0.1"),
            KeyValue::new("empty", ""),
            KeyValue::new("cluster_proxy.bytes_to_agent", 0_i64),
            KeyValue::new("negative", -42_i64),
            KeyValue::new("large", i64::MAX),
            KeyValue::new("ratio", 0.25_f64),
            KeyValue::new("zero", 0.0_f64),
            KeyValue::new("yes", true),
            KeyValue::new("no", false),
            KeyValue::new("owned", String::from("a string made at run time")),
            KeyValue::new("bools", Value::Array(Array::Bool(vec![true, false]))),
            KeyValue::new("ints", Value::Array(Array::I64(vec![0, -1, 300]))),
            KeyValue::new("floats", Value::Array(Array::F64(vec![1.5, 0.0]))),
            KeyValue::new(
                "strings",
                Value::Array(Array::String(vec!["a".into(), "".into()])),
            ),
            KeyValue::new("empties", Value::Array(Array::I64(Vec::new()))),
            KeyValue::new("long", "x".repeat(300)),
        ];
        let mut events = SpanEvents::default();
        events.events.push(Event::new(
            "dial failed",
            at(1_700_000_000),
            vec![KeyValue::new("error.message", "connection refused")],
            1,
        ));
        events.dropped_count = 2;
        let mut links = SpanLinks::default();
        links.links.push(Link::new(
            context(0xdef, 0x33, false, true),
            vec![KeyValue::new("link.kind", "probe")],
            4,
        ));
        links.dropped_count = 5;
        let connection = SpanData {
            span_context: context(0xabc, 0x11, true, false),
            parent_span_id: SpanId::from(0x22),
            parent_span_is_remote: true,
            span_kind: SpanKind::Server,
            name: Cow::Borrowed("tunnel.connection"),
            start_time: at(1_700_000_000),
            end_time: at(1_700_000_001),
            attributes,
            dropped_attributes_count: 3,
            events,
            links,
            status: Status::error("no agent for cluster-b"),
            instrumentation_scope: ours.clone(),
        };
        let reconcile = SpanData {
            span_context: SpanContext::new(
                TraceId::from(0x1234),
                SpanId::from(0x44),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Owned("reconcile".to_owned()),
            start_time: at(1_700_000_002),
            end_time: at(1_700_000_003),
            attributes: vec![KeyValue::new("k8s.object.kind", "ManagedCluster")],
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Ok,
            instrumentation_scope: layer,
        };
        let mut client = reconcile.clone();
        client.span_kind = SpanKind::Client;
        client.name = Cow::Borrowed("tunnel.dial");
        client.status = Status::Unset;
        client.instrumentation_scope = ours;
        let mut others = reconcile.clone();
        others.span_kind = SpanKind::Producer;
        let mut consumer = reconcile.clone();
        consumer.span_kind = SpanKind::Consumer;
        consumer.start_time = UNIX_EPOCH;
        vec![connection, reconcile, client, others, consumer]
    }

    fn resource() -> Resource {
        Resource::builder_empty()
            .with_service_name("hub-proxy-server")
            .with_attributes([KeyValue::new("deployment.environment", "test")])
            .with_schema_url(
                [KeyValue::new("service.instance.id", "replica-0")],
                "https://opentelemetry.io/schemas/1.26.0",
            )
            .build()
    }

    /// What the OTLP exporter of `opentelemetry-otlp` sends for the same
    /// spans: the SDK's own conversion to the published messages.
    fn reference_request(spans: Vec<SpanData>, resource: &Resource) -> ExportTraceServiceRequest {
        let resource = ResourceAttributesWithSchema::from(resource);
        ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(spans, &resource),
        }
    }

    #[test]
    fn spans_decode_as_the_sdk_converts_them() {
        let resource = resource();
        let encoded = SpanEncoder::new(&resource).encode_request(&spans());
        let decoded = ExportTraceServiceRequest::decode(encoded.as_slice())
            .expect("the encoded request decodes");
        assert_eq!(decoded, reference_request(spans(), &resource));
        let scopes = &decoded.resource_spans[0].scope_spans;
        assert_eq!(scopes.len(), 2, "one ScopeSpans per instrumentation scope");
        let names = |scope: usize| -> Vec<&str> {
            scopes[scope]
                .spans
                .iter()
                .map(|s| s.name.as_str())
                .collect()
        };
        assert_eq!(names(0), ["tunnel.connection", "tunnel.dial"]);
        assert_eq!(names(1), ["reconcile", "reconcile", "reconcile"]);
    }

    #[test]
    fn the_encoding_is_what_prost_writes() {
        // Byte for byte, not only equal once decoded: lengths, field order
        // and the defaults left out are the canonical ones.
        let resource = resource();
        let encoded = SpanEncoder::new(&resource).encode_request(&spans());
        assert_eq!(
            encoded,
            reference_request(spans(), &resource).encode_to_vec()
        );
    }

    #[test]
    fn an_empty_batch_and_an_empty_resource_encode() {
        let encoder = SpanEncoder::default();
        let decoded = ExportTraceServiceRequest::decode(encoder.encode_request(&[]).as_slice())
            .expect("decodes");
        assert_eq!(decoded.resource_spans.len(), 1);
        assert!(decoded.resource_spans[0].scope_spans.is_empty());
    }

    #[test]
    fn varint_lengths_match_the_varints_written() {
        for value in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut buf = Vec::new();
            put_varint(&mut buf, value);
            assert_eq!(buf.len(), varint_len(value), "{value}");
        }
    }
}
