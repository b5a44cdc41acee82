//! The low-level API over caller-owned buffers, for serving stacks that manage their own
//! memory: a layer's page pool (`[block][kv_head][page_bytes]` bytes), and per sequence
//! a block table, an f16 side store (`[kv_head][K|V][sinks + window + page_size +
//! protected][head_dim]`) and its list of protected positions (ascending; see
//! [`protect`]). [`crate::KvCache`] is built on [`append`], [`decode`] and [`protect`].
//!
//! Each checks everything (shapes, values, block tables, protected lists) before any
//! backend touches a byte: a call that returns an error has written nothing.
//!
//! The caller's contract for the block tables it owns: every entry a call uses (the
//! first [`blocks_for`]`(len)` of a table, except the pages a call does not touch, which
//! may be [`FREED_BLOCK`]: pages wholly before a decode's sliding window, pages full
//! before an append) is a block of that pool, no block appears
//! twice in one table, and no block is held by two live sequences of one pool. The
//! first two are checked on every call ([`Error::AliasedBlock`] for a repeat), and
//! [`decode`] checks the third across the sequences of its batch (so a sequence may
//! appear at most once per batch); an [`append`] sees one table only, so two
//! sequences' tables that share a block are the caller's to prevent (a
//! [`crate::KvCache`] hands every block to one sequence only). Learned
//! rotations are checked for size, finiteness and unit rows and columns per call (which
//! keeps every stored channel in f16 range); their full orthogonality is checked by
//! [`LayerCalibration::check_orthogonal`], which [`crate::KvCache::set_calibration`]
//! runs once.

use crate::config::{CacheConfig, LayerCalibration};
use crate::error::{Error, Result};
use crate::reference::SeqRef;
use crate::{Backend, KvElement, cpu, reference};
use half::f16;
use rotkv_kernels::layout::Format;
use rotkv_kernels::params::{AppendParams, DecodeParams};

/// A layer's shape beyond the cache config: heads and the pool's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    /// KV heads.
    pub num_kv_heads: usize,
    /// Query heads (a multiple of `num_kv_heads`).
    pub num_q_heads: usize,
}

/// Most KV or query heads of a layer (real models have at most a few hundred).
pub const MAX_HEADS: usize = 1 << 16;

impl LayerShape {
    pub(crate) fn check(&self) -> Result<()> {
        if self.num_kv_heads > MAX_HEADS || self.num_q_heads > MAX_HEADS {
            return Err(Error::Capacity(format!(
                "{} query heads and {} KV heads: at most {MAX_HEADS} of each",
                self.num_q_heads, self.num_kv_heads
            )));
        }
        if self.num_kv_heads == 0 || self.num_q_heads == 0 || !self.num_q_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::Shape(format!(
                "{} query heads must be a positive multiple of {} KV heads",
                self.num_q_heads, self.num_kv_heads
            )));
        }
        Ok(())
    }
}

/// A zeroed vector of `n` elements, or [`Error::Capacity`] when the allocator refuses it
/// (rather than aborting the process).
pub(crate) fn try_zeroed<T: bytemuck::Zeroable>(n: usize, what: &str) -> Result<Vec<T>> {
    bytemuck::allocation::try_zeroed_vec(n)
        .map_err(|()| Error::Capacity(format!("could not allocate {what}: {n} elements of {} bytes", size_of::<T>())))
}

/// Page pools must start on a 16-byte boundary (vector loads on every backend).
pub const POOL_ALIGN: usize = 16;

/// A zeroed, 16-byte aligned byte buffer for a page pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolBuffer(Vec<u128>);

impl PoolBuffer {
    /// `bytes` zero bytes (rounded up to a multiple of 16).
    pub fn new(bytes: usize) -> Self {
        PoolBuffer(vec![0u128; bytes.div_ceil(16)])
    }
    /// As [`PoolBuffer::new`], but a size the system cannot allocate is
    /// [`Error::Capacity`] instead of an abort. The memory is not touched (zero pages
    /// from the allocator).
    pub fn try_new(bytes: usize) -> Result<Self> {
        Ok(PoolBuffer(try_zeroed(bytes.div_ceil(16), "a page pool")?))
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
    /// The bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

/// Bytes of a pool of `num_blocks` blocks ([`Error::Capacity`] past `isize::MAX`).
pub fn pool_bytes(config: &CacheConfig, shape: &LayerShape, num_blocks: usize) -> Result<usize> {
    let fmt = config.format()?;
    shape.check()?;
    num_blocks
        .checked_mul(shape.num_kv_heads)
        .and_then(|n| n.checked_mul(fmt.page_bytes() as usize))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::Capacity(format!(
                "a pool of {num_blocks} blocks x {} KV heads x {} bytes overflows the address space",
                shape.num_kv_heads,
                fmt.page_bytes()
            ))
        })
}

