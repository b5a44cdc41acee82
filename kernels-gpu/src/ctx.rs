//! The device context kernel bodies are generic over.
//!
//! On `nvptx64` it is `Nvptx`: special registers, `bar.sync` and `shfl.sync` through
//! `core::arch::nvptx` and `asm!`. On the host the SIMT emulator (`sim` feature,
//! `crate::sim`) implements it with one OS thread per GPU thread, so the same kernel body
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
    /// One 16-byte load of read-only global memory (`ld.global.nc.v4.u32` on the device).
    ///
    /// # Safety
    /// `p` must be 16-byte aligned and valid for 16 bytes that no thread writes during
    /// the kernel.
    unsafe fn load16(&self, p: *const u8) -> [u32; 4] {
        // SAFETY: forwarded contract.
        unsafe { *p.cast::<[u32; 4]>() }
    }
    /// Lane within the warp.
    fn lane(&self) -> u32 {
        self.thread_idx() % WARP
    }
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
        let r: f32;
        // SAFETY: a full-warp butterfly shuffle; kernels call it with all 32 lanes active.
        unsafe {
            core::arch::asm!(
                "shfl.sync.bfly.b32 {r}, {v}, {m}, 0x1f, 0xffffffff;",
                r = out(reg32) r, v = in(reg32) v, m = in(reg32) mask,
            );
        }
        r
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
    fn shared(&self) -> *mut u8 {
        let p: u64;
        // SAFETY: converts the address of the module's extern shared array to a generic
        // pointer; no memory is touched.
        unsafe { core::arch::asm!("cvta.shared.u64 {p}, rotkv_smem;", p = out(reg64) p) };
        p as *mut u8
    }
    #[inline(always)]
    fn shfl_idx(&self, v: f32, src_lane: u32) -> f32 {
        let r: f32;
        // SAFETY: a full-warp indexed shuffle; kernels call it with all 32 lanes active.
        unsafe {
            core::arch::asm!(
                "shfl.sync.idx.b32 {r}, {v}, {s}, 0x1f, 0xffffffff;",
                r = out(reg32) r, v = in(reg32) v, s = in(reg32) src_lane,
            );
        }
        r
    }
}
