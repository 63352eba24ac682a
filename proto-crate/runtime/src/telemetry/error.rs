//! What the telemetry flags can get wrong, and the export compression they
//! choose: shared by the configuration ([`super`]) and the exporter.

/// A configuration the flags describe that cannot work.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "unknown trace sampler {0:?}: expected always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio"
    )]
    Sampler(String),
    #[error("trace sampler argument {0:?} is not a ratio between 0 and 1")]
    SamplerArg(String),
    #[error("resource attribute {0:?} is not key=value")]
    ResourceAttribute(String),
    #[error("OTLP header {0:?} is not key=value with a valid gRPC metadata name and value")]
    Header(String),
    #[error("reading the OTLP collector's CA bundle {path}: {source}")]
    Certificate {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("OTLP endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("starting the trace exporter's runtime: {0}")]
    ExportRuntime(#[source] std::io::Error),
    #[error(
        "OTLP protocol {0:?} is not spoken here: only grpc is (point the endpoint at the collector's OTLP/gRPC port, usually 4317)"
    )]
    Protocol(String),
    #[error("OTLP compression {0:?}: expected none or gzip")]
    Compression(String),
    #[error("OTLP timeout {0:?} is not a positive number of milliseconds")]
    Timeout(String),
    #[error("OTEL_SDK_DISABLED {0:?}: expected true or false")]
    SdkDisabled(String),
}

/// How each export is compressed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportCompression {
    #[default]
    None,
    Gzip,
}
