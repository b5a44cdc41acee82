//! Append. `append_tokens` is the fused pass over new tokens (as vLLM's
//! reshape-and-cache): per token and KV head it loads K and V (f32, f16 or bf16),
//! subtracts the key mean, runs the FWHT in registers and shuffles (or the dense learned
//! rotation of the layer, when it has one), applies the channel
//! permutation and rounds to f16 (the stored row); then, as the token's slot mapping says,
//! either stores that row in the f16 side store (sinks and recent window) or quantizes it
//! into its page slot (group min/max by shuffles, f16 scale and zero, codes, packing).
//! Where each token goes is computed on the device from the sequence's block table and
//! protected list ([`destination`]), so an append uploads nothing but new block-table
//! entries. `append_flush` quantizes window rows that leave the window during an append
//! (a page of the ring fills), reading them from the side store; it runs before
//! `append_tokens`, which may overwrite those ring rows.

use crate::ctx::Ctx;
use crate::fwht::{dense_warp, fwht_warp, permute_warp};
use crate::layout::{Format, SIDE_PAGE, clip_range, div};
use crate::math::{f16_to_f32, f32_to_f16, f64_to_f16};
use crate::params::{
    AppendBatchParams, AppendParams, BATCH_ERROR_BATCH, BATCH_ERROR_BLOCK, BATCH_ERROR_NONFINITE, BATCH_NO_SLOT,
    FLAG_DENSE_KEYS, FLAG_DENSE_VALUES, FLAG_ROTATE_KEYS, FLAG_ROTATE_VALUES, load_elem,
};

/// Where a token's f16 rows and codes go: resolved on the device from the sequence's
/// block table and protected list (no host-made slot mapping; offsets in 64 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dest {
    /// The f16 side row (sink or window ring row), or `NONE` for a quantized token.
    pub side_row: u32,
    /// The physical block of a quantized token (`NONE` otherwise, or when the table
    /// entry is past the pool: then nothing is written).
    pub block: u32,
    /// Its slot in the page.
    pub slot: u32,
    /// The side row of its protected copy, or `NONE`.
    pub copy_row: u32,
}

/// "None" in a [`Dest`] field, and the padding of a protected list.
pub const NONE: u32 = u32::MAX;

/// Where position `pos` goes when the sequence will hold `p.new_len` tokens.
///
/// # Safety
/// `block_table` valid for `p.format.pages_for(p.new_len)` entries; `protected` for
/// `p.format.protected` entries (ascending positions padded with [`NONE`]; unused when
/// `p.format.protected == 0`).
#[inline(always)]
pub unsafe fn destination(p: &AppendParams, pos: u32, block_table: *const u32, protected: *const u32) -> Dest {
    let fmt = &p.format;
    let mut d = Dest { side_row: NONE, block: NONE, slot: 0, copy_row: NONE };
    // (The scalar form of `place`: an enum here ends up in local memory on the device.)
    let (page, row) = fmt.locate(pos, p.new_len);
    if page == SIDE_PAGE {
        d.side_row = row;
    } else {
        // SAFETY: page < pages_for(new_len) (contract).
        let block = unsafe { *block_table.add(page as usize) };
        if block < p.num_blocks {
            d.block = block;
        }
        d.slot = row;
    }
    for i in 0..fmt.protected {
        // SAFETY: i < fmt.protected entries (contract).
        if unsafe { *protected.add(i as usize) } == pos {
            d.copy_row = fmt.protected_row(i);
        }
    }
    d
}

