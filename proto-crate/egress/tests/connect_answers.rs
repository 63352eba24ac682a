//! What the client makes of each answer a proxy may give to CONNECT. The
//! proxy here is a script on loopback, because real proxies do not answer
//! in garbage or hang up mid-answer on demand; the real ones (tinyproxy,
//! stunnel, microsocks) are run by `e2e/tests/behind_proxy.rs`.

use std::time::Duration;

use cluster_proxy_egress::{Egress, EgressError, EgressSettings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const STEP: Duration = Duration::from_secs(10);

/// A proxy that reads one request head, hands it to the test and writes
/// `answer`; with `echo`, it then echoes what comes (the tunnel's far end).
async fn scripted_proxy(
    answer: &'static [u8],
    echo: bool,
) -> (String, tokio::task::JoinHandle<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let head = read_head(&mut tcp).await;
        if !answer.is_empty() {
            tcp.write_all(answer).await.unwrap();
        }
        if echo {
            let mut buffer = vec![0; 4096];
            loop {
                match tcp.read(&mut buffer).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => tcp.write_all(&buffer[..n]).await.unwrap(),
                }
            }
        }
        head
    });
    (format!("http://{address}"), task)
}

async fn read_head(tcp: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tcp.read(&mut byte).await.unwrap() == 0 {
            break;
        }
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

fn egress(proxy_url: &str) -> Egress {
    egress_with(EgressSettings {
        proxy_url: Some(proxy_url.to_owned()),
        ..EgressSettings::default()
    })
}

fn egress_with(settings: EgressSettings) -> Egress {
    Egress::with_rules(
        cluster_proxy_egress::ProxyRules::from_lookup(settings.proxy_url.as_deref(), |_| None)
            .unwrap(),
        &settings,
        "egress-test/1",
    )
    .unwrap()
}

async fn connect(egress: &Egress) -> Result<cluster_proxy_egress::EgressStream, EgressError> {
    tokio::time::timeout(STEP, egress.connect("hub.example", 8091, true))
        .await
        .expect("the connect must end, not hang")
}

#[tokio::test]
async fn a_200_hands_over_the_connection_and_bytes_cross_it() {
    let (url, proxy) = scripted_proxy(b"HTTP/1.1 200 Connection established\r\n\r\n", true).await;
    let mut stream = connect(&egress(&url)).await.unwrap();
    stream.write_all(b"client hello").await.unwrap();
    let mut echoed = [0u8; 12];
    stream.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"client hello");
    drop(stream);
    let head = proxy.await.unwrap();
    assert!(
        head.starts_with("CONNECT hub.example:8091 HTTP/1.1\r\n"),
        "{head}"
    );
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("host: hub.example:8091\r\n"), "{head}");
    assert!(lower.contains("user-agent: egress-test/1\r\n"), "{head}");
    assert!(!lower.contains("proxy-authorization"), "{head}");
}

#[tokio::test]
async fn credentials_go_as_basic_and_a_file_wins_over_the_url() {
    let (url, proxy) = scripted_proxy(b"HTTP/1.1 200 OK\r\n\r\n", false).await;
    let with_user = url.replace("http://", "http://alice:s%40cret@");
    connect(&egress(&with_user)).await.unwrap();
    let head = proxy.await.unwrap();
    // base64("alice:s@cret")
    assert!(head.contains("Basic YWxpY2U6c0BjcmV0\r\n"), "{head}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("credentials");
    std::fs::write(&file, "bob:pw\n").unwrap();
    let (url, proxy) = scripted_proxy(b"HTTP/1.1 200 OK\r\n\r\n", false).await;
    let with_user = url.replace("http://", "http://alice:ignored@");
    connect(&egress_with(EgressSettings {
        proxy_url: Some(with_user),
        proxy_credentials_file: Some(file),
        ..EgressSettings::default()
    }))
    .await
    .unwrap();
    let head = proxy.await.unwrap();
    assert!(head.contains("Basic Ym9iOnB3\r\n"), "{head}"); // bob:pw
}

#[tokio::test]
async fn a_407_says_whether_credentials_were_sent_and_what_the_proxy_asks_for() {
    let answer = b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Negotiate\r\nProxy-Authenticate: Basic realm=\"corp\"\r\nContent-Length: 0\r\n\r\n";
    let (url, _proxy) = scripted_proxy(answer, false).await;
    let err = connect(&egress(&url)).await.unwrap_err();
    assert_eq!(err.reason(), "proxy_auth");
    let text = err.to_string();
    assert!(text.contains("407"), "{text}");
    assert!(text.contains("no credentials were given"), "{text}");
    assert!(text.contains("Negotiate, Basic"), "{text}");

    let (url, _proxy) = scripted_proxy(answer, false).await;
    let err = connect(&egress(&url.replace("http://", "http://alice:hunter2@")))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("were not accepted"), "{text}");
    assert!(
        !text.contains("hunter2") && !text.contains("alice"),
        "{text}"
    );
    assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
}

