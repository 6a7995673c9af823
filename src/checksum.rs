//! The checksum that guards every byte crossing a boundary: xxh3-64, and a copy that computes
//! it in the same pass over the bytes.
//!
//! Values above 240 bytes take XXH3's long loop: 64-byte stripes folded into eight 64-bit
//! accumulators, scrambled every 1 KiB. The `xxhash-rust` crate picks its vector width when it is
//! compiled, which for a default x86-64 build means SSE2; this module runs the same loop with
//! AVX2 when the CPU has it (detected once at run time), about twice the speed. It also offers
//! [`copy_checksum`]: each stripe is loaded once, stored to the destination and folded into the
//! accumulators from the same registers, so a checked copy reads the source once instead of
//! copying and then hashing the copy. Both agree bit for bit with `xxh3_64` (tested below on
//! every length up to a few KiB, at every alignment, and on large values).

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
mod x86 {
    use std::arch::x86_64::*;
    use std::sync::atomic::{AtomicU8, Ordering};

    /// XXH3's default secret (the seed-0 custom secret is the default one).
    const SECRET: [u8; 192] = xxhash_rust::const_xxh3::const_custom_default_secret(0);
    pub(super) const STRIPE: usize = 64;
    /// Stripes per block: (secret length − stripe) / 8 bytes consumed per stripe.
    const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / 8;
    const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;
    const LASTACC_START: usize = 7;
    const MERGEACCS_START: usize = 11;

    /// How far ahead of the stripe being folded the source is prefetched. Measured on 64 KiB
    /// objects of 4 KiB pages, 8 copies with hashing a call: 1 KiB ahead 62-70 us, 2 KiB 54-62,
    /// 3 KiB and 4 KiB about as 2 KiB, none 83-100. On another VM, with the node's segments on
    /// 2 MiB pages, 64 KiB objects drawn at random from 512 MiB: 2 KiB ahead 0.78-0.94x memcpy,
    /// 3 KiB 0.97-1.02x, 4 KiB 0.98-1.02x, 6 KiB 0.95-0.96x (a one-off probe; the batched
    /// same-host reads it moved are in docs/BENCHMARKS.md, "Same host").
    const PREFETCH: usize = 4096;
    const PRIME32_1: u64 = 0x9E37_79B1;
    const PRIME32_2: u64 = 0x85EB_CA77;
    const PRIME32_3: u64 = 0xC2B2_AE3D;
    const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
    const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
    const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
    const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

    /// 0 unknown, 1 without AVX2, 2 with.
    static AVX2: AtomicU8 = AtomicU8::new(0);

    #[inline]
    pub(super) fn has_avx2() -> bool {
        match AVX2.load(Ordering::Relaxed) {
            0 => {
                let yes = std::arch::is_x86_feature_detected!("avx2");
                AVX2.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
                yes
            }
            v => v == 2,
        }
    }

