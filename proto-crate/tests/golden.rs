//! Pins the wire encoding of every packet type, byte for byte. These bytes are
//! what upstream Go peers send and expect (proto3, default values omitted).

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::packet::{self, Frame};
use prost::Message;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn check(p: Packet, wire: &str, frame: Frame) {
    let expected = hex(wire);
    assert_eq!(p.encode_to_vec(), expected, "encoding of {frame:?}");
    let decoded = Packet::decode(expected.as_slice()).expect("decode golden bytes");
    assert_eq!(decoded, p);
    assert_eq!(Frame::from_packet(decoded), frame);
}

#[test]
fn dial_request_omits_the_default_type() {
    check(
        packet::dial_request("a:1", 5),
        "12 0c  0a 03 746370  12 03 613a31  18 05",
        Frame::DialRequest {
            protocol: "tcp".into(),
            address: "a:1".into(),
            random: 5,
            trace: None,
            early_data: Bytes::new(),
        },
    );
}

#[test]
fn dial_response_success_and_error() {
    check(
        packet::dial_response_ok(5, 7),
        "08 01  1a 04  10 07  18 05",
        Frame::DialResponse {
            error: String::new(),
            connect_id: 7,
            random: 5,
            early_data_written: false,
        },
    );
    check(
        packet::dial_response_error(5, "x"),
        "08 01  1a 05  0a 01 78  18 05",
        Frame::DialResponse {
            error: "x".into(),
            connect_id: 0,
            random: 5,
            early_data_written: false,
        },
    );
}

#[test]
fn trace_context_is_an_extension_field_absent_unless_sent() {
    use cluster_proxy_proto::trace::TraceHeaders;
    // Without trace context: the very bytes upstream peers send.
    assert_eq!(
        packet::dial_request_traced("a:1", 5, None).encode_to_vec(),
        hex("12 0c  0a 03 746370  12 03 613a31  18 05")
    );
    let trace = TraceHeaders {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: String::new(),
    };
    let traced = packet::dial_request_traced("a:1", 5, Some(trace.clone()));
    let mut expected = hex("12 48  0a 03 746370  12 03 613a31  18 05  a2 06 39  0a 37");
    expected.extend_from_slice(trace.traceparent.as_bytes());
    assert_eq!(
        traced.encode_to_vec(),
        expected,
        "field 100 (tag a2 06) after the plain fields"
    );
    assert_eq!(
        Frame::from_packet(Packet::decode(expected.as_slice()).unwrap()),
        Frame::DialRequest {
            protocol: "tcp".into(),
            address: "a:1".into(),
            random: 5,
            trace: Some(trace),
            early_data: Bytes::new(),
        }
    );
}

#[test]
fn early_data_and_its_confirmation_are_extension_fields_absent_unless_sent() {
    // Without early data: the very bytes upstream peers send and expect.
    assert_eq!(
        packet::dial_request_with_early_data("a:1", 5, None, Bytes::new()).encode_to_vec(),
        hex("12 0c  0a 03 746370  12 03 613a31  18 05")
    );
    assert_eq!(
        packet::dial_response_connected(5, 7, false).encode_to_vec(),
        hex("08 01  1a 04  10 07  18 05")
    );
    check(
        packet::dial_request_with_early_data("a:1", 5, None, Bytes::from_static(b"hi")),
        // Field 101 (tag aa 06, length-delimited) after the plain fields.
        "12 11  0a 03 746370  12 03 613a31  18 05  aa 06 02 6869",
        Frame::DialRequest {
            protocol: "tcp".into(),
            address: "a:1".into(),
            random: 5,
            trace: None,
            early_data: Bytes::from_static(b"hi"),
        },
    );
    check(
        packet::dial_response_connected(5, 7, true),
        // Field 100 (tag a0 06, varint) after the plain fields.
        "08 01  1a 07  10 07  18 05  a0 06 01",
        Frame::DialResponse {
            error: String::new(),
            connect_id: 7,
            random: 5,
            early_data_written: true,
        },
    );
}

#[test]
fn data() {
    check(
        packet::data(7, Bytes::from_static(b"hi")),
        "08 04  22 06  08 07  1a 02 6869",
        Frame::Data {
            connect_id: 7,
            data: Bytes::from_static(b"hi"),
        },
    );
}

#[test]
fn close_request_and_response() {
    check(
        packet::close_request(7),
        "08 02  2a 02  08 07",
        Frame::CloseRequest { connect_id: 7 },
    );
    check(
        packet::close_response(7, ""),
        "08 03  32 02  10 07",
        Frame::CloseResponse {
            error: String::new(),
            connect_id: 7,
        },
    );
    check(
        packet::close_response(7, "e"),
        "08 03  32 05  0a 01 65  10 07",
        Frame::CloseResponse {
            error: "e".into(),
            connect_id: 7,
        },
    );
}

#[test]
fn close_dial_and_drain() {
    check(
        packet::close_dial(5),
        "08 05  3a 02  08 05",
        Frame::CloseDial { random: 5 },
    );
    check(packet::drain(), "08 06  42 00", Frame::Drain);
}

#[test]
fn window_update_extension_uses_high_numbers() {
    // type 100, payload field 100 (tag varint a2 06).
    check(
        packet::window_update(7, 65536),
        "08 64  a2 06 06  08 07  10 80 80 04",
        Frame::WindowUpdate {
            connect_id: 7,
            bytes: 65536,
        },
    );
}

#[test]
fn server_count_extension_uses_high_numbers() {
    // type 101, payload field 101 (tag varint aa 06).
    check(
        packet::server_count(3),
        "08 65  aa 06 02  08 03",
        Frame::ServerCount { count: 3 },
    );
}

#[test]
fn span_batch_extension_uses_high_numbers() {
    // type 102, payload field 102 (tag varint b2 06), OTLP bytes in field 1.
    check(
        packet::span_batch(bytes::Bytes::from_static(b"\x0a\x00")),
        "08 66  b2 06 04  0a 02 0a 00",
        Frame::SpanBatch {
            otlp: bytes::Bytes::from_static(b"\x0a\x00"),
        },
    );
}

#[test]
fn large_dial_ids_use_full_varints() {
    let p = packet::dial_request("h:1", i64::MAX);
    let bytes = p.encode_to_vec();
    assert_eq!(Packet::decode(bytes.as_slice()).unwrap(), p);
    assert_eq!(
        &bytes[bytes.len() - 10..],
        hex("18 ff ff ff ff ff ff ff ff 7f").as_slice()
    );
}

#[test]
fn malformed_bytes_are_an_error_not_a_panic() {
    for garbage in [
        hex("12"),                               // truncated length
        hex("12 05 0a"),                         // length beyond the buffer
        hex("ff ff ff ff ff ff ff ff ff ff ff"), // overlong varint
        hex("0f"),                               // invalid wire type
    ] {
        assert!(
            Packet::decode(garbage.as_slice()).is_err(),
            "{garbage:02x?} decoded"
        );
    }
}

#[test]
fn unknown_fields_from_newer_peers_are_skipped() {
    // A CLOSE_REQ carrying an unknown field 200 (varint 1).
    let mut bytes = packet::close_request(7).encode_to_vec();
    bytes.extend(hex("c0 0c 01"));
    let p = Packet::decode(bytes.as_slice()).unwrap();
    assert_eq!(Frame::from_packet(p), Frame::CloseRequest { connect_id: 7 });
}
