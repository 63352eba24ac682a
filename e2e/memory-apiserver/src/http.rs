//! The REST protocol: discovery, the resource paths and their verbs, watch
//! streams, and errors as `meta/v1 Status`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use super::exec::Connect;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, watch};

use super::error::ApiError;
use super::resources::ResourceType;
use super::selector::{FieldSelector, LabelSelector};
use super::shared::{Body, Shared, Snapshot};
use super::store::{
    DeleteOptions, Deleted, Event, EventType, Part, PatchKind, Propagation, Store, User,
    WriteOptions, as_version,
};
use super::{openapi, rbac, reviews, table};

use super::body::{json_response, media_type, read_bytes, read_json};

fn error_response(error: &ApiError) -> Response<Body> {
    let status = StatusCode::from_u16(error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &error.status())
}

pub async fn handle(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let response = match route(&shared, request).await {
        Ok(response) => response,
        Err(error) => error_response(&error),
    };
    Ok(response)
}

struct Query(HashMap<String, String>);

impl Query {
    fn parse(query: Option<&str>) -> Self {
        Query(
            form_urlencoded::parse(query.unwrap_or_default().as_bytes())
                .into_owned()
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }

    fn number(&self, key: &str) -> Result<Option<u64>, ApiError> {
        self.get(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| ApiError::bad_request(format!("{key}: {v:?} is not a number")))
            })
            .transpose()
    }
}

/// What a resource path names.
struct Target {
    resource: ResourceType,
    namespace: Option<String>,
    name: Option<String>,
    part: Part,
}

/// Serves one request: health, then (authenticated) discovery, the
/// endpoints that are not stored objects, and the resources.
async fn route(shared: &Shared, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let path = request.uri().path().to_string();
    // Health endpoints answer anyone, as the real server's
    // system:public-info-viewer role allows.
    if matches!(path.as_str(), "/healthz" | "/readyz" | "/livez") {
        return Ok(health_response());
    }
    let user = shared.authenticate(&request)?;
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    if is_discovery(&segments, request.method()) {
        shared.authorize(
            &user,
            &rbac::Attributes::Path {
                verb: "get".into(),
                path: path.clone(),
            },
        )?;
    }
    if let Some(answer) = discovery(shared, &segments, &path) {
        return answer;
    }
    if let Some(endpoint) = Endpoint::of(&segments, request.method()) {
        return endpoint.serve(shared, &user, request).await;
    }
    let (target, sub) = resource_target(shared, &segments, &path)?;
    serve_resource(shared, &user, target, sub, request).await
}

fn health_response() -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from_static(b"ok")).boxed());
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Paths every authenticated user may read through the
/// `system:discovery` role, authorized as non-resource `get`s.
fn is_discovery(segments: &[&str], method: &Method) -> bool {
    match segments {
        ["version"] | ["api"] | ["apis"] | ["apis", _] | ["openapi", ..] => true,
        ["api", _] | ["apis", _, _] => method == Method::GET,
        _ => false,
    }
}

fn not_found_path(path: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("the server could not find the requested resource ({path})"),
    )
}

/// The discovery documents: `/version`, OpenAPI v3, the group and version
/// lists; `None` for any other path.
fn discovery(
    shared: &Shared,
    segments: &[&str],
    path: &str,
) -> Option<Result<Response<Body>, ApiError>> {
    let answer = match segments {
        ["version"] => Ok(json_response(
            StatusCode::OK,
            &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-cluster-proxy-e2e",
                    "platform": "linux/amd64", "goVersion": "n/a", "compiler": "n/a",
                    "buildDate": "2026-01-01T00:00:00Z", "gitCommit": "", "gitTreeState": "clean"}),
        )),
        ["openapi", "v3"] => Ok(json_response(
            StatusCode::OK,
            &openapi::root(&shared.store.registry()),
        )),
        ["openapi", "v3", "api", version] | ["openapi", "v3", "apis", "", version] => {
            openapi_document(shared, "", version, path)
        }
        ["openapi", "v3", "apis", group, version] => openapi_document(shared, group, version, path),
        ["api"] => Ok(json_response(
            StatusCode::OK,
            &json!({"kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": []}),
        )),
        ["apis"] => Ok(group_list(shared)),
        ["apis", group] => api_group(shared, group, path),
        [
            "apis",
            group @ ("authorization.k8s.io" | "authentication.k8s.io"),
            "v1",
        ] => Ok(json_response(
            StatusCode::OK,
            &reviews::resource_list(group),
        )),
        ["api", version] => resource_list(shared, "", version),
        ["apis", group, version] => resource_list(shared, group, version),
        _ => return None,
    };
    Some(answer)
}

