//! The RESP door in a cluster: a key that this node does not hold as its only owner goes to its
//! owners over this node's own links to them ([`Peer::connect_for_clients`]), routed by the
//! core's routing plan ([`kvpool::route`]) exactly as an application's client routes it: by
//! the view, to every replica the namespace asks for, and, while the view changes, a miss
//! looked up once more on the key's previous owner when the key's owners vouch for that copy.
//!
//! The links shake hands with the node token (which admits to every namespace) and nothing
//! more, so the owners serve forwarded requests as a client's. One pool of links per door,
//! shared by its connections; a link carries one request at a time, and a node that failed is
//! skipped for a moment, its keys misses meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvpool::placement::ClusterView;
use kvpool::protocol::{ErrorCode, Op, Outcome, PutItem, Reply};
use kvpool::route::{
    Heard, ReadPlan, Routes, Step, ViewChanged, ViewRetry, WriteCodes, FALLBACK_WINDOW,
};
use kvpool::NodeId;

use crate::cluster::Cluster;
use crate::peer::{Peer, PeerError};

/// How long a node that failed is skipped before it is tried again.
const BACKOFF: Duration = Duration::from_millis(500);

/// Idle links kept per node.
const IDLE_LINKS: usize = 16;

/// Runs `$body` (a future that routes by `$r`, the door's current routes) and runs it again
/// by fresh routes when a node answers that the view changed (a bounded number of times); then
/// `$on_moved`, when it is `Some`, instead of the error (a miss, for reads). Err: the reply line.
macro_rules! routed {
    ($t:expr, $on_moved:expr, |$r:ident| $body:expr) => {{
        let mut retry = ViewRetry::new();
        let on_moved = $on_moved;
        loop {
            let routes = $t.forwarder.routes($t.cluster);
            let $r: &Routes = &routes;
            let node = match $body.await {
                Err(Failed::Moved(node)) => node,
                other => break other.map_err(|e| e.text()),
            };
            if !retry.again() {
                break on_moved.ok_or_else(|| Failed::Moved(node).text());
            }
            if !$t.forwarder.refresh($t.cluster, node).await {
                // The nodes don't agree yet: give gossip a moment.
                tokio::time::sleep(retry.pause()).await;
            }
        }
    }};
}

/// The door's links to the nodes that own keys elsewhere, and the view it routes them by.
pub(crate) struct Forwarder {
    token: String,
    timeout: Duration,
    routes: Mutex<Arc<Routes>>,
    /// Per node: links not carrying a request now.
    idle: Mutex<HashMap<u32, Vec<Peer>>>,
    /// Nodes that just failed, and until when they are skipped.
    backoff: Mutex<HashMap<u32, Instant>>,
}

/// Why a forwarded request got no answer.
#[derive(Debug)]
enum Failed {
    /// The node could not be reached (or failed moments ago): its keys are misses for now.
    Unreachable(String),
    /// Routed by another view than the node's: route again by a fresh one.
    Moved(Option<NodeId>),
    /// The node refused it.
    Refused { code: ErrorCode, message: String },
    /// The node broke the protocol, or a value failed its checksum.
    Broken(String),
}

/// A node's answer: its reply with the payload it carries, or None for a miss.
type Answer = Option<(Reply, Vec<u8>)>;

impl Forwarder {
    pub(crate) fn new(token: String, timeout: Duration) -> Forwarder {
        Forwarder {
            token,
            timeout,
            routes: Mutex::new(Arc::new(Routes::new(ClusterView::default()))),
            idle: Mutex::default(),
            backoff: Mutex::default(),
        }
    }

    /// How long a forwarded request (and a forwarded value still arriving) may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The routes by this node's view, adopted first when it is newer than the door's.
    fn routes(&self, cluster: &Cluster) -> Arc<Routes> {
        let mut cur = lock(&self.routes);
        if cluster.stamp() != cur.stamp {
            if let Some(next) = cur.adopt(cluster.view(), Instant::now()) {
                *cur = Arc::new(next);
            }
        }
        cur.clone()
    }

