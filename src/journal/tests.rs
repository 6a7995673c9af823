//! The journal against a model: records written, replayed, compacted while appends go on.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::compaction::COMPACT_SLACK;
use super::*;
use crate::addr::NodeId;

/// A fresh directory, unique to this call.
fn dir(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("kvpool-journal-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn commit(generation: u64, key: &[u8]) -> Record<'_> {
    Record {
        ns: 0,
        segment: 1,
        offset: generation * 64,
        len: 64,
        checksum: generation ^ 0x5a5a,
        generation,
        pinned: false,
        depth: 0,
        key,
    }
}

/// Records written through the mapping are in the file at once (a reader sees them while
/// the journal is open, as after a kill), across many times the first reservation; the
/// zeros allocated ahead are neither records nor a torn tail; a clean drop cuts them off.
#[test]
fn records_go_through_the_mapping_and_the_space_ahead_is_zeros() {
    let d = dir("append");
    let mut j = Journal::create(&d, NodeId(3), 7, &["default".to_string()]).unwrap();
    let path = d.join(journal_file_name(NodeId(3)));
    let n = 40_000u64; // about 2.4 MB of records: the file is reserved again several times
    for g in 1..=n {
        j.commit(&commit(g, format!("key-{g}").as_bytes()));
        if g % 3 == 0 {
            j.gone(g);
        }
    }
    assert!(j.healthy());
    let bytes = std::fs::read(&path).unwrap();
    let r = replay(&bytes, 7).unwrap();
    assert_eq!(r.node, 3);
    assert_eq!(r.objects.len() as u64, n - n / 3);
    assert_eq!(r.torn_tail, 0);
    assert!(
        bytes.len() as u64 > r.end,
        "space allocated ahead of the records"
    );
    assert!(bytes[r.end as usize..].iter().all(|&b| b == 0));
    let last = r.objects.last().unwrap();
    assert_eq!(
        (last.generation, last.key.clone()),
        (n, format!("key-{n}").into_bytes())
    );

    // A record cut short where the next write began is a torn tail of its own length.
    let mut torn = bytes.clone();
    torn[r.end as usize..r.end as usize + 5].copy_from_slice(&[9, 0, 0, 0, 1]);
    let t = replay(&torn, 7).unwrap();
    assert_eq!(
        (t.torn_tail, t.end, t.objects.len()),
        (5, r.end, r.objects.len())
    );

    drop(j);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        r.end,
        "a clean stop keeps only the records"
    );
    let again = replay(&std::fs::read(&path).unwrap(), 7).unwrap();
    assert_eq!(again, r);
    let _ = std::fs::remove_dir_all(&d);
}

/// What a journal file replays to, by generation.
fn live(path: &Path) -> BTreeMap<u64, Committed> {
    let r = replay(&std::fs::read(path).unwrap(), 7).unwrap();
    assert_eq!(r.torn_tail, 0);
    r.objects.into_iter().map(|c| (c.generation, c)).collect()
}

