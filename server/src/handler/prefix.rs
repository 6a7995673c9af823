//! The prefix family: finding objects by key for one-sided reads and holding them there.
//! `Lookup` locates (and leases) them, `Release` ends the leases, `Pin` pins or unpins them,
//! `Hold` keeps them in place for as long as the connection lives (same-host views).

use kvpool::protocol::{ErrorCode, Key, LocatedWire, Reply};
use kvpool::Millis;
use rkyv::Archived;
use tokio::io::{AsyncRead, AsyncWrite};

use super::conn::{Conn, Next};
use crate::ledger::{Refused, Resource};
use crate::metrics::Transport;

/// Why a batch of holds was refused whole.
enum HoldFailed {
    /// A bound of the resource ledger.
    Limit(Refused),
    /// A bad key or namespace.
    Pool(kvpool::PoolError),
}

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
                    self.s.bring_up(ns, k.as_slice(), now, self.routing());
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
    /// a reader that maps the segments). A batch that would take the connection or the
    /// namespace past its bounds (objects held, and bytes held: `max_held_share` of the
    /// namespace's memory) is refused whole, with `LimitExceeded`.
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
        if let Err(e) = self.s.pool.check_namespace(ns) {
            return self.answer(id, Err(e.into())).await;
        }
        let n = keys.len() as u64;
        if let Err(r) = self.held.account.charge(ns, Resource::Holds, n) {
            return self.refused(id, r).await;
        }
        let found = match self.hold_each(ns, keys) {
            Ok(found) => found,
            Err(e) => {
                // Nothing of this batch stays held.
                self.held.account.release(ns, Resource::Holds, n);
                return match e {
                    HoldFailed::Limit(r) => self.refused(id, r).await,
                    HoldFailed::Pool(e) => self.answer(id, Err(e.into())).await,
                };
            }
        };
        let held = found.iter().flatten().count();
        self.held
            .account
            .release(ns, Resource::Holds, n - held as u64);
        if self.answered_moved(id, held < found.len()).await? {
            self.held.holds.end_last(held, &mut self.held.account);
            return Ok(true);
        }
        self.answer(id, Ok(Reply::Located(found))).await
    }

    /// Holds each of `keys` that is here, charging its bytes; on a refusal or a bad key, ends
    /// the holds this call took and says why.
    fn hold_each(
        &mut self,
        ns: u32,
        keys: &Archived<Vec<Key>>,
    ) -> Result<Vec<Option<LocatedWire>>, HoldFailed> {
        let pool = &*self.s.pool;
        let mut found = Vec::with_capacity(keys.len());
        for k in keys.iter() {
            let key = k.as_slice();
            let held = match self.s.fresh_key(ns, key, self.routing()) {
                true => {
                    self.s.bring_up(ns, key, self.s.now(), self.routing());
                    pool.hold(ns, key)
                }
                false => Ok(None),
            };
            let refused = match held {
                Ok(Some(l)) => {
                    let (generation, len) = (l.addr.generation, l.addr.len);
                    match self.held.account.charge(ns, Resource::HeldBytes, len) {
                        Ok(()) => {
                            self.held.holds.held.push((ns, key.into(), generation, len));
                            found.push(Some(LocatedWire {
                                addr: l.addr,
                                checksum: l.checksum,
                            }));
                            continue;
                        }
                        Err(r) => {
                            let _ = pool.unhold(ns, key, generation);
                            HoldFailed::Limit(r)
                        }
                    }
                }
                Ok(None) => {
                    found.push(None);
                    continue;
                }
                Err(e) => HoldFailed::Pool(e),
            };
            self.held
                .holds
                .end_last(found.iter().flatten().count(), &mut self.held.account);
            return Err(refused);
        }
        Ok(found)
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
