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
    #[error(
        "unknown cipher suite {0:?}: expected an IANA name as Go's crypto/tls takes it, \
         e.g. TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"
    )]
    UnknownCipherSuite(String),
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
    Arc::new(ring_provider())
}

/// The ring provider preferring AES-128-GCM for TLS 1.3, as Go's `crypto/tls`
/// does on CPUs with AES instructions (rustls puts AES-256-GCM first). Every
/// tunneled byte is sealed and opened twice in the server and once in the
/// agent, and 128-bit AES takes fewer rounds; its SHA-256 key schedule also
/// costs less than AES-256-GCM's SHA-384 in each handshake. Every suite stays
/// on; a server follows the client's order, so Go peers are unaffected.
fn ring_provider() -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|suite| suite.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    provider
}

/// The oldest TLS version a server accepts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MinTlsVersion {
    #[default]
    Tls12,
    Tls13,
}

/// What a server's TLS accepts: the oldest version and, for TLS 1.2, which
/// cipher suites.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerTlsPolicy {
    pub min_version: MinTlsVersion,
    /// The TLS 1.2 suites offered; `None`: every one the provider has. TLS
    /// 1.3 suites are not configurable (as in Go's `crypto/tls`).
    pub tls12_suites: Option<Vec<rustls::CipherSuite>>,
}

/// The cipher suites a list of names (Go's `--cipher-suites`, an OCM TLS
/// profile's `cipherSuites`) comes to here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CipherSuiteSelection {
    /// The named TLS 1.2 suites this build implements, in the provider's
    /// order of preference.
    pub tls12: Vec<rustls::CipherSuite>,
    /// Named TLS 1.3 suites: always on, as in Go, so naming them changes
    /// nothing.
    pub tls13_fixed: Vec<String>,
    /// Named suites Go knows and this build does not implement (RSA key
    /// exchange, CBC, RC4, 3DES): never offered.
    pub unavailable: Vec<String>,
}

/// TLS 1.3 suites by their IANA names.
const TLS13_SUITE_NAMES: &[&str] = &[
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
];

/// TLS 1.2 suites Go's `crypto/tls` knows that the ring provider does not
/// implement: no forward secrecy, or not an AEAD.
const GO_SUITES_NOT_IMPLEMENTED: &[&str] = &[
    "TLS_RSA_WITH_RC4_128_SHA",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256",
];

/// Sorts `names` into the suites this build offers, the TLS 1.3 ones that
/// are always on, and the ones it does not implement; a name Go would not
/// know either is an error. Go's short ChaCha20 names (without `_SHA256`)
/// are accepted.
pub fn select_cipher_suites(names: &[String]) -> Result<CipherSuiteSelection, TlsError> {
    let provider = provider();
    let tls12: Vec<rustls::CipherSuite> = provider
        .cipher_suites
        .iter()
        .filter(|suite| suite.version() == &rustls::version::TLS12)
        .map(|suite| suite.suite())
        .collect();
    let mut selection = CipherSuiteSelection::default();
    let mut named = Vec::new();
    for name in names
        .iter()
        .map(|name| name.trim())
        .filter(|n| !n.is_empty())
    {
        let canonical = match name {
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305" => "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305" => {
                "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256"
            }
            other => other,
        };
        if let Some(suite) = tls12.iter().find(|s| s.as_str() == Some(canonical)) {
            named.push(*suite);
        } else if TLS13_SUITE_NAMES.contains(&canonical) {
            selection.tls13_fixed.push(name.to_owned());
        } else if GO_SUITES_NOT_IMPLEMENTED.contains(&canonical) {
            selection.unavailable.push(name.to_owned());
        } else {
            return Err(TlsError::UnknownCipherSuite(name.to_owned()));
        }
    }
    selection.tls12 = tls12.into_iter().filter(|s| named.contains(s)).collect();
    Ok(selection)
}

/// A server config presenting `identity`. With `client_ca`, clients must
/// present a certificate issued by it (mTLS).
pub fn server_config(
    identity: Identity,
    client_ca: Option<Arc<RootCertStore>>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with_policy(identity, client_ca, alpn, &ServerTlsPolicy::default())
}

/// [`server_config`] accepting what `policy` allows.
pub fn server_config_with_policy(
    identity: Identity,
    client_ca: Option<Arc<RootCertStore>>,
    alpn: &[&[u8]],
    policy: &ServerTlsPolicy,
) -> Result<Arc<ServerConfig>, TlsError> {
    build_server_config(identity, client_ca, false, alpn, policy)
}

/// A server config presenting `identity` that verifies client certificates
/// issued by `client_ca` when a client sends one, and accepts clients that
/// send none (they authenticate otherwise, e.g. with a bearer token).
pub fn server_config_optional_clients(
    identity: Identity,
    client_ca: Arc<RootCertStore>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    build_server_config(
        identity,
        Some(client_ca),
        true,
        alpn,
        &ServerTlsPolicy::default(),
    )
}