#[derive(Clone, Debug)]
enum Step {
    /// Commit a new generation under key `k`, replacing the live one of that key if any
    /// (its "gone" follows, as the pool writes it).
    Put(u8),
    /// The live object of key `k` goes.
    Remove(u8),
    /// Pin or unpin the live object of key `k`.
    Pin(u8, bool),
    /// Start a compaction (if none is under way) and build it now.
    Begin,
    /// Finish the compaction built, if any.
    Finish,
    /// Close the journal (as the pool's drop does) before the next finish.
    Close,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u8..12).prop_map(Step::Put),
        2 => (0u8..12).prop_map(Step::Remove),
        1 => (0u8..12, any::<bool>()).prop_map(|(k, p)| Step::Pin(k, p)),
        1 => Just(Step::Begin),
        1 => Just(Step::Finish),
        1 => Just(Step::Close),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// However compactions interleave with appends (records appended while one is built
    /// are carried over verbatim), the file always replays to exactly the objects the
    /// records describe, and a compaction that finishes after a close changes nothing.
    #[test]
    fn compaction_keeps_exactly_the_live_objects(steps in prop::collection::vec(step(), 1..120)) {
        let d = dir("model");
        let path = d.join(journal_file_name(NodeId(0)));
        let mut j = Journal::create(&d, NodeId(0), 7, &["default".to_string()]).unwrap();
        // key -> live object
        let mut model: BTreeMap<u8, Committed> = BTreeMap::new();
        let mut built: Option<io::Result<Built>> = None;
        let mut generation = 0u64;
        let mut closed_before_finish = false;
        for s in &steps {
            match *s {
                Step::Put(k) => {
                    generation += 1;
                    let c = Committed {
                        ns: 0,
                        segment: 0,
                        offset: generation * 64,
                        len: 64,
                        checksum: generation ^ 0x77,
                        generation,
                        pinned: false,
                        depth: 0,
                        key: vec![k; 1 + k as usize],
                    };
                    j.commit(&c.record());
                    if let Some(old) = model.insert(k, c) {
                        j.gone(old.generation);
                    }
                }
                Step::Remove(k) => {
                    if let Some(old) = model.remove(&k) {
                        j.gone(old.generation);
                    }
                }
                Step::Pin(k, p) => {
                    if let Some(c) = model.get_mut(&k) {
                        c.pinned = p;
                        j.pin(c.generation, p);
                    }
                }
                Step::Begin => {
                    if built.is_none() {
                        if let Some(c) = j.start_compaction() {
                            built = Some(c.build());
                        }
                    }
                }
                Step::Finish => {
                    if let Some(b) = built.take() {
                        drop(j.finish(b));
                        prop_assert!(!d.join("journal-0.kvj.compact").exists());
                    }
                }
                Step::Close => {
                    if built.is_some() {
                        j.closed = true;
                        closed_before_finish = true;
                        let before = std::fs::read(&path).unwrap();
                        drop(j.finish(built.take().unwrap()));
                        prop_assert_eq!(std::fs::read(&path).unwrap(), before);
                        prop_assert!(!d.join("journal-0.kvj.compact").exists());
                        break;
                    }
                }
            }
            prop_assert!(j.healthy());
            let want: BTreeMap<u64, Committed> =
                model.values().map(|c| (c.generation, c.clone())).collect();
            prop_assert_eq!(live(&path), want);
        }
        if !closed_before_finish {
            if let Some(b) = built.take() {
                drop(j.finish(b));
            }
        }
        drop(j);
        let want: BTreeMap<u64, Committed> =
            model.values().map(|c| (c.generation, c.clone())).collect();
        prop_assert_eq!(live(&path), want);
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// A compaction shrinks the file to one commit per live object plus what was appended
/// while it was built, and the journal goes on appending to the new file. A compaction's
/// file left by a crash is removed at the next start.
#[test]
fn a_compaction_carries_over_the_records_appended_while_it_was_built() {
    let d = dir("carry");
    let path = d.join(journal_file_name(NodeId(0)));
    // What a crash in the middle of a compaction leaves goes at the next start.
    std::fs::write(d.join("journal-0.kvj.compact"), b"half a compaction").unwrap();
    let mut j = Journal::create(&d, NodeId(0), 7, &["default".to_string()]).unwrap();
    assert!(!d.join("journal-0.kvj.compact").exists());
    for g in 1..=10_000u64 {
        j.commit(&commit(g, b"hot"));
        if g > 1 {
            j.gone(g - 1);
        }
    }
    let long = replay(&std::fs::read(&path).unwrap(), 7).unwrap().end;
    let c = j.start_compaction().unwrap();
    assert!(j.start_compaction().is_none(), "one at a time");
    let built = c.build();
    // Meanwhile: the hot key is replaced twice and a pinned one arrives.
    j.commit(&commit(10_001, b"hot"));
    j.gone(10_000);
    j.commit(&commit(10_002, b"hot"));
    j.gone(10_001);
    j.commit(&Record {
        pinned: true,
        ..commit(10_003, b"cold")
    });
    drop(j.finish(built));
    let r = replay(&std::fs::read(&path).unwrap(), 7).unwrap();
    assert!(r.end < long / 100, "{} bytes from {long}", r.end);
    let got: Vec<(u64, bool)> = r.objects.iter().map(|c| (c.generation, c.pinned)).collect();
    assert_eq!(got, [(10_002, false), (10_003, true)]);
    j.gone(10_003);
    drop(j);
    let r = replay(&std::fs::read(&path).unwrap(), 7).unwrap();
    assert_eq!(r.objects.len(), 1);
    assert_eq!(r.end, std::fs::metadata(&path).unwrap().len());
    let _ = std::fs::remove_dir_all(&d);
}

/// A compaction that cannot be written (here its file's name is taken by a directory, as
/// a full disk would refuse it) keeps the journal as it is, healthy and complete, and is
/// tried again only after another slack's worth of records; then it goes through.
#[test]
fn a_compaction_that_cannot_be_written_keeps_the_journal_and_is_retried() {
    let d = dir("retry");
    let path = d.join(journal_file_name(NodeId(0)));
    let blocker = d.join("journal-0.kvj.compact");
    let mut j = Journal::create(&d, NodeId(0), 7, &["default".to_string()]).unwrap();
    std::fs::create_dir(&blocker).unwrap();
    // One key overwritten again and again: generation g replaces g - 1.
    fn put(j: &mut Journal, g: &mut u64) {
        *g += 1;
        j.commit(&commit(*g, b"hot"));
        if *g > 1 {
            j.gone(*g - 1);
        }
    }
    let mut g = 0u64;
    let c = loop {
        put(&mut j, &mut g);
        if let Some(c) = j.compaction_due() {
            break c;
        }
    };
    let built = c.build();
    assert!(built.is_err(), "its file's name is taken");
    drop(j.finish(built));
    assert!(j.healthy(), "kept");
    let st = j.stats();
    assert_eq!((st.compactions, st.compaction_failures), (0, 1));
    let r = replay(&std::fs::read(&path).unwrap(), 7).unwrap();
    assert_eq!((r.objects.len(), r.objects[0].generation), (1, g));
    let failed_at = j.records;
    // Not tried again at once, but after another slack's worth of records.
    std::fs::remove_dir(&blocker).unwrap();
    let c = loop {
        put(&mut j, &mut g);
        if let Some(c) = j.compaction_due() {
            break c;
        }
    };
    assert!(j.records >= failed_at + COMPACT_SLACK);
    drop(j.finish(c.build()));
    let r = replay(&std::fs::read(&path).unwrap(), 7).unwrap();
    assert_eq!((r.objects.len(), r.objects[0].generation), (1, g));
    assert!(r.end < 1000, "compacted to {} bytes", r.end);
    let st = j.stats();
    assert_eq!(
        (
            st.healthy,
            st.bytes,
            st.records,
            st.compactions,
            st.compaction_failures
        ),
        (true, r.end, 1, 1, 1)
    );
    drop(j);
    let _ = std::fs::remove_dir_all(&d);
}

/// Through [`SharedJournal`], compactions start by themselves on another thread while
/// writers on several threads keep appending; the file ends up short and exact.
#[test]
fn shared_journal_compacts_behind_concurrent_writers() {
    let d = dir("shared");
    let path = d.join(journal_file_name(NodeId(0)));
    let j =
        SharedJournal::new(Journal::create(&d, NodeId(0), 7, &["default".to_string()]).unwrap());
    let threads = 4u64;
    let per = 60_000u64;
    std::thread::scope(|s| {
        for t in 0..threads {
            let j = &j;
            s.spawn(move || {
                let key = t.to_le_bytes();
                for i in 0..per {
                    let g = 1 + t + i * threads;
                    j.with(|j| j.commit(&commit(g, &key)));
                    if i > 0 {
                        j.with(|j| j.gone(g - threads));
                    }
                }
            });
        }
    });
    j.settle();
    let written = threads * per * 2 * 50;
    let r = replay(&std::fs::read(&path).unwrap(), 7).unwrap();
    assert!(
        r.end < written / 2,
        "compacted: {} of {written} bytes",
        r.end
    );
    let mut got: Vec<u64> = r.objects.iter().map(|c| c.generation).collect();
    got.sort_unstable();
    let want: Vec<u64> = (0..threads).map(|t| 1 + t + (per - 1) * threads).collect();
    assert_eq!(got, want);
    drop(j);
    assert!(!d.join("journal-0.kvj.compact").exists());
    let _ = std::fs::remove_dir_all(&d);
}

/// Records held back during a recovery reach the file through the mapping in one go.
#[test]
fn held_records_are_written_on_release() {
    let d = dir("hold");
    let mut j = Journal::create(&d, NodeId(0), 7, &["default".to_string()]).unwrap();
    let path = d.join(journal_file_name(NodeId(0)));
    j.hold();
    for g in 1..=100u64 {
        j.commit(&commit(g, &g.to_le_bytes()));
    }
    assert!(replay(&std::fs::read(&path).unwrap(), 7)
        .unwrap()
        .objects
        .is_empty());
    j.release();
    j.pin(5, true);
    let r = replay(&std::fs::read(&path).unwrap(), 7).unwrap();
    assert_eq!(r.objects.len(), 100);
    assert!(r.objects[4].pinned);
    drop(j);
    let _ = std::fs::remove_dir_all(&d);
}
