//! The weights view: SGLang's remote model loader (`--load-format remote` with a
//! `redis://host:port/<model>` URL) reads a model published by `kvpool weights put` through
//! this door, unchanged.
//!
//! The loader lists `SCAN 0 MATCH <model>/keys/rank_<r>/*` and reads each
//! `GET <model>/keys/rank_<r>/<tensor>` as a safetensors serialization of
//! `{"tensor_bytes": tensor}`; it lists `<model>/files/*` and reads each `<model>/files/<name>`
//! as text. None of those keys exists: a GET of one, for a model whose manifest is in the
//! `weights` namespace, is answered by assembling the tensor from its chunks (each verified
//! against the manifest's xxh3; a chunk missing or failing makes the GET a miss, never wrong
//! bytes) behind a safetensors header made here. A SCAN whose pattern names such a directory
//! answers the view's keys. Everything else about the door is unchanged: SET, DEL and the other
//! commands act on the ordinary keys of the connection's namespace, and a GET of a name the
//! view does not answer reads the ordinary key.
//!
//! Who may read: the view is the `weights` namespace read through another name, so a
//! connection sees it only when its token admits to `weights` (as a native client's would); to
//! any other connection these names are ordinary keys.
//!
//! Memory: a tensor is assembled whole before its reply is written (a chunk failing after part
//! of a reply was sent could not be turned into a miss any more), so the door holds at most
//! `[resp] weights_memory` bytes of tensors at once, across its connections; a tensor larger
//! than that is refused with an error. Sizes come from the manifest, which only a client
//! admitted to `weights` can store; a peer chooses only the name.

use std::io;
use std::sync::Arc;

use kvpool::resp::encode;
use kvpool::weights::{self as w, ChunkRef, Manifest, TensorEntry};
use tokio::io::AsyncWrite;

use super::conn::{Conn, Place};

/// A name the view may answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ViewKey<'k> {
    /// `<model>/keys/rank_<rank>/<tensor>`.
    Tensor {
        model: &'k str,
        rank: u32,
        tensor: &'k str,
    },
    /// `<model>/files/<name>`.
    File { model: &'k str, name: &'k str },
}

/// A directory of the view a SCAN pattern names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ViewDir {
    /// `<model>/keys/rank_<r>/`.
    Rank(u32),
    /// `<model>/files/`.
    Files,
}

const KEYS: &str = "/keys/rank_";
const FILES: &str = "/files/";

/// The tensor of a safetensors file that SGLang's serializer writes.
const TENSOR_NAME: &str = "tensor_bytes";

/// Reads `key` as a name of the view. The model is everything before the first `/keys/rank_`
/// (or, for a name without it, the first `/files/`), so a model whose own name contains one of
/// those can't be read through the view.
pub(crate) fn parse_key(key: &[u8]) -> Option<ViewKey<'_>> {
    let key = std::str::from_utf8(key).ok()?;
    if let Some(at) = key.find(KEYS) {
        let rest = &key[at + KEYS.len()..];
        let slash = rest.find('/')?;
        let rank = parse_rank(&rest[..slash])?;
        let tensor = &rest[slash + 1..];
        let model = &key[..at];
        return (!model.is_empty() && !tensor.is_empty()).then_some(ViewKey::Tensor {
            model,
            rank,
            tensor,
        });
    }
    let at = key.find(FILES)?;
    let (model, name) = (&key[..at], &key[at + FILES.len()..]);
    (!model.is_empty() && !name.is_empty()).then_some(ViewKey::File { model, name })
}

/// Reads a SCAN pattern as one naming a directory of the view: its part up to and including
/// `/keys/rank_<r>/` or `/files/` must be literal (no glob character), so the model is known.
/// The rest of the pattern filters the directory's names as usual.
pub(crate) fn parse_pattern(pat: &[u8]) -> Option<(&str, ViewDir)> {
    let pat = std::str::from_utf8(pat).ok()?;
    let literal = |s: &str| !s.contains(['*', '?', '[', '\\']);
    if let Some(at) = pat.find(KEYS) {
        let rest = &pat[at + KEYS.len()..];
        let slash = rest.find('/')?;
        let rank = parse_rank(&rest[..slash])?;
        let model = &pat[..at];
        return (!model.is_empty() && literal(model)).then_some((model, ViewDir::Rank(rank)));
    }
    let at = pat.find(FILES)?;
    let model = &pat[..at];
    (!model.is_empty() && literal(model)).then_some((model, ViewDir::Files))
}

