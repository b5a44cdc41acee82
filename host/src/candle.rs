//! candle tensors in and out of rotkv (feature `candle`, `candle-core` 0.11): through a
//! [`KvCache`] on the CPU, or as views of a device layer's memory (the device path).
//!
//! # Through a `KvCache` (CPU storage)
//!
//! [`append`] stores a layer's new keys and values given as candle [`Tensor`]s,
//! [`decode`] and [`decode_tokens`] run decode attention for query tensors and return the
//! output as a new tensor. They are [`KvCache::append`], [`KvCache::decode`] and
//! [`KvCache::decode_tokens`] with candle's shapes and dtypes checked and mapped; the
//! cache's backend ([`crate::Backend::Cpu`] for serving, [`crate::Backend::Reference`]
//! as the oracle) runs them, so a tensor round trip gives bit for bit what the same
//! slices give through the cache directly.
//!
//! - Keys and values: `[tokens, num_kv_heads, head_dim]`, both the same dtype.
//! - Queries: `[rows, num_q_heads, head_dim]` with `rows = seqs.len() * q_len`, the
//!   sequences' rows in the order of `seqs` (for [`decode`], `q_len = 1`: one row per
//!   sequence).
//! - Output: a new contiguous CPU tensor `[rows, num_q_heads, head_dim]` of the queries'
//!   dtype (computed in f32, then rounded to f16 or bf16 for those).
//! - Dtypes: f32, f16 or bf16.
//!
//! Tensors must have CPU storage. A contiguous tensor (any start offset, a narrowed
//! slice of a larger one) is read in place, without a copy; any other layout (a row
//! stride, as `qkv.narrow(1, ..)` of a fused projection gives, or a transposed view) is
//! first copied into a contiguous buffer. The output is always a new tensor.
//!
//! # The device path (features `sim` or `cuda`)
//!
//! `device_append`, `device_decode` and `with_tensor_view` take tensors as views of a
//! `rotkv::device::DeviceLayer`'s memory, **without a copy**:
//! `DeviceLayer::append_strided` and `DecodePlan::run_strided` on the tensor's own
//! storage, a row stride (a narrowed fused projection) passed to the kernels as their row
//! stride; K and V may have different row strides (each is the kernel's token stride for
//! that input). Rows must be contiguous (`[heads, head_dim]`); other layouts are an error
//! (call `.contiguous()` first).
//!
//! - On the emulated device (`Device::sim`), whose device memory is host memory, CPU
//!   tensors are the views: the whole device path runs, and is tested, without a GPU.
//! - On a GPU (feature `candle-cuda`: candle-core's `cuda`), CUDA tensors are the views:
//!   candle's `CudaSlice` address plus the layout's start offset. The tensor must be on
//!   the layer's CUDA context **and stream**: make the layer's device with
//!   `cuda_device(&candle_device)`, which uses candle's stream, so candle's ops and
//!   rotkv's launches are ordered on one stream with no synchronization. A tensor on
//!   another context or stream is an error. This code is compile-checked (`cargo xtask
//!   candle-cuda`) but **has not run on a GPU**.
//! - A CUDA tensor on a sim layer, a CPU tensor on a cuda layer, Metal storage, or CUDA
//!   storage in a build without `candle-cuda` is refused with [`Error::Unsupported`].
//!
//! The output of `device_decode` is a new tensor (one allocation per call: a `Vec` on
//! the emulator, a stream-ordered `alloc` of candle's device on a GPU); a stack
//! that wants no allocation per step decodes into its own device buffer through
//! `with_tensor_view`.
//!
//! The [`KvCache`] functions refuse non-CPU tensors with [`Error::Unsupported`].
//!
//! # Example
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use rotkv::{Backend, CacheConfig, CacheShape, KvCache};
//!
//! let shape = CacheShape { layers: 1, num_kv_heads: 2, num_q_heads: 4, max_seqs: 1, max_tokens: 256, num_blocks: None };
//! let mut cache = KvCache::new(CacheConfig::k2v2(64), shape, Backend::Cpu)?;
//! let seq = cache.add_sequence()?;
//! let k = Tensor::ones((10, 2, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
//! rotkv::candle::append(&mut cache, 0, seq, &k, &k)?; // 10 tokens
//! let q = Tensor::ones((1, 4, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
//! let out = rotkv::candle::decode(&cache, 0, &[seq], &q)?;
//! assert_eq!(out.dims(), &[1, 4, 64]);
//! // A query with the wrong number of heads is an error, not a panic.
//! let bad = Tensor::ones((1, 2, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
//! assert!(rotkv::candle::decode(&cache, 0, &[seq], &bad).is_err());
//! # Ok::<(), rotkv::Error>(())
//! ```

