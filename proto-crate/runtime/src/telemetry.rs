//! OpenTelemetry traces for every binary (feature `otlp`), set up once here.
//!
//! `tracing` spans become OpenTelemetry spans (`tracing-opentelemetry`) and
//! go to an OTLP/gRPC collector when an endpoint is configured
//! (`--otlp-endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`); with no endpoint
//! nothing is exported and no OpenTelemetry layer is installed at all, so
//! spans cost what plain `tracing` spans cost.
//!
//! Export is a batch processor on its own thread with a bounded queue
//! ([`MAX_QUEUE_SPANS`]): ending a span never waits for the collector, and
//! when the collector is down or slow, spans beyond the queue are dropped
//! rather than buffered without bound. The gRPC channel to the collector
//! (connecting, encoding each batch, HTTP/2) runs on a Tokio runtime of its
//! own, on its own thread (`otel-export`), never on the runtime that
//! carries the tunnel: encoding a batch of hundreds of spans takes
//! milliseconds, which on a data-path worker would hold up every task
//! queued behind it. [`Telemetry::shutdown`] (or dropping the guard)
//! flushes what is queued.
//!
//! The connection spans (the proxy-server's, the proxy-agent's and the Rust
//! client's) do not go through `tracing`: they are made with the same
//! provider's tracer directly ([`cluster_proxy_proto::trace::direct`]),
//! which [`init`] installs.
//!
//! While traces are exported, every log line carries the `trace_id` and
//! `span_id` of the span it was written in (a JSON field, or `key=value` at
//! the end of a text line), so logs and traces can be joined.
//!
//! The standard variables `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`,
//! `OTEL_TRACES_SAMPLER_ARG`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SDK_DISABLED`
//! and the exporter's `OTEL_EXPORTER_OTLP_{ENDPOINT, HEADERS, CERTIFICATE,
//! PROTOCOL, COMPRESSION, TIMEOUT}` are read as the defaults of the matching
//! flags; each `OTEL_EXPORTER_OTLP_TRACES_*` variant (and its hidden
//! `--otlp-traces-*` flag) takes precedence over its signal-less form, as
//! the specification says. Only the `grpc` protocol is spoken: any other is
//! refused at startup rather than sent to a port that expects HTTP.
//!
//! The exporter is ours ([`otlp_exporter`]): it writes each batch straight
//! into OTLP protobuf ([`otlp_encoding`]) instead of building the
//! `opentelemetry-proto` messages first, which with every connection
//! sampled was most of what a span cost.

mod error;
mod export_runtime;
mod otlp_encoding;
mod otlp_exporter;
pub mod relay;

pub use export_runtime::EXPORT_THREAD_NICE;
use export_runtime::{ExportRuntime, yield_to_the_data_path};

// Apart from this module so the exporter, which this module starts, can
// name them without depending on it.
pub use error::{ExportCompression, TelemetryError};

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use tracing::{Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::logging::{LogFormat, filter_for_verbosity};

/// Spans held for export at most; more are dropped while the collector lags.
pub const MAX_QUEUE_SPANS: usize = 4096;
/// Longest a single export may take before it is abandoned, unless
/// `OTEL_EXPORTER_OTLP_TIMEOUT` says otherwise.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often queued spans are sent.
pub const EXPORT_INTERVAL: Duration = Duration::from_secs(1);

/// The tracing flags every binary takes, flattened into its command line.
/// Each defaults to the standard OpenTelemetry environment variable.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct TelemetryFlags {
    /// OTLP/gRPC collector for traces, e.g. http://otel-collector:4317; traces are off when unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Service name on exported spans (default: the program's name).
    #[arg(long, env = "OTEL_SERVICE_NAME")]
    pub otel_service_name: Option<String>,
    /// Sampler: parentbased_always_on (default), parentbased_always_off, parentbased_traceidratio, always_on, always_off or traceidratio.
    #[arg(long, env = "OTEL_TRACES_SAMPLER")]
    pub otel_traces_sampler: Option<String>,
    /// Ratio (0 to 1) for the traceidratio samplers; default 1.
    #[arg(long, env = "OTEL_TRACES_SAMPLER_ARG")]
    pub otel_traces_sampler_arg: Option<String>,
    /// Extra resource attributes on exported spans: key=value pairs separated by commas.
    #[arg(long, env = "OTEL_RESOURCE_ATTRIBUTES")]
    pub otel_resource_attributes: Option<String>,
    /// gRPC metadata sent with every export (e.g. a collector's API key): key=value pairs separated by commas.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_HEADERS")]
    pub otlp_headers: Option<String>,
    /// CA bundle (PEM file) an https collector's certificate must chain to.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_CERTIFICATE")]
    pub otlp_certificate: Option<std::path::PathBuf>,
    /// OTLP transport; only grpc (the default) is spoken.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_PROTOCOL")]
    pub otlp_protocol: Option<String>,
    /// Compression of each export: none (default) or gzip.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_COMPRESSION")]
    pub otlp_compression: Option<String>,
    /// Longest an export may take, in milliseconds (default 5000); a batch that takes longer is dropped.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TIMEOUT")]
    pub otlp_timeout: Option<String>,
    /// true turns trace export off whatever else is set.
    #[arg(long, env = "OTEL_SDK_DISABLED")]
    pub otel_sdk_disabled: Option<String>,
    // The traces-only forms of the exporter settings; each overrides the
    // signal-less one above. Hidden from --help: the variables are what
    // deployments set.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", hide = true)]
    pub otlp_traces_endpoint: Option<String>,
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_HEADERS", hide = true)]
    pub otlp_traces_headers: Option<String>,
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", hide = true)]
    pub otlp_traces_certificate: Option<std::path::PathBuf>,
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", hide = true)]
    pub otlp_traces_protocol: Option<String>,
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", hide = true)]
    pub otlp_traces_compression: Option<String>,
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", hide = true)]
    pub otlp_traces_timeout: Option<String>,
}

