//! The FWHT and the dense rotations of a row, and the staging of a row into stored order.

use super::*;

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
pub(super) fn fwht_portable(x: &mut [f32]) {
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
pub(super) fn dense_rotate(x: &[f32], r: &[f32], out: &mut [f32]) {
    let d = x.len();
    out.fill(0.0);
    for (&xi, row) in x.iter().zip(r.chunks_exact(d)) {
        out.iter_mut().zip(row).for_each(|(o, &m)| *o += xi * m);
    }
}

/// Rotates `x` (in place) into stored order in `out`: `out[j] = (x R)[perm[j]]`.
pub(super) fn rotate_into(x: &mut [f32], rot: HeadRotation<'_>, perm: &[u16], out: &mut [f32]) {
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
pub(super) fn unrotate_into(y: &[f32], rot: HeadRotation<'_>, perm: &[u16], t: &mut [f32], out: &mut [f32]) {
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
pub(super) fn stage_row(
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
pub(super) fn load_row<K: Kernels, T: KvElement>(kern: K, src: &[T], dst: &mut [f32]) {
    if T::DTYPE == DTYPE_F32 {
        dst.copy_from_slice(bytemuck::cast_slice(src));
    } else if T::DTYPE == DTYPE_F16 {
        kern.to_f32(bytemuck::cast_slice(src), dst);
    } else {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}
