//! Where a client's byte streams come from when not from the network: a [`Connector`] the
//! application sets in [`crate::ClientConfig::connector`] opens each stream a connection runs
//! over (a node served in the same process, a proxy, a test's in-memory pipe). The client
//! speaks the same protocol over it as over TCP.
//!
//! Uses `endpoint` only.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::endpoint::Endpoint;

/// A byte stream a connection can run over: any ordered, reliable, bidirectional stream.
pub trait ByteStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> ByteStream for T {}

/// A stream opened by a [`Connector`].
pub type BoxStream = Box<dyn ByteStream>;

/// What [`Connector::connect`] returns: the stream, once open.
pub type Connecting<'a> = Pin<Box<dyn Future<Output = io::Result<BoxStream>> + Send + 'a>>;

/// Opens the streams of a client's connections in place of its network transports.
///
/// Called for every connection the client opens, with the endpoint it would have dialled: the
/// one given to [`crate::Client::connect`], or another node's address from the cluster view
/// (as [`Endpoint::Tcp`], or [`Endpoint::Quic`] for a client that connected over QUIC or
/// TLS). A connection opened through it never takes the same-host path, which needs a Unix
/// socket. An error fails the call that needed the connection as a connect error does: the
/// node counts as unreachable.
pub trait Connector: fmt::Debug + Send + Sync + 'static {
    /// Opens a stream to the node at `endpoint`.
    fn connect<'a>(&'a self, endpoint: &'a Endpoint) -> Connecting<'a>;
}
