//! One connection (or one QUIC stream) of the native protocol: read a frame, do what it asks,
//! answer; repeat.
//!
//! Requests are answered in the order they arrive, each tagged with its id, so a client may
//! pipeline as many as it likes; responses are flushed when no further request is already
//! buffered. Every request consumes exactly its payload, even when it fails, so one bad request
//! never desynchronises the stream. A frame that breaks the protocol itself (bad magic, a header
//! over the limit) is answered with an error and the connection is closed: after it nothing on
//! the stream can be trusted.
//!
//! This file holds the connection loop, the handshake gate, the view-stamp and namespace checks,
//! metrics and the reply helpers; [`Conn::dispatch`] hands each operation to its family:
//!
//! - `admin`: `Hello` (the handshake), `Stats`;
//! - `data`: `Put`, `Get`, `BatchPut`, `BatchGet` (its prefix mode included), `Exists`,
//!   `Remove`, `Clear`, `Scan`, over the transport-independent operations of [`crate::service`];
//! - `one_sided`: `Alloc`, `Write`, `Commit`, `Abort`, `Read`, `MapInfo` (access by address);
//! - `prefix`: `Lookup`, `Release`, `Pin` (finding, leasing and pinning objects by key);
//! - `cluster`: `ClusterAuth`, `Gossip`, `View`, `Drain`, `Vouch`, `Move` (node to node).

mod admin;
mod cluster;
mod data;
mod handoff;
mod one_sided;
mod prefix;

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Instant;

use kvpool::protocol::auth::{self, AuthBytes};
use kvpool::protocol::io::{
    discard, read_header, read_prefix, write_all_vectored, write_frame, FrameReader, LowWater,
    WireError,
};
use kvpool::protocol::AlignedVec;
use kvpool::protocol::{
    decode_request, encode, ArchivedOp, ErrorCode, FrameError, Priority, Reply, Response,
};
use kvpool::PoolError;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::watch;

use self::data::Item;
use crate::bulk::{Bulk, Ticket};
use crate::deadline::{within, ReadStall, StallLimit};
use crate::metrics::{OpKind, Transport};
use crate::service::{Access, Routing, Shared};

/// The read and write buffers of an authenticated connection.
const IO_BUFFER: usize = 64 << 10;

/// The read buffer until the `Hello` is accepted: room for a `Hello` frame, so that
/// connections that never authenticate hold little (a larger `Hello` is read past it).
const HELLO_BUFFER: usize = 4 << 10;

/// Bytes of a large payload sent or received between two yields to the runtime (see
/// [`Conn::reply`] and the put path): the most a latency request waits behind a bulk transfer
/// on a worker thread.
pub(crate) const BULK_CHUNK: usize = 1 << 20;

/// Bytes of a payload received at a time before they are looked at (hashed while in cache).
const RECEIVE_PIECE: usize = 256 << 10;

/// What the accept loop knows of a connection it hands to [`serve`].
pub(crate) struct Accepted {
    pub(crate) transport: Transport,
    /// The peer's IP address; None over the Unix socket.
    pub(crate) peer: Option<std::net::IpAddr>,
    /// The socket under a plain TCP or Unix connection.
    pub(crate) fd: Option<std::os::fd::RawFd>,
    /// Tells the reaper that the connection authenticated; None where nothing reaps it.
    pub(crate) admit: Option<crate::reaper::Admit>,
}

