//! `#[repr(C)]` parameter blocks, one per kernel family.
//!
//! Kernels take raw pointers plus one of these by value; strides are in elements. The
//! host fills them after validation; every backend (cpu, sim, cuda) is driven by the
//! same values, so a launch is described once.

use crate::layout::Format;

/// Keys are rotated by the Hadamard transform before quantization.
pub const FLAG_ROTATE_KEYS: u32 = 1 << 0;
/// Values are rotated by the Hadamard transform before quantization.
pub const FLAG_ROTATE_VALUES: u32 = 1 << 1;
/// `decode_merge` writes f16 outputs (else f32, or bf16 with [`FLAG_OUTPUT_BF16`]).
pub const FLAG_OUTPUT_F16: u32 = 1 << 2;
/// `decode_merge` writes bf16 outputs (round to nearest even).
pub const FLAG_OUTPUT_BF16: u32 = 1 << 5;
/// Keys are rotated by a dense per-head `D x D` matrix (a learned rotation) instead of
/// the Hadamard transform; the kernels get the matrices as `[kv_head][D][D]` f32.
pub const FLAG_DENSE_KEYS: u32 = 1 << 3;
/// Values are rotated by a dense per-head matrix (see [`FLAG_DENSE_KEYS`]).
pub const FLAG_DENSE_VALUES: u32 = 1 << 4;

/// Element type of the K/V inputs of `append_tokens` and of the decode queries: f32.
pub const DTYPE_F32: u32 = 0;
/// Element type of the K/V inputs and queries: IEEE f16.
pub const DTYPE_F16: u32 = 1;
/// Element type of the K/V inputs and queries: bf16.
pub const DTYPE_BF16: u32 = 2;

/// Element `i` of an input of type `dtype` (`DTYPE_*`; anything else reads f32), as f32.
///
/// # Safety
/// `x` valid for element `i` of that type.
#[inline(always)]
pub unsafe fn load_elem(x: *const u8, dtype: u32, i: usize) -> f32 {
    // SAFETY: forwarded contract.
    unsafe {
        match dtype {
            DTYPE_F16 => crate::math::f16_to_f32(*x.cast::<u16>().add(i)),
            DTYPE_BF16 => f32::from_bits((*x.cast::<u16>().add(i) as u32) << 16),
            _ => *x.cast::<f32>().add(i),
        }
    }
}

/// Parameters of the fused append (rotate, quantize, pack, store) of new tokens of one
/// sequence and one layer.
///
/// Layout (`#[repr(C)]`, shared with the PTX entry points, which take it by value): the
/// [`Format`], then ten `u32` fields in declaration order, no padding. K and V each have
/// their own token stride (`token_stride`, `v_token_stride`: a K read from a fused QKV
/// row next to a contiguous V, say); the head stride is shared.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct AppendParams {
    /// Cache shape.
    pub format: Format,
    /// KV heads of the layer.
    pub num_kv_heads: u32,
    /// Position of the first token of this launch (for `append_flush`: the sequence
    /// length before the append).
    pub start: u32,
    /// Number of tokens of this launch.
    pub count: u32,
    /// The sequence length once the whole append is done (where every token lives
    /// depends on it: `Format::place(pos, new_len)`). A long append is launched in
    /// chunks that share it.
    pub new_len: u32,
    /// Blocks in the layer's pool: a block-table entry at or past it is not written
    /// (the device cannot report an error; the host checks the tables it builds).
    pub num_blocks: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Elements between consecutive tokens of the K input.
    pub token_stride: u32,
    /// Elements between consecutive tokens of the V input (equal to `token_stride` when
    /// K and V share a layout).
    pub v_token_stride: u32,
    /// Elements between consecutive heads of the K and V inputs (both).
    pub head_stride: u32,
    /// Element type of the K and V inputs (`DTYPE_*`).
    pub input_dtype: u32,
}

// The layout the doc comment states: the format, then ten u32, no padding.
const _: () = assert!(core::mem::size_of::<AppendParams>() == core::mem::size_of::<Format>() + 10 * 4);
const _: () = assert!(core::mem::align_of::<AppendParams>() == 4);

