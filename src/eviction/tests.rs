use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn ins(fp: u64) -> Insert {
    Insert {
        fingerprint: fp,
        depth: 0,
        tick: 0,
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Insert into shard `n` (modulo the shards).
    Insert(usize),
    Access(usize),
    Remove(usize),
    /// Victim from shard `shard`, with objects whose handle is divisible by `refuse` refused,
    /// below `bound` (a tick; none when `None`).
    Victim {
        shard: usize,
        refuse: u32,
        bound: Option<u64>,
    },
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(
        prop_oneof![
            3 => (0usize..4).prop_map(Op::Insert),
            2 => (0usize..64).prop_map(Op::Access),
            1 => (0usize..64).prop_map(Op::Remove),
            2 => (0usize..4, 2u32..6, proptest::option::of(0u64..400))
                .prop_map(|(shard, refuse, bound)| Op::Victim { shard, refuse, bound }),
        ],
        1..400,
    )
}

proptest! {
    /// Every policy, alone or split over shards that share its state, holds exactly the objects
    /// inserted and not yet removed or evicted, never evicts what it was told it may not, and
    /// never hands out an object twice.
    #[test]
    fn policies_track_exactly_their_objects(ops in ops(), which in 0usize..PolicyKind::ALL.len(), n in 1usize..4) {
        let mut p = PolicyKind::ALL[which].build_shards(n);
        // Per shard: live handles, free handles, next new handle.
        let mut live: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); n];
        let mut free: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut next = vec![0u32; n];
        let mut tick = 0u64;
        let pick = |live: &[BTreeSet<u32>], i: usize| {
            let all: Vec<(usize, u32)> = live
                .iter()
                .enumerate()
                .flat_map(|(s, l)| l.iter().map(move |&h| (s, h)))
                .collect();
            (!all.is_empty()).then(|| all[i % all.len()])
        };
        for op in ops {
            tick += 1;
            match op {
                Op::Insert(s) => {
                    let s = s % n;
                    let h = free[s].pop().unwrap_or_else(|| { next[s] += 1; next[s] - 1 });
                    p[s].insert(h, Insert { fingerprint: h as u64 * 31 % 7, depth: h % 5, tick });
                    live[s].insert(h);
                }
                Op::Access(i) => {
                    if let Some((s, h)) = pick(&live, i) {
                        p[s].access(h, tick);
                    }
                }
                Op::Remove(i) => {
                    if let Some((s, h)) = pick(&live, i) {
                        p[s].remove(h);
                        live[s].remove(&h);
                        free[s].push(h);
                    }
                }
                Op::Victim { shard, refuse, bound } => {
                    let s = shard % n;
                    let mut ok = |h: u32| h % refuse != 0;
                    let v = match bound {
                        Some(b) => p[s].victim_below(&mut ok, tick, b),
                        None => p[s].victim(&mut ok, tick),
                    };
                    if let Some(h) = v {
                        prop_assert!(h % refuse != 0, "evicted a protected object");
                        prop_assert!(live[s].remove(&h), "evicted an object it did not hold");
                        free[s].push(h);
                    } else if bound.is_none() {
                        // Nothing evictable within the scan budget: there may be evictable
                        // objects beyond it, but not among few objects.
                        let l = &live[s];
                        prop_assert!(l.len() > SCAN || l.iter().all(|h| h % refuse == 0), "{l:?}");
                    }
                }
            }
            for s in 0..n {
                prop_assert_eq!(p[s].len(), live[s].len());
            }
        }
        // Drain: everything comes out exactly once.
        for s in 0..n {
            let mut out = BTreeSet::new();
            while let Some(h) = p[s].victim(&mut |_| true, tick) {
                prop_assert!(out.insert(h));
            }
            prop_assert_eq!(&out, &live[s]);
        }
    }
}

#[test]
fn lru_evicts_least_recent_and_skips_protected() {
    let mut p = Lru::default();
    for h in 0..4 {
        p.insert(h, ins(h as u64));
    }
    p.access(0, 9);
    assert_eq!(p.victim(&mut |_| true, 0), Some(1));
    assert_eq!(p.victim(&mut |h| h != 2, 0), Some(3));
    assert_eq!(
        p.victim(&mut |_| true, 0),
        Some(0),
        "2 was moved to the hot end when skipped"
    );
    assert_eq!(p.victim(&mut |_| false, 0), None);
    assert_eq!(p.len(), 1);
}

