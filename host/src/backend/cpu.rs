//! The fast CPU backend: the same bytes as [`crate::reference`], computed in f32 with
//! threads (rayon) over sequences, KV heads and splits, and inner loops written so the
//! compiler vectorizes them (lane-parallel accumulators, lookup tables that unpack a
//! byte of codes at once). On x86-64 with AVX2 the hot loops are compiled a second time
//! for AVX2 and picked at run time.
//!
//! Scores never dequantize a key: for a group with scale `s` and zero `z`,
//! `q'.khat = s * (q'.codes) + z * sum(q')`, and `sum(q')` per group is computed once
//! per query.

use crate::KvElement;
use crate::config::{HeadRotation, LayerCalibration};
use crate::reference;
use crate::reference::SeqRef;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use rotkv_kernels::layout::{Format, NO_CLIP, Place, clip_range};
pub use rotkv_kernels::math::exp_neg;
use rotkv_kernels::math::f64_to_f16;
use rotkv_kernels::params::{AppendParams, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DecodeParams};

/// Tokens scored per softmax step (one max and one rescale per chunk).
const CHUNK: usize = 64;

/// Token columns of a chunk's transposed key codes (`avx2::transpose_codes`): a chunk
/// rounded up to whole token sets of every `avx2::dots_codes_t` instance (16, 24, 32 or
/// 48 tokens). The AVX2 transposition zeroes the columns past the chunk; the 512-bit
/// one (`avx512::transpose_codes`) writes the chunk rounded up to 16 tokens only (its
/// kernel reads no further), so the columns after those hold what an earlier chunk left.
const CODES_T_COLS: usize = 96;

/// In-place orthonormal FWHT in f32 (same definition as [`crate::reference::fwht`]).
/// Rows of 8 to 256 values run an AVX2 kernel where the processor has it, or one in
/// 512-bit registers for rows of 16 to 256 where it has AVX-512 F (the same additions
/// in the same order, so bit for bit the portable result).
pub fn fwht(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect()
        && avx2::fwht(kern, x)
    {
        return;
    }
    fwht_portable(x)
}

/// The portable [`fwht`].
fn fwht_portable(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    if n >= 8 {
        // The three short strides inside each block of 8, in registers (the same additions
        // in the same order as the loop below would do them).
        for b in x.chunks_exact_mut(8) {
            let a: [f32; 8] = b.try_into().expect("8 values");
            let s = [
                a[0] + a[1],
                a[0] - a[1],
                a[2] + a[3],
                a[2] - a[3],
                a[4] + a[5],
                a[4] - a[5],
                a[6] + a[7],
                a[6] - a[7],
            ];
            let t = [
                s[0] + s[2],
                s[1] + s[3],
                s[0] - s[2],
                s[1] - s[3],
                s[4] + s[6],
                s[5] + s[7],
                s[4] - s[6],
                s[5] - s[7],
            ];
            let u = [
                t[0] + t[4],
                t[1] + t[5],
                t[2] + t[6],
                t[3] + t[7],
                t[0] - t[4],
                t[1] - t[5],
                t[2] - t[6],
                t[3] - t[7],
            ];
            b.copy_from_slice(&u);
        }
        h = 8;
    }
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

/// `out = x R` for a row-major `d x d` matrix (row by row, so the inner loop is a
/// vectorizable axpy).
fn dense_rotate(x: &[f32], r: &[f32], out: &mut [f32]) {
    let d = x.len();
    out.fill(0.0);
    for (&xi, row) in x.iter().zip(r.chunks_exact(d)) {
        out.iter_mut().zip(row).for_each(|(o, &m)| *o += xi * m);
    }
}

/// Rotates `x` (in place) into stored order in `out`: `out[j] = (x R)[perm[j]]`.
fn rotate_into(x: &mut [f32], rot: HeadRotation<'_>, perm: &[u16], out: &mut [f32]) {
    match rot {
        HeadRotation::None => {}
        HeadRotation::Hadamard => fwht(x),
        HeadRotation::Dense(r) => {
            dense_rotate(x, r, out);
            x.copy_from_slice(out);
        }
    }
    for (o, &p) in out.iter_mut().zip(perm) {
        *o = x[p as usize];
    }
}

/// Inverse of [`rotate_into`]: `out = unpermute(y) R^T`; `t` is scratch of the row's
/// length.
fn unrotate_into(y: &[f32], rot: HeadRotation<'_>, perm: &[u16], t: &mut [f32], out: &mut [f32]) {
    for (&yj, &pj) in y.iter().zip(perm) {
        t[pj as usize] = yj;
    }
    match rot {
        HeadRotation::None => out.copy_from_slice(t),
        HeadRotation::Hadamard => {
            out.copy_from_slice(t);
            fwht(out);
        }
        HeadRotation::Dense(r) => {
            for (o, row) in out.iter_mut().zip(r.chunks_exact(t.len())) {
                *o = dot(row, t);
            }
        }
    }
}

/// Rotates one input row (minus `mean`, where given) into stored order and rounds it
/// to f16, as the CPU append stores it; `x` and `y` are scratch of the row's length.
#[inline]
fn stage_row(
    src: &[f32],
    mean: Option<(&[f32], &[f32])>,
    rot: HeadRotation<'_>,
    perm: &[u16],
    x: &mut [f32],
    y: &mut [f32],
    dst: &mut [f16],
) {
    match mean {
        Some((m, s)) => x.iter_mut().zip(src.iter().zip(m).zip(s)).for_each(|(x, ((a, m), s))| *x = (a - m) / s),
        None => x.copy_from_slice(src),
    }
    rotate_into(x, rot, perm, y);
    dst.convert_from_f32_slice(y);
}

/// The f16 row the CPU backend stores for an input row (the f32 twin of
/// [`crate::reference::stored_key`] / [`crate::reference::stored_value`]).
/// `mean`: the key's `(mean, scale)`, the row becoming `(src - mean) / scale`.
pub fn stored_row(src: &[f32], mean: Option<(&[f32], &[f32])>, rot: HeadRotation<'_>, perm: &[u16]) -> Vec<f16> {
    let n = src.len();
    let mut out = vec![f16::ZERO; n];
    stage_row(src, mean, rot, perm, &mut vec![0.0; n], &mut vec![0.0; n], &mut out);
    out
}

/// Converts an input row (f32, f16 or bf16) to f32; f16 rows with the kernel set's
/// batched conversion (F16C under AVX2).
#[inline(always)]
fn load_row<K: Kernels, T: KvElement>(kern: K, src: &[T], dst: &mut [f32]) {
    if T::DTYPE == DTYPE_F32 {
        dst.copy_from_slice(bytemuck::cast_slice(src));
    } else if T::DTYPE == DTYPE_F16 {
        kern.to_f32(bytemuck::cast_slice(src), dst);
    } else {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}

/// The first row `i` of `x` (`[rows][d]`, row `i` of head `i % heads`) for which
/// `exact_bad(i, row)` holds, asking it only about rows that fail a fast test: the
/// row's squared L2 norm as stored, `(x - mean) / scale` (`mean`: `[heads][d]` each), in f32 (with AVX2
/// where present), below `bound2`. Rows are scanned in parallel. (The caller picks
/// `bound2` below its exact limit by more than the f32 sum's error; an infinity or NaN
/// anywhere fails the fast test.)
pub(crate) fn first_bad_row<T: KvElement>(
    x: &[T],
    heads: usize,
    d: usize,
    mean: Option<(&[f32], &[f32])>,
    bound2: f32,
    exact_bad: impl Fn(usize, &[T]) -> bool + Sync,
) -> Option<usize> {
    const ROWS: usize = 64;
    #[inline(always)]
    fn norm2<K: Kernels, T: KvElement>(kern: K, row: &[T], mean: Option<(&[f32], &[f32])>, buf: &mut [f32]) -> f32 {
        let affine = mean.map_or(KeyAffine::None, |(m, s)| KeyAffine::Full(m, s));
        load_affine(kern, row, affine, buf)
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn scan<K: Kernels, T: KvElement>(
        kern: K,
        block: &[T],
        first: usize,
        heads: usize,
        d: usize,
        mean: Option<(&[f32], &[f32])>,
        bound2: f32,
        exact_bad: &(impl Fn(usize, &[T]) -> bool + Sync),
    ) -> Option<usize> {
        let mut buf = [0f32; 256];
        for (r, row) in block.chunks_exact(d).enumerate() {
            let i = first + r;
            let hd = i % heads * d..(i % heads + 1) * d;
            let m = mean.map(|(m, s)| (&m[hd.clone()], &s[hd]));
            let n2 = norm2(kern, row, m, &mut buf[..d]);
            if (n2.is_nan() || n2 >= bound2) && exact_bad(i, row) {
                return Some(i);
            }
        }
        None
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn scan_avx2<T: KvElement>(
        kern: Avx2,
        block: &[T],
        first: usize,
        heads: usize,
        d: usize,
        mean: Option<(&[f32], &[f32])>,
        bound2: f32,
        exact_bad: &(impl Fn(usize, &[T]) -> bool + Sync),
    ) -> Option<usize> {
        scan(kern, block, first, heads, d, mean, bound2, exact_bad)
    }
    assert!(d <= 256 && d.is_multiple_of(LANES));
    #[cfg(target_arch = "x86_64")]
    let avx = Avx2::detect();
    x.par_chunks(ROWS * d).enumerate().find_map_first(|(b, block)| {
        #[cfg(target_arch = "x86_64")]
        if let Some(kern) = avx {
            // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target features.
            return unsafe { scan_avx2(kern, block, b * ROWS, heads, d, mean, bound2, &exact_bad) };
        }
        scan(Portable, block, b * ROWS, heads, d, mean, bound2, &exact_bad)
    })
}

/// Scratch rows of the fused append (one set per worker thread): `x`, `y` and `row` of
/// one row, `page` the stored f16 rows of a head-page (keys, then values), `ranges` the
/// min and max of each of their groups and `params` their row-local scales and zeros.
struct AppendScratch {
    x: Vec<f32>,
    y: Vec<f32>,
    row: Vec<f16>,
    page: Vec<f16>,
    ranges: Vec<(f32, f32)>,
    params: Vec<u8>,
    /// A page's new rows before and after a learned rotation (`[page_size][d]` and
    /// `[2][page_size][d]`, keys then values); empty until a learned rotation needs them.
    dense_in: Vec<f32>,
    dense_out: Vec<f32>,
}

impl AppendScratch {
    /// For rows of `d` and pages of `page_size` tokens, `groups` per row.
    fn new(d: usize, page_size: usize, groups: usize) -> Self {
        let mut s = Self {
            x: vec![],
            y: vec![],
            row: vec![],
            page: vec![],
            ranges: vec![],
            params: vec![],
            dense_in: vec![],
            dense_out: vec![],
        };
        s.fit(d, page_size, groups);
        s
    }

    /// Rows of exactly `d`, and room for pages of `page_size` tokens, `groups` per row.
    fn fit(&mut self, d: usize, page_size: usize, groups: usize) {
        self.x.resize(d, 0.0);
        self.y.resize(d, 0.0);
        self.row.resize(d, f16::ZERO);
        let rows = 2 * page_size;
        self.page.resize(self.page.len().max(rows * d), f16::ZERO);
        self.ranges.resize(self.ranges.len().max(rows * groups), (0.0, 0.0));
        self.params.resize(self.params.len().max(4 * rows * groups), 0);
    }
}

thread_local! {
    /// The calling thread's append scratch, kept between tasks and calls (a head-page's
    /// rows are tens of KiB: allocating and zeroing them per task showed in profiles).
    static SCRATCH: std::cell::RefCell<AppendScratch> = std::cell::RefCell::new(AppendScratch::new(0, 0, 0));
}

/// Runs `f` with this thread's append scratch fitted to the format's rows and pages (a
/// fresh one if it is in use further up this thread's stack).
fn with_scratch<R>(fmt: &Format, f: impl FnOnce(&mut AppendScratch) -> R) -> R {
    let (d, ps, groups) = (fmt.head_dim as usize, fmt.page_size as usize, fmt.groups() as usize);
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => {
            s.fit(d, ps, groups);
            f(&mut s)
        }
        Err(_) => f(&mut AppendScratch::new(d, ps, groups)),
    })
}

/// How a key row becomes `(k - mean) / scale` before its rotation, per KV head: the
/// same f32 operations as [`stage_row`], with the ones that change no bit left out
/// (`x - 0.0 == x` and `x / 1.0 == x` for every finite `x`, signed zeros included).
#[derive(Clone, Copy)]
pub(crate) enum KeyAffine<'a> {
    /// Mean `+0.0` and scale 1 everywhere: the row as it is.
    None,
    /// Scale 1 everywhere: `x - mean`.
    Center(&'a [f32]),
    /// `(x - mean) / scale`.
    Full(&'a [f32], &'a [f32]),
}

impl<'a> KeyAffine<'a> {
    fn of(mean: &'a [f32], scale: &'a [f32]) -> Self {
        match (mean.iter().all(|m| m.to_bits() == 0), scale.iter().all(|&s| s == 1.0)) {
            (true, true) => Self::None,
            (false, true) => Self::Center(mean),
            _ => Self::Full(mean, scale),
        }
    }
}

/// Loads an input row into `x` as f32 and centers and scales it (keys) as
/// [`stage_row`] does; returns its squared L2 norm in f32, eight partial sums (NaN or
/// infinite when a value is not finite): the fast test of [`first_bad_row`] and of the
/// fused append.
#[inline(always)]
fn load_affine<K: Kernels, T: KvElement>(kern: K, src: &[T], affine: KeyAffine<'_>, x: &mut [f32]) -> f32 {
    load_row(kern, src, x);
    match affine {
        KeyAffine::None => {}
        KeyAffine::Center(m) => x.iter_mut().zip(m).for_each(|(x, m)| *x -= m),
        KeyAffine::Full(m, s) => x.iter_mut().zip(m.iter().zip(s)).for_each(|(x, (m, s))| *x = (*x - m) / s),
    }
    let mut acc = [0f32; LANES];
    for x8 in x.chunks_exact(LANES) {
        for l in 0..LANES {
            acc[l] += x8[l] * x8[l];
        }
    }
    acc.iter().sum()
}

/// [`stage_row`] for an input row of any element type into `dst`, with the kernel
/// set's FWHT and f16 conversions (the same bits as [`stage_row`]: the same f32
/// operations, conversions rounding to nearest even). Returns [`load_affine`]'s squared
/// norm, so that the fused append checks each row as it reads it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn stage_input<K: Kernels, T: KvElement>(
    kern: K,
    src: &[T],
    mean: KeyAffine<'_>,
    rot: HeadRotation<'_>,
    perm: Option<&[u16]>,
    x: &mut [f32],
    y: &mut [f32],
    row: &mut [f16],
) -> f32 {
    let norm2 = load_affine(kern, src, mean, x);
    match rot {
        HeadRotation::None => {}
        HeadRotation::Hadamard => kern.fwht(x),
        HeadRotation::Dense(r) => {
            kern.dense_rotate(x, r, y);
            x.copy_from_slice(y);
        }
    }
    permute_round(kern, x, perm, y, row);
    norm2
}

/// The rotated row `x` permuted into stored order (`y` is scratch of its length) and
/// rounded to f16 into `row`: the last steps of [`stage_input`].
#[inline(always)]
fn permute_round<K: Kernels>(kern: K, x: &[f32], perm: Option<&[u16]>, y: &mut [f32], row: &mut [f16]) {
    match perm {
        Some(perm) => {
            for (o, &p) in y.iter_mut().zip(perm) {
                *o = x[p as usize];
            }
            kern.round_to_f16(y, row);
        }
        None => kern.round_to_f16(x, row),
    }
}

/// `Some(perm)` unless it is the identity.
fn non_identity(perm: &[u16]) -> Option<&[u16]> {
    (!perm.iter().enumerate().all(|(i, &p)| p as usize == i)).then_some(perm)
}

/// Codes of one group against its stored scale and zero, bit for bit those of
/// [`crate::reference::quantize_row`] (`round((x - z) / s)` in f64, ties away from zero,
/// clamped), by comparisons with thresholds instead of divisions: the code is the number
/// of `k` in `1..=levels` with `x >= z + (k - 1/2) s`. Each threshold is exact in f64
/// (`z`, `s` are f16, `(k - 1/2) s` has at most 16 significant bits, the sum spans less
/// than 46 bits), and rounding it up to f32 keeps the comparison exact for the f32 `x`
/// (an f16 value). The reference's f64 division never rounds across a tie: a quotient
/// off a tie is off it by at least `2^-25 / s`, far more than its rounding (`|x - z| <
/// 2^17`), and `round` sends an exact tie away from zero as `>=` does. So the results
/// agree for every input, ties included. `false` (nothing written) when a threshold is
/// not finite (scales or zeros at the ends of the f16 range); the caller then divides.
#[inline(always)]
fn group_codes<const LEVELS: usize>(x: &[f32], s: f64, z: f64, out: &mut [u8]) -> bool {
    let mut th = [0f32; LEVELS];
    for (k, t) in th.iter_mut().enumerate() {
        match threshold(z, s, k) {
            Some(r) => *t = r,
            None => return false,
        }
    }
    for (o, &v) in out.iter_mut().zip(x) {
        let mut c = 0u8;
        for &t in &th {
            c += (v >= t) as u8;
        }
        *o = c;
    }
    true
}

/// Threshold `k` of a group with stored scale `s` and zero `z`: `z + (k + 1/2) s`, exact
/// in f64, rounded up to f32 (see [`group_codes`]); `None` where it is not finite.
#[inline(always)]
fn threshold(z: f64, s: f64, k: usize) -> Option<f32> {
    let exact = z + (k as f64 + 0.5) * s;
    if !exact.is_finite() {
        return None;
    }
    let r = exact as f32;
    Some(if (r as f64) < exact { r.next_up() } else { r })
}

/// Packs codes (`bits` each) little-end first into bytes (docs/src/format.md).
#[inline(always)]
fn pack_into(codes: &[u8], bits: u32, out: &mut [u8]) {
    if bits == 2 {
        for (o, c) in out.iter_mut().zip(codes.chunks_exact(4)) {
            *o = c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6;
        }
    } else {
        for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
            *o = c[0] | c[1] << 4;
        }
    }
}

/// The scale and zero of a group of finite f16 values `x` with range
/// `[lo, hi]`, rounded to f16 as [`crate::reference::quantize_row`] does; a range that
/// ends at a zero is recomputed by the reference's own [`reference::group_range`] (so
/// `-0.0` against `0.0` is decided the same way).
#[inline(always)]
fn group_params(x: &[f16], lo: f32, hi: f32, bits: u32, clip_q16: u32) -> (f16, f16) {
    let (lo, hi) = if lo == 0.0 || hi == 0.0 {
        let buf: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        reference::group_range(&buf)
    } else {
        (lo as f64, hi as f64)
    };
    let (lo, hi) = clip_range(lo, hi, clip_q16);
    let levels = ((1u32 << bits) - 1) as f64;
    (f16::from_bits(f64_to_f16((hi - lo) / levels)), f16::from_bits(f64_to_f16(lo)))
}

/// A group whose range `lo..hi` ends at a zero, for the vector quantizers: its scale and
/// zero from [`group_params`] (which decides the zero's sign from the row) into `p` (4
/// bytes, little-endian f16 scale then zero) and its thresholds (see [`group_codes`];
/// all `+inf` for a constant group) into `t[..levels]`. False where a threshold is not
/// finite: the row must then go to the portable quantizer (`t` holds `+inf` there).
#[inline]
fn zero_end_params(x: &[f16], (lo, hi): (f32, f32), bits: u32, clip_q16: u32, p: &mut [u8], t: &mut [f32]) -> bool {
    let (s, z) = group_params(x, lo, hi, bits, clip_q16);
    p[..2].copy_from_slice(&s.to_le_bytes());
    p[2..4].copy_from_slice(&z.to_le_bytes());
    let (s, z) = (s.to_f64(), z.to_f64());
    let mut finite = true;
    for (k, t) in t.iter_mut().enumerate().take((1 << bits) - 1) {
        *t = match (s == 0.0, threshold(z, s, k)) {
            (true, _) => f32::INFINITY,
            (false, Some(r)) => r,
            (false, None) => {
                finite = false;
                f32::INFINITY
            }
        };
    }
    finite
}

/// The min and max of each group of `g` values of a stored f16 row (finite values),
/// exact; a range ending at a zero of either sign is recomputed by [`group_params`], so
/// the sign of a zero found here does not matter.
#[inline(always)]
fn group_ranges_portable(row: &[f16], g: usize, ranges: &mut [(f32, f32)]) {
    for (x, range) in row.chunks_exact(g).zip(ranges.iter_mut()) {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for v in x.iter().map(|v| v.to_f32()) {
            lo = if v < lo { v } else { lo };
            hi = if v > hi { v } else { hi };
        }
        *range = (lo, hi);
    }
}

/// Quantizes one stored f16 row (finite values, groups of `g` whose min and max are
/// `ranges`, see [`group_ranges_portable`]) into packed codes and `(scale, zero)` pairs,
/// bit for bit [`crate::reference::quantize_row`]: threshold codes ([`group_codes`]),
/// dividing only where a threshold is not finite.
#[inline(always)]
fn quantize_row_portable(
    row: &[f16],
    bits: u32,
    g: usize,
    clip_q16: u32,
    ranges: &[(f32, f32)],
    codes: &mut [u8],
    params: &mut [u8],
) {
    let levels = ((1u32 << bits) - 1) as f64;
    let (mut x, mut c) = ([0f32; 256], [0u8; 256]);
    let (x, c) = (&mut x[..row.len()], &mut c[..row.len()]);
    row.convert_to_f32_slice(x);
    for (j, (x, out)) in x.chunks_exact(g).zip(c.chunks_exact_mut(g)).enumerate() {
        let (lo, hi) = ranges[j];
        let (scale, zero) = group_params(&row[j * g..(j + 1) * g], lo, hi, bits, clip_q16);
        params[4 * j..4 * j + 2].copy_from_slice(&scale.to_le_bytes());
        params[4 * j + 2..4 * j + 4].copy_from_slice(&zero.to_le_bytes());
        let (s, z) = (scale.to_f64(), zero.to_f64());
        if s == 0.0 {
            out.fill(0);
            continue;
        }
        let done = if bits == 2 { group_codes::<3>(x, s, z, out) } else { group_codes::<15>(x, s, z, out) };
        if !done {
            for (o, &v) in out.iter_mut().zip(x.iter()) {
                *o = ((v as f64 - z) / s).round().clamp(0.0, levels) as u8;
            }
        }
    }
    pack_into(c, bits, codes);
}

/// Quantizes stored f16 rows (`rows`: `[n][head_dim]`, `n` at most a page; `ranges`:
/// the min and max of each of their groups, `[n][groups]`, as
/// [`Kernels::group_ranges`] finds them) into the head-page `bytes` (their codes and
/// scale/zero pairs at slots `slot..slot + n`) with the kernel set's quantizer (bit for
/// bit the reference's); `params` is scratch of at least `n` rows' scale/zero bytes.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn quantize_into_page<K: Kernels>(
    kern: K,
    fmt: &Format,
    rows: &[f16],
    ranges: &[(f32, f32)],
    value: bool,
    slot: u32,
    bytes: &mut [u8],
    params: &mut [u8],
) {
    let (d, groups) = (fmt.head_dim as usize, fmt.groups() as usize);
    let (n, pb, cb) = (rows.len() / d, fmt.param_bytes() as usize, fmt.code_bytes(value) as usize);
    assert!(rows.len() == n * d && ranges.len() == n * groups && slot as usize + n <= fmt.page_size as usize);
    let params = &mut params[..n * pb];
    let c = fmt.codes_at(value, slot) as usize;
    let codes = &mut bytes[c..c + n * cb];
    kern.quantize_rows(rows, d, fmt.bits(value), fmt.group_size as usize, fmt.clip(value), ranges, codes, params);
    // Row-local (scale, zero) pairs to the page's planar layout: one group's scales (and
    // zeros) of consecutive slots are contiguous.
    for j in 0..groups {
        let (s0, z0) = (fmt.scale_at(value, j as u32, slot) as usize, fmt.zero_at(value, j as u32, slot) as usize);
        for (i, p) in params.chunks_exact(pb).enumerate() {
            bytes[s0 + 2 * i..s0 + 2 * i + 2].copy_from_slice(&p[4 * j..4 * j + 2]);
            bytes[z0 + 2 * i..z0 + 2 * i + 2].copy_from_slice(&p[4 * j + 2..4 * j + 4]);
        }
    }
}

/// Element of new token `t`, KV head `h` of the K input (`p.token_stride` apart).
#[inline(always)]
fn k_src(p: &AppendParams, t: u32, h: usize) -> usize {
    t as usize * p.token_stride as usize + h * p.head_stride as usize
}

/// Element of new token `t`, KV head `h` of the V input (`p.v_token_stride` apart).
#[inline(always)]
fn v_src(p: &AppendParams, t: u32, h: usize) -> usize {
    t as usize * p.v_token_stride as usize + h * p.head_stride as usize
}

/// The exact test of an append's input row: `(value, token, kv_head, row)`, true when
/// the row is bad.
pub(crate) type ExactRowTest<'a, T> = dyn Fn(bool, usize, usize, &[T]) -> bool + Sync + 'a;

/// The input check of an append, made by the CPU backend's fused pass on the rows it
/// reads anyway (the test of [`crate::paged::check_rows`]: finite values and an L2 norm as
/// stored within the f16 range), so the input crosses memory once.
pub(crate) struct RowCheck<'a, T> {
    /// Rows whose f32 squared norm (eight partial sums) is below this pass without the
    /// exact test (the caller sets it below the exact limit by more than the f32 sum's
    /// error; a NaN or infinite norm fails it).
    pub fast_limit: f32,
    /// The exact test of a row that fails the fast one: `(value, token, kv_head, row)`,
    /// true when the row is bad.
    pub exact_bad: &'a ExactRowTest<'a, T>,
}

impl<T> RowCheck<'_, T> {
    /// Whether the row of `(value, token, kv_head)` with fast squared norm `norm2` is bad.
    #[inline(always)]
    fn bad(&self, norm2: f32, value: bool, token: usize, h: usize, row: &[T]) -> bool {
        // A NaN norm is not below the limit: it goes to the exact test.
        let fast_ok = norm2 < self.fast_limit;
        !fast_ok && (self.exact_bad)(value, token, h, row)
    }
}

/// A KV head's key and value permutations (`None`: the identity).
type HeadPerms<'a> = (Option<&'a [u16]>, Option<&'a [u16]>);

/// Everything one head-page of an append reads: the format, the calibration, the old
/// window rows and the new input rows, and the check the new rows must pass.
struct PageInputs<'a, T> {
    p: &'a AppendParams,
    calib: &'a LayerCalibration,
    /// Per KV head: how its key rows are centered and scaled.
    affine: &'a [KeyAffine<'a>],
    /// Per KV head: its key and value permutations (`None`: the identity).
    perms: &'a [HeadPerms<'a>],
    side: &'a [f16],
    k: &'a [T],
    v: &'a [T],
    check: Option<&'a RowCheck<'a, T>>,
}

/// Where [`fill_page`] found the stored f16 row of a slot.
enum Staged {
    /// Row `at` of the side store (an old window row).
    Side(usize),
    /// A new input row, staged into the row given; `true` when its groups' ranges were
    /// found too.
    Scratch(bool),
    /// A new input row that fails the check: nothing more is written.
    Bad,
}

