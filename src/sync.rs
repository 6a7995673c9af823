//! The one place atomics come from, so that `--cfg loom` can swap in loom's model-checked ones
//! (the shape tokio and bytes use). Everything lock-free in the core imports from here.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

/// Locks a std mutex, recovering from poisoning: every critical section in the core (the pool's
/// shards and allocators, the journal) leaves its data consistent before anything that could
/// panic.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
