//! The dense f32 arithmetic of the forward pass: matrix products (multi-threaded, AVX2 +
//! FMA when the CPU has them), RMSNorm, RoPE, SwiGLU.

use rayon::prelude::*;

/// A row-major f32 matrix `[rows][cols]` (a weight: `[out][in]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Rows (output features of a weight).
    pub rows: usize,
    /// Columns (input features of a weight).
    pub cols: usize,
    /// `rows * cols` values.
    pub data: Vec<f32>,
}

impl Matrix {
    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// `a . b` in f32 with eight independent accumulators.
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// [`dot_portable`] compiled for AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `a . b` (equal lengths), with the fastest kernel the CPU runs.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable(a, b)
}

/// `out[r][o] = w.row(o) . x[r]` for `n` rows of `x` (`[n][w.cols]`); `out` is
/// `[n][w.rows]`. Threads take blocks of output features; each block walks the rows in
/// tiles so the weights and the inputs of a tile stay in cache.
pub fn matmul(w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul input");
    assert_eq!(out.len(), n * w.rows, "matmul output");
    const OUT_BLOCK: usize = 32;
    const ROW_TILE: usize = 16;
    let mut t = vec![0f32; n * w.rows];
    // t is [output block][row][o within block].
    t.par_chunks_mut(OUT_BLOCK * n).enumerate().for_each(|(b, chunk)| {
        let o0 = b * OUT_BLOCK;
        let width = chunk.len() / n;
        for r0 in (0..n).step_by(ROW_TILE) {
            for o in 0..width {
                let wr = w.row(o0 + o);
                for r in r0..(r0 + ROW_TILE).min(n) {
                    chunk[r * width + o] = dot(wr, &x[r * w.cols..(r + 1) * w.cols]);
                }
            }
        }
    });
    for (b, chunk) in t.chunks(OUT_BLOCK * n).enumerate() {
        let width = chunk.len() / n;
        for r in 0..n {
            out[r * w.rows + b * OUT_BLOCK..][..width].copy_from_slice(&chunk[r * width..(r + 1) * width]);
        }
    }
}

/// RMSNorm of each `w.len()`-wide row of `x` into `out`: `x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / w.len() as f64;
        let s = (1.0 / (ms + eps as f64).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * s * g;
        }
    }
}

/// Rotary tables for one position: `(cos, sin)` of each of the `d / 2` frequencies,
/// computed as Hugging Face does (f32 inverse frequencies `1 / theta^(2i/d)`, each divided
/// by its factor when `factors` are given, f32 angle `pos * inv_freq`), the cosine and
/// sine then taken exactly.
pub fn rope_table(pos: usize, d: usize, theta: f32, factors: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    (0..d / 2)
        .map(|i| {
            let mut inv = 1.0 / theta.powf((2 * i) as f32 / d as f32);
            if let Some(f) = factors {
                inv /= f[i];
            }
            let a = (pos as f32 * inv) as f64;
            (a.cos() as f32, a.sin() as f32)
        })
        .unzip()
}

/// RoPE on one head in Hugging Face's channel order (`rotate_half`: channel `i` pairs
/// with `i + d/2`).
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let h = x.len() / 2;
    for i in 0..h {
        let (a, b) = (x[i], x[i + h]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i] + a * sin[i];
    }
}

/// `silu(gate) * up`, elementwise, into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `gelu_tanh(gate) * up`, elementwise, into `gate`: GeGLU with the tanh approximation
/// of GELU (`0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, Gemma's
/// `gelu_pytorch_tanh`).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_naive_for_awkward_sizes() {
        let w = Matrix { rows: 37, cols: 29, data: (0..37 * 29).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect() };
        for n in [1, 3, 17, 40] {
            let x: Vec<f32> = (0..n * 29).map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0).collect();
            let mut out = vec![0f32; n * 37];
            matmul(&w, &x, n, &mut out);
            for r in 0..n {
                for o in 0..37 {
                    let e: f64 = (0..29).map(|c| w.data[o * 29 + c] as f64 * x[r * 29 + c] as f64).sum();
                    assert!((out[r * 37 + o] as f64 - e).abs() < 1e-4, "n {n} r {r} o {o}");
                }
            }
        }
        let a: Vec<f32> = (0..100).map(|i| i as f32 * 0.01).collect();
        assert!((dot(&a, &a) - dot_portable(&a, &a)).abs() < 1e-4);
    }
}
