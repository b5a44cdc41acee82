//! candle tensors in and out of a [`KvCache`] (feature `candle`, `candle-core` 0.11).
//!
//! [`append`] stores a layer's new keys and values given as candle [`Tensor`]s,
//! [`decode`] and [`decode_tokens`] run decode attention for query tensors and return the
//! output as a new tensor. They are [`KvCache::append`], [`KvCache::decode`] and
//! [`KvCache::decode_tokens`] with candle's shapes and dtypes checked and mapped; the
//! cache's backend ([`crate::Backend::Cpu`] for serving, [`crate::Backend::Reference`]
//! as the oracle) runs them, so a tensor round trip gives bit for bit what the same
//! slices give through the cache directly.
//!
//! # Shapes and dtypes
//!
//! - Keys and values: `[tokens, num_kv_heads, head_dim]`, both the same dtype.
//! - Queries: `[rows, num_q_heads, head_dim]` with `rows = seqs.len() * q_len`, the
//!   sequences' rows in the order of `seqs` (for [`decode`], `q_len = 1`: one row per
//!   sequence).
//! - Output: a new contiguous CPU tensor `[rows, num_q_heads, head_dim]` of the queries'
//!   dtype (computed in f32, then rounded to f16 or bf16 for those).
//! - Dtypes: f32, f16 or bf16.
//!
//! # Storage: CPU only
//!
//! Tensors must have CPU storage. A contiguous tensor (any start offset, a narrowed
//! slice of a larger one) is read in place, without a copy; any other layout (a row
//! stride, as `qkv.narrow(1, ..)` of a fused projection gives, or a transposed view) is
//! first copied into a contiguous buffer. The output is always a new tensor.
//!
//! candle's CUDA storage is **not supported in this build**: a tensor on a CUDA device is
//! refused with [`Error::Unsupported`]. The zero-copy path (wrapping candle's
//! `CudaSlice`s into `rotkv::device`) needs candle-core's `cuda` feature, whose
//! candle-kernels are compiled with `nvcc` at build time and link `libcudart`; it is not
//! built here (see the README's "candle" section). Metal storage is refused the same way.
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

/// An element type both candle and rotkv read: f32, f16, bf16.
trait Elem: KvElement + WithDType {}
impl Elem for f32 {}
impl Elem for f16 {}
impl Elem for bf16 {}

/// Appends `k` and `v` (`[tokens, num_kv_heads, head_dim]`, f32, f16 or bf16, the same
/// dtype, CPU storage) to `seq` in `layer`: [`KvCache::append`] over the tensors'
/// elements. Contiguous tensors are read in place; others are copied first (see the
/// module documentation).
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

/// Refuses tensors whose storage is not on the CPU.
fn check_location(name: &str, t: &Tensor) -> Result<()> {
    location_supported(name, t.device().location())
}

fn location_supported(name: &str, loc: DeviceLocation) -> Result<()> {
    match loc {
        DeviceLocation::Cpu => Ok(()),
        DeviceLocation::Cuda { gpu_id } => Err(Error::Unsupported(format!(
            "{name} is on cuda:{gpu_id}: the CUDA-storage path of rotkv::candle is not built (it needs \
             candle-core's `cuda` feature, see the README's \"candle\" section); use CPU tensors, or \
             rotkv::device with DeviceBuffers"
        ))),
        DeviceLocation::Metal { gpu_id } => {
            Err(Error::Unsupported(format!("{name} is on metal:{gpu_id}: rotkv::candle takes CPU tensors only")))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A CUDA or Metal tensor cannot be made in this build (candle without `cuda`), so the
    /// refusal is tested on its location.
    #[test]
    fn device_storage_is_refused_with_a_clear_error() {
        let e = location_supported("k", DeviceLocation::Cuda { gpu_id: 1 }).unwrap_err();
        assert!(matches!(&e, Error::Unsupported(m) if m.contains("cuda:1") && m.contains("not built")), "{e}");
        let e = location_supported("q", DeviceLocation::Metal { gpu_id: 0 }).unwrap_err();
        assert!(matches!(&e, Error::Unsupported(m) if m.contains("metal:0")), "{e}");
        assert!(location_supported("v", DeviceLocation::Cpu).is_ok());
        // candle itself has no CUDA device here.
        assert!(candle_core::Device::new_cuda(0).is_err());
    }
}
