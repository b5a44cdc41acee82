//! The CUDA backend (feature `cuda`): the PTX committed in `host/ptx/rotkv.ptx`, embedded
//! in the library and loaded once per process on device 0 through cudarc. cudarc loads
//! the driver at run time, so this builds without a CUDA toolkit and a program that has
//! it still starts on a machine without a GPU ([`available`] is then false).
//!
//! [`Kernels`] is the PTX loaded into one context, with the raw entry points (device
//! addresses, a caller's `CUstream`) that [`crate::device`], the GPU API with the cache in
//! device memory, is built on.
//!
//! The rest works on the host buffers of the paged API ([`crate::Backend::Cuda`], on
//! device 0's default stream): each call uploads what the kernels read and downloads
//! what they write, through the launch planning of [`crate::launch`]. It is a test path
//! for the conformance suite, never chosen by [`crate::Backend::auto`].

use crate::config::LayerCalibration;
use crate::error::{Error, Result};
use crate::launch::{self, BLOCK, DecodeInputs};
use crate::reference::SeqRef;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use half::f16;
use rotkv_kernels::params::{AppendBatchParams, AppendParams, DecodeParams, MergeParams};
use std::sync::{Arc, OnceLock};

/// The cudarc this build uses (0.19; `Device::cuda` takes its `CudaStream`).
pub use cudarc;

/// The device code, as `cargo xtask ptx` wrote it.
pub static PTX: &str = include_str!("../../ptx/rotkv.ptx");

struct Gpu {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    sms: usize,
}

static GPU: OnceLock<std::result::Result<Gpu, String>> = OnceLock::new();

fn gpu() -> Result<&'static Gpu> {
    GPU.get_or_init(|| {
        // SAFETY: only probes whether the driver library can be loaded. (With feature
        // `candle-cuda`, candle-core's `cuda` makes cudarc link the driver library at
        // build time, `dynamic-linking`: it is present whenever the binary runs, and
        // cudarc has no probe.)
        #[cfg(not(feature = "candle-cuda"))]
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no CUDA driver library on this machine".into());
        }
        let ctx = CudaContext::new(0).map_err(|e| format!("no CUDA device 0: {e:?}"))?;
        let kernels = Kernels::load(&ctx).map_err(|e| e.to_string())?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| format!("multiprocessor count: {e:?}"))?
            .max(1) as usize;
        Ok(Gpu { stream: ctx.default_stream(), kernels, sms })
    })
    .as_ref()
    .map_err(|e| Error::Backend(format!("cuda: {e}")))
}

/// Whether a CUDA driver and device are present (the PTX is loaded on first use).
pub fn available() -> bool {
    gpu().is_ok()
}

/// Multiprocessors of device 0 (the host-buffer path's split count), or an error
/// without a GPU.
pub fn sm_count() -> Result<usize> {
    Ok(gpu()?.sms)
}

fn err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("cuda {what}: {e:?}"))
}

fn launch_config_block(grid: [u32; 3], block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid[0], grid[1], grid[2]), block_dim: (block, 1, 1), shared_mem_bytes: shared }
}

/// A layer's learned rotations on the device, or a one-element placeholder without them
/// (the kernels read the matrices only when the paged layer set the matching
/// `FLAG_DENSE_*` bit from the same calibration).
fn rotation_d(s: &Arc<CudaStream>, r: &Option<Vec<f32>>) -> Result<CudaSlice<f32>> {
    s.clone_htod(r.as_deref().unwrap_or(&[0.0])).map_err(err("upload"))
}

