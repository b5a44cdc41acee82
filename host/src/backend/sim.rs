//! Device kernels run by the SIMT emulator (feature `sim`), through the launch geometry
//! the CUDA backend uses: `append_flush` and `append_tokens` for append,
//! `decode_split` and `decode_merge` for decode. [`crate::Backend::Sim`] runs them.

use crate::config::LayerCalibration;
use crate::error::{Error, Result};
use crate::launch::{self, AppendPtrs, BLOCK, BatchPtrs, DecodeInputs, DecodeKernel, DecodePtrs, FlushPtrs, MergePtrs};
use crate::reference::SeqRef;
use half::f16;
use rotkv_kernels::append::{
    append_batch_flush, append_batch_tokens, append_flush, append_tokens, batch_flush_grid, batch_tokens_grid,
};
use rotkv_kernels::decode::decode_split;
use rotkv_kernels::decode_mma::decode_mma;
use rotkv_kernels::merge::decode_merge;
use rotkv_kernels::params::{AppendBatchParams, AppendParams, DecodeParams, FLAG_DENSE_VALUES, MergeParams};
use rotkv_kernels::sim::{self, SimCtx};

/// Multiprocessors of the emulated device (drives the split count only).
pub const SIM_SMS: usize = 4;

/// Decode blocks an emulated multiprocessor holds at once (the occupancy a plan
/// assumes on the emulator; a GPU asks its driver).
pub const SIM_RESIDENT_BLOCKS: usize = 2;

/// Decode attention through the emulated `decode_split` and `decode_merge` kernels.
pub fn decode_sim(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let inputs = DecodeInputs::new(p, calib, pool, seqs, q)?;
    let (m, l, o) = decode_split_launch(&inputs, calib, pool, q)?;
    let (mp, _) = inputs.merge();
    decode_merge_sim(&mp, &m, &l, &o, &inputs.vperm_inv, calib.value_rotation.as_deref(), out)
}

/// Runs the `decode_merge` kernel: partials `m`, `l` (`[seq][q_head][split]`), `o`
/// (`[seq][q_head][split][head_dim]`, stored value order), the inverse value
/// permutations `vperm_inv` (`[kv_head][head_dim]`) and, when `p.flags` has
/// `FLAG_DENSE_VALUES`, the learned value rotations `value_rot`
/// (`[kv_head][head_dim][head_dim]`) into `out` (`[seq][q_head][head_dim]`).
pub fn decode_merge_sim<O: crate::OutputElement>(
    p: &MergeParams,
    m: &[f32],
    l: &[f32],
    o: &[f32],
    vperm_inv: &[u16],
    value_rot: Option<&[f32]>,
    out: &mut [O],
) -> Result<()> {
    let (s, h, n, d) = (p.num_seqs as usize, p.num_q_heads as usize, p.num_splits as usize, p.head_dim as usize);
    if p.num_kv_heads == 0 || h % p.num_kv_heads as usize != 0 {
        return Err(Error::Shape(format!("{h} query heads for {} KV heads", p.num_kv_heads)));
    }
    let want = [
        ("m", m.len(), s * h * n),
        ("l", l.len(), s * h * n),
        ("o", o.len(), s * h * n * d),
        ("out", out.len(), s.saturating_sub(1) * p.out_row_stride as usize + h * d),
    ];
    for (what, got, expect) in want {
        if got != expect {
            return Err(Error::Shape(format!("{what} has {got} elements, expected {expect}")));
        }
    }
    if (p.out_row_stride as usize) < h * d {
        return Err(Error::Shape(format!("output row stride {} below {h} heads x {d}", p.out_row_stride)));
    }
    if vperm_inv.len() != p.num_kv_heads as usize * d || vperm_inv.iter().any(|&c| c as usize >= d) {
        return Err(Error::Calibration(format!(
            "vperm_inv must hold {} entries below {d}",
            p.num_kv_heads as usize * d
        )));
    }
    let dense = p.flags & FLAG_DENSE_VALUES != 0;
    let rot = match value_rot {
        Some(r) if dense && r.len() == p.num_kv_heads as usize * d * d => r.as_ptr(),
        None if !dense => std::ptr::null(),
        _ => {
            return Err(Error::Calibration(format!(
                "value_rot must hold {} entries exactly when FLAG_DENSE_VALUES is set",
                p.num_kv_heads as usize * d * d
            )));
        }
    };
    let p = MergeParams { flags: (p.flags & !crate::OUTPUT_FLAGS) | O::FLAG, ..*p };
    let ptrs = MergePtrs {
        m: addr(m.as_ptr()),
        l: addr(l.as_ptr()),
        o: addr(o.as_ptr()),
        vperm_inv: addr(vperm_inv.as_ptr()),
        value_rot: addr(rot),
        out: addr(out.as_mut_ptr()),
        meta: 0,
    };
    // SAFETY: sizes checked above; `out` is borrowed mutably for the launch.
    unsafe { merge_raw(&p, &ptrs) }
}

