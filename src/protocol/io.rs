//! Reading and writing frames over any ordered byte stream (TCP, QUIC streams, Unix sockets).
//! Shared by the daemon and the client, so both sides frame identically.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use rkyv::util::AlignedVec;
use thiserror::Error;
use tokio::io::{AsyncBufRead, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::frame::{FrameError, FramePrefix, Limits, PREFIX_LEN};

/// A failure to read a frame.
#[derive(Debug, Error)]
pub enum WireError {
    /// The stream failed or ended mid-frame.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The frame broke the protocol.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Reads and checks the next prefix; `Ok(None)` when the stream ended cleanly between frames.
pub async fn read_prefix<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<Option<FramePrefix>, WireError> {
    let mut b = [0u8; PREFIX_LEN];
    let first = r.read(&mut b).await?;
    if first == 0 {
        return Ok(None);
    }
    r.read_exact(&mut b[first..]).await?;
    Ok(Some(FramePrefix::parse(&b, limits)?))
}

/// The most of an announced header made room for at a time: the buffer grows with the bytes
/// that actually arrive, so a peer that announces a large header and sends little costs little.
pub const HEADER_CHUNK: usize = 64 << 10;

/// Room made for a header's first bytes; then twice what has arrived, at most [`HEADER_CHUNK`]
/// more at a time.
pub const HEADER_FIRST: usize = 4 << 10;

/// Reads the header of a frame whose prefix was just read into `buf` (cleared first).
///
/// The buffer is made twice as large as what has arrived so far (at least [`HEADER_FIRST`], at
/// most [`HEADER_CHUNK`] bytes more), so it holds at most about twice the bytes received; it is
/// never sized from the announced length alone. Room is zeroed before it is read into, so it is
/// memory the process holds: a thousand connections that announce 64 KiB headers and send 16
/// bytes hold 4 KiB each, not 64.
pub async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
    prefix: &FramePrefix,
    buf: &mut AlignedVec,
) -> io::Result<()> {
    let want = prefix.header_len as usize;
    buf.clear();
    if buf.capacity() > want.max(HEADER_CHUNK) * 2 {
        // Don't keep a large buffer from an earlier frame for the life of the connection.
        *buf = AlignedVec::new();
    }
    while buf.len() < want {
        let have = buf.len();
        let room = (have * 2)
            .clamp(HEADER_FIRST, have + HEADER_CHUNK)
            .min(want);
        buf.resize(room, 0);
        match r.read(&mut buf[have..]).await {
            Ok(0) => {
                buf.resize(have, 0);
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            Ok(n) => buf.resize(have + n, 0),
            Err(e) => {
                buf.resize(have, 0);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Writes one frame: prefix, header, then the payload pieces in order (not flushed).
///
/// One vectored write where the writer takes them (a socket under a `BufWriter`): a frame larger
/// than the buffer goes out in one system call with whatever was buffered before it flushed,
/// instead of one for the header and one per payload piece.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &[u8],
    payload: &[&[u8]],
) -> io::Result<()> {
    let payload_len = payload.iter().map(|p| p.len() as u64).sum();
    let prefix = FramePrefix {
        header_len: header.len() as u32,
        payload_len,
    }
    .encode();
    let slices = || {
        [&prefix[..], header]
            .into_iter()
            .chain(payload.iter().copied())
            .map(IoSlice::new)
    };
    // Most frames have a payload of at most a few pieces: their slices stay on the stack.
    const ON_STACK: usize = 8;
    if payload.len() + 2 <= ON_STACK {
        let mut bufs = [IoSlice::new(&[]); ON_STACK];
        let n = bufs.iter_mut().zip(slices()).map(|(b, s)| *b = s).count();
        return write_all_vectored(w, &mut bufs[..n]).await;
    }
    write_all_vectored(w, &mut slices().collect::<Vec<_>>()).await
}

/// Writes every byte of `bufs` in order, as few vectored writes as the writer allows.
pub async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Most bytes a [`FrameReader`] reads into its buffer at once after a large payload: enough
/// for the next frame's prefix and header, so the payload after them is read straight into
/// its destination instead of through the buffer.
pub const SMALL_FILL: usize = 4 << 10;

/// Payload bytes read with [`read_direct`] since the buffer was last filled that make the next
/// fill a [`SMALL_FILL`].
pub const LARGE_PAYLOAD: usize = 16 << 10;

/// A buffered reader for frames (`tokio::io::BufReader`'s job) that keeps large payloads out
/// of its buffer.
///
/// A `BufReader` fills its whole buffer whenever it is empty: the read meant for a frame's
/// prefix brings in the payload after it too, up to the buffer's size, and every one of those
/// bytes is copied a second time on its way to the payload's destination (a 64 KiB put went
/// almost whole through the node's buffer). This reader fills only [`SMALL_FILL`] bytes when
/// the frames before were large ([`LARGE_PAYLOAD`] or more read with [`read_direct`] since the
/// last fill), and the whole buffer otherwise, so a stream of small frames still arrives many
/// to a system call.
pub struct FrameReader<R> {
    inner: R,
    buf: Box<[u8]>,
    /// The buffered bytes are `buf[pos..filled]`.
    pos: usize,
    filled: usize,
    /// Payload bytes [`read_direct`] has returned since the last fill.
    direct: usize,
}

impl<R> FrameReader<R> {
    /// A reader over `inner` with a buffer of `capacity` bytes (at least 1).
    pub fn with_capacity(capacity: usize, inner: R) -> FrameReader<R> {
        FrameReader {
            inner,
            buf: vec![0u8; capacity.max(1)].into_boxed_slice(),
            pos: 0,
            filled: 0,
            direct: 0,
        }
    }

    /// Gives the buffer `capacity` bytes (at least 1, and at least what is buffered), keeping
    /// the buffered bytes: a server reads a connection's first frames through a small buffer
    /// and makes it larger once the peer has authenticated.
    pub fn set_capacity(&mut self, capacity: usize) {
        let kept = self.filled - self.pos;
        let capacity = capacity.max(kept).max(1);
        if capacity == self.buf.len() {
            return;
        }
        let mut buf = vec![0u8; capacity].into_boxed_slice();
        buf[..kept].copy_from_slice(&self.buf[self.pos..self.filled]);
        self.buf = buf;
        self.pos = 0;
        self.filled = kept;
    }

    /// The buffer's size.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// The bytes read from the stream and not yet consumed.
    pub fn buffer(&self) -> &[u8] {
        &self.buf[self.pos..self.filled]
    }

    /// The stream (reading from it directly skips what is buffered).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    fn consume_buffered(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.filled);
    }
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Refills the buffer when it is empty (with at most [`SMALL_FILL`] bytes after a large
    /// payload); the buffered bytes, empty only at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<&[u8]>> {
        if self.pos == self.filled {
            let cap = if self.direct >= LARGE_PAYLOAD {
                SMALL_FILL.min(self.buf.len())
            } else {
                self.buf.len()
            };
            let mut rb = ReadBuf::new(&mut self.buf[..cap]);
            ready!(Pin::new(&mut self.inner).poll_read(cx, &mut rb))?;
            self.filled = rb.filled().len();
            self.pos = 0;
            self.direct = 0;
        }
        Poll::Ready(Ok(&self.buf[self.pos..self.filled]))
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for FrameReader<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        // Nothing buffered and a read at least as large as the buffer: straight from the
        // stream, as `BufReader` does.
        if me.pos == me.filled && out.remaining() >= me.buf.len() {
            return Pin::new(&mut me.inner).poll_read(cx, out);
        }
        let have = ready!(me.poll_fill(cx))?;
        let n = have.len().min(out.remaining());
        out.put_slice(&have[..n]);
        me.consume_buffered(n);
        Poll::Ready(Ok(()))
    }
}

impl<R: AsyncRead + Unpin> AsyncBufRead for FrameReader<R> {
    fn poll_fill_buf(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<&[u8]>> {
        self.get_mut().poll_fill(cx)
    }

    fn consume(self: Pin<&mut Self>, amt: usize) {
        self.get_mut().consume_buffered(amt);
    }
}

/// Reads some bytes of a payload into `dst` (`Ok(0)` only at the end of the stream): what `r`
/// has buffered first, then straight from the stream into `dst`, whatever `dst`'s size.
pub async fn read_direct<R: AsyncRead + Unpin>(
    r: &mut FrameReader<R>,
    dst: &mut [u8],
) -> io::Result<usize> {
    let n = if !r.buffer().is_empty() || dst.is_empty() {
        let buffered = r.buffer();
        let n = buffered.len().min(dst.len());
        dst[..n].copy_from_slice(&buffered[..n]);
        r.consume_buffered(n);
        n
    } else {
        // The buffer is empty, so the stream's next bytes are the payload's next bytes.
        r.get_mut().read(dst).await?
    };
    r.direct = r.direct.saturating_add(n);
    Ok(n)
}

/// Fills `dst` with [`read_direct`]; an early end of the stream is `UnexpectedEof`.
pub async fn read_exact_direct<R: AsyncRead + Unpin>(
    r: &mut FrameReader<R>,
    dst: &mut [u8],
) -> io::Result<()> {
    let mut at = 0;
    while at < dst.len() {
        match read_direct(r, &mut dst[at..]).await? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => at += n,
        }
    }
    Ok(())
}

/// Payloads at least this large are read with the socket's receive low-water mark raised
/// ([`LowWater`]); smaller ones arrive in a few segments anyway.
pub const LOW_WATER_MIN: usize = 256 << 10;

/// The highest receive low-water mark [`LowWater`] sets: the reader is signalled at most once
/// per this many bytes of a payload, and still hashes what arrived while the rest is on its way.
pub const LOW_WATER_MAX: usize = 1 << 20;

/// Reads a large payload from a TCP socket with the socket's receive low-water mark
/// (`SO_RCVLOWAT`) raised, so that the socket's data-ready path (`sock_def_readable`, the epoll
/// callback behind it, and the reader's wake-up when it sleeps) runs once up to
/// [`LOW_WATER_MAX`] bytes of it have arrived, instead of for every segment the kernel queues
/// (64 KiB over loopback). Over loopback that path runs on the *sender's* thread, which
/// delivers the segment: in a profile of 2 MiB gets from a probe node that sent replies
/// without copying them, it was the largest single item of the node's CPU.
///
/// The mark never makes a read wait for bytes that will not come: before every read that goes
/// to the socket (nothing of the payload is buffered above it) the mark is at most the
/// payload's bytes still to come, all of which are on their way through the socket (the
/// frame's prefix announced the length); it is lowered as they arrive, and put back to 1
/// (every byte wakes the reader) by [`LowWater::finish`] before anything else is read, or when
/// dropped (an error or a cancelled read; the connection is then not reused in sync anyway).
/// A peer that stops half-way leaves the reader waiting exactly as long as without the mark. A
/// slow one wakes the reader once per mark's worth of bytes instead of per segment, so
/// per-read progress timers see fewer, larger reads.
///
/// Only on Linux 4.18 or later, where raising the mark also lets the receive window grow to
/// hold it; elsewhere (and for other transports: `fd` None) plain reads.
#[derive(Debug)]
pub struct LowWater {
    /// The TCP socket being read; it outlives this value (owned by the connection that the
    /// reads borrow).
    fd: Option<std::os::fd::RawFd>,
    /// The mark set on the socket now (1: the kernel's default).
    mark: usize,
}

impl LowWater {
    /// For reading one payload from `fd`, the TCP socket under the reader (None: another
    /// transport; every read is then a plain [`read_direct`]).
    pub fn new(fd: Option<std::os::fd::RawFd>) -> LowWater {
        LowWater {
            fd: fd.filter(|_| low_water_supported()),
            mark: 1,
        }
    }

    /// [`read_direct`] of the payload's next bytes into `dst`, `left` of them (at least
    /// `dst.len()`) still to come, with the mark adjusted first when the read goes to the
    /// socket.
    pub async fn read<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut FrameReader<R>,
        dst: &mut [u8],
        left: usize,
    ) -> io::Result<usize> {
        if r.buffer().is_empty() && !dst.is_empty() {
            self.before_socket_read(left.max(dst.len()))?;
        }
        read_direct(r, dst).await
    }

    /// Fills `dst` with [`LowWater::read`]s, `left` bytes of the payload (`dst`'s included)
    /// still to come; an early end of the stream is `UnexpectedEof`, as in
    /// [`read_exact_direct`].
    pub async fn read_exact<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut FrameReader<R>,
        dst: &mut [u8],
        left: usize,
    ) -> io::Result<()> {
        let mut at = 0;
        while at < dst.len() {
            match self.read(r, &mut dst[at..], left - at).await? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n => at += n,
            }
        }
        Ok(())
    }

    /// Puts the mark back to 1: the payload is read, and what follows may be a few bytes.
    pub fn finish(mut self) -> io::Result<()> {
        self.set(1)
    }

    /// Sets the mark for a read straight from the socket (nothing of the payload buffered
    /// above it) with `left` bytes of the payload still to come; for readers that do not go
    /// through [`LowWater::read`].
    pub fn before_socket_read(&mut self, left: usize) -> io::Result<()> {
        if self.mark > left {
            // The tail of the payload: wake when all of it is here.
            self.set(left)
        } else if self.mark == 1 && left >= LOW_WATER_MIN {
            self.set(left.min(LOW_WATER_MAX))
        } else {
            Ok(())
        }
    }

    fn set(&mut self, mark: usize) -> io::Result<()> {
        let Some(fd) = self.fd else {
            return Ok(());
        };
        if mark == self.mark {
            return Ok(());
        }
        let value = libc::c_int::try_from(mark).unwrap_or(libc::c_int::MAX);
        // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from `&value`, a live c_int, and
        // touches no other memory of ours; a descriptor that is not (or no longer) a socket only
        // makes the call fail, which is returned.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        self.mark = mark;
        Ok(())
    }
}

impl Drop for LowWater {
    fn drop(&mut self) {
        // Best effort: after an error or a cancelled read the connection is dropped, not reused.
        let _ = self.set(1);
    }
}

/// Bytes received on the TCP socket `fd` that no read has taken yet (`SIOCINQ`): while a
/// raised low-water mark keeps a read waiting, whether bytes are still arriving.
pub fn queued_bytes(fd: std::os::fd::RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCINQ writes one c_int through the pointer, which points at the live `n`; a
    // descriptor that is not a socket only makes the call fail, which is returned.
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Whether the kernel grows the receive window to a raised low-water mark (Linux 4.18+), so
/// that a raised mark can never wait on a window too small to deliver it.
fn low_water_supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .and_then(|r| kernel_at_least(&r, (4, 18)))
            .unwrap_or(false)
    })
}

