//! The OTLP exporter of `opentelemetry-otlp`, built from the `telemetry` settings: the
//! protocol, gzip, its retries (the crate's recommended policy: up to 3, backing off from
//! 100 ms, honouring `Retry-After`; none starts past [`EXPORT_TIMEOUT`] after the first try,
//! and each try is given as long); and its HTTP client,
//! hyper over rustls (ring), trusting the public roots and `telemetry.otlp_ca_file`, which
//! adds `telemetry.otlp_headers` to every post. The header values are kept marked
//! sensitive and only the client holds them: neither they nor the client's `Debug` show up
//! in logs.

use std::fmt;
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use http::{HeaderName, HeaderValue};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use opentelemetry::KeyValue;
use opentelemetry_http::hyper::HyperClient;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{
    Compression, Protocol, RetryPolicy, SpanExporter, WithExportConfig, WithHttpConfig,
};
use opentelemetry_sdk::trace::SpanExporter as _;
use opentelemetry_sdk::Resource;
use secrecy::ExposeSecret;

use crate::configuration::{OtlpCompression, OtlpEndpoint, OtlpProtocol, TelemetrySettings};

/// How long one try may take, and after how long since the first no retry starts: an
/// export takes at most about twice this.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// The exporter posting to `endpoint` as `settings` say. Fails when the CA file holds no
/// certificate it can use.
pub fn exporter(
    endpoint: &OtlpEndpoint,
    settings: &TelemetrySettings,
) -> anyhow::Result<SpanExporter> {
    let protocol = match settings.otlp_protocol {
        OtlpProtocol::HttpJson => Protocol::HttpJson,
        OtlpProtocol::HttpProtobuf => Protocol::HttpBinary,
    };
    let mut builder = SpanExporter::builder()
        .with_http()
        .with_endpoint(endpoint.traces_url())
        .with_protocol(protocol)
        .with_timeout(EXPORT_TIMEOUT)
        .with_retry_policy(RetryPolicy::recommended())
        .with_http_client(Transport::new(settings)?);
    if settings.otlp_compression == OtlpCompression::Gzip {
        builder = builder.with_compression(Compression::Gzip);
    }
    let mut exporter = builder
        .build()
        .context("telemetry: the OTLP exporter could not be built")?;
    exporter.set_resource(
        &Resource::builder_empty()
            .with_attributes([
                KeyValue::new("service.name", "tollgate"),
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            ])
            .build(),
    );
    Ok(exporter)
}

/// The exporter's HTTP client, which adds the configured headers to every request.
struct Transport {
    client: HyperClient<HttpsConnector<HttpConnector>>,
    /// Marked sensitive.
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Transport {
    fn new(settings: &TelemetrySettings) -> anyhow::Result<Transport> {
        let https = HttpsConnectorBuilder::new()
            .with_tls_config(crate::tls::client_config(
                settings.otlp_ca_file.as_deref(),
                "telemetry.otlp_ca_file",
            )?)
            .https_or_http()
            .enable_http1()
            .build();
        let headers = settings
            .otlp_headers
            .iter()
            .map(|h| {
                let name = HeaderName::from_bytes(h.name.as_str().as_bytes())?;
                let mut value = HeaderValue::from_str(h.value.expose_secret())?;
                value.set_sensitive(true);
                Ok((name, value))
            })
            .collect::<anyhow::Result<_>>()
            .context("telemetry.otlp_headers")?;
        Ok(Transport {
            client: HyperClient::new(https, EXPORT_TIMEOUT, None),
            headers,
        })
    }
}

impl fmt::Debug for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("Transport")
            .field("headers", &names)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl HttpClient for Transport {
    async fn send_bytes(&self, mut request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        for (name, value) in &self.headers {
            request.headers_mut().insert(name.clone(), value.clone());
        }
        self.client.send_bytes(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::configuration::OtlpHeader;

    fn settings(headers: &[(&'static str, &str)]) -> TelemetrySettings {
        TelemetrySettings {
            otlp_endpoint: None,
            otlp_protocol: OtlpProtocol::HttpJson,
            otlp_compression: OtlpCompression::None,
            otlp_headers: headers
                .iter()
                .map(|(n, v)| OtlpHeader {
                    name: actix_web::http::header::HeaderName::from_static(n),
                    value: (*v).into(),
                })
                .collect(),
            otlp_ca_file: None,
        }
    }

    #[test]
    fn the_transport_and_the_settings_never_print_a_header_value() {
        let s = settings(&[("x-api-key", "sekrit-value")]);
        let transport = Transport::new(&s).unwrap();
        for printed in [format!("{transport:?}"), format!("{s:?}")] {
            assert!(printed.contains("x-api-key"), "{printed}");
            assert!(!printed.contains("sekrit-value"), "{printed}");
        }
        let endpoint = OtlpEndpoint::parse("https://collector.example").unwrap();
        let exporter = exporter(&endpoint, &s).unwrap();
        assert!(!format!("{exporter:?}").contains("sekrit-value"));
    }
}
