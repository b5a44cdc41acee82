//! OptR learned rotations: per (layer, KV head), an orthogonal `R = H exp(A - A^T)`
//! (`H` the Hadamard matrix) learned offline from a model's own queries, keys and values,
//! minimizing the error that reaches the model rather than the error of the cached
//! tensors themselves:
//!
//! - keys: `KL(p || p_hat)` of each query's attention distribution plus the relative
//!   error of the attention output after the layer's output projection `W_O`
//!   (`|(p_hat - p) V W_O^h|^2 / |p V W_O^h|^2`, summed over the query heads of the group);
//! - values: the relative error `|p (V_hat - V) W_O^h|^2 / |p V W_O^h|^2`.
//!
//! The quantizer in the loop is the cache's (per-token groups, f16 scale and zero,
//! clipped range) applied decode-faithfully: the first `sinks` positions and the newest
//! `window` positions before each query stay exact. Rounding is differentiated with a
//! straight-through estimator (round treated as the identity; the scale and zero, and so
//! the group's min and max, keep their true derivatives; clamped channels pass nothing
//! but through scale and zero). `A` starts at zero (`R = H`, the plain Hadamard rotation)
//! and is trained with Adam; the gradient of `exp` is its exact Frechet adjoint (the
//! block-triangular exponential). The query positions are split in two interleaved sets:
//! one is trained on, the other (held out) picks the step whose rotation is kept, so the
//! kept rotation is never worse than `H` on held-out queries of the calibration text.
//!
//! Everything here is f64 and runs on the CPU; the result is stored as f32 in the
//! calibration file ([`crate::LayerCalibration::key_rotation`]).

use crate::config::CacheConfig;
use crate::error::{Error, Result};
use crate::model::math::Matrix;
use rayon::prelude::*;
use rotkv_kernels::layout::{NO_CLIP, clip_range};
use rotkv_kernels::math::f64_to_f16;

/// What a learned rotation is trained for: the quantizer and the decode-faithful masks,
/// and the optimizer's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptrOptions {
    /// Key code bits (2 or 4).
    pub key_bits: u32,
    /// Value code bits (2 or 4).
    pub value_bits: u32,
    /// Channels per quantization group.
    pub group: usize,
    /// Key range clip ratio (1.0: the whole range), as [`CacheConfig::key_clip`].
    pub key_clip: f64,
    /// Value range clip ratio.
    pub value_clip: f64,
    /// Leading positions kept exact.
    pub sinks: usize,
    /// Newest positions before each query kept exact.
    pub window: usize,
    /// Adam steps.
    pub steps: usize,
    /// Adam learning rate (on `A`).
    pub lr: f64,
    /// Query positions per query head trained on, spread evenly over the calibration
    /// tokens after `window` (each attends causally to every position up to itself); as
    /// many positions between them are held out.
    pub queries: usize,
    /// Weight of the key loss's output-error term against its KL term.
    pub output_weight: f64,
}

impl OptrOptions {
    /// The options for rotations a cache with `config` will use: its bits, group size,
    /// clip ratios, sinks and window; 64 Adam steps of learning rate 2e-3 over 48 query
    /// positions per query head, output-error weight 1.
    pub fn for_config(config: &CacheConfig) -> Self {
        Self {
            key_bits: config.key_bits,
            value_bits: config.value_bits,
            group: config.group_size,
            key_clip: config.key_clip as f64,
            value_clip: config.value_clip as f64,
            sinks: config.sinks,
            window: config.window,
            steps: 64,
            lr: 2e-3,
            queries: 48,
            output_weight: 1.0,
        }
    }

    fn clip_q16(ratio: f64) -> u32 {
        (ratio * NO_CLIP as f64).round() as u32
    }
}

/// Held-out losses of one rotation: with `R = H` (the start) and with the kept `R`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainReport {
    /// Held-out loss with the plain Hadamard rotation.
    pub hadamard: f64,
    /// Held-out loss with the learned rotation (at most `hadamard`).
    pub learned: f64,
    /// The Adam step whose rotation was kept (0: the Hadamard itself).
    pub step: usize,
}

/// One query row of the training data: its position, which query head of the group
/// it belongs to, and the query with the softmax scale folded in.
#[derive(Clone, Debug, PartialEq)]
pub struct Query {
    /// Position (it attends to positions `0..=pos`).
    pub pos: usize,
    /// Query head within the KV head's group.
    pub head: usize,
    /// `q / sqrt(D)`, `[D]`.
    pub q: Vec<f64>,
}

