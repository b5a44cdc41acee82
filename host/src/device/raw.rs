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
use crate::launch::{AppendPtrs, DecodePtrs, FlushPtrs, MergePtrs};
use rotkv_kernels::params::{AppendParams, DecodeParams, MergeParams};

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
/// blocks (the kernels clamp each length `lens[s]` to `p.max_len`, and `decode_split`
/// also each table entry; `decode_mma`, the kernel the planning picks for head_dim 64
/// and 128 and for head_dim 256 with groups of 128, trusts the entries: a wrong one reads
/// outside the pool), side stores and protected lists per sequence,
/// partials for `p.num_seqs * p.q_len * p.num_q_heads * p.num_splits` rows; the pool and
/// side stores 16-byte aligned; none of it written by other work while this runs.
pub unsafe fn decode(device: &Device, p: &DecodeParams, ptrs: &DecodePtrs) -> Result<()> {
    aligned16("pool", ptrs.pool)?;
    aligned16("side stores", ptrs.sides)?;
    bump(&device.0.stats.launches);
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
/// p.head_dim` f32 (or f16 with `FLAG_OUTPUT_F16`); all live allocations of `device`.
pub unsafe fn merge(device: &Device, p: &MergeParams, ptrs: &MergePtrs) -> Result<()> {
    bump(&device.0.stats.launches);
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
    if crate::launch::flush_grid(p).is_none() {
        return Ok(());
    }
    bump(&device.0.stats.launches);
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
    bump(&device.0.stats.launches);
    match &device.0.kind {
        // SAFETY: forwarded contract.
        #[cfg(feature = "sim")]
        Kind::Sim => unsafe { crate::sim::append_tokens_raw(p, ptrs) },
        // SAFETY: forwarded contract.
        #[cfg(feature = "cuda")]
        Kind::Cuda { stream, kernels, .. } => unsafe { kernels.append_tokens(stream.cu_stream(), p, ptrs) },
    }
}
