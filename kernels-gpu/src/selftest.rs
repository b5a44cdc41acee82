//! First checks on a GPU of the layouts the decode kernel relies on.
//!
//! `mma_selftest`: one `mma.sync.m16n8k16` per warp on fragments given by the host, so a
//! first run on a GPU learns at once whether the fragment layouts of `Ctx::mma_m16n8k16`
//! (and the decode kernel built on them) match the hardware. The host packs the fragments
//! from plain matrices by the documented layout and compares the result with a plain
//! matrix product (`rotkv::cuda::mma_selftest`, and the emulator tests).
//!
//! `ldmatrix_selftest`: `cp.async` into shared memory, the wait and warp barrier, and
//! `ldmatrix` `x4`/`x2`, plain and transposed, on host-given rows; the host compares each
//! lane's registers with the layout `Ctx::ldmatrix_x4` documents
//! (`rotkv::cuda::ldmatrix_selftest`, and the emulator tests).

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

/// Words each lane writes in [`ldmatrix_selftest`]: `x4`, `x4.trans`, `x2`, `x2.trans`.
pub const LDMATRIX_WORDS: usize = 12;
/// Rows (16 bytes each) [`ldmatrix_selftest`] reads: four 8 x 8 matrices of 16-bit elements.
pub const LDMATRIX_ROWS: usize = 32;

/// 16-byte slot of shared memory where [`ldmatrix_selftest`] puts row `i`: scattered, so
/// that each lane's row address is its own.
pub const fn ldmatrix_slot(i: usize) -> usize {
    i * 5 % LDMATRIX_ROWS
}

/// The primitives of `decode_mma`'s `cp.async` ring on one warp: copies the 32 rows of
/// `rows` into shared memory with `cp.async` (lane `i` row `i`, into slot
/// [`ldmatrix_slot`]`(i)`), retires them (`cp.async.wait_group 0`, then `bar.warp.sync`
/// so every lane sees every copy), and loads them back with `ldmatrix` `x4` and `x2`,
/// plain and transposed, lane `L` giving the address of row `L` (row `L % 8` of matrix
/// `L / 8`). A first run on a GPU thus learns whether the layouts of
/// [`Ctx::ldmatrix_x4`] and the ring's visibility rules are the hardware's.
///
/// # Safety
/// `rows` valid for `LDMATRIX_ROWS * 16` bytes, 16-byte aligned, not written during the
/// kernel; `out` valid for `32 * LDMATRIX_WORDS` writes; one block of 32 threads with
/// `LDMATRIX_ROWS * 16` bytes of dynamic shared memory.
///
/// # Parameters
/// Lane `L` writes `out[L * 12 ..][..12]`: the four registers of the `x4`, the four of the
/// `x4.trans`, the two of the `x2` and the two of the `x2.trans`.
#[inline(always)]
pub unsafe fn ldmatrix_selftest<C: Ctx>(ctx: &C, rows: *const u8, out: *mut u32) {
    let lane = ctx.lane() as usize;
    let sh = ctx.shared();
    // SAFETY (every access): inside the sizes of the contract.
    unsafe {
        // By offset, as the decode kernel's ring copies.
        let mine = sh.add(16 * ldmatrix_slot(lane));
        ctx.cp_async16_at(16 * ldmatrix_slot(lane) as u32, rows.add(16 * lane));
        ctx.cp_async_commit();
        ctx.cp_async_wait(0);
        ctx.sync_warp();
        let row = mine.cast_const();
        let (x4, x4t) = (ctx.ldmatrix_x4(row, false), ctx.ldmatrix_x4(row, true));
        let (x2, x2t) = (ctx.ldmatrix_x2(row, false), ctx.ldmatrix_x2(row, true));
        let o = out.add(LDMATRIX_WORDS * lane);
        for i in 0..4 {
            *o.add(i) = x4[i];
            *o.add(4 + i) = x4t[i];
        }
        for i in 0..2 {
            *o.add(8 + i) = x2[i];
            *o.add(10 + i) = x2t[i];
        }
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

    /// PTX entry point of [`super::ldmatrix_selftest`].
    ///
    /// # Safety
    /// See [`super::ldmatrix_selftest`].
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn rotkv_ldmatrix_selftest(rows: *const u8, out: *mut u32) {
        // SAFETY: forwarded contract.
        unsafe { super::ldmatrix_selftest(&Nvptx, rows, out) }
    }
}
