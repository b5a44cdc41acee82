//! Hostile and unusual inputs to the model harness: every one is an error that names
//! what is wrong, never a panic, an out-of-bounds access or an allocation far larger
//! than the input. Model files are written here (GGUF v3), calibration files with
//! safetensors.

use rotkv::model::calibrate::{self, Calibration};
use rotkv::model::gguf::Gguf;
use rotkv::model::llama::{ExactAttention, Llama, Row};
use rotkv::{Error, LayerCalibration};
use rotkv_tests::Rng;
use rotkv_tests::gguf_writer::{Meta, Tensor, gguf_bytes, gguf_bytes_at, tiny_llama};

/// A one-layer llama GGUF with `heads` query heads and one KV head of `head_dim`
/// channels (see [`tiny_llama`]).
fn llama_gguf(heads: usize, head_dim: usize) -> (Vec<(&'static str, Meta)>, Vec<Tensor>) {
    tiny_llama(heads, 1, head_dim, head_dim as u64)
}

// ---- finding 1: head dimensions -------------------------------------------------------

#[test]
fn odd_and_zero_head_dims_are_refused_by_name() {
    for head_dim in [9, 0, 1] {
        let (meta, tensors) = llama_gguf(2, head_dim);
        let g = Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap();
        match Llama::from_gguf(&g) {
            Err(e @ Error::Unsupported(_)) => assert!(e.to_string().contains(&format!("head_dim {head_dim}")), "{e}"),
            other => panic!("head_dim {head_dim}: {other:?}"),
        }
    }
}

#[test]
fn head_dim_96_runs_exact_and_is_refused_by_calibration() {
    let (meta, tensors) = llama_gguf(2, 96);
    let g = Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap();
    let m = Llama::from_gguf(&g).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| i % 8).collect();
    let rows: Vec<Row> = (0..tokens.len()).map(|p| Row { seq: 0, pos: p }).collect();
    let h = m.forward(&tokens, &rows, &mut ExactAttention::new(&m.config), None, 1).unwrap();
    assert!(h.iter().all(|x| x.is_finite()));
    let e = calibrate::calibrate(&m, &tokens, None, &mut |_| {}).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("head_dim 96"), "{e}");
    let e = calibrate::calibrate_layer(&[0.0; 96 * 40], &[0.0; 96 * 40], 1, 96).unwrap_err();
    assert!(e.to_string().contains("head_dim 96"), "{e}");
    // The cache refuses it by name too.
    let e = rotkv::model::KvMethod::parse("k2v2", 96, 64).unwrap_err();
    assert!(e.to_string().contains("head_dim 96"), "{e}");
}

#[test]
#[should_panic(expected = "fwht of 96 values: the length must be a power of two")]
fn fwht_refuses_non_powers_of_two_in_release_too() {
    rotkv::reference::fwht(&mut [1.0; 96]);
}

// ---- finding 2: calibration files -----------------------------------------------------

/// A safetensors file of `tensors` (name, dtype, shape, bytes) with the calibration
/// format tag.
fn calibration_file(tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dt, shape, b)| (n.clone(), safetensors::tensor::TensorView::new(*dt, shape.clone(), b).unwrap()))
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "rotkv-calibration-1".to_string())]);
    safetensors::serialize(views, Some(meta)).unwrap()
}

#[test]
fn calibration_with_zero_channels_is_an_error() {
    use safetensors::Dtype::{F32, U16};
    let file = calibration_file(vec![
        ("layer0.key_mean".into(), F32, vec![1, 0], vec![]),
        ("layer0.key_perm".into(), U16, vec![1, 0], vec![]),
        ("layer0.value_perm".into(), U16, vec![1, 0], vec![]),
    ]);
    let e = Calibration::from_safetensors(&file).unwrap_err();
    assert!(e.to_string().contains("head_dim 0"), "{e}");
    // The layer check itself, as a cache runs it.
    let empty = LayerCalibration::identity(1, 0);
    assert!(matches!(empty.validate(1, 0), Err(Error::Calibration(_))));
    assert!(matches!(empty.check_orthogonal(1, 0), Err(Error::Calibration(_))));
}

