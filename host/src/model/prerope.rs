//! Pre-RoPE key quantization (RotateKV's recipe), simulated in the perplexity harness.
//!
//! rotkv's cache quantizes keys after RoPE, per KV head: decode reads the stored key as
//! it is. RotateKV quantizes the key before RoPE (rotated by a Hadamard transform across a
//! group of heads) and re-applies RoPE to every dequantized key at decode, which costs an
//! inverse rotation and a RoPE per cached key and token. This module measures what that
//! buys: [`SimAttention`] keeps each simulated method's keys and values in f32 and
//! attends exactly over them, with the positions the real cache would hold quantized (the
//! same sinks, the same recent window, paged as [`rotkv_kernels::layout::Format`] pages
//! them) replaced by what a quantized cache would return:
//!
//! - values, and keys of the post-RoPE control (`-sim`): `unrotate(deq(Q(f16(rotate(x -
//!   mean) / scale)))) * scale + mean`, the quantizer of [`crate::reference`]
//!   ([`crate::reference::quantize_group_clipped`], [`crate::reference::dequantize_group`])
//!   with the method's bits, group and clip;
//! - keys of the pre-RoPE method (`-pre`): the key of position `p` with RoPE undone
//!   (`k_pre`), through the same round trip with the pre-RoPE calibration's mean and
//!   scale, then RoPE of position `p` re-applied: `RoPE_p(H^T deq(Q(H (k_pre - mean) /
//!   scale)) * scale + mean)`.
//!
//! Every kept row (exact or dequantized) is rounded to f16, as an f16 cache stores it.
//! The rotation is per KV head: RotateKV rotates the concatenated heads of a group, but
//! on the models measured here the group degenerates (SmolLM2: 3 heads x 64 = 192
//! channels, not a power of two, so per head; Gemma 3 270M: one KV head of 256, so the
//! group is that head).
//!
//! This is a simulation, not a cache option: the cache and its kernels stay post-RoPE.
//! Up to the f16 rounding of the re-RoPE'd key it gives the numbers a real pre-RoPE cache
//! would (a real cache could keep the pre-RoPE key quantized and re-apply RoPE in its
//! decode loop; the scores would be the same). The `-sim` control runs the post-RoPE
//! method through the same code, so its perplexity next to the real cache's measures the
//! simulation's own error.

use super::llama::{Attention, ExactAttention, LayerActivations, LlamaConfig, Row};
use super::math::rope;
use crate::config::{CacheConfig, HeadRotation};
use crate::error::{Error, Result};
use crate::reference::{dequantize_group, quantize_group_clipped, rotate, unrotate};
use half::f16;
use rotkv_kernels::layout::Format;

/// One head's row through the quantizer: `unrotate(deq(Q(f16(rotate((x - mean) /
/// scale))))) * scale + mean`, with `bits`, `group` channels per group and a Q16 clip
/// ratio (the Hadamard rotation, no permutation). The rotated row is rounded to f16 first,
/// as the cache stores it before a page is quantized.
pub fn round_trip(x: &[f32], mean: &[f32], scale: &[f32], bits: u32, group: usize, clip_q16: u32) -> Vec<f32> {
    let d = x.len();
    let perm: Vec<u16> = (0..d as u16).collect();
    let c: Vec<f64> = x.iter().zip(mean).zip(scale).map(|((&a, &m), &s)| (a as f64 - m as f64) / s as f64).collect();
    let r: Vec<f64> =
        rotate(&c, HeadRotation::Hadamard, &perm).into_iter().map(|y| f16::from_f64(y).to_f64()).collect();
    let deq: Vec<f64> =
        r.chunks_exact(group).flat_map(|g| dequantize_group(&quantize_group_clipped(g, bits, clip_q16))).collect();
    let back = unrotate(&deq, HeadRotation::Hadamard, &perm);
    back.iter().zip(mean).zip(scale).map(|((&y, &m), &s)| (y * s as f64 + m as f64) as f32).collect()
}

/// RoPE undone: the rotation of [`rope`] by the opposite angle.
pub fn unrope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let neg: Vec<f32> = sin.iter().map(|&s| -s).collect();
    rope(x, cos, &neg);
}

/// The pre-RoPE round trip of one head's post-RoPE key at a position with RoPE tables
/// `(cos, sin)`: RoPE undone, [`round_trip`] with the pre-RoPE `mean` and `scale`, RoPE
/// re-applied.
#[allow(clippy::too_many_arguments)]
pub fn pre_rope_key(
    k_post: &[f32],
    cos: &[f32],
    sin: &[f32],
    mean: &[f32],
    scale: &[f32],
    bits: u32,
    group: usize,
    clip_q16: u32,
) -> Vec<f32> {
    let mut k = k_post.to_vec();
    unrope(&mut k, cos, sin);
    let mut out = round_trip(&k, mean, scale, bits, group, clip_q16);
    rope(&mut out, cos, sin);
    out
}

