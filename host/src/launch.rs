//! Host-side launch planning shared by the device backends (`sim`, `cuda`): the buffers
//! the kernels read, in the layout they read them, and the launch geometry. Both backends
//! go through these functions, so the emulator checks the same launches a GPU gets. The
//! CPU backend uses [`store_f16_rows`] for its sink and window rows.

use crate::config::LayerCalibration;
use crate::error::{Error, Result};
use crate::reference::{self, SeqRef};
use half::f16;
use rotkv_kernels::decode::{MAX_GROUP, decode_shared_bytes};
use rotkv_kernels::decode_mma::{self, mma_shared_bytes};
use rotkv_kernels::layout::{Format, Place};
use rotkv_kernels::params::{AppendParams, DTYPE_F32, DecodeParams, MergeParams};

/// Threads per block of the one-warp kernels (append, `decode_split`, merge).
pub const BLOCK: u32 = 32;

/// Largest grid y or z dimension a GPU launches.
pub const MAX_GRID_YZ: u32 = 65_535;

/// Which decode kernel runs a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernel {
    /// `decode_mma` (tensor cores) with this many quantization groups per head.
    Mma {
        /// Groups per head (`head_dim / group_size`).
        groups: u32,
    },
    /// `decode_split` (CUDA cores).
    Split,
}

/// Whether `decode_mma` has an instantiation for `(head_dim, key bits, value bits,
/// groups per head)` (from `for_each_decode_mma!`).
pub fn mma_instantiated(fmt: &Format) -> bool {
    macro_rules! any {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal, $ng:literal, $nks:literal, $nvt:literal)),* $(,)?) => {
            false $(|| (fmt.head_dim, fmt.key_bits, fmt.value_bits, fmt.groups()) == ($d, $kb, $vb, $ng))*
        };
    }
    rotkv_kernels::for_each_decode_mma!(any)
}

/// The launch-planning rule: the tensor-core kernel wherever it is instantiated, for any
/// number of query rows (GQA heads x query tokens). With one or two rows the MMA wastes
/// most of its 16 rows, but its cost per token is in unpacking codes, not in rows: read
/// from the SASS (`cargo xtask sass`), `decode_mma` spends ~30 warp-instructions per
/// (token, KV head) at head_dim 128 and `decode_split` several hundred whatever the group,
/// so the CUDA-core kernel serves only what `decode_mma` does not instantiate.
pub fn decode_kernel(fmt: &Format) -> DecodeKernel {
    if mma_instantiated(fmt) { DecodeKernel::Mma { groups: fmt.groups() } } else { DecodeKernel::Split }
}

/// Refuses what the device kernels do not implement: variance normalization (KVarN
/// channel scales) runs on the reference and cpu backends only.
pub fn check_format(fmt: &Format) -> Result<()> {
    if fmt.channel_norm > 0 {
        return Err(Error::Unsupported(
            "variance normalization (channel_norm) on the device kernels: use the cpu or reference backend".into(),
        ));
    }
    Ok(())
}

/// Blocks per split in grid z: query tokens (`decode_split`) or row tiles of 16
/// (`decode_mma`).
fn z_factor(kernel: DecodeKernel, gqa: usize, q_len: usize) -> usize {
    match kernel {
        DecodeKernel::Split => q_len,
        DecodeKernel::Mma { .. } => (gqa * q_len).div_ceil(decode_mma::ROWS as usize),
    }
}

/// The launch shape of a decode step: which kernel, its grid, block and dynamic shared
/// memory. Every device backend launches exactly this.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLaunch {
    /// The kernel the planning rule chose.
    pub kernel: DecodeKernel,
    /// Grid: (KV heads, sequences, splits x query tokens) for `decode_split`, (KV heads,
    /// sequences, splits x row tiles of 16) for `decode_mma`.
    pub grid: [u32; 3],
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory in bytes.
    pub shared: u32,
}

/// Splits per sequence for a fixed decode plan, the launch being `per_split` blocks for
/// each split on a GPU that holds `wave` blocks at once (multiprocessors x the kernel's
/// resident blocks per multiprocessor); no split shorter than 256 tokens of
/// `max_context`, at most 64.
///
/// Wave quantization decides: `s` splits make `s x per_split / wave` waves, and a last
/// partial wave leaves multiprocessors idle (320 blocks on 264 slots take two rounds for
/// 1.2 waves of work), so the efficiency of `s` is `waves / ceil(waves)`. The rule: one
/// split when a single split's blocks already fill 80% of a wave; `cap` where even `cap`
/// splits stay within one wave; the most splits that stay within one wave when they fill
/// at least 85% of it; else FlashAttention-2's split heuristic (`num_splits_heuristic`),
/// the fewest splits whose efficiency is within 85% of the best over `1 ..= cap` (fewer
/// splits: less merge work and setup per block). Batch 8 x 8 KV heads on an H200 at 2
/// blocks per multiprocessor: 4 splits (256 blocks, 97% of a wave), where filling the
/// wave from above took 5 (320 blocks, 61%).
pub fn wave_splits(max_context: usize, per_split: usize, wave: usize) -> u32 {
    let cap = max_context.div_ceil(256).clamp(1, 64);
    let (per, wave) = (per_split.max(1), wave.max(1));
    if per as f64 >= 0.8 * wave as f64 {
        return 1;
    }
    // Not even `cap` splits fill a wave: as many as allowed (each adds blocks in flight).
    if cap * per <= wave {
        return cap as u32;
    }
    let one_wave = (wave / per).min(cap);
    if (one_wave * per) as f64 >= 0.85 * wave as f64 {
        return one_wave as u32;
    }
    let eff = |s: usize| {
        let waves = (s * per) as f64 / wave as f64;
        waves / waves.ceil()
    };
    let best = (1..=cap).map(eff).fold(0.0, f64::max);
    (1..=cap).find(|&s| eff(s) >= 0.85 * best).unwrap_or(cap) as u32
}

