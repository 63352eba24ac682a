//! `tracing` set-up for every binary.
//!
//! Logs go to stderr (as klog's do). `auto` writes coloured text on a terminal
//! and plain text without ANSI codes otherwise (a log file or a collector must
//! not receive escape sequences); `json` writes one JSON object per line for
//! log pipelines.
//!
//! klog's `-v` sets the level of our own crates ([`OWN_CRATES`]) only;
//! third-party libraries (rustls, h2, hyper, tonic, tower, …) stay at `warn`
//! whatever `-v` says, so `-v=4`, which klog users run routinely, does not
//! dump TLS handshakes and HTTP/2 frames. `RUST_LOG`, when set, replaces the
//! whole filter (e.g. `RUST_LOG=info,h2=trace` to look at HTTP/2).

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
///
/// Besides `-v` and `--log-format`, the klog flags upstream's binaries
/// register (normalized to dashes, as upstream does) are accepted so that
/// existing manifests keep working; logs always go to stderr, and
/// [`LogFlags::ignored`] names the ones given that change nothing here.
#[derive(Debug, Default, Clone, clap::Args, Serialize)]
pub struct LogFlags {
    /// Log verbosity as klog's -v, for this program's own logs (RUST_LOG replaces the filter).
    #[arg(short = 'v', long = "v")]
    pub v: Option<u8>,
    /// Log lines as text (coloured only on a terminal), plain text, or JSON.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// The klog flags upstream's binaries take (boxed: they are rarely given).
    #[command(flatten)]
    #[serde(skip)]
    pub klog: Box<KlogFlags>,
}

/// klog's flags, as upstream's binaries register them; accepted so that
/// existing manifests keep working (see [`LogFlags::ignored`]).
#[derive(Debug, Default, Clone, clap::Args)]
pub struct KlogFlags {
    /// klog: log to stderr instead of files; accepted, logs always go to stderr.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", value_parser = crate::cli::parse_go_bool)]
    pub logtostderr: Option<bool>,
    /// klog: log to stderr as well as files; accepted, logs always go to stderr.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", value_parser = crate::cli::parse_go_bool)]
    pub alsologtostderr: Option<bool>,
    /// klog: directory of log files; accepted, no effect (logs go to stderr).
    #[arg(long, hide = true, alias = "log_dir")]
    pub log_dir: Option<String>,
    /// klog: log file; accepted, no effect (logs go to stderr).
    #[arg(long, hide = true, alias = "log_file")]
    pub log_file: Option<String>,
    /// klog: maximum log file size in MB; accepted, no effect.
    #[arg(long, hide = true, alias = "log_file_max_size")]
    pub log_file_max_size: Option<u64>,
    /// klog: file path in log headers; accepted, no effect.
    #[arg(long, hide = true, alias = "add_dir_header", num_args = 0..=1, default_missing_value = "true", value_parser = crate::cli::parse_go_bool)]
    pub add_dir_header: Option<bool>,
    /// klog: no header prefixes; accepted, no effect.
    #[arg(long, hide = true, alias = "skip_headers", num_args = 0..=1, default_missing_value = "true", value_parser = crate::cli::parse_go_bool)]
    pub skip_headers: Option<bool>,
    /// klog: no headers in log files; accepted, no effect.
    #[arg(long, hide = true, alias = "skip_log_headers", num_args = 0..=1, default_missing_value = "true", value_parser = crate::cli::parse_go_bool)]
    pub skip_log_headers: Option<bool>,
    /// klog: one log file for every severity; accepted, no effect.
    #[arg(long, hide = true, alias = "one_output", num_args = 0..=1, default_missing_value = "true", value_parser = crate::cli::parse_go_bool)]
    pub one_output: Option<bool>,
    /// klog: severity also written to stderr when logging to files; accepted, no effect.
    #[arg(long, hide = true)]
    pub stderrthreshold: Option<String>,
    /// klog: stderrthreshold semantics switch; accepted, no effect.
    #[arg(long, hide = true, alias = "legacy_stderr_threshold_behavior", num_args = 0..=1, default_missing_value = "true", value_parser = crate::cli::parse_go_bool)]
    pub legacy_stderr_threshold_behavior: Option<bool>,
    /// klog: per-file verbosity; accepted, no effect (use RUST_LOG=module=level).
    #[arg(long, hide = true)]
    pub vmodule: Option<String>,
    /// klog: stack trace at file:line; accepted, no effect.
    #[arg(long, hide = true, alias = "log_backtrace_at")]
    pub log_backtrace_at: Option<String>,
}

impl LogFlags {
    /// The klog flags given that change nothing here (logs always go to
    /// stderr, one line per event); a binary warns about each. Giving
    /// `--logtostderr=true` or `--alsologtostderr`, which describe what
    /// happens anyway, is not reported.
    pub fn ignored(&self) -> Vec<&'static str> {
        let klog = &self.klog;
        let mut ignored = Vec::new();
        let mut check = |given: bool, name: &'static str| {
            if given {
                ignored.push(name);
            }
        };
        check(klog.logtostderr == Some(false), "logtostderr");
        check(
            klog.log_dir.as_deref().is_some_and(|d| !d.is_empty()),
            "log-dir",
        );
        check(
            klog.log_file.as_deref().is_some_and(|f| !f.is_empty()),
            "log-file",
        );
        check(klog.add_dir_header == Some(true), "add-dir-header");
        check(klog.skip_headers == Some(true), "skip-headers");
        check(klog.skip_log_headers == Some(true), "skip-log-headers");
        check(klog.one_output == Some(true), "one-output");
        check(
            klog.vmodule.as_deref().is_some_and(|v| !v.is_empty()),
            "vmodule",
        );
        check(
            klog.log_backtrace_at
                .as_deref()
                .is_some_and(|v| !v.is_empty() && v != ":0"),
            "log-backtrace-at",
        );
        ignored
    }
}

