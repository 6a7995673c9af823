//! The writer of a pool's journal: each record appended through the mapping before the
//! operation it describes returns, or held back during a recovery.

use std::io;
use std::path::{Path, PathBuf};

use crate::addr::NodeId;

use super::file::{compaction_path, journal_file_name, write_whole, Appender};
use super::format::{
    encode_commit, frame, frame_head, header, Record, MAX_RECORD, TAG_GONE, TAG_PIN,
};

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

/// The writer of a pool's journal.
#[derive(Debug)]
pub struct Journal {
    pub(super) path: PathBuf,
    /// None once a write failed (see [`Journal::healthy`]).
    pub(super) file: Option<Appender>,
    pub(super) header: Vec<u8>,
    pub(super) layout: u32,
    /// Records since the file was last written whole.
    pub(super) records: u64,
    /// Commits minus gones since then, plus the objects it started with.
    pub(super) live: u64,
    /// Records held back by [`Journal::hold`] until [`Journal::release`].
    pub(super) held: Option<Vec<u8>>,
    /// A compaction was started and has not finished.
    pub(super) compacting: bool,
    /// No compaction starts before `records` reaches this (set when one could not be written,
    /// a full disk say: the journal as it stands is kept, and tried again later).
    pub(super) retry_at: u64,
    /// The pool is gone: a compaction finishing now is thrown away.
    pub(super) closed: bool,
    /// Compactions finished, and those that could not be written.
    pub(super) compactions: u64,
    pub(super) compaction_failures: u64,
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
        let header = header(node, layout, namespaces);
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

    pub(super) fn fail(&mut self) {
        if let Some(mut f) = self.file.take() {
            f.len = 0;
        }
        let _ = std::fs::remove_file(&self.path);
    }
}
