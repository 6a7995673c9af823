//! The fabric path to one node (`fabric://` endpoints): control over TCP, and values read
//! one-sidedly out of the node's registered segments over libfabric (`tcp`, `shm`,
//! `verbs;ofi_rxm`, `efa`: the provider the node names).
//!
//! A get looks its keys up in one round trip (address, checksum), reads every object's bytes
//! into a registered buffer with several reads in flight, then each object's version word, and
//! copies the bytes out hashing them in the same pass. An object whose word no longer says
//! "generation g, committed, current" was removed, replaced or evicted while it was read: it
//! is fetched through the socket instead. Bytes whose word held but whose hash differs are a
//! checksum error, as on every other path. Any failure of the fabric itself also falls back to
//! the socket, so a read over the fabric is never worse than a miss.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use kvpool::protocol::{FabricSegment, HelloInfo, Op, Reply};
use kvpool::segment::SegmentLayout;
use kvpool_fabric::{Endpoint, Fabric, Peer, Region, Remote};

use super::local_get::prefix_run;
use super::{unexpected, Link};
use crate::config::ClientConfig;
use crate::conn::Conn;
use crate::cores::off_runtime;
use crate::dst::{dst_len, fit, Dst};
use crate::error::ClientError;
use crate::located::Located;

/// Reads kept in flight at once.
const DEPTH: usize = 8;

/// The most one read into a caller's buffer carries: a value is read in chunks of this, each
/// hashed as soon as it lands while the next are in flight.
const CHUNK: usize = 512 << 10;

/// A lane's buffer to start with, and the most it keeps (a larger one is given back once used).
const LANE_BUF: usize = 4 << 20;
const LANE_BUF_KEEP: usize = 64 << 20;

/// The header page at the start of each segment, read at open.
const HEADER: usize = 4096;

/// One endpoint of this client with the node's address inserted and a registered buffer
/// reads land in; a call takes one for itself.
struct Lane {
    ep: Endpoint,
    node: Peer,
    buf: Region,
}

/// One segment of the node as this client reaches it.
struct Seg {
    remote: Remote,
    layout: SegmentLayout,
}

/// The node's fabric, as one incarnation of its daemon offered it.
pub(super) struct FabricState {
    fabric: Fabric,
    address: Vec<u8>,
    incarnation: u64,
    segments: HashMap<u32, Seg>,
    lanes: Mutex<Vec<Lane>>,
    /// Reads land straight in the caller's buffers (the provider needs no local registration).
    direct: bool,
}

/// What a link keeps of a node's fabric: the state of the current incarnation, or None while
/// the socket serves (the node's daemon restarted and the new fabric is not open yet).
pub(super) struct FabricPath {
    state: RwLock<Option<Arc<FabricState>>>,
}

impl FabricPath {
    /// Asks the node for its fabric over `conn` and opens it; an error says why the node or
    /// this client cannot serve `fabric://`.
    pub(super) async fn open(
        conn: &mut Conn,
        hello: &HelloInfo,
    ) -> Result<FabricPath, ClientError> {
        let state = FabricState::open(conn, hello).await?;
        Ok(FabricPath {
            state: RwLock::new(Some(Arc::new(state))),
        })
    }

    /// The current state, if open.
    pub(super) fn state(&self) -> Option<Arc<FabricState>> {
        self.state.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// After the node's daemon restarted: the old registrations died with it; opens the new
    /// fabric over `conn`, or leaves the socket to serve when that fails.
    pub(super) async fn reopen(&self, conn: &mut Conn, hello: &HelloInfo) {
        *self.state.write().unwrap_or_else(|e| e.into_inner()) = None;
        match FabricState::open(conn, hello).await {
            Ok(s) => *self.state.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(s)),
            Err(e) => {
                tracing::warn!(error = %e, "the node's fabric did not reopen: the socket serves")
            }
        }
    }
}

impl FabricState {
    async fn open(conn: &mut Conn, hello: &HelloInfo) -> Result<FabricState, ClientError> {
        let (reply, _) = conn.call(Op::FabricInfo, &[]).await?;
        let Reply::FabricInfo {
            incarnation,
            provider,
            address,
            segments,
        } = reply
        else {
            return Err(unexpected(&reply));
        };
        if incarnation != hello.incarnation {
            return Err(ClientError::Protocol(
                "FabricInfo names another incarnation than the handshake".into(),
            ));
        }
        let fabric = Fabric::open(&provider).map_err(|e| fabric_error(&provider, &e))?;
        let state = FabricState {
            fabric,
            address,
            incarnation,
            segments: HashMap::new(),
            lanes: Mutex::new(Vec::new()),
            direct: false,
        };
        let node = hello.node;
        off_runtime(u64::MAX, || state.read_headers(node, segments))
    }

