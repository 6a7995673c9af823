//! The store's only contact with the disk: positional reads and writes of numbered region
//! files, behind a trait so that the engine can change (and tests can fail on purpose).
//!
//! Two engines open the same files: [`FileRegions`] through the page cache and
//! [`DirectRegions`] with `O_DIRECT` (`io/direct.rs`); [`IoEngine`] names one, as a
//! configuration does, and opens it.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::str::FromStr;

mod direct;
#[cfg(test)]
mod tests;

pub use direct::DirectRegions;

/// Reads, writes, syncs and truncates the store's regions, each addressed by its number.
///
/// A read fills the whole buffer or fails (a short read is `UnexpectedEof`); a write writes the
/// whole buffer or fails. The store never assumes more than that, so an engine may be `pread`
/// and `pwrite` through the page cache ([`FileRegions`]), the same with `O_DIRECT`
/// ([`DirectRegions`]), or io_uring.
pub trait RegionIo: Send + Sync {
    /// Reads `buf.len()` bytes of region `region` from `offset`.
    fn read_at(&self, region: u32, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `buf` into region `region` at `offset`.
    fn write_at(&self, region: u32, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Makes the writes to region `region` durable.
    fn sync(&self, region: u32) -> io::Result<()>;
    /// Cuts region `region` to `len` bytes (0 empties it before it is written anew).
    fn truncate(&self, region: u32, len: u64) -> io::Result<()>;
    /// Bytes region `region` holds.
    fn len(&self, region: u32) -> io::Result<u64>;
}

/// Regions as files `region-NNNNN.kvd` in one directory, read and written with `pread` and
/// `pwrite` through the page cache.
#[derive(Debug)]
pub struct FileRegions {
    files: Vec<File>,
}

impl FileRegions {
    /// Opens (creating what is missing) `count` region files in `dir`, and deletes region
    /// files numbered `count` or above, left by a configuration with more regions: the store
    /// never holds more than its capacity.
    pub fn open(dir: &Path, count: u32) -> io::Result<FileRegions> {
        let files = open_regions(dir, count, 0)?;
        Ok(FileRegions { files })
    }

    fn file(&self, region: u32) -> io::Result<&File> {
        self.files
            .get(region as usize)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such region"))
    }
}

impl RegionIo for FileRegions {
    fn read_at(&self, region: u32, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file(region)?.read_exact_at(buf, offset)
    }

    fn write_at(&self, region: u32, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.file(region)?.write_all_at(buf, offset)
    }

    fn sync(&self, region: u32) -> io::Result<()> {
        self.file(region)?.sync_data()
    }

    fn truncate(&self, region: u32, len: u64) -> io::Result<()> {
        self.file(region)?.set_len(len)
    }

    fn len(&self, region: u32) -> io::Result<u64> {
        Ok(self.file(region)?.metadata()?.len())
    }
}

/// The engines a store's regions can be opened with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoEngine {
    /// [`FileRegions`]: `pread` and `pwrite` through the page cache.
    #[default]
    Buffered,
    /// [`DirectRegions`]: `O_DIRECT`, around the page cache.
    Direct,
}

impl FromStr for IoEngine {
    type Err = String;

    /// `buffered` or `direct`.
    fn from_str(s: &str) -> Result<IoEngine, String> {
        match s {
            "buffered" => Ok(IoEngine::Buffered),
            "direct" => Ok(IoEngine::Direct),
            _ => Err(format!(
                "{s:?}: the disk I/O engine is `buffered` or `direct`"
            )),
        }
    }
}

impl IoEngine {
    /// Opens `count` region files in `dir` with this engine (see [`FileRegions::open`] and
    /// [`DirectRegions::open`]), as the engine a store chosen at run time holds.
    pub fn open(self, dir: &Path, count: u32) -> io::Result<Box<dyn RegionIo>> {
        Ok(match self {
            IoEngine::Buffered => Box::new(FileRegions::open(dir, count)?),
            IoEngine::Direct => Box::new(DirectRegions::open(dir, count)?),
        })
    }
}

impl fmt::Display for IoEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoEngine::Buffered => "buffered",
            IoEngine::Direct => "direct",
        })
    }
}

/// Opens (creating what is missing) `count` region files in `dir` with the extra `open(2)`
/// flags `flags`, and deletes region files numbered `count` or above.
fn open_regions(dir: &Path, count: u32, flags: i32) -> io::Result<Vec<File>> {
    fs::create_dir_all(dir)?;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if let Some(n) = region_number(&name.to_string_lossy()) {
            if n >= count {
                fs::remove_file(entry.path())?;
            }
        }
    }
    (0..count)
        .map(|r| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .custom_flags(flags)
                .open(dir.join(region_file_name(r)))
        })
        .collect()
}

/// The file name of region `region`.
pub fn region_file_name(region: u32) -> String {
    format!("region-{region:05}.kvd")
}

/// The region number a file name stands for, if it names a region.
fn region_number(name: &str) -> Option<u32> {
    name.strip_prefix("region-")?
        .strip_suffix(".kvd")?
        .parse()
        .ok()
}