/// f16 elements of one sequence's side store for one layer.
pub fn side_elems(config: &CacheConfig, shape: &LayerShape) -> Result<usize> {
    let fmt = config.format()?;
    shape.check()?;
    Ok(fmt.side_elems(shape.num_kv_heads as u32))
}

/// Blocks a sequence of `len` tokens needs in its block table.
pub fn blocks_for(config: &CacheConfig, len: usize) -> Result<usize> {
    let fmt = config.format()?;
    Ok(fmt.pages_for(len.min(u32::MAX as usize) as u32) as usize)
}

fn num_blocks(fmt: &Format, shape: &LayerShape, pool: &[u8]) -> Result<usize> {
    let pool_len = pool.len();
    // An empty pool (no blocks: every sequence fits its sinks and window) has no start
    // to align (an empty slice's pointer is dangling).
    if pool_len == 0 {
        return Ok(0);
    }
    if !(pool.as_ptr() as usize).is_multiple_of(POOL_ALIGN) {
        return Err(Error::Shape(format!("the pool must start on a {POOL_ALIGN}-byte boundary (see PoolBuffer)")));
    }
    let per_block = fmt.page_bytes() as usize * shape.num_kv_heads;
    if !pool_len.is_multiple_of(per_block) {
        return Err(Error::Shape(format!("pool of {pool_len} bytes is not a whole number of {per_block}-byte blocks")));
    }
    Ok(pool_len / per_block)
}

/// One bit per block of a pool: the blocks the tables of one call use so far.
struct BlockSet(Vec<u64>);

impl BlockSet {
    fn new(num_blocks: usize) -> Self {
        // calloc'd: a pool of n blocks holds at least n * 64 bytes, so this is under
        // 1/500 of it, and only the words the tables touch are written.
        BlockSet(vec![0; num_blocks.div_ceil(64)])
    }
}

/// The block-table entry of a page whose block the caller has freed: allowed for the
/// pages a call does not touch, which are the pages wholly before every query row's
/// sliding window for [`decode`] ([`DecodeOptions::window_left`]) and the pages already
/// full before the call for [`append`]. Every other entry a call uses must be a block of
/// the pool; any entry that is not `FREED_BLOCK` is checked as a block (inside the pool,
/// not repeated), so a freed page's entry must be set to this value before its block is
/// handed to another page.
pub const FREED_BLOCK: u32 = u32::MAX;

/// Checks the first `needed` entries of the `seq`th table of a call: present, inside a
/// pool of `num_blocks` blocks, and not used already by this table or an earlier one of
/// the call (`used`). The first `skipped` entries are pages the call does not touch: each
/// may be [`FREED_BLOCK`] instead (and is then skipped).
fn check_block_table(
    table: &[u32],
    needed: usize,
    skipped: usize,
    num_blocks: usize,
    seq: usize,
    used: &mut BlockSet,
) -> Result<()> {
    if table.len() < needed {
        return Err(Error::Capacity(format!("block table has {} entries, the sequence needs {needed}", table.len())));
    }
    for (index, &block) in table[..needed].iter().enumerate() {
        if index < skipped && block == FREED_BLOCK {
            continue;
        }
        if block as usize >= num_blocks {
            return Err(Error::BlockTable { index, block, num_blocks });
        }
        let (word, bit) = (block as usize / 64, 1u64 << (block % 64));
        if used.0[word] & bit != 0 {
            let owner = if table[..index].contains(&block) {
                format!("twice in the block table of sequence {seq} of the call")
            } else {
                format!("by sequence {seq} of the call and an earlier one")
            };
            return Err(Error::AliasedBlock { index, block, detail: owner });
        }
        used.0[word] |= bit;
    }
    Ok(())
}

/// Checks a sequence's list of protected positions: strictly ascending, none among the
/// leading sinks, at most `config.protected` of them.
fn check_protected(fmt: &Format, protected: &[u32]) -> Result<()> {
    if protected.len() > fmt.protected as usize {
        return Err(Error::Capacity(format!(
            "{} protected positions; the configuration has room for {}",
            protected.len(),
            fmt.protected
        )));
    }
    if let Some(w) = protected.windows(2).find(|w| w[0] >= w[1]) {
        return Err(Error::Value(format!("protected positions must ascend: {} then {}", w[0], w[1])));
    }
    if let Some(&p) = protected.iter().find(|&&p| p < fmt.sinks) {
        return Err(Error::Value(format!(
            "protected position {p} is a sink (the first {} are kept anyway)",
            fmt.sinks
        )));
    }
    Ok(())
}

