//! The PKI for every cluster-proxy mTLS hop.
//!
//! * [`pki`] — create or load a CA and issue server, client and per-cluster
//!   agent certificates (ECDSA P-256).
//! * [`files`] — the on-disk PKI layout and `cert-authority init`.
//! * [`authority`] — the reconcile pass that keeps a PKI current, over a
//!   [`authority::Store`] (the `files` backend is [`authority::FileStore`]).
//! * [`rotation`] — when to renew leaves and how to roll the CA over.
//! * [`settings`] — the command line and its layered settings.
//!
//! Loading credentials into rustls, their hot reload and reading a peer's
//! identity belong to every service and live in `cluster-proxy-runtime`;
//! they are re-exported here as [`tls`], [`reload`] and [`peer`].
#![forbid(unsafe_code)]

pub mod authority;
pub mod commands;
pub mod files;
pub mod kubernetes;
pub mod pki;
pub mod rotation;
pub mod settings;

pub use cluster_proxy_runtime::{peer, reload, tls};
