//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the `traceparent` and
//! `tracestate` request headers, parsed strictly. The client's headers are hostile input:
//! a malformed `traceparent` is ignored (a new trace starts) and never passed on as it came.

use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
use rand::RngCore;

pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The longest `tracestate` passed on (the spec's recommended limit); a longer one is
/// dropped whole rather than cut, since the spec's truncation needs its list parsed.
pub const MAX_TRACESTATE: usize = 512;

/// The `sampled` bit of the trace flags.
const SAMPLED: u8 = 0x01;

/// A trace and the span that is the parent of the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// Only the `sampled` bit: version 00 defines no other.
    pub flags: u8,
}

impl SpanContext {
    /// A `traceparent` value: version 00 (length 55), or a later version (not `ff`) in the
    /// same layout, longer only after a `-` (the spec's rule for versions it does not know
    /// yet). Lowercase hex only; all-zero trace or parent ids are invalid.
    pub fn parse(value: &[u8]) -> Option<SpanContext> {
        if value.len() < 55 {
            return None;
        }
        let version = hex_byte(&value[0..2])?;
        match version {
            0x00 if value.len() != 55 => return None,
            0xff => return None,
            _ if value.len() > 55 && value[55] != b'-' => return None,
            _ => {}
        }
        if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let mut trace_id = [0u8; 16];
        for (i, b) in trace_id.iter_mut().enumerate() {
            *b = hex_byte(&value[3 + 2 * i..5 + 2 * i])?;
        }
        let mut span_id = [0u8; 8];
        for (i, b) in span_id.iter_mut().enumerate() {
            *b = hex_byte(&value[36 + 2 * i..38 + 2 * i])?;
        }
        let flags = hex_byte(&value[53..55])?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(SpanContext {
            trace_id,
            span_id,
            flags: flags & SAMPLED,
        })
    }

    /// The incoming context of a request: its one valid `traceparent` (two or more are
    /// invalid, as the spec's test suite has it), or `None`.
    pub fn incoming(headers: &HeaderMap) -> Option<SpanContext> {
        let mut values = headers.get_all(&TRACEPARENT);
        let first = values.next()?;
        if values.next().is_some() {
            return None;
        }
        SpanContext::parse(first.as_bytes())
    }

    /// A new trace (random ids), marked sampled: services that sample by their parent
    /// record it as they would have recorded a request that came with no trace at all.
    pub fn new_root() -> SpanContext {
        SpanContext {
            trace_id: random_id(),
            span_id: random_id(),
            flags: SAMPLED,
        }
    }

    /// A child of this span: the same trace and flags, a new span id.
    pub fn child(&self) -> SpanContext {
        SpanContext {
            span_id: random_id(),
            ..*self
        }
    }

    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The version 00 `traceparent` naming this span as the parent.
    pub fn traceparent(&self) -> HeaderValue {
        let mut out = [0u8; 55];
        out[..3].copy_from_slice(b"00-");
        write_hex(&mut out[3..35], &self.trace_id);
        out[35] = b'-';
        write_hex(&mut out[36..52], &self.span_id);
        out[52] = b'-';
        write_hex(&mut out[53..55], &[self.flags]);
        // Only hex digits and dashes: always a valid header value.
        HeaderValue::from_bytes(&out).expect("hex and dashes")
    }
}

/// The `tracestate` to pass on with a valid incoming `traceparent`: its fields joined with
/// commas (the spec allows splitting it over several), when the whole is at most
/// [`MAX_TRACESTATE`] characters of printable ASCII; otherwise none. (A header value cannot
/// hold CR or LF; other control characters and non-ASCII bytes are refused here.)
pub fn tracestate(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut values = headers.get_all(&TRACESTATE);
    let first = values.next()?;
    let ok = |v: &[u8]| v.iter().all(|b| (0x20..=0x7e).contains(b) || *b == b'\t');
    let Some(second) = values.next() else {
        let v = first.as_bytes();
        return (!v.is_empty() && v.len() <= MAX_TRACESTATE && ok(v)).then(|| first.clone());
    };
    let mut joined = Vec::with_capacity(MAX_TRACESTATE);
    for v in [first, second].into_iter().chain(values) {
        if !joined.is_empty() {
            joined.push(b',');
        }
        joined.extend_from_slice(v.as_bytes());
        if joined.len() > MAX_TRACESTATE {
            return None;
        }
    }
    if !ok(&joined) {
        return None;
    }
    HeaderValue::from_bytes(&joined).ok()
}

