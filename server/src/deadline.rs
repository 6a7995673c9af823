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
    /// The wire limits of an authenticated connection.
    pub(crate) limits: Limits,
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
///
/// Over TCP a large payload is read with the socket's low-water mark raised
/// ([`LowWater`](kvpool::protocol::io::LowWater)), so a read may wait while bytes do arrive,
/// slowly; with the socket given ([`ReadStall::on_socket`]), a read whose timer runs out while
/// more bytes were queued than when it was set is given another `limit` instead of failing. So
/// it is still the bytes that must stop arriving, not the reads returning.
pub(crate) struct ReadStall<R> {
    inner: R,
    limit: Duration,
    timer: Pin<Box<Sleep>>,
    /// A request is being read.
    in_request: bool,
    /// The timer runs: a read blocked since it was set.
    running: bool,
    /// The TCP socket under `inner`, open as long as `inner` is.
    socket: Option<std::os::fd::RawFd>,
    /// Bytes queued on `socket` when the timer was last set.
    queued: usize,
}

impl<R> ReadStall<R> {
    pub(crate) fn new(inner: R, limit: Duration) -> ReadStall<R> {
        ReadStall {
            inner,
            limit,
            timer: Box::pin(tokio::time::sleep(limit)),
            in_request: false,
            running: false,
            socket: None,
            queued: 0,
        }
    }

    /// The TCP socket under the reader (owned by it), whose queue tells a slow peer from one
    /// that stopped while a raised low-water mark keeps reads waiting.
    pub(crate) fn on_socket(mut self, socket: Option<std::os::fd::RawFd>) -> ReadStall<R> {
        self.socket = socket;
        self
    }

    /// Bytes queued on the socket now (0 without one, or if the query fails).
    fn queued_now(&self) -> usize {
        self.socket
            .and_then(|fd| kvpool::protocol::io::queued_bytes(fd).ok())
            .unwrap_or(0)
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
                    this.queued = this.queued_now();
                    let at = Instant::now() + this.limit;
                    this.timer.as_mut().reset(at);
                }
                while this.timer.as_mut().poll(cx).is_ready() {
                    let queued = this.queued_now();
                    if queued <= this.queued {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the peer stopped sending in the middle of a request",
                        )));
                    }
                    // Bytes arrived, below the raised mark: the peer is slow, not stopped.
                    this.queued = queued;
                    let at = Instant::now() + this.limit;
                    this.timer.as_mut().reset(at);
                }
                Poll::Pending
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

    /// With a large payload's low-water mark raised, a read waits while bytes trickle in below
    /// the mark: a peer sending slowly but steadily is given all the time it needs, one that
    /// stops half-way still fails after the limit. Real TCP on loopback, real time.
    #[tokio::test]
    async fn a_slow_payload_under_a_raised_mark_is_not_a_stall() {
        use kvpool::protocol::io::{FrameReader, LowWater};
        use std::os::fd::AsRawFd;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let connect = tokio::net::TcpStream::connect(l.local_addr().unwrap());
        let (w, a) = tokio::join!(connect, l.accept());
        let (a, mut w) = (a.unwrap().0, w.unwrap());
        let fd = a.as_raw_fd();
        let limit = Duration::from_millis(300);
        let mut r = FrameReader::with_capacity(4096, ReadStall::new(a, limit).on_socket(Some(fd)));
        r.get_mut().in_request(true);
        const LEN: usize = 512 << 10;
        // 8 KiB every 10 ms: the whole payload (the mark) takes about twice the limit to arrive.
        let writer = tokio::spawn(async move {
            for _ in 0..LEN / (8 << 10) {
                w.write_all(&[9u8; 8 << 10]).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Half of a second payload, then nothing.
            w.write_all(&[8u8; LEN / 2]).await.unwrap();
            w
        });
        async fn read_payload<R: AsyncRead + Unpin>(
            r: &mut FrameReader<R>,
            fd: std::os::fd::RawFd,
            fill: u8,
        ) -> io::Result<usize> {
            let mut got = vec![0u8; LEN];
            let mut water = LowWater::new(Some(fd));
            water.read_exact(r, &mut got, LEN).await?;
            water.finish()?;
            assert!(got.iter().all(|&b| b == fill));
            Ok(got.len())
        }
        assert_eq!(read_payload(&mut r, fd, 9).await.unwrap(), LEN);
        let _w = writer.await.unwrap();
        let e = read_payload(&mut r, fd, 8).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
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
