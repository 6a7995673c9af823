//! The node's data operations, apart from any wire protocol: what every front door (the native
//! protocol in `handler`, a Redis-protocol one) calls once it has framed a request.
//!
//! A front door owns its framing, its replies and its metrics; it calls in here for everything
//! that decides what a request does to the pool, so each rule lives once:
//!
//! - who may use which namespace: [`Shared::authenticate`] (a token to an [`Access`]) and
//!   [`Shared::namespace`] (a name to an id, checked against the access);
//! - writes: [`Shared::begin_put`] (for a value streamed into its allocation) and
//!   [`Shared::put_value`] (a value already in memory), both noting the write for the cluster;
//! - reads: [`Shared::get`] and [`Shared::exists_run`], which serve a read routed by a cluster
//!   view only from an object continuous since it was written ([`Routing`], [`kvpool::placement::history`]);
//! - [`Shared::remove`] and [`Shared::count`];
//! - listing: [`Shared::scan`], one bounded page of a namespace's keys with a prefix.

use std::sync::Arc;
use std::time::Instant;

use kvpool::pool::{ObjectRef, ScanPage};
use kvpool::protocol::auth::ClusterSecret;
use kvpool::protocol::{ErrorCode, HelloInfo, Replication};
use kvpool::{Commit, GlobalAddr, Millis, Pool, PoolError};

use crate::cluster::{Cluster, Continuity};
use crate::deadline::ConnPolicy;
use crate::metrics::Metrics;

/// What every connection shares.
pub(crate) struct Shared {
    pub(crate) pool: Arc<Pool>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) started: Instant,
    pub(crate) hello: HelloInfo,
    pub(crate) cluster: Arc<Cluster>,
    /// Limits before and after the handshake and the timeouts of every stage of a connection.
    pub(crate) conn: ConnPolicy,
    /// Handoff watches and tombstones (told of every commit by the pool).
    pub(crate) watches: Arc<crate::watch::Watches>,
    /// KV events for routers (told of every commit, removal and eviction by the pool, and of
    /// the disk tier's changes).
    pub(crate) events: Arc<crate::events::EventHub>,
    /// Turns of the bulk transfers (docs/ARCHITECTURE.md, "Scheduling").
    pub(crate) bulk: Arc<crate::bulk::Bulk>,
    /// Heap buffers released by closed connections, given back to the OS in batches.
    pub(crate) trim: Arc<crate::trim::Trim>,
    /// The staging areas of same-host writers.
    pub(crate) stagings: Arc<crate::staging::Stagings>,
    /// What peers make the node hold, per connection and per namespace, and its bounds.
    pub(crate) ledger: Arc<crate::ledger::Ledger>,
    /// Who may connect, and which namespaces each token opens.
    pub(crate) auth: Auth,
    /// What proves and bounds the cluster's own peers.
    pub(crate) peers: PeerPolicy,
    /// The disk tier under DRAM (`[disk]`); None when it is off.
    pub(crate) disk: Option<Arc<crate::disk_tier::DiskTier>>,
    /// The segments registered with a fabric (`[listen] fabric`); None when it is off.
    pub(crate) fabric: Option<Arc<crate::fabric::NodeFabric>>,
}

/// Who may connect, and which namespaces each token opens.
pub(crate) struct Auth {
    /// The node's token: admits to every namespace (empty: none needed).
    pub(crate) token: String,
    /// Per namespace id, the tokens that may use it (empty, with no read tokens either: every
    /// accepted client).
    pub(crate) ns_tokens: Vec<Vec<String>>,
    /// Per namespace id, the tokens that may only read it (missing ids: none).
    pub(crate) ns_read_tokens: Vec<Vec<String>>,
    /// Wrong tokens, per peer address and across the node (`[limits] auth_failures`,
    /// `auth_failures_per_second`).
    pub(crate) failures: crate::auth_limit::AuthFailures,
    /// Authenticated connections per token (`[limits] max_connections_per_token`).
    pub(crate) per_token: Arc<crate::admission::TokenCounts>,
}

