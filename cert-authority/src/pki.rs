//! Certificate issuing.

use std::net::IpAddr;
use std::time::Duration;

use cluster_proxy_proto::identity::ClusterName;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;

/// Default validity of issued leaf certificates.
pub const DEFAULT_LEAF_VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
/// Default validity of a generated CA.
pub const DEFAULT_CA_VALIDITY: Duration = Duration::from_secs(5 * 365 * 24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("invalid subject alternative name {0:?}")]
    BadSan(String),
    #[error("validity {0:?} is out of range")]
    BadValidity(Duration),
    #[error("the CA private key cannot be read: {0}")]
    UnreadableCaKey(String),
    #[error("the CA certificate cannot be read: {0}")]
    UnreadableCaCertificate(String),
    #[error("the CA private key does not belong to the CA certificate")]
    CaKeyMismatch,
    #[error("subject {0}")]
    Subject(String),
}

/// A certificate and its private key, PEM encoded.
#[derive(Clone)]
pub struct Credentials {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// What a leaf certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// TLS server (proxy-server client and agent ports).
    Server,
    /// TLS client (hub proxy clients, agents).
    Client,
}

/// A request for a leaf certificate.
#[derive(Debug, Clone)]
pub struct LeafRequest {
    pub common_name: String,
    /// DNS names and IP addresses (as text); IP literals become IP SANs.
    pub sans: Vec<String>,
    pub usage: Usage,
    /// For agent certificates: the cluster the certificate names.
    pub cluster: Option<ClusterName>,
    pub validity: Duration,
}

impl LeafRequest {
    pub fn server(common_name: &str, sans: &[&str]) -> Self {
        LeafRequest {
            common_name: common_name.to_owned(),
            sans: sans.iter().map(|s| (*s).to_owned()).collect(),
            usage: Usage::Server,
            cluster: None,
            validity: DEFAULT_LEAF_VALIDITY,
        }
    }

    pub fn client(common_name: &str) -> Self {
        LeafRequest {
            common_name: common_name.to_owned(),
            sans: Vec::new(),
            usage: Usage::Client,
            cluster: None,
            validity: DEFAULT_LEAF_VALIDITY,
        }
    }

    /// An agent client certificate naming `cluster`.
    pub fn agent(cluster: &ClusterName) -> Self {
        LeafRequest {
            common_name: format!("cluster-proxy-agent:{cluster}"),
            sans: Vec::new(),
            usage: Usage::Client,
            cluster: Some(cluster.clone()),
            validity: DEFAULT_LEAF_VALIDITY,
        }
    }

    pub fn with_validity(mut self, validity: Duration) -> Self {
        self.validity = validity;
        self
    }
}

fn validity_window(
    validity: Duration,
    now: OffsetDateTime,
) -> Result<(OffsetDateTime, OffsetDateTime), PkiError> {
    let span = time::Duration::try_from(validity).map_err(|_| PkiError::BadValidity(validity))?;
    // Back-date a little so peers with slightly skewed clocks accept new
    // certs, but by a fraction of short lifetimes only: otherwise a
    // certificate would be born past its renewal point and renewed forever.
    let tenth: time::Duration = span / 10_i32;
    let backdate = tenth.min(time::Duration::minutes(5));
    let not_before = now - backdate;
    let not_after = now
        .checked_add(span)
        .ok_or(PkiError::BadValidity(validity))?;
    Ok((not_before, not_after))
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "open-cluster-management");
    dn.push(DnType::CommonName, common_name);
    dn
}

/// A certificate authority that can issue leaves.
pub struct Authority {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

impl Authority {
    /// Creates a new self-signed CA with an ECDSA P-256 key.
    pub fn generate(common_name: &str, validity: Duration) -> Result<Self, PkiError> {
        Self::generate_at(common_name, validity, OffsetDateTime::now_utc())
    }

