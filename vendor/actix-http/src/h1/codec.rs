use std::{collections::VecDeque, fmt, io};

use bitflags::bitflags;
use bytes::BytesMut;
use http::{Method, Version};
use tokio_util::codec::{Decoder, Encoder};

use super::{
    decoder::{self, PayloadDecoder, PayloadItem, PayloadType},
    encoder, Message, MessageType,
};
use crate::{body::BodySize, error::ParseError, ConnectionType, Request, Response, ServiceConfig};

bitflags! {
    #[derive(Debug, Clone, Copy)]
    struct Flags: u8 {
        const HEAD               = 0b0000_0001;
        const KEEP_ALIVE_ENABLED = 0b0000_0010;
        const STREAM             = 0b0000_0100;
        /// A response closed the connection: every later response closes it too.
        const CLOSE              = 0b0000_1000;
    }
}

/// How the response to one decoded request is framed: by that request's method, version and
/// connection type.
#[derive(Debug, Clone, Copy)]
struct Framing {
    head: bool,
    version: Version,
    conn_type: ConnectionType,
}

/// HTTP/1 Codec
pub struct Codec {
    config: ServiceConfig,
    decoder: decoder::MessageDecoder<Request>,
    payload: Option<PayloadDecoder>,
    version: Version,
    conn_type: ConnectionType,

    // encoder part
    flags: Flags,
    encoder: encoder::MessageEncoder<Response<()>>,

    /// The framing of each decoded request not answered yet, oldest first. The dispatcher
    /// decodes the requests pipelined behind one before it answers it, and `decode` leaves
    /// `flags`, `version` and `conn_type` as the latest request's: a response head takes its
    /// own request's framing from here. One entry per request the dispatcher holds (being
    /// answered or queued), so bounded as its queue is.
    unanswered: VecDeque<Framing>,
}

impl Default for Codec {
    fn default() -> Self {
        Codec::new(ServiceConfig::default())
    }
}

impl fmt::Debug for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("h1::Codec")
            .field("flags", &self.flags)
            .finish_non_exhaustive()
    }
}

impl Codec {
    /// Create HTTP/1 codec.
    ///
    /// `keepalive_enabled` how response `connection` header get generated.
    pub fn new(config: ServiceConfig) -> Self {
        let flags = if config.keep_alive().enabled() {
            Flags::KEEP_ALIVE_ENABLED
        } else {
            Flags::empty()
        };

        Codec {
            config,
            flags,
            decoder: decoder::MessageDecoder::default(),
            payload: None,
            version: Version::HTTP_11,
            conn_type: ConnectionType::Close,
            encoder: encoder::MessageEncoder::default(),
            unanswered: VecDeque::new(),
        }
    }

    /// Check if request is upgrade.
    #[inline]
    pub fn upgrade(&self) -> bool {
        self.conn_type == ConnectionType::Upgrade
    }

    /// Check if last response is keep-alive.
    #[inline]
    pub fn keep_alive(&self) -> bool {
        self.conn_type == ConnectionType::KeepAlive
    }

    /// Check if keep-alive enabled on server level.
    #[inline]
    pub fn keep_alive_enabled(&self) -> bool {
        self.flags.contains(Flags::KEEP_ALIVE_ENABLED)
    }

    /// Check last request's message type.
    #[inline]
    pub fn message_type(&self) -> MessageType {
        if self.flags.contains(Flags::STREAM) {
            MessageType::Stream
        } else if self.payload.is_none() {
            MessageType::None
        } else {
            MessageType::Payload
        }
    }

    #[inline]
    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }
}

impl Decoder for Codec {
    type Item = Message<Request>;
    type Error = ParseError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Self::Item>, Self::Error> {
        if let Some(ref mut payload) = self.payload {
            Ok(match payload.decode(src)? {
                Some(PayloadItem::Chunk(chunk)) => Some(Message::Chunk(Some(chunk))),
                Some(PayloadItem::Eof) => {
                    self.payload.take();
                    Some(Message::Chunk(None))
                }
                None => None,
            })
        } else if let Some((req, payload)) = self.decoder.decode(src)? {
            let head = req.head();
            self.flags.set(Flags::HEAD, head.method == Method::HEAD);
            self.version = head.version;
            self.conn_type = head.connection_type();

            if self.conn_type == ConnectionType::KeepAlive
                && !self.flags.contains(Flags::KEEP_ALIVE_ENABLED)
            {
                self.conn_type = ConnectionType::Close
            }

            self.unanswered.push_back(Framing {
                head: self.flags.contains(Flags::HEAD),
                version: self.version,
                conn_type: self.conn_type,
            });

            match payload {
                PayloadType::None => self.payload = None,
                PayloadType::Payload(pl) => self.payload = Some(pl),
                PayloadType::Stream(pl) => {
                    self.payload = Some(pl);
                    self.flags.insert(Flags::STREAM);
                }
            }
            Ok(Some(Message::Item(req)))
        } else {
            Ok(None)
        }
    }
}

