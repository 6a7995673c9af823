//! # kvpool-bench
//!
//! The library half of `kvpool-bench`: the cache-hit-rate harness ([`replay`]), which replays
//! real request traces against simulated policies and against a real kvpool, and the [`units`]
//! both subcommands parse and print. The `perf` subcommand lives in the binary (it installs a
//! counting global allocator to measure the index).

pub mod replay;
pub mod units;