/// Decode attention on the GPU: `decode_split` then `decode_merge`.
pub fn decode_cuda(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let g = gpu()?;
    let inputs = DecodeInputs::new(p, calib, pool, seqs, q)?;
    let s = &g.stream;
    let up = err("upload");
    let (q_d, pool_d, tables_d, lens_d) = (
        s.clone_htod(q).map_err(&up)?,
        s.clone_htod(pool).map_err(&up)?,
        s.clone_htod(&inputs.tables).map_err(&up)?,
        s.clone_htod(&inputs.lens).map_err(&up)?,
    );
    let (sides_d, perm_d, inv_d) = (
        s.clone_htod(inputs.sides()).map_err(&up)?,
        s.clone_htod(&calib.key_perm).map_err(&up)?,
        s.clone_htod(&inputs.vperm_inv).map_err(&up)?,
    );
    let kscale_d = s.clone_htod(&calib.key_scale).map_err(&up)?;
    let (krot_d, vrot_d) = (rotation_d(s, &calib.key_rotation)?, rotation_d(s, &calib.value_rotation)?);
    let prot_d = s.clone_htod(&inputs.protected).map_err(&up)?;
    let (nm, no) = inputs.partial_lens();
    let alloc = err("alloc");
    let mut m_d = s.alloc_zeros::<f32>(nm).map_err(&alloc)?;
    let mut l_d = s.alloc_zeros::<f32>(nm).map_err(&alloc)?;
    let mut o_d = s.alloc_zeros::<f32>(no).map_err(&alloc)?;
    let mut out_d = s.alloc_zeros::<f32>(out.len()).map_err(&alloc)?;
    let (mp, _) = inputs.merge();
    fn a<T>(b: &CudaSlice<T>, s: &Arc<CudaStream>) -> u64 {
        b.device_ptr(s).0
    }
    // SAFETY: the same entry points and argument lists as the device API (one launch
    // path, `Kernels`); every address is a buffer just made on `s` with the sizes the
    // kernels' `# Safety` sections ask for (DecodeInputs checked them); no step batch.
    unsafe {
        let ptrs = launch::DecodePtrs {
            q: a(&q_d, s),
            pool: a(&pool_d, s),
            tables: a(&tables_d, s),
            lens: a(&lens_d, s),
            sides: a(&sides_d, s),
            protected: a(&prot_d, s),
            key_scale: a(&kscale_d, s),
            key_perm: a(&perm_d, s),
            key_rot: a(&krot_d, s),
            m: m_d.device_ptr_mut(s).0,
            l: l_d.device_ptr_mut(s).0,
            o: o_d.device_ptr_mut(s).0,
            meta: 0,
        };
        g.kernels.decode(s.cu_stream(), &inputs.params, &ptrs)?;
        let ptrs = launch::MergePtrs {
            m: ptrs.m,
            l: ptrs.l,
            o: ptrs.o,
            vperm_inv: a(&inv_d, s),
            value_rot: a(&vrot_d, s),
            out: out_d.device_ptr_mut(s).0,
            meta: 0,
        };
        g.kernels.merge(s.cu_stream(), &mp, &ptrs)?;
    }
    let host = s.clone_dtoh(&out_d).map_err(err("download"))?;
    out.copy_from_slice(&host);
    Ok(())
}

