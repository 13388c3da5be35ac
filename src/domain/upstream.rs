//! An upstream replica: parsed once from the configuration's `routes[].upstreams`, then
//! used by the proxy for every forwarded request without parsing anything again.

use actix_web::http::header::HeaderValue;
use actix_web::http::uri::{Authority, InvalidUriParts, Parts, PathAndQuery, Scheme};
use actix_web::http::Uri;

/// One upstream replica: scheme and authority, to which the request's path is appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    base: String,
    authority: Authority,
    /// The `Host` a request to it carries, written once: awc writes it per request
    /// (`format!` and a header check) when the request has none.
    host: HeaderValue,
}

impl Upstream {
    /// `http://host[:port]`, with no path, query or credentials.
    pub fn parse(s: &str) -> Result<Upstream, String> {
        let uri: Uri = s
            .parse()
            .map_err(|_| format!("{s:?} is not a URL like http://127.0.0.1:9001"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "{s:?}: only http:// upstreams are supported (TLS is terminated before them)"
            ));
        }
        let authority = uri
            .authority()
            .filter(|a| !a.as_str().contains('@'))
            .ok_or_else(|| format!("{s:?} needs a host and no credentials"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!("{s:?} must not have a path or query"));
        }
        // awc's own rule: the port unless it is absent, 80 or 443.
        let host = match authority.port_u16() {
            None | Some(80) | Some(443) => authority.host().to_owned(),
            Some(port) => format!("{}:{port}", authority.host()),
        };
        Ok(Upstream {
            base: format!("http://{authority}"),
            authority: authority.clone(),
            host: HeaderValue::try_from(host).map_err(|_| format!("{s:?}: not a host"))?,
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The `Host` header a request forwarded to it carries.
    pub fn host(&self) -> &HeaderValue {
        &self.host
    }

    /// The replica's URL for a request's path and query (from parts: nothing re-parsed).
    pub fn uri(&self, path_and_query: Option<&PathAndQuery>) -> Result<Uri, InvalidUriParts> {
        let mut parts = Parts::default();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = Some(
            path_and_query
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
        );
        Uri::from_parts(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_must_be_plain_http_origins() {
        assert!(Upstream::parse("http://127.0.0.1:9001").is_ok());
        assert!(Upstream::parse("http://svc.internal").is_ok());
        for bad in [
            "ftp://x",
            "http://x/path",
            "http://u:p@x",
            "127.0.0.1:9001",
            "http://x?q=1",
        ] {
            assert!(Upstream::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_host_header_is_the_authority_without_a_default_port() {
        for (url, host) in [
            ("http://127.0.0.1:9001", "127.0.0.1:9001"),
            ("http://svc.internal", "svc.internal"),
            ("http://svc.internal:80", "svc.internal"),
            ("http://svc.internal:443", "svc.internal"),
            ("http://[::1]:8080", "[::1]:8080"),
        ] {
            assert_eq!(Upstream::parse(url).unwrap().host(), host, "{url}");
        }
    }
}
