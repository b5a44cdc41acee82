//! The dense f32 arithmetic of the forward pass: matrix products (multi-threaded, AVX2 +
//! FMA when the CPU has them) over f32 weights or weights kept as GGUF blocks, RMSNorm,
//! RoPE, SwiGLU, GeGLU.

use rayon::prelude::*;

use crate::{Error, Result};

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

/// A weight kept as its GGUF blocks (one of the ggml types [`super::gguf::dequantize`]
/// reads): `rows` rows of `cols` values, each row a whole number of blocks. Rows are
/// dequantized to f32 as a product needs them, a block of rows at a time, so the f32
/// weights are never all in memory at once.
#[derive(Clone, Debug, PartialEq)]
pub struct Blocks {
    kind: u32,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

impl Blocks {
    /// Keeps `data` (`rows` rows of `cols` values of ggml type `kind`); an error when the
    /// type is not one the reader dequantizes, a row is empty or not a whole number of the
    /// type's blocks, or the bytes do not match.
    pub fn new(kind: u32, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        let row_bytes = Self::row_bytes(kind, rows, cols, data.len())?;
        Ok(Self { kind, rows, cols, row_bytes, data })
    }

    /// The bytes of one row of `rows` x `cols` values of type `kind` stored in `len` bytes,
    /// or the error [`Self::new`] gives. Whole blocks per row is what ggml requires of every
    /// weight, so the model loader checks it for both storages.
    pub fn row_bytes(kind: u32, rows: usize, cols: usize, len: usize) -> Result<usize> {
        let name = super::gguf::type_name(kind);
        let (block, bytes) =
            super::gguf::block_geometry(kind).ok_or_else(|| Error::Unsupported(format!("ggml type {name}")))?;
        if cols == 0 || !cols.is_multiple_of(block) {
            return Err(Error::Shape(format!("rows of {cols} values are not whole {name} blocks of {block}")));
        }
        let row_bytes = (cols / block)
            .checked_mul(bytes)
            .ok_or_else(|| Error::Shape(format!("rows of {cols} {name} values do not fit in memory")))?;
        if rows.checked_mul(row_bytes) != Some(len) {
            return Err(Error::Shape(format!("{len} bytes for {rows} rows of {row_bytes} bytes")));
        }
        Ok(row_bytes)
    }

    /// The ggml type id.
    pub fn kind(&self) -> u32 {
        self.kind
    }

    /// Rows (output features of a weight).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features of a weight).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The stored bytes, `rows` rows of whole blocks.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The same blocks with row `r` taken from row `src(r)` (rows move whole).
    pub fn permute_rows(&self, src: impl Fn(usize) -> usize) -> Self {
        let mut data = vec![0u8; self.data.len()];
        for (r, row) in data.chunks_exact_mut(self.row_bytes).enumerate() {
            row.copy_from_slice(&self.data[src(r) * self.row_bytes..][..self.row_bytes]);
        }
        Self { data, ..*self }
    }

    /// Dequantizes rows `first..first + out.len() / cols` into `out`, whose length must be
    /// a multiple of `cols`, the rows inside the matrix.
    pub fn rows_into(&self, first: usize, out: &mut [f32]) {
        assert!(out.len().is_multiple_of(self.cols), "{} values are not whole rows of {}", out.len(), self.cols);
        let count = out.len() / self.cols;
        let bytes = &self.data[first * self.row_bytes..(first + count) * self.row_bytes];
        super::gguf::dequantize_into(self.kind, bytes, out).expect("whole blocks, as `new` checked");
    }
}

/// A weight matrix `[rows][cols]`: f32 values, or the GGUF blocks they were read from
/// (`rotkv::model::load_with(path, WeightStorage::Quantized)`). Both give bit-identical
/// products: [`matmul`] dequantizes blocks of rows into the same f32 values the f32 form
/// holds and runs the same kernel on them.
#[derive(Clone, Debug, PartialEq)]
pub enum Weight {
    /// Dequantized at load.
    F32(Matrix),
    /// Kept as stored in the file.
    Blocks(Blocks),
}

impl From<Matrix> for Weight {
    fn from(m: Matrix) -> Self {
        Weight::F32(m)
    }
}

impl Weight {
    /// Rows (output features).
    pub fn rows(&self) -> usize {
        match self {
            Weight::F32(m) => m.rows,
            Weight::Blocks(b) => b.rows,
        }
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        match self {
            Weight::F32(m) => m.cols,
            Weight::Blocks(b) => b.cols,
        }
    }

