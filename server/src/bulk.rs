//! The bulk class: large transfers take turns for the node's bulk workers, so a
//! small request never waits behind more than one chunk of them.
//!
//! A request whose payload (in either direction) is at least `[limits] bulk_threshold` is
//! *bulk*. Before moving each [`BULK_CHUNK`](crate::handler::BULK_CHUNK) of it, its connection
//! asks this scheduler for a *grant*; at most `bulk_workers` grants are out at once (by default
//! one fewer than the node's cores, so one worker is always free for small requests), and a
//! grant lapses after `hold` even if its chunk has not finished moving (a peer that reads
//! slowly must not hold up everyone else's bulk). Small requests never ask: they run as soon
//! as a worker polls them.
//!
//! The worker kept free is kept only for small requests that come: while the node has served
//! none for [`QUIET`], *spare* grants (by default one, for that worker) go out too, so bulk
//! alone uses every core. Each spare grant covers one chunk, like any grant, and the first
//! small request served ends them for the chunks after: a small request that arrives after a
//! quiet spell waits behind at most one chunk per worker, the bound the class keeps anyway.
//!
//! Waiting chunks are served in start-time fair queueing order across *flows* — one flow per
//! namespace and priority (and one for the cluster's own moves) — each flow's share in
//! proportion to its priority's weight ([`Priority::weight`]): two namespaces moving bulk at
//! the same priority get the same bytes per second whatever their number of connections, and
//! nothing starves. Token buckets cap bulk bytes per second for the whole node
//! (`--bulk-rate`) and per namespace (`[[namespace]] bulk_rate`); a flow over its namespace's
//! rate steps aside for the others instead of blocking them.
//!
//! A request with a deadline is first *admitted*: the scheduler estimates when its last byte
//! would move — the bytes ahead of it that fair queueing would serve first, at the bulk rate
//! measured while chunks queued (and at most the configured rates) — and refuses it at once
//! when that is after its deadline, before any byte moves.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kvpool::protocol::Priority;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

/// The namespace id the cluster's own traffic (moves, re-replication) is accounted under.
pub(crate) const CLUSTER_NS: u32 = u32::MAX;

/// Bytes per second assumed for deadline estimates until the node has measured its own.
const ASSUMED_RATE: f64 = (1u64 << 30) as f64;

/// A bucket holds this many seconds of its rate (and at least one chunk).
const BURST_SECS: f64 = 0.1;

/// Spare grants go out while the node has served no small request for this long.
pub(crate) const QUIET: Duration = Duration::from_millis(50);

/// How bulk transfers are scheduled (`[limits]` and `[[namespace]]` settings).
#[derive(Clone, Debug)]
pub(crate) struct BulkConfig {
    /// Most chunks moving at once while small requests are being served.
    pub(crate) workers: usize,
    /// More chunks that may move at once while none has been for [`BulkConfig::quiet`] (the
    /// workers `workers` leaves to small requests).
    pub(crate) spare: usize,
    /// See `spare`.
    pub(crate) quiet: Duration,
    /// Cap on bulk bytes per second for the whole node; `None`: none.
    pub(crate) rate: Option<u64>,
    /// Per namespace id, its cap on bulk bytes per second.
    pub(crate) ns_rates: Vec<Option<u64>>,
    /// A request whose payload is at least this many bytes is bulk.
    pub(crate) threshold: u64,
    /// Longest a grant is held for one chunk.
    pub(crate) hold: Duration,
    /// Bytes one grant covers (the largest chunk), for bucket bursts.
    pub(crate) chunk: u64,
}

impl Default for BulkConfig {
    /// The defaults of `[limits]` on a 2-core node.
    fn default() -> Self {
        BulkConfig {
            workers: 1,
            spare: 1,
            quiet: QUIET,
            rate: None,
            ns_rates: Vec::new(),
            threshold: 256 << 10,
            hold: Duration::from_millis(2),
            chunk: 1 << 20,
        }
    }
}

/// Why a request was refused at admission.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Unmeetable {
    /// When the scheduler expects the request's last byte to move, from now.
    pub(crate) estimate: Duration,
    /// What the request allowed.
    pub(crate) budget: Duration,
}

