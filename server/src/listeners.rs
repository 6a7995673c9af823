//! Accept loops, one per transport, in the mini-redis shape: a semaphore bounds concurrent
//! connections, each connection gets its own task, and every task holds a clone of `done` so
//! shutdown can wait for all of them to drain. A peer address over its connection cap (TCP
//! connections and QUIC streams alike) is closed or reset at once.
//!
//! A connection accepted while every slot is taken, or an accept that fails for lack of
//! descriptors, reaps the oldest connection that has not authenticated ([`crate::reaper`]) and
//! takes its place; only when every connection has authenticated does accepting wait for a
//! slot. Other failed accepts pause the loop, longer while failures continue, and are logged
//! at a bounded rate.

use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::admission::{AcceptErrors, LogLimiter, PeerCounts, LOG_EVERY};
use crate::handler::{serve, Accepted};
use crate::metrics::{Limit, ReapCause, Transport};
use crate::reaper::{Reaper, Waiting};
use crate::service::Shared;

/// What every accept loop needs.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub(crate) shared: Arc<Shared>,
    pub(crate) limit: Arc<Semaphore>,
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) done: mpsc::Sender<()>,
    /// Open connections (and QUIC streams) per peer address.
    pub(crate) peers: Arc<PeerCounts>,
    /// The connections (and QUIC streams) that have not authenticated, oldest first.
    pub(crate) reaper: Arc<Reaper>,
}

pub(crate) async fn tcp(listener: TcpListener, ctx: Ctx) {
    accept_loop(ctx, Transport::Tcp, listener, None).await
}

pub(crate) async fn unix(listener: UnixListener, ctx: Ctx) {
    accept_loop(ctx, Transport::Unix, listener, None).await
}

/// The Redis-protocol front door: TCP connections served by `crate::resp`, under the same
/// connection limits as the native ones.
pub(crate) async fn resp(listener: TcpListener, ctx: Ctx, door: Arc<crate::resp::RespShared>) {
    accept_loop(ctx, Transport::Resp, listener, Some(door)).await
}

/// The native protocol over TLS (`listen.tls`): each accepted TCP connection's TLS handshake
/// runs in its own task, bounded by the handshake timeout, so a peer that stalls in it holds
/// only its own slot.
pub(crate) async fn tls(listener: TcpListener, acceptor: tokio_rustls::TlsAcceptor, ctx: Ctx) {
    let handshake = ctx.shared.conn.handshake;
    let l = TlsListener {
        listener,
        acceptor,
        handshake,
    };
    accept_loop(ctx, Transport::Tls, l, None).await
}

/// A listener of byte streams, split into read and write halves once opened, with the peer's
/// IP address where it has one.
trait Accept {
    type R: AsyncRead + Unpin + Send + 'static;
    type W: AsyncWrite + Unpin + Send + 'static;
    /// What finishes opening an accepted connection (a TLS handshake), run in the
    /// connection's own task rather than in the accept loop.
    type Open: Future<Output = io::Result<(Self::R, Self::W)>> + Send + 'static;

    /// Accepts a connection; the returned future finishes opening it.
    fn accept_opening(
        &self,
    ) -> impl Future<Output = io::Result<(Self::Open, Option<IpAddr>)>> + Send;

    /// The socket under an opened connection's read half, for plain TCP (its receive
    /// low-water mark is raised for large payloads) and Unix (descriptors are passed over it:
    /// `MapInfo`) connections; None for TLS, whose socket carries records, not the payload.
    fn socket_fd(_r: &Self::R) -> Option<std::os::fd::RawFd> {
        None
    }
}

struct TlsListener {
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    handshake: std::time::Duration,
}

type TlsStream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

impl Accept for TlsListener {
    type R = tokio::io::ReadHalf<TlsStream>;
    type W = tokio::io::WriteHalf<TlsStream>;
    type Open = std::pin::Pin<Box<dyn Future<Output = io::Result<(Self::R, Self::W)>> + Send>>;
    async fn accept_opening(&self) -> io::Result<(Self::Open, Option<IpAddr>)> {
        let (sock, peer) = self.listener.accept().await?;
        let _ = sock.set_nodelay(true);
        let (acceptor, within) = (self.acceptor.clone(), self.handshake);
        let open = Box::pin(async move {
            let tls = tokio::time::timeout(within, acceptor.accept(sock))
                .await
                .map_err(|_| {
                    io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out")
                })??;
            Ok(tokio::io::split(tls))
        });
        Ok((open as Self::Open, Some(peer.ip())))
    }
}

