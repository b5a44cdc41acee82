//! Shared helpers of the rotkv conformance suite: seeded inputs, a single-sequence paged
//! store, and the comparisons the suite states its tolerances with.

use rotkv::paged::{self, DecodeOptions, LayerShape};
use rotkv::reference::SeqRef;
use rotkv::{Backend, CacheConfig, LayerCalibration, Result, f16};

/// A small deterministic generator (xorshift64*), so every input has a fixed seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32) / (1u64 << 24) as f32
    }
    /// Roughly standard normal (sum of four uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        (self.uniform() + self.uniform() + self.uniform() + self.uniform() - 2.0) * 1.732
    }
    /// An integer in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f32) as usize % n.max(1)
    }
}

/// What the synthetic rows look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Data {
    /// Normal values with a per-channel bias and one outlier channel (key-like).
    Keys,
    /// Normal values, no structure.
    Normal,
    /// Every row identical.
    AllEqual,
    /// Rows whose channels are piecewise constant over 32-channel runs (constant groups).
    ConstantGroups,
    /// Normal values plus a few huge outliers (up to 2000).
    HugeOutliers,
}

/// `rows` rows of `d` f32 values.
pub fn rows(data: Data, rows: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let bias: Vec<f32> = (0..d).map(|c| if c % 17 == 3 { 4.0 } else { 0.3 * r.normal() }).collect();
    let first: Vec<f32> = (0..d).map(|_| r.normal()).collect();
    let mut out = Vec::with_capacity(rows * d);
    for _ in 0..rows {
        let consts: Vec<f32> = (0..d / 32).map(|_| (r.normal() * 8.0).round() / 8.0).collect();
        for c in 0..d {
            out.push(match data {
                Data::Keys => bias[c] + r.normal() + if c == 7 { 12.0 } else { 0.0 },
                Data::Normal => r.normal(),
                Data::AllEqual => first[c],
                Data::ConstantGroups => consts[c / 32],
                Data::HugeOutliers => {
                    if r.below(97) == 0 {
                        (r.normal().signum()) * 2000.0
                    } else {
                        r.normal()
                    }
                }
            });
        }
    }
    out
}

/// `n` values uniform in `[-2, 2)` from an xorshift generator seeded with `seed`: the
/// K/V/query rows of the device tests.
pub fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0) as f32
        })
        .collect()
}