/// Serves one connection until the peer leaves, the protocol breaks, or shutdown is signalled
/// while the connection is idle between requests.
pub(crate) async fn serve<R, W>(
    shared: Arc<Shared>,
    accepted: Accepted,
    r: R,
    w: W,
    mut shutdown: watch::Receiver<bool>,
) where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let Accepted {
        transport,
        peer: peer_ip,
        fd,
        admit,
    } = accepted;
    shared.metrics.connection_opened(transport);
    let tcp_fd = fd.filter(|_| transport == Transport::Tcp);
    let mut conn = Conn {
        s: &shared,
        transport,
        // A request that stops arriving half-way fails the connection (idling between
        // requests is the idle policy's). Small until the Hello is accepted.
        r: FrameReader::with_capacity(
            HELLO_BUFFER,
            ReadStall::new(r, shared.conn.read).on_socket(tcp_fd),
        ),
        // A reply the peer stops reading fails the connection, releasing what it referenced.
        w: BufWriter::with_capacity(IO_BUFFER, StallLimit::new(w, shared.conn.write)),
        access: None,
        admit,
        peer_ip,
        unix_fd: fd.filter(|_| transport == Transport::Unix),
        tcp_fd,
        peer: false,
        challenge: [0; auth::AUTH_LEN],
        stamp: 0,
        holds: Holds {
            pool: &shared.pool,
            held: Vec::new(),
        },
        account: shared.ledger.account(),
        watching: None,
        read_buf: Vec::new(),
        class: ReqClass {
            ns: ONE_SIDED_NS,
            priority: Priority::Normal,
            deadline: None,
        },
        bulk_in: None,
        moved_bulk: false,
        token_slot: None,
        staging: None,
        pending: Default::default(),
    };
    let mut hdr = AlignedVec::<16>::new();
    let hello_by = tokio::time::Instant::now() + shared.conn.handshake;
    loop {
        // Until the Hello is accepted: a small header, no payload, one deadline for it all.
        let (limits, deadline) = if conn.access.is_some() {
            // A connection holding objects is a same-host reader's lifeline for its views:
            // closing it for idling would free memory that the reader still maps.
            // So is a watching one: a consumer waits as long as its producer takes. And one that
            // holds a staging area: a writer keeps it open, idle, for as long as it puts.
            let idle = shared.conn.idle.filter(|_| {
                conn.holds.is_empty() && conn.watching.is_none() && conn.staging.is_none()
            });
            (
                &shared.limits,
                idle.map(|d| tokio::time::Instant::now() + d),
            )
        } else {
            (&shared.conn.hello_limits, Some(hello_by))
        };
        if conn.watching.is_some() && conn.r.buffer().is_empty() {
            // Between requests of a watching connection: write its events until the next
            // request's first bytes arrive (filling the read buffer is cancel-safe).
            let next = loop {
                let Some(reg) = conn.watching.as_mut() else {
                    break Ok(());
                };
                // (The shutdown's guard is dropped inside: it must not live across an await.)
                let stop = async {
                    let _ = shutdown.wait_for(|stop| *stop).await;
                };
                tokio::select! {
                    biased;
                    () = stop => break Err(()),
                    ev = reg.rx.recv() => {
                        let Some(ev) = ev else { break Ok(()) };
                        if conn.events(ev).await.is_err() {
                            break Err(());
                        }
                    }
                    r = conn.r.fill_buf() => break match r {
                        Ok(b) if !b.is_empty() => Ok(()),
                        _ => Err(()),
                    },
                }
            };
            if next.is_err() {
                break;
            }
        }
        // Waiting for the next request's first byte: shutdown, the idle policy or the
        // handshake deadline may end it; from that byte on, the request must keep arriving.
        conn.r.get_mut().in_request(false);
        let first = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break,
            b = within(deadline, async { conn.r.fill_buf().await.map(|b| !b.is_empty()) }) => b,
        };
        if !matches!(first, Ok(true)) {
            break;
        }
        conn.r.get_mut().in_request(true);
        let prefix = within(deadline, read_prefix(&mut conn.r, limits)).await;
        let prefix = match prefix {
            Ok(Some(p)) => p,
            Ok(None) | Err(WireError::Io(_)) => break,
            Err(WireError::Frame(e)) => {
                shared.metrics.protocol_error();
                tracing::debug!(error = %e, transport = transport.name(), "closing connection after a bad frame");
                let code = match e {
                    FrameError::HeaderTooLarge(_) | FrameError::PayloadTooLarge(_) => {
                        ErrorCode::FrameTooLarge
                    }
                    _ => ErrorCode::Malformed,
                };
                let _ = conn.fail(0, code, &e.to_string()).await;
                let _ = conn.w.flush().await;
                break;
            }
        };
        if within(deadline, read_header(&mut conn.r, &prefix, &mut hdr))
            .await
            .is_err()
        {
            break;
        }
        match conn.request(&hdr, prefix.payload_len).await {
            Ok(true) => {}
            Ok(false) => {
                let _ = conn.w.flush().await;
                break;
            }
            Err(_) => break,
        }
        if conn.r.buffer().is_empty() && conn.w.flush().await.is_err() {
            break;
        }
    }
    let _ = conn.w.shutdown().await;
    shared.trim.released(conn.buffers() + hdr.capacity() as u64);
    shared.metrics.connection_closed(transport);
}

