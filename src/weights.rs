//! Model weights in the pool: the safetensors format, the manifest that describes a published
//! model, the keys its pieces are stored under, and the byte ranges of a tensor-parallel slice.
//!
//! No I/O here: the client publishes and loads (`kvpool_client::weights`), the daemon's RESP
//! door serves SGLang's remote loader from the same objects. docs/WEIGHTS.md is the user's view.
//!
//! A published model is
//! - one *chunk* object per piece of a tensor (tensors larger than the chunk size are cut; a
//!   tensor of zero bytes has no chunk), pinned, under [`chunk_key`]: the model's name hash, the
//!   tensor's place and the chunk's xxh3, so identical bytes published twice land on the same
//!   key, and a chunk of another publication of the model can never be taken for this one's;
//! - one *extra file* object per small companion file (`config.json`, the shard index, ...);
//! - the [`Manifest`], a JSON object under [`manifest_key`], written last: a model is visible
//!   only once all of its pieces are stored.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Version of the manifest layout this code writes and reads.
pub const MANIFEST_FORMAT: u32 = 1;

/// Namespace weights go to unless told otherwise.
pub const DEFAULT_NAMESPACE: &str = "weights";

/// Default size of a chunk: large enough that a request's overhead is noise, small enough that
/// a model is spread over every node and loads in parallel.
pub const DEFAULT_CHUNK_SIZE: u64 = 16 << 20;

/// Longest model name (the manifest key must stay a valid key).
pub const MAX_NAME: usize = 200;

/// Largest safetensors header accepted (the format's own reference reader uses 100 MB).
pub const MAX_HEADER: u64 = 100 << 20;

/// Why a file or a manifest was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// Not a safetensors file, or one that breaks the format's rules.
    #[error("not a valid safetensors file: {0}")]
    Safetensors(String),
    /// A manifest that does not parse, or is of a layout this version can't read.
    #[error("bad weights manifest: {0}")]
    Manifest(String),
    /// A model name that can't be used.
    #[error("bad model name: {0}")]
    Name(String),
    /// A tensor-parallel slice that can't be taken.
    #[error("can't shard tensor {tensor:?}: {why}")]
    Shard {
        /// The tensor.
        tensor: String,
        /// Why.
        why: String,
    },
}

/// One tensor of a safetensors header, where its bytes lie in the data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderTensor {
    /// Name.
    pub name: String,
    /// Element type as the file names it (`F32`, `BF16`, ...).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// First byte in the data section.
    pub begin: u64,
    /// One past the last byte.
    pub end: u64,
}

/// A parsed safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The header's JSON exactly as in the file (padding included), so the file can be
    /// written back byte for byte.
    pub text: String,
    /// Where the data section starts: 8 + the header's length.
    pub data_start: u64,
    /// Length of the data section.
    pub data_len: u64,
    /// Tensors in the order of their bytes in the file.
    pub tensors: Vec<HeaderTensor>,
}

/// Bits per element of a safetensors dtype, None for one this code doesn't know.
pub fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        _ => return None,
    })
}

/// Reads the length prefix of a safetensors file: the header's length.
pub fn header_len(first8: [u8; 8]) -> Result<u64, FormatError> {
    let n = u64::from_le_bytes(first8);
    if n == 0 || n > MAX_HEADER {
        return Err(FormatError::Safetensors(format!(
            "header length {n} (at most {MAX_HEADER})"
        )));
    }
    Ok(n)
}

/// Parses a header (`text`: the bytes after the length prefix) of a file of `file_len` bytes.
/// Checks what the format requires: offsets inside the file, no overlaps and no holes, and
/// for known dtypes a byte length that matches the shape.
pub fn parse_header(text: &[u8], file_len: u64) -> Result<Header, FormatError> {
    let bad = |m: String| FormatError::Safetensors(m);
    let text = std::str::from_utf8(text).map_err(|_| bad("header is not UTF-8".into()))?;
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| bad(format!("header JSON: {e}")))?;
    let data_start = 8 + text.len() as u64;
    let data_len = file_len
        .checked_sub(data_start)
        .ok_or_else(|| bad("file shorter than its header".into()))?;
    let mut tensors = Vec::with_capacity(map.len());
    for (name, v) in map {
        if name == "__metadata__" {
            continue;
        }
        let t: RawTensor = serde_json::from_value(v).map_err(|e| bad(format!("{name}: {e}")))?;
        let [begin, end] = t.data_offsets;
        if begin > end || end > data_len {
            return Err(bad(format!(
                "{name}: bytes {begin}..{end} outside a data section of {data_len}"
            )));
        }
        if let Some(bits) = dtype_bits(&t.dtype) {
            let elems = t
                .shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("{name}: shape overflows")))?;
            let want = elems
                .checked_mul(bits)
                .map(|b| b.div_ceil(8))
                .ok_or_else(|| bad(format!("{name}: shape overflows")))?;
            if want != end - begin {
                return Err(bad(format!(
                    "{name}: {} bytes for a {} tensor of shape {:?} (needs {want})",
                    end - begin,
                    t.dtype,
                    t.shape
                )));
            }
        }
        tensors.push(HeaderTensor {
            name,
            dtype: t.dtype,
            shape: t.shape,
            begin,
            end,
        });
    }
    tensors.sort_by_key(|t| (t.begin, t.end));
    let mut at = 0;
    for t in &tensors {
        if t.begin != at {
            return Err(bad(format!(
                "{}: starts at {} where the previous tensor ended at {at} (holes and overlaps are not allowed)",
                t.name, t.begin
            )));
        }
        at = t.end;
    }
    if at != data_len {
        return Err(bad(format!(
            "tensors cover {at} bytes of a data section of {data_len}"
        )));
    }
    Ok(Header {
        text: text.to_owned(),
        data_start,
        data_len,
        tensors,
    })
}