/// What proves and bounds the cluster's own peers.
pub(crate) struct PeerPolicy {
    /// Proves cluster peers (`ClusterAuth`): only they may gossip, drain and move objects.
    pub(crate) secret: ClusterSecret,
    /// Wrong proofs of the cluster secret, across the node
    /// (`[limits] cluster_auth_failures_per_second`).
    pub(crate) failures: crate::auth_limit::AuthFailures,
    /// The longest a call to another node made for a request may take (four heartbeats, as
    /// the mover's): asking for objects while the cluster settles, moving them when asked.
    pub(crate) timeout: std::time::Duration,
}

/// Why a token was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AuthDenied {
    /// The token admits to nothing.
    Wrong,
    /// Refused unchecked: the peer's address failed too often, or the node's budget of
    /// failures is spent and the address failed recently.
    Throttled(crate::auth_limit::Throttled),
}

impl AuthDenied {
    /// What the peer is told.
    pub(crate) fn message(self) -> String {
        match self {
            AuthDenied::Wrong => "wrong or missing auth token".into(),
            AuthDenied::Throttled(t) if t.node_wide => format!(
                "too many failed authentications on this node, this address's among them; \
                 retry in {} ms ([limits] auth_failures_per_second)",
                t.wait.as_millis().max(1)
            ),
            AuthDenied::Throttled(t) => format!(
                "too many failed authentications from this address; retry in {} ms \
                 ([limits] auth_failures)",
                t.wait.as_millis().max(1)
            ),
        }
    }
}

/// The namespaces one connection may use, decided by the token it authenticated with.
#[derive(Clone, Debug)]
pub(crate) struct Access {
    /// Per namespace id: may read it.
    allowed: Vec<bool>,
    /// Per namespace id: may also write it (put, remove, pin, ...).
    writable: Vec<bool>,
}

impl Access {
    /// May this connection use namespace `ns`? An id the pool does not have is allowed here, so
    /// that the pool answers it with `UnknownNamespace`.
    pub(crate) fn allows(&self, ns: u32) -> bool {
        self.allowed.get(ns as usize).copied().unwrap_or(true)
    }

    /// May this connection change namespace `ns` (not only read it)? As [`Access::allows`]
    /// for an id the pool does not have.
    pub(crate) fn writes(&self, ns: u32) -> bool {
        self.writable.get(ns as usize).copied().unwrap_or(true)
    }

    /// Every namespace: the connection proved the cluster secret.
    pub(crate) fn grant_all(&mut self) {
        self.allowed.iter_mut().for_each(|a| *a = true);
        self.writable.iter_mut().for_each(|a| *a = true);
    }
}

/// How a read reached this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Routing {
    /// Sent here on purpose (view stamp 0: a previous-owner read, the mover, admin tools, or a
    /// front door without cluster views): serve whatever object is here.
    Direct,
    /// Routed by the cluster view of this stamp to this node as a key's owner (or replica):
    /// serve only an object this node held as one of its first owners in every view since it
    /// was written, and only while that view is still this node's (a read routed by a view the
    /// node has since left misses, and changes nothing).
    ByView(u64),
}

impl Routing {
    /// The routing of a request that carried view stamp `stamp` (0: none).
    pub(crate) fn of_stamp(stamp: u64) -> Routing {
        match stamp {
            0 => Routing::Direct,
            stamp => Routing::ByView(stamp),
        }
    }
}

/// Why a namespace name was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NamespaceError {
    /// No namespace of that name on this node.
    #[error("unknown namespace {0:?}")]
    Unknown(String),
    /// The connection's token does not admit to it.
    #[error("not authorised for namespace {0:?}")]
    Unauthorized(String),
}

