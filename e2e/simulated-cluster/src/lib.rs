//! The simulated managed clusters and hub pods of the test bed: what a real
//! hub and real clusters would run besides cluster-proxy, played on one
//! machine. A kubelet stand-in runs rendered Deployments as local processes
//! ([`kubelet`], supervised by [`process`], built by [`binaries`]); OCM's
//! placement controller and each cluster's registration and work agents
//! ([`ocm`], with OCM's CRDs); per-cluster network namespaces ([`netns`]);
//! the services inside a cluster ([`sample`], [`targets`]); the Service in
//! front of the proxy-server replicas ([`balancer`]); an OTLP trace
//! collector ([`otlp`]); a real forward proxy ([`forward_proxy`]). It
//! links no cluster-proxy data plane: control-plane tests use it with the
//! in-memory API alone.
#![forbid(unsafe_code)]

pub mod balancer;
pub mod binaries;
pub mod cluster_api;
pub mod forward_proxy;
pub mod kubelet;
pub mod netns;
pub mod ocm;
pub mod otlp;
pub mod process;
pub mod sample;
pub mod targets;
pub mod wait;