/// `||a - b|| / ||b||` in f64.
/// FNV-1a (64-bit) of token ids as little-endian u32 bytes (the tokenizer tests compare
/// whole texts' ids with `tests/scripts/gguf_tokenizer_reference.py` by it).
pub fn fnv_ids(ids: &[u32]) -> u64 {
    ids.iter()
        .flat_map(|t| t.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// One sequence of one layer in caller-owned buffers (identity block table unless
/// shuffled), for driving the low-level API.
#[derive(Clone, Debug, PartialEq)]
pub struct Store {
    /// The cache configuration.
    pub config: CacheConfig,
    /// Heads.
    pub shape: LayerShape,
    /// Calibration.
    pub calib: LayerCalibration,
    /// Page pool.
    pub pool: paged::PoolBuffer,
    /// Side store.
    pub side: Vec<f16>,
    /// Block table.
    pub table: Vec<u32>,
    /// Protected positions (ascending).
    pub protected: Vec<u32>,
    /// Tokens held.
    pub len: usize,
}

impl Store {
    /// Room for `capacity` tokens; with `shuffle_seed` the block table is a random
    /// permutation of a pool with 3 spare blocks, so pages are not in order.
    pub fn new(config: CacheConfig, shape: LayerShape, capacity: usize, shuffle_seed: Option<u64>) -> Self {
        let blocks = paged::blocks_for(&config, capacity).expect("config");
        let spare = if shuffle_seed.is_some() { 3 } else { 0 };
        let mut table: Vec<u32> = (0..(blocks + spare) as u32).collect();
        if let Some(seed) = shuffle_seed {
            let mut r = Rng::new(seed);
            for i in (1..table.len()).rev() {
                table.swap(i, r.below(i + 1));
            }
        }
        table.truncate(blocks);
        let calib = LayerCalibration::identity(shape.num_kv_heads, config.head_dim);
        Self {
            pool: paged::PoolBuffer::new(paged::pool_bytes(&config, &shape, blocks + spare).expect("config")),
            side: vec![f16::ZERO; paged::side_elems(&config, &shape).expect("config")],
            config,
            shape,
            calib,
            table,
            protected: Vec::new(),
            len: 0,
        }
    }

    /// Extends the protected positions by `more` ([`paged::protect`]).
    pub fn protect(&mut self, more: &[u32]) -> Result<()> {
        let new: Vec<u32> = self.protected.iter().chain(more).copied().collect();
        paged::protect(&self.config, &self.shape, &mut self.side, self.len, &self.protected, &new)?;
        self.protected = new;
        Ok(())
    }

    /// Appends `k`, `v` (`[tokens][kv_heads][d]`).
    pub fn append(&mut self, backend: Backend, k: &[f32], v: &[f32]) -> Result<()> {
        let tokens = k.len() / (self.shape.num_kv_heads * self.config.head_dim);
        self.len = paged::append(
            backend,
            &self.config,
            &self.calib,
            &self.shape,
            self.pool.bytes_mut(),
            &self.table,
            &mut self.side,
            &self.protected,
            self.len,
            tokens,
            k,
            v,
        )?;
        Ok(())
    }

    /// The sequence as decode sees it.
    pub fn seq(&self) -> SeqRef<'_> {
        SeqRef { block_table: &self.table, side: &self.side, len: self.len, protected: &self.protected }
    }

    /// Decodes one query (`[q_heads][d]`).
    pub fn decode(&self, backend: Backend, q: &[f32], splits: Option<u32>) -> Result<Vec<f32>> {
        self.decode_rows(backend, q, 1, splits)
    }

    /// Decodes the last `q_len` tokens (`q` is `[q_len][q_heads][d]`, as is the result).
    pub fn decode_rows(&self, backend: Backend, q: &[f32], q_len: usize, splits: Option<u32>) -> Result<Vec<f32>> {
        let mut out = vec![0f32; q.len()];
        paged::decode(
            backend,
            &self.config,
            &self.calib,
            &self.shape,
            self.pool.bytes(),
            &[self.seq()],
            q,
            &mut out,
            DecodeOptions { num_splits: splits, q_len, ..DecodeOptions::default() },
        )?;
        Ok(out)
    }
}

/// A small config for a supported `(head_dim, key_bits, value_bits, group)`: 16-token
/// pages, 3 sinks, a 32-token window, Hadamard on both.
pub fn small_config(d: u32, kb: u32, vb: u32, g: u32) -> CacheConfig {
    CacheConfig {
        head_dim: d as usize,
        key_bits: kb,
        value_bits: vb,
        group_size: g as usize,
        page_size: 16,
        sinks: 3,
        window: 32,
        ..CacheConfig::k2v2(d as usize)
    }
}

/// A calibration with a non-zero key mean, key scales (smoothing) spread over 0.5 to 2
/// (SmolLM2's calibrated scales at alpha 0.5 span 0.5 to 1.6; a wider spread raises the
/// tensor-core kernel's f16 query error, which grows with `|q s| |k / s|`, past the
/// suite's tolerances) and random permutations.
pub fn random_calibration(hkv: usize, d: usize, seed: u64) -> LayerCalibration {
    let mut r = Rng::new(seed);
    let mut c = LayerCalibration::identity(hkv, d);
    c.key_mean.iter_mut().for_each(|m| *m = r.normal() * 0.5);
    c.key_scale.iter_mut().for_each(|s| *s = (r.normal() * 0.35).clamp(-0.69, 0.69).exp());
    for perm in [&mut c.key_perm, &mut c.value_perm] {
        for p in perm.chunks_exact_mut(d) {
            for i in (1..d).rev() {
                p.swap(i, r.below(i + 1));
            }
        }
    }
    c
}

/// A random orthogonal `d x d` matrix (row-major, f32): Gram-Schmidt in f64 on a seeded
/// normal matrix, orthogonal to f32 rounding.
pub fn random_rotation(d: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let mut rows: Vec<Vec<f64>> = Vec::with_capacity(d);
    while rows.len() < d {
        let mut v: Vec<f64> = (0..d).map(|_| r.normal() as f64).collect();
        for _ in 0..2 {
            for u in &rows {
                let p: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(u).for_each(|(a, b)| *a -= p * b);
            }
        }
        let n = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        if n > 1e-6 {
            rows.push(v.into_iter().map(|a| a / n).collect());
        }
    }
    rows.into_iter().flatten().map(|a| a as f32).collect()
}

/// [`random_calibration`] plus random orthogonal key and value rotations per KV head
/// (the shape of OptR's learned rotations).
pub fn learned_calibration(hkv: usize, d: usize, seed: u64) -> LayerCalibration {
    let mut c = random_calibration(hkv, d, seed);
    c.key_rotation = Some((0..hkv).flat_map(|h| random_rotation(d, seed * 31 + h as u64)).collect());
    c.value_rotation = Some((0..hkv).flat_map(|h| random_rotation(d, seed * 37 + 1000 + h as u64)).collect());
    c
}

/// The backends this build has that can run here; prints `SKIPPED: <backend> (...)` for
/// each one that cannot (the cuda backend without a driver or a device), so a GPU test
/// never passes silently.
///
/// `ROTKV_TEST_BACKENDS` (a comma-separated list of backend names, e.g. `cuda`) keeps
/// only those: the GPU bundle runs the conformance suite on the GPU alone that way.
pub fn backends() -> Vec<Backend> {
    let only = std::env::var("ROTKV_TEST_BACKENDS").ok();
    Backend::all()
        .iter()
        .copied()
        .filter(|b| only.as_deref().is_none_or(|o| o.split(',').any(|n| n.trim() == b.name())))
        .filter(|b| {
            let ok = b.available();
            if !ok {
                eprintln!("SKIPPED: {} backend (no CUDA driver or device on this machine)", b.name());
            }
            ok
        })
        .collect()
}

/// Whether `backend` runs device kernels on the SIMT emulator (every GPU thread
/// emulated, one at a time: slow, so the suite gives it its smaller cases).
pub fn emulated(backend: Backend) -> bool {
    backend == Backend::Sim
}

/// Where the shared data directory of the workspace is, if present
/// (`../shared/data` beside the repository).
pub fn shared_data() -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data");
    p.join("smollm2-alice-kv.safetensors").exists().then_some(p)
}

