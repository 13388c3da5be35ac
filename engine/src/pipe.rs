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
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use redis::{Cmd, RedisError, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

/// The socket: TCP, or a Unix socket (`redis+unix://`).
pub enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Stream {
    /// Its two halves: the reading one for the driver alone, the writing one shared.
    fn split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Tcp(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
            }
            Stream::Unix(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Unix(r), WriteHalf::Unix(w))
            }
        }
    }
}

/// Read through `AsyncRead`: a read that fills less than the room it was given ends the
/// socket's readiness there, so the driver waits for the next reply without a second
/// `recv` that would only say "nothing more" (`try_read` keeps the readiness until a read
/// fails with `WouldBlock`: a wasted system call per reply).
enum ReadHalf {
    Tcp(tokio::net::tcp::OwnedReadHalf),
    Unix(tokio::net::unix::OwnedReadHalf),
}

impl ReadHalf {
    /// Reads what the socket holds now, without waiting (`WouldBlock` when nothing). A
    /// `recv` of its own rather than tokio's `try_read`, which answers `WouldBlock`
    /// without asking the kernel until the reactor has seen the socket readable: on a
    /// worker too busy to poll the reactor, that is exactly what has not happened yet.
    /// Tokio copes with the bytes gone: its next read finds none and waits again.
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        let fd = match self {
            ReadHalf::Tcp(s) => s.as_ref().as_raw_fd(),
            ReadHalf::Unix(s) => s.as_ref().as_raw_fd(),
        };
        // SAFETY: `buf` is valid for writes of its length, and `fd` is an open socket this
        // half owns for as long as the call lasts.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self {
            ReadHalf::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            ReadHalf::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

enum WriteHalf {
    Tcp(tokio::net::tcp::OwnedWriteHalf),
    Unix(tokio::net::unix::OwnedWriteHalf),
}

impl WriteHalf {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(s) => s.try_write(buf),
            WriteHalf::Unix(s) => s.try_write(buf),
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            WriteHalf::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            WriteHalf::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
}

type Reply = oneshot::Sender<Result<Value, RedisError>>;

struct State {
    /// The socket's writing half: callers write with it under this lock.
    write: WriteHalf,
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
    state: Mutex<State>,
    /// The reading half and what it read: the driver's, and a caller's that checks for
    /// replies at its deadline ([`Pipe::read_now`]).
    reader: Mutex<Reader>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reader(&self) -> MutexGuard<'_, Reader> {
        self.reader.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answers the oldest waiting command with `value`.
    fn answer(&self, value: Value) -> Result<(), RedisError> {
        let tx = self.state().waiting.pop_front();
        match tx {
            Some(tx) => {
                let _ = tx.send(Ok(value));
                Ok(())
            }
            None => Err(protocol("a reply nobody asked for".into())),
        }
    }
}

struct Reader {
    read: ReadHalf,
    input: Input,
}

impl Reader {
    /// Answers every complete reply read so far.
    fn answer_complete(&mut self, shared: &Shared) -> Result<(), RedisError> {
        let input = &mut self.input;
        while let Some((value, used)) = parse(&input.buf[input.start..input.end])? {
            input.start += used;
            shared.answer(value)?;
        }
        Ok(())
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
        let (read, write) = stream.split();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                write,
                out: Vec::new(),
                waiting: VecDeque::new(),
                driver: None,
                ended: None,
                dropped: false,
            }),
            reader: Mutex::new(Reader {
                read,
                input: Input::default(),
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
                if let Ok(n) = s.write.try_write(&s.out) {
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

    /// Reads and answers the replies the socket holds now, without waiting for the
    /// driver task. A caller whose deadline has come calls it before giving up: on a
    /// worker too busy to have run the driver since the reply arrived, the reply is
    /// there, and the store was not late (see `gather`). A failure is left for the
    /// driver to meet and report.
    pub fn read_now(&self) {
        let shared = &self.0 .0;
        let mut reader = shared.reader();
        let reader = &mut *reader;
        loop {
            let n = match reader.read.try_read(reader.input.room()) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            reader.input.end += n;
            if reader.answer_complete(shared).is_err() {
                return;
            }
        }
    }
}

fn closed() -> RedisError {
    io::Error::new(io::ErrorKind::ConnectionAborted, "redis connection closed").into()
}

/// Writes what callers left in the buffer, reads and answers replies, until the socket
/// ends or fails (then fails every waiting command) or every handle is dropped.
async fn drive(shared: Arc<Shared>) -> RedisError {
    let r = poll_fn(|cx| poll_drive(&shared, cx)).await;
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

/// Bytes read and not parsed yet: `buf[start..end]`, in a buffer that grows only when a
/// reply does not fit it.
struct Input {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Default for Input {
    fn default() -> Input {
        Input {
            buf: vec![0; 16 * 1024],
            start: 0,
            end: 0,
        }
    }
}

impl Input {
    /// Room for the next read: the unparsed bytes moved to the front, and the buffer
    /// doubled when they fill it.
    fn room(&mut self) -> &mut [u8] {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        if self.end == self.buf.len() {
            self.buf.resize(2 * self.buf.len(), 0);
        }
        &mut self.buf[self.end..]
    }
}

fn poll_drive(shared: &Shared, cx: &mut Context<'_>) -> Poll<Result<(), RedisError>> {
    // Write what is left in the buffer.
    {
        let mut guard = shared.state();
        let s = &mut *guard;
        if s.dropped {
            return Poll::Ready(Ok(()));
        }
        if !s.driver.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            s.driver = Some(cx.waker().clone());
        }
        while !s.out.is_empty() {
            match s.write.poll_write(cx, &s.out) {
                Poll::Pending => break,
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::Error::from(io::ErrorKind::WriteZero).into()))
                }
                Poll::Ready(Ok(n)) => {
                    s.out.drain(..n);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
            }
        }
    }
    // Read and answer every complete reply.
    let mut reader = shared.reader();
    let reader = &mut *reader;
    loop {
        let mut room = ReadBuf::new(reader.input.room());
        match reader.read.poll_read(cx, &mut room) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
            Poll::Ready(Ok(())) => {}
        }
        let n = room.filled().len();
        if n == 0 {
            return Poll::Ready(Err(closed()));
        }
        reader.input.end += n;
        reader.answer_complete(shared)?;
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

    /// A real Redis behind the pipe: replies far larger than the read buffer, and many
    /// commands in flight at once, each answered with its own reply.
    /// A connection to `redis`, its driver spawned on this runtime.
    async fn connected(redis: &tollgate_testkit::RedisServer) -> Pipe {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", redis.port))
            .await
            .unwrap();
        let (pipe, driver) = Pipe::start(Stream::Tcp(tcp));
        tokio::spawn(driver);
        pipe
    }

    #[tokio::test]
    async fn replies_waiting_on_the_socket_are_read_by_a_caller_before_the_driver_runs() {
        // Arrange: a connection whose driver is on this (current-thread) runtime, and
        // three commands written.
        let redis = tollgate_testkit::RedisServer::start().unwrap();
        let pipe = connected(&redis).await;
        let mut pings: Vec<_> = (0..3)
            .map(|i| {
                let pipe = pipe.clone();
                Box::pin(async move {
                    let mut echo = redis::cmd("ECHO");
                    echo.arg(i);
                    pipe.send(&echo).await
                })
            })
            .collect();
        for p in &mut pings {
            assert!(futures_util::FutureExt::now_or_never(p.as_mut()).is_none());
        }

        // Act: the thread is held (Redis answers meanwhile; the driver cannot run), then
        // a caller reads what the socket holds.
        std::thread::sleep(std::time::Duration::from_millis(100));
        pipe.read_now();

        // Assert: every reply reached its own caller without the driver.
        for (i, p) in pings.iter_mut().enumerate() {
            let reply = futures_util::FutureExt::now_or_never(p.as_mut()).expect("answered");
            assert_eq!(
                reply.unwrap(),
                Value::BulkString(i.to_string().into_bytes())
            );
        }
        // And the driver carries on from there.
        let mut echo = redis::cmd("ECHO");
        echo.arg("next");
        assert_eq!(
            pipe.send(&echo).await.unwrap(),
            Value::BulkString(b"next".to_vec())
        );
    }

    #[tokio::test]
    async fn large_and_pipelined_replies_each_reach_their_own_caller() {
        let redis = tollgate_testkit::RedisServer::start().unwrap();
        let pipe = connected(&redis).await;

        // 100 kB: the 16 kB buffer must grow, and keep what it has read meanwhile.
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut set = redis::cmd("SET");
        set.arg("big").arg(&big[..]);
        assert_eq!(pipe.send(&set).await.unwrap(), Value::Okay);
        let mut get = redis::cmd("GET");
        get.arg("big");
        assert_eq!(
            pipe.send(&get).await.unwrap(),
            Value::BulkString(big.clone())
        );

        // 500 commands in flight, replies of different sizes: each caller gets its own.
        let sends = (0..500usize).map(|i| {
            let pipe = pipe.clone();
            async move {
                let mut echo = redis::cmd("ECHO");
                echo.arg(vec![b'x'; i * 37 % 3000]);
                (i, pipe.send(&echo).await.unwrap())
            }
        });
        for (i, reply) in futures_util::future::join_all(sends).await {
            assert_eq!(
                reply,
                Value::BulkString(vec![b'x'; i * 37 % 3000]),
                "command {i}"
            );
        }
        assert_eq!(pipe.send(&get).await.unwrap(), Value::BulkString(big));

        // 16 MB: more than the socket takes at once, so the caller's write is partial and
        // the driver writes the rest; the commands behind it wait their turn.
        let huge: Vec<u8> = (0..16u32 << 20).map(|i| (i % 253) as u8).collect();
        let mut set = redis::cmd("SET");
        set.arg("huge").arg(&huge[..]);
        let mut strlen = redis::cmd("STRLEN");
        strlen.arg("huge");
        let both = futures_util::future::join(pipe.send(&set), pipe.send(&strlen));
        let (set, len) = tokio::time::timeout(std::time::Duration::from_secs(30), both)
            .await
            .expect("the driver writes what the caller's write left");
        assert_eq!(set.unwrap(), Value::Okay);
        assert_eq!(len.unwrap(), Value::Int(16 << 20));
    }

    #[test]
    fn unparsed_bytes_move_to_the_front_and_the_buffer_grows_only_when_they_fill_it() {
        let mut input = Input::default();
        let size = input.buf.len();
        assert_eq!(input.room().len(), size);
        // Full, with the first 10 bytes parsed: they make room.
        input.buf[10] = b'a';
        (input.start, input.end) = (10, size);
        assert_eq!(input.room().len(), 10);
        assert_eq!((input.start, input.end, input.buf[0]), (0, size - 10, b'a'));
        // Full of one unparsed reply: twice the size.
        (input.start, input.end) = (0, size);
        assert_eq!(input.room().len(), size);
        // All parsed: from the front again.
        (input.start, input.end) = (5, 5);
        assert_eq!(input.room().len(), 2 * size);
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