/// The node's bulk scheduler.
pub(crate) struct Bulk {
    cfg: BulkConfig,
    st: Mutex<State>,
    /// What [`Bulk::last_small`] counts from.
    epoch: std::time::Instant,
    /// Microseconds from `epoch` to when a small request was last served, plus one; 0: never.
    last_small: AtomicU64,
    /// Told when a rate cap holds every waiting chunk back (`State::retry_at` set), so that
    /// some waiter sleeps until then and looks again.
    retry: Notify,
}

/// One flow: a namespace at one priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct FlowKey {
    ns: u32,
    priority: Priority,
}

#[derive(Debug, Default)]
struct Flow {
    /// Virtual finish time of the flow's last queued chunk.
    finish: u64,
    /// Bytes its admitted requests have still to move.
    remaining: u64,
}

struct Waiter {
    flow: FlowKey,
    bytes: u64,
    /// Told its grant: whether it is a spare one.
    tx: oneshot::Sender<bool>,
}

/// A token bucket of bytes. A chunk is never cut to fit: one larger than the burst waits for a
/// full bucket and leaves it in debt, which the next grants wait out.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    burst: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: u64, chunk: u64, now: Instant) -> Bucket {
        let burst = (rate as f64 * BURST_SECS).max(chunk as f64);
        Bucket {
            rate: rate.max(1) as f64,
            burst,
            level: burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.rate).min(self.burst);
        self.at = now;
    }

    /// When `bytes` may be taken (a grant larger than the burst needs only a full bucket and
    /// leaves it in debt): `None` now.
    fn wait_for(&self, bytes: u64, now: Instant) -> Option<Instant> {
        let need = (bytes as f64).min(self.burst);
        (self.level < need).then(|| now + Duration::from_secs_f64((need - self.level) / self.rate))
    }
}

struct State {
    /// Grants that may still be handed out.
    free: usize,
    /// Spare grants out.
    spare_out: usize,
    /// Virtual time: the start tag of the last chunk granted.
    vtime: u64,
    seq: u64,
    flows: HashMap<FlowKey, Flow>,
    /// Waiting chunks by (start tag, arrival).
    waiting: BTreeMap<(u64, u64), Waiter>,
    node: Option<Bucket>,
    ns: HashMap<u32, Bucket>,
    /// Measured bulk bytes per second (an average over chained grants).
    rate: f64,
    /// The last grant handed out when a grant was returned: (when, bytes).
    last: Option<(Instant, u64)>,
    /// When waiters held back by a rate cap should look again.
    retry_at: Option<Instant>,
}

