//! Reports of the reads a link served from its index of where same-host objects are: the node
//! did not see them, and its eviction policy and hit counters should count them.

use std::sync::Arc;

use kvpool::protocol::Op;

use super::Link;
use crate::config::ClientConfig;
use crate::seen::Reads;

impl Link {
    /// Sends [`Link::report_reads`] in the background: the read that filled the batch does not
    /// wait for the node (a round trip of a few hundred microseconds, every
    /// [`TOUCH_BATCH`](crate::seen::TOUCH_BATCH) reads, was most of the same-host batched
    /// get's tail). The seen index hands out one batch at a time, so one report per link is
    /// on its way at most; its end, however it ends, lets the next one go.
    pub(super) fn report(self: &Arc<Self>, cfg: &ClientConfig, batch: Reads) {
        struct Done(Arc<Link>);
        impl Drop for Done {
            fn drop(&mut self) {
                if let Some(sh) = &self.0.same_host {
                    sh.seen().reported();
                }
            }
        }
        let done = Done(Arc::clone(self));
        let cfg = cfg.clone();
        tokio::spawn(async move {
            done.0.report_reads(&cfg, batch).await;
            drop(done);
        });
    }

    /// Tells the node of reads served from the client's index (a lookup whose answer is not
    /// needed), so its eviction policy and hit counters count them. Best effort: a failure only
    /// loses the report.
    async fn report_reads(&self, cfg: &ClientConfig, mut batch: Reads) {
        // The node takes a `Lookup`'s keys from the last to the first: reversed, the reads
        // reach its eviction policy in the order they were noted (each call's batch already
        // tail first). The sort is stable, so each namespace keeps that order.
        batch.reverse();
        batch.sort_by_key(|(ns, _)| *ns);
        for group in batch.chunk_by(|a, b| a.0 == b.0) {
            let op = Op::Lookup {
                ns: group[0].0,
                keys: group.iter().map(|(_, k)| k.to_vec()).collect(),
                lease_ms: 0,
            };
            if let Err(e) = self.simple(cfg, 0, op, &[]).await {
                tracing::debug!(error = %e, "reporting reads served from the client's index failed");
            }
        }
    }
}
