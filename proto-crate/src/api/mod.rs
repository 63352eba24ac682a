//! Kubernetes API types shared by the control-plane services (feature `kube-api`).
//!
//! One module per API group and version, named as the group's short name and
//! the served version:
//!
//! | module | group / version | kinds |
//! |---|---|---|
//! | [`proxy::v1alpha1`] | `proxy.open-cluster-management.io/v1alpha1` | `ManagedProxyConfiguration` (our CRD) |
//! | [`cluster::v1`] | `cluster.open-cluster-management.io/v1` | `ManagedCluster` |
//! | [`cluster::v1alpha1`] | `cluster.open-cluster-management.io/v1alpha1` | rollout strategy (used by addons) |
//! | [`cluster::v1beta1`] | `cluster.open-cluster-management.io/v1beta1` | `Placement`, `PlacementDecision` |
//! | [`addon::v1alpha1`] | `addon.open-cluster-management.io/v1alpha1` | `ClusterManagementAddOn`, `ManagedClusterAddOn`, `AddOnDeploymentConfig` |
//! | [`work::v1`] | `work.open-cluster-management.io/v1` | `ManifestWork` |
//!
//! The data plane (proxy-server, proxy-agent) does not enable `kube-api`, so it
//! links no `kube`, `k8s-openapi` or `schemars`.
//!
//! # Our CRD and OCM's
//!
//! `ManagedProxyConfiguration` is ours: its schema is generated from the Rust
//! types (`cargo run -p addon-manager --bin crdgen`) into
//! `charts/cluster-proxy/crds/managedproxyconfigurations.yaml`, and a test fails
//! when the file drifts. The OCM kinds belong to OCM, which installs their CRDs
//! on the hub; here they are written from OCM's published API
//! (`open-cluster-management-io/api`) with the same group, version, kind, scope
//! and field names, so the code works against a real hub. They implement
//! [`kube::Resource`] but offer no `crd()`: OCM installs those CRDs.
//!
//! # Writing objects we do not own
//!
//! The OCM types model the fields a cluster-proxy addon manager reads and
//! writes, not every field OCM defines. That is safe because of two rules:
//!
//! * on read, unknown fields are ignored (no `deny_unknown_fields`), and every
//!   OCM field is optional on the Rust side, so an object from a newer OCM
//!   still parses;
//! * on write, controllers use server-side apply with their own field manager
//!   and send only the fields they own (every optional field is skipped when
//!   unset). The API server merges the applied fields and keeps everything
//!   else, including fields this crate does not model. A read-modify-`PUT` of
//!   a parsed object would drop those fields, so controllers never do that.
//!
//! Enumerations in OCM types are `String`s with constants for the known values,
//! so a value added by a later OCM release is carried through instead of
//! failing the whole object.
//!
//! # Versioning rule
//!
//! An API version is a promise that objects written under it keep parsing:
//!
//! 1. Within a version, changes are additive only: a new field is optional
//!    (`Option`, or a serde default equal to its CRD default), a new enum
//!    value is added, never taken away.
//! 2. A field is never removed, renamed or retyped, an optional field never
//!    becomes required, and a default never changes within a version. Any such
//!    change is a new version module (for example `proxy::v1alpha2`) next to
//!    the old one, with a conversion between them, and the CRD serves both.
//! 3. Every version keeps checked-in JSON fixtures of realistic objects under
//!    `proto-crate/tests/fixtures/<group>/<version>/`. Fixtures are only ever
//!    added, never edited: `tests/api_compat.rs` parses each one with the
//!    current types and checks that a round trip keeps every field the types
//!    model. A change that breaks an old object fails that test.

/// Declares the root type of an OCM kind: `metadata`, a `spec` that reads as
/// its default when absent (objects created from minimal manifests have none,
/// and one unparsable object would stall a whole watch), an optional `status`,
/// and `apiVersion`/`kind` written on serialisation, as the API expects.
macro_rules! ocm_kind {
    (
        $(#[$attr:meta])*
        $kind:ident {
            group: $group:literal,
            version: $version:literal,
            plural: $plural:literal,
            scope: $scope:ident,
            spec: $spec:ty
            $(, status: $status:ty)? $(,)?
        }
    ) => {
        $(#[$attr])*
        #[derive(serde::Deserialize, Clone, Debug, Default, PartialEq)]
        pub struct $kind {
            /// Standard object metadata.
            #[serde(default)]
            pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
            /// The desired state.
            #[serde(default)]
            pub spec: $spec,
            $(
            /// The observed state, written by its controller.
            #[serde(default)]
            pub status: Option<$status>,
            )?
        }

        impl $kind {
            /// A new object named `name` with `spec` and no status.
            pub fn new(name: &str, spec: $spec) -> Self {
                let mut object = Self::default();
                object.metadata.name = Some(name.to_owned());
                object.spec = spec;
                object
            }
        }

        impl kube::Resource for $kind {
            type DynamicType = ();
            type Scope = kube::core::$scope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                stringify!($kind).into()
            }

            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                $group.into()
            }

            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                $version.into()
            }

            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }

            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }

            fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }

        impl serde::Serialize for $kind {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                #[allow(unused_mut)]
                let mut fields = 4;
                $(
                let status: &Option<$status> = &self.status;
                fields += usize::from(status.is_some());
                )?
                let mut object = serializer.serialize_struct(stringify!($kind), fields)?;
                object.serialize_field("apiVersion", &<Self as kube::Resource>::api_version(&()))?;
                object.serialize_field("kind", stringify!($kind))?;
                object.serialize_field("metadata", &self.metadata)?;
                object.serialize_field("spec", &self.spec)?;
                $(
                if let Some(status) = &self.status {
                    object.serialize_field("status", status as &$status)?;
                }
                )?
                object.end()
            }
        }
    };
}

pub mod addon;
pub mod cluster;
pub mod proxy;
pub mod work;

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Condition status `True`.
pub const CONDITION_TRUE: &str = "True";
/// Condition status `False`.
pub const CONDITION_FALSE: &str = "False";
/// Condition status `Unknown`.
pub const CONDITION_UNKNOWN: &str = "Unknown";

/// The condition of type `type_` in `conditions`, if present.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|condition| condition.type_ == type_)
}

/// Whether `conditions` holds a condition of type `type_` with status `True`.
pub fn is_condition_true(conditions: &[Condition], type_: &str) -> bool {
    find_condition(conditions, type_).is_some_and(|condition| condition.status == CONDITION_TRUE)
}
