//! The device context kernel bodies are generic over.
//!
//! On `nvptx64` it is `Nvptx`: special registers and `bar.sync` through
//! `core::arch::nvptx`, `shfl.sync` through LLVM's (convergent) NVVM intrinsics, loads and
//! `mma.sync` through `asm!`. On the host the SIMT emulator (`sim` feature,
//! `crate::sim`) implements it with one coroutine per GPU thread, so the same kernel body
//! runs on both. Blocks are one-dimensional (`threadIdx.x` only); grids are 3-D.

/// Threads per warp.
pub const WARP: u32 = 32;

/// What a kernel body may ask of the machine it runs on.
pub trait Ctx {
    /// `threadIdx.x`.
    fn thread_idx(&self) -> u32;
    /// `blockDim.x`.
    fn block_dim(&self) -> u32;
    /// `blockIdx.{x, y, z}`.
    fn block_idx(&self) -> [u32; 3];
    /// `gridDim.{x, y, z}`.
    fn grid_dim(&self) -> [u32; 3];
    /// `__syncthreads()`: every thread of the block must reach it.
    fn sync_threads(&self);
    /// `__shfl_xor_sync(0xffffffff, v, mask)`: every lane of the warp must take part.
    fn shfl_xor(&self, v: f32, mask: u32) -> f32;
    /// `__shfl_sync(0xffffffff, v, src_lane)`: every lane of the warp must take part.
    fn shfl_idx(&self, v: f32, src_lane: u32) -> f32;
    /// The block's dynamic shared memory (16-byte aligned; its size is set at launch).
    fn shared(&self) -> *mut u8;
    /// `red.global.add.u32 [p], v`: adds `v` to the u32 at `p` atomically, returning
    /// nothing (the device-side error counters of the batched append).
    ///
    /// # Safety
    /// `p` valid, 4-byte aligned, writable global memory.
    unsafe fn atomic_add_u32(&self, p: *mut u32, v: u32) {
        // SAFETY: forwarded contract; an `AtomicU32` has the layout of a `u32`.
        unsafe { core::sync::atomic::AtomicU32::from_ptr(p).fetch_add(v, core::sync::atomic::Ordering::Relaxed) };
    }
    /// One 16-byte load of read-only global memory (`ld.global.nc.v4.u32` on the device).
    ///
    /// # Safety
    /// `p` must be 16-byte aligned and valid for 16 bytes that no thread writes during
    /// the kernel.
    unsafe fn load16(&self, p: *const u8) -> [u32; 4] {
        // SAFETY: forwarded contract.
        unsafe { *p.cast::<[u32; 4]>() }
    }
    /// 16 bytes of the block's shared memory at `p`. On the device an `ld.shared.v4.u32`
    /// (a shared load, which the scheduler tracks on the short scoreboard, where a generic
    /// load of a shared address goes through the generic path and the long scoreboard).
    ///
    /// # Safety
    /// `p` must be 16-byte aligned and point into the block's shared memory, valid for 16
    /// bytes that no thread writes while this load may run.
    unsafe fn load_shared16(&self, p: *const u32) -> [u32; 4] {
        // SAFETY: forwarded contract.
        unsafe { *p.cast::<[u32; 4]>() }
    }
    /// 8 bytes of the block's shared memory at `p`, as [`Ctx::load_shared16`]
    /// (`ld.shared.v2.u32` on the device).
    ///
    /// # Safety
    /// As [`Ctx::load_shared16`], 8-byte aligned and valid for 8 bytes.
    unsafe fn load_shared8(&self, p: *const u32) -> [u32; 2] {
        // SAFETY: forwarded contract.
        unsafe { *p.cast::<[u32; 2]>() }
    }
    /// `cp.async.cg.shared.global [dst], [src], 16`: starts a 16-byte copy from global to
    /// shared memory in the thread's current cp.async group (see [`Ctx::cp_async_commit`]).
    /// The data is visible to this thread only after the [`Ctx::cp_async_wait`] that
    /// retires its group, to the rest of its warp after a [`Ctx::sync_warp`] that follows
    /// that wait, to the rest of the block after a `sync_threads` that follows it. The
    /// default body copies at once (correct for any context); the emulator fills `dst`
    /// with NaN and defers the copy to the wait, the device copies asynchronously
    /// (sm_80+).
    ///
    /// # Safety
    /// `dst_shared` must point into the block's shared memory and `src_global` into global
    /// memory, both 16-byte aligned and valid for 16 bytes; nobody writes `src_global`
    /// during the kernel, and nobody touches `dst_shared` until the copy's group is
    /// retired.
    unsafe fn cp_async16(&self, dst_shared: *mut u8, src_global: *const u8) {
        // SAFETY: forwarded contract.
        unsafe { core::ptr::copy_nonoverlapping(src_global, dst_shared, 16) }
    }
    /// [`Ctx::cp_async16`] into the block's dynamic shared memory at byte offset
    /// `dst_offset`: the device adds it to the shared window's 32-bit address of the
    /// array, so a kernel's destination arithmetic stays 32-bit.
    ///
    /// # Safety
    /// As [`Ctx::cp_async16`] for `self.shared() + dst_offset`.
    unsafe fn cp_async16_at(&self, dst_offset: u32, src_global: *const u8) {
        // SAFETY: forwarded contract.
        unsafe { self.cp_async16(self.shared().add(dst_offset as usize), src_global) }
    }
    /// `cp.async.commit_group`: closes the current group of [`Ctx::cp_async16`] copies
    /// (an empty group is allowed and trivially complete).
    fn cp_async_commit(&self) {}
    /// `cp.async.wait_group n`: waits until at most the `n` most recent committed groups
    /// of this thread are pending; every older group is complete and visible to this
    /// thread. Copies not yet committed are not waited for. `n` should be a constant (the
    /// device needs an immediate); above 7 the device waits as for 7, which is stricter.
    fn cp_async_wait(&self, n: u32) {
        let _ = n;
    }
    /// `__syncwarp()`: every lane of the warp must take part. Orders the lanes' memory
    /// accesses around it: what a lane wrote to shared memory before it (a cp.async copy
    /// included, once its group is retired by [`Ctx::cp_async_wait`]) is visible to every
    /// lane of the warp after it. The default body is a shuffle (a warp barrier on the
    /// emulator, where memory is coherent); the device runs `bar.warp.sync`.
    fn sync_warp(&self) {
        let _ = self.shfl_idx_u32(0, 0);
    }
    /// `ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16`: four 8 x 8 matrices of 16-bit
    /// elements from shared memory, one register each. Lane `8 i + r` gives the address
    /// of row `r` (16 bytes) of matrix `i`. With `g = lane / 4`, `t = lane % 4`, register
    /// `i` of a lane holds (PTX ISA, "Warp-level matrix load instruction: ldmatrix"):
    /// without `trans`, elements `2t` and `2t + 1` of row `g` (the row's 32-bit word `t`);
    /// with `trans` (the matrix read column-major), element `g` of rows `2t` (low half)
    /// and `2t + 1` (high half). Every lane of the warp must take part. The default body
    /// exchanges the row addresses by shuffles and reads the elements itself.
    ///
    /// # Safety
    /// Each lane's `row` is 16-byte aligned, in the block's shared memory, valid for 16
    /// bytes that no thread writes until every lane has passed this call.
    unsafe fn ldmatrix_x4(&self, row: *const u8, trans: bool) -> [u32; 4] {
        // SAFETY: forwarded contract.
        unsafe { ldmatrix_by_shuffles(self, row, trans) }
    }
    /// `ldmatrix.sync.aligned.m8n8.x2{.trans}.shared.b16`: as [`Ctx::ldmatrix_x4`] with two
    /// matrices (lanes 0-15 give the row addresses; the others' are not read).
    ///
    /// # Safety
    /// As [`Ctx::ldmatrix_x4`], for lanes 0-15.
    unsafe fn ldmatrix_x2(&self, row: *const u8, trans: bool) -> [u32; 2] {
        // SAFETY: forwarded contract.
        unsafe { ldmatrix_by_shuffles(self, row, trans) }
    }
    /// Lane within the warp.
    fn lane(&self) -> u32 {
        self.thread_idx() % WARP
    }
    /// `__shfl_sync(0xffffffff, v, src_lane)` of 32 raw bits: every lane of the warp must
    /// take part.
    fn shfl_idx_u32(&self, v: u32, src_lane: u32) -> u32 {
        self.shfl_idx(f32::from_bits(v), src_lane).to_bits()
    }
    /// `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`: `D = A * B + C` for one warp,
    /// A 16 x 16 f16 (row-major), B 16 x 8 f16 (column-major), C and D 16 x 8 f32. Every
    /// lane of the warp must take part.
    ///
    /// Fragments, with `g = lane / 4` and `t = lane % 4` (PTX ISA 9.1, section 9.7.14.5.8
    /// "Matrix Fragments for mma.m16n8k16 with floating point type": groupID =
    /// `%laneid >> 2`, threadID_in_group = `%laneid % 4`, elements low to high); each
    /// `u32` holds two f16, the lower index in the low half:
    /// - `a[0]` = `A[g][2t]`, `A[g][2t+1]`; `a[1]` = `A[g+8][2t]`, `A[g+8][2t+1]`;
    ///   `a[2]` = `A[g][2t+8]`, `A[g][2t+9]`; `a[3]` = `A[g+8][2t+8]`, `A[g+8][2t+9]`;
    /// - `b[0]` = `B[2t][g]`, `B[2t+1][g]`; `b[1]` = `B[2t+8][g]`, `B[2t+9][g]`;
    /// - `c`, result: `[0]` = `C[g][2t]`, `[1]` = `C[g][2t+1]`, `[2]` = `C[g+8][2t]`, `[3]` = `C[g+8][2t+1]`.
    ///
    /// The default body computes it with indexed shuffles (correct on any context, slow);
    /// the device uses the instruction.
    fn mma_m16n8k16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        let lane = self.lane();
        let (g, t) = (lane / 4, lane % 4);
        let half = |w: u32, hi: bool| crate::math::f16_to_f32(if hi { (w >> 16) as u16 } else { w as u16 });
        // Rows g and g + 8 of A: A[row][k] lives in lane 4 * row' + k' / 2 % 4, register
        // (row >= 8) + 2 * (k >= 8), half k % 2.
        let mut arow = [[0f32; 16]; 2];
        for r in 0..4u32 {
            for src_t in 0..4u32 {
                let w = self.shfl_idx_u32(a[r as usize], 4 * g + src_t);
                let row = (r & 1) as usize;
                let k = (2 * src_t + 8 * (r >> 1)) as usize;
                arow[row][k] = half(w, false);
                arow[row][k + 1] = half(w, true);
            }
        }
        // Columns 2t and 2t + 1 of B: B[k][n] lives in lane 4 * n + k % 8 / 2, register
        // k >= 8, half k % 2.
        let mut bcol = [[0f32; 16]; 2];
        for col in 0..2u32 {
            for r in 0..2u32 {
                for src_t in 0..4u32 {
                    let w = self.shfl_idx_u32(b[r as usize], 4 * (2 * t + col) + src_t);
                    let k = (2 * src_t + 8 * r) as usize;
                    bcol[col as usize][k] = half(w, false);
                    bcol[col as usize][k + 1] = half(w, true);
                }
            }
        }
        core::array::from_fn(|i| {
            let (row, col) = (i / 2, i % 2);
            arow[row].iter().zip(&bcol[col]).fold(c[i], |acc, (x, y)| acc + x * y)
        })
    }
}

