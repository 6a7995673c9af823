//! The vector paths against `xxhash-rust`'s xxh3: every length, alignment, cut and scatter.

use proptest::prelude::*;

use super::*;

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