/// The training data of one KV head.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadData {
    /// Channels per head.
    pub d: usize,
    /// Keys `[T][D]`, centered as the cache will center them.
    pub keys: Vec<f64>,
    /// Values `[T][D]`.
    pub values: Vec<f64>,
    /// Query rows trained on.
    pub queries: Vec<Query>,
    /// Held-out query rows (they choose the step whose rotation is kept).
    pub holdout: Vec<Query>,
    /// Per query head of the group, `M = W^T W` (`[D][D]`) of its slice `W` (`dim x D`)
    /// of the output projection: `|o W^T|^2 = o M o^T`.
    pub out_metric: Vec<Vec<f64>>,
}

impl HeadData {
    fn tokens(&self) -> usize {
        self.keys.len() / self.d
    }
}

// ---------------------------------------------------------------------------------------
// Small dense linear algebra (row-major f64).

/// `a (n x k) * b (k x m)`.
fn matmul(a: &[f64], b: &[f64], n: usize, k: usize, m: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * m];
    for i in 0..n {
        let o = &mut out[i * m..(i + 1) * m];
        for (p, &aip) in a[i * k..(i + 1) * k].iter().enumerate() {
            if aip != 0.0 {
                o.iter_mut().zip(&b[p * m..(p + 1) * m]).for_each(|(x, &y)| *x += aip * y);
            }
        }
    }
    out
}

/// `a^T * b` for `a (t x n)`, `b (t x m)`: an `n x m` sum of outer products.
fn matmul_tn(a: &[f64], b: &[f64], t: usize, n: usize, m: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * m];
    for r in 0..t {
        let (ar, br) = (&a[r * n..(r + 1) * n], &b[r * m..(r + 1) * m]);
        for (i, &x) in ar.iter().enumerate() {
            if x != 0.0 {
                out[i * m..(i + 1) * m].iter_mut().zip(br).for_each(|(o, &y)| *o += x * y);
            }
        }
    }
    out
}

fn transpose(a: &[f64], n: usize) -> Vec<f64> {
    let mut t = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            t[j * n + i] = a[i * n + j];
        }
    }
    t
}

pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The orthonormal Sylvester Hadamard matrix of size `d` (natural order, symmetric):
/// `x H` is [`crate::reference::fwht`] of `x`.
pub fn hadamard_matrix(d: usize) -> Vec<f64> {
    let s = 1.0 / (d as f64).sqrt();
    (0..d * d).map(|ij| if ((ij / d) & (ij % d)).count_ones().is_multiple_of(2) { s } else { -s }).collect()
}

/// Matrix exponential of an `n x n` matrix: scaling and squaring with a degree-12
/// Taylor polynomial on a matrix of 1-norm at most 1/2 (truncation error below 1e-16
/// relative).
pub fn expm(a: &[f64], n: usize) -> Vec<f64> {
    let norm = (0..n).map(|j| (0..n).map(|i| a[i * n + j].abs()).sum::<f64>()).fold(0.0, f64::max);
    let squarings = if norm > 0.5 { (norm / 0.5).log2().ceil() as u32 } else { 0 };
    let scale = 0.5f64.powi(squarings as i32);
    let x: Vec<f64> = a.iter().map(|v| v * scale).collect();
    // Horner: I + x (I + x/2 (I + x/3 (...))).
    let mut e = identity(n);
    for k in (1..=12).rev() {
        let mut t = matmul(&x, &e, n, n, n);
        t.iter_mut().for_each(|v| *v /= k as f64);
        (0..n).for_each(|i| t[i * n + i] += 1.0);
        e = t;
    }
    for _ in 0..squarings {
        e = matmul(&e, &e, n, n, n);
    }
    e
}

fn identity(n: usize) -> Vec<f64> {
    let mut e = vec![0.0; n * n];
    (0..n).for_each(|i| e[i * n + i] = 1.0);
    e
}

/// The gradient with respect to `X` of a loss of `exp(X)` whose gradient with respect
/// to `exp(X)` is `g`: the Frechet derivative of `exp` at `X^T` in the direction `g`,
/// the upper right block of `exp([[X^T, g], [0, X^T]])`.
fn expm_adjoint(x: &[f64], g: &[f64], n: usize) -> Vec<f64> {
    let gn = g.iter().map(|v| v * v).sum::<f64>().sqrt();
    if gn == 0.0 {
        return vec![0.0; n * n];
    }
    // (Linear in g: normalize it so the block's norm is X's.)
    let xt = transpose(x, n);
    let m = 2 * n;
    let mut b = vec![0.0; m * m];
    for i in 0..n {
        for j in 0..n {
            b[i * m + j] = xt[i * n + j];
            b[(n + i) * m + n + j] = xt[i * n + j];
            b[i * m + n + j] = g[i * n + j] / gn;
        }
    }
    let e = expm(&b, m);
    let mut out = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            out[i * n + j] = e[i * m + n + j] * gn;
        }
    }
    out
}