    /// Bytes the weight holds in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Weight::F32(m) => m.data.len() * 4,
            Weight::Blocks(b) => b.data.len(),
        }
    }

    /// Row `r` in f32 into `out` (exactly `cols` values).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols(), "one row");
        match self {
            Weight::F32(m) => out.copy_from_slice(m.row(r)),
            Weight::Blocks(b) => b.rows_into(r, out),
        }
    }

    /// The f32 matrix (a copy for blocks).
    pub fn to_matrix(&self) -> Matrix {
        match self {
            Weight::F32(m) => m.clone(),
            Weight::Blocks(b) => {
                let mut data = vec![0f32; b.rows * b.cols];
                b.rows_into(0, &mut data);
                Matrix { rows: b.rows, cols: b.cols, data }
            }
        }
    }
}

/// Output rows of a weight per task of [`matmul`] (dequantized together for blocks).
const OUT_BLOCK: usize = 16;
/// Input rows per micro-tile.
const TILE_R: usize = 3;
/// Output rows per micro-tile.
const TILE_O: usize = 4;

/// `out[r][o] = w.row(o) . x[r]` for `n` rows of `x` (`[n][w.cols()]`); `out` is
/// `[n][w.rows()]`. Threads take blocks of 16 output features (dequantized into a
/// per-thread buffer when the weight is kept as blocks); within a block, micro-tiles of
/// 3 input rows by 4 output rows keep twelve 8-lane accumulators in registers (AVX2 + FMA
/// when the CPU has them). Every output is summed in the same order whatever the tile it
/// falls in, the batch size or the weight's storage: lane `j` of its accumulator adds
/// columns `8i + j` in order, the lanes are then summed by one fixed tree, and columns past
/// the last multiple of 8 are added last, one at a time. So on one machine the result
/// does not depend on the batch or the storage, bit for bit; across machines it may (the
/// portable kernel, used without AVX2 and FMA, rounds each product before adding it).
pub fn matmul(w: &Weight, x: &[f32], n: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), n * cols, "matmul input");
    assert_eq!(out.len(), n * rows, "matmul output");
    if n == 0 || rows == 0 {
        return;
    }
    let mut t = vec![0f32; n * rows];
    // t is [output block][row][o within block].
    t.par_chunks_mut(OUT_BLOCK * n).enumerate().for_each_init(Vec::new, |buf: &mut Vec<f32>, (b, chunk)| {
        let o0 = b * OUT_BLOCK;
        let width = chunk.len() / n;
        let wrows: &[f32] = match w {
            Weight::F32(m) => &m.data[o0 * cols..(o0 + width) * cols],
            Weight::Blocks(q) => {
                buf.resize(width * cols, 0.0);
                q.rows_into(o0, &mut buf[..width * cols]);
                &buf[..width * cols]
            }
        };
        block_product(wrows, width, x, n, cols, chunk);
    });
    for (b, chunk) in t.chunks(OUT_BLOCK * n).enumerate() {
        let width = chunk.len() / n;
        for r in 0..n {
            out[r * rows + b * OUT_BLOCK..][..width].copy_from_slice(&chunk[r * width..(r + 1) * width]);
        }
    }
}

