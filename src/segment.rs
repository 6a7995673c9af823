//! Segments: the DRAM a node contributes, mapped so that same-host clients can map it too.
//!
//! A segment is one mapping of a file (by default under `/dev/shm`, so tmpfs pages that any
//! process of the host can map) or of anonymous memory. Its layout, written in a header at the
//! start so that a client can check what it mapped:
//!
//! ```text
//! [0, 4096)                      header: magic, layout version, ids, granule, region offsets,
//!                                and at byte 64 the incarnation word (see below)
//! [versions_offset, +8*n)        one AtomicU64 version word per granule of the data area
//! [data_offset, +data_len)       the objects, aligned to 2 MiB (huge-page friendly)
//! ```
//!
//! The version word of the granule where an object starts is that object's seqlock word (see
//! [`crate::seqlock`]).
//!
//! The incarnation word holds the incarnation of the daemon that created the segment while that
//! daemon serves it, and 0 once the segment is retired: when the daemon drops it, or when a
//! daemon restarted on the same directory finds the file a dead daemon left (it zeroes the word,
//! then replaces the file). A same-host client still mapping a retired file (its unlinked pages
//! stay mapped) checks this word on every access and refuses the mapping instead of serving the
//! dead daemon's bytes. Everything here is bounds-checked; the raw accessors are `unsafe` and
//! say what their callers must guarantee.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use crate::addr::NodeId;
use crate::mapping::{AlignedMap, Frontier, HugeRegions, Mapped, HUGE_PAGE, MADV_POPULATE_WRITE};

/// Magic bytes at the start of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"KVPOOLSG";
/// Version of the on-memory layout described in the module docs. 3: version words carry the
/// detached bit (`g << 2 | detached << 1 | busy`); a client of another layout maps nothing and
/// reads through the socket.
pub const LAYOUT_VERSION: u32 = 3;
/// Byte offset in the header of the incarnation word (an `AtomicU64`; 0: retired).
pub const INCARNATION_OFFSET: usize = 64;
const HEADER_LEN: u64 = 4096;
const DATA_ALIGN: u64 = HUGE_PAGE;

/// Whether to ask for huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// Try the best available and fall back to normal pages, logging what was obtained.
    #[default]
    Auto,
    /// Normal pages only.
    Off,
}

/// What backs a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A file in this directory (tmpfs or hugetlbfs): same-host clients can map it.
    File(PathBuf),
    /// Anonymous memory: private to the daemon, no same-host mapping.
    Anonymous,
}

/// Which kind of pages a segment got, for the logs and stats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageKind {
    /// Explicit huge pages (`MAP_HUGETLB` or a hugetlbfs file).
    HugeTlb,
    /// Normal pages with `MADV_HUGEPAGE` advice: the kernel may back them with transparent huge
    /// pages, depending on its settings. The data area is also collapsed into huge pages a
    /// 2 MiB region at a time as it is first used, where the mapping allows it
    /// ([`Segment::huge_regions`]).
    TransparentAdvised,
    /// Normal pages.
    Normal,
}

/// How to create a segment.
#[derive(Clone, Debug)]
pub struct SegmentSpec {
    /// Node that owns the segment.
    pub node: NodeId,
    /// Segment number within the node.
    pub id: u32,
    /// Size of the data area in bytes (rounded down to a multiple of the allocator page size by
    /// the caller).
    pub data_len: u64,
    /// Granule of the version table: every object starts on a multiple of it.
    pub granule: u64,
    /// Backing memory.
    pub backing: Backing,
    /// Huge page policy.
    pub huge_pages: HugePages,
    /// Touch every page at creation (`MAP_POPULATE`) so the first writes don't fault.
    pub prefault: bool,
    /// Incarnation of the daemon, written into the header's incarnation word.
    pub incarnation: u64,
}

/// The fixed header at the start of a segment, as read back by a mapping client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentLayout {
    /// Owning node.
    pub node: NodeId,
    /// Segment number.
    pub id: u32,
    /// Version word granule.
    pub granule: u64,
    /// Offset of the version table.
    pub versions_offset: u64,
    /// Offset of the data area.
    pub data_offset: u64,
    /// Length of the data area.
    pub data_len: u64,
}

