//! The raw TCP stream: the physical limit of loopback TCP for a request/response of a given
//! size on this machine, moving the same bytes between the same amount of memory as kvpool and
//! the baselines do. An in-process server (its own tokio runtime with two workers, like
//! kvpoold's on this machine) on 127.0.0.1:0 holds a data set like theirs: one region in which
//! object `k` of size `s` lies at `k × s`, as many objects as [`workloads::object_count`] gives
//! (512 MiB at 2 MiB, 16× the L3 of typical servers, so a reply is read from DRAM as kvpool's and
//! memcached's are). Each request names its objects; the server writes them straight from the
//! region (`writev`) and the client reads them into a reused buffer. Its get loops walk the
//! objects in the same order as kvpool's (from the same start, `depth` at a time). No framing,
//! lookup or checksum, and no copy the kernel does not make.
//!
//! The server serves a data set rather than one buffer: a single 2 MiB buffer stays in the
//! CPU's caches and would measure a cache-resident transfer, not the limit of serving a data
//! set (docs/BENCHMARKS.md, "How it measures").
//!
//! At depth 8 the client asks for 8 consecutive objects in one request and reads the reply
//! straight into its 8 buffers (`readv`): the least a round trip carrying 8 values can cost. A
//! put is the same transfer the other way: the request and the bytes in one `writev`, the server
//! reads them into one of the connection's slots and echoes the request. Like kvpool's put loops
//! (and the baselines'), each connection cycles through [`workloads::put_keys`]'s number of
//! slots, touched before the first put is received, so a put overwrites memory already in use.
//!
//! Whoever receives a large transfer raises the socket's receive low-water mark as kvpool's
//! client and node do ([`LowWater`]): signalled per MiB, not per segment. Without it the stream
//! would not be the limit: kvpool's pipelined gets outran it.

