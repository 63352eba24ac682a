//! The on-disk PKI layout of the `files` backend, and `cert-authority init`.
//!
//! ```text
//! DIR/ca/tls.crt, DIR/ca/tls.key        the signing CA (key 0600)
//! DIR/ca-bundle.crt                     the trust bundle every hop verifies against
//! DIR/proxy-server/tls.{crt,key}        client port of proxy-server (server cert)
//! DIR/agent-server/tls.{crt,key}        agent port of proxy-server (server cert)
//! DIR/proxy-client/tls.{crt,key}        hub clients of the tunnel (client cert)
//! DIR/agents/<cluster>/tls.{crt,key}    one agent client cert per cluster, naming it
//! ```
//!
//! The directory names match the Kubernetes Secrets of the `kubernetes`
//! backend (`proxy-server`, `agent-server`, `proxy-client`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use cluster_proxy_proto::identity::ClusterName;

use crate::pki::{Authority, Credentials, DEFAULT_CA_VALIDITY, LeafRequest, PkiError};

pub const CA_DIR: &str = "ca";
pub const BUNDLE_FILE: &str = "ca-bundle.crt";
pub const PROXY_SERVER: &str = "proxy-server";
pub const AGENT_SERVER: &str = "agent-server";
pub const PROXY_CLIENT: &str = "proxy-client";
pub const AGENTS_DIR: &str = "agents";
/// Service access (when wanted): the user-server's serving certificate, its
/// identity toward service-proxies, and the service-proxies' serving one.
pub const USER_SERVER: &str = "user-server";
pub const USER_SERVER_IDENTITY: &str = "user-server-identity";
pub const SERVICE_PROXY: &str = "service-proxy";
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";

/// SANs every server certificate gets, so local runs work out of the box.
pub const LOCAL_SANS: &[&str] = &["localhost", "127.0.0.1", "::1"];

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} already holds a CA; refusing to overwrite it (remove the directory or pick another)", .0.display())]
    AlreadyInitialized(PathBuf),
}

/// What `init` issues.
#[derive(Debug, Clone)]
pub struct InitOptions {
    pub clusters: Vec<ClusterName>,
    /// Extra SANs for both server certificates (upstream's `additionalSANs`).
    pub additional_sans: Vec<String>,
    pub leaf_validity: Duration,
    pub ca_validity: Duration,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            clusters: Vec::new(),
            additional_sans: Vec::new(),
            leaf_validity: crate::pki::DEFAULT_LEAF_VALIDITY,
            ca_validity: DEFAULT_CA_VALIDITY,
        }
    }
}

/// Paths of one certificate and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The layout under one directory.
#[derive(Debug, Clone)]
pub struct Layout {
    pub dir: PathBuf,
}

