//! One connection (or one QUIC stream): read a frame, do what it asks, answer; repeat.
//!
//! Requests are answered in the order they arrive, each tagged with its id, so a client may
//! pipeline as many as it likes; responses are flushed when no further request is already
//! buffered. Every request consumes exactly its payload, even when it fails, so one bad request
//! never desynchronises the stream. A frame that breaks the protocol itself (bad magic, a header
//! over the limit) is answered with an error and the connection is closed: after it nothing on
//! the stream can be trusted.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use kvpool::protocol::auth::{self, AuthBytes, ClusterSecret};
use kvpool::protocol::io::{discard, read_header, read_prefix, write_frame, WireError};
use kvpool::protocol::AlignedVec;
use kvpool::protocol::{
    decode_request, encode, AllocResult, ArchivedOp, ErrorCode, FrameError, HelloInfo, Limits,
    LocatedWire, Reply, Response, SegmentMap, ValueMeta, PROTOCOL_VERSION,
};
use kvpool::{GlobalAddr, Millis, Pool, PoolError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::watch;

use crate::cluster::Membership;
use crate::deadline::{within, ConnPolicy, StallLimit};
use crate::metrics::{Metrics, OpKind, Transport};

/// What every connection shares.
pub(crate) struct Shared {
    pub(crate) pool: Arc<Pool>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) limits: Limits,
    pub(crate) token: String,
    /// Per namespace id, the tokens that may use it (empty: every accepted client).
    pub(crate) ns_tokens: Vec<Vec<String>>,
    pub(crate) started: Instant,
    pub(crate) hello: HelloInfo,
    pub(crate) cluster: Arc<Membership>,
    /// Proves cluster peers (`ClusterAuth`): only they may gossip, drain and move objects.
    pub(crate) cluster_secret: ClusterSecret,
    /// Limits before the handshake and the timeouts of every stage of a connection.
    pub(crate) conn: ConnPolicy,
}

impl Shared {
    fn now(&self) -> Millis {
        self.started.elapsed().as_millis() as Millis
    }

    /// The instant `at` on the pool's clock (milliseconds since `started`).
    fn instant_at(&self, at: Millis) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.started + std::time::Duration::from_millis(at))
    }
}

const IO_BUFFER: usize = 64 << 10;

/// Serves one connection until the peer leaves, the protocol breaks, or shutdown is signalled
/// while the connection is idle between requests.
pub(crate) async fn serve<R, W>(
    shared: Arc<Shared>,
    transport: Transport,
    r: R,
    w: W,
    mut shutdown: watch::Receiver<bool>,
) where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    shared.metrics.connection_opened(transport);
    let mut conn = Conn {
        s: &shared,
        transport,
        r: BufReader::with_capacity(IO_BUFFER, r),
        // A reply the peer stops reading fails the connection, releasing what it referenced.
        w: BufWriter::with_capacity(IO_BUFFER, StallLimit::new(w, shared.conn.write)),
        greeted: false,
        peer: false,
        challenge: [0; auth::AUTH_LEN],
        allowed: Vec::new(),
        routed: false,
    };
    let mut hdr = AlignedVec::<16>::new();
    let hello_by = tokio::time::Instant::now() + shared.conn.handshake;
    loop {
        // Until the Hello is accepted: a small header, no payload, one deadline for it all.
        let (limits, deadline) = if conn.greeted {
            let idle = shared.conn.idle;
            (
                &shared.limits,
                idle.map(|d| tokio::time::Instant::now() + d),
            )
        } else {
            (&shared.conn.hello_limits, Some(hello_by))
        };
        let prefix = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break,
            p = within(deadline, read_prefix(&mut conn.r, limits)) => p,
        };
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
    shared.metrics.connection_closed(transport);
}