impl SegmentLayout {
    /// The layout for a data area of `data_len` bytes with version words every `granule` bytes.
    pub fn new(node: NodeId, id: u32, data_len: u64, granule: u64) -> Self {
        let words = data_len.div_ceil(granule);
        let versions_offset = HEADER_LEN;
        let data_offset = (versions_offset + words * 8).next_multiple_of(DATA_ALIGN);
        SegmentLayout {
            node,
            id,
            granule,
            versions_offset,
            data_offset,
            data_len,
        }
    }

    /// Total bytes of the mapping.
    pub fn total_len(&self) -> u64 {
        self.data_offset + self.data_len
    }

    fn encode(&self) -> [u8; 56] {
        let mut b = [0u8; 56];
        b[0..8].copy_from_slice(&SEGMENT_MAGIC);
        b[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.node.0.to_le_bytes());
        b[16..20].copy_from_slice(&self.id.to_le_bytes());
        b[24..32].copy_from_slice(&self.granule.to_le_bytes());
        b[32..40].copy_from_slice(&self.versions_offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.data_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.data_len.to_le_bytes());
        b
    }

    /// Parses and checks a header read from the start of a mapping of `mapped_len` bytes.
    pub fn decode(b: &[u8], mapped_len: u64) -> io::Result<Self> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        if b.len() < 56 || b[0..8] != SEGMENT_MAGIC {
            return Err(bad("not a kvpool segment (bad magic)"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(8) != LAYOUT_VERSION {
            return Err(bad("unsupported segment layout version"));
        }
        let l = SegmentLayout {
            node: NodeId(u32_at(12)),
            id: u32_at(16),
            granule: u64_at(24),
            versions_offset: u64_at(32),
            data_offset: u64_at(40),
            data_len: u64_at(48),
        };
        let expect = SegmentLayout::new(l.node, l.id, l.data_len, l.granule.max(1));
        if !l.granule.is_power_of_two() || l != expect || l.total_len() > mapped_len {
            return Err(bad("inconsistent segment header"));
        }
        Ok(l)
    }
}

/// A segment's mapping: a file's at a huge-page-aligned address, or memmap2's.
enum SegmentMap {
    Aligned(AlignedMap),
    Raw(MmapRaw),
}

// SAFETY: both variants own their mapping for the enum's life.
unsafe impl Mapped for SegmentMap {
    fn base(&self) -> *mut u8 {
        match self {
            SegmentMap::Aligned(m) => m.base(),
            SegmentMap::Raw(m) => m.base(),
        }
    }
    fn mapped_len(&self) -> usize {
        match self {
            SegmentMap::Aligned(m) => m.mapped_len(),
            SegmentMap::Raw(m) => m.mapped_len(),
        }
    }
}

/// A mapped segment.
pub struct Segment {
    layout: SegmentLayout,
    map: SegmentMap,
    path: Option<PathBuf>,
    pages: PageKind,
    /// The data area's 2 MiB regions collapsed into huge pages as they are first used; None
    /// with `HugePages::Off`, explicit huge pages, or a data area not 2 MiB aligned in memory.
    huge: Option<HugeRegions>,
    /// How far allocations reached, and the prefaulting ahead of them.
    frontier: Frontier,
    /// Keep the file when dropped (retired all the same), for the next life to recover.
    keep_file: bool,
}

// SAFETY: the mapping is plain shared memory owned by the segment for its whole life. Shared
// access from several threads goes through `unsafe fn data` / `data_mut`, whose callers must hold
// what makes the range theirs (in the pool: a reader reference, or a write claim of the pending
// table, see `kvpool::claims`), through `copy_out_racy`, whose result is discarded unless the
// seqlock validates it, and through the version words, which are atomics.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates (or replaces) a segment as `spec` says.
    pub fn create(spec: &SegmentSpec) -> io::Result<Segment> {
        let layout = SegmentLayout::new(spec.node, spec.id, spec.data_len, spec.granule);
        let len = layout.total_len();
        let (map, path, pages) = match &spec.backing {
            Backing::Anonymous => {
                let (map, pages) = map_anonymous(len, spec)?;
                (map, None, pages)
            }
            Backing::File(dir) => {
                create_dir(dir)?;
                let path = dir.join(segment_file_name(spec.node, spec.id));
                // A stale file from an earlier run is replaced, never reused: its version words
                // would validate addresses of objects that no longer exist. It is retired first,
                // for clients that still map it.
                retire_file(&path);
                let _ = std::fs::remove_file(&path);
                let file = OpenOptions::new()
                    .mode(0o600)
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&path)?;
                file.set_len(len)?;
                let (map, pages) = map_file(&file, len, spec)?;
                (map, Some(path), pages)
            }
        };
        let mut seg = Segment {
            layout,
            map,
            path,
            pages,
            huge: None,
            frontier: Frontier::default(),
            keep_file: false,
        };
        if pages == PageKind::TransparentAdvised && seg.data_ptr() as u64 % HUGE_PAGE == 0 {
            let regions = HugeRegions::new(layout.data_len);
            if spec.prefault {
                // SAFETY: the data area is mapped while `seg` lives.
                unsafe { regions.back(seg.data_ptr(), layout.data_len, 0, layout.data_len) };
            }
            seg.huge = Some(regions);
        }
        // SAFETY: the header page lies inside the fresh mapping and nobody else has it yet.
        unsafe {
            let hdr = layout.encode();
            std::ptr::copy_nonoverlapping(hdr.as_ptr(), seg.map.base(), hdr.len());
        }
        incarnation_word(&seg.map)
            .expect("the header page is mapped")
            .store(spec.incarnation, Ordering::Release);
        Ok(seg)
    }

