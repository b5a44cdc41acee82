//! A llama-family forward pass on the CPU (llama, qwen2, qwen3 and gemma3 GGUF files):
//! RMSNorm, RoPE, grouped-query attention through an [`Attention`] implementation (exact
//! f32, or the rotkv cache), SwiGLU MLP, tied or untied output. Per architecture: qwen2's
//! q, k, v biases (any file that has them); qwen3's per-head RMSNorm of q and k before
//! RoPE and its head_dim apart from `dim / heads` (`attention.key_length`); gemma3's
//! embeddings scaled by `sqrt(dim)`, per-head q/k RMSNorm, RMSNorms after the attention
//! and the MLP as well as before (llama.cpp's conversion stores Gemma's `1 + w` norm
//! gains with the 1 added, so every norm here multiplies by the stored gain), GeGLU (tanh
//! GELU), and sliding-window layers ([`SlidingWindow`]: five of every six layers attend
//! to the newest `attention.sliding_window` positions only, with RoPE base 10,000; the
//! rest attend to everything with `rope.freq_base` and the file's RoPE scaling, as
//! llama.cpp and Hugging Face run Gemma 3); llama-3's RoPE
//! frequency factors (the `rope_freqs.weight` tensor llama.cpp's conversion writes from
//! `rope_scaling` of type llama3: each frequency divided by its factor) and linear RoPE
//! scaling (`rope.scaling.type = linear`: positions divided by `rope.scaling.factor`).
//! Other RoPE scalings (yarn, longrope) are [`Error::Unsupported`].
//!
//! Weights are dequantized to f32 at load time and multiplied in f32. llama GGUF files
//! store the q and k rows permuted for ggml's interleaved RoPE (adjacent channel pairs);
//! they are un-permuted at load time, so q and k are in Hugging Face's channel order
//! (channel `i` rotates with `i + head_dim / 2`) everywhere in this crate. qwen2 files are
//! stored in that order already.

use super::gguf::Gguf;
use super::math::{Blocks, Matrix, Weight, geglu, matmul, rms_norm, rope, rope_table, swiglu};
use crate::error::{Error, Result};

/// Model hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `llama` or `qwen2`.
    pub arch: String,
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub dim: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Channels per head (queries, keys and values).
    pub head_dim: usize,
    /// MLP hidden size.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Sliding-window layers (gemma3); `None`: every layer attends to every position.
    pub sliding: Option<SlidingWindow>,
    /// Factor on the token embeddings entering the first layer (gemma3: `sqrt(dim)`; 1
    /// elsewhere). The tied output projection uses the unscaled embeddings.
    pub embed_scale: f32,
    /// The MLP's gated activation.
    pub act: Activation,
    /// Softmax scale of attention (`1 / sqrt(head_dim)` but for Gemma 3 27B, whose
    /// `query_pre_attn_scalar` is `dim / heads`).
    pub attn_scale: f32,
}

/// Which layers attend to a sliding window of positions, and their RoPE base.
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a query sees, itself included (Hugging Face's `sliding_window`; rotkv's
    /// `window_left` is one less).
    pub window: usize,
    /// Per layer, whether it slides (Gemma 3: all but every sixth, so layers 5, 11, 17,
    /// .. attend to every position).
    pub layers: Vec<bool>,
    /// RoPE base of the sliding layers (no RoPE scaling there).
    pub rope_theta: f32,
}

/// The gated activation of the MLP: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up` (llama, qwen2, qwen3).
    #[default]
    Silu,
    /// GeGLU with the tanh GELU: `gelu_tanh(gate) * up` (gemma3).
    GeluTanh,
}

/// How RoPE's frequencies or positions are scaled.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum RopeScaling {
    /// Plain RoPE.
    #[default]
    None,
    /// Every frequency divided by the factor, as positions divided by it
    /// (`rope.scaling.type = linear`).
    Linear(f32),
    /// Frequency `i` divided by factor `i` (`head_dim / 2` factors: llama-3's
    /// `rope_freqs.weight`).
    FreqFactors(Vec<f32>),
}

impl LlamaConfig {
    /// Query channels of a token: `heads * head_dim` (the hidden size for llama and
    /// qwen2; qwen3 may differ).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// `window_left` of `layer` (FlashInfer's: a query at position `q` sees `q -
    /// window_left ..= q`), `None` for a layer that sees every position.
    pub fn window_left(&self, layer: usize) -> Option<usize> {
        let s = self.sliding.as_ref()?;
        s.layers.get(layer).copied().unwrap_or(false).then(|| s.window.saturating_sub(1))
    }

    /// RoPE tables `(cos, sin)` of one position for `layer` (a sliding layer has its own
    /// base and no scaling).
    pub fn rope_table_of(&self, layer: usize, pos: usize) -> (Vec<f32>, Vec<f32>) {
        match (&self.sliding, self.window_left(layer)) {
            (Some(s), Some(_)) => rope_table(pos, self.head_dim, s.rope_theta, None),
            _ => self.rope_table(pos),
        }
    }

