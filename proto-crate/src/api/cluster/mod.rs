//! `cluster.open-cluster-management.io`: OCM's cluster inventory and placement.

pub mod v1;
pub mod v1alpha1;
pub mod v1beta1;

/// The API group.
pub const GROUP: &str = "cluster.open-cluster-management.io";