struct Conn<'a, R, W> {
    s: &'a Shared,
    transport: Transport,
    r: FrameReader<R>,
    w: BufWriter<W>,
    /// The namespaces this connection may use; `None` until its `Hello` is accepted.
    access: Option<Access>,
    /// Until the `Hello` is accepted: tells the reaper that the connection authenticated.
    admit: Option<crate::reaper::Admit>,
    /// The peer's address (wrong tokens are counted per address); None over the Unix socket.
    peer_ip: Option<std::net::IpAddr>,
    /// The Unix socket the connection is on (owned by `r` and `w`), for passing descriptors.
    unix_fd: Option<std::os::fd::RawFd>,
    /// The plain TCP socket the connection is on (owned by `r` and `w`), whose receive
    /// low-water mark is raised while a large payload arrives ([`LowWater`]).
    tcp_fd: Option<std::os::fd::RawFd>,
    /// Proved the cluster secret (`ClusterAuth`): a cluster peer, may gossip and drain.
    peer: bool,
    /// This connection's random challenge, sent in the `Hello` reply.
    challenge: AuthBytes,
    /// The view stamp the request being served was routed by (0: none; see [`Conn::routing`]).
    stamp: u64,
    /// The objects this connection holds (`Hold`); ended when the connection is dropped.
    holds: Holds<'a>,
    /// What this connection holds, in the resource ledger: its holds, watches and pending
    /// allocations, charged as they are taken; settled when the connection is dropped.
    account: crate::ledger::Account,
    /// What this connection watches (`Watch`, `Subscribe`) and its events; ended on drop.
    watching: Option<crate::watch::Registration>,
    /// The buffer one-sided reads are copied into before they are sent (reused).
    read_buf: Vec<u8>,
    /// The request being served: its flow and deadline, for the bulk scheduler.
    class: ReqClass,
    /// The request's incoming payload's turns, when it is bulk.
    bulk_in: Option<Ticket<'a>>,
    /// Whether the request being served moved a bulk payload (either way).
    moved_bulk: bool,
    /// This connection's count under the token it authenticated with
    /// (`limits.max_connections_per_token`); released when the connection is dropped.
    token_slot: Option<crate::admission::TokenSlot>,
    /// The staging area this connection asked for (`Staging`), retired when it closes.
    staging: Option<crate::staging::Held>,
    /// The allocations this connection's `Alloc`s made that may still be pending.
    pending: one_sided::PendingAllocs,
}

/// What the bulk scheduler needs to know of the request being served.
#[derive(Clone, Copy, Debug)]
struct ReqClass {
    /// Its namespace ([`ONE_SIDED_NS`] for access by address).
    ns: u32,
    priority: Priority,
    deadline: Option<tokio::time::Instant>,
}

/// The flow one-sided transfers (by address, no namespace named) are scheduled in.
const ONE_SIDED_NS: u32 = u32::MAX - 1;

impl ReqClass {
    /// What is left of its deadline.
    fn budget(&self) -> Option<std::time::Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(tokio::time::Instant::now()))
    }
}

/// The objects one connection holds, one entry per hold (namespace, key, generation, length);
/// every hold ends when this is dropped, however the connection ends (the connection's
/// [`crate::ledger::Account`] gives their charges back at the same time).
struct Holds<'a> {
    pool: &'a kvpool::Pool,
    held: Vec<(u32, Box<[u8]>, u64, u64)>,
}

impl Holds<'_> {
    fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Ends the last `n` holds taken, crediting their bytes back to `account`.
    fn end_last(&mut self, n: usize, account: &mut crate::ledger::Account) {
        use crate::ledger::Resource;
        let from = self.held.len().saturating_sub(n);
        for (ns, key, generation, len) in self.held.split_off(from) {
            let _ = self.pool.unhold(ns, &key, generation);
            account.release(ns, Resource::HeldBytes, len);
            account.release(ns, Resource::Holds, 1);
        }
    }
}

impl Drop for Holds<'_> {
    fn drop(&mut self) {
        for (ns, key, generation, _) in self.held.drain(..) {
            let _ = self.pool.unhold(ns, &key, generation);
        }
    }
}

/// Ok(true): carry on; Ok(false): close the connection; Err: the stream failed.
type Next = io::Result<bool>;

impl<R, W> Conn<'_, R, W> {
    /// Bytes of heap buffers this connection holds (released when it closes).
    fn buffers(&self) -> u64 {
        let held = self.r.capacity() + IO_BUFFER + self.read_buf.capacity();
        held as u64
    }
}

impl<'a, R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'a, R, W> {
    async fn request(&mut self, hdr: &[u8], payload: u64) -> Next {
        let req = match decode_request(hdr) {
            Ok(r) => r,
            Err(e) => {
                self.s.metrics.protocol_error();
                discard(&mut self.r, payload).await?;
                self.fail(0, ErrorCode::Malformed, &e.to_string()).await?;
                return Ok(true);
            }
        };
        let id = req.id.to_native();
        if self.access.is_none() && !matches!(req.op, ArchivedOp::Hello { .. }) {
            discard(&mut self.r, payload).await?;
            self.fail(
                id,
                ErrorCode::HandshakeRequired,
                "the first request must be Hello",
            )
            .await?;
            return Ok(false);
        }
        let routed = req.view.to_native();
        if routed != 0 && op_namespace(&req.op).is_some() {
            let stamp = self.s.cluster.stamp();
            if routed != stamp {
                discard(&mut self.r, payload).await?;
                let version = self.s.cluster.view().version;
                self.fail(
                    id,
                    ErrorCode::WrongView,
                    &format!("routed by another cluster view; this node is at version {version}"),
                )
                .await?;
                return Ok(true);
            }
        }
        self.stamp = routed;
        let start = Instant::now();
        let deadline_us = req.deadline_us.to_native();
        self.class = ReqClass {
            ns: op_namespace(&req.op).unwrap_or(ONE_SIDED_NS),
            // Whatever a peer asks, the cluster's own traffic is background.
            priority: match self.peer {
                true => Priority::Background,
                false => Priority::from_u8(req.priority),
            },
            deadline: (deadline_us > 0).then(|| {
                tokio::time::Instant::now() + std::time::Duration::from_micros(deadline_us)
            }),
        };
        let (kind, carry_on) = match self.refusal(&req.op, payload) {
            Some((code, message)) => {
                discard(&mut self.r, payload).await?;
                self.fail(id, code, message).await?;
                (OpKind::Admin, true)
            }
            None => match self.admit_payload(payload) {
                Err(message) => {
                    discard(&mut self.r, payload).await?;
                    self.fail(id, ErrorCode::DeadlineUnmeetable, &message)
                        .await?;
                    (op_kind(&req.op), true)
                }
                Ok(ticket) => {
                    self.moved_bulk = ticket.is_some();
                    self.bulk_in = ticket;
                    let r = self.dispatch(id, &req.op, payload).await;
                    self.bulk_in = None;
                    if !self.moved_bulk {
                        // A small request: the worker kept for them stays kept a while.
                        self.s.bulk.served_small();
                    }
                    (op_kind(&req.op), r?)
                }
            },
        };
        self.s.metrics.record(kind, start.elapsed(), carry_on);
        Ok(carry_on)
    }

