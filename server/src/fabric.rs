//! The node's fabric (`[listen] fabric`): every segment registered with a libfabric provider
//! (`tcp`, `shm`, `verbs;ofi_rxm`, `efa`), so that a client reads objects one-sidedly by global
//! address (`fabric://` endpoints), and a thread of its own that drives the provider's progress.
//!
//! A segment's registration is a capability: its key (64 random bits where the provider lets
//! the node choose) is handed, with `FabricInfo`, only to connections whose token admits to
//! every namespace the segment holds, by the same rule as `MapInfo`'s descriptors; a tenant's
//! namespace has a segment of its own, so a key reaches one tenant's objects or the common
//! ones. Keys die with the daemon: a restarted node registers its new segments anew. A provider
//! that checks no keys (`shm`) is offered only to tokens that admit to every segment.
//!
//! What a read finds is checked by the client: the object's version word, read after its
//! bytes, and its checksum (docs/ARCHITECTURE.md, "Fabric").

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use kvpool::protocol::{ErrorCode, FabricSegment, Reply};
use kvpool::Pool;
use kvpool_fabric::{Fabric, Registration};

/// How long the progress thread sleeps on its queue before looking at its stop flag.
const WAIT_MS: i32 = 100;

/// How long the progress of a provider without a descriptor to sleep on (`shm`) pauses when
/// it found nothing to do: the most a peer's access waits for it to look again.
const IDLE: Duration = Duration::from_micros(20);

/// The node's registrations and the thread that serves them.
pub(crate) struct NodeFabric {
    provider: String,
    address: Vec<u8>,
    checks_keys: bool,
    /// Per registered segment, what a client needs to reach it.
    segments: Vec<FabricSegment>,
    stop: Arc<AtomicBool>,
    progress: Option<JoinHandle<()>>,
    /// Closed before the pool (and so the segments' memory) can go: fields drop in order.
    registrations: Vec<Registration>,
    _pool: Arc<Pool>,
}

impl NodeFabric {
    /// Opens `provider`, registers every segment of `pool` for peers' reads and starts the
    /// progress thread.
    pub(crate) fn open(provider: &str, pool: &Arc<Pool>) -> anyhow::Result<NodeFabric> {
        let fabric = Fabric::open(provider)
            .with_context(|| format!("opening the fabric provider {provider:?}"))?;
        let mut endpoint = fabric
            .serving_endpoint()
            .context("opening the fabric endpoint")?;
        let address = endpoint.name().context("the fabric endpoint's address")?;
        let mut registrations = Vec::new();
        let mut segments = Vec::new();
        for seg in pool.segments() {
            let (base, len) = seg.mapping();
            // SAFETY: the segment's mapping stays at `base` for the segment's life, and the
            // segment lives as long as the pool, which this value holds (`_pool`) and drops
            // only after the registrations (field order); remote access is read-only.
            let reg = unsafe { endpoint.register_memory(base, len, true, false) }
                .with_context(|| format!("registering segment {}", seg.layout().id))?;
            let remote = reg.remote();
            segments.push(FabricSegment {
                id: seg.layout().id,
                addr: remote.addr,
                key: remote.key,
                total_len: remote.len,
            });
            registrations.push(reg);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let progress = std::thread::Builder::new()
            .name("kvpool-fabric".into())
            .spawn(move || {
                while !stopping.load(Ordering::Relaxed) {
                    // A peer's failed access (a forged key, a range out of bounds) shows
                    // here as an error; the provider has refused it, and serving goes on.
                    if let Err(e) = endpoint.wait(WAIT_MS, IDLE) {
                        tracing::debug!(error = %e, "a peer's fabric access failed");
                    }
                }
            })
            .context("starting the fabric progress thread")?;
        let checks_keys = fabric.checks_keys();
        let provider = fabric.provider();
        tracing::info!(
            %provider,
            checks_keys,
            segments = segments.len(),
            "segments registered with the fabric"
        );
        if !checks_keys {
            tracing::warn!(
                %provider,
                "this provider checks no memory keys: its segments are offered only to tokens \
                 that admit to every namespace (docs/SECURITY.md)"
            );
        }
        Ok(NodeFabric {
            provider,
            address,
            checks_keys,
            segments,
            stop,
            progress: Some(progress),
            registrations,
            _pool: pool.clone(),
        })
    }

    /// The `FabricInfo` answer for a connection: the segments its token admits to
    /// (`reachable`, by segment id), or why none.
    pub(crate) fn offer(
        &self,
        incarnation: u64,
        reachable: impl Fn(u32) -> bool,
    ) -> Result<Reply, (ErrorCode, &'static str)> {
        let segments: Vec<FabricSegment> = self
            .segments
            .iter()
            .filter(|s| reachable(s.id))
            .cloned()
            .collect();
        if !self.checks_keys && segments.len() != self.segments.len() {
            return Err((
                ErrorCode::Unauthorized,
                "this node's fabric provider checks no memory keys: only a token that admits \
                 to every namespace may use it",
            ));
        }
        Ok(Reply::FabricInfo {
            incarnation,
            provider: self.provider.clone(),
            address: self.address.clone(),
            segments,
        })
    }

    /// Bytes registered.
    pub(crate) fn registered_bytes(&self) -> u64 {
        self.registrations.iter().map(|r| r.len() as u64).sum()
    }
}

impl Drop for NodeFabric {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.progress.take() {
            let _ = t.join();
        }
    }
}
