//! One node as a client reaches it: pooled connections (`pool`), what the node said at the
//! handshake, and — when the node runs on this host — the same-host path (`same_host`): its
//! segments mapped for direct loads and stores, with the puts (`local_put`) and reads
//! (`local_get`) that use them, the watch that keeps the index of seen objects honest
//! (`watch`) and the reports of the reads it served (`reports`). Every operation here goes to
//! this node only; the routing layer (`client`) decides which node. This module uses `conn`,
//! `local`, `seen`, `staging`, `located`, `dst`, `cores`, `config`, `endpoint` and `error`,
//! never `client`.
//!
//! A link outlives the daemon it first reached: when the daemon restarts, pooled connections
//! that the old daemon closed are noticed before use and dropped, a fresh connection shakes
//! hands again, and when the handshake names another incarnation the link drops every pooled
//! connection, takes the new namespace ids and maps the new segment files (the old mapping,
//! of the dead daemon's unlinked files, is released once no read holds it).

mod fabric;
mod local_get;
mod local_put;
mod pool;
mod reports;
mod same_host;
mod watch;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use kvpool::protocol::{AllocItem, CommitItem, ErrorCode, HelloInfo, Op, PutItem, Reply};
use kvpool::{checksum, AddrFault, GlobalAddr};

use crate::config::ClientConfig;
use crate::conn::{quic_connect, Class, Conn};
use crate::cores::off_runtime;
use crate::dst::{dst_len, fit, Dst};
use crate::endpoint::Endpoint;
use crate::error::ClientError;
use crate::local::LocalMap;
use crate::located::Located;
use fabric::FabricPath;
use pool::{ConnPool, Lane};
use same_host::SameHostPath;

/// A link to one node.
pub(crate) struct Link {
    pub(crate) endpoint: Endpoint,
    /// What the node said at the first handshake.
    pub(crate) hello: HelloInfo,
    namespaces: RwLock<HashMap<String, u32>>,
    /// The connections to the node.
    conns: ConnPool,
    /// The incarnation of the daemon the link last shook hands with.
    incarnation: AtomicU64,
    /// The node is on this host and the link maps its segments (again after a restart).
    same_host: Option<SameHostPath>,
    /// The endpoint is `fabric://`: values are read one-sidedly over the node's fabric.
    fabric: Option<FabricPath>,
}

impl Link {
    /// Connects and shakes hands; on the same host switches to the Unix socket and maps the
    /// node's segments (unless `cfg.same_host` is off, or a connector opens the streams).
    pub(crate) async fn open(
        mut endpoint: Endpoint,
        cfg: &ClientConfig,
    ) -> Result<Link, ClientError> {
        let quic = match endpoint {
            Endpoint::Quic(_) if cfg.connector.is_none() => {
                Some(quic_connect(&endpoint, cfg).await?)
            }
            _ => None,
        };
        let (mut conn, mut hello) =
            Conn::open(&endpoint, cfg, (quic.as_ref().map(|q| &q.1), false)).await?;
        let mut same_host = None;
        let mut fabric = None;
        if matches!(endpoint, Endpoint::Fabric(_)) && cfg.connector.is_none() {
            fabric = Some(FabricPath::open(&mut conn, &hello).await?);
        } else if let Some(found) = SameHostPath::open(cfg, &hello).await {
            endpoint = found.endpoint;
            conn = found.conn;
            hello = found.hello;
            same_host = Some(found.path);
        }
        let namespaces = hello.namespaces.iter().cloned().collect();
        Ok(Link {
            endpoint,
            incarnation: AtomicU64::new(hello.incarnation),
            hello,
            namespaces: RwLock::new(namespaces),
            conns: ConnPool::new(cfg, conn, quic),
            same_host,
            fabric,
        })
    }

    /// The mapping of the node's segments, when the same-host path is in use.
    pub(crate) fn local(&self) -> Option<Arc<LocalMap>> {
        self.same_host.as_ref().and_then(SameHostPath::local)
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
        self.conns.clear();
        *self.namespaces.write().unwrap_or_else(|e| e.into_inner()) =
            hello.namespaces.iter().cloned().collect();
        if let Some(f) = &self.fabric {
            f.reopen(conn, hello).await;
        }
        let Some(sh) = &self.same_host else {
            return Ok(());
        };
        let remapped = sh.remap(cfg, &self.endpoint, conn, hello).await;
        if remapped.is_err() {
            // The new connection broke: the next one does all this again.
            let _ = self.incarnation.compare_exchange(
                hello.incarnation,
                old,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        remapped
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
        let quic = self.conns.quic_connection(&self.endpoint, cfg).await?;
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
            let _slot = self.conns.slot(lane).await?;
            let mut conn = match self.conns.pooled(lane) {
                Some(c) => c,
                None => {
                    let quic = self.conns.quic_connection(&self.endpoint, cfg).await?;
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
                self.conns.give_back(cfg, lane, conn);
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
            if let Some(sh) = &self.same_host {
                sh.watch.lost();
            }
            self.conns.clear();
        }
        r
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
        if let Some(sh) = self.same_host.as_ref().filter(|_| self.puts_locally(items)) {
            return self
                .put_local(sh, cfg, view, ns, items, &sum, pin, depths)
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
        if let Some(sh) = &self.same_host {
            return self
                .get_local(sh, cfg, view, ns, keys, dsts, prefix, lease_ms)
                .await;
        }
        if let Some(st) = self.fabric.as_ref().and_then(FabricPath::state) {
            return Box::pin(self.get_fabric(st, cfg, view, ns, keys, dsts, prefix)).await;
        }
        // Boxed: its future (frames, a streaming hasher) is several kilobytes, and inline it
        // would be every same-host call's too, moved on each poll's setup (see `get_local`).
        Box::pin(self.get_remote(cfg, view, ns, keys, dsts, prefix)).await
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
        if let Some(sh) = &self.same_host {
            if let Some(found) = self.get_one_local(sh, cfg, view, ns, key).await? {
                return Ok(found);
            }
        }
        if let Some(st) = self.fabric.as_ref().and_then(FabricPath::state) {
            if let Some(found) = Box::pin(self.get_one_fabric(st, cfg, view, ns, key)).await? {
                return Ok(found);
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
        if let Some(st) = self.fabric.as_ref().and_then(FabricPath::state) {
            let read = off_runtime(u64::MAX, || st.read_range(addr, offset, dst, hash));
            if let Some(read) = read {
                return Ok(read);
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