/// Fused append of new tokens: stored f16 rows, then f16 side rows or page slots.
///
/// # Safety
/// `k` valid at element `t * p.token_stride + h * p.head_stride + c` and `v` at element
/// `t * p.v_token_stride + h * p.head_stride + c` for `t < p.count`, `h < p.num_kv_heads`,
/// `c < D`; `key_mean` and `key_scale` (finite, > 0) for `Hkv * D` reads; `key_perm` and
/// `value_perm` for `Hkv * D` (rows are permutations of `0..D`); `key_rot` (with
/// `FLAG_DENSE_KEYS`) and `value_rot` (with `FLAG_DENSE_VALUES`) for `Hkv * D * D`
/// (unused, and may be null, without the flag); `block_table` and `protected` as
/// [`destination`] asks; `pool` a 16-byte aligned pool of `p.num_blocks` blocks of
/// `p.format`'s head-pages with `p.num_kv_heads` heads per block; `side` a side store of
/// `p.format.side_elems(p.num_kv_heads)` f16 entries; `seq_len` null or one writable
/// u32. `D == 32 * V == p.format.head_dim`. Grid `(Hkv, count, 1)`, 32 threads.
///
/// # Parameters
/// Token `t` is position `p.start + t` of a sequence that holds `p.new_len` tokens after
/// the append; it goes where [`destination`] says: its f16 side row (sink or window), or
/// its page slot through the block table; a protected position's f16 rows are also
/// copied to its protected side row. Keys and values both. A table entry at or past
/// `p.num_blocks` is skipped (never written out of the pool). The launch that holds the
/// last token (`p.start + p.count == p.new_len`) stores `p.new_len` at `seq_len` (when
/// not null): the device keeps the sequence length, with no upload.
///
/// # Thread mapping
/// Block `(h, t)`, one warp; lane `i` owns channels `[i * V, (i + 1) * V)` of the row: it
/// loads them, subtracts the key mean and divides by the key scale (f32 `(k - mu) / s`), runs the warp FWHT (or the dense rotation: `D`
/// shuffles and `D * V` multiply-adds per lane), gathers the permutation with
/// indexed shuffles and rounds to f16; then it stores its channels of the side row, or
/// quantizes them with the group's lanes (`quantize_lanes`: the group's min and max by
/// shuffles, f16 scale and zero, packed codes). Values first, then keys: a token with a
/// non-finite key or value is stored with a NaN key and a finite value (its non-finite
/// value channels as 0), so that only the rows that can see it decode to NaN. Lane 0 of
/// block `(0, 0)` writes the length.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn append_tokens<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    p: &AppendParams,
    k: *const u8,
    v: *const u8,
    key_mean: *const f32,
    key_scale: *const f32,
    key_perm: *const u16,
    value_perm: *const u16,
    key_rot: *const f32,
    value_rot: *const f32,
    block_table: *const u32,
    protected: *const u32,
    pool: *mut u8,
    side: *mut u16,
    seq_len: *mut u32,
) {
    let [h, t, _] = ctx.block_idx();
    // SAFETY: forwarded contract; input row `t` is token `t`; no error counters.
    unsafe {
        append_row::<C, D, V>(
            ctx,
            p,
            h,
            t,
            t,
            k,
            v,
            key_mean,
            key_scale,
            key_perm,
            value_perm,
            key_rot,
            value_rot,
            block_table,
            protected,
            pool,
            side,
            seq_len,
            core::ptr::null_mut(),
        )
    }
}

