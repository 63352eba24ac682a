//! The PKI for every cluster-proxy mTLS hop.
//!
//! * [`pki`] — create or load a CA and issue server, client and per-cluster
//!   agent certificates (ECDSA P-256).
//! * [`tls`] — load PEM credentials from files into rustls server/client
//!   configurations (ring provider), with clear errors for missing, malformed
//!   or expired material.
//! * [`peer`] — read the cluster identity a peer certificate names.
#![forbid(unsafe_code)]

pub mod peer;
pub mod pki;
pub mod tls;
