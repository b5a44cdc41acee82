//! The AVX2 FWHT, dense rotations and the one-pass staging of a new row.

use super::*;

/// The FWHT butterflies of the `8 * R` floats at `p` ([`lanes::fwht_regs!`] at eight
/// lanes: strides 1, 2 and 4 inside each register, 8 and up between registers), then a
/// multiplication by `scale` where given.
///
/// # Safety
/// `p` is valid for reads and writes of `8 * R` floats, and AVX2 and FMA are present.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn fwht_regs<const R: usize>(p: *mut f32, scale: Option<f32>) {
    // SAFETY: this function is compiled for AVX2, FMA and F16C.
    let l = unsafe { W256::assume() };
    // SAFETY (in the macro): `p` as the caller vouches.
    lanes::fwht_regs!(l: W256, R, p, scale)
}

/// Whether the vector loads of the one-pass staging (`Lanes::load_elems`) read `T`: f32, f16 or bf16, of that type's size (`KvElement` is
/// sealed, but its `DTYPE` alone does not prove the element's size).
pub(crate) fn loadable<T: KvElement>() -> bool {
    let size = if T::DTYPE == DTYPE_F32 { 4 } else { 2 };
    [DTYPE_F32, DTYPE_F16, DTYPE_BF16].contains(&T::DTYPE) && size_of::<T>() == size
}

/// [`lanes::stage_hadamard!`] at eight lanes: the fused append's one-pass staging of a new
/// row of `8 * R` channels (64 or 128) for a Hadamard rotation with no channel
/// permutation, groups of `8 * PER` channels. `None` (nothing written) for another
/// element type or row length.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn stage_hadamard<T: KvElement, const R: usize, const PER: usize>(
    src: &[T],
    affine: KeyAffine<'_>,
    dst: &mut [f16],
    ranges: &mut [(f32, f32)],
) -> Option<f32> {
    // SAFETY: this function is compiled for AVX2, FMA and F16C.
    let l = unsafe { W256::assume() };
    lanes::stage_hadamard!(l: W256, T, R, PER, src, affine, dst, ranges)
}

/// [`stage_hadamard`] of a token's key row (with its `affine`) and value row, one
/// after the other in one call: the same bytes as two calls, without the fill loop's
/// per-row dispatch between them (8-19% off append at head_dim 64 and 128 with these
/// kernels). `None`, with nothing written, where `stage_hadamard` declines the rows
/// (the four rows' lengths are checked first, so it cannot decline only the second).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn stage_pair<T: KvElement, const R: usize, const PER: usize>(
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
pub(super) fn fwht_256(x: &mut [f32]) {
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

/// [`super::super::fwht`] for rows of 8 to 256 floats (16 to 256 in 512-bit registers with
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

/// [`super::super::dense_rotate`], `out = x R` for a row-major `d x d` matrix, with the
/// outputs in registers: blocks of 64 outputs (eight accumulators), each running
/// down the matrix's rows, `acc += x[i] * R[i][..]` with the product rounded and then
/// added (no fused multiply-add) in order of `i`, so each output is the scalar loop's
/// bits. The scalar loop kept `out` in memory and ran 4 lanes wide (SSE2): learned
/// rotations spent two thirds of append's time in it.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dense_rotate(x: &[f32], r: &[f32], out: &mut [f32]) {
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
pub(super) fn dense_rotate_rows(x: &[f32], r: &[f32], d: usize, out: &mut [f32]) {
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