    /// Leaves the file in place when the segment is dropped (a clean stop), so that a pool
    /// started next on the same directory can recover its objects. The file is retired all the
    /// same: clients still mapping it stop reading it.
    pub fn keep_file_on_drop(&mut self) {
        self.keep_file = true;
    }

    /// The incarnation in the header (0 once retired).
    pub fn incarnation(&self) -> u64 {
        incarnation_word(&self.map).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// The whole mapping (header, version words, data): its first byte and length, to
    /// register with a fabric. It stays mapped at that address for as long as the segment
    /// lives.
    pub fn mapping(&self) -> (std::ptr::NonNull<u8>, usize) {
        let base = std::ptr::NonNull::new(self.map.base()).expect("a mapping is never at 0");
        (base, self.map.mapped_len())
    }

    /// Layout of this segment.
    pub fn layout(&self) -> &SegmentLayout {
        &self.layout
    }

    /// Path of the backing file, if any (what same-host clients map).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Which pages the segment got.
    pub fn page_kind(&self) -> PageKind {
        self.pages
    }

    /// Prepares the block `[offset, offset + len)` the pool just allocated, before anyone writes
    /// it: backs the data area's 2 MiB regions it touches with huge pages, each the first time
    /// (`MADV_COLLAPSE`; see [`crate::mapping`]; best effort, and nothing where the segment
    /// does not collapse), and moves the frontier the prefaulting thread works ahead of. True
    /// when the block reached a region no block had reached before.
    pub fn back_block(&self, offset: u64, len: u64) -> bool {
        if !self.in_bounds(offset, len) {
            return false;
        }
        if let Some(h) = &self.huge {
            // SAFETY: the data area is mapped while `self` lives.
            unsafe { h.back(self.data_ptr(), self.layout.data_len, offset, len) };
        }
        self.frontier.reach(offset, len)
    }

    /// Faults in the next 2 MiB region ahead of the allocations, when the frontier leaves one
    /// within `window` bytes (see [`Frontier`]): collapsed into a huge page where the segment
    /// collapses, else every page of it faulted in for writing (`MADV_POPULATE_WRITE`). Not a
    /// byte of the region changes, so it is safe whoever reads or writes it meanwhile. False
    /// when there is nothing to do.
    pub fn prefault_next(&self, window: u64) -> bool {
        let data_len = self.layout.data_len;
        let Some(r) = self.frontier.take_next(window, data_len / HUGE_PAGE) else {
            return false;
        };
        let start = r * HUGE_PAGE;
        if let Some(h) = &self.huge {
            // SAFETY: the data area is mapped while `self` lives.
            unsafe { h.back(self.data_ptr(), data_len, start, HUGE_PAGE) };
        }
        // After a collapse this finds every page present; where the kernel did not collapse,
        // or the segment does not, it faults the region in.
        // SAFETY: `take_next` hands out only whole regions inside the data area (r < data_len /
        // HUGE_PAGE), which is mapped while `self` lives and starts page aligned; the advice
        // changes no byte.
        unsafe {
            libc::madvise(
                self.data_ptr().add(start as usize).cast(),
                HUGE_PAGE as usize,
                MADV_POPULATE_WRITE,
            );
        }
        true
    }

    /// Bytes of the data area faulted in ahead of the allocations so far.
    pub fn prefaulted_bytes(&self) -> u64 {
        self.frontier.prefaulted() * HUGE_PAGE
    }

    /// The data area's 2 MiB regions the kernel collapsed into huge pages, and those it did
    /// not; (0, 0) where the segment does not collapse.
    pub fn huge_regions(&self) -> (u64, u64) {
        self.huge.as_ref().map_or((0, 0), HugeRegions::counts)
    }

    /// Length of the data area.
    pub fn data_len(&self) -> u64 {
        self.layout.data_len
    }

    /// The version word of the object starting at data offset `offset`, or None when `offset` is
    /// out of range or not on a granule boundary.
    pub fn version(&self, offset: u64) -> Option<&AtomicU64> {
        version_word(&self.map, &self.layout, offset)
    }

    /// True when `[offset, offset + len)` lies in the data area.
    pub fn in_bounds(&self, offset: u64, len: u64) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.layout.data_len)
    }

    /// The data bytes `[offset, offset + len)` for reading.
    ///
    /// # Safety
    /// The range must be in bounds and nobody may write it while the slice lives: the caller
    /// holds a read reference on the object (the pool's reader count) that stops it from being
    /// freed and reused, and committed objects are never written.
    pub unsafe fn data(&self, offset: u64, len: u64) -> &[u8] {
        debug_assert!(self.in_bounds(offset, len));
        // SAFETY: in bounds of the mapping (caller's contract); no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.data_ptr().add(offset as usize), len as usize) }
    }

    /// The data bytes `[offset, offset + len)` for writing.
    ///
    /// # Safety
    /// The range must be in bounds and belong to an allocation the caller owns exclusively (a
    /// pending, uncommitted object), and no other slice of it may be live.
    #[expect(
        clippy::mut_from_ref,
        reason = "shared memory: exclusivity is the caller's contract"
    )]
    pub unsafe fn data_mut(&self, offset: u64, len: u64) -> &mut [u8] {
        debug_assert!(self.in_bounds(offset, len));
        // SAFETY: in bounds; exclusive by the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.data_ptr().add(offset as usize), len as usize)
        }
    }

    /// Copies `[offset, offset + dst.len())` into `dst` without any exclusivity: the bytes may be
    /// concurrently rewritten, so the caller must validate the object's version afterwards
    /// (seqlock). Returns false when out of bounds.
    pub fn copy_out_racy(&self, offset: u64, dst: &mut [u8]) -> bool {
        if !self.in_bounds(offset, dst.len() as u64) {
            return false;
        }
        // SAFETY: in bounds. The source may be written concurrently by another owner (possibly
        // another process): the bytes are plain `u8`s (every value valid) and the caller
        // discards them unless the version check proves no write overlapped the copy.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.data_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        true
    }

    fn data_ptr(&self) -> *mut u8 {
        // SAFETY: data_offset < total_len, the mapping's length.
        unsafe { self.map.base().add(self.layout.data_offset as usize) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Some(w) = incarnation_word(&self.map) {
            w.store(0, Ordering::Release);
        }
        if let Some(p) = self.path.as_ref().filter(|_| !self.keep_file) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A segment file a previous life of the node left, opened read-only to copy its objects out.
/// It is read with `pread` rather than mapped: no page faults on the old pages, a hole reads as
/// zeros without allocating, and a file shortened meanwhile is an error, not a SIGBUS. Clients
/// of that life may still write it through their mappings, so callers check what they copied
/// (by checksum) before using it.
pub struct RetiredSegment {
    layout: SegmentLayout,
    file: File,
}

impl RetiredSegment {
    /// Opens segment `id` of `node` in `dir`, if it is there and has a layout this build reads.
    pub fn open(dir: &Path, node: NodeId, id: u32) -> io::Result<RetiredSegment> {
        use std::os::unix::fs::FileExt;
        let path = dir.join(segment_file_name(node, id));
        let file = OpenOptions::new().read(true).open(&path)?;
        let len = file.metadata()?.len();
        let mut header = [0u8; 56];
        file.read_exact_at(&mut header, 0)?;
        let layout = SegmentLayout::decode(&header, len)?;
        if layout.node != node || layout.id != id {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "segment file names another node or segment",
            ));
        }
        Ok(RetiredSegment { layout, file })
    }

    /// Its layout.
    pub fn layout(&self) -> &SegmentLayout {
        &self.layout
    }

    /// Copies data bytes `[offset, offset + dst.len())` into `dst`; false when out of bounds or
    /// unreadable.
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> bool {
        use std::os::unix::fs::FileExt;
        let in_bounds = offset
            .checked_add(dst.len() as u64)
            .is_some_and(|end| end <= self.layout.data_len);
        in_bounds
            && self
                .file
                .read_exact_at(dst, self.layout.data_offset + offset)
                .is_ok()
    }
}

