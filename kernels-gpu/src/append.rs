//! Append: `append_rotate` turns new K/V rows into the stored f16 rows (key mean
//! subtracted, FWHT, channel permutation, rounding to f16), `append_quantize` quantizes
//! stored rows into page slots (group min/max, f16 scale and zero, codes, packing). The
//! host runs rotate for the new tokens, quantize for the pages that fill, and copies the
//! rows that stay in f16 to the sinks and the window.

use crate::ctx::Ctx;
use crate::fwht::{fwht_warp, permute_warp};
use crate::layout::{Format, div};
use crate::math::{f16_to_f32, f32_to_f16, f64_to_f16};
use crate::params::{AppendParams, DTYPE_BF16, DTYPE_F16, FLAG_ROTATE_KEYS, FLAG_ROTATE_VALUES};

/// Stored f16 rows of the new tokens.
///
/// # Safety
/// `k` and `v` valid at element `t * p.token_stride + h * p.head_stride + c` for `t < p.count`,
/// `h < p.num_kv_heads`, `c < D`; `key_mean` for `Hkv * D` reads; `key_perm` and
/// `value_perm` for `Hkv * D` (rows are permutations of `0..D`); `staged` for
/// `p.count * Hkv * 2 * D` writes. `D == 32 * V == p.format.head_dim`. Grid
/// `(Hkv, count, 1)`, 32 threads.
///
/// # Parameters
/// `staged[(t * Hkv + h) * 2 * D + (0 for K | D for V) + c]`: f16 bits of stored channel
/// `c` of token `t`, head `h`.
///
/// # Thread mapping
/// Block `(h, t)`, one warp; lane `i` owns channels `[i * V, (i + 1) * V)` of the row: it
/// loads them (f32, f16 or bf16 as `p.input_dtype` says), subtracts the key mean, runs the warp FWHT, gathers the permutation with
/// indexed shuffles and rounds to f16. Keys first, then values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn append_rotate<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    p: &AppendParams,
    k: *const u8,
    v: *const u8,
    key_mean: *const f32,
    key_perm: *const u16,
    value_perm: *const u16,
    staged: *mut u16,
) {
    /// Element `i` of an input of type `dtype`.
    ///
    /// # Safety
    /// `x` valid for element `i` of that type.
    #[inline(always)]
    unsafe fn load(x: *const u8, dtype: u32, i: usize) -> f32 {
        // SAFETY: forwarded contract.
        unsafe {
            match dtype {
                DTYPE_F16 => f16_to_f32(*x.cast::<u16>().add(i)),
                DTYPE_BF16 => f32::from_bits((*x.cast::<u16>().add(i) as u32) << 16),
                _ => *x.cast::<f32>().add(i),
            }
        }
    }
    let [h, t, _] = ctx.block_idx();
    let lane = ctx.lane() as usize;
    let hkv = p.num_kv_heads as usize;
    let src = t as usize * p.token_stride as usize + h as usize * p.head_stride as usize + lane * V;
    let out = (t as usize * hkv + h as usize) * 2 * D + lane * V;
    for value in [false, true] {
        // SAFETY (raw accesses): inside the sizes of the `# Safety` contract.
        let mut x: [f32; V] = core::array::from_fn(|c| unsafe {
            if value {
                load(v, p.input_dtype, src + c)
            } else {
                load(k, p.input_dtype, src + c) - *key_mean.add(h as usize * D + lane * V + c)
            }
        });
        let flag = if value { FLAG_ROTATE_VALUES } else { FLAG_ROTATE_KEYS };
        if p.flags & flag != 0 {
            fwht_warp(ctx, &mut x);
        }
        let perm = if value { value_perm } else { key_perm };
        let y = unsafe { permute_warp(ctx, &x, perm.add(h as usize * D)) };
        for (c, &yc) in y.iter().enumerate() {
            unsafe { *staged.add(out + value as usize * D + c) = f32_to_f16(yc) };
        }
    }
}

