//! The operations over many keys that the public calls of `client` share: stores on every
//! replica, batched gets that fall back to the next replica and (while the view is changing)
//! to previous owners, per-key presence, the owners' vouching for previous owners' copies, and
//! the keys operations answered with a count. Part of `client`; every request goes out through
//! the one fan-out (`fanout`), routed by `routing`.

use std::sync::Arc;

use kvpool::protocol::{ErrorCode, Op, Reply};
use kvpool::route::{ViewChanged, WriteCodes};

use super::fanout::{add_item, add_key, asked_of, pick, Batch};
use super::routing::Routing;
use super::Client;
use crate::dst::Dst;
use crate::error::ClientError;
use crate::link::{owned, unexpected, Link};

/// Destination buffers by key index; a buffer is out (None) while a request fills it.
type Slots<'a, 'b> = [Option<Dst<'a, 'b>>];

impl Client {
    /// Per key of `keys`: may the copy of `keys[i]` on its previous owner `p` be served, for
    /// each `(i, p)` in `asked`? Only when every current owner of the key (among the replicas
    /// reads consult; `p` itself aside) vouches that it acknowledged no write or remove of the
    /// key since it could have taken one over that copy (`Op::Vouch`). Without that a copy
    /// from before an acknowledged write could shadow it, once the write is evicted or removed
    /// on the owner. An owner that does not answer vouches for nothing: a miss, never a stale
    /// value. One request per owner, in parallel.
    pub(super) async fn vouched(
        &self,
        r: &Routing,
        keys: &[&[u8]],
        asked: &[(usize, u32)],
    ) -> Vec<bool> {
        let cfg = &self.cfg;
        let mut ok = vec![false; keys.len()];
        let (mut batches, cut) = (Vec::new(), self.cut());
        for &(i, prev) in asked {
            ok[i] = true;
            for o in r.view.owners(keys[i], self.read_replicas()) {
                if o.0 != prev {
                    add_key(&mut batches, (o.0, 0, ()), i, cut);
                }
            }
        }
        let answers = self
            .fan_out(r, &mut batches, |l, ns, b| async move {
                let op = Op::Vouch {
                    ns,
                    keys: owned(&pick(keys, &b.idx)),
                };
                match l.simple(cfg, b.stamp, op, &[]).await? {
                    Reply::Statuses(s) if s.len() == b.idx.len() => Ok(s),
                    other => Err(unexpected(&other)),
                }
            })
            .await;
        for (b, res) in batches.iter().zip(answers) {
            match res {
                Ok(s) => b
                    .idx
                    .iter()
                    .zip(s)
                    .for_each(|(&i, c)| ok[i] &= c == ErrorCode::Ok as u16),
                Err(_) => b.idx.iter().for_each(|&i| ok[i] = false),
            }
        }
        ok
    }