/// Parameters of the batched append (`append_batch_flush`, `append_batch_tokens`): the
/// new tokens of every sequence of a serving step, one layer, in one launch each.
///
/// The step's rows are described by a `u32` array in device memory (the step batch,
/// [`batch_meta_len`] entries): `[0, max_rows)` the slot of each input row
/// ([`BATCH_NO_SLOT`] for an unused row); then per slot its length before the step
/// (`start`), its new tokens (`count`) and the input row of its first new token
/// (`first_row`), `max_seqs` entries each. Slot `s`'s tokens are input rows `first_row
/// .. first_row + count`, positions `start .. start + count`.
///
/// Layout (`#[repr(C)]`, taken by value by the PTX entry points): an [`AppendParams`]
/// (its `start`, `count` and `new_len` unused: they come from the step batch), then four
/// `u32`, no padding.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct AppendBatchParams {
    /// Format, heads, pool blocks, flags, input strides and dtype of the layer's append.
    pub append: AppendParams,
    /// Sequence slots of the layer the step batch may name (`s < max_seqs`).
    pub max_seqs: u32,
    /// Input rows of the step (grid y of `append_batch_tokens`).
    pub max_rows: u32,
    /// Block-table entries per slot (a slot's table is `tables + s * table_stride`); a
    /// sequence that would need more pages is skipped and counted as an error.
    pub table_stride: u32,
    /// Entries of a slot's protected list (`protected + s * protected_stride`).
    pub protected_stride: u32,
}

const _: () = assert!(core::mem::size_of::<AppendBatchParams>() == core::mem::size_of::<AppendParams>() + 4 * 4);

/// A step batch's row slot for an input row that carries no token.
pub const BATCH_NO_SLOT: u32 = u32::MAX;

/// `u32` entries of a step batch of `max_rows` rows over `max_seqs` slots: the rows'
/// slots, then each slot's start, count and first row.
#[inline]
pub const fn batch_meta_len(max_rows: u32, max_seqs: u32) -> usize {
    max_rows as usize + 3 * max_seqs as usize
}

/// Device-side error counters of the batched append (a `u32` array of [`BATCH_ERRORS`]
/// entries the caller reads after the step): what the host could not see and the
/// kernels skipped instead of reading or writing out of bounds.
pub const BATCH_ERRORS: usize = 3;
/// Error counter: (token, KV head) rows not stored because the step batch was
/// inconsistent (a row's slot past `max_seqs`, a row outside its slot's rows, a slot's
/// rows past the batch's, a length past `u32::MAX / 2` or past the slot's block table).
/// The contract that each slot's rows `first .. first + count` name that slot is the
/// caller's: a row there naming another slot is stored (or counted) as that slot's.
pub const BATCH_ERROR_BATCH: usize = 0;
/// Error counter: (token or flushed row, KV head, K|V) rows not stored because their
/// block-table entry is at or past the pool's blocks.
pub const BATCH_ERROR_BLOCK: usize = 1;
/// Not an error of the batch: (token, KV head, K|V) input rows with a NaN or infinity
/// (stored as they come: the rows that attend to them decode to NaN), counted so that a
/// stack can find a bad step without reading K/V on the host.
pub const BATCH_ERROR_NONFINITE: usize = 2;