/// The decode launch for validated parameters (`num_kv_heads > 0`).
pub fn decode_launch(p: &DecodeParams) -> DecodeLaunch {
    let gqa = p.num_q_heads / p.num_kv_heads.max(1);
    let kernel = decode_kernel(&p.format);
    let z = p.num_splits as usize * z_factor(kernel, gqa as usize, p.q_len as usize);
    let (block, shared) = match kernel {
        DecodeKernel::Split => (BLOCK, decode_shared_bytes(&p.format, MAX_GROUP as u32)),
        DecodeKernel::Mma { groups } => {
            (decode_mma::THREADS, mma_shared_bytes(p.format.head_dim, p.format.key_bits, p.format.value_bits, groups))
        }
    };
    DecodeLaunch { kernel, grid: [p.num_kv_heads, p.num_seqs, z as u32], block, shared }
}

/// The PTX entry point of a decode launch.
pub fn decode_entry(fmt: &Format, kernel: DecodeKernel) -> Result<&'static str> {
    macro_rules! split {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal)),* $(,)?) => {
            match (fmt.head_dim, fmt.key_bits, fmt.value_bits) {
                $(($d, $kb, $vb) => Ok(stringify!($name)),)*
                other => Err(Error::Unsupported(format!("decode_split for (head_dim, key bits, value bits) {other:?}"))),
            }
        };
    }
    macro_rules! mma {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal, $ng:literal, $nks:literal, $nvt:literal)),* $(,)?) => {
            match (fmt.head_dim, fmt.key_bits, fmt.value_bits, fmt.groups()) {
                $(($d, $kb, $vb, $ng) => Ok(stringify!($name)),)*
                other => Err(Error::Unsupported(format!("decode_mma for (head_dim, key bits, value bits, groups) {other:?}"))),
            }
        };
    }
    match kernel {
        DecodeKernel::Split => rotkv_kernels::for_each_decode!(split),
        DecodeKernel::Mma { .. } => rotkv_kernels::for_each_decode_mma!(mma),
    }
}

/// Everything `decode_split` reads besides the pool and the queries.
pub struct DecodeInputs {
    /// The launch parameters (with the block-table stride filled in).
    pub params: DecodeParams,
    /// Block tables, `[seq][stride]` (padded with 0).
    pub tables: Vec<u32>,
    /// Sequence lengths.
    pub lens: Vec<u32>,
    /// Side stores back to back, f16 bits, 16-byte aligned storage.
    sides: Vec<u128>,
    side_len: usize,
    /// Protected positions, `[seq][format.protected]` padded with `u32::MAX` (one
    /// padding entry when the format has none, so no buffer is empty).
    pub protected: Vec<u32>,
    /// Inverse value permutations for `decode_merge`.
    pub vperm_inv: Vec<u16>,
    /// The decode kernel the launch-planning rule chose.
    pub kernel: DecodeKernel,
}