impl State {
    fn new(cfg: &BulkConfig, now: Instant) -> State {
        let ns = cfg
            .ns_rates
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|r| (i as u32, Bucket::new(r, cfg.chunk, now))))
            .collect();
        State {
            free: cfg.workers.max(1),
            spare_out: 0,
            vtime: 0,
            seq: 0,
            flows: HashMap::new(),
            waiting: BTreeMap::new(),
            node: cfg.rate.map(|r| Bucket::new(r, cfg.chunk, now)),
            ns,
            rate: cfg.rate.map_or(ASSUMED_RATE, |r| r as f64),
            last: None,
            retry_at: None,
        }
    }

    /// Queues a chunk of `bytes` of `flow`; returns its place.
    fn enqueue(&mut self, flow: FlowKey, bytes: u64, tx: oneshot::Sender<bool>) -> (u64, u64) {
        let vtime = self.vtime;
        let f = self.flows.entry(flow).or_default();
        let start = f.finish.max(vtime);
        // Virtual cost: bytes over weight (weights 1..8 divide 8).
        f.finish = start.saturating_add(bytes.saturating_mul(8) / flow.priority.weight());
        self.seq += 1;
        let key = (start, self.seq);
        self.waiting.insert(key, Waiter { flow, bytes, tx });
        key
    }

    /// Hands out grants while some are free (or fewer than `spare_cap` spare ones are out) and
    /// a waiting chunk may go; `chained`: a grant was just returned (so the gap since the
    /// previous grant measures the bulk rate).
    fn dispatch(&mut self, now: Instant, mut chained: bool, spare_cap: usize) {
        self.retry_at = None;
        if let Some(b) = &mut self.node {
            b.refill(now);
        }
        for b in self.ns.values_mut() {
            b.refill(now);
        }
        while (self.free > 0 || self.spare_out < spare_cap) && !self.waiting.is_empty() {
            // The first waiter in fair-queueing order whose namespace is within its rate.
            let mut wake: Option<Instant> = None;
            let mut soonest = |at: Instant| wake = Some(wake.map_or(at, |x: Instant| x.min(at)));
            let pick = self.waiting.iter().find_map(|(k, w)| {
                match self
                    .ns
                    .get(&w.flow.ns)
                    .and_then(|b| b.wait_for(w.bytes, now))
                {
                    Some(at) => {
                        soonest(at);
                        None
                    }
                    None => Some((*k, w.bytes)),
                }
            });
            let Some((key, bytes)) = pick else {
                self.retry_at = wake;
                return;
            };
            if let Some(at) = self.node.as_ref().and_then(|b| b.wait_for(bytes, now)) {
                self.retry_at = Some(at);
                return;
            }
            let Some(w) = self.waiting.remove(&key) else {
                return;
            };
            self.vtime = self.vtime.max(key.0);
            if let Some(f) = self.flows.get_mut(&w.flow) {
                f.remaining = f.remaining.saturating_sub(w.bytes);
            }
            for b in self.node.iter_mut().chain(self.ns.get_mut(&w.flow.ns)) {
                b.level -= w.bytes as f64;
            }
            if chained {
                if let Some((at, bytes)) = self.last {
                    let dt = now.saturating_duration_since(at).as_secs_f64();
                    if dt > 0.0 {
                        self.rate = 0.8 * self.rate + 0.2 * (bytes as f64 / dt);
                    }
                }
                chained = false;
            }
            self.last = Some((now, w.bytes));
            let spare = self.free == 0;
            self.take(spare);
            if w.tx.send(spare).is_err() {
                // Its waiter is gone (it removes itself under this lock, so this is only a
                // guard): the grant goes to the next.
                self.give_back(spare);
            }
        }
    }

    /// Takes a grant: a spare one or one of the workers'.
    fn take(&mut self, spare: bool) {
        match spare {
            true => self.spare_out += 1,
            false => self.free -= 1,
        }
    }

    /// Returns a grant [`State::take`] took.
    fn give_back(&mut self, spare: bool) {
        match spare {
            true => self.spare_out = self.spare_out.saturating_sub(1),
            false => self.free += 1,
        }
    }

    /// The time until `bytes` more of `flow` (behind what the flow has admitted already) would
    /// have moved: fair queueing serves every other flow at most its weight's share meanwhile.
    fn estimate(&self, flow: FlowKey, bytes: u64, cfg: &BulkConfig) -> Duration {
        let mine = self
            .flows
            .get(&flow)
            .map_or(0, |f| f.remaining)
            .saturating_add(bytes);
        let w = flow.priority.weight();
        let others: u64 = self
            .flows
            .iter()
            .filter(|(k, _)| **k != flow)
            .map(|(k, f)| {
                f.remaining
                    .min(mine.saturating_mul(k.priority.weight()) / w)
            })
            .sum();
        let mut rate = self.rate;
        if let Some(r) = cfg.rate {
            rate = rate.min(r as f64);
        }
        let mut secs = mine.saturating_add(others) as f64 / rate.max(1.0);
        if let Some(Some(r)) = cfg.ns_rates.get(flow.ns as usize) {
            secs = secs.max(mine as f64 / (*r).max(1) as f64);
        }
        Duration::from_secs_f64(secs.min(1e9))
    }
}

impl Bulk {
    pub(crate) fn new(cfg: BulkConfig) -> Bulk {
        let st = State::new(&cfg, Instant::now());
        Bulk {
            cfg,
            st: Mutex::new(st),
            epoch: std::time::Instant::now(),
            last_small: AtomicU64::new(0),
            retry: Notify::new(),
        }
    }

