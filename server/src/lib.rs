//! # kvpool-server
//!
//! The cache daemon `kvpoold`: it contributes DRAM to the pool and serves it over TCP (the
//! default data path), QUIC (TLS 1.3, for links that need encryption) and a Unix socket (for
//! same-host clients, which then map the segments and read and write them directly).
//!
//! - [`config`]: the TOML file, environment and flags, with documented defaults;
//! - [`Daemon`]: start, serve, drain on shutdown;
//! - [`Node`] (`node`): a node served in this process over in-memory streams, by the same
//!   connection handler, for tests that start no process;
//! - `handler`: one connection's native-protocol request loop, shared by every transport, with
//!   `deadline`'s timeouts on its reads and writes; one file per family of operations (`admin`,
//!   `data`, `one_sided`, `prefix`, `cluster`);
//! - `service`: what every connection shares (`Shared`) and the data operations apart from any
//!   wire protocol (authenticate a token, put, get, exists, remove), for every front door;
//! - `events`: KV events for cache-aware routers (`KvEvents`): keys stored in and removed
//!   from each tier, per namespace, in bounded per-subscriber queues;
//! - `ledger`: everything a peer can make the node hold (pending allocations, holds, watches,
//!   leases, tombstones, staging areas), counted per connection and per namespace against
//!   `[limits]`, and released when its connection closes;
//! - `listeners`: the accept loops, with `admission`'s fd limit, per-peer cap and backoff, and
//!   `reaper`'s closing of the oldest unauthenticated connection when slots or descriptors run
//!   short;
//! - `auth_limit`: failed authentications, throttled per address and across the node;
//! - `trim`: heap memory freed by closed connections given back to the OS;
//! - `cluster`: this node's view of the cluster (`Cluster`), kept by heartbeats;
//! - `mover`: pinned objects moved to their owners after a change, and the drain;
//! - `peers`: connections to the other nodes of a view, and copies sent to them;
//! - `handover`: unpinned objects handed to their new owners when a node drains or joins;
//! - `settle`: reads while the cluster settles, asking the nodes that held a key this node took
//!   over to move its pinned object here before the read misses it;
//! - `written`: the keys written or removed here, so a previous owner's older copy is never
//!   served over them;
//! - `etcd_gateway`: membership through etcd instead (leases, the view derived and watched), over an
//!   HTTP/1.1 client (`http`, on hyper) to etcd's JSON gateway;
//! - `resp`: the Redis-protocol front door (`listen.resp`): RESP2/RESP3 commands mapped onto
//!   the same data operations as the native protocol;
//! - [`metrics`]: Prometheus counters and histograms, served over HTTP;
//! - [`secret`]: the cluster secret that authenticates nodes to each other (docs/SECURITY.md);
//! - `fuzzing` (feature `fuzzing`): one connection served from a byte string, for `fuzz/`.

mod admission;
mod auth_limit;
mod bulk;
mod cluster;
pub mod config;
mod daemon;
mod deadline;
mod disk_tier;
mod etcd_gateway;
mod events;
mod fabric;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
mod handler;
mod handover;
mod http;
mod ledger;
mod listeners;
pub mod metrics;
mod mover;
mod node;
mod peer;
mod peers;
mod reaper;
mod resp;
mod restart;
pub mod secret;
mod service;
mod settle;
mod staging;
pub mod tls;
mod trim;
mod watch;
mod written;

pub use config::Config;
pub use daemon::{Bound, Daemon};
pub use kvpool::segment::host_id;
pub use node::Node;
pub use trim::keep_heap_small;
