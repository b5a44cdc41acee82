//! Offline calibration from a model's own keys and values: per (layer, KV head) key
//! means (centering), channel permutations after the Hadamard rotation (RotateKV's
//! outlier-aware reordering) and learned rotations (OptR), stored in a safetensors file
//! that `rotkv ppl --calib` and [`crate::KvCache::set_calibration`] take.
//!
//! - Key mean: the mean of the post-RoPE keys over the calibration tokens (positions
//!   before [`SKIP_POSITIONS`] left out: they are the attention sinks, kept in f16, and
//!   their keys are outliers that would pull the mean).
//! - Key channel standard deviation (smoothing, QServe's SmoothAttention idea): per
//!   channel, the standard deviation `sigma` of the centered keys over the same tokens
//!   (floored at 1e-6 of the head's mean so it is > 0). A cache smoothing with exponent
//!   `alpha` divides the centered keys by `s = sigma^alpha / mean(sigma^alpha)` (mean 1
//!   per head; [`smoothing_scales`]) and multiplies the query by `s`, so attention is
//!   unchanged and the quantizer sees variance-balanced channels.
//! - Permutation: rotate the centered keys (values: the values, not centered) by the
//!   Hadamard transform, measure each rotated channel's root mean square over the
//!   calibration tokens, and sort the channels by it (ascending), so a group of g
//!   consecutive stored channels holds channels of similar range. One permutation serves
//!   every group size.
//! - Learned rotations (OptR, optional): per KV head, orthogonal key and value rotations
//!   trained on the model's own queries, keys and values of the calibration text for one
//!   cache configuration's quantizer ([`super::optr`]); they replace the Hadamard
//!   transform where a cache uses them ([`Use::learned`]).
//!
//! # Example: a calibration file into a cache
//!
//! ```
//! use rotkv::model::calibrate::{Calibration, Use};
//! use rotkv::{Backend, CacheConfig, CacheShape, KvCache, LayerCalibration};
//!
//! // (A file from `rotkv calibrate` would be read with `Calibration::load(path)?`.)
//! let mut layer = LayerCalibration::identity(3, 64);
//! layer.key_mean[5] = 0.75;
//! let bytes = Calibration {
//!     layers: vec![layer; 2],
//!     kv_heads: 3,
//!     head_dim: 64,
//!     metadata: Default::default(),
//!     key_smoothing: Default::default(),
//! }
//! .to_safetensors()?;
//! let cal = Calibration::from_safetensors(&bytes)?;
//!
//! let shape = CacheShape { layers: 2, num_kv_heads: 3, num_q_heads: 9, max_seqs: 1, max_tokens: 512, num_blocks: None };
//! let mut cache = KvCache::new(CacheConfig::k2v2(64), shape, Backend::Cpu)?;
//! for l in 0..2 {
//!     // Before any token of the layer is appended.
//!     cache.set_calibration(l, cal.layer(l, Use { center: true, ..Use::default() }))?;
//! }
//! # Ok::<(), rotkv::Error>(())
//! ```

use super::llama::{ExactAttention, LayerActivations, Llama, Row};
use super::optr::{self, OptrOptions};
use crate::config::LayerCalibration;
use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// Leading positions left out of the statistics (the default sinks).
pub const SKIP_POSITIONS: usize = 4;

/// What a calibration file holds, per layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// Per layer: key means `[kv_heads][head_dim]`, key and value permutations, learned
    /// rotations. In a `Calibration` (the file), [`LayerCalibration::key_scale`] holds
    /// the key channel standard deviations `sigma` (tensor `layer{L}.key_std`; all ones
    /// where the file has none), not scales: [`Calibration::layer`] turns them into the
    /// scales a cache uses when [`Use::smooth`] asks for smoothing.
    pub layers: Vec<LayerCalibration>,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Free-form facts (model, text, tokens), stored as metadata.
    pub metadata: BTreeMap<String, String>,
    /// Per key bit width (2, 4): per layer, the smoothing chosen for each KV head
    /// (`[layers][kv_heads]`, one of [`smooth_choices`]) from the measured attention error
    /// ([`measure_smoothing`]); tensors `layer{L}.key_alpha_k{bits}` and
    /// `layer{L}.key_knee_k{bits}` (U32 `[kv_heads]`). Empty in files written before the
    /// measurement existed (they load; a recipe that needs the choice says so).
    /// [`Smooth::Measured`] uses it.
    pub key_smoothing: BTreeMap<u32, Vec<Vec<SmoothChoice>>>,
}

/// Which parts of a calibration a cache uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Use {
    /// Subtract the calibrated key mean.
    pub center: bool,
    /// Apply the calibrated key and value permutations.
    pub reorder: bool,
    /// Rotate by the learned (OptR) rotations instead of the Hadamard transform.
    pub learned: bool,
    /// Smooth the keys ([`Smooth`]).
    pub smooth: Option<Smooth>,
}

/// How [`Use::smooth`] smooths the keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Smooth {
    /// Every KV head with exponent `alpha` given in hundredths (`Alpha(50)`: alpha 0.5):
    /// key scales `sigma^alpha` normalized to mean 1 per KV head ([`smoothing_scales`]).
    Alpha(u32),
    /// Per KV head: alpha [`AUTO_SMOOTH_ALPHA`] where the head's largest channel standard
    /// deviation is at least [`AUTO_SMOOTH_RATIO`] times the mean of its channels (key
    /// outlier channels, which smoothing is for), none elsewhere ([`auto_smoothing_scales`]).
    Auto,
    /// Per layer and KV head, the exponent `rotkv calibrate` measured best for keys of
    /// this many bits ([`Calibration::key_smoothing`], [`measure_smoothing`]): `-m`, and the
    /// recipe ([`Use::recipe`]).
    Measured(u32),
}

impl Use {
    /// The recommended recipe for a cache whose keys have `key_bits` bits: the calibrated
    /// key means and, per layer and KV head, the smoothing exponent measured best for
    /// that quantizer ([`Smooth::Measured`]). The recipe also protects [`RECIPE_SINKS`]
    /// detected sinks per layer ([`RECIPE_DETECTOR`], [`super::sinks::detect`],
    /// [`crate::KvCache::protect`]).
    pub fn recipe(key_bits: u32) -> Self {
        Self { center: true, smooth: Some(Smooth::Measured(key_bits)), ..Self::default() }
    }
}

/// Detected sinks per layer that the recipe keeps in f16 (`-dh8`).
pub const RECIPE_SINKS: usize = 8;

/// The detector the recipe ranks sinks with (`-dh8`: the hidden-state norm).
pub const RECIPE_DETECTOR: super::sinks::Detector = super::sinks::Detector::Hidden;

/// The smoothing exponents [`measure_smoothing`] chooses from, in hundredths (alpha 0,
/// 0.25, 0.5, 0.75, 1; 0 is no smoothing).
pub const SMOOTH_ALPHAS: [u32; 5] = [0, 25, 50, 75, 100];

/// The knees [`measure_smoothing`] chooses from, in multiples of the head's median
/// channel standard deviation (0: none). See [`SmoothChoice::knee`].
pub const SMOOTH_KNEES: [u32; 2] = [0, 2];

/// One KV head's key smoothing: channel scales `sigma^alpha`, and beyond the knee
/// `sigma` itself (each outlier channel brought down to the knee's level), normalized to
/// mean 1 ([`smoothing_scales_knee`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmoothChoice {
    /// The exponent in hundredths, one of [`SMOOTH_ALPHAS`].
    pub alpha: u32,
    /// Channels whose `sigma` exceeds `knee` times the head's median are scaled by
    /// `sigma` (alpha 1) above that level; 0: no knee. One of [`SMOOTH_KNEES`].
    pub knee: u32,
}

