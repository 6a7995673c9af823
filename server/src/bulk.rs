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
mod tests;
