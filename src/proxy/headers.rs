//! Request ids, hop-by-hop headers, the `X-Forwarded-*` / `Forwarded` fields, the client-IP
//! claims believed only from trusted proxies, and what a valid `Host` is.

use std::net::{IpAddr, Ipv6Addr};

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::HttpMessage;
use ipnet::IpNet;

use crate::domain::client_addr;

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub static X_CLIENT_ID: HeaderName = HeaderName::from_static("x-client-id");
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The request's id: the client's `x-request-id` when it is sane, else a new UUID.
#[derive(Clone, Debug)]
pub struct RequestId(pub HeaderValue);

fn acceptable_request_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.:/+=".contains(c))
}

/// A new random (v4) UUID, written without the formatting machinery.
fn new_request_id() -> HeaderValue {
    let mut buf = uuid::Uuid::encode_buffer();
    let text = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut buf);
    HeaderValue::from_str(text).unwrap_or(HeaderValue::from_static("unknown"))
}

/// Middleware: settles the request id before anything logs, and echoes it in the response.
pub async fn request_id(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let id = req
        .headers()
        .get(&X_REQUEST_ID)
        .filter(|v| acceptable_request_id(v))
        .cloned()
        .unwrap_or_else(new_request_id);
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut res = next.call(req).await?;
    res.headers_mut().insert(X_REQUEST_ID.clone(), id);
    Ok(res)
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus those
/// the gateway sets itself.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Names listed in the `Connection` header are hop-by-hop too.
fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

/// The headers of a response to pass back to the client.
pub fn response_headers<'a>(
    headers: &'a HeaderMap,
) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> + 'a {
    let listed = connection_listed(headers);
    headers
        .iter()
        .filter(move |(n, _)| !is_hop_by_hop(n) && !listed.contains(n))
}

/// Headers in which a client states its own address, as CDNs and load balancers write them
/// (the list of the `request-ip` package, less `X-Forwarded-For` and `Forwarded`, which
/// the gateway always rewrites). A service may believe them, so only a trusted proxy may
/// pass them on: [`drop_client_ip_claims`].
fn is_client_ip_claim(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "x-real-ip"
            | "true-client-ip"
            | "x-client-ip"
            | "cf-connecting-ip"
            | "cf-pseudo-ipv4"
            | "fastly-client-ip"
            | "x-cluster-client-ip"
            | "x-appengine-user-ip"
            | "x-forwarded"
            | "forwarded-for"
    )
}

/// Whether the peer is one of `server.trusted_proxies`.
#[inline]
pub fn peer_trusted(peer: Option<IpAddr>, trusted: &[IpNet]) -> bool {
    !trusted.is_empty()
        && peer.is_some_and(|ip| trusted.iter().any(|n| n.contains(&ip.to_canonical())))
}

/// Whether the request claims a client address in a header [`drop_client_ip_claims`]
/// removes. Nearly every request has none, so the map is only changed when it does.
pub fn has_client_ip_claims(headers: &HeaderMap) -> bool {
    headers.keys().any(is_client_ip_claim)
}

/// Removes every client-IP claim (see [`is_client_ip_claim`]) from a request of an
/// untrusted peer.
pub fn drop_client_ip_claims(headers: &mut HeaderMap) {
    let claimed: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_client_ip_claim(n))
        .cloned()
        .collect();
    for name in claimed {
        headers.remove(&name);
    }
}

/// Whether `value` is a valid `Host` (RFC 9112 §3.2, RFC 3986 §3.2.2): `uri-host [":" port]`,
/// where the host is an IPv6 literal in brackets or a non-empty reg-name (letters, digits,
/// `-._~`, sub-delims and `%XX` escapes; so also an IPv4 address), and the port at most
/// five digits. Like nginx, `..` is refused too.
pub fn valid_host(value: &[u8]) -> bool {
    let (host_ok, port) = match value.strip_prefix(b"[") {
        Some(rest) => {
            let Some(end) = rest.iter().position(|&b| b == b']') else {
                return false;
            };
            let literal = std::str::from_utf8(&rest[..end])
                .ok()
                .is_some_and(|s| s.parse::<Ipv6Addr>().is_ok());
            match &rest[end + 1..] {
                [] => (literal, None),
                [b':', port @ ..] => (literal, Some(port)),
                _ => return false,
            }
        }
        None => match value.iter().position(|&b| b == b':') {
            Some(i) => (reg_name(&value[..i]), Some(&value[i + 1..])),
            None => (reg_name(value), None),
        },
    };
    host_ok && port.is_none_or(|p| p.len() <= 5 && p.iter().all(u8::is_ascii_digit))
}

/// The bytes a `reg-name` may hold besides percent-encodings (RFC 3986 §3.2.2: unreserved
/// and sub-delims), one lookup a byte.
const REG_NAME: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
            );
        b += 1;
    }
    table
};

