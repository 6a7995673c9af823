//! The same-host path: the client maps the node's segments, so a get is a lookup round trip
//! over the Unix socket plus a memcpy, and a one-sided read of an address already known is a
//! memcpy and two version checks, with no syscall at all. memcpy, its reference, is measured
//! here in slices alternating with the one-sided reads, twice: from the very objects read (each
//! mapped read-only on its own, [`SameBytes`]), the limit of reading those bytes and the
//! reference of the targets, and from a DRAM ring of the bench's own memory, which shows what
//! the machine's memory gives elsewhere.

use anyhow::{anyhow, Context};
use kvpool_client::{Client, ClientConfig, GlobalAddr, LocalHold, ReadView};

use super::compare::interleave_threads;
use super::driver::{Measured, ThreadOp};
use super::report::{Ref, Row};
use super::workloads::{self, DEPTH};
use super::{memcpy, Ctx, Section};

/// Lease long enough for the whole section (the pool caps it; nothing is evicted meanwhile).
const LEASE_MS: u64 = 30_000;

/// Target of one-sided reads, as a fraction of memcpy of the same objects.
const TARGET: f64 = 0.9;

/// The name of the targets' reference in the tables.
const SAME: &str = "memcpy of the same objects";

/// Measures memcpy and `read_local` side by side, then local `batch_get_into`, for every size
/// and concurrency.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let endpoint = format!("tcp://{}", ctx.daemon()?.tcp);
    let client = ctx
        .rt
        .block_on(Client::connect(&endpoint, ClientConfig::default()))?;
    if !client.is_local() {
        ctx.report.note(Section::Local, "the client did not take the same-host path (segments not mappable here): nothing to measure");
        return memcpy::run(ctx);
    }
    let ring = memcpy::ring(&ctx.args.sizes);
    for size in ctx.args.sizes.clone() {
        let keys = workloads::keys(size);
        let addrs = ctx.rt.block_on(lease_all(&client, &keys))?;
        let same = match ctx.rt.block_on(SameBytes::map(&client, &keys, &addrs)) {
            Ok(same) => Some(same),
            Err(e) => {
                ctx.report.note(
                    Section::Local,
                    format!("{SAME} not measured at {size} B ({e:#}): the targets are judged against the ring"),
                );
                None
            }
        };
        measure_read_local(ctx, &client, &addrs, &same, &ring, size)?;
        measure_batch_gets(ctx, &endpoint, &keys, &same, &ring, size)?;
        drop(same);
    }
    notes(ctx, ring.len());
    Ok(())
}

/// One-sided `read_local` of the leased `addrs` at every concurrency, alternating with both
/// memcpy references (the same objects, when mapped, and the `ring`).
fn measure_read_local(
    ctx: &mut Ctx,
    client: &Client,
    addrs: &[GlobalAddr],
    same: &Option<SameBytes>,
    ring: &[u8],
    size: u64,
) -> anyhow::Result<()> {
    let window = ctx.window();
    for conns in ctx.args.conns.clone() {
        let reads = read_ops(client, addrs, size, conns);
        let m = interleave_threads(
            &mut [
                SameBytes::ops_of(same, size, conns, 1),
                memcpy::ops(ring, size, conns),
                reads,
            ],
            window,
        )?;
        let mut row = Row::new(Section::Local, "kvpool", "read_local")
            .shape(size, conns, 1)
            .measured(&m[2]);
        row.refs = refs(row.gbps, &m, true);
        push_references(ctx, &m, size, conns, 1);
        ctx.report.push(row);
    }
    Ok(())
}

