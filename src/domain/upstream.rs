//! An upstream replica: parsed once from the configuration's `routes[].upstreams`, then
//! used by the proxy for every forwarded request without parsing anything again.

use actix_web::http::uri::{Authority, InvalidUriParts, Parts, PathAndQuery, Scheme};
use actix_web::http::Uri;

/// One upstream replica: scheme and authority, to which the request's path is appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    base: String,
    authority: Authority,
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
        Ok(Upstream {
            base: format!("http://{authority}"),
            authority: authority.clone(),
        })
    }

    pub fn base(&self) -> &str {
        &self.base
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
}
