//! The request path's connection to one Redis server: commands written on the caller's
//! thread, replies read in order by one task beside them.
//!
//! redis-rs's multiplexed connection sends each command through a channel to a driver
//! task, which writes it and parses every reply into a `Value` tree. On the request path
//! that hop and its bookkeeping were a large part of the gateway's cost per decision. Here
//! a command is packed into the connection's write buffer and written at once with a
//! non-blocking write (the driver finishes a write the socket could not take whole), and
//! its reply slot joins a FIFO. The driver reads, parses each complete reply and answers
//! the oldest slot: Redis answers the commands of one connection in the order it got them.
//!
//! It speaks RESP2 only (no `HELLO 3`), which is all `EVALSHA` and `SCRIPT LOAD` need.
//! When the socket ends or fails, every command waiting on it and every later one fails
//! with an I/O error, and the connection's health says so (see `pool`).

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use redis::{Cmd, RedisError, Value};
use tokio::sync::oneshot;

/// The socket: TCP, or a Unix socket (`redis+unix://`).
pub enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Stream {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.try_write(buf),
            Stream::Unix(s) => s.try_write(buf),
        }
    }

    fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.try_read_buf(buf),
            Stream::Unix(s) => s.try_read_buf(buf),
        }
    }

    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Stream::Tcp(s) => s.poll_read_ready(cx),
            Stream::Unix(s) => s.poll_read_ready(cx),
        }
    }

    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Stream::Tcp(s) => s.poll_write_ready(cx),
            Stream::Unix(s) => s.poll_write_ready(cx),
        }
    }
}

type Reply = oneshot::Sender<Result<Value, RedisError>>;

struct State {
    /// Packed commands the socket has not taken yet.
    out: Vec<u8>,
    /// One slot per command written or buffered, oldest first.
    waiting: VecDeque<Reply>,
    /// The driver, to wake when `out` needs it or every handle is gone.
    driver: Option<Waker>,
    /// Why the connection ended; every command from then on fails with it.
    ended: Option<RedisError>,
    /// Every [`Pipe`] is gone: nobody can send on it again.
    dropped: bool,
}

struct Shared {
    stream: Stream,
    state: Mutex<State>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Closes the connection when the last [`Pipe`] goes.
struct Handle(Arc<Shared>);

impl Drop for Handle {
    fn drop(&mut self) {
        let mut s = self.0.state();
        s.dropped = true;
        if let Some(w) = s.driver.take() {
            w.wake();
        }
    }
}

/// One pipelined connection. Cloning it is cheap; the socket closes when the last clone
/// is dropped.
#[derive(Clone)]
pub struct Pipe(Arc<Handle>);

impl Pipe {
    /// Starts the connection's driver on the current runtime; the returned future ends
    /// when the connection does, with why.
    pub fn start(stream: Stream) -> (Pipe, impl std::future::Future<Output = RedisError>) {
        let shared = Arc::new(Shared {
            stream,
            state: Mutex::new(State {
                out: Vec::new(),
                waiting: VecDeque::new(),
                driver: None,
                ended: None,
                dropped: false,
            }),
        });
        let driver = drive(Arc::clone(&shared));
        (Pipe(Arc::new(Handle(shared))), driver)
    }