/// `R = H exp(A - A^T)`.
fn rotation_of(a: &[f64], h: &[f64], d: usize) -> Vec<f64> {
    let x: Vec<f64> = (0..d * d).map(|ij| a[ij] - a[(ij % d) * d + ij / d]).collect();
    matmul(h, &expm(&x, d), d, d, d)
}

/// The gradient with respect to `A` of a loss whose gradient with respect to
/// `R = H exp(A - A^T)` is `g_r`.
fn grad_a(a: &[f64], h: &[f64], g_r: &[f64], d: usize) -> Vec<f64> {
    let x: Vec<f64> = (0..d * d).map(|ij| a[ij] - a[(ij % d) * d + ij / d]).collect();
    // R = H E: dL/dE = H^T dL/dR (H is symmetric).
    let g_e = matmul(h, g_r, d, d, d);
    let g_x = expm_adjoint(&x, &g_e, d);
    (0..d * d).map(|ij| g_x[ij] - g_x[(ij % d) * d + ij / d]).collect()
}

// ---------------------------------------------------------------------------------------
// The cache's quantizer, with the straight-through backward.

/// What the backward pass of one quantized row needs.
struct QuantRow {
    /// The dequantized row.
    xhat: Vec<f64>,
    /// Per channel: `Some(r - u)` inside the range (round treated as the identity), or
    /// `None` when clamped (`r` in `codes`).
    inside: Vec<Option<f64>>,
    codes: Vec<f64>,
    /// Per group: argmin, argmax (channel indices), whether the scale is 0.
    ends: Vec<(usize, usize, bool)>,
}

/// Quantizes a rotated row as the cache does: the row rounded to f16 (the stored row),
/// per group of `g` channels the clipped min/max range, f16 scale and zero, codes
/// rounded half away from zero and clamped, dequantized against the stored scale and
/// zero.
fn quantize(y: &[f64], bits: u32, g: usize, clip_q16: u32) -> QuantRow {
    let levels = ((1u32 << bits) - 1) as f64;
    let d = y.len();
    let stored: Vec<f64> = y.iter().map(|&v| half::f16::from_bits(f64_to_f16(v)).to_f64()).collect();
    let mut out =
        QuantRow { xhat: vec![0.0; d], inside: vec![None; d], codes: vec![0.0; d], ends: Vec::with_capacity(d / g) };
    for (j, x) in stored.chunks_exact(g).enumerate() {
        let (mut lo_i, mut hi_i) = (0, 0);
        for (i, &v) in x.iter().enumerate() {
            if v < x[lo_i] {
                lo_i = i;
            }
            if v > x[hi_i] {
                hi_i = i;
            }
        }
        let (lo, hi) = clip_range(x[lo_i], x[hi_i], clip_q16);
        let s = half::f16::from_bits(f64_to_f16((hi - lo) / levels)).to_f64();
        let z = half::f16::from_bits(f64_to_f16(lo)).to_f64();
        out.ends.push((j * g + lo_i, j * g + hi_i, s == 0.0));
        for (i, &v) in x.iter().enumerate() {
            let c = j * g + i;
            if s == 0.0 {
                out.xhat[c] = z;
                out.inside[c] = Some(0.0);
                continue;
            }
            let u = (v - z) / s;
            let r = u.round();
            let rc = r.clamp(0.0, levels);
            out.codes[c] = rc;
            out.xhat[c] = rc * s + z;
            out.inside[c] = if r == rc { Some(rc - u) } else { None };
        }
    }
    out
}

/// The straight-through gradient with respect to the rotated row of a loss whose
/// gradient with respect to the dequantized row is `gx` (see [`quantize`]).
fn quantize_backward(q: &QuantRow, gx: &[f64], bits: u32, g: usize, clip_ratio: f64, out: &mut [f64]) {
    let levels = ((1u32 << bits) - 1) as f64;
    for (j, &(lo_i, hi_i, flat)) in q.ends.iter().enumerate() {
        let range = j * g..(j + 1) * g;
        if flat {
            // A constant group is reproduced exactly: the identity.
            out[range.clone()].iter_mut().zip(&gx[range]).for_each(|(o, &v)| *o += v);
            continue;
        }
        let (mut gs, mut gz) = (0.0, 0.0);
        for c in range {
            match q.inside[c] {
                Some(frac) => {
                    out[c] += gx[c];
                    gs += gx[c] * frac;
                }
                None => {
                    gs += gx[c] * q.codes[c];
                    gz += gx[c];
                }
            }
        }
        // s = (hi - lo) / levels, z = lo; lo and hi are the clipped range of (min, max).
        let (g_hi, g_lo) = (gs / levels, gz - gs / levels);
        let (a, b) = ((1.0 + clip_ratio) / 2.0, (1.0 - clip_ratio) / 2.0);
        out[hi_i] += g_hi * a + g_lo * b;
        out[lo_i] += g_hi * b + g_lo * a;
    }
}

