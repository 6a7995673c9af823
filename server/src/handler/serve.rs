//! One connection's life and the policies beside its dispatch: opened from what the accept
//! loop knows, served request by request until the peer leaves, the protocol breaks, or
//! shutdown is signalled while the connection is idle between requests.
//!
//! - the handshake: until the `Hello` is accepted, a small read buffer, a small header, no
//!   payload, and one deadline (`handshake_timeout_ms`) for it all;
//! - idling: an authenticated connection idle for `idle_timeout_ms` is closed, unless it holds
//!   objects, watches, or holds a staging area;
//! - events: between the requests of a watching connection, its events are written (handoff
//!   events, and KV event batches of a connection that sent `KvEvents`).

use std::sync::Arc;

use kvpool::protocol::io::{read_header, read_prefix, FrameReader, WireError};
use kvpool::protocol::{auth, AlignedVec, ErrorCode, FrameError, Limits, Priority};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::watch;
use tokio::time::Instant;

use super::conn::{Conn, Fds, ReqClass, Serving, Session, HELLO_BUFFER, IO_BUFFER, ONE_SIDED_NS};
use super::held::{Holdings, Holds};
use crate::deadline::{within, ReadStall, StallLimit};
use crate::metrics::Transport;
use crate::service::Shared;

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
    let transport = accepted.transport;
    shared.metrics.connection_opened(transport);
    let mut conn = Conn::open(&shared, accepted, r, w);
    let mut hdr = AlignedVec::<16>::new();
    let hello_by = Instant::now() + shared.conn.handshake;
    loop {
        let bounds = conn.bounds(hello_by);
        if (conn.held.watching.is_some() || conn.held.kv_events.is_some())
            && conn.r.buffer().is_empty()
            && conn.write_events(&mut shutdown).await.is_err()
        {
            break;
        }
        if !conn.next_request(&mut hdr, bounds, &mut shutdown).await {
            break;
        }
    }
    let _ = conn.w.shutdown().await;
    shared.trim.released(conn.buffers() + hdr.capacity() as u64);
    shared.metrics.connection_closed(transport);
}

