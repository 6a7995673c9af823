//! Membership through etcd (`[cluster] etcd`), spoken to through etcd v3's JSON gateway (HTTP/1.1,
//! see `http`), instead of heartbeats between the nodes.
//!
//! Layout under the prefix (default `/kvpool/`):
//!
//! - `nodes/<id>`: the node's record as JSON (id, addresses, capacity, state, epoch), written by
//!   the node itself without a lease, so a node that dies stays in the view, as down;
//! - `alive/<id>`: written under the node's lease (TTL: `down_after_ms` in whole seconds, or
//!   etcd's minimum if larger), kept alive every third of the TTL.
//!
//! The view is every record under `nodes/`, with the state forced to `down` where `alive/<id>`
//! is absent, at version = the etcd revision it was built at. Every node builds it the same way
//! from the same keys, so nodes that have seen the same revision agree on the stamp. A node
//! builds it from a range of the prefix, then follows a watch from the next revision.
//!
//! A node registers (both keys, in one transaction) and then turns from `joining` to
//! `serving`; every later change of its own record (drain, leave) is put again. When etcd can't
//! be reached the node keeps serving on its last view and retries; when etcd is back it keeps
//! its lease if etcd still has it (etcd refreshes leases when it restarts) or takes a new one,
//! registers again, and ranges and watches afresh; nodes of its view that etcd then holds no
//! record of (a wiped etcd), or the same record of without a lease (they could not reach etcd
//! either), stay in the view as they were for a lease TTL, the time a live node takes to
//! register again, so that their keys do not move meanwhile. A record of this node left by an earlier run
//! with an epoch at least as high as the node's own is outranked before the first put.
//!
//! With etcd's own authentication (`etcd_user`), the node trades the user's password for a
//! token (`/v3/auth/authenticate`) at the start of every session and sends it as the
//! `Authorization` header; a call etcd answers 401 (the token expired) authenticates again and
//! is repeated once.
//!
//! `https://` endpoints are reached over TLS (`etcd_ca_file`: the CA that etcd's certificate
//! is verified by; `etcd_cert_file`/`etcd_key_file`: the client certificate for etcd's
//! `--client-cert-auth`).

use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use kvpool::membership::EtcdRecords;
use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::cluster::{Cluster, Timing};
use crate::config::{EtcdAuth, EtcdConfig};
use crate::http::{self, HttpError, Url};

/// What can go wrong with etcd.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EtcdError {
    /// HTTP to the gateway failed.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// A call took longer than its timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The gateway answered something else than expected.
    #[error("unexpected reply: {0}")]
    Reply(String),
    /// The lease is gone (it expired while etcd could not be reached).
    #[error("lease {0:x} expired")]
    LeaseLost(i64),
    /// The watch stream ended.
    #[error("watch ended")]
    WatchEnded,
    /// etcd refused the token (expired, or etcd restarted): authenticate again.
    #[error("etcd refused the auth token: {0}")]
    Unauthenticated(String),
    /// etcd refused the user and password.
    #[error("etcd authentication of user {user:?} failed: {reason}")]
    Auth {
        /// The user.
        user: String,
        /// etcd's answer.
        reason: String,
    },
}

/// Largest reply, or message of the watch stream, read from etcd.
const MAX_REPLY: usize = 4 << 20;

