//! What every cluster-proxy binary shares, written once.
//!
//! * [`tls`] — PEM credentials into rustls server/client configurations (ring
//!   provider), with errors that name the file and what is wrong with it.
//! * [`reload`] — hot reload of those configurations when files change.
//! * [`peer`] — the cluster identity a peer certificate names.
//! * [`config`] — layered configuration: defaults < TOML file < environment
//!   (with the Kubernetes Service-link variables filtered out and Go's boolean
//!   spellings) < command-line flags.
//! * [`http_proxy`] — what the service-access proxies share: hop-by-hop
//!   headers, upgraded streams, Kubernetes `Status` errors.
//! * [`cli`] — `--help` that shows every default, the check that every
//!   flag is described, and the flag groups several binaries share.
//! * `shell` (feature `otlp`) — what every `main` does before and after its
//!   service: flags, settings, runtime, logging and traces, signals.
//! * [`logging`] — `tracing` set-up: text on a terminal, plain text without
//!   colour otherwise, JSON on request.
//! * `telemetry` (feature `otlp`) — OpenTelemetry traces over OTLP/gRPC, with
//!   trace ids in log lines.
//! * [`accept`] — accept loops at the open-file limit: a clear refusal, no busy loop.
//! * [`admin`] — the `/healthz`, `/readyz`, `/metrics` HTTP server, with timeouts.
//! * [`metrics`] — Prometheus exposition and the metric-naming rule.
//! * [`net`] — binding listeners with errors that say which port failed.
//! * [`shutdown`] — SIGTERM/SIGINT handling for graceful shutdown.
//! * [`workers`] — the Tokio runtime of a data-path service, sized by
//!   `--worker-threads`.
//! * `allocator` — mimalloc as the global allocator of every binary that
//!   links this crate.
//!
//! It links no Kubernetes client: the data plane (proxy-server, proxy-agent)
//! depends on it.
#![forbid(unsafe_code)]

pub mod accept;
pub mod admin;
mod allocator;
pub mod cli;
pub mod config;
pub mod http_proxy;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod peer;
pub mod reload;
#[cfg(feature = "otlp")]
pub mod shell;
pub mod shutdown;
#[cfg(feature = "otlp")]
pub mod telemetry;
pub mod tls;
pub mod workers;

#[cfg(test)]
pub(crate) mod test_pki;
