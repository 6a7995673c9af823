//! An in-process harness for the fuzz targets (`fuzz/`, built with the `fuzzing` feature): one
//! native-protocol connection served, by the same loop every transport runs, from a byte string
//! standing for everything a client sends, over a small anonymous pool. No socket, no thread.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvpool::placement::{ClusterView, NodeInfo};
use kvpool::pool::{NamespaceConfig, DEFAULT_NAMESPACE};
use kvpool::protocol::auth::ClusterSecret;
use kvpool::protocol::{HelloInfo, Limits, MAX_HELLO_HEADER, PROTOCOL_VERSION};
use kvpool::segment::{Backing, HugePages};
use kvpool::{Pool, PoolConfig};
use tokio::io::AsyncWrite;

use crate::cluster::{Cluster, Source};
use crate::deadline::ConnPolicy;
use crate::metrics::Transport;
use crate::service::{Auth, PeerPolicy, Shared};

/// The token that opens the node's every namespace.
pub const NODE_TOKEN: &str = "node-token";
/// The token of namespace `team` (id 1) alone.
pub const TEAM_TOKEN: &str = "team-token";

/// A node to serve connections from: a one-node cluster over a 1 MiB anonymous pool with
/// namespaces `default` (open to every client) and `team` (token [`TEAM_TOKEN`]), a current
/// thread runtime whose clock advances by itself whenever every task waits.
pub struct Harness {
    shared: Arc<Shared>,
    rt: tokio::runtime::Runtime,
}