/// `/apis`: every group with stored kinds, and the review APIs.
fn group_list(shared: &Shared) -> Response<Body> {
    let mut groups: Vec<Value> = shared
        .store
        .registry()
        .groups()
        .into_iter()
        .filter(|(g, _)| !g.is_empty())
        .map(|(group, versions)| {
            let versions: Vec<Value> = versions
                .iter()
                .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
                .collect();
            let preferred = versions.first().cloned().unwrap_or(json!({}));
            json!({"name": group, "versions": versions, "preferredVersion": preferred})
        })
        .collect();
    // The review APIs, which have no stored objects.
    for group in ["authentication.k8s.io", "authorization.k8s.io"] {
        let version = json!({"groupVersion": format!("{group}/v1"), "version": "v1"});
        groups.push(json!({"name": group, "versions": [version], "preferredVersion": version}));
    }
    json_response(
        StatusCode::OK,
        &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}),
    )
}

/// `/apis/<group>`.
fn api_group(shared: &Shared, group: &str, path: &str) -> Result<Response<Body>, ApiError> {
    let versions = shared
        .store
        .registry()
        .groups()
        .remove(group)
        .filter(|_| !group.is_empty())
        .ok_or_else(|| not_found_path(path))?;
    let versions: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({"kind": "APIGroup", "apiVersion": "v1", "name": group,
                "versions": versions, "preferredVersion": versions[0]}),
    ))
}

/// The endpoints that are not stored objects and read the request body or
/// stream: TokenRequest, the self reviews, pod port-forwarding, exec,
/// attach and logs.
enum Endpoint {
    Token { namespace: String, name: String },
    SelfSubjectAccessReview,
    SelfSubjectReview,
    SubjectAccessReview,
    TokenReview,
    PortForward { namespace: String, name: String },
    Exec { namespace: String, name: String },
    Attach { namespace: String, name: String },
    Log { namespace: String, name: String },
}

impl Endpoint {
    fn of(segments: &[&str], method: &Method) -> Option<Self> {
        let post = method == Method::POST;
        match segments {
            [
                "api",
                "v1",
                "namespaces",
                namespace,
                "serviceaccounts",
                name,
                "token",
            ] if post => Some(Endpoint::Token {
                namespace: (*namespace).to_owned(),
                name: (*name).to_owned(),
            }),
            [
                "apis",
                "authorization.k8s.io",
                "v1",
                "selfsubjectaccessreviews",
            ] if post => Some(Endpoint::SelfSubjectAccessReview),
            ["apis", "authentication.k8s.io", "v1", "selfsubjectreviews"] if post => {
                Some(Endpoint::SelfSubjectReview)
            }
            ["apis", "authorization.k8s.io", "v1", "subjectaccessreviews"] if post => {
                Some(Endpoint::SubjectAccessReview)
            }
            ["apis", "authentication.k8s.io", "v1", "tokenreviews"] if post => {
                Some(Endpoint::TokenReview)
            }
            [
                "api",
                "v1",
                "namespaces",
                namespace,
                "pods",
                name,
                "portforward",
            ] => Some(Endpoint::PortForward {
                namespace: (*namespace).to_owned(),
                name: (*name).to_owned(),
            }),
            ["api", "v1", "namespaces", namespace, "pods", name, "exec"] => Some(Endpoint::Exec {
                namespace: (*namespace).to_owned(),
                name: (*name).to_owned(),
            }),
            ["api", "v1", "namespaces", namespace, "pods", name, "attach"] => {
                Some(Endpoint::Attach {
                    namespace: (*namespace).to_owned(),
                    name: (*name).to_owned(),
                })
            }
            ["api", "v1", "namespaces", namespace, "pods", name, "log"] => Some(Endpoint::Log {
                namespace: (*namespace).to_owned(),
                name: (*name).to_owned(),
            }),
            _ => None,
        }
    }

    async fn serve(
        self,
        shared: &Shared,
        user: &User,
        request: Request<Incoming>,
    ) -> Result<Response<Body>, ApiError> {
        match self {
            Endpoint::Token { namespace, name } => {
                token_request(shared, user, &namespace, &name, request).await
            }
            Endpoint::SelfSubjectAccessReview => {
                reviews::self_subject_access_review(shared, user, request).await
            }
            Endpoint::SelfSubjectReview => reviews::self_subject_review(shared, user),
            Endpoint::SubjectAccessReview => {
                reviews::subject_access_review(shared, user, request).await
            }
            Endpoint::TokenReview => reviews::token_review(shared, user, request).await,
            Endpoint::PortForward { namespace, name } => {
                super::portforward::serve(shared, user, request, &namespace, &name).await
            }
            Endpoint::Exec { namespace, name } => {
                super::exec::serve(shared, user, request, &namespace, &name, Connect::Exec).await
            }
            Endpoint::Attach { namespace, name } => {
                super::exec::serve(shared, user, request, &namespace, &name, Connect::Attach).await
            }
            Endpoint::Log { namespace, name } => {
                super::log::serve(shared, user, request, &namespace, &name).await
            }
        }
    }
}

