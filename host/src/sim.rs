//! Device kernels run by the SIMT emulator (feature `sim`), through the launch geometry
//! the CUDA backend uses: `append_flush` and `append_tokens` for append,
//! `decode_split` and `decode_merge` for decode. [`crate::Backend::Sim`] runs them.

use crate::config::LayerCalibration;
use crate::error::{Error, Result};
use crate::launch::{self, BLOCK, DecodeInputs, DecodeKernel};
use crate::reference::SeqRef;
use half::f16;
use rotkv_kernels::append::{append_flush, append_tokens};
use rotkv_kernels::decode::decode_split;
use rotkv_kernels::decode_mma::decode_mma;
use rotkv_kernels::merge::decode_merge;
use rotkv_kernels::params::{AppendParams, DecodeParams, FLAG_DENSE_VALUES, FLAG_OUTPUT_F16, MergeParams};
use rotkv_kernels::sim::{self, SimCtx};

/// Multiprocessors of the emulated device (drives the split count only).
pub const SIM_SMS: usize = 4;

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

/// Element types `decode_merge` can write: f32 and f16.
pub trait MergeOutput: bytemuck::Pod {
    /// Whether this is f16 (sets `FLAG_OUTPUT_F16`).
    const F16: bool;
}
impl MergeOutput for f32 {
    const F16: bool = false;
}
impl MergeOutput for f16 {
    const F16: bool = true;
}

/// A raw pointer the emulator's threads may share (each kernel thread writes its own
/// elements, as on the GPU).
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: the kernels only dereference these pointers inside the sizes validated by the
// launcher below, and write disjoint elements per thread.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    fn ptr(self) -> *mut T {
        self.0
    }
}