    /// RoPE tables `(cos, sin)` of one position, with this model's scaling (of the layers
    /// that attend to every position).
    pub fn rope_table(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        match &self.rope_scaling {
            RopeScaling::None => rope_table(pos, self.head_dim, self.rope_theta, None),
            // Hugging Face's linear scaling divides every inverse frequency by the factor.
            RopeScaling::Linear(f) => {
                rope_table(pos, self.head_dim, self.rope_theta, Some(&vec![*f; self.head_dim / 2]))
            }
            RopeScaling::FreqFactors(ff) => rope_table(pos, self.head_dim, self.rope_theta, Some(ff)),
        }
    }
}

/// One transformer layer's weights (`[out][in]` matrices).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// Attention RMSNorm gain.
    pub attn_norm: Vec<f32>,
    /// Query projection (rows in Hugging Face order).
    pub wq: Weight,
    /// Key projection (rows in Hugging Face order).
    pub wk: Weight,
    /// Value projection.
    pub wv: Weight,
    /// q, k, v biases (qwen2).
    pub bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMSNorm gains of q and k (`[head_dim]` each), applied before RoPE (qwen3,
    /// gemma3).
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// RMSNorm gains applied to the attention output and to the MLP output before each
    /// joins the residual stream (gemma3's post-norms).
    pub post_norms: Option<[Vec<f32>; 2]>,
    /// Attention output projection.
    pub wo: Weight,
    /// MLP RMSNorm gain.
    pub ffn_norm: Vec<f32>,
    /// Gate projection of the gated MLP.
    pub gate: Weight,
    /// Up projection of the gated MLP.
    pub up: Weight,
    /// MLP down projection.
    pub down: Weight,
}

/// A llama-family model: f32 arithmetic over weights held in f32 or as the GGUF stores them
/// ([`WeightStorage`]).
#[derive(Clone, Debug)]
pub struct Llama {
    /// Hyper-parameters.
    pub config: LlamaConfig,
    /// Token embeddings `[vocab][dim]`.
    pub embed: Weight,
    /// Layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm gain.
    pub norm: Vec<f32>,
    /// Output projection `[vocab][dim]`; `None`: tied to the embeddings.
    pub output: Option<Weight>,
}

/// One row of a forward batch: a token of sequence `seq` (an index the [`Attention`]
/// implementation understands) at position `pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Sequence index.
    pub seq: usize,
    /// Position of the token in its sequence.
    pub pos: usize,
}

/// Attention of a layer for a batch of rows: `q` is `[rows][heads][head_dim]` after RoPE,
/// `k` and `v` are `[rows][kv_heads][head_dim]` (k after RoPE); `out` is
/// `[rows][heads][head_dim]`. Each row attends to every earlier token of its sequence and
/// to itself; the implementation keeps the keys and values.
pub trait Attention {
    /// Attends and stores this batch's keys and values.
    fn attend(&mut self, layer: usize, rows: &[Row], q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()>;
}

/// What a layer computed for a batch, shown to an observer (capture): the layer's input
/// `hidden`, `q` post-RoPE, `k_pre` before RoPE, `k` post-RoPE, `v`; shapes as in
/// [`Attention::attend`].
#[derive(Debug)]
pub struct LayerActivations<'a> {
    /// The layer.
    pub layer: usize,
    /// The batch's rows.
    pub rows: &'a [Row],
    /// The residual stream entering the layer, `[rows][dim]` (before its RMSNorm).
    pub hidden: &'a [f32],
    /// Queries after RoPE.
    pub q: &'a [f32],
    /// Keys before RoPE.
    pub k_pre: &'a [f32],
    /// Keys after RoPE.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
}

/// Checks a model's head dimension for the forward pass: RoPE pairs channel `i` with
/// `i + head_dim / 2` and the llama row order is undone in pairs, so it must be even and
/// non-zero. Any such head_dim runs with [`ExactAttention`]; the rotkv cache
/// ([`CacheAttention`], calibration) needs 64, 128 or 256 ([`crate::config::check_head_dim`]).
pub fn check_model_head_dim(head_dim: usize) -> Result<()> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(Error::Unsupported(format!(
            "model head_dim {head_dim}: the forward pass needs an even, non-zero head_dim \
             (the rotkv cache: 64, 128 or 256)"
        )));
    }
    Ok(())
}

