//! `host:port` dial addresses, as Go's `net` package reads them: the
//! packets carry them, the spans (`crate::trace::direct`), the agent's dialer and the
//! server's routing take them apart.

/// Splits a dial address into host and port the way Go's `net.SplitHostPort`
/// does (`[v6]:port`, `host:port`). Returns `None` when there is no port.
pub fn split_host_port(address: &str) -> Option<(&str, &str)> {
    if let Some(rest) = address.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = after.strip_prefix(':')?;
        return Some((host, port));
    }
    let (host, port) = address.rsplit_once(':')?;
    if host.contains(':') {
        // An unbracketed IPv6 literal is ambiguous; Go rejects it too.
        return None;
    }
    Some((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_host_and_port_like_go() {
        assert_eq!(split_host_port("a.b:443"), Some(("a.b", "443")));
        assert_eq!(split_host_port("[fd00::1]:80"), Some(("fd00::1", "80")));
        assert_eq!(split_host_port("fd00::1"), None);
        assert_eq!(split_host_port("nohost"), None);
        assert_eq!(split_host_port("[fd00::1]"), None);
    }
}
