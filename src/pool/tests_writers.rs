//! Writers of one pending allocation: overlapping ranges are refused, never aliased.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Barrier;

use super::*;
use crate::checksum::checksum;
use crate::error::AddrFault;
use crate::segment::{Backing, HugePages};

fn pool() -> Pool {
    let cfg = PoolConfig {
        segment_size: 8 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        ..PoolConfig::default()
    };
    Pool::new(&cfg, [5; 16]).unwrap()
}

#[test]
fn overlapping_writes_are_busy_and_disjoint_ones_proceed() {
    let p = pool();
    let a = p.alloc(0, b"k", 4096, false, 0).unwrap();
    let mut first = p.begin_write_range(&a, 0, 2048).unwrap();
    first.bytes_mut().fill(1);
    let busy = |r: Result<PendingWrite<'_>, PoolError>| {
        matches!(r, Err(PoolError::BadAddress(AddrFault::Busy)))
    };
    assert!(busy(p.begin_write_range(&a, 2047, 10)));
    assert!(busy(p.begin_write(&a)));
    assert_eq!(
        p.write(&a, 0, &[9; 16]),
        Err(PoolError::BadAddress(AddrFault::Busy))
    );
    assert!(matches!(
        p.begin_write_range(&a, 4000, 200),
        Err(PoolError::BadAddress(AddrFault::OutOfBounds))
    ));
    let mut second = p.begin_write_range(&a, 2048, 2048).unwrap();
    second.bytes_mut().fill(2);
    assert_eq!(
        p.commit(Commit::new(&a, 0)),
        Err(PoolError::BadAddress(AddrFault::Busy)),
        "open writes hold off commit"
    );
    assert_eq!(p.reap(u64::MAX), 0, "and the reaper");
    drop(first);
    drop(second);
    let mut want = vec![1u8; 2048];
    want.resize(4096, 2);
    p.commit(Commit::new(&a, checksum(&want))).unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), want);
}

/// Many threads race to write overlapping ranges of one allocation, round after round. Whoever
/// holds a range must be alone on it: each writer fills its slice, yields, and checks nobody
/// else wrote into it; an independent count of holders per byte must never exceed one; and the
/// committed object is exactly the last writer's bytes, never a mixture.
#[test]
fn racing_writers_never_share_bytes_and_commits_are_never_torn() {
    const THREADS: usize = 8;
    const LEN: usize = 64 << 10;
    const ROUNDS: usize = 40;
    let p = pool();
    let barrier = Barrier::new(THREADS);
    // Holders per 4 KiB page of the allocation.
    let holders: Vec<AtomicU32> = (0..LEN / 4096).map(|_| AtomicU32::new(0)).collect();
    let granted = AtomicU64::new(0);
    for round in 0..ROUNDS {
        let a = p.alloc(0, b"raced", LEN as u64, false, 0).unwrap();
        // Each thread writes the whole object with its own value, except that odd threads
        // write a page-aligned half, so full and partial overlaps both happen.
        let last = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (p, a, barrier, holders, last) = (&p, &a, &barrier, &holders, &last);
                let granted = &granted;
                s.spawn(move || {
                    let value = (round * THREADS + t) as u8 | 1;
                    let (off, len) = if t % 2 == 0 {
                        (0, LEN)
                    } else {
                        (((t / 2) % 2) * LEN / 2, LEN / 2)
                    };
                    barrier.wait();
                    for _ in 0..20 {
                        let Ok(mut w) = p.begin_write_range(a, off as u64, len as u64) else {
                            std::thread::yield_now();
                            continue;
                        };
                        granted.fetch_add(1, Ordering::Relaxed);
                        let pages = off / 4096..(off + len) / 4096;
                        for h in &holders[pages.clone()] {
                            assert_eq!(h.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                        }
                        let bytes = w.bytes_mut();
                        bytes.fill(value);
                        std::thread::yield_now();
                        assert!(bytes.iter().all(|&b| b == value), "aliased");
                        for h in &holders[pages] {
                            h.fetch_sub(1, Ordering::SeqCst);
                        }
                        last.lock().unwrap().push((off, len, value));
                        drop(w);
                    }
                });
            }
        });
        // The content is what the writes, in the order they were granted, leave behind.
        let mut want = vec![0u8; LEN];
        for (off, len, value) in last.into_inner().unwrap() {
            want[off..off + len].fill(value);
        }
        p.commit(Commit::new(&a, checksum(&want)))
            .expect("the committed bytes are exactly the serialised writes");
        assert_eq!(p.get(0, b"raced", 0).unwrap(), want);
    }
    assert!(granted.load(Ordering::Relaxed) > 0);
}

/// A whole claim turns into the commit's seal: no write can come between the bytes its holder
/// hashed and the bytes committed; a wrong hash releases the allocation; a partial claim or a
/// cancelled key is refused.
#[test]
fn a_whole_claim_commits_what_it_hashed() {
    let p = pool();
    let a = p.alloc(0, b"k", 4096, false, 0).unwrap();
    let mut w = p.begin_write(&a).unwrap();
    w.bytes_mut().fill(7);
    assert!(
        matches!(
            p.begin_write(&a),
            Err(PoolError::BadAddress(AddrFault::Busy))
        ),
        "no other writer while it is held"
    );
    let sum = checksum(&[7; 4096]);
    p.commit(Commit::claimed(w, sum, sum)).unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), vec![7; 4096]);
    assert!(!p.is_pending(a.generation));
    assert!(
        p.write(&a, 0, &[1]).is_err(),
        "committed: nothing writes it any more"
    );

    // A hash that differs from the given checksum: refused, and the allocation is released.
    let b = p.alloc(0, b"b", 4096, false, 0).unwrap();
    let mut w = p.begin_write(&b).unwrap();
    w.bytes_mut().fill(8);
    assert_eq!(
        p.commit(Commit::claimed(w, sum, sum ^ 1)),
        Err(PoolError::ChecksumMismatch)
    );
    assert!(!p.is_pending(b.generation));
    assert!(p.get(0, b"b", 0).is_err());

    // Part of the allocation: not a commit.
    let c = p.alloc(0, b"c", 4096, false, 0).unwrap();
    let w = p.begin_write_range(&c, 0, 100).unwrap();
    assert_eq!(
        p.commit(Commit::claimed(w, sum, sum)),
        Err(PoolError::BadAddress(AddrFault::NotWritable))
    );
    assert!(
        p.is_pending(c.generation),
        "still pending, its claim released"
    );
    assert!(p.begin_write(&c).is_ok());

    // Cancelled while held: refused, and freed.
    let d = p.alloc(0, b"d", 4096, false, 0).unwrap();
    let w = p.begin_write(&d).unwrap();
    assert_eq!(p.cancel(0, &[b"d"]).unwrap(), 1);
    assert_eq!(
        p.commit(Commit::claimed(w, sum, sum)),
        Err(PoolError::Cancelled)
    );
    assert!(!p.is_pending(d.generation));
}
