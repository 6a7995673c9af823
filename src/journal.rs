//! The index journal: what a pool needs to find its objects again after a restart.
//!
//! A pool whose segments are files keeps, next to them, an append-only file
//! (`journal-<node>.kvj`) with one record per change of its index: an object committed (its
//! namespace, key, segment, offset, length, checksum, generation, pin and prefix depth), an
//! object gone from the index (removed, replaced or evicted; by generation), and a pin change.
//! Each record is copied into the file before the operation returns, so a daemon killed at any
//! instant leaves a journal whose every complete record describes an acknowledged state; a
//! record cut short by the kill is recognised by its checksum and ends the replay. The page
//! cache outlives the process, so no `fsync` is needed for a restart (a reboot of the host loses
//! `/dev/shm` and the journal with it anyway).
//!
//! The file is mapped and records are copied into it through the mapping ([`Appender`]): the
//! same page-cache pages a `write(2)` would fill, without a system call per record (two per
//! overwriting put, which cost a put of 64 KiB over TCP about a tenth of its throughput). The
//! space ahead of the last record is allocated before it is mapped, so a store never faults
//! for want of room, and is zeros: a replay stops at the first zero length. A clean stop
//! truncates the file to its records.
//!
//! Replaying the journal gives the objects that were in the index (see [`replay`]); the pool
//! then copies each one whose bytes still hash to its recorded checksum into its new segments
//! (see `pool/recover.rs`). The checksum comes from this file, which only the daemon writes,
//! never from the shared segment memory.
//!
//! ```text
//! header   magic "KVPOOLJN" | version u32 | body_len u32 | xxh3 of body u64 | body:
//!          segment layout u32 | node u32 | namespaces u32 | per namespace: len u16, name
//! record   body_len u32 | xxh3 of body u64 | body (little-endian):
//!          1 commit: ns u32, segment u16, offset u64, len u64, checksum u64, generation u64,
//!                    pinned u8, depth u32, key_len u16, key
//!          2 gone:   generation u64
//!          3 pin:    generation u64, pinned u8
//! ```
//!
//! The journal grows with every change; once it holds many more records than live objects it
//! is rewritten with only the live ones, off the locks of the writers ([`SharedJournal`]): the
//! records up to the journal's end at that moment are read back, replayed and written as a
//! new file by a thread of its own, while appends go on to the old file; then, under the
//! journal's lock again, the records appended meanwhile are copied after them verbatim and the
//! new file is renamed onto the old one. A crash at any point leaves the old file or the new
//! one, each complete.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use memmap2::{MmapMut, MmapOptions};
use xxhash_rust::xxh3::xxh3_64;

use crate::addr::NodeId;
use crate::error::MAX_KEY_LEN;
use crate::sync::lock;

/// Magic bytes at the start of a journal.
pub const JOURNAL_MAGIC: [u8; 8] = *b"KVPOOLJN";
/// Version of the journal format described in the module docs.
pub const JOURNAL_VERSION: u32 = 1;

const TAG_COMMIT: u8 = 1;
const TAG_GONE: u8 = 2;
const TAG_PIN: u8 = 3;
const COMMIT_FIXED: usize = 1 + 4 + 2 + 8 * 4 + 1 + 4 + 2;
const MAX_RECORD: usize = COMMIT_FIXED + MAX_KEY_LEN;
/// Records of slack before a compaction is considered.
const COMPACT_SLACK: u64 = 1 << 16;
/// The least space an [`Appender`] allocates ahead of its last record at a time.
const GROW_MIN: usize = 64 << 10;
/// The most it allocates ahead at a time (it doubles its file up to this step).
const GROW_MAX: usize = 64 << 20;

/// Where a compaction writes the journal at `path` anew before renaming it onto it.
fn compaction_path(path: &Path) -> PathBuf {
    path.with_extension("kvj.compact")
}

/// The file name of node `node`'s journal inside its segment directory.
pub fn journal_file_name(node: NodeId) -> String {
    format!("journal-{}.kvj", node.0)
}