/// Which spans are recorded and exported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerChoice {
    AlwaysOn,
    AlwaysOff,
    TraceIdRatio(f64),
    /// Follow the parent's decision; the inner choice decides for root spans.
    ParentBased(RootSampler),
}

/// The root sampler of [`SamplerChoice::ParentBased`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RootSampler {
    AlwaysOn,
    AlwaysOff,
    TraceIdRatio(f64),
}

impl SamplerChoice {
    /// Parses `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` as the spec defines them.
    pub fn parse(name: Option<&str>, arg: Option<&str>) -> Result<Self, TelemetryError> {
        let ratio = || -> Result<f64, TelemetryError> {
            match arg.map(str::trim).filter(|a| !a.is_empty()) {
                None => Ok(1.0),
                Some(text) => text
                    .parse::<f64>()
                    .ok()
                    .filter(|r| (0.0..=1.0).contains(r))
                    .ok_or_else(|| TelemetryError::SamplerArg(text.to_owned())),
            }
        };
        let name = name.map(str::trim).filter(|n| !n.is_empty());
        Ok(match name.unwrap_or("parentbased_always_on") {
            "always_on" => SamplerChoice::AlwaysOn,
            "always_off" => SamplerChoice::AlwaysOff,
            "traceidratio" => SamplerChoice::TraceIdRatio(ratio()?),
            "parentbased_always_on" => SamplerChoice::ParentBased(RootSampler::AlwaysOn),
            "parentbased_always_off" => SamplerChoice::ParentBased(RootSampler::AlwaysOff),
            "parentbased_traceidratio" => {
                SamplerChoice::ParentBased(RootSampler::TraceIdRatio(ratio()?))
            }
            other => return Err(TelemetryError::Sampler(other.to_owned())),
        })
    }

    fn sampler(self) -> Sampler {
        match self {
            SamplerChoice::AlwaysOn => Sampler::AlwaysOn,
            SamplerChoice::AlwaysOff => Sampler::AlwaysOff,
            SamplerChoice::TraceIdRatio(r) => Sampler::TraceIdRatioBased(r),
            SamplerChoice::ParentBased(root) => Sampler::ParentBased(Box::new(match root {
                RootSampler::AlwaysOn => Sampler::AlwaysOn,
                RootSampler::AlwaysOff => Sampler::AlwaysOff,
                RootSampler::TraceIdRatio(r) => Sampler::TraceIdRatioBased(r),
            })),
        }
    }
}

/// Parses `OTEL_RESOURCE_ATTRIBUTES`: `key=value` pairs separated by commas,
/// values percent-decoded as the spec says.
pub fn parse_resource_attributes(text: &str) -> Result<Vec<(String, String)>, TelemetryError> {
    parse_key_values(text, TelemetryError::ResourceAttribute)
}

/// Parses `OTEL_EXPORTER_OTLP_HEADERS`, which has the format of
/// `OTEL_RESOURCE_ATTRIBUTES`.
pub fn parse_headers(text: &str) -> Result<Vec<(String, String)>, TelemetryError> {
    parse_key_values(text, TelemetryError::Header)
}

fn parse_key_values(
    text: &str,
    error: fn(String) -> TelemetryError,
) -> Result<Vec<(String, String)>, TelemetryError> {
    text.split(',')
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair
                .split_once('=')
                .filter(|(k, _)| !k.trim().is_empty())
                .ok_or_else(|| error(pair.to_owned()))?;
            let value = percent_decode(value.trim()).ok_or_else(|| error(pair.to_owned()))?;
            Ok((key.trim().to_owned(), value))
        })
        .collect()
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A checked tracing configuration. Its `Debug` leaves header values out:
/// they are often credentials.
#[derive(Clone, PartialEq)]
pub struct TelemetryConfig {
    /// Where spans go; `None` turns export off.
    pub endpoint: Option<String>,
    pub service_name: String,
    pub sampler: SamplerChoice,
    pub resource_attributes: Vec<(String, String)>,
    /// gRPC metadata on every export.
    pub headers: Vec<(String, String)>,
    /// The CA bundle (PEM) an https collector's certificate must chain to.
    pub ca_certificate: Option<std::path::PathBuf>,
    pub compression: ExportCompression,
    /// Longest one export may take, connecting included.
    pub export_timeout: Duration,
    /// `OTEL_SDK_DISABLED=true`: no spans at all, not even relayed ones.
    pub disabled: bool,
}

impl std::fmt::Debug for TelemetryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryConfig")
            .field("endpoint", &self.endpoint)
            .field("service_name", &self.service_name)
            .field("sampler", &self.sampler)
            .field("resource_attributes", &self.resource_attributes)
            .field("headers", &RedactedHeaders(&self.headers))
            .field("ca_certificate", &self.ca_certificate)
            .field("compression", &self.compression)
            .field("export_timeout", &self.export_timeout)
            .field("disabled", &self.disabled)
            .finish()
    }
}

