//! Which proxy, if any, carries a connection: the proxy URL (`--proxy-url`,
//! or `HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY` from the environment) and the
//! `NO_PROXY` exceptions, by the rules of Go's `golang.org/x/net/http/httpproxy`
//! (upstream's agent and every client-go client follow them):
//!
//! - a variable's upper-case name wins over its lower-case one;
//! - `localhost` and loopback addresses are never proxied;
//! - a `NO_PROXY` entry is `*` (nothing is proxied), an IP address, a CIDR,
//!   a domain (`example.com` matches it and its subdomains), a domain with a
//!   leading `.` or `*.` (subdomains only), each with an optional `:port`
//!   that must then match too (IPv6 with a port as `[::1]:443`);
//! - domain entries match names, IP entries match literal addresses: no
//!   name is resolved to decide.
//!
//! curl differs in one place: its `.example.com` also matches `example.com`.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use percent_encoding::percent_decode_str;

/// How the proxy is spoken to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyScheme {
    /// HTTP CONNECT over plain TCP.
    Http,
    /// HTTP CONNECT inside TLS to the proxy.
    Https,
    /// SOCKS5; `remote_dns` (`socks5h://`) lets the proxy resolve names.
    Socks5 { remote_dns: bool },
}

impl ProxyScheme {
    fn name(self) -> &'static str {
        match self {
            ProxyScheme::Http => "http",
            ProxyScheme::Https => "https",
            ProxyScheme::Socks5 { remote_dns: false } => "socks5",
            ProxyScheme::Socks5 { remote_dns: true } => "socks5h",
        }
    }

    fn default_port(self) -> u16 {
        match self {
            ProxyScheme::Http => 80,
            ProxyScheme::Https => 443,
            ProxyScheme::Socks5 { .. } => 1080,
        }
    }
}

/// A user name and password for the proxy.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A parsed proxy URL. Its `Display` never shows the credentials, so it
/// may go into logs, errors and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyUrl {
    pub scheme: ProxyScheme,
    /// Without IPv6 brackets.
    pub host: String,
    pub port: u16,
    /// From the URL's userinfo (percent-decoded).
    pub credentials: Option<Credentials>,
}

impl fmt::Display for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        write!(f, "{}://{host}:{}", self.scheme.name(), self.port)
    }
}

/// A proxy URL or `NO_PROXY` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// `what` names the source (`--proxy-url`, `HTTPS_PROXY`); the value is
    /// left out since it may hold a password.
    #[error("{what}: {reason}")]
    ProxyUrl { what: String, reason: String },
}

impl ProxyUrl {
    /// Parses `value` as Go does: a URL without a scheme is `http://`; the
    /// port defaults to the scheme's (80, 443, 1080).
    pub fn parse(what: &str, value: &str) -> Result<ProxyUrl, RuleError> {
        let invalid = |reason: &str| RuleError::ProxyUrl {
            what: what.to_owned(),
            reason: reason.to_owned(),
        };
        let value = value.trim();
        let (scheme, rest) = match value.split_once("://") {
            Some((scheme, rest)) => (scheme.to_ascii_lowercase(), rest),
            None => ("http".to_owned(), value),
        };
        let scheme = match scheme.as_str() {
            "http" => ProxyScheme::Http,
            "https" => ProxyScheme::Https,
            "socks5" => ProxyScheme::Socks5 { remote_dns: false },
            "socks5h" => ProxyScheme::Socks5 { remote_dns: true },
            _ => {
                return Err(invalid(&format!(
                    "unsupported scheme {scheme:?} (http, https, socks5 and socks5h are)"
                )));
            }
        };
        // Go ignores a path ("http://proxy:3128/"): only the authority counts.
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let (userinfo, host_port) = match authority.rsplit_once('@') {
            Some((userinfo, host_port)) => (Some(userinfo), host_port),
            None => (None, authority),
        };
        let (host, port) = split_host_port(host_port).map_err(|reason| invalid(&reason))?;
        if host.is_empty() {
            return Err(invalid("no host"));
        }
        let port = match port {
            Some(port) => port,
            None => scheme.default_port(),
        };
        let credentials = userinfo
            .map(|userinfo| {
                let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                let decode = |part: &str| {
                    percent_decode_str(part)
                        .decode_utf8()
                        .map(|decoded| decoded.into_owned())
                        .map_err(|_| invalid("the userinfo is not UTF-8 once percent-decoded"))
                };
                Ok::<_, RuleError>(Credentials {
                    username: decode(user)?,
                    password: decode(password)?,
                })
            })
            .transpose()?;
        Ok(ProxyUrl {
            scheme,
            host: host.to_owned(),
            port,
            credentials,
        })
    }
}