/// The version word for `offset` inside a mapping with this layout; shared with the client's
/// read-only mapping code.
pub fn version_word<'a, M: Mapped>(
    map: &'a M,
    layout: &SegmentLayout,
    offset: u64,
) -> Option<&'a AtomicU64> {
    if offset >= layout.data_len || offset % layout.granule != 0 {
        return None;
    }
    let at = layout.versions_offset + (offset / layout.granule) * 8;
    if at + 8 > map.mapped_len() as u64 {
        return None;
    }
    // SAFETY: `at` is in bounds (checked), 8-byte aligned (versions_offset is 4096 and the
    // mapping is page aligned), and the word is only ever accessed atomically.
    Some(unsafe { &*(map.base().add(at as usize) as *const AtomicU64) })
}

/// The incarnation word of a mapping's header, or None when the mapping is shorter than the
/// header; shared with the client's mapping code.
pub fn incarnation_word<M: Mapped>(map: &M) -> Option<&AtomicU64> {
    if map.mapped_len() < HEADER_LEN as usize {
        return None;
    }
    // SAFETY: the word lies inside the header page (checked), is 8-byte aligned (the mapping
    // is page aligned, the offset a multiple of 8) and is only ever accessed atomically.
    Some(unsafe { &*(map.base().add(INCARNATION_OFFSET) as *const AtomicU64) })
}

