//! File descriptors over a Unix stream socket (`SCM_RIGHTS`): how a node hands a same-host
//! client the segments it may map, after the client authenticated, instead of naming files
//! anyone of the daemon's user could open.
//!
//! The sender attaches the descriptors to the first bytes of a reply; the receiver takes them
//! with a *peek* ([`peek_fds`]) before it reads the reply as usual, so a buffered reader can
//! read the bytes as any other (the kernel closes its own copies of the descriptors then).
//! Both calls are non-blocking single attempts on a non-blocking socket.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};

use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// Most descriptors one message carries (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// Bytes of control buffer for [`MAX_FDS`] descriptors.
const CONTROL: usize = rustix::cmsg_space!(ScmRights(MAX_FDS));

/// Sends `bytes` on the stream socket `sock` with `fds` attached to them; returns how many of
/// the bytes went (at least one, or an error: `WouldBlock` when the socket's buffer is full).
/// The caller sends the rest of the bytes as usual. `sock` and `fds` are the caller's open
/// descriptors, borrowed for the call.
pub fn send_with_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    if bytes.is_empty() || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "descriptors need at least one byte and at most 253 to a message",
        ));
    }
    let fds: Vec<BorrowedFd<'_>> = fds.iter().map(|&fd| borrowed(fd)).collect();
    let mut space = [MaybeUninit::uninit(); CONTROL];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "descriptors do not fit a control message",
        ));
    }
    let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
    Ok(sendmsg(
        borrowed(sock),
        &[IoSlice::new(bytes)],
        &mut control,
        flags,
    )?)
}

/// Looks at the next byte waiting on the stream socket `sock` without consuming it and takes
/// the descriptors attached to it (duplicates: the byte keeps its own until read). None when
/// nothing is waiting yet; an empty list when the byte carries none; `UnexpectedEof` when the
/// peer closed. Descriptors come close-on-exec. More than [`MAX_FDS`] is an error (any that
/// arrived are closed). `sock` is the caller's open socket, borrowed for the call.
pub fn peek_fds(sock: RawFd) -> io::Result<Option<Vec<OwnedFd>>> {
    let mut byte = [0u8; 1];
    let mut space = [MaybeUninit::uninit(); CONTROL];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let flags = RecvFlags::PEEK | RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC;
    let msg = match recvmsg(
        borrowed(sock),
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        flags,
    ) {
        Ok(msg) => msg,
        Err(Errno::AGAIN | Errno::INTR) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        // Dropping `control` closes whatever did arrive.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more descriptors than a message may carry",
        ));
    }
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if msg.bytes == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(fds))
}

/// The caller's descriptor `fd`, borrowed for the call it was passed to.
fn borrowed<'a>(fd: RawFd) -> BorrowedFd<'a> {
    // SAFETY: the public functions of this module take descriptors their caller holds open
    // until the call returns (their documented contract), and the borrow ends with the call.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    /// Descriptors ride on the first bytes: a peek takes them and leaves the bytes, which a
    /// plain read then gets in full; the files behind them are the ones sent.
    #[test]
    fn descriptors_ride_on_the_bytes_and_the_bytes_stay() {
        let (a, mut b) = UnixStream::pair().unwrap();
        assert!(peek_fds(b.as_raw_fd()).unwrap().is_none(), "nothing yet");
        let mut files: Vec<std::fs::File> = (0..3).map(|_| tempfile()).collect();
        for (i, f) in files.iter_mut().enumerate() {
            f.write_all(format!("file {i}").as_bytes()).unwrap();
        }
        let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        assert_eq!(send_with_fds(a.as_raw_fd(), b"hello", &raw).unwrap(), 5);
        (&a).write_all(b" world").unwrap();
        let got = peek_fds(b.as_raw_fd()).unwrap().unwrap();
        assert_eq!(got.len(), 3);
        for (i, fd) in got.into_iter().enumerate() {
            let mut f = std::fs::File::from(fd);
            f.rewind().unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, format!("file {i}"));
        }
        let mut buf = [0u8; 11];
        b.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hello world");
        drop(a);
        assert_eq!(
            peek_fds(b.as_raw_fd()).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn bytes_without_descriptors_peek_as_none_attached() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(b"x").unwrap();
        assert_eq!(peek_fds(b.as_raw_fd()).unwrap().unwrap().len(), 0);
        assert!(send_with_fds(a.as_raw_fd(), b"", &[]).is_err());
        assert!(send_with_fds(a.as_raw_fd(), b"x", &[0; MAX_FDS + 1]).is_err());
    }

    /// A fresh file, already unlinked.
    fn tempfile() -> std::fs::File {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kvpool-fdpass-{}-{n}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }
}
