//! What bounds each weights path on this machine, measured on the same bytes: reading the file
//! (page cache warm), memcpy between two sets of tensor-sized buffers, and one raw TCP stream
//! over loopback.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;

/// Bytes per write of the raw TCP sender.
const SEND: usize = 16 << 20;

/// `read()` of the whole file into `buf` (at least the file's length): one `read_exact`, which
/// the kernel serves in reads of up to 2 GiB from the page cache.
pub(crate) fn read_file(path: &Path, buf: &mut [u8]) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len() as usize;
    f.read_exact(&mut buf[..len])?;
    Ok(t.elapsed())
}

/// memcpy of every source tensor into its destination, one thread.
pub(crate) fn memcpy(src: &[&[u8]], dst: &mut [Vec<u8>]) -> Duration {
    let t = Instant::now();
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        d.copy_from_slice(s);
    }
    std::hint::black_box(&dst);
    t.elapsed()
}

/// A loopback TCP connection whose far end, a thread of this process, sends `len` bytes of its
/// source in writes of [`SEND`] bytes whenever it receives a request byte.
pub(crate) struct RawStream {
    stream: TcpStream,
    sender: Option<JoinHandle<()>>,
    stop: mpsc::Sender<()>,
}

impl RawStream {
    /// Connects to a new sender thread serving `src[from..]`.
    pub(crate) fn start(src: std::sync::Arc<Vec<u8>>, from: usize) -> anyhow::Result<RawStream> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = mpsc::channel::<()>();
        let sender = std::thread::Builder::new()
            .name("raw-tcp-send".into())
            .spawn(move || {
                let Ok((mut s, _)) = listener.accept() else {
                    return;
                };
                let mut req = [0u8; 1];
                while s.read_exact(&mut req).is_ok() && stopped.try_recv().is_err() {
                    for part in src[from..].chunks(SEND) {
                        if s.write_all(part).is_err() {
                            return;
                        }
                    }
                }
            })?;
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(RawStream {
            stream,
            sender: Some(sender),
            stop,
        })
    }

    /// Asks for the bytes and reads them into `dst` in order (the buffers' lengths add up to
    /// the sender's source); returns the time from the request to the last byte.
    pub(crate) fn receive(&mut self, dst: &mut [Vec<u8>]) -> anyhow::Result<Duration> {
        let t = Instant::now();
        self.stream.write_all(&[1])?;
        for d in dst.iter_mut() {
            self.stream.read_exact(d)?;
        }
        Ok(t.elapsed())
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(h) = self.sender.take() {
            let _ = h.join();
        }
    }
}