    /// Per key: present on its owner, or (while the view is changing) on its previous owner.
    pub(super) async fn presence(
        &self,
        r: &Routing,
        keys: &[&[u8]],
    ) -> Result<Vec<bool>, ClientError> {
        let cfg = &self.cfg;
        let lookup = |l: Arc<Link>, ns, b: &Batch| {
            let sub = pick(keys, &b.idx);
            let stamp = b.stamp;
            async move { l.lookup(cfg, stamp, ns, &sub, 0).await }
        };
        let mut present = vec![false; keys.len()];
        let mut batches = self.by_owner(r, keys, 0..keys.len(), 0);
        let answers = self
            .fan_out(r, &mut batches, |l, ns, b| lookup(l, ns, b))
            .await;
        for (b, res) in batches.iter().zip(answers) {
            if let Some(found) = self.reached(b.node, res)? {
                b.idx
                    .iter()
                    .zip(found)
                    .for_each(|(&i, f)| present[i] = f.is_some());
            }
        }
        // Misses up to the end of the batch, on their previous owners.
        let misses: Vec<usize> = (0..keys.len()).filter(|&i| !present[i]).collect();
        let mut prev = self.by_previous_owner(r, keys, misses);
        let asked = asked_of(&prev);
        let (vouched, answers) = tokio::join!(
            self.vouched(r, keys, &asked),
            self.fan_out(r, &mut prev, |l, ns, b| lookup(l, ns, b))
        );
        for (b, res) in prev.iter().zip(answers) {
            if let Ok(found) = res {
                b.idx
                    .iter()
                    .zip(found)
                    .for_each(|(&i, f)| present[i] |= f.is_some() && vouched[i]);
            }
        }
        // As in get_many: a key handed over between the two lookups is on its owner by now.
        let again: Vec<usize> = asked
            .iter()
            .map(|&(i, _)| i)
            .filter(|&i| !present[i])
            .collect();
        if !again.is_empty() {
            let mut batches = self.by_owner(r, keys, again, 0);
            let answers = self
                .fan_out(r, &mut batches, |l, ns, b| lookup(l, ns, b))
                .await;
            for (b, res) in batches.iter().zip(answers) {
                if let Ok(found) = res {
                    b.idx
                        .iter()
                        .zip(found)
                        .for_each(|(&i, f)| present[i] |= f.is_some());
                }
            }
        }
        Ok(present)
    }

    /// Stores items on their owners (`replicas` of them, `pinned_replicas` when pinned). An
    /// item counts as stored when one owner stored it. `sums`: the values' checksums when the
    /// caller has them (`sums[i]` for `items[i]`); otherwise each value is hashed here.
    pub(super) async fn put_many(
        &self,
        items: &[(&[u8], &[u8])],
        sums: Option<&[u64]>,
        pin: bool,
        depths: Vec<u32>,
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let cfg = &self.cfg;
        let r_count = if pin { self.repl.1 } else { self.repl.0 }.max(1);
        let depths = &depths;
        routed!(self, r => {
            // Each node's batch runs from the last item to the first, so a node stores a prefix
            // chain tail first and its eviction policy sees the chain's root as the newest of
            // its blocks: under pressure a chain shrinks from its end, where a prefix lookup
            // loses least (docs/EVICTION.md, "tail first").
            let (mut batches, cut) = (Vec::new(), self.cut());
            for (i, (k, v)) in items.iter().enumerate().rev() {
                for o in r.view.owners(k, r_count) {
                    add_item(&mut batches, (o.0, r.stamp, ()), (i, v.len() as u64), cut);
                }
            }
            let answers = self
                .fan_out(&r, &mut batches, |l, ns, b| {
                    let sub = pick(items, &b.idx);
                    let sub_depths = if depths.is_empty() {
                        Vec::new()
                    } else {
                        pick(depths, &b.idx)
                    };
                    let sub_sums = sums.map(|s| pick(s, &b.idx));
                    async move {
                        l.put_many(cfg, b.stamp, ns, &sub, sub_sums.as_deref(), pin, sub_depths)
                            .await
                    }
                })
                .await;
            // Stored once is stored; otherwise the first owner's refusal (the routing plan's
            // rule, `WriteCodes`).
            let mut codes = WriteCodes::new(items.len());
            for (b, res) in batches.iter().zip(answers) {
                let got = self
                    .reached(b.node, res)?
                    .unwrap_or_else(|| vec![ErrorCode::Unavailable; b.idx.len()]);
                for (&i, code) in b.idx.iter().zip(got) {
                    codes.heard(i, code);
                }
            }
            // An owner's view changed while the values streamed in (it refuses to commit
            // then): the batch goes again by the new view; values stored are stored again.
            codes.finish().map_err(|ViewChanged| ClientError::Server {
                code: ErrorCode::WrongView,
                message: "the view changed during the put".into(),
            })
        })
    }

