//! Quantization metrics on captured KV tensors (feature `eval`).
//!
//! Input: a safetensors file with `layer{L}.q` `[T, Hq, D]`, `layer{L}.k` and
//! `layer{L}.v` `[T, Hkv, D]` (f16, bf16 or f32), as in `../shared/data/`; the attention
//! scale comes from the metadata key `attn_scaling` when present, else `1/sqrt(D)`.
//!
//! Metrics, per method and layer, as the `.metrics.json` beside the shared data defines
//! them: `k_rel_err = ||khat - k|| / ||k||` over the whole `[T, Hkv, D]` tensor (likewise
//! `v_rel_err`), and `attn_rel_err = ||ohat - o|| / ||o||` over the outputs of the last
//! 128 query positions with full causal attention, `o` from the exact keys and values
//! and `ohat` from the quantized ones, all in f64.
//!
//! The whole-tensor methods (`naive2`, `had2`, ...) quantize every token with the
//! library's quantizer ([`crate::reference`]: rows rotated, rounded to f16 as the format
//! stores them, then f16 scales and zeros per group). The cache methods (`k2v2`,
//! `k4v2`) run the real cache: every token appended through [`crate::paged::append`],
//! every one of the last 128 queries decoded by [`crate::paged::decode`] after its own
//! token was appended, so sinks and window are exactly what decode sees at that step.

use crate::config::{CacheConfig, HeadRotation, LayerCalibration, Rotation};
use crate::error::{Error, Result};
use crate::paged::{self, DecodeOptions, LayerShape};
use crate::reference::{self, SeqRef};
use crate::{Backend, f16};
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;

/// Query positions the attention metric averages over (the last ones of the tile).
pub const QUERY_POSITIONS: usize = 128;

/// One layer's tensors, as f32 `[T][H][D]`.
#[derive(Clone, Debug)]
pub struct LayerTile {
    /// Layer index.
    pub layer: usize,
    /// Tokens.
    pub tokens: usize,
    /// Query heads.
    pub num_q_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Queries `[T][Hq][D]`.
    pub q: Vec<f32>,
    /// Keys `[T][Hkv][D]`.
    pub k: Vec<f32>,
    /// Values `[T][Hkv][D]`.
    pub v: Vec<f32>,
}

/// A captured KV file: its layers and attention scale.
#[derive(Clone, Debug)]
pub struct Tile {
    /// Layers found in the file, in increasing order.
    pub layers: Vec<LayerTile>,
    /// Softmax scale.
    pub attn_scaling: f64,
    /// The file's metadata.
    pub metadata: HashMap<String, String>,
}

fn tensor_f32(st: &SafeTensors<'_>, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
    let t = st.tensor(name).map_err(|e| Error::Input(format!("{name}: {e}")))?;
    let data = t.data();
    let values: Vec<f32> = match t.dtype() {
        Dtype::F16 => data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        other => return Err(Error::Input(format!("{name} has dtype {other:?}; expected F16, BF16 or F32"))),
    };
    Ok((t.shape().to_vec(), values))
}

