//! The churn run: `cargo run -p e2e --example churn -- [connections] [concurrency] [agent-kills]`
//! (defaults 100000, 32, 5). Prints the report (`e2e::churn`) and exits
//! non-zero when server or agent did not come back to their baseline.

use std::time::Duration;

use e2e::churn::{ChurnOptions, run};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut number = |default: usize| -> anyhow::Result<usize> {
        match args.next() {
            Some(value) => value
                .parse()
                .map_err(|e| anyhow::anyhow!("{value:?} is not a count: {e}")),
            None => Ok(default),
        }
    };
    let mut options = ChurnOptions::new(number(100_000)?);
    options.concurrency = number(32)?;
    options.agent_kills = number(5)?;
    options.settle_deadline = Duration::from_secs(120);
    let dir = tempfile::tempdir()?;
    let report = run(&options, dir.path()).await?;
    println!("{report}");
    if report.settled_after.is_none() {
        anyhow::bail!("server or agent did not come back to its baseline");
    }
    Ok(())
}
