//! A buffered reader for frames that reads large payloads past its buffer, straight into
//! their destination.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncBufRead, AsyncRead, AsyncReadExt, ReadBuf};

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