/// Keeps this node registered in etcd and the view derived from it, until `stop` fires.
/// Failures are retried (every heartbeat, at most every second) while the node keeps serving
/// on its last view.
pub(crate) async fn run(
    m: Arc<Cluster>,
    cfg: EtcdConfig,
    timing: Timing,
    mut stop: watch::Receiver<bool>,
) {
    let ttl = lease_ttl(timing.down_after);
    let call_timeout = Duration::from_millis(ttl as u64 * 1000 / 3)
        .clamp(Duration::from_millis(500), Duration::from_secs(5));
    let retry = timing
        .heartbeat
        .clamp(Duration::from_millis(100), Duration::from_secs(1));
    let mut r = Registrar {
        keys: Keys::new(&cfg.prefix, m.me()),
        m,
        etcd: Etcd {
            endpoints: cfg.endpoints,
            current: 0,
            timeout: call_timeout,
            auth: cfg.auth,
            tls: cfg.tls,
            token: None,
        },
        prefix: cfg.prefix,
        ttl,
        restart_ttl: lease_ttl(timing.restart_window),
        lease: None,
        published: None,
        failing: false,
        lost_lease: false,
    };
    loop {
        match r.session(&mut stop).await {
            Ok(()) => return,
            // Its lease went while etcd answers: registers again at once, down meanwhile.
            Err(EtcdError::LeaseLost(id)) if !r.failing => {
                tracing::warn!(
                    lease = id,
                    "etcd: this node's lease is gone; registering again"
                );
                r.failing = true;
                continue;
            }
            Err(e) => {
                if !r.failing {
                    tracing::warn!(error = %e, "etcd: lost; serving on the last view, retrying");
                } else {
                    tracing::debug!(error = %e, "etcd: still unreachable");
                }
                r.failing = true;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = stopped(&mut stop) => return,
        }
    }
}

/// Resolves once `stop` fires (without holding the channel's lock across awaits).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The lease TTL asked of etcd: `down_after`, rounded up to whole seconds (etcd may grant more:
/// its minimum is 1.5 election timeouts, 2 s with its defaults).
pub(crate) fn lease_ttl(down_after: Duration) -> i64 {
    (down_after.as_millis().div_ceil(1000) as i64).max(1)
}

/// The keys under the prefix, read into the core's [`EtcdRecords`] (which derives the view).
#[derive(Debug, Default)]
pub(crate) struct Registry {
    records: EtcdRecords,
}

impl Registry {
    /// Applies one key's new value (None: deleted). Keys outside the layout, and records that
    /// don't parse or name another node, are ignored (by every node alike).
    pub(crate) fn apply(&mut self, prefix: &str, key: &[u8], value: Option<&[u8]>) {
        let Some(rest) = key
            .strip_prefix(prefix.as_bytes())
            .and_then(|r| std::str::from_utf8(r).ok())
        else {
            return;
        };
        let id_in = |dir: &str| rest.strip_prefix(dir).and_then(|i| i.parse::<u32>().ok());
        if let Some(id) = id_in("nodes/") {
            let rec = value.map(decode_record);
            if matches!(rec, Some(None)) || matches!(&rec, Some(Some(r)) if r.id != id) {
                tracing::warn!(node = id, "etcd: ignoring a malformed node record");
            }
            self.records.set_record(id, rec.flatten());
        } else if let Some(id) = id_in("alive/") {
            self.records.set_alive(id, value.is_some());
        }
    }

    /// The view: every record, down where its node holds no lease, at the revision seen.
    pub(crate) fn view(&self) -> ClusterView {
        self.records.view()
    }
}

/// A node record as stored in etcd.
#[derive(Serialize, Deserialize)]
struct Record {
    id: u32,
    tcp: String,
    quic: String,
    metrics: String,
    capacity: u64,
    state: String,
    epoch: u64,
}

pub(crate) fn encode_record(n: &NodeInfo) -> Vec<u8> {
    serde_json::to_vec(&Record {
        id: n.id,
        tcp: n.tcp.clone(),
        quic: n.quic.clone(),
        metrics: n.metrics.clone(),
        capacity: n.capacity,
        state: n.state.name().to_string(),
        epoch: n.epoch,
    })
    .expect("a record serializes")
}

pub(crate) fn decode_record(b: &[u8]) -> Option<NodeInfo> {
    let r: Record = serde_json::from_slice(b).ok()?;
    let state = NodeState::ALL.into_iter().find(|s| s.name() == r.state)?;
    Some(NodeInfo {
        id: r.id,
        tcp: r.tcp,
        quic: r.quic,
        metrics: r.metrics,
        capacity: r.capacity,
        state,
        epoch: r.epoch,
    })
}

/// This node's keys.
struct Keys {
    record: Vec<u8>,
    alive: Vec<u8>,
}

impl Keys {
    fn new(prefix: &str, me: u32) -> Keys {
        Keys {
            record: format!("{prefix}nodes/{me}").into_bytes(),
            alive: format!("{prefix}alive/{me}").into_bytes(),
        }
    }
}

/// A granted lease.
#[derive(Clone, Copy, Debug)]
struct Lease {
    id: i64,
    ttl: i64,
}

/// The state kept across sessions (one session: from connecting to etcd to losing it).
struct Registrar {
    m: Arc<Cluster>,
    etcd: Etcd,
    prefix: String,
    keys: Keys,
    ttl: i64,
    /// The TTL of the lease a restarting record's `alive/<id>` is put under: the restart
    /// window, after which the others see the node down.
    restart_ttl: i64,
    lease: Option<Lease>,
    /// This node's record as last put.
    published: Option<NodeInfo>,
    /// The last session failed (for logging once per outage).
    failing: bool,
    /// The lease expired and this node has not registered again since.
    lost_lease: bool,
}

impl Registrar {
    /// Registers, builds the view, then follows the watch, keeps the lease alive and publishes
    /// this node's changes. Ok when `stop` fired; an error when etcd was lost.
    async fn session(&mut self, stop: &mut watch::Receiver<bool>) -> Result<(), EtcdError> {
        // A fresh token for every session: a watch opened with a stale one just stays silent.
        self.etcd.token = None;
        let lease = self.lease().await?;
        let theirs = self.etcd.get(&self.keys.record).await?;
        let theirs = theirs.as_deref().and_then(decode_record);
        // After a lapse, this node registers again with its own record at a new epoch, and
        // its view takes that record only when etcd shows it (below), as the others' do.
        let reinstated = self.m.reinstated().map(|mut r| {
            r.epoch = r.epoch.max(theirs.as_ref().map_or(0, |t| t.epoch) + 1);
            r
        });
        if let (Some(theirs), None) = (&theirs, &reinstated) {
            self.m.outrank(theirs);
        }
        // Resuming a restart in place: whether the others still see this node restarting (its
        // alive key, under the restart window's lease, still there) is read before this
        // session's registration replaces that key.
        let held = match self.m.is_resuming() {
            true => Some(self.etcd.get(&self.keys.alive).await?.is_some()),
            false => None,
        };
        let mine = match reinstated {
            Some(r) => r,
            None => self.m.my_record().expect("this node is in its own view"),
        };
        self.etcd
            .txn_put(&[
                (&self.keys.record, &encode_record(&mine), None),
                (&self.keys.alive, b"", Some(lease.id)),
            ])
            .await?;
        self.mark_published(mine);
        if std::mem::take(&mut self.lost_lease) {
            // The others route this node's keys elsewhere until this registration reaches them,
            // and it took writes for them by its own view after its first fence: suspect too.
            self.m.fence();
        }
        let (revision, kvs) = self.etcd.range_prefix(&self.prefix).await?;
        let mut reg = Registry::default();
        reg.records.revision = revision;
        for (k, v) in &kvs {
            reg.apply(&self.prefix, k, Some(v));
        }
        // Nodes of this node's view that etcd lost (no record, or the same record without a
        // lease: etcd was wiped, or unreachable to them too) keep their records for a lease
        // TTL, the time a live node takes to register again (see `EtcdRecords`).
        let carried = reg.records.carry(&self.m.view());
        let mut carry_until = None;
        if !carried.is_empty() {
            tracing::info!(
                nodes = ?carried,
                "etcd: nodes of the view without a record or lease; kept as they were until they register again"
            );
            let ttl = Duration::from_secs(lease.ttl.max(1) as u64);
            carry_until = Some(tokio::time::Instant::now() + ttl);
        }
        self.m.replace(reg.view());
        if let Some(held) = held {
            let mine = self.m.my_record().expect("this node is in its own view");
            let seen = match theirs {
                Some(t) if held => t,
                t => NodeInfo {
                    state: NodeState::Down,
                    ..t.unwrap_or(mine)
                },
            };
            self.m.resume(Some(&seen));
        }
        if self.m.my_state() == NodeState::Joining {
            self.m.set_state(NodeState::Serving);
        }
        let body = self.etcd.watch(&self.prefix, revision + 1).await?;
        let (tx, mut events) = mpsc::channel(16);
        let _watch = AbortOnDrop(tokio::spawn(follow(body, tx)));
        if self.failing {
            tracing::info!(revision, "etcd: back; registered again");
            self.failing = false;
        } else {
            tracing::info!(revision, lease_ttl_s = lease.ttl, "etcd: registered");
        }
        let mut changed = self.m.subscribe();
        let every = Duration::from_millis(lease.ttl.max(1) as u64 * 1000 / 3);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mine = self.m.my_record().expect("this node is in its own view");
            if self.published.as_ref() != Some(&mine) {
                if mine.state == NodeState::Restarting {
                    // The alive key outlives this process for the restart window: the others
                    // hold this node's keys for it until then.
                    let hold = self.etcd.grant(self.restart_ttl).await?;
                    self.etcd
                        .txn_put(&[
                            (&self.keys.record, &encode_record(&mine), None),
                            (&self.keys.alive, b"", Some(hold.id)),
                        ])
                        .await?;
                } else {
                    self.etcd
                        .put(&self.keys.record, &encode_record(&mine))
                        .await?;
                }
                self.mark_published(mine);
            }
            tokio::select! {
                _ = tick.tick() => {
                    if self.etcd.keepalive(lease.id).await?.is_none() {
                        self.lapse();
                        return Err(EtcdError::LeaseLost(lease.id));
                    }
                }
                batch = events.recv() => {
                    let (revision, kvs) = batch.unwrap_or(Err(EtcdError::WatchEnded))?;
                    if kvs.is_empty() {
                        continue;
                    }
                    reg.records.revision = reg.records.revision.max(revision);
                    for (k, v) in &kvs {
                        reg.apply(&self.prefix, k, v.as_deref());
                    }
                    self.m.replace(reg.view());
                    if self.m.lapsed() {
                        // etcd dropped this node's lease (revoked, or expired unseen): the
                        // others have it down, and so has its view now. Registers again at once.
                        self.lapse();
                        return Err(EtcdError::LeaseLost(lease.id));
                    }
                }
                _ = until(carry_until) => {
                    carry_until = None;
                    let gone = reg.records.end_carry();
                    if !gone.is_empty() {
                        tracing::info!(nodes = ?gone, "etcd: nodes did not register again");
                        self.m.replace(reg.view());
                    }
                }
                r = changed.changed() => {
                    if r.is_err() {
                        return Ok(());
                    }
                }
                _ = stopped(stop) => return Ok(()),
            }
        }
    }

    /// The lease of the last session if etcd still holds it, else a new one.
    async fn lease(&mut self) -> Result<Lease, EtcdError> {
        if let Some(l) = self.lease {
            if self.etcd.keepalive(l.id).await?.is_some() {
                return Ok(l);
            }
            tracing::info!(lease = l.id, "etcd: lease expired; taking a new one");
            // Its alive key went with it: the others saw this node down, if they could reach
            // etcd. It registers again right away, without a lapse: when etcd was out of reach
            // of every node, the others still hold this node as it was (they carry it), and a
            // view with it down meanwhile would move its keys for nothing.
            self.lease = None;
            self.m.fence();
            self.lost_lease = true;
        }
        let l = self.etcd.grant(self.ttl).await?;
        if l.ttl != self.ttl {
            tracing::info!(
                asked_s = self.ttl,
                granted_s = l.ttl,
                "etcd: lease TTL differs from down_after_ms"
            );
        }
        self.lease = Some(l);
        Ok(l)
    }

    /// etcd holds no lease of this node any more, and its alive key went with it: the others
    /// have it down. So does its own view until it registers again (which fences it once more:
    /// see `session`), and it is fenced now.
    fn lapse(&mut self) {
        self.lease = None;
        self.lost_lease = true;
        let shown = self.published.clone().or_else(|| self.m.my_record());
        if let Some(shown) = shown {
            self.m.lapse(&shown);
        }
    }

    fn mark_published(&mut self, rec: NodeInfo) {
        self.m.mark_published(rec.epoch);
        self.published = Some(rec);
    }
}