    /// Batched get, one request per owner in parallel; keys whose owner can't be reached are
    /// tried on their next replica, misses (while the view is changing) on their previous
    /// owner. With `prefix`, nothing after the first missing key is returned.
    pub(super) async fn get_many(
        &self,
        keys: &[&[u8]],
        dsts: &mut [Dst<'_, '_>],
        prefix: bool,
        lease_ms: u64,
    ) -> Result<Vec<Option<usize>>, ClientError> {
        assert_eq!(keys.len(), dsts.len(), "one destination per key");
        routed!(self, r => {
            // Reborrowed afresh in every attempt: a failed one may not have given back all.
            let mut slots: Vec<Option<Dst<'_, '_>>> =
                dsts.iter_mut().map(|d| Some(&mut **d)).collect();
            let all = (0..keys.len()).collect();
            let (mut out, misses) = self
                .get_from_owners(&r, keys, &mut slots, (all, prefix), lease_ms)
                .await?;
            if self.fallback(&r).is_some() && !misses.is_empty() {
                self.get_from_previous(
                    &r,
                    keys,
                    &mut slots,
                    &mut out,
                    misses.clone(),
                    prefix,
                    lease_ms,
                )
                .await;
                // A key its previous owner no longer had may have reached its owner between
                // the two lookups (a mover drops its copy only once the owner holds it): the
                // owner is asked once more, so a key in flight is never a miss.
                let again: Vec<usize> = misses.into_iter().filter(|&i| out[i].is_none()).collect();
                if !again.is_empty() {
                    let (got, _) = self
                        .get_from_owners(&r, keys, &mut slots, (again.clone(), false), lease_ms)
                        .await?;
                    for i in again {
                        out[i] = got[i];
                    }
                }
            }
            if prefix {
                if let Some(gap) = out.iter().position(|o| o.is_none()) {
                    out[gap..].fill(None);
                }
            }
            Ok(out)
        }, wrong_view_miss => vec![None; keys.len()])
    }

    /// The owners' part of [`Client::get_many`] for the keys at `todo`: round k asks the k-th
    /// owner of the keys whose earlier owners could not be reached. Returns each key's length (None: a miss) and the
    /// keys that missed, in the order their answers came.
    async fn get_from_owners(
        &self,
        r: &Routing,
        keys: &[&[u8]],
        slots: &mut Slots<'_, '_>,
        (mut todo, prefix): (Vec<usize>, bool),
        lease_ms: u64,
    ) -> Result<(Vec<Option<usize>>, Vec<usize>), ClientError> {
        let cfg = &self.cfg;
        let mut out = vec![None; keys.len()];
        let mut misses = Vec::new();
        let mut round = 0;
        while !todo.is_empty() {
            let batches = self.by_owner(r, keys, todo.iter().copied(), round);
            // The node stops at the first missing key only when it holds the whole batch.
            let single = batches.len() == 1 && todo.len() == keys.len();
            let mut batches = take_bufs(batches, slots);
            let answers = self
                .fan_out(r, &mut batches, |l, ns, b| {
                    let sub = pick(keys, &b.idx);
                    let (stamp, bufs) = (b.stamp, &mut b.tag);
                    let prefix = prefix && single;
                    async move {
                        l.get_many(cfg, stamp, ns, &sub, bufs, prefix, lease_ms)
                            .await
                    }
                })
                .await;
            todo = Vec::new();
            for (b, res) in batches.into_iter().zip(answers) {
                let (node, idx) = give_back(b, slots);
                match self.reached(node, res)? {
                    Some(got) => {
                        for (&i, g) in idx.iter().zip(got) {
                            out[i] = g;
                            if g.is_none() {
                                misses.push(i);
                            }
                        }
                    }
                    None => todo.extend(idx),
                }
            }
            round += 1;
        }
        Ok((out, misses))
    }