/// Local `batch_get_into` of `DEPTH` keys per call at every concurrency, with the checksum
/// check off, on, and on without the client's index, alternating with both memcpy references
/// copying as many values.
fn measure_batch_gets(
    ctx: &mut Ctx,
    endpoint: &str,
    keys: &[Vec<u8>],
    same: &Option<SameBytes>,
    ring: &[u8],
    size: u64,
) -> anyhow::Result<()> {
    let window = ctx.window();
    for (verify, index) in [(false, true), (true, true), (true, false)] {
        for conns in ctx.args.conns.clone() {
            let cfg = ClientConfig {
                verify_checksums: verify,
                local_index: if index {
                    ClientConfig::default().local_index
                } else {
                    0
                },
                ..ClientConfig::default()
            };
            let gets = batch_ops(endpoint, &cfg, keys, size, conns)?;
            let copies = memcpy::batch_ops(ring, size, conns, DEPTH);
            let same_copies = SameBytes::ops_of(same, size, conns, DEPTH);
            let m = interleave_threads(&mut [same_copies, copies, gets], window)?;
            if (verify, index) == (true, true) {
                push_references(ctx, &m, size, conns, DEPTH);
            }
            let op = match (verify, index) {
                (false, _) => "batch_get_into verify=off",
                (true, true) => "batch_get_into verify=on",
                (true, false) => "batch_get_into verify=on index=off",
            };
            let mut row = Row::new(Section::Local, "kvpool", op)
                .shape(size, conns, DEPTH)
                .measured(&m[2]);
            row.refs = refs(row.gbps, &m, verify && index);
            ctx.report.push(row);
        }
    }
    Ok(())
}

/// How the section measures, in the notes of `memcpy` and `local`; `ring_len` is the size of
/// the memcpy ring.
fn notes(ctx: &mut Ctx, ring_len: usize) {
    memcpy::note(ctx, ring_len);
    ctx.report.note(
        Section::Memcpy,
        format!("{SAME}: the data set's objects, each mapped read-only on its own under a hold, copied in the order and into the buffers the kvpool rows read them (the limit of reading those bytes, and the targets' reference); memcpy: the same copies from the bench's own {} MiB ring", ring_len >> 20),
    );
    ctx.report.note(
        Section::Local,
        format!(
            "read_local: addresses from one lease() call, then client.read_local(&addr, 0, &mut buf) in a loop \
             (conns = threads), alternating with both memcpy references in four slices; batch_get_into: {DEPTH} keys per call \
             (one blocking client per thread, alternating with both memcpy references copying {DEPTH} values into {DEPTH} buffers \
             of their own), copied from the mapping: keys the \
             client has seen (each client reads the data set once, unrecorded) straight from its index, with index=off after one lookup round trip over the Unix \
             socket each call; verify=on also hashes every value (xxh3, in the same pass as the copy)"
        ),
    );
}

/// One batched-get loop per thread, each on its own blocking client, `DEPTH` keys per call.
fn batch_ops<'a>(
    endpoint: &str,
    cfg: &ClientConfig,
    keys: &'a [Vec<u8>],
    size: u64,
    conns: usize,
) -> anyhow::Result<Vec<ThreadOp<'a>>> {
    (0..conns)
        .map(|t| {
            let c = kvpool_client::blocking::Client::connect(endpoint, cfg.clone())?;
            anyhow::ensure!(
                c.is_local(),
                "a second client did not take the same-host path"
            );
            let mut bufs = vec![vec![0u8; size as usize]; DEPTH];
            let mut i = t * keys.len() / conns;
            let mut op = Box::new(move || {
                let batch: Vec<&[u8]> = (0..DEPTH)
                    .map(|j| &keys[(i + j) % keys.len()][..])
                    .collect();
                i += DEPTH;
                let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                let got = c.batch_get_into(&batch, &mut dsts)?;
                anyhow::ensure!(
                    got.iter().all(|g| *g == Some(size as usize)),
                    "batch_get_into missed a stored key"
                );
                Ok(size * DEPTH as u64)
            }) as ThreadOp<'a>;
            if cfg.local_index > 0 {
                // The rows with the index measure keys the client has seen: one unrecorded pass
                // over the data set first, or the first pass's lookups (a round trip per call
                // until every key was read once) would be part of the figure.
                for _ in 0..keys.len().div_ceil(DEPTH) {
                    op()?;
                }
            }
            Ok(op)
        })
        .collect()
}

/// The data set's objects, each mapped read-only on its own ([`ReadView`], under a hold that
/// keeps the node from moving or rewriting them): memcpy from these is the limit of reading
/// those very bytes. A DRAM ring of the bench's own memory is not that limit: on this virtual
/// machine the same copy runs up to a fifth faster or slower depending on which memory it
/// reads, so a ring measures where the pages landed as much as the read path.
struct SameBytes {
    /// One view per key, in the keys' order (dropped before the hold, as views must be).
    views: Vec<ReadView>,
    _hold: LocalHold,
}

