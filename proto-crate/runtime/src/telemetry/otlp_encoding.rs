//! Finished spans straight into the bytes of an OTLP
//! `ExportTraceServiceRequest` (protobuf, `opentelemetry/proto/collector/
//! trace/v1/trace_service.proto` and the messages it includes).
//!
//! Why not the `opentelemetry-proto` messages: the OTLP exporter turns
//! every batch into those first (a `String` for every attribute key and
//! value, a `Vec` for every id) and then encodes them (prost computes the
//! length of every nested message once per level it is nested in). With
//! every connection sampled that was most of what a span cost its
//! process. Here each span is written once, borrowing its attributes; the
//! only copies are of each span's bytes into its enclosing messages.
//!
//! The field numbers are those of the published proto definitions; the
//! tests decode what is written with the `opentelemetry-proto` messages and
//! compare it with the SDK's own conversion of the same spans.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::BufMut;
use opentelemetry::trace::{SpanId, SpanKind, Status};
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

fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.put_u8((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    buf.put_u8(value as u8);
}

fn put_key(buf: &mut Vec<u8>, field: u32, wire_type: u32) {
    put_varint(buf, u64::from(field << 3 | wire_type));
}

/// A length-delimited field: `bytes`, `string` or an embedded message.
fn put_bytes(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(buf, field, LENGTH_DELIMITED);
    put_varint(buf, bytes.len() as u64);
    buf.put_slice(bytes);
}

/// A `string` or `bytes` field; proto3 leaves an empty one out.
fn put_nonempty(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    if !bytes.is_empty() {
        put_bytes(buf, field, bytes);
    }
}

/// A `uint32`, `int64` or enum field; proto3 leaves a zero out.
fn put_uint(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        put_key(buf, field, VARINT);
        put_varint(buf, value);
    }
}

fn put_fixed64(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        put_key(buf, field, FIXED64);
        buf.put_u64_le(value);
    }
}

fn put_fixed32(buf: &mut Vec<u8>, field: u32, value: u32) {
    if value != 0 {
        put_key(buf, field, FIXED32);
        buf.put_u32_le(value);
    }
}

/// An embedded message written by `write` into `scratch`, then copied into
/// `buf` behind its length (which is only known once it is written).
fn put_message(
    buf: &mut Vec<u8>,
    field: u32,
    scratch: &mut Vec<u8>,
    write: impl FnOnce(&mut Vec<u8>),
) {
    scratch.clear();
    write(scratch);
    put_bytes(buf, field, scratch);
}

fn unix_nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
    })
}

/// The encoded length of an `AnyValue` holding `value`. Attributes are
/// written straight into their span: their lengths are computed, not
/// found by writing them aside.
fn any_value_len(value: &Value) -> usize {
    match value {
        Value::Bool(_) => 2,
        Value::I64(i) => 1 + varint_len(*i as u64),
        Value::F64(_) => 9,
        Value::String(s) => delimited_len(s.as_str().len()),
        Value::Array(array) => delimited_len(array_value_len(array)),
        other => delimited_len(other.as_str().len()),
    }
}

/// The encoded length of an `ArrayValue` (its elements are `AnyValue`s,
/// field 1).
fn array_value_len(array: &Array) -> usize {
    fn elements(lens: impl Iterator<Item = usize>) -> usize {
        lens.map(delimited_len).sum()
    }
    match array {
        Array::Bool(values) => elements(values.iter().map(|_| 2)),
        Array::I64(values) => elements(values.iter().map(|i| 1 + varint_len(*i as u64))),
        Array::F64(values) => elements(values.iter().map(|_| 9)),
        Array::String(values) => elements(values.iter().map(|s| delimited_len(s.as_str().len()))),
        other => elements(std::iter::once(delimited_len(other.to_string().len()))),
    }
}

fn varint_len(value: u64) -> usize {
    // One byte per started 7 bits, at least one.
    (64 - (value | 1).leading_zeros() as usize).div_ceil(7)
}

/// The length of a length-delimited field's key (for fields below 16),
/// length and `len` bytes of content.
fn delimited_len(len: usize) -> usize {
    1 + varint_len(len as u64) + len
}

fn put_any_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Bool(b) => {
            // A false bool still says which member of the oneof is set.
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
            put_key(buf, 5, LENGTH_DELIMITED);
            put_varint(buf, array_value_len(array) as u64);
            put_array_value(buf, array);
        }
        // A kind of value this exporter does not know yet goes as its text.
        other => put_bytes(buf, 1, other.as_str().as_bytes()),
    }
}

fn put_array_value(buf: &mut Vec<u8>, array: &Array) {
    fn each<T>(buf: &mut Vec<u8>, values: &[T], to_value: impl Fn(&T) -> Value) {
        for value in values {
            let value = to_value(value);
            put_key(buf, 1, LENGTH_DELIMITED);
            put_varint(buf, any_value_len(&value) as u64);
            put_any_value(buf, &value);
        }
    }
    match array {
        Array::Bool(values) => each(buf, values, |b| Value::Bool(*b)),
        Array::I64(values) => each(buf, values, |i| Value::I64(*i)),
        Array::F64(values) => each(buf, values, |f| Value::F64(*f)),
        Array::String(values) => each(buf, values, |s: &StringValue| Value::String(s.clone())),
        other => each(buf, &[other.to_string()], |s| {
            Value::String(s.clone().into())
        }),
    }
}