    /// Reads and checks each segment's header (it names the node, the segment, the layout,
    /// and holds the incarnation), so reads are placed by the layout the node wrote.
    fn read_headers(
        mut self,
        node: u32,
        offered: Vec<FabricSegment>,
    ) -> Result<FabricState, ClientError> {
        let provider = self.fabric.provider();
        let mut lane = self.lane(HEADER).map_err(|e| fabric_error(&provider, &e))?;
        for s in offered {
            let remote = Remote {
                addr: s.addr,
                key: s.key,
                len: s.total_len,
            };
            lane.ep
                .read_many(&mut lane.buf, &[(0..HEADER, lane.node, remote, 0)], 1)
                .map_err(|e| fabric_error(&provider, &e))?;
            let head = &lane.buf.bytes()[..HEADER];
            let layout = SegmentLayout::decode(head, s.total_len).map_err(|e| {
                ClientError::Protocol(format!("segment {} over the fabric: {e}", s.id))
            })?;
            let word_at = kvpool::segment::INCARNATION_OFFSET;
            let word = u64::from_ne_bytes(head[word_at..word_at + 8].try_into().expect("8 bytes"));
            if layout.id != s.id || layout.node.0 != node || word != self.incarnation {
                return Err(ClientError::Protocol(format!(
                    "segment {} over the fabric is not the one offered",
                    s.id
                )));
            }
            self.segments.insert(s.id, Seg { remote, layout });
        }
        // `KVPOOL_FABRIC_BOUNCE=1` takes the path of providers that require registered
        // buffers (verbs, EFA) on any provider, so that it is tested where they are not.
        self.direct = lane.ep.reads_into_any_memory()
            && std::env::var_os("KVPOOL_FABRIC_BOUNCE").is_none_or(|v| v != "1");
        self.give_back(lane);
        Ok(self)
    }

    /// A lane whose buffer holds at least `len` bytes: an idle one, or a new one.
    fn lane(&self, len: usize) -> Result<Lane, kvpool_fabric::Error> {
        let idle = self.lanes.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut lane = match idle {
            Some(l) => l,
            None => {
                let ep = self.fabric.endpoint()?;
                let node = ep.insert(&self.address)?;
                let buf = ep.register(LANE_BUF, false, false)?;
                Lane { ep, node, buf }
            }
        };
        if lane.buf.len() < len {
            lane.buf = lane
                .ep
                .register(len.next_multiple_of(1 << 20), false, false)?;
        }
        Ok(lane)
    }

    fn give_back(&self, mut lane: Lane) {
        if lane.buf.len() > LANE_BUF_KEEP {
            match lane.ep.register(LANE_BUF, false, false) {
                Ok(b) => lane.buf = b,
                Err(_) => return,
            }
        }
        self.lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(lane);
    }

    /// Where the object at `addr` lies in its segment's registration: its bytes from `offset`
    /// for `len`, and its version word; None when the address is not of this fabric or out of
    /// the segment's bounds.
    fn place(
        &self,
        addr: &kvpool::GlobalAddr,
        offset: u64,
        len: u64,
    ) -> Option<(Remote, u64, u64)> {
        if addr.incarnation != self.incarnation {
            return None;
        }
        let seg = self.segments.get(&addr.segment)?;
        let l = &seg.layout;
        let end = addr.offset.checked_add(addr.len)?;
        if end > l.data_len || addr.offset % l.granule != 0 || offset.checked_add(len)? > addr.len {
            return None;
        }
        let data = l.data_offset + addr.offset + offset;
        let word = l.versions_offset + (addr.offset / l.granule) * 8;
        Some((seg.remote, data, word))
    }

