//! Cache configuration, presets, validation and per-layer calibration data.

use crate::error::{Error, Result};
use rotkv_kernels::layout::{Format, NO_CLIP};
use rotkv_kernels::params::{FLAG_ROTATE_KEYS, FLAG_ROTATE_VALUES};

/// Rotation applied to keys or values before quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotation {
    /// No rotation: the naive baseline (quantize the raw channels).
    None,
    /// The orthonormal Sylvester Hadamard transform in natural order, then the optional
    /// calibrated channel permutation.
    Hadamard,
}

/// Everything that fixes the byte format of a cache layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheConfig {
    /// Channels per head: 64, 128 or 256.
    pub head_dim: usize,
    /// Bits per key code: 2 or 4.
    pub key_bits: u32,
    /// Bits per value code: 2 or 4.
    pub value_bits: u32,
    /// Channels per quantization group: 32, 64, 128 or 256, at most `head_dim`.
    pub group_size: usize,
    /// Tokens per page: a power of two from 16 to 256.
    pub page_size: usize,
    /// Leading tokens kept in f16 (attention sinks).
    pub sinks: usize,
    /// Newest tokens kept in f16 (at least this many; up to `window + page_size - 1`).
    pub window: usize,
    /// Rotation of the keys.
    pub key_rotation: Rotation,
    /// Rotation of the values.
    pub value_rotation: Rotation,
    /// Fraction of each key group's min..max range the quantizer spans, about its
    /// midpoint (1.0: the whole range, as DESIGN.md defines it; 0.5 to 1.0). Values
    /// outside get the end codes. Decoding does not depend on it: only append reads it.
    pub key_clip: f32,
    /// The same for values.
    pub value_clip: f32,
    /// Room for protected positions per sequence and layer (0 to 32): detected attention
    /// sinks beyond the leading `sinks`, whose f16 rows are kept beside the window and
    /// read by decode instead of their quantized page slot. A sequence's positions are set
    /// with [`crate::KvCache::protect`] (or passed to [`crate::paged`]); each costs
    /// `4 * head_dim` bytes per KV head of the side store.
    pub protected: usize,
    /// KVarN variance normalization: 0 for none, else 1 to 8 Sinkhorn iterations
    /// (alternating channel and token RMS normalization of each page's rows) that give
    /// every head-page f16 channel scales for keys and values; channels are divided by
    /// them before quantization and multiplied back when read (`4 * head_dim` bytes per
    /// head-page). Reference and CPU backends only: the device kernels refuse it.
    pub channel_norm: u32,
}

impl CacheConfig {
    /// The default: 2-bit keys and values, Hadamard on both, group = whole head up to
    /// 128 channels, 64-token pages, 4 sinks, a 128-token window, and the key quantizer
    /// spanning 0.8 of each group's range (`key_clip`: on SmolLM2 it took k2v2's
    /// perplexity change from +34.8% to +10.2% uncalibrated, and to +4.1% with
    /// calibrated key centering; see the quality table in `docs/src/accuracy.md`). Values keep the whole
    /// range (clipping them measured slightly worse).
    pub fn k2v2(head_dim: usize) -> Self {
        Self {
            head_dim,
            key_bits: 2,
            value_bits: 2,
            group_size: head_dim.min(128),
            page_size: 64,
            sinks: 4,
            window: 128,
            key_rotation: Rotation::Hadamard,
            value_rotation: Rotation::Hadamard,
            key_clip: 0.8,
            value_clip: 1.0,
            protected: 0,
            channel_norm: 0,
        }
    }
    /// 4-bit keys, 2-bit values (keys dominate the error); whole ranges (4-bit keys
    /// measured no better clipped).
    pub fn k4v2(head_dim: usize) -> Self {
        Self { key_bits: 4, key_clip: 1.0, ..Self::k2v2(head_dim) }
    }
    /// 4-bit keys and values, whole ranges.
    pub fn k4v4(head_dim: usize) -> Self {
        Self { key_bits: 4, value_bits: 4, key_clip: 1.0, ..Self::k2v2(head_dim) }
    }
    /// The named presets, for command lines: `k2v2`, `k4v2`, `k4v4`.
    pub fn preset(name: &str, head_dim: usize) -> Result<Self> {
        match name {
            "k2v2" => Ok(Self::k2v2(head_dim)),
            "k4v2" => Ok(Self::k4v2(head_dim)),
            "k4v4" => Ok(Self::k4v4(head_dim)),
            other => Err(Error::Unsupported(format!("unknown preset {other:?} (k2v2, k4v2, k4v4)"))),
        }
    }

