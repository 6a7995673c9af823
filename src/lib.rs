//! # kvpool core
//!
//! The parts of kvpool that hold no sockets and spawn no tasks: what a node's memory is and how
//! objects live in it. The daemon (`kvpool-server`) and the client (`kvpool-client`) are thin
//! shells around it.
//!
//! - [`segment`]: DRAM regions mapped from files in `/dev/shm` (or anonymous memory) that
//!   same-host clients can map too; a version word per granule lives inside.
//! - [`alloc`]: a size-class allocator of offsets in a segment, O(1), no heap per allocation.
//! - [`addr`]: global addresses `(node, incarnation, segment, offset, len, generation, key)`
//!   and the memory keys that make them unforgeable.
//! - [`seqlock`]: the per-block version protocol that turns a read racing with reuse into a
//!   miss instead of torn bytes (model-checked with loom).
//! - [`claims`]: the rule that keeps concurrent writers of one pending allocation on disjoint
//!   byte ranges (model-checked with loom).
//! - [`pool`]: the object index (sharded; a pluggable eviction policy per namespace), two-phase
//!   puts, read references, leases, pins, quota reservations, eviction and one-sided access;
//!   at start-up, the recovery of a previous life's objects from its segment files.
//! - [`disk`]: the on-disk store of a second tier: a capped log of regions, dropped oldest
//!   first, with an index rebuilt from it at open; every read verified.
//! - [`journal`]: the append-only record of a pool's index changes that lets a restarted
//!   daemon find its objects again.
//! - [`protocol`]: frames, messages and error codes of the wire protocol.
//! - [`placement`]: the cluster view and weighted rendezvous placement of keys; where requests
//!   go and what a view change moves ([`placement::routing`]), and which objects a node may
//!   still serve as their owner's copy ([`placement::history`]).
//! - [`route`]: the routing plan of one request: the nodes a write goes to, the nodes a read
//!   asks in turn (owner, replicas, the previous owner while the view changes), and what each
//!   answer means, for every speaker that reaches nodes for a client.
//! - [`membership`]: one node's view of the cluster and every rule that changes it (gossip
//!   merges, refuting, failure detection, joining, etcd-derived views), without I/O: the daemon
//!   carries messages and clock readings in.
//! - [`resp`]: the Redis protocol (RESP2/RESP3) of the daemon's second front door: a bounded,
//!   incremental command parser and the reply encoder.
//! - [`weights`]: model weights in the pool: safetensors headers, the manifest of a published
//!   model, its keys, and the byte ranges of a tensor-parallel slice.

#![cfg_attr(loom, allow(dead_code, unused_imports))]

#[cfg(not(loom))]
pub mod addr;
#[cfg(not(loom))]
pub mod alloc;
#[cfg(not(loom))]
pub mod checksum;
pub mod claims;
#[cfg(not(loom))]
pub mod disk;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
pub mod eviction;
#[cfg(not(loom))]
pub mod fdpass;
#[cfg(not(loom))]
pub mod journal;
mod le;
#[cfg(not(loom))]
pub mod mapping;
#[cfg(not(loom))]
pub mod membership;
mod paged;
#[cfg(not(loom))]
pub mod placement;
#[cfg(not(loom))]
pub mod pool;
#[cfg(not(loom))]
pub mod prefix;
#[cfg(not(loom))]
pub mod protocol;
#[cfg(not(loom))]
pub mod resp;
#[cfg(not(loom))]
pub mod route;
#[cfg(not(loom))]
pub mod segment;
pub mod seqlock;
mod sync;
#[cfg(not(loom))]
pub mod units;
#[cfg(not(loom))]
pub mod weights;

#[cfg(not(loom))]
pub use addr::{GlobalAddr, NodeId};
#[cfg(not(loom))]
pub use checksum::checksum;
#[cfg(not(loom))]
pub use error::{AddrFault, PoolError, MAX_KEY_LEN};
#[cfg(not(loom))]
pub use pool::{Claim, Commit, CommitObserver, LowerTier, Millis, Pool, PoolConfig, Victim};