/// The address of a host buffer as the emulated kernels take it (provenance exposed, so
/// [`ptr`] can turn it back into a pointer).
pub(crate) fn addr<T>(p: *const T) -> u64 {
    p.expose_provenance() as u64
}

/// The pointer at an address made by [`addr`].
fn ptr<T>(a: u64) -> *mut T {
    std::ptr::with_exposed_provenance_mut(a as usize)
}

/// Runs `decode_merge` on the emulator over raw addresses: grid (query heads, sequences
/// x query tokens), one warp per block.
///
/// # Safety
/// The buffers at `ptrs` are live host buffers of the sizes `decode_merge`'s `# Safety`
/// section asks for `p`, and nothing else accesses them during the call.
pub unsafe fn merge_raw(p: &MergeParams, ptrs: &MergePtrs) -> Result<()> {
    let (h, s) = (p.num_q_heads, p.num_seqs);
    let ptrs = *ptrs;
    macro_rules! launch {
        ($d:literal, $v:literal) => {
            sim::launch([h, s, 1], 32, 0, |c: &SimCtx<'_>| {
                // SAFETY: forwarded contract; grid (H, S, 1) of 32-thread blocks, as
                // `decode_merge` requires; each block writes its own output row.
                unsafe {
                    decode_merge::<_, $d, $v>(
                        c,
                        p,
                        ptr(ptrs.m),
                        ptr(ptrs.l),
                        ptr(ptrs.o),
                        ptr(ptrs.vperm_inv),
                        ptr(ptrs.value_rot),
                        ptr(ptrs.out),
                        ptr(ptrs.meta),
                    )
                }
            })
            .map_err(|e| Error::Backend(format!("sim decode_merge: {e}")))
        };
    }
    match p.head_dim {
        64 => launch!(64, 2),
        128 => launch!(128, 4),
        256 => launch!(256, 8),
        other => Err(Error::Unsupported(format!("head_dim {other}"))),
    }
}

/// The kernels' pointer to a layer's learned rotations (null without them; the paged
/// layer set the matching `FLAG_DENSE_*` bits from the same calibration and checked its
/// size).
fn rotation_ptr(r: &Option<Vec<f32>>) -> *mut f32 {
    r.as_ref().map_or(std::ptr::null_mut(), |r| r.as_ptr().cast_mut())
}

/// Split-K partials from the emulated `decode_split` kernel: `(m, l, o)` with `m`, `l`
/// per `[seq][q_head][split]` and `o` per `[seq][q_head][split][head_dim]` (stored value
/// order), for the batch `seqs` whose queries `q` are `[seq][q_head][head_dim]`.
pub fn decode_split_sim(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    decode_split_launch(&DecodeInputs::new(p, calib, pool, seqs, q)?, calib, pool, q)
}

fn decode_split_launch(
    inputs: &DecodeInputs,
    calib: &LayerCalibration,
    pool: &[u8],
    q: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let p = inputs.params;
    let (nm, no) = inputs.partial_lens();
    let (mut m, mut l, mut o) = (vec![0f32; nm], vec![0f32; nm], vec![0f32; no]);
    let ptrs = DecodePtrs {
        q: addr(q.as_ptr()),
        pool: addr(pool.as_ptr()),
        tables: addr(inputs.tables.as_ptr()),
        lens: addr(inputs.lens.as_ptr()),
        sides: addr(inputs.sides().as_ptr()),
        protected: addr(inputs.protected.as_ptr()),
        key_scale: addr(calib.key_scale.as_ptr()),
        key_perm: addr(calib.key_perm.as_ptr()),
        key_rot: addr(rotation_ptr(&calib.key_rotation)),
        m: addr(m.as_mut_ptr()),
        l: addr(l.as_mut_ptr()),
        o: addr(o.as_mut_ptr()),
        meta: 0,
    };
    // SAFETY: the paged layer and `DecodeInputs::new` validated pool, tables, lengths,
    // side stores and queries; the outputs have the partials' sizes.
    unsafe { decode_raw(&p, &ptrs)? };
    Ok((m, l, o))
}

