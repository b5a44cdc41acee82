//! The fast Walsh-Hadamard transform of one head held by one warp.

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
}