impl Encoder<Message<(Response<()>, BodySize)>> for Codec {
    type Error = io::Error;

    fn encode(
        &mut self,
        item: Message<(Response<()>, BodySize)>,
        dst: &mut BytesMut,
    ) -> Result<(), Self::Error> {
        match item {
            Message::Item((mut res, length)) => {
                // frame the response by its own request, not by one pipelined after it; a
                // response with no request (to a malformed one) keeps the latest state
                if let Some(framing) = self.unanswered.pop_front() {
                    self.flags.set(Flags::HEAD, framing.head);
                    self.version = framing.version;
                    self.conn_type = if self.flags.contains(Flags::CLOSE) {
                        ConnectionType::Close
                    } else {
                        framing.conn_type
                    };
                }

                // set response version
                res.head_mut().version = self.version;

                // connection status
                self.conn_type = if let Some(ct) = res.head().conn_type() {
                    if ct == ConnectionType::KeepAlive {
                        self.conn_type
                    } else {
                        ct
                    }
                } else {
                    self.conn_type
                };
                if self.conn_type == ConnectionType::Close {
                    self.flags.insert(Flags::CLOSE);
                }

                // encode message
                self.encoder.encode(
                    dst,
                    &mut res,
                    self.flags.contains(Flags::HEAD),
                    self.flags.contains(Flags::STREAM),
                    self.version,
                    length,
                    self.conn_type,
                    &self.config,
                )?;
            }

            Message::Chunk(Some(bytes)) => {
                self.encoder.encode_chunk(bytes.as_ref(), dst)?;
            }

            Message::Chunk(None) => {
                self.encoder.encode_eof(dst)?;
            }
        }

        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        header::{HeaderValue, UPGRADE},
        HttpMessage as _, StatusCode,
    };

    #[actix_rt::test]
    async fn upgrade_advertisement_preserves_keep_alive() {
        for (version, camel_case, connection) in [
            ("HTTP/1.1", false, "connection: upgrade\r\n"),
            ("HTTP/1.1", true, "Connection: Upgrade\r\n"),
            ("HTTP/1.0", false, "connection: keep-alive, upgrade\r\n"),
            ("HTTP/1.0", true, "Connection: keep-alive, upgrade\r\n"),
        ] {
            let mut codec = Codec::default();
            let mut request = BytesMut::from(
                format!("GET / {version}\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n")
                    .as_bytes(),
            );
            codec.decode(&mut request).unwrap().unwrap();

            let mut response = Response::with_body(StatusCode::OK, ());
            response.head_mut().set_camel_case_headers(camel_case);
            response
                .headers_mut()
                .insert(UPGRADE, HeaderValue::from_static("websocket"));

            let mut output = BytesMut::new();
            codec
                .encode(Message::Item((response, BodySize::Sized(0))), &mut output)
                .unwrap();
            let output = std::str::from_utf8(&output).unwrap();

            assert!(
                output.contains(connection),
                "missing {connection:?}: {output}"
            );
            assert!(codec.keep_alive());
        }
    }

    /// Encodes a `200 OK` with a 5-byte body (`hello`) and returns what went on the wire, with
    /// the date header left out.
    fn encode_response(codec: &mut Codec, conn_type: Option<ConnectionType>) -> String {
        let mut response = Response::with_body(StatusCode::OK, ());
        if let Some(conn_type) = conn_type {
            response.head_mut().set_connection_type(conn_type);
        }
        let mut output = BytesMut::new();
        codec
            .encode(Message::Item((response, BodySize::Sized(5))), &mut output)
            .unwrap();
        codec
            .encode(Message::Chunk(Some("hello".into())), &mut output)
            .unwrap();
        codec.encode(Message::Chunk(None), &mut output).unwrap();
        std::str::from_utf8(&output)
            .unwrap()
            .split("\r\n")
            .filter(|line| !line.starts_with("date: "))
            .collect::<Vec<_>>()
            .join("\r\n")
    }

    fn decode_all(codec: &mut Codec, requests: &str) {
        let mut buf = BytesMut::from(requests);
        while !buf.is_empty() {
            codec.decode(&mut buf).unwrap().unwrap();
        }
    }