use crate::KvElement;
use crate::cache::{KvCache, SeqId};
use crate::error::{Error, Result};
use candle_core::{DType, DeviceLocation, Storage, Tensor, WithDType};
use half::{bf16, f16};

/// An element type both candle and rotkv read and write: f32, f16, bf16.
#[cfg(not(feature = "candle-cuda"))]
pub trait Elem: KvElement + crate::OutputElement + WithDType {}
/// An element type both candle and rotkv read and write: f32, f16, bf16.
#[cfg(feature = "candle-cuda")]
pub trait Elem:
    KvElement
    + crate::OutputElement
    + WithDType
    + candle_core::cuda::CudaDType
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
{
}
impl Elem for f32 {}
impl Elem for f16 {}
impl Elem for bf16 {}

/// Appends `k` and `v` (`[tokens, num_kv_heads, head_dim]`, f32, f16 or bf16, the same
/// dtype, CPU storage) to `seq` in `layer`: [`KvCache::append`] over the tensors'
/// elements. Contiguous tensors are read in place; others are copied first (see the
/// module documentation), after every check that reads no element (layer, sequence,
/// capacity), so that a refused append copies nothing.
///
/// # Errors
///
/// [`Error::Unsupported`] for a tensor that is not on the CPU (CUDA storage is not built,
/// see the module documentation), a dtype other than f32, f16 and bf16, or `k` and `v` of
/// different dtypes; [`Error::Shape`] for a rank other than 3, a head count or head_dim
/// other than the cache's, or `v` shaped unlike `k`; then every error of
/// [`KvCache::append`] (layer, sequence, capacity, non-finite values). On error the cache
/// is unchanged.
pub fn append(cache: &mut KvCache, layer: usize, seq: SeqId, k: &Tensor, v: &Tensor) -> Result<()> {
    let (hkv, d) = (cache.shape().num_kv_heads, cache.config().head_dim);
    check_location("k", k)?;
    check_location("v", v)?;
    let (tokens, dtype) = check_kv(k, v, hkv, d)?;
    // Everything that needs no element is checked before a strided tensor is copied: a
    // broadcast over a few bytes of storage can stand for gigabytes of rows.
    check_room(cache, layer, seq, tokens)?;
    match dtype {
        DType::F32 => append_as::<f32>(cache, layer, seq, tokens, k, v),
        DType::F16 => append_as::<f16>(cache, layer, seq, tokens, k, v),
        _ => append_as::<bf16>(cache, layer, seq, tokens, k, v),
    }
}

fn append_as<T: Elem>(
    cache: &mut KvCache,
    layer: usize,
    seq: SeqId,
    tokens: usize,
    k: &Tensor,
    v: &Tensor,
) -> Result<()> {
    with_elems::<T, _>("k", k, |k| with_elems::<T, _>("v", v, |v| cache.append(layer, seq, tokens, k, v)))
}

/// Decode attention in `layer` for one query token per sequence of `seqs`: `q` is
/// `[seqs.len(), num_q_heads, head_dim]` (f32, f16 or bf16, CPU storage); the output is a
/// new `[seqs.len(), num_q_heads, head_dim]` tensor of `q`'s dtype. [`KvCache::decode`]
/// over the tensor's elements.
///
/// # Errors
///
/// As [`decode_tokens`] with `q_len = 1`.
pub fn decode(cache: &KvCache, layer: usize, seqs: &[SeqId], q: &Tensor) -> Result<Tensor> {
    decode_tokens(cache, layer, seqs, 1, q)
}

