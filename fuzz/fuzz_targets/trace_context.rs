//! The W3C trace context a client sends (gRPC metadata, CONNECT headers) and
//! the server forwards to agents: `traceparent` and `tracestate` as any
//! text, split at the first newline. A value that parses is a valid remote
//! context, and what we write for it parses back to the same ids and
//! sampled flag.
#![no_main]

use cluster_proxy_proto::trace::{TraceHeaders, parse_traceparent};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let (traceparent, tracestate) = text.split_once('\n').unwrap_or((text, ""));
    if let Ok(parent) = parse_traceparent(traceparent) {
        assert!(parent.is_valid() && parent.is_remote(), "{traceparent:?}");
        let written =
            TraceHeaders::from_span_context(&parent).expect("a valid context has headers");
        let again = parse_traceparent(&written.traceparent).expect("our own traceparent parses");
        assert_eq!(again.trace_id(), parent.trace_id(), "{traceparent:?}");
        assert_eq!(again.span_id(), parent.span_id(), "{traceparent:?}");
        assert_eq!(again.trace_flags(), parent.trace_flags(), "{traceparent:?}");
    }
    let headers = TraceHeaders {
        traceparent: traceparent.to_owned(),
        tracestate: tracestate.to_owned(),
    };
    match headers.to_context() {
        Some(context) => {
            let original = parse_traceparent(traceparent).expect("to_context accepted it");
            let written = TraceHeaders::from_context(&context).expect("a valid parent has headers");
            let again =
                parse_traceparent(&written.traceparent).expect("our own traceparent parses");
            assert_eq!(
                (again.trace_id(), again.span_id(), again.trace_flags()),
                (
                    original.trace_id(),
                    original.span_id(),
                    original.trace_flags()
                ),
                "{headers:?}"
            );
        }
        None => assert!(parse_traceparent(traceparent).is_err(), "{headers:?}"),
    }
});