    /// How the request being served reached this node: routed by a view (stamp not 0), it
    /// reads this node's objects as their owner's (or replica's) copy, so only continuous ones
    /// are served.
    fn routing(&self) -> Routing {
        Routing::of_stamp(self.stamp)
    }

    /// For a read that `missed` something: when it was routed by a view this node has since
    /// left, its misses may be that view change's (nothing was judged by the newer view), so
    /// the client is told `WrongView` to route it again, not that the keys are missing. A
    /// removal done under such a view is answered so too (`missed` true), so the client
    /// removes again by the new view (`Shared::remove_keys`). Returns whether it answered so.
    async fn answered_moved(&mut self, id: u64, missed: bool) -> io::Result<bool> {
        if !missed || !self.s.view_moved(self.routing()) {
            return Ok(false);
        }
        let version = self.s.cluster.view().version;
        let message = format!(
            "the cluster view changed while this was served; this node is at version {version}"
        );
        self.fail(id, ErrorCode::WrongView, &message).await?;
        Ok(true)
    }

    /// Admits a bulk payload of `bytes` of the request being served (`None`: not bulk), or
    /// says why its deadline can't be met.
    fn admit_payload(&self, bytes: u64) -> Result<Option<Ticket<'a>>, String> {
        let bulk: &'a Bulk = &self.s.bulk;
        if !bulk.is_bulk(bytes) {
            return Ok(None);
        }
        let c = self.class;
        match bulk.admit(c.ns, c.priority, bytes, c.budget()) {
            Ok(t) => Ok(Some(t)),
            Err(u) => {
                self.s.metrics.bulk_refused();
                Err(format!(
                    "{bytes} bytes would take about {:?} here, over the {:?} allowed",
                    u.estimate, u.budget
                ))
            }
        }
    }

    /// Receives `dst.len()` payload bytes into `dst` by `deadline`, handing each piece to
    /// `seen` right after it lands (while it is in cache): a bulk payload moves a chunk per
    /// turn of the request's ticket; another yields to the other connections between chunks.
    async fn receive(
        &mut self,
        dst: &mut [u8],
        mut seen: impl FnMut(&[u8]),
        deadline: tokio::time::Instant,
    ) -> Result<io::Result<usize>, tokio::time::error::Elapsed> {
        let mut ticket = self.bulk_in.take();
        let (s, class, r) = (self.s, self.class, &mut self.r);
        let mut water = LowWater::new(self.tcp_fd);
        let receive = async {
            let total = dst.len();
            let (mut done, mut left) = (0, total);
            for chunk in dst.chunks_mut(BULK_CHUNK) {
                let n = chunk.len();
                let pieces = async {
                    for piece in chunk.chunks_mut(RECEIVE_PIECE) {
                        water.read_exact(r, piece, left).await?;
                        left -= piece.len();
                        seen(piece);
                    }
                    Ok::<(), io::Error>(())
                };
                in_turn(s, class, ticket.as_mut(), n, pieces).await?;
                done += n;
                if ticket.is_none() && done < total {
                    tokio::task::yield_now().await;
                }
            }
            water.finish()?;
            Ok(done)
        };
        let read = tokio::time::timeout_at(deadline, receive).await;
        self.bulk_in = ticket;
        read
    }

    /// Hands the operation to its family's method (see the module docs).
    async fn dispatch(&mut self, id: u64, op: &ArchivedOp, payload: u64) -> Next {
        self.settle(op).await;
        let now = self.s.now();
        match op {
            ArchivedOp::Hello {
                version,
                token,
                client,
            } => self.hello(id, version.to_native(), token, client).await,
            ArchivedOp::Stats => self.stats(id).await,
            ArchivedOp::Put {
                ns,
                key,
                checksum,
                pin,
            } => {
                let (key, checksum) = (key.as_slice(), checksum.to_native());
                let item = Item {
                    key,
                    len: payload,
                    checksum,
                };
                self.put(id, ns.to_native(), item, *pin).await
            }
            ArchivedOp::Get { ns, key } => self.get(id, ns.to_native(), key.as_slice(), now).await,
            ArchivedOp::BatchPut {
                ns,
                items,
                pin,
                depths,
            } => {
                let ns = ns.to_native();
                self.batch_put(id, ns, items, (*pin, depths), payload).await
            }
            ArchivedOp::BatchGet { ns, keys, prefix } => {
                self.batch_get(id, ns.to_native(), keys, *prefix, now).await
            }
            ArchivedOp::Exists { ns, keys } => self.exists(id, ns.to_native(), keys).await,
            ArchivedOp::Remove { ns, keys } => self.remove(id, ns.to_native(), keys).await,
            ArchivedOp::Clear { ns } => self.clear(id, ns.to_native()).await,
            ArchivedOp::Scan {
                ns,
                cursor,
                count,
                prefix,
            } => {
                let (ns, cursor, count) = (ns.to_native(), cursor.to_native(), count.to_native());
                self.scan(id, ns, cursor, count, prefix.as_slice()).await
            }
            ArchivedOp::Alloc {
                ns,
                items,
                pin,
                depths,
            } => self.alloc(id, ns.to_native(), items, (*pin, depths)).await,
            ArchivedOp::Write { addr, offset } => {
                self.write(id, addr, offset.to_native(), payload).await
            }
            ArchivedOp::Commit { items } => self.commit(id, items).await,
            ArchivedOp::Abort { addrs } => self.abort(id, addrs).await,
            ArchivedOp::Read { addr, offset, len } => {
                self.read(id, addr, offset.to_native(), len.to_native())
                    .await
            }
            ArchivedOp::MapInfo => self.map_info(id).await,
            ArchivedOp::Staging => self.staging(id).await,
            ArchivedOp::CommitStaged { staging, items } => {
                self.commit_staged(id, staging.to_native(), items).await
            }
            ArchivedOp::Lookup { ns, keys, lease_ms } => {
                let lease_ms = lease_ms.to_native();
                self.lookup(id, ns.to_native(), keys, lease_ms, now).await
            }
            ArchivedOp::Release { ns, keys } => self.release(id, ns.to_native(), keys).await,
            ArchivedOp::Pin { ns, keys, pinned } => {
                self.pin(id, ns.to_native(), keys, *pinned).await
            }
            ArchivedOp::ClusterAuth { nonce, proof } => self.cluster_auth(id, nonce, proof).await,
            ArchivedOp::Gossip { view } => self.gossip(id, view, None).await,
            ArchivedOp::Heartbeat { view, heard } => self.gossip(id, view, Some(heard)).await,
            ArchivedOp::View => self.view(id).await,
            ArchivedOp::Drain => self.drain(id).await,
            ArchivedOp::Vouch { ns, keys } => self.vouch(id, ns.to_native(), keys).await,
            ArchivedOp::Hold { ns, keys } => self.hold(id, ns.to_native(), keys).await,
            ArchivedOp::Watch { ns, keys } => self.watch(id, ns.to_native(), keys, now).await,
            ArchivedOp::Unwatch { ns, keys } => self.unwatch(id, ns.to_native(), keys).await,
            ArchivedOp::Subscribe { ns, prefix } => {
                self.subscribe(id, ns.to_native(), prefix.as_slice()).await
            }
            ArchivedOp::Expire { ns, keys, ttl_ms } => {
                self.expire(id, ns.to_native(), keys, ttl_ms.to_native(), now)
                    .await
            }
            ArchivedOp::Fail { ns, keys, reason } => {
                self.fail_keys(id, ns.to_native(), keys, reason.as_str(), now)
                    .await
            }
            ArchivedOp::Cancel { ns, keys, reason } => {
                self.cancel(id, ns.to_native(), keys, reason.as_str(), now)
                    .await
            }
            ArchivedOp::Move { ns, keys, view } => {
                self.move_keys(id, ns.to_native(), keys, view).await
            }
        }
    }

    /// Before a client's read routed by a view: the pinned objects of keys this node took over
    /// while the cluster settles may still be on their way here, and are asked for first
    /// ([`crate::settle`]). A cluster peer's reads (a mover asking what this node lacks) are
    /// served as they are.
    async fn settle(&mut self, op: &ArchivedOp) {
        if self.peer || self.stamp == 0 || !self.s.cluster.settling() {
            return;
        }
        let (ns, keys): (u32, Vec<&[u8]>) = match op {
            ArchivedOp::Get { ns, key } => (ns.to_native(), vec![key.as_slice()]),
            ArchivedOp::BatchGet { ns, keys, .. }
            | ArchivedOp::Exists { ns, keys }
            | ArchivedOp::Lookup { ns, keys, .. } => {
                (ns.to_native(), keys.iter().map(|k| k.as_slice()).collect())
            }
            _ => return,
        };
        // A batch over the limit is refused as it is.
        if keys.len() <= self.s.limits.max_batch as usize {
            self.s.settle_misses(ns, &keys, self.stamp).await;
        }
    }

    /// Why `op` is refused before it is looked at, if it is: ops that carry no payload refuse
    /// one, and a keyed op needs access to its namespace.
    fn refusal(&self, op: &ArchivedOp, payload: u64) -> Option<(ErrorCode, &'static str)> {
        let payload_ops = matches!(
            op,
            ArchivedOp::Put { .. } | ArchivedOp::BatchPut { .. } | ArchivedOp::Write { .. }
        );
        if !payload_ops && payload > 0 {
            return Some((
                ErrorCode::PayloadMismatch,
                "this operation takes no payload",
            ));
        }
        let ns = op_namespace(op)?;
        let Some(access) = self.access.as_ref().filter(|a| a.allows(ns)) else {
            return Some((ErrorCode::Unauthorized, "not authorised for this namespace"));
        };
        if changes_namespace(op) && !access.writes(ns) {
            return Some((
                ErrorCode::Unauthorized,
                "this token may only read this namespace",
            ));
        }
        None
    }

    /// Counts the `true`s of per-key results, refusing a batch over `max_batch` first.
    fn count(
        &self,
        n: usize,
        results: impl Iterator<Item = Result<bool, PoolError>>,
    ) -> Result<Reply, ErrorCode> {
        self.s.batch_check(n)?;
        let mut c = 0;
        for r in results {
            c += r? as u64;
        }
        Ok(Reply::Count(c))
    }

    /// The digest of the token this connection authenticated with (of the empty token when
    /// none): who may use the staging areas it names. Every non-empty token holds a slot
    /// ([`Conn::token_slot`]) keyed by it.
    fn token_digest(&self) -> [u8; 32] {
        static NONE: std::sync::LazyLock<[u8; 32]> =
            std::sync::LazyLock::new(|| auth::token_digest(b""));
        self.token_slot.as_ref().map_or(*NONE, |s| *s.key())
    }

    /// Replies with `r`'s reply, or fails with its code; carries on either way.
    async fn answer(&mut self, id: u64, r: Result<Reply, ErrorCode>) -> Next {
        match r {
            Ok(reply) => self.reply(id, reply, &[]).await?,
            Err(code) => {
                let message = match code {
                    ErrorCode::BadKey => format!(
                        "BadKey: keys are 1 to {} bytes on this node (limits.max_key_len)",
                        self.s.pool.max_key_len()
                    ),
                    ErrorCode::BatchTooLarge => format!(
                        "BatchTooLarge: at most {} items per request (limits.max_batch)",
                        self.s.limits.max_batch
                    ),
                    _ => format!("{code:?}"),
                };
                self.fail(id, code, &message).await?
            }
        }
        Ok(true)
    }

    /// Fails a request that the resource ledger refused: `LimitExceeded`, naming the setting,
    /// counted on `kvpool_limit_refusals_total`; carries on.
    async fn refused(&mut self, id: u64, r: crate::ledger::Refused) -> Next {
        self.s.metrics.limit_refused(r.limit);
        self.fail(id, ErrorCode::LimitExceeded, &r.to_string())
            .await?;
        Ok(true)
    }

    async fn pool_fail(&mut self, id: u64, e: PoolError) -> io::Result<()> {
        self.fail(id, e.into(), &e.to_string()).await
    }

    async fn fail(&mut self, id: u64, code: ErrorCode, message: &str) -> io::Result<()> {
        self.reply(
            id,
            Reply::Error {
                code: code as u16,
                message: message.to_string(),
            },
            &[],
        )
        .await
    }

    /// Writes `first` and every other event already queued (and a `Lagged` event when some
    /// were dropped), then flushes.
    async fn events(&mut self, first: crate::watch::Event) -> io::Result<()> {
        let mut next = Some(first);
        while let Some(ev) = next {
            let reply = Reply::Event {
                ns: ev.ns,
                key: ev.key.into_vec(),
                code: ev.code as u16,
                reason: ev.reason,
            };
            self.reply(kvpool::protocol::EVENT_ID, reply, &[]).await?;
            next = self.watching.as_mut().and_then(|r| r.rx.try_recv().ok());
        }
        if self.watching.as_ref().is_some_and(|r| r.take_lagged()) {
            let reply = Reply::Event {
                ns: 0,
                key: Vec::new(),
                code: ErrorCode::Lagged as u16,
                reason: String::new(),
            };
            self.reply(kvpool::protocol::EVENT_ID, reply, &[]).await?;
        }
        self.w.flush().await
    }

    /// Writes a response. A bulk payload (`[limits] bulk_threshold` and up) is admitted by the
    /// bulk scheduler first — refused with `DeadlineUnmeetable` instead when its deadline can't
    /// be met — then goes out [`BULK_CHUNK`] bytes at a time, each chunk in its turn; any other
    /// payload over a chunk goes out a chunk at a time with a yield between, so a small request
    /// on another connection waits behind at most one chunk of this one for a worker thread.
    async fn reply(&mut self, id: u64, reply: Reply, payload: &[&[u8]]) -> io::Result<()> {
        let total: usize = payload.iter().map(|p| p.len()).sum();
        let mut ticket = match self.admit_payload(total as u64) {
            Ok(t) => {
                self.moved_bulk |= t.is_some();
                t
            }
            Err(message) => {
                return Box::pin(self.fail(id, ErrorCode::DeadlineUnmeetable, &message)).await
            }
        };
        let hdr = encode(&Response { id, reply });
        if total <= BULK_CHUNK && ticket.is_none() {
            return write_frame(&mut self.w, &hdr, payload).await;
        }
        let prefix = kvpool::protocol::FramePrefix {
            header_len: hdr.len() as u32,
            payload_len: total as u64,
        }
        .encode();
        // The payload in chunks of at most BULK_CHUNK bytes, each one vectored write (a batch
        // of small values goes out in one turn, not one per value); the frame's prefix and
        // header lead the first.
        let mut lead = Some([IoSlice::new(&prefix), IoSlice::new(&hdr)]);
        let mut chunks = Chunks::new(payload, BULK_CHUNK);
        while let Some((mut bufs, bytes)) = chunks.next_chunk() {
            if let Some(lead) = lead.take() {
                bufs.splice(0..0, lead);
            }
            let write = write_all_vectored(&mut self.w, &mut bufs);
            in_turn(self.s, self.class, ticket.as_mut(), bytes, write).await?;
            if ticket.is_none() {
                tokio::task::yield_now().await;
            }
        }
        match lead {
            // An empty payload: the frame is its prefix and header.
            Some(mut lead) => write_all_vectored(&mut self.w, &mut lead).await,
            None => Ok(()),
        }
    }
}

