//! Per-block version words: how a reader that raced with eviction and reuse finds out.
//!
//! Every allocation start has one 64-bit version word, kept in the segment itself so that a
//! same-host client that maps the segment can check it with plain loads. The word holds
//! `generation << 1 | busy`:
//!
//! - `0`: never used;
//! - `g << 1 | 1`: the block belongs to generation `g` and is being written (allocated, not yet
//!   committed) or has been retired (freed); reads must fail;
//! - `g << 1`: generation `g` is committed and readable.
//!
//! Generations come from one counter per pool and are never reused, so a global address that
//! names generation `g` can only ever be validated by the object it was issued for.
//!
//! The protocol is a seqlock with a single writer per block (the allocator hands a block to one
//! owner at a time):
//!
//! - owner, on allocation: [`begin`] stores `g << 1 | 1` then issues a release fence, *before*
//!   writing any byte; on commit, [`publish`] stores `g << 1` with release ordering;
//! - freer: [`retire`] stores `g << 1 | 1` before the block goes back to the allocator;
//! - reader: [`read_begin`] checks the word equals `g << 1` (acquire), copies the bytes, then
//!   [`read_validate`] issues an acquire fence and checks the word is unchanged.
//!
//! If a reader's copy saw any byte written by a later owner, that owner's release fence in
//! [`begin`] synchronises with the reader's acquire fence in [`read_validate`], so the reader is
//! guaranteed to observe a word other than `g << 1` and report a miss. The loom test
//! `tests/loom_seqlock.rs` checks this under every interleaving.

use crate::sync::{fence, AtomicU64, Ordering};

/// The busy bit: set while a block is being written or after it was freed.
pub const BUSY: u64 = 1;

/// The word value of a committed, readable block of generation `generation`.
#[inline]
pub const fn committed(generation: u64) -> u64 {
    generation << 1
}

/// The word value of a block of generation `generation` that is being written or was retired.
#[inline]
pub const fn writing(generation: u64) -> u64 {
    (generation << 1) | BUSY
}

/// Claims the block for `generation` before its owner writes any byte into it.
#[inline]
pub fn begin(word: &AtomicU64, generation: u64) {
    word.store(writing(generation), Ordering::Relaxed);
    // Orders the busy store before every data write that follows (see the module docs).
    fence(Ordering::Release);
}

/// Makes generation `generation` readable; all bytes written before are visible to a reader
/// that observes the new word.
#[inline]
pub fn publish(word: &AtomicU64, generation: u64) {
    word.store(committed(generation), Ordering::Release);
}

/// Marks a block of generation `generation` unreadable before it is freed.
#[inline]
pub fn retire(word: &AtomicU64, generation: u64) {
    word.store(writing(generation), Ordering::Relaxed);
    fence(Ordering::Release);
}

/// Starts a read of generation `generation`: true when the block currently holds it, committed.
#[inline]
pub fn read_begin(word: &AtomicU64, generation: u64) -> bool {
    word.load(Ordering::Acquire) == committed(generation)
}

/// Ends a read started by [`read_begin`]: true when no writer touched the block meanwhile, so
/// the bytes copied in between are exactly generation `generation`'s.
#[inline]
pub fn read_validate(word: &AtomicU64, generation: u64) -> bool {
    fence(Ordering::Acquire);
    word.load(Ordering::Relaxed) == committed(generation)
}

/// True when the block is held by generation `generation` and not yet committed: the only state
/// in which one-sided writes are accepted.
#[inline]
pub fn is_writing(word: &AtomicU64, generation: u64) -> bool {
    word.load(Ordering::Acquire) == writing(generation)
}
