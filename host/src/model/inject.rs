//! Outlier-injected models, a stress set for key quantization: a few RoPE channel pairs
//! of each KV head's keys scaled up by `s` and the same pairs of every query head of its
//! group scaled down by `1 / s`, so every attention score, and so the f32 model's
//! function, is unchanged while the keys get the outlier channels that break
//! per-token 2-bit quantization (`rotkv --inject-key-outliers SEED,COUNT,SCALE`).
//!
//! Pair `p` of a head is channels `p` and `p + head_dim / 2` in Hugging Face order (the
//! model's order after loading: the GGUF's interleaved q and k rows are un-permuted at
//! load, [`super::llama`]), the two channels RoPE rotates together; scaling both alike
//! commutes with RoPE. Where the model normalizes q and k per head before RoPE (qwen3,
//! gemma3), the norm would undo a scaled projection row, so the norm gains are scaled
//! instead; they are shared by all heads, so the pairs are the same for every KV head of
//! a layer there. Elsewhere the rows of `W_k` (and its bias) are scaled, with the pairs
//! drawn per KV head, and the rows of `W_q` (and its bias) of the group's query heads.
//! Scaled projections are held in f32.

use super::llama::Llama;
use super::math::Weight;
use crate::error::{Error, Result};

/// What to inject: `count` pairs per KV head and layer, drawn with `seed`, scaled by
/// `scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Injection {
    /// Seed of the pair choice.
    pub seed: u64,
    /// RoPE channel pairs per KV head and layer.
    pub count: usize,
    /// Factor of the keys' pairs (the queries' get its inverse).
    pub scale: f32,
}

impl Injection {
    /// Parses `SEED,COUNT,SCALE` (for example `1,4,16`).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || Error::Value(format!("--inject-key-outliers {s:?}: SEED,COUNT,SCALE (e.g. 1,4,16)"));
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let [seed, count, scale] = parts[..] else { return Err(bad()) };
        let inj = Self {
            seed: seed.parse().map_err(|_| bad())?,
            count: count.parse().map_err(|_| bad())?,
            scale: scale.parse().map_err(|_| bad())?,
        };
        if !(inj.scale.is_finite() && inj.scale > 0.0) {
            return Err(Error::Value(format!("--inject-key-outliers: scale {} (finite, > 0)", inj.scale)));
        }
        Ok(inj)
    }
}

/// SplitMix64: a small, fixed generator for the pair choice.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `count` distinct pairs of `0..half`, ascending.
fn draw(state: &mut u64, half: usize, count: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..half).collect();
    for i in 0..count {
        let j = i + (next(state) % (half - i) as u64) as usize;
        all.swap(i, j);
    }
    let mut out = all[..count].to_vec();
    out.sort_unstable();
    out
}

fn as_f32(w: &mut Weight) -> &mut super::math::Matrix {
    if let Weight::Blocks(_) = w {
        *w = Weight::F32(w.to_matrix());
    }
    match w {
        Weight::F32(m) => m,
        Weight::Blocks(_) => unreachable!("converted above"),
    }
}

/// Injects key outlier channels into `model` as [`Injection`] says (see the module
/// docs); returns the scaled pairs `[layer][kv_head]`.
pub fn inject_key_outliers(model: &mut Llama, inj: &Injection) -> Result<Vec<Vec<Vec<usize>>>> {
    let c = model.config.clone();
    let (d, hq, hkv) = (c.head_dim, c.heads, c.kv_heads);
    let half = d / 2;
    if inj.count > half {
        return Err(Error::Value(format!("--inject-key-outliers: {} pairs of a {d}-channel head", inj.count)));
    }
    let (s, inv) = (inj.scale, 1.0 / inj.scale);
    let mut state = inj.seed;
    let mut out = Vec::with_capacity(c.layers);
    for w in &mut model.layers {
        let channels = |pairs: &[usize]| pairs.iter().flat_map(|&p| [p, p + half]).collect::<Vec<_>>();
        if let Some([nq, nk]) = &mut w.qk_norm {
            let pairs = draw(&mut state, half, inj.count);
            for ch in channels(&pairs) {
                nk[ch] *= s;
                nq[ch] *= inv;
            }
            out.push(vec![pairs; hkv]);
            continue;
        }
        let mut layer = Vec::with_capacity(hkv);
        for h in 0..hkv {
            let pairs = draw(&mut state, half, inj.count);
            let key_rows: Vec<usize> = channels(&pairs).iter().map(|ch| h * d + ch).collect();
            let group = hq / hkv;
            let query_rows: Vec<usize> = (h * group..(h + 1) * group)
                .flat_map(|qh| channels(&pairs).into_iter().map(move |ch| qh * d + ch))
                .collect();
            for (weight, rows, f, bias) in [(&mut w.wk, &key_rows, s, 1), (&mut w.wq, &query_rows, inv, 0)] {
                let m = as_f32(weight);
                let cols = m.cols;
                for &r in rows {
                    m.data[r * cols..(r + 1) * cols].iter_mut().for_each(|x| *x *= f);
                }
                if let Some(b) = &mut w.bias {
                    rows.iter().for_each(|&r| b[bias][r] *= f);
                }
            }
            layer.push(pairs);
        }
        out.push(layer);
    }
    Ok(out)
}