/// An object as the journal last described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// Namespace id, in the journal's namespace table.
    pub ns: u32,
    /// Segment number.
    pub segment: u16,
    /// Offset in the segment's data area.
    pub offset: u64,
    /// Value length.
    pub len: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// Generation in the life that wrote it.
    pub generation: u64,
    /// Pinned (never evicted).
    pub pinned: bool,
    /// Prefix-chain depth given at its allocation.
    pub depth: u32,
    /// The key.
    pub key: Vec<u8>,
}

/// Why a journal could not be read at all.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Not a journal (bad magic) or a damaged header.
    #[error("not a kvpool journal, or its header is damaged")]
    Corrupt,
    /// A journal format this build does not read.
    #[error("journal format version {0} (this kvpoold reads version {JOURNAL_VERSION})")]
    UnknownVersion(u32),
    /// Segments of a layout this build does not read.
    #[error("segment layout version {found} (this kvpoold reads version {reads})")]
    UnknownLayout {
        /// The journal's layout.
        found: u32,
        /// The one this build reads.
        reads: u32,
    },
}

/// What [`replay`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// The journal writer's node.
    pub node: u32,
    /// Its namespace names, by id.
    pub namespaces: Vec<String>,
    /// Objects in the index when the journal ends, oldest commit first, one per key.
    pub objects: Vec<Committed>,
    /// Bytes after the last whole record (a record cut short by a crash, or damage), not
    /// counting the zeros allocated ahead of it.
    pub torn_tail: u64,
    /// Where the last whole record ends (the header's length when there is none).
    pub end: u64,
}

/// What a journal holds and has done, for the daemon's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JournalStats {
    /// False once a write failed and the journal was deleted: the next start will be empty.
    pub healthy: bool,
    /// Bytes of its header and records (the file is larger by the space allocated ahead).
    pub bytes: u64,
    /// Records in the file since it was last written whole.
    pub records: u64,
    /// Compactions finished.
    pub compactions: u64,
    /// Compactions that could not be written (the journal was kept; they are tried again).
    pub compaction_failures: u64,
}

/// A commit to record, borrowing its key.
#[derive(Clone, Copy, Debug)]
pub struct Record<'a> {
    /// Namespace id.
    pub ns: u32,
    /// Segment number.
    pub segment: u16,
    /// Offset in the segment's data area.
    pub offset: u64,
    /// Value length.
    pub len: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// Generation.
    pub generation: u64,
    /// Pinned.
    pub pinned: bool,
    /// Prefix-chain depth.
    pub depth: u32,
    /// The key.
    pub key: &'a [u8],
}

impl Committed {
    /// This object as a record to write.
    pub fn record(&self) -> Record<'_> {
        Record {
            ns: self.ns,
            segment: self.segment,
            offset: self.offset,
            len: self.len,
            checksum: self.checksum,
            generation: self.generation,
            pinned: self.pinned,
            depth: self.depth,
            key: &self.key,
        }
    }
}