/// Header names with their values left out, for `Debug`.
pub(crate) struct RedactedHeaders<'a>(pub(crate) &'a [(String, String)]);

impl std::fmt::Debug for RedactedHeaders<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(name, _)| (name, "<redacted>")))
            .finish()
    }
}

impl TelemetryConfig {
    /// No export: logs only.
    pub fn off(service_name: &str) -> Self {
        TelemetryConfig {
            endpoint: None,
            service_name: service_name.to_owned(),
            sampler: SamplerChoice::ParentBased(RootSampler::AlwaysOn),
            resource_attributes: Vec::new(),
            headers: Vec::new(),
            ca_certificate: None,
            compression: ExportCompression::None,
            export_timeout: EXPORT_TIMEOUT,
            disabled: false,
        }
    }
}

/// The traces-only form of a setting when it is given, else the general one;
/// blank values count as not given.
fn for_traces<'a>(traces: Option<&'a str>, general: Option<&'a str>) -> Option<&'a str> {
    let given = |value: Option<&'a str>| value.map(str::trim).filter(|v| !v.is_empty());
    given(traces).or(given(general))
}

fn parse_protocol(text: Option<&str>) -> Result<(), TelemetryError> {
    match text {
        None | Some("grpc") => Ok(()),
        Some(other) => Err(TelemetryError::Protocol(other.to_owned())),
    }
}

fn parse_compression(text: Option<&str>) -> Result<ExportCompression, TelemetryError> {
    match text {
        None | Some("none") => Ok(ExportCompression::None),
        Some("gzip") => Ok(ExportCompression::Gzip),
        Some(other) => Err(TelemetryError::Compression(other.to_owned())),
    }
}

fn parse_timeout(text: Option<&str>) -> Result<Duration, TelemetryError> {
    let Some(text) = text else {
        return Ok(EXPORT_TIMEOUT);
    };
    text.parse::<u64>()
        .ok()
        .filter(|millis| *millis > 0)
        .map(Duration::from_millis)
        .ok_or_else(|| TelemetryError::Timeout(text.to_owned()))
}

fn parse_sdk_disabled(text: Option<&str>) -> Result<bool, TelemetryError> {
    match text.map(str::trim).filter(|t| !t.is_empty()) {
        None => Ok(false),
        Some(t) if t.eq_ignore_ascii_case("true") => Ok(true),
        Some(t) if t.eq_ignore_ascii_case("false") => Ok(false),
        Some(other) => Err(TelemetryError::SdkDisabled(other.to_owned())),
    }
}

impl TelemetryFlags {
    /// Checks the flags; `default_service_name` names the service when
    /// `OTEL_SERVICE_NAME` does not. An empty endpoint means off.
    pub fn to_config(&self, default_service_name: &str) -> Result<TelemetryConfig, TelemetryError> {
        let disabled = parse_sdk_disabled(self.otel_sdk_disabled.as_deref())?;
        let endpoint = for_traces(
            self.otlp_traces_endpoint.as_deref(),
            self.otlp_endpoint.as_deref(),
        )
        .filter(|_| !disabled)
        .map(str::to_owned);
        parse_protocol(for_traces(
            self.otlp_traces_protocol.as_deref(),
            self.otlp_protocol.as_deref(),
        ))?;
        if let Some(endpoint) = &endpoint {
            let uri: http::Uri =
                endpoint
                    .parse()
                    .map_err(|e: http::uri::InvalidUri| TelemetryError::Endpoint {
                        endpoint: endpoint.clone(),
                        reason: e.to_string(),
                    })?;
            if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                return Err(TelemetryError::Endpoint {
                    endpoint: endpoint.clone(),
                    reason: "expected http://host:port or https://host:port".into(),
                });
            }
        }
        Ok(TelemetryConfig {
            endpoint,
            disabled,
            service_name: self
                .otel_service_name
                .as_deref()
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .unwrap_or(default_service_name)
                .to_owned(),
            sampler: SamplerChoice::parse(
                self.otel_traces_sampler.as_deref(),
                self.otel_traces_sampler_arg.as_deref(),
            )?,
            resource_attributes: parse_resource_attributes(
                self.otel_resource_attributes.as_deref().unwrap_or(""),
            )?,
            headers: parse_headers(
                for_traces(
                    self.otlp_traces_headers.as_deref(),
                    self.otlp_headers.as_deref(),
                )
                .unwrap_or(""),
            )?,
            ca_certificate: [&self.otlp_traces_certificate, &self.otlp_certificate]
                .into_iter()
                .flatten()
                .find(|path| !path.as_os_str().is_empty())
                .cloned(),
            compression: parse_compression(for_traces(
                self.otlp_traces_compression.as_deref(),
                self.otlp_compression.as_deref(),
            ))?,
            export_timeout: parse_timeout(for_traces(
                self.otlp_traces_timeout.as_deref(),
                self.otlp_timeout.as_deref(),
            ))?,
        })
    }
}

