//! One connection's state (`Conn`) and what every family of operations uses: the request's
//! checks (handshake, view stamp, namespace, refusals), its class for the bulk scheduler, the
//! payload received in turn, and the replies and errors written back.

use std::io::{self, IoSlice};
use std::time::Instant;

use kvpool::protocol::auth::{self, AuthBytes};
use kvpool::protocol::io::{discard, write_all_vectored, write_frame, FrameReader, LowWater};
use kvpool::protocol::{decode_request, encode, ArchivedOp, ErrorCode, Priority, Reply, Response};
use kvpool::PoolError;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};

use super::held::Holdings;
use crate::bulk::{Bulk, Ticket};
use crate::metrics::{OpKind, Transport};
use crate::service::{Access, Routing, Shared};

/// The read and write buffers of an authenticated connection.
pub(super) const IO_BUFFER: usize = 64 << 10;

/// The read buffer until the `Hello` is accepted: room for a `Hello` frame, so that
/// connections that never authenticate hold little (a larger `Hello` is read past it).
pub(super) const HELLO_BUFFER: usize = 4 << 10;

/// Bytes of a large payload sent or received between two yields to the runtime (see
/// [`Conn::reply`] and the put path): the most a latency request waits behind a bulk transfer
/// on a worker thread.
pub(crate) const BULK_CHUNK: usize = 1 << 20;

/// Bytes of a payload received at a time before they are looked at (hashed while in cache).
const RECEIVE_PIECE: usize = 256 << 10;

/// One connection: its stream, who is on the other end, the request being served and what
/// the connection holds.
pub(super) struct Conn<'a, R, W> {
    pub(super) s: &'a Shared,
    pub(super) transport: Transport,
    pub(super) r: FrameReader<R>,
    pub(super) w: BufWriter<W>,
    /// Who the peer is and what it may do.
    pub(super) session: Session,
    /// The sockets under the stream.
    pub(super) fds: Fds,
    /// The request being served.
    pub(super) req: Serving<'a>,
    /// What the connection holds; released when it closes.
    pub(super) held: Holdings<'a>,
    /// The buffer one-sided reads are copied into before they are sent (reused).
    pub(super) read_buf: Vec<u8>,
}

/// Who is on the other end of a connection, and what it may do.
pub(super) struct Session {
    /// The namespaces this connection may use; `None` until its `Hello` is accepted.
    pub(super) access: Option<Access>,
    /// Until the `Hello` is accepted: tells the reaper that the connection authenticated.
    pub(super) admit: Option<crate::reaper::Admit>,
    /// The peer's address (wrong tokens are counted per address); None over the Unix socket.
    pub(super) peer_ip: Option<std::net::IpAddr>,
    /// Proved the cluster secret (`ClusterAuth`): a cluster peer, may gossip and drain.
    pub(super) peer: bool,
    /// This connection's random challenge, sent in the `Hello` reply.
    pub(super) challenge: AuthBytes,
    /// The protocol version the connection speaks (asked for in its `Hello`; 0 before).
    pub(super) version: u32,
    /// This connection's count under the token it authenticated with
    /// (`limits.max_connections_per_token`); released when the connection is dropped.
    pub(super) token_slot: Option<crate::admission::TokenSlot>,
}

/// The sockets a connection's stream is on, where the transport has one.
pub(super) struct Fds {
    /// The Unix socket the connection is on (owned by `r` and `w`), for passing descriptors.
    pub(super) unix: Option<std::os::fd::RawFd>,
    /// The plain TCP socket the connection is on (owned by `r` and `w`), whose receive
    /// low-water mark is raised while a large payload arrives ([`LowWater`]).
    pub(super) tcp: Option<std::os::fd::RawFd>,
}

/// The request being served.
pub(super) struct Serving<'a> {
    /// The view stamp it was routed by (0: none; see [`Conn::routing`]).
    pub(super) stamp: u64,
    /// Its flow and deadline, for the bulk scheduler.
    pub(super) class: ReqClass,
    /// Its incoming payload's turns, when it is bulk.
    pub(super) bulk_in: Option<Ticket<'a>>,
    /// Whether it moved a bulk payload (either way).
    pub(super) moved_bulk: bool,
}