fn parse_rank(digits: &str) -> Option<u32> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The view's names in `dir` of model `model` described by `m`, in the manifest's order.
pub(crate) fn names(model: &str, m: &Manifest, dir: ViewDir) -> Vec<Vec<u8>> {
    match dir {
        ViewDir::Rank(r) => m
            .files_of_rank(r)
            .flat_map(|(_, f)| &f.tensors)
            .map(|t| format!("{model}{KEYS}{r}/{}", t.name).into_bytes())
            .collect(),
        ViewDir::Files => m
            .extra
            .iter()
            .map(|e| format!("{model}{FILES}{}", e.name).into_bytes())
            .collect(),
    }
}

/// Why a tensor can't be wrapped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum WrapError {
    /// The manifest's dtype, shape and length disagree (or the dtype is unknown).
    #[error("tensor {name:?}: {why}")]
    Inconsistent { name: String, why: String },
}

/// The bytes before a tensor's data in the safetensors serialization of
/// `{"tensor_bytes": t}`: the header's length (8 bytes, little endian) and the header's JSON,
/// padded with spaces to a multiple of 8 bytes as the format asks. The data follows at once.
pub(crate) fn safetensors_prefix(t: &TensorEntry) -> Result<Vec<u8>, WrapError> {
    let bad = |why: String| WrapError::Inconsistent {
        name: t.name.clone(),
        why,
    };
    let bits = w::dtype_bits(&t.dtype).ok_or_else(|| bad(format!("unknown dtype {}", t.dtype)))?;
    let want = t
        .shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(bits))
        .map(|b| b.div_ceil(8));
    if want != Some(t.len) {
        return Err(bad(format!(
            "{} bytes for a {} tensor of shape {:?}",
            t.len, t.dtype, t.shape
        )));
    }
    // Written as the safetensors package writes it (keys in this order, no spaces), so the
    // bytes equal `safetensors.torch.save({"tensor_bytes": t})`.
    let dtype = serde_json::to_string(&t.dtype).expect("a string always serializes");
    let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
    let mut json = format!(
        r#"{{"{TENSOR_NAME}":{{"dtype":{dtype},"shape":[{}],"data_offsets":[0,{}]}}}}"#,
        shape.join(","),
        t.len
    )
    .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Chunks read in one batch from their owners.
const BATCH: usize = 64;

