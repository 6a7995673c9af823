//! The same-host fast path: the node's segments mapped into this process, read and written with
//! plain loads and stores, no syscall and no socket per operation.
//!
//! Every read checks the object's version word before and after the copy (the seqlock of
//! `kvpool::seqlock`), so a read that raced with eviction and reuse is reported as stale, never
//! returned. Writes go only into allocations that are still pending (version word says
//! "being written, generation g").
//!
//! A mapping belongs to one incarnation of the daemon. Every access checks that the address is
//! of that incarnation and that the segment's incarnation word still holds it (a daemon that
//! exits, or a daemon restarted on the same directory, zeroes the word of the old file this
//! process may still map); otherwise it is refused with `WrongIncarnation` and the caller goes
//! through the socket, where the link notices the restart and maps the new files.
//!
//! Uses nothing else of the crate (only the core's segment layout and seqlock).

use std::sync::atomic::{AtomicU64, Ordering};

use kvpool::mapping::{AlignedMap, Mapped as _};
use kvpool::protocol::SegmentMap;
use kvpool::segment::{incarnation_word, version_word, SegmentLayout};
use kvpool::{seqlock, AddrFault, GlobalAddr};

/// One of the seqlock's read checks.
type VersionCheck = fn(&AtomicU64, u64) -> bool;

/// Pieces a skewed copy is cut into: below the size from which glibc's memcpy uses `rep movsb`
/// (2 KiB and up on x86-64), so each piece takes its vector loop.
const SKEWED_PIECE: usize = 1 << 10;

/// Copies `n` bytes from `src` to `dst`, which must not overlap.
///
/// glibc's memcpy moves blocks between a few KiB and its non-temporal threshold with
/// `rep movsb`, which runs about 4× slower when the destination lies 1 to 63 bytes past the
/// source modulo 4 KiB: every load then waits on an earlier store to the same page offset (4K
/// aliasing). That is exactly where a large malloc'd buffer (a numpy array, a torch tensor:
/// 16 bytes past a page) lands against a page-aligned object of the segment. Such a copy goes
/// in pieces small enough for memcpy's vector loop, which detects the aliasing and copies
/// backwards. Measured: 2 MiB in 64 KiB chunks, 720 µs skewed by 16 against 125 µs aligned; in
/// 1 KiB pieces 160 µs (docs/BENCHMARKS.md).
///
/// # Safety
/// `src..src+n` must be readable, `dst..dst+n` writable, and the two ranges disjoint.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, n: usize) {
    let skew = (dst as usize).wrapping_sub(src as usize) & 4095;
    if !(1..64).contains(&skew) || n <= SKEWED_PIECE {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    let mut done = 0;
    while done < n {
        let k = SKEWED_PIECE.min(n - done);
        // SAFETY: `done + k <= n`, so both pieces lie inside the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), k) };
        done += k;
    }
}

struct Mapped {
    map: AlignedMap,
    layout: SegmentLayout,
    /// The segment file (the descriptor the node passed), for read-only mappings of parts of
    /// it ([`ReadView`]).
    file: std::fs::File,
    /// Mapped read-write; otherwise read-only: never stored into.
    writable: bool,
}

impl Mapped {
    /// The segment's incarnation word (in the header page, inside the mapping).
    fn incarnation_word(&self) -> &AtomicU64 {
        incarnation_word(&self.map).expect("mapping checked to hold the header")
    }
}

/// Why a verified read returned no bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LocalReadError {
    /// The address was refused (stale, another incarnation, out of bounds, ...).
    Fault(AddrFault),
    /// The bytes copied do not hash to the object's checksum.
    Checksum,
}

/// A node's segments, mapped.
pub(crate) struct LocalMap {
    node: u32,
    incarnation: u64,
    segments: Vec<Option<Mapped>>,
}

