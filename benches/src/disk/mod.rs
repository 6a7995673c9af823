//! `kvpool-bench disk`: the disk tier's large-block reads and writes against `fio` on the same
//! file system, in the same run.
//!
//! Writes `--objects` values of `--value-size` bytes through the disk store twice, over the
//! buffered engine (`FileRegions`) and over the `O_DIRECT` engine (`DirectRegions`), each
//! synced at the end, then half as many records straight through the `O_DIRECT` engine from an
//! aligned buffer (the store's insert without its copies), next to `fio` writing as many bytes
//! with `--direct=1` and an fsync. Then
//! reads the objects back, each pass every object at most once in a shuffled order of its own,
//! stopped after `--seconds`, with 1 and 4 readers (`--readers`), all from the same region
//! files:
//!
//! - the store over the buffered engine, the files' pages dropped from the page cache first
//!   (`posix_fadvise(DONTNEED)`, which needs no privilege), so that the disk is read;
//! - the store over the `O_DIRECT` engine, as a get does it: one aligned read of the whole
//!   record into the thread's aligned buffer, header, key and checksum checked, the value
//!   copied out;
//! - the `O_DIRECT` engine alone doing the same without the store (no index, no header
//!   checks): the engine's own rate;
//! - `fio --direct=1 --rw=randread --bs=<value size>` over the same files, with as many jobs
//!   as readers: the file system's limit on this machine.
//!
//! The kinds run `--rounds` times each, their order rotated from round to round (so that none
//! always reads right after another, whatever caches the disk has below the page cache); each
//! is reported as its median with its lowest and highest, and the ratio of medians to fio's.
//! Opening the store (its index rebuilt from the records, as at a restart) is timed over each
//! engine in between. Last, `fio` with io_uring and 16 reads in flight shows what a deep queue gets. Figures are
//! bytes of values over wall time, GB/s (10^9); every read is checked. Nothing here asserts on
//! time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvpool::checksum::checksum;
use kvpool::disk::{
    DirectRegions, DiskConfig, DiskStore, Insert, RegionIo, ALIGN, DEFAULT_REGION_SIZE, HEADER_LEN,
};
use kvpool_bench::units::{self, fmt_size};

mod fio;
mod read;
#[cfg(test)]
mod tests;

/// Flags of `kvpool-bench disk`.
#[derive(clap::Args, Debug)]
pub(crate) struct DiskArgs {
    /// Directory on the disk to measure; a fresh subdirectory is made in it and removed after
    /// [default: the system's temp dir]. It needs about one and a half times the data set
    /// free.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Objects written and read: the data set is this many values.
    #[arg(long, default_value_t = 1024)]
    objects: u64,
    /// Bytes of one value (B, KiB, MiB).
    #[arg(long, default_value = "2MiB", value_parser = units::parse_size)]
    value_size: u64,
    /// Reader threads of the read passes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    readers: Vec<usize>,
    /// The longest one read pass runs, in seconds (a pass reads each object at most once).
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Read passes of each kind per reader count, their order rotated from round to round;
    /// the median is reported, with the lowest and highest.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    fio: PathBuf,
}

/// Distinct values written round-robin (their checksums computed once, outside the timing,
/// as the pool hands the disk tier a value's checksum with it).
const VALUES: usize = 16;