impl DecodeInputs {
    /// Checks what the kernels assume beyond the paged layer's checks (GQA group size,
    /// query size, pool alignment) and lays out the inputs.
    pub fn new(
        p: &DecodeParams,
        calib: &LayerCalibration,
        pool: &[u8],
        seqs: &[SeqRef<'_>],
        q: &[f32],
    ) -> Result<Self> {
        let fmt = p.format;
        check_format(&fmt)?;
        let d = fmt.head_dim as usize;
        let (s, hq, hkv) = (seqs.len(), p.num_q_heads as usize, p.num_kv_heads as usize);
        if hkv == 0 || hq / hkv > MAX_GROUP {
            return Err(Error::Unsupported(format!(
                "{hq} query heads for {hkv} KV heads on the device kernels (at most {MAX_GROUP} per KV head)"
            )));
        }
        let q_len = p.q_len as usize;
        let dense = p.q_seq_stride as usize == q_len * hq * d && p.q_token_stride as usize == hq * d;
        if q_len == 0 || q.len() != s * p.q_seq_stride as usize || !dense || p.q_dtype != DTYPE_F32 {
            return Err(Error::Shape(format!("q has {} elements for {s} sequences of {q_len} x {hq} x {d}", q.len())));
        }
        if let Some((i, x)) = seqs.iter().enumerate().find(|(_, x)| x.len < q_len) {
            return Err(Error::Shape(format!("sequence {i} has {} tokens, fewer than q_len {q_len}", x.len)));
        }
        let kernel = decode_kernel(&fmt);
        let z = p.num_splits as usize * z_factor(kernel, hq / hkv, q_len);
        if s > MAX_GRID_YZ as usize || z > MAX_GRID_YZ as usize || s * q_len > MAX_GRID_YZ as usize {
            return Err(Error::Capacity(format!(
                "{s} sequences x {q_len} query tokens x {} splits exceeds the GPU grid ({MAX_GRID_YZ} per dimension)",
                p.num_splits
            )));
        }
        if !pool.is_empty() && !(pool.as_ptr() as usize).is_multiple_of(16) {
            return Err(Error::Shape("the pool must start on a 16-byte boundary".into()));
        }
        let stride = seqs.iter().map(|x| x.block_table.len()).max().unwrap_or(0).max(1);
        let mut tables = vec![0u32; s * stride];
        for (i, x) in seqs.iter().enumerate() {
            tables[i * stride..i * stride + x.block_table.len()].copy_from_slice(x.block_table);
        }
        let side_elems = fmt.side_elems(p.num_kv_heads);
        let mut sides = vec![0u128; (s * side_elems).div_ceil(8)];
        let bits: &mut [u16] = &mut bytemuck::cast_slice_mut::<u128, u16>(&mut sides)[..s * side_elems];
        for (i, x) in seqs.iter().enumerate() {
            if x.side.len() != side_elems {
                return Err(Error::Shape(format!("side store of sequence {i} has {} elements", x.side.len())));
            }
            bits[i * side_elems..(i + 1) * side_elems].iter_mut().zip(x.side).for_each(|(o, v)| *o = v.to_bits());
        }
        let np = fmt.protected as usize;
        let mut protected = vec![u32::MAX; (s * np).max(1)];
        for (i, x) in seqs.iter().enumerate() {
            if x.protected.len() > np {
                return Err(Error::Capacity(format!("sequence {i} has {} protected positions", x.protected.len())));
            }
            protected[i * np..i * np + x.protected.len()].copy_from_slice(x.protected);
        }
        Ok(Self {
            params: DecodeParams {
                block_table_stride: stride as u32,
                num_blocks: (pool.len() / (p.num_kv_heads as usize * fmt.page_bytes() as usize).max(1))
                    .try_into()
                    .unwrap_or(u32::MAX),
                max_len: seqs.iter().map(|x| x.len as u32).max().unwrap_or(0),
                ..*p
            },
            tables,
            lens: seqs.iter().map(|x| x.len as u32).collect(),
            sides,
            side_len: s * side_elems,
            protected,
            vperm_inv: calib.value_perm_inverse(d),
            kernel,
        })
    }

    /// The side stores as f16 bits (16-byte aligned).
    pub fn sides(&self) -> &[u16] {
        &bytemuck::cast_slice::<u128, u16>(&self.sides)[..self.side_len]
    }

    /// Threads per block of the decode kernel.
    pub fn split_block(&self) -> u32 {
        decode_launch(&self.params).block
    }

    /// Decode kernel grid: (KV heads, sequences, splits x query tokens) for
    /// `decode_split`, (KV heads, sequences, splits x row tiles) for `decode_mma`.
    pub fn split_grid(&self) -> [u32; 3] {
        decode_launch(&self.params).grid
    }

    /// Decode kernel dynamic shared memory.
    pub fn split_shared_bytes(&self) -> u32 {
        decode_launch(&self.params).shared
    }

    /// Elements of the partial outputs `(m and l, o)`: `[seq][q_len][q_head][split]`.
    pub fn partial_lens(&self) -> (usize, usize) {
        let p = &self.params;
        let n = p.num_seqs as usize * p.q_len as usize * p.num_q_heads as usize * p.num_splits as usize;
        (n, n * p.format.head_dim as usize)
    }

    /// `decode_merge` parameters and grid (query heads, sequences x query tokens): each
    /// query token's rows merge like a sequence of their own.
    pub fn merge(&self) -> (MergeParams, [u32; 3]) {
        let p = &self.params;
        let rows = p.num_seqs * p.q_len;
        let mp = MergeParams {
            num_seqs: rows,
            num_q_heads: p.num_q_heads,
            num_kv_heads: p.num_kv_heads,
            head_dim: p.format.head_dim,
            num_splits: p.num_splits,
            flags: p.flags,
            out_row_stride: p.num_q_heads * p.format.head_dim,
            batch_seqs: 0,
            q_len: p.q_len,
        };
        (mp, [p.num_q_heads, rows, 1])
    }
}

/// Device addresses (`CUdeviceptr` values on a GPU, host addresses on the emulator) of
/// the buffers a decode kernel (`decode_split` or `decode_mma`) reads and writes, in the
/// order of its entry point. Sizes and layouts: the kernel's `# Safety` section.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodePtrs {
    /// Queries, f32 `[seq][q_len][q_head][head_dim]` (`q_seq_stride` between sequences).
    pub q: u64,
    /// The page pool (16-byte aligned).
    pub pool: u64,
    /// Block tables, u32 `[seq][block_table_stride]`.
    pub tables: u64,
    /// Sequence lengths, u32 `[seq]`.
    pub lens: u64,
    /// Side stores, f16 `[seq][side_elems]` (16-byte aligned).
    pub sides: u64,
    /// Protected positions, u32 `[seq][format.protected]` (padded with `u32::MAX`).
    pub protected: u64,
    /// Key scales (smoothing), f32 `[kv_head][head_dim]`: the query is multiplied by them
    /// before its rotation.
    pub key_scale: u64,
    /// Key permutations, u16 `[kv_head][head_dim]`.
    pub key_perm: u64,
    /// Learned key rotations, f32 `[kv_head][head_dim][head_dim]` (read only with
    /// `FLAG_DENSE_KEYS`).
    pub key_rot: u64,
    /// Partial maxima, f32 `[seq][q_len][q_head][split]`.
    pub m: u64,
    /// Partial sums, as `m`.
    pub l: u64,
    /// Partial outputs, f32 `[seq][q_len][q_head][split][head_dim]`.
    pub o: u64,
    /// The step batch (u32, with [`DecodeParams::batch_rows`] `> 0`), or 0 for a uniform
    /// batch.
    pub meta: u64,
}