/// Resolves at `t`, or never.
async fn until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Reads watch messages into `tx` until the stream fails or ends (then sends the error).
async fn follow(mut body: http::Body, tx: mpsc::Sender<Result<WatchBatch, EtcdError>>) {
    loop {
        let r = match body.next_line().await {
            Ok(Some(line)) => parse_watch(&line),
            Ok(None) => Err(EtcdError::WatchEnded),
            Err(e) => Err(e.into()),
        };
        let end = r.is_err();
        if tx.send(r).await.is_err() || end {
            return;
        }
    }
}

/// Aborts a task when dropped (the watch reader, when its session ends).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One watch message: its revision, and each changed key with its new value (None: deleted).
type WatchBatch = (u64, Vec<(Vec<u8>, Option<Vec<u8>>)>);

fn parse_watch(line: &[u8]) -> Result<WatchBatch, EtcdError> {
    let v: Value = serde_json::from_slice(line).map_err(|e| EtcdError::Reply(e.to_string()))?;
    let r = v.get("result").ok_or_else(|| reply_error(&v))?;
    if r.get("canceled").and_then(Value::as_bool) == Some(true) {
        return Err(EtcdError::Reply(format!("watch canceled: {r}")));
    }
    let mut revision = int(&r["header"]["revision"]).unwrap_or(0) as u64;
    let mut kvs = Vec::new();
    for e in r["events"].as_array().into_iter().flatten() {
        let kv = &e["kv"];
        let key = bytes(&kv["key"])?;
        revision = revision.max(int(&kv["mod_revision"]).unwrap_or(0) as u64);
        // proto3 JSON leaves out defaults: no type is PUT.
        let value = match e["type"].as_str() {
            Some("DELETE") => None,
            _ => Some(bytes(&kv["value"])?),
        };
        kvs.push((key, value));
    }
    Ok((revision, kvs))
}

