//! `decode_split`: split-K decode attention on CUDA cores straight from the packed cache,
//! one warp per (KV head, sequence, split, query token). The tensor-core kernel
//! (`crate::decode_mma`) is the fast path; this one serves the configurations it does not
//! instantiate (head_dim 256, 2-bit codes in groups of 32) and single-row tiles.
//!
//! The score and value steps are small functions (`score_token`, `value_row`) so that
//! a tensor-core path can replace them without touching the page walk, the online
//! softmax or the merge.

use crate::ctx::Ctx;
use crate::fwht::{dense_warp, fwht_warp, permute_warp};
use crate::layout::{Format, SIDE_PAGE};
use crate::math::{exp_neg, f16_to_f32, softmax_weight};
use crate::params::{DecodeParams, FLAG_DENSE_KEYS, FLAG_ROTATE_KEYS, load_elem};

/// Largest GQA group (query heads per KV head) the kernel holds in registers.
pub const MAX_GROUP: usize = 8;

/// Reads the `V` f16 values of a side-store row that lane `lane` owns.
///
/// # Safety
/// `side` must be valid for the row's `D` elements at `at`.
#[inline(always)]
unsafe fn f16_lane<const V: usize>(side: *const u16, at: usize, lane: usize) -> [f32; V] {
    // SAFETY: lane * V + v < D by construction (32 lanes x V = D).
    core::array::from_fn(|v| f16_to_f32(unsafe { *side.add(at + lane * V + v) }))
}

/// The `(scale, zero)` pair of the group holding the lane's channels.
///
/// # Safety
/// `page` must point at a whole head-page of `fmt`.
#[inline(always)]
unsafe fn lane_params(fmt: &Format, page: *const u8, value: bool, slot: u32, lane: u32, v: u32) -> (f32, f32) {
    let group = crate::layout::div(lane * v, fmt.group_size);
    let s = fmt.scale_at(value, group, slot) as usize;
    let z = fmt.zero_at(value, group, slot) as usize;
    // SAFETY: scale_at/zero_at lie inside the head-page (layout invariant); f16 is 2-aligned.
    unsafe { (f16_to_f32(*page.add(s).cast::<u16>()), f16_to_f32(*page.add(z).cast::<u16>())) }
}

/// The lane's `V` codes of one token (`BITS` bits each), from the 32-bit word that holds
/// them.
///
/// # Safety
/// `codes` must point at the token's `D * BITS / 8` code bytes, 4-byte aligned.
#[inline(always)]
unsafe fn lane_codes<const V: usize, const BITS: u32>(codes: *const u8, lane: u32) -> [f32; V] {
    let bit = lane * V as u32 * BITS;
    // SAFETY: bit / 32 < D * BITS / 32 words; code sections start 16-byte aligned and a
    // token's codes are a multiple of 4 bytes.
    let word = unsafe { *codes.cast::<u32>().add((bit / 32) as usize) } >> (bit % 32);
    let mask = (1u32 << BITS) - 1;
    core::array::from_fn(|v| ((word >> (v as u32 * BITS)) & mask) as f32)
}

/// Where a token's row is, as plain scalars (an enum here would live in local memory on
/// the device): an f16 side-store row `row` when `page == SIDE`, else slot `row` of
/// logical page `page`.
#[derive(Clone, Copy)]
struct Loc {
    page: u32,
    row: u32,
}

/// `Loc::page` of a side-store row.
const SIDE: u32 = SIDE_PAGE;

impl Loc {
    /// The location of position `pos` of a sequence of `len` tokens (protected positions
    /// not yet resolved).
    #[inline(always)]
    fn of(fmt: &Format, pos: u32, len: u32) -> Loc {
        let (page, row) = fmt.locate(pos, len);
        Loc { page, row }
    }
}

/// The lane's `V` stored-order values of one token (dequantized for pages).
///
/// # Safety
/// `loc` must name a side row of the sequence's side store `side` or a slot of a page of
/// its block table `table` (entries are clamped into the pool).
#[inline(always)]
unsafe fn value_row<const V: usize, const VB: u32>(
    p: &DecodeParams,
    loc: Loc,
    table: *const u32,
    side: *const u16,
    pool: *const u8,
    kvh: u32,
    lane: u32,
) -> [f32; V] {
    let fmt = &p.format;
    if loc.page == SIDE {
        // SAFETY: the row lies in the sequence's side store.
        return unsafe { f16_lane::<V>(side, fmt.side_row_at(kvh, true, loc.row), lane as usize) };
    }
    // SAFETY: the entry is clamped into the pool (`DecodeParams::block`).
    let base = unsafe { pool.add(fmt.page_offset(p.block(*table.add(loc.page as usize)), kvh, p.num_kv_heads)) };
    // SAFETY: inside the head-page.
    let (scale, zero) = unsafe { lane_params(fmt, base, true, loc.row, lane, V as u32) };
    let codes = unsafe { lane_codes::<V, VB>(base.add(fmt.value_codes_at(loc.row) as usize), lane) };
    codes.map(|c| c * scale + zero)
}

