//! Credentials rotate under continuous traffic: server certificates, then the
//! agent certificate, then the CA (bundle with old and new first, new only
//! last). No tunneled connection drops; new handshakes use the new
//! credentials; a certificate from the retired CA is refused afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cert_authority::files::{InitOptions, Layout, init, write_atomically, write_pair};
use cert_authority::pki::{Authority, LeafRequest};
use cert_authority::tls::{self, Identity, Pem};
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::transport::ALPN_H2;
use simulated_cluster::targets::EchoServer;
use simulated_cluster::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{AgentUnderTest, test_server_config, tunnel_client};

const RELOAD: Duration = Duration::from_millis(100);
const STEP: Duration = Duration::from_secs(10);

fn client_tls(layout: &Layout) -> Arc<rustls::ClientConfig> {
    let pair = layout.proxy_client();
    tls::client_config(
        tls::roots(&Pem::file("bundle", &layout.bundle()).unwrap()).unwrap(),
        Some(Identity::from_files(&pair.cert, &pair.key).unwrap()),
        &[ALPN_H2],
    )
    .unwrap()
}

/// Waits until a fresh handshake with the client port presents the
/// certificate now in `layout`'s proxy-server files.
async fn server_presents_current_cert(layout: &Layout, port: u16) -> bool {
    let expected = der_of(&layout.proxy_server().cert);
    for _ in 0..50 {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        if let Ok(stream) = tokio_rustls::TlsConnector::from(client_tls(layout))
            .connect(name, tcp)
            .await
            && stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.to_vec())
                == Some(expected.clone())
        {
            return true;
        }
        tokio::time::sleep(RELOAD).await;
    }
    false
}

