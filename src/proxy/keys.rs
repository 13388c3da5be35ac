//! Where a request's API key comes from: a header (the default), `Authorization: Bearer`,
//! a query parameter, in the configured order. A key is found in at most one of them (a
//! key in two is refused: first-wins would forward the other, or hide a stale one), and
//! whichever carried it is taken out of what is forwarded.

use std::borrow::Cow;

use actix_web::http::header::{self, HeaderMap, HeaderName};
use percent_encoding::percent_decode_str;

use crate::configuration::KeySource;
use crate::error::ApiError;

/// The sources a gateway reads keys from, built once from `[server]`.
pub struct KeySources {
    header: Option<HeaderName>,
    bearer: bool,
    query: Option<String>,
    /// "in the x-api-key header or as an Authorization: Bearer token": the end of a 401.
    wanted: String,
}

/// A key found in a request.
#[derive(Debug, PartialEq)]
pub struct FoundKey<'r> {
    /// As sent (a query parameter's percent-decoded); empty when not valid text.
    pub key: Cow<'r, str>,
    pub source: KeySource,
    /// With [`KeySource::Query`]: the query without the key's parameter (`None`: nothing
    /// else was in it).
    pub rest_of_query: Option<String>,
}

impl KeySources {
    pub fn new(sources: &[KeySource], header: &HeaderName, query: &str) -> KeySources {
        let has = |s| sources.contains(&s);
        let wanted = sources
            .iter()
            .map(|s| match s {
                KeySource::Header => format!("in the {header} header"),
                KeySource::Bearer => "as an Authorization: Bearer token".to_string(),
                KeySource::Query => format!("in the {query} query parameter"),
            })
            .collect::<Vec<_>>();
        let wanted = match wanted.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        };
        KeySources {
            header: has(KeySource::Header).then(|| header.clone()),
            bearer: has(KeySource::Bearer),
            query: has(KeySource::Query).then(|| query.to_string()),
            wanted,
        }
    }

    /// The header source's name, if the header is a source: it is never forwarded.
    pub fn header(&self) -> Option<&HeaderName> {
        self.header.as_ref()
    }

    /// The answer to a request without a known key.
    pub fn missing(&self) -> ApiError {
        ApiError::MissingKey(self.wanted.clone())
    }

    /// The request's key, if it sent one; `400` for one sent twice (in one source or
    /// two). With only the header source (the default), one header lookup.
    pub fn find<'r>(
        &self,
        headers: &'r HeaderMap,
        query: Option<&'r str>,
    ) -> Result<Option<FoundKey<'r>>, ApiError> {
        let mut found: Option<FoundKey<'r>> = None;
        let mut put = |key: FoundKey<'r>| match &found {
            Some(first) => Err(ApiError::BadRequest(format!(
                "an API key was sent {} and {}; send it once",
                describe(first.source),
                describe(key.source)
            ))),
            None => {
                found = Some(key);
                Ok(())
            }
        };
        if let Some(name) = &self.header {
            if let Some(v) = headers.get(name) {
                put(FoundKey {
                    key: Cow::Borrowed(v.to_str().unwrap_or("")),
                    source: KeySource::Header,
                    rest_of_query: None,
                })?;
            }
        }
        if self.bearer {
            if let Some(key) = bearer(headers)? {
                put(FoundKey {
                    key: Cow::Borrowed(key),
                    source: KeySource::Bearer,
                    rest_of_query: None,
                })?;
            }
        }
        if let (Some(name), Some(q)) = (&self.query, query) {
            if let Some((key, rest)) = from_query(q, name)? {
                put(FoundKey {
                    key,
                    source: KeySource::Query,
                    rest_of_query: rest,
                })?;
            }
        }
        Ok(found)
    }
}

fn describe(source: KeySource) -> &'static str {
    match source {
        KeySource::Header => "in a header",
        KeySource::Bearer => "as a Bearer token",
        KeySource::Query => "in the query",
    }
}

/// The token of `Authorization: Bearer <token>` (the scheme in any case, RFC 9110
/// §11.1); another scheme is not a key. Two `Authorization` headers are `400`.
fn bearer(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let mut all = headers.get_all(header::AUTHORIZATION);
    let (Some(v), None) = (all.next(), all.next()) else {
        return match headers.contains_key(header::AUTHORIZATION) {
            true => Err(ApiError::BadRequest(
                "the Authorization header was sent more than once".into(),
            )),
            false => Ok(None),
        };
    };
    let v = v.to_str().unwrap_or("");
    let Some((scheme, token)) = v.split_once(' ') else {
        return Ok(None);
    };
    Ok(scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_matches(' ')))
}

