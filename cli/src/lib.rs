//! The `cluster-proxy` workstation CLI, as a library so tests drive it
//! with a scripted API and an injected clock.
//!
//! * [`address`] — `CLUSTER:[HOST:]PORT`, `[LOCAL_ADDR:]LOCAL_PORT`, `HOST:PORT`.
//! * [`hub`] — the hub client and the proxy-servers' client credentials.
//! * [`health`] — `cluster-proxy health`: collect, probe live, render.
//! * [`forward`] — `cluster-proxy port-forward`.
//! * [`kubeconfig`] — `cluster-proxy kubeconfig`: contexts through the user-server.
#![forbid(unsafe_code)]

pub mod address;
pub mod forward;
pub mod health;
pub mod hub;
pub mod kubeconfig;