/// The body of [`append_tokens`] for token `t` of the append `p` (position `p.start +
/// t`) and KV head `h`, read from input row `row` of `k` and `v`; a warp. When `errors`
/// is not null, a token whose block-table entry is at or past `p.num_blocks` adds 2 (its
/// K and V rows) to `errors[BATCH_ERROR_BLOCK]`.
///
/// # Safety
/// As [`append_tokens`], with `row` in place of the block's `t` for the inputs; `errors`
/// null or [`crate::params::BATCH_ERRORS`] writable u32.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn append_row<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    p: &AppendParams,
    h: u32,
    t: u32,
    row: u32,
    k: *const u8,
    v: *const u8,
    key_mean: *const f32,
    key_scale: *const f32,
    key_perm: *const u16,
    value_perm: *const u16,
    key_rot: *const f32,
    value_rot: *const f32,
    block_table: *const u32,
    protected: *const u32,
    pool: *mut u8,
    side: *mut u16,
    seq_len: *mut u32,
    errors: *mut u32,
) {
    let fmt = &p.format;
    let lane = ctx.lane() as usize;
    let head = h as usize * p.head_stride as usize + lane * V;
    let k_src = row as usize * p.token_stride as usize + head;
    let v_src = row as usize * p.v_token_stride as usize + head;
    // SAFETY: the table and list as the contract gives them.
    let dest = unsafe { destination(p, p.start + t, block_table, protected) };
    if h == 0 && t == 0 && lane == 0 && !seq_len.is_null() && p.start + p.count == p.new_len {
        // SAFETY: one writable u32 (contract).
        unsafe { *seq_len = p.new_len };
    }
    if dest.side_row == NONE && dest.block == NONE && lane == 0 && !errors.is_null() {
        // SAFETY: the counters (contract).
        unsafe { ctx.atomic_add_u32(errors.add(BATCH_ERROR_BLOCK), 2) };
    }
    // Values, then keys. (A range, not a loop over `[false, true]`: an array iterator
    // whose loop is not unrolled lives in local memory on the device, and a closure
    // called twice is not inlined.)
    // A token whose key or value has a NaN or infinity is stored with a NaN key and a
    // finite value (its non-finite value channels as 0): every row that can see it scores
    // NaN and decodes to NaN, while a row that cannot (masked by causality or a sliding
    // window, whose score is -inf whatever the key) multiplies a finite value by 0 and
    // stays finite. Values first, so the key knows.
    let mut poison = false;
    for half in 0..2 {
        let value = half == 0;
        // SAFETY (raw accesses): inside the sizes of the `# Safety` contract.
        // (A constant-bound loop, not `array::from_fn`: the body has two callers, and the
        // closure of a from_fn is not always inlined into both: a call with the array on
        // the stack.)
        let mut x = [0.0f32; V];
        for (c, xc) in x.iter_mut().enumerate() {
            *xc = unsafe {
                if value {
                    load_elem(v, p.input_dtype, v_src + c)
                } else {
                    let at = h as usize * D + lane * V + c;
                    (load_elem(k, p.input_dtype, k_src + c) - *key_mean.add(at)) / *key_scale.add(at)
                }
            };
        }
        // Whether the row has a non-finite channel: an OR over the warp.
        let mut nf = x.iter().fold(0u32, |a, &xc| a | !xc.is_finite() as u32);
        let mut mask = 1;
        while mask < 32 {
            nf |= ctx.shfl_xor(f32::from_bits(nf), mask).to_bits();
            mask *= 2;
        }
        if nf != 0 && lane == 0 && !errors.is_null() {
            // The step's counters say how many such rows there were (one atomic each).
            // SAFETY: the counters (contract).
            unsafe { ctx.atomic_add_u32(errors.add(BATCH_ERROR_NONFINITE), 1) };
        }
        if value {
            poison = nf != 0;
            for xc in x.iter_mut() {
                if !xc.is_finite() {
                    *xc = 0.0;
                }
            }
        } else if nf != 0 || poison {
            x = [f32::NAN; V];
        }
        let (dense, hadamard, rot) = if value {
            (FLAG_DENSE_VALUES, FLAG_ROTATE_VALUES, value_rot)
        } else {
            (FLAG_DENSE_KEYS, FLAG_ROTATE_KEYS, key_rot)
        };
        if p.flags & dense != 0 {
            // SAFETY: the head's D x D matrix (contract, with the flag set).
            x = unsafe { dense_warp::<C, V, false>(ctx, &x, rot.add(h as usize * D * D)) };
        } else if p.flags & hadamard != 0 {
            fwht_warp(ctx, &mut x);
        }
        let perm = if value { value_perm } else { key_perm };
        let y = unsafe { permute_warp(ctx, &x, perm.add(h as usize * D)) };
        let stored: [u16; V] = core::array::from_fn(|c| f32_to_f16(y[c]));
        // The side row, then the protected copy's row (a range again, see above).
        for which in 0..2 {
            let row = if which == 0 { dest.side_row } else { dest.copy_row };
            if row != NONE {
                let at = fmt.side_row_at(h, value, row) + lane * V;
                for (c, &s) in stored.iter().enumerate() {
                    // SAFETY: a side row below side_rows(); lane * V + c < D.
                    unsafe { *side.add(at + c) = s };
                }
            }
        }
        if dest.block != NONE {
            // SAFETY: the block is below p.num_blocks, inside the pool (contract).
            unsafe { quantize_lanes::<C, V>(ctx, fmt, p.num_kv_heads, value, &stored, pool, dest.block, dest.slot, h) };
        }
    }
}

