//! What every whole-system test binary shares: the harness (the `kvpool-system-tests` library,
//! re-exported) and the multi-node helpers, which drive the client.

#![allow(
    dead_code,
    unreachable_pub,
    unused_imports,
    reason = "each test binary uses a different subset"
)]

pub mod cluster;
pub mod raw;

pub use kvpool_system_tests::*;
