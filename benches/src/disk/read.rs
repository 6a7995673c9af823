//! The read passes of `kvpool-bench disk`: every object once, in a shuffled order, shared
//! among reader threads, each read checked.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use kvpool::checksum::checksum;
use kvpool::disk::{DirectRegions, DiskStore, Get, RegionIo, ALIGN, HEADER_LEN, RECORD_MAGIC};
use memmap2::MmapMut;

use super::fio::Fio;
use super::{key, row, Workload};

/// What the read passes read through, and for how long at most.
pub(super) struct Passes<'a> {
    pub(super) w: &'a Workload,
    /// The region files every pass reads.
    pub(super) dir: &'a Path,
    pub(super) fio: Option<&'a Fio>,
    pub(super) buffered: &'a DiskStore,
    pub(super) direct: &'a DiskStore<DirectRegions>,
    pub(super) engine: &'a DirectRegions,
    pub(super) records: &'a [Record],
    pub(super) deadline: Duration,
}

/// The ways the passes read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Buffered,
    Direct,
    Engine,
    Fio,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Buffered, Kind::Direct, Kind::Engine, Kind::Fio];

    fn label(self, w: &Workload) -> String {
        match self {
            Kind::Buffered => "store get, buffered (page cache dropped)".into(),
            Kind::Direct => "store get, O_DIRECT".into(),
            Kind::Engine => "O_DIRECT engine, one aligned read per record".into(),
            Kind::Fio => format!(
                "fio randread --direct=1 --bs={}",
                kvpool_bench::units::fmt_size(w.values[0].len() as u64)
            ),
        }
    }
}

impl Passes<'_> {
    /// Runs `rounds` passes of each kind with `readers` readers, the kinds' order rotated from
    /// round to round so that none always follows another, and prints each kind's median
    /// (lowest and highest) and its ratio to fio's median.
    pub(super) fn compare(&self, readers: usize, rounds: usize) -> anyhow::Result<()> {
        println!(
            "\nreads, {readers} reader(s): median of {rounds} rounds, each object at most once \
             per pass, a pass at most {:?}",
            self.deadline
        );
        let kinds: Vec<Kind> = Kind::ALL
            .into_iter()
            .filter(|&k| k != Kind::Fio || self.fio.is_some())
            .collect();
        let mut got: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
        for round in 0..rounds {
            for k in 0..kinds.len() {
                let k = (k + round) % kinds.len();
                let seed = (readers * 1000 + round * 10 + k) as u64;
                got[k].push(self.one(kinds[k], readers, seed)?);
            }
        }
        for v in &mut got {
            v.sort_by(f64::total_cmp);
        }
        let median = |v: &[f64]| v[v.len() / 2];
        let fio = kinds
            .iter()
            .position(|&k| k == Kind::Fio)
            .map(|i| median(&got[i]));
        for (kind, v) in kinds.iter().zip(&got) {
            let baseline = fio.filter(|_| *kind != Kind::Fio);
            let spread = format!("{:.2}-{:.2}", v[0], v[v.len() - 1]);
            row(
                &kind.label(self.w),
                readers,
                median(v),
                Some(&spread),
                baseline,
            );
        }
        Ok(())
    }

    /// One pass of `kind`; GB/s.
    fn one(&self, kind: Kind, readers: usize, seed: u64) -> anyhow::Result<f64> {
        let w = self.w;
        let (bytes, secs) = match kind {
            Kind::Buffered => {
                drop_cached(self.dir)?;
                store_pass(self.buffered, w, readers, self.deadline, seed)?
            }
            Kind::Direct => store_pass(self.direct, w, readers, self.deadline, seed)?,
            Kind::Engine => {
                record_pass(self.engine, self.records, w, readers, self.deadline, seed)?
            }
            Kind::Fio => {
                let fio = self.fio.expect("fio passes only with fio");
                let bs = w.values[0].len() as u64;
                return fio.randread(self.dir, w.regions, bs, readers, self.deadline);
            }
        };
        Ok(bytes as f64 / secs / 1e9)
    }
}

/// Where object `i`'s record lies (the `i`-th of [`locate`]'s answer).
pub(super) struct Record {
    region: u32,
    offset: u64,
    /// The whole record, padding included: a multiple of 4 KiB.
    len: u64,
}