#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// What the pool holds of a published model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`] of the writer.
    pub format: u32,
    /// The model's name.
    pub name: String,
    /// Largest chunk.
    pub chunk_size: u64,
    /// Copies of every piece the namespace keeps (its `pinned_replicas`) when published.
    pub replicas: u32,
    /// The safetensors files, in the order they were given (or the index lists them).
    pub files: Vec<FileEntry>,
    /// Small companion files (configs, tokenizer, the shard index), stored whole.
    pub extra: Vec<ExtraFile>,
}

/// One safetensors file of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name (no directory).
    pub name: String,
    /// The tensor-parallel rank the file belongs to, for checkpoints saved per rank
    /// (`model-rank-R-part-P.safetensors`); None: every rank's.
    pub rank: Option<u32>,
    /// The header's JSON exactly as in the file.
    pub header: String,
    /// Length of the data section.
    pub data_len: u64,
    /// Tensors in the order of their bytes.
    pub tensors: Vec<TensorEntry>,
}

/// One tensor of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Name.
    pub name: String,
    /// Element type (`F32`, `BF16`, ...).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Offset in its file's data section.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// xxh3-64 of each chunk, in order; chunk `i` covers bytes `i * chunk_size ..` of the
    /// tensor.
    pub chunks: Vec<u64>,
}

/// A companion file stored whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtraFile {
    /// File name (no directory).
    pub name: String,
    /// Length.
    pub len: u64,
    /// xxh3-64 of the bytes.
    pub xxh3: u64,
}

/// Where one chunk is: which file, tensor and piece, and its bytes' range in the tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkRef {
    /// Index of the file in [`Manifest::files`].
    pub file: usize,
    /// Index of the tensor in its file.
    pub tensor: usize,
    /// Index of the chunk in its tensor.
    pub chunk: usize,
    /// First byte in the tensor.
    pub begin: u64,
    /// Length.
    pub len: u64,
    /// xxh3-64.
    pub xxh3: u64,
}

impl Manifest {
    /// Parses a stored manifest.
    pub fn from_json(bytes: &[u8]) -> Result<Manifest, FormatError> {
        let m: Manifest =
            serde_json::from_slice(bytes).map_err(|e| FormatError::Manifest(e.to_string()))?;
        if m.format != MANIFEST_FORMAT {
            return Err(FormatError::Manifest(format!(
                "layout {} (this version reads {MANIFEST_FORMAT})",
                m.format
            )));
        }
        if m.chunk_size == 0 {
            return Err(FormatError::Manifest("chunk size 0".into()));
        }
        for f in &m.files {
            for t in &f.tensors {
                if t.chunks.len() as u64 != t.len.div_ceil(m.chunk_size) {
                    return Err(FormatError::Manifest(format!(
                        "{}: {} chunks for {} bytes",
                        t.name,
                        t.chunks.len(),
                        t.len
                    )));
                }
            }
        }
        Ok(m)
    }

    /// The manifest as stored.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest always serializes")
    }

    /// Bytes of all tensors.
    pub fn tensor_bytes(&self) -> u64 {
        self.files
            .iter()
            .flat_map(|f| &f.tensors)
            .map(|t| t.len)
            .sum()
    }

    /// Number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.files.iter().map(|f| f.tensors.len()).sum()
    }

    /// Every chunk of the model, file by file, tensor by tensor.
    pub fn chunks(&self) -> impl Iterator<Item = ChunkRef> + '_ {
        self.files.iter().enumerate().flat_map(move |(fi, f)| {
            f.tensors
                .iter()
                .enumerate()
                .flat_map(move |(ti, t)| self.tensor_chunks(fi, ti, t))
        })
    }

    /// The chunks of one tensor.
    pub fn tensor_chunks<'a>(
        &'a self,
        file: usize,
        tensor: usize,
        t: &'a TensorEntry,
    ) -> impl Iterator<Item = ChunkRef> + 'a {
        let cs = self.chunk_size;
        t.chunks.iter().enumerate().map(move |(ci, &x)| {
            let begin = ci as u64 * cs;
            ChunkRef {
                file,
                tensor,
                chunk: ci,
                begin,
                len: cs.min(t.len - begin),
                xxh3: x,
            }
        })
    }

    /// Finds a tensor by name: (file index, tensor index). With several tensor-parallel rank
    /// files, the one of `rank` (or of every rank).
    pub fn find(&self, name: &str, rank: Option<u32>) -> Option<(usize, usize)> {
        self.files
            .iter()
            .enumerate()
            .filter(|(_, f)| f.rank.is_none() || rank.is_none() || f.rank == rank)
            .find_map(|(fi, f)| {
                f.tensors
                    .iter()
                    .position(|t| t.name == name)
                    .map(|ti| (fi, ti))
            })
    }

    /// The files a tensor-parallel `rank` loads: those saved for it, or, when the checkpoint
    /// is not saved per rank, all.
    pub fn files_of_rank(&self, rank: u32) -> impl Iterator<Item = (usize, &FileEntry)> {
        self.files
            .iter()
            .enumerate()
            .filter(move |(_, f)| f.rank.is_none_or(|r| r == rank))
    }
}