    /// The previous owners' part of [`Client::get_many`] (while the view is changing): the
    /// misses looked up on their previous owners, a copy used only when the keys' owners vouch
    /// for it. With `prefix`, every key from the first miss on (any may extend the run).
    #[expect(
        clippy::too_many_arguments,
        reason = "the buffers and the results of get_many's first part, passed on"
    )]
    async fn get_from_previous(
        &self,
        r: &Routing,
        keys: &[&[u8]],
        slots: &mut Slots<'_, '_>,
        out: &mut [Option<usize>],
        mut misses: Vec<usize>,
        prefix: bool,
        lease_ms: u64,
    ) {
        let cfg = &self.cfg;
        misses.sort_unstable();
        if prefix {
            // Blocks before the first miss are loaded; from it on, any may extend the run, and
            // those on one previous owner go in one request.
            let first = misses[0];
            misses = (first..keys.len()).filter(|&i| out[i].is_none()).collect();
        }
        let batches = self.by_previous_owner(r, keys, misses);
        let asked = asked_of(&batches);
        let mut batches = take_bufs(batches, slots);
        let (vouched, answers) = tokio::join!(
            self.vouched(r, keys, &asked),
            self.fan_out(r, &mut batches, |l, ns, b| {
                let sub = pick(keys, &b.idx);
                let (stamp, bufs) = (b.stamp, &mut b.tag);
                async move {
                    l.get_many(cfg, stamp, ns, &sub, bufs, false, lease_ms)
                        .await
                }
            })
        );
        for (b, res) in batches.into_iter().zip(answers) {
            let (_, idx) = give_back(b, slots);
            if let Ok(got) = res {
                for (&i, g) in idx.iter().zip(got) {
                    // A copy the owners did not vouch for is a miss (its bytes in the buffer
                    // are not reported).
                    out[i] = out[i].or(g.filter(|_| vouched[i]));
                }
            }
        }
    }

    /// A keys operation answered with a count, on the first `r` owners of each key; the count
    /// is the primary owners'.
    pub(super) async fn keys_op(
        &self,
        keys: &[&[u8]],
        r_count: usize,
        make: impl Fn(u32, Vec<Vec<u8>>) -> Op,
    ) -> Result<u64, ClientError> {
        let cfg = &self.cfg;
        let make = &make;
        routed!(self, r => {
            // Batches tagged with whether they go to the keys' primary owner.
            let (mut batches, cut) = (Vec::new(), self.cut());
            for (i, k) in keys.iter().enumerate() {
                for (rank, o) in r.view.owners(k, r_count).into_iter().enumerate() {
                    add_key(&mut batches, (o.0, r.stamp, rank == 0), i, cut);
                }
            }
            let answers = self
                .fan_out(&r, &mut batches, |l, ns, b| {
                    let sub = owned(&pick(keys, &b.idx));
                    async move { l.count(cfg, b.stamp, make(ns, sub)).await }
                })
                .await;
            let mut total = 0;
            for (b, res) in batches.iter().zip(answers) {
                if let (Some(n), true) = (self.reached(b.node, res)?, b.tag) {
                    total += n;
                }
            }
            Ok(total)
        })
    }
}

/// The batches, each with the destination buffers of its keys taken out of `slots`.
fn take_bufs<'a, 'b>(
    batches: Vec<Batch>,
    slots: &mut Slots<'a, 'b>,
) -> Vec<Batch<Vec<Dst<'a, 'b>>>> {
    batches
        .into_iter()
        .map(|b| Batch {
            tag: b
                .idx
                .iter()
                .map(|&i| slots[i].take().expect("each key once"))
                .collect(),
            node: b.node,
            stamp: b.stamp,
            idx: b.idx,
            bytes: b.bytes,
        })
        .collect()
}

/// Puts a batch's buffers back into `slots`; returns its node and key indexes.
fn give_back<'a, 'b>(b: Batch<Vec<Dst<'a, 'b>>>, slots: &mut Slots<'a, 'b>) -> (u32, Vec<usize>) {
    for (&i, buf) in b.idx.iter().zip(b.tag) {
        slots[i] = Some(buf);
    }
    (b.node, b.idx)
}