/// `out[r][o] = w[o] . x[r]` for one block: `w` is `[width][cols]`, `x` `[n][cols]`, `out`
/// `[n][width]`.
fn block_product(w: &[f32], width: usize, x: &[f32], n: usize, cols: usize, out: &mut [f32]) {
    let mut r0 = 0;
    while r0 < n {
        let tr = TILE_R.min(n - r0);
        let mut o0 = 0;
        while o0 < width {
            let to = if width - o0 >= TILE_O { TILE_O } else { 1 };
            let mut acc = [[0f32; TILE_O]; TILE_R];
            let xs = |i: usize| &x[(r0 + i) * cols..(r0 + i + 1) * cols];
            let ws = |j: usize| &w[(o0 + j) * cols..(o0 + j + 1) * cols];
            match (tr, to) {
                (3, 4) => micro::<3, 4>([xs(0), xs(1), xs(2)], [ws(0), ws(1), ws(2), ws(3)], &mut acc),
                (2, 4) => micro::<2, 4>([xs(0), xs(1)], [ws(0), ws(1), ws(2), ws(3)], &mut acc),
                (1, 4) => micro::<1, 4>([xs(0)], [ws(0), ws(1), ws(2), ws(3)], &mut acc),
                (3, _) => micro::<3, 1>([xs(0), xs(1), xs(2)], [ws(0)], &mut acc),
                (2, _) => micro::<2, 1>([xs(0), xs(1)], [ws(0)], &mut acc),
                _ => micro::<1, 1>([xs(0)], [ws(0)], &mut acc),
            }
            for (i, a) in acc.iter().enumerate().take(tr) {
                out[(r0 + i) * width + o0..][..to].copy_from_slice(&a[..to]);
            }
            o0 += to;
        }
        r0 += tr;
    }
}

/// One micro-tile with the fastest kernel the CPU runs. Every row of `x` and `w` must have
/// the same length (checked: the AVX2 kernel's loads rely on it).
fn micro<const R: usize, const O: usize>(x: [&[f32]; R], w: [&[f32]; O], out: &mut [[f32; TILE_O]; TILE_R]) {
    let cols = x[0].len();
    assert!(x.iter().chain(&w).all(|r| r.len() == cols), "micro-tile rows of unequal length");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { micro_avx2::<R, O>(x, w, out) };
    }
    micro_portable::<R, O>(x, w, out)
}