/// Appends `p.count` tokens on the GPU: `append_flush` for the window rows whose page
/// fills, then the fused `append_tokens` for the new tokens. The pool and the side store
/// are host buffers here: they are uploaded, updated on the device and copied back.
/// `k` and `v` are the raw inputs, of the element type `p.input_dtype` names (the
/// kernel converts f16 and bf16 itself).
#[allow(clippy::too_many_arguments)]
pub fn append_cuda(
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
    let g = gpu()?;
    let s = &g.stream;
    let up = err("upload");
    let side_bits: &mut [u16] = bytemuck::cast_slice_mut(side);
    let table = if block_table.is_empty() { &[u32::MAX][..] } else { block_table };
    let mut pool_d = s.clone_htod(&*pool).map_err(&up)?;
    let mut side_d = s.clone_htod(&*side_bits).map_err(&up)?;
    let table_d = s.clone_htod(table).map_err(&up)?;
    let prot_d = s.clone_htod(&launch::protected_row(&p.format, protected)).map_err(&up)?;
    let (k_d, v_d, mean_d) =
        (s.clone_htod(k).map_err(&up)?, s.clone_htod(v).map_err(&up)?, s.clone_htod(&calib.key_mean).map_err(&up)?);
    let ks_d = s.clone_htod(&calib.key_scale).map_err(&up)?;
    let (kp_d, vp_d) = (s.clone_htod(&calib.key_perm).map_err(&up)?, s.clone_htod(&calib.value_perm).map_err(&up)?);
    let (kr_d, vr_d) = (rotation_d(s, &calib.key_rotation)?, rotation_d(s, &calib.value_rotation)?);
    let block_table = table_d.device_ptr(s).0;
    let (pool_a, side_a) = (pool_d.device_ptr_mut(s).0, side_d.device_ptr_mut(s).0);
    // SAFETY: every address is a buffer just made on `s` with what the kernels' contracts
    // ask: `check_append_buffers` checked the inputs' sizes at their strides and the block
    // table (the pages written are blocks of the pool), the protected list is padded to
    // the format's length.
    unsafe {
        g.kernels.flush(s.cu_stream(), p, &launch::FlushPtrs { block_table, side: side_a, pool: pool_a })?;
        g.kernels.append_tokens(
            s.cu_stream(),
            p,
            &launch::AppendPtrs {
                k: k_d.device_ptr(s).0,
                v: v_d.device_ptr(s).0,
                key_mean: mean_d.device_ptr(s).0,
                key_scale: ks_d.device_ptr(s).0,
                key_perm: kp_d.device_ptr(s).0,
                value_perm: vp_d.device_ptr(s).0,
                key_rot: kr_d.device_ptr(s).0,
                value_rot: vr_d.device_ptr(s).0,
                block_table,
                protected: prot_d.device_ptr(s).0,
                pool: pool_a,
                side: side_a,
                seq_len: 0,
            },
        )?;
    }
    let down = err("download");
    pool.copy_from_slice(&s.clone_dtoh(&pool_d).map_err(&down)?);
    side_bits.copy_from_slice(&s.clone_dtoh(&side_d).map_err(&down)?);
    Ok(())
}

/// The PTX loaded into one CUDA context, with its entry points looked up once each: the
/// raw entry points on a caller's `CUstream` and device addresses (`CUdeviceptr`), which
/// [`crate::device`] builds on.
pub struct Kernels {
    module: Arc<CudaModule>,
    functions: std::sync::Mutex<std::collections::HashMap<&'static str, CudaFunction>>,
}