/// A random id, never all zeros (W3C: invalid). Filled as bytes: sampling `[u8; N]` draws
/// a 32-bit word per byte, four times the generator's work.
fn random_id<const N: usize>() -> [u8; N] {
    let mut id = [0; N];
    let mut rng = rand::rng();
    while id == [0; N] {
        rng.fill_bytes(&mut id);
    }
    id
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    Some(hex_digit(two[0])? << 4 | hex_digit(two[1])?)
}

fn write_hex(out: &mut [u8], bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = DIGITS[(b >> 4) as usize];
        out[2 * i + 1] = DIGITS[(b & 0xf) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_version_00_traceparent_is_read_and_written_back_the_same() {
        let ctx = SpanContext::parse(VALID.as_bytes()).unwrap();
        assert_eq!(
            hex::encode(ctx.trace_id),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(hex::encode(ctx.span_id), "00f067aa0ba902b7");
        assert!(ctx.sampled());
        assert_eq!(ctx.traceparent(), VALID);
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ];
        for b in bad {
            assert_eq!(SpanContext::parse(b.as_bytes()), None, "{b:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_in_the_version_00_layout_and_unknown_flags_dropped() {
        let v = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-what-comes";
        let ctx = SpanContext::parse(v.as_bytes()).unwrap();
        assert_eq!(ctx.flags, 0x01);
        assert!(ctx.traceparent().to_str().unwrap().starts_with("00-"));
    }

    #[test]
    fn a_child_keeps_the_trace_and_flags_with_a_new_span_id() {
        let ctx = SpanContext::parse(VALID.as_bytes()).unwrap();
        let child = ctx.child();
        assert_eq!((child.trace_id, child.flags), (ctx.trace_id, ctx.flags));
        assert_ne!(child.span_id, ctx.span_id);
        assert_ne!(SpanContext::new_root().trace_id, ctx.trace_id);
    }

    #[test]
    fn two_traceparents_are_none() {
        let mut h = HeaderMap::new();
        h.append(TRACEPARENT.clone(), HeaderValue::from_static(VALID));
        assert!(SpanContext::incoming(&h).is_some());
        h.append(TRACEPARENT.clone(), HeaderValue::from_static(VALID));
        assert_eq!(SpanContext::incoming(&h), None);
    }

    #[test]
    fn tracestate_is_joined_and_dropped_when_too_long_or_odd() {
        let mut h = HeaderMap::new();
        assert_eq!(tracestate(&h), None);
        h.append(TRACESTATE.clone(), HeaderValue::from_static("a=1"));
        assert_eq!(tracestate(&h).unwrap(), "a=1");
        h.append(TRACESTATE.clone(), HeaderValue::from_static("b=2"));
        assert_eq!(tracestate(&h).unwrap(), "a=1,b=2");

        let mut h = HeaderMap::new();
        let long = format!("k={}", "v".repeat(MAX_TRACESTATE - 1));
        h.insert(TRACESTATE.clone(), HeaderValue::from_str(&long).unwrap());
        assert_eq!(tracestate(&h), None);
        let fits = format!("k={}", "v".repeat(MAX_TRACESTATE - 2));
        h.insert(TRACESTATE.clone(), HeaderValue::from_str(&fits).unwrap());
        assert!(tracestate(&h).is_some());

        h.insert(
            TRACESTATE.clone(),
            HeaderValue::from_bytes(b"a=\xc3\xa9").unwrap(),
        );
        assert_eq!(tracestate(&h), None);
    }

    #[test]
    fn new_ids_are_random_in_every_byte_and_never_zero() {
        let ids: Vec<[u8; 16]> = (0..256).map(|_| random_id()).collect();
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
        for i in 0..16 {
            let values: std::collections::HashSet<u8> = ids.iter().map(|id| id[i]).collect();
            assert!(values.len() > 100, "byte {i} took {} values", values.len());
        }
        assert!(ids.iter().all(|id| *id != [0; 16]));
    }
}