    /// Checks the configuration and returns the device-side [`Format`].
    pub fn format(&self) -> Result<Format> {
        let d = self.head_dim;
        check_head_dim(d)?;
        for (what, b) in [("key_bits", self.key_bits), ("value_bits", self.value_bits)] {
            if !rotkv_kernels::CODE_BITS.contains(&b) {
                return Err(Error::Unsupported(format!("{what} {b} (supported: 2, 4)")));
            }
        }
        let g = self.group_size;
        if !rotkv_kernels::GROUP_SIZES.iter().any(|&x| x as usize == g) || g > d {
            return Err(Error::Unsupported(format!(
                "group_size {g} for head_dim {d} (supported: 32, 64, 128, 256, at most head_dim)"
            )));
        }
        let p = self.page_size;
        if !p.is_power_of_two()
            || p < rotkv_kernels::MIN_PAGE_SIZE as usize
            || p > rotkv_kernels::MAX_PAGE_SIZE as usize
        {
            return Err(Error::Unsupported(format!("page_size {p} (a power of two from 16 to 256)")));
        }
        if self.sinks > 1024 || self.window > 1 << 16 {
            return Err(Error::Unsupported(format!(
                "sinks {} / window {} (at most 1024 sinks and 65536 window tokens)",
                self.sinks, self.window
            )));
        }
        if self.protected > rotkv_kernels::MAX_PROTECTED as usize {
            return Err(Error::Unsupported(format!(
                "protected {} (at most {} protected positions per sequence)",
                self.protected,
                rotkv_kernels::MAX_PROTECTED
            )));
        }
        if self.channel_norm > 8 {
            return Err(Error::Unsupported(format!("channel_norm {} (0 to 8 iterations)", self.channel_norm)));
        }
        let clip = |what: &str, c: f32| -> Result<u32> {
            if !(0.5..=1.0).contains(&c) {
                return Err(Error::Value(format!("{what} {c} (a fraction from 0.5 to 1.0)")));
            }
            Ok((c as f64 * NO_CLIP as f64).round() as u32)
        };
        let (key_clip, value_clip) = (clip("key_clip", self.key_clip)?, clip("value_clip", self.value_clip)?);
        debug_assert!(rotkv_kernels::is_instantiated(d as u32, self.key_bits, self.value_bits, g as u32));
        Ok(Format {
            head_dim: d as u32,
            key_bits: self.key_bits,
            value_bits: self.value_bits,
            group_size: g as u32,
            page_size: p as u32,
            sinks: self.sinks as u32,
            window: self.window as u32,
            key_clip,
            value_clip,
            protected: self.protected as u32,
            channel_norm: self.channel_norm,
        })
    }

    /// `FLAG_*` bits of the kernel parameter blocks.
    pub fn flags(&self) -> u32 {
        let mut f = 0;
        if self.key_rotation == Rotation::Hadamard {
            f |= FLAG_ROTATE_KEYS;
        }
        if self.value_rotation == Rotation::Hadamard {
            f |= FLAG_ROTATE_VALUES;
        }
        f
    }

    /// Bytes per quantized token per KV head (codes plus f16 scales and zeros, K and V).
    pub fn bytes_per_token(&self) -> Result<usize> {
        Ok(self.format()?.bytes_per_token() as usize)
    }

    /// Storage bits per cached element, averaged over keys and values, scales and zeros
    /// (and channel scales) included (the f16 sinks and window are not counted).
    pub fn bits_per_element(&self) -> f64 {
        let channel = if self.channel_norm > 0 { 16.0 / self.page_size as f64 } else { 0.0 };
        quantized_bits_per_element(self.key_bits, self.value_bits, self.group_size) + channel
    }