/// Window positions of a sequence of `p.start` tokens whose page fills when it grows
/// to `p.new_len`: `[first, first + n)` as `(first, n)`. Those rows are quantized from
/// the side store by [`append_flush`] before [`append_tokens`] may overwrite their ring
/// rows.
#[inline]
pub const fn flush_range(p: &AppendParams) -> (u32, u32) {
    let fmt = &p.format;
    let first = fmt.sinks + fmt.quantized_len(p.start);
    let end = fmt.sinks + fmt.quantized_len(p.new_len);
    let end = if end < p.start { end } else { p.start };
    (first, end.saturating_sub(first))
}

/// Quantizes the window rows that leave the window during an append (see
/// [`flush_range`]): block `(i, h, kv)` moves position `first + i` of KV head `h` from its
/// window ring row into its page slot; keys for `kv == 0`, values for 1.
///
/// # Safety
/// `block_table` valid for `p.format.pages_for(p.new_len)` entries; `side` a side store
/// of `p.format.side_elems(p.num_kv_heads)` f16 entries; `pool` a 16-byte aligned pool of
/// `p.num_blocks` blocks of `p.format`'s head-pages with `p.num_kv_heads` heads per
/// block. `D == 32 * V == p.format.head_dim`. Grid `(n, Hkv, 2)` with `(first, n) =
/// flush_range(p)`, 32 threads.
///
/// # Parameters
/// `p.start` is the length before the append, `p.new_len` after it. The rows are the
/// stored f16 rows, so the codes equal those a one-shot append writes. A table entry at
/// or past `p.num_blocks` is skipped.
///
/// # Thread mapping
/// Block `(i, h, kv)`, one warp; lane `i` reads channels `[i * V, (i + 1) * V)` of the row
/// and quantizes them with its group's lanes (`quantize_lanes`, as `append_tokens` does).
#[inline(always)]
pub unsafe fn append_flush<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    p: &AppendParams,
    block_table: *const u32,
    side: *const u16,
    pool: *mut u8,
) {
    let [i, head, value] = ctx.block_idx();
    // SAFETY: forwarded contract; no error counters.
    unsafe {
        flush_row::<C, D, V>(
            ctx,
            p,
            flush_range(p).0 + i,
            head,
            value != 0,
            block_table,
            side,
            pool,
            core::ptr::null_mut(),
        )
    }
}

/// The body of [`append_flush`] for window position `pos` (inside [`flush_range`]), KV
/// head `head`, keys or values; a warp. When `errors` is not null, a table entry at or
/// past `p.num_blocks` adds 1 to `errors[BATCH_ERROR_BLOCK]`.
///
/// # Safety
/// As [`append_flush`]; `errors` null or [`crate::params::BATCH_ERRORS`] writable u32.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn flush_row<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    p: &AppendParams,
    pos: u32,
    head: u32,
    value: bool,
    block_table: *const u32,
    side: *const u16,
    pool: *mut u8,
    errors: *mut u32,
) {
    let fmt = &p.format;
    let lane = ctx.lane() as usize;
    let (page, slot) = fmt.locate(pos, p.new_len);
    if page == SIDE_PAGE {
        return;
    }
    // SAFETY: page < pages_for(new_len) (contract).
    let block = unsafe { *block_table.add(page as usize) };
    if block >= p.num_blocks {
        if lane == 0 && !errors.is_null() {
            // SAFETY: the counters (contract).
            unsafe { ctx.atomic_add_u32(errors.add(BATCH_ERROR_BLOCK), 1) };
        }
        return;
    }
    let at = fmt.side_row_at(head, value, fmt.window_row(pos)) + lane * V;
    // SAFETY (raw accesses): inside the sizes of the `# Safety` contract.
    let stored: [u16; V] = core::array::from_fn(|c| unsafe { *side.add(at + c) });
    // SAFETY: the block is inside the pool (checked above).
    unsafe { quantize_lanes::<C, V>(ctx, fmt, p.num_kv_heads, value, &stored, pool, block, slot, head) };
}

