//! Large payloads read from a TCP socket with its receive low-water mark raised, so the reader
//! wakes once per many segments, never waiting for bytes that will not come.

use std::future::Future;
use std::io;

use tokio::io::AsyncRead;

#[cfg(doc)]
use super::reader::read_exact_direct;
use super::reader::{read_direct, FrameReader};

/// Payloads at least this large are read with the socket's receive low-water mark raised
/// ([`LowWater`]); smaller ones arrive in a few segments anyway.
pub const LOW_WATER_MIN: usize = 256 << 10;

/// The highest receive low-water mark [`LowWater`] sets: the reader is signalled at most once
/// per this many bytes of a payload, and copies and hashes what arrived while the rest is on
/// its way. A higher mark wakes the reader less often but leaves it more to copy after the
/// sender's last byte: with 1 MiB, a 2 MiB get on one connection ran at 0.77× memcached (five
/// pairs, lowest 0.69×), with 256 KiB at 0.89× (lowest 0.85×) in the same hour.
pub const LOW_WATER_MAX: usize = 256 << 10;

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
    /// `dst.len()`) still to come. The mark is adjusted only when the read goes to the socket
    /// and finds nothing there, right before it waits: bytes already queued are taken without
    /// a `setsockopt` (a payload that arrived whole costs none). Setting the mark checks the
    /// queue at once and wakes the reader if it already holds the new mark's worth (Linux's
    /// `tcp_set_rcvlowat`), so no arrival between the empty read and the new mark is missed.
    pub async fn read<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut FrameReader<R>,
        dst: &mut [u8],
        left: usize,
    ) -> io::Result<usize> {
        if !r.buffer().is_empty() || dst.is_empty() {
            return read_direct(r, dst).await;
        }
        let want = left.max(dst.len());
        let mut read = std::pin::pin!(read_direct(r, dst));
        std::future::poll_fn(|cx| match read.as_mut().poll(cx) {
            std::task::Poll::Pending => match self.before_socket_read(want) {
                Ok(()) => std::task::Poll::Pending,
                Err(e) => std::task::Poll::Ready(Err(e)),
            },
            done => done,
        })
        .await
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

#[cfg(test)]
#[path = "tests_low_water.rs"]
mod tests;
