//! An upstream replica: parsed once from the configuration's `routes[].upstreams`, then
//! used by the proxy for every forwarded request without parsing anything again.

use actix_web::http::header::HeaderValue;
use actix_web::http::uri::{Authority, InvalidUriParts, Parts, PathAndQuery, Scheme};
use actix_web::http::Uri;
use rustls::pki_types::ServerName;

/// One upstream replica: scheme and authority, to which the request's path is appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    base: String,
    /// Where a connection goes: the configured authority, with the port written out for
    /// `https` (awc's plain client would take a port-less one for port 80).
    authority: Authority,
    /// The `Host` a request to it carries, written once: awc writes it per request
    /// (`format!` and a header check) when the request has none.
    host: HeaderValue,
    /// `https://`: reached over TLS, its certificate verified for its host.
    tls: bool,
}

impl Upstream {
    /// `http://host[:port]` or `https://host[:port]`, with no path, query or credentials.
    pub fn parse(s: &str) -> Result<Upstream, String> {
        let uri: Uri = s
            .parse()
            .map_err(|_| format!("{s:?} is not a URL like http://127.0.0.1:9001"))?;
        let (tls, default_port) = match uri.scheme_str() {
            Some("http") => (false, 80),
            Some("https") => (true, 443),
            _ => {
                return Err(format!(
                    "{s:?}: only http:// and https:// upstreams are supported"
                ))
            }
        };
        let authority = uri
            .authority()
            .filter(|a| !a.as_str().contains('@') && !a.host().is_empty())
            .ok_or_else(|| format!("{s:?} needs a host and no credentials"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!("{s:?} must not have a path or query"));
        }
        let host = authority.host();
        // The name the certificate must be valid for, and the SNI sent (none for an
        // address): refused here, so a connection never fails on it.
        if tls && ServerName::try_from(server_name(host)).is_err() {
            return Err(format!(
                "{s:?}: {host:?} is not a DNS name or an IP address"
            ));
        }
        let port = authority.port_u16();
        // RFC 9110 §7.2: the target's authority, without the port when it is the
        // scheme's default.
        let host_header = match port {
            None => host.to_owned(),
            Some(p) if p == default_port => host.to_owned(),
            Some(p) => format!("{host}:{p}"),
        };
        let connect = match port {
            None if tls => format!("{host}:443")
                .parse()
                .map_err(|_| format!("{s:?}: not a host"))?,
            _ => authority.clone(),
        };
        Ok(Upstream {
            base: format!("{}://{authority}", if tls { "https" } else { "http" }),
            authority: connect,
            host: HeaderValue::try_from(host_header).map_err(|_| format!("{s:?}: not a host"))?,
            tls,
        })
    }

    /// `scheme://authority` as configured: the replica's name in logs and metrics.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The `Host` header a request forwarded to it carries.
    pub fn host(&self) -> &HeaderValue {
        &self.host
    }

    /// Whether it is reached over TLS (`https://`).
    pub fn tls(&self) -> bool {
        self.tls
    }

    /// The URL a request for `path_and_query` is sent to (from parts: nothing re-parsed).
    /// Its scheme is `http` for every replica, the port always written for `https`: awc
    /// would hand an `https` URL to its own TLS, under which `proxy::wire` could not read
    /// the responses. An `https` replica's URL goes to the client whose connections are
    /// TLS already (`proxy::tls`); the request line is origin-form, so the scheme never
    /// reaches the wire.
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

/// The name a certificate is checked against for `host` (a URL's host: an IPv6 address
/// in brackets): the bare address or the DNS name.
pub fn server_name(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_must_be_http_or_https_origins() {
        for good in [
            "http://127.0.0.1:9001",
            "http://svc.internal",
            "https://svc.internal",
            "https://svc.internal:8443",
            "https://10.0.0.1",
            "https://[::1]:8443",
        ] {
            assert!(Upstream::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "ftp://x",
            "http://x/path",
            "https://x/path",
            "http://u:p@x",
            "https://u@x",
            "127.0.0.1:9001",
            "http://x?q=1",
            "https://",
            "https://bad_name!:443",
        ] {
            assert!(Upstream::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_host_header_is_the_authority_without_the_schemes_default_port() {
        for (url, host) in [
            ("http://127.0.0.1:9001", "127.0.0.1:9001"),
            ("http://svc.internal", "svc.internal"),
            ("http://svc.internal:80", "svc.internal"),
            ("http://svc.internal:443", "svc.internal:443"),
            ("http://[::1]:8080", "[::1]:8080"),
            ("https://svc.internal", "svc.internal"),
            ("https://svc.internal:443", "svc.internal"),
            ("https://svc.internal:80", "svc.internal:80"),
            ("https://svc.internal:8443", "svc.internal:8443"),
            ("https://[::1]:8443", "[::1]:8443"),
        ] {
            assert_eq!(Upstream::parse(url).unwrap().host(), host, "{url}");
        }
    }

    #[test]
    fn an_https_replica_is_sent_an_http_url_with_its_port_written_out() {
        let path = PathAndQuery::from_static("/a?b=1");
        for (url, tls, sent) in [
            (
                "https://svc.internal",
                true,
                "http://svc.internal:443/a?b=1",
            ),
            (
                "https://svc.internal:8443",
                true,
                "http://svc.internal:8443/a?b=1",
            ),
            ("https://[::1]", true, "http://[::1]:443/a?b=1"),
            ("http://svc.internal", false, "http://svc.internal/a?b=1"),
        ] {
            let upstream = Upstream::parse(url).unwrap();
            assert_eq!(upstream.tls(), tls, "{url}");
            assert_eq!(upstream.uri(Some(&path)).unwrap().to_string(), sent);
            assert_eq!(upstream.base(), url);
        }
    }

    #[test]
    fn a_certificate_is_checked_for_the_bare_host() {
        assert_eq!(server_name("[::1]"), "::1");
        assert_eq!(server_name("svc.internal"), "svc.internal");
        assert_eq!(server_name("10.0.0.1"), "10.0.0.1");
    }
}
