//! Error codes on the wire.

use crate::error::{AddrFault, PoolError};

/// Every error a node can answer with. Stable: the numbers are part of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// No error (used in per-item status lists).
    Ok = 0,
    /// The frame could not be decoded.
    Malformed = 1,
    /// The frame's header or payload exceeds the limits; the connection is closed.
    FrameTooLarge = 2,
    /// More items in one request than the batch limit.
    BatchTooLarge = 3,
    /// The client speaks another protocol version.
    UnsupportedVersion = 4,
    /// Missing or wrong auth token.
    Unauthorized = 5,
    /// The first frame of a connection must be `Hello`.
    HandshakeRequired = 6,
    /// The payload length does not match what the header describes.
    PayloadMismatch = 7,
    /// No such namespace on this node.
    UnknownNamespace = 10,
    /// Key empty or longer than 256 bytes.
    BadKey = 11,
    /// Value larger than the pool can hold.
    TooLarge = 12,
    /// Nothing left to evict.
    PoolFull = 13,
    /// Namespace quota exhausted by objects that can't be evicted.
    QuotaExceeded = 14,
    /// No such object.
    NotFound = 15,
    /// Bytes don't match their checksum.
    ChecksumMismatch = 16,
    /// A limit on what one connection or one client may hold or open was reached (pending
    /// allocations per connection, connections per token): the message names the setting.
    LimitExceeded = 17,
    /// The address belongs to another node.
    WrongNode = 20,
    /// No such segment.
    NoSegment = 21,
    /// Wrong memory key.
    WrongKey = 22,
    /// Range out of bounds.
    OutOfBounds = 23,
    /// The object at the address was evicted or replaced (a miss).
    Stale = 24,
    /// Writes only go into pending allocations.
    NotWritable = 25,
    /// A write into the allocation is in progress.
    Busy = 26,
    /// The operation is only offered over the Unix socket.
    NotLocal = 30,
    /// The request was routed with another cluster view than the node's: fetch the view
    /// (`Op::View`) and route again. The message carries the node's view version.
    WrongView = 40,
    /// The node that holds the key can't be reached (a client-side code: keys there are misses).
    Unavailable = 41,
    /// The address names another incarnation of the node's daemon (issued before a restart),
    /// or a same-host mapping is of a daemon that is gone: nothing it named exists (a miss).
    WrongIncarnation = 50,
    /// (`Vouch`) This node acknowledged a write or remove of the key that a copy on another
    /// node could be older than (or it can't rule one out): don't serve that copy. (A cluster
    /// peer's unpinned `Put`, a handover copy) refused for that reason, or because the key is
    /// here already.
    Superseded = 55,
    /// (Handoff) The key's producer posted a tombstone (`Fail`): it will not be written; the
    /// reason travels with the event or error.
    Failed = 56,
    /// (Handoff) Events for this connection were dropped (it did not read them fast enough):
    /// what it watches must be checked again.
    Lagged = 57,
    /// The request carried a deadline that the node estimates it cannot meet (its bulk
    /// transfers queued ahead, at the node's and the namespace's bulk rates): refused before any
    /// work, so the caller can recompute instead of waiting. The message carries the estimate.
    DeadlineUnmeetable = 58,
    /// The client timed out (never sent by a node).
    Timeout = 97,
    /// The node is shutting down.
    ShuttingDown = 98,
    /// A bug on the node; it keeps serving.
    Internal = 99,
}

impl ErrorCode {
    /// The code for a number; unknown numbers map to `Internal`.
    pub fn from_u16(v: u16) -> ErrorCode {
        use ErrorCode::*;
        const ALL: [ErrorCode; 34] = [
            Ok,
            Malformed,
            FrameTooLarge,
            BatchTooLarge,
            UnsupportedVersion,
            Unauthorized,
            HandshakeRequired,
            PayloadMismatch,
            UnknownNamespace,
            BadKey,
            TooLarge,
            PoolFull,
            QuotaExceeded,
            NotFound,
            ChecksumMismatch,
            LimitExceeded,
            WrongNode,
            NoSegment,
            WrongKey,
            OutOfBounds,
            Stale,
            NotWritable,
            Busy,
            NotLocal,
            WrongView,
            Unavailable,
            WrongIncarnation,
            Superseded,
            Failed,
            Lagged,
            DeadlineUnmeetable,
            Timeout,
            ShuttingDown,
            Internal,
        ];
        ALL.into_iter().find(|c| *c as u16 == v).unwrap_or(Internal)
    }

    /// True for errors that mean "not in the cache" rather than "something is wrong".
    pub fn is_miss(self) -> bool {
        matches!(
            self,
            ErrorCode::NotFound | ErrorCode::Stale | ErrorCode::WrongIncarnation
        )
    }
}

impl From<PoolError> for ErrorCode {
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::UnknownNamespace => ErrorCode::UnknownNamespace,
            PoolError::BadKey => ErrorCode::BadKey,
            PoolError::TooLarge => ErrorCode::TooLarge,
            PoolError::PoolFull => ErrorCode::PoolFull,
            PoolError::QuotaExceeded => ErrorCode::QuotaExceeded,
            PoolError::NotFound => ErrorCode::NotFound,
            PoolError::ChecksumMismatch => ErrorCode::ChecksumMismatch,
            PoolError::Cancelled => ErrorCode::Failed,
            PoolError::BadAddress(f) => match f {
                AddrFault::WrongNode => ErrorCode::WrongNode,
                AddrFault::NoSegment => ErrorCode::NoSegment,
                AddrFault::WrongKey => ErrorCode::WrongKey,
                AddrFault::OutOfBounds => ErrorCode::OutOfBounds,
                AddrFault::Stale => ErrorCode::Stale,
                AddrFault::NotWritable => ErrorCode::NotWritable,
                AddrFault::Busy => ErrorCode::Busy,
                AddrFault::WrongIncarnation => ErrorCode::WrongIncarnation,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for v in 0..200u16 {
            let c = ErrorCode::from_u16(v);
            assert!(c as u16 == v || c == ErrorCode::Internal);
        }
        assert_eq!(ErrorCode::from_u16(24), ErrorCode::Stale);
    }
}
