//! The one-sided family: access by address. `Alloc` reserves memory for values, `Write` fills
//! it, `Commit` makes it visible (or `Abort` gives it back), `Read` reads an object's bytes, and
//! `MapInfo` hands a same-host client descriptors of the segments its token admits to, which
//! it then reads (and, where it may write, writes) directly.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use kvpool::protocol::io::{discard, write_frame};
use kvpool::protocol::{
    AllocItem, AllocResult, CommitItem, ErrorCode, Reply, SegmentMap, StagedCommit,
};
use kvpool::{Commit, GlobalAddr, PoolError};
use rkyv::Archived;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::conn::{payload_failure, Conn, Next};
use super::held::PendingAllocs;
use crate::ledger::{Account, Resource};
use crate::metrics::Transport;
use crate::service::{Access, Routing, Shared};

/// Largest one-sided read buffer a connection keeps between reads (larger reads allocate
/// their own): a weights chunk of the default size fits.
const READ_BUF_KEEP: usize = 16 << 20;

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// `depths` (empty, or one per item) place the values in prefix chains.
    pub(super) async fn alloc(
        &mut self,
        id: u64,
        ns: u32,
        items: &Archived<Vec<AllocItem>>,
        (pin, depths): (bool, &Archived<Vec<u32>>),
    ) -> Next {
        if let Err(code) = self.s.batch_check(items.len()) {
            return self.answer(id, Err(code)).await;
        }
        let n = items.len() as u64;
        let (pool, account) = (&*self.s.pool, &mut self.held.account);
        if let Err(r) = self.held.pending.admit(account, pool, ns, n) {
            return self.refused(id, r).await;
        }
        let (pending, account, stamp) = (
            &mut self.held.pending,
            &mut self.held.account,
            self.req.stamp,
        );
        let results = items
            .iter()
            .enumerate()
            .map(|(n, i)| {
                let depth = depths.get(n).map_or(0, |d| d.to_native());
                // Noted at the alloc, so before the commit acknowledges the write.
                match self
                    .s
                    .begin_put(ns, i.key.as_slice(), i.len.to_native(), pin, depth)
                {
                    Ok(a) => {
                        pending.note(a.generation, stamp, ns);
                        AllocResult {
                            addr: Some(a),
                            code: 0,
                        }
                    }
                    Err(e) => {
                        account.release(ns, Resource::Pending, 1);
                        AllocResult {
                            addr: None,
                            code: ErrorCode::from(e) as u16,
                        }
                    }
                }
            })
            .collect();
        self.reply(id, Reply::Allocated(results), &[]).await?;
        Ok(true)
    }

    /// The payload (`len` bytes) goes to `addr` at `offset`.
    pub(super) async fn write(
        &mut self,
        id: u64,
        addr: &Archived<GlobalAddr>,
        offset: u64,
        len: u64,
    ) -> Next {
        let r = self.write_one(&GlobalAddr::from(addr), offset, len).await?;
        self.s.metrics.bytes(len, 0);
        self.answer(id, r.map(|()| Reply::Done)).await
    }

    pub(super) async fn commit(&mut self, id: u64, items: &Archived<Vec<CommitItem>>) -> Next {
        let (s, stamp) = (self.s, self.req.stamp);
        let pending = (&mut self.held.pending, &mut self.held.account);
        let r = self.s.batch_check(items.len()).map(|()| {
            Reply::Statuses(
                items
                    .iter()
                    .map(|i| {
                        let addr = GlobalAddr::from(&i.addr);
                        let commit = || {
                            s.pool
                                .commit(Commit::new(&addr, i.checksum.to_native()))
                                .map(drop)
                        };
                        let pending = (&mut *pending.0, &mut *pending.1);
                        status_of(commit_pending(s, pending, stamp, &addr, commit))
                    })
                    .collect(),
            )
        });
        self.answer(id, r).await
    }

    pub(super) async fn abort(&mut self, id: u64, addrs: &Archived<Vec<GlobalAddr>>) -> Next {
        let pool = &*self.s.pool;
        let (pending, account) = (&mut self.held.pending, &mut self.held.account);
        let r = self.s.batch_check(addrs.len()).map(|()| {
            Reply::Statuses(
                addrs
                    .iter()
                    .map(|a| {
                        let addr = GlobalAddr::from(a);
                        let r = pool.abort(&addr);
                        if r.is_ok() {
                            pending.forget(account, addr.generation);
                        }
                        code_of(r)
                    })
                    .collect(),
            )
        });
        self.answer(id, r).await
    }

    pub(super) async fn read(
        &mut self,
        id: u64,
        addr: &Archived<GlobalAddr>,
        offset: u64,
        len: u64,
    ) -> Next {
        let pool = &*self.s.pool;
        let addr = GlobalAddr::from(addr);
        // Verify the address before sizing a buffer from it: a peer can only make us
        // allocate as much as a real object it was given the key of.
        let checked = pool.verify_addr(&addr).and_then(|()| {
            addr.sub_range(offset, len)
                .map(|_| ())
                .ok_or(kvpool::AddrFault::OutOfBounds.into())
        });
        match checked {
            Ok(()) => {
                // The connection's buffer, grown (and zeroed) only when a read is larger than
                // any before: no allocation and no zeroing pass per read.
                let n = len as usize;
                let mut buf = std::mem::take(&mut self.read_buf);
                if buf.len() < n {
                    buf.resize(n, 0);
                }
                let sent = match pool.read(&addr, offset, &mut buf[..n]) {
                    Ok(()) => {
                        let r = self.reply(id, Reply::Data, &[&buf[..n]]).await;
                        self.s.metrics.bytes(0, len);
                        r
                    }
                    Err(e) => self.pool_fail(id, e).await,
                };
                if buf.len() <= READ_BUF_KEEP {
                    self.read_buf = buf;
                }
                sent?;
            }
            Err(e) => self.pool_fail(id, e).await?,
        }
        Ok(true)
    }

    /// Offers the segments this connection may map, each as a descriptor passed with the reply
    /// (never a path); see [`segments_to_offer`].
    pub(super) async fn map_info(&mut self, id: u64) -> Next {
        let (Transport::Unix, Some(sock), Some(access)) =
            (self.transport, self.fds.unix, self.session.access.as_ref())
        else {
            self.fail(
                id,
                ErrorCode::NotLocal,
                "segments are only offered over the Unix socket",
            )
            .await?;
            return Ok(true);
        };
        let (maps, files) = segments_to_offer(self.s, access);
        let reply = Reply::MapInfo {
            incarnation: self.s.pool.incarnation(),
            segments: maps,
        };
        let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        self.reply_with_fds(id, reply, sock, &fds).await?;
        Ok(true)
    }

    /// Offers the node's fabric: its provider and address, and the keys of the segments this
    /// connection's token admits to (the rule of [`segments_to_offer`]).
    pub(super) async fn fabric_info(&mut self, id: u64) -> Next {
        let (Some(fabric), Some(access)) = (self.s.fabric.as_ref(), self.session.access.as_ref())
        else {
            let msg = "this node serves no fabric ([listen] fabric)";
            self.fail(id, ErrorCode::NotFound, msg).await?;
            return Ok(true);
        };
        let pool = &*self.s.pool;
        let offered = fabric.offer(pool.incarnation(), |seg| may_read(pool, access, seg));
        self.s.metrics.fabric_offer(offered.is_ok());
        match offered {
            Ok(reply) => self.reply(id, reply, &[]).await?,
            Err((code, msg)) => self.fail(id, code, msg).await?,
        }
        Ok(true)
    }

    /// Hands a same-host writer a staging area ([`crate::staging`]): over the Unix socket,
    /// to a token that may write some namespace, one per connection.
    pub(super) async fn staging(&mut self, id: u64) -> Next {
        let (Transport::Unix, Some(sock), Some(access)) =
            (self.transport, self.fds.unix, self.session.access.as_ref())
        else {
            let msg = "staging areas are only offered over the Unix socket";
            self.fail(id, ErrorCode::NotLocal, msg).await?;
            return Ok(true);
        };
        let writes_any = self
            .s
            .pool
            .namespaces()
            .iter()
            .any(|(_, ns)| access.writes(*ns));
        if !writes_any {
            let msg = "this token writes no namespace: it needs no staging area";
            self.fail(id, ErrorCode::Unauthorized, msg).await?;
            return Ok(true);
        }
        if self.held.staging.is_some() {
            let msg = "this connection has its staging area already";
            self.fail(id, ErrorCode::LimitExceeded, msg).await?;
            return Ok(true);
        }
        let (area, held, file) = match self.s.stagings.create(self.token_digest()) {
            Ok(made) => made,
            Err(crate::staging::StagingError::Refused(r)) => return self.refused(id, r).await,
            Err(e) => {
                self.fail(id, ErrorCode::LimitExceeded, &e.to_string())
                    .await?;
                return Ok(true);
            }
        };
        self.held.staging = Some(held);
        let reply = Reply::Staging {
            id: area,
            len: self.s.stagings.size,
        };
        self.reply_with_fds(id, reply, sock, &[file.as_raw_fd()])
            .await?;
        Ok(true)
    }

    /// Copies each item from staging area `staging` into its pending allocation and commits
    /// it; per item `Ok` or why not. An area this connection's token may not use (another
    /// tenant's, or one retired with its connection) fails the request whole (`NotFound`).
    pub(super) async fn commit_staged(
        &mut self,
        id: u64,
        staging: u64,
        items: &Archived<Vec<StagedCommit>>,
    ) -> Next {
        if let Err(code) = self.s.batch_check(items.len()) {
            return self.answer(id, Err(code)).await;
        }
        let Some(area) = self.s.stagings.get(staging, &self.token_digest()) else {
            let msg = "no such staging area for this token (retired with the connection that \
                       asked for it?)";
            self.fail(id, ErrorCode::NotFound, msg).await?;
            return Ok(true);
        };
        let pool = &*self.s.pool;
        let mut bytes = 0;
        let mut statuses = Vec::with_capacity(items.len());
        for item in items.iter() {
            let addr = GlobalAddr::from(&item.addr);
            let offset = item.offset.to_native();
            let commit = || {
                pool.begin_write(&addr).and_then(|mut w| {
                    match area.copy_out(offset, w.bytes_mut()) {
                        Some(hashed) => pool
                            .commit(Commit::claimed(w, item.checksum.to_native(), hashed))
                            .map(drop),
                        None => Err(kvpool::AddrFault::OutOfBounds.into()),
                    }
                })
            };
            let pending = (&mut self.held.pending, &mut self.held.account);
            let r = commit_pending(self.s, pending, self.req.stamp, &addr, commit);
            if r.is_ok() {
                bytes += addr.len;
            }
            statuses.push(status_of(r));
        }
        self.s.metrics.bytes(bytes, 0);
        self.reply(id, Reply::Statuses(statuses), &[]).await?;
        Ok(true)
    }

    /// Sends `reply` over the Unix socket `sock` with `fds` riding on its first byte.
    async fn reply_with_fds(
        &mut self,
        id: u64,
        reply: Reply,
        sock: RawFd,
        fds: &[RawFd],
    ) -> io::Result<()> {
        let mut frame = Vec::new();
        let hdr = kvpool::protocol::encode(&kvpool::protocol::Response { id, reply });
        write_frame(&mut frame, &hdr, &[]).await?;
        // Whatever went before goes first, so the descriptors ride on this reply's first byte.
        self.w.flush().await?;
        let deadline = tokio::time::Instant::now() + self.s.conn.write;
        let sent = loop {
            match kvpool::fdpass::send_with_fds(sock, &frame, fds) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(io::ErrorKind::TimedOut.into());
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        };
        self.w.write_all(&frame[sent..]).await
    }

    async fn write_one(
        &mut self,
        addr: &GlobalAddr,
        offset: u64,
        len: u64,
    ) -> io::Result<Result<(), ErrorCode>> {
        let pool = &*self.s.pool;
        // Claims exactly the bytes written: a write overlapping another connection's open write
        // of the same allocation is refused (`Busy`) instead of aliasing its memory.
        let mut w = match pool.begin_write_range(addr, offset, len) {
            Ok(w) => w,
            Err(e) => {
                discard(&mut self.r, len).await?;
                return Ok(Err(e.into()));
            }
        };
        let deadline = self.s.instant_at(w.deadline());
        let read = self.receive(w.bytes_mut(), |_| {}, deadline).await;
        let expired = read.is_err();
        if let Some(e) = payload_failure(read) {
            drop(w);
            // Past its deadline: give the allocation back now (if another write still holds
            // it, the reaper takes it once that write ends). After a socket error it stays
            // pending for its owner, who may write it again over another connection.
            if expired {
                let _ = pool.abort(addr);
            }
            return Err(e);
        }
        Ok(Ok(()))
    }
}

