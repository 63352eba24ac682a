//! OCM's TLS profile: the ConfigMap `ocm-tls-profile` in addon-manager's
//! namespace (`minTLSVersion`, `cipherSuites`), which OCM components follow
//! and which a platform (OpenShift's APIServer TLS profile, a compliance
//! policy) keeps up to date. Its settings reach every proxy-server as
//! `--tls-min-version` and `--cipher-suites`, with the pod template
//! annotation [`ANNOTATION_TLS_CONFIG_HASH`] so that a change rolls them, as
//! upstream's addon-manager does. Upstream restarts itself to see a change;
//! here the ConfigMap is watched.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// The ConfigMap's name (OCM sdk-go `tls.ConfigMapName`).
pub const TLS_PROFILE_CONFIGMAP: &str = "ocm-tls-profile";
/// Its key for the oldest TLS version.
pub const KEY_MIN_TLS_VERSION: &str = "minTLSVersion";
/// Its key for the cipher suites (IANA names, comma-separated).
pub const KEY_CIPHER_SUITES: &str = "cipherSuites";
/// `ProxyServerDeployed=False` for a profile the proxy-servers cannot follow.
pub const REASON_INVALID_TLS_PROFILE: &str = "InvalidTLSProfile";
/// The proxy-server pod template annotation that changes with the profile.
pub const ANNOTATION_TLS_CONFIG_HASH: &str = "proxy.open-cluster-management.io/tls-config-hash";

/// A profile the proxy-servers cannot follow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsProfileError {
    #[error(
        "ConfigMap {TLS_PROFILE_CONFIGMAP}: {KEY_MIN_TLS_VERSION} {0:?} is not one of \
         VersionTLS10, VersionTLS11, VersionTLS12, VersionTLS13"
    )]
    MinVersion(String),
    #[error("ConfigMap {TLS_PROFILE_CONFIGMAP}: {KEY_CIPHER_SUITES}: {0}")]
    CipherSuites(String),
}

/// The proxy-servers' TLS settings from the profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsProfile {
    /// `VersionTLS12` or `VersionTLS13`; `None` when the profile names none.
    pub min_version: Option<String>,
    /// The profile's suites as given; empty when it names none.
    pub cipher_suites: Vec<String>,
}

impl TlsProfile {
    /// Reads the ConfigMap's data. OCM's names (`VersionTLS12`) and
    /// OpenSSL's (`TLSv1.2`) are accepted for the version. TLS 1.0 and 1.1
    /// become TLS 1.2: the proxy-server implements nothing older, and a
    /// minimum of 1.0 allows 1.2 (every client of ours and of upstream
    /// speaks it). A cipher suite name Go would not know is an error;
    /// the proxy-server decides which of the known ones it can offer.
    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Self, TlsProfileError> {
        let min_version = match data.get(KEY_MIN_TLS_VERSION).map(|v| v.trim()) {
            None | Some("") => None,
            Some("VersionTLS10" | "TLSv1.0" | "VersionTLS11" | "TLSv1.1") => {
                Some("VersionTLS12".to_owned())
            }
            Some("VersionTLS12" | "TLSv1.2") => Some("VersionTLS12".to_owned()),
            Some("VersionTLS13" | "TLSv1.3") => Some("VersionTLS13".to_owned()),
            Some(other) => return Err(TlsProfileError::MinVersion(other.to_owned())),
        };
        let cipher_suites: Vec<String> = data
            .get(KEY_CIPHER_SUITES)
            .map(|list| {
                list.split(',')
                    .map(str::trim)
                    .filter(|name| !name.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        cluster_proxy_runtime::tls::select_cipher_suites(&cipher_suites)
            .map_err(|error| TlsProfileError::CipherSuites(error.to_string()))?;
        Ok(TlsProfile {
            min_version,
            cipher_suites,
        })
    }

    /// Whether the profile sets anything.
    pub fn is_empty(&self) -> bool {
        self.min_version.is_none() && self.cipher_suites.is_empty()
    }

    /// The proxy-server flags that carry the profile.
    pub fn args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(version) = &self.min_version {
            args.push(format!("--tls-min-version={version}"));
        }
        if !self.cipher_suites.is_empty() {
            args.push(format!("--cipher-suites={}", self.cipher_suites.join(",")));
        }
        args
    }

    /// 16 hex digits that change with the flags (upstream's annotation is
    /// as long).
    pub fn hash(&self) -> String {
        let digest = Sha256::digest(self.args().join("\n").as_bytes());
        hex::encode(&digest[..8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn versions_and_suites_become_flags() {
        let profile = TlsProfile::from_data(&data(&[
            ("minTLSVersion", "VersionTLS13"),
            (
                "cipherSuites",
                "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            ),
        ]))
        .unwrap();
        assert_eq!(
            profile.args(),
            [
                "--tls-min-version=VersionTLS13",
                "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"
            ]
        );
        assert_eq!(profile.hash().len(), 16);
        let openssl = TlsProfile::from_data(&data(&[("minTLSVersion", "TLSv1.2")])).unwrap();
        assert_eq!(openssl.args(), ["--tls-min-version=VersionTLS12"]);
        assert_ne!(openssl.hash(), profile.hash());
    }

    #[test]
    fn tls10_and_11_become_tls12_and_nothing_set_is_empty() {
        for old in ["VersionTLS10", "VersionTLS11", "TLSv1.0"] {
            let profile = TlsProfile::from_data(&data(&[("minTLSVersion", old)])).unwrap();
            assert_eq!(
                profile.min_version.as_deref(),
                Some("VersionTLS12"),
                "{old}"
            );
        }
        let empty = TlsProfile::from_data(&data(&[("minTLSVersion", ""), ("other", "x")])).unwrap();
        assert!(empty.is_empty());
        assert!(empty.args().is_empty());
    }

    #[test]
    fn unknown_versions_and_suites_are_errors_naming_them() {
        let err = TlsProfile::from_data(&data(&[("minTLSVersion", "VersionTLS14")])).unwrap_err();
        assert!(err.to_string().contains("VersionTLS14"), "{err}");
        let err = TlsProfile::from_data(&data(&[("cipherSuites", "TLS_NOPE")])).unwrap_err();
        assert!(err.to_string().contains("TLS_NOPE"), "{err}");
    }
}
