//! Same-host reads: values copied straight out of the node's mapping into the caller's
//! buffers, found by this client's index of where objects are or by one lookup round trip, each
//! copy checked against the object's version (and checksum); and holds, which keep objects in
//! place for reading without a copy.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvpool::protocol::{ErrorCode, Op, Reply};
use kvpool::AddrFault;

use super::same_host::SameHostPath;
use super::{fault, owned, unexpected, Link};
use crate::config::ClientConfig;
use crate::conn::Conn;
use crate::cores::{off_runtime, CopyThreads};
use crate::dst::{dst_len, fit, Dst, Fit};
use crate::error::ClientError;
use crate::local::{LocalMap, LocalReadError};
use crate::located::Located;
use crate::seen::Reads;

impl Link {
    /// [`Link::get_many`] on the same host (`sh`): keys this client has seen are copied
    /// straight from the mapping; the rest are looked up in one round trip (leased for
    /// `lease_ms`) and copied.
    #[expect(clippy::too_many_arguments, reason = "get_many's own parameters")]
    pub(super) async fn get_local(
        self: &Arc<Self>,
        sh: &SameHostPath,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        prefix: bool,
        lease_ms: u64,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        let mut out = vec![None; keys.len()];
        let (todo, report) = get_seen(sh, cfg, ns, keys, dsts, &mut out, prefix)?;
        if let Some(batch) = report {
            self.report(cfg, batch);
        }
        if todo.is_empty() {
            return Ok(prefix_run(out, prefix));
        }
        // The keys the index did not know take a round trip. That part is boxed so that the
        // future of the common case, every key copied from the index, stays small: inline, the
        // lookup's and the fallback's futures were part of it, and with `Client::link`'s
        // (boxed as well) made the request future `fan_out` moves on every call about 11 KB,
        // aligned for the hasher (a `memalign` per call; BENCHMARKS.md, local section).
        Box::pin(async move {
            let sub: Vec<&[u8]> = todo.iter().map(|&i| keys[i]).collect();
            let found = self.lookup(cfg, view, ns, &sub, lease_ms).await?;
            self.arm_watch(sh, cfg);
            let mut located = vec![None; keys.len()];
            for (&i, l) in todo.iter().zip(&found) {
                located[i] = *l;
            }
            let leased: Vec<Vec<u8>> = if lease_ms > 0 {
                todo.iter()
                    .filter(|&&i| located[i].is_some())
                    .map(|&i| keys[i].to_vec())
                    .collect()
            } else {
                Vec::new()
            };
            if prefix {
                // Nothing after the first key found neither in the index nor by the lookup is
                // written: the caller's buffers past the run keep what they held.
                if let Some(gap) =
                    (0..keys.len()).find(|&i| out[i].is_none() && located[i].is_none())
                {
                    located[gap..].fill(None);
                }
            }
            let mut fallback = Vec::new();
            self.copy_located(cfg, &located, &todo, dsts, (&mut out, &mut fallback))?;
            {
                let mut seen = sh.seen();
                for &i in &todo {
                    if let (Some(l), Some(_)) = (located[i], out[i]) {
                        seen.insert(ns, keys[i], l);
                    }
                }
            }
            if !leased.is_empty() {
                self.count(cfg, 0, Op::Release { ns, keys: leased }).await?;
            }
            self.get_replaced(cfg, ns, keys, dsts, fallback, &mut out)
                .await?;
            Ok(prefix_run(out, prefix))
        })
        .await
    }

    /// Objects replaced between lookup and copy (`which`): fetched through the socket, `out[i]`
    /// their lengths.
    pub(super) async fn get_replaced(
        &self,
        cfg: &ClientConfig,
        ns: u32,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        which: Vec<usize>,
        out: &mut [Option<usize>],
    ) -> Result<(), ClientError> {
        for i in which {
            out[i] = self
                .get_remote(
                    cfg,
                    0,
                    ns,
                    &[keys[i]],
                    std::slice::from_mut(&mut dsts[i]),
                    false,
                )
                .await?
                .pop()
                .flatten();
        }
        Ok(())
    }

