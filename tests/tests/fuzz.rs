//! Mutation fuzzing of the two file readers, on stable Rust in the ordinary test suite:
//! the GGUF reader (with the tokenizer and the llama loader and a short forward pass on
//! whatever loads) and the calibration-file reader. Each target mutates committed-in-code
//! seed files (bit flips, interesting integers at random offsets, truncation, chunk
//! duplication and deletion, splices of two seeds) with a fixed seed and a fixed number
//! of iterations, so a run is reproducible; any panic fails the test, names the
//! iteration and writes the input to `target/fuzz-crash-<target>-<iteration>.bin`.
//!
//! Budgets: `ROTKV_FUZZ_ITERS` (default 3,000) mutants of the calibration files and ten
//! times as many GGUF files (about 35 µs each against 600 µs): a few seconds in the
//! test suite. `cargo xtask ci` sets 50,000 (see README "Reliability").
//! `ROTKV_FUZZ_SEED` picks another mutation stream.

use rotkv::LayerCalibration;
use rotkv::model::calibrate::Calibration;
use rotkv::model::gguf::Gguf;
use rotkv::model::llama::{ExactAttention, Llama, Row};
use rotkv::model::tokenizer::Tokenizer;
use rotkv_tests::Rng;
use rotkv_tests::gguf_writer::{Meta, gguf_bytes};
use std::panic::{AssertUnwindSafe, catch_unwind};

fn iterations() -> usize {
    std::env::var("ROTKV_FUZZ_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(3000)
}

fn base_seed() -> u64 {
    std::env::var("ROTKV_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed)
}

const INTERESTING: [u64; 12] = [0, 1, 2, 3, 7, 8, 16, 64, 0x7f, 0x8000_0000, 0xffff_ffff, 0xffff_ffff_ffff_ffff];

/// One to four random mutations of `seed` (`other` for splices).
fn mutate(seed: &[u8], other: &[u8], r: &mut Rng) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + r.below(4) {
        if b.is_empty() {
            b.push(r.below(256) as u8);
        }
        let at = r.below(b.len());
        match r.below(8) {
            0 => b[at] ^= 1 << r.below(8),
            1 => b[at] = [0, 1, 0x7f, 0x80, 0xff][r.below(5)],
            2 | 3 => {
                // An interesting little-endian integer of 4 or 8 bytes.
                let v = INTERESTING[r.below(INTERESTING.len())].wrapping_add(r.below(3) as u64).wrapping_sub(1);
                let w = if r.below(2) == 0 { 4 } else { 8 };
                for (i, byte) in v.to_le_bytes()[..w].iter().enumerate() {
                    if let Some(x) = b.get_mut(at + i) {
                        *x = *byte;
                    }
                }
            }
            4 => b.truncate(at),
            5 => {
                let n = r.below(64.min(b.len() - at) + 1);
                let chunk = b[at..at + n].to_vec();
                let to = r.below(b.len() + 1);
                b.splice(to..to, chunk);
            }
            6 => {
                let n = r.below(64.min(b.len() - at) + 1);
                b.drain(at..at + n);
            }
            _ => {
                let from = r.below(other.len().max(1));
                let n = r.below(256).min(other.len() - from.min(other.len()));
                let end = (at + n).min(b.len());
                b.splice(at..end, other[from..from + n].iter().copied());
            }
        }
    }
    b
}

/// Runs `target` on `weight * iterations()` mutants of the seeds; a panic fails with the
/// input saved.
fn fuzz(name: &str, weight: usize, seeds: &[Vec<u8>], target: impl Fn(&[u8])) {
    for s in seeds {
        target(s);
    }
    let mut r = Rng::new(base_seed() ^ name.len() as u64);
    let started = std::time::Instant::now();
    let n = weight * iterations();
    for i in 0..n {
        let a = &seeds[r.below(seeds.len())];
        let b = &seeds[r.below(seeds.len())];
        let input = mutate(a, b, &mut r);
        if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target")
                .join(format!("fuzz-crash-{name}-{i}.bin"));
            let _ = std::fs::write(&path, &input);
            panic!("{name}: iteration {i} panicked; input written to {}", path.display());
        }
    }
    eprintln!("fuzz {name}: {n} inputs in {:.1} s", started.elapsed().as_secs_f64());
}

