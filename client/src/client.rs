//! The async client: a pool of connections to one node, its namespaces, and — when the node
//! runs on this host — its segments mapped for direct loads and stores.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvpool::placement::ClusterView;
use kvpool::pool::PoolStats;
use kvpool::protocol::{
    AllocItem, CommitItem, ErrorCode, HelloInfo, LocatedWire, Op, PutItem, Reply,
};
use kvpool::{checksum, AddrFault, GlobalAddr};

use crate::conn::{quic_connect, Conn};
use crate::endpoint::Endpoint;
use crate::error::ClientError;
use crate::local::LocalMap;

/// Whether to use the same-host fast path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SameHost {
    /// Use it when the node turns out to run on this host (same kernel boot id and its Unix
    /// socket is reachable): control over the Unix socket, data by direct loads and stores.
    #[default]
    Auto,
    /// Never: every byte goes through the endpoint's transport.
    Off,
}

/// How a client connects and behaves. Every default is documented on its field.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Namespace the client works in. Default `"default"`.
    pub namespace: String,
    /// Auth token for the handshake. Default empty.
    pub token: String,
    /// Name sent in the handshake, for the node's logs. Default `"kvpool-client"`.
    pub client_name: String,
    /// Every call must finish within this. Default 10 s.
    pub timeout: Duration,
    /// Most idle connections kept for reuse. Default 16.
    pub max_idle: usize,
    /// Check the xxh3 checksum of every value received. Default true.
    pub verify_checksums: bool,
    /// Same-host fast path. Default [`SameHost::Auto`].
    pub same_host: SameHost,
    /// PEM CA certificate that QUIC servers must chain to (the daemon's generated
    /// `tls-cert.pem` for a self-signed node). Default none.
    pub ca: Option<std::path::PathBuf>,
    /// Accept any QUIC server certificate. Default false.
    pub insecure_skip_verify: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            namespace: kvpool::pool::DEFAULT_NAMESPACE.to_string(),
            token: String::new(),
            client_name: "kvpool-client".into(),
            timeout: Duration::from_secs(10),
            max_idle: 16,
            verify_checksums: true,
            same_host: SameHost::Auto,
            ca: None,
            insecure_skip_verify: false,
        }
    }
}

/// A committed object located for one-sided reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Located {
    /// Its address.
    pub addr: GlobalAddr,
    /// xxh3-64 of its bytes.
    pub checksum: u64,
}

impl From<LocatedWire> for Located {
    fn from(l: LocatedWire) -> Self {
        Located {
            addr: l.addr,
            checksum: l.checksum,
        }
    }
}

struct Inner {
    endpoint: Endpoint,
    cfg: ClientConfig,
    hello: HelloInfo,
    namespaces: HashMap<String, u32>,
    idle: Mutex<Vec<Conn>>,
    quic: Option<(quinn::Endpoint, quinn::Connection)>,
    local: Option<LocalMap>,
}

/// A client of one node, bound to one namespace. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    ns: u32,
}

/// How long `load_prefix` leases blocks while copying them on the same host.
const LOAD_LEASE_MS: u64 = 5_000;

/// The blocks of a prefix, named by their tokens or by keys the engine computed itself.
#[derive(Clone, Copy, Debug)]
pub enum Prefix<'a> {
    /// Token ids, hashed into block keys as docs/HASHING.md specifies (full blocks only).
    Tokens {
        /// Tenant, model, KV layout, block size and salt.
        seed: &'a kvpool::prefix::PrefixSeed,
        /// The request's tokens.
        tokens: &'a [u32],
    },
    /// Block keys an engine already has (vLLM, SGLang and Dynamo block hashes, trace ids).
    Keys(&'a [&'a [u8]]),
}

impl Prefix<'_> {
    /// The block keys, in order.
    pub fn keys(&self) -> Vec<Vec<u8>> {
        match self {
            Prefix::Tokens { seed, tokens } => {
                seed.block_keys(tokens).iter().map(|k| k.to_vec()).collect()
            }
            Prefix::Keys(keys) => keys.iter().map(|k| k.to_vec()).collect(),
        }
    }
}

