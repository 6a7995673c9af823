//! Two-phase puts (alloc, write, commit) and one-sided access by global address: reads and
//! writes of the node's memory, straight from the mapping on the same host, and leases that
//! keep located objects from eviction meanwhile.

use std::sync::Arc;

use kvpool::protocol::{ErrorCode, Op, Reply};
use kvpool::{AddrFault, GlobalAddr};

use super::fanout::pick;
use super::{code_result, Client};
use crate::error::ClientError;
use crate::link::{fault, unexpected};
use crate::local::{LocalMap, LocalReadError};
use crate::located::Located;

impl Client {
    /// Reserves memory for a value of `len` bytes on the key's owner; write it with
    /// [`Client::write`], then [`Client::commit`]. (One copy: two-phase puts are not
    /// replicated.)
    pub async fn alloc(&self, key: &[u8], len: u64) -> Result<GlobalAddr, ClientError> {
        let cfg = &self.cfg;
        let ns = &*self.ns;
        routed!(self, r => {
            let owner = self.primary(&r, key)?;
            let l = self.link(owner, &r).await?;
            let mut res = l
                .alloc_many(cfg, r.stamp, l.ns(ns)?, &[(key, len)], false, Vec::new())
                .await?;
            res.pop()
                .expect("one result")
                .map_err(|code| ClientError::Server {
                    code,
                    message: format!("{code:?}"),
                })
        })
    }

    /// Writes `bytes` at `offset` into a pending allocation on the node the address names: a
    /// direct store on the same host, a one-sided write request otherwise.
    pub async fn write(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        bytes: &[u8],
    ) -> Result<(), ClientError> {
        let l = self.link_of(addr).await?;
        l.write(&self.cfg, addr, offset, bytes).await
    }

    /// Makes a pending allocation visible; `checksum` is the xxh3-64 of its bytes. Judged by
    /// the cluster view its [`Client::alloc`] was routed by (when the commit goes over the
    /// connection that allocated): if the key's owners changed since, the allocation is given
    /// back (or, when they changed during the commit, kept) and the answer is
    /// [`ErrorCode::WrongView`]; alloc, write and commit again, which routes by the new view.
    pub async fn commit(&self, addr: &GlobalAddr, checksum: u64) -> Result<(), ClientError> {
        let l = self.link_of(addr).await?;
        let codes = l.commit_many(&self.cfg, 0, &[(*addr, checksum)]).await?;
        match codes[0] {
            ErrorCode::WrongView => Err(ClientError::Server {
                code: ErrorCode::WrongView,
                message: "the cluster's view changed after the alloc (this node may no longer \
                          own the key): alloc, write and commit it again"
                    .into(),
            }),
            code => code_result(code),
        }
    }

    /// Gives a pending allocation back.
    pub async fn abort(&self, addr: &GlobalAddr) -> Result<(), ClientError> {
        let l = self.link_of(addr).await?;
        match l
            .simple(&self.cfg, 0, Op::Abort { addrs: vec![*addr] }, &[])
            .await?
        {
            Reply::Statuses(s) => code_result(ErrorCode::from_u16(s.first().copied().unwrap_or(0))),
            r => Err(unexpected(&r)),
        }
    }

