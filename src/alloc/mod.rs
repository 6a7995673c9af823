//! Allocator.
