//! The generated checkpoint: one safetensors file shaped like a Llama-style decoder in bf16,
//! sized to what was asked.
//!
//! The mix, per layer: `q_proj` and `o_proj` h×h, `k_proj` and `v_proj` (h/4)×h (grouped-query
//! attention, 4 query heads per KV head), `gate_proj` and `up_proj` i×h and `down_proj` h×i with
//! i = 2.75 h rounded to 128 (TinyLlama's 5632 for h = 2048), and two RMS norms of h; plus
//! `model.embed_tokens` and an untied `lm_head` of V×h and the final norm. The hidden size is
//! the largest of 8192, 4096, ..., 128 that leaves room for 16 layers with a vocabulary of at
//! least 32 000; the layer count then fills the size, and the vocabulary (a multiple of 64)
//! takes up what remains, so the file is within a few KiB of the size. The default 2 GiB is
//! h = 2048, 20 layers, V = 41 920: 183 tensors from 4 KiB norms to 172 MB embeddings.
//! Tensors are named as Hugging Face names them and stored in name order, as the safetensors
//! writer stores them. The bytes are pseudo-random (xorshift), so no two chunks are equal.

use std::io::Write;
use std::path::Path;

use anyhow::{ensure, Context};

/// Least vocabulary.
const MIN_VOCAB: u64 = 32_000;

/// Least layers before a smaller hidden size is taken.
const MIN_LAYERS: u64 = 16;

/// Bytes per element (bf16).
const BF16: u64 = 2;

/// The shapes of the generated model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModelShape {
    /// Hidden size.
    pub(crate) hidden: u64,
    /// MLP width.
    pub(crate) intermediate: u64,
    /// Decoder layers.
    pub(crate) layers: u64,
    /// Vocabulary.
    pub(crate) vocab: u64,
}

/// One tensor of the file: name, shape, bytes.
#[derive(Clone, Debug)]
pub(crate) struct Tensor {
    /// Hugging Face name.
    pub(crate) name: String,
    /// Shape.
    pub(crate) shape: Vec<u64>,
    /// Bytes (bf16).
    pub(crate) len: u64,
}

impl ModelShape {
    /// The shape whose file is closest to `size` bytes without exceeding it.
    pub(crate) fn for_size(size: u64) -> anyhow::Result<ModelShape> {
        for hidden in [8192, 4096, 2048, 1024, 512, 256, 128u64] {
            let intermediate = (hidden * 11 / 4).next_multiple_of(128);
            let mut s = ModelShape {
                hidden,
                intermediate,
                layers: 0,
                vocab: MIN_VOCAB,
            };
            let fixed = s.bytes();
            let Some(room) = size.checked_sub(fixed) else {
                continue;
            };
            s.layers = room / s.layer_bytes();
            if s.layers < MIN_LAYERS && hidden > 128 {
                continue;
            }
            ensure!(s.layers > 0, "--size {size} is too small for a model");
            let rest = size - s.bytes() + 2 * MIN_VOCAB * hidden * BF16;
            s.vocab = (rest / (2 * hidden * BF16)) / 64 * 64;
            return Ok(s);
        }
        anyhow::bail!(
            "--size {size} is too small: the smallest model (hidden 128, vocabulary {MIN_VOCAB}) needs {} bytes",
            ModelShape {
                hidden: 128,
                intermediate: 384,
                layers: 1,
                vocab: MIN_VOCAB
            }
            .bytes()
        )
    }

    fn layer_bytes(&self) -> u64 {
        let (h, i) = (self.hidden, self.intermediate);
        BF16 * (2 * h + 2 * h * h + 2 * (h / 4) * h + 3 * i * h)
    }

    /// Bytes of all tensors.
    pub(crate) fn bytes(&self) -> u64 {
        BF16 * (2 * self.vocab * self.hidden + self.hidden) + self.layers * self.layer_bytes()
    }