/// Decode attention in `layer` for the last `q_len` tokens of every sequence of `seqs`
/// (see [`KvCache::decode_tokens`] for which positions each row attends to): `q` is
/// `[seqs.len() * q_len, num_q_heads, head_dim]` (f32, f16 or bf16, CPU storage), the
/// rows of `seqs[0]` first; the output is a new tensor of that shape and of `q`'s dtype.
///
/// # Errors
///
/// [`Error::Unsupported`] for a `q` that is not on the CPU (CUDA storage is not built,
/// see the module documentation) or of a dtype other than f32, f16 and bf16;
/// [`Error::Shape`] for a rank other than 3, a head count or head_dim other than the
/// cache's, or a row count other than `seqs.len() * q_len`; then every error of
/// [`KvCache::decode_tokens`] (layer, sequences, `q_len`, sequences shorter than
/// `q_len`).
pub fn decode_tokens(cache: &KvCache, layer: usize, seqs: &[SeqId], q_len: usize, q: &Tensor) -> Result<Tensor> {
    let (hq, d) = (cache.shape().num_q_heads, cache.config().head_dim);
    check_location("q", q)?;
    let rows = check_dims("q", q, hq, d, "num_q_heads")?;
    if seqs.len().checked_mul(q_len) != Some(rows) {
        return Err(Error::Shape(format!(
            "q has {rows} rows; {} sequences of {q_len} query tokens need {}",
            seqs.len(),
            seqs.len().saturating_mul(q_len)
        )));
    }
    // Checked before `q` is copied and the output allocated (as [`KvCache::decode_tokens`]
    // checks it): a broadcast `q` of a huge `q_len` stands for gigabytes of rows.
    if !(1..=crate::paged::MAX_Q_LEN).contains(&q_len) {
        let max = crate::paged::MAX_Q_LEN;
        return Err(Error::Shape(format!("q_len {q_len}: 1 to {max} query tokens per sequence")));
    }
    let dtype = elem_dtype("q", q)?;
    let mut out = vec![0f32; rows * hq * d];
    match dtype {
        DType::F32 => with_elems::<f32, _>("q", q, |q| cache.decode_tokens(layer, seqs, q_len, q, &mut out))?,
        DType::F16 => with_elems::<f16, _>("q", q, |q| cache.decode_tokens(layer, seqs, q_len, q, &mut out))?,
        _ => with_elems::<bf16, _>("q", q, |q| cache.decode_tokens(layer, seqs, q_len, q, &mut out))?,
    }
    let shape = (rows, hq, d);
    let dev = &candle_core::Device::Cpu;
    let t = match dtype {
        DType::F32 => Tensor::from_vec(out, shape, dev),
        DType::F16 => Tensor::from_vec(out.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), shape, dev),
        _ => Tensor::from_vec(out.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), shape, dev),
    };
    t.map_err(|e| Error::Shape(format!("candle output tensor: {e}")))
}

/// The checks every append makes of `k` and `v`: `[tokens, hkv, d]` each, the same shape
/// and one supported dtype. Returns the token count and the dtype.
fn check_kv(k: &Tensor, v: &Tensor, hkv: usize, d: usize) -> Result<(usize, DType)> {
    let tokens = check_dims("k", k, hkv, d, "num_kv_heads")?;
    if v.dims() != k.dims() {
        return Err(Error::Shape(format!("v has shape {:?}, k has {:?}: they must match", v.dims(), k.dims())));
    }
    let dtype = elem_dtype("k", k)?;
    if v.dtype() != dtype {
        return Err(Error::Unsupported(format!(
            "k is {} and v is {}: they must have the same dtype",
            dtype.as_str(),
            v.dtype().as_str()
        )));
    }
    Ok((tokens, dtype))
}

/// The checks of [`KvCache::append`] that read no element (layer, sequence, `max_tokens`,
/// free blocks), made before [`with_elems`] copies a strided tensor, so that an append
/// that cannot succeed copies nothing. [`KvCache::append`] makes them again.
fn check_room(cache: &KvCache, layer: usize, seq: SeqId, tokens: usize) -> Result<()> {
    let len = cache.len(layer, seq)?;
    let new_len = len.saturating_add(tokens);
    let max = cache.shape().max_tokens;
    if new_len > max {
        return Err(Error::Capacity(format!(
            "sequence {seq} would hold {new_len} tokens in layer {layer}; max_tokens is {max}"
        )));
    }
    // A sequence's block table holds the pages of its longest layer (tables only grow).
    let format = cache.config().format()?;
    let pages = |n: usize| u32::try_from(n).map_or(usize::MAX, |n| format.pages_for(n) as usize);
    let mut held = 0;
    for l in 0..cache.shape().layers {
        held = held.max(pages(cache.len(l, seq)?));
    }
    let need = pages(new_len).saturating_sub(held);
    if need > cache.free_blocks() {
        return Err(Error::Capacity(format!(
            "sequence {seq} needs {need} more blocks, {} are free",
            cache.free_blocks()
        )));
    }
    Ok(())
}

/// Refuses tensors whose storage is not on the CPU.
fn check_location(name: &str, t: &Tensor) -> Result<()> {
    location_supported(name, t.device().location())
}

fn location_supported(name: &str, loc: DeviceLocation) -> Result<()> {
    match loc {
        DeviceLocation::Cpu => Ok(()),
        DeviceLocation::Cuda { gpu_id } => Err(Error::Unsupported(format!(
            "{name} is on cuda:{gpu_id}: a KvCache takes CPU tensors; CUDA tensors go to a cuda \
             DeviceLayer through rotkv::candle::device_append/device_decode (feature `candle-cuda`)"
        ))),
        DeviceLocation::Metal { gpu_id } => {
            Err(Error::Unsupported(format!("{name} is on metal:{gpu_id}: a KvCache takes CPU tensors only")))
        }
    }
}