// ---------------------------------------------------------------------------------------
// Losses and their gradients with respect to R.

/// Numerically stable softmax of `s` in place.
pub(super) fn softmax(s: &mut [f64]) {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    s.iter_mut().for_each(|x| {
        *x = (*x - m).exp();
        sum += *x;
    });
    s.iter_mut().for_each(|x| *x /= sum);
}

/// Whether position `i` is quantized when the query at `t` reads it.
fn quantized_for(i: usize, t: usize, o: &OptrOptions) -> bool {
    i >= o.sinks && i + o.window <= t
}

/// Query rows with their exact attention.
struct Batch<'a> {
    queries: &'a [Query],
    /// Per row: exact attention probabilities and exact output.
    exact: Vec<(Vec<f64>, Vec<f64>)>,
}

/// The exact attention of every row of `queries`.
fn batch<'a>(data: &HeadData, queries: &'a [Query]) -> Batch<'a> {
    let d = data.d;
    let exact = queries
        .iter()
        .map(|q| {
            let mut p: Vec<f64> = (0..=q.pos).map(|i| dot(&q.q, &data.keys[i * d..(i + 1) * d])).collect();
            softmax(&mut p);
            let mut o = vec![0.0; d];
            for (i, &pi) in p.iter().enumerate() {
                o.iter_mut().zip(&data.values[i * d..(i + 1) * d]).for_each(|(a, &v)| *a += pi * v);
            }
            (p, o)
        })
        .collect();
    Batch { queries, exact }
}

/// `o M o^T`.
pub(super) fn metric(o: &[f64], m: &[f64]) -> f64 {
    let d = o.len();
    (0..d).map(|i| o[i] * dot(&m[i * d..(i + 1) * d], o)).sum()
}

/// `y = x R` for rows `x` (`[t][d]`) and every row quantized as the cache does.
fn rotate_and_quantize(x: &[f64], r: &[f64], d: usize, bits: u32, g: usize, clip: f64) -> (Vec<f64>, Vec<QuantRow>) {
    let y = matmul(x, r, x.len() / d, d, d);
    let q16 = OptrOptions::clip_q16(clip);
    let quant = y.chunks_exact(d).map(|row| quantize(row, bits, g, q16)).collect();
    (y, quant)
}

/// Back through the quantizer and `y = x R` ([`rotate_and_quantize`]): `g_y` (the
/// gradient with respect to the rows where they are used unquantized) gets the
/// straight-through gradient of `g_yhat` (with respect to the quantized rows), and
/// `g_r` gets `x^T g_y`.
#[allow(clippy::too_many_arguments)]
fn back_through_quantizer(
    x: &[f64],
    quant: &[QuantRow],
    g_yhat: &[f64],
    mut g_y: Vec<f64>,
    bits: u32,
    g: usize,
    clip: f64,
    g_r: &mut [f64],
) {
    let d = quant.first().map_or(1, |q| q.xhat.len());
    for (i, qrow) in quant.iter().enumerate() {
        let r = i * d..(i + 1) * d;
        quantize_backward(qrow, &g_yhat[r.clone()], bits, g, clip, &mut g_y[r]);
    }
    let gx = matmul_tn(x, &g_y, quant.len(), d, d);
    g_r.iter_mut().zip(&gx).for_each(|(a, b)| *a += b);
}

