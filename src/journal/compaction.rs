//! Compaction: a journal rewritten with only its live objects, built off the writers' locks by
//! a thread of its own while appends go on, then swapped in with what was appended meanwhile.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::sync::lock;

use super::file::{compaction_path, write_new, Appender};
use super::format::{encode_commit, frame, MAX_RECORD};
use super::{replay, Journal, JournalStats};

/// Records of slack before a compaction is considered.
pub(super) const COMPACT_SLACK: u64 = 1 << 16;

impl Journal {
    /// Counts a compaction that could not be written and puts the next one off by
    /// `COMPACT_SLACK` records; the journal as it stands is kept.
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
    pub(super) fn start_compaction(&mut self) -> Option<Compaction> {
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
    /// after `COMPACT_SLACK` more records; one that found the journal's own records damaged
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
