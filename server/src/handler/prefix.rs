//! The prefix family: finding objects by key for one-sided reads and holding them there.
//! `Lookup` locates (and leases) them, `Release` ends the leases, `Pin` pins or unpins them.

use kvpool::protocol::{Key, LocatedWire, Reply};
use kvpool::Millis;
use rkyv::Archived;
use tokio::io::{AsyncRead, AsyncWrite};

use super::{Conn, Next};

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// A key whose object here may not be served as its owner's (see [`crate::fence`]) is
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
            keys.iter()
                .map(|k| {
                    if !self.s.fresh_key(ns, k.as_slice(), self.routing) {
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
                .map_err(Into::into)
        });
        self.answer(id, r.map(Reply::Located)).await
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