/// Owns the span exporter; flushes queued spans when shut down or dropped.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// Declared after `provider`, so it outlives the final flush.
    export_runtime: Option<ExportRuntime>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// The tracer for connection spans made outside `tracing`
    /// ([`cluster_proxy_proto::trace::DirectSpan`]): the same provider, so
    /// the same batch queue, sampler and resource, as the layer's. `None`
    /// when nothing is exported.
    pub fn connection_tracer(&self) -> Option<opentelemetry::global::BoxedTracer> {
        let provider = self.provider.as_ref()?;
        Some(opentelemetry::global::BoxedTracer::new(Box::new(
            provider.tracer("cluster-proxy"),
        )))
    }

    /// Sends the spans still queued and stops the exporter. The flush runs on
    /// a blocking thread so the runtime that drives the exporter's
    /// connection stays free.
    pub async fn shutdown(mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
        if let Some(export_runtime) = self.export_runtime.take() {
            let _ = tokio::task::spawn_blocking(move || drop(export_runtime)).await;
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // On a thread of its own: the exporter may need this thread's
            // runtime to make progress; the export timeout bounds the wait.
            let _ = std::thread::spawn(move || provider.shutdown()).join();
        }
    }
}

/// Builds the exporting tracer provider, with the runtime its gRPC channel
/// to the collector runs on (see the module's introduction).
fn tracer_provider(
    config: &TelemetryConfig,
    endpoint: &str,
) -> Result<(SdkTracerProvider, ExportRuntime), TelemetryError> {
    let collector = collector_config(config, endpoint)?;
    let export_runtime = ExportRuntime::start("otel-export")?;
    // The channel spawns its tasks on the runtime it is built in.
    let exporter = {
        let _entered = export_runtime.handle.enter();
        otlp_exporter::OtlpSpanExporter::new(&collector)?
    };
    Ok((provider_with(config, exporter), export_runtime))
}

/// The collector `config` names at `endpoint`, its CA bundle read.
fn collector_config(
    config: &TelemetryConfig,
    endpoint: &str,
) -> Result<otlp_exporter::CollectorConfig, TelemetryError> {
    let ca_certificate_pem = match &config.ca_certificate {
        Some(path) => Some(
            std::fs::read(path).map_err(|source| TelemetryError::Certificate {
                path: path.clone(),
                source,
            })?,
        ),
        None => None,
    };
    Ok(otlp_exporter::CollectorConfig {
        endpoint: endpoint.to_owned(),
        headers: config.headers.clone(),
        ca_certificate_pem,
        compression: config.compression,
        timeout: config.export_timeout,
    })
}

/// A forwarder of the spans agents relay ([`relay::SpanForwarder`]) to the
/// collector `config` names, holding at most `capacity` batches and
/// counting spans by `outcome` in `spans`; `None` when `config` exports
/// nothing.
pub fn span_forwarder(
    config: &TelemetryConfig,
    capacity: usize,
    spans: prometheus_client::metrics::family::Family<
        relay::Labels,
        prometheus_client::metrics::counter::Counter,
    >,
) -> Result<Option<relay::SpanForwarder>, TelemetryError> {
    let Some(endpoint) = &config.endpoint else {
        return Ok(None);
    };
    let collector = collector_config(config, endpoint)?;
    relay::SpanForwarder::start(&collector, capacity, spans).map(Some)
}

/// The tracer provider of an agent that relays its spans through its
/// tunnels ([`relay`]): the same sampler, resource and batching as
/// [`tracer_provider`]'s, with `queue` where the collector would be.
fn relaying_provider(
    config: &TelemetryConfig,
    queue: std::sync::Arc<relay::RelayQueue>,
) -> SdkTracerProvider {
    provider_with(config, relay::RelayExporter::new(queue))
}

/// A provider exporting through `exporter` with `config`'s sampler and
/// resource, in batches on a processor thread of the lowest priority.
fn provider_with<E>(config: &TelemetryConfig, exporter: E) -> SdkTracerProvider
where
    E: opentelemetry_sdk::trace::SpanExporter + 'static,
{
    // The processor starts a thread of its own (it turns each batch into
    // OTLP messages): the threads that appear while it is built are its.
    let threads_before = thread_ids();
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(MAX_QUEUE_SPANS)
                .with_scheduled_delay(EXPORT_INTERVAL)
                .build(),
        )
        .build();
    for thread in thread_ids().difference(&threads_before) {
        yield_to_the_data_path(Some(*thread));
    }
    let resource = Resource::builder_empty()
        .with_service_name(config.service_name.clone())
        .with_attributes(
            config
                .resource_attributes
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .build();
    SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_sampler(config.sampler.sampler())
        .with_resource(resource)
        .build()
}

/// This process's thread ids (Linux); empty where `/proc` is not there.
fn thread_ids() -> std::collections::BTreeSet<i32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Default::default();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| task.file_name().to_str()?.parse().ok())
        .collect()
}

/// Installs the global subscriber: the log output of [`crate::logging`]
/// and, when `config` has an endpoint, OpenTelemetry export with trace ids
/// in every log line. A second call (several services in one test process)
/// leaves the first subscriber in place and exports nothing of its own.
pub fn init(
    verbosity: u8,
    format: LogFormat,
    config: &TelemetryConfig,
) -> Result<Telemetry, TelemetryError> {
    init_relaying(verbosity, format, config, false)
}

