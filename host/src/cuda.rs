//! The CUDA backend (feature `cuda`): the PTX committed in `host/ptx/rotkv.ptx`, embedded
//! in the library and loaded once per process on device 0 through cudarc. cudarc loads
//! the driver at run time, so this builds without a CUDA toolkit and a program that has
//! it still starts on a machine without a GPU ([`available`] is then false).
//!
//! This first version works on the host buffers of the paged API: each call uploads what
//! the kernels read and downloads what they write, through the launch planning of
//! [`crate::launch`] (the same the SIMT emulator checks). Device-resident pools are the
//! next step.

use crate::config::LayerCalibration;
use crate::error::{Error, Result};
use crate::launch::{self, BLOCK, DecodeInputs};
use crate::reference::SeqRef;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use half::f16;
use rotkv_kernels::layout::Format;
use rotkv_kernels::params::{AppendParams, DecodeParams, MergeParams};
use std::sync::{Arc, OnceLock};

/// The device code, as `cargo xtask ptx` wrote it.
pub static PTX: &str = include_str!("../ptx/rotkv.ptx");

/// A `#[repr(C)]` parameter block passed by value to a kernel.
#[repr(transparent)]
struct Arg<T>(T);
// SAFETY: the wrapped parameter blocks are `#[repr(C)]` plain data (u32 and f32 fields),
// laid out exactly as the PTX entry points declare them.
unsafe impl DeviceRepr for Arg<DecodeParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<MergeParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<AppendParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<Format> {}

struct Gpu {
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

static GPU: OnceLock<std::result::Result<Gpu, String>> = OnceLock::new();

fn gpu() -> Result<&'static Gpu> {
    GPU.get_or_init(|| {
        // SAFETY: only probes whether the driver library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no CUDA driver library on this machine".into());
        }
        let ctx = CudaContext::new(0).map_err(|e| format!("no CUDA device 0: {e:?}"))?;
        let module =
            ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).map_err(|e| format!("loading the PTX: {e:?}"))?;
        Ok(Gpu { stream: ctx.default_stream(), module })
    })
    .as_ref()
    .map_err(|e| Error::Backend(format!("cuda: {e}")))
}

/// Whether a CUDA driver and device are present (the PTX is loaded on first use).
pub fn available() -> bool {
    gpu().is_ok()
}

fn err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("cuda {what}: {e:?}"))
}

fn function(g: &Gpu, name: &str) -> Result<CudaFunction> {
    g.module.load_function(name).map_err(err(name))
}

fn config(grid: [u32; 3], shared: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid[0], grid[1], grid[2]), block_dim: (BLOCK, 1, 1), shared_mem_bytes: shared }
}

/// The `decode_split` entry point for a format, from the instantiation list.
fn decode_entry(fmt: &Format) -> Result<&'static str> {
    macro_rules! name {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal)),* $(,)?) => {
            match (fmt.head_dim, fmt.key_bits, fmt.value_bits) {
                $(($d, $kb, $vb) => Ok(stringify!($name)),)*
                other => Err(Error::Unsupported(format!("(head_dim, key bits, value bits) {other:?}"))),
            }
        };
    }
    rotkv_kernels::for_each_decode!(name)
}

/// The `decode_merge` entry point for a head dimension.
fn merge_entry(d: u32) -> Result<&'static str> {
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

