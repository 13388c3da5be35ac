//! Request paths in one normal form before they are routed and forwarded.
//!
//! A route publishes a prefix of a service's paths. If the gateway routed one spelling of a
//! path and the service resolved another (`/orders/../secret.txt`, `/orders/%2e%2e/x`,
//! `/orders/..;/x`), a client could reach what no route publishes. So the path is brought
//! to one normal form (RFC 3986 §6.2.2: escapes of unreserved characters decoded, hex
//! digits upper-cased, dot segments removed, plus merged slashes as Envoy and nginx do),
//! routed on that form and forwarded in that form: the service sees exactly what was
//! routed. Spellings that servers disagree about (encoded `/` and `\`, `;` path
//! parameters, trailing dots, control characters) are refused rather than guessed.
//!
//! Most paths are already normal: [`NormalPath::parse`] checks them in one pass and
//! borrows them; only a path that changes is copied.

use std::borrow::Cow;

use crate::error::ApiError;

/// Paths longer than this are refused with `414` (the query is not counted).
pub const MAX_PATH_BYTES: usize = 8 * 1024;

/// A request path in normal form: starts with `/`, no empty, `.` or `..` segments (a
/// trailing `/` is kept), no escapes of unreserved characters, upper-case hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormalPath<'a>(Cow<'a, str>);

/// Why a path is refused. The messages name the problem, never echo the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path is longer than {MAX_PATH_BYTES} bytes")]
    TooLong,
    #[error("the request target must be a path starting with '/'")]
    NotAbsolute,
    #[error("malformed percent-escape in the path: '%' must be followed by two hex digits")]
    MalformedEscape,
    #[error("encoded '/' (%2F) is not allowed in a path")]
    EncodedSlash,
    #[error("'\\' (raw or encoded as %5C) is not allowed in a path")]
    Backslash,
    #[error("';' (raw or encoded as %3B) is not allowed in a path: some servers read what follows it as path parameters")]
    Semicolon,
    #[error("control characters (raw or encoded, such as %00) are not allowed in a path")]
    ControlChar,
    #[error("a path segment may not end in '.' (other than '.' and '..'): some servers drop trailing dots")]
    TrailingDot,
    #[error("the path climbs above '/' with '..'")]
    AboveRoot,
}

/// `414` for the length limit, `400` for the rest.
impl From<PathError> for ApiError {
    fn from(e: PathError) -> ApiError {
        match e {
            PathError::TooLong => ApiError::PathTooLong(MAX_PATH_BYTES),
            e => ApiError::BadPath(e.to_string()),
        }
    }
}