    /// [`Self::generate`] as of `now` (an injected clock).
    pub fn generate_at(
        common_name: &str,
        validity: Duration,
        now: OffsetDateTime,
    ) -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        (params.not_before, params.not_after) = validity_window(validity, now)?;
        let cert = params.self_signed(&key)?;
        let cert_pem = cert.pem();
        let key_pem = key.serialize_pem();
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)?;
        Ok(Authority {
            cert_pem,
            key_pem,
            issuer,
        })
    }

    /// Loads an existing CA (PEM certificate and PKCS#8 key). The key must
    /// be the certificate's: otherwise everything issued would carry a
    /// signature no peer can verify against the published CA.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, PkiError> {
        let key =
            KeyPair::from_pem(key_pem).map_err(|e| PkiError::UnreadableCaKey(e.to_string()))?;
        let (_, block) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
            .map_err(|e| PkiError::UnreadableCaCertificate(e.to_string()))?;
        let cert = block
            .parse_x509()
            .map_err(|e| PkiError::UnreadableCaCertificate(e.to_string()))?;
        if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(PkiError::CaKeyMismatch);
        }
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)
            .map_err(|e| PkiError::UnreadableCaCertificate(e.to_string()))?;
        Ok(Authority {
            cert_pem: cert_pem.to_owned(),
            key_pem: key_pem.to_owned(),
            issuer,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key (PKCS#8 PEM), for persisting it.
    pub fn key_pem(&self) -> String {
        self.key_pem.clone()
    }

    /// Issues a leaf certificate with a fresh ECDSA P-256 key.
    pub fn issue(&self, request: &LeafRequest) -> Result<Credentials, PkiError> {
        self.issue_at(request, OffsetDateTime::now_utc())
    }

    /// [`Self::issue`] as of `now` (an injected clock).
    pub fn issue_at(
        &self,
        request: &LeafRequest,
        now: OffsetDateTime,
    ) -> Result<Credentials, PkiError> {
        let key = KeyPair::generate()?;
        let params = leaf_params(request, now)?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Credentials {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Signs a certificate for the public key of a verified PKCS#10 request
    /// with the subject the request asked for. SANs, usages and validity come
    /// from `request` alone: nothing else the requester claimed is copied.
    ///
    /// The subject is kept because OCM's registration agent accepts an
    /// issued certificate only when its subject is the one it requested (it
    /// asks again otherwise); the identity proxy-server trusts is the
    /// cluster URI SAN added here, never the subject.
    ///
    /// `subject` is [`requested_subject`] of the request: rcgen's own
    /// reading of a request keeps one value per attribute type.
    pub fn sign_request_at(
        &self,
        mut csr: rcgen::CertificateSigningRequestParams,
        subject: DistinguishedName,
        request: &LeafRequest,
        now: OffsetDateTime,
    ) -> Result<String, PkiError> {
        csr.params = leaf_params(request, now)?;
        csr.params.distinguished_name = subject;
        Ok(csr.signed_by(&self.issuer)?.pem())
    }
}

/// The subject a request asks for, in a form rcgen encodes back to the same
/// bytes: one attribute per RDN, in order, each value with its string type.
/// rcgen's `DistinguishedName` holds one value per type, so the second value
/// of a standard type (OCM subjects carry several organizations, one for
/// each group) is kept as a custom type with the same OID. Multi-valued RDNs
/// and a type repeated more often than that are refused.
pub fn requested_subject(
    name: &x509_parser::x509::X509Name<'_>,
) -> Result<DistinguishedName, PkiError> {
    use x509_parser::der_parser::asn1_rs::Tag;
    let bad = |why: String| PkiError::Subject(format!("{name}: {why}"));
    let mut dn = DistinguishedName::new();
    let mut seen: Vec<DnType> = Vec::new();
    for rdn in name.iter() {
        let mut attributes = rdn.iter();
        let (Some(attribute), None) = (attributes.next(), attributes.next()) else {
            return Err(bad(
                "an RDN with other than one attribute (multi-valued RDNs are not supported)".into(),
            ));
        };
        let oid: Vec<u64> = attribute
            .attr_type()
            .iter()
            .ok_or_else(|| bad("an attribute type OID out of range".into()))?
            .collect();
        let mut dn_type = DnType::from_oid(&oid);
        if seen.contains(&dn_type) {
            dn_type = DnType::CustomDnType(oid.clone());
            if seen.contains(&dn_type) {
                return Err(bad(format!(
                    "attribute type {} more than twice",
                    attribute.attr_type()
                )));
            }
        }
        let value = attribute.attr_value();
        let text = || {
            std::str::from_utf8(value.data)
                .map_err(|_| bad(format!("a {:?} value that is not text", value.header.tag())))
        };
        let string_error = |e: rcgen::Error| bad(e.to_string());
        let dn_value = match value.header.tag() {
            Tag::Utf8String => DnValue::Utf8String(text()?.to_owned()),
            Tag::PrintableString => {
                DnValue::PrintableString(text()?.try_into().map_err(string_error)?)
            }
            Tag::Ia5String => DnValue::Ia5String(text()?.try_into().map_err(string_error)?),
            Tag::T61String => DnValue::TeletexString(text()?.try_into().map_err(string_error)?),
            Tag::BmpString => DnValue::BmpString(
                rcgen::string::BmpString::from_utf16be(value.data.to_vec())
                    .map_err(string_error)?,
            ),
            Tag::UniversalString => DnValue::UniversalString(
                rcgen::string::UniversalString::from_utf32be(value.data.to_vec())
                    .map_err(string_error)?,
            ),
            other => return Err(bad(format!("an attribute value of type {other:?}"))),
        };
        seen.push(dn_type.clone());
        dn.push(dn_type, dn_value);
    }
    Ok(dn)
}

fn leaf_params(request: &LeafRequest, now: OffsetDateTime) -> Result<CertificateParams, PkiError> {
    {
        let mut params = CertificateParams::default();
        params.distinguished_name = name(&request.common_name);
        for san in &request.sans {
            params.subject_alt_names.push(match san.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(
                    san.clone()
                        .try_into()
                        .map_err(|_| PkiError::BadSan(san.clone()))?,
                ),
            });
        }
        if let Some(cluster) = &request.cluster {
            let uri = cluster.to_uri();
            params.subject_alt_names.push(SanType::URI(
                uri.clone().try_into().map_err(|_| PkiError::BadSan(uri))?,
            ));
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![match request.usage {
            Usage::Server => ExtendedKeyUsagePurpose::ServerAuth,
            Usage::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        (params.not_before, params.not_after) = validity_window(request.validity, now)?;
        Ok(params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86400);

    #[test]
    fn a_ca_loads_only_with_its_own_readable_key() {
        let one = Authority::generate("one", DAY).unwrap();
        let other = Authority::generate("other", DAY).unwrap();
        let loaded = Authority::from_pem(one.cert_pem(), &one.key_pem()).unwrap();
        assert_eq!(loaded.cert_pem(), one.cert_pem());

        assert!(matches!(
            Authority::from_pem(one.cert_pem(), &other.key_pem()),
            Err(PkiError::CaKeyMismatch)
        ));
        assert!(matches!(
            Authority::from_pem(one.cert_pem(), "garbage"),
            Err(PkiError::UnreadableCaKey(_))
        ));
        assert!(matches!(
            Authority::from_pem("garbage", &one.key_pem()),
            Err(PkiError::UnreadableCaCertificate(_))
        ));
        let truncated = &one.cert_pem()[..one.cert_pem().len() / 2];
        assert!(matches!(
            Authority::from_pem(truncated, &one.key_pem()),
            Err(PkiError::UnreadableCaCertificate(_))
        ));
        // The message says what is wrong, not "certificate generation failed".
        let error = Authority::from_pem(one.cert_pem(), &other.key_pem()).unwrap_err();
        assert!(error.to_string().contains("does not belong"), "{error}");
    }
}
