//! TLS for the gateway's own requests to `https://` services of its operator's (the span
//! collector, an identity provider's keys, quota warnings' webhooks, and a gateway's admin
//! API for `tollgate catalog`): Mozilla's roots, built in (the image need not have any),
//! and the certificates of a configured CA file.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// A client configuration trusting the public roots and the certificates of `ca_file`
/// (the configuration key it came from is `key`, for errors); an error when the file holds
/// no certificate it can use.
pub fn client_config(ca_file: Option<&Path>, key: &str) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(path) = ca_file {
        let context = || format!("{key}: {}", path.display());
        let mut added = 0;
        for cert in CertificateDer::pem_file_iter(path).with_context(context)? {
            roots
                .add(cert.with_context(context)?)
                .with_context(context)?;
            added += 1;
        }
        if added == 0 {
            bail!("{}: no certificate in it", context());
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// An HTTP/1.1 client over hyper for `http://` and `https://` URLs, trusting what
/// [`client_config`] trusts, with request bodies of type `B`.
pub fn https_client<B>(
    ca_file: Option<&Path>,
    key: &str,
) -> anyhow::Result<
    hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        B,
    >,
>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
{
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(client_config(ca_file, key)?)
        .https_or_http()
        .enable_http1()
        .build();
    Ok(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(https),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("ca.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = client_config(Some(&empty), "telemetry.otlp_ca_file").unwrap_err();
        let said = format!("{err:#}");
        assert!(
            said.contains("no certificate") && said.contains("telemetry.otlp_ca_file"),
            "{said}"
        );
        assert!(client_config(Some(&dir.path().join("absent.pem")), "k").is_err());
    }
}
