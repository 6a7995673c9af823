//! Same-host puts: values copied straight into their allocations in the node's mapping or,
//! when the node maps its segments read-only to this client, into the staging area for the node
//! to copy; committed in groups, one group's commit in flight while the next is copied.

use kvpool::protocol::{ErrorCode, Op, Reply, StagedCommit};
use kvpool::GlobalAddr;

use super::same_host::SameHostPath;
use super::{fault, unexpected, Link};
use crate::config::ClientConfig;
use crate::cores::off_runtime;
use crate::error::ClientError;
use crate::local::LocalMap;
use crate::located::Located;
use crate::staging::StagingArea;

/// Values at least this large take the same-host path for single puts (below it one socket
/// round trip is cheaper than the alloc and commit round trips).
const LOCAL_PUT_MIN: usize = 16 << 10;

/// One same-host batch put: its items, their allocations, and what became of each.
struct LocalPut<'i> {
    items: &'i [(&'i [u8], &'i [u8])],
    allocs: Vec<Result<GlobalAddr, ErrorCode>>,
    /// Item i's checksum.
    sum: &'i (dyn Fn(usize) -> u64 + Sync),
    /// Each item's code.
    codes: Vec<ErrorCode>,
    /// The checksums of the items copied.
    sums: Vec<u64>,
}

/// Where the copies of a same-host batch put are committed, and the groups of them waiting
/// for it.
struct Groups<'a> {
    cfg: &'a ClientConfig,
    /// The view the allocations were routed by, stamped on their commits.
    view: u64,
    /// The staging area, when the node handed one out.
    staging: Option<&'a StagingArea>,
    staged: Staged,
    pending: Uncommitted,
    /// The group whose commit may still be waiting for the node's answer.
    inflight: Option<InFlight<'a>>,
}

impl Link {
    /// Whether a put of `items` takes the same-host path.
    pub(super) fn puts_locally(&self, items: &[(&[u8], &[u8])]) -> bool {
        self.same_host.is_some()
            && (items.len() > 1 || items.first().is_some_and(|i| i.1.len() >= LOCAL_PUT_MIN))
    }

    /// [`Link::put_many`] through the mapping of `sh`: alloc, store, commit (`sum(i)`: item
    /// i's checksum).
    #[expect(clippy::too_many_arguments, reason = "put_many's own parameters")]
    pub(super) async fn put_local(
        &self,
        sh: &SameHostPath,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        items: &[(&[u8], &[u8])],
        sum: &(dyn Fn(usize) -> u64 + Sync),
        pin: bool,
        depths: Vec<u32>,
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let lens: Vec<(&[u8], u64)> = items.iter().map(|(k, v)| (*k, v.len() as u64)).collect();
        let allocs = self.alloc_many(cfg, view, ns, &lens, pin, depths).await?;
        let staging = sh.staging();
        let mut put = LocalPut {
            items,
            allocs,
            sum,
            codes: vec![ErrorCode::Ok; items.len()],
            sums: vec![0; items.len()],
        };
        let mut groups = Groups {
            cfg,
            view,
            staging: staging.as_deref(),
            staged: Staged::default(),
            pending: Uncommitted::default(),
            inflight: None,
        };
        self.copy_in(&mut groups, &mut put).await?;
        if staging.as_ref().is_some_and(|st| !st.usable()) {
            // The node retired the area under these puts (its connection closed): the values it
            // did not take are still in their allocations' hands, pending, so they go over the
            // socket instead of failing.
            self.put_unstaged(cfg, view, &mut put).await?;
        }
        let mut seen = sh.seen();
        // (No await below: the guard is not held across one.)
        for ((i, a), code) in put.allocs.iter().enumerate().zip(&put.codes) {
            if let (Ok(addr), ErrorCode::Ok) = (a, code) {
                let at = Located {
                    addr: *addr,
                    checksum: put.sums[i],
                };
                seen.insert(ns, items[i].0, at);
            }
        }
        Ok(put.codes)
    }