impl std::fmt::Display for SmoothChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.2}", self.alpha as f64 / 100.0)?;
        if self.knee > 0 { write!(f, "k{}", self.knee) } else { Ok(()) }
    }
}

/// Every choice [`measure_smoothing`] measures: each exponent without a knee, then each
/// knee with the exponents below 1 (alpha 1 is the same with or without one).
pub fn smooth_choices() -> Vec<SmoothChoice> {
    SMOOTH_KNEES
        .iter()
        .flat_map(|&knee| SMOOTH_ALPHAS.iter().map(move |&alpha| SmoothChoice { alpha, knee }))
        .filter(|c| c.knee == 0 || c.alpha < 100)
        .collect()
}

/// [`smoothing_scales`] with a knee: per head, with `m` the median of its channels'
/// `sigma` and `t = knee * m`, the scale of a channel is `sigma^alpha` up to `t` and
/// `t^alpha * sigma / t` above (continuous; outlier channels are divided down to the
/// knee's level), normalized to mean 1. `knee == 0` is [`smoothing_scales`].
pub fn smoothing_scales_knee(sigma: &[f32], head_dim: usize, alpha: f64, knee: u32) -> Vec<f32> {
    if knee == 0 {
        return smoothing_scales(sigma, head_dim, alpha);
    }
    let mut out = Vec::with_capacity(sigma.len());
    for head in sigma.chunks_exact(head_dim) {
        let mut sorted: Vec<f64> = head.iter().map(|&x| x as f64).collect();
        sorted.sort_by(f64::total_cmp);
        let t = knee as f64 * 0.5 * (sorted[head_dim / 2 - 1] + sorted[head_dim / 2]);
        let p: Vec<f64> = head
            .iter()
            .map(|&x| {
                let x = x as f64;
                if x > t { t.powf(alpha) * x / t } else { x.powf(alpha) }
            })
            .collect();
        let mean = p.iter().sum::<f64>() / head_dim as f64;
        out.extend(p.iter().map(|&x| (x / mean) as f32));
    }
    out
}

/// Query positions per query head that [`measure_smoothing`] averages over by default.
pub const SMOOTH_QUERIES: usize = 256;

/// The largest-to-mean channel standard deviation ratio from which [`Smooth::Auto`]
/// smooths a KV head. Chosen on the two real models measured (the book's accuracy
/// chapter, `docs/src/accuracy.md`): SmolLM2-135M's 90 heads span 1.45 to 2.91 (smoothing costs it perplexity),
/// Gemma 3 270M's 18 span 3.1 to 18.4 (smoothing at alpha 0.5 takes k2v2-c from +45.7% to
/// +3.96%). Two models are thin evidence for the exact value.
pub const AUTO_SMOOTH_RATIO: f64 = 3.0;

/// The exponent [`Smooth::Auto`] smooths with (the best of 0.25, 0.5 and 1.0 on Gemma 3).
pub const AUTO_SMOOTH_ALPHA: f64 = 0.5;

/// Per KV head, the largest channel `sigma` over the mean of the head's channels (what
/// [`Smooth::Auto`] compares with [`AUTO_SMOOTH_RATIO`]).
pub fn outlier_ratios(sigma: &[f32], head_dim: usize) -> Vec<f64> {
    sigma
        .chunks_exact(head_dim)
        .map(|head| {
            let mean = head.iter().map(|&x| x as f64).sum::<f64>() / head_dim as f64;
            head.iter().fold(0f64, |m, &x| m.max(x as f64)) / mean
        })
        .collect()
}

/// [`smoothing_scales`] with each head's alpha chosen as [`Smooth::Auto`] says: ones for
/// heads whose largest channel `sigma` is below [`AUTO_SMOOTH_RATIO`] times their mean.
pub fn auto_smoothing_scales(sigma: &[f32], head_dim: usize) -> Vec<f32> {
    sigma
        .chunks_exact(head_dim)
        .zip(outlier_ratios(sigma, head_dim))
        .flat_map(|(head, ratio)| {
            let alpha = if ratio >= AUTO_SMOOTH_RATIO { AUTO_SMOOTH_ALPHA } else { 0.0 };
            smoothing_scales(head, head_dim, alpha)
        })
        .collect()
}

/// Key scales from channel standard deviations `sigma` (`[kv_heads][head_dim]`, > 0):
/// `sigma^alpha` (f64) divided by its mean over each head's channels, rounded to f32.
/// `alpha == 0` or equal `sigma` give ones (no smoothing).
pub fn smoothing_scales(sigma: &[f32], head_dim: usize, alpha: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(sigma.len());
    for head in sigma.chunks_exact(head_dim) {
        let p: Vec<f64> = head.iter().map(|&x| (x as f64).powf(alpha)).collect();
        let mean = p.iter().sum::<f64>() / head_dim as f64;
        out.extend(p.iter().map(|&x| (x / mean) as f32));
    }
    out
}

impl Calibration {
    /// The calibration of `layer` restricted to `what` (the rest identity).
    pub fn layer(&self, layer: usize, what: Use) -> LayerCalibration {
        let full = &self.layers[layer];
        let id = LayerCalibration::identity(self.kv_heads, self.head_dim);
        LayerCalibration {
            key_mean: if what.center { full.key_mean.clone() } else { id.key_mean },
            key_scale: match what.smooth {
                Some(Smooth::Alpha(a)) => smoothing_scales(&full.key_scale, self.head_dim, a as f64 / 100.0),
                Some(Smooth::Auto) => auto_smoothing_scales(&full.key_scale, self.head_dim),
                Some(Smooth::Measured(bits)) => match self.key_smoothing.get(&bits).and_then(|a| a.get(layer)) {
                    Some(choices) => full
                        .key_scale
                        .chunks_exact(self.head_dim)
                        .zip(choices)
                        .flat_map(|(sigma, c)| {
                            smoothing_scales_knee(sigma, self.head_dim, c.alpha as f64 / 100.0, c.knee)
                        })
                        .collect(),
                    None => id.key_scale,
                },
                None => id.key_scale,
            },
            key_perm: if what.reorder { full.key_perm.clone() } else { id.key_perm.clone() },
            value_perm: if what.reorder { full.value_perm.clone() } else { id.value_perm },
            key_rotation: if what.learned { full.key_rotation.clone() } else { None },
            value_rotation: if what.learned { full.value_rotation.clone() } else { None },
        }
    }

    /// Whether the file holds key channel standard deviations (every layer has one that
    /// is not all ones: [`Use::smooth`] would change nothing otherwise).
    pub fn has_key_std(&self) -> bool {
        self.layers.iter().all(|l| l.key_scale.iter().any(|&s| s != 1.0))
    }

    /// Whether the file holds a measured smoothing choice for keys of `key_bits` bits on
    /// every layer, and the key channel standard deviations it applies to
    /// ([`Smooth::Measured`] would change nothing otherwise).
    pub fn has_smoothing_choice(&self, key_bits: u32) -> bool {
        self.has_key_std() && self.key_smoothing.get(&key_bits).is_some_and(|a| a.len() == self.layers.len())
    }

