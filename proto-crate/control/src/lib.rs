//! What every cluster-proxy control-plane service (cert-authority,
//! addon-manager, health-prober, addon-agent) needs from Kubernetes, written
//! once:
//! - [`client`]: clients that name themselves in a User-Agent header, from
//!   the usual inference, a given kubeconfig, or a kubeconfig file that is
//!   re-read when it changes ([`client::KubeconfigClient`]);
//! - [`leader`]: leader election on a `coordination.k8s.io/v1` Lease, as a
//!   single step ([`leader::Elector`]) and as a run loop
//!   ([`leader::LeaderElection`]);
//! - [`lease`]: renewal of an addon's health Lease, as OCM's registration
//!   agent reads it.
//!
//! The data plane never depends on this crate: it links kube.

#![forbid(unsafe_code)]

pub mod client;
pub mod leader;
pub mod lease;

pub use client::{ClientError, KubeconfigClient, client, client_from};
pub use leader::{Elector, LeaderElection, LeaderError};
pub use lease::{LeaseRenewal, is_not_found, renew_lease};
