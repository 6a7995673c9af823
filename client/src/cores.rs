//! Where same-host copies run: a large one off the runtime's worker ([`off_runtime`]), and
//! over how many threads it spreads. A batched get of 8 MiB or more is
//! copied on several threads, which pays when cores are idle; when other callers of this
//! process are copying already (four engine threads loading at once on a 2-core host), more
//! threads only add spawns and preemption. So each copy counts the threads it runs on while
//! it runs, and a large one takes only the cores the others leave free (at least its own).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

/// Bytes of same-host copies from which one call spreads them over the free cores.
pub(crate) const PARALLEL_COPY_MIN: u64 = 8 << 20;

/// Threads of this process copying out of mappings right now.
static COPYING: AtomicUsize = AtomicUsize::new(0);

fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The threads one copy runs on, counted in [`COPYING`] until it is dropped.
pub(crate) struct CopyThreads(usize);

impl CopyThreads {
    /// Threads for a copy of `bytes` in `jobs` pieces: one below [`PARALLEL_COPY_MIN`],
    /// otherwise the cores no other copy is using, at most one per piece and at least one.
    pub(crate) fn claim(bytes: u64, jobs: usize) -> CopyThreads {
        let n = if bytes < PARALLEL_COPY_MIN {
            1
        } else {
            cores()
                .saturating_sub(COPYING.load(Relaxed))
                .min(jobs)
                .max(1)
        };
        COPYING.fetch_add(n, Relaxed);
        CopyThreads(n)
    }

    pub(crate) fn get(&self) -> usize {
        self.0
    }
}

impl Drop for CopyThreads {
    fn drop(&mut self) {
        COPYING.fetch_sub(self.0, Relaxed);
    }
}

/// Same-host copies of at least this many bytes give their worker thread's other tasks to
/// another thread first.
const OFF_RUNTIME: u64 = 1 << 20;

/// Runs `copy`, a same-host copy of `bytes`: a large one on a multi-threaded runtime runs in
/// `block_in_place`, so the runtime moves this worker's other tasks (the client's small
/// requests) to another thread instead of leaving them behind a copy of milliseconds. On a
/// current-thread runtime, or outside one, it runs inline.
pub(crate) fn off_runtime<T>(bytes: u64, copy: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let multi =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if bytes >= OFF_RUNTIME && multi {
        tokio::task::block_in_place(copy)
    } else {
        copy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_copy_takes_only_the_cores_others_leave_free() {
        // Tests of this crate may copy concurrently: only what this test holds is asserted
        // relative to what it sees.
        let small = CopyThreads::claim(PARALLEL_COPY_MIN - 1, 8);
        assert_eq!(small.get(), 1, "small copies stay on the caller's thread");
        let one_piece = CopyThreads::claim(PARALLEL_COPY_MIN, 1);
        assert_eq!(one_piece.get(), 1, "never more threads than pieces");
        let held: Vec<CopyThreads> = (0..cores()).map(|_| CopyThreads::claim(1, 1)).collect();
        let busy = CopyThreads::claim(64 << 20, 64);
        assert_eq!(
            busy.get(),
            1,
            "every core busy: the caller's own thread only"
        );
        drop((held, busy, small, one_piece));
    }
}