/// The llama q/k row order undone: GGUF row `2i + h2` of a head holds Hugging Face row
/// `h2 * d/2 + i`. Rows move whole, so blocks move as bytes.
fn hf_order(w: Weight, heads: usize) -> Weight {
    let d = w.rows() / heads;
    let src = |r: usize| {
        let (h, j) = (r / d, r % d);
        h * d + if j < d / 2 { 2 * j } else { 2 * (j - d / 2) + 1 }
    };
    match w {
        Weight::F32(m) => {
            let mut data = vec![0f32; m.data.len()];
            for (r, row) in data.chunks_exact_mut(m.cols).enumerate() {
                row.copy_from_slice(m.row(src(r)));
            }
            Weight::F32(Matrix { data, ..m })
        }
        Weight::Blocks(b) => Weight::Blocks(b.permute_rows(src)),
    }
}

/// How [`Llama::from_gguf_with`] keeps the weight matrices in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightStorage {
    /// Dequantized to f32 at load (4 bytes per weight).
    #[default]
    F32,
    /// As the file stores them (Q4_K: 4.5 bits per weight), dequantized a block of rows
    /// at a time inside each product. The products are bit-identical to [`Self::F32`]'s;
    /// they cost the dequantization of every weight row once per product.
    Quantized,
    /// `Quantized` when the f32 weights would take more than half of the memory available
    /// at load (`MemAvailable` of `/proc/meminfo`), `F32` otherwise or where that cannot
    /// be read.
    Auto,
}

impl WeightStorage {
    /// `f32`, `quantized` or `auto`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "f32" => Ok(Self::F32),
            "quantized" => Ok(Self::Quantized),
            "auto" => Ok(Self::Auto),
            other => Err(Error::Input(format!("weight storage {other:?} (f32, quantized or auto)"))),
        }
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