/// How one simulated method treats its keys.
#[derive(Clone, Debug)]
pub struct SimMethod {
    /// The cache configuration it simulates (bits, group, clips, sinks, window, page).
    pub config: CacheConfig,
    /// Keys quantized before RoPE (`-pre`) or after it (`-sim`).
    pub pre_rope: bool,
    /// Per layer: key mean and key scale `[kv_heads][head_dim]` (post-RoPE ones for
    /// `-sim`, pre-RoPE ones for `-pre`; zeros and ones uncalibrated).
    pub key_stats: Vec<(Vec<f32>, Vec<f32>)>,
    /// KIVI's quantizer instead (`kivi2`, `kivi4`): no rotation; keys per channel over
    /// blocks of `group_size` consecutive tokens (quantized once a block is complete),
    /// values per token in groups of `group_size` channels; both the whole range.
    pub kivi: bool,
}

/// KIVI's per-token value quantizer: groups of `group` raw channels (no rotation), the
/// whole range.
fn per_token(x: &[f32], bits: u32, group: usize) -> Vec<f32> {
    x.chunks_exact(group)
        .flat_map(|g| {
            let g: Vec<f64> = g.iter().map(|&v| v as f64).collect();
            dequantize_group(&quantize_group_clipped(&g, bits, rotkv_kernels::layout::NO_CLIP))
        })
        .map(|v| v as f32)
        .collect()
}

/// Attention over simulated caches: sequence `s` of a [`Row`] is method
/// `methods[seq_method[s]]`; sequences whose entry is `None` are not this
/// attention's (see [`Split`]). Rows of a sequence arrive in position order; several rows
/// of one sequence in a batch are a multi-token decode (all stored first, each row causal,
/// the quantized positions those of the sequence's length after the batch, as the cache's
/// multi-token decode reads them).
#[derive(Debug)]
pub struct SimAttention {
    config: LlamaConfig,
    methods: Vec<(SimMethod, Format)>,
    seq_method: Vec<Option<usize>>,
    /// Per layer, per sequence: exact keys and values, and their quantized versions, all
    /// f16-rounded, `[pos][kv_heads][head_dim]`.
    store: Vec<Vec<[Vec<f32>; 4]>>,
}

impl SimAttention {
    /// Simulated caches for `methods`; `seq_method[s]` is the method of row sequence `s`.
    pub fn new(config: &LlamaConfig, methods: Vec<SimMethod>, seq_method: Vec<Option<usize>>) -> Result<Self> {
        let mut with_format = Vec::new();
        for m in methods {
            let fmt = m.config.format()?;
            if m.kivi && !(fmt.page_size as usize).is_multiple_of(m.config.group_size) {
                return Err(Error::Value("KIVI's token blocks must divide the page".into()));
            }
            if m.config.head_dim != config.head_dim
                || m.key_stats.len() != config.layers
                || m.key_stats.iter().any(|(a, b)| a.len() != config.kv_heads * config.head_dim || b.len() != a.len())
            {
                return Err(Error::Shape("simulated method does not fit the model".into()));
            }
            with_format.push((m, fmt));
        }
        if seq_method.iter().flatten().any(|&m| m >= with_format.len()) {
            return Err(Error::Shape("sequence of an unknown simulated method".into()));
        }
        let store = vec![vec![Default::default(); seq_method.len()]; config.layers];
        Ok(Self { config: config.clone(), methods: with_format, seq_method, store })
    }
}

/// Channel `ch` of the stored (f16-rounded) key row of position `p`.
fn ke_at(ke: &[f32], p: usize, kvd: usize, ch: usize) -> f64 {
    ke[p * kvd + ch] as f64
}

fn f16_round(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
}