#[test]
fn calibration_with_a_missing_layer_is_an_error() {
    let cal = Calibration {
        layers: vec![LayerCalibration::identity(2, 64); 3],
        kv_heads: 2,
        head_dim: 64,
        metadata: Default::default(),
        key_smoothing: Default::default(),
    };
    let bytes = cal.to_safetensors().unwrap();
    assert_eq!(Calibration::from_safetensors(&bytes).unwrap().layers.len(), 3);
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let keep = |skip: &dyn Fn(&str) -> bool| {
        calibration_file(
            st.tensors()
                .into_iter()
                .filter(|(n, _)| !skip(n))
                .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
                .collect(),
        )
    };
    // Layer 1 gone: layers 0 and 2 remain.
    let e = Calibration::from_safetensors(&keep(&|n| n.starts_with("layer1."))).unwrap_err();
    assert!(e.to_string().contains("layer 1 is missing"), "{e}");
    // A layer without one of its tensors names it.
    let e = Calibration::from_safetensors(&keep(&|n| n == "layer2.value_perm")).unwrap_err();
    assert!(e.to_string().contains("layer2.value_perm"), "{e}");
    // A tensor the format does not have.
    let mut with_extra: Vec<_> =
        st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    with_extra.push(("layer7.extra".into(), safetensors::Dtype::F32, vec![1], vec![0; 4]));
    let e = Calibration::from_safetensors(&calibration_file(with_extra)).unwrap_err();
    assert!(e.to_string().contains("layer7.extra"), "{e}");
}