/// The lanes of an 8-lane sum, added by the tree both kernels use.
fn lane_sum(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// [`micro`] in portable code (separate multiply and add).
fn micro_portable<const R: usize, const O: usize>(x: [&[f32]; R], w: [&[f32]; O], out: &mut [[f32; TILE_O]; TILE_R]) {
    let cols = x[0].len();
    let body = cols / 8 * 8;
    for i in 0..R {
        for j in 0..O {
            let mut acc = [0f32; 8];
            for (xc, wc) in x[i][..body].chunks_exact(8).zip(w[j][..body].chunks_exact(8)) {
                for l in 0..8 {
                    acc[l] += xc[l] * wc[l];
                }
            }
            let mut s = lane_sum(acc);
            for c in body..cols {
                s += x[i][c] * w[j][c];
            }
            out[i][j] = s;
        }
    }
}

/// [`micro`] with AVX2 and FMA: `R * O` accumulators in registers, each input vector
/// loaded once per 8 columns.
///
/// # Safety
/// The CPU must support AVX2 and FMA; every slice of `x` and `w` has the same length
/// ([`micro`] checks it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_avx2<const R: usize, const O: usize>(
    x: [&[f32]; R],
    w: [&[f32]; O],
    out: &mut [[f32; TILE_O]; TILE_R],
) {
    use std::arch::x86_64::*;
    let cols = x[0].len();
    let body = cols / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); O]; R];
    let mut c = 0;
    while c < body {
        // SAFETY: c + 8 <= body <= cols, the length of every row.
        let xv: [__m256; R] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x[i].as_ptr().add(c)) });
        for j in 0..O {
            // SAFETY: as above.
            let wv = unsafe { _mm256_loadu_ps(w[j].as_ptr().add(c)) };
            for i in 0..R {
                acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
            }
        }
        c += 8;
    }
    for i in 0..R {
        for j in 0..O {
            let mut l = [0f32; 8];
            // SAFETY: `l` holds 8 f32.
            unsafe { _mm256_storeu_ps(l.as_mut_ptr(), acc[i][j]) };
            let mut s = lane_sum(l);
            for k in body..cols {
                s = x[i][k].mul_add(w[j][k], s);
            }
            out[i][j] = s;
        }
    }
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
        let m = Matrix { rows: 37, cols: 29, data: (0..37 * 29).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect() };
        let w = Weight::F32(m.clone());
        for n in [1, 3, 17, 40] {
            let x: Vec<f32> = (0..n * 29).map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0).collect();
            let mut out = vec![0f32; n * 37];
            matmul(&w, &x, n, &mut out);
            for r in 0..n {
                for o in 0..37 {
                    let e: f64 = (0..29).map(|c| m.data[o * 29 + c] as f64 * x[r * 29 + c] as f64).sum();
                    assert!((out[r * 37 + o] as f64 - e).abs() < 1e-4, "n {n} r {r} o {o}");
                }
            }
        }
        let a: Vec<f32> = (0..100).map(|i| i as f32 * 0.01).collect();
        assert!((dot(&a, &a) - dot_portable(&a, &a)).abs() < 1e-4);
    }

    /// Blocks of every type the reader dequantizes, with sane f16 scales and random
    /// codes: the product over blocks equals the product over their f32 values bit for
    /// bit, for awkward row and batch counts, and both are close to an f64 product.
    #[test]
    fn blocks_give_the_f32_product_bit_for_bit() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let h = |x: f32| half::f16::from_f32(x).to_le_bytes();
        // (kind, values per block, bytes per block, offsets of f16 scales).
        let kinds: [(u32, usize, usize, &[usize]); 9] = [
            (1, 1, 2, &[0]),
            (30, 1, 2, &[]),
            (2, 32, 18, &[0]),
            (3, 32, 20, &[0, 2]),
            (6, 32, 22, &[0]),
            (7, 32, 24, &[0, 2]),
            (8, 32, 34, &[0]),
            (12, 256, 144, &[0, 2]),
            (14, 256, 210, &[208]),
        ];
        for (kind, block, bytes, scales) in kinds {
            let (rows, cols) = (37, if block == 1 { 29 } else { 2 * block.max(32) });
            let blocks = rows * cols / block;
            let mut data: Vec<u8> = (0..blocks * bytes).map(|_| next() as u8).collect();
            for b in data.chunks_exact_mut(bytes) {
                for &o in scales {
                    let v = ((next() % 2000) as f32 / 1000.0 - 1.0) * if block == 1 { 1.0 } else { 0.05 };
                    b[o..o + 2].copy_from_slice(&h(v));
                }
                if kind == 30 {
                    let v = (next() % 2000) as f32 / 1000.0 - 1.0;
                    b.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }
            }
            let q = Weight::Blocks(Blocks::new(kind, rows, cols, data.clone()).unwrap());
            // The f32 form as the f32 storage makes it: the whole tensor dequantized at once.
            let m = Matrix { rows, cols, data: crate::model::gguf::dequantize(kind, &data).unwrap() };
            assert_eq!(q.to_matrix(), m, "kind {kind}");
            assert!(m.data.iter().all(|v| v.is_finite()), "kind {kind}");
            let f = Weight::F32(m.clone());
            let mut row = vec![0f32; cols];
            q.row_into(5, &mut row);
            assert_eq!(row, m.row(5), "kind {kind}");
            for n in [1, 2, 3, 4, 5, 17] {
                let x: Vec<f32> = (0..n * cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
                let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                matmul(&q, &x, n, &mut a);
                matmul(&f, &x, n, &mut b);
                assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()), "kind {kind} n {n}");
                for r in 0..n {
                    for o in 0..rows {
                        let e: f64 = (0..cols).map(|c| m.data[o * cols + c] as f64 * x[r * cols + c] as f64).sum();
                        let scale: f64 = (0..cols).map(|c| (m.data[o * cols + c] * x[r * cols + c]).abs() as f64).sum();
                        // f32 sums of `cols` products: within `cols` roundings of the sum of magnitudes.
                        assert!(
                            (a[r * rows + o] as f64 - e).abs() <= cols as f64 * f32::EPSILON as f64 * scale,
                            "kind {kind} n {n}"
                        );
                    }
                }
            }
        }
        assert!(Blocks::new(12, 2, 128, vec![0; 144]).is_err(), "rows of half a Q4_K block");
        assert!(Blocks::new(8, 2, 0, vec![]).is_err(), "empty rows");
        assert!(Blocks::new(1, 0, 1 << 63, vec![]).is_err(), "rows past any memory");
        assert!(Blocks::new(8, 2, 64, vec![0; 135]).is_err(), "bytes that do not match");
        assert!(Blocks::new(13, 2, 256, vec![0; 10]).is_err(), "a type the reader does not know");
    }

    /// Both kernels (portable, and AVX2 where the CPU has it) give every output the same
    /// bits whatever micro-tile shape computes it, for column counts around the 8-lane
    /// body: what makes a product independent of the batch size.
    #[test]
    fn every_tile_shape_sums_each_output_alike() {
        type Kernel = fn([&[f32]; 1], [&[f32]; 1], &mut [[f32; TILE_O]; TILE_R]);
        let mut kernels: Vec<(&str, Kernel)> = vec![("portable", micro_portable::<1, 1>)];
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            kernels.push(("avx2", |x, w, o| {
                // SAFETY: AVX2 and FMA were detected; the rows have equal lengths.
                unsafe { micro_avx2::<1, 1>(x, w, o) }
            }));
        }
        for cols in [1, 7, 8, 9, 29, 64, 67] {
            let v =
                |k: usize| -> Vec<f32> { (0..cols).map(|c| (((c * 37 + k * 11) % 23) as f32 - 11.0) / 7.0).collect() };
            let (xs, ws): (Vec<Vec<f32>>, Vec<Vec<f32>>) = ((0..3).map(v).collect(), (3..7).map(v).collect());
            for (name, one) in &kernels {
                let single = |i: usize, j: usize| {
                    let mut o = [[0f32; TILE_O]; TILE_R];
                    one([&xs[i]], [&ws[j]], &mut o);
                    o[0][0]
                };
                let mut tile = [[0f32; TILE_O]; TILE_R];
                let (x3, w4) = ([&xs[0][..], &xs[1], &xs[2]], [&ws[0][..], &ws[1], &ws[2], &ws[3]]);
                if *name == "portable" {
                    micro_portable::<3, 4>(x3, w4, &mut tile);
                } else {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: this kernel is listed only where AVX2 and FMA were detected.
                    unsafe {
                        micro_avx2::<3, 4>(x3, w4, &mut tile)
                    };
                }
                for (i, row) in tile.iter().enumerate() {
                    for (j, &got) in row.iter().enumerate() {
                        assert_eq!(got.to_bits(), single(i, j).to_bits(), "{name} cols {cols} ({i}, {j})");
                    }
                }
            }
        }
        // The product of a batch equals the products of its rows one at a time.
        let w = Weight::F32(Matrix {
            rows: 21,
            cols: 67,
            data: (0..21 * 67).map(|i| ((i % 19) as f32 - 9.0) / 4.0).collect(),
        });
        let x: Vec<f32> = (0..7 * 67).map(|i| ((i % 13) as f32 - 6.0) / 3.0).collect();
        let mut all = vec![0f32; 7 * 21];
        matmul(&w, &x, 7, &mut all);
        for r in 0..7 {
            let mut one = vec![0f32; 21];
            matmul(&w, &x[r * 67..(r + 1) * 67], 1, &mut one);
            assert!(one.iter().zip(&all[r * 21..]).all(|(a, b)| a.to_bits() == b.to_bits()), "row {r}");
        }
    }
}