/// `t`'s dtype when rotkv reads it.
fn elem_dtype(name: &str, t: &Tensor) -> Result<DType> {
    match t.dtype() {
        d @ (DType::F32 | DType::F16 | DType::BF16) => Ok(d),
        other => Err(Error::Unsupported(format!("{name} has dtype {}; rotkv takes f32, f16 or bf16", other.as_str()))),
    }
}

/// Checks that `t` is `[n, heads, head_dim]` and returns `n`.
fn check_dims(name: &str, t: &Tensor, heads: usize, head_dim: usize, what: &str) -> Result<usize> {
    match *t.dims() {
        [n, h, dd] if h == heads && dd == head_dim => Ok(n),
        _ => Err(Error::Shape(format!(
            "{name} has shape {:?}; expected [_, {heads}, {head_dim}] ({what} {heads}, head_dim {head_dim})",
            t.dims()
        ))),
    }
}

/// Calls `f` with `t`'s elements in row-major order: the storage itself when `t` is
/// contiguous, else a copy. `t` is rank 3 on the CPU with dtype `T` (checked by the
/// callers; checked again here without panicking).
fn with_elems<T: Elem, R>(name: &str, t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return location_supported(name, t.device().location())
            .and_then(|()| Err(Error::Unsupported(format!("{name}: storage is not on the CPU"))));
    };
    let all = cpu.as_slice::<T>().map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
    let out_of_range = || Error::Shape(format!("{name}: its layout reaches past its storage"));
    if let Some((start, end)) = layout.contiguous_offsets() {
        return f(all.get(start..end).ok_or_else(out_of_range)?);
    }
    let ([n0, n1, n2], [s0, s1, s2]) = (layout.dims(), layout.stride()) else {
        return Err(Error::Shape(format!("{name} has shape {:?}; expected rank 3", layout.dims())));
    };
    let (n0, n1, n2, s0, s1, s2) = (*n0, *n1, *n2, *s0, *s1, *s2);
    let mut rows = Vec::with_capacity(n0 * n1 * n2);
    for i in 0..n0 {
        for j in 0..n1 {
            let base = layout.start_offset() + i * s0 + j * s1;
            if s2 == 1 {
                rows.extend_from_slice(all.get(base..base + n2).ok_or_else(out_of_range)?);
            } else {
                for c in 0..n2 {
                    rows.push(*all.get(base + c * s2).ok_or_else(out_of_range)?);
                }
            }
        }
    }
    drop(storage);
    f(&rows)
}

// ---------------------------------------------------------------------------------------
// The device path: tensors as views of a `DeviceLayer`'s device memory.

#[cfg(any(feature = "sim", feature = "cuda"))]
use crate::device::{DecodePlan, DeviceLayer, DeviceSlice, DeviceSliceMut};

/// Where a rank-3 `[n, heads, head_dim]` tensor's rows lie in its storage (elements).
#[cfg(any(feature = "sim", feature = "cuda"))]
#[derive(Clone, Copy, Debug)]
struct Rows {
    /// The first element.
    start: usize,
    /// Elements from one row (`[heads, head_dim]`) to the next.
    row_stride: usize,
    /// Elements from the first to one past the last: `(n - 1) * row_stride + heads *
    /// head_dim`.
    span: usize,
}

/// The row layout of `layout` (dims `[n, heads, head_dim]`, `n >= 1`, checked by the
/// callers): each row contiguous (head_dim stride 1, head stride head_dim), rows any
/// stride apart; checked to lie inside `storage_len` elements. Any other layout is an
/// error: the kernels take a row stride and nothing else.
#[cfg(any(feature = "sim", feature = "cuda"))]
fn rows_of(name: &str, layout: &candle_core::Layout, storage_len: usize) -> Result<Rows> {
    let (&[n, h, d], &[s0, s1, s2]) = (layout.dims(), layout.stride()) else {
        return Err(Error::Shape(format!("{name} has shape {:?}; expected rank 3", layout.dims())));
    };
    let row = h * d;
    if (d > 1 && s2 != 1) || (h > 1 && s1 != d) || (n > 1 && s0 < row) {
        return Err(Error::Shape(format!(
            "{name} has strides {:?} for shape {:?}: the device path takes rows of contiguous heads \
             (strides [row_stride >= {row}, {d}, 1], as a narrowed fused projection has); copy it \
             with .contiguous() first",
            layout.stride(),
            layout.dims()
        )));
    }
    let row_stride = if n > 1 { s0 } else { row };
    let start = layout.start_offset();
    let span = (n - 1).checked_mul(row_stride).and_then(|x| x.checked_add(row));
    match span.and_then(|sp| start.checked_add(sp).map(|end| (sp, end))) {
        Some((span, end)) if end <= storage_len => Ok(Rows { start, row_stride, span }),
        _ => Err(Error::Shape(format!("{name}: its layout reaches past its storage ({storage_len} elements)"))),
    }
}

