//! Routing: the view requests are routed by (and the previous one, for a while after it
//! changed), who owns a key under it, the links to the nodes, and what happens when a node
//! fails or answers that the view changed. The decisions are the core's routing plan
//! ([`kvpool::route`]); this part carries them out. Part of `client`; uses `link`,
//! `endpoint`, `config` and `error`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use kvpool::placement::{ClusterView, NodeState};
use kvpool::protocol::{ErrorCode, Op, Reply};
use kvpool::route::{Routes, ViewRetry};
use kvpool::{GlobalAddr, NodeId};

use super::Client;
use crate::endpoint::Endpoint;
use crate::error::ClientError;
use crate::link::{unexpected, Link};

/// How the client reaches nodes other than the one it connected to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scheme {
    Tcp,
    Quic,
    /// Reached over `tls://`: other nodes over QUIC (TLS 1.3 with the same CA), never in
    /// plaintext (the view carries no TLS-over-TCP addresses).
    Tls,
    /// Reached over `fabric://`: other nodes over their fabric too (TCP for requests).
    Fabric,
}

/// The view requests are routed by, and the one before it.
pub(super) type Routing = Routes;

/// Whether the view `r` routes by has node `node` restarting in place.
fn restarting(r: &Routing, node: u32) -> bool {
    r.view
        .node(NodeId(node))
        .is_some_and(|n| n.state == NodeState::Restarting)
}

/// How long a node that failed is skipped before the client tries it again.
const BACKOFF: Duration = Duration::from_millis(500);

/// Runs `$body` (the contents of an async block that routes by `$r`, the current routing) and
/// runs it again, with a fresh view, when a node answers that the view changed (a bounded
/// number of times). With `wrong_view_miss`, a view that keeps changing yields that value (a
/// miss for reads) instead of the `WrongView` error.
macro_rules! routed {
    ($client:ident, $r:ident => $body:block $(, wrong_view_miss => $miss:expr)?) => {{
        let mut retry = ::kvpool::route::ViewRetry::new();
        loop {
            let $r = $client.routing();
            let res: Result<_, $crate::error::ClientError> = async $body.await;
            match res {
                Err(e) if $client.retry_view(&e, &mut retry).await => {}
                $(Err(e) if e.code() == Some(::kvpool::protocol::ErrorCode::WrongView) => {
                    break Ok($miss)
                })?
                other => break other,
            }
        }
    }};
}

/// Whether no node of `v` is serving (with etcd: every lease lapsed at once, or every node
/// restarting in place): no request reaches a node that could answer with a newer view.
pub(super) fn ownerless(v: &ClusterView) -> bool {
    !v.nodes.iter().any(|n| n.state == NodeState::Serving)
}

