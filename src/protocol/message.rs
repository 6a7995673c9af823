//! Request and response headers. Everything bulky (values, read data) travels as the frame's
//! raw payload, never inside these.

use rkyv::{Archive, Deserialize, Serialize};

use crate::addr::{GlobalAddr, NodeId};
use crate::placement::ClusterView;
use crate::pool::PoolStats;

/// A request: an id chosen by the client (echoed in the response, so many requests can be in
/// flight on one connection) and the operation.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub struct Request {
    /// Echoed in the response.
    pub id: u64,
    /// The [`ClusterView::stamp`] the client routed this request by; the node refuses keyed
    /// operations routed by another view with `WrongView`. 0: sent to this node on purpose
    /// (one-sided access by address, a previous-owner lookup, a replica repair, admin tools).
    pub view: u64,
    /// Priority among bulk transfers ([`Priority`] as a number; a larger one is more
    /// urgent, anything above `High` counts as `High`). Requests small enough for the latency
    /// class ignore it.
    pub priority: u8,
    /// Microseconds the client will wait for the reply, counted from when the node has read
    /// the header; 0: no deadline. A bulk request the node estimates it cannot finish in time
    /// is refused up front with `DeadlineUnmeetable`.
    pub deadline_us: u64,
    /// What to do.
    pub op: Op,
}

/// How urgent a bulk transfer is: bulk requests take turns for the node's bulk workers in
/// proportion to their weight (1, 2, 4 and 8 from `Background` to `High`), per namespace and
/// priority, so none starves (docs/ARCHITECTURE.md, "Scheduling large and small requests").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Priority {
    /// The cluster's own moves and re-replication; prefetches.
    Background = 0,
    /// Work that can wait (warming a cache).
    Low = 1,
    /// Everything else (the default).
    #[default]
    Normal = 2,
    /// Transfers someone is waiting for (a decode engine's handoff).
    High = 3,
}

impl Priority {
    /// The priority a wire value means: anything above `High` is `High`.
    pub fn from_u8(v: u8) -> Priority {
        match v {
            0 => Priority::Background,
            1 => Priority::Low,
            2 => Priority::Normal,
            _ => Priority::High,
        }
    }

    /// Its share of the bulk workers relative to the others: 1, 2, 4, 8.
    pub fn weight(self) -> u64 {
        1 << (self as u8)
    }

    /// Its name in configs, flags and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Priority::Background => "background",
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
        }
    }

    /// The priority named `s` (see [`Priority::name`]).
    pub fn parse(s: &str) -> Option<Priority> {
        [
            Priority::Background,
            Priority::Low,
            Priority::Normal,
            Priority::High,
        ]
        .into_iter()
        .find(|p| p.name().eq_ignore_ascii_case(s))
    }
}

/// A key as sent on the wire.
pub type Key = Vec<u8>;

