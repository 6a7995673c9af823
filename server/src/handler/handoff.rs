//! The handoff family (docs/HANDOFF.md): `Watch` and `Unwatch` keys, `Subscribe` to a prefix,
//! `Fail` keys (a producer's tombstone), `Cancel` them (the abort of a request on both sides). A connection that watches is sent an `Event` frame
//! (request id `EVENT_ID`) for every commit or tombstone of what it watches; the connection
//! loop writes them between requests.

use kvpool::protocol::{ErrorCode, Key, Reply};
use kvpool::Millis;
use rkyv::Archived;
use tokio::io::{AsyncRead, AsyncWrite};

use super::conn::{Conn, Next};
use crate::ledger::Resource;
use crate::metrics::HandoffFailure;
use crate::watch::{MAX_PREFIX, MAX_REASON};

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// Registers the watches first, then says where each key stands: a commit between the two
    /// is both reported as present and sent as an event (the client takes the first), never
    /// lost.
    pub(super) async fn watch(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        now: Millis,
    ) -> Next {
        if let Err(code) = self.s.batch_check(keys.len()) {
            return self.answer(id, Err(code)).await;
        }
        if let Err(e) = self.s.pool.check_namespace(ns) {
            return self.answer(id, Err(e.into())).await;
        }
        let n = keys.len() as u64;
        if let Err(r) = self.held.account.charge(ns, Resource::Watches, n) {
            return self.refused(id, r).await;
        }
        let watches = self.s.watches.clone();
        let reg = self.held.watching.get_or_insert_with(|| watches.register());
        let new = keys
            .iter()
            .filter(|k| watches.watch(reg, ns, k.as_slice()))
            .count();
        // A key watched already is charged once.
        self.held
            .account
            .release(ns, Resource::Watches, n - new as u64);
        let pool = &*self.s.pool;
        let mut codes = Vec::with_capacity(keys.len());
        for k in keys.iter() {
            let key = k.as_slice();
            let present = self.s.fresh_key(ns, key, self.routing())
                && pool.exists_prefix(ns, [key]).unwrap_or(0) == 1;
            let code = if present {
                ErrorCode::Ok
            } else if let Some(reason) = watches.tombstone(ns, key, now) {
                // Its reason follows as an event, right after this reply.
                if let Some(reg) = self.held.watching.as_ref() {
                    watches.tell_one(reg, ns, key, ErrorCode::Failed, &reason);
                }
                ErrorCode::Failed
            } else {
                ErrorCode::NotFound
            };
            codes.push(code as u16);
        }
        self.answer(id, Ok(Reply::Statuses(codes))).await
    }

    pub(super) async fn unwatch(&mut self, id: u64, ns: u32, keys: &Archived<Vec<Key>>) -> Next {
        if let Err(code) = self.s.batch_check(keys.len()) {
            return self.answer(id, Err(code)).await;
        }
        let watches = self.s.watches.clone();
        let mut n = 0;
        if let Some(reg) = self.held.watching.as_mut() {
            for k in keys.iter() {
                n += watches.unwatch(reg, ns, k.as_slice()) as u64;
            }
        }
        self.held.account.release(ns, Resource::Watches, n);
        self.answer(id, Ok(Reply::Count(n))).await
    }

    pub(super) async fn subscribe(&mut self, id: u64, ns: u32, prefix: &[u8]) -> Next {
        if prefix.len() > MAX_PREFIX {
            let msg = format!("a prefix is at most {MAX_PREFIX} bytes");
            self.fail(id, ErrorCode::BadKey, &msg).await?;
            return Ok(true);
        }
        if let Err(e) = self.s.pool.check_namespace(ns) {
            return self.answer(id, Err(e.into())).await;
        }
        if let Err(r) = self.held.account.charge(ns, Resource::Subscriptions, 1) {
            return self.refused(id, r).await;
        }
        let watches = self.s.watches.clone();
        let reg = self.held.watching.get_or_insert_with(|| watches.register());
        if !watches.subscribe(reg, ns, prefix) {
            self.held.account.release(ns, Resource::Subscriptions, 1);
        }
        self.answer(id, Ok(Reply::Done)).await
    }

    /// Leases the keys, written yet or not (their removal `ttl_ms` from now, unless renewed),
    /// or ends their leases (`ttl_ms` 0). Counts the keys present.
    pub(super) async fn expire(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        ttl_ms: u64,
        now: Millis,
    ) -> Next {
        if let Err(code) = self.s.batch_check(keys.len()) {
            return self.answer(id, Err(code)).await;
        }
        let mut n = 0;
        for k in keys.iter() {
            match self.s.pool.provenance(ns, k.as_slice()) {
                Ok(found) => n += found.is_some() as u64,
                Err(e) => return self.answer(id, Err(e.into())).await,
            }
        }
        let until = (ttl_ms > 0).then(|| now.saturating_add(ttl_ms));
        let keys = keys.iter().map(|k| k.as_slice());
        if let Err(r) = self.s.watches.lease(ns, keys, until) {
            return self.refused(id, r).await;
        }
        self.answer(id, Ok(Reply::Count(n))).await
    }

    /// Posts tombstones (the keys' producer gave up on them) and wakes their watchers.
    pub(super) async fn fail_keys(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        reason: &str,
        now: Millis,
    ) -> Next {
        if let Err(code) = self.s.batch_check(keys.len()) {
            return self.answer(id, Err(code)).await;
        }
        if let Err(e) = self.s.pool.check_namespace(ns) {
            return self.answer(id, Err(e.into())).await;
        }
        // (A reason over MAX_REASON bytes is cut by the registry.)
        for k in keys.iter() {
            if self.s.pool.check_key(k.as_slice()).is_err() {
                return self.answer(id, Err(ErrorCode::BadKey)).await;
            }
        }
        let posted = self
            .s
            .watches
            .fail(ns, keys.iter().map(|k| k.as_slice()), reason, now);
        if let Err(r) = posted {
            return self.refused(id, r).await;
        }
        let n = keys.len() as u64;
        self.s.metrics.handoff_failed(HandoffFailure::Failed, n);
        self.answer(id, Ok(Reply::Count(n))).await
    }

    /// Aborts a request's keys here, on both sides of its handoff: objects removed (pinned
    /// too), pending allocations released (a reservation's or a producer's later commit fails),
    /// leases dropped, then tombstones posted as by `Fail`, so every watcher wakes at once.
    /// Counts the objects and allocations freed.
    pub(super) async fn cancel(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        reason: &str,
        now: Millis,
    ) -> Next {
        if let Err(code) = self.s.batch_check(keys.len()) {
            return self.answer(id, Err(code)).await;
        }
        if reason.len() > MAX_REASON {
            let msg = format!("a reason is at most {MAX_REASON} bytes");
            self.fail(id, ErrorCode::TooLarge, &msg).await?;
            return Ok(true);
        }
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        let freed = match self.s.cancel(ns, &keys) {
            Ok(n) => n,
            Err(e) => return self.answer(id, Err(e.into())).await,
        };
        let n = keys.len() as u64;
        self.s.metrics.handoff_failed(HandoffFailure::Cancelled, n);
        // Ending leases is never refused.
        let _ = self.s.watches.lease(ns, keys.iter().copied(), None);
        // The objects are gone; the tombstones that wake their waiters may still meet the
        // namespace's bound, which the client is told (a cancel can be sent again).
        if let Err(r) = self.s.watches.fail(ns, keys.iter().copied(), reason, now) {
            return self.refused(id, r).await;
        }
        // Cancelled here, but by a view this node has since left: the client cancels again by
        // the new one, as a `Remove` is removed again (`Shared::remove_keys`).
        if self.answered_moved(id, true).await? {
            return Ok(true);
        }
        self.answer(id, Ok(Reply::Count(freed))).await
    }
}
