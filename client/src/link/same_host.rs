//! The same-host path to one node, as a link holds it: the node's segments mapped into this
//! process (mapped again after the daemon restarts), the staging area puts go through when the
//! mapping is read-only, the index of where this client last found objects, and the watch
//! that says whether that index may be read without asking the node.

use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use kvpool::protocol::{HelloInfo, Op, Reply};

use super::watch::Watch;
use crate::config::{ClientConfig, SameHost};
use crate::conn::Conn;
use crate::endpoint::Endpoint;
use crate::error::ClientError;
use crate::local::LocalMap;
use crate::seen::SeenIndex;
use crate::staging::StagingArea;

/// What a link keeps of a node on this host.
pub(super) struct SameHostPath {
    /// The mapping of the current incarnation's segments; None when mapping the restarted
    /// daemon's segments failed (then the socket serves).
    local: RwLock<Option<Arc<LocalMap>>>,
    /// Where same-host puts go when the node maps its segments read-only to this client
    /// ([`StagingArea`]); of the current incarnation.
    staging: RwLock<Option<Arc<StagingArea>>>,
    /// Where this client last found same-host objects ([`SeenIndex`]).
    seen: Mutex<SeenIndex>,
    /// Whether the index may be read without asking the node ([`Watch`]).
    pub(super) watch: Watch,
}

/// A node found on this host and mapped: the path to it, with the Unix socket's endpoint, the
/// connection that asked for the mapping and its handshake.
pub(super) struct Found {
    pub(super) path: SameHostPath,
    pub(super) endpoint: Endpoint,
    pub(super) conn: Conn,
    pub(super) hello: HelloInfo,
}

impl SameHostPath {
    /// When the node that answered `hello` runs on this host (and `cfg.same_host` allows, with
    /// no connector opening the streams in place of the network):
    /// connects over its Unix socket and maps its segments. None when it is elsewhere or the
    /// mapping failed; the link then goes through the socket it reached.
    pub(super) async fn open(cfg: &ClientConfig, hello: &HelloInfo) -> Option<Found> {
        if cfg.same_host != SameHost::Auto
            || cfg.connector.is_some()
            || hello.uds_path.is_empty()
            || hello.host_id != kvpool::segment::host_id()
        {
            return None;
        }
        let uds = Endpoint::Unix(hello.uds_path.clone().into());
        // Same host: control goes over the Unix socket, data through the mapping.
        let (mut c, h) = Conn::open(&uds, cfg, (None, false)).await.ok()?;
        let (reply, fds) = c.call_with_fds(Op::MapInfo, cfg.timeout).await.ok()?;
        let m = map_offered(reply, fds, &h)
            .inspect_err(
                |e| tracing::debug!(error = %e, "same-host mapping failed; using the socket path"),
            )
            .ok()?;
        let staging = if m.has_read_only() {
            open_staging(&uds, cfg).await
        } else {
            None
        };
        Some(Found {
            path: SameHostPath {
                local: RwLock::new(Some(Arc::new(m))),
                staging: RwLock::new(staging.map(Arc::new)),
                seen: Mutex::new(SeenIndex::new(cfg.local_index)),
                watch: Watch::new(),
            },
            endpoint: uds,
            conn: c,
            hello: h,
        })
    }

    /// The mapping of the node's segments, unless remapping them after a restart failed.
    pub(super) fn local(&self) -> Option<Arc<LocalMap>> {
        self.local.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The staging area of the current incarnation, when the node handed one out.
    pub(super) fn staging(&self) -> Option<Arc<StagingArea>> {
        self.staging
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .filter(|s| s.usable())
    }

    /// The index of where this client last found objects of the node.
    pub(super) fn seen(&self) -> MutexGuard<'_, SeenIndex> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After the daemon restarted (`hello`, the handshake on `conn` to `endpoint`, names a new
    /// incarnation): maps the new segments over `conn` and asks for a new staging area. A
    /// mapping refused or failed leaves the link on the socket; an error is returned only when
    /// `conn` broke, and then the next connection does all this again.
    pub(super) async fn remap(
        &self,
        cfg: &ClientConfig,
        endpoint: &Endpoint,
        conn: &mut Conn,
        hello: &HelloInfo,
    ) -> Result<(), ClientError> {
        let mapped = match conn.call_with_fds(Op::MapInfo, REMAP_WITHIN).await {
            Ok((reply, fds)) => map_offered(reply, fds, hello).map_err(|e| e.to_string()),
            Err(e) if e.keeps_connection() => Err(e.to_string()),
            Err(e) => {
                *self.local.write().unwrap_or_else(|e| e.into_inner()) = None;
                return Err(e);
            }
        };
        let mapped = mapped
            .inspect_err(|e| {
                tracing::warn!(error = %e, "remapping the restarted node failed; using the socket")
            })
            .ok();
        let staging = match &mapped {
            Some(m) if m.has_read_only() => open_staging(endpoint, cfg).await,
            _ => None,
        };
        *self.staging.write().unwrap_or_else(|e| e.into_inner()) = staging.map(Arc::new);
        *self.local.write().unwrap_or_else(|e| e.into_inner()) = mapped.map(Arc::new);
        Ok(())
    }
}

/// How long a remap after a restart waits for the node's `MapInfo` reply.
const REMAP_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// A staging area for this client's same-host puts ([`StagingArea`]), asked for on a
/// connection of its own over the Unix socket `uds`, which the area lives as long as; None when
/// the node hands out none (its setting, its total, a token that writes nothing, or a node
/// older than the request), and puts then go over the socket.
async fn open_staging(uds: &Endpoint, cfg: &ClientConfig) -> Option<StagingArea> {
    let made = async {
        let (mut c, _) = Conn::open(uds, cfg, (None, false)).await?;
        let (reply, mut fds) = c.call_with_fds(Op::Staging, cfg.timeout).await?;
        let (Reply::Staging { id, len }, Some(fd)) = (reply, fds.pop()) else {
            return Err(ClientError::Protocol(
                "a staging reply without its area".into(),
            ));
        };
        let file = std::fs::File::from(fd);
        StagingArea::new(id, len, &file, c).map_err(ClientError::Io)
    };
    made.await
        .inspect_err(
            |e| tracing::debug!(error = %e, "no staging area: same-host puts go over the socket"),
        )
        .ok()
}

/// Maps the segments a `MapInfo` reply offered, each with the descriptor that came with it,
/// when they are of the incarnation the handshake `hello` named. None offered (the token admits
/// to no segment whose namespaces are all its own) is an error: the link then has no mapping
/// and goes through the socket.
fn map_offered(
    reply: Reply,
    fds: Vec<std::os::fd::OwnedFd>,
    hello: &HelloInfo,
) -> std::io::Result<LocalMap> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let Reply::MapInfo {
        incarnation,
        segments,
    } = reply
    else {
        return Err(invalid(format!("unexpected reply {reply:?}")));
    };
    if segments.len() != fds.len() {
        return Err(invalid(format!(
            "{} segments offered with {} descriptors",
            segments.len(),
            fds.len()
        )));
    }
    if segments.is_empty() {
        return Err(std::io::Error::other(
            "the node offers no segment to this token",
        ));
    }
    let m = LocalMap::open(
        hello.node,
        incarnation,
        segments.into_iter().zip(fds).collect(),
    )?;
    if m.incarnation() != hello.incarnation {
        return Err(invalid(
            "MapInfo names another incarnation than the handshake".into(),
        ));
    }
    Ok(m)
}