impl<'a> NormalPath<'a> {
    /// The normal form of a request's raw (still percent-encoded) path, borrowed when
    /// `raw` is already in it.
    pub fn parse(raw: &'a str) -> Result<NormalPath<'a>, PathError> {
        if raw.len() > MAX_PATH_BYTES {
            return Err(PathError::TooLong);
        }
        let rest = raw.strip_prefix('/').ok_or(PathError::NotAbsolute)?;
        if is_normal(rest)? {
            Ok(NormalPath(Cow::Borrowed(raw)))
        } else {
            normalise(rest).map(|p| NormalPath(Cow::Owned(p)))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the path differs from what the client sent (so it must be re-encoded for
    /// the forward).
    pub fn is_rewritten(&self) -> bool {
        matches!(self.0, Cow::Owned(_))
    }
}

/// One character of a segment: a raw byte, or a percent-escape and the byte it encodes.
#[derive(Clone, Copy)]
enum Unit {
    Raw(u8),
    /// `spelled_normally`: the escape is needed (not of an unreserved character) and its
    /// hex digits are upper-case.
    Escape {
        byte: u8,
        spelled_normally: bool,
    },
}

impl Unit {
    fn byte(self) -> u8 {
        match self {
            Unit::Raw(b) | Unit::Escape { byte: b, .. } => b,
        }
    }

    /// Bytes of the raw segment this unit takes.
    fn width(self) -> usize {
        match self {
            Unit::Raw(_) => 1,
            Unit::Escape { .. } => 3,
        }
    }
}

/// The units of one segment, refusing what [`PathError`] names.
fn units(segment: &str) -> impl Iterator<Item = Result<Unit, PathError>> + '_ {
    let bytes = segment.as_bytes();
    let mut i = 0;
    std::iter::from_fn(move || {
        let &b = bytes.get(i)?;
        let unit = if b == b'%' {
            let digits = (bytes.get(i + 1).copied(), bytes.get(i + 2).copied());
            let (Some(hi), Some(lo)) = digits else {
                i = bytes.len();
                return Some(Err(PathError::MalformedEscape));
            };
            let (Some(h), Some(l)) = (hex(hi), hex(lo)) else {
                i = bytes.len();
                return Some(Err(PathError::MalformedEscape));
            };
            let byte = h << 4 | l;
            Unit::Escape {
                byte,
                spelled_normally: !unreserved(byte)
                    && !hi.is_ascii_lowercase()
                    && !lo.is_ascii_lowercase(),
            }
        } else {
            Unit::Raw(b)
        };
        i += unit.width();
        Some(match unit.byte() {
            b'/' => Err(PathError::EncodedSlash),
            b'\\' => Err(PathError::Backslash),
            b';' => Err(PathError::Semicolon),
            0x00..=0x1F | 0x7F => Err(PathError::ControlChar),
            _ => Ok(unit),
        })
    })
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// RFC 3986 unreserved characters: never need an escape, so an escape of one is decoded.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// What a segment is once decoded.
enum Segment {
    Empty,
    Dot,
    DotDot,
    Name,
}

/// Classifies a segment, refusing a name that ends in `.`; `changed` is set when the
/// segment is not spelled in normal form.
fn classify(segment: &str, changed: &mut bool) -> Result<Segment, PathError> {
    let (mut len, mut dots, mut last_dot) = (0usize, 0usize, false);
    for unit in units(segment) {
        let unit = unit?;
        if let Unit::Escape {
            spelled_normally: false,
            ..
        } = unit
        {
            *changed = true;
        }
        len += 1;
        last_dot = unit.byte() == b'.';
        dots += usize::from(last_dot);
    }
    Ok(match (len, dots) {
        (0, _) => Segment::Empty,
        (1, 1) => Segment::Dot,
        (2, 2) => Segment::DotDot,
        _ if last_dot => return Err(PathError::TrailingDot),
        _ => Segment::Name,
    })
}

/// Whether `rest` (the path after its first `/`) is normal by its bytes alone: letters,
/// digits, `-`, `_`, `~`, single `/`s not at its start, and `.`s between two of the
/// others (so no segment is `.` or `..` or ends in `.`). Every segment is then a name
/// with nothing to decode: most request paths, checked a byte at a time. Any other
/// path is checked unit by unit ([`is_normal`]).
fn plainly_normal(rest: &[u8]) -> bool {
    let plain = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~');
    let mut prev = b'/';
    for (i, &b) in rest.iter().enumerate() {
        let ok = match b {
            b'/' => prev != b'/',
            b'.' => plain(prev) && rest.get(i + 1).is_some_and(|&n| plain(n)),
            b => plain(b),
        };
        if !ok {
            return false;
        }
        prev = b;
    }
    true
}

/// Validates `rest` (the path after its first `/`) and says whether it is already normal.
fn is_normal(rest: &str) -> Result<bool, PathError> {
    if plainly_normal(rest.as_bytes()) {
        return Ok(true);
    }
    is_normal_by_units(rest)
}

/// [`is_normal`], a unit at a time.
fn is_normal_by_units(rest: &str) -> Result<bool, PathError> {
    let mut changed = false;
    let mut segments = rest.split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        match classify(segment, &mut changed)? {
            Segment::Empty if last => {}
            Segment::Empty | Segment::Dot | Segment::DotDot => changed = true,
            Segment::Name => {}
        }
    }
    Ok(!changed)
}

/// The normal form of `rest` (the path after its first `/`): escapes normalised, empty
/// segments merged, dot segments removed (RFC 3986 §5.2.4).
fn normalise(rest: &str) -> Result<String, PathError> {
    let mut out = String::with_capacity(rest.len() + 1);
    let mut trailing_slash = false;
    let mut segments = rest.split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        match classify(segment, &mut false)? {
            Segment::Empty | Segment::Dot => trailing_slash = last,
            Segment::DotDot => {
                let parent = out.rfind('/').ok_or(PathError::AboveRoot)?;
                out.truncate(parent);
                trailing_slash = last;
            }
            Segment::Name => {
                out.push('/');
                push_normal(&mut out, segment)?;
                trailing_slash = false;
            }
        }
    }
    if trailing_slash || out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// Appends a segment with escapes of unreserved characters decoded and the others' hex
/// digits upper-cased. Raw bytes are copied in runs (a character may take several).
fn push_normal(out: &mut String, segment: &str) -> Result<(), PathError> {
    let (mut run, mut i) = (0, 0);
    for unit in units(segment) {
        let unit = unit?;
        if let Unit::Escape { byte, .. } = unit {
            out.push_str(&segment[run..i]);
            if unreserved(byte) {
                out.push(char::from(byte));
            } else {
                out.push('%');
                out.push(char::from(HEX_UPPER[usize::from(byte >> 4)]));
                out.push(char::from(HEX_UPPER[usize::from(byte & 0xF)]));
            }
            run = i + unit.width();
        }
        i += unit.width();
    }
    out.push_str(&segment[run..]);
    Ok(())
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

#[cfg(test)]
mod tests {
    use super::*;

    fn normal(raw: &str) -> Result<String, PathError> {
        NormalPath::parse(raw).map(|p| p.as_str().to_string())
    }

    #[test]
    fn a_normal_path_is_borrowed_as_it_is() {
        for raw in [
            "/",
            "/orders",
            "/orders/",
            "/orders/7",
            "/orders/.well-known/x",
            "/orders/a.b/%C3%A9",
            "/orders/%252e%252e",
            "/orders/%3F%23%25",
            "/orders/{\"a\":1}|^[]",
            "/orders/é",
        ] {
            let p = NormalPath::parse(raw).unwrap();
            assert_eq!(p.as_str(), raw);
            assert!(!p.is_rewritten(), "{raw}");
        }
    }

    /// The byte check never calls a path normal that the unit-by-unit check would not:
    /// every path of up to five characters over an alphabet with each kind of byte.
    #[test]
    fn the_byte_check_agrees_with_the_full_check() {
        let alphabet = [b'a', b'Z', b'7', b'-', b'~', b'.', b'/', b'%', b';', b'\\'];
        let mut plain = 0;
        let mut rest = Vec::new();
        fn each(rest: &mut Vec<u8>, alphabet: &[u8], left: usize, f: &mut dyn FnMut(&[u8])) {
            f(rest);
            if left == 0 {
                return;
            }
            for &b in alphabet {
                rest.push(b);
                each(rest, alphabet, left - 1, f);
                rest.pop();
            }
        }
        each(&mut rest, &alphabet, 5, &mut |r| {
            if super::plainly_normal(r) {
                plain += 1;
                let text = std::str::from_utf8(r).unwrap();
                assert_eq!(super::is_normal_by_units(text), Ok(true), "{text:?}");
            }
        });
        // The common spellings do take the byte check.
        assert!(plain > 1000, "{plain}");
        for p in ["api/items/42", "v1/items.json", "a/", "", "x-y_z~1/b.c.d"] {
            assert!(super::plainly_normal(p.as_bytes()), "{p}");
        }
        for p in [
            "/a", "a//b", "a/.", "a/..", ".a", "a./b", "a..b", "a%41", "a;b", "a.",
        ] {
            assert!(!super::plainly_normal(p.as_bytes()), "{p}");
        }
    }

    #[test]
    fn dot_segments_are_removed() {
        let cases = [
            ("/orders/./7", "/orders/7"),
            ("/orders/.", "/orders/"),
            ("/orders/7/..", "/orders/"),
            ("/orders/..", "/"),
            ("/orders/../secret.txt", "/secret.txt"),
            ("/orders/x/../../billing/y", "/billing/y"),
            ("/./orders", "/orders"),
            ("/.", "/"),
            ("/orders/a/./b/../c/", "/orders/a/c/"),
        ];
        for (raw, want) in cases {
            assert_eq!(normal(raw).as_deref(), Ok(want), "{raw}");
            assert!(NormalPath::parse(raw).unwrap().is_rewritten());
        }
    }

    #[test]
    fn encoded_dots_are_dots_in_any_case() {
        for dots in ["%2e%2e", "%2E%2E", ".%2e", "%2e.", "%2E.", ".%2E", "%2e%2E"] {
            let raw = format!("/orders/{dots}/secret.txt");
            assert_eq!(normal(&raw).as_deref(), Ok("/secret.txt"), "{raw}");
        }
        assert_eq!(normal("/orders/%2e/7").as_deref(), Ok("/orders/7"));
        assert_eq!(normal("/orders/a%2eb").as_deref(), Ok("/orders/a.b"));
    }

    #[test]
    fn a_double_encoded_dot_is_the_text_percent_2e_never_a_dot() {
        assert_eq!(
            normal("/orders/%252e%252e/secret.txt").as_deref(),
            Ok("/orders/%252e%252e/secret.txt")
        );
        assert_eq!(normal("/orders/%252E").as_deref(), Ok("/orders/%252E"));
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_the_rest_upper_cased() {
        assert_eq!(
            normal("/%6Frders/%41%7a%30%2D%5F%7E").as_deref(),
            Ok("/orders/Az0-_~")
        );
        assert_eq!(
            normal("/orders/%c3%a9%3f").as_deref(),
            Ok("/orders/%C3%A9%3F")
        );
        assert_eq!(normal("/orders/%25").as_deref(), Ok("/orders/%25"));
        assert_eq!(
            normal("/orders/é%2e").as_deref().err(),
            Some(&PathError::TrailingDot)
        );
        assert_eq!(normal("/orders/é%41").as_deref(), Ok("/orders/éA"));
    }

    #[test]
    fn repeated_slashes_are_merged() {
        assert_eq!(normal("//orders").as_deref(), Ok("/orders"));
        assert_eq!(normal("///orders//7").as_deref(), Ok("/orders/7"));
        assert_eq!(normal("/orders//").as_deref(), Ok("/orders/"));
        assert_eq!(normal("//").as_deref(), Ok("/"));
        // Merged before dot segments are removed, as nginx does.
        assert_eq!(normal("/orders/7//../8").as_deref(), Ok("/orders/8"));
    }

    #[test]
    fn climbing_above_the_root_is_refused() {
        for raw in [
            "/..",
            "/../orders",
            "/orders/../..",
            "/orders/%2e%2e/..",
            "/./..",
        ] {
            assert_eq!(normal(raw), Err(PathError::AboveRoot), "{raw}");
        }
    }

    #[test]
    fn ambiguous_spellings_are_refused() {
        let cases = [
            ("/orders%2fx", PathError::EncodedSlash),
            ("/orders/%2F..%2Fsecret", PathError::EncodedSlash),
            ("/orders/%5c..", PathError::Backslash),
            ("/orders/..\\secret", PathError::Backslash),
            ("/orders/..;/secret", PathError::Semicolon),
            ("/orders/7;jsessionid=x", PathError::Semicolon),
            ("/orders/7%3Bx", PathError::Semicolon),
            ("/orders/%00", PathError::ControlChar),
            ("/orders/a\0b", PathError::ControlChar),
            ("/orders/%0a", PathError::ControlChar),
            ("/orders/%7F", PathError::ControlChar),
            ("/orders/\t", PathError::ControlChar),
            ("/orders/%zz", PathError::MalformedEscape),
            ("/orders/%4", PathError::MalformedEscape),
            ("/orders/%", PathError::MalformedEscape),
            ("/orders/%%41", PathError::MalformedEscape),
            ("/orders/...", PathError::TrailingDot),
            ("/orders/.../x", PathError::TrailingDot),
            ("/orders./x", PathError::TrailingDot),
            ("/orders/secret.txt.", PathError::TrailingDot),
            ("/orders/.%2e.", PathError::TrailingDot),
            ("*", PathError::NotAbsolute),
            ("orders", PathError::NotAbsolute),
            ("", PathError::NotAbsolute),
        ];
        for (raw, want) in cases {
            assert_eq!(normal(raw), Err(want), "{raw:?}");
        }
    }

    #[test]
    fn a_path_over_the_limit_is_refused_as_too_long() {
        let at_limit = format!("/{}", "a".repeat(MAX_PATH_BYTES - 1));
        assert!(NormalPath::parse(&at_limit).is_ok());
        let over = format!("/{}", "a".repeat(MAX_PATH_BYTES));
        let err = NormalPath::parse(&over).unwrap_err();
        assert_eq!(err, PathError::TooLong);
        let status = actix_web::ResponseError::status_code(&ApiError::from(err));
        assert_eq!(status, 414);
    }

    #[test]
    fn the_normal_form_is_its_own_normal_form_with_no_dot_or_empty_segments() {
        let pieces = ["a", ".", "..", "%2e", ".%2E", "", "%41", "b%c3%A9", "%252e"];
        let mut paths = vec![String::new()];
        for _ in 0..4 {
            paths = paths
                .iter()
                .flat_map(|p| pieces.iter().map(move |s| format!("{p}/{s}")))
                .collect();
            for raw in &paths {
                let Ok(once) = normal(raw) else { continue };
                let twice = NormalPath::parse(&once).unwrap();
                assert_eq!(twice.as_str(), once, "{raw}");
                assert!(!twice.is_rewritten(), "{raw} → {once}");
                let inner =
                    &once[1..once.len() - usize::from(once.len() > 1 && once.ends_with('/'))];
                assert!(
                    inner.is_empty() || inner.split('/').all(|s| !matches!(s, "" | "." | "..")),
                    "{raw} → {once}"
                );
            }
        }
    }

    #[test]
    fn refusals_never_echo_the_path() {
        let err = NormalPath::parse("/orders/\u{1b}[31m%00").unwrap_err();
        assert!(!err.to_string().contains('\u{1b}'));
    }
}