/// `KeyValue` messages, one per attribute, as field `field` of `buf`.
fn put_attributes<'a>(
    buf: &mut Vec<u8>,
    field: u32,
    attributes: impl IntoIterator<Item = &'a KeyValue>,
) {
    for attribute in attributes {
        let key = attribute.key.as_str();
        let value_len = any_value_len(&attribute.value);
        let len = if key.is_empty() {
            0
        } else {
            delimited_len(key.len())
        } + delimited_len(value_len);
        put_key(buf, field, LENGTH_DELIMITED);
        put_varint(buf, len as u64);
        put_nonempty(buf, 1, key.as_bytes());
        put_key(buf, 2, LENGTH_DELIMITED);
        put_varint(buf, value_len as u64);
        put_any_value(buf, &attribute.value);
    }
}

/// `InstrumentationScope`: name, version, attributes.
fn put_scope(buf: &mut Vec<u8>, scope: &InstrumentationScope) {
    put_nonempty(buf, 1, scope.name().as_bytes());
    put_nonempty(buf, 2, scope.version().unwrap_or_default().as_bytes());
    put_attributes(buf, 3, scope.attributes());
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

/// One `Span` message's fields.
fn put_span(buf: &mut Vec<u8>, scratch: &mut Vec<u8>, span: &SpanData) {
    let context = &span.span_context;
    put_bytes(buf, 1, &context.trace_id().to_bytes());
    put_bytes(buf, 2, &context.span_id().to_bytes());
    put_nonempty(buf, 3, context.trace_state().header().as_bytes());
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
        put_message(buf, 11, scratch, |event_buf| {
            put_fixed64(event_buf, 1, unix_nanos(event.timestamp));
            put_nonempty(event_buf, 2, event.name.as_bytes());
            put_attributes(event_buf, 3, &event.attributes);
            put_uint(event_buf, 4, u64::from(event.dropped_attributes_count));
        });
    }
    put_uint(buf, 12, u64::from(span.events.dropped_count));
    for link in &span.links.links {
        put_message(buf, 13, scratch, |link_buf| {
            let linked = &link.span_context;
            put_bytes(link_buf, 1, &linked.trace_id().to_bytes());
            put_bytes(link_buf, 2, &linked.span_id().to_bytes());
            put_nonempty(link_buf, 3, linked.trace_state().header().as_bytes());
            put_attributes(link_buf, 4, &link.attributes);
            put_uint(link_buf, 5, u64::from(link.dropped_attributes_count));
            put_fixed32(
                link_buf,
                6,
                span_flags(linked.trace_flags().to_u8(), linked.is_remote()),
            );
        });
    }
    put_uint(buf, 14, u64::from(span.links.dropped_count));
    put_message(buf, 15, scratch, |status_buf| match &span.status {
        Status::Unset => {}
        Status::Ok => put_uint(status_buf, 3, 1),
        Status::Error { description } => {
            put_nonempty(status_buf, 2, description.as_bytes());
            put_uint(status_buf, 3, 2);
        }
    });
    put_fixed32(
        buf,
        16,
        span_flags(context.trace_flags().to_u8(), span.parent_span_is_remote),
    );
}

/// Encodes batches of spans of one process (one resource).
#[derive(Debug, Default)]
pub(crate) struct SpanEncoder {
    /// The `Resource` message, encoded once.
    resource: Vec<u8>,
    resource_schema_url: String,
}

impl SpanEncoder {
    pub(crate) fn new(resource: &Resource) -> Self {
        let attributes: Vec<KeyValue> = resource
            .iter()
            .map(|(key, value)| KeyValue::new(key.clone(), value.clone()))
            .collect();
        let mut encoded = Vec::new();
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
        let mut scopes: Vec<&InstrumentationScope> = Vec::new();
        let mut scope_of_span = Vec::with_capacity(spans.len());
        for span in spans {
            let scope = &span.instrumentation_scope;
            let index = match scopes.iter().position(|known| *known == scope) {
                Some(index) => index,
                None => {
                    scopes.push(scope);
                    scopes.len() - 1
                }
            };
            scope_of_span.push(index);
        }
        let mut scratch = Vec::with_capacity(256);
        let mut span_buf = Vec::with_capacity(1024);
        let mut scope_buf = Vec::with_capacity(spans.len() * 512);
        let mut resource_spans = Vec::with_capacity(spans.len() * 512 + self.resource.len());
        put_bytes(&mut resource_spans, 1, &self.resource);
        for (index, scope) in scopes.iter().enumerate() {
            scope_buf.clear();
            put_message(&mut scope_buf, 1, &mut scratch, |buf| put_scope(buf, scope));
            for (span, _) in spans
                .iter()
                .zip(&scope_of_span)
                .filter(|(_, of)| **of == index)
            {
                span_buf.clear();
                put_span(&mut span_buf, &mut scratch, span);
                put_bytes(&mut scope_buf, 2, &span_buf);
            }
            put_nonempty(
                &mut scope_buf,
                3,
                scope.schema_url().unwrap_or_default().as_bytes(),
            );
            put_bytes(&mut resource_spans, 2, &scope_buf);
        }
        put_nonempty(&mut resource_spans, 3, self.resource_schema_url.as_bytes());
        let mut request = Vec::with_capacity(resource_spans.len() + 8);
        put_bytes(&mut request, 1, &resource_spans);
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