/// etcd v3 through its JSON gateway: one connection per call, every call bounded by a timeout,
/// endpoints tried in turn (the next call after a failure goes to the next endpoint).
struct Etcd {
    endpoints: Vec<Url>,
    current: usize,
    timeout: Duration,
    auth: Option<EtcdAuth>,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// The token `auth` was traded for, once it has been.
    token: Option<String>,
}

impl Etcd {
    /// Grants a lease of `ttl` seconds.
    async fn grant(&mut self, ttl: i64) -> Result<Lease, EtcdError> {
        let r = self
            .call("/v3/lease/grant", json!({ "TTL": ttl }), false)
            .await?;
        match (int(&r["ID"]), int(&r["TTL"])) {
            (Some(id), Some(ttl)) if ttl > 0 => Ok(Lease { id, ttl }),
            _ => Err(EtcdError::Reply(format!("lease grant: {r}"))),
        }
    }

    /// Refreshes a lease: its TTL, or None when etcd no longer has it.
    async fn keepalive(&mut self, id: i64) -> Result<Option<i64>, EtcdError> {
        let r = self
            .call("/v3/lease/keepalive", json!({ "ID": id.to_string() }), true)
            .await?;
        let r = r.get("result").ok_or_else(|| reply_error(&r))?;
        Ok(int(&r["TTL"]).filter(|&t| t > 0))
    }