/// Quantizes head-page `(page, h)` into `bytes`: first every stored f16 row of the page
/// into the scratch (`scr.page`, with each group's min and max): an old window row copied
/// from its f16 side row, a new row checked, rotated and rounded to f16 as it is read (in
/// one pass in registers where the kernel set can, [`Kernels::stage_hadamard`]: a Hadamard
/// rotation and no channel permutation; else [`stage_input`]); then the keys and the
/// values quantized a page at a time ([`quantize_into_page`]). Variance-normalized pages
/// (which need the whole page's rows first) go through
/// [`crate::reference::quantize_page`] on the same rows. False when a new row fails the
/// check (then nothing of a regular page has been written, but a variance-normalized
/// page's key half may have been).
#[inline(always)]
fn fill_page<K: Kernels, T: KvElement>(
    kern: K,
    inp: &PageInputs<'_, T>,
    page: u32,
    h: u32,
    bytes: &mut [u8],
    scr: &mut AppendScratch,
) -> bool {
    let p = inp.p;
    let fmt = &p.format;
    let d = fmt.head_dim as usize;
    let hu = h as usize;
    let len = p.start;
    let (kperm, vperm) = inp.perms[hu];
    let (krot, vrot) = (inp.calib.rotation(false, hu, d, p.flags), inp.calib.rotation(true, hu, d, p.flags));
    let pos = |slot: u32| fmt.sinks + page * fmt.page_size + slot;
    let g = fmt.group_size as usize;
    let groups = fmt.groups() as usize;
    let AppendScratch { x, y, row: scr_row, page: staged, ranges, params, dense_in, dense_out } = scr;
    // New rows under a learned rotation are loaded and checked first, then rotated a
    // page at a time (`Kernels::dense_rotate_rows`, the same bits as row by row); `stage`
    // takes them from `dense_out` (keys, then values, `[page_size][d]` each).
    let ps = fmt.page_size as usize;
    let first_new = (0..fmt.page_size).find(|&slot| pos(slot) >= len).unwrap_or(fmt.page_size) as usize;
    let mut dense = [false; 2];
    for (vi, rot) in [krot, vrot].into_iter().enumerate() {
        let HeadRotation::Dense(r) = rot else { continue };
        if first_new == ps {
            continue;
        }
        let value = vi == 1;
        dense_in.resize(dense_in.len().max(ps * d), 0.0);
        dense_out.resize(dense_out.len().max(2 * ps * d), 0.0);
        for slot in first_new..ps {
            let at = pos(slot as u32);
            let (row, affine) = if value {
                (&inp.v[v_src(p, at - len, hu)..][..d], KeyAffine::None)
            } else {
                (&inp.k[k_src(p, at - len, hu)..][..d], inp.affine[hu])
            };
            let norm2 = load_affine(kern, row, affine, &mut dense_in[slot * d..][..d]);
            if inp.check.is_some_and(|c| c.bad(norm2, value, (at - len) as usize, hu, row)) {
                return false;
            }
        }
        let out = &mut dense_out[(vi * ps + first_new) * d..(vi + 1) * ps * d];
        kern.dense_rotate_rows(&dense_in[first_new * d..ps * d], r, d, out);
        dense[vi] = true;
    }
    let dense_out = &dense_out[..];
    // The stored f16 row of (slot, value): from the side store, or staged into `dst` (with
    // its groups' ranges into `rg` where the kernel set stages it in one pass).
    let stage = |slot: u32, value: bool, x: &mut [f32], y: &mut [f32], dst: &mut [f16], rg: &mut [(f32, f32)]| {
        let at = pos(slot);
        if at < len {
            return Staged::Side(fmt.side_row_at(h, value, fmt.window_row(at)));
        }
        let t = (at - len) as usize;
        let (row, affine, rot, perm) = if value {
            (&inp.v[v_src(p, at - len, hu)..][..d], KeyAffine::None, vrot, vperm)
        } else {
            (&inp.k[k_src(p, at - len, hu)..][..d], inp.affine[hu], krot, kperm)
        };
        if dense[value as usize] {
            // Rotated (and checked) above.
            permute_round(kern, &dense_out[(value as usize * ps + slot as usize) * d..][..d], perm, y, dst);
            return Staged::Scratch(false);
        }
        let fused = match (rot, perm) {
            (HeadRotation::Hadamard, None) => kern.stage_hadamard(row, affine, g, dst, rg),
            _ => None,
        };
        let (norm2, ranged) = match fused {
            Some(norm2) => (norm2, true),
            None => (stage_input(kern, row, affine, rot, perm, x, y, dst), false),
        };
        match inp.check {
            Some(c) if c.bad(norm2, value, t, hu, row) => Staged::Bad,
            _ => Staged::Scratch(ranged),
        }
    };
    if fmt.channel_norm > 0 {
        for value in [false, true] {
            let mut rows = Vec::with_capacity(fmt.page_size as usize * d);
            for slot in 0..fmt.page_size {
                let row = match stage(slot, value, x, y, scr_row, &mut ranges[..groups]) {
                    Staged::Side(at) => &inp.side[at..at + d],
                    Staged::Scratch(_) => &scr_row[..],
                    Staged::Bad => return false,
                };
                rows.extend(row.iter().map(|x| x.to_f64()));
            }
            reference::quantize_page(fmt, &rows, value, bytes);
        }
        return true;
    }
    // New rows of one head are a token stride apart (a new memory page every row or two
    // at head_dim 128 and up, which hardware prefetchers do not cross): ask for them
    // PREFETCH slots ahead.
    const PREFETCH: u32 = 4;
    let prefetch = |slot: u32| {
        let at = pos(slot);
        if slot < fmt.page_size && at >= len {
            let (ks, vs) = (k_src(p, at - len, hu), v_src(p, at - len, hu));
            kern.prefetch_l1(bytemuck::cast_slice(&inp.k[ks..ks + d]));
            kern.prefetch_l1(bytemuck::cast_slice(&inp.v[vs..vs + d]));
        }
    };
    (0..PREFETCH).for_each(prefetch);
    // Every stored row of the page first (keys, then values, in `staged`), then the page
    // quantized in two calls, so that the quantizer works on many rows at once.
    let ps = fmt.page_size as usize;
    let (keys, values) = staged[..2 * ps * d].split_at_mut(ps * d);
    let (key_ranges, value_ranges) = ranges[..2 * ps * groups].split_at_mut(ps * groups);
    let slots = keys.chunks_exact_mut(d).zip(key_ranges.chunks_exact_mut(groups));
    let slots = slots.zip(values.chunks_exact_mut(d).zip(value_ranges.chunks_exact_mut(groups)));
    // Where both halves take the one-pass staging, a new token's key and value rows are
    // staged in one call (`Kernels::stage_hadamard_pair`: the two rows' work side by side).
    let pair = !dense[0]
        && !dense[1]
        && matches!((krot, kperm, vrot, vperm), (HeadRotation::Hadamard, None, HeadRotation::Hadamard, None));
    for (slot, (k, v)) in slots.enumerate() {
        let slot = slot as u32;
        prefetch(slot + PREFETCH);
        if pair && slot as usize >= first_new {
            let at = pos(slot);
            let (kr, vr) = (&inp.k[k_src(p, at - len, hu)..][..d], &inp.v[v_src(p, at - len, hu)..][..d]);
            if let Some((nk, nv)) =
                kern.stage_hadamard_pair(kr, inp.affine[hu], vr, g, (&mut *k.0, &mut *k.1), (&mut *v.0, &mut *v.1))
            {
                let t = (at - len) as usize;
                if inp.check.is_some_and(|c| c.bad(nk, false, t, hu, kr) || c.bad(nv, true, t, hu, vr)) {
                    return false;
                }
                continue;
            }
        }
        for (value, (dst, rg)) in [(false, k), (true, v)] {
            match stage(slot, value, x, y, dst, rg) {
                Staged::Side(at) => {
                    dst.copy_from_slice(&inp.side[at..at + d]);
                    kern.group_ranges(dst, g, rg);
                }
                Staged::Scratch(true) => {}
                Staged::Scratch(false) => kern.group_ranges(dst, g, rg),
                Staged::Bad => return false,
            }
        }
    }
    quantize_into_page(kern, fmt, keys, key_ranges, false, 0, bytes, params);
    quantize_into_page(kern, fmt, values, value_ranges, true, 0, bytes, params);
    true
}

/// [`fill_page`] with the AVX2 kernels, compiled for AVX2 (and FMA, F16C).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn fill_page_avx2<T: KvElement>(
    kern: Avx2,
    inp: &PageInputs<'_, T>,
    page: u32,
    h: u32,
    bytes: &mut [u8],
    scr: &mut AppendScratch,
) -> bool {
    fill_page(kern, inp, page, h, bytes, scr)
}

/// [`fill_page`] with the best kernels this processor supports.
fn fill_page_best<T: KvElement>(
    inp: &PageInputs<'_, T>,
    page: u32,
    h: u32,
    bytes: &mut [u8],
    scr: &mut AppendScratch,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect() {
        // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target features.
        return unsafe { fill_page_avx2(kern, inp, page, h, bytes, scr) };
    }
    fill_page(Portable, inp, page, h, bytes, scr)
}

/// Bytes of saved pool blocks a thread keeps for its next append (a larger buffer is
/// freed after its call).
const SAVE_KEEP: usize = 16 << 20;

thread_local! {
    /// The calling thread's buffer for the pool blocks an append overwrites (restored when
    /// a row fails the check), kept between calls up to [`SAVE_KEEP`] bytes so that a
    /// steady stream of appends does not fault in fresh pages every call.
    static SAVED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Appends `p.count` new tokens (`k[t * p.token_stride + h * p.head_stride + c]`,
/// `v[t * p.v_token_stride + h * p.head_stride + c]`, f32, f16 or bf16) to a sequence
/// of `p.start` tokens, producing the bytes of [`crate::reference::append`] (f16 rows may
/// differ only at rounding ties of the f32 rotation, and codes then by one step).
///
/// With `check`, every new row is checked as it is read, and `false` is returned, with
/// nothing changed, when one fails: the rows that go to the side store (sinks, window)
/// first, then the pages that fill, one head-page per task, each task saving its pool
/// block before writing it (`fill_page`: each new row read once, checked, rotated and
/// rounded to f16 into the task's scratch, old window rows alike, then the page's rows
/// quantized and packed); a bad row there restores every block. Then the new sink, window and protected
/// rows (after, since the pages read the old window rows that the new ones may
/// overwrite). Without `check` the rows must have been validated.
#[allow(clippy::too_many_arguments)]
pub(crate) fn append_checked<T: KvElement>(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    protected: &[u32],
    k: &[T],
    v: &[T],
    check: Option<&RowCheck<'_, T>>,
) -> bool {
    let fmt = &p.format;
    let d = fmt.head_dim as usize;
    let hkv = p.num_kv_heads as usize;
    let (len, new_len) = (p.start, p.start + p.count);
    let affine: Vec<KeyAffine<'_>> =
        (0..hkv).map(|h| KeyAffine::of(calib.head(h, d).0, calib.head_key_scale(h, d))).collect();
    // The new rows that stay in f16 only (sinks, window): checked before anything is written.
    if let Some(c) = check {
        let mut buf = [0f32; 256];
        for pos in len..new_len {
            if matches!(fmt.place(pos, new_len), Place::Page { .. }) {
                continue;
            }
            let t = (pos - len) as usize;
            for h in 0..hkv {
                let kr = &k[k_src(p, pos - len, h)..][..d];
                let vr = &v[v_src(p, pos - len, h)..][..d];
                if c.bad(row_norm2_best(kr, affine[h], &mut buf[..d]), false, t, h, kr)
                    || c.bad(row_norm2_best(vr, KeyAffine::None, &mut buf[..d]), true, t, h, vr)
                {
                    return false;
                }
            }
        }
    }
    let perms: Vec<HeadPerms<'_>> = (0..hkv)
        .map(|h| {
            let (_, kperm, vperm) = calib.head(h, d);
            (non_identity(kperm), non_identity(vperm))
        })
        .collect();
    let (p0, p1) = (fmt.pages_for(len), fmt.pages_for(new_len));
    if p1 > p0 {
        let pb = fmt.page_bytes() as usize;
        // Each head-page's bytes, by (block, head); the block table's entries are distinct.
        let mut blocks: Vec<Option<&mut [u8]>> = pool.chunks_exact_mut(pb).map(Some).collect();
        let mut tasks = Vec::with_capacity((p1 - p0) as usize * hkv);
        for page in p0..p1 {
            for h in 0..hkv {
                let bytes = blocks[block_table[page as usize] as usize * hkv + h].take();
                tasks.push((page, h as u32, bytes.expect("distinct blocks in the block table")));
            }
        }
        let inp = PageInputs { p, calib, affine: &affine, perms: &perms, side: &*side, k, v, check };
        let ok = match check {
            None => {
                tasks.into_par_iter().for_each(|(page, h, bytes)| {
                    with_scratch(fmt, |scr| fill_page_best(&inp, page, h, bytes, scr));
                });
                true
            }
            Some(_) => {
                // Taken out of the thread-local for the call (not borrowed): a rayon worker
                // that runs another append while this one waits for its tasks finds it
                // empty and allocates its own.
                let size = tasks.len() * pb;
                let mut saved = SAVED.take();
                saved.resize(size.max(saved.len()), 0);
                let bad = std::sync::atomic::AtomicBool::new(false);
                tasks.par_iter_mut().zip(saved[..size].par_chunks_mut(pb)).for_each(|((page, h, bytes), save)| {
                    save.copy_from_slice(bytes);
                    if !bad.load(std::sync::atomic::Ordering::Relaxed)
                        && !with_scratch(fmt, |scr| fill_page_best(&inp, *page, *h, bytes, scr))
                    {
                        bad.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                let bad = bad.into_inner();
                if bad {
                    for ((_, _, bytes), save) in tasks.iter_mut().zip(saved.chunks_exact(pb)) {
                        bytes.copy_from_slice(save);
                    }
                }
                if saved.len() <= SAVE_KEEP {
                    SAVED.set(saved);
                }
                !bad
            }
        };
        if !ok {
            return false;
        }
    }
    // New tokens that stay in f16: sink and window rows, and protected rows.
    with_scratch(fmt, |scr| {
        for pos in len..new_len {
            let row = match fmt.place(pos, new_len) {
                Place::Sink { index } => Some(index),
                Place::Window { slot } => Some(slot),
                Place::Page { .. } => None,
            };
            let copy = reference::protected_index(protected, pos).map(|i| fmt.protected_row(i));
            if row.is_none() && copy.is_none() {
                continue;
            }
            for (h, (&key_affine, &(kperm, vperm))) in affine.iter().zip(&perms).enumerate() {
                let (ks, vs) = (k_src(p, pos - len, h), v_src(p, pos - len, h));
                for value in [false, true] {
                    let rot = calib.rotation(value, h, d, p.flags);
                    stage_input_best(&k[ks..ks + d], &v[vs..vs + d], value, key_affine, rot, kperm, vperm, scr);
                    for r in row.into_iter().chain(copy) {
                        let at = fmt.side_row_at(h as u32, value, r);
                        side[at..at + d].copy_from_slice(&scr.row);
                    }
                }
            }
        }
    });
    true
}

/// Appends `p.count` new tokens (`k[t * p.token_stride + h * p.head_stride + c]`,
/// `v[t * p.v_token_stride + h * p.head_stride + c]`, f32, f16 or bf16, already
/// validated: finite, each row's norm as stored within the f16 range) to a sequence of
/// `p.start` tokens, producing the bytes of [`crate::reference::append`] (f16 rows may
/// differ only at rounding ties of the f32 rotation, and codes then by one step): the
/// pages that fill first, one head-page per task written straight into its pool block
/// (each new row read once, rotated and rounded to f16 into the task's scratch, old window
/// rows alike, then the page's rows quantized and packed), then the new sink, window and
/// protected rows.
/// [`crate::paged::append`] on the cpu backend runs the same pass with the input check
/// fused into it, restoring the pool blocks it wrote when a row fails.
#[allow(clippy::too_many_arguments)]
pub fn append<T: KvElement>(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    protected: &[u32],
    k: &[T],
    v: &[T],
) {
    append_checked(p, calib, pool, block_table, side, protected, k, v, None);
}

/// The row's squared norm as stored before its rotation (see [`stage_input`]), with the
/// best kernels; `buf` is scratch of the row's length.
fn row_norm2_best<T: KvElement>(row: &[T], affine: KeyAffine<'_>, buf: &mut [f32]) -> f32 {
    #[inline(always)]
    fn go<K: Kernels, T: KvElement>(kern: K, row: &[T], affine: KeyAffine<'_>, buf: &mut [f32]) -> f32 {
        load_affine(kern, row, affine, buf)
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect() {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn go_avx2<T: KvElement>(kern: Avx2, row: &[T], affine: KeyAffine<'_>, buf: &mut [f32]) -> f32 {
            go(kern, row, affine, buf)
        }
        // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target features.
        return unsafe { go_avx2(kern, row, affine, buf) };
    }
    go(Portable, row, affine, buf)
}

/// [`stage_input`] of the key (`value == false`) or value row with the best kernels.
#[allow(clippy::too_many_arguments)]
fn stage_input_best<T: KvElement>(
    k: &[T],
    v: &[T],
    value: bool,
    affine: KeyAffine<'_>,
    rot: HeadRotation<'_>,
    kperm: Option<&[u16]>,
    vperm: Option<&[u16]>,
    scr: &mut AppendScratch,
) {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn go<K: Kernels, T: KvElement>(
        kern: K,
        k: &[T],
        v: &[T],
        value: bool,
        affine: KeyAffine<'_>,
        rot: HeadRotation<'_>,
        kperm: Option<&[u16]>,
        vperm: Option<&[u16]>,
        scr: &mut AppendScratch,
    ) {
        let AppendScratch { x, y, row, .. } = scr;
        if value {
            stage_input(kern, v, KeyAffine::None, rot, vperm, x, y, row);
        } else {
            stage_input(kern, k, affine, rot, kperm, x, y, row);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect() {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        fn go_avx2<T: KvElement>(
            kern: Avx2,
            k: &[T],
            v: &[T],
            value: bool,
            affine: KeyAffine<'_>,
            rot: HeadRotation<'_>,
            kperm: Option<&[u16]>,
            vperm: Option<&[u16]>,
            scr: &mut AppendScratch,
        ) {
            go(kern, k, v, value, affine, rot, kperm, vperm, scr)
        }
        // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target features.
        return unsafe { go_avx2(kern, k, v, value, affine, rot, kperm, vperm, scr) };
    }
    go(Portable, k, v, value, affine, rot, kperm, vperm, scr)
}

/// The split count the CPU backend uses when the caller does not choose: enough
/// `(sequence, KV head, split)` tasks to keep every thread busy, never splits shorter
/// than 512 tokens, at most 64.
pub fn default_splits(max_len: usize, num_seqs: usize, num_kv_heads: usize, threads: usize) -> u32 {
    let tasks = (num_seqs * num_kv_heads).max(1);
    let want = (4 * threads).div_ceil(tasks);
    let cap = max_len.div_ceil(512).max(1);
    want.clamp(1, cap.min(64)) as u32
}

/// Position of channel `c` in a row unpacked by [`unpack`] ("unpack order"): within
/// each block of 8 code bytes (`8 * 8 / bits` channels), channel `c` sits at
/// `(c % per_byte) * 8 + (c / per_byte) % 8`, so the unpack is 8 lanes wide per shift.
/// The order permutes channels only inside 16- or 32-channel blocks, so every
/// quantization group keeps its channels.
fn unpack_position(c: usize, bits: u32) -> usize {
    let per_byte = 8 / bits as usize;
    let block = 8 * per_byte;
    c / block * block + (c % per_byte) * 8 + (c / per_byte) % 8
}

/// The bit position at which the transposed key kernel (`avx2::dots_codes_t`) masks
/// stored channel `c`'s code inside its row's 32-bit word: `8 b + s * bits` for code `s`
/// of byte `b < 3`, `s * bits` for byte 3 (whose word is shifted down by 24 first).
fn code_shift(c: usize, bits: u32) -> u32 {
    let per_byte = 8 / bits as usize;
    let (b, s) = ((c / per_byte) % 4, c % per_byte);
    (if b < 3 { 8 * b } else { 0 } + s * bits as usize) as u32
}

/// `x * 2^-code_shift(c)`: exact (a power-of-two scale) unless the result is subnormal,
/// below `2^-126`, far under any query value that moves a score.
fn shifted_query(x: f32, c: usize, bits: u32) -> f32 {
    x * f32::from_bits((127 - code_shift(c, bits)) << 23)
}

/// Unpacks one token's codes to f32 in unpack order (see [`unpack_position`]).
#[inline(always)]
fn unpack_bits<const BITS: u32>(bytes: &[u8], out: &mut [f32]) {
    let per_byte = (8 / BITS) as usize;
    let mask = (1u32 << BITS) - 1;
    for (blk, o) in bytes.chunks_exact(8).zip(out.chunks_exact_mut(8 * per_byte)) {
        let b: [i32; 8] = std::array::from_fn(|i| blk[i] as i32);
        for (s, o8) in o.chunks_exact_mut(8).enumerate() {
            let shift = s as u32 * BITS;
            for i in 0..8 {
                // i32 (not u32) so the conversion is one vector instruction.
                o8[i] = ((b[i] >> shift) & mask as i32) as f32;
            }
        }
    }
}

#[inline(always)]
fn unpack(bytes: &[u8], bits: u32, out: &mut [f32]) {
    if bits == 2 { unpack_bits::<2>(bytes, out) } else { unpack_bits::<4>(bytes, out) }
}

/// `exp(x)` for `x <= RESCALE_THRESHOLD` (the lazily rescaled softmax weights).
#[inline(always)]
fn exp_shifted(x: f32) -> f32 {
    exp_neg(x - RESCALE_THRESHOLD) * RESCALE_EXP
}

/// `e^RESCALE_THRESHOLD`.
const RESCALE_EXP: f32 = 485_165_200.0;

/// One block of consecutive tokens of one KV head.
#[derive(Clone, Copy)]
pub(crate) enum Chunk<'a> {
    /// `n` f16 key rows and `n` f16 value rows, `[n][head_dim]` each, stored order.
    F16 { k: &'a [f16], v: &'a [f16] },
    /// Slots `[slot, slot + n)` of a head-page.
    Quant { page: &'a [u8], slot: u32, n: u32 },
}

/// Query heads per register block of the portable kernels.
const HEAD_BLOCK: usize = 4;
/// Channels per accumulator (one AVX2 register of f32).
const LANES: usize = 8;

/// The two inner products of attention over a chunk of `n <= CHUNK` tokens whose rows
/// are in f32 (`rows` is `[n][d]`), restricted to channels `[c0, c1)` (a multiple of 16
/// channels): scores `out[h][t] = sum_c q[h][c] * rows[t][c]` and value accumulation
/// `o[h][c] += sum_t w[h][t] * rows[t][c]`, for heads `h < g` (`out` and `w` are
/// `[g][CHUNK]`).
pub(crate) trait Kernels: Copy {
    /// Scores.
    #[allow(clippy::too_many_arguments)]
    fn dots(self, q: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]);
    /// Value accumulation.
    #[allow(clippy::too_many_arguments)]
    fn accumulate(self, o: &mut [f32], w: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize);

    /// `dst = src` as f32 (same length).
    #[inline(always)]
    fn to_f32(self, src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    /// `dst = src` rounded to f16, to nearest even (same length).
    #[inline(always)]
    fn round_to_f16(self, src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    /// [`fwht`] (the same bits).
    #[inline(always)]
    fn fwht(self, x: &mut [f32]) {
        fwht_portable(x)
    }

    /// [`dense_rotate`] (the same bits): `out = x R`, each output the products
    /// `x[i] * R[i][j]` rounded and added in order of `i`.
    #[inline(always)]
    fn dense_rotate(self, x: &[f32], r: &[f32], out: &mut [f32]) {
        dense_rotate(x, r, out)
    }

    /// [`Kernels::dense_rotate`] of every row of `x` (`[n][d]`, `r` is `d x d`) into
    /// `out` (the same bits, row by row).
    #[inline(always)]
    fn dense_rotate_rows(self, x: &[f32], r: &[f32], d: usize, out: &mut [f32]) {
        for (xr, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            self.dense_rotate(xr, r, o);
        }
    }

    /// A hint that `bytes` will be read in a few thousand cycles: into the second-level
    /// cache (nothing in portable code).
    #[inline(always)]
    fn prefetch(self, bytes: &[u8]) {
        let _ = bytes;
    }

    /// A hint that `bytes` will be read next: into the first-level cache (nothing in
    /// portable code).
    #[inline(always)]
    fn prefetch_l1(self, bytes: &[u8]) {
        let _ = bytes;
    }

    /// Softmax weights in place, `s[i] = exp(s[i] - m)` for `s[i] - m <= RESCALE_THRESHOLD`
    /// (`-inf` scores give 0), and their sum.
    #[inline(always)]
    fn exp_sum(self, s: &mut [f32], m: f32) -> f32 {
        for x in s.iter_mut() {
            *x = exp_shifted(*x - m);
        }
        sum(s)
    }

    /// The softmax weights of one head over a chunk whose values are one quantization
    /// group, with that group's value scales and zeros applied in the same pass:
    /// `w[i] = p[i] scales[i]` for `p[i] = exp(s[i] - m)` (as [`Kernels::exp_sum`]), and
    /// returns `(sum p, sum p zeros)`. `s` is left as it was or holds `p`.
    #[inline(always)]
    fn exp_weights(self, s: &mut [f32], m: f32, scales: &[f32], zeros: &[f32], w: &mut [f32]) -> (f32, f32) {
        let l = self.exp_sum(s, m);
        for ((w, p), sc) in w.iter_mut().zip(s.iter()).zip(scales) {
            *w = p * sc;
        }
        (l, dot(s, zeros))
    }

    /// The min and max of each group of `g` values of a stored f16 row (see
    /// [`group_ranges_portable`]).
    #[inline(always)]
    fn group_ranges(self, row: &[f16], g: usize, ranges: &mut [(f32, f32)]) {
        group_ranges_portable(row, g, ranges)
    }

    /// [`Kernels::stage_hadamard`] of a new token's key row (with its `affine`) and value
    /// row in one call, the same bytes as two calls, for kernel sets that gain from
    /// working on both rows at once; `None`, with nothing written, where the kernel set
    /// has no such pass (then stage the rows one at a time).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn stage_hadamard_pair<T: KvElement>(
        self,
        k: &[T],
        affine: KeyAffine<'_>,
        v: &[T],
        g: usize,
        key: (&mut [f16], &mut [(f32, f32)]),
        value: (&mut [f16], &mut [(f32, f32)]),
    ) -> Option<(f32, f32)> {
        let _ = (k, affine, v, g, key, value);
        None
    }

    /// Stages a new input row of a Hadamard-rotated head with no channel permutation in
    /// one pass ([`stage_input`]'s f16 row into `dst`, the same bits, and its groups'
    /// ranges as [`Kernels::group_ranges`] finds them), returning [`load_affine`]'s
    /// squared norm (up to f32 rounding: it only decides which rows get the exact test),
    /// or `None`, with nothing written, where the kernel set has no such pass.
    #[inline(always)]
    fn stage_hadamard<T: KvElement>(
        self,
        src: &[T],
        affine: KeyAffine<'_>,
        g: usize,
        dst: &mut [f16],
        ranges: &mut [(f32, f32)],
    ) -> Option<f32> {
        let _ = (src, affine, g, dst, ranges);
        None
    }

    /// Quantizes stored f16 rows (`rows`: `[n][d]`, `d <= 256`, finite values; `ranges`:
    /// `[n][d / g]`, each group's min and max as [`Kernels::group_ranges`] finds them) into
    /// `codes` (`[n][d * bits / 8]`) and `params` (`[n][4 * d / g]`), each row as
    /// [`quantize_row_portable`] does (the same bytes).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn quantize_rows(
        self,
        rows: &[f16],
        d: usize,
        bits: u32,
        g: usize,
        clip_q16: u32,
        ranges: &[(f32, f32)],
        codes: &mut [u8],
        params: &mut [u8],
    ) {
        let (cb, pb) = (d * bits as usize / 8, 4 * (d / g));
        let rows = rows.chunks_exact(d).zip(ranges.chunks_exact(d / g));
        for ((row, ranges), (c, p)) in rows.zip(codes.chunks_exact_mut(cb).zip(params.chunks_exact_mut(pb))) {
            quantize_row_portable(row, bits, g, clip_q16, ranges, c, p)
        }
    }

    /// [`Kernels::dots`] over packed `bits`-bit codes (`[n][d * bits / 8]` bytes) instead
    /// of f32 rows, with `q` in unpack order; `scratch` is `[CHUNK][d]` f32.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn dots_codes(
        self,
        q: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        n: usize,
        c0: usize,
        c1: usize,
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        unpack_range(codes, bits, n, d, c0, c1, scratch);
        self.dots(q, g, d, scratch, n, c0, c1, out);
    }

    /// The exact key scores of a chunk straight into `s` (`[g][CHUNK]`), every group's
    /// scale and zero applied (`s[h][t] = sum_j scales[j][t] dot_j[h][t] + zeros[j][t]
    /// qsum[h][j]`; `scales`, `zeros` `[groups][CHUNK]`, `qsum` `[g][groups]`), where this
    /// kernel set has that in one pass (the 512-bit kernels); `false` (nothing written)
    /// where it has not, and the caller takes [`Kernels::key_dots`] and applies them. The
    /// lines of `pf` are prefetched into L2 along the way (see
    /// [`Kernels::spreads_prefetch`]).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn key_scores(
        self,
        _qt: &[f32],
        _g: usize,
        _d: usize,
        _codes: &[u8],
        _bits: u32,
        _gs: usize,
        _n: usize,
        _scales: &[f32],
        _zeros: &[f32],
        _qsum: &[f32],
        _s: &mut [f32],
        _codes_t: &mut [u32],
        _pf: &[u8],
    ) -> bool {
        false
    }

    /// The key scores of a chunk of packed codes for every quantization group of
    /// `gs` channels: `out[j][h][t]` (`[groups][g][CHUNK]`) is group `j`'s
    /// `sum_c q[h][c] * code[t][c]`. `q` is the query twice: `qk` in the unpack order of
    /// the codes (for kernels that unpack rows, as [`Kernels::dots_codes`]) and `qt` in
    /// stored order with each channel scaled by `2^-code_shift(c)` (see [`shifted_query`];
    /// for the transposed AVX2 kernel). `rows` and `codes_t` are scratch.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn key_dots(
        self,
        qk: &[f32],
        _qt: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        gs: usize,
        n: usize,
        out: &mut [f32],
        rows: &mut [f32],
        _codes_t: &mut [u32],
    ) {
        key_dots_by_group(self, qk, g, d, codes, bits, gs, n, out, rows);
    }

    /// Integer key scores of group `j` (see [`IntQuery`]): `out[h][t] = scale[h][j] *
    /// sum_c qi[h][c] * code[t][c]` over the group's channels (`qi = 254 hi + lo` with two
    /// terms), the products summed exactly in integers (so every kernel set gives the
    /// same bits). `codes` is `[n][cb]` bytes.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn dots_int(self, q: &IntQuery, g: usize, j: usize, codes: &[u8], cb: usize, n: usize, out: &mut [f32]) {
        let (pb, bits) = (q.per_byte, 8 / q.per_byte as u32);
        let mask = (1u8 << bits) - 1;
        for t in 0..n {
            let bytes = &codes[t * cb + j * q.group_bytes..t * cb + (j + 1) * q.group_bytes];
            for h in 0..g {
                let qh = q.group(h, j);
                let per_term = qh.len() / q.terms;
                let mut acc = 0i32;
                for (i, qt) in qh.chunks_exact(per_term).enumerate() {
                    let mut sum = 0i32;
                    for (b, &byte) in bytes.iter().enumerate() {
                        for s in 0..pb {
                            let code = (byte >> (s as u32 * bits)) & mask;
                            sum += code as i32 * qt[(b / 32 * pb + s) * 32 + b % 32] as i32;
                        }
                    }
                    acc += if q.terms == 2 && i == 0 { sum * LO_STEPS } else { sum };
                }
                out[h * CHUNK + t] = acc as f32 * q.scale[h * q.groups + j];
            }
        }
    }

    /// Whether [`Kernels::accumulate_codes_prefetching`] and [`Kernels::key_scores`]
    /// spread their prefetches over their work (else `key_scores` is not given any, and
    /// `accumulate_codes_prefetching` issues them at once, first).
    #[inline(always)]
    fn spreads_prefetch(self) -> bool {
        false
    }

    /// [`Kernels::accumulate_codes`], prefetching the lines of `pf` into L2 along the way
    /// (here all at once first; the 512-bit kernel spreads them over its tokens).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn accumulate_codes_prefetching(
        self,
        o: &mut [f32],
        w: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        n: usize,
        c0: usize,
        c1: usize,
        scratch: &mut [f32],
        pf: &[u8],
    ) {
        self.prefetch(pf);
        self.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, scratch)
    }

    /// [`Kernels::accumulate`] over packed codes, `o` in unpack order.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn accumulate_codes(
        self,
        o: &mut [f32],
        w: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        n: usize,
        c0: usize,
        c1: usize,
        scratch: &mut [f32],
    ) {
        unpack_range(codes, bits, n, d, c0, c1, scratch);
        self.accumulate(o, w, g, d, scratch, n, c0, c1);
    }
}

