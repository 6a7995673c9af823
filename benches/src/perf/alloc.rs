//! The block allocator alone, one thread: allocate a block and free the oldest of 64 live ones,
//! over and over (a steady state, not an empty allocator). The system allocator (glibc
//! malloc/free of the same sizes, same pattern) is the reference, measured in alternating
//! slices.

use std::hint::black_box;

use anyhow::Context;
use kvpool::alloc::{AllocConfig, Allocator};

use super::compare::interleave_threads;
use super::driver::ThreadOp;
use super::report::{Ref, Row};
use super::{Ctx, Section};

/// Block sizes measured.
const SIZES: [u64; 3] = [4 << 10, 64 << 10, 2 << 20];
/// Blocks kept live while measuring.
const LIVE: usize = 64;
/// Pairs per timed operation (one pair takes tens of nanoseconds: too short to time alone).
const BATCH: u64 = 256;
/// Target allocate+free pairs per second.
const TARGET: f64 = 5e6;
/// Capacity of the allocator under test.
const CAPACITY: u64 = 1 << 30;

/// Measures both allocators at every size.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let window = ctx.window() / 2;
    for size in SIZES {
        let mut sys_ring: Vec<Vec<u8>> = (0..LIVE)
            .map(|_| Vec::with_capacity(size as usize))
            .collect();
        let mut i = 0;
        let sys: ThreadOp<'_> = Box::new(move || {
            for _ in 0..BATCH {
                sys_ring[i] = black_box(Vec::with_capacity(size as usize));
                i = (i + 1) % LIVE;
            }
            Ok(0)
        });
        let mut alloc =
            Allocator::new(CAPACITY, AllocConfig::default()).context("creating the allocator")?;
        let mut ring = Vec::with_capacity(LIVE);
        for _ in 0..LIVE {
            ring.push(
                alloc
                    .allocate(size)
                    .context("allocator full while filling")?
                    .offset,
            );
        }
        let mut j = 0;
        let kv: ThreadOp<'_> = Box::new(move || {
            for _ in 0..BATCH {
                let b = alloc.allocate(size).context("allocator full")?;
                alloc.free(ring[j])?;
                ring[j] = black_box(b.offset);
                j = (j + 1) % LIVE;
            }
            Ok(0)
        });
        let m = interleave_threads(&mut [vec![sys], vec![kv]], window)?;
        let (sys, kv) = (&m[0], &m[1]);
        let (sys_rate, kv_rate) = (
            sys.ops_per_s() * BATCH as f64,
            kv.ops_per_s() * BATCH as f64,
        );
        let mut sys_row =
            Row::new(Section::Alloc, "system malloc", "malloc+free").shape(size, 1, 1);
        sys_row.ops_per_s = Some(sys_rate);
        let mut row =
            Row::new(Section::Alloc, "kvpool Allocator", "allocate+free").shape(size, 1, 1);
        row.ops_per_s = Some(kv_rate);
        row.refs
            .push(Ref::with_target("5 M/s", kv_rate / TARGET, 1.0));
        if sys_rate > 0.0 {
            row.refs.push(Ref::new("system malloc", kv_rate / sys_rate));
        }
        ctx.report.push(sys_row);
        ctx.report.push(row);
    }
    ctx.report.note(
        Section::Alloc,
        format!(
            "ops/s = allocate+free pairs per second on one thread: {LIVE} blocks live, each step allocates one \
             and frees the oldest; Allocator::new({} GiB, AllocConfig::default()); timed in batches of {BATCH}",
            CAPACITY >> 30
        ),
    );
    Ok(())
}
