//! The W3C `traceparent` / `tracestate` values as they travel on the wire
//! (re-exported by [`crate::trace`]).

use std::str::FromStr;

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};

/// The W3C header / gRPC metadata key of the parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header / gRPC metadata key of vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";

/// A `traceparent` (and optional `tracestate`) as found on the wire.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: String,
    pub tracestate: String,
}

/// Why a `traceparent` value was not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    #[error("traceparent {0:?} does not have the form version-traceid-parentid-flags")]
    Shape(String),
    #[error("traceparent {0:?} has an invalid version")]
    Version(String),
    #[error("traceparent {0:?} has an invalid or all-zero trace id")]
    TraceId(String),
    #[error("traceparent {0:?} has an invalid or all-zero parent id")]
    ParentId(String),
    #[error("traceparent {0:?} has invalid flags")]
    Flags(String),
}

/// The value of one lowercase hex digit (the only case the spec allows).
fn lower_hex_digit(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        _ => None,
    }
}

/// Decodes exactly `2 * N` lowercase hex digits. Done by hand because a
/// `traceparent` is parsed for every tunneled connection, and the general
/// routines (`from_str_radix`, splitting on a `char`) cost several times
/// more on that path.
fn decode_lower_hex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = (lower_hex_digit(pair[0])? << 4) | lower_hex_digit(pair[1])?;
    }
    Some(out)
}

/// Appends `bytes` as lowercase hex.
fn push_lower_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
}

/// The length of a version-00 `traceparent`.
const TRACEPARENT_LEN: usize = 55;

/// Parses a `traceparent` value into a remote span context (without trace state).
pub fn parse_traceparent(value: &str) -> Result<SpanContext, TraceParentError> {
    let value = value.trim();
    let shape = || TraceParentError::Shape(value.to_owned());
    let mut parts = value.as_bytes().splitn(5, |b| *b == b'-');
    let version = parts.next().ok_or_else(shape)?;
    let trace_id = parts.next().ok_or_else(shape)?;
    let parent_id = parts.next().ok_or_else(shape)?;
    let flags = parts.next().ok_or_else(shape)?;
    let rest = parts.next();
    let version = decode_lower_hex::<1>(version)
        .filter(|version| *version != [0xff])
        .ok_or_else(|| TraceParentError::Version(value.to_owned()))?;
    // Version 00 has exactly four fields; later versions may append more.
    if version == [0] && rest.is_some() {
        return Err(shape());
    }
    let [flags] =
        decode_lower_hex::<1>(flags).ok_or_else(|| TraceParentError::Flags(value.to_owned()))?;
    let trace_id = decode_lower_hex::<16>(trace_id)
        .map(TraceId::from_bytes)
        .filter(|id| *id != TraceId::INVALID)
        .ok_or_else(|| TraceParentError::TraceId(value.to_owned()))?;
    let span_id = decode_lower_hex::<8>(parent_id)
        .map(SpanId::from_bytes)
        .filter(|id| *id != SpanId::INVALID)
        .ok_or_else(|| TraceParentError::ParentId(value.to_owned()))?;
    // Only the sampled bit is defined; unknown bits must not be propagated.
    let flags = TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8());
    Ok(SpanContext::new(
        trace_id,
        span_id,
        flags,
        true,
        TraceState::NONE,
    ))
}

/// The version-00 `traceparent` of `span_context`.
fn format_traceparent(span_context: &SpanContext) -> String {
    let mut traceparent = String::with_capacity(TRACEPARENT_LEN);
    traceparent.push_str("00-");
    push_lower_hex(&mut traceparent, &span_context.trace_id().to_bytes());
    traceparent.push('-');
    push_lower_hex(&mut traceparent, &span_context.span_id().to_bytes());
    traceparent.push('-');
    push_lower_hex(&mut traceparent, &[span_context.trace_flags().to_u8()]);
    traceparent
}

impl TraceHeaders {
    /// The headers that make a receiver's span a child of `context`'s span;
    /// `None` when it has no valid span (tracing off, or not sampled in).
    pub fn from_context(context: &opentelemetry::Context) -> Option<Self> {
        Self::from_span_context(context.span().span_context())
    }

    /// The headers that make a receiver's span a child of the span with
    /// `span_context`; `None` when it is not valid.
    pub fn from_span_context(span_context: &SpanContext) -> Option<Self> {
        if !span_context.is_valid() {
            return None;
        }
        Some(TraceHeaders {
            traceparent: format_traceparent(span_context),
            tracestate: span_context.trace_state().header(),
        })
    }

    /// The remote parent these headers name, or `None` when `traceparent` is
    /// malformed. A malformed `tracestate` is dropped, as the spec says.
    pub fn to_context(&self) -> Option<opentelemetry::Context> {
        let parent = parse_traceparent(&self.traceparent).ok()?;
        let state = if self.tracestate.is_empty() {
            TraceState::NONE
        } else {
            TraceState::from_str(&self.tracestate).unwrap_or_default()
        };
        let parent = SpanContext::new(
            parent.trace_id(),
            parent.span_id(),
            parent.trace_flags(),
            true,
            state,
        );
        Some(opentelemetry::Context::new().with_remote_span_context(parent))
    }

