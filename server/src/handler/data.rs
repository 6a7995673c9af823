//! The data family: `Put`, `Get`, `BatchPut`, `BatchGet` (with its prefix mode), `Exists`,
//! `Remove`, `Clear`, `Scan`. What they do to the pool is [`crate::service`]'s; here is their native framing:
//! values stream between the socket and pool memory without a copy.

use std::io;

use kvpool::protocol::io::discard;
use kvpool::protocol::{ErrorCode, Key, PutItem, Reply, ValueMeta, MISS_VERSION};
use kvpool::{Commit, GlobalAddr, Millis, PoolError};
use rkyv::Archived;
use tokio::io::{AsyncRead, AsyncWrite};

use super::conn::{payload_failure, Conn, Next};
use crate::metrics::Limit;

/// One value of a `Put` or `BatchPut`: its key, length in the payload and checksum.
pub(super) struct Item<'k> {
    pub(super) key: &'k [u8],
    pub(super) len: u64,
    pub(super) checksum: u64,
}

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    pub(super) async fn put(&mut self, id: u64, ns: u32, item: Item<'_>, pin: bool) -> Next {
        let len = item.len;
        let r = self.put_one(ns, item, pin, 0).await?;
        self.s.metrics.bytes(len, 0);
        self.answer(id, r.map(|()| Reply::Done)).await
    }

    pub(super) async fn get(&mut self, id: u64, ns: u32, key: &[u8], now: Millis) -> Next {
        match self.s.get(ns, key, now, self.routing()) {
            Ok(obj) => {
                let bytes = obj.bytes();
                let reply = Reply::Value {
                    len: bytes.len() as u64,
                    checksum: obj.checksum(),
                };
                self.reply(id, reply, &[bytes]).await?;
                self.s.metrics.bytes(0, bytes.len() as u64);
            }
            Err(e) => {
                let missed = e == PoolError::NotFound;
                if !self.answered_moved(id, missed).await? {
                    // A miss is an answer, not a failure, to a connection that knows `Miss`.
                    if missed && self.session.version >= MISS_VERSION {
                        self.reply(id, Reply::Miss, &[]).await?;
                    } else {
                        self.pool_fail(id, e).await?;
                    }
                }
            }
        }
        Ok(true)
    }

    /// `items`' values follow in the payload, concatenated; `depths` (empty, or one per item)
    /// place them in prefix chains.
    pub(super) async fn batch_put(
        &mut self,
        id: u64,
        ns: u32,
        items: &Archived<Vec<PutItem>>,
        (pin, depths): (bool, &Archived<Vec<u32>>),
        payload: u64,
    ) -> Next {
        let max_batch = self.s.conn.limits.max_batch as usize;
        let total: Option<u64> = items
            .iter()
            .try_fold(0u64, |acc, i| acc.checked_add(i.len.to_native()));
        if items.len() > max_batch || total != Some(payload) {
            discard(&mut self.r, payload).await?;
            let (code, msg) = if items.len() > max_batch {
                self.s.metrics.limit_refused(Limit::Batch);
                (ErrorCode::BatchTooLarge, "too many items")
            } else {
                (
                    ErrorCode::PayloadMismatch,
                    "payload length is not the sum of the item lengths",
                )
            };
            self.fail(id, code, msg).await?;
            return Ok(true);
        }
        let mut statuses = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let depth = depths.get(i).map_or(0, |d| d.to_native());
            let item = Item {
                key: item.key.as_slice(),
                len: item.len.to_native(),
                checksum: item.checksum.to_native(),
            };
            let r = self.put_one(ns, item, pin, depth).await?;
            statuses.push(r.err().map_or(0, |c| c as u16));
        }
        self.s.metrics.bytes(payload, 0);
        self.reply(id, Reply::Statuses(statuses), &[]).await?;
        Ok(true)
    }

    /// With `prefix`, the keys are a prefix chain: after the first miss nothing more is sent.
    pub(super) async fn batch_get(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        prefix: bool,
        now: Millis,
    ) -> Next {
        if keys.len() > self.s.conn.limits.max_batch as usize {
            self.s.metrics.limit_refused(Limit::Batch);
            self.fail(id, ErrorCode::BatchTooLarge, "too many keys")
                .await?;
            return Ok(true);
        }
        // A prefix chain is read up to its run here, judged first without touching anything,
        // so nothing past its gap is touched or sent.
        let run = if prefix {
            let run = self
                .s
                .present_run(ns, keys.iter().map(|k| k.as_slice()), self.routing())
                .and_then(|run| {
                    if run < keys.len() {
                        // The read that ends the run, as a read of it would have counted.
                        self.s.pool.count_miss(ns)?;
                    }
                    Ok(run)
                });
            match run {
                Ok(run) => run,
                Err(e) => {
                    self.pool_fail(id, e).await?;
                    return Ok(true);
                }
            }
        } else {
            keys.len()
        };
        let mut refs: Vec<Option<_>> = keys.iter().map(|_| None).collect();
        // From the last key to the first: each read is an access for the eviction policy, so
        // a chain's root ends up its most recently used block and pressure takes the chain
        // from its tail, as a batched store leaves it (docs/EVICTION.md, "Batches tail first").
        for (slot, key) in refs.iter_mut().zip(keys.iter()).take(run).rev() {
            match self.s.get(ns, key.as_slice(), now, self.routing()) {
                Ok(r) => *slot = Some(r),
                Err(PoolError::NotFound) => {}
                Err(e) => {
                    drop(refs);
                    self.pool_fail(id, e).await?;
                    return Ok(true);
                }
            }
        }
        if prefix {
            // A block evicted since the run was judged ends it there.
            if let Some(gap) = refs.iter().position(Option::is_none) {
                refs[gap..].fill_with(|| None);
            }
        }
        let missed = refs.iter().any(Option::is_none);
        if self.answered_moved(id, missed).await? {
            return Ok(true);
        }
        let metas = refs
            .iter()
            .map(|r| {
                r.as_ref().map(|r| ValueMeta {
                    len: r.bytes().len() as u64,
                    checksum: r.checksum(),
                })
            })
            .collect();
        let slices: Vec<&[u8]> = refs.iter().flatten().map(|r| r.bytes()).collect();
        let out: u64 = slices.iter().map(|s| s.len() as u64).sum();
        self.reply(id, Reply::Values(metas), &slices).await?;
        self.s.metrics.bytes(0, out);
        Ok(true)
    }

    pub(super) async fn exists(&mut self, id: u64, ns: u32, keys: &Archived<Vec<Key>>) -> Next {
        let r = self.s.batch_check(keys.len()).and_then(|()| {
            self.s
                .exists_run(ns, keys.iter().map(|k| k.as_slice()), self.routing())
                .map_err(Into::into)
        });
        let missed = matches!(r, Ok(n) if n < keys.len());
        if self.answered_moved(id, missed).await? {
            return Ok(true);
        }
        self.answer(id, r.map(|n| Reply::Count(n as u64))).await
    }

    pub(super) async fn remove(&mut self, id: u64, ns: u32, keys: &Archived<Vec<Key>>) -> Next {
        let r = self.s.batch_check(keys.len()).and_then(|()| {
            let keys = keys.iter().map(|k| k.as_slice());
            self.s
                .remove_keys(ns, keys, self.routing())
                .map_err(Into::into)
        });
        // Removed, but by a view this node has since left: the client removes again by the
        // new one (`Shared::remove_keys`).
        if matches!(r, Ok((_, true))) && self.answered_moved(id, true).await? {
            return Ok(true);
        }
        self.answer(id, r.map(|(n, _)| Reply::Count(n))).await
    }

    /// `Clear`: every object of `ns` here, removed.
    pub(super) async fn clear(&mut self, id: u64, ns: u32) -> Next {
        let r = self.s.clear(ns).map(Reply::Count).map_err(ErrorCode::from);
        self.answer(id, r).await
    }

    /// `Scan`: one page of the keys of `ns` here that start with `prefix`.
    pub(super) async fn scan(
        &mut self,
        id: u64,
        ns: u32,
        cursor: u64,
        count: u32,
        prefix: &[u8],
    ) -> Next {
        let r = self
            .s
            .scan(ns, cursor, count, prefix, self.routing())
            .map(|p| Reply::Keys {
                keys: p.keys,
                cursor: p.cursor,
            })
            .map_err(ErrorCode::from);
        // Keys judged after the view changed are left out: such a page may not be whole.
        if self.answered_moved(id, r.is_ok()).await? {
            return Ok(true);
        }
        self.answer(id, r).await
    }

    /// Receives one value straight from the socket into a fresh allocation and commits it.
    /// Consumes exactly `item.len` payload bytes whatever happens.
    async fn put_one(
        &mut self,
        ns: u32,
        item: Item<'_>,
        pin: bool,
        depth: u32,
    ) -> io::Result<Result<(), ErrorCode>> {
        let pool = &*self.s.pool;
        let begun = match self.session.peer {
            true => self.s.begin_copy(ns, item.key, item.len, pin, depth),
            false => self.s.begin_put(ns, item.key, item.len, pin, depth),
        };
        let addr = match begun {
            Ok(a) => a,
            Err(e) => {
                discard(&mut self.r, item.len).await?;
                return Ok(Err(e.into()));
            }
        };
        let hashed = {
            let mut w = match pool.begin_write(&addr) {
                Ok(w) => w,
                Err(e) => {
                    // A `Cancel` of the key came between the allocation and this write: the
                    // payload is dropped and the put fails (its allocation is released).
                    let _ = pool.abort(&addr);
                    discard(&mut self.r, item.len).await?;
                    return Ok(Err(e.into()));
                }
            };
            let deadline = self.s.instant_at(w.deadline());
            // Received in pieces, each hashed right after it lands (still in cache): one pass
            // over the bytes instead of a second one at commit, and no long stretch of hashing
            // that holds a worker thread from every other connection.
            let mut h = kvpool::checksum::Hasher::new();
            let read = self.receive(w.bytes_mut(), |p| h.update(p), deadline).await;
            if let Some(e) = payload_failure(read) {
                drop(w);
                let _ = pool.abort(&addr);
                return Err(e);
            }
            h.digest()
        };
        Ok(self.commit_received(ns, &item, &addr, hashed, pin))
    }

    /// Commits a value [`Conn::put_one`] received into `addr` and hashed as `hashed`, as the
    /// view and the sender (a client, or a peer handing a key over) allow.
    fn commit_received(
        &self,
        ns: u32,
        item: &Item<'_>,
        addr: &GlobalAddr,
        hashed: u64,
        pin: bool,
    ) -> Result<(), ErrorCode> {
        let pool = &*self.s.pool;
        // The allocation's address never left this connection and the write claim covered
        // every byte hashed: the bytes committed are the bytes checked. If the view changed
        // while the value streamed in, this node may no longer own the key and its mover may
        // already have handed the older value over to the new owner: the write is refused
        // (aborted), and the client routes it again by the new view. Judged again after the
        // commit (`Shared::commit_in_view`).
        if !self.session.peer || pin {
            let commit = || {
                pool.commit(Commit::prehashed(addr, item.checksum, hashed))
                    .map(drop)
            };
            return self.s.commit_in_view(addr, self.routing(), commit);
        }
        if self.s.view_moved(self.routing()) {
            // A peer's copy routed by a view this node has left, refused the same way.
            let _ = pool.abort(addr);
            return Err(ErrorCode::WrongView);
        }
        // A peer's copy of an unpinned object (the mover handing over a key this node now
        // owns): taken only while no write or remove acknowledged here can be newer, and never
        // over an object this node holds, so an older copy never replaces a newer value.
        let replicas = self
            .s
            .replication(ns)
            .map_or(1, |r| r.replicas.max(1) as usize);
        let commit = || {
            pool.commit(Commit::prehashed(addr, item.checksum, hashed).when_present(Some(false)))
        };
        match self.s.cluster.if_vouched((ns, item.key), replicas, commit) {
            Some(Ok(true)) => Ok(()),
            Some(Ok(false)) => Err(ErrorCode::Superseded),
            Some(Err(e)) => Err(e.into()),
            None => {
                let _ = pool.abort(addr);
                Err(ErrorCode::Superseded)
            }
        }
    }
}
