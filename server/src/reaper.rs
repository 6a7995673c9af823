//! Connections that have not authenticated yet, oldest first, and closing them to make room.
//!
//! A connection counts as unauthenticated from the moment it is given a connection slot until
//! its `Hello` (or RESP `AUTH`) is accepted. When the node is at `listen.max_connections`, or
//! an accept fails for lack of descriptors, the accept loop reaps the oldest of them: its reads
//! fail at once, its task ends and its slot and descriptor are freed for the connection that
//! is waiting. So a peer holding slots with connections that never say `Hello` loses its own
//! oldest ones to every newcomer, instead of keeping honest clients out until the handshake
//! timeout. Connections that authenticated are never reaped.
//!
//! The registry is a map ordered by arrival; each connection's [`Waiting`] entry leaves it when
//! the connection authenticates ([`Admit::authenticated`]) or ends (its drop), whichever comes
//! first. A connection is either admitted or reaped, never both: the two race on one atomic
//! state.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;

/// The connection has not authenticated.
const WAITING: u8 = 0;
/// Its `Hello` (or `AUTH`) was accepted: it is never reaped.
const ADMITTED: u8 = 1;
/// It was chosen to make room: its reads fail.
const REAPED: u8 = 2;

/// The node's unauthenticated connections, by arrival.
#[derive(Default)]
pub(crate) struct Reaper {
    waiting: Mutex<BTreeMap<u64, Arc<Mark>>>,
    next: AtomicU64,
}

/// What the registry and a connection share.
struct Mark {
    state: AtomicU8,
    /// Woken (every waiter) when the connection is reaped.
    reap: Arc<Notify>,
    /// Set, and its waiters woken, when the connection has ended and given back its slot.
    gone: AtomicBool,
    closed: Notify,
}

/// A connection's place in the registry, held by its task for the connection's whole life and
/// dropped after its connection slot: its drop says that the slot is free.
pub(crate) struct Waiting {
    reaper: Arc<Reaper>,
    seq: u64,
    mark: Arc<Mark>,
}

/// What a connection's handler holds to say that it authenticated.
pub(crate) struct Admit {
    reaper: Arc<Reaper>,
    seq: u64,
    mark: Arc<Mark>,
}

/// A connection just reaped, until it has closed.
pub(crate) struct Reaped(Arc<Mark>);

impl Reaper {
    pub(crate) fn new() -> Arc<Reaper> {
        Arc::default()
    }

    /// Registers a connection just given a slot, as the newest unauthenticated one.
    pub(crate) fn enter(self: &Arc<Self>) -> Waiting {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let mark = Arc::new(Mark {
            state: AtomicU8::new(WAITING),
            reap: Arc::new(Notify::new()),
            gone: AtomicBool::new(false),
            closed: Notify::new(),
        });
        self.lock().insert(seq, mark.clone());
        Waiting {
            reaper: self.clone(),
            seq,
            mark,
        }
    }