/// [`Kernels::key_dots`] one group at a time through [`Kernels::dots_codes`] (the trait's
/// default, and AVX2's path for rows that are not whole 16-byte blocks).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn key_dots_by_group<K: Kernels>(
    kern: K,
    qk: &[f32],
    g: usize,
    d: usize,
    codes: &[u8],
    bits: u32,
    gs: usize,
    n: usize,
    out: &mut [f32],
    rows: &mut [f32],
) {
    for j in 0..d / gs {
        let o = &mut out[j * g * CHUNK..(j + 1) * g * CHUNK];
        kern.dots_codes(qk, g, d, codes, bits, n, j * gs, (j + 1) * gs, o, rows);
    }
}

/// Unpacks channels `[c0, c1)` (whole 8-byte code blocks) of `n` tokens' codes into
/// `rows` (`[n][d]`, unpack order).
#[inline(always)]
fn unpack_range(codes: &[u8], bits: u32, n: usize, d: usize, c0: usize, c1: usize, rows: &mut [f32]) {
    let cb = d * bits as usize / 8;
    let (b0, b1) = (c0 * bits as usize / 8, c1 * bits as usize / 8);
    for t in 0..n {
        unpack(&codes[t * cb + b0..t * cb + b1], bits, &mut rows[t * d + c0..t * d + c1]);
    }
}

/// Query rows quantized to int8 for integer key scores ([`KeyScores::Int8`],
/// [`KeyScores::Int8x2`]): per row and quantization group a scale `a = max|q| / 127`
/// and codes `hi = round(q / a)` in `[-127, 127]`; with two terms also
/// `lo = round(254 * (q / a - hi))`, so `q = a * (hi + lo / 254)` to about 1 / 64516 of
/// `max|q|`. Laid out in the order the key code bytes unpack: for group `j`, term `i`,
/// 32-byte chunk `k` of its code bytes and shift `s` (`per_byte` codes per byte), lane
/// `b` holds the channel of code `s` of byte `j * group_bytes + 32 k + b`, i.e. channel
/// `(j * group_bytes + 32 k + b) * per_byte + s` (zero past the group's bytes). So one
/// 32-byte load of codes, a shift and a mask meet 32 query bytes with no reordering.
pub(crate) struct IntQuery {
    per_byte: usize,
    group_bytes: usize,
    groups: usize,
    /// 32-byte chunks per group.
    chunks: usize,
    /// 1 (`hi`) or 2 (`hi`, `lo`).
    terms: usize,
    /// `[g][groups][terms][chunks][per_byte][32]`.
    q: Vec<i8>,
    /// `[g][groups]`: `a` for one term, `a / 254` for two (the scale of `254 hi + lo`).
    scale: Vec<f32>,
}

/// The weight of `hi` against `lo` in a two-term [`IntQuery`].
const LO_STEPS: i32 = 254;

impl IntQuery {
    /// Quantizes `q` (`[g][d]`, stored channel order) to `terms` (1 or 2) int8 terms.
    fn new(fmt: &Format, q: &[f32], g: usize, terms: usize) -> Self {
        let d = fmt.head_dim as usize;
        let (bits, gs) = (fmt.key_bits as usize, fmt.group_size as usize);
        let (per_byte, group_bytes, groups) = (8 / bits, gs * bits / 8, d / gs);
        let chunks = group_bytes.div_ceil(32);
        let per_term = chunks * per_byte * 32;
        let mut out = IntQuery {
            per_byte,
            group_bytes,
            groups,
            chunks,
            terms,
            q: vec![0; g * groups * terms * per_term],
            scale: vec![0.0; g * groups],
        };
        for h in 0..g {
            for j in 0..groups {
                let src = &q[h * d + j * gs..h * d + (j + 1) * gs];
                let amax = src.iter().fold(0f32, |m, x| m.max(x.abs()));
                let a = amax / 127.0;
                if a == 0.0 || !a.is_finite() {
                    continue;
                }
                out.scale[h * groups + j] = if terms == 2 { a / LO_STEPS as f32 } else { a };
                let at = (h * groups + j) * terms * per_term;
                let dst = &mut out.q[at..at + terms * per_term];
                for b in 0..group_bytes {
                    for s in 0..per_byte {
                        let x = src[b * per_byte + s] / a;
                        let hi = x.round().clamp(-127.0, 127.0);
                        let i = (b / 32 * per_byte + s) * 32 + b % 32;
                        dst[i] = hi as i8;
                        if terms == 2 {
                            dst[per_term + i] = ((x - hi) * LO_STEPS as f32).round().clamp(-127.0, 127.0) as i8;
                        }
                    }
                }
            }
        }
        out
    }

    /// Row `h`'s codes of group `j`, term after term.
    #[inline(always)]
    fn group(&self, h: usize, j: usize) -> &[i8] {
        let per_group = self.terms * self.chunks * self.per_byte * 32;
        &self.q[(h * self.groups + j) * per_group..(h * self.groups + j + 1) * per_group]
    }
}

/// How the CPU backend scores keys stored as codes (see [`crate::paged::KeyScores`]).
pub use crate::paged::KeyScores;

