//! Deadlines on a connection's reads and writes, so that a peer that goes quiet (before its
//! handshake, between requests, or instead of reading a reply) cannot hold a connection, its
//! buffers and the objects a reply references for ever.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use kvpool::protocol::Limits;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// How long a connection may take at each stage, what it may send before the handshake, and
/// what it may hold and map after it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnPolicy {
    /// Limits until the `Hello` is accepted: a small header, no payload.
    pub(crate) hello_limits: Limits,
    /// From accept to the end of the `Hello` header.
    pub(crate) handshake: Duration,
    /// Longest wait for the next request of an authenticated connection; `None`: no limit.
    pub(crate) idle: Option<Duration>,
    /// Longest a write may make no progress (the peer is not reading).
    pub(crate) write: Duration,
    /// Longest a request's bytes may stop arriving once its first byte has (the peer stalls
    /// in the middle of a frame or a payload).
    pub(crate) read: Duration,
    /// Most objects one connection may hold (`Hold`) at once.
    pub(crate) max_holds: usize,
    /// Most keys and prefixes one connection may watch at once.
    pub(crate) max_watches: usize,
    /// Most allocations one connection may have pending at once.
    pub(crate) max_pending: usize,
    /// Which segments same-host writers map read-only (`memory.same_host_writes`).
    pub(crate) same_host_writes: crate::staging::Policy,
}

/// Runs `f`, failing with `TimedOut` if it has not finished by `deadline` (`None`: no deadline).
pub(crate) async fn within<T, E: From<io::Error>>(
    deadline: Option<Instant>,
    f: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    match deadline {
        None => f.await,
        Some(d) => tokio::time::timeout_at(d, f)
            .await
            .unwrap_or_else(|_| Err(io::Error::from(io::ErrorKind::TimedOut).into())),
    }
}

/// A writer whose every write, flush and shutdown must make progress within `limit`: one that
/// stays blocked longer (the peer stopped reading) fails with `TimedOut`, and so does every
/// later call, so the connection closes and whatever the pending reply referenced is released.
pub(crate) struct StallLimit<W> {
    inner: W,
    limit: Duration,
    /// Armed while a call is blocked; its deadline is `limit` after the call first blocked.
    timer: Pin<Box<Sleep>>,
    armed: bool,
    expired: bool,
}

impl<W> StallLimit<W> {
    pub(crate) fn new(inner: W, limit: Duration) -> StallLimit<W> {
        StallLimit {
            inner,
            limit,
            timer: Box::pin(tokio::time::sleep(limit)),
            armed: false,
            expired: false,
        }
    }
}

impl<W: AsyncWrite + Unpin> StallLimit<W> {
    fn guard<T>(
        &mut self,
        cx: &mut Context<'_>,
        op: impl FnOnce(Pin<&mut W>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if self.expired {
            return Poll::Ready(Err(stalled()));
        }
        match op(Pin::new(&mut self.inner), cx) {
            Poll::Ready(r) => {
                self.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => {
                if !self.armed {
                    self.armed = true;
                    let at = Instant::now() + self.limit;
                    self.timer.as_mut().reset(at);
                }
                match self.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        self.expired = true;
                        Poll::Ready(Err(stalled()))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

/// A reader that, while armed (a request has started arriving), fails any read making no
/// progress for `limit` with `TimedOut`, so a peer that sends half a frame or half a payload and
/// stops cannot hold its connection, buffers and pending allocation for ever. Disarmed (between
/// requests) it waits as long as the connection's idle policy allows.
pub(crate) struct ReadStall<R> {
    inner: R,
    limit: Duration,
    timer: Pin<Box<Sleep>>,
    /// A request is being read.
    in_request: bool,
    /// The timer runs: a read blocked since it was set.
    running: bool,
}

impl<R> ReadStall<R> {
    pub(crate) fn new(inner: R, limit: Duration) -> ReadStall<R> {
        ReadStall {
            inner,
            limit,
            timer: Box::pin(tokio::time::sleep(limit)),
            in_request: false,
            running: false,
        }
    }

    /// Arms (a request's first byte arrived) or disarms (waiting for the next request).
    pub(crate) fn in_request(&mut self, on: bool) {
        self.in_request = on;
        self.running = false;
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for ReadStall<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.running = false;
                Poll::Ready(r)
            }
            Poll::Pending if !this.in_request => Poll::Pending,
            Poll::Pending => {
                if !this.running {
                    this.running = true;
                    let at = Instant::now() + this.limit;
                    this.timer.as_mut().reset(at);
                }
                match this.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer stopped sending in the middle of a request",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

fn stalled() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the peer stopped reading")
}

impl<W: AsyncWrite + Unpin> AsyncWrite for StallLimit<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().guard(cx, |w, cx| w.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .guard(cx, |w, cx| w.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().guard(cx, |w, cx| w.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().guard(cx, |w, cx| w.poll_shutdown(cx))
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_request_that_stops_arriving_fails_after_the_limit_and_idling_never_does() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut r = ReadStall::new(a, Duration::from_secs(5));
        // Disarmed: waiting for the next request takes as long as it takes.
        let mut one = [0u8; 1];
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            b.write_all(b"x").await.unwrap();
            b
        });
        r.read_exact(&mut one).await.unwrap();
        let mut b = late.await.unwrap();
        // Armed: progress keeps it alive, however long the request takes in all.
        r.in_request(true);
        let writer = tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                b.write_all(b"y").await.unwrap();
            }
            b
        });
        let mut ten = [0u8; 10];
        r.read_exact(&mut ten).await.unwrap();
        assert_eq!(&ten, b"yyyyyyyyyy");
        let _b = writer.await.unwrap();
        // ... and 5 s without a byte ends it.
        let start = Instant::now();
        let e = r.read_exact(&mut one).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        // Disarmed again: no limit.
        r.in_request(false);
        let waited = tokio::time::timeout(Duration::from_secs(60), r.read_exact(&mut one)).await;
        assert!(waited.is_err(), "a disarmed read timed out by itself");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_nobody_reads_fails_after_the_limit_and_progress_resets_it() {
        let (a, mut b) = tokio::io::duplex(16);
        let mut w = StallLimit::new(a, Duration::from_secs(5));
        // Progress keeps it alive however long it takes in all.
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 8];
            while got.len() < 64 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                let n = b.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            (got, b)
        });
        w.write_all(&[1u8; 64]).await.unwrap();
        let (got, b) = reader.await.unwrap();
        assert_eq!(got, vec![1u8; 64]);
        // Nobody reads: the write fails once it has been blocked for the limit, and stays failed.
        let start = Instant::now();
        let err = w.write_all(&[2u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= Duration::from_secs(5));
        assert_eq!(w.flush().await.unwrap_err().kind(), io::ErrorKind::TimedOut);
        drop(b);
    }

    #[tokio::test(start_paused = true)]
    async fn within_times_out_only_with_a_deadline() {
        let never = std::future::pending::<io::Result<()>>();
        let at = Instant::now() + Duration::from_secs(1);
        let err = within(Some(at), never).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(within(None, async { io::Result::Ok(3) }).await.unwrap(), 3);
    }
}