impl Layout {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Layout { dir: dir.into() }
    }

    fn pair(&self, sub: &Path) -> Pair {
        let dir = self.dir.join(sub);
        Pair {
            cert: dir.join(CERT_FILE),
            key: dir.join(KEY_FILE),
        }
    }

    pub fn ca(&self) -> Pair {
        self.pair(Path::new(CA_DIR))
    }

    pub fn bundle(&self) -> PathBuf {
        self.dir.join(BUNDLE_FILE)
    }

    pub fn proxy_server(&self) -> Pair {
        self.pair(Path::new(PROXY_SERVER))
    }

    pub fn agent_server(&self) -> Pair {
        self.pair(Path::new(AGENT_SERVER))
    }

    pub fn proxy_client(&self) -> Pair {
        self.pair(Path::new(PROXY_CLIENT))
    }

    pub fn agent(&self, cluster: &ClusterName) -> Pair {
        self.pair(&Path::new(AGENTS_DIR).join(cluster.as_str()))
    }

    pub fn user_server(&self) -> Pair {
        self.pair(Path::new(USER_SERVER))
    }

    pub fn user_server_identity(&self) -> Pair {
        self.pair(Path::new(USER_SERVER_IDENTITY))
    }

    pub fn service_proxy(&self) -> Pair {
        self.pair(Path::new(SERVICE_PROXY))
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FilesError + '_ {
    move |source| FilesError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Writes `content` to `path` atomically (temp file + rename), so a watcher
/// never reads half a file; keys are created with mode 0600.
pub fn write_atomically(path: &Path, content: &str, private: bool) -> Result<(), FilesError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(io(&tmp))?;
    file.write_all(content.as_bytes()).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

pub fn write_pair(pair: &Pair, credentials: &Credentials) -> Result<(), FilesError> {
    write_atomically(&pair.key, &credentials.key_pem, true)?;
    write_atomically(&pair.cert, &credentials.cert_pem, false)
}

/// The server certificate SANs: local names plus the additional ones.
pub fn server_sans(additional: &[String]) -> Vec<String> {
    let mut sans: Vec<String> = LOCAL_SANS.iter().map(|s| (*s).to_owned()).collect();
    for san in additional {
        if !sans.contains(san) {
            sans.push(san.clone());
        }
    }
    sans
}

/// Creates a complete PKI under `layout.dir`: CA, bundle, both server
/// certificates, the proxy-client certificate and one agent certificate per
/// cluster. Refuses to overwrite an existing CA.
pub fn init(layout: &Layout, options: &InitOptions) -> Result<Authority, FilesError> {
    let ca_pair = layout.ca();
    if ca_pair.cert.exists() || ca_pair.key.exists() {
        return Err(FilesError::AlreadyInitialized(layout.dir.clone()));
    }
    let ca = Authority::generate("cluster-proxy-ca", options.ca_validity)?;
    write_atomically(&ca_pair.key, &ca.key_pem(), true)?;
    write_atomically(&ca_pair.cert, ca.cert_pem(), false)?;
    write_atomically(&layout.bundle(), ca.cert_pem(), false)?;
    let sans = server_sans(&options.additional_sans);
    let sans: Vec<&str> = sans.iter().map(String::as_str).collect();
    let validity = options.leaf_validity;
    write_pair(
        &layout.proxy_server(),
        &ca.issue(&LeafRequest::server(PROXY_SERVER, &sans).with_validity(validity))?,
    )?;
    write_pair(
        &layout.agent_server(),
        &ca.issue(&LeafRequest::server(AGENT_SERVER, &sans).with_validity(validity))?,
    )?;
    write_pair(
        &layout.proxy_client(),
        &ca.issue(&LeafRequest::client(PROXY_CLIENT).with_validity(validity))?,
    )?;
    for cluster in &options.clusters {
        write_pair(
            &layout.agent(cluster),
            &ca.issue(&LeafRequest::agent(cluster).with_validity(validity))?,
        )?;
    }
    Ok(ca)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::cluster_of;
    use crate::tls::{Identity, Pem, roots};
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;

    #[test]
    fn init_writes_a_complete_usable_pki_and_refuses_to_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let cluster = ClusterName::new("cluster-a").unwrap();
        init(
            &layout,
            &InitOptions {
                clusters: vec![cluster.clone()],
                additional_sans: vec!["proxy.example.com".into()],
                ..InitOptions::default()
            },
        )
        .unwrap();
        roots(&Pem::file("bundle", &layout.bundle()).unwrap()).unwrap();
        for pair in [
            layout.proxy_server(),
            layout.agent_server(),
            layout.proxy_client(),
            layout.agent(&cluster),
        ] {
            Identity::from_files(&pair.cert, &pair.key).unwrap();
        }
        let agent_pem = std::fs::read(layout.agent(&cluster).cert).unwrap();
        let der = CertificateDer::from_pem_slice(&agent_pem).unwrap();
        assert_eq!(cluster_of(&der).unwrap(), Some(cluster));
        let server_pem = std::fs::read_to_string(layout.proxy_server().cert).unwrap();
        let der = CertificateDer::from_pem_slice(server_pem.as_bytes()).unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).unwrap();
        let san = parsed.subject_alternative_name().unwrap().unwrap();
        assert!(format!("{:?}", san.value).contains("proxy.example.com"));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(layout.ca().key)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(matches!(
            init(&layout, &InitOptions::default()),
            Err(FilesError::AlreadyInitialized(_))
        ));
    }
}
