//! Memory per object of the index: a `kvpool::Pool` (anonymous memory, normal pages) filled
//! with small objects (16-byte keys unless `--index-key-len` says otherwise, 1-byte values), its heap growth counted exactly by the
//! counting global allocator; the reference is the heap of a bare `HashMap<Box<[u8]>, [u64; 6]>`
//! (same keys, a 48-byte value like an index entry) for as many keys, in the same run.

use std::collections::HashMap;
use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvpool::pool::{PoolConfig, DEFAULT_NAMESPACE};
use kvpool::segment::{Backing, HugePages};
use kvpool::{checksum, Commit, Pool};

use super::machine::{meminfo_kib, rss_bytes};
use super::report::{Ref, Report, Row};
use super::{Ctx, Section};
use crate::heap::live_bytes;

/// Segment size; as many segments as the objects need.
const SEGMENT: u64 = 1 << 30;
/// Bytes of segment one small object takes (one 512-byte granule), for sizing the segments.
const SEGMENT_PER_OBJECT: u64 = 512;
/// Rough memory per object with 16-byte keys, for sizing: index heap and version word, then
/// the reference map; each longer key adds its excess twice (pool and map).
const ESTIMATE_PER_OBJECT: u64 = 400;

/// Fills a pool, measures, then fills the reference map with as many keys.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let n = objects_that_fit(ctx);
    let key_len = usize::from(ctx.args.index_key_len);
    let budget = Duration::from_millis(ctx.args.index_budget_ms);
    let segments = (n * SEGMENT_PER_OBJECT).div_ceil(SEGMENT) as u32 + 1;
    let cfg = pool_config(segments);
    // The reference first, while the heap is fresh (it is as fast as it gets then).
    let t = Instant::now();
    let reference = map_heap_per_object(n, key_len);
    eprintln!(
        "  reference map for {n} keys allocated in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // Hand the reference's freed pages back to the OS, so the pool's RSS growth is its own.
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    let heap_empty = live_bytes();
    let pool = Pool::new(&cfg, [7; 16]).context("creating the pool")?;
    let fixed = live_bytes().saturating_sub(heap_empty);
    let ns = pool
        .namespace_id(DEFAULT_NAMESPACE)
        .context("default namespace")?;
    let filled = fill(&pool, ns, n, key_len, budget)?;
    let lookups = lookup_rates(&pool, ns, filled.inserted, key_len)?;
    // Freeing ten million entries one by one takes seconds, and nothing is measured after
    // this: let a background thread do it (the process may exit first; the OS takes it all).
    std::thread::spawn(move || drop(pool));
    if filled.inserted < n {
        let msg = format!(
            "stopped at {} of {n} objects after the {} s budget (--index-budget-ms)",
            filled.inserted,
            budget.as_secs()
        );
        ctx.report.note(Section::Index, msg);
    }

    let reference = if filled.inserted == n {
        reference
    } else {
        map_heap_per_object(filled.inserted, key_len)
    };
    push_rows(&mut ctx.report, &filled, reference, lookups);
    ctx.report
        .note(Section::Index, method_note(key_len, segments, fixed));
    Ok(())
}

/// The objects to insert: `--index-objects`, or fewer when the memory available would not
/// hold them and their reference (a note says so).
fn objects_that_fit(ctx: &mut Ctx) -> u64 {
    let n = ctx.args.index_objects.max(1);
    let key_len = usize::from(ctx.args.index_key_len);
    let Some(avail) = meminfo_kib("MemAvailable") else {
        return n;
    };
    let per_object = ESTIMATE_PER_OBJECT + 2 * key_len.saturating_sub(16) as u64;
    let fit = (avail * 1024 * 7 / 10 / per_object).max(1);
    if n <= fit {
        return n;
    }
    let msg = format!(
        "only {} MiB available: inserting {fit} objects instead of {n}",
        avail >> 10
    );
    ctx.report.note(Section::Index, msg);
    fit
}

/// The measured pool: anonymous memory, normal pages, `segments` segments of [`SEGMENT`].
fn pool_config(segments: u32) -> PoolConfig {
    PoolConfig {
        segment_size: SEGMENT,
        segments,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        prefault: false,
        ..PoolConfig::default()
    }
}

/// What filling the pool measured.
struct Filled {
    /// Objects inserted before `n` was reached or the budget ran out.
    inserted: u64,
    /// Seconds the inserts took.
    secs: f64,
    /// Heap growth per object, bytes.
    heap: f64,
    /// RSS growth per object, bytes.
    rss: f64,
}