/// Tokens scored per step: one per lane.
pub const TILE: u32 = 32;

/// "Not a protected position" in the score loop's per-lane index.
const NONE: u32 = u32::MAX;

/// Dynamic shared memory of `decode_split` for a GQA group of `group` query heads: the
/// rotated queries `[group][D]` and their per-quantization-group sums
/// `[group][D / g]`, f32.
pub const fn decode_shared_bytes(fmt: &Format, group: u32) -> u32 {
    group * (fmt.head_dim + fmt.groups()) * 4
}

/// Scores of the lane's token against every query head of the group (in `s`), reading
/// the whole key with 16-byte loads; the queries come from shared memory (every lane
/// reads the same address).
///
/// # Safety
/// `row` must point at the token's key: `D * KB / 8` code bytes (quantized, with its
/// head-page `page` for scales and zeros) or `D` f16 values (`page` null), 16-byte
/// aligned; `qs` at `[MAX_GROUP][D]` f32 and `qsum` at `[MAX_GROUP][D / g]` f32.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_token<C: Ctx, const D: usize, const KB: u32>(
    ctx: &C,
    fmt: &Format,
    row: *const u8,
    page: *const u8,
    slot: u32,
    qs: *const f32,
    qsum: *const f32,
    g: usize,
    s: &mut [f32; MAX_GROUP],
) {
    *s = [0.0; MAX_GROUP];
    let groups = fmt.groups() as usize;
    if page.is_null() {
        for chunk in 0..D / 8 {
            // SAFETY: 16-byte chunk `chunk` of the D f16 values (contract).
            let w = unsafe { ctx.load16(row.add(16 * chunk)) };
            // Words picked by a select chain, not `w[k]` or an iterator over `w`: either
            // would put the array in local memory on the device (and unrolling the four
            // words by hand makes ptxas spill at D = 64).
            for k in 0..4 {
                let word = pick(&w, k);
                let x = [f16_to_f32(word as u16), f16_to_f32((word >> 16) as u16)];
                for (i, &xi) in x.iter().enumerate() {
                    let c = chunk * 8 + k * 2 + i;
                    for (h, sh) in s.iter_mut().enumerate() {
                        if h < g {
                            // SAFETY: h < MAX_GROUP, c < D (contract on qs).
                            *sh += unsafe { *qs.add(h * D + c) } * xi;
                        }
                    }
                }
            }
        }
        return;
    }
    let per_word = (32 / KB) as usize;
    let mask = (1u32 << KB) - 1;
    let gs = fmt.group_size as usize;
    let mut scale = 0.0;
    for chunk in 0..D * KB as usize / 128 {
        // SAFETY: 16-byte chunk of the token's codes (contract).
        let w = unsafe { ctx.load16(row.add(16 * chunk)) };
        // Words by a select chain (see the f16 rows above).
        for k in 0..4 {
            let word = pick(&w, k);
            for i in 0..per_word {
                let c = (chunk * 4 + k) * per_word + i;
                // (Power-of-two group size: masks and shifts, no trapping division.)
                if c & gs.wrapping_sub(1) == 0 {
                    // A new quantization group: its scale, and its zero times sum(q').
                    let j = c as u32 >> gs.trailing_zeros();
                    // SAFETY: inside the head-page (layout invariant), 2-aligned.
                    let (sc, z) = unsafe {
                        (
                            f16_to_f32(*page.add(fmt.scale_at(false, j, slot) as usize).cast::<u16>()),
                            f16_to_f32(*page.add(fmt.zero_at(false, j, slot) as usize).cast::<u16>()),
                        )
                    };
                    scale = sc;
                    for (h, sh) in s.iter_mut().enumerate() {
                        if h < g {
                            // SAFETY: h < MAX_GROUP, j < D / g.
                            *sh += z * unsafe { *qsum.add(h * groups + j as usize) };
                        }
                    }
                }
                let x = ((word >> (i as u32 * KB)) & mask) as f32 * scale;
                for (h, sh) in s.iter_mut().enumerate() {
                    if h < g {
                        // SAFETY: h < MAX_GROUP, c < D.
                        *sh += unsafe { *qs.add(h * D + c) } * x;
                    }
                }
            }
        }
    }
}