    /// Reads the `located` objects into `dsts` (`located[i]` into `dsts[i]`): per key Some(true)
    /// when read and checked, Some(false) when it changed meanwhile (or is not reachable over
    /// the fabric: the socket serves it), None for a key with no location. With `verify`, the
    /// bytes are hashed as they are copied out and compared with the lookup's checksum.
    pub(super) fn read_all(
        &self,
        located: &[Option<Located>],
        dsts: &mut [Dst<'_, '_>],
        verify: bool,
        current: bool,
    ) -> Result<Vec<Option<bool>>, ClientError> {
        let mut out = vec![None; located.len()];
        let mut jobs = Vec::new();
        for (i, (l, d)) in located.iter().zip(dsts.iter()).enumerate() {
            let Some(l) = l else { continue };
            let (need, have) = (l.addr.len, dst_len(d));
            if need > have {
                return Err(ClientError::BufferTooSmall { need, have });
            }
            match self.place(&l.addr, 0, l.addr.len) {
                Some(p) => jobs.push((i, *l, p)),
                None => out[i] = Some(false),
            }
        }
        // Batches of objects that fit a lane's buffer together (one alone when larger); read
        // straight into the caller's buffers, one batch.
        let mut start = 0;
        while start < jobs.len() {
            let mut bytes = 0usize;
            let mut end = start;
            while end < jobs.len() {
                let n = (jobs[end].1.addr.len as usize).next_multiple_of(8) + 8;
                if end > start && bytes + n > LANE_BUF_KEEP && !self.direct {
                    break;
                }
                bytes += n;
                end += 1;
            }
            let batch = &jobs[start..end];
            let read = if self.direct {
                self.read_direct(batch, dsts, verify, current)
            } else {
                self.read_batch(batch, bytes, dsts, verify, current)
            };
            match read {
                Ok(done) => {
                    for (k, ok) in done.into_iter().enumerate() {
                        out[batch[k].0] = Some(ok);
                    }
                }
                Err(ClientError::Checksum) => return Err(ClientError::Checksum),
                Err(e) => {
                    tracing::debug!(error = %e, "a read over the fabric failed: the socket serves");
                    for j in batch {
                        out[j.0] = Some(false);
                    }
                }
            }
            start = end;
        }
        Ok(out)
    }

    /// [`FabricState::read_all`] where the provider reads into memory nobody registered (tcp,
    /// shm): every object's bytes straight into the caller's buffers (each piece of a
    /// scattered one read on its own), then every version word, then the bytes hashed where
    /// they landed. An object whose word moved on leaves what was read in its buffers, as a
    /// same-host copy does, and is reported changed.
    fn read_direct(
        &self,
        batch: &[(usize, Located, (Remote, u64, u64))],
        dsts: &mut [Dst<'_, '_>],
        verify: bool,
        current: bool,
    ) -> Result<Vec<bool>, ClientError> {
        let provider = || self.fabric.provider();
        let mut lane = self.lane(0).map_err(|e| fabric_error(&provider(), &e))?;
        let mut slots: Vec<Option<&mut Dst<'_, '_>>> = dsts.iter_mut().map(Some).collect();
        let mut fits = Vec::with_capacity(batch.len());
        for (i, l, _) in batch {
            let dst = slots[*i].take().expect("one job per key");
            let have = dst_len(dst);
            let fitted = fit(dst, l.addr.len).ok_or(ClientError::BufferTooSmall {
                need: l.addr.len,
                have,
            })?;
            fits.push(fitted);
        }
        let node = lane.node;
        // Each piece in chunks, so that the ones landed are hashed while later ones are in
        // flight; `owner[r]` is the object read `r` belongs to.
        let mut reads = Vec::with_capacity(batch.len());
        let mut owner = Vec::with_capacity(batch.len());
        for (k, (fitted, (_, _, (remote, data_at, _)))) in fits.iter_mut().zip(batch).enumerate() {
            let mut at = *data_at;
            for piece in fitted.pieces().iter_mut() {
                for chunk in piece.chunks_mut(CHUNK) {
                    let n = chunk.len() as u64;
                    reads.push((chunk, node, *remote, at));
                    owner.push(k);
                    at += n;
                }
            }
        }
        let mut hashers: Vec<_> = batch
            .iter()
            .map(|_| kvpool::checksum::Hasher::new())
            .collect();
        let mut order = InOrder::default();
        let mut in_order = false;
        let mut words = vec![0u8; 8 * batch.len()];
        let landed = |r: usize, bytes: &[u8]| {
            if verify && order.landed(r) {
                hashers[owner[r]].update(bytes);
            }
        };
        let read = lane
            .ep
            .read_many_into_each(&mut reads, DEPTH, landed)
            .and_then(|()| {
                in_order = order.all(reads.len());
                drop(reads);
                let mut w: Vec<_> = words
                    .chunks_mut(8)
                    .zip(batch)
                    .map(|(w, (_, _, (remote, _, word_at)))| (w, node, *remote, *word_at))
                    .collect();
                // After every byte landed, as in `read_batch`.
                lane.ep.read_many_into(&mut w, DEPTH)
            });
        if let Err(e) = read {
            return Err(fabric_error(&provider(), &e));
        }
        self.give_back(lane);
        let mut done = Vec::with_capacity(batch.len());
        let mut failed = None;
        for ((fitted, (_, l, _)), w) in fits.iter_mut().zip(batch).zip(words.chunks(8)) {
            let word = u64::from_ne_bytes(w.try_into().expect("8 bytes"));
            if !word_holds(word, l.addr.generation, current) {
                done.push(false);
                continue;
            }
            if verify {
                let sum = if in_order {
                    hashers[done.len()].digest()
                } else {
                    let mut h = kvpool::checksum::Hasher::new();
                    for p in fitted.pieces().iter() {
                        h.update(p);
                    }
                    h.digest()
                };
                if sum != l.checksum {
                    failed = Some(ClientError::Checksum);
                }
            }
            done.push(true);
        }
        failed.map_or(Ok(done), Err)
    }

