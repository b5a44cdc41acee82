//! Device kernels run by the SIMT emulator (feature `sim`), through the launch geometry
//! the CUDA backend uses: `append_rotate` and `append_quantize` for append,
//! `decode_split` and `decode_merge` for decode. [`crate::Backend::Sim`] runs them.

use crate::config::LayerCalibration;
use crate::error::{Error, Result};
use crate::reference::SeqRef;
use half::f16;
use rotkv_kernels::append::{append_quantize, append_rotate};
use rotkv_kernels::decode::{MAX_GROUP, decode_shared_bytes, decode_split};
use rotkv_kernels::layout::Place;
use rotkv_kernels::merge::decode_merge;
use rotkv_kernels::params::{AppendParams, DecodeParams, MergeParams};
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
    let d = p.format.head_dim as usize;
    let (m, l, o) = decode_split_sim(p, calib, pool, seqs, q)?;
    let inv = calib.value_perm_inverse(d);
    let mp = MergeParams {
        num_seqs: p.num_seqs,
        num_q_heads: p.num_q_heads,
        num_kv_heads: p.num_kv_heads,
        head_dim: p.format.head_dim,
        num_splits: p.num_splits,
        flags: p.flags,
    };
    decode_merge_sim(&mp, &m, &l, &o, &inv, out)
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
/// (`[seq][q_head][split][head_dim]`, stored value order) and the inverse value
/// permutations `vperm_inv` (`[kv_head][head_dim]`) into `out` (`[seq][q_head][head_dim]`).
pub fn decode_merge_sim(
    p: &MergeParams,
    m: &[f32],
    l: &[f32],
    o: &[f32],
    vperm_inv: &[u16],
    out: &mut [f32],
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
    let (mp, lp, op, vp, outp) = (
        Shared(m.as_ptr().cast_mut()),
        Shared(l.as_ptr().cast_mut()),
        Shared(o.as_ptr().cast_mut()),
        Shared(vperm_inv.as_ptr().cast_mut()),
        Shared(out.as_mut_ptr()),
    );
    let p = *p;
    macro_rules! launch {
        ($d:literal, $v:literal) => {
            sim::launch([h as u32, s as u32, 1], 32, 0, |c: &SimCtx<'_>| {
                // SAFETY: sizes checked above; grid (H, S, 1) of 32-thread blocks, as
                // `decode_merge` requires; each block writes its own output row.
                unsafe { decode_merge::<_, $d, $v>(c, &p, mp.ptr(), lp.ptr(), op.ptr(), vp.ptr(), outp.ptr()) }
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
    let fmt = p.format;
    let d = fmt.head_dim as usize;
    let (s, hq, hkv, n) = (seqs.len(), p.num_q_heads as usize, p.num_kv_heads as usize, p.num_splits as usize);
    if hq / hkv > MAX_GROUP {
        return Err(Error::Unsupported(format!(
            "{} query heads per KV head on the GPU kernels (at most {MAX_GROUP})",
            hq / hkv
        )));
    }
    if q.len() != s * p.q_seq_stride as usize || p.q_seq_stride as usize != hq * d {
        return Err(Error::Shape(format!("q has {} elements for {s} sequences of {hq} x {d}", q.len())));
    }
    if !(pool.as_ptr() as usize).is_multiple_of(16) {
        return Err(Error::Shape("the pool must start on a 16-byte boundary".into()));
    }
    let stride = seqs.iter().map(|x| x.block_table.len()).max().unwrap_or(0).max(1);
    let mut tables = vec![0u32; s * stride];
    for (i, x) in seqs.iter().enumerate() {
        tables[i * stride..i * stride + x.block_table.len()].copy_from_slice(x.block_table);
    }
    let lens: Vec<u32> = seqs.iter().map(|x| x.len as u32).collect();
    // Side stores back to back, 16-byte aligned (the kernel reads rows with 16-byte
    // loads; a GPU allocation is aligned the same way).
    let side_elems = p.format.side_elems(p.num_kv_heads);
    let mut sides_buf = vec![0u128; (s * side_elems).div_ceil(8)];
    let sides: &mut [u16] = &mut bytemuck::cast_slice_mut::<u128, u16>(&mut sides_buf)[..s * side_elems];
    for (i, x) in seqs.iter().enumerate() {
        if x.side.len() != side_elems {
            return Err(Error::Shape(format!("side store of sequence {i} has {} elements", x.side.len())));
        }
        sides[i * side_elems..(i + 1) * side_elems].iter_mut().zip(x.side).for_each(|(o, v)| *o = v.to_bits());
    }
    let p = DecodeParams { block_table_stride: stride as u32, ..*p };
    let (mut m, mut l, mut o) = (vec![0f32; s * hq * n], vec![0f32; s * hq * n], vec![0f32; s * hq * n * d]);
    let shared = decode_shared_bytes(&fmt, MAX_GROUP as u32) as usize;
    let (qp, pp, tp, lp, sp, kp) = (
        Shared(q.as_ptr().cast_mut()),
        Shared(pool.as_ptr().cast_mut()),
        Shared(tables.as_mut_ptr()),
        Shared(lens.as_ptr().cast_mut()),
        Shared(sides.as_ptr().cast_mut()),
        Shared(calib.key_perm.as_ptr().cast_mut()),
    );
    let (mp, lsp, op) = (Shared(m.as_mut_ptr()), Shared(l.as_mut_ptr()), Shared(o.as_mut_ptr()));
    macro_rules! launch {
        ($d:literal, $v:literal, $kb:literal, $vb:literal) => {
            sim::launch([hkv as u32, s as u32, n as u32], 32, shared, |c: &SimCtx<'_>| {
                // SAFETY: the paged layer validated pool, tables, lengths and side stores;
                // the buffers above have the kernel's sizes; grid (Hkv, S, N) x 32.
                unsafe {
                    decode_split::<_, $d, $v, $kb, $vb>(
                        c,
                        &p,
                        qp.ptr(),
                        pp.ptr(),
                        tp.ptr(),
                        lp.ptr(),
                        sp.ptr(),
                        kp.ptr(),
                        mp.ptr(),
                        lsp.ptr(),
                        op.ptr(),
                    )
                }
            })
            .map_err(|e| Error::Backend(format!("sim decode_split: {e}")))
        };
    }
    macro_rules! dispatch {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal)),* $(,)?) => {
            match (d, fmt.key_bits, fmt.value_bits) {
                $(($d, $kb, $vb) => launch!($d, $v, $kb, $vb),)*
                other => Err(Error::Unsupported(format!("(head_dim, key bits, value bits) {other:?}"))),
            }
        };
    }
    rotkv_kernels::for_each_decode!(dispatch)?;
    Ok((m, l, o))
}

