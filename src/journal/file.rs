//! The journal's files: their names, the appender that writes records through a mapping,
//! and files written whole.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use memmap2::{MmapMut, MmapOptions};

use crate::addr::NodeId;

/// The least space an `Appender` allocates ahead of its last record at a time.
const GROW_MIN: usize = 64 << 10;
/// The most it allocates ahead at a time (it doubles its file up to this step).
const GROW_MAX: usize = 64 << 20;

/// The file name of node `node`'s journal inside its segment directory.
pub fn journal_file_name(node: NodeId) -> String {
    format!("journal-{}.kvj", node.0)
}

/// Where a compaction writes the journal at `path` anew before renaming it onto it.
pub(super) fn compaction_path(path: &Path) -> PathBuf {
    path.with_extension("kvj.compact")
}

/// A journal file open for appending through a mapping of it (see the module docs).
#[derive(Debug)]
pub(super) struct Appender {
    pub(super) file: File,
    /// The whole file: the records written, then zeros allocated ahead.
    map: MmapMut,
    /// Bytes written: the header and the records.
    pub(super) len: usize,
}

impl Appender {
    /// Appends to `file`, whose first `len` bytes are written.
    pub(super) fn new(file: File, len: usize) -> io::Result<Appender> {
        let map = reserve(&file, len + GROW_MIN)?;
        Ok(Appender { file, map, len })
    }

    /// Copies `parts`, one after the other, after the bytes written.
    pub(super) fn append(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        let n: usize = parts.iter().map(|p| p.len()).sum();
        let end = self.len + n;
        if end > self.map.len() {
            let step = self.map.len().clamp(GROW_MIN, GROW_MAX);
            self.map = reserve(&self.file, end.max(self.map.len() + step))?;
        }
        let mut at = self.len;
        for p in parts {
            self.map[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        self.len = end;
        Ok(())
    }
}

impl Drop for Appender {
    /// A clean stop leaves only the records: the zeros allocated ahead go. (After a failed
    /// write `len` is 0 and the file is already gone.)
    fn drop(&mut self) {
        if self.len > 0 {
            let _ = self.file.set_len(self.len as u64);
        }
    }
}

/// Allocates the first `len` bytes of `file` (extending it with zeros) and maps them.
fn reserve(file: &File, len: usize) -> io::Result<MmapMut> {
    let size =
        libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::OutOfMemory))?;
    // SAFETY: posix_fallocate reads only its arguments; `file` is an open descriptor for
    // writing, and a failure is returned, not signalled.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    // SAFETY: `file` is this daemon's own journal or the compacted one about to replace it
    // (created 0600 in its data directory by `write_new`) and only its `Appender` writes it
    // while it is mapped; all `len` bytes of it were allocated just above, so no store
    // through the mapping can fault for want of space. The mapping is only ever written,
    // never read (a compaction reads the file with `pread`), so bytes another process changed
    // would not be read back through it. Truncating the file under a running daemon is
    // outside its contract, as for the segment files (docs/OPERATIONS.md).
    unsafe { MmapOptions::new().len(len).map_mut(file) }
}

/// Writes `header` and `records` to a temporary file renamed onto `path`; returns the file,
/// open for reading and writing.
pub(super) fn write_whole(path: &Path, header: &[u8], records: &[u8]) -> io::Result<File> {
    let tmp = path.with_extension("kvj.tmp");
    let f = write_new(&tmp, header, records)?;
    std::fs::rename(&tmp, path)?;
    Ok(f)
}

/// Writes `header` and `records` to a new file at `path` (replacing any), open for reading
/// and writing, without renaming it anywhere.
pub(super) fn write_new(path: &Path, header: &[u8], records: &[u8]) -> io::Result<File> {
    let mut f = OpenOptions::new()
        .mode(0o600)
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.write_all(header)?;
    f.write_all(records)?;
    Ok(f)
}
