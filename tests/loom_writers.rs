//! Model-checks the rule that keeps writers of one pending allocation apart
//! (`kvpool::claims::WriteClaims`), the way the pool uses it: a claim is taken and released
//! under the pending table's lock, and only a granted claim lets a writer touch its bytes. The
//! bytes are loom `UnsafeCell`s, so loom fails the model if two threads ever access the same
//! byte without one happening before the other: two writers' claims never alias.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p kvpool --no-default-features --release --test loom_writers`.
#![cfg(loom)]

use kvpool::claims::WriteClaims;
use loom::cell::UnsafeCell;
use loom::sync::{Arc, Mutex};
use loom::thread;

/// What the pending table holds for one allocation.
struct Entry {
    /// Still pending (commit takes it out).
    present: bool,
    claims: WriteClaims,
}

/// One pending allocation of four bytes.
struct Allocation {
    /// Stands in for the pending table's shard lock.
    table: Mutex<Entry>,
    bytes: [UnsafeCell<u8>; 4],
}

fn allocation() -> Arc<Allocation> {
    Arc::new(Allocation {
        table: Mutex::new(Entry {
            present: true,
            claims: WriteClaims::default(),
        }),
        bytes: [
            UnsafeCell::new(0),
            UnsafeCell::new(0),
            UnsafeCell::new(0),
            UnsafeCell::new(0),
        ],
    })
}

/// `Pool::begin_write_range`, the copy, and `PendingWrite::drop`. False when refused.
fn write(a: &Allocation, start: usize, end: usize, value: u8) -> bool {
    {
        let mut e = a.table.lock().unwrap();
        if !e.present || !e.claims.try_claim(start as u64, end as u64) {
            return false;
        }
    }
    for b in &a.bytes[start..end] {
        // SAFETY: the claim on [start, end) is what the model checks makes this exclusive.
        b.with_mut(|p| unsafe { *p = value });
    }
    a.table
        .lock()
        .unwrap()
        .claims
        .release(start as u64, end as u64);
    true
}

/// `Pool::commit`: takes the allocation out only when no write is open, then reads its bytes.
fn commit(a: &Allocation) -> Option<[u8; 4]> {
    {
        let mut e = a.table.lock().unwrap();
        if !e.present || !e.claims.is_empty() {
            return None;
        }
        e.present = false;
    }
    let mut out = [0; 4];
    for (o, b) in out.iter_mut().zip(&a.bytes) {
        // SAFETY: out of the table with no claim: the model checks no writer can still be here.
        *o = b.with(|p| unsafe { *p });
    }
    Some(out)
}

#[test]
fn overlapping_writers_never_hold_the_same_bytes() {
    loom::model(|| {
        let a = allocation();
        let b = a.clone();
        let t = thread::spawn(move || write(&b, 0, 3, 1));
        let mine = write(&a, 1, 4, 2);
        let theirs = t.join().unwrap();
        // The first to claim always gets its range; the other may come after it or be refused.
        assert!(mine || theirs);
        assert!(a.table.lock().unwrap().claims.is_empty());
        let got = commit(&a).unwrap();
        match (mine, theirs) {
            (true, false) => assert_eq!(got, [0, 2, 2, 2]),
            (false, true) => assert_eq!(got, [1, 1, 1, 0]),
            _ => assert!(got == [1, 2, 2, 2] || got == [1, 1, 1, 2]),
        }
    });
}

#[test]
fn disjoint_writers_both_proceed() {
    loom::model(|| {
        let a = allocation();
        let b = a.clone();
        let t = thread::spawn(move || write(&b, 0, 2, 1));
        assert!(write(&a, 2, 4, 2));
        assert!(t.join().unwrap());
        assert_eq!(commit(&a), Some([1, 1, 2, 2]));
    });
}

#[test]
fn commit_never_reads_under_a_writer() {
    loom::model(|| {
        let a = allocation();
        let b = a.clone();
        let t = thread::spawn(move || write(&b, 0, 4, 7));
        let committed = commit(&a);
        let wrote = t.join().unwrap();
        match committed {
            // Committed first: the write found nothing to write into.
            Some(bytes) if !wrote => assert_eq!(bytes, [0; 4]),
            Some(bytes) => assert_eq!(bytes, [7; 4]),
            None => assert!(wrote, "commit is refused only while the write is open"),
        }
    });
}

/// The model has teeth: a rule that grants overlapping ranges is caught by loom.
#[test]
#[should_panic]
fn a_rule_that_ignores_overlap_is_caught() {
    loom::model(|| {
        let a = allocation();
        let b = a.clone();
        let overlapping = |a: &Allocation, value: u8| {
            drop(a.table.lock().unwrap());
            for byte in &a.bytes[1..3] {
                // SAFETY: deliberately unsound: no claim is taken.
                byte.with_mut(|p| unsafe { *p = value });
            }
        };
        let t = thread::spawn(move || overlapping(&b, 1));
        overlapping(&a, 2);
        t.join().unwrap();
    });
}