/// Extends a sequence's protected positions from `old` to `new` (which must start with
/// `old`, ascend strictly, leave out the leading sinks and fit `config.protected`) for a
/// sequence of `len` tokens: each added position
/// must not be quantized yet (a token still in the window, or not yet appended). Those
/// already appended have their f16 window rows copied into their protected rows now;
/// later ones are copied by [`append`] when they arrive, given `new`.
///
/// Detected attention sinks are usually found at prefill (from attention mass, key or
/// hidden-state norms) and protected before the prompt is appended.
pub fn protect(
    config: &CacheConfig,
    shape: &LayerShape,
    side: &mut [f16],
    len: usize,
    old: &[u32],
    new: &[u32],
) -> Result<()> {
    let fmt = config.format()?;
    shape.check()?;
    let hkv = shape.num_kv_heads as u32;
    if side.len() != fmt.side_elems(hkv) {
        return Err(Error::Shape(format!("side store has {} elements, expected {}", side.len(), fmt.side_elems(hkv))));
    }
    if len > u32::MAX as usize / 2 {
        return Err(Error::Capacity(format!("sequence of {len} tokens")));
    }
    if let Some(&p) = new.iter().find(|&&p| p as usize >= u32::MAX as usize / 2) {
        return Err(Error::Value(format!(
            "position {p} can never be appended (a sequence holds fewer than {} tokens)",
            u32::MAX / 2
        )));
    }
    check_protected(&fmt, new)?;
    if !new.starts_with(old) {
        return Err(Error::Value("the new protected positions must extend the old list".into()));
    }
    let first_open = fmt.sinks + fmt.quantized_len(len as u32);
    if let Some(&p) = new[old.len()..].iter().find(|&&p| p < first_open) {
        return Err(Error::Value(format!(
            "position {p} is already quantized (positions below {first_open} are); protect it before it leaves the window"
        )));
    }
    let d = fmt.head_dim as usize;
    for (i, &pos) in new.iter().enumerate().skip(old.len()).filter(|&(_, &p)| (p as usize) < len) {
        for h in 0..hkv {
            for value in [false, true] {
                let from = fmt.side_row_at(h, value, fmt.window_row(pos));
                let to = fmt.side_row_at(h, value, fmt.protected_row(i as u32));
                side.copy_within(from..from + d, to);
            }
        }
    }
    Ok(())
}

/// Converts a `[tokens][heads][head_dim]` input (queries) to f32, checking its size and
/// values with [`check_rows`] (each row's L2 norm within the f16 range).
pub(crate) fn to_f32_rows<T: KvElement>(
    what: &str,
    x: &[T],
    tokens: usize,
    heads: usize,
    d: usize,
) -> Result<Vec<f32>> {
    check_rows(what, x, tokens, heads, d, None)?;
    Ok(x.iter().map(|v| v.to_f32()).collect())
}

/// Checks the buffers of an append at the level of [`AppendParams`] (what the sim and
/// cuda entry points hand to the kernels as raw addresses, so nothing may be out of
/// bounds): the format, the calibration's shapes, the pool (`num_blocks` whole blocks),
/// the side store, the block table (the pages this append writes are blocks of the pool),
/// the protected list, and the K and V inputs (`k_bytes` and `v_bytes`) for `count`
/// tokens at their own token strides, heads `head_stride` apart, in `input_dtype`.
/// [`append`] checks all of this (and the rows' values) before it gets here.
#[allow(clippy::too_many_arguments)]
#[cfg(any(feature = "sim", feature = "cuda"))]
pub(crate) fn check_append_buffers(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool_len: usize,
    block_table: &[u32],
    side_len: usize,
    protected: &[u32],
    k_bytes: usize,
    v_bytes: usize,
) -> Result<()> {
    let fmt = &p.format;
    crate::launch::check_format(fmt)?;
    let (hkv, d) = (p.num_kv_heads as usize, fmt.head_dim as usize);
    calib.validate(hkv, d)?;
    if p.start.checked_add(p.count) != Some(p.new_len) || p.new_len > u32::MAX / 2 {
        return Err(Error::Value(format!("append of {} tokens at {} to length {}", p.count, p.start, p.new_len)));
    }
    let blocks = p.num_blocks as usize;
    if (fmt.page_bytes() as u64 * hkv as u64).checked_mul(blocks as u64) != Some(pool_len as u64) {
        return Err(Error::Shape(format!("pool of {pool_len} bytes is not {blocks} blocks of {hkv} pages")));
    }
    if side_len < fmt.side_elems(p.num_kv_heads) {
        return Err(Error::Shape(format!(
            "side store of {side_len} elements, expected {}",
            fmt.side_elems(p.num_kv_heads)
        )));
    }
    let full = fmt.pages_for(p.start) as usize;
    check_block_table(block_table, fmt.pages_for(p.new_len) as usize, full, blocks, 0, &mut BlockSet::new(blocks))?;
    check_protected(fmt, protected)?;
    if p.count > 0 {
        let elem = crate::launch::dtype_bytes(p.input_dtype) as u64;
        for (what, have, stride) in [("k", k_bytes, p.token_stride), ("v", v_bytes, p.v_token_stride)] {
            // The last element read: token count - 1, head hkv - 1, channel d - 1.
            let need =
                ((p.count as u64 - 1) * stride as u64 + (hkv as u64 - 1) * p.head_stride as u64 + d as u64) * elem;
            if (have as u64) < need {
                return Err(Error::Shape(format!(
                    "{what} has {have} bytes; {} tokens at its strides read {need}",
                    p.count
                )));
            }
        }
    }
    Ok(())
}

