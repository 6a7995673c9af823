//! Model weights in the pool (docs/WEIGHTS.md): safetensors files published tensor by tensor
//! as pinned chunks with a manifest, loaded back in parallel from every node into caller
//! buffers, whole tensors or a tensor-parallel slice, with missing chunks read from the files
//! and put back.
//!
//! Every chunk is checked against the manifest's xxh3 once: on the same host in the same pass
//! as the copy (the object's checksum, found equal to the manifest's before the copy), over a
//! socket by hashing the received bytes. A chunk missing or failing the check on one copy is
//! taken from the next replica.
//!
//! Uses `client` (leases, one-sided reads, batched pinned puts) and the core's
//! [`kvpool::weights`] format.

mod fetch;
mod publish;
mod view;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use kvpool::protocol::ErrorCode;
use kvpool::weights::{
    check_name, chunk_key, extra_key, manifest_key, shard_ranges, ChunkRef, FormatError, Manifest,
    Slice,
};
use thiserror::Error;

use crate::{Client, ClientError};
use fetch::Sink;

pub use publish::PublishOptions;
pub use view::TensorViews;

/// Keys per request of a removal or a presence probe (well under the node's `max_batch`).
const KEYS_PER_REQUEST: usize = 4096;

/// Bytes of tensors loaded at once when writing files back.
const WRITE_GROUP: u64 = 256 << 20;

/// Why a weights call failed.
#[derive(Debug, Error)]
pub enum WeightsError {
    /// A file or a manifest that breaks the format.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The pool could not be reached or refused a request.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// No model of that name is published.
    #[error("no model {0:?} in the pool")]
    NotFound(String),
    /// The model has no such tensor.
    #[error("model has no tensor {0:?}")]
    NoTensor(String),
    /// The namespace keeps another number of copies than asked for.
    #[error(
        "the namespace keeps {has} copies of each pinned object, not {asked}: set \
         `pinned_replicas = {asked}` in its [[namespace]] section or publish into a namespace \
         that has it"
    )]
    Replicas {
        /// Copies asked for.
        asked: u32,
        /// Copies the namespace keeps.
        has: usize,
    },
    /// A piece could not be stored; nothing of this publication was kept.
    #[error("storing {what}: {code:?}; nothing of the publication was kept")]
    Store {
        /// Which piece.
        what: String,
        /// The node's answer (`QuotaExceeded`, `PoolFull`, ...).
        code: ErrorCode,
    },
    /// Chunks are in no copy in the pool and no source file was given to read them from.
    #[error("{missing} of the {wanted} chunks asked for are in no copy in the pool")]
    Missing {
        /// Chunks missing.
        missing: usize,
        /// Chunks asked for.
        wanted: usize,
    },
    /// A source file given for missing chunks is not the one that was published.
    #[error("{path}: not the file published as {file:?} ({why})")]
    SourceChanged {
        /// The file.
        path: PathBuf,
        /// The published file's name.
        file: String,
        /// What differs.
        why: String,
    },
    /// A caller's buffer has the wrong size.
    #[error("buffer for {tensor:?} is {have} bytes, the tensor {need}")]
    Buffer {
        /// The tensor.
        tensor: String,
        /// Its length.
        need: u64,
        /// The buffer's.
        have: u64,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WeightsError + '_ {
    move |source| WeightsError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Where a load's bytes came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Chunks read from the pool.
    pub chunks_from_pool: usize,
    /// Bytes read from the pool.
    pub bytes_from_pool: u64,
    /// Chunks found missing and read from the source files (and put back).
    pub chunks_from_files: usize,
    /// Bytes read from the source files.
    pub bytes_from_files: u64,
    /// Chunks whose first copy was missing or failed its check and were read from another.
    pub chunks_from_replicas: usize,
}

/// One tensor to load whole: its place in the manifest and the caller's buffer (exactly its
/// length).
pub struct Target<'a> {
    /// Index of the file in [`Manifest::files`].
    pub file: usize,
    /// Index of the tensor in the file.
    pub tensor: usize,
    /// Where its bytes go.
    pub dst: &'a mut [u8],
}

/// The published files on disk, by file name, for chunks missing from the pool.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    paths: HashMap<String, PathBuf>,
}

impl Sources {
    /// The files in `dir` with the published files' names.
    pub fn dir(dir: &Path, m: &Manifest) -> Sources {
        Sources {
            paths: m
                .files
                .iter()
                .map(|f| (f.name.clone(), dir.join(&f.name)))
                .collect(),
        }
    }