/// Runs the decode kernel the launch-planning rule picks for `p` ([`launch::decode_launch`]:
/// `decode_split` or `decode_mma`, its grid, block and shared memory) on the emulator
/// over raw addresses.
///
/// # Safety
/// The buffers at `ptrs` are live host buffers of the sizes the kernel's `# Safety`
/// section asks for `p`, and nothing else accesses them during the call.
pub unsafe fn decode_raw(p: &DecodeParams, ptrs: &DecodePtrs) -> Result<()> {
    let fmt = p.format;
    let shape = launch::decode_launch(p);
    let (grid, block, shared) = (shape.grid, shape.block, shape.shared as usize);
    let ptrs = *ptrs;
    macro_rules! launch {
        ($kernel:ident :: <$($g:literal),*>) => {
            sim::launch(grid, block, shared, |c: &SimCtx<'_>| {
                // SAFETY: forwarded contract; grid, block and shared memory are the
                // kernel's (decode_launch).
                unsafe {
                    $kernel::<_, $($g),*>(
                        c,
                        p,
                        ptr(ptrs.q),
                        ptr(ptrs.pool),
                        ptr(ptrs.tables),
                        ptr(ptrs.lens),
                        ptr(ptrs.sides),
                        ptr(ptrs.protected),
                        ptr(ptrs.key_scale),
                        ptr(ptrs.key_perm),
                        ptr(ptrs.key_rot),
                        ptr(ptrs.m),
                        ptr(ptrs.l),
                        ptr(ptrs.o),
                        ptr(ptrs.meta),
                    )
                }
            })
            .map_err(|e| Error::Backend(format!("sim {}: {e}", stringify!($kernel))))
        };
    }
    macro_rules! dispatch_split {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal)),* $(,)?) => {
            match (fmt.head_dim, fmt.key_bits, fmt.value_bits) {
                $(($d, $kb, $vb) => launch!(decode_split::<$d, $v, $kb, $vb>),)*
                other => Err(Error::Unsupported(format!("(head_dim, key bits, value bits) {other:?}"))),
            }
        };
    }
    macro_rules! dispatch_mma {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal, $ng:literal, $nks:literal, $nvt:literal)),* $(,)?) => {
            match (fmt.head_dim, fmt.key_bits, fmt.value_bits, fmt.groups()) {
                $(($d, $kb, $vb, $ng) => launch!(decode_mma::<$d, $v, $kb, $vb, $ng, $nks, $nvt>),)*
                other => Err(Error::Unsupported(format!("decode_mma for (head_dim, key bits, value bits, groups) {other:?}"))),
            }
        };
    }
    match shape.kernel {
        DecodeKernel::Split => rotkv_kernels::for_each_decode!(dispatch_split),
        DecodeKernel::Mma { .. } => rotkv_kernels::for_each_decode_mma!(dispatch_mma),
    }
}

/// Appends `p.count` tokens with the emulated `append_flush` (window rows whose page
/// fills) and `append_tokens` (the new tokens, fused) kernels: the same bytes as
/// [`crate::reference::append`] (up to f16 rounding ties of the f32 rotation).
/// `k` and `v` are the raw inputs, of the element type `p.input_dtype` names.
#[allow(clippy::too_many_arguments)]
pub fn append_sim(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    protected: &[u32],
    k: &[u8],
    v: &[u8],
) -> Result<()> {
    crate::paged::check_append_buffers(p, calib, pool.len(), block_table, side.len(), protected, k.len(), v.len())?;
    let protected = launch::protected_row(&p.format, protected);
    let table = if block_table.is_empty() { &[u32::MAX][..] } else { block_table };
    let side: &mut [u16] = bytemuck::cast_slice_mut(side);
    let (pool, side) = (addr(pool.as_mut_ptr()), addr(side.as_mut_ptr()));
    let block_table = addr(table.as_ptr());
    // SAFETY: `check_append_buffers` validated the inputs' sizes at their strides, the
    // pool, the block table (every entry of the pages written is a block of the pool) and
    // the side store; the padded protected list lives through the calls.
    unsafe {
        flush_raw(p, &FlushPtrs { block_table, side, pool })?;
        append_tokens_raw(
            p,
            &AppendPtrs {
                k: addr(k.as_ptr()),
                v: addr(v.as_ptr()),
                key_mean: addr(calib.key_mean.as_ptr()),
                key_scale: addr(calib.key_scale.as_ptr()),
                key_perm: addr(calib.key_perm.as_ptr()),
                value_perm: addr(calib.value_perm.as_ptr()),
                key_rot: addr(rotation_ptr(&calib.key_rotation)),
                value_rot: addr(rotation_ptr(&calib.value_rotation)),
                block_table,
                protected: addr(protected.as_ptr()),
                pool,
                side,
                seq_len: 0,
            },
        )
    }
}