impl Attention for SimAttention {
    fn attend(&mut self, layer: usize, rows: &[Row], q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()> {
        use rayon::prelude::*;
        let c = &self.config;
        let (d, hkv, hq) = (c.head_dim, c.kv_heads, c.heads);
        let (kvd, qd) = (hkv * d, hq * d);
        // Store every row first (keys and values exact and round-tripped).
        for (i, r) in rows.iter().enumerate() {
            let m = self.seq_method.get(r.seq).copied().flatten().ok_or(Error::UnknownSequence(r.seq))?;
            let (meth, fmt) = &self.methods[m];
            let [ke, ve, kq, vq] = &mut self.store[layer][r.seq];
            if ke.len() != r.pos * kvd {
                return Err(Error::Shape(format!("row at position {} of simulated sequence {}", r.pos, r.seq)));
            }
            let (mean, scale) = &meth.key_stats[layer];
            let (cos, sin) = c.rope_table_of(layer, r.pos);
            let g = meth.config.group_size;
            for h in 0..hkv {
                let kh = &k[i * kvd + h * d..][..d];
                let vh = &v[i * kvd + h * d..][..d];
                let (mh, sh) = (&mean[h * d..(h + 1) * d], &scale[h * d..(h + 1) * d]);
                let mut kk = if meth.kivi {
                    // Replaced when its block of tokens is complete (below).
                    kh.to_vec()
                } else if meth.pre_rope {
                    pre_rope_key(kh, &cos, &sin, mh, sh, fmt.key_bits, g, fmt.key_clip)
                } else {
                    round_trip(kh, mh, sh, fmt.key_bits, g, fmt.key_clip)
                };
                let (zeros, ones) = (vec![0f32; d], vec![1f32; d]);
                let mut vv = if meth.kivi {
                    per_token(vh, fmt.value_bits, g)
                } else {
                    round_trip(vh, &zeros, &ones, fmt.value_bits, g, fmt.value_clip)
                };
                f16_round(&mut kk);
                f16_round(&mut vv);
                kq.extend_from_slice(&kk);
                vq.extend_from_slice(&vv);
                let (mut ke1, mut ve1) = (kh.to_vec(), vh.to_vec());
                f16_round(&mut ke1);
                f16_round(&mut ve1);
                ke.extend_from_slice(&ke1);
                ve.extend_from_slice(&ve1);
            }
            // KIVI: a complete block of `g` tokens after the sinks is quantized per channel.
            let (g, sinks) = (meth.config.group_size, meth.config.sinks);
            if meth.kivi && r.pos + 1 > sinks && (r.pos + 1 - sinks).is_multiple_of(g) {
                let first = r.pos + 1 - g;
                for ch in 0..kvd {
                    let x: Vec<f64> = (first..=r.pos).map(|p| ke_at(ke, p, kvd, ch)).collect();
                    let deq =
                        dequantize_group(&quantize_group_clipped(&x, fmt.key_bits, rotkv_kernels::layout::NO_CLIP));
                    for (p, y) in (first..=r.pos).zip(deq) {
                        kq[p * kvd + ch] = f16::from_f64(y).to_f32();
                    }
                }
            }
        }
        let window = c.window_left(layer);
        let scale = c.attn_scale;
        let group = hq / hkv;
        let store = &self.store[layer];
        let methods = &self.methods;
        let seq_method = &self.seq_method;
        out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
            let (r, h) = (i / hq, i % hq);
            let row = rows[r];
            let [ke, ve, kq, vq] = &store[row.seq];
            let fmt = &methods[seq_method[row.seq].unwrap_or(0)].1;
            let len = ke.len() / kvd;
            let (lo, hi) = (fmt.sinks as usize, fmt.sinks as usize + fmt.quantized_len(len as u32) as usize);
            let kh = h / group;
            let first = window.map_or(0, |w| row.pos.saturating_sub(w));
            let qh = &q[r * qd + h * d..][..d];
            let at = |p: usize| -> (&[f32], &[f32]) {
                let off = p * kvd + kh * d;
                if (lo..hi).contains(&p) {
                    (&kq[off..off + d], &vq[off..off + d])
                } else {
                    (&ke[off..off + d], &ve[off..off + d])
                }
            };
            let scores: Vec<f32> = (first..=row.pos).map(|p| super::math::dot(qh, at(p).0) * scale).collect();
            let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|&s| (s - mx).exp()).collect();
            let sum: f64 = e.iter().map(|&x| x as f64).sum();
            o.fill(0.0);
            for (p, &w) in (first..=row.pos).zip(&e) {
                let w = (w as f64 / sum) as f32;
                o.iter_mut().zip(at(p).1).for_each(|(a, &b)| *a += w * b);
            }
        });
        debug_assert_eq!(out.len(), rows.len() * qd);
        Ok(())
    }
}

/// Attention that sends the rows of simulated sequences (`simulated[s]`) to a
/// [`SimAttention`] and the others to a second implementation (the rotkv caches), one
/// batch each.
pub struct Split<'a> {
    /// Whether row sequence `s` is simulated.
    pub simulated: Vec<bool>,
    /// The simulated caches.
    pub sim: SimAttention,
    /// Everything else.
    pub rest: &'a mut dyn Attention,
}

