//! addon-manager: the kube-runtime controllers that install cluster-proxy as
//! an OCM addon — proxy-servers on the hub from the `ManagedProxyConfiguration`
//! ([`hub`]), and an agent on every selected managed cluster through a
//! `ManifestWork` ([`addon`]). It also holds the `crdgen` binary, which writes
//! the `ManagedProxyConfiguration` CRD from the API types in
//! `cluster-proxy-proto` (feature `kube-api`) into `charts/`.
#![forbid(unsafe_code)]

pub mod addon;
pub mod apply;
pub mod hub;
pub mod service;
pub mod settings;
pub mod trace;
