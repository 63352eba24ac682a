//! A CertificateSigningRequest's `spec.request`, as an approved OCM agent
//! could write it: the cert-authority's checks (PEM, PKCS#10, key strength,
//! claimed clusters, signature) must refuse or sign, never panic, and a
//! signed certificate names the requester's cluster.
#![no_main]

use std::sync::LazyLock;
use std::time::Duration;

use cert_authority::kubernetes::csr::{Decision, SIGNER_NAME, decide};
use cert_authority::pki::Authority;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition, CertificateSigningRequestSpec,
    CertificateSigningRequestStatus,
};
use libfuzzer_sys::fuzz_target;

static SIGNER: LazyLock<Authority> = LazyLock::new(|| {
    Authority::generate("fuzz-signer", Duration::from_secs(3600)).expect("a signer")
});

fuzz_target!(|request: &[u8]| {
    let csr = CertificateSigningRequest {
        spec: CertificateSigningRequestSpec {
            signer_name: SIGNER_NAME.to_owned(),
            request: ByteString(request.to_vec()),
            username: Some("system:open-cluster-management:cluster-a:agent".to_owned()),
            groups: Some(vec!["system:open-cluster-management:cluster-a".to_owned()]),
            ..Default::default()
        },
        status: Some(CertificateSigningRequestStatus {
            conditions: Some(vec![CertificateSigningRequestCondition {
                type_: "Approved".to_owned(),
                status: "True".to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let now = time::OffsetDateTime::now_utc();
    match decide(&csr, &SIGNER, Duration::from_secs(3600), now) {
        Decision::Sign { cluster, .. } => assert_eq!(cluster.as_str(), "cluster-a"),
        Decision::Refuse { .. } => {}
        Decision::Ignore(why) => panic!("an approved CSR for our signer was ignored: {why}"),
    }
});