/// Runs the `decode_merge` kernel: partials `m`, `l` (`[seq][q_head][split]`), `o`
/// (`[seq][q_head][split][head_dim]`, stored value order), the inverse value
/// permutations `vperm_inv` (`[kv_head][head_dim]`) and, when `p.flags` has
/// `FLAG_DENSE_VALUES`, the learned value rotations `value_rot`
/// (`[kv_head][head_dim][head_dim]`) into `out` (`[seq][q_head][head_dim]`).
pub fn decode_merge_sim<O: MergeOutput>(
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
        ("out", out.len(), s * h * d),
    ];
    for (what, got, expect) in want {
        if got != expect {
            return Err(Error::Shape(format!("{what} has {got} elements, expected {expect}")));
        }
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
    let (mp, lp, op, vp, rp, outp) = (
        Shared(m.as_ptr().cast_mut()),
        Shared(l.as_ptr().cast_mut()),
        Shared(o.as_ptr().cast_mut()),
        Shared(vperm_inv.as_ptr().cast_mut()),
        Shared(rot.cast_mut()),
        Shared(out.as_mut_ptr().cast::<u8>()),
    );
    let p = MergeParams { flags: (p.flags & !FLAG_OUTPUT_F16) | if O::F16 { FLAG_OUTPUT_F16 } else { 0 }, ..*p };
    macro_rules! launch {
        ($d:literal, $v:literal) => {
            sim::launch([h as u32, s as u32, 1], 32, 0, |c: &SimCtx<'_>| {
                // SAFETY: sizes checked above; grid (H, S, 1) of 32-thread blocks, as
                // `decode_merge` requires; each block writes its own output row.
                unsafe {
                    decode_merge::<_, $d, $v>(c, &p, mp.ptr(), lp.ptr(), op.ptr(), vp.ptr(), rp.ptr(), outp.ptr())
                }
            })
            .map_err(|e| Error::Backend(format!("sim decode_merge: {e}")))
        };
    }
    match d {
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
    let fmt = p.format;
    let (nm, no) = inputs.partial_lens();
    let (mut m, mut l, mut o) = (vec![0f32; nm], vec![0f32; nm], vec![0f32; no]);
    let (qp, pp, tp, lp, sp, prp, kp, kr) = (
        Shared(q.as_ptr().cast_mut()),
        Shared(pool.as_ptr().cast_mut()),
        Shared(inputs.tables.as_ptr().cast_mut()),
        Shared(inputs.lens.as_ptr().cast_mut()),
        Shared(inputs.sides().as_ptr().cast_mut()),
        Shared(inputs.protected.as_ptr().cast_mut()),
        Shared(calib.key_perm.as_ptr().cast_mut()),
        Shared(rotation_ptr(&calib.key_rotation)),
    );
    let (mp, lsp, op) = (Shared(m.as_mut_ptr()), Shared(l.as_mut_ptr()), Shared(o.as_mut_ptr()));
    let (grid, block, shared) = (inputs.split_grid(), inputs.split_block(), inputs.split_shared_bytes() as usize);
    macro_rules! launch {
        ($kernel:ident :: <$($g:literal),*>) => {
            sim::launch(grid, block, shared, |c: &SimCtx<'_>| {
                // SAFETY: the paged layer and `DecodeInputs::new` validated pool, tables,
                // lengths, side stores and queries; the outputs have the partials' sizes;
                // grid, block and shared memory are the kernel's (DecodeInputs).
                unsafe {
                    $kernel::<_, $($g),*>(
                        c,
                        &p,
                        qp.ptr(),
                        pp.ptr(),
                        tp.ptr(),
                        lp.ptr(),
                        sp.ptr(),
                        prp.ptr(),
                        kp.ptr(),
                        kr.ptr(),
                        mp.ptr(),
                        lsp.ptr(),
                        op.ptr(),
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
    match inputs.kernel {
        DecodeKernel::Split => rotkv_kernels::for_each_decode!(dispatch_split)?,
        DecodeKernel::Mma { .. } => rotkv_kernels::for_each_decode_mma!(dispatch_mma)?,
    }
    Ok((m, l, o))
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
    let fmt = p.format;
    launch::check_format(&fmt)?;
    let d = fmt.head_dim as usize;
    let err = |what: &str, e: sim::SimError| Error::Backend(format!("sim {what}: {e}"));
    let mut jobs = launch::flush_jobs(p, block_table);
    let mut slots = launch::slot_mapping(p, block_table, protected)?;
    let side: &mut [u16] = bytemuck::cast_slice_mut(side);
    let (pp, sp, jp, tp) =
        (Shared(pool.as_mut_ptr()), Shared(side.as_mut_ptr()), Shared(jobs.as_mut_ptr()), Shared(slots.as_mut_ptr()));
    let (kp, vp, mp, kq, vq, kr, vr) = (
        Shared(k.as_ptr().cast_mut()),
        Shared(v.as_ptr().cast_mut()),
        Shared(calib.key_mean.as_ptr().cast_mut()),
        Shared(calib.key_perm.as_ptr().cast_mut()),
        Shared(calib.value_perm.as_ptr().cast_mut()),
        Shared(rotation_ptr(&calib.key_rotation)),
        Shared(rotation_ptr(&calib.value_rotation)),
    );
    let njobs = (jobs.len() / 4) as u32;
    macro_rules! run {
        ($(($tok:ident, $flush:ident, $d:literal, $v:literal)),* $(,)?) => {
            match d {
                $($d => {
                    // 1. Window rows whose page fills (they may be overwritten in 2).
                    if njobs > 0 {
                        sim::launch([njobs, 2, 1], BLOCK, 0, |c: &SimCtx<'_>| {
                            // SAFETY: `jobs` holds njobs quadruples whose blocks the paged
                            // layer checked against the pool; `side` is the sequence's store.
                            unsafe { append_flush::<_, $d, $v>(c, &fmt, p.num_kv_heads, sp.ptr(), jp.ptr(), pp.ptr()) }
                        })
                        .map_err(|e| err("append_flush", e))?;
                    }
                    // 2. The new tokens, at most MAX_GRID_YZ per launch.
                    for (first, n) in launch::token_chunks(p.count) {
                        let cp = AppendParams { count: n, ..*p };
                        let skip = first as usize * p.token_stride as usize * launch::dtype_bytes(p.input_dtype);
                        sim::launch(launch::tokens_grid(&cp), BLOCK, 0, |c: &SimCtx<'_>| {
                            // SAFETY: the paged layer validated the inputs' sizes and the
                            // block table; `slots` has two entries per new token, and the
                            // chunk's inputs and entries start `first` tokens in.
                            unsafe {
                                append_tokens::<_, $d, $v>(
                                    c,
                                    &cp,
                                    kp.ptr().add(skip),
                                    vp.ptr().add(skip),
                                    mp.ptr(),
                                    kq.ptr(),
                                    vq.ptr(),
                                    kr.ptr(),
                                    vr.ptr(),
                                    tp.ptr().add(2 * first as usize),
                                    pp.ptr(),
                                    sp.ptr(),
                                )
                            }
                        })
                        .map_err(|e| err("append_tokens", e))?;
                    }
                    Ok(())
                })*
                other => Err(Error::Unsupported(format!("head_dim {other}"))),
            }
        };
    }
    rotkv_kernels::for_each_append!(run)
}
