//! Reading admin request bodies: a size limit, JSON syntax (`400`), then field checks that
//! collect every problem with its field name (`422`) before anything is written.

use actix_web::http::header::{self, HeaderMap};
use actix_web::web;
use futures_util::StreamExt;
use serde_json::{Map, Value};

use crate::error::{ApiError, FieldError};

/// Admin bodies are small; anything bigger is refused with `413`.
pub const MAX_BODY: usize = 64 * 1024;

/// Reads a JSON object body (an empty body counts as `{}`).
pub async fn read_object(mut payload: web::Payload) -> Result<Map<String, Value>, ApiError> {
    let mut buf = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::BadRequest(format!("reading the body: {e}")))?;
        if buf.len() + chunk.len() > MAX_BODY {
            return Err(ApiError::PayloadTooLarge(MAX_BODY as u64));
        }
        buf.extend_from_slice(&chunk);
    }
    if buf.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    let text = std::str::from_utf8(&buf)
        .map_err(|_| ApiError::BadRequest("the body is not UTF-8".into()))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::BadRequest(
            "the body must be a JSON object".into(),
        )),
        // serde_json refuses numbers beyond f64 (1e999) as a syntax error; name the field.
        Err(e) if e.to_string().contains("number out of range") => Err(ApiError::field(
            &field_before(text, e.line(), e.column()).unwrap_or_else(|| "body".into()),
            "must be a finite number",
        )),
        Err(e) => Err(ApiError::BadRequest(format!("malformed JSON: {e}"))),
    }
}

/// The object key whose value sits at (line, column), found by scanning back from it.
fn field_before(text: &str, line: usize, column: usize) -> Option<String> {
    let offset: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum::<usize>()
        + column;
    let before = text.get(..offset.min(text.len()))?;
    let colon = before.rfind(':')?;
    let key_end = before[..colon].rfind('"')?;
    let key_start = before[..key_end].rfind('"')?;
    Some(before[key_start + 1..key_end].to_string())
}

/// Collects field problems; `finish` turns them into one `422`.
#[derive(Default)]
pub struct Fields {
    pub errors: Vec<FieldError>,
}

impl Fields {
    pub fn bad(&mut self, field: &str, message: impl Into<String>) {
        self.errors.push(FieldError {
            field: field.to_string(),
            message: message.into(),
        });
    }

    /// A required finite number.
    pub fn number(&mut self, obj: &Map<String, Value>, field: &str) -> Option<f64> {
        match obj.get(field) {
            None | Some(Value::Null) => {
                self.bad(field, "is required");
                None
            }
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if x.is_finite() => Some(x),
                _ => {
                    self.bad(field, "must be a finite number");
                    None
                }
            },
            Some(_) => {
                self.bad(field, "must be a number");
                None
            }
        }
    }

    /// An optional string of at most `max` characters.
    pub fn opt_string(
        &mut self,
        obj: &Map<String, Value>,
        field: &str,
        max: usize,
    ) -> Option<String> {
        match obj.get(field) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.chars().count() <= max => Some(s.clone()),
            Some(Value::String(_)) => {
                self.bad(field, format!("must be at most {max} characters"));
                None
            }
            Some(_) => {
                self.bad(field, "must be a string");
                None
            }
        }
    }

    /// Refuses fields the resource does not have (read-only ones are ignored).
    pub fn only(&mut self, obj: &Map<String, Value>, allowed: &[&str], read_only: &[&str]) {
        for k in obj.keys() {
            if !allowed.contains(&k.as_str()) && !read_only.contains(&k.as_str()) {
                self.bad(k, "is not a field of this resource");
            }
        }
    }

    /// An id in the body, if present, must equal the one in the path.
    pub fn same_id(&mut self, obj: &Map<String, Value>, field: &str, path_id: &str) {
        if let Some(v) = obj.get(field) {
            if v.as_str() != Some(path_id) {
                self.bad(
                    field,
                    format!("must match the path ({path_id:?}) or be left out"),
                );
            }
        }
    }

    pub fn finish(self) -> Result<(), ApiError> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(ApiError::Validation(self.errors))
        }
    }
}

/// An `If-Match` precondition: `None` without the header, `Some(None)` for `*`.
pub fn if_match(headers: &HeaderMap) -> Result<Option<Option<u64>>, ApiError> {
    let Some(v) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let v = v
        .to_str()
        .map_err(|_| ApiError::BadRequest("If-Match is not ASCII".into()))?
        .trim();
    if v == "*" {
        return Ok(Some(None));
    }
    let first = v.split(',').next().unwrap_or("").trim();
    let rev = first
        .trim_start_matches("W/")
        .trim_matches('"')
        .parse::<u64>()
        .map_err(|_| ApiError::PreconditionFailed(format!("If-Match {v:?} matches no version")))?;
    Ok(Some(Some(rev)))
}

/// A `limit` query parameter: 1-1000, 100 when absent.
pub fn page_limit(limit: Option<usize>) -> Result<usize, ApiError> {
    let limit = limit.unwrap_or(100);
    if (1..=1000).contains(&limit) {
        Ok(limit)
    } else {
        Err(ApiError::field("limit", "must be between 1 and 1000"))
    }
}

/// The ETag of a record at revision `rev`.
pub fn etag(rev: u64) -> String {
    format!("\"{rev}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_field_of_an_out_of_range_number_is_found() {
        let text = "{\"rate\": 1, \"capacity\": 1e999}";
        let e = serde_json::from_str::<Value>(text).unwrap_err();
        assert_eq!(
            field_before(text, e.line(), e.column()).as_deref(),
            Some("capacity")
        );
    }

    #[test]
    fn if_match_takes_a_quoted_revision_or_a_star() {
        let mut h = HeaderMap::new();
        assert_eq!(if_match(&h).unwrap(), None);
        h.insert(header::IF_MATCH, "\"12\"".parse().unwrap());
        assert_eq!(if_match(&h).unwrap(), Some(Some(12)));
        h.insert(header::IF_MATCH, "*".parse().unwrap());
        assert_eq!(if_match(&h).unwrap(), Some(None));
    }
}
