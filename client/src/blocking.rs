//! A blocking facade over [`crate::Client`], for engines that are not async. It owns a small
//! tokio runtime; every method blocks the calling thread until the async call completes.
//!
//! Uses only the public API of the crate (`Client` and its types).

use std::sync::Arc;

use kvpool::placement::ClusterView;
use kvpool::pool::PoolStats;
use kvpool::protocol::{DiskTierStats, NodeTraffic};

use crate::{ClientConfig, ClientError, ErrorCode, GlobalAddr, Located};

/// A subscription to KV events read by blocking calls (see [`crate::Client::kv_events`]);
/// dropping it ends it.
pub struct KvEvents {
    // Field order is drop order: the subscription before the runtime it runs on.
    inner: crate::KvEvents,
    rt: Arc<tokio::runtime::Runtime>,
}

impl KvEvents {
    /// The next batch of any node, waiting at most `timeout`: None when nothing came in time
    /// (see [`crate::KvEvents::next_within`]).
    pub fn next_within(
        &mut self,
        timeout: std::time::Duration,
    ) -> Option<Result<crate::KvEventBatch, ClientError>> {
        self.rt.block_on(self.inner.next_within(timeout))
    }
}

/// A blocking client. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    rt: Arc<tokio::runtime::Runtime>,
    inner: crate::Client,
}

