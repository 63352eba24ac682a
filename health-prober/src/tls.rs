//! TLS to the managed clusters' kube-apiservers and to the proxy-servers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11};
use cluster_proxy_runtime::reload::{self, Watched};
use cluster_proxy_runtime::tls::{self, Identity, Pem, TlsError};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// The mTLS client config for the proxy-servers' gRPC port, rebuilt when the
/// files change on disk (the `proxy-client` Secret is renewed in place).
pub fn watch_proxy_client(
    ca: &Path,
    cert: &Path,
    key: &Path,
    interval: Duration,
) -> Result<Watched<rustls::ClientConfig>, TlsError> {
    let (ca, cert, key): (PathBuf, PathBuf, PathBuf) = (ca.into(), cert.into(), key.into());
    let paths = vec![ca.clone(), cert.clone(), key.clone()];
    reload::watch_files(
        "proxy-server client credentials",
        paths,
        interval,
        move || proxy_client(&ca, &cert, &key),
    )
}

/// The same, read once.
pub fn proxy_client(
    ca: &Path,
    cert: &Path,
    key: &Path,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let roots = tls::roots(&Pem::file("proxy-server CA", ca)?)?;
    tls::client_config(roots, Some(Identity::from_files(cert, key)?), &[ALPN_H2])
}

/// TLS to the kube-apiservers: verified against `ca`, or (`None`) not
/// verified at all, as `clusteradm proxy health` does: the hub has no CA
/// for managed API servers, and the tunnel itself is authenticated.
pub fn target_client(ca: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    match ca {
        Some(ca) => {
            let roots = tls::roots(&Pem::file("kube-apiserver CA", ca)?)?;
            tls::client_config(roots, None, &[ALPN_HTTP11])
        }
        None => {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| TlsError::Config(e.to_string()))?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
            Ok(Arc::new(config))
        }
    }
}

/// Accepts any certificate, but still checks the handshake signatures (so
/// the peer holds the key of the certificate it sent).
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