/// Retires a segment file a dead daemon left behind: if it is a kvpool segment, zeroes its
/// incarnation word so that clients still mapping it stop reading it. Best effort: a file that
/// can't be opened or is not a segment is left to be replaced.
/// Creates `dir` (and its parents) if missing, mode 0711: reachable by name for other users
/// (the daemon's socket may live there), not listable; the files in it are the owner's alone.
/// An existing directory is left as it is.
pub fn create_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(dir)
}

/// Retires and removes node `node`'s segment files in `dir` numbered `count` and up: what an
/// earlier life with more segments (or other namespaces with segments of their own) left and
/// this one does not replace. Returns how many went.
pub fn remove_beyond(dir: &Path, node: NodeId, count: u32) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_str().unwrap_or_default();
        // Segment ids are the file name's last number; the whole name must be what
        // `segment_file_name` gives for it.
        let id = name
            .rsplit(['-', '.'])
            .nth(1)
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|&id| segment_file_name(node, id) == name);
        if id.is_some_and(|id| id >= count) {
            retire_file(&e.path());
            removed += std::fs::remove_file(e.path()).is_ok() as usize;
        }
    }
    removed
}

fn retire_file(path: &Path) {
    let Ok(file) = OpenOptions::new().read(true).write(true).open(path) else {
        return;
    };
    // Touching a mapped page beyond the end of the file would fault (SIGBUS).
    if file.metadata().map_or(true, |m| m.len() < HEADER_LEN) {
        return;
    }
    let Ok(map) = MmapOptions::new().len(HEADER_LEN as usize).map_raw(&file) else {
        return;
    };
    // SAFETY: the header page is mapped and backed by the file (checked above); read only.
    let magic = unsafe { std::slice::from_raw_parts(map.as_ptr(), SEGMENT_MAGIC.len()) };
    if magic == SEGMENT_MAGIC {
        if let Some(w) = incarnation_word(&map) {
            w.store(0, Ordering::Release);
        }
    }
}

