//! The `agentidentifiers` value an agent sends in its metadata: all three
//! parsers (server, agent flag, upstream-compatible) on any text, and a value
//! the server accepted survives `to_query` unchanged.
#![no_main]

use cluster_proxy_proto::identifiers::{AgentIdentifiers, parse_query};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|query: &str| {
    let pairs = parse_query(query);
    let parsed = AgentIdentifiers::parse(query);
    // The server's parser fails on everything the query splitter does, and
    // more (a `default-route` that is no Go boolean).
    if pairs.is_err() {
        assert!(parsed.is_err());
    }
    let strict = AgentIdentifiers::parse_strict(query);
    let upstream = AgentIdentifiers::parse_like_upstream(query);
    // Strict accepts a subset of what the upstream-compatible parser does,
    // which accepts a subset of what the server does.
    if let Ok(strict) = &strict {
        assert_eq!(upstream.as_ref().ok(), Some(strict));
    }
    if let Ok(upstream) = &upstream {
        assert_eq!(parsed.as_ref().ok(), Some(upstream));
    }
    if let Ok(ids) = parsed {
        let _ = ids.destination_keys().count();
        let encoded = ids.to_query();
        assert_eq!(AgentIdentifiers::parse(&encoded), Ok(ids), "{encoded:?}");
    }
});
