//! The dispatch table: each operation of the native protocol handed to its family's method.

use kvpool::protocol::ArchivedOp;
use tokio::io::{AsyncRead, AsyncWrite};

use super::conn::{Conn, Next};
use super::data::Item;

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// Hands the operation to its family's method (see the module docs).
    pub(super) async fn dispatch(&mut self, id: u64, op: &ArchivedOp, payload: u64) -> Next {
        self.settle(op).await;
        let now = self.s.now();
        match op {
            ArchivedOp::Hello {
                version,
                token,
                client,
            } => self.hello(id, version.to_native(), token, client).await,
            ArchivedOp::Stats => self.stats(id).await,
            ArchivedOp::DiskStats => self.disk_stats(id).await,
            ArchivedOp::Traffic => self.traffic(id).await,
            ArchivedOp::Put {
                ns,
                key,
                checksum,
                pin,
            } => {
                let (key, checksum) = (key.as_slice(), checksum.to_native());
                let item = Item {
                    key,
                    len: payload,
                    checksum,
                };
                self.put(id, ns.to_native(), item, *pin).await
            }
            ArchivedOp::Get { ns, key } => self.get(id, ns.to_native(), key.as_slice(), now).await,
            ArchivedOp::BatchPut {
                ns,
                items,
                pin,
                depths,
            } => {
                let ns = ns.to_native();
                self.batch_put(id, ns, items, (*pin, depths), payload).await
            }
            ArchivedOp::BatchGet { ns, keys, prefix } => {
                self.batch_get(id, ns.to_native(), keys, *prefix, now).await
            }
            ArchivedOp::Exists { ns, keys } => self.exists(id, ns.to_native(), keys).await,
            ArchivedOp::Remove { ns, keys } => self.remove(id, ns.to_native(), keys).await,
            ArchivedOp::Clear { ns } => self.clear(id, ns.to_native()).await,
            ArchivedOp::Scan {
                ns,
                cursor,
                count,
                prefix,
            } => {
                let (ns, cursor, count) = (ns.to_native(), cursor.to_native(), count.to_native());
                self.scan(id, ns, cursor, count, prefix.as_slice()).await
            }
            ArchivedOp::Alloc {
                ns,
                items,
                pin,
                depths,
            } => self.alloc(id, ns.to_native(), items, (*pin, depths)).await,
            ArchivedOp::Write { addr, offset } => {
                self.write(id, addr, offset.to_native(), payload).await
            }
            ArchivedOp::Commit { items } => self.commit(id, items).await,
            ArchivedOp::Abort { addrs } => self.abort(id, addrs).await,
            ArchivedOp::Read { addr, offset, len } => {
                self.read(id, addr, offset.to_native(), len.to_native())
                    .await
            }
            ArchivedOp::MapInfo => self.map_info(id).await,
            ArchivedOp::FabricInfo => self.fabric_info(id).await,
            ArchivedOp::Staging => self.staging(id).await,
            ArchivedOp::CommitStaged { staging, items } => {
                self.commit_staged(id, staging.to_native(), items).await
            }
            ArchivedOp::Lookup { ns, keys, lease_ms } => {
                let lease_ms = lease_ms.to_native();
                self.lookup(id, ns.to_native(), keys, lease_ms, now).await
            }
            ArchivedOp::Release { ns, keys } => self.release(id, ns.to_native(), keys).await,
            ArchivedOp::Pin { ns, keys, pinned } => {
                self.pin(id, ns.to_native(), keys, *pinned).await
            }
            ArchivedOp::ClusterAuth { nonce, proof } => self.cluster_auth(id, nonce, proof).await,
            ArchivedOp::Gossip { view } => self.gossip(id, view, None).await,
            ArchivedOp::Heartbeat { view, heard } => self.gossip(id, view, Some(heard)).await,
            ArchivedOp::View => self.view(id).await,
            ArchivedOp::Drain => self.drain(id).await,
            ArchivedOp::Vouch { ns, keys } => self.vouch(id, ns.to_native(), keys).await,
            ArchivedOp::Hold { ns, keys } => self.hold(id, ns.to_native(), keys).await,
            ArchivedOp::Watch { ns, keys } => self.watch(id, ns.to_native(), keys, now).await,
            ArchivedOp::Unwatch { ns, keys } => self.unwatch(id, ns.to_native(), keys).await,
            ArchivedOp::Subscribe { ns, prefix } => {
                self.subscribe(id, ns.to_native(), prefix.as_slice()).await
            }
            ArchivedOp::Expire { ns, keys, ttl_ms } => {
                self.expire(id, ns.to_native(), keys, ttl_ms.to_native(), now)
                    .await
            }
            ArchivedOp::Fail { ns, keys, reason } => {
                self.fail_keys(id, ns.to_native(), keys, reason.as_str(), now)
                    .await
            }
            ArchivedOp::Cancel { ns, keys, reason } => {
                self.cancel(id, ns.to_native(), keys, reason.as_str(), now)
                    .await
            }
            ArchivedOp::KvEvents { ns, prefix } => {
                self.kv_events(id, ns.to_native(), prefix.as_slice()).await
            }
            ArchivedOp::Move { ns, keys, view } => {
                self.move_keys(id, ns.to_native(), keys, view).await
            }
        }
    }
}
