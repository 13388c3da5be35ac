//! What the HTTP/1.1 edge refuses before a request is routed or its key looked up, and how a
//! refusal lets go of a body it never read.
//!
//! [`refusal`]: `TRACE` and `CONNECT` (`405`, never forwarded, as nginx answers `TRACE`),
//! a missing, repeated or malformed `Host` (`400`, RFC 9112 §3.2, as nginx does) and the API
//! key header sent more than once (`400`: which one would be the client's?). All before a
//! token is spent.
//!
//! [`keep_payload`]: every answer the guard gives without reading the request body keeps
//! the body's `Payload` alive until the answer is written. actix-http drains the body of a
//! *dropped* chunked `Payload` on a kept-alive connection with no timer at all, so a client
//! trickling chunks after its `401` would hold the connection forever. While the `Payload`
//! is alive and unfinished, the dispatcher answers with `Connection: close` and then
//! lingers, reading and discarding, for at most `client_disconnect_timeout` (set in
//! `startup`) before it closes, whatever the body's framing. A body that had fully arrived
//! is finished, so a well-behaved client keeps its connection: [`read_arrived`] first reads
//! what came with the head.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::Payload;
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::http::uri::Authority;
use actix_web::http::{Method, Version};
use actix_web::HttpResponse;
use bytes::Bytes;
use futures_util::Stream;

use super::headers::valid_host;
use crate::error::ApiError;

/// The `Allow` of a `405`: the methods the gateway forwards (any but `TRACE` and
/// `CONNECT`; these are the ones RFC 9110 defines and PATCH).
pub(super) const ALLOWED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// Why the request is refused before it is routed, if it is: see the module's doc.
pub(super) fn refusal(
    method: &Method,
    version: Version,
    authority: Option<&Authority>,
    headers: &HeaderMap,
    api_key_header: Option<&HeaderName>,
) -> Option<ApiError> {
    // TRACE would echo the request (cookies and keys included) back from a service;
    // CONNECT asks for a tunnel the gateway does not open.
    if method == Method::TRACE || method == Method::CONNECT {
        return Some(ApiError::MethodNotAllowed(ALLOWED_METHODS));
    }
    // actix-http's HTTP/1 parser already refuses a repeated Host and HTTP/1.1 without
    // one (a bare 400); checked here too, so that the rule does not rest on it.
    let mut hosts = headers.get_all(header::HOST);
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => {
            return Some(ApiError::BadRequest(
                "the Host header was sent more than once".into(),
            ))
        }
        (Some(host), None) if !valid_host(host.as_bytes()) => {
            return Some(ApiError::BadRequest(
                "the Host header is not a valid host[:port]".into(),
            ))
        }
        (None, _) if version == Version::HTTP_11 => {
            return Some(ApiError::BadRequest(
                "an HTTP/1.1 request needs a Host header".into(),
            ))
        }
        // RFC 9113 §8.3.1: a Host that names another host than :authority is malformed
        // (the service would be told one host and the client have asked another).
        (Some(host), None)
            if version == Version::HTTP_2
                && authority.is_some_and(|a| {
                    !a.as_str().as_bytes().eq_ignore_ascii_case(host.as_bytes())
                }) =>
        {
            return Some(ApiError::BadRequest(
                "the Host header and :authority name different hosts".into(),
            ))
        }
        _ => {}
    }
    if let Some(name) = api_key_header {
        let mut keys = headers.get_all(name);
        if keys.next().is_some() && keys.next().is_some() {
            return Some(ApiError::BadRequest(format!(
                "the {name} header was sent more than once; send one API key"
            )));
        }
    }
    None
}

/// An HTTP/2 request names its host in `:authority`, and usually sends no `Host` (RFC 9113
/// §8.3.1); it is given one from `:authority`, so that everything after (the checks above,
/// `X-Forwarded-Host`, `Forwarded: host=`) reads the host from one place, whatever the
/// version. A `Host` it did send is left for [`refusal`] to compare.
pub(super) fn authority_as_host(authority: Option<&Authority>, headers: &mut HeaderMap) {
    if headers.contains_key(header::HOST) {
        return;
    }
    if let Some(host) = authority.and_then(|a| HeaderValue::from_str(a.as_str()).ok()) {
        headers.insert(header::HOST, host);
    }
}

/// The most of an unwanted body [`read_arrived`] reads: a body that fits has usually
/// arrived with its head.
const READ_ARRIVED_MAX: usize = 64 * 1024;

