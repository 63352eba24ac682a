//! Every reconcile of every controller here is a span (`reconcile`, see
//! [`cluster_proxy_runtime::telemetry::reconcile_span`]) that names the
//! object and, on failure, carries the error.

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;

use cluster_proxy_runtime::telemetry::{in_reconcile_span, reconcile_span};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

/// Runs `reconcile` for `object` inside its reconcile span.
pub async fn traced<K, C, E, Fut>(
    controller: &'static str,
    object: Arc<K>,
    context: Arc<C>,
    reconcile: impl FnOnce(Arc<K>, Arc<C>) -> Fut,
) -> Result<Action, E>
where
    K: Resource<DynamicType = ()>,
    Fut: Future<Output = Result<Action, E>>,
    E: Display,
{
    let span = reconcile_span(
        controller,
        &K::kind(&()),
        &object.name_any(),
        object.namespace().as_deref(),
    );
    in_reconcile_span(span, reconcile(object, context)).await
}
