//! One connection (or one QUIC stream) of the native protocol: read a frame, do what it asks,
//! answer; repeat.
//!
//! Requests are answered in the order they arrive, each tagged with its id, so a client may
//! pipeline as many as it likes; responses are flushed when no further request is already
//! buffered. Every request consumes exactly its payload, even when it fails, so one bad request
//! never desynchronises the stream. A frame that breaks the protocol itself (bad magic, a header
//! over the limit) is answered with an error and the connection is closed: after it nothing on
//! the stream can be trusted.
//!
//! - `serve`: the connection's life and its policies (the handshake's deadline and small
//!   buffers, the idle timeout, a watching connection's events between requests);
//! - `conn`: the connection's state, the checks every request passes, replies and errors;
//! - `dispatch`: each operation handed to its family;
//! - `held`: the objects a connection holds and its pending allocations;
//! - `admin`: `Hello` (the handshake), `Stats`;
//! - `data`: `Put`, `Get`, `BatchPut`, `BatchGet` (its prefix mode included), `Exists`,
//!   `Remove`, `Clear`, `Scan`, over the transport-independent operations of [`crate::service`];
//! - `one_sided`: `Alloc`, `Write`, `Commit`, `Abort`, `Read`, `MapInfo` (access by address);
//! - `prefix`: `Lookup`, `Release`, `Pin` (finding, leasing and pinning objects by key);
//! - `handoff`: `Watch`, `Unwatch`, `Subscribe`, `Fail`, `Cancel` (docs/HANDOFF.md);
//! - `kv_events`: `KvEvents` (KV events for routers) and the writing of their batches;
//! - `cluster`: `ClusterAuth`, `Gossip`, `View`, `Drain`, `Vouch`, `Move` (node to node).

mod admin;
mod cluster;
mod conn;
mod data;
mod dispatch;
mod handoff;
mod held;
mod kv_events;
mod one_sided;
mod prefix;
mod serve;

pub(crate) use conn::BULK_CHUNK;
pub(crate) use serve::{serve, Accepted};