impl<'a, R, W> Conn<'a, ReadStall<R>, StallLimit<W>>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    /// A connection just accepted: nothing authenticated, nothing held, small buffers.
    fn open(s: &'a Shared, accepted: Accepted, r: R, w: W) -> Self {
        let Accepted {
            transport,
            peer: peer_ip,
            fd,
            admit,
        } = accepted;
        let tcp_fd = fd.filter(|_| transport == Transport::Tcp);
        Conn {
            s,
            transport,
            // A request that stops arriving half-way fails the connection (idling between
            // requests is the idle policy's). Small until the Hello is accepted.
            r: FrameReader::with_capacity(
                HELLO_BUFFER,
                ReadStall::new(r, s.conn.read).on_socket(tcp_fd),
            ),
            // A reply the peer stops reading fails the connection, releasing what it referenced.
            w: BufWriter::with_capacity(IO_BUFFER, StallLimit::new(w, s.conn.write)),
            session: Session {
                access: None,
                admit,
                peer_ip,
                peer: false,
                challenge: [0; auth::AUTH_LEN],
                version: 0,
                token_slot: None,
            },
            fds: Fds {
                unix: fd.filter(|_| transport == Transport::Unix),
                tcp: tcp_fd,
            },
            req: Serving {
                stamp: 0,
                class: ReqClass {
                    ns: ONE_SIDED_NS,
                    priority: Priority::Normal,
                    deadline: None,
                },
                bulk_in: None,
                moved_bulk: false,
            },
            held: Holdings {
                holds: Holds {
                    pool: &s.pool,
                    held: Vec::new(),
                },
                account: s.ledger.account(),
                watching: None,
                kv_events: None,
                staging: None,
                pending: Default::default(),
            },
            read_buf: Vec::new(),
        }
    }

    /// The limits the next request is read under and the deadline for its first byte: until
    /// the `Hello` is accepted, a small header, no payload, one deadline for it all; after it,
    /// the wire limits and the idle timeout.
    fn bounds(&self, hello_by: Instant) -> (&'a Limits, Option<Instant>) {
        if self.session.access.is_none() {
            return (&self.s.conn.hello_limits, Some(hello_by));
        }
        // A connection holding objects is a same-host reader's lifeline for its views:
        // closing it for idling would free memory that the reader still maps.
        // So is a watching one: a consumer waits as long as its producer takes. And one that
        // holds a staging area: a writer keeps it open, idle, for as long as it puts.
        let idle = self.s.conn.idle.filter(|_| {
            self.held.holds.is_empty()
                && self.held.watching.is_none()
                && self.held.kv_events.is_none()
                && self.held.staging.is_none()
        });
        (&self.s.conn.limits, idle.map(|d| Instant::now() + d))
    }

    /// Between requests of a watching connection: writes its events until the next request's
    /// first bytes arrive (filling the read buffer is cancel-safe). Err: close the connection.
    async fn write_events(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<(), ()> {
        loop {
            // (The shutdown's guard is dropped inside: it must not live across an await.)
            let stop = async {
                let _ = shutdown.wait_for(|stop| *stop).await;
            };
            let watched = async {
                match self.held.watching.as_mut() {
                    Some(reg) => reg.rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            let kv = async {
                match self.held.kv_events.as_ref() {
                    Some(sub) => {
                        sub.ready().await;
                        // Cancel-safe: a request arriving meanwhile is served first.
                        tokio::time::sleep(crate::events::LINGER).await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = stop => return Err(()),
                ev = watched => {
                    let Some(ev) = ev else { return Ok(()) };
                    if self.events(ev).await.is_err() {
                        return Err(());
                    }
                }
                () = kv => {
                    if self.kv_event_batches().await.is_err() {
                        return Err(());
                    }
                }
                r = self.r.fill_buf() => return match r {
                    Ok(b) if !b.is_empty() => Ok(()),
                    _ => Err(()),
                },
            }
        }
    }

    /// Waits for the next request, reads it under `bounds` and serves it. Shutdown, the idle
    /// policy or the handshake deadline may end the wait; from the request's first byte on, it
    /// must keep arriving. Returns whether the connection carries on.
    async fn next_request(
        &mut self,
        hdr: &mut AlignedVec<16>,
        (limits, deadline): (&Limits, Option<Instant>),
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        self.r.get_mut().in_request(false);
        let first = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => return false,
            b = within(deadline, async { self.r.fill_buf().await.map(|b| !b.is_empty()) }) => b,
        };
        if !matches!(first, Ok(true)) {
            return false;
        }
        self.r.get_mut().in_request(true);
        let prefix = match within(deadline, read_prefix(&mut self.r, limits)).await {
            Ok(Some(p)) => p,
            Ok(None) | Err(WireError::Io(_)) => return false,
            Err(WireError::Frame(e)) => {
                self.bad_frame(e).await;
                return false;
            }
        };
        if within(deadline, read_header(&mut self.r, &prefix, hdr))
            .await
            .is_err()
        {
            return false;
        }
        match self.request(hdr, prefix.payload_len).await {
            Ok(true) => {}
            Ok(false) => {
                let _ = self.w.flush().await;
                return false;
            }
            Err(_) => return false,
        }
        !(self.r.buffer().is_empty() && self.w.flush().await.is_err())
    }

    /// Answers a frame that breaks the protocol itself; the connection closes after it.
    async fn bad_frame(&mut self, e: FrameError) {
        self.s.metrics.protocol_error();
        tracing::debug!(error = %e, transport = self.transport.name(), "closing connection after a bad frame");
        let code = match e {
            FrameError::HeaderTooLarge(_) | FrameError::PayloadTooLarge(_) => {
                ErrorCode::FrameTooLarge
            }
            _ => ErrorCode::Malformed,
        };
        let _ = self.fail(0, code, &e.to_string()).await;
        let _ = self.w.flush().await;
    }
}
