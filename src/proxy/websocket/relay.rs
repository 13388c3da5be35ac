//! An upgraded connection relayed both ways, as the body of the client's `101`.
//!
//! actix-http hands a WebSocket upgrade's request body to the service as the raw bytes that
//! follow its head, until the client's connection ends, and writes a `101`'s streamed body
//! raw (no chunking) after its head: so the client's side is the request's `Payload` and
//! this body, and the dispatcher keeps owning the client's socket. [`Relay`] is that body.
//! Each time the dispatcher asks it for the next bytes for the client it also moves the
//! client's bytes on to the service, so one task drives both ways, and nothing more than one
//! chunk waits in each direction: the client's next chunk is read only once the last one is
//! written to the service (the `Payload` holds at most 32 KiB before actix stops reading the
//! socket), and the service's next bytes are read only when the dispatcher wants more for
//! the client (it stops at 32 KiB unwritten).
//!
//! It ends when the service's connection ends (the dispatcher then closes the client's after
//! a bounded linger, see `proxy::edge`). When the client's side ends (its Close frame has
//! gone on already, or it shut its socket's write half), the service's write half is shut
//! too, and the relay goes on until the service ends its side: half-closes are passed on.
//!
//! Closing (idle for `upstream.websocket_idle_timeout_ms`, or the gateway stopping): each
//! way is followed frame by frame ([`FrameCursor`]: headers only), and at its next frame
//! boundary a Close `1001` (going away) is sent there instead of what follows, to the
//! client unmasked, to the service masked as a client's must be. Then the relay waits for
//! the service to close its connection, at most [`Relays::close_wait`], and ends.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use actix_web::dev::Payload;
use bytes::{Buf, Bytes, BytesMut};
use futures_util::Stream;
use tokio::io::AsyncWrite;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::frames::{close_frame, FrameCursor, GOING_AWAY};
use super::handshake::UpstreamIo;
use super::relays::{Relays, Slot};

/// How much is read from the service at a time.
const READ_CHUNK: usize = 16 * 1024;

/// The body of a `101`: see the module's doc.
pub(super) struct Relay {
    client: Payload,
    upstream: UpstreamIo,
    /// Bytes for the client before anything read from the service: what came after its
    /// `101` head, or a Close of the gateway's.
    to_client: Option<Bytes>,
    /// The client's chunk being written to the service.
    to_upstream: Bytes,
    read_buf: BytesMut,
    /// Frames each way, followed only while closing matters (always: it is cheap).
    up_frames: FrameCursor,
    down_frames: FrameCursor,
    /// The client's side has ended; `upstream_shut`: the service's write half is shut.
    client_done: bool,
    upstream_shut: bool,
    /// Closing: since the gateway's Close went each way.
    closing: bool,
    close_sent_up: bool,
    close_sent_down: bool,
    finished: bool,
    /// The idle deadline, or while closing the end of the wait for the service.
    timer: Pin<Box<Sleep>>,
    last_activity: Instant,
    stopping: Pin<Box<WaitForCancellationFutureOwned>>,
    service: Arc<str>,
    /// The client's connection slot, given back when the relay ends; its relays.
    slot: Slot,
}

impl Relay {
    pub(super) fn new(
        client: Payload,
        upstream: UpstreamIo,
        rest: Bytes,
        service: Arc<str>,
        slot: Slot,
    ) -> Relay {
        let relays = slot.relays();
        relays.metrics().websockets.opened(&service);
        let now = Instant::now();
        let mut down_frames = FrameCursor::default();
        down_frames.advance(&rest, false);
        Relay {
            client,
            upstream,
            to_client: (!rest.is_empty()).then_some(rest),
            to_upstream: Bytes::new(),
            read_buf: BytesMut::new(),
            up_frames: FrameCursor::default(),
            down_frames,
            client_done: false,
            upstream_shut: false,
            closing: false,
            close_sent_up: false,
            close_sent_down: false,
            finished: false,
            timer: Box::pin(tokio::time::sleep_until(now + relays.idle_timeout())),
            last_activity: now,
            stopping: Box::pin(relays.closing().clone().cancelled_owned()),
            service,
            slot,
        }
    }

    fn relays(&self) -> &Relays {
        self.slot.relays()
    }

    /// From now on, a Close at each way's next frame boundary, then the wait for the service.
    fn begin_close(&mut self) {
        self.closing = true;
        let wait = self.relays().close_wait();
        self.timer.as_mut().reset(Instant::now() + wait);
    }

    /// Watches the stop and the timer: `true` when the relay is over.
    fn poll_timers(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.closing && self.stopping.as_mut().poll(cx).is_ready() {
            self.begin_close();
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            if self.closing {
                return true;
            }
            let due = self.last_activity + self.relays().idle_timeout();
            if due <= Instant::now() {
                self.begin_close();
            } else {
                self.timer.as_mut().reset(due);
            }
        }
        false
    }

