//! Errors of the core's operations. Each has a stable numeric code on the wire
//! ([`crate::protocol::ErrorCode`]).

use thiserror::Error;

/// Largest key, in bytes.
pub const MAX_KEY_LEN: usize = 256;

/// Why a one-sided access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum AddrFault {
    /// The address names another node.
    #[error("address belongs to another node")]
    WrongNode,
    /// No such segment on this node.
    #[error("no such segment")]
    NoSegment,
    /// The memory key does not match the address.
    #[error("wrong memory key")]
    WrongKey,
    /// The range falls outside the object or the segment.
    #[error("range out of bounds")]
    OutOfBounds,
    /// The object at the address is gone or was replaced (generation mismatch): a cache miss.
    #[error("stale address: the object was evicted or replaced")]
    Stale,
    /// Writes are only accepted into allocations that are not yet committed.
    #[error("object is not writable (already committed or expired)")]
    NotWritable,
    /// Another write into the same pending allocation is still in progress.
    #[error("a write into this allocation is still in progress")]
    Busy,
    /// The address (or the same-host mapping it was read through) belongs to another
    /// incarnation of the node's daemon: it was issued before a restart, or the mapping is of a
    /// segment file of a daemon that is gone. Nothing it named exists any more: a miss.
    #[error("address of another incarnation of the node (the daemon restarted)")]
    WrongIncarnation,
}

/// Errors of pool operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum PoolError {
    /// The namespace id is not configured on this node.
    #[error("unknown namespace")]
    UnknownNamespace,
    /// Keys are 1 to 256 bytes, or fewer where the node is configured so
    /// (`limits.max_key_len`).
    #[error(
        "key must be 1 to {MAX_KEY_LEN} bytes, or fewer where the node sets limits.max_key_len"
    )]
    BadKey,
    /// The value is larger than a segment can ever hold.
    #[error("value too large for this pool")]
    TooLarge,
    /// No memory is free and nothing can be evicted (everything pinned, leased or being read).
    #[error("pool full: nothing evictable")]
    PoolFull,
    /// The namespace's byte quota is used up by objects that can't be evicted.
    #[error("namespace quota exceeded")]
    QuotaExceeded,
    /// No such object (a miss).
    #[error("not found")]
    NotFound,
    /// A one-sided access was refused.
    #[error("bad address: {0}")]
    BadAddress(#[from] AddrFault),
    /// The bytes do not match the checksum given with them.
    #[error("checksum mismatch")]
    ChecksumMismatch,
    /// The allocation's key was cancelled (`Cancel`) before the allocation was committed: it
    /// was released and will never be committed.
    #[error("the allocation was cancelled (a Cancel of its key) before its commit")]
    Cancelled,
}