fn build_server_config(
    identity: Identity,
    client_ca: Option<Arc<RootCertStore>>,
    clients_optional: bool,
    alpn: &[&[u8]],
    policy: &ServerTlsPolicy,
) -> Result<Arc<ServerConfig>, TlsError> {
    let mut provider = ring_provider();
    if let Some(allowed) = &policy.tls12_suites {
        provider.cipher_suites.retain(|suite| {
            suite.version() != &rustls::version::TLS12 || allowed.contains(&suite.suite())
        });
    }
    let provider = Arc::new(provider);
    let versions: &[&rustls::SupportedProtocolVersion] = match policy.min_version {
        MinTlsVersion::Tls12 => rustls::DEFAULT_VERSIONS,
        MinTlsVersion::Tls13 => &[&rustls::version::TLS13],
    };
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        Some(roots) => {
            let mut verifier = WebPkiClientVerifier::builder_with_provider(roots, provider);
            if clients_optional {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
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

/// `config` issuing stateless TLS session tickets (encrypted with a key
/// of this config's own, rotated every 6 hours), so a client that
/// reconnects resumes its session: no certificate chain verified and no
/// signature made or checked, a fraction of a full handshake's CPU. Without
/// it rustls keeps 256 sessions in memory, which a fleet of thousands of
/// agents evicts long before they reconnect. Only for servers that check a
/// resumed session's certificates for expiry themselves
/// ([`crate::peer::check_not_expired`]); a new config (credentials or trust
/// reloaded) has a new key, so no session outlives a change of trust.
pub fn with_session_tickets(config: Arc<ServerConfig>) -> Result<Arc<ServerConfig>, TlsError> {
    let mut config = Arc::unwrap_or_clone(config);
    config.ticketer = rustls::crypto::ring::Ticketer::new()
        .map_err(|e| TlsError::Config(format!("session tickets: {e}")))?;
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

    /// Runs a handshake between `client` and `server` in memory; the
    /// negotiated suite, or the error.
    fn handshake(
        client: Arc<ClientConfig>,
        server: Arc<ServerConfig>,
    ) -> Result<rustls::CipherSuite, rustls::Error> {
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut client = rustls::ClientConnection::new(client, name)?;
        let mut server = rustls::ServerConnection::new(server)?;
        for _ in 0..10 {
            let mut bytes = Vec::new();
            client.write_tls(&mut bytes).unwrap();
            server.read_tls(&mut bytes.as_slice()).unwrap();
            server.process_new_packets()?;
            let mut bytes = Vec::new();
            server.write_tls(&mut bytes).unwrap();
            client.read_tls(&mut bytes.as_slice()).unwrap();
            client.process_new_packets()?;
            if !client.is_handshaking() && !server.is_handshaking() {
                return Ok(client.negotiated_cipher_suite().unwrap().suite());
            }
        }
        panic!("the handshake did not finish");
    }

    /// One TLS 1.3 connection's handshake, and then the server's tickets
    /// delivered: full or resumed.
    fn connect(client: Arc<ClientConfig>, server: Arc<ServerConfig>) -> rustls::HandshakeKind {
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut client = rustls::ClientConnection::new(client, name).unwrap();
        let mut server = rustls::ServerConnection::new(server).unwrap();
        // Flights until both are done, then one more: the tickets follow
        // the server's handshake.
        let mut after = 0;
        while after < 2 {
            let mut bytes = Vec::new();
            client.write_tls(&mut bytes).unwrap();
            server.read_tls(&mut bytes.as_slice()).unwrap();
            server.process_new_packets().unwrap();
            let mut bytes = Vec::new();
            server.write_tls(&mut bytes).unwrap();
            client.read_tls(&mut bytes.as_slice()).unwrap();
            client.process_new_packets().unwrap();
            if !client.is_handshaking() && !server.is_handshaking() {
                after += 1;
            }
        }
        server.handshake_kind().unwrap()
    }

    /// A fleet of agents reconnecting after an outage: without tickets,
    /// the 256 sessions rustls keeps are long gone when the first of 300
    /// agents comes back, and every reconnect costs a full handshake.
    #[test]
    fn session_tickets_let_a_client_resume_after_hundreds_of_others() {
        let ca = TestCa::new();
        let leaf = ca.server("localhost");
        let agent = ca.client("agent", None);
        let trust = || roots(&Pem::text("ca.crt", &ca.cert_pem)).unwrap();
        let identity = |leaf: &crate::test_pki::Leaf| {
            Identity::new(
                &Pem::text("tls.crt", &leaf.cert_pem),
                &Pem::text("tls.key", &leaf.key_pem),
            )
            .unwrap()
        };
        let client = || client_config(trust(), Some(identity(&agent)), &[]).unwrap();
        for tickets in [false, true] {
            let mut server = server_config(identity(&leaf), Some(trust()), &[]).unwrap();
            if tickets {
                server = with_session_tickets(server).unwrap();
            }
            let first = client();
            assert_eq!(
                connect(first.clone(), server.clone()),
                rustls::HandshakeKind::Full
            );
            for _ in 0..300 {
                connect(client(), server.clone());
            }
            let expected = if tickets {
                rustls::HandshakeKind::Resumed
            } else {
                rustls::HandshakeKind::Full
            };
            assert_eq!(connect(first, server), expected, "tickets: {tickets}");
        }
    }

    /// A client speaking only `version`, offering only the suites named.
    fn picky_client(
        ca: &TestCa,
        version: &'static rustls::SupportedProtocolVersion,
        suites: &[rustls::CipherSuite],
    ) -> Arc<ClientConfig> {
        let mut provider = rustls::crypto::ring::default_provider();
        provider
            .cipher_suites
            .retain(|suite| suites.contains(&suite.suite()));
        let roots = roots(&Pem::text("ca.crt", &ca.cert_pem)).unwrap();
        let config = ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[version])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(config)
    }

    #[test]
    fn cipher_suite_names_sort_into_offered_fixed_unavailable_or_unknown() {
        let names: Vec<String> = [
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            " TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305",
            "TLS_AES_128_GCM_SHA256",
            "TLS_RSA_WITH_AES_128_CBC_SHA",
            "",
        ]
        .map(String::from)
        .to_vec();
        let selection = select_cipher_suites(&names).unwrap();
        assert_eq!(selection.tls12.len(), 2, "{selection:?}");
        assert!(
            selection
                .tls12
                .contains(&rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256)
        );
        assert_eq!(selection.tls13_fixed, ["TLS_AES_128_GCM_SHA256"]);
        assert_eq!(selection.unavailable, ["TLS_RSA_WITH_AES_128_CBC_SHA"]);
        let err = select_cipher_suites(&["TLS_MADE_UP".to_owned()]).unwrap_err();
        assert!(err.to_string().contains("TLS_MADE_UP"), "{err}");
    }

    #[test]
    fn a_server_offers_only_the_tls12_suites_its_policy_names() {
        use rustls::CipherSuite::{
            TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 as AES128,
            TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256 as CHACHA, TLS13_AES_256_GCM_SHA384,
        };
        let ca = TestCa::new();
        let leaf = ca.server("s");
        let server = |policy: &ServerTlsPolicy| {
            let identity = Identity::new(
                &Pem::text("s.crt", &leaf.cert_pem),
                &Pem::text("s.key", &leaf.key_pem),
            )
            .unwrap();
            server_config_with_policy(identity, None, &[], policy).unwrap()
        };
        let only_aes = ServerTlsPolicy {
            min_version: MinTlsVersion::Tls12,
            tls12_suites: Some(vec![AES128]),
        };
        let tls12 = &rustls::version::TLS12;
        let tls13 = &rustls::version::TLS13;
        assert_eq!(
            handshake(picky_client(&ca, tls12, &[AES128]), server(&only_aes)),
            Ok(AES128)
        );
        assert!(handshake(picky_client(&ca, tls12, &[CHACHA]), server(&only_aes)).is_err());
        // TLS 1.3 is not restricted by the list.
        assert_eq!(
            handshake(
                picky_client(&ca, tls13, &[TLS13_AES_256_GCM_SHA384]),
                server(&only_aes)
            ),
            Ok(TLS13_AES_256_GCM_SHA384)
        );
        // Without a list, every suite; with TLS 1.3 as the minimum, no TLS 1.2.
        assert_eq!(
            handshake(
                picky_client(&ca, tls12, &[CHACHA]),
                server(&ServerTlsPolicy::default())
            ),
            Ok(CHACHA)
        );
        let tls13_only = ServerTlsPolicy {
            min_version: MinTlsVersion::Tls13,
            tls12_suites: None,
        };
        assert!(handshake(picky_client(&ca, tls12, &[AES128]), server(&tls13_only)).is_err());
    }

    #[test]
    fn our_ends_agree_on_aes_128_and_a_client_preferring_aes_256_gets_it() {
        use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
        let ca = TestCa::new();
        let leaf = ca.server("s");
        let server = || {
            let identity = Identity::new(
                &Pem::text("s.crt", &leaf.cert_pem),
                &Pem::text("s.key", &leaf.key_pem),
            )
            .unwrap();
            server_config(identity, None, &[]).unwrap()
        };
        let roots = roots(&Pem::text("ca.crt", &ca.cert_pem)).unwrap();
        let ours = client_config(roots, None, &[]).unwrap();
        assert_eq!(handshake(ours, server()), Ok(TLS13_AES_128_GCM_SHA256));
        // The server follows the client's order (Go's clients put AES-128 first too).
        let tls13 = &rustls::version::TLS13;
        let aes_256_first = picky_client(
            &ca,
            tls13,
            &[TLS13_AES_256_GCM_SHA384, TLS13_AES_128_GCM_SHA256],
        );
        assert_eq!(
            handshake(aes_256_first, server()),
            Ok(TLS13_AES_256_GCM_SHA384)
        );
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