fn der_of(path: &std::path::Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_file(path)
        .unwrap()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_and_the_ca_rotate_without_dropping_connections() {
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout::new(dir.path());
    let cluster = ClusterName::new("cluster-a").unwrap();
    init(
        &layout,
        &InitOptions {
            clusters: vec![cluster.clone()],
            ..InitOptions::default()
        },
    )
    .unwrap();

    let mut config = test_server_config();
    config.server_cert = Some(layout.proxy_server().cert);
    config.server_key = Some(layout.proxy_server().key);
    config.server_ca_cert = Some(layout.bundle());
    config.cluster_cert = Some(layout.agent_server().cert);
    config.cluster_key = Some(layout.agent_server().key);
    config.cluster_ca_cert = Some(layout.bundle());
    config.credential_reload_interval = RELOAD;
    let server = proxy_server::start(config).await.unwrap();

    let agent_pair = layout.agent(&cluster);
    let mut agent_config = proxy_agent::ProxyAgentConfig::new(proxy_agent::TlsSource::Files {
        ca_cert: layout.bundle(),
        agent_cert: Some(agent_pair.cert.clone()),
        agent_key: Some(agent_pair.key.clone()),
        alpn: Vec::new(),
    })
    .with_ephemeral_ports();
    agent_config.proxy_server_host = "localhost".into();
    agent_config.proxy_server_port = server.agent_addr.port();
    agent_config.agent_identifiers = "host=cluster-a".into();
    agent_config
        .host_aliases
        .insert("cluster-a".into(), [127, 0, 0, 1].into());
    agent_config.credential_reload_interval = RELOAD;
    let agent = AgentUnderTest::start_with(agent_config).await.unwrap();
    assert!(wait_until(STEP, || server.tunnel_count() == 1).await);

    // Continuous traffic over one tunneled connection for the whole test.
    let echo = EchoServer::start().await.unwrap();
    let client = tunnel_client(client_tls(&layout), server.client_addr)
        .await
        .unwrap();
    let mut stream = client
        .dial(&format!("cluster-a:{}", echo.addr.port()))
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let round_trips = Arc::new(AtomicU64::new(0));
    let traffic = {
        let (stop, round_trips) = (stop.clone(), round_trips.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1024];
            while !stop.load(Ordering::Relaxed) {
                stream
                    .write_all(&[round_trips.load(Ordering::Relaxed) as u8; 1024])
                    .await?;
                stream.read_exact(&mut buf).await?;
                round_trips.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, std::io::Error>(())
        })
    };
    let progressing = |from: u64| {
        let round_trips = round_trips.clone();
        async move { wait_until(STEP, || round_trips.load(Ordering::Relaxed) > from + 50).await }
    };
    assert!(progressing(0).await);

    let ca_pair = layout.ca();
    let old_ca = Authority::from_pem(
        &std::fs::read_to_string(&ca_pair.cert).unwrap(),
        &std::fs::read_to_string(&ca_pair.key).unwrap(),
    )
    .unwrap();
    let sans: Vec<&str> = cert_authority::files::LOCAL_SANS.to_vec();

    // 1. Server certificates: new handshakes see the new certificate.
    write_pair(
        &layout.proxy_server(),
        &old_ca
            .issue(&LeafRequest::server("proxy-server", &sans))
            .unwrap(),
    )
    .unwrap();
    write_pair(
        &layout.agent_server(),
        &old_ca
            .issue(&LeafRequest::server("agent-server", &sans))
            .unwrap(),
    )
    .unwrap();
    assert!(
        server_presents_current_cert(&layout, server.client_addr.port()).await,
        "server still presents the old certificate"
    );
    assert!(progressing(round_trips.load(Ordering::Relaxed)).await);

    // 2. The agent certificate.
    write_pair(
        &agent_pair,
        &old_ca.issue(&LeafRequest::agent(&cluster)).unwrap(),
    )
    .unwrap();
    tokio::time::sleep(RELOAD * 3).await;
    assert!(progressing(round_trips.load(Ordering::Relaxed)).await);
    assert_eq!(server.tunnel_count(), 1);

    // 3. CA rollover: publish {old, new}, re-issue every leaf from the new CA,
    //    then retire the old CA from the bundle.
    let new_ca = Authority::generate("cluster-proxy-ca-2", Duration::from_secs(24 * 3600)).unwrap();
    write_atomically(
        &layout.bundle(),
        &format!("{}{}", old_ca.cert_pem(), new_ca.cert_pem()),
        false,
    )
    .unwrap();
    tokio::time::sleep(RELOAD * 3).await;
    write_pair(
        &layout.proxy_server(),
        &new_ca
            .issue(&LeafRequest::server("proxy-server", &sans))
            .unwrap(),
    )
    .unwrap();
    write_pair(
        &layout.agent_server(),
        &new_ca
            .issue(&LeafRequest::server("agent-server", &sans))
            .unwrap(),
    )
    .unwrap();
    write_pair(
        &agent_pair,
        &new_ca.issue(&LeafRequest::agent(&cluster)).unwrap(),
    )
    .unwrap();
    let old_client = old_ca.issue(&LeafRequest::client("proxy-client")).unwrap();
    write_pair(
        &layout.proxy_client(),
        &new_ca.issue(&LeafRequest::client("proxy-client")).unwrap(),
    )
    .unwrap();
    assert!(
        server_presents_current_cert(&layout, server.client_addr.port()).await,
        "server does not present the new CA's certificate"
    );
    // Every leaf now comes from the new CA: retire the old one.
    write_atomically(&layout.bundle(), new_ca.cert_pem(), false).unwrap();
    tokio::time::sleep(RELOAD * 3).await;
    assert!(progressing(round_trips.load(Ordering::Relaxed)).await);

    // New handshakes with new credentials work end to end ...
    let fresh = tunnel_client(client_tls(&layout), server.client_addr)
        .await
        .unwrap();
    let mut s = fresh
        .dial(&format!("cluster-a:{}", echo.addr.port()))
        .await
        .unwrap();
    s.write_all(b"after rollover").await.unwrap();
    let mut buf = [0u8; 14];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"after rollover");

    // ... and a certificate from the retired CA is refused.
    let retired = tls::client_config(
        tls::roots(&Pem::file("bundle", &layout.bundle()).unwrap()).unwrap(),
        Some(
            Identity::new(
                &Pem::text("old.crt", &old_client.cert_pem),
                &Pem::text("old.key", &old_client.key_pem),
            )
            .unwrap(),
        ),
        &[ALPN_H2],
    )
    .unwrap();
    let refused = match tunnel_client(retired, server.client_addr).await {
        Err(_) => true,
        Ok(c) => c
            .dial(&format!("cluster-a:{}", echo.addr.port()))
            .await
            .is_err(),
    };
    assert!(refused, "a certificate from the retired CA was accepted");

    // The original connection never dropped.
    stop.store(true, Ordering::Relaxed);
    traffic
        .await
        .unwrap()
        .expect("the tunneled connection dropped during rotation");
    assert!(round_trips.load(Ordering::Relaxed) > 200);
    drop(agent);
    server.shutdown().await;
}

