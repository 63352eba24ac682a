//! How a cluster-proxy process opens an outbound connection: straight to
//! its target, or through the network's forward proxy.
//!
//! Managed clusters in enterprises often reach the hub only through an
//! HTTP(S) proxy. [`Egress`] follows the same rules as upstream's Go agent
//! and client-go (`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`; see [`rules`]),
//! plus an explicit proxy URL that wins over the environment, and speaks
//! to the proxy by its URL's scheme:
//!
//! - `http://`: HTTP CONNECT (hyper's HTTP/1.1 client, so the answer is
//!   parsed by a real HTTP parser and the status reported as it came);
//! - `https://`: the same inside TLS to the proxy, verified against the
//!   proxy's CA bundle. That bundle only ever verifies the proxy: the
//!   target's certificate is checked by the caller's own TLS, so a proxy CA
//!   never widens trust in the hub;
//! - `socks5://` (names resolved here) and `socks5h://` (by the proxy), by
//!   hyper-util's SOCKS5 client.
//!
//! Basic credentials come from the URL's userinfo or a mounted file, read
//! at every connection so a rotated Secret is used without a restart.
//! Errors say which proxy failed and how, never with the credentials.
#![forbid(unsafe_code)]

mod connect;
pub mod connector;
mod egress;
mod error;
pub mod rules;
mod stream;
pub mod tcp;

pub use connect::read_credentials;
pub use connector::EgressConnector;
pub use egress::{Egress, EgressSettings};
pub use error::EgressError;
pub use rules::{Credentials, NoProxy, ProxyRules, ProxyScheme, ProxyUrl, Route, RuleError};
pub use stream::EgressStream;