/// Parameters of the split-K decode of `q_len` query tokens per sequence.
///
/// The queries (and the output) are `[num_seqs][q_len][num_q_heads][head_dim]`: row `i`
/// of a sequence of `len` tokens is the token at position `q = len - q_len + i` and
/// attends causally, to positions `0 ..= q`, or with a sliding window
/// (`attn_window = W > 0`) to the `W` newest of them, `q + 1 - W ..= q` (clipped at 0).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct DecodeParams {
    /// Cache shape.
    pub format: Format,
    /// Sequences in the batch.
    pub num_seqs: u32,
    /// Query heads (a multiple of `num_kv_heads`).
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Splits of each sequence's visible positions `[a, len)` (`a` =
    /// [`DecodeParams::visible_start`]: 0 without a window); split `i` covers
    /// `[a + i * c, min(a + (i + 1) * c, len))` with `c = ceil((len - a) / num_splits)`.
    pub num_splits: u32,
    /// Entries per block-table row.
    pub block_table_stride: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Softmax scale applied to `q . k`.
    pub sm_scale: f32,
    /// Elements between consecutive sequences of the query: `q_len * q_token_stride`
    /// for a dense batch.
    pub q_seq_stride: u32,
    /// Elements between consecutive query tokens of one sequence (`num_q_heads *
    /// head_dim` dense; more for a row of a fused QKV projection). Heads are `head_dim`
    /// apart.
    pub q_token_stride: u32,
    /// Element type of the queries (`DTYPE_*`).
    pub q_dtype: u32,
    /// Blocks in the pool: both decode kernels read a block-table entry at or past it as
    /// the last block ([`DecodeParams::block`]), never out of a pool of at least one
    /// block (one `min` per tile in `decode_mma`: no spill, up to 2 registers); with 0
    /// blocks no length may reach a quantized page (the host's checks ensure it).
    pub num_blocks: u32,
    /// Longest sequence: a length read on the device is clamped to it, and
    /// `block_table_stride` covers its pages.
    pub max_len: u32,
    /// Query tokens per sequence (1 for plain decode; more for speculative decoding's
    /// verification rows). Every sequence of the batch holds at least `q_len` tokens.
    pub q_len: u32,
    /// Sliding window: the keys each query row sees, its own position included (FlashInfer's
    /// `window_left + 1`, Hugging Face's `sliding_window`); 0 for no window. Row `i` sees
    /// positions [`DecodeParams::row_start`]`(len, i) ..` [`DecodeParams::row_len`]`(len,
    /// i)`; positions below every row's start (row 0's) are never read, nor are the
    /// block-table entries of pages wholly below it.
    pub attn_window: u32,
    /// 0 for a uniform batch (every sequence `q_len` rows, sequence `s`'s rows at `s *
    /// q_seq_stride`); else a step batch of this many rows (the `meta` array of
    /// [`AppendBatchParams`] over `batch_seqs` slots): sequence `s`'s rows are its new
    /// tokens of the step, its count of them (`q_len` at most) starting at input row
    /// `first_row` (queries at `row * q_token_stride`, partials at row `first_row + i`).
    pub batch_rows: u32,
    /// Slots of the step batch (with `batch_rows > 0`); a sequence at or past it has no
    /// rows.
    pub batch_seqs: u32,
}

/// Parameters of the log-sum-exp merge of split partials.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct MergeParams {
    /// Sequences in the batch.
    pub num_seqs: u32,
    /// Query heads.
    pub num_q_heads: u32,
    /// KV heads (selects the value permutation of each query head's group).
    pub num_kv_heads: u32,
    /// Channels per head.
    pub head_dim: u32,
    /// Splits per sequence.
    pub num_splits: u32,
    /// `FLAG_*` bits: `FLAG_ROTATE_VALUES` or `FLAG_DENSE_VALUES` (the output is rotated
    /// back by the FWHT or the transposed learned rotation) and `FLAG_OUTPUT_F16` or
    /// `FLAG_OUTPUT_BF16` (the output's type, else f32).
    pub flags: u32,
    /// Elements between consecutive output rows (a row is one query token of one
    /// sequence: `num_q_heads` heads, `head_dim` apart); `num_q_heads * head_dim` dense.
    pub out_row_stride: u32,
    /// With a step batch (`meta` not null; `num_seqs` its rows): its slots, and the most
    /// rows a slot may have (the decode launch's `q_len`). A row is merged only when its
    /// slot is below `batch_seqs`, has at most `q_len` rows and the row lies inside them;
    /// any other row is written as zeros (its partials were not written this step).
    /// Unused without a step batch.
    pub batch_seqs: u32,
    /// See `batch_seqs`.
    pub q_len: u32,
}

