//! Connection churn through the real proxy-server and proxy-agent binaries
//! (`e2e::churn`): a CI-sized run; `cargo run -p e2e --example churn` runs
//! the 100,000. `CHURN_CONNECTIONS` overrides the count.

use std::time::Duration;

use e2e::churn::{ChurnOptions, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churned_connections_leave_no_fds_threads_or_memory_behind() {
    let connections = std::env::var("CHURN_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let mut options = ChurnOptions::new(connections);
    options.concurrency = 16;
    options.agent_kills = 2;
    options.settle_deadline = Duration::from_secs(60);
    let dir = tempfile::tempdir().unwrap();
    let report = run(&options, dir.path())
        .await
        .unwrap_or_else(|e| panic!("churn: {e}"));
    println!("{report}");
    let counts = report.outcomes;
    let kinds = [
        counts.grpc_closed,
        counts.connect_closed,
        counts.connect_reset,
        counts.refused,
    ];
    assert!(
        kinds.iter().all(|&n| n > 0),
        "every kind of connection ran: {counts}"
    );
    assert_eq!(
        counts.killed_mid_stream, options.agent_kills,
        "every stream open at an agent kill ended: {counts}"
    );
    let finished = kinds.iter().sum::<usize>() + counts.agent_outage;
    assert_eq!(finished, connections, "every connection was accounted for");
    // A worker fails at most the connection it had in flight when the agent
    // went down and one it started before the agent came back.
    assert!(
        counts.agent_outage <= 2 * options.concurrency * options.agent_kills,
        "agent outages cost a few connections, not {}: {counts}",
        counts.agent_outage
    );
    assert!(
        report.settled_after.is_some(),
        "server and agent back to their baseline:\n{report}"
    );
}
