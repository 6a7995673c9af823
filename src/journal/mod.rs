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
//! The file is mapped and records are copied into it through the mapping (`Appender`): the
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

mod compaction;
mod file;
mod format;
mod replay;
mod writer;

pub use compaction::{Built, Compaction, SharedJournal};
pub use file::journal_file_name;
pub use format::{Committed, Record, JOURNAL_MAGIC, JOURNAL_VERSION};
pub use replay::{replay, JournalError, Replayed};
pub use writer::{Journal, JournalStats};

#[cfg(test)]
mod tests;
