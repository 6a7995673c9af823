//! Regions read and written with `O_DIRECT`: the bytes go between the disk and the caller's
//! memory without passing through the page cache, so a disk tier neither doubles its reads in
//! RAM nor pushes the node's other files out of it, and a read measures the disk.
//!
//! `O_DIRECT` wants the offset, the length and the memory address of every request aligned (to
//! [`ALIGN`], 4 KiB, which covers the logical block size of every disk). Requests aligned in
//! all three go to the disk as they are. Any other request goes through an aligned bounce
//! buffer: a read reads the aligned blocks around it and copies its bytes out; a write reads
//! the partly covered first and last blocks, lays its bytes over them and writes the blocks
//! back, then cuts the file to the length a plain `pwrite` would have left. So the engine is
//! correct for every request, and fast for aligned ones.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use memmap2::MmapMut;

use super::{open_regions, RegionIo};
use crate::disk::format::ALIGN;
use crate::sync::lock;

/// Bytes of one bounce buffer: the most an unaligned request moves per `pread`/`pwrite`. A
/// 2 MiB value read at its unaligned offset fits in one.
const BOUNCE_LEN: usize = 4 << 20;
/// Bounce buffers kept for reuse once released; more may exist while requests run.
const SPARE_MAX: usize = 8;

/// Regions as the files of [`super::FileRegions`] (the same names and bytes: a store written
/// by one engine opens with the other), opened with `O_DIRECT`.
#[derive(Debug)]
pub struct DirectRegions {
    files: Vec<File>,
    /// One lock per region, held by writes and truncations: an unaligned write reads, changes
    /// and writes back whole blocks, which must not interleave with another write to them.
    writers: Vec<Mutex<()>>,
    /// Bytes of a bounce buffer ([`BOUNCE_LEN`]; less in tests, to cross their edges often).
    bounce_len: usize,
    /// Released bounce buffers, each `bounce_len` bytes and page-aligned.
    spare: Mutex<Vec<MmapMut>>,
}

impl DirectRegions {
    /// Opens (creating what is missing) `count` region files in `dir` with `O_DIRECT`, and
    /// deletes region files numbered `count` or above. A file system that refuses `O_DIRECT`
    /// is an `Unsupported` error naming the directory.
    pub fn open(dir: &Path, count: u32) -> io::Result<DirectRegions> {
        DirectRegions::open_with_bounce(dir, count, BOUNCE_LEN)
    }

    /// [`DirectRegions::open`] with bounce buffers of `bounce_len` bytes (a multiple of
    /// [`ALIGN`], at least two blocks).
    pub(super) fn open_with_bounce(
        dir: &Path,
        count: u32,
        bounce_len: usize,
    ) -> io::Result<DirectRegions> {
        debug_assert!(bounce_len % ALIGN as usize == 0 && bounce_len >= 2 * ALIGN as usize);
        let files = open_regions(dir, count, libc::O_DIRECT).map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "{}: the file system refuses O_DIRECT; put the disk store on a local \
                         disk or use buffered I/O",
                        dir.display()
                    ),
                )
            } else {
                e
            }
        })?;
        let writers = files.iter().map(|_| Mutex::new(())).collect();
        Ok(DirectRegions {
            files,
            writers,
            bounce_len,
            spare: Mutex::new(Vec::new()),
        })
    }

    fn file(&self, region: u32) -> io::Result<&File> {
        self.files
            .get(region as usize)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such region"))
    }

    /// A bounce buffer, reused or new; give it back with [`DirectRegions::release`].
    fn bounce(&self) -> io::Result<MmapMut> {
        match lock(&self.spare).pop() {
            Some(b) => Ok(b),
            // An anonymous mapping is page-aligned, which is what O_DIRECT asks of memory.
            None => MmapMut::map_anon(self.bounce_len),
        }
    }

    fn release(&self, bounce: MmapMut) {
        let mut spare = lock(&self.spare);
        if spare.len() < SPARE_MAX {
            spare.push(bounce);
        }
    }

    /// Reads an unaligned request through a bounce buffer.
    fn read_bounced(&self, file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut bounce = self.bounce()?;
        let result = read_spans(file, &mut bounce, offset, buf);
        self.release(bounce);
        result
    }

    /// Writes an unaligned request through a bounce buffer, then gives the file the length a
    /// plain `pwrite` would have left. The caller holds the region's writer lock.
    fn write_bounced(&self, file: &File, offset: u64, buf: &[u8]) -> io::Result<()> {
        let old_len = file.metadata()?.len();
        let mut bounce = self.bounce()?;
        let result = write_spans(file, &mut bounce, offset, buf);
        self.release(bounce);
        result?;
        let len = old_len.max(offset + buf.len() as u64);
        if file.metadata()?.len() > len {
            file.set_len(len)?;
        }
        Ok(())
    }
}