    /// Is a payload of `bytes` bulk?
    pub(crate) fn is_bulk(&self, bytes: u64) -> bool {
        bytes >= self.cfg.threshold
    }

    /// Longest a grant is held for one chunk.
    pub(crate) fn hold(&self) -> Duration {
        self.cfg.hold
    }

    fn micros(&self) -> u64 {
        (self.epoch.elapsed().as_micros() as u64).saturating_add(1)
    }

    /// A request that moved no bulk payload was served: spare grants stop for [`QUIET`].
    pub(crate) fn served_small(&self) {
        if self.cfg.spare == 0 {
            return;
        }
        let now = self.micros();
        // Stored at most every 1/16 of the window, so busy connections don't all write the
        // same cache line per request.
        let step = (self.cfg.quiet.as_micros() as u64 / 16).max(1);
        let last = self.last_small.load(Relaxed);
        if last == 0 || now >= last.saturating_add(step) {
            self.last_small.store(now, Relaxed);
        }
    }

    /// Spare grants that may be out now.
    fn spare_cap(&self) -> usize {
        let last = self.last_small.load(Relaxed);
        let quiet =
            last == 0 || self.micros().saturating_sub(last) >= self.cfg.quiet.as_micros() as u64;
        match quiet {
            true => self.cfg.spare,
            false => 0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a bulk request of `bytes` for namespace `ns` at `priority`, which must be done
    /// within `budget` (`None`: no deadline); refused when the estimate is over the budget.
    pub(crate) fn admit(
        &self,
        ns: u32,
        priority: Priority,
        bytes: u64,
        budget: Option<Duration>,
    ) -> Result<Ticket<'_>, Unmeetable> {
        let flow = FlowKey { ns, priority };
        let mut st = self.lock();
        if let Some(budget) = budget {
            let estimate = st.estimate(flow, bytes, &self.cfg);
            if estimate > budget {
                return Err(Unmeetable { estimate, budget });
            }
        }
        let f = st.flows.entry(flow).or_default();
        f.remaining = f.remaining.saturating_add(bytes);
        Ok(Ticket {
            bulk: self,
            flow,
            remaining: bytes,
        })
    }

    /// Returns one grant and hands out the next.
    fn release(&self, spare: bool) {
        let mut st = self.lock();
        st.give_back(spare);
        self.dispatch(&mut st, true);
    }

    /// [`State::dispatch`] now; wakes the waiters to set their timers when a rate cap holds
    /// the queue back.
    fn dispatch(&self, st: &mut State, chained: bool) {
        st.dispatch(Instant::now(), chained, self.spare_cap());
        if st.retry_at.is_some() {
            self.retry.notify_waiters();
        }
    }
}

/// An admitted bulk request: what it has left to move, and its place among the flows.
pub(crate) struct Ticket<'a> {
    bulk: &'a Bulk,
    flow: FlowKey,
    remaining: u64,
}