/// Appends `p.count` tokens with the emulated `append_rotate` and `append_quantize`
/// kernels: the same bytes as [`crate::reference::append`] (up to f16 rounding ties of
/// the f32 rotation).
pub fn append_sim(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    k: &[f32],
    v: &[f32],
) -> Result<()> {
    let fmt = p.format;
    let d = fmt.head_dim as usize;
    let hkv = p.num_kv_heads as usize;
    let (n, len) = (p.count as usize, p.start as usize);
    let new_len = p.start + p.count;
    let mut staged = vec![0u16; n * hkv * 2 * d];
    let err = |what: &str, e: sim::SimError| Error::Backend(format!("sim {what}: {e}"));
    // 1. Stored rows of the new tokens.
    if n > 0 {
        let (kp, vp, mp, kq, vq, sp) = (
            Shared(k.as_ptr().cast_mut()),
            Shared(v.as_ptr().cast_mut()),
            Shared(calib.key_mean.as_ptr().cast_mut()),
            Shared(calib.key_perm.as_ptr().cast_mut()),
            Shared(calib.value_perm.as_ptr().cast_mut()),
            Shared(staged.as_mut_ptr()),
        );
        macro_rules! rotate {
            ($(($rot:ident, $q2:ident, $q4:ident, $d:literal, $v:literal)),* $(,)?) => {
                match d {
                    $($d => sim::launch([hkv as u32, n as u32, 1], 32, 0, |c: &SimCtx<'_>| {
                        // SAFETY: the paged layer validated the inputs' sizes; `staged`
                        // has count x Hkv x 2 x D entries; grid (Hkv, count) x 32.
                        unsafe { append_rotate::<_, $d, $v>(c, p, kp.ptr(), vp.ptr(), mp.ptr(), kq.ptr(), vq.ptr(), sp.ptr()) }
                    }),)*
                    other => return Err(Error::Unsupported(format!("head_dim {other}"))),
                }
            };
        }
        rotkv_kernels::for_each_append!(rotate).map_err(|e| err("append_rotate", e))?;
    }
    // 2. Pages that fill: their rows come from the old window or the new tokens.
    let (p0, p1) = (fmt.pages_for(p.start), fmt.pages_for(new_len));
    for value in [false, true] {
        let (mut rows, mut slots) = (Vec::new(), Vec::new());
        for page in p0..p1 {
            for h in 0..hkv as u32 {
                for slot in 0..fmt.page_size {
                    let pos = fmt.sinks + page * fmt.page_size + slot;
                    if (pos as usize) < len {
                        let at = fmt.side_row_at(h, value, fmt.window_row(pos));
                        rows.extend(side[at..at + d].iter().map(|x| x.to_bits()));
                    } else {
                        let at = ((pos as usize - len) * hkv + h as usize) * 2 * d + value as usize * d;
                        rows.extend_from_slice(&staged[at..at + d]);
                    }
                    slots.extend_from_slice(&[block_table[page as usize], slot, h]);
                }
            }
        }
        let jobs = slots.len() / 3;
        if jobs == 0 {
            continue;
        }
        let (rp, tp, pp) = (Shared(rows.as_mut_ptr()), Shared(slots.as_mut_ptr()), Shared(pool.as_mut_ptr()));
        let bits = fmt.bits(value);
        macro_rules! quantize {
            ($(($rot:ident, $q2:ident, $q4:ident, $d:literal, $v:literal)),* $(,)?) => {
                match (d, bits) {
                    $(
                        ($d, 2) => sim::launch([jobs as u32, 1, 1], 32, 0, |c: &SimCtx<'_>| {
                            // SAFETY: `rows` holds jobs x D entries, `slots` jobs triples
                            // whose blocks the paged layer checked against the pool.
                            unsafe { append_quantize::<_, $d, $v, 2>(c, &fmt, p.num_kv_heads, value, rp.ptr(), tp.ptr(), pp.ptr()) }
                        }),
                        ($d, 4) => sim::launch([jobs as u32, 1, 1], 32, 0, |c: &SimCtx<'_>| {
                            // SAFETY: as above.
                            unsafe { append_quantize::<_, $d, $v, 4>(c, &fmt, p.num_kv_heads, value, rp.ptr(), tp.ptr(), pp.ptr()) }
                        }),
                    )*
                    other => return Err(Error::Unsupported(format!("(head_dim, bits) {other:?}"))),
                }
            };
        }
        rotkv_kernels::for_each_append!(quantize).map_err(|e| err("append_quantize", e))?;
    }
    // 3. New tokens that stay in f16.
    for pos in p.start..new_len {
        let row = match fmt.place(pos, new_len) {
            Place::Sink { index } => index,
            Place::Window { slot } => slot,
            Place::Page { .. } => continue,
        };
        for h in 0..hkv as u32 {
            for value in [false, true] {
                let at = fmt.side_row_at(h, value, row);
                let src = ((pos as usize - len) * hkv + h as usize) * 2 * d + value as usize * d;
                side[at..at + d].iter_mut().zip(&staged[src..src + d]).for_each(|(o, &b)| *o = f16::from_bits(b));
            }
        }
    }
    Ok(())
}
