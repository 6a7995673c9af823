//! The low-water mark over real TCP: payloads whole, the mark raised and put back, no read
//! waiting past a payload.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
