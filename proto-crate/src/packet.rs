//! Packet constructors and a typed view of received packets.
//!
//! Peers dispatch on `type` and read the payload through nil-safe getters: a
//! payload that does not match the type yields zero values, never an error —
//! exactly how the Go implementations behave. Callers validate the values
//! (zero ids, empty addresses) themselves.

use bytes::Bytes;

use crate::konnectivity::packet::Payload;
use crate::konnectivity::{
    CloseDial, CloseRequest, CloseResponse, Data, DialRequest, DialResponse, Drain, Packet,
    PacketType, ServerCount, SpanBatch, WindowUpdate,
};
use crate::trace::TraceHeaders;

/// Re-exported where dial addresses were first parsed, for the crates that use it from here.
pub use crate::host_port::split_host_port;

/// The only dial protocol konnectivity supports.
pub const PROTOCOL_TCP: &str = "tcp";

fn packet(kind: PacketType, payload: Payload) -> Packet {
    Packet {
        r#type: kind as i32,
        payload: Some(payload),
    }
}

pub fn dial_request(address: impl Into<String>, random: i64) -> Packet {
    dial_request_traced(address, random, None)
}

/// A dial request carrying the dialer's trace context (the negotiated
/// extension field 100; with `None` the bytes are plain konnectivity's).
pub fn dial_request_traced(
    address: impl Into<String>,
    random: i64,
    trace: Option<TraceHeaders>,
) -> Packet {
    dial_request_with_early_data(address, random, trace, Bytes::new())
}

/// A dial request carrying the connection's first bytes (the early-data
/// extension, field 101; empty, the field is absent from the wire).
pub fn dial_request_with_early_data(
    address: impl Into<String>,
    random: i64,
    trace: Option<TraceHeaders>,
    early_data: Bytes,
) -> Packet {
    packet(
        PacketType::DialReq,
        Payload::DialRequest(DialRequest {
            protocol: PROTOCOL_TCP.to_owned(),
            address: address.into(),
            random,
            trace_context: trace.map(Into::into),
            early_data,
        }),
    )
}

pub fn dial_response_ok(random: i64, connect_id: i64) -> Packet {
    dial_response_connected(random, connect_id, false)
}

/// A successful dial response; `early_data_written` says the request's early
/// data was delivered (extension field 100, absent from the wire when false).
pub fn dial_response_connected(random: i64, connect_id: i64, early_data_written: bool) -> Packet {
    packet(
        PacketType::DialRsp,
        Payload::DialResponse(DialResponse {
            error: String::new(),
            connect_id,
            random,
            early_data_written,
        }),
    )
}

pub fn dial_response_error(random: i64, error: impl Into<String>) -> Packet {
    packet(
        PacketType::DialRsp,
        Payload::DialResponse(DialResponse {
            error: error.into(),
            connect_id: 0,
            random,
            early_data_written: false,
        }),
    )
}

pub fn data(connect_id: i64, data: Bytes) -> Packet {
    packet(
        PacketType::Data,
        Payload::Data(Data {
            connect_id,
            error: String::new(),
            data,
        }),
    )
}

pub fn close_request(connect_id: i64) -> Packet {
    packet(
        PacketType::CloseReq,
        Payload::CloseRequest(CloseRequest { connect_id }),
    )
}

pub fn close_response(connect_id: i64, error: impl Into<String>) -> Packet {
    packet(
        PacketType::CloseRsp,
        Payload::CloseResponse(CloseResponse {
            error: error.into(),
            connect_id,
        }),
    )
}

pub fn close_dial(random: i64) -> Packet {
    packet(
        PacketType::DialCls,
        Payload::CloseDial(CloseDial { random }),
    )
}

pub fn drain() -> Packet {
    packet(PacketType::Drain, Payload::Drain(Drain {}))
}

pub fn window_update(connect_id: i64, bytes: i64) -> Packet {
    packet(
        PacketType::WindowUpdate,
        Payload::WindowUpdate(WindowUpdate { connect_id, bytes }),
    )
}

/// Tells an agent how many proxy-server replicas exist now (cluster-proxy
/// extension; only for agents that advertised
/// [`crate::metadata::SERVER_COUNT_UPDATES`]).
pub fn server_count(count: u32) -> Packet {
    packet(
        PacketType::ServerCount,
        Payload::ServerCount(ServerCount {
            count: i64::from(count),
        }),
    )
}

/// The most bytes of OTLP one SPAN_BATCH carries. Small next to a
/// tunnel's packets (a batch waits in the same lane as the connections'
/// DATA, so a big one would hold theirs up) and far below any server's
/// `--max-packet-size` (at least 65 KiB plus change is refused by the
/// server's relay negotiation, see proxy-server); the agent splits bigger
/// batches and the server refuses bigger ones.
pub const MAX_SPAN_BATCH: usize = 256 * 1024;

/// The agent's own spans for the server to forward (cluster-proxy
/// extension; only on a tunnel that negotiated
/// [`crate::metadata::SPAN_RELAY`]): `otlp` is an encoded OTLP
/// `ExportTraceServiceRequest`.
pub fn span_batch(otlp: Bytes) -> Packet {
    packet(
        PacketType::SpanBatch,
        Payload::SpanBatch(SpanBatch { otlp }),
    )
}

/// The upstream metric label of a packet's type (`DIAL_REQ`, `DATA`, …).
pub fn type_name(p: &Packet) -> &'static str {
    PacketType::try_from(p.r#type).map_or("UNKNOWN", |t| t.as_str_name())
}

