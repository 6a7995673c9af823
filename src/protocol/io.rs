//! Reading and writing frames over any ordered byte stream (TCP, QUIC streams, Unix sockets).
//! Shared by the daemon and the client, so both sides frame identically.

use std::io;

use rkyv::util::AlignedVec;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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

/// Reads the header of a frame whose prefix was just read into `buf` (cleared first).
pub async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
    prefix: &FramePrefix,
    buf: &mut AlignedVec,
) -> io::Result<()> {
    buf.clear();
    buf.resize(prefix.header_len as usize, 0);
    r.read_exact(&mut buf[..]).await?;
    Ok(())
}

/// Writes one frame: prefix, header, then the payload pieces in order (not flushed).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &[u8],
    payload: &[&[u8]],
) -> io::Result<()> {
    let payload_len = payload.iter().map(|p| p.len() as u64).sum();
    let prefix = FramePrefix {
        header_len: header.len() as u32,
        payload_len,
    };
    w.write_all(&prefix.encode()).await?;
    w.write_all(header).await?;
    for p in payload {
        w.write_all(p).await?;
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
