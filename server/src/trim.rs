//! Handing freed heap memory back to the kernel.
//!
//! glibc's allocator keeps what it frees for reuse: after a crowd of connections that held
//! many small allocations (watched keys, pre-handshake buffers) goes, the node's resident
//! memory would stay where it peaked. Two things hand it back:
//!
//! - [`keep_heap_small`], at start: fixed thresholds instead of glibc's adaptive ones. By
//!   default glibc raises its mmap threshold, and with it the size an arena's free top may
//!   keep, up to 32 and 64 MiB each time a large block is freed, and `malloc_trim` never
//!   shrinks a thread arena's top: memory that crept up round after round of watchers
//!   (+20 MiB per round of 16 connections × 65 536 watches). Fixed at 4 MiB, blocks of 4 MiB
//!   and more are mapped and unmapped on their own and a free top past 4 MiB is returned.
//! - [`after_release`]: asks the allocator to return the free pages inside its arenas
//!   (`malloc_trim`), once, on a blocking thread, however many releases ask at once.

use std::sync::atomic::{AtomicBool, Ordering};

/// A trim is queued or running.
static QUEUED: AtomicBool = AtomicBool::new(false);

/// Asks for the heap's free pages to be handed back soon (off the caller's thread when a
/// runtime is there to take it).
pub(crate) fn after_release() {
    if QUEUED.swap(true, Ordering::AcqRel) {
        return;
    }
    let trim = || {
        QUEUED.store(false, Ordering::Release);
        trim_now();
    };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn_blocking(trim);
        }
        Err(_) => trim(),
    }
}

/// Bytes from which a block is mapped on its own, and past which an arena's free top is
/// handed back.
const THRESHOLD: i32 = 4 << 20;

/// Fixes the allocator's thresholds (see the module's docs); call once, at start.
pub fn keep_heap_small() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt takes two ints and changes the allocator's parameters under its own
    // lock; called before the daemon's threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, THRESHOLD);
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_now() {
    // SAFETY: malloc_trim takes a byte count and only walks the allocator's own free lists,
    // under its own locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_now() {}
