//! One shard of the object index: per namespace, a hash table of committed objects ordered by
//! that namespace's eviction policy, plus the objects removed while still being read
//! ("zombies", freed when their last reader leaves).
//!
//! Objects are named by handles: indexes into a slot vector that holds each object's entry and
//! where its key is. The hash table stores only handles (4 bytes each) and finds keys through
//! the slots, comparing the whole key, so a key is kept once and a hash collision can't return
//! another key's object; freed handles are reused. Keys are packed in size classes ([`Keys`])
//! rather than boxed one by one, and the slots, like the policies' per-handle tables, are a
//! [`Paged`] vector, which never reserves more than a page beyond what it holds: together 72
//! bytes of heap per object with 16-byte keys, where boxed keys in a `Vec` took 80 plus up to
//! as much again in reserve (docs/BENCHMARKS.md has the measured total).

use hashbrown::HashTable;

use super::keys::{KeyRef, Keys};
use crate::eviction::{Eviction, Handle, Insert};
use crate::paged::Paged;
use crate::pool::Millis;

/// What the index knows of one committed object. Kept small: pools hold millions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) generation: u64,
    pub(crate) checksum: u64,
    /// End of the current lease (ms on the pool's clock); eviction skips the object until then.
    pub(crate) lease_until: Millis,
    pub(crate) segment: u16,
    /// Daemon-side readers streaming the bytes right now (zero-copy sends).
    pub(crate) readers: u16,
    pub(crate) pinned: bool,
    /// Read (a get, or a read located for a same-host or one-sided client) since it was
    /// committed; existence and prefix lookups do not count. What a disk tier's `read-once`
    /// admission asks of an evicted object.
    pub(crate) accessed: bool,
}

impl Entry {
    pub(crate) fn evictable(&self, now: Millis) -> bool {
        self.readers == 0 && !self.pinned && self.lease_until <= now
    }
}

/// An object removed from the index while readers still stream it.
#[derive(Debug)]
pub(crate) struct Zombie {
    pub(crate) ns: u32,
    pub(crate) segment: u16,
    pub(crate) offset: u64,
    pub(crate) generation: u64,
    pub(crate) readers: u16,
    pub(crate) pinned: bool,
}

/// One handle's object: its entry and its key (none while the handle is free).
#[derive(Clone, Copy)]
struct Slot {
    entry: Entry,
    key: KeyRef,
}

/// The objects of one namespace in one shard.
pub(crate) struct NsIndex {
    table: HashTable<Handle>,
    slots: Paged<Slot>,
    keys: Keys,
    free: Vec<Handle>,
    policy: Box<dyn Eviction>,
}

/// The shard is picked by the low bits of `xxh3_64(key)`; the table inside must hash with
/// another seed, or all of a shard's keys would share their low bits.
fn table_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, 0x6b76_706f_6f6c)
}

impl NsIndex {
    fn new(policy: Box<dyn Eviction>) -> Self {
        NsIndex {
            table: HashTable::new(),
            slots: Paged::default(),
            keys: Keys::default(),
            free: Vec::new(),
            policy,
        }
    }

    fn find(&self, key: &[u8]) -> Option<Handle> {
        let (slots, keys) = (&self.slots, &self.keys);
        self.table
            .find(table_hash(key), |&h| keys.get(slots[h as usize].key) == key)
            .copied()
    }

    /// The key of handle `h` (empty when the handle is free).
    fn key_of(&self, h: Handle) -> &[u8] {
        self.keys.get(self.slots[h as usize].key)
    }

    pub(crate) fn contains(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    /// The entry of `key`, without counting as an access.
    pub(crate) fn peek(&self, key: &[u8]) -> Option<&Entry> {
        let h = self.find(key)?;
        Some(&self.slots[h as usize].entry)
    }

    /// The entry of `key`, counting as an access (at logical time `stamp`) for the eviction
    /// policy.
    pub(crate) fn get(&mut self, key: &[u8], stamp: u64) -> Option<&mut Entry> {
        let h = self.find(key)?;
        self.policy.access(h, stamp);
        let entry = &mut self.slots[h as usize].entry;
        entry.accessed = true;
        Some(entry)
    }

    /// The logical time the policy ranks its next victim by (None when empty).
    pub(crate) fn next_victim_stamp(&self) -> Option<u64> {
        self.policy.peek_stamp()
    }

    /// The entry of `key`, without telling the policy.
    pub(crate) fn peek_mut(&mut self, key: &[u8]) -> Option<&mut Entry> {
        let h = self.find(key)?;
        Some(&mut self.slots[h as usize].entry)
    }

    /// Inserts or replaces; returns the replaced entry. `depth` is the object's position in its
    /// prefix chain (0 when it is not part of one).
    pub(crate) fn insert(
        &mut self,
        key: &[u8],
        entry: Entry,
        depth: u32,
        stamp: u64,
    ) -> Option<Entry> {
        let info = Insert {
            fingerprint: xxhash_rust::xxh3::xxh3_64(key),
            depth,
            tick: stamp,
        };
        if let Some(h) = self.find(key) {
            // A new object under an old key: new to the policy too.
            self.policy.remove(h);
            self.policy.insert(h, info);
            return Some(std::mem::replace(&mut self.slots[h as usize].entry, entry));
        }
        let hash = table_hash(key);
        let slot = Slot {
            entry,
            key: self.keys.insert(key),
        };
        let h = match self.free.pop() {
            Some(h) => {
                self.slots[h as usize] = slot;
                h
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as Handle
            }
        };
        let (slots, keys) = (&self.slots, &self.keys);
        self.table
            .insert_unique(hash, h, |&x| table_hash(keys.get(slots[x as usize].key)));
        self.policy.insert(h, info);
        None
    }

    /// Removes `key`; returns its entry.
    pub(crate) fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let h = self.find(key)?;
        self.policy.remove(h);
        Some(self.release(h))
    }