/// The crates whose level `-v` sets: this workspace's (as `tracing` targets).
pub const OWN_CRATES: &[&str] = &[
    "cluster_proxy_proto",
    "cluster_proxy_runtime",
    "proxy_server",
    "proxy_agent",
    "cert_authority",
    "addon_manager",
    "health_prober",
    "e2e",
];

/// The level of our own crates for klog's `-v`: 0–1 info, 2–4 debug (klog's
/// V(4) is upstream's connection-level detail, and upstream's agent runs at
/// `-v=4` by default), 5 and more trace (upstream's per-packet V(5)).
pub fn level_for_verbosity(verbosity: u8) -> &'static str {
    match verbosity {
        0..=1 => "info",
        2..=4 => "debug",
        _ => "trace",
    }
}

/// The filter used when `RUST_LOG` is not set: everything at `warn`, our own
/// crates at [`level_for_verbosity`].
pub fn filter_for_verbosity(verbosity: u8) -> String {
    let level = level_for_verbosity(verbosity);
    std::iter::once("warn".to_owned())
        .chain(OWN_CRATES.iter().map(|krate| format!("{krate}={level}")))
        .collect::<Vec<_>>()
        .join(",")
}

/// Installs the global subscriber. A second call (tests that start several
/// services in one process) leaves the first in place. `RUST_LOG`, when set
/// and valid, replaces the filter [`filter_for_verbosity`] gives.
pub fn init(verbosity: u8, format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(filter_for_verbosity(verbosity)));
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
        assert_eq!(level_for_verbosity(1), "info");
        assert_eq!(level_for_verbosity(3), "debug");
        assert_eq!(level_for_verbosity(4), "debug");
        assert_eq!(level_for_verbosity(5), "trace");
        assert_eq!(level_for_verbosity(9), "trace");
    }

    #[test]
    fn verbosity_raises_our_crates_only() {
        use tracing::Level;
        use tracing_subscriber::layer::SubscriberExt;
        for v in [0u8, 4, 9] {
            let subscriber =
                tracing_subscriber::registry().with(EnvFilter::new(filter_for_verbosity(v)));
            tracing::subscriber::with_default(subscriber, || {
                assert!(tracing::enabled!(target: "proxy_agent::tunnel", Level::INFO));
                assert_eq!(
                    tracing::enabled!(target: "proxy_server::tunnel", Level::DEBUG),
                    v >= 2,
                    "-v={v}"
                );
                assert_eq!(
                    tracing::enabled!(target: "cluster_proxy_proto::flow", Level::TRACE),
                    v >= 5,
                    "-v={v}"
                );
                // A level filter: what hides INFO hides DEBUG and TRACE too.
                assert!(
                    !tracing::enabled!(target: "rustls::client::hs", Level::INFO),
                    "-v={v}"
                );
                assert!(!tracing::enabled!(target: "h2::codec::framed_read", Level::INFO));
                assert!(!tracing::enabled!(target: "hyper::proto", Level::INFO));
                assert!(!tracing::enabled!(target: "tonic::transport", Level::INFO));
                assert!(!tracing::enabled!(target: "tower::buffer", Level::INFO));
                assert!(tracing::enabled!(target: "h2::proto", Level::WARN));
            });
        }
    }

    #[test]
    fn connection_spans_are_off_in_the_log_filter() {
        // Without an exporter only the log filter applies: the per-connection
        // spans must be disabled at every verbosity, so they cost nothing.
        use tracing::Level;
        use tracing_subscriber::layer::SubscriberExt;
        for v in [0u8, 4, 9] {
            let subscriber =
                tracing_subscriber::registry().with(EnvFilter::new(filter_for_verbosity(v)));
            tracing::subscriber::with_default(subscriber, || {
                assert!(
                    !tracing::enabled!(target: cluster_proxy_proto::trace::SPAN_TARGET, Level::INFO),
                    "-v={v}"
                );
                let span =
                    tracing::info_span!(target: cluster_proxy_proto::trace::SPAN_TARGET, "probe");
                assert!(span.is_disabled(), "-v={v}");
            });
        }
    }

    #[test]
    fn klog_flags_are_accepted() {
        use clap::Parser;
        #[derive(Parser)]
        struct Demo {
            #[command(flatten)]
            logging: LogFlags,
        }
        let demo = Demo::try_parse_from([
            "demo",
            "--logtostderr=true",
            "--log-file=/var/log/konnectivity-server.log",
            "--log-file-max-size=0",
            "--alsologtostderr",
            "--v=4",
            "--vmodule=",
            "--log_dir=/tmp",
        ])
        .unwrap();
        assert_eq!(demo.logging.v, Some(4));
        assert_eq!(demo.logging.ignored(), ["log-dir", "log-file"]);
        let short = Demo::try_parse_from(["demo", "-v=5"]).unwrap();
        assert_eq!(short.logging.v, Some(5));
        assert!(Demo::try_parse_from(["demo", "--logtostderr=maybe"]).is_err());
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
