//! The prefix family: finding objects by key for one-sided reads and holding them there.
//! `Lookup` locates (and leases) them, `Release` ends the leases, `Pin` pins or unpins them,
//! `Hold` keeps them in place for as long as the connection lives (same-host views).

use kvpool::protocol::{ErrorCode, Key, LocatedWire, Reply};
use kvpool::Millis;
use rkyv::Archived;
use tokio::io::{AsyncRead, AsyncWrite};

use super::{Conn, Next};
use crate::metrics::Transport;

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// A key whose object here may not be served as its owner's (see [`kvpool::placement::history`]) is
    /// reported absent.
    pub(super) async fn lookup(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        lease_ms: u64,
        now: Millis,
    ) -> Next {
        let pool = &*self.s.pool;
        let r = self.s.batch_check(keys.len()).and_then(|()| {
            // From the last key to the first, as `BatchGet` reads: a chain's root ends up its
            // most recently used block.
            keys.iter()
                .rev()
                .map(|k| {
                    if !self.s.fresh_key(ns, k.as_slice(), self.routing()) {
                        return Ok(None);
                    }
                    pool.lookup(ns, k.as_slice(), lease_ms, now).map(|l| {
                        l.map(|l| LocatedWire {
                            addr: l.addr,
                            checksum: l.checksum,
                        })
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|mut found| {
                    found.reverse();
                    found
                })
                .map_err(Into::into)
        });
        // Leases taken for a batch answered `WrongView` lapse by themselves.
        let missed = matches!(&r, Ok(found) if found.contains(&None));
        if self.answered_moved(id, missed).await? {
            return Ok(true);
        }
        self.answer(id, r.map(Reply::Located)).await
    }

    /// Holds every object found until this connection closes (Unix socket only: a hold is for
    /// a reader that maps the segments). A batch that would take the connection past
    /// `max_holds_per_connection` is refused whole.
    pub(super) async fn hold(&mut self, id: u64, ns: u32, keys: &Archived<Vec<Key>>) -> Next {
        if self.transport != Transport::Unix {
            let msg =
                "holds are only offered over the Unix socket, to a reader that maps the segments";
            self.fail(id, ErrorCode::NotLocal, msg).await?;
            return Ok(true);
        }
        if let Err(code) = self.s.batch_check(keys.len()) {
            return self.answer(id, Err(code)).await;
        }
        if self.holds.len() + keys.len() > self.s.conn.max_holds {
            let max = self.s.conn.max_holds;
            self.s
                .metrics
                .limit_refused(crate::metrics::Limit::HoldsPerConnection);
            let msg = format!(
                "this connection would hold more than {max} objects (limits.max_holds_per_connection)"
            );
            self.fail(id, ErrorCode::BatchTooLarge, &msg).await?;
            return Ok(true);
        }
        let pool = &*self.s.pool;
        let mut found = Vec::with_capacity(keys.len());
        for k in keys.iter() {
            let key = k.as_slice();
            let held = if self.s.fresh_key(ns, key, self.routing()) {
                pool.hold(ns, key)
            } else {
                Ok(None)
            };
            match held {
                Ok(Some(l)) => {
                    self.holds.held.push((ns, key.into(), l.addr.generation));
                    found.push(Some(LocatedWire {
                        addr: l.addr,
                        checksum: l.checksum,
                    }));
                }
                Ok(None) => found.push(None),
                Err(e) => {
                    // Bad key or namespace: nothing of this batch stays held.
                    self.holds.end_last(found.iter().flatten().count());
                    return self.answer(id, Err(e.into())).await;
                }
            }
        }
        if self.answered_moved(id, found.contains(&None)).await? {
            self.holds.end_last(found.iter().flatten().count());
            return Ok(true);
        }
        self.answer(id, Ok(Reply::Located(found))).await
    }

    pub(super) async fn release(&mut self, id: u64, ns: u32, keys: &Archived<Vec<Key>>) -> Next {
        let pool = &*self.s.pool;
        let r = self.count(
            keys.len(),
            keys.iter().map(|k| pool.release(ns, k.as_slice())),
        );
        self.answer(id, r).await
    }

    pub(super) async fn pin(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        pinned: bool,
    ) -> Next {
        let pool = &*self.s.pool;
        let r = self.count(
            keys.len(),
            keys.iter()
                .map(|k| pool.set_pinned(ns, k.as_slice(), pinned)),
        );
        self.answer(id, r).await
    }
}
