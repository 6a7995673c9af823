//! File descriptors over a Unix stream socket (`SCM_RIGHTS`): how a node hands a same-host
//! client the segments it may map, after the client authenticated, instead of naming files
//! anyone of the daemon's user could open.
//!
//! The sender attaches the descriptors to the first bytes of a reply; the receiver takes them
//! with a *peek* ([`peek_fds`]) before it reads the reply as usual, so a buffered reader can
//! read the bytes as any other (the kernel closes its own copies of the descriptors then).
//! Both calls are non-blocking single attempts on a non-blocking socket.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message carries (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// Bytes of control buffer for `n` descriptors.
fn control_len(n: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure computation on its argument.
    unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends `bytes` on the stream socket `sock` with `fds` attached to them; returns how many of
/// the bytes went (at least one, or an error: `WouldBlock` when the socket's buffer is full).
/// The caller sends the rest of the bytes as usual.
pub fn send_with_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    if bytes.is_empty() || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "descriptors need at least one byte and at most 253 to a message",
        ));
    }
    // u64 elements keep the buffer aligned for cmsghdr.
    let mut control = vec![0u64; control_len(fds.len()).div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no buffers); the fields set below point
    // at `iov` and `control`, which outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control_len(fds.len()) as _;
        // SAFETY: the control buffer holds CMSG_SPACE(len) bytes, aligned, so the first header
        // and its data (CMSG_LEN(len) bytes) fit in it; the descriptors are copied in bytewise.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            let len = std::mem::size_of_val(fds);
            (*c).cmsg_len = libc::CMSG_LEN(len as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), len);
        }
    }
    // SAFETY: `msg` is fully initialised above; sendmsg only reads the buffers it names.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Looks at the next byte waiting on the stream socket `sock` without consuming it and takes
/// the descriptors attached to it (duplicates: the byte keeps its own until read). None when
/// nothing is waiting yet; an empty list when the byte carries none; `UnexpectedEof` when the
/// peer closed. Descriptors come close-on-exec. More than [`MAX_FDS`] is an error (any that
/// arrived are closed).
pub fn peek_fds(sock: RawFd) -> io::Result<Option<Vec<OwnedFd>>> {
    let mut byte = 0u8;
    let mut iov = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    let mut control = vec![0u64; control_len(MAX_FDS).div_ceil(8)];
    // SAFETY: as in send_with_fds; the buffers outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * 8) as _;
    // SAFETY: `msg` names one writable byte and a writable control buffer of the given length.
    let n = unsafe {
        libc::recvmsg(
            sock,
            &mut msg,
            libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg.msg_control` with `msg_controllen` bytes of well-formed
    // control messages; the CMSG_* walk stays within them, and each SCM_RIGHTS payload holds
    // `(cmsg_len - CMSG_LEN(0)) / 4` descriptors that are now ours (each taken exactly once).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more descriptors than a message may carry",
        ));
    }
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(fds))
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
