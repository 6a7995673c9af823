//! Client errors as Python exceptions (the classes of `kvpool._errors`) and as the negative
//! Mooncake-style status codes that the Mooncake-compatible calls return.

use kvpool_client::{ClientError, ErrorCode};
use pyo3::{import_exception, PyErr};

import_exception!(kvpool._errors, Error);
import_exception!(kvpool._errors, ConnectionError);
import_exception!(kvpool._errors, TimeoutError);
import_exception!(kvpool._errors, AuthError);
import_exception!(kvpool._errors, NotFoundError);
import_exception!(kvpool._errors, TooLargeError);
import_exception!(kvpool._errors, PoolFullError);
import_exception!(kvpool._errors, BufferTooSmallError);
import_exception!(kvpool._errors, InvalidKeyError);
import_exception!(kvpool._errors, InvalidArgumentError);
import_exception!(kvpool._errors, ClosedError);

/// Mooncake Store's status codes (its `ErrorCode` enum), the subset kvpool returns.
pub(crate) mod code {
    pub(crate) const OK: i64 = 0;
    pub(crate) const INTERNAL_ERROR: i64 = -1;
    pub(crate) const BUFFER_OVERFLOW: i64 = -10;
    pub(crate) const NO_AVAILABLE_HANDLE: i64 = -200;
    pub(crate) const INVALID_KEY: i64 = -400;
    pub(crate) const INVALID_PARAMS: i64 = -600;
    pub(crate) const ILLEGAL_CLIENT: i64 = -601;
    pub(crate) const OBJECT_NOT_FOUND: i64 = -704;
    pub(crate) const TRANSFER_FAIL: i64 = -800;
    pub(crate) const RPC_FAIL: i64 = -900;
}

/// Why a call failed, before it becomes an exception or a status code.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The client library's error.
    Client(ClientError),
    /// The key is empty or longer than [`kvpool::MAX_KEY_LEN`].
    BadKey(usize),
    /// A pointer is null, not inside a registered buffer, or the lists differ in length.
    BadArgument(String),
    /// The client was closed.
    Closed,
    /// A miss, where the call's contract makes it an error.
    NotFound,
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        Failure::Client(e)
    }
}

impl Failure {
    /// The Mooncake-style status code.
    pub(crate) fn code(&self) -> i64 {
        match self {
            Failure::Client(e) => client_code(e),
            Failure::BadKey(_) => code::INVALID_KEY,
            Failure::BadArgument(_) | Failure::Closed => code::INVALID_PARAMS,
            Failure::NotFound => code::OBJECT_NOT_FOUND,
        }
    }

    /// The exception, of the class that names the failure.
    pub(crate) fn into_py(self) -> PyErr {
        match self {
            Failure::Client(e) => client_exception(e),
            Failure::BadKey(len) => InvalidKeyError::new_err(format!(
                "a key must be 1 to {} bytes, this one has {len}",
                kvpool::MAX_KEY_LEN
            )),
            Failure::BadArgument(m) => InvalidArgumentError::new_err(m),
            Failure::Closed => ClosedError::new_err("the client is closed"),
            Failure::NotFound => NotFoundError::new_err("no object under that key"),
        }
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> Self {
        f.into_py()
    }
}

fn client_code(e: &ClientError) -> i64 {
    match e {
        ClientError::BufferTooSmall { .. } => code::BUFFER_OVERFLOW,
        ClientError::Checksum => code::TRANSFER_FAIL,
        ClientError::UnknownNamespace(_) => code::ILLEGAL_CLIENT,
        ClientError::Endpoint(_) => code::INVALID_PARAMS,
        ClientError::Protocol(_) => code::INTERNAL_ERROR,
        ClientError::Io(_) | ClientError::Timeout | ClientError::Tls(_) => code::RPC_FAIL,
        ClientError::Server { code: c, .. } => server_code(*c),
    }
}

fn server_code(c: ErrorCode) -> i64 {
    match c {
        ErrorCode::Ok => code::OK,
        ErrorCode::BadKey => code::INVALID_KEY,
        ErrorCode::TooLarge
        | ErrorCode::PoolFull
        | ErrorCode::QuotaExceeded
        | ErrorCode::LimitExceeded => code::NO_AVAILABLE_HANDLE,
        ErrorCode::NotFound | ErrorCode::Stale | ErrorCode::WrongIncarnation => {
            code::OBJECT_NOT_FOUND
        }
        ErrorCode::Unauthorized | ErrorCode::UnknownNamespace => code::ILLEGAL_CLIENT,
        ErrorCode::ChecksumMismatch => code::TRANSFER_FAIL,
        ErrorCode::Unavailable
        | ErrorCode::Timeout
        | ErrorCode::ShuttingDown
        | ErrorCode::DeadlineUnmeetable => code::RPC_FAIL,
        _ => code::INTERNAL_ERROR,
    }
}

/// The status code of one item of a batch put.
pub(crate) fn item_code(c: ErrorCode) -> i64 {
    server_code(c)
}

/// The exception for an item of a batch put that failed with `c`.
pub(crate) fn item_exception(c: ErrorCode) -> PyErr {
    client_exception(ClientError::Server {
        code: c,
        message: String::new(),
    })
}

pub(crate) fn client_exception(e: ClientError) -> PyErr {
    let msg = e.to_string();
    match &e {
        ClientError::Timeout => TimeoutError::new_err(msg),
        ClientError::Io(_) | ClientError::Tls(_) => ConnectionError::new_err(msg),
        ClientError::Endpoint(_) => InvalidArgumentError::new_err(msg),
        ClientError::UnknownNamespace(_) => AuthError::new_err(msg),
        ClientError::BufferTooSmall { .. } => BufferTooSmallError::new_err(msg),
        ClientError::Checksum | ClientError::Protocol(_) => Error::new_err(msg),
        ClientError::Server { code: c, .. } => match c {
            ErrorCode::BadKey => InvalidKeyError::new_err(msg),
            ErrorCode::TooLarge => TooLargeError::new_err(msg),
            ErrorCode::PoolFull | ErrorCode::QuotaExceeded => PoolFullError::new_err(msg),
            ErrorCode::NotFound | ErrorCode::Stale | ErrorCode::WrongIncarnation => {
                NotFoundError::new_err(msg)
            }
            ErrorCode::Unauthorized | ErrorCode::UnknownNamespace => AuthError::new_err(msg),
            ErrorCode::Unavailable | ErrorCode::ShuttingDown => ConnectionError::new_err(msg),
            ErrorCode::Timeout | ErrorCode::DeadlineUnmeetable => TimeoutError::new_err(msg),
            _ => Error::new_err(msg),
        },
    }
}