impl Tile {
    /// Parses a safetensors file's bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| Error::Input(format!("not a safetensors file: {e}")))?;
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| Error::Input(e.to_string()))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        let mut ids: Vec<usize> =
            st.names().iter().filter_map(|n| n.strip_prefix("layer")?.strip_suffix(".k")?.parse().ok()).collect();
        ids.sort_unstable();
        if ids.is_empty() {
            return Err(Error::Input("no tensor named layer{L}.k".into()));
        }
        let mut layers = Vec::new();
        for layer in ids {
            let (qs, q) = tensor_f32(&st, &format!("layer{layer}.q"))?;
            let (ks, k) = tensor_f32(&st, &format!("layer{layer}.k"))?;
            let (vs, v) = tensor_f32(&st, &format!("layer{layer}.v"))?;
            if qs.len() != 3 || ks.len() != 3 || ks != vs || qs[0] != ks[0] || qs[2] != ks[2] {
                return Err(Error::Input(format!(
                    "layer {layer}: shapes q {qs:?}, k {ks:?}, v {vs:?}; expected [T, Hq, D], [T, Hkv, D], [T, Hkv, D]"
                )));
            }
            let (t, hq, hkv, d) = (ks[0], qs[1], ks[1], ks[2]);
            if t == 0 || hkv == 0 || hq % hkv != 0 {
                return Err(Error::Input(format!("layer {layer}: {t} tokens, {hq} query heads, {hkv} KV heads")));
            }
            if [&q, &k, &v].iter().any(|x| x.iter().any(|v| !v.is_finite())) {
                return Err(Error::Input(format!("layer {layer} holds non-finite values")));
            }
            layers.push(LayerTile { layer, tokens: t, num_q_heads: hq, num_kv_heads: hkv, head_dim: d, q, k, v });
        }
        let d = layers[0].head_dim;
        let attn_scaling = match metadata.get("attn_scaling") {
            Some(s) => s.parse().map_err(|_| Error::Input(format!("metadata attn_scaling {s:?} is not a number")))?,
            None => 1.0 / (d as f64).sqrt(),
        };
        Ok(Self { layers, attn_scaling, metadata })
    }

    /// Reads a file.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::Input(format!("{}: {e}", path.display())))?;
        Self::from_bytes(&bytes)
    }
}

/// How a method quantizes.
#[derive(Clone, Debug, PartialEq)]
pub enum MethodKind {
    /// Every token quantized: bits, group (None = whole head), rotation.
    Whole { key_bits: u32, value_bits: u32, group: Option<usize>, rotation: Rotation },
    /// The real cache with this config (sinks and window in f16).
    Cache(CacheConfig),
}

/// A named quantization method.
#[derive(Clone, Debug, PartialEq)]
pub struct Method {
    /// Name in tables and JSON.
    pub name: String,
    /// What it does.
    pub kind: MethodKind,
}

/// The methods of the shared `.metrics.json` (`naive2`, `naive4`, `had2`, `had4`,
/// `had2_g32`, `naive2_g32`), then the cache presets `k2v2` and `k4v2` with their default
/// sinks and window.
pub fn standard_methods(head_dim: usize) -> Vec<Method> {
    let whole = |name: &str, bits: u32, group: Option<usize>, rotation: Rotation| Method {
        name: name.into(),
        kind: MethodKind::Whole { key_bits: bits, value_bits: bits, group, rotation },
    };
    let mut m = vec![
        whole("naive2", 2, None, Rotation::None),
        whole("naive4", 4, None, Rotation::None),
        whole("had2", 2, None, Rotation::Hadamard),
        whole("had4", 4, None, Rotation::Hadamard),
        whole("had2_g32", 2, Some(32), Rotation::Hadamard),
        whole("naive2_g32", 2, Some(32), Rotation::None),
    ];
    for preset in ["k2v2", "k4v2"] {
        // The min/max quantizer of the numpy metrics (no clipping), so the rows compare.
        let c = CacheConfig {
            key_clip: 1.0,
            value_clip: 1.0,
            ..CacheConfig::preset(preset, head_dim).expect("preset names are known")
        };
        m.push(Method { name: format!("{preset}_s{}_w{}", c.sinks, c.window), kind: MethodKind::Cache(c) });
    }
    m
}

/// One method's metrics on one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct MethodResult {
    /// Method name.
    pub name: String,
    /// Key relative error.
    pub k_rel_err: f64,
    /// Value relative error.
    pub v_rel_err: f64,
    /// Attention-output relative error over the last 128 queries.
    pub attn_rel_err: f64,
    /// Storage bits per element, scales and zeros included (sinks and window excluded).
    pub bits_per_element: f64,
    /// Bytes per quantized token per KV head (codes, scales and zeros, K and V).
    pub bytes_per_token: usize,
}

/// All methods on one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerReport {
    /// Layer index.
    pub layer: usize,
    /// Per method.
    pub methods: Vec<MethodResult>,
}

fn rel_err(a: &[f64], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        num += (x - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den).sqrt()
}