/// [`init`], and with `relay` (an agent's `--trace-relay=auto`) and no
/// endpoint, spans are exported to the process's [`relay::RelayQueue`]
/// ([`relay::installed`]) for its tunnels to send home, instead of
/// nowhere. `OTEL_SDK_DISABLED=true` turns that off too.
pub fn init_relaying(
    verbosity: u8,
    format: LogFormat,
    config: &TelemetryConfig,
    relay: bool,
) -> Result<Telemetry, TelemetryError> {
    let (provider, export_runtime, queue) = match &config.endpoint {
        Some(endpoint) => {
            let (provider, runtime) = tracer_provider(config, endpoint)?;
            (provider, Some(runtime), None)
        }
        None if relay && !config.disabled => {
            let queue = relay::RelayQueue::new(relay::RELAY_QUEUE_BATCHES);
            (relaying_provider(config, queue.clone()), None, Some(queue))
        }
        None => {
            crate::logging::init(verbosity, format);
            return Ok(Telemetry::default());
        }
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(filter_for_verbosity(verbosity)));
    let tracer = provider.tracer("cluster-proxy");
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .event_format(WithTraceIds {
            json: format == LogFormat::Json,
        });
    // The connection spans (target SPAN_TARGET) go to the exporter only; the
    // log output keeps its own filter.
    let export_filter = export_targets(&filter_for_verbosity(verbosity));
    let installed = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(span_layer(tracer).with_filter(export_filter))
        .try_init();
    if installed.is_err() {
        let _ = provider.shutdown();
        return Ok(Telemetry::default());
    }
    if let Some(queue) = queue {
        relay::install(queue);
    }
    let telemetry = Telemetry {
        provider: Some(provider),
        export_runtime,
    };
    // The connection spans are made with the provider's tracer directly
    // (`cluster_proxy_proto::trace::direct`), not through the layer.
    if let Some(tracer) = telemetry.connection_tracer() {
        let _ = cluster_proxy_proto::trace::install_tracer(tracer);
    }
    Ok(telemetry)
}

/// The exporter `config` describes, with no subscriber and no tracer
/// installed: for a process that compares tracing on and off side by side
/// (the tunnel benchmark, `span_cost`) and hands its
/// [`Telemetry::connection_tracer`] only to what it traces. `None` without
/// an endpoint.
pub fn exporter(config: &TelemetryConfig) -> Result<Option<Telemetry>, TelemetryError> {
    let Some(endpoint) = &config.endpoint else {
        return Ok(None);
    };
    let (provider, export_runtime) = tracer_provider(config, endpoint)?;
    Ok(Some(Telemetry {
        provider: Some(provider),
        export_runtime: Some(export_runtime),
    }))
}

/// What the exporting layer sees: `directives` (`target=level`, as
/// [`filter_for_verbosity`] writes them) and the connection and reconcile
/// spans ([`cluster_proxy_proto::trace::SPAN_TARGET`]). A static target
/// filter rather than an `EnvFilter`: an `EnvFilter` beside a layer takes a
/// lock on every record, enter and close of every span it lets through, and
/// a connection span has a dozen of those.
fn export_targets(directives: &str) -> Targets {
    directives
        .parse::<Targets>()
        .unwrap_or_else(|_| Targets::new())
        .with_target(cluster_proxy_proto::trace::SPAN_TARGET, Level::INFO)
}

/// The layer that turns spans into OpenTelemetry spans. Without the
/// source location (`code.*`), thread (`thread.*`) and busy/idle-time
/// attributes the layer adds by default: a connection span is made for
/// every tunneled connection, and each of those costs allocations and
/// clock reads per span (the inactivity tracking, per poll) on the data
/// path and bytes on the wire, and says nothing the span's name and
/// attributes do not. Without context activation either: nothing here reads
/// OpenTelemetry's thread-local current context (parents come from the
/// `tracing` span tree and [`cluster_proxy_proto::trace`]), and activating
/// it costs a lock, a context clone and two stack operations per poll of
/// every instrumented future.
fn span_layer<S>(
    tracer: opentelemetry_sdk::trace::Tracer,
) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_context_activation(false)
}

/// The span of one reconcile of a controller (`reconcile`), named after
/// the object it reconciles. Like the connection spans it has the target
/// [`cluster_proxy_proto::trace::SPAN_TARGET`]: with no exporter it is
/// disabled and costs nothing. Record the outcome with [`record_outcome`],
/// or run the work with [`in_reconcile_span`].
pub fn reconcile_span(
    controller: &'static str,
    kind: &str,
    name: &str,
    namespace: Option<&str>,
) -> tracing::Span {
    tracing::info_span!(
        target: cluster_proxy_proto::trace::SPAN_TARGET,
        "reconcile",
        otel.kind = "internal",
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
        cluster_proxy.controller = controller,
        k8s.object.kind = kind,
        k8s.object.name = name,
        k8s.object.namespace = namespace.unwrap_or_default(),
        error.message = tracing::field::Empty,
    )
}

/// Marks `span` failed with the error's text; a success leaves the status
/// unset, as the semantic conventions ask of instrumentation.
pub fn record_outcome<T, E: std::fmt::Display>(span: &tracing::Span, result: &Result<T, E>) {
    if let Err(error) = result {
        record_error(span, error);
    }
}