/// Window rows one block of [`append_batch_flush`] quantizes (in a loop).
pub const FLUSH_ROWS_PER_BLOCK: u32 = 8;

/// The most window rows one sequence flushes in a step of at most `max_rows` new tokens:
/// a multiple of the page size, `page_size * ceil(max_rows / page_size)` (the quantized
/// length grows by whole pages, at most that many in `max_rows` tokens).
#[inline]
pub const fn batch_flush_rows(fmt: &Format, max_rows: u32) -> u32 {
    max_rows.div_ceil(fmt.page_size) * fmt.page_size
}

/// Grid of [`append_batch_flush`]: `(ceil(batch_flush_rows / FLUSH_ROWS_PER_BLOCK), Hkv,
/// 2 * max_seqs)`.
#[inline]
pub const fn batch_flush_grid(bp: &AppendBatchParams) -> [u32; 3] {
    let rows = batch_flush_rows(&bp.append.format, bp.max_rows);
    [rows.div_ceil(FLUSH_ROWS_PER_BLOCK), bp.append.num_kv_heads, 2 * bp.max_seqs]
}

/// Grid of [`append_batch_tokens`]: `(Hkv, max_rows, 1)`.
#[inline]
pub const fn batch_tokens_grid(bp: &AppendBatchParams) -> [u32; 3] {
    [bp.append.num_kv_heads, bp.max_rows, 1]
}

/// The append of slot `slot` in a step batch (`meta`, see [`AppendBatchParams`]) as
/// [`AppendParams`], and whether it is consistent: the slot below `bp.max_seqs`, its new
/// length within `u32` (at most `u32::MAX / 2`, the format's limit) and its pages within
/// `bp.table_stride` entries. The first row is returned beside it.
///
/// # Safety
/// `meta` valid for [`crate::params::batch_meta_len`]`(bp.max_rows, bp.max_seqs)` entries.
#[inline(always)]
unsafe fn slot_append(bp: &AppendBatchParams, meta: *const u32, slot: u32) -> (bool, AppendParams, u32) {
    let (rows, seqs) = (bp.max_rows as usize, bp.max_seqs as usize);
    let mut p = bp.append;
    if slot >= bp.max_seqs {
        return (false, p, 0);
    }
    let s = slot as usize;
    // SAFETY: s < max_seqs, inside the three per-slot arrays (contract).
    let (start, count, first) =
        unsafe { (*meta.add(rows + s), *meta.add(rows + seqs + s), *meta.add(rows + 2 * seqs + s)) };
    p.start = start;
    p.count = count;
    p.new_len = start.wrapping_add(count);
    let ok = start <= u32::MAX / 2
        && count <= u32::MAX / 2 - start
        && p.format.pages_for(p.new_len) <= bp.table_stride
        && first <= bp.max_rows
        && count <= bp.max_rows - first;
    (ok, p, first)
}