/// The append entry points `(rotate, quantize 2-bit, quantize 4-bit)` for a head dimension.
fn append_entries(d: u32) -> Result<(&'static str, &'static str, &'static str)> {
    macro_rules! names {
        ($(($rot:ident, $q2:ident, $q4:ident, $d:literal, $v:literal)),* $(,)?) => {
            match d {
                $($d => Ok((stringify!($rot), stringify!($q2), stringify!($q4))),)*
                other => Err(Error::Unsupported(format!("head_dim {other}"))),
            }
        };
    }
    rotkv_kernels::for_each_append!(names)
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
    let (nm, no) = inputs.partial_lens();
    let alloc = err("alloc");
    let mut m_d = s.alloc_zeros::<f32>(nm).map_err(&alloc)?;
    let mut l_d = s.alloc_zeros::<f32>(nm).map_err(&alloc)?;
    let mut o_d = s.alloc_zeros::<f32>(no).map_err(&alloc)?;
    let mut out_d = s.alloc_zeros::<f32>(out.len()).map_err(&alloc)?;
    let split = function(g, decode_entry(&inputs.params.format)?)?;
    let params = Arg(inputs.params);
    let mut b = s.launch_builder(&split);
    b.arg(&params).arg(&q_d).arg(&pool_d).arg(&tables_d).arg(&lens_d).arg(&sides_d).arg(&perm_d);
    b.arg(&mut m_d).arg(&mut l_d).arg(&mut o_d);
    // SAFETY: the arguments match `decode_split`'s entry point in order and type; the
    // buffers have the sizes its `# Safety` section asks for (DecodeInputs checked them).
    unsafe { b.launch(config(inputs.split_grid(), inputs.split_shared_bytes())) }.map_err(err("decode_split"))?;
    let (mp, grid) = inputs.merge();
    let merge = function(g, merge_entry(mp.head_dim)?)?;
    let mp = Arg(mp);
    let mut b = s.launch_builder(&merge);
    b.arg(&mp).arg(&m_d).arg(&l_d).arg(&o_d).arg(&inv_d).arg(&mut out_d);
    // SAFETY: as above, for `decode_merge`.
    unsafe { b.launch(config(grid, 0)) }.map_err(err("decode_merge"))?;
    let host = s.clone_dtoh(&out_d).map_err(err("download"))?;
    out.copy_from_slice(&host);
    Ok(())
}

/// Appends `p.count` tokens on the GPU: `append_rotate`, then `append_quantize` for the
/// keys and the values of the pages that fill; the rows that stay in f16 go to the side
/// store on the host.
pub fn append_cuda(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    k: &[f32],
    v: &[f32],
) -> Result<()> {
    let g = gpu()?;
    let s = &g.stream;
    let fmt = p.format;
    let (rot, q2, q4) = append_entries(fmt.head_dim)?;
    let up = err("upload");
    let mut staged = vec![0u16; launch::staged_len(p)];
    if p.count > 0 {
        let (k_d, v_d, mean_d) =
            (s.clone_htod(k).map_err(&up)?, s.clone_htod(v).map_err(&up)?, s.clone_htod(&calib.key_mean).map_err(&up)?);
        let (kp_d, vp_d) = (s.clone_htod(&calib.key_perm).map_err(&up)?, s.clone_htod(&calib.value_perm).map_err(&up)?);
        let mut staged_d = s.alloc_zeros::<u16>(staged.len()).map_err(err("alloc"))?;
        let f = function(g, rot)?;
        let params = Arg(*p);
        let mut b = s.launch_builder(&f);
        b.arg(&params).arg(&k_d).arg(&v_d).arg(&mean_d).arg(&kp_d).arg(&vp_d).arg(&mut staged_d);
        // SAFETY: arguments in the order and types of `append_rotate`'s entry point; the
        // paged layer checked the inputs' sizes; `staged` has staged_len elements.
        unsafe { b.launch(config(launch::rotate_grid(p), 0)) }.map_err(err(rot))?;
        staged = s.clone_dtoh(&staged_d).map_err(err("download"))?;
    }
    let mut pool_d = s.clone_htod(&*pool).map_err(&up)?;
    let mut quantized = false;
    for value in [false, true] {
        let (rows, slots) = launch::quantize_jobs(p, side, &staged, block_table, value);
        let jobs = (slots.len() / 3) as u32;
        if jobs == 0 {
            continue;
        }
        quantized = true;
        let (rows_d, slots_d) = (s.clone_htod(&rows).map_err(&up)?, s.clone_htod(&slots).map_err(&up)?);
        let f = function(g, if fmt.bits(value) == 2 { q2 } else { q4 })?;
        let (fa, hkv, vflag) = (Arg(fmt), p.num_kv_heads, value as u32);
        let mut b = s.launch_builder(&f);
        b.arg(&fa).arg(&hkv).arg(&vflag).arg(&rows_d).arg(&slots_d).arg(&mut pool_d);
        // SAFETY: arguments in the order and types of `append_quantize`'s entry point;
        // every job's block is in the pool (the paged layer checked the block table).
        unsafe { b.launch(config([jobs, 1, 1], 0)) }.map_err(err("append_quantize"))?;
    }
    if quantized {
        let host = s.clone_dtoh(&pool_d).map_err(err("download"))?;
        pool.copy_from_slice(&host);
    }
    launch::store_f16_rows(p, side, &staged);
    Ok(())
}