/// Parses a journal. `layout` is the segment layout version this build reads.
pub fn replay(bytes: &[u8], layout: u32) -> Result<Replayed, JournalError> {
    if bytes.len() < 24 || bytes[..8] != JOURNAL_MAGIC {
        return Err(JournalError::Corrupt);
    }
    let version = u32_at(bytes, 8);
    if version != JOURNAL_VERSION {
        return Err(JournalError::UnknownVersion(version));
    }
    let body_len = u32_at(bytes, 12) as usize;
    let body = bytes.get(24..24 + body_len).ok_or(JournalError::Corrupt)?;
    if xxh3_64(body) != u64_at(bytes, 16) || body.len() < 12 {
        return Err(JournalError::Corrupt);
    }
    let found = u32_at(body, 0);
    if found != layout {
        return Err(JournalError::UnknownLayout {
            found,
            reads: layout,
        });
    }
    let node = u32_at(body, 4);
    let count = u32_at(body, 8) as usize;
    let mut namespaces = Vec::new();
    let mut at = 12;
    for _ in 0..count {
        let len = body
            .get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
            .ok_or(JournalError::Corrupt)?;
        let name = body
            .get(at + 2..at + 2 + len)
            .ok_or(JournalError::Corrupt)?;
        namespaces.push(String::from_utf8(name.to_vec()).map_err(|_| JournalError::Corrupt)?);
        at += 2 + len;
    }
    if at != body.len() {
        return Err(JournalError::Corrupt);
    }

    // generation -> (sequence of its commit, object)
    let mut live: HashMap<u64, (u64, Committed)> = HashMap::new();
    let mut pos = 24 + body_len;
    let mut seq = 0u64;
    while pos < bytes.len() {
        let Some(rec) = record_at(bytes, pos) else {
            break;
        };
        pos += 12 + rec.len();
        seq += 1;
        match decode(rec, namespaces.len()) {
            Some(Decoded::Commit(c)) => {
                live.insert(c.generation, (seq, c));
            }
            Some(Decoded::Gone(g)) => {
                live.remove(&g);
            }
            Some(Decoded::Pin(g, pinned)) => {
                if let Some((_, c)) = live.get_mut(&g) {
                    c.pinned = pinned;
                }
            }
            // A whole record (its checksum holds) that makes no sense: damage we can't
            // explain, so nothing after it is trusted either.
            None => {
                pos -= 12 + rec.len();
                break;
            }
        }
    }
    let mut objects: Vec<(u64, Committed)> = live.into_values().collect();
    objects.sort_unstable_by_key(|(s, _)| *s);
    // A key committed again before its older object's "gone" was written (a crash between
    // the two): the later commit wins.
    let mut newest: HashMap<(u32, &[u8]), u64> = HashMap::new();
    for (s, c) in &objects {
        newest.insert((c.ns, c.key.as_slice()), *s);
    }
    let keep: Vec<bool> = objects
        .iter()
        .map(|(s, c)| newest.get(&(c.ns, c.key.as_slice())) == Some(s))
        .collect();
    let objects = objects
        .into_iter()
        .zip(keep)
        .filter_map(|((_, c), k)| k.then_some(c))
        .collect();
    // Zeros after the records are space the writer allocated ahead, not a torn record.
    let written = bytes
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |i| i + 1)
        .max(pos);
    Ok(Replayed {
        node,
        namespaces,
        objects,
        torn_tail: (written - pos) as u64,
        end: pos as u64,
    })
}

/// The writer of a pool's journal.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    /// None once a write failed (see [`Journal::healthy`]).
    file: Option<Appender>,
    header: Vec<u8>,
    layout: u32,
    /// Records since the file was last written whole.
    records: u64,
    /// Commits minus gones since then, plus the objects it started with.
    live: u64,
    /// Records held back by [`Journal::hold`] until [`Journal::release`].
    held: Option<Vec<u8>>,
    /// A compaction was started and has not finished.
    compacting: bool,
    /// No compaction starts before `records` reaches this (set when one could not be written,
    /// a full disk say: the journal as it stands is kept, and tried again later).
    retry_at: u64,
    /// The pool is gone: a compaction finishing now is thrown away.
    closed: bool,
    /// Compactions finished, and those that could not be written.
    compactions: u64,
    compaction_failures: u64,
}