struct Conn<'a, R, W> {
    s: &'a Shared,
    transport: Transport,
    r: BufReader<R>,
    w: BufWriter<W>,
    greeted: bool,
    /// Proved the cluster secret (`ClusterAuth`): a cluster peer, may gossip and drain.
    peer: bool,
    /// This connection's random challenge, sent in the `Hello` reply.
    challenge: AuthBytes,
    /// Per namespace id: may this connection use it (set by the handshake).
    allowed: Vec<bool>,
    /// The request being served was routed by a view (stamp not 0): it reads this node's
    /// objects as their owner's (or replica's) copy, so only continuous ones are served.
    routed: bool,
}

/// Ok(true): carry on; Ok(false): close the connection; Err: the stream failed.
type Next = io::Result<bool>;

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
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
        if !self.greeted && !matches!(req.op, ArchivedOp::Hello { .. }) {
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
        self.routed = routed != 0;
        let start = Instant::now();
        let (kind, outcome) = self.dispatch(id, &req.op, payload).await?;
        self.s
            .metrics
            .record(kind, start.elapsed(), outcome.is_ok());
        match outcome {
            Ok(()) => Ok(true),
            Err(Close) => Ok(false),
        }
    }

    async fn dispatch(
        &mut self,
        id: u64,
        op: &ArchivedOp,
        payload: u64,
    ) -> io::Result<(OpKind, Result<(), Close>)> {
        let pool = &*self.s.pool;
        let now = self.s.now();
        let max_batch = self.s.limits.max_batch as usize;
        // Ops that carry no payload drain any they were sent and refuse.
        let payload_ops = matches!(
            op,
            ArchivedOp::Put { .. } | ArchivedOp::BatchPut { .. } | ArchivedOp::Write { .. }
        );
        if !payload_ops && payload > 0 {
            discard(&mut self.r, payload).await?;
            self.fail(
                id,
                ErrorCode::PayloadMismatch,
                "this operation takes no payload",
            )
            .await?;
            return Ok((OpKind::Admin, Ok(())));
        }
        if let Some(ns) = op_namespace(op) {
            if !self.allowed.get(ns as usize).copied().unwrap_or(true) {
                discard(&mut self.r, payload).await?;
                self.fail(
                    id,
                    ErrorCode::Unauthorized,
                    "not authorised for this namespace",
                )
                .await?;
                return Ok((OpKind::Admin, Ok(())));
            }
        }
        let kind = match op {
            ArchivedOp::Hello {
                version,
                token,
                client,
            } => {
                if version.to_native() != PROTOCOL_VERSION {
                    self.fail(
                        id,
                        ErrorCode::UnsupportedVersion,
                        &format!("this node speaks protocol {PROTOCOL_VERSION}"),
                    )
                    .await?;
                    return Ok((OpKind::Hello, Err(Close)));
                }
                // The node's token admits to every namespace; a namespace token to its own
                // namespaces and the open ones (those without tokens).
                let token = token.as_str();
                let admin = !self.s.token.is_empty() && token == self.s.token;
                let ns_token = self
                    .s
                    .ns_tokens
                    .iter()
                    .any(|ts| ts.iter().any(|t| t == token));
                if !(self.s.token.is_empty() || admin || ns_token) {
                    self.fail(id, ErrorCode::Unauthorized, "wrong or missing auth token")
                        .await?;
                    return Ok((OpKind::Hello, Err(Close)));
                }
                self.allowed = self
                    .s
                    .ns_tokens
                    .iter()
                    .map(|ts| ts.is_empty() || admin || ts.iter().any(|t| t == token))
                    .collect();
                tracing::debug!(
                    client = client.as_str(),
                    transport = self.transport.name(),
                    "client connected"
                );
                self.challenge = match auth::random() {
                    Ok(c) => c,
                    Err(e) => {
                        self.fail(id, ErrorCode::Internal, &e.to_string()).await?;
                        return Ok((OpKind::Hello, Err(Close)));
                    }
                };
                self.greeted = true;
                let mut hello = self.s.hello.clone();
                hello.challenge = self.challenge;
                hello
                    .namespaces
                    .retain(|(_, id)| self.allowed[*id as usize]);
                hello.replication.retain(|r| self.allowed[r.ns as usize]);
                hello.view = self.s.cluster.view();
                self.reply(id, Reply::Hello(hello), &[]).await?;
                OpKind::Hello
            }
            ArchivedOp::Put {
                ns,
                key,
                checksum,
                pin,
            } => {
                let r = self
                    .put_one(
                        ns.to_native(),
                        key.as_slice(),
                        payload,
                        checksum.to_native(),
                        *pin,
                        0,
                        now,
                    )
                    .await?;
                self.s.metrics.bytes(payload, 0);
                self.answer(id, r.map(|()| Reply::Done)).await?;
                OpKind::Put
            }
            ArchivedOp::Get { ns, key } => {
                let got = pool
                    .get_ref(ns.to_native(), key.as_slice(), now)
                    .and_then(|obj| self.fresh(ns.to_native(), key.as_slice(), obj));
                match got {
                    Ok(obj) => {
                        let bytes = obj.bytes();
                        let reply = Reply::Value {
                            len: bytes.len() as u64,
                            checksum: obj.checksum(),
                        };
                        self.reply(id, reply, &[bytes]).await?;
                        self.s.metrics.bytes(0, bytes.len() as u64);
                    }
                    Err(e) => self.pool_fail(id, e).await?,
                }
                OpKind::Get
            }
            ArchivedOp::BatchPut {
                ns,
                items,
                pin,
                depths,
            } => {
                let total: Option<u64> = items
                    .iter()
                    .try_fold(0u64, |acc, i| acc.checked_add(i.len.to_native()));
                if items.len() > max_batch || total != Some(payload) {
                    discard(&mut self.r, payload).await?;
                    let (code, msg) = if items.len() > max_batch {
                        (ErrorCode::BatchTooLarge, "too many items")
                    } else {
                        (
                            ErrorCode::PayloadMismatch,
                            "payload length is not the sum of the item lengths",
                        )
                    };
                    self.fail(id, code, msg).await?;
                    return Ok((OpKind::BatchPut, Ok(())));
                }
                let mut statuses = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let depth = depths.get(i).map_or(0, |d| d.to_native());
                    let r = self
                        .put_one(
                            ns.to_native(),
                            item.key.as_slice(),
                            item.len.to_native(),
                            item.checksum.to_native(),
                            *pin,
                            depth,
                            now,
                        )
                        .await?;
                    statuses.push(r.err().map_or(0, |c| c as u16));
                }
                self.s.metrics.bytes(payload, 0);
                self.reply(id, Reply::Statuses(statuses), &[]).await?;
                OpKind::BatchPut
            }
            ArchivedOp::BatchGet { ns, keys, prefix } => {
                if keys.len() > max_batch {
                    self.fail(id, ErrorCode::BatchTooLarge, "too many keys")
                        .await?;
                    return Ok((OpKind::BatchGet, Ok(())));
                }
                let ns = ns.to_native();
                let mut refs = Vec::with_capacity(keys.len());
                let mut gap = false;
                for key in keys.iter() {
                    if gap {
                        // After a gap a prefix block is useless: don't send it.
                        refs.push(None);
                        continue;
                    }
                    match pool
                        .get_ref(ns, key.as_slice(), now)
                        .and_then(|r| self.fresh(ns, key.as_slice(), r))
                    {
                        Ok(r) => refs.push(Some(r)),
                        Err(PoolError::NotFound) => {
                            gap = *prefix;
                            refs.push(None);
                        }
                        Err(e) => {
                            drop(refs);
                            self.pool_fail(id, e).await?;
                            return Ok((OpKind::BatchGet, Ok(())));
                        }
                    }
                }
                let metas = refs
                    .iter()
                    .map(|r| {
                        r.as_ref().map(|r| ValueMeta {
                            len: r.bytes().len() as u64,
                            checksum: r.checksum(),
                        })
                    })
                    .collect();
                let slices: Vec<&[u8]> = refs.iter().flatten().map(|r| r.bytes()).collect();
                let out: u64 = slices.iter().map(|s| s.len() as u64).sum();
                self.reply(id, Reply::Values(metas), &slices).await?;
                self.s.metrics.bytes(0, out);
                OpKind::BatchGet
            }
            ArchivedOp::Exists { ns, keys } => {
                let r = self.batch_check(keys.len()).and_then(|()| {
                    pool.exists_prefix(ns.to_native(), keys.iter().map(|k| k.as_slice()))
                        .map(|n| {
                            // The run ends at the first object not served as the owner's.
                            keys.iter()
                                .take(n)
                                .position(|k| !self.fresh_key(ns.to_native(), k.as_slice()))
                                .unwrap_or(n)
                        })
                        .map_err(Into::into)
                });
                self.answer(id, r.map(|n| Reply::Count(n as u64))).await?;
                OpKind::Exists
            }
            ArchivedOp::Remove { ns, keys } => {
                let r = self.count(
                    keys.len(),
                    keys.iter().map(|k| {
                        self.s.cluster.note_write(ns.to_native(), k.as_slice());
                        pool.remove(ns.to_native(), k.as_slice())
                    }),
                );
                self.answer(id, r).await?;
                OpKind::Remove
            }
            ArchivedOp::Alloc {
                ns,
                items,
                pin,
                depths,
            } => {
                if items.len() > max_batch {
                    self.fail(id, ErrorCode::BatchTooLarge, "too many items")
                        .await?;
                    return Ok((OpKind::Alloc, Ok(())));
                }
                let results = items
                    .iter()
                    .enumerate()
                    .map(|(n, i)| {
                        let depth = depths.get(n).map_or(0, |d| d.to_native());
                        // Noted at the alloc, so before the commit acknowledges the write.
                        self.s.cluster.note_write(ns.to_native(), i.key.as_slice());
                        match pool.alloc_in_chain(
                            ns.to_native(),
                            i.key.as_slice(),
                            i.len.to_native(),
                            *pin,
                            depth,
                            now,
                        ) {
                            Ok(a) => AllocResult {
                                addr: Some(a),
                                code: 0,
                            },
                            Err(e) => AllocResult {
                                addr: None,
                                code: ErrorCode::from(e) as u16,
                            },
                        }
                    })
                    .collect();
                self.reply(id, Reply::Allocated(results), &[]).await?;
                OpKind::Alloc
            }
            ArchivedOp::Write { addr, offset } => {
                let r = self
                    .write_one(&GlobalAddr::from(addr), offset.to_native(), payload)
                    .await?;
                self.s.metrics.bytes(payload, 0);
                self.answer(id, r.map(|()| Reply::Done)).await?;
                OpKind::Write
            }
            ArchivedOp::Commit { items } => {
                let r = self.batch_check(items.len()).map(|()| {
                    Reply::Statuses(
                        items
                            .iter()
                            .map(|i| {
                                code_of(pool.commit(
                                    &GlobalAddr::from(&i.addr),
                                    i.checksum.to_native(),
                                    now,
                                ))
                            })
                            .collect(),
                    )
                });
                self.answer(id, r).await?;
                OpKind::Commit
            }
            ArchivedOp::Abort { addrs } => {
                let r = self.batch_check(addrs.len()).map(|()| {
                    Reply::Statuses(
                        addrs
                            .iter()
                            .map(|a| code_of(pool.abort(&GlobalAddr::from(a))))
                            .collect(),
                    )
                });
                self.answer(id, r).await?;
                OpKind::Abort
            }
            ArchivedOp::Read { addr, offset, len } => {
                let addr = GlobalAddr::from(addr);
                let (offset, len) = (offset.to_native(), len.to_native());
                // Verify the address before sizing a buffer from it: a peer can only make us
                // allocate as much as a real object it was given the key of.
                let checked = pool.verify_addr(&addr).and_then(|()| {
                    addr.sub_range(offset, len)
                        .map(|_| ())
                        .ok_or(kvpool::AddrFault::OutOfBounds.into())
                });
                match checked {
                    Ok(()) => {
                        let mut buf = vec![0u8; len as usize];
                        match pool.read(&addr, offset, &mut buf) {
                            Ok(()) => {
                                self.reply(id, Reply::Data, &[&buf]).await?;
                                self.s.metrics.bytes(0, len);
                            }
                            Err(e) => self.pool_fail(id, e).await?,
                        }
                    }
                    Err(e) => self.pool_fail(id, e).await?,
                }
                OpKind::Read
            }
            ArchivedOp::Vouch { ns, keys } => {
                let ns = ns.to_native();
                // A copy elsewhere may be one of up to this many (pinned objects have more).
                let replicas = self
                    .s
                    .hello
                    .replication
                    .iter()
                    .find(|r| r.ns == ns)
                    .map(|r| r.replicas.max(r.pinned_replicas) as usize)
                    .ok_or(ErrorCode::UnknownNamespace);
                let r = self.batch_check(keys.len()).and(replicas).map(|replicas| {
                    Reply::Statuses(
                        keys.iter()
                            .map(|k| {
                                if self.s.cluster.vouches(ns, k.as_slice(), replicas) {
                                    ErrorCode::Ok as u16
                                } else {
                                    ErrorCode::Superseded as u16
                                }
                            })
                            .collect(),
                    )
                });
                self.answer(id, r).await?;
                OpKind::Lookup
            }
            ArchivedOp::Lookup { ns, keys, lease_ms } => {
                let r = self.batch_check(keys.len()).and_then(|()| {
                    keys.iter()
                        .map(|k| {
                            if !self.fresh_key(ns.to_native(), k.as_slice()) {
                                return Ok(None);
                            }
                            pool.lookup(ns.to_native(), k.as_slice(), lease_ms.to_native(), now)
                                .map(|l| {
                                    l.map(|l| LocatedWire {
                                        addr: l.addr,
                                        checksum: l.checksum,
                                    })
                                })
                        })
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(Into::into)
                });
                self.answer(id, r.map(Reply::Located)).await?;
                OpKind::Lookup
            }
            ArchivedOp::Release { ns, keys } => {
                let r = self.count(
                    keys.len(),
                    keys.iter()
                        .map(|k| pool.release(ns.to_native(), k.as_slice())),
                );
                self.answer(id, r).await?;
                OpKind::Release
            }
            ArchivedOp::Pin { ns, keys, pinned } => {
                let r = self.count(
                    keys.len(),
                    keys.iter()
                        .map(|k| pool.set_pinned(ns.to_native(), k.as_slice(), *pinned)),
                );
                self.answer(id, r).await?;
                OpKind::Pin
            }
            ArchivedOp::Stats => {
                let mut stats = pool.stats();
                stats
                    .namespaces
                    .retain(|n| self.allowed.get(n.id as usize).copied().unwrap_or(false));
                self.reply(id, Reply::Stats(stats), &[]).await?;
                OpKind::Admin
            }
            ArchivedOp::View => {
                self.reply(id, Reply::View(self.s.cluster.view()), &[])
                    .await?;
                OpKind::Admin
            }
            ArchivedOp::ClusterAuth { nonce, proof } => {
                let node = self.s.hello.node;
                if !self
                    .s
                    .cluster_secret
                    .verify_peer(node, &self.challenge, nonce, proof)
                {
                    // debug, not warn: anyone can send this, and logs must not be floodable.
                    tracing::debug!(
                        transport = self.transport.name(),
                        "refused a connection that failed the cluster secret check"
                    );
                    self.fail(id, ErrorCode::Unauthorized, "wrong cluster secret")
                        .await?;
                    return Ok((OpKind::Admin, Err(Close)));
                }
                self.peer = true;
                self.allowed.iter_mut().for_each(|a| *a = true);
                let proof = self
                    .s
                    .cluster_secret
                    .node_proof(node, &self.challenge, nonce);
                self.reply(id, Reply::ClusterAuth { proof }, &[]).await?;
                OpKind::Admin
            }
            ArchivedOp::Gossip { view } => {
                if !self.peer {
                    self.fail(
                        id,
                        ErrorCode::Unauthorized,
                        "gossip is cluster control: it needs the cluster secret (ClusterAuth)",
                    )
                    .await?;
                    return Ok((OpKind::Admin, Ok(())));
                }
                let theirs: kvpool::placement::ClusterView =
                    match rkyv::deserialize::<_, rkyv::rancor::Error>(view) {
                        Ok(v) => v,
                        Err(e) => {
                            self.fail(id, ErrorCode::Malformed, &e.to_string()).await?;
                            return Ok((OpKind::Admin, Ok(())));
                        }
                    };
                let after = self.s.cluster.merge(&theirs);
                self.reply(id, Reply::View(after), &[]).await?;
                OpKind::Admin
            }
            ArchivedOp::Drain => {
                if !self.peer {
                    self.fail(
                        id,
                        ErrorCode::Unauthorized,
                        "drain is cluster control: it needs the cluster secret (ClusterAuth)",
                    )
                    .await?;
                    return Ok((OpKind::Admin, Ok(())));
                }
                tracing::info!(client = "drain request", "drain requested");
                self.s.cluster.request_drain();
                self.reply(id, Reply::Done, &[]).await?;
                OpKind::Admin
            }
            ArchivedOp::MapInfo => {
                if self.transport != Transport::Unix {
                    self.fail(
                        id,
                        ErrorCode::NotLocal,
                        "segments are only offered over the Unix socket",
                    )
                    .await?;
                    return Ok((OpKind::Admin, Ok(())));
                }
                let maps = pool
                    .segments()
                    .filter_map(|s| {
                        Some(SegmentMap {
                            id: s.layout().id,
                            path: s.path()?.to_string_lossy().into_owned(),
                            total_len: s.layout().total_len(),
                        })
                    })
                    .collect();
                let reply = Reply::MapInfo {
                    incarnation: pool.incarnation(),
                    segments: maps,
                };
                self.reply(id, reply, &[]).await?;
                OpKind::Admin
            }
        };
        Ok((kind, Ok(())))
    }

    /// Receives one value of `len` bytes straight into a fresh allocation and commits it.
    /// Consumes exactly `len` payload bytes whatever happens.
    #[expect(clippy::too_many_arguments, reason = "one call site per request shape")]
    async fn put_one(
        &mut self,
        ns: u32,
        key: &[u8],
        len: u64,
        checksum: u64,
        pin: bool,
        depth: u32,
        now: Millis,
    ) -> io::Result<Result<(), ErrorCode>> {
        let pool = &*self.s.pool;
        self.s.cluster.note_write(ns, key);
        // The clock now, not the request's: each item of a long batch gets its whole timeout.
        let addr = match pool.alloc_in_chain(ns, key, len, pin, depth, self.s.now()) {
            Ok(a) => a,
            Err(e) => {
                discard(&mut self.r, len).await?;
                return Ok(Err(e.into()));
            }
        };
        {
            let mut w = pool
                .begin_write(&addr)
                .map_err(|e| io::Error::other(e.to_string()))?;
            let deadline = self.s.instant_at(w.deadline());
            let read = tokio::time::timeout_at(deadline, self.r.read_exact(w.bytes_mut())).await;
            if let Some(e) = payload_failure(read) {
                drop(w);
                let _ = pool.abort(&addr);
                return Err(e);
            }
        }
        Ok(pool.commit(&addr, checksum, now).map_err(Into::into))
    }

    async fn write_one(
        &mut self,
        addr: &GlobalAddr,
        offset: u64,
        len: u64,
    ) -> io::Result<Result<(), ErrorCode>> {
        let pool = &*self.s.pool;
        // Claims exactly the bytes written: a write overlapping another connection's open write
        // of the same allocation is refused (`Busy`) instead of aliasing its memory.
        let mut w = match pool.begin_write_range(addr, offset, len) {
            Ok(w) => w,
            Err(e) => {
                discard(&mut self.r, len).await?;
                return Ok(Err(e.into()));
            }
        };
        let deadline = self.s.instant_at(w.deadline());
        let read = tokio::time::timeout_at(deadline, self.r.read_exact(w.bytes_mut())).await;
        let expired = read.is_err();
        if let Some(e) = payload_failure(read) {
            drop(w);
            // Past its deadline: give the allocation back now (if another write still holds
            // it, the reaper takes it once that write ends). After a socket error it stays
            // pending for its owner, who may write it again over another connection.
            if expired {
                let _ = pool.abort(addr);
            }
            return Err(e);
        }
        Ok(Ok(()))
    }

    /// `obj`, unless this read is routed and the object is not continuous (see
    /// [`crate::fence`]): then it is removed and the read misses.
    fn fresh<'p>(
        &self,
        ns: u32,
        key: &[u8],
        obj: kvpool::pool::ObjectRef<'p>,
    ) -> Result<kvpool::pool::ObjectRef<'p>, PoolError> {
        let (generation, pinned) = (obj.generation(), obj.pinned());
        if self.continuous(ns, key, generation, pinned) {
            return Ok(obj);
        }
        drop(obj);
        let _ = self.s.pool.remove_generation(ns, key, generation);
        Err(PoolError::NotFound)
    }

    /// False when this read is routed and the object of `key` here is not continuous (it is
    /// then removed); true otherwise, also when there is no object.
    fn fresh_key(&self, ns: u32, key: &[u8]) -> bool {
        if !self.routed {
            return true;
        }
        let Ok(Some((generation, pinned))) = self.s.pool.provenance(ns, key) else {
            return true;
        };
        if self.continuous(ns, key, generation, pinned) {
            return true;
        }
        let _ = self.s.pool.remove_generation(ns, key, generation);
        false
    }

    /// May an object of `key` allocated at `generation` be served by this request? Unrouted
    /// requests (stamp 0: previous-owner reads, the mover) read what is here; routed ones only
    /// an object this node held as one of its first owners (the namespace's `replicas`, or
    /// `pinned_replicas` for a pinned object) in every view since it was written.
    fn continuous(&self, ns: u32, key: &[u8], generation: u64, pinned: bool) -> bool {
        if !self.routed {
            return true;
        }
        let replicas = self
            .s
            .hello
            .replication
            .iter()
            .find(|r| r.ns == ns)
            .map_or(1, |r| {
                if pinned {
                    r.replicas.max(r.pinned_replicas)
                } else {
                    r.replicas
                }
            });
        self.s
            .cluster
            .continuous(key, generation, replicas.max(1) as usize)
    }

    fn batch_check(&self, n: usize) -> Result<(), ErrorCode> {
        if n > self.s.limits.max_batch as usize {
            return Err(ErrorCode::BatchTooLarge);
        }
        Ok(())
    }

    fn count(
        &self,
        n: usize,
        results: impl Iterator<Item = Result<bool, PoolError>>,
    ) -> Result<Reply, ErrorCode> {
        self.batch_check(n)?;
        let mut c = 0;
        for r in results {
            c += r? as u64;
        }
        Ok(Reply::Count(c))
    }

    async fn answer(&mut self, id: u64, r: Result<Reply, ErrorCode>) -> io::Result<()> {
        match r {
            Ok(reply) => self.reply(id, reply, &[]).await,
            Err(code) => self.fail(id, code, &describe(code)).await,
        }
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

    async fn reply(&mut self, id: u64, reply: Reply, payload: &[&[u8]]) -> io::Result<()> {
        let hdr = encode(&Response { id, reply });
        write_frame(&mut self.w, &hdr, payload).await
    }
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
        | ArchivedOp::Alloc { ns, .. }
        | ArchivedOp::Lookup { ns, .. }
        | ArchivedOp::Vouch { ns, .. }
        | ArchivedOp::Release { ns, .. }
        | ArchivedOp::Pin { ns, .. } => Some(ns.to_native()),
        _ => None,
    }
}

/// The request was answered and the connection must close.
struct Close;

fn code_of(r: Result<(), PoolError>) -> u16 {
    r.err().map_or(0, |e| ErrorCode::from(e) as u16)
}

fn describe(code: ErrorCode) -> String {
    format!("{code:?}")
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