    /// These files (a path's file name names the published file).
    pub fn files(paths: &[PathBuf]) -> Sources {
        Sources {
            paths: paths
                .iter()
                .filter_map(|p| Some((p.file_name()?.to_str()?.to_owned(), p.clone())))
                .collect(),
        }
    }
}

/// What a model's pieces look like in the pool now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightStats {
    /// Bytes of tensors.
    pub tensor_bytes: u64,
    /// Tensors.
    pub tensors: usize,
    /// Chunks (pieces of tensors).
    pub chunks: usize,
    /// Copies the namespace keeps of each.
    pub replicas: usize,
    /// Per node: (node id, chunk copies it serves, their bytes).
    pub nodes: Vec<(u32, usize, u64)>,
    /// Chunks with fewer copies than `replicas`.
    pub under_replicated: usize,
    /// Chunks with no copy at all.
    pub missing: usize,
    /// Per node that answered: reads of the weights namespace that found their object.
    pub namespace_hits: u64,
}

/// Model weights in one namespace of a pool.
#[derive(Clone)]
pub struct Weights {
    kv: Client,
}

impl Weights {
    /// Weights in `namespace` (usually [`kvpool::weights::DEFAULT_NAMESPACE`]) of the pool
    /// `kv` is connected to.
    pub fn new(kv: &Client, namespace: &str) -> Result<Weights, ClientError> {
        Ok(Weights {
            kv: kv.namespace(namespace)?,
        })
    }

    /// The client, bound to the weights' namespace.
    pub fn client(&self) -> &Client {
        &self.kv
    }

    /// The manifest of model `name`, None when it is not published.
    pub async fn manifest(&self, name: &str) -> Result<Option<Manifest>, WeightsError> {
        check_name(name)?;
        match self.kv.get(&manifest_key(name)).await? {
            Some(bytes) => Ok(Some(Manifest::from_json(&bytes)?)),
            None => Ok(None),
        }
    }

    /// Like [`Weights::manifest`], NotFound when there is none.
    pub async fn require(&self, name: &str) -> Result<Manifest, WeightsError> {
        self.manifest(name)
            .await?
            .ok_or_else(|| WeightsError::NotFound(name.to_owned()))
    }

    /// The names of the published models, sorted.
    pub async fn list(&self) -> Result<Vec<String>, WeightsError> {
        let keys = self
            .kv
            .keys_with_prefix(kvpool::weights::MANIFEST_PREFIX.as_bytes())
            .await?;
        Ok(keys
            .into_iter()
            .filter_map(|k| {
                let name = k.strip_prefix(kvpool::weights::MANIFEST_PREFIX.as_bytes())?;
                String::from_utf8(name.to_vec()).ok()
            })
            .collect())
    }

    /// Removes model `name`: its manifest first (so no new load starts), then its pieces.
    /// Returns false when it was not published.
    pub async fn remove(&self, name: &str) -> Result<bool, WeightsError> {
        let Some(m) = self.manifest(name).await? else {
            return Ok(false);
        };
        self.kv.remove(&manifest_key(name)).await?;
        self.remove_keys(&piece_keys(&m)).await?;
        Ok(true)
    }

    async fn remove_keys(&self, keys: &[Vec<u8>]) -> Result<(), ClientError> {
        for group in keys.chunks(KEYS_PER_REQUEST) {
            let refs: Vec<&[u8]> = group.iter().map(|k| &k[..]).collect();
            self.kv.batch_remove(&refs).await?;
        }
        Ok(())
    }

