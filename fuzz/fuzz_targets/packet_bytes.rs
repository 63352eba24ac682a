//! Raw bytes off the wire: a `Packet` as prost decodes it, then the typed view
//! every peer dispatches on. Decoding must fail cleanly or yield a frame that
//! survives re-encoding unchanged.
#![no_main]

use cluster_proxy_proto::Packet;
use cluster_proxy_proto::packet::{Frame, type_name};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(packet) = Packet::decode(data) else {
        return;
    };
    let _ = type_name(&packet);
    let reencoded = packet.encode_to_vec();
    let frame = Frame::from_packet(packet);
    let again = Packet::decode(reencoded.as_slice()).expect("prost re-decodes its own encoding");
    assert_eq!(frame, Frame::from_packet(again));
});