/// `w[k]` for `k < 4` as a select chain (registers only; an indexed load of a local
/// array is local memory on the device).
#[inline(always)]
fn pick(w: &[u32; 4], k: usize) -> u32 {
    match k {
        0 => w[0],
        1 => w[1],
        2 => w[2],
        _ => w[3],
    }
}

/// Split-K decode partials of one (KV head, sequence, split).
///
/// # Safety
/// With `S = p.num_seqs`, `Hq = p.num_q_heads`, `N = p.num_splits`: `q` valid (of
/// `p.q_dtype`) at `s * p.q_seq_stride + t * p.q_token_stride + h * D + c` for `s < S`,
/// `t < p.q_len`, `h < Hq`, `c < D`; `block_tables` for
/// `S * p.block_table_stride` entries with `p.block_table_stride >=
/// pages_for(p.max_len)` (entries are clamped below `p.num_blocks`, so a wrong entry
/// reads another block, never outside the pool; entries of pages wholly below
/// [`DecodeParams::visible_start`] are not read at all); `seq_lens` for `S` lengths (each >= 1;
/// clamped to `p.max_len`); `pool` holding `p.num_blocks` blocks; `sides` for `S * side_elems` f16 bits, 16-byte aligned;
/// `protected` for `S * p.format.protected` positions (each sequence's ascending list,
/// padded with `u32::MAX`; unused when `p.format.protected` is 0);
/// `pool` 16-byte aligned; `key_scale` for `Hkv * D` (finite); `key_perm` for `Hkv * D`
/// (rows are permutations); `key_rot` for `Hkv * D * D` when `p.flags` has `FLAG_DENSE_KEYS` (else unused); `part_m`,
/// `part_l` for `S * q_len * Hq * N` writes and `part_o` for `S * q_len * Hq * N * D`;
/// every sequence at least `p.q_len` tokens long.
/// `D == 32 * V == p.format.head_dim`, `KB`/`VB` the key/value bits,
/// `Hq / Hkv <= MAX_GROUP`. Grid `(Hkv, S, N * q_len)`, 32 threads, [`decode_shared_bytes`] of
/// dynamic shared memory for `MAX_GROUP` heads.
///
/// With a step batch (`p.batch_rows > 0`, `meta` its
/// [`crate::params::batch_meta_len`] u32), sequence `s` decodes its rows of the step
/// ([`DecodeParams::seq_rows`]); blocks of query tokens past them leave at once. `meta`
/// is unused (may be null) otherwise.
///
/// # Parameters
/// Outputs per `[seq][q_len][q_head][split]`: `part_m` the max logit (`-inf` for an empty
/// split), `part_l` the sum of `exp(logit - m)`, `part_o` (`[.. ][D]`) the sum of
/// `exp(logit - m) * v'` in stored value order: the input of `decode_merge`.
///
/// # Thread mapping
/// Block `(x, y, z)` = (KV head, sequence, split + N * query token), one warp for the
/// whole GQA group; the query token's causal limit and sliding window
/// ([`DecodeParams::row_start`]) cut the split's range.
/// First lane `i` owns channels `[i * V, (i + 1) * V)` of each query: multiplied by the
/// key scales (`q * s`, then the softmax scale), FWHT across the
/// warp (or the dense learned rotation), key permutation by shuffles, softmax scale
/// folded in, written to shared memory with per-group sums. Then the split is walked in tiles of 32 tokens: scores with one
/// token per lane, whole keys read with 16-byte loads (codes, or f16 rows for sinks,
/// window and protected positions, which each lane looks up in the sequence's list)
/// against the shared queries; a warp max and sum per query head update the
/// online softmax; then back to channels per lane for the values: each lane reads its
/// 32-bit word of value codes per token and takes the token's weights by shuffles.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn decode_split<C: Ctx, const D: usize, const V: usize, const KB: u32, const VB: u32>(
    ctx: &C,
    p: &DecodeParams,
    q: *const u8,
    pool: *const u8,
    block_tables: *const u32,
    seq_lens: *const u32,
    sides: *const u16,
    protected: *const u32,
    key_scale: *const f32,
    key_perm: *const u16,
    key_rot: *const f32,
    part_m: *mut f32,
    part_l: *mut f32,
    part_o: *mut f32,
    meta: *const u32,
) {
    let [kvh, seq, z] = ctx.block_idx();
    // SAFETY: the step batch (contract).
    let (pb, q_base, row_base) = unsafe { p.seq_rows(meta, seq) };
    let p = &pb;
    // Grid z enumerates (query token, split): one query token of the sequence per block.
    let nsplit = p.num_splits.max(1);
    let (split, qi) = (z % nsplit, z / nsplit);
    // A query token past the sequence's rows (a step batch gives each its own count).
    if qi >= p.q_len {
        return;
    }
    let lane = ctx.lane();
    let fmt = p.format;
    let hq = p.num_q_heads as usize;
    let g = (hq / (p.num_kv_heads as usize).max(1)).clamp(1, MAX_GROUP);
    let groups = fmt.groups() as usize;
    // SAFETY (all raw accesses below): inside the sizes of the `# Safety` contract.
    let len = p.clamp_len(unsafe { *seq_lens.add(seq as usize) });
    let table = unsafe { block_tables.add(seq as usize * p.block_table_stride as usize) };
    let side = unsafe { sides.add(seq as usize * fmt.side_elems(p.num_kv_heads)) };
    let prot = unsafe { protected.add(seq as usize * fmt.protected as usize) };
    let qs = ctx.shared().cast::<f32>();
    let qsum = unsafe { qs.add(MAX_GROUP * D) };

    // Rotated, permuted, scaled queries of the group into shared memory.
    for h in 0..MAX_GROUP {
        if h >= g {
            continue;
        }
        let row = q_base + qi as usize * p.q_token_stride as usize + (kvh as usize * g + h) * D + lane as usize * V;
        let ks = unsafe { key_scale.add(kvh as usize * D + lane as usize * V) };
        let mut x: [f32; V] =
            core::array::from_fn(|v| unsafe { load_elem(q, p.q_dtype, row + v) * *ks.add(v) } * p.sm_scale);
        if p.flags & FLAG_DENSE_KEYS != 0 {
            x = unsafe { dense_warp::<C, V, false>(ctx, &x, key_rot.add(kvh as usize * D * D)) };
        } else if p.flags & FLAG_ROTATE_KEYS != 0 {
            fwht_warp(ctx, &mut x);
        }
        // Stored channel j takes rotated channel key_perm[j].
        let y = unsafe { permute_warp(ctx, &x, key_perm.add(kvh as usize * D)) };
        for (v, &yv) in y.iter().enumerate() {
            unsafe { *qs.add(h * D + lane as usize * V + v) = yv };
        }
    }
    ctx.sync_threads();
    if (lane as usize) < groups {
        for h in 0..MAX_GROUP {
            if h < g {
                let gs = fmt.group_size as usize;
                let sum = (0..gs).map(|c| unsafe { *qs.add(h * D + lane as usize * gs + c) }).sum();
                unsafe { *qsum.add(h * groups + lane as usize) = sum };
            }
        }
    }
    ctx.sync_threads();

    // The split's positions, cut to the query token's window: its causal limit and, with
    // a sliding window, its first visible position (once per block: positions, and so
    // pages, below it are never read).
    let (begin, end) = p.split_range(split, len);
    let end = end.min(p.row_len(len, qi));
    let begin = begin.max(p.row_start(len, qi)).min(end);
    let mut m = [f32::NEG_INFINITY; MAX_GROUP];
    let mut l = [0f32; MAX_GROUP];
    let mut o = [[0f32; V]; MAX_GROUP];
    let mut t0 = begin;
    while t0 < end {
        let n = (end - t0).min(TILE);
        // Scores: one token per lane.
        let mut s = [f32::NEG_INFINITY; MAX_GROUP];
        // The lane's token is protected position `index` of the list (NONE if not).
        let mut index = NONE;
        if lane < n {
            let pos = t0 + lane;
            let mut loc = Loc::of(&fmt, pos, len);
            if loc.page != SIDE {
                for j in 0..fmt.protected {
                    // SAFETY: j < the list's length (contract).
                    if unsafe { *prot.add(j as usize) } == pos {
                        index = j;
                    }
                }
                if index != NONE {
                    loc = Loc { page: SIDE, row: fmt.protected_row(index) };
                }
            }
            let (row, page, slot) = if loc.page == SIDE {
                (unsafe { side.add(fmt.side_row_at(kvh, false, loc.row)) }.cast::<u8>(), core::ptr::null(), 0)
            } else {
                let base =
                    unsafe { pool.add(fmt.page_offset(p.block(*table.add(loc.page as usize)), kvh, p.num_kv_heads)) };
                (unsafe { base.add(fmt.key_codes_at(loc.row) as usize) }, base, loc.row)
            };
            unsafe { score_token::<C, D, KB>(ctx, &fmt, row, page, slot, qs, qsum, g, &mut s) };
        }
        // Online softmax over the tile, per query head.
        for h in 0..MAX_GROUP {
            if h >= g {
                continue;
            }
            let mut mx = s[h];
            let mut mask = 1;
            while mask < 32 {
                mx = mx.max(ctx.shfl_xor(mx, mask));
                mask *= 2;
            }
            let mn = m[h].max(mx);
            let c = exp_neg(m[h] - mn);
            s[h] = softmax_weight(s[h], mn);
            let mut sum = s[h];
            let mut mask = 1;
            while mask < 32 {
                sum += ctx.shfl_xor(sum, mask);
                mask *= 2;
            }
            l[h] = l[h] * c + sum;
            m[h] = mn;
            o[h].iter_mut().for_each(|x| *x *= c);
        }
        // Values: channels per lane, each token's weights (and protected index) by
        // shuffles.
        for t in 0..n {
            let mut loc = Loc::of(&fmt, t0 + t, len);
            if fmt.protected > 0 {
                let j = ctx.shfl_idx(f32::from_bits(index), t).to_bits();
                if j != NONE {
                    loc = Loc { page: SIDE, row: fmt.protected_row(j) };
                }
            }
            let val = unsafe { value_row::<V, VB>(p, loc, table, side, pool, kvh, lane) };
            for h in 0..MAX_GROUP {
                if h < g {
                    let w = ctx.shfl_idx(s[h], t);
                    for (ov, &x) in o[h].iter_mut().zip(&val) {
                        *ov += w * x;
                    }
                }
            }
        }
        t0 += n;
    }
    for h in 0..MAX_GROUP {
        if h < g {
            let row =
                ((row_base as usize + qi as usize) * hq + kvh as usize * g + h) * nsplit as usize + split as usize;
            if lane == 0 {
                unsafe {
                    *part_m.add(row) = m[h];
                    *part_l.add(row) = l[h];
                }
            }
            for (v, &ov) in o[h].iter().enumerate() {
                unsafe { *part_o.add(row * D + lane as usize * V + v) = ov };
            }
        }
    }
}