impl LocalMap {
    /// Maps every segment the node offered (its descriptor passed with the offer), checking
    /// each header names the node and segment and holds incarnation `incarnation` (the one the
    /// `MapInfo` reply named). A segment offered read-only is mapped read-only, and never
    /// written through this mapping (writes to it go over the socket).
    pub(crate) fn open(
        node: u32,
        incarnation: u64,
        maps: Vec<(SegmentMap, std::os::fd::OwnedFd)>,
    ) -> std::io::Result<LocalMap> {
        let mut segments: Vec<Option<Mapped>> = Vec::new();
        for (m, fd) in maps {
            let file = std::fs::File::from(fd);
            // At a 2 MiB-aligned address, as the node maps it: the pages the node collapsed
            // into huge pages are then mapped huge here too (`kvpool::mapping`).
            let map = AlignedMap::map_shared(&file, m.total_len, m.writable, false)?;
            // SAFETY: the header page is inside the mapping (total_len >= 4096 is checked by
            // decode against the mapped length) and is written once, before the node serves.
            let header =
                unsafe { std::slice::from_raw_parts(map.base(), 4096.min(map.mapped_len())) };
            let layout = SegmentLayout::decode(header, map.mapped_len() as u64)?;
            if layout.node.0 != node || layout.id != m.id {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "segment header names another node or segment",
                ));
            }
            let writable = m.writable;
            let mapped = Mapped {
                map,
                layout,
                file,
                writable,
            };
            if incarnation == 0 || mapped.incarnation_word().load(Ordering::Acquire) != incarnation
            {
                // The file was replaced (the daemon restarted) between MapInfo and the open.
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "segment file is of another incarnation of the node",
                ));
            }
            let i = m.id as usize;
            if i >= u16::MAX as usize {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "segment number out of range",
                ));
            }
            if segments.len() <= i {
                segments.resize_with(i + 1, || None);
            }
            segments[i] = Some(mapped);
        }
        Ok(LocalMap {
            node,
            incarnation,
            segments,
        })
    }

    /// The incarnation of the daemon whose segments these are.
    pub(crate) fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// True when `addr` is in memory this process has mapped (of any incarnation: an access
    /// then says whether the incarnation is right).
    pub(crate) fn covers(&self, addr: &GlobalAddr) -> bool {
        self.mapped(addr).is_some()
    }

    /// The mapping of `addr`'s segment, when this process has one.
    fn mapped(&self, addr: &GlobalAddr) -> Option<&Mapped> {
        if addr.node.0 != self.node {
            return None;
        }
        self.segments.get(addr.segment as usize)?.as_ref()
    }

    /// Copies `dst.len()` bytes at `offset` of the committed object at `addr`. With `current`,
    /// the object must also still be its key's value (not one a holder keeps after a removal
    /// or an overwrite): a reader that found the address in its own index, not through a lease.
    pub(crate) fn read(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
        current: bool,
    ) -> Result<(), AddrFault> {
        self.read_with(addr, offset, dst, current, |src, dst| {
            // SAFETY: read_with's contract: `src` has `dst.len()` readable bytes of the mapping.
            unsafe { copy_bytes(src, dst.as_mut_ptr(), dst.len()) }
        })
    }

    /// Copies the whole committed object at `addr` into `dst` (exactly `addr.len` bytes) and
    /// checks that the bytes hash to `checksum` (xxh3-64), hashed in the same pass as the copy
    /// (each stripe is loaded once, stored and folded into the hash from the same registers).
    /// (`current` as for [`LocalMap::read`].)
    pub(crate) fn read_verified(
        &self,
        addr: &GlobalAddr,
        dst: &mut [u8],
        checksum: u64,
        current: bool,
    ) -> Result<(), LocalReadError> {
        if dst.len() as u64 != addr.len {
            return Err(LocalReadError::Fault(AddrFault::OutOfBounds));
        }
        let sum = self
            .read_with(addr, 0, dst, current, |src, dst| {
                // SAFETY: read_with's contract: `src` has `dst.len()` readable bytes of the
                // mapping (possibly written concurrently: copy_checksum only reads it through
                // the raw pointer), and `dst` is an exclusive buffer that cannot overlap it.
                unsafe { kvpool::checksum::copy_checksum(src, dst.as_mut_ptr(), dst.len()) }
            })
            .map_err(LocalReadError::Fault)?;
        if sum != checksum {
            return Err(LocalReadError::Checksum);
        }
        Ok(())
    }

    /// [`LocalMap::read_verified`] into several buffers: the object's bytes in order, as many
    /// as `pieces` hold together, which must be exactly the object's length. (`current` as
    /// for [`LocalMap::read`].)
    pub(crate) fn read_verified_scatter(
        &self,
        addr: &GlobalAddr,
        pieces: &mut [&mut [u8]],
        checksum: u64,
        current: bool,
    ) -> Result<(), LocalReadError> {
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        if len != addr.len {
            return Err(LocalReadError::Fault(AddrFault::OutOfBounds));
        }
        let sum = self
            .read_span(addr, 0, len, current, |src| {
                // SAFETY: read_span's contract: `src` has `len` readable bytes of the mapping
                // (possibly written concurrently: the kernel reads it only through the raw
                // pointer); the pieces are exclusive buffers, which cannot overlap it.
                unsafe { kvpool::checksum::copy_checksum_scatter(src, pieces) }
            })
            .map_err(LocalReadError::Fault)?;
        if sum != checksum {
            return Err(LocalReadError::Checksum);
        }
        Ok(())
    }

    /// True when the object at `addr` is committed and still its key's value right now (the
    /// check a read with `current` makes before it copies): a cheap look at one version word.
    pub(crate) fn is_current(&self, addr: &GlobalAddr) -> bool {
        let Ok((seg, _)) = self.locate(addr, 0, addr.len) else {
            return false;
        };
        version_word(&seg.map, &seg.layout, addr.offset)
            .is_some_and(|word| seqlock::read_begin_current(word, addr.generation))
    }

    /// The seqlock-checked copy: `copy(src, dst)` copies `dst.len()` bytes from the mapping at
    /// `src` (the bytes may be torn by a concurrent reuse; the version check after the copy
    /// says so, and then its result is dropped).
    fn read_with<R>(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
        current: bool,
        copy: impl FnOnce(*const u8, &mut [u8]) -> R,
    ) -> Result<R, AddrFault> {
        self.read_span(addr, offset, dst.len() as u64, current, |src| {
            copy(src, dst)
        })
    }

    /// The seqlock-checked access behind [`LocalMap::read_with`]: `copy(src)` reads `len` bytes
    /// of the mapping at `src` (they may be torn by a concurrent reuse; the version check after
    /// it says so, and then its result is dropped).
    fn read_span<R>(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        len: u64,
        current: bool,
        copy: impl FnOnce(*const u8) -> R,
    ) -> Result<R, AddrFault> {
        let (seg, at) = self.locate(addr, offset, len)?;
        let word =
            version_word(&seg.map, &seg.layout, addr.offset).ok_or(AddrFault::OutOfBounds)?;
        let (begin, validate): (VersionCheck, VersionCheck) = if current {
            (seqlock::read_begin_current, seqlock::read_validate_current)
        } else {
            (seqlock::read_begin, seqlock::read_validate)
        };
        if !begin(word, addr.generation) {
            return Err(AddrFault::Stale);
        }
        // `at..at+len` lies in the data area (checked by locate). The bytes may be rewritten
        // concurrently by the node or another client; they are plain bytes, read only through
        // this raw pointer, and discarded unless the version check below proves no write
        // overlapped the copy.
        let src = seg.map.base().wrapping_add(at as usize);
        let r = copy(src);
        if !validate(word, addr.generation) {
            return Err(AddrFault::Stale);
        }
        Ok(r)
    }

    /// True when some segment is mapped read-only: the node keeps this client's stores out of
    /// it (a read token, or `memory.same_host_writes`), so puts there want a staging area.
    pub(crate) fn has_read_only(&self) -> bool {
        self.segments.iter().flatten().any(|m| !m.writable)
    }

    /// True when `addr` is in a segment this process mapped read-write (see
    /// [`LocalMap::covers`]).
    pub(crate) fn covers_writable(&self, addr: &GlobalAddr) -> bool {
        self.mapped(addr).is_some_and(|m| m.writable)
    }

    /// Copies `src` to `offset` inside the pending allocation at `addr`. `NotWritable` for a
    /// segment mapped read-only.
    pub(crate) fn write(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        src: &[u8],
    ) -> Result<(), AddrFault> {
        let (seg, at) = self.locate(addr, offset, src.len() as u64)?;
        if !seg.writable {
            return Err(AddrFault::NotWritable);
        }
        let word =
            version_word(&seg.map, &seg.layout, addr.offset).ok_or(AddrFault::OutOfBounds)?;
        if !seqlock::is_writing(word, addr.generation) {
            return Err(AddrFault::NotWritable);
        }
        // SAFETY: in bounds of the mapping (locate), which is read-write (checked above). This
        // is a raw copy of plain bytes, never a reference, so it asserts no exclusivity in this
        // process. Nothing in the daemon orders it against other writers of the allocation
        // (same-host writes take no write claim): overlapping writers can only tear the bytes,
        // which commit's checksum refuses, and a write racing the reaper after the
        // allocation's deadline can land in reused memory, so callers must commit well within
        // `pending_timeout_ms` (the version check above narrows, but cannot close, that window).
        unsafe {
            copy_bytes(src.as_ptr(), seg.map.base().add(at as usize), src.len());
        }
        Ok(())
    }

    fn locate(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        len: u64,
    ) -> Result<(&Mapped, u64), AddrFault> {
        if addr.node.0 != self.node {
            return Err(AddrFault::WrongNode);
        }
        if addr.incarnation != self.incarnation {
            return Err(AddrFault::WrongIncarnation);
        }
        let seg = self
            .segments
            .get(addr.segment as usize)
            .and_then(|s| s.as_ref())
            .ok_or(AddrFault::NoSegment)?;
        if seg.incarnation_word().load(Ordering::Acquire) != self.incarnation {
            return Err(AddrFault::WrongIncarnation);
        }
        let end = addr
            .offset
            .checked_add(addr.len)
            .ok_or(AddrFault::OutOfBounds)?;
        if end > seg.layout.data_len {
            return Err(AddrFault::OutOfBounds);
        }
        let rel = addr.sub_range(offset, len).ok_or(AddrFault::OutOfBounds)?;
        Ok((seg, seg.layout.data_offset + rel))
    }
}