    /// Rows of a sequence per pass of a multi-token step (a prompt chunk appended and
    /// attended in passes: [`crate::KvCache::append_decode`],
    /// [`crate::device::StepBatch::with_passes`]): half the window, at least 1 (64 with
    /// the presets). The window holds at least `window` newest tokens after every append,
    /// so a row of a pass of `c` tokens sees its pass's earlier tokens and at least
    /// `window - c` tokens before the pass in f16: at least half a window, where
    /// token-by-token decode sees a whole one.
    pub fn pass_rows(&self) -> usize {
        (self.window / 2).max(1)
    }
}

/// Bits per element of a `(key_bits, value_bits, group)` quantizer with f16 scale and
/// zero per group, averaged over keys and values.
pub fn quantized_bits_per_element(key_bits: u32, value_bits: u32, group: usize) -> f64 {
    (key_bits + value_bits) as f64 / 2.0 + 32.0 / group as f64
}

/// The rotation of one KV head's keys or values, before its channel permutation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HeadRotation<'a> {
    /// No rotation.
    None,
    /// The orthonormal Sylvester Hadamard transform (FWHT).
    Hadamard,
    /// A dense orthogonal `D x D` matrix `R`, row-major: the rotated row is `x R`, the
    /// inverse `y R^T` (a learned rotation, see [`LayerCalibration::key_rotation`]).
    Dense(&'a [f32]),
}

impl From<Rotation> for HeadRotation<'static> {
    /// The rotation a configured [`Rotation`] stands for.
    fn from(r: Rotation) -> Self {
        match r {
            Rotation::None => HeadRotation::None,
            Rotation::Hadamard => HeadRotation::Hadamard,
        }
    }
}

/// Largest `|R R^T - I|` entry a dense rotation may have (f32 storage of an orthogonal
/// matrix computed in f64 is within 1e-6; the bound leaves room for matrices computed in
/// f32 elsewhere).
pub const ORTHOGONALITY_TOL: f64 = 1e-4;

/// Calibration data of one layer: per KV head, a key mean subtracted and a per-channel
/// key scale divided out before the rotation (the query is multiplied by the same
/// scale before its rotation), optional learned rotations replacing the Hadamard
/// transform, and channel permutations applied after the rotation.
///
/// A key row `k` of a head is stored as `rotate((k - key_mean) / key_scale)` (f32
/// subtraction, then IEEE f32 division, on every backend) and the query is rotated as
/// `rotate(q * key_scale)` (f32 product), so `q k^T` changes only by the constant
/// `q key_mean^T` (softmax-invariant) and the quantizer sees centered, smoothed channels.
/// Stored channel `j` of a rotated key is rotated channel `key_perm[j]` (likewise for
/// values). The identity permutations, a zero mean, scales of one and no learned
/// rotations (the default) change nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCalibration {
    /// `[num_kv_heads][head_dim]` key means.
    pub key_mean: Vec<f32>,
    /// `[num_kv_heads][head_dim]` per-channel key scales (smoothing; finite and > 0): the
    /// centered key is divided by them and the query multiplied. All ones: no smoothing.
    pub key_scale: Vec<f32>,
    /// `[num_kv_heads][head_dim]` key channel permutations.
    pub key_perm: Vec<u16>,
    /// `[num_kv_heads][head_dim]` value channel permutations.
    pub value_perm: Vec<u16>,
    /// `[num_kv_heads][head_dim][head_dim]` orthogonal key rotations (row-major `R`, the
    /// rotated key is `(k - mean) R`), used instead of the configured key rotation: the
    /// OptR learned rotations of `rotkv calibrate --methods optr`. `None`: the
    /// configured rotation ([`CacheConfig::key_rotation`]).
    pub key_rotation: Option<Vec<f32>>,
    /// The same for values.
    pub value_rotation: Option<Vec<f32>>,
}

impl LayerCalibration {
    /// Zero means, unit scales, identity permutations, the configured rotations.
    pub fn identity(num_kv_heads: usize, head_dim: usize) -> Self {
        let perm: Vec<u16> = (0..num_kv_heads).flat_map(|_| 0..head_dim as u16).collect();
        Self {
            key_mean: vec![0.0; num_kv_heads * head_dim],
            key_scale: vec![1.0; num_kv_heads * head_dim],
            key_perm: perm.clone(),
            value_perm: perm,
            key_rotation: None,
            value_rotation: None,
        }
    }

