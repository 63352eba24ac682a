//! How the addon-agent names itself to the Kubernetes APIs it calls.

/// Sent on every Kubernetes request, so audit logs name the component.
pub const USER_AGENT: &str = concat!("addon-agent/", env!("CARGO_PKG_VERSION"));