    /// Moves the client's bytes to the service until one side has to wait. An error: the
    /// service's connection failed.
    fn pump_up(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        loop {
            if !self.to_upstream.is_empty() {
                match Pin::new(&mut self.upstream).poll_write(cx, &self.to_upstream) {
                    Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                    Poll::Ready(Ok(n)) => {
                        self.to_upstream.advance(n);
                        self.last_activity = Instant::now();
                        continue;
                    }
                    Poll::Ready(Err(e)) => return Err(e),
                    Poll::Pending => return Ok(()),
                }
            }
            if self.closing && !self.close_sent_up && self.up_frames.at_boundary() {
                self.close_sent_up = true;
                self.to_upstream = close_frame(GOING_AWAY, Some(rand::random()));
                continue;
            }
            if self.client_done {
                if !self.upstream_shut {
                    match Pin::new(&mut self.upstream).poll_shutdown(cx) {
                        Poll::Ready(_) => self.upstream_shut = true,
                        Poll::Pending => return Ok(()),
                    }
                }
                return Ok(());
            }
            match Pin::new(&mut self.client).poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    self.last_activity = Instant::now();
                    if self.close_sent_up {
                        // Nothing may follow the gateway's Close (RFC 6455 §5.5.1).
                        continue;
                    }
                    let followed = self.up_frames.advance(&chunk, self.closing);
                    self.to_upstream = chunk.slice(..followed);
                }
                // Its end, or a client that broke its connection off: the same to the
                // service.
                Poll::Ready(Some(Err(_)) | None) => self.client_done = true,
                Poll::Pending => return Ok(()),
            }
        }
    }

    /// The service's next bytes for the client, when there are any.
    fn pump_down(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        loop {
            if self.read_buf.capacity() < READ_CHUNK / 2 {
                self.read_buf.reserve(READ_CHUNK);
            }
            let read =
                tokio_util::io::poll_read_buf(Pin::new(&mut self.upstream), cx, &mut self.read_buf);
            match read {
                Poll::Ready(Ok(0)) => return Poll::Ready(None),
                Poll::Ready(Ok(_)) => {
                    self.last_activity = Instant::now();
                    let chunk = self.read_buf.split().freeze();
                    if self.close_sent_down {
                        continue;
                    }
                    let followed = self.down_frames.advance(&chunk, self.closing);
                    if followed > 0 {
                        return Poll::Ready(Some(chunk.slice(..followed)));
                    }
                    if self.closing {
                        self.close_sent_down = true;
                        return Poll::Ready(Some(close_frame(GOING_AWAY, None)));
                    }
                }
                Poll::Ready(Err(e)) => {
                    tracing::debug!(service = %self.service, error = %e, "websocket: the service's connection failed");
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if self.closing && !self.close_sent_down && self.down_frames.at_boundary() {
                        self.close_sent_down = true;
                        return Poll::Ready(Some(close_frame(GOING_AWAY, None)));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl MessageBody for Relay {
    type Error = io::Error;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, io::Error>>> {
        let this = self.get_mut();
        if let Some(first) = this.to_client.take() {
            return Poll::Ready(Some(Ok(first)));
        }
        if this.finished || this.poll_timers(cx) {
            this.finished = true;
            return Poll::Ready(None);
        }
        if let Err(e) = this.pump_up(cx) {
            tracing::debug!(service = %this.service, error = %e, "websocket: the service's connection failed");
            this.finished = true;
            return Poll::Ready(None);
        }
        match this.pump_down(cx) {
            Poll::Ready(Some(bytes)) => Poll::Ready(Some(Ok(bytes))),
            Poll::Ready(None) => {
                this.finished = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.relays().metrics().websockets.closed(&self.service);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::metrics::Metrics;

    /// A relay whose client sends nothing, over a real connection to a "service" (the
    /// other end, returned).
    async fn relay() -> (Relay, TcpStream, Relays) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (service, _) = listener.accept().await.unwrap();
        let relays = Relays::new(
            Duration::from_secs(60),
            Duration::from_secs(30),
            Arc::new(Metrics::default()),
        );
        let slot = relays.take("acme", None).unwrap();
        let nothing: actix_http::BoxedPayloadStream = Box::pin(futures_util::stream::pending());
        let client = Payload::Stream { payload: nothing };
        let upstream = UpstreamIo::Plain(upstream);
        let relay = Relay::new(client, upstream, Bytes::new(), Arc::from("chat"), slot);
        (relay, service, relays)
    }

    /// The relay's next bytes for the client, or `None` if it has none within 200 ms.
    async fn next_out(relay: &mut Relay) -> Option<Option<Bytes>> {
        let next = std::future::poll_fn(|cx| Pin::new(&mut *relay).poll_next(cx));
        tokio::time::timeout(Duration::from_millis(200), next)
            .await
            .ok()
            .map(|r| r.map(|b| b.unwrap()))
    }

    #[tokio::test]
    async fn a_stop_mid_frame_closes_the_client_at_the_frame_end_and_the_service_at_once() {
        // Arrange: the service has sent 4 bytes of a frame of 10.
        let (mut relay, mut service, relays) = relay().await;
        service.write_all(&[0x82, 10, 1, 2, 3, 4]).await.unwrap();
        assert_eq!(
            next_out(&mut relay).await,
            Some(Some(Bytes::from_static(&[0x82, 10, 1, 2, 3, 4])))
        );

        // Act: the gateway stops.
        relays.close_all();

        // Assert: nothing for the client until the frame ends: then its rest, and a Close
        // 1001 instead of the next frame; the service gets a masked Close 1001 at once.
        assert_eq!(next_out(&mut relay).await, None, "no Close mid-frame");
        let mut close = [0u8; 8];
        service.read_exact(&mut close).await.unwrap();
        assert_eq!(close[..2], [0x88, 0x82]);
        let code = [close[6] ^ close[2], close[7] ^ close[3]];
        assert_eq!(u16::from_be_bytes(code), GOING_AWAY);
        service
            .write_all(&[5, 6, 7, 8, 9, 10, 0x81, 1, b'x'])
            .await
            .unwrap();
        assert_eq!(
            next_out(&mut relay).await,
            Some(Some(Bytes::from_static(&[5, 6, 7, 8, 9, 10])))
        );
        assert_eq!(
            next_out(&mut relay).await,
            Some(Some(close_frame(GOING_AWAY, None)))
        );
        // The service answers the Close and ends the connection: so does the relay.
        service.write_all(&[0x88, 0x02, 0x03, 0xe9]).await.unwrap();
        drop(service);
        assert_eq!(next_out(&mut relay).await, Some(None));
    }
}
