//! Same-host zero-copy views of tensors: each tensor's chunks held on their nodes and mapped
//! read-only, end to end, so the tensor is one slice of this process's memory that is the
//! pool's memory itself. Each view is checked against the manifest's checksums once, when it is
//! made; the holds keep the daemon from evicting, moving or reusing the chunks while the views
//! live, so the bytes cannot change after the check. Part of `weights`.

use kvpool::weights::{chunk_key, ChunkRef, Manifest};

use super::{Weights, WeightsError, KEYS_PER_REQUEST};
use crate::{LocalHold, Located, ReadView};

/// Views of tensors made by [`Weights::view`]: `get(i)` is the `i`-th tensor asked for, or
/// None where it could not be viewed (a chunk on another host, in no copy, not page aligned,
/// or failing its checksum); load those with [`Weights::load_into`]. The holds end when this is
/// dropped.
pub struct TensorViews {
    // Field order is drop order: the mappings go before the holds that protect them.
    views: Vec<Option<ReadView>>,
    hold: LocalHold,
}

impl TensorViews {
    /// The bytes of the `i`-th tensor asked for, when it is viewed.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        self.views.get(i)?.as_ref().map(ReadView::as_slice)
    }

    /// Tensors asked for.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// Whether no tensor was asked for.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }

    /// Tensors viewed (the others must be copied).
    pub fn viewed(&self) -> usize {
        self.views.iter().flatten().count()
    }

    /// Connections keeping the holds (one per node of this host asked).
    pub fn connections(&self) -> usize {
        self.hold.connections()
    }
}

impl Weights {
    /// Zero-copy views of tensors `which` (file, tensor) of `m`, for the ones whose chunks
    /// all have a copy on a node of this host: see [`TensorViews`]. Never reads a file and
    /// never copies; what can't be viewed is None.
    ///
    /// With `verify`, every viewed chunk is hashed (on every core) and compared with the
    /// manifest, so a view's bytes are exactly the published ones. Without it, a view trusts
    /// the node's own check: each chunk's checksum, as the node recorded it when it verified
    /// the bytes it received, is compared with the manifest's, but the memory is not read; a
    /// chunk corrupted in place since (by another process of this host writing into the
    /// segment) would go unnoticed.
    pub async fn view(
        &self,
        m: &Manifest,
        which: &[(usize, usize)],
        verify: bool,
    ) -> Result<TensorViews, WeightsError> {
        let mut chunks: Vec<Vec<ChunkRef>> = Vec::with_capacity(which.len());
        for &(file, tensor) in which {
            let entry = m
                .files
                .get(file)
                .and_then(|f| f.tensors.get(tensor))
                .ok_or_else(|| WeightsError::NoTensor(format!("#{file}.{tensor}")))?;
            chunks.push(m.tensor_chunks(file, tensor, entry).collect());
        }
        let refs: Vec<&ChunkRef> = chunks.iter().flatten().collect();
        let keys: Vec<Vec<u8>> = refs.iter().map(|c| chunk_key(&m.name, c)).collect();
        let mut found: Vec<Option<Located>> = vec![None; keys.len()];
        let mut hold = LocalHold::default();
        let mut todo: Vec<usize> = (0..keys.len()).collect();
        for replica in 0..self.kv.pinned_replicas() {
            if todo.is_empty() {
                break;
            }
            let mut left = Vec::new();
            for group in todo.chunks(KEYS_PER_REQUEST) {
                let ks: Vec<&[u8]> = group.iter().map(|&i| &keys[i][..]).collect();
                let (h, got) = self.kv.hold_local(&ks, replica).await?;
                hold.absorb(h);
                for (&i, l) in group.iter().zip(got) {
                    match l {
                        Some(l) if l.checksum == refs[i].xxh3 && l.addr.len == refs[i].len => {
                            found[i] = Some(l)
                        }
                        _ => left.push(i),
                    }
                }
            }
            todo = left;
        }
        let mut views = Vec::with_capacity(which.len());
        let mut at = 0;
        for cs in &chunks {
            let located = &found[at..at + cs.len()];
            at += cs.len();
            let addrs: Option<Vec<_>> = located.iter().map(|l| l.map(|l| l.addr)).collect();
            // Verifying reads every byte at once: map the pages up front. Otherwise each page
            // is mapped when the caller first reads it, as a mapped file is.
            views.push(addrs.and_then(|a| match hold.view(&a, verify) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::debug!(error = %e, "a tensor can't be viewed in place; it is copied");
                    None
                }
            }));
        }
        if verify {
            verify_views(&mut views, &chunks);
        }
        Ok(TensorViews { views, hold })
    }
}

/// Hashes every chunk of every view against its manifest checksum, the chunks spread over
/// every core; a view with a chunk that fails is dropped (and logged).
fn verify_views(views: &mut [Option<ReadView>], chunks: &[Vec<ChunkRef>]) {
    let mut work: Vec<(usize, &[u8], u64)> = Vec::new();
    for (i, (v, cs)) in views.iter().zip(chunks).enumerate() {
        let Some(v) = v else { continue };
        let bytes = v.as_slice();
        let mut off = 0usize;
        for c in cs {
            work.push((i, &bytes[off..off + c.len as usize], c.xxh3));
            off += c.len as usize;
        }
    }
    // Largest first, so the threads finish together.
    work.sort_unstable_by_key(|w| std::cmp::Reverse(w.1.len()));
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(work.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let bad: Option<Vec<usize>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut bad = Vec::new();
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(i, bytes, want)) = work.get(k) else {
                            break bad;
                        };
                        if kvpool::checksum(bytes) != want {
                            bad.push(i);
                        }
                    }
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            // A hashing thread that died checked nothing: no view counts as verified.
            all.extend(h.join().ok()?);
        }
        Some(all)
    });
    let bad = bad.unwrap_or_else(|| (0..views.len()).collect());
    for i in bad {
        if views[i].take().is_some() {
            tracing::warn!(
                tensor = i,
                "a chunk in the pool fails its manifest checksum; the tensor is copied from another copy"
            );
        }
    }
}