impl Accept for TcpListener {
    type R = tokio::net::tcp::OwnedReadHalf;
    type W = tokio::net::tcp::OwnedWriteHalf;
    type Open = std::future::Ready<io::Result<(Self::R, Self::W)>>;
    async fn accept_opening(&self) -> io::Result<(Self::Open, Option<IpAddr>)> {
        let (sock, peer) = self.accept().await?;
        let _ = sock.set_nodelay(true);
        tracing::trace!(%peer, "tcp connection");
        Ok((std::future::ready(Ok(sock.into_split())), Some(peer.ip())))
    }

    fn socket_fd(r: &Self::R) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let sock: &tokio::net::TcpStream = r.as_ref();
        Some(sock.as_raw_fd())
    }
}

impl Accept for UnixListener {
    type R = tokio::net::unix::OwnedReadHalf;
    type W = tokio::net::unix::OwnedWriteHalf;
    type Open = std::future::Ready<io::Result<(Self::R, Self::W)>>;
    async fn accept_opening(&self) -> io::Result<(Self::Open, Option<IpAddr>)> {
        let sock = self.accept().await?.0;
        Ok((std::future::ready(Ok(sock.into_split())), None))
    }

    fn socket_fd(r: &Self::R) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let sock: &tokio::net::UnixStream = r.as_ref();
        Some(sock.as_raw_fd())
    }
}

/// Accepts connections until shutdown, each served by its own task: by the native handler, or
/// by the RESP front door when `door` is given.
async fn accept_loop<L: Accept + 'static>(
    mut ctx: Ctx,
    transport: Transport,
    listener: L,
    door: Option<Arc<crate::resp::RespShared>>,
) {
    let mut errors = AcceptErrors::default();
    let mut refusals = LogLimiter::new(LOG_EVERY);
    loop {
        let accepted = tokio::select! {
            r = listener.accept_opening() => r,
            _ = ctx.shutdown.wait_for(|s| *s) => return,
        };
        let (open, peer) = match accepted {
            Ok(accepted) => {
                errors.succeeded();
                accepted
            }
            Err(e) => {
                if !accept_failed(&mut ctx, &mut errors, &e, transport).await {
                    return;
                }
                continue;
            }
        };
        let slot = match peer.map(|ip| (ip, ctx.peers.enter(ip))) {
            None => None,
            Some((_, Some(slot))) => Some(slot),
            Some((ip, None)) => {
                ctx.shared.metrics.limit_refused(Limit::ConnectionsPerPeer);
                if let Some(more) = refusals.allow(Instant::now()) {
                    tracing::warn!(
                        %ip,
                        "closing a connection over the per-peer cap \
                         (listen.max_connections_per_peer; {more} more since the last report)"
                    );
                }
                continue; // dropping the halves closes the connection
            }
        };
        let Some(permit) = permit(&mut ctx).await else {
            return;
        };
        let held = Held {
            permit,
            waiting: ctx.reaper.enter(),
            peer: slot,
            done: ctx.done.clone(),
        };
        let (shared, stop, door) = (ctx.shared.clone(), ctx.shutdown.clone(), door.clone());
        tokio::spawn(open_and_serve::<L>(
            open,
            (transport, peer),
            door,
            shared,
            stop,
            held,
        ));
    }
}

/// What a connection's task holds until the connection ends. Fields drop in this order: the
/// connection slot before the reaper's entry, whose going tells an accept loop waiting on a
/// reaped connection that its slot is free.
struct Held {
    #[expect(
        dead_code,
        reason = "held for its drop, which frees the connection slot"
    )]
    permit: tokio::sync::OwnedSemaphorePermit,
    waiting: Waiting,
    /// Its count under its address (none over the Unix socket).
    #[expect(dead_code, reason = "held for its drop, which uncounts the connection")]
    peer: Option<crate::admission::Slot<IpAddr>>,
    /// Shutdown waits for every task's clone to go.
    #[expect(dead_code, reason = "held for its drop, which shutdown waits for")]
    done: mpsc::Sender<()>,
}

/// Finishes opening an accepted connection (a TLS handshake) and serves it: by the native
/// handler, or by the RESP front door when `door` is given.
async fn open_and_serve<L: Accept + 'static>(
    open: L::Open,
    (transport, peer): (Transport, Option<IpAddr>),
    door: Option<Arc<crate::resp::RespShared>>,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    held: Held,
) {
    let waiting = &held.waiting;
    // The opening is unauthenticated too: reaping ends it.
    let opened = tokio::select! {
        o = open => o,
        () = waiting.reaped() => Err(io::ErrorKind::ConnectionAborted.into()),
    };
    let (r, w) = match opened {
        Ok(halves) => halves,
        Err(e) => return tracing::debug!(error = %e, ?peer, "a connection failed to open"),
    };
    let fd = L::socket_fd(&r);
    let (r, admit) = (waiting.reader(r), Some(waiting.admit()));
    match door {
        Some(door) => crate::resp::serve(shared, door, (peer, admit), r, w, stop).await,
        None => {
            let conn = Accepted {
                transport,
                peer,
                fd,
                admit,
            };
            serve(shared, conn, r, w, stop).await
        }
    }
}