/// [`Ctx::ldmatrix_x4`] and [`Ctx::ldmatrix_x2`] from their definition: the row addresses
/// of the `N` matrices go round the warp by shuffles and each lane reads its own elements.
///
/// # Safety
/// As [`Ctx::ldmatrix_x4`], for lanes `0 .. 8 N`.
pub(crate) unsafe fn ldmatrix_by_shuffles<C: Ctx + ?Sized, const N: usize>(
    ctx: &C,
    row: *const u8,
    trans: bool,
) -> [u32; N] {
    let a = row as usize as u64;
    // Row `r` of matrix `i`: the address lane `8 i + r` gave.
    let row_of = |i: u32, r: u32| -> *const u8 {
        let src = 8 * i + r;
        let lo = ctx.shfl_idx_u32(a as u32, src) as u64;
        let hi = ctx.shfl_idx_u32((a >> 32) as u32, src) as u64;
        // Every row lies in the block's shared memory, as this lane's does.
        row.with_addr((lo | hi << 32) as usize)
    };
    // SAFETY: the rows are valid for 16 bytes (the caller's contract).
    unsafe { ldmatrix_fragment(ctx.lane(), trans, row_of) }
}

/// `lane`'s registers of an `ldmatrix` of `N` matrices (the layout of
/// [`Ctx::ldmatrix_x4`]) from `row_of(i, r)`, the address of row `r` of matrix `i`.
///
/// # Safety
/// Every row `row_of` gives for `i < N` is valid for 16 bytes of reads.
pub(crate) unsafe fn ldmatrix_fragment<const N: usize>(
    lane: u32,
    trans: bool,
    row_of: impl Fn(u32, u32) -> *const u8,
) -> [u32; N] {
    let (g, t) = (lane / 4, lane % 4);
    core::array::from_fn(|i| {
        let i = i as u32;
        // SAFETY: words and half-words inside rows valid for 16 bytes.
        unsafe {
            if trans {
                let h = |p: *const u8| p.add(2 * g as usize).cast::<u16>().read() as u32;
                h(row_of(i, 2 * t)) | h(row_of(i, 2 * t + 1)) << 16
            } else {
                row_of(i, g).add(4 * t as usize).cast::<u32>().read()
            }
        }
    })
}

