//! A daemon's own connection to another daemon: heartbeats (`Heartbeat`, or `Gossip` to a
//! node of protocol 5), moving objects (`Lookup`, `Put`) and asking for them (`Move`, `Vouch`).
//! Plain TCP, one request at a time, every call bounded by a timeout. Requests go with view
//! stamp 0: the daemon addresses the peer on purpose. Every such connection proves the cluster
//! secret right after the handshake (`ClusterAuth`) and checks the peer's proof in turn, so
//! objects and views only ever go to a node of the cluster.
//!
//! A connection may instead carry a client's requests to the node that owns their keys (the
//! RESP door's forwarding, [`Peer::connect_for_clients`]): it shakes hands with the node token
//! only, so the peer serves its requests exactly as a client's (writes, not copies; the
//! client's priority), and its replies may carry values ([`Peer::ask`]).

use std::time::Duration;

use kvpool::protocol::auth::{self, ClusterSecret};
use kvpool::protocol::io::{discard, read_header, read_prefix, write_frame};
use kvpool::protocol::{
    decode_response_owned, judge, AlignedVec, Class, ErrorCode, Exchange, HelloInfo, Limits, Op,
    Outcome, Priority, Reply, MIN_PROTOCOL_VERSION, PREFIX_LEN, PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
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
    /// Where every connection to a peer counts the bytes of its calls.
    pub(crate) traffic: crate::metrics::PeerTraffic,
}

/// One connection to one peer, after the handshake.
pub(crate) struct Peer {
    r: BufReader<OwnedReadHalf>,
    w: BufWriter<OwnedWriteHalf>,
    hdr: AlignedVec,
    exchange: Exchange,
    limits: Limits,
    timeout: Duration,
    /// What the peer said at the handshake.
    pub(crate) hello: HelloInfo,
    /// Counts the bytes of every call.
    traffic: crate::metrics::PeerTraffic,
}

impl Peer {
    /// Connects to `addr` (`host:port`), shakes hands with the token and proves the cluster
    /// secret; fails unless the peer proves it too. Asks for this build's protocol version,
    /// and connects again asking for each older one down to [`MIN_PROTOCOL_VERSION`] while the
    /// peer is older (`UnsupportedVersion`): `hello.version` says which one the connection
    /// speaks.
    pub(crate) async fn connect(
        addr: &str,
        creds: &PeerAuth,
        node: u32,
        timeout: Duration,
    ) -> Result<Peer, PeerError> {
        let mut version = PROTOCOL_VERSION;
        loop {
            match Peer::connect_as(version, addr, creds, node, timeout).await {
                Err(PeerError::Server {
                    code: ErrorCode::UnsupportedVersion,
                    ..
                }) if version > MIN_PROTOCOL_VERSION => version -= 1,
                r => return r,
            }
        }
    }

    /// Connects to node `expect` at `addr` (`host:port`) to carry clients' requests: the
    /// handshake with the node token `token` (which admits to every namespace) and nothing
    /// more, so the node serves them as a client's; requests of the default class. Falls back
    /// to older protocol versions as [`Peer::connect`] does; fails when the node there is not
    /// `expect`.
    pub(crate) async fn connect_for_clients(
        addr: &str,
        token: &str,
        expect: u32,
        timeout: Duration,
    ) -> Result<Peer, PeerError> {
        let mut version = PROTOCOL_VERSION;
        let p = loop {
            let name = "kvpoold resp door";
            // Clients' requests, not the cluster's: not counted as peer traffic.
            let uncounted = Default::default();
            let who = (token, name, uncounted);
            match Peer::open(version, addr, who, Class::default(), timeout).await {
                Err(PeerError::Server {
                    code: ErrorCode::UnsupportedVersion,
                    ..
                }) if version > MIN_PROTOCOL_VERSION => version -= 1,
                r => break r?,
            }
        };
        if p.hello.node != expect {
            return Err(PeerError::Protocol(format!(
                "{addr} is node {}, the view says node {expect}",
                p.hello.node
            )));
        }
        Ok(p)
    }