/// Cuts a payload of slices into chunks of at most `max` bytes, each a list of slices to write
/// in one vectored write.
struct Chunks<'p> {
    rest: &'p [&'p [u8]],
    /// How far into `rest[0]` the next chunk starts.
    at: usize,
    max: usize,
}

impl<'p> Chunks<'p> {
    fn new(payload: &'p [&'p [u8]], max: usize) -> Self {
        Chunks {
            rest: payload,
            at: 0,
            max: max.max(1),
        }
    }

    /// The next chunk and its length; `None` when the payload has been cut up.
    fn next_chunk(&mut self) -> Option<(Vec<IoSlice<'p>>, usize)> {
        let mut bufs = Vec::new();
        let mut len = 0;
        while let Some(&first) = self.rest.first() {
            let piece = &first[self.at..];
            let take = piece.len().min(self.max - len);
            if take > 0 {
                bufs.push(IoSlice::new(&piece[..take]));
                len += take;
            }
            if take == piece.len() {
                self.rest = &self.rest[1..];
                self.at = 0;
            } else {
                self.at += take;
            }
            if len == self.max {
                break;
            }
        }
        (len > 0).then_some((bufs, len))
    }
}

/// Moves one chunk of `bytes` (`io`) of the request of `class`: in its bulk turn when it has
/// a `ticket`, otherwise at once (the caller yields between chunks).
async fn in_turn<'a, T>(
    s: &'a Shared,
    class: ReqClass,
    ticket: Option<&mut Ticket<'a>>,
    bytes: usize,
    io: impl std::future::Future<Output = T>,
) -> T {
    match ticket {
        Some(t) => {
            let grant = t.chunk(bytes as u64).await;
            s.metrics.bulk_chunk(class.priority, bytes as u64);
            crate::bulk::under(grant, s.bulk.hold(), io).await
        }
        None => io.await,
    }
}