/// Calls `f` with `t`'s rows as a view of `dev`'s memory and their row stride
/// (elements), without a copy: the primitive under [`device_append`] and
/// [`device_decode`], public for a stack that decodes into buffers it keeps
/// ([`DecodePlan::run_strided`] into a [`crate::device::DeviceBuffer`]: no allocation per
/// step, so the step can be captured in a CUDA graph).
///
/// - On the emulated device `t` must have CPU storage (its device memory is host
///   memory); on a cuda device, CUDA storage of the device's context and stream
///   (feature `candle-cuda`; see [`device_append`]).
/// - `t` is `[n >= 1, heads, head_dim]` (any heads and head_dim) of dtype `T`, each row
///   contiguous, rows any stride apart, any start offset.
///
/// The storage stays read-locked while `f` runs. On CUDA, `f` must enqueue its work on
/// the device's stream (the ops of `rotkv::device` do), and cudarc's event tracking
/// records the read when `f` returns.
///
/// # Errors
///
/// [`Error::Unsupported`] or [`Error::Device`] for a tensor on another device, or of
/// another dtype than `T`; [`Error::Shape`] for a rank other than 3, no rows, or another
/// layout; then `f`'s errors.
#[cfg(any(feature = "sim", feature = "cuda"))]
pub fn with_tensor_view<T: Elem, R>(
    dev: &crate::device::Device,
    name: &str,
    t: &Tensor,
    f: impl FnOnce(DeviceSlice<'_, T>, usize) -> Result<R>,
) -> Result<R> {
    check_view_location(name, t.device().location(), dev)?;
    let want = <T as WithDType>::DTYPE;
    if t.dtype() != want {
        return Err(Error::Unsupported(format!("{name} has dtype {}, not {}", t.dtype().as_str(), want.as_str())));
    }
    if t.dims().first() == Some(&0) {
        return Err(Error::Shape(format!("{name} has shape {:?}: no rows", t.dims())));
    }
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => {
            let all = cpu.as_slice::<T>().map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
            let r = rows_of(name, layout, all.len())?;
            let rows = &all[r.start..r.start + r.span];
            // SAFETY: on the emulator (checked by `check_view_location`) a device address
            // is a host address; `rows` is initialized memory of `T`, read-locked (candle
            // writes storage only under its write lock) and borrowed until `f` returns;
            // the emulator finishes every launch before returning, so nothing reads the
            // view afterwards.
            let view = unsafe { DeviceSlice::from_raw(dev, rows.as_ptr().expose_provenance() as u64, r.span)? };
            f(view, r.row_stride)
        }
        #[cfg(feature = "candle-cuda")]
        Storage::Cuda(cs) => {
            use cudarc::driver::{CudaSlice, DevicePtr};
            check_cuda_stream(name, cs, dev)?;
            let stream = layer_stream(dev)?;
            let slice: &CudaSlice<T> =
                cs.as_cuda_slice::<T>().map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
            let r = rows_of(name, layout, slice.len())?;
            let (ptr, _read) = slice.device_ptr(stream);
            // SAFETY: `ptr` is the start of `slice`, a live allocation of the layer's
            // context (`check_cuda_stream` compared contexts and streams), of
            // `slice.len() >= r.start + r.span` initialized elements (checked); the
            // storage is read-locked until `f` returns, and the work `f` enqueues on the
            // layer's stream, which is candle's stream for this tensor, is ordered before
            // any later write or free candle enqueues there (`_read` records the read on
            // the stream when it drops, after `f`).
            let view = unsafe { DeviceSlice::from_raw(dev, ptr + (r.start * size_of::<T>()) as u64, r.span)? };
            f(view, r.row_stride)
        }
        _ => Err(Error::Unsupported(format!("{name}: storage of another kind than the layer's device"))),
    }
}

/// The layer's stream (a cuda layer: checked by `check_view_location`).
#[cfg(feature = "candle-cuda")]
fn layer_stream(dev: &crate::device::Device) -> Result<&std::sync::Arc<cudarc::driver::CudaStream>> {
    dev.stream().ok_or_else(|| Error::Unsupported("a CUDA tensor on a layer that is not on a GPU".into()))
}

