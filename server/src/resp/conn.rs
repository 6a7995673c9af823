//! One RESP connection's state (`Conn`): its session, its view of the cluster, its reply
//! buffer, and what every command uses: authentication, where a key is served, forwarding to
//! the key's owners, errors and values written out.

use std::io;
use std::sync::Arc;

use kvpool::placement::ClusterView;
use kvpool::protocol::io::write_all_vectored;
use kvpool::resp::{encode, Parser, Proto};
use kvpool::weights::Manifest;
use kvpool::{NodeId, PoolError};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::forward;
use super::shared::RespShared;
use crate::deadline::StallLimit;
use crate::service::{Routing, Shared};

/// Values at least this long are written from the pool to the socket directly instead of being
/// copied into the reply buffer.
pub(super) const DIRECT_WRITE: usize = 16 << 10;

/// One RESP connection's state.
pub(crate) struct Conn<'a, W> {
    pub(crate) s: &'a Shared,
    pub(crate) door: &'a RespShared,
    pub(crate) id: u64,
    /// The peer's address (wrong tokens are counted per address).
    pub(super) peer: Option<std::net::IpAddr>,
    pub(super) w: StallLimit<W>,
    /// Replies not yet written.
    pub(crate) out: Vec<u8>,
    pub(crate) proto: Proto,
    pub(super) session: Option<Session>,
    pub(crate) name: Option<Vec<u8>>,
    /// The cluster view keys are checked against, refreshed when the membership's stamp moves.
    pub(super) view: (u64, ClusterView),
    /// How reads are served, set by [`Conn::check_key`]: as the owner's copy by the view
    /// (only objects held as their owner since written, as the native client's routed reads
    /// are), or directly on a node that never had a peer, where every object is.
    pub(super) routing: Routing,
    /// The weights view's last manifest (`weights`).
    pub(super) manifests: ManifestCache,
    /// This connection's count under its `AUTH` token (`limits.max_connections_per_token`).
    pub(super) token_slot: Option<crate::admission::TokenSlot>,
    /// Until an `AUTH` is accepted: tells the reaper that the connection authenticated.
    pub(super) admit: Option<crate::reaper::Admit>,
}

/// A command's arguments.
pub(super) struct Args<'b> {
    pub(super) p: &'b Parser,
    pub(super) buf: &'b [u8],
}

impl<'b> Args<'b> {
    pub(super) fn len(&self) -> usize {
        self.p.len()
    }

    pub(super) fn get(&self, i: usize) -> &'b [u8] {
        self.p.arg(self.buf, i).unwrap_or_default()
    }

    pub(super) fn iter(&self, from: usize) -> impl Iterator<Item = &'b [u8]> + Clone + 'b {
        let (p, buf) = (self.p, self.buf);
        (from..p.len()).map(move |i| p.arg(buf, i).unwrap_or_default())
    }
}

/// Where a key is served.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// From this node's pool: it is the key's only owner (or has never had a peer).
    Local,
    /// By its owners, over the door's links to them.
    Remote,
}

/// Why a keyed command was refused before it touched the pool.
pub(super) enum Refused {
    /// An error reply, ready to send.
    Reply(String),
}

impl Refused {
    /// The error reply.
    pub(super) fn text(self) -> String {
        let Refused::Reply(msg) = self;
        msg
    }
}

impl<'a, W: AsyncWrite + Unpin + Send> Conn<'a, W> {
    /// A connection from `peer`; `admit` tells the reaper when it has authenticated (at once
    /// on a node without a token).
    pub(crate) fn new(
        s: &'a Shared,
        door: &'a RespShared,
        id: u64,
        (peer, admit): (Option<std::net::IpAddr>, Option<crate::reaper::Admit>),
        w: StallLimit<W>,
    ) -> Self {
        // A node without a token admits everyone to the default namespace at once.
        let session = s.authenticate("").and_then(|access| {
            let ns = s.namespace(&access, kvpool::pool::DEFAULT_NAMESPACE).ok()?;
            Some(Session {
                ns,
                ns_name: kvpool::pool::DEFAULT_NAMESPACE.to_string(),
                writes: access.writes(ns),
                weights: s
                    .namespace(&access, kvpool::weights::DEFAULT_NAMESPACE)
                    .ok(),
            })
        });
        let mut conn = Conn {
            s,
            door,
            id,
            peer,
            w,
            out: Vec::with_capacity(64 << 10),
            proto: Proto::Resp2,
            session,
            name: None,
            view: (s.cluster.stamp(), s.cluster.view()),
            routing: Routing::ByView(s.cluster.stamp()),
            manifests: None,
            token_slot: None,
            admit,
        };
        if conn.session.is_some() {
            conn.admitted();
        }
        conn
    }