/// The resource a path names (`/api/v1/namespaces/ns/pods/name/status`),
/// with its subresource.
fn resource_target<'p>(
    shared: &Shared,
    segments: &[&'p str],
    path: &str,
) -> Result<(Target, Option<&'p str>), ApiError> {
    let (group, version, rest) = match segments {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => {
            return Err(not_found_path(path));
        }
    };
    let (namespace, rest): (Option<String>, &[&str]) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if !(tail.is_empty() && matches!(*plural, "status" | "finalize")) =>
        {
            (Some((*ns).to_string()), &rest[2..])
        }
        _ => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some((*name).to_string()), None),
        [plural, name, sub] => (*plural, Some((*name).to_string()), Some(*sub)),
        _ => {
            return Err(not_found_path(path));
        }
    };
    let resource = shared
        .store
        .resource_type(group, version, plural)
        .ok_or_else(|| not_found_path(path))?;
    if namespace.is_some() && !resource.namespaced {
        return Err(ApiError::new(
            404,
            "NotFound",
            format!("{plural} is not namespaced"),
        ));
    }
    let part = match sub {
        None => Part::Main,
        Some("status") if resource.status => Part::Status,
        Some("approval") if resource.approval => Part::Approval,
        Some(other) => {
            return Err(ApiError::new(
                404,
                "NotFound",
                format!("{plural} has no subresource {other:?}"),
            ));
        }
    };
    let target = Target {
        resource,
        namespace,
        name,
        part,
    };
    Ok((target, sub))
}

/// A request for a resource, authorized for its verb, served by the store.
async fn serve_resource(
    shared: &Shared,
    user: &User,
    target: Target,
    sub: Option<&str>,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let query = Query::parse(request.uri().query());
    let verb = rbac::verb(request.method(), target.name.is_some(), query.flag("watch"));
    // kube-apiserver authorizes a list or watch whose field selector pins
    // metadata.name as a request for that name (its RequestInfo does), so a
    // Role's resourceNames can admit it.
    let selected_name = match verb {
        "list" | "watch" => FieldSelector::parse(query.get("fieldSelector").unwrap_or_default())
            .ok()
            .and_then(|s| s.requires_exact_match("metadata.name").map(str::to_owned)),
        _ => None,
    };
    shared.authorize(
        user,
        &rbac::resource_attributes(
            &target.resource,
            verb,
            sub,
            target.namespace.as_deref(),
            target.name.as_deref().or(selected_name.as_deref()),
        ),
    )?;
    let options = WriteOptions {
        field_manager: query.get("fieldManager").map(str::to_string),
        dry_run: query.get("dryRun").is_some(),
        force: query.flag("force"),
        user_agent: request
            .headers()
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
    };
    let method = request.method().clone();
    let as_table = request
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(table::wanted);
    let content_type = media_type(&request);
    let store = &shared.store;
    let t = &target.resource;
    let ns = target.namespace.as_deref();
    match (method, target.name.as_deref()) {
        (Method::GET, Some(name)) => {
            let object = store.get(t, ns, name)?;
            if as_table {
                return Ok(json_response(
                    StatusCode::OK,
                    &table::render(t, std::slice::from_ref(&object), None),
                ));
            }
            Ok(json_response(StatusCode::OK, &object))
        }
        (Method::GET, None) if query.flag("watch") => watch_response(shared, &target, &query),
        (Method::GET, None) => list_response(shared, &target, &query, as_table),
        (Method::POST, None) => {
            if t.namespaced && ns.is_none() {
                return Err(ApiError::new(
                    405,
                    "MethodNotAllowed",
                    "create needs a namespace in the path",
                ));
            }
            let body = read_json(request, &content_type).await?;
            strict_fields(&query, t, &body, None)?;
            let body = openapi::without_undeclared(t, body);
            let created = store.create(t, ns, body, user, &options)?;
            Ok(json_response(StatusCode::CREATED, &created))
        }
        (Method::PUT, Some(name)) => {
            let body = read_json(request, &content_type).await?;
            strict_fields(&query, t, &body, None)?;
            let body = openapi::without_undeclared(t, body);
            signer_admission(shared, user, t, name, target.part, &body)?;
            let updated = store.update(t, ns, name, body, target.part, &options)?;
            Ok(json_response(StatusCode::OK, &updated))
        }
        (Method::PATCH, Some(name)) => {
            patch(shared, user, &target, name, &query, &options, request).await
        }
        (Method::DELETE, Some(name)) => {
            let delete_options = delete_options(request, &query).await?;
            let deleted = store.delete(t, ns, name, &delete_options)?;
            Ok(json_response(StatusCode::OK, &deleted_body(t, deleted)))
        }
        (Method::DELETE, None) => delete_collection(store, t, ns, &query, request).await,
        (method, _) => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported here"),
        )),
    }
}