impl Harness {
    /// A fresh node: nothing stored, nothing pending.
    pub fn new() -> Harness {
        let cfg = PoolConfig {
            segment_size: 1 << 20,
            backing: Backing::Anonymous,
            huge_pages: HugePages::Off,
            namespaces: vec![
                NamespaceConfig::unlimited(DEFAULT_NAMESPACE),
                NamespaceConfig::unlimited("team"),
            ],
            ..PoolConfig::default()
        };
        let pool = Arc::new(Pool::new(&cfg, [7; 16]).expect("an anonymous 1 MiB pool"));
        let cluster = Arc::new(Cluster::new(NodeInfo::serving(0, 1 << 20), Source::Gossip));
        cluster.attach_pool(pool.clone());
        let limits = Limits::default();
        let ledger = crate::ledger::Ledger::new(
            &crate::ledger::Bounds::uniform(64, 1024),
            &[1 << 20, 1 << 20],
        );
        let shared = Shared {
            hello: hello(&pool, &limits),
            pool,
            metrics: Arc::default(),
            started: Instant::now(),
            cluster,
            conn: conn_policy(limits),
            watches: Arc::new(crate::watch::Watches::new(
                1000,
                ledger.clone(),
                Default::default(),
            )),
            events: crate::events::EventHub::new(2, Default::default()),
            bulk: Arc::new(crate::bulk::Bulk::new(crate::bulk::BulkConfig::default())),
            trim: Default::default(),
            stagings: crate::staging::Stagings::new(
                (1 << 20, 4 << 20),
                ledger.clone(),
                Default::default(),
            ),
            ledger,
            auth: Auth {
                token: NODE_TOKEN.into(),
                ns_tokens: vec![Vec::new(), vec![TEAM_TOKEN.into()]],
                ns_read_tokens: Vec::new(),
                // Off: every input starts from the same state.
                failures: crate::auth_limit::AuthFailures::new(0, Duration::ZERO, 0),
                per_token: crate::admission::TokenCounts::new(0),
            },
            peers: PeerPolicy {
                secret: ClusterSecret::from_file_contents(&[b'k'; 32]).expect("a 32-byte secret"),
                // Off, as above.
                failures: crate::auth_limit::AuthFailures::new(0, Duration::ZERO, 0),
                timeout: Duration::from_secs(1),
            },
            disk: None,
            fabric: None,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a current-thread runtime");
        Harness {
            shared: Arc::new(shared),
            rt,
        }
    }

    /// Serves `input` as everything a client sends on one TCP connection, then its end, and
    /// returns every byte the node wrote back.
    pub fn serve(&self, input: &[u8]) -> Vec<u8> {
        let out = Output::default();
        let (_stop, shutdown) = tokio::sync::watch::channel(false);
        let serve = crate::handler::serve(
            self.shared.clone(),
            crate::handler::Accepted {
                transport: Transport::Tcp,
                peer: None,
                fd: None,
                admit: None,
            },
            input,
            out.clone(),
            shutdown,
        );
        self.rt.block_on(serve);
        let mut written = out.0.lock().expect("not poisoned");
        std::mem::take(&mut *written)
    }
}

/// The `Hello` the harness's node tells a client.
fn hello(pool: &Pool, limits: &Limits) -> HelloInfo {
    HelloInfo {
        version: PROTOCOL_VERSION,
        node: 0,
        incarnation: pool.incarnation(),
        namespaces: pool.namespaces(),
        host_id: String::new(),
        uds_path: String::new(),
        max_payload: limits.max_payload,
        max_batch: limits.max_batch,
        view: ClusterView::default(),
        replication: Vec::new(),
        challenge: [0; kvpool::protocol::auth::AUTH_LEN],
    }
}

/// The harness's timeouts: generous, and no idle timeout (the clock advances by itself).
fn conn_policy(limits: Limits) -> ConnPolicy {
    ConnPolicy {
        limits,
        hello_limits: Limits {
            max_header: MAX_HELLO_HEADER,
            max_payload: 0,
            ..limits
        },
        handshake: Duration::from_secs(10),
        idle: None,
        write: Duration::from_secs(30),
        read: Duration::from_secs(30),
    }
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}

/// The connection's write half: every byte kept.
#[derive(Clone, Default)]
struct Output(Arc<Mutex<Vec<u8>>>);

impl AsyncWrite for Output {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.0.lock().expect("not poisoned").extend_from_slice(b);
        Poll::Ready(Ok(b.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use kvpool::protocol::{
        decode_response_owned, AlignedVec, ErrorCode, Exchange, FramePrefix, Op, Reply, Response,
        MISS_VERSION, PREFIX_LEN, PROTOCOL_VERSION,
    };

    use super::*;

    fn frame(op: Op, id: u64, payload: &[u8]) -> Vec<u8> {
        Exchange::new().request_as(id, op).frame(payload)
    }

    fn replies(mut out: &[u8]) -> Vec<Response> {
        let mut all = Vec::new();
        while !out.is_empty() {
            let p = FramePrefix::parse(out.first_chunk().unwrap(), &Limits::default()).unwrap();
            let end = PREFIX_LEN + p.header_len as usize;
            let mut h = AlignedVec::<16>::new();
            h.extend_from_slice(&out[PREFIX_LEN..end]);
            all.push(decode_response_owned(&h).unwrap());
            out = &out[end + p.payload_len as usize..];
        }
        all
    }

    fn hello(token: &str) -> Op {
        hello_as(PROTOCOL_VERSION, token)
    }

    fn hello_as(version: u32, token: &str) -> Op {
        Op::Hello {
            version,
            token: token.into(),
            client: "test".into(),
        }
    }

    /// An absent key is answered `Miss` on a connection of the version that knows it, and
    /// `NotFound` on one of an older version.
    #[test]
    fn a_miss_is_a_reply_from_its_version_on_and_an_error_before() {
        let get = || Op::Get {
            ns: 0,
            key: b"absent".to_vec(),
        };
        let h = Harness::new();
        for version in [MISS_VERSION - 1, MISS_VERSION, PROTOCOL_VERSION] {
            let mut input = frame(hello_as(version, NODE_TOKEN), 1, &[]);
            input.extend(frame(get(), 2, &[]));
            let r = replies(&h.serve(&input));
            assert_eq!(r.len(), 2, "{r:?}");
            match &r[1].reply {
                Reply::Miss => assert!(version >= MISS_VERSION),
                Reply::Error { code, .. } => {
                    assert!(version < MISS_VERSION);
                    assert_eq!(ErrorCode::from_u16(*code), ErrorCode::NotFound);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// The fuzz target reaches past the handshake: a `Hello` with the node's token, then a
    /// put and a get of it, are served by the connection loop from bytes alone.
    #[test]
    fn a_hello_put_and_get_are_served_from_bytes() {
        let value = b"value";
        let mut input = frame(hello(NODE_TOKEN), 1, &[]);
        let put = Op::Put {
            ns: 0,
            key: b"k".to_vec(),
            checksum: kvpool::checksum(value),
            pin: false,
        };
        input.extend(frame(put, 2, value));
        let get = Op::Get {
            ns: 0,
            key: b"k".to_vec(),
        };
        input.extend(frame(get, 3, &[]));
        let out = Harness::new().serve(&input);
        let r = replies(&out);
        assert_eq!(r.len(), 3, "{r:?}");
        assert!(matches!(r[0].reply, Reply::Hello(_)), "{:?}", r[0]);
        assert_eq!(r[1].reply, Reply::Done);
        assert!(
            matches!(r[2].reply, Reply::Value { len: 5, .. }),
            "{:?}",
            r[2]
        );
        assert!(out.ends_with(value));
    }

    /// Without a `Hello`, or with a wrong token, nothing is served and the connection ends.
    #[test]
    fn the_handshake_gate_holds_without_a_valid_hello() {
        let get = || Op::Get {
            ns: 0,
            key: b"k".to_vec(),
        };
        let h = Harness::new();
        for opening in [frame(get(), 1, &[]), frame(hello("wrong"), 1, &[])] {
            let mut input = opening;
            input.extend(frame(get(), 2, &[]));
            let r = replies(&h.serve(&input));
            assert_eq!(r.len(), 1, "{r:?}");
            assert!(matches!(r[0].reply, Reply::Error { .. }), "{:?}", r[0]);
        }
    }
}
