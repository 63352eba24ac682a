//! The `agentidentifiers` value: a URL query such as
//! `host=cluster-a&host=cluster-a.open-cluster-management-agent&default-route=true`.
//!
//! Parsing follows Go's `url.ParseQuery` (the upstream server's parser): `&`
//! separates pairs, `+` is a space, `%XX` escapes must be valid, a `;` is an
//! error, and keys may repeat.

use std::net::{Ipv4Addr, Ipv6Addr};

/// Key for a DNS name the agent serves.
pub const KEY_HOST: &str = "host";
pub const KEY_IPV4: &str = "ipv4";
pub const KEY_IPV6: &str = "ipv6";
pub const KEY_CIDR: &str = "cidr";
pub const KEY_DEFAULT_ROUTE: &str = "default-route";
/// Reserved upstream for internal use; agents must not send it.
pub const KEY_UID: &str = "uid";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentifiersError {
    #[error("invalid semicolon separator in agent identifiers {0:?}")]
    Semicolon(String),
    #[error("invalid URL escape in agent identifiers {0:?}")]
    BadEscape(String),
    #[error("invalid default-route value {0:?}: want true or false")]
    BadBool(String),
    #[error("unknown address type {0:?} in agent identifiers")]
    UnknownKey(String),
    #[error("invalid {kind} address {value:?} in agent identifiers")]
    BadAddress { kind: &'static str, value: String },
}

/// Parsed agent identifiers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentIdentifiers {
    pub hosts: Vec<String>,
    pub ipv4: Vec<String>,
    pub ipv6: Vec<String>,
    pub cidrs: Vec<String>,
    pub default_route: bool,
    /// Keys this version does not know; the server ignores them (fail open for
    /// version skew), as upstream does.
    pub unknown: Vec<(String, String)>,
}

fn unescape(part: &str) -> Result<String, IdentifiersError> {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| IdentifiersError::BadEscape(part.to_owned()))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| IdentifiersError::BadEscape(part.to_owned()))
}

fn parse_go_bool(value: &str) -> Result<bool, IdentifiersError> {
    crate::strconv::parse_bool(value).ok_or_else(|| IdentifiersError::BadBool(value.to_owned()))
}

/// Splits a query into decoded `(key, value)` pairs, in order.
pub fn parse_query(query: &str) -> Result<Vec<(String, String)>, IdentifiersError> {
    let mut pairs = Vec::new();
    for segment in query.split('&') {
        if segment.is_empty() {
            continue;
        }
        if segment.contains(';') {
            return Err(IdentifiersError::Semicolon(segment.to_owned()));
        }
        let (key, value) = segment.split_once('=').unwrap_or((segment, ""));
        pairs.push((unescape(key)?, unescape(value)?));
    }
    Ok(pairs)
}

impl AgentIdentifiers {
    /// Parses identifiers the way the server does: unknown keys are kept aside.
    pub fn parse(query: &str) -> Result<Self, IdentifiersError> {
        let mut ids = AgentIdentifiers::default();
        let mut default_route_seen = false;
        for (key, value) in parse_query(query)? {
            match key.as_str() {
                KEY_HOST => ids.hosts.push(value),
                KEY_IPV4 => ids.ipv4.push(value),
                KEY_IPV6 => ids.ipv6.push(value),
                KEY_CIDR => ids.cidrs.push(value),
                // Upstream reads only the first value.
                KEY_DEFAULT_ROUTE if !default_route_seen => {
                    default_route_seen = true;
                    ids.default_route = parse_go_bool(&value)?;
                }
                KEY_DEFAULT_ROUTE => {}
                _ => ids.unknown.push((key, value)),
            }
        }
        Ok(ids)
    }

    /// Parses identifiers the way the agent validates its own flag: unknown
    /// keys and `uid` are rejected, addresses must be well formed.
    pub fn parse_strict(query: &str) -> Result<Self, IdentifiersError> {
        let ids = Self::parse(query)?;
        if let Some((key, _)) = ids.unknown.first() {
            return Err(IdentifiersError::UnknownKey(key.clone()));
        }
        for v in &ids.ipv4 {
            v.parse::<Ipv4Addr>()
                .map_err(|_| IdentifiersError::BadAddress {
                    kind: KEY_IPV4,
                    value: v.clone(),
                })?;
        }
        for v in &ids.ipv6 {
            v.parse::<Ipv6Addr>()
                .map_err(|_| IdentifiersError::BadAddress {
                    kind: KEY_IPV6,
                    value: v.clone(),
                })?;
        }
        for v in &ids.cidrs {
            let valid = v.split_once('/').is_some_and(|(ip, bits)| {
                let bits: Option<u8> = bits.parse().ok();
                match (ip.parse::<std::net::IpAddr>(), bits) {
                    (Ok(std::net::IpAddr::V4(_)), Some(b)) => b <= 32,
                    (Ok(std::net::IpAddr::V6(_)), Some(b)) => b <= 128,
                    _ => false,
                }
            });
            if !valid {
                return Err(IdentifiersError::BadAddress {
                    kind: KEY_CIDR,
                    value: v.clone(),
                });
            }
        }
        Ok(ids)
    }

