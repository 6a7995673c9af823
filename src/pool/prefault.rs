//! The prefaulting thread: faults segment memory in ahead of the allocations, so that fresh
//! blocks are written into pages that are already there (see [`crate::mapping::Frontier`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::Thread;

use super::Pool;

/// Wakes the prefaulting thread when allocations reach fresh memory; stops it when the pool
/// is dropped.
pub(super) struct Wake {
    thread: Thread,
    stop: Arc<AtomicBool>,
}

impl Wake {
    pub(super) fn wake(&self) {
        self.thread.unpark();
    }
}

impl Drop for Wake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

impl Pool {
    /// Starts a thread that keeps up to `window` bytes of the segments faulted in ahead of the
    /// allocations (split evenly among the segments, and never more ahead than a segment's
    /// allocations reached: an idle pool commits nothing it has not used). It runs until the
    /// pool is dropped. False when `window` is 0 or a thread was already started.
    pub fn start_prefaulting(self: &Arc<Pool>, window: u64) -> std::io::Result<bool> {
        if window == 0 || self.prefault.get().is_some() {
            return Ok(false);
        }
        let per_segment = window / self.segments.len().max(1) as u64;
        let stop = Arc::new(AtomicBool::new(false));
        let pool = Arc::downgrade(self);
        let stopped = stop.clone();
        let handle = std::thread::Builder::new()
            .name("kvpool-prefault".into())
            .spawn(move || loop {
                if stopped.load(Ordering::Acquire) {
                    return;
                }
                let Some(pool) = pool.upgrade() else { return };
                // One region of each segment that has one to do, in turn.
                let mut worked = false;
                for s in &pool.segments {
                    worked |= s.segment.prefault_next(per_segment);
                }
                drop(pool);
                if !worked {
                    // Until an allocation reaches fresh memory (or the pool is dropped); a
                    // wake that came since the pass above returns at once.
                    std::thread::park();
                }
            })?;
        let wake = Wake {
            thread: handle.thread().clone(),
            stop,
        };
        // Allocations made before the wake was set: one pass now.
        wake.wake();
        Ok(self.prefault.set(wake).is_ok())
    }

    /// Bytes faulted in ahead of the allocations so far, per segment.
    pub fn prefaulted_bytes(&self) -> impl Iterator<Item = u64> + '_ {
        self.segments.iter().map(|s| s.segment.prefaulted_bytes())
    }
}