/// The key loss of rotation `r` and its gradient with respect to `r`.
fn key_loss(data: &HeadData, b: &Batch<'_>, o: &OptrOptions, r: &[f64]) -> (f64, Vec<f64>) {
    let (queries, exact) = (b.queries, &b.exact);
    let (d, t) = (data.d, data.tokens());
    let (y, quant) = rotate_and_quantize(&data.keys, r, d, o.key_bits, o.group, o.key_clip);
    let norm: f64 = queries.iter().zip(exact).map(|(q, (_, oe))| metric(oe, &data.out_metric[q.head])).sum();
    let nq = queries.len() as f64;
    let mut loss = 0.0;
    // Gradients with respect to the quantized rows, the exact rows, and q R.
    let (mut g_yhat, mut g_y) = (vec![0.0; t * d], vec![0.0; t * d]);
    let mut g_r = vec![0.0; d * d];
    for (q, (pe, _)) in queries.iter().zip(exact) {
        let qr = matmul(&q.q, r, 1, d, d);
        let row = |i: usize| if quantized_for(i, q.pos, o) { &quant[i].xhat[..] } else { &y[i * d..(i + 1) * d] };
        let mut p: Vec<f64> = (0..=q.pos).map(|i| dot(&qr, row(i))).collect();
        softmax(&mut p);
        let mut dout = vec![0.0; d];
        for (i, (&pi, &pei)) in p.iter().zip(pe).enumerate() {
            if pei > 0.0 {
                loss += pei * (pei.ln() - pi.max(1e-300).ln()) / nq;
            }
            dout.iter_mut().zip(&data.values[i * d..(i + 1) * d]).for_each(|(a, &v)| *a += (pi - pei) * v);
        }
        let m = &data.out_metric[q.head];
        loss += o.output_weight * metric(&dout, m) / norm;
        // dL/dp_i of the output term: 2 v_i . (M dout) / norm.
        let mdo = matmul(m, &dout, d, d, 1);
        let gp: Vec<f64> =
            (0..=q.pos).map(|i| 2.0 * o.output_weight * dot(&data.values[i * d..(i + 1) * d], &mdo) / norm).collect();
        let pg = dot(&p, &gp);
        let mut g_qr = vec![0.0; d];
        for i in 0..=q.pos {
            let gs = (p[i] - pe[i]) / nq + p[i] * (gp[i] - pg);
            if gs == 0.0 {
                continue;
            }
            g_qr.iter_mut().zip(row(i)).for_each(|(a, &v)| *a += gs * v);
            let dst = if quantized_for(i, q.pos, o) { &mut g_yhat } else { &mut g_y };
            dst[i * d..(i + 1) * d].iter_mut().zip(&qr).for_each(|(a, &v)| *a += gs * v);
        }
        // qr = q R: dL/dR += q^T g_qr.
        for (a, &qa) in q.q.iter().enumerate() {
            g_r[a * d..(a + 1) * d].iter_mut().zip(&g_qr).for_each(|(x, &g)| *x += qa * g);
        }
    }
    back_through_quantizer(&data.keys, &quant, &g_yhat, g_y, o.key_bits, o.group, o.key_clip, &mut g_r);
    (loss, g_r)
}

/// The value loss of rotation `r` and its gradient with respect to `r`.
fn value_loss(data: &HeadData, b: &Batch<'_>, o: &OptrOptions, r: &[f64]) -> (f64, Vec<f64>) {
    let (queries, exact) = (b.queries, &b.exact);
    let (d, t) = (data.d, data.tokens());
    let (_, quant) = rotate_and_quantize(&data.values, r, d, o.value_bits, o.group, o.value_clip);
    let yhat: Vec<f64> = quant.iter().flat_map(|q| q.xhat.iter().copied()).collect();
    // Dequantized values back in the original channels: vhat = yhat R^T; err = vhat - v.
    let rt = transpose(r, d);
    let vhat = matmul(&yhat, &rt, t, d, d);
    let err: Vec<f64> = vhat.iter().zip(&data.values).map(|(a, b)| a - b).collect();
    let norm: f64 = queries.iter().zip(exact).map(|(q, (_, oe))| metric(oe, &data.out_metric[q.head])).sum();
    let mut loss = 0.0;
    let mut g_vhat = vec![0.0; t * d];
    for (q, (pe, _)) in queries.iter().zip(exact) {
        let mut dout = vec![0.0; d];
        for (i, &pi) in pe.iter().enumerate() {
            if quantized_for(i, q.pos, o) {
                dout.iter_mut().zip(&err[i * d..(i + 1) * d]).for_each(|(a, &e)| *a += pi * e);
            }
        }
        let m = &data.out_metric[q.head];
        loss += metric(&dout, m) / norm;
        let u: Vec<f64> = matmul(m, &dout, d, d, 1).iter().map(|x| 2.0 * x / norm).collect();
        for (i, &pi) in pe.iter().enumerate() {
            if quantized_for(i, q.pos, o) {
                g_vhat[i * d..(i + 1) * d].iter_mut().zip(&u).for_each(|(a, &x)| *a += pi * x);
            }
        }
    }
    // vhat = yhat R^T: dL/dR += g_vhat^T yhat, dL/dyhat = g_vhat R.
    let mut g_r = matmul_tn(&g_vhat, &yhat, t, d, d);
    let g_yhat = matmul(&g_vhat, r, t, d, d);
    let g_y = vec![0.0; t * d];
    back_through_quantizer(&data.values, &quant, &g_yhat, g_y, o.value_bits, o.group, o.value_clip, &mut g_r);
    (loss, g_r)
}

