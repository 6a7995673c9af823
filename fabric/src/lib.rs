//! libfabric for kvpool: the fabric library that carries verbs (InfiniBand, RoCE, with
//! `ofi_rxm`), AWS EFA and, for development, the `tcp` and `shm` providers.
//!
//! [`sys`] is a binding generated at build time against the headers installed (libfabric 1.17,
//! Debian 12's, and later); the rest is a small safe layer of one-sided reads and writes of
//! registered memory ([`Fabric`], [`Endpoint`], [`Region`]). Memory is registered the way the
//! production providers demand (`FI_MR_LOCAL`, `FI_MR_VIRT_ADDR`, `FI_MR_ALLOCATED`,
//! `FI_MR_PROV_KEY`, `FI_MR_ENDPOINT` are all offered) and used the way the provider answers:
//! a [`Remote`] carries the address a peer reads at, the region's virtual address or an offset
//! into it, whichever the provider's addressing is.
//!
//! Built without libfabric's headers the crate has no binding, [`AVAILABLE`] is false and
//! [`Fabric::open`] fails; the types are the same, so code using them builds either way.

#[cfg(libfabric)]
mod rma;
#[cfg(libfabric)]
pub mod sys;
mod types;

#[cfg(libfabric)]
pub use rma::{Endpoint, Error, Fabric, Peer, Region, Registration, Remote};
#[cfg(not(libfabric))]
mod unavailable;
#[cfg(not(libfabric))]
pub use unavailable::{Endpoint, Error, Fabric, Peer, Region, Registration, Remote};

/// Whether this build has the libfabric binding (its headers were installed at build time).
pub const AVAILABLE: bool = cfg!(libfabric);