use std::io::{ErrorKind, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::sync::Arc;

use kvpool::protocol::io::{write_all_vectored, FrameReader, LowWater};
use memmap2::{Advice, MmapMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::driver::Worker;
use super::workloads::{self, Buffers};

/// Marks a request as a put (the value size is in the other bits of its first word).
const PUT: u64 = 1 << 63;

/// A request: three little-endian words. Word 0: the value size, the top bit set for a put.
/// Word 1: a get's first object, a put's slot. Word 2: a get's number of objects, a put's number
/// of slots the connection cycles through. A put's echo is the request itself.
const REQUEST: usize = 24;

/// Most slots a put connection cycles through, and most objects one get asks for: far more than
/// any loop here uses, a bound on what the server allocates for a request.
const MOST: u64 = 1024;

/// Read buffer of the server's connections, as in kvpool's client and the baselines' clients.
const IO_BUFFER: usize = 64 << 10;

/// Bytes of the region that holds the data sets of every size up to `max_size`: the largest
/// `object_count(s) × s` (512 MiB unless `max_size` is over 32 MiB, when 16 objects of it are
/// more).
pub(crate) fn region_bytes(max_size: u64) -> u64 {
    workloads::WORKING_SET.max(16 * max_size)
}

/// The in-process raw TCP server, on its own runtime; stopped when dropped.
pub(crate) struct RawServer {
    rt: Option<tokio::runtime::Runtime>,
    /// Where it listens.
    pub(crate) addr: SocketAddr,
}

impl RawServer {
    /// Starts the server with a data set of `bytes` ([`region_bytes`] for the data sets of
    /// [`workloads`]).
    pub(crate) fn start(bytes: u64) -> anyhow::Result<RawServer> {
        RawServer::with_region(Arc::new(region(bytes)?))
    }

    /// Starts the server with the data set `region`.
    fn with_region(region: Arc<MmapMut>) -> anyhow::Result<RawServer> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("raw-tcp")
            .enable_all()
            .build()?;
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        rt.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, region.clone()));
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

/// A data set of `bytes` of [`workloads::value`]'s noise, in anonymous memory advised for
/// transparent huge pages before its first touch: kvpool's segments are on 2 MiB pages
/// (docs/ARCHITECTURE.md, "Huge pages"), and a limit on 4 KiB pages would pay for page walks
/// kvpool does not.
fn region(bytes: u64) -> anyhow::Result<MmapMut> {
    let mut m = MmapMut::map_anon(usize::try_from(bytes)?.max(1))?;
    // Advice only: a kernel without transparent huge pages leaves the pages at 4 KiB.
    let _ = m.advise(Advice::HugePage);
    workloads::fill_noise(&mut m);
    Ok(m)
}

/// Where object `k` of `size` bytes lies in `region`: objects wrap at the region's end, as a
/// data set of `region.len() / size` objects.
fn object(region: &[u8], size: usize, k: u64) -> anyhow::Result<&[u8]> {
    anyhow::ensure!(
        size > 0 && size <= region.len(),
        "raw tcp: no object of {size} bytes in the region"
    );
    let count = (region.len() / size) as u64;
    let at = (k % count) as usize * size;
    Ok(&region[at..at + size])
}

/// Answers the requests of one connection until the client leaves.
async fn serve(mut stream: TcpStream, region: Arc<MmapMut>) -> anyhow::Result<()> {
    stream.set_nodelay(true)?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let (r, mut w) = stream.split();
    let mut r = FrameReader::with_capacity(IO_BUFFER, r);
    // The put slots of this connection, all of one size.
    let mut slots: Vec<Vec<u8>> = Vec::new();
    loop {
        let mut req = [0u8; REQUEST];
        match r.read_exact(&mut req).await {
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            other => other?,
        };
        let word = |i: usize| u64::from_le_bytes(req[8 * i..8 * i + 8].try_into().unwrap());
        let (size, first, n) = (word(0) & !PUT, word(1), word(2));
        anyhow::ensure!(
            n > 0 && n <= MOST,
            "raw tcp: a request for {n} objects or slots"
        );
        let size = usize::try_from(size)?;
        if word(0) & PUT != 0 {
            anyhow::ensure!(first < n, "raw tcp: slot {first} of {n}");
            if slots.len() != n as usize || slots[0].len() != size {
                // Touched now (a non-zero fill), so that no put pays for first-touch faults.
                slots = (0..n).map(|_| vec![0xa5u8; size]).collect();
            }
            let slot = &mut slots[first as usize];
            let mut water = LowWater::new(Some(fd));
            water.read_exact(&mut r, slot, size).await?;
            water.finish()?;
            w.write_all(&req).await?;
        } else {
            let mut parts = (0..n)
                .map(|i| object(&region, size, first + i).map(IoSlice::new))
                .collect::<anyhow::Result<Vec<_>>>()?;
            write_all_vectored(&mut w, &mut parts).await?;
        }
    }
}

/// A request for `n` objects of `size` from object `first` (a put: slot `first` of `n`).
fn request(size: u64, first: u64, n: u64) -> [u8; REQUEST] {
    let mut req = [0u8; REQUEST];
    for (i, x) in [size, first, n].into_iter().enumerate() {
        req[8 * i..8 * i + 8].copy_from_slice(&x.to_le_bytes());
    }
    req
}

/// Connects to the raw server with the same socket options as the kvpool and baseline clients.
async fn connect(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Gets `depth` values of `size` bytes per round trip: one request for `depth` consecutive
/// objects of the data set, the reply read into `depth` reused buffers.
pub(crate) struct RawGet {
    stream: TcpStream,
    size: usize,
    depth: usize,
    /// Objects the loop walks through, as many as its kvpool counterpart's keys.
    objects: usize,
    /// The next round trip's first object.
    next: usize,
    bufs: Buffers,
}

impl RawGet {
    /// A connection to `addr` getting `depth` values of `size` per round trip into `bufs`,
    /// walking through `objects` objects from object `start` as [`KvGet`] walks through its keys.
    ///
    /// [`KvGet`]: super::workloads::KvGet
    pub(crate) async fn connect(
        addr: SocketAddr,
        size: u64,
        depth: usize,
        objects: usize,
        start: usize,
        bufs: Buffers,
    ) -> anyhow::Result<RawGet> {
        anyhow::ensure!(objects > 0, "raw tcp: a get loop over no objects");
        Ok(RawGet {
            stream: connect(addr).await?,
            size: size as usize,
            depth,
            objects,
            next: start % objects,
            bufs,
        })
    }
}

impl Worker for RawGet {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let req = request(self.size as u64, self.next as u64, self.depth as u64);
        self.stream.write_all(&req).await?;
        self.next = (self.next + self.depth) % self.objects;
        let mut bufs = self.bufs.take(self.depth, self.size);
        read_into(&self.stream, &mut bufs).await?;
        self.bufs.put(bufs);
        Ok((self.depth * self.size) as u64)
    }
}

/// Fills every buffer from the socket, in order, with as few `readv` calls as the kernel
/// allows. The low-water mark is set per value, as kvpool's client sets it: to what the value
/// being filled still lacks (at most 1 MiB), so that its tail wakes the reader as soon as it
/// is all here. One mark over the whole reply made kvpool's batches much slower.
async fn read_into(stream: &TcpStream, bufs: &mut [Vec<u8>]) -> anyhow::Result<()> {
    let fd = std::os::fd::AsRawFd::as_raw_fd(stream);
    let mut slices: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
    let mut left = &mut slices[..];
    let mut water = LowWater::new(Some(fd));
    while !left.is_empty() {
        let values = left.len();
        water.before_socket_read(left[0].len())?;
        stream.readable().await?;
        match stream.try_read_vectored(left) {
            Ok(0) => anyhow::bail!("raw tcp: connection closed mid-reply"),
            Ok(n) => IoSliceMut::advance_slices(&mut left, n),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
        if left.len() < values {
            // The value being filled is complete: the next one starts from a mark of 1.
            std::mem::replace(&mut water, LowWater::new(Some(fd))).finish()?;
        }
    }
    water.finish()?;
    Ok(())
}

/// Sends one value per round trip: request and bytes in one `writev`, then the echo. Cycles
/// through as many slots as its kvpool counterpart ([`KvPut`]) cycles through keys.
///
/// [`KvPut`]: super::workloads::KvPut
pub(crate) struct RawPut {
    stream: TcpStream,
    value: Arc<Vec<u8>>,
    slots: usize,
    next: usize,
}

impl RawPut {
    /// A connection to `addr` sending `value` per round trip, as one of `conns` put loops.
    pub(crate) async fn connect(
        addr: SocketAddr,
        value: Arc<Vec<u8>>,
        conns: usize,
    ) -> anyhow::Result<RawPut> {
        Ok(RawPut {
            stream: connect(addr).await?,
            slots: workloads::put_keys_per_loop(value.len() as u64, conns),
            value,
            next: 0,
        })
    }
}

impl Worker for RawPut {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let head = request(
            self.value.len() as u64 | PUT,
            self.next as u64,
            self.slots as u64,
        );
        self.next = (self.next + 1) % self.slots;
        let mut parts = [IoSlice::new(&head), IoSlice::new(&self.value)];
        write_all_vectored(&mut self.stream, &mut parts).await?;
        let mut echo = [0u8; REQUEST];
        self.stream.read_exact(&mut echo).await?;
        anyhow::ensure!(echo == head, "raw tcp: wrong reply to a put");
        Ok(self.value.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server's data set: 16 objects of 4 KiB.
    fn server() -> (RawServer, Arc<MmapMut>) {
        let region = Arc::new(region(16 * 4096).unwrap());
        assert!(region[..] == workloads::value(16 * 4096)[..]);
        (RawServer::with_region(region.clone()).unwrap(), region)
    }

    #[test]
    fn a_get_walks_the_data_set_like_kvpools_loop() {
        let (srv, region) = server();
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let bufs = Buffers::default();
            // 16 objects from object 14, three per round trip: 14 15 0, then 1 2 3.
            let mut get = RawGet::connect(srv.addr, 4096, 3, 16, 14, bufs.clone())
                .await
                .unwrap();
            for firsts in [[14, 15, 0], [1, 2, 3]] {
                assert_eq!(get.op().await.unwrap(), 3 * 4096);
                let got = bufs.take(3, 4096);
                for (b, k) in got.iter().zip(firsts) {
                    assert!(b[..] == region[k * 4096..(k + 1) * 4096], "object {k}");
                }
                bufs.put(got);
            }
        });
    }

    #[test]
    fn a_put_cycles_through_its_slots_and_a_bad_slot_ends_the_connection() {
        let (srv, _) = server();
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let value = workloads::value(4096);
            let mut put = RawPut::connect(srv.addr, value, 1).await.unwrap();
            let slots = workloads::put_keys_per_loop(4096, 1);
            assert!(slots > 1);
            for _ in 0..slots + 1 {
                assert_eq!(put.op().await.unwrap(), 4096);
            }
            assert_eq!(put.next, 1);
            put.next = slots;
            assert!(put.op().await.is_err(), "slot {slots} of {slots} was taken");
        });
    }
}
