//! Every combination of `type` and payload a hostile peer can send, including
//! payloads that do not match the type (Go's nil-safe getters yield zero
//! values) and types this version does not know.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use cluster_proxy_proto::konnectivity::packet::Payload;
use cluster_proxy_proto::konnectivity::{
    CloseDial, CloseRequest, CloseResponse, Data, DialRequest, DialResponse, Drain, ServerCount,
    TraceContext, WindowUpdate,
};
use cluster_proxy_proto::packet::Frame;
use cluster_proxy_proto::{Packet, PacketType};
use libfuzzer_sys::fuzz_target;
use prost::Message;

#[derive(Debug, Arbitrary)]
enum AnyPayload {
    None,
    DialRequest {
        protocol: String,
        address: String,
        random: i64,
        trace: Option<(String, String)>,
        early_data: Vec<u8>,
    },
    DialResponse {
        error: String,
        connect_id: i64,
        random: i64,
        early_data_written: bool,
    },
    CloseRequest(i64),
    CloseResponse(String, i64),
    Data {
        connect_id: i64,
        error: String,
        data: Vec<u8>,
    },
    CloseDial(i64),
    Drain,
    WindowUpdate(i64, i64),
    ServerCount(i64),
}

#[derive(Debug, Arbitrary)]
struct AnyPacket {
    kind: i32,
    payload: AnyPayload,
}

impl From<AnyPayload> for Option<Payload> {
    fn from(payload: AnyPayload) -> Self {
        Some(match payload {
            AnyPayload::None => return None,
            AnyPayload::DialRequest {
                protocol,
                address,
                random,
                trace,
                early_data,
            } => Payload::DialRequest(DialRequest {
                protocol,
                address,
                random,
                trace_context: trace.map(|(traceparent, tracestate)| TraceContext {
                    traceparent,
                    tracestate,
                }),
                early_data: Bytes::from(early_data),
            }),
            AnyPayload::DialResponse {
                error,
                connect_id,
                random,
                early_data_written,
            } => Payload::DialResponse(DialResponse {
                error,
                connect_id,
                random,
                early_data_written,
            }),
            AnyPayload::CloseRequest(connect_id) => {
                Payload::CloseRequest(CloseRequest { connect_id })
            }
            AnyPayload::CloseResponse(error, connect_id) => {
                Payload::CloseResponse(CloseResponse { error, connect_id })
            }
            AnyPayload::Data {
                connect_id,
                error,
                data,
            } => Payload::Data(Data {
                connect_id,
                error,
                data: Bytes::from(data),
            }),
            AnyPayload::CloseDial(random) => Payload::CloseDial(CloseDial { random }),
            AnyPayload::Drain => Payload::Drain(Drain {}),
            AnyPayload::WindowUpdate(connect_id, bytes) => {
                Payload::WindowUpdate(WindowUpdate { connect_id, bytes })
            }
            AnyPayload::ServerCount(count) => Payload::ServerCount(ServerCount { count }),
        })
    }
}

fuzz_target!(|input: AnyPacket| {
    let packet = Packet {
        r#type: input.kind,
        payload: input.payload.into(),
    };
    let wire = packet.encode_to_vec();
    let frame = Frame::from_packet(packet);
    let known = PacketType::try_from(input.kind).is_ok();
    assert_eq!(matches!(frame, Frame::Unknown(_)), !known);
    // What the receiving peer decodes from the bytes is what the sender meant.
    let received = Packet::decode(wire.as_slice()).expect("prost decodes its own encoding");
    assert_eq!(Frame::from_packet(received), frame);
});