/// Operations. The payload column says what raw bytes follow the header.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub enum Op {
    /// First frame of every connection. Payload: none.
    Hello {
        /// The protocol version the connection speaks: [`crate::protocol::PROTOCOL_VERSION`],
        /// or down to [`crate::protocol::MIN_PROTOCOL_VERSION`] to talk to an older node.
        version: u32,
        /// Auth token; empty when none.
        token: String,
        /// Free-form client name, for logs.
        client: String,
    },
    /// Store one value. Payload: the value.
    Put {
        /// Namespace id.
        ns: u32,
        /// Key.
        key: Key,
        /// xxh3-64 of the value.
        checksum: u64,
        /// Pin the object.
        pin: bool,
    },
    /// Fetch one value. Payload: none. Reply: `Value` with the value as payload.
    Get {
        /// Namespace id.
        ns: u32,
        /// Key.
        key: Key,
    },
    /// Store several values. Payload: the values, concatenated in order.
    BatchPut {
        /// Namespace id.
        ns: u32,
        /// One per value.
        items: Vec<PutItem>,
        /// Pin the objects.
        pin: bool,
        /// When the items are blocks of prefix chains: each item's depth in its chain (block
        /// number), for prefix-aware eviction. Empty when they are not.
        depths: Vec<u32>,
    },
    /// Fetch several values. Reply: `Values`, payload the present values concatenated.
    BatchGet {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// The keys are a prefix chain: stop at the first missing one (later ones are reported
        /// absent even if present, since a block after a gap is useless).
        prefix: bool,
    },
    /// Length of the leading run of present keys. Reply: `Count`.
    Exists {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Remove keys. Reply: `Count` of those that existed.
    Remove {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Reserve memory for values to be written one-sided. Reply: `Allocated`.
    Alloc {
        /// Namespace id.
        ns: u32,
        /// One per value.
        items: Vec<AllocItem>,
        /// Pin the objects when committed.
        pin: bool,
        /// As in `BatchPut`: each item's depth in its prefix chain, or empty.
        depths: Vec<u32>,
    },
    /// One-sided write into a pending allocation. Payload: the bytes.
    Write {
        /// Address from `Alloc`.
        addr: GlobalAddr,
        /// Offset inside the object.
        offset: u64,
    },
    /// Make pending allocations visible. Reply: `Statuses`.
    Commit {
        /// One per allocation.
        items: Vec<CommitItem>,
    },
    /// Give pending allocations back. Reply: `Statuses`.
    Abort {
        /// Addresses from `Alloc`.
        addrs: Vec<GlobalAddr>,
    },
    /// One-sided read by address. Reply: `Data`, payload the bytes.
    Read {
        /// Address of a committed object.
        addr: GlobalAddr,
        /// Offset inside the object.
        offset: u64,
        /// Bytes to read.
        len: u64,
    },
    /// Find objects for one-sided reads, leasing them. Reply: `Located`.
    Lookup {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Lease length in ms (0: none).
        lease_ms: u64,
    },
    /// End leases. Reply: `Count` of objects found.
    Release {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Pin or unpin objects. Reply: `Count` of objects found.
    Pin {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Pin (true) or unpin.
        pinned: bool,
    },
    /// Node statistics. Reply: `Stats`.
    Stats,
    /// The cluster view. Reply: `View`.
    View,
    /// Node to node heartbeat: the sender's view, merged into the receiver's. Reply: `View`,
    /// the receiver's view after the merge. Only on a connection that passed `ClusterAuth`.
    Gossip {
        /// The sender's view.
        view: ClusterView,
    },
    /// Leave the cluster: take no new objects, move pinned objects to their other owners,
    /// then exit. Reply: `Done` once draining has started. Only on a connection that passed
    /// `ClusterAuth`.
    Drain,
    /// The segments a same-host client may map (Unix socket only): those holding only
    /// namespaces the connection's token admits to. Reply: `MapInfo`, with a descriptor of each
    /// segment riding on it (see [`SegmentMap`]).
    MapInfo,
    /// Asked of a key's owner before a copy from its previous owner is used: may a copy of
    /// each key on another node be served? Reply: `Statuses`, per key `Ok` (this node has
    /// acknowledged no write or remove of it that such a copy could shadow) or `Superseded`.
    Vouch {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Proves knowledge of the cluster secret (see [`crate::protocol::auth`]); after it the
    /// connection may send cluster control (`Gossip`, `Drain`) and use every namespace. Reply:
    /// `ClusterAuth` with the node's proof; a wrong proof gets `Unauthorized` and the
    /// connection is closed.
    ClusterAuth {
        /// The sender's fresh random bytes.
        nonce: [u8; 32],
        /// `HMAC-SHA256(secret, transcript("peer"))` over the Hello's challenge and `nonce`.
        proof: [u8; 32],
    },
    /// Removes every object of a namespace on this node, pinned ones too (Mooncake's
    /// `remove_all`). Reply: `Count` of the objects removed. A client clears a namespace by
    /// sending it to every node of the view.
    Clear {
        /// Namespace id.
        ns: u32,
    },
    /// One page of the keys of a namespace on this node that start with `prefix`: committed
    /// objects only, walked like Redis's `SCAN` (every key present from the first page to the
    /// last is listed exactly once; one written or removed meanwhile may or may not be). Reply:
    /// `Keys`. Routed by a view (`view` not 0), only the keys this node would serve to a routed
    /// read are listed; with `view` 0, every key it holds.
    Scan {
        /// Namespace id.
        ns: u32,
        /// 0 to start, then the cursor of the previous page's reply.
        cursor: u64,
        /// Index slots to look at (at most `max_batch`; 0 counts as 1): bounds the page.
        count: u32,
        /// Keys listed start with these bytes (at most 256; empty: every key).
        prefix: Vec<u8>,
    },
    /// Find objects and hold them for reading in place, for a same-host reader that maps
    /// their memory (a zero-copy view): every object found stays exactly as it is — not
    /// evicted, its memory not reused, a removal or overwrite deferred until the hold ends —
    /// for as long as this connection stays open. Holds end only when the connection closes
    /// (a connection holding objects is exempt from the idle timeout). Reply: `Located`.
    Hold {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Watch keys for a handoff: the reply says where each stands now (`Statuses`: `Ok`
    /// present, `NotFound` not yet, `Failed` tombstoned), and from then on the connection is
    /// sent an `Event` (request id [`crate::protocol::EVENT_ID`]) whenever one of them is
    /// committed or failed, until `Unwatch` or the connection closes.
    Watch {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Stop watching keys. Reply: `Count` of watches ended.
    Unwatch {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
    },
    /// Watch every key of the namespace that starts with `prefix` (at most 256 bytes; empty:
    /// every key), as `Watch` does, without a status. Reply: `Done`.
    Subscribe {
        /// Namespace id.
        ns: u32,
        /// Key prefix.
        prefix: Vec<u8>,
    },
    /// A handoff's lease on keys, written yet or not (a producer leases its blocks before it
    /// writes them, so that dying midway leaves nothing behind): each key's object is removed
    /// `ttl_ms` from now unless the lease is renewed (another `Expire`) or ended (`ttl_ms` 0:
    /// the object is kept). Reply: `Count` of the keys present.
    Expire {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Lease length in ms (0: end the lease).
        ttl_ms: u64,
    },
    /// A producer's tombstone: the keys will not be written (the request failed). Every
    /// watcher is told at once (`Event` with `Failed` and the reason) and a later `Watch` finds
    /// them failed, until a commit of the key or the tombstone's time (`tombstone_ms`) ends it.
    /// Reply: `Count` of tombstones posted.
    Fail {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Why (at most 1 KiB; longer is cut).
        reason: String,
    },
    /// (Handoff) Aborts a request's keys on this node, on both sides of a handoff: for each
    /// key, the committed object (pinned too) is removed, every pending allocation of it (a
    /// consumer's reservation, a producer's put or alloc still in flight) is released, so its
    /// commit fails with `Failed`, its handoff lease is dropped, and a tombstone with `reason`
    /// is posted as by `Fail`, waking every watcher at once. Sent to every copy's owner.
    /// Reply: `Count` of objects and pending allocations freed.
    Cancel {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// Why (at most 1 KiB; a longer one is refused with `TooLarge`).
        reason: String,
    },
    /// Node to node heartbeat, protocol 6 on: `Gossip` plus the nodes the sender heard from
    /// directly within its `down_after`, so a receiver that cannot reach one of them itself (a
    /// partition of one link) does not mark it down while others still hear it. Reply: `View`,
    /// as for `Gossip`. Only on a connection that passed `ClusterAuth`. (New variants go last:
    /// a variant's tag is its position, and peers of protocol 5 still decode the others.)
    Heartbeat {
        /// The sender's view.
        view: ClusterView,
        /// Who the sender heard directly lately (at most one entry per node of its view).
        heard: Vec<Heard>,
    },
    /// A staging area for a same-host writer whose segments the node maps read-only (Unix
    /// socket only, a token that may write some namespace): memory the client writes values
    /// into, which the node copies into their pending allocations at `CommitStaged`, so the
    /// client's stores reach nothing but its own staging area. Reply: `Staging`, with the
    /// area's descriptor riding on it (as `MapInfo`'s do). The area lives as long as this
    /// connection.
    Staging,
    /// Copies each item's bytes from staging area `staging` (this client's, from `Staging`) into
    /// its pending allocation, then commits it as `Commit` does (the checksum is checked against
    /// the bytes that landed). Reply: `Statuses`.
    CommitStaged {
        /// The staging area's id.
        staging: u64,
        /// One per allocation.
        items: Vec<StagedCommit>,
    },
    /// Node to node, protocol 7 on: sent by an owner of these keys that lacks them while the
    /// cluster settles after a view change. The receiver merges `view` as it merges `Gossip`,
    /// then moves each pinned object of the keys that it holds as its mover does after a view
    /// change, now: copied to the key's owners under its view that lack it, and dropped here
    /// once they all hold it if this node is not one of them. Reply: `View`, as for `Gossip`.
    /// Only on a connection that passed `ClusterAuth`.
    Move {
        /// Namespace id.
        ns: u32,
        /// Keys.
        keys: Vec<Key>,
        /// The sender's view.
        view: ClusterView,
    },
    /// Protocol 9 on: the node's disk tier, per tier beside `Stats`. Reply: `DiskStats`.
    DiskStats,
    /// Protocol 10 on: KV events for cache-aware routers. From the `Done` reply on, the
    /// connection is sent `KvEvents` frames (request id [`crate::protocol::EVENT_ID`]): every
    /// key of the namespace starting with `prefix` (at most 256 bytes; empty: every key) that
    /// is stored in or removed from a tier of this node. Another `KvEvents` adds its namespace
    /// and prefix to the same stream; the subscription ends with the connection.
    KvEvents {
        /// Namespace id.
        ns: u32,
        /// Key prefix.
        prefix: Vec<u8>,
    },
    /// Protocol 11 on: the node's traffic since start: operations served by type and outcome,
    /// payload bytes in and out, requests and connections refused by each limit. Reply:
    /// `Traffic`.
    Traffic,
    /// Protocol 13 on: what reading and writing the node's memory one-sidedly over its fabric
    /// takes (`fabric://` endpoints): the fabric's provider and the node's address on it, and
    /// the segments the connection's token admits to (as for `MapInfo`) with their keys.
    /// Reply: `FabricInfo`; `NotFound` when the node serves no fabric, `Unauthorized` when
    /// its provider checks no keys and the token does not admit to every segment.
    FabricInfo,
}

/// One value of a `CommitStaged`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct StagedCommit {
    /// Address from `Alloc`.
    pub addr: GlobalAddr,
    /// Where its bytes start in the staging area (its length is the address's).
    pub offset: u64,
    /// xxh3-64 of the bytes.
    pub checksum: u64,
}

/// One node a `Heartbeat`'s sender heard from directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct Heard {
    /// The node.
    pub node: u32,
    /// How long before the heartbeat was sent, in milliseconds.
    pub age_ms: u64,
}

/// One value of a `BatchPut`.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub struct PutItem {
    /// Key.
    pub key: Key,
    /// Value length: the next `len` bytes of the payload.
    pub len: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
}

/// One allocation of an `Alloc`.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub struct AllocItem {
    /// Key.
    pub key: Key,
    /// Value length.
    pub len: u64,
}

/// One commit.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub struct CommitItem {
    /// Address from `Alloc`.
    pub addr: GlobalAddr,
    /// xxh3-64 of the bytes written.
    pub checksum: u64,
}

/// A response: the request's id and the outcome.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// Outcome.
    pub reply: Reply,
}