impl Kernels {
    /// Loads the embedded PTX into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).map_err(err("loading the PTX"))?;
        Ok(Self { module, functions: Default::default() })
    }

    fn function(&self, name: &'static str) -> Result<CudaFunction> {
        let mut f = self.functions.lock().map_err(|_| Error::Backend("cuda: poisoned function cache".into()))?;
        if let Some(x) = f.get(name) {
            return Ok(x.clone());
        }
        let x = self.module.load_function(name).map_err(err(name))?;
        f.insert(name, x.clone());
        Ok(x)
    }

    /// [`Kernels::function`], opted in to `shared` bytes of dynamic shared memory where
    /// that is above the 48 KiB default.
    fn function_with_shared(&self, name: &'static str, shared: u32) -> Result<CudaFunction> {
        let f = self.function(name)?;
        if shared > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .map_err(err(name))?;
        }
        Ok(f)
    }

    /// Launches `name` with `args` (pointers to each argument's value, in order).
    ///
    /// # Safety
    /// `args` match the entry point's parameters in order and type; every buffer they
    /// address is valid for what the kernel does with the launch shape.
    unsafe fn launch(
        &self,
        name: &'static str,
        stream: cudarc::driver::sys::CUstream,
        grid: [u32; 3],
        block: u32,
        shared: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        let f = self.function_with_shared(name, shared)?;
        // SAFETY: forwarded contract.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                (grid[0], grid[1], grid[2]),
                (block, 1, 1),
                shared,
                stream,
                args,
            )
        }
        .map_err(err(name))
    }

    /// Blocks of entry point `name` (with `block` threads and `shared` bytes of dynamic
    /// shared memory) one multiprocessor holds at once: the driver's occupancy
    /// calculation.
    pub fn resident_blocks(&self, name: &'static str, block: u32, shared: u32) -> Result<usize> {
        let f = self.function_with_shared(name, shared)?;
        let n = f.occupancy_max_active_blocks_per_multiprocessor(block, shared as usize, None).map_err(err(name))?;
        Ok(n as usize)
    }

    /// Enqueues the decode kernel of [`launch::decode_launch`]`(p)` on `stream`.
    ///
    /// # Safety
    /// As [`crate::device::raw::decode`], with device addresses in `stream`'s context.
    pub unsafe fn decode(
        &self,
        stream: cudarc::driver::sys::CUstream,
        p: &DecodeParams,
        ptrs: &launch::DecodePtrs,
    ) -> Result<()> {
        let shape = launch::decode_launch(p);
        let name = launch::decode_entry(&p.format, shape.kernel)?;
        let mut a = (*p, *ptrs);
        let x = &mut a.1;
        let mut args = [
            (&mut a.0 as *mut DecodeParams).cast(),
            (&mut x.q as *mut u64).cast(),
            (&mut x.pool as *mut u64).cast(),
            (&mut x.tables as *mut u64).cast(),
            (&mut x.lens as *mut u64).cast(),
            (&mut x.sides as *mut u64).cast(),
            (&mut x.protected as *mut u64).cast(),
            (&mut x.key_scale as *mut u64).cast(),
            (&mut x.key_perm as *mut u64).cast(),
            (&mut x.key_rot as *mut u64).cast(),
            (&mut x.m as *mut u64).cast(),
            (&mut x.l as *mut u64).cast(),
            (&mut x.o as *mut u64).cast(),
            (&mut x.meta as *mut u64).cast(),
        ];
        // SAFETY: the entry point's parameters in order (params by value, then 13
        // pointers); forwarded contract for the buffers.
        unsafe { self.launch(name, stream, shape.grid, shape.block, shape.shared, &mut args) }
    }

    /// Enqueues `decode_merge` on `stream`: grid (query heads, `p.num_seqs`).
    ///
    /// # Safety
    /// As [`crate::device::raw::merge`], with device addresses in `stream`'s context.
    pub unsafe fn merge(
        &self,
        stream: cudarc::driver::sys::CUstream,
        p: &MergeParams,
        ptrs: &launch::MergePtrs,
    ) -> Result<()> {
        let name = launch::merge_entry(p.head_dim)?;
        let mut a = (*p, *ptrs);
        let x = &mut a.1;
        let mut args = [
            (&mut a.0 as *mut MergeParams).cast(),
            (&mut x.m as *mut u64).cast(),
            (&mut x.l as *mut u64).cast(),
            (&mut x.o as *mut u64).cast(),
            (&mut x.vperm_inv as *mut u64).cast(),
            (&mut x.value_rot as *mut u64).cast(),
            (&mut x.out as *mut u64).cast(),
            (&mut x.meta as *mut u64).cast(),
        ];
        // SAFETY: `decode_merge`'s parameters in order; forwarded contract.
        unsafe { self.launch(name, stream, [p.num_q_heads, p.num_seqs, 1], BLOCK, 0, &mut args) }
    }

    /// Enqueues `append_flush` for the append `p` on `stream` (nothing when no page
    /// fills).
    ///
    /// # Safety
    /// As [`crate::device::raw::append_flush`], with device addresses in `stream`'s
    /// context.
    pub unsafe fn flush(
        &self,
        stream: cudarc::driver::sys::CUstream,
        p: &AppendParams,
        ptrs: &launch::FlushPtrs,
    ) -> Result<()> {
        let Some(grid) = launch::flush_grid(p) else { return Ok(()) };
        let name = launch::append_entries(p.format.head_dim)?.1;
        let (mut a, mut x) = (*p, *ptrs);
        let mut args = [
            (&mut a as *mut AppendParams).cast(),
            (&mut x.block_table as *mut u64).cast(),
            (&mut x.side as *mut u64).cast(),
            (&mut x.pool as *mut u64).cast(),
        ];
        // SAFETY: `append_flush`'s parameters in order; forwarded contract.
        unsafe { self.launch(name, stream, grid, BLOCK, 0, &mut args) }
    }

    /// Enqueues the batched append on `stream`: `append_batch_flush` then
    /// `append_batch_tokens`, the same two launches whatever the step holds.
    ///
    /// # Safety
    /// As [`crate::device::raw::append_batch`], with device addresses in `stream`'s
    /// context.
    pub unsafe fn append_batch(
        &self,
        stream: cudarc::driver::sys::CUstream,
        bp: &AppendBatchParams,
        ptrs: &launch::BatchPtrs,
    ) -> Result<()> {
        let (tok, flush) = launch::append_batch_entries(bp.append.format.head_dim)?;
        let (mut b, mut x) = (*bp, *ptrs);
        let mut args = [
            (&mut b as *mut AppendBatchParams).cast(),
            (&mut x.meta as *mut u64).cast(),
            (&mut x.tables as *mut u64).cast(),
            (&mut x.sides as *mut u64).cast(),
            (&mut x.pool as *mut u64).cast(),
            (&mut x.errors as *mut u64).cast(),
        ];
        // SAFETY: `append_batch_flush`'s parameters in order; forwarded contract.
        unsafe { self.launch(flush, stream, rotkv_kernels::append::batch_flush_grid(bp), BLOCK, 0, &mut args)? };
        let mut args = [
            (&mut b as *mut AppendBatchParams).cast(),
            (&mut x.meta as *mut u64).cast(),
            (&mut x.k as *mut u64).cast(),
            (&mut x.v as *mut u64).cast(),
            (&mut x.key_mean as *mut u64).cast(),
            (&mut x.key_scale as *mut u64).cast(),
            (&mut x.key_perm as *mut u64).cast(),
            (&mut x.value_perm as *mut u64).cast(),
            (&mut x.key_rot as *mut u64).cast(),
            (&mut x.value_rot as *mut u64).cast(),
            (&mut x.tables as *mut u64).cast(),
            (&mut x.protected as *mut u64).cast(),
            (&mut x.pool as *mut u64).cast(),
            (&mut x.sides as *mut u64).cast(),
            (&mut x.lens as *mut u64).cast(),
            (&mut x.errors as *mut u64).cast(),
        ];
        // SAFETY: `append_batch_tokens`'s parameters in order; forwarded contract.
        unsafe { self.launch(tok, stream, rotkv_kernels::append::batch_tokens_grid(bp), BLOCK, 0, &mut args) }
    }

    /// Enqueues `append_tokens` on `stream`, in launches of at most 65,535 tokens.
    ///
    /// # Safety
    /// As [`crate::device::raw::append_tokens`], with device addresses in `stream`'s
    /// context.
    pub unsafe fn append_tokens(
        &self,
        stream: cudarc::driver::sys::CUstream,
        p: &AppendParams,
        ptrs: &launch::AppendPtrs,
    ) -> Result<()> {
        let name = launch::append_entries(p.format.head_dim)?.0;
        for (first, mut cp) in launch::token_chunks(p) {
            let mut x = launch::chunk_ptrs(p, first, ptrs);
            let mut args = [
                (&mut cp as *mut AppendParams).cast(),
                (&mut x.k as *mut u64).cast(),
                (&mut x.v as *mut u64).cast(),
                (&mut x.key_mean as *mut u64).cast(),
                (&mut x.key_scale as *mut u64).cast(),
                (&mut x.key_perm as *mut u64).cast(),
                (&mut x.value_perm as *mut u64).cast(),
                (&mut x.key_rot as *mut u64).cast(),
                (&mut x.value_rot as *mut u64).cast(),
                (&mut x.block_table as *mut u64).cast(),
                (&mut x.protected as *mut u64).cast(),
                (&mut x.pool as *mut u64).cast(),
                (&mut x.side as *mut u64).cast(),
                (&mut x.seq_len as *mut u64).cast(),
            ];
            // SAFETY: `append_tokens`'s parameters in order; the chunk's inputs start
            // `first` tokens in; forwarded contract.
            unsafe { self.launch(name, stream, launch::tokens_grid(&cp), BLOCK, 0, &mut args)? };
        }
        Ok(())
    }
}

