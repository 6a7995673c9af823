//! The same-host fast path: the node's segments mapped into this process, read and written with
//! plain loads and stores, no syscall and no socket per operation.
//!
//! Every read checks the object's version word before and after the copy (the seqlock of
//! `kvpool::seqlock`), so a read that raced with eviction and reuse is reported as stale, never
//! returned. Writes go only into allocations that are still pending (version word says
//! "being written, generation g").

use std::fs::OpenOptions;

use kvpool::protocol::SegmentMap;
use kvpool::segment::{version_word, SegmentLayout};
use kvpool::{seqlock, AddrFault, GlobalAddr};
use memmap2::MmapRaw;

struct Mapped {
    map: MmapRaw,
    layout: SegmentLayout,
}

/// A node's segments, mapped.
pub(crate) struct LocalMap {
    node: u32,
    segments: Vec<Option<Mapped>>,
}

impl LocalMap {
    /// Maps every segment the node offered, checking each header names the node and segment.
    pub(crate) fn open(node: u32, maps: &[SegmentMap]) -> std::io::Result<LocalMap> {
        let mut segments: Vec<Option<Mapped>> = Vec::new();
        for m in maps {
            let file = OpenOptions::new().read(true).write(true).open(&m.path)?;
            let map = memmap2::MmapOptions::new()
                .len(m.total_len as usize)
                .map_raw(&file)?;
            // SAFETY: the header page is inside the mapping (total_len >= 4096 is checked by
            // decode against the mapped length) and is written once, before the node serves.
            let header = unsafe { std::slice::from_raw_parts(map.as_ptr(), 4096.min(map.len())) };
            let layout = SegmentLayout::decode(header, map.len() as u64)?;
            if layout.node.0 != node || layout.id != m.id {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "segment header names another node or segment",
                ));
            }
            let i = m.id as usize;
            if segments.len() <= i {
                segments.resize_with(i + 1, || None);
            }
            segments[i] = Some(Mapped { map, layout });
        }
        Ok(LocalMap { node, segments })
    }

    /// True when `addr` is in memory this process has mapped.
    pub(crate) fn covers(&self, addr: &GlobalAddr) -> bool {
        addr.node.0 == self.node
            && self
                .segments
                .get(addr.segment as usize)
                .is_some_and(|s| s.is_some())
    }

    /// Copies `dst.len()` bytes at `offset` of the committed object at `addr`.
    pub(crate) fn read(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), AddrFault> {
        let (seg, at) = self.locate(addr, offset, dst.len() as u64)?;
        let word =
            version_word(&seg.map, &seg.layout, addr.offset).ok_or(AddrFault::OutOfBounds)?;
        if !seqlock::read_begin(word, addr.generation) {
            return Err(AddrFault::Stale);
        }
        // SAFETY: `at..at+len` lies in the data area (checked by locate). The bytes may be
        // rewritten concurrently by the node or another client; they are plain bytes and are
        // discarded unless the version check below proves no write overlapped the copy.
        unsafe {
            std::ptr::copy_nonoverlapping(
                seg.map.as_ptr().add(at as usize),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        if !seqlock::read_validate(word, addr.generation) {
            return Err(AddrFault::Stale);
        }
        Ok(())
    }

    /// Copies `src` to `offset` inside the pending allocation at `addr`.
    pub(crate) fn write(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        src: &[u8],
    ) -> Result<(), AddrFault> {
        let (seg, at) = self.locate(addr, offset, src.len() as u64)?;
        let word =
            version_word(&seg.map, &seg.layout, addr.offset).ok_or(AddrFault::OutOfBounds)?;
        if !seqlock::is_writing(word, addr.generation) {
            return Err(AddrFault::NotWritable);
        }
        // SAFETY: in bounds of the mapping (locate). This is a raw copy of plain bytes, never a
        // reference, so it asserts no exclusivity in this process. Nothing in the daemon orders
        // it against other writers of the allocation (same-host writes take no write claim):
        // overlapping writers can only tear the bytes, which commit's checksum refuses, and a
        // write racing the reaper after the allocation's deadline can land in reused memory,
        // so callers must commit well within `pending_timeout_ms` (the version check above
        // narrows, but cannot close, that window).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                seg.map.as_mut_ptr().add(at as usize),
                src.len(),
            );
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
        let seg = self
            .segments
            .get(addr.segment as usize)
            .and_then(|s| s.as_ref())
            .ok_or(AddrFault::NoSegment)?;
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