/// Inserts objects `0..n` into `pool` (stopping early once `budget` is spent) and measures
/// the heap and RSS that grew per object.
fn fill(pool: &Pool, ns: u32, n: u64, key_len: usize, budget: Duration) -> anyhow::Result<Filled> {
    let zero = checksum(&[0]);
    let (heap0, rss0) = (live_bytes(), rss_bytes());
    let started = Instant::now();
    let mut inserted = 0u64;
    while inserted < n {
        // A two-phase put of one zero byte: the segment already holds zeros, so its data
        // pages are never written and the RSS growth is the index's own.
        let k = key(inserted, key_len);
        let addr = pool
            .alloc(ns, &k, 1, false, 0)
            .with_context(|| format!("alloc #{inserted}"))?;
        pool.commit(Commit::new(&addr, zero))
            .with_context(|| format!("commit #{inserted}"))?;
        inserted += 1;
        if inserted % (1 << 16) == 0 {
            let secs = started.elapsed().as_secs_f64();
            if inserted % (1 << 20) == 0 {
                eprint!("\r  inserted {inserted} of {n} ({secs:.0} s)");
                let _ = std::io::stderr().flush();
            }
            if started.elapsed() > budget {
                break;
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!("\r  inserted {inserted} of {n} in {secs:.1} s");
    Ok(Filled {
        inserted,
        secs,
        heap: live_bytes().saturating_sub(heap0) as f64 / inserted as f64,
        rss: rss_bytes().saturating_sub(rss0) as f64 / inserted as f64,
    })
}

/// The section's rows: the pool's heap and RSS per object against the map's `reference`
/// heap per object, the map's own row, then the lookup rates.
fn push_rows(report: &mut Report, filled: &Filled, reference: f64, lookups: Vec<(&str, f64)>) {
    let inserted = filled.inserted;
    let mut row = Row::new(Section::Index, "kvpool Pool", "heap/object");
    row.objects = Some(inserted);
    row.bytes_per_object = Some(filled.heap);
    row.ops_per_s = Some(inserted as f64 / filled.secs);
    let mut rss_row = Row::new(Section::Index, "kvpool Pool", "RSS growth/object");
    rss_row.objects = Some(inserted);
    rss_row.bytes_per_object = Some(filled.rss);
    if reference > 0.0 {
        row.refs
            .push(Ref::new("bare HashMap", filled.heap / reference));
        rss_row
            .refs
            .push(Ref::new("bare HashMap heap", filled.rss / reference));
    }
    let mut ref_row = Row::new(
        Section::Index,
        "HashMap<Box<[u8]>, [u64; 6]>",
        "heap/object",
    );
    ref_row.objects = Some(inserted);
    ref_row.bytes_per_object = Some(reference);
    report.push(row);
    report.push(rss_row);
    report.push(ref_row);
    for (op, ops_per_s) in lookups {
        let mut row = Row::new(Section::Index, "kvpool Pool", op);
        row.objects = Some(inserted);
        row.ops_per_s = Some(ops_per_s);
        report.push(row);
    }
}

/// How the section measures, for its note; `fixed` is the heap `Pool::new` took up front.
fn method_note(key_len: usize, segments: u32, fixed: usize) -> String {
    let fixed_mib = fixed as f64 / (1 << 20) as f64;
    format!(
        "{key_len}-byte keys (--index-key-len), 1-byte zero values stored with pool.alloc + pool.commit (no write, so the data \
         pages stay untouched), Backing::Anonymous, HugePages::Off, {segments} × 1 GiB segments; heap \
         bytes counted exactly by the bench's counting global allocator (requested sizes of everything \
         the pool allocates per object: entry, key, eviction links, hash table); RSS: /proc/self/statm \
         growth: the heap pages actually touched (capacity that grown tables keep in reserve is counted \
         as heap but not touched) + malloc's own overhead + the 8-byte version word per object; \
         Pool::new took {fixed_mib:.1} MiB of heap up front (allocator metadata, shards), not counted \
         per object; ops/s = alloc+commit pairs per second while filling; reference: the heap of \
         HashMap::with_capacity(n) plus n boxed keys, i.e. what a bare map of the same keys allocates; \
         lookups (one thread; ops/s = lookups per second of that thread's CPU time, {LOOKUP_MS} ms \
         of it each, in {LOOKUP_ROUNDS} interleaved rounds; keys drawn uniformly at random): `lookup hit` = \
         pool.lookup of a present key (index probe, full key compare, eviction access, signed \
         address), `lookup miss` = pool.lookup of an absent key, `exists` = pool.exists_prefix \
         of one present key (probe and compare only)"
    )
}

/// Thread CPU time each lookup rate is measured over, in milliseconds.
const LOOKUP_MS: u64 = 2000;

/// Rounds the lookup measurements are interleaved in, so a change in the machine's load
/// during the run weighs on every kind of lookup alike.
const LOOKUP_ROUNDS: u64 = 5;

/// Single-threaded lookup rates over the `n` objects of a filled pool: (op, lookups per second
/// of the looking thread's CPU time) for present keys, absent keys and presence checks, keys
/// drawn uniformly at random. CPU time, not wall time: on a shared machine a thread that is
/// descheduled half the time would otherwise look half as fast.
fn lookup_rates(
    pool: &Pool,
    ns: u32,
    n: u64,
    key_len: usize,
) -> anyhow::Result<Vec<(&'static str, f64)>> {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        // xorshift64*: cheap next to a lookup, and uniform enough to defeat the caches.
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    };
    let ops = ["lookup hit", "lookup miss", "exists"];
    let mut done = [0u64; 3];
    let mut cpu = [Duration::ZERO; 3];
    let slice = Duration::from_millis(LOOKUP_MS / LOOKUP_ROUNDS);
    for _ in 0..LOOKUP_ROUNDS {
        for (j, op) in ops.into_iter().enumerate() {
            let (started, wall) = (thread_cpu(), Instant::now());
            // Bounded in wall time too, in case the thread hardly gets a CPU.
            while thread_cpu() - started < slice && wall.elapsed() < slice * 10 {
                for _ in 0..1024 {
                    let i = next();
                    let ok = match j {
                        0 => pool.lookup(ns, &key(i, key_len), 0, 0)?.is_some(),
                        1 => pool.lookup(ns, &key(n + i, key_len), 0, 0)?.is_none(),
                        _ => pool.exists_prefix(ns, [&key(i, key_len)[..]])? == 1,
                    };
                    anyhow::ensure!(ok, "{op} of object #{i} answered wrong");
                }
                done[j] += 1024;
            }
            cpu[j] += thread_cpu() - started;
        }
    }
    let rates = ops
        .into_iter()
        .enumerate()
        .map(|(j, op)| (op, done[j] as f64 / cpu[j].as_secs_f64().max(1e-9)))
        .collect::<Vec<_>>();
    for (op, rate) in &rates {
        eprintln!("  {op}: {:.2} M per CPU second", rate / 1e6);
    }
    Ok(rates)
}

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Heap bytes per key of a bare map holding `n` of the same keys with a 48-byte value: its
/// table sized for `n` (the bucket count growth reaches too, and inserting up to that capacity
/// allocates nothing more) plus `n` boxed keys, counted by the allocator. Allocated, not
/// filled: random inserts into a table of a GiB would take as long as filling the pool.
fn map_heap_per_object(n: u64, key_len: usize) -> f64 {
    let before = live_bytes();
    let map: HashMap<Box<[u8]>, [u64; 6]> = HashMap::with_capacity(n as usize);
    let keys: Vec<Box<[u8]>> = (0..n).map(|i| Box::from(&key(i, key_len)[..])).collect();
    // The Vec holding the keys is not part of a map: leave it out.
    let holder = keys.capacity() * std::mem::size_of::<Box<[u8]>>();
    let per = live_bytes().saturating_sub(before).saturating_sub(holder) as f64 / n as f64;
    drop(std::hint::black_box((map, keys)));
    per
}

/// Shortest key length the bench makes (`idx:` and 12 digits), and the longest (the pool's).
const KEY_LENS: std::ops::RangeInclusive<usize> = 16..=kvpool::error::MAX_KEY_LEN;

/// The key of object `i`, `len` bytes long ([`KEY_LENS`]): `idx:`, filler up to `len`, then 12
/// decimal digits, so keys of one length differ only in their tail, as prefix-hash keys of one
/// model often share a head.
fn key(i: u64, len: usize) -> Key {
    let len = len.clamp(*KEY_LENS.start(), *KEY_LENS.end());
    let mut bytes = [b'-'; 256];
    bytes[..4].copy_from_slice(b"idx:");
    let mut v = i;
    for b in bytes[len - 12..len].iter_mut().rev() {
        *b = b'0' + (v % 10) as u8;
        v /= 10;
    }
    Key { bytes, len }
}

/// A bench key on the stack, so a lookup's key costs no allocation.
struct Key {
    bytes: [u8; 256],
    len: usize,
}

impl std::ops::Deref for Key {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}