impl Client {
    /// Connects (see [`crate::Client::connect`]).
    pub fn connect(endpoint: &str, cfg: ClientConfig) -> Result<Client, ClientError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvpool-client")
            .enable_all()
            .build()?;
        let inner = rt.block_on(crate::Client::connect(endpoint, cfg))?;
        Ok(Client {
            rt: Arc::new(rt),
            inner,
        })
    }

    /// The async client underneath.
    pub fn async_client(&self) -> &crate::Client {
        &self.inner
    }

    /// The same client in namespace `name`.
    pub fn namespace(&self, name: &str) -> Result<Client, ClientError> {
        Ok(Client {
            rt: self.rt.clone(),
            inner: self.inner.namespace(name)?,
        })
    }

    /// Runs one of the async client's futures (or one built on it, such as
    /// [`crate::weights::Weights`]'s) on this client's runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// See [`crate::Client::kv_events`].
    pub fn kv_events(&self, prefix: &[u8]) -> Result<KvEvents, ClientError> {
        Ok(KvEvents {
            inner: self.rt.block_on(self.inner.kv_events(prefix))?,
            rt: self.rt.clone(),
        })
    }

    /// True when the same-host fast path is in use (see [`crate::Client::is_local`]).
    pub fn is_local(&self) -> bool {
        self.inner.is_local()
    }

    /// See [`crate::Client::put`].
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.put(key, value))
    }

    /// See [`crate::Client::put_pinned`].
    pub fn put_pinned(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.put_pinned(key, value))
    }

    /// See [`crate::Client::get`].
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        self.rt.block_on(self.inner.get(key))
    }

    /// See [`crate::Client::get_into`].
    pub fn get_into(&self, key: &[u8], dst: &mut [u8]) -> Result<Option<usize>, ClientError> {
        self.rt.block_on(self.inner.get_into(key, dst))
    }

    /// See [`crate::Client::exists`].
    pub fn exists(&self, key: &[u8]) -> Result<bool, ClientError> {
        self.rt.block_on(self.inner.exists(key))
    }

    /// See [`crate::Client::batch_exists`].
    pub fn batch_exists(&self, keys: &[&[u8]]) -> Result<usize, ClientError> {
        self.rt.block_on(self.inner.batch_exists(keys))
    }

    /// See [`crate::Client::unreachable_events`].
    pub fn unreachable_events(&self) -> u64 {
        self.inner.unreachable_events()
    }

    /// See [`crate::Client::present`].
    pub fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>, ClientError> {
        self.rt.block_on(self.inner.present(keys))
    }

    /// See [`crate::Client::remove`].
    pub fn remove(&self, key: &[u8]) -> Result<bool, ClientError> {
        self.rt.block_on(self.inner.remove(key))
    }

    /// See [`crate::Client::remove_all`].
    pub fn remove_all(&self) -> Result<u64, ClientError> {
        self.rt.block_on(self.inner.remove_all())
    }

    /// See [`crate::Client::keys_with_prefix`].
    pub fn keys_with_prefix(&self, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ClientError> {
        self.rt.block_on(self.inner.keys_with_prefix(prefix))
    }

    /// See [`crate::Client::batch_put_from`].
    pub fn batch_put_from(&self, items: &[(&[u8], &[u8])]) -> Result<Vec<ErrorCode>, ClientError> {
        self.rt.block_on(self.inner.batch_put_from(items))
    }

    /// See [`crate::Client::batch_get_into`].
    pub fn batch_get_into(
        &self,
        keys: &[&[u8]],
        dsts: &mut [&mut [u8]],
    ) -> Result<Vec<Option<usize>>, ClientError> {
        self.rt.block_on(self.inner.batch_get_into(keys, dsts))
    }

    /// See [`crate::Client::batch_get_scatter`].
    pub fn batch_get_scatter(
        &self,
        keys: &[&[u8]],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Result<Vec<Option<usize>>, ClientError> {
        self.rt.block_on(self.inner.batch_get_scatter(keys, dsts))
    }

    /// See [`crate::Client::match_prefix`].
    pub fn match_prefix(&self, prefix: crate::Prefix<'_>) -> Result<usize, ClientError> {
        self.rt.block_on(self.inner.match_prefix(prefix))
    }

    /// See [`crate::Client::save_prefix`].
    pub fn save_prefix(
        &self,
        prefix: crate::Prefix<'_>,
        blocks: &[&[u8]],
    ) -> Result<usize, ClientError> {
        self.rt.block_on(self.inner.save_prefix(prefix, blocks))
    }

    /// See [`crate::Client::load_prefix`].
    pub fn load_prefix(
        &self,
        prefix: crate::Prefix<'_>,
        dsts: &mut [&mut [u8]],
    ) -> Result<usize, ClientError> {
        self.rt.block_on(self.inner.load_prefix(prefix, dsts))
    }

    /// See [`crate::Client::alloc`].
    pub fn alloc(&self, key: &[u8], len: u64) -> Result<GlobalAddr, ClientError> {
        self.rt.block_on(self.inner.alloc(key, len))
    }

    /// See [`crate::Client::write`].
    pub fn write(&self, addr: &GlobalAddr, offset: u64, bytes: &[u8]) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.write(addr, offset, bytes))
    }

    /// See [`crate::Client::commit`].
    pub fn commit(&self, addr: &GlobalAddr, checksum: u64) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.commit(addr, checksum))
    }

    /// See [`crate::Client::read`].
    pub fn read(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<bool, ClientError> {
        self.rt.block_on(self.inner.read(addr, offset, dst))
    }

    /// See [`crate::Client::lease`].
    pub fn lease(
        &self,
        keys: &[&[u8]],
        lease_ms: u64,
    ) -> Result<Vec<Option<Located>>, ClientError> {
        self.rt.block_on(self.inner.lease(keys, lease_ms))
    }

    /// See [`crate::Client::read_local_verified_scatter`] (no socket, no runtime).
    pub fn read_local_verified_scatter(
        &self,
        located: &Located,
        pieces: &mut [&mut [u8]],
    ) -> Option<Result<usize, ClientError>> {
        self.inner.read_local_verified_scatter(located, pieces)
    }

    /// See [`crate::Client::release`].
    pub fn release(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        self.rt.block_on(self.inner.release(keys))
    }

    /// See [`crate::Client::pin`].
    pub fn pin(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        self.rt.block_on(self.inner.pin(keys))
    }

    /// See [`crate::Client::unpin`].
    pub fn unpin(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        self.rt.block_on(self.inner.unpin(keys))
    }

    /// See [`crate::Client::stats`].
    pub fn stats(&self) -> Result<PoolStats, ClientError> {
        self.rt.block_on(self.inner.stats())
    }

    /// See [`crate::Client::disk_stats`].
    pub fn disk_stats(&self) -> Result<Option<DiskTierStats>, ClientError> {
        self.rt.block_on(self.inner.disk_stats())
    }

    /// See [`crate::Client::node_disk_stats`].
    pub fn node_disk_stats(&self, node: u32) -> Result<Option<DiskTierStats>, ClientError> {
        self.rt.block_on(self.inner.node_disk_stats(node))
    }

    /// See [`crate::Client::node_traffic`].
    pub fn node_traffic(&self, node: u32) -> Result<Option<NodeTraffic>, ClientError> {
        self.rt.block_on(self.inner.node_traffic(node))
    }

    /// See [`crate::Client::view`].
    pub fn view(&self) -> Result<ClusterView, ClientError> {
        self.rt.block_on(self.inner.view())
    }

    /// See [`crate::Client::node_stats`].
    pub fn node_stats(&self, node: u32) -> Result<PoolStats, ClientError> {
        self.rt.block_on(self.inner.node_stats(node))
    }

    /// See [`crate::Client::drain_node`].
    pub fn drain_node(&self, node: u32) -> Result<(), ClientError> {
        self.rt.block_on(self.inner.drain_node(node))
    }
}