/// Runs the `rotkv_mma_selftest` kernel on `stream`'s device: 8 warps (2 blocks of 4),
/// each one `mma.sync.m16n8k16` on fragments packed by [`launch::MmaCase::pack`] from
/// random small-integer and f16-subnormal matrices, compared with the f32 product
/// exactly. The first check on a new GPU: it tells whether the fragment layout the
/// decode kernel relies on is the hardware's.
pub fn mma_selftest(stream: &Arc<CudaStream>) -> Result<()> {
    let kernels = Kernels::load(stream.context())?;
    let f = kernels.function("rotkv_mma_selftest")?;
    let cases: Vec<launch::MmaCase> = (0..8).map(launch::MmaCase::new).collect();
    let (a, b, c) = launch::mma_selftest_inputs(&cases);
    let up = err("upload");
    let (a_d, b_d, c_d) =
        (stream.clone_htod(&a).map_err(&up)?, stream.clone_htod(&b).map_err(&up)?, stream.clone_htod(&c).map_err(&up)?);
    let mut d_d = stream.alloc_zeros::<f32>(c.len()).map_err(err("alloc"))?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&a_d).arg(&b_d).arg(&c_d).arg(&mut d_d);
    // SAFETY: `mma_selftest`'s parameters in order; 8 warps, each with 32 * (4, 2, 4, 4)
    // elements of a, b, c, d.
    unsafe { lb.launch(launch_config_block([2, 1, 1], 128, 0)) }.map_err(err("rotkv_mma_selftest"))?;
    let d = stream.clone_dtoh(&d_d).map_err(err("download"))?;
    launch::mma_selftest_check(&cases, &d)
}

