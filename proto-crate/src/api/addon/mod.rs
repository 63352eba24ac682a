//! `addon.open-cluster-management.io`: OCM's add-on framework.

pub mod v1alpha1;

/// The API group.
pub const GROUP: &str = "addon.open-cluster-management.io";
