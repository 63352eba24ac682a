//! Connection spans made with the OpenTelemetry API directly, not through
//! `tracing`.
//!
//! The proxy-server's `tunnel.connection` and the proxy-agent's `agent.dial`
//! are made once per tunneled connection, on the busiest path the services
//! have. Through the `tracing` → OpenTelemetry bridge each of them cost a
//! pass through every layer and its filter for the creation, each
//! `record`, each enter and the close, and every field went from a
//! `tracing` value to an attribute even when the span was not sampled.
//! A [`DirectSpan`] asks the exporting tracer once, when the connection
//! starts (its ids are needed then, for the agent), and adds attributes only
//! when the sampler kept it: an unsampled connection pays for its ids and
//! nothing else.
//!
//! The tracer is process-wide, like the `tracing` subscriber it sits beside:
//! `cluster_proxy_runtime::telemetry::init` installs the exporting one with
//! [`install_tracer`]. Without it every `DirectSpan` is disabled.

use std::borrow::Cow;
use std::sync::OnceLock;

use opentelemetry::KeyValue;
use opentelemetry::global::{BoxedSpan, BoxedTracer};
use opentelemetry::trace::{Span as _, SpanContext, SpanId, SpanKind, Status, TraceId, Tracer};

use super::w3c::TraceHeaders;

static TRACER: OnceLock<BoxedTracer> = OnceLock::new();

/// Makes `tracer` the one every [`DirectSpan`] of this process uses. The
/// first call wins, as the first `tracing` subscriber does; a later tracer
/// is handed back.
pub fn install_tracer(tracer: BoxedTracer) -> Result<(), BoxedTracer> {
    TRACER.set(tracer)
}

/// Whether spans are made at all (a tracer is installed).
pub fn tracer_installed() -> bool {
    TRACER.get().is_some()
}

/// The attributes of a TCP connection to `address` (`host:port`), as the
/// semantic conventions for network spans name them: `network.transport`,
/// `server.address` and `server.port`.
pub fn tcp_server_attributes(address: &str) -> [KeyValue; 3] {
    let (host, port) = crate::host_port::split_host_port(address).unwrap_or((address, ""));
    [
        KeyValue::new("network.transport", "tcp"),
        KeyValue::new("server.address", host.to_owned()),
        KeyValue::new("server.port", port.to_owned()),
    ]
}

/// One span, started when the work starts and ended when it is dropped (or
/// by [`DirectSpan::end`]).
#[derive(Debug)]
pub struct DirectSpan {
    /// Present while the span records: sampled and not yet ended.
    span: Option<BoxedSpan>,
    /// The span's ids (invalid when no tracer is installed), kept for the
    /// peers and log lines even when the span is not sampled.
    context: SpanContext,
}

impl DirectSpan {
    /// A span that records nothing and has no ids.
    pub fn disabled() -> Self {
        DirectSpan {
            span: None,
            context: SpanContext::NONE,
        }
    }

    /// Starts span `name`, a child of the span `parent` names (a new trace
    /// when there is none or it is malformed), with the process's tracer.
    /// Disabled without one. `attributes` is the most attributes the span
    /// will be given: room for them is made at once, so adding them one
    /// step at a time never regrows the span's list (which showed as the
    /// largest single cost of a connection span).
    pub fn start(
        name: &'static str,
        kind: SpanKind,
        parent: Option<&TraceHeaders>,
        attributes: usize,
    ) -> Self {
        match TRACER.get() {
            Some(tracer) => {
                let parent = parent
                    .and_then(TraceHeaders::to_context)
                    .unwrap_or_default();
                Self::start_with(tracer, name, kind, &parent, attributes)
            }
            None => Self::disabled(),
        }
    }

    /// The process's tracer, if one is installed.
    pub fn installed_tracer() -> Option<&'static BoxedTracer> {
        TRACER.get()
    }

    /// Starts span `name` with `tracer`, a child of `parent`'s span (a new
    /// trace when it has none), with room for `attributes` attributes.
    pub fn start_with(
        tracer: &BoxedTracer,
        name: &'static str,
        kind: SpanKind,
        parent: &opentelemetry::Context,
        attributes: usize,
    ) -> Self {
        let mut builder = tracer.span_builder(name).with_kind(kind);
        // The SDK keeps the builder's list (and its capacity) as the span's.
        builder.attributes = Some(Vec::with_capacity(attributes));
        let span = tracer.build_with_context(builder, parent);
        let context = span.span_context().clone();
        DirectSpan {
            span: span.is_recording().then_some(span),
            context,
        }
    }

    /// Whether the span is sampled and still open: only then do attributes
    /// and events go anywhere.
    pub fn is_recording(&self) -> bool {
        self.span.is_some()
    }

    /// Adds the attributes `make` returns; `make` runs only while the span
    /// records, so an unsampled span never builds them.
    pub fn set_attributes<I>(&mut self, make: impl FnOnce() -> I)
    where
        I: IntoIterator<Item = KeyValue>,
    {
        if let Some(span) = &mut self.span {
            span.set_attributes(make());
        }
    }

    /// Adds an event named `name` with the attributes `make` returns (made
    /// only while the span records).
    pub fn add_event(
        &mut self,
        name: impl Into<Cow<'static, str>>,
        make: impl FnOnce() -> Vec<KeyValue>,
    ) {
        if let Some(span) = &mut self.span {
            span.add_event(name, make());
        }
    }

    /// Marks the span failed with `message`, which also becomes its
    /// `error.message` attribute.
    pub fn fail(&mut self, message: &str) {
        if let Some(span) = &mut self.span {
            span.set_attribute(KeyValue::new("error.message", message.to_owned()));
            span.set_status(Status::error(message.to_owned()));
        }
    }

    /// The headers that make a peer's span this span's child; `None` when
    /// the span has no ids. An unsampled span's headers say so, and the
    /// peer's parent-based sampler follows.
    pub fn headers(&self) -> Option<TraceHeaders> {
        TraceHeaders::from_span_context(&self.context)
    }

    /// The trace id for log lines about this work; `None` without ids.
    pub fn trace_id(&self) -> Option<TraceId> {
        self.context.is_valid().then(|| self.context.trace_id())
    }

    /// The span id for log lines about this work; `None` without ids.
    pub fn span_id(&self) -> Option<SpanId> {
        self.context.is_valid().then(|| self.context.span_id())
    }

    /// Ends the span now; later attributes go nowhere.
    pub fn end(&mut self) {
        if let Some(mut span) = self.span.take() {
            span.end();
        }
    }
}

