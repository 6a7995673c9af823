//! One node as a client reaches it: pooled connections, what the node said at the handshake,
//! and — when the node runs on this host — its segments mapped for direct loads and stores.
//! Every operation here goes to this node only; the routing layer (`client`) decides which
//! node. This module uses `conn`, `local`, `config`, `endpoint` and `error`, never `client`.
//!
//! A link outlives the daemon it first reached: when the daemon restarts, pooled connections
//! that the old daemon closed are noticed before use and dropped, a fresh connection shakes
//! hands again, and when the handshake names another incarnation the link drops every pooled
//! connection, takes the new namespace ids and maps the new segment files (the old mapping,
//! of the dead daemon's unlinked files, is released once no read holds it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kvpool::protocol::{
    AllocItem, CommitItem, ErrorCode, HelloInfo, LocatedWire, Op, PutItem, Reply, StagedCommit,
};
use kvpool::{checksum, AddrFault, GlobalAddr};

use crate::config::{ClientConfig, SameHost};
use crate::conn::{quic_connect, Class, Conn};
use crate::cores::CopyThreads;
use crate::endpoint::Endpoint;
use crate::error::ClientError;
use crate::local::{LocalMap, LocalReadError};
use crate::seen::SeenIndex;
use crate::staging::StagingArea;

/// Values at least this large take the same-host path for single puts (below it one socket
/// round trip is cheaper than the alloc and commit round trips).
const LOCAL_PUT_MIN: usize = 16 << 10;

/// A committed object located for one-sided reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Located {
    /// Its address.
    pub addr: GlobalAddr,
    /// xxh3-64 of its bytes.
    pub checksum: u64,
}

impl From<LocatedWire> for Located {
    fn from(l: LocatedWire) -> Self {
        Located {
            addr: l.addr,
            checksum: l.checksum,
        }
    }
}

/// A traffic class, as the client keeps its connections: a call moving at least
/// [`Lane::BULK_BYTES`] (a large value or batch, by what it sends or has room to receive) uses
/// the bulk connections, any other the latency ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    Latency = 0,
    Bulk = 1,
}

impl Lane {
    /// The nodes' default `[limits] bulk_threshold`.
    pub(crate) const BULK_BYTES: u64 = 256 << 10;

    pub(crate) fn of(bytes: u64) -> Lane {
        if bytes >= Lane::BULK_BYTES {
            Lane::Bulk
        } else {
            Lane::Latency
        }
    }
}

/// A connection pool to one node.
pub(crate) struct Link {
    pub(crate) endpoint: Endpoint,
    /// What the node said at the first handshake.
    pub(crate) hello: HelloInfo,
    namespaces: RwLock<HashMap<String, u32>>,
    /// Idle connections of each traffic class ([`Lane`]): a small request never picks up a
    /// connection that a bulk transfer is using, and the two have their own caps.
    idle: [Mutex<Vec<Conn>>; 2],
    /// Connections in use per class at most (`max_connections`, `max_bulk_connections`); more
    /// concurrent calls wait for one, within their timeout.
    slots: [tokio::sync::Semaphore; 2],
    /// The QUIC connection streams are opened on (QUIC endpoints only); replaced when closed.
    quic: Mutex<Option<(quinn::Endpoint, quinn::Connection)>>,
    /// The incarnation of the daemon the link last shook hands with.
    incarnation: AtomicU64,
    /// The node is on this host and the link maps its segments (again after a restart).
    same_host: bool,
    /// The mapping of the current incarnation's segments; None when not on the same host or
    /// when mapping the restarted daemon's segments failed (then the socket serves).
    local: RwLock<Option<Arc<LocalMap>>>,
    /// Where this client last found same-host objects ([`SeenIndex`]).
    seen: Mutex<SeenIndex>,
    /// Where same-host puts go when the node maps its segments read-only to this client
    /// ([`StagingArea`]); of the current incarnation.
    staging: RwLock<Option<Arc<StagingArea>>>,
    /// Whether the index may be read without asking the node ([`Watch`]).
    watch: Watch,
}