    /// Every tensor, in name order (the order of their bytes in the file).
    pub(crate) fn tensors(&self) -> Vec<Tensor> {
        let (h, i, kv) = (self.hidden, self.intermediate, self.hidden / 4);
        let t = |name: String, shape: Vec<u64>| Tensor {
            len: shape.iter().product::<u64>() * BF16,
            name,
            shape,
        };
        let mut out = vec![
            t("lm_head.weight".into(), vec![self.vocab, h]),
            t("model.embed_tokens.weight".into(), vec![self.vocab, h]),
            t("model.norm.weight".into(), vec![h]),
        ];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}.");
            out.extend([
                t(format!("{p}input_layernorm.weight"), vec![h]),
                t(format!("{p}mlp.down_proj.weight"), vec![h, i]),
                t(format!("{p}mlp.gate_proj.weight"), vec![i, h]),
                t(format!("{p}mlp.up_proj.weight"), vec![i, h]),
                t(format!("{p}post_attention_layernorm.weight"), vec![h]),
                t(format!("{p}self_attn.k_proj.weight"), vec![kv, h]),
                t(format!("{p}self_attn.o_proj.weight"), vec![h, h]),
                t(format!("{p}self_attn.q_proj.weight"), vec![h, h]),
                t(format!("{p}self_attn.v_proj.weight"), vec![kv, h]),
            ]);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// One line for people.
    pub(crate) fn describe(&self) -> String {
        format!(
            "Llama-style bf16: hidden {}, MLP {}, {} layers, vocabulary {}, {} tensors, {:.2} GiB",
            self.hidden,
            self.intermediate,
            self.layers,
            self.vocab,
            self.tensors().len(),
            self.bytes() as f64 / (1u64 << 30) as f64
        )
    }
}

/// Writes the model as a safetensors file at `path`; returns its tensors in file order.
pub(crate) fn write(shape: &ModelShape, path: &Path) -> anyhow::Result<Vec<Tensor>> {
    let tensors = shape.tensors();
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({"format": "pt", "generator": "kvpool-bench weights"}),
    );
    let mut at = 0;
    for t in &tensors {
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": t.shape, "data_offsets": [at, at + t.len]}),
        );
        at += t.len;
    }
    let mut text = serde_json::to_string(&header)?;
    // The data section starts 8-byte aligned, as the safetensors writer pads it.
    while (8 + text.len()) % 8 != 0 {
        text.push(' ');
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(text.len() as u64).to_le_bytes())?;
    out.write_all(text.as_bytes())?;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut buf = vec![0u8; 16 << 20];
    let mut left = at;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        for word in buf[..n].chunks_mut(8) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            word.copy_from_slice(&rng.to_le_bytes()[..word.len()]);
        }
        out.write_all(&buf[..n])?;
        left -= n as u64;
    }
    out.flush()?;
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_fill_what_was_asked_with_realistic_shapes() {
        for (size, hidden) in [(2u64 << 30, 2048), (64 << 20, 256), (512 << 20, 1024)] {
            let s = ModelShape::for_size(size).unwrap();
            assert_eq!(s.hidden, hidden, "{size}: {s:?}");
            assert!(s.layers >= MIN_LAYERS && s.vocab >= MIN_VOCAB, "{s:?}");
            assert!(s.bytes() <= size && size - s.bytes() < 256 * s.hidden * BF16);
            let sum: u64 = s.tensors().iter().map(|t| t.len).sum();
            assert_eq!(sum, s.bytes());
        }
        let s = ModelShape::for_size(2 << 30).unwrap();
        assert_eq!((s.intermediate, s.layers, s.vocab), (5632, 20, 41_920));
        assert!(ModelShape::for_size(1 << 20).is_err());
    }

    #[test]
    fn the_file_parses_as_safetensors() {
        let dir = std::env::temp_dir().join(format!("kvpool-bench-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        let s = ModelShape::for_size(64 << 20).unwrap();
        let tensors = write(&s, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let n = kvpool::weights::header_len(bytes[..8].try_into().unwrap()).unwrap();
        let h =
            kvpool::weights::parse_header(&bytes[8..8 + n as usize], bytes.len() as u64).unwrap();
        assert_eq!(h.data_start % 8, 0);
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        let want: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, want);
        assert_eq!(h.data_len, s.bytes());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
