//! A complete throwaway PKI for tests and local runs: one CA, the two server
//! certificates, the hub proxy-client certificate and one agent certificate
//! per cluster, as PEM files and as ready rustls configurations.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cert_authority::files::{self, FilesError, Layout};
use cert_authority::pki::{Authority, Credentials, LeafRequest, PkiError};
use cert_authority::tls::{self, Identity, Pem, TlsError};
use cluster_proxy_proto::identity::{ClusterName, IdentityError};
use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11};

#[derive(Debug, thiserror::Error)]
pub enum TestPkiError {
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(transparent)]
    Files(#[from] FilesError),
}

/// SANs of the server certificates: the names tests dial.
pub const SERVER_SANS: &[&str] = &["localhost", "127.0.0.1", "::1"];

pub struct TestPki {
    pub ca: Authority,
    pub proxy_server: Credentials,
    pub agent_server: Credentials,
    pub proxy_client: Credentials,
    pub agents: Vec<(ClusterName, Credentials)>,
}

fn identity(c: &Credentials, name: &str) -> Result<Identity, TlsError> {
    Identity::new(
        &Pem::text(&format!("{name}.crt"), &c.cert_pem),
        &Pem::text(&format!("{name}.key"), &c.key_pem),
    )
}

impl TestPki {
    pub fn new(clusters: &[&str]) -> Result<Self, TestPkiError> {
        Self::with_server_sans(clusters, &[])
    }

    /// [`TestPki::new`] whose server certificates also name `extra_sans`
    /// (the hub address agents dial over a network, say).
    pub fn with_server_sans(clusters: &[&str], extra_sans: &[&str]) -> Result<Self, TestPkiError> {
        let ca = Authority::generate("cluster-proxy-test-ca", Duration::from_secs(24 * 3600))?;
        let sans: Vec<&str> = SERVER_SANS.iter().chain(extra_sans).copied().collect();
        let proxy_server = ca.issue(&LeafRequest::server("proxy-server", &sans))?;
        let agent_server = ca.issue(&LeafRequest::server("agent-server", &sans))?;
        let proxy_client = ca.issue(&LeafRequest::client("proxy-client"))?;
        let agents = clusters
            .iter()
            .map(|name| {
                let cluster = ClusterName::new(*name)?;
                let creds = ca.issue(&LeafRequest::agent(&cluster))?;
                Ok((cluster, creds))
            })
            .collect::<Result<Vec<_>, TestPkiError>>()?;
        Ok(TestPki {
            ca,
            proxy_server,
            agent_server,
            proxy_client,
            agents,
        })
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, TlsError> {
        tls::roots(&Pem::text("ca.crt", self.ca.cert_pem()))
    }

    pub fn server_tls(&self) -> Result<proxy_server::ServerTls, TestPkiError> {
        Ok(proxy_server::ServerTls::fixed(
            self.frontend_server_config()?,
            self.agent_port_config(proxy_server::AGENT_PORT_ALPN)?,
        ))
    }

    /// The TLS a proxy-server's agent port serves, choosing from `alpn`,
    /// for tests that stand in for the server.
    pub fn agent_port_config(
        &self,
        alpn: &[&[u8]],
    ) -> Result<Arc<rustls::ServerConfig>, TestPkiError> {
        Ok(tls::server_config(
            identity(&self.agent_server, "agent-server")?,
            Some(self.roots()?),
            alpn,
        )?)
    }

    /// The TLS a proxy-server's client port serves (ALPN `h2` and
    /// `http/1.1`), for tests that stand in for the server.
    pub fn frontend_server_config(&self) -> Result<Arc<rustls::ServerConfig>, TestPkiError> {
        Ok(tls::server_config(
            identity(&self.proxy_server, "proxy-server")?,
            Some(self.roots()?),
            &[ALPN_H2, ALPN_HTTP11],
        )?)
    }

    /// TLS for a hub client (gRPC).
    pub fn client_tls(&self) -> Result<Arc<rustls::ClientConfig>, TestPkiError> {
        self.client_tls_alpn(&[ALPN_H2])
    }

    /// TLS for a hub client offering the given ALPN protocols.
    pub fn client_tls_alpn(
        &self,
        alpn: &[&[u8]],
    ) -> Result<Arc<rustls::ClientConfig>, TestPkiError> {
        Ok(tls::client_config(
            self.roots()?,
            Some(identity(&self.proxy_client, "proxy-client")?),
            alpn,
        )?)
    }

    /// TLS for a client that trusts the CA but presents no certificate.
    pub fn anonymous_tls(&self) -> Result<Arc<rustls::ClientConfig>, TestPkiError> {
        Ok(tls::client_config(self.roots()?, None, &[ALPN_H2])?)
    }

    /// TLS presenting the hub client certificate where an agent's is expected
    /// (a certificate that names no cluster, like upstream-issued agent certs).
    pub fn unbound_agent_tls(&self) -> Result<Arc<rustls::ClientConfig>, TestPkiError> {
        self.client_tls()
    }

    /// TLS for an agent of `cluster`.
    pub fn agent_tls(&self, cluster: &str) -> Result<Arc<rustls::ClientConfig>, TestPkiError> {
        self.agent_tls_alpn(cluster, &[ALPN_H2])
    }

    /// TLS presenting the agent certificate of `cluster`, offering `alpn`.
    pub fn agent_tls_alpn(
        &self,
        cluster: &str,
        alpn: &[&[u8]],
    ) -> Result<Arc<rustls::ClientConfig>, TestPkiError> {
        let creds = self
            .agents
            .iter()
            .find(|(c, _)| c.as_str() == cluster)
            .map(|(_, creds)| creds)
            .ok_or_else(|| IdentityError::InvalidClusterName(cluster.to_owned()))?;
        Ok(tls::client_config(
            self.roots()?,
            Some(identity(creds, "agent")?),
            alpn,
        )?)
    }

    /// Writes the PKI into `dir` in `cert-authority init`'s layout
    /// ([`cert_authority::files::Layout`]), keys with mode 0600.
    pub fn write(&self, dir: &Path) -> Result<Layout, TestPkiError> {
        let layout = Layout::new(dir);
        let ca = layout.ca();
        files::write_atomically(&ca.key, &self.ca.key_pem(), true)?;
        files::write_atomically(&ca.cert, self.ca.cert_pem(), false)?;
        files::write_atomically(&layout.bundle(), self.ca.cert_pem(), false)?;
        files::write_pair(&layout.proxy_server(), &self.proxy_server)?;
        files::write_pair(&layout.agent_server(), &self.agent_server)?;
        files::write_pair(&layout.proxy_client(), &self.proxy_client)?;
        for (cluster, credentials) in &self.agents {
            files::write_pair(&layout.agent(cluster), credentials)?;
        }
        Ok(layout)
    }
}
