//! `decode_merge`: the log-sum-exp combine of split-K partials, the inverse value
//! permutation and the inverse rotation (Hadamard, or the transpose of a learned dense
//! rotation), one warp per (query head, sequence).

use crate::ctx::Ctx;
use crate::fwht::{dense_warp, fwht_warp};
use crate::math::{exp_neg, f32_to_f16};
use crate::params::{
    BATCH_NO_SLOT, FLAG_DENSE_VALUES, FLAG_OUTPUT_BF16, FLAG_OUTPUT_F16, FLAG_ROTATE_VALUES, MergeParams,
};

/// Merges the partials of one `(query head, sequence)` and writes its attention output
/// in the original value channels.
///
/// # Safety
/// With `S = p.num_seqs`, `H = p.num_q_heads`, `N = p.num_splits`: `m` and `l` must be
/// valid for `S * H * N` reads, `o` for `S * H * N * D`, `vperm_inv` for
/// `p.num_kv_heads * D` (each row a permutation of `0..D`), `value_rot` for
/// `p.num_kv_heads * D * D` when `p.flags` has `FLAG_DENSE_VALUES` (else unused), `out`
/// for writes at `s * p.out_row_stride + h * D + c` (`s < S`, `h < H`, `c < D`; 4 or 2
/// bytes each) not aliased by the inputs; `D == p.head_dim`, `V * 32 == D`. The grid must be
/// `(H, S, 1)` with 32 threads per block. `meta` null, or a step batch whose first `S`
/// entries are the rows' slots: a row whose slot is `BATCH_NO_SLOT` is written as zeros
/// without reading its partials.
///
/// # Parameters
/// - `m`, `l`: per `[seq][q_head][split]`, the split's max logit (`-inf` when empty) and
///   sum of `exp(logit - m)`;
/// - `o`: `[seq][q_head][split][D]`, the split's sum of `exp(logit - m) * v'` in stored
///   value order;
/// - `vperm_inv`: `[kv_head][D]` inverse value permutation: rotated channel `c` is stored
///   channel `vperm_inv[c]`;
/// - `value_rot`: `[kv_head][D][D]` learned value rotations `R` (the output is
///   `unpermute(o') R^T`);
/// - `out`: `[seq][q_head][D]` with rows `p.out_row_stride` apart, f32, or f16 with
///   `FLAG_OUTPUT_F16`, or bf16 (round to nearest even) with `FLAG_OUTPUT_BF16`.
///
/// # Thread mapping
/// Block `(x, y)` = (query head, sequence), one warp. Lane `i` owns channels
/// `[i * V, (i + 1) * V)`: it merges them over the splits, fetches the stored channels it
/// needs with `V` indexed shuffles, then runs the FWHT (butterflies inside the lane for
/// strides below `V`, `shfl.bfly` across lanes for the rest) or the transposed dense
/// rotation (`D` shuffles).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn decode_merge<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    p: &MergeParams,
    m: *const f32,
    l: *const f32,
    o: *const f32,
    vperm_inv: *const u16,
    value_rot: *const f32,
    out: *mut u8,
    meta: *const u32,
) {
    let [qh, seq, _] = ctx.block_idx();
    let lane = ctx.lane() as usize;
    let hq = p.num_q_heads as usize;
    // A step batch's row that no decode block wrote this step (no token, or a slot the
    // decode launch gave no rows) gets zeros.
    // SAFETY: with a step batch, `meta` holds its `num_seqs` rows' slots and the per-slot
    // arrays of `batch_seqs` slots (contract).
    let unused = !meta.is_null() && unsafe { !batch_row_decoded(p, meta, seq) };
    let splits = if unused { 0 } else { p.num_splits as usize };
    let row = seq as usize * hq + qh as usize;
    let base = row * splits;
    // SAFETY (all reads below): indices stay inside the sizes of the `# Safety` contract.
    let mut max = f32::NEG_INFINITY;
    // A split that saw a non-finite query, key or value has a NaN sum (its max may still
    // be -inf when every score was NaN): the row is NaN, never a finite wrong row.
    let mut bad = false;
    for i in 0..splits {
        let (mi, li) = unsafe { (*m.add(base + i), *l.add(base + i)) };
        max = max.max(mi);
        bad |= mi.is_nan() || li.is_nan();
    }
    let mut acc = [0f32; V];
    let mut sum = 0.0;
    if max > f32::NEG_INFINITY {
        for i in 0..splits {
            let mi = unsafe { *m.add(base + i) };
            if mi == f32::NEG_INFINITY {
                continue;
            }
            let c = exp_neg(mi - max);
            sum += unsafe { *l.add(base + i) } * c;
            let oi = unsafe { o.add((base + i) * D + lane * V) };
            for (v, a) in acc.iter_mut().enumerate() {
                *a += unsafe { *oi.add(v) } * c;
            }
        }
    }
    let inv = if bad {
        f32::NAN
    } else if sum > 0.0 {
        1.0 / sum
    } else {
        0.0
    };
    acc.iter_mut().for_each(|a| *a *= inv);
    // Inverse permutation: rotated channel c comes from stored channel vperm_inv[c].
    // (max(1): no division can trap; the host validated both counts.)
    let group = (hq / (p.num_kv_heads as usize).max(1)).max(1);
    let kvh = qh as usize / group;
    let mut x = [0f32; V];
    for (v, xv) in x.iter_mut().enumerate() {
        let j = unsafe { *vperm_inv.add(kvh * D + lane * V + v) } as usize;
        let (src, slot) = ((j / V) as u32, j % V);
        for (s, &a) in acc.iter().enumerate() {
            let t = ctx.shfl_idx(a, src);
            if s == slot {
                *xv = t;
            }
        }
    }
    if p.flags & FLAG_DENSE_VALUES != 0 {
        // SAFETY: the KV head's D x D matrix (contract, with the flag set).
        x = unsafe { dense_warp::<C, V, true>(ctx, &x, value_rot.add(kvh * D * D)) };
    } else if p.flags & FLAG_ROTATE_VALUES != 0 {
        fwht_warp(ctx, &mut x);
    }
    let at = seq as usize * p.out_row_stride as usize + qh as usize * D + lane * V;
    for (v, &xv) in x.iter().enumerate() {
        if p.flags & FLAG_OUTPUT_F16 != 0 {
            unsafe { *out.cast::<u16>().add(at + v) = f32_to_f16(xv) };
        } else if p.flags & FLAG_OUTPUT_BF16 != 0 {
            unsafe { *out.cast::<u16>().add(at + v) = f32_to_bf16(xv) };
        } else {
            unsafe { *out.cast::<f32>().add(at + v) = xv };
        }
    }
}