impl Llama {
    /// Loads a llama, qwen2, qwen3 or gemma3 model from a parsed GGUF file, every weight
    /// dequantized to f32.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        Self::from_gguf_with(g, WeightStorage::F32)
    }

    /// [`Self::from_gguf`] with the weight matrices kept as `storage` says (norm gains,
    /// biases and RoPE factors are always f32).
    pub fn from_gguf_with(g: &Gguf, storage: WeightStorage) -> Result<Self> {
        let storage = match storage {
            WeightStorage::Auto => {
                // Matrices of the types the reader knows (the others fail the load anyway).
                let f32_bytes = g
                    .tensors
                    .values()
                    .filter(|t| t.dims.len() >= 2 && super::gguf::block_geometry(t.kind).is_some())
                    .fold(0u64, |a, t| a.saturating_add(t.elements().saturating_mul(4)));
                match available_memory() {
                    Some(avail) if f32_bytes > avail / 2 => WeightStorage::Quantized,
                    _ => WeightStorage::F32,
                }
            }
            s => s,
        };
        let arch = g.get("general.architecture")?.as_str().unwrap_or("").to_string();
        if !["llama", "qwen2", "qwen3", "gemma3"].contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "architecture {arch:?} (llama, qwen2, qwen3 and gemma3 are supported)"
            )));
        }
        let gemma = arch == "gemma3";
        let u = |k: &str| g.get_u64(&format!("{arch}.{k}")).map(|v| v as usize);
        let (dim, layers, heads) = (u("embedding_length")?, u("block_count")?, u("attention.head_count")?);
        let kv_heads = u("attention.head_count_kv").unwrap_or(heads);
        let head_dim = u("attention.key_length").unwrap_or(dim / heads.max(1));
        let eps = g.get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))? as f32;
        let rope_theta = g.get_f64(&format!("{arch}.rope.freq_base")).unwrap_or(10000.0) as f32;
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) || heads.checked_mul(head_dim).is_none() {
            return Err(Error::Unsupported(format!(
                "{heads} heads, {kv_heads} KV heads, head_dim {head_dim}, dim {dim}"
            )));
        }
        for (key, what) in [("attention.value_length", "value head_dim"), ("rope.dimension_count", "RoPE dimensions")] {
            if let Ok(n) = u(key)
                && n != head_dim
            {
                return Err(Error::Unsupported(format!("{what} {n} apart from head_dim {head_dim} ({arch}.{key})")));
            }
        }
        check_model_head_dim(head_dim)?;
        let rope_scaling = match g.metadata.get(&format!("{arch}.rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => {
                let f = g.get_f64(&format!("{arch}.rope.scaling.factor"))? as f32;
                if !(f.is_finite() && f > 0.0) {
                    return Err(Error::Value(format!("{arch}.rope.scaling.factor {f}")));
                }
                if f == 1.0 { RopeScaling::None } else { RopeScaling::Linear(f) }
            }
            Some(other) => {
                return Err(Error::Unsupported(format!("RoPE scaling {other:?} (read: none, linear, llama3 factors)")));
            }
        };
        let rope_scaling = if g.tensors.contains_key("rope_freqs.weight") {
            if rope_scaling != RopeScaling::None {
                return Err(Error::Unsupported("rope_freqs.weight together with linear RoPE scaling".into()));
            }
            let (ff, dims) = g.tensor_f32("rope_freqs.weight")?;
            if dims != [head_dim as u64 / 2] {
                return Err(Error::Shape(format!("rope_freqs.weight is {dims:?}, expected [{}]", head_dim / 2)));
            }
            if ff.iter().any(|&f| !(f.is_finite() && f > 0.0)) {
                return Err(Error::Value("rope_freqs.weight holds a factor that is not positive".into()));
            }
            RopeScaling::FreqFactors(ff)
        } else {
            rope_scaling
        };
        // Gemma 3 as llama.cpp runs it: every sixth layer global, the others a sliding
        // window of `attention.sliding_window` positions with RoPE base 10,000 and no
        // scaling; queries scaled by `1 / sqrt(head_dim)`, except the 62-layer 27B model's
        // `1 / sqrt(dim / heads)` (its `query_pre_attn_scalar`).
        // `attention.sliding_window_pattern`, when present: a period `n` (layer `l` slides
        // unless `(l + 1) % n == 0`, llama.cpp's `set_swa_pattern`) or one bool per layer
        // (true: sliding), as llama.cpp's `get_key_or_arr` reads it.
        let sliding = if gemma {
            let window = u("attention.sliding_window")?;
            let key = format!("{arch}.attention.sliding_window_pattern");
            let flags: Vec<bool> = match g.metadata.get(&key) {
                None => (0..layers).map(|l| !(l + 1).is_multiple_of(6)).collect(),
                Some(v) => match (v.as_u64(), v.as_bool_array()) {
                    (Some(n), _) if n > 0 => (0..layers).map(|l| !(l as u64 + 1).is_multiple_of(n)).collect(),
                    (_, Some(b)) if b.len() == layers => b,
                    _ => {
                        return Err(Error::Unsupported(format!(
                            "{key} {v:?} (a positive period or one bool per layer is read)"
                        )));
                    }
                },
            };
            if window == 0 {
                return Err(Error::Unsupported("sliding window of 0 positions".into()));
            }
            Some(SlidingWindow { window, layers: flags, rope_theta: 10000.0 })
        } else {
            None
        };
        let attn_scale =
            if gemma && layers == 62 { 1.0 / ((dim / heads) as f32).sqrt() } else { 1.0 / (head_dim as f32).sqrt() };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
            let (kind, bytes, dims) = g.tensor_bytes(name)?;
            if dims != [cols as u64, rows as u64] {
                return Err(Error::Shape(format!("{name} is {dims:?}, expected [{cols}, {rows}]")));
            }
            // Whole blocks per row (as ggml requires) for both storages, so both accept the
            // same files.
            Blocks::row_bytes(kind, rows, cols, bytes.len()).map_err(|e| Error::Shape(format!("{name}: {e}")))?;
            // f32 tensors gain nothing from staying as stored.
            if storage == WeightStorage::Quantized && kind != 0 {
                return Ok(Weight::Blocks(Blocks::new(kind, rows, cols, bytes.to_vec())?));
            }
            Ok(Weight::F32(Matrix { rows, cols, data: super::gguf::dequantize(kind, bytes)? }))
        };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>> {
            let (data, dims) = g.tensor_f32(name)?;
            if dims != [n as u64] {
                return Err(Error::Shape(format!("{name} is {dims:?}, expected [{n}]")));
            }
            Ok(data)
        };
        let (_, _, embed_dims) = g.tensor_bytes("token_embd.weight")?;
        let vocab =
            *embed_dims.get(1).ok_or_else(|| Error::Shape("token_embd.weight is not a matrix".into()))? as usize;
        let embed = matrix("token_embd.weight", vocab, dim)?;
        let (kvd, qd) = (kv_heads * head_dim, heads * head_dim);
        let ffn = u("feed_forward_length")?;
        if dim == 0 || ffn == 0 || vocab == 0 {
            return Err(Error::Unsupported(format!(
                "embedding length {dim}, feed-forward length {ffn}, vocabulary {vocab}"
            )));
        }
        let llama = arch == "llama";
        let layers = (0..layers)
            .map(|l| {
                let n = |s: &str| format!("blk.{l}.{s}");
                let (mut wq, mut wk) = (matrix(&n("attn_q.weight"), qd, dim)?, matrix(&n("attn_k.weight"), kvd, dim)?);
                if llama {
                    wq = hf_order(wq, heads);
                    wk = hf_order(wk, kv_heads);
                }
                let bias = if g.tensors.contains_key(&n("attn_q.bias")) {
                    Some([
                        vector(&n("attn_q.bias"), qd)?,
                        vector(&n("attn_k.bias"), kvd)?,
                        vector(&n("attn_v.bias"), kvd)?,
                    ])
                } else {
                    None
                };
                let qk_norm = if arch == "qwen3" || gemma {
                    Some([vector(&n("attn_q_norm.weight"), head_dim)?, vector(&n("attn_k_norm.weight"), head_dim)?])
                } else {
                    None
                };
                let post_norms = if gemma {
                    Some([vector(&n("post_attention_norm.weight"), dim)?, vector(&n("post_ffw_norm.weight"), dim)?])
                } else {
                    None
                };
                Ok(LayerWeights {
                    attn_norm: vector(&n("attn_norm.weight"), dim)?,
                    wq,
                    wk,
                    wv: matrix(&n("attn_v.weight"), kvd, dim)?,
                    bias,
                    qk_norm,
                    post_norms,
                    wo: matrix(&n("attn_output.weight"), dim, qd)?,
                    ffn_norm: vector(&n("ffn_norm.weight"), dim)?,
                    gate: matrix(&n("ffn_gate.weight"), ffn, dim)?,
                    up: matrix(&n("ffn_up.weight"), ffn, dim)?,
                    down: matrix(&n("ffn_down.weight"), dim, ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let output =
            if g.tensors.contains_key("output.weight") { Some(matrix("output.weight", vocab, dim)?) } else { None };
        let config = LlamaConfig {
            arch,
            vocab,
            dim,
            layers: layers.len(),
            heads,
            kv_heads,
            head_dim,
            ffn,
            eps,
            rope_theta,
            rope_scaling,
            sliding,
            embed_scale: if gemma { (dim as f32).sqrt() } else { 1.0 },
            act: if gemma { Activation::GeluTanh } else { Activation::Silu },
            attn_scale,
        };
        Ok(Self { config, embed, layers, norm: vector("output_norm.weight", dim)?, output })
    }

    /// Runs the first `n_layers` layers on a batch of rows (one token each) and returns
    /// the hidden states `[rows][dim]`, after the final RMSNorm when all layers ran.
    /// `observe` sees each layer's q, k and v.
    pub fn forward(
        &self,
        tokens: &[u32],
        rows: &[Row],
        attn: &mut dyn Attention,
        mut observe: Option<&mut dyn FnMut(&LayerActivations<'_>)>,
        n_layers: usize,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        check_model_head_dim(c.head_dim)?;
        if c.heads == 0
            || c.kv_heads == 0
            || !c.heads.is_multiple_of(c.kv_heads)
            || c.heads.checked_mul(c.head_dim).is_none()
        {
            return Err(Error::Unsupported(format!(
                "{} heads, {} KV heads, head_dim {}, dim {}",
                c.heads, c.kv_heads, c.head_dim, c.dim
            )));
        }
        if let RopeScaling::FreqFactors(f) = &c.rope_scaling
            && f.len() != c.head_dim / 2
        {
            return Err(Error::Shape(format!("{} RoPE frequency factors for head_dim {}", f.len(), c.head_dim)));
        }
        for (what, x) in [("attention scale", c.attn_scale), ("embedding scale", c.embed_scale)] {
            if !(x.is_finite() && x > 0.0) {
                return Err(Error::Value(format!("{what} {x} must be finite and positive")));
            }
        }
        let n = rows.len();
        if tokens.len() != n {
            return Err(Error::Shape(format!("{} tokens for {n} rows", tokens.len())));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(Error::Value(format!("token {t} is outside the vocabulary of {}", c.vocab)));
        }
        let (d, kvd, qd) = (c.head_dim, c.kv_heads * c.head_dim, c.q_dim());
        let mut x = vec![0f32; n * c.dim];
        for (xr, &t) in x.chunks_exact_mut(c.dim).zip(tokens) {
            self.embed.row_into(t as usize, xr);
            xr.iter_mut().for_each(|e| *e *= c.embed_scale);
        }
        let mut h = vec![0f32; n * c.dim];
        let (mut q, mut k, mut v) = (vec![0f32; n * qd], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        let mut att = vec![0f32; n * qd];
        let (mut g, mut u) = (vec![0f32; n * c.ffn], vec![0f32; n * c.ffn]);
        // RoPE tables of the full-attention layers, and of the sliding ones when they differ.
        let tables: Vec<(Vec<f32>, Vec<f32>)> = rows.iter().map(|r| c.rope_table(r.pos)).collect();
        let sliding_tables: Vec<(Vec<f32>, Vec<f32>)> = match &c.sliding {
            Some(sw) => rows.iter().map(|r| rope_table(r.pos, c.head_dim, sw.rope_theta, None)).collect(),
            None => Vec::new(),
        };
        let mut post = vec![0f32; if self.layers.iter().any(|w| w.post_norms.is_some()) { n * c.dim } else { 0 }];
        for (l, w) in self.layers.iter().enumerate().take(n_layers) {
            let tables = if c.window_left(l).is_some() { &sliding_tables } else { &tables };
            rms_norm(&x, &w.attn_norm, c.eps, &mut h);
            matmul(&w.wq, &h, n, &mut q);
            matmul(&w.wk, &h, n, &mut k);
            matmul(&w.wv, &h, n, &mut v);
            if let Some([bq, bk, bv]) = &w.bias {
                for (dst, b) in [(&mut q, bq), (&mut k, bk), (&mut v, bv)] {
                    dst.chunks_exact_mut(b.len()).for_each(|r| r.iter_mut().zip(b).for_each(|(o, &bb)| *o += bb));
                }
            }
            if let Some([nq, nk]) = &w.qk_norm {
                // RMSNorm of each head's channels (rows of `head_dim`).
                let (q0, k0) = (q.clone(), k.clone());
                rms_norm(&q0, nq, c.eps, &mut q);
                rms_norm(&k0, nk, c.eps, &mut k);
            }
            let k_pre = if observe.is_some() { k.clone() } else { Vec::new() };
            for (r, (cos, sin)) in tables.iter().enumerate() {
                q[r * qd..(r + 1) * qd].chunks_exact_mut(d).for_each(|hd| rope(hd, cos, sin));
                k[r * kvd..(r + 1) * kvd].chunks_exact_mut(d).for_each(|hd| rope(hd, cos, sin));
            }
            if let Some(f) = observe.as_mut() {
                f(&LayerActivations { layer: l, rows, hidden: &x, q: &q, k_pre: &k_pre, k: &k, v: &v });
            }
            attn.attend(l, rows, &q, &k, &v, &mut att)?;
            matmul(&w.wo, &att, n, &mut h);
            if let Some([pa, _]) = &w.post_norms {
                rms_norm(&h, pa, c.eps, &mut post);
                std::mem::swap(&mut h, &mut post);
            }
            x.iter_mut().zip(&h).for_each(|(a, &b)| *a += b);
            rms_norm(&x, &w.ffn_norm, c.eps, &mut h);
            matmul(&w.gate, &h, n, &mut g);
            matmul(&w.up, &h, n, &mut u);
            match c.act {
                Activation::Silu => swiglu(&mut g, &u),
                Activation::GeluTanh => geglu(&mut g, &u),
            }
            matmul(&w.down, &g, n, &mut h);
            if let Some([_, pf]) = &w.post_norms {
                rms_norm(&h, pf, c.eps, &mut post);
                std::mem::swap(&mut h, &mut post);
            }
            x.iter_mut().zip(&h).for_each(|(a, &b)| *a += b);
        }
        if n_layers >= self.layers.len() {
            rms_norm(&x, &self.norm, c.eps, &mut h);
            return Ok(h);
        }
        Ok(x)
    }

    /// Every weight matrix: the embeddings, the output projection when untied, and each
    /// layer's seven projections.
    fn matrices(&self) -> impl Iterator<Item = &Weight> {
        let layers = self.layers.iter().flat_map(|w| [&w.wq, &w.wk, &w.wv, &w.wo, &w.gate, &w.up, &w.down]);
        std::iter::once(&self.embed).chain(self.output.as_ref()).chain(layers)
    }

    /// Whether any weight matrix is kept as stored ([`WeightStorage::Quantized`]).
    pub fn weights_as_stored(&self) -> bool {
        self.matrices().any(|m| matches!(m, Weight::Blocks(_)))
    }

    /// Bytes the weight matrices hold in memory (embeddings and output projection
    /// included; norm gains and biases not).
    pub fn weight_bytes(&self) -> usize {
        self.matrices().map(Weight::bytes).sum()
    }

    /// Logits `[rows][vocab]` of final hidden states `[rows][dim]`.
    pub fn logits(&self, hidden: &[f32]) -> Vec<f32> {
        let n = hidden.len() / self.config.dim;
        let w = self.output.as_ref().unwrap_or(&self.embed);
        let mut out = vec![0f32; n * w.rows()];
        matmul(w, hidden, n, &mut out);
        out
    }
}

/// Causal attention of one query head over `len` keys and values of its KV head
/// (`keys[t * stride..][..d]`), in f32 with an f64 softmax sum.
fn attend_head(q: &[f32], keys: &[f32], values: &[f32], len: usize, stride: usize, scale: f32, out: &mut [f32]) {
    let d = q.len();
    let scores: Vec<f32> = (0..len).map(|t| super::math::dot(q, &keys[t * stride..][..d]) * scale).collect();
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = scores.iter().map(|&s| (s - m).exp()).collect();
    let sum: f64 = p.iter().map(|&x| x as f64).sum();
    out.fill(0.0);
    for (t, &pt) in p.iter().enumerate() {
        let w = (pt as f64 / sum) as f32;
        out.iter_mut().zip(&values[t * stride..][..d]).for_each(|(o, &vv)| *o += w * vv);
    }
}

/// Exact attention in f32 over unquantized keys and values (what a prefill kernel
/// computes). Rows of a sequence must arrive in position order, without gaps.
#[derive(Clone, Debug)]
pub struct ExactAttention {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Softmax scale.
    scale: f32,
    /// Per layer, its `window_left` ([`LlamaConfig::window_left`]).
    windows: Vec<Option<usize>>,
    /// Per layer, per sequence: keys and values `[pos][kv_heads][head_dim]`.
    store: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
}

impl ExactAttention {
    /// An empty store for a model's attention shape, softmax scale and sliding windows.
    pub fn new(config: &LlamaConfig) -> Self {
        Self {
            heads: config.heads,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
            scale: config.attn_scale,
            windows: (0..config.layers).map(|l| config.window_left(l)).collect(),
            store: Vec::new(),
        }
    }

    /// Attention of `rows` over the stored keys and values (after storing them): the
    /// shared code of [`ExactAttention`] and the prefill of [`CacheAttention`].
    fn run(&mut self, layer: usize, rows: &[Row], q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()> {
        use rayon::prelude::*;
        let (d, kvd) = (self.head_dim, self.kv_heads * self.head_dim);
        if self.store.len() <= layer {
            self.store.resize(layer + 1, Vec::new());
        }
        let store = &mut self.store[layer];
        for (i, r) in rows.iter().enumerate() {
            if store.len() <= r.seq {
                store.resize(r.seq + 1, (Vec::new(), Vec::new()));
            }
            let (ks, vs) = &mut store[r.seq];
            if ks.len() != r.pos * kvd {
                return Err(Error::Shape(format!(
                    "sequence {} holds {} tokens in layer {layer}; a row at position {} cannot follow",
                    r.seq,
                    ks.len() / kvd,
                    r.pos
                )));
            }
            ks.extend_from_slice(&k[i * kvd..(i + 1) * kvd]);
            vs.extend_from_slice(&v[i * kvd..(i + 1) * kvd]);
        }
        let group = self.heads / self.kv_heads;
        let scale = self.scale;
        let window = self.windows.get(layer).copied().flatten();
        let store = &self.store[layer];
        out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
            let (r, h) = (i / self.heads, i % self.heads);
            let row = rows[r];
            let (ks, vs) = &store[row.seq];
            let kh = h / group;
            // A sliding layer's query sees positions `pos - window_left ..= pos`.
            let first = window.map_or(0, |w| row.pos.saturating_sub(w));
            let (ks, vs) = (&ks[first * kvd + kh * d..], &vs[first * kvd + kh * d..]);
            attend_head(&q[i * d..(i + 1) * d], ks, vs, row.pos + 1 - first, kvd, scale, o);
        });
        Ok(())
    }
}

impl Attention for ExactAttention {
    fn attend(&mut self, layer: usize, rows: &[Row], q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()> {
        self.run(layer, rows, q, k, v, out)
    }
}

/// Attention through rotkv caches, as a serving stack runs it. A row whose sequence gets
/// exactly that one row in the batch is decode: its key and value are appended to the
/// cache and its query decoded from the cache. Several rows of one sequence are a
/// prefill of an empty sequence: they attend to each other exactly (unquantized, as a
/// prefill kernel does) and are then appended; with [`CacheAttention::multi_token_decode`]
/// they are decoded instead, into any sequence: all appended, then one multi-token decode
/// ([`crate::KvCache::decode_tokens`], as speculative decoding verifies a draft). Rows
/// must continue their sequence (positions `len, len + 1, ..` in batch order); every row
/// is checked before anything is appended.
///
/// Sequence index `s` of a [`Row`] is sequence `slots[s].1` of cache `slots[s].0`.
#[derive(Debug)]
pub struct CacheAttention {
    /// The caches (one per method, say), all with the model's attention shape.
    pub caches: Vec<crate::KvCache>,
    /// Row sequence index -> (cache, sequence of that cache).
    pub slots: Vec<(usize, crate::SeqId)>,
    /// Several rows of one sequence in a batch are decoded from the cache (appended, then
    /// one decode with `q_len` = their count) rather than prefilled exactly. Off by
    /// default.
    pub multi_token_decode: bool,
    /// Rows of a sequence per pass of a multi-token decode ([`crate::KvCache::append_decode`]):
    /// `None` takes each cache's [`crate::CacheConfig::pass_rows`] (half its window, as a
    /// serving step with [`crate::device::StepBatch::with_passes`] runs); `Some(n)` at or
    /// above the rows is one append then one decode.
    pub pass_rows: Option<usize>,
    prefill: ExactAttention,
}

impl CacheAttention {
    /// Attention over `caches`; `slots` maps row sequences to cache sequences.
    pub fn new(config: &LlamaConfig, caches: Vec<crate::KvCache>, slots: Vec<(usize, crate::SeqId)>) -> Result<Self> {
        crate::config::check_head_dim(config.head_dim).map_err(|_| {
            Error::Unsupported(format!(
                "model head_dim {} in the rotkv cache (supported: 64, 128, 256)",
                config.head_dim
            ))
        })?;
        for (s, &(c, _)) in slots.iter().enumerate() {
            if c >= caches.len() {
                return Err(Error::Shape(format!("slot {s} names cache {c} of {}", caches.len())));
            }
        }
        // The model's sliding windows and softmax scale, on every cache's layers.
        let mut caches = caches;
        for cache in &mut caches {
            for l in 0..config.layers {
                cache.set_window_left(l, config.window_left(l))?;
            }
            cache.set_softmax_scale(config.attn_scale)?;
        }
        Ok(Self { caches, slots, multi_token_decode: false, pass_rows: None, prefill: ExactAttention::new(config) })
    }
}

impl Attention for CacheAttention {
    fn attend(&mut self, layer: usize, rows: &[Row], q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()> {
        let (hq, hkv, d) = (self.prefill.heads, self.prefill.kv_heads, self.prefill.head_dim);
        let (qd, kvd) = (hq * d, hkv * d);
        let mut per_seq = std::collections::HashMap::<usize, Vec<usize>>::new();
        for (i, r) in rows.iter().enumerate() {
            if r.seq >= self.slots.len() {
                return Err(Error::UnknownSequence(r.seq));
            }
            per_seq.entry(r.seq).or_default().push(i);
        }
        // Check every row before anything is appended: a prefill starts an empty
        // sequence at position 0, a decode row sits at the sequence's length.
        for (&s, idx) in &per_seq {
            let (c, id) = self.slots[s];
            let have = self.caches[c].len(layer, id)?;
            if idx.len() > 1 && have > 0 && !self.multi_token_decode {
                return Err(Error::Unsupported(format!("a prefill of {} rows into non-empty sequence {s}", idx.len())));
            }
            for (j, &i) in idx.iter().enumerate() {
                if rows[i].pos != have + j {
                    return Err(Error::Shape(format!(
                        "row at position {} of sequence {s}, which holds {have} tokens",
                        rows[i].pos
                    )));
                }
            }
        }
        // Prefills: exact attention among the rows, then the rows go to the cache.
        // Decodes are grouped by cache and by rows per sequence (one call each).
        let mut decodes = std::collections::BTreeMap::<(usize, usize), Vec<&[usize]>>::new();
        for (&s, idx) in &per_seq {
            let (c, id) = self.slots[s];
            if idx.len() == 1 || self.multi_token_decode {
                decodes.entry((c, idx.len())).or_default().push(idx);
                continue;
            }
            let sub_rows: Vec<Row> = idx.iter().map(|&i| Row { seq: 0, pos: rows[i].pos }).collect();
            let gather =
                |x: &[f32], w: usize| idx.iter().flat_map(|&i| x[i * w..(i + 1) * w].iter().copied()).collect();
            let (sq, sk, sv): (Vec<f32>, Vec<f32>, Vec<f32>) = (gather(q, qd), gather(k, kvd), gather(v, kvd));
            let mut so = vec![0f32; idx.len() * qd];
            let mut exact = ExactAttention { store: Vec::new(), ..self.prefill.clone() };
            exact.run(layer, &sub_rows, &sq, &sk, &sv, &mut so)?;
            self.caches[c].append(layer, id, idx.len(), &sk, &sv)?;
            for (j, &i) in idx.iter().enumerate() {
                out[i * qd..(i + 1) * qd].copy_from_slice(&so[j * qd..(j + 1) * qd]);
            }
        }
        // Decodes: append each sequence's rows, then one decode call per cache and rows per
        // sequence (rows `[sequence][row]`, in batch order).
        for ((c, q_len), seqs) in decodes {
            let gather = |x: &[f32], w: usize, idx: &[usize]| -> Vec<f32> {
                idx.iter().flat_map(|&i| x[i * w..(i + 1) * w].iter().copied()).collect()
            };
            let ids: Vec<crate::SeqId> = seqs.iter().map(|idx| self.slots[rows[idx[0]].seq].1).collect();
            let all: Vec<usize> = seqs.iter().flat_map(|idx| idx.iter().copied()).collect();
            let (ks, vs, qs) = (gather(k, kvd, &all), gather(v, kvd, &all), gather(q, qd, &all));
            let mut o = vec![0f32; qs.len()];
            let pass = self.pass_rows.unwrap_or_else(|| self.caches[c].config().pass_rows());
            self.caches[c].append_decode(layer, &ids, q_len, pass, (&ks, &vs), &qs, &mut o)?;
            for (j, &i) in all.iter().enumerate() {
                out[i * qd..(i + 1) * qd].copy_from_slice(&o[j * qd..(j + 1) * qd]);
            }
        }
        Ok(())
    }
}
