//! The start-up and shutdown every binary's `main` shares, written once.
//!
//! A binary names its command line ([`CommandLine`]) and its layered
//! settings ([`BinarySettings`]); [`run`] then parses the flags (with each
//! default in `--help`), loads the settings, builds the Tokio runtime, starts
//! logging and trace export, warns about what was given but changes nothing,
//! installs the signal handlers, and hands the settings and the signals to
//! the binary's own service. [`stop_on_signal`] and [`drain_on_signal`] are
//! the two ways a service ends; [`launch`] leaves the signals alone.

use std::ffi::OsString;
use std::future::Future;

use clap::{CommandFactory, FromArgMatches};
use serde::Serialize;

use crate::config::ConfigError;
use crate::logging::{LogFlags, LogFormat};
use crate::shutdown::Signals;
use crate::telemetry::{TelemetryError, TelemetryFlags};

/// A binary's command line (or a subcommand's): the shared flag groups the
/// shell reads.
pub trait CommandLine: FromArgMatches {
    /// `-v`, `--log-format` and the klog flags.
    fn logging(&self) -> &LogFlags;

    /// The OpenTelemetry flags; `None` for a binary that exports no traces.
    fn telemetry(&self) -> Option<&TelemetryFlags> {
        None
    }
}

/// A binary's effective settings: defaults < TOML file < environment < flags.
pub trait BinarySettings: Serialize + Default + Sized {
    /// The command line these settings are loaded from.
    type Flags: CommandLine;

    /// The service's name: OpenTelemetry's `service.name` unless
    /// `OTEL_SERVICE_NAME` says otherwise.
    const SERVICE: &'static str;

    /// Layers the defaults, the file, the environment and `flags`.
    fn load(flags: &Self::Flags) -> Result<Self, ConfigError>;

    /// klog's `-v` and the log line format, as loaded.
    fn log_settings(&self) -> (u8, LogFormat);

    /// How many workers the runtime has; `None` is Tokio's multi-threaded
    /// default, `Some` is [`crate::workers::build`]'s choice for `--worker-threads`.
    fn worker_threads(&self) -> Option<u32> {
        None
    }

    /// Whether spans go home through the tunnels when no collector is
    /// configured (the agent's `--trace-relay`; see
    /// [`crate::telemetry::relay`]).
    fn relays_spans(&self) -> bool {
        false
    }

    /// Settings given that change nothing here (upstream flags accepted for
    /// compatibility, or flags the others given make moot); the shell warns
    /// about each.
    fn ignored_settings(&self) -> Vec<&'static str> {
        Vec::new()
    }

    /// Anything else worth a warning at start-up (deprecated spellings,
    /// settings that contradict each other).
    fn warnings(&self, _flags: &Self::Flags) -> Vec<String> {
        Vec::new()
    }
}

/// Why a binary could not start.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Telemetry(#[from] TelemetryError),
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
}

/// Parses the process's arguments and runs `serve` with the loaded settings
/// (see the module docs). `--help`, `--version` and bad flags exit as clap does.
pub fn run<S, F, Fut, E>(serve: F) -> Result<(), E>
where
    S: BinarySettings,
    S::Flags: CommandFactory,
    F: FnOnce(S, Signals) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: From<ShellError>,
{
    run_from(std::env::args_os(), serve)
}

/// [`run`] over explicit arguments, the program name first (a binary that
/// runs another's command line as a subcommand).
pub fn run_from<S, F, Fut, E, I, T>(args: I, serve: F) -> Result<(), E>
where
    S: BinarySettings,
    S::Flags: CommandFactory,
    F: FnOnce(S, Signals) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: From<ShellError>,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let flags: S::Flags = crate::cli::parse_from(&S::default(), args);
    launch(flags, |settings| async move {
        match Signals::install() {
            Ok(signals) => serve(settings, signals).await,
            Err(error) => Err(ShellError::Signals(error).into()),
        }
    })
}

/// Loads the settings from parsed `flags`, then runs `serve` after the
/// shared start-up but without taking over the termination signals: for a
/// command that must still die of SIGTERM, as a synchronous loop does.
pub fn launch<S, F, Fut, E>(flags: S::Flags, serve: F) -> Result<(), E>
where
    S: BinarySettings,
    F: FnOnce(S) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: From<ShellError>,
{
    let settings = S::load(&flags).map_err(ShellError::from)?;
    runtime(settings.worker_threads())
        .map_err(ShellError::Runtime)?
        .block_on(start(flags, settings, serve))
}

