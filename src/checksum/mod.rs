//! The checksum that guards every byte crossing a boundary: xxh3-64, and a copy that computes
//! it in the same pass over the bytes.
//!
//! Values above 240 bytes take XXH3's long loop: 64-byte stripes folded into eight 64-bit
//! accumulators, scrambled every 1 KiB. The `xxhash-rust` crate picks its vector width when it is
//! compiled, which for a default x86-64 build means SSE2; this module runs the same loop with
//! AVX2 when the CPU has it (detected once at run time), about twice the speed. It also offers
//! [`copy_checksum`]: each stripe is loaded once, stored to the destination and folded into the
//! accumulators from the same registers, so a checked copy reads the source once instead of
//! copying and then hashing the copy. Both agree bit for bit with `xxh3_64` (tested in
//! tests.rs on every length up to a few KiB, at every alignment, and on large values). The AVX2
//! loop is in x86.rs.

use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

/// xxh3-64 of `bytes`: what `put` sends, `commit` verifies and `get` returns.
#[inline]
pub fn checksum(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if bytes.len() > MID_SIZE_MAX && x86::has_avx2() {
        // SAFETY: the CPU has AVX2 (checked just above); `bytes` is `len` readable bytes, and no
        // destination is written (null with COPY = false).
        return unsafe {
            x86::long_avx2::<false>(bytes.as_ptr(), std::ptr::null_mut(), bytes.len())
        };
    }
    xxh3_64(bytes)
}

/// Copies `len` bytes from `src` to `dst` and returns the xxh3-64 of the bytes now at `dst`
/// (which, when the source changes during the copy, may differ from what the source holds:
/// the hash is always of what was written, never of a second read).
///
/// # Safety
///
/// `src` must be valid for reads of `len` bytes and `dst` valid for writes of `len` bytes, and
/// the two ranges must not overlap. The source may be written concurrently by others (it is only
/// ever read through raw pointers, never through a reference); nothing else may access `dst`
/// during the call.
pub unsafe fn copy_checksum(src: *const u8, dst: *mut u8, len: usize) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if len > MID_SIZE_MAX && x86::has_avx2() {
        // SAFETY: AVX2 is present; the pointer contract is the caller's, passed on unchanged.
        return unsafe { x86::long_avx2::<true>(src, dst, len) };
    }
    // Portable path: copy a piece, then hash it while it is still in cache.
    let mut h = Xxh3Default::new();
    let mut done = 0;
    while done < len {
        let n = PORTABLE_PIECE.min(len - done);
        // SAFETY: `done + n <= len`: both pieces lie inside the caller's ranges, which do not
        // overlap; `dst` is exclusively ours for the call, so the slice over its piece is sound.
        let piece = unsafe {
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n);
            std::slice::from_raw_parts(dst.add(done), n)
        };
        h.update(piece);
        done += n;
    }
    h.digest()
}

/// [`copy_checksum`] into several destinations: the bytes at `src` are copied in order into
/// `pieces` (the first piece's length of them into the first piece, and so on: as many bytes
/// as the pieces hold together) and the xxh3-64 of their concatenation is returned, hashed in
/// the same pass as the copy when every piece but the last is a multiple of 64 bytes (a KV
/// cache's pages are), else copied and then hashed piece by piece. What engines whose pages
/// are per layer need to load an object that holds every layer without a staging copy.
///
/// # Safety
///
/// `src` must be valid for reads of the pieces' total length and overlap none of them. As for
/// [`copy_checksum`], the source may be written concurrently by others (it is read only through
/// the raw pointer); the hash is of what was written.
pub unsafe fn copy_checksum_scatter(src: *const u8, pieces: &mut [&mut [u8]]) -> u64 {
    let len: usize = pieces.iter().map(|p| p.len()).sum();
    #[cfg(target_arch = "x86_64")]
    if len > MID_SIZE_MAX
        && x86::has_avx2()
        && pieces
            .iter()
            .rev()
            .skip(1)
            .all(|p| p.len() % x86::STRIPE == 0)
    {
        let dsts: Vec<(*mut u8, usize)> = pieces
            .iter_mut()
            .filter(|p| !p.is_empty())
            .map(|p| (p.as_mut_ptr(), p.len()))
            .collect();
        // SAFETY: AVX2 is present; `src` has `len` readable bytes (the caller's contract); the
        // pieces are exclusive, non-overlapping buffers (distinct `&mut`) of these lengths,
        // summing to `len`, every one but the last a multiple of 64 bytes (checked above:
        // dropping empty pieces keeps that true).
        return unsafe { x86::long_avx2_scatter(src, &dsts, len) };
    }
    let mut h = Xxh3Default::new();
    let mut done = 0;
    for piece in pieces.iter_mut() {
        // SAFETY: `done + piece.len() <= len`: inside the caller's source range, which does not
        // overlap the piece.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), piece.as_mut_ptr(), piece.len()) };
        h.update(piece);
        done += piece.len();
    }
    h.digest()
}

/// xxh3-64 of bytes that arrive in pieces (a value read off a socket, hashed piece by piece
/// while each is in cache): [`Hasher::update`] with each piece in order, then
/// [`Hasher::digest`], which equals [`checksum`] of their concatenation. With AVX2 it runs
/// [`checksum`]'s vector loop (the `xxhash-rust` streaming hasher is SSE2 in a default build,
/// about half the speed); otherwise it is `xxhash-rust`'s.
pub struct Hasher(Inner);

enum Inner {
    Portable(Xxh3Default),
    #[cfg(target_arch = "x86_64")]
    Avx2(x86::Streaming),
}

impl Hasher {
    /// A hasher of no bytes yet.
    pub fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx2() {
            return Hasher(Inner::Avx2(x86::Streaming::default()));
        }
        Hasher(Inner::Portable(Xxh3Default::new()))
    }

    /// Hashes the next piece.
    #[inline]
    pub fn update(&mut self, piece: &[u8]) {
        match &mut self.0 {
            Inner::Portable(h) => h.update(piece),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: this variant is only made when the CPU has AVX2 (`Hasher::new`).
            Inner::Avx2(h) => unsafe { h.update(piece) },
        }
    }

    /// The hash of every piece so far, as one.
    pub fn digest(&self) -> u64 {
        match &self.0 {
            Inner::Portable(h) => h.digest(),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `update`.
            Inner::Avx2(h) => unsafe { h.digest() },
        }
    }
}

impl Default for Hasher {
    fn default() -> Self {
        Hasher::new()
    }
}

/// The portable path's copy-then-hash piece: small enough to still be in L2 when hashed.
const PORTABLE_PIECE: usize = 64 << 10;

/// Lengths up to this take XXH3's short paths, which [`xxh3_64`] runs.
const MID_SIZE_MAX: usize = 240;

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