/// Checks a model name: 1..=[`MAX_NAME`] bytes, printable, no `/` at either end.
pub fn check_name(name: &str) -> Result<(), FormatError> {
    let bad = |m: &str| FormatError::Name(format!("{name:?}: {m}"));
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(bad(&format!("1 to {MAX_NAME} bytes")));
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(bad("no spaces or control characters"));
    }
    if name.starts_with('/') || name.ends_with('/') {
        return Err(bad("no leading or trailing '/'"));
    }
    Ok(())
}

/// Key of a model's manifest.
pub fn manifest_key(name: &str) -> Vec<u8> {
    format!("{MANIFEST_PREFIX}{name}").into_bytes()
}

/// Prefix of every manifest key (what `weights ls` lists).
pub const MANIFEST_PREFIX: &str = "manifest/";

fn name_hash(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// Key of a chunk.
pub fn chunk_key(name: &str, c: &ChunkRef) -> Vec<u8> {
    format!(
        "w/{:016x}/{}.{}.{}/{:016x}",
        name_hash(name),
        c.file,
        c.tensor,
        c.chunk,
        c.xxh3
    )
    .into_bytes()
}

/// Key of a companion file.
pub fn extra_key(name: &str, index: usize, e: &ExtraFile) -> Vec<u8> {
    format!("w/{:016x}/x{index}/{:016x}", name_hash(name), e.xxh3).into_bytes()
}

/// The rank in a per-rank checkpoint's file name (`model-rank-3-part-0.safetensors`).
pub fn rank_of_file(file_name: &str) -> Option<u32> {
    let rest = &file_name[file_name.find("-rank-")? + 6..];
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// The files a sharded checkpoint's index (`model.safetensors.index.json`) names, in order of
/// first appearance.
pub fn index_files(index_json: &[u8]) -> Result<Vec<String>, FormatError> {
    #[derive(Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let idx: Index = serde_json::from_slice(index_json)
        .map_err(|e| FormatError::Safetensors(format!("shard index: {e}")))?;
    let mut files: Vec<String> = idx.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    for f in &files {
        if f.contains('/') || f.contains('\\') || f == ".." {
            return Err(FormatError::Safetensors(format!(
                "shard index names {f:?}, outside its directory"
            )));
        }
    }
    Ok(files)
}

/// Slice `rank` of `world` along dimension `dim` of a row-major tensor: its byte ranges in the
/// tensor and its shape. The dimension must divide evenly.
pub fn shard_ranges(
    t: &TensorEntry,
    dim: usize,
    rank: u64,
    world: u64,
) -> Result<Slice, FormatError> {
    let err = |why: String| FormatError::Shard {
        tensor: t.name.clone(),
        why,
    };
    let bits = dtype_bits(&t.dtype).ok_or_else(|| err(format!("unknown dtype {}", t.dtype)))?;
    let &size = t
        .shape
        .get(dim)
        .ok_or_else(|| err(format!("no dimension {dim} in shape {:?}", t.shape)))?;
    if world == 0 || rank >= world || size % world != 0 {
        return Err(err(format!(
            "dimension {dim} of {size} into {world} parts (rank {rank})"
        )));
    }
    let part = size / world;
    // Elements in one step along `dim` (the product of the later dimensions).
    let inner: u64 = t.shape[dim + 1..].iter().product();
    let outer: u64 = t.shape[..dim].iter().product();
    let row_bits = part * inner * bits;
    if row_bits % 8 != 0 || (size * inner * bits) % 8 != 0 {
        return Err(err("slice does not fall on byte boundaries".into()));
    }
    let (run, stride) = (row_bits / 8, size * inner * bits / 8);
    let mut ranges = Vec::with_capacity(outer as usize);
    for o in 0..outer {
        let begin = o * stride + rank * run;
        match ranges.last_mut() {
            Some((b, l)) if *b + *l == begin => *l += run,
            _ => ranges.push((begin, run)),
        }
    }
    let mut shape = t.shape.clone();
    shape[dim] = part;
    Ok(Slice { ranges, shape })
}

/// A tensor-parallel slice of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    /// (first byte in the tensor, length), in order, adjacent ones merged.
    pub ranges: Vec<(u64, u64)>,
    /// The slice's shape.
    pub shape: Vec<u64>,
}

#[cfg(test)]
mod tests;