fn reg_name(name: &[u8]) -> bool {
    let mut i = 0;
    let mut dot = false;
    while i < name.len() {
        let b = name[i];
        if b == b'%' {
            match name.get(i + 1..i + 3) {
                Some([h, l]) if h.is_ascii_hexdigit() && l.is_ascii_hexdigit() => i += 3,
                _ => return false,
            }
            dot = false;
            continue;
        }
        if !REG_NAME[usize::from(b)] || (b == b'.' && dot) {
            return false;
        }
        dot = b == b'.';
        i += 1;
    }
    !name.is_empty()
}

/// Who sent the request, as far as the gateway can trust it.
pub struct Origin {
    /// The client's address: the peer, or the nearest untrusted hop in `X-Forwarded-For`
    /// when the peer is a trusted proxy.
    pub client_ip: Option<IpAddr>,
    pub x_forwarded_for: String,
    pub proto: &'static str,
    pub host: Option<HeaderValue>,
}

/// Writes an address the way `Display` does; IPv4 (nearly every peer) without the
/// formatting machinery, which cost ~4k instructions a request.
fn push_ip(out: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        IpAddr::V6(v6) => {
            use std::fmt::Write;
            let _ = write!(out, "{v6}");
        }
    }
}

impl Origin {
    pub fn of(
        headers: &HeaderMap,
        peer: Option<IpAddr>,
        scheme: &'static str,
        trusted: &[IpNet],
    ) -> Origin {
        let peer = peer.map(|p| p.to_canonical());
        let peer_trusted = peer_trusted(peer, trusted);
        let push_peer = |out: &mut String| match peer {
            Some(p) => push_ip(out, p),
            None => out.push_str("unknown"),
        };
        // Only a valid host is passed on (the guard refuses a request with an invalid one;
        // this keeps anything else out of `X-Forwarded-Host` and `Forwarded` regardless).
        let valid = |v: &&HeaderValue| valid_host(v.as_bytes());
        let host = headers.get(header::HOST).filter(valid).cloned();
        if !peer_trusted {
            let mut x_forwarded_for = String::with_capacity(16);
            push_peer(&mut x_forwarded_for);
            return Origin {
                client_ip: peer,
                x_forwarded_for,
                proto: scheme,
                host,
            };
        }
        let prior: Vec<&str> = headers
            .get_all(&X_FORWARDED_FOR)
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        let lines = headers.get_all(&X_FORWARDED_FOR).map(HeaderValue::as_bytes);
        let client_ip = client_addr(lines, peer, trusted);
        let proto = match headers.get(&X_FORWARDED_PROTO).map(HeaderValue::as_bytes) {
            Some(b"http") => "http",
            Some(b"https") => "https",
            _ => scheme,
        };
        let host = headers
            .get(&X_FORWARDED_HOST)
            .filter(valid)
            .cloned()
            .or(host);
        let mut xff = prior.join(", ");
        if !xff.is_empty() {
            xff.push_str(", ");
        }
        push_peer(&mut xff);
        Origin {
            client_ip,
            x_forwarded_for: xff,
            proto,
            host,
        }
    }

    /// The RFC 7239 `Forwarded` value for this hop.
    pub fn forwarded(&self) -> String {
        let mut v = String::with_capacity(48);
        v.push_str("for=");
        match self.client_ip {
            Some(IpAddr::V6(ip)) => {
                v.push_str("\"[");
                push_ip(&mut v, IpAddr::V6(ip));
                v.push_str("]\"");
            }
            Some(ip) => push_ip(&mut v, ip),
            None => v.push_str("unknown"),
        }
        v.push_str(";proto=");
        v.push_str(self.proto);
        if let Some(h) = self
            .host
            .as_ref()
            .and_then(|h| h.to_str().ok())
            .filter(|h| {
                h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
            })
        {
            v.push_str(";host=\"");
            v.push_str(h);
            v.push('"');
        }
        v
    }
}

/// Whether a request header is passed on to the upstream unchanged. `Expect` is this hop's
/// business: actix-http has already answered `100 Continue` to the client, and awc, given
/// `Expect`, would wait for a `100` the service need not send (a route timeout later, `504`),
/// or refuse a request without a body outright (`502`).
pub fn forwardable(
    name: &HeaderName,
    api_key_header: Option<&HeaderName>,
    listed: &[HeaderName],
) -> bool {
    !(is_hop_by_hop(name)
        || name == header::EXPECT
        || listed.contains(name)
        || Some(name) == api_key_header
        || name == header::HOST
        || name == header::CONTENT_LENGTH
        || name == header::FORWARDED
        || name == X_FORWARDED_FOR
        || name == X_FORWARDED_PROTO
        || name == X_FORWARDED_HOST
        || name == X_CLIENT_ID
        || name == X_REQUEST_ID)
}