/// What the bulk scheduler needs to know of the request being served.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReqClass {
    /// Its namespace ([`ONE_SIDED_NS`] for access by address).
    pub(super) ns: u32,
    pub(super) priority: Priority,
    pub(super) deadline: Option<tokio::time::Instant>,
}

/// The flow one-sided transfers (by address, no namespace named) are scheduled in.
pub(super) const ONE_SIDED_NS: u32 = u32::MAX - 1;

impl ReqClass {
    /// What is left of its deadline.
    pub(super) fn budget(&self) -> Option<std::time::Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(tokio::time::Instant::now()))
    }
}

/// Ok(true): carry on; Ok(false): close the connection; Err: the stream failed.
pub(super) type Next = io::Result<bool>;

impl<R, W> Conn<'_, R, W> {
    /// Bytes of heap buffers this connection holds (released when it closes).
    pub(super) fn buffers(&self) -> u64 {
        let held = self.r.capacity() + IO_BUFFER + self.read_buf.capacity();
        held as u64
    }
}

impl<'a, R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'a, R, W> {
    pub(super) async fn request(&mut self, hdr: &[u8], payload: u64) -> Next {
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
        if self.session.access.is_none() && !matches!(req.op, ArchivedOp::Hello { .. }) {
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
        self.req.stamp = routed;
        let start = Instant::now();
        let deadline_us = req.deadline_us.to_native();
        self.req.class = ReqClass {
            ns: op_namespace(&req.op).unwrap_or(ONE_SIDED_NS),
            // Whatever a peer asks, the cluster's own traffic is background.
            priority: match self.session.peer {
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
                    self.req.moved_bulk = ticket.is_some();
                    self.req.bulk_in = ticket;
                    let r = self.dispatch(id, &req.op, payload).await;
                    self.req.bulk_in = None;
                    if !self.req.moved_bulk {
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
    pub(super) fn routing(&self) -> Routing {
        Routing::of_stamp(self.req.stamp)
    }

    /// For a read that `missed` something: when it was routed by a view this node has since
    /// left, its misses may be that view change's (nothing was judged by the newer view), so
    /// the client is told `WrongView` to route it again, not that the keys are missing. A
    /// removal done under such a view is answered so too (`missed` true), so the client
    /// removes again by the new view (`Shared::remove_keys`). Returns whether it answered so.
    pub(super) async fn answered_moved(&mut self, id: u64, missed: bool) -> io::Result<bool> {
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
    pub(super) fn admit_payload(&self, bytes: u64) -> Result<Option<Ticket<'a>>, String> {
        let bulk: &'a Bulk = &self.s.bulk;
        if !bulk.is_bulk(bytes) {
            return Ok(None);
        }
        let c = self.req.class;
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
    pub(super) async fn receive(
        &mut self,
        dst: &mut [u8],
        mut seen: impl FnMut(&[u8]),
        deadline: tokio::time::Instant,
    ) -> Result<io::Result<usize>, tokio::time::error::Elapsed> {
        let mut ticket = self.req.bulk_in.take();
        let (s, class, r) = (self.s, self.req.class, &mut self.r);
        let mut water = LowWater::new(self.fds.tcp);
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
        self.req.bulk_in = ticket;
        read
    }

    /// Before a client's read routed by a view: the pinned objects of keys this node took over
    /// while the cluster settles may still be on their way here, and are asked for first
    /// ([`crate::settle`]). A cluster peer's reads (a mover asking what this node lacks) are
    /// served as they are.
    pub(super) async fn settle(&mut self, op: &ArchivedOp) {
        if self.session.peer || self.req.stamp == 0 || !self.s.cluster.settling() {
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
        if keys.len() <= self.s.conn.limits.max_batch as usize {
            self.s.settle_misses(ns, &keys, self.req.stamp).await;
        }
    }

    /// Why `op` is refused before it is looked at, if it is: ops that carry no payload refuse
    /// one, and a keyed op needs access to its namespace.
    pub(super) fn refusal(
        &self,
        op: &ArchivedOp,
        payload: u64,
    ) -> Option<(ErrorCode, &'static str)> {
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
        let Some(access) = self.session.access.as_ref().filter(|a| a.allows(ns)) else {
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
    pub(super) fn count(
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
    /// ([`Session::token_slot`]) keyed by it.
    pub(super) fn token_digest(&self) -> [u8; 32] {
        static NONE: std::sync::LazyLock<[u8; 32]> =
            std::sync::LazyLock::new(|| auth::token_digest(b""));
        self.session.token_slot.as_ref().map_or(*NONE, |s| *s.key())
    }

    /// Replies with `r`'s reply, or fails with its code; carries on either way.
    pub(super) async fn answer(&mut self, id: u64, r: Result<Reply, ErrorCode>) -> Next {
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
                        self.s.conn.limits.max_batch
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
    pub(super) async fn refused(&mut self, id: u64, r: crate::ledger::Refused) -> Next {
        self.s.metrics.limit_refused(r.limit);
        self.fail(id, ErrorCode::LimitExceeded, &r.to_string())
            .await?;
        Ok(true)
    }

    pub(super) async fn pool_fail(&mut self, id: u64, e: PoolError) -> io::Result<()> {
        self.fail(id, e.into(), &e.to_string()).await
    }

    pub(super) async fn fail(&mut self, id: u64, code: ErrorCode, message: &str) -> io::Result<()> {
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
    pub(super) async fn events(&mut self, first: crate::watch::Event) -> io::Result<()> {
        let mut next = Some(first);
        while let Some(ev) = next {
            let reply = Reply::Event {
                ns: ev.ns,
                key: ev.key.into_vec(),
                code: ev.code as u16,
                reason: ev.reason,
            };
            self.reply(kvpool::protocol::EVENT_ID, reply, &[]).await?;
            next = self
                .held
                .watching
                .as_mut()
                .and_then(|r| r.rx.try_recv().ok());
        }
        if self.held.watching.as_ref().is_some_and(|r| r.take_lagged()) {
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
    pub(super) async fn reply(
        &mut self,
        id: u64,
        reply: Reply,
        payload: &[&[u8]],
    ) -> io::Result<()> {
        let total: usize = payload.iter().map(|p| p.len()).sum();
        let mut ticket = match self.admit_payload(total as u64) {
            Ok(t) => {
                self.req.moved_bulk |= t.is_some();
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
            in_turn(self.s, self.req.class, ticket.as_mut(), bytes, write).await?;
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
    pub(super) fn new(payload: &'p [&'p [u8]], max: usize) -> Self {
        Chunks {
            rest: payload,
            at: 0,
            max: max.max(1),
        }
    }

    /// The next chunk and its length; `None` when the payload has been cut up.
    pub(super) fn next_chunk(&mut self) -> Option<(Vec<IoSlice<'p>>, usize)> {
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
pub(super) async fn in_turn<'a, T>(
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
pub(super) fn op_kind(op: &ArchivedOp) -> OpKind {
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
        ArchivedOp::Watch { .. }
        | ArchivedOp::Unwatch { .. }
        | ArchivedOp::Subscribe { .. }
        | ArchivedOp::KvEvents { .. } => OpKind::Exists,
        ArchivedOp::Fail { .. } | ArchivedOp::Expire { .. } | ArchivedOp::Cancel { .. } => {
            OpKind::Remove
        }
        ArchivedOp::Pin { .. } => OpKind::Pin,
        ArchivedOp::Scan { .. } => OpKind::Scan,
        ArchivedOp::Stats
        | ArchivedOp::DiskStats
        | ArchivedOp::Traffic
        | ArchivedOp::View
        | ArchivedOp::MapInfo
        | ArchivedOp::FabricInfo
        | ArchivedOp::Staging
        | ArchivedOp::ClusterAuth { .. }
        | ArchivedOp::Gossip { .. }
        | ArchivedOp::Heartbeat { .. }
        | ArchivedOp::Move { .. }
        | ArchivedOp::Drain => OpKind::Admin,
    }
}

/// Whether an operation changes its namespace (a read-only token may not send it).
pub(super) fn changes_namespace(op: &ArchivedOp) -> bool {
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
pub(super) fn op_namespace(op: &ArchivedOp) -> Option<u32> {
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
        | ArchivedOp::KvEvents { ns, .. }
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
pub(super) fn payload_failure(
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
    pub(super) fn chunks_cut_a_payload_into_full_pieces_in_order() {
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
