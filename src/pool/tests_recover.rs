//! Recovery against a model: random objects written, removed, pinned; a crash or a clean stop;
//! random damage to the segment files and the journal; then exactly the objects whose bytes
//! and records survived intact come back, byte for byte, and nothing else.

use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::*;
use crate::journal::journal_file_name;
use crate::segment::{segment_file_name, Backing, HugePages};

fn cfg(dir: &Path) -> PoolConfig {
    PoolConfig {
        segment_size: 4 << 20,
        segments: 2,
        backing: Backing::File(dir.to_path_buf()),
        huge_pages: HugePages::Off,
        shards: 4,
        namespaces: vec![
            NamespaceConfig::unlimited(DEFAULT_NAMESPACE),
            NamespaceConfig::unlimited("other"),
        ],
        ..PoolConfig::default()
    }
}

fn test_dir(name: &str) -> PathBuf {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("kvpool-recover-{name}-{}-{n}", std::process::id()))
}

fn value(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(131).wrapping_add(seed * 7) as u8)
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Put {
        ns: u32,
        key: u8,
        len: u16,
        pin: bool,
    },
    Remove {
        ns: u32,
        key: u8,
    },
    Pin {
        ns: u32,
        key: u8,
        pin: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..2, 0u8..24, 0u16..9000, any::<bool>())
            .prop_map(|(ns, key, len, pin)| Op::Put { ns, key, len, pin }),
        1 => (0u32..2, 0u8..24).prop_map(|(ns, key)| Op::Remove { ns, key }),
        1 => (0u32..2, 0u8..24, any::<bool>()).prop_map(|(ns, key, pin)| Op::Pin { ns, key, pin }),
    ]
}

/// Where an object's bytes are in its segment file, to damage them.
fn file_position(p: &Pool, dir: &Path, addr: &GlobalAddr) -> (PathBuf, u64) {
    let seg = p.segments().nth(addr.segment as usize).unwrap();
    (
        dir.join(segment_file_name(p.node(), addr.segment)),
        seg.layout().data_offset + addr.offset,
    )
}

/// A damaged object: its (namespace, key), its file and position, and the byte flipped.
type Damage = ((u32, u8), (PathBuf, u64), u64);

