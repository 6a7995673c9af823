//! The store against a model of it, under random inserts, removals, reads and reopenings: a
//! map of what each key holds, and a FIFO of regions with the bytes each has taken.

use std::collections::{HashMap, VecDeque};

use proptest::prelude::*;

use super::tests::{bytes_on_disk, TempDir};
use super::*;

const REGION: u64 = 32 << 10;
const REGIONS: u64 = 4;

#[derive(Clone, Debug)]
enum Op {
    Insert {
        ns: u32,
        key: u8,
        len: usize,
        seed: u8,
    },
    Remove {
        ns: u32,
        key: u8,
    },
    Get {
        ns: u32,
        key: u8,
    },
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3u32, 0..12u8, 0..20_000usize, any::<u8>())
            .prop_map(|(ns, key, len, seed)| Op::Insert { ns, key, len, seed }),
        2 => (0..3u32, 0..12u8).prop_map(|(ns, key)| Op::Remove { ns, key }),
        3 => (0..3u32, 0..12u8).prop_map(|(ns, key)| Op::Get { ns, key }),
        1 => Just(Op::Reopen),
    ]
}

/// What the store should hold.
#[derive(Default)]
struct Model {
    /// `(ns, key)` → (value, the region's serial number).
    objects: HashMap<(u32, u8), (Vec<u8>, u64)>,
    /// Regions holding records, oldest first: (serial, bytes taken).
    regions: VecDeque<(u64, u64)>,
    serial: u64,
}

impl Model {
    /// Takes `len` bytes of the head region; the serial of the region they are in.
    fn append(&mut self, len: u64) -> u64 {
        if self
            .regions
            .back()
            .is_none_or(|&(_, used)| used + len > REGION)
        {
            if self.regions.len() as u64 == REGIONS {
                let (gone, _) = self.regions.pop_front().unwrap();
                self.objects.retain(|_, (_, r)| *r != gone);
            }
            self.serial += 1;
            self.regions.push_back((self.serial, 0));
        }
        let head = self.regions.back_mut().unwrap();
        head.1 += len;
        head.0
    }

    fn namespace_bytes(&self, ns: u32) -> u64 {
        self.objects
            .iter()
            .filter(|((n, _), _)| *n == ns)
            .map(|(_, (v, _))| format::record_len(1, v.len() as u64))
            .sum()
    }
}

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8) ^ seed).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_store_behaves_as_its_model_and_never_exceeds_its_capacity(
        ops in proptest::collection::vec(op(), 1..120)
    ) {
        let dir = TempDir::new("model");
        let config = DiskConfig::new(&dir.0, REGIONS * REGION).region_size(REGION);
        let mut store = DiskStore::open(&config).unwrap();
        let mut model = Model::default();
        let mut buf = vec![0u8; REGION as usize];
        for op in ops {
            match op {
                Op::Insert { ns, key, len, seed } => {
                    let v = value(seed, len);
                    prop_assert_eq!(store.insert(ns, &[key], &v), Insert::Written);
                    let region = model.append(format::record_len(1, len as u64));
                    model.objects.insert((ns, key), (v, region));
                }
                Op::Remove { ns, key } => {
                    let had = model.objects.contains_key(&(ns, key));
                    prop_assert_eq!(store.remove(ns, &[key]), had);
                    if had {
                        // The tombstone takes a block of its own.
                        model.append(ALIGN);
                        model.objects.remove(&(ns, key));
                    }
                }
                Op::Get { ns, key } => {
                    let got = match store.get(ns, &[key], &mut buf) {
                        Get::Hit { len } => Some(buf[..len].to_vec()),
                        _ => None,
                    };
                    prop_assert_eq!(got.as_ref(), model.objects.get(&(ns, key)).map(|(v, _)| v));
                }
                Op::Reopen => {
                    drop(store);
                    store = DiskStore::open(&config).unwrap();
                }
            }
            prop_assert!(bytes_on_disk(&dir.0) <= REGIONS * REGION);
            for ns in 0..3 {
                prop_assert_eq!(store.namespace_bytes(ns), model.namespace_bytes(ns));
            }
            prop_assert_eq!(store.stats().objects, model.objects.len() as u64);
        }
    }
}