    /// Routes by `v` from now on if it is newer. True when adopted.
    fn adopt(&self, v: ClusterView) -> bool {
        let mut cur = lock(&self.routes);
        match cur.adopt(v, Instant::now()) {
            Some(next) => {
                *cur = Arc::new(next);
                true
            }
            None => false,
        }
    }

    /// A link to `node` (an idle one, or one opened now from its address in `r`'s views).
    async fn link(&self, node: NodeId, r: &Routes) -> Result<Peer, Failed> {
        if let Some(p) = lock(&self.idle).get_mut(&node.0).and_then(Vec::pop) {
            return Ok(p);
        }
        let skipped = lock(&self.backoff)
            .get(&node.0)
            .is_some_and(|until| Instant::now() < *until);
        if skipped {
            let why = format!("node {} failed moments ago", node.0);
            return Err(Failed::Unreachable(why));
        }
        let info = r
            .view
            .node(node)
            .or_else(|| r.prev.as_ref().and_then(|(v, _)| v.node(node)))
            .ok_or_else(|| Failed::Refused {
                code: ErrorCode::WrongNode,
                message: format!("node {} is not in the cluster view", node.0),
            })?;
        Peer::connect_for_clients(&info.tcp, &self.token, node.0, self.timeout)
            .await
            .map_err(|e| self.failed(node, e))
    }

    /// What a failure of the link to `node` means; a node that can't be reached is skipped
    /// for a moment.
    fn failed(&self, node: NodeId, e: PeerError) -> Failed {
        match e {
            PeerError::Io(_) | PeerError::Timeout | PeerError::Wire(_) => {
                tracing::warn!(node = node.0, error = %e, "node unreachable: its keys are misses");
                lock(&self.backoff).insert(node.0, Instant::now() + BACKOFF);
                lock(&self.idle).remove(&node.0);
                Failed::Unreachable(e.to_string())
            }
            PeerError::Server { code, message } => Failed::Refused { code, message },
            e => Failed::Broken(e.to_string()),
        }
    }

    /// Keeps a link that is still in step for the next request.
    fn give_back(&self, node: NodeId, p: Peer) {
        let mut idle = lock(&self.idle);
        let links = idle.entry(node.0).or_default();
        if links.len() < IDLE_LINKS {
            links.push(p);
        }
    }

    /// One request to `node` in namespace `ns`, stamped `stamp` (0: on purpose): `op` gets
    /// the node's id of the namespace.
    async fn ask(
        &self,
        r: &Routes,
        (node, stamp): (NodeId, u64),
        ns: &str,
        op: impl FnOnce(u32) -> Op,
        payload: &[&[u8]],
    ) -> Result<Answer, Failed> {
        let mut p = self.link(node, r).await?;
        let id = p.ns(ns);
        let Some(id) = id else {
            self.give_back(node, p);
            return Err(Failed::Broken(format!("unknown namespace {ns:?}")));
        };
        let asked = p.ask(stamp, op(id), payload).await;
        let (outcome, body) = asked.map_err(|e| self.failed(node, e))?;
        self.give_back(node, p);
        match outcome {
            Outcome::Done(reply) => Ok(Some((reply, body))),
            // A node of an older protocol answers a miss as an error.
            Outcome::Miss
            | Outcome::Refused {
                code: ErrorCode::NotFound,
                ..
            } => Ok(None),
            Outcome::Moved { .. } => Err(Failed::Moved(Some(node))),
            Outcome::Refused {
                code: ErrorCode::Unavailable,
                message,
            } => Err(Failed::Unreachable(message)),
            Outcome::Refused { code, message } => Err(Failed::Refused { code, message }),
        }
    }