/// Outcomes.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub enum Reply {
    /// Handshake accepted.
    Hello(HelloInfo),
    /// Done, nothing to report.
    Done,
    /// A count (see the request).
    Count(u64),
    /// One value follows as payload.
    Value {
        /// Length.
        len: u64,
        /// xxh3-64 of the value.
        checksum: u64,
    },
    /// Per key: present (and its bytes follow in the payload, in order) or not.
    Values(Vec<Option<ValueMeta>>),
    /// Per item: an error code (0 for success).
    Statuses(Vec<u16>),
    /// Per allocation: an address or an error code.
    Allocated(Vec<AllocResult>),
    /// Per key: where the object is, if present.
    Located(Vec<Option<LocatedWire>>),
    /// Read data follows as payload.
    Data,
    /// Statistics.
    Stats(PoolStats),
    /// The cluster view.
    View(ClusterView),
    /// Segments to map, of the daemon's current incarnation.
    MapInfo {
        /// The daemon's incarnation: every address the mapping may serve carries it, and so
        /// does the incarnation word of every segment listed.
        incarnation: u64,
        /// The segments.
        segments: Vec<SegmentMap>,
    },
    /// The node's answer to `ClusterAuth`: `HMAC-SHA256(secret, transcript("node"))`.
    ClusterAuth {
        /// The node's proof.
        proof: [u8; 32],
    },
    /// The request failed; `code` is an [`crate::protocol::ErrorCode`].
    Error {
        /// Error code.
        code: u16,
        /// Human-readable detail.
        message: String,
    },
    /// A watched key was committed (`code` Ok) or failed (`Failed`, with `reason`), or events
    /// were dropped (`Lagged`: check every watched key again). Sent unasked, with request id
    /// [`crate::protocol::EVENT_ID`], on a connection that watches.
    Event {
        /// Namespace id.
        ns: u32,
        /// The key (empty for `Lagged`).
        key: Key,
        /// An [`crate::protocol::ErrorCode`].
        code: u16,
        /// The producer's reason (`Failed`).
        reason: String,
    },
    /// One page of a `Scan`.
    Keys {
        /// The keys of this page (possibly none while the walk goes on).
        keys: Vec<Key>,
        /// Where the next page starts; 0 when the walk is complete.
        cursor: u64,
    },
    /// A staging area (`Staging`); its descriptor rides on this reply.
    Staging {
        /// Names the area in `CommitStaged`: random, and good only for connections that
        /// authenticated with the token of the connection that asked for it.
        id: u64,
        /// Its length in bytes.
        len: u64,
    },
    /// Protocol 8 on: the key of a `Get` is not there. A connection of an older version is
    /// answered `Error` with `NotFound` instead. (New variants go last: a variant's tag is its
    /// position.)
    Miss,
    /// Protocol 9 on: the disk tier's statistics (none when the node has no disk tier).
    DiskStats(Option<Box<DiskTierStats>>),
    /// Protocol 10 on: KV events, sent unasked with request id
    /// [`crate::protocol::EVENT_ID`] on a connection that sent `KvEvents`.
    KvEvents(KvEventBatch),
    /// Protocol 11 on: the node's traffic since start.
    Traffic(NodeTraffic),
    /// Protocol 13 on: the node's fabric and the segments this connection may reach over it.
    FabricInfo {
        /// The daemon's incarnation: every address the segments hold carries it.
        incarnation: u64,
        /// The provider (`tcp;ofi_rxm`, `shm`, `verbs;ofi_rxm`, `efa`, ...): the client opens
        /// the same.
        provider: String,
        /// The node's endpoint address on that provider (its `fi_getname`).
        address: Vec<u8>,
        /// The segments.
        segments: Vec<FabricSegment>,
    },
}

