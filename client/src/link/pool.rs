//! The connections a link keeps to its node: idle ones per traffic class ([`Lane`]), a cap on
//! those in use per class, and the QUIC connection streams are opened on.

use std::sync::Mutex;

use tokio::sync::{Semaphore, SemaphorePermit};

use crate::config::ClientConfig;
use crate::conn::{quic_connect, Conn};
use crate::endpoint::Endpoint;
use crate::error::ClientError;

/// A traffic class, as the client keeps its connections: a call moving at least
/// [`Lane::BULK_BYTES`] (a large value or batch, by what it sends or has room to receive) uses
/// the bulk connections, any other the latency ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    Latency = 0,
    Bulk = 1,
}

impl Lane {
    /// The nodes' default `[limits] bulk_threshold`.
    pub(crate) const BULK_BYTES: u64 = 256 << 10;

    pub(crate) fn of(bytes: u64) -> Lane {
        if bytes >= Lane::BULK_BYTES {
            Lane::Bulk
        } else {
            Lane::Latency
        }
    }
}

/// The connections to one node.
pub(super) struct ConnPool {
    /// Idle connections of each traffic class ([`Lane`]): a small request never picks up a
    /// connection that a bulk transfer is using, and the two have their own caps.
    idle: [Mutex<Vec<Conn>>; 2],
    /// Connections in use per class at most (`max_connections`, `max_bulk_connections`); more
    /// concurrent calls wait for one, within their timeout.
    slots: [Semaphore; 2],
    /// The QUIC connection streams are opened on (QUIC endpoints only); replaced when closed.
    quic: Mutex<Option<(quinn::Endpoint, quinn::Connection)>>,
}

impl ConnPool {
    /// A pool holding `first`, the connection of the first handshake, idle in the latency class.
    pub(super) fn new(
        cfg: &ClientConfig,
        first: Conn,
        quic: Option<(quinn::Endpoint, quinn::Connection)>,
    ) -> ConnPool {
        ConnPool {
            idle: [Mutex::new(vec![first]), Mutex::new(Vec::new())],
            slots: [
                Semaphore::new(cfg.max_connections.max(1)),
                Semaphore::new(cfg.max_bulk_connections.max(1)),
            ],
            quic: Mutex::new(quic),
        }
    }

    /// A connection slot of `lane`, waiting for one while all are in use.
    pub(super) async fn slot(&self, lane: Lane) -> Result<SemaphorePermit<'_>, ClientError> {
        self.slots[lane as usize]
            .acquire()
            .await
            .map_err(|_| ClientError::Protocol("connection pool closed".into()))
    }

    /// Puts `conn` back among the idle ones of `lane`, unless `max_idle` are idle already.
    pub(super) fn give_back(&self, cfg: &ClientConfig, lane: Lane, mut conn: Conn) {
        conn.last_used = std::time::Instant::now();
        let mut idle = self.idle[lane as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if idle.len() < cfg.max_idle {
            idle.push(conn);
        }
    }

    /// Drops every pooled connection (the node exited or restarted).
    pub(super) fn clear(&self) {
        for idle in &self.idle {
            idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// The QUIC connection to open a stream on (None for other transports, and for streams
    /// from the config's connector), connecting again when the node closed the last one (it
    /// exited or restarted).
    pub(super) async fn quic_connection(
        &self,
        endpoint: &Endpoint,
        cfg: &ClientConfig,
    ) -> Result<Option<quinn::Connection>, ClientError> {
        if !matches!(endpoint, Endpoint::Quic(_)) || cfg.connector.is_some() {
            return Ok(None);
        }
        let current = self
            .quic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|q| q.1.clone());
        if let Some(c) = current.filter(|c| c.close_reason().is_none()) {
            return Ok(Some(c));
        }
        let (ep, c) = quic_connect(endpoint, cfg).await?;
        *self.quic.lock().unwrap_or_else(|e| e.into_inner()) = Some((ep, c.clone()));
        Ok(Some(c))
    }

    /// A pooled connection that still looks usable; pooled ones the node closed meanwhile (it
    /// exited or restarted) are dropped, with every other pooled one when that happens.
    pub(super) fn pooled(&self, lane: Lane) -> Option<Conn> {
        let mut idle = self.idle[lane as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut c = idle.pop()?;
        if c.looks_open() {
            return Some(c);
        }
        drop(idle);
        self.clear();
        None
    }
}
