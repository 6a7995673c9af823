//! memcpy from a DRAM-sized source ring into a value-sized buffer: the ceiling of any
//! same-host read, since a one-sided read is exactly such a copy plus two version checks.
//! When `local` runs too, it measures memcpy itself, interleaved with its reads.

use std::hint::black_box;

use super::driver::{run_threads, ThreadOp};
use super::report::Row;
use super::{Ctx, Section};

/// Source ring: far larger than any cache, so every copy reads DRAM.
const RING: u64 = 1 << 30;

/// Measures memcpy GB/s for every size and thread count (when `local` does not).
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let window = ctx.window();
    let ring = ring(&ctx.args.sizes);
    for size in ctx.args.sizes.clone() {
        for conns in ctx.args.conns.clone() {
            let m = run_threads(window, &mut ops(&ring, size, conns))?;
            ctx.report.push(
                Row::new(Section::Memcpy, "memcpy", "copy")
                    .shape(size, conns, 1)
                    .measured(&m),
            );
        }
    }
    note(ctx, ring.len());
    Ok(())
}

/// The source ring, written once so every page is backed.
pub(crate) fn ring(sizes: &[u64]) -> Vec<u8> {
    let max = sizes.iter().copied().max().unwrap_or(1);
    let len = RING.max(max * 8) as usize;
    eprintln!("  filling a {} MiB memcpy source ring", len >> 20);
    vec![0x5au8; len]
}

/// One copy loop per thread, each walking its own part of the ring.
pub(crate) fn ops(ring: &[u8], size: u64, conns: usize) -> Vec<ThreadOp<'_>> {
    batch_ops(ring, size, conns, 1)
}

/// [`ops`] copying `depth` consecutive values of the ring into `depth` buffers of their own
/// per call: the memcpy a batched get of `depth` keys into the caller's buffers amounts to
/// (its destinations, `depth` × the value size, need not fit a cache as one buffer does).
pub(crate) fn batch_ops(ring: &[u8], size: u64, conns: usize, depth: usize) -> Vec<ThreadOp<'_>> {
    let size_us = size as usize;
    copy_ops(ring.len() / size_us, size, conns, depth, move |slot| {
        &ring[slot * size_us..(slot + 1) * size_us]
    })
}

/// One copy loop per thread over `slots` sources of `size` bytes (`source(i)` is the i-th),
/// `depth` of them in turn into `depth` buffers of the thread's own per call, thread `t` of
/// `conns` starting at slot `t * slots / conns`.
pub(crate) fn copy_ops<'a>(
    slots: usize,
    size: u64,
    conns: usize,
    depth: usize,
    source: impl Fn(usize) -> &'a [u8] + Copy + Send + 'a,
) -> Vec<ThreadOp<'a>> {
    (0..conns)
        .map(|t| {
            let mut dsts = vec![vec![0u8; size as usize]; depth];
            let mut i = t * slots / conns;
            Box::new(move || {
                for dst in dsts.iter_mut() {
                    dst.copy_from_slice(source(i % slots));
                    i += 1;
                    black_box(&mut *dst);
                }
                Ok(size * dsts.len() as u64)
            }) as ThreadOp<'a>
        })
        .collect()
}

/// Explains the memcpy rows.
pub(crate) fn note(ctx: &mut Ctx, ring_len: usize) {
    ctx.report.note(
        Section::Memcpy,
        format!("conns = copying threads, each from its own part of a {} MiB ring into one value-sized buffer", ring_len >> 20),
    );
}