/// PATCH in each of its four formats; an apply that creates the object is
/// authorized as `create` too.
async fn patch(
    shared: &Shared,
    user: &User,
    target: &Target,
    name: &str,
    query: &Query,
    options: &WriteOptions,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let store = &shared.store;
    let t = &target.resource;
    let ns = target.namespace.as_deref();
    let content_type = media_type(&request);
    let kind = match content_type.as_str() {
        "application/merge-patch+json" => PatchKind::Merge,
        // Custom objects have no strategy to merge with.
        "application/strategic-merge-patch+json" if !t.custom => PatchKind::StrategicMerge,
        "application/json-patch+json" => PatchKind::Json,
        "application/apply-patch+yaml" | "application/apply-patch+json" => PatchKind::Apply,
        _ => {
            let accepted = if t.custom {
                "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
            } else {
                "application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml"
            };
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                format!(
                    "the body of the request was in an unknown format - accepted media types include: {accepted}"
                ),
            ));
        }
    };
    let body = read_json(request, &content_type).await?;
    if kind != PatchKind::Json {
        let applied = (kind == PatchKind::Apply).then_some(name);
        strict_fields(query, t, &body, applied)?;
    }
    // Strategic merge patches carry `$` directives no schema declares.
    let body = if kind == PatchKind::Apply {
        openapi::without_undeclared(t, body)
    } else {
        body
    };
    signer_admission(shared, user, t, name, target.part, &body)?;
    // kube-apiserver's patch handler authorizes the request as
    // `patch`, and an apply that creates the object once more as
    // `create` (handlers/patch.go: `withAuthorization(createValidation,
    // …, createAuthorizerAttributes)`): a role with only `patch` can
    // change objects but not make them.
    if kind == PatchKind::Apply && target.part == Part::Main && store.get(t, ns, name).is_err() {
        shared.authorize_further(
            user,
            &rbac::resource_attributes(t, "create", None, ns, Some(name)),
        )?;
    }
    let patched = store.patch(t, ns, name, kind, body, target.part, user, options)?;
    let status = if patched.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(json_response(status, &patched.object))
}

/// DELETE of a collection: every object the selectors match, as a list of
/// what was deleted.
async fn delete_collection(
    store: &Store,
    t: &ResourceType,
    ns: Option<&str>,
    query: &Query,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let delete_options = delete_options(request, query).await?;
    let (labels, fields) = selectors(query, t)?;
    let page = store.list(t, ns, &labels, &fields, 0, None);
    let mut deleted = Vec::new();
    for item in page.items {
        let name = item
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let item_ns = item.pointer("/metadata/namespace").and_then(Value::as_str);
        match store.delete(t, item_ns, name, &delete_options) {
            Ok(Deleted::Gone(object) | Deleted::Pending(object)) => deleted.push(object),
            Err(_) => {}
        }
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({"kind": t.list_kind(), "apiVersion": t.api_version(),
                "metadata": {"resourceVersion": store.resource_version().to_string()}, "items": deleted}),
    ))
}

fn openapi_document(
    shared: &Shared,
    group: &str,
    version: &str,
    path: &str,
) -> Result<Response<Body>, ApiError> {
    let document =
        openapi::group_version(&shared.store.registry(), group, version).ok_or_else(|| {
            ApiError::new(
                404,
                "NotFound",
                format!("the server could not find the requested resource ({path})"),
            )
        })?;
    Ok(json_response(StatusCode::OK, &document))
}

/// `fieldValidation=Strict`: a field no schema declares is an error, not
/// silently dropped (`Warn`, the default, and `Ignore` keep the old way).
/// `apply` names the applied object: server-side apply
/// reports only the first undeclared field, in its typed-patch words.
fn strict_fields(
    query: &Query,
    t: &ResourceType,
    body: &Value,
    apply: Option<&str>,
) -> Result<(), ApiError> {
    if query.get("fieldValidation") != Some("Strict") {
        return Ok(());
    }
    let undeclared = openapi::undeclared_fields(t, body);
    if undeclared.is_empty() {
        return Ok(());
    }
    if let Some(name) = apply {
        // kube-apiserver answers 500 without a reason here, naming the
        // namespace the applied object itself gives.
        let namespace = body
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or_default();
        return Err(ApiError::new(
            500,
            "",
            format!(
                "failed to create typed patch object ({namespace}/{name}; {}/{}, Kind={}): .{}: field not declared in schema",
                t.group, t.version, t.kind, undeclared[0]
            ),
        ));
    }
    let message = {
        let fields: Vec<String> = undeclared
            .iter()
            .map(|f| format!("unknown field {f:?}"))
            .collect();
        format!(
            "{kind} in version {version:?} cannot be handled as a {kind}: strict decoding error: {}",
            fields.join(", "),
            kind = t.kind,
            version = t.version,
        )
    };
    Err(ApiError::bad_request(message))
}

