//! Reading and writing frames over any ordered byte stream (TCP, QUIC streams, Unix sockets).
//! Shared by the daemon and the client, so both sides frame identically.

use std::io::{self, IoSlice};

use rkyv::util::AlignedVec;
use thiserror::Error;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

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

/// Reads some bytes of a payload into `dst` (`Ok(0)` only at the end of the stream): what `r`
/// has buffered first, then straight from the stream into `dst`, whatever `dst`'s size (a
/// `BufReader` reads through its own buffer, and copies again, for any read smaller than that
/// buffer).
pub async fn read_direct<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    dst: &mut [u8],
) -> io::Result<usize> {
    let buffered = r.buffer();
    if !buffered.is_empty() || dst.is_empty() {
        let n = buffered.len().min(dst.len());
        dst[..n].copy_from_slice(&buffered[..n]);
        r.consume(n);
        return Ok(n);
    }
    // The buffer is empty, so the stream's next bytes are the payload's next bytes.
    r.get_mut().read(dst).await
}

/// Fills `dst` with [`read_direct`]; an early end of the stream is `UnexpectedEof`.
pub async fn read_exact_direct<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
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
            let mut r = BufReader::with_capacity(buffer, rx);
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
}