impl<'a> Ticket<'a> {
    /// Waits for the turn of its next chunk of `bytes`; the grant is returned when dropped.
    /// Cancel-safe: a waiter dropped while waiting leaves the queue (or returns a grant it was
    /// just handed).
    pub(crate) async fn chunk(&mut self, bytes: u64) -> Grant<'a> {
        let bulk = self.bulk;
        let (tx, mut rx) = oneshot::channel();
        let key = {
            let mut st = bulk.lock();
            let key = st.enqueue(self.flow, bytes, tx);
            bulk.dispatch(&mut st, false);
            key
        };
        // Granted at once (a grant was free and no one was ahead): no timers to set.
        if let Ok(spare) = rx.try_recv() {
            self.remaining = self.remaining.saturating_sub(bytes);
            return Grant {
                bulk,
                spare: Some(spare),
            };
        }
        let mut waiting = Waiting {
            bulk,
            key,
            rx,
            done: false,
        };
        let spare = loop {
            // Registered before the state is read, so a retry time set after the read wakes it.
            let told = bulk.retry.notified();
            tokio::pin!(told);
            told.as_mut().enable();
            let retry = bulk.lock().retry_at;
            let far = Instant::now() + Duration::from_secs(3600);
            tokio::select! {
                biased;
                r = &mut waiting.rx => match r {
                    Ok(spare) => break Some(spare),
                    // Its sender goes only with the waiter's entry, which only a grant (which
                    // sends first) or this waiter removes: not reached. Were it, the chunk
                    // moves on a grant that was never counted out, so it returns none.
                    Err(_) => break None,
                },
                () = tokio::time::sleep_until(retry.unwrap_or(far)) => {
                    let mut st = bulk.lock();
                    bulk.dispatch(&mut st, false);
                }
                () = &mut told => {}
            }
        };
        waiting.done = true;
        self.remaining = self.remaining.saturating_sub(bytes);
        Grant { bulk, spare }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.remaining == 0 {
            return;
        }
        let mut st = self.bulk.lock();
        if let Some(f) = st.flows.get_mut(&self.flow) {
            f.remaining = f.remaining.saturating_sub(self.remaining);
        }
    }
}

/// A chunk in the queue; leaves it when dropped before its turn came.
struct Waiting<'a> {
    bulk: &'a Bulk,
    key: (u64, u64),
    /// Where its grant comes.
    rx: oneshot::Receiver<bool>,
    done: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.bulk.lock();
        if st.waiting.remove(&self.key).is_none() {
            // Granted while its waiter was being dropped (granted under this lock, so the
            // grant is in the channel): hand it on.
            if let Ok(spare) = self.rx.try_recv() {
                st.give_back(spare);
            }
            self.bulk.dispatch(&mut st, false);
        }
    }
}

/// The right to move one chunk now; returned when dropped.
pub(crate) struct Grant<'a> {
    bulk: &'a Bulk,
    /// Whether it is a spare grant; `None`: one that was never counted out.
    spare: Option<bool>,
}

impl Drop for Grant<'_> {
    fn drop(&mut self) {
        if let Some(spare) = self.spare {
            self.bulk.release(spare);
        }
    }
}

