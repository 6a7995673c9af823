//! Frames written and read back: headers, partial vectored writes, and the reader's buffer
//! against the bytes sent.

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