/// Quantizes every `[H][D]` row of `x` with the library's quantizer and returns the
/// dequantized, unrotated rows in f64.
fn quantize_all(x: &[f32], d: usize, bits: u32, group: usize, hadamard: bool) -> Vec<f64> {
    let perm: Vec<u16> = (0..d as u16).collect();
    let rot = if hadamard { HeadRotation::Hadamard } else { HeadRotation::None };
    x.par_chunks(d)
        .flat_map_iter(|row| {
            let stored: Vec<f64> = reference::stored_value(row, rot, &perm).iter().map(|v| v.to_f64()).collect();
            let mut codes = vec![0u8; d * bits as usize / 8];
            let mut params = vec![0u8; d / group * 4];
            reference::quantize_row(&stored, bits, group, rotkv_kernels::layout::NO_CLIP, &mut codes, &mut params);
            let deq = reference::dequantize_row(&codes, &params, bits, group, d);
            reference::unrotate(&deq, rot, &perm)
        })
        .collect()
}

/// Causal attention outputs `[n][Hq][D]` of the last `n` queries over keys and values
/// given as f64 rows `[T][Hkv][D]`.
fn attention(tile: &LayerTile, k: &[f64], v: &[f64], scale: f64, n: usize) -> Vec<f64> {
    let (t, hq, hkv, d) = (tile.tokens, tile.num_q_heads, tile.num_kv_heads, tile.head_dim);
    let g = hq / hkv;
    (t - n..t)
        .into_par_iter()
        .flat_map_iter(|pos| {
            (0..hq).flat_map(move |h| {
                let q = &tile.q[(pos * hq + h) * d..(pos * hq + h + 1) * d];
                let kh = h / g;
                let logits: Vec<f64> = (0..=pos)
                    .map(|s| {
                        let kr = &k[(s * hkv + kh) * d..(s * hkv + kh + 1) * d];
                        scale * q.iter().zip(kr).map(|(&a, &b)| a as f64 * b).sum::<f64>()
                    })
                    .collect();
                let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                let sum: f64 = w.iter().sum();
                let mut o = vec![0.0; d];
                for (s, w) in w.iter().enumerate() {
                    let vr = &v[(s * hkv + kh) * d..(s * hkv + kh + 1) * d];
                    o.iter_mut().zip(vr).for_each(|(o, v)| *o += w * v);
                }
                o.into_iter().map(move |x| x / sum)
            })
        })
        .collect()
}

/// Runs the real cache over a layer: append all but the last `n` tokens, then per query
/// position append its token and decode it. Returns the final cache contents (keys and
/// values `[T][Hkv][D]`, unrotated, as decode reads them) and the decoded outputs.
fn run_cache(tile: &LayerTile, config: &CacheConfig, scale: f64, n: usize) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let (t, hq, hkv, d) = (tile.tokens, tile.num_q_heads, tile.num_kv_heads, tile.head_dim);
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let blocks = paged::blocks_for(config, t)?;
    let mut pool = paged::PoolBuffer::new(paged::pool_bytes(config, &shape, blocks)?);
    let mut side = vec![f16::ZERO; paged::side_elems(config, &shape)?];
    let table: Vec<u32> = (0..blocks as u32).collect();
    let calib = LayerCalibration::identity(hkv, d);
    let row = hkv * d;
    let backend = Backend::Cpu;
    let prefill = t - n;
    paged::append(
        backend,
        config,
        &calib,
        &shape,
        pool.bytes_mut(),
        &table,
        &mut side,
        &[],
        0,
        prefill,
        &tile.k[..prefill * row],
        &tile.v[..prefill * row],
    )?;
    let mut out = vec![0f32; n * hq * d];
    let opts = DecodeOptions { sm_scale: Some(scale as f32), ..DecodeOptions::default() };
    for (i, pos) in (prefill..t).enumerate() {
        let (kr, vr) = (&tile.k[pos * row..(pos + 1) * row], &tile.v[pos * row..(pos + 1) * row]);
        paged::append(backend, config, &calib, &shape, pool.bytes_mut(), &table, &mut side, &[], pos, 1, kr, vr)?;
        let seq = SeqRef { block_table: &table, side: &side, len: pos + 1, protected: &[] };
        let q = &tile.q[pos * hq * d..(pos + 1) * hq * d];
        paged::decode(
            backend,
            config,
            &calib,
            &shape,
            pool.bytes(),
            &[seq],
            q,
            &mut out[i * hq * d..(i + 1) * hq * d],
            opts,
        )?;
    }
    let fmt = config.format()?;
    let seq = SeqRef { block_table: &table, side: &side, len: t, protected: &[] };
    let ident: Vec<u16> = (0..d as u16).collect();
    let (pool, ident) = (pool.bytes(), &ident);
    let read = |value: bool, rot: Rotation| -> Vec<f64> {
        (0..t)
            .flat_map(|pos| {
                (0..hkv).flat_map(move |h| {
                    let r = reference::read_row(&fmt, hkv, pool, &seq, h, pos, value);
                    reference::unrotate(&r, rot.into(), ident)
                })
            })
            .collect()
    };
    let k = read(false, config.key_rotation);
    let v = read(true, config.value_rotation);
    Ok((k, v, out.into_iter().map(f64::from).collect()))
}

