//! `Pool::cancel`: a request's pending allocations and objects, freed in one call, and never
//! committed after it.

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
        shards: 4,
        namespaces: vec![
            NamespaceConfig::unlimited(DEFAULT_NAMESPACE),
            NamespaceConfig::unlimited("other"),
        ],
        ..PoolConfig::default()
    };
    Pool::new(&cfg, [9; 16]).unwrap()
}

fn used(p: &Pool) -> u64 {
    p.stats().used_bytes()
}

#[test]
fn cancel_frees_reservations_and_objects_and_their_commits_fail() {
    let p = pool();
    let v = vec![3u8; 10_000];
    // A key of another namespace, and another key: both untouched.
    p.put(1, b"k1", &v, false, 0).unwrap();
    p.put(0, b"keep", &v, false, 0).unwrap();
    let before = used(&p);
    let reserved = p.alloc(0, b"k1", 4096, false, 0).unwrap();
    p.put(0, b"k2", &v, true, 0).unwrap();
    let in_flight = p.alloc(0, b"k3", 20_000, false, 0).unwrap();
    p.write(&in_flight, 0, &[1; 100]).unwrap();
    let second = p.alloc(0, b"k3", 100, false, 0).unwrap();
    assert!(used(&p) > before);

    let keys: [&[u8]; 4] = [b"k1", b"k2", b"k3", b"never"];
    assert_eq!(
        p.cancel(0, &keys),
        Ok(4),
        "one reservation, one object, two allocations"
    );
    assert_eq!(used(&p), before, "every byte is back");
    assert!(p.get(0, b"k2", 0).is_err(), "the pinned object is gone");
    assert_eq!(p.stats().namespaces[0].pinned_bytes, 0);
    assert_eq!(
        p.get(1, b"k1", 0).unwrap(),
        v,
        "another namespace keeps its key"
    );
    assert_eq!(p.get(0, b"keep", 0).unwrap(), v);
    for a in [reserved, in_flight, second] {
        assert_eq!(
            p.commit(Commit::new(&a, 0)),
            Err(PoolError::Cancelled),
            "a clear error"
        );
        assert_eq!(p.write(&a, 0, &[1]), Err(PoolError::Cancelled));
    }
    assert_eq!(p.cancel(0, &keys), Ok(0), "nothing is left to cancel");
    // A later write of the key is a new request.
    p.put(0, b"k1", &v, false, 0).unwrap();
    assert_eq!(p.get(0, b"k1", 0).unwrap(), v);

    assert_eq!(p.cancel(7, &keys), Err(PoolError::UnknownNamespace));
    assert_eq!(p.cancel(0, &[b""]), Err(PoolError::BadKey));
}

/// A write still open can't have its memory freed under it: the allocation is doomed instead,
/// and its commit, an abort or the reaper releases it.
#[test]
fn an_allocation_being_written_is_released_by_whoever_comes_next() {
    let p = pool();
    let before = used(&p);
    let a = p.alloc(0, b"a", 4096, false, 0).unwrap();
    let b = p.alloc(0, b"b", 4096, false, 0).unwrap();
    let c = p.alloc(0, b"c", 4096, false, 0).unwrap();
    let (wa, wb, wc) = (
        p.begin_write(&a).unwrap(),
        p.begin_write(&b).unwrap(),
        p.begin_write_range(&c, 0, 10).unwrap(),
    );
    assert_eq!(p.cancel(0, &[b"a", b"b", b"c"]), Ok(3));
    assert_eq!(
        p.begin_write_range(&c, 100, 10).err(),
        Some(PoolError::Cancelled),
        "no new write opens"
    );
    assert_eq!(p.cancel(0, &[b"a"]), Ok(0), "counted once");
    drop((wa, wb, wc));
    assert_eq!(
        p.commit(Commit::new(&a, 0)),
        Err(PoolError::Cancelled),
        "a clear error"
    );
    assert_eq!(
        p.commit(Commit::new(&a, 0)),
        Err(PoolError::Cancelled),
        "and again"
    );
    p.abort(&b).unwrap();
    assert_eq!(p.reap(0), 1, "the reaper takes the last one at once");
    assert_eq!(used(&p), before);
    assert!(p.get(0, b"a", 0).is_err());
    let fresh = p.alloc(0, b"a", 16, false, 0).unwrap();
    p.abort(&fresh).unwrap();
    assert_eq!(
        p.commit(Commit::new(&fresh, 0)),
        Err(AddrFault::NotWritable.into()),
        "an allocation aborted, not cancelled"
    );
}

/// Commits and cancels of one key race; whichever comes first, once both are done the key is
/// absent and its memory free: a commit either lands before the cancel (which removes it) or
/// fails.
#[test]
fn a_commit_racing_a_cancel_never_resurrects_the_key() {
    let p = pool();
    let before = used(&p);
    let v = vec![5u8; 64 << 10];
    let sum = checksum(&v);
    let (mut landed, mut refused) = (0, 0);
    for round in 0..300u32 {
        let a = p.alloc(0, b"raced", v.len() as u64, false, 0).unwrap();
        p.write(&a, 0, &v).unwrap();
        let go = Barrier::new(2);
        let (committed, cancelled) = std::thread::scope(|s| {
            let commit = s.spawn(|| {
                go.wait();
                if round % 2 == 0 {
                    p.commit(Commit::new(&a, sum))
                } else {
                    p.commit(Commit::all(&[(a, sum)]))
                }
            });
            go.wait();
            let n = p.cancel(0, &[b"raced"]).unwrap();
            (commit.join().unwrap(), n)
        });
        assert_eq!(cancelled, 1, "the allocation or the object");
        match committed {
            Ok(committed) => {
                assert!(committed, "an unconditional commit commits");
                landed += 1;
            }
            Err(e) => {
                assert_eq!(e, PoolError::Cancelled);
                refused += 1;
            }
        }
        assert!(p.get(0, b"raced", 0).is_err(), "round {round}: resurrected");
        assert_eq!(used(&p), before, "round {round}");
    }
    assert_eq!(landed + refused, 300);
}