    async fn connect_as(
        version: u32,
        addr: &str,
        creds: &PeerAuth,
        node: u32,
        timeout: Duration,
    ) -> Result<Peer, PeerError> {
        // Everything a node sends a peer is the cluster's own traffic: its moves and copies
        // are bulk at the lowest priority on the receiving node (ARCHITECTURE.md,
        // "Scheduling").
        let class = Class {
            priority: Priority::Background,
            deadline_us: 0,
        };
        let name = format!("kvpoold node {node}");
        let who = (creds.token.as_str(), name.as_str(), creds.traffic.clone());
        let mut p = Peer::open(version, addr, who, class, timeout).await?;
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

    /// A connection to `addr` after the handshake in protocol `version` with `token` as client
    /// `name`, its requests of `class` and their bytes counted in `traffic`.
    async fn open(
        version: u32,
        addr: &str,
        (token, name, traffic): (&str, &str, crate::metrics::PeerTraffic),
        class: Class,
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
            exchange: Exchange::new().with_class(class),
            limits: Limits {
                max_header: 64 << 20,
                max_payload: u64::MAX,
                max_batch: u32::MAX,
            },
            timeout,
            hello: no_hello(),
            traffic,
        };
        let hello = Op::Hello {
            version,
            token: token.to_string(),
            client: name.to_string(),
        };
        match p.call(hello, &[]).await? {
            Reply::Hello(h) => p.hello = h,
            r => return Err(PeerError::Protocol(format!("handshake answered {r:?}"))),
        }
        Ok(p)
    }

    /// The peer's id for namespace `name`, as its handshake named it.
    pub(crate) fn ns(&self, name: &str) -> Option<u32> {
        self.hello
            .namespaces
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, id)| id)
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

    /// One request stamped with view `view` (0: none), its reply judged, and, when the node
    /// did what was asked, the payload the reply carries (a value, or values one after
    /// another). A refusal is an outcome, not an error: the connection stays in step.
    pub(crate) async fn ask(
        &mut self,
        view: u64,
        op: Op,
        payload: &[&[u8]],
    ) -> Result<(Outcome, Vec<u8>), PeerError> {
        let timeout = self.timeout;
        tokio::time::timeout(timeout, self.ask_now(view, op, payload))
            .await
            .map_err(|_| PeerError::Timeout)?
    }

    async fn ask_now(
        &mut self,
        view: u64,
        op: Op,
        payload: &[&[u8]],
    ) -> Result<(Outcome, Vec<u8>), PeerError> {
        let (outcome, payload_len) = self.send_and_judge(view, op, payload).await?;
        if !matches!(outcome, Outcome::Done(_)) {
            discard(&mut self.r, payload_len).await?;
            return Ok((outcome, Vec::new()));
        }
        let mut body = Vec::new();
        let len = usize::try_from(payload_len).ok();
        if len.is_none_or(|n| body.try_reserve_exact(n).is_err()) {
            return Err(PeerError::Protocol(format!(
                "a reply payload of {payload_len} bytes"
            )));
        }
        body.resize(payload_len as usize, 0);
        self.r.read_exact(&mut body).await?;
        Ok((outcome, body))
    }

    /// Sends one request stamped with view `view` and reads its reply's header: the judged
    /// outcome and the length of the payload that follows it, still unread.
    async fn send_and_judge(
        &mut self,
        view: u64,
        op: Op,
        payload: &[&[u8]],
    ) -> Result<(Outcome, u64), PeerError> {
        self.exchange.view = view;
        let membership = matches!(op, Op::Heartbeat { .. } | Op::Gossip { .. });
        let out = self.exchange.request(op);
        write_frame(&mut self.w, &out.header, payload).await?;
        self.w.flush().await?;
        let prefix = read_prefix(&mut self.r, &self.limits)
            .await?
            .ok_or_else(|| PeerError::Protocol("peer closed the connection".into()))?;
        let frame = |header: usize, payload: u64| (PREFIX_LEN + header) as u64 + payload;
        let sent = payload.iter().map(|p| p.len() as u64).sum();
        self.traffic.call(
            membership,
            frame(out.header.len(), sent),
            frame(prefix.header_len as usize, prefix.payload_len),
        );
        read_header(&mut self.r, &prefix, &mut self.hdr).await?;
        let response =
            decode_response_owned(&self.hdr).map_err(|e| PeerError::Protocol(e.to_string()))?;
        let outcome = judge(out.id, response).map_err(|e| PeerError::Protocol(e.to_string()))?;
        Ok((outcome, prefix.payload_len))
    }

    async fn exchange(&mut self, view: u64, op: Op, payload: &[&[u8]]) -> Result<Reply, PeerError> {
        let (outcome, payload_len) = self.send_and_judge(view, op, payload).await?;
        let reply = match outcome.into_result() {
            Ok(reply) => reply,
            Err((code, message)) => {
                discard(&mut self.r, payload_len).await?;
                return Err(PeerError::Server { code, message });
            }
        };
        if payload_len != 0 {
            return Err(PeerError::Protocol("unexpected reply payload".into()));
        }
        Ok(reply)
    }
}

