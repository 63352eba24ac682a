//! PEM files an operator (or a mounted Secret) hands the services: the
//! runtime's credential loading (certificate chain, private key, CA bundle),
//! the cert-authority's CA loading, and the peer-identity reading of each
//! certificate found. Any bytes end in a value or a clear error.
#![no_main]

use cert_authority::pki::Authority;
use cluster_proxy_runtime::peer::{cluster_of, subject_of};
use cluster_proxy_runtime::tls::{Identity, Pem, roots};
use libfuzzer_sys::fuzz_target;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let pem = Pem::text("fuzz", text);
    let _ = Identity::new(&pem, &pem);
    let _ = roots(&pem);
    let _ = Authority::from_pem(text, text);
    for cert in CertificateDer::pem_slice_iter(data).flatten() {
        let _ = cluster_of(&cert);
        let _ = subject_of(&cert);
    }
});