/// Window rows that leave the window during a step, for every sequence of a step batch
/// (the batched [`append_flush`]): block `(x, h, 2 * s + kv)` quantizes rows `x *
/// FLUSH_ROWS_PER_BLOCK ..` (at most [`FLUSH_ROWS_PER_BLOCK`]) of slot `s`'s
/// [`flush_range`], KV head `h`, keys for `kv == 0` and values for 1. Must run before the
/// same step's [`append_batch_tokens`] (it reads the ring rows those may overwrite).
///
/// # Safety
/// `meta` a step batch of [`crate::params::batch_meta_len`]`(bp.max_rows, bp.max_seqs)`
/// entries; `tables` `bp.max_seqs` block tables of `bp.table_stride` entries; `sides`
/// `bp.max_seqs` side stores of `side_elems(Hkv)` f16; `pool` as [`append_flush`];
/// `errors` null or [`crate::params::BATCH_ERRORS`] writable u32. Grid
/// [`batch_flush_grid`], 32 threads. The slots' lengths in `meta` are the sequences'
/// lengths before the step.
///
/// # Parameters
/// A slot with no new tokens, or whose step is inconsistent (its slot past `max_seqs`,
/// its length past `u32::MAX / 2` or its pages past the table; the tokens kernel counts
/// it), flushes nothing. Table entries at or past the pool's blocks are skipped and
/// counted in `errors[BATCH_ERROR_BLOCK]`.
///
/// # Thread mapping
/// One warp per block, looping over its rows; each row as [`append_flush`]'s block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn append_batch_flush<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    bp: &AppendBatchParams,
    meta: *const u32,
    tables: *const u32,
    sides: *const u16,
    pool: *mut u8,
    errors: *mut u32,
) {
    let [x, head, z] = ctx.block_idx();
    let (slot, value) = (z >> 1, z & 1 != 0);
    // SAFETY: the step batch (contract).
    let (ok, p, _) = unsafe { slot_append(bp, meta, slot) };
    if !ok || p.count == 0 {
        return;
    }
    let (first, n) = flush_range(&p);
    let side_elems = p.format.side_elems(p.num_kv_heads);
    // SAFETY: slot < max_seqs (checked by slot_append): inside the tables and sides.
    let (table, side) =
        unsafe { (tables.add(slot as usize * bp.table_stride as usize), sides.add(slot as usize * side_elems)) };
    let mut i = x * FLUSH_ROWS_PER_BLOCK;
    let end = if n < i + FLUSH_ROWS_PER_BLOCK { n } else { i + FLUSH_ROWS_PER_BLOCK };
    while i < end {
        // SAFETY: pages_for(new_len) <= table_stride (slot_append); the slot's side store.
        unsafe { flush_row::<C, D, V>(ctx, &p, first + i, head, value, table, side, pool, errors) };
        i += 1;
    }
}

/// The new tokens of every sequence of a step batch, one launch (the batched
/// [`append_tokens`], vLLM's reshape-and-cache): block `(h, r)` stores input row `r`
/// (KV head `h`) of `k` and `v` at its slot's next position, as [`append_tokens`] does,
/// and the block of a slot's first row stores the slot's new length in `lens[slot]`.
///
/// # Safety
/// `k` and `v` valid for `bp.max_rows` rows at their strides (as [`append_tokens`] asks
/// for `count` tokens); `meta`, `tables`, `sides`, `errors` as [`append_batch_flush`];
/// `protected` `bp.max_seqs` lists of `bp.protected_stride` entries; `lens` `bp.max_seqs`
/// writable u32; the calibration buffers and `pool` as [`append_tokens`]. Grid
/// [`batch_tokens_grid`], 32 threads.
///
/// # Parameters
/// An input row whose slot is [`BATCH_NO_SLOT`] is skipped. A row whose slot is past
/// `bp.max_seqs`, that lies outside its slot's rows, or whose slot's step is
/// inconsistent (a length or pages past the limits) is skipped and counted in
/// `errors[BATCH_ERROR_BATCH]` (one per KV head); table entries at or past the pool's
/// blocks in `errors[BATCH_ERROR_BLOCK]`. Nothing is read or written outside the
/// buffers the contract names.
///
/// # Thread mapping
/// As [`append_tokens`]: one warp per (KV head, row).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn append_batch_tokens<C: Ctx, const D: usize, const V: usize>(
    ctx: &C,
    bp: &AppendBatchParams,
    meta: *const u32,
    k: *const u8,
    v: *const u8,
    key_mean: *const f32,
    key_scale: *const f32,
    key_perm: *const u16,
    value_perm: *const u16,
    key_rot: *const f32,
    value_rot: *const f32,
    tables: *const u32,
    protected: *const u32,
    pool: *mut u8,
    sides: *mut u16,
    lens: *mut u32,
    errors: *mut u32,
) {
    let [h, r, _] = ctx.block_idx();
    // SAFETY: r < max_rows (grid): inside the rows' slots.
    let slot = unsafe { *meta.add(r as usize) };
    if slot == BATCH_NO_SLOT {
        return;
    }
    // SAFETY: the step batch (contract).
    let (ok, p, first) = unsafe { slot_append(bp, meta, slot) };
    let t = r.wrapping_sub(first);
    if !ok || t >= p.count {
        if ctx.lane() == 0 && !errors.is_null() {
            // SAFETY: the counters (contract).
            unsafe { ctx.atomic_add_u32(errors.add(BATCH_ERROR_BATCH), 1) };
        }
        return;
    }
    let s = slot as usize;
    let side_elems = p.format.side_elems(p.num_kv_heads);
    // SAFETY: s < max_seqs (slot_append): the slot's table (pages_for(new_len) <=
    // table_stride), protected list, side store and length; row r < max_rows.
    unsafe {
        append_row::<C, D, V>(
            ctx,
            &p,
            h,
            t,
            r,
            k,
            v,
            key_mean,
            key_scale,
            key_perm,
            value_perm,
            key_rot,
            value_rot,
            tables.add(s * bp.table_stride as usize),
            protected.add(s * bp.protected_stride as usize),
            pool,
            sides.add(s * side_elems),
            lens.add(s),
            errors,
        )
    }
}