/// Keeps the seen index honest about the daemon's life. Reads from the index ask the node
/// nothing, so a client would go on serving a dead daemon's last values out of its memory (and,
/// were another daemon started on other files, values it no longer has). So the index is only
/// read while a watch connection to the node, idle after its handshake, stays open: the
/// daemon's exit (or a restart, or an idle timeout closing it) ends the connection and the
/// watching task clears `alive` as soon as it runs; reads then look up through the socket, and
/// the first one the node answers arms a new watch. The task ends with the link (`stop`
/// dropped).
///
/// The watching task may run late on a busy machine, so a call of this client's own that finds
/// the node gone (a broken stream, a refused connect) ends the watch too, before it returns
/// ([`Watch::lost`]): after a call has failed that way, no read is served from the index until
/// the node answers again.
struct Watch {
    /// The id of the watch that holds the index open; 0 while none does. Each watch clears it
    /// only if it still holds its own id, so a watch that ends late never closes the index a
    /// newer one opened.
    alive: Arc<AtomicU64>,
    /// The last id handed out.
    ids: AtomicU64,
    arming: Arc<AtomicBool>,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Watch {
    fn new() -> Watch {
        Watch {
            alive: Arc::new(AtomicU64::new(0)),
            ids: AtomicU64::new(0),
            arming: Arc::new(AtomicBool::new(false)),
            stop: Mutex::new(None),
        }
    }

    fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) != 0
    }

    /// The node was found gone by a call: the index closes now, and the watch's task is told to
    /// end (it clears nothing a newer watch set).
    fn lost(&self) {
        self.alive.store(0, Ordering::Release);
        drop(self.stop.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Link {
    /// Connects and shakes hands; on the same host switches to the Unix socket and maps the
    /// node's segments (unless `cfg.same_host` is off).
    pub(crate) async fn open(
        mut endpoint: Endpoint,
        cfg: &ClientConfig,
    ) -> Result<Link, ClientError> {
        let quic = match endpoint {
            Endpoint::Quic(_) => Some(quic_connect(&endpoint, cfg).await?),
            _ => None,
        };
        let (mut conn, mut hello) =
            Conn::open(&endpoint, cfg, (quic.as_ref().map(|q| &q.1), false)).await?;
        let mut local = None;
        let mut staging = None;
        if cfg.same_host == SameHost::Auto
            && !hello.uds_path.is_empty()
            && hello.host_id == kvpool::segment::host_id()
        {
            let uds = Endpoint::Unix(hello.uds_path.clone().into());
            // Same host: control goes over the Unix socket, data through the mapping.
            if let Ok((mut c, h)) = Conn::open(&uds, cfg, (None, false)).await {
                if let Ok((reply, fds)) = c.call_with_fds(Op::MapInfo, cfg.timeout).await {
                    match map_offered(reply, fds, &h) {
                        Ok(m) => {
                            if m.has_read_only() {
                                staging = open_staging(&uds, cfg).await;
                            }
                            local = Some(m);
                            endpoint = uds;
                            conn = c;
                            hello = h;
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "same-host mapping failed; using the socket path")
                        }
                    }
                }
            }
        }
        let namespaces = hello.namespaces.iter().cloned().collect();
        Ok(Link {
            endpoint,
            incarnation: AtomicU64::new(hello.incarnation),
            hello,
            namespaces: RwLock::new(namespaces),
            idle: [Mutex::new(vec![conn]), Mutex::new(Vec::new())],
            slots: [
                tokio::sync::Semaphore::new(cfg.max_connections.max(1)),
                tokio::sync::Semaphore::new(cfg.max_bulk_connections.max(1)),
            ],
            quic: Mutex::new(quic),
            same_host: local.is_some(),
            local: RwLock::new(local.map(Arc::new)),
            seen: Mutex::new(SeenIndex::new(cfg.local_index)),
            staging: RwLock::new(staging.map(Arc::new)),
            watch: Watch::new(),
        })
    }

    /// The staging area of the current incarnation, when the node handed one out.
    fn staging(&self) -> Option<Arc<StagingArea>> {
        self.staging
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .filter(|s| s.usable())
    }

    /// The mapping of the node's segments, when the same-host path is in use.
    pub(crate) fn local(&self) -> Option<Arc<LocalMap>> {
        self.local.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// After a handshake on a fresh connection: when it names another incarnation than the
    /// link knew, the daemon restarted. Every pooled connection is of the dead daemon, the
    /// namespace ids may have changed and the mapping is of its files: drop them, and map the
    /// new segments over `conn`.
    async fn adopt(
        &self,
        cfg: &ClientConfig,
        conn: &mut Conn,
        hello: &HelloInfo,
    ) -> Result<(), ClientError> {
        let old = self.incarnation.swap(hello.incarnation, Ordering::AcqRel);
        if old == hello.incarnation {
            return Ok(());
        }
        tracing::info!(
            node = hello.node,
            "the node's daemon restarted: reconnecting and remapping"
        );
        self.clear_idle();
        *self.namespaces.write().unwrap_or_else(|e| e.into_inner()) =
            hello.namespaces.iter().cloned().collect();
        if !self.same_host {
            return Ok(());
        }
        let mapped = match conn.call_with_fds(Op::MapInfo, REMAP_WITHIN).await {
            Ok((reply, fds)) => map_offered(reply, fds, hello).map_err(|e| e.to_string()),
            Err(e) if e.keeps_connection() => Err(e.to_string()),
            Err(e) => {
                // The new connection broke: the next one does all this again.
                *self.local.write().unwrap_or_else(|e| e.into_inner()) = None;
                let _ = self.incarnation.compare_exchange(
                    hello.incarnation,
                    old,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
                return Err(e);
            }
        };
        let mapped = mapped
            .inspect_err(|e| {
                tracing::warn!(error = %e, "remapping the restarted node failed; using the socket")
            })
            .ok();
        let staging = match &mapped {
            Some(m) if m.has_read_only() => open_staging(&self.endpoint, cfg).await,
            _ => None,
        };
        *self.staging.write().unwrap_or_else(|e| e.into_inner()) = staging.map(Arc::new);
        *self.local.write().unwrap_or_else(|e| e.into_inner()) = mapped.map(Arc::new);
        Ok(())
    }

    /// The node's id.
    pub(crate) fn node(&self) -> u32 {
        self.hello.node
    }

    /// The name of the node's namespace `id`.
    pub(crate) fn ns_name(&self, id: u32) -> Option<String> {
        self.namespaces
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(_, v)| **v == id)
            .map(|(k, _)| k.clone())
    }

    /// A fresh connection of its own, not pooled, for a long-lived exchange (watching).
    pub(crate) async fn dedicated(&self, cfg: &ClientConfig) -> Result<Conn, ClientError> {
        let quic = self.quic_connection(cfg).await?;
        let (mut c, hello) = Conn::open(&self.endpoint, cfg, (quic.as_ref(), false)).await?;
        self.adopt(cfg, &mut c, &hello).await?;
        Ok(c)
    }

    /// The node's id for namespace `name`.
    pub(crate) fn ns(&self, name: &str) -> Result<u32, ClientError> {
        self.namespaces
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .copied()
            .ok_or_else(|| ClientError::UnknownNamespace(name.to_string()))
    }

    /// Runs one exchange on a pooled connection of the latency class under the call timeout,
    /// routed by view stamp `view` (0: this node on purpose). The connection goes back to the
    /// pool only when the exchange left it in sync.
    pub(crate) async fn run<T>(
        &self,
        cfg: &ClientConfig,
        view: u64,
        f: impl AsyncFnOnce(&mut Conn) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        self.run_in(Lane::Latency, cfg, view, f).await
    }

    /// [`Link::run`] on a connection of `lane`.
    pub(crate) async fn run_in<T>(
        &self,
        lane: Lane,
        cfg: &ClientConfig,
        view: u64,
        f: impl AsyncFnOnce(&mut Conn) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let work = async {
            let _slot = self.slots[lane as usize]
                .acquire()
                .await
                .map_err(|_| ClientError::Protocol("connection pool closed".into()))?;
            let mut conn = match self.pooled(lane) {
                Some(c) => c,
                None => {
                    let quic = self.quic_connection(cfg).await?;
                    let bulk = lane == Lane::Bulk;
                    let (mut c, hello) =
                        Conn::open(&self.endpoint, cfg, (quic.as_ref(), bulk)).await?;
                    self.adopt(cfg, &mut c, &hello).await?;
                    c
                }
            };
            conn.exchange.view = view;
            conn.exchange.class = Class {
                priority: cfg.priority,
                deadline_us: cfg.deadline.map_or(0, |d| d.as_micros().max(1) as u64),
            };
            let r = f(&mut conn).await;
            if r.as_ref().err().is_none_or(ClientError::keeps_connection) {
                conn.last_used = std::time::Instant::now();
                let mut idle = self.idle[lane as usize]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if idle.len() < cfg.max_idle {
                    idle.push(conn);
                }
            }
            r
        };
        let limit = cfg.deadline.map_or(cfg.timeout, |d| d.min(cfg.timeout));
        let r = tokio::time::timeout(limit, work)
            .await
            .map_err(|_| ClientError::Timeout)?;
        if let Err(ClientError::Io(_)) = &r {
            // The node is gone (a stream broke, or a connect was refused): the others of the
            // pool are likely broken too (the daemon exited), and a fresh one will say whether
            // it restarted. Nor is the index read until the node answers again.
            self.watch.lost();
            self.clear_idle();
        }
        r
    }

    /// Drops every pooled connection (the node exited or restarted).
    fn clear_idle(&self) {
        for idle in &self.idle {
            idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// The QUIC connection to open a stream on (None for other transports), connecting again
    /// when the node closed the last one (it exited or restarted).
    async fn quic_connection(
        &self,
        cfg: &ClientConfig,
    ) -> Result<Option<quinn::Connection>, ClientError> {
        if !matches!(self.endpoint, Endpoint::Quic(_)) {
            return Ok(None);
        }
        let current = self
            .quic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|q| q.1.clone());
        if let Some(c) = current.filter(|c| c.close_reason().is_none()) {
            return Ok(Some(c));
        }
        let (ep, c) = quic_connect(&self.endpoint, cfg).await?;
        *self.quic.lock().unwrap_or_else(|e| e.into_inner()) = Some((ep, c.clone()));
        Ok(Some(c))
    }

    /// A pooled connection that still looks usable; pooled ones the node closed meanwhile (it
    /// exited or restarted) are dropped, with every other pooled one when that happens.
    fn pooled(&self, lane: Lane) -> Option<Conn> {
        let mut idle = self.idle[lane as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let c = idle.pop()?;
        if c.looks_open() {
            return Some(c);
        }
        drop(idle);
        self.clear_idle();
        None
    }

    /// A call whose reply carries no payload.
    pub(crate) async fn simple(
        &self,
        cfg: &ClientConfig,
        view: u64,
        op: Op,
        payload: &[&[u8]],
    ) -> Result<Reply, ClientError> {
        let lane = Lane::of(payload.iter().map(|p| p.len() as u64).sum());
        self.run_in(lane, cfg, view, async |c: &mut Conn| {
            c.call_simple(op, payload).await
        })
        .await
    }

    /// Length of the leading run of `keys` present.
    pub(crate) async fn exists(
        &self,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
    ) -> Result<usize, ClientError> {
        let op = Op::Exists {
            ns,
            keys: owned(keys),
        };
        match self.simple(cfg, view, op, &[]).await? {
            Reply::Count(n) => Ok(n as usize),
            r => Err(unexpected(&r)),
        }
    }

    /// Locates (and leases for `lease_ms`) objects.
    pub(crate) async fn lookup(
        &self,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
        lease_ms: u64,
    ) -> Result<Vec<Option<Located>>, ClientError> {
        let op = Op::Lookup {
            ns,
            keys: owned(keys),
            lease_ms,
        };
        match self.simple(cfg, view, op, &[]).await? {
            Reply::Located(v) if v.len() == keys.len() => {
                Ok(v.into_iter().map(|l| l.map(Located::from)).collect())
            }
            r => Err(unexpected(&r)),
        }
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

    /// A keys operation answered with a count (remove, release, pin).
    pub(crate) async fn count(
        &self,
        cfg: &ClientConfig,
        view: u64,
        op: Op,
    ) -> Result<u64, ClientError> {
        match self.simple(cfg, view, op, &[]).await? {
            Reply::Count(n) => Ok(n),
            r => Err(unexpected(&r)),
        }
    }

    /// Stores values (one code per item). On the same host the bytes are copied straight into
    /// the node's memory. `sums`: the values' checksums when the caller has them (the node
    /// checks them on commit either way); otherwise each value is hashed here.
    #[expect(
        clippy::too_many_arguments,
        reason = "the routing layer's one call site"
    )]
    pub(crate) async fn put_many(
        &self,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        items: &[(&[u8], &[u8])],
        sums: Option<&[u64]>,
        pin: bool,
        depths: Vec<u32>,
    ) -> Result<Vec<ErrorCode>, ClientError> {
        debug_assert!(sums.is_none_or(|s| s.len() == items.len()));
        let sum = |i: usize| sums.map_or_else(|| checksum(items[i].1), |s| s[i]);
        let local_worth =
            items.len() > 1 || items.first().is_some_and(|i| i.1.len() >= LOCAL_PUT_MIN);
        if self.same_host && local_worth {
            return self
                .put_local(cfg, view, ns, items, &sum, pin, depths)
                .await;
        }
        if let ([(key, value)], true) = (items, depths.is_empty()) {
            let op = Op::Put {
                ns,
                key: key.to_vec(),
                checksum: sum(0),
                pin,
            };
            return match self.simple(cfg, view, op, &[value]).await {
                Ok(_) => Ok(vec![ErrorCode::Ok]),
                Err(ClientError::Server { code, .. }) if code != ErrorCode::WrongView => {
                    Ok(vec![code])
                }
                Err(e) => Err(e),
            };
        }
        let op = Op::BatchPut {
            depths,
            ns,
            items: items
                .iter()
                .enumerate()
                .map(|(i, (k, v))| PutItem {
                    key: k.to_vec(),
                    len: v.len() as u64,
                    checksum: sum(i),
                })
                .collect(),
            pin,
        };
        let payload: Vec<&[u8]> = items.iter().map(|(_, v)| *v).collect();
        match self.simple(cfg, view, op, &payload).await? {
            Reply::Statuses(s) if s.len() == items.len() => {
                Ok(s.into_iter().map(ErrorCode::from_u16).collect())
            }
            r => Err(unexpected(&r)),
        }
    }

    /// [`Link::put_many`] through the mapping: alloc, store, commit (`sum(i)`: item i's
    /// checksum).
    #[expect(clippy::too_many_arguments, reason = "put_many's own parameters")]
    async fn put_local(
        &self,
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
        let local = self.local();
        let staging = self.staging();
        let mut codes = vec![ErrorCode::Ok; items.len()];
        let mut pending = Uncommitted::default();
        let mut staged = Staged::default();
        let mut inflight: Option<InFlight<'_>> = None;
        let mut sums = vec![0; items.len()];
        for (i, (a, (_, v))) in allocs.iter().zip(items).enumerate() {
            let addr = match a {
                Ok(addr) => addr,
                Err(code) => {
                    codes[i] = *code;
                    continue;
                }
            };
            let direct = local
                .as_deref()
                .is_some_and(|l| l.incarnation() == addr.incarnation && l.covers_writable(addr));
            if let (false, Some(st)) = (direct, staging.as_deref()) {
                // The segment is mapped read-only: the value goes through the staging area.
                let mut range = st.take(v.len() as u64);
                if range.is_none() && (inflight.is_some() || !staged.items.is_empty()) {
                    // Room comes back as the groups before this value are committed.
                    if let Some(f) = inflight.take() {
                        settle(f.await?, &mut codes);
                    }
                    let group = std::mem::take(&mut staged);
                    settle(self.commit_staged(cfg, view, st, group).await?, &mut codes);
                    range = st.take(v.len() as u64);
                }
                if let Some(r) = range {
                    off_runtime(v.len() as u64, || st.fill(r, v));
                    sums[i] = sum(i);
                    staged.items.push(StagedCommit {
                        addr: *addr,
                        offset: r.start,
                        checksum: sums[i],
                    });
                    staged.which.push(i);
                    staged.ranges.push(r);
                    staged.bytes += v.len() as u64;
                    if staged.bytes >= COMMIT_GROUP {
                        // One group in flight while the next is copied: the node copies this
                        // one meanwhile.
                        let group = std::mem::take(&mut staged);
                        let f = Box::pin(self.commit_staged(cfg, view, st, group));
                        launch(&mut inflight, f, &mut codes).await?;
                    }
                    continue;
                }
                // No room now (other threads' puts hold it) or a value larger than the area:
                // over the socket.
            }
            match self
                .write_local_or_remote(cfg, local.as_deref(), addr, v)
                .await
            {
                Ok(()) => {
                    sums[i] = sum(i);
                    pending.commits.push((*addr, sums[i]));
                    pending.which.push(i);
                    pending.bytes += v.len() as u64;
                    if pending.bytes >= COMMIT_GROUP {
                        // As for staged groups: the node hashes this one while the next is
                        // copied.
                        let group = std::mem::take(&mut pending);
                        let f = Box::pin(self.commit_written(cfg, view, group));
                        launch(&mut inflight, f, &mut codes).await?;
                    }
                }
                Err(e) => codes[i] = e.code().unwrap_or(ErrorCode::Unavailable),
            }
        }
        if let Some(f) = inflight.take() {
            settle(f.await?, &mut codes);
        }
        if let Some(st) = staging.as_deref() {
            settle(self.commit_staged(cfg, view, st, staged).await?, &mut codes);
        }
        settle(self.commit_written(cfg, view, pending).await?, &mut codes);
        if staging.as_ref().is_some_and(|st| !st.usable()) {
            // The node retired the area under these puts (its connection closed): the values it
            // did not take are still in their allocations' hands, pending, so they go over the
            // socket instead of failing.
            let mut again = Uncommitted::default();
            for (i, (a, (_, v))) in allocs.iter().zip(items).enumerate() {
                if let (Ok(addr), ErrorCode::Unavailable) = (a, codes[i]) {
                    match self.write(cfg, addr, 0, v).await {
                        Ok(()) => {
                            again.commits.push((*addr, sums[i]));
                            again.which.push(i);
                        }
                        Err(e) => codes[i] = e.code().unwrap_or(ErrorCode::Unavailable),
                    }
                }
            }
            settle(self.commit_written(cfg, view, again).await?, &mut codes);
        }
        let mut seen = self.seen();
        // (No await below: the guard is not held across one.)
        for ((i, a), code) in allocs.iter().enumerate().zip(&codes) {
            if let (Ok(addr), ErrorCode::Ok) = (a, code) {
                let at = Located {
                    addr: *addr,
                    checksum: sums[i],
                };
                seen.insert(ns, items[i].0, at);
            }
        }
        Ok(codes)
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

    /// Reserves memory for values to be written one-sided.
    pub(crate) async fn alloc_many(
        &self,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        items: &[(&[u8], u64)],
        pin: bool,
        depths: Vec<u32>,
    ) -> Result<Vec<Result<GlobalAddr, ErrorCode>>, ClientError> {
        let op = Op::Alloc {
            ns,
            depths,
            items: items
                .iter()
                .map(|(k, l)| AllocItem {
                    key: k.to_vec(),
                    len: *l,
                })
                .collect(),
            pin,
        };
        match self.simple(cfg, view, op, &[]).await? {
            Reply::Allocated(rs) if rs.len() == items.len() => Ok(rs
                .into_iter()
                .map(|r| r.addr.ok_or(ErrorCode::from_u16(r.code)))
                .collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Makes pending allocations visible. `view`: the view stamp their `Alloc` was routed by,
    /// for a node to judge the commit by (0: none, as for a plain two-phase put).
    pub(crate) async fn commit_many(
        &self,
        cfg: &ClientConfig,
        view: u64,
        items: &[(GlobalAddr, u64)],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let op = Op::Commit {
            items: items
                .iter()
                .map(|(addr, checksum)| CommitItem {
                    addr: *addr,
                    checksum: *checksum,
                })
                .collect(),
        };
        match self.simple(cfg, view, op, &[]).await? {
            Reply::Statuses(s) if s.len() == items.len() => {
                Ok(s.into_iter().map(ErrorCode::from_u16).collect())
            }
            r => Err(unexpected(&r)),
        }
    }

    /// Batched get into caller buffers. With `prefix`, the node stops at the first missing key.
    /// On the same host the objects are leased for `lease_ms` while they are copied out of the
    /// mapping (0: no lease; the version check still catches a concurrent reuse).
    #[expect(
        clippy::too_many_arguments,
        reason = "the routing layer's one call site"
    )]
    pub(crate) async fn get_many(
        self: &Arc<Self>,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        prefix: bool,
        lease_ms: u64,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        debug_assert_eq!(keys.len(), dsts.len());
        if self.same_host {
            return self
                .get_local(cfg, view, ns, keys, dsts, prefix, lease_ms)
                .await;
        }
        // Boxed: its future (frames, a streaming hasher) is several kilobytes, and inline it
        // would be every same-host call's too, moved on each poll's setup (see `get_local`).
        Box::pin(self.get_remote(cfg, view, ns, keys, dsts, prefix)).await
    }

    /// [`Link::get_many`] on the same host: keys this client has seen are copied straight from
    /// the mapping; the rest are looked up in one round trip (leased for `lease_ms`) and copied.
    #[expect(clippy::too_many_arguments, reason = "get_many's own parameters")]
    async fn get_local(
        self: &Arc<Self>,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        prefix: bool,
        lease_ms: u64,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        let mut out = vec![None; keys.len()];
        let todo = self.get_seen(cfg, ns, keys, dsts, &mut out, prefix)?;
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
            self.arm_watch(cfg);
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
                let mut seen = self.seen();
                for &i in &todo {
                    if let (Some(l), Some(_)) = (located[i], out[i]) {
                        seen.insert(ns, keys[i], l);
                    }
                }
            }
            if !leased.is_empty() {
                self.count(cfg, 0, Op::Release { ns, keys: leased }).await?;
            }
            // Objects replaced between lookup and copy: fetch them through the socket.
            for i in fallback {
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
            Ok(prefix_run(out, prefix))
        })
        .await
    }

    /// Copies the keys this client's index knows straight from the mapping, each checked as
    /// its key's current value; returns the indexes of the others (and of stale entries, which
    /// are forgotten). With `prefix`, only the leading run of known keys that are still current
    /// is copied (a key past a gap is useless to the caller, and its buffer keeps what it held).
    /// Reports the reads to the node once a batch of them has gathered.
    fn get_seen(
        self: &Arc<Self>,
        cfg: &ClientConfig,
        ns: u32,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        out: &mut [Option<usize>],
        prefix: bool,
    ) -> Result<Vec<usize>, ClientError> {
        let all = || (0..keys.len()).collect();
        let Some(local) = self.local().filter(|_| self.watch.alive()) else {
            return Ok(all());
        };
        // The entries' own copies of the keys, for the report of the reads they serve.
        let mut shared = Vec::with_capacity(keys.len());
        let known: Vec<Option<Located>> = {
            let mut seen = self.seen();
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
            let mut seen = self.seen();
            for &i in &stale {
                if let Some(l) = &known[i] {
                    seen.forget(ns, keys[i], l);
                }
            }
            // Noted from the last key to the first, as the node reads a batch (tail first).
            let read = out.iter().zip(shared).rev();
            seen.touch_all(ns, read.filter_map(|(o, key)| o.and(key)))
        };
        if let Some(batch) = report {
            self.report(cfg, batch);
        }
        Ok(todo)
    }

    /// Sends [`Link::report_reads`] in the background: the read that filled the batch does not
    /// wait for the node (a round trip of a few hundred microseconds, every
    /// [`TOUCH_BATCH`](crate::seen::TOUCH_BATCH) reads, was most of the same-host batched
    /// get's tail). The seen index hands out one batch at a time, so one report per link is
    /// on its way at most; its end, however it ends, lets the next one go.
    fn report(self: &Arc<Self>, cfg: &ClientConfig, batch: Vec<(u32, Arc<[u8]>)>) {
        struct Done(Arc<Link>);
        impl Drop for Done {
            fn drop(&mut self) {
                self.0.seen().reported();
            }
        }
        let done = Done(Arc::clone(self));
        let cfg = cfg.clone();
        tokio::spawn(async move {
            done.0.report_reads(&cfg, batch).await;
            drop(done);
        });
    }

    /// Tells the node of reads served from the client's index (a lookup whose answer is not
    /// needed), so its eviction policy and hit counters count them. Best effort: a failure only
    /// loses the report.
    async fn report_reads(&self, cfg: &ClientConfig, mut batch: Vec<(u32, Arc<[u8]>)>) {
        // The node takes a `Lookup`'s keys from the last to the first: reversed, the reads
        // reach its eviction policy in the order they were noted (each call's batch already
        // tail first). The sort is stable, so each namespace keeps that order.
        batch.reverse();
        batch.sort_by_key(|(ns, _)| *ns);
        for group in batch.chunk_by(|a, b| a.0 == b.0) {
            let op = Op::Lookup {
                ns: group[0].0,
                keys: group.iter().map(|(_, k)| k.to_vec()).collect(),
                lease_ms: 0,
            };
            if let Err(e) = self.simple(cfg, 0, op, &[]).await {
                tracing::debug!(error = %e, "reporting reads served from the client's index failed");
            }
        }
    }

    /// Starts a watch of the node's life in the background, unless one runs or is starting
    /// or the index is off. Called after the node answered, so a watch found dead is replaced.
    fn arm_watch(&self, cfg: &ClientConfig) {
        if cfg.local_index == 0
            || self.watch.alive()
            || self.watch.arming.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        *self.watch.stop.lock().unwrap_or_else(|e| e.into_inner()) = Some(stop);
        let (alive, arming) = (self.watch.alive.clone(), self.watch.arming.clone());
        let id = self.watch.ids.fetch_add(1, Ordering::Relaxed) + 1;
        let (endpoint, cfg) = (self.endpoint.clone(), cfg.clone());
        let incarnation = self.incarnation.load(Ordering::Acquire);
        tokio::spawn(async move {
            let opened = Conn::open(&endpoint, &cfg, (None, false)).await;
            let Ok((conn, hello)) = opened else {
                arming.store(false, Ordering::Release);
                return;
            };
            if hello.incarnation != incarnation {
                // Restarted meanwhile: the link adopts the new life on its next call.
                arming.store(false, Ordering::Release);
                return;
            }
            alive.store(id, Ordering::Release);
            arming.store(false, Ordering::Release);
            let (mut reader, _writer) = conn.split();
            // The node sends nothing unasked: any outcome of this read (its end above all)
            // means the connection, and with it the watch, is over.
            tokio::select! {
                _ = reader.next() => {}
                _ = stopped => {}
            }
            let _ = alive.compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire);
        });
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, SeenIndex> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn get_remote(
        &self,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        prefix: bool,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        let op = Op::BatchGet {
            ns,
            keys: owned(keys),
            prefix,
        };
        let verify = cfg.verify_checksums;
        let lane = Lane::of(dsts.iter().map(|d| dst_len(d)).sum());
        self.run_in(lane, cfg, view, async move |c: &mut Conn| {
            let (reply, _) = c.call(op, &[]).await?;
            let Reply::Values(metas) = reply else {
                return Err(unexpected(&reply));
            };
            if metas.len() != dsts.len() {
                return Err(ClientError::Protocol("wrong number of values".into()));
            }
            let mut out = Vec::with_capacity(metas.len());
            let mut err = None;
            for (meta, dst) in metas.iter().zip(dsts.iter_mut()) {
                let Some(m) = meta else {
                    out.push(None);
                    continue;
                };
                match fit(dst, m.len) {
                    Some(mut fitted) => {
                        let sum = c.read_pieces(fitted.pieces(), verify).await?;
                        if verify && sum != m.checksum {
                            err = Some(ClientError::Checksum);
                        }
                        out.push(Some(m.len as usize));
                    }
                    None => {
                        c.skip(m.len).await?;
                        err = Some(ClientError::BufferTooSmall {
                            need: m.len,
                            have: dst_len(dst),
                        });
                        out.push(None);
                    }
                }
            }
            err.map_or(Ok(out), Err)
        })
        .await
    }

    /// One value as a fresh buffer, or None on a miss.
    pub(crate) async fn get(
        self: &Arc<Self>,
        cfg: &ClientConfig,
        view: u64,
        ns: u32,
        key: &[u8],
    ) -> Result<Option<Vec<u8>>, ClientError> {
        if self.same_host {
            let known = self.seen().get(ns, key);
            if let (Some((l, shared)), Some(local)) =
                (known, self.local().filter(|_| self.watch.alive()))
            {
                let mut buf = vec![0u8; l.addr.len as usize];
                if read_checked(cfg, &local, &l, &mut [&mut buf[..]], true)? {
                    let report = self.seen().touch(ns, shared);
                    if let Some(batch) = report {
                        self.report(cfg, batch);
                    }
                    return Ok(Some(buf));
                }
                self.seen().forget(ns, key, &l);
            }
            let found = self.lookup(cfg, view, ns, &[key], 0).await?.pop().flatten();
            self.arm_watch(cfg);
            let Some(l) = found else {
                return Ok(None);
            };
            let mut buf = vec![0u8; l.addr.len as usize];
            if self.read_local_checked(cfg, &l, &mut buf)? {
                self.seen().insert(ns, key, l);
                return Ok(Some(buf));
            }
        }
        let verify = cfg.verify_checksums;
        let key = key.to_vec();
        self.run(cfg, view, async move |c: &mut Conn| {
            let Some((reply, len)) = c.fetch(Op::Get { ns, key }).await? else {
                return Ok(None);
            };
            let Reply::Value { checksum: sum, .. } = reply else {
                return Err(unexpected(&reply));
            };
            let mut buf = vec![0u8; len as usize];
            c.read_into(&mut buf).await?;
            if verify && checksum(&buf) != sum {
                return Err(ClientError::Checksum);
            }
            Ok(Some(buf))
        })
        .await
    }

    /// One-sided read; Ok(false) when the object is gone or was replaced.
    pub(crate) async fn read(
        &self,
        cfg: &ClientConfig,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<bool, ClientError> {
        let read = self.read_hashing(cfg, addr, offset, dst, false).await?;
        Ok(read.is_some())
    }

    /// One-sided read of a whole object that also returns its bytes' xxh3-64, hashed as they
    /// arrive over a socket (after the copy, from the mapping); None when the object is gone or
    /// was replaced.
    pub(crate) async fn read_hashed(
        &self,
        cfg: &ClientConfig,
        addr: &GlobalAddr,
        dst: &mut [u8],
    ) -> Result<Option<u64>, ClientError> {
        self.read_hashing(cfg, addr, 0, dst, true).await
    }

    /// [`Link::read`], and with `hash` [`Link::read_hashed`]: Some(the bytes' xxh3-64, or 0
    /// without `hash`) when read, None when the object is gone or was replaced.
    async fn read_hashing(
        &self,
        cfg: &ClientConfig,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
        hash: bool,
    ) -> Result<Option<u64>, ClientError> {
        let sum = |dst: &[u8]| if hash { checksum(dst) } else { 0 };
        if let Some(local) = self.local().filter(|l| l.covers(addr)) {
            match off_runtime(dst.len() as u64, || local.read(addr, offset, dst, false)) {
                Ok(()) => return Ok(Some(sum(dst))),
                Err(AddrFault::Stale) => return Ok(None),
                // An address of another daemon than the one mapped: the node decides (it
                // refuses the dead daemon's addresses; the link remaps after a restart).
                Err(AddrFault::WrongIncarnation) => {}
                Err(f) => return Err(fault(f)),
            }
        }
        let op = Op::Read {
            addr: *addr,
            offset,
            len: dst.len() as u64,
        };
        let lane = Lane::of(dst.len() as u64);
        self.run_in(lane, cfg, 0, async move |c: &mut Conn| {
            match c.call(op, &[]).await {
                Ok((Reply::Data, len)) if len == dst.len() as u64 => {
                    if hash {
                        return c.read_into_hashed(dst).await.map(Some);
                    }
                    c.read_into(dst).await?;
                    Ok(Some(0))
                }
                Ok((r, len)) => {
                    c.skip(len).await?;
                    Err(unexpected(&r))
                }
                Err(ClientError::Server {
                    code: ErrorCode::Stale,
                    ..
                }) => Ok(None),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// One-sided write into a pending allocation.
    pub(crate) async fn write(
        &self,
        cfg: &ClientConfig,
        addr: &GlobalAddr,
        offset: u64,
        bytes: &[u8],
    ) -> Result<(), ClientError> {
        if let Some(local) = self.local().filter(|l| l.covers_writable(addr)) {
            match off_runtime(bytes.len() as u64, || local.write(addr, offset, bytes)) {
                Ok(()) => return Ok(()),
                Err(AddrFault::WrongIncarnation) => {}
                Err(f) => return Err(fault(f)),
            }
        }
        let op = Op::Write {
            addr: *addr,
            offset,
        };
        self.simple(cfg, 0, op, &[bytes]).await.map(|_| ())
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

/// Where one value of a batched get goes: buffers it fills in order (one, for a plain get
/// into a buffer; several, to scatter it, e.g. a KV block into per-layer pages). A value
/// shorter than them fills the first bytes.
pub(crate) type Dst<'a, 'b> = &'a mut [&'b mut [u8]];

/// The bytes `dst` holds.
pub(crate) fn dst_len(dst: &[&mut [u8]]) -> u64 {
    dst.iter().map(|p| p.len() as u64).sum()
}

/// The first bytes of a [`Dst`] that one value fills: one buffer's front (the plain get, no
/// allocation), or the pieces it reaches, the last one cut short.
enum Fit<'a> {
    One([&'a mut [u8]; 1]),
    Many(Vec<&'a mut [u8]>),
}

impl<'a> Fit<'a> {
    fn pieces(&mut self) -> &mut [&'a mut [u8]] {
        match self {
            Fit::One(one) => one,
            Fit::Many(many) => many,
        }
    }
}

/// The first `len` bytes of `dst`; None when it holds fewer.
fn fit<'a>(dst: &'a mut [&mut [u8]], len: u64) -> Option<Fit<'a>> {
    let mut left = usize::try_from(len).ok()?;
    if let [one] = dst {
        return one.get_mut(..left).map(|d| Fit::One([d]));
    }
    let mut out = Vec::with_capacity(dst.len());
    for p in dst.iter_mut() {
        if left == 0 {
            break;
        }
        let take = left.min(p.len());
        out.push(&mut p[..take]);
        left -= take;
    }
    (left == 0).then_some(Fit::Many(out))
}

/// With `prefix`, nothing after the first miss.
fn prefix_run(mut out: Vec<Option<usize>>, prefix: bool) -> Vec<Option<usize>> {
    if prefix {
        if let Some(gap) = out.iter().position(|o| o.is_none()) {
            out[gap..].fill(None);
        }
    }
    out
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

/// Same-host copies of at least this many bytes give their worker thread's other tasks to
/// another thread first.
const OFF_RUNTIME: u64 = 1 << 20;

/// Runs `copy`, a same-host copy of `bytes`: a large one on a multi-threaded runtime runs in
/// `block_in_place`, so the runtime moves this worker's other tasks (the client's small
/// requests) to another thread instead of leaving them behind a copy of milliseconds. On a
/// current-thread runtime, or outside one, it runs inline.
fn off_runtime<T>(bytes: u64, copy: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let multi =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if bytes >= OFF_RUNTIME && multi {
        tokio::task::block_in_place(copy)
    } else {
        copy()
    }
}

/// How long a remap after a restart waits for the node's `MapInfo` reply.
const REMAP_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// A staging area for this client's same-host puts ([`StagingArea`]), asked for on a
/// connection of its own over the Unix socket `uds`, which the area lives as long as; None when
/// the node hands out none (its setting, its total, a token that writes nothing, or a node
/// older than the request), and puts then go over the socket.
async fn open_staging(uds: &Endpoint, cfg: &ClientConfig) -> Option<StagingArea> {
    let made = async {
        let (mut c, _) = Conn::open(uds, cfg, (None, false)).await?;
        let (reply, mut fds) = c.call_with_fds(Op::Staging, cfg.timeout).await?;
        let (Reply::Staging { id, len }, Some(fd)) = (reply, fds.pop()) else {
            return Err(ClientError::Protocol(
                "a staging reply without its area".into(),
            ));
        };
        let file = std::fs::File::from(fd);
        StagingArea::new(id, len, &file, c).map_err(ClientError::Io)
    };
    made.await
        .inspect_err(
            |e| tracing::debug!(error = %e, "no staging area: same-host puts go over the socket"),
        )
        .ok()
}

/// Maps the segments a `MapInfo` reply offered, each with the descriptor that came with it,
/// when they are of the incarnation the handshake `hello` named. None offered (the token admits
/// to no segment whose namespaces are all its own) is an error: the link then has no mapping
/// and goes through the socket.
fn map_offered(
    reply: Reply,
    fds: Vec<std::os::fd::OwnedFd>,
    hello: &HelloInfo,
) -> std::io::Result<LocalMap> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let Reply::MapInfo {
        incarnation,
        segments,
    } = reply
    else {
        return Err(invalid(format!("unexpected reply {reply:?}")));
    };
    if segments.len() != fds.len() {
        return Err(invalid(format!(
            "{} segments offered with {} descriptors",
            segments.len(),
            fds.len()
        )));
    }
    if segments.is_empty() {
        return Err(std::io::Error::other(
            "the node offers no segment to this token",
        ));
    }
    let m = LocalMap::open(
        hello.node,
        incarnation,
        segments.into_iter().zip(fds).collect(),
    )?;
    if m.incarnation() != hello.incarnation {
        return Err(invalid(
            "MapInfo names another incarnation than the handshake".into(),
        ));
    }
    Ok(m)
}

pub(crate) fn owned(keys: &[&[u8]]) -> Vec<Vec<u8>> {
    keys.iter().map(|k| k.to_vec()).collect()
}

pub(crate) fn unexpected(r: &Reply) -> ClientError {
    ClientError::Protocol(format!("unexpected reply {r:?}"))
}

pub(crate) fn fault(f: AddrFault) -> ClientError {
    let code = ErrorCode::from(kvpool::PoolError::from(f));
    ClientError::Server {
        code,
        message: f.to_string(),
    }
}
