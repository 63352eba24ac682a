//! Reading identities out of peer certificates.

use cluster_proxy_proto::identity::{ClusterName, IdentityError};
use std::time::{SystemTime, UNIX_EPOCH};
use x509_parser::extensions::GeneralName;

use x509_parser::prelude::{FromDer, X509Certificate};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PeerError {
    #[error("peer certificate cannot be parsed: {0}")]
    Parse(String),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("peer certificate names more than one cluster ({0} and {1})")]
    Ambiguous(String, String),
    #[error("peer certificate {subject:?} expired at {not_after}")]
    Expired { subject: String, not_after: String },
}

/// The cluster a certificate names (see [`cluster_proxy_proto::identity`]),
/// or `None` for certificates that name no cluster (hub clients, upstream-issued agent certs).
pub fn cluster_of(cert_der: &[u8]) -> Result<Option<ClusterName>, PeerError> {
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| PeerError::Parse(e.to_string()))?;
    let mut found: Option<ClusterName> = None;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| PeerError::Parse(e.to_string()))?;
    for name in san.iter().flat_map(|ext| ext.value.general_names.iter()) {
        if let GeneralName::URI(uri) = name
            && let Some(cluster) = ClusterName::from_uri(uri)?
        {
            match &found {
                Some(previous) if *previous != cluster => {
                    return Err(PeerError::Ambiguous(
                        previous.to_string(),
                        cluster.to_string(),
                    ));
                }
                _ => found = Some(cluster),
            }
        }
    }
    Ok(found)
}

/// Checks that no certificate of a presented `chain` has expired by `now`.
///
/// A resumed TLS session (a TLS 1.3 ticket, a TLS 1.2 session id) brings back
/// the chain of the handshake that created it without verifying it again, and
/// rustls keeps such sessions for 24 hours: without this check a client or an
/// agent would stay trusted for up to a day after its certificate expired.
/// Go's `crypto/tls` refuses to resume such a session too.
pub fn check_not_expired(chain: &[impl AsRef<[u8]>], now: SystemTime) -> Result<(), PeerError> {
    let now = now
        .duration_since(UNIX_EPOCH)
        .map(|since| i64::try_from(since.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    for der in chain {
        let (_, cert) =
            X509Certificate::from_der(der.as_ref()).map_err(|e| PeerError::Parse(e.to_string()))?;
        let not_after = cert.validity().not_after;
        if not_after.timestamp() < now {
            return Err(PeerError::Expired {
                subject: cert.subject().to_string(),
                not_after: not_after.to_string(),
            });
        }
    }
    Ok(())
}

/// The common name of a certificate's subject, if it has exactly one.
pub fn common_name_of(cert_der: &[u8]) -> Result<Option<String>, PeerError> {
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| PeerError::Parse(e.to_string()))?;
    let mut names = cert.subject().iter_common_name();
    let first = names
        .next()
        .map(|cn| cn.as_str().map(str::to_owned))
        .transpose()
        .map_err(|e| PeerError::Parse(format!("common name: {e}")))?;
    if names.next().is_some() {
        return Err(PeerError::Parse(
            "the subject has more than one common name".into(),
        ));
    }
    Ok(first)
}

/// The subject of a certificate, for logs.
pub fn subject_of(cert_der: &[u8]) -> String {
    X509Certificate::from_der(cert_der)
        .map(|(_, c)| c.subject().to_string())
        .unwrap_or_else(|_| "<unparsable certificate>".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_pki::TestCa;
    use cluster_proxy_proto::identity::CLUSTER_URI_PREFIX;
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    fn der(pem: &str) -> Vec<u8> {
        CertificateDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .to_vec()
    }

    #[test]
    fn agent_certificates_name_their_cluster() {
        let ca = TestCa::new();
        let cluster = ClusterName::new("cluster-a").unwrap();
        let uri = format!("{CLUSTER_URI_PREFIX}cluster-a");
        let agent = ca.client("agent", Some(&uri));
        assert_eq!(cluster_of(&der(&agent.cert_pem)), Ok(Some(cluster)));
        let client = ca.client("hub-client", None);
        assert_eq!(cluster_of(&der(&client.cert_pem)), Ok(None));
        assert!(subject_of(&der(&client.cert_pem)).contains("CN=hub-client"));
    }

    #[test]
    fn two_clusters_in_one_certificate_are_refused() {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        for name in ["cluster-a", "cluster-b"] {
            params.subject_alt_names.push(rcgen::SanType::URI(
                format!("{CLUSTER_URI_PREFIX}{name}").try_into().unwrap(),
            ));
        }
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert!(matches!(
            cluster_of(cert.der()),
            Err(PeerError::Ambiguous(_, _))
        ));
    }

    #[test]
    fn a_chain_is_expired_once_any_certificate_is() {
        let ca = TestCa::new();
        let ca_der = der(&ca.cert_pem);
        let valid = der(&ca.client("valid", None).cert_pem);
        let now = SystemTime::now();
        assert_eq!(check_not_expired(&[&valid, &ca_der], now), Ok(()));
        let expired = der(&ca.expired_server("expired").cert_pem);
        let err = check_not_expired(&[&valid, &expired], now).unwrap_err();
        assert!(
            matches!(&err, PeerError::Expired { subject, .. } if subject.contains("CN=expired")),
            "{err}"
        );
        // The same chain, an hour and a half earlier, was still valid.
        let earlier = now - std::time::Duration::from_secs(90 * 60);
        assert_eq!(check_not_expired(&[&valid, &expired], earlier), Ok(()));
        assert!(matches!(
            check_not_expired(&[b"not a certificate".as_slice()], now),
            Err(PeerError::Parse(_))
        ));
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(matches!(
            cluster_of(b"not a certificate"),
            Err(PeerError::Parse(_))
        ));
    }
}