impl From<&NamespaceError> for ErrorCode {
    fn from(e: &NamespaceError) -> ErrorCode {
        match e {
            NamespaceError::Unknown(_) => ErrorCode::UnknownNamespace,
            NamespaceError::Unauthorized(_) => ErrorCode::Unauthorized,
        }
    }
}

impl Shared {
    /// The pool's clock: milliseconds since the daemon started.
    pub(crate) fn now(&self) -> Millis {
        self.started.elapsed().as_millis() as Millis
    }

    /// The instant `at` on the pool's clock (milliseconds since `started`).
    pub(crate) fn instant_at(&self, at: Millis) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.started + std::time::Duration::from_millis(at))
    }

    /// The namespaces `token` admits to, or `None` when it admits to nothing (the connection
    /// must then be refused). With no node token configured every client is admitted. The node's
    /// token admits to every namespace; a namespace token to its own namespaces and the open
    /// ones (those without tokens).
    ///
    /// A front door calls this once per connection, before any keyed operation, and keeps the
    /// [`Access`] for [`Shared::namespace`] (or [`Access::allows`] when it has ids).
    ///
    /// Tokens are compared in constant time (`kvpool::protocol::auth::token_matches`): every
    /// configured token is compared, with no early exit, whatever matches.
    pub(crate) fn authenticate(&self, token: &str) -> Option<Access> {
        use kvpool::protocol::auth::{digests_equal, token_digest};
        let presented = token_digest(token.as_bytes());
        let matches = |t: &String| digests_equal(&presented, &token_digest(t.as_bytes()));
        let any = |ts: &[String]| ts.iter().fold(false, |any, t| any | matches(t));
        let admin = !self.auth.token.is_empty() & matches(&self.auth.token);
        let none = Vec::new();
        let read_tokens = |i: usize| self.auth.ns_read_tokens.get(i).unwrap_or(&none);
        // Per namespace: (open to everyone, a write token matched, a read token matched).
        let per_ns: Vec<(bool, bool, bool)> = self
            .auth
            .ns_tokens
            .iter()
            .enumerate()
            .map(|(i, ts)| {
                let rs = read_tokens(i);
                (ts.is_empty() && rs.is_empty(), any(ts), any(rs))
            })
            .collect();
        let ns_token = per_ns.iter().fold(false, |acc, &(_, w, r)| acc | w | r);
        if !(self.auth.token.is_empty() || admin || ns_token) {
            return None;
        }
        Some(Access {
            allowed: per_ns
                .iter()
                .map(|&(open, w, r)| open || admin || w || r)
                .collect(),
            writable: per_ns
                .iter()
                .map(|&(open, w, _)| open || admin || w)
                .collect(),
        })
    }

    /// [`Shared::authenticate`] for a peer presenting a token (a `Hello`, a RESP `AUTH`), with
    /// its wrong tokens counted per address and across the node, and refused unchecked past
    /// `[limits] auth_failures` or, from an address that failed recently,
    /// `auth_failures_per_second`.
    pub(crate) fn authenticate_peer(
        &self,
        token: &str,
        peer: Option<std::net::IpAddr>,
    ) -> Result<Access, AuthDenied> {
        let now = Instant::now();
        if let Err(throttled) = self.auth.failures.check(peer, now) {
            self.metrics.auth_throttled();
            return Err(AuthDenied::Throttled(throttled));
        }
        self.authenticate(token).ok_or_else(|| {
            self.metrics.auth_failed();
            self.auth.failures.failed(peer, now);
            AuthDenied::Wrong
        })
    }

    /// Checks a peer's proof of the cluster secret (`ClusterAuth`) for `challenge`, the one this
    /// node sent it. Wrong proofs are counted across the node: past
    /// `[limits] cluster_auth_failures_per_second`, one from an address that failed recently is
    /// refused unchecked.
    pub(crate) fn verify_cluster_peer(
        &self,
        peer: Option<std::net::IpAddr>,
        challenge: &kvpool::protocol::auth::AuthBytes,
        nonce: &kvpool::protocol::auth::AuthBytes,
        proof: &kvpool::protocol::auth::AuthBytes,
    ) -> Result<(), AuthDenied> {
        let now = Instant::now();
        if let Err(throttled) = self.peers.failures.check(peer, now) {
            self.metrics.cluster_auth_throttled();
            return Err(AuthDenied::Throttled(throttled));
        }
        let node = self.hello.node;
        if self.peers.secret.verify_peer(node, challenge, nonce, proof) {
            return Ok(());
        }
        self.metrics.cluster_auth_failed();
        self.peers.failures.failed(peer, now);
        Err(AuthDenied::Wrong)
    }

    /// Moves a connection's count under `limits.max_connections_per_token` to `token`, just
    /// accepted: `held` is its slot so far (none for an empty token, and none before). Refused,
    /// with `held` left as it was, when `token` has the cap open already; a connection that
    /// authenticates again with its own token keeps its slot.
    pub(crate) fn admit_token(
        &self,
        token: &str,
        held: &mut Option<crate::admission::TokenSlot>,
    ) -> Result<(), String> {
        if token.is_empty() {
            *held = None;
            return Ok(());
        }
        let digest = kvpool::protocol::auth::token_digest(token.as_bytes());
        if held.as_ref().is_some_and(|h| *h.key() == digest) {
            return Ok(());
        }
        match self.auth.per_token.enter(digest) {
            Some(slot) => {
                *held = Some(slot);
                Ok(())
            }
            None => {
                self.metrics
                    .limit_refused(crate::metrics::Limit::ConnectionsPerToken);
                Err(format!(
                    "this token has {} connections open already \
                     (limits.max_connections_per_token)",
                    self.auth.per_token.max()
                ))
            }
        }
    }

    /// The id of the namespace called `name`, if `access` may use it.
    pub(crate) fn namespace(&self, access: &Access, name: &str) -> Result<u32, NamespaceError> {
        let ns = self
            .pool
            .namespace_id(name)
            .ok_or_else(|| NamespaceError::Unknown(name.to_string()))?;
        if !access.allows(ns) {
            return Err(NamespaceError::Unauthorized(name.to_string()));
        }
        Ok(ns)
    }

    /// Refuses a batch of more than `limits.max_batch` items.
    pub(crate) fn batch_check(&self, n: usize) -> Result<(), ErrorCode> {
        if n > self.conn.limits.max_batch as usize {
            self.metrics.limit_refused(crate::metrics::Limit::Batch);
            return Err(ErrorCode::BatchTooLarge);
        }
        Ok(())
    }

    /// Reserves memory for a `len`-byte value of `key` (block `depth` of a prefix chain, 0
    /// otherwise) and notes the write for the cluster, so an older copy elsewhere is never
    /// served over it.
    ///
    /// The caller then fills the allocation (`pool.begin_write`, before its deadline) and
    /// commits it with the value's checksum (`pool.commit`), or aborts it (`pool.abort`) if the
    /// value never arrives. [`Shared::put_value`] does all of that for a value in memory.
    pub(crate) fn begin_put(
        &self,
        ns: u32,
        key: &[u8],
        len: u64,
        pin: bool,
        depth: u32,
    ) -> Result<GlobalAddr, PoolError> {
        self.cluster.note_write(ns, key);
        self.begin_copy(ns, key, len, pin, depth)
    }

    /// [`Shared::begin_put`] of a cluster peer's copy (the mover handing this node a key it now
    /// owns): not noted as a write, since it is the previous owner's own data, not newer than
    /// the previous owner's copy (so this node may still vouch for that copy while the rest of
    /// the move is in flight).
    pub(crate) fn begin_copy(
        &self,
        ns: u32,
        key: &[u8],
        len: u64,
        pin: bool,
        depth: u32,
    ) -> Result<GlobalAddr, PoolError> {
        // The clock now, not the request's: each item of a long batch gets its whole timeout.
        self.pool
            .alloc_in_chain(ns, key, len, pin, depth, self.now())
    }

    /// Stores a whole value of `key`: allocates, copies, and commits it. With `checksum` the
    /// value is verified against it (xxh3-64; a mismatch stores nothing and fails with
    /// `ChecksumMismatch`); without, it is computed here.
    ///
    /// The front door must have checked `ns` with the connection's [`Access`] and bounded the
    /// value's length by `limits.max_payload` before reading it into memory.
    pub(crate) fn put_value(
        &self,
        ns: u32,
        key: &[u8],
        value: &[u8],
        checksum: Option<u64>,
        pin: bool,
    ) -> Result<(), PoolError> {
        self.put_value_if(ns, key, value, (checksum, None), pin)
            .map(drop)
    }

    /// [`Shared::put_value`] that commits only when the key's presence is `present` (None:
    /// always; see [`Commit::when_present`]); the address written and whether it was
    /// committed. The value is copied into its allocation under a write claim of all of it,
    /// hashed there while it is in cache, and the claim turns into the commit's seal
    /// ([`Commit::claimed`]): the bytes hashed are the bytes committed, and hashed once. A
    /// `checksum` given is compared with that hash.
    pub(crate) fn put_value_if(
        &self,
        ns: u32,
        key: &[u8],
        value: &[u8],
        (checksum, present): (Option<u64>, Option<bool>),
        pin: bool,
    ) -> Result<(GlobalAddr, bool), PoolError> {
        let addr = self.begin_put(ns, key, value.len() as u64, pin, 0)?;
        let mut w = match self.pool.begin_write_range(&addr, 0, value.len() as u64) {
            Ok(w) => w,
            Err(e) => {
                let _ = self.pool.abort(&addr);
                return Err(e);
            }
        };
        let bytes = w.bytes_mut();
        bytes.copy_from_slice(value);
        let hashed = kvpool::checksum(bytes);
        let c = Commit::claimed(w, checksum.unwrap_or(hashed), hashed).when_present(present);
        Ok((addr, self.pool.commit(c)?))
    }

    /// The first half of [`Shared::put_value`]: `value` copied into a fresh allocation of
    /// `key` (given back if the copy fails), not yet committed. For a front door that commits
    /// on its own terms (a [`Commit`] with a condition, or of several values).
    pub(crate) fn stage_value(
        &self,
        ns: u32,
        key: &[u8],
        value: &[u8],
        pin: bool,
    ) -> Result<GlobalAddr, PoolError> {
        let addr = self.begin_put(ns, key, value.len() as u64, pin, 0)?;
        if let Err(e) = self.pool.write(&addr, 0, value) {
            let _ = self.pool.abort(&addr);
            return Err(e);
        }
        Ok(addr)
    }

    /// The object of `key`, held for reading until the reference is dropped (stream its bytes,
    /// then drop it: a held object cannot be evicted). A read routed [`Routing::ByView`] misses
    /// an object that is not continuous, and removes it; one routed by a view this node has
    /// since left misses and removes nothing (the front door answers `WrongView`).
    pub(crate) fn get<'a>(
        &'a self,
        ns: u32,
        key: &'a [u8],
        now: Millis,
        routing: Routing,
    ) -> Result<ObjectRef<'a>, PoolError> {
        let obj = match self.pool.get_ref(ns, key, now) {
            Err(PoolError::NotFound) if self.promote(ns, key, now, routing) => {
                self.pool.get_ref(ns, key, now)?
            }
            found => found?,
        };
        let (generation, pinned) = (obj.generation(), obj.pinned());
        match self.continuity(ns, key, generation, pinned, routing) {
            Continuity::Continuous => Ok(obj),
            Continuity::Broken => {
                drop(obj);
                let _ = self.pool.remove_generation(ns, key, generation);
                Err(PoolError::NotFound)
            }
            Continuity::Moved => Err(PoolError::NotFound),
        }
    }

    /// Brings `key`'s copy on the disk tier up into DRAM, if there is a tier, DRAM lacks the key
    /// and the copy may be served to a read routed by `routing` (judged as an object in DRAM of
    /// the copy's generation would be): whether DRAM may now hold it. For the reads that find
    /// objects in DRAM only (`Lookup`, `Hold`); a get promotes by itself.
    pub(crate) fn bring_up(&self, ns: u32, key: &[u8], now: Millis, routing: Routing) -> bool {
        self.disk.is_some() && matches!(self.pool.provenance(ns, key), Ok(None)) && {
            self.promote(ns, key, now, routing)
        }
    }

    /// [`DiskTier::promote`](crate::disk_tier::DiskTier::promote) of `key`, judged by `routing`.
    fn promote(&self, ns: u32, key: &[u8], now: Millis, routing: Routing) -> bool {
        let Some(d) = &self.disk else {
            return false;
        };
        let promote = || {
            let judge = |generation| self.continuity(ns, key, generation, false, routing);
            d.promote(&self.pool, (ns, key), now, judge)
        };
        // The disk read blocks this thread: on the daemon's multi-threaded runtime its other
        // tasks move to another worker meanwhile.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(promote),
            _ => promote(),
        }
    }

    /// Length of the leading run of `keys` present here (what prefix lookups need; one key
    /// for a plain existence check). Under [`Routing::ByView`] the run also ends at the first
    /// object not served as its owner's. Does not change recency.
    pub(crate) fn exists_run<'k, I>(
        &self,
        ns: u32,
        keys: I,
        routing: Routing,
    ) -> Result<usize, PoolError>
    where
        I: Iterator<Item = &'k [u8]> + Clone,
    {
        self.served_run(ns, keys, routing, Pool::exists_prefix)
    }

    /// [`Shared::exists_run`] without counting a prefix lookup: how many of `keys`, from the
    /// first, a prefix read would find here. Does not change recency.
    pub(crate) fn present_run<'k, I>(
        &self,
        ns: u32,
        keys: I,
        routing: Routing,
    ) -> Result<usize, PoolError>
    where
        I: Iterator<Item = &'k [u8]> + Clone,
    {
        self.served_run(ns, keys, routing, Pool::present_prefix)
    }

    /// The two above: the leading run `present` finds here, cut at the first key a read routed
    /// by `routing` may not serve.
    fn served_run<'k, I>(
        &self,
        ns: u32,
        keys: I,
        routing: Routing,
        present: fn(&Pool, u32, I) -> Result<usize, PoolError>,
    ) -> Result<usize, PoolError>
    where
        I: Iterator<Item = &'k [u8]> + Clone,
    {
        let n = present(&self.pool, ns, keys.clone())?;
        Ok(keys
            .take(n)
            .position(|k| !self.fresh_key(ns, k, routing))
            .unwrap_or(n))
    }

    /// Whether a request routed by `routing` was routed by a view this node has since left
    /// (never a direct one).
    pub(crate) fn view_moved(&self, routing: Routing) -> bool {
        matches!(routing, Routing::ByView(stamp) if self.cluster.stamp() != stamp)
    }

    /// Commits a routed put's pending allocation `addr` with `commit`, judged by the view the
    /// put was routed by (`routing`): when that view is no longer this node's, the allocation
    /// is aborted instead and the answer is `WrongView`; when it stopped being so while `commit`
    /// ran, the value stays committed here and the answer is `WrongView` all the same. Either
    /// way the client puts it again by the new view. Without the second check, this node's
    /// mover could hand the key's older value to its new owner just before the commit, and the
    /// new owner would go on serving it; with it, the client's write by the new view reaches
    /// the new owner as a write, which a later copy from here can't replace.
    pub(crate) fn commit_in_view(
        &self,
        addr: &GlobalAddr,
        routing: Routing,
        commit: impl FnOnce() -> Result<(), PoolError>,
    ) -> Result<(), ErrorCode> {
        if self.view_moved(routing) {
            let _ = self.pool.abort(addr);
            return Err(ErrorCode::WrongView);
        }
        commit()?;
        match self.view_moved(routing) {
            true => Err(ErrorCode::WrongView),
            false => Ok(()),
        }
    }

    /// Removes `keys` (a `Remove`); returns how many existed, and whether the request was
    /// routed by a view this node had left by the time they were removed. Such a removal is
    /// done here, but the view changed between the front door's stamp check and the removal,
    /// so this node's mover may already have handed a key's older value to its new owner: the
    /// front door answers `WrongView` and the client removes again by the new view (a removal
    /// is idempotent, and a copy arriving after it is refused there as superseded). A view
    /// change after the check moves nothing: the keys are gone by then.
    pub(crate) fn remove_keys<'k>(
        &self,
        ns: u32,
        keys: impl Iterator<Item = &'k [u8]>,
        routing: Routing,
    ) -> Result<(u64, bool), PoolError> {
        let mut n = 0;
        for key in keys {
            n += self.remove(ns, key)? as u64;
        }
        Ok((n, self.view_moved(routing)))
    }

    /// Removes `key`; returns whether it existed. Noted as a write for the cluster first, so a
    /// previous owner's older copy is not served in its place.
    pub(crate) fn remove(&self, ns: u32, key: &[u8]) -> Result<bool, PoolError> {
        self.cluster.note_write(ns, key);
        self.pool.remove(ns, key)
    }

    /// Aborts `keys` of namespace `ns` here (`Cancel`): their objects removed and their pending
    /// allocations released ([`Pool::cancel`]), each noted as a write for the cluster first like
    /// [`Shared::remove`]'s. Returns how many objects and allocations it freed.
    pub(crate) fn cancel(&self, ns: u32, keys: &[&[u8]]) -> Result<u64, PoolError> {
        self.pool.check_namespace(ns)?;
        for key in keys {
            kvpool::pool::check_key(key)?;
            self.cluster.note_write(ns, key);
        }
        self.pool.cancel(ns, keys)
    }

    /// Removes every object of namespace `ns` here, pinned ones too; returns how many it
    /// removed. The keys are walked a bounded page at a time (`pool.scan`), each removal noted
    /// as a write for the cluster like [`Shared::remove`]'s. Objects written meanwhile may or
    /// may not be removed.
    pub(crate) fn clear(&self, ns: u32) -> Result<u64, PoolError> {
        const PAGE: usize = 4096;
        let mut cursor = 0;
        let mut removed = 0;
        loop {
            let page = self.pool.scan(ns, cursor, PAGE, &mut |_| true)?;
            for key in &page.keys {
                removed += self.remove(ns, key)? as u64;
            }
            if page.cursor == 0 {
                let below = self.disk.as_ref().map_or(0, |d| d.clear(ns));
                self.events.cleared(ns);
                return Ok(removed + below);
            }
            cursor = page.cursor;
        }
    }

    /// One page of the keys of namespace `ns` here that start with `prefix` (see
    /// [`Pool::scan`] for the cursor): committed objects only, at most `count` index slots
    /// looked at (at least 1, at most `max_batch`, so the page is bounded too). Under
    /// [`Routing::ByView`] a key is listed only when this node would serve it to a routed read
    /// (it held the object as one of its first owners in every view since it was written), so
    /// a copy kept for another owner is not listed; unlike a routed read, the listing removes
    /// nothing. A prefix longer than a key can be is `BadKey`.
    pub(crate) fn scan(
        &self,
        ns: u32,
        cursor: u64,
        count: u32,
        prefix: &[u8],
        routing: Routing,
    ) -> Result<ScanPage, PoolError> {
        if prefix.len() > kvpool::MAX_KEY_LEN {
            return Err(PoolError::BadKey);
        }
        let budget = count.clamp(1, self.conn.limits.max_batch.max(1)) as usize;
        let mut page = self
            .pool
            .scan(ns, cursor, budget, &mut |k| k.starts_with(prefix))?;
        if routing != Routing::Direct {
            // Outside the scan's shard lock: provenance takes the key's own shard lock.
            page.keys.retain(|k| {
                matches!(self.pool.provenance(ns, k), Ok(Some((generation, pinned)))
                    if self.continuity(ns, k, generation, pinned, routing)
                        == Continuity::Continuous)
            });
        }
        Ok(page)
    }

    /// How many committed objects namespace `ns` holds (its keys are walked a page at a time
    /// with `pool.scan`).
    pub(crate) fn count(&self, ns: u32) -> Result<u64, PoolError> {
        self.pool
            .stats()
            .namespaces
            .iter()
            .find(|n| n.id == ns)
            .map(|n| n.objects)
            .ok_or(PoolError::UnknownNamespace)
    }

    /// What this node proves itself to its peers with: its token and the cluster secret.
    pub(crate) fn peer_auth(&self) -> crate::peer::PeerAuth {
        crate::peer::PeerAuth {
            token: self.auth.token.clone(),
            secret: self.peers.secret.clone(),
            traffic: self.metrics.peer_traffic(),
        }
    }

    /// Namespace `ns`'s replication factors, as told to clients in `Hello`.
    pub(crate) fn replication(&self, ns: u32) -> Option<&Replication> {
        self.hello.replication.iter().find(|r| r.ns == ns)
    }

    /// False when the read is routed by a view and the object of `key` here is not continuous
    /// (it is then removed), or the view it was routed by is no longer this node's (nothing is
    /// removed); true otherwise, also when there is no object.
    pub(crate) fn fresh_key(&self, ns: u32, key: &[u8], routing: Routing) -> bool {
        if routing == Routing::Direct {
            return true;
        }
        let Ok(found) = self.pool.provenance(ns, key) else {
            return true;
        };
        let Some((generation, pinned)) = found else {
            return self.fresh_on_disk(ns, key, routing);
        };
        match self.continuity(ns, key, generation, pinned, routing) {
            Continuity::Continuous => true,
            Continuity::Broken => {
                let _ = self.pool.remove_generation(ns, key, generation);
                false
            }
            Continuity::Moved => false,
        }
    }

    /// [`Shared::fresh_key`] of a key DRAM lacks: false when its disk copy may not be served
    /// to a read routed by `routing` (a broken one is forgotten), true otherwise.
    fn fresh_on_disk(&self, ns: u32, key: &[u8], routing: Routing) -> bool {
        let Some(d) = &self.disk else {
            return true;
        };
        let Some(found) = d.store.lookup(ns, key) else {
            return true;
        };
        match self.continuity(ns, key, found.generation, false, routing) {
            Continuity::Continuous => true,
            Continuity::Broken => {
                d.removed_broken(ns, key);
                false
            }
            Continuity::Moved => false,
        }
    }

    /// May an object of `key` allocated at `generation` be served by this read? Direct reads
    /// read what is here; routed ones only an object this node held as one of its first owners
    /// (the namespace's `replicas`, or `pinned_replicas` for a pinned object) in every view
    /// since it was written, judged while the view they were routed by is still this node's.
    fn continuity(
        &self,
        ns: u32,
        key: &[u8],
        generation: u64,
        pinned: bool,
        routing: Routing,
    ) -> Continuity {
        let Routing::ByView(stamp) = routing else {
            return Continuity::Continuous;
        };
        let replicas = self.replication(ns).map_or(1, |r| {
            if pinned {
                r.replicas.max(r.pinned_replicas)
            } else {
                r.replicas
            }
        });
        self.cluster
            .continuity(stamp, key, generation, replicas.max(1) as usize)
    }
}

#[cfg(test)]
mod tests;
