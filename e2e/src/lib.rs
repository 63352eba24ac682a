//! End-to-end support for cluster-proxy: a throwaway PKI ([`pki`]), target
//! services ([`targets`]) and helpers that start servers, clients and
//! hand-driven agents on loopback ([`harness`]). The loopback scenario tests
//! live in `tests/`, the benchmark in `benches/`.
#![forbid(unsafe_code)]

pub mod churn;
pub mod env;
pub mod h2_frames;
pub mod harness;
pub mod kubeapi;
pub mod loadgen;
pub mod otlp;
pub mod pki;
pub mod processes;
pub mod replicas;
pub mod span_shapes;
pub mod targets;