/// Calls `$m!` with every `decode_split` instantiation:
/// `(entry point, head_dim, channels per lane, key bits, value bits)`. The group size is
/// a runtime parameter, so these 12 cover all 36 configurations of
/// [`crate::for_each_config!`].
#[macro_export]
macro_rules! for_each_decode {
    ($m:ident) => {
        $m! {
            (rotkv_decode_split_d64_k2v2, 64, 2, 2, 2),
            (rotkv_decode_split_d64_k2v4, 64, 2, 2, 4),
            (rotkv_decode_split_d64_k4v2, 64, 2, 4, 2),
            (rotkv_decode_split_d64_k4v4, 64, 2, 4, 4),
            (rotkv_decode_split_d128_k2v2, 128, 4, 2, 2),
            (rotkv_decode_split_d128_k2v4, 128, 4, 2, 4),
            (rotkv_decode_split_d128_k4v2, 128, 4, 4, 2),
            (rotkv_decode_split_d128_k4v4, 128, 4, 4, 4),
            (rotkv_decode_split_d256_k2v2, 256, 8, 2, 2),
            (rotkv_decode_split_d256_k2v4, 256, 8, 2, 4),
            (rotkv_decode_split_d256_k4v2, 256, 8, 4, 2),
            (rotkv_decode_split_d256_k4v4, 256, 8, 4, 4)
        }
    };
}