/// Runs `io` (one chunk's transfer) under `grant`, returning the grant when `io` finishes or
/// after `hold`, whichever is first (a peer that reads or sends slowly must not hold everyone
/// else's bulk up).
pub(crate) async fn under<T>(grant: Grant<'_>, hold: Duration, io: impl Future<Output = T>) -> T {
    tokio::pin!(io);
    tokio::select! {
        biased;
        r = &mut io => r,
        () = tokio::time::sleep(hold) => {
            drop(grant);
            io.await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(workers: usize) -> BulkConfig {
        BulkConfig {
            workers,
            spare: 0,
            quiet: QUIET,
            rate: None,
            ns_rates: vec![None, None],
            threshold: 256 << 10,
            hold: Duration::from_millis(5),
            chunk: 1 << 20,
        }
    }

    const MIB: u64 = 1 << 20;

    /// Drives `st` by hand: every flow keeps `depth` chunks queued; each round returns the
    /// oldest grant and refills. Returns the grants per flow.
    fn run(st: &mut State, flows: &[(FlowKey, usize)], rounds: usize) -> HashMap<FlowKey, u64> {
        let t0 = Instant::now();
        let mut rxs: Vec<(FlowKey, oneshot::Receiver<bool>)> = Vec::new();
        let mut granted: HashMap<FlowKey, u64> = HashMap::new();
        for &(f, depth) in flows {
            for _ in 0..depth {
                let (tx, rx) = oneshot::channel();
                st.enqueue(f, MIB, tx);
                rxs.push((f, rx));
            }
        }
        st.dispatch(t0, false, 0);
        for round in 0..rounds {
            // Whatever was granted: count it, return its grant, queue its flow's next chunk.
            let mut next = Vec::new();
            for (f, mut rx) in rxs.drain(..) {
                if rx.try_recv().is_ok() {
                    *granted.entry(f).or_default() += 1;
                    st.free += 1;
                    let (tx, rx) = oneshot::channel();
                    st.enqueue(f, MIB, tx);
                    next.push((f, rx));
                } else {
                    next.push((f, rx));
                }
            }
            rxs = next;
            st.dispatch(t0 + Duration::from_millis(round as u64), true, 0);
        }
        granted
    }

    fn flow(ns: u32, priority: Priority) -> FlowKey {
        FlowKey { ns, priority }
    }

    #[test]
    fn two_namespaces_share_equally_whatever_their_connections() {
        let c = cfg(1);
        let mut st = State::new(&c, Instant::now());
        let (a, b) = (flow(0, Priority::Normal), flow(1, Priority::Normal));
        let g = run(&mut st, &[(a, 4), (b, 1)], 1000);
        let (ga, gb) = (g[&a], g[&b]);
        assert!(ga + gb >= 999, "{ga} + {gb}");
        assert!(ga.abs_diff(gb) <= 2, "a {ga}, b {gb}");
    }

    #[test]
    fn shares_follow_priority_weights_and_background_is_not_starved() {
        let c = cfg(1);
        let mut st = State::new(&c, Instant::now());
        let (h, n, bg) = (
            flow(0, Priority::High),
            flow(1, Priority::Normal),
            flow(CLUSTER_NS, Priority::Background),
        );
        let g = run(&mut st, &[(h, 2), (n, 2), (bg, 2)], 1300);
        // Weights 8 : 4 : 1 of 1300 grants: 800, 400, 100.
        assert!(g[&h].abs_diff(800) <= 4, "{g:?}");
        assert!(g[&n].abs_diff(400) <= 4, "{g:?}");
        assert!(g[&bg].abs_diff(100) <= 4, "{g:?}");
    }

    #[test]
    fn grants_never_exceed_the_workers() {
        let c = cfg(3);
        let mut st = State::new(&c, Instant::now());
        let now = Instant::now();
        let mut rxs = Vec::new();
        for i in 0..10 {
            let (tx, rx) = oneshot::channel();
            st.enqueue(flow(i % 2, Priority::Normal), MIB, tx);
            rxs.push(rx);
        }
        st.dispatch(now, false, 0);
        let granted = rxs
            .iter_mut()
            .map(|r| r.try_recv().is_ok() as usize)
            .sum::<usize>();
        assert_eq!((granted, st.free, st.waiting.len()), (3, 0, 7));
    }

    #[test]
    fn a_namespace_over_its_rate_steps_aside_for_the_others() {
        let mut c = cfg(1);
        c.ns_rates = vec![Some(MIB), None];
        let t0 = Instant::now();
        let mut st = State::new(&c, t0);
        let (slow, fast) = (flow(0, Priority::Normal), flow(1, Priority::Normal));
        let mut rxs = Vec::new();
        for f in [slow, slow, fast, fast] {
            let (tx, rx) = oneshot::channel();
            st.enqueue(f, MIB, tx);
            rxs.push(rx);
        }
        // The slow namespace's bucket holds one chunk: its first goes, then it owes a chunk.
        st.dispatch(t0, false, 0);
        assert!(rxs[0].try_recv().is_ok());
        st.free += 1;
        st.dispatch(t0, true, 0);
        // Its second chunk is held back; the other namespace's go meanwhile.
        assert!(rxs[1].try_recv().is_err() && rxs[2].try_recv().is_ok());
        st.free += 1;
        st.dispatch(t0, true, 0);
        assert!(rxs[1].try_recv().is_err() && rxs[3].try_recv().is_ok());
        st.free += 1;
        st.dispatch(t0, true, 0);
        let retry = st
            .retry_at
            .expect("a retry time while a rate holds a chunk back");
        assert!(retry > t0 + Duration::from_millis(900), "{retry:?}");
        st.dispatch(t0 + Duration::from_millis(1001), false, 0);
        assert!(rxs[1].try_recv().is_ok());
    }

    #[test]
    fn the_node_rate_paces_every_grant() {
        let mut c = cfg(4);
        c.rate = Some(10 * MIB);
        let t0 = Instant::now();
        let mut st = State::new(&c, t0);
        let mut rxs = Vec::new();
        for _ in 0..4 {
            let (tx, rx) = oneshot::channel();
            st.enqueue(flow(0, Priority::Normal), MIB, tx);
            rxs.push(rx);
        }
        // A burst of 0.1 s at 10 MiB/s is one chunk; the next must wait 0.1 s per chunk.
        st.dispatch(t0, false, 0);
        let first = rxs
            .iter_mut()
            .map(|r| r.try_recv().is_ok() as usize)
            .sum::<usize>();
        assert_eq!(first, 1);
        st.dispatch(t0 + Duration::from_millis(50), false, 0);
        assert_eq!(
            rxs.iter_mut()
                .map(|r| r.try_recv().is_ok() as usize)
                .sum::<usize>(),
            0
        );
        st.dispatch(t0 + Duration::from_millis(101), false, 0);
        assert_eq!(
            rxs.iter_mut()
                .map(|r| r.try_recv().is_ok() as usize)
                .sum::<usize>(),
            1
        );
    }

    #[test]
    fn admission_refuses_what_cannot_finish_in_time() {
        let mut c = cfg(1);
        c.rate = Some(100 * MIB);
        let bulk = Bulk::new(c);
        // 100 MiB at 100 MiB/s: about a second.
        let ahead = bulk
            .admit(0, Priority::Normal, 100 * MIB, None)
            .expect("no deadline");
        let r = bulk.admit(1, Priority::Normal, MIB, Some(Duration::from_millis(5)));
        // Fair queueing serves the other flow only as much as this one meanwhile: 2 MiB.
        let e = r.err().expect("2 MiB at 100 MiB/s takes 20 ms");
        assert!(
            e.estimate >= Duration::from_millis(19) && e.estimate <= Duration::from_millis(21),
            "{e:?}"
        );
        assert!(bulk
            .admit(1, Priority::Normal, MIB, Some(Duration::from_millis(30)))
            .is_ok());
        // A high-priority request is served 8 : 4 ahead of the normal one.
        let e = bulk
            .admit(2, Priority::High, 8 * MIB, Some(Duration::from_millis(1)))
            .err()
            .expect("refused");
        assert!(
            e.estimate >= Duration::from_millis(115) && e.estimate <= Duration::from_millis(125),
            "{e:?}"
        );
        drop(ahead);
        assert!(bulk
            .admit(1, Priority::Normal, MIB, Some(Duration::from_millis(15)))
            .is_ok());
    }

    /// Counts the grants out: (workers', spare).
    fn out(bulk: &Bulk) -> (usize, usize) {
        let st = bulk.lock();
        (bulk.cfg.workers - st.free, st.spare_out)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_kept_worker_moves_bulk_only_while_no_small_request_is_served() {
        let mut c = cfg(1);
        (c.spare, c.quiet) = (1, Duration::from_secs(30));
        let bulk = Bulk::new(c);
        let mut t = [0, 1, 2].map(|ns| bulk.admit(ns, Priority::Normal, 8 * MIB, None).unwrap());
        // No small request yet: the worker's grant, then the spare one, then none.
        let g1 = t[0].chunk(MIB).await;
        let g2 = t[1].chunk(MIB).await;
        assert_eq!(
            (g1.spare, g2.spare, out(&bulk)),
            (Some(false), Some(true), (1, 1))
        );
        let third = tokio::time::timeout(Duration::from_millis(20), t[2].chunk(MIB)).await;
        assert!(
            third.is_err(),
            "a third chunk moved with one worker and one spare"
        );
        // A small request is served: the spare grant out finishes its chunk, and no other
        // goes out while the window lasts; the worker's grant still does.
        bulk.served_small();
        drop(g2);
        assert_eq!(out(&bulk), (1, 0));
        let third = tokio::time::timeout(Duration::from_millis(20), t[2].chunk(MIB)).await;
        assert!(
            third.is_err(),
            "a spare grant went out right after a small request"
        );
        drop(g1);
        let g3 = t[2].chunk(MIB).await;
        assert_eq!((g3.spare, out(&bulk)), (Some(false), (1, 0)));
        drop(g3);
        assert_eq!(out(&bulk), (0, 0));
        drop(t);
        assert!(bulk.lock().flows.values().all(|f| f.remaining == 0));

        // Once the window has passed with no small request, spare grants go out again.
        let mut c = cfg(1);
        (c.spare, c.quiet) = (1, Duration::from_millis(30));
        let bulk = Bulk::new(c);
        bulk.served_small();
        let mut t = [0, 1].map(|ns| bulk.admit(ns, Priority::Normal, 8 * MIB, None).unwrap());
        let g1 = t[0].chunk(MIB).await;
        tokio::time::sleep(Duration::from_millis(60)).await;
        let g2 = t[1].chunk(MIB).await;
        assert_eq!(
            (g1.spare, g2.spare, out(&bulk)),
            (Some(false), Some(true), (1, 1))
        );
        // A waiter granted a spare grant while it was being dropped hands it back.
        drop(g2);
        let pending = t[1].chunk(MIB);
        drop(pending);
        drop(g1);
        assert_eq!(out(&bulk), (0, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_dropped_in_the_queue_or_at_its_grant_leaks_nothing() {
        let bulk = Bulk::new(cfg(1));
        let mut t1 = bulk.admit(0, Priority::Normal, 4 * MIB, None).unwrap();
        let mut t2 = bulk.admit(1, Priority::Normal, 4 * MIB, None).unwrap();
        let g1 = t1.chunk(MIB).await;
        // The second waits behind the first grant; dropping it leaves the queue.
        let wait = tokio::time::timeout(Duration::from_millis(20), t2.chunk(MIB)).await;
        assert!(wait.is_err());
        assert!(bulk.lock().waiting.is_empty());
        drop(g1);
        assert_eq!(bulk.lock().free, 1);
        // Granted while dropped: the grant comes back.
        let g = t2.chunk(MIB).await;
        let pending = t1.chunk(MIB);
        drop(g);
        drop(pending);
        let st = bulk.lock();
        assert_eq!((st.free, st.waiting.len()), (1, 0));
        drop(st);
        drop((t1, t2));
        assert!(bulk.lock().flows.values().all(|f| f.remaining == 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_held_back_by_the_rate_when_a_grant_returns_still_gets_its_turn() {
        let mut c = cfg(1);
        c.rate = Some(4 * MIB);
        let bulk = Bulk::new(c);
        let mut t1 = bulk.admit(0, Priority::Normal, MIB, None).unwrap();
        let mut t2 = bulk.admit(1, Priority::Normal, MIB, None).unwrap();
        // The first chunk empties the bucket (its burst is one chunk); the second queues for
        // the grant, and when the grant comes back the rate holds it back a quarter second:
        // nobody's timer was set for that until the release told the waiters.
        let g = t1.chunk(MIB).await;
        let second = async {
            let _g = t2.chunk(MIB).await;
        };
        let release = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(g);
        };
        let both = async { tokio::join!(second, release) };
        tokio::time::timeout(Duration::from_secs(10), both)
            .await
            .expect("the second chunk got its turn once the bucket refilled");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_lapses_after_its_hold() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let bulk = Bulk::new(cfg(1));
        let done = AtomicBool::new(false);
        let mut t = bulk.admit(0, Priority::Normal, 2 * MIB, None).unwrap();
        let g = t.chunk(MIB).await;
        // A chunk that takes far longer than the hold (5 ms): a peer reading slowly.
        let slow = under(g, Duration::from_millis(5), async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            done.store(true, Ordering::SeqCst);
        });
        let mut t2 = bulk.admit(1, Priority::Normal, MIB, None).unwrap();
        let other = async {
            let _g = t2.chunk(MIB).await;
            done.load(Ordering::SeqCst)
        };
        let ((), slow_was_done) = tokio::join!(slow, other);
        assert!(
            !slow_was_done,
            "the next chunk waited for the slow one to finish"
        );
    }
}