    /// Sends `cmd` and waits for its reply (an error reply is a `Value::ServerError`).
    pub async fn send(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        let shared = &self.0 .0;
        let (tx, rx) = oneshot::channel();
        {
            let mut s = shared.state();
            if let Some(e) = &s.ended {
                return Err(e.clone());
            }
            let idle = s.out.is_empty();
            cmd.write_packed_command(&mut s.out);
            s.waiting.push_back(tx);
            if idle {
                // Written from here: no hop to the driver. What the socket does not take
                // (or an error) is the driver's to deal with.
                if let Ok(n) = shared.stream.try_write(&s.out) {
                    if n == s.out.len() {
                        s.out.clear();
                    } else {
                        s.out.drain(..n);
                    }
                }
            }
            if !s.out.is_empty() {
                if let Some(w) = s.driver.take() {
                    w.wake();
                }
            }
        }
        rx.await.unwrap_or_else(|_| Err(closed()))
    }
}

fn closed() -> RedisError {
    io::Error::new(io::ErrorKind::ConnectionAborted, "redis connection closed").into()
}

/// Writes what callers left in the buffer, reads and answers replies, until the socket
/// ends or fails (then fails every waiting command) or every handle is dropped.
async fn drive(shared: Arc<Shared>) -> RedisError {
    let mut input: Vec<u8> = Vec::with_capacity(16 * 1024);
    let mut start = 0;
    let r = poll_fn(|cx| poll_drive(&shared, cx, &mut input, &mut start)).await;
    let e = match r {
        Ok(()) => closed(),
        Err(e) => e,
    };
    let waiting = {
        let mut s = shared.state();
        s.ended = Some(e.clone());
        s.out.clear();
        std::mem::take(&mut s.waiting)
    };
    for tx in waiting {
        let _ = tx.send(Err(e.clone()));
    }
    e
}

fn poll_drive(
    shared: &Shared,
    cx: &mut Context<'_>,
    input: &mut Vec<u8>,
    start: &mut usize,
) -> Poll<Result<(), RedisError>> {
    // Write what is left in the buffer.
    {
        let mut s = shared.state();
        if s.dropped {
            return Poll::Ready(Ok(()));
        }
        if !s.driver.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            s.driver = Some(cx.waker().clone());
        }
        while !s.out.is_empty() {
            match shared.stream.poll_write_ready(cx) {
                Poll::Pending => break,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Ready(Ok(())) => {}
            }
            match shared.stream.try_write(&s.out) {
                Ok(0) => return Poll::Ready(Err(io::Error::from(io::ErrorKind::WriteZero).into())),
                Ok(n) => {
                    s.out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }
    // Read and answer every complete reply.
    loop {
        match shared.stream.poll_read_ready(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
            Poll::Ready(Ok(())) => {}
        }
        if input.capacity() - input.len() < 4096 {
            input.reserve(16 * 1024);
        }
        match shared.stream.try_read_buf(input) {
            Ok(0) => return Poll::Ready(Err(closed())),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Poll::Ready(Err(e.into())),
        }
        while let Some((value, used)) = parse(&input[*start..])? {
            *start += used;
            let tx = shared.state().waiting.pop_front();
            match tx {
                Some(tx) => {
                    let _ = tx.send(Ok(value));
                }
                None => {
                    return Poll::Ready(Err(protocol("a reply nobody asked for".into())));
                }
            }
        }
        if *start == input.len() {
            input.clear();
            *start = 0;
        } else if *start > input.len() / 2 {
            input.drain(..*start);
            *start = 0;
        }
    }
}

fn protocol(detail: String) -> RedisError {
    RedisError::from((redis::ErrorKind::Parse, "invalid reply from redis", detail))
}

/// One complete RESP2 reply at the start of `buf` and its length, `None` if it is not all
/// there yet.
fn parse(buf: &[u8]) -> Result<Option<(Value, usize)>, RedisError> {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let Some((&kind, line)) = buf[..eol].split_first() else {
        return Err(protocol("an empty line".into()));
    };
    let next = eol + 2;
    let number = || -> Result<i64, RedisError> {
        std::str::from_utf8(line)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| protocol(format!("not a number: {:?}", String::from_utf8_lossy(line))))
    };
    match kind {
        b'+' => {
            let v = match line {
                b"OK" => Value::Okay,
                _ => Value::SimpleString(String::from_utf8_lossy(line).into_owned()),
            };
            Ok(Some((v, next)))
        }
        // redis-rs knows the error codes (`NOSCRIPT`, ...): its parser makes the value.
        b'-' => Ok(Some((redis::parse_redis_value(&buf[..next])?, next))),
        b':' => Ok(Some((Value::Int(number()?), next))),
        b'$' => {
            let len = number()?;
            if len < 0 {
                return Ok(Some((Value::Nil, next)));
            }
            let end = next + len as usize;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            Ok(Some((Value::BulkString(buf[next..end].to_vec()), end + 2)))
        }
        b'*' => {
            let len = number()?;
            if len < 0 {
                return Ok(Some((Value::Nil, next)));
            }
            let mut items = Vec::with_capacity((len as usize).min(1024));
            let mut at = next;
            for _ in 0..len {
                match parse(&buf[at..])? {
                    Some((v, used)) => {
                        items.push(v);
                        at += used;
                    }
                    None => return Ok(None),
                }
            }
            Ok(Some((Value::Array(items), at)))
        }
        other => Err(protocol(format!("unknown reply type {:?}", other as char))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(bytes: &[u8]) -> Value {
        let (v, used) = parse(bytes).unwrap().expect("complete");
        assert_eq!(used, bytes.len());
        v
    }

    #[test]
    fn replies_parse_as_redis_rs_parses_them() {
        for bytes in [
            &b"+OK\r\n"[..],
            b"+PONG\r\n",
            b":-42\r\n",
            b"$-1\r\n",
            b"$0\r\n\r\n",
            b"$5\r\nhe\r\no\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*3\r\n$2\r\n17\r\n$0\r\n\r\n*2\r\n:1\r\n$3\r\n\x00\x01\x02\r\n",
        ] {
            assert_eq!(whole(bytes), redis::parse_redis_value(bytes).unwrap());
        }
    }

    #[test]
    fn an_error_reply_keeps_its_code() {
        let v = whole(b"-NOSCRIPT No matching script\r\n");
        let e = v.extract_error().unwrap_err();
        assert_eq!(e.code(), Some("NOSCRIPT"));
    }

    #[test]
    fn a_reply_cut_anywhere_waits_for_the_rest() {
        let bytes = b"*2\r\n$5\r\nhello\r\n:7\r\n";
        for cut in 0..bytes.len() {
            assert!(parse(&bytes[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        assert!(parse(b"?x\r\n").is_err());
    }
}