/// Plain Rust written so the compiler vectorizes it for any target.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Kernels for Portable {
    #[inline(always)]
    fn dots(self, q: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]) {
        for t in 0..n {
            let row = &rows[t * d..(t + 1) * d];
            for h in 0..g {
                let qh = &q[h * d..(h + 1) * d];
                let mut acc = [0f32; LANES];
                for cb in (c0..c1).step_by(LANES) {
                    for l in 0..LANES {
                        acc[l] += qh[cb + l] * row[cb + l];
                    }
                }
                out[h * CHUNK + t] = acc.iter().sum();
            }
        }
    }

    #[inline(always)]
    fn accumulate(self, o: &mut [f32], w: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize) {
        for cb in (c0..c1).step_by(LANES) {
            for h0 in (0..g).step_by(HEAD_BLOCK) {
                let hn = (g - h0).min(HEAD_BLOCK);
                let mut acc = [[0f32; LANES]; HEAD_BLOCK];
                for t in 0..n {
                    let r = &rows[t * d + cb..t * d + cb + LANES];
                    for (hh, acc) in acc.iter_mut().enumerate().take(hn) {
                        let wt = w[(h0 + hh) * CHUNK + t];
                        for l in 0..LANES {
                            acc[l] += wt * r[l];
                        }
                    }
                }
                for (hh, acc) in acc.iter().enumerate().take(hn) {
                    let dst = &mut o[(h0 + hh) * d + cb..(h0 + hh) * d + cb + LANES];
                    for l in 0..LANES {
                        dst[l] += acc[l];
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::Avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA micro-kernels, register-blocked over up to 4 query heads: key scores
    //! of packed codes with tokens in lanes (2 to 6 sets of 8 tokens per pass), value
    //! accumulation with channels in lanes (2 or 4 slices of 8 channels per pass), and
    //! the same over f32 rows (f16 sinks and window: 2 tokens or 16 channels).
    use super::avx512::Avx512;
    use super::{CHUNK, CODES_T_COLS, DTYPE_BF16, DTYPE_F16, DTYPE_F32, IntQuery, Kernels, KeyAffine};
    use crate::KvElement;
    use half::f16;
    use std::arch::x86_64::*;

    /// Proof that the processor supports AVX2, FMA and F16C: only [`Avx2::detect`]
    /// makes one. Where the processor also has AVX-512 F, the decode kernels over packed
    /// codes, the append's one-pass staging and quantizer and the FWHT run with 512-bit
    /// registers ([`Avx512`]: the same bits, half the instructions) unless
    /// `set_avx512(false)` or `ROTKV_CPU_ISA=avx2` turned them off (and the tests'
    /// `narrow`).
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2 {
        zmm: Option<Avx512>,
    }

    impl Avx2 {
        /// `Some` when AVX2, FMA and F16C are available.
        pub(crate) fn detect() -> Option<Self> {
            (std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c"))
            .then(|| Avx2 { zmm: Avx512::detect().filter(|_| !super::isa_is_avx2()) })
        }

        /// The same kernels with 256-bit registers only.
        #[cfg(test)]
        pub(crate) fn narrow(self) -> Self {
            Avx2 { zmm: None }
        }

        /// The packed codes of one group as the quantizer writes them with this kernel
        /// set (for the tests).
        #[cfg(test)]
        pub(crate) fn group_codes(self, x: &[f16], th: &[f32], bits: u32, out: &mut [u8]) {
            if !self.zmm.is_some_and(|z| z.group_codes(x, th, bits, out)) {
                // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
                unsafe { group_codes(x, th, bits, out) }
            }
        }

        /// Whether the 512-bit kernels run (decode's packed-code kernels, append's staging
        /// and codes, the FWHT).
        pub(crate) fn is_wide(self) -> bool {
            self.zmm.is_some()
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        let n8 = src.len() / 8 * 8;
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= n8 <= len of both slices.
            unsafe { _mm256_storeu_ps(dp.add(i), _mm256_cvtph_ps(_mm_loadu_si128(sp.add(i).cast()))) };
        }
        for i in n8..src.len() {
            dst[i] = src[i].to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
        assert_eq!(src.len(), dst.len());
        let n8 = src.len() / 8 * 8;
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= n8 <= len of both slices.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(sp.add(i)));
                _mm_storeu_si128(dp.add(i).cast(), h)
            };
        }
        for i in n8..src.len() {
            dst[i] = f16::from_f32(src[i]);
        }
    }

    /// The codes of 8 values against `LEVELS` thresholds (the count of thresholds at or
    /// below each value), one per i32 lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn codes8<const LEVELS: usize>(v: __m256, th: &[__m256; 15]) -> __m256i {
        let mut c = _mm256_setzero_si256();
        for t in th.iter().take(LEVELS) {
            // The mask is -1 where v >= t: subtracting it counts.
            c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(v, *t)));
        }
        c
    }

    /// Byte 0 of each i32 lane of `h` in bytes 0..4 of each 128-bit half.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn low_bytes(h: __m256i) -> (__m128i, __m128i) {
        let pick = _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        (_mm_shuffle_epi8(_mm256_castsi256_si128(h), pick), _mm_shuffle_epi8(_mm256_extracti128_si256::<1>(h), pick))
    }

    /// The exact min and max of a group of f16 values (`g` a multiple of 32), four
    /// independent chains. A range ending at a zero of either sign is recomputed by
    /// `group_params`, so the sign of a zero found here does not matter.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn group_range(x: &[f16]) -> (f32, f32) {
        assert!(x.len().is_multiple_of(32));
        let p = x.as_ptr();
        // SAFETY: i + 8 * q + 8 <= x.len() for every load.
        let load = |i: usize| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.add(i).cast())) };
        let mut lo = [_mm256_set1_ps(f32::INFINITY); 4];
        let mut hi = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        for i in (0..x.len()).step_by(32) {
            for q in 0..4 {
                let v = load(i + 8 * q);
                lo[q] = _mm256_min_ps(lo[q], v);
                hi[q] = _mm256_max_ps(hi[q], v);
            }
        }
        let lo = _mm256_min_ps(_mm256_min_ps(lo[0], lo[1]), _mm256_min_ps(lo[2], lo[3]));
        let hi = _mm256_max_ps(_mm256_max_ps(hi[0], hi[1]), _mm256_max_ps(hi[2], hi[3]));
        (hmin(lo), hmax(hi))
    }

    /// The packed codes of a group of f16 values against its `2^bits - 1` thresholds
    /// (`th`, ascending; a code is the count of thresholds at or below its value), 8 bytes
    /// at a time: 32 2-bit codes saturated to bytes (the i32 lanes of four registers, in
    /// the order `packs`/`packus` leave them: runs of four consecutive channels), each
    /// run of four joined into its byte by two multiply-adds (`c0 + 4 c1`, then
    /// `+ 16 (c2 + 4 c3)`), the bytes gathered and the two halves interleaved back into
    /// channel order; or 16 4-bit codes by variable shifts, a horizontal add and byte
    /// shuffles. `out` is the group's `x.len() * bits / 8` bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn group_codes(x: &[f16], th: &[f32], bits: u32, out: &mut [u8]) {
        let g = x.len();
        assert!(g.is_multiple_of(32) && out.len() == g * bits as usize / 8 && th.len() == (1 << bits) - 1);
        let mut t = [_mm256_setzero_ps(); 15];
        for (t, &v) in t.iter_mut().zip(th) {
            *t = _mm256_set1_ps(v);
        }
        let p = x.as_ptr();
        // SAFETY: every load below reads 8 values inside `x` (bounds in the loops).
        let load = |i: usize| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.add(i).cast())) };
        let op = out.as_mut_ptr();
        if bits == 2 {
            let (w4, w16) = (_mm256_set1_epi16(0x0401), _mm256_set1_epi32(0x0010_0001));
            for b in 0..g / 32 {
                // 32 * b + 32 <= g.
                let r: [__m256i; 4] = std::array::from_fn(|q| codes8::<3>(load(32 * b + 8 * q), &t));
                // Bytes: per 128-bit half, channels [0, 4) of r[0], r[1], r[2], r[3], then
                // [4, 8) of each in the upper half.
                let c = _mm256_packus_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
                // Each run of four codes joined into the low byte of its i32 lane: the
                // bytes of channels 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31.
                let q = _mm256_madd_epi16(_mm256_maddubs_epi16(c, w4), w16);
                let (even, odd) = low_bytes(q);
                // SAFETY: 8 * b + 8 <= g / 4 = out.len().
                unsafe { _mm_storel_epi64(op.add(8 * b).cast(), _mm_unpacklo_epi8(even, odd)) };
            }
        } else {
            let shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
            for b in 0..g / 16 {
                // 16 * b + 16 <= g.
                let r: [__m256i; 2] =
                    std::array::from_fn(|q| _mm256_sllv_epi32(codes8::<15>(load(16 * b + 8 * q), &t), shifts));
                let (lo4, hi4) = low_bytes(_mm256_hadd_epi32(r[0], r[1]));
                // SAFETY: 8 * b + 8 <= g / 2 = out.len().
                unsafe { _mm_storel_epi64(op.add(8 * b).cast(), _mm_unpacklo_epi16(lo4, hi4)) };
            }
        }
    }

    /// [`super::quantize_row_portable`] in AVX2 on `rows.len() / d` rows of `d` (the same
    /// bytes; `ranges` is `[rows][d / g]`, `codes` `[rows][d * bits / 8]`, `params`
    /// `[rows][4 * d / g]`), in blocks of 16 rows and two passes per block, so that the
    /// scalar work of one row (the f64 scale and zero, their f16 rounding, the thresholds:
    /// a long dependent chain) runs beside that of the other rows instead of stalling its
    /// own codes: every group's scale, zero and thresholds (`z + (k + 1/2) s` rounded up
    /// to f32, see [`super::group_codes`]; all `+inf` for a constant group, whose codes
    /// are all 0), then the codes ([`group_codes`]). A row with a threshold that is not
    /// finite would go to the portable quantizer (which divides there); for finite rows
    /// none is (`|z| <= 65504` and `s <= 131008 / 3` keep every threshold below 2^18),
    /// so that branch only keeps the function total. Every group's range must be ordered
    /// (`lo <= hi`: its min and max). With `zmm` and BMI2 the whole pass is
    /// [`Avx512::quantize_rows`]; with `zmm` alone the codes come from
    /// [`Avx512::group_codes`] (the same bytes either way).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quantize_rows(
        zmm: Option<Avx512>,
        rows: &[f16],
        d: usize,
        bits: u32,
        g: usize,
        clip: u32,
        ranges: &[(f32, f32)],
        codes: &mut [u8],
        params: &mut [u8],
    ) {
        const BLOCK: usize = 16;
        // Groups of a block: at most 8 per row.
        const ITEMS: usize = BLOCK * 8;
        assert!(d <= 256 && g.is_multiple_of(32) && d.is_multiple_of(g) && (bits == 2 || bits == 4));
        let n = rows.len() / d;
        let (groups, levels) = (d / g, (1usize << bits) - 1);
        let (cb, pb, gb) = (d * bits as usize / 8, 4 * groups, g * bits as usize / 8);
        assert!(rows.len() == n * d && ranges.len() == n * groups && codes.len() == n * cb && params.len() == n * pb);
        if zmm.is_some_and(|z| z.quantize_rows(rows, d, bits, g, clip, ranges, codes, params)) {
            return;
        }
        // Thresholds by level, then group of the block: `th[k * ITEMS + i]`.
        let mut th = [0f32; 15 * ITEMS];
        let mut portable = [false; BLOCK];
        for r0 in (0..n).step_by(BLOCK) {
            let m = BLOCK.min(n - r0);
            let row = |r: usize| &rows[(r0 + r) * d..(r0 + r + 1) * d];
            let items = m * groups;
            portable.fill(false);
            for i0 in (0..items).step_by(4) {
                let lanes = 4.min(items - i0);
                let (mut lo, mut hi) = ([1f64; 4], [1f64; 4]);
                for l in 0..lanes {
                    (lo[l], hi[l]) = (ranges[r0 * groups + i0 + l].0 as f64, ranges[r0 * groups + i0 + l].1 as f64);
                }
                // SAFETY: four f64 each.
                let (lo, hi) = unsafe { (_mm256_loadu_pd(lo.as_ptr()), _mm256_loadu_pd(hi.as_ptr())) };
                let (scale, zero, thresholds, nonfinite) = group_params4(lo, hi, bits, clip);
                let zero_end = _mm256_movemask_pd(_mm256_or_pd(
                    _mm256_cmp_pd::<_CMP_EQ_OQ>(lo, _mm256_setzero_pd()),
                    _mm256_cmp_pd::<_CMP_EQ_OQ>(hi, _mm256_setzero_pd()),
                ));
                for l in 0..lanes {
                    let i = i0 + l;
                    let (r, j) = (i / groups, i % groups);
                    if zero_end >> l & 1 == 1 {
                        let x = &row(r)[j * g..(j + 1) * g];
                        let p = (r0 + r) * pb + 4 * j;
                        let mut t = [0f32; 15];
                        let ok = super::zero_end_params(
                            x,
                            ranges[r0 * groups + i],
                            bits,
                            clip,
                            &mut params[p..p + 4],
                            &mut t,
                        );
                        portable[r] |= !ok;
                        for k in 0..levels {
                            th[k * ITEMS + i] = t[k];
                        }
                        continue;
                    }
                    let p = (r0 + r) * pb + 4 * j;
                    params[p..p + 2].copy_from_slice(&scale[l].to_le_bytes());
                    params[p + 2..p + 4].copy_from_slice(&zero[l].to_le_bytes());
                    portable[r] |= nonfinite >> l & 1 == 1;
                    for k in 0..levels {
                        th[k * ITEMS + i] = thresholds[k][l];
                    }
                }
            }
            for r in 0..m {
                let (c, p) = (&mut codes[(r0 + r) * cb..][..cb], &mut params[(r0 + r) * pb..][..pb]);
                if portable[r] {
                    // Not met with finite rows (see above); the same bytes if it were.
                    let ranges = &ranges[(r0 + r) * groups..][..groups];
                    super::quantize_row_portable(row(r), bits, g, clip, ranges, c, p);
                    continue;
                }
                for (j, (x, out)) in row(r).chunks_exact(g).zip(c.chunks_exact_mut(gb)).enumerate() {
                    let mut t = [0f32; 15];
                    for (k, t) in t.iter_mut().enumerate().take(levels) {
                        *t = th[k * ITEMS + r * groups + j];
                    }
                    if !zmm.is_some_and(|z| z.group_codes(x, &t[..levels], bits, out)) {
                        group_codes(x, &t[..levels], bits, out);
                    }
                }
            }
        }
    }

    /// The f64 lanes' masks (all ones or zero) as i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn mask32(m: __m256d) -> __m128i {
        let pick = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(m), pick))
    }

    /// Four f64 rounded to f16 bits, to nearest even, as [`f64_to_f16`] rounds them:
    /// first to f32 by rounding to odd (the nearest f32, one step toward zero where that
    /// is larger in magnitude, then its last bit set where it is inexact), then by F16C.
    /// Rounding to odd at 24 bits and then to nearest at 11 is rounding to nearest (the
    /// intermediate format has at least two more bits); f16 subnormals and overflow to
    /// infinity included.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn f64x4_to_f16(x: __m256d) -> [u16; 4] {
        let r = _mm256_cvtpd_ps(x);
        let back = _mm256_cvtps_pd(r);
        let abs = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
        let away = _mm256_cmp_pd::<_CMP_GT_OQ>(_mm256_and_pd(back, abs), _mm256_and_pd(x, abs));
        let inexact = _mm256_cmp_pd::<_CMP_NEQ_UQ>(back, x);
        // Toward zero: one less in magnitude is one less in the bits, for either sign.
        let bits = _mm_add_epi32(_mm_castps_si128(r), mask32(away));
        let bits = _mm_or_si128(bits, _mm_srli_epi32::<31>(mask32(inexact)));
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_castsi128_ps(bits));
        let mut out = [0u16; 4];
        // SAFETY: the low 8 bytes of `h` into 4 u16.
        unsafe { _mm_storel_epi64(out.as_mut_ptr().cast(), h) };
        out
    }

    /// Four f64 rounded up to f32 (the nearest f32, one step up where it is below), as
    /// [`super::group_codes`] rounds its thresholds.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn f64x4_up_to_f32(t: __m256d) -> __m128 {
        let r = _mm256_cvtpd_ps(t);
        let up = mask32(_mm256_cmp_pd::<_CMP_LT_OQ>(_mm256_cvtps_pd(r), t));
        let bits = _mm_castps_si128(r);
        // One step up: +1 in the bits of a non-negative f32, -1 of a negative one.
        let step = _mm_or_si128(_mm_srai_epi32::<31>(bits), _mm_set1_epi32(1));
        _mm_castsi128_ps(_mm_add_epi32(bits, _mm_and_si128(up, step)))
    }

    /// [`super::group_params`] and the thresholds of [`super::group_codes`] for four
    /// groups at once, from their ranges `lo`, `hi` (f64 lanes; a range that ends at a
    /// zero must be redone by the scalar path, which decides the zero's sign): the clip
    /// about the midpoint and the scale in the same f64 operations, the scale and zero
    /// rounded to f16 ([`f64x4_to_f16`]), then `z + (k + 1/2) s` for each level, exact in
    /// f64 and rounded up to f32 ([`f64x4_up_to_f32`]); `+inf` for a group whose scale is
    /// 0. Returns the scales' and zeros' f16 bits, `thresholds[k][lane]`, and a bit per
    /// lane whose thresholds are not all finite (that group's row must go to the portable
    /// quantizer).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn group_params4(lo: __m256d, hi: __m256d, bits: u32, clip: u32) -> ([u16; 4], [u16; 4], [[f32; 4]; 15], i32) {
        let (lo, hi) = if clip >= super::NO_CLIP {
            (lo, hi)
        } else {
            // The operations of `clip_range`, in its order.
            let ratio = _mm256_set1_pd(clip as f64 / super::NO_CLIP as f64);
            let half = _mm256_mul_pd(_mm256_mul_pd(_mm256_set1_pd(0.5), _mm256_sub_pd(hi, lo)), ratio);
            let mid = _mm256_mul_pd(_mm256_set1_pd(0.5), _mm256_add_pd(lo, hi));
            (_mm256_sub_pd(mid, half), _mm256_add_pd(mid, half))
        };
        let levels = (1usize << bits) - 1;
        let scale = f64x4_to_f16(_mm256_div_pd(_mm256_sub_pd(hi, lo), _mm256_set1_pd(levels as f64)));
        let zero = f64x4_to_f16(lo);
        let widen = |h: [u16; 4]| {
            // SAFETY: 8 bytes from a [u16; 4].
            _mm256_cvtps_pd(_mm_cvtph_ps(unsafe { _mm_loadl_epi64(h.as_ptr().cast()) }))
        };
        let (s, z) = (widen(scale), widen(zero));
        let constant = mask32(_mm256_cmp_pd::<_CMP_EQ_OQ>(s, _mm256_setzero_pd()));
        let inf = _mm256_set1_pd(f64::INFINITY);
        let mut thresholds = [[0f32; 4]; 15];
        let mut finite = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
        for (k, out) in thresholds.iter_mut().enumerate().take(levels) {
            let t = _mm256_add_pd(z, _mm256_mul_pd(_mm256_set1_pd(k as f64 + 0.5), s));
            let abs = _mm256_and_pd(t, _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX)));
            finite = _mm256_and_pd(finite, _mm256_cmp_pd::<_CMP_LT_OQ>(abs, inf));
            let r = _mm_blendv_ps(f64x4_up_to_f32(t), _mm_set1_ps(f32::INFINITY), _mm_castsi128_ps(constant));
            // SAFETY: four f32.
            unsafe { _mm_storeu_ps(out.as_mut_ptr(), r) };
        }
        let constant = _mm_movemask_ps(_mm_castsi128_ps(constant));
        (scale, zero, thresholds, !_mm256_movemask_pd(finite) & !constant & 0xf)
    }

    /// `e^x` in each lane for `x <= 88` (0 below -87, and for `-inf`), to 2e-7 relative:
    /// `x = n ln2 + r` (`n` rounded, `r` by two FMAs with ln2 split in a high part of 17
    /// bits and the rest, so `r` is exact to 1e-10 for `|n| <= 126`), then
    /// `e^r = 1 + r + r^2 (c2 + c3 r + c4 r^2 + c5 r^3)` on `|r| <= ln2 / 2` with
    /// coefficients fitted for the least maximal relative error (1.05e-7 in exact
    /// arithmetic; 1.8e-7 in f32 over `[-87, 20]`, see `fast_exp_is_accurate`), and
    /// `2^n` built in the exponent bits. One degree and about ten instructions fewer
    /// than [`super::exp_neg`]'s Taylor polynomial without FMA.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn exp8(x: __m256) -> __m256 {
        let floor = _mm256_set1_ps(-87.0);
        let xc = _mm256_max_ps(x, floor);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            xc,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693_145_75), xc);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428_606_8e-6), r);
        let p = _mm256_fmadd_ps(_mm256_set1_ps(8.312_525e-3), r, _mm256_set1_ps(4.189_011_5e-2));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166_671_14));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.499_992_3));
        let y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r), _mm256_set1_ps(1.0));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        let y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
        _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_GE_OQ>(x, floor))
    }

    /// [`super::Kernels::exp_sum`] with [`exp8`], eight weights at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn exp_sum(s: &mut [f32], m: f32) -> f32 {
        let n8 = s.len() / 8 * 8;
        let (p, mv) = (s.as_mut_ptr(), _mm256_set1_ps(m));
        let mut acc = _mm256_setzero_ps();
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= n8 <= s.len().
            unsafe {
                let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
                _mm256_storeu_ps(p.add(i), y);
                acc = _mm256_add_ps(acc, y);
            }
        }
        let rest = s.len() - n8;
        if rest > 0 {
            let mut tail = [f32::NEG_INFINITY; 8];
            tail[..rest].copy_from_slice(&s[n8..]);
            // SAFETY: `tail` holds 8 floats.
            let y = exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(tail.as_ptr()) }, mv));
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(tail.as_mut_ptr(), y) };
            s[n8..].copy_from_slice(&tail[..rest]);
            acc = _mm256_add_ps(acc, y);
        }
        hsum(acc)
    }

    /// [`super::Kernels::exp_weights`] in one pass, eight tokens at a time: the weights
    /// of [`exp_sum`] (the same bits, and the same sum), each times its scale, and the
    /// zero sum by FMAs into eight lanes.
    /// With `zmm`, the whole 16-token blocks go through [`Avx512::exp_weights16`] (the
    /// same bits).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn exp_weights(
        zmm: Option<Avx512>,
        s: &[f32],
        m: f32,
        scales: &[f32],
        zeros: &[f32],
        w: &mut [f32],
    ) -> (f32, f32) {
        let n = s.len();
        assert!(scales.len() >= n && zeros.len() >= n && w.len() >= n);
        let n8 = n / 8 * 8;
        let (sp, scp, zp, wp, mv) = (s.as_ptr(), scales.as_ptr(), zeros.as_ptr(), w.as_mut_ptr(), _mm256_set1_ps(m));
        let (mut acc, mut zacc, done) = match zmm {
            Some(z) => z.exp_weights16(s, m, scales, zeros, w),
            None => (_mm256_setzero_ps(), _mm256_setzero_ps(), 0),
        };
        for i in (done..n8).step_by(8) {
            // SAFETY: i + 8 <= n8 <= n, and every slice holds n or more (asserted).
            unsafe {
                let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(i)), mv));
                acc = _mm256_add_ps(acc, y);
                _mm256_storeu_ps(wp.add(i), _mm256_mul_ps(y, _mm256_loadu_ps(scp.add(i))));
                zacc = _mm256_fmadd_ps(y, _mm256_loadu_ps(zp.add(i)), zacc);
            }
        }
        let rest = n - n8;
        if rest > 0 {
            let (mut ts, mut tsc, mut tz, mut tw) = ([f32::NEG_INFINITY; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
            ts[..rest].copy_from_slice(&s[n8..]);
            tsc[..rest].copy_from_slice(&scales[n8..n]);
            tz[..rest].copy_from_slice(&zeros[n8..n]);
            // SAFETY: the four arrays hold 8 floats each.
            unsafe {
                let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(ts.as_ptr()), mv));
                acc = _mm256_add_ps(acc, y);
                _mm256_storeu_ps(tw.as_mut_ptr(), _mm256_mul_ps(y, _mm256_loadu_ps(tsc.as_ptr())));
                zacc = _mm256_fmadd_ps(y, _mm256_loadu_ps(tz.as_ptr()), zacc);
            }
            w[n8..n].copy_from_slice(&tw[..rest]);
        }
        (hsum(acc), hsum(zacc))
    }

    /// Smallest of the eight lanes (the largest of their negations, negated).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hmin(v: __m256) -> f32 {
        -hmax(_mm256_sub_ps(_mm256_setzero_ps(), v))
    }

    /// Largest of the eight lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Scores of heads `[h0, h0 + H)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn dots_block<const H: usize>(
        q: &[f32],
        h0: usize,
        d: usize,
        rows: &[f32],
        n: usize,
        c0: usize,
        c1: usize,
        out: &mut [f32],
    ) {
        assert!((h0 + H) * d <= q.len() && n * d <= rows.len() && c1 <= d && c0 <= c1 && (c1 - c0).is_multiple_of(8));
        assert!((h0 + H - 1) * CHUNK + n <= out.len());
        let (qp, rp) = (q.as_ptr(), rows.as_ptr());
        let mut t = 0;
        while t < n {
            let two = t + 1 < n;
            let r1 = if two { t + 1 } else { t };
            let mut a0 = [_mm256_setzero_ps(); H];
            let mut a1 = [_mm256_setzero_ps(); H];
            let mut c = c0;
            while c < c1 {
                // SAFETY: rows t and r1 are < n and c + 8 <= c1 <= d, so both 8-float
                // loads are inside `rows` (asserted above); likewise the query loads.
                unsafe {
                    let x0 = _mm256_loadu_ps(rp.add(t * d + c));
                    let x1 = _mm256_loadu_ps(rp.add(r1 * d + c));
                    for hh in 0..H {
                        let qv = _mm256_loadu_ps(qp.add((h0 + hh) * d + c));
                        a0[hh] = _mm256_fmadd_ps(qv, x0, a0[hh]);
                        a1[hh] = _mm256_fmadd_ps(qv, x1, a1[hh]);
                    }
                }
                c += 8;
            }
            for hh in 0..H {
                out[(h0 + hh) * CHUNK + t] = hsum(a0[hh]);
                if two {
                    out[(h0 + hh) * CHUNK + t + 1] = hsum(a1[hh]);
                }
            }
            t += 2;
        }
    }

    /// Value accumulation of heads `[h0, h0 + H)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn accumulate_block<const H: usize>(
        o: &mut [f32],
        w: &[f32],
        h0: usize,
        d: usize,
        rows: &[f32],
        n: usize,
        c0: usize,
        c1: usize,
    ) {
        assert!((h0 + H) * d <= o.len() && n * d <= rows.len() && c1 <= d && c0 <= c1 && (c1 - c0).is_multiple_of(16));
        assert!(n == 0 || (h0 + H - 1) * CHUNK + n <= w.len());
        let (op, rp) = (o.as_mut_ptr(), rows.as_ptr());
        let mut c = c0;
        while c < c1 {
            let mut a0 = [_mm256_setzero_ps(); H];
            let mut a1 = [_mm256_setzero_ps(); H];
            for t in 0..n {
                // SAFETY: t < n and c + 16 <= c1 <= d: both loads are inside `rows`.
                let (x0, x1) = unsafe { (_mm256_loadu_ps(rp.add(t * d + c)), _mm256_loadu_ps(rp.add(t * d + c + 8))) };
                for hh in 0..H {
                    let wv = _mm256_set1_ps(w[(h0 + hh) * CHUNK + t]);
                    a0[hh] = _mm256_fmadd_ps(wv, x0, a0[hh]);
                    a1[hh] = _mm256_fmadd_ps(wv, x1, a1[hh]);
                }
            }
            for hh in 0..H {
                // SAFETY: (h0 + hh) * d + c + 16 <= (h0 + H) * d <= o.len() (asserted).
                unsafe {
                    let p = op.add((h0 + hh) * d + c);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), a0[hh]));
                    _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), a1[hh]));
                }
            }
            c += 16;
        }
    }

    /// Transposes a chunk's key codes, `n <= CHUNK` rows of `cb` bytes (a multiple of
    /// 16), into `out[w][t]`: dword `w` of token `t`'s row, zero for `n <= t <
    /// CODES_T_COLS`. Four rows at a time, 4 x 4 dword transposes in SSE registers.
    pub(super) fn transpose_codes(_proof: Avx2, codes: &[u8], cb: usize, n: usize, out: &mut [u32]) {
        assert!(cb.is_multiple_of(16) && n <= CHUNK && n * cb <= codes.len());
        let words = cb / 4;
        assert!(out.len() >= words * CODES_T_COLS);
        let (cp, op) = (codes.as_ptr(), out.as_mut_ptr());
        let mut t = 0;
        while t < n {
            for blk in 0..cb / 16 {
                // SAFETY: row t + i < n (or a zero row), bytes blk * 16 .. + 16 <= cb: inside
                // `codes` (asserted); the stores go to words 4 blk .. + 4 < words, columns
                // t .. t + 4 <= CHUNK < CODES_T_COLS: inside `out` (asserted).
                unsafe {
                    let row = |i: usize| {
                        if t + i < n {
                            _mm_loadu_si128(cp.add((t + i) * cb + blk * 16).cast())
                        } else {
                            _mm_setzero_si128()
                        }
                    };
                    let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
                    let (l01, h01) = (_mm_unpacklo_epi32(r0, r1), _mm_unpackhi_epi32(r0, r1));
                    let (l23, h23) = (_mm_unpacklo_epi32(r2, r3), _mm_unpackhi_epi32(r2, r3));
                    let w = op.add(blk * 4 * CODES_T_COLS + t);
                    _mm_storeu_si128(w.cast(), _mm_unpacklo_epi64(l01, l23));
                    _mm_storeu_si128(w.add(CODES_T_COLS).cast(), _mm_unpackhi_epi64(l01, l23));
                    _mm_storeu_si128(w.add(2 * CODES_T_COLS).cast(), _mm_unpacklo_epi64(h01, h23));
                    _mm_storeu_si128(w.add(3 * CODES_T_COLS).cast(), _mm_unpackhi_epi64(h01, h23));
                }
            }
            t += 4;
        }
        for w in 0..words {
            out[w * CODES_T_COLS + t..(w + 1) * CODES_T_COLS].fill(0);
        }
    }

    /// Key scores of heads `[h0, h0 + H)` over the dwords `[w0, w1)` of the key code
    /// rows (one quantization group), tokens in lanes: `out[h][t] = sum_c qt[h][c] *
    /// (code[t][c] << p_c)`, where `codes_t` is [`transpose_codes`]' output and `qt` the
    /// query rows in stored channel order, each channel scaled by `2^-p_c` (see
    /// [`super::code_shift`]), so a code is isolated by one mask and no shift (the
    /// product is exact either way, hence the sum's bits are those of unshifted codes).
    /// `TS` sets of 8 tokens share each broadcast query value; `TS * H` accumulator
    /// chains hide the FMA latency. Scores tokens `[t_begin, n)` (`t_begin` a multiple of
    /// 8), writing whole 8-token vectors (lanes past `n` hold garbage).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn dots_codes_t<const H: usize, const BITS: u32, const TS: usize>(
        qt: &[f32],
        h0: usize,
        d: usize,
        codes_t: &[u32],
        t_begin: usize,
        n: usize,
        w0: usize,
        w1: usize,
        out: &mut [f32],
    ) {
        let per_byte = 8 / BITS as usize;
        let per_word = 4 * per_byte;
        assert!((h0 + H) * d <= qt.len() && w0 <= w1 && w1 * per_word <= d && n <= CHUNK);
        assert!(codes_t.len() >= w1 * CODES_T_COLS && (h0 + H - 1) * CHUNK + n <= out.len());
        let sets = n.saturating_sub(t_begin).div_ceil(8 * TS);
        assert!(t_begin.is_multiple_of(8) && t_begin + sets * 8 * TS <= CODES_T_COLS);
        let (qp, cp) = (qt.as_ptr(), codes_t.as_ptr());
        let m = (1i32 << BITS) - 1;
        // Slot k = b * per_byte + s of a word masks bits p(b, s) of the (for b = 3,
        // shifted) word.
        let masks: [[i32; 8]; 16] = std::array::from_fn(|k| {
            let (b, s) = (k / per_byte, k % per_byte);
            let p = if b < 3 { 8 * b + s * BITS as usize } else { s * BITS as usize };
            [if k < per_word { m << p } else { 0 }; 8]
        });
        let mut t0 = t_begin;
        while t0 < n {
            let mut acc = [[_mm256_setzero_ps(); H]; TS];
            for w in w0..w1 {
                // The masks are read from memory as operands: held in registers (16 of
                // them), they pushed the accumulators to the stack.
                let mp = std::hint::black_box(masks.as_ptr());
                let mut raw = [_mm256_setzero_si256(); TS];
                // SAFETY: w < w1 and t0 + 8 TS <= CODES_T_COLS (asserted): inside `codes_t`.
                unrolled::<TS>(|i| {
                    raw[i] = unsafe { _mm256_loadu_si256(cp.add(w * CODES_T_COLS + t0 + 8 * i).cast()) }
                });
                unrolled::<4>(|b| {
                    if b == 3 {
                        unrolled::<TS>(|i| raw[i] = _mm256_srli_epi32::<24>(raw[i]));
                    }
                    for s in 0..per_byte {
                        // SAFETY: b * per_byte + s < per_word <= 16 entries of `masks`.
                        let mask = unsafe { _mm256_loadu_si256(mp.add(b * per_byte + s).cast()) };
                        let c = w * per_word + b * per_byte + s;
                        let mut qb = [_mm256_setzero_ps(); H];
                        // SAFETY: c < w1 * per_word <= d and h0 + hh < h0 + H: inside `qt`.
                        unrolled::<H>(|hh| qb[hh] = unsafe { _mm256_broadcast_ss(&*qp.add((h0 + hh) * d + c)) });
                        unrolled::<TS>(|i| {
                            let x = _mm256_cvtepi32_ps(_mm256_and_si256(raw[i], mask));
                            unrolled::<H>(|hh| acc[i][hh] = _mm256_fmadd_ps(qb[hh], x, acc[i][hh]));
                        });
                    }
                });
            }
            for (i, a) in acc.iter().enumerate() {
                let t = t0 + 8 * i;
                if t < n {
                    for (hh, &v) in a.iter().enumerate() {
                        let at = (h0 + hh) * CHUNK + t;
                        // t < n <= CHUNK and both multiples of 8: t + 8 <= CHUNK, inside
                        // head h0 + hh's row of `out`.
                        assert!(at + 8 <= out.len());
                        // SAFETY: at + 8 <= out.len() (asserted just above).
                        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at), v) };
                    }
                }
            }
            t0 += 8 * TS;
        }
    }

    /// [`dots_codes_t`] for `g` heads in blocks of up to 4: as many sets of 8 tokens per
    /// pass as keep 8 or more accumulator chains in 16 registers (2, 3, 4 and 6 sets for
    /// 4, 3, 2 and 1 heads), and the tokens past the last whole pass in passes of 2 sets
    /// (a chunk of 64 tokens with 3 heads: 48 + 16 lanes, not 72).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dots_codes_t_heads(
        _proof: Avx2,
        qt: &[f32],
        g: usize,
        d: usize,
        codes_t: &[u32],
        bits: u32,
        n: usize,
        w0: usize,
        w1: usize,
        out: &mut [f32],
    ) {
        let mut h0 = 0;
        while h0 < g {
            let hn = (g - h0).min(4);
            macro_rules! sets {
                ($h:literal, $b:literal, $ts:literal) => {{
                    let main = n / (8 * $ts) * (8 * $ts);
                    // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were
                    // detected.
                    unsafe {
                        dots_codes_t::<$h, $b, $ts>(qt, h0, d, codes_t, 0, main, w0, w1, out);
                        dots_codes_t::<$h, $b, 2>(qt, h0, d, codes_t, main, n, w0, w1, out);
                    }
                }};
            }
            match (bits, hn) {
                (2, 4) => sets!(4, 2, 2),
                (2, 3) => sets!(3, 2, 3),
                (2, 2) => sets!(2, 2, 4),
                (2, _) => sets!(1, 2, 6),
                (_, 4) => sets!(4, 4, 2),
                (_, 3) => sets!(3, 4, 3),
                (_, 2) => sets!(2, 4, 4),
                _ => sets!(1, 4, 6),
            }
            h0 += hn;
        }
    }

    /// `2^e` in every lane (`-126 <= e <= 127`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn pow2(e: i32) -> __m256 {
        _mm256_set1_ps(f32::from_bits(((127 + e) as u32) << 23))
    }

    /// Value accumulation of heads `[h0, h0 + H)` straight from packed codes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn accumulate_codes_block<const H: usize, const BITS: u32>(
        o: &mut [f32],
        w: &[f32],
        h0: usize,
        d: usize,
        codes: &[u8],
        n: usize,
        c0: usize,
        c1: usize,
    ) {
        let cb = d * BITS as usize / 8;
        let cpb = 64 / BITS as usize;
        let shifts = 8 / BITS as i32;
        assert!((h0 + H) * d <= o.len() && n * cb <= codes.len() && c1 <= d && c0 <= c1);
        assert!(c0.is_multiple_of(cpb) && c1.is_multiple_of(cpb) && (n == 0 || (h0 + H - 1) * CHUNK + n <= w.len()));
        let (op, cp) = (o.as_mut_ptr(), codes.as_ptr());
        let m = (1i32 << BITS) - 1;
        for blk in c0 / cpb..c1 / cpb {
            for sp in (0..shifts).step_by(2) {
                // Code `s` of each byte is masked in place, so the sums are `2^(s BITS)`
                // times the codes' and are scaled back (exactly: a power of two) at the end;
                // the bits are those of shifted codes, one instruction fewer per 8 codes.
                let (p0, p1) = (sp * BITS as i32, (sp + 1) * BITS as i32);
                let (mask0, mask1) = (_mm256_set1_epi32(m << p0), _mm256_set1_epi32(m << p1));
                let mut a0 = [_mm256_setzero_ps(); H];
                let mut a1 = [_mm256_setzero_ps(); H];
                for t in 0..n {
                    // SAFETY: blk < d / cpb and t < n: 8 bytes inside token t's codes.
                    let raw = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp.add(t * cb + blk * 8).cast())) };
                    let x0 = _mm256_cvtepi32_ps(_mm256_and_si256(raw, mask0));
                    let x1 = _mm256_cvtepi32_ps(_mm256_and_si256(raw, mask1));
                    for hh in 0..H {
                        // SAFETY: (h0 + H - 1) * CHUNK + n <= w.len() (asserted), t < n.
                        // (Indexed, the bounds checks were a third of the loop's instructions.)
                        let wv = _mm256_set1_ps(unsafe { *w.get_unchecked((h0 + hh) * CHUNK + t) });
                        a0[hh] = _mm256_fmadd_ps(wv, x0, a0[hh]);
                        a1[hh] = _mm256_fmadd_ps(wv, x1, a1[hh]);
                    }
                }
                let (u0, u1) = (pow2(-p0), pow2(-p1));
                let c = blk * cpb + sp as usize * 8;
                for hh in 0..H {
                    // SAFETY: c + 16 <= d and h0 + hh < h0 + H: inside `o` (asserted).
                    unsafe {
                        let p = op.add((h0 + hh) * d + c);
                        _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(a0[hh], u0)));
                        _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), _mm256_mul_ps(a1[hh], u1)));
                    }
                }
            }
        }
    }

    /// `_mm256_broadcast_ss(*p)` as an instruction LLVM may not merge with an equal one:
    /// merged, the broadcast values stay in registers and the accumulators that need
    /// them go to the stack; loaded again, each costs a load-port slot only.
    ///
    /// # Safety
    /// `p` is valid for reading an `f32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn broadcast_again(p: *const f32) -> __m256 {
        let y: __m256;
        // SAFETY: reads 4 bytes at `p` (the caller's contract), no stack, no flags.
        unsafe {
            std::arch::asm!(
                "vbroadcastss {y}, dword ptr [{p}]",
                p = in(reg) p,
                y = lateout(ymm_reg) y,
                options(readonly, nostack, preserves_flags)
            )
        };
        y
    }

    /// [`accumulate_codes_block`] for 1 or 2 heads: passes of 32 channels (four slices
    /// of 8: one 8-byte block of 2-bit codes, two of 4-bit codes) so that `4 H`
    /// accumulator chains hide the FMA latency (two slices give 2 or 4 chains:
    /// latency-bound). Each slice broadcasts its weights again ([`broadcast_again`])
    /// rather than keep them in registers. Measured hot in L1 (2026-12-03, Zen 4, head_dim
    /// 128, 2-bit): 1.45x the FMA floor for 2 heads against 1.80x, 2.0x for one against
    /// 3.2x; for 3 heads (12 chains) it was no faster than the two-slice kernel (1.36x
    /// against 1.35x: its 12 broadcasts per token fill the load ports), so 3 and 4 heads
    /// keep that one. Channels `[c0, c1)` are whole passes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn accumulate_codes_wide<const H: usize, const BITS: u32>(
        o: &mut [f32],
        w: &[f32],
        h0: usize,
        d: usize,
        codes: &[u8],
        n: usize,
        c0: usize,
        c1: usize,
    ) {
        let cb = d * BITS as usize / 8;
        let shifts = 8 / BITS as usize;
        assert!((h0 + H) * d <= o.len() && n * cb <= codes.len() && c1 <= d && c0 <= c1);
        assert!(c0.is_multiple_of(32) && c1.is_multiple_of(32) && (n == 0 || (h0 + H - 1) * CHUNK + n <= w.len()));
        let (op, cp, wp) = (o.as_mut_ptr(), codes.as_ptr(), w.as_ptr());
        let m = (1i32 << BITS) - 1;
        for pass in c0 / 32..c1 / 32 {
            let mut acc = [[_mm256_setzero_ps(); H]; 4];
            for t in 0..n {
                // SAFETY: the pass's 32 channels are 4 BITS bytes at pass * 4 BITS < cb, of
                // token t < n: inside `codes` (asserted).
                let (ra, rb) = unsafe {
                    let at = cp.add(t * cb + pass * 4 * BITS as usize);
                    let ra = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at.cast()));
                    (ra, if BITS == 4 { _mm256_cvtepu8_epi32(_mm_loadl_epi64(at.add(8).cast())) } else { ra })
                };
                unrolled::<4>(|k| {
                    let (raw, s) = if k < shifts { (ra, k) } else { (rb, k - shifts) };
                    // The top code of a byte needs no mask (nor a mask register).
                    let code = if s + 1 == shifts {
                        _mm256_srl_epi32(raw, _mm_cvtsi32_si128(8 - BITS as i32))
                    } else {
                        _mm256_and_si256(raw, _mm256_set1_epi32(m << (s as u32 * BITS)))
                    };
                    let x = _mm256_cvtepi32_ps(code);
                    unrolled::<H>(|hh| {
                        // SAFETY: (h0 + H - 1) * CHUNK + n <= w.len() (asserted), t < n.
                        let wv = unsafe { broadcast_again(wp.add((h0 + hh) * CHUNK + t)) };
                        acc[k][hh] = _mm256_fmadd_ps(wv, x, acc[k][hh]);
                    });
                });
            }
            // Slice k holds channels pass * 32 + 8 k .. + 8 (unpack order), its codes
            // masked in place at bit s BITS (but the top one): scaled back by
            // 2^-(s BITS), exactly.
            for (k, a) in acc.iter().enumerate() {
                let s = k % shifts;
                let u = pow2(if s + 1 == shifts { 0 } else { -(s as i32 * BITS as i32) });
                for (hh, &v) in a.iter().enumerate() {
                    // SAFETY: pass * 32 + 8 k + 8 <= c1 <= d, h0 + hh < h0 + H: inside `o`.
                    unsafe {
                        let p = op.add((h0 + hh) * d + pass * 32 + 8 * k);
                        _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(v, u)));
                    }
                }
            }
        }
    }

    /// An address in each cache line that `bytes` touches, from the line its first byte
    /// is in: a slice that does not start a line (an input row a token stride from the
    /// last, a page of a pool that is not 64-byte aligned) touches one line more than
    /// its length in lines, and a prefetch of every 64th byte from its start leaves that
    /// last line out.
    #[inline(always)]
    pub(super) fn lines(bytes: &[u8]) -> impl Iterator<Item = *const u8> {
        let p = bytes.as_ptr();
        let skew = p as usize % 64;
        let n = if bytes.is_empty() { 0 } else { skew + bytes.len() };
        (0..n).step_by(64).map(move |at| p.wrapping_sub(skew).wrapping_add(at))
    }

    /// Calls `f(0)`, `f(1)`, ..., `f(N - 1)` written out (for N of 4, 8 and 16), so that
    /// each index is a constant once `f` is inlined: arrays of registers indexed by it stay
    /// in registers, where LLVM leaves a loop over them rolled, with the array in memory.
    #[inline(always)]
    pub(super) fn unrolled<const N: usize>(mut f: impl FnMut(usize)) {
        macro_rules! calls {
            ($($i:literal)*) => {{ $( f($i); )* }};
        }
        match N {
            1 => calls!(0),
            2 => calls!(0 1),
            3 => calls!(0 1 2),
            4 => calls!(0 1 2 3),
            6 => calls!(0 1 2 3 4 5),
            8 => calls!(0 1 2 3 4 5 6 7),
            16 => calls!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15),
            _ => (0..N).for_each(f),
        }
    }

    /// The FWHT butterflies of [`fwht_regs`] on an array `$v` of `R` registers (`8 * R`
    /// floats), unscaled; a macro so that the array stays in registers in every caller
    /// (as a function LLVM may leave it out of line, with the array in memory).
    macro_rules! fwht_in_regs {
        ($v:expr, $r:expr) => {{
            const { assert!($r <= 16, "stages 1 to 8 only") };
            let v: &mut [__m256; $r] = $v;
            let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
            let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
            let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
            unrolled::<$r>(|r| {
                let a = v[r];
                let a = _mm256_fmadd_ps(a, s1, _mm256_permute_ps::<0xB1>(a));
                let a = _mm256_fmadd_ps(a, s2, _mm256_permute_ps::<0x4E>(a));
                v[r] = _mm256_fmadd_ps(a, s4, _mm256_permute2f128_ps::<1>(a, a));
            });
            // Stride h between registers, called with constants (so every index is one).
            let mut stage = |h: usize| {
                if h < $r {
                    // Pair k of the stage: i = its block's start + k % h, with i + h.
                    unrolled::<$r>(|k| {
                        if k < $r / 2 {
                            let i = k / h * 2 * h + k % h;
                            let (a, b) = (v[i], v[i + h]);
                            v[i] = _mm256_add_ps(a, b);
                            v[i + h] = _mm256_sub_ps(a, b);
                        }
                    });
                }
            };
            stage(1);
            stage(2);
            stage(4);
            stage(8);
        }};
    }

    /// In-register FWHT butterflies of `8 * R` floats at `p` (strides 1, 2 and 4 inside
    /// each register by a lane swap and a multiply-add with +-1, exact since
    /// `x * -1 + y` rounds once like `y - x`; strides 8 and up between registers), then
    /// a multiplication by `scale` where given.
    ///
    /// # Safety
    /// `p` is valid for reads and writes of `8 * R` floats, and AVX2 and FMA are present.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fwht_regs<const R: usize>(p: *mut f32, scale: Option<f32>) {
        let mut v = [_mm256_setzero_ps(); R];
        for (r, v) in v.iter_mut().enumerate() {
            // SAFETY: r < R: the 8 floats at 8 * r are inside the caller's 8 * R.
            *v = unsafe { _mm256_loadu_ps(p.add(8 * r)) };
        }
        fwht_in_regs!(&mut v, R);
        for (r, v) in v.iter().enumerate() {
            let v = match scale {
                Some(s) => _mm256_mul_ps(*v, _mm256_set1_ps(s)),
                None => *v,
            };
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(p.add(8 * r), v) };
        }
    }

    /// Whether the vector loads of the one-pass staging (`load8`, and `load16` of the
    /// 512-bit pass) read `T`: f32, f16 or bf16, of that type's size (`KvElement` is
    /// sealed, but its `DTYPE` alone does not prove the element's size).
    pub(super) fn loadable<T: KvElement>() -> bool {
        let size = if T::DTYPE == DTYPE_F32 { 4 } else { 2 };
        [DTYPE_F32, DTYPE_F16, DTYPE_BF16].contains(&T::DTYPE) && size_of::<T>() == size
    }

    /// Eight elements of an input row at `p` as f32 (exact: f16 by F16C, bf16 by a shift
    /// into the high half), for the element types the fused staging reads.
    ///
    /// # Safety
    /// `p` is valid for reads of 8 elements, `T` is f32, f16 or bf16 (its `DTYPE`, with
    /// the size of that type), and AVX2 and F16C are present.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<T: KvElement>(p: *const T) -> __m256 {
        // SAFETY: the caller's contract (8 elements of 4 or 2 bytes).
        unsafe {
            if T::DTYPE == DTYPE_F32 {
                _mm256_loadu_ps(p.cast())
            } else if T::DTYPE == DTYPE_F16 {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            } else {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
            }
        }
    }

    /// The fused append's staging of one new row of `8 * R` channels (64 or 128) for a
    /// Hadamard rotation with no channel permutation, in registers: the row loaded as f32,
    /// centered and scaled (`affine`, the same f32 operations as
    /// [`super::load_affine`]), its squared norm (the fast check's, in another order:
    /// FMAs into eight lanes), the butterflies and the scale of [`fwht_regs`] (the same
    /// bits as [`super::fwht`]), rounding to f16 into `dst`, and the min and max of each
    /// group of `8 * PER` channels of the stored row into `ranges` (as [`group_range`]
    /// finds them). Every loop has a constant trip count, so that the row stays in
    /// registers. `None` (nothing written) for another element type or row length.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn stage_hadamard<T: KvElement, const R: usize, const PER: usize>(
        src: &[T],
        affine: KeyAffine<'_>,
        dst: &mut [f16],
        ranges: &mut [(f32, f32)],
    ) -> Option<f32> {
        let d = 8 * R;
        if !loadable::<T>() || src.len() != d || dst.len() != d {
            return None;
        }
        assert!(PER >= 4 && R.is_multiple_of(PER) && R / PER <= 4 && ranges.len() == R / PER);
        let sp = src.as_ptr();
        let mut v = [_mm256_setzero_ps(); R];
        // One loop per case, each with a constant trip count and a short body (so that
        // LLVM unrolls it and the array stays in registers).
        match affine {
            KeyAffine::None => unrolled::<R>(|r| {
                // SAFETY: 8 * r + 8 <= d = src.len(); T is one of the three types.
                v[r] = unsafe { load8(sp.add(8 * r)) };
            }),
            KeyAffine::Center(m) => {
                assert_eq!(m.len(), d);
                unrolled::<R>(|r| {
                    // SAFETY: as above, and `m` has d floats.
                    v[r] = unsafe { _mm256_sub_ps(load8(sp.add(8 * r)), _mm256_loadu_ps(m.as_ptr().add(8 * r))) };
                });
            }
            KeyAffine::Full(m, sc) => {
                assert!(m.len() == d && sc.len() == d);
                unrolled::<R>(|r| {
                    // SAFETY: as above, and `m` and `sc` have d floats.
                    v[r] = unsafe {
                        let (m, sc) = (_mm256_loadu_ps(m.as_ptr().add(8 * r)), _mm256_loadu_ps(sc.as_ptr().add(8 * r)));
                        _mm256_div_ps(_mm256_sub_ps(load8(sp.add(8 * r)), m), sc)
                    };
                });
            }
        }
        let mut acc = [_mm256_setzero_ps(); 2];
        unrolled::<R>(|r| acc[r % 2] = _mm256_fmadd_ps(v[r], v[r], acc[r % 2]));
        fwht_in_regs!(&mut v, R);
        let scale = _mm256_set1_ps(1.0 / (d as f32).sqrt());
        let dp = dst.as_mut_ptr();
        // At most 4 groups (R / PER <= 16 / 4).
        let mut lo = [_mm256_set1_ps(f32::INFINITY); 4];
        let mut hi = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        unrolled::<R>(|r| {
            let y = _mm256_mul_ps(v[r], scale);
            // SAFETY: 8 * r + 8 <= d = dst.len().
            unsafe { _mm_storeu_si128(dp.add(8 * r).cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y)) };
            lo[r / PER] = _mm256_min_ps(lo[r / PER], y);
            hi[r / PER] = _mm256_max_ps(hi[r / PER], y);
        });
        // Rounding to f16 is monotone, so the rounded min and max are the min and max of
        // the rounded row (up to the sign of a zero, which `group_params` decides).
        let round = |v: __m256| _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
        for (j, range) in ranges.iter_mut().enumerate() {
            *range = (hmin(round(lo[j])), hmax(round(hi[j])));
        }
        Some(hsum(_mm256_add_ps(acc[0], acc[1])))
    }

    /// [`stage_hadamard`] of a token's key row (with its `affine`) and value row, one
    /// after the other in one call: the same bytes as two calls, without the fill loop's
    /// per-row dispatch between them (8-19% off append at head_dim 64 and 128 with these
    /// kernels). `None`, with nothing written, where `stage_hadamard` declines the rows
    /// (the four rows' lengths are checked first, so it cannot decline only the second).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn stage_pair<T: KvElement, const R: usize, const PER: usize>(
        k: &[T],
        affine: KeyAffine<'_>,
        v: &[T],
        (kd, kr): (&mut [f16], &mut [(f32, f32)]),
        (vd, vr): (&mut [f16], &mut [(f32, f32)]),
    ) -> Option<(f32, f32)> {
        if [v.len(), kd.len(), vd.len()] != [k.len(); 3] || kr.len() != vr.len() {
            return None;
        }
        let nk = stage_hadamard::<T, R, PER>(k, affine, kd, kr)?;
        let nv = stage_hadamard::<T, R, PER>(v, KeyAffine::None, vd, vr)?;
        Some((nk, nv))
    }

    /// A row of 256 floats: two halves of 128 in registers (16 registers each, no
    /// spills), then the stride-128 butterflies with the scale.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fwht_256(x: &mut [f32]) {
        assert_eq!(x.len(), 256);
        let p = x.as_mut_ptr();
        let s = _mm256_set1_ps(1.0 / 16.0);
        // SAFETY: both halves are 128 floats inside `x` (asserted length).
        unsafe {
            fwht_regs::<16>(p, None);
            fwht_regs::<16>(p.add(128), None);
        }
        for i in (0..128).step_by(8) {
            // SAFETY: i + 128 + 8 <= 256.
            unsafe {
                let (a, b) = (_mm256_loadu_ps(p.add(i)), _mm256_loadu_ps(p.add(i + 128)));
                _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_add_ps(a, b), s));
                _mm256_storeu_ps(p.add(i + 128), _mm256_mul_ps(_mm256_sub_ps(a, b), s));
            }
        }
    }

    /// [`super::fwht`] for rows of 8 to 256 floats (16 to 256 in 512-bit registers with
    /// `zmm`); `false` (nothing done) for others.
    #[inline(always)]
    pub(crate) fn fwht(proof: Avx2, x: &mut [f32]) -> bool {
        if let Some(z) = proof.zmm
            && z.fwht(x)
        {
            return true;
        }
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe {
            let p = x.as_mut_ptr();
            // SAFETY (pointers): each arm's row length is exactly 8 * R floats of `x`.
            match x.len() {
                8 => fwht_regs::<1>(p, Some(1.0 / 8f32.sqrt())),
                16 => fwht_regs::<2>(p, Some(1.0 / 16f32.sqrt())),
                32 => fwht_regs::<4>(p, Some(1.0 / 32f32.sqrt())),
                64 => fwht_regs::<8>(p, Some(1.0 / 64f32.sqrt())),
                128 => fwht_regs::<16>(p, Some(1.0 / 128f32.sqrt())),
                256 => fwht_256(x),
                _ => return false,
            }
        }
        true
    }

    /// Sum of the eight i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum_epi32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0x4E>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0xB1>(s));
        _mm_cvtsi128_si32(s)
    }

    /// `len` (8, 16 or at least 32) code bytes at `p` in a 256-bit register, zeros past
    /// `len`.
    ///
    /// # Safety
    /// `p` is valid for reads of `min(len, 32)` bytes; AVX2 is present.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_codes(p: *const u8, len: usize) -> __m256i {
        // SAFETY: each arm reads exactly the bytes the caller vouches for.
        unsafe {
            if len >= 32 {
                _mm256_loadu_si256(p.cast())
            } else if len >= 16 {
                _mm256_zextsi128_si256(_mm_loadu_si128(p.cast()))
            } else {
                _mm256_zextsi128_si256(_mm_loadl_epi64(p.cast()))
            }
        }
    }

    /// Defines an integer key-score kernel for heads `[h0, h0 + H)` and group `j` (see
    /// [`Kernels::dots_int`]): `$mac` adds the products of 32 unsigned code bytes `u`
    /// and 32 signed query bytes `q` into the accumulator `a`, `$widen` turns the two
    /// accumulators into i32 lanes (with the `hi` term of two weighted by 254). One term:
    /// two tokens at a time; two terms: one token, its `hi` and `lo` sums side by side.
    macro_rules! dots_int_kernel {
        (
            $(#[$doc:meta])* $name:ident, $features:literal,
            |$a:ident, $u:ident, $q:ident| $mac:expr,
            |$a0:ident, $a1:ident, $two:ident| $widen:expr
        ) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            fn $name<const H: usize, const BITS: u32>(
                q: &IntQuery,
                h0: usize,
                j: usize,
                codes: &[u8],
                cb: usize,
                n: usize,
                out: &mut [f32],
            ) {
                let pb = 8 / BITS as usize;
                let gb = q.group_bytes;
                let two_terms = q.terms == 2;
                assert!(
                    q.per_byte == pb && (j + 1) * gb <= cb && n * cb <= codes.len() && (gb == 8 || gb.is_multiple_of(16))
                );
                assert!(q.chunks * pb <= 8 && (h0 + H - 1) * CHUNK + n <= out.len());
                let per_term = q.chunks * pb * 32;
                let qg: [&[i8]; H] = std::array::from_fn(|hh| q.group(h0 + hh, j));
                assert!(qg.iter().all(|x| x.len() == q.terms * per_term));
                let cp = codes.as_ptr();
                let mask = _mm256_set1_epi8(((1u32 << BITS) - 1) as i8);
                let mut t = 0;
                while t < n {
                    // Second accumulator: the next token (one term) or this token's `lo` term.
                    let second = two_terms || t + 1 < n;
                    let r1 = if two_terms || t + 1 >= n { t } else { t + 1 };
                    let mut a0 = [_mm256_setzero_si256(); H];
                    let mut a1 = [_mm256_setzero_si256(); H];
                    for k in 0..q.chunks {
                        let len = gb - 32 * k;
                        // SAFETY: the group's bytes [j * gb, (j + 1) * gb) lie in each token's
                        // cb bytes (asserted), and load_codes reads at most the len left of them.
                        let (raw0, raw1) = unsafe {
                            (
                                load_codes(cp.add(t * cb + j * gb + 32 * k), len),
                                load_codes(cp.add(r1 * cb + j * gb + 32 * k), len),
                            )
                        };
                        for s in 0..pb {
                            let cnt = _mm_cvtsi32_si128((s as u32 * BITS) as i32);
                            let u0 = _mm256_and_si256(_mm256_srl_epi16(raw0, cnt), mask);
                            let u1 = _mm256_and_si256(_mm256_srl_epi16(raw1, cnt), mask);
                            let at = (k * pb + s) * 32;
                            for hh in 0..H {
                                // SAFETY: 32 bytes at `at` (and at `per_term + at` with two
                                // terms) are inside the group's query (length asserted).
                                let qv = unsafe { _mm256_loadu_si256(qg[hh].as_ptr().add(at).cast()) };
                                a0[hh] = {
                                    let ($a, $u, $q) = (a0[hh], u0, qv);
                                    $mac
                                };
                                if two_terms {
                                    // SAFETY: as above.
                                    let lo = unsafe { _mm256_loadu_si256(qg[hh].as_ptr().add(per_term + at).cast()) };
                                    a1[hh] = {
                                        let ($a, $u, $q) = (a1[hh], u0, lo);
                                        $mac
                                    };
                                } else {
                                    a1[hh] = {
                                        let ($a, $u, $q) = (a1[hh], u1, qv);
                                        $mac
                                    };
                                }
                            }
                        }
                    }
                    for hh in 0..H {
                        let a = q.scale[(h0 + hh) * q.groups + j];
                        let ($a0, $a1, $two) = (a0[hh], a1[hh], two_terms);
                        let (x0, x1): (__m256i, __m256i) = $widen;
                        if two_terms {
                            out[(h0 + hh) * CHUNK + t] = hsum_epi32(_mm256_add_epi32(x0, x1)) as f32 * a;
                        } else {
                            out[(h0 + hh) * CHUNK + t] = hsum_epi32(x0) as f32 * a;
                            if second {
                                out[(h0 + hh) * CHUNK + t + 1] = hsum_epi32(x1) as f32 * a;
                            }
                        }
                    }
                    t += if two_terms { 1 } else { 2 };
                }
            }
        };
    }

    dots_int_kernel!(
        /// Integer key scores with `vpmaddubsw` of unsigned codes and signed query bytes,
        /// summed in i16 over the group's shifts and chunks (at most 8 terms of at most
        /// 2 * 15 * 127 = 3810, below 2^15), then `vpmaddwd` to i32 (by 254 for the `hi`
        /// term of two, by 1 else) and a horizontal sum.
        dots_int_block, "avx2,fma,f16c",
        |a, u, q| _mm256_add_epi16(a, _mm256_maddubs_epi16(u, q)),
        |a0, a1, two| (
            _mm256_madd_epi16(a0, _mm256_set1_epi16(if two { super::LO_STEPS as i16 } else { 1 })),
            _mm256_madd_epi16(a1, _mm256_set1_epi16(1))
        )
    );

    dots_int_kernel!(
        /// [`dots_int_block`] with `vpdpbusd`: each 32-byte product of unsigned codes and
        /// signed query bytes is summed four bytes at a time straight into i32 lanes (no
        /// i16 partial sums, no `vpmaddwd`), the `hi` term of two then weighted by 254 in
        /// i32. The integer sums are exact either way (at most 256 * 15 * 127 * 255 <
        /// 2^31), so the scores are the same bits.
        dots_int_block_vnni, "avx2,fma,f16c,avx512f,avx512vnni,avx512vl",
        |a, u, q| _mm256_dpbusd_epi32(a, u, q),
        |a0, a1, two| (if two { _mm256_mullo_epi32(a0, _mm256_set1_epi32(super::LO_STEPS)) } else { a0 }, a1)
    );

    macro_rules! by_head_blocks {
        ($g:expr, $h0:ident, $f:ident, ($($arg:expr),*) $(, $bits:literal)?) => {{
            let mut $h0 = 0;
            while $h0 < $g {
                let hn = ($g - $h0).min(4);
                // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were
                // detected; the VNNI kernels are called only with a `Vnni` value, which
                // exists only after AVX-512 F, VNNI and VL were detected too.
                unsafe {
                    match hn {
                        4 => $f::<4 $(, $bits)?>($($arg,)* ),
                        3 => $f::<3 $(, $bits)?>($($arg,)* ),
                        2 => $f::<2 $(, $bits)?>($($arg,)* ),
                        _ => $f::<1 $(, $bits)?>($($arg,)* ),
                    }
                }
                $h0 += hn;
            }
        }};
    }

    /// [`super::dense_rotate`], `out = x R` for a row-major `d x d` matrix, with the
    /// outputs in registers: blocks of 64 outputs (eight accumulators), each running
    /// down the matrix's rows, `acc += x[i] * R[i][..]` with the product rounded and then
    /// added (no fused multiply-add) in order of `i`, so each output is the scalar loop's
    /// bits. The scalar loop kept `out` in memory and ran 4 lanes wide (SSE2): learned
    /// rotations spent two thirds of append's time in it.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dense_rotate(x: &[f32], r: &[f32], out: &mut [f32]) {
        let d = x.len();
        assert!(out.len() == d && r.len() == d * d);
        let rp = r.as_ptr();
        let mut c0 = 0;
        // Blocks of 64 outputs, then of 8, then the scalar loop for the rest.
        while c0 + 64 <= d {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (i, &xi) in x.iter().enumerate() {
                let xv = _mm256_set1_ps(xi);
                for (b, a) in acc.iter_mut().enumerate() {
                    // SAFETY: i < d and c0 + 8 b + 8 <= c0 + 64 <= d: inside row i of r.
                    let m = unsafe { _mm256_loadu_ps(rp.add(i * d + c0 + 8 * b)) };
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(xv, m));
                }
            }
            for (b, a) in acc.iter().enumerate() {
                // SAFETY: c0 + 8 b + 8 <= d = out.len().
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * b), *a) };
            }
            c0 += 64;
        }
        while c0 + 8 <= d {
            let mut a = _mm256_setzero_ps();
            for (i, &xi) in x.iter().enumerate() {
                // SAFETY: i < d and c0 + 8 <= d: inside row i of r.
                let m = unsafe { _mm256_loadu_ps(rp.add(i * d + c0)) };
                a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(xi), m));
            }
            // SAFETY: c0 + 8 <= d = out.len().
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c0), a) };
            c0 += 8;
        }
        for (j, o) in out.iter_mut().enumerate().skip(c0) {
            let mut a = 0.0f32;
            for (i, &xi) in x.iter().enumerate() {
                a += xi * r[i * d + j];
            }
            *o = a;
        }
    }

    /// [`dense_rotate`] of every row of `x` (`[n][d]`) into `out`: four rows at a time
    /// against blocks of 16 outputs (eight accumulators), so that each load of the matrix
    /// serves four rows (one row at a time reads the whole matrix per row, 64 KiB at
    /// head_dim 128, from L2); the same operations per output in the same order, so the
    /// same bits. Other row counts and head dimensions that are not a multiple of 16 take
    /// [`dense_rotate`] for the rest.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dense_rotate_rows(x: &[f32], r: &[f32], d: usize, out: &mut [f32]) {
        const R: usize = 4;
        assert!(d * d == r.len() && d > 0 && x.len().is_multiple_of(d) && out.len() == x.len());
        let n = x.len() / d;
        // Rows in blocks of R; the rest go one at a time below.
        let blocked = if d.is_multiple_of(16) { n / R * R } else { 0 };
        let (xp, rp) = (x.as_ptr(), r.as_ptr());
        // Column blocks outside, row blocks inside: a column block of the matrix (d x 16
        // floats, 16 KiB at head_dim 256) is read from L2 once and then from L1 for every
        // block of rows.
        for c0 in (0..d).step_by(16).take(if blocked > 0 { d / 16 } else { 0 }) {
            for t in (0..blocked).step_by(R) {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                for i in 0..d {
                    // SAFETY: i < d and c0 + 16 <= d: inside row i of r.
                    let m = unsafe { [_mm256_loadu_ps(rp.add(i * d + c0)), _mm256_loadu_ps(rp.add(i * d + c0 + 8))] };
                    for (row, a) in acc.iter_mut().enumerate() {
                        // SAFETY: (t + row) * d + i < blocked * d <= x.len().
                        let xv = _mm256_set1_ps(unsafe { *xp.add((t + row) * d + i) });
                        a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(xv, m[0]));
                        a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(xv, m[1]));
                    }
                }
                for (row, a) in acc.iter().enumerate() {
                    let o = &mut out[(t + row) * d + c0..][..16];
                    // SAFETY: `o` holds 16 floats.
                    unsafe {
                        _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
                        _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
                    }
                }
            }
        }
        let t = blocked;
        for (xr, o) in x[t * d..].chunks_exact(d).zip(out[t * d..].chunks_exact_mut(d)) {
            dense_rotate(xr, r, o);
        }
    }

    /// Proof that the processor also has AVX-512 VNNI and AVX-512 VL, so `vpdpbusd` on
    /// 256-bit registers: only [`Vnni::detect`] makes one. (The VEX form of AVX-VNNI
    /// alone, on client cores without AVX-512, is not used: no machine this was built on
    /// had it to test it.)
    #[derive(Clone, Copy)]
    pub(crate) struct Vnni(());

    impl Vnni {
        /// `Some` when AVX2, FMA, F16C, AVX-512 F, AVX-512 VNNI and AVX-512 VL are
        /// available (the compiler takes VNNI and VL to imply F, so F is checked too).
        pub(crate) fn detect() -> Option<Self> {
            (Avx2::detect().is_some()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512vl"))
            .then_some(Vnni(()))
        }
    }

    impl Avx2 {
        /// [`Kernels::dots_int`] with `vpdpbusd` when `vnni` is given, `vpmaddubsw` else
        /// (the same bits).
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        pub(crate) fn dots_int_with(
            self,
            vnni: Option<Vnni>,
            q: &IntQuery,
            g: usize,
            j: usize,
            codes: &[u8],
            cb: usize,
            n: usize,
            out: &mut [f32],
        ) {
            match (vnni, q.per_byte) {
                (Some(_), 4) => by_head_blocks!(g, h0, dots_int_block_vnni, (q, h0, j, codes, cb, n, out), 2),
                (Some(_), _) => by_head_blocks!(g, h0, dots_int_block_vnni, (q, h0, j, codes, cb, n, out), 4),
                (None, 4) => by_head_blocks!(g, h0, dots_int_block, (q, h0, j, codes, cb, n, out), 2),
                (None, _) => by_head_blocks!(g, h0, dots_int_block, (q, h0, j, codes, cb, n, out), 4),
            }
        }
    }

    impl Kernels for Avx2 {
        #[inline(always)]
        fn to_f32(self, src: &[f16], dst: &mut [f32]) {
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe { f16_to_f32(src, dst) }
        }
        #[inline(always)]
        fn round_to_f16(self, src: &[f32], dst: &mut [f16]) {
            // SAFETY: as above.
            unsafe { f32_to_f16(src, dst) }
        }
        #[inline(always)]
        fn fwht(self, x: &mut [f32]) {
            if !fwht(self, x) {
                super::fwht_portable(x)
            }
        }
        #[inline(always)]
        fn dense_rotate(self, x: &[f32], r: &[f32], out: &mut [f32]) {
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe { dense_rotate(x, r, out) }
        }
        #[inline(always)]
        fn dense_rotate_rows(self, x: &[f32], r: &[f32], d: usize, out: &mut [f32]) {
            // SAFETY: as above.
            unsafe { dense_rotate_rows(x, r, d, out) }
        }
        #[inline(always)]
        fn prefetch(self, bytes: &[u8]) {
            for line in lines(bytes) {
                // SAFETY: a prefetch is a hint and does not fault.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(line.cast()) };
            }
        }
        #[inline(always)]
        fn prefetch_l1(self, bytes: &[u8]) {
            for line in lines(bytes) {
                // SAFETY: a prefetch is a hint and does not fault.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.cast()) };
            }
        }
        #[inline(always)]
        fn exp_sum(self, s: &mut [f32], m: f32) -> f32 {
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe { exp_sum(s, m) }
        }
        #[inline(always)]
        fn exp_weights(self, s: &mut [f32], m: f32, scales: &[f32], zeros: &[f32], w: &mut [f32]) -> (f32, f32) {
            // SAFETY: as above.
            unsafe { exp_weights(self.zmm, s, m, scales, zeros, w) }
        }
        #[inline(always)]
        fn group_ranges(self, row: &[f16], g: usize, ranges: &mut [(f32, f32)]) {
            for (x, range) in row.chunks_exact(g).zip(ranges.iter_mut()) {
                // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
                *range = unsafe { group_range(x) };
            }
        }
        #[inline(always)]
        fn stage_hadamard_pair<T: KvElement>(
            self,
            k: &[T],
            affine: KeyAffine<'_>,
            v: &[T],
            g: usize,
            key: (&mut [f16], &mut [(f32, f32)]),
            value: (&mut [f16], &mut [(f32, f32)]),
        ) -> Option<(f32, f32)> {
            if let Some(z) = self.zmm {
                return z.stage_hadamard_pair(k, affine, v, g, key, value);
            }
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe {
                match (k.len(), g) {
                    (64, 32) => stage_pair::<T, 8, 4>(k, affine, v, key, value),
                    (64, 64) => stage_pair::<T, 8, 8>(k, affine, v, key, value),
                    (128, 32) => stage_pair::<T, 16, 4>(k, affine, v, key, value),
                    (128, 64) => stage_pair::<T, 16, 8>(k, affine, v, key, value),
                    (128, 128) => stage_pair::<T, 16, 16>(k, affine, v, key, value),
                    _ => None,
                }
            }
        }
        #[inline(always)]
        fn stage_hadamard<T: KvElement>(
            self,
            src: &[T],
            affine: KeyAffine<'_>,
            g: usize,
            dst: &mut [f16],
            ranges: &mut [(f32, f32)],
        ) -> Option<f32> {
            if let Some(z) = self.zmm {
                return z.stage_hadamard(src, affine, g, dst, ranges);
            }
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe {
                match (src.len(), g) {
                    (64, 32) => stage_hadamard::<T, 8, 4>(src, affine, dst, ranges),
                    (64, 64) => stage_hadamard::<T, 8, 8>(src, affine, dst, ranges),
                    (128, 32) => stage_hadamard::<T, 16, 4>(src, affine, dst, ranges),
                    (128, 64) => stage_hadamard::<T, 16, 8>(src, affine, dst, ranges),
                    (128, 128) => stage_hadamard::<T, 16, 16>(src, affine, dst, ranges),
                    _ => None,
                }
            }
        }
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        fn quantize_rows(
            self,
            rows: &[f16],
            d: usize,
            bits: u32,
            g: usize,
            clip: u32,
            ranges: &[(f32, f32)],
            codes: &mut [u8],
            params: &mut [u8],
        ) {
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe { quantize_rows(self.zmm, rows, d, bits, g, clip, ranges, codes, params) }
        }
        #[inline(always)]
        fn dots(self, q: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]) {
            by_head_blocks!(g, h0, dots_block, (q, h0, d, rows, n, c0, c1, out));
        }
        #[inline(always)]
        fn accumulate(
            self,
            o: &mut [f32],
            w: &[f32],
            g: usize,
            d: usize,
            rows: &[f32],
            n: usize,
            c0: usize,
            c1: usize,
        ) {
            by_head_blocks!(g, h0, accumulate_block, (o, w, h0, d, rows, n, c0, c1));
        }
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        fn key_dots(
            self,
            qk: &[f32],
            qt: &[f32],
            g: usize,
            d: usize,
            codes: &[u8],
            bits: u32,
            gs: usize,
            n: usize,
            out: &mut [f32],
            rows: &mut [f32],
            codes_t: &mut [u32],
        ) {
            let cb = d * bits as usize / 8;
            if !cb.is_multiple_of(16) {
                // Rows that are not whole 16-byte blocks (head_dim 96 at 2 bits, which the
                // cache does not accept; the kernels do).
                return super::key_dots_by_group(self, qk, g, d, codes, bits, gs, n, out, rows);
            }
            // The 256-bit kernels: with the 512-bit ones, decode's exact path takes
            // `key_scores` instead, and no chunk reaches this.
            transpose_codes(self, codes, cb, n, codes_t);
            // Every group is whole 32-bit words: groups of 32 or more channels.
            let words = gs * bits as usize / 32;
            for j in 0..d / gs {
                let o = &mut out[j * g * CHUNK..(j + 1) * g * CHUNK];
                dots_codes_t_heads(self, qt, g, d, codes_t, bits, n, j * words, (j + 1) * words, o);
            }
        }
        #[inline(always)]
        fn spreads_prefetch(self) -> bool {
            self.zmm.is_some()
        }
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        fn accumulate_codes_prefetching(
            self,
            o: &mut [f32],
            w: &[f32],
            g: usize,
            d: usize,
            codes: &[u8],
            bits: u32,
            n: usize,
            c0: usize,
            c1: usize,
            scratch: &mut [f32],
            pf: &[u8],
        ) {
            match self.zmm.filter(|_| Avx512::takes_values(bits, c0, c1)) {
                Some(z) => z.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, pf),
                None => {
                    self.prefetch(pf);
                    self.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, scratch)
                }
            }
        }
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        fn key_scores(
            self,
            qt: &[f32],
            g: usize,
            d: usize,
            codes: &[u8],
            bits: u32,
            gs: usize,
            n: usize,
            scales: &[f32],
            zeros: &[f32],
            qsum: &[f32],
            s: &mut [f32],
            codes_t: &mut [u32],
            pf: &[u8],
        ) -> bool {
            match self.zmm {
                Some(z) if (d * bits as usize / 8).is_multiple_of(16) => {
                    z.key_scores(qt, g, d, codes, bits, gs, n, scales, zeros, qsum, s, codes_t, pf);
                    true
                }
                _ => false,
            }
        }
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        fn dots_int(self, q: &IntQuery, g: usize, j: usize, codes: &[u8], cb: usize, n: usize, out: &mut [f32]) {
            self.dots_int_with(Vnni::detect(), q, g, j, codes, cb, n, out)
        }
        #[inline(always)]
        fn accumulate_codes(
            self,
            o: &mut [f32],
            w: &[f32],
            g: usize,
            d: usize,
            codes: &[u8],
            bits: u32,
            n: usize,
            c0: usize,
            c1: usize,
            _scratch: &mut [f32],
        ) {
            if let Some(z) = self.zmm.filter(|_| Avx512::takes_values(bits, c0, c1)) {
                return z.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, &[]);
            }
            let mut h0 = 0;
            while h0 < g {
                let hn = (g - h0).min(4);
                macro_rules! go {
                    ($b:literal) => {
                        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were
                        // detected.
                        unsafe {
                            match hn {
                                4 => accumulate_codes_block::<4, $b>(o, w, h0, d, codes, n, c0, c1),
                                3 => accumulate_codes_block::<3, $b>(o, w, h0, d, codes, n, c0, c1),
                                2 => accumulate_codes_wide::<2, $b>(o, w, h0, d, codes, n, c0, c1),
                                _ => accumulate_codes_wide::<1, $b>(o, w, h0, d, codes, n, c0, c1),
                            }
                        }
                    };
                }
                if bits == 2 {
                    go!(2)
                } else {
                    go!(4)
                }
                h0 += hn;
            }
        }
    }
}

