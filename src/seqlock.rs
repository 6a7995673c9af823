//! Per-block version words: how a reader that raced with eviction and reuse finds out.
//!
//! Every allocation start has one 64-bit version word, kept in the segment itself so that a
//! same-host client that maps the segment can check it with plain loads. The word holds
//! `generation << 2 | detached << 1 | busy`:
//!
//! - `0`: never used;
//! - `g << 2 | 1`: the block belongs to generation `g` and is being written (allocated, not yet
//!   committed) or has been retired (freed); reads must fail;
//! - `g << 2`: generation `g` is committed, readable, and the current value of its key;
//! - `g << 2 | 2`: generation `g` is committed and still readable by whoever holds its address
//!   (a lease parks the memory of an object that was removed or overwritten), but it is no
//!   longer its key's value: a reader that found the address through a cached lookup, not a
//!   lease, must treat it as a miss ([`read_begin_current`]).
//!
//! Generations come from one counter per pool and are never reused, so a global address that
//! names generation `g` can only ever be validated by the object it was issued for.
//!
//! The protocol is a seqlock with a single writer per block (the allocator hands a block to one
//! owner at a time):
//!
//! - owner, on allocation: [`begin`] stores `g << 2 | 1` then issues a release fence, *before*
//!   writing any byte; on commit, [`publish`] stores `g << 2` with release ordering;
//! - index: when the object leaves the index while readers hold its memory, [`detach`] sets the
//!   detached bit (no byte changes, so holders read on; see the list above);
//! - freer: [`retire`] stores `g << 2 | 1` before the block goes back to the allocator;
//! - reader: [`read_begin`] checks the word is `g << 2`, detached or not (acquire), copies the bytes, then
//!   [`read_validate`] issues an acquire fence and checks the word is unchanged.
//!
//! If a reader's copy saw any byte written by a later owner, that owner's release fence in
//! [`begin`] synchronises with the reader's acquire fence in [`read_validate`], so the reader is
//! guaranteed to observe a word other than `g << 2` and report a miss. The loom test
//! `tests/loom_seqlock.rs` checks this under every interleaving.

use crate::sync::{fence, AtomicU64, Ordering};

/// The busy bit: set while a block is being written or after it was freed.
pub const BUSY: u64 = 1;

/// The detached bit: set on a committed block whose object left the index while readers held it.
pub const DETACHED: u64 = 2;

/// The word value of a committed, readable block of generation `generation`.
#[inline]
pub const fn committed(generation: u64) -> u64 {
    generation << 2
}

/// The word value of a block of generation `generation` that is being written or was retired.
#[inline]
pub const fn writing(generation: u64) -> u64 {
    (generation << 2) | BUSY
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

/// Marks the committed block of generation `generation` as no longer its key's value while
/// holders may still read it (its object left the index but its memory is parked). Does nothing
/// when the word holds anything else.
#[inline]
pub fn detach(word: &AtomicU64, generation: u64) {
    let _ = word.compare_exchange(
        committed(generation),
        committed(generation) | DETACHED,
        Ordering::Release,
        Ordering::Relaxed,
    );
}

/// Starts a read of generation `generation` by an address holder: true when the block holds
/// it, committed (detached or not).
#[inline]
pub fn read_begin(word: &AtomicU64, generation: u64) -> bool {
    word.load(Ordering::Acquire) & !DETACHED == committed(generation)
}

/// Ends a read started by [`read_begin`]: true when no writer touched the block meanwhile, so
/// the bytes copied in between are exactly generation `generation`'s.
#[inline]
pub fn read_validate(word: &AtomicU64, generation: u64) -> bool {
    fence(Ordering::Acquire);
    word.load(Ordering::Relaxed) & !DETACHED == committed(generation)
}

/// [`read_begin`] for a reader that wants its key's current value: false also when the block
/// was detached.
#[inline]
pub fn read_begin_current(word: &AtomicU64, generation: u64) -> bool {
    word.load(Ordering::Acquire) == committed(generation)
}

/// [`read_validate`] for a read started by [`read_begin_current`]: false also when the block
/// was detached meanwhile.
#[inline]
pub fn read_validate_current(word: &AtomicU64, generation: u64) -> bool {
    fence(Ordering::Acquire);
    word.load(Ordering::Relaxed) == committed(generation)
}

/// True when the block is held by generation `generation` and not yet committed: the only state
/// in which one-sided writes are accepted.
#[inline]
pub fn is_writing(word: &AtomicU64, generation: u64) -> bool {
    word.load(Ordering::Acquire) == writing(generation)
}
