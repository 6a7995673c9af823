//! The layer's interface in a build without libfabric's headers: [`Fabric::open`] says so,
//! and nothing else can be made, so code using the layer builds the same either way.

use std::convert::Infallible;
use std::ptr::NonNull;

pub use crate::types::{Error, Peer, Remote};

/// A provider's fabric and domain: none can be opened in this build.
#[derive(Clone)]
pub struct Fabric(Infallible);

impl Fabric {
    /// Fails: this build has no libfabric.
    pub fn open(_provider: &str) -> Result<Fabric, Error> {
        Err(Error {
            op: "fi_getinfo",
            code: libc::ENOSYS,
        })
    }
    /// The provider.
    pub fn provider(&self) -> String {
        match self.0 {}
    }
    /// Whether peers address memory by virtual address.
    pub fn virtual_addressing(&self) -> bool {
        match self.0 {}
    }
    /// Whether the provider checks keys.
    pub fn checks_keys(&self) -> bool {
        match self.0 {}
    }
    /// An endpoint.
    pub fn endpoint(&self) -> Result<Endpoint, Error> {
        match self.0 {}
    }
    /// A serving endpoint.
    pub fn serving_endpoint(&self) -> Result<Endpoint, Error> {
        match self.0 {}
    }
}

/// An endpoint: none exists in this build.
pub struct Endpoint(Infallible);

impl Endpoint {
    /// The endpoint's address.
    pub fn name(&self) -> Result<Vec<u8>, Error> {
        match self.0 {}
    }
    /// Adds a peer.
    pub fn insert(&self, _name: &[u8]) -> Result<Peer, Error> {
        match self.0 {}
    }
    /// Registers fresh memory.
    pub fn register(&self, _len: usize, _read: bool, _write: bool) -> Result<Region, Error> {
        match self.0 {}
    }
    /// Registers memory the caller keeps.
    ///
    /// # Safety
    /// As for the real layer: the memory outlives the registration.
    pub unsafe fn register_memory(
        &self,
        _base: NonNull<u8>,
        _len: usize,
        _read: bool,
        _write: bool,
    ) -> Result<Registration, Error> {
        match self.0 {}
    }
    /// Several reads.
    pub fn read_many(
        &mut self,
        _dst: &mut Registration,
        _reads: &[(std::ops::Range<usize>, Peer, Remote, u64)],
        _depth: usize,
    ) -> Result<(), Error> {
        match self.0 {}
    }
    /// Whether reads may land in unregistered memory.
    pub fn reads_into_any_memory(&self) -> bool {
        match self.0 {}
    }
    /// Several reads into unregistered buffers.
    pub fn read_many_into(
        &mut self,
        _reads: &mut [(&mut [u8], Peer, Remote, u64)],
        _depth: usize,
    ) -> Result<(), Error> {
        match self.0 {}
    }
    /// Several reads into unregistered buffers, each handed over as it lands.
    pub fn read_many_into_each(
        &mut self,
        _reads: &mut [(&mut [u8], Peer, Remote, u64)],
        _depth: usize,
        _landed: impl FnMut(usize, &[u8]),
    ) -> Result<(), Error> {
        match self.0 {}
    }
    /// One write.
    pub fn write(
        &mut self,
        _src: (&Registration, std::ops::Range<usize>),
        _peer: Peer,
        _dst: &Remote,
        _offset: u64,
    ) -> Result<(), Error> {
        match self.0 {}
    }
    /// Waits for work.
    pub fn wait(
        &mut self,
        _timeout_ms: i32,
        _idle: std::time::Duration,
    ) -> Result<Option<usize>, Error> {
        match self.0 {}
    }
}

/// A registration: none exists in this build.
pub struct Registration(Infallible);

impl Registration {
    /// What a peer needs.
    pub fn remote(&self) -> Remote {
        match self.0 {}
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self.0 {}
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
}

/// Registered memory owned: none exists in this build.
pub struct Region(Infallible);

impl std::ops::Deref for Region {
    type Target = Registration;
    fn deref(&self) -> &Registration {
        match self.0 {}
    }
}

impl std::ops::DerefMut for Region {
    fn deref_mut(&mut self) -> &mut Registration {
        match self.0 {}
    }
}

impl Region {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self.0 {}
    }
    /// The bytes for writing.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self.0 {}
    }
}