/// Runs the benchmark and prints its figures.
pub(crate) fn run(args: DiskArgs) -> anyhow::Result<()> {
    ensure!(
        args.value_size >= 8 && args.objects > 0,
        "--objects must be positive and --value-size at least 8"
    );
    ensure!(
        args.readers.iter().all(|&r| r > 0) && args.rounds > 0,
        "--readers and --rounds must be positive"
    );
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("kvpool-bench-disk-{}", std::process::id()));
    let result = measure(&args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// What the store is measured with: its configuration and the values it holds.
pub(crate) struct Workload {
    pub(crate) config: DiskConfig,
    pub(crate) regions: u32,
    /// Bytes of one object's record, padding included.
    pub(crate) record_len: u64,
    /// Records one region holds.
    pub(crate) per_region: u64,
    pub(crate) objects: u64,
    pub(crate) values: Vec<Vec<u8>>,
    pub(crate) sums: Vec<u64>,
}

impl Workload {
    fn new(args: &DiskArgs, dir: &Path) -> Workload {
        let record =
            (HEADER_LEN as u64 + key(0).len() as u64 + args.value_size).next_multiple_of(ALIGN);
        let region_size = DEFAULT_REGION_SIZE.max(record);
        let per_region = region_size / record;
        // Room for every object, and one region spare so that none is dropped.
        let regions = args.objects.div_ceil(per_region) + 1;
        let config = DiskConfig::new(dir, regions.max(2) * region_size).region_size(region_size);
        let values: Vec<Vec<u8>> = (0..VALUES)
            .map(|v| {
                (0..args.value_size as usize)
                    .map(|i| (i as u8).wrapping_mul(131).wrapping_add(v as u8))
                    .collect()
            })
            .collect();
        let sums = values.iter().map(|v| checksum(v)).collect();
        Workload {
            regions: config.regions() as u32,
            record_len: record,
            per_region,
            config,
            objects: args.objects,
            values,
            sums,
        }
    }

    /// Object `i`'s value and its checksum.
    pub(crate) fn value(&self, i: u64) -> (&[u8], u64) {
        let v = (i % VALUES as u64) as usize;
        (&self.values[v], self.sums[v])
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.objects * self.values[0].len() as u64
    }
}

/// Object `i`'s key.
pub(crate) fn key(i: u64) -> Vec<u8> {
    format!("disk-bench-{i:010}").into_bytes()
}

fn measure(args: &DiskArgs, dir: &Path) -> anyhow::Result<()> {
    let fio = fio::Fio::find(&args.fio);
    let data_dir = dir.join("data");
    let w = Workload::new(args, &data_dir);
    println!(
        "disk: {} objects of {} ({:.2} GiB), regions of {}, in {}",
        w.objects,
        fmt_size(args.value_size),
        w.bytes() as f64 / (1u64 << 30) as f64,
        fmt_size(w.config.region_size),
        dir.display()
    );
    if let Err(why) = &fio {
        println!("  fio: {why}; its rows are left out");
    }
    let fio = fio.ok();
    let direct = writes(&w, dir, fio.as_ref())?;
    // The buffered store reads the same files as the others, so that every reader meets the
    // same disk (and whatever caches sit below it).
    // Opening rebuilds the index from the records: a restart's cost, over each engine.
    println!();
    let t = Instant::now();
    let io = DirectRegions::open(&data_dir, w.regions)?;
    let reopened = DiskStore::open_with(&w.config, io).context("reopening the O_DIRECT store")?;
    ensure!(reopened.stats().objects == w.objects, "reopened short");
    drop(reopened);
    opened("O_DIRECT", &w, t.elapsed().as_secs_f64());
    let t = Instant::now();
    let buffered = DiskStore::open(&w.config).context("opening the buffered store")?;
    opened("buffered", &w, t.elapsed().as_secs_f64());
    let engine = DirectRegions::open(&data_dir, w.regions)?;
    let records = read::locate(&engine, w.regions)?;
    ensure!(
        records.len() as u64 == w.objects,
        "found {} records of {} objects",
        records.len(),
        w.objects
    );
    let passes = read::Passes {
        w: &w,
        dir: &data_dir,
        fio: fio.as_ref(),
        buffered: &buffered,
        direct: &direct,
        engine: &engine,
        records: &records,
        deadline: Duration::from_secs_f64(args.seconds),
    };
    for &readers in &args.readers {
        passes.compare(readers, args.rounds)?;
    }
    if let Some(f) = &fio {
        let what = "fio randread --direct=1, io_uring, iodepth 16";
        match f.ceiling(&data_dir, w.regions, args.value_size, passes.deadline) {
            Ok(gbs) => println!("\n  {what:<48} {:>2}  {gbs:>5.2} GB/s  (a deep queue)", 1),
            Err(e) => println!("\n  {what}: unavailable ({e:#})"),
        }
    }
    Ok(())
}

/// Writes every object through the store over each engine and fio as many bytes; prints the
/// figures and returns the store over the O_DIRECT engine, which the reads use.
fn writes(
    w: &Workload,
    dir: &Path,
    fio: Option<&fio::Fio>,
) -> anyhow::Result<DiskStore<DirectRegions>> {
    println!("\nwrites (one writer, as the store's log has; synced at the end)");
    let fio_gbs = fio
        .map(|f| f.write(&dir.join("fio"), w.values[0].len() as u64, w.bytes()))
        .transpose()?;
    let buffered_config = DiskConfig {
        dir: dir.join("buffered"),
        ..w.config.clone()
    };
    let buffered = DiskStore::open(&buffered_config).context("opening the buffered store")?;
    let secs = fill(&buffered, w)?;
    drop(buffered);
    std::fs::remove_dir_all(&buffered_config.dir)?;
    row(
        "store insert, buffered (pwrite)",
        1,
        w.bytes() as f64 / secs / 1e9,
        None,
        fio_gbs,
    );
    let io =
        DirectRegions::open(&w.config.dir, w.regions).context("opening the O_DIRECT engine")?;
    let direct = DiskStore::open_with(&w.config, io).context("opening the O_DIRECT store")?;
    let secs = fill(&direct, w)?;
    row(
        "store insert, O_DIRECT",
        1,
        w.bytes() as f64 / secs / 1e9,
        None,
        fio_gbs,
    );
    let gbs = engine_fill(w, &dir.join("engine"))?;
    row(
        "O_DIRECT engine, records from an aligned buffer",
        1,
        gbs,
        None,
        fio_gbs,
    );
    if let Some(gbs) = fio_gbs {
        row("fio write --direct=1", 1, gbs, None, None);
    }
    Ok(direct)
}

/// Writes half as many records as the store holds straight through the O_DIRECT engine, laid
/// out as the store lays them, from one page-aligned buffer (no copy per record) and synced
/// as the store syncs (each region once full, and at the end): what an insert that needs no
/// bounce buffer could do. GB/s of values; the files are removed.
fn engine_fill(w: &Workload, dir: &Path) -> anyhow::Result<f64> {
    let engine = DirectRegions::open(dir, w.regions)?;
    let mut record = memmap2::MmapMut::map_anon(w.record_len as usize)?;
    let value = w.value(0).0;
    record[HEADER_LEN..HEADER_LEN + value.len()].copy_from_slice(value);
    let count = w.objects.div_ceil(2);
    let t = Instant::now();
    for i in 0..count {
        let region = (i / w.per_region) as u32;
        if i > 0 && i % w.per_region == 0 {
            engine.sync(region - 1)?;
        }
        engine.write_at(region, (i % w.per_region) * w.record_len, &record)?;
    }
    engine.sync(((count - 1) / w.per_region) as u32)?;
    let secs = t.elapsed().as_secs_f64();
    drop(engine);
    std::fs::remove_dir_all(dir)?;
    Ok((count * value.len() as u64) as f64 / secs / 1e9)
}

fn opened(engine: &str, w: &Workload, secs: f64) {
    println!(
        "open over the {engine} engine (the index rebuilt from the records): {secs:.3} s, \
         {:.0} objects/s",
        w.objects as f64 / secs
    );
}

/// Inserts every object, then syncs; the seconds it took.
fn fill(store: &DiskStore<impl RegionIo>, w: &Workload) -> anyhow::Result<f64> {
    let t = Instant::now();
    for i in 0..w.objects {
        let (value, sum) = w.value(i);
        let done = store.insert_prehashed(0, &key(i), value, sum);
        ensure!(done == Insert::Written, "insert {i}: {done:?}");
    }
    ensure!(store.sync(), "sync failed");
    let secs = t.elapsed().as_secs_f64();
    ensure!(
        store.stats().objects == w.objects,
        "the store holds {} of {} objects",
        store.stats().objects,
        w.objects
    );
    Ok(secs)
}

/// Prints one figure, the lowest and highest of its rounds when it had several, and its ratio
/// to fio's when there is one.
pub(crate) fn row(what: &str, threads: usize, gbs: f64, spread: Option<&str>, fio: Option<f64>) {
    let spread = spread.map_or(String::new(), |s| format!("  ({s})"));
    let ratio = fio.map_or(String::new(), |f| format!("  {:.2}x fio", gbs / f));
    println!("  {what:<48} {threads:>2}  {gbs:>5.2} GB/s{spread}{ratio}");
}