impl Journal {
    /// Creates (replacing any) the journal of `node` in `dir` for a pool with these namespace
    /// names, writing a temporary file and renaming it, so a crash leaves the old one or the
    /// new one.
    pub fn create(
        dir: &Path,
        node: NodeId,
        layout: u32,
        namespaces: &[String],
    ) -> io::Result<Journal> {
        let mut body = Vec::new();
        body.extend_from_slice(&layout.to_le_bytes());
        body.extend_from_slice(&node.0.to_le_bytes());
        body.extend_from_slice(&(namespaces.len() as u32).to_le_bytes());
        for n in namespaces {
            let name = &n.as_bytes()[..n.len().min(u16::MAX as usize)];
            body.extend_from_slice(&(name.len() as u16).to_le_bytes());
            body.extend_from_slice(name);
        }
        let mut header = Vec::with_capacity(24 + body.len());
        header.extend_from_slice(&JOURNAL_MAGIC);
        header.extend_from_slice(&JOURNAL_VERSION.to_le_bytes());
        header.extend_from_slice(&(body.len() as u32).to_le_bytes());
        header.extend_from_slice(&xxh3_64(&body).to_le_bytes());
        header.extend_from_slice(&body);
        let path = dir.join(journal_file_name(node));
        // A compaction's file left by a crash in the middle of one.
        let _ = std::fs::remove_file(compaction_path(&path));
        let file = Appender::new(write_whole(&path, &header, &[])?, header.len())?;
        Ok(Journal {
            path,
            file: Some(file),
            header,
            layout,
            records: 0,
            live: 0,
            held: None,
            compacting: false,
            retry_at: 0,
            closed: false,
            compactions: 0,
            compaction_failures: 0,
        })
    }

    /// Records a commit.
    pub fn commit(&mut self, c: &Record<'_>) {
        let mut b = [0u8; MAX_RECORD];
        let n = encode_commit(c, &mut b);
        self.live += 1;
        self.append(&b[..n]);
    }

    /// Records that generation `generation` left the index.
    pub fn gone(&mut self, generation: u64) {
        let mut b = [0u8; 9];
        b[0] = TAG_GONE;
        b[1..9].copy_from_slice(&generation.to_le_bytes());
        self.live = self.live.saturating_sub(1);
        self.append(&b);
    }

    /// Records a pin change.
    pub fn pin(&mut self, generation: u64, pinned: bool) {
        let mut b = [0u8; 10];
        b[0] = TAG_PIN;
        b[1..9].copy_from_slice(&generation.to_le_bytes());
        b[9] = pinned as u8;
        self.append(&b);
    }

    /// False once a write failed: the journal was then deleted, so a restart starts empty
    /// instead of trusting a journal with a hole.
    pub fn healthy(&self) -> bool {
        self.file.is_some()
    }

    /// What it holds and has done.
    pub fn stats(&self) -> JournalStats {
        JournalStats {
            healthy: self.healthy(),
            bytes: self.file.as_ref().map_or(0, |f| f.len as u64),
            records: self.records,
            compactions: self.compactions,
            compaction_failures: self.compaction_failures,
        }
    }

    /// Counts a compaction that could not be written and puts the next one off by
    /// [`COMPACT_SLACK`] records; the journal as it stands is kept.
    fn postpone(&mut self) {
        self.retry_at = self.records + COMPACT_SLACK;
        self.compaction_failures += 1;
    }

    /// Starts a compaction when one is due: when the file holds more than twice as many
    /// records as there are live objects (plus a slack of 65536 records), none is under way and
    /// no records are held back. What it returns is built off the lock
    /// ([`Compaction::build`]) and then handed to [`Journal::finish`].
    pub fn compaction_due(&mut self) -> Option<Compaction> {
        if self.records <= 2 * self.live + COMPACT_SLACK || self.records < self.retry_at {
            return None;
        }
        self.start_compaction()
    }

    /// Starts a compaction whether or not one is due, unless one is under way, records are
    /// held back, or the journal failed or closed.
    fn start_compaction(&mut self) -> Option<Compaction> {
        if self.compacting || self.closed || self.held.is_some() {
            return None;
        }
        let end = self.file.as_ref()?.len;
        self.compacting = true;
        Some(Compaction {
            path: self.path.clone(),
            header: self.header.clone(),
            layout: self.layout,
            end,
            records: self.records,
        })
    }