    /// Puts one key (no lease).
    async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), EtcdError> {
        let body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
        self.call("/v3/kv/put", body, false).await.map(drop)
    }

    /// Puts several keys in one transaction (one revision), each with its lease or none.
    async fn txn_put(&mut self, puts: &[(&[u8], &[u8], Option<i64>)]) -> Result<(), EtcdError> {
        let ops: Vec<Value> = puts
            .iter()
            .map(|(k, v, lease)| {
                let mut put = json!({ "key": B64.encode(k), "value": B64.encode(v) });
                if let Some(l) = lease {
                    put["lease"] = json!(l.to_string());
                }
                json!({ "request_put": put })
            })
            .collect();
        let r = self
            .call("/v3/kv/txn", json!({ "success": ops }), false)
            .await?;
        if r["succeeded"].as_bool() != Some(true) {
            return Err(EtcdError::Reply(format!("txn: {r}")));
        }
        Ok(())
    }

    /// One key's value.
    async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, EtcdError> {
        let r = self
            .call("/v3/kv/range", json!({ "key": B64.encode(key) }), false)
            .await?;
        match r["kvs"].as_array().and_then(|a| a.first()) {
            Some(kv) => Ok(Some(bytes(&kv["value"])?)),
            None => Ok(None),
        }
    }

    /// Every key under `prefix` with its value, and the revision they were read at.
    async fn range_prefix(
        &mut self,
        prefix: &str,
    ) -> Result<(u64, Vec<(Vec<u8>, Vec<u8>)>), EtcdError> {
        let body = json!({
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix.as_bytes())),
        });
        let r = self.call("/v3/kv/range", body, false).await?;
        let revision = int(&r["header"]["revision"])
            .ok_or_else(|| EtcdError::Reply(format!("range: {r}")))? as u64;
        let mut out = Vec::new();
        for kv in r["kvs"].as_array().into_iter().flatten() {
            out.push((bytes(&kv["key"])?, bytes(&kv["value"])?));
        }
        Ok((revision, out))
    }

    /// Opens a watch of every key under `prefix` from revision `from`; the stream's messages
    /// follow the confirmation, which this reads.
    async fn watch(&mut self, prefix: &str, from: u64) -> Result<http::Body, EtcdError> {
        let body = json!({ "create_request": {
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix.as_bytes())),
            "start_revision": from.to_string(),
        }});
        let token = self.token().await?;
        let url = self.endpoints[self.current].clone();
        let json = body.to_string().into_bytes();
        let r = tokio::time::timeout(self.timeout, async {
            let mut b = http::post(
                &url,
                self.tls.as_ref(),
                "/v3/watch",
                &json,
                token.as_deref(),
                MAX_REPLY,
            )
            .await
            .map_err(refused)?;
            let first = b.next_line().await?.ok_or(EtcdError::WatchEnded)?;
            let v: Value =
                serde_json::from_slice(&first).map_err(|e| EtcdError::Reply(e.to_string()))?;
            if v["result"]["created"].as_bool() != Some(true) {
                return Err(EtcdError::Reply(format!("watch: {v}")));
            }
            Ok(b)
        })
        .await
        .unwrap_or(Err(EtcdError::Timeout(self.timeout)));
        if r.is_err() {
            self.next_endpoint();
        }
        r
    }

    /// One call: the reply's JSON (the first message, for a streaming endpoint). A token etcd
    /// refuses (expired) is traded again once.
    async fn call(&mut self, path: &str, req: Value, stream: bool) -> Result<Value, EtcdError> {
        match self.call_once(path, &req, stream).await {
            Err(EtcdError::Unauthenticated(_)) if self.auth.is_some() => {
                self.token = None;
                self.call_once(path, &req, stream).await
            }
            r => r,
        }
    }

    async fn call_once(
        &mut self,
        path: &str,
        req: &Value,
        stream: bool,
    ) -> Result<Value, EtcdError> {
        let token = self.token().await?;
        self.exchange(path, req, token.as_deref(), stream).await
    }

    /// One request to the current endpoint, bounded by the timeout: the reply's JSON (the
    /// first message, for a streaming endpoint). A failure other than a refused token moves
    /// the next request on to the next endpoint.
    async fn exchange(
        &mut self,
        path: &str,
        req: &Value,
        token: Option<&str>,
        stream: bool,
    ) -> Result<Value, EtcdError> {
        let url = self.endpoints[self.current].clone();
        let json = req.to_string().into_bytes();
        let r = tokio::time::timeout(self.timeout, async {
            let mut b = http::post(&url, self.tls.as_ref(), path, &json, token, MAX_REPLY)
                .await
                .map_err(refused)?;
            let reply = if stream {
                b.next_line().await?.unwrap_or_default()
            } else {
                b.read_all().await?
            };
            let v: Value =
                serde_json::from_slice(&reply).map_err(|e| EtcdError::Reply(e.to_string()))?;
            if v.get("error").is_some() {
                return Err(reply_error(&v));
            }
            Ok(v)
        })
        .await
        .unwrap_or(Err(EtcdError::Timeout(self.timeout)));
        if matches!(r, Err(ref e) if !matches!(e, EtcdError::Unauthenticated(_))) {
            self.next_endpoint();
        }
        r
    }

    /// The token to send, trading the user and password for one first when there is none;
    /// None when etcd's authentication is not used.
    async fn token(&mut self) -> Result<Option<String>, EtcdError> {
        let Some(auth) = &self.auth else {
            return Ok(None);
        };
        if let Some(t) = &self.token {
            return Ok(Some(t.clone()));
        }
        let user = auth.user.clone();
        let req = json!({ "name": auth.user, "password": auth.password });
        let failed = |reason: String| EtcdError::Auth {
            user: user.clone(),
            reason,
        };
        let v = match self
            .exchange("/v3/auth/authenticate", &req, None, false)
            .await
        {
            Ok(v) => v,
            // etcd answers a wrong password 400 with its reason in the body.
            Err(EtcdError::Http(HttpError::Status { body, .. })) => {
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::String(body));
                let why = v["message"].as_str().map(str::to_string);
                return Err(failed(why.unwrap_or_else(|| v.to_string())));
            }
            Err(e) => return Err(e),
        };
        match v["token"].as_str() {
            Some(t) if !t.is_empty() => {
                self.token = Some(t.to_string());
                Ok(self.token.clone())
            }
            _ => {
                self.next_endpoint();
                Err(failed(format!("no token in {}", reply_error(&v))))
            }
        }
    }

    fn next_endpoint(&mut self) {
        self.current = (self.current + 1) % self.endpoints.len().max(1);
    }
}

/// An HTTP error as etcd means it: 401 is a token it refuses (grpc code 16).
fn refused(e: HttpError) -> EtcdError {
    match e {
        HttpError::Status { status: 401, body } => EtcdError::Unauthenticated(body),
        e => e.into(),
    }
}

fn reply_error(v: &Value) -> EtcdError {
    EtcdError::Reply(v.to_string().chars().take(300).collect())
}

/// An int64 of proto3 JSON: a string, or a number.
fn int(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_str()?.parse().ok())
}

/// A bytes field of proto3 JSON (base64); absent is empty.
fn bytes(v: &Value) -> Result<Vec<u8>, EtcdError> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => B64
            .decode(s)
            .map_err(|e| EtcdError::Reply(format!("base64: {e}"))),
        other => Err(EtcdError::Reply(format!("not bytes: {other}"))),
    }
}

/// The end of a prefix range: the prefix with its last byte below 0xff raised by one.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

#[cfg(test)]
mod tests;