/// An input's size, finite values, and each row's L2 norm (f64, eight partial sums; of
/// `(x - mean) / scale` where `mean` is given: the key as stored) at most the f16 range,
/// so that no rotated channel can overflow f16. Rows are checked in parallel; the error
/// names the first bad row.
pub(crate) fn check_rows<T: KvElement>(
    what: &str,
    x: &[T],
    tokens: usize,
    heads: usize,
    d: usize,
    mean: Option<(&[f32], &[f32])>,
) -> Result<()> {
    check_len(what, x, tokens, heads, d)?;
    // First in f32 (vectorized): a row whose f32 norm is below the fast limit is fine; the
    // others get the f64 test.
    let head = |i: usize| mean.map(|(m, s)| head_slices(m, s, i % heads, d));
    let bad = cpu::first_bad_row(x, heads, d, mean, FAST_NORM2_LIMIT, |i, row| row_is_bad(row, head(i)))
        .map(|i| (i, &x[i * d..(i + 1) * d]));
    match bad {
        Some((i, row)) => Err(row_error(what, i / heads, i % heads, row, head(i))),
        None => Ok(()),
    }
}

/// The size check of [`check_rows`].
fn check_len<T>(what: &str, x: &[T], tokens: usize, heads: usize, d: usize) -> Result<()> {
    if x.len() != tokens * heads * d {
        return Err(Error::Shape(format!(
            "{what} has {} elements, expected {tokens} tokens x {heads} heads x {d} = {}",
            x.len(),
            tokens * heads * d
        )));
    }
    Ok(())
}

/// The largest L2 norm of a stored row: the f16 range.
const ROW_NORM_LIMIT: f64 = 65504.0;

/// The fast test's limit on a row's f32 squared norm: a row below 0.999 of the limit is
/// fine (the f32 sum's relative error is below 1e-4; an infinity or NaN anywhere makes the
/// sum fail the test); the others get the exact test ([`row_is_bad`]).
const FAST_NORM2_LIMIT: f32 = (0.999 * ROW_NORM_LIMIT * ROW_NORM_LIMIT) as f32;

/// One head's `(mean, scale)` slices.
fn head_slices<'a>(m: &'a [f32], s: &'a [f32], h: usize, d: usize) -> (&'a [f32], &'a [f32]) {
    (&m[h * d..(h + 1) * d], &s[h * d..(h + 1) * d])
}

/// A row's L2 norm as stored, `(x - mean) / scale` with the head's `mean` (f64, eight
/// partial sums), or NaN when a value is not finite.
fn row_norm<T: KvElement>(row: &[T], mean: Option<(&[f32], &[f32])>) -> f64 {
    let mut acc = [0f64; 8];
    let mut finite = true;
    for (c0, r8) in (0..row.len()).step_by(8).zip(row.chunks(8)) {
        for (l, v) in r8.iter().enumerate() {
            let v = v.to_f32();
            finite &= v.is_finite();
            let c = mean.map_or(v as f64, |(m, s)| (v as f64 - m[c0 + l] as f64) / s[c0 + l] as f64);
            acc[l] += c * c;
        }
    }
    if finite { acc.iter().sum::<f64>().sqrt() } else { f64::NAN }
}

/// The exact test: a value not finite, or a norm as stored above the f16 range.
fn row_is_bad<T: KvElement>(row: &[T], mean: Option<(&[f32], &[f32])>) -> bool {
    let n = row_norm(row, mean);
    n.is_nan() || n > ROW_NORM_LIMIT
}