/// Adam on `A` from zero on the training loss; returns the rotation of lowest held-out
/// loss and the report.
fn train(
    d: usize,
    o: &OptrOptions,
    loss: impl Fn(&[f64]) -> (f64, Vec<f64>),
    holdout: impl Fn(&[f64]) -> f64,
) -> (Vec<f64>, TrainReport) {
    let h = hadamard_matrix(d);
    let (b1, b2, eps) = (0.9, 0.999, 1e-12);
    let mut a = vec![0.0; d * d];
    let (mut m, mut v) = (vec![0.0; d * d], vec![0.0; d * d]);
    let mut best = (h.clone(), f64::INFINITY, 0);
    let mut first = f64::NAN;
    for step in 0..=o.steps {
        let r = rotation_of(&a, &h, d);
        let held = holdout(&r);
        if step == 0 {
            first = held;
        }
        if held < best.1 {
            best = (r.clone(), held, step);
        }
        if step == o.steps || !held.is_finite() {
            break;
        }
        let (l, g_r) = loss(&r);
        if !l.is_finite() {
            break;
        }
        let g = grad_a(&a, &h, &g_r, d);
        let t = (step + 1) as i32;
        for i in 0..d * d {
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
            a[i] -= o.lr * mh / (vh.sqrt() + eps);
        }
    }
    let (r, learned, step) = best;
    (r, TrainReport { hadamard: first, learned, step })
}

/// Learns the key rotation of one KV head.
pub fn train_key_rotation(data: &HeadData, o: &OptrOptions) -> (Vec<f64>, TrainReport) {
    let (tr, ho) = (batch(data, &data.queries), batch(data, &data.holdout));
    train(data.d, o, |r| key_loss(data, &tr, o, r), |r| key_loss(data, &ho, o, r).0)
}

/// Learns the value rotation of one KV head.
pub fn train_value_rotation(data: &HeadData, o: &OptrOptions) -> (Vec<f64>, TrainReport) {
    let (tr, ho) = (batch(data, &data.queries), batch(data, &data.holdout));
    train(data.d, o, |r| value_loss(data, &tr, o, r), |r| value_loss(data, &ho, o, r).0)
}

/// The learned rotations of one layer and their training reports (per KV head: keys,
/// values).
pub struct LayerRotations {
    /// `[kv_heads][D][D]` key rotations.
    pub key: Vec<f32>,
    /// `[kv_heads][D][D]` value rotations.
    pub value: Vec<f32>,
    /// Per KV head: `(key report, value report)`.
    pub reports: Vec<(TrainReport, TrainReport)>,
}

/// The training data of every KV head of a layer from its activations over `t` tokens:
/// queries `[t][heads][D]` (post-RoPE), keys and values `[t][kv_heads][D]`, the key
/// mean the cache subtracts, and the output projection `wo` (`dim x heads * D`).
#[allow(clippy::too_many_arguments)]
pub fn layer_data(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    key_mean: &[f32],
    wo: &Matrix,
    heads: usize,
    kv_heads: usize,
    d: usize,
    o: &OptrOptions,
) -> Result<Vec<HeadData>> {
    let t = k.len() / (kv_heads * d).max(1);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || q.len() != t * heads * d || v.len() != k.len() {
        return Err(Error::Shape(format!("optr: {heads} query heads, {kv_heads} KV heads, {t} tokens")));
    }
    if wo.cols != heads * d {
        return Err(Error::Shape(format!("optr: output projection has {} columns, expected {}", wo.cols, heads * d)));
    }
    if t <= o.window + 1 || o.queries == 0 {
        return Err(Error::Shape(format!("optr: {t} tokens leave no query past the {}-token window", o.window)));
    }
    let g = heads / kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    // Query positions spread evenly over (window, t), alternately trained on and held out.
    let n = 2 * o.queries;
    let positions: Vec<usize> = (0..n).map(|i| o.window + 1 + (i * (t - o.window - 1)) / n).collect();
    let out_metric = super::calibrate::output_metric(wo, None, heads, d);
    Ok((0..kv_heads)
        .map(|h| {
            let head = |x: &[f32], n: usize, hh: usize, p: usize| -> Vec<f64> {
                x[(p * n + hh) * d..(p * n + hh + 1) * d].iter().map(|&a| a as f64).collect()
            };
            let keys: Vec<f64> = (0..t)
                .flat_map(|p| {
                    head(k, kv_heads, h, p).into_iter().zip(&key_mean[h * d..(h + 1) * d]).map(|(a, &m)| a - m as f64)
                })
                .collect();
            let values: Vec<f64> = (0..t).flat_map(|p| head(v, kv_heads, h, p)).collect();
            let (mut queries, mut holdout) = (Vec::new(), Vec::new());
            for (j, &pos) in positions.iter().enumerate() {
                for i in 0..g {
                    let qv = head(q, heads, h * g + i, pos).into_iter().map(|x| x * scale).collect();
                    let set = if j % 2 == 0 { &mut queries } else { &mut holdout };
                    set.push(Query { pos, head: i, q: qv });
                }
            }
            let out_metric = out_metric[h * g..(h + 1) * g].to_vec();
            HeadData { d, keys, values, queries, holdout, out_metric }
        })
        .collect())
}