    /// Reaps the oldest connection that has not authenticated, if there is one.
    pub(crate) fn reap_oldest(&self) -> Option<Reaped> {
        let mut waiting = self.lock();
        while let Some((_, mark)) = waiting.pop_first() {
            // One that authenticated meanwhile would have left the map; skip it all the same.
            let won = mark
                .state
                .compare_exchange(WAITING, REAPED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if won {
                mark.reap.notify_waiters();
                return Some(Reaped(mark));
            }
        }
        None
    }

    /// Connections waiting to authenticate now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Mark>>> {
        // The map is consistent after every statement; a panic elsewhere cannot break it.
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Waiting {
    /// The handle the connection's handler calls when the connection authenticates.
    pub(crate) fn admit(&self) -> Admit {
        Admit {
            reaper: self.reaper.clone(),
            seq: self.seq,
            mark: self.mark.clone(),
        }
    }

    /// `r`, whose reads fail once this connection is reaped.
    pub(crate) fn reader<R>(&self, r: R) -> Reapable<R> {
        Reapable {
            inner: r,
            mark: Some(self.mark.clone()),
            reaped: None,
        }
    }

    /// Finishes when this connection is reaped (never once it authenticated).
    pub(crate) async fn reaped(&self) {
        let notified = self.mark.reap.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.mark.state.load(Ordering::Acquire) != REAPED {
            notified.await;
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.reaper.lock().remove(&self.seq);
        self.mark.gone.store(true, Ordering::Release);
        self.mark.closed.notify_waiters();
    }
}

impl Admit {
    /// The connection authenticated: it leaves the registry and is never reaped. False when it
    /// was reaped first (it is closing: its reads fail).
    pub(crate) fn authenticated(&self) -> bool {
        let won = self
            .mark
            .state
            .compare_exchange(WAITING, ADMITTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if won {
            self.reaper.lock().remove(&self.seq);
        }
        won || self.mark.state.load(Ordering::Acquire) == ADMITTED
    }
}

impl Reaped {
    /// Finishes once the reaped connection has ended and freed its slot and descriptor.
    pub(crate) async fn closed(self) {
        let closed = self.0.closed.notified();
        tokio::pin!(closed);
        closed.as_mut().enable();
        if !self.0.gone.load(Ordering::Acquire) {
            closed.await;
        }
    }
}

/// A connection's reader that fails with `ConnectionAborted` once the connection is reaped;
/// after it authenticated, a plain pass-through.
pub(crate) struct Reapable<R> {
    inner: R,
    /// None once the connection authenticated.
    mark: Option<Arc<Mark>>,
    /// Woken when the connection is reaped; made on the first read.
    reaped: Option<Pin<Box<OwnedNotified>>>,
}

impl<R> Reapable<R> {
    /// Whether the connection was reaped, registering the task to be woken when it is.
    fn poll_reaped(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(mark) = &self.mark else {
            return false;
        };
        let reaped = self.reaped.get_or_insert_with(|| {
            let mut n = Box::pin(mark.reap.clone().notified_owned());
            // Registered before the state is read, so a reap after the read wakes it.
            n.as_mut().enable();
            n
        });
        match mark.state.load(Ordering::Acquire) {
            ADMITTED => {
                self.mark = None;
                self.reaped = None;
                false
            }
            REAPED => true,
            _ => reaped.as_mut().poll(cx).is_ready(),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Reapable<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.poll_reaped(cx) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for a new connection before it authenticated",
            )));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn the_oldest_unauthenticated_connection_is_reaped_first() {
        let r = Reaper::new();
        let a = r.enter();
        let b = r.enter();
        let c = r.enter();
        assert!(b.admit().authenticated());
        assert_eq!(r.len(), 2);
        let reaped = r.reap_oldest().expect("a is waiting");
        assert!(Arc::ptr_eq(&reaped.0, &a.mark));
        assert!(
            !a.admit().authenticated(),
            "a reaped connection is not admitted"
        );
        assert!(b.admit().authenticated(), "admitted stays admitted");
        drop(c);
        assert!(r.reap_oldest().is_none(), "b authenticated and c is gone");
        assert_eq!(r.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reaped_connections_reads_fail_and_its_close_is_seen() {
        let r = Reaper::new();
        let (a, mut peer) = tokio::io::duplex(64);
        let waiting = r.enter();
        let mut reader = waiting.reader(a);
        peer.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        reader.read_exact(&mut one).await.unwrap();
        // A read waiting for bytes fails as soon as the connection is reaped.
        let read = tokio::spawn(async move { reader.read_exact(&mut one).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let reaped = r.reap_oldest().unwrap();
        let e = read.await.unwrap().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        waiting.reaped().await;
        let closed = tokio::spawn(reaped.closed());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!closed.is_finished());
        drop(waiting);
        closed.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_authenticated_connection_is_never_reaped() {
        let r = Reaper::new();
        let (a, mut peer) = tokio::io::duplex(64);
        let waiting = r.enter();
        let mut reader = waiting.reader(a);
        assert!(waiting.admit().authenticated());
        assert!(r.reap_oldest().is_none());
        peer.write_all(b"ok").await.unwrap();
        let mut two = [0u8; 2];
        reader.read_exact(&mut two).await.unwrap();
        assert_eq!(&two, b"ok");
        let never = tokio::time::timeout(Duration::from_secs(3600), waiting.reaped()).await;
        assert!(never.is_err());
    }
}