/// The error for a bad row of `what` (token `t`, head `h`).
fn row_error<T: KvElement>(what: &str, t: usize, h: usize, row: &[T], mean: Option<(&[f32], &[f32])>) -> Error {
    if let Some(j) = row.iter().position(|v| !v.to_f32().is_finite()) {
        return Error::Value(format!("{what}[token {t}][head {h}][{j}] is {}", row[j].to_f32()));
    }
    Error::Value(format!(
        "{what}[token {t}][head {h}] has norm {:.1}: above the f16 range the cache stores ({ROW_NORM_LIMIT})",
        row_norm(row, mean)
    ))
}

/// Appends `tokens` new tokens to one sequence of one layer and returns the new length.
///
/// `k` and `v` are `[tokens][num_kv_heads][head_dim]`. `len` is the sequence's length
/// before the call; `block_table` must hold valid blocks for the pages of
/// [`blocks_for`]`(len + tokens)` from [`blocks_for`]`(len)` on (the pages the call may
/// write); the full pages before them are not touched and may be [`FREED_BLOCK`]; `side` is the sequence's side store;
/// `protected` its protected positions (as last accepted by [`protect`]; empty for
/// none): the new tokens among them get their protected rows.
#[allow(clippy::too_many_arguments)]
pub fn append<T: KvElement>(
    backend: Backend,
    config: &CacheConfig,
    calib: &LayerCalibration,
    shape: &LayerShape,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    protected: &[u32],
    len: usize,
    tokens: usize,
    k: &[T],
    v: &[T],
) -> Result<usize> {
    let fmt = config.format()?;
    shape.check()?;
    let d = config.head_dim;
    let hkv = shape.num_kv_heads;
    calib.validate(hkv, d)?;
    let new_len = len
        .checked_add(tokens)
        .filter(|&n| n <= u32::MAX as usize / 2)
        .ok_or_else(|| Error::Capacity(format!("{len} + {tokens} tokens is past the format's limit")))?;
    if side.len() != fmt.side_elems(hkv as u32) {
        return Err(Error::Shape(format!(
            "side store has {} elements, expected {}",
            side.len(),
            fmt.side_elems(hkv as u32)
        )));
    }
    let blocks = num_blocks(&fmt, shape, pool)?;
    crate::launch::check_pool_blocks(&fmt, blocks)?;
    let mut used = BlockSet::new(blocks);
    // The pages full before the call are not touched: their blocks may be freed.
    let full = fmt.pages_for(len as u32) as usize;
    check_block_table(block_table, fmt.pages_for(new_len as u32) as usize, full, blocks, 0, &mut used)?;
    check_protected(&fmt, protected)?;
    let key_mean = Some((&calib.key_mean[..], &calib.key_scale[..]));
    if backend == Backend::Cpu {
        // The fused append checks the rows as it reads them (below).
        check_len("k", k, tokens, hkv, d)?;
        if let Err(e) = check_len("v", v, tokens, hkv, d) {
            // The other backends' order: a bad key value before the values' length.
            check_rows("k", k, tokens, hkv, d, key_mean)?;
            return Err(e);
        }
    } else {
        check_rows("k", k, tokens, hkv, d, key_mean)?;
        check_rows("v", v, tokens, hkv, d, None)?;
    }
    let params = AppendParams {
        format: fmt,
        num_kv_heads: hkv as u32,
        start: len as u32,
        count: tokens as u32,
        new_len: new_len as u32,
        num_blocks: blocks as u32,
        flags: config.flags() | calib.flags(),
        token_stride: (hkv * d) as u32,
        v_token_stride: (hkv * d) as u32,
        head_stride: d as u32,
        input_dtype: rotkv_kernels::params::DTYPE_F32,
    };
    // The device kernels read the caller's elements as they are (f16 and bf16 too).
    #[cfg(any(feature = "sim", feature = "cuda"))]
    let (raw, raw_k, raw_v) = (
        AppendParams { input_dtype: T::DTYPE, ..params },
        bytemuck::cast_slice::<T, u8>(k),
        bytemuck::cast_slice::<T, u8>(v),
    );
    match backend {
        Backend::Reference => {
            let (k, v): (Vec<f32>, Vec<f32>) =
                (k.iter().map(|x| x.to_f32()).collect(), v.iter().map(|x| x.to_f32()).collect());
            reference::append(&params, calib, pool, block_table, side, protected, &k, &v)
        }
        // The caller's elements as they are: the fused append converts, checks and
        // quantizes row by row, and changes nothing when a row fails the check.
        Backend::Cpu => {
            let head = |h: usize| key_mean.map(|(m, s)| head_slices(m, s, h, d));
            let exact_bad =
                |value: bool, _t: usize, h: usize, row: &[T]| row_is_bad(row, if value { None } else { head(h) });
            let check = cpu::RowCheck { fast_limit: FAST_NORM2_LIMIT, exact_bad: &exact_bad };
            if !cpu::append_checked(&params, calib, pool, block_table, side, protected, k, v, Some(&check)) {
                // A row failed: the error names the first bad row, as the other backends'.
                check_rows("k", k, tokens, hkv, d, key_mean)?;
                check_rows("v", v, tokens, hkv, d, None)?;
                // Unreachable (the same exact test), but if so, the rows are fine.
                cpu::append(&params, calib, pool, block_table, side, protected, k, v);
            }
        }
        #[cfg(feature = "sim")]
        Backend::Sim => crate::sim::append_sim(&raw, calib, pool, block_table, side, protected, raw_k, raw_v)?,
        #[cfg(feature = "cuda")]
        Backend::Cuda => crate::cuda::append_cuda(&raw, calib, pool, block_table, side, protected, raw_k, raw_v)?,
    }
    Ok(new_len)
}

