//! `ManagedProxyConfiguration` (`proxy.open-cluster-management.io/v1alpha1`).
//!
//! Cluster-scoped, with a status subresource. Every spec field, default and
//! status condition type of upstream cluster-proxy's CRD is here, under the
//! same JSON names, so an object written for upstream parses unchanged.
//!
//! # Differences from upstream's CRD
//!
//! The schema is generated from these types (`crdgen`), so it differs from
//! upstream's controller-gen output in these ways, none of which rejects an
//! object upstream's CRD accepts, as long as it has a `spec` and no two
//! conditions of one type:
//!
//! * `spec` is required (upstream: optional, yet its own `authentication`,
//!   `proxyServer` and `proxyAgent` are required, so an MPC without a spec
//!   could never be reconciled).
//! * `spec.authentication.signer` and `spec.authentication.dump` carry object
//!   defaults (`{type: SelfSigned}` and the three secret names), so the
//!   API server fills them in even when the whole object is omitted; upstream
//!   only defaults their inner fields, which has no effect while the parent
//!   object is absent.
//! * `status.conditions` is a list map keyed by `type`
//!   (`x-kubernetes-list-type: map`), so cert-authority and addon-manager can
//!   each own their own conditions under server-side apply; upstream's list is
//!   atomic and written whole with `Update`.
//! * Optional objects and strings are `nullable` (schemars' rendering of
//!   `Option`); descriptions are this module's doc comments, not upstream's.
//! * `minimum` values read `1.0` and `0.0`: the CRD type stores numbers as
//!   `f64`; the API server treats them as upstream's `1` and `0`.
//! * No `listKind` in `spec.names`; the API server fills in
//!   `ManagedProxyConfigurationList`, the same value upstream sets.
//! * Printer columns `Entrypoint`, `Replicas`, `Deployed` and `Age`; upstream
//!   has none, so `kubectl get` showed only the name and age.
//! * One field upstream lacks: `spec.proxyServer.resources` (the proxy-server
//!   container's requests and limits, which a namespace with a ResourceQuota
//!   requires). Optional; an object without it hashes and renders as before.
//!
//! Kept as upstream although it is odd: `replicas` has no minimum (a negative
//! value is reported by addon-manager as a `False` condition instead of being
//! rejected), the signer enum admits `Provided` and `CertManager` although
//! only `SelfSigned` is implemented, and `spec.deploy.ports` requires `ports`
//! once `deploy` is set.

pub mod entrypoint;
mod resource;
pub mod validation;

pub use entrypoint::{EntrypointError, PORT_FORWARD_HOST, load_balancer_address};
pub use resource::*;
pub use validation::{InvalidSpec, REASON_INVALID_SPEC, SpecProblem};