#[test]
fn prefix_aware_shrinks_chains_from_their_end() {
    let mut p = PrefixAware::default();
    // A chain of 4 blocks, touched head first like a request does.
    for h in 0..4 {
        p.insert(
            h,
            Insert {
                fingerprint: h as u64,
                depth: h,
                tick: h as u64,
            },
        );
    }
    assert_eq!(p.victim(&mut |_| true, 0), Some(3));
    assert_eq!(p.victim(&mut |_| true, 0), Some(2));
    let mut lru = Lru::default();
    for h in 0..4 {
        lru.insert(h, ins(h as u64));
    }
    assert_eq!(
        lru.victim(&mut |_| true, 0),
        Some(0),
        "plain LRU loses the head, killing the chain"
    );
}

#[test]
fn s3fifo_resists_scans() {
    // 100 objects read over and over, then a scan of 10 000 objects seen once: the hot set
    // survives in the main FIFO while the scan churns through the small one.
    let mut p = S3Fifo::default();
    let capacity = 200;
    let mut resident = BTreeSet::new();
    let mut next = 0u32;
    let mut handle_of = std::collections::HashMap::new();
    let mut touch = |p: &mut S3Fifo, key: u64, resident: &mut BTreeSet<u32>| {
        if let Some(&h) = handle_of.get(&key) {
            if resident.contains(&h) {
                p.access(h, 0);
                return;
            }
        }
        if resident.len() >= capacity {
            let v = p.victim(&mut |_| true, 0).unwrap();
            resident.remove(&v);
        }
        let h = next;
        next += 1;
        handle_of.insert(key, h);
        p.insert(h, ins(key));
        resident.insert(h);
    };
    for _ in 0..5 {
        for k in 0..100 {
            touch(&mut p, k, &mut resident);
        }
    }
    for k in 1000..11_000 {
        touch(&mut p, k, &mut resident);
    }
    let hot_left = (0..100u64)
        .filter(|k| resident.contains(&handle_of[k]))
        .count();
    assert!(
        hot_left >= 90,
        "only {hot_left} of the hot set survived the scan"
    );
}

/// A run of reused objects at the small FIFO's head longer than a scan's budget: `s3fifo-lru`
/// evicts main's least recently used object, never one of them (S3-FIFO would promote them all
/// before evicting anything from small).
#[test]
fn s3fifo_lru_never_evicts_a_reused_object_when_its_budget_runs_out() {
    let mut p = PolicyKind::S3FifoLru.build();
    let mut always = |_| true;
    let mut tick = 0;
    let insert = |p: &mut Box<dyn Eviction>, h: u32, tick: &mut u64| {
        *tick += 1;
        let mut info = ins(u64::from(h) << 20);
        info.tick = *tick;
        p.insert(h, info);
    };
    for h in 0..100 {
        insert(&mut p, h, &mut tick);
    }
    // 0..10 reused: the first eviction promotes them to main and evicts 10.
    for h in 0..10 {
        tick += 1;
        p.access(h, tick);
    }
    tick += 1;
    assert_eq!(p.victim(&mut always, tick), Some(10));
    // 100..300 come in and are all read again: a run four times the scan budget.
    for h in 100..300 {
        insert(&mut p, h, &mut tick);
    }
    for h in 100..300 {
        tick += 1;
        p.access(h, tick);
    }
    let mut evicted = Vec::new();
    for _ in 0..99 {
        tick += 1;
        evicted.push(p.victim(&mut always, tick).unwrap());
    }
    // The untouched 11..100 first, in order; then main's least recent, 0..10 (promoted before
    // the run), while the run is promoted a budget at a time behind them.
    let want: Vec<u32> = (11..100).chain(0..10).collect();
    assert_eq!(evicted, want, "a reused object was evicted");
}

#[test]
fn names_round_trip() {
    for k in PolicyKind::ALL {
        assert_eq!(k.name().parse::<PolicyKind>(), Ok(k));
    }
    assert!("mru".parse::<PolicyKind>().is_err());
    assert_eq!(PolicyKind::default(), PolicyKind::S3FifoLru);
}