    /// A one-sided read by address: `dst.len()` bytes of the object at `addr` from `offset`,
    /// straight into `dst`, then its version word (the object may be held or leased: a
    /// detached object still reads). None when the fabric cannot serve it (another
    /// incarnation's address, out of the segment, a provider that requires registered buffers,
    /// a fabric failure): the socket serves it then. Some(None) when the object is gone or was
    /// replaced; Some(Some(its bytes' xxh3-64, or 0 without `hash`)) when read.
    pub(super) fn read_range(
        &self,
        addr: &kvpool::GlobalAddr,
        offset: u64,
        dst: &mut [u8],
        hash: bool,
    ) -> Option<Option<u64>> {
        let (remote, data_at, word_at) = self.place(addr, offset, dst.len() as u64)?;
        if !self.direct {
            return None;
        }
        let mut lane = self.lane(0).ok()?;
        let node = lane.node;
        let mut hasher = kvpool::checksum::Hasher::new();
        let mut order = InOrder::default();
        let mut in_order = false;
        let mut reads: Vec<_> = dst
            .chunks_mut(CHUNK)
            .scan(data_at, |at, chunk| {
                let here = *at;
                *at += chunk.len() as u64;
                Some((chunk, node, remote, here))
            })
            .collect();
        let landed = |r: usize, bytes: &[u8]| {
            if hash && order.landed(r) {
                hasher.update(bytes);
            }
        };
        let mut word = [0u8; 8];
        let read = lane
            .ep
            .read_many_into_each(&mut reads, DEPTH, landed)
            .and_then(|()| {
                in_order = order.all(reads.len());
                drop(reads);
                lane.ep
                    .read_many_into(&mut [(&mut word[..], node, remote, word_at)], 1)
            });
        if let Err(e) = read {
            tracing::debug!(error = %e, "a read over the fabric failed: the socket serves");
            return None;
        }
        self.give_back(lane);
        if !word_holds(u64::from_ne_bytes(word), addr.generation, false) {
            return Some(None);
        }
        if !hash {
            return Some(Some(0));
        }
        Some(Some(if in_order {
            hasher.digest()
        } else {
            kvpool::checksum::checksum(dst)
        }))
    }

    /// One batch of [`FabricState::read_all`]: every object's bytes, then every version word.
    fn read_batch(
        &self,
        batch: &[(usize, Located, (Remote, u64, u64))],
        bytes: usize,
        dsts: &mut [Dst<'_, '_>],
        verify: bool,
        current: bool,
    ) -> Result<Vec<bool>, ClientError> {
        let provider = || self.fabric.provider();
        let mut lane = self
            .lane(bytes)
            .map_err(|e| fabric_error(&provider(), &e))?;
        let mut data = Vec::with_capacity(batch.len());
        let mut words = Vec::with_capacity(batch.len());
        let mut at = 0usize;
        for (_, l, (remote, data_at, _)) in batch {
            let n = l.addr.len as usize;
            data.push((at..at + n, lane.node, *remote, *data_at));
            at += n.next_multiple_of(8);
        }
        for (_, _, (remote, _, word_at)) in batch {
            words.push((at..at + 8, lane.node, *remote, *word_at));
            at += 8;
        }
        // The words are read only once every byte has landed: a word that still says
        // generation g then was g all along the bytes' read (generations are never reused, and
        // an owner marks the word before it writes a byte).
        let read = lane
            .ep
            .read_many(&mut lane.buf, &data, DEPTH)
            .and_then(|()| lane.ep.read_many(&mut lane.buf, &words, DEPTH));
        if let Err(e) = read {
            // The lane's connection may be gone (a provider closes it after a fault): a new
            // one is made for the next call.
            return Err(fabric_error(&provider(), &e));
        }
        let buf = lane.buf.bytes();
        let mut done = Vec::with_capacity(batch.len());
        let mut failed = None;
        for (k, (i, l, _)) in batch.iter().enumerate() {
            let w = &words[k].0;
            let word = u64::from_ne_bytes(buf[w.clone()].try_into().expect("8 bytes"));
            if !word_holds(word, l.addr.generation, current) {
                done.push(false);
                continue;
            }
            let src = &buf[data[k].0.clone()];
            let Some(mut fitted) = fit(dsts[*i], l.addr.len) else {
                return Err(ClientError::BufferTooSmall {
                    need: l.addr.len,
                    have: dst_len(dsts[*i]),
                });
            };
            let pieces = fitted.pieces();
            if verify {
                // SAFETY: `src` is this lane's own buffer, read completely (read_many returned),
                // `src.len()` bytes, the pieces' total (fit); the caller's pieces cannot overlap it.
                let sum = unsafe { kvpool::checksum::copy_checksum_scatter(src.as_ptr(), pieces) };
                if sum != l.checksum {
                    failed = Some(ClientError::Checksum);
                }
            } else {
                let mut from = 0;
                for p in pieces.iter_mut() {
                    let n = p.len();
                    p.copy_from_slice(&src[from..from + n]);
                    from += n;
                }
            }
            done.push(true);
        }
        self.give_back(lane);
        failed.map_or(Ok(done), Err)
    }
}