impl Attention for Split<'_> {
    fn attend(&mut self, layer: usize, rows: &[Row], q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<()> {
        let n = rows.len();
        if n == 0 {
            return Ok(());
        }
        let (qd, kvd) = (q.len() / n, k.len() / n);
        for want in [true, false] {
            let idx: Vec<usize> =
                (0..n).filter(|&i| self.simulated.get(rows[i].seq).copied().unwrap_or(false) == want).collect();
            if idx.is_empty() {
                continue;
            }
            let gather = |x: &[f32], w: usize| -> Vec<f32> {
                idx.iter().flat_map(|&i| x[i * w..(i + 1) * w].iter().copied()).collect()
            };
            let sub: Vec<Row> = idx.iter().map(|&i| rows[i]).collect();
            let mut o = vec![0f32; idx.len() * qd];
            let (sq, sk, sv) = (gather(q, qd), gather(k, kvd), gather(v, kvd));
            if want {
                self.sim.attend(layer, &sub, &sq, &sk, &sv, &mut o)?;
            } else {
                self.rest.attend(layer, &sub, &sq, &sk, &sv, &mut o)?;
            }
            for (j, &i) in idx.iter().enumerate() {
                out[i * qd..(i + 1) * qd].copy_from_slice(&o[j * qd..(j + 1) * qd]);
            }
        }
        Ok(())
    }
}

