//! The quantizer: group ranges and parameters, codes against thresholds, packing.

use super::*;

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
pub(super) fn group_codes<const LEVELS: usize>(x: &[f32], s: f64, z: f64, out: &mut [u8]) -> bool {
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
pub(super) fn threshold(z: f64, s: f64, k: usize) -> Option<f32> {
    let exact = z + (k as f64 + 0.5) * s;
    if !exact.is_finite() {
        return None;
    }
    let r = exact as f32;
    Some(if (r as f64) < exact { r.next_up() } else { r })
}

/// Packs codes (`bits` each) little-end first into bytes (docs/src/format.md).
#[inline(always)]
pub(super) fn pack_into(codes: &[u8], bits: u32, out: &mut [u8]) {
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
pub(super) fn group_params(x: &[f16], lo: f32, hi: f32, bits: u32, clip_q16: u32) -> (f16, f16) {
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
pub(super) fn zero_end_params(
    x: &[f16],
    (lo, hi): (f32, f32),
    bits: u32,
    clip_q16: u32,
    p: &mut [u8],
    t: &mut [f32],
) -> bool {
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
pub(super) fn group_ranges_portable(row: &[f16], g: usize, ranges: &mut [(f32, f32)]) {
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
pub(super) fn quantize_row_portable(
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
pub(super) fn quantize_into_page<K: Kernels>(
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