/// Whether row `r` of a step batch was decoded this step: its slot is one of the batch's,
/// has at most `p.q_len` rows, and `r` lies inside them (what `DecodeParams::seq_rows`
/// gives the decode kernels).
///
/// # Safety
/// `meta` a step batch of `p.num_seqs` rows over `p.batch_seqs` slots.
#[inline(always)]
unsafe fn batch_row_decoded(p: &MergeParams, meta: *const u32, r: u32) -> bool {
    let (rows, seqs) = (p.num_seqs as usize, p.batch_seqs as usize);
    // SAFETY: r < num_seqs rows; the slot is checked below `batch_seqs` before the
    // per-slot arrays are read (contract).
    let slot = unsafe { *meta.add(r as usize) };
    if slot == BATCH_NO_SLOT || slot as usize >= seqs {
        return false;
    }
    let (count, first) =
        unsafe { (*meta.add(rows + seqs + slot as usize), *meta.add(rows + 2 * seqs + slot as usize)) };
    count <= p.q_len && first <= r && r - first < count
}

/// `x` rounded to bf16 (nearest, ties to even; NaN stays NaN).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Calls `$m!(name, head_dim, values_per_lane)` for every merge instantiation.
#[macro_export]
macro_rules! for_each_merge {
    ($m:ident) => {
        $m!(rotkv_decode_merge_d64, 64, 2);
        $m!(rotkv_decode_merge_d128, 128, 4);
        $m!(rotkv_decode_merge_d256, 256, 8);
    };
}

#[cfg(target_arch = "nvptx64")]
mod entry {
    use super::decode_merge;
    use crate::ctx::Nvptx;
    use crate::params::MergeParams;

    macro_rules! merge_entry {
        ($name:ident, $d:literal, $v:literal) => {
            /// PTX entry point of [`decode_merge`] for one head dimension.
            ///
            /// # Safety
            /// See [`decode_merge`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $name(
                p: MergeParams,
                m: *const f32,
                l: *const f32,
                o: *const f32,
                vperm_inv: *const u16,
                value_rot: *const f32,
                out: *mut u8,
                meta: *const u32,
            ) {
                // SAFETY: forwarded contract of `decode_merge`.
                unsafe { decode_merge::<_, $d, $v>(&Nvptx, &p, m, l, o, vperm_inv, value_rot, out, meta) }
            }
        };
    }
    crate::for_each_merge!(merge_entry);
}
