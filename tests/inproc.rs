//! The client driven against the daemon's own connection handler over in-memory streams: every
//! node is a [`kvpool_server::Node`] served in this test's runtime, and every client reaches
//! it through a connector that hands it a stream to the node its endpoint names. No process
//! starts and no socket opens, so the client's logic (routing, batching, view changes,
//! fallback owners, vouching, replicas, reconnects, timeouts, refusals, handoff) is tested
//! against the real handler in one process.
#![cfg(not(loom))]

#[path = "inproc/cluster.rs"]
mod cluster;
#[path = "inproc/conns.rs"]
mod conns;
#[path = "inproc/data.rs"]
mod data;
#[path = "inproc/handoff.rs"]
mod handoff;
#[path = "inproc/harness.rs"]
mod harness;
#[path = "inproc/limits.rs"]
mod limits;