/// The kernel's boot id: equal for two processes exactly when they share a host (and boot), so
/// a client can tell it may map a node's segments.
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The file name of segment `id` of `node` inside the data directory.
pub fn segment_file_name(node: NodeId, id: u32) -> String {
    format!("segment-{}-{}.kvp", node.0, id)
}

fn map_anonymous(len: u64, spec: &SegmentSpec) -> io::Result<(SegmentMap, PageKind)> {
    let mut opts = MmapOptions::new();
    opts.len(len as usize);
    if spec.prefault {
        opts.populate();
    }
    if spec.huge_pages == HugePages::Auto {
        let mut huge = opts.clone();
        huge.huge(None);
        if let Ok(m) = huge.map_anon() {
            return Ok((SegmentMap::Raw(m.into()), PageKind::HugeTlb));
        }
    }
    let map: MmapRaw = opts.map_anon()?.into();
    let advised =
        spec.huge_pages == HugePages::Auto && map.advise(memmap2::Advice::HugePage).is_ok();
    Ok((SegmentMap::Raw(map), page_kind(advised)))
}

fn map_file(file: &File, len: u64, spec: &SegmentSpec) -> io::Result<(SegmentMap, PageKind)> {
    if on_hugetlbfs(file) {
        let mut opts = MmapOptions::new();
        opts.len(len as usize);
        if spec.prefault {
            opts.populate();
        }
        return Ok((SegmentMap::Raw(opts.map_raw(file)?), PageKind::HugeTlb));
    }
    // At a 2 MiB-aligned address, so that the data area can be mapped with huge pages.
    let map = AlignedMap::map_shared(file, len, true, spec.prefault)?;
    let advised = spec.huge_pages == HugePages::Auto && map.advise_huge();
    Ok((SegmentMap::Aligned(map), page_kind(advised)))
}

fn page_kind(advised: bool) -> PageKind {
    match advised {
        true => PageKind::TransparentAdvised,
        false => PageKind::Normal,
    }
}

