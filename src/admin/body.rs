//! Reading admin request bodies: a size limit, JSON syntax (`400`), then field checks that
//! collect every problem with its field name (`422`) before anything is written.

use actix_web::http::header::{self, HeaderMap};
use actix_web::web;
use futures_util::StreamExt;
use serde::de::{DeserializeOwned, Deserializer, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::{ApiError, FieldError};

/// Admin bodies are small; anything bigger is refused with `413`.
pub const MAX_BODY: usize = 64 * 1024;

/// `v` as an integer when it is a number written with a fraction of zero (`478.0`,
/// `4.78e2`) that fits one; `None` otherwise.
fn integral(v: &Value) -> Option<Value> {
    let f = v.as_f64().filter(|f| f.fract() == 0.0 && v.is_f64())?;
    if (0.0..=u64::MAX as f64).contains(&f) && f < 2f64.powi(64) {
        Some(Value::from(f as u64))
    } else if f >= i64::MIN as f64 && f < 0.0 {
        Some(Value::from(f as i64))
    } else {
        None
    }
}

/// Reads a JSON object body (an empty body counts as `{}`).
pub async fn read_object(payload: web::Payload) -> Result<Map<String, Value>, ApiError> {
    read_object_within(payload, MAX_BODY).await
}

/// Reads a JSON object body of at most `max` bytes (an empty body counts as `{}`).
pub async fn read_object_within(
    mut payload: web::Payload,
    max: usize,
) -> Result<Map<String, Value>, ApiError> {
    let mut buf = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::BadRequest(format!("reading the body: {e}")))?;
        if buf.len() + chunk.len() > max {
            return Err(ApiError::PayloadTooLarge(max as u64));
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

/// One field of a request body, parsed on its own: a bad value becomes an error naming the
/// field instead of ending the parse, so a body with several bad fields gets them all.
/// `null` counts as absent. Request types use it for every field, with `#[serde(default)]`.
#[derive(Debug, Default)]
pub enum Field<T> {
    #[default]
    Absent,
    Valid(T),
    Invalid(String),
}

impl<T> Field<T> {
    /// Whether the member was there (valid or not), not absent or `null`.
    pub fn is_given(&self) -> bool {
        !matches!(self, Field::Absent)
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Field<T>, D::Error> {
        Ok(match Value::deserialize(d)? {
            Value::Null => Field::Absent,
            v => match T::deserialize(&v) {
                Ok(t) => Field::Valid(t),
                // JSON Schema's `integer` is any number without a fraction: `478.0` is 478.
                Err(e) => match integral(&v).map(serde_json::from_value::<T>) {
                    Some(Ok(t)) => Field::Valid(t),
                    _ => Field::Invalid(e.to_string()),
                },
            },
        })
    }
}

/// Reads a JSON object body (an empty body counts as `{}`) into `T`, whose fields are all
/// [`Field`]s: members `T` does not have are refused by name (`T` denies unknown fields, so
/// its schema says `additionalProperties: false`); each field's problem is collected by
/// [`Fields`].
pub async fn read_body<T: DeserializeOwned>(
    payload: web::Payload,
) -> Result<(T, Fields), ApiError> {
    let mut obj = read_object(payload).await?;
    let mut f = Fields::default();
    known_members::<T>(&mut obj, "", "is not a field of this resource", &mut f);
    let body = serde_json::from_value(Value::Object(obj))
        .map_err(|e| ApiError::BadRequest(format!("the body does not fit: {e}")))?;
    Ok((body, f))
}

/// Reads one object inside a body (an item of a list, say) into `T` as [`read_body`] reads
/// a body: its members `T` does not have are refused by name, `{at}.{member}`, and a value
/// that is no object is refused as `at`. The caller names `T`'s fields `{at}.{field}`.
/// `at` empty: the body itself, whose members are named as they are.
pub fn read_member<T: DeserializeOwned>(value: Value, at: &str, f: &mut Fields) -> Option<T> {
    let at = if at.is_empty() { "body" } else { at };
    let Value::Object(mut obj) = value else {
        f.bad(at, "must be an object");
        return None;
    };
    let prefix = if at == "body" {
        String::new()
    } else {
        format!("{at}.")
    };
    known_members::<T>(&mut obj, &prefix, "is not a field of it", f);
    match serde_json::from_value(Value::Object(obj)) {
        Ok(t) => Some(t),
        Err(e) => {
            f.bad(at, e.to_string());
            None
        }
    }
}

/// Drops the members of `obj` that `T` has no field for, naming each in `f`.
fn known_members<T: DeserializeOwned>(
    obj: &mut Map<String, Value>,
    prefix: &str,
    message: &str,
    f: &mut Fields,
) {
    let names = field_names::<T>();
    obj.retain(|k, _| {
        let known = names.contains(&k.as_str());
        if !known {
            f.bad(&format!("{prefix}{k}"), message);
        }
        known
    });
}

/// The field names of a struct that derives `Deserialize`, read from the derive itself.
fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Names<'_> {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(serde::de::Error::custom("names read"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut names: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut names));
    names
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

    /// A field that must be present and valid.
    pub fn required<T>(&mut self, field: &str, value: Field<T>) -> Option<T> {
        match value {
            Field::Valid(t) => Some(t),
            Field::Absent => {
                self.bad(field, "is required");
                None
            }
            Field::Invalid(e) => {
                self.bad(field, e);
                None
            }
        }
    }

    /// A field that may be left out (or `null`), but must be valid when present.
    pub fn optional<T>(&mut self, field: &str, value: Field<T>) -> Option<T> {
        match value {
            Field::Valid(t) => Some(t),
            Field::Absent => None,
            Field::Invalid(e) => {
                self.bad(field, e);
                None
            }
        }
    }

    /// A read-only id sent back in a body, if present, must equal the one in the path.
    pub fn same_id<T: PartialEq + std::fmt::Display>(
        &mut self,
        field: &str,
        value: Field<T>,
        path_id: &T,
    ) {
        match value {
            Field::Valid(v) if v == *path_id => {}
            Field::Absent => {}
            _ => self.bad(
                field,
                format!(
                    "must match the path ({:?}) or be left out",
                    path_id.to_string()
                ),
            ),
        }
    }

    /// The problems `inner` found in a part of the body, each named within `at`
    /// (`clients[3]` and `plan`: `clients[3].plan`).
    pub fn within(&mut self, at: &str, inner: Fields) {
        for e in inner.errors {
            self.errors.push(FieldError {
                field: format!("{at}.{}", e.field),
                message: e.message,
            });
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

/// An `If-Match` or `If-None-Match` precondition (RFC 9110 13.1.1, 13.1.2): `*`, or the
/// revisions its entity tags name.
#[derive(Debug, Clone, PartialEq)]
pub enum Tags {
    /// `*`: any current representation.
    Any,
    /// The revisions of the tags listed that can match: for `If-Match`, compared strongly
    /// as a write needs, the strong ones only (`W/"3"` never matches); for `If-None-Match`,
    /// compared weakly, all of them. Tags that are no revision of ours are dropped.
    Revisions(Vec<u64>),
}

/// `If-Match`: the write goes ahead only when it matches.
pub type IfMatch = Tags;
/// `If-None-Match`: `*` makes a `PUT` create-only; the write is refused when it matches.
pub type IfNoneMatch = Tags;

impl Tags {
    /// Whether a resource at revision `current` (`None`: it does not exist) matches.
    pub fn matches(&self, current: Option<u64>) -> bool {
        match (self, current) {
            (_, None) => false,
            (Tags::Any, Some(_)) => true,
            (Tags::Revisions(revs), Some(cur)) => revs.contains(&cur),
        }
    }
}

/// The `If-Match` header(s), `None` without one; `400` when it is not `*` or a list of
/// entity tags.
pub fn if_match(headers: &HeaderMap) -> Result<Option<IfMatch>, ApiError> {
    tags(headers, header::IF_MATCH, false)
}

/// The `If-None-Match` header(s), `None` without one; `400` when it is not `*` or a list
/// of entity tags.
pub fn if_none_match(headers: &HeaderMap) -> Result<Option<IfNoneMatch>, ApiError> {
    tags(headers, header::IF_NONE_MATCH, true)
}

/// Header `name`'s lines as one list of tags; `weak`: weak tags count (a weak comparison).
fn tags(
    headers: &HeaderMap,
    name: header::HeaderName,
    weak: bool,
) -> Result<Option<Tags>, ApiError> {
    let mut values = headers.get_all(&name).peekable();
    if values.peek().is_none() {
        return Ok(None);
    }
    let bad = |v: &str| {
        ApiError::BadRequest(format!(
            "{} {v:?} is not * or a list of entity tags like \"3\"",
            if weak { "If-None-Match" } else { "If-Match" }
        ))
    };
    let mut revs = Vec::new();
    let mut star = false;
    for v in values {
        let v = v.to_str().map_err(|_| bad("(not ASCII)"))?;
        for tag in entity_tags(v).ok_or_else(|| bad(v))? {
            match tag {
                Tag::Star => star = true,
                Tag::Weak(_) if !weak => {}
                Tag::Weak(opaque) | Tag::Strong(opaque) => revs.extend(opaque.parse::<u64>().ok()),
            }
        }
    }
    Ok(Some(if star {
        Tags::Any
    } else {
        Tags::Revisions(revs)
    }))
}

/// A write's preconditions, `If-Match` then `If-None-Match` (RFC 9110 13.2.2).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Preconditions {
    pub if_match: Option<IfMatch>,
    pub if_none_match: Option<IfNoneMatch>,
}

impl Preconditions {
    /// Both headers; `400` when either is malformed.
    pub fn read(headers: &HeaderMap) -> Result<Self, ApiError> {
        Ok(Self {
            if_match: if_match(headers)?,
            if_none_match: if_none_match(headers)?,
        })
    }

    /// Whether the request states any: then a write that loses a race is refused (`412`),
    /// not retried over what the other writer left.
    pub fn any(&self) -> bool {
        self.if_match.is_some() || self.if_none_match.is_some()
    }
}

enum Tag<'a> {
    Star,
    Weak(&'a str),
    Strong(&'a str),
}

/// The syntax [`entity_tags`] accepts, as a JSON Schema (ECMA-262) pattern: `*`, or a list
/// of entity tags (empty list elements allowed, as RFC 9110 5.6.1 asks).
pub const IF_MATCH_PATTERN: &str =
    r#"^(\*|[ \t,]*(W/)?"[\x21\x23-\x7E]*"([ \t]*,[ \t,]*(W/)?"[\x21\x23-\x7E]*")*[ \t,]*)$"#;

/// Splits `*` or `#entity-tag` (RFC 9110 8.8.3); `None` on a syntax error. A tag's
/// characters are `%x21 / %x23-7E` (no space, no quote; a comma is allowed inside).
fn entity_tags(v: &str) -> Option<Vec<Tag<'_>>> {
    let v = v.trim_matches([' ', '\t']);
    if v == "*" {
        return Some(vec![Tag::Star]);
    }
    let mut tags = Vec::new();
    let mut rest = v;
    loop {
        rest = rest.trim_start_matches([' ', '\t']);
        if let Some(r) = rest.strip_prefix(',') {
            rest = r; // empty list elements are allowed
            continue;
        }
        if rest.is_empty() {
            break;
        }
        let (weak, r) = match rest.strip_prefix("W/") {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let r = r.strip_prefix('"')?;
        let end = r.find('"')?;
        let opaque = &r[..end];
        if !opaque
            .bytes()
            .all(|b| b == 0x21 || (0x23..=0x7e).contains(&b))
        {
            return None;
        }
        tags.push(if weak {
            Tag::Weak(opaque)
        } else {
            Tag::Strong(opaque)
        });
        rest = r[end + 1..].trim_start_matches([' ', '\t']);
        match rest.strip_prefix(',') {
            Some(r) => rest = r,
            None if rest.is_empty() => break,
            None => return None,
        }
    }
    (!tags.is_empty()).then_some(tags)
}

/// `schema`, marked `readOnly`: a field a client may send back as it read it.
pub fn read_only(
    schema: utoipa::openapi::RefOr<utoipa::openapi::Schema>,
) -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
    use utoipa::openapi::{RefOr, Schema};
    match schema {
        RefOr::T(Schema::Object(mut o)) => {
            o.read_only = Some(true);
            RefOr::T(Schema::Object(o))
        }
        other => other,
    }
}

/// A free-text description: at most [`Description::MAX_CHARS`] characters.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "String")]
pub struct Description(String);

impl Description {
    pub const MAX_CHARS: usize = 1024;
}

impl TryFrom<String> for Description {
    type Error = String;
    fn try_from(s: String) -> Result<Description, String> {
        if s.chars().count() <= Self::MAX_CHARS {
            Ok(Description(s))
        } else {
            Err(format!("must be at most {} characters", Self::MAX_CHARS))
        }
    }
}

impl From<Description> for String {
    fn from(d: Description) -> String {
        d.0
    }
}

impl utoipa::PartialSchema for Description {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
        ObjectBuilder::new()
            .schema_type(SchemaType::Type(Type::String))
            .max_length(Some(Self::MAX_CHARS))
            .description(Some("Free text, at most 1024 characters."))
            .into()
    }
}

impl utoipa::ToSchema for Description {}

/// A `limit` query parameter: 1-1000, 100 when absent. Any integer outside the bounds (a
/// negative or a huge one too) is a `422` naming it; only a value that is no integer is a
/// malformed query (`400`).
pub fn page_limit(limit: Option<&str>) -> Result<usize, ApiError> {
    let Some(raw) = limit else {
        return Ok(100);
    };
    let digits = raw.strip_prefix(['-', '+']).unwrap_or(raw);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::BadRequest(format!(
            "limit {raw:?} is not an integer"
        )));
    }
    match raw.parse::<u16>() {
        Ok(limit @ 1..=1000) => Ok(limit.into()),
        _ => Err(ApiError::field("limit", "must be between 1 and 1000")),
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

    fn parsed(values: &[&str]) -> Result<Option<IfMatch>, ApiError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::IF_MATCH, v.parse().unwrap());
        }
        if_match(&h)
    }

    #[test]
    fn if_match_takes_a_quoted_revision_or_a_star() {
        assert_eq!(parsed(&[]).unwrap(), None);
        assert_eq!(
            parsed(&["\"12\""]).unwrap(),
            Some(IfMatch::Revisions(vec![12]))
        );
        assert_eq!(parsed(&["*"]).unwrap(), Some(IfMatch::Any));
    }

    #[test]
    fn a_list_matches_when_any_listed_tag_matches() {
        let m = parsed(&["\"1\", \"3\""]).unwrap().unwrap();
        assert!(m.matches(Some(3)) && m.matches(Some(1)));
        assert!(!m.matches(Some(2)));
        // Several header lines make one list.
        let m = parsed(&["\"1\"", "\"3\""]).unwrap().unwrap();
        assert!(m.matches(Some(3)));
    }

    #[test]
    fn a_weak_tag_never_matches_for_a_write() {
        let m = parsed(&["W/\"3\""]).unwrap().unwrap();
        assert!(!m.matches(Some(3)));
        let m = parsed(&["W/\"3\", \"4\""]).unwrap().unwrap();
        assert!(!m.matches(Some(3)));
        assert!(m.matches(Some(4)));
    }

    #[test]
    fn a_star_matches_any_existing_representation_and_no_missing_one() {
        let m = parsed(&["*"]).unwrap().unwrap();
        assert!(m.matches(Some(7)));
        assert!(!m.matches(None));
        assert!(!IfMatch::Revisions(vec![1]).matches(None));
    }

    #[test]
    fn tags_that_are_no_revision_of_ours_match_nothing() {
        let m = parsed(&["\"abc\", \"a,b\""]).unwrap().unwrap();
        assert_eq!(m, IfMatch::Revisions(vec![]));
    }

    #[test]
    fn malformed_if_match_is_a_bad_request() {
        for v in ["3", "\"3", "W/3", "\"1\" \"2\"", "", "*, \"1\"", "\"a b\""] {
            assert!(
                matches!(parsed(&[v]), Err(ApiError::BadRequest(_))),
                "{v:?}"
            );
        }
    }

    #[test]
    fn a_whole_number_written_with_a_fraction_is_an_integer_as_json_schema_says() {
        let f: Field<u64> = serde_json::from_str("478.0").unwrap();
        assert!(matches!(f, Field::Valid(478)));
        let f: Field<u64> = serde_json::from_str("4.78e2").unwrap();
        assert!(matches!(f, Field::Valid(478)));
        let f: Field<u64> = serde_json::from_str("478.5").unwrap();
        assert!(matches!(f, Field::Invalid(_)));
        let f: Field<u64> = serde_json::from_str("-1.0").unwrap();
        assert!(matches!(f, Field::Invalid(_)));
        let f: Field<f64> = serde_json::from_str("2.5").unwrap();
        assert!(matches!(f, Field::Valid(v) if v == 2.5));
    }

    fn none_match(values: &[&str]) -> Result<Option<IfNoneMatch>, ApiError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::IF_NONE_MATCH, v.parse().unwrap());
        }
        if_none_match(&h)
    }

    #[test]
    fn if_none_match_star_fails_on_any_existing_representation_only() {
        assert_eq!(none_match(&[]).unwrap(), None);
        let m = none_match(&["*"]).unwrap().unwrap();
        assert!(m.matches(Some(1)));
        assert!(!m.matches(None));
    }

    #[test]
    fn if_none_match_compares_weakly() {
        let m = none_match(&["W/\"3\", \"5\""]).unwrap().unwrap();
        assert!(m.matches(Some(3)) && m.matches(Some(5)));
        assert!(!m.matches(Some(4)) && !m.matches(None));
        assert!(matches!(none_match(&["3"]), Err(ApiError::BadRequest(_))));
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Two {
        #[serde(default)]
        a: Field<u8>,
        #[serde(default)]
        b: Field<Option<String>>,
    }

    #[test]
    fn every_bad_field_of_a_body_is_named() {
        assert_eq!(field_names::<Two>(), ["a", "b"]);
        let t: Two = serde_json::from_str(r#"{"a": 300, "b": 5}"#).unwrap();
        let mut f = Fields::default();
        f.required("a", t.a);
        f.optional("b", t.b);
        let fields: Vec<_> = f.errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["a", "b"]);
        let t: Two = serde_json::from_str(r#"{"b": null}"#).unwrap();
        let mut f = Fields::default();
        assert_eq!(f.optional("b", t.b), None);
        assert_eq!(f.required("a", t.a), None);
        assert_eq!(f.errors[0].message, "is required");
    }
}