    /// Loads whole tensors into the callers' buffers, all chunks in parallel from every node.
    /// Chunks in no copy are read from `sources` (checked against the manifest, and put back
    /// into the pool) when given; otherwise the load fails with `Missing`.
    pub async fn load_into(
        &self,
        m: &Manifest,
        targets: &mut [Target<'_>],
        sources: Option<&Sources>,
    ) -> Result<LoadReport, WeightsError> {
        let mut sinks = Vec::new();
        let mut refs = Vec::new();
        for t in targets.iter_mut() {
            let entry = m
                .files
                .get(t.file)
                .and_then(|f| f.tensors.get(t.tensor))
                .ok_or_else(|| WeightsError::NoTensor(format!("#{}.{}", t.file, t.tensor)))?;
            if t.dst.len() as u64 != entry.len {
                return Err(WeightsError::Buffer {
                    tensor: entry.name.clone(),
                    need: entry.len,
                    have: t.dst.len() as u64,
                });
            }
            let mut rest: &mut [u8] = &mut *t.dst;
            for c in m.tensor_chunks(t.file, t.tensor, entry) {
                let (dst, tail) = std::mem::take(&mut rest).split_at_mut(c.len as usize);
                rest = tail;
                sinks.push(Sink {
                    key: chunk_key(&m.name, &c),
                    xxh3: c.xxh3,
                    dst,
                });
                refs.push(c);
            }
        }
        let mut report = LoadReport::default();
        let missing = self.fetch(&mut sinks, &mut report).await?;
        if missing.is_empty() {
            return Ok(report);
        }
        let Some(sources) = sources else {
            return Err(WeightsError::Missing {
                missing: missing.len(),
                wanted: sinks.len(),
            });
        };
        let mut files = SourceFiles::new(m, sources);
        for &i in &missing {
            let c = refs[i];
            files.read(&c, sinks[i].dst)?;
            report.chunks_from_files += 1;
            report.bytes_from_files += c.len;
        }
        // Put the missing chunks back, so the next load finds them.
        let items: Vec<(&[u8], &[u8])> = missing
            .iter()
            .map(|&i| (&sinks[i].key[..], &*sinks[i].dst))
            .collect();
        // Their bytes were just checked against these sums.
        let sums: Vec<u64> = missing.iter().map(|&i| sinks[i].xxh3).collect();
        let codes = self
            .kv
            .batch_put_pinned_with_checksums(&items, &sums)
            .await?;
        for (code, &i) in codes.iter().zip(&missing) {
            if *code != ErrorCode::Ok {
                tracing::warn!(
                    chunk = %String::from_utf8_lossy(&sinks[i].key),
                    ?code,
                    "a chunk read from its file could not be put back"
                );
            }
        }
        Ok(report)
    }

    /// Loads every tensor of the model; returns them in file order with their bytes.
    pub async fn load_all(
        &self,
        m: &Manifest,
        sources: Option<&Sources>,
    ) -> Result<(Vec<Vec<u8>>, LoadReport), WeightsError> {
        let mut bufs: Vec<Vec<u8>> = m
            .files
            .iter()
            .flat_map(|f| &f.tensors)
            .map(|t| vec![0u8; t.len as usize])
            .collect();
        let mut targets = Vec::with_capacity(bufs.len());
        let mut it = bufs.iter_mut();
        for (fi, f) in m.files.iter().enumerate() {
            for ti in 0..f.tensors.len() {
                let dst = it.next().expect("one buffer per tensor");
                targets.push(Target {
                    file: fi,
                    tensor: ti,
                    dst: &mut dst[..],
                });
            }
        }
        let report = self.load_into(m, &mut targets, sources).await?;
        drop(targets);
        Ok((bufs, report))
    }

    /// One tensor's bytes, found by name (for a per-rank checkpoint, `rank`'s).
    pub async fn tensor(
        &self,
        m: &Manifest,
        name: &str,
        rank: Option<u32>,
    ) -> Result<Vec<u8>, WeightsError> {
        let (file, tensor) = m
            .find(name, rank)
            .ok_or_else(|| WeightsError::NoTensor(name.to_owned()))?;
        let mut buf = vec![0u8; m.files[file].tensors[tensor].len as usize];
        self.load_into(
            m,
            &mut [Target {
                file,
                tensor,
                dst: &mut buf,
            }],
            None,
        )
        .await?;
        Ok(buf)
    }

    /// Slice `rank` of `world` of tensor `name` along dimension `dim`, fetching only the
    /// chunks the slice touches (all of them when `dim` is not the first and chunks are
    /// larger than a row). Returns its bytes and its shape.
    pub async fn slice(
        &self,
        m: &Manifest,
        name: &str,
        dim: usize,
        rank: u64,
        world: u64,
    ) -> Result<(Vec<u8>, Vec<u64>), WeightsError> {
        let (file, tensor) = m
            .find(name, None)
            .ok_or_else(|| WeightsError::NoTensor(name.to_owned()))?;
        let entry = &m.files[file].tensors[tensor];
        let Slice { ranges, shape } = shard_ranges(entry, dim, rank, world)?;
        let touched: Vec<ChunkRef> = m
            .tensor_chunks(file, tensor, entry)
            .filter(|c| {
                ranges
                    .iter()
                    .any(|&(b, l)| b < c.begin + c.len && c.begin < b + l)
            })
            .collect();
        let mut bufs: Vec<Vec<u8>> = touched.iter().map(|c| vec![0u8; c.len as usize]).collect();
        let mut sinks: Vec<Sink<'_>> = touched
            .iter()
            .zip(bufs.iter_mut())
            .map(|(c, b)| Sink {
                key: chunk_key(&m.name, c),
                xxh3: c.xxh3,
                dst: &mut b[..],
            })
            .collect();
        let missing = self.fetch(&mut sinks, &mut LoadReport::default()).await?;
        if !missing.is_empty() {
            return Err(WeightsError::Missing {
                missing: missing.len(),
                wanted: sinks.len(),
            });
        }
        drop(sinks);
        let mut out = Vec::with_capacity(ranges.iter().map(|r| r.1 as usize).sum());
        for (begin, len) in ranges {
            let mut at = begin;
            while at < begin + len {
                let (c, buf) = touched
                    .iter()
                    .zip(&bufs)
                    .find(|(c, _)| c.begin <= at && at < c.begin + c.len)
                    .expect("every byte of the slice lies in a fetched chunk");
                let end = (begin + len).min(c.begin + c.len);
                out.extend_from_slice(&buf[(at - c.begin) as usize..(end - c.begin) as usize]);
                at = end;
            }
        }
        Ok((out, shape))
    }

    /// A companion file's bytes, checked against the manifest.
    pub async fn extra(&self, m: &Manifest, index: usize) -> Result<Vec<u8>, WeightsError> {
        let e = m
            .extra
            .get(index)
            .ok_or_else(|| WeightsError::NoTensor(format!("extra file #{index}")))?;
        let mut buf = vec![0u8; e.len as usize];
        let mut sinks = [Sink {
            key: extra_key(&m.name, index, e),
            xxh3: e.xxh3,
            dst: &mut buf,
        }];
        if !self
            .fetch(&mut sinks, &mut LoadReport::default())
            .await?
            .is_empty()
        {
            return Err(WeightsError::Missing {
                missing: 1,
                wanted: 1,
            });
        }
        Ok(buf)
    }

    /// Writes the model's files into `dir`, byte for byte as published: every safetensors
    /// file and every companion file. Loads at most 256 MiB of tensors at once.
    pub async fn write_files(
        &self,
        m: &Manifest,
        dir: &Path,
        sources: Option<&Sources>,
    ) -> Result<LoadReport, WeightsError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut report = LoadReport::default();
        for (fi, f) in m.files.iter().enumerate() {
            let path = inside(dir, &f.name)?;
            let mut out = std::io::BufWriter::with_capacity(
                1 << 20,
                std::fs::File::create(&path).map_err(io_err(&path))?,
            );
            out.write_all(&(f.header.len() as u64).to_le_bytes())
                .and_then(|()| out.write_all(f.header.as_bytes()))
                .map_err(io_err(&path))?;
            let mut ti = 0;
            while ti < f.tensors.len() {
                let mut end = ti;
                let mut bytes = 0;
                while end < f.tensors.len()
                    && (end == ti || bytes + f.tensors[end].len <= WRITE_GROUP)
                {
                    bytes += f.tensors[end].len;
                    end += 1;
                }
                let mut bufs: Vec<Vec<u8>> = f.tensors[ti..end]
                    .iter()
                    .map(|t| vec![0u8; t.len as usize])
                    .collect();
                let mut targets: Vec<Target<'_>> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(k, b)| Target {
                        file: fi,
                        tensor: ti + k,
                        dst: &mut b[..],
                    })
                    .collect();
                let r = self.load_into(m, &mut targets, sources).await?;
                drop(targets);
                add_report(&mut report, &r);
                for b in &bufs {
                    out.write_all(b).map_err(io_err(&path))?;
                }
                ti = end;
            }
            out.flush().map_err(io_err(&path))?;
        }
        for i in 0..m.extra.len() {
            let path = inside(dir, &m.extra[i].name)?;
            let bytes = self.extra(m, i).await?;
            std::fs::write(&path, bytes).map_err(io_err(&path))?;
        }
        Ok(report)
    }

    /// Where the model's chunks are: copies per node, chunks short of copies or missing.
    pub async fn stats(&self, m: &Manifest) -> Result<WeightStats, WeightsError> {
        let chunks: Vec<ChunkRef> = m.chunks().collect();
        let keys: Vec<Vec<u8>> = chunks.iter().map(|c| chunk_key(&m.name, c)).collect();
        // A cluster of fewer nodes keeps fewer copies.
        let replicas = keys.first().map_or(self.kv.pinned_replicas(), |k| {
            let view = self.kv.routing_view();
            view.owners(k, self.kv.pinned_replicas()).len().max(1)
        });
        let mut copies = vec![0usize; keys.len()];
        let mut nodes: HashMap<u32, (usize, u64)> = HashMap::new();
        for replica in 0..replicas {
            for (g, group) in keys.chunks(KEYS_PER_REQUEST).enumerate() {
                let refs: Vec<&[u8]> = group.iter().map(|k| &k[..]).collect();
                let found = self.kv.lease_replica(&refs, 0, replica).await?;
                for (k, f) in found.into_iter().enumerate() {
                    if let Some(l) = f {
                        let i = g * KEYS_PER_REQUEST + k;
                        copies[i] += 1;
                        let n = nodes.entry(l.addr.node.0).or_default();
                        n.0 += 1;
                        n.1 += chunks[i].len;
                    }
                }
            }
        }
        let view = self.kv.routing_view();
        let mut hits = 0;
        for node in view.nodes.iter().map(|n| n.id) {
            if let Ok(s) = self.kv.node_stats(node).await {
                hits += s
                    .namespaces
                    .iter()
                    .filter(|n| n.name == kvpool::weights::DEFAULT_NAMESPACE)
                    .map(|n| n.hits)
                    .sum::<u64>();
            }
        }
        let mut per_node: Vec<(u32, usize, u64)> =
            nodes.into_iter().map(|(n, (c, b))| (n, c, b)).collect();
        per_node.sort_unstable();
        Ok(WeightStats {
            tensor_bytes: m.tensor_bytes(),
            tensors: m.tensor_count(),
            chunks: chunks.len(),
            replicas,
            nodes: per_node,
            under_replicated: copies.iter().filter(|&&c| c > 0 && c < replicas).count(),
            missing: copies.iter().filter(|&&c| c == 0).count(),
            namespace_hits: hits,
        })
    }
}