/// After a failed accept: when it failed for lack of descriptors and a connection that has not
/// authenticated can be reaped, waits until it has closed (its descriptor is free); otherwise
/// pauses (longer while failures continue). Either way the failure is logged at a bounded rate.
/// False on shutdown.
async fn accept_failed(
    ctx: &mut Ctx,
    errors: &mut AcceptErrors,
    e: &io::Error,
    transport: Transport,
) -> bool {
    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
    let reaped = out_of_fds.then(|| ctx.reaper.reap_oldest()).flatten();
    let pause = match &reaped {
        Some(_) => {
            ctx.shared.metrics.connection_reaped(ReapCause::Descriptors);
            errors.made_room(e, transport.name(), Instant::now());
            // A reaped connection ends at its task's next turn; never wait on it for long.
            REAP_WAIT
        }
        None => errors.failed(e, transport.name(), Instant::now()),
    };
    let wait = async move {
        match reaped {
            Some(reaped) => {
                let _ = tokio::time::timeout(pause, reaped.closed()).await;
            }
            None => tokio::time::sleep(pause).await,
        }
    };
    tokio::select! {
        () = wait => true,
        _ = ctx.shutdown.wait_for(|s| *s) => false,
    }
}

/// The longest an accept loop waits for a connection it reaped to close.
const REAP_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The application error code a QUIC stream over the per-peer cap is reset and stopped with.
const STREAM_REFUSED: quinn::VarInt = quinn::VarInt::from_u32(1);

/// QUIC: every bidirectional stream of every connection is served like one TCP connection.
pub(crate) async fn quic(endpoint: quinn::Endpoint, mut ctx: Ctx) {
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => i,
            _ = ctx.shutdown.wait_for(|s| *s) => break,
        };
        let Some(incoming) = incoming else { break };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(error = %e, "quic handshake failed");
                    return;
                }
            };
            quic_streams(conn, ctx).await;
        });
    }
    endpoint.close(0u32.into(), b"shutting down");
}

async fn quic_streams(conn: quinn::Connection, mut ctx: Ctx) {
    let ip = conn.remote_address().ip();
    let mut refusals = LogLimiter::new(LOG_EVERY);
    loop {
        let stream = tokio::select! {
            s = conn.accept_bi() => s,
            _ = ctx.shutdown.wait_for(|s| *s) => return,
        };
        let (mut send, mut recv) = match stream {
            Ok(s) => s,
            Err(_) => return, // the peer closed the connection
        };
        // A stream is a connection to the per-address cap, as a TCP connection is: one QUIC
        // peer can't hold more of the node's connections than a TCP peer can.
        let Some(slot) = ctx.peers.enter(ip) else {
            ctx.shared.metrics.limit_refused(Limit::ConnectionsPerPeer);
            if let Some(more) = refusals.allow(Instant::now()) {
                tracing::warn!(
                    %ip,
                    "resetting a QUIC stream over the per-peer cap \
                     (listen.max_connections_per_peer; {more} more since the last report)"
                );
            }
            let _ = send.reset(STREAM_REFUSED);
            let _ = recv.stop(STREAM_REFUSED);
            continue;
        };
        let Some(permit) = permit(&mut ctx).await else {
            return;
        };
        let held = Held {
            permit,
            waiting: ctx.reaper.enter(),
            peer: Some(slot),
            done: ctx.done.clone(),
        };
        let (shared, stop) = (ctx.shared.clone(), ctx.shutdown.clone());
        tokio::spawn(async move {
            let conn = Accepted {
                transport: Transport::Quic,
                peer: Some(ip),
                fd: None,
                admit: Some(held.waiting.admit()),
            };
            serve(shared, conn, held.waiting.reader(recv), send, stop).await;
            drop(held);
        });
    }
}

/// A connection slot for a connection just accepted: a free one, or else the one of the oldest
/// connection that has not authenticated, reaped for it. Only when every connection has
/// authenticated does it wait for one to close. None on shutdown.
async fn permit(ctx: &mut Ctx) -> Option<tokio::sync::OwnedSemaphorePermit> {
    loop {
        if let Ok(p) = ctx.limit.clone().try_acquire_owned() {
            return Some(p);
        }
        let reaped = ctx.reaper.reap_oldest();
        if reaped.is_some() {
            ctx.shared
                .metrics
                .connection_reaped(ReapCause::MaxConnections);
        }
        // Its slot comes back before it is seen closed; if another accept loop took it first,
        // the next round reaps another.
        let closed = async {
            match reaped {
                Some(r) => r.closed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            p = ctx.limit.clone().acquire_owned() => return p.ok(),
            () = closed => continue,
            _ = ctx.shutdown.wait_for(|s| *s) => return None,
        }
    }
}