/// Metrics of `methods` on one layer. `progress` is called once per method done.
pub fn evaluate_layer(
    tile: &LayerTile,
    methods: &[Method],
    scale: f64,
    progress: &(dyn Fn() + Sync),
) -> Result<LayerReport> {
    let d = tile.head_dim;
    let n = QUERY_POSITIONS.min(tile.tokens);
    let exact_k: Vec<f64> = tile.k.iter().map(|&x| x as f64).collect();
    let exact_v: Vec<f64> = tile.v.iter().map(|&x| x as f64).collect();
    let exact: Vec<f32> = attention(tile, &exact_k, &exact_v, scale, n).into_iter().map(|x| x as f32).collect();
    let mut results = Vec::new();
    for m in methods {
        let r = match &m.kind {
            MethodKind::Whole { key_bits, value_bits, group, rotation } => {
                let g = group.unwrap_or(d);
                let c =
                    CacheConfig { key_bits: *key_bits, value_bits: *value_bits, group_size: g, ..CacheConfig::k2v2(d) };
                let bytes_per_token = c.bytes_per_token()?;
                let had = *rotation == Rotation::Hadamard;
                let kq = quantize_all(&tile.k, d, *key_bits, g, had);
                let vq = quantize_all(&tile.v, d, *value_bits, g, had);
                let o = attention(tile, &kq, &vq, scale, n);
                MethodResult {
                    name: m.name.clone(),
                    k_rel_err: rel_err(&kq, &tile.k),
                    v_rel_err: rel_err(&vq, &tile.v),
                    attn_rel_err: rel_err(&o, &exact),
                    bits_per_element: c.bits_per_element(),
                    bytes_per_token,
                }
            }
            MethodKind::Cache(config) => {
                let c = CacheConfig { head_dim: d, ..*config };
                let (kq, vq, o) = run_cache(tile, &c, scale, n)?;
                MethodResult {
                    name: m.name.clone(),
                    k_rel_err: rel_err(&kq, &tile.k),
                    v_rel_err: rel_err(&vq, &tile.v),
                    attn_rel_err: rel_err(&o, &exact),
                    bits_per_element: c.bits_per_element(),
                    bytes_per_token: c.bytes_per_token()?,
                }
            }
        };
        results.push(r);
        progress();
    }
    Ok(LayerReport { layer: tile.layer, methods: results })
}

/// The `--json` form: `{"file", "attn_scaling", "layers": [{"layer", "methods": [...]}]}`.
pub fn report_json(file: &str, scale: f64, layers: &[LayerReport]) -> serde_json::Value {
    serde_json::json!({
        "file": file,
        "attn_scaling": scale,
        "layers": layers.iter().map(|l| serde_json::json!({
            "layer": l.layer,
            "methods": l.methods.iter().map(|m| serde_json::json!({
                "name": m.name,
                "k_rel_err": m.k_rel_err,
                "v_rel_err": m.v_rel_err,
                "attn_rel_err": m.attn_rel_err,
                "bits_per_element": m.bits_per_element,
                "bytes_per_token": m.bytes_per_token,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}
