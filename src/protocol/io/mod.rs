//! Reading and writing frames over any ordered byte stream (TCP, QUIC streams, Unix sockets).
//! Shared by the daemon and the client, so both sides frame identically.
//!
//! Frames are written and their prefixes and headers read here; [`FrameReader`] (reader.rs)
//! buffers a stream without copying large payloads through its buffer, and [`LowWater`]
//! (low_water.rs) wakes the reader of a large payload once per up to [`LOW_WATER_MAX`] bytes
//! instead of once per segment.

mod low_water;
mod reader;

use std::io::{self, IoSlice};

use rkyv::util::AlignedVec;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::frame::{FrameError, FramePrefix, Limits, PREFIX_LEN};

pub use low_water::{queued_bytes, LowWater, LOW_WATER_MAX, LOW_WATER_MIN};
pub use reader::{read_direct, read_exact_direct, FrameReader, LARGE_PAYLOAD, SMALL_FILL};

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
mod tests;
