//! The demotion queue and the one thread that writes it to the store: demotions oldest first,
//! tombstones ahead of them, and a demotion of a key forgotten meanwhile never indexed.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;

use kvpool::disk::{Insert, Object};

use super::DiskTier;

/// An evicted object on its way to disk: a copy, since its block is freed once the pool has
/// handed its bytes over.
pub(super) struct Demotion {
    pub(super) ns: u32,
    pub(super) key: Box<[u8]>,
    /// Empty until the pool hands the bytes over ([`Queue::fill`]).
    pub(super) value: Vec<u8>,
    /// The value's length.
    pub(super) len: u64,
    pub(super) checksum: u64,
    pub(super) generation: u64,
    /// Which demotion of its key this is ([`Queue::push`] numbers them).
    pub(super) ticket: u64,
}

/// What the writer does next.
pub(super) enum Job {
    Demote(Demotion),
    /// Keeps a forgotten key's older records from coming back at a restart.
    Tombstone {
        ns: u32,
        key: Box<[u8]>,
    },
}

/// Per key of one namespace, two numbers: the ticket and the value's checksum of its latest
/// demotion ([`Queue::pending`]), or the generations of an object brought up ([`Queue::promoted`]).
pub(super) type Pending = HashMap<Box<[u8]>, (u64, u64)>;

#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: VecDeque<Job>,
    /// Per namespace and key, the ticket and checksum of the latest demotion queued or being
    /// written: an older one of the key is skipped, and one whose entry is gone (forgotten)
    /// is not indexed.
    pub(super) pending: HashMap<u32, Pending>,
    /// Per namespace and key, DRAM's object brought up from disk: its generation in DRAM and
    /// the generation of the disk copy it came from (the object's own).
    pub(super) promoted: HashMap<u32, Pending>,
    /// Demotions reserved while their object was evicted, waiting for its bytes.
    pub(super) reserved: HashMap<u64, Demotion>,
    /// Buffers demotions' values were copied into, written and kept for the next ones, so that
    /// demotion does not make the heap grow and shrink by a value per eviction (at most the
    /// queue's bound of them, by capacity).
    pub(super) spare: Vec<Vec<u8>>,
    /// Per namespace, value bytes of its demotions reserved, queued or being written.
    pub(super) ns_queued: HashMap<u32, u64>,
    next_ticket: u64,
    /// No more demotions are taken; the writer exits once the queue is empty.
    pub(super) closed: bool,
}

impl Queue {
    /// Reserves a demotion of `d`'s key (its value not yet copied) as the key's latest: its
    /// ticket, under which [`Queue::fill`] queues it.
    pub(super) fn reserve(&mut self, d: Demotion) -> u64 {
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        self.pending
            .entry(d.ns)
            .or_default()
            .insert(d.key.clone(), (ticket, d.checksum));
        *self.ns_queued.entry(d.ns).or_default() += d.len;
        self.reserved.insert(ticket, Demotion { ticket, ..d });
        ticket
    }

    /// A buffer for a value of `len` bytes: a spare one that can hold it, or a new one.
    pub(super) fn buffer(&mut self, len: usize) -> Vec<u8> {
        match self.spare.iter().position(|b| b.capacity() >= len) {
            Some(i) => self.spare.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps `buf` for a later demotion while the spares stay within `bound` bytes.
    fn keep(&mut self, mut buf: Vec<u8>, bound: u64) {
        let kept: usize = self.spare.iter().map(Vec::capacity).sum();
        if (kept + buf.capacity()) as u64 <= bound {
            buf.clear();
            self.spare.push(buf);
        }
    }

    /// Queues reserved demotion `ticket` with its value (a miss if it was never reserved).
    pub(super) fn fill(&mut self, ticket: u64, value: Vec<u8>) {
        if let Some(mut d) = self.reserved.remove(&ticket) {
            d.value = value;
            self.jobs.push_back(Job::Demote(d));
        }
    }

    /// Cancels the demotion of `(ns, key)` queued or being written, unless its value's xxh3-64
    /// is `keep`; whether there was one.
    pub(super) fn cancel(&mut self, ns: u32, key: &[u8], keep: Option<u64>) -> bool {
        let Some(keys) = self.pending.get_mut(&ns) else {
            return false;
        };
        if keys.get(key).is_none_or(|&(_, sum)| Some(sum) == keep) {
            return false;
        }
        keys.remove(key);
        if keys.is_empty() {
            self.pending.remove(&ns);
        }
        true
    }

    /// Whether demotion `ticket` of `(ns, key)` is still its key's latest, not cancelled.
    fn current(&self, ns: u32, key: &[u8], ticket: u64) -> bool {
        self.pending
            .get(&ns)
            .and_then(|keys| keys.get(key))
            .is_some_and(|&(t, _)| t == ticket)
    }

    /// Ends demotion `ticket` of `(ns, key)` (written, or failed): its key has none pending
    /// unless a later one was queued.
    fn settle(&mut self, ns: u32, key: &[u8], ticket: u64) {
        if self.current(ns, key, ticket) {
            self.cancel(ns, key, None);
        }
    }
}

impl DiskTier {
    /// The writer thread: runs queued jobs, oldest first (tombstones are queued at the front),
    /// until the queue is closed and empty.
    pub(super) fn write_jobs(&self) {
        background_priority();
        loop {
            let job = {
                let mut q = self.lock();
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            match job {
                Job::Tombstone { ns, key } => {
                    self.store.tombstone(ns, &key);
                }
                Job::Demote(d) => {
                    self.write_demotion(&d);
                    let len = d.len;
                    let mut q = self.lock();
                    if let Some(n) = q.ns_queued.get_mut(&d.ns) {
                        *n = n.saturating_sub(len);
                    }
                    q.keep(d.value, self.bound);
                    drop(q);
                    self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
                }
            }
        }
    }

    /// Writes one demotion, unless its key was forgotten or demoted again since it was queued;
    /// indexed only if neither happened while it was written.
    fn write_demotion(&self, d: &Demotion) {
        let c = &self.counters;
        if !self.lock().current(d.ns, &d.key, d.ticket) {
            c.withdrawn.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let object = Object {
            ns: d.ns,
            key: &d.key,
            value: &d.value,
            checksum: d.checksum,
            generation: d.generation,
        };
        // Asked with the index locked: a commit or removal of the key either forgot the
        // demotion before (it is withdrawn) or finds the copy indexed after (and forgets it).
        let still = || {
            let mut q = self.lock();
            let current = q.current(d.ns, &d.key, d.ticket);
            q.settle(d.ns, &d.key, d.ticket);
            current
        };
        match self.store.write(&object, still) {
            Insert::Written => {
                self.publish(d.ns, kvpool::protocol::KvEventKind::Stored, &d.key);
                c.demoted.fetch_add(1, Ordering::Relaxed);
                c.demoted_bytes
                    .fetch_add(d.value.len() as u64, Ordering::Relaxed);
            }
            Insert::Withdrawn => {
                c.withdrawn.fetch_add(1, Ordering::Relaxed);
            }
            Insert::TooLarge | Insert::IoError => {
                self.lock().settle(d.ns, &d.key, d.ticket);
                c.write_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Lowers the calling thread's scheduling priority (nice 10): demotion is background work, and
/// on a node with no core to spare the gets and puts it shares the cores with go first. A
/// refusal leaves the priority as it was.
fn background_priority() {
    // SAFETY: setpriority takes plain integers and changes no memory; on Linux,
    // PRIO_PROCESS with id 0 names the calling thread alone (each thread has its own nice
    // value), and its result is only a status.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
}
