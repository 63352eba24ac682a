//! Starting servers, clients and hand-driven agents on loopback for tests.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use cluster_proxy_proto::Packet;
use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::h2_channel::H2Channel;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::konnectivity::agent_service_client::AgentServiceClient;
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::transport::{TransportError, connect_channel};
use proxy_server::settings::ProxyServerSettings;
use simulated_cluster::targets::free_port;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::metadata::{MetadataMap, MetadataValue};

/// A server configuration for tests: ephemeral loopback ports, `destHost`
/// routing, short dial timeout.
pub fn test_server_config() -> ProxyServerSettings {
    ProxyServerSettings {
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
        ..ProxyServerSettings::default()
    }
}

/// A gRPC tunnel client for the server at `addr`.
pub async fn tunnel_client(
    tls: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
) -> Result<TunnelClient, TransportError> {
    let channel = H2Channel::connect("localhost", addr.port(), tls, Duration::from_secs(5)).await?;
    Ok(TunnelClient::over_h2(channel))
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
        Self::connect_as(None, tls, agent_addr, agent_id, identifiers, flow_window).await
    }

    /// [`RawAgent::connect`] without flow control, adding `extensions`
    /// (metadata key and value pairs) to its Connect request.
    pub async fn connect_with(
        extensions: &[(&'static str, &'static str)],
        tls: Arc<rustls::ClientConfig>,
        agent_addr: SocketAddr,
        agent_id: &str,
        identifiers: &str,
    ) -> Result<RawAgent, RawAgentError> {
        Self::connect_full(
            None,
            extensions,
            tls,
            agent_addr,
            agent_id,
            identifiers,
            None,
        )
        .await
    }

    /// [`RawAgent::connect`] sending `user_agent` first in its `user-agent`
    /// header (e.g. `grpc-go/1.72.0`, to be taken for a Go agent).
    pub async fn connect_as(
        user_agent: Option<&str>,
        tls: Arc<rustls::ClientConfig>,
        agent_addr: SocketAddr,
        agent_id: &str,
        identifiers: &str,
        flow_window: Option<u32>,
    ) -> Result<RawAgent, RawAgentError> {
        Self::connect_full(
            user_agent,
            &[],
            tls,
            agent_addr,
            agent_id,
            identifiers,
            flow_window,
        )
        .await
    }

    async fn connect_full(
        user_agent: Option<&str>,
        extensions: &[(&'static str, &'static str)],
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
        if let Some(v) = user_agent.and_then(|ua| MetadataValue::try_from(ua).ok()) {
            md.insert("user-agent", v);
        }
        for (key, value) in extensions {
            md.insert(*key, MetadataValue::from_static(value));
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

/// A plain-HTTP GET of `path` on a health port: the status code and body.
pub async fn health_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    health_get_over(tokio::net::TcpStream::connect(addr).await?, path).await
}

/// [`health_get`] over a connection the caller opened (from inside a
/// network namespace, say: `simulated_cluster::netns::connect_in`).
pub async fn health_get_over(
    mut tcp: tokio::net::TcpStream,
    path: &str,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut response = String::new();
    tcp.read_to_string(&mut response).await?;
    let malformed = || std::io::Error::other(format!("not an HTTP response: {response:?}"));
    let status = response
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(malformed)?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .ok_or_else(malformed)?;
    Ok((status, body))
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("proxy answered {0:?}")]
    Status(String),
}

/// A tunneled connection opened with HTTP CONNECT: the client's TLS stream,
/// writing through. A TLS stream may keep written bytes until it is flushed
/// (when its socket is full, or tokio's cooperative budget ran out), and a
/// test that writes and then only reads would wait forever; so every write
/// flushes, and a flush that could not finish is driven by later reads.
#[derive(Debug)]
pub struct ConnectStream {
    inner: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    unflushed: bool,
}

impl ConnectStream {
    fn new(inner: tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> Self {
        ConnectStream {
            inner,
            unflushed: false,
        }
    }

    /// The TLS stream underneath.
    pub fn get_ref(&self) -> &tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        &self.inner
    }