/// A small llama GGUF with a tokenizer: `heads` query heads, `kv` KV heads, head_dim 8.
fn model_seed(heads: usize, kv: usize) -> Vec<u8> {
    let (hd, vocab, ffn) = (8usize, 8usize, 4usize);
    let (dim, kvd) = (heads * hd, kv * hd);
    let mut r = Rng::new(3);
    let mut t = |name: &str, dims: &[usize]| {
        let n: usize = dims.iter().product();
        let data = (0..n).map(|_| 0.1 * r.normal() + if dims.len() == 1 { 1.0 } else { 0.0 }).collect();
        (name.to_string(), dims.iter().map(|&d| d as u64).collect(), data)
    };
    let tensors = vec![
        t("token_embd.weight", &[dim, vocab]),
        t("output_norm.weight", &[dim]),
        t("blk.0.attn_norm.weight", &[dim]),
        t("blk.0.attn_q.weight", &[dim, dim]),
        t("blk.0.attn_k.weight", &[dim, kvd]),
        t("blk.0.attn_v.weight", &[dim, kvd]),
        t("blk.0.attn_output.weight", &[dim, dim]),
        t("blk.0.ffn_norm.weight", &[dim]),
        t("blk.0.ffn_gate.weight", &[dim, ffn]),
        t("blk.0.ffn_up.weight", &[dim, ffn]),
        t("blk.0.ffn_down.weight", &[ffn, dim]),
    ];
    let tokens: Vec<String> = ["a", "b", "c", " ", "ab", "abc", "1", "2"].map(String::from).to_vec();
    let meta = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.embedding_length", Meta::U32(dim as u32)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.attention.head_count", Meta::U32(heads as u32)),
        ("llama.attention.head_count_kv", Meta::U32(kv as u32)),
        ("llama.feed_forward_length", Meta::U32(ffn as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("smollm".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.merges", Meta::Strs(vec!["a b".into(), "ab c".into()])),
    ];
    gguf_bytes(&meta, &tensors)
}

#[test]
fn fuzz_gguf_reader_tokenizer_and_model_load() {
    let seeds = vec![model_seed(2, 1), model_seed(2, 2), model_seed(4, 2)];
    // The seeds load, tokenize and run.
    for s in &seeds {
        let g = Gguf::parse(s.clone()).unwrap();
        Llama::from_gguf(&g).unwrap();
        Tokenizer::from_gguf(&g).unwrap();
    }
    fuzz("gguf", 10, &seeds, |bytes| {
        let Ok(g) = Gguf::parse(bytes.to_vec()) else { return };
        if let Ok(tok) = Tokenizer::from_gguf(&g)
            && let Ok(ids) = tok.encode("abc ab 12 cab")
        {
            let _ = tok.decode(&ids);
        }
        if let Ok(m) = Llama::from_gguf(&g) {
            // A forward pass over whatever loaded (its sizes come from tensors that fit
            // the file): 3 tokens inside the vocabulary.
            let tokens = [0u32, 1, 2];
            let rows: Vec<Row> = (0..3).map(|p| Row { seq: 0, pos: p }).collect();
            let _ = m.forward(&tokens, &rows, &mut ExactAttention::new(&m.config), None, 1);
        }
    });
}

#[test]
fn fuzz_calibration_reader() {
    let plain = Calibration {
        layers: vec![LayerCalibration::identity(2, 64); 2],
        kv_heads: 2,
        head_dim: 64,
        metadata: [("model".to_string(), "fuzz".to_string())].into(),
    };
    let mut shuffled = plain.clone();
    let mut r = Rng::new(9);
    for l in &mut shuffled.layers {
        for (i, m) in l.key_mean.iter_mut().enumerate() {
            *m = r.normal() * (i % 7) as f32;
        }
        l.key_perm[..64].reverse();
        l.value_perm[64..].reverse();
    }
    let mut rotated = plain.clone();
    rotated.layers.truncate(1);
    let mut identity_rot = vec![0f32; 2 * 64 * 64];
    for h in 0..2 {
        for c in 0..64 {
            identity_rot[(h * 64 + c) * 64 + c] = 1.0;
        }
    }
    rotated.layers[0].key_rotation = Some(identity_rot.clone());
    rotated.layers[0].value_rotation = Some(identity_rot);
    let seeds: Vec<Vec<u8>> = [plain, shuffled, rotated].iter().map(|c| c.to_safetensors().unwrap()).collect();
    for s in &seeds {
        Calibration::from_safetensors(s).unwrap();
    }
    fuzz("calibration", 1, &seeds, |bytes| {
        if let Ok(c) = Calibration::from_safetensors(bytes) {
            for l in &c.layers {
                let _ = l.validate(c.kv_heads, c.head_dim);
                let _ = l.check_orthogonal(c.kv_heads, c.head_dim);
            }
        }
    });
}