/// Marks `span` failed with `error`'s text.
pub fn record_error(span: &tracing::Span, error: &dyn std::fmt::Display) {
    let text = error.to_string();
    span.record("otel.status_code", "ERROR");
    span.record("otel.status_description", text.as_str());
    span.record("error.message", text.as_str());
}

/// Runs `work` inside `span` and records how it ended.
pub async fn in_reconcile_span<T, E: std::fmt::Display>(
    span: tracing::Span,
    work: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    use tracing::Instrument;
    let result = work.instrument(span.clone()).await;
    record_outcome(&span, &result);
    result
}

/// Writes the usual log line (text without colour, or JSON) with the
/// current span's trace and span ids added.
struct WithTraceIds {
    json: bool,
}

impl<S, N> FormatEvent<S, N> for WithTraceIds
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let ids = trace_ids();
        let mut line = String::new();
        if self.json {
            tracing_subscriber::fmt::format()
                .json()
                .with_target(false)
                .format_event(ctx, Writer::new(&mut line), event)?;
        } else {
            tracing_subscriber::fmt::format()
                .with_target(false)
                .with_ansi(false)
                .format_event(ctx, Writer::new(&mut line), event)?;
        }
        writer.write_str(&add_trace_ids(&line, ids.as_ref(), self.json))
    }
}

/// The trace and span id of the current span, when it is recorded.
fn trace_ids() -> Option<(String, String)> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let current = tracing::Span::current();
    if current.is_none() {
        return None;
    }
    let context = current.context();
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| {
        (
            span_context.trace_id().to_string(),
            span_context.span_id().to_string(),
        )
    })
}

