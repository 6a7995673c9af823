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