/// Which reads may be hashed as they land: those that land in the order they were posted.
/// Reads of one peer complete in that order on these providers; should one not, the hashing
/// stops and the caller hashes the buffers again once every read has landed.
struct InOrder {
    next: usize,
    kept: bool,
}

impl Default for InOrder {
    fn default() -> Self {
        InOrder {
            next: 0,
            kept: true,
        }
    }
}

impl InOrder {
    /// Read `r` landed: whether its bytes come next in the hash.
    fn landed(&mut self, r: usize) -> bool {
        self.kept &= r == self.next;
        if self.kept {
            self.next += 1;
        }
        self.kept
    }

    /// Whether all `reads` were hashed in order as they landed.
    fn all(&self, reads: usize) -> bool {
        self.kept && self.next == reads
    }
}

/// Whether an object's version word, read after its bytes, says they are generation
/// `generation`'s, committed (and, with `current`, still its key's value: not detached).
fn word_holds(word: u64, generation: u64, current: bool) -> bool {
    let detached_ok = if current { 0 } else { 2 };
    word & !detached_ok == generation << 2
}

/// A fabric failure as the client reports it.
fn fabric_error(provider: &str, e: &kvpool_fabric::Error) -> ClientError {
    ClientError::Io(std::io::Error::other(format!(
        "fabric provider {provider:?}: {e}"
    )))
}

impl Link {
    /// [`Link::get_many`] over the fabric (`st`): one lookup round trip, then every object
    /// read one-sidedly; those that changed meanwhile (or that the fabric failed to read) are
    /// fetched through the socket.
    #[expect(clippy::too_many_arguments, reason = "get_many's own parameters")]
    pub(super) async fn get_fabric(
        self: &Arc<Self>,
        st: Arc<FabricState>,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        prefix: bool,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        let mut located = self.lookup(cfg, view, ns, keys, 0).await?;
        if prefix {
            if let Some(gap) = located.iter().position(Option::is_none) {
                located[gap..].fill(None);
            }
        }
        let verify = cfg.verify_checksums;
        let read = off_runtime(u64::MAX, || st.read_all(&located, dsts, verify, true))?;
        let mut out = vec![None; keys.len()];
        let mut fallback = Vec::new();
        for (i, r) in read.into_iter().enumerate() {
            match r {
                Some(true) => out[i] = located[i].map(|l| l.addr.len as usize),
                Some(false) => fallback.push(i),
                None => {}
            }
        }
        self.get_replaced(cfg, ns, keys, dsts, fallback, &mut out)
            .await?;
        Ok(prefix_run(out, prefix))
    }

    /// [`Link::get`] over the fabric: Some(the answer), or None when the socket has to serve
    /// it (the object changed between the lookup and the read).
    pub(super) async fn get_one_fabric(
        &self,
        st: Arc<FabricState>,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        key: &[u8],
    ) -> Result<Option<Option<Vec<u8>>>, ClientError> {
        let Some(l) = self.lookup(cfg, view, ns, &[key], 0).await?.pop().flatten() else {
            return Ok(Some(None));
        };
        let mut buf = vec![0u8; l.addr.len as usize];
        let verify = cfg.verify_checksums;
        let read = off_runtime(u64::MAX, || {
            st.read_all(&[Some(l)], &mut [&mut [&mut buf[..]]], verify, true)
        })?;
        Ok((read.first() == Some(&Some(true))).then_some(Some(buf)))
    }
}
