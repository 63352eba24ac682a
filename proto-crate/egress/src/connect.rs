//! Setting up the tunnel through each kind of proxy.

use std::path::Path;
use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::proxy::SocksV5;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tower::Service;

use crate::error::EgressError;
use crate::rules::{Credentials, ProxyScheme, ProxyUrl};
use crate::stream::EgressStream;
use crate::tcp;

/// How to speak to a proxy besides its URL.
pub(crate) struct ProxyDial<'a> {
    /// Verifies an `https://` proxy.
    pub proxy_ca_file: Option<&'a Path>,
    /// Wins over the URL's userinfo; read at every connection.
    pub credentials_file: Option<&'a Path>,
    pub user_agent: &'a http::HeaderValue,
}

/// `host:port`, IPv6 bracketed.
fn host_port(host: &str, port: u16) -> String {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

pub(crate) async fn direct(host: &str, port: u16) -> Result<EgressStream, EgressError> {
    let target = host_port(host, port);
    tcp::connect(&target)
        .await
        .map(EgressStream::Tcp)
        .map_err(|source| EgressError::Direct { target, source })
}

pub(crate) async fn through(
    dial: &ProxyDial<'_>,
    proxy: &ProxyUrl,
    host: &str,
    port: u16,
) -> Result<EgressStream, EgressError> {
    let credentials = match dial.credentials_file {
        Some(path) => Some(read_credentials(path)?),
        None => proxy.credentials.clone(),
    };
    let proxy_name = proxy.to_string();
    let target = host_port(host, port);
    let tcp = tcp::connect(&host_port(&proxy.host, proxy.port))
        .await
        .map_err(|source| EgressError::ProxyUnreachable {
            proxy: proxy_name.clone(),
            source,
        })?;
    let connect = HttpConnect {
        proxy: &proxy_name,
        target: &target,
        credentials: credentials.as_ref(),
        user_agent: dial.user_agent,
    };
    match proxy.scheme {
        ProxyScheme::Http => connect.over(tcp).await.map(EgressStream::Proxied),
        ProxyScheme::Https => {
            let config = proxy_tls_config(proxy, dial.proxy_ca_file)?;
            let server_name =
                ServerName::try_from(proxy.host.clone()).map_err(|_| EgressError::ProxyCa {
                    proxy: proxy_name.clone(),
                    reason: format!("{:?} is not a valid TLS server name", proxy.host),
                })?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(server_name, tcp)
                .await
                .map_err(|source| EgressError::ProxyTls {
                    proxy: proxy_name.clone(),
                    source,
                })?;
            let tls = connect.over(tls).await?;
            Ok(EgressStream::ProxyTls(Box::new(tls)))
        }
        ProxyScheme::Socks5 { remote_dns } => {
            socks5(
                tcp,
                &proxy_name,
                host,
                port,
                remote_dns,
                credentials.as_ref(),
            )
            .await
        }
    }
}

/// Reads Basic credentials from `path`: a directory holding `username` and
/// `password` (a mounted `kubernetes.io/basic-auth` Secret), or a file
/// `user:password`. One trailing newline is not part of a value.
pub fn read_credentials(path: &Path) -> Result<Credentials, EgressError> {
    let failed = |reason: String| EgressError::Credentials {
        path: path.to_owned(),
        reason,
    };
    let read = |file: &Path| {
        std::fs::read_to_string(file)
            .map(|text| {
                let text = text.strip_suffix('\n').unwrap_or(&text);
                text.strip_suffix('\r').unwrap_or(text).to_owned()
            })
            .map_err(|e| failed(format!("{}: {e}", file.display())))
    };
    let credentials = if path.is_dir() {
        Credentials {
            username: read(&path.join("username"))?,
            password: read(&path.join("password"))?,
        }
    } else {
        let text = read(path)?;
        let (username, password) = text
            .split_once(':')
            .ok_or_else(|| failed("expected user:password".to_owned()))?;
        Credentials {
            username: username.to_owned(),
            password: password.to_owned(),
        }
    };
    if credentials.username.is_empty() {
        return Err(failed("the user name is empty".to_owned()));
    }
    Ok(credentials)
}

/// The TLS configuration that verifies an `https://` proxy: `ca_file`'s
/// certificates, else the system's roots.
pub(crate) fn proxy_tls_config(
    proxy: &ProxyUrl,
    ca_file: Option<&Path>,
) -> Result<Arc<rustls::ClientConfig>, EgressError> {
    let failed = |reason: String| EgressError::ProxyCa {
        proxy: proxy.to_string(),
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certificates = CertificateDer::pem_file_iter(path)
                .map_err(|e| failed(format!("{}: {e}", path.display())))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| failed(format!("{}: {e}", path.display())))?;
            let (added, _) = roots.add_parsable_certificates(certificates);
            if added == 0 {
                return Err(failed(format!("{} holds no certificate", path.display())));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(native.certs);
            if roots.is_empty() {
                return Err(failed(
                    "no --proxy-ca-cert given and the system has no CA certificates".to_owned(),
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| failed(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// One HTTP CONNECT exchange.
struct HttpConnect<'a> {
    proxy: &'a str,
    target: &'a str,
    credentials: Option<&'a Credentials>,
    user_agent: &'a http::HeaderValue,
}

impl HttpConnect<'_> {
    /// Sends CONNECT over `io` and hands `io` back once the proxy answered
    /// 2xx; the caller's bytes then go to the target.
    async fn over<IO>(&self, io: IO) -> Result<IO, EgressError>
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let protocol = |detail: String| EgressError::ProxyProtocol {
            proxy: self.proxy.to_owned(),
            detail,
        };
        let mut request = http::Request::connect(self.target)
            .header(http::header::HOST, self.target)
            .header(http::header::USER_AGENT, self.user_agent.clone());
        if let Some(credentials) = self.credentials {
            request = request.header(http::header::PROXY_AUTHORIZATION, basic(credentials));
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| protocol(format!("CONNECT {}: {e}", self.target)))?;
        let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
            .handshake::<_, Empty<Bytes>>(TokioIo::new(io))
            .await
            .map_err(|e| self.hyper_error(e))?;
        let mut connection = connection.with_upgrades();
        // The request goes out and the answer comes in only while the
        // connection is polled. After a 2xx to CONNECT the connection hands
        // its IO to the upgrade and ends, possibly before the response is
        // seen here; when it ends without one, the response fails.
        let mut connection_ended = false;
        let response = {
            let sent = sender.send_request(request);
            tokio::pin!(sent);
            loop {
                tokio::select! {
                    response = &mut sent => break response.map_err(|e| self.hyper_error(e))?,
                    ended = &mut connection, if !connection_ended => {
                        ended.map_err(|e| self.hyper_error(e))?;
                        connection_ended = true;
                    }
                }
            }
        };
        let status = response.status();
        if !status.is_success() {
            return Err(self.refused(&response));
        }
        let upgraded = if connection_ended {
            hyper::upgrade::on(response).await
        } else {
            let (upgraded, ended) = tokio::join!(hyper::upgrade::on(response), connection);
            ended.map_err(|e| self.hyper_error(e))?;
            upgraded
        };
        let upgraded = upgraded.map_err(|e| self.hyper_error(e))?;
        let parts = upgraded
            .downcast::<TokioIo<IO>>()
            .map_err(|_| protocol("the upgraded connection is not the one dialed".to_owned()))?;
        if !parts.read_buf.is_empty() {
            // A TLS target speaks only after our ClientHello: these bytes
            // came from the proxy, not the target.
            return Err(protocol(format!(
                "{} bytes followed its {status} answer before the tunnel was used",
                parts.read_buf.len()
            )));
        }
        Ok(parts.io.into_inner())
    }

    fn closed(&self) -> EgressError {
        EgressError::ProxyClosed {
            proxy: self.proxy.to_owned(),
            target: self.target.to_owned(),
        }
    }

    fn hyper_error(&self, error: hyper::Error) -> EgressError {
        if error.is_incomplete_message() || error.is_canceled() || error.is_closed() {
            return self.closed();
        }
        let mut detail = error.to_string();
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            detail.push_str(": ");
            detail.push_str(&cause.to_string());
            source = cause.source();
        }
        EgressError::ProxyProtocol {
            proxy: self.proxy.to_owned(),
            detail,
        }
    }

    fn refused<B>(&self, response: &http::Response<B>) -> EgressError {
        let status = response.status();
        // A 401 to CONNECT comes from the proxy too (the target has not been
        // reached): tinyproxy answers so when it rejects the credentials.
        if status == http::StatusCode::PROXY_AUTHENTICATION_REQUIRED
            || status == http::StatusCode::UNAUTHORIZED
        {
            let challenge = response
                .headers()
                .get_all(http::header::PROXY_AUTHENTICATE)
                .iter()
                .filter_map(|value| value.to_str().ok())
                .filter_map(|value| value.split_whitespace().next())
                .collect::<Vec<_>>();
            return EgressError::ProxyAuthentication {
                proxy: self.proxy.to_owned(),
                target: self.target.to_owned(),
                status,
                sent_credentials: self.credentials.is_some(),
                challenge: (!challenge.is_empty()).then(|| challenge.join(", ")),
            };
        }
        EgressError::ProxyRefused {
            proxy: self.proxy.to_owned(),
            target: self.target.to_owned(),
            status,
        }
    }
}

fn basic(credentials: &Credentials) -> http::HeaderValue {
    let encoded = base64::engine::general_purpose::STANDARD
        .encode(format!("{}:{}", credentials.username, credentials.password));
    // Base64 is always a valid header value.
    let mut value = http::HeaderValue::from_str(&format!("Basic {encoded}"))
        .unwrap_or_else(|_| http::HeaderValue::from_static("Basic"));
    value.set_sensitive(true);
    value
}

/// The SOCKS5 handshake on an open connection to the proxy. For
/// `socks5://` the target's name is resolved here (hyper-util would do it
/// with a blocking call), for `socks5h://` by the proxy.
async fn socks5(
    tcp: TcpStream,
    proxy: &str,
    host: &str,
    port: u16,
    remote_dns: bool,
    credentials: Option<&Credentials>,
) -> Result<EgressStream, EgressError> {
    let target = host_port(host, port);
    let address = if remote_dns {
        target.clone()
    } else {
        let resolved = tokio::net::lookup_host(&target)
            .await
            .and_then(|mut addresses| {
                addresses
                    .next()
                    .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))
            })
            .map_err(|source| EgressError::Resolve {
                proxy: proxy.to_owned(),
                target: target.clone(),
                source,
            })?;
        resolved.to_string()
    };
    let failed = |detail: String| EgressError::Socks {
        proxy: proxy.to_owned(),
        target: target.clone(),
        detail,
    };
    let destination: http::Uri = format!("socks://{address}")
        .parse()
        .map_err(|e| failed(format!("{address}: {e}")))?;
    // The connection is already open: hand it to the handshake once.
    let mut opened = Some(TokioIo::new(tcp));
    let preconnected = tower::service_fn(move |_: http::Uri| {
        let io = opened
            .take()
            .ok_or_else(|| std::io::Error::other("the connection to the proxy was already used"));
        std::future::ready(io)
    });
    let mut handshake = SocksV5::new(destination.clone(), preconnected).local_dns(false);
    if let Some(credentials) = credentials {
        handshake = handshake.with_auth(credentials.username.clone(), credentials.password.clone());
    }
    // hyper-util's SOCKS errors do not expose their cause through
    // `source()`; their Debug form holds it (the reply code, the I/O error).
    let io = handshake
        .call(destination)
        .await
        .map_err(|e| failed(format!("{e} ({e:?})")))?;
    Ok(EgressStream::Proxied(io.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_a_file_or_a_mounted_secret() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("credentials");
        std::fs::write(&file, "alice:s3:cret\n").unwrap();
        let credentials = read_credentials(&file).unwrap();
        assert_eq!(
            (credentials.username.as_str(), credentials.password.as_str()),
            ("alice", "s3:cret")
        );
        let secret = dir.path().join("secret");
        std::fs::create_dir(&secret).unwrap();
        std::fs::write(secret.join("username"), "bob").unwrap();
        std::fs::write(secret.join("password"), "pw\r\n").unwrap();
        let credentials = read_credentials(&secret).unwrap();
        assert_eq!(
            (credentials.username.as_str(), credentials.password.as_str()),
            ("bob", "pw")
        );
        std::fs::write(&file, "no-colon").unwrap();
        let err = read_credentials(&file).unwrap_err().to_string();
        assert!(err.contains("user:password"), "{err}");
        std::fs::remove_file(secret.join("password")).unwrap();
        let err = read_credentials(&secret).unwrap_err().to_string();
        assert!(err.contains("password"), "{err}");
        assert!(read_credentials(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn basic_authorization_is_marked_sensitive() {
        let value = basic(&Credentials {
            username: "alice".into(),
            password: "pw".into(),
        });
        assert!(value.is_sensitive());
        assert_eq!(value.to_str().unwrap(), "Basic YWxpY2U6cHc=");
    }
}
