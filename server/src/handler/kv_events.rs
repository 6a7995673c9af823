//! `KvEvents` (docs/PROTOCOL.md): a connection subscribes to the KV events of a namespace's
//! keys under a prefix; the connection loop writes its batches between requests (see
//! `serve.rs`), from the queue the event hub fills (`crate::events`).

use kvpool::protocol::{ErrorCode, Reply, EVENT_ID, KV_EVENTS_VERSION};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::conn::{Conn, Next};
use crate::ledger::Resource;
use crate::watch::MAX_PREFIX;

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// Subscribes this connection to the KV events of `ns` under `prefix`, charged to the
    /// connection and the namespace in the ledger; a subscription made twice is charged once.
    pub(super) async fn kv_events(&mut self, id: u64, ns: u32, prefix: &[u8]) -> Next {
        if self.session.version < KV_EVENTS_VERSION {
            let msg = format!("KvEvents needs protocol {KV_EVENTS_VERSION}");
            self.fail(id, ErrorCode::UnsupportedVersion, &msg).await?;
            return Ok(true);
        }
        if prefix.len() > MAX_PREFIX {
            let msg = format!("a prefix is at most {MAX_PREFIX} bytes");
            self.fail(id, ErrorCode::BadKey, &msg).await?;
            return Ok(true);
        }
        if let Err(e) = self.s.pool.check_namespace(ns) {
            return self.answer(id, Err(e.into())).await;
        }
        if let Err(r) = self.held.account.charge(ns, Resource::KvEvents, 1) {
            return self.refused(id, r).await;
        }
        let hub = &self.s.events;
        let sub = self.held.kv_events.get_or_insert_with(|| hub.subscriber());
        if !sub.add(ns, prefix) {
            self.held.account.release(ns, Resource::KvEvents, 1);
        }
        self.answer(id, Ok(Reply::Done)).await
    }

    /// Writes the KV events queued for this connection as batches (one frame per batch taken
    /// from its queue), then flushes.
    pub(super) async fn kv_event_batches(&mut self) -> std::io::Result<()> {
        while let Some(batch) = self.held.kv_events.as_mut().and_then(|s| s.take()) {
            self.reply(EVENT_ID, Reply::KvEvents(batch), &[]).await?;
        }
        self.w.flush().await
    }
}