/// Most query tokens per sequence of one decode call ([`DecodeOptions::q_len`]): a chunk
/// of a prompt (chunked prefill from the packed cache) as well as a few speculative
/// rows. A GPU grid also bounds a launch's query rows (sequences x rows, and splits x
/// row tiles, at most 65,535 each).
pub const MAX_Q_LEN: usize = 4096;

/// Options of a decode call. The default is one query token per sequence, the softmax
/// scale `1 / sqrt(head_dim)` and splits chosen by the backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeOptions {
    /// Softmax scale; `None` means `1 / sqrt(head_dim)`.
    pub sm_scale: Option<f32>,
    /// Splits per sequence (1 to 1024; a count past the longest sequence's tokens is cut
    /// to that, since the extra splits would be empty); `None` lets the backend choose.
    pub num_splits: Option<u32>,
    /// Query tokens per sequence (1 to [`MAX_Q_LEN`]): 1 for plain decode, more for the
    /// verification rows of speculative decoding or a chunk of new tokens. They are the
    /// sequence's last `q_len` tokens (already appended): row `i` of a sequence of `len`
    /// tokens is position `len - q_len + i` and attends causally to positions
    /// `0 ..= len - q_len + i`.
    pub q_len: usize,
    /// How the CPU backend scores keys stored as codes (other backends ignore it).
    pub key_scores: KeyScores,
    /// Sliding-window attention, FlashInfer's `window_left`: `Some(w)` lets the query row
    /// at position `q` attend only to positions `q - w ..= q` (clipped at 0; `w + 1` keys,
    /// so `Some(0)` is the row's own key only). Hugging Face's and llama.cpp's
    /// `sliding_window = n` (the key at `q - n + 1` is the oldest visible) is
    /// `Some(n - 1)`. Sinks, protected positions and the f16 recent rows count like any
    /// other position: outside the window they are not attended. `None`: no window.
    /// At most `u32::MAX - 1`. Pages wholly before the first row's window are not read:
    /// their block-table entries may be [`FREED_BLOCK`].
    pub window_left: Option<usize>,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        Self { sm_scale: None, num_splits: None, q_len: 1, key_scores: KeyScores::default(), window_left: None }
    }
}

impl DecodeOptions {
    /// `window_left` as [`DecodeParams::attn_window`]: the keys a row sees (`w + 1`), 0 for
    /// no window; a window whose key count does not fit `u32` is [`Error::Value`].
    pub fn attn_window(&self) -> Result<u32> {
        attn_window(self.window_left)
    }
}

/// A `window_left` ([`DecodeOptions::window_left`]) as [`DecodeParams::attn_window`].
pub(crate) fn attn_window(window_left: Option<usize>) -> Result<u32> {
    match window_left {
        None => Ok(0),
        Some(w) => w.checked_add(1).and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
            Error::Value(format!(
                "window_left {w}: at most {} (the window's {} keys must fit u32); None for no window",
                u32::MAX - 1,
                u32::MAX
            ))
        }),
    }
}

/// Positions a sequence of `len` tokens attends to when its last `q_len` tokens are the
/// queries, with `attn_window` keys per row (0: all): `[first, len)`, `first` being the
/// first row's window start.
pub(crate) fn visible_range(len: usize, q_len: usize, attn_window: u32) -> (usize, usize) {
    let first = if attn_window == 0 { 0 } else { (len + 1).saturating_sub(q_len).saturating_sub(attn_window as usize) };
    (first, len)
}

/// Pages of a sequence of `len` tokens that lie wholly before position `first` (their
/// entries are not read by a decode that starts there).
pub(crate) fn pages_before(fmt: &Format, len: usize, first: usize) -> usize {
    let quantized_from = fmt.sinks as usize;
    let whole = first.saturating_sub(quantized_from) / fmt.page_size as usize;
    whole.min(fmt.pages_for(len as u32) as usize)
}

