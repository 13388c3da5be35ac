//! HTTP/2 protocol.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use actix_codec::{AsyncRead, AsyncWrite};
use bytes::Bytes;
use futures_core::{ready, Stream};
use h2::{
    server::{Builder, Connection, Handshake},
    RecvStream,
};
use tokio::time::{sleep_until, Sleep};

use crate::{
    config::ServiceConfig,
    error::{DispatchError, PayloadError},
};

mod dispatcher;
mod service;

pub use self::{dispatcher::Dispatcher, service::H2Service};

/// HTTP/2 peer stream.
pub struct Payload {
    stream: RecvStream,
}

impl Payload {
    pub(crate) fn new(stream: RecvStream) -> Self {
        Self { stream }
    }
}

impl Stream for Payload {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();

        match ready!(Pin::new(&mut this.stream).poll_data(cx)) {
            Some(Ok(chunk)) => {
                let len = chunk.len();

                match this.stream.flow_control().release_capacity(len) {
                    Ok(()) => Poll::Ready(Some(Ok(chunk))),
                    Err(err) => Poll::Ready(Some(Err(err.into()))),
                }
            }
            Some(Err(err)) => Poll::Ready(Some(Err(err.into()))),
            None => Poll::Ready(None),
        }
    }
}

/// tollgate: streams one connection may have open at once (nginx's
/// `http2_max_concurrent_streams` default); h2 sets no limit. A client past it gets
/// `REFUSED_STREAM` for the excess.
pub const MAX_CONCURRENT_STREAMS: u32 = 128;

/// tollgate: the largest header list (decoded, with h2's 32 bytes per field) a request may
/// have; h2 allows 16 MiB. It also bounds the CONTINUATION frames of one header block.
pub const MAX_HEADER_LIST_SIZE: u32 = 64 * 1024;

/// tollgate: streams a client may reset before the server has accepted them (rapid
/// reset, CVE-2023-44487), past which the connection is closed with `ENHANCE_YOUR_CALM`;
/// h2's default, stated.
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;

/// tollgate: streams the server may reset for a client's protocol errors before it closes
/// the connection (h2's default, stated).
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// tollgate: bytes buffered per stream for a client that does not read (h2's default,
/// stated): with `MAX_CONCURRENT_STREAMS` it bounds one connection's send buffers.
pub const MAX_SEND_BUFFER_SIZE: usize = 400 * 1024;

pub(crate) fn handshake_with_timeout<T>(io: T, config: &ServiceConfig) -> HandshakeWithTimeout<T>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut builder = Builder::new();
    builder
        .initial_window_size(config.h2_initial_window_size())
        .initial_connection_window_size(config.h2_initial_connection_window_size())
        // tollgate: the limits h2 leaves open by default (PATCHES.md, "HTTP/2 limits").
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST_SIZE)
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .max_send_buffer_size(MAX_SEND_BUFFER_SIZE);

    HandshakeWithTimeout {
        handshake: builder.handshake(io),
        timer: config
            .client_request_deadline()
            .map(|deadline| Box::pin(sleep_until(deadline.into()))),
    }
}

pub(crate) struct HandshakeWithTimeout<T: AsyncRead + AsyncWrite + Unpin> {
    handshake: Handshake<T>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl<T> Future for HandshakeWithTimeout<T>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    type Output = Result<(Connection<T, Bytes>, Option<Pin<Box<Sleep>>>), DispatchError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();

        match Pin::new(&mut this.handshake).poll(cx)? {
            // return the timer on success handshake; its slot can be re-used for h2 ping-pong
            Poll::Ready(conn) => Poll::Ready(Ok((conn, this.timer.take()))),
            Poll::Pending => match this.timer.as_mut() {
                Some(timer) => {
                    ready!(timer.as_mut().poll(cx));
                    Poll::Ready(Err(DispatchError::SlowRequestTimeout))
                }
                None => Poll::Pending,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use static_assertions::assert_impl_all;

    use super::*;

    assert_impl_all!(Payload: Unpin, Send, Sync);
}