/// Finds every object's record by reading the headers of the regions, as the format in
/// `kvpool::disk` lays them out (not timed).
pub(super) fn locate(engine: &DirectRegions, regions: u32) -> anyhow::Result<Vec<Record>> {
    let mut block = MmapMut::map_anon(ALIGN as usize)?;
    let mut found: Vec<Option<Record>> = Vec::new();
    for region in 0..regions {
        let len = engine.len(region)?;
        let mut offset = 0;
        while offset < len {
            engine.read_at(region, offset, &mut block)?;
            let b = &block[..];
            ensure!(b[..4] == RECORD_MAGIC, "no record at {region}:{offset}");
            let key_len = u32::from_le_bytes(b[12..16].try_into()?) as usize;
            let value_len = u64::from_le_bytes(b[16..24].try_into()?);
            let key = std::str::from_utf8(&b[HEADER_LEN..HEADER_LEN + key_len])?;
            let i: usize = key
                .strip_prefix("disk-bench-")
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("a key not of this benchmark: {key:?}"))?;
            let record_len =
                (HEADER_LEN as u64 + key_len as u64 + value_len).next_multiple_of(ALIGN);
            if found.len() <= i {
                found.resize_with(i + 1, || None);
            }
            found[i] = Some(Record {
                region,
                offset,
                len: record_len,
            });
            offset += record_len;
        }
    }
    found
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.with_context(|| format!("object {i} has no record")))
        .collect()
}

/// Drops the clean pages of the files in `dir` from the page cache, so that the next buffered
/// reads go to the disk (no privilege needed, unlike `drop_caches`).
pub(super) fn drop_cached(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let file = File::open(entry?.path())?;
        file.sync_data()?;
        // SAFETY: a plain system call on a descriptor `file` keeps open for its length; no
        // memory is passed.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        ensure!(rc == 0, "posix_fadvise: error {rc}");
    }
    Ok(())
}

/// Gets every object through the store into a plain buffer; bytes of values read, seconds.
fn store_pass(
    store: &DiskStore<impl RegionIo>,
    w: &Workload,
    readers: usize,
    deadline: Duration,
    seed: u64,
) -> anyhow::Result<(u64, f64)> {
    let size = w.values[0].len();
    pass(
        w,
        (readers, deadline, seed),
        || vec![0u8; size],
        |i, buf| match store.get(0, &key(i), buf) {
            Get::Hit { len } if len == size => Ok(len as u64),
            other => bail!("get {i}: {other:?}"),
        },
    )
}

/// Reads every object's whole record in one aligned `O_DIRECT` read, checks its key and
/// checksum and copies the value into a plain buffer: the get the store could do.
fn record_pass(
    engine: &DirectRegions,
    records: &[Record],
    w: &Workload,
    readers: usize,
    deadline: Duration,
    seed: u64,
) -> anyhow::Result<(u64, f64)> {
    let size = w.values[0].len();
    let longest = records.iter().map(|r| r.len).max().unwrap_or(ALIGN) as usize;
    pass(
        w,
        (readers, deadline, seed),
        || {
            (
                MmapMut::map_anon(longest).expect("a buffer"),
                vec![0u8; size],
            )
        },
        |i, (record, out)| {
            let r = &records[i as usize];
            let record = &mut record[..r.len as usize];
            engine.read_at(r.region, r.offset, record)?;
            let k = key(i);
            let value_at = HEADER_LEN + k.len();
            let value = &record[value_at..value_at + size];
            ensure!(
                record[HEADER_LEN..value_at] == k[..] && checksum(value) == w.value(i).1,
                "object {i} read back wrong"
            );
            out.copy_from_slice(value);
            Ok(size as u64)
        },
    )
}

/// Runs `read` on every object once, in an order shuffled by `seed` and shared by `readers`
/// threads, each with its own scratch, until all are read or `deadline` has passed; the bytes
/// `read` reported and the seconds from the start to the last reader's end.
fn pass<S>(
    w: &Workload,
    (readers, deadline, seed): (usize, Duration, u64),
    scratch: impl Fn() -> S + Sync,
    read: impl Fn(u64, &mut S) -> anyhow::Result<u64> + Sync,
) -> anyhow::Result<(u64, f64)> {
    let order = shuffled(w.objects, seed);
    let next = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        let readers: Vec<_> = (0..readers)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    let mut scratch = scratch();
                    while start.elapsed() < deadline {
                        let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            break;
                        };
                        bytes.fetch_add(read(i, &mut scratch)?, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        readers
            .into_iter()
            .try_for_each(|r| r.join().expect("a reader panicked"))
    })?;
    Ok((bytes.into_inner(), start.elapsed().as_secs_f64()))
}

/// `0..n` in the order `seed` shuffles it to (Fisher-Yates with xorshift).
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n).collect();
    let mut x = (0x2545_f491_4f6c_dd1d_u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}
