//! Mutation fuzzing on stable Rust in the ordinary test suite, of the same four targets
//! cargo-fuzz runs (`fuzz/`, `cargo xtask fuzz`): what one input does is in
//! `tests/src/fuzz_harness.rs`, included here and by `fuzz/fuzz_targets/*.rs`. The GGUF
//! reader (with the tokenizer and the llama loader and a short forward pass on whatever
//! loads), the calibration-file reader, pools and side stores through the paged decode,
//! and `KvCache` operation sequences against the reference. Each target mutates seed
//! files (bit flips, interesting integers at random offsets, truncation, chunk
//! duplication and deletion, splices of two seeds) with a fixed seed and a fixed number
//! of iterations, so a run is reproducible; any panic fails the test, names the
//! iteration and writes the input to `target/fuzz-crash-<target>-<iteration>.bin`.
//!
//! Budgets: `ROTKV_FUZZ_ITERS` (default 3,000) mutants of the calibration files and ten
//! times as many GGUF files (about 35 µs each against 600 µs), and a tenth as many pools
//! and operation sequences: a few seconds in the test suite. `cargo xtask ci` sets
//! 20,000 (see docs/src/reliability.md). `ROTKV_FUZZ_SEED` picks another mutation stream.
//!
//! The seeds are also cargo-fuzz's committed corpus (`fuzz/corpus/<target>/`):
//! `seed_corpus_is_committed` checks the files equal the seeds built here, and
//! `ROTKV_WRITE_FUZZ_CORPUS=1 cargo test -p rotkv-tests --test fuzz seed_corpus` rewrites
//! them.

#[path = "../src/fuzz_harness.rs"]
mod harness;

use rotkv::LayerCalibration;
use rotkv::model::calibrate::Calibration;
use rotkv::model::gguf::Gguf;
use rotkv::model::llama::Llama;
use rotkv::model::tokenizer::Tokenizer;
use rotkv_tests::Rng;
use rotkv_tests::gguf_writer::{gguf_bytes, tiny_llama, tiny_tokenizer};
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

/// Runs `target` on `weight * iterations()` mutants (`weight` in tenths) of the seeds; a panic fails with the
/// input saved.
fn fuzz(name: &str, weight: usize, seeds: &[Vec<u8>], target: impl Fn(&[u8])) {
    for s in seeds {
        target(s);
    }
    let mut r = Rng::new(base_seed() ^ name.len() as u64);
    let started = std::time::Instant::now();
    let n = weight * iterations() / 10;
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
    let (mut meta, tensors) = tiny_llama(heads, kv, 8, 3);
    meta.extend(tiny_tokenizer());
    gguf_bytes(&meta, &tensors)
}

/// The GGUF seeds: small llama models with a tokenizer.
fn gguf_seeds() -> Vec<Vec<u8>> {
    vec![model_seed(2, 1), model_seed(2, 2), model_seed(4, 2)]
}

/// The calibration seeds: identity, shuffled and (`with_rotations`) learned-rotation
/// files. The rotation seed (64 KB) stays out of the committed corpus.
fn calibration_seeds(with_rotations: bool) -> Vec<Vec<u8>> {
    let plain = Calibration {
        layers: vec![LayerCalibration::identity(2, 64); 2],
        kv_heads: 2,
        head_dim: 64,
        metadata: [("model".to_string(), "fuzz".to_string())].into(),
        key_smoothing: Default::default(),
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
    let mut files = vec![plain.clone(), shuffled];
    if with_rotations {
        let mut rotated = plain;
        rotated.layers.truncate(1);
        let mut identity_rot = vec![0f32; 2 * 64 * 64];
        for h in 0..2 {
            for c in 0..64 {
                identity_rot[(h * 64 + c) * 64 + c] = 1.0;
            }
        }
        rotated.layers[0].key_rotation = Some(identity_rot.clone());
        rotated.layers[0].value_rotation = Some(identity_rot);
        files.push(rotated);
    }
    files.iter().map(|c| c.to_safetensors().unwrap()).collect()
}

/// Pool seeds (see `harness::pool` for the byte layout): `blocks` blocks of pseudo-random
/// bytes, sequences whose lengths and tables fit them, small queries.
fn pool_seed(config: u8, heads: u8, blocks: u8, seqs: &[(u8, &[u8])], opts: u8, seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed);
    let mut bytes = vec![config, heads, blocks];
    let cfg = harness::small_config(config);
    let hkv = 1 + (heads & 1) as usize;
    let shape = rotkv::paged::LayerShape { num_kv_heads: hkv, num_q_heads: hkv };
    let pool = rotkv::paged::pool_bytes(&cfg, &shape, blocks as usize).unwrap();
    // Codes of any value; f16 scales and zeros of modest size (the page's tail).
    bytes.extend((0..pool).map(|i| if i % 64 < 48 { r.below(256) as u8 } else { [0x00, 0x2c, 0x3c, 0xb8][i % 4] }));
    let side = rotkv::paged::side_elems(&cfg, &shape).unwrap();
    bytes.push(seqs.len() as u8);
    for &(len, table) in seqs {
        // Length one byte, table given in full with u8 entries, side store of the right size.
        bytes.extend([0x40 | 0x0c, len, table.len() as u8]);
        bytes.extend(table);
        bytes.extend((0..side).flat_map(|_| rotkv::f16::from_f32((r.below(33) as f32 - 16.0) / 8.0).to_le_bytes()));
        bytes.push(0);
    }
    bytes.push(opts);
    bytes.extend((0..seqs.len() * 4 * 64).map(|_| r.below(64) as u8));
    bytes
}

