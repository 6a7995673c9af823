//! XXH3-64's long loop with AVX2, detected once at run time: the hash alone, the copy that
//! hashes what it stores, the same into scattered destinations, and a streaming hasher.

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
pub(super) unsafe fn long_avx2<const COPY: bool>(src: *const u8, dst: *mut u8, len: usize) -> u64 {
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
        let p = ((acc[2 * i] ^ key(2 * i)) as u128) * ((acc[2 * i + 1] ^ key(2 * i + 1)) as u128);
        r = r.wrapping_add((p as u64) ^ ((p >> 64) as u64));
    }
    r ^= r >> 37;
    r = r.wrapping_mul(0x1656_6791_9E37_79F9);
    r ^ (r >> 32)
}
