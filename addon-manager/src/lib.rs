//! addon-manager: the kube-runtime controllers that install proxy-servers on
//! the hub and agents on managed clusters.
//!
//! The controllers are not built yet. So far the crate holds only the `crdgen`
//! binary, which writes the `ManagedProxyConfiguration` CRD from the API types
//! in `cluster-proxy-proto` (feature `kube-api`) into `charts/`.
#![forbid(unsafe_code)]