/// Quantizes one stored row held by a warp (lane `i`: channels `[i * V, (i + 1) * V)`, f16
/// bits) into slot `slot` of the head-page of `head` in block `block`: packed codes plus
/// the f16 scale and zero of each group, exactly as `rotkv::reference::quantize_row`
/// defines them (the range clipped by `fmt.clip(value)`, scale and zero in f64 from the
/// f16 inputs, codes rounded half away from zero and clamped). A group of g channels is `g / V` consecutive lanes, reduced with butterfly
/// shuffles for its min and max; the lanes sharing a 32-bit word of codes OR their parts
/// together with shuffles and the first of them stores the word; the group's first lane
/// stores scale and zero.
///
/// # Safety
/// `block` inside `pool` (a 16-byte aligned pool of `fmt`'s head-pages, `num_kv_heads`
/// per block), `head < num_kv_heads`, `slot < fmt.page_size`, `32 * V == fmt.head_dim`,
/// bits 2 or 4.
///
/// # Thread mapping
/// Every lane of the warp must call it (it shuffles).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn quantize_lanes<C: Ctx, const V: usize>(
    ctx: &C,
    fmt: &Format,
    num_kv_heads: u32,
    value: bool,
    stored: &[u16; V],
    pool: *mut u8,
    block: u32,
    slot: u32,
    head: u32,
) {
    let lane = ctx.lane();
    let bits = fmt.bits(value);
    let top = (1u32 << bits) - 1;
    let x: [f32; V] = core::array::from_fn(|c| f16_to_f32(stored[c]));
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
    let (lo, hi) = clip_range(lo as f64, hi as f64, fmt.clip(value));
    let scale = f64_to_f16((hi - lo) / top as f64);
    let zero = f64_to_f16(lo);
    let (s, z) = (f16_to_f32(scale) as f64, f16_to_f32(zero) as f64);
    // Codes, packed into this lane's share of its 32-bit word.
    let bit0 = lane * V as u32 * bits;
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
            r.min(top)
        };
        part |= code << ((bit0 + c as u32 * bits) % 32);
    }
    // V * bits is 4, 8, 16 or 32: a word holds the parts of 32 / (V * bits) lanes.
    let word_lanes = div(32, V as u32 * bits).max(1);
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