/// What an operation counts as in the metrics.
fn op_kind(op: &ArchivedOp) -> OpKind {
    match op {
        ArchivedOp::Hello { .. } => OpKind::Hello,
        ArchivedOp::Put { .. } => OpKind::Put,
        ArchivedOp::Get { .. } => OpKind::Get,
        ArchivedOp::BatchPut { .. } => OpKind::BatchPut,
        ArchivedOp::BatchGet { .. } => OpKind::BatchGet,
        ArchivedOp::Exists { .. } => OpKind::Exists,
        ArchivedOp::Remove { .. } | ArchivedOp::Clear { .. } => OpKind::Remove,
        ArchivedOp::Alloc { .. } => OpKind::Alloc,
        ArchivedOp::Write { .. } => OpKind::Write,
        ArchivedOp::Commit { .. } | ArchivedOp::CommitStaged { .. } => OpKind::Commit,
        ArchivedOp::Abort { .. } => OpKind::Abort,
        ArchivedOp::Read { .. } => OpKind::Read,
        ArchivedOp::Lookup { .. } | ArchivedOp::Vouch { .. } | ArchivedOp::Hold { .. } => {
            OpKind::Lookup
        }
        ArchivedOp::Release { .. } => OpKind::Release,
        ArchivedOp::Watch { .. } | ArchivedOp::Unwatch { .. } | ArchivedOp::Subscribe { .. } => {
            OpKind::Exists
        }
        ArchivedOp::Fail { .. } | ArchivedOp::Expire { .. } | ArchivedOp::Cancel { .. } => {
            OpKind::Remove
        }
        ArchivedOp::Pin { .. } => OpKind::Pin,
        ArchivedOp::Scan { .. } => OpKind::Scan,
        ArchivedOp::Stats
        | ArchivedOp::View
        | ArchivedOp::MapInfo
        | ArchivedOp::Staging
        | ArchivedOp::ClusterAuth { .. }
        | ArchivedOp::Gossip { .. }
        | ArchivedOp::Heartbeat { .. }
        | ArchivedOp::Move { .. }
        | ArchivedOp::Drain => OpKind::Admin,
    }
}