fn flip(path: &Path, at: u64) {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(at)).unwrap();
    std::io::Read::read_exact(&mut f, &mut b).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[b[0] ^ 0x5a]).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn recovery_brings_back_exactly_the_intact_objects(
        ops in prop::collection::vec(op(), 1..80),
        crash in any::<bool>(),
        damage in prop::collection::vec((any::<prop::sample::Index>(), any::<u16>()), 0..4),
        torn in any::<bool>(),
    ) {
        let dir = test_dir("model");
        let p = Pool::new(&cfg(&dir), [1; 16]).unwrap();
        // (ns, key) -> (value, pinned)
        let mut model: BTreeMap<(u32, u8), (Vec<u8>, bool)> = BTreeMap::new();
        for (i, o) in ops.iter().enumerate() {
            match *o {
                Op::Put { ns, key, len, pin } => {
                    let v = value(i as u32, len as usize);
                    p.put(ns, &[key], &v, pin, 0).unwrap();
                    model.insert((ns, key), (v, pin));
                }
                Op::Remove { ns, key } => {
                    prop_assert_eq!(p.remove(ns, &[key]).unwrap(), model.remove(&(ns, key)).is_some());
                }
                Op::Pin { ns, key, pin } => {
                    let found = p.set_pinned(ns, &[key], pin).unwrap();
                    if let Some(m) = model.get_mut(&(ns, key)) {
                        m.1 = pin;
                    }
                    prop_assert_eq!(found, model.contains_key(&(ns, key)));
                }
            }
        }
        // An in-flight put at the crash: pending, never committed, never recovered.
        let pending = p.alloc(0, b"pending", 100, false, 0).unwrap();
        p.write(&pending, 0, &[7; 100]).unwrap();
        // Damage some objects' bytes (after the stop, as an operator's stray write would).
        let keys: Vec<(u32, u8)> = model.keys().copied().collect();
        let mut damaged: Vec<Damage> = Vec::new();
        for (which, at) in &damage {
            if keys.is_empty() {
                break;
            }
            let k = keys[which.index(keys.len())];
            let l = p.lookup(k.0, &[k.1], 0, 0).unwrap().unwrap();
            if l.addr.len == 0 || damaged.iter().any(|(d, ..)| *d == k) {
                continue;
            }
            damaged.push((k, file_position(&p, &dir, &l.addr), u64::from(*at) % l.addr.len));
        }
        if crash {
            std::mem::forget(p);
        } else {
            drop(p);
        }
        for (k, (path, base), at) in &damaged {
            flip(path, base + at);
            model.remove(k);
        }
        let journal = dir.join(journal_file_name(NodeId(0)));
        // After a clean stop the file holds only its records; after a crash the space
        // allocated ahead of them follows, as zeros.
        let bytes = std::fs::read(&journal).unwrap();
        let end = crate::journal::replay(&bytes, crate::segment::LAYOUT_VERSION).unwrap().end;
        prop_assert!(crash || bytes.len() as u64 == end, "{} bytes, records end at {}", bytes.len(), end);
        prop_assert!(bytes[end as usize..].iter().all(|&b| b == 0));
        if torn {
            // A record cut short by the crash: the first bytes of the last write, where it
            // began.
            let f = std::fs::OpenOptions::new().write(true).open(&journal).unwrap();
            f.write_all_at(&[1, 2, 3], end).unwrap();
        }

        let p = Pool::new(&cfg(&dir), [2; 16]).unwrap();
        let r = p.recovery().clone();
        prop_assert_eq!(&r.unreadable, &None);
        prop_assert_eq!(r.recovered, model.len() as u64, "{:?}", r);
        prop_assert_eq!(r.dropped_checksum, damaged.len() as u64);
        prop_assert_eq!(r.torn_tail, if torn { 3 } else { 0 });
        prop_assert_eq!(p.lookup(0, b"pending", 0, 0).unwrap(), None);
        for ns in 0..2u32 {
            for key in 0..24u8 {
                let got = p.get(ns, &[key], 0).ok();
                let want = model.get(&(ns, key));
                prop_assert_eq!(got.as_ref(), want.map(|m| &m.0), "ns {} key {}", ns, key);
                if let Some((_, pin)) = want {
                    prop_assert_eq!(p.provenance(ns, &[key]).unwrap().unwrap().1, *pin);
                }
            }
        }
        // And the life after that recovers the same again (its own journal is complete).
        drop(p);
        let p = Pool::new(&cfg(&dir), [3; 16]).unwrap();
        prop_assert_eq!(p.recovery().recovered, model.len() as u64);
        drop(p);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn an_unknown_journal_version_starts_empty_and_says_why() {
    let dir = test_dir("version");
    let p = Pool::new(&cfg(&dir), [1; 16]).unwrap();
    p.put(0, b"k", b"v", false, 0).unwrap();
    drop(p);
    let journal = dir.join(journal_file_name(NodeId(0)));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .unwrap();
    f.seek(SeekFrom::Start(8)).unwrap();
    f.write_all(&99u32.to_le_bytes()).unwrap();
    drop(f);
    let p = Pool::new(&cfg(&dir), [2; 16]).unwrap();
    let why = p.recovery().unreadable.clone().expect("refused");
    assert!(why.contains("version 99"), "{why}");
    assert_eq!(p.recovery().recovered, 0);
    assert!(p.get(0, b"k", 0).is_err());
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn objects_of_a_namespace_no_longer_configured_are_dropped() {
    let dir = test_dir("namespace");
    let p = Pool::new(&cfg(&dir), [1; 16]).unwrap();
    p.put(0, b"a", b"kept", false, 0).unwrap();
    p.put(1, b"b", b"dropped", false, 0).unwrap();
    drop(p);
    let only_default = PoolConfig {
        namespaces: vec![NamespaceConfig::unlimited(DEFAULT_NAMESPACE)],
        ..cfg(&dir)
    };
    let p = Pool::new(&only_default, [2; 16]).unwrap();
    assert_eq!(p.recovery().recovered, 1);
    assert_eq!(p.recovery().dropped_namespace, 1);
    assert_eq!(p.get(0, b"a", 0).unwrap(), b"kept");
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_long_journal_is_compacted_and_still_recovers() {
    let dir = test_dir("compact");
    let p = Pool::new(&cfg(&dir), [1; 16]).unwrap();
    // Far more records than live objects: one key rewritten over and over.
    for i in 0..70_000u32 {
        p.put(0, b"hot", &i.to_le_bytes(), false, 0).unwrap();
    }
    p.put(1, b"cold", b"still here", true, 0).unwrap();
    // Compactions run on a thread of their own; the file is exact whenever it is read, but
    // the next pool must not start before one under way has renamed its file into place.
    p.settle_journal();
    // About 5.5 MB of records were written. The file is larger than its records by the space
    // allocated ahead of them, which depends on when the last compaction ran: the records are
    // what is measured.
    let st = p.journal_stats().unwrap();
    assert!(
        st.compactions >= 1 && st.bytes < 4 << 20,
        "compacted: {st:?}"
    );
    std::mem::forget(p);
    let p = Pool::new(&cfg(&dir), [2; 16]).unwrap();
    assert_eq!(p.recovery().recovered, 2);
    assert_eq!(p.get(0, b"hot", 0).unwrap(), 69_999u32.to_le_bytes());
    assert_eq!(p.get(1, b"cold", 0).unwrap(), b"still here");
    assert!(p.provenance(1, b"cold").unwrap().unwrap().1);
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A namespace gains a segment of its own across a restart: its objects move into it, the
/// others' stay in the common ones; when it loses it again, the file it leaves is removed and
/// its objects come back into the common segments.
#[test]
fn objects_follow_their_namespace_into_and_out_of_its_own_segment() {
    let dir = test_dir("own-segment");
    let own = |own_segment| PoolConfig {
        namespaces: vec![
            NamespaceConfig::unlimited(DEFAULT_NAMESPACE),
            NamespaceConfig {
                quota_bytes: Some(1 << 20),
                own_segment,
                ..NamespaceConfig::unlimited("other")
            },
        ],
        ..cfg(&dir)
    };
    let files = || {
        let mut f: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".kvp"))
            .collect();
        f.sort();
        f
    };
    let put_all = |p: &Pool| {
        for ns in [0, 1] {
            p.put(ns, b"k", &value(ns, 100_000), false, 0).unwrap();
        }
    };
    let check = |p: &Pool, other_segment: Option<u32>| {
        for ns in [0, 1] {
            assert_eq!(p.get(ns, b"k", 1).unwrap(), value(ns, 100_000), "ns {ns}");
            let at = p.lookup(ns, b"k", 0, 1).unwrap().unwrap().addr;
            let want = if ns == 1 { other_segment } else { None };
            assert_eq!(p.segment_owner(at.segment).map(|_| at.segment), want);
        }
    };
    drop({
        let p = Pool::new(&own(false), [1; 16]).unwrap();
        put_all(&p);
        p
    });
    assert_eq!(
        files(),
        [
            segment_file_name(NodeId(0), 0),
            segment_file_name(NodeId(0), 1)
        ]
    );
    drop({
        let p = Pool::new(&own(true), [2; 16]).unwrap();
        assert_eq!(p.recovery().recovered, 2);
        check(&p, Some(2));
        p
    });
    assert_eq!(files().len(), 3);
    let p = Pool::new(&own(false), [3; 16]).unwrap();
    assert_eq!(p.recovery().recovered, 2);
    check(&p, None);
    assert_eq!(files().len(), 2, "the own segment's file is gone");
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_clean_stop_keeps_the_eviction_order_and_a_crash_keeps_commit_order() {
    let hottest = |p: &Pool| p.unpinned_objects(0, |_| true).unwrap()[0].key.clone();
    for clean in [true, false] {
        let dir = test_dir("recency");
        let p = Pool::new(&cfg(&dir), [1; 16]).unwrap();
        for k in [b"a", b"b", b"c"] {
            p.put(0, k, b"v", false, 0).unwrap();
        }
        p.get(0, b"a", 0).unwrap();
        assert_eq!(hottest(&p), b"a");
        if clean {
            assert_eq!(p.save_recency(&dir).unwrap(), 3);
        }
        drop(p);
        let p = Pool::new(&cfg(&dir), [2; 16]).unwrap();
        assert_eq!(p.recovery().recovered, 3);
        let want: &[u8] = if clean { b"a" } else { b"c" };
        assert_eq!(hottest(&p), want, "clean stop: {clean}");
        assert!(
            !dir.join(crate::pool::recency_file_name(NodeId(0))).exists(),
            "read once"
        );
        drop(p);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