/// A segment a client may read over the node's fabric: the whole mapping (header, version
/// words, data) is registered, readable by whoever holds the key.
#[derive(Clone, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct FabricSegment {
    /// Segment number.
    pub id: u32,
    /// The mapping's first byte as the provider addresses it (its virtual address, or 0 under
    /// offset addressing).
    pub addr: u64,
    /// The registration's key: a capability, random where the provider lets the node choose.
    pub key: u64,
    /// Length of the whole mapping.
    pub total_len: u64,
}

/// What a node has served since start: the counters of its metrics page that a client cannot
/// compute from `Stats`, for `kvpool top` and scripts that have no access to the metrics
/// listener.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize, serde::Serialize,
)]
pub struct NodeTraffic {
    /// Operations served, by type (named as on the metrics page's `op` label).
    pub operations: Vec<OpCount>,
    /// Payload bytes received.
    pub bytes_in: u64,
    /// Payload bytes sent.
    pub bytes_out: u64,
    /// Requests and connections refused by a limit, by limit (named as on the metrics page's
    /// `limit` label).
    pub refusals: Vec<LimitCount>,
    /// Connections open now, over every transport.
    pub connections: u64,
}

impl NodeTraffic {
    /// Operations of the types named in `ops` served, successful or not.
    pub fn ops(&self, ops: &[&str]) -> u64 {
        self.operations
            .iter()
            .filter(|o| ops.contains(&o.op.as_str()))
            .map(|o| o.ok + o.error)
            .sum()
    }