/// Commits the pending allocation `addr` with `commit` (a `Commit` or `CommitStaged` item),
/// judged like a socket put by the view its `Alloc` was routed by (`Shared::commit_in_view`):
/// the request's own view stamp (`stamp`) when it carries one, as a same-host put's does, else
/// the stamp noted in `pending` when this connection allocated it, else none (an allocation
/// made over another connection, as a one-sided handoff's is, or a direct one). An allocation
/// committed, or aborted for its view, leaves `pending`.
fn commit_pending(
    s: &Shared,
    (pending, account): (&mut PendingAllocs, &mut Account),
    stamp: u64,
    addr: &GlobalAddr,
    commit: impl FnOnce() -> Result<(), PoolError>,
) -> Result<(), ErrorCode> {
    let stamp = match stamp {
        0 => pending.stamp(addr.generation),
        stamp => stamp,
    };
    let r = s.commit_in_view(addr, Routing::of_stamp(stamp), commit);
    if matches!(r, Ok(()) | Err(ErrorCode::WrongView)) {
        pending.forget(account, addr.generation);
    }
    r
}

fn code_of(r: Result<(), PoolError>) -> u16 {
    status_of(r.map_err(ErrorCode::from))
}

fn status_of(r: Result<(), ErrorCode>) -> u16 {
    r.err().map_or(0, |e| e as u16)
}
/// Whether `access` may read every object segment `id` can hold: a namespace's own segment
/// when the token admits to that namespace, a common segment when it admits to every
/// namespace without a segment of its own.
fn may_read(pool: &kvpool::Pool, access: &Access, id: u32) -> bool {
    match pool.segment_owner(id) {
        Some(ns) => access.allows(ns),
        None => pool.common_namespaces().all(|ns| access.allows(ns)),
    }
}

/// The segments `access` may map and a read-only descriptor of each: a namespace's own segment
/// when the token admits to the namespace, the common segments when it admits to every
/// namespace kept there. Never a writable one: a client holding one could shrink the segment's
/// file under the node (writers go through staging areas, [`crate::staging`]). At most
/// [`kvpool::fdpass::MAX_FDS`].
fn segments_to_offer(
    s: &crate::service::Shared,
    access: &Access,
) -> (Vec<SegmentMap>, Vec<std::fs::File>) {
    let pool = &*s.pool;
    let mut maps = Vec::new();
    let mut files = Vec::new();
    for seg in pool.segments() {
        let id = seg.layout().id;
        let read = may_read(pool, access, id);
        let Some(path) = seg.path().filter(|_| read) else {
            continue;
        };
        if files.len() == kvpool::fdpass::MAX_FDS {
            tracing::debug!("more segments than one message passes: the rest go unmapped");
            break;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path);
        match file {
            Ok(f) => {
                files.push(f);
                maps.push(SegmentMap {
                    id,
                    total_len: seg.layout().total_len(),
                    writable: false,
                });
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot open a segment file to pass")
            }
        }
    }
    (maps, files)
}
