//! The raw entry points under [`super::DeviceLayer`] and [`super::DecodePlan`]: the
//! kernels on device addresses (`CUdeviceptr` values on a GPU, host addresses on the
//! emulator; [`super::DeviceBuffer::addr`] and [`super::DeviceSlice::addr`] give them),
//! enqueued on the [`Device`]'s
//! stream. For a stack that owns its pools, tables and workspaces. Launch shapes are
//! those of [`crate::launch`]. An append needs no host-made metadata: the kernels find
//! every token's place from the sequence's block table and protected list on the
//! device (`rotkv_kernels::append::destination`), and can keep the sequence length on
//! the device too ([`crate::launch::AppendPtrs::seq_len`]). On cuda the same operations
//! on a caller's raw `CUstream` are the methods of `crate::cuda::Kernels`.
//!
//! Nothing here checks a buffer's size or contents: the `# Safety` contracts are the
//! kernels' own. What the host can see it checks before anything is enqueued: the pool
//! and side-store bases must be 16-byte aligned (the kernels read them with 16-byte
//! vector loads and `cp.async`), else [`Error::Shape`].

use super::{Device, Kind, bump};
use crate::error::{Error, Result};
use crate::launch;

/// The parameter blocks and address sets the entry points take, re-exported so that a
/// stack calling them needs no second dependency on `rotkv-kernels`.
pub use crate::launch::{AppendPtrs, BatchPtrs, DecodePtrs, FlushPtrs, MergePtrs};
pub use rotkv_kernels::layout::Format;
pub use rotkv_kernels::params::{
    AppendBatchParams, AppendParams, BATCH_ERROR_BATCH, BATCH_ERROR_BLOCK, BATCH_ERROR_NONFINITE, BATCH_ERRORS,
    BATCH_NO_SLOT, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DecodeParams, MergeParams, batch_meta_len,
};

/// The 32-bit words of a parameter block or the addresses of an address set, for the
/// launch record ([`super::LaunchRecord`]).
fn words<T: Copy>(x: &T) -> Vec<u64> {
    const {
        assert!(size_of::<T>().is_multiple_of(4) && align_of::<T>() >= 4);
    }
    // SAFETY: every type this is called with (the `#[repr(C)]` parameter blocks of u32,
    // f32 and a `Format` of u32, and the address sets of u64) has no padding bytes, so
    // all of its `size_of` bytes are initialized; the read is within the value.
    let bytes = unsafe { std::slice::from_raw_parts((x as *const T).cast::<u8>(), size_of::<T>()) };
    bytes.chunks_exact(4).map(|w| u32::from_ne_bytes([w[0], w[1], w[2], w[3]]) as u64).collect()
}

/// Records a launch of `kernel` with parameter block `p` and addresses `a` (when the
/// device records) and counts it.
fn note<P: Copy, A: Copy>(device: &Device, kernel: &'static str, grid: [u32; 3], p: &P, a: &A) {
    bump(&device.0.stats.launches);
    let mut args = words(p);
    args.extend(words(a));
    device.log_launch(kernel, grid, args);
}

/// A pool or side-store base the kernels read with 16-byte loads.
fn aligned16(what: &str, addr: u64) -> Result<()> {
    if addr.is_multiple_of(16) {
        Ok(())
    } else {
        Err(Error::Shape(format!("the {what} at {addr:#x} is not 16-byte aligned")))
    }
}