    /// Refusals over every limit.
    pub fn refused(&self) -> u64 {
        self.refusals.iter().map(|r| r.count).sum()
    }
}

/// One operation type's count in [`NodeTraffic`].
#[derive(
    Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize, serde::Serialize,
)]
pub struct OpCount {
    /// The operation type.
    pub op: String,
    /// Served successfully.
    pub ok: u64,
    /// Answered with an error.
    pub error: u64,
}

/// One limit's refusals in [`NodeTraffic`].
#[derive(
    Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize, serde::Serialize,
)]
pub struct LimitCount {
    /// The limit.
    pub limit: String,
    /// Requests and connections it refused.
    pub count: u64,
}

/// Several KV events in one frame, in the order the node published them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct KvEventBatch {
    /// The subscriber's sequence number of the first event of `events`: it counts every event
    /// published to this subscriber, those dropped too, so a gap is visible.
    pub seq: u64,
    /// Events dropped since the previous batch because the subscriber did not read them fast
    /// enough (0: none). Nonzero is the lag marker: the receiver's picture is incomplete, and
    /// it resynchronises (lists the keys again).
    pub dropped: u64,
    /// The events.
    pub events: Vec<KvEvent>,
}

/// One key stored in or removed from a tier of the node, or a namespace cleared.
#[derive(Clone, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct KvEvent {
    /// Namespace id.
    pub ns: u32,
    /// What happened.
    pub kind: KvEventKind,
    /// Where.
    pub tier: KvTier,
    /// The key (empty for `Cleared`).
    pub key: Key,
}

