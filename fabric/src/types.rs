//! The plain types of the layer, the same with the binding or without: errors, peers' addresses
//! in an address vector, and what a peer needs to reach registered memory.

use std::fmt;

/// A libfabric call that failed: which one, and libfabric's error number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// The call, or the check that refused the operation before any call.
    pub op: &'static str,
    /// libfabric's error number (positive, `FI_E*` or an errno).
    pub code: i32,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        #[cfg(libfabric)]
        {
            // SAFETY: fi_strerror returns a static string for any number.
            let text = unsafe { std::ffi::CStr::from_ptr(crate::sys::fi_strerror(self.code)) };
            write!(f, "{}: {} ({})", self.op, text.to_string_lossy(), self.code)
        }
        #[cfg(not(libfabric))]
        write!(
            f,
            "{}: this build has no libfabric (install libfabric-dev and libclang-dev, then rebuild)",
            self.op
        )
    }
}

impl std::error::Error for Error {}

/// A peer endpoint's address in an endpoint's address vector (`Endpoint::insert`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer(pub(crate) u64);

/// What a peer needs to read or write registered memory: where it starts under the provider's
/// addressing, its key and its length. Published by the memory's owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    /// The memory's first byte as peers address it: its virtual address
    /// (`Fabric::virtual_addressing`), else 0.
    pub addr: u64,
    /// The memory key.
    pub key: u64,
    /// Length in bytes.
    pub len: u64,
}
