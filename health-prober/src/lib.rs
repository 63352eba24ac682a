//! health-prober: probes every managed cluster through the tunnel and records
//! latency in the addon status.
//!
//! Not built yet: this crate only reserves its place in the workspace. It has
//! no binary, so nothing can mistake it for a working prober.
#![forbid(unsafe_code)]
