//! The rotations of one head held by one warp: the fast Walsh-Hadamard transform, a
//! dense (learned) rotation matrix, and channel permutations.

use crate::ctx::{Ctx, WARP};
use crate::math::inv_sqrt_head_dim;

/// In-place orthonormal FWHT of a `32 * V`-channel row spread over a warp: lane `i`
/// holds channels `[i * V, (i + 1) * V)` in `x`. Butterflies inside the lane for strides
/// below `V`, then `shfl.bfly` across lanes for strides `V, 2V, ..`; finally the
/// `1 / sqrt(32 V)` normalization. Same definition as `rotkv::reference::fwht`
/// (Sylvester order), so it is its own inverse.
///
/// # Thread mapping
/// Every lane of the warp must call it (it shuffles `5 * V` times).
#[inline(always)]
pub fn fwht_warp<C: Ctx, const V: usize>(ctx: &C, x: &mut [f32; V]) {
    let mut h = 1;
    while h < V {
        let mut i = 0;
        while i < V {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
            i += 2 * h;
        }
        h *= 2;
    }
    let lane = ctx.lane();
    let mut lanes = 1;
    while lanes < WARP {
        let upper = lane & lanes != 0;
        for v in x.iter_mut() {
            let other = ctx.shfl_xor(*v, lanes);
            *v = if upper { other - *v } else { *v + other };
        }
        lanes *= 2;
    }
    let s = inv_sqrt_head_dim(WARP * V as u32);
    x.iter_mut().for_each(|v| *v *= s);
}

/// Dense rotation of a `32 * V`-channel row spread over a warp (lane `i` holds channels
/// `[i * V, (i + 1) * V)` of `x` and of the result): returns `x M`, or `x M^T` when
/// `TRANSPOSE`, for the row-major `D x D` matrix `m` (`D = 32 * V`). Accumulated in
/// f32 over input channels in ascending order.
///
/// # Safety
/// `m` must be valid for `D * D` reads.
///
/// # Thread mapping
/// Every lane of the warp must call it (`D` indexed shuffles broadcast each input
/// channel). For input channel `i`, lane `l` reads `M[i][l * V .. (l + 1) * V]`: the warp
/// reads one contiguous row of `M` per channel (coalesced); `TRANSPOSE` reads columns
/// (strided; used once per query head, by the merge).
#[inline(always)]
pub unsafe fn dense_warp<C: Ctx, const V: usize, const TRANSPOSE: bool>(
    ctx: &C,
    x: &[f32; V],
    m: *const f32,
) -> [f32; V] {
    let d = WARP as usize * V;
    let lane = ctx.lane() as usize;
    let mut y = [0f32; V];
    for src in 0..WARP {
        for (s, &xs) in x.iter().enumerate() {
            let xi = ctx.shfl_idx(xs, src);
            let i = src as usize * V + s;
            for (v, yv) in y.iter_mut().enumerate() {
                let j = lane * V + v;
                let at = if TRANSPOSE { j * d + i } else { i * d + j };
                // SAFETY: i, j < D, so at < D * D (contract).
                *yv += xi * unsafe { *m.add(at) };
            }
        }
    }
    y
}

/// Gathers a permutation across the warp: returns, for the lane's stored channels
/// `j = lane * V + v`, the value of rotated channel `perm[j]` (held by lane
/// `perm[j] / V`, slot `perm[j] % V`). `perm` points at the head's `32 * V` entries.
///
/// # Safety
/// `perm` must be valid for `32 * V` reads, each entry below `32 * V`.
///
/// # Thread mapping
/// Every lane of the warp must call it (`V * V` indexed shuffles).
#[inline(always)]
pub unsafe fn permute_warp<C: Ctx, const V: usize>(ctx: &C, x: &[f32; V], perm: *const u16) -> [f32; V] {
    let lane = ctx.lane() as usize;
    let mut out = [0f32; V];
    for (v, o) in out.iter_mut().enumerate() {
        // SAFETY: lane * V + v < 32 * V entries (contract).
        let c = unsafe { *perm.add(lane * V + v) } as usize;
        let (src, slot) = ((c / V) as u32, c % V);
        for (s, &xs) in x.iter().enumerate() {
            let t = ctx.shfl_idx(xs, src);
            if s == slot {
                *o = t;
            }
        }
    }
    out
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use crate::sim::launch;
    use core::sync::atomic::{AtomicU32, Ordering};
    use std::vec::Vec;

    /// Plain f64 FWHT (natural order, orthonormal).
    fn fwht_f64(x: &mut [f64]) {
        let n = x.len();
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (x[j], x[j + h]);
                    x[j] = a + b;
                    x[j + h] = a - b;
                }
            }
            h *= 2;
        }
        let s = 1.0 / (n as f64).sqrt();
        x.iter_mut().for_each(|v| *v *= s);
    }

    fn check<const V: usize>() {
        let n = 32 * V;
        let input: Vec<f32> = (0..n).map(|i| ((i * 7919 % 113) as f32 - 56.0) / 17.0).collect();
        let out: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
        launch([1, 1, 1], 32, 0, |c| {
            let lane = c.lane() as usize;
            let mut x: [f32; V] = core::array::from_fn(|v| input[lane * V + v]);
            fwht_warp(c, &mut x);
            for (v, xv) in x.iter().enumerate() {
                out[lane * V + v].store(xv.to_bits(), Ordering::SeqCst);
            }
        })
        .unwrap();
        let mut want: Vec<f64> = input.iter().map(|&v| v as f64).collect();
        fwht_f64(&mut want);
        for (o, w) in out.iter().zip(&want) {
            let g = f32::from_bits(o.load(Ordering::SeqCst)) as f64;
            assert!((g - w).abs() < 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
        }
    }

    #[test]
    fn warp_fwht_matches_the_definition() {
        check::<2>();
        check::<4>();
        check::<8>();
    }

    fn check_dense<const V: usize>() {
        let n = 32 * V;
        let input: Vec<f32> = (0..n).map(|i| ((i * 7919 % 113) as f32 - 56.0) / 17.0).collect();
        let m: Vec<f32> = (0..n * n).map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 500.0).collect();
        for transpose in [false, true] {
            let out: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            launch([1, 1, 1], 32, 0, |c| {
                let lane = c.lane() as usize;
                let x: [f32; V] = core::array::from_fn(|v| input[lane * V + v]);
                // SAFETY: m holds n * n entries.
                let y = unsafe {
                    if transpose {
                        dense_warp::<_, V, true>(c, &x, m.as_ptr())
                    } else {
                        dense_warp::<_, V, false>(c, &x, m.as_ptr())
                    }
                };
                for (v, yv) in y.iter().enumerate() {
                    out[lane * V + v].store(yv.to_bits(), Ordering::SeqCst);
                }
            })
            .unwrap();
            for (j, o) in out.iter().enumerate() {
                let want: f64 =
                    (0..n).map(|i| input[i] as f64 * if transpose { m[j * n + i] } else { m[i * n + j] } as f64).sum();
                let g = f32::from_bits(o.load(Ordering::SeqCst)) as f64;
                assert!((g - want).abs() < 1e-4 * (1.0 + want.abs()), "transpose {transpose} ch {j}: {g} vs {want}");
            }
        }
    }

    #[test]
    fn warp_dense_rotation_matches_the_matrix_product() {
        check_dense::<2>();
        check_dense::<4>();
        check_dense::<8>();
    }
}
