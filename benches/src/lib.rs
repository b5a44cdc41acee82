//! Shared helpers of the rotkv benchmarks: deterministic synthetic KV rows, the decode
//! benchmarks' shapes and caches, and the append benchmarks' input and warm caches
//! (criterion's `benches/cpu.rs` and the best-of-N `cpu_decode_best` and
//! `cpu_append_best` binaries read the same data).

use rotkv::{Backend, CacheConfig, CacheShape, KvCache, SeqId};

/// A decode benchmark shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Name in the benchmark id.
    pub name: &'static str,
    /// KV heads.
    pub hkv: usize,
    /// Query heads.
    pub hq: usize,
    /// Head dimension.
    pub d: usize,
}

/// `rows` rows of `d` values with a fixed seed: roughly normal values plus one large
/// outlier channel per row (as real keys have), never all zero.
pub fn synthetic_rows(rows: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut out = Vec::with_capacity(rows * d);
    for _ in 0..rows {
        for c in 0..d {
            let u = (next() + next() + next() + next() - 2.0) * 1.7;
            out.push(if c == 5 { u + 8.0 } else { u });
        }
    }
    out
}

/// The bytes of an f16 slice.
pub fn as_bytes(x: &[half::f16]) -> &[u8] {
    // f16 is two plain bytes; half's bytemuck feature provides the Pod impl.
    bytemuck::cast_slice(x)
}

/// Sequences per decode step in the decode benchmarks.
pub const BATCH: usize = 8;

/// The decode benchmarks' shapes: SmolLM2-135M's attention (3 KV heads, 9 query heads,
/// head_dim 64) and Llama-3-8B's (8, 32, 128).
pub const DECODE_SHAPES: [Shape; 2] =
    [Shape { name: "d64_smollm2", hkv: 3, hq: 9, d: 64 }, Shape { name: "d128_llama8b", hkv: 8, hq: 32, d: 128 }];

/// A one-layer cache of `config` (cpu backend) holding [`BATCH`] sequences of `ctx`
/// synthetic tokens each: the decode benchmarks' input.
pub fn filled_cache(config: CacheConfig, shape: Shape, ctx: usize) -> (KvCache, Vec<SeqId>) {
    let cshape = CacheShape {
        layers: 1,
        num_kv_heads: shape.hkv,
        num_q_heads: shape.hq,
        max_seqs: BATCH,
        max_tokens: ctx,
        num_blocks: None,
    };
    let mut cache = KvCache::new(config, cshape, Backend::Cpu).expect("cache");
    let seqs = (0..BATCH)
        .map(|b| {
            let s = cache.add_sequence().expect("slot");
            let k = synthetic_rows(ctx * shape.hkv, shape.d, 1 + b as u64);
            let v = synthetic_rows(ctx * shape.hkv, shape.d, 1000 + b as u64);
            cache.append(0, s, ctx, &k, &v).expect("append");
            s
        })
        .collect();
    (cache, seqs)
}

/// The same tokens as [`filled_cache`]'s in plain f16, laid out `[seq][kv_head][ctx][d]`
/// (K, then V) for `rotkv::cpu::decode_f16_baseline`.
pub fn f16_cache(shape: Shape, ctx: usize) -> (Vec<half::f16>, Vec<half::f16>) {
    let (hkv, d) = (shape.hkv, shape.d);
    let mut k16 = vec![half::f16::ZERO; BATCH * hkv * ctx * d];
    let mut v16 = k16.clone();
    for b in 0..BATCH {
        let k = synthetic_rows(ctx * hkv, d, 1 + b as u64);
        let v = synthetic_rows(ctx * hkv, d, 1000 + b as u64);
        for (i, (kk, vv)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let (t, h) = (i / hkv, i % hkv);
            let at = ((b * hkv + h) * ctx + t) * d;
            k16[at..at + d].iter_mut().zip(kk).for_each(|(o, x)| *o = half::f16::from_f32(*x));
            v16[at..at + d].iter_mut().zip(vv).for_each(|(o, x)| *o = half::f16::from_f32(*x));
        }
    }
    (k16, v16)
}

/// The append benchmarks' input: `tokens` new tokens of `hkv` KV heads of `d` channels,
/// keys and values in f32 and the same values rounded to f16.
pub struct AppendInput {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub k16: Vec<half::f16>,
    pub v16: Vec<half::f16>,
}

impl AppendInput {
    /// The synthetic rows of the append benchmarks.
    pub fn new(tokens: usize, hkv: usize, d: usize) -> Self {
        let k = synthetic_rows(tokens * hkv, d, 5);
        let v = synthetic_rows(tokens * hkv, d, 6);
        let to16 = |x: &[f32]| x.iter().map(|&x| half::f16::from_f32(x)).collect();
        AppendInput { k16: to16(&k), v16: to16(&v), k, v }
    }
}

/// A one-layer, one-sequence cache of `config` (cpu backend, `hkv` KV heads, room for
/// `tokens`) whose pool was written once before, as in a serving stack's steady state (no
/// first-touch page faults in a timed loop): a sequence added, `input` appended, the
/// sequence freed.
pub fn warm_append_cache(
    config: CacheConfig,
    hkv: usize,
    tokens: usize,
    calib: Option<&rotkv::LayerCalibration>,
    input: &AppendInput,
) -> KvCache {
    let shape = CacheShape {
        layers: 1,
        num_kv_heads: hkv,
        num_q_heads: hkv,
        max_seqs: 1,
        max_tokens: tokens,
        num_blocks: None,
    };
    let mut cache = KvCache::new(config, shape, Backend::Cpu).expect("cache");
    if let Some(c) = calib {
        cache.set_calibration(0, c.clone()).expect("calibration");
    }
    let s = cache.add_sequence().expect("slot");
    cache.append(0, s, tokens, &input.k, &input.v).expect("append");
    cache.free_sequence(s).expect("free");
    cache
}

/// One timed append of the benchmarks: a sequence added to `cache`, `input` appended (its
/// f16 or its f32 rows), the sequence freed again.
pub fn append_prefill(cache: &mut KvCache, tokens: usize, input: &AppendInput, f16_input: bool) {
    let s = cache.add_sequence().expect("slot");
    if f16_input {
        cache.append(0, s, tokens, std::hint::black_box(&input.k16), std::hint::black_box(&input.v16))
    } else {
        cache.append(0, s, tokens, std::hint::black_box(&input.k), std::hint::black_box(&input.v))
    }
    .expect("append");
    cache.free_sequence(s).expect("free");
}