#[cfg(test)]
mod tests {
    use super::copy_bytes;

    /// Every skew class and length, including the piecewise path's partial last piece, copies
    /// exactly the bytes asked and nothing beyond them.
    #[test]
    fn skewed_copies_are_exact() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for skew in [0usize, 1, 16, 63, 64, 4095] {
            for n in [0usize, 1, 1023, 1024, 1025, 4096, 9_999] {
                let mut dst = vec![0xAAu8; n + skew + 8192];
                // Place the destination `skew` bytes past the source modulo 4 KiB.
                let base = dst.as_ptr() as usize;
                let want = (src.as_ptr() as usize + skew) & 4095;
                let at = (want + 4096 - (base & 4095)) & 4095;
                // SAFETY: `at + n <= dst.len()` and `n <= src.len()`; distinct allocations.
                unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr().add(at), n) };
                assert_eq!(&dst[at..at + n], &src[..n], "skew {skew} n {n}");
                assert!(dst[..at].iter().all(|b| *b == 0xAA));
                assert!(dst[at + n..].iter().all(|b| *b == 0xAA));
            }
        }
    }
}

/// Committed objects of this host's nodes mapped read-only and end to end into one range of
/// this process's memory: the bytes of several objects (a tensor's chunks) seen as one slice,
/// without a copy. The objects must be held (`Op::Hold`) for as long as the view is read: the
/// view maps the segment files themselves, so memory the daemon reused would show through.
/// Unmapped on drop.
pub struct ReadView {
    /// The reserved range (page aligned) and its length.
    base: *mut libc::c_void,
    reserved: usize,
    /// Where the first object's first byte landed, and the total length of the objects.
    data: *const u8,
    len: usize,
}

