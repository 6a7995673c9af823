//! # kvpool-client
//!
//! The embedded client of kvpool, for inference servers: put and get KV blocks and weights,
//! batched prefix lookups (`batch_exists`), zero-copy batched gets into caller buffers, and
//! one-sided reads and writes by global address.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvpool_client::ClientError> {
//! use kvpool_client::{Client, ClientConfig};
//! let kv = Client::connect("tcp://127.0.0.1:7370", ClientConfig::default()).await?;
//! kv.put(b"block-0", &[1u8; 4096]).await?;
//! let mut buf = vec![0u8; 4096];
//! assert_eq!(kv.get_into(b"block-0", &mut buf).await?, Some(4096));
//! # Ok(()) }
//! ```
//!
//! When the node runs on the same host the client notices (same kernel boot id, reachable Unix
//! socket), maps the node's segments and moves bytes with plain loads and stores; only the
//! small control exchanges (lookup, alloc, commit) cross a socket. [`blocking::Client`] wraps
//! the same client for code that is not async.
//!
//! Components, each module using only those after it: [`Client`] (`client`: routing by the
//! cluster view, one fan-out per batch, timeouts on every call; `blocking` wraps it), `link`
//! (one node: pooled connections, its handshake, and the same-host path to it: mapped
//! segments, staging, the index of objects seen), `conn` (one framed stream: TCP, QUIC stream
//! or Unix socket), `seen` (the index of where same-host objects are), `staging` (the area
//! same-host puts go through when the mapping is read-only), `local` (the same-host mapping),
//! `cores` (where large copies run), `dst` (the buffers a get fills), [`Located`]
//! (`located`), [`Endpoint`], [`ClientConfig`] (`config`), [`Connector`] (`connector`: streams
//! opened in place of the network, such as to a node served in the same process) and
//! [`ClientError`] (`error`).
//! [`weights`] stores and loads model weights over a [`Client`].

pub mod blocking;

/// The README's examples, compiled as doctests so they can't rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

mod client;
mod config;
mod conn;
mod connector;
mod cores;
mod dst;
mod endpoint;
mod error;
mod link;
mod local;
mod located;
mod seen;
mod staging;
pub mod weights;

pub use client::{
    Client, KeyEvent, KvEventBatch, KvEvents, LocalHold, Prefix, Subscription, WaitOutcome,
};
pub use config::{ClientConfig, SameHost};
pub use connector::{BoxStream, ByteStream, Connecting, Connector};
pub use endpoint::Endpoint;
pub use error::ClientError;
pub use kvpool::prefix::PrefixSeed;
pub use kvpool::protocol::{ErrorCode, Priority};
pub use kvpool::protocol::{KvEvent, KvEventKind, KvTier};
pub use kvpool::GlobalAddr;
pub use local::{ReadView, ViewError};
pub use located::Located;