    /// Checks sizes, finiteness of the means, that every key scale is finite and > 0,
    /// that every permutation is one and that every learned rotation has rows and columns of unit norm (within
    /// [`ORTHOGONALITY_TOL`]; `O(D^2)` per head, run on every append and decode). Full
    /// orthogonality is [`LayerCalibration::check_orthogonal`].
    pub fn validate(&self, num_kv_heads: usize, head_dim: usize) -> Result<()> {
        if head_dim == 0 || num_kv_heads == 0 {
            return Err(Error::Calibration(format!("{num_kv_heads} KV heads of {head_dim} channels")));
        }
        let n = num_kv_heads
            .checked_mul(head_dim)
            .ok_or_else(|| Error::Calibration(format!("{num_kv_heads} KV heads of {head_dim} channels")))?;
        for (what, len) in [
            ("key_mean", self.key_mean.len()),
            ("key_scale", self.key_scale.len()),
            ("key_perm", self.key_perm.len()),
            ("value_perm", self.value_perm.len()),
        ] {
            if len != n {
                return Err(Error::Calibration(format!(
                    "{what} has {len} entries, expected {num_kv_heads} heads x {head_dim} = {n}"
                )));
            }
        }
        if let Some(i) = self.key_mean.iter().position(|x| !x.is_finite()) {
            return Err(Error::Calibration(format!("key_mean[{i}] is not finite")));
        }
        if let Some(i) = self.key_scale.iter().position(|x| !(x.is_finite() && *x > 0.0)) {
            return Err(Error::Calibration(format!(
                "key_scale[{i}] is {}: key scales must be finite and > 0",
                self.key_scale[i]
            )));
        }
        for (what, perm) in [("key_perm", &self.key_perm), ("value_perm", &self.value_perm)] {
            for (h, p) in perm.chunks_exact(head_dim).enumerate() {
                let mut seen = vec![false; head_dim];
                for &c in p {
                    let c = c as usize;
                    if c >= head_dim || seen[c] {
                        return Err(Error::Calibration(format!(
                            "{what} of KV head {h} is not a permutation of 0..{head_dim}"
                        )));
                    }
                    seen[c] = true;
                }
            }
        }
        for (what, rot) in [("key_rotation", &self.key_rotation), ("value_rotation", &self.value_rotation)] {
            if let Some(r) = rot
                && Some(r.len()) != n.checked_mul(head_dim)
            {
                return Err(Error::Calibration(format!(
                    "{what} has {} entries, expected {num_kv_heads} heads x {head_dim} x {head_dim} = {}",
                    r.len(),
                    n as u128 * head_dim as u128
                )));
            }
        }
        let mut cols = vec![0f64; head_dim];
        for (what, m, h) in self.rotations(head_dim) {
            // Unit rows and columns: the cheap part of orthogonality, and what keeps every
            // rotated channel within the row's norm (so the f16 range check of the inputs
            // still holds). The full check is `check_orthogonal`. One pass in row order.
            cols.fill(0.0);
            let mut rows_ok = true;
            for row in m.chunks_exact(head_dim) {
                let mut norm = 0f64;
                for (c, &x) in cols.iter_mut().zip(row) {
                    let x2 = x as f64 * x as f64;
                    norm += x2;
                    *c += x2;
                }
                // (NaN compares false: a non-finite matrix is refused too.)
                rows_ok &= (norm - 1.0).abs() <= ORTHOGONALITY_TOL;
            }
            if !rows_ok || !cols.iter().all(|&c| (c - 1.0).abs() <= ORTHOGONALITY_TOL) {
                return Err(Error::Calibration(format!(
                    "{what} of KV head {h}: its rows and columns must have unit norm (an orthogonal matrix)"
                )));
            }
        }
        Ok(())
    }

    /// [`LayerCalibration::validate`], and that every learned rotation is orthogonal:
    /// `|R R^T - I|` below [`ORTHOGONALITY_TOL`] everywhere (`O(D^3)` per head, so it
    /// runs when a calibration is set or loaded, not on every call).
    pub fn check_orthogonal(&self, num_kv_heads: usize, head_dim: usize) -> Result<()> {
        self.validate(num_kv_heads, head_dim)?;
        for (what, m, h) in self.rotations(head_dim) {
            let err = orthogonality_error(m, head_dim);
            if err.is_nan() || err > ORTHOGONALITY_TOL {
                return Err(Error::Calibration(format!(
                    "{what} of KV head {h} is not orthogonal (largest |R R^T - I| entry {err:.2e})"
                )));
            }
        }
        Ok(())
    }

