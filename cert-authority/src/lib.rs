//! The PKI for every cluster-proxy mTLS hop.
//!
//! * [`pki`] — create or load a CA and issue server, client and per-cluster
//!   agent certificates (ECDSA P-256).
//! * [`tls`] — load PEM credentials from files into rustls server/client
//!   configurations (ring provider), with clear errors for missing, malformed
//!   or expired material.
//! * [`peer`] — read the cluster identity a peer certificate names.
//! * [`files`] — the on-disk PKI layout and `cert-authority init`.
//! * [`reload`] — rebuild rustls configurations when credential files change,
//!   without touching established connections.
//! * [`authority`] — the reconcile pass that keeps a PKI current, over a
//!   [`authority::Store`] (the `files` backend is [`authority::FileStore`]).
//! * [`rotation`] — when to renew leaves and how to roll the CA over.
#![forbid(unsafe_code)]

pub mod authority;
pub mod files;
pub mod kubernetes;
pub mod peer;
pub mod pki;
pub mod reload;
pub mod rotation;
pub mod tls;
