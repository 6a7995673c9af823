//! What both phases share: a load's targets and its check against the file, the chunk list,
//! the lookup and the hash timed on their own, and the latency rows.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvpool::weights::{chunk_key, Manifest};
use kvpool_client::weights::{Target, Weights};
use kvpool_client::{Client, Located};

use super::report::{Report, Row};
use super::{Model, WeightsArgs, KEYS_PER_REQUEST, MODEL};

/// Targets for every tensor of a one-file manifest, into `dst`.
pub(super) fn targets<'a>(m: &Manifest, dst: &'a mut [Vec<u8>]) -> Vec<Target<'a>> {
    debug_assert_eq!(m.files.len(), 1);
    dst.iter_mut()
        .enumerate()
        .map(|(i, d)| Target {
            file: 0,
            tensor: i,
            dst: &mut d[..],
        })
        .collect()
}

/// Fails unless every loaded tensor equals the file's.
pub(super) fn check(model: &Model, dst: &[Vec<u8>], what: &str) -> anyhow::Result<()> {
    for (i, d) in dst.iter().enumerate() {
        ensure!(
            d[..] == *model.tensor(i),
            "{what}: tensor {i} differs from the file"
        );
    }
    Ok(())
}

/// Every chunk of the model: its key and (tensor, range in the tensor).
pub(super) fn chunks(m: &Manifest) -> Vec<(Vec<u8>, usize, usize, usize)> {
    m.chunks()
        .map(|c| {
            (
                chunk_key(&m.name, &c),
                c.tensor,
                c.begin as usize,
                (c.begin + c.len) as usize,
            )
        })
        .collect()
}

/// Looks up every chunk (no lease), one request per node per 4096 keys as the loader does.
pub(super) async fn lookup(kv: &Client, keys: &[Vec<u8>]) -> anyhow::Result<Vec<Located>> {
    let mut out = Vec::with_capacity(keys.len());
    for group in keys.chunks(KEYS_PER_REQUEST) {
        let refs: Vec<&[u8]> = group.iter().map(|k| &k[..]).collect();
        for f in kv.lease_replica(&refs, 0, 0).await? {
            out.push(f.context("a chunk is missing from the pool")?);
        }
    }
    Ok(out)
}

/// xxh3 of every chunk of the loaded tensors.
pub(super) fn hash_all(dst: &[Vec<u8>], chunks: &[(Vec<u8>, usize, usize, usize)]) -> Duration {
    let t = Instant::now();
    for (_, ti, b, e) in chunks {
        std::hint::black_box(kvpool::checksum::checksum(&dst[*ti][*b..*e]));
    }
    t.elapsed()
}

/// Latency of `Weights::tensor` of `name` alone, `reps` times.
fn tensor_latency(
    rt: &tokio::runtime::Runtime,
    w: &Weights,
    m: &Manifest,
    name: &str,
    reps: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        let bytes = rt.block_on(w.tensor(m, name, None))?;
        out.push(t.elapsed());
        std::hint::black_box(bytes);
    }
    Ok(out)
}

/// Latency rows of tensor 0 (file order) and of the first small tensor, and of the manifest.
pub(super) fn latencies(
    phase: &'static str,
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    w: &Weights,
    m: &Manifest,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut times = Vec::new();
    for _ in 0..args.latency_reps {
        let t = Instant::now();
        std::hint::black_box(rt.block_on(w.require(MODEL))?);
        times.push(t.elapsed());
    }
    report
        .rows
        .push(Row::new(phase, "manifest (Weights::require)", 0, &times).latency());
    let f = &m.files[0];
    let small = f
        .tensors
        .iter()
        .min_by_key(|t| t.len)
        .context("no tensors")?;
    for (t, label) in [(&f.tensors[0], "tensor 0"), (small, "smallest tensor")] {
        let times = tensor_latency(rt, w, m, &t.name, args.latency_reps)?;
        report.rows.push(
            Row::new(
                phase,
                &format!("Weights::tensor, {label} ({})", t.name),
                t.len,
                &times,
            )
            .latency(),
        );
    }
    Ok(())
}