fn on_hugetlbfs(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    // SAFETY: fstatfs writes into the zeroed struct we own; the fd is valid for the call.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::fstatfs(file.as_raw_fd(), &mut st) == 0 && st.f_type as i64 == HUGETLBFS_MAGIC
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path) -> SegmentSpec {
        SegmentSpec {
            node: NodeId(3),
            id: 1,
            data_len: 4 << 20,
            granule: 512,
            backing: Backing::File(dir.to_path_buf()),
            huge_pages: HugePages::Auto,
            prefault: false,
            incarnation: 7,
        }
    }

    #[test]
    fn file_segment_header_round_trips_and_is_removed_on_drop() {
        let dir = std::env::temp_dir().join(format!("kvpool-seg-test-{}", std::process::id()));
        let seg = Segment::create(&spec(&dir)).unwrap();
        let path = seg.path().unwrap().to_path_buf();
        let bytes = std::fs::read(&path).unwrap();
        let l = SegmentLayout::decode(&bytes, bytes.len() as u64).unwrap();
        assert_eq!(&l, seg.layout());
        assert_eq!(l.data_offset % DATA_ALIGN, 0);
        assert!(seg.version(0).is_some());
        assert!(seg.version(511).is_none());
        assert!(seg.version(4 << 20).is_none());
        assert!(seg.in_bounds((4 << 20) - 1, 1));
        assert!(!seg.in_bounds((4 << 20) - 1, 2));
        assert!(!seg.in_bounds(u64::MAX, 2));
        let mut out = [0u8; 4];
        assert!(!seg.copy_out_racy((4 << 20) - 2, &mut out));
        drop(seg);
        assert!(!path.exists());
        let _ = std::fs::remove_dir(&dir);
    }

    #[test]
    fn a_replaced_or_dropped_segment_is_retired_for_clients_that_still_map_it() {
        let dir = std::env::temp_dir().join(format!("kvpool-seg-retire-{}", std::process::id()));
        let first = Segment::create(&spec(&dir)).unwrap();
        assert_eq!(first.incarnation(), 7);
        let path = first.path().unwrap().to_path_buf();
        // A client's mapping of the first file.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let client = MmapOptions::new().len(4096).map_raw(&file).unwrap();
        let word = incarnation_word(&client).unwrap();
        assert_eq!(word.load(Ordering::Acquire), 7);
        // A restarted daemon (the first one "crashed": its Segment is leaked, not dropped).
        std::mem::forget(first);
        let second = Segment::create(&SegmentSpec {
            incarnation: 8,
            ..spec(&dir)
        })
        .unwrap();
        assert_eq!(word.load(Ordering::Acquire), 0, "old file retired");
        assert_eq!(second.incarnation(), 8);
        let file2 = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let client2 = MmapOptions::new().len(4096).map_raw(&file2).unwrap();
        let word2 = incarnation_word(&client2).unwrap();
        assert_eq!(word2.load(Ordering::Acquire), 8);
        drop(second);
        assert_eq!(word2.load(Ordering::Acquire), 0, "dropped segment retired");
        let _ = std::fs::remove_dir(&dir);
    }

    /// Where a test's segment files go: /dev/shm (tmpfs, the default backing's file system)
    /// when there is one.
    fn shm_dir(name: &str) -> PathBuf {
        let base = Path::new("/dev/shm");
        let base = if base.is_dir() {
            base.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        base.join(format!("kvpool-seg-{name}-{}", std::process::id()))
    }

    /// A file segment's data area lies at a 2 MiB-aligned address, and backing its regions with
    /// huge pages (whatever the kernel makes of it) changes no byte, written before or after,
    /// through the segment or a client's read-only mapping of the file; each whole region is
    /// tried once.
    #[test]
    fn backing_a_segment_with_huge_pages_keeps_every_byte() {
        let dir = shm_dir("huge");
        let spec = SegmentSpec {
            data_len: 6 << 20,
            ..spec(&dir)
        };
        let seg = Segment::create(&spec).unwrap();
        assert_eq!(seg.data_ptr() as u64 % HUGE_PAGE, 0);
        let pattern = |i: u64| (i.wrapping_mul(31) ^ (i >> 12)) as u8;
        // The first region written before it is backed; the others after.
        let first: Vec<u8> = (0..HUGE_PAGE).map(pattern).collect();
        // SAFETY: nothing else uses this segment.
        unsafe { seg.data_mut(0, HUGE_PAGE) }.copy_from_slice(&first);
        seg.back_block(4096, 8192);
        seg.back_block(HUGE_PAGE - 1, 2);
        seg.back_block(0, 6 << 20);
        let (collapsed, refused) = seg.huge_regions();
        println!("collapsed {collapsed}, refused {refused}");
        if seg.page_kind() == PageKind::TransparentAdvised {
            assert_eq!(collapsed + refused, 3, "each region tried once");
        }
        let rest: Vec<u8> = (HUGE_PAGE..6 << 20).map(pattern).collect();
        // SAFETY: as above.
        unsafe { seg.data_mut(HUGE_PAGE, rest.len() as u64) }.copy_from_slice(&rest);
        let mut all = vec![0u8; 6 << 20];
        assert!(seg.copy_out_racy(0, &mut all));
        assert!(all.iter().enumerate().all(|(i, &b)| b == pattern(i as u64)));
        // A client's read-only mapping of the file sees the same bytes.
        let file = File::open(seg.path().unwrap()).unwrap();
        let client = AlignedMap::map_shared(&file, seg.layout().total_len(), false, false).unwrap();
        assert_eq!(client.base() as u64 % HUGE_PAGE, 0);
        let data = seg.layout().data_offset as usize;
        // SAFETY: the data area lies inside the client's mapping of the whole file.
        let seen = unsafe { std::slice::from_raw_parts(client.base().add(data), 6 << 20) };
        assert!(seen == &all[..]);
        drop(seg);
        let _ = std::fs::remove_dir(&dir);
    }

    /// The prefaulting thread's step commits the memory ahead of the allocations, only as far
    /// as the allocations reached, and changes no byte, on huge and normal pages alike.
    #[test]
    fn prefaulting_ahead_commits_memory_and_keeps_every_byte() {
        use std::os::unix::fs::MetadataExt;
        for huge_pages in [HugePages::Auto, HugePages::Off] {
            let dir = shm_dir(&format!("ahead-{huge_pages:?}"));
            let seg = Segment::create(&SegmentSpec {
                data_len: 8 << 20,
                huge_pages,
                ..spec(&dir)
            })
            .unwrap();
            let committed = || std::fs::metadata(seg.path().unwrap()).unwrap().blocks() * 512;
            let pattern = |i: u64| (i.wrapping_mul(29) ^ (i >> 9)) as u8;
            // Bytes already in region 1 (a block some allocation wrote) before it is prefaulted.
            let one: Vec<u8> = (0..4096).map(pattern).collect();
            // SAFETY: nothing else uses this segment.
            unsafe { seg.data_mut(HUGE_PAGE + 8192, 4096) }.copy_from_slice(&one);
            assert!(
                !seg.prefault_next(64 << 20),
                "nothing reached, nothing ahead"
            );
            let before = committed();
            assert!(seg.back_block(0, 4096));
            assert!(
                seg.prefault_next(64 << 20),
                "region 1, as far ahead as region 0 reached"
            );
            assert!(!seg.prefault_next(64 << 20));
            // The whole region, but for its one page written already.
            let grew = committed() - before;
            assert!(grew >= HUGE_PAGE - 4096, "{huge_pages:?}: {grew}");
            // A block into region 2: region 3 is next, and the area ends there.
            assert!(seg.back_block(HUGE_PAGE, HUGE_PAGE + 1));
            assert!(seg.prefault_next(64 << 20));
            assert!(!seg.prefault_next(64 << 20), "the area ends at region 3");
            assert_eq!(seg.prefaulted_bytes(), 2 * HUGE_PAGE);
            let mut seen = vec![0u8; 4096];
            assert!(seg.copy_out_racy(HUGE_PAGE + 8192, &mut seen));
            assert_eq!(seen, one);
            let mut rest = vec![1u8; HUGE_PAGE as usize];
            assert!(seg.copy_out_racy(3 * HUGE_PAGE, &mut rest));
            assert!(
                rest.iter().all(|&b| b == 0),
                "a prefaulted page reads as zeros"
            );
            drop(seg);
            let _ = std::fs::remove_dir(&dir);
        }
    }

    #[test]
    fn decode_rejects_garbage() {
        assert!(SegmentLayout::decode(&[0u8; 100], 1 << 30).is_err());
        let l = SegmentLayout::new(NodeId(0), 0, 1 << 20, 512);
        let mut b = l.encode();
        assert!(SegmentLayout::decode(&b, l.total_len()).is_ok());
        assert!(SegmentLayout::decode(&b, l.total_len() - 1).is_err());
        b[24] = 3; // granule not a power of two
        assert!(SegmentLayout::decode(&b, l.total_len()).is_err());
    }

    #[test]
    fn anonymous_segment_falls_back_cleanly() {
        let mut s = spec(Path::new("/nonexistent"));
        s.backing = Backing::Anonymous;
        let seg = Segment::create(&s).unwrap();
        assert!(seg.path().is_none());
        assert!(matches!(
            seg.page_kind(),
            PageKind::HugeTlb | PageKind::TransparentAdvised | PageKind::Normal
        ));
    }
}