/// The repository's `data/` directory (`ROTKV_REPO_DATA` overrides it, for test binaries
/// run away from the checkout, as the GPU bundle does).
pub fn repo_data() -> std::path::PathBuf {
    match std::env::var_os("ROTKV_REPO_DATA") {
        Some(dir) => dir.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data"),
    }
}

/// GGUF v3 files written by the tests (model harness and hostile-input tests).
pub mod gguf_writer {
    /// A metadata value.
    #[derive(Clone, Debug)]
    pub enum Meta {
        U32(u32),
        F32(f32),
        Bool(bool),
        Str(String),
        Strs(Vec<String>),
        F32s(Vec<f32>),
        I32s(Vec<i32>),
        /// An array of `n` booleans.
        Bools(u64),
    }

    /// A tensor to write: name, ggml dims (fastest first), f32 data.
    pub type Tensor = (String, Vec<u64>, Vec<f32>);

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    /// A GGUF v3 file of F32 tensors, each tensor's data at `offset_of(i, aligned
    /// offset)` from the data section (aligned to 32 bytes).
    pub fn gguf_bytes_at(meta: &[(&str, Meta)], tensors: &[Tensor], offset_of: &dyn Fn(usize, u64) -> u64) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        for (k, v) in meta {
            put_str(&mut out, k);
            match v {
                Meta::U32(x) => {
                    out.extend_from_slice(&4u32.to_le_bytes());
                    out.extend_from_slice(&x.to_le_bytes());
                }
                Meta::F32(x) => {
                    out.extend_from_slice(&6u32.to_le_bytes());
                    out.extend_from_slice(&x.to_le_bytes());
                }
                Meta::Bool(b) => {
                    out.extend_from_slice(&7u32.to_le_bytes());
                    out.push(*b as u8);
                }
                Meta::F32s(v) => {
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&6u32.to_le_bytes());
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
                Meta::I32s(v) => {
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&5u32.to_le_bytes());
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
                Meta::Str(s) => {
                    out.extend_from_slice(&8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Meta::Strs(v) => {
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&8u32.to_le_bytes());
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    v.iter().for_each(|s| put_str(&mut out, s));
                }
                Meta::Bools(n) => {
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&7u32.to_le_bytes());
                    out.extend_from_slice(&n.to_le_bytes());
                    out.resize(out.len() + *n as usize, 1);
                }
            }
        }
        let mut offset = 0u64;
        for (i, (name, dims, data)) in tensors.iter().enumerate() {
            put_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&offset_of(i, offset).to_le_bytes());
            offset += (data.len() as u64 * 4).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        for (_, _, data) in tensors {
            data.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            out.resize(out.len().div_ceil(32) * 32, 0);
        }
        out
    }

    /// [`gguf_bytes_at`] with every tensor at its aligned offset.
    pub fn gguf_bytes(meta: &[(&str, Meta)], tensors: &[Tensor]) -> Vec<u8> {
        gguf_bytes_at(meta, tensors, &|_, o| o)
    }

    /// A one-layer llama model: `heads` query heads and `kv_heads` KV heads of `head_dim`
    /// channels, vocabulary 8, MLP 4, small random weights from `seed` (norm weights
    /// near 1). No tokenizer: add [`tiny_tokenizer`] where one is needed.
    pub fn tiny_llama(
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        seed: u64,
    ) -> (Vec<(&'static str, Meta)>, Vec<Tensor>) {
        let (dim, kvd, ffn, vocab) = (heads * head_dim, kv_heads * head_dim, 4usize, 8usize);
        let mut r = crate::Rng::new(seed);
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
        let meta = vec![
            ("general.architecture", Meta::Str("llama".into())),
            ("llama.embedding_length", Meta::U32(dim as u32)),
            ("llama.block_count", Meta::U32(1)),
            ("llama.attention.head_count", Meta::U32(heads as u32)),
            ("llama.attention.head_count_kv", Meta::U32(kv_heads as u32)),
            ("llama.rope.dimension_count", Meta::U32(head_dim as u32)),
            ("llama.feed_forward_length", Meta::U32(ffn as u32)),
            ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ];
        (meta, tensors)
    }

    /// A GPT-2-style BPE tokenizer of [`tiny_llama`]'s 8 tokens (two merges).
    pub fn tiny_tokenizer() -> Vec<(&'static str, Meta)> {
        let tokens: Vec<String> = ["a", "b", "c", " ", "ab", "abc", "1", "2"].map(String::from).to_vec();
        vec![
            ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
            ("tokenizer.ggml.pre", Meta::Str("smollm".into())),
            ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
            ("tokenizer.ggml.merges", Meta::Strs(vec!["a b".into(), "ab c".into()])),
        ]
    }
}
