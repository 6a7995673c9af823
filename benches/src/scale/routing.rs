//! A client's routing cost: nanoseconds per key to find its owner in a view of 3 nodes and of
//! the run's node count, the same keys through the same code the client uses
//! (`ClusterView::owner` for one key, `placement::routing::group_by_owner` for a batch), the
//! two sizes alternating, best of `reps` passes each.

use std::hint::black_box;
use std::time::Instant;

use kvpool::placement::{routing, ClusterView, NodeInfo};

/// Nanoseconds per key.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cost {
    pub(crate) nodes: u32,
    pub(crate) owner_ns: f64,
    pub(crate) batch_ns: f64,
}

fn view(n: u32) -> ClusterView {
    ClusterView::from_nodes((0..n).map(|id| NodeInfo::serving(id, 64 << 30)).collect())
}

/// 32-byte keys, as prefix-hash keys are.
fn keys(n: usize) -> Vec<[u8; 32]> {
    (0..n as u64)
        .map(|i| {
            let h = xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()).to_le_bytes();
            let mut k = [0u8; 32];
            k[..16].copy_from_slice(&h);
            k[16..].copy_from_slice(&h);
            k
        })
        .collect()
}

fn pass(v: &ClusterView, keys: &[[u8; 32]]) -> (f64, f64) {
    let t = Instant::now();
    for k in keys {
        black_box(v.owner(black_box(k)));
    }
    let owner = t.elapsed().as_nanos() as f64 / keys.len() as f64;
    let t = Instant::now();
    for batch in keys.chunks(64) {
        black_box(routing::group_by_owner(v, batch, 0..batch.len(), 0));
    }
    let batch = t.elapsed().as_nanos() as f64 / keys.len() as f64;
    (owner, batch)
}

/// The cost at 3 nodes and at `n`, measured alternately.
pub(crate) fn measure(n: u32, reps: usize) -> [Cost; 2] {
    let keys = keys(200_000);
    let sizes = [3, n];
    let views = sizes.map(view);
    let mut best = [(f64::MAX, f64::MAX); 2];
    for _ in 0..reps.max(1) {
        for (i, v) in views.iter().enumerate() {
            let (o, b) = pass(v, &keys);
            best[i] = (best[i].0.min(o), best[i].1.min(b));
        }
    }
    [0, 1].map(|i| Cost {
        nodes: sizes[i],
        owner_ns: best[i].0,
        batch_ns: best[i].1,
    })
}