/// Calls `$m!` with every append instantiation: `(tokens entry, flush entry, head_dim,
/// channels per lane)`.
#[macro_export]
macro_rules! for_each_append {
    ($m:ident) => {
        $m! {
            (rotkv_append_tokens_d64, rotkv_append_flush_d64, 64, 2),
            (rotkv_append_tokens_d128, rotkv_append_flush_d128, 128, 4),
            (rotkv_append_tokens_d256, rotkv_append_flush_d256, 256, 8)
        }
    };
}

/// Calls `$m!` with every batched-append instantiation: `(tokens entry, flush entry,
/// head_dim, channels per lane)`.
#[macro_export]
macro_rules! for_each_append_batch {
    ($m:ident) => {
        $m! {
            (rotkv_append_batch_tokens_d64, rotkv_append_batch_flush_d64, 64, 2),
            (rotkv_append_batch_tokens_d128, rotkv_append_batch_flush_d128, 128, 4),
            (rotkv_append_batch_tokens_d256, rotkv_append_batch_flush_d256, 256, 8)
        }
    };
}

#[cfg(target_arch = "nvptx64")]
mod entry {
    use super::{append_batch_flush, append_batch_tokens, append_flush, append_tokens};
    use crate::ctx::Nvptx;
    use crate::params::{AppendBatchParams, AppendParams};

    macro_rules! append_entries {
        ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {$(
            /// PTX entry point of [`append_tokens`].
            ///
            /// # Safety
            /// See [`append_tokens`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $tok(
                p: AppendParams,
                k: *const u8,
                v: *const u8,
                key_mean: *const f32,
                key_scale: *const f32,
                key_perm: *const u16,
                value_perm: *const u16,
                key_rot: *const f32,
                value_rot: *const f32,
                block_table: *const u32,
                protected: *const u32,
                pool: *mut u8,
                side: *mut u16,
                seq_len: *mut u32,
            ) {
                // SAFETY: forwarded contract.
                unsafe {
                    append_tokens::<_, $d, $v>(
                        &Nvptx, &p, k, v, key_mean, key_scale, key_perm, value_perm, key_rot, value_rot, block_table,
                        protected, pool, side, seq_len,
                    )
                }
            }

            /// PTX entry point of [`append_flush`].
            ///
            /// # Safety
            /// See [`append_flush`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $flush(
                p: AppendParams,
                block_table: *const u32,
                side: *const u16,
                pool: *mut u8,
            ) {
                // SAFETY: forwarded contract.
                unsafe { append_flush::<_, $d, $v>(&Nvptx, &p, block_table, side, pool) }
            }
        )*};
    }
    crate::for_each_append!(append_entries);

    macro_rules! append_batch_entries {
        ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {$(
            /// PTX entry point of [`append_batch_tokens`].
            ///
            /// # Safety
            /// See [`append_batch_tokens`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $tok(
                bp: AppendBatchParams,
                meta: *const u32,
                k: *const u8,
                v: *const u8,
                key_mean: *const f32,
                key_scale: *const f32,
                key_perm: *const u16,
                value_perm: *const u16,
                key_rot: *const f32,
                value_rot: *const f32,
                tables: *const u32,
                protected: *const u32,
                pool: *mut u8,
                sides: *mut u16,
                lens: *mut u32,
                errors: *mut u32,
            ) {
                // SAFETY: forwarded contract.
                unsafe {
                    append_batch_tokens::<_, $d, $v>(
                        &Nvptx, &bp, meta, k, v, key_mean, key_scale, key_perm, value_perm, key_rot, value_rot,
                        tables, protected, pool, sides, lens, errors,
                    )
                }
            }

            /// PTX entry point of [`append_batch_flush`].
            ///
            /// # Safety
            /// See [`append_batch_flush`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $flush(
                bp: AppendBatchParams,
                meta: *const u32,
                tables: *const u32,
                sides: *const u16,
                pool: *mut u8,
                errors: *mut u32,
            ) {
                // SAFETY: forwarded contract.
                unsafe { append_batch_flush::<_, $d, $v>(&Nvptx, &bp, meta, tables, sides, pool, errors) }
            }
        )*};
    }
    crate::for_each_append_batch!(append_batch_entries);
}