    /// The connection authenticated: it is never reaped to make room after this. (One reaped
    /// meanwhile fails its next read and closes.)
    pub(super) fn admitted(&mut self) {
        if let Some(admit) = self.admit.take() {
            admit.authenticated();
        }
    }

    pub(crate) fn authenticated(&self) -> bool {
        self.session.is_some()
    }

    pub(crate) fn session(&self) -> Option<&Session> {
        self.session.as_ref()
    }

    /// Bytes of replies buffered.
    pub(crate) fn pending(&self) -> usize {
        self.out.len()
    }

    pub(crate) async fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            let r = self.w.write_all(&self.out).await;
            self.out.clear();
            r?;
        }
        self.w.flush().await
    }

    pub(crate) async fn shutdown(&mut self) -> io::Result<()> {
        self.w.shutdown().await
    }

    /// Answers bytes that are not RESP (the connection closes after it).
    pub(crate) fn protocol_error(&mut self, msg: &str) {
        encode::error(&mut self.out, &format!("ERR {msg}"));
    }

    /// `AUTH [namespace] token`: the token must admit to the namespace (`default` when none is
    /// named). A failed AUTH leaves the connection as it was.
    pub(crate) fn auth(&mut self, user: Option<&[u8]>, token: &[u8]) -> Result<(), String> {
        const WRONGPASS: &str = "WRONGPASS invalid username-password pair or user is disabled.";
        let ns_name = match user {
            Some(u) => std::str::from_utf8(u).map_err(|_| WRONGPASS.to_string())?,
            None => kvpool::pool::DEFAULT_NAMESPACE,
        };
        let token = std::str::from_utf8(token).map_err(|_| WRONGPASS.to_string())?;
        let access = self
            .s
            .authenticate_peer(token, self.peer)
            .map_err(|denied| match denied {
                crate::service::AuthDenied::Wrong => WRONGPASS.to_string(),
                throttled => format!("ERR kvpool: {}", throttled.message()),
            })?;
        let ns = self
            .s
            .namespace(&access, ns_name)
            .map_err(|_| WRONGPASS.to_string())?;
        self.s
            .admit_token(token, &mut self.token_slot)
            .map_err(|why| format!("ERR kvpool: {why}"))?;
        self.admitted();
        self.session = Some(Session {
            ns,
            ns_name: ns_name.to_string(),
            writes: access.writes(ns),
            weights: self
                .s
                .namespace(&access, kvpool::weights::DEFAULT_NAMESPACE)
                .ok(),
        });
        Ok(())
    }

    pub(super) fn ns(&self) -> u32 {
        self.session.as_ref().map_or(0, |s| s.ns)
    }

    /// The session's token may change its namespace.
    pub(crate) fn writes(&self) -> bool {
        self.session.as_ref().is_some_and(|s| s.writes)
    }

    /// The `weights` namespace's id when the connection's token admits to it (the weights
    /// view is shown only then).
    pub(super) fn weights_ns(&self) -> Option<u32> {
        self.session.as_ref().and_then(|s| s.weights)
    }

    /// Where `key` is served, or why it is refused: a key of a size the pool never stores, or,
    /// in a cluster with no node serving, any key. In a cluster of several nodes a key whose
    /// owners are not exactly this node is forwarded to them (a copy stored here would shadow,
    /// or be shadowed by, the owner's).
    pub(super) fn check_key(&mut self, key: &[u8]) -> Result<Place, Refused> {
        self.check_key_in(self.ns(), key)
    }

    /// [`Conn::check_key`] for a key of namespace `ns` (the connection's, or `weights` for the
    /// weights view).
    pub(super) fn check_key_in(&mut self, ns: u32, key: &[u8]) -> Result<Place, Refused> {
        if self.s.pool.check_key(key).is_err() {
            return Err(Refused::Reply(format!(
                "ERR kvpool keys are 1 to {} bytes (limits.max_key_len)",
                self.s.pool.max_key_len()
            )));
        }
        let stamp = self.s.cluster.stamp();
        if stamp != self.view.0 {
            self.view = (stamp, self.s.cluster.view());
        }
        let view = &self.view.1;
        if view.nodes.len() <= 1 {
            // A node that never had a peer holds every object as its only owner.
            self.routing = Routing::Direct;
            return Ok(Place::Local);
        }
        // Judged by the view placed by: if the node leaves it meanwhile, its reads here miss
        // (and remove nothing) rather than be judged by a view they were not placed by.
        self.routing = Routing::ByView(self.view.0);
        let replicas = self.s.replication(ns).map_or(1, |r| r.replicas.max(1)) as usize;
        let me = self.s.cluster.me();
        let owners = view.owners(key, replicas);
        if owners.len() == 1 && owners[0] == NodeId(me) {
            return Ok(Place::Local);
        }
        if owners.is_empty() {
            return Err(Refused::Reply(
                "CLUSTERDOWN kvpool: no node of the cluster is serving".into(),
            ));
        }
        Ok(Place::Remote)
    }

    /// Where this connection's keys owned elsewhere are forwarded, or the error line to
    /// answer when this node can't forward.
    pub(super) fn forward(&self) -> Result<forward::Target<'a>, String> {
        let ns = self
            .session
            .as_ref()
            .map_or(kvpool::pool::DEFAULT_NAMESPACE, |s| s.ns_name.as_str());
        self.forward_in(ns)
    }

    /// [`Conn::forward`] in namespace `ns` (which the caller checked the connection may use).
    pub(super) fn forward_in(&self, ns: &str) -> Result<forward::Target<'a>, String> {
        let s = self.s;
        let id = s.hello.namespaces.iter().find(|(n, _)| n == ns);
        // A namespace this node does not name: as the client's default.
        let replication = id
            .and_then(|&(_, id)| s.replication(id))
            .map_or((1, 2), |r| {
                (r.replicas as usize, r.pinned_replicas as usize)
            });
        Ok(forward::Target {
            forwarder: &self.door.forward,
            cluster: &s.cluster,
            ns: ns.to_string(),
            replication,
        })
    }

    /// The value of a key owned elsewhere: Ok(None) for a miss, Err(reply line) on failure.
    pub(super) async fn forward_get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        let t = self.forward()?;
        t.get(key).await
    }

    /// Stores a value whose key is owned elsewhere (on every replica).
    pub(super) async fn forward_put(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let t = self.forward()?;
        self.s.metrics.bytes(value.len() as u64, 0);
        t.put(key, value).await
    }

    pub(super) fn refuse(&mut self, r: Refused) {
        let Refused::Reply(msg) = r;
        encode::error(&mut self.out, &msg);
    }

    pub(super) fn pool_error(&mut self, e: PoolError) {
        let msg = self.pool_error_text(e);
        encode::error(&mut self.out, &msg);
    }

    pub(super) fn pool_error_text(&self, e: PoolError) -> String {
        match e {
            PoolError::PoolFull | PoolError::QuotaExceeded => {
                format!("OOM kvpool: {e} (every object is pinned, leased or being read)")
            }
            PoolError::TooLarge => format!(
                "ERR kvpool: value too large for this pool (largest {} bytes)",
                self.s.pool.max_value_len()
            ),
            e => format!("ERR kvpool: {e}"),
        }
    }

    pub(super) async fn write_value(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.s.metrics.bytes(0, bytes.len() as u64);
        if bytes.len() < DIRECT_WRITE {
            encode::bulk(&mut self.out, bytes);
            return Ok(());
        }
        // The replies before it, the value's header, the value and its end in one vectored
        // write: one system call, and no lone packet for the header or the CRLF that the
        // client would have to wake up for.
        encode::bulk_header(&mut self.out, bytes.len());
        let mut bufs = [
            io::IoSlice::new(&self.out),
            io::IoSlice::new(bytes),
            io::IoSlice::new(encode::CRLF),
        ];
        let r = write_all_vectored(&mut self.w, &mut bufs).await;
        self.out.clear();
        r
    }
}

/// The manifest a connection read last: (model, xxh3 of its bytes, parsed). A GET of the next
/// tensor re-reads the manifest object (so a model removed or republished is seen at once) but
/// parses it again only when its bytes changed.
pub(crate) type ManifestCache = Option<(String, u64, Arc<Manifest>)>;

/// What the connection does after a command.
pub(crate) enum Next {
    Continue,
    /// The reply is written; close (QUIT).
    Close,
}

/// A connection's namespace and rights, once it is authenticated.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub(crate) ns: u32,
    pub(crate) ns_name: String,
    /// The token may change the namespace (not only read it: `read_tokens`).
    pub(crate) writes: bool,
    /// The `weights` namespace's id, when the token admits to it (the weights view).
    pub(crate) weights: Option<u32>,
}

/// The protocol a connection speaks (RESP2 until `HELLO 3`).
pub(crate) fn proto_of(v: &[u8]) -> Option<Proto> {
    match v {
        b"2" => Some(Proto::Resp2),
        b"3" => Some(Proto::Resp3),
        _ => None,
    }
}