    /// [`Link::get`] on the same host (`sh`): copied out of the mapping, found by this client's
    /// index or by a lookup. Some(the answer), or None when the socket has to serve it (the
    /// object was replaced between the lookup and the copy).
    pub(super) async fn get_one_local(
        self: &Arc<Self>,
        sh: &SameHostPath,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        key: &[u8],
    ) -> Result<Option<Option<Vec<u8>>>, ClientError> {
        let known = sh.seen().get(ns, key);
        if let (Some((l, shared)), Some(local)) = (known, sh.local().filter(|_| sh.watch.alive())) {
            let mut buf = vec![0u8; l.addr.len as usize];
            if read_checked(cfg, &local, &l, &mut [&mut buf[..]], true)? {
                let report = sh.seen().touch(ns, shared);
                if let Some(batch) = report {
                    self.report(cfg, batch);
                }
                return Ok(Some(Some(buf)));
            }
            sh.seen().forget(ns, key, &l);
        }
        let found = self.lookup(cfg, view, ns, &[key], 0).await?.pop().flatten();
        self.arm_watch(sh, cfg);
        let Some(l) = found else {
            return Ok(Some(None));
        };
        let mut buf = vec![0u8; l.addr.len as usize];
        if self.read_local_checked(cfg, &l, &mut buf)? {
            sh.seen().insert(ns, key, l);
            return Ok(Some(Some(buf)));
        }
        Ok(None)
    }

    /// Starts a watch of the node's life for the index of `sh` (see
    /// [`Watch`](super::watch::Watch)).
    fn arm_watch(&self, sh: &SameHostPath, cfg: &ClientConfig) {
        let incarnation = self.incarnation.load(Ordering::Acquire);
        sh.watch.arm(cfg, &self.endpoint, incarnation);
    }

    /// Holds `keys` for reading in place (`Op::Hold`) on a connection of their own, which the
    /// caller keeps for as long as it reads the objects' memory: the holds end when it is
    /// dropped. Only on a same-host link; the mapping returned is of the incarnation that
    /// connection reached (a restart in between is refused as `WrongIncarnation`).
    pub(crate) async fn hold(
        &self,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
    ) -> Result<(Conn, Arc<LocalMap>, Vec<Option<Located>>), ClientError> {
        let local = self.local().ok_or(ClientError::Server {
            code: ErrorCode::NotLocal,
            message: "the node is not mapped by this client".into(),
        })?;
        let work = async {
            let (mut conn, hello) = Conn::open(&self.endpoint, cfg, (None, false)).await?;
            if hello.incarnation != local.incarnation() {
                return Err(fault(AddrFault::WrongIncarnation));
            }
            conn.exchange.view = view;
            let op = Op::Hold {
                ns,
                keys: owned(keys),
            };
            match conn.call_simple(op, &[]).await? {
                Reply::Located(v) if v.len() == keys.len() => Ok((
                    conn,
                    local,
                    v.into_iter().map(|l| l.map(Located::from)).collect(),
                )),
                r => Err(unexpected(&r)),
            }
        };
        let limit = cfg.deadline.map_or(cfg.timeout, |d| d.min(cfg.timeout));
        tokio::time::timeout(limit, work)
            .await
            .map_err(|_| ClientError::Timeout)?
    }

    /// Copies the `located` objects at `which` out of the mapping into `dsts`: `out[i]` their
    /// lengths; `fallback` the ones replaced meanwhile (to fetch through the socket).
    fn copy_located(
        &self,
        cfg: &ClientConfig,
        located: &[Option<Located>],
        which: &[usize],
        dsts: &mut [Dst<'_, '_>],
        (out, fallback): (&mut [Option<usize>], &mut Vec<usize>),
    ) -> Result<(), ClientError> {
        let Some(local) = self.local() else {
            fallback.extend(which.iter().filter(|&&i| located[i].is_some()));
            return Ok(());
        };
        let mut asked = vec![None; located.len()];
        for &i in which {
            asked[i] = located[i];
        }
        for (i, ok) in copy_all(&asked, dsts, |l, dst| {
            read_checked(cfg, &local, l, dst, false)
        })? {
            match ok {
                Some(true) => out[i] = asked[i].map(|l| l.addr.len as usize),
                Some(false) => fallback.push(i),
                None => {}
            }
        }
        Ok(())
    }