/// Device addresses of `decode_merge`'s buffers, in its entry point's order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MergePtrs {
    /// Partial maxima (as [`DecodePtrs::m`]).
    pub m: u64,
    /// Partial sums.
    pub l: u64,
    /// Partial outputs.
    pub o: u64,
    /// Inverse value permutations, u16 `[kv_head][head_dim]`.
    pub vperm_inv: u64,
    /// Learned value rotations (read only with `FLAG_DENSE_VALUES`).
    pub value_rot: u64,
    /// Output, f32 or f16 (`FLAG_OUTPUT_F16`) `[seq x q_len][q_head][head_dim]`.
    pub out: u64,
    /// The step batch whose first `num_seqs` entries are the rows' slots (a row without
    /// one is written as zeros), or 0.
    pub meta: u64,
}

/// Device addresses of `append_tokens`'s buffers, in its entry point's order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppendPtrs {
    /// Keys, `[token][kv_head][head_dim]` of `input_dtype`, `token_stride` apart.
    pub k: u64,
    /// Values, as `k` but `v_token_stride` apart.
    pub v: u64,
    /// Key mean, f32 `[kv_head][head_dim]`.
    pub key_mean: u64,
    /// Key scales (smoothing), f32 `[kv_head][head_dim]`, finite and > 0: the centered
    /// key is divided by them before its rotation.
    pub key_scale: u64,
    /// Key permutations, u16 `[kv_head][head_dim]`.
    pub key_perm: u64,
    /// Value permutations, u16 `[kv_head][head_dim]`.
    pub value_perm: u64,
    /// Learned key rotations (read only with `FLAG_DENSE_KEYS`).
    pub key_rot: u64,
    /// Learned value rotations (read only with `FLAG_DENSE_VALUES`).
    pub value_rot: u64,
    /// The sequence's block-table row, u32 (at least `pages_for(new_len)` entries).
    pub block_table: u64,
    /// The sequence's protected positions, u32 `[format.protected]` (ascending, padded
    /// with `u32::MAX`; not read when the format protects none).
    pub protected: u64,
    /// The page pool.
    pub pool: u64,
    /// The sequence's side store, f16.
    pub side: u64,
    /// Where the device keeps the sequence's length (one u32, written with the new
    /// length by the launch holding the last token), or 0 for none.
    pub seq_len: u64,
}

/// Device addresses of `append_flush`'s buffers, in its entry point's order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushPtrs {
    /// The sequence's block-table row, u32.
    pub block_table: u64,
    /// The sequence's side store, f16.
    pub side: u64,
    /// The page pool.
    pub pool: u64,
}

/// Device addresses of the batched append's buffers (`append_batch_flush` and
/// `append_batch_tokens`), every slot's at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchPtrs {
    /// The step batch, u32 [`rotkv_kernels::params::batch_meta_len`] entries (see
    /// [`rotkv_kernels::params::AppendBatchParams`]).
    pub meta: u64,
    /// Keys, `[row][kv_head][head_dim]` of `input_dtype`, `token_stride` apart
    /// (`max_rows` rows).
    pub k: u64,
    /// Values, as `k` but `v_token_stride` apart.
    pub v: u64,
    /// Key mean, f32 `[kv_head][head_dim]`.
    pub key_mean: u64,
    /// Key scales, f32 `[kv_head][head_dim]`.
    pub key_scale: u64,
    /// Key permutations, u16 `[kv_head][head_dim]`.
    pub key_perm: u64,
    /// Value permutations, u16 `[kv_head][head_dim]`.
    pub value_perm: u64,
    /// Learned key rotations (read only with `FLAG_DENSE_KEYS`).
    pub key_rot: u64,
    /// Learned value rotations (read only with `FLAG_DENSE_VALUES`).
    pub value_rot: u64,
    /// Block tables, u32 `[max_seqs][table_stride]`.
    pub tables: u64,
    /// Protected lists, u32 `[max_seqs][protected_stride]`.
    pub protected: u64,
    /// The page pool.
    pub pool: u64,
    /// Side stores, f16 `[max_seqs][side_elems]`.
    pub sides: u64,
    /// Sequence lengths, u32 `[max_seqs]` (the slots with new tokens get their new length).
    pub lens: u64,
    /// Error counters, u32 [`rotkv_kernels::params::BATCH_ERRORS`], or 0 for none.
    pub errors: u64,
}

/// The batched-append entry points `(tokens, flush)` for a head dimension.
pub fn append_batch_entries(d: u32) -> Result<(&'static str, &'static str)> {
    macro_rules! names {
        ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {
            match d {
                $($d => Ok((stringify!($tok), stringify!($flush))),)*
                other => Err(Error::Unsupported(format!("head_dim {other}"))),
            }
        };
    }
    rotkv_kernels::for_each_append_batch!(names)
}

