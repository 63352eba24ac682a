//! Who a request is from: a bearer token the hub's TokenReview accepts, or
//! a client certificate of the hub's client CA (`CN` the user, each `O` a
//! group, as kube-apiserver reads them).
//!
//! TokenReview answers are cached: a user's requests cost the hub one
//! review per [`Authenticator`] TTL, not one per request (upstream's
//! service-proxy reviewed every request until its 10 s cache, and a burst
//! of kubectl calls waited on the hub's rate limit). Concurrent requests
//! with the same uncached token share one review ([`crate::cache`]). Only
//! the token's SHA-256 is kept.

use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;

use crate::cache::{self, ReviewCache};

/// An authenticated hub user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum AuthnError {
    #[error("no credentials: send a bearer token or a client certificate")]
    NoCredentials,
    #[error("the token is not valid on the hub{0}")]
    Rejected(String),
    #[error("the hub's TokenReview failed: {0}")]
    Review(String),
    #[error("the OIDC issuer could not be asked: {0}")]
    Issuer(String),
}

type Answer = Result<User, AuthnError>;

/// Hub TokenReviews, cached.
pub struct Authenticator {
    reviews: Api<TokenReview>,
    ttl: Duration,
    /// How long a refusal is remembered: short, so a token that becomes
    /// valid (just created) is not refused for long, but a client retrying
    /// a bad token in a loop does not cost the hub a review each time.
    negative_ttl: Duration,
    cache: ReviewCache<Answer>,
    /// Reviews sent to the hub.
    sent: Counter,
}

impl Authenticator {
    pub fn new(client: Client, ttl: Duration, capacity: usize, sent: Counter) -> Self {
        Authenticator {
            reviews: Api::all(client),
            ttl,
            negative_ttl: ttl.min(Duration::from_secs(5)),
            cache: ReviewCache::new(capacity),
            sent,
        }
    }

    /// The user `token` belongs to.
    pub async fn token(&self, token: &str) -> Answer {
        let ttl = |answer: &Answer| match answer {
            Ok(_) => self.ttl,
            // The hub unreachable: not kept at all.
            Err(AuthnError::Review(_) | AuthnError::Issuer(_)) => Duration::ZERO,
            Err(_) => self.negative_ttl,
        };
        self.cache
            .get(cache::key([token]), ttl, || self.review(token))
            .await
    }

    /// How many answers are cached (for tests and metrics).
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    async fn review(&self, token: &str) -> Answer {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.sent.inc();
        let answer = self
            .reviews
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthnError::Review(e.to_string()))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let why = status
                .error
                .filter(|e| !e.is_empty())
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            return Err(AuthnError::Rejected(why));
        }
        let user = status.user.unwrap_or_default();
        let name = user.username.unwrap_or_default();
        if name.is_empty() {
            return Err(AuthnError::Rejected(": the review names no user".into()));
        }
        Ok(User {
            name,
            uid: user.uid.unwrap_or_default(),
            groups: user.groups.unwrap_or_default(),
        })
    }
}

/// The user a verified client certificate names, as kube-apiserver reads
/// it: the subject's common name, its organizations as groups.
pub fn certificate_user(der: &[u8]) -> Result<User, AuthnError> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| AuthnError::Rejected(format!(": the client certificate: {e}")))?;
    let subject = cert.subject();
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| AuthnError::Rejected(": the client certificate has no common name".into()))?
        .to_owned();
    let mut groups: Vec<String> = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok())
        .map(str::to_owned)
        .collect();
    // As kube-apiserver: whoever authenticates is in this group.
    groups.push("system:authenticated".to_owned());
    Ok(User {
        name,
        uid: String::new(),
        groups,
    })
}