/// How the CPU backend computes `q . k` for keys stored as codes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeyScores {
    /// Codes unpacked to f32 and multiplied with the f32 query (the path the
    /// conformance suite checks against the reference).
    #[default]
    Exact,
    /// The query quantized once per step to int8 per row and quantization group
    /// (scale `max|q| / 127`), dotted with the codes in integers (AVX2 `vpmaddubsw`);
    /// adds the query's rounding error to the scores: 0.6-1.2% of the scores' norm and
    /// up to 1.2e-2 relative in the outputs on the real SmolLM2 tile (stated and tested in
    /// `cpu.rs` and `tests/tests/cpu_int.rs`). `rotkv ppl` on SmolLM2, lcet10, 4 x 1024:
    /// k2v2-c 32.800 -> 32.748 (-0.16%), k4v2-c 31.866 -> 31.876 (+0.03%).
    Int8,
    /// As [`KeyScores::Int8`] with the query's rounding residual as a second int8 term
    /// (`q = a * (hi + lo / 254)`): twice the integer products, about 1/254 of the error
    /// (2-7e-5 of the scores' norm, outputs within 4.1e-5 on the real tile). `rotkv ppl`
    /// as above: k2v2-c 32.777 (-0.07%), k4v2-c 31.868 (+0.005%). Not the default: the
    /// issue's bar was 0.05%.
    Int8x2,
}

/// Decode attention for `options.q_len` query tokens per sequence (one by default).
///
/// `q` and `out` are `[seqs.len()][q_len][num_q_heads][head_dim]`; `out` receives the
/// attention output in the original value channels. Query row `i` of a sequence of `len`
/// tokens is the token at position `len - q_len + i` and attends to positions
/// `0 ..= len - q_len + i` (causal), so every sequence must hold at least `q_len`
/// tokens. With [`DecodeOptions::window_left`] a row attends to its window only (see
/// there). Splits are cut from each sequence's visible positions; a row leaves out the
/// positions outside its own window.
///
/// Pages wholly before the first query row's window are never read, so a caller may free
/// their blocks: such a page's block-table entry may be [`FREED_BLOCK`], while every page
/// holding a visible position needs a valid entry (and a block handed to another page
/// must not stay in the old page's entry: any entry other than `FREED_BLOCK` is checked).
#[allow(clippy::too_many_arguments)]
pub fn decode<T: KvElement>(
    backend: Backend,
    config: &CacheConfig,
    calib: &LayerCalibration,
    shape: &LayerShape,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[T],
    out: &mut [f32],
    options: DecodeOptions,
) -> Result<()> {
    let fmt = config.format()?;
    shape.check()?;
    let d = config.head_dim;
    let (hkv, hq) = (shape.num_kv_heads, shape.num_q_heads);
    calib.validate(hkv, d)?;
    let blocks = num_blocks(&fmt, shape, pool)?;
    let q_len = options.q_len;
    if !(1..=MAX_Q_LEN).contains(&q_len) {
        return Err(Error::Shape(format!("q_len {q_len}: 1 to {MAX_Q_LEN} query tokens per sequence")));
    }
    let attn_window = options.attn_window()?;
    let mut used = BlockSet::new(blocks);
    for (i, s) in seqs.iter().enumerate() {
        if s.len == 0 {
            return Err(Error::Shape(format!("sequence {i} of the batch has no tokens")));
        }
        if s.len < q_len {
            return Err(Error::Shape(format!(
                "sequence {i} of the batch holds {} tokens, fewer than its {q_len} query tokens (append them first)",
                s.len
            )));
        }
        if s.len > u32::MAX as usize / 2 {
            return Err(Error::Capacity(format!("sequence {i} has {} tokens", s.len)));
        }
        if s.side.len() != fmt.side_elems(hkv as u32) {
            return Err(Error::Shape(format!(
                "side store of sequence {i} has {} elements, expected {}",
                s.side.len(),
                fmt.side_elems(hkv as u32)
            )));
        }
        let (first, _) = visible_range(s.len, q_len, attn_window);
        let skipped = pages_before(&fmt, s.len, first);
        check_block_table(s.block_table, fmt.pages_for(s.len as u32) as usize, skipped, blocks, i, &mut used)?;
        check_protected(&fmt, s.protected)?;
    }
    let rows = seqs.len() * q_len;
    for (what, n) in [("q", q.len()), ("out", out.len())] {
        if n != rows * hq * d {
            return Err(Error::Shape(format!(
                "{what} has {n} elements, expected {} sequences x {q_len} query tokens x {hq} heads x {d} = {}",
                seqs.len(),
                rows * hq * d
            )));
        }
    }
    let q = to_f32_rows("q", q, rows, hq, d)?;
    let sm_scale = options.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !sm_scale.is_finite() || sm_scale <= 0.0 {
        return Err(Error::Value(format!("softmax scale {sm_scale} must be finite and positive")));
    }
    let max_len = seqs.iter().map(|s| s.len).max().unwrap_or(0);
    // The most positions one sequence attends to: the splits cut these (with a small
    // window, a long context launches no empty splits).
    let max_visible = seqs
        .iter()
        .map(|s| {
            let (first, end) = visible_range(s.len, q_len, attn_window);
            end - first
        })
        .max()
        .unwrap_or(0);
    let num_splits = match options.num_splits {
        // Splits of `ceil(visible / n)` tokens: past one split per visible token of the
        // longest sequence they are all empty, so the count is cut there (the same
        // result, and the partials stay proportional to the work).
        Some(n) if (1..=1024).contains(&n) => n.min(max_visible.max(1) as u32),
        Some(n) => return Err(Error::Value(format!("num_splits {n} (1 to 1024)"))),
        None => match backend {
            Backend::Reference => 1,
            Backend::Cpu => cpu::default_splits(max_visible, seqs.len(), hkv, rayon::current_num_threads()),
            #[cfg(feature = "sim")]
            Backend::Sim => gpu_split_count(max_visible, seqs.len(), hkv, crate::sim::SIM_SMS),
            #[cfg(feature = "cuda")]
            Backend::Cuda => gpu_split_count(max_visible, seqs.len(), hkv, crate::cuda::sm_count()?),
        },
    };
    let params = DecodeParams {
        format: fmt,
        num_seqs: seqs.len() as u32,
        num_q_heads: hq as u32,
        num_kv_heads: hkv as u32,
        num_splits,
        block_table_stride: seqs.iter().map(|s| s.block_table.len()).max().unwrap_or(0) as u32,
        flags: config.flags() | calib.flags(),
        sm_scale,
        q_seq_stride: (q_len * hq * d) as u32,
        q_token_stride: (hq * d) as u32,
        q_dtype: rotkv_kernels::params::DTYPE_F32,
        num_blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        max_len: max_len as u32,
        q_len: q_len as u32,
        attn_window,
        batch_rows: 0,
        batch_seqs: 0,
    };
    if seqs.is_empty() {
        return Ok(());
    }
    match backend {
        Backend::Reference => reference::decode(&params, calib, pool, seqs, &q, out),
        Backend::Cpu => cpu::decode(&params, calib, pool, seqs, &q, out, options.key_scores),
        #[cfg(feature = "sim")]
        Backend::Sim => crate::sim::decode_sim(&params, calib, pool, seqs, &q, out)?,
        #[cfg(feature = "cuda")]
        Backend::Cuda => crate::cuda::decode_cuda(&params, calib, pool, seqs, &q, out)?,
    }
    Ok(())
}