/// The `DeleteOptions` of a DELETE: its body (as kube-rs and kubectl send
/// it) or the query.
async fn delete_options(
    request: Request<Incoming>,
    query: &Query,
) -> Result<DeleteOptions, ApiError> {
    let bytes = read_bytes(request).await?;
    let body: Value = if bytes.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?
    };
    let text = |pointer: &str| {
        body.pointer(pointer)
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let mut propagation =
        text("/propagationPolicy").or_else(|| query.get("propagationPolicy").map(str::to_string));
    // The deprecated form of the same choice.
    let orphan = body
        .get("orphanDependents")
        .and_then(Value::as_bool)
        .or_else(|| query.get("orphanDependents").map(|v| v == "true"));
    if propagation.is_none() {
        propagation = orphan.map(|o| if o { "Orphan" } else { "Background" }.to_string());
    }
    let propagation = propagation
        .map(|p| Propagation::parse(&p))
        .transpose()?
        .unwrap_or_default();
    let dry_run = query.get("dryRun").is_some()
        || body
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|d| !d.is_empty());
    Ok(DeleteOptions {
        propagation,
        precondition_uid: text("/preconditions/uid"),
        precondition_resource_version: text("/preconditions/resourceVersion"),
        dry_run,
    })
}

/// What a DELETE answers: the object while finalizers hold it; once gone,
/// the object for the types that return it, else a `Status`.
fn deleted_body(t: &ResourceType, deleted: Deleted) -> Value {
    match deleted {
        Deleted::Pending(object) => object,
        Deleted::Gone(object) => {
            let returns_object = t.group.is_empty()
                && matches!(t.plural.as_str(), "namespaces" | "pods" | "services");
            if returns_object {
                return object;
            }
            let text = |field: &str| {
                object
                    .pointer(&format!("/metadata/{field}"))
                    .cloned()
                    .unwrap_or(Value::Null)
            };
            let mut details = json!({"name": text("name"), "kind": t.plural, "uid": text("uid")});
            if !t.group.is_empty() {
                details["group"] = json!(t.group);
            }
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details})
        }
    }
}

/// The audience a TokenRequest gets when it names none (the real
/// server's `--api-audiences`, as clusters usually set it).
const DEFAULT_TOKEN_AUDIENCE: &str = "https://kubernetes.default.svc";

/// `POST .../serviceaccounts/<name>/token`: a token that authenticates as
/// the ServiceAccount (`system:serviceaccount:<ns>:<name>`, groups
/// `system:serviceaccounts` and `system:serviceaccounts:<ns>`), for
/// `expirationSeconds` (default 3600, at least 600). Tokens are opaque
/// here, not JWTs, and do not expire: clients treat them as opaque.
async fn token_request(
    shared: &Shared,
    user: &User,
    namespace: &str,
    name: &str,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    shared.authorize(
        user,
        &rbac::Attributes::Resource {
            verb: "create".into(),
            group: String::new(),
            resource: "serviceaccounts/token".into(),
            namespace: Some(namespace.to_owned()),
            name: Some(name.to_owned()),
        },
    )?;
    let accounts = shared
        .store
        .resource_type("", "v1", "serviceaccounts")
        .ok_or_else(|| ApiError::new(404, "NotFound", "serviceaccounts are not served"))?;
    // 404 for a missing account before the body is read, as the real one.
    shared.store.get(&accounts, Some(namespace), name)?;
    let content_type = media_type(&request);
    let asked = read_json(request, &content_type).await?;
    let seconds = match asked.pointer("/spec/expirationSeconds") {
        None | Some(Value::Null) => 3600,
        Some(value) => value.as_i64().ok_or_else(|| {
            ApiError::new(
                400,
                "BadRequest",
                format!("spec.expirationSeconds: {value} is not an integer"),
            )
        })?,
    };
    if seconds < 600 {
        return Err(ApiError::new(
            422,
            "Invalid",
            format!(
                "TokenRequest.authentication.k8s.io {name:?} is invalid: spec.expirationSeconds: Invalid value: {seconds}: may not specify a duration less than 10 minutes"
            ),
        ));
    }
    let audiences = match asked.pointer("/spec/audiences").and_then(Value::as_array) {
        Some(given) if !given.is_empty() => Value::Array(given.clone()),
        _ => json!([DEFAULT_TOKEN_AUDIENCE]),
    };
    let token = shared.bound_token(namespace, name).ok_or_else(|| {
        ApiError::new(
            404,
            "NotFound",
            format!("serviceaccounts {name:?} not found"),
        )
    })?;
    let expires = time::OffsetDateTime::now_utc()
        .replace_nanosecond(0)
        .unwrap_or_else(|_| time::OffsetDateTime::now_utc())
        + time::Duration::seconds(seconds);
    let expires = expires
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    Ok(json_response(
        StatusCode::CREATED,
        &json!({"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"name": name, "namespace": namespace, "creationTimestamp": null},
                "spec": {"audiences": audiences, "expirationSeconds": seconds, "boundObjectRef": null},
                "status": {"token": token, "expirationTimestamp": expires}}),
    ))
}

