//! A daemon's own connection to another daemon: heartbeats (`Gossip`) and moving pinned
//! objects (`Lookup`, `Put`). Plain TCP, one request at a time, every call bounded by a
//! timeout. Requests go with view stamp 0: the daemon addresses the peer on purpose. Every
//! connection proves the cluster secret right after the handshake (`ClusterAuth`) and checks
//! the peer's proof in turn, so objects and views only ever go to a node of the cluster.

use std::time::Duration;

use kvpool::protocol::auth::{self, ClusterSecret};
use kvpool::protocol::io::{discard, read_header, read_prefix, write_frame};
use kvpool::protocol::{
    decode_response_owned, encode, AlignedVec, ErrorCode, HelloInfo, Limits, Op, Priority, Reply,
    Request, Response, PROTOCOL_VERSION,
};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// A failed exchange with a peer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PeerError {
    #[error("peer i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("peer frame: {0}")]
    Wire(#[from] kvpool::protocol::io::WireError),
    #[error("peer protocol: {0}")]
    Protocol(String),
    #[error("peer timed out")]
    Timeout,
    #[error("peer answered {code:?}: {message}")]
    Server { code: ErrorCode, message: String },
    #[error("peer failed the cluster secret check: not a node of this cluster")]
    NotInCluster,
    #[error("no randomness for the cluster handshake: {0}")]
    Random(#[from] auth::AuthError),
}

/// What a daemon presents to its peers: the node token (when nodes have one) at `Hello`, and
/// proof of the cluster secret right after.
#[derive(Clone, Debug)]
pub(crate) struct PeerAuth {
    pub(crate) token: String,
    pub(crate) secret: ClusterSecret,
}

/// One connection to one peer, after the handshake.
pub(crate) struct Peer {
    r: BufReader<OwnedReadHalf>,
    w: BufWriter<OwnedWriteHalf>,
    hdr: AlignedVec,
    next_id: u64,
    limits: Limits,
    timeout: Duration,
    /// What the peer said at the handshake.
    pub(crate) hello: HelloInfo,
}

impl Peer {
    /// Connects to `addr` (`host:port`), shakes hands with the token and proves the cluster
    /// secret; fails unless the peer proves it too.
    pub(crate) async fn connect(
        addr: &str,
        creds: &PeerAuth,
        node: u32,
        timeout: Duration,
    ) -> Result<Peer, PeerError> {
        let s = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| PeerError::Timeout)??;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        let mut p = Peer {
            r: BufReader::with_capacity(64 << 10, r),
            w: BufWriter::with_capacity(64 << 10, w),
            hdr: AlignedVec::new(),
            next_id: 1,
            limits: Limits {
                max_header: 64 << 20,
                max_payload: u64::MAX,
                max_batch: u32::MAX,
            },
            timeout,
            hello: HelloInfo {
                version: 0,
                node: 0,
                incarnation: 0,
                namespaces: Vec::new(),
                host_id: String::new(),
                uds_path: String::new(),
                max_payload: 0,
                max_batch: 0,
                view: Default::default(),
                replication: Vec::new(),
                challenge: [0; auth::AUTH_LEN],
            },
        };
        let hello = Op::Hello {
            version: PROTOCOL_VERSION,
            token: creds.token.clone(),
            client: format!("kvpoold node {node}"),
        };
        match p.call(hello, &[]).await? {
            Reply::Hello(h) => p.hello = h,
            r => return Err(PeerError::Protocol(format!("handshake answered {r:?}"))),
        }
        let nonce = auth::random()?;
        let (them, challenge) = (p.hello.node, p.hello.challenge);
        let proof = creds.secret.peer_proof(them, &challenge, &nonce);
        match p.call(Op::ClusterAuth { nonce, proof }, &[]).await {
            Ok(Reply::ClusterAuth { proof })
                if creds.secret.verify_node(them, &challenge, &nonce, &proof) => {}
            Ok(Reply::ClusterAuth { .. })
            | Err(PeerError::Server {
                code: ErrorCode::Unauthorized,
                ..
            }) => return Err(PeerError::NotInCluster),
            Ok(r) => {
                return Err(PeerError::Protocol(format!(
                    "cluster handshake answered {r:?}"
                )))
            }
            Err(e) => return Err(e),
        }
        Ok(p)
    }

    /// One request. Replies carrying a payload are refused (nothing the daemon asks a peer for
    /// has one), so a peer can't make us buffer anything.
    pub(crate) async fn call(&mut self, op: Op, payload: &[&[u8]]) -> Result<Reply, PeerError> {
        self.call_in_view(0, op, payload).await
    }

    /// [`Peer::call`] stamped with view `view` (0: none), so the peer answers a routed read as
    /// it answers a client's: `WrongView` when its view differs, and only copies it may serve
    /// as their owner's.
    pub(crate) async fn call_in_view(
        &mut self,
        view: u64,
        op: Op,
        payload: &[&[u8]],
    ) -> Result<Reply, PeerError> {
        let timeout = self.timeout;
        tokio::time::timeout(timeout, self.exchange(view, op, payload))
            .await
            .map_err(|_| PeerError::Timeout)?
    }

    async fn exchange(&mut self, view: u64, op: Op, payload: &[&[u8]]) -> Result<Reply, PeerError> {
        let id = self.next_id;
        self.next_id += 1;
        // Everything a node sends a peer is the cluster's own traffic: its moves and copies are
        // bulk at the lowest priority on the receiving node (ARCHITECTURE.md, "Scheduling").
        let hdr = encode(&Request {
            id,
            view,
            priority: Priority::Background as u8,
            deadline_us: 0,
            op,
        });
        write_frame(&mut self.w, &hdr, payload).await?;
        self.w.flush().await?;
        let prefix = read_prefix(&mut self.r, &self.limits)
            .await?
            .ok_or_else(|| PeerError::Protocol("peer closed the connection".into()))?;
        read_header(&mut self.r, &prefix, &mut self.hdr).await?;
        let Response { id: got, reply } =
            decode_response_owned(&self.hdr).map_err(|e| PeerError::Protocol(e.to_string()))?;
        if got != id {
            return Err(PeerError::Protocol(format!(
                "response {got} for request {id}"
            )));
        }
        if let Reply::Error { code, message } = reply {
            discard(&mut self.r, prefix.payload_len).await?;
            return Err(PeerError::Server {
                code: ErrorCode::from_u16(code),
                message,
            });
        }
        if prefix.payload_len != 0 {
            return Err(PeerError::Protocol("unexpected reply payload".into()));
        }
        Ok(reply)
    }
}
