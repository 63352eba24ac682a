//! The hub controller: every `ManagedProxyConfiguration` (MPC) becomes the
//! hub objects that run its proxy-servers — the namespace, ServiceAccount
//! `cluster-proxy`, the proxy-server Deployment named after the MPC, the
//! in-cluster Service (`proxy-entrypoint`), and per entrypoint type the
//! LoadBalancer Service (`proxy-agent-entrypoint`) or the port-forward RBAC
//! (`cluster-proxy-addon-agent:portforward`) — with upstream's names, labels
//! and arguments ([`render`]), kept in place by a kube-runtime controller
//! ([`controller`]) that owns the `ProxyServerDeployed` condition.
//!
//! Entry point: [`run`] with a [`HubSettings`] and [`HubMetrics`]. Other
//! controllers (the addon's agent rendering, cert-authority's SANs) derive
//! the address agents dial with [`entrypoint_address`].
//!
//! # Differences from upstream, and why
//!
//! * **Validation instead of crash loops.** An invalid spec (no image, an
//!   entrypoint type without its value, a hostname that is no DNS name or
//!   IP, a negative replica count, an invalid LoadBalancer annotation key,
//!   …: `ManagedProxyConfigurationSpec::validate`) sets
//!   `ProxyServerDeployed=False`, reason `InvalidSpec`, with every problem in
//!   the message, and leaves what is deployed alone. Upstream panics on a
//!   missing entrypoint and deploys the rest as given. Only problems in
//!   `spec.proxyServer`, `spec.deploy` and `spec.authentication.dump` stop
//!   the proxy-servers ([`hub_problems`]); the agent, signer and SAN fields
//!   are reported by the controllers that use them.
//! * **LoadBalancer annotations**: keys that are qualified names are kept;
//!   upstream's check is inverted and keeps only invalid ones. The Service is
//!   applied on every reconcile, so changed annotations reach it (upstream
//!   never updates it after creation).
//! * **LoadBalancer hostnames**: an ingress that publishes only a hostname
//!   (AWS ELB) is an address here; upstream waits for an IP forever.
//! * **`spec.deploy.ports` are honoured** (container ports, Services, probes
//!   and the `--*-port` flags); upstream ignores them.
//! * **Rolling updates** (maxUnavailable 1, maxSurge 1) instead of
//!   recreating every proxy-server at once: a draining proxy-server sends
//!   DRAIN to its agents and finishes the connections it has, so a
//!   configuration change does not cut every tunnel at the same moment.
//! * **Server id** from the pod name (`PROXY_SERVER_ID` by the downward
//!   API), so agents and logs name replicas stably instead of by a random
//!   UUID per start.
//! * **Hardened pods**: non-root 65532, read-only root filesystem, no
//!   capabilities, no privilege escalation, RuntimeDefault seccomp.
//! * **Server-side apply** under `cluster-proxy-addon-manager` for every
//!   object and for the status, whose conditions are a list map: this
//!   controller writes only `ProxyServerDeployed` and
//!   `lastObservedGeneration`, cert-authority its certificate conditions.
//!   An unchanged status is not written, and keeps its `lastTransitionTime`.
//! * **Drift from watch events**: the Deployment, Services, ServiceAccount,
//!   Role and RoleBinding are watched (owner references), and the Namespace
//!   through its label, so an edited or deleted object is put back at once,
//!   not at the next resync.
//! * **Pruning**: objects this MPC controls that the spec no longer asks for
//!   (the LoadBalancer Service after a switch to `Hostname`, the port-forward
//!   RBAC, a renamed Service, the objects in a former namespace) are deleted.
//! * **The Namespace is not owned by the MPC**: it may hold addon-manager
//!   itself and the CA, which deleting the MPC must not take away. Every
//!   other object carries a controller owner reference to the MPC and is
//!   garbage-collected with it.
//! * **OCM's TLS profile** (ConfigMap `ocm-tls-profile` in
//!   [`HubSettings::tls_profile_namespace`], see [`tls_profile`]) becomes the
//!   proxy-servers' `--tls-min-version` and `--cipher-suites`, as upstream;
//!   the ConfigMap is watched, where upstream restarts itself to see a
//!   change, and a profile the proxy-servers cannot follow is
//!   `ProxyServerDeployed=False` (`InvalidTLSProfile`) with what is deployed
//!   left as it is.
//! * **Trace export of the proxy-servers** ([`telemetry`]): addon-manager's
//!   `--proxy-server-otlp-*` flags (defaulting to its own `OTEL_*`) become
//!   the proxy-server container's `OTEL_*` variables, the collector headers
//!   from a Secret and its CA from a ConfigMap, never inlined, with a pod
//!   template hash so a change rolls them. Upstream's proxy-servers export
//!   nothing.
//! * **Multiple MPCs** are each reconciled; upstream exits when
//!   `cluster-proxy` is missing at start. Only `cluster-proxy` is read by
//!   the addon's agent rendering, as upstream.

pub mod controller;
pub mod metrics;
pub mod render;
pub mod telemetry;
pub mod tls_profile;

pub use controller::{HubError, HubSettings, hub_problems, retry_delay, run};
pub use metrics::{HubMetrics, ReconcileResult};
pub use render::{
    EntrypointError, HubObjects, HubRenderOptions, RenderError, entrypoint_address, render,
    render_with,
};
pub use telemetry::{KeyRef, ProxyServerTelemetry, ProxyServerTelemetryError};
pub use tls_profile::{TLS_PROFILE_CONFIGMAP, TlsProfile, TlsProfileError};