impl SameBytes {
    async fn map(client: &Client, keys: &[Vec<u8>], addrs: &[GlobalAddr]) -> anyhow::Result<Self> {
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        let (hold, found) = client.hold_local(&refs, 0).await.context("hold_local")?;
        let mut views = Vec::with_capacity(addrs.len());
        for (addr, f) in addrs.iter().zip(found) {
            let f = f.ok_or_else(|| anyhow!("a stored key is not held on this host"))?;
            anyhow::ensure!(f.addr == *addr, "a key moved while the section ran");
            views.push(
                hold.view(&[f.addr], true)
                    .context("mapping an object to copy from")?,
            );
        }
        Ok(SameBytes { views, _hold: hold })
    }

    /// [`SameBytes::ops`], or none (which measures nothing, at once) when the objects could
    /// not be mapped.
    fn ops_of(
        same: &Option<SameBytes>,
        size: u64,
        conns: usize,
        depth: usize,
    ) -> Vec<ThreadOp<'_>> {
        same.as_ref()
            .map_or_else(Vec::new, |s| s.ops(size, conns, depth))
    }

    /// One copy loop per thread, `depth` objects into `depth` buffers per call, each thread
    /// starting where the kvpool loop of the same rank starts.
    fn ops(&self, size: u64, conns: usize, depth: usize) -> Vec<ThreadOp<'_>> {
        let views = &self.views;
        memcpy::copy_ops(views.len(), size, conns, depth, move |i| {
            views[i].as_slice()
        })
    }
}

/// The memcpy rows of one interleaved measurement: `m[0]` from the same objects (when they
/// were measured), `m[1]` from the ring.
fn push_references(ctx: &mut Ctx, m: &[Measured], size: u64, conns: usize, depth: usize) {
    let what = if depth == 1 {
        "copy".to_string()
    } else {
        format!("copy into {depth} buffers")
    };
    if m[0].gbps() > 0.0 {
        ctx.report.push(
            Row::new(Section::Memcpy, SAME, &what)
                .shape(size, conns, depth)
                .measured(&m[0]),
        );
    }
    ctx.report.push(
        Row::new(Section::Memcpy, "memcpy", &what)
            .shape(size, conns, depth)
            .measured(&m[1]),
    );
}

/// A kvpool row's ratios to both references of its measurement: to the same objects, then to
/// the ring. With `targeted`, the target goes with the first of them that was measured.
fn refs(gbps: Option<f64>, m: &[Measured], targeted: bool) -> Vec<Ref> {
    let Some(g) = gbps else {
        return Vec::new();
    };
    let ratio = |name: &str, of: f64, target: bool| {
        if target {
            Ref::with_target(name, g / of, TARGET)
        } else {
            Ref::new(name, g / of)
        }
    };
    let same = Some(m[0].gbps()).filter(|r| *r > 0.0);
    let ring = Some(m[1].gbps()).filter(|r| *r > 0.0);
    let mut out = Vec::new();
    if let Some(s) = same {
        out.push(ratio(SAME, s, targeted));
    }
    if let Some(r) = ring {
        out.push(ratio("memcpy", r, targeted && same.is_none()));
    }
    out
}

/// One read loop per thread over the leased addresses.
fn read_ops<'a>(
    client: &Client,
    addrs: &'a [GlobalAddr],
    size: u64,
    conns: usize,
) -> Vec<ThreadOp<'a>> {
    (0..conns)
        .map(|t| {
            let client = client.clone();
            let mut buf = vec![0u8; size as usize];
            let mut i = t * addrs.len() / conns;
            Box::new(move || {
                let addr = &addrs[i % addrs.len()];
                i += 1;
                match client.read_local(addr, 0, &mut buf) {
                    Some(Ok(())) => Ok(size),
                    Some(Err(f)) => Err(anyhow!("read_local: {f}")),
                    None => Err(anyhow!("read_local: address not in the mapped segments")),
                }
            }) as ThreadOp<'a>
        })
        .collect()
}

/// Addresses of every key, leased for the section.
async fn lease_all(client: &Client, keys: &[Vec<u8>]) -> anyhow::Result<Vec<GlobalAddr>> {
    let mut addrs = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(1024) {
        let refs: Vec<&[u8]> = chunk.iter().map(|k| k.as_slice()).collect();
        for l in client.lease(&refs, LEASE_MS).await.context("lease")? {
            addrs.push(l.ok_or_else(|| anyhow!("a stored key is missing"))?.addr);
        }
    }
    Ok(addrs)
}
