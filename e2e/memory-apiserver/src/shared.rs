//! What every request handler shares: the store, the credentials the API
//! knows, paginated lists' snapshots and the pods' network; and who a
//! request is from (authentication, impersonation) and whether it may
//! (authorization).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::watch;

use super::error::ApiError;
use super::pods::PodNetwork;
use super::rbac;
use super::store::{Store, User};

pub type Body = BoxBody<Bytes, Infallible>;

/// The group every authenticated requester belongs to.
const AUTHENTICATED: &str = "system:authenticated";

pub struct Shared {
    pub store: Arc<Store>,
    pub tokens: Mutex<HashMap<String, User>>,
    /// Tokens bound to a ServiceAccount (TokenRequest): token → the
    /// account's namespace, name and uid. Such a token authenticates only
    /// while that very account exists, as kube-apiserver's bound tokens.
    pub bound_tokens: Mutex<HashMap<String, BoundAccount>>,
    /// Paginated lists' snapshots, newest last.
    pub snapshots: Mutex<std::collections::VecDeque<Snapshot>>,
    pub bookmark_interval: Duration,
    /// Requests are authorized by RBAC.
    pub rbac: bool,
    /// Every authorization decision, when the API keeps them.
    pub requests: Option<Mutex<Vec<rbac::RequestRecord>>>,
    pub shutdown: watch::Receiver<bool>,
    /// Where the kubelet stand-in's pods listen (`pods/portforward`).
    pub pods: PodNetwork,
    /// TokenReviews answered: what a caching authenticator saves.
    pub token_reviews: AtomicU64,
    /// SubjectAccessReviews answered (likewise for a caching authorizer).
    pub subject_access_reviews: AtomicU64,
}

/// The ServiceAccount a bound token belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundAccount {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The user a connection's verified client certificate names.
#[derive(Debug, Clone)]
pub struct CertificateUser(pub User);

impl Shared {
    pub(crate) fn authenticate(&self, request: &Request<Incoming>) -> Result<User, ApiError> {
        let token = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        // A bearer token decides when one is sent; a verified client
        // certificate otherwise.
        let mut user = match token {
            Some(token) => self.user_of_token(token),
            None => request
                .extensions()
                .get::<CertificateUser>()
                .map(|c| c.0.clone()),
        }
        .ok_or_else(|| ApiError::new(401, "Unauthorized", "Unauthorized"))?;
        // As the real server: whoever authenticates is also in this group.
        if !user.groups.iter().any(|g| g == AUTHENTICATED) {
            user.groups.push(AUTHENTICATED.to_string());
        }
        self.impersonate(request, user)
    }

    /// Who `token` authenticates as, if anyone: a bound token only while
    /// its ServiceAccount exists (kube-apiserver: "service account ... has
    /// been deleted", or re-created with another uid).
    pub(crate) fn user_of_token(&self, token: &str) -> Option<User> {
        let bound = self
            .bound_tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token)
            .cloned();
        if let Some(account) = bound
            && !self.account_exists(&account)
        {
            return None;
        }
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token)
            .cloned()
    }

    fn account_exists(&self, account: &BoundAccount) -> bool {
        let Some(t) = self.store.resource_type("", "v1", "serviceaccounts") else {
            return false;
        };
        self.store
            .get(&t, Some(&account.namespace), &account.name)
            .is_ok_and(|sa| {
                sa.pointer("/metadata/uid").and_then(Value::as_str) == Some(account.uid.as_str())
            })
    }

    /// Issues a token bound to ServiceAccount `name` in `namespace` (as
    /// TokenRequest does), or `None` when the account does not exist.
    pub fn bound_token(&self, namespace: &str, name: &str) -> Option<String> {
        let t = self.store.resource_type("", "v1", "serviceaccounts")?;
        let account = self.store.get(&t, Some(namespace), name).ok()?;
        let uid = account
            .pointer("/metadata/uid")
            .and_then(Value::as_str)?
            .to_owned();
        let token = format!(
            "{:032x}{:032x}",
            rand::random::<u128>(),
            rand::random::<u128>()
        );
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                token.clone(),
                User {
                    name: format!("system:serviceaccount:{namespace}:{name}"),
                    uid: uid.clone(),
                    groups: vec![
                        "system:serviceaccounts".to_owned(),
                        format!("system:serviceaccounts:{namespace}"),
                    ],
                },
            );
        self.bound_tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                token.clone(),
                BoundAccount {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    uid,
                },
            );
        Some(token)
    }

    /// Whether `user` may do this (always, without RBAC).
    pub(crate) fn allowed(&self, user: &User, attributes: &rbac::Attributes) -> bool {
        !self.rbac || rbac::allowed(&self.store, user, attributes)
    }

    pub(crate) fn authorize(
        &self,
        user: &User,
        attributes: &rbac::Attributes,
    ) -> Result<(), ApiError> {
        self.check(user, attributes, false)
    }

    /// Authorizes a request that was authorized once already as something
    /// else (an apply that creates: `patch`, then `create`).
    pub(crate) fn authorize_further(
        &self,
        user: &User,
        attributes: &rbac::Attributes,
    ) -> Result<(), ApiError> {
        self.check(user, attributes, true)
    }

    fn check(
        &self,
        user: &User,
        attributes: &rbac::Attributes,
        further_check: bool,
    ) -> Result<(), ApiError> {
        let allowed = self.allowed(user, attributes);
        if let Some(requests) = &self.requests {
            requests
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(rbac::RequestRecord {
                    further_check,
                    ..rbac::RequestRecord::new(user, attributes, allowed)
                });
        }
        if allowed {
            Ok(())
        } else {
            Err(rbac::forbidden(user, attributes))
        }
    }

    /// The user a request acts as: the authenticated one, or the one its
    /// `Impersonate-User`/`Impersonate-Group` headers name when it may
    /// impersonate them.
    fn impersonate(&self, request: &Request<Incoming>, user: User) -> Result<User, ApiError> {
        let header_values = |name: &str| -> Vec<String> {
            request
                .headers()
                .get_all(name)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .map(str::to_string)
                .collect()
        };
        let Some(target) = header_values("impersonate-user").into_iter().next() else {
            if header_values("impersonate-group").is_empty() {
                return Ok(user);
            }
            return Err(ApiError::new(
                500,
                "InternalError",
                "Internal error occurred: requested [{Kind: Group}] without impersonating a user",
            ));
        };
        let check = |resource: &str, name: &str| {
            self.authorize(
                &user,
                &rbac::Attributes::Resource {
                    verb: "impersonate".into(),
                    group: String::new(),
                    resource: resource.into(),
                    namespace: None,
                    name: Some(name.to_string()),
                },
            )
        };
        check("users", &target)?;
        let mut groups = header_values("impersonate-group");
        for group in &groups {
            check("groups", group)?;
        }
        if !groups.iter().any(|g| g == AUTHENTICATED) {
            groups.push(AUTHENTICATED.to_string());
        }
        Ok(User {
            name: target,
            uid: header_values("impersonate-uid")
                .into_iter()
                .next()
                .unwrap_or_default(),
            groups,
        })
    }
}

/// The full result of a paginated list, kept so that its later pages read
/// the same state (as the real server reads them at the first page's
/// resourceVersion).
pub struct Snapshot {
    /// Type, namespace and selectors of the list.
    pub(crate) key: String,
    pub(crate) resource_version: u64,
    pub(crate) items: Arc<Vec<Value>>,
}
