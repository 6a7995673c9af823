//! Model-checks the per-block version protocol (`kvpool::seqlock`) under every interleaving
//! loom can produce: a reader holding an address of generation 1 must never accept bytes that a
//! later owner of the memory wrote.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p kvpool --no-default-features --release --test loom_seqlock`.
#![cfg(loom)]

use kvpool::seqlock;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

/// Two version words (an object may start at either) over three data words: the object of
/// generation 1 starts at word A and covers data 0..2; a later owner may start at A again, or
/// at B and cover data 1..3.
struct Memory {
    word_a: AtomicU64,
    word_b: AtomicU64,
    data: [AtomicU64; 3],
    /// Stands in for the allocator's mutex, through which a freed block is handed over.
    allocator: Mutex<bool>,
}

fn memory_with_generation_1() -> Arc<Memory> {
    let m = Memory {
        word_a: AtomicU64::new(0),
        word_b: AtomicU64::new(0),
        data: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
        allocator: Mutex::new(false),
    };
    seqlock::begin(&m.word_a, 1);
    m.data[0].store(1, Ordering::Relaxed);
    m.data[1].store(1, Ordering::Relaxed);
    seqlock::publish(&m.word_a, 1);
    Arc::new(m)
}

/// What a one-sided read of generation 1 returns: Some(bytes) only when validated.
fn read_generation_1(m: &Memory) -> Option<[u64; 2]> {
    if !seqlock::read_begin(&m.word_a, 1) {
        return None;
    }
    let got = [
        m.data[0].load(Ordering::Relaxed),
        m.data[1].load(Ordering::Relaxed),
    ];
    seqlock::read_validate(&m.word_a, 1).then_some(got)
}

#[test]
fn reuse_at_the_same_offset_is_detected() {
    loom::model(|| {
        let m = memory_with_generation_1();
        let owner = m.clone();
        let t = thread::spawn(move || {
            seqlock::retire(&owner.word_a, 1);
            seqlock::begin(&owner.word_a, 2);
            owner.data[0].store(2, Ordering::Relaxed);
            owner.data[1].store(2, Ordering::Relaxed);
            seqlock::publish(&owner.word_a, 2);
        });
        if let Some(got) = read_generation_1(&m) {
            assert_eq!(got, [1, 1], "accepted bytes of a later generation");
        }
        t.join().unwrap();
    });
}

#[test]
fn reuse_by_an_overlapping_block_handed_over_by_the_allocator_is_detected() {
    loom::model(|| {
        let m = memory_with_generation_1();
        let freer = m.clone();
        let new_owner = m.clone();
        // Eviction retires generation 1 and frees the block...
        let t1 = thread::spawn(move || {
            seqlock::retire(&freer.word_a, 1);
            *freer.allocator.lock().unwrap() = true;
        });
        // ...and another thread is handed memory overlapping it, starting at another word.
        let t2 = thread::spawn(move || {
            if !*new_owner.allocator.lock().unwrap() {
                return;
            }
            seqlock::begin(&new_owner.word_b, 2);
            new_owner.data[1].store(2, Ordering::Relaxed);
            new_owner.data[2].store(2, Ordering::Relaxed);
            seqlock::publish(&new_owner.word_b, 2);
        });
        if let Some(got) = read_generation_1(&m) {
            assert_eq!(got, [1, 1], "accepted bytes of an overlapping later object");
        }
        t1.join().unwrap();
        t2.join().unwrap();
    });
}

#[test]
fn pending_blocks_are_never_readable() {
    loom::model(|| {
        let m = Arc::new(Memory {
            word_a: AtomicU64::new(0),
            word_b: AtomicU64::new(0),
            data: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
            allocator: Mutex::new(false),
        });
        let owner = m.clone();
        let t = thread::spawn(move || {
            seqlock::begin(&owner.word_a, 1);
            owner.data[0].store(1, Ordering::Relaxed);
            owner.data[1].store(1, Ordering::Relaxed);
            assert!(seqlock::is_writing(&owner.word_a, 1));
            seqlock::publish(&owner.word_a, 1);
        });
        if let Some(got) = read_generation_1(&m) {
            assert_eq!(got, [1, 1], "read a half-written object");
        }
        t.join().unwrap();
    });
}

/// Detaching (the object left the index while a holder keeps its memory) never fails a
/// holder's read, whenever it lands; once it has happened, a reader that wants the key's
/// current value sees a miss; and the memory's reuse afterwards is caught as before.
#[test]
fn a_detached_block_stays_readable_to_holders_only() {
    loom::model(|| {
        let m = memory_with_generation_1();
        let owner = m.clone();
        let t = thread::spawn(move || seqlock::detach(&owner.word_a, 1));
        assert_eq!(
            read_generation_1(&m),
            Some([1, 1]),
            "a holder's read failed"
        );
        t.join().unwrap();
        assert!(!seqlock::read_begin_current(&m.word_a, 1));
        assert!(seqlock::read_begin(&m.word_a, 1));
        let owner = m.clone();
        let t = thread::spawn(move || {
            seqlock::retire(&owner.word_a, 1);
            seqlock::begin(&owner.word_a, 2);
            owner.data[0].store(2, Ordering::Relaxed);
            owner.data[1].store(2, Ordering::Relaxed);
            seqlock::publish(&owner.word_a, 2);
        });
        if let Some(got) = read_generation_1(&m) {
            assert_eq!(got, [1, 1], "accepted bytes of a later generation");
        }
        t.join().unwrap();
        seqlock::detach(&m.word_a, 1);
        assert!(
            seqlock::read_begin_current(&m.word_a, 2),
            "a stale detach hit a new owner"
        );
    });
}