    fn poll_pending_flush(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.unflushed {
            ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
            self.unflushed = false;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for ConnectStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        // Pending here registers for writability, so the flush goes on
        // while the caller waits to read.
        if let Poll::Ready(Err(e)) = this.poll_pending_flush(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ConnectStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending_flush(cx))?;
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        this.unflushed = true;
        // Whatever this cannot finish now, a later read or write does.
        if let Poll::Ready(Err(e)) = this.poll_pending_flush(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.unflushed = false;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Opens a tunneled connection with HTTP CONNECT over mTLS (the client TLS
/// config must offer ALPN `http/1.1`). Returns the stream after the `200`.
pub async fn http_connect(
    tls: Arc<rustls::ClientConfig>,
    server: SocketAddr,
    target: &str,
) -> Result<ConnectStream, ConnectError> {
    http_connect_to(tls, server, "localhost", target).await
}

/// [`http_connect`] verifying the server certificate for `server_name`.
pub async fn http_connect_to(
    tls: Arc<rustls::ClientConfig>,
    server: SocketAddr,
    server_name: &str,
    target: &str,
) -> Result<ConnectStream, ConnectError> {
    let tcp = tokio::net::TcpStream::connect(server).await?;
    http_connect_over(tls, tcp, server_name, target).await
}

/// [`http_connect_to`] over a TCP connection the caller opened (to shape its
/// socket buffers, say).
pub async fn http_connect_over(
    tls: Arc<rustls::ClientConfig>,
    tcp: tokio::net::TcpStream,
    server_name: &str,
    target: &str,
) -> Result<ConnectStream, ConnectError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from(server_name.to_string())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await?;
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    // A TLS stream may hold written bytes until flushed.
    stream.flush().await?;
    // Read the response head byte by byte so no tunneled byte is consumed.
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await? == 0 || head.len() > 16 * 1024 {
            return Err(ConnectError::Status(
                String::from_utf8_lossy(&head).into_owned(),
            ));
        }
        head.push(byte[0]);
    }
    let mut head = String::from_utf8_lossy(&head).into_owned();
    if head.starts_with("HTTP/1.1 200") {
        return Ok(ConnectStream::new(stream));
    }
    // Failures carry the reason in a short body, then the server closes.
    let mut body = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut body)).await;
    head.push_str(&String::from_utf8_lossy(&body));
    Err(ConnectError::Status(head))
}

#[derive(Debug, thiserror::Error)]
pub enum AgentStartError {
    #[error(transparent)]
    Pki(#[from] crate::pki::TestPkiError),
    #[error("agent runtime: {0}")]
    Runtime(#[from] std::io::Error),
    #[error(transparent)]
    Agent(#[from] proxy_agent::AgentError),
    #[error("agent task failed: {0}")]
    Join(String),
    #[error("invalid host alias address {0:?}")]
    Alias(String),
}

/// A real proxy-agent running on its own tokio runtime, so a test can kill it
/// abruptly ([`AgentUnderTest::kill`]): every task and socket of the agent
/// vanishes at once, as with `kill -9`.
pub struct AgentUnderTest {
    runtime: Option<tokio::runtime::Runtime>,
    agent: Option<proxy_agent::RunningAgent>,
}

impl AgentUnderTest {
    /// Starts an agent of `cluster` (identifiers `host=<cluster>`) dialing the
    /// server's agent port; `aliases` map names to addresses like hostAliases.
    pub async fn start(
        pki: &crate::pki::TestPki,
        cluster: &str,
        agent_addr: SocketAddr,
        aliases: &[(&str, &str)],
    ) -> Result<Self, AgentStartError> {
        let mut config = proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Config(
            pki.agent_tls(cluster)?,
        ))
        .with_ephemeral_ports();
        config.proxy_server_host = "localhost".into();
        config.proxy_server_port = agent_addr.port();
        config.agent_id = format!("{cluster}-agent");
        config.agent_identifiers = format!("host={cluster}");
        config.sync_interval = Duration::from_millis(200);
        config.host_aliases = aliases
            .iter()
            .map(|(name, ip)| {
                ip.parse()
                    .map(|ip| ((*name).to_owned(), ip))
                    .map_err(|_| AgentStartError::Alias((*ip).to_owned()))
            })
            .collect::<Result<_, _>>()?;
        Self::start_with(config).await
    }

    /// Starts an agent with a full configuration.
    pub async fn start_with(
        config: proxy_agent::ProxyAgentConfig,
    ) -> Result<Self, AgentStartError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("agent-under-test")
            .enable_all()
            .build()?;
        let agent = runtime
            .spawn(proxy_agent::start(config))
            .await
            .map_err(|e| AgentStartError::Join(e.to_string()))??;
        Ok(AgentUnderTest {
            runtime: Some(runtime),
            agent: Some(agent),
        })
    }

    pub fn agent(&self) -> Option<&proxy_agent::RunningAgent> {
        self.agent.as_ref()
    }

    /// Drops every task and socket of the agent at once.
    pub fn kill(mut self) {
        self.agent.take();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }

    /// DRAIN, then a graceful stop.
    pub async fn shutdown(mut self) {
        if let (Some(agent), Some(runtime)) = (self.agent.take(), self.runtime.as_ref()) {
            let _ = runtime.spawn(agent.shutdown()).await;
        }
    }
}

impl Drop for AgentUnderTest {
    fn drop(&mut self) {
        self.agent.take();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Why [`LocalReplicas`] could not start a replica or an agent.
#[derive(Debug, thiserror::Error)]
pub enum LocalReplicasError {
    #[error(transparent)]
    Pki(#[from] crate::pki::TestPkiError),
    #[error(transparent)]
    Server(#[from] proxy_server::ServerError),
    #[error(transparent)]
    Agent(#[from] AgentStartError),
    #[error(transparent)]
    InProcessAgent(#[from] proxy_agent::AgentError),
    #[error("the agent of {cluster} did not connect to replica {index} within {within:?}")]
    NotConnected {
        cluster: String,
        index: usize,
        within: Duration,
    },
}

/// `replicas` in-process proxy-servers on loopback sharing one test PKI,
/// and agents connected to one of them by index.
pub struct LocalReplicas {
    pub pki: crate::pki::TestPki,
    pub servers: Vec<proxy_server::RunningServer>,
}

impl LocalReplicas {
    /// How long [`LocalReplicas::agent`] waits for the agent's tunnel.
    pub const CONNECT_WAIT: Duration = Duration::from_secs(10);

    pub async fn start(clusters: &[&str], replicas: usize) -> Result<Self, LocalReplicasError> {
        let pki = crate::pki::TestPki::new(clusters)?;
        let mut servers = Vec::with_capacity(replicas);
        for _ in 0..replicas {
            servers
                .push(proxy_server::start_with_tls(test_server_config(), pki.server_tls()?).await?);
        }
        Ok(LocalReplicas { pki, servers })
    }

    /// An agent of `cluster` connected to replica `index` (on a runtime of
    /// its own, so it can be killed), its name resolving to loopback.
    pub async fn agent(
        &self,
        cluster: &str,
        index: usize,
    ) -> Result<AgentUnderTest, LocalReplicasError> {
        let server = &self.servers[index];
        let before = server.tunnel_count();
        let agent = AgentUnderTest::start(
            &self.pki,
            cluster,
            server.agent_addr,
            &[(cluster, "127.0.0.1")],
        )
        .await?;
        if !wait_until(Self::CONNECT_WAIT, || server.tunnel_count() > before).await {
            return Err(LocalReplicasError::NotConnected {
                cluster: cluster.to_owned(),
                index,
                within: Self::CONNECT_WAIT,
            });
        }
        Ok(agent)
    }

    /// An agent of `cluster` connected to replica `index` on the caller's
    /// runtime (no thread of its own, so thousands fit in one process), its
    /// name resolving to loopback.
    pub async fn in_process_agent(
        &self,
        cluster: &str,
        index: usize,
    ) -> Result<proxy_agent::RunningAgent, LocalReplicasError> {
        let tls = self.pki.agent_tls(cluster)?;
        let mut config = proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Config(tls))
            .with_ephemeral_ports();
        config.proxy_server_host = "localhost".into();
        config.proxy_server_port = self.servers[index].agent_addr.port();
        config.agent_id = format!("{cluster}-agent-{index}");
        config.agent_identifiers = format!("host={cluster}");
        config.host_aliases = [(cluster.to_owned(), std::net::IpAddr::from([127, 0, 0, 1]))]
            .into_iter()
            .collect();
        Ok(proxy_agent::start(config).await?)
    }

    /// `localhost:<client port>` of replica `index` (the test server
    /// certificate names localhost).
    pub fn client_address(&self, index: usize) -> String {
        format!("localhost:{}", self.servers[index].client_addr.port())
    }
}

/// Loopback ports of one proxy-server process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerPorts {
    pub client: u16,
    pub agent: u16,
    pub health: u16,
    pub admin: u16,
}

impl ServerPorts {
    /// Four free loopback ports.
    pub fn free() -> Self {
        ServerPorts {
            client: free_port(),
            agent: free_port(),
            health: free_port(),
            admin: free_port(),
        }
    }

    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.client))
    }

    pub fn health_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.health))
    }
}