fn pool_seeds() -> Vec<Vec<u8>> {
    vec![
        pool_seed(0, 0, 2, &[(28, &[1, 0])], 0xff, 1),
        pool_seed(1, 2, 3, &[(40, &[2, 0]), (30, &[1])], 0x40, 2),
        pool_seed(5, 2, 4, &[(60, &[3, 2, 1, 0])], 0x80, 3),
    ]
}

/// Operation-sequence seeds (see `harness::paged_ops`): 8 bytes per operation, kind first.
fn ops_seeds() -> Vec<Vec<u8>> {
    let op = |kind: u8, a: u8, b: u8, c: u8, seed: u32| {
        let mut v = vec![kind, a, b, c];
        v.extend(seed.to_le_bytes());
        v
    };
    let add = || op(0, 0, 0, 0, 0);
    let mut grow = Vec::new();
    grow.extend(add());
    grow.extend(op(3, 0, 0, 20, 1));
    grow.extend(op(5, 0, 0, 22, 0));
    grow.extend(op(3, 0, 0, 30, 2));
    grow.extend(op(6, 0, 0, 0, 0));
    grow.extend(op(6, 0, 0, 0x08, 3));
    let mut two = Vec::new();
    two.extend(add());
    two.extend(add());
    two.extend(op(3, 0, 1, 39, 4));
    two.extend(op(3, 1, 1, 17, 5));
    two.extend(op(6, 0, 1, 1, 6));
    two.extend(op(2, 0, 0, 0, 0));
    two.extend(add());
    two.extend(op(3, 2, 1, 5, 7));
    two.extend(op(6, 1, 1, 0x09, 2));
    let mut errors = Vec::new();
    errors.extend(add());
    errors.extend(op(3, 0, 7, 4, 8));
    errors.extend(op(3, 0, 0, 0x64, 9));
    errors.extend(op(5, 0, 0, 0xff, 0));
    errors.extend(op(3, 0, 0, 0xc8, 10));
    errors.extend(op(6, 0, 0, 0x0c, 0));
    errors.extend(op(2, 0, 0, 0, 0));
    errors.extend(op(2, 0, 0, 0, 0));
    vec![grow, two, errors]
}

#[test]
fn fuzz_gguf_reader_tokenizer_and_model_load() {
    let seeds = gguf_seeds();
    // The seeds load, tokenize and run.
    for s in &seeds {
        let g = Gguf::parse(s.clone()).unwrap();
        Llama::from_gguf(&g).unwrap();
        Tokenizer::from_gguf(&g).unwrap();
    }
    fuzz("gguf", 100, &seeds, harness::gguf);
}

#[test]
fn fuzz_calibration_reader() {
    let seeds = calibration_seeds(true);
    for s in &seeds {
        Calibration::from_safetensors(s).unwrap();
    }
    fuzz("calibration", 10, &seeds, harness::calibration);
}

#[test]
fn fuzz_pools_and_side_stores_through_paged_decode() {
    let seeds = pool_seeds();
    for s in &seeds {
        assert!(harness::pool(s), "a pool seed does not decode");
    }
    fuzz("pool", 1, &seeds, |bytes| {
        harness::pool(bytes);
    });
}

#[test]
fn fuzz_cache_operation_sequences_against_the_reference() {
    fuzz("paged_ops", 1, &ops_seeds(), harness::paged_ops);
}

/// cargo-fuzz's committed corpus is these seeds (rewritten with
/// `ROTKV_WRITE_FUZZ_CORPUS=1`).
#[test]
fn seed_corpus_is_committed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    let write = std::env::var_os("ROTKV_WRITE_FUZZ_CORPUS").is_some();
    let targets = [
        ("gguf", gguf_seeds()),
        ("calibration", calibration_seeds(false)),
        ("pool", pool_seeds()),
        ("paged_ops", ops_seeds()),
    ];
    for (target, seeds) in targets {
        let dir = root.join(target);
        for (i, seed) in seeds.iter().enumerate() {
            let path = dir.join(format!("seed-{i}"));
            if write {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, seed).unwrap();
            } else {
                let committed = std::fs::read(&path)
                    .unwrap_or_else(|e| panic!("{}: {e} (ROTKV_WRITE_FUZZ_CORPUS=1 writes it)", path.display()));
                // A calibration file's metadata is a hash map whose order in the header
                // varies from run to run: those seeds compare as parsed.
                let same = &committed == seed
                    || target == "calibration"
                        && Calibration::from_safetensors(&committed).ok() == Calibration::from_safetensors(seed).ok();
                assert!(
                    same,
                    "{} differs from the seed built here (ROTKV_WRITE_FUZZ_CORPUS=1 rewrites it)",
                    path.display()
                );
            }
        }
    }
}
