//! The same-host path: the client maps the node's segments, so a get is a lookup round trip
//! over the Unix socket plus a memcpy, and a one-sided read of an address already known is a
//! memcpy and two version checks, with no syscall at all. memcpy, its reference, is measured
//! here in slices alternating with the one-sided reads.

use anyhow::{anyhow, Context};
use kvpool_client::{Client, ClientConfig, GlobalAddr};

use super::compare::interleave_threads;
use super::driver::ThreadOp;
use super::report::{Ref, Row};
use super::workloads::{self, DEPTH};
use super::{memcpy, Ctx, Section};

/// Lease long enough for the whole section (the pool caps it; nothing is evicted meanwhile).
const LEASE_MS: u64 = 30_000;

/// Target of one-sided reads, as a fraction of memcpy.
const TARGET: f64 = 0.9;

/// Measures memcpy and `read_local` side by side, then local `batch_get_into`, for every size
/// and concurrency.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let endpoint = format!("tcp://{}", ctx.daemon()?.tcp);
    let window = ctx.window();
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
        for conns in ctx.args.conns.clone() {
            let reads = read_ops(&client, &addrs, size, conns);
            let m = interleave_threads(&mut [memcpy::ops(&ring, size, conns), reads], window)?;
            let copy = Row::new(Section::Memcpy, "memcpy", "copy")
                .shape(size, conns, 1)
                .measured(&m[0]);
            let mut row = Row::new(Section::Local, "kvpool", "read_local")
                .shape(size, conns, 1)
                .measured(&m[1]);
            if let (Some(g), Some(r)) = (row.gbps, copy.gbps.filter(|r| *r > 0.0)) {
                row.refs.push(Ref::with_target("memcpy", g / r, TARGET));
            }
            ctx.report.push(copy);
            ctx.report.push(row);
        }
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
                let gets = batch_ops(&endpoint, &cfg, &keys, size, conns)?;
                let copies = memcpy::batch_ops(&ring, size, conns, DEPTH);
                let m = interleave_threads(&mut [copies, gets], window)?;
                if (verify, index) == (true, true) {
                    ctx.report.push(
                        Row::new(
                            Section::Memcpy,
                            "memcpy",
                            &format!("copy into {DEPTH} buffers"),
                        )
                        .shape(size, conns, DEPTH)
                        .measured(&m[0]),
                    );
                }
                let op = match (verify, index) {
                    (false, _) => "batch_get_into verify=off",
                    (true, true) => "batch_get_into verify=on",
                    (true, false) => "batch_get_into verify=on index=off",
                };
                let mut row = Row::new(Section::Local, "kvpool", op)
                    .shape(size, conns, DEPTH)
                    .measured(&m[1]);
                if let (Some(g), Some(r)) = (row.gbps, Some(m[0].gbps()).filter(|r| *r > 0.0)) {
                    row.refs.push(if verify && index {
                        Ref::with_target("memcpy", g / r, TARGET)
                    } else {
                        Ref::new("memcpy", g / r)
                    });
                }
                ctx.report.push(row);
            }
        }
    }
    memcpy::note(ctx, ring.len());
    ctx.report.note(
        Section::Local,
        format!(
            "read_local: addresses from one lease() call, then client.read_local(&addr, 0, &mut buf) in a loop \
             (conns = threads), alternating with memcpy in four slices; batch_get_into: {DEPTH} keys per call \
             (one blocking client per thread, alternating with a memcpy of {DEPTH} values into {DEPTH} buffers \
             of their own, the reference of these rows), copied from the mapping: keys the \
             client has seen (each client reads the data set once, unrecorded) straight from its index, with index=off after one lookup round trip over the Unix \
             socket each call; verify=on also hashes every value (xxh3, in the same pass as the copy)"
        ),
    );
    Ok(())
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
