//! Publishing: safetensors files read once, in order, by a reader thread that hashes each chunk
//! while the previous batch is being stored; companion files stored whole; the manifest last.
//! A publication that fails removes what it stored, so nothing half-published stays.

use std::collections::HashSet;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use kvpool::protocol::ErrorCode;
use kvpool::weights::{
    check_name, chunk_key, extra_key, header_len, index_files, manifest_key, parse_header,
    rank_of_file, ChunkRef, ExtraFile, FileEntry, Header, Manifest, TensorEntry,
    DEFAULT_CHUNK_SIZE, MANIFEST_FORMAT,
};

use super::{io_err, piece_keys, Weights, WeightsError};

/// Bytes of chunks stored per batch (one request per node).
const BATCH_BYTES: u64 = 64 << 20;

/// Most pieces per batch.
const BATCH_PIECES: usize = 1024;

/// Largest companion file (configs, tokenizers, the shard index).
const MAX_EXTRA: u64 = 256 << 20;

/// Largest chunk (the node's default `max_payload` is 1 GiB).
const MAX_CHUNK: u64 = 512 << 20;

/// How to publish.
#[derive(Clone, Debug)]
pub struct PublishOptions {
    /// Largest chunk a tensor is cut into. Default [`DEFAULT_CHUNK_SIZE`].
    pub chunk_size: u64,
    /// Copies asked for; the namespace must keep that many (None: whatever it keeps).
    pub replicas: Option<u32>,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            chunk_size: DEFAULT_CHUNK_SIZE,
            replicas: None,
        }
    }
}

/// A safetensors file to publish.
struct Source {
    path: PathBuf,
    name: String,
    header: Header,
}

/// Chunks read and hashed, in one buffer.
struct Batch {
    /// `batch_bytes` long; the pieces fill it from the start.
    buf: Vec<u8>,
    used: usize,
    /// (chunk, its range in `buf`).
    pieces: Vec<(ChunkRef, usize, usize)>,
}

impl Weights {
    /// Publishes model `name` from `paths`: safetensors files (a sharded checkpoint's
    /// `*.index.json` brings the files it names, from its directory), and any other file
    /// (configs, tokenizer) as a companion file stored whole. Replaces an earlier publication
    /// of the name once this one is complete; chunks whose bytes did not change are kept, not
    /// stored again.
    pub async fn publish(
        &self,
        name: &str,
        paths: &[PathBuf],
        opts: &PublishOptions,
    ) -> Result<Manifest, WeightsError> {
        check_name(name)?;
        let has = self.kv.pinned_replicas();
        if let Some(asked) = opts.replicas.filter(|&r| r as usize != has) {
            return Err(WeightsError::Replicas { asked, has });
        }
        if opts.chunk_size == 0 || opts.chunk_size > MAX_CHUNK {
            return Err(WeightsError::Format(
                kvpool::weights::FormatError::Manifest(format!(
                    "chunk size {} (1 to {MAX_CHUNK})",
                    opts.chunk_size
                )),
            ));
        }
        let (sources, extra_paths) = expand(paths)?;
        let old = self.manifest(name).await?;
        let mut written = Vec::new();
        let res = self
            .store(name, sources, &extra_paths, opts.chunk_size, &mut written)
            .await;
        let m = match res {
            Ok(m) => m,
            Err(e) => {
                self.undo(&written).await;
                return Err(e);
            }
        };
        let code = self
            .kv
            .batch_put_pinned(&[(&manifest_key(name), &m.to_json())])
            .await;
        match code.map(|c| c[0]) {
            Ok(ErrorCode::Ok) => {}
            Ok(code) => {
                self.undo(&written).await;
                return Err(WeightsError::Store {
                    what: "the manifest".into(),
                    code,
                });
            }
            Err(e) => {
                self.undo(&written).await;
                return Err(e.into());
            }
        }
        if let Some(old) = old {
            let keep: HashSet<Vec<u8>> = piece_keys(&m).into_iter().collect();
            let stale: Vec<Vec<u8>> = piece_keys(&old)
                .into_iter()
                .filter(|k| !keep.contains(k))
                .collect();
            self.remove_keys(&stale).await?;
        }
        Ok(m)
    }