/// Enqueues the decode kernel of [`crate::launch::decode_launch`]`(p)` (`decode_split`
/// or `decode_mma`: grid, block and shared memory from there).
///
/// # Errors
/// [`Error::Shape`] for a pool or side-store base that is not 16-byte aligned (nothing
/// is enqueued).
///
/// # Safety
/// Every address in `ptrs` is a live allocation of `device` holding what the kernel's
/// `# Safety` section (`rotkv_kernels::decode::decode_split`,
/// `rotkv_kernels::decode_mma::decode_mma`) asks for `p`: queries for `p.num_seqs`
/// sequences of `p.q_len` rows, block tables of `p.block_table_stride >=
/// pages_for(p.max_len)` entries, every entry a block of the pool of `p.num_blocks`
/// blocks for right results (both kernels clamp each length `lens[s]` to `p.max_len`
/// and each table entry below `p.num_blocks`: a wrong entry reads a wrong page of a pool
/// of at least one block, never memory outside it; with `p.num_blocks == 0` no length
/// may reach a quantized page), side stores and protected lists per sequence,
/// partials for `p.num_seqs * p.q_len * p.num_q_heads * p.num_splits` rows (with a step
/// batch, `p.batch_rows > 0`: `ptrs.meta` its `batch_meta_len(p.batch_rows,
/// p.batch_seqs)` u32 and partials for `p.batch_rows * p.num_q_heads * p.num_splits`
/// rows; else `ptrs.meta` unused); the pool and
/// side stores 16-byte aligned; none of it written by other work while this runs.
pub unsafe fn decode(device: &Device, p: &DecodeParams, ptrs: &DecodePtrs) -> Result<()> {
    aligned16("pool", ptrs.pool)?;
    aligned16("side stores", ptrs.sides)?;
    let l = launch::decode_launch(p);
    note(device, launch::decode_entry(&p.format, l.kernel)?, l.grid, p, ptrs);
    match &device.0.kind {
        // SAFETY: forwarded contract.
        #[cfg(feature = "sim")]
        Kind::Sim => unsafe { crate::sim::decode_raw(p, ptrs) },
        // SAFETY: forwarded contract.
        #[cfg(feature = "cuda")]
        Kind::Cuda { stream, kernels, .. } => unsafe { kernels.decode(stream.cu_stream(), p, ptrs) },
    }
}

/// Enqueues `decode_merge`: grid (query heads, `p.num_seqs`), one warp per block.
///
/// # Safety
/// As `rotkv_kernels::merge::decode_merge` asks: partials for `p.num_seqs` rows (a
/// decode's sequences times query tokens) of `p.num_q_heads` heads and `p.num_splits`
/// splits, inverse value permutations `[kv_head][head_dim]`, learned value rotations
/// when `p.flags` has `FLAG_DENSE_VALUES`, an output of `p.num_seqs * p.num_q_heads *
/// p.head_dim` f32 (or f16 with `FLAG_OUTPUT_F16`); `ptrs.meta` 0, or a step batch of
/// `p.num_seqs` rows over `p.batch_seqs` slots (rows its decode did not write are
/// written as zeros); all live allocations of `device`.
pub unsafe fn merge(device: &Device, p: &MergeParams, ptrs: &MergePtrs) -> Result<()> {
    note(device, launch::merge_entry(p.head_dim)?, [p.num_q_heads, p.num_seqs, 1], p, ptrs);
    match &device.0.kind {
        // SAFETY: forwarded contract.
        #[cfg(feature = "sim")]
        Kind::Sim => unsafe { crate::sim::merge_raw(p, ptrs) },
        // SAFETY: forwarded contract.
        #[cfg(feature = "cuda")]
        Kind::Cuda { stream, kernels, .. } => unsafe { kernels.merge(stream.cu_stream(), p, ptrs) },
    }
}

/// Enqueues `append_flush` for the append `p` (`p.start` the length before it,
/// `p.new_len` after): the window rows whose page fills, quantized from the side store
/// (nothing is launched when none does; grid [`crate::launch::flush_grid`]).
///
/// # Errors
/// [`Error::Shape`] for a pool or side-store base that is not 16-byte aligned (nothing
/// is enqueued).
///
/// # Safety
/// As `rotkv_kernels::append::append_flush` asks: `ptrs.block_table` the sequence's
/// table with at least `p.format.pages_for(p.new_len)` entries, `ptrs.side` its side
/// store (`p.format.side_elems(p.num_kv_heads)` f16), `ptrs.pool` a 16-byte aligned pool
/// of `p.num_blocks` blocks; all live allocations of `device`. Table entries at or past
/// `p.num_blocks` are skipped, never written. It must run before the same append's
/// [`append_tokens`] (same stream: it does).
pub unsafe fn append_flush(device: &Device, p: &AppendParams, ptrs: &FlushPtrs) -> Result<()> {
    aligned16("pool", ptrs.pool)?;
    aligned16("side store", ptrs.side)?;
    let Some(grid) = launch::flush_grid(p) else { return Ok(()) };
    note(device, launch::append_entries(p.format.head_dim)?.1, grid, p, ptrs);
    match &device.0.kind {
        // SAFETY: forwarded contract.
        #[cfg(feature = "sim")]
        Kind::Sim => unsafe { crate::sim::flush_raw(p, ptrs) },
        // SAFETY: forwarded contract.
        #[cfg(feature = "cuda")]
        Kind::Cuda { stream, kernels, .. } => unsafe { kernels.flush(stream.cu_stream(), p, ptrs) },
    }
}

