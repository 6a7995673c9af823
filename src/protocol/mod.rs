//! The wire protocol: length-prefixed frames, each a small rkyv-archived header followed by raw
//! payload bytes that are never serialised. Specified in docs/PROTOCOL.md.
//!
//! Decoding is two-phase, as in mini-redis: [`FramePrefix::parse`] checks the fixed 16-byte
//! prefix against the [`Limits`] before a single byte of the frame is buffered, then
//! [`decode_request`] validates the archived header (rkyv's bytecheck) before anything reads it.
//! No input can make a reader allocate more than `max_header` bytes, and a reader's header
//! buffer grows with the bytes that actually arrive, not with the length a peer announces.
//!
//! Every speaker builds its requests and judges the replies through one [`Exchange`], which
//! holds no socket: it stamps each request with its id, view and class, and [`judge`] turns a
//! reply into an [`Outcome`] (the answer, a miss, moved to another view, or refused).

pub mod auth;
mod codes;
mod exchange;
mod frame;
#[cfg(feature = "io")]
pub mod io;
#[allow(
    missing_docs,
    reason = "rkyv generates undocumented Archived* mirrors of the documented types"
)]
mod message;

pub use codes::ErrorCode;
pub use exchange::{judge, Class, Exchange, ExchangeError, Outcome, Outgoing};
pub use frame::{
    decode_request, decode_response, decode_response_owned, encode, FrameError, FramePrefix,
    Limits, MAGIC, MAX_HELLO_HEADER, PREFIX_LEN,
};
pub use message::*;
/// Buffer for headers: rkyv reads archives in place, which needs 16-byte alignment.
pub use rkyv::util::AlignedVec;

/// Protocol version spoken by this build: a node's `HelloInfo` says it, and its clients and
/// peers ask for it in their `Hello`.
///
/// 6 added `Heartbeat` and 7 added `Move`, both node to node only; 8 answers a `Get` of an
/// absent key with `Miss` instead of an error; 9 added `DiskStats`; 10 added `KvEvents`; 11
/// added `Traffic`; 12 added the `restarting` node state; 13 added `FabricInfo`.
pub const PROTOCOL_VERSION: u32 = 13;

/// The first version with `Heartbeat`: a peer of an older one is sent `Gossip`.
pub const HEARTBEAT_VERSION: u32 = 6;

/// The first version with `Move`: a peer of an older one is not asked to move objects.
pub const MOVE_VERSION: u32 = 7;

/// The first version answered `Miss`: a connection of an older one is answered `Error` with
/// `NotFound` for an absent key.
pub const MISS_VERSION: u32 = 8;

/// The first version with `DiskStats`: a node of an older one is not asked.
pub const DISK_STATS_VERSION: u32 = 9;

/// The first version with `KvEvents`: a connection of an older one is refused it
/// (`UnsupportedVersion`).
pub const KV_EVENTS_VERSION: u32 = 10;

/// The first version with `Traffic`: a node of an older one is not asked.
pub const TRAFFIC_VERSION: u32 = 11;

/// The first version whose views may hold `restarting` records: a connection of an older one
/// is sent them as `down` ([`view_for`]).
pub const RESTARTING_VERSION: u32 = 12;

/// `view` as a connection speaking `version` can read it: before [`RESTARTING_VERSION`],
/// restarting records are sent as down (such a speaker routes around the node, and its routed
/// requests are answered `WrongView` until the node is back, as its view's stamp differs).
pub fn view_for(
    mut view: crate::placement::ClusterView,
    version: u32,
) -> crate::placement::ClusterView {
    if version < RESTARTING_VERSION {
        for n in view.nodes.iter_mut() {
            if n.state == crate::placement::NodeState::Restarting {
                n.state = crate::placement::NodeState::Down;
            }
        }
    }
    view
}

/// The oldest version a node of this build accepts in a `Hello` (older ones get
/// `UnsupportedVersion`). A connection that asked for an older version than the node's is
/// answered in it; a node that gets `UnsupportedVersion` from a peer (an older node, in a
/// rolling upgrade) connects again asking for each older version down to this one and speaks
/// as the version it was answered in did.
pub const MIN_PROTOCOL_VERSION: u32 = 5;

/// The request id of an `Event` (sent unasked on a connection that watches keys) and of a
/// `KvEvents` frame; never the id of a request.
pub const EVENT_ID: u64 = u64::MAX;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{ClusterView, NodeInfo, NodeState};

    #[test]
    fn an_older_speaker_is_sent_a_restarting_node_as_down() {
        let view = ClusterView::from_nodes(vec![
            NodeInfo::serving(0, 1),
            NodeInfo {
                state: NodeState::Restarting,
                ..NodeInfo::serving(1, 1)
            },
        ]);
        let state = |v: &ClusterView| v.nodes[1].state;
        assert_eq!(
            state(&view_for(view.clone(), PROTOCOL_VERSION)),
            NodeState::Restarting
        );
        let old = view_for(view.clone(), RESTARTING_VERSION - 1);
        assert_eq!(state(&old), NodeState::Down);
        assert_eq!(old.nodes[0], view.nodes[0]);
    }
}