impl DecodeParams {
    /// Sequence `seq`'s rows: the parameters to decode them with (`q_len` its rows), the
    /// element offset of its first query row, and the index of its first partials (and
    /// output) row. A uniform batch: `q_len` rows at `seq * q_seq_stride`, rows `seq *
    /// q_len ..`. A step batch (`batch_rows > 0`): the slot's count this step (at most
    /// `q_len`; 0 past `batch_seqs`) from input row `first_row` on.
    ///
    /// # Safety
    /// With `batch_rows > 0`, `meta` valid for [`batch_meta_len`]`(batch_rows,
    /// batch_seqs)` u32; unused otherwise.
    #[inline(always)]
    pub unsafe fn seq_rows(&self, meta: *const u32, seq: u32) -> (DecodeParams, usize, u32) {
        if self.batch_rows == 0 {
            return (*self, seq as usize * self.q_seq_stride as usize, seq * self.q_len);
        }
        let mut p = *self;
        if seq >= self.batch_seqs {
            p.q_len = 0;
            return (p, 0, 0);
        }
        let (r, s) = (self.batch_rows as usize, self.batch_seqs as usize);
        // SAFETY: seq < batch_seqs: inside the counts and first rows (contract).
        let (count, first) = unsafe { (*meta.add(r + s + seq as usize), *meta.add(r + 2 * s + seq as usize)) };
        // A slot with more rows than the launch's tiles cover, or rows past the batch (an
        // inconsistent batch), gets none: cutting them would give its rows the causal
        // limits of other tokens. The merge writes zeros for them (`MergeParams::q_len`).
        p.q_len =
            if count <= self.q_len && first <= self.batch_rows && count <= self.batch_rows - first { count } else { 0 };
        (p, first as usize * self.q_token_stride as usize, first)
    }
    /// A block-table entry as the decode kernels use it: clamped below `num_blocks`.
    #[inline(always)]
    pub const fn block(&self, entry: u32) -> u32 {
        let last = self.num_blocks.saturating_sub(1);
        if entry < last { entry } else { last }
    }
    /// A sequence length read on the device as the decode kernels use it: at most
    /// `max_len`.
    #[inline(always)]
    pub const fn clamp_len(&self, len: u32) -> u32 {
        if len < self.max_len { len } else { self.max_len }
    }
    /// Tokens per split for a sequence of `len` tokens: `ceil(len / num_splits)`.
    #[inline]
    pub const fn split_len(&self, len: u32) -> u32 {
        // (num_splits >= 1 on every launch; written without a trap path, see layout::div.)
        if self.num_splits == 0 { 0 } else { len.div_ceil(self.num_splits) }
    }
    /// Positions row `row` (`0 .. q_len`) of a sequence of `len` tokens attends to:
    /// `0 .. len - q_len + row + 1`, i.e. the length its causal mask sees.
    #[inline]
    pub const fn row_len(&self, len: u32, row: u32) -> u32 {
        (len + row + 1).saturating_sub(self.q_len)
    }
    /// First position row `row` (`0 .. q_len`) of a sequence of `len` tokens attends to:
    /// 0 without a window, else `row_len(len, row) - attn_window` (at least 0), so the row
    /// sees the `attn_window` newest positions up to its own.
    #[inline]
    pub const fn row_start(&self, len: u32, row: u32) -> u32 {
        if self.attn_window == 0 { 0 } else { self.row_len(len, row).saturating_sub(self.attn_window) }
    }
    /// Positions a row sees at most: `attn_window`, or `u32::MAX` without a window (row
    /// `row` sees `[row_len - min(row_len, window_keys), row_len)`).
    #[inline(always)]
    pub const fn window_keys(&self) -> u32 {
        if self.attn_window == 0 { u32::MAX } else { self.attn_window }
    }
    /// First position any row of a sequence of `len` tokens attends to (row 0's start):
    /// the splits cover `[visible_start(len), len)`.
    #[inline]
    pub const fn visible_start(&self, len: u32) -> u32 {
        self.row_start(len, 0)
    }
    /// Positions `[begin, end)` of split `split` of a sequence of `len` tokens: the
    /// visible positions `[visible_start(len), len)` cut into `num_splits` runs of
    /// `ceil(visible / num_splits)` (empty when the sequence is too short to reach it).
    #[inline]
    pub const fn split_range(&self, split: u32, len: u32) -> (u32, u32) {
        let first = self.visible_start(len);
        let per = self.split_len(len - first);
        let begin = first.saturating_add(split.saturating_mul(per));
        let end = begin.saturating_add(per);
        let begin = if begin < len { begin } else { len };
        let end = if end < len { end } else { len };
        (begin, end)
    }
}
