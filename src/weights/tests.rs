use super::*;
use proptest::prelude::*;

/// A safetensors file of `tensors` (name, dtype, shape), bytes counting up.
fn file(tensors: &[(&str, &str, &[u64])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, dtype, shape) in tensors {
        let n = shape.iter().product::<u64>() * dtype_bits(dtype).unwrap() / 8;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}),
        );
        at += n;
    }
    let mut text = serde_json::to_string(&header).unwrap();
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend((0..at).map(|i| i as u8));
    out
}

fn parse(f: &[u8]) -> Result<Header, FormatError> {
    let n = header_len(f[..8].try_into().unwrap())?;
    parse_header(&f[8..8 + n as usize], f.len() as u64)
}

#[test]
fn a_header_parses_in_byte_order_with_its_text_kept() {
    let f = file(&[
        ("b", "F32", &[2, 3]),
        ("a", "BF16", &[4]),
        ("c", "U8", &[0]),
    ]);
    let h = parse(&f).unwrap();
    let names: Vec<&str> = h.tensors.iter().map(|t| &t.name[..]).collect();
    // "c" has no bytes: it sorts at its offset, after "a".
    assert_eq!(names, ["b", "a", "c"]);
    assert_eq!(h.data_len, 32);
    assert_eq!(h.data_start, 8 + h.text.len() as u64);
    assert_eq!(&f[8..h.data_start as usize], h.text.as_bytes());
}

#[test]
fn holes_overlaps_and_wrong_lengths_are_refused() {
    let f = file(&[("a", "F32", &[2])]);
    // A data section one byte longer than the tensors: a hole at the end.
    let mut longer = f.clone();
    longer.push(0);
    assert!(parse(&longer).is_err());
    // A shorter file than the offsets say.
    assert!(parse(&f[..f.len() - 1]).is_err());
    let text = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#;
    let e = parse_header(text.as_bytes(), 8 + text.len() as u64 + 4).unwrap_err();
    assert!(e.to_string().contains("needs 8"), "{e}");
    let text = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    assert!(parse_header(text.as_bytes(), 8 + text.len() as u64 + 6).is_err());
    assert!(parse_header(b"[1,2]", 100).is_err());
    assert!(parse_header(b"\xff", 100).is_err());
    assert!(header_len([0; 8]).is_err());
    assert!(header_len(u64::MAX.to_le_bytes()).is_err());
}

fn manifest(chunk_size: u64, lens: &[u64]) -> Manifest {
    Manifest {
        format: MANIFEST_FORMAT,
        name: "m".into(),
        chunk_size,
        replicas: 2,
        files: vec![FileEntry {
            name: "model.safetensors".into(),
            rank: None,
            header: "{}".into(),
            data_len: lens.iter().sum(),
            tensors: lens
                .iter()
                .enumerate()
                .map(|(i, &len)| TensorEntry {
                    name: format!("t{i}"),
                    dtype: "U8".into(),
                    shape: vec![len],
                    offset: lens[..i].iter().sum(),
                    len,
                    chunks: (0..len.div_ceil(chunk_size)).collect(),
                })
                .collect(),
        }],
        extra: Vec::new(),
    }
}

#[test]
fn chunks_cover_every_tensor_exactly() {
    let m = manifest(10, &[25, 0, 10, 3]);
    let per: Vec<(usize, u64, u64)> = m.chunks().map(|c| (c.tensor, c.begin, c.len)).collect();
    assert_eq!(
        per,
        [(0, 0, 10), (0, 10, 10), (0, 20, 5), (2, 0, 10), (3, 0, 3)]
    );
    let back = Manifest::from_json(&m.to_json()).unwrap();
    assert_eq!(back, m);
    let mut wrong = m.clone();
    wrong.files[0].tensors[0].chunks.pop();
    assert!(Manifest::from_json(&wrong.to_json()).is_err());
    let mut newer = m;
    newer.format += 1;
    assert!(Manifest::from_json(&newer.to_json()).is_err());
    assert!(Manifest::from_json(b"{").is_err());
}

#[test]
fn keys_names_ranks_and_indexes() {
    let m = manifest(10, &[25]);
    let c = m.chunks().nth(1).unwrap();
    let k = chunk_key("org/model", &c);
    assert!(k.len() < 64 && k.starts_with(b"w/"));
    assert_ne!(k, chunk_key("org/model2", &c));
    assert_eq!(manifest_key("a/b"), b"manifest/a/b");
    assert!(check_name("org/model-7b").is_ok());
    for bad in ["", "/x", "x/", "a b", &"x".repeat(MAX_NAME + 1)] {
        assert!(check_name(bad).is_err(), "{bad:?}");
    }
    assert_eq!(rank_of_file("model-rank-12-part-0.safetensors"), Some(12));
    assert_eq!(rank_of_file("model-00001-of-00002.safetensors"), None);
    let idx = br#"{"metadata":{},"weight_map":{"a":"m-2.safetensors","b":"m-1.safetensors","c":"m-2.safetensors"}}"#;
    assert_eq!(
        index_files(idx).unwrap(),
        ["m-1.safetensors", "m-2.safetensors"]
    );
    assert!(index_files(br#"{"weight_map":{"a":"../x"}}"#).is_err());
}

proptest! {
    /// A slice's byte ranges pick exactly the elements a naive walk over the indices picks.
    #[test]
    fn shard_ranges_match_a_naive_slice(
        shape in prop::collection::vec(1u64..5, 1..4),
        dim_pick in 0usize..4,
        world in 1u64..4,
        bits in prop::sample::select(vec![8u64, 16, 32]),
    ) {
        let dim = dim_pick % shape.len();
        let mut shape = shape;
        shape[dim] *= world;
        let dtype = match bits { 8 => "U8", 16 => "F16", _ => "F32" };
        let elems: u64 = shape.iter().product();
        let t = TensorEntry {
            name: "t".into(), dtype: dtype.into(), shape: shape.clone(), offset: 0,
            len: elems * bits / 8, chunks: vec![],
        };
        let esz = bits / 8;
        for rank in 0..world {
            let Slice { ranges, shape: sub } = shard_ranges(&t, dim, rank, world).unwrap();
            let part = shape[dim] / world;
            // Naive: every element whose index along `dim` falls in the rank's part.
            let mut want = Vec::new();
            for e in 0..elems {
                let mut rest = e;
                let mut idx = vec![0; shape.len()];
                for d in (0..shape.len()).rev() {
                    idx[d] = rest % shape[d];
                    rest /= shape[d];
                }
                if idx[dim] / part == rank {
                    want.extend(e * esz..(e + 1) * esz);
                }
            }
            let got: Vec<u64> = ranges.iter().flat_map(|&(b, l)| b..b + l).collect();
            prop_assert_eq!(got, want);
            prop_assert_eq!(sub.iter().product::<u64>() * esz, ranges.iter().map(|r| r.1).sum::<u64>());
        }
        prop_assert!(shard_ranges(&t, shape.len(), 0, world).is_err());
        prop_assert!(shard_ranges(&t, dim, world, world).is_err());
    }
}