    /// Takes out the object the policy picks among those evictable at `now` (`tick`: the
    /// pool's logical time), showing it to `seen` (key and entry) before its key is dropped.
    pub(crate) fn victim(
        &mut self,
        now: Millis,
        tick: u64,
        seen: &mut dyn FnMut(&[u8], &Entry),
    ) -> Option<Entry> {
        let slots = &self.slots;
        let h = self
            .policy
            .victim(&mut |h| slots[h as usize].entry.evictable(now), tick)?;
        Some(self.release_seen(h, seen))
    }

    /// Keys of the pinned objects (freed slots have empty keys, and keys are never empty).
    pub(crate) fn pinned_keys(&self) -> impl Iterator<Item = &[u8]> {
        self.slots
            .iter()
            .filter(|s| s.entry.pinned && !s.key.is_none())
            .map(|s| self.keys.get(s.key))
    }

    /// Visits every unpinned object: its key, entry and worth to the eviction policy (see
    /// [`crate::eviction::Eviction::worth`]).
    pub(crate) fn unpinned(&self, visit: &mut dyn FnMut(&[u8], &Entry, u64)) {
        for (h, s) in self.slots.iter().enumerate() {
            if !s.entry.pinned && !s.key.is_none() {
                visit(
                    self.keys.get(s.key),
                    &s.entry,
                    self.policy.worth(h as Handle),
                );
            }
        }
    }

    /// Visits the keys of slots `from..from + budget` (freed slots have empty keys and are
    /// skipped); returns how many slots it looked at and the slot to continue from, None once
    /// past the last. A slot keeps its
    /// object for the object's whole life, so a walk in slot order sees every object present
    /// throughout it exactly once.
    pub(crate) fn scan(
        &self,
        from: usize,
        budget: usize,
        visit: &mut dyn FnMut(&[u8]),
    ) -> (usize, Option<usize>) {
        let end = from.saturating_add(budget).min(self.slots.len());
        for s in self.slots.range(from, end) {
            if !s.key.is_none() {
                visit(self.keys.get(s.key));
            }
        }
        (
            end.saturating_sub(from),
            (end < self.slots.len()).then_some(end),
        )
    }

    /// [`NsIndex::victim`], unless the policy's next candidate ranks above `bound` (see
    /// [`Eviction::victim_below`]).
    pub(crate) fn victim_below(
        &mut self,
        now: Millis,
        tick: u64,
        bound: u64,
        seen: &mut dyn FnMut(&[u8], &Entry),
    ) -> Option<Entry> {
        let slots = &self.slots;
        let h = self.policy.victim_below(
            &mut |h| slots[h as usize].entry.evictable(now),
            tick,
            bound,
        )?;
        Some(self.release_seen(h, seen))
    }

    /// [`NsIndex::release`] of a victim, shown to `seen` first.
    fn release_seen(&mut self, h: Handle, seen: &mut dyn FnMut(&[u8], &Entry)) -> Entry {
        let slot = &self.slots[h as usize];
        seen(self.keys.get(slot.key), &slot.entry);
        self.release(h)
    }

    /// Drops handle `h` (already gone from the policy) from the table and the slots.
    fn release(&mut self, h: Handle) -> Entry {
        let hash = table_hash(self.key_of(h));
        if let Ok(e) = self.table.find_entry(hash, |&x| x == h) {
            e.remove();
        }
        let slot = &mut self.slots[h as usize];
        self.keys.remove(std::mem::take(&mut slot.key));
        self.free.push(h);
        slot.entry
    }
}

/// One shard: an index per namespace.
pub(crate) struct Shard {
    pub(crate) ns: Vec<NsIndex>,
    pub(crate) zombies: Vec<Zombie>,
}

impl Shard {
    /// A shard with one policy instance per namespace (see [`PolicyKind::build_shards`]).
    ///
    /// [`PolicyKind::build_shards`]: crate::eviction::PolicyKind::build_shards
    pub(crate) fn new(policies: Vec<Box<dyn Eviction>>) -> Self {
        Shard {
            ns: policies.into_iter().map(NsIndex::new).collect(),
            zombies: Vec::new(),
        }
    }

    /// Drops one reader of generation `generation` of `key`; returns the zombie to free when
    /// that was the last reader of a removed object.
    pub(crate) fn release_reader(
        &mut self,
        ns: usize,
        key: &[u8],
        generation: u64,
    ) -> Option<Zombie> {
        if let Some(e) = self.ns[ns].peek_mut(key) {
            if e.generation == generation {
                e.readers = e.readers.saturating_sub(1);
                return None;
            }
        }
        let i = self
            .zombies
            .iter()
            .position(|z| z.generation == generation)?;
        let z = &mut self.zombies[i];
        z.readers = z.readers.saturating_sub(1);
        (z.readers == 0).then(|| self.zombies.swap_remove(i))
    }
}

#[cfg(test)]
#[path = "tests_index.rs"]
mod tests;