/// Splits `host[:port]` or `[v6][:port]`; the host comes back unbracketed.
fn split_host_port(value: &str) -> Result<(&str, Option<u16>), String> {
    let parse_port = |port: &str| {
        port.parse::<u16>()
            .map_err(|_| format!("invalid port {port:?}"))
    };
    if let Some(rest) = value.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| "unclosed '[' in the host".to_owned())?;
        return match after.strip_prefix(':') {
            Some(port) => Ok((host, Some(parse_port(port)?))),
            None if after.is_empty() => Ok((host, None)),
            None => Err(format!("unexpected {after:?} after the host")),
        };
    }
    match value.rsplit_once(':') {
        // A bare IPv6 address has colons but no port.
        Some(_) if value.parse::<IpAddr>().is_ok() => Ok((value, None)),
        Some((host, port)) => Ok((host, Some(parse_port(port)?))),
        None => Ok((value, None)),
    }
}

/// One `NO_PROXY` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Exception {
    Everything,
    Network(IpNet),
    Address {
        ip: IpAddr,
        port: Option<u16>,
    },
    /// `suffix` starts with `.`; `exact` also matches the name without it.
    Domain {
        suffix: String,
        exact: bool,
        port: Option<u16>,
    },
}

/// The parsed `NO_PROXY` list. Entries that cannot be read are skipped, as
/// Go does, and reported by [`NoProxy::skipped`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NoProxy {
    exceptions: Vec<Exception>,
    skipped: Vec<String>,
}

impl NoProxy {
    pub fn parse(value: &str) -> NoProxy {
        let mut no_proxy = NoProxy::default();
        for entry in value.split(',') {
            let entry = entry.trim().to_ascii_lowercase();
            if entry.is_empty() {
                continue;
            }
            match Self::exception(&entry) {
                Some(exception) => no_proxy.exceptions.push(exception),
                None => no_proxy.skipped.push(entry),
            }
        }
        no_proxy
    }

    fn exception(entry: &str) -> Option<Exception> {
        if entry == "*" {
            return Some(Exception::Everything);
        }
        if let Ok(network) = entry.parse::<IpNet>() {
            return Some(Exception::Network(network));
        }
        let (host, port) = split_host_port(entry).ok()?;
        if host.is_empty() {
            return None;
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Some(Exception::Address { ip, port });
        }
        let host = host.strip_prefix('*').unwrap_or(host);
        if host.is_empty() || host == "." {
            return None;
        }
        let exact = !host.starts_with('.');
        let suffix = if exact {
            format!(".{host}")
        } else {
            host.to_owned()
        };
        Some(Exception::Domain {
            suffix,
            exact,
            port,
        })
    }

    /// Entries that were not understood (and so match nothing).
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// Whether a connection to `host:port` goes direct.
    pub fn excludes(&self, host: &str, port: u16) -> bool {
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        let host = host.strip_suffix('.').unwrap_or(&host);
        if host == "localhost" {
            return true;
        }
        // `::ffff:127.0.0.1` is loopback too (Go compares the IPv4 form).
        let ip = host.parse::<IpAddr>().ok().map(|ip| ip.to_canonical());
        if ip.is_some_and(|ip| ip.is_loopback()) {
            return true;
        }
        let port_matches = |wanted: &Option<u16>| wanted.is_none_or(|wanted| wanted == port);
        self.exceptions
            .iter()
            .any(|exception| match (exception, ip) {
                (Exception::Everything, _) => true,
                (Exception::Network(network), Some(ip)) => network.contains(&ip),
                (Exception::Address { ip: wanted, port }, Some(ip)) => {
                    *wanted == ip && port_matches(port)
                }
                (
                    Exception::Domain {
                        suffix,
                        exact,
                        port,
                    },
                    None,
                ) => {
                    (host.ends_with(suffix.as_str()) || (*exact && host == &suffix[1..]))
                        && port_matches(port)
                }
                _ => false,
            })
    }
}

/// Where a connection goes: straight to its target, or through `proxy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'a> {
    Direct,
    Proxy(&'a ProxyUrl),
}

/// The proxies and exceptions of one process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyRules {
    /// For TLS targets (the tunnel, an https API server).
    pub https: Option<ProxyUrl>,
    /// For plain-HTTP targets.
    pub http: Option<ProxyUrl>,
    pub no_proxy: NoProxy,
}

