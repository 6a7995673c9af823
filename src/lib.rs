//! kvpool core.

pub mod alloc;