    /// Parses identifiers as upstream's agent validates its flag: unknown
    /// keys and malformed queries are rejected, but addresses are not checked
    /// (upstream's own e2e manifests pass `ipv4=${HOST_IP}` unexpanded, and
    /// upstream's agent starts with it). [`AgentIdentifiers::parse_strict`]
    /// tells what is wrong with such a value, for a warning.
    pub fn parse_like_upstream(query: &str) -> Result<Self, IdentifiersError> {
        let ids = Self::parse(query)?;
        if let Some((key, _)) = ids.unknown.first() {
            return Err(IdentifiersError::UnknownKey(key.clone()));
        }
        Ok(ids)
    }

    /// The strings the `destHost` strategy matches dial hosts against.
    pub fn destination_keys(&self) -> impl Iterator<Item = &str> {
        self.hosts
            .iter()
            .chain(&self.ipv4)
            .chain(&self.ipv6)
            .map(String::as_str)
    }

    /// Encodes back into the query format (hosts first, keys in a fixed order).
    pub fn to_query(&self) -> String {
        let mut out = form_urlencoded::Serializer::new(String::new());
        for h in &self.hosts {
            out.append_pair(KEY_HOST, h);
        }
        for v in &self.ipv4 {
            out.append_pair(KEY_IPV4, v);
        }
        for v in &self.ipv6 {
            out.append_pair(KEY_IPV6, v);
        }
        for v in &self.cidrs {
            out.append_pair(KEY_CIDR, v);
        }
        if self.default_route {
            out.append_pair(KEY_DEFAULT_ROUTE, "true");
        }
        for (k, v) in &self.unknown {
            out.append_pair(k, v);
        }
        out.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repeated_keys_and_default_route() {
        let ids = AgentIdentifiers::parse(
            "host=node1.example&ipv4=10.0.0.4&ipv4=10.0.0.5&ipv6=fd00::1&cidr=10.0.0.0/24&default-route=true",
        )
        .unwrap();
        assert_eq!(ids.hosts, ["node1.example"]);
        assert_eq!(ids.ipv4, ["10.0.0.4", "10.0.0.5"]);
        assert_eq!(ids.ipv6, ["fd00::1"]);
        assert_eq!(ids.cidrs, ["10.0.0.0/24"]);
        assert!(ids.default_route);
        let keys: Vec<_> = ids.destination_keys().collect();
        assert_eq!(keys, ["node1.example", "10.0.0.4", "10.0.0.5", "fd00::1"]);
    }

    #[test]
    fn empty_value_is_no_identifiers() {
        assert_eq!(
            AgentIdentifiers::parse("").unwrap(),
            AgentIdentifiers::default()
        );
    }

    #[test]
    fn decodes_escapes_and_plus() {
        let ids = AgentIdentifiers::parse("host=a%2Eb&host=c+d").unwrap();
        assert_eq!(ids.hosts, ["a.b", "c d"]);
    }

    #[test]
    fn rejects_malformed_queries() {
        assert!(matches!(
            AgentIdentifiers::parse("host=a;host=b"),
            Err(IdentifiersError::Semicolon(_))
        ));
        assert!(matches!(
            AgentIdentifiers::parse("host=%zz"),
            Err(IdentifiersError::BadEscape(_))
        ));
        assert!(matches!(
            AgentIdentifiers::parse("host=%4"),
            Err(IdentifiersError::BadEscape(_))
        ));
        assert!(matches!(
            AgentIdentifiers::parse("default-route=maybe"),
            Err(IdentifiersError::BadBool(_))
        ));
    }

    #[test]
    fn server_keeps_unknown_keys_agent_rejects_them() {
        let ids = AgentIdentifiers::parse("host=a&zone=eu").unwrap();
        assert_eq!(ids.unknown, [("zone".to_owned(), "eu".to_owned())]);
        assert_eq!(
            AgentIdentifiers::parse_strict("host=a&zone=eu"),
            Err(IdentifiersError::UnknownKey("zone".into()))
        );
        assert!(AgentIdentifiers::parse_strict("uid=1").is_err());
        assert!(AgentIdentifiers::parse_strict("ipv4=300.1.1.1").is_err());
        assert!(AgentIdentifiers::parse_strict("ipv6=zz::").is_err());
        assert!(AgentIdentifiers::parse_strict("cidr=10.0.0.0/33").is_err());
        assert!(AgentIdentifiers::parse_strict("cidr=10.0.0.0/8&ipv6=::1&ipv4=1.2.3.4").is_ok());
    }

    #[test]
    fn round_trips_through_the_query_format() {
        let ids =
            AgentIdentifiers::parse("host=a&host=b.c&ipv4=1.2.3.4&default-route=true").unwrap();
        assert_eq!(AgentIdentifiers::parse(&ids.to_query()).unwrap(), ids);
    }
}