/// The variables [`ProxyRules::from_lookup`] reads, upper case first.
pub const ENV_VARIABLES: [&str; 8] = [
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
];

impl ProxyRules {
    /// No proxy at all.
    pub fn direct() -> ProxyRules {
        ProxyRules::default()
    }

    /// The rules from the process environment; `explicit` (`--proxy-url`)
    /// wins over every `*_PROXY` variable, `NO_PROXY` still applies.
    pub fn from_env(explicit: Option<&str>) -> Result<ProxyRules, RuleError> {
        Self::from_lookup(explicit, |name| std::env::var(name).ok())
    }

    /// [`Self::from_env`] over any variable lookup (tests pass a map).
    pub fn from_lookup(
        explicit: Option<&str>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<ProxyRules, RuleError> {
        let first = |names: [&'static str; 2]| {
            names.into_iter().find_map(|name| {
                lookup(name)
                    .filter(|value| !value.trim().is_empty())
                    .map(|value| (name, value))
            })
        };
        let parse = |found: Option<(&str, String)>| {
            found
                .map(|(name, value)| ProxyUrl::parse(name, &value))
                .transpose()
        };
        let explicit = explicit
            .map(str::trim)
            .filter(|value| !value.is_empty())
            .map(|value| ProxyUrl::parse("--proxy-url", value))
            .transpose()?;
        let all = parse(first(["ALL_PROXY", "all_proxy"]))?;
        let https = match explicit.clone() {
            Some(url) => Some(url),
            None => parse(first(["HTTPS_PROXY", "https_proxy"]))?.or_else(|| all.clone()),
        };
        let http = match explicit {
            Some(url) => Some(url),
            None => parse(first(["HTTP_PROXY", "http_proxy"]))?.or(all),
        };
        let no_proxy = first(["NO_PROXY", "no_proxy"])
            .map(|(_, value)| NoProxy::parse(&value))
            .unwrap_or_default();
        Ok(ProxyRules {
            https,
            http,
            no_proxy,
        })
    }

    /// Whether any proxy is configured.
    pub fn is_direct(&self) -> bool {
        self.https.is_none() && self.http.is_none()
    }

    /// The route to `host:port`; `tls` says whether the target speaks TLS
    /// (`HTTPS_PROXY` applies) or plain HTTP (`HTTP_PROXY`).
    pub fn route(&self, host: &str, port: u16, tls: bool) -> Route<'_> {
        let proxy = if tls { &self.https } else { &self.http };
        match proxy {
            Some(proxy) if !self.no_proxy.excludes(host, port) => Route::Proxy(proxy),
            _ => Route::Direct,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn rules(vars: &[(&str, &str)], explicit: Option<&str>) -> Result<ProxyRules, RuleError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ProxyRules::from_lookup(explicit, |name| vars.get(name).cloned())
    }

    #[test]
    fn urls_parse_as_go_does() {
        let url = ProxyUrl::parse("HTTPS_PROXY", "proxy.corp:3128").unwrap();
        assert_eq!(url.scheme, ProxyScheme::Http);
        assert_eq!((url.host.as_str(), url.port), ("proxy.corp", 3128));
        assert_eq!(url.to_string(), "http://proxy.corp:3128");
        let url = ProxyUrl::parse("x", "https://proxy.corp").unwrap();
        assert_eq!((url.scheme, url.port), (ProxyScheme::Https, 443));
        let url = ProxyUrl::parse("x", "SOCKS5H://[fd00::1]:1081/").unwrap();
        assert_eq!(url.scheme, ProxyScheme::Socks5 { remote_dns: true });
        assert_eq!((url.host.as_str(), url.port), ("fd00::1", 1081));
        assert_eq!(url.to_string(), "socks5h://[fd00::1]:1081");
        let url = ProxyUrl::parse("x", "socks5://10.0.0.1").unwrap();
        assert_eq!(url.port, 1080);
    }

    #[test]
    fn credentials_are_decoded_and_never_displayed() {
        let url = ProxyUrl::parse("x", "http://us%40er:p%3Ass@word@proxy:8080").unwrap();
        let credentials = url.credentials.clone().unwrap();
        assert_eq!(credentials.username, "us@er");
        assert_eq!(credentials.password, "p:ss@word");
        assert_eq!(url.to_string(), "http://proxy:8080");
        assert!(!format!("{credentials:?}").contains("ss@word"));
        let url = ProxyUrl::parse("x", "http://user@proxy:8080").unwrap();
        assert_eq!(url.credentials.unwrap().password, "");
    }

    #[test]
    fn bad_urls_are_refused_without_echoing_them() {
        for value in [
            "ftp://proxy:21",
            "http://:3128",
            "http://proxy:port",
            "http://proxy:99999",
            "http://[::1",
            "http://user:secret@proxy:x",
        ] {
            let err = ProxyUrl::parse("HTTPS_PROXY", value)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("HTTPS_PROXY: "), "{err}");
            assert!(!err.contains("secret"), "{err}");
        }
    }