/// Reads and discards the part of the request body that has already arrived, at most
/// [`READ_ARRIVED_MAX`] bytes, without waiting for more. actix-http calls the service as
/// soon as a head is parsed, before it decodes the body bytes that came with it, so this
/// lets it run once (a yield, no timer) before giving up: a client that sent its whole
/// body finishes it here and keeps its connection.
pub(super) async fn read_arrived(payload: &mut Payload) {
    if matches!(payload, Payload::None) {
        return;
    }
    let (mut read, mut yielded) = (0, false);
    std::future::poll_fn(|cx| loop {
        match Pin::new(&mut *payload).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) if read + chunk.len() <= READ_ARRIVED_MAX => {
                read += chunk.len();
            }
            Poll::Ready(_) => return Poll::Ready(()),
            Poll::Pending if !yielded => {
                yielded = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Pending => return Poll::Ready(()),
        }
    })
    .await
}

/// `resp` with the request's unread `payload` held in its body until the body is written
/// (see the module's doc). A request without a body has nothing to hold.
pub(super) fn keep_payload(resp: HttpResponse<BoxBody>, payload: Payload) -> HttpResponse<BoxBody> {
    if matches!(payload, Payload::None) {
        return resp;
    }
    resp.map_body(|_, body| {
        BoxBody::new(Holding {
            body,
            _payload: payload,
        })
    })
}

/// A response body that holds the request's `Payload` while it is written. It never hands
/// its bytes out whole (`try_into_bytes`), which would drop it, and the `Payload`, early.
struct Holding<B> {
    body: B,
    _payload: Payload,
}

impl<B: MessageBody + Unpin> MessageBody for Holding<B> {
    type Error = B::Error;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Pin::new(&mut self.body).poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        h
    }

    fn refused(method: Method, pairs: &[(&'static str, &'static str)]) -> Option<String> {
        let key = HeaderName::from_static("x-api-key");
        refusal(&method, Version::HTTP_11, None, &headers(pairs), Some(&key)).map(|e| e.to_string())
    }

    #[test]
    fn trace_and_connect_are_not_allowed_whatever_else_is_sent() {
        for m in [Method::TRACE, Method::CONNECT] {
            let e = refused(m, &[("host", "a"), ("x-api-key", "k")]).unwrap();
            assert!(e.contains("GET, HEAD"), "{e}");
        }
    }

    #[test]
    fn host_is_required_once_and_valid_on_http_1_1() {
        assert_eq!(refused(Method::GET, &[("host", "api.example:8080")]), None);
        assert!(refused(Method::GET, &[("host", "a"), ("host", "b")]).is_some());
        assert!(refused(Method::GET, &[("host", "a/b")]).is_some());
        assert!(refused(Method::GET, &[]).is_some());
        let key = HeaderName::from_static("x-api-key");
        assert!(refusal(
            &Method::GET,
            Version::HTTP_10,
            None,
            &HeaderMap::new(),
            Some(&key)
        )
        .is_none());
    }

    #[test]
    fn an_http2_request_takes_its_host_from_authority_and_may_not_contradict_it() {
        let authority: Authority = "API.example:8443".parse().unwrap();
        let mut h = HeaderMap::new();
        authority_as_host(Some(&authority), &mut h);
        assert_eq!(h.get(header::HOST).unwrap(), "API.example:8443");
        let h2 = |host: &'static str| {
            refusal(
                &Method::GET,
                Version::HTTP_2,
                Some(&authority),
                &headers(&[("host", host)]),
                None,
            )
        };
        assert!(h2("api.example:8443").is_none(), "case does not matter");
        let e = h2("other.example").unwrap().to_string();
        assert!(e.contains(":authority"), "{e}");
        // HTTP/1.1 in absolute form: the target's authority wins (RFC 9112 §3.2.2); the
        // Host is not compared.
        let h1 = refusal(
            &Method::GET,
            Version::HTTP_11,
            Some(&authority),
            &headers(&[("host", "other.example")]),
            None,
        );
        assert!(h1.is_none());
        // A Host sent is kept, to be compared.
        let mut sent = headers(&[("host", "other.example")]);
        authority_as_host(Some(&authority), &mut sent);
        assert_eq!(sent.get(header::HOST).unwrap(), "other.example");
    }

    #[test]
    fn the_key_header_twice_is_refused_naming_it() {
        let e = refused(
            Method::GET,
            &[("host", "a"), ("x-api-key", "k"), ("x-api-key", "k")],
        )
        .unwrap();
        assert!(e.contains("x-api-key"), "{e}");
        assert_eq!(
            refused(Method::GET, &[("host", "a"), ("x-api-key", "k")]),
            None
        );
    }
}
