//! Device kernels run by the SIMT emulator (feature `sim`), through the launch geometry
//! the CUDA backend uses. So far: `decode_merge`. The `append` and `decode_split`
//! kernels, and with them a `sim` [`crate::Backend`], are not written yet.

use crate::error::{Error, Result};
use rotkv_kernels::merge::decode_merge;
use rotkv_kernels::params::MergeParams;
use rotkv_kernels::sim::{self, SimCtx};

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
