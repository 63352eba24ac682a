//! The span exporter: batches of finished spans to an OTLP/gRPC collector
//! (`opentelemetry.proto.collector.trace.v1.TraceService/Export`), encoded
//! by [`super::otlp_encoding`].
//!
//! The batch processor calls [`OtlpSpanExporter::export`] on its own thread
//! and waits for it; the gRPC channel's connection runs on the exporter's
//! runtime (`otel-export`). One attempt per batch: a batch the collector
//! does not take in time ([`super::EXPORT_TIMEOUT`]) is dropped, so a slow
//! or absent collector costs spans, never memory. The first failure after
//! a success is logged as a warning, the recovery as info, and nothing in
//! between: a collector that is down for an hour is one line, not one per
//! second.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use super::error::{ExportCompression, TelemetryError};
use super::otlp_encoding::SpanEncoder;

const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// Where and how spans are sent.
#[derive(Clone)]
pub(crate) struct CollectorConfig {
    pub endpoint: String,
    /// Extra gRPC metadata on every export (`OTEL_EXPORTER_OTLP_HEADERS`).
    pub headers: Vec<(String, String)>,
    /// The CA bundle (PEM) an `https` collector's certificate must chain to.
    pub ca_certificate_pem: Option<Vec<u8>>,
    pub compression: ExportCompression,
    /// Longest one export may take, connecting included.
    pub timeout: std::time::Duration,
}

/// Sends [`SpanData`] batches to one collector. Its `Debug` names the
/// headers it sends, not their values.
pub(crate) struct OtlpSpanExporter {
    endpoint: String,
    grpc: tonic::client::Grpc<Channel>,
    metadata: MetadataMap,
    encoder: SpanEncoder,
    /// Whether the last export failed (for logging transitions only).
    failing: AtomicBool,
    shut_down: AtomicBool,
}

impl OtlpSpanExporter {
    /// Builds the exporter; its channel connects lazily, on the Tokio
    /// runtime this is called in.
    pub(crate) fn new(config: &CollectorConfig) -> Result<Self, TelemetryError> {
        let invalid = |reason: String| TelemetryError::Endpoint {
            endpoint: config.endpoint.clone(),
            reason,
        };
        let mut endpoint = Endpoint::from_shared(config.endpoint.clone())
            .map_err(|e| invalid(e.to_string()))?
            .timeout(config.timeout)
            .connect_timeout(config.timeout);
        if endpoint.uri().scheme_str() == Some("https") {
            let Some(ca) = &config.ca_certificate_pem else {
                return Err(invalid(
                    "an https collector needs the CA that signed its certificate \
                     (--otlp-certificate or OTEL_EXPORTER_OTLP_CERTIFICATE)"
                        .into(),
                ));
            };
            let tls =
                ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(ca));
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| invalid(e.to_string()))?;
        }
        let mut metadata = MetadataMap::new();
        for (key, value) in &config.headers {
            let name = tonic::metadata::MetadataKey::from_bytes(key.as_bytes())
                .map_err(|_| TelemetryError::Header(key.clone()))?;
            let value = value
                .parse()
                .map_err(|_| TelemetryError::Header(key.clone()))?;
            metadata.append(name, value);
        }
        let mut grpc = tonic::client::Grpc::new(endpoint.connect_lazy());
        if config.compression == ExportCompression::Gzip {
            grpc = grpc.send_compressed(tonic::codec::CompressionEncoding::Gzip);
        }
        Ok(OtlpSpanExporter {
            endpoint: config.endpoint.clone(),
            grpc,
            metadata,
            encoder: SpanEncoder::default(),
            failing: AtomicBool::new(false),
            shut_down: AtomicBool::new(false),
        })
    }

    /// One export of an encoded `ExportTraceServiceRequest`.
    pub(crate) async fn send(
        &self,
        request: Vec<u8>,
    ) -> Result<ExportTraceServiceResponse, tonic::Status> {
        let mut grpc = self.grpc.clone();
        grpc.ready()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut request = tonic::Request::new(request);
        *request.metadata_mut() = self.metadata.clone();
        let path = http::uri::PathAndQuery::from_static(EXPORT_PATH);
        Ok(grpc
            .unary(request, path, EncodedRequestCodec)
            .await?
            .into_inner())
    }
}

