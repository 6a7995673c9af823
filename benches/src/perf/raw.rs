//! The raw TCP stream: the physical limit of loopback TCP for a request/response of a given
//! size on this machine. An in-process server (its own tokio runtime with two workers, like
//! kvpoold's on this machine) on 127.0.0.1:0 answers each 8-byte request — a little-endian
//! u64 length — with that many bytes from one preallocated buffer; the client sends the
//! request and reads the bytes into a reused buffer. No framing, no lookup, no checksum, no
//! copy the kernel does not make.
//!
//! At depth 8 the client asks for all 8 values in one request and reads the reply straight
//! into its 8 buffers (`readv`): the least a round trip carrying 8 values can cost. A put is
//! the same transfer the other way: the request's top bit set, the bytes follow in the same
//! `writev`, the server reads them into a reused buffer and echoes the 8 bytes.
//!
//! Whoever receives a large transfer raises the socket's receive low-water mark as kvpool's
//! client and node do ([`LowWater`]): signalled per MiB, not per segment. Without it the stream
//! would not be the limit: kvpool's pipelined gets outran it.

use std::io::{ErrorKind, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::sync::Arc;

use kvpool::protocol::io::{FrameReader, LowWater};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::driver::Worker;
use super::workloads::{self, Buffers};

/// Marks a request as a put (the length is in the other bits).
const PUT: u64 = 1 << 63;

/// Read buffer of the server's connections, as in kvpool's client and the baselines' clients.
const IO_BUFFER: usize = 64 << 10;

/// The in-process raw TCP server, on its own runtime; stopped when dropped.
pub(crate) struct RawServer {
    rt: Option<tokio::runtime::Runtime>,
    /// Where it listens.
    pub(crate) addr: SocketAddr,
}

impl RawServer {
    /// Starts the server, sending from a buffer of `max_size` bytes (longer replies repeat it).
    pub(crate) fn start(max_size: u64) -> anyhow::Result<RawServer> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("raw-tcp")
            .enable_all()
            .build()?;
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let payload = workloads::value(max_size);
        rt.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, payload.clone()));
            }
        });
        Ok(RawServer { rt: Some(rt), addr })
    }
}

impl Drop for RawServer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Answers the requests of one connection until the client leaves.
async fn serve(mut stream: TcpStream, payload: Arc<Vec<u8>>) -> anyhow::Result<()> {
    stream.set_nodelay(true)?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let (r, mut w) = stream.split();
    let mut r = FrameReader::with_capacity(IO_BUFFER, r);
    let mut sink = Vec::new();
    loop {
        let mut req = [0u8; 8];
        match r.read_exact(&mut req).await {
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            other => other?,
        };
        let word = u64::from_le_bytes(req);
        let len = usize::try_from(word & !PUT)?;
        if word & PUT != 0 {
            if sink.len() < len {
                sink.resize(len, 0);
            }
            let mut water = LowWater::new(Some(fd));
            water.read_exact(&mut r, &mut sink[..len], len).await?;
            water.finish()?;
            w.write_all(&req).await?;
        } else {
            let mut left = len;
            while left > 0 {
                let n = left.min(payload.len());
                anyhow::ensure!(n > 0, "raw tcp: the server has no bytes to send");
                w.write_all(&payload[..n]).await?;
                left -= n;
            }
        }
    }
}

/// Connects to the raw server with the same socket options as the kvpool and baseline clients.
async fn connect(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Gets `depth` values of `size` bytes per round trip: one request for all of them, the reply
/// read into `depth` reused buffers.
pub(crate) struct RawGet {
    stream: TcpStream,
    request: [u8; 8],
    size: usize,
    depth: usize,
    bufs: Buffers,
}

impl RawGet {
    /// A connection to `addr` getting `depth` × `size` bytes per round trip into `bufs`.
    pub(crate) async fn connect(
        addr: SocketAddr,
        size: u64,
        depth: usize,
        bufs: Buffers,
    ) -> anyhow::Result<RawGet> {
        Ok(RawGet {
            stream: connect(addr).await?,
            request: (size * depth as u64).to_le_bytes(),
            size: size as usize,
            depth,
            bufs,
        })
    }
}

impl Worker for RawGet {
    async fn op(&mut self) -> anyhow::Result<u64> {
        self.stream.write_all(&self.request).await?;
        let mut bufs = self.bufs.take(self.depth, self.size);
        read_into(&self.stream, &mut bufs).await?;
        self.bufs.put(bufs);
        Ok((self.depth * self.size) as u64)
    }
}

/// Fills every buffer from the socket, in order, with as few `readv` calls as the kernel
/// allows.
async fn read_into(stream: &TcpStream, bufs: &mut [Vec<u8>]) -> anyhow::Result<()> {
    let mut slices: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
    let mut rest: usize = slices.iter().map(|s| s.len()).sum();
    let mut left = &mut slices[..];
    let mut water = LowWater::new(Some(std::os::fd::AsRawFd::as_raw_fd(stream)));
    while !left.is_empty() {
        water.before_socket_read(rest)?;
        stream.readable().await?;
        match stream.try_read_vectored(left) {
            Ok(0) => anyhow::bail!("raw tcp: connection closed mid-reply"),
            Ok(n) => {
                rest -= n;
                IoSliceMut::advance_slices(&mut left, n);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
    }
    water.finish()?;
    Ok(())
}

/// Sends one value per round trip: header and bytes in one `writev`, then the 8-byte echo.
pub(crate) struct RawPut {
    stream: TcpStream,
    value: Arc<Vec<u8>>,
}

impl RawPut {
    /// A connection to `addr` sending `value` per round trip.
    pub(crate) async fn connect(addr: SocketAddr, value: Arc<Vec<u8>>) -> anyhow::Result<RawPut> {
        Ok(RawPut {
            stream: connect(addr).await?,
            value,
        })
    }
}

impl Worker for RawPut {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let head = (self.value.len() as u64 | PUT).to_le_bytes();
        let mut parts = [IoSlice::new(&head), IoSlice::new(&self.value)];
        let mut parts = &mut parts[..];
        while !parts.is_empty() {
            let n = self.stream.write_vectored(parts).await?;
            anyhow::ensure!(n > 0, "raw tcp: connection closed while sending");
            IoSlice::advance_slices(&mut parts, n);
        }
        let mut echo = [0u8; 8];
        self.stream.read_exact(&mut echo).await?;
        anyhow::ensure!(echo == head, "raw tcp: wrong reply to a put");
        Ok(self.value.len() as u64)
    }
}