/// tinyproxy answers 407 only when no credentials came; wrong ones get
/// `401 Unauthorized`. Both are the proxy rejecting the credentials.
#[tokio::test]
async fn a_401_to_connect_is_an_authentication_failure_too() {
    let answer = b"HTTP/1.0 401 Unauthorized\r\nProxy-Authenticate: Basic realm=\"tinyproxy\"\r\nContent-Length: 0\r\n\r\n";
    let (url, _proxy) = scripted_proxy(answer, false).await;
    let err = connect(&egress(&url.replace("http://", "http://alice:hunter2@")))
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "proxy_auth", "{err}");
    let text = err.to_string();
    assert!(text.contains("401 Unauthorized"), "{text}");
    assert!(text.contains("were not accepted"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}

#[tokio::test]
async fn other_refusals_carry_their_status() {
    let (url, _proxy) = scripted_proxy(
        b"HTTP/1.1 403 Forbidden\r\nContent-Length: 9\r\n\r\nforbidden",
        false,
    )
    .await;
    let err = connect(&egress(&url)).await.unwrap_err();
    assert_eq!(err.reason(), "proxy_refused");
    assert!(err.to_string().contains("403 Forbidden"), "{err}");
    assert!(err.to_string().contains("hub.example:8091"), "{err}");
}

#[tokio::test]
async fn an_answer_that_is_not_http_or_no_answer_at_all_is_named() {
    let (url, _proxy) = scripted_proxy(b"SSH-2.0-OpenSSH_9.2\r\n\r\n", false).await;
    let err = connect(&egress(&url)).await.unwrap_err();
    assert_eq!(err.reason(), "proxy_protocol", "{err}");

    let (url, proxy) = scripted_proxy(b"", false).await;
    let err = connect(&egress(&url)).await.unwrap_err();
    proxy.await.unwrap();
    assert_eq!(err.reason(), "proxy_closed", "{err}");

    // Bytes after the 200 came from the proxy: the target has not spoken.
    let (url, _proxy) = scripted_proxy(b"HTTP/1.1 200 OK\r\n\r\nsurprise", false).await;
    let err = connect(&egress(&url)).await.unwrap_err();
    assert_eq!(err.reason(), "proxy_protocol", "{err}");
    assert!(err.to_string().contains("8 bytes"), "{err}");
}

#[tokio::test]
async fn a_dead_proxy_is_unreachable_and_named_without_credentials() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let err = connect(&egress(&format!("http://u:topsecret@127.0.0.1:{port}")))
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "proxy_unreachable");
    let text = err.to_string();
    assert!(text.contains(&format!("http://127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("topsecret"), "{text}");
}

#[tokio::test]
async fn loopback_targets_and_no_proxy_matches_go_direct() {
    // The proxy would refuse everything: only a direct connection works.
    let (url, _proxy) = scripted_proxy(b"HTTP/1.1 403 Forbidden\r\n\r\n", false).await;
    let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = target.local_addr().unwrap().port();
    let egress = egress(&url);
    egress.connect("127.0.0.1", port, true).await.unwrap();
    egress.connect("localhost", port, true).await.unwrap();
}

#[test]
fn a_missing_credentials_file_or_proxy_ca_fails_at_start_up() {
    let settings = EgressSettings {
        proxy_url: Some("http://proxy:3128".into()),
        proxy_credentials_file: Some("/nonexistent/credentials".into()),
        ..EgressSettings::default()
    };
    let rules =
        cluster_proxy_egress::ProxyRules::from_lookup(settings.proxy_url.as_deref(), |_| None)
            .unwrap();
    let err = Egress::with_rules(rules, &settings, "t").unwrap_err();
    assert_eq!(err.reason(), "proxy_config");
    assert!(
        err.to_string().contains("/nonexistent/credentials"),
        "{err}"
    );

    let settings = EgressSettings {
        proxy_url: Some("https://proxy:3129".into()),
        proxy_ca_file: Some("/nonexistent/proxy-ca.crt".into()),
        ..EgressSettings::default()
    };
    let rules =
        cluster_proxy_egress::ProxyRules::from_lookup(settings.proxy_url.as_deref(), |_| None)
            .unwrap();
    let err = Egress::with_rules(rules, &settings, "t").unwrap_err();
    assert!(err.to_string().contains("proxy-ca.crt"), "{err}");
}