fn resource_list(shared: &Shared, group: &str, version: &str) -> Result<Response<Body>, ApiError> {
    let registry = shared.store.registry();
    let mut resources = Vec::new();
    for t in registry.in_group_version(group, version) {
        let mut verbs = vec![
            "create",
            "delete",
            "deletecollection",
            "get",
            "list",
            "patch",
            "update",
            "watch",
        ];
        verbs.sort_unstable();
        resources.push(
            json!({"name": t.plural, "singularName": t.singular, "namespaced": t.namespaced,
            "kind": t.kind, "verbs": verbs, "shortNames": t.short_names, "categories": t.categories}),
        );
        if t.status {
            resources.push(json!({"name": format!("{}/status", t.plural), "singularName": "", "namespaced": t.namespaced,
                "kind": t.kind, "verbs": ["get", "patch", "update"]}));
        }
        if t.approval {
            resources.push(json!({"name": format!("{}/approval", t.plural), "singularName": "", "namespaced": t.namespaced,
                "kind": t.kind, "verbs": ["get", "patch", "update"]}));
        }
        if group.is_empty() && t.plural == "serviceaccounts" {
            resources.push(json!({"name": "serviceaccounts/token", "singularName": "", "namespaced": true,
                "group": "authentication.k8s.io", "version": "v1", "kind": "TokenRequest", "verbs": ["create"]}));
        }
    }
    if resources.is_empty() {
        return Err(ApiError::new(
            404,
            "NotFound",
            format!("no resources in {group}/{version}"),
        ));
    }
    let group_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Ok(json_response(
        StatusCode::OK,
        &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}),
    ))
}

/// kube-apiserver's CertificateApproval and CertificateSigning admission:
/// approving a CSR needs `approve`, and writing its certificate `sign`, on
/// the `signers` resource named by the CSR's `signerName` (only the exact
/// name here; the real plugins also accept `<domain>/*`).
fn signer_admission(
    shared: &Shared,
    user: &User,
    t: &ResourceType,
    name: &str,
    part: Part,
    body: &Value,
) -> Result<(), ApiError> {
    const GROUP: &str = "certificates.k8s.io";
    if t.group != GROUP || t.plural != "certificatesigningrequests" {
        return Ok(());
    }
    let verb = match part {
        Part::Approval => "approve",
        Part::Status
            if body
                .pointer("/status/certificate")
                .and_then(Value::as_str)
                .is_some_and(|c| !c.is_empty()) =>
        {
            "sign"
        }
        _ => return Ok(()),
    };
    let existing = shared.store.get(t, None, name)?;
    let signer = existing
        .pointer("/spec/signerName")
        .and_then(Value::as_str)
        .unwrap_or_default();
    shared.authorize(
        user,
        &rbac::Attributes::Resource {
            verb: verb.into(),
            group: GROUP.into(),
            resource: "signers".into(),
            namespace: None,
            name: Some(signer.to_string()),
        },
    )
}

/// The fields a type can be selected by besides `metadata.name` and
/// `metadata.namespace` (what the real server's field label conversions
/// accept).
fn selectable_fields(t: &ResourceType) -> &'static [&'static str] {
    const EVENT: &[&str] = &[
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
        "regarding.kind",
        "regarding.namespace",
        "regarding.name",
        "regarding.uid",
        "regarding.apiVersion",
        "regarding.resourceVersion",
        "regarding.fieldPath",
        "reportingController",
    ];
    match (t.group.as_str(), t.plural.as_str()) {
        ("", "secrets") => &["type"],
        ("", "namespaces") => &["status.phase"],
        ("", "events") | ("events.k8s.io", "events") => EVENT,
        ("", "pods") => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.podIPs",
            "status.nominatedNodeName",
        ],
        ("certificates.k8s.io", "certificatesigningrequests") => &["spec.signerName"],
        _ => &[],
    }
}

fn selectors(query: &Query, t: &ResourceType) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let labels = LabelSelector::parse(query.get("labelSelector").unwrap_or_default())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let fields = FieldSelector::parse(query.get("fieldSelector").unwrap_or_default())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let allowed = selectable_fields(t);
    for field in fields.fields() {
        if matches!(field, "metadata.name" | "metadata.namespace") || allowed.contains(&field) {
            continue;
        }
        // Only types with a field label conversion of their own say "not
        // supported"; the rest answer in apimachinery's default words.
        let own_conversion = !t.custom
            && matches!(
                (t.group.as_str(), t.plural.as_str()),
                (
                    "",
                    "namespaces" | "pods" | "secrets" | "services" | "events"
                ) | ("events.k8s.io", "events")
                    | ("certificates.k8s.io", "certificatesigningrequests")
            );
        return Err(ApiError::bad_request(if !own_conversion {
            format!(
                "{field:?} is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
            )
        } else {
            format!("field label not supported: {field}")
        }));
    }
    Ok((labels, fields))
}