/// `dir/name` for a file name of a manifest, its directories created; a name that would
/// leave `dir` is refused.
fn inside(dir: &Path, name: &str) -> Result<PathBuf, WeightsError> {
    let ok = !name.is_empty()
        && !name.starts_with('/')
        && !name.contains('\\')
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if !ok {
        return Err(WeightsError::Format(FormatError::Manifest(format!(
            "file name {name:?} leaves the output directory"
        ))));
    }
    let path = dir.join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    Ok(path)
}

fn add_report(total: &mut LoadReport, r: &LoadReport) {
    total.chunks_from_pool += r.chunks_from_pool;
    total.bytes_from_pool += r.bytes_from_pool;
    total.chunks_from_files += r.chunks_from_files;
    total.bytes_from_files += r.bytes_from_files;
    total.chunks_from_replicas += r.chunks_from_replicas;
}

/// Every key of a model's pieces (chunks and companion files).
fn piece_keys(m: &Manifest) -> Vec<Vec<u8>> {
    m.chunks()
        .map(|c| chunk_key(&m.name, &c))
        .chain(
            m.extra
                .iter()
                .enumerate()
                .map(|(i, e)| extra_key(&m.name, i, e)),
        )
        .collect()
}

/// The source files of a load's missing chunks, each opened (and its header length checked)
/// once however many of its chunks are read.
struct SourceFiles<'a> {
    m: &'a Manifest,
    sources: &'a Sources,
    open: HashMap<usize, std::fs::File>,
}

