//! The keys of one namespace in one index shard, packed in size classes: a key of `n` bytes
//! takes a cell of `n` rounded up to 8 bytes in its class's pages, and the index names it by a
//! 6-byte [`KeyRef`].
//!
//! A boxed key costs a 16-byte pointer in its slot, its own heap block and malloc's header and
//! rounding (a 16-byte key takes a 32-byte chunk); here it costs its cell and the `KeyRef`.
//! Freed cells go on their class's free list and are reused before a class grows, so a class
//! holds at most as many cells as it ever held keys at once; pages never move, so growing a
//! class copies nothing.

use crate::error::MAX_KEY_LEN;

/// Bytes a class's page holds at most (a page holds a power of two of cells).
const PAGE_BYTES: usize = 64 << 10;

/// Cells grow in steps of this many bytes: one class per step up to [`MAX_KEY_LEN`].
const STEP: usize = 8;

/// Where a key is: its cell in the class its length picks. `len == 0`: no key (keys are never
/// empty).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct KeyRef {
    cell: u32,
    len: u16,
}

impl KeyRef {
    /// True when this names no key.
    pub(crate) fn is_none(self) -> bool {
        self.len == 0
    }
}

/// Cells of one size.
#[derive(Debug)]
struct Class {
    /// Bytes per cell.
    cell: usize,
    /// log2 of the cells per page.
    shift: u32,
    /// Every page but the last holds `1 << shift` cells.
    pages: Vec<Vec<u8>>,
    /// Cells handed out so far (free or not).
    cells: u32,
    free: Vec<u32>,
}

impl Class {
    fn new(cell: usize) -> Self {
        Class {
            cell,
            shift: (PAGE_BYTES / cell).ilog2(),
            pages: Vec::new(),
            cells: 0,
            free: Vec::new(),
        }
    }

    fn bytes(&self, cell: u32) -> &[u8] {
        let (page, at) = self.locate(cell);
        &self.pages[page][at..at + self.cell]
    }

    fn bytes_mut(&mut self, cell: u32) -> &mut [u8] {
        let (page, at) = self.locate(cell);
        let size = self.cell;
        &mut self.pages[page][at..at + size]
    }

    fn locate(&self, cell: u32) -> (usize, usize) {
        let cell = cell as usize;
        (
            cell >> self.shift,
            (cell & ((1 << self.shift) - 1)) * self.cell,
        )
    }

    /// A free cell: a reused one, or a new one at the end of the last page.
    fn take(&mut self) -> u32 {
        if let Some(c) = self.free.pop() {
            return c;
        }
        let per_page = 1usize << self.shift;
        let c = self.cells;
        let full = self
            .pages
            .last()
            .is_none_or(|p| p.len() == per_page * self.cell);
        if full {
            // The first page starts small and doubles, so a namespace with a few keys stays
            // small; later pages are allocated whole.
            let cells = if self.pages.is_empty() { 4 } else { per_page };
            self.pages.push(Vec::with_capacity(cells * self.cell));
        }
        let cell = self.cell;
        let page = self.pages.last_mut().expect("a page with room");
        if page.len() == page.capacity() {
            let want = (page.capacity() * 2).min(per_page * cell);
            page.reserve_exact(want - page.len());
        }
        page.resize(page.len() + cell, 0);
        self.cells += 1;
        c
    }
}

/// The keys of one namespace in one shard.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    /// Class `i` holds the keys of `i * STEP + 1 ..= (i + 1) * STEP` bytes; classes are added
    /// when a key first needs them (a pool may have thousands of shards, each namespace's keys
    /// usually of one or two lengths).
    classes: Vec<Class>,
}

impl Keys {
    /// Stores a copy of `key` (1 to [`MAX_KEY_LEN`] bytes, as `check_key` admits).
    pub(crate) fn insert(&mut self, key: &[u8]) -> KeyRef {
        assert!(
            !key.is_empty() && key.len() <= MAX_KEY_LEN,
            "keys are checked before they reach the index"
        );
        let i = (key.len() - 1) / STEP;
        while self.classes.len() <= i {
            let cell = (self.classes.len() + 1) * STEP;
            self.classes.push(Class::new(cell));
        }
        let class = &mut self.classes[i];
        let cell = class.take();
        class.bytes_mut(cell)[..key.len()].copy_from_slice(key);
        KeyRef {
            cell,
            len: key.len() as u16,
        }
    }