/// The `decode_merge` entry point for a head dimension.
pub fn merge_entry(d: u32) -> Result<&'static str> {
    macro_rules! name {
        ($name:ident, $d:literal, $v:literal) => {
            if d == $d {
                return Ok(stringify!($name));
            }
        };
    }
    rotkv_kernels::for_each_merge!(name);
    Err(Error::Unsupported(format!("head_dim {d}")))
}

/// The append entry points `(tokens, flush)` for a head dimension.
pub fn append_entries(d: u32) -> Result<(&'static str, &'static str)> {
    macro_rules! names {
        ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {
            match d {
                $($d => Ok((stringify!($tok), stringify!($flush))),)*
                other => Err(Error::Unsupported(format!("head_dim {other}"))),
            }
        };
    }
    rotkv_kernels::for_each_append!(names)
}

/// `append_tokens` grid for a chunk of `count` tokens: (KV heads, count). A launch covers
/// at most [`MAX_GRID_YZ`] tokens; [`token_chunks`] cuts longer appends.
pub fn tokens_grid(p: &AppendParams) -> [u32; 3] {
    [p.num_kv_heads, p.count, 1]
}

/// `append_flush` grid: (window positions whose page fills, KV heads, 2), or `None`
/// when no page fills (nothing to launch).
pub fn flush_grid(p: &AppendParams) -> Option<[u32; 3]> {
    let (_, n) = rotkv_kernels::append::flush_range(p);
    (n > 0).then_some([n, p.num_kv_heads, 2])
}

/// The `append_tokens` launches of an append `p`: at most [`MAX_GRID_YZ`] tokens each
/// (the GPU's grid y limit), as `(first token, params)`: the chunk's `start` advanced by
/// `first`, `count` its tokens, `new_len` the whole append's; its K/V inputs start
/// `first` tokens in.
pub fn token_chunks(p: &AppendParams) -> impl Iterator<Item = (u32, AppendParams)> + '_ {
    (0..p.count).step_by(MAX_GRID_YZ as usize).map(move |first| {
        (first, AppendParams { start: p.start + first, count: (p.count - first).min(MAX_GRID_YZ), ..*p })
    })
}

/// The inputs of the `append_tokens` launch of `p` that starts `first` tokens in (a
/// [`token_chunks`] chunk): `k` advanced by `first` K token strides, `v` by `first` V
/// token strides (elements of `p.input_dtype`), every other address as in `ptrs`.
pub fn chunk_ptrs(p: &AppendParams, first: u32, ptrs: &AppendPtrs) -> AppendPtrs {
    let elem = dtype_bytes(p.input_dtype) as u64;
    let skip = |stride: u32| first as u64 * stride as u64 * elem;
    AppendPtrs { k: ptrs.k + skip(p.token_stride), v: ptrs.v + skip(p.v_token_stride), ..*ptrs }
}

/// A sequence's protected list as the append and decode kernels read it: `fmt.protected`
/// entries (at least one), ascending positions padded with `u32::MAX`.
pub fn protected_row(fmt: &Format, protected: &[u32]) -> Vec<u32> {
    let mut row = vec![u32::MAX; (fmt.protected as usize).max(1)];
    row.iter_mut().zip(protected).for_each(|(r, &p)| *r = p);
    row
}

/// Bytes of one K/V input element of type `dtype` (`DTYPE_*`: 4 for f32, else 2).
pub fn dtype_bytes(dtype: u32) -> usize {
    if dtype == rotkv_kernels::params::DTYPE_F32 { 4 } else { 2 }
}

/// Blocks a layer's pool may have: block-table entries are u32, and the kernels compute
/// every pool offset in 64 bits, so any u32 block below `u32::MAX` (which stays free as
/// a marker) is addressable. A larger pool is refused with [`Error::Capacity`] by the
/// paged layer and the device layer before anything is written.
pub fn max_pool_blocks(_fmt: &Format) -> usize {
    u32::MAX as usize
}

/// Refuses a pool of `num_blocks` blocks past [`max_pool_blocks`].
pub fn check_pool_blocks(fmt: &Format, num_blocks: usize) -> Result<()> {
    let max = max_pool_blocks(fmt);
    if num_blocks > max {
        return Err(Error::Capacity(format!(
            "a pool of {num_blocks} blocks: block-table entries address at most {max} blocks"
        )));
    }
    Ok(())
}

/// Copies the staged rows of new tokens that stay in f16 (sinks and window, and the
/// protected copies of positions in `protected`) into the side store. Runs after the
/// quantize jobs have read the old window.
pub fn store_f16_rows(p: &AppendParams, side: &mut [f16], staged: &[u16], protected: &[u32]) {
    let fmt = p.format;
    let d = fmt.head_dim as usize;
    let hkv = p.num_kv_heads as usize;
    let new_len = p.start + p.count;
    for pos in p.start..new_len {
        let row = match fmt.place(pos, new_len) {
            Place::Sink { index } => Some(index),
            Place::Window { slot } => Some(slot),
            Place::Page { .. } => None,
        };
        let copy = reference::protected_index(protected, pos).map(|i| fmt.protected_row(i));
        for row in row.into_iter().chain(copy) {
            for h in 0..hkv as u32 {
                for value in [false, true] {
                    let at = fmt.side_row_at(h, value, row);
                    let src = ((pos - p.start) as usize * hkv + h as usize) * 2 * d + value as usize * d;
                    side[at..at + d].iter_mut().zip(&staged[src..src + d]).for_each(|(o, &b)| *o = f16::from_bits(b));
                }
            }
        }
    }
}