/// Sum of `x` with `LANES` independent accumulators (vectorizes; f32 addition order
/// differs from a serial sum by rounding only).
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

/// Max of `x` (not NaN-aware: scores are finite) with `LANES` accumulators.
#[inline(always)]
fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    acc.iter().chain(it.remainder()).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// `sum(a * b)` with `LANES` independent accumulators.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A chunk's max logit may exceed the running reference max by this much before the
/// state is rescaled (lazy rescaling: weights up to `e^20` stay far from f32 overflow).
const RESCALE_THRESHOLD: f32 = 20.0;

/// Scratch of [`HeadState`] for variance-normalized pages.
struct NormScratch {
    key_scales: Vec<f32>,
    value_scales: Vec<f32>,
    qk: Vec<f32>,
    qt: Vec<f32>,
    qsum: Vec<f32>,
    ov: Vec<f32>,
    zsum: Vec<f32>,
}

/// Running online-softmax state of one KV head's query rows, and its scratch.
///
/// The rows are the group's query heads, for every query token of a multi-token decode
/// (`[token][head]`); each row may have its own causal limit ([`HeadState::causal`]),
/// past which its scores are masked. Weights are `exp(logit - m)` against a reference
/// max `m` that only moves when a chunk's max exceeds it by [`RESCALE_THRESHOLD`]; value
/// zeros are accumulated per quantization group in `zsum` and added to `o` when `m` moves
/// and at the end ([`HeadState::finish`]).
pub(crate) struct HeadState {
    /// Query rows (heads of the group, times query tokens).
    g: usize,
    d: usize,
    /// Rotated, scaled queries `[g][d]`.
    q: Vec<f32>,
    /// The same in the unpack order of the key codes.
    qk: Vec<f32>,
    /// The same in stored order, channel `c` scaled by `2^-code_shift(c)`
    /// ([`shifted_query`], for [`Kernels::key_dots`]).
    qt: Vec<f32>,
    /// `sum(q')` per quantization group: `[g][groups]`.
    qsum: Vec<f32>,
    /// Sum of `weight * zero` per head and value group `[g][groups]`.
    zsum: Vec<f32>,
    /// Reference max logit per head.
    pub m: Vec<f32>,
    /// Sum of `exp(logit - m)` per head.
    pub l: Vec<f32>,
    /// Weighted value sum `[g][d]` (stored value order), complete after `finish`.
    pub o: Vec<f32>,
    /// Weighted sum of quantized values `[g][d]` in the unpack order of value codes.
    ov: Vec<f32>,
    /// Code bits of keys and values (for the unpack orders).
    bits: (u32, u32),
    /// Variance-normalized pages (empty without): the page's key and value channel
    /// scales `[d]`, the queries times the key scales in unpack order `[g][d]` with their
    /// group sums `[g][groups]`, and one chunk's weighted value codes `[g][d]` and zero
    /// sums `[g][groups]` before the value scales are applied.
    norm: Option<NormScratch>,
    /// The queries in int8 where key scores are integer ([`HeadState::int_keys`]).
    int_q: Option<IntQuery>,
    /// Position of the next chunk's first token.
    pos: u32,
    /// The smallest causal limit: chunks ending at or before it (and starting at or past
    /// `mask_to`) need no mask.
    mask_from: u32,
    /// The largest sliding-window start (0 without a window).
    mask_to: u32,
    /// Per row, the end (exclusive) of the positions it attends to.
    limits: Vec<u32>,
    /// Per row, the first position it attends to (empty without a window).
    starts: Vec<u32>,
    s: Vec<f32>,
    w: Vec<f32>,
    /// Partial key scores per group, `[groups][g][CHUNK]`.
    tmp: Vec<f32>,
    /// A chunk's key codes transposed for [`Kernels::key_dots`].
    codes_t: Vec<u32>,
    rows: Vec<f32>,
    scales: Vec<f32>,
    zeros: Vec<f32>,
}