/// The `HelloInfo` of a peer that has not answered yet.
fn no_hello() -> HelloInfo {
    HelloInfo {
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
    }
}

#[cfg(test)]
mod tests {
    use kvpool::protocol::io::{read_header, read_prefix, write_frame};
    use kvpool::protocol::{decode_request, ArchivedOp};
    use tokio::net::TcpListener;

    use super::*;

    /// A node of protocol 5 as far as the handshake goes: refuses a `Hello` of any other
    /// version (closing the connection), answers one of 5 and the cluster proof. Returns the
    /// versions it was asked for.
    async fn old_node(l: TcpListener, secret: ClusterSecret) -> Vec<u32> {
        let mut asked = Vec::new();
        loop {
            let (s, _) = l.accept().await.unwrap();
            let (mut r, mut w) = s.into_split();
            let mut hdr = AlignedVec::new();
            let limits = Limits::default();
            let challenge = [7u8; 32];
            loop {
                let Ok(Some(prefix)) = read_prefix(&mut r, &limits).await else {
                    break;
                };
                read_header(&mut r, &prefix, &mut hdr).await.unwrap();
                let req = decode_request(&hdr).unwrap();
                let id = req.id.to_native();
                let reply = match &req.op {
                    ArchivedOp::Hello { version, .. } => {
                        asked.push(version.to_native());
                        if version.to_native() != 5 {
                            Reply::Error {
                                code: ErrorCode::UnsupportedVersion as u16,
                                message: "this node speaks protocol 5".into(),
                            }
                        } else {
                            let mut h = no_hello();
                            h.version = 5;
                            h.node = 9;
                            h.challenge = challenge;
                            Reply::Hello(h)
                        }
                    }
                    ArchivedOp::ClusterAuth { nonce, .. } => Reply::ClusterAuth {
                        proof: secret.node_proof(9, &challenge, nonce),
                    },
                    _ => return asked,
                };
                let close = matches!(reply, Reply::Error { .. });
                let hdr = kvpool::protocol::encode(&kvpool::protocol::Response { id, reply });
                write_frame(&mut w, &hdr, &[]).await.unwrap();
                w.flush().await.unwrap();
                if close {
                    break;
                }
            }
            if asked.last() == Some(&5) {
                return asked;
            }
        }
    }

