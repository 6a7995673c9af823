use kvpool::weights::{ExtraFile, FileEntry, Manifest, TensorEntry, MANIFEST_FORMAT};

use super::*;
use crate::resp::shared::Budget;

fn tensor(name: &str, dtype: &str, shape: &[u64], len: u64) -> TensorEntry {
    TensorEntry {
        name: name.into(),
        dtype: dtype.into(),
        shape: shape.to_vec(),
        offset: 0,
        len,
        chunks: vec![0; len.div_ceil(4) as usize],
    }
}

#[test]
fn tensor_keys_parse_with_models_that_contain_slashes() {
    assert_eq!(
        parse_key(b"org/model/keys/rank_3/layers.0.attn.weight"),
        Some(ViewKey::Tensor {
            model: "org/model",
            rank: 3,
            tensor: "layers.0.attn.weight"
        })
    );
    // A tensor name may itself contain '/'.
    assert_eq!(
        parse_key(b"m/keys/rank_0/a/b"),
        Some(ViewKey::Tensor {
            model: "m",
            rank: 0,
            tensor: "a/b"
        })
    );
    assert_eq!(
        parse_key(b"org/m/files/config.json"),
        Some(ViewKey::File {
            model: "org/m",
            name: "config.json"
        })
    );
}

#[test]
fn other_keys_are_not_the_views() {
    for k in [
        &b"plain"[..],
        b"/keys/rank_0/x",            // no model
        b"m/keys/rank_0/",            // no tensor
        b"m/keys/rank_/x",            // no rank
        b"m/keys/rank_x/t",           // not a number
        b"m/keys/rank_-1/t",          // not a number
        b"m/keys/rank_99999999999/t", // past u32
        b"m/keys/rank_0",             // no slash after the rank
        b"m/files/",                  // no file
        b"/files/x",                  // no model
        b"m/\xff/files/x",            // not UTF-8
    ] {
        assert_eq!(parse_key(k), None, "{}", String::from_utf8_lossy(k));
    }
}

#[test]
fn scan_patterns_name_a_directory_only_with_a_literal_model() {
    assert_eq!(
        parse_pattern(b"org/m/keys/rank_1/*"),
        Some(("org/m", ViewDir::Rank(1)))
    );
    assert_eq!(
        parse_pattern(b"m/keys/rank_0/layers.*"),
        Some(("m", ViewDir::Rank(0)))
    );
    assert_eq!(parse_pattern(b"m/files/*"), Some(("m", ViewDir::Files)));
    for p in [
        &b"*"[..],
        b"m*/keys/rank_0/*",
        b"m?/files/*",
        b"[m]/files/*",
        b"m/keys/rank_*/x",
        b"m/keys/rank_0*",
        b"m/other/*",
    ] {
        assert_eq!(parse_pattern(p), None, "{}", String::from_utf8_lossy(p));
    }
}

#[test]
fn a_rank_lists_its_files_tensors_and_files_list_the_extras() {
    let file = |name: &str, rank: Option<u32>, tensors: Vec<TensorEntry>| FileEntry {
        name: name.into(),
        rank,
        header: String::new(),
        data_len: 0,
        tensors,
    };
    let m = Manifest {
        format: MANIFEST_FORMAT,
        name: "m".into(),
        chunk_size: 4,
        replicas: 1,
        files: vec![
            file(
                "model-rank-0-part-0.safetensors",
                Some(0),
                vec![tensor("a", "F32", &[1], 4)],
            ),
            file(
                "model-rank-1-part-0.safetensors",
                Some(1),
                vec![tensor("a", "F32", &[1], 4)],
            ),
            file("shared.safetensors", None, vec![tensor("b", "U8", &[2], 2)]),
        ],
        extra: vec![ExtraFile {
            name: "config.json".into(),
            len: 2,
            xxh3: 0,
        }],
    };
    let s = |v: Vec<Vec<u8>>| {
        v.into_iter()
            .map(|k| String::from_utf8(k).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        s(names("m", &m, ViewDir::Rank(1))),
        ["m/keys/rank_1/a", "m/keys/rank_1/b"]
    );
    assert_eq!(s(names("m", &m, ViewDir::Rank(7))), ["m/keys/rank_7/b"]);
    assert_eq!(s(names("m", &m, ViewDir::Files)), ["m/files/config.json"]);
}

/// The bytes of `safetensors.torch.save({"tensor_bytes": t})` (safetensors 0.8), taken from
/// the package.
#[test]
fn the_prefix_is_the_safetensors_packages_own() {
    let p = safetensors_prefix(&tensor("w", "BF16", &[2, 3], 12)).unwrap();
    let json = br#"{"tensor_bytes":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}   "#;
    assert_eq!(&p[..8], &(json.len() as u64).to_le_bytes());
    assert_eq!(&p[8..], json);
    // A scalar, whose header needs no padding.
    let p = safetensors_prefix(&tensor("s", "F32", &[], 4)).unwrap();
    assert_eq!(
        &p[8..],
        br#"{"tensor_bytes":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}"#
    );
    assert_eq!(p.len() % 8, 0);
}

#[test]
fn every_prefix_is_a_valid_header_of_its_tensor() {
    for (dtype, shape, len) in [
        ("F32", vec![3u64, 5], 60u64),
        ("I64", vec![7], 56),
        ("BOOL", vec![1, 1, 9], 9),
        ("F16", vec![0, 4], 0),
    ] {
        let p = safetensors_prefix(&tensor("t", dtype, &shape, len)).unwrap();
        assert_eq!((p.len() - 8) % 8, 0, "padded to 8");
        let n = kvpool::weights::header_len(p[..8].try_into().unwrap()).unwrap();
        assert_eq!(n as usize, p.len() - 8);
        let h = kvpool::weights::parse_header(&p[8..], p.len() as u64 + len).unwrap();
        assert_eq!(h.tensors.len(), 1);
        let t = &h.tensors[0];
        assert_eq!((t.name.as_str(), t.dtype.as_str()), ("tensor_bytes", dtype));
        assert_eq!((t.shape.clone(), t.begin, t.end), (shape, 0, len));
    }
}

#[test]
fn a_manifest_whose_tensor_disagrees_with_itself_is_not_wrapped() {
    assert!(safetensors_prefix(&tensor("t", "F32", &[3], 8)).is_err());
    assert!(safetensors_prefix(&tensor("t", "X9", &[3], 3)).is_err());
    assert!(safetensors_prefix(&tensor("t", "F32", &[u64::MAX, 2], 8)).is_err());
}

#[tokio::test]
async fn the_budget_refuses_what_can_never_fit_and_waits_for_room() {
    let b = Budget::new(8 << 10);
    let d = std::time::Duration::from_millis(50);
    assert!(b
        .reserve((8 << 10) + 1, d)
        .await
        .unwrap_err()
        .contains("weights_memory"));
    let held = b.reserve(6 << 10, d).await.unwrap();
    assert!(b.reserve(4 << 10, d).await.unwrap_err().contains("busy"));
    drop(held);
    assert!(b
        .reserve(u64::MAX, d)
        .await
        .unwrap_err()
        .contains("weights_memory"));
    assert!(b.reserve(8 << 10, d).await.is_ok());
}
