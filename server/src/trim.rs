//! Giving the heap's freed memory back to the operating system.
//!
//! The daemon uses the system allocator, glibc's malloc on Linux, which keeps what is freed in
//! the middle of its arenas for later allocations instead of returning it: after a thousand
//! connections close, the pages their buffers touched stay resident (about 35 to 90 MiB for a
//! thousand peers that each sent part of a 64 KiB header before authenticating). The pool's
//! memory is not on the heap (its segments are mapped), so what stays is the connections'.
//!
//! `malloc_trim(0)` returns every free page of every arena. It walks the arenas under their
//! locks, so it runs off the hot path and rarely: connections report the buffer bytes they
//! release when they close ([`Trim::released`]), and a background task looks once per
//! [`TRIM_EVERY`] and trims, on a blocking thread, only when at least [`TRIM_AFTER`] bytes were
//! released since the last trim.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// Bytes released since the last trim that make the next look trim.
pub(crate) const TRIM_AFTER: u64 = 16 << 20;

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
