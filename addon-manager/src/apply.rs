//! How addon-manager writes: server-side apply under one field manager, so
//! the API server merges what we own and keeps what others own (status
//! written by other controllers, fields set by users or admission), and an
//! owner reference to the object an applied object was rendered from, so
//! garbage collection removes it with its owner.

use std::fmt::Debug;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The field manager of every write addon-manager makes.
pub const FIELD_MANAGER: &str = "cluster-proxy-addon-manager";

/// Sent on every request, so audit logs name the component.
pub const USER_AGENT: &str = concat!("addon-manager/", env!("CARGO_PKG_VERSION"));

/// Errors writing an object.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("{kind} has no metadata.name; cannot apply it")]
    Unnamed { kind: String },
    #[error("applying {kind} {name}: {source}")]
    Api {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl ApplyError {
    /// The API's answer, when there was one.
    pub fn api_error(&self) -> Option<&kube::Error> {
        match self {
            ApplyError::Api { source, .. } => Some(source),
            ApplyError::Unnamed { .. } => None,
        }
    }
}

/// Server-side applies `object` through `api` as [`FIELD_MANAGER`]. Fields
/// we own are taken over from other managers (`force`), as a controller
/// that is the source of truth for them must.
pub async fn apply<K>(api: &Api<K>, object: &K) -> Result<K, ApplyError>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
{
    let (kind, name) = kind_and_name(object)?;
    api.patch(&name, &apply_params(), &Patch::Apply(object))
        .await
        .map_err(|source| ApplyError::Api { kind, name, source })
}

/// Server-side applies only the `status` of `object` (the status
/// subresource) as [`FIELD_MANAGER`].
pub async fn apply_status<K>(api: &Api<K>, object: &K) -> Result<K, ApplyError>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
{
    let (kind, name) = kind_and_name(object)?;
    api.patch_status(&name, &apply_params(), &Patch::Apply(object))
        .await
        .map_err(|source| ApplyError::Api { kind, name, source })
}

fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

fn kind_and_name<K: Resource<DynamicType = ()>>(
    object: &K,
) -> Result<(String, String), ApplyError> {
    let kind = K::kind(&()).into_owned();
    match object.meta().name.clone() {
        Some(name) => Ok((kind, name)),
        None => Err(ApplyError::Unnamed { kind }),
    }
}

/// A controller owner reference to `owner` (blocking its deletion until
/// the dependent is gone, as upstream sets it).
pub fn owner_reference<K>(owner: &K) -> Option<OwnerReference>
where
    K: Resource<DynamicType = ()>,
{
    Some(OwnerReference {
        api_version: K::api_version(&()).into_owned(),
        kind: K::kind(&()).into_owned(),
        name: owner.meta().name.clone()?,
        uid: owner.meta().uid.clone()?,
        controller: Some(true),
        block_owner_deletion: Some(true),
    })
}

/// Whether `error` is the API's 404.
pub fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

/// Whether `error` is the API's 409 (a conflict: retry with fresh data).
pub fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// `object`'s name, or `""`.
pub fn name_of<K: Resource>(object: &K) -> String {
    object.name_any()
}