/// How many paginated lists keep their snapshot for later pages.
const SNAPSHOTS: usize = 64;

fn list_response(
    shared: &Shared,
    target: &Target,
    query: &Query,
    as_table: bool,
) -> Result<Response<Body>, ApiError> {
    let (labels, fields) = selectors(query, &target.resource)?;
    let limit = query.number("limit")?.unwrap_or(0) as usize;
    let key = format!(
        "{}|{}|{}|{}",
        target.resource.storage_key(),
        target.namespace.as_deref().unwrap_or_default(),
        query.get("labelSelector").unwrap_or_default(),
        query.get("fieldSelector").unwrap_or_default()
    );
    let item_key = |o: &Value| {
        format!(
            "{}/{}",
            o.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or_default(),
            o.pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
        )
    };
    let (resource_version, items, after) = match query.get("continue") {
        Some(token) => {
            let (token_rv, after) = decode_continue(token)?;
            let snapshots = shared.snapshots.lock().unwrap_or_else(|p| p.into_inner());
            let found = snapshots
                .iter()
                .find(|s| s.key == key && s.resource_version == token_rv)
                .map(|s| s.items.clone());
            let items = found.ok_or_else(|| {
                ApiError::new(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                )
            })?;
            (token_rv, items, Some(after))
        }
        None => {
            let page = shared.store.list(
                &target.resource,
                target.namespace.as_deref(),
                &labels,
                &fields,
                0,
                None,
            );
            let items = Arc::new(page.items);
            if limit > 0 && items.len() > limit {
                let mut snapshots = shared.snapshots.lock().unwrap_or_else(|p| p.into_inner());
                snapshots.push_back(Snapshot {
                    key: key.clone(),
                    resource_version: page.resource_version,
                    items: items.clone(),
                });
                while snapshots.len() > SNAPSHOTS {
                    snapshots.pop_front();
                }
            }
            (page.resource_version, items, None)
        }
    };
    let rest: Vec<&Value> = items
        .iter()
        .filter(|o| after.as_deref().is_none_or(|a| item_key(o).as_str() > a))
        .collect();
    let take = if limit == 0 {
        rest.len()
    } else {
        limit.min(rest.len())
    };
    let page: Vec<Value> = rest[..take].iter().map(|o| (*o).clone()).collect();
    let mut metadata = json!({"resourceVersion": resource_version.to_string()});
    if take < rest.len()
        && let Some(last) = page.last()
    {
        metadata["continue"] = json!(encode_continue(resource_version, &item_key(last)));
        // As the real server, only an unfiltered list counts what is left.
        if query.get("labelSelector").is_none() && query.get("fieldSelector").is_none() {
            metadata["remainingItemCount"] = json!(rest.len() - take);
        }
    }
    if as_table {
        let mut rendered = table::render(&target.resource, &page, None);
        rendered["metadata"] = metadata;
        return Ok(json_response(StatusCode::OK, &rendered));
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({"kind": target.resource.list_kind(), "apiVersion": target.resource.api_version(),
                "metadata": metadata, "items": page}),
    ))
}

/// A continue token shaped as the real server's: base64 of
/// `{"v":"meta.k8s.io/v1","rv":…,"start":"…"}`.
fn encode_continue(resource_version: u64, after: &str) -> String {
    use base64::Engine;
    let token =
        json!({"v": "meta.k8s.io/v1", "rv": resource_version, "start": format!("{after}\u{0}")});
    base64::engine::general_purpose::URL_SAFE.encode(token.to_string())
}

fn decode_continue(token: &str) -> Result<(u64, String), ApiError> {
    use base64::Engine;
    let invalid = |why: String| ApiError::bad_request(format!("continue key is not valid: {why}"));
    let bytes = base64::engine::general_purpose::URL_SAFE
        .decode(token)
        .map_err(|e| invalid(e.to_string()))?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    if value.get("v").and_then(Value::as_str) != Some("meta.k8s.io/v1") {
        return Err(invalid(
            "incorrect encoded start resourceVersion (version meta.k8s.io/v1)".into(),
        ));
    }
    let resource_version = value
        .get("rv")
        .and_then(Value::as_u64)
        .ok_or_else(|| invalid("no resourceVersion".into()))?;
    let start = value
        .get("start")
        .and_then(Value::as_str)
        .map(|s| s.trim_end_matches('\u{0}').to_string())
        .ok_or_else(|| invalid("no start key".into()))?;
    Ok((resource_version, start))
}

