//! Which byte ranges of one pending allocation are being written right now.
//!
//! The rule that makes writing into a pending allocation sound: a writer gets its `&mut [u8]`
//! over `[start, end)` only after [`WriteClaims::try_claim`] granted that range, and a range is
//! granted only when it overlaps no range still held. The pool keeps one `WriteClaims` per
//! pending allocation inside its pending table and claims and releases under that table's lock,
//! so two live slices of one allocation are always disjoint. Commit, abort and the reaper all
//! refuse an allocation that has any claim, so its memory is never freed under a writer.
//!
//! This module has no dependencies so that `tests/loom_writers.rs` can model-check the same code
//! under `--cfg loom`.

/// The ranges held by the open writes of one allocation (half-open, in bytes from its start).
#[derive(Debug, Default)]
pub struct WriteClaims {
    held: Vec<(u64, u64)>,
}

impl WriteClaims {
    /// Claims `[start, end)` for one writer; false (and nothing changes) when it overlaps a range
    /// already held. An empty range overlaps nothing, but still counts as an open write.
    pub fn try_claim(&mut self, start: u64, end: u64) -> bool {
        debug_assert!(start <= end);
        if start < end
            && self
                .held
                .iter()
                .any(|&(s, e)| s < e && start < e && s < end)
        {
            return false;
        }
        self.held.push((start, end));
        true
    }

    /// Gives back one claim of `[start, end)`, made earlier by [`WriteClaims::try_claim`].
    pub fn release(&mut self, start: u64, end: u64) {
        if let Some(i) = self.held.iter().position(|&r| r == (start, end)) {
            self.held.swap_remove(i);
        }
    }

    /// True when no write is open.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// How many writes are open.
    pub fn len(&self) -> usize {
        self.held.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn overlapping_claims_are_refused_until_released() {
        let mut c = WriteClaims::default();
        assert!(c.try_claim(0, 100));
        assert!(!c.try_claim(99, 200), "overlaps by one byte");
        assert!(!c.try_claim(0, 100), "the same range twice");
        assert!(!c.try_claim(10, 20), "inside");
        assert!(c.try_claim(100, 200), "adjacent is disjoint");
        assert!(c.try_claim(50, 50), "empty overlaps nothing");
        assert_eq!(c.len(), 3);
        c.release(0, 100);
        assert!(c.try_claim(10, 20));
        c.release(10, 20);
        c.release(100, 200);
        c.release(50, 50);
        assert!(c.is_empty());
    }
}