/// Whether an operation changes its namespace (a read-only token may not send it).
fn changes_namespace(op: &ArchivedOp) -> bool {
    matches!(
        op,
        ArchivedOp::Put { .. }
            | ArchivedOp::BatchPut { .. }
            | ArchivedOp::Alloc { .. }
            | ArchivedOp::Remove { .. }
            | ArchivedOp::Clear { .. }
            | ArchivedOp::Pin { .. }
            | ArchivedOp::Expire { .. }
            | ArchivedOp::Fail { .. }
            | ArchivedOp::Cancel { .. }
            | ArchivedOp::Move { .. }
    )
}

/// The namespace an operation names, for authorisation.
fn op_namespace(op: &ArchivedOp) -> Option<u32> {
    match op {
        ArchivedOp::Put { ns, .. }
        | ArchivedOp::Get { ns, .. }
        | ArchivedOp::BatchPut { ns, .. }
        | ArchivedOp::BatchGet { ns, .. }
        | ArchivedOp::Exists { ns, .. }
        | ArchivedOp::Remove { ns, .. }
        | ArchivedOp::Clear { ns }
        | ArchivedOp::Scan { ns, .. }
        | ArchivedOp::Alloc { ns, .. }
        | ArchivedOp::Lookup { ns, .. }
        | ArchivedOp::Hold { ns, .. }
        | ArchivedOp::Watch { ns, .. }
        | ArchivedOp::Unwatch { ns, .. }
        | ArchivedOp::Subscribe { ns, .. }
        | ArchivedOp::Fail { ns, .. }
        | ArchivedOp::Cancel { ns, .. }
        | ArchivedOp::Expire { ns, .. }
        | ArchivedOp::Vouch { ns, .. }
        | ArchivedOp::Move { ns, .. }
        | ArchivedOp::Release { ns, .. }
        | ArchivedOp::Pin { ns, .. } => Some(ns.to_native()),
        _ => None,
    }
}