/// Quantizes stored f16 rows into page slots (keys or values, `BITS` bits).
///
/// # Safety
/// `rows` valid for `jobs * D` f16 reads; `slots` for `3 * jobs` entries
/// `(block, slot, kv_head)`, each block inside `pool`; `pool` a 16-byte aligned pool of
/// `fmt`'s head-pages with `num_kv_heads` heads per block. `D == 32 * V`,
/// `BITS == fmt.bits(value)`. Grid `(jobs, 1, 1)`, 32 threads.
///
/// # Parameters
/// Job `j` quantizes `rows[j * D..(j + 1) * D]` into slot `slots[3j + 1]` of the
/// head-page of KV head `slots[3j + 2]` in block `slots[3j]`: packed codes plus the f16
/// scale and zero of each group, exactly as `rotkv::reference::quantize_row` defines them
/// (scale and zero in f64 from the f16 inputs, codes rounded half away from zero).
///
/// # Thread mapping
/// Block `j`, one warp; lane `i` owns channels `[i * V, (i + 1) * V)`; a group of g
/// channels is `g / V` consecutive lanes, reduced with butterfly shuffles for its min and
/// max; the lanes sharing a 32-bit word of codes OR their parts together with shuffles,
/// and the first of them stores the word; the group's first lane stores scale and zero.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn append_quantize<C: Ctx, const D: usize, const V: usize, const BITS: u32>(
    ctx: &C,
    fmt: &Format,
    num_kv_heads: u32,
    value: bool,
    rows: *const u16,
    slots: *const u32,
    pool: *mut u8,
) {
    let [job, _, _] = ctx.block_idx();
    let lane = ctx.lane();
    // SAFETY (raw accesses): inside the sizes of the `# Safety` contract.
    let (block, slot, head) = unsafe {
        let s = slots.add(3 * job as usize);
        (*s, *s.add(1), *s.add(2))
    };
    let x: [f32; V] =
        core::array::from_fn(|c| f16_to_f32(unsafe { *rows.add(job as usize * D + lane as usize * V + c) }));
    // Group min and max over the group's lanes.
    let group_lanes = div(fmt.group_size, V as u32).max(1);
    let (mut lo, mut hi) = (x[0], x[0]);
    for &xc in &x[1..] {
        lo = lo.min(xc);
        hi = hi.max(xc);
    }
    let mut mask = 1;
    while mask < group_lanes {
        lo = lo.min(ctx.shfl_xor(lo, mask));
        hi = hi.max(ctx.shfl_xor(hi, mask));
        mask *= 2;
    }
    let levels = ((1u32 << BITS) - 1) as f64;
    let scale = f64_to_f16((hi as f64 - lo as f64) / levels);
    let zero = f64_to_f16(lo as f64);
    let (s, z) = (f16_to_f32(scale) as f64, f16_to_f32(zero) as f64);
    // Codes, packed into this lane's share of its 32-bit word.
    let bit0 = lane * V as u32 * BITS;
    let mut part = 0u32;
    for (c, &xc) in x.iter().enumerate() {
        let code = if s == 0.0 {
            0
        } else {
            // y >= 0 (zero is the group's min, an f16 value): round half away from zero
            // as the reference does; y - trunc(y) is exact in f64.
            let y = ((xc as f64 - z) / s).max(0.0);
            let t = y as u32;
            let r = if y - t as f64 >= 0.5 { t + 1 } else { t };
            r.min((1 << BITS) - 1)
        };
        part |= code << ((bit0 + c as u32 * BITS) % 32);
    }
    let word_lanes = 32 / (V as u32 * BITS).min(32);
    let mut mask = 1;
    while mask < word_lanes {
        part |= ctx.shfl_xor(f32::from_bits(part), mask).to_bits();
        mask *= 2;
    }
    let page = unsafe { pool.add(fmt.page_offset(block, head, num_kv_heads)) };
    if lane.is_multiple_of(word_lanes) {
        let at = fmt.codes_at(value, slot) as usize + (bit0 / 32) as usize * 4;
        // SAFETY: inside the slot's codes (a multiple of 4 bytes, 4-aligned).
        unsafe { *page.add(at).cast::<u32>() = part };
    }
    if lane.is_multiple_of(group_lanes) {
        let group = lane / group_lanes;
        // SAFETY: inside the head-page's params; f16 slots are 2-aligned.
        unsafe {
            *page.add(fmt.scale_at(value, group, slot) as usize).cast::<u16>() = scale;
            *page.add(fmt.zero_at(value, group, slot) as usize).cast::<u16>() = zero;
        }
    }
}

/// Calls `$m!` with every append instantiation: `(rotate entry, quantize 2-bit entry,
/// quantize 4-bit entry, head_dim, channels per lane)`.
#[macro_export]
macro_rules! for_each_append {
    ($m:ident) => {
        $m! {
            (rotkv_append_rotate_d64, rotkv_append_quantize_d64_b2, rotkv_append_quantize_d64_b4, 64, 2),
            (rotkv_append_rotate_d128, rotkv_append_quantize_d128_b2, rotkv_append_quantize_d128_b4, 128, 4),
            (rotkv_append_rotate_d256, rotkv_append_quantize_d256_b2, rotkv_append_quantize_d256_b4, 256, 8)
        }
    };
}

#[cfg(target_arch = "nvptx64")]
mod entry {
    use super::{append_quantize, append_rotate};
    use crate::ctx::Nvptx;
    use crate::layout::Format;
    use crate::params::AppendParams;

    macro_rules! append_entries {
        ($(($rot:ident, $q2:ident, $q4:ident, $d:literal, $v:literal)),* $(,)?) => {$(
            /// PTX entry point of [`append_rotate`].
            ///
            /// # Safety
            /// See [`append_rotate`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $rot(
                p: AppendParams,
                k: *const u8,
                v: *const u8,
                key_mean: *const f32,
                key_perm: *const u16,
                value_perm: *const u16,
                staged: *mut u16,
            ) {
                // SAFETY: forwarded contract.
                unsafe { append_rotate::<_, $d, $v>(&Nvptx, &p, k, v, key_mean, key_perm, value_perm, staged) }
            }

            /// PTX entry point of [`append_quantize`] for 2-bit codes.
            ///
            /// # Safety
            /// See [`append_quantize`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $q2(
                fmt: Format,
                num_kv_heads: u32,
                value: u32,
                rows: *const u16,
                slots: *const u32,
                pool: *mut u8,
            ) {
                // SAFETY: forwarded contract.
                unsafe { append_quantize::<_, $d, $v, 2>(&Nvptx, &fmt, num_kv_heads, value != 0, rows, slots, pool) }
            }

            /// PTX entry point of [`append_quantize`] for 4-bit codes.
            ///
            /// # Safety
            /// See [`append_quantize`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $q4(
                fmt: Format,
                num_kv_heads: u32,
                value: u32,
                rows: *const u16,
                slots: *const u32,
                pool: *mut u8,
            ) {
                // SAFETY: forwarded contract.
                unsafe { append_quantize::<_, $d, $v, 4>(&Nvptx, &fmt, num_kv_heads, value != 0, rows, slots, pool) }
            }
        )*};
    }
    crate::for_each_append!(append_entries);
}