/// Per layer, the mean and channel standard deviation of the pre-RoPE keys
/// `[kv_heads][head_dim]` of `tokens` (an exact forward pass; positions before
/// [`super::calibrate::SKIP_POSITIONS`] left out), as a calibration file holds them for
/// post-RoPE keys ([`super::calibrate::calibrate_layer`] on the pre-RoPE keys: its
/// permutations are not used by `-pre`).
pub fn pre_rope_calibration(model: &super::Llama, tokens: &[u32]) -> Result<super::calibrate::Calibration> {
    let c = &model.config;
    let mut acts: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); c.layers];
    let mut keep = |a: &LayerActivations<'_>| {
        acts[a.layer].0.extend_from_slice(a.k_pre);
        acts[a.layer].1.extend_from_slice(a.v);
    };
    let rows: Vec<Row> = (0..tokens.len()).map(|p| Row { seq: 0, pos: p }).collect();
    model.forward(tokens, &rows, &mut ExactAttention::new(c), Some(&mut keep), c.layers)?;
    let layers = acts
        .iter()
        .map(|(k, v)| super::calibrate::calibrate_layer(k, v, c.kv_heads, c.head_dim))
        .collect::<Result<Vec<_>>>()?;
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("keys".into(), "pre-RoPE".into());
    Ok(super::calibrate::Calibration {
        layers,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        metadata,
        key_smoothing: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::math::rope_table;
    use rotkv_kernels::layout::NO_CLIP;

    /// Fixed-seed values in about -2..2 with one larger channel per row.
    fn rows(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
                if i % 64 == 3 { u + 6.0 } else { u }
            })
            .collect()
    }

    fn f16_close(a: f32, b: f32) -> bool {
        // Half an f16 ulp of the larger magnitude, plus f32 noise of the rotations.
        let ulp = a.abs().max(b.abs()) / 1024.0;
        (a - b).abs() <= 0.5 * ulp.max(6e-8) + 1e-5 * (1.0 + a.abs())
    }

    /// With nothing to quantize away, the pre-RoPE path gives back the post-RoPE key:
    /// `RoPE(H^T H k_pre) == k_post` up to f16 rounding. (a) the path's parts, unrope,
    /// rotate, unrotate, rope, on arbitrary keys; (b) the whole path through the quantizer
    /// on keys whose rotated groups are constant (a constant group round-trips exactly).
    #[test]
    fn pre_rope_path_is_identity_without_quantization_error() {
        for d in [64usize, 128, 256] {
            let perm: Vec<u16> = (0..d as u16).collect();
            for pos in [0usize, 1, 17, 1000] {
                let (cos, sin) = rope_table(pos, d, 10000.0, None);
                let k_pre = rows(d, 7 + pos as u64);
                let mut k_post = k_pre.clone();
                rope(&mut k_post, &cos, &sin);
                // (a)
                let mut back = k_post.clone();
                unrope(&mut back, &cos, &sin);
                let x: Vec<f64> = back.iter().map(|&v| v as f64).collect();
                let y = unrotate(&rotate(&x, HeadRotation::Hadamard, &perm), HeadRotation::Hadamard, &perm);
                let mut again: Vec<f32> = y.iter().map(|&v| v as f32).collect();
                rope(&mut again, &cos, &sin);
                for (a, b) in again.iter().zip(&k_post) {
                    assert!(f16_close(f16::from_f32(*a).to_f32(), *b), "d {d} pos {pos}: {a} vs {b}");
                }
                // (b) groups of 32: rotated key constant per group (f16 values).
                let group = 32;
                let r: Vec<f64> = (0..d).map(|c| [0.5, -1.25, 3.0, 0.0375][(c / group) % 4]).collect();
                let k_pre: Vec<f32> = unrotate(&r, HeadRotation::Hadamard, &perm).iter().map(|&v| v as f32).collect();
                let mut k_post = k_pre.clone();
                rope(&mut k_post, &cos, &sin);
                let (zeros, ones) = (vec![0f32; d], vec![1f32; d]);
                for bits in [2, 4] {
                    let got = pre_rope_key(&k_post, &cos, &sin, &zeros, &ones, bits, group, NO_CLIP);
                    for (a, b) in got.iter().zip(&k_post) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d {d} pos {pos} bits {bits}: {a} vs {b}");
                    }
                }
            }
        }
    }

    /// The pre-RoPE key's error is the quantizer's: in the rotated pre-RoPE domain every
    /// channel of the dequantized key is within half the group's stored scale of the
    /// (f16-rounded) rotated key, with and without centering and smoothing.
    #[test]
    fn pre_rope_error_is_the_quantizers() {
        let d = 128;
        let perm: Vec<u16> = (0..d as u16).collect();
        let mean = rows(d, 3).iter().map(|v| v * 0.3).collect::<Vec<f32>>();
        let scale = rows(d, 4).iter().map(|v| 0.5 + v.abs() * 0.2).collect::<Vec<f32>>();
        for (t, pos) in [5usize, 130, 999].into_iter().enumerate() {
            let (cos, sin) = rope_table(pos, d, 10000.0, None);
            let k_pre = rows(d, 100 + t as u64);
            let mut k_post = k_pre.clone();
            rope(&mut k_post, &cos, &sin);
            for (m, s) in [(vec![0f32; d], vec![1f32; d]), (mean.clone(), scale.clone())] {
                for (bits, group) in [(2, 32), (2, 128), (4, 64)] {
                    let got = pre_rope_key(&k_post, &cos, &sin, &m, &s, bits, group, NO_CLIP);
                    let to_rot = |k: &[f32]| -> Vec<f64> {
                        let mut k = k.to_vec();
                        unrope(&mut k, &cos, &sin);
                        let c: Vec<f64> = k
                            .iter()
                            .zip(&m)
                            .zip(&s)
                            .map(|((&a, &mm), &ss)| (a as f64 - mm as f64) / ss as f64)
                            .collect();
                        rotate(&c, HeadRotation::Hadamard, &perm)
                    };
                    let want: Vec<f64> = to_rot(&k_post).iter().map(|&y| f16::from_f64(y).to_f64()).collect();
                    let have = to_rot(&got);
                    for (g, (w, h)) in want.chunks_exact(group).zip(have.chunks_exact(group)).enumerate() {
                        let q = quantize_group_clipped(w, bits, NO_CLIP);
                        let bound = q.scale.to_f64() / 2.0 + 1e-4 * (1.0 + q.scale.to_f64());
                        for (a, b) in w.iter().zip(h) {
                            assert!(
                                (a - b).abs() <= bound,
                                "pos {pos} bits {bits} group {g}: {a} vs {b}, scale {}",
                                q.scale
                            );
                        }
                    }
                    // And the error is not zero: the keys really were quantized.
                    assert!(got.iter().zip(&k_post).any(|(a, b)| (a - b).abs() > 1e-3));
                }
            }
        }
    }

    #[test]
    fn method_names() {
        let m = crate::model::KvMethod::parse("k2v2-c-pre", 64, 1024).unwrap();
        assert!(m.pre_rope && m.simulated && m.calib.center);
        let m = crate::model::KvMethod::parse("k4v2-sim-a50", 128, 1024).unwrap();
        assert!(!m.pre_rope && m.simulated && m.calib.smooth == Some(crate::model::calibrate::Smooth::Alpha(50)));
        assert!(!crate::model::KvMethod::parse("k2v2", 64, 1024).unwrap().simulated);
        for bad in ["f16-pre", "naive2-pre", "k2v2-r-pre", "k2v2-pre-o64", "k2v2-da4-sim", "k2v2-v2-pre"] {
            assert!(crate::model::KvMethod::parse(bad, 64, 1024).is_err(), "{bad}");
        }
    }
}