impl std::fmt::Debug for OtlpSpanExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let header_names: Vec<&str> = self
            .metadata
            .keys()
            .map(|key| match key {
                tonic::metadata::KeyRef::Ascii(key) => key.as_str(),
                tonic::metadata::KeyRef::Binary(key) => key.as_str(),
            })
            .collect();
        f.debug_struct("OtlpSpanExporter")
            .field("endpoint", &self.endpoint)
            .field("headers", &header_names)
            .field("failing", &self.failing)
            .finish_non_exhaustive()
    }
}

impl SpanExporter for OtlpSpanExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        if self.shut_down.load(Ordering::Relaxed) {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        let request = self.encoder.encode_request(&batch);
        drop(batch);
        match self.send(request).await {
            Ok(response) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("spans reach the trace collector again");
                }
                if let Some(partial) = response.partial_success
                    && (partial.rejected_spans > 0 || !partial.error_message.is_empty())
                {
                    tracing::warn!(
                        rejected_spans = partial.rejected_spans,
                        error = %partial.error_message,
                        "the trace collector rejected spans"
                    );
                }
                Ok(())
            }
            Err(status) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %status,
                        "exporting spans failed; spans are dropped until the trace collector answers"
                    );
                }
                Err(OTelSdkError::InternalFailure(status.to_string()))
            }
        }
    }

    fn shutdown_with_timeout(&self, _timeout: std::time::Duration) -> OTelSdkResult {
        if self.shut_down.swap(true, Ordering::Relaxed) {
            Err(OTelSdkError::AlreadyShutdown)
        } else {
            Ok(())
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.encoder = SpanEncoder::new(resource);
    }
}

/// The codec of an export call: the request is already encoded
/// ([`SpanEncoder`]), the response is decoded as usual.
struct EncodedRequestCodec;

struct EncodedRequestEncoder;

impl Encoder for EncodedRequestEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl Codec for EncodedRequestCodec {
    type Encode = Vec<u8>;
    type Decode = ExportTraceServiceResponse;
    type Encoder = EncodedRequestEncoder;
    type Decoder = tonic_prost::ProstDecoder<ExportTraceServiceResponse>;