/// What a [`KvEvent`] says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Archive, Serialize, Deserialize)]
#[repr(u8)]
pub enum KvEventKind {
    /// The key's value is now held in the tier (a commit, a promotion, a demotion written).
    Stored = 0,
    /// The key left the tier (removed, evicted, expired, replaced on disk, its region dropped).
    Removed = 1,
    /// Every key of the namespace left every tier (`Clear`).
    Cleared = 2,
}

/// The tier of a [`KvEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Archive, Serialize, Deserialize)]
#[repr(u8)]
pub enum KvTier {
    /// The node's memory.
    Dram = 0,
    /// The disk tier under it (`[disk]`).
    Disk = 1,
}

impl KvEventKind {
    /// Its name in the CLI's and the Python client's output.
    pub fn name(self) -> &'static str {
        match self {
            KvEventKind::Stored => "stored",
            KvEventKind::Removed => "removed",
            KvEventKind::Cleared => "cleared",
        }
    }
}

impl KvTier {
    /// Its name in the CLI's and the Python client's output.
    pub fn name(self) -> &'static str {
        match self {
            KvTier::Dram => "dram",
            KvTier::Disk => "disk",
        }
    }
}

/// A node's disk tier: its occupancy, its reads and writes, and what moved objects between it
/// and DRAM, since start.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize, serde::Serialize,
)]
pub struct DiskTierStats {
    /// The most bytes the tier's files may hold.
    pub capacity: u64,
    /// Objects on disk.
    pub objects: u64,
    /// Bytes on disk of those (whole records).
    pub bytes: u64,
    /// Reads that returned a verified value.
    pub hits: u64,
    /// Reads that did not (absent, or dropped).
    pub misses: u64,
    /// Value bytes read.
    pub bytes_read: u64,
    /// Bytes written (records and tombstones).
    pub bytes_written: u64,
    /// Copies dropped because what was read did not check out.
    pub checksum_failures: u64,
    /// Reads, writes, syncs and truncations that failed (`EIO`, `ENOSPC`).
    pub io_errors: u64,
    /// Regions dropped whole to make room.
    pub regions_dropped: u64,
    /// Objects that left with a dropped region.
    pub evicted: u64,
    /// Regions found cut short at start (a write a crash interrupted), cut there.
    pub torn: u64,
    /// Objects DRAM evicted that were written to disk.
    pub demoted: u64,
    /// Value bytes of those.
    pub demoted_bytes: u64,
    /// Evictions of objects whose value was already on disk (not written again).
    pub already_on_disk: u64,
    /// Evictions the admission filter declined.
    pub not_admitted: u64,
    /// Evictions refused because their namespace had its share of the disk.
    pub share_refused: u64,
    /// Evictions dropped because the demotion queue was full.
    pub queue_drops: u64,
    /// Demotions the store refused (too large, or the write failed).
    pub write_failures: u64,
    /// Demotions not indexed because their key was written or removed meanwhile.
    pub withdrawn: u64,
    /// Disk copies or queued demotions forgotten because their key was written anew or removed.
    pub forgotten: u64,
    /// Objects read up from disk into DRAM.
    pub promoted: u64,
    /// Value bytes of those.
    pub promoted_bytes: u64,
    /// Disk hits that could not be brought into DRAM (quota or memory refused).
    pub promotion_failures: u64,
    /// Value bytes waiting in the demotion queue or being written now.
    pub queued_bytes: u64,
}

