//! Why a dial failed, in the words and codes each frontend answers with.
//! Apart from [`crate::dial`] because the tunnel, which dialing uses,
//! fails dials too.

use std::time::Duration;

use http::StatusCode;

/// Why a dial failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DialFailure {
    /// No connected agent serves the requested host.
    NoAgent,
    /// The agent could not dial (its error text, e.g. `dial tcp …: connect: connection refused`).
    Agent(String),
    /// The agent sent DIAL_CLS.
    ClosedByAgent,
    /// The agent's tunnel ended before it answered.
    TunnelClosed(String),
    /// No answer within the dial timeout.
    Timeout(Duration),
    /// The request itself is unusable (bad protocol, duplicate dial id).
    BadRequest(String),
    /// A configured bound refused the dial (e.g. `--max-pending-dials-per-tunnel`).
    Overloaded(String),
    /// `--client-policy` does not let this client reach the agent's cluster.
    Forbidden(String),
}

impl DialFailure {
    /// The text clients see (DIAL_RSP error or HTTP body); upstream's wording where it has one.
    pub fn message(&self) -> String {
        match self {
            DialFailure::NoAgent => "No agent available".into(),
            DialFailure::Agent(e) => e.clone(),
            DialFailure::ClosedByAgent => "dial closed".into(),
            DialFailure::TunnelClosed(e) => e.clone(),
            DialFailure::Timeout(d) => format!("timed out waiting for backend dial after {d:?}"),
            DialFailure::BadRequest(e) => e.clone(),
            DialFailure::Overloaded(e) => e.clone(),
            DialFailure::Forbidden(e) => e.clone(),
        }
    }

    /// Upstream's `dial_failure_count` reason label.
    pub fn reason(&self) -> &'static str {
        match self {
            DialFailure::NoAgent => "no_agent",
            DialFailure::Agent(_) => "error_response",
            DialFailure::ClosedByAgent => "backend_close",
            DialFailure::TunnelClosed(_) => "backend_close",
            DialFailure::Timeout(_) => "backend_dial_timeout",
            DialFailure::BadRequest(_) => "send_rsp",
            DialFailure::Overloaded(_) => "overloaded",
            DialFailure::Forbidden(_) => "forbidden",
        }
    }

    /// HTTP CONNECT status, mapped as upstream does.
    pub fn http_status(&self) -> StatusCode {
        match self {
            DialFailure::NoAgent => StatusCode::INTERNAL_SERVER_ERROR,
            DialFailure::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            DialFailure::BadRequest(_) => StatusCode::BAD_REQUEST,
            DialFailure::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            DialFailure::Forbidden(_) => StatusCode::FORBIDDEN,
            DialFailure::Agent(e) => {
                let e = e.to_ascii_lowercase();
                if e.contains("timeout") || e.contains("timed out") || e.contains("deadline") {
                    StatusCode::GATEWAY_TIMEOUT
                } else if e.contains("too many open files") {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::BAD_GATEWAY
                }
            }
            DialFailure::ClosedByAgent | DialFailure::TunnelClosed(_) => StatusCode::BAD_GATEWAY,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_status_follows_upstreams_mapping() {
        let agent = |e: &str| DialFailure::Agent(e.into()).http_status();
        assert_eq!(
            agent("dial tcp 10.0.0.1:443: connect: connection refused"),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            agent("dial tcp 10.0.0.1:443: i/o timeout"),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            agent("context deadline exceeded"),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            agent("dial tcp: lookup x: no such host"),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            agent("socket: too many open files"),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            DialFailure::NoAgent.http_status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            DialFailure::Timeout(Duration::from_secs(1)).http_status(),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            DialFailure::TunnelClosed("x".into()).http_status(),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(DialFailure::NoAgent.message(), "No agent available");
    }
}