/// Why reading a payload into a pending allocation failed, if it did: a socket error, or the
/// allocation's deadline (`pending_timeout_ms`) passing before the last byte came. Either way the
/// caller releases the allocation and closes the connection, so a stalled payload never keeps
/// memory pending past its timeout.
fn payload_failure(
    read: Result<io::Result<usize>, tokio::time::error::Elapsed>,
) -> Option<io::Error> {
    match read {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(e),
        Err(_) => Some(io::Error::new(
            io::ErrorKind::TimedOut,
            "payload not received before its allocation's deadline",
        )),
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::Chunks;

    /// Every byte once, in order; every chunk full but the last.
    #[test]
    fn chunks_cut_a_payload_into_full_pieces_in_order() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut seed = 0x9e37_79b9_u64;
        for _ in 0..500 {
            // A random cut of `data` into slices, some empty.
            let mut cuts = Vec::new();
            let mut at = 0;
            while at < data.len() {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let n = ((seed >> 33) % 3000) as usize * ((seed >> 20) % 4 != 0) as usize;
                let n = n.min(data.len() - at);
                cuts.push(&data[at..at + n]);
                at += n;
            }
            let max = 1 + ((seed >> 40) % 4000) as usize;
            let mut chunks = Chunks::new(&cuts, max);
            let mut got = Vec::new();
            let mut lens = Vec::new();
            while let Some((bufs, len)) = chunks.next_chunk() {
                assert_eq!(bufs.iter().map(|b| b.len()).sum::<usize>(), len);
                assert!(bufs.iter().all(|b| !b.is_empty()));
                bufs.iter().for_each(|b| got.extend_from_slice(b));
                lens.push(len);
            }
            assert!(got == data, "bytes lost, repeated or reordered");
            let (last, full) = lens.split_last().unwrap();
            assert!(full.iter().all(|&l| l == max) && *last <= max && *last > 0);
        }
        assert!(Chunks::new(&[&[][..], &[]], 8).next_chunk().is_none());
    }
}