    /// The calibration a cache of `config` uses for `layer` under the recommended recipe
    /// ([`Use::recipe`] for its key bits): an error naming what is missing where the file
    /// has no measured smoothing choice for those keys (a file from an older `rotkv
    /// calibrate`, or calibrated without `smooth`).
    pub fn recipe_layer(&self, layer: usize, config: &crate::CacheConfig) -> Result<LayerCalibration> {
        if layer >= self.layers.len() {
            return Err(Error::Layer { layer, layers: self.layers.len() });
        }
        if !self.has_smoothing_choice(config.key_bits) {
            return Err(Error::Calibration(format!(
                "the calibration has no measured smoothing choice for {}-bit keys (written by an older rotkv \
                 calibrate, or without `smooth`): run rotkv calibrate again",
                config.key_bits
            )));
        }
        Ok(self.layer(layer, Use::recipe(config.key_bits)))
    }

    /// Whether every layer holds a learned key or value rotation.
    pub fn has_learned_rotations(&self) -> bool {
        self.layers.iter().all(|l| l.key_rotation.is_some() || l.value_rotation.is_some())
    }

    /// Serializes to safetensors: `layer{L}.key_mean` (F32 `[kv_heads, head_dim]`),
    /// `layer{L}.key_perm` and `layer{L}.value_perm` (U16), `layer{L}.key_std` (F32
    /// `[kv_heads, head_dim]`, the channel standard deviations; left out where all ones),
    /// where present
    /// `layer{L}.key_rotation` and `layer{L}.value_rotation` (F32 `[kv_heads, head_dim,
    /// head_dim]`, row-major `R`), metadata `format = rotkv-calibration-1` plus
    /// [`Calibration::metadata`].
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        use safetensors::tensor::{Dtype, TensorView};
        let (h, d) = (self.kv_heads, self.head_dim);
        let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (l, c) in self.layers.iter().enumerate() {
            let mut push = |name: &str, dt, shape: Vec<usize>, b: &[u8]| {
                blobs.push((format!("layer{l}.{name}"), dt, shape, b.to_vec()));
            };
            push("key_mean", Dtype::F32, vec![h, d], bytemuck::cast_slice(&c.key_mean));
            push("key_perm", Dtype::U16, vec![h, d], bytemuck::cast_slice(&c.key_perm));
            push("value_perm", Dtype::U16, vec![h, d], bytemuck::cast_slice(&c.value_perm));
            if c.key_scale.iter().any(|&s| s != 1.0) {
                push("key_std", Dtype::F32, vec![h, d], bytemuck::cast_slice(&c.key_scale));
            }
            for (bits, choices) in &self.key_smoothing {
                let heads = choices.get(l).map_or(&[][..], Vec::as_slice);
                let alpha: Vec<u32> = heads.iter().map(|c| c.alpha).collect();
                let knee: Vec<u32> = heads.iter().map(|c| c.knee).collect();
                push(&format!("key_alpha_k{bits}"), Dtype::U32, vec![alpha.len()], bytemuck::cast_slice(&alpha));
                push(&format!("key_knee_k{bits}"), Dtype::U32, vec![knee.len()], bytemuck::cast_slice(&knee));
            }
            for (name, r) in [("key_rotation", &c.key_rotation), ("value_rotation", &c.value_rotation)] {
                if let Some(r) = r {
                    push(name, Dtype::F32, vec![h, d, d], bytemuck::cast_slice(r));
                }
            }
        }
        let views = blobs
            .iter()
            .map(|(k, dt, shape, b)| {
                TensorView::new(*dt, shape.clone(), b).map(|v| (k.clone(), v)).map_err(|e| Error::Input(e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta: std::collections::HashMap<String, String> = self.metadata.clone().into_iter().collect();
        meta.insert("format".into(), "rotkv-calibration-1".into());
        safetensors::serialize(views, Some(meta)).map_err(|e| Error::Input(format!("safetensors: {e}")))
    }

    /// Reads a file written by [`Calibration::to_safetensors`], validating every layer.
    pub fn from_safetensors(bytes: &[u8]) -> Result<Self> {
        use safetensors::SafeTensors;
        let bad = |e: String| Error::Calibration(e);
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let metadata: BTreeMap<String, String> = meta.metadata().clone().unwrap_or_default().into_iter().collect();
        if metadata.get("format").map(String::as_str) != Some("rotkv-calibration-1") {
            return Err(bad("not a rotkv calibration file (metadata format != rotkv-calibration-1)".into()));
        }
        let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let first = st.tensor("layer0.key_mean").map_err(|e| bad(format!("layer0.key_mean: {e}")))?;
        let [kv_heads, head_dim] = first.shape() else {
            return Err(bad("key_mean is not [kv_heads, head_dim]".into()));
        };
        let (kv_heads, head_dim) = (*kv_heads, *head_dim);
        crate::config::check_head_dim(head_dim).map_err(|_| {
            Error::Unsupported(format!("calibration file for head_dim {head_dim} (supported: 64, 128, 256)"))
        })?;
        if kv_heads == 0 {
            return Err(bad("layer0.key_mean is [0, head_dim]: no KV heads".into()));
        }
        // Every tensor is `layer{L}.{name}` with a known name, and the layers run from 0
        // without a gap: a missing layer is an error, not the end of the file.
        const NAMES: [&str; 10] = [
            "key_mean",
            "key_perm",
            "value_perm",
            "key_std",
            "key_rotation",
            "value_rotation",
            "key_alpha_k2",
            "key_alpha_k4",
            "key_knee_k2",
            "key_knee_k4",
        ];
        let mut n_layers = 0usize;
        for name in st.names() {
            // `L` in its one decimal spelling (`layer001` is not `layer1`: a tensor the
            // loader would never read), and small enough to count layers up to it.
            let parsed = name
                .strip_prefix("layer")
                .and_then(|r| r.split_once('.'))
                .filter(|(l, t)| {
                    NAMES.contains(t)
                        && !l.is_empty()
                        && l.bytes().all(|b| b.is_ascii_digit())
                        && (*l == "0" || !l.starts_with('0'))
                })
                .and_then(|(l, _)| l.parse::<usize>().ok())
                .and_then(|l| l.checked_add(1));
            let end = parsed.ok_or_else(|| {
                bad(format!(
                    "tensor {name} is not layer<L>.<{}> (L a layer number without leading zeros)",
                    NAMES.join("|")
                ))
            })?;
            n_layers = n_layers.max(end);
        }
        if let Some(l) = (0..n_layers).find(|l| st.tensor(&format!("layer{l}.key_mean")).is_err()) {
            return Err(bad(format!(
                "layer {l} is missing (layer{l}.key_mean; the file has layers up to {})",
                n_layers - 1
            )));
        }
        let mut layers = Vec::new();
        let mut key_smoothing: BTreeMap<u32, Vec<Vec<SmoothChoice>>> = BTreeMap::new();
        let f32s = |b: Vec<u8>| -> Vec<f32> {
            b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect()
        };
        for l in 0..n_layers {
            let mean = st.tensor(&format!("layer{l}.key_mean")).map_err(|e| bad(format!("layer{l}.key_mean: {e}")))?;
            let get_shaped = |name: &str, dtype: safetensors::Dtype, shape: &[usize]| -> Result<Vec<u8>> {
                let t = st.tensor(&format!("layer{l}.{name}")).map_err(|e| bad(format!("layer{l}.{name}: {e}")))?;
                if t.dtype() != dtype || t.shape() != shape {
                    return Err(bad(format!("layer{l}.{name} is {:?} {:?}", t.dtype(), t.shape())));
                }
                Ok(t.data().to_vec())
            };
            let get = |name: &str, dtype| get_shaped(name, dtype, &[kv_heads, head_dim]);
            let rotation = |name: &str| -> Result<Option<Vec<f32>>> {
                if st.tensor(&format!("layer{l}.{name}")).is_err() {
                    return Ok(None);
                }
                let b = get_shaped(name, safetensors::Dtype::F32, &[kv_heads, head_dim, head_dim])?;
                Ok(Some(f32s(b)))
            };
            if mean.dtype() != safetensors::Dtype::F32 {
                return Err(bad(format!("layer{l}.key_mean is {:?}", mean.dtype())));
            }
            let u16s = |b: Vec<u8>| b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            // An absent key_std is all ones (no smoothing); a present one is validated as
            // key scales (finite, > 0) below.
            let key_std = match st.tensor(&format!("layer{l}.key_std")) {
                Ok(_) => f32s(get("key_std", safetensors::Dtype::F32)?),
                Err(_) => vec![1.0; kv_heads * head_dim],
            };
            let c = LayerCalibration {
                key_mean: f32s(get("key_mean", safetensors::Dtype::F32)?),
                key_scale: key_std,
                key_perm: u16s(get("key_perm", safetensors::Dtype::U16)?),
                value_perm: u16s(get("value_perm", safetensors::Dtype::U16)?),
                key_rotation: rotation("key_rotation")?,
                value_rotation: rotation("value_rotation")?,
            };
            c.check_orthogonal(kv_heads, head_dim).map_err(|e| bad(format!("layer {l}: {e}")))?;
            layers.push(c);
            // Measured smoothing exponents: on every layer or on none, each one of
            // SMOOTH_ALPHAS.
            for bits in [2u32, 4] {
                let name = format!("key_alpha_k{bits}");
                let has = st.tensor(&format!("layer{l}.{name}")).is_ok();
                let before = key_smoothing.get(&bits).map_or(0, Vec::len);
                if (has && before != l) || (!has && before > 0) {
                    return Err(bad(format!(
                        "layer{l}.{name}: the smoothing choice must be on every layer or on none"
                    )));
                }
                if !has {
                    continue;
                }
                let u32s = |name: &str, allowed: &[u32]| -> Result<Vec<u32>> {
                    let b = get_shaped(name, safetensors::Dtype::U32, &[kv_heads])?;
                    let a: Vec<u32> = b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4"))).collect();
                    match a.iter().find(|x| !allowed.contains(x)) {
                        Some(x) => Err(bad(format!("layer{l}.{name} holds {x} (not one of {allowed:?})"))),
                        None => Ok(a),
                    }
                };
                let alpha = u32s(&name, &SMOOTH_ALPHAS)?;
                let knee_name = format!("key_knee_k{bits}");
                let knee = if st.tensor(&format!("layer{l}.{knee_name}")).is_ok() {
                    u32s(&knee_name, &SMOOTH_KNEES)?
                } else {
                    vec![0; kv_heads]
                };
                let heads = alpha.iter().zip(&knee).map(|(&alpha, &knee)| SmoothChoice { alpha, knee }).collect();
                key_smoothing.entry(bits).or_default().push(heads);
            }
        }
        Ok(Self { layers, kv_heads, head_dim, metadata, key_smoothing })
    }

    /// Reads a calibration file.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::Input(format!("reading {}: {e}", path.display())))?;
        Self::from_safetensors(&bytes)
    }
}

/// Channel order that sorts the channels of `rows` (`[n][d]`) by root mean square,
/// ascending (ties by channel index).
pub fn sort_by_rms(rows: &[f32], d: usize) -> Vec<u16> {
    let n = (rows.len() / d).max(1);
    let mut ms = vec![0f64; d];
    for r in rows.chunks_exact(d) {
        ms.iter_mut().zip(r).for_each(|(m, &x)| *m += (x as f64) * (x as f64));
    }
    let mut order: Vec<u16> = (0..d as u16).collect();
    order.sort_by(|&a, &b| (ms[a as usize] / n as f64).total_cmp(&(ms[b as usize] / n as f64)).then(a.cmp(&b)));
    order
}

/// Calibration of one layer from its keys and values `[tokens][kv_heads][head_dim]`
/// (post-RoPE keys); positions before [`SKIP_POSITIONS`] are left out. `key_scale`
/// holds the key channel standard deviations (see [`Calibration::layers`]).
pub fn calibrate_layer(k: &[f32], v: &[f32], kv_heads: usize, head_dim: usize) -> Result<LayerCalibration> {
    crate::config::check_head_dim(head_dim)?;
    if kv_heads == 0 {
        return Err(Error::Shape("calibration of 0 KV heads".into()));
    }
    let d = head_dim;
    let row = kv_heads * d;
    let t = k.len() / row;
    if t <= SKIP_POSITIONS || k.len() != v.len() || !k.len().is_multiple_of(row) {
        return Err(Error::Shape(format!("{t} calibration tokens (more than {SKIP_POSITIONS} are needed)")));
    }
    let used = t - SKIP_POSITIONS;
    let mut out = LayerCalibration::identity(kv_heads, d);
    for h in 0..kv_heads {
        let head = |x: &[f32], p: usize| x[p * row + h * d..p * row + (h + 1) * d].to_vec();
        let mut mean = vec![0f64; d];
        for p in SKIP_POSITIONS..t {
            mean.iter_mut().zip(head(k, p)).for_each(|(m, x)| *m += x as f64 / used as f64);
        }
        let rotate = |x: Vec<f64>| -> Vec<f32> {
            let mut x = x;
            crate::reference::fwht(&mut x);
            x.iter().map(|&y| y as f32).collect()
        };
        let (mut kr, mut vr) = (Vec::with_capacity(used * d), Vec::with_capacity(used * d));
        for p in SKIP_POSITIONS..t {
            kr.extend(rotate(head(k, p).iter().zip(&mean).map(|(&x, m)| x as f64 - m).collect()));
            vr.extend(rotate(head(v, p).iter().map(|&x| x as f64).collect()));
        }
        out.key_mean[h * d..(h + 1) * d].iter_mut().zip(&mean).for_each(|(o, &m)| *o = m as f32);
        let mut var = vec![0f64; d];
        for p in SKIP_POSITIONS..t {
            var.iter_mut().zip(head(k, p)).zip(&mean).for_each(|((s, x), m)| *s += (x as f64 - m).powi(2));
        }
        let sigma: Vec<f64> = var.iter().map(|&s| (s / used as f64).sqrt()).collect();
        let floor = (1e-6 * sigma.iter().sum::<f64>() / d as f64).max(f64::MIN_POSITIVE);
        let std = out.key_scale[h * d..(h + 1) * d].iter_mut();
        std.zip(&sigma).for_each(|(o, &s)| *o = (s.max(floor) as f32).max(f32::MIN_POSITIVE));
        out.key_perm[h * d..(h + 1) * d].copy_from_slice(&sort_by_rms(&kr, d));
        out.value_perm[h * d..(h + 1) * d].copy_from_slice(&sort_by_rms(&vr, d));
    }
    Ok(out)
}

/// What [`calibrate_with`] measures besides the key and value statistics.
#[derive(Clone, Debug)]
pub struct CalibrateOptions<'a> {
    /// Learned rotations (OptR) trained for this quantizer, if any.
    pub optr: Option<&'a OptrOptions>,
    /// The cache configurations (one per key bit width) whose key quantizer the smoothing
    /// exponent of each layer and KV head is chosen for ([`measure_smoothing`]); their
    /// sinks, window and page size say which keys a query reads quantized.
    pub smooth_for: Vec<crate::CacheConfig>,
    /// Query positions per query head the measurement averages over.
    pub queries: usize,
    /// Detected sinks kept exact in the measurement, as the recipe keeps them in f16
    /// (`None`: none): found by `detector` over the first [`super::DETECT_PREFILL`] tokens.
    pub protect: Option<(super::sinks::Detector, usize)>,
    /// The loss the smoothing choice minimizes.
    pub loss: SmoothLoss,
}

/// What [`measure_smoothing`] measures of a smoothing choice per query.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SmoothLoss {
    /// `KL(p || p_hat)` of the attention distributions (the presets' recipe).
    #[default]
    AttentionKl,
    /// The attention output's error through the layer's output projection (and the gains
    /// of a post-attention norm): `|| (sum_j (p_j - p_hat_j) v_j) W_o,h ||^2` with exact
    /// values, what the error of one query head adds to the residual stream (`rotkv
    /// calibrate --smooth-loss output`: an experiment, not better than the KL on the
    /// quality table). Per query head: the cross terms between the heads of a group are
    /// left out, as is a post-attention norm's division by the token's RMS.
    Output,
}

