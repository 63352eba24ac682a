//! The one protocol crate every cluster-proxy service shares.
//!
//! * [`konnectivity`] — the konnectivity (apiserver-network-proxy) wire types and
//!   gRPC stubs, generated from `proto/` and checked in (no `protoc` at build time).
//! * [`packet`] — constructors and a typed, nil-safe view of [`konnectivity::Packet`].
//! * [`metadata`] — the gRPC metadata keys both ends exchange.
//! * [`identifiers`] — the `agentidentifiers` value format (URL query).
//! * [`identity`] — how a certificate names a cluster, and which identifiers a
//!   cluster may claim.
//! * [`flow`] — the per-connection flow-control primitives (credit and bounded
//!   receive buffers) that keep one slow connection from stalling a tunnel.
//! * [`grpc_framing`] — gRPC framing of packets that neither copies a received
//!   message out of its HTTP/2 frame nor a sent payload into an encode buffer.
//! * [`framed`] — the lean framing our own ends negotiate (ALPN) instead of gRPC over HTTP/2.
//! * [`websocket`] — the lean framing inside a WebSocket, for networks that let only HTTP/1.1 through.
//! * [`h2_driver`] — the parts for driving an HTTP/2 connection and its streams from one
//!   task (the tunnel's two ends do, rather than a task per stream as hyper does).
//! * [`duration`] / [`strconv`] — Go's duration and boolean syntaxes, as upstream flags use them.
//! * [`trace`] — W3C trace-context propagation (gRPC metadata, HTTP headers, dial requests).
//! * [`transport`] / [`client`] — mTLS gRPC channels and a tunnel dialer for Rust users.
//! * [`service_access`] — the user-server → service-proxy contract: its headers and hub identities.
//! * [`connector`] — a hyper / tower connector (and, with `kube-api`, a `kube::Client`)
//!   whose connections go through the tunnel.
//! * `api` (feature `kube-api`) — the versioned Kubernetes API types: our CRD and the OCM types.
#![forbid(unsafe_code)]

#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod konnectivity {
    //! Generated from `proto/konnectivity/*.proto`; see `tests/codegen.rs`.
    include!("gen/konnectivity.rs");
}

#[cfg(feature = "kube-api")]
pub mod api;
pub mod client;
pub mod connector;
pub mod dial_error;
pub mod duplex;
pub mod duration;
pub mod flow;
pub mod framed;
pub mod grpc_framing;
pub mod h2_channel;
pub mod h2_driver;
pub mod host_port;
pub mod identifiers;
pub mod identity;
pub mod metadata;
pub mod packet;
pub mod service_access;
pub mod status;
pub mod strconv;
pub mod trace;
pub mod transport;
pub mod websocket;

pub use konnectivity::{Packet, PacketType};