    /// Ends the compaction [`Journal::compaction_due`] started: copies the records appended
    /// since it began after the compacted ones, renames the new file onto the journal's and
    /// appends to it from now on. Returns the old file's appender, for the caller to drop
    /// outside the lock (unmapping a large file takes a while). A compaction that could not
    /// be written (a full disk, say) leaves the journal as it is, complete, and is tried again
    /// after [`COMPACT_SLACK`] more records; one that found the journal's own records damaged
    /// fails the journal, as a failed append does; one that finishes after the pool closed or
    /// the journal failed is thrown away.
    pub fn finish(&mut self, built: io::Result<Built>) -> Option<impl Drop> {
        self.compacting = false;
        let mut built = match built {
            Ok(b) => b,
            Err(_) if self.closed => return None,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                self.fail();
                return None;
            }
            Err(_) => {
                let _ = std::fs::remove_file(compaction_path(&self.path));
                self.postpone();
                return None;
            }
        };
        let Some(old) = self.file.as_ref().filter(|_| !self.closed) else {
            built.discard();
            return None;
        };
        // Read through the file, not the mapping, which is only ever written (see `reserve`).
        let mut tail = vec![0u8; old.len - built.end];
        let swapped = old
            .file
            .read_exact_at(&mut tail, built.end as u64)
            .and_then(|()| built.file.append(&[&tail]))
            .and_then(|()| std::fs::rename(&built.tmp, &self.path));
        if swapped.is_err() {
            // Nothing was renamed: the journal is still the old file, complete.
            built.discard();
            self.postpone();
            return None;
        }
        self.records = built.objects + (self.records - built.records);
        self.compactions += 1;
        let mut old = std::mem::replace(self.file.as_mut()?, built.file);
        // The old file is no longer the journal: it must not be truncated on the way out.
        old.len = 0;
        Some(old)
    }

    /// Holds records back in memory instead of writing each one (for a recovery, which
    /// writes a whole journal at once: a crash during it loses the objects not yet recovered
    /// in any case).
    pub fn hold(&mut self) {
        self.held.get_or_insert_with(Vec::new);
    }

    /// Writes the records held back since [`Journal::hold`], and writes each one again from
    /// then on.
    pub fn release(&mut self) {
        let Some(held) = self.held.take() else { return };
        let Some(f) = self.file.as_mut() else { return };
        if f.append(&[&held]).is_err() {
            self.fail();
        }
    }

    fn append(&mut self, body: &[u8]) {
        if let Some(held) = self.held.as_mut() {
            frame(body, held);
            self.records += 1;
            return;
        }
        let Some(f) = self.file.as_mut() else { return };
        if f.append(&[&frame_head(body), body]).is_err() {
            self.fail();
            return;
        }
        self.records += 1;
    }

    fn fail(&mut self) {
        if let Some(mut f) = self.file.take() {
            f.len = 0;
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A compaction started by [`Journal::compaction_due`]: what it needs to build the new file
/// without the journal's lock.
#[derive(Debug)]
pub struct Compaction {
    path: PathBuf,
    header: Vec<u8>,
    layout: u32,
    /// The journal's length when it began: the records before are compacted, the ones after
    /// copied as they are.
    end: usize,
    /// [`Journal::records`] then.
    records: u64,
}

/// A compacted journal, written to a temporary file but not yet in place.
#[derive(Debug)]
pub struct Built {
    tmp: PathBuf,
    file: Appender,
    end: usize,
    records: u64,
    /// Records in it: one commit per live object.
    objects: u64,
}

impl Built {
    fn discard(&mut self) {
        self.file.len = 0;
        let _ = std::fs::remove_file(&self.tmp);
    }
}

impl Compaction {
    /// Reads the journal's records up to where the compaction began (they never change once
    /// written), replays them, and writes the header and one commit per live object to a
    /// temporary file, allocated and mapped for the appends to come.
    pub fn build(self) -> io::Result<Built> {
        let mut bytes = vec![0u8; self.end];
        File::open(&self.path)?.read_exact_at(&mut bytes, 0)?;
        // Damage to the journal's own records (never expected) is `InvalidData`, which fails
        // the journal; any other error is the file system's, and the compaction is retried.
        let damaged = |e| io::Error::new(io::ErrorKind::InvalidData, e);
        let r = replay(&bytes, self.layout).map_err(|e| damaged(e.to_string()))?;
        if r.end != self.end as u64 {
            return Err(damaged("journal records end early".to_string()));
        }
        drop(bytes);
        let mut recs = Vec::with_capacity(r.objects.len() * 64);
        let mut b = [0u8; MAX_RECORD];
        for c in &r.objects {
            let n = encode_commit(&c.record(), &mut b);
            frame(&b[..n], &mut recs);
        }
        let tmp = compaction_path(&self.path);
        let file = write_new(&tmp, &self.header, &recs)?;
        Ok(Built {
            tmp,
            file: Appender::new(file, self.header.len() + recs.len())?,
            end: self.end,
            records: self.records,
            objects: r.objects.len() as u64,
        })
    }
}

/// A pool's journal, locked by its writers and compacted by a thread of its own.
#[derive(Debug)]
pub struct SharedJournal {
    journal: Arc<Mutex<Journal>>,
    compactor: Mutex<Option<JoinHandle<()>>>,
}

impl SharedJournal {
    /// Shares `journal`.
    pub fn new(journal: Journal) -> SharedJournal {
        SharedJournal {
            journal: Arc::new(Mutex::new(journal)),
            compactor: Mutex::new(None),
        }
    }

    /// Runs `f` on the journal under its lock, then starts a compaction on a thread of its
    /// own if one became due.
    pub fn with<R>(&self, f: impl FnOnce(&mut Journal) -> R) -> R {
        let (r, due) = {
            let mut j = lock(&self.journal);
            let r = f(&mut j);
            (r, j.compaction_due())
        };
        if let Some(c) = due {
            let mut compactor = lock(&self.compactor);
            // The previous compaction has finished (only one runs at a time), but its thread
            // may still be unmapping the old file: reaped if done, otherwise left to end on its
            // own rather than waited for here, under the caller's shard lock.
            if let Some(h) = compactor.take().filter(|h| h.is_finished()) {
                let _ = h.join();
            }
            let journal = Arc::clone(&self.journal);
            match std::thread::Builder::new()
                .name("kvpool-journal".into())
                .spawn(move || compact(&journal, c))
            {
                Ok(h) => *compactor = Some(h),
                // No thread to be had now: a later append tries again.
                Err(_) => lock(&self.journal).compacting = false,
            }
        }
        r
    }

    /// What the journal holds and has done.
    pub fn stats(&self) -> JournalStats {
        lock(&self.journal).stats()
    }

    /// Waits until no compaction is under way or due: the one under way finishes, then one
    /// that became due while it ran (and that no later append started) runs too. For tests,
    /// which need the file's size not to depend on how long a compaction took.
    pub fn settle(&self) {
        self.join();
        self.with(|_| ());
        self.join();
    }

    /// Waits for a compaction under way to finish (its file renamed in, or thrown away).
    fn join(&self) {
        if let Some(h) = lock(&self.compactor).take() {
            let _ = h.join();
        }
    }
}

impl Drop for SharedJournal {
    /// A compaction under way is waited for and thrown away: the journal as it stands is
    /// complete, and a pool opened on the same directory next must not find it renamed over.
    fn drop(&mut self) {
        lock(&self.journal).closed = true;
        self.join();
    }
}

/// Builds a compaction without the lock and finishes it under it.
fn compact(journal: &Mutex<Journal>, c: Compaction) {
    let built = c.build();
    let old = lock(journal).finish(built);
    drop(old);
}

/// A journal file open for appending through a mapping of it (see the module docs).
#[derive(Debug)]
struct Appender {
    file: File,
    /// The whole file: the records written, then zeros allocated ahead.
    map: MmapMut,
    /// Bytes written: the header and the records.
    len: usize,
}

impl Appender {
    /// Appends to `file`, whose first `len` bytes are written.
    fn new(file: File, len: usize) -> io::Result<Appender> {
        let map = reserve(&file, len + GROW_MIN)?;
        Ok(Appender { file, map, len })
    }

    /// Copies `parts`, one after the other, after the bytes written.
    fn append(&mut self, parts: &[&[u8]]) -> io::Result<()> {
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
fn write_whole(path: &Path, header: &[u8], records: &[u8]) -> io::Result<File> {
    let tmp = path.with_extension("kvj.tmp");
    let f = write_new(&tmp, header, records)?;
    std::fs::rename(&tmp, path)?;
    Ok(f)
}

/// Writes `header` and `records` to a new file at `path` (replacing any), open for reading
/// and writing, without renaming it anywhere.
fn write_new(path: &Path, header: &[u8], records: &[u8]) -> io::Result<File> {
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

fn frame(body: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&frame_head(body));
    out.extend_from_slice(body);
}

/// What goes before a record's body: its length and its xxh3.
fn frame_head(body: &[u8]) -> [u8; 12] {
    let mut head = [0u8; 12];
    head[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
    head[4..].copy_from_slice(&xxh3_64(body).to_le_bytes());
    head
}

/// Encodes a commit record's body into `b`; returns its length.
fn encode_commit(c: &Record<'_>, b: &mut [u8; MAX_RECORD]) -> usize {
    let key = &c.key[..c.key.len().min(MAX_KEY_LEN)];
    b[0] = TAG_COMMIT;
    b[1..5].copy_from_slice(&c.ns.to_le_bytes());
    b[5..7].copy_from_slice(&c.segment.to_le_bytes());
    b[7..15].copy_from_slice(&c.offset.to_le_bytes());
    b[15..23].copy_from_slice(&c.len.to_le_bytes());
    b[23..31].copy_from_slice(&c.checksum.to_le_bytes());
    b[31..39].copy_from_slice(&c.generation.to_le_bytes());
    b[39] = c.pinned as u8;
    b[40..44].copy_from_slice(&c.depth.to_le_bytes());
    b[44..46].copy_from_slice(&(key.len() as u16).to_le_bytes());
    b[46..46 + key.len()].copy_from_slice(key);
    COMMIT_FIXED + key.len()
}

/// The body of the whole, intact record at `pos`, if there is one.
fn record_at(bytes: &[u8], pos: usize) -> Option<&[u8]> {
    let head = bytes.get(pos..pos + 12)?;
    let len = u32_at(head, 0) as usize;
    if len == 0 || len > MAX_RECORD {
        return None;
    }
    let body = bytes.get(pos + 12..pos + 12 + len)?;
    (xxh3_64(body) == u64_at(head, 4)).then_some(body)
}

enum Decoded {
    Commit(Committed),
    Gone(u64),
    Pin(u64, bool),
}

fn decode(b: &[u8], namespaces: usize) -> Option<Decoded> {
    match *b.first()? {
        TAG_COMMIT if b.len() >= COMMIT_FIXED => {
            let key_len = u16::from_le_bytes([b[44], b[45]]) as usize;
            let ns = u32_at(b, 1);
            if b.len() != COMMIT_FIXED + key_len
                || key_len == 0
                || key_len > MAX_KEY_LEN
                || ns as usize >= namespaces
                || b[39] > 1
            {
                return None;
            }
            Some(Decoded::Commit(Committed {
                ns,
                segment: u16::from_le_bytes([b[5], b[6]]),
                offset: u64_at(b, 7),
                len: u64_at(b, 15),
                checksum: u64_at(b, 23),
                generation: u64_at(b, 31),
                pinned: b[39] == 1,
                depth: u32_at(b, 40),
                key: b[46..].to_vec(),
            }))
        }
        TAG_GONE if b.len() == 9 => Some(Decoded::Gone(u64_at(b, 1))),
        TAG_PIN if b.len() == 10 && b[9] <= 1 => Some(Decoded::Pin(u64_at(b, 1), b[9] == 1)),
        _ => None,
    }
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// A fresh directory, unique to this call.
    fn dir(name: &str) -> PathBuf {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let d =
            std::env::temp_dir().join(format!("kvpool-journal-{name}-{}-{n}", std::process::id()));
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
        let j = SharedJournal::new(
            Journal::create(&d, NodeId(0), 7, &["default".to_string()]).unwrap(),
        );
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
}