impl CalibrateOptions<'_> {
    /// The presets' key quantizers (`k2v2` for 2-bit keys, `k4v2` for 4-bit keys: k4v4
    /// quantizes keys as k4v2 does) for `head_dim`, [`SMOOTH_QUERIES`] queries, the
    /// recipe's detected sinks, no learned rotations.
    pub fn presets(head_dim: usize) -> Self {
        Self {
            optr: None,
            smooth_for: vec![crate::CacheConfig::k2v2(head_dim), crate::CacheConfig::k4v2(head_dim)],
            queries: SMOOTH_QUERIES,
            protect: Some((RECIPE_DETECTOR, RECIPE_SINKS)),
            loss: SmoothLoss::AttentionKl,
        }
    }
}

/// The fewest calibration tokens [`measure_smoothing`] takes for `config`: sinks,
/// window and one page before the first query, then room for the queries.
pub fn smoothing_min_tokens(config: &crate::CacheConfig) -> usize {
    config.sinks + config.window + config.page_size + 16
}

/// One layer's activations and statistics that [`measure_smoothing`] reads.
#[derive(Clone, Copy, Debug)]
pub struct SmoothData<'a> {
    /// Queries, `[T][heads][head_dim]` (post-RoPE, the model's activations).
    pub q: &'a [f32],
    /// Keys, `[T][kv_heads][head_dim]` (post-RoPE).
    pub k: &'a [f32],
    /// Values, `[T][kv_heads][head_dim]` (read by [`SmoothLoss::Output`] only).
    pub v: &'a [f32],
    /// The key mean per KV head and channel (`[kv_heads][head_dim]`).
    pub key_mean: &'a [f32],
    /// The centered keys' channel standard deviations (`[kv_heads][head_dim]`).
    pub sigma: &'a [f32],
    /// Positions the cache keeps in f16 (the detected sinks).
    pub protected: &'a [u32],
    /// For [`SmoothLoss::Output`]: per query head the metric of [`output_metric`]
    /// (`head_dim x head_dim`, row-major); `None` measures [`SmoothLoss::AttentionKl`].
    pub out_metric: Option<&'a [Vec<f64>]>,
}

