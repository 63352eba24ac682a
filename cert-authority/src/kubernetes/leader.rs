//! Leader election on the `cluster-proxy-cert-authority` Lease; the
//! mechanism is shared by every control-plane service and lives in
//! [`cluster_proxy_control::leader`].

pub use cluster_proxy_control::leader::{
    Elector, LeaderElection, LeaderError, LeaseAction, lease_action,
};

use super::common::KubeError;

impl From<LeaderError> for KubeError {
    fn from(error: LeaderError) -> Self {
        match error {
            LeaderError::Api(error) => KubeError::Api(error),
            // Stopped comes only from `lead_in_turns`, which this backend does not use.
            other @ (LeaderError::Timing { .. } | LeaderError::Stopped) => {
                KubeError::Config(other.to_string())
            }
        }
    }
}