/// What one watcher sees of a change, if anything: selector transitions
/// turn into ADDED or DELETED, as on the real server. `storage_key` is the
/// target's.
fn seen_as(
    event: &Event,
    storage_key: &str,
    target: &Target,
    labels: &LabelSelector,
    fields: &FieldSelector,
) -> Option<EventType> {
    if event.storage_key != storage_key {
        return None;
    }
    if target.resource.namespaced
        && let Some(ns) = &target.namespace
        && *ns != event.namespace
    {
        return None;
    }
    let matches = |o: &Value| labels.matches(o) && fields.matches(o);
    let now = matches(&event.object);
    let before = event.old.as_ref().is_some_and(matches);
    let kind = match event.kind {
        EventType::Added if now => EventType::Added,
        EventType::Deleted if before || now => EventType::Deleted,
        EventType::Modified if now && before => EventType::Modified,
        EventType::Modified if now => EventType::Added,
        EventType::Modified if before => EventType::Deleted,
        _ => return None,
    };
    Some(kind)
}

/// The watch line of `event` as a watcher of `t` sees it (`kind`), rendered
/// once for all the watchers that see it alike.
fn event_line(event: &Event, kind: EventType, t: &ResourceType) -> Bytes {
    event.line(&t.api_version(), kind, || {
        line(kind.name(), &as_version(event.object.clone(), t))
    })
}

fn line(kind: &str, object: &Value) -> Bytes {
    let mut bytes =
        serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

fn bookmark(t: &ResourceType, rv: u64, initial_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        &json!({"kind": t.kind, "apiVersion": t.api_version(), "metadata": metadata}),
    )
}

fn watch_response(
    shared: &Shared,
    target: &Target,
    query: &Query,
) -> Result<Response<Body>, ApiError> {
    let (labels, fields) = selectors(query, &target.resource)?;
    let send_initial = query.flag("sendInitialEvents");
    let requested = query.number("resourceVersion")?;
    let from = if send_initial { None } else { requested };
    let bookmarks = query.flag("allowWatchBookmarks");
    let timeout = Duration::from_secs(query.number("timeoutSeconds")?.unwrap_or(1800));
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let target = Target {
        resource: target.resource.clone(),
        namespace: target.namespace.clone(),
        name: None,
        part: Part::Main,
    };
    match shared.store.watch_from(&target.resource, from) {
        Err(expired) => {
            // The real server answers 200 and an ERROR event.
            let _ = tx.try_send(line("ERROR", &expired.status()));
        }
        Ok((replay, receiver, start)) => {
            let interval = shared.bookmark_interval;
            let shutdown = shared.shutdown.clone();
            tokio::spawn(stream_events(
                tx,
                target,
                labels,
                fields,
                replay,
                receiver,
                start,
                send_initial,
                bookmarks,
                interval,
                timeout,
                shutdown,
            ));
        }
    }
    Ok(super::body::streamed_response(rx, "application/json"))
}

#[allow(clippy::too_many_arguments)]
async fn stream_events(
    tx: mpsc::Sender<Bytes>,
    target: Target,
    labels: LabelSelector,
    fields: FieldSelector,
    replay: Vec<Arc<Event>>,
    mut receiver: broadcast::Receiver<Arc<Event>>,
    start: u64,
    send_initial: bool,
    bookmarks: bool,
    interval: Duration,
    timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last = start;
    let storage_key = target.resource.storage_key();
    for event in &replay {
        if let Some(kind) = seen_as(event, &storage_key, &target, &labels, &fields)
            && tx
                .send(event_line(event, kind, &target.resource))
                .await
                .is_err()
        {
            return;
        }
        last = last.max(event.resource_version);
    }
    if send_initial
        && tx
            .send(bookmark(&target.resource, last, true))
            .await
            .is_err()
    {
        return;
    }
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let mut ticker = tokio::time::interval(interval);
    ticker.tick().await;
    loop {
        tokio::select! {
            received = receiver.recv() => match received {
                Ok(event) => {
                    if event.resource_version <= last {
                        continue;
                    }
                    last = event.resource_version;
                    if let Some(kind) = seen_as(&event, &storage_key, &target, &labels, &fields)
                        && tx.send(event_line(&event, kind, &target.resource)).await.is_err()
                    {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // As kube-apiserver closes a watcher that does not keep
                    // up ("forcing watcher close due to unresponsiveness"):
                    // the stream ends, and the client watches again from
                    // the last version it saw, from the history while it
                    // reaches back that far (410 Expired after that).
                    tracing::debug!(resource = %storage_key, last, "closing a watch that fell behind");
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = ticker.tick(), if bookmarks => {
                if tx.send(bookmark(&target.resource, last, false)).await.is_err() {
                    return;
                }
            }
            _ = &mut deadline => return,
            _ = shutdown.changed() => return,
            _ = tx.closed() => return,
        }
    }
}
