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

/// How much of an announced header is made room for at a time: the buffer grows with the bytes
/// that actually arrive, so a peer that announces a large header and sends little costs little.
pub const HEADER_CHUNK: usize = 64 << 10;

/// Reads the header of a frame whose prefix was just read into `buf` (cleared first).
///
/// The buffer grows at most [`HEADER_CHUNK`] bytes beyond what has arrived; it is never sized
/// from the announced length alone.
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
        let step = (want - have).min(HEADER_CHUNK);
        buf.resize(have + step, 0);
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

#[cfg(test)]
mod tests {
    use super::*;

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
            buf.capacity() <= 2 * HEADER_CHUNK,
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
}