/// Whether a tensor at `loc` can be a view of `dev`'s memory: CPU tensors on the sim
/// device; CUDA tensors on a cuda device of the same context and stream (feature
/// `candle-cuda`).
#[cfg(any(feature = "sim", feature = "cuda"))]
fn check_view_location(name: &str, loc: DeviceLocation, dev: &crate::device::Device) -> Result<()> {
    match (loc, dev.is_sim()) {
        (DeviceLocation::Cpu, true) => Ok(()),
        (DeviceLocation::Cpu, false) => Err(Error::Unsupported(format!(
            "{name} is on the CPU but the layer is on a GPU: move it there first (Tensor::to_device), \
             or use rotkv::candle::append/decode with a KvCache"
        ))),
        (DeviceLocation::Cuda { gpu_id }, true) => Err(Error::Unsupported(format!(
            "{name} is on cuda:{gpu_id} but the layer is on the emulated (sim) device, which takes CPU tensors"
        ))),
        #[cfg(feature = "candle-cuda")]
        (DeviceLocation::Cuda { .. }, false) => Ok(()),
        #[cfg(not(feature = "candle-cuda"))]
        (DeviceLocation::Cuda { gpu_id }, false) => Err(Error::Unsupported(format!(
            "{name} is on cuda:{gpu_id}: CUDA tensors need rotkv's feature `candle-cuda` (candle-core's \
             `cuda`), which this build lacks"
        ))),
        (DeviceLocation::Metal { gpu_id }, _) => {
            Err(Error::Unsupported(format!("{name} is on metal:{gpu_id}: rotkv takes CPU or CUDA tensors")))
        }
    }
}

/// Checks that CUDA storage `cs` belongs to `dev`'s context and stream.
#[cfg(feature = "candle-cuda")]
fn check_cuda_stream(name: &str, cs: &candle_core::CudaStorage, dev: &crate::device::Device) -> Result<()> {
    let ours = layer_stream(dev)?;
    let theirs = cs.device.cuda_stream();
    if theirs.context().cu_ctx() != ours.context().cu_ctx() {
        return Err(Error::Device(format!(
            "{name} is on {:?}, a CUDA context other than the layer's: one DeviceLayer per GPU",
            cs.device
        )));
    }
    if theirs.cu_stream() != ours.cu_stream() {
        return Err(Error::Device(format!(
            "{name} is on candle's stream, the layer on another stream of the same GPU: make the layer's \
             Device with rotkv::candle::cuda_device(&candle_device) so both use candle's stream"
        )));
    }
    Ok(())
}

/// The rotkv [`crate::device::Device`] of a candle CUDA device: its GPU and **its
/// stream** (`CudaDevice::cuda_stream`), so rotkv's launches and candle's ops on the same
/// tensors are ordered on one stream with no synchronization. The device path refuses
/// CUDA tensors of a layer made on another stream. Loads rotkv's PTX into the context:
/// make one per candle device and share it.
///
/// # Errors
///
/// [`Error::Unsupported`] for a device that is not CUDA; every error of
/// [`crate::device::Device::cuda`].
#[cfg(feature = "candle-cuda")]
pub fn cuda_device(dev: &candle_core::Device) -> Result<crate::device::Device> {
    let cuda =
        dev.as_cuda_device().map_err(|_| Error::Unsupported(format!("{:?} is not a CUDA device", dev.location())))?;
    crate::device::Device::cuda(cuda.cuda_stream())
}

/// Appends `k` and `v` (`[tokens, num_kv_heads, head_dim]`, f32, f16 or bf16, the same
/// dtype; each at its own row stride) to `seq` of a device layer, reading the tensors in
/// place: [`DeviceLayer::append_strided`] on views of their storage, no copy. Returns the
/// new length.
///
/// - A sim layer takes CPU tensors (the emulator's device memory is host memory): the
///   whole device path, tested without a GPU.
/// - A cuda layer takes CUDA tensors of its own context **and stream** (feature
///   `candle-cuda`; make the layer's device with `cuda_device`), enqueued on that
///   stream with no synchronization.
///
/// Each row (`[num_kv_heads, head_dim]`) must be contiguous; rows may lie any stride
/// apart (`qkv.narrow(1, ..)` of a fused projection), and K's and V's strides may differ
/// (a RoPE'd contiguous `k` next to a `v` narrowed from the projection): each goes to
/// the kernel as that input's token stride. Any start offset is fine. Costs what
/// [`DeviceLayer::append_strided`] costs: launches, plus a 4-byte block-table upload when
/// the sequence takes a new page; no allocation.
///
/// # Errors
///
/// [`Error::Unsupported`] for a dtype other than f32, f16 and bf16, `k` and `v` of
/// different dtypes, or a tensor on another kind of device than the layer's (a CUDA
/// tensor on a sim layer, a CPU tensor on a cuda layer, Metal, CUDA without the
/// `candle-cuda` feature); [`Error::Device`] for a CUDA tensor of another context or
/// stream; [`Error::Shape`] for a rank other than 3, heads or head_dim other than the
/// layer's, `v` shaped unlike `k`, or a layout other than contiguous rows at a stride;
/// then every error of [`DeviceLayer::append_strided`].
/// On error nothing is enqueued and the layer is unchanged.
#[cfg(any(feature = "sim", feature = "cuda"))]
pub fn device_append(layer: &mut DeviceLayer, seq: SeqId, k: &Tensor, v: &Tensor) -> Result<usize> {
    let (hkv, d) = (layer.shape().num_kv_heads, layer.config().head_dim);
    let (tokens, dtype) = check_kv(k, v, hkv, d)?;
    if tokens == 0 {
        layer.len(seq)?;
        check_view_location("k", k.device().location(), layer.device())?;
        check_view_location("v", v.device().location(), layer.device())?;
        return layer.len(seq);
    }
    match dtype {
        DType::F32 => device_append_as::<f32>(layer, seq, tokens, k, v),
        DType::F16 => device_append_as::<f16>(layer, seq, tokens, k, v),
        _ => device_append_as::<bf16>(layer, seq, tokens, k, v),
    }
}