/// Splits per sequence for the GPU decode kernel of a per-call launch: the rule of
/// [`crate::launch::wave_splits`] for `(KV head, sequence)` blocks per split at two
/// resident blocks per multiprocessor (no split shorter than 256 tokens, at most 64).
pub fn gpu_split_count(max_len: usize, num_seqs: usize, num_kv_heads: usize, num_sms: usize) -> u32 {
    crate::launch::wave_splits(max_len, num_seqs * num_kv_heads, 2 * num_sms)
}

#[cfg(test)]
mod tests {
    use super::gpu_split_count;

    #[test]
    fn gpu_split_count_fills_the_device_without_tiny_splits() {
        // H200: 132 SMs. One long sequence on 8 KV heads: 33 splits fill one wave of
        // 264 blocks exactly.
        assert_eq!(gpu_split_count(131_072, 1, 8, 132), 33);
        // Batch 8 x 8 KV heads: 4 splits (256 blocks), not 5 (320: a partial second wave).
        assert_eq!(gpu_split_count(32_768, 8, 8, 132), 4);
        assert_eq!(gpu_split_count(131_072, 1, 8, 132), 33);
        // A big batch fills the device by itself.
        assert_eq!(gpu_split_count(32_768, 64, 8, 132), 1);
        // Short contexts are not cut below 256 tokens per split.
        assert_eq!(gpu_split_count(1000, 1, 1, 132), 4);
        assert_eq!(gpu_split_count(1, 1, 1, 132), 1);
        // Never more than 64.
        assert_eq!(gpu_split_count(1 << 24, 1, 1, 1000), 64);
        assert_eq!(gpu_split_count(0, 0, 0, 0), 1);
    }
}