/// Size and checksum of one value of a batch get.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct ValueMeta {
    /// Length.
    pub len: u64,
    /// xxh3-64.
    pub checksum: u64,
}

/// Result of one allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct AllocResult {
    /// The address, when it succeeded.
    pub addr: Option<GlobalAddr>,
    /// Error code (0 on success).
    pub code: u16,
}

/// A located object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct LocatedWire {
    /// Its address.
    pub addr: GlobalAddr,
    /// xxh3-64 of its bytes.
    pub checksum: u64,
}

/// What a node tells a client at the handshake.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub struct HelloInfo {
    /// Protocol version.
    pub version: u32,
    /// The node.
    pub node: u32,
    /// The incarnation of the node's daemon (random, nonzero, new at every start): a client
    /// that sees it change knows the daemon restarted and every address and mapping it held is
    /// void.
    pub incarnation: u64,
    /// Namespaces, as (name, id).
    pub namespaces: Vec<(String, u32)>,
    /// Identity of the node's host (the kernel boot id), to detect a same-host client.
    pub host_id: String,
    /// The node's Unix socket, for same-host clients (empty: none).
    pub uds_path: String,
    /// Largest payload accepted.
    pub max_payload: u64,
    /// Most items per batch.
    pub max_batch: u32,
    /// The cluster view.
    pub view: ClusterView,
    /// Replication factors of the namespaces this client may use.
    pub replication: Vec<Replication>,
    /// Fresh random bytes of this connection, for `ClusterAuth`.
    pub challenge: [u8; 32],
}

/// How many nodes hold each object of a namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct Replication {
    /// Namespace id.
    pub ns: u32,
    /// Copies of each unpinned object (KV blocks): default 1.
    pub replicas: u32,
    /// Copies of each pinned object (weights): default 2.
    pub pinned_replicas: u32,
}

/// A segment a same-host client may map. Its file is not named: the node passes an open
/// descriptor of it with the `MapInfo` reply (one per segment, in order, as `SCM_RIGHTS` on the
/// reply's first byte), opened read-write or read-only as `writable` says.
#[derive(Clone, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct SegmentMap {
    /// Segment number.
    pub id: u32,
    /// Length of the whole mapping.
    pub total_len: u64,
    /// The descriptor is open for writing: the connection may write every namespace the
    /// segment holds. Otherwise it is read-only and so must the mapping be.
    pub writable: bool,
}

impl From<&ArchivedGlobalAddrAlias> for GlobalAddr {
    fn from(a: &ArchivedGlobalAddrAlias) -> Self {
        GlobalAddr {
            node: NodeId(a.node.0.to_native()),
            incarnation: a.incarnation.to_native(),
            segment: a.segment.to_native(),
            offset: a.offset.to_native(),
            len: a.len.to_native(),
            generation: a.generation.to_native(),
            key: a.key.to_native(),
        }
    }
}

type ArchivedGlobalAddrAlias = <GlobalAddr as Archive>::Archived;