/// The value of the query parameter `name` (percent-decoded; `+` is a plus, RFC 3986) and
/// the query without it, byte for byte (`None`: nothing else). Sent twice: `400`.
#[allow(clippy::type_complexity)]
fn from_query<'q>(
    query: &'q str,
    name: &str,
) -> Result<Option<(Cow<'q, str>, Option<String>)>, ApiError> {
    let is_key = |part: &&str| {
        let n = part.split_once('=').map_or(*part, |(n, _)| n);
        decoded(n).as_deref() == Some(name)
    };
    // Most queries carry no key: nothing is built for them.
    let mut keys = query.split('&').filter(is_key);
    let Some(part) = keys.next() else {
        return Ok(None);
    };
    if keys.next().is_some() {
        return Err(ApiError::BadRequest(format!(
            "the {name} query parameter was sent more than once; send one API key"
        )));
    }
    let value = part.split_once('=').map_or("", |(_, v)| v);
    let key = decoded(value).unwrap_or(Cow::Borrowed(""));
    let rest: Vec<&str> = query.split('&').filter(|p| !is_key(p)).collect();
    Ok(Some((key, (!rest.is_empty()).then(|| rest.join("&")))))
}

/// Percent-decoded text; `None` when it is not UTF-8.
fn decoded(s: &str) -> Option<Cow<'_, str>> {
    percent_decode_str(s).decode_utf8().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::HeaderValue;

    fn all() -> KeySources {
        KeySources::new(
            &[KeySource::Header, KeySource::Bearer, KeySource::Query],
            &HeaderName::from_static("x-api-key"),
            "api_key",
        )
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        h
    }

    fn key(h: &HeaderMap, q: Option<&str>) -> Option<(String, KeySource, Option<String>)> {
        all()
            .find(h, q)
            .unwrap()
            .map(|f| (f.key.into_owned(), f.source, f.rest_of_query))
    }

    #[test]
    fn a_key_is_found_in_each_source() {
        assert_eq!(
            key(&headers(&[("x-api-key", "k1")]), None),
            Some(("k1".into(), KeySource::Header, None))
        );
        for auth in ["Bearer k2", "bearer k2", "BEARER  k2"] {
            let h = HeaderMap::from_iter([(
                header::AUTHORIZATION,
                HeaderValue::from_str(auth).unwrap(),
            )]);
            assert_eq!(
                key(&h, None),
                Some(("k2".into(), KeySource::Bearer, None)),
                "{auth}"
            );
        }
        assert_eq!(
            key(&HeaderMap::new(), Some("a=%2F&api_key=tg%5Fk3&b=1+2")),
            Some(("tg_k3".into(), KeySource::Query, Some("a=%2F&b=1+2".into())))
        );
        assert_eq!(
            key(&HeaderMap::new(), Some("api_key=a+b")),
            Some(("a+b".into(), KeySource::Query, None))
        );
        assert_eq!(
            key(&HeaderMap::new(), Some("api%5Fkey=k4")),
            Some(("k4".into(), KeySource::Query, None))
        );
    }

    #[test]
    fn what_is_not_a_key_is_not_one() {
        let basic = headers(&[("authorization", "Basic dXNlcjpwYXNz")]);
        assert_eq!(key(&basic, None), None);
        assert_eq!(key(&HeaderMap::new(), Some("api_keys=1&x=api_key")), None);
        assert_eq!(key(&HeaderMap::new(), None), None);
        // Only the configured sources are read.
        let header_only = KeySources::new(
            &[KeySource::Header],
            &HeaderName::from_static("x-api-key"),
            "api_key",
        );
        let bearer = headers(&[("authorization", "Bearer k")]);
        assert_eq!(header_only.find(&bearer, Some("api_key=k")).unwrap(), None);
    }

    #[test]
    fn a_key_sent_twice_is_refused_naming_where() {
        let h = headers(&[("x-api-key", "k1"), ("authorization", "Bearer k1")]);
        let e = all().find(&h, None).unwrap_err().to_string();
        assert!(e.contains("in a header and as a Bearer token"), "{e}");
        let h = headers(&[("x-api-key", "k1")]);
        let e = all().find(&h, Some("api_key=k1")).unwrap_err().to_string();
        assert!(e.contains("in a header and in the query"), "{e}");
        let none = HeaderMap::new();
        let e = all().find(&none, Some("api_key=a&api_key=b"));
        assert!(e.unwrap_err().to_string().contains("more than once"));
        let h = headers(&[("authorization", "Bearer a"), ("authorization", "Bearer b")]);
        assert!(all().find(&h, None).is_err());
    }

    #[test]
    fn a_401_names_every_source_in_order() {
        assert_eq!(
            all().missing().to_string(),
            "a valid API key is required in the x-api-key header, as an Authorization: Bearer token or in the api_key query parameter"
        );
    }
}
