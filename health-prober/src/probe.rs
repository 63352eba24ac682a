//! One probe: through one replica, dial `<cluster>:<port>`, TLS handshake,
//! `GET /healthz`, timing each phase.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::client::DialError;
use cluster_proxy_proto::connector::{ConnectError, TunnelConnector};
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

/// The phases a probe times (the `phase` label of the latency histogram).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Dial,
    Tls,
    FirstByte,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Dial => "dial",
            Phase::Tls => "tls",
            Phase::FirstByte => "first_byte",
        }
    }
}

/// What one replica saw of one cluster.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProbeOutcome {
    pub dial: Option<Duration>,
    pub tls: Option<Duration>,
    pub first_byte: Option<Duration>,
    /// The HTTP status of `/healthz`, when the request got that far.
    pub status: Option<u16>,
    /// Why the probe failed (`None`: `/healthz` answered 200).
    pub error: Option<String>,
    /// The failure was the replica's (its gRPC stream), not the cluster's.
    pub replica_failed: bool,
}

impl ProbeOutcome {
    pub fn healthy(&self) -> bool {
        self.error.is_none()
    }

    /// Dial + TLS + first byte, when all three were measured.
    pub fn total(&self) -> Option<Duration> {
        Some(self.dial? + self.tls? + self.first_byte?)
    }

    fn failed(mut self, error: String) -> Self {
        self.error = Some(error);
        self
    }
}

/// What a probe needs besides the replica.
#[derive(Clone)]
pub struct ProbeTarget {
    pub port: u16,
    /// TLS to the cluster's kube-apiserver (ALPN `http/1.1`).
    pub tls: Arc<rustls::ClientConfig>,
    pub timeout: Duration,
}

/// Probes `cluster` through `connector`; never fails, the outcome says why.
pub async fn probe(
    connector: &TunnelConnector,
    target: &ProbeTarget,
    cluster: &str,
) -> ProbeOutcome {
    let deadline = Instant::now() + target.timeout;
    let mut outcome = ProbeOutcome::default();
    let timed_out =
        |phase: Phase| format!("{} timed out after {:?}", phase.as_str(), target.timeout);

    let server_name = match ServerName::try_from(cluster.to_owned()) {
        Ok(name) => name,
        Err(_) => return outcome.failed(format!("{cluster:?} is not a DNS name")),
    };
    let uri: http::Uri = match format!("https://{cluster}:{}/healthz", target.port).parse() {
        Ok(uri) => uri,
        Err(_) => return outcome.failed(format!("{cluster:?} does not form a URL")),
    };

    let started = Instant::now();
    let stream = match tokio::time::timeout_at(deadline, connector.connect(&uri)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            outcome.replica_failed = matches!(
                error,
                ConnectError::Tunnel {
                    source: DialError::Stream(_),
                    ..
                }
            );
            return outcome.failed(format!("dial: {}", describe_connect(&error)));
        }
        Err(_) => return outcome.failed(timed_out(Phase::Dial)),
    };
    outcome.dial = Some(started.elapsed());

    let started = Instant::now();
    let tls = TlsConnector::from(target.tls.clone());
    let stream = match tokio::time::timeout_at(deadline, tls.connect(server_name, stream)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => return outcome.failed(format!("tls: {error}")),
        Err(_) => return outcome.failed(timed_out(Phase::Tls)),
    };
    outcome.tls = Some(started.elapsed());

    let started = Instant::now();
    let exchange = async {
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await?;
        // The connection task ends with the probe: it owns the only sender.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let request = http::Request::get("/healthz")
            .header(http::header::HOST, format!("{cluster}:{}", target.port))
            .body(Empty::new());
        match request {
            Ok(request) => sender.send_request(request).await.map(|r| r.status()),
            // Host values built from a DNS name and a port are always valid.
            Err(_) => Ok(http::StatusCode::BAD_REQUEST),
        }
    };
    match tokio::time::timeout_at(deadline, exchange).await {
        Ok(Ok(status)) => {
            outcome.first_byte = Some(started.elapsed());
            outcome.status = Some(status.as_u16());
            if status != http::StatusCode::OK {
                outcome.error = Some(format!("/healthz answered {}", status.as_u16()));
            }
            outcome
        }
        Ok(Err(error)) => outcome.failed(format!("http: {error}")),
        Err(_) => outcome.failed(timed_out(Phase::FirstByte)),
    }
}

fn describe_connect(error: &ConnectError) -> String {
    match error {
        ConnectError::NoAgent { .. } => "no agent connected".into(),
        other => other.to_string(),
    }
}