    /// After `Moved` from `node`: this node's view, or else `node`'s, adopted when newer.
    async fn refresh(&self, cluster: &Cluster, node: Option<NodeId>) -> bool {
        let before = lock(&self.routes).stamp;
        let r = self.routes(cluster);
        if r.stamp != before {
            return true;
        }
        let Some(node) = node else {
            return false;
        };
        let Ok(mut p) = self.link(node, &r).await else {
            return false;
        };
        match p.ask(0, Op::View, &[]).await {
            Ok((Outcome::Done(Reply::View(v)), _)) => {
                self.give_back(node, p);
                self.adopt(v)
            }
            _ => false,
        }
    }
}

/// Where one command's forwarded requests go: the door's links, this node's view and the
/// connection's namespace. Holds nothing of the connection, so a command can await it.
pub(crate) struct Target<'a> {
    pub(crate) forwarder: &'a Forwarder,
    pub(crate) cluster: &'a Cluster,
    pub(crate) ns: String,
    /// The namespace's (replicas, pinned replicas).
    pub(crate) replication: (usize, usize),
}

impl Target<'_> {
    /// The value of a key owned elsewhere: Ok(None) for a miss (a key whose owners can't be
    /// reached included), Err(reply line) on failure.
    pub(crate) async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        routed!(self, Some(None), |r| self.get_by(r, key))
    }

    /// Stores a value whose key is owned elsewhere (on every replica).
    pub(crate) async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let codes = self.put_many(&[(key, value)]).await?;
        refusal(codes[0]).map_or(Ok(()), |e| Err(e.text()))
    }

    /// Stores many values on their owners, one request per owner (cut to the node's limits);
    /// one code per item: stored once is stored, otherwise the first owner's refusal.
    pub(crate) async fn put_many(
        &self,
        items: &[(&[u8], &[u8])],
    ) -> Result<Vec<ErrorCode>, String> {
        routed!(self, None, |r| self.put_many_by(r, items))
    }

    /// True when `key` is present on its owner, or (while the view changes) on its previous
    /// owner with its owners vouching for that copy.
    pub(crate) async fn exists(&self, key: &[u8]) -> Result<bool, String> {
        routed!(self, Some(false), |r| self.exists_by(r, key))
    }

    /// Removes `key` from every node that may hold it; true when one did.
    pub(crate) async fn remove(&self, key: &[u8]) -> Result<bool, String> {
        routed!(self, None, |r| self.remove_by(r, key))
    }

    /// Removes every object of the namespace on every node of the view that is not down,
    /// pinned ones too; how many were removed. A node that can't be reached fails the call,
    /// since what it holds was not removed.
    pub(crate) async fn remove_all(&self) -> Result<u64, String> {
        let r = self.forwarder.routes(self.cluster);
        let mut removed = 0;
        for node in r.everyone() {
            let op = |ns| Op::Clear { ns };
            let n = match self.forwarder.ask(&r, (node, 0), &self.ns, op, &[]).await {
                Ok(Some((Reply::Count(n), _))) => n,
                Ok(Some((reply, _))) => return Err(unexpected(&reply).text()),
                Ok(None) => 0,
                Err(Failed::Unreachable(_)) => {
                    let e = Failed::Refused {
                        code: ErrorCode::Unavailable,
                        message: format!("node {} could not be reached to clear it", node.0),
                    };
                    return Err(e.text());
                }
                Err(e) => return Err(e.text()),
            };
            removed += n;
        }
        Ok(removed)
    }

    /// The values of many keys owned elsewhere (None: a miss), one request per node in each
    /// step of their plans: a key whose owner can't be reached goes on to its next replica,
    /// a miss (while the view changes) to its previous owner.
    pub(crate) async fn get_many(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, String> {
        routed!(self, Some(vec![None; keys.len()]), |r| self
            .get_many_by(r, keys))
    }

    /// One round of [`Target::get_many`]: every key whose step asks a node, asked, one
    /// request per node; what each heard (none when every key is done).
    async fn get_round(
        &self,
        r: &Routes,
        keys: &[&[u8]],
        steps: &[Step],
        found: &mut [Option<Vec<u8>>],
    ) -> Result<Vec<(usize, Heard)>, Failed> {
        let mut asks: Vec<((NodeId, u64), Vec<usize>)> = Vec::new();
        let mut previous: Vec<usize> = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            let to = match s {
                Step::Ask { node, stamp } => (*node, *stamp),
                Step::AskPrevious { node, .. } => {
                    previous.push(i);
                    (*node, 0)
                }
                Step::Hit | Step::Miss => continue,
            };
            match asks.iter_mut().find(|(t, _)| *t == to) {
                Some((_, ix)) => ix.push(i),
                None => asks.push((to, vec![i])),
            }
        }
        let mut heard = Vec::new();
        for (to, ix) in asks {
            let sub: Vec<&[u8]> = ix.iter().map(|&i| keys[i]).collect();
            match self.get_batch(r, to, &sub).await {
                Ok(values) => {
                    for (&i, v) in ix.iter().zip(values) {
                        heard.push((i, heard_value(v, &mut found[i])));
                    }
                }
                Err(Failed::Unreachable(_)) => {
                    heard.extend(ix.iter().map(|&i| (i, Heard::Unreachable)));
                }
                Err(e) => return Err(e),
            }
        }
        // A previous owner's copy counts only when the key's owners vouch for it.
        for i in previous {
            let Step::AskPrevious { vouchers, .. } = &steps[i] else {
                continue;
            };
            if found[i].is_some() && !self.vouched(r, keys[i], vouchers).await {
                found[i] = None;
                if let Some(h) = heard.iter_mut().find(|(j, _)| *j == i) {
                    h.1 = Heard::Miss;
                }
            }
        }
        Ok(heard)
    }

    /// One attempt of [`Target::get`], routed by `r`.
    async fn get_by(&self, r: &Routes, key: &[u8]) -> Result<Option<Vec<u8>>, Failed> {
        let fb = r.fallback(Instant::now(), FALLBACK_WINDOW);
        let mut plan = ReadPlan::one(r, key, self.read_replicas(), fb);
        let (mut step, mut found) = (plan.first(), None);
        loop {
            let heard = match step {
                Step::Ask { node, stamp } => match self.get_on(r, (node, stamp), key).await {
                    Ok(v) => heard_value(v, &mut found),
                    Err(Failed::Unreachable(_)) => Heard::Unreachable,
                    Err(e) => return Err(e),
                },
                Step::AskPrevious { node, vouchers } => {
                    let (old, vouched) = tokio::join!(
                        self.get_on(r, (node, 0), key),
                        self.vouched(r, key, &vouchers)
                    );
                    match (vouched, old) {
                        (true, Ok(v)) => heard_value(v, &mut found),
                        _ => Heard::Miss,
                    }
                }
                Step::Hit => return Ok(found),
                Step::Miss => return Ok(None),
            };
            step = plan.next(heard);
        }
    }

    /// One attempt of [`Target::put_many`], routed by `r`.
    async fn put_many_by(
        &self,
        r: &Routes,
        items: &[(&[u8], &[u8])],
    ) -> Result<Vec<ErrorCode>, Failed> {
        let mut codes = WriteCodes::new(items.len());
        // Each node's items from the last to the first, as the client stores them (a
        // prefix chain tail first).
        let mut by_node: Vec<(NodeId, Vec<usize>)> = Vec::new();
        for (i, (k, _)) in items.iter().enumerate().rev() {
            for o in r.writes(k, self.replication.0) {
                match by_node.iter_mut().find(|(n, _)| *n == o) {
                    Some((_, ix)) => ix.push(i),
                    None => by_node.push((o, vec![i])),
                }
            }
        }
        for (node, ix) in by_node {
            self.put_on(r, node, items, &ix, &mut codes).await?;
        }
        codes.finish().map_err(|ViewChanged| Failed::Moved(None))
    }

    /// One attempt of [`Target::exists`], routed by `r`.
    async fn exists_by(&self, r: &Routes, key: &[u8]) -> Result<bool, Failed> {
        let fb = r.fallback(Instant::now(), FALLBACK_WINDOW);
        let mut plan = ReadPlan::presence(r, key, self.read_replicas(), fb);
        let mut step = plan.first();
        loop {
            let heard = match step {
                Step::Ask { node, stamp } => match self.exists_on(r, (node, stamp), key).await {
                    Ok(true) => Heard::Hit,
                    Ok(false) => Heard::Miss,
                    Err(Failed::Unreachable(_)) => Heard::Unreachable,
                    Err(e) => return Err(e),
                },
                Step::AskPrevious { node, vouchers } => {
                    let (old, vouched) = tokio::join!(
                        self.exists_on(r, (node, 0), key),
                        self.vouched(r, key, &vouchers)
                    );
                    match (vouched, old) {
                        (true, Ok(true)) => Heard::Hit,
                        _ => Heard::Miss,
                    }
                }
                Step::Hit => return Ok(true),
                Step::Miss => return Ok(false),
            };
            step = plan.next(heard);
        }
    }

    /// One attempt of [`Target::remove`], routed by `r`.
    async fn remove_by(&self, r: &Routes, key: &[u8]) -> Result<bool, Failed> {
        let fb = r.fallback(Instant::now(), FALLBACK_WINDOW);
        let mut any = false;
        for to in r.removes(key, self.read_replicas(), fb) {
            let keys = vec![key.to_vec()];
            let op = |ns| Op::Remove { ns, keys };
            match self.forwarder.ask(r, to, &self.ns, op, &[]).await {
                Ok(Some((Reply::Count(n), _))) => any |= n > 0,
                Ok(Some((reply, _))) => return Err(unexpected(&reply)),
                Ok(None) | Err(Failed::Unreachable(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(any)
    }

    /// One attempt of [`Target::get_many`], routed by `r`.
    async fn get_many_by(
        &self,
        r: &Routes,
        keys: &[&[u8]],
    ) -> Result<Vec<Option<Vec<u8>>>, Failed> {
        let fb = r.fallback(Instant::now(), FALLBACK_WINDOW);
        let replicas = self.read_replicas();
        let mut plans: Vec<ReadPlan> = keys
            .iter()
            .map(|k| ReadPlan::batched(r, k, replicas, fb))
            .collect();
        let mut steps: Vec<Step> = plans.iter_mut().map(ReadPlan::first).collect();
        let mut found: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        loop {
            let heard = self.get_round(r, keys, &steps, &mut found).await?;
            if heard.is_empty() {
                return Ok(found);
            }
            for (i, h) in heard {
                steps[i] = plans[i].next(h);
            }
        }
    }

    /// Replicas reads consult: a pinned object may be on any of its pinned replicas.
    fn read_replicas(&self) -> usize {
        self.replication.0.max(self.replication.1).max(1)
    }

    async fn get_on(
        &self,
        r: &Routes,
        to: (NodeId, u64),
        key: &[u8],
    ) -> Result<Option<Vec<u8>>, Failed> {
        let key = key.to_vec();
        let op = |ns| Op::Get { ns, key };
        match self.forwarder.ask(r, to, &self.ns, op, &[]).await? {
            None => Ok(None),
            Some((Reply::Value { len, checksum }, body)) if body.len() as u64 == len => {
                match kvpool::checksum(&body) == checksum {
                    true => Ok(Some(body)),
                    false => Err(Failed::Broken("checksum mismatch on received value".into())),
                }
            }
            Some((reply, _)) => Err(unexpected(&reply)),
        }
    }

    async fn exists_on(&self, r: &Routes, to: (NodeId, u64), key: &[u8]) -> Result<bool, Failed> {
        let keys = vec![key.to_vec()];
        let op = |ns| Op::Exists { ns, keys };
        match self.forwarder.ask(r, to, &self.ns, op, &[]).await? {
            Some((Reply::Count(n), _)) => Ok(n > 0),
            None => Ok(false),
            Some((reply, _)) => Err(unexpected(&reply)),
        }
    }

    /// The values of `keys` on one node, in requests cut to the node's batch limit.
    async fn get_batch(
        &self,
        r: &Routes,
        to: (NodeId, u64),
        keys: &[&[u8]],
    ) -> Result<Vec<Option<Vec<u8>>>, Failed> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.batch_limit(r, to.0).await) {
            let keys: Vec<Vec<u8>> = chunk.iter().map(|k| k.to_vec()).collect();
            let op = |ns| Op::BatchGet {
                ns,
                keys,
                prefix: false,
            };
            let (metas, body) = match self.forwarder.ask(r, to, &self.ns, op, &[]).await? {
                Some((Reply::Values(m), body)) if m.len() == chunk.len() => (m, body),
                Some((reply, _)) => return Err(unexpected(&reply)),
                None => (vec![None; chunk.len()], Vec::new()),
            };
            let mut at = 0usize;
            for m in metas {
                let Some(m) = m else {
                    out.push(None);
                    continue;
                };
                let value = usize::try_from(m.len)
                    .ok()
                    .and_then(|n| body.get(at..at.checked_add(n)?))
                    .ok_or_else(|| Failed::Broken("values shorter than announced".into()))?;
                if kvpool::checksum(value) != m.checksum {
                    return Err(Failed::Broken("checksum mismatch on received value".into()));
                }
                at += value.len();
                out.push(Some(value.to_vec()));
            }
        }
        Ok(out)
    }

    /// Stores the items `ix` of `items` on `node`, in requests cut to its limits, each code
    /// told to `codes`.
    async fn put_on(
        &self,
        r: &Routes,
        node: NodeId,
        items: &[(&[u8], &[u8])],
        ix: &[usize],
        codes: &mut WriteCodes,
    ) -> Result<(), Failed> {
        let (max_keys, max_bytes) = self.limits(r, node).await;
        let mut batches: Vec<(Vec<usize>, u64)> = Vec::new();
        for &i in ix {
            let len = items[i].1.len() as u64;
            match batches.last_mut() {
                Some((b, bytes))
                    if b.len() < max_keys && bytes.saturating_add(len) <= max_bytes =>
                {
                    b.push(i);
                    *bytes += len;
                }
                _ => batches.push((vec![i], len)),
            }
        }
        for (b, _) in batches {
            let to = (node, r.stamp);
            match self.put_batch(r, to, items, &b).await {
                Ok(got) => b.iter().zip(got).for_each(|(&i, c)| codes.heard(i, c)),
                Err(Failed::Unreachable(_)) => b
                    .iter()
                    .for_each(|&i| codes.heard(i, ErrorCode::Unavailable)),
                Err(Failed::Moved(_)) => {
                    b.iter().for_each(|&i| codes.heard(i, ErrorCode::WrongView))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One request storing the items `b` of `items`: a `Put` for one, a `BatchPut` for more.
    async fn put_batch(
        &self,
        r: &Routes,
        to: (NodeId, u64),
        items: &[(&[u8], &[u8])],
        b: &[usize],
    ) -> Result<Vec<ErrorCode>, Failed> {
        if let [i] = b {
            let (key, value) = items[*i];
            let op = |ns| Op::Put {
                ns,
                key: key.to_vec(),
                checksum: kvpool::checksum(value),
                pin: false,
            };
            return match self.forwarder.ask(r, to, &self.ns, op, &[value]).await {
                Ok(_) => Ok(vec![ErrorCode::Ok]),
                Err(Failed::Refused { code, .. }) => Ok(vec![code]),
                Err(e) => Err(e),
            };
        }
        let put: Vec<PutItem> = b
            .iter()
            .map(|&i| PutItem {
                key: items[i].0.to_vec(),
                len: items[i].1.len() as u64,
                checksum: kvpool::checksum(items[i].1),
            })
            .collect();
        let op = |ns| Op::BatchPut {
            ns,
            items: put,
            pin: false,
            depths: Vec::new(),
        };
        let payload: Vec<&[u8]> = b.iter().map(|&i| items[i].1).collect();
        match self.forwarder.ask(r, to, &self.ns, op, &payload).await? {
            Some((Reply::Statuses(s), _)) if s.len() == b.len() => {
                Ok(s.into_iter().map(ErrorCode::from_u16).collect())
            }
            Some((reply, _)) => Err(unexpected(&reply)),
            None => Err(Failed::Broken("a store answered as a miss".into())),
        }
    }

    /// May the copy of `key` on its previous owner be served? Only when every one of
    /// `vouchers` vouches that it acknowledged no write or remove of the key since it could
    /// have taken one over that copy (`Op::Vouch`); one that does not answer vouches for
    /// nothing.
    async fn vouched(&self, r: &Routes, key: &[u8], vouchers: &[NodeId]) -> bool {
        for &node in vouchers {
            let keys = vec![key.to_vec()];
            let op = |ns| Op::Vouch { ns, keys };
            match self.forwarder.ask(r, (node, 0), &self.ns, op, &[]).await {
                Ok(Some((Reply::Statuses(s), _))) if s == [ErrorCode::Ok as u16] => {}
                _ => return false,
            }
        }
        true
    }

    /// The keys and bytes one request to `node` may carry, as its handshake said.
    async fn limits(&self, r: &Routes, node: NodeId) -> (usize, u64) {
        match self.forwarder.link(node, r).await {
            Ok(p) => {
                let limits = (
                    (p.hello.max_batch as usize).max(1),
                    p.hello.max_payload.max(1),
                );
                self.forwarder.give_back(node, p);
                limits
            }
            // Unreachable: one item per request, each then failing on its own.
            Err(_) => (1, u64::MAX),
        }
    }

    async fn batch_limit(&self, r: &Routes, node: NodeId) -> usize {
        self.limits(r, node).await.0
    }
}

impl Failed {
    /// The RESP error line for a forwarded request that failed.
    fn text(&self) -> String {
        match self {
            Failed::Refused {
                code: ErrorCode::PoolFull | ErrorCode::QuotaExceeded,
                message,
            } => format!("OOM kvpool: the owner has no room: {message}"),
            Failed::Refused { code, message } => {
                format!("ERR kvpool: forwarding to the key's owner failed: node refused: {code:?}: {message}")
            }
            Failed::Moved(_) => "ERR kvpool: forwarding to the key's owner failed: node refused: \
                 WrongView: the view changed during the request"
                .into(),
            Failed::Unreachable(e) | Failed::Broken(e) => {
                format!("ERR kvpool: forwarding to the key's owner failed: {e}")
            }
        }
    }
}

/// The refusal a write's code means, or None when it was stored.
fn refusal(code: ErrorCode) -> Option<Failed> {
    let message = match code {
        ErrorCode::Ok => return None,
        // The only way a write fails so: a `cancel` of its key came first.
        ErrorCode::Failed => {
            "its key was cancelled (a `cancel` of the request) before the commit".into()
        }
        code => format!("{code:?}"),
    };
    Some(Failed::Refused { code, message })
}

/// What a read heard of value `v`, kept in `found` when there is one.
fn heard_value(v: Option<Vec<u8>>, found: &mut Option<Vec<u8>>) -> Heard {
    match v {
        Some(v) => {
            *found = Some(v);
            Heard::Hit
        }
        None => Heard::Miss,
    }
}

fn unexpected(r: &Reply) -> Failed {
    Failed::Broken(format!("unexpected reply {r:?}"))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
