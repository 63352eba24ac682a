//! The local multi-cluster environment ([`env`], behind `e2e up`) and the
//! cross-service scenarios: connection churn through the real binaries
//! ([`churn`]) and the proxy-server's connection span as benchmarked
//! ([`span_shapes`]), and service access in one process ([`service_access`]). Its parts live in nested crates: the in-memory
//! Kubernetes API (`memory-apiserver`), the simulated clusters
//! (`simulated-cluster`) and the data-plane starters (`tunnel-harness`).
//! The scenario tests live in `tests/`, the benchmark in `benches/`.
#![forbid(unsafe_code)]

pub mod churn;
pub mod env;
pub mod service_access;
pub mod span_shapes;