// SAFETY: the view is a read-only mapping that this value alone unmaps (on drop); nothing
// else refers to its range, so it may move to and be read from any thread.
unsafe impl Send for ReadView {}
// SAFETY: as above; reads through `&ReadView` never write the mapping.
unsafe impl Sync for ReadView {}

impl ReadView {
    /// The objects' bytes, end to end.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `data..data+len` lies inside the reserved range, every page of which is
        // mapped readable (stitch) until drop; the holds keep the daemon from rewriting it.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl Drop for ReadView {
    fn drop(&mut self) {
        // SAFETY: `base..base+reserved` is the range this view reserved and mapped; no slice
        // of it outlives `self` (as_slice borrows self).
        unsafe { libc::munmap(self.base, self.reserved) };
    }
}

/// Why objects could not be stitched into one [`ReadView`] (the caller copies them instead).
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// An address was refused (stale, another incarnation, out of bounds, ...).
    #[error("{0}")]
    Fault(AddrFault),
    /// The objects do not meet at page boundaries (only a view of one object, or of objects
    /// whose inner boundaries fall on pages, is possible).
    #[error("the objects are not page aligned end to end")]
    Unaligned,
    /// The kernel refused a mapping.
    #[error("mapping the objects failed: {0}")]
    Map(std::io::Error),
}