fn runtime(worker_threads: Option<u32>) -> std::io::Result<tokio::runtime::Runtime> {
    match worker_threads {
        Some(requested) => crate::workers::build(requested),
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
    }
}

async fn start<S, F, Fut, E>(flags: S::Flags, settings: S, serve: F) -> Result<(), E>
where
    S: BinarySettings,
    F: FnOnce(S) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: From<ShellError>,
{
    let (verbosity, format) = settings.log_settings();
    let telemetry = match flags.telemetry() {
        Some(telemetry) => {
            let config = telemetry.to_config(S::SERVICE).map_err(ShellError::from)?;
            crate::telemetry::init_relaying(verbosity, format, &config, settings.relays_spans())
                .map_err(ShellError::from)?
        }
        None => {
            crate::logging::init(verbosity, format);
            crate::telemetry::Telemetry::default()
        }
    };
    for flag in settings
        .ignored_settings()
        .into_iter()
        .chain(flags.logging().ignored())
    {
        tracing::warn!(flag, "flag is accepted but has no effect");
    }
    for warning in settings.warnings(&flags) {
        tracing::warn!("{warning}");
    }
    let result = serve(settings).await;
    telemetry.shutdown().await;
    result
}

/// Waits for SIGTERM or SIGINT, then runs `stop` to its end.
pub async fn stop_on_signal<Stop: Future<Output = ()>>(mut signals: Signals, stop: Stop) {
    let signal = signals.recv().await;
    tracing::info!(signal, "stopping");
    stop.await;
}

/// Waits for SIGTERM or SIGINT, then drains with `drain`; a second signal
/// abandons the drain (as upstream's agent does).
pub async fn drain_on_signal<Drain: Future<Output = ()>>(mut signals: Signals, drain: Drain) {
    let signal = signals.recv().await;
    tracing::info!(signal, "draining");
    tokio::select! {
        _ = drain => {}
        signal = signals.recv() => tracing::warn!(signal, "second signal; exiting now"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde::Deserialize;

    #[derive(Parser, Serialize)]
    #[command(name = "demo")]
    struct DemoCli {
        /// Port to listen on.
        #[arg(long)]
        port: Option<u16>,
        #[command(flatten)]
        #[serde(flatten)]
        logging: LogFlags,
    }

    impl CommandLine for DemoCli {
        fn logging(&self) -> &LogFlags {
            &self.logging
        }
    }

    #[derive(Debug, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct DemoSettings {
        port: u16,
        v: u8,
        log_format: LogFormat,
    }

    impl Default for DemoSettings {
        fn default() -> Self {
            DemoSettings {
                port: 8,
                v: 0,
                log_format: LogFormat::Auto,
            }
        }
    }

    impl BinarySettings for DemoSettings {
        type Flags = DemoCli;
        const SERVICE: &'static str = "demo";

        fn load(flags: &DemoCli) -> Result<Self, ConfigError> {
            let spec = crate::config::EnvSpec {
                prefix: "SHELL_DEMO_TEST_",
                aliases: &[],
            };
            let settings: DemoSettings =
                crate::config::load_with_env(spec, None, flags, Vec::new())?;
            if settings.port == 0 {
                return Err(crate::config::invalid("port", "must not be 0"));
            }
            Ok(settings)
        }

        fn log_settings(&self) -> (u8, LogFormat) {
            (self.v, self.log_format)
        }

        fn worker_threads(&self) -> Option<u32> {
            Some(1)
        }
    }

    #[test]
    fn the_service_gets_the_loaded_settings_on_the_chosen_runtime() {
        let served: Result<(), ShellError> = run_from(
            ["demo", "--port", "9"],
            |settings: DemoSettings, _| async move {
                assert_eq!(settings.port, 9);
                assert_eq!(
                    tokio::runtime::Handle::current().runtime_flavor(),
                    tokio::runtime::RuntimeFlavor::CurrentThread
                );
                Ok(())
            },
        );
        served.expect("served");
    }

    #[test]
    fn a_bad_setting_stops_before_the_service_starts() {
        let served: Result<(), ShellError> =
            run_from(["demo", "--port", "0"], |_: DemoSettings, _| async {
                panic!("the service started with a refused setting")
            });
        let refused = served.expect_err("port 0 is refused").to_string();
        assert!(refused.contains("--port"), "{refused}");
    }
}