    /// Reads the headers from gRPC request metadata; `None` without `traceparent`.
    pub fn from_metadata(metadata: &tonic::metadata::MetadataMap) -> Option<Self> {
        let text = |key: &str| {
            metadata
                .get(key)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Some(TraceHeaders {
            traceparent: text(TRACEPARENT)?,
            tracestate: text(TRACESTATE).unwrap_or_default(),
        })
    }

    /// Reads the headers from an HTTP request; `None` without `traceparent`.
    pub fn from_http(headers: &http::HeaderMap) -> Option<Self> {
        let text = |key: &str| {
            headers
                .get(key)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Some(TraceHeaders {
            traceparent: text(TRACEPARENT)?,
            tracestate: text(TRACESTATE).unwrap_or_default(),
        })
    }

    /// Writes the headers into gRPC request metadata (values that are not
    /// valid metadata are skipped).
    pub fn insert_into_metadata(&self, metadata: &mut tonic::metadata::MetadataMap) {
        if let Ok(value) = self.traceparent.parse() {
            metadata.insert(TRACEPARENT, value);
        }
        if !self.tracestate.is_empty()
            && let Ok(value) = self.tracestate.parse()
        {
            metadata.insert(TRACESTATE, value);
        }
    }

    /// Writes the headers into an HTTP request's headers.
    pub fn insert_into_http(&self, headers: &mut http::HeaderMap) {
        if let Ok(value) = http::HeaderValue::from_str(&self.traceparent) {
            headers.insert(TRACEPARENT, value);
        }
        if !self.tracestate.is_empty()
            && let Ok(value) = http::HeaderValue::from_str(&self.tracestate)
        {
            headers.insert(TRACESTATE, value);
        }
    }
}

impl From<crate::konnectivity::TraceContext> for TraceHeaders {
    fn from(wire: crate::konnectivity::TraceContext) -> Self {
        TraceHeaders {
            traceparent: wire.traceparent,
            tracestate: wire.tracestate,
        }
    }
}

impl From<TraceHeaders> for crate::konnectivity::TraceContext {
    fn from(headers: TraceHeaders) -> Self {
        crate::konnectivity::TraceContext {
            traceparent: headers.traceparent,
            tracestate: headers.tracestate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_spec_example() {
        let parent = parse_traceparent(VALID).unwrap();
        assert_eq!(
            parent.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(parent.span_id().to_string(), "00f067aa0ba902b7");
        assert!(parent.is_sampled());
        assert!(parent.is_remote());
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_err(), "{bad:?}");
        }
        // A later version may carry more fields.
        let future = format!("01-{}-extra", &VALID[3..]);
        assert!(parse_traceparent(&future).is_ok());
    }

    #[test]
    fn the_hand_written_hex_agrees_with_opentelemetrys_formatting() {
        // Ids with every digit in every position, sampled and not.
        for seed in 0u64..64 {
            let trace = u128::from(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)) << 64
                | u128::from(seed.rotate_left(17) ^ 0x0123_4567_89ab_cdef);
            let span = seed.wrapping_mul(0xff51_afd7_ed55_8ccd) | 1;
            let flags = if seed % 2 == 0 {
                TraceFlags::SAMPLED
            } else {
                TraceFlags::default()
            };
            let context = SpanContext::new(
                TraceId::from(trace),
                SpanId::from(span),
                flags,
                false,
                TraceState::NONE,
            );
            let formatted = format_traceparent(&context);
            assert_eq!(
                formatted,
                format!(
                    "00-{}-{}-{:02x}",
                    context.trace_id(),
                    context.span_id(),
                    flags.to_u8()
                )
            );
            let parsed = parse_traceparent(&formatted).unwrap();
            assert_eq!(parsed.trace_id(), context.trace_id(), "{formatted}");
            assert_eq!(parsed.span_id(), context.span_id(), "{formatted}");
            assert_eq!(parsed.trace_flags(), flags, "{formatted}");
        }
    }

    #[test]
    fn headers_round_trip_through_a_context() {
        let headers = TraceHeaders {
            traceparent: VALID.into(),
            tracestate: "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7".into(),
        };
        let context = headers.to_context().unwrap();
        assert_eq!(TraceHeaders::from_context(&context), Some(headers));
        let unusable = TraceHeaders {
            traceparent: "garbage".into(),
            tracestate: String::new(),
        };
        assert!(unusable.to_context().is_none());
        assert!(TraceHeaders::from_context(&opentelemetry::Context::new()).is_none());
    }

    #[test]
    fn metadata_and_http_headers_carry_them() {
        let headers = TraceHeaders {
            traceparent: VALID.into(),
            tracestate: "a=b".into(),
        };
        let mut metadata = tonic::metadata::MetadataMap::new();
        headers.insert_into_metadata(&mut metadata);
        assert_eq!(
            TraceHeaders::from_metadata(&metadata),
            Some(headers.clone())
        );
        let mut http_headers = http::HeaderMap::new();
        headers.insert_into_http(&mut http_headers);
        assert_eq!(TraceHeaders::from_http(&http_headers), Some(headers));
        assert_eq!(
            TraceHeaders::from_http(&http::HeaderMap::new()),
            None,
            "no traceparent, no trace context"
        );
    }
}
