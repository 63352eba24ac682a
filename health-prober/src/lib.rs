//! health-prober: probes every managed cluster's kube-apiserver through each
//! proxy-server replica and records reachability and latency as the
//! `ClusterProxyReachable` condition of the cluster's `cluster-proxy`
//! ManagedClusterAddOn.
//!
//! * [`settings`] — flags, environment (`HEALTH_PROBER_*`) and TOML file.
//! * [`replicas`] — one lazily (re)connected gRPC channel per replica.
//! * [`probe`] — one probe: dial, TLS handshake, `GET /healthz`, timed.
//! * [`verdict`] — outcomes to a condition, and when it is worth a write.
//! * [`prober`] — the rounds and the status writes.
//! * [`shards`] — member Leases, and which clusters this replica probes.
//! * [`tls`] — client TLS for the proxy-servers and the kube-apiservers.
//! * [`metrics`] — Prometheus metrics.
#![forbid(unsafe_code)]

pub mod metrics;
pub mod probe;
pub mod prober;
pub mod replicas;
pub mod service;
pub mod settings;
pub mod shards;
pub mod tls;
pub mod verdict;