/// Request headers the gateway drops because they describe the client's connection.
pub fn connection_headers(headers: &HeaderMap) -> Vec<HeaderName> {
    connection_listed(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn an_untrusted_peer_cannot_claim_another_address() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6")]);
        let o = Origin::of(&h, Some("10.0.0.9".parse().unwrap()), "http", &[]);
        assert_eq!(o.x_forwarded_for, "10.0.0.9");
        assert_eq!(o.client_ip, Some("10.0.0.9".parse().unwrap()));
    }

    #[test]
    fn a_trusted_proxy_chain_is_extended_and_its_client_believed() {
        let h = headers(&[
            ("x-forwarded-for", "1.2.3.4, 10.0.0.2"),
            ("x-forwarded-proto", "https"),
        ]);
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        let o = Origin::of(&h, Some("10.0.0.9".parse().unwrap()), "http", &trusted);
        assert_eq!(o.x_forwarded_for, "1.2.3.4, 10.0.0.2, 10.0.0.9");
        assert_eq!(o.client_ip, Some("1.2.3.4".parse().unwrap()));
        assert_eq!(o.proto, "https");
        assert_eq!(o.forwarded(), "for=1.2.3.4;proto=https");
    }

    #[test]
    fn a_trusted_proxy_writing_a_port_hides_nothing_the_client_wrote() {
        // The proxy wrote `1.2.3.4:5678`; the client had sent `X-Forwarded-For: 6.6.6.6`.
        // Skipping the hop it could not parse once made `6.6.6.6` the client.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 1.2.3.4:5678")]);
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        let o = Origin::of(&h, Some("10.0.0.9".parse().unwrap()), "http", &trusted);
        assert_eq!(o.client_ip, Some("1.2.3.4".parse().unwrap()));
        let h = headers(&[("x-forwarded-for", "6.6.6.6, unknown")]);
        let o = Origin::of(&h, Some("10.0.0.9".parse().unwrap()), "http", &trusted);
        assert_eq!(o.client_ip, Some("10.0.0.9".parse().unwrap()));
        assert_eq!(o.x_forwarded_for, "6.6.6.6, unknown, 10.0.0.9");
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        for ip in [
            "0.0.0.0",
            "10.0.0.9",
            "192.168.100.255",
            "1.20.3.199",
            "::1",
            "2001:db8::7",
        ] {
            let mut out = String::new();
            push_ip(&mut out, ip.parse().unwrap());
            assert_eq!(out, ip);
        }
        let o = Origin::of(&HeaderMap::new(), Some("::1".parse().unwrap()), "http", &[]);
        assert_eq!(o.forwarded(), "for=\"[::1]\";proto=http");
    }

    #[test]
    fn hop_by_hop_and_connection_listed_headers_are_dropped() {
        let h = headers(&[
            ("connection", "x-secret-hop"),
            ("x-secret-hop", "1"),
            ("x-keep", "1"),
        ]);
        let names: Vec<_> = response_headers(&h)
            .map(|(n, _)| n.as_str().to_string())
            .collect();
        assert_eq!(names, vec!["x-keep"]);
    }

    #[test]
    fn a_host_is_a_host_and_an_optional_port() {
        for ok in [
            "example.com",
            "api.example.com:8443",
            "127.0.0.1:80",
            "[::1]",
            "[2001:db8::7]:443",
            "a-b_c~d",
            "caf%C3%A9.example",
            "host:",
        ] {
            assert!(valid_host(ok.as_bytes()), "{ok:?}");
        }
        for bad in [
            "", ":80", "a b", "a/b", "a\\b", "u@a", "a\"b", "a<b", "a..b", "a:8x", "a:123456",
            "a:1:2", "[::1", "[zz]", "[::1]x", "%zz", "a%4", "a\tb",
        ] {
            assert!(!valid_host(bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn an_invalid_host_is_not_passed_on_even_from_a_trusted_proxy() {
        let h = headers(&[("host", "gw.example"), ("x-forwarded-host", "a b")]);
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        let o = Origin::of(&h, Some("10.0.0.9".parse().unwrap()), "http", &trusted);
        assert_eq!(o.host.unwrap(), "gw.example");
        let h = headers(&[("host", "a/b")]);
        assert!(Origin::of(&h, None, "http", &[]).host.is_none());
    }

    #[test]
    fn client_ip_claims_are_dropped_and_nothing_else() {
        let mut h = headers(&[
            ("x-real-ip", "6.6.6.6"),
            ("true-client-ip", "6.6.6.6"),
            ("cf-connecting-ip", "6.6.6.6"),
            ("x-keep", "1"),
        ]);
        drop_client_ip_claims(&mut h);
        let names: Vec<_> = h.keys().map(|n| n.as_str().to_string()).collect();
        assert_eq!(names, vec!["x-keep"]);
    }

    #[test]
    fn expect_is_never_forwarded() {
        let key = HeaderName::from_static("x-api-key");
        assert!(!forwardable(&header::EXPECT, Some(&key), &[]));
        assert!(forwardable(&header::ACCEPT, Some(&key), &[]));
    }

    #[test]
    fn odd_request_ids_are_replaced() {
        assert!(acceptable_request_id(&HeaderValue::from_static("abc-123")));
        assert!(!acceptable_request_id(&HeaderValue::from_static("a b")));
        assert!(!acceptable_request_id(
            &HeaderValue::from_str(&"a".repeat(129)).unwrap()
        ));
    }
}