#[cfg(target_arch = "nvptx64")]
mod entry {
    use super::decode_split;
    use crate::ctx::Nvptx;
    use crate::params::DecodeParams;

    macro_rules! decode_entries {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal)),* $(,)?) => {$(
            /// PTX entry point of [`decode_split`] for one (head_dim, key bits, value bits).
            ///
            /// # Safety
            /// See [`decode_split`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $name(
                p: DecodeParams,
                q: *const u8,
                pool: *const u8,
                block_tables: *const u32,
                seq_lens: *const u32,
                sides: *const u16,
                protected: *const u32,
                key_scale: *const f32,
                key_perm: *const u16,
                key_rot: *const f32,
                part_m: *mut f32,
                part_l: *mut f32,
                part_o: *mut f32,
                meta: *const u32,
            ) {
                // SAFETY: forwarded contract of `decode_split`.
                unsafe {
                    decode_split::<_, $d, $v, $kb, $vb>(
                        &Nvptx,
                        &p,
                        q,
                        pool,
                        block_tables,
                        seq_lens,
                        sides,
                        protected,
                        key_scale,
                        key_perm,
                        key_rot,
                        part_m,
                        part_l,
                        part_o,
                        meta,
                    )
                }
            }
        )*};
    }
    crate::for_each_decode!(decode_entries);
}