/// One CONNECT over a fresh TLS connection with `tls`: how the handshake went
/// and the response head, empty when the server closed the connection
/// without answering.
async fn connect_once(
    tls: Arc<rustls::ClientConfig>,
    server: std::net::SocketAddr,
) -> (Option<rustls::HandshakeKind>, String) {
    let tcp = tokio::net::TcpStream::connect(server).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let Ok(mut stream) = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
    else {
        return (None, String::new());
    };
    let kind = stream.get_ref().1.handshake_kind();
    let request = b"CONNECT cluster-a:443 HTTP/1.1\r\nHost: cluster-a:443\r\n\r\n";
    let mut head = Vec::new();
    if stream.write_all(request).await.is_ok() && stream.flush().await.is_ok() {
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match tokio::time::timeout(STEP, stream.read(&mut byte)).await {
                Ok(Ok(1)) => head.push(byte[0]),
                Ok(_) => break,
                Err(_) => panic!("the server neither answered nor closed the connection"),
            }
        }
    }
    (kind, String::from_utf8_lossy(&head).into_owned())
}

/// A resumed TLS session brings back the certificate of the handshake that
/// created it, unverified (rustls keeps sessions for 24 hours): the server
/// must not accept it once that certificate has expired.
#[tokio::test]
async fn a_resumed_session_does_not_outlive_the_client_certificate() {
    let pki = tunnel_harness::pki::TestPki::new(&[]).unwrap();
    let server = proxy_server::start_with_tls(test_server_config(), pki.server_tls().unwrap())
        .await
        .unwrap();
    let roots = tls::roots(&Pem::text("ca.crt", pki.ca.cert_pem())).unwrap();
    let lifetime = Duration::from_secs(4);
    for version in [&rustls::version::TLS13, &rustls::version::TLS12] {
        let issued = std::time::SystemTime::now();
        let short_lived = pki
            .ca
            .issue(&LeafRequest::client("short-lived").with_validity(lifetime))
            .unwrap();
        use rustls::pki_types::pem::PemObject;
        let chain =
            rustls::pki_types::CertificateDer::pem_slice_iter(short_lived.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(short_lived.key_pem.as_bytes())
            .unwrap();
        // Each config keeps its own sessions.
        let client_config = || {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut config = rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[version])
                .unwrap()
                .with_root_certificates(roots.clone())
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .unwrap();
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Arc::new(config)
        };
        let config = client_config();

        let (kind, head) = connect_once(config.clone(), server.client_addr).await;
        assert_eq!(kind, Some(rustls::HandshakeKind::Full), "{version:?}");
        assert!(head.starts_with("HTTP/1.1 "), "{version:?}: {head:?}");
        let (kind, head) = connect_once(config.clone(), server.client_addr).await;
        assert_eq!(kind, Some(rustls::HandshakeKind::Resumed), "{version:?}");
        assert!(head.starts_with("HTTP/1.1 "), "{version:?}: {head:?}");

        // notAfter has a resolution of one second.
        let expired = issued + lifetime + Duration::from_secs(1);
        assert!(wait_until(STEP, || std::time::SystemTime::now() > expired).await);
        let (kind, head) = connect_once(config, server.client_addr).await;
        assert_eq!(kind, Some(rustls::HandshakeKind::Resumed), "{version:?}");
        assert_eq!(head, "", "{version:?}: an expired certificate was served");
        // A full handshake with it fails as it always did.
        let (_, head) = connect_once(client_config(), server.client_addr).await;
        assert_eq!(head, "", "{version:?}");
    }
    // Both refusals are counted apart from failed handshakes (the server
    // counts a failed handshake after its alert has left).
    let count = |reason: &str| {
        let series = format!(
            "cluster_proxy_server_tls_handshake_failures_total{{listener=\"client\",reason=\"{reason}\"}} "
        );
        server
            .metrics_text()
            .lines()
            .find_map(|line| line.strip_prefix(series.as_str()).map(str::to_owned))
    };
    let counted = || {
        count("expired_resumed_session").as_deref() == Some("2")
            && count("error").as_deref() == Some("2")
    };
    assert!(wait_until(STEP, counted).await, "{}", server.metrics_text());
    server.shutdown().await;
}
