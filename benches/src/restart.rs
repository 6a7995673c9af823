//! `kvpool-bench restart`: how long a restarted node takes to recover its objects.
//!
//! Fills a file-backed pool (the daemon's own `kvpool::Pool`, with the daemon's default
//! geometry) in a fresh directory with `--objects` values of `--value-size` bytes, stops it (the
//! segment files and journal stay, as after a kill -9 or a clean stop), then times
//! `Pool::new` on the same directory: reading the journal, mapping the old segments, and
//! copying and checking every object into the new ones. The daemon's start adds only binding
//! its sockets. A fresh start on an empty directory is timed too, as the floor. Bounded: the
//! work is the fill and one recovery; nothing here asserts on time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Args;
use kvpool::pool::{Pool, PoolConfig};
use kvpool::segment::{Backing, HugePages};

/// Arguments of `kvpool-bench restart`.
#[derive(Args, Debug)]
pub(crate) struct RestartArgs {
    /// Objects to recover.
    #[arg(long, default_value_t = 1_000_000)]
    objects: u64,
    /// Bytes per value.
    #[arg(long, default_value_t = 4096)]
    value_size: u64,
    /// Where to put the segment files (tmpfs, as the daemon's default).
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
}

/// Runs the benchmark and prints its figures.
pub(crate) fn run(args: RestartArgs) -> anyhow::Result<()> {
    let dir = args
        .dir
        .join(format!("kvpool-bench-restart-{}", std::process::id()));
    let result = measure(&args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(args: &RestartArgs, dir: &std::path::Path) -> anyhow::Result<()> {
    ensure!(
        args.value_size >= 8,
        "--value-size must be at least 8 (each value is numbered)"
    );
    // Room for every object with an eighth to spare, so nothing is evicted.
    let data = args.objects * args.value_size.next_multiple_of(512);
    let cfg = PoolConfig {
        segment_size: (data + data / 8).max(64 << 20),
        backing: Backing::File(dir.to_path_buf()),
        huge_pages: HugePages::Auto,
        ..PoolConfig::default()
    };
    let t = Instant::now();
    let pool = Pool::new(&cfg, [1; 16]).context("creating the pool")?;
    let fresh = t.elapsed();
    let mut value = vec![0u8; args.value_size as usize];
    let t = Instant::now();
    for i in 0..args.objects {
        value[..8].copy_from_slice(&i.to_le_bytes());
        pool.put(0, &key(i), &value, false, 0)
            .with_context(|| format!("put {i}"))?;
    }
    let fill = t.elapsed();
    drop(pool);
    let journal = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .find(|e| e.file_name().to_string_lossy().ends_with(".kvj"))
        .map_or(0, |e| e.metadata().map_or(0, |m| m.len()));

    let t = Instant::now();
    let pool = Pool::new(&cfg, [2; 16]).context("restarting the pool")?;
    let recovery = t.elapsed();
    let r = pool.recovery().clone();
    ensure!(
        r.recovered == args.objects,
        "recovered {} of {} objects: {r:?}",
        r.recovered,
        args.objects
    );
    for i in (0..args.objects).step_by((args.objects / 1000).max(1) as usize) {
        let v = pool.get(0, &key(i), 0)?;
        ensure!(
            v.len() == value.len() && v[..8] == i.to_le_bytes(),
            "object {i} recovered wrong"
        );
    }
    let secs = recovery.as_secs_f64();
    println!("restart: {} objects of {} B", args.objects, args.value_size);
    println!(
        "  fresh start (empty directory)  {:>9.3} s",
        fresh.as_secs_f64()
    );
    println!(
        "  fill                           {:>9.3} s",
        fill.as_secs_f64()
    );
    println!(
        "  journal                        {:>9.1} MiB",
        journal as f64 / 1048576.0
    );
    println!(
        "  recovery                       {:>9.3} s  ({:.0} objects/s, {:.2} GB/s of values)",
        secs,
        args.objects as f64 / secs,
        r.recovered_bytes as f64 / secs / 1e9
    );
    Ok(())
}

fn key(i: u64) -> Vec<u8> {
    format!("restart-bench-{i:016x}").into_bytes()
}
