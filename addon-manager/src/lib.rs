//! addon-manager: the kube-runtime controllers that install proxy-servers on
//! the hub and agents on managed clusters.
//!
//! Not built yet: this crate only reserves its place in the workspace. It has
//! no binary, so nothing can mistake it for a working controller.
#![forbid(unsafe_code)]
