//! What a client sends first on the client port: hyper's HTTP/1.1 and HTTP/2
//! detection and parsing, exactly as the listener configures them, then the
//! CONNECT frontend's own check ([`proxy_server::http_connect::connect_target`]).
//! Any bytes must end in a response or a closed connection, never a panic
//! or a hang.
#![no_main]

use std::convert::Infallible;
use std::sync::LazyLock;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use libfuzzer_sys::fuzz_target;
use proxy_server::http_connect::{ConnectRequestError, connect_target};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
});

async fn check(request: Request<Incoming>) -> Result<Response<Empty<Bytes>>, Infallible> {
    let status = match connect_target(&request) {
        Ok(address) => {
            assert_eq!(request.method(), Method::CONNECT);
            assert!(!address.is_empty());
            StatusCode::OK
        }
        Err(ConnectRequestError::NotConnect) => {
            assert_ne!(request.method(), Method::CONNECT);
            StatusCode::METHOD_NOT_ALLOWED
        }
        Err(ConnectRequestError::NoAuthority) => StatusCode::BAD_REQUEST,
    };
    let mut response = Response::new(Empty::new());
    *response.status_mut() = status;
    Ok(response)
}

fuzz_target!(|data: &[u8]| {
    RUNTIME.block_on(async {
        let (client, server) = tokio::io::duplex(16 * 1024);
        let (mut from_server, mut to_server) = tokio::io::split(client);
        let send = async {
            let _ = to_server.write_all(data).await;
            let _ = to_server.shutdown().await;
        };
        let drain = async {
            let mut sink = Vec::new();
            let _ = from_server.read_to_end(&mut sink).await;
        };
        let builder = auto::Builder::new(TokioExecutor::new());
        let serve = async {
            let _ = builder
                .serve_connection_with_upgrades(TokioIo::new(server), service_fn(check))
                .await;
        };
        // A parse that waits for bytes that never come would hang here; the
        // fuzzer's -timeout reports that as a finding.
        tokio::join!(send, drain, serve);
    });
});