/// Drives one namespace split over `policies` (one per shard, keys placed by hash) the way the
/// pool does: evict from the shard whose candidate ranks first, bounded by the runner-up. Returns
/// the hits of `accesses` at `capacity` objects.
fn sharded_hits(mut policies: Vec<Box<dyn Eviction>>, accesses: &[u64], capacity: usize) -> u64 {
    use std::collections::HashMap;
    let n = policies.len();
    let shard = |k: u64| (k.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % n;
    let mut handle: HashMap<u64, (usize, Handle)> = HashMap::new();
    let mut key: Vec<Vec<u64>> = vec![Vec::new(); n];
    let mut free: Vec<Vec<Handle>> = vec![Vec::new(); n];
    let (mut hits, mut tick) = (0, 0u64);
    for &k in accesses {
        tick += 1;
        if let Some(&(s, h)) = handle.get(&k) {
            hits += 1;
            policies[s].access(h, tick);
            continue;
        }
        while handle.len() >= capacity {
            let mut ranked: Vec<(u64, usize)> = (0..n)
                .filter_map(|s| policies[s].peek_stamp().map(|st| (st, s)))
                .collect();
            ranked.sort_unstable();
            let bound = ranked.get(1).map_or(u64::MAX, |r| r.0);
            let s = ranked[0].1;
            tick += 1;
            if let Some(v) = policies[s].victim_below(&mut |_| true, tick, bound) {
                handle.remove(&key[s][v as usize]);
                free[s].push(v);
            }
        }
        let s = shard(k);
        let h = free[s].pop().unwrap_or(key[s].len() as Handle);
        if h as usize == key[s].len() {
            key[s].push(k);
        } else {
            key[s][h as usize] = k;
        }
        handle.insert(k, (s, h));
        policies[s].insert(
            h,
            Insert {
                fingerprint: k.wrapping_mul(0xff51_afd7_ed55_8ccd),
                depth: 0,
                tick,
            },
        );
    }
    hits
}

/// A deterministic pseudo-random stream (xorshift64) for the workloads below.
fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// A workload where S3-FIFO's adaptation matters: a skewed hot set that recurs after a delay
/// (so the ghost lists see it come back), mixed with keys seen once.
fn recurring_with_one_offs() -> Vec<u64> {
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    let mut out = Vec::new();
    let mut fresh = 1_000_000u64;
    for _ in 0..60_000 {
        let r = next();
        if r % 3 == 0 {
            fresh += 1;
            out.push(fresh);
        } else {
            // Squaring a uniform draw skews towards small keys: 0..3000, the hottest first.
            let u = (r >> 11) as f64 / (1u64 << 53) as f64;
            out.push((u * u * 3000.0) as u64);
        }
    }
    out
}

#[test]
fn sharded_s3fifo_adapts_as_one_policy() {
    for kind in [PolicyKind::S3Fifo, PolicyKind::S3FifoLru] {
        sharded_adapts_as_one_policy(kind);
    }
}

fn sharded_adapts_as_one_policy(kind: PolicyKind) {
    let accesses = recurring_with_one_offs();
    let capacity = 400;
    let one = sharded_hits(vec![kind.build()], &accesses, capacity);
    let shared = sharded_hits(kind.build_shards(32), &accesses, capacity);
    let alone = sharded_hits((0..32).map(|_| kind.build()).collect(), &accesses, capacity);
    let lru = sharded_hits(vec![PolicyKind::Lru.build()], &accesses, capacity);
    println!("{kind}: one {one} shared {shared} alone {alone} lru {lru}");
    let tolerance = accesses.len() as u64 / 200;
    assert!(
        shared.abs_diff(one) <= tolerance,
        "{kind}: 32 shards sharing their state hit {shared}, one policy {one}"
    );
    // What the sharing is for: the same shards adapting alone do measurably worse.
    assert!(
        alone + tolerance < one,
        "{kind}: 32 shards adapting alone hit {alone}, one policy {one}: the workload no longer shows the sharing"
    );
    assert!(one > lru, "{kind} {one} vs lru {lru}");
}

/// Conversations, as a chat server sends them: each turn rereads the whole conversation (a shared
/// system prompt, then every earlier turn) and appends 3 new blocks; a conversation ends after 1
/// to 12 turns and a new one opens. Every block is reread many times, then never again.
fn conversations(open: usize, turns: usize) -> Vec<u64> {
    /// A new conversation: one of 10 system prompts of 4 blocks (keys 0..40, the lowest the
    /// likeliest), and how many turns it will last.
    fn start(next: &mut impl FnMut() -> u64) -> (Vec<u64>, u64) {
        let p = (next() % 10).min(next() % 10);
        ((p * 4..p * 4 + 4).collect(), 1 + next() % 12)
    }
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut fresh = 1_000u64;
    let mut convs: Vec<(Vec<u64>, u64)> = (0..open).map(|_| start(&mut next)).collect();
    let mut out = Vec::new();
    for _ in 0..turns {
        let i = (next() % open as u64) as usize;
        out.extend_from_slice(&convs[i].0);
        for _ in 0..3 {
            fresh += 1;
            convs[i].0.push(fresh);
            out.push(fresh);
        }
        convs[i].1 -= 1;
        if convs[i].1 == 0 {
            convs[i] = start(&mut next);
        }
    }
    out
}

#[test]
fn s3fifo_lru_keeps_up_with_lru_on_conversations() {
    // Where recency is all there is to know, the paper's main FIFO keeps finished conversations
    // for extra rounds (their blocks have the highest counts) and falls behind LRU; in recency
    // order main drops them when LRU would.
    let accesses = conversations(40, 20_000);
    let capacity = 900;
    let hits = |k: PolicyKind| sharded_hits(vec![k.build()], &accesses, capacity);
    let (lru, clock, recency) = (
        hits(PolicyKind::Lru),
        hits(PolicyKind::S3Fifo),
        hits(PolicyKind::S3FifoLru),
    );
    println!(
        "lru {lru} s3fifo {clock} s3fifo-lru {recency} of {}",
        accesses.len()
    );
    let point = accesses.len() as u64 / 100;
    assert!(
        recency + point >= lru,
        "s3fifo-lru {recency} fell behind lru {lru}"
    );
    assert!(
        clock + point < lru,
        "s3fifo {clock} no longer falls behind lru {lru}: the workload doesn't show the difference"
    );
}

#[test]
fn hit_density_recognises_a_returning_prefix() {
    // A block evicted after 5 references comes back: the ghost history gives it its count
    // again, so it ranks with the popular blocks, not with the one-offs inserted beside it.
    let cfg = DensityConfig::default();
    let mut p = Density::new(cfg);
    p.insert(0, ins(7));
    for t in 1..5 {
        p.access(0, t);
    }
    assert_eq!(p.victim(&mut |_| true, 5), Some(0));
    p.insert(0, ins(7));
    assert_eq!(p.ghost_refs(0), Some(6));
    p.insert(1, ins(8));
    assert_eq!(
        p.ghost_refs(1),
        Some(1),
        "a new fingerprint starts at one reference"
    );
    let mut off = Density::new(DensityConfig {
        ghost: false,
        ..cfg
    });
    off.insert(0, ins(7));
    assert_eq!(off.victim(&mut |_| true, 1), Some(0));
    off.insert(0, ins(7));
    assert_eq!(off.ghost_refs(0), Some(1), "no ghost: forgotten");
}

#[test]
fn hit_density_bounds_its_ghost_history() {
    // 100 blocks held, 100 000 evicted: the history keeps at most ghost_factor x 100.
    let mut p = Density::default();
    for h in 0..100 {
        p.insert(h, ins(h as u64));
    }
    for k in 100..100_100u64 {
        let v = p.victim(&mut |_| true, k).unwrap();
        p.insert(v, ins(k));
    }
    assert_eq!(p.len(), 100);
    assert!(p.ghost_len() <= 8 * 100, "{} ghosts", p.ghost_len());
}

#[test]
fn hit_density_keeps_reused_blocks_over_one_offs() {
    // 40 blocks reread in turn, one between every two blocks seen once, in a cache of 60: each
    // hot block comes back after 79 other blocks, so LRU never keeps one; hit density learns
    // from the few that random sampling spares (and the ghost history, which gives a returning
    // block its count back) that rereads are worth their place.
    let mut accesses = Vec::new();
    let mut fresh = 1_000u64;
    for i in 0..40_000u64 {
        if i % 2 == 0 {
            accesses.push(i / 2 % 40);
        } else {
            fresh += 1;
            accesses.push(fresh);
        }
    }
    let hits = |k: PolicyKind| sharded_hits(vec![k.build()], &accesses, 60);
    let (lru, density) = (hits(PolicyKind::Lru), hits(PolicyKind::HitDensity));
    println!("lru {lru} hit-density {density} of {}", accesses.len());
    assert!(density > lru + 2_000, "hit-density {density} vs lru {lru}");
}