    fn encoder(&mut self) -> Self::Encoder {
        EncodedRequestEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(BufferSettings::default())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use opentelemetry::trace::{Span as _, Tracer as _};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use tonic::transport::{Identity, Server, ServerTlsConfig};

    use super::*;
    use crate::telemetry::{SamplerChoice, TelemetryConfig, exporter};
    use crate::test_pki::TestCa;

    /// A collector that keeps every request with its metadata.
    #[derive(Clone, Default)]
    struct Recorder {
        requests: Arc<Mutex<Vec<(MetadataMap, ExportTraceServiceRequest)>>>,
    }

    #[tonic::async_trait]
    impl TraceService for Recorder {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let metadata = request.metadata().clone();
            self.requests
                .lock()
                .expect("recorder lock")
                .push((metadata, request.into_inner()));
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    impl Recorder {
        fn span_names(&self) -> Vec<String> {
            let requests = self.requests.lock().expect("recorder lock");
            requests
                .iter()
                .flat_map(|(_, request)| &request.resource_spans)
                .flat_map(|resource| &resource.scope_spans)
                .flat_map(|scope| &scope.spans)
                .map(|span| span.name.clone())
                .collect()
        }

        /// Serves on a loopback port (TLS with `tls`) from a runtime of its
        /// own; returns the port and the runtime, which stops it when dropped.
        fn serve(&self, tls: Option<ServerTlsConfig>) -> (u16, tokio::runtime::Runtime) {
            self.serve_with(tls, false)
        }

        fn serve_accepting_gzip(&self) -> (u16, tokio::runtime::Runtime) {
            self.serve_with(None, true)
        }

        fn serve_with(
            &self,
            tls: Option<ServerTlsConfig>,
            accept_gzip: bool,
        ) -> (u16, tokio::runtime::Runtime) {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("collector runtime");
            let listener = runtime
                .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
                .expect("a loopback port");
            let port = listener.local_addr().expect("its address").port();
            let mut server = Server::builder();
            if let Some(tls) = tls {
                server = server.tls_config(tls).expect("server TLS");
            }
            let mut service = TraceServiceServer::new(self.clone());
            if accept_gzip {
                service = service.accept_compressed(tonic::codec::CompressionEncoding::Gzip);
            }
            let router = server.add_service(service);
            runtime.spawn(
                router
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
            (port, runtime)
        }
    }

    /// Exports one span named `name` through an exporter for `config` and
    /// flushes it.
    fn export_one_span(config: &TelemetryConfig, name: &'static str) {
        let telemetry = exporter(config)
            .expect("a valid configuration")
            .expect("an endpoint");
        let tracer = telemetry.connection_tracer().expect("a tracer");
        let span = tracer.start_with_context(name, &opentelemetry::Context::new());
        assert!(span.span_context().is_sampled());
        drop(span);
        // Dropping the guard flushes what is queued.
        drop(telemetry);
    }

    fn config(endpoint: String) -> TelemetryConfig {
        TelemetryConfig {
            endpoint: Some(endpoint),
            sampler: SamplerChoice::AlwaysOn,
            ..TelemetryConfig::off("exporter-test")
        }
    }

    #[test]
    fn spans_reach_the_collector_with_the_configured_headers() {
        let recorder = Recorder::default();
        let (port, _collector) = recorder.serve(None);
        let config = TelemetryConfig {
            headers: vec![
                ("x-api-key".to_owned(), "secret value".to_owned()),
                ("X-Tenant".to_owned(), "hub-1".to_owned()),
            ],
            ..config(format!("http://127.0.0.1:{port}"))
        };
        export_one_span(&config, "test.plain");
        assert_eq!(recorder.span_names(), ["test.plain"]);
        let requests = recorder.requests.lock().expect("recorder lock");
        let (metadata, request) = &requests[0];
        assert_eq!(
            metadata.get("x-api-key").and_then(|v| v.to_str().ok()),
            Some("secret value")
        );
        assert_eq!(
            metadata.get("x-tenant").and_then(|v| v.to_str().ok()),
            Some("hub-1")
        );
        let resource = request.resource_spans[0]
            .resource
            .as_ref()
            .expect("a resource");
        assert!(
            resource
                .attributes
                .iter()
                .any(|kv| kv.key == "service.name")
        );
    }

    #[test]
    fn an_https_collector_is_verified_with_the_configured_ca() {
        let ca = TestCa::new();
        let leaf = ca.server("collector");
        let recorder = Recorder::default();
        let identity = Identity::from_pem(&leaf.cert_pem, &leaf.key_pem);
        let (port, _collector) = recorder.serve(Some(ServerTlsConfig::new().identity(identity)));
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ca_path = dir.path().join("collector-ca.pem");
        std::fs::write(&ca_path, &ca.cert_pem).expect("writing the CA");
        let config = TelemetryConfig {
            ca_certificate: Some(ca_path),
            ..config(format!("https://localhost:{port}"))
        };
        export_one_span(&config, "test.tls");
        assert_eq!(recorder.span_names(), ["test.tls"]);

        // Another CA's collector is refused: nothing arrives.
        let other = TestCa::new();
        let other_ca_path = dir.path().join("other-ca.pem");
        std::fs::write(&other_ca_path, &other.cert_pem).expect("writing the CA");
        let config = TelemetryConfig {
            ca_certificate: Some(other_ca_path),
            ..config
        };
        export_one_span(&config, "test.untrusted");
        assert_eq!(recorder.span_names(), ["test.tls"]);
    }

    #[test]
    fn debug_output_names_headers_but_leaves_their_values_out() {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let _entered = runtime.enter();
        let exporter = OtlpSpanExporter::new(&CollectorConfig {
            headers: vec![("x-api-key".to_owned(), "s3cr3t-value".to_owned())],
            ..collector("http://127.0.0.1:4317")
        })
        .expect("exporter");
        let printed = format!("{exporter:?}");
        assert!(printed.contains("x-api-key"), "{printed}");
        assert!(!printed.contains("s3cr3t-value"), "{printed}");
    }

    #[test]
    fn configurations_that_cannot_work_are_refused_with_the_reason() {
        let https = config("https://collector.example:4317".to_owned());
        let error = exporter(&https).expect_err("https without a CA");
        assert!(error.to_string().contains("--otlp-certificate"), "{error}");

        let missing = TelemetryConfig {
            ca_certificate: Some("/nonexistent/collector-ca.pem".into()),
            ..https
        };
        let error = exporter(&missing).expect_err("an unreadable CA");
        assert!(
            error.to_string().contains("/nonexistent/collector-ca.pem"),
            "{error}"
        );

        let header = TelemetryConfig {
            headers: vec![("bad key".to_owned(), "v".to_owned())],
            ..config("http://127.0.0.1:4317".to_owned())
        };
        let error = exporter(&header).expect_err("an invalid metadata name");
        assert!(error.to_string().contains("bad key"), "{error}");
    }

    fn collector(endpoint: &str) -> CollectorConfig {
        CollectorConfig {
            endpoint: endpoint.to_owned(),
            headers: Vec::new(),
            ca_certificate_pem: None,
            compression: ExportCompression::None,
            timeout: crate::telemetry::EXPORT_TIMEOUT,
        }
    }

    #[test]
    fn an_export_to_a_collector_that_is_down_fails_within_the_timeout() {
        let exporter = {
            let runtime = tokio::runtime::Runtime::new().expect("runtime");
            let _entered = runtime.enter();
            let exporter =
                OtlpSpanExporter::new(&collector("http://127.0.0.1:9")).expect("exporter");
            (exporter, runtime)
        };
        let started = std::time::Instant::now();
        let result = exporter.1.block_on(exporter.0.export(Vec::new()));
        assert!(result.is_err());
        assert!(started.elapsed() < crate::telemetry::EXPORT_TIMEOUT + Duration::from_secs(1));
        assert!(exporter.0.failing.load(Ordering::Relaxed));
    }

    /// `OTEL_EXPORTER_OTLP_TIMEOUT`: a collector that takes the connection
    /// and never answers holds an export for the configured time, no longer.
    #[test]
    fn a_silent_collector_holds_an_export_for_the_configured_timeout() {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let silent = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("a loopback port");
        let port = silent.local_addr().expect("its address").port();
        let timeout = Duration::from_millis(300);
        let exporter = {
            let _entered = runtime.enter();
            OtlpSpanExporter::new(&CollectorConfig {
                timeout,
                ..collector(&format!("http://127.0.0.1:{port}"))
            })
            .expect("exporter")
        };
        let started = std::time::Instant::now();
        let result = runtime.block_on(exporter.export(Vec::new()));
        let took = started.elapsed();
        assert!(result.is_err());
        assert!(took >= timeout, "gave up after {took:?}");
        assert!(took < Duration::from_secs(3), "held for {took:?}");
        drop(silent);
    }

    /// `OTEL_EXPORTER_OTLP_COMPRESSION=gzip`: a collector that does not
    /// take gzip refuses the export (so it really is compressed), one that
    /// does gets the span.
    #[test]
    fn gzip_exports_reach_a_collector_that_accepts_gzip() {
        let gzip = TelemetryConfig {
            compression: ExportCompression::Gzip,
            ..config(String::new())
        };
        let plain = Recorder::default();
        let (port, _plain_runtime) = plain.serve(None);
        export_one_span(
            &TelemetryConfig {
                endpoint: Some(format!("http://127.0.0.1:{port}")),
                ..gzip.clone()
            },
            "test.refused",
        );
        assert!(plain.span_names().is_empty());

        let accepting = Recorder::default();
        let (port, _runtime) = accepting.serve_accepting_gzip();
        export_one_span(
            &TelemetryConfig {
                endpoint: Some(format!("http://127.0.0.1:{port}")),
                ..gzip
            },
            "test.gzip",
        );
        assert_eq!(accepting.span_names(), ["test.gzip"]);
    }
}