/// Learns the key and value rotations of every KV head of a layer (heads and kinds in
/// parallel).
pub fn learn_layer(data: &[HeadData], o: &OptrOptions) -> LayerRotations {
    let jobs: Vec<(usize, bool)> = (0..data.len()).flat_map(|h| [(h, false), (h, true)]).collect();
    let done: Vec<(Vec<f64>, TrainReport)> = jobs
        .par_iter()
        .map(|&(h, value)| if value { train_value_rotation(&data[h], o) } else { train_key_rotation(&data[h], o) })
        .collect();
    let mut out = LayerRotations { key: Vec::new(), value: Vec::new(), reports: Vec::new() };
    for pair in done.chunks_exact(2) {
        out.key.extend(pair[0].0.iter().map(|&x| x as f32));
        out.value.extend(pair[1].0.iter().map(|&x| x as f32));
        out.reports.push((pair[0].1, pair[1].1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random stream in [-1, 1).
    fn stream(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        move || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            ((s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        }
    }

    #[test]
    fn hadamard_matrix_is_the_fwht() {
        let d = 16;
        let h = hadamard_matrix(d);
        let mut r = stream(1);
        let x: Vec<f64> = (0..d).map(|_| r()).collect();
        let mut f = x.clone();
        crate::reference::fwht(&mut f);
        let y = matmul(&x, &h, 1, d, d);
        assert!(y.iter().zip(&f).all(|(a, b)| (a - b).abs() < 1e-12));
    }

    #[test]
    fn expm_of_skew_is_orthogonal_and_matches_a_rotation() {
        // exp([[0, t], [-t, 0]]) = [[cos t, sin t], [-sin t, cos t]].
        let t = 2.5;
        let e = expm(&[0.0, t, -t, 0.0], 2);
        let want = [t.cos(), t.sin(), -t.sin(), t.cos()];
        assert!(e.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-13), "{e:?}");
        let d = 8;
        let mut r = stream(2);
        let a: Vec<f64> = (0..d * d).map(|_| r()).collect();
        let rot = rotation_of(&a, &hadamard_matrix(d), d);
        let rrt = matmul(&rot, &transpose(&rot, d), d, d, d);
        let id = identity(d);
        assert!(rrt.iter().zip(&id).all(|(a, b)| (a - b).abs() < 1e-12));
    }

    #[test]
    fn gradient_through_the_exponential_matches_finite_differences() {
        // A smooth loss of R: L = sum(W * R) + |R c|^2 / 2 for fixed W, c.
        let d = 8;
        let mut r = stream(3);
        let w: Vec<f64> = (0..d * d).map(|_| r()).collect();
        let c: Vec<f64> = (0..d).map(|_| r()).collect();
        let loss = |rot: &[f64]| -> (f64, Vec<f64>) {
            let rc = matmul(rot, &c, d, d, 1);
            let l = dot(&w, rot) + 0.5 * dot(&rc, &rc);
            let g: Vec<f64> = (0..d * d).map(|ij| w[ij] + rc[ij / d] * c[ij % d]).collect();
            (l, g)
        };
        let h = hadamard_matrix(d);
        let a: Vec<f64> = (0..d * d).map(|_| 0.3 * r()).collect();
        let (_, g_r) = loss(&rotation_of(&a, &h, d));
        let g = grad_a(&a, &h, &g_r, d);
        for ij in [0, 5, 17, 40, 63] {
            let eps = 1e-6;
            let (mut ap, mut am) = (a.clone(), a.clone());
            ap[ij] += eps;
            am[ij] -= eps;
            let fd = (loss(&rotation_of(&ap, &h, d)).0 - loss(&rotation_of(&am, &h, d)).0) / (2.0 * eps);
            assert!((fd - g[ij]).abs() < 1e-6 * (1.0 + fd.abs()), "entry {ij}: fd {fd} vs {}", g[ij]);
        }
    }

    #[test]
    fn quantizer_matches_the_reference_and_its_backward_is_straight_through() {
        let (d, g, bits) = (64, 32, 2);
        let mut r = stream(4);
        let y: Vec<f64> = (0..d).map(|_| 3.0 * r()).collect();
        for clip in [1.0, 0.8] {
            let q16 = OptrOptions::clip_q16(clip);
            let q = quantize(&y, bits, g, q16);
            // Same dequantized row as the reference quantizer of the f16 row.
            let stored: Vec<f64> = y.iter().map(|&v| half::f16::from_f64(v).to_f64()).collect();
            let mut codes = vec![0u8; d * bits as usize / 8];
            let mut params = vec![0u8; d / g * 4];
            crate::reference::quantize_row(&stored, bits, g, q16, &mut codes, &mut params);
            let want = crate::reference::dequantize_row(&codes, &params, bits, g, d);
            assert_eq!(q.xhat, want);
            // With the codes frozen, xhat = codes * s(y) + z(y) is smooth in y near y (the
            // group's min and max move with it). The straight-through gradient is that
            // derivative plus the identity for every channel inside the range.
            let gx: Vec<f64> = (0..d).map(|_| r()).collect();
            let mut got = vec![0.0; d];
            quantize_backward(&q, &gx, bits, g, clip, &mut got);
            let frozen = |y: &[f64]| -> f64 {
                let levels = 3.0;
                let mut total = 0.0;
                for (j, x) in y.chunks_exact(g).enumerate() {
                    let lo = x.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let (lo, hi) = clip_range(lo, hi, q16);
                    let (s, z) = ((hi - lo) / levels, lo);
                    for (i, _) in x.iter().enumerate() {
                        let c = j * g + i;
                        total += gx[c] * (q.codes[c] * s + z);
                    }
                }
                total
            };
            for c in [0, 3, 31, 32, 50, 63] {
                let eps = 1e-7;
                let (mut yp, mut ym) = (y.clone(), y.clone());
                yp[c] += eps;
                ym[c] -= eps;
                let fd = (frozen(&yp) - frozen(&ym)) / (2.0 * eps);
                let ste = fd + if q.inside[c].is_some() { gx[c] } else { 0.0 };
                assert!((ste - got[c]).abs() < 1e-5, "clip {clip} channel {c}: {ste} vs {}", got[c]);
            }
        }
    }

    /// Synthetic head: keys with a few outlier channels and a low-rank query structure.
    fn synthetic(d: usize, t: usize, seed: u64) -> HeadData {
        let mut r = stream(seed);
        let scale: Vec<f64> = (0..d).map(|c| if c % 13 == 2 { 6.0 } else { 0.5 + 0.5 * r().abs() }).collect();
        let keys: Vec<f64> = (0..t * d).map(|i| r() * scale[i % d]).collect();
        let values: Vec<f64> = (0..t * d).map(|_| r()).collect();
        let dir: Vec<f64> = (0..d).map(|_| r()).collect();
        let mut query =
            |i: usize| Query { pos: 20 + i * 3, head: i % 2, q: (0..d).map(|c| 0.4 * dir[c] + 0.2 * r()).collect() };
        let queries = (0..12).map(&mut query).collect();
        let holdout = (0..12).map(&mut query).collect();
        let out_metric = (0..2)
            .map(|_| {
                let w: Vec<f64> = (0..d * d).map(|_| r()).collect();
                matmul_tn(&w, &w, d, d, d)
            })
            .collect();
        HeadData { d, keys, values, queries, holdout, out_metric }
    }

    #[test]
    fn training_lowers_the_loss_and_keeps_rotations_orthogonal() {
        let d = 64;
        let data = synthetic(d, 56, 5);
        let o = OptrOptions {
            key_bits: 2,
            value_bits: 2,
            group: 32,
            key_clip: 0.8,
            value_clip: 1.0,
            sinks: 2,
            window: 8,
            steps: 30,
            lr: 5e-3,
            queries: 12,
            output_weight: 1.0,
        };
        for (r, rep) in [train_key_rotation(&data, &o), train_value_rotation(&data, &o)] {
            assert!(rep.hadamard.is_finite() && rep.hadamard > 0.0, "{rep:?}");
            assert!(rep.learned < 0.9 * rep.hadamard, "{rep:?}");
            let rf: Vec<f32> = r.iter().map(|&x| x as f32).collect();
            assert!(crate::config::orthogonality_error(&rf, d) < 1e-5);
        }
    }
}
