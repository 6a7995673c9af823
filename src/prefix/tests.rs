use super::*;

/// The seeds and token lists of the published vectors (docs/HASHING.md).
pub(crate) fn vectors() -> Vec<(&'static str, PrefixSeed, Vec<u32>)> {
    let base = PrefixSeed {
        tenant: String::new(),
        model: "meta-llama/Llama-3.1-8B-Instruct".into(),
        dtype: "bf16".into(),
        tp_rank: 0,
        tp_size: 1,
        pp_stage: 0,
        layer_start: 0,
        layer_end: 32,
        block_tokens: 16,
        salt: None,
    };
    let tokens = |n: u32| {
        (0..n)
            .map(|i| (i * 7919 + 13) % 128_256)
            .collect::<Vec<u32>>()
    };
    vec![
        ("one block, no salt", base.clone(), tokens(16)),
        (
            "empty salt differs from no salt",
            PrefixSeed {
                salt: Some(String::new()),
                ..base.clone()
            },
            tokens(16),
        ),
        (
            "salt",
            PrefixSeed {
                salt: Some("user-42".into()),
                ..base.clone()
            },
            tokens(16),
        ),
        (
            "tenant",
            PrefixSeed {
                tenant: "acme".into(),
                ..base.clone()
            },
            tokens(16),
        ),
        ("partial last block dropped", base.clone(), tokens(40)),
        (
            "32-token blocks",
            PrefixSeed {
                block_tokens: 32,
                ..base.clone()
            },
            tokens(96),
        ),
        (
            "64-token blocks",
            PrefixSeed {
                block_tokens: 64,
                ..base.clone()
            },
            tokens(128),
        ),
        (
            "256-token blocks",
            PrefixSeed {
                block_tokens: 256,
                ..base.clone()
            },
            tokens(256),
        ),
        (
            "tensor-parallel rank 1 of 2",
            PrefixSeed {
                tp_rank: 1,
                tp_size: 2,
                ..base.clone()
            },
            tokens(32),
        ),
        (
            "pipeline stage 1, layers 16-32",
            PrefixSeed {
                pp_stage: 1,
                layer_start: 16,
                ..base.clone()
            },
            tokens(16),
        ),
        (
            "fp8 KV",
            PrefixSeed {
                dtype: "fp8_e4m3".into(),
                ..base.clone()
            },
            tokens(16),
        ),
        ("no full block", base.clone(), tokens(15)),
        ("100-block chain", base.clone(), tokens(1600)),
    ]
}

fn hex(k: &BlockKey) -> String {
    k.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every vector as a JSON object for the Python reference.
fn vectors_json() -> String {
    let items: Vec<String> = vectors()
        .into_iter()
        .map(|(_, s, t)| {
            let keys: Vec<String> = s.block_keys(&t).iter().map(|k| format!("\"{}\"", hex(k))).collect();
            let salt = s.salt.as_ref().map_or("null".to_string(), |v| format!("{v:?}"));
            format!(
                r#"{{"seed": {{"tenant": {:?}, "model": {:?}, "dtype": {:?}, "tp_rank": {}, "tp_size": {}, "pp_stage": {}, "layer_start": {}, "layer_end": {}, "block_tokens": {}, "salt": {}}}, "tokens": {:?}, "keys": [{}]}}"#,
                s.tenant, s.model, s.dtype, s.tp_rank, s.tp_size, s.pp_stage, s.layer_start, s.layer_end, s.block_tokens, salt, t, keys.join(", ")
            )
        })
        .collect();
    format!("[{}]", items.join(",\n"))
}

#[test]
fn the_documented_vectors_are_what_the_code_computes() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/HASHING.md")).unwrap();
    for (name, seed, tokens) in vectors() {
        let keys = seed.block_keys(&tokens);
        assert_eq!(
            keys.len(),
            tokens.len() / seed.block_tokens as usize,
            "{name}"
        );
        // The doc lists each vector's first and last key.
        for k in [keys.first(), keys.last()].into_iter().flatten() {
            assert!(
                doc.contains(&hex(k)),
                "docs/HASHING.md lacks key {} of vector {name:?}",
                hex(k)
            );
        }
    }
}

#[test]
fn anything_in_the_seed_or_any_earlier_token_changes_the_key() {
    let v = vectors();
    let mut firsts: Vec<BlockKey> = v
        .iter()
        .filter(|(_, s, t)| t.len() >= 16 && s.block_tokens == 16)
        .map(|(_, s, t)| s.block_keys(t)[0])
        .collect();
    let n = firsts.len();
    firsts.sort();
    firsts.dedup();
    // Vectors 0, 4, 11 (base seed, same first block) and 12 share the first key; all other
    // seeds differ.
    assert_eq!(firsts.len(), n - 2);
    let (_, base, tokens) = &v[12];
    let keys = base.block_keys(tokens);
    let mut changed = tokens.clone();
    changed[5] ^= 1; // in block 0: every key changes
    assert!(base
        .block_keys(&changed)
        .iter()
        .zip(&keys)
        .all(|(a, b)| a != b));
    let mut changed = tokens.clone();
    changed[16 * 50] ^= 1; // in block 50: keys before it stay
    let other = base.block_keys(&changed);
    assert_eq!(other[..50], keys[..50]);
    assert!(other[50..].iter().zip(&keys[50..]).all(|(a, b)| a != b));
}

#[test]
fn the_python_reference_reproduces_every_vector() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/hashing_reference.py");
    let probe = std::process::Command::new("python3")
        .args(["-c", "import xxhash"])
        .output();
    let missing = match probe {
        Ok(o) if o.status.success() => None,
        Ok(_) => Some("python3's xxhash package is not installed (pip install xxhash)"),
        Err(_) => Some("python3 is not installed"),
    };
    if let Some(why) = missing {
        // As tests/common/deps.rs: a failure in CI, which installs both; elsewhere a skip that
        // is written past the runner's output capture so that it shows.
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
        assert!(!ci, "the Python cross-check can't run: {why}");
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "test the_python_reference_reproduces_every_vector ... SKIPPED: {why}"
        );
        return;
    }
    let file =
        std::env::temp_dir().join(format!("kvpool-hash-vectors-{}.json", std::process::id()));
    std::fs::write(&file, vectors_json()).unwrap();
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg("--check")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python reference disagrees:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("13 vectors, 0 differ"), "{text}");
}
