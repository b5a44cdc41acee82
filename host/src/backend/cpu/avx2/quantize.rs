//! The AVX2 quantizer: group ranges, parameters and codes.

use super::*;

/// The codes of 8 values against `LEVELS` thresholds (the count of thresholds at or
/// below each value), one per i32 lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn codes8<const LEVELS: usize>(v: __m256, th: &[__m256; 15]) -> __m256i {
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
pub(super) fn low_bytes(h: __m256i) -> (__m128i, __m128i) {
    let pick = _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    (_mm_shuffle_epi8(_mm256_castsi256_si128(h), pick), _mm_shuffle_epi8(_mm256_extracti128_si256::<1>(h), pick))
}

/// The exact min and max of a group of f16 values (`g` a multiple of 32), four
/// independent chains. A range ending at a zero of either sign is recomputed by
/// `group_params`, so the sign of a zero found here does not matter.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn group_range(x: &[f16]) -> (f32, f32) {
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
pub(super) fn group_codes(x: &[f16], th: &[f32], bits: u32, out: &mut [u8]) {
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

/// [`super::super::quantize_row_portable`] in AVX2 on `rows.len() / d` rows of `d` (the same
/// bytes; `ranges` is `[rows][d / g]`, `codes` `[rows][d * bits / 8]`, `params`
/// `[rows][4 * d / g]`), in blocks of 16 rows and two passes per block, so that the
/// scalar work of one row (the f64 scale and zero, their f16 rounding, the thresholds:
/// a long dependent chain) runs beside that of the other rows instead of stalling its
/// own codes: every group's scale, zero and thresholds (`z + (k + 1/2) s` rounded up
/// to f32, see [`super::super::group_codes`]; all `+inf` for a constant group, whose codes
/// are all 0), then the codes ([`group_codes`]). A row with a threshold that is not
/// finite would go to the portable quantizer (which divides there); for finite rows
/// none is (`|z| <= 65504` and `s <= 131008 / 3` keep every threshold below 2^18),
/// so that branch only keeps the function total. Every group's range must be ordered
/// (`lo <= hi`: its min and max). With `zmm` and BMI2 the whole pass is
/// [`Avx512::quantize_rows`]; with `zmm` alone the codes come from
/// [`Avx512::group_codes`] (the same bytes either way).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_rows(
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
                    let ok = super::super::zero_end_params(
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
                super::super::quantize_row_portable(row(r), bits, g, clip, ranges, c, p);
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
pub(super) fn mask32(m: __m256d) -> __m128i {
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
pub(crate) fn f64x4_to_f16(x: __m256d) -> [u16; 4] {
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
/// [`super::super::group_codes`] rounds its thresholds.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn f64x4_up_to_f32(t: __m256d) -> __m128 {
    let r = _mm256_cvtpd_ps(t);
    let up = mask32(_mm256_cmp_pd::<_CMP_LT_OQ>(_mm256_cvtps_pd(r), t));
    let bits = _mm_castps_si128(r);
    // One step up: +1 in the bits of a non-negative f32, -1 of a negative one.
    let step = _mm_or_si128(_mm_srai_epi32::<31>(bits), _mm_set1_epi32(1));
    _mm_castsi128_ps(_mm_add_epi32(bits, _mm_and_si128(up, step)))
}

/// [`super::super::group_params`] and the thresholds of [`super::super::group_codes`] for four
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
pub(super) fn group_params4(
    lo: __m256d,
    hi: __m256d,
    bits: u32,
    clip: u32,
) -> ([u16; 4], [u16; 4], [[f32; 4]; 15], i32) {
    let (lo, hi) = if clip >= super::super::NO_CLIP {
        (lo, hi)
    } else {
        // The operations of `clip_range`, in its order.
        let ratio = _mm256_set1_pd(clip as f64 / super::super::NO_CLIP as f64);
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