    /// The bytes of the key `r` names (empty for none).
    pub(crate) fn get(&self, r: KeyRef) -> &[u8] {
        if r.is_none() {
            return &[];
        }
        let len = r.len as usize;
        &self.classes[(len - 1) / STEP].bytes(r.cell)[..len]
    }

    /// Frees the cell of `r` (which must name a stored key) for reuse.
    pub(crate) fn remove(&mut self, r: KeyRef) {
        if !r.is_none() {
            self.classes[(r.len as usize - 1) / STEP].free.push(r.cell);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn keys_of_every_length_survive_reuse_across_pages() {
        let mut keys = Keys::default();
        let mut held: HashMap<Vec<u8>, KeyRef> = HashMap::new();
        let mut rng = 1u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for i in 0..40_000u64 {
            // A unique prefix, then filler up to a random length (at least the prefix's).
            let mut k = format!("{i}:").into_bytes();
            let len = (1 + next() as usize % MAX_KEY_LEN).max(k.len());
            k.resize(len, (i % 251) as u8);
            let r = keys.insert(&k);
            assert!(held.insert(k, r).is_none());
            if next() % 3 == 0 {
                let victim = held.keys().next().cloned().expect("one held");
                keys.remove(held.remove(&victim).expect("held"));
            }
        }
        for (k, r) in &held {
            assert_eq!(keys.get(*r), &k[..]);
        }
        assert_eq!(keys.get(KeyRef::default()), b"");
        // Freed cells were reused: no class holds more cells than keys were ever live at once.
        let cells: u32 = keys.classes.iter().map(|c| c.cells).sum();
        assert!((cells as usize) < 40_000, "{cells} cells");
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Insert a key of this length filled from this seed.
        Insert(usize, u8),
        /// Remove the held key at this position (modulo how many are held).
        Remove(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1..=MAX_KEY_LEN, any::<u8>()).prop_map(|(len, seed)| Op::Insert(len, seed)),
            2 => any::<usize>().prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Inserts and removes of keys of random lengths agree with a map after every step:
        /// every held key reads back as its own bytes, no two held keys share a cell, and a
        /// class never has more cells than it held keys at once (freed cells are reused).
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec(op(), 1..400)) {
            let mut keys = Keys::default();
            let mut model: HashMap<u32, (Vec<u8>, KeyRef)> = HashMap::new();
            let mut peak = vec![0u32; MAX_KEY_LEN.div_ceil(STEP)];
            for (id, op) in (0u32..).zip(ops) {
                match op {
                    Op::Insert(len, seed) => {
                        // Bytes that differ from key to key, even at one length.
                        let k: Vec<u8> = (0..len)
                            .map(|j| seed.wrapping_add((j as u8).wrapping_mul(31)) ^ id as u8)
                            .collect();
                        let r = keys.insert(&k);
                        prop_assert!(!r.is_none());
                        model.insert(id, (k, r));
                    }
                    Op::Remove(at) => {
                        if model.is_empty() {
                            continue;
                        }
                        let mut ids: Vec<u32> = model.keys().copied().collect();
                        ids.sort_unstable();
                        let (_, r) = model.remove(&ids[at % ids.len()]).expect("held");
                        keys.remove(r);
                    }
                }
                let mut live = vec![0u32; peak.len()];
                let mut cells = std::collections::HashSet::new();
                for (k, r) in model.values() {
                    prop_assert_eq!(keys.get(*r), &k[..]);
                    let class = (k.len() - 1) / STEP;
                    prop_assert!(cells.insert((class, r.cell)), "two keys in one cell");
                    live[class] += 1;
                }
                for (class, n) in live.into_iter().enumerate() {
                    peak[class] = peak[class].max(n);
                    let made = keys.classes.get(class).map_or(0, |c| c.cells);
                    prop_assert!(made <= peak[class], "class {} made {} cells for {} at most", class, made, peak[class]);
                }
            }
        }
    }

    #[test]
    fn a_small_class_stays_small() {
        let mut keys = Keys::default();
        let r = keys.insert(b"0123456789abcdef");
        assert_eq!(keys.get(r), b"0123456789abcdef");
        assert_eq!(keys.classes[1].pages[0].capacity(), 4 * 16);
    }
}