    /// A node as a client sees it: answers `Hello` (as node 4, namespace `default` = 0), then
    /// a `Get` of `k` with its value, of anything else with a miss, and a `Clear` with a
    /// refusal. Returns whether anything but those came (a `ClusterAuth`).
    async fn plain_node(l: TcpListener) -> bool {
        let (s, _) = l.accept().await.unwrap();
        let (mut r, mut w) = s.into_split();
        let mut hdr = AlignedVec::new();
        let limits = Limits::default();
        while let Ok(Some(prefix)) = read_prefix(&mut r, &limits).await {
            read_header(&mut r, &prefix, &mut hdr).await.unwrap();
            let req = decode_request(&hdr).unwrap();
            let id = req.id.to_native();
            let (reply, payload): (Reply, &[u8]) = match &req.op {
                ArchivedOp::Hello { .. } => {
                    let mut h = no_hello();
                    h.version = PROTOCOL_VERSION;
                    h.node = 4;
                    h.namespaces = vec![("default".into(), 0)];
                    (Reply::Hello(h), &[])
                }
                ArchivedOp::Get { key, .. } if key.as_slice() == b"k" => (
                    Reply::Value {
                        len: 5,
                        checksum: kvpool::checksum(b"value"),
                    },
                    b"value",
                ),
                ArchivedOp::Get { .. } => (Reply::Miss, &[]),
                ArchivedOp::Clear { .. } => (
                    Reply::Error {
                        code: ErrorCode::PoolFull as u16,
                        message: "full".into(),
                    },
                    &[],
                ),
                _ => return true,
            };
            let hdr = kvpool::protocol::encode(&kvpool::protocol::Response { id, reply });
            write_frame(&mut w, &hdr, &[payload]).await.unwrap();
            w.flush().await.unwrap();
        }
        false
    }

    #[tokio::test]
    async fn a_link_for_clients_carries_values_misses_and_refusals_without_cluster_proof() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let node = tokio::spawn(plain_node(l));
        let t = Duration::from_secs(5);
        assert!(
            Peer::connect_for_clients(&addr, "", 3, t).await.is_err(),
            "the node there is not the one the view names"
        );
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let node2 = tokio::spawn(plain_node(l));
        let mut p = Peer::connect_for_clients(&addr, "", 4, t).await.unwrap();
        assert_eq!(p.ns("default"), Some(0));
        assert_eq!(p.ns("other"), None);
        let get = |key: &[u8]| Op::Get {
            ns: 0,
            key: key.to_vec(),
        };
        let (hit, body) = p.ask(9, get(b"k"), &[]).await.unwrap();
        assert!(matches!(hit, Outcome::Done(Reply::Value { len: 5, .. })));
        assert_eq!(body, b"value");
        let (miss, body) = p.ask(9, get(b"absent"), &[]).await.unwrap();
        assert_eq!((miss, body.len()), (Outcome::Miss, 0));
        let (refused, _) = p.ask(0, Op::Clear { ns: 0 }, &[]).await.unwrap();
        assert!(matches!(
            refused,
            Outcome::Refused {
                code: ErrorCode::PoolFull,
                ..
            }
        ));
        drop(p);
        assert!(!node2.await.unwrap(), "no cluster proof was sent");
        node.abort();
    }

    #[tokio::test]
    async fn an_older_peer_is_connected_to_again_in_its_version() {
        let text = ClusterSecret::generate_file_contents().unwrap();
        let secret = ClusterSecret::from_file_contents(text.as_bytes()).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let node = tokio::spawn(old_node(l, secret.clone()));
        let creds = PeerAuth {
            token: String::new(),
            secret,
            traffic: Default::default(),
        };
        let p = Peer::connect(&addr, &creds, 1, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            p.hello.version, 5,
            "the connection speaks the older version"
        );
        assert_eq!(p.hello.node, 9);
        drop(p);
        let asked: Vec<u32> = (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).rev().collect();
        assert_eq!(
            node.await.unwrap(),
            asked,
            "each version down to the peer's"
        );
    }
}
