//! How many threads a large same-host copy spreads over. A batched get of 8 MiB or more is
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