/// A received packet, decoded by its `type` with Go's nil-safe semantics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    DialRequest {
        protocol: String,
        address: String,
        random: i64,
        /// The dialer's trace context (cluster-proxy extension), if sent.
        trace: Option<TraceHeaders>,
        /// The connection's first bytes (cluster-proxy extension), if sent.
        early_data: Bytes,
    },
    DialResponse {
        error: String,
        connect_id: i64,
        random: i64,
        /// The request's early data was delivered (cluster-proxy extension).
        early_data_written: bool,
    },
    CloseRequest {
        connect_id: i64,
    },
    CloseResponse {
        error: String,
        connect_id: i64,
    },
    Data {
        connect_id: i64,
        data: Bytes,
    },
    CloseDial {
        random: i64,
    },
    Drain,
    WindowUpdate {
        connect_id: i64,
        bytes: i64,
    },
    /// The number of proxy-server replicas changed (cluster-proxy
    /// extension). The sender's value, unvalidated: receivers ignore
    /// counts below 1.
    ServerCount {
        count: i64,
    },
    /// The agent's own spans (cluster-proxy extension): an encoded OTLP
    /// `ExportTraceServiceRequest`, unvalidated.
    SpanBatch {
        otlp: Bytes,
    },
    /// A `type` this implementation does not know; peers ignore these.
    Unknown(i32),
}

impl Frame {
    pub fn from_packet(packet: Packet) -> Frame {
        let payload = packet.payload;
        match PacketType::try_from(packet.r#type) {
            Ok(PacketType::DialReq) => {
                let p = match payload {
                    Some(Payload::DialRequest(p)) => p,
                    _ => DialRequest::default(),
                };
                Frame::DialRequest {
                    protocol: p.protocol,
                    address: p.address,
                    random: p.random,
                    trace: p.trace_context.map(Into::into),
                    early_data: p.early_data,
                }
            }
            Ok(PacketType::DialRsp) => {
                let p = match payload {
                    Some(Payload::DialResponse(p)) => p,
                    _ => DialResponse::default(),
                };
                Frame::DialResponse {
                    error: p.error,
                    connect_id: p.connect_id,
                    random: p.random,
                    early_data_written: p.early_data_written,
                }
            }
            Ok(PacketType::CloseReq) => {
                let connect_id = match payload {
                    Some(Payload::CloseRequest(p)) => p.connect_id,
                    _ => 0,
                };
                Frame::CloseRequest { connect_id }
            }
            Ok(PacketType::CloseRsp) => {
                let p = match payload {
                    Some(Payload::CloseResponse(p)) => p,
                    _ => CloseResponse::default(),
                };
                Frame::CloseResponse {
                    error: p.error,
                    connect_id: p.connect_id,
                }
            }
            Ok(PacketType::Data) => {
                let p = match payload {
                    Some(Payload::Data(p)) => p,
                    _ => Data::default(),
                };
                Frame::Data {
                    connect_id: p.connect_id,
                    data: p.data,
                }
            }
            Ok(PacketType::DialCls) => {
                let random = match payload {
                    Some(Payload::CloseDial(p)) => p.random,
                    _ => 0,
                };
                Frame::CloseDial { random }
            }
            Ok(PacketType::Drain) => Frame::Drain,
            Ok(PacketType::WindowUpdate) => {
                let p = match payload {
                    Some(Payload::WindowUpdate(p)) => p,
                    _ => WindowUpdate::default(),
                };
                Frame::WindowUpdate {
                    connect_id: p.connect_id,
                    bytes: p.bytes,
                }
            }
            Ok(PacketType::ServerCount) => {
                let count = match payload {
                    Some(Payload::ServerCount(p)) => p.count,
                    _ => 0,
                };
                Frame::ServerCount { count }
            }
            Ok(PacketType::SpanBatch) => {
                let otlp = match payload {
                    Some(Payload::SpanBatch(p)) => p.otlp,
                    _ => Bytes::new(),
                };
                Frame::SpanBatch { otlp }
            }
            Err(_) => Frame::Unknown(packet.r#type),
        }
    }

    /// The upstream metric label for this packet's type (`DIAL_REQ`, `DATA`, …).
    pub fn type_name(&self) -> &'static str {
        match self {
            Frame::DialRequest { .. } => "DIAL_REQ",
            Frame::DialResponse { .. } => "DIAL_RSP",
            Frame::CloseRequest { .. } => "CLOSE_REQ",
            Frame::CloseResponse { .. } => "CLOSE_RSP",
            Frame::Data { .. } => "DATA",
            Frame::CloseDial { .. } => "DIAL_CLS",
            Frame::Drain => "DRAIN",
            Frame::WindowUpdate { .. } => "WINDOW_UPDATE",
            Frame::ServerCount { .. } => "SERVER_COUNT",
            Frame::SpanBatch { .. } => "SPAN_BATCH",
            Frame::Unknown(_) => "UNKNOWN",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatched_payload_reads_as_zero_values() {
        let p = Packet {
            r#type: PacketType::Data as i32,
            payload: Some(Payload::CloseDial(CloseDial { random: 7 })),
        };
        assert_eq!(
            Frame::from_packet(p),
            Frame::Data {
                connect_id: 0,
                data: Bytes::new()
            }
        );
    }

    #[test]
    fn unknown_type_is_reported_not_rejected() {
        let p = Packet {
            r#type: 42,
            payload: None,
        };
        assert_eq!(Frame::from_packet(p), Frame::Unknown(42));
    }

    #[test]
    fn absent_type_is_a_dial_request() {
        let p = Packet {
            r#type: 0,
            payload: None,
        };
        assert!(matches!(
            Frame::from_packet(p),
            Frame::DialRequest { random: 0, .. }
        ));
    }
}
