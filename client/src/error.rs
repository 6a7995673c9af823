//! Client errors. A miss is not an error: lookups return `None`.
//!
//! Uses nothing else of the crate.

use std::io;

use kvpool::protocol::ErrorCode;
use thiserror::Error;

/// Why a call failed.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The endpoint string is not understood.
    #[error("bad endpoint {0}")]
    Endpoint(String),
    /// Connecting or the stream failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// TLS or QUIC setup failed.
    #[error("tls/quic: {0}")]
    Tls(String),
    /// The node sent something that breaks the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The node refused the request.
    #[error("node refused: {code:?}: {message}")]
    Server {
        /// Error code.
        code: ErrorCode,
        /// Detail from the node.
        message: String,
    },
    /// The call did not finish within the configured timeout.
    #[error("timed out")]
    Timeout,
    /// Bytes received do not match their checksum (the value is not returned).
    #[error("checksum mismatch on received value")]
    Checksum,
    /// A destination buffer is smaller than the value.
    #[error("buffer of {have} bytes is too small for a value of {need}")]
    BufferTooSmall {
        /// Value length.
        need: u64,
        /// Buffer length.
        have: u64,
    },
    /// The node has no namespace of that name.
    #[error("unknown namespace {0:?}")]
    UnknownNamespace(String),
}

impl ClientError {
    /// The node's error code, when the node refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// True when the node could not be reached or stopped answering: its keys are misses.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ClientError::Io(_) | ClientError::Timeout | ClientError::Tls(_)
        ) || self.code() == Some(ErrorCode::Unavailable)
    }

    /// True when a node refused a bulk transfer up front because it estimated it could not
    /// finish it by the call's deadline ([`crate::ClientConfig::deadline`]): recompute rather
    /// than retry.
    pub fn is_deadline_refused(&self) -> bool {
        self.code() == Some(ErrorCode::DeadlineUnmeetable)
    }

    /// True when the connection is still in sync after this error and can be reused.
    pub(crate) fn keeps_connection(&self) -> bool {
        matches!(
            self,
            ClientError::Server { .. } | ClientError::Checksum | ClientError::BufferTooSmall { .. }
        )
    }
}

impl From<kvpool::protocol::FrameError> for ClientError {
    fn from(e: kvpool::protocol::FrameError) -> Self {
        ClientError::Protocol(e.to_string())
    }
}

impl From<kvpool::protocol::io::WireError> for ClientError {
    fn from(e: kvpool::protocol::io::WireError) -> Self {
        match e {
            kvpool::protocol::io::WireError::Io(e) => ClientError::Io(e),
            kvpool::protocol::io::WireError::Frame(e) => e.into(),
        }
    }
}
