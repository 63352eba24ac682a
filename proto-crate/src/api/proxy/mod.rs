//! `proxy.open-cluster-management.io`: cluster-proxy's own API group.

pub mod v1alpha1;

/// The API group.
pub const GROUP: &str = "proxy.open-cluster-management.io";