impl Client {
    /// The routing requests go by now. A view without a serving node is refreshed in the
    /// background meanwhile (at most every [`BACKOFF`]).
    pub(super) fn routing(&self) -> Arc<Routing> {
        let r = self
            .inner
            .routing
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if self
            .inner
            .ownerless
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.refresh_soon();
        }
        r
    }

    /// Replicas consulted by reads: a pinned object may be on any of `pinned_replicas` nodes.
    pub(super) fn read_replicas(&self) -> usize {
        self.repl.0.max(self.repl.1).max(1)
    }

    pub(super) fn fallback<'r>(&self, r: &'r Routing) -> Option<&'r ClusterView> {
        r.fallback(Instant::now(), self.cfg.fallback_window)
    }

    /// The previous owner of `key`, when the view changed recently, it differs from the
    /// current owner and it is not down ([`Routes::previous_owner`]).
    pub(super) fn prev_owner(&self, r: &Routing, key: &[u8]) -> Option<u32> {
        r.previous_owner(key, self.fallback(r)).map(|n| n.0)
    }

    /// The `k`-th owner of `key` among the replicas reads consult (the owner itself for 0,
    /// found without ranking every node).
    pub(super) fn owner_at(&self, r: &Routing, key: &[u8], k: usize) -> Option<NodeId> {
        r.owner_at(key, k, self.read_replicas())
    }

    pub(super) fn primary(&self, r: &Routing, key: &[u8]) -> Result<u32, ClientError> {
        r.view.owner(key).map(|n| n.0).ok_or_else(no_owner)
    }

    /// The link to node `node`, opened on first use from its address in the view. A node the
    /// view has restarting in place is not asked (its keys are misses and its writes refused
    /// until it is back), and its old link is dropped: the process it led to is gone.
    pub(super) async fn link(&self, node: u32, r: &Routing) -> Result<Arc<Link>, ClientError> {
        if restarting(r, node) {
            // No backoff: the next process may serve moments later.
            self.drop_link(node);
            return Err(ClientError::Server {
                code: ErrorCode::Unavailable,
                message: format!("node {node} is restarting"),
            });
        }
        if let Some(l) = self
            .inner
            .links
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
        {
            return Ok(l.clone());
        }
        // Boxed: opening a link is a future of several kilobytes (a connection, a handshake),
        // and inline it would be part of every request's future, which `fan_out` builds and
        // moves on every call (callgrind: about 11 KB copied per same-host batched get).
        Box::pin(self.open_link(node, r)).await
    }

    /// [`Client::link`] for a node with no link yet: opens one from its address in the view.
    async fn open_link(&self, node: u32, r: &Routing) -> Result<Arc<Link>, ClientError> {
        let skipped = self
            .inner
            .backoff
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .is_some_and(|until| Instant::now() < *until);
        if skipped {
            return Err(ClientError::Server {
                code: ErrorCode::Unavailable,
                message: format!("node {node} failed moments ago"),
            });
        }
        let info = r
            .view
            .node(NodeId(node))
            .or_else(|| r.prev.as_ref().and_then(|(v, _)| v.node(NodeId(node))))
            .ok_or_else(|| ClientError::Server {
                // Nodes stay in the view (down) after they leave: this one never was in it.
                code: ErrorCode::WrongNode,
                message: format!("node {node} is not in the cluster view"),
            })?;
        let endpoint = match self.inner.scheme {
            Scheme::Quic | Scheme::Tls if !info.quic.is_empty() => {
                Endpoint::Quic(info.quic.clone())
            }
            Scheme::Tls => {
                return Err(ClientError::Tls(format!(
                    "node {node} has no QUIC address, and a tls:// client reaches other nodes \
                     only encrypted"
                )))
            }
            Scheme::Fabric => Endpoint::Fabric(info.tcp.clone()),
            _ => Endpoint::Tcp(info.tcp.clone()),
        };
        let cfg = &self.cfg;
        let opened = tokio::time::timeout(cfg.timeout, Link::open(endpoint.clone(), cfg))
            .await
            .map_err(|_| ClientError::Timeout)
            .and_then(|r| r);
        let link = match opened {
            Ok(l) => l,
            Err(e) => {
                if e.is_unreachable() {
                    self.lost(node, &e);
                }
                return Err(e);
            }
        };
        if link.node() != node {
            return Err(ClientError::Protocol(format!(
                "{endpoint} is node {}, the view says node {node}",
                link.node()
            )));
        }
        self.inner.cut.meet(&link.hello);
        let mut links = self.inner.links.lock().unwrap_or_else(|e| e.into_inner());
        Ok(links.entry(node).or_insert_with(|| Arc::new(link)).clone())
    }

    pub(super) async fn link_of(&self, addr: &GlobalAddr) -> Result<Arc<Link>, ClientError> {
        self.link(addr.node.0, &self.routing()).await
    }

    /// A node failed: its keys are misses for now. Logged, and the link dropped; it is tried
    /// again after [`BACKOFF`]. A node the view has restarting is expected to fail: only its
    /// link is dropped, so that the next process is reached as soon as the view has it back.
    pub(super) fn lost(&self, node: u32, e: &ClientError) {
        if restarting(&self.routing(), node) {
            tracing::debug!(
                node,
                "node restarting: its keys are misses until it is back"
            );
            self.drop_link(node);
            self.refresh_soon();
            return;
        }
        tracing::warn!(node, error = %e, "node unreachable: its keys are misses");
        self.inner
            .unreachable
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.forget(node);
    }

    /// Refreshes the view in the background, at most once per [`BACKOFF`]: a node restarting
    /// in place is not asked, and a client that only reads that node's keys would otherwise
    /// never hear that it came back, since only another node's answer (`WrongView`) tells it
    /// the view changed; nor would a client whose view has no node serving.
    fn refresh_soon(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        {
            let mut r = self
                .inner
                .refreshed
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let recent = r.0.is_some_and(|at| at.elapsed() < BACKOFF);
            if r.1 || recent {
                return;
            }
            *r = (Some(Instant::now()), true);
        }
        let c = self.clone();
        rt.spawn(async move {
            c.refresh().await;
            let mut r = c.inner.refreshed.lock().unwrap_or_else(|e| e.into_inner());
            r.1 = false;
        });
    }

    /// Drops the link to a node that failed, so the next use reconnects after [`BACKOFF`]. A
    /// failure while the node is skipped anyway (a request refused by the backoff itself) does
    /// not prolong it: else a client asking the node more often than every [`BACKOFF`] would
    /// never try it again, even long after it came back.
    pub(super) fn forget(&self, node: u32) {
        let now = Instant::now();
        self.inner
            .backoff
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(node)
            .and_modify(|until| {
                if *until <= now {
                    *until = now + BACKOFF;
                }
            })
            .or_insert(now + BACKOFF);
        self.drop_link(node);
    }

    /// Drops the link to `node` (never the first one's), so the next use connects again.
    fn drop_link(&self, node: u32) {
        if node != self.inner.first.node() {
            self.inner
                .links
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&node);
        }
    }

    pub(super) async fn fetch_view(&self, l: &Link) -> Result<ClusterView, ClientError> {
        match l.simple(&self.cfg, 0, Op::View, &[]).await? {
            Reply::View(v) => Ok(v),
            r => Err(unexpected(&r)),
        }
    }

    /// Routes by `v` from now on if it is newer than the current view. True when adopted.
    pub(super) fn adopt(&self, v: ClusterView) -> bool {
        let mut cur = self
            .inner
            .routing
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let Some(next) = cur.adopt(v, Instant::now()) else {
            return false;
        };
        tracing::debug!(
            from = cur.view.version,
            to = next.view.version,
            "cluster view changed"
        );
        self.inner
            .ownerless
            .store(ownerless(&next.view), std::sync::atomic::Ordering::Relaxed);
        *cur = Arc::new(next);
        true
    }

    /// Asks every node the client has a link to for its view and adopts the newest.
    pub(super) async fn refresh(&self) -> bool {
        let links: Vec<Arc<Link>> = self
            .inner
            .links
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        let views = join_all(links.iter().map(|l| self.fetch_view(l))).await;
        let mut adopted = false;
        let mut best: Option<ClusterView> = None;
        for v in views.into_iter().flatten() {
            if best.as_ref().is_none_or(|b| v.version > b.version) {
                best = Some(v);
            }
        }
        if let Some(v) = best {
            adopted = self.adopt(v);
        }
        adopted
    }

    /// After a failed routed call: when a node answered that the view changed, refreshes the
    /// view (or waits a moment for gossip to settle) and says to route again, a bounded number
    /// of times.
    pub(super) async fn retry_view(&self, e: &ClientError, retry: &mut ViewRetry) -> bool {
        if e.code() != Some(ErrorCode::WrongView) || !retry.again() {
            return false;
        }
        if !self.refresh().await {
            // The nodes don't agree yet: give gossip a moment.
            tokio::time::sleep(retry.pause()).await;
        }
        true
    }
}

fn no_owner() -> ClientError {
    ClientError::Server {
        code: ErrorCode::Unavailable,
        message: "no node is serving".into(),
    }
}