impl HeadState {
    /// `q` is the `[g][d]` rotated query rows with the softmax scale folded in; every
    /// row attends to every token given (see [`HeadState::causal`]).
    pub(crate) fn new(fmt: &Format, q: &[f32], g: usize) -> Self {
        let d = fmt.head_dim as usize;
        let gs = fmt.group_size as usize;
        let groups = d / gs;
        let mut qk = vec![0f32; g * d];
        for (qh, kh) in q.chunks_exact(d).zip(qk.chunks_exact_mut(d)) {
            for (c, &x) in qh.iter().enumerate() {
                kh[unpack_position(c, fmt.key_bits)] = x;
            }
        }
        let qt = q.iter().enumerate().map(|(i, &x)| shifted_query(x, i % d, fmt.key_bits)).collect();
        Self {
            g,
            d,
            q: q.to_vec(),
            qk,
            qt,
            qsum: q.chunks_exact(gs).map(|c| c.iter().sum()).collect(),
            zsum: vec![0.0; g * groups],
            m: vec![f32::NEG_INFINITY; g],
            l: vec![0.0; g],
            o: vec![0.0; g * d],
            ov: vec![0.0; g * d],
            bits: (fmt.key_bits, fmt.value_bits),
            norm: (fmt.channel_norm > 0).then(|| NormScratch {
                key_scales: vec![0.0; d],
                value_scales: vec![0.0; d],
                qk: vec![0.0; g * d],
                qt: vec![0.0; g * d],
                qsum: vec![0.0; g * groups],
                ov: vec![0.0; g * d],
                zsum: vec![0.0; g * groups],
            }),
            int_q: None,
            pos: 0,
            mask_from: u32::MAX,
            mask_to: 0,
            limits: Vec::new(),
            starts: Vec::new(),
            s: vec![0.0; g * CHUNK],
            w: vec![0.0; g * CHUNK],
            tmp: vec![0.0; groups * g * CHUNK],
            codes_t: vec![0; fmt.key_code_bytes() as usize / 4 * CODES_T_COLS],
            rows: vec![0.0; CHUNK * d],
            scales: vec![0.0; CHUNK * groups],
            zeros: vec![0.0; CHUNK * groups],
        }
    }

    /// Gives every row a causal limit: the chunks start at position `begin`, and row `r`
    /// only sees positions below `limits[r]` (its scores past it are masked; a row that
    /// sees none of the chunks stays empty, `m = -inf, l = 0, o = 0`).
    pub(crate) fn causal(mut self, begin: u32, limits: Vec<u32>) -> Self {
        debug_assert_eq!(limits.len(), self.g);
        self.pos = begin;
        self.mask_from = limits.iter().copied().min().unwrap_or(u32::MAX);
        self.limits = limits;
        self
    }

    /// Gives every row a sliding-window start as well: row `r` only sees positions at or
    /// past `starts[r]` (its scores before it are masked).
    pub(crate) fn window(mut self, starts: Vec<u32>) -> Self {
        debug_assert_eq!(starts.len(), self.g);
        self.mask_to = starts.iter().copied().max().unwrap_or(0);
        self.starts = starts;
        self
    }

    /// Scores quantized keys with int8 queries and integer dot products
    /// ([`KeyScores::Int8`]; pages with variance normalization keep the f32 path).
    pub(crate) fn int_keys(mut self, fmt: &Format, terms: usize) -> Self {
        if fmt.channel_norm == 0 {
            self.int_q = Some(IntQuery::new(fmt, &self.q, self.g, terms));
        }
        self
    }

    /// Masks the scores of the `n` tokens of the current chunk that lie past their row's
    /// causal limit or before its sliding-window start (only chunks that reach past the
    /// smallest limit or start before the largest start have any).
    #[inline(always)]
    fn mask(&mut self, n: usize) {
        if self.pos + n as u32 <= self.mask_from && self.pos >= self.mask_to {
            return;
        }
        for (h, &limit) in self.limits.iter().enumerate() {
            let keep = limit.saturating_sub(self.pos).min(n as u32) as usize;
            self.s[h * CHUNK + keep..h * CHUNK + n].fill(f32::NEG_INFINITY);
        }
        for (h, &start) in self.starts.iter().enumerate() {
            let drop = start.saturating_sub(self.pos).min(n as u32) as usize;
            self.s[h * CHUNK..h * CHUNK + drop].fill(f32::NEG_INFINITY);
        }
    }

    /// Converts the scales and zeros of slots `[slot, slot + n)` into `scales` and
    /// `zeros` (`[groups][CHUNK]`; contiguous runs in the page's planar layout).
    #[inline(always)]
    fn load_params<K: Kernels>(&mut self, kern: K, fmt: &Format, page: &[u8], value: bool, slot: u32, n: usize) {
        for j in 0..fmt.groups() {
            let (s, z) = (fmt.scale_at(value, j, slot) as usize, fmt.zero_at(value, j, slot) as usize);
            let j = j as usize;
            let scales = bytemuck::cast_slice::<u8, f16>(&page[s..s + 2 * n]);
            kern.to_f32(scales, &mut self.scales[j * CHUNK..j * CHUNK + n]);
            let zeros = bytemuck::cast_slice::<u8, f16>(&page[z..z + 2 * n]);
            kern.to_f32(zeros, &mut self.zeros[j * CHUNK..j * CHUNK + n]);
        }
    }

    /// Adds the zero sums into `o`.
    #[inline(always)]
    fn flush(&mut self) {
        let d = self.d;
        let groups = self.zsum.len() / self.g;
        let gs = d / groups;
        for h in 0..self.g {
            for j in 0..groups {
                let z = std::mem::take(&mut self.zsum[h * groups + j]);
                if z != 0.0 {
                    self.o[h * d + j * gs..h * d + (j + 1) * gs].iter_mut().for_each(|o| *o += z);
                }
            }
        }
    }

    /// Turns the scores of `n` tokens into weights `exp(s - m)`, moving `m` (and
    /// rescaling the running sums) only when a score exceeds it by the threshold.
    #[inline(always)]
    fn softmax<K: Kernels>(&mut self, kern: K, n: usize) {
        self.rescale(n);
        for h in 0..self.g {
            let m = self.m[h];
            let s = &mut self.s[h * CHUNK..h * CHUNK + n];
            if m == f32::NEG_INFINITY {
                // Every score of the row so far is masked: no weight (not -inf - -inf).
                s.fill(0.0);
                continue;
            }
            self.l[h] += kern.exp_sum(s, m);
        }
    }

    /// The first half of [`HeadState::softmax`]: moves each row's reference max `m` where
    /// a score of the chunk exceeds it by the threshold, rescaling the running sums.
    #[inline(always)]
    fn rescale(&mut self, n: usize) {
        let d = self.d;
        let mut moved = false;
        for h in 0..self.g {
            let local = max(&self.s[h * CHUNK..h * CHUNK + n]);
            if local > self.m[h] + RESCALE_THRESHOLD {
                if !moved {
                    self.flush();
                    moved = true;
                }
                let c = exp_neg(self.m[h] - local);
                self.m[h] = local;
                self.l[h] *= c;
                self.o[h * d..(h + 1) * d].iter_mut().for_each(|o| *o *= c);
                self.ov[h * d..(h + 1) * d].iter_mut().for_each(|o| *o *= c);
            }
        }
    }

    /// Raw scores `s[h][t] = q'[h] . khat[t]` of slots `[slot, slot + n)` of a page (no
    /// mask, no softmax), by the f32 or the integer path; the lines of `pf` are prefetched
    /// into L2 (by the kernel, spread out, where it does that).
    #[inline(always)]
    fn key_scores<K: Kernels>(&mut self, kern: K, fmt: &Format, page: &[u8], slot: u32, n: usize, pf: &[u8]) {
        let (g, d) = (self.g, self.d);
        let gs = fmt.group_size as usize;
        let groups = d / gs;
        // A variance-normalized page: the queries times its key channel scales.
        if let Some(nm) = self.norm.as_mut() {
            for value in [false, true] {
                let at = fmt.channel_scale_at(value, 0) as usize;
                let src = bytemuck::cast_slice::<u8, f16>(&page[at..at + 2 * d]);
                kern.to_f32(src, if value { &mut nm.value_scales } else { &mut nm.key_scales });
            }
            for h in 0..g {
                for c in 0..d {
                    let x = self.q[h * d + c] * nm.key_scales[c];
                    nm.qk[h * d + unpack_position(c, fmt.key_bits)] = x;
                    nm.qt[h * d + c] = shifted_query(x, c, fmt.key_bits);
                }
                for j in 0..groups {
                    nm.qsum[h * groups + j] =
                        (j * gs..(j + 1) * gs).map(|c| self.q[h * d + c] * nm.key_scales[c]).sum();
                }
            }
        }
        self.load_params(kern, fmt, page, false, slot, n);
        let (qk, qt, qsum) = match &self.norm {
            Some(nm) => (&nm.qk, &nm.qt, &nm.qsum),
            None => (&self.qk, &self.qt, &self.qsum),
        };
        let kc = fmt.key_codes_at(slot) as usize;
        let kcodes = &page[kc..kc + n * fmt.key_code_bytes() as usize];
        if self.int_q.is_none()
            && kern.key_scores(
                qt,
                g,
                d,
                kcodes,
                fmt.key_bits,
                gs,
                n,
                &self.scales,
                &self.zeros,
                qsum,
                &mut self.s,
                &mut self.codes_t,
                pf,
            )
        {
            return;
        }
        kern.prefetch(pf);
        if self.int_q.is_none() {
            // Every group's partial scores at once, `tmp` as `[groups][g][CHUNK]`.
            kern.key_dots(qk, qt, g, d, kcodes, fmt.key_bits, gs, n, &mut self.tmp, &mut self.rows, &mut self.codes_t);
        }
        for j in 0..groups {
            // The integer path scores one group at a time into `tmp[0]`.
            let at = if let Some(iq) = &self.int_q {
                kern.dots_int(iq, g, j, kcodes, fmt.key_code_bytes() as usize, n, &mut self.tmp);
                0
            } else {
                j * g * CHUNK
            };
            let (scales, zeros) = (&self.scales[j * CHUNK..j * CHUNK + n], &self.zeros[j * CHUNK..j * CHUNK + n]);
            for h in 0..g {
                let qs = qsum[h * groups + j];
                let s = &mut self.s[h * CHUNK..h * CHUNK + n];
                let tmp = &self.tmp[at + h * CHUNK..at + h * CHUNK + n];
                if j == 0 {
                    for t in 0..n {
                        s[t] = scales[t] * tmp[t] + zeros[t] * qs;
                    }
                } else {
                    for t in 0..n {
                        s[t] += scales[t] * tmp[t] + zeros[t] * qs;
                    }
                }
            }
        }
    }

    /// Scores the chunk, updates the softmax state and accumulates its values.
    ///
    /// `next` is the next chunk's head-page (or empty), prefetched into L2 in three
    /// parts spread over this chunk's work: issued at once, its 72 lines (head_dim 128)
    /// filled the miss buffers and the prefetches stalled; into L1, they took more time
    /// than they saved (in-process A/B, 2026-12-03: L2 instead of L1 decoded 11-17%
    /// faster at head_dim 128).
    #[inline(always)]
    pub(crate) fn step<K: Kernels>(&mut self, kern: K, fmt: &Format, chunk: Chunk<'_>, next: &[u8]) {
        let (g, d) = (self.g, self.d);
        // The next chunk in the same page (pages of 128 or 256 tokens, or a page split at
        // a protected position) has nothing to prefetch.
        let next = match chunk {
            Chunk::Quant { page, .. } if std::ptr::eq(page.as_ptr(), next.as_ptr()) => &[][..],
            _ => next,
        };
        // Three line-aligned parts of `next`.
        let third = next.len().div_ceil(3).next_multiple_of(64);
        let part = |i: usize| &next[(i * third).min(next.len())..((i + 1) * third).min(next.len())];
        match chunk {
            Chunk::F16 { k, v } => {
                kern.prefetch(next);
                let n = k.len() / d;
                kern.to_f32(k, &mut self.rows[..n * d]);
                kern.dots(&self.q, g, d, &self.rows, n, 0, d, &mut self.s);
                self.mask(n);
                self.softmax(kern, n);
                kern.to_f32(v, &mut self.rows[..n * d]);
                kern.accumulate(&mut self.o, &self.s, g, d, &self.rows, n, 0, d);
                self.pos += n as u32;
            }
            Chunk::Quant { page, slot, n } => {
                let n = n as usize;
                let gs = fmt.group_size as usize;
                let groups = d / gs;
                // The first third of the next page: prefetched by the key kernel, a line per
                // code position, where it does that (in-process A/B, 2026-12-03: 1-8% faster
                // at head_dim 64, -4% to +13% at 128), else at once.
                if kern.spreads_prefetch() {
                    self.key_scores(kern, fmt, page, slot, n, part(0));
                } else {
                    kern.prefetch(part(0));
                    self.key_scores(kern, fmt, page, slot, n, &[]);
                }
                // With one value group, the weights are scaled in the softmax's pass.
                let fused = groups == 1;
                // The rest of the next page is prefetched by the value kernel, a line per
                // token, where it does that (in-process A/B, 2026-12-03, 512-bit kernels:
                // 1-5% faster than two bursts; the bursts waited for free miss buffers).
                let spread = fused && kern.spreads_prefetch();
                if !spread {
                    kern.prefetch(part(1));
                }
                self.mask(n);
                if fused {
                    self.rescale(n);
                } else {
                    self.softmax(kern, n);
                }
                if !spread {
                    kern.prefetch(part(2));
                }
                // The next page's scales and zeros (and channel scales), read first, into L1.
                if let Some(params) = next.get(fmt.scale_at(false, 0, 0) as usize..) {
                    kern.prefetch_l1(params);
                }
                let vc = fmt.value_codes_at(slot) as usize;
                let vcodes = &page[vc..vc + n * fmt.value_code_bytes() as usize];
                self.load_params(kern, fmt, page, true, slot, n);
                // Normalized pages accumulate the chunk apart, then apply the value scales.
                let (ov, zsum) = match self.norm.as_mut() {
                    Some(nm) => {
                        nm.ov.fill(0.0);
                        nm.zsum.fill(0.0);
                        (&mut nm.ov, &mut nm.zsum)
                    }
                    None => (&mut self.ov, &mut self.zsum),
                };
                if fused {
                    // One group: `zsum` is `[g]`.
                    for (h, zs) in zsum.iter_mut().enumerate().take(g) {
                        let m = self.m[h];
                        let (s, w) = (&mut self.s[h * CHUNK..h * CHUNK + n], &mut self.w[h * CHUNK..h * CHUNK + n]);
                        if m == f32::NEG_INFINITY {
                            // Every score of the row so far is masked: no weight.
                            w.fill(0.0);
                            continue;
                        }
                        let (l, z) = kern.exp_weights(s, m, &self.scales[..n], &self.zeros[..n], w);
                        self.l[h] += l;
                        *zs += z;
                    }
                    let pf = if spread { &next[third.min(next.len())..] } else { &[][..] };
                    kern.accumulate_codes_prefetching(
                        ov,
                        &self.w,
                        g,
                        d,
                        vcodes,
                        fmt.value_bits,
                        n,
                        0,
                        d,
                        &mut self.rows,
                        pf,
                    );
                }
                for j in (0..groups).filter(|_| !fused) {
                    let (scales, zeros) =
                        (&self.scales[j * CHUNK..j * CHUNK + n], &self.zeros[j * CHUNK..j * CHUNK + n]);
                    for h in 0..g {
                        let (p, w) = (&self.s[h * CHUNK..h * CHUNK + n], &mut self.w[h * CHUNK..h * CHUNK + n]);
                        for t in 0..n {
                            w[t] = p[t] * scales[t];
                        }
                        zsum[h * groups + j] += dot(p, zeros);
                    }
                    let (c0, c1) = (j * gs, (j + 1) * gs);
                    kern.accumulate_codes(ov, &self.w, g, d, vcodes, fmt.value_bits, n, c0, c1, &mut self.rows);
                }
                if let Some(nm) = &self.norm {
                    for h in 0..g {
                        for c in 0..d {
                            let x = nm.ov[h * d + unpack_position(c, fmt.value_bits)] + nm.zsum[h * groups + c / gs];
                            self.o[h * d + c] += nm.value_scales[c] * x;
                        }
                    }
                }
                self.pos += n as u32;
            }
        }
    }

    /// Completes `o` (call once after the last chunk).
    pub(crate) fn finish(&mut self) {
        self.flush();
        let d = self.d;
        for (o, ov) in self.o.chunks_exact_mut(d).zip(self.ov.chunks_exact(d)) {
            for (c, o) in o.iter_mut().enumerate() {
                *o += ov[unpack_position(c, self.bits.1)];
            }
        }
    }
}

/// Runs every chunk of `chunks` through `st`, then completes it.
///
/// The head-pages of one KV head lie `num_kv_heads` pages apart in the pool (or wherever
/// the block table puts them), so each one starts cold for the hardware prefetchers:
/// the next chunk's page bytes are prefetched while the current chunk is computed.
#[inline(always)]
fn run_chunks<'a, K: Kernels>(kern: K, st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    let mut chunks = chunks.peekable();
    while let Some(c) = chunks.next() {
        let next = match chunks.peek() {
            Some(Chunk::Quant { page, .. }) => page,
            _ => &[][..],
        };
        st.step(kern, fmt, c, next);
    }
    st.finish();
}

/// [`run_chunks`] with the AVX2 kernels, compiled for AVX2 (and FMA, F16C) so
/// everything inlines.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn run_chunks_avx2<'a>(kern: Avx2, st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    run_chunks(kern, st, fmt, chunks)
}

/// [`run_chunks`] with the best kernels this processor supports.
fn run_chunks_best<'a>(st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect() {
        // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target features.
        return unsafe { run_chunks_avx2(kern, st, fmt, chunks) };
    }
    run_chunks(Portable, st, fmt, chunks)
}

/// [`set_avx512`]'s choice: 0 none yet (then `ROTKV_CPU_ISA`), 1 on, 2 off.
static AVX512_CHOICE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether the 256-bit kernels only were asked for: by [`set_avx512`]`(false)`, or, if it
/// was never called, by `ROTKV_CPU_ISA=avx2` in the environment (read once).
fn isa_is_avx2() -> bool {
    static ENV_AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match AVX512_CHOICE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => *ENV_AVX2.get_or_init(|| std::env::var("ROTKV_CPU_ISA").is_ok_and(|v| v.eq_ignore_ascii_case("avx2"))),
    }
}

/// Turns the CPU backend's 512-bit kernels (decode's packed-code kernels, append's
/// one-pass staging and quantizer, the FWHT) on or off for this process, from the next call
/// on (on by default where the processor has AVX-512 F, unless `ROTKV_CPU_ISA=avx2` is
/// set). The results are the same bits either way; off is for
/// side-by-side benchmarks and for processors that lower their clock for 512-bit
/// instructions. Without AVX-512 F, `true` changes nothing. See [`kernels`].
pub fn set_avx512(enabled: bool) {
    AVX512_CHOICE.store(if enabled { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
}

/// The kernel set the CPU backend's decode and append use on this processor: `"avx512"`
/// (AVX2, FMA and F16C, and decode's packed-code kernels, append's staging and codes and
/// the FWHT with 512-bit registers: AVX-512 F; the 2-bit codes also BMI2 where present),
/// `"avx2"` (AVX2, FMA and F16C; also where [`set_avx512`]`(false)` or
/// `ROTKV_CPU_ISA=avx2` turned the 512-bit kernels off) or `"portable"`. Benchmarks
/// print it beside their numbers.
pub fn kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect() {
        return if kern.is_wide() { "avx512" } else { "avx2" };
    }
    "portable"
}

/// The chunks of positions `[begin, end)` of a sequence, in position order: sink rows,
/// then page slots (a protected position as a one-row f16 chunk of its protected row),
/// then window rows, none crossing a page, a protected position, the end of the sinks
/// or the wrap of the window ring, none longer than 64 tokens.
fn chunks<'a>(
    fmt: &Format,
    num_kv_heads: usize,
    pool: &'a [u8],
    seq: &SeqRef<'a>,
    kv_head: usize,
    begin: u32,
    end: u32,
) -> impl Iterator<Item = Chunk<'a>> + use<'a> {
    let fmt = *fmt;
    let len = seq.len as u32;
    let seq = *seq;
    let d = fmt.head_dim as usize;
    let mut pos = begin;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let h = kv_head as u32;
        let (chunk, n) = match fmt.place(pos, len) {
            Place::Sink { index: row } | Place::Window { slot: row } => {
                let limit = if pos < fmt.sinks { fmt.sinks } else { fmt.sinks + fmt.window_capacity() };
                let n = (end - pos).min(limit - row).min(CHUNK as u32);
                let k = fmt.side_row_at(h, false, row);
                let v = fmt.side_row_at(h, true, row);
                let c = n as usize * d;
                (Chunk::F16 { k: &seq.side[k..k + c], v: &seq.side[v..v + c] }, n)
            }
            Place::Page { page, slot } => {
                // A protected position is read from its f16 row; a page chunk stops before
                // the next one.
                let next = seq.protected.partition_point(|&x| x < pos);
                match seq.protected.get(next) {
                    Some(&p) if p == pos => {
                        let row = fmt.protected_row(next as u32);
                        let (k, v) = (fmt.side_row_at(h, false, row), fmt.side_row_at(h, true, row));
                        (Chunk::F16 { k: &seq.side[k..k + d], v: &seq.side[v..v + d] }, 1)
                    }
                    upcoming => {
                        let stop = upcoming.map_or(end, |&p| p.min(end));
                        let n = (stop - pos).min(fmt.page_size - slot).min(CHUNK as u32);
                        let at = fmt.page_offset(seq.block_table[page as usize], h, num_kv_heads as u32);
                        let page = &pool[at..at + fmt.page_bytes() as usize];
                        (Chunk::Quant { page, slot, n }, n)
                    }
                }
            }
        };
        pos += n;
        Some(chunk)
    })
}

/// Rotated query rows of one KV head's group, `[q_len][g][d]`, with the softmax scale
/// folded in.
fn group_queries(p: &DecodeParams, calib: &LayerCalibration, q: &[f32], seq: usize, kv_head: usize) -> Vec<f32> {
    let d = p.format.head_dim as usize;
    let hq = p.num_q_heads as usize;
    let g = hq / p.num_kv_heads as usize;
    let (_, kperm, _) = calib.head(kv_head, d);
    let ks = calib.head_key_scale(kv_head, d);
    let mut out = vec![0f32; p.q_len as usize * g * d];
    let mut x = vec![0f32; d];
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        let (row, i) = (r / g, r % g);
        let at = seq * p.q_seq_stride as usize + row * p.q_token_stride as usize + (kv_head * g + i) * d;
        x.iter_mut().zip(q[at..at + d].iter().zip(ks)).for_each(|(x, (q, s))| *x = q * s * p.sm_scale);
        rotate_into(&mut x, calib.rotation(false, kv_head, d, p.flags), kperm, o);
    }
    out
}

/// Decode attention for `p.q_len` query tokens per sequence (see
/// [`crate::reference::decode`] for the definition): tasks over `(sequence, KV head,
/// split)` in parallel, each scoring the `q_len * g` query rows of its KV head's group
/// in one pass over the split's keys and values (rows past their causal limit masked,
/// which only the split's last `q_len - 1` positions can be; with a sliding window, the
/// splits cover the visible positions only and the rows before their window's start are
/// masked, which only the split's first `q_len - 1` positions can be), then the
/// log-sum-exp merge
/// and the inverse value rotation per query row and head. The rows share each chunk's
/// loads and conversions: the portable kernels unpack a chunk's codes once for all rows,
/// the AVX2 kernels once per register block of 4 rows.
pub fn decode(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
    out: &mut [f32],
    key_scores: KeyScores,
) {
    let fmt = p.format;
    let d = fmt.head_dim as usize;
    let (hq, hkv) = (p.num_q_heads as usize, p.num_kv_heads as usize);
    let g = hq / hkv;
    let q_len = p.q_len as usize;
    let ns = p.num_splits as usize;
    let tasks: Vec<(usize, usize, u32)> =
        (0..seqs.len()).flat_map(|s| (0..hkv).flat_map(move |h| (0..ns as u32).map(move |i| (s, h, i)))).collect();
    let partials: Vec<Option<HeadState>> = tasks
        .par_iter()
        .map(|&(s, h, split)| {
            let len = seqs[s].len as u32;
            let (b, e) = p.split_range(split, len);
            if b >= e {
                return None;
            }
            let limits = (0..q_len * g).map(|r| p.row_len(len, (r / g) as u32)).collect();
            let mut st = HeadState::new(&fmt, &group_queries(p, calib, q, s, h), q_len * g).causal(b, limits);
            if p.attn_window > 0 {
                st = st.window((0..q_len * g).map(|r| p.row_start(len, (r / g) as u32)).collect());
            }
            match key_scores {
                KeyScores::Exact => {}
                KeyScores::Int8 => st = st.int_keys(&fmt, 1),
                KeyScores::Int8x2 => st = st.int_keys(&fmt, 2),
            }
            run_chunks_best(&mut st, &fmt, chunks(&fmt, hkv, pool, &seqs[s], h, b, e));
            Some(st)
        })
        .collect();
    out.par_chunks_mut(p.q_seq_stride as usize).zip(partials.par_chunks(hkv * ns)).for_each(|(out, parts)| {
        let (mut x, mut t) = (vec![0f32; d], vec![0f32; d]);
        for row in 0..q_len {
            for qh in 0..hq {
                let (h, i) = (qh / g, qh % g);
                merge_into(&parts[h * ns..(h + 1) * ns], row * g + i, d, &mut x);
                let (_, _, vperm) = calib.head(h, d);
                let o = &mut out[(row * hq + qh) * d..(row * hq + qh + 1) * d];
                unrotate_into(&x, calib.rotation(true, h, d, p.flags), vperm, &mut t, o);
            }
        }
    });
}

/// Log-sum-exp merge of query row `i` of the partials of one KV head (empty splits are
/// `None`, rows masked out of a whole split have `m = -inf`: neither contributes; all
/// empty gives zeros).
fn merge_into(parts: &[Option<HeadState>], i: usize, d: usize, x: &mut [f32]) {
    let live = || parts.iter().flatten().filter(|s| s.m[i] > f32::NEG_INFINITY);
    let m = live().map(|s| s.m[i]).fold(f32::NEG_INFINITY, f32::max);
    x.fill(0.0);
    let mut l = 0.0;
    for s in live() {
        let c = exp_neg(s.m[i] - m);
        l += s.l[i] * c;
        x.iter_mut().zip(&s.o[i * d..(i + 1) * d]).for_each(|(a, b)| *a += b * c);
    }
    if l > 0.0 {
        x.iter_mut().for_each(|a| *a /= l);
    }
}