#[cfg(any(feature = "sim", feature = "cuda"))]
fn device_append_as<T: Elem>(
    layer: &mut DeviceLayer,
    seq: SeqId,
    tokens: usize,
    k: &Tensor,
    v: &Tensor,
) -> Result<usize> {
    // The views borrow the tensors, not the layer (a handle of its device is enough).
    let dev = layer.device().clone();
    with_tensor_view::<T, _>(&dev, "k", k, |kv, ks| {
        with_tensor_view::<T, _>(&dev, "v", v, |vv, vs| layer.append_strided(seq, tokens, &kv, ks, &vv, vs))
    })
}

/// Decode attention for the plan's slots (as [`DecodePlan::run`]): `q` is `[max_seqs *
/// q_len, num_q_heads, head_dim]` (f32, f16 or bf16; row `s * q_len + t` for token `t` of
/// slot `s`), read in place like [`device_append`]'s tensors (contiguous rows at any row
/// stride: `qkv.narrow(..)` works without a copy). Returns a new contiguous tensor of
/// that shape and `q`'s dtype on `q`'s device: a `Vec` wrapped as a CPU tensor on a sim
/// layer; on a cuda layer one `alloc` of candle's device per call (stream-ordered, no
/// synchronization, not zeroed: the merge kernel writes every element), wrapped as
/// candle CUDA storage. Everything is checked before the output is allocated; the decode
/// itself enqueues the plan's two launches and nothing else. For a step with no allocation at all (CUDA
/// graph capture), decode into a [`crate::device::DeviceBuffer`] the stack keeps:
/// [`DecodePlan::run_strided`] on the query view [`with_tensor_view`] lends.
///
/// # Errors
///
/// [`Error::Shape`] for a `q` of another shape or layout (see [`device_append`]), and
/// the errors of [`device_append`] for dtype and device; then every error of
/// [`DecodePlan::run_strided`]. On error nothing is enqueued.
#[cfg(any(feature = "sim", feature = "cuda"))]
pub fn device_decode(plan: &mut DecodePlan, layer: &DeviceLayer, q_len: usize, q: &Tensor) -> Result<Tensor> {
    let (hq, d) = (layer.shape().num_q_heads, layer.config().head_dim);
    let rows = check_dims("q", q, hq, d, "num_q_heads")?;
    let slots = plan.shape().max_seqs;
    if !(1..=plan.shape().max_q_len).contains(&q_len) {
        return Err(Error::Shape(format!("q_len {q_len}: the plan takes 1 to {}", plan.shape().max_q_len)));
    }
    if rows != slots * q_len {
        return Err(Error::Shape(format!(
            "q has {rows} rows; the plan's {slots} slots of {q_len} query tokens need {}",
            slots * q_len
        )));
    }
    match elem_dtype("q", q)? {
        DType::F32 => device_decode_as::<f32>(plan, layer, q_len, q),
        DType::F16 => device_decode_as::<f16>(plan, layer, q_len, q),
        _ => device_decode_as::<bf16>(plan, layer, q_len, q),
    }
}

#[cfg(any(feature = "sim", feature = "cuda"))]
fn device_decode_as<T: Elem>(plan: &mut DecodePlan, layer: &DeviceLayer, q_len: usize, q: &Tensor) -> Result<Tensor> {
    let (hq, d) = (layer.shape().num_q_heads, layer.config().head_dim);
    let rows = plan.shape().max_seqs * q_len;
    let n = rows * hq * d;
    let dev = layer.device();
    with_tensor_view::<T, _>(dev, "q", q, |qv, qs| {
        // Every check of the decode before the output is allocated: on error nothing is
        // allocated or enqueued.
        plan.check_run(layer, q_len, (qv.device_id(), qv.len(), qs), (qv.device_id(), n, hq * d))?;
        decode_into_new::<T>(plan, layer, q_len, q, qv, qs)
    })
}

