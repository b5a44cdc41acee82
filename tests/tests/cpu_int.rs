//! The CPU backend's integer key path ([`KeyScores::Int8`]) against the f64 reference:
//! the error it adds to decode outputs, next to the exact f32 path's, on random data of
//! awkward sizes and on the real SmolLM2 tile. (The score error itself is stated and
//! bounded in `host/src/backend/cpu/`, `int_key_scores_error_against_f64`.)

use rotkv::eval::Tile;
use rotkv::paged::{self, DecodeOptions, KeyScores, LayerShape};
use rotkv::{Backend, CacheConfig};
use rotkv_tests::{Data, Store, rel_err, repo_data, rows, shared_data, small_config};

/// Decode of the last `q` row with the CPU backend's given key path.
fn decode_cpu(st: &Store, q: &[f32], key_scores: KeyScores) -> Vec<f32> {
    let mut out = vec![0f32; q.len()];
    let options = DecodeOptions { key_scores, ..DecodeOptions::default() };
    paged::decode(Backend::Cpu, &st.config, &st.calib, &st.shape, st.pool.bytes(), &[st.seq()], q, &mut out, options)
        .unwrap();
    out
}

/// `[exact, int8, int8x2]` errors of the CPU decode against the reference on the same
/// bytes (appended by the reference backend).
fn errors(config: CacheConfig, shape: LayerShape, k: &[f32], v: &[f32], q: &[f32]) -> [f64; 3] {
    let len = k.len() / (shape.num_kv_heads * config.head_dim);
    let mut st = Store::new(config, shape, len, Some(7));
    st.append(Backend::Reference, k, v).unwrap();
    let want = st.decode(Backend::Reference, q, None).unwrap();
    [KeyScores::Exact, KeyScores::Int8, KeyScores::Int8x2].map(|keys| rel_err(&decode_cpu(&st, q, keys), &want))
}

/// Bounds. Exact: 5e-5 (f32 accumulation against f64, the conformance suite's
/// `DECODE_TOL`). Int8: the query's int8 rounding moves the logits by 0.6-2.6% of their
/// norm (see the score test), a softmax weight by about that factor, so the outputs
/// (weighted means of values) move by about 1e-2; keys with huge outliers (+-2000) make
/// logits of thousands, where that relative error is several logits: up to 4.6e-2
/// measured on random data, bounded at 8e-2; on the real tile up to 1.2e-2, bounded at
/// 2e-2. Int8x2 (two int8 terms, 254 times finer): up to 5.9e-4 on random data (huge
/// outliers again; 4e-5 without), bounded at 1.5e-3, and up to 4.1e-5 on the tile,
/// bounded at 2e-4.
const EXACT_TOL: f64 = 5e-5;
const INT8_TOL_RANDOM: f64 = 8e-2;
const INT8_TOL_TILE: f64 = 2e-2;
const INT8X2_TOL_RANDOM: f64 = 1.5e-3;
const INT8X2_TOL_TILE: f64 = 2e-4;

#[test]
fn int8_keys_error_on_random_data() {
    let mut worst = [0f64; 3];
    for (config, hkv, g) in [
        (CacheConfig::k2v2(64), 3, 3),
        (CacheConfig { group_size: 32, ..CacheConfig::k4v2(128) }, 2, 4),
        (small_config(64, 2, 2, 32), 1, 3),
        (small_config(256, 4, 2, 128), 1, 2),
        (small_config(128, 2, 4, 64), 2, 1),
    ] {
        let d = config.head_dim;
        let page = config.page_size;
        // 1 token, one past a page boundary after sinks and window, and a longer context.
        for len in [1, config.sinks + config.window + page + 1, 700] {
            for data in [Data::Keys, Data::ConstantGroups, Data::HugeOutliers] {
                let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hkv * g };
                let k = rows(data, len * hkv, d, 1 + len as u64);
                let v = rows(Data::Normal, len * hkv, d, 2 + len as u64);
                let q = rows(Data::Normal, hkv * g, d, 3);
                let [e32, e8, e16] = errors(config, shape, &k, &v, &q);
                eprintln!(
                    "d{d} k{} g{} len {len} {data:?}: exact {e32:.2e}, int8 {e8:.2e}, int8x2 {e16:.2e}",
                    config.key_bits, config.group_size
                );
                assert!(e32 < EXACT_TOL, "exact: {e32}");
                assert!(e8 < INT8_TOL_RANDOM, "int8: {e8}");
                assert!(e16 < INT8X2_TOL_RANDOM, "int8x2: {e16}");
                worst = [worst[0].max(e32), worst[1].max(e8), worst[2].max(e16)];
            }
        }
    }
    eprintln!(
        "random data, largest output error: exact {:.2e}, int8 {:.2e}, int8x2 {:.2e}",
        worst[0], worst[1], worst[2]
    );
}

#[test]
fn int8_keys_error_on_the_real_tile() {
    let mut files = vec![repo_data().join("smollm2-alice-kv-l0-l5.safetensors")];
    match shared_data() {
        Some(dir) => files.push(dir.join("smollm2-alice-kv.safetensors")),
        None => {
            eprintln!("SKIPPED: ../shared/data/smollm2-alice-kv.safetensors not found (layers 15 and 29 unchecked)")
        }
    }
    for file in files {
        let tile = Tile::load(&file).unwrap();
        for layer in &tile.layers {
            let (hkv, hq, d) = (layer.num_kv_heads, layer.num_q_heads, layer.head_dim);
            let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
            for config in [CacheConfig::k2v2(d), CacheConfig::k4v2(d)] {
                for len in [333, layer.tokens.min(1024)] {
                    let (k, v) = (&layer.k[..len * hkv * d], &layer.v[..len * hkv * d]);
                    // The tile's softmax scale is 1 / sqrt(d), decode's default.
                    assert_eq!(tile.attn_scaling, 1.0 / (d as f64).sqrt());
                    let q = &layer.q[(len - 1) * hq * d..len * hq * d];
                    let [e32, e8, e16] = errors(config, shape, k, v, q);
                    eprintln!(
                        "tile layer {} k{} len {len}: exact {e32:.2e}, int8 {e8:.2e}, int8x2 {e16:.2e}",
                        layer.layer, config.key_bits
                    );
                    assert!(e32 < EXACT_TOL, "exact: {e32}");
                    assert!(e8 < INT8_TOL_TILE, "int8: {e8}");
                    assert!(e16 < INT8X2_TOL_TILE, "int8x2: {e16}");
                }
            }
        }
    }
}