/// The real device: special registers and PTX instructions.
#[cfg(target_arch = "nvptx64")]
#[derive(Clone, Copy)]
pub struct Nvptx;

// The dynamic shared memory of every kernel of the module, sized at launch.
#[cfg(target_arch = "nvptx64")]
core::arch::global_asm!(".extern .shared .align 16 .b8 rotkv_smem[];");

#[cfg(target_arch = "nvptx64")]
impl Ctx for Nvptx {
    #[inline(always)]
    fn thread_idx(&self) -> u32 {
        // SAFETY: reading a special register has no preconditions inside a kernel.
        unsafe { core::arch::nvptx::_thread_idx_x() as u32 }
    }
    #[inline(always)]
    fn block_dim(&self) -> u32 {
        // SAFETY: as above.
        unsafe { core::arch::nvptx::_block_dim_x() as u32 }
    }
    #[inline(always)]
    fn block_idx(&self) -> [u32; 3] {
        use core::arch::nvptx::*;
        // SAFETY: as above.
        unsafe { [_block_idx_x() as u32, _block_idx_y() as u32, _block_idx_z() as u32] }
    }
    #[inline(always)]
    fn grid_dim(&self) -> [u32; 3] {
        use core::arch::nvptx::*;
        // SAFETY: as above.
        unsafe { [_grid_dim_x() as u32, _grid_dim_y() as u32, _grid_dim_z() as u32] }
    }
    #[inline(always)]
    fn sync_threads(&self) {
        // SAFETY: kernels call this where every thread of the block arrives (the same
        // contract the emulator checks).
        unsafe { core::arch::nvptx::_syncthreads() }
    }
    #[inline(always)]
    fn shfl_xor(&self, v: f32, mask: u32) -> f32 {
        // SAFETY: a full-warp butterfly shuffle; kernels call it with all 32 lanes active.
        unsafe { intrinsics::shfl_sync_bfly_f32(FULL_MASK, v, mask, 0x1f) }
    }
    #[inline(always)]
    unsafe fn load16(&self, p: *const u8) -> [u32; 4] {
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: the caller guarantees an aligned, valid, read-only global address.
        unsafe {
            core::arch::asm!(
                "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; ld.global.nc.v4.u32 {{{a}, {b}, {c}, {d}}}, [g]; }}",
                p = in(reg64) p,
                a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            );
        }
        [a, b, c, d]
    }
    #[inline(always)]
    unsafe fn load_shared16(&self, p: *const u32) -> [u32; 4] {
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: the caller guarantees an aligned address inside the block's shared
        // memory that nobody writes meanwhile; the load only reads (`pure, readonly`: its
        // result depends on its input and memory, so the compiler may merge two loads of
        // one address with no write between them).
        // `p`'s offset from the start of the shared array: `shared()` is a pure conversion
        // of the array's address, so the compiler folds `p - shared()` when `p` was
        // derived from it (no conversion at run time), and the shared address is the
        // array's plus the offset, as `cp_async16_at` addresses it.
        let off = (p as u64).wrapping_sub(self.shared() as u64) as u32;
        unsafe {
            core::arch::asm!(
                "{{ .reg .u32 s; mov.u32 s, rotkv_smem; add.u32 s, s, {o}; ld.shared.v4.u32 {{{a}, {b}, {c}, {d}}}, [s]; }}",
                o = in(reg32) off,
                a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                options(pure, readonly, nostack),
            );
        }
        [a, b, c, d]
    }
    #[inline(always)]
    unsafe fn load_shared8(&self, p: *const u32) -> [u32; 2] {
        let (a, b): (u32, u32);
        // As `load_shared16`.
        let off = (p as u64).wrapping_sub(self.shared() as u64) as u32;
        // SAFETY: the caller guarantees an aligned address inside the block's shared
        // memory that nobody writes meanwhile; the load only reads (`pure, readonly`: its
        // result depends on its input and memory, so the compiler may merge two loads of
        // one address with no write between them).
        unsafe {
            core::arch::asm!(
                "{{ .reg .u32 s; mov.u32 s, rotkv_smem; add.u32 s, s, {o}; ld.shared.v2.u32 {{{a}, {b}}}, [s]; }}",
                o = in(reg32) off,
                a = out(reg32) a, b = out(reg32) b,
                options(pure, readonly, nostack),
            );
        }
        [a, b]
    }
    #[inline(always)]
    fn shared(&self) -> *mut u8 {
        let p: u64;
        // SAFETY: converts the address of the module's extern shared array to a generic
        // pointer; no memory is touched.
        unsafe {
            core::arch::asm!("cvta.shared.u64 {p}, rotkv_smem;", p = out(reg64) p, options(pure, nomem, nostack))
        };
        p as *mut u8
    }
    #[inline(always)]
    fn shfl_idx(&self, v: f32, src_lane: u32) -> f32 {
        // SAFETY: a full-warp indexed shuffle; kernels call it with all 32 lanes active.
        unsafe { intrinsics::shfl_sync_idx_f32(FULL_MASK, v, src_lane, 0x1f) }
    }
    #[inline(always)]
    fn shfl_idx_u32(&self, v: u32, src_lane: u32) -> u32 {
        // SAFETY: as above.
        unsafe { intrinsics::shfl_sync_idx_i32(FULL_MASK, v, src_lane, 0x1f) }
    }
    #[inline(always)]
    fn mma_m16n8k16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        let (d0, d1, d2, d3): (f32, f32, f32, f32);
        // SAFETY: a warp-wide tensor-core instruction on registers only (sm_80+); kernels
        // call it with all 32 lanes active, the contract the emulator checks.
        unsafe {
            core::arch::asm!(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
                d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                options(nomem, nostack),
            );
        }
        [d0, d1, d2, d3]
    }
    #[inline(always)]
    unsafe fn cp_async16(&self, dst_shared: *mut u8, src_global: *const u8) {
        // SAFETY: the caller guarantees aligned shared and global addresses valid for 16
        // bytes; the generic addresses are converted to their state spaces.
        unsafe {
            core::arch::asm!(
                "{{ .reg .u64 s, g; cvta.to.shared.u64 s, {d}; cvta.to.global.u64 g, {p}; cp.async.cg.shared.global [s], [g], 16; }}",
                d = in(reg64) dst_shared,
                p = in(reg64) src_global,
                options(nostack),
            );
        }
    }
    #[inline(always)]
    unsafe fn ldmatrix_x4(&self, row: *const u8, trans: bool) -> [u32; 4] {
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: the caller guarantees an aligned row of shared memory per lane and a
        // full warp; the generic address is converted to the shared window.
        unsafe {
            if trans {
                core::arch::asm!(
                    "{{ .reg .u64 s; cvta.to.shared.u64 s, {p}; ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [s]; }}",
                    p = in(reg64) row,
                    a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                    options(readonly, nostack),
                );
            } else {
                core::arch::asm!(
                    "{{ .reg .u64 s; cvta.to.shared.u64 s, {p}; ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [s]; }}",
                    p = in(reg64) row,
                    a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                    options(readonly, nostack),
                );
            }
        }
        [a, b, c, d]
    }
    #[inline(always)]
    unsafe fn ldmatrix_x2(&self, row: *const u8, trans: bool) -> [u32; 2] {
        let (a, b): (u32, u32);
        // SAFETY: as `ldmatrix_x4`.
        unsafe {
            if trans {
                core::arch::asm!(
                    "{{ .reg .u64 s; cvta.to.shared.u64 s, {p}; ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {{{a}, {b}}}, [s]; }}",
                    p = in(reg64) row,
                    a = out(reg32) a, b = out(reg32) b,
                    options(readonly, nostack),
                );
            } else {
                core::arch::asm!(
                    "{{ .reg .u64 s; cvta.to.shared.u64 s, {p}; ldmatrix.sync.aligned.m8n8.x2.shared.b16 {{{a}, {b}}}, [s]; }}",
                    p = in(reg64) row,
                    a = out(reg32) a, b = out(reg32) b,
                    options(readonly, nostack),
                );
            }
        }
        [a, b]
    }
    #[inline(always)]
    unsafe fn cp_async16_at(&self, dst_offset: u32, src_global: *const u8) {
        // SAFETY: the caller guarantees an aligned offset inside the block's dynamic
        // shared memory and an aligned global source valid for 16 bytes.
        unsafe {
            core::arch::asm!(
                "{{ .reg .u32 s; .reg .u64 g; mov.u32 s, rotkv_smem; add.u32 s, s, {o}; cvta.to.global.u64 g, {p}; cp.async.cg.shared.global [s], [g], 16; }}",
                o = in(reg32) dst_offset,
                p = in(reg64) src_global,
                options(nostack),
            );
        }
    }
    #[inline(always)]
    unsafe fn atomic_add_u32(&self, p: *mut u32, v: u32) {
        // SAFETY: the caller guarantees a valid, aligned, writable global address.
        unsafe {
            core::arch::asm!(
                "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; red.global.add.u32 [g], {v}; }}",
                p = in(reg64) p,
                v = in(reg32) v,
                options(nostack),
            );
        }
    }
    #[inline(always)]
    fn sync_warp(&self) {
        // SAFETY: kernels call it with all 32 lanes active; the memory clobber (no
        // `nomem`) keeps memory accesses on their side of it.
        unsafe { core::arch::asm!("bar.warp.sync -1;", options(nostack)) }
    }
    #[inline(always)]
    fn cp_async_commit(&self) {
        // SAFETY: closes this thread's cp.async group; no operands.
        unsafe { core::arch::asm!("cp.async.commit_group;", options(nostack)) }
    }
    #[inline(always)]
    fn cp_async_wait(&self, n: u32) {
        // SAFETY: waits for this thread's own copies; the memory clobber (no `nomem`) keeps
        // shared-memory reads after it. `N` must be an immediate: one arm per value, which
        // folds away for a constant `n`.
        unsafe {
            match n {
                0 => core::arch::asm!("cp.async.wait_group 0;", options(nostack)),
                1 => core::arch::asm!("cp.async.wait_group 1;", options(nostack)),
                2 => core::arch::asm!("cp.async.wait_group 2;", options(nostack)),
                3 => core::arch::asm!("cp.async.wait_group 3;", options(nostack)),
                4 => core::arch::asm!("cp.async.wait_group 4;", options(nostack)),
                5 => core::arch::asm!("cp.async.wait_group 5;", options(nostack)),
                6 => core::arch::asm!("cp.async.wait_group 6;", options(nostack)),
                _ => core::arch::asm!("cp.async.wait_group 7;", options(nostack)),
            }
        }
    }
}

/// All 32 lanes.
#[cfg(target_arch = "nvptx64")]
const FULL_MASK: u32 = 0xffff_ffff;

/// LLVM's NVPTX intrinsics for warp shuffles. Unlike `asm!`, they are `convergent`, so
/// LLVM never moves a shuffle into (or duplicates it across) divergent control flow.
/// Arguments: member mask, value, lane (or xor mask), clamp (`0x1f`: the whole warp).
#[cfg(target_arch = "nvptx64")]
mod intrinsics {
    unsafe extern "C" {
        #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
        pub fn shfl_sync_bfly_f32(mask: u32, v: f32, lane_mask: u32, clamp: u32) -> f32;
        #[link_name = "llvm.nvvm.shfl.sync.idx.f32"]
        pub fn shfl_sync_idx_f32(mask: u32, v: f32, src_lane: u32, clamp: u32) -> f32;
        #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
        pub fn shfl_sync_idx_i32(mask: u32, v: u32, src_lane: u32, clamp: u32) -> u32;
    }
}
