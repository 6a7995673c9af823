//! What every RESP connection shares beside the node's `Shared`: the door's settings and its
//! node-wide memory bounds (input buffers, tensors being assembled for the weights view).

use std::sync::Arc;

use super::expiry::Expiry;
use super::forward;
use crate::config::RespConfig;

/// What every RESP connection shares beside the node's [`Shared`].
pub(crate) struct RespShared {
    pub(crate) config: RespConfig,
    /// The address the door listens on (for `INFO`).
    pub(crate) addr: std::net::SocketAddr,
    /// Open RESP connections (for `INFO`).
    pub(crate) clients: std::sync::atomic::AtomicU64,
    /// Ids handed to connections (`CLIENT ID`).
    pub(crate) next_id: std::sync::atomic::AtomicU64,
    /// Deadlines of the keys set with a TTL.
    pub(crate) expiry: Arc<Expiry>,
    /// The links that serve keys owned by other nodes.
    pub(crate) forward: forward::Forwarder,
    /// Bytes the weights view may hold at once for tensors being assembled.
    pub(crate) weights_memory: Budget,
    /// Bytes of input buffer the door's connections hold beyond their first `INPUT_BASE` each.
    pub(crate) input_memory: InputMemory,
}

/// The node-wide bound on RESP input buffers (`[resp] input_memory`): without it, the door's
/// memory was bounded only by `max_connections` × `max_command` (1 TiB at the defaults), since
/// every command but a large plain `SET` is buffered whole before it runs.
pub(crate) struct InputMemory {
    held: std::sync::atomic::AtomicU64,
    limit: u64,
}

impl InputMemory {
    pub(crate) fn new(limit: u64) -> InputMemory {
        InputMemory {
            held: Default::default(),
            limit,
        }
    }

    /// Takes `bytes` if the total stays within the limit.
    pub(super) fn take(&self, bytes: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.held
            .fetch_update(Relaxed, Relaxed, |h| {
                h.checked_add(bytes).filter(|&t| t <= self.limit)
            })
            .is_ok()
    }

    /// Adds `bytes` whatever the limit (capacity the allocator gave beyond what was taken).
    pub(super) fn add(&self, bytes: u64) {
        self.held
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn give(&self, bytes: u64) {
        self.held
            .fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes held now (`INFO memory`).
    pub(crate) fn held(&self) -> u64 {
        self.held.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The door's bound on bytes held for assembling tensors, across its connections: permits of
/// 1 KiB.
pub(crate) struct Budget {
    permits: tokio::sync::Semaphore,
    limit: u64,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Budget {
        let kib = limit / 1024;
        let kib = kib.min(tokio::sync::Semaphore::MAX_PERMITS as u64) as usize;
        Budget {
            permits: tokio::sync::Semaphore::new(kib),
            limit: kib as u64 * 1024,
        }
    }

    /// Room for `bytes`, waiting up to `within` for other assemblies to finish. Err: the reply
    /// line (too large ever, or no room in time).
    pub(super) async fn reserve(
        &self,
        bytes: u64,
        within: std::time::Duration,
    ) -> Result<tokio::sync::SemaphorePermit<'_>, String> {
        // Sizes come from a manifest: compared before any arithmetic on them.
        if bytes > self.limit {
            return Err(format!(
                "ERR kvpool: {bytes} bytes is more than the weights view serves at once \
                 ([resp] weights_memory = {})",
                self.limit
            ));
        }
        let kib = u32::try_from(bytes.div_ceil(1024))
            .map_err(|_| "ERR kvpool: tensor too large".to_string())?;
        match tokio::time::timeout(within, self.permits.acquire_many(kib)).await {
            Ok(Ok(p)) => Ok(p),
            _ => Err(
                "ERR kvpool: the weights view is busy assembling other tensors; \
                      retry (or raise [resp] weights_memory)"
                    .into(),
            ),
        }
    }
}
