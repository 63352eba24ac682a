//! `tracing` set-up for every binary.
//!
//! Logs go to stderr (as klog's do). `auto` writes coloured text on a terminal
//! and plain text without ANSI codes otherwise (a log file or a collector must
//! not receive escape sequences); `json` writes one JSON object per line for
//! log pipelines. `RUST_LOG` overrides the verbosity derived from klog's `-v`.

use std::io::IsTerminal;

use serde::{Deserialize, Serialize};
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text; coloured only when stderr is a terminal.
    #[default]
    Auto,
    /// Plain text, never coloured.
    Text,
    /// One JSON object per line.
    Json,
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LogFormat::Auto => "auto",
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// The logging flags every binary takes, flattened into its command line.
#[derive(Debug, Default, Clone, clap::Args, Serialize)]
pub struct LogFlags {
    /// Log verbosity as klog's -v (RUST_LOG overrides).
    #[arg(short = 'v', long = "v")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub v: Option<u8>,
    /// Log lines as text (coloured only on a terminal), plain text, or JSON.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<LogFormat>,
}

/// The default filter for klog's `-v` levels: 0–1 info, 2–3 debug, more trace.
pub fn level_for_verbosity(verbosity: u8) -> &'static str {
    match verbosity {
        0..=1 => "info",
        2..=3 => "debug",
        _ => "trace",
    }
}

/// Installs the global subscriber. A second call (tests that start several
/// services in one process) leaves the first in place.
pub fn init(verbosity: u8, format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(level_for_verbosity(verbosity)));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.with_ansi(false).try_init(),
        LogFormat::Auto => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbosity_maps_like_klog() {
        assert_eq!(level_for_verbosity(0), "info");
        assert_eq!(level_for_verbosity(3), "debug");
        assert_eq!(level_for_verbosity(9), "trace");
    }

    #[test]
    fn formats_parse_from_flags_and_files() {
        use clap::ValueEnum;
        assert_eq!(LogFormat::from_str("json", true), Ok(LogFormat::Json));
        let parsed: LogFormat = serde_json::from_str("\"text\"").unwrap();
        assert_eq!(parsed, LogFormat::Text);
        assert_eq!(LogFormat::Auto.to_string(), "auto");
    }
}