/// One warp's matrices for the `mma_selftest` kernel: `A` 16 x 16 and `B` 16 x 8 f16,
/// `C` 16 x 8 f32, row-major (`B[k][n]` at `k * 8 + n`). [`MmaCase::new`] makes values
/// whose product f32 and the tensor cores both compute exactly: small integers, and in
/// columns 4..8 of `B` f16 subnormals (`code * 2^-24`, code 0 to 15) with `C` in the
/// same units, so any summation order gives the same f32.
#[derive(Clone, Debug, PartialEq)]
pub struct MmaCase {
    /// A, 16 x 16.
    pub a: Vec<half::f16>,
    /// B, 16 x 8.
    pub b: Vec<half::f16>,
    /// C, 16 x 8.
    pub c: Vec<f32>,
}

impl MmaCase {
    /// A random case from `seed`.
    pub fn new(seed: u64) -> Self {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = |n: u64| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % n) as i64
        };
        let tiny = (2f32).powi(-24);
        let a = (0..256).map(|_| half::f16::from_f32((next(7) - 3) as f32)).collect();
        let b = (0..128)
            .map(|i| {
                let x = if i % 8 < 4 { (next(9) - 4) as f32 } else { next(16) as f32 * tiny };
                half::f16::from_f32(x)
            })
            .collect();
        let c = (0..128).map(|i| (next(11) - 5) as f32 * if i % 8 < 4 { 1.0 } else { tiny }).collect();
        Self { a, b, c }
    }

    /// `A * B + C` in f32, 16 x 8 row-major.
    pub fn product(&self) -> Vec<f32> {
        (0..128)
            .map(|i| {
                let (m, n) = (i / 8, i % 8);
                (0..16).map(|k| self.a[m * 16 + k].to_f32() * self.b[k * 8 + n].to_f32()).sum::<f32>() + self.c[i]
            })
            .collect()
    }

    /// The 32 lanes' fragments `(a, b, c)` (`[lane][4]`, `[lane][2]`, `[lane][4]`) in the
    /// layout documented at `Ctx::mma_m16n8k16`, appended to the given vectors.
    pub fn pack(&self, a: &mut Vec<u32>, b: &mut Vec<u32>, c: &mut Vec<f32>) {
        let pair = |lo: half::f16, hi: half::f16| lo.to_bits() as u32 | (hi.to_bits() as u32) << 16;
        let (am, bm) = (|r: usize, k: usize| self.a[r * 16 + k], |k: usize, n: usize| self.b[k * 8 + n]);
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            a.extend_from_slice(&[
                pair(am(g, 2 * t), am(g, 2 * t + 1)),
                pair(am(g + 8, 2 * t), am(g + 8, 2 * t + 1)),
                pair(am(g, 2 * t + 8), am(g, 2 * t + 9)),
                pair(am(g + 8, 2 * t + 8), am(g + 8, 2 * t + 9)),
            ]);
            b.extend_from_slice(&[pair(bm(2 * t, g), bm(2 * t + 1, g)), pair(bm(2 * t + 8, g), bm(2 * t + 9, g))]);
            c.extend_from_slice(&[
                self.c[g * 8 + 2 * t],
                self.c[g * 8 + 2 * t + 1],
                self.c[(g + 8) * 8 + 2 * t],
                self.c[(g + 8) * 8 + 2 * t + 1],
            ]);
        }
    }

    /// One warp's D fragments (`[lane][4]`, as `C`'s) back to a 16 x 8 row-major matrix.
    pub fn unpack(d: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; 128];
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            let f = &d[lane * 4..lane * 4 + 4];
            out[g * 8 + 2 * t] = f[0];
            out[g * 8 + 2 * t + 1] = f[1];
            out[(g + 8) * 8 + 2 * t] = f[2];
            out[(g + 8) * 8 + 2 * t + 1] = f[3];
        }
        out
    }
}

/// Packs `cases` (one per warp) for `mma_selftest`: `(a, b, c)` fragment arrays.
pub fn mma_selftest_inputs(cases: &[MmaCase]) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for x in cases {
        x.pack(&mut a, &mut b, &mut c);
    }
    (a, b, c)
}

/// Compares `mma_selftest`'s output `d` (one warp per case) with the f32 products:
/// exact. The error names the first differing element.
pub fn mma_selftest_check(cases: &[MmaCase], d: &[f32]) -> Result<()> {
    if d.len() != cases.len() * 128 {
        return Err(Error::Shape(format!("{} outputs for {} warps", d.len(), cases.len())));
    }
    for (w, x) in cases.iter().enumerate() {
        let got = MmaCase::unpack(&d[w * 128..(w + 1) * 128]);
        let want = x.product();
        if let Some(i) = (0..128).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            return Err(Error::Backend(format!(
                "mma self-test: warp {w}, D[{}][{}] is {:e}, the f32 product is {:e}",
                i / 8,
                i % 8,
                got[i],
                want[i]
            )));
        }
    }
    Ok(())
}