impl Drop for DirectSpan {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanProcessor};

    use super::*;

    /// Keeps every span that ends.
    #[derive(Debug, Clone, Default)]
    pub(crate) struct Ended(pub(crate) Arc<Mutex<Vec<SpanData>>>);

    impl SpanProcessor for Ended {
        fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {}
        fn on_end(&self, span: SpanData) {
            self.0.lock().unwrap().push(span);
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    fn tracer(sampler: Sampler) -> (BoxedTracer, Ended, SdkTracerProvider) {
        let ended = Ended::default();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(ended.clone())
            .with_sampler(sampler)
            .build();
        let tracer = BoxedTracer::new(Box::new(provider.tracer("test")));
        (tracer, ended, provider)
    }

    fn parent(flags: &str) -> TraceHeaders {
        TraceHeaders {
            traceparent: format!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-{flags}"),
            tracestate: String::new(),
        }
    }

    #[test]
    fn a_sampled_span_continues_its_parent_and_ends_with_what_was_added() {
        let (tracer, ended, _provider) = tracer(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)));
        let parent = parent("01").to_context().unwrap();
        let mut span =
            DirectSpan::start_with(&tracer, "tunnel.connection", SpanKind::Server, &parent, 4);
        assert!(span.is_recording());
        span.set_attributes(|| [KeyValue::new("cluster_proxy.cluster", "a")]);
        span.add_event("dial failed", || {
            vec![KeyValue::new("cluster_proxy.end_reason", "x")]
        });
        span.fail("connection refused");
        let headers = span.headers().expect("a sampled span has headers");
        let span_id = span.span_id().expect("ids");
        assert_eq!(
            headers.traceparent,
            format!("00-0af7651916cd43dd8448eb211c80319c-{span_id}-01")
        );
        drop(span);
        let ended = ended.0.lock().unwrap();
        let [data] = ended.as_slice() else {
            panic!("one span should have ended: {ended:?}")
        };
        assert_eq!(data.name, "tunnel.connection");
        assert_eq!(data.span_kind, SpanKind::Server);
        assert_eq!(data.parent_span_id.to_string(), "b7ad6b7169203331");
        assert_eq!(
            data.span_context.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        let value = |key: &str| {
            data.attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.as_str().into_owned())
        };
        assert_eq!(value("cluster_proxy.cluster").as_deref(), Some("a"));
        assert_eq!(
            value("error.message").as_deref(),
            Some("connection refused")
        );
        assert_eq!(data.status, Status::error("connection refused"));
        assert_eq!(data.events.events.len(), 1);
        assert_eq!(data.events.events[0].name, "dial failed");
    }

    #[test]
    fn an_unsampled_span_builds_no_attributes_but_passes_its_ids_on() {
        let (tracer, ended, _provider) = tracer(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)));
        let parent = parent("00").to_context().unwrap();
        let mut span = DirectSpan::start_with(&tracer, "agent.dial", SpanKind::Client, &parent, 1);
        let mut built = false;
        span.set_attributes(|| {
            built = true;
            [KeyValue::new("k", "v")]
        });
        assert!(!built, "an unsampled span built its attributes");
        assert!(!span.is_recording());
        let headers = span.headers().expect("an unsampled span still has ids");
        assert!(headers.traceparent.ends_with("-00"), "{headers:?}");
        assert_eq!(
            span.trace_id().map(|id| id.to_string()).as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
        drop(span);
        assert!(ended.0.lock().unwrap().is_empty());
    }

    #[test]
    fn a_disabled_span_builds_nothing_and_has_no_ids() {
        let mut span = DirectSpan::disabled();
        let mut built = false;
        span.set_attributes(|| {
            built = true;
            [KeyValue::new("k", "v")]
        });
        span.add_event("e", || {
            built = true;
            Vec::new()
        });
        span.fail("boom");
        assert!(
            !built,
            "attributes of a span that records nothing were built"
        );
        assert!(!span.is_recording());
        assert_eq!(span.headers(), None);
        assert_eq!(span.trace_id(), None);
        assert_eq!(span.span_id(), None);
    }
}
