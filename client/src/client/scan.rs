//! Listing keys: every serving node of the view walks its keys with a prefix a bounded page at
//! a time (`Op::Scan`), all nodes at once; the keys come back merged, each once. Part of
//! `client`; uses `fanout` and `routing`.

use std::collections::BTreeSet;

use kvpool::placement::NodeState;
use kvpool::protocol::{ErrorCode, Op, Reply};

use super::fanout::add_key;
use super::Client;
use crate::error::ClientError;
use crate::link::unexpected;

/// Index slots one `Scan` page asks a node to look at (a node caps it at its `max_batch`).
const SCAN_PAGE: u32 = 1024;

impl Client {
    /// The keys of this client's namespace that start with `prefix` (empty: every key), on
    /// every serving node of the cluster view, each once (a key kept on several replicas is
    /// listed once), sorted. A node lists only the committed objects it would serve to a read
    /// routed to it, so a copy kept for another owner is not listed. Like Redis's `SCAN`: a key
    /// present throughout the call is listed; one written or removed meanwhile may or may not
    /// be. A node that can't be reached is skipped (counted in
    /// [`Client::unreachable_events`]), as reads count its keys as misses: its keys are listed
    /// only when a replica holds them. A view change during the walk starts it again with the
    /// new view.
    pub async fn keys_with_prefix(&self, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ClientError> {
        if prefix.len() > kvpool::MAX_KEY_LEN {
            return Err(ClientError::Server {
                code: ErrorCode::BadKey,
                message: format!(
                    "a prefix of {} bytes is longer than any key ({} bytes at most)",
                    prefix.len(),
                    kvpool::MAX_KEY_LEN
                ),
            });
        }
        let cfg = &self.cfg;
        routed!(self, r => {
            let (mut batches, cut) = (Vec::new(), self.cut());
            for n in r.view.nodes.iter().filter(|n| n.state == NodeState::Serving) {
                add_key(&mut batches, (n.id, r.stamp, ()), 0, cut);
            }
            let answers = self
                .fan_out(&r, &mut batches, |l, ns, b| async move {
                    let count = SCAN_PAGE.min(l.hello.max_batch.max(1));
                    let mut keys = Vec::new();
                    let mut cursor = 0;
                    loop {
                        let op = Op::Scan {
                            ns,
                            cursor,
                            count,
                            prefix: prefix.to_vec(),
                        };
                        match l.simple(cfg, b.stamp, op, &[]).await? {
                            Reply::Keys { keys: page, cursor: next } => {
                                keys.extend(page);
                                if next == 0 {
                                    return Ok(keys);
                                }
                                // A node's cursors only grow (see `Pool::scan`): one that
                                // does not is a broken walk that would never end.
                                if next <= cursor {
                                    return Err(ClientError::Protocol(format!(
                                        "node {} answered Scan cursor {cursor} with {next}",
                                        b.node
                                    )));
                                }
                                cursor = next;
                            }
                            r => return Err(unexpected(&r)),
                        }
                    }
                })
                .await;
            let mut all = BTreeSet::new();
            for (b, res) in batches.iter().zip(answers) {
                if let Some(keys) = self.reached(b.node, res)? {
                    all.extend(keys.into_iter().filter(|k| k.starts_with(prefix)));
                }
            }
            Ok(all.into_iter().collect())
        })
    }
}