fn display(path: std::path::PathBuf) -> String {
    path.display().to_string()
}

/// The flags of a proxy-server process on `ports` of loopback, routing by
/// `destHost`, with the certificates of a test PKI written to `layout`
/// ([`crate::pki::TestPki::write`]). Callers append their own flags.
pub fn proxy_server_args(
    server_id: &str,
    ports: &ServerPorts,
    layout: &cert_authority::files::Layout,
) -> Vec<String> {
    proxy_server_args_agents_on(server_id, ports, IpAddr::from([127, 0, 0, 1]), layout)
}

/// [`proxy_server_args`] with the agent port on `agent_address` (a hub
/// address agents reach over a network) instead of loopback.
pub fn proxy_server_args_agents_on(
    server_id: &str,
    ports: &ServerPorts,
    agent_address: IpAddr,
    layout: &cert_authority::files::Layout,
) -> Vec<String> {
    vec![
        format!("--server-id={server_id}"),
        "--proxy-strategies=destHost".to_owned(),
        "--server-bind-address=127.0.0.1".to_owned(),
        format!("--server-port={}", ports.client),
        format!("--agent-bind-address={agent_address}"),
        format!("--agent-port={}", ports.agent),
        "--health-bind-address=127.0.0.1".to_owned(),
        format!("--health-port={}", ports.health),
        "--admin-bind-address=127.0.0.1".to_owned(),
        format!("--admin-port={}", ports.admin),
        format!("--server-cert={}", display(layout.proxy_server().cert)),
        format!("--server-key={}", display(layout.proxy_server().key)),
        format!("--server-ca-cert={}", display(layout.bundle())),
        format!("--cluster-cert={}", display(layout.agent_server().cert)),
        format!("--cluster-key={}", display(layout.agent_server().key)),
        format!("--cluster-ca-cert={}", display(layout.bundle())),
    ]
}