/// Enqueues `append_tokens` for `p.count` tokens of one sequence (positions `p.start ..`,
/// the sequence holding `p.new_len` tokens after the append), in launches of at most
/// 65,535 tokens.
///
/// # Errors
/// [`Error::Shape`] for a pool or side-store base that is not 16-byte aligned (nothing
/// is enqueued).
///
/// # Safety
/// As `rotkv_kernels::append::append_tokens` asks for `p`: K and V of `p.input_dtype`,
/// K valid for `p.count` tokens at `p.token_stride` and V for `p.count` tokens at
/// `p.v_token_stride` (element `t * stride + h * p.head_stride + c` for `t < p.count`,
/// `h < p.num_kv_heads`, `c < head_dim`, each at its own stride: `p.token_stride` is
/// never used for V), the layer's calibration buffers, the
/// sequence's block table (at least `p.format.pages_for(p.new_len)` entries) and
/// protected list (`p.format.protected` entries, ascending, padded with `u32::MAX`), the
/// pool (`p.num_blocks` blocks, 16-byte aligned), the sequence's side store and, unless
/// 0, one u32 for its length; all live allocations of `device`. Table entries at or past
/// `p.num_blocks` are skipped, never written.
pub unsafe fn append_tokens(device: &Device, p: &AppendParams, ptrs: &AppendPtrs) -> Result<()> {
    aligned16("pool", ptrs.pool)?;
    aligned16("side store", ptrs.side)?;
    note(device, launch::append_entries(p.format.head_dim)?.0, launch::tokens_grid(p), p, ptrs);
    match &device.0.kind {
        // SAFETY: forwarded contract.
        #[cfg(feature = "sim")]
        Kind::Sim => unsafe { crate::sim::append_tokens_raw(p, ptrs) },
        // SAFETY: forwarded contract.
        #[cfg(feature = "cuda")]
        Kind::Cuda { stream, kernels, .. } => unsafe { kernels.append_tokens(stream.cu_stream(), p, ptrs) },
    }
}

/// Enqueues the batched append of a serving step for one layer: `append_batch_flush`
/// (grid `rotkv_kernels::append::batch_flush_grid`) then `append_batch_tokens` (grid
/// `rotkv_kernels::append::batch_tokens_grid`). Two launches whatever the step holds:
/// which slots take how many tokens, and so which window rows are flushed and where
/// every token goes, is read on the device from the step batch at `ptrs.meta`.
///
/// # Errors
/// [`Error::Shape`] for a pool or side-store base that is not 16-byte aligned;
/// [`Error::Unsupported`] for a head_dim without kernels (nothing is enqueued).
///
/// # Safety
/// As `rotkv_kernels::append::append_batch_flush` and `append_batch_tokens` ask for `bp`:
/// `ptrs.meta` a step batch of `batch_meta_len(bp.max_rows, bp.max_seqs)` u32 whose
/// starts are the slots' lengths on the device; K and V valid for `bp.max_rows` rows at
/// their strides; `bp.max_seqs` block tables of `bp.table_stride` entries, protected
/// lists of `bp.protected_stride`, side stores, lengths; the layer's calibration buffers
/// and pool; `ptrs.errors` 0 or [`BATCH_ERRORS`] u32; all live allocations of `device`.
/// Block-table entries at or past the pool, and rows the step batch does not describe
/// consistently, are skipped and counted in the error words, never read or written out
/// of bounds; every other entry a slot's new length needs must be a block of the pool
/// that no other slot uses.
pub unsafe fn append_batch(device: &Device, bp: &AppendBatchParams, ptrs: &BatchPtrs) -> Result<()> {
    aligned16("pool", ptrs.pool)?;
    aligned16("side stores", ptrs.sides)?;
    let (tok, flush) = launch::append_batch_entries(bp.append.format.head_dim)?;
    note(device, flush, rotkv_kernels::append::batch_flush_grid(bp), bp, ptrs);
    note(device, tok, rotkv_kernels::append::batch_tokens_grid(bp), bp, ptrs);
    match &device.0.kind {
        // SAFETY: forwarded contract.
        #[cfg(feature = "sim")]
        Kind::Sim => unsafe { crate::sim::append_batch_raw(bp, ptrs) },
        // SAFETY: forwarded contract.
        #[cfg(feature = "cuda")]
        Kind::Cuda { stream, kernels, .. } => unsafe { kernels.append_batch(stream.cu_stream(), bp, ptrs) },
    }
}
