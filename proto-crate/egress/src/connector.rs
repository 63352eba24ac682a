//! [`Egress`] as a connector for hyper's pooled client (kube-rs and the
//! HTTPS clients build on it): each new connection follows the proxy rules.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;

use crate::egress::Egress;
use crate::error::EgressError;
use crate::stream::EgressStream;

/// Opens connections for hyper's client by [`Egress`]'s rules; TLS to the
/// target is the caller's (hyper-rustls wraps this connector).
#[derive(Debug, Clone, Default)]
pub struct EgressConnector {
    egress: Egress,
}

impl EgressConnector {
    pub fn new(egress: Egress) -> Self {
        EgressConnector { egress }
    }
}

impl tower::Service<http::Uri> for EgressConnector {
    type Response = TokioIo<EgressStream>;
    type Error = EgressError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, EgressError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), EgressError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let egress = self.egress.clone();
        Box::pin(async move {
            let tls = uri.scheme() != Some(&http::uri::Scheme::HTTP);
            let host = uri.host().unwrap_or_default().to_owned();
            let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
            if host.is_empty() {
                return Err(EgressError::Direct {
                    target: uri.to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "the URL has no host",
                    ),
                });
            }
            egress.connect(&host, port, tls).await.map(TokioIo::new)
        })
    }
}
