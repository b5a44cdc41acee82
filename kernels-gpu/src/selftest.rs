//! `mma_selftest`: one `mma.sync.m16n8k16` per warp on fragments given by the host, so a
//! first run on a GPU learns at once whether the fragment layouts of `Ctx::mma_m16n8k16`
//! (and the decode kernel built on them) match the hardware. The host packs the fragments
//! from plain matrices by the documented layout and compares the result with a plain
//! matrix product (`rotkv::cuda::mma_selftest`, and the emulator tests).

use crate::ctx::Ctx;

/// Runs one MMA per warp: `d = a * b + c` on the lane's fragments.
///
/// # Safety
/// With `W` warps in the grid: `a` valid for `W * 32 * 4` reads, `b` for `W * 32 * 2`,
/// `c` for `W * 32 * 4`, `d` for `W * 32 * 4` writes not aliased by the inputs.
///
/// # Parameters
/// Per warp `w` and lane `l`: `a[(w * 32 + l) * 4 ..][..4]`, `b[(w * 32 + l) * 2 ..][..2]`
/// and `c[(w * 32 + l) * 4 ..][..4]` are the lane's A, B and C fragments; `d` receives its
/// D fragment at the same place as `c`.
///
/// # Thread mapping
/// Any grid of blocks of whole warps; global warp `w = (block * block_dim + thread) / 32`.
#[inline(always)]
pub unsafe fn mma_selftest<C: Ctx>(ctx: &C, a: *const u32, b: *const u32, c: *const f32, d: *mut f32) {
    let t = (ctx.block_idx()[0] * ctx.block_dim() + ctx.thread_idx()) as usize;
    // SAFETY (reads and writes): inside the sizes of the contract.
    let af: [u32; 4] = core::array::from_fn(|i| unsafe { *a.add(4 * t + i) });
    let bf: [u32; 2] = core::array::from_fn(|i| unsafe { *b.add(2 * t + i) });
    let cf: [f32; 4] = core::array::from_fn(|i| unsafe { *c.add(4 * t + i) });
    let r = ctx.mma_m16n8k16(af, bf, cf);
    for (i, &x) in r.iter().enumerate() {
        unsafe { *d.add(4 * t + i) = x };
    }
}

#[cfg(target_arch = "nvptx64")]
mod entry {
    use crate::ctx::Nvptx;

    /// PTX entry point of [`super::mma_selftest`].
    ///
    /// # Safety
    /// See [`super::mma_selftest`].
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn rotkv_mma_selftest(a: *const u32, b: *const u32, c: *const f32, d: *mut f32) {
        // SAFETY: forwarded contract.
        unsafe { super::mma_selftest(&Nvptx, a, b, c, d) }
    }
}