/// Adds the ids to one formatted log line (which ends with a newline).
fn add_trace_ids(line: &str, ids: Option<&(String, String)>, json: bool) -> String {
    let Some((trace_id, span_id)) = ids else {
        return line.to_owned();
    };
    let body = line.trim_end_matches('\n');
    if json {
        match body.strip_suffix('}') {
            Some(open) => {
                format!("{open},\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"}}\n")
            }
            None => line.to_owned(),
        }
    } else {
        format!("{body} trace_id={trace_id} span_id={span_id}\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samplers_parse_as_the_spec_names_them() {
        assert_eq!(
            SamplerChoice::parse(None, None).unwrap(),
            SamplerChoice::ParentBased(RootSampler::AlwaysOn)
        );
        assert_eq!(
            SamplerChoice::parse(Some("traceidratio"), Some("0.25")).unwrap(),
            SamplerChoice::TraceIdRatio(0.25)
        );
        assert_eq!(
            SamplerChoice::parse(Some("parentbased_traceidratio"), None).unwrap(),
            SamplerChoice::ParentBased(RootSampler::TraceIdRatio(1.0))
        );
        assert_eq!(
            SamplerChoice::parse(Some("always_off"), None).unwrap(),
            SamplerChoice::AlwaysOff
        );
        assert!(matches!(
            SamplerChoice::parse(Some("sometimes"), None),
            Err(TelemetryError::Sampler(_))
        ));
        for bad in ["1.5", "-0.1", "half", "NaN"] {
            assert!(
                matches!(
                    SamplerChoice::parse(Some("traceidratio"), Some(bad)),
                    Err(TelemetryError::SamplerArg(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn resource_attributes_parse_and_decode() {
        assert_eq!(
            parse_resource_attributes("k8s.cluster.name=hub, team=a%20b,").unwrap(),
            vec![
                ("k8s.cluster.name".to_owned(), "hub".to_owned()),
                ("team".to_owned(), "a b".to_owned())
            ]
        );
        assert!(parse_resource_attributes("").unwrap().is_empty());
        for bad in ["novalue", "=v", "k=%zz", "k=%4"] {
            assert!(
                matches!(
                    parse_resource_attributes(bad),
                    Err(TelemetryError::ResourceAttribute(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn flags_become_a_config() {
        let off = TelemetryFlags::default().to_config("proxy-server").unwrap();
        assert_eq!(off, TelemetryConfig::off("proxy-server"));
        let blank = TelemetryFlags {
            otlp_endpoint: Some("  ".into()),
            ..Default::default()
        };
        assert_eq!(blank.to_config("x").unwrap().endpoint, None);
        let on = TelemetryFlags {
            otlp_endpoint: Some("http://127.0.0.1:4317".into()),
            otel_service_name: Some("hub-proxy".into()),
            otel_traces_sampler: Some("always_on".into()),
            otel_resource_attributes: Some("a=b".into()),
            ..Default::default()
        }
        .to_config("proxy-server")
        .unwrap();
        assert_eq!(on.endpoint.as_deref(), Some("http://127.0.0.1:4317"));
        assert_eq!(on.service_name, "hub-proxy");
        assert_eq!(on.sampler, SamplerChoice::AlwaysOn);
        for bad in ["127.0.0.1:4317", "ftp://collector:4317", "http://"] {
            let flags = TelemetryFlags {
                otlp_endpoint: Some(bad.into()),
                ..Default::default()
            };
            assert!(
                matches!(flags.to_config("x"), Err(TelemetryError::Endpoint { .. })),
                "{bad}"
            );
        }
    }

    /// The `/proc` directories of this process's threads whose name starts
    /// with `prefix`.
    fn threads_named(prefix: &str) -> Vec<std::path::PathBuf> {
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return Vec::new();
        };
        tasks
            .filter_map(Result::ok)
            .map(|task| task.path())
            .filter(|task| {
                std::fs::read_to_string(task.join("comm"))
                    .is_ok_and(|comm| comm.starts_with(prefix))
            })
            .collect()
    }

    /// The nice value of each thread of this process whose name starts
    /// with `prefix`.
    fn nice_of_threads(prefix: &str) -> Vec<i32> {
        threads_named(prefix)
            .iter()
            .filter_map(|task| {
                // Field 19 of stat, counted after the name's closing paren.
                let stat = std::fs::read_to_string(task.join("stat")).ok()?;
                let after_name = stat.rsplit_once(')')?.1;
                after_name.split_whitespace().nth(16)?.parse().ok()
            })
            .collect()
    }

    /// Export never competes with the data path at equal priority: both the
    /// batch processor's thread and the `otel-export` runtime's run at the
    /// lowest priority.
    #[test]
    fn the_export_threads_run_at_the_lowest_priority() {
        let config = TelemetryConfig {
            endpoint: Some("http://127.0.0.1:9".into()),
            sampler: SamplerChoice::AlwaysOn,
            ..TelemetryConfig::off("test")
        };
        let telemetry = exporter(&config).unwrap().unwrap();
        // Threads name themselves once they run: wait for both names.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let export = nice_of_threads("otel-export");
            let batch = nice_of_threads("OpenTelemetry");
            if !export.is_empty() && !batch.is_empty() {
                assert!(
                    export
                        .iter()
                        .chain(&batch)
                        .all(|nice| *nice == EXPORT_THREAD_NICE),
                    "export threads' nice values: {export:?} and {batch:?}"
                );
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "export threads not found: {export:?} {batch:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(telemetry);
    }

    /// The exporter's gRPC channel runs on a runtime of its own, so it can
    /// be set up where no Tokio runtime exists, and the runtime that carries
    /// the tunnel never encodes a batch. Built on the caller's runtime, as
    /// before, this panicked: the channel spawns its tasks where it is built.
    #[test]
    fn the_exporter_runs_on_a_runtime_of_its_own() {
        assert!(tokio::runtime::Handle::try_current().is_err());
        let config = TelemetryConfig {
            // Nothing listens there: exports fail at once.
            endpoint: Some("http://127.0.0.1:9".into()),
            sampler: SamplerChoice::AlwaysOn,
            ..TelemetryConfig::off("test")
        };
        let telemetry = exporter(&config)
            .expect("an exporter without an ambient runtime")
            .expect("an endpoint");
        assert!(telemetry.exporting());
        // The new thread names itself once it runs: wait for that.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while threads_named("otel-export").is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "no otel-export thread"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let tracer = telemetry.connection_tracer().expect("a tracer");
        let span = cluster_proxy_proto::trace::DirectSpan::start_with(
            &tracer,
            "test.span",
            opentelemetry::trace::SpanKind::Internal,
            &opentelemetry::Context::new(),
            0,
        );
        assert!(span.is_recording());
        drop(span);
        // Flushes to the unreachable collector and stops the runtime; the
        // export timeout bounds it.
        drop(telemetry);
    }

    #[test]
    fn flags_read_the_standard_variables_as_defaults() {
        use clap::Parser;
        #[derive(Parser)]
        struct Demo {
            #[command(flatten)]
            telemetry: TelemetryFlags,
        }
        let demo = Demo::try_parse_from([
            "demo",
            "--otlp-endpoint=http://127.0.0.1:4317",
            "--otel-traces-sampler=traceidratio",
            "--otel-traces-sampler-arg=0.5",
        ])
        .unwrap();
        let config = demo.telemetry.to_config("demo").unwrap();
        assert_eq!(config.sampler, SamplerChoice::TraceIdRatio(0.5));
        let command = <Demo as clap::CommandFactory>::command();
        let env_of = |id: &str| {
            command
                .get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env())
                .and_then(|e| e.to_str())
                .map(str::to_owned)
        };
        for (flag, variable) in [
            ("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
            ("otel_service_name", "OTEL_SERVICE_NAME"),
            ("otel_traces_sampler", "OTEL_TRACES_SAMPLER"),
            ("otel_traces_sampler_arg", "OTEL_TRACES_SAMPLER_ARG"),
            ("otel_resource_attributes", "OTEL_RESOURCE_ATTRIBUTES"),
            ("otlp_headers", "OTEL_EXPORTER_OTLP_HEADERS"),
            ("otlp_certificate", "OTEL_EXPORTER_OTLP_CERTIFICATE"),
            ("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL"),
            ("otlp_compression", "OTEL_EXPORTER_OTLP_COMPRESSION"),
            ("otlp_timeout", "OTEL_EXPORTER_OTLP_TIMEOUT"),
            ("otel_sdk_disabled", "OTEL_SDK_DISABLED"),
            ("otlp_traces_endpoint", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            ("otlp_traces_headers", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"),
            (
                "otlp_traces_certificate",
                "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
            ),
            ("otlp_traces_protocol", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
            (
                "otlp_traces_compression",
                "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
            ),
            ("otlp_traces_timeout", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"),
        ] {
            assert_eq!(env_of(flag).as_deref(), Some(variable), "{flag}");
        }
        let demo = Demo::try_parse_from([
            "demo",
            "--otlp-endpoint=https://collector:4317",
            "--otlp-headers=api-key=a%2Cb, x-tenant = hub-1",
            "--otlp-certificate=/etc/collector/ca.pem",
        ])
        .unwrap();
        let config = demo.telemetry.to_config("demo").unwrap();
        assert_eq!(
            config.headers,
            [
                ("api-key".to_owned(), "a,b".to_owned()),
                ("x-tenant".to_owned(), "hub-1".to_owned())
            ]
        );
        assert_eq!(
            config.ca_certificate.as_deref(),
            Some(std::path::Path::new("/etc/collector/ca.pem"))
        );
        let bad = Demo::try_parse_from(["demo", "--otlp-headers=novalue"]).unwrap();
        assert!(matches!(
            bad.telemetry.to_config("demo"),
            Err(TelemetryError::Header(_))
        ));
    }

    /// The traces-only settings override the general ones; protocols other
    /// than grpc, unknown compressions, bad timeouts and a bad
    /// `OTEL_SDK_DISABLED` are refused with what was wrong.
    #[test]
    fn traces_settings_override_the_general_ones_and_bad_values_are_refused() {
        #[derive(clap::Parser)]
        struct Demo {
            #[command(flatten)]
            telemetry: TelemetryFlags,
        }
        let config_of = |args: &[&str]| {
            <Demo as clap::Parser>::try_parse_from(
                std::iter::once("demo").chain(args.iter().copied()),
            )
            .expect("the flags parse")
            .telemetry
            .to_config("demo")
        };

        let defaults = config_of(&["--otlp-endpoint=http://collector:4317"]).unwrap();
        assert_eq!(defaults.compression, ExportCompression::None);
        assert_eq!(defaults.export_timeout, EXPORT_TIMEOUT);

        let config = config_of(&[
            "--otlp-endpoint=http://general:4317",
            "--otlp-traces-endpoint=http://traces:4317",
            "--otlp-headers=who=general",
            "--otlp-traces-headers=who=traces",
            "--otlp-certificate=/general.pem",
            "--otlp-traces-certificate=/traces.pem",
            "--otlp-compression=none",
            "--otlp-traces-compression=gzip",
            "--otlp-timeout=10000",
            "--otlp-traces-timeout=2500",
            "--otlp-protocol=http/protobuf",
            "--otlp-traces-protocol=grpc",
        ])
        .unwrap();
        assert_eq!(config.endpoint.as_deref(), Some("http://traces:4317"));
        assert_eq!(config.headers, [("who".to_owned(), "traces".to_owned())]);
        assert_eq!(
            config.ca_certificate.as_deref(),
            Some(std::path::Path::new("/traces.pem"))
        );
        assert_eq!(config.compression, ExportCompression::Gzip);
        assert_eq!(config.export_timeout, Duration::from_millis(2500));

        // Blank traces-only values fall back to the general ones.
        let config = config_of(&[
            "--otlp-endpoint=http://general:4317",
            "--otlp-traces-endpoint=",
            "--otlp-compression=gzip",
        ])
        .unwrap();
        assert_eq!(config.endpoint.as_deref(), Some("http://general:4317"));
        assert_eq!(config.compression, ExportCompression::Gzip);

        let disabled = config_of(&[
            "--otlp-endpoint=http://collector:4317",
            "--otel-sdk-disabled=TRUE",
        ])
        .unwrap();
        assert_eq!(disabled.endpoint, None);
        let enabled = config_of(&[
            "--otlp-endpoint=http://collector:4317",
            "--otel-sdk-disabled=false",
        ])
        .unwrap();
        assert!(enabled.endpoint.is_some());

        for (args, wanted) in [
            (["--otlp-protocol=http/protobuf"], "only grpc"),
            (["--otlp-traces-protocol=http/json"], "only grpc"),
            (["--otlp-compression=zstd"], "expected none or gzip"),
            (["--otlp-timeout=0"], "milliseconds"),
            (["--otlp-traces-timeout=5s"], "milliseconds"),
            (["--otel-sdk-disabled=yes"], "expected true or false"),
        ] {
            let error = config_of(&args).expect_err(args[0]);
            assert!(error.to_string().contains(wanted), "{}: {error}", args[0]);
        }
    }

    #[test]
    fn debug_output_names_headers_but_leaves_their_values_out() {
        let config = TelemetryConfig {
            headers: vec![("x-api-key".to_owned(), "s3cr3t-value".to_owned())],
            ..TelemetryConfig::off("demo")
        };
        let printed = format!("{config:?}");
        assert!(printed.contains("x-api-key"), "{printed}");
        assert!(!printed.contains("s3cr3t-value"), "{printed}");
    }

    #[test]
    fn log_lines_get_trace_ids() {
        let ids = (
            "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
            "00f067aa0ba902b7".to_owned(),
        );
        let json = add_trace_ids("{\"level\":\"INFO\",\"fields\":{}}\n", Some(&ids), true);
        let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(parsed["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parsed["span_id"], "00f067aa0ba902b7");
        assert!(json.ends_with("}\n"));
        let text = add_trace_ids("INFO hello\n", Some(&ids), false);
        assert_eq!(
            text,
            "INFO hello trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7\n"
        );
        assert_eq!(add_trace_ids("INFO hello\n", None, false), "INFO hello\n");
    }
}