    fn read_local_checked(
        &self,
        cfg: &ClientConfig,
        l: &Located,
        dst: &mut [u8],
    ) -> Result<bool, ClientError> {
        match self.local() {
            Some(local) => read_checked(cfg, &local, l, &mut [dst], false),
            None => Ok(false),
        }
    }
}

/// Copies the keys this client's index knows straight from the mapping, each checked as
/// its key's current value; returns the indexes of the others (and of stale entries, which
/// are forgotten). With `prefix`, only the leading run of known keys that are still current
/// is copied (a key past a gap is useless to the caller, and its buffer keeps what it held).
/// Also returns the reads to report to the node, once a batch of them has gathered.
fn get_seen(
    sh: &SameHostPath,
    cfg: &ClientConfig,
    ns: u32,
    keys: &[&[u8]],
    dsts: &mut [Dst<'_, '_>],
    out: &mut [Option<usize>],
    prefix: bool,
) -> Result<(Vec<usize>, Option<Reads>), ClientError> {
    let all = || ((0..keys.len()).collect(), None);
    let Some(local) = sh.local().filter(|_| sh.watch.alive()) else {
        return Ok(all());
    };
    // The entries' own copies of the keys, for the report of the reads they serve.
    let mut shared = Vec::with_capacity(keys.len());
    let known: Vec<Option<Located>> = {
        let mut seen = sh.seen();
        let mut known: Vec<Option<Located>> = keys
            .iter()
            .map(|k| {
                let (l, key) = seen.get(ns, k).unzip();
                shared.push(key);
                l
            })
            .collect();
        if prefix {
            // The run ends at the first key not remembered, or remembered at an address
            // that is no longer its value (removed, evicted or replaced since).
            if let Some(gap) = known
                .iter()
                .position(|l| !l.is_some_and(|l| local.is_current(&l.addr)))
            {
                if let Some(l) = &known[gap] {
                    seen.forget(ns, keys[gap], l);
                }
                known[gap..].fill(None);
            }
        }
        known
    };
    if known.iter().all(Option::is_none) {
        return Ok(all());
    }
    let mut todo = Vec::new();
    let mut stale = Vec::new();
    let copied = copy_all(&known, dsts, |l, dst| {
        read_checked(cfg, &local, l, dst, true)
    })?;
    for (i, ok) in copied {
        match ok {
            Some(true) => out[i] = known[i].map(|l| l.addr.len as usize),
            Some(false) => {
                stale.push(i);
                todo.push(i);
            }
            None => todo.push(i),
        }
    }
    let report = {
        let mut seen = sh.seen();
        for &i in &stale {
            if let Some(l) = &known[i] {
                seen.forget(ns, keys[i], l);
            }
        }
        // Noted from the last key to the first, as the node reads a batch (tail first).
        let read = out.iter().zip(shared).rev();
        seen.touch_all(ns, read.filter_map(|(o, key)| o.and(key)))
    };
    Ok((todo, report))
}