    /// Copies each allocated item of `put` into the node's memory (or its staging area) and
    /// has the node commit them in groups; every group is committed when it returns.
    async fn copy_in<'a>(
        &'a self,
        g: &mut Groups<'a>,
        put: &mut LocalPut<'_>,
    ) -> Result<(), ClientError> {
        let local = self.local();
        for i in 0..put.items.len() {
            let addr = match put.allocs[i] {
                Ok(addr) => addr,
                Err(code) => {
                    put.codes[i] = code;
                    continue;
                }
            };
            let direct = local
                .as_deref()
                .is_some_and(|l| l.incarnation() == addr.incarnation && l.covers_writable(&addr));
            // Mapped read-only: the value goes through the staging area, when it has room.
            if !direct && self.stage(g, put, i, addr).await? {
                continue;
            }
            let v = put.items[i].1;
            match self
                .write_local_or_remote(g.cfg, local.as_deref(), &addr, v)
                .await
            {
                Ok(()) => {
                    put.sums[i] = (put.sum)(i);
                    g.pending.commits.push((addr, put.sums[i]));
                    g.pending.which.push(i);
                    g.pending.bytes += v.len() as u64;
                    if g.pending.bytes >= COMMIT_GROUP {
                        // As for staged groups: the node hashes this one while the next is
                        // copied.
                        let group = std::mem::take(&mut g.pending);
                        let f = Box::pin(self.commit_written(g.cfg, g.view, group));
                        launch(&mut g.inflight, f, &mut put.codes).await?;
                    }
                }
                Err(e) => put.codes[i] = e.code().unwrap_or(ErrorCode::Unavailable),
            }
        }
        if let Some(f) = g.inflight.take() {
            settle(f.await?, &mut put.codes);
        }
        if let Some(st) = g.staging {
            let group = std::mem::take(&mut g.staged);
            settle(
                self.commit_staged(g.cfg, g.view, st, group).await?,
                &mut put.codes,
            );
        }
        let group = std::mem::take(&mut g.pending);
        settle(
            self.commit_written(g.cfg, g.view, group).await?,
            &mut put.codes,
        );
        Ok(())
    }

    /// Copies item `i` of `put` (allocated at `addr`) into the staging area and queues it for
    /// its commit. False when it has to go another way: the node handed out no area, or the
    /// area has no room for it even once the groups before it are committed (other threads'
    /// puts hold it, or the value is larger than the area); then it goes over the socket.
    async fn stage<'a>(
        &'a self,
        g: &mut Groups<'a>,
        put: &mut LocalPut<'_>,
        i: usize,
        addr: GlobalAddr,
    ) -> Result<bool, ClientError> {
        let Some(st) = g.staging else {
            return Ok(false);
        };
        let v = put.items[i].1;
        let mut range = st.take(v.len() as u64);
        if range.is_none() && (g.inflight.is_some() || !g.staged.items.is_empty()) {
            // Room comes back as the groups before this value are committed.
            if let Some(f) = g.inflight.take() {
                settle(f.await?, &mut put.codes);
            }
            let group = std::mem::take(&mut g.staged);
            settle(
                self.commit_staged(g.cfg, g.view, st, group).await?,
                &mut put.codes,
            );
            range = st.take(v.len() as u64);
        }
        let Some(r) = range else {
            return Ok(false);
        };
        off_runtime(v.len() as u64, || st.fill(r, v));
        put.sums[i] = (put.sum)(i);
        g.staged.items.push(StagedCommit {
            addr,
            offset: r.start,
            checksum: put.sums[i],
        });
        g.staged.which.push(i);
        g.staged.ranges.push(r);
        g.staged.bytes += v.len() as u64;
        if g.staged.bytes >= COMMIT_GROUP {
            // One group in flight while the next is copied: the node copies this one meanwhile.
            let group = std::mem::take(&mut g.staged);
            let f = Box::pin(self.commit_staged(g.cfg, g.view, st, group));
            launch(&mut g.inflight, f, &mut put.codes).await?;
        }
        Ok(true)
    }

    /// Writes over the socket, and commits, the items of `put` that a retired staging area
    /// left `Unavailable`.
    async fn put_unstaged(
        &self,
        cfg: &ClientConfig,
        view: u64,
        put: &mut LocalPut<'_>,
    ) -> Result<(), ClientError> {
        let mut again = Uncommitted::default();
        for (i, (a, (_, v))) in put.allocs.iter().zip(put.items).enumerate() {
            if let (Ok(addr), ErrorCode::Unavailable) = (a, put.codes[i]) {
                match self.write(cfg, addr, 0, v).await {
                    Ok(()) => {
                        again.commits.push((*addr, put.sums[i]));
                        again.which.push(i);
                    }
                    Err(e) => put.codes[i] = e.code().unwrap_or(ErrorCode::Unavailable),
                }
            }
        }
        settle(self.commit_written(cfg, view, again).await?, &mut put.codes);
        Ok(())
    }

    /// Has the node copy the values of group `w` out of staging area `st` into their
    /// allocations and commit them; returns each value's (item index, code), and gives the
    /// group's ranges back once the node answered. Stamped with `view`, the view the
    /// allocations were routed by: a value whose node's view changed by its commit is
    /// `WrongView`, and the put goes again by the new view. An area the node no longer knows (its
    /// connection closed) is retired: those values fail as `Unavailable`, and later puts go
    /// over the socket.
    async fn commit_staged(
        &self,
        cfg: &ClientConfig,
        view: u64,
        st: &StagingArea,
        w: Staged,
    ) -> Result<Vec<(usize, ErrorCode)>, ClientError> {
        if w.items.is_empty() {
            return Ok(Vec::new());
        }
        let n = w.which.len();
        let op = Op::CommitStaged {
            staging: st.id,
            items: w.items,
        };
        let got = self.simple(cfg, view, op, &[]).await;
        // Answered or not, the ranges can be reused: bytes that change under a copy the node is
        // still making fail its checksum, never land as a value.
        for r in w.ranges {
            st.give_back(r);
        }
        let statuses = match got {
            Ok(Reply::Statuses(s)) if s.len() == n => {
                s.into_iter().map(ErrorCode::from_u16).collect()
            }
            Ok(r) => return Err(unexpected(&r)),
            Err(ClientError::Server {
                code: ErrorCode::NotFound,
                ..
            }) => {
                st.retire();
                vec![ErrorCode::Unavailable; n]
            }
            Err(e) => return Err(e),
        };
        Ok(w.which.into_iter().zip(statuses).collect())
    }

    /// Commits the values of group `w` (stamped with `view`, as [`Link::commit_staged`]);
    /// returns each value's (item index, code).
    async fn commit_written(
        &self,
        cfg: &ClientConfig,
        view: u64,
        w: Uncommitted,
    ) -> Result<Vec<(usize, ErrorCode)>, ClientError> {
        if w.commits.is_empty() {
            return Ok(Vec::new());
        }
        let got = self.commit_many(cfg, view, &w.commits).await?;
        Ok(w.which.into_iter().zip(got).collect())
    }

    /// A whole-value write into a fresh allocation: a store into `local` when it maps the
    /// address's incarnation, a one-sided write request otherwise.
    async fn write_local_or_remote(
        &self,
        cfg: &ClientConfig,
        local: Option<&LocalMap>,
        addr: &GlobalAddr,
        bytes: &[u8],
    ) -> Result<(), ClientError> {
        if let Some(local) =
            local.filter(|l| l.incarnation() == addr.incarnation && l.covers_writable(addr))
        {
            return off_runtime(bytes.len() as u64, || local.write(addr, 0, bytes)).map_err(fault);
        }
        self.write(cfg, addr, 0, bytes).await
    }
}