/// Values at least this large take the same-host path for puts (below it one socket round
/// trip is cheaper than the alloc and commit round trips).
const LOCAL_PUT_MIN: usize = 16 << 10;

impl Client {
    /// Connects to the node at `endpoint` (`tcp://`, `quic://` or `unix://`).
    pub async fn connect(endpoint: &str, cfg: ClientConfig) -> Result<Client, ClientError> {
        let endpoint = Endpoint::parse(endpoint)?;
        tokio::time::timeout(cfg.timeout, Self::connect_inner(endpoint, cfg))
            .await
            .map_err(|_| ClientError::Timeout)?
    }

    async fn connect_inner(
        mut endpoint: Endpoint,
        cfg: ClientConfig,
    ) -> Result<Client, ClientError> {
        let quic = match endpoint {
            Endpoint::Quic(_) => Some(quic_connect(&endpoint, &cfg).await?),
            _ => None,
        };
        let (mut conn, mut hello) =
            Conn::open(&endpoint, &cfg, quic.as_ref().map(|q| &q.1)).await?;
        let mut local = None;
        if cfg.same_host == SameHost::Auto
            && !hello.uds_path.is_empty()
            && hello.host_id == kvpool::segment::host_id()
        {
            let uds = Endpoint::Unix(hello.uds_path.clone().into());
            // Same host: control goes over the Unix socket, data through the mapping.
            if let Ok((mut c, h)) = Conn::open(&uds, &cfg, None).await {
                if let Ok(Reply::MapInfo(maps)) = c.call_simple(Op::MapInfo, &[]).await {
                    match LocalMap::open(h.node, &maps) {
                        Ok(m) => {
                            local = Some(m);
                            endpoint = uds;
                            conn = c;
                            hello = h;
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "same-host mapping failed; using the socket path")
                        }
                    }
                }
            }
        }
        let namespaces = hello.namespaces.iter().cloned().collect::<HashMap<_, _>>();
        let ns = *namespaces
            .get(&cfg.namespace)
            .ok_or_else(|| ClientError::UnknownNamespace(cfg.namespace.clone()))?;
        Ok(Client {
            inner: Arc::new(Inner {
                endpoint,
                cfg,
                hello,
                namespaces,
                idle: Mutex::new(vec![conn]),
                quic,
                local,
            }),
            ns,
        })
    }

    /// The same client, working in namespace `name`.
    pub fn namespace(&self, name: &str) -> Result<Client, ClientError> {
        let ns = *self
            .inner
            .namespaces
            .get(name)
            .ok_or_else(|| ClientError::UnknownNamespace(name.to_string()))?;
        Ok(Client {
            inner: self.inner.clone(),
            ns,
        })
    }

    /// True when the same-host fast path is in use.
    pub fn is_local(&self) -> bool {
        self.inner.local.is_some()
    }

    /// The endpoint actually used for requests (the Unix socket on the same-host path).
    pub fn endpoint(&self) -> String {
        self.inner.endpoint.to_string()
    }

    /// What the node said at the handshake.
    pub fn hello(&self) -> &HelloInfo {
        &self.inner.hello
    }

    // ----- whole values -----

    /// Stores `value` under `key`.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.put_with(key, value, false).await
    }

    /// Stores `value` under `key`, pinned: it is never evicted (model weights).
    pub async fn put_pinned(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.put_with(key, value, true).await
    }

    async fn put_with(&self, key: &[u8], value: &[u8], pin: bool) -> Result<(), ClientError> {
        if self.inner.local.is_some() && value.len() >= LOCAL_PUT_MIN {
            let codes = self.batch_put_local(&[(key, value)], pin, None).await?;
            return code_result(codes[0]);
        }
        let op = Op::Put {
            ns: self.ns,
            key: key.to_vec(),
            checksum: checksum(value),
            pin,
        };
        self.run(async |c: &mut Conn| c.call_simple(op, &[value]).await.map(|_| ()))
            .await
    }

    /// The value of `key`, or None on a miss.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        if self.inner.local.is_some() {
            if let Some(l) = self.lookup_one(key).await? {
                let mut buf = vec![0u8; l.addr.len as usize];
                if self.read_local_checked(&l, &mut buf)? {
                    return Ok(Some(buf));
                }
            } else {
                return Ok(None);
            }
        }
        let ns = self.ns;
        let verify = self.inner.cfg.verify_checksums;
        let key = key.to_vec();
        self.run(async move |c: &mut Conn| {
            let (reply, len) = match c.call(Op::Get { ns, key }, &[]).await {
                Err(ClientError::Server {
                    code: ErrorCode::NotFound,
                    ..
                }) => return Ok(None),
                r => r?,
            };
            let Reply::Value { checksum: sum, .. } = reply else {
                return Err(unexpected(&reply));
            };
            let mut buf = vec![0u8; len as usize];
            c.read_into(&mut buf).await?;
            if verify && checksum(&buf) != sum {
                return Err(ClientError::Checksum);
            }
            Ok(Some(buf))
        })
        .await
    }

    /// Copies the value of `key` into `dst`; returns its length, or None on a miss.
    pub async fn get_into(&self, key: &[u8], dst: &mut [u8]) -> Result<Option<usize>, ClientError> {
        let mut bufs = [dst];
        Ok(self
            .batch_get_into(&[key], &mut bufs)
            .await?
            .pop()
            .flatten())
    }

    /// True when `key` is present.
    pub async fn exists(&self, key: &[u8]) -> Result<bool, ClientError> {
        Ok(self.batch_exists(&[key]).await? == 1)
    }

    /// Length of the leading run of `keys` that are present, in one round trip.
    pub async fn batch_exists(&self, keys: &[&[u8]]) -> Result<usize, ClientError> {
        let op = Op::Exists {
            ns: self.ns,
            keys: owned(keys),
        };
        match self
            .run(async |c: &mut Conn| c.call_simple(op, &[]).await)
            .await?
        {
            Reply::Count(n) => Ok(n as usize),
            r => Err(unexpected(&r)),
        }
    }

    /// Removes `key`; true when it existed.
    pub async fn remove(&self, key: &[u8]) -> Result<bool, ClientError> {
        Ok(self
            .keys_op(&[key], |ns, keys| Op::Remove { ns, keys })
            .await?
            == 1)
    }

    /// Stores many values in one round trip. Returns one code per item ([`ErrorCode::Ok`] when
    /// stored). On the same host the bytes are copied straight into the node's memory.
    pub async fn batch_put_from(
        &self,
        items: &[(&[u8], &[u8])],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        self.put_many(items, None).await
    }

    async fn put_many(
        &self,
        items: &[(&[u8], &[u8])],
        chain: Option<u32>,
    ) -> Result<Vec<ErrorCode>, ClientError> {
        if self.inner.local.is_some() {
            return self.batch_put_local(items, false, chain).await;
        }
        let op = Op::BatchPut {
            chain,
            ns: self.ns,
            items: items
                .iter()
                .map(|(k, v)| PutItem {
                    key: k.to_vec(),
                    len: v.len() as u64,
                    checksum: checksum(v),
                })
                .collect(),
            pin: false,
        };
        let payload: Vec<&[u8]> = items.iter().map(|(_, v)| *v).collect();
        match self
            .run(async |c: &mut Conn| c.call_simple(op, &payload).await)
            .await?
        {
            Reply::Statuses(s) => Ok(s.into_iter().map(ErrorCode::from_u16).collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Fetches many values into caller buffers (`dsts[i]` for `keys[i]`) in one round trip.
    /// Returns each value's length, or None for a miss. On the same host the bytes are copied
    /// straight from the node's memory into the buffers.
    pub async fn batch_get_into(
        &self,
        keys: &[&[u8]],
        dsts: &mut [&mut [u8]],
    ) -> Result<Vec<Option<usize>>, ClientError> {
        self.get_many(keys, dsts, false, 0).await
    }

    /// Batched get. With `prefix`, stops at the first missing key (later ones come back None).
    /// On the same host the objects are leased for `lease_ms` while they are copied out of the
    /// mapping (0: no lease; the version check still catches a concurrent reuse).
    async fn get_many(
        &self,
        keys: &[&[u8]],
        dsts: &mut [&mut [u8]],
        prefix: bool,
        lease_ms: u64,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        assert_eq!(keys.len(), dsts.len(), "one destination buffer per key");
        if self.inner.local.is_some() {
            let located = self.lease(keys, lease_ms).await?;
            let mut out = vec![None; keys.len()];
            let mut fallback = Vec::new();
            for (i, l) in located.iter().enumerate() {
                let Some(l) = l else {
                    if prefix {
                        break;
                    }
                    continue;
                };
                let need = l.addr.len;
                let have = dsts[i].len() as u64;
                let dst = dsts[i]
                    .get_mut(..need as usize)
                    .ok_or(ClientError::BufferTooSmall { need, have })?;
                if self.read_local_checked(l, dst)? {
                    out[i] = Some(need as usize);
                } else {
                    fallback.push(i);
                }
            }
            if lease_ms > 0 {
                let leased: Vec<&[u8]> = located
                    .iter()
                    .zip(keys)
                    .filter(|(l, _)| l.is_some())
                    .map(|(_, k)| *k)
                    .collect();
                self.release(&leased).await?;
            }
            // Objects replaced between lookup and copy: fetch them through the socket.
            for i in fallback {
                out[i] = self
                    .get_into_remote(&[keys[i]], std::slice::from_mut(&mut dsts[i]), false)
                    .await?
                    .pop()
                    .flatten();
            }
            if prefix {
                // A block after a gap is useless to the engine.
                if let Some(gap) = out.iter().position(|o| o.is_none()) {
                    out[gap..].fill(None);
                }
            }
            return Ok(out);
        }
        self.get_into_remote(keys, dsts, prefix).await
    }

    async fn get_into_remote(
        &self,
        keys: &[&[u8]],
        dsts: &mut [&mut [u8]],
        prefix: bool,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        let op = Op::BatchGet {
            ns: self.ns,
            keys: owned(keys),
            prefix,
        };
        let verify = self.inner.cfg.verify_checksums;
        self.run(async move |c: &mut Conn| {
            let (reply, _) = c.call(op, &[]).await?;
            let Reply::Values(metas) = reply else {
                return Err(unexpected(&reply));
            };
            if metas.len() != dsts.len() {
                return Err(ClientError::Protocol("wrong number of values".into()));
            }
            let mut out = Vec::with_capacity(metas.len());
            let mut err = None;
            for (meta, dst) in metas.iter().zip(dsts.iter_mut()) {
                let Some(m) = meta else {
                    out.push(None);
                    continue;
                };
                match dst.get_mut(..m.len as usize) {
                    Some(d) => {
                        c.read_into(d).await?;
                        if verify && checksum(d) != m.checksum {
                            err = Some(ClientError::Checksum);
                        }
                        out.push(Some(m.len as usize));
                    }
                    None => {
                        c.skip(m.len).await?;
                        err = Some(ClientError::BufferTooSmall {
                            need: m.len,
                            have: dst.len() as u64,
                        });
                        out.push(None);
                    }
                }
            }
            err.map_or(Ok(out), Err)
        })
        .await
    }

    // ----- context caching: prefixes of KV blocks -----

    /// How many leading blocks of `prefix` the pool holds: one round trip, never one per block.
    pub async fn match_prefix(&self, prefix: Prefix<'_>) -> Result<usize, ClientError> {
        let keys = prefix.keys();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        self.batch_exists(&refs).await
    }

    /// Stores the KV blocks of a prefix (`blocks[i]` for block `i`; only full blocks, so
    /// `blocks` may not be longer than the prefix has blocks). Blocks the pool already holds
    /// are not sent again. Returns how many leading blocks the pool holds afterwards.
    pub async fn save_prefix(
        &self,
        prefix: Prefix<'_>,
        blocks: &[&[u8]],
    ) -> Result<usize, ClientError> {
        let keys = prefix.keys();
        if blocks.len() > keys.len() {
            return Err(ClientError::Protocol(format!(
                "{} blocks given for a prefix of {} full blocks",
                blocks.len(),
                keys.len()
            )));
        }
        let refs: Vec<&[u8]> = keys[..blocks.len()].iter().map(|k| &k[..]).collect();
        let have = self.batch_exists(&refs).await?;
        if have == blocks.len() {
            return Ok(have);
        }
        let items: Vec<(&[u8], &[u8])> = refs[have..]
            .iter()
            .zip(&blocks[have..])
            .map(|(k, b)| (*k, *b))
            .collect();
        let codes = self.put_many(&items, Some(have as u32)).await?;
        Ok(have + codes.iter().take_while(|c| **c == ErrorCode::Ok).count())
    }

    /// Loads the leading run of a prefix's blocks the pool holds into `dsts` (`dsts[i]` for
    /// block `i`) and returns how many it loaded; never a block after a gap. Zero-copy into the
    /// buffers on the same host, with the blocks leased while they are copied so eviction can't
    /// recycle them meanwhile.
    pub async fn load_prefix(
        &self,
        prefix: Prefix<'_>,
        dsts: &mut [&mut [u8]],
    ) -> Result<usize, ClientError> {
        let keys = prefix.keys();
        let n = keys.len().min(dsts.len());
        let refs: Vec<&[u8]> = keys[..n].iter().map(|k| &k[..]).collect();
        let got = self
            .get_many(&refs, &mut dsts[..n], true, LOAD_LEASE_MS)
            .await?;
        Ok(got.iter().take_while(|g| g.is_some()).count())
    }

    // ----- two-phase put and one-sided access -----

    /// Reserves memory for a value of `len` bytes; write it with [`Client::write`], then
    /// [`Client::commit`].
    pub async fn alloc(&self, key: &[u8], len: u64) -> Result<GlobalAddr, ClientError> {
        let mut r = self.alloc_many(&[(key, len)], false, None).await?;
        r.pop()
            .expect("one result")
            .map_err(|code| ClientError::Server {
                code,
                message: format!("{code:?}"),
            })
    }

    async fn alloc_many(
        &self,
        items: &[(&[u8], u64)],
        pin: bool,
        chain: Option<u32>,
    ) -> Result<Vec<Result<GlobalAddr, ErrorCode>>, ClientError> {
        let op = Op::Alloc {
            ns: self.ns,
            chain,
            items: items
                .iter()
                .map(|(k, l)| AllocItem {
                    key: k.to_vec(),
                    len: *l,
                })
                .collect(),
            pin,
        };
        match self
            .run(async |c: &mut Conn| c.call_simple(op, &[]).await)
            .await?
        {
            Reply::Allocated(rs) => Ok(rs
                .into_iter()
                .map(|r| r.addr.ok_or(ErrorCode::from_u16(r.code)))
                .collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Writes `bytes` at `offset` into a pending allocation: a direct store on the same host,
    /// a one-sided write request otherwise.
    pub async fn write(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        bytes: &[u8],
    ) -> Result<(), ClientError> {
        if let Some(local) = self.inner.local.as_ref().filter(|l| l.covers(addr)) {
            return local.write(addr, offset, bytes).map_err(fault);
        }
        let op = Op::Write {
            addr: *addr,
            offset,
        };
        self.run(async |c: &mut Conn| c.call_simple(op, &[bytes]).await.map(|_| ()))
            .await
    }

    /// Makes a pending allocation visible; `checksum` is the xxh3-64 of its bytes.
    pub async fn commit(&self, addr: &GlobalAddr, checksum: u64) -> Result<(), ClientError> {
        let codes = self.commit_many(&[(*addr, checksum)]).await?;
        code_result(codes[0])
    }

    async fn commit_many(
        &self,
        items: &[(GlobalAddr, u64)],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let op = Op::Commit {
            items: items
                .iter()
                .map(|(addr, checksum)| CommitItem {
                    addr: *addr,
                    checksum: *checksum,
                })
                .collect(),
        };
        match self
            .run(async |c: &mut Conn| c.call_simple(op, &[]).await)
            .await?
        {
            Reply::Statuses(s) => Ok(s.into_iter().map(ErrorCode::from_u16).collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Gives a pending allocation back.
    pub async fn abort(&self, addr: &GlobalAddr) -> Result<(), ClientError> {
        let op = Op::Abort { addrs: vec![*addr] };
        match self
            .run(async |c: &mut Conn| c.call_simple(op, &[]).await)
            .await?
        {
            Reply::Statuses(s) => code_result(ErrorCode::from_u16(s.first().copied().unwrap_or(0))),
            r => Err(unexpected(&r)),
        }
    }

    /// One-sided read of `dst.len()` bytes at `offset` of the object at `addr`. On the same host
    /// this is a plain copy from the mapping (no syscall); otherwise one request. Returns false
    /// when the object is gone or was replaced (a miss).
    pub async fn read(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<bool, ClientError> {
        if let Some(local) = self.inner.local.as_ref().filter(|l| l.covers(addr)) {
            return match local.read(addr, offset, dst) {
                Ok(()) => Ok(true),
                Err(AddrFault::Stale) => Ok(false),
                Err(f) => Err(fault(f)),
            };
        }
        let op = Op::Read {
            addr: *addr,
            offset,
            len: dst.len() as u64,
        };
        self.run(async move |c: &mut Conn| match c.call(op, &[]).await {
            Ok((Reply::Data, len)) if len == dst.len() as u64 => {
                c.read_into(dst).await?;
                Ok(true)
            }
            Ok((r, len)) => {
                c.skip(len).await?;
                Err(unexpected(&r))
            }
            Err(ClientError::Server {
                code: ErrorCode::Stale,
                ..
            }) => Ok(false),
            Err(e) => Err(e),
        })
        .await
    }

    /// The same-host read, without a socket and without an `.await`: for loops of one-sided
    /// reads. None when the node is not local or does not hold `addr`'s memory.
    pub fn read_local(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
    ) -> Option<Result<(), AddrFault>> {
        let local = self.inner.local.as_ref().filter(|l| l.covers(addr))?;
        Some(local.read(addr, offset, dst))
    }

    /// Locates objects for one-sided reads and leases them for `lease_ms` (0: no lease), so
    /// eviction leaves them alone meanwhile. One round trip.
    pub async fn lease(
        &self,
        keys: &[&[u8]],
        lease_ms: u64,
    ) -> Result<Vec<Option<Located>>, ClientError> {
        let op = Op::Lookup {
            ns: self.ns,
            keys: owned(keys),
            lease_ms,
        };
        match self
            .run(async |c: &mut Conn| c.call_simple(op, &[]).await)
            .await?
        {
            Reply::Located(v) => Ok(v.into_iter().map(|l| l.map(Located::from)).collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Ends leases; returns how many of the objects exist.
    pub async fn release(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        self.keys_op(keys, |ns, keys| Op::Release { ns, keys })
            .await
    }

    /// Pins objects; returns how many exist.
    pub async fn pin(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        self.keys_op(keys, |ns, keys| Op::Pin {
            ns,
            keys,
            pinned: true,
        })
        .await
    }

    /// Unpins objects; returns how many exist.
    pub async fn unpin(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        self.keys_op(keys, |ns, keys| Op::Pin {
            ns,
            keys,
            pinned: false,
        })
        .await
    }

    /// The node's statistics.
    pub async fn stats(&self) -> Result<PoolStats, ClientError> {
        match self
            .run(async |c: &mut Conn| c.call_simple(Op::Stats, &[]).await)
            .await?
        {
            Reply::Stats(s) => Ok(s),
            r => Err(unexpected(&r)),
        }
    }

    /// The cluster view.
    pub async fn view(&self) -> Result<ClusterView, ClientError> {
        match self
            .run(async |c: &mut Conn| c.call_simple(Op::View, &[]).await)
            .await?
        {
            Reply::View(v) => Ok(v),
            r => Err(unexpected(&r)),
        }
    }

    // ----- internals -----

    async fn keys_op(
        &self,
        keys: &[&[u8]],
        make: impl FnOnce(u32, Vec<Vec<u8>>) -> Op,
    ) -> Result<u64, ClientError> {
        let op = make(self.ns, owned(keys));
        match self
            .run(async |c: &mut Conn| c.call_simple(op, &[]).await)
            .await?
        {
            Reply::Count(n) => Ok(n),
            r => Err(unexpected(&r)),
        }
    }

    async fn lookup_one(&self, key: &[u8]) -> Result<Option<Located>, ClientError> {
        Ok(self.lease(&[key], 0).await?.pop().flatten())
    }

    /// Local read plus checksum; Ok(false) when the object was replaced meanwhile.
    fn read_local_checked(&self, l: &Located, dst: &mut [u8]) -> Result<bool, ClientError> {
        let local = self.inner.local.as_ref().expect("local path");
        match local.read(&l.addr, 0, dst) {
            Ok(()) => {}
            Err(AddrFault::Stale) => return Ok(false),
            Err(f) => return Err(fault(f)),
        }
        if self.inner.cfg.verify_checksums && checksum(dst) != l.checksum {
            return Err(ClientError::Checksum);
        }
        Ok(true)
    }

    async fn batch_put_local(
        &self,
        items: &[(&[u8], &[u8])],
        pin: bool,
        chain: Option<u32>,
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let allocs = self
            .alloc_many(
                &items
                    .iter()
                    .map(|(k, v)| (*k, v.len() as u64))
                    .collect::<Vec<_>>(),
                pin,
                chain,
            )
            .await?;
        let local = self.inner.local.as_ref().expect("local path");
        let mut codes = vec![ErrorCode::Ok; items.len()];
        let mut commits = Vec::new();
        let mut which = Vec::new();
        for (i, (a, (_, v))) in allocs.iter().zip(items).enumerate() {
            match a {
                Ok(addr) => match local.write(addr, 0, v) {
                    Ok(()) => {
                        commits.push((*addr, checksum(v)));
                        which.push(i);
                    }
                    Err(f) => {
                        codes[i] = kvpool::protocol::ErrorCode::from(kvpool::PoolError::from(f))
                    }
                },
                Err(code) => codes[i] = *code,
            }
        }
        if !commits.is_empty() {
            for (i, code) in which.into_iter().zip(self.commit_many(&commits).await?) {
                codes[i] = code;
            }
        }
        Ok(codes)
    }

    /// Runs one exchange on a pooled connection under the call timeout. The connection goes
    /// back to the pool only when the exchange left it in sync.
    async fn run<T>(
        &self,
        f: impl AsyncFnOnce(&mut Conn) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let inner = &*self.inner;
        let work = async {
            let pooled = inner.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let mut conn = match pooled {
                Some(c) => c,
                None => {
                    Conn::open(
                        &inner.endpoint,
                        &inner.cfg,
                        inner.quic.as_ref().map(|q| &q.1),
                    )
                    .await?
                    .0
                }
            };
            let r = f(&mut conn).await;
            if r.as_ref().err().is_none_or(|e| e.keeps_connection()) {
                let mut idle = inner.idle.lock().unwrap_or_else(|e| e.into_inner());
                if idle.len() < inner.cfg.max_idle {
                    idle.push(conn);
                }
            }
            r
        };
        tokio::time::timeout(inner.cfg.timeout, work)
            .await
            .map_err(|_| ClientError::Timeout)?
    }
}

fn owned(keys: &[&[u8]]) -> Vec<Vec<u8>> {
    keys.iter().map(|k| k.to_vec()).collect()
}

fn unexpected(r: &Reply) -> ClientError {
    ClientError::Protocol(format!("unexpected reply {r:?}"))
}

fn fault(f: AddrFault) -> ClientError {
    let code = ErrorCode::from(kvpool::PoolError::from(f));
    ClientError::Server {
        code,
        message: f.to_string(),
    }
}

fn code_result(code: ErrorCode) -> Result<(), ClientError> {
    match code {
        ErrorCode::Ok => Ok(()),
        code => Err(ClientError::Server {
            code,
            message: format!("{code:?}"),
        }),
    }
}