    /// One-sided read of `dst.len()` bytes at `offset` of the object at `addr`, from the node
    /// the address names. On the same host this is a plain copy from the mapping (no syscall);
    /// otherwise one request. Returns false when the object is gone or was replaced, or its
    /// node can't be reached (a miss).
    pub async fn read(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<bool, ClientError> {
        Ok(self.read_hashing(addr, offset, dst, false).await?.is_some())
    }

    /// [`Client::read`] of a whole object (`dst` exactly its length) that also returns its
    /// bytes' xxh3-64, hashed as they arrive over the socket; None as `read`'s false.
    pub(crate) async fn read_hashed(
        &self,
        addr: &GlobalAddr,
        dst: &mut [u8],
    ) -> Result<Option<u64>, ClientError> {
        self.read_hashing(addr, 0, dst, true).await
    }

    /// The two above: Some(the xxh3-64 with `hash`, else 0) when read, None for a miss.
    async fn read_hashing(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
        hash: bool,
    ) -> Result<Option<u64>, ClientError> {
        let l = match self.link_of(addr).await {
            Ok(l) => l,
            Err(e) if e.is_unreachable() => return Ok(None),
            Err(e) => return Err(e),
        };
        let read = if hash {
            l.read_hashed(&self.cfg, addr, dst).await
        } else {
            l.read(&self.cfg, addr, offset, dst)
                .await
                .map(|ok| ok.then_some(0))
        };
        match read {
            Err(e) if e.is_unreachable() => {
                self.lost(addr.node.0, &e);
                Ok(None)
            }
            r => r,
        }
    }

    /// The same-host read, without a socket and without an `.await`: for loops of one-sided
    /// reads. None when the address's node is not mapped by this client. The bytes are the
    /// object's, as the seqlock and the incarnation checks prove, but not checksummed: use
    /// [`Client::read_local_verified`] for that. `WrongIncarnation` means the address or the
    /// mapping is of a daemon that is gone: lease again (which remaps after a restart).
    pub fn read_local(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
    ) -> Option<Result<(), AddrFault>> {
        let local = self.local_map(addr)?;
        Some(local.read(addr, offset, dst, false))
    }

    /// The same-host read of a whole object found by [`Client::lease`], into `dst` (at least
    /// as long as the object), checked against the object's checksum in the same pass as the
    /// copy. Returns the object's length. None when the address's node is not mapped by this
    /// client; `Checksum` when the bytes don't match (they must not be used); a node error
    /// (`Stale`, `WrongIncarnation`) when the object is gone or the daemon restarted: a miss.
    pub fn read_local_verified(
        &self,
        located: &Located,
        dst: &mut [u8],
    ) -> Option<Result<usize, ClientError>> {
        let local = self.local_map(&located.addr)?;
        let need = located.addr.len;
        let Some(dst) = dst.get_mut(..need as usize) else {
            let have = dst.len() as u64;
            return Some(Err(ClientError::BufferTooSmall { need, have }));
        };
        Some(
            match local.read_verified(&located.addr, dst, located.checksum, false) {
                Ok(()) => Ok(need as usize),
                Err(LocalReadError::Checksum) => Err(ClientError::Checksum),
                Err(LocalReadError::Fault(f)) => Err(fault(f)),
            },
        )
    }

    /// [`Client::read_local_verified`] into several buffers (`pieces`, filled in order, whose
    /// lengths must sum to the object's length): an object that holds every layer of a KV
    /// block goes straight into the engine's per-layer pages, checked against its checksum in
    /// the same pass as the copy.
    pub fn read_local_verified_scatter(
        &self,
        located: &Located,
        pieces: &mut [&mut [u8]],
    ) -> Option<Result<usize, ClientError>> {
        let local = self.local_map(&located.addr)?;
        let have: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        let need = located.addr.len;
        if have != need {
            return Some(Err(ClientError::BufferTooSmall { need, have }));
        }
        Some(
            match local.read_verified_scatter(&located.addr, pieces, located.checksum, false) {
                Ok(()) => Ok(need as usize),
                Err(LocalReadError::Checksum) => Err(ClientError::Checksum),
                Err(LocalReadError::Fault(f)) => Err(fault(f)),
            },
        )
    }

    /// The mapping that covers `addr`, if its node is mapped.
    fn local_map(&self, addr: &GlobalAddr) -> Option<Arc<LocalMap>> {
        let links = self.inner.links.lock().unwrap_or_else(|e| e.into_inner());
        links.get(&addr.node.0)?.local().filter(|l| l.covers(addr))
    }

    /// Locates objects for one-sided reads and leases them for `lease_ms` (0: none), so
    /// eviction leaves them alone meanwhile. One round trip per owner, in parallel.
    pub async fn lease(
        &self,
        keys: &[&[u8]],
        lease_ms: u64,
    ) -> Result<Vec<Option<Located>>, ClientError> {
        self.lease_replica(keys, lease_ms, 0).await
    }

    /// [`Client::lease`] asked of each key's `replica`-th owner (0: the owner; up to the
    /// namespace's `pinned_replicas` for pinned objects): a reader that found a copy missing
    /// or failing its checksum goes on to the next one. Keys without such an owner, and keys
    /// on a node that can't be reached, are None.
    pub async fn lease_replica(
        &self,
        keys: &[&[u8]],
        lease_ms: u64,
        replica: usize,
    ) -> Result<Vec<Option<Located>>, ClientError> {
        let cfg = &self.cfg;
        routed!(self, r => {
            let mut batches = self.by_owner(&r, keys, 0..keys.len(), replica);
            let answers = self
                .fan_out(&r, &mut batches, |l, ns, b| {
                    let sub = pick(keys, &b.idx);
                    async move { l.lookup(cfg, b.stamp, ns, &sub, lease_ms).await }
                })
                .await;
            let mut out = vec![None; keys.len()];
            for (b, res) in batches.iter().zip(answers) {
                if let Some(found) = self.reached(b.node, res)? {
                    b.idx.iter().zip(found).for_each(|(&i, f)| out[i] = f);
                }
            }
            Ok(out)
        })
    }
}