/// A same-host batch put commits what it has copied each time this many bytes are waiting, so
/// that a consumer of a handoff (`Client::wait_get_into`) reads the first values while the
/// rest are still being copied; one commit round trip per 8 MiB.
const COMMIT_GROUP: u64 = 8 << 20;

/// Writes each (item index, code) of a committed group into `codes`.
fn settle(got: Vec<(usize, ErrorCode)>, codes: &mut [ErrorCode]) {
    for (i, code) in got {
        codes[i] = code;
    }
}

/// A group's commit that may still be waiting for the node's answer.
type InFlight<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Vec<(usize, ErrorCode)>, ClientError>> + Send + 'a>,
>;

/// Starts the commit `f` of a group (after settling the one still in flight: one at a time)
/// and leaves it in `inflight` if the node has not answered yet, so the caller copies the next
/// group while the node takes this one.
async fn launch<'a>(
    inflight: &mut Option<InFlight<'a>>,
    mut f: InFlight<'a>,
    codes: &mut [ErrorCode],
) -> Result<(), ClientError> {
    if let Some(prev) = inflight.take() {
        settle(prev.await?, codes);
    }
    match poll_once(f.as_mut()).await {
        std::task::Poll::Ready(r) => settle(r?, codes),
        std::task::Poll::Pending => *inflight = Some(f),
    }
    Ok(())
}

/// Polls `f` once: a request it makes is sent (as far as it goes without waiting) before the
/// caller goes on with other work.
async fn poll_once<F: std::future::Future + ?Sized>(
    mut f: std::pin::Pin<&mut F>,
) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx))).await
}

/// Values of a same-host batch put copied into the staging area, not yet committed.
#[derive(Default)]
struct Staged {
    items: Vec<StagedCommit>,
    /// Their items' indexes.
    which: Vec<usize>,
    /// The staging ranges they occupy.
    ranges: Vec<crate::staging::Range>,
    bytes: u64,
}

/// Values of a same-host batch put copied into their allocations, not yet committed.
#[derive(Default)]
struct Uncommitted {
    commits: Vec<(GlobalAddr, u64)>,
    /// Their items' indexes.
    which: Vec<usize>,
    bytes: u64,
}