/// The output tensor of [`device_decode`], allocated on `q`'s device after
/// [`DecodePlan::check_run`] passed, and the plan run into it.
#[cfg(any(feature = "sim", feature = "cuda"))]
fn decode_into_new<T: Elem>(
    plan: &mut DecodePlan,
    layer: &DeviceLayer,
    q_len: usize,
    q: &Tensor,
    qv: DeviceSlice<'_, T>,
    qs: usize,
) -> Result<Tensor> {
    let (hq, d) = (layer.shape().num_q_heads, layer.config().head_dim);
    let rows = plan.shape().max_seqs * q_len;
    let n = rows * hq * d;
    let dev = layer.device();
    match q.device() {
        candle_core::Device::Cpu => {
            let mut out = vec![T::from_f64(0.0); n];
            // SAFETY: the emulator (a CPU q passes `with_tensor_view`'s location check only
            // on a sim layer): `out` is host memory of `n` initialized `T`, borrowed mutably
            // until the plan's launches, which finish before `run_strided` returns.
            let mut ov = unsafe { DeviceSliceMut::<T>::from_raw(dev, out.as_mut_ptr().expose_provenance() as u64, n)? };
            plan.run_strided(layer, q_len, &qv, qs, &mut ov, hq * d)?;
            Tensor::from_vec(out, (rows, hq, d), &candle_core::Device::Cpu)
                .map_err(|e| Error::Shape(format!("candle output tensor: {e}")))
        }
        #[cfg(feature = "candle-cuda")]
        candle_core::Device::Cuda(cdev) => {
            use cudarc::driver::DevicePtrMut;
            let stream = layer_stream(dev)?;
            // SAFETY (of `alloc`): uninitialized device memory of `n` elements, never read
            // before the merge kernel writes every element of it (every row of every slot:
            // a free slot's rows are written as zeros) on the same stream.
            let mut out = unsafe { cdev.alloc::<T>(n) }.map_err(|e| Error::Backend(format!("candle alloc: {e}")))?;
            {
                let (ptr, _write) = out.device_ptr_mut(stream);
                // SAFETY: `out` is a fresh allocation of candle's device, the layer's
                // context and stream (checked by `with_tensor_view`), of `n` elements;
                // nobody else holds it.
                let mut ov = unsafe { DeviceSliceMut::<T>::from_raw(dev, ptr, n)? };
                plan.run_strided(layer, q_len, &qv, qs, &mut ov, hq * d)?;
            }
            let storage = Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(out, cdev.clone()));
            Ok(Tensor::from_storage(storage, (rows, hq, d), candle_core::op::BackpropOp::none(), false))
        }
        other => Err(Error::Unsupported(format!("q is on {:?}", other.location()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CUDA or Metal tensor cannot be made without a GPU, so the refusal is tested on
    /// its location.
    #[test]
    fn device_storage_is_refused_with_a_clear_error() {
        let e = location_supported("k", DeviceLocation::Cuda { gpu_id: 1 }).unwrap_err();
        assert!(matches!(&e, Error::Unsupported(m) if m.contains("cuda:1") && m.contains("device_append")), "{e}");
        let e = location_supported("q", DeviceLocation::Metal { gpu_id: 0 }).unwrap_err();
        assert!(matches!(&e, Error::Unsupported(m) if m.contains("metal:0")), "{e}");
        assert!(location_supported("v", DeviceLocation::Cpu).is_ok());
        // candle itself has no CUDA device in a build without its `cuda` feature.
        #[cfg(not(feature = "candle-cuda"))]
        assert!(candle_core::Device::new_cuda(0).is_err());
    }

    /// The device path on the emulated device takes CPU tensors only; the CUDA and Metal
    /// refusals are tested on their locations (no such tensor can be made here).
    #[cfg(feature = "sim")]
    #[test]
    fn device_path_location_rules_on_sim() {
        let dev = crate::device::Device::sim();
        assert!(check_view_location("k", DeviceLocation::Cpu, &dev).is_ok());
        let e = check_view_location("q", DeviceLocation::Cuda { gpu_id: 0 }, &dev).unwrap_err();
        assert!(matches!(&e, Error::Unsupported(m) if m.contains("cuda:0") && m.contains("sim")), "{e}");
        let e = check_view_location("v", DeviceLocation::Metal { gpu_id: 2 }, &dev).unwrap_err();
        assert!(matches!(&e, Error::Unsupported(m) if m.contains("metal:2")), "{e}");
    }
}
