//! A minimal CA for this crate's unit tests (the real PKI lives in
//! cert-authority, which depends on this crate).

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};

pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pub cert_pem: String,
}

pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "test-ca");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    fn issue(&self, mut params: CertificateParams) -> Leaf {
        let key = KeyPair::generate().unwrap();
        params.is_ca = IsCa::ExplicitNoCa;
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    pub fn server(&self, name: &str) -> Leaf {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params)
    }

    /// A server certificate whose validity ended an hour ago.
    pub fn expired_server(&self, name: &str) -> Leaf {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(2);
        params.not_after = now - time::Duration::hours(1);
        self.issue(params)
    }

    /// A client certificate; with `uri`, carrying it as a URI SAN.
    pub fn client(&self, name: &str, uri: Option<&str>) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        if let Some(uri) = uri {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().unwrap()));
        }
        self.issue(params)
    }
}
