//! A gRPC request or response body as the peer chose to send it: arbitrary
//! bytes, cut into HTTP/2 DATA frames at arbitrary places. The splitter must
//! find exactly the messages (or the first error) that a plain reading of the
//! whole body finds, wherever the cuts fall; a message decodes the same from
//! the frames it arrived in as from its joined bytes, and every message that
//! decodes as a `Packet` must frame back to the same bytes.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::grpc_framing::{MESSAGE_PREFIX_LEN, MessageSplitter, encode};
use libfuzzer_sys::fuzz_target;
use prost::Message;

#[derive(Debug, Arbitrary)]
struct Body {
    /// Frame lengths; the rest of the body is the last frame.
    cuts: Vec<u16>,
    /// The receiver's `--max-packet-size`, small enough to be hit.
    max_message_len: u16,
    bytes: Vec<u8>,
}

/// gRPC status codes: a bad compressed flag, a message over the limit.
const INTERNAL: i32 = 13;
const OUT_OF_RANGE: i32 = 11;

/// What a receiver makes of the body.
#[derive(Debug, PartialEq)]
enum Reading {
    Messages { messages: Vec<Bytes>, partial: bool },
    Refused { messages: Vec<Bytes>, code: i32 },
}

/// The body read whole, straight from the gRPC spec: a flag byte (only 0
/// without an encoding), a big-endian length, that many bytes.
fn read_whole(mut body: &[u8], max: usize) -> Reading {
    let mut messages = Vec::new();
    loop {
        if body.len() < MESSAGE_PREFIX_LEN {
            return Reading::Messages {
                messages,
                partial: !body.is_empty(),
            };
        }
        if body[0] != 0 {
            return Reading::Refused {
                messages,
                code: INTERNAL,
            };
        }
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if len > max {
            return Reading::Refused {
                messages,
                code: OUT_OF_RANGE,
            };
        }
        let rest = &body[MESSAGE_PREFIX_LEN..];
        if rest.len() < len {
            return Reading::Messages {
                messages,
                partial: true,
            };
        }
        messages.push(Bytes::copy_from_slice(&rest[..len]));
        body = &rest[len..];
    }
}

/// The body as the splitter reads it, frame by frame.
fn read_framed(body: &Body, max: usize) -> Reading {
    let all = Bytes::copy_from_slice(&body.bytes);
    let mut splitter = MessageSplitter::default();
    let mut messages = Vec::new();
    let mut offset = 0;
    let mut cuts = body.cuts.iter().map(|&cut| usize::from(cut));
    loop {
        let end = match cuts.next() {
            Some(cut) => (offset + cut).min(all.len()),
            None => all.len(),
        };
        splitter.push(all.slice(offset..end));
        offset = end;
        loop {
            match splitter.next_message(max) {
                Ok(Some(message)) => {
                    // Decoding from the frames' parts (the receivers' path)
                    // agrees with decoding the joined bytes.
                    let from_parts = Packet::decode(message.clone()).ok();
                    let joined = message.into_contiguous();
                    assert_eq!(from_parts, Packet::decode(joined.clone()).ok());
                    messages.push(joined);
                }
                Ok(None) => break,
                Err(status) => {
                    return Reading::Refused {
                        messages,
                        code: status.code() as i32,
                    };
                }
            }
        }
        if offset == all.len() {
            return Reading::Messages {
                messages,
                partial: splitter.has_partial(),
            };
        }
    }
}

fuzz_target!(|body: Body| {
    let max = usize::from(body.max_message_len);
    let framed = read_framed(&body, max);
    assert_eq!(framed, read_whole(&body.bytes, max));
    let Reading::Messages { messages, .. } = framed else {
        return;
    };
    for message in messages {
        let Ok(packet) = Packet::decode(message.clone()) else {
            continue;
        };
        let encoded = encode(&packet, usize::MAX).expect("a decoded packet encodes");
        let mut reframed = encoded.head.to_vec();
        reframed.extend_from_slice(encoded.payload.as_deref().unwrap_or_default());
        let again = Packet::decode(&reframed[MESSAGE_PREFIX_LEN..]).expect("our framing decodes");
        assert_eq!(again, packet);
        assert_eq!(
            u32::from_be_bytes([reframed[1], reframed[2], reframed[3], reframed[4]]) as usize,
            reframed.len() - MESSAGE_PREFIX_LEN
        );
    }
});