    /// Every learned rotation matrix: `(name, matrix, kv_head)`.
    fn rotations(&self, head_dim: usize) -> impl Iterator<Item = (&'static str, &[f32], usize)> {
        let dd = (head_dim * head_dim).max(1);
        [("key_rotation", &self.key_rotation), ("value_rotation", &self.value_rotation)].into_iter().flat_map(
            move |(what, r)| r.iter().flat_map(move |r| r.chunks_exact(dd).enumerate()).map(move |(h, m)| (what, m, h)),
        )
    }

    /// `FLAG_DENSE_*` bits of the kernel parameter blocks for the learned rotations this
    /// calibration holds.
    pub fn flags(&self) -> u32 {
        use rotkv_kernels::params::{FLAG_DENSE_KEYS, FLAG_DENSE_VALUES};
        (if self.key_rotation.is_some() { FLAG_DENSE_KEYS } else { 0 })
            | (if self.value_rotation.is_some() { FLAG_DENSE_VALUES } else { 0 })
    }

    /// The rotation of the keys (`value == false`) or values of `kv_head`: its learned
    /// matrix if this calibration has one, else the Hadamard transform where `flags` (the
    /// kernel flags) ask for it, else none.
    pub fn rotation(&self, value: bool, kv_head: usize, head_dim: usize, flags: u32) -> HeadRotation<'_> {
        let (learned, hadamard) = if value {
            (&self.value_rotation, flags & FLAG_ROTATE_VALUES != 0)
        } else {
            (&self.key_rotation, flags & FLAG_ROTATE_KEYS != 0)
        };
        match learned {
            Some(r) => HeadRotation::Dense(&r[kv_head * head_dim * head_dim..(kv_head + 1) * head_dim * head_dim]),
            None if hadamard => HeadRotation::Hadamard,
            None => HeadRotation::None,
        }
    }

    /// The inverse value permutations, `[kv_head][head_dim]`: rotated channel `c` is
    /// stored channel `inverse[c]` (what the merge kernel gathers with).
    pub fn value_perm_inverse(&self, head_dim: usize) -> Vec<u16> {
        let mut inv = vec![0u16; self.value_perm.len()];
        for (h, perm) in self.value_perm.chunks_exact(head_dim).enumerate() {
            for (j, &c) in perm.iter().enumerate() {
                inv[h * head_dim + c as usize] = j as u16;
            }
        }
        inv
    }

    /// The key scales of one KV head (`[head_dim]`).
    pub fn head_key_scale(&self, kv_head: usize, head_dim: usize) -> &[f32] {
        &self.key_scale[kv_head * head_dim..(kv_head + 1) * head_dim]
    }

    /// The slices of one KV head: `(key_mean, key_perm, value_perm)`.
    pub fn head(&self, kv_head: usize, head_dim: usize) -> (&[f32], &[u16], &[u16]) {
        let r = kv_head * head_dim..(kv_head + 1) * head_dim;
        (&self.key_mean[r.clone()], &self.key_perm[r.clone()], &self.value_perm[r])
    }
}

/// Largest entry of `|R R^T - I|` for a row-major `d x d` matrix, in f64.
pub fn orthogonality_error(r: &[f32], d: usize) -> f64 {
    let mut worst = 0f64;
    for i in 0..d {
        for j in 0..d {
            let dot: f64 = (0..d).map(|c| r[i * d + c] as f64 * r[j * d + c] as f64).sum();
            let e = (dot - if i == j { 1.0 } else { 0.0 }).abs();
            if e.is_nan() {
                return f64::NAN;
            }
            worst = worst.max(e);
        }
    }
    worst
}

/// Checks that a head dimension is one the cache is instantiated for (64, 128 or 256):
/// an [`Error::Unsupported`] naming it otherwise. The Hadamard transform, the channel
/// permutations and every kernel assume one of these (powers of two).
pub fn check_head_dim(head_dim: usize) -> Result<()> {
    if !rotkv_kernels::HEAD_DIMS.iter().any(|&x| x as usize == head_dim) {
        return Err(Error::Unsupported(format!("head_dim {head_dim} (supported: 64, 128, 256)")));
    }
    Ok(())
}
