//! The review APIs: who a token belongs to (TokenReview), who the requester
//! is (SelfSubjectReview), and whether someone may do something
//! (SubjectAccessReview, SelfSubjectAccessReview). None of them stores
//! anything; each answers from the credentials and RBAC the API holds, and
//! each needs `create` on its own resource, as on the real server (a
//! delegating authenticator needs `system:auth-delegator`).

use std::sync::atomic::Ordering;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};

use super::body::{json_response, media_type, read_json};
use super::error::ApiError;
use super::rbac;
use super::shared::{Body, Shared};
use super::store::User;

const AUTHENTICATION: &str = "authentication.k8s.io";
const AUTHORIZATION: &str = "authorization.k8s.io";

/// The review resources this API serves, by group: (plural, kind).
pub(crate) const RESOURCES: &[(&str, &str, &str)] = &[
    (AUTHENTICATION, "selfsubjectreviews", "SelfSubjectReview"),
    (AUTHENTICATION, "tokenreviews", "TokenReview"),
    (
        AUTHORIZATION,
        "selfsubjectaccessreviews",
        "SelfSubjectAccessReview",
    ),
    (AUTHORIZATION, "subjectaccessreviews", "SubjectAccessReview"),
];

/// The discovery document of one review group (`/apis/<group>/v1`).
pub(crate) fn resource_list(group: &str) -> Value {
    let resources: Vec<Value> = RESOURCES
        .iter()
        .filter(|(g, _, _)| *g == group)
        .map(|(_, plural, kind)| {
            json!({"name": plural, "singularName": plural.trim_end_matches('s'),
                   "namespaced": false, "kind": kind, "verbs": ["create"]})
        })
        .collect();
    json!({"kind": "APIResourceList", "apiVersion": "v1",
           "groupVersion": format!("{group}/v1"), "resources": resources})
}

/// `create` on a review resource: what every review needs first.
fn authorize_create(
    shared: &Shared,
    user: &User,
    group: &str,
    resource: &str,
) -> Result<(), ApiError> {
    shared.authorize(
        user,
        &rbac::Attributes::Resource {
            verb: "create".into(),
            group: group.into(),
            resource: resource.into(),
            namespace: None,
            name: None,
        },
    )
}

/// An answer: the review as asked, with its status.
fn answered(mut review: Value, group: &str, kind: &str, status: Value) -> Response<Body> {
    review["apiVersion"] = json!(format!("{group}/v1"));
    review["kind"] = json!(kind);
    review["status"] = status;
    json_response(StatusCode::CREATED, &review)
}

pub(crate) async fn self_subject_access_review(
    shared: &Shared,
    user: &User,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    authorize_create(shared, user, AUTHORIZATION, "selfsubjectaccessreviews")?;
    let content_type = media_type(&request);
    let review = read_json(request, &content_type).await?;
    let attributes = access_review_attributes(&review, "SelfSubjectAccessReview")?;
    let allowed = shared.allowed(user, &attributes);
    Ok(answered(
        review,
        AUTHORIZATION,
        "SelfSubjectAccessReview",
        json!({"allowed": allowed}),
    ))
}

/// Whether `spec.user` (with `spec.groups`) may do what the review names:
/// how a delegating authorizer (an aggregated API, a proxy) asks RBAC.
pub(crate) async fn subject_access_review(
    shared: &Shared,
    user: &User,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    authorize_create(shared, user, AUTHORIZATION, "subjectaccessreviews")?;
    let content_type = media_type(&request);
    let review = read_json(request, &content_type).await?;
    let text = |pointer: &str| {
        review
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let subject = User {
        name: text("/spec/user"),
        uid: text("/spec/uid"),
        groups: review
            .pointer("/spec/groups")
            .and_then(Value::as_array)
            .map(|groups| {
                groups
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
    };
    if subject.name.is_empty() && subject.groups.is_empty() {
        return Err(ApiError::invalid(
            "SubjectAccessReview.authorization.k8s.io \"\" is invalid: spec.user: Invalid value: \"\": at least one of user or group must be specified",
        ));
    }
    let attributes = access_review_attributes(&review, "SubjectAccessReview")?;
    shared
        .subject_access_reviews
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let allowed = shared.allowed(&subject, &attributes);
    let status = if allowed {
        json!({"allowed": true, "reason": "RBAC: allowed"})
    } else {
        json!({"allowed": false})
    };
    Ok(answered(
        review,
        AUTHORIZATION,
        "SubjectAccessReview",
        status,
    ))
}

/// Who `spec.token` belongs to. An unknown token is not an error but an
/// unauthenticated answer, with the real server's error text (clients such
/// as upstream's service-proxy match on "invalid bearer token").
pub(crate) async fn token_review(
    shared: &Shared,
    user: &User,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    authorize_create(shared, user, AUTHENTICATION, "tokenreviews")?;
    shared.token_reviews.fetch_add(1, Ordering::Relaxed);
    let content_type = media_type(&request);
    let review = read_json(request, &content_type).await?;
    let Some(token) = review
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    else {
        return Err(ApiError::invalid(
            "TokenReview.authentication.k8s.io \"\" is invalid: spec.token: Required value",
        ));
    };
    let audiences = review
        .pointer("/spec/audiences")
        .cloned()
        .unwrap_or(json!([]));
    let status = match shared.user_of_token(token) {
        Some(reviewed) => json!({
            "authenticated": true,
            "user": {"username": reviewed.name, "uid": reviewed.uid, "groups": reviewed.groups},
            "audiences": audiences,
        }),
        None => json!({"user": {}, "error": "[invalid bearer token, token lookup failed]"}),
    };
    Ok(answered(review, AUTHENTICATION, "TokenReview", status))
}

/// `kubectl auth whoami`: who the server takes the requester for.
pub(crate) fn self_subject_review(
    shared: &Shared,
    user: &User,
) -> Result<Response<Body>, ApiError> {
    authorize_create(shared, user, AUTHENTICATION, "selfsubjectreviews")?;
    Ok(json_response(
        StatusCode::CREATED,
        &json!({"kind": "SelfSubjectReview", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"creationTimestamp": null},
                "status": {"userInfo": {"username": user.name, "uid": user.uid, "groups": user.groups}}}),
    ))
}

/// What an access review asks about.
fn access_review_attributes(review: &Value, kind: &str) -> Result<rbac::Attributes, ApiError> {
    let text = |pointer: &str| {
        review
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    if review.pointer("/spec/resourceAttributes").is_some() {
        let resource = text("/spec/resourceAttributes/resource");
        let subresource = text("/spec/resourceAttributes/subresource");
        let optional = |v: String| (!v.is_empty()).then_some(v);
        return Ok(rbac::Attributes::Resource {
            verb: text("/spec/resourceAttributes/verb"),
            group: text("/spec/resourceAttributes/group"),
            resource: if subresource.is_empty() {
                resource
            } else {
                format!("{resource}/{subresource}")
            },
            namespace: optional(text("/spec/resourceAttributes/namespace")),
            name: optional(text("/spec/resourceAttributes/name")),
        });
    }
    if review.pointer("/spec/nonResourceAttributes").is_some() {
        return Ok(rbac::Attributes::Path {
            verb: text("/spec/nonResourceAttributes/verb"),
            path: text("/spec/nonResourceAttributes/path"),
        });
    }
    Err(ApiError::invalid(format!(
        "{kind}.authorization.k8s.io \"\" is invalid: spec.resourceAttributes: Invalid value: \"null\": exactly one of nonResourceAttributes or resourceAttributes must be specified"
    )))
}