#[test]
fn calibration_tensor_names_must_be_canonical_and_in_range() {
    let cal = Calibration {
        layers: vec![LayerCalibration::identity(1, 64); 2],
        kv_heads: 1,
        head_dim: 64,
        metadata: Default::default(),
        key_smoothing: Default::default(),
    };
    let bytes = cal.to_safetensors().unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let with = |extra: &str| {
        let mut all: Vec<_> =
            st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
        // Ones: valid as a key_mean and as a key_std.
        let ones: Vec<u8> = (0..64).flat_map(|_| 1f32.to_le_bytes()).collect();
        all.push((extra.to_string(), safetensors::Dtype::F32, vec![1, 64], ones));
        Calibration::from_safetensors(&calibration_file(all))
    };
    // A layer number whose successor does not fit (wrapped to 0 layers in release, a
    // panic in debug), numbers past u64 and leading zeros (a second spelling of layer 1
    // that was silently never read): each names the tensor.
    let max = format!("layer{}.key_mean", usize::MAX);
    for name in [max.as_str(), "layer99999999999999999999999.key_mean", "layer001.key_mean", "layer01.key_perm"] {
        match with(name) {
            Err(e @ Error::Calibration(_)) => assert!(e.to_string().contains(name), "{name}: {e}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    // A layer far past the others is a gap, not a loop over it.
    let e = with("layer1000000000000.key_mean").unwrap_err();
    assert!(e.to_string().contains("layer 2 is missing"), "{e}");
    // The canonical names still load.
    assert_eq!(with("layer1.key_std").unwrap().layers.len(), 2);
}

// ---- finding 3: resource limits of hostile files --------------------------------------

#[test]
fn gguf_metadata_arrays_are_bounded_by_the_file_and_a_budget() {
    // 5 MB of booleans would be 160 MB of values: refused before anything is allocated.
    let file = gguf_bytes(&[("junk", Meta::Bools(5_000_000))], &[]);
    let e = Gguf::parse(file).unwrap_err();
    assert!(e.to_string().contains("elements in all"), "{e}");
    // Within the budget it parses.
    let g = Gguf::parse(gguf_bytes(&[("flags", Meta::Bools(1000))], &[])).unwrap();
    assert!(matches!(&g.metadata["flags"], rotkv::model::gguf::Value::Array(v) if v.len() == 1000));
    // An array of u64 counted past the end of the file.
    let mut file = gguf_bytes(&[("flags", Meta::Bools(64))], &[]);
    let at = file.windows(5).position(|w| w == b"flags").unwrap() + 5 + 4; // key, array type
    file[at..at + 4].copy_from_slice(&10u32.to_le_bytes()); // element type u64
    let e = Gguf::parse(file).unwrap_err();
    assert!(e.to_string().contains("larger than the rest of the file"), "{e}");
}

/// A GGUF v3 file of `keys` one-byte metadata entries (`k<i>` = u8) and `tensors` F32
/// tensor entries of one dimension (no data: the parser refuses the counts first).
fn gguf_of_many_entries(keys: usize, tensors: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors as u64).to_le_bytes());
    b.extend((keys as u64).to_le_bytes());
    for i in 0..keys {
        let name = format!("k{i}");
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend(0u32.to_le_bytes()); // u8
        b.push(1);
    }
    for i in 0..tensors {
        let name = format!("t{i}");
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend(1u32.to_le_bytes()); // one dimension
        b.extend(1u64.to_le_bytes());
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(0u64.to_le_bytes());
    }
    b.resize(b.len().next_multiple_of(32) + 32, 0);
    b
}

#[test]
fn gguf_key_and_tensor_counts_are_bounded_before_allocation() {
    use rotkv::model::gguf::{MAX_METADATA_ELEMENTS, MAX_METADATA_KEYS, MAX_TENSORS};
    // Within the bounds a file of many small entries parses.
    let g = Gguf::parse(gguf_of_many_entries(1000, 1000)).unwrap();
    assert_eq!((g.metadata.len(), g.tensors.len()), (1000, 1000));
    // Past them: 100k keys (1.8 MB of file, about 10 MB of maps) or 100k tensor entries
    // are refused by their declared counts, before a map is built.
    let e = Gguf::parse(gguf_of_many_entries(100_000, 0)).unwrap_err();
    assert!(e.to_string().contains(&format!("100000 metadata keys; at most {MAX_METADATA_KEYS}")), "{e}");
    let e = Gguf::parse(gguf_of_many_entries(0, 100_000)).unwrap_err();
    assert!(e.to_string().contains(&format!("100000 tensors; at most {MAX_TENSORS}")), "{e}");
    let e = Gguf::parse_metadata(gguf_of_many_entries(MAX_METADATA_KEYS + 1, 0)).unwrap_err();
    assert!(e.to_string().contains("metadata keys"), "{e}");
    // Keys count against the element budget with the arrays: an array that fits the
    // budget alone does not fit it beside 10 more keys.
    let fits = gguf_bytes(&[("junk", Meta::Bools(MAX_METADATA_ELEMENTS as u64 - 1))], &[]);
    assert!(Gguf::parse_metadata(fits).is_ok());
    let mut meta = vec![("junk", Meta::Bools(MAX_METADATA_ELEMENTS as u64 - 5))];
    let names: Vec<String> = (0..10).map(|i| format!("key{i}")).collect();
    meta.extend(names.iter().map(|n| (n.as_str(), Meta::U32(1))));
    let e = Gguf::parse_metadata(gguf_bytes(&meta, &[])).unwrap_err();
    assert!(e.to_string().contains("elements in all"), "{e}");
}

#[test]
fn gguf_alignment_must_be_a_power_of_two_and_offsets_aligned() {
    let (mut meta, tensors) = llama_gguf(2, 64);
    let g = Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap();
    assert!(Llama::from_gguf(&g).is_ok());
    for bad in [0, 3, 48] {
        meta.push(("general.alignment", Meta::U32(bad)));
        let e = Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap_err();
        assert!(e.to_string().contains("alignment"), "{bad}: {e}");
        meta.pop();
    }
    meta.push(("general.alignment", Meta::U32(32)));
    assert!(Gguf::parse(gguf_bytes(&meta, &tensors)).is_ok());
    // One tensor 4 bytes off its aligned place.
    let e = Gguf::parse(gguf_bytes_at(&meta, &tensors, &|i, o| if i == 3 { o + 4 } else { o })).unwrap_err();
    assert!(e.to_string().contains("blk.0.attn_q.weight") && e.to_string().contains("not aligned"), "{e}");
}

/// The byte-level vocabulary (256 byte characters), letter pairs (merges in a shuffled
/// order) and some 4-letter merges of those pairs, ranked after them.
fn letter_tokenizer() -> (rotkv::model::tokenizer::Tokenizer, Vec<(String, String)>, Vec<String>) {
    let mut tokens: Vec<String> = Vec::new();
    let mut extra = 0;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        tokens.push(if printable {
            char::from_u32(b).unwrap().to_string()
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap().to_string()
        });
    }
    let mut r = Rng::new(7);
    let letters: Vec<char> = ('a'..='z').collect();
    let mut pairs: Vec<(String, String)> =
        letters.iter().flat_map(|&a| letters.iter().map(move |&b| (a.to_string(), b.to_string()))).collect();
    for i in (1..pairs.len()).rev() {
        pairs.swap(i, r.below(i + 1));
    }
    let mut merges = pairs.clone();
    for _ in 0..2000 {
        let (a, b) = (&pairs[r.below(pairs.len())], &pairs[r.below(pairs.len())]);
        merges.push((format!("{}{}", a.0, a.1), format!("{}{}", b.0, b.1)));
    }
    for (a, b) in &merges {
        tokens.push(format!("{a}{b}"));
    }
    let lines: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let tok =
        rotkv::model::tokenizer::Tokenizer::new(tokens.clone(), &refs, rotkv::model::tokenizer::Pre::Gpt2, [None; 3])
            .unwrap();
    (tok, merges, tokens)
}