    #[actix_rt::test]
    async fn pipelined_responses_are_framed_by_their_own_requests() {
        let mut codec = Codec::default();
        decode_all(
            &mut codec,
            "HEAD /a HTTP/1.1\r\nHost: localhost\r\n\r\n\
             GET /b HTTP/1.1\r\nHost: localhost\r\n\r\n\
             HEAD /c HTTP/1.1\r\nHost: localhost\r\n\r\n\
             GET /d HTTP/1.0\r\n\r\n",
        );

        // no body for the HEAD, though a GET was decoded after it
        assert_eq!(
            encode_response(&mut codec, None),
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
        );
        assert!(codec.keep_alive());
        // the GET's body, though a HEAD was decoded after it
        assert_eq!(
            encode_response(&mut codec, None),
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
        );
        assert!(codec.keep_alive());
        // HTTP/1.1 and keep-alive, though an HTTP/1.0 request was decoded after it
        assert_eq!(
            encode_response(&mut codec, None),
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
        );
        assert!(codec.keep_alive());
        assert_eq!(
            encode_response(&mut codec, None),
            "HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nhello"
        );
        assert!(!codec.keep_alive());
    }

    #[actix_rt::test]
    async fn pipelined_close_applies_to_its_own_response() {
        let mut codec = Codec::default();
        decode_all(
            &mut codec,
            "GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n\
             GET /b HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        );

        assert_eq!(
            encode_response(&mut codec, None),
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
        );
        assert!(codec.keep_alive());
        assert_eq!(
            encode_response(&mut codec, None),
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello"
        );
        assert!(!codec.keep_alive());
    }

    #[actix_rt::test]
    async fn a_response_that_closes_the_connection_closes_it_for_later_responses_too() {
        for (first, closed_by) in [
            (
                "GET /a HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
                None,
            ),
            (
                "GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n",
                Some(ConnectionType::Close),
            ),
        ] {
            let mut codec = Codec::default();
            decode_all(
                &mut codec,
                &format!("{first}GET /b HTTP/1.1\r\nHost: localhost\r\n\r\n"),
            );

            let close = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello";
            assert_eq!(encode_response(&mut codec, closed_by), close);
            assert_eq!(encode_response(&mut codec, None), close);
            assert!(!codec.keep_alive());
        }
    }

    #[actix_rt::test]
    async fn a_response_to_no_request_is_framed_by_the_latest_one() {
        // e.g. the `400` to a malformed request that follows a HEAD
        let mut codec = Codec::default();
        decode_all(&mut codec, "HEAD /a HTTP/1.1\r\nHost: localhost\r\n\r\n");
        let head = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n";
        assert_eq!(encode_response(&mut codec, None), head);
        assert_eq!(encode_response(&mut codec, None), head);

        // and before any request, as a new codec always did
        let mut codec = Codec::default();
        assert_eq!(
            encode_response(&mut codec, None),
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello"
        );
    }

    #[actix_rt::test]
    async fn test_http_request_chunked_payload_and_next_message() {
        let mut codec = Codec::default();

        let mut buf = BytesMut::from(
            "GET /test HTTP/1.1\r\n\
             Host: localhost\r\n\
             transfer-encoding: chunked\r\n\r\n",
        );
        let item = codec.decode(&mut buf).unwrap().unwrap();
        let req = item.message();

        assert_eq!(req.method(), Method::GET);
        assert!(req.chunked().unwrap());

        buf.extend(
            b"4\r\ndata\r\n4\r\nline\r\n0\r\n\r\n\
               POST /test2 HTTP/1.1\r\n\
               Host: localhost\r\n\
               transfer-encoding: chunked\r\n\r\n"
                .iter(),
        );

        let msg = codec.decode(&mut buf).unwrap().unwrap();
        assert_eq!(msg.chunk().as_ref(), b"data");

        let msg = codec.decode(&mut buf).unwrap().unwrap();
        assert_eq!(msg.chunk().as_ref(), b"line");

        let msg = codec.decode(&mut buf).unwrap().unwrap();
        assert!(msg.eof());

        // decode next message
        let item = codec.decode(&mut buf).unwrap().unwrap();
        let req = item.message();
        assert_eq!(*req.method(), Method::POST);
        assert!(req.chunked().unwrap());
    }

    #[actix_rt::test]
    async fn test_http_request_rejects_content_length_and_chunked() {
        let mut codec = Codec::default();
        let mut buf = BytesMut::from(
            "POST /test HTTP/1.1\r\n\
             Host: localhost\r\n\
             content-length: 11\r\n\
             transfer-encoding: chunked\r\n\r\n\
             0\r\n\r\n\
             GET /test2 HTTP/1.1\r\n\
             Host: localhost\r\n\r\n",
        );

        assert!(codec.decode(&mut buf).is_err());
    }
}