    /// XXH3-64's long hash (`len > 240`) of the bytes at `src`, storing each stripe to `dst` as
    /// it is loaded when `COPY`; the hash is of the stored bytes.
    ///
    /// # Safety
    ///
    /// The CPU supports AVX2. `src` is valid for reads of `len` bytes (it may change
    /// concurrently; it is read only through raw pointers). With `COPY`, `dst` is valid for
    /// writes of `len` bytes, does not overlap `src`, and nothing else accesses it during the
    /// call; without, `dst` is not used.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn long_avx2<const COPY: bool>(
        src: *const u8,
        dst: *mut u8,
        len: usize,
    ) -> u64 {
        debug_assert!(len > super::MID_SIZE_MAX);
        let secret = SECRET.as_ptr();
        let mut acc = initial();
        let blocks = (len - 1) / BLOCK;
        let mut at = 0;
        for _ in 0..blocks {
            for s in 0..STRIPES_PER_BLOCK {
                prefetch(src, at, len);
                // SAFETY: `at + 64 <= blocks * BLOCK <= len - 1`; the secret offset
                // `s * 8 + 64 <= 184 < 192`.
                unsafe { stripe::<COPY>(&mut acc, src.add(at), dst.add(at), secret.add(s * 8)) };
                at += STRIPE;
            }
            // SAFETY: `192 - 64 + 64 = 192`: the scramble key is the secret's last 64 bytes.
            unsafe { scramble(&mut acc, secret.add(SECRET.len() - STRIPE)) };
        }
        let tail_stripes = (len - 1 - at) / STRIPE;
        for s in 0..tail_stripes {
            prefetch(src, at, len);
            // SAFETY: `at + 64 <= len - 1` for each of these stripes (the division above), and
            // `s < STRIPES_PER_BLOCK`, so the secret offset stays inside it.
            unsafe { stripe::<COPY>(&mut acc, src.add(at), dst.add(at), secret.add(s * 8)) };
            at += STRIPE;
        }
        let last = if COPY {
            // The bytes not in a full stripe; then the last stripe is read back from what was
            // written, so the hash covers exactly the destination's bytes.
            // SAFETY: `at < len`: the rest of both ranges, which do not overlap; `dst` is ours.
            unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) };
            dst as *const u8
        } else {
            src
        };
        // SAFETY: `len > 240`, so `len - 64` is in range; the secret offset
        // `192 - 64 - 7 + 64 = 185 <= 192`. COPY = false: nothing is stored.
        unsafe {
            stripe::<false>(
                &mut acc,
                last.add(len - STRIPE),
                std::ptr::null_mut(),
                secret.add(SECRET.len() - STRIPE - LASTACC_START),
            )
        };
        finish(&acc, len)
    }

    /// [`long_avx2`] with `COPY`, storing into `pieces` in order instead of one buffer.
    ///
    /// # Safety
    ///
    /// AVX2; `src` readable for `len > 240` bytes (it may change concurrently); `pieces` are
    /// non-empty, non-overlapping buffers writable for their lengths, which sum to `len`, none
    /// overlapping `src`, nothing else accessing them during the call, and every one but the
    /// last a multiple of `STRIPE` bytes (so no stripe straddles two pieces).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn long_avx2_scatter(
        src: *const u8,
        pieces: &[(*mut u8, usize)],
        len: usize,
    ) -> u64 {
        debug_assert!(len > super::MID_SIZE_MAX);
        debug_assert_eq!(pieces.iter().map(|p| p.1).sum::<usize>(), len);
        let secret = SECRET.as_ptr();
        let mut acc = initial();
        // Where byte `at` goes: piece `p`, at `off` in it (stripe-aligned while stripes run).
        let (mut p, mut off) = (0usize, 0usize);
        let mut next_stripe = || {
            // SAFETY (of the pointer's use, by the callers below): a stripe starting at a
            // multiple of 64 lies inside one piece, since every piece but the last is a multiple
            // of 64 long and the stripes end before `len`.
            let d = pieces[p].0.wrapping_add(off);
            off += STRIPE;
            if off == pieces[p].1 {
                p += 1;
                off = 0;
            }
            d
        };
        let blocks = (len - 1) / BLOCK;
        let mut at = 0;
        for _ in 0..blocks {
            for s in 0..STRIPES_PER_BLOCK {
                prefetch(src, at, len);
                let d = next_stripe();
                // SAFETY: `at + 64 <= len - 1`; `d` has 64 writable bytes of one piece (above);
                // the secret offset `s * 8 + 64 <= 184 < 192`.
                unsafe { stripe::<true>(&mut acc, src.add(at), d, secret.add(s * 8)) };
                at += STRIPE;
            }
            // SAFETY: the scramble key is the secret's last 64 bytes.
            unsafe { scramble(&mut acc, secret.add(SECRET.len() - STRIPE)) };
        }
        let tail_stripes = (len - 1 - at) / STRIPE;
        for s in 0..tail_stripes {
            prefetch(src, at, len);
            let d = next_stripe();
            // SAFETY: as in the loop above; `s < STRIPES_PER_BLOCK`.
            unsafe { stripe::<true>(&mut acc, src.add(at), d, secret.add(s * 8)) };
            at += STRIPE;
        }
        // The last 1..=64 bytes: inside the current piece, which ends at a multiple of 64 past
        // `at` or is the last one (ending at `len`).
        // SAFETY: `pieces[p]` has `len - at` writable bytes from `off` (just said); the source
        // range is the caller's.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), pieces[p].0.add(off), len - at) };
        // The last stripe is read back from what was written: its 64 bytes may span pieces.
        let mut last = [0u8; STRIPE];
        let (mut start, from) = (0usize, len - STRIPE);
        for &(ptr, n) in pieces {
            let (lo, hi) = (from.max(start), len.min(start + n));
            if lo < hi {
                // SAFETY: `lo - start .. hi - start` is inside this piece; `last` has room for
                // `hi - lo <= 64` bytes at `lo - from`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        ptr.add(lo - start),
                        last.as_mut_ptr().add(lo - from),
                        hi - lo,
                    )
                };
            }
            start += n;
        }
        // SAFETY: `last` is 64 readable bytes; the secret offset `192 - 64 - 7 + 64 <= 192`;
        // nothing is stored.
        unsafe {
            stripe::<false>(
                &mut acc,
                last.as_ptr(),
                std::ptr::null_mut(),
                secret.add(SECRET.len() - STRIPE - LASTACC_START),
            )
        };
        finish(&acc, len)
    }

    /// Bytes [`Streaming`] keeps before it folds them (four stripes).
    const BUFFER: usize = 4 * STRIPE;

    /// The state of an xxh3-64 over pieces, folded with AVX2: XXH3's streaming form. Stripes
    /// are folded only once a byte after them has arrived (the input's last stripe is folded
    /// differently, at the digest), so at least one byte is always kept.
    pub(super) struct Streaming {
        acc: Acc,
        total: u64,
        /// Bytes not folded yet: the first `pending` of it. Every byte while the input is
        /// at most `BUFFER` long, so a short input takes XXH3's short paths at the digest.
        buf: [u8; BUFFER],
        pending: usize,
        /// The last stripe folded, for a last stripe that reaches back before `buf`.
        last: [u8; STRIPE],
    }

    impl Default for Streaming {
        fn default() -> Self {
            Streaming {
                acc: Acc {
                    lanes: INITIAL,
                    stripes: 0,
                },
                total: 0,
                buf: [0; BUFFER],
                pending: 0,
                last: [0; STRIPE],
            }
        }
    }

    impl Streaming {
        /// Folds the next piece.
        ///
        /// # Safety
        ///
        /// The CPU supports AVX2.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn update(&mut self, mut data: &[u8]) {
            self.total += data.len() as u64;
            if self.pending + data.len() <= BUFFER {
                self.buf[self.pending..self.pending + data.len()].copy_from_slice(data);
                self.pending += data.len();
                return;
            }
            if self.pending > 0 {
                // Fill the buffer and fold it whole: more bytes follow it.
                let fill = BUFFER - self.pending;
                self.buf[self.pending..].copy_from_slice(&data[..fill]);
                data = &data[fill..];
                // SAFETY: `buf` holds four stripes.
                unsafe { self.acc.fold(self.buf.as_ptr(), BUFFER / STRIPE) };
                self.last.copy_from_slice(&self.buf[BUFFER - STRIPE..]);
                self.pending = 0;
            }
            // `data` is not empty: the buffer overflowed. Fold every stripe with a byte after it.
            let n = (data.len() - 1) / STRIPE;
            if n > 0 {
                // SAFETY: `n` stripes are `n * 64 < data.len()` readable bytes.
                unsafe { self.acc.fold(data.as_ptr(), n) };
                self.last
                    .copy_from_slice(&data[(n - 1) * STRIPE..n * STRIPE]);
                data = &data[n * STRIPE..];
            }
            self.buf[..data.len()].copy_from_slice(data);
            self.pending = data.len();
        }

        /// The hash of every byte so far.
        ///
        /// # Safety
        ///
        /// AVX2.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn digest(&self) -> u64 {
            if self.total <= super::MID_SIZE_MAX as u64 {
                // Nothing was folded: every byte is in the buffer.
                return super::xxh3_64(&self.buf[..self.pending]);
            }
            let mut state = self.acc;
            // The last stripe: the input's last 64 bytes, reaching back into `last` when
            // fewer than 64 are pending (`pending >= 1` always, and stripes were folded).
            let mut end = [0u8; STRIPE];
            let p = self.pending;
            if p >= STRIPE {
                // SAFETY: `(p - 1) / 64` stripes lie inside the first `p` bytes of `buf`.
                unsafe { state.fold(self.buf.as_ptr(), (p - 1) / STRIPE) };
                end.copy_from_slice(&self.buf[p - STRIPE..p]);
            } else {
                end[..STRIPE - p].copy_from_slice(&self.last[p..]);
                end[STRIPE - p..].copy_from_slice(&self.buf[..p]);
            }
            let mut acc = load(&state.lanes);
            // SAFETY: `end` is 64 readable bytes; the secret offset `192 - 64 - 7 + 64 <= 192`;
            // nothing is stored.
            unsafe {
                stripe::<false>(
                    &mut acc,
                    end.as_ptr(),
                    std::ptr::null_mut(),
                    SECRET.as_ptr().add(SECRET.len() - STRIPE - LASTACC_START),
                )
            };
            finish(&acc, self.total as usize)
        }
    }

    /// [`Streaming`]'s accumulators between pieces.
    #[derive(Clone, Copy)]
    struct Acc {
        lanes: [u64; 8],
        /// Stripes folded into the current block (a scramble after the 16th).
        stripes: usize,
    }

    impl Acc {
        /// Folds `n` stripes at `src` into the accumulators, scrambling at each block's end.
        ///
        /// # Safety
        ///
        /// AVX2; `src` readable for `n * 64` bytes.
        #[target_feature(enable = "avx2")]
        unsafe fn fold(&mut self, src: *const u8, n: usize) {
            let secret = SECRET.as_ptr();
            let mut acc = load(&self.lanes);
            for i in 0..n {
                prefetch(src, i * STRIPE, n * STRIPE);
                // SAFETY: stripe `i < n` is inside the caller's range; `self.stripes < 16`,
                // so the secret offset `stripes * 8 + 64 <= 184 < 192`.
                unsafe {
                    stripe::<false>(
                        &mut acc,
                        src.add(i * STRIPE),
                        std::ptr::null_mut(),
                        secret.add(self.stripes * 8),
                    )
                };
                self.stripes += 1;
                if self.stripes == STRIPES_PER_BLOCK {
                    // SAFETY: the scramble key is the secret's last 64 bytes.
                    unsafe { scramble(&mut acc, secret.add(SECRET.len() - STRIPE)) };
                    self.stripes = 0;
                }
            }
            self.lanes = store(&acc);
        }
    }

    /// XXH3's initial accumulators, lane by lane.
    const INITIAL: [u64; 8] = [
        PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
    ];

    /// XXH3's initial accumulators.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn initial() -> [__m256i; 2] {
        load(&INITIAL)
    }

    /// Eight accumulator lanes into registers.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn load(lanes: &[u64; 8]) -> [__m256i; 2] {
        // SAFETY: `lanes` is 64 readable bytes; unaligned loads.
        unsafe {
            [
                _mm256_loadu_si256(lanes.as_ptr() as *const __m256i),
                _mm256_loadu_si256(lanes.as_ptr().add(4) as *const __m256i),
            ]
        }
    }

    /// Registers back into eight accumulator lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn store(acc: &[__m256i; 2]) -> [u64; 8] {
        let mut lanes = [0u64; 8];
        // SAFETY: `lanes` is 64 writable bytes; unaligned stores.
        unsafe {
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, acc[0]);
            _mm256_storeu_si256(lanes.as_mut_ptr().add(4) as *mut __m256i, acc[1]);
        }
        lanes
    }

    /// The hash of `len` bytes from the accumulators after the last stripe.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn finish(acc: &[__m256i; 2], len: usize) -> u64 {
        merge(&store(acc), (len as u64).wrapping_mul(PRIME64_1))
    }

    /// Asks for the cache line [`PREFETCH`] bytes past byte `at` of the `len` bytes at `src`,
    /// when that is still one of them: prefetching past the end would fetch lines nobody reads,
    /// a good part of the traffic for objects of a few KiB.
    #[inline(always)]
    fn prefetch(src: *const u8, at: usize, len: usize) {
        if at + PREFETCH < len {
            // SAFETY: a prefetch is a hint: it never faults and changes nothing but the cache,
            // whatever the address (it is inside the caller's range anyway).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(at + PREFETCH) as *const i8) };
        }
    }

    /// One stripe: acc[i ^ 1] += data[i]; acc[i] += lo32(data[i] ^ key[i]) * hi32(...).
    ///
    /// # Safety
    ///
    /// AVX2; `src` readable for 64 bytes, `key` for 64 bytes; with `COPY`, `dst` writable for 64.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn stripe<const COPY: bool>(
        acc: &mut [__m256i; 2],
        src: *const u8,
        dst: *mut u8,
        key: *const u8,
    ) {
        // SAFETY: the caller's contract; all loads and stores are unaligned forms.
        unsafe {
            let d0 = _mm256_loadu_si256(src as *const __m256i);
            let d1 = _mm256_loadu_si256(src.add(32) as *const __m256i);
            if COPY {
                _mm256_storeu_si256(dst as *mut __m256i, d0);
                _mm256_storeu_si256(dst.add(32) as *mut __m256i, d1);
            }
            let k0 = _mm256_loadu_si256(key as *const __m256i);
            let k1 = _mm256_loadu_si256(key.add(32) as *const __m256i);
            acc[0] = fold(acc[0], d0, k0);
            acc[1] = fold(acc[1], d1, k1);
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn fold(acc: __m256i, data: __m256i, key: __m256i) -> __m256i {
        let dk = _mm256_xor_si256(data, key);
        let product = _mm256_mul_epu32(dk, _mm256_srli_epi64::<32>(dk));
        // Swap the 64-bit halves of each 128-bit lane: lane i is added to accumulator i ^ 1.
        let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
        _mm256_add_epi64(product, _mm256_add_epi64(acc, swapped))
    }

    /// acc = (acc ^ (acc >> 47) ^ key) * PRIME32_1, per 64-bit lane.
    ///
    /// # Safety
    ///
    /// AVX2; `key` readable for 64 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scramble(acc: &mut [__m256i; 2], key: *const u8) {
        let prime = _mm256_set1_epi32(PRIME32_1 as i32);
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: the caller's contract: `key + 32 * i` has 32 readable bytes.
            let k = unsafe { _mm256_loadu_si256(key.add(32 * i) as *const __m256i) };
            let x = _mm256_xor_si256(_mm256_xor_si256(*a, _mm256_srli_epi64::<47>(*a)), k);
            let lo = _mm256_mul_epu32(x, prime);
            let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), prime);
            *a = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
        }
    }

    fn merge(acc: &[u64; 8], start: u64) -> u64 {
        let key = |i: usize| {
            let at = MERGEACCS_START + 8 * i;
            u64::from_le_bytes(SECRET[at..at + 8].try_into().expect("8 bytes"))
        };
        let mut r = start;
        for i in 0..4 {
            let p =
                ((acc[2 * i] ^ key(2 * i)) as u128) * ((acc[2 * i + 1] ^ key(2 * i + 1)) as u128);
            r = r.wrapping_add((p as u64) ^ ((p >> 64) as u64));
        }
        r ^= r >> 37;
        r = r.wrapping_mul(0x1656_6791_9E37_79F9);
        r ^ (r >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn copied(src: &[u8], skew: usize) -> (Vec<u8>, u64) {
        let mut buf = vec![0u8; src.len() + skew];
        // SAFETY: `buf[skew..]` has `src.len()` writable bytes and is a fresh allocation.
        let sum = unsafe { copy_checksum(src.as_ptr(), buf.as_mut_ptr().add(skew), src.len()) };
        (buf.split_off(skew), sum)
    }

    #[test]
    fn every_length_up_to_a_few_blocks_matches_xxh3() {
        let data = bytes(3 * 1024 + 200, 7);
        for n in 0..data.len() {
            let want = xxh3_64(&data[..n]);
            assert_eq!(checksum(&data[..n]), want, "checksum of {n} bytes");
            let (dst, sum) = copied(&data[..n], n % 61);
            assert_eq!(sum, want, "copy_checksum of {n} bytes");
            assert_eq!(dst, &data[..n]);
        }
    }

    #[test]
    fn large_values_match_xxh3_at_every_block_boundary() {
        let data = bytes((2 << 20) + 1025, 11);
        for n in [
            1024,
            1025,
            2047,
            2048,
            2049,
            64 << 10,
            (64 << 10) + 63,
            1 << 20,
            2 << 20,
            (2 << 20) + 1025,
        ] {
            let want = xxh3_64(&data[..n]);
            assert_eq!(checksum(&data[..n]), want, "{n}");
            let (dst, sum) = copied(&data[..n], 16);
            assert_eq!(sum, want, "{n}");
            assert!(dst == data[..n], "{n}: bytes differ");
        }
    }

    /// Splits `src` into pieces of the given lengths (the rest in a last piece), copies it
    /// into them with `copy_checksum_scatter`, and returns the concatenation and the hash.
    fn scattered(src: &[u8], cuts: &[usize]) -> (Vec<u8>, u64) {
        let mut bufs: Vec<Vec<u8>> = Vec::new();
        let mut rest = src.len();
        for &c in cuts {
            let c = c.min(rest);
            bufs.push(vec![0u8; c]);
            rest -= c;
        }
        bufs.push(vec![0u8; rest]);
        let mut pieces: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        // SAFETY: `src` has the pieces' total length; the pieces are fresh allocations.
        let sum = unsafe { copy_checksum_scatter(src.as_ptr(), &mut pieces) };
        (bufs.concat(), sum)
    }

    #[test]
    fn scattered_copies_hash_as_the_whole() {
        let data = bytes((2 << 20) + 100, 13);
        let page = 64 << 10;
        for (n, cuts) in [
            (32 * page, vec![page; 31]),         // a vLLM block: 32 layer pages
            ((32 * page) + 100, vec![page; 32]), // and a short tail piece
            (5000, vec![64, 128, 0, 1024, 64]),
            (300, vec![256]),            // the last stripe spans two pieces
            (300, vec![64, 64, 64, 64]), // a 44-byte last piece
            (4096, vec![1000, 3]),       // not multiples of 64: copy then hash
            (200, vec![100]),            // the short path
            (0, vec![]),
        ] {
            let src = &data[..n];
            let (got, sum) = scattered(src, &cuts);
            assert_eq!(sum, xxh3_64(src), "{n} bytes cut {cuts:?}");
            assert!(got == src, "{n} bytes cut {cuts:?}: bytes differ");
        }
    }

    /// The streaming hasher over `data` cut at `cuts` (lengths, the rest in a last piece).
    fn streamed(data: &[u8], cuts: &[usize]) -> u64 {
        let mut h = Hasher::new();
        let mut at = 0;
        for &c in cuts {
            let c = c.min(data.len() - at);
            h.update(&data[at..at + c]);
            at += c;
        }
        h.update(&data[at..]);
        h.digest()
    }

    #[test]
    fn streamed_pieces_hash_as_the_whole() {
        let data = bytes((2 << 20) + 1025, 17);
        for n in [
            0, 1, 63, 64, 65, 240, 241, 255, 256, 257, 320, 1024, 1025, 4096, 70_001,
        ] {
            let want = xxh3_64(&data[..n]);
            for cut in [1, 7, 63, 64, 65, 200, 256, 257, 4096, 65_536, 1 << 20] {
                let cuts = vec![cut; n / cut];
                assert_eq!(
                    streamed(&data[..n], &cuts),
                    want,
                    "{n} bytes in pieces of {cut}"
                );
            }
        }
        // What the sockets do: a 2 MiB value in 256 KiB reads, and in uneven ones.
        let n = 2 << 20;
        assert_eq!(streamed(&data[..n], &[256 << 10; 8]), xxh3_64(&data[..n]));
        assert_eq!(
            streamed(&data, &[1, 65_535, 3, 200_000, 64, 64, 777_777]),
            xxh3_64(&data)
        );
    }

    proptest! {
        #[test]
        fn streamed_pieces_of_any_cut_hash_as_xxh3(
            data in proptest::collection::vec(any::<u8>(), 0..9000),
            cuts in proptest::collection::vec(0usize..700, 0..12),
        ) {
            prop_assert_eq!(streamed(&data, &cuts), xxh3_64(&data));
        }

        #[test]
        fn scattered_copies_of_any_cut_hash_as_xxh3(
            data in proptest::collection::vec(any::<u8>(), 0..6000),
            stripes in proptest::collection::vec(0usize..40, 0..6),
            odd in any::<bool>(),
        ) {
            let mut cuts: Vec<usize> = stripes.iter().map(|s| s * 64).collect();
            if odd {
                cuts.push(7);
            }
            let (got, sum) = scattered(&data, &cuts);
            prop_assert_eq!(sum, xxh3_64(&data));
            prop_assert!(got == data);
        }

        #[test]
        fn any_bytes_at_any_alignment_hash_as_xxh3(
            data in proptest::collection::vec(any::<u8>(), 0..9000),
            from in 0usize..64,
            skew in 0usize..64,
        ) {
            let src = &data[from.min(data.len())..];
            let want = xxh3_64(src);
            prop_assert_eq!(checksum(src), want);
            let (dst, sum) = copied(src, skew);
            prop_assert_eq!(sum, want);
            prop_assert_eq!(&dst[..], src);
        }
    }
}