/// BPE as a pass per rank: merge every occurrence of the lowest-ranked pair, left to
/// right, until none is left (quadratic; the definition the fast merge must match).
fn bpe_by_passes(word: &str, merges: &[(String, String)], tokens: &[String]) -> Vec<u32> {
    let ranks: std::collections::HashMap<(&str, &str), usize> =
        merges.iter().enumerate().rev().map(|(i, (a, b))| ((a.as_str(), b.as_str()), i)).collect();
    let mut parts: Vec<String> = word.chars().map(String::from).collect();
    while let Some(best) = parts.windows(2).filter_map(|w| ranks.get(&(w[0].as_str(), w[1].as_str())).copied()).min() {
        let mut merged = Vec::new();
        let mut i = 0;
        while i < parts.len() {
            if i + 1 < parts.len() && ranks.get(&(parts[i].as_str(), parts[i + 1].as_str())) == Some(&best) {
                merged.push(format!("{}{}", parts[i], parts[i + 1]));
                i += 2;
            } else {
                merged.push(parts[i].clone());
                i += 1;
            }
        }
        parts = merged;
    }
    parts.iter().map(|p| tokens.iter().position(|t| t == p).unwrap() as u32).collect()
}

#[test]
fn bpe_of_a_64_kb_word_is_fast_and_merges_as_before() {
    let (tok, merges, tokens) = letter_tokenizer();
    let mut r = Rng::new(11);
    let word = |n: usize, r: &mut Rng| -> String { (0..n).map(|_| (b'a' + r.below(26) as u8) as char).collect() };
    for n in [1, 2, 3, 17, 300, 2000] {
        let w = word(n, &mut r);
        assert_eq!(tok.encode(&w).unwrap(), bpe_by_passes(&w, &merges, &tokens), "word of {n} letters");
    }
    let long = word(64 * 1024, &mut r);
    let started = std::time::Instant::now();
    let ids = tok.encode(&long).unwrap();
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(tok.decode(&ids).unwrap(), long);
    assert!(secs < 5.0, "a 64 KB word took {secs:.1} s to encode");
}

// ---- tokenizer setup and text prefixes ------------------------------------------------

/// A SentencePiece tokenizer of `▁`, the letters, their `▁` pairs, a few letter pairs
/// and the newline's byte token, scores in id order.
fn letter_sentencepiece(extra: &[String]) -> (rotkv::model::tokenizer::Tokenizer, Vec<String>) {
    let letters: Vec<String> = ('a'..='z').map(String::from).collect();
    let mut tokens: Vec<String> = vec!["<0x0A>".into(), "▁".into(), ".".into()];
    tokens.extend(letters.iter().cloned());
    tokens.extend(letters.iter().map(|l| format!("▁{l}")));
    tokens.extend(["th", "he", "in", "er", "an", "the", "▁the"].map(String::from));
    tokens.extend(extra.iter().cloned());
    let scores: Vec<f64> = (0..tokens.len()).map(|i| -(i as f64)).collect();
    let types: Vec<i64> = (0..tokens.len()).map(|i| if i == 0 { 6 } else { 1 }).collect();
    let tok =
        rotkv::model::tokenizer::Tokenizer::sentencepiece(tokens.clone(), &scores, &types, true, [None; 3]).unwrap();
    (tok, tokens)
}

#[test]
fn a_300_kb_sentencepiece_token_is_one_pass_of_setup() {
    // One token of 300,000 letters beside short ones: its 299,999 splits are not looked
    // up (no token has the length of both halves), where each hashed its prefix before
    // (about 45 GB hashed, 20 s).
    let long: String = (0..300_000).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let (tok, tokens) = letter_sentencepiece(std::slice::from_ref(&long));
    let (short, _) = letter_sentencepiece(&[]);
    assert_eq!(tok.merge_count(), short.merge_count());
    assert_eq!(tok.setup_bytes(), short.setup_bytes(), "the long token cost setup work");
    assert!(short.setup_bytes() < 1000, "{}", short.setup_bytes());
    assert_eq!(tok.vocab_size(), tokens.len());
    // The long token is still a token of the vocabulary (decoded whole).
    let id = tokens.len() as u32 - 1;
    assert_eq!(tok.decode(&[id]).unwrap(), long);
}

/// `lines` lines of random words (some with trailing spaces, CRLF ends, blank lines).
fn random_text(lines: usize, seed: u64) -> String {
    let mut r = Rng::new(seed);
    let mut s = String::new();
    for _ in 0..lines {
        for w in 0..1 + r.below(12) {
            if w > 0 {
                s.push(' ');
            }
            let word: String = (0..1 + r.below(9)).map(|_| (b'a' + r.below(26) as u8) as char).collect();
            s.push_str(&word);
        }
        match r.below(8) {
            0 => s.push_str("  \n"),
            1 => s.push_str("\r\n"),
            2 => s.push_str(".\n\n"),
            _ => s.push('\n'),
        }
    }
    s
}

