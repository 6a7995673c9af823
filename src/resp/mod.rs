//! The Redis protocol (RESP2 and RESP3) as the daemon's second front door speaks it: a bounded,
//! incremental command parser and the reply encoder. No I/O: the daemon feeds bytes in and
//! writes the encoded bytes out (`kvpool-server`'s `resp` module).
//!
//! - [`Parser`]: commands in both forms a client may send: arrays of bulk strings (what every
//!   client library sends) and inline commands (a line of words, what `telnet` and
//!   `redis-cli` in pipe mode send), pipelined back to back. It keeps its place between calls,
//!   so bytes arriving a few at a time are scanned once, and it answers where the command's
//!   arguments lie in the caller's buffer: no argument is copied.
//! - [`encode`]: the replies (simple strings, errors, integers, bulk strings, nulls, arrays and
//!   RESP3 maps), written into a caller's `Vec<u8>`.
//!
//! Everything a peer declares is checked against [`RespLimits`] before it is believed: a bulk
//! length, an argument count, an inline line, the bytes of one command. The parser never
//! reserves memory on a declared length; the arguments it records grow with the bytes that
//! actually arrived (each costs at least four bytes on the wire).

pub mod encode;
mod parse;

pub use parse::{parse_int, Parsed, Parser, PendingBulk, RespError};

/// Bounds on what one command may declare. The defaults are Redis's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RespLimits {
    /// Largest bulk string (one key or value). Default 512 MiB (Redis's `proto-max-bulk-len`).
    pub max_bulk: u64,
    /// Most arguments in one command. Default 1 048 576 (Redis's multibulk bound is 1024×1024
    /// before authentication too).
    pub max_args: u64,
    /// Longest inline command line, and longest header line. Default 64 KiB (Redis's
    /// `PROTO_INLINE_MAX_SIZE`).
    pub max_inline: usize,
    /// Most bytes of one command, arguments and framing together. Default 1 GiB (Redis's
    /// `client-query-buffer-limit`).
    pub max_command: u64,
}

impl Default for RespLimits {
    fn default() -> Self {
        RespLimits {
            max_bulk: 512 << 20,
            max_args: 1 << 20,
            max_inline: 64 << 10,
            max_command: 1 << 30,
        }
    }
}

/// Which protocol a connection speaks: RESP2 until a `HELLO 3`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Proto {
    /// RESP2: nulls are `$-1`, maps are flat arrays.
    #[default]
    Resp2,
    /// RESP3: nulls are `_`, maps are `%`.
    Resp3,
}

#[cfg(test)]
mod tests;