/// A read from the mapping into `pieces` (exactly the object's length, filled in order),
/// checked by checksum in the same pass unless checksums are off; Ok(false) when the bytes
/// can't be served from it: the object was replaced meanwhile (with `current`, also when it is
/// no longer its key's value though a holder keeps it), or the address is of another
/// incarnation than the mapping.
fn read_checked(
    cfg: &ClientConfig,
    local: &LocalMap,
    l: &Located,
    pieces: &mut [&mut [u8]],
    current: bool,
) -> Result<bool, ClientError> {
    let r = match (pieces, cfg.verify_checksums) {
        ([dst], true) => local.read_verified(&l.addr, dst, l.checksum, current),
        (pieces, true) => local.read_verified_scatter(&l.addr, pieces, l.checksum, current),
        (pieces, false) => {
            // Each piece is version-checked on its own: a reuse between two of them fails
            // the later one's check (the generation moved on), so no mix of two values passes.
            let mut at = 0;
            pieces
                .iter_mut()
                .try_for_each(|p| {
                    let r = local.read(&l.addr, at, p, current);
                    at += p.len() as u64;
                    r
                })
                .map_err(LocalReadError::Fault)
        }
    };
    match r {
        Ok(()) => Ok(true),
        Err(LocalReadError::Fault(
            AddrFault::Stale | AddrFault::WrongIncarnation | AddrFault::NoSegment,
        )) => Ok(false),
        Err(LocalReadError::Fault(f)) => Err(fault(f)),
        Err(LocalReadError::Checksum) => Err(ClientError::Checksum),
    }
}

/// Copies each located object (`located[i]` into `dsts[i]`, checked by `read`) and returns, per
/// key index, Some(what `read` said) or None for a key with no location. A buffer too small is
/// an error before anything is copied. Runs off the runtime's workers when large, and spread
/// from [`PARALLEL_COPY_MIN`](crate::cores::PARALLEL_COPY_MIN) bytes on over the cores other
/// copies leave free ([`CopyThreads`]; one contiguous run of keys per thread).
fn copy_all<'d>(
    located: &[Option<Located>],
    dsts: &'d mut [Dst<'_, '_>],
    read: impl Fn(&Located, &mut [&mut [u8]]) -> Result<bool, ClientError> + Sync,
) -> Result<Vec<(usize, Option<bool>)>, ClientError> {
    let mut jobs: Vec<(usize, &Located, Fit<'d>)> = Vec::new();
    for (i, (l, d)) in located.iter().zip(dsts.iter_mut()).enumerate() {
        if let Some(l) = l {
            let (need, have) = (l.addr.len, dst_len(d));
            let dst = fit(d, need).ok_or(ClientError::BufferTooSmall { need, have })?;
            jobs.push((i, l, dst));
        }
    }
    let bytes: u64 = jobs.iter().map(|j| j.1.addr.len).sum();
    let claim = CopyThreads::claim(bytes, jobs.len());
    let threads = claim.get();
    let run = |part: &mut [(usize, &Located, Fit<'_>)]| -> Result<Vec<(usize, bool)>, ClientError> {
        part.iter_mut()
            .map(|(i, l, dst)| Ok((*i, read(l, dst.pieces())?)))
            .collect()
    };
    let done: Vec<(usize, bool)> = off_runtime(bytes, || {
        if threads == 1 {
            return run(&mut jobs);
        }
        let per = jobs.len().div_ceil(threads);
        std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .chunks_mut(per)
                .map(|part| s.spawn(|| run(part)))
                .collect();
            let mut all = Vec::new();
            for h in handles {
                // A copying thread that panicked copied nothing usable: its keys fall back.
                all.extend(h.join().unwrap_or_else(|_| Ok(Vec::new()))?);
            }
            Ok(all)
        })
    })?;
    let mut out: Vec<(usize, Option<bool>)> = (0..located.len()).map(|i| (i, None)).collect();
    for (i, ok) in done {
        out[i].1 = Some(ok);
    }
    // A key with a location whose thread died: as replaced meanwhile.
    for (i, o) in out.iter_mut() {
        if o.is_none() && located[*i].is_some() {
            *o = Some(false);
        }
    }
    Ok(out)
}

/// With `prefix`, nothing after the first miss.
pub(super) fn prefix_run(mut out: Vec<Option<usize>>, prefix: bool) -> Vec<Option<usize>> {
    if prefix {
        if let Some(gap) = out.iter().position(|o| o.is_none()) {
            out[gap..].fill(None);
        }
    }
    out
}
