//! Starting servers, clients and hand-driven agents on loopback for tests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::Packet;
use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::konnectivity::agent_service_client::AgentServiceClient;
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::transport::{TransportError, connect_channel};
use proxy_server::config::ServerConfig;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::metadata::{MetadataMap, MetadataValue};

/// A server configuration for tests: ephemeral loopback ports, `destHost`
/// routing, short dial timeout.
pub fn test_server_config() -> ServerConfig {
    ServerConfig {
        server_port: 0,
        agent_port: 0,
        health_port: 0,
        admin_port: 0,
        server_bind_address: "127.0.0.1".into(),
        agent_bind_address: "127.0.0.1".into(),
        health_bind_address: "127.0.0.1".into(),
        admin_bind_address: "127.0.0.1".into(),
        proxy_strategies: "destHost".into(),
        backend_dial_timeout: Duration::from_secs(5),
        ..ServerConfig::default()
    }
}

/// A gRPC tunnel client for the server at `addr`.
pub async fn tunnel_client(
    tls: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
) -> Result<TunnelClient, TransportError> {
    let channel = connect_channel("localhost", addr.port(), tls, Duration::from_secs(5)).await?;
    Ok(TunnelClient::new(channel))
}

#[derive(Debug, thiserror::Error)]
pub enum RawAgentError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("connect refused: {0}")]
    Refused(#[from] tonic::Status),
}

/// An agent driven packet by packet, to test the server's protocol handling.
pub struct RawAgent {
    pub to_server: mpsc::Sender<Packet>,
    pub from_server: Streaming<Packet>,
    pub headers: MetadataMap,
}

impl RawAgent {
    pub async fn connect(
        tls: Arc<rustls::ClientConfig>,
        agent_addr: SocketAddr,
        agent_id: &str,
        identifiers: &str,
        flow_window: Option<u32>,
    ) -> Result<RawAgent, RawAgentError> {
        let channel =
            connect_channel("localhost", agent_addr.port(), tls, Duration::from_secs(5)).await?;
        let (to_server, rx) = mpsc::channel(64);
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        let md = request.metadata_mut();
        if let Ok(v) = MetadataValue::try_from(agent_id) {
            md.insert(metadata::AGENT_ID, v);
        }
        if let Ok(v) = MetadataValue::try_from(identifiers) {
            md.insert(metadata::AGENT_IDENTIFIERS, v);
        }
        if let Some(w) = flow_window {
            md.insert(metadata::FLOW_CONTROL_WINDOW, MetadataValue::from(w));
        }
        let response = AgentServiceClient::new(channel).connect(request).await?;
        let headers = response.metadata().clone();
        Ok(RawAgent {
            to_server,
            from_server: response.into_inner(),
            headers,
        })
    }

    /// The next packet from the server, failing the test after `timeout`.
    pub async fn recv(&mut self, timeout: Duration) -> Option<Packet> {
        tokio::time::timeout(timeout, self.from_server.message())
            .await
            .ok()
            .and_then(|r| r.ok())
            .flatten()
    }
}

/// Polls `condition` every 20 ms until it holds or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    condition()
}