impl<'a> SourceFiles<'a> {
    fn new(m: &'a Manifest, sources: &'a Sources) -> Self {
        SourceFiles {
            m,
            sources,
            open: HashMap::new(),
        }
    }

    /// Reads chunk `c` from its source file into `dst`, checked against the manifest.
    fn read(&mut self, c: &ChunkRef, dst: &mut [u8]) -> Result<(), WeightsError> {
        use std::os::unix::fs::FileExt;
        let f = &self.m.files[c.file];
        let t = &f.tensors[c.tensor];
        let path = self
            .sources
            .paths
            .get(&f.name)
            .ok_or(WeightsError::Missing {
                missing: 1,
                wanted: 1,
            })?;
        let changed = |why: String| WeightsError::SourceChanged {
            path: path.clone(),
            file: f.name.clone(),
            why,
        };
        let file = match self.open.entry(c.file) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let mut file = std::fs::File::open(path).map_err(io_err(path))?;
                let mut head = [0u8; 8];
                file.read_exact(&mut head).map_err(io_err(path))?;
                if u64::from_le_bytes(head) != f.header.len() as u64 {
                    return Err(changed("another header".into()));
                }
                v.insert(file)
            }
        };
        file.read_exact_at(dst, 8 + f.header.len() as u64 + t.offset + c.begin)
            .map_err(io_err(path))?;
        if kvpool::checksum::checksum(dst) != c.xxh3 {
            return Err(changed(format!("bytes of {} differ", t.name)));
        }
        Ok(())
    }
}
