//! Where the frames of a WebSocket byte stream begin (RFC 6455 §5.2). The relay copies bytes
//! as they come; it needs to know only whether a direction stands between two frames, to put
//! a Close frame of its own there. Frame headers are read, payloads are skipped, nothing is
//! unmasked or buffered (a header split between two reads is kept, at most 14 bytes).

use bytes::Bytes;

/// RFC 6455 §7.4.1: the endpoint is going away (a server going down, or an idle connection
/// it closes).
pub const GOING_AWAY: u16 = 1001;

/// Follows a stream of frames from its first byte.
#[derive(Debug, Default, Clone)]
pub struct FrameCursor {
    /// The current frame's header as far as it has arrived (2 to 14 bytes).
    head: [u8; 14],
    head_len: u8,
    /// Payload bytes left in the current frame, once its header is whole.
    left: u64,
}

impl FrameCursor {
    /// Between two frames (or before the first).
    pub fn at_boundary(&self) -> bool {
        self.head_len == 0 && self.left == 0
    }

    /// Follows `bytes`, which come next in the stream; with `stop`, only up to the first
    /// frame boundary it meets (none of them when it stands at one). How many it followed.
    pub fn advance(&mut self, bytes: &[u8], stop: bool) -> usize {
        let mut i = 0;
        while i < bytes.len() {
            if self.left > 0 {
                let n = self.left.min((bytes.len() - i) as u64);
                self.left -= n;
                i += n as usize;
                continue;
            }
            if stop && self.head_len == 0 {
                return i;
            }
            self.head[usize::from(self.head_len)] = bytes[i];
            self.head_len += 1;
            i += 1;
            let head = &self.head[..usize::from(self.head_len)];
            if header_len(head) == Some(head.len()) {
                self.left = payload_len(head);
                self.head_len = 0;
            }
        }
        i
    }
}

/// The length of the header that starts `head` (it needs its first two bytes).
fn header_len(head: &[u8]) -> Option<usize> {
    let second = *head.get(1)?;
    let extended = match second & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    let mask = if second & 0x80 != 0 { 4 } else { 0 };
    Some(2 + extended + mask)
}

/// The payload length a whole header announces.
fn payload_len(head: &[u8]) -> u64 {
    match head[1] & 0x7f {
        126 => u64::from(u16::from_be_bytes([head[2], head[3]])),
        127 => u64::from_be_bytes(head[2..10].try_into().unwrap_or_default()),
        n => u64::from(n),
    }
}

/// A Close frame with `code` and no reason (RFC 6455 §5.5.1): as a server sends it, or as
/// a client must, masked with `mask` (§5.3).
pub fn close_frame(code: u16, mask: Option<[u8; 4]>) -> Bytes {
    let [hi, lo] = code.to_be_bytes();
    match mask {
        None => Bytes::copy_from_slice(&[0x88, 0x02, hi, lo]),
        Some(m) => {
            Bytes::copy_from_slice(&[0x88, 0x82, m[0], m[1], m[2], m[3], hi ^ m[0], lo ^ m[1]])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame of `len` payload bytes, masked or not.
    fn frame(len: usize, masked: bool) -> Vec<u8> {
        let mut f = vec![0x82];
        let mask_bit = if masked { 0x80 } else { 0 };
        match len {
            0..=125 => f.push(mask_bit | len as u8),
            126..=65535 => {
                f.push(mask_bit | 126);
                f.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                f.push(mask_bit | 127);
                f.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        if masked {
            f.extend_from_slice(&[1, 2, 3, 4]);
        }
        f.extend(std::iter::repeat_n(7u8, len));
        f
    }

    #[test]
    fn every_length_form_ends_where_its_header_says() {
        for (len, masked) in [
            (0, false),
            (5, true),
            (125, false),
            (126, true),
            (70_000, false),
        ] {
            let mut c = FrameCursor::default();
            let f = frame(len, masked);
            assert_eq!(c.advance(&f[..f.len() - 1], false), f.len() - 1);
            assert!(!c.at_boundary(), "{len}");
            c.advance(&f[f.len() - 1..], false);
            assert!(c.at_boundary(), "{len}");
        }
    }

    #[test]
    fn a_header_split_byte_by_byte_is_followed() {
        let mut stream = frame(300, true);
        stream.extend(frame(2, false));
        let mut c = FrameCursor::default();
        let mut boundaries = 0;
        for b in &stream {
            c.advance(std::slice::from_ref(b), false);
            boundaries += usize::from(c.at_boundary());
        }
        assert_eq!(boundaries, 2);
    }

    #[test]
    fn stopping_ends_at_the_first_boundary_and_not_before_a_frame() {
        let first = frame(10, false);
        let mut stream = first.clone();
        stream.extend(frame(3, false));
        let mut c = FrameCursor::default();
        assert_eq!(c.advance(&stream, true), 0, "already between frames");
        c.advance(&stream[..4], false);
        assert_eq!(c.advance(&stream[4..], true), first.len() - 4);
        assert!(c.at_boundary());
    }

    #[test]
    fn close_frames_carry_their_code_masked_or_not() {
        assert_eq!(&close_frame(1001, None)[..], &[0x88, 2, 0x03, 0xe9]);
        let masked = close_frame(1001, Some([0xff, 0, 0, 0]));
        assert_eq!(&masked[..], &[0x88, 0x82, 0xff, 0, 0, 0, 0x03 ^ 0xff, 0xe9]);
        let mut c = FrameCursor::default();
        c.advance(&masked, false);
        assert!(c.at_boundary());
    }
}