impl<W: AsyncWrite + Unpin + Send> Conn<'_, W> {
    /// Answers a GET of `key` from the view when it names a published model's tensor or file
    /// and the connection may read `weights`. Ok(false): not the view's, the caller reads the
    /// ordinary key.
    pub(super) async fn weights_get(&mut self, key: &[u8]) -> io::Result<bool> {
        let Some(vk) = parse_key(key) else {
            return Ok(false);
        };
        let Some(wns) = self.weights_ns() else {
            return Ok(false);
        };
        let model = match vk {
            ViewKey::Tensor { model, .. } | ViewKey::File { model, .. } => model,
        };
        let Some(m) = self.manifest(wns, model).await else {
            return Ok(false);
        };
        // The bytes a reply holds are reserved until it is written.
        let (found, _room) = match vk {
            ViewKey::Tensor { rank, tensor, .. } => {
                let Some((fi, ti)) = m.find(tensor, Some(rank)) else {
                    return Ok(false);
                };
                let t = &m.files[fi].tensors[ti];
                let prefix = match safetensors_prefix(t) {
                    Ok(p) => p,
                    Err(e) => {
                        encode::error(&mut self.out, &format!("ERR kvpool: {e}"));
                        return Ok(true);
                    }
                };
                let door = self.door;
                let room = match door
                    .weights_memory
                    .reserve(
                        (prefix.len() as u64).saturating_add(t.len),
                        door.forward.timeout(),
                    )
                    .await
                {
                    Ok(p) => p,
                    Err(msg) => {
                        encode::error(&mut self.out, &msg);
                        return Ok(true);
                    }
                };
                (self.assemble(wns, model, &m, fi, ti, prefix).await, room)
            }
            ViewKey::File { name, .. } => {
                let Some(i) = m.extra.iter().position(|e| e.name == name) else {
                    return Ok(false);
                };
                let door = self.door;
                let room = match door
                    .weights_memory
                    .reserve(m.extra[i].len, door.forward.timeout())
                    .await
                {
                    Ok(p) => p,
                    Err(msg) => {
                        encode::error(&mut self.out, &msg);
                        return Ok(true);
                    }
                };
                (self.extra_file(wns, model, &m, i).await, room)
            }
        };
        match found {
            Ok(Some(v)) => self.write_value(&v).await?,
            Ok(None) => encode::null(&mut self.out, self.proto),
            Err(msg) => encode::error(&mut self.out, &msg),
        }
        Ok(true)
    }

    /// The view's names for a SCAN pattern that names a directory of a published model the
    /// connection may read; None: an ordinary SCAN.
    pub(super) async fn weights_scan(&mut self, pattern: &[u8]) -> Option<Vec<Vec<u8>>> {
        let (model, dir) = parse_pattern(pattern)?;
        let wns = self.weights_ns()?;
        let m = self.manifest(wns, model).await?;
        let mut keys = names(model, &m, dir);
        keys.retain(|k| super::glob::matches(pattern, k));
        Some(keys)
    }

    /// The manifest of `model`, None when there is none (or it can't be read: logged).
    async fn manifest(&mut self, wns: u32, model: &str) -> Option<Arc<Manifest>> {
        if w::check_name(model).is_err() {
            return None;
        }
        let key = w::manifest_key(model);
        let hash_of = |b: &[u8]| kvpool::checksum(b);
        let (hash, parsed) = match self.read_whole(wns, &key).await {
            Ok(Some(bytes)) => {
                let h = hash_of(&bytes);
                let cached = self
                    .manifests
                    .as_ref()
                    .filter(|(n, ch, _)| n == model && *ch == h);
                if let Some((_, _, m)) = cached {
                    return Some(m.clone());
                }
                (h, Manifest::from_json(&bytes))
            }
            Ok(None) => return None,
            Err(msg) => {
                tracing::warn!(model, error = %msg, "weights view: can't read the manifest");
                return None;
            }
        };
        match parsed {
            Ok(m) if m.name == model => {
                let m = Arc::new(m);
                self.manifests = Some((model.to_string(), hash, m.clone()));
                Some(m)
            }
            Ok(m) => {
                tracing::warn!(model, named = %m.name, "weights view: the manifest names another model");
                None
            }
            Err(e) => {
                tracing::warn!(model, error = %e, "weights view: bad manifest");
                None
            }
        }
    }

    /// The value of `key` in namespace `wns` (here or from its owners). Err: a reply line.
    async fn read_whole(&mut self, wns: u32, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        match self.check_key_in(wns, key) {
            Err(r) => Err(r.text()),
            Ok(Place::Remote) => self.forward_in(w::DEFAULT_NAMESPACE)?.get(key).await,
            Ok(Place::Local) => {
                let s = self.s;
                match s.get(wns, key, s.now(), self.routing) {
                    Ok(obj) => Ok(Some(obj.bytes().to_vec())),
                    Err(kvpool::PoolError::NotFound) => Ok(None),
                    Err(e) => Err(self.pool_error_text(e)),
                }
            }
        }
    }

    /// A companion file, checked against the manifest's length and xxh3; None when missing or
    /// failing (logged). The caller has reserved its bytes.
    async fn extra_file(
        &mut self,
        wns: u32,
        model: &str,
        m: &Manifest,
        i: usize,
    ) -> Result<Option<Vec<u8>>, String> {
        let e = &m.extra[i];
        // Within weights_memory, which a usize holds (a u32 count of KiB).
        let mut out = vec![0u8; e.len as usize];
        let key = w::extra_key(model, i, e);
        let what = format!("{model}: file {}", e.name);
        if !self.fill(wns, &what, vec![(key, &mut out[..])]).await? {
            return Ok(None);
        }
        if kvpool::checksum(&out) != e.xxh3 {
            tracing::warn!(what, "weights view: a companion file fails its checksum");
            return Ok(None);
        }
        Ok(Some(out))
    }

    /// Tensor `ti` of file `fi`, wrapped as SGLang's safetensors value (behind `prefix`), from
    /// its chunks; None when a chunk is missing or fails its checksum (logged), Err(reply line)
    /// when the chunks can't be asked for at all. The caller has reserved its bytes.
    async fn assemble(
        &mut self,
        wns: u32,
        model: &str,
        m: &Manifest,
        fi: usize,
        ti: usize,
        prefix: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, String> {
        let t = &m.files[fi].tensors[ti];
        let total = prefix.len() as u64 + t.len;
        // Within weights_memory, which a usize holds (a u32 count of KiB).
        let mut out = vec![0u8; total as usize];
        let (head, body) = out.split_at_mut(prefix.len());
        head.copy_from_slice(&prefix);
        let chunks: Vec<ChunkRef> = m.tensor_chunks(fi, ti, t).collect();
        let cs = m.chunk_size as usize;
        let pieces = chunks
            .iter()
            .map(|c| w::chunk_key(model, c))
            .zip(body.chunks_mut(cs))
            .collect();
        let what = format!("{model}: tensor {}", t.name);
        if !self.fill(wns, &what, pieces).await? {
            return Ok(None);
        }
        // Verified after the copy, so what is checked is what is sent.
        for (c, bytes) in chunks.iter().zip(out[prefix.len()..].chunks(cs)) {
            if kvpool::checksum(bytes) != c.xxh3 {
                tracing::warn!(
                    what,
                    chunk = c.chunk,
                    "weights view: a chunk fails its checksum"
                );
                return Ok(None);
            }
        }
        Ok(Some(out))
    }

    /// Fills each destination with the value of its key in namespace `wns`: from this pool
    /// when this node owns the key, otherwise from its owners over the door's links to them, in
    /// batches. Ok(false) when a value is missing or not exactly its destination's length
    /// (logged, about `what`); Err(reply line) when the keys can't be asked for at all.
    async fn fill(
        &mut self,
        wns: u32,
        what: &str,
        pieces: Vec<(Vec<u8>, &mut [u8])>,
    ) -> Result<bool, String> {
        let (mut remote_keys, mut remote_dsts): (Vec<Vec<u8>>, Vec<&mut [u8]>) = Default::default();
        let s = self.s;
        for (key, dst) in pieces {
            match self.check_key_in(wns, &key).map_err(|r| r.text())? {
                Place::Remote => {
                    remote_keys.push(key);
                    remote_dsts.push(dst);
                }
                Place::Local => match s.get(wns, &key, s.now(), self.routing) {
                    Ok(obj) if obj.bytes().len() == dst.len() => dst.copy_from_slice(obj.bytes()),
                    Ok(obj) => {
                        let len = obj.bytes().len();
                        tracing::warn!(
                            what,
                            len,
                            want = dst.len(),
                            "weights view: a piece has the wrong length"
                        );
                        return Ok(false);
                    }
                    Err(e) => {
                        tracing::warn!(what, error = %e, "weights view: a piece is missing");
                        return Ok(false);
                    }
                },
            }
        }
        if remote_keys.is_empty() {
            return Ok(true);
        }
        let owners = self.forward_in(w::DEFAULT_NAMESPACE)?;
        for (keys, dsts) in remote_keys.chunks(BATCH).zip(remote_dsts.chunks_mut(BATCH)) {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            match owners.get_many(&keys).await {
                Ok(got)
                    if got
                        .iter()
                        .zip(dsts.iter())
                        .all(|(g, d)| g.as_ref().is_some_and(|v| v.len() == d.len())) =>
                {
                    for (v, d) in got.iter().flatten().zip(dsts.iter_mut()) {
                        d.copy_from_slice(v);
                    }
                }
                Ok(_) => {
                    tracing::warn!(what, "weights view: a piece is missing on its owners");
                    return Ok(false);
                }
                Err(e) => {
                    tracing::warn!(what, error = %e, "weights view: can't read a piece from its owners");
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