/// Element `(m, r, c)` of the `ldmatrix_selftest` input: matrix `m` (0-3), row `r`,
/// column `c` (0-7), a distinct 16-bit value that reads back as its own coordinates.
pub fn ldmatrix_selftest_element(m: usize, r: usize, c: usize) -> u16 {
    (0x1000 * m + 0x100 * r + c) as u16
}

/// The `ldmatrix_selftest` kernel's input: 32 rows of 16 bytes, row `8 m + r` holding
/// [`ldmatrix_selftest_element`]`(m, r, 0..8)` in little-endian order.
pub fn ldmatrix_selftest_rows() -> Vec<u8> {
    (0..32).flat_map(|i| (0..8).flat_map(move |c| ldmatrix_selftest_element(i / 8, i % 8, c).to_le_bytes())).collect()
}

/// Checks the `ldmatrix_selftest` kernel's output (12 words per lane: `x4`, `x4.trans`,
/// `x2`, `x2.trans`) for the input of [`ldmatrix_selftest_rows`] against the PTX ISA's
/// layout: without `.trans` lane `(g, t) = (lane / 4, lane % 4)` holds elements `2t`,
/// `2t + 1` of row `g` in register `i` (matrix `i`); with it, element `g` of rows `2t`
/// and `2t + 1`.
pub fn ldmatrix_selftest_check(out: &[u32]) -> Result<()> {
    const WORDS: usize = rotkv_kernels::selftest::LDMATRIX_WORDS;
    if out.len() != 32 * WORDS {
        return Err(Error::Shape(format!("{} ldmatrix self-test outputs for 32 lanes of {WORDS}", out.len())));
    }
    let el = |m: usize, r: usize, c: usize| ldmatrix_selftest_element(m, r, c) as u32;
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        let plain = |i: usize| el(i, g, 2 * t) | el(i, g, 2 * t + 1) << 16;
        let trans = |i: usize| el(i, 2 * t, g) | el(i, 2 * t + 1, g) << 16;
        let want: [(&str, usize, u32); WORDS] = core::array::from_fn(|k| match k {
            0..4 => ("x4", k, plain(k)),
            4..8 => ("x4.trans", k - 4, trans(k - 4)),
            8..10 => ("x2", k - 8, plain(k - 8)),
            _ => ("x2.trans", k - 10, trans(k - 10)),
        });
        for (k, &(what, i, w)) in want.iter().enumerate() {
            let got = out[lane * WORDS + k];
            if got != w {
                return Err(Error::Backend(format!(
                    "ldmatrix self-test: lane {lane}, {what} register {i} is {got:#010x}, the PTX ISA layout gives {w:#010x} (elements (matrix, row, column) are 0xMRC)"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CacheConfig;

    fn params(start: u32, count: u32) -> AppendParams {
        AppendParams {
            format: CacheConfig::k2v2(64).format().unwrap(),
            num_kv_heads: 1,
            start,
            count,
            new_len: start + count,
            num_blocks: u32::MAX,
            flags: 0,
            token_stride: 64,
            v_token_stride: 64,
            head_stride: 64,
            input_dtype: rotkv_kernels::params::DTYPE_F32,
        }
    }

    #[test]
    fn wave_splits_avoid_partial_waves_and_tiny_splits() {
        // H200 (132 SMs), decode_mma at 2 resident blocks: batch 8 x 8 KV heads x 1 row
        // tile is 64 blocks per split. 4 splits: 256 blocks in one wave of 264 (97%);
        // 5 would be 320 blocks, a second round for 56 of them (61%).
        assert_eq!(wave_splits(32_768, 64, 264), 4);
        // Batch 1 x 3 KV heads (SmolLM2): 3 blocks per split, 88 splits would fill the
        // wave; the cap is 64.
        assert_eq!(wave_splits(32_768, 3, 264), 64);
        // 100 blocks per split: 5 splits, 500 blocks in 1.9 waves (95%); 2 would fill 76%
        // of one wave, 3 would be 57% of two.
        assert_eq!(wave_splits(32_768, 100, 264), 5);
        // Batch 8 x 3 KV heads (24 blocks per split): 11 splits, exactly one wave.
        assert_eq!(wave_splits(32_768, 24, 264), 11);
        // A wave (80% of it) already full: one split.
        assert_eq!(wave_splits(32_768, 1024, 264), 1);
        assert_eq!(wave_splits(32_768, 212, 264), 1);
        // Short contexts are not cut below 256 tokens; never more than 64 splits.
        assert_eq!(wave_splits(1000, 1, 264), 4);
        assert_eq!(wave_splits(1 << 24, 1, 100_000), 64);
        assert_eq!(wave_splits(0, 0, 0), 1);
        // Never a partial wave below 85% of the best efficiency within the cap.
        for per in 1..300 {
            let s = wave_splits(1 << 20, per, 264) as usize;
            let eff = |s: usize| {
                let w = (s * per) as f64 / 264.0;
                w / w.ceil()
            };
            let best = (1..=64).map(eff).fold(0.0, f64::max);
            assert!((1..=64).contains(&s) && (per >= 212 || eff(s) >= 0.85 * best), "per {per}: {s}");
            // Within one wave whenever that fills 85% of it.
            if per < 212 && (264 / per).min(64) * per * 100 >= 85 * 264 {
                assert_eq!(s, (264 / per).min(64), "per {per}");
            }
        }
    }

    #[test]
    fn token_chunks_cover_any_count_within_the_grid_limit() {
        let chunks = |n| token_chunks(&params(7, n)).collect::<Vec<_>>();
        assert_eq!(chunks(0).len(), 0);
        assert_eq!(chunks(1).iter().map(|c| (c.0, c.1.start, c.1.count)).collect::<Vec<_>>(), [(0, 7, 1)]);
        assert_eq!(chunks(MAX_GRID_YZ).len(), 1);
        let two = chunks(MAX_GRID_YZ + 1);
        assert_eq!(
            two.iter().map(|c| (c.0, c.1.start, c.1.count)).collect::<Vec<_>>(),
            [(0, 7, MAX_GRID_YZ), (MAX_GRID_YZ, 7 + MAX_GRID_YZ, 1)]
        );
        let n = 3 * MAX_GRID_YZ + 17;
        let c = chunks(n);
        assert_eq!(c.len(), 4);
        assert!(c.iter().all(|(_, p)| (1..=MAX_GRID_YZ).contains(&p.count) && p.new_len == 7 + n));
        assert!(c.windows(2).all(|w| w[0].1.start + w[0].1.count == w[1].1.start && w[1].0 - w[0].0 == w[0].1.count));
        assert_eq!(c.iter().map(|c| c.1.count).sum::<u32>(), n);
    }

    /// A chunk's K and V inputs start `first` tokens in, each at its own token stride,
    /// in bytes of the input type; the other addresses are kept.
    #[test]
    fn chunk_inputs_advance_k_and_v_by_their_own_strides() {
        let ptrs = AppendPtrs { k: 1 << 20, v: 1 << 30, pool: 77, seq_len: 5, ..AppendPtrs::default() };
        let p = AppendParams { token_stride: 3 * 64, v_token_stride: 64, ..params(0, 3 * MAX_GRID_YZ) };
        let c = chunk_ptrs(&p, MAX_GRID_YZ, &ptrs);
        let n = MAX_GRID_YZ as u64;
        assert_eq!((c.k, c.v), ((1 << 20) + n * 3 * 64 * 4, (1 << 30) + n * 64 * 4));
        assert_eq!(AppendPtrs { k: ptrs.k, v: ptrs.v, ..c }, ptrs);
        let h = AppendParams { input_dtype: rotkv_kernels::params::DTYPE_BF16, v_token_stride: 5 * 64, ..p };
        let c = chunk_ptrs(&h, 2, &ptrs);
        assert_eq!((c.k, c.v), ((1 << 20) + 2 * 3 * 64 * 2, (1 << 30) + 2 * 5 * 64 * 2));
        assert_eq!(chunk_ptrs(&p, 0, &ptrs), ptrs);
    }

    /// The device-side destination of every token (`append::destination`) against the
    /// reference's placement (`Format::place`, `reference::protected_index`), with
    /// shuffled tables, protected positions, and table entries past the pool skipped.
    #[test]
    fn device_destinations_match_the_reference_placement() {
        use rotkv_kernels::append::{NONE, destination};
        let mut fmt = CacheConfig::k2v2(64).format().unwrap();
        fmt.protected = 3;
        for (start, count) in [(0, 1), (0, 300), (3, 1), (200, 65), (150, 1000), (4, 127)] {
            let mut p = params(start, count);
            p.format = fmt;
            let pages = fmt.pages_for(p.new_len) as usize;
            let table: Vec<u32> = (0..pages as u32).map(|i| (i * 7919 + 13) % 4099).collect();
            p.num_blocks = 4000; // entries 4000..4099 are past the pool
            let protected = [5, 140, 700];
            let row = protected_row(&fmt, &protected);
            for pos in start..start + count {
                // SAFETY: the table covers pages_for(new_len); the list has fmt.protected entries.
                let d = unsafe { destination(&p, pos, table.as_ptr(), row.as_ptr()) };
                let copy = reference::protected_index(&protected, pos).map_or(NONE, |i| fmt.protected_row(i));
                assert_eq!(d.copy_row, copy, "pos {pos}");
                match fmt.place(pos, p.new_len) {
                    Place::Sink { index: r } | Place::Window { slot: r } => {
                        assert_eq!((d.side_row, d.block), (r, NONE), "pos {pos}")
                    }
                    Place::Page { page, slot } => {
                        let b = table[page as usize];
                        assert_eq!(d.side_row, NONE);
                        assert_eq!(d.block, if b < p.num_blocks { b } else { NONE }, "pos {pos}");
                        assert_eq!(d.slot, slot);
                    }
                }
            }
        }
        // Offsets are 64-bit: the last block of the largest pool lands past 2^32 bytes,
        // not wrapped.
        let last = max_pool_blocks(&fmt) as u32 - 1;
        assert!(fmt.page_offset(last, 7, 8) > u32::MAX as usize);
        assert!(check_pool_blocks(&fmt, max_pool_blocks(&fmt)).is_ok());
        assert!(matches!(check_pool_blocks(&fmt, max_pool_blocks(&fmt) + 1), Err(Error::Capacity(_))));
    }
}
