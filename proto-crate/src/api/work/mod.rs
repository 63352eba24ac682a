//! `work.open-cluster-management.io`: OCM's ManifestWork delivery.

pub mod v1;

/// The API group.
pub const GROUP: &str = "work.open-cluster-management.io";