impl LocalMap {
    /// The segment file and file offset of the whole committed object at `addr`, checked like
    /// a read: node, incarnation, bounds, and a version word that says it is committed at the
    /// address's generation.
    fn file_range(&self, addr: &GlobalAddr) -> Result<(&Mapped, u64), AddrFault> {
        let (seg, at) = self.locate(addr, 0, addr.len)?;
        let word =
            version_word(&seg.map, &seg.layout, addr.offset).ok_or(AddrFault::OutOfBounds)?;
        if !seqlock::read_begin(word, addr.generation) {
            return Err(AddrFault::Stale);
        }
        Ok((seg, at))
    }
}

/// Maps the committed objects `parts` (each with the mapping of its node, of that mapping's
/// incarnation: a tensor's chunks may live on different nodes of this host) read-only, end to
/// end, into one range: see [`ReadView`]. The first object may start anywhere; every later one
/// must start on a page of its file and every earlier one end on one, so that the pages line
/// up. `populate`: fill in the page tables now (worth it when every byte is read at once, as a
/// verification does); otherwise each page is mapped on its first access.
pub(crate) fn stitch(
    parts: &[(&LocalMap, GlobalAddr)],
    populate: bool,
) -> Result<ReadView, ViewError> {
    let page = kvpool::mapping::page_size();
    let mut pieces = Vec::with_capacity(parts.len());
    for (i, (map, addr)) in parts.iter().enumerate() {
        let (seg, at) = map.file_range(addr).map_err(ViewError::Fault)?;
        let at = at as usize;
        let lead = at % page;
        let end = at + addr.len as usize;
        let last = i + 1 == parts.len();
        if (i > 0 && lead != 0) || (!last && end % page != 0) {
            return Err(ViewError::Unaligned);
        }
        let span = (end - (at - lead)).next_multiple_of(page);
        if (at - lead) + span > seg.map.mapped_len() {
            return Err(ViewError::Unaligned);
        }
        pieces.push((seg, at - lead, span, lead));
    }
    let len: usize = parts.iter().map(|(_, a)| a.len as usize).sum();
    let reserved: usize = pieces.iter().map(|p| p.2).sum::<usize>().max(page);
    let base = kvpool::mapping::reserve(reserved).map_err(ViewError::Map)?;
    let view = ReadView {
        base,
        reserved,
        data: (base as *const u8).wrapping_add(pieces.first().map_or(0, |p| p.3)),
        len,
    };
    let mut cursor = 0usize;
    for (seg, file_at, span, _) in pieces {
        use std::os::fd::AsRawFd;
        // SAFETY: `base+cursor .. +span` lies inside the reservation (the spans sum to
        // `reserved`), which this function owns, so MAP_FIXED replaces only our own pages;
        // `file_at .. +span` lies inside the segment file (checked above), at a page-aligned
        // offset. The mapping is read-only and shared, so it sees the daemon's bytes.
        let got = unsafe {
            libc::mmap(
                (base as *mut u8).add(cursor).cast(),
                span,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_FIXED | if populate { libc::MAP_POPULATE } else { 0 },
                seg.file.as_raw_fd(),
                file_at as libc::off_t,
            )
        };
        if got == libc::MAP_FAILED {
            // `view` unmaps the whole reservation on the way out.
            return Err(ViewError::Map(std::io::Error::last_os_error()));
        }
        cursor += span;
    }
    Ok(view)
}
