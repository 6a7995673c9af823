//! The Redis-protocol front door (`listen.resp`): RESP2 and RESP3 over TCP, so that redis
//! clients (redis-py, redis-cli, LMCache's `redis://` and `resp://` connectors, SGLang's remote
//! weight loader) use the pool unchanged.
//!
//! One task per connection reads into a buffer, parses every complete command in it with the
//! core's bounded [`kvpool::resp::Parser`], executes each through the same data operations as
//! the native protocol (`crate::service`), and writes the replies in order, flushing when no
//! further command is buffered (pipelining). A GET's value goes from the pool to the socket
//! without a copy when it is large. A command the door does not know is answered with an error
//! and the connection goes on; bytes that are not RESP are answered with an error and the
//! connection is closed, as Redis does.
//!
//! - `serve`: the read loop of one connection;
//! - `conn`: one connection's state and what every command uses;
//! - `shared`: what the door's connections share, and its memory bounds;
//! - `commands`: the command table;
//! - `admin`: the replies of `INFO`, `COMMAND`, `CONFIG GET` and `HELLO`;
//! - `glob`: `SCAN ... MATCH` patterns;
//! - `weights`: the weights view that SGLang's remote loader reads a published model through;
//! - `expiry`: deadlines of keys set with a TTL; `forward`: keys owned by other nodes.

mod admin;
mod commands;
mod conn;
mod expiry;
mod forward;
mod glob;
mod serve;
mod shared;
mod weights;

pub(crate) use expiry::{sweeper, Expiry};
pub(crate) use forward::Forwarder;
pub(crate) use serve::serve;
pub(crate) use shared::{Budget as WeightsBudget, InputMemory, RespShared};
