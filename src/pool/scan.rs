//! Walking a namespace's keys a page at a time (what Redis's `SCAN` needs), one shard locked
//! for one bounded page, never the whole index at once.

use super::{lock, Pool};
use crate::error::PoolError;

/// Bits of a scan cursor that hold the slot within a shard; the shard is above them.
const SLOT_BITS: u32 = 40;

/// One page of a scan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanPage {
    /// Where the next page starts; 0 when the walk is complete.
    pub cursor: u64,
    /// The keys of this page that `keep` accepted.
    pub keys: Vec<Vec<u8>>,
}

impl Pool {
    /// The keys of namespace `ns` from `cursor` (0 to start), looking at no more than `budget`
    /// index slots (at least 1), keeping those `keep` accepts. Like Redis's `SCAN`: every object
    /// present from the first page to the last is returned exactly once; one written or removed
    /// meanwhile may or may not be; a page may be empty while the walk goes on. A cursor this
    /// pool never handed out is treated as the end of the walk.
    pub fn scan(
        &self,
        ns: u32,
        cursor: u64,
        budget: usize,
        keep: &mut dyn FnMut(&[u8]) -> bool,
    ) -> Result<ScanPage, PoolError> {
        self.ns(ns)?;
        let mut shard = (cursor >> SLOT_BITS) as usize;
        let mut slot = (cursor & ((1 << SLOT_BITS) - 1)) as usize;
        let mut left = budget.max(1);
        let mut keys = Vec::new();
        while shard < self.shards.len() && left > 0 {
            let guard = lock(&self.shards[shard]);
            let index = &guard.ns[ns as usize];
            let (looked, next) = index.scan(slot, left, &mut |k| {
                if keep(k) {
                    keys.push(k.to_vec());
                }
            });
            drop(guard);
            // Moving to the next shard costs one slot's worth, so a page over many empty shards
            // is bounded too.
            left = left.saturating_sub(looked.max(1));
            match next {
                Some(s) => slot = s,
                None => {
                    shard += 1;
                    slot = 0;
                }
            }
        }
        let cursor = if shard >= self.shards.len() {
            0
        } else {
            ((shard as u64) << SLOT_BITS) | slot as u64
        };
        Ok(ScanPage { cursor, keys })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use crate::pool::{Pool, PoolConfig};
    use crate::segment::{Backing, HugePages};

    fn pool() -> Pool {
        let cfg = PoolConfig {
            segment_size: 8 << 20,
            backing: Backing::Anonymous,
            huge_pages: HugePages::Off,
            shards: 4,
            ..PoolConfig::default()
        };
        Pool::new(&cfg, [7; 16]).expect("pool")
    }

    fn walk(p: &Pool, budget: usize, keep: &mut dyn FnMut(&[u8]) -> bool) -> Vec<Vec<u8>> {
        let mut cursor = 0;
        let mut out = Vec::new();
        for _ in 0..100_000 {
            let page = p.scan(0, cursor, budget, keep).expect("scan");
            assert!(page.keys.len() <= budget.max(1));
            out.extend(page.keys);
            cursor = page.cursor;
            if cursor == 0 {
                return out;
            }
        }
        panic!("the walk never ended");
    }

    #[test]
    fn every_key_once_in_bounded_pages() {
        let p = pool();
        let want: HashSet<Vec<u8>> = (0..300).map(|i| format!("k{i}").into_bytes()).collect();
        for k in &want {
            p.put(0, k, b"v", false, 0).expect("put");
        }
        for budget in [1, 7, 1000] {
            let got = walk(&p, budget, &mut |_| true);
            assert_eq!(got.len(), want.len(), "budget {budget}");
            assert_eq!(got.into_iter().collect::<HashSet<_>>(), want);
        }
        let ones = walk(&p, 10, &mut |k| k.ends_with(b"1"));
        assert_eq!(ones.len(), 30);
        assert!(p.scan(9, 0, 10, &mut |_| true).is_err());
        // An empty namespace walk ends at once.
        let empty = pool();
        assert_eq!(empty.scan(0, 0, 10, &mut |_| true).expect("scan").cursor, 0);
        // A cursor from nowhere ends the walk instead of panicking.
        assert_eq!(
            p.scan(0, u64::MAX, 10, &mut |_| true).expect("scan").cursor,
            0
        );
    }

    #[test]
    fn keys_present_throughout_survive_churn() {
        let p = pool();
        let stable: HashSet<Vec<u8>> = (0..100).map(|i| format!("s{i}").into_bytes()).collect();
        for k in &stable {
            p.put(0, k, b"v", false, 0).expect("put");
        }
        let mut cursor = 0;
        let mut seen = Vec::new();
        let mut round = 0;
        loop {
            // Churn between pages: new keys come, others go, freed slots are reused.
            p.put(0, format!("t{round}").as_bytes(), b"v", false, 0)
                .expect("put");
            if round > 0 {
                p.remove(0, format!("t{}", round - 1).as_bytes())
                    .expect("remove");
            }
            round += 1;
            let page = p.scan(0, cursor, 5, &mut |_| true).expect("scan");
            seen.extend(page.keys);
            cursor = page.cursor;
            if cursor == 0 {
                break;
            }
        }
        for k in &stable {
            assert_eq!(seen.iter().filter(|s| *s == k).count(), 1, "{k:?}");
        }
    }
}