/// The flags of a proxy-agent process of `cluster` dialing a proxy-server's
/// agent port on loopback, with `cluster` resolving to 127.0.0.1 and its
/// own health and admin ports. Callers append their own flags.
pub fn proxy_agent_args(
    cluster: &ClusterName,
    agent_id: &str,
    agent_port: u16,
    layout: &cert_authority::files::Layout,
) -> Vec<String> {
    let server = SocketAddr::from(([127, 0, 0, 1], agent_port));
    proxy_agent_args_to(
        cluster,
        agent_id,
        server,
        (free_port(), free_port()),
        layout,
    )
}

/// [`proxy_agent_args`] dialing the agent port at `server` (its IP is the
/// name the server certificate must carry), with the agent's own health
/// and admin ports `(health, admin)` on its loopback.
pub fn proxy_agent_args_to(
    cluster: &ClusterName,
    agent_id: &str,
    server: SocketAddr,
    (health_port, admin_port): (u16, u16),
    layout: &cert_authority::files::Layout,
) -> Vec<String> {
    vec![
        format!("--proxy-server-host={}", server.ip()),
        format!("--proxy-server-port={}", server.port()),
        format!("--ca-cert={}", display(layout.bundle())),
        format!("--agent-cert={}", display(layout.agent(cluster).cert)),
        format!("--agent-key={}", display(layout.agent(cluster).key)),
        format!("--agent-id={agent_id}"),
        format!("--agent-identifiers=host={cluster}"),
        format!("--host-alias={cluster}=127.0.0.1"),
        "--health-server-host=127.0.0.1".to_owned(),
        format!("--health-server-port={health_port}"),
        "--admin-bind-address=127.0.0.1".to_owned(),
        format!("--admin-server-port={admin_port}"),
    ]
}