/// Runs the `rotkv_ldmatrix_selftest` kernel on `stream`'s device: one warp copies 32
/// host-given rows into shared memory with `cp.async`, retires them (`wait_group` and
/// `bar.warp.sync`) and reads them back with `ldmatrix` `x4` and `x2`, plain and
/// transposed; every register is compared with the PTX ISA layout
/// ([`launch::ldmatrix_selftest_check`]). The first check of the primitives of the
/// decode kernel's `cp.async` ring on a new GPU.
pub fn ldmatrix_selftest(stream: &Arc<CudaStream>) -> Result<()> {
    use rotkv_kernels::selftest::{LDMATRIX_ROWS, LDMATRIX_WORDS};
    let kernels = Kernels::load(stream.context())?;
    let f = kernels.function("rotkv_ldmatrix_selftest")?;
    let rows = launch::ldmatrix_selftest_rows();
    let rows_d = stream.clone_htod(&rows).map_err(err("upload"))?;
    let mut out_d = stream.alloc_zeros::<u32>(32 * LDMATRIX_WORDS).map_err(err("alloc"))?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&rows_d).arg(&mut out_d);
    // SAFETY: `ldmatrix_selftest`'s parameters in order: 512 bytes of rows (cudarc's
    // allocations are 256-byte aligned), 32 * 12 words of output; one warp with 512 bytes
    // of dynamic shared memory.
    unsafe { lb.launch(launch_config_block([1, 1, 1], 32, (LDMATRIX_ROWS * 16) as u32)) }
        .map_err(err("rotkv_ldmatrix_selftest"))?;
    let out = stream.clone_dtoh(&out_d).map_err(err("download"))?;
    launch::ldmatrix_selftest_check(&out)
}