    #[test]
    fn explicit_wins_upper_case_wins_and_all_proxy_is_the_fallback() {
        let r = rules(
            &[
                ("HTTPS_PROXY", "http://upper:1"),
                ("https_proxy", "http://lower:1"),
                ("http_proxy", "http://plain:1"),
            ],
            None,
        )
        .unwrap();
        assert_eq!(r.https.as_ref().unwrap().host, "upper");
        assert_eq!(r.http.as_ref().unwrap().host, "plain");
        let r = rules(&[("https_proxy", "http://lower:1")], None).unwrap();
        assert_eq!(r.https.unwrap().host, "lower");
        let r = rules(&[("HTTPS_PROXY", "http://env:1")], Some("socks5h://flag:2")).unwrap();
        assert_eq!(r.https.as_ref().unwrap().host, "flag");
        assert_eq!(r.http.as_ref().unwrap().host, "flag");
        let r = rules(&[("ALL_PROXY", "socks5://all:1")], None).unwrap();
        assert_eq!(r.https.unwrap().host, "all");
        let r = rules(&[("HTTPS_PROXY", "  ")], Some("")).unwrap();
        assert!(r.is_direct());
        assert!(rules(&[("HTTPS_PROXY", "gopher://x")], None).is_err());
    }

    #[test]
    fn no_proxy_follows_go() {
        let no = NoProxy::parse(
            " Example.com, .sub.corp ,*.wild.io, 10.0.0.0/8, 192.168.1.5, 172.16.0.1:8443, \
             [fd00::2]:443, fd00::3, only-port.net:6443, :80, ",
        );
        assert!(no.skipped().contains(&":80".to_owned()));
        let direct = |host: &str, port: u16| no.excludes(host, port);
        // A domain matches itself and its subdomains, case-insensitively.
        assert!(direct("example.com", 443));
        assert!(direct("API.EXAMPLE.COM", 443));
        assert!(!direct("notexample.com", 443));
        // A leading '.' or '*.' matches subdomains only (curl also the name).
        assert!(direct("a.sub.corp", 443));
        assert!(!direct("sub.corp", 443));
        assert!(direct("x.wild.io", 1));
        assert!(!direct("wild.io", 1));
        // IPs and CIDRs match literal addresses only, never names.
        assert!(direct("10.1.2.3", 443));
        assert!(!direct("11.1.2.3", 443));
        assert!(direct("192.168.1.5", 9));
        assert!(direct("172.16.0.1", 8443));
        assert!(!direct("172.16.0.1", 443));
        assert!(direct("[fd00::2]", 443));
        assert!(!direct("fd00::2", 80));
        assert!(direct("fd00::3", 80));
        // A port pins the entry to it.
        assert!(direct("only-port.net", 6443));
        assert!(!direct("only-port.net", 443));
        // localhost and loopback never go through a proxy.
        assert!(direct("localhost", 8091));
        assert!(direct("127.0.0.1", 8091));
        assert!(direct("::1", 8091));
        assert!(direct("::ffff:127.0.0.1", 8091));
        assert!(direct("127.1.2.3", 8091));
        assert!(!NoProxy::parse("").excludes("hub.example", 443));
        assert!(NoProxy::parse("*").excludes("hub.example", 443));
    }

    #[test]
    fn routes_pick_the_proxy_by_the_target_protocol() {
        let r = rules(
            &[
                ("HTTPS_PROXY", "http://tls-proxy:3128"),
                ("NO_PROXY", ".svc,10.96.0.1"),
            ],
            None,
        )
        .unwrap();
        assert!(
            matches!(r.route("hub.example", 443, true), Route::Proxy(p) if p.host == "tls-proxy")
        );
        assert_eq!(r.route("hub.example", 80, false), Route::Direct);
        assert_eq!(r.route("kubernetes.default.svc", 443, true), Route::Direct);
        assert_eq!(r.route("10.96.0.1", 443, true), Route::Direct);
        assert_eq!(r.route("127.0.0.1", 8091, true), Route::Direct);
    }
}