impl RegionIo for DirectRegions {
    fn read_at(&self, region: u32, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let file = self.file(region)?;
        if is_aligned(offset, buf) {
            if read_upto(file, buf, offset)? < buf.len() {
                return Err(eof());
            }
            return Ok(());
        }
        self.read_bounced(file, offset, buf)
    }

    fn write_at(&self, region: u32, offset: u64, buf: &[u8]) -> io::Result<()> {
        let file = self.file(region)?;
        let _writer = lock(&self.writers[region as usize]);
        if is_aligned(offset, buf) {
            return write_all(file, buf, offset);
        }
        self.write_bounced(file, offset, buf)
    }

    fn sync(&self, region: u32) -> io::Result<()> {
        // O_DIRECT skips the page cache, not the disk's own cache nor the file's metadata.
        self.file(region)?.sync_data()
    }

    fn truncate(&self, region: u32, len: u64) -> io::Result<()> {
        let file = self.file(region)?;
        let _writer = lock(&self.writers[region as usize]);
        file.set_len(len)
    }

    fn len(&self, region: u32) -> io::Result<u64> {
        Ok(self.file(region)?.metadata()?.len())
    }
}

/// Reads `buf` from `offset` one aligned span of at most a `bounce` at a time: the blocks
/// around the bytes asked for are read, and the bytes copied out.
fn read_spans(file: &File, bounce: &mut [u8], offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let at = offset + done as u64;
        let start = at - at % ALIGN;
        let skip = (at - start) as usize;
        let take = (buf.len() - done).min(bounce.len() - skip);
        let span = round_up(skip + take);
        if read_upto(file, &mut bounce[..span], start)? < skip + take {
            return Err(eof());
        }
        buf[done..done + take].copy_from_slice(&bounce[skip..skip + take]);
        done += take;
    }
    Ok(())
}

/// Writes `buf` at `offset` one aligned span of at most a `bounce` at a time: the partly
/// covered first and last blocks of a span are read (zeros past the end of the file), the
/// bytes laid over them, and the whole span written.
fn write_spans(file: &File, bounce: &mut [u8], offset: u64, buf: &[u8]) -> io::Result<()> {
    let block = ALIGN as usize;
    let mut done = 0;
    while done < buf.len() {
        let at = offset + done as u64;
        let start = at - at % ALIGN;
        let skip = (at - start) as usize;
        let take = (buf.len() - done).min(bounce.len() - skip);
        let span = round_up(skip + take);
        if skip > 0 {
            fill_block(file, &mut bounce[..block], start)?;
        }
        // The last block, unless it is the first and was just read.
        if (skip + take) % block != 0 && (span > block || skip == 0) {
            let last = span - block;
            fill_block(file, &mut bounce[last..span], start + last as u64)?;
        }
        bounce[skip..skip + take].copy_from_slice(&buf[done..done + take]);
        write_all(file, &bounce[..span], start)?;
        done += take;
    }
    Ok(())
}

/// Whether a request can go to the disk as it is: offset, length and address all aligned.
fn is_aligned(offset: u64, buf: &[u8]) -> bool {
    offset % ALIGN == 0
        && buf.len() as u64 % ALIGN == 0
        && (buf.as_ptr() as usize) % ALIGN as usize == 0
}

fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN as usize) * ALIGN as usize
}

fn eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past the end of the region",
    )
}

/// Reads into `buf` (aligned) from `offset` (aligned) until it is full or the file ends; the
/// bytes read. A read that ends off a block boundary has reached the end of the file (and
/// `O_DIRECT` would refuse to read on from there).
fn read_upto(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => {
                filled += n;
                if filled as u64 % ALIGN != 0 {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Reads one block (aligned) at `offset`, zeros where the file ends before it does.
fn fill_block(file: &File, block: &mut [u8], offset: u64) -> io::Result<()> {
    let n = read_upto(file, block, offset)?;
    block[n..].fill(0);
    Ok(())
}

/// Writes all of `buf` (aligned) at `offset` (aligned).
fn write_all(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    let mut written = 0;
    while written < buf.len() {
        match file.write_at(&buf[written..], offset + written as u64) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
