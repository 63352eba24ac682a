//! Loading PEM credentials into rustls configurations.
//!
//! Every config is built with the ring provider explicitly, so no process-wide
//! default provider has to be installed. Errors name the file and what was
//! wrong with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use x509_parser::prelude::{FromDer, X509Certificate};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {origin}: no PEM certificate found")]
    NoCertificate { what: &'static str, origin: String },
    #[error("{what} {origin}: no PEM private key found (expected PKCS#8, PKCS#1 or SEC1)")]
    NoKey { what: &'static str, origin: String },
    #[error("{what} {origin}: malformed PEM: {detail}")]
    BadPem {
        what: &'static str,
        origin: String,
        detail: String,
    },
    #[error(
        "{what} {origin}: certificate is not valid now (valid from {not_before} to {not_after})"
    )]
    NotValidNow {
        what: &'static str,
        origin: String,
        not_before: String,
        not_after: String,
    },
    #[error("{what} {origin}: certificate cannot be parsed: {detail}")]
    BadCertificate {
        what: &'static str,
        origin: String,
        detail: String,
    },
    #[error("{what} {origin}: CA certificate rejected: {detail}")]
    BadCa {
        what: &'static str,
        origin: String,
        detail: String,
    },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// PEM material and where it came from (for error messages).
#[derive(Debug, Clone)]
pub struct Pem {
    origin: String,
    bytes: Vec<u8>,
}

impl Pem {
    /// Reads a PEM file.
    pub fn file(what: &'static str, path: &Path) -> Result<Self, TlsError> {
        let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
            what,
            path: path.to_owned(),
            source,
        })?;
        Ok(Pem {
            origin: path.display().to_string(),
            bytes,
        })
    }

    /// PEM held in memory.
    pub fn text(origin: &str, pem: &str) -> Self {
        Pem {
            origin: origin.to_owned(),
            bytes: pem.as_bytes().to_vec(),
        }
    }

    fn certificates(&self, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let certs = CertificateDer::pem_slice_iter(&self.bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsError::BadPem {
                what,
                origin: self.origin.clone(),
                detail: e.to_string(),
            })?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate {
                what,
                origin: self.origin.clone(),
            });
        }
        Ok(certs)
    }

    fn private_key(&self, what: &'static str) -> Result<PrivateKeyDer<'static>, TlsError> {
        PrivateKeyDer::from_pem_slice(&self.bytes).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey {
                what,
                origin: self.origin.clone(),
            },
            other => TlsError::BadPem {
                what,
                origin: self.origin.clone(),
                detail: other.to_string(),
            },
        })
    }
}

/// A certificate chain and its key, checked to be currently valid.
#[derive(Debug)]
pub struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    pub fn new(cert: &Pem, key: &Pem) -> Result<Self, TlsError> {
        let chain = cert.certificates("certificate")?;
        check_valid_now("certificate", &cert.origin, &chain[0])?;
        let key = key.private_key("private key")?;
        Ok(Identity { chain, key })
    }

    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Identity::new(
            &Pem::file("certificate", cert)?,
            &Pem::file("private key", key)?,
        )
    }
}

fn check_valid_now(
    what: &'static str,
    origin: &str,
    cert: &CertificateDer<'_>,
) -> Result<(), TlsError> {
    let (_, parsed) = X509Certificate::from_der(cert).map_err(|e| TlsError::BadCertificate {
        what,
        origin: origin.to_owned(),
        detail: e.to_string(),
    })?;
    let validity = parsed.validity();
    if !validity.is_valid() {
        return Err(TlsError::NotValidNow {
            what,
            origin: origin.to_owned(),
            not_before: validity.not_before.to_string(),
            not_after: validity.not_after.to_string(),
        });
    }
    Ok(())
}

/// Trust anchors from a CA bundle.
pub fn roots(ca: &Pem) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in ca.certificates("CA bundle")? {
        store.add(cert).map_err(|e| TlsError::BadCa {
            what: "CA bundle",
            origin: ca.origin.clone(),
            detail: e.to_string(),
        })?;
    }
    Ok(Arc::new(store))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The oldest TLS version a server accepts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MinTlsVersion {
    #[default]
    Tls12,
    Tls13,
}

/// A server config presenting `identity`. With `client_ca`, clients must
/// present a certificate issued by it (mTLS).
pub fn server_config(
    identity: Identity,
    client_ca: Option<Arc<RootCertStore>>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with_min_version(identity, client_ca, alpn, MinTlsVersion::Tls12)
}

/// [`server_config`] with an explicit minimum TLS version.
pub fn server_config_with_min_version(
    identity: Identity,
    client_ca: Option<Arc<RootCertStore>>,
    alpn: &[&[u8]],
    min_version: MinTlsVersion,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let versions: &[&rustls::SupportedProtocolVersion] = match min_version {
        MinTlsVersion::Tls12 => rustls::DEFAULT_VERSIONS,
        MinTlsVersion::Tls13 => &[&rustls::version::TLS13],
    };
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        Some(roots) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(identity.chain, identity.key)
        .map_err(|e| {
            TlsError::Config(format!(
                "certificate and key do not form a usable pair: {e}"
            ))
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A client config trusting `roots`, presenting `identity` if given.
pub fn client_config(
    roots: Arc<RootCertStore>,
    identity: Option<Identity>,
    alpn: &[&[u8]],
) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_webpki_verifier(verifier);
    let mut config = match identity {
        Some(id) => builder
            .with_client_auth_cert(id.chain, id.key)
            .map_err(|e| {
                TlsError::Config(format!(
                    "certificate and key do not form a usable pair: {e}"
                ))
            })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_pki::TestCa;

    #[test]
    fn missing_files_name_the_path() {
        let err = Pem::file("certificate", Path::new("/nonexistent/tls.crt")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/tls.crt"), "{err}");
    }

    #[test]
    fn empty_or_wrong_pem_is_a_clear_error() {
        let empty = Pem::text("empty.pem", "");
        assert!(matches!(roots(&empty), Err(TlsError::NoCertificate { .. })));
        let ca = TestCa::new();
        let cert_only = Pem::text("cert.pem", &ca.cert_pem);
        assert!(matches!(
            Identity::new(&cert_only, &cert_only),
            Err(TlsError::NoKey { .. })
        ));
        let broken = Pem::text(
            "broken.pem",
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        );
        assert!(roots(&broken).is_err());
    }

    #[test]
    fn expired_certificates_are_refused_at_load() {
        let ca = TestCa::new();
        let creds = ca.expired_server("s");
        let err = Identity::new(
            &Pem::text("s.crt", &creds.cert_pem),
            &Pem::text("s.key", &creds.key_pem),
        )
        .unwrap_err();
        assert!(matches!(err, TlsError::NotValidNow { .. }), "{err}");
        assert!(err.to_string().contains("s.crt"), "{err}");
    }

    #[test]
    fn mismatched_key_is_refused() {
        let ca = TestCa::new();
        let a = ca.server("a");
        let b = ca.server("b");
        let id = Identity::new(
            &Pem::text("a.crt", &a.cert_pem),
            &Pem::text("b.key", &b.key_pem),
        )
        .unwrap();
        assert!(server_config(id, None, &[]).is_err());
    }
}
