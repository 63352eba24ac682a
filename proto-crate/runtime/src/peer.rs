//! Reading identities out of peer certificates.

use cluster_proxy_proto::identity::{ClusterName, IdentityError};
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
    fn garbage_is_an_error() {
        assert!(matches!(
            cluster_of(b"not a certificate"),
            Err(PeerError::Parse(_))
        ));
    }
}
