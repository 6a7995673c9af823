//! Giving the heap's freed memory back to the operating system.
//!
//! The daemon uses the system allocator, glibc's malloc on Linux, which keeps what is freed for
//! later allocations instead of returning it: after a crowd of connections goes (a thousand
//! peers that each sent part of a 64 KiB header before authenticating; sixteen connections
//! that watched 65 536 keys each), the pages their buffers and tables touched would stay
//! resident. The pool's memory is not on the heap (its segments are mapped), so what stays is
//! the connections'. Two things hand it back:
//!
//! - [`keep_heap_small`], at start: fixed thresholds instead of glibc's adaptive ones. By
//!   default glibc raises its mmap threshold, and with it the size an arena's free top may
//!   keep, up to 32 and 64 MiB each time a large block is freed, and `malloc_trim` never
//!   shrinks a thread arena's top: memory crept up round after round of watchers. Fixed at
//!   4 MiB, blocks of 4 MiB and more are mapped and unmapped on their own, and a free top past
//!   4 MiB is returned.
//! - `malloc_trim(0)`, which returns every free page inside every arena. It walks the arenas
//!   under their locks, so it runs off the hot path and rarely: whoever releases heap memory
//!   reports the bytes ([`Trim::released`]: connections their buffers as they close, the watch
//!   registry a connection's watches), and a background task looks once per [`TRIM_EVERY`]
//!   and trims, on a blocking thread, only when at least [`TRIM_AFTER`] bytes were released
//!   since the last trim.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// Bytes released since the last trim that make the next look trim.
pub(crate) const TRIM_AFTER: u64 = 4 << 20;

/// How often the background task looks.
pub(crate) const TRIM_EVERY: Duration = Duration::from_secs(1);

/// The bytes released since the last trim.
#[derive(Debug, Default)]
pub(crate) struct Trim {
    released: AtomicU64,
}

impl Trim {
    /// A connection (or another holder of large heap buffers) freed `bytes` of them.
    pub(crate) fn released(&self, bytes: u64) {
        self.released.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Whether enough was released to trim now; if so, counting starts again.
    fn due(&self) -> bool {
        let released = self.released.load(Ordering::Relaxed);
        if released < TRIM_AFTER {
            return false;
        }
        // What was released meanwhile counts towards the next trim.
        self.released.fetch_sub(released, Ordering::Relaxed);
        true
    }
}

/// Bytes from which a block is mapped on its own, and past which an arena's free top is
/// handed back.
const THRESHOLD: i32 = 4 << 20;

/// Fixes the allocator's thresholds (see the module's docs); call once, at start, before the
/// daemon's threads start.
pub fn keep_heap_small() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt takes two ints and changes the allocator's parameters under its own
    // lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, THRESHOLD);
    }
}

/// Looks every [`TRIM_EVERY`] until shutdown, trimming the heap when it is due.
pub(crate) async fn run(trim: Arc<Trim>, mut shutdown: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(TRIM_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        if trim.due() {
            // A blocking thread: the walk takes the arenas' locks and may take milliseconds.
            let _ = tokio::task::spawn_blocking(release_free_memory).await;
        }
    }
}

/// Returns the allocator's free pages to the operating system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_free_memory() {
    // SAFETY: malloc_trim only walks and advises the allocator's own free lists, under their
    // locks; any thread may call it at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other allocators give memory back on their own (or offer no such call).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_free_memory() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_is_due_only_after_enough_was_released_and_counting_restarts() {
        let t = Trim::default();
        t.released(TRIM_AFTER - 1);
        assert!(!t.due());
        t.released(1);
        assert!(t.due());
        assert!(!t.due(), "counting starts again");
        t.released(TRIM_AFTER);
        assert!(t.due());
    }

    #[tokio::test(start_paused = true)]
    async fn the_task_trims_when_due_and_stops_on_shutdown() {
        let t = Arc::new(Trim::default());
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(run(t.clone(), shutdown));
        t.released(TRIM_AFTER);
        tokio::time::sleep(TRIM_EVERY * 2).await;
        assert!(!t.due(), "the task trimmed and started counting again");
        stop.send(true).unwrap();
        task.await.unwrap();
    }
}