/// Runs `append_flush` on the emulator over raw addresses for the append `p` (`p.start`
/// the length before it): grid [`launch::flush_grid`], one warp per block; nothing when
/// no page fills.
///
/// # Safety
/// The buffers at `ptrs` are live host buffers as `append_flush`'s `# Safety` section
/// asks for `p`, and nothing else accesses them during the call.
pub unsafe fn flush_raw(p: &AppendParams, ptrs: &FlushPtrs) -> Result<()> {
    let Some(grid) = launch::flush_grid(p) else { return Ok(()) };
    let ptrs = *ptrs;
    macro_rules! run {
        ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {
            match p.format.head_dim {
                $($d => sim::launch(grid, BLOCK, 0, |c: &SimCtx<'_>| {
                    // SAFETY: forwarded contract.
                    unsafe { append_flush::<_, $d, $v>(c, p, ptr(ptrs.block_table), ptr(ptrs.side), ptr(ptrs.pool)) }
                })
                .map_err(|e| Error::Backend(format!("sim append_flush: {e}"))),)*
                other => Err(Error::Unsupported(format!("head_dim {other}"))),
            }
        };
    }
    rotkv_kernels::for_each_append!(run)
}

/// Runs `append_tokens` on the emulator over raw addresses, in launches of at most
/// [`launch::MAX_GRID_YZ`] tokens ([`launch::token_chunks`]).
///
/// # Safety
/// The buffers at `ptrs` are live host buffers as `append_tokens`'s `# Safety` section
/// asks for `p`, and nothing else accesses them during the call.
pub unsafe fn append_tokens_raw(p: &AppendParams, ptrs: &AppendPtrs) -> Result<()> {
    for (first, cp) in launch::token_chunks(p) {
        let ptrs = launch::chunk_ptrs(p, first, ptrs);
        macro_rules! run {
            ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {
                match p.format.head_dim {
                    $($d => sim::launch(launch::tokens_grid(&cp), BLOCK, 0, |c: &SimCtx<'_>| {
                        // SAFETY: forwarded contract; the chunk's inputs start `first`
                        // tokens in.
                        unsafe {
                            append_tokens::<_, $d, $v>(
                                c,
                                &cp,
                                ptr(ptrs.k),
                                ptr(ptrs.v),
                                ptr(ptrs.key_mean),
                                ptr(ptrs.key_scale),
                                ptr(ptrs.key_perm),
                                ptr(ptrs.value_perm),
                                ptr(ptrs.key_rot),
                                ptr(ptrs.value_rot),
                                ptr(ptrs.block_table),
                                ptr(ptrs.protected),
                                ptr(ptrs.pool),
                                ptr(ptrs.side),
                                ptr(ptrs.seq_len),
                            )
                        }
                    })
                    .map_err(|e| Error::Backend(format!("sim append_tokens: {e}"))),)*
                    other => Err(Error::Unsupported(format!("head_dim {other}"))),
                }
            };
        }
        rotkv_kernels::for_each_append!(run)?;
    }
    Ok(())
}

/// Runs the batched append on the emulator over raw addresses: `append_batch_flush`
/// (grid [`batch_flush_grid`]) then `append_batch_tokens` (grid [`batch_tokens_grid`]),
/// one warp per block.
///
/// # Safety
/// The buffers at `ptrs` are live host buffers as the two kernels' `# Safety` sections
/// ask for `bp`, and nothing else accesses them during the call.
pub unsafe fn append_batch_raw(bp: &AppendBatchParams, ptrs: &BatchPtrs) -> Result<()> {
    let x = *ptrs;
    macro_rules! run {
        ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {
            match bp.append.format.head_dim {
                $($d => {
                    sim::launch(batch_flush_grid(bp), BLOCK, 0, |c: &SimCtx<'_>| {
                        // SAFETY: forwarded contract.
                        unsafe {
                            append_batch_flush::<_, $d, $v>(
                                c, bp, ptr(x.meta), ptr(x.tables), ptr(x.sides), ptr(x.pool), ptr(x.errors),
                            )
                        }
                    })
                    .map_err(|e| Error::Backend(format!("sim append_batch_flush: {e}")))?;
                    sim::launch(batch_tokens_grid(bp), BLOCK, 0, |c: &SimCtx<'_>| {
                        // SAFETY: forwarded contract.
                        unsafe {
                            append_batch_tokens::<_, $d, $v>(
                                c,
                                bp,
                                ptr(x.meta),
                                ptr(x.k),
                                ptr(x.v),
                                ptr(x.key_mean),
                                ptr(x.key_scale),
                                ptr(x.key_perm),
                                ptr(x.value_perm),
                                ptr(x.key_rot),
                                ptr(x.value_rot),
                                ptr(x.tables),
                                ptr(x.protected),
                                ptr(x.pool),
                                ptr(x.sides),
                                ptr(x.lens),
                                ptr(x.errors),
                            )
                        }
                    })
                    .map_err(|e| Error::Backend(format!("sim append_batch_tokens: {e}")))
                })*
                other => Err(Error::Unsupported(format!("head_dim {other}"))),
            }
        };
    }
    rotkv_kernels::for_each_append_batch!(run)
}
