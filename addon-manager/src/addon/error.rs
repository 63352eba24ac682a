//! The addon controllers' error, and how long to wait after one.

use std::time::Duration;

use kube::runtime::controller::Action;

use super::metrics::AddonMetrics;
use crate::apply::ApplyError;

/// Errors that make a reconcile retry (with backoff). Bad input is not an
/// error here: it becomes a `False` condition.
#[derive(Debug, thiserror::Error)]
pub enum AddonError {
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("{action}: {source}")]
    Api {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error("rendering the agent manifests: {0}")]
    Render(#[from] cluster_proxy_proto::api::work::v1::ManifestError),
    #[error("object has no {0}")]
    Incomplete(&'static str),
    #[error("the controllers' caches are closed (shutting down)")]
    CacheClosed,
}

impl AddonError {
    pub(crate) fn api(action: impl Into<String>) -> impl FnOnce(kube::Error) -> AddonError {
        let action = action.into();
        move |source| AddonError::Api { action, source }
    }

    /// Whether the API answered 409 (stale data: retry at once).
    pub fn is_conflict(&self) -> bool {
        let error = match self {
            AddonError::Apply(apply) => apply.api_error(),
            AddonError::Api { source, .. } => Some(source),
            _ => None,
        };
        error.is_some_and(crate::apply::is_conflict)
    }
}

/// How long to wait before retrying after an error: at once for a
/// conflict (someone else wrote; re-read and try again), else a short
/// backoff that keeps a broken API from being hammered.
pub(crate) fn retry_after(error: &AddonError) -> Duration {
    if error.is_conflict() {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(5)
    }
}

/// What every addon controller does after a failed reconcile of `object`:
/// counts it against `controller`, says what failed, and retries after
/// [`retry_after`].
pub(crate) fn requeue_failed(
    metrics: &AddonMetrics,
    controller: &'static str,
    object: &str,
    error: &AddonError,
) -> Action {
    metrics.failed(controller);
    tracing::warn!(controller, object, %error, "reconcile failed; retrying");
    Action::requeue(retry_after(error))
}
