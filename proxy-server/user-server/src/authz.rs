//! Whether a hub user may reach a cluster: a SubjectAccessReview for `get`
//! on `managedclusters/proxy` (group `cluster.open-cluster-management.io`)
//! named after the cluster, so a hub admin grants per-cluster access with an
//! ordinary (Cluster)Role and binding:
//!
//! ```yaml
//! rules:
//! - apiGroups: ["cluster.open-cluster-management.io"]
//!   resources: ["managedclusters/proxy"]
//!   resourceNames: ["cluster-a"]
//!   verbs: ["get"]
//! ```
//!
//! Decisions are cached briefly (a revoked grant takes effect within the
//! TTL), concurrent identical questions share one review.

use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};

use crate::authn::User;
use crate::cache::{self, ReviewCache};

pub const GROUP: &str = "cluster.open-cluster-management.io";
pub const RESOURCE: &str = "managedclusters";
pub const SUBRESOURCE: &str = "proxy";
pub const VERB: &str = "get";

#[derive(Debug, Clone, thiserror::Error)]
pub enum AuthzError {
    #[error(
        "user {user:?} may not reach cluster {cluster:?}: it needs {VERB} on {RESOURCE}/{SUBRESOURCE} ({GROUP}) named {cluster:?} on the hub"
    )]
    Denied { user: String, cluster: String },
    #[error("the hub's SubjectAccessReview failed: {0}")]
    Review(String),
}

type Decision = Result<(), AuthzError>;

/// Hub SubjectAccessReviews, cached.
pub struct Authorizer {
    reviews: Api<SubjectAccessReview>,
    ttl: Duration,
    cache: ReviewCache<Decision>,
}

impl Authorizer {
    pub fn new(client: Client, ttl: Duration, capacity: usize) -> Self {
        Authorizer {
            reviews: Api::all(client),
            ttl,
            cache: ReviewCache::new(capacity),
        }
    }

    /// Whether `user` may reach `cluster`.
    pub async fn check(&self, user: &User, cluster: &str) -> Decision {
        let key = cache::key(
            [user.name.as_str(), user.uid.as_str(), cluster]
                .into_iter()
                .chain(user.groups.iter().map(String::as_str)),
        );
        let ttl = |decision: &Decision| match decision {
            Err(AuthzError::Review(_)) => Duration::ZERO,
            _ => self.ttl,
        };
        self.cache
            .get(key, ttl, || self.review(user, cluster))
            .await
    }

    async fn review(&self, user: &User, cluster: &str) -> Decision {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
                groups: Some(user.groups.clone()),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(GROUP.into()),
                    resource: Some(RESOURCE.into()),
                    subresource: Some(SUBRESOURCE.into()),
                    verb: Some(VERB.into()),
                    name: Some(cluster.into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = self
            .reviews
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthzError::Review(e.to_string()))?;
        if answer.status.is_some_and(|s| s.allowed) {
            Ok(())
        } else {
            Err(AuthzError::Denied {
                user: user.name.clone(),
                cluster: cluster.to_owned(),
            })
        }
    }
}