/// The decode-faithful error key smoothing leaves, per KV head of one layer: for each
/// choice of [`smooth_choices`], the mean over query heads and `queries` query positions
/// of the loss of one query. The cache of `config` holds the keys centered (`key_mean`),
/// divided by the smoothing scales of `sigma` for the choice ([`smoothing_scales_knee`]),
/// Hadamard-rotated and quantized with the configuration's key quantizer (bits, group,
/// clip, f16 scale and zero) wherever it would hold them quantized (after the sinks,
/// before the recent window as the cache's pages fill, and not at `protected`
/// positions), and multiplies the query by the same scales. With `p` the exact attention
/// distribution of the query over the keys it sees and `p_hat` the cache's, the loss is
/// `KL(p || p_hat)` without `out_metric`, and with it the squared norm of what the error
/// adds through the output projection, `x M x^T` for `x = sum_j (p_j - p_hat_j) v_j` and
/// the query head's metric `M` (values exact: smoothing does not touch them). Query
/// positions are spread evenly from the first one that reads a quantized page to the
/// end. Returns `[kv head][choice]`.
pub fn measure_smoothing(
    c: &super::llama::LlamaConfig,
    layer: usize,
    data: &SmoothData<'_>,
    config: &crate::CacheConfig,
    queries: usize,
) -> Result<Vec<Vec<f64>>> {
    let (d, hkv, hq) = (c.head_dim, c.kv_heads, c.heads);
    if config.head_dim != d {
        return Err(Error::Shape(format!("a cache of head_dim {} for a model of head_dim {d}", config.head_dim)));
    }
    let fmt = config.format()?;
    let SmoothData { q, k, v, key_mean, sigma, protected, out_metric } = *data;
    let t_all = k.len() / (hkv * d);
    if k.len() != t_all * hkv * d
        || q.len() != t_all * hq * d
        || key_mean.len() != hkv * d
        || sigma.len() != hkv * d
        || (out_metric.is_some() && v.len() != k.len())
        || out_metric.is_some_and(|m| m.len() != hq || m.iter().any(|m| m.len() != d * d))
    {
        return Err(Error::Shape("measure_smoothing: activations and statistics of different shapes".into()));
    }
    let first = config.sinks + config.window + config.page_size;
    if t_all < smoothing_min_tokens(config) || queries == 0 {
        return Err(Error::Shape(format!(
            "{t_all} calibration tokens: measuring the smoothing of this cache takes at least {}",
            smoothing_min_tokens(config)
        )));
    }
    let n_q = queries.min(t_all - first);
    let qpos: Vec<usize> = (0..n_q).map(|i| first + i * (t_all - first) / n_q).collect();
    let (bits, group, clip) = (config.key_bits, config.group_size, fmt.clip(false));
    let scale = c.attn_scale as f64;
    let per_group = hq / hkv;
    let sinks = config.sinks;
    let q_end = |t: usize| sinks + fmt.quantized_len(t as u32 + 1) as usize;
    let last_q = q_end(t_all - 1);
    let window_left = c.window_left(layer);
    let visible = |t: usize| window_left.map_or(0, |w| t.saturating_sub(w))..=t;
    let is_protected: Vec<bool> = (0..t_all).map(|p| protected.contains(&(p as u32))).collect();
    // (query head, position) of every query, in the order of `exact`.
    let jobs: Vec<(usize, usize)> = (0..per_group).flat_map(|g| qpos.iter().map(move |&t| (g, t))).collect();
    let choices = smooth_choices();
    let mut out = vec![vec![0f64; choices.len()]; hkv];
    for h in 0..hkv {
        let mu = &key_mean[h * d..(h + 1) * d];
        let sig = &sigma[h * d..(h + 1) * d];
        let key = |p: usize| &k[(p * hkv + h) * d..(p * hkv + h + 1) * d];
        let qrow = |qh: usize, t: usize| &q[(t * hq + qh) * d..(t * hq + qh + 1) * d];
        // Exact logits of every (query head, query position): keys of the visible range.
        let exact: Vec<Vec<f64>> = jobs
            .iter()
            .map(|&(g, t)| visible(t).map(|p| scale * dot(qrow(h * per_group + g, t), key(p))).collect())
            .collect();
        let exact_p: Vec<Vec<f64>> = if out_metric.is_some() {
            exact
                .iter()
                .map(|x| {
                    let mut p = x.clone();
                    optr::softmax(&mut p);
                    p
                })
                .collect()
        } else {
            Vec::new()
        };
        for (a, choice) in choices.iter().enumerate() {
            let s: Vec<f64> = smoothing_scales_knee(sig, d, choice.alpha as f64 / 100.0, choice.knee)
                .iter()
                .map(|&x| x as f64)
                .collect();
            // The quantization error of every key the cache may hold quantized, in the
            // rotated, smoothed space.
            let mut err = vec![0f64; last_q.saturating_sub(sinks) * d];
            for (p, x) in (sinks..last_q).zip(err.chunks_exact_mut(d)) {
                x.iter_mut().zip(key(p)).zip(mu).zip(&s).for_each(|(((o, &x), &m), &s)| *o = (x as f64 - m as f64) / s);
                crate::reference::fwht(x);
                for e in x.chunks_exact_mut(group) {
                    let deq =
                        crate::reference::dequantize_group(&crate::reference::quantize_group_clipped(e, bits, clip));
                    e.iter_mut().zip(&deq).for_each(|(e, y)| *e = y - *e);
                }
            }
            let mut loss = 0f64;
            for (i, &(g, t)) in jobs.iter().enumerate() {
                let qh = h * per_group + g;
                // The query, scaled and rotated as the cache does.
                let mut qr: Vec<f64> = qrow(qh, t).iter().zip(&s).map(|(&x, &s)| x as f64 * s).collect();
                crate::reference::fwht(&mut qr);
                let lo = *visible(t).start();
                let mut approx = exact[i].clone();
                for p in lo.max(sinks)..q_end(t) {
                    if !is_protected[p] {
                        approx[p - lo] += scale * optr::dot(&qr, &err[(p - sinks) * d..(p - sinks + 1) * d]);
                    }
                }
                loss += match out_metric {
                    None => kl_divergence(&exact[i], &approx),
                    Some(metrics) => {
                        optr::softmax(&mut approx);
                        let mut delta = vec![0f64; d];
                        for (j, p) in visible(t).enumerate() {
                            let w = exact_p[i][j] - approx[j];
                            let vr = &v[(p * hkv + h) * d..(p * hkv + h + 1) * d];
                            delta.iter_mut().zip(vr).for_each(|(o, &x)| *o += w * x as f64);
                        }
                        optr::metric(&delta, &metrics[qh])
                    }
                };
            }
            out[h][a] = loss / jobs.len() as f64;
        }
    }
    Ok(out)
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// `KL(softmax(p) || softmax(q))` of two logit vectors, in f64.
fn kl_divergence(p: &[f64], q: &[f64]) -> f64 {
    let lse = |x: &[f64]| {
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        m + x.iter().map(|&v| (v - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p), lse(q));
    p.iter().zip(q).map(|(&a, &b)| (a - lp).exp() * ((a - lp) - (b - lq))).sum::<f64>().max(0.0)
}

/// The index into [`smooth_choices`] of the smallest loss (the earlier choice of equals:
/// no knee before a knee, the smaller exponent first).
pub fn best_choice(loss: &[f64]) -> usize {
    (0..loss.len()).fold(0, |b, i| if loss[i] < loss[b] { i } else { b })
}

/// Runs `tokens` through the model (exact attention) and calibrates every layer: key
/// means, key channel standard deviations and permutations, and with `optr` the learned key and value rotations too
/// (trained on the centered keys; see [`super::optr`]). Where the text is long enough
/// ([`smoothing_min_tokens`] of the presets), the smoothing exponent per layer and KV
/// head is chosen for the presets' key quantizers too ([`CalibrateOptions::presets`],
/// [`Calibration::key_smoothing`]). `progress(layer)` is called as each layer's rotations
/// are done.
pub fn calibrate(
    model: &Llama,
    tokens: &[u32],
    optr: Option<&OptrOptions>,
    progress: &mut dyn FnMut(usize),
) -> Result<Calibration> {
    let mut opts = CalibrateOptions { optr, ..CalibrateOptions::presets(model.config.head_dim) };
    opts.smooth_for.retain(|cfg| tokens.len() >= smoothing_min_tokens(cfg));
    calibrate_with(model, tokens, &opts, progress)
}

/// [`calibrate`] with the options spelled out: the smoothing choice is measured for every
/// configuration of [`CalibrateOptions::smooth_for`] (an error where the text is too short
/// for one, or two share a key bit width). The mean loss per choice is kept in the
/// metadata (`smooth.k<bits>`), and each KV head's loss per choice (`smooth.k<bits>.loss`).
pub fn calibrate_with(
    model: &Llama,
    tokens: &[u32],
    opts: &CalibrateOptions<'_>,
    progress: &mut dyn FnMut(usize),
) -> Result<Calibration> {
    use rayon::prelude::*;
    let c = &model.config;
    let optr = opts.optr;
    // Before the forward pass: the calibration rotates by the Hadamard transform and is
    // only useful to the cache, both of which need 64, 128 or 256 channels.
    crate::config::check_head_dim(c.head_dim).map_err(|_| {
        Error::Unsupported(format!("calibration of a model with head_dim {} (supported: 64, 128, 256)", c.head_dim))
    })?;
    for (i, cfg) in opts.smooth_for.iter().enumerate() {
        if opts.smooth_for[..i].iter().any(|o| o.key_bits == cfg.key_bits) {
            return Err(Error::Value(format!("two smoothing configurations for {}-bit keys", cfg.key_bits)));
        }
        if tokens.len() < smoothing_min_tokens(cfg) {
            return Err(Error::Shape(format!(
                "{} calibration tokens: measuring the smoothing for {}-bit keys takes at least {}",
                tokens.len(),
                cfg.key_bits,
                smoothing_min_tokens(cfg)
            )));
        }
    }
    let measure = !opts.smooth_for.is_empty();
    let protected: Vec<Vec<u32>> = match opts.protect {
        Some((how, n)) if measure => {
            let skip = opts.smooth_for.iter().map(|cfg| cfg.sinks).max().unwrap_or(SKIP_POSITIONS);
            super::sinks::detect(model, &tokens[..super::DETECT_PREFILL.min(tokens.len())], n, skip, how)?
        }
        _ => vec![Vec::new(); c.layers],
    };
    let mut acts: Vec<[Vec<f32>; 3]> = vec![Default::default(); c.layers];
    let mut keep = |a: &LayerActivations<'_>| {
        let [q, k, v] = &mut acts[a.layer];
        k.extend_from_slice(a.k);
        v.extend_from_slice(a.v);
        if optr.is_some() || measure {
            q.extend_from_slice(a.q);
        }
    };
    let rows: Vec<Row> = (0..tokens.len()).map(|p| Row { seq: 0, pos: p }).collect();
    model.forward(tokens, &rows, &mut ExactAttention::new(c), Some(&mut keep), c.layers)?;
    let mut layers = Vec::with_capacity(c.layers);
    let mut metadata = BTreeMap::new();
    let mut gains = Vec::new();
    for (l, [q, k, v]) in acts.iter().enumerate() {
        let mut cal = calibrate_layer(k, v, c.kv_heads, c.head_dim)?;
        if let Some(o) = optr {
            let data = optr::layer_data(
                q,
                k,
                v,
                &cal.key_mean,
                &model.layers[l].wo.to_matrix(),
                c.heads,
                c.kv_heads,
                c.head_dim,
                o,
            )?;
            let rot = optr::learn_layer(&data, o);
            for (h, (kr, vr)) in rot.reports.iter().enumerate() {
                metadata.insert(
                    format!("optr.layer{l}.head{h}"),
                    format!(
                        "held-out key loss {:.5} -> {:.5} (step {}), value loss {:.5} -> {:.5} (step {})",
                        kr.hadamard, kr.learned, kr.step, vr.hadamard, vr.learned, vr.step
                    ),
                );
                gains.push((kr.learned / kr.hadamard, vr.learned / vr.hadamard));
            }
            (cal.key_rotation, cal.value_rotation) = (Some(rot.key), Some(rot.value));
            progress(l);
        }
        layers.push(cal);
    }
    if !gains.is_empty() {
        let n = gains.len() as f64;
        metadata.insert(
            "optr.mean_loss_ratio".into(),
            format!(
                "keys {:.4}, values {:.4} (learned / Hadamard, held-out loss)",
                gains.iter().map(|g| g.0).sum::<f64>() / n,
                gains.iter().map(|g| g.1).sum::<f64>() / n
            ),
        );
    }
    let mut key_smoothing = BTreeMap::new();
    let choices = smooth_choices();
    // The output projection's metric per layer and query head, for the output loss.
    let metrics: Vec<Vec<Vec<f64>>> = match opts.loss {
        SmoothLoss::Output if measure => (0..c.layers)
            .into_par_iter()
            .map(|l| {
                let w = &model.layers[l];
                output_metric(&w.wo.to_matrix(), w.post_norms.as_ref().map(|[pa, _]| &pa[..]), c.heads, c.head_dim)
            })
            .collect(),
        _ => vec![Vec::new(); c.layers],
    };
    let is_kl = opts.loss == SmoothLoss::AttentionKl;
    let what = match opts.loss {
        SmoothLoss::AttentionKl => "attention KL",
        SmoothLoss::Output => "output error",
    };
    for cfg in &opts.smooth_for {
        // [layer][kv head][choice]
        let loss: Vec<Vec<Vec<f64>>> = (0..c.layers)
            .into_par_iter()
            .map(|l| {
                let [q, k, v] = &acts[l];
                let cal = &layers[l];
                let data = SmoothData {
                    q,
                    k,
                    v,
                    key_mean: &cal.key_mean,
                    sigma: &cal.key_scale,
                    protected: &protected[l],
                    out_metric: (opts.loss == SmoothLoss::Output).then_some(&metrics[l][..]),
                };
                measure_smoothing(c, l, &data, cfg, opts.queries)
            })
            .collect::<Result<_>>()?;
        let chosen: Vec<Vec<SmoothChoice>> =
            loss.iter().map(|heads| heads.iter().map(|x| choices[best_choice(x)]).collect()).collect();
        let n = (c.layers * c.kv_heads) as f64;
        let mean = |f: &dyn Fn(&Vec<f64>) -> f64| loss.iter().flatten().map(f).sum::<f64>() / n;
        let mut summary = format!("mean {what} over KV heads:");
        for (a, choice) in choices.iter().enumerate().filter(|(_, c)| c.knee == 0) {
            write_kl(&mut summary, &format!(" alpha {choice} on every head"), mean(&|x| x[a]), is_kl);
        }
        write_kl(&mut summary, " chosen per head", mean(&|x| x[best_choice(x)]), is_kl);
        metadata.insert(format!("smooth.k{}", cfg.key_bits), summary);
        let per_head: Vec<String> =
            loss.iter().flatten().map(|x| x.iter().map(|v| format!("{v:.3e}")).collect::<Vec<_>>().join("/")).collect();
        metadata.insert(format!("smooth.k{}.loss", cfg.key_bits), per_head.join(" "));
        key_smoothing.insert(cfg.key_bits, chosen);
    }
    Ok(Calibration { layers, kv_heads: c.kv_heads, head_dim: c.head_dim, metadata, key_smoothing })
}

/// Per query head `qh`, the `head_dim x head_dim` matrix `M` (row-major) with
/// `x M x^T = sum_r (g_r * sum_a wo[r][qh * head_dim + a] * x[a])^2`: the squared norm of
/// what an attention output `x` of that head adds through the output projection `wo`
/// (`dim x heads * head_dim`, the model's `[out][in]` layout) and, where the layer has
/// one (Gemma 3), the gains `g` of its post-attention norm (without the norm's division
/// by the token's RMS: a per-token factor left out). [`SmoothData::out_metric`].
pub fn output_metric(wo: &super::math::Matrix, post_norm: Option<&[f32]>, heads: usize, d: usize) -> Vec<Vec<f64>> {
    (0..heads)
        .map(|qh| {
            let mut m = vec![0.0; d * d];
            for r in 0..wo.rows {
                let w = &wo.row(r)[qh * d..(qh + 1) * d];
                let g2 = post_norm.map_or(1.0, |g| (g[r] as f64).powi(2));
                for a in 0..d {
                    let wa = g2 * w[a] as f64;
                    m[a * d..(a + 1) * d].iter_mut().zip(w).for_each(|(x, &wb)| *x += wa * wb as f64);
                }
            }
            m
        })
        .collect()
}

/// Appends `what` and the loss to a summary: a KL as a decimal, an output error (of the
/// model's own scale) in scientific notation.
fn write_kl(s: &mut String, what: &str, loss: f64, kl: bool) {
    if !s.ends_with(':') {
        s.push(',');
    }
    if kl { s.push_str(&format!("{what} {loss:.5}")) } else { s.push_str(&format!("{what} {loss:.4e}")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_order_of_synthetic_keys() {
        // 2 heads of 64 channels; head 1 has a bias of 3 on channel 5.
        let (hkv, d, t) = (2, 64, 40);
        let mut k = vec![0f32; t * hkv * d];
        for p in 0..t {
            for c in 0..d {
                let wobble = ((p * 7 + c * 3) % 11) as f32 / 11.0 - 0.5;
                k[p * hkv * d + c] = wobble;
                k[p * hkv * d + d + c] = wobble * 0.5 + if c == 5 { 3.0 } else { 0.0 };
            }
        }
        let cal = calibrate_layer(&k, &k, hkv, d).unwrap();
        cal.validate(hkv, d).unwrap();
        assert!((cal.key_mean[d + 5] - 3.0).abs() < 0.05, "{}", cal.key_mean[d + 5]);
        assert!(cal.key_mean[5].abs() < 0.1);
        // The value order sorts rotated channels by RMS: the last holds the largest.
        let ms = |c: usize| -> f64 {
            (SKIP_POSITIONS..t)
                .map(|p| {
                    let mut x: Vec<f64> = k[p * hkv * d + d..p * hkv * d + 2 * d].iter().map(|&v| v as f64).collect();
                    crate::reference::fwht(&mut x);
                    x[c] * x[c]
                })
                .sum()
        };
        let order = &cal.value_perm[d..];
        // (The file sorts f32 rotations, this check f64 ones: equal up to f32 rounding.)
        assert!(order.windows(2).all(|w| ms(w[0] as usize) <= ms(w[1] as usize) * (1.0 + 1e-5) + 1e-9));
        assert!(calibrate_layer(&k[..4 * hkv * d], &k[..4 * hkv * d], hkv, d).is_err());
    }

    #[test]
    fn file_round_trip_and_bad_files() {
        let mut c = LayerCalibration::identity(3, 64);
        c.key_mean[7] = 1.5;
        c.key_perm.swap(0, 63);
        let cal = Calibration {
            layers: vec![c.clone(), c],
            kv_heads: 3,
            head_dim: 64,
            metadata: BTreeMap::new(),
            key_smoothing: BTreeMap::new(),
        };
        let bytes = cal.to_safetensors().unwrap();
        let back = Calibration::from_safetensors(&bytes).unwrap();
        assert_eq!(back.layers, cal.layers);
        assert_eq!(
            back.layer(1, Use { center: false, reorder: true, learned: false, smooth: None }).key_mean,
            vec![0.0; 192]
        );
        assert!(Calibration::from_safetensors(b"not a file").is_err());
        // A permutation that is not one is refused.
        let mut broken = cal.clone();
        broken.layers[1].value_perm[3] = 4;
        assert!(Calibration::from_safetensors(&broken.to_safetensors().unwrap()).is_err());
        // Learned rotations round trip; a matrix that is not orthogonal is refused, also
        // one whose rows and columns all have unit norm (blocks of [[s, s], [s, s]]).
        let (h, d) = (3, 64);
        let had = super::optr::hadamard_matrix(d);
        let mut learned = cal.clone();
        for l in &mut learned.layers {
            l.key_rotation = Some((0..h).flat_map(|_| had.iter().map(|&x| x as f32)).collect());
        }
        let back = Calibration::from_safetensors(&learned.to_safetensors().unwrap()).unwrap();
        assert_eq!(back.layers, learned.layers);
        assert!(back.has_learned_rotations() && !cal.has_learned_rotations());
        assert_eq!(back.layer(0, Use { learned: true, ..Use::default() }).key_rotation, learned.layers[0].key_rotation);
        assert_eq!(back.layer(0, Use::default()).key_rotation, None);
        let s = std::f32::consts::FRAC_1_SQRT_2;
        let mut unit_not_orthogonal = vec![0f32; h * d * d];
        for hh in 0..h {
            for i in 0..d {
                let pair = i & !1;
                for j in [pair, pair + 1] {
                    unit_not_orthogonal[hh * d * d + i * d + j] = s;
                }
            }
        }
        let mut bad = learned.clone();
        bad.layers[1].value_rotation = Some(unit_not_orthogonal);
        bad.layers[1].validate(h, d).unwrap();
        assert!(bad.layers[1].check_orthogonal(h, d).is_err());
        assert!(Calibration::from_safetensors(&bad.to_safetensors().unwrap()).is_err());
        bad.layers[1].value_rotation = Some(vec![0.5; h * d * d]);
        assert!(bad.layers[1].validate(h, d).is_err());
        bad.layers[1].value_rotation = Some(vec![0.5; 10]);
        assert!(bad.layers[1].validate(h, d).is_err());
    }

    #[test]
    fn key_std_round_trip_smoothing_scales_and_bad_values() {
        let (h, d) = (3, 64);
        let mut c = LayerCalibration::identity(h, d);
        c.key_scale.iter_mut().enumerate().for_each(|(i, s)| *s = 0.5 + (i % 13) as f32 * 0.75);
        let cal = Calibration {
            layers: vec![c.clone(), c],
            kv_heads: h,
            head_dim: d,
            metadata: BTreeMap::new(),
            key_smoothing: BTreeMap::new(),
        };
        let back = Calibration::from_safetensors(&cal.to_safetensors().unwrap()).unwrap();
        assert_eq!(back.layers, cal.layers);
        assert!(back.has_key_std());
        // No key_std tensor (an older file, or not calibrated): ones, and no smoothing.
        let plain = Calibration { layers: vec![LayerCalibration::identity(h, d); 2], ..cal.clone() };
        let bytes = plain.to_safetensors().unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert!(st.tensor("layer0.key_std").is_err());
        let back_plain = Calibration::from_safetensors(&bytes).unwrap();
        assert!(!back_plain.has_key_std());
        let smooth = Use { smooth: Some(Smooth::Alpha(50)), ..Use::default() };
        assert_eq!(back_plain.layer(1, smooth).key_scale, vec![1.0; h * d]);
        // Scales: sigma^alpha normalized to mean 1 per head; alpha 0 is no smoothing.
        let s = back.layer(1, smooth).key_scale;
        for (head, sigma) in s.chunks_exact(d).zip(cal.layers[1].key_scale.chunks_exact(d)) {
            let mean = head.iter().map(|&x| x as f64).sum::<f64>() / d as f64;
            assert!((mean - 1.0).abs() < 1e-6, "{mean}");
            let r = |c: usize| head[c] as f64 / (sigma[c] as f64).sqrt();
            assert!((1..d).all(|c| (r(c) / r(0) - 1.0).abs() < 1e-6));
        }
        assert_eq!(back.layer(1, Use { smooth: Some(Smooth::Alpha(0)), ..Use::default() }).key_scale, vec![1.0; h * d]);
        assert_eq!(back.layer(1, Use::default()).key_scale, vec![1.0; h * d]);
        // Zero, negative, NaN and infinite standard deviations are refused.
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let mut broken = cal.clone();
            broken.layers[1].key_scale[5] = bad;
            let e = Calibration::from_safetensors(&broken.to_safetensors().unwrap()).unwrap_err();
            assert!(matches!(e, Error::Calibration(_)) && e.to_string().contains("key_scale"), "{bad}: {e}");
        }
    }

    #[test]
    fn key_std_of_synthetic_keys() {
        // Channel c of head 0 has standard deviation about (1 + c % 4); head 1 has a
        // constant channel 9 (sigma 0: floored, still > 0).
        let (hkv, d, t) = (2, 64, 400);
        let mut k = vec![0f32; t * hkv * d];
        for p in 0..t {
            let sign = if (p * 2654435761) % 7 < 3 { -1.0 } else { 1.0 };
            for c in 0..d {
                let w = (((p * 31 + c * 17) % 23) as f32 / 22.0 - 0.5) * 2.0 * 3f32.sqrt() * sign;
                k[p * hkv * d + c] = 2.0 + w * (1 + c % 4) as f32;
                k[p * hkv * d + d + c] = if c == 9 { 4.0 } else { w };
            }
        }
        let cal = calibrate_layer(&k, &k, hkv, d).unwrap();
        cal.validate(hkv, d).unwrap();
        for c in 0..d {
            let r = cal.key_scale[c] / cal.key_scale[c % 4];
            assert!((r - 1.0).abs() < 0.2, "channel {c}: {}", cal.key_scale[c]);
        }
        assert!(cal.key_scale[3] > 2.5 * cal.key_scale[0]);
        assert!(cal.key_scale[d + 9] > 0.0 && cal.key_scale[d + 9] < 1e-5);
    }

    /// `Smooth::Auto` smooths a head at alpha 0.5 exactly when its largest channel
    /// standard deviation is at least 3 times the head's mean, and leaves it alone (scales
    /// exactly one) otherwise.
    #[test]
    fn auto_smoothing_picks_heads_with_outlier_channels() {
        let d = 64;
        // Head 0: one channel at 2.9 times the mean; head 1: at 3.1 times; head 2: 18 times.
        let head = |ratio: f64| -> Vec<f32> {
            // n - 1 channels of 1 and one of x, with x / mean = ratio: x = ratio (n - 1) / (n - ratio).
            let n = d as f64;
            let x = ratio * (n - 1.0) / (n - ratio);
            (0..d).map(|c| if c == 7 { x as f32 } else { 1.0 }).collect()
        };
        let sigma: Vec<f32> = [2.9, 3.1, 18.0].iter().flat_map(|&r| head(r)).collect();
        let s = auto_smoothing_scales(&sigma, d);
        let r = outlier_ratios(&sigma, d);
        assert!(
            r.len() == 3 && (r[0] - 2.9).abs() < 1e-5 && (r[1] - 3.1).abs() < 1e-5 && (r[2] - 18.0).abs() < 1e-4,
            "{r:?}"
        );
        assert_eq!(&s[..d], &vec![1.0; d][..], "below the ratio: no smoothing");
        assert_eq!(&s[d..], &smoothing_scales(&sigma[d..], d, 0.5)[..], "above it: alpha 0.5");
        assert!(s[d + 7] > 1.5 && s[2 * d + 7] > s[d + 7]);
    }
}