/// The f16 baseline used by the benchmarks: decode attention over a plain f16 cache
/// (`[seq][kv_head][len][head_dim]` for K and V, no rotation, no quantization), with
/// the same threading, chunking and online softmax as [`decode`]. `q` and `out` are
/// `[seq][q_head][head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn decode_f16_baseline(
    k: &[f16],
    v: &[f16],
    len: usize,
    num_kv_heads: usize,
    num_q_heads: usize,
    head_dim: usize,
    splits: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let d = head_dim;
    let g = num_q_heads / num_kv_heads;
    let seqs = q.len() / (num_q_heads * d);
    let fmt = Format {
        head_dim: d as u32,
        key_bits: 2,
        value_bits: 2,
        group_size: d as u32,
        page_size: CHUNK as u32,
        sinks: 0,
        window: 0,
        key_clip: NO_CLIP,
        value_clip: NO_CLIP,
        protected: 0,
        channel_norm: 0,
    };
    let per = len.div_ceil(splits);
    let tasks: Vec<(usize, usize, usize)> =
        (0..seqs).flat_map(|s| (0..num_kv_heads).flat_map(move |h| (0..splits).map(move |i| (s, h, i)))).collect();
    let partials: Vec<Option<HeadState>> = tasks
        .par_iter()
        .map(|&(s, h, i)| {
            let (b, e) = ((i * per).min(len), ((i + 1) * per).min(len));
            if b >= e {
                return None;
            }
            let at = (s * num_q_heads + h * g) * d;
            let qs: Vec<f32> = q[at..at + g * d].iter().map(|x| x / (d as f32).sqrt()).collect();
            let mut st = HeadState::new(&fmt, &qs, g);
            let base = (s * num_kv_heads + h) * len * d;
            let rows = (b..e).step_by(CHUNK).map(|t| {
                let r = base + t * d..base + (t + CHUNK).min(e) * d;
                Chunk::F16 { k: &k[r.clone()], v: &v[r] }
            });
            run_chunks_best(&mut st, &fmt, rows);
            Some(st)
        })
        .collect();
    out.par_chunks_mut(num_q_heads * d).zip(partials.par_chunks(num_kv_heads * splits)).for_each(|(out, parts)| {
        for qh in 0..num_q_heads {
            let (h, i) = (qh / g, qh % g);
            merge_into(&parts[h * splits..(h + 1) * splits], i, d, &mut out[qh * d..(qh + 1) * d]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-2, 2).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 8) as f32 / (1 << 22) as f32 - 2.0
            })
            .collect()
    }

    /// Runs the same chunks (f16 rows and quantized pages) through two kernel sets.
    fn run_both<K: Kernels>(kern: K, fmt: &Format, g: usize, terms: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = fmt.head_dim as usize;
        let n = 50;
        let q = values(g * d, 1);
        let rows: Vec<f16> = values(2 * n * d, 2).iter().map(|&x| f16::from_f32(x)).collect();
        let page: Vec<u8> = values(fmt.page_bytes() as usize, 3).iter().map(|&x| (x * 1000.0) as i32 as u8).collect();
        // Valid f16 scales and zeros in the page's params.
        let mut page = page;
        for value in [false, true] {
            for j in 0..fmt.groups() {
                for slot in 0..fmt.page_size {
                    let s = fmt.scale_at(value, j, slot) as usize;
                    let z = fmt.zero_at(value, j, slot) as usize;
                    page[s..s + 2].copy_from_slice(&f16::from_f32(0.01 + (slot % 7) as f32 * 0.03).to_le_bytes());
                    page[z..z + 2].copy_from_slice(&f16::from_f32(-0.2 - (j as f32) * 0.1).to_le_bytes());
                }
            }
            if fmt.channel_norm > 0 {
                for c in 0..fmt.head_dim {
                    let at = fmt.channel_scale_at(value, c) as usize;
                    page[at..at + 2].copy_from_slice(&f16::from_f32(0.5 + (c % 5) as f32 * 0.25).to_le_bytes());
                }
            }
        }
        let mut st = HeadState::new(fmt, &q, g);
        if terms > 0 {
            st = st.int_keys(fmt, terms);
        }
        let chunks = [
            Chunk::F16 { k: &rows[..n * d], v: &rows[n * d..] },
            Chunk::Quant { page: &page, slot: 3, n: 13 },
            Chunk::Quant { page: &page, slot: 0, n: fmt.page_size },
        ];
        run_chunks(kern, &mut st, fmt, chunks.into_iter());
        (st.m[..g].to_vec(), st.l[..g].to_vec(), st.o[..g * d].to_vec())
    }

    /// The AVX2 kernels with 256-bit registers only, and with 512-bit ones where the
    /// processor has AVX-512 F (else a `SKIPPED` line).
    #[cfg(target_arch = "x86_64")]
    fn kernel_sets(avx: Avx2) -> Vec<(Avx2, &'static str)> {
        let mut v = vec![(avx.narrow(), "avx2")];
        if avx.is_wide() {
            v.push((avx, "avx512"));
        } else {
            eprintln!("SKIPPED: the 512-bit kernels (this processor has no AVX-512 F)");
        }
        v
    }

    #[test]
    fn avx2_kernels_match_portable_kernels() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            // Pages of 16 and 64 tokens (a whole chunk through `HeadState::step`), and
            // variance-normalized pages (their own shifted queries).
            for (d, kb, vb, gs, page_size, channel_norm) in [
                (64, 2, 2, 64, 16, 0),
                (128, 4, 2, 32, 16, 0),
                (256, 2, 4, 128, 16, 0),
                (128, 4, 4, 128, 16, 0),
                (64, 2, 2, 32, 16, 0),
                (256, 4, 2, 256, 16, 0),
                (128, 2, 2, 128, 64, 0),
                (64, 4, 2, 32, 64, 0),
                (128, 2, 2, 64, 64, 2),
                (64, 4, 4, 64, 16, 2),
            ] {
                let fmt = Format {
                    head_dim: d,
                    key_bits: kb,
                    value_bits: vb,
                    group_size: gs,
                    page_size,
                    sinks: 0,
                    window: 0,
                    key_clip: NO_CLIP,
                    value_clip: NO_CLIP,
                    protected: 0,
                    channel_norm,
                };
                for g in [1, 2, 3, 6, 7, 8] {
                    for terms in [0, 1, 2] {
                        let (m0, l0, o0) = run_both(Portable, &fmt, g, terms);
                        let mut first: Option<Vec<u32>> = None;
                        for (kern, what) in kernel_sets(avx) {
                            let (m1, l1, o1) = run_both(kern, &fmt, g, terms);
                            for (a, b) in m0.iter().zip(&m1).chain(l0.iter().zip(&l1)).chain(o0.iter().zip(&o1)) {
                                assert!(
                                    (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                                    "{a} vs {b} ({what} {d} {kb} {vb} {gs} g{g} terms {terms})"
                                );
                            }
                            // The 512-bit kernels give the 256-bit ones' bits.
                            let bits: Vec<u32> = m1.iter().chain(&l1).chain(&o1).map(|x| x.to_bits()).collect();
                            match &first {
                                None => first = Some(bits),
                                Some(f) => assert!(*f == bits, "{what} bits ({d} {kb} {vb} {gs} g{g} terms {terms})"),
                            }
                        }
                    }
                }
            }
        }
    }

    /// Random bytes (xorshift64) for the packed-code kernel tests.
    fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut next = xorshift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        (0..n).map(|_| (next() >> 24) as u8).collect()
    }

    /// The xorshift64 stream from `state` (non-zero).
    fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// Code of stored channel `c` in a row of packed codes.
    fn code_of(row: &[u8], c: usize, bits: u32) -> u32 {
        let per = 8 / bits as usize;
        ((row[c / per] >> ((c % per) as u32 * bits)) & ((1 << bits) - 1)) as u32
    }

    /// Every supported (head_dim, code bits, group size), and head_dim 96 (rows of 24
    /// bytes at 2 bits: the AVX2 key kernel's fallback).
    fn code_shapes() -> Vec<(usize, u32, usize)> {
        let mut v = vec![(96, 2, 32), (96, 4, 32)];
        for d in [64, 128, 256] {
            for bits in [2, 4] {
                for gs in [32, 64, 128, 256].into_iter().filter(|&gs| gs <= d) {
                    v.push((d, bits, gs));
                }
            }
        }
        v
    }

    /// The 512-bit fused key scores (`Kernels::key_scores`: the transposed kernel with
    /// each group's scale and zero applied as it stores) against `key_dots` and the
    /// combine loop of `HeadState::key_scores` (the AVX2 path), bit for bit over the
    /// chunk's tokens: every code shape, 1 to 16 heads (every head block), chunks of 1 to
    /// 64 tokens (1 to 4 sets of 16), the scratch stale. The 256-bit kernels have no fused
    /// path, nor rows that are not whole 16-byte blocks.
    #[test]
    fn fused_key_scores_match_key_dots_and_the_combine() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            if !avx.is_wide() {
                eprintln!("SKIPPED: the 512-bit fused key scores (this processor has no AVX-512 F)");
                return;
            }
            let mut seed = 5000u32;
            for (d, bits, gs) in code_shapes() {
                let cb = d * bits as usize / 8;
                let groups = d / gs;
                let mut rows = vec![0f32; CHUNK * d];
                let mut ct = vec![u32::MAX; cb / 4 * CODES_T_COLS];
                for g in [1, 2, 3, 4, 5, 6, 7, 8, 11, 16] {
                    for n in [1, 7, 8, 9, 16, 17, 23, 24, 25, 31, 32, 33, 47, 48, 49, 50, 63, 64] {
                        seed += 4;
                        let q: Vec<f32> = values(g * d, seed).iter().map(|x| x * 3.0).collect();
                        let codes = random_bytes(n * cb, seed as u64);
                        let mut qk = vec![0f32; g * d];
                        for h in 0..g {
                            for c in 0..d {
                                qk[h * d + unpack_position(c, bits)] = q[h * d + c];
                            }
                        }
                        let qt: Vec<f32> = q.iter().enumerate().map(|(i, &x)| shifted_query(x, i % d, bits)).collect();
                        let scales: Vec<f32> =
                            values(groups * CHUNK, seed + 1).iter().map(|x| x.abs() + 0.01).collect();
                        let zeros = values(groups * CHUNK, seed + 2);
                        let qsum = values(g * groups, seed + 3);
                        let mut s = vec![f32::NAN; g * CHUNK];
                        let args = (&scales[..], &zeros[..], &qsum[..]);
                        assert!(!avx.narrow().key_scores(
                            &qt,
                            g,
                            d,
                            &codes,
                            bits,
                            gs,
                            n,
                            args.0,
                            args.1,
                            args.2,
                            &mut s,
                            &mut ct,
                            &[]
                        ));
                        let fused = avx.key_scores(
                            &qt,
                            g,
                            d,
                            &codes,
                            bits,
                            gs,
                            n,
                            args.0,
                            args.1,
                            args.2,
                            &mut s,
                            &mut ct,
                            &[],
                        );
                        assert_eq!(fused, cb.is_multiple_of(16), "d{d} b{bits}");
                        if !fused {
                            continue;
                        }
                        let mut tmp = vec![f32::NAN; groups * g * CHUNK];
                        avx.narrow().key_dots(&qk, &qt, g, d, &codes, bits, gs, n, &mut tmp, &mut rows, &mut ct);
                        for h in 0..g {
                            for t in 0..n {
                                let mut want = 0f32;
                                for j in 0..groups {
                                    let x = scales[j * CHUNK + t] * tmp[(j * g + h) * CHUNK + t]
                                        + zeros[j * CHUNK + t] * qsum[h * groups + j];
                                    want = if j == 0 { x } else { want + x };
                                }
                                assert_eq!(
                                    s[h * CHUNK + t].to_bits(),
                                    want.to_bits(),
                                    "d{d} b{bits} gs{gs} g{g} n{n} head {h} token {t}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The key scores of every group of a chunk (`Kernels::key_dots`: AVX2's transposed
    /// kernel with its passes of 2 to 6 token sets and the 2-set remainder, and the
    /// portable unpacking one) for every code shape, 1 to 16 heads (every head block),
    /// chunks of 1 to 64 tokens, the scratch reused with stale contents: the portable
    /// kernel within 1e-6 of an f64 sum, the AVX2 one bit for bit an f32 FMA chain over
    /// the group's channels in stored order (what its doc promises: the masked, shifted
    /// codes and the `2^-p` queries give the unshifted products).
    #[test]
    fn key_scores_of_all_groups_match_f64_and_the_fma_chain() {
        fn check<K: Kernels>(kern: K, exact_chain: bool, what: &str) {
            let mut seed = 1;
            for (d, bits, gs) in code_shapes() {
                let cb = d * bits as usize / 8;
                let groups = d / gs;
                let mut rows = vec![0f32; CHUNK * d];
                let mut ct = vec![u32::MAX; cb / 4 * CODES_T_COLS];
                for g in [1, 2, 3, 4, 5, 6, 7, 8, 11, 16] {
                    for n in [1, 7, 8, 9, 16, 17, 23, 24, 25, 47, 48, 49, 50, 63, 64] {
                        seed += 1;
                        let q: Vec<f32> = values(g * d, seed as u32).iter().map(|x| x * 3.0).collect();
                        let codes = random_bytes(n * cb, seed);
                        let mut qk = vec![0f32; g * d];
                        for h in 0..g {
                            for c in 0..d {
                                qk[h * d + unpack_position(c, bits)] = q[h * d + c];
                            }
                        }
                        let qt: Vec<f32> = q.iter().enumerate().map(|(i, &x)| shifted_query(x, i % d, bits)).collect();
                        let mut out = vec![f32::NAN; groups * g * CHUNK];
                        kern.key_dots(&qk, &qt, g, d, &codes, bits, gs, n, &mut out, &mut rows, &mut ct);
                        for j in 0..groups {
                            for h in 0..g {
                                for t in 0..n {
                                    let row = &codes[t * cb..(t + 1) * cb];
                                    let (mut exact, mut mag, mut chain) = (0f64, 0f64, 0f32);
                                    for c in j * gs..(j + 1) * gs {
                                        let code = code_of(row, c, bits);
                                        let x = q[h * d + c] as f64 * code as f64;
                                        exact += x;
                                        mag += x.abs();
                                        chain = q[h * d + c].mul_add(code as f32, chain);
                                    }
                                    let got = out[(j * g + h) * CHUNK + t];
                                    let at = format!(
                                        "{what}: d {d} bits {bits} gs {gs} g {g} n {n}: group {j} head {h} token {t}"
                                    );
                                    assert!((got as f64 - exact).abs() <= 1e-6 * mag + 1e-9, "{at}: {got} vs {exact}");
                                    if exact_chain && cb.is_multiple_of(16) {
                                        assert_eq!(
                                            got.to_bits(),
                                            chain.to_bits(),
                                            "{at}: {got} vs the chain's {chain}"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        check(Portable, false, "portable");
        #[cfg(target_arch = "x86_64")]
        match Avx2::detect() {
            Some(avx) => {
                check(avx.narrow(), true, "avx2");
                if avx.is_wide() {
                    check(avx, true, "avx512");
                } else {
                    eprintln!("SKIPPED: avx512 part (this processor has no AVX-512 F)");
                }
            }
            None => eprintln!("SKIPPED: avx2 part (this processor has no AVX2/FMA/F16C)"),
        }
    }

    /// Value accumulation from packed codes (`Kernels::accumulate_codes`: AVX2's
    /// two-slice kernel for 3 and 4 heads, the four-slice one for 1 and 2, codes masked
    /// in place and scaled back) for every code shape, 1 to 16 heads and chunks of 1 to 64
    /// tokens, added to what `o` held: the portable kernel within 1e-6 of an f64 sum, the
    /// AVX2 ones bit for bit `o + (an f32 FMA chain over the tokens)`, as the shifted
    /// codes gave before the masks (the power-of-two scale-back is exact).
    #[test]
    fn value_accumulation_from_codes_matches_f64_and_the_fma_chain() {
        fn check<K: Kernels>(kern: K, exact_chain: bool, what: &str) {
            let mut seed = 1000;
            for (d, bits, gs) in code_shapes() {
                let cb = d * bits as usize / 8;
                let mut rows = vec![0f32; CHUNK * d];
                for g in [1, 2, 3, 4, 5, 6, 7, 8, 11, 16] {
                    for n in [1, 2, 7, 16, 33, 64] {
                        seed += 1;
                        let w: Vec<f32> = values(g * CHUNK, seed as u32).iter().map(|x| x * 0.5).collect();
                        let codes = random_bytes(n * cb, seed);
                        let o0: Vec<f32> = values(g * d, seed as u32 + 7).iter().map(|x| x * 5.0).collect();
                        let mut o = o0.clone();
                        for j in 0..d / gs {
                            kern.accumulate_codes(&mut o, &w, g, d, &codes, bits, n, j * gs, (j + 1) * gs, &mut rows);
                        }
                        for h in 0..g {
                            for c in 0..d {
                                let u = unpack_position(c, bits);
                                let (mut exact, mut mag, mut chain) = (o0[h * d + u] as f64, 0f64, 0f32);
                                mag += exact.abs();
                                for t in 0..n {
                                    let code = code_of(&codes[t * cb..(t + 1) * cb], c, bits);
                                    let x = w[h * CHUNK + t] as f64 * code as f64;
                                    exact += x;
                                    mag += x.abs();
                                    chain = w[h * CHUNK + t].mul_add(code as f32, chain);
                                }
                                let got = o[h * d + u];
                                let at = format!("{what}: d {d} bits {bits} gs {gs} g {g} n {n}: head {h} channel {c}");
                                assert!((got as f64 - exact).abs() <= 1e-6 * mag + 1e-9, "{at}: {got} vs {exact}");
                                if exact_chain {
                                    let want = o0[h * d + u] + chain;
                                    assert_eq!(got.to_bits(), want.to_bits(), "{at}: {got} vs {want}");
                                }
                            }
                        }
                    }
                }
            }
        }
        check(Portable, false, "portable");
        #[cfg(target_arch = "x86_64")]
        match Avx2::detect() {
            Some(avx) => {
                check(avx.narrow(), true, "avx2");
                if avx.is_wide() {
                    check(avx, true, "avx512");
                } else {
                    eprintln!("SKIPPED: avx512 part (this processor has no AVX-512 F)");
                }
            }
            None => eprintln!("SKIPPED: avx2 part (this processor has no AVX2/FMA/F16C)"),
        }
    }

    #[test]
    fn fwht_kernels_match_portable_bit_for_bit() {
        for n in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] {
            let x = values(n * 3, n as u32);
            for row in x.chunks_exact(n) {
                let (mut a, mut b) = (row.to_vec(), row.to_vec());
                fwht(&mut a);
                fwht_portable(&mut b);
                assert_eq!(
                    a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                // Each kernel set (`fwht` above takes the widest).
                #[cfg(target_arch = "x86_64")]
                if let Some(avx) = Avx2::detect() {
                    for (kern, name) in kernel_sets(avx) {
                        let mut c = row.to_vec();
                        kern.fwht(&mut c);
                        assert_eq!(
                            c.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "{name}, n {n}"
                        );
                    }
                }
                // And the definition (f64 reference).
                let mut r: Vec<f64> = row.iter().map(|&v| v as f64).collect();
                reference::fwht(&mut r);
                for (a, r) in a.iter().zip(&r) {
                    assert!((*a as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()), "n {n}: {a} vs {r}");
                }
            }
        }
    }

    /// Integer scores bit for bit equal between the portable, AVX2 and AVX-512 VNNI kernels (integer
    /// sums are exact), on random codes for every code width and group size.
    #[test]
    fn int_scores_match_between_kernels() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            let vnni = avx2::Vnni::detect();
            if vnni.is_none() {
                eprintln!("SKIPPED: the VNNI integer scores (this processor has no AVX-512 VNNI and VL)");
            }
            for (d, kb, gs) in [(64, 2, 32), (64, 2, 64), (128, 4, 32), (128, 2, 128), (256, 4, 256), (256, 2, 256)] {
                let fmt = Format {
                    head_dim: d,
                    key_bits: kb,
                    value_bits: 2,
                    group_size: gs,
                    page_size: 16,
                    sinks: 0,
                    window: 0,
                    key_clip: NO_CLIP,
                    value_clip: NO_CLIP,
                    protected: 0,
                    channel_norm: 0,
                };
                let cb = fmt.key_code_bytes() as usize;
                let codes: Vec<u8> = values(CHUNK * cb, 5).iter().map(|&x| (x * 1000.0) as i32 as u8).collect();
                // Head blocks of 1, 2, 3 and 4 (and 4 + 1, 4 + 2, 4 + 4).
                for (g, terms) in [1, 2, 3, 5, 6, 8].into_iter().flat_map(|g| [(g, 1), (g, 2)]) {
                    let iq = IntQuery::new(&fmt, &values(g * d as usize, 6), g, terms);
                    for n in [1, 2, 7, CHUNK] {
                        let (mut a, mut b) = (vec![0f32; g * CHUNK], vec![0f32; g * CHUNK]);
                        for j in 0..iq.groups {
                            Portable.dots_int(&iq, g, j, &codes, cb, n, &mut a);
                            avx.dots_int_with(None, &iq, g, j, &codes, cb, n, &mut b);
                            assert_eq!(a, b, "d{d} k{kb} g{gs} rows {g} terms {terms} n {n} group {j}");
                            if let Some(vnni) = vnni {
                                b.fill(0.0);
                                avx.dots_int_with(Some(vnni), &iq, g, j, &codes, cb, n, &mut b);
                                assert_eq!(a, b, "VNNI: d{d} k{kb} g{gs} rows {g} terms {terms} n {n} group {j}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Key scores of the f32 and integer (`terms` int8 terms) paths against f64 on the
    /// same stored pages: `(relative error f32, relative error integer, max |logit
    /// error| integer / logit RMS)`.
    fn score_errors(
        config: crate::CacheConfig,
        hkv: usize,
        k: &[f32],
        q: &[f32],
        sm_scale: f32,
        terms: usize,
    ) -> (f64, f64, f64) {
        use crate::paged::{self, LayerShape};
        let d = config.head_dim;
        let fmt = config.format().unwrap();
        let t = k.len() / (hkv * d);
        let hq = q.len() / d;
        let g = hq / hkv;
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
        let blocks = paged::blocks_for(&config, t).unwrap();
        let mut pool = paged::PoolBuffer::new(paged::pool_bytes(&config, &shape, blocks).unwrap());
        let mut side = vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
        let table: Vec<u32> = (0..blocks as u32).collect();
        let calib = LayerCalibration::identity(hkv, d);
        let backend = crate::Backend::Reference;
        paged::append(backend, &config, &calib, &shape, pool.bytes_mut(), &table, &mut side, &[], 0, t, k, k).unwrap();
        let pool = pool.bytes();
        let (mut e32, mut e8, mut r2, mut worst, mut n_all) = (0f64, 0f64, 0f64, 0f64, 0usize);
        let mask = (1u32 << fmt.key_bits) - 1;
        for h in 0..hkv {
            // Rotated queries with the softmax scale, f32 (as decode makes them) and f64.
            let q32: Vec<f32> = q[h * g * d..(h + 1) * g * d].iter().map(|x| x * sm_scale).collect();
            let mut qr = q32.clone();
            qr.chunks_exact_mut(d).for_each(fwht);
            let mut q64: Vec<f64> = q32.iter().map(|&x| x as f64).collect();
            q64.chunks_exact_mut(d).for_each(reference::fwht);
            for page in 0..fmt.pages_for(t as u32) {
                let at = fmt.page_offset(page, h as u32, hkv as u32);
                let bytes = &pool[at..at + fmt.page_bytes() as usize];
                let n = fmt.page_size as usize;
                let mut exact = HeadState::new(&fmt, &qr, g);
                exact.key_scores(Portable, &fmt, bytes, 0, n, &[]);
                let mut int = HeadState::new(&fmt, &qr, g).int_keys(&fmt, terms);
                int.key_scores(Portable, &fmt, bytes, 0, n, &[]);
                for slot in 0..n as u32 {
                    let kc = fmt.key_codes_at(slot) as usize;
                    let khat: Vec<f64> = (0..d)
                        .map(|c| {
                            let j = (c / fmt.group_size as usize) as u32;
                            let f = |o: u32| f16::from_le_bytes([bytes[o as usize], bytes[o as usize + 1]]).to_f64();
                            let per_byte = 8 / fmt.key_bits as usize;
                            let code =
                                (bytes[kc + c / per_byte] as u32 >> ((c % per_byte) as u32 * fmt.key_bits)) & mask;
                            code as f64 * f(fmt.scale_at(false, j, slot)) + f(fmt.zero_at(false, j, slot))
                        })
                        .collect();
                    for r in 0..g {
                        let want: f64 = q64[r * d..(r + 1) * d].iter().zip(&khat).map(|(a, b)| a * b).sum();
                        let (a, b) =
                            (exact.s[r * CHUNK + slot as usize] as f64, int.s[r * CHUNK + slot as usize] as f64);
                        e32 += (a - want).powi(2);
                        e8 += (b - want).powi(2);
                        r2 += want * want;
                        worst = worst.max((b - want).abs());
                        n_all += 1;
                    }
                }
            }
        }
        let rms = (r2 / n_all as f64).sqrt();
        ((e32 / r2).sqrt(), (e8 / r2).sqrt(), worst / rms)
    }

    /// The integer key paths' added score error, stated and bounded (random keys with
    /// an outlier channel and a bias; the real SmolLM2 tile where the `eval` feature can
    /// read it). The int8 query has a per-(row, group) scale `a = max|q| / 127`; its
    /// rounding error is uniform in `+-a/2` per channel, so the score error is about
    /// `a / sqrt(12) * ||khat||`: measured 0.6-1.2% of the scores' norm on the real tile
    /// and 1.0-2.6% on random keys (whose scores are small next to `||q|| ||khat||`), the
    /// largest single logit error 2-7% of the logits' RMS. Bounds: 4e-2 and 0.15. Two
    /// int8 terms (`Int8x2`) cut the query's rounding 254-fold: bounds 4e-4 and 2e-3.
    /// The f32 path: 1e-5 (accumulation order only).
    #[test]
    fn int_key_scores_error_against_f64() {
        let check = |name: &str, config: crate::CacheConfig, hkv: usize, k: &[f32], q: &[f32], sm: f32| {
            for (terms, tol, tol_worst) in [(1, 4e-2, 0.15), (2, 4e-4, 2e-3)] {
                let (e32, e8, worst) = score_errors(config, hkv, k, q, sm, terms);
                eprintln!(
                    "{name}: score rel err f32 {e32:.2e}, int8 x{terms} {e8:.2e}, max |logit err| / logit RMS {worst:.2e}"
                );
                assert!(e32 < 1e-5, "{name}: f32 path {e32}");
                assert!(e8 < tol, "{name}: int8 x{terms} path {e8}");
                assert!(worst < tol_worst, "{name}: int8 x{terms} worst logit {worst}");
            }
        };
        for (d, config) in [
            (64, crate::CacheConfig::k2v2(64)),
            (128, crate::CacheConfig { group_size: 32, ..crate::CacheConfig::k4v2(128) }),
            (256, crate::CacheConfig::k2v2(256)),
            (256, crate::CacheConfig { group_size: 256, ..crate::CacheConfig::k4v2(256) }),
        ] {
            let (hkv, g, t) = (3, 3, 4 + 128 + 2 * 64 + 1);
            let mut k = values(t * hkv * d, 11);
            k.iter_mut().enumerate().for_each(|(i, x)| *x += if i % d == 7 { 6.0 } else { 0.5 });
            let q = values(hkv * g * d, 12);
            check(
                &format!("random d{d} k{} g{}", config.key_bits, config.group_size),
                config,
                hkv,
                &k,
                &q,
                1.0 / (d as f32).sqrt(),
            );
        }
        #[cfg(feature = "eval")]
        {
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            let files = [
                root.join("data/smollm2-alice-kv-l0-l5.safetensors"),
                root.join("../shared/data/smollm2-alice-kv.safetensors"),
            ];
            for file in files.iter().filter(|f| f.exists()) {
                let tile = crate::eval::Tile::load(file).unwrap();
                for l in &tile.layers {
                    let (hkv, hq, d) = (l.num_kv_heads, l.num_q_heads, l.head_dim);
                    let t = l.tokens.min(1024);
                    let q = &l.q[(t - 1) * hq * d..t * hq * d];
                    for config in [crate::CacheConfig::k2v2(d), crate::CacheConfig::k4v2(d)] {
                        let name = format!("tile layer {} k{}", l.layer, config.key_bits);
                        check(&name, config, hkv, &l.k[..t * hkv * d], q, tile.attn_scaling as f32);
                    }
                }
            }
        }
    }

    /// Rows that exercise the threshold quantizer: random values, a coarse grid (whose
    /// values sit exactly on rounding ties `z + (k + 1/2) s` again and again), constant
    /// groups, huge outliers, the ends of the f16 range, subnormals and signed zeros.
    fn awkward_rows(d: usize, seed: u32) -> Vec<Vec<f16>> {
        let r = values(16 * d, seed);
        let mut rows: Vec<Vec<f16>> = Vec::new();
        rows.push(r[..d].iter().map(|&x| f16::from_f32(x)).collect());
        rows.push(r[d..2 * d].iter().map(|&x| f16::from_f32((x * 6.0).round() / 4.0)).collect());
        rows.push(r[2 * d..3 * d].iter().map(|&x| f16::from_f32((x * 8.0).round() * 0.375 - 3.0)).collect());
        rows.push(vec![f16::from_f32(-1.25); d]);
        rows.push((0..d).map(|c| f16::from_f32(if c % 37 == 5 { 3000.0 } else { r[3 * d + c] })).collect());
        rows.push((0..d).map(|c| if c % 2 == 0 { f16::MAX } else { f16::MIN }).collect());
        rows.push((0..d).map(|c| f16::from_bits((r[4 * d + c].to_bits() & 0x83ff) as u16)).collect());
        rows.push(
            (0..d).map(|c| if c % 3 == 0 { f16::NEG_ZERO } else { f16::from_f32(r[5 * d + c] * 1e-3) }).collect(),
        );
        rows.push((0..d).map(|c| f16::from_f32((c % 4) as f32)).collect());
        // Zeros of both signs: as the extremes of a group, and as a whole group.
        rows.push((0..d).map(|c| if c % 2 == 0 { f16::NEG_ZERO } else { f16::ZERO }).collect());
        rows.push(
            (0..d)
                .map(|c| {
                    if c % 5 == 1 {
                        f16::ZERO
                    } else if c % 5 == 2 {
                        f16::NEG_ZERO
                    } else {
                        f16::from_f32(r[6 * d + c].abs() + 0.1)
                    }
                })
                .collect(),
        );
        rows.push(
            (0..d)
                .map(|c| {
                    if c % 3 == 1 {
                        f16::NEG_ZERO
                    } else if c % 3 == 2 {
                        f16::ZERO
                    } else {
                        f16::from_f32(-r[7 * d + c].abs() - 0.1)
                    }
                })
                .collect(),
        );
        rows
    }

    /// The one-pass staging of a Hadamard row ([`Kernels::stage_hadamard`], AVX2) writes
    /// the f16 row of [`stage_input`] bit for bit (f32, f16 and bf16 input; keys as they
    /// are, centered, centered and scaled; head_dim 64 and 128; groups of 32 to 128), the
    /// ranges [`Kernels::group_ranges`] finds in it, and the squared norm of
    /// [`load_affine`] to f32 rounding (1e-5 relative; it only picks the rows for the exact
    /// test). A row with a huge outlier is among them. The pair pass
    /// ([`Kernels::stage_hadamard_pair`], where the kernel set has one) writes what two
    /// calls write, norms included.
    #[test]
    fn one_pass_staging_writes_the_staged_row() {
        #[cfg(target_arch = "x86_64")]
        fn run<T: KvElement>(avx: Avx2, conv: impl Fn(f32) -> T, pairs: &mut usize) {
            // The 512-bit pass also takes rows of 256.
            let dims: &[usize] = if avx.is_wide() { &[64, 128, 256] } else { &[64, 128] };
            for &d in dims {
                let mean = values(d, 7);
                let scale: Vec<f32> = values(d, 8).iter().map(|v| 1.0 + v.abs()).collect();
                for (a, affine) in
                    [KeyAffine::None, KeyAffine::Center(&mean), KeyAffine::Full(&mean, &scale)].into_iter().enumerate()
                {
                    for (i, mut row) in (0..6).map(|i| (i, values(d, 100 + i as u32))) {
                        if i == 5 {
                            row[d / 3] = 3.0e4;
                        }
                        let src: Vec<T> = row.iter().map(|&v| conv(v)).collect();
                        let (mut x, mut y, mut want) = (vec![0f32; d], vec![0f32; d], vec![f16::ZERO; d]);
                        // The expected row from the portable kernels (the FWHT of neither set).
                        let norm = stage_input(
                            Portable,
                            &src,
                            affine,
                            HeadRotation::Hadamard,
                            None,
                            &mut x,
                            &mut y,
                            &mut want,
                        );
                        for g in [32usize, 64, 128, 256].into_iter().filter(|&g| g <= d) {
                            let mut got = vec![f16::ONE; d];
                            let mut ranges = vec![(f32::NAN, f32::NAN); d / g];
                            let fast = avx.stage_hadamard(&src, affine, g, &mut got, &mut ranges).expect("one pass");
                            let what = format!(
                                "{} d{d} affine {a} row {i} g{g}",
                                if avx.is_wide() { "avx512" } else { "avx2" }
                            );
                            assert_eq!(
                                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                "{what}"
                            );
                            let mut found = vec![(0f32, 0f32); d / g];
                            avx.group_ranges(&want, g, &mut found);
                            assert_eq!(ranges, found, "{what}");
                            assert!((fast - norm).abs() <= 1e-5 * norm, "{what}: {fast} vs {norm}");
                            // The pair pass: the same bytes and norms as two calls (the
                            // value row without an affine), where the kernel set has one.
                            let vsrc: Vec<T> = values(d, 200 + i as u32).iter().map(|&v| conv(v)).collect();
                            let (mut vwant, mut vranges) = (vec![f16::ONE; d], vec![(f32::NAN, f32::NAN); d / g]);
                            let vnorm = avx
                                .stage_hadamard(&vsrc, KeyAffine::None, g, &mut vwant, &mut vranges)
                                .expect("one pass");
                            let (mut pk, mut pv) = (vec![f16::ZERO; d], vec![f16::ZERO; d]);
                            let (mut pkr, mut pvr) = (vec![(0f32, 0f32); d / g], vec![(0f32, 0f32); d / g]);
                            let bits = |r: &[f16]| r.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            match avx.stage_hadamard_pair(
                                &src,
                                affine,
                                &vsrc,
                                g,
                                (&mut pk, &mut pkr),
                                (&mut pv, &mut pvr),
                            ) {
                                Some((nk, nv)) => {
                                    assert_eq!((bits(&pk), &pkr), (bits(&got), &ranges), "{what}: pair, key");
                                    assert_eq!((bits(&pv), &pvr), (bits(&vwant), &vranges), "{what}: pair, value");
                                    assert_eq!(
                                        (nk.to_bits(), nv.to_bits()),
                                        (fast.to_bits(), vnorm.to_bits()),
                                        "{what}"
                                    );
                                    *pairs += 1;
                                }
                                None => assert!(d == 256, "{what}: no pair pass"),
                            }
                        }
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(avx) = Avx2::detect() {
            let mut pairs = 0;
            for (avx, _) in kernel_sets(avx) {
                run::<f32>(avx, |v| v, &mut pairs);
                run::<f16>(avx, f16::from_f32, &mut pairs);
                run::<half::bf16>(avx, half::bf16::from_f32, &mut pairs);
            }
            assert!(pairs > 0, "the pair pass never ran");
            return;
        }
        println!("SKIPPED: no AVX2, FMA and F16C on this processor");
    }

    /// Both kernel sets' page quantizers (`Kernels::quantize_rows`; the 512-bit one where
    /// the processor has it) write the portable quantizer's bytes on every branch they
    /// have: item counts that leave a short last block (13 rows of 1, 3 or 8 groups),
    /// constant groups, groups whose range ends at a zero of either sign (the scalar
    /// parameters), made-up ranges past the f16 range or infinite (thresholds that are
    /// not finite: the row goes to the portable quantizer, whose divisions give the codes
    /// the compares would give, so that branch only keeps the pass total), and rows
    /// holding an infinity or a NaN whose range ends at a zero (the portable quantizer
    /// from the scalar branch; it fails when that row is left to the compares). The
    /// ranges given are always ordered (`lo <= hi`), as the quantizers require.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn page_quantizers_match_portable_on_every_branch() {
        let Some(avx) = Avx2::detect() else {
            println!("SKIPPED: no AVX2, FMA and F16C on this processor");
            return;
        };
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let made_up = [f32::NEG_INFINITY, -70000.0, -65520.0, -65504.0, 0.5, 65504.0, 65520.0, 70000.0, f32::INFINITY];
        let mut cases = 0;
        for (d, g) in [(128usize, 128usize), (96, 32), (256, 32), (128, 64)] {
            let groups = d / g;
            for bits in [2u32, 4] {
                for clip in [NO_CLIP, 52_429] {
                    for round in 0..12 {
                        let n = 13;
                        let mut rows: Vec<f16> = (0..n * d)
                            .map(|_| f16::from_bits((next() % 0x7800) as u16 | (next() as u16 & 0x8000)))
                            .collect();
                        let mut ranges = vec![(0f32, 0f32); n * groups];
                        for (i, x) in rows.chunks_exact_mut(g).enumerate() {
                            match (i + round) % 7 {
                                // A constant group.
                                1 => x.fill(f16::from_f32(1.5)),
                                // Non-negative, with an exact zero as its min; non-positive
                                // with a negative zero as its max.
                                2 => x.iter_mut().enumerate().for_each(|(c, v)| {
                                    *v = if c == 3 { f16::ZERO } else { f16::from_bits(v.to_bits() & 0x7fff) }
                                }),
                                3 => x.iter_mut().enumerate().for_each(|(c, v)| {
                                    *v = if c == 5 { f16::NEG_ZERO } else { f16::from_bits(v.to_bits() | 0x8000) }
                                }),
                                _ => {}
                            }
                            group_ranges_portable(x, g, std::slice::from_mut(&mut ranges[i]));
                            match (i + 2 * round) % 11 {
                                // A made-up ordered range, often past f16 or infinite.
                                4 | 9 => {
                                    let (a, b) = (made_up[next() as usize % 9], made_up[next() as usize % 9]);
                                    ranges[i] = (a.min(b), a.max(b));
                                }
                                // A value that is not finite, and a range ending at zero.
                                6 => {
                                    x[next() as usize % g] =
                                        [f16::INFINITY, f16::NEG_INFINITY, f16::NAN][next() as usize % 3];
                                    ranges[i] = if next() & 1 == 0 { (0.0, 7.0) } else { (-7.0, -0.0) };
                                }
                                _ => {}
                            }
                        }
                        let (cb, pb) = (d * bits as usize / 8, 4 * groups);
                        let (mut want_c, mut want_p) = (vec![0u8; n * cb], vec![0u8; n * pb]);
                        for r in 0..n {
                            quantize_row_portable(
                                &rows[r * d..(r + 1) * d],
                                bits,
                                g,
                                clip,
                                &ranges[r * groups..(r + 1) * groups],
                                &mut want_c[r * cb..(r + 1) * cb],
                                &mut want_p[r * pb..(r + 1) * pb],
                            );
                        }
                        for (kern, name) in kernel_sets(avx) {
                            let (mut c, mut p) = (vec![0xa5u8; n * cb], vec![0x5au8; n * pb]);
                            kern.quantize_rows(&rows, d, bits, g, clip, &ranges, &mut c, &mut p);
                            let what = format!("{name} d{d} g{g} bits {bits} clip {clip} round {round}");
                            for r in 0..n {
                                assert_eq!(
                                    (&c[r * cb..(r + 1) * cb], &p[r * pb..(r + 1) * pb]),
                                    (&want_c[r * cb..(r + 1) * cb], &want_p[r * pb..(r + 1) * pb]),
                                    "{what}, row {r}, ranges {:?}",
                                    &ranges[r * groups..(r + 1) * groups]
                                );
                            }
                            cases += 1;
                        }
                    }
                }
            }
        }
        assert!(cases >= 192, "{cases} cases");
    }

    /// Both kernel sets' codes equal the count of thresholds at or below each value,
    /// packed as `pack_into` packs them, for crafted thresholds: equal ones (ties after
    /// rounding), `+inf` tails, all `+inf` (a constant group), values exactly on a
    /// threshold, zeros of both signs; every group size, both code widths.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn codes_match_the_threshold_count_on_crafted_thresholds() {
        let Some(avx) = Avx2::detect() else {
            println!("SKIPPED: no AVX2, FMA and F16C on this processor");
            return;
        };
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        let mut cases = 0;
        for bits in [2u32, 4] {
            let levels = (1usize << bits) - 1;
            for g in [32usize, 64, 128, 256] {
                for case in 0..200 {
                    // A few distinct f16 values that the thresholds and the group share.
                    let grid: Vec<f32> = (0..6).map(|_| f16::from_bits((next() % 0x7c00) as u16).to_f32()).collect();
                    let pick = |r: u64| {
                        let v = grid[r as usize % grid.len()];
                        if r >> 8 & 1 == 1 { -v } else { v }
                    };
                    let mut th: Vec<f32> = (0..levels).map(|_| pick(next())).collect();
                    th.sort_by(f32::total_cmp);
                    match case % 4 {
                        // A +inf tail, or all +inf (a constant group's thresholds).
                        1 => th.iter_mut().skip(levels / 2).for_each(|t| *t = f32::INFINITY),
                        2 => th.fill(f32::INFINITY),
                        // All equal.
                        3 => {
                            let t = th[levels / 2];
                            th.fill(t);
                        }
                        _ => {}
                    }
                    let x: Vec<f16> = (0..g)
                        .map(|i| match next() % 4 {
                            0 => f16::from_f32(th[i % levels]),
                            1 => f16::from_bits((next() % 0x7c00) as u16 | (next() as u16 & 0x8000)),
                            2 => {
                                if i % 2 == 0 {
                                    f16::ZERO
                                } else {
                                    f16::NEG_ZERO
                                }
                            }
                            _ => f16::from_f32(pick(next())),
                        })
                        .filter(|v| v.is_finite())
                        .chain(std::iter::repeat(f16::ONE))
                        .take(g)
                        .collect();
                    let count: Vec<u8> =
                        x.iter().map(|v| th.iter().filter(|&&t| t <= v.to_f32()).count() as u8).collect();
                    let mut want = vec![0u8; g * bits as usize / 8];
                    pack_into(&count, bits, &mut want);
                    for (kern, name) in kernel_sets(avx) {
                        let mut got = vec![0x5au8; want.len()];
                        kern.group_codes(&x, &th, bits, &mut got);
                        assert_eq!(got, want, "{name}: {bits}-bit, g {g}, case {case}, thresholds {th:?}");
                    }
                    cases += 1;
                }
            }
        }
        assert_eq!(cases, 1600);
    }

    /// The prefetches reach every cache line a slice touches, from the line its first
    /// byte is in, whatever the slice's offset in its line and its length (a page of a
    /// 16-byte aligned pool, an input row a token stride from the last), and no other.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn prefetches_cover_every_line_a_slice_touches() {
        let buf = vec![0u8; 1024];
        for start in 0..130 {
            for len in [0, 1, 15, 16, 48, 63, 64, 65, 127, 128, 129, 256, 300, 640] {
                let s = &buf[start..start + len];
                let got: Vec<usize> = avx2::lines(s).map(|p| p as usize / 64).collect();
                let a = s.as_ptr() as usize;
                let want: Vec<usize> = if len == 0 { vec![] } else { (a / 64..=(a + len - 1) / 64).collect() };
                assert_eq!(got, want, "offset {start}, {len} bytes");
            }
        }
    }

    /// The AVX2 and 512-bit quantizers' vector roundings agree with the scalar ones for
    /// every kind of input: f64 to f16 to nearest even (`f64x4_to_f16` against [`f64_to_f16`]) and f64
    /// up to f32 (`f64x4_up_to_f32` against `as f32` and `next_up`): random values over
    /// the f16 range and beyond, exact f16 midpoints and their f64 neighbours, f16 and f32
    /// subnormals, zeros of both signs, values past f16 and f32 overflow.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_roundings_match_scalar() {
        use std::arch::x86_64::*;
        let Some(_) = Avx2::detect() else {
            println!("SKIPPED: no AVX2, FMA and F16C on this processor");
            return;
        };
        let mut xs = vec![0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e300, -1e300, 3.0e38, 4.0e38];
        xs.extend([f64::INFINITY, f64::NEG_INFINITY, f64::NAN]);
        xs.extend([
            f64::MIN_POSITIVE,
            5e-324,
            2f64.powi(-24),
            2f64.powi(-25),
            2f64.powi(-25) * 1.0000001,
            2f64.powi(-26),
        ]);
        for b in (0..0x7c00u16).step_by(7) {
            // Each f16 and the midpoint above it, exactly and one f64 step off either way.
            let (a, c) = (f16::from_bits(b).to_f64(), f16::from_bits(b + 1).to_f64());
            let mid = (a + c) / 2.0;
            for x in [a, mid, mid.next_up(), mid.next_down(), (mid as f32) as f64] {
                xs.extend([x, -x]);
            }
        }
        let mut seed = 0x2545_f491u64;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let e = (seed >> 52) as i32 % 60 - 40;
            xs.push(
                f64::from_bits(seed >> 12 | 0x3ff0_0000_0000_0000)
                    * 2f64.powi(e)
                    * if seed & 1 == 0 { 1.0 } else { -1.0 },
            );
        }
        xs.truncate(xs.len() / 4 * 4);
        for x in xs.chunks_exact(4) {
            // SAFETY: AVX2, FMA and F16C were detected above; four f64 read.
            let (h, up) = unsafe {
                let v = _mm256_loadu_pd(x.as_ptr());
                let mut up = [0f32; 4];
                _mm_storeu_ps(up.as_mut_ptr(), avx2::f64x4_up_to_f32(v));
                (avx2::f64x4_to_f16(v), up)
            };
            for l in 0..4 {
                assert_eq!(h[l], f64_to_f16(x[l]), "f16 of {:e} ({:#x})", x[l], x[l].to_bits());
                let mut want = x[l] as f32;
                if (want as f64) < x[l] {
                    want = want.next_up();
                }
                assert_eq!(up[l].to_bits(), want.to_bits(), "f32 up of {:e}", x[l]);
            }
        }
        // The 512-bit quantizer's roundings (rounding modes of the conversion itself).
        let Some(z) = avx512::Avx512::detect().filter(|_| !isa_is_avx2()) else {
            println!("SKIPPED: the 512-bit roundings (no AVX-512 F, or ROTKV_CPU_ISA=avx2)");
            return;
        };
        xs.truncate(xs.len() / 8 * 8);
        for x in xs.chunks_exact(8) {
            let (h, up) = z.roundings(x.try_into().expect("eight"));
            for l in 0..8 {
                assert_eq!(h[l], f64_to_f16(x[l]), "512-bit f16 of {:e} ({:#x})", x[l], x[l].to_bits());
                let mut want = x[l] as f32;
                if (want as f64) < x[l] {
                    want = want.next_up();
                }
                assert_eq!(up[l].to_bits(), want.to_bits(), "512-bit f32 up of {:e}", x[l]);
            }
        }
    }

    /// [`quantize_into_page`] on `rows` at slots `slot..`, with the ranges the kernel set
    /// finds.
    fn quantize_rows_into<K: Kernels>(
        kern: K,
        fmt: &Format,
        rows: &[Vec<f16>],
        value: bool,
        slot: u32,
        bytes: &mut [u8],
    ) {
        let g = fmt.group_size as usize;
        let flat: Vec<f16> = rows.concat();
        let mut ranges = vec![(0f32, 0f32); rows.len() * fmt.groups() as usize];
        for (row, rg) in flat.chunks_exact(fmt.head_dim as usize).zip(ranges.chunks_exact_mut(fmt.groups() as usize)) {
            kern.group_ranges(row, g, rg);
        }
        let mut params = vec![0u8; rows.len() * fmt.param_bytes() as usize];
        quantize_into_page(kern, fmt, &flat, &ranges, value, slot, bytes, &mut params);
    }

    /// The fused append's quantizer (threshold comparisons, [`group_codes`]) writes the
    /// bytes of the reference's f64 division quantizer for every row, exact ties
    /// included (the test counts them: it must meet some), with both kernel sets, a row
    /// at a time and a page at a time (pages of 64 rows: four of the AVX2 quantizer's
    /// blocks of 16, the awkward rows spread over all of them, and a partial page).
    #[test]
    fn threshold_quantizer_matches_reference_bit_for_bit() {
        let mut ties = 0;
        for (d, kb, vb, gs, clip) in [
            (64, 2, 4, 32, NO_CLIP),
            (128, 2, 2, 128, 52_429),
            (128, 4, 2, 64, NO_CLIP),
            (256, 4, 4, 256, 40_000),
            (256, 2, 4, 32, NO_CLIP),
            (128, 4, 4, 128, NO_CLIP),
            (256, 2, 2, 256, 52_429),
        ] {
            let fmt = Format {
                head_dim: d,
                key_bits: kb,
                value_bits: vb,
                group_size: gs,
                page_size: 64,
                sinks: 0,
                window: 0,
                key_clip: clip,
                value_clip: NO_CLIP,
                protected: 0,
                channel_norm: 0,
            };
            let d = d as usize;
            let rows = awkward_rows(d, d as u32 + kb + gs);
            for (i, row) in rows.iter().enumerate() {
                let x: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
                for value in [false, true] {
                    let bits = fmt.bits(value);
                    let slot = (i % 64) as u32;
                    let (mut codes, mut params) =
                        (vec![0u8; fmt.code_bytes(value) as usize], vec![0u8; fmt.param_bytes() as usize]);
                    reference::quantize_row(&x, bits, gs as usize, fmt.clip(value), &mut codes, &mut params);
                    for (j, g) in x.chunks_exact(gs as usize).enumerate() {
                        let s = f16::from_le_bytes([params[4 * j], params[4 * j + 1]]).to_f64();
                        let z = f16::from_le_bytes([params[4 * j + 2], params[4 * j + 3]]).to_f64();
                        ties += g.iter().filter(|&&v| s > 0.0 && ((v - z) / s).fract().abs() == 0.5).count();
                    }
                    let check = |bytes: &[u8], kernels: &str| {
                        let c = fmt.codes_at(value, slot) as usize;
                        assert_eq!(
                            &bytes[c..c + codes.len()],
                            &codes[..],
                            "{kernels} codes, d{d} k{kb} v{vb} g{gs} row {i} value {value}"
                        );
                        assert_eq!(reference::page_params(&fmt, bytes, value, slot), params, "{kernels} params");
                    };
                    let one = std::slice::from_ref(row);
                    let mut bytes = vec![0xAAu8; fmt.page_bytes() as usize];
                    quantize_rows_into(Portable, &fmt, one, value, slot, &mut bytes);
                    check(&bytes, "portable");
                    #[cfg(target_arch = "x86_64")]
                    if let Some(avx) = Avx2::detect() {
                        for (avx, name) in kernel_sets(avx) {
                            let mut bytes = vec![0x55u8; fmt.page_bytes() as usize];
                            quantize_rows_into(avx, &fmt, one, value, slot, &mut bytes);
                            check(&bytes, name);
                        }
                    }
                }
            }
            // A page at a time: every slot's bytes as the same kernel set writes them a
            // row at a time (so, by the loop above, the reference's).
            for value in [false, true] {
                // 104 rows: the awkward ones, each also with its channels rotated.
                let many: Vec<Vec<f16>> = (0..104)
                    .map(|i| {
                        let mut r = rows[i % rows.len()].clone();
                        r.rotate_left(i / rows.len() * 7 % d);
                        r
                    })
                    .collect();
                for page in many.chunks(64) {
                    let slot = (64 - page.len()) as u32;
                    let mut one_by_one = vec![0x33u8; fmt.page_bytes() as usize];
                    for (i, row) in page.iter().enumerate() {
                        quantize_rows_into(
                            Portable,
                            &fmt,
                            std::slice::from_ref(row),
                            value,
                            slot + i as u32,
                            &mut one_by_one,
                        );
                    }
                    let mut bytes = vec![0x33u8; fmt.page_bytes() as usize];
                    quantize_rows_into(Portable, &fmt, page, value, slot, &mut bytes);
                    assert_eq!(bytes, one_by_one, "portable page, d{d} k{kb} v{vb} g{gs} value {value}");
                    #[cfg(target_arch = "x86_64")]
                    if let Some(avx) = Avx2::detect() {
                        for (avx, name) in kernel_sets(avx) {
                            let mut bytes = vec![0x33u8; fmt.page_bytes() as usize];
                            quantize_rows_into(avx, &fmt, page, value, slot, &mut bytes);
                            assert_eq!(bytes, one_by_one, "{name} page, d{d} k{kb} v{vb} g{gs} value {value}");
                        }
                    }
                }
            }
        }
        assert!(ties > 100, "only {ties} exact ties met");
    }

    /// The AVX2 dense rotation (learned rotations' `x R`), one row and many rows at a
    /// time, gives the scalar loop's bits for every shape the blocks meet (64- and
    /// 8-output blocks and a scalar rest for one row; four rows against 16 outputs and the
    /// rows left over for many), signed zeros and a zero row included.
    #[test]
    fn dense_rotation_matches_scalar_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            for (seed, d) in [1usize, 5, 8, 24, 64, 72, 100, 128, 136, 256].into_iter().enumerate() {
                let r = values(d * d, 40 + seed as u32);
                let mut rows = vec![values(d, 80 + seed as u32), vec![0.0; d], vec![-0.0; d]];
                // Large and small magnitudes, so that the order of the additions shows.
                rows.push(
                    values(d, 90 + seed as u32)
                        .iter()
                        .enumerate()
                        .map(|(i, v)| v * 8f32.powi(i as i32 % 9 - 4))
                        .collect(),
                );
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                for x in &rows {
                    let (mut a, mut b) = (vec![f32::NAN; d], vec![f32::NAN; d]);
                    dense_rotate(x, &r, &mut a);
                    avx.dense_rotate(x, &r, &mut b);
                    assert_eq!(bits(&a), bits(&b), "d {d}");
                }
                // Many rows at once (four at a time, then the rest), against row by row.
                for n in [1, 3, 4, 5, 8, 11] {
                    let x: Vec<f32> =
                        (0..n).flat_map(|i| rows[i % rows.len()].iter().map(move |v| v * (i + 1) as f32)).collect();
                    let mut a = vec![f32::NAN; n * d];
                    for (xr, o) in x.chunks_exact(d).zip(a.chunks_exact_mut(d)) {
                        dense_rotate(xr, &r, o);
                    }
                    let mut b = vec![f32::NAN; n * d];
                    avx.dense_rotate_rows(&x, &r, d, &mut b);
                    assert_eq!(bits(&a), bits(&b), "d {d}, {n} rows");
                }
            }
        }
    }

    /// The fused softmax weights ([`Kernels::exp_weights`]: AVX2, and AVX-512 where the
    /// processor has it) for every length from 0 to 70 (whole 16- and 8-token blocks and
    /// tails), masked scores included: the weights bit for bit `exp_sum`'s `p` times the
    /// scale, the sum `exp_sum`'s bits, the zero sum within 1e-6 of f64, and the 512-bit
    /// kernels' bits those of the 256-bit ones.
    #[test]
    fn fused_softmax_weights_match_exp_sum() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            for n in 0..=70usize {
                let mut scores: Vec<f32> = values(n, 7 + n as u32).iter().map(|x| x * 6.0).collect();
                if n > 5 {
                    scores[n / 2] = f32::NEG_INFINITY;
                }
                let m = scores.iter().copied().fold(-1.0f32, f32::max) + 0.25;
                let scales: Vec<f32> = values(n, 300 + n as u32).iter().map(|x| x.abs() + 0.01).collect();
                let zeros = values(n, 600 + n as u32);
                let mut p = scores.clone();
                let l_want = avx.narrow().exp_sum(&mut p, m);
                let mut first: Option<(Vec<u32>, u32, u32)> = None;
                for (kern, what) in kernel_sets(avx) {
                    let mut s = scores.clone();
                    let mut w = vec![f32::NAN; n];
                    let (l, z) = kern.exp_weights(&mut s, m, &scales, &zeros, &mut w);
                    assert_eq!(l.to_bits(), l_want.to_bits(), "{what} n {n}: sum");
                    for i in 0..n {
                        assert_eq!(w[i].to_bits(), (p[i] * scales[i]).to_bits(), "{what} n {n}: weight {i}");
                    }
                    let z_want: f64 = p.iter().zip(&zeros).map(|(&p, &z)| p as f64 * z as f64).sum();
                    let mag: f64 = p.iter().zip(&zeros).map(|(&p, &z)| (p as f64 * z as f64).abs()).sum();
                    assert!((z as f64 - z_want).abs() <= 1e-6 * mag + 1e-30, "{what} n {n}: zero sum {z} vs {z_want}");
                    let bits = (w.iter().map(|x| x.to_bits()).collect(), l.to_bits(), z.to_bits());
                    match &first {
                        None => first = Some(bits),
                        Some(f) => assert!(*f == bits, "{what} n {n}: bits differ from avx2"),
                    }
                }
            }
        }
    }

    /// The AVX2 softmax exponential ([`avx2::exp8`]): relative error at most 2.5e-7
    /// against f64 over `[-87, 20]` (measured 1.8e-7 in an f32 emulation of the same
    /// steps; the softmax needs about 1e-6), 0 below -87 and for `-inf`, and
    /// `exp_sum`'s weights and sum over awkward lengths agree with the portable kernel.
    #[test]
    fn fast_exp_is_accurate() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            let xs: Vec<f32> = (0..=1_070_000).map(|i| -87.0 + i as f32 * 1e-4).chain([0.0, -0.0, 20.0]).collect();
            let mut worst = 0f64;
            for c in xs.chunks(8) {
                let mut y = c.to_vec();
                let sum = avx.exp_sum(&mut y, 0.0);
                let mut want_sum = 0f64;
                for (&x, &y) in c.iter().zip(&y) {
                    let want = (x as f64).exp();
                    want_sum += want;
                    worst = worst.max((y as f64 - want).abs() / want);
                }
                assert!((sum as f64 - want_sum).abs() <= 1e-6 * want_sum, "sum {sum} vs {want_sum}");
            }
            assert!(worst <= 2.5e-7, "worst relative error {worst}");
            let mut y = [f32::NEG_INFINITY, -87.5, -1000.0, f32::MIN, -0.5];
            let sum = avx.exp_sum(&mut y, 0.0);
            assert_eq!(&y[..4], &[0.0; 4]);
            assert!((sum - (-0.5f32).exp()).abs() < 1e-7);
            // Both kernel sets over lengths that leave tails, with a shifted max. The portable
            // kernel computes `exp(x - 20) * e^20`, and rounding `x - 20` costs it up to
            // `|x - 20| * 6e-8` relative: that (plus 5e-7) is the tolerance here.
            for n in [1, 7, 8, 9, 63, 64] {
                let s: Vec<f32> = values(n, n as u32).iter().map(|x| x * 10.0 + 3.0).collect();
                let (mut a, mut b) = (s.clone(), s.clone());
                let (sa, sb) = (Portable.exp_sum(&mut a, 5.0), avx.exp_sum(&mut b, 5.0));
                assert!((sa - sb).abs() <= 2e-6 * sa, "n {n}: {sa} vs {sb}");
                for ((x, y), arg) in a.iter().zip(&b).zip(&s) {
                    let tol = ((arg - 5.0 - 20.0).abs() * 6e-8 + 5e-7) * x;
                    assert!((x - y).abs() <= tol, "n {n}: {x} vs {y}");
                }
            }
            eprintln!("fast exp: worst relative error {worst:.2e} over [-87, 20]");
        }
    }

    #[test]
    fn exp_neg_is_accurate() {
        for i in 0..=19_000 {
            let x = -(i as f32) * 0.0045;
            let (a, b) = (exp_neg(x) as f64, (x as f64).exp());
            assert!((a - b).abs() <= 3e-7 * b, "exp({x}) = {a}, want {b}");
        }
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(-100.0), 0.0);
        assert!((exp_shifted(20.0) / 485_165_195.4 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn unpack_order_is_a_permutation_within_groups() {
        for bits in [2, 4] {
            let mut seen = vec![false; 256];
            for c in 0..256 {
                let u = unpack_position(c, bits);
                assert!(!seen[u] && u / 32 == c / 32);
                seen[u] = true;
            }
            // unpack() puts channel c's code at unpack_position(c).
            let codes: Vec<u8> = (0..64).map(|c| (c % (1 << bits)) as u8).collect();
            let packed = reference::pack_codes(&codes, bits);
            let mut out = vec![0f32; 64];
            unpack(&packed, bits, &mut out);
            for (c, &code) in codes.iter().enumerate() {
                assert_eq!(out[unpack_position(c, bits)], code as f32);
            }
        }
    }

    #[test]
    fn default_splits_keep_threads_busy_and_splits_long() {
        assert_eq!(default_splits(100, 1, 1, 2), 1);
        assert_eq!(default_splits(32768, 8, 8, 2), 1);
        assert_eq!(default_splits(32768, 1, 1, 16), 64);
        assert_eq!(default_splits(4096, 1, 2, 4), 8);
        assert!(default_splits(1 << 20, 1, 1, 1) <= 64);
    }
}