/// Whether a kernel release string (`6.1.0-13-amd64`) is at least `(major, minor)`; None when
/// it does not start with two numbers.
fn kernel_at_least(release: &str, want: (u32, u32)) -> Option<bool> {
    let mut parts = release.trim().split(['.', '-']);
    let major = parts.next()?.parse::<u32>().ok()?;
    let minor = parts.next()?.parse::<u32>().ok()?;
    Some((major, minor) >= want)
}

/// Reads and drops `n` bytes (the payload of a request that failed before it was consumed),
/// through a small fixed buffer.
pub async fn discard<R: AsyncRead + Unpin>(r: &mut R, mut n: u64) -> io::Result<()> {
    let mut buf = [0u8; 8192];
    while n > 0 {
        let take = n.min(buf.len() as u64) as usize;
        r.read_exact(&mut buf[..take]).await?;
        n -= take as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_are_compared_by_major_and_minor() {
        assert_eq!(kernel_at_least("6.18.44-fc-v657", (4, 18)), Some(true));
        assert_eq!(
            kernel_at_least("4.18.0-513.el8.x86_64\n", (4, 18)),
            Some(true)
        );
        assert_eq!(kernel_at_least("5.4.0-150-generic", (4, 18)), Some(true));
        assert_eq!(kernel_at_least("4.17.19", (4, 18)), Some(false));
        assert_eq!(
            kernel_at_least("3.10.0-1160.el7.x86_64", (4, 18)),
            Some(false)
        );
        assert_eq!(kernel_at_least("linux", (4, 18)), None);
    }

    /// The socket's receive low-water mark now.
    fn mark_of(fd: std::os::fd::RawFd) -> usize {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` (the size of `v`) bytes into the live `v`
        // and the length into the live `len`; a failure is asserted on.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        v as usize
    }

    /// A connected pair of TCP sockets on loopback: (the reader's, the writer's).
    async fn tcp_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let connect = tokio::net::TcpStream::connect(l.local_addr().unwrap());
        let (c, a) = tokio::join!(connect, l.accept());
        (a.unwrap().0, c.unwrap())
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    /// Over real TCP, every payload arrives whole and intact through [`LowWater`] however the
    /// peer cuts it up and however much of it the reader buffered with the header, the mark is
    /// raised while a large one arrives and back at 1 after it, and no read ever waits for
    /// more than the payload: the peer sends what follows each payload only after the reader
    /// said it has the payload, so a mark set one byte too high hangs this test.
    #[tokio::test]
    async fn low_water_reads_payloads_whole_and_never_waits_past_them() {
        use std::os::fd::AsRawFd;
        let (r, mut w) = tcp_pair().await;
        let fd = r.as_raw_fd();
        let (rh, mut ack) = r.into_split();
        let mut reader = FrameReader::with_capacity(64 << 10, rh);
        // (payload length, bytes per write, bytes of the payload sent with its 16-byte header)
        let cases: &[(usize, usize, usize)] = &[
            (2 << 20, 2 << 20, 0),
            (2 << 20, 7 << 10, 0),
            ((2 << 20) + 17, 100 << 10, 40 << 10),
            (300 << 10, 1000, 0),
            (600 << 10, 4 << 10, 0),
            (5 << 20, 1 << 20, 60 << 10),
            (256 << 10, 256 << 10, 0),
            (100 << 10, 4 << 10, 0),
        ];
        let plan = cases.to_vec();
        let writer = tokio::spawn(async move {
            let mut ok = [0u8; 2];
            for (k, &(len, per_write, with_header)) in plan.iter().enumerate() {
                let payload = pattern(len, k as u8);
                let mut first = vec![k as u8; 16];
                first.extend_from_slice(&payload[..with_header]);
                w.write_all(&first).await.unwrap();
                // The rest once the reader has the header: it then drains what came with it
                // and meets an empty socket.
                let (mut back, _) = w.split();
                back.read_exact(&mut ok).await.unwrap();
                assert_eq!(&ok, b"go");
                for (i, piece) in payload[with_header..].chunks(per_write).enumerate() {
                    w.write_all(piece).await.unwrap();
                    if i % 64 == 63 {
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                }
                // What follows the payload only once the reader has all of it.
                let (mut back, _) = w.split();
                back.read_exact(&mut ok).await.unwrap();
                assert_eq!(&ok, b"ok");
                w.write_all(b"tail").await.unwrap();
            }
        });
        for (k, &(len, _, _)) in cases.iter().enumerate() {
            let mut hdr = [0u8; 16];
            reader.read_exact(&mut hdr).await.unwrap();
            assert_eq!(hdr, [k as u8; 16]);
            ack.write_all(b"go").await.unwrap();
            let mut got = vec![0u8; len];
            let mut water = LowWater::new(Some(fd));
            let (mut at, mut raised) = (0, 0);
            while at < len {
                // Odd payloads as the node receives a put (256 KiB pieces, each filled with
                // `read_exact`), even ones as the client hashes a value (at most 256 KiB per read).
                let end = len.min(at + (256 << 10));
                let n = if k % 2 == 1 {
                    let read = water.read_exact(&mut reader, &mut got[at..end], len - at);
                    tokio::time::timeout(std::time::Duration::from_secs(20), read)
                        .await
                        .expect("a read waited for bytes that were never sent")
                        .unwrap();
                    end - at
                } else {
                    let read = water.read(&mut reader, &mut got[at..end], len - at);
                    tokio::time::timeout(std::time::Duration::from_secs(20), read)
                        .await
                        .expect("a read waited for bytes that were never sent")
                        .unwrap()
                };
                assert!(n > 0);
                at += n;
                raised = raised.max(mark_of(fd));
            }
            water.finish().unwrap();
            assert_eq!(mark_of(fd), 1, "payload {k}: the mark was left raised");
            assert!(got == pattern(len, k as u8), "payload {k} arrived changed");
            // Raised only for what is left once the reader's buffer (64 KiB) is drained.
            if low_water_supported() && len >= LOW_WATER_MIN + (64 << 10) {
                assert!(
                    raised > 1,
                    "payload {k} of {len} bytes: the mark was never raised"
                );
                assert!(raised <= LOW_WATER_MAX);
            } else if len < LOW_WATER_MIN || !low_water_supported() {
                assert_eq!(
                    raised, 1,
                    "payload {k}: the mark was raised for {len} bytes"
                );
            }
            ack.write_all(b"ok").await.unwrap();
            let mut tail = [0u8; 4];
            reader.read_exact(&mut tail).await.unwrap();
            assert_eq!(&tail, b"tail");
        }
        writer.await.unwrap();
    }

    /// A read given up half-way (a timeout, a cancelled call) still puts the mark back.
    #[tokio::test]
    async fn dropping_low_water_half_way_puts_the_mark_back() {
        use std::os::fd::AsRawFd;
        let (r, mut w) = tcp_pair().await;
        let fd = r.as_raw_fd();
        let mut reader = FrameReader::with_capacity(64 << 10, r);
        w.write_all(&pattern(1 << 20, 3)).await.unwrap();
        let mut got = vec![0u8; 2 << 20];
        let mut water = LowWater::new(Some(fd));
        let mut at = 0;
        let gave_up = loop {
            let read = water.read(&mut reader, &mut got[at..], (2 << 20) - at);
            match tokio::time::timeout(std::time::Duration::from_millis(300), read).await {
                Ok(n) => at += n.unwrap(),
                Err(_) => break true,
            }
        };
        // The peer stopped half-way: the read waits, as it would without the mark.
        assert!(gave_up && at <= 1 << 20);
        if low_water_supported() {
            assert!(mark_of(fd) > 1);
        }
        drop(water);
        assert_eq!(mark_of(fd), 1);
        assert_eq!(&got[..at], &pattern(1 << 20, 3)[..at]);
    }

    /// What [`queued_bytes`] reports is what a read then takes.
    #[tokio::test]
    async fn queued_bytes_counts_what_no_read_took() {
        use std::os::fd::AsRawFd;
        let (mut r, mut w) = tcp_pair().await;
        assert_eq!(queued_bytes(r.as_raw_fd()).unwrap(), 0);
        w.write_all(&[5u8; 1000]).await.unwrap();
        let mut waited = 0;
        while queued_bytes(r.as_raw_fd()).unwrap() < 1000 && waited < 1000 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            waited += 1;
        }
        assert_eq!(queued_bytes(r.as_raw_fd()).unwrap(), 1000);
        let mut buf = [0u8; 600];
        r.read_exact(&mut buf).await.unwrap();
        assert_eq!(queued_bytes(r.as_raw_fd()).unwrap(), 400);
    }

    /// A peer that announces the largest header and sends a few bytes makes the reader hold
    /// one chunk, not the announced length; a header sent whole still arrives whole.
    #[tokio::test]
    async fn header_buffer_grows_with_the_bytes_received() {
        let limits = Limits::default();
        let prefix = FramePrefix {
            header_len: limits.max_header,
            payload_len: 0,
        };
        let (mut tx, mut rx) = tokio::io::duplex(1 << 20);
        tx.write_all(&[7u8; 16]).await.unwrap();
        let mut buf = AlignedVec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_millis(100),
            read_header(&mut rx, &prefix, &mut buf),
        )
        .await;
        assert!(read.is_err(), "the rest of the header never arrives");
        assert!(
            buf.capacity() <= HEADER_FIRST,
            "{} bytes held for 16 received",
            buf.capacity()
        );

        let whole: Vec<u8> = (0..(3 * HEADER_CHUNK + 5) as u32)
            .map(|i| i as u8)
            .collect();
        let prefix = FramePrefix {
            header_len: whole.len() as u32,
            payload_len: 0,
        };
        let (mut tx, mut rx) = tokio::io::duplex(4096);
        let send = tokio::spawn(async move { tx.write_all(&whole).await.map(|()| whole) });
        let mut buf = AlignedVec::new();
        read_header(&mut rx, &prefix, &mut buf).await.unwrap();
        assert_eq!(&buf[..], &send.await.unwrap().unwrap()[..]);

        let (tx, mut rx) = tokio::io::duplex(64);
        drop(tx);
        let err = read_header(&mut rx, &prefix, &mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// Takes at most `max` bytes per write, vectored or not, and keeps them.
    struct Trickle {
        got: Vec<u8>,
        max: usize,
        calls: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<io::Result<usize>> {
            let n = buf.len().min(self.max);
            self.got.extend_from_slice(&buf[..n]);
            self.calls += 1;
            std::task::Poll::Ready(Ok(n))
        }

        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> std::task::Poll<io::Result<usize>> {
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.max - n);
                self.got.extend_from_slice(&b[..take]);
                n += take;
            }
            self.calls += 1;
            std::task::Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// A frame written through partial vectored writes arrives whole and in order, empty
    /// pieces included; a writer taking everything gets it in one call.
    #[tokio::test]
    async fn a_frame_survives_partial_vectored_writes() {
        let pieces: Vec<Vec<u8>> = [0usize, 5, 0, 4096, 1, 70_000, 0]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let payload: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
        let header = [9u8; 40];
        let mut want = FramePrefix {
            header_len: 40,
            payload_len: pieces.iter().map(|p| p.len() as u64).sum(),
        }
        .encode()
        .to_vec();
        want.extend_from_slice(&header);
        pieces.iter().for_each(|p| want.extend_from_slice(p));
        for max in [1, 3, 17, 4096, 1 << 20] {
            let mut w = Trickle {
                got: Vec::new(),
                max,
                calls: 0,
            };
            write_frame(&mut w, &header, &payload).await.unwrap();
            assert!(w.got == want, "max {max}: the frame arrived changed");
            if max == 1 << 20 {
                assert_eq!(w.calls, 1);
            }
        }
    }

    /// Bytes read through a buffered reader come out whole and in order whether they were
    /// buffered or read straight into the destination, and the reader's next frame is intact.
    #[tokio::test]
    async fn direct_reads_take_the_buffered_bytes_first() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + 7) as u8).collect();
        for (buffer, split) in [(16, 5), (4096, 100), (64 << 10, 70_000), (1 << 20, 299_999)] {
            let (mut tx, rx) = tokio::io::duplex(8192);
            let sent = data.clone();
            let send = tokio::spawn(async move { tx.write_all(&sent).await });
            let mut r = FrameReader::with_capacity(buffer, rx);
            // A small read first leaves bytes in the buffer (as a frame's header does).
            let mut head = [0u8; 3];
            r.read_exact(&mut head).await.unwrap();
            let mut a = vec![0u8; split - 3];
            read_exact_direct(&mut r, &mut a).await.unwrap();
            let mut b = vec![0u8; data.len() - split];
            read_exact_direct(&mut r, &mut b).await.unwrap();
            send.await.unwrap().unwrap();
            let got: Vec<u8> = head.iter().chain(&a).chain(&b).copied().collect();
            assert!(got == data, "buffer {buffer}: bytes changed");
            let mut more = [0u8; 1];
            let err = read_exact_direct(&mut r, &mut more).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        }
    }

    /// A reader made larger (or smaller) keeps the bytes it had buffered, in order, and fills
    /// up to its new size afterwards.
    #[tokio::test]
    async fn a_resized_reader_keeps_what_it_buffered() {
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7) as u8).collect();
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        tx.write_all(&data).await.unwrap();
        drop(tx);
        let mut r = FrameReader::with_capacity(4096, rx);
        let mut head = [0u8; 100];
        r.read_exact(&mut head).await.unwrap();
        assert_eq!(r.buffer().len(), 4096 - 100);
        r.set_capacity(64 << 10);
        assert_eq!((r.capacity(), r.buffer().len()), (64 << 10, 4096 - 100));
        r.set_capacity(10);
        assert_eq!(r.capacity(), 4096 - 100, "never below what is buffered");
        r.set_capacity(64 << 10);
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        let got: Vec<u8> = head.iter().chain(&rest).copied().collect();
        assert!(got == data);
    }

    /// After a large payload a fill stops at `SMALL_FILL` bytes, so the next frame's payload is
    /// read past the buffer rather than copied through it; after small payloads the buffer fills
    /// whole again. Every byte comes out in order either way.
    #[tokio::test]
    async fn a_fill_after_a_large_payload_is_small() {
        let lens = [100usize, 64 << 10, 64 << 10, 100, 100, 8000];
        let mut data = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            data.extend_from_slice(&(len as u64).to_le_bytes());
            data.extend((0..len).map(|j| (i * 31 + j * 7) as u8));
        }
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        tx.write_all(&data).await.unwrap();
        drop(tx);
        let mut r = FrameReader::with_capacity(64 << 10, rx);
        let mut got = Vec::new();
        let mut after_header = Vec::new();
        for _ in lens {
            let mut h = [0u8; 8];
            r.read_exact(&mut h).await.unwrap();
            after_header.push(r.buffer().len());
            let mut p = vec![0u8; u64::from_le_bytes(h) as usize];
            read_exact_direct(&mut r, &mut p).await.unwrap();
            got.extend_from_slice(&h);
            got.extend_from_slice(&p);
        }
        assert!(got == data, "bytes changed");
        // The first fill took the whole buffer; the one for the frame after a 64 KiB payload
        // took at most SMALL_FILL; so did the next (its frame's payload was 64 KiB too).
        assert_eq!(after_header[0], (64 << 10) - 8);
        assert_eq!(after_header[2], SMALL_FILL - 8);
        assert_eq!(after_header[3], SMALL_FILL - 8);
        // Frame 4 came out of frame 3's fill.
        assert_eq!(after_header[4], SMALL_FILL - 8 - 100 - 8);
        let mut more = [0u8; 1];
        assert_eq!(r.read(&mut more).await.unwrap(), 0);
    }

    proptest::proptest! {
        /// Against the model (the bytes sent, in order): frames of any payload sizes, arriving
        /// in pieces of any size, read as a header (`read_exact` through the buffer) and a
        /// payload (`read_exact_direct`), come out whole whatever the buffer's size and fill.
        #[test]
        fn frames_come_out_as_they_went_in(
            lens in proptest::collection::vec(0usize..40_000, 1..12),
            capacity in 1usize..70_000,
            pipe in 1usize..20_000,
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let mut data = Vec::new();
            for (i, &len) in lens.iter().enumerate() {
                data.extend_from_slice(&(len as u64).to_le_bytes());
                data.extend((0..len).map(|j| (i * 131 + j * 17 + j / 256) as u8));
            }
            let got = rt.block_on(async {
                let (mut tx, rx) = tokio::io::duplex(pipe);
                let sent = data.clone();
                let send = tokio::spawn(async move { tx.write_all(&sent).await });
                let mut r = FrameReader::with_capacity(capacity, rx);
                let mut got = Vec::new();
                for _ in &lens {
                    let mut h = [0u8; 8];
                    r.read_exact(&mut h).await.unwrap();
                    let mut p = vec![0u8; u64::from_le_bytes(h) as usize];
                    read_exact_direct(&mut r, &mut p).await.unwrap();
                    got.extend_from_slice(&h);
                    got.extend_from_slice(&p);
                }
                send.await.unwrap().unwrap();
                let mut more = [0u8; 1];
                assert_eq!(r.read(&mut more).await.unwrap(), 0, "nothing after the frames");
                got
            });
            proptest::prop_assert!(got == data, "bytes changed");
        }
    }
}