    /// Removes what a failed publication stored.
    async fn undo(&self, written: &[Vec<u8>]) {
        if let Err(e) = self.remove_keys(written).await {
            tracing::warn!(error = %e, "removing the pieces of a failed publication");
        }
    }

    /// Stores the chunks of `sources` and the companion files `extra_paths` of model `name`;
    /// returns its manifest. `written`: the keys stored, for an undo.
    async fn store(
        &self,
        name: &str,
        sources: Vec<Source>,
        extra_paths: &[Named],
        chunk_size: u64,
        written: &mut Vec<Vec<u8>>,
    ) -> Result<Manifest, WeightsError> {
        let mut files = file_entries(&sources);
        self.store_chunks(name, sources, chunk_size, &mut files, written)
            .await?;
        let extra = self.store_extras(name, extra_paths, written).await?;
        Ok(Manifest {
            format: MANIFEST_FORMAT,
            name: name.to_owned(),
            chunk_size,
            replicas: self.kv.pinned_replicas() as u32,
            files,
            extra,
        })
    }

    /// Stores the tensors of `sources` in chunks of `chunk_size`, read by a thread of their own
    /// in batches while the previous batch is put, and records their checksums in `files`.
    async fn store_chunks(
        &self,
        name: &str,
        sources: Vec<Source>,
        chunk_size: u64,
        files: &mut [FileEntry],
        written: &mut Vec<Vec<u8>>,
    ) -> Result<(), WeightsError> {
        let (full_tx, mut full_rx) = tokio::sync::mpsc::channel::<Result<Batch, WeightsError>>(2);
        let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let batch_bytes = BATCH_BYTES.max(chunk_size) as usize;
        for _ in 0..3 {
            empty_tx
                .send(vec![0u8; batch_bytes])
                .expect("the receiver is alive");
        }
        let reader = std::thread::spawn(move || {
            read_all(sources, chunk_size, batch_bytes, &full_tx, &empty_rx)
        });
        let mut failure = None;
        while let Some(batch) = full_rx.recv().await {
            let res = match batch {
                Ok(b) => self
                    .store_batch(name, &b, files, written)
                    .await
                    .map(|()| b.buf),
                Err(e) => Err(e),
            };
            match res {
                Ok(buf) => {
                    // The reader may have finished; then the buffer is simply dropped.
                    let _ = empty_tx.send(buf);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        drop(full_rx);
        drop(empty_tx);
        // The reader stops at its next send once the channel is closed.
        let _ = reader.join();
        failure.map_or(Ok(()), Err)
    }

    /// Stores the companion files `extra_paths` of model `name` whole.
    async fn store_extras(
        &self,
        name: &str,
        extra_paths: &[Named],
        written: &mut Vec<Vec<u8>>,
    ) -> Result<Vec<ExtraFile>, WeightsError> {
        let mut extra = Vec::with_capacity(extra_paths.len());
        for (i, (p, rel)) in extra_paths.iter().enumerate() {
            let len = std::fs::metadata(p).map_err(io_err(p))?.len();
            if len > MAX_EXTRA {
                return Err(WeightsError::Io {
                    path: p.clone(),
                    source: std::io::Error::other(format!(
                        "{len} bytes: a companion file may have at most {MAX_EXTRA}; \
                         give safetensors files a .safetensors name"
                    )),
                });
            }
            let bytes = std::fs::read(p).map_err(io_err(p))?;
            let e = ExtraFile {
                name: rel.clone(),
                len: bytes.len() as u64,
                xxh3: kvpool::checksum::checksum(&bytes),
            };
            let key = extra_key(name, i, &e);
            self.put_new(&[(key, &bytes[..])], &[e.xxh3], "a companion file", written)
                .await?;
            extra.push(e);
        }
        Ok(extra)
    }

    /// Stores a batch's chunks that the pool does not hold yet and records their checksums.
    async fn store_batch(
        &self,
        name: &str,
        b: &Batch,
        files: &mut [FileEntry],
        written: &mut Vec<Vec<u8>>,
    ) -> Result<(), WeightsError> {
        let items: Vec<(Vec<u8>, &[u8])> = b
            .pieces
            .iter()
            .map(|(c, from, to)| (chunk_key(name, c), &b.buf[*from..*to]))
            .collect();
        let sums: Vec<u64> = b.pieces.iter().map(|(c, _, _)| c.xxh3).collect();
        self.put_new(&items, &sums, "a chunk", written).await?;
        for (c, _, _) in &b.pieces {
            let t = &mut files[c.file].tensors[c.tensor];
            debug_assert_eq!(t.chunks.len(), c.chunk, "chunks arrive in order");
            t.chunks.push(c.xxh3);
        }
        Ok(())
    }

    /// Stores the items whose keys the pool does not hold (their bytes are in the key's
    /// checksum, so a present key holds these bytes); records the keys it stored. `sums`:
    /// the items' xxh3, computed once by the reader (the node checks them on commit).
    async fn put_new(
        &self,
        items: &[(Vec<u8>, &[u8])],
        sums: &[u64],
        what: &str,
        written: &mut Vec<Vec<u8>>,
    ) -> Result<(), WeightsError> {
        let keys: Vec<&[u8]> = items.iter().map(|(k, _)| &k[..]).collect();
        let present = self.kv.present(&keys).await?;
        let new: Vec<usize> = (0..items.len()).filter(|&i| !present[i]).collect();
        let todo: Vec<(&[u8], &[u8])> =
            new.iter().map(|&i| (&items[i].0[..], items[i].1)).collect();
        let todo_sums: Vec<u64> = new.iter().map(|&i| sums[i]).collect();
        if todo.is_empty() {
            return Ok(());
        }
        let codes = self
            .kv
            .batch_put_pinned_with_checksums(&todo, &todo_sums)
            .await?;
        // Record first, so a failure below still removes every stored one.
        for ((k, _), c) in todo.iter().zip(&codes) {
            if *c == ErrorCode::Ok {
                written.push(k.to_vec());
            }
        }
        if let Some(((k, _), &code)) = todo.iter().zip(&codes).find(|(_, &c)| c != ErrorCode::Ok) {
            return Err(WeightsError::Store {
                what: format!("{what} ({})", String::from_utf8_lossy(k)),
                code,
            });
        }
        Ok(())
    }
}

/// A file of the model: where it is, and its name in the model (relative, `/`-separated).
type Named = (PathBuf, String);

/// The manifest's entry of each source file, its tensors' chunks still to be recorded.
fn file_entries(sources: &[Source]) -> Vec<FileEntry> {
    sources
        .iter()
        .map(|s| FileEntry {
            name: s.name.clone(),
            rank: rank_of_file(&s.name),
            header: s.header.text.clone(),
            data_len: s.header.data_len,
            tensors: s
                .header
                .tensors
                .iter()
                .map(|t| TensorEntry {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                    shape: t.shape.clone(),
                    offset: t.begin,
                    len: t.end - t.begin,
                    chunks: Vec::new(),
                })
                .collect(),
        })
        .collect()
}

/// The safetensors files (with their headers) and the companion files of `paths`. A
/// directory brings every file under it (hidden ones aside), named relative to it.
fn expand(paths: &[PathBuf]) -> Result<(Vec<Source>, Vec<Named>), WeightsError> {
    let mut named: Vec<Named> = Vec::new();
    for p in paths {
        if p.is_dir() {
            walk(p, "", &mut named)?;
        } else {
            named.push((p.clone(), file_name(p)?));
        }
    }
    let mut tensors: Vec<Named> = Vec::new();
    let mut extra: Vec<Named> = Vec::new();
    for (p, name) in named {
        if name.ends_with(".safetensors") {
            tensors.push((p, name));
        } else if name.ends_with(".index.json") {
            let bytes = std::fs::read(&p).map_err(io_err(&p))?;
            let dir = p.parent().unwrap_or(Path::new("."));
            let base = name.rsplit_once('/').map_or("", |(d, _)| d);
            for f in index_files(&bytes)? {
                let rel = if base.is_empty() {
                    f.clone()
                } else {
                    format!("{base}/{f}")
                };
                tensors.push((dir.join(f), rel));
            }
            extra.push((p, name));
        } else {
            extra.push((p, name));
        }
    }
    let mut seen = HashSet::new();
    let mut sources = Vec::with_capacity(tensors.len());
    for (p, name) in tensors {
        // A file named by the index and given (or found in the directory) too.
        if !seen.insert(name.clone()) {
            continue;
        }
        let header = read_header(&p)?;
        sources.push(Source {
            path: p,
            name,
            header,
        });
    }
    for (p, name) in &extra {
        if !seen.insert(name.clone()) {
            return Err(WeightsError::Io {
                path: p.clone(),
                source: std::io::Error::other(format!("two files of the model are named {name:?}")),
            });
        }
    }
    if sources.is_empty() {
        return Err(WeightsError::Format(
            kvpool::weights::FormatError::Safetensors(
                "no .safetensors file (or shard index) given".into(),
            ),
        ));
    }
    Ok((sources, extra))
}

/// Every file under `dir`, hidden ones (`.git`, `.gitattributes`) aside, in name order.
fn walk(dir: &Path, prefix: &str, out: &mut Vec<Named>) -> Result<(), WeightsError> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .collect::<Result<_, _>>()
        .map_err(io_err(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let name = file_name(&p)?;
        if name.starts_with('.') {
            continue;
        }
        let rel = format!("{prefix}{name}");
        if p.is_dir() {
            walk(&p, &format!("{rel}/"), out)?;
        } else {
            out.push((p, rel));
        }
    }
    Ok(())
}

fn file_name(p: &Path) -> Result<String, WeightsError> {
    p.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .ok_or_else(|| WeightsError::Io {
            path: p.to_owned(),
            source: std::io::Error::other("not a file name in UTF-8"),
        })
}

/// Reads and checks a safetensors file's header.
pub(super) fn read_header(p: &Path) -> Result<Header, WeightsError> {
    let mut f = std::fs::File::open(p).map_err(io_err(p))?;
    let file_len = f.metadata().map_err(io_err(p))?.len();
    let mut first = [0u8; 8];
    f.read_exact(&mut first).map_err(io_err(p))?;
    let n = header_len(first)?;
    if 8 + n > file_len {
        return Err(WeightsError::Format(
            kvpool::weights::FormatError::Safetensors(format!(
                "{}: header of {n} bytes in a file of {file_len}",
                p.display()
            )),
        ));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).map_err(io_err(p))?;
    Ok(parse_header(&text, file_len)?)
}

/// The reader thread: every file's data section in order, cut into chunks, each hashed, in
/// batches of about `batch_bytes` into buffers handed back through `empty`.
fn read_all(
    sources: Vec<Source>,
    chunk_size: u64,
    batch_bytes: usize,
    full: &tokio::sync::mpsc::Sender<Result<Batch, WeightsError>>,
    empty: &std::sync::mpsc::Receiver<Vec<u8>>,
) {
    let send = |b: Result<Batch, WeightsError>| full.blocking_send(b).is_ok();
    let Ok(buf) = empty.recv() else { return };
    let mut batch = Batch {
        buf,
        used: 0,
        pieces: Vec::new(),
    };
    for (fi, s) in sources.iter().enumerate() {
        let opened = std::fs::File::open(&s.path).and_then(|mut f| {
            f.seek(SeekFrom::Start(s.header.data_start))?;
            Ok(f)
        });
        let mut f = match opened {
            Ok(f) => f,
            Err(e) => {
                send(Err(io_err(&s.path)(e)));
                return;
            }
        };
        for (ti, t) in s.header.tensors.iter().enumerate() {
            let len = t.end - t.begin;
            let mut begin = 0;
            for ci in 0..len.div_ceil(chunk_size) as usize {
                let n = chunk_size.min(len - begin) as usize;
                if batch.used + n > batch_bytes || batch.pieces.len() == BATCH_PIECES {
                    let Ok(next) = empty.recv() else { return };
                    let full_batch = std::mem::replace(
                        &mut batch,
                        Batch {
                            buf: next,
                            used: 0,
                            pieces: Vec::new(),
                        },
                    );
                    if !send(Ok(full_batch)) {
                        return;
                    }
                }
                let from = batch.used;
                let dst = &mut batch.buf[from..from + n];
                if let Err(e) = f.read_exact(dst) {
                    send(Err(io_err(&s.path)(e)));
                    return;
                }
                batch.used += n;
                let xxh3 = kvpool::checksum::checksum(dst);
                batch.pieces.push((
                    ChunkRef {
                        file: fi,
                        tensor: ti,
                        chunk: ci,
                        begin,
                        len: n as u64,
                        xxh3,
                    },
                    from,
                    from + n,
                ));
                begin += n as u64;
            }
        }
    }
    if !batch.pieces.is_empty() {
        send(Ok(batch));
    }
}
