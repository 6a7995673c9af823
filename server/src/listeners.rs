//! Accept loops, one per transport, in the mini-redis shape: a semaphore bounds concurrent
//! connections (accepting waits when it is exhausted), each connection gets its own task, and
//! every task holds a clone of `done` so shutdown can wait for all of them to drain.

use std::sync::Arc;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::handler::{serve, Shared};
use crate::metrics::Transport;

/// What every accept loop needs.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub(crate) shared: Arc<Shared>,
    pub(crate) limit: Arc<Semaphore>,
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) done: mpsc::Sender<()>,
}

pub(crate) async fn tcp(listener: TcpListener, mut ctx: Ctx) {
    loop {
        let Some(permit) = permit(&mut ctx).await else {
            return;
        };
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = ctx.shutdown.wait_for(|s| *s) => return,
        };
        let (sock, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "tcp accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        tracing::trace!(%peer, "tcp connection");
        let (r, w) = sock.into_split();
        let (shared, stop, done) = (ctx.shared.clone(), ctx.shutdown.clone(), ctx.done.clone());
        tokio::spawn(async move {
            serve(shared, Transport::Tcp, r, w, stop).await;
            drop((permit, done));
        });
    }
}

pub(crate) async fn unix(listener: UnixListener, mut ctx: Ctx) {
    loop {
        let Some(permit) = permit(&mut ctx).await else {
            return;
        };
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = ctx.shutdown.wait_for(|s| *s) => return,
        };
        let sock = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "unix accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let (r, w) = sock.into_split();
        let (shared, stop, done) = (ctx.shared.clone(), ctx.shutdown.clone(), ctx.done.clone());
        tokio::spawn(async move {
            serve(shared, Transport::Unix, r, w, stop).await;
            drop((permit, done));
        });
    }
}

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
    loop {
        let Some(permit) = permit(&mut ctx).await else {
            return;
        };
        let stream = tokio::select! {
            s = conn.accept_bi() => s,
            _ = ctx.shutdown.wait_for(|s| *s) => return,
        };
        let (send, recv) = match stream {
            Ok(s) => s,
            Err(_) => return, // the peer closed the connection
        };
        let (shared, stop, done) = (ctx.shared.clone(), ctx.shutdown.clone(), ctx.done.clone());
        tokio::spawn(async move {
            serve(shared, Transport::Quic, recv, send, stop).await;
            drop((permit, done));
        });
    }
}

async fn permit(ctx: &mut Ctx) -> Option<tokio::sync::OwnedSemaphorePermit> {
    tokio::select! {
        p = ctx.limit.clone().acquire_owned() => p.ok(),
        _ = ctx.shutdown.wait_for(|s| *s) => None,
    }
}
