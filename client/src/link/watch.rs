//! Whether a link may serve reads from its index of where same-host objects are without asking
//! the node: only while a watch connection to the node stays open.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::ClientConfig;
use crate::conn::Conn;
use crate::endpoint::Endpoint;

/// Keeps the seen index honest about the daemon's life. Reads from the index ask the node
/// nothing, so a client would go on serving a dead daemon's last values out of its memory (and,
/// were another daemon started on other files, values it no longer has). So the index is only
/// read while a watch connection to the node, idle after its handshake, stays open: the
/// daemon's exit (or a restart, or an idle timeout closing it) ends the connection and the
/// watching task clears `alive` as soon as it runs; reads then look up through the socket, and
/// the first one the node answers arms a new watch. The task ends with the link (`stop`
/// dropped).
///
/// The watching task may run late on a busy machine, so a call of this client's own that finds
/// the node gone (a broken stream, a refused connect) ends the watch too, before it returns
/// ([`Watch::lost`]): after a call has failed that way, no read is served from the index until
/// the node answers again.
pub(super) struct Watch {
    /// The id of the watch that holds the index open; 0 while none does. Each watch clears it
    /// only if it still holds its own id, so a watch that ends late never closes the index a
    /// newer one opened.
    alive: Arc<AtomicU64>,
    /// The last id handed out.
    ids: AtomicU64,
    arming: Arc<AtomicBool>,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Watch {
    pub(super) fn new() -> Watch {
        Watch {
            alive: Arc::new(AtomicU64::new(0)),
            ids: AtomicU64::new(0),
            arming: Arc::new(AtomicBool::new(false)),
            stop: Mutex::new(None),
        }
    }

    pub(super) fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) != 0
    }

    /// The node was found gone by a call: the index closes now, and the watch's task is told to
    /// end (it clears nothing a newer watch set).
    pub(super) fn lost(&self) {
        self.alive.store(0, Ordering::Release);
        drop(self.stop.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    /// Starts a watch of the life of the node at `endpoint` (in `incarnation`, as the link
    /// knows it) in the background, unless one runs or is starting or the index is off. Called
    /// after the node answered, so a watch found dead is replaced.
    pub(super) fn arm(&self, cfg: &ClientConfig, endpoint: &Endpoint, incarnation: u64) {
        if cfg.local_index == 0 || self.alive() || self.arming.swap(true, Ordering::AcqRel) {
            return;
        }
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        *self.stop.lock().unwrap_or_else(|e| e.into_inner()) = Some(stop);
        let (alive, arming) = (self.alive.clone(), self.arming.clone());
        let id = self.ids.fetch_add(1, Ordering::Relaxed) + 1;
        let (endpoint, cfg) = (endpoint.clone(), cfg.clone());
        tokio::spawn(async move {
            let opened = Conn::open(&endpoint, &cfg, (None, false)).await;
            let Ok((conn, hello)) = opened else {
                arming.store(false, Ordering::Release);
                return;
            };
            if hello.incarnation != incarnation {
                // Restarted meanwhile: the link adopts the new life on its next call.
                arming.store(false, Ordering::Release);
                return;
            }
            alive.store(id, Ordering::Release);
            arming.store(false, Ordering::Release);
            let (mut reader, _writer) = conn.split();
            // The node sends nothing unasked: any outcome of this read (its end above all)
            // means the connection, and with it the watch, is over.
            tokio::select! {
                _ = reader.next() => {}
                _ = stopped => {}
            }
            let _ = alive.compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire);
        });
    }
}