#[test]
fn text_prefixes_tokenize_as_the_whole_text_and_read_only_what_they_need() {
    let dir = std::env::temp_dir().join(format!("rotkv-text-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("text.txt");
    std::fs::write(&path, random_text(4000, 5)).unwrap();
    let (bpe, _, _) = letter_tokenizer();
    let (sp, _) = letter_sentencepiece(&[]);
    for tok in [&bpe, &sp] {
        let all = tok.encode(&rotkv::model::read_text(&path).unwrap()).unwrap();
        for n in [0, 1, 2, 3, 100, 1000, 7777, all.len() - 1] {
            let p = rotkv::model::text_tokens(tok, &path, n).unwrap();
            assert_eq!(p.ids, all[..n], "{:?}, {n} tokens", tok.kind);
            assert!(!p.whole || n + 1 >= all.len() / 2, "{n} tokens read the whole file");
        }
        // More than the text holds: all of it.
        let p = rotkv::model::text_tokens(tok, &path, all.len() + 5).unwrap();
        assert_eq!((p.ids.len(), p.whole), (all.len(), true));
    }
    // An 8 MB text, 2 tokens asked: a few KB read (the whole text took 2.5 GB and 11 s
    // through the CLI).
    let big = dir.join("big.txt");
    let text = random_text(4000, 6);
    std::fs::write(&big, text.repeat(8 << 20 >> 17)).unwrap();
    let p = rotkv::model::text_tokens(&bpe, &big, 2).unwrap();
    assert_eq!(p.ids.len(), 2);
    assert!(!p.whole && p.bytes <= 8 * 2 + 4096, "{} bytes read for 2 tokens", p.bytes);
    let p = rotkv::model::text_tokens(&sp, &big, 20_000).unwrap();
    assert_eq!(p.ids, sp.encode(&text.replace("\r\n", "\n")).unwrap()[..20_000]);
    assert!(p.bytes <= 4 * (8 * 20_000 + 4096), "{} bytes read for 20000 tokens", p.bytes);
    // A file that is not UTF-8 past the prefix still gives its first tokens.
    let mut bytes = b"hello world\nand more\n".to_vec();
    bytes.extend([0xff; 10_000]);
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, &bytes).unwrap();
    assert_eq!(rotkv::model::text_tokens(&bpe, &bad, 1).unwrap().ids, bpe.encode("hello").unwrap()[..1]);
    let e = rotkv::model::text_tokens(&bpe, &bad, 100).unwrap_err();
    assert!(e.to_string().contains("not UTF-8"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_with_too_many_steps_is_an_error() {
    let (meta, tensors) = llama_gguf(2, 64);
    let m = Llama::from_gguf(&Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap()).unwrap();
    let e =
        rotkv::model::generate(&m, &[1, 2], usize::MAX, rotkv::CacheConfig::k2v2(64), rotkv::Backend::Cpu).unwrap_err();
    assert!(matches!(e, Error::Capacity(_)) && e.to_string().contains("too many tokens"), "{e}");
}

// ---- the cache and the paged API: aliased blocks, stale ids, sizes -------------------

use rotkv::paged::{self, DecodeOptions, LayerShape};
use rotkv::reference::SeqRef;
use rotkv::{Backend, CacheConfig, CacheShape, KvCache, SeqId, f16};
use rotkv_tests::{Data, backends, rows};

fn seq_ref<'a>(table: &'a [u32], side: &'a [f16], len: usize) -> SeqRef<'a> {
    SeqRef { block_table: table, side, len, protected: &[] }
}

#[test]
fn aliased_block_tables_are_refused_before_anything_is_written() {
    let config = CacheConfig { window: 16, page_size: 16, ..CacheConfig::k2v2(64) };
    let shape = LayerShape { num_kv_heads: 2, num_q_heads: 2 };
    let calib = LayerCalibration::identity(2, 64);
    let (k, v) = (rows(Data::Keys, 60 * 2, 64, 1), rows(Data::Normal, 60 * 2, 64, 2));
    let q = rows(Data::Normal, 2 * 2, 64, 3);
    for backend in backends() {
        let mut pool = paged::PoolBuffer::new(paged::pool_bytes(&config, &shape, 6).unwrap());
        let mut side = vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
        let mut side2 = side.clone();
        // 60 tokens need 2 pages: one table that repeats a block.
        let (pool0, side0) = (pool.clone(), side.clone());
        let r =
            paged::append(backend, &config, &calib, &shape, pool.bytes_mut(), &[3, 3], &mut side, &[], 0, 60, &k, &v);
        assert!(matches!(r, Err(Error::AliasedBlock { index: 1, block: 3, .. })), "{backend:?}: {r:?}");
        assert!(r.unwrap_err().to_string().contains("twice in the block table"));
        assert_eq!((&pool, &side), (&pool0, &side0), "{backend:?}: a refused append wrote");
        // Entries past the pages the length needs are not looked at.
        paged::append(backend, &config, &calib, &shape, pool.bytes_mut(), &[3, 1, 3], &mut side, &[], 0, 60, &k, &v)
            .unwrap();
        paged::append(backend, &config, &calib, &shape, pool.bytes_mut(), &[0, 4], &mut side2, &[], 0, 60, &k, &v)
            .unwrap();
        let mut out = vec![0f32; q.len()];
        let decode = |seqs: &[SeqRef<'_>], out: &mut [f32]| {
            let q = &q[..seqs.len() * 2 * 64];
            paged::decode(backend, &config, &calib, &shape, pool.bytes(), seqs, q, out, DecodeOptions::default())
        };
        decode(&[seq_ref(&[3, 1], &side, 60), seq_ref(&[0, 4], &side2, 60)], &mut out).unwrap();
        let before = out.clone();
        // Two sequences of a batch sharing block 1, and a table repeating a block.
        for (tables, index, block) in [([[3u32, 1], [1, 4]], 0, 1), ([[3, 1], [0, 0]], 1, 0)] {
            let r = decode(&[seq_ref(&tables[0], &side, 60), seq_ref(&tables[1], &side2, 60)], &mut out);
            assert!(
                matches!(r, Err(Error::AliasedBlock { index: i, block: b, .. }) if i == index && b == block),
                "{backend:?} {tables:?}: {r:?}"
            );
            assert_eq!(out, before, "a refused decode wrote its output");
        }
        // The cache: a sequence twice in one batch.
        let cshape =
            CacheShape { layers: 1, num_kv_heads: 2, num_q_heads: 2, max_seqs: 2, max_tokens: 64, num_blocks: None };
        let mut cache = KvCache::new(config, cshape, backend).unwrap();
        let s = cache.add_sequence().unwrap();
        cache.append(0, s, 60, &k, &v).unwrap();
        let e = cache.decode(0, &[s, s], &q, &mut out).unwrap_err();
        assert!(matches!(e, Error::Shape(_)) && e.to_string().contains("appears twice"), "{e}");
    }
}

#[test]
fn freed_and_foreign_sequence_ids_are_refused() {
    let config = CacheConfig { window: 16, page_size: 16, protected: 2, ..CacheConfig::k2v2(64) };
    let cshape =
        CacheShape { layers: 1, num_kv_heads: 2, num_q_heads: 2, max_seqs: 2, max_tokens: 64, num_blocks: None };
    let (k, v) = (rows(Data::Keys, 40 * 2, 64, 1), rows(Data::Normal, 40 * 2, 64, 2));
    let q = &rows(Data::Normal, 2, 64, 3);
    for backend in backends() {
        let mut cache = KvCache::new(config, cshape, backend).unwrap();
        let mut other = KvCache::new(config, cshape, backend).unwrap();
        let old = cache.add_sequence().unwrap();
        cache.append(0, old, 20, &k[..20 * 128], &v[..20 * 128]).unwrap();
        cache.free_sequence(old).unwrap();
        let new = cache.add_sequence().unwrap();
        assert_eq!(new.slot(), old.slot(), "the slot is reused");
        assert_ne!(new, old);
        cache.append(0, new, 40, &k, &v).unwrap();
        let foreign = other.add_sequence().unwrap();
        assert_eq!(foreign.slot(), new.slot());
        let mut want = vec![0f32; q.len()];
        cache.decode(0, &[new], q, &mut want).unwrap();
        let free_blocks = cache.free_blocks();
        for id in [old, foreign, SeqId::from_slot(new.slot())] {
            let mut out = vec![0f32; q.len()];
            let results = [
                cache.append(0, id, 1, &k[..128], &v[..128]).map(|_| ()),
                cache.len(0, id).map(|_| ()),
                cache.is_empty(id).map(|_| ()),
                cache.protect(0, id, &[50]),
                cache.protected(0, id).map(|_| ()),
                cache.set_sequence_key_mean(0, id, &[0.0; 128]),
                cache.decode(0, &[id], q, &mut out),
                cache.free_sequence(id),
            ];
            for r in results {
                assert_eq!(r, Err(Error::UnknownSequence(new.slot())), "{backend:?} {id:?}");
            }
        }
        // Nothing changed: the live sequence still holds its tokens and blocks.
        assert_eq!(cache.len(0, new), Ok(40));
        assert_eq!(cache.protected(0, new), Ok(&[][..]));
        assert_eq!(cache.free_blocks(), free_blocks);
        let mut out = vec![0f32; q.len()];
        cache.decode(0, &[new], q, &mut out).unwrap();
        assert_eq!(out, want);
    }
}

#[test]
fn cache_and_pool_sizes_past_memory_are_capacity_errors() {
    let config = CacheConfig::k2v2(128);
    let base =
        CacheShape { layers: 1, num_kv_heads: 8, num_q_heads: 32, max_seqs: 1, max_tokens: 64, num_blocks: None };
    let capacity = |shape: CacheShape| match KvCache::new(config, shape, Backend::Cpu) {
        Err(e @ Error::Capacity(_)) => e.to_string(),
        Err(e) => panic!("{shape:?}: {e}"),
        Ok(c) => panic!("{shape:?}: a cache of {} bytes", c.memory_bytes()),
    };
    // A pool far past the index space, layers and slots whose products overflow.
    capacity(CacheShape { num_blocks: Some(u32::MAX as usize), ..base });
    capacity(CacheShape { num_blocks: Some(usize::MAX), ..base });
    capacity(CacheShape { layers: 1 << 40, ..base });
    capacity(CacheShape { layers: usize::MAX, ..base });
    capacity(CacheShape { max_seqs: 1 << 60, ..base });
    capacity(CacheShape { max_seqs: usize::MAX, ..base });
    capacity(CacheShape { num_kv_heads: 1 << 40, num_q_heads: 1 << 40, ..base });
    // 2^31 - 1 tokens: a legal size of about 150 GB that this machine cannot allocate is
    // an error, not an abort (where it can, the pages are not touched).
    match KvCache::new(config, CacheShape { max_tokens: (1 << 31) - 1, ..base }, Backend::Cpu) {
        Err(Error::Capacity(e)) => assert!(e.contains("could not allocate"), "{e}"),
        Err(e) => panic!("{e}"),
        Ok(c) => assert!(c.memory_bytes() > 100 << 30),
    }
    // The sizing functions of the paged API.
    let huge = LayerShape { num_kv_heads: 1 << 40, num_q_heads: 1 << 40 };
    assert!(matches!(paged::pool_bytes(&config, &huge, 1 << 30), Err(Error::Capacity(_))));
    let wide = LayerShape { num_kv_heads: (1 << 32) + 1, num_q_heads: (1 << 32) + 1 };
    assert!(matches!(paged::side_elems(&config, &wide), Err(Error::Capacity(_))));
    let ok = LayerShape { num_kv_heads: 8, num_q_heads: 32 };
    assert!(matches!(paged::pool_bytes(&config, &ok, usize::MAX / 2), Err(Error::Capacity(_))));
    assert_eq!(paged::pool_bytes(&config, &ok, 2).unwrap(), 2 * 8 * config.format().unwrap().page_bytes() as usize);
}

#[test]
fn protected_positions_that_can_never_come_are_refused() {
    let config = CacheConfig { protected: 4, ..CacheConfig::k2v2(64) };
    let cshape =
        CacheShape { layers: 1, num_kv_heads: 1, num_q_heads: 1, max_seqs: 1, max_tokens: 200, num_blocks: None };
    for backend in backends() {
        let mut cache = KvCache::new(config, cshape, backend).unwrap();
        let s = cache.add_sequence().unwrap();
        for bad in [&[u32::MAX][..], &[200], &[10, 1 << 31]] {
            let e = cache.protect(0, s, bad).unwrap_err();
            assert!(matches!(e, Error::Value(_)) && e.to_string().contains("can never be appended"), "{bad:?}: {e}");
            assert_eq!(cache.protected(0, s), Ok(&[][..]), "a refused protect kept a position");
        }
        cache.protect(0, s, &[10, 199]).unwrap();
        assert_eq!(cache.protected(0, s), Ok(&[10, 199][..]));
    }
    // The paged API refuses positions past the format's length limit.
    let shape = LayerShape { num_kv_heads: 1, num_q_heads: 1 };
    let mut side = vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
    let e = paged::protect(&config, &shape, &mut side, 0, &[], &[u32::MAX]).unwrap_err();
    assert!(e.to_string().contains("can never be appended"), "{e}");
}

#[test]
fn gguf_duplicate_names_are_refused() {
    let (meta, mut tensors) = llama_gguf(2, 64);
    let dup = tensors[1].clone();
    tensors.push(dup);
    let e = Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap_err();
    assert!(e.to_string().contains("output_norm.weight appears twice"), "{e}");
    let (mut meta, tensors) = llama_gguf(2, 64);
    meta.push(("llama.block_count", Meta::U32(7)));
    let e = Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap_err();
    assert!(e.to_string().contains("llama.block_count appears twice"), "{e}");
}

/// An empty page pool is a pool of no blocks (every sequence in its sinks and window),
/// not a misaligned one: appends and decodes that need no block work on every backend,
/// and one that needs a block says so.
#[test]
fn an_empty_paged_pool_holds_no_blocks() {
    let config = CacheConfig { window: 16, page_size: 16, ..CacheConfig::k2v2(64) };
    let calib = LayerCalibration::identity(1, 64);
    let shape = LayerShape { num_kv_heads: 1, num_q_heads: 1 };
    let (k, v, q) = (rows(Data::Normal, 10, 64, 1), rows(Data::Normal, 10, 64, 2), rows(Data::Normal, 1, 64, 3));
    for backend in backends() {
        let mut side = vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
        let n = paged::append(backend, &config, &calib, &shape, &mut [], &[], &mut side, &[], 0, 10, &k, &v).unwrap();
        assert_eq!(n, 10);
        let seq = SeqRef { block_table: &[], side: &side, len: 10, protected: &[] };
        let mut out = vec![0f32; 64];
        paged::decode(backend, &config, &calib, &shape, &[], &[seq], &q, &mut out, DecodeOptions::default()).unwrap();
        assert!(out.iter().all(|x| x.is_finite()) && out.iter().any(|&x| x != 0.0), "{backend:?}");
        // 40 tokens need a block: refused for the table, not for the pool's alignment.
        let (k, v) = (rows(Data::Normal, 40, 64, 4), rows(Data::Normal, 40, 64, 5));
        let e =
            paged::append(backend, &config, &calib, &shape, &mut [], &[], &mut side, &[], 0, 40, &k, &v).unwrap_err();
        assert!(!e.to_string().contains("boundary"), "{backend:?}: {e}");
    }
}

/// A zero-token append checks its inputs like any other (the device layer's: buffers of
/// another device, strides, in `tests/tests/step.rs`): rows for tokens it does not
/// append are a shape error, and nothing changes.
#[test]
fn zero_token_appends_check_their_inputs() {
    let config = CacheConfig::k2v2(64);
    let shape =
        CacheShape { layers: 1, num_kv_heads: 2, num_q_heads: 2, max_seqs: 1, max_tokens: 64, num_blocks: None };
    for backend in backends() {
        let mut cache = KvCache::new(config, shape, backend).unwrap();
        let s = cache.add_sequence().unwrap();
        let row = vec![0.5f32; 2 * 64];
        assert!(matches!(cache.append(0, s, 0, &row, &[]), Err(Error::Shape(_))), "{backend:?}");
        assert!(matches!(cache.append(0, s, 0, &[], &row), Err(Error::Shape(_))), "{backend:?}");
        cache.append::<f32>(0, s, 0, &[], &[]).unwrap();
        assert_eq!(cache.len(0, s), Ok(0));
    }
}

/// Sizes from input never wrap or abort on the device API: a layer whose pool bytes
/// overflow `usize` (k4v4 head_dim 256, pages of 256, 63,081 KV heads, 4,199,642,129
/// blocks: 2^64 + 561,152 bytes) is `Error::Capacity`, not a layer with a 561,152-byte pool;
/// an allocation the machine cannot hold (1 PiB; a layer of 300 sequences of 2^30 tokens,
/// or of u32::MAX blocks: past the 128 TiB of a 47-bit address space, so refused whatever
/// the kernel's overcommit policy) is `Error::Capacity`, not an abort.
#[test]
fn device_sizes_are_checked_and_allocations_fallible() {
    use rotkv::device::{Device, DeviceLayer, LayerSize};
    let dev = Device::sim();
    let config = CacheConfig { page_size: 256, ..CacheConfig::k4v4(256) };
    let heads = 63_081;
    let shape = LayerShape { num_kv_heads: heads, num_q_heads: heads };
    let size = LayerSize { max_seqs: 1, max_tokens: 1024, num_blocks: Some(4_199_642_129) };
    let r = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(heads, 256), size);
    assert!(matches!(r, Err(Error::Capacity(_))), "{:?}", r.map(|_| ()));
    assert!(matches!(dev.alloc::<u8>(1 << 50), Err(Error::Capacity(_))));
    let shape = LayerShape { num_kv_heads: 8, num_q_heads: 32 };
    let calib = LayerCalibration::identity(8, 128);
    for size in [
        LayerSize { max_seqs: 300, max_tokens: 1 << 30, num_blocks: None },
        LayerSize { max_seqs: 1, max_tokens: 1024, num_blocks: Some(u32::MAX as usize) },
    ] {
        let r = DeviceLayer::new(&dev, CacheConfig::k2v2(128), shape, calib.clone(), size);
        assert!(matches!(r, Err(Error::Capacity(_))), "{size:?}: {:?}", r.map(|_| ()));
    }
}
