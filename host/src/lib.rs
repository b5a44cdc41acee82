//! rotkv: a 2-bit KV cache with Hadamard rotations, and decode attention that reads the
//! packed cache directly. A token costs 72 bytes per KV head at head_dim 128 (k2v2)
//! instead of 512 in bf16.
//!
//! # Where to start
//!
//! - **A serving stack on the CPU, or a first try:** [`KvCache`] with a preset
//!   ([`CacheConfig::k2v2`], [`CacheConfig::k4v2`], [`CacheConfig::k4v4`]): add a
//!   sequence, append keys and values, decode queries, free it (example below). Calibration
//!   ([`LayerCalibration`], [`KvCache::set_calibration`]) buys most of the accuracy.
//! - **A stack that owns its memory:** [`paged`]: the same append and decode over
//!   caller-owned page pools, block tables and side stores ([`paged::PoolBuffer`] gives an
//!   aligned pool); decode takes a sliding window ([`paged::DecodeOptions::window_left`],
//!   FlashInfer's convention; [`KvCache::set_window_left`] per layer).
//! - **On a GPU:** `device` (features `cuda` for a GPU, `sim` for the emulated one with the
//!   same types): a layer's cache in device memory (`device::DeviceLayer`), a fixed decode
//!   plan (`device::DecodePlan`) and a whole serving step as one launch list
//!   (`device::StepBatch`, `device::DecodePlan::run_step`: batched append, chunked
//!   prefill and decode in passes) on the caller's stream, ready for CUDA-graph capture;
//!   raw entry points below it. It has run on an H200 (the device and step tests, a step
//!   replayed as a CUDA graph), except `run_step`'s passes (tested on the emulator).
//! - **candle:** `candle` (feature `candle`): append and decode over candle `Tensor`s,
//!   through a [`KvCache`] (CPU storage) or, with `sim` or `cuda`, on the device path
//!   without copies.
//! - **Measuring a model:** `model` (feature `model`): GGUF models on the CPU through the
//!   cache, perplexity, calibration; the `rotkv` program (feature `cli`) drives it.
//!
//! Underneath: [`backend`] holds the host-memory backends behind the paged API,
//! [`reference`](mod@reference) (the scalar f64 oracle), [`cpu`] (the fast CPU backend),
//! `sim` (the device kernels on the SIMT emulator) and `cuda` (the PTX through cudarc;
//! over host buffers a test path); [`launch`] is the launch planning the device backends
//! share. Every call validates its inputs and returns an [`Error`] that says what was
//! wrong; a failed call changes nothing.
//!
//! The book in the repository's `docs/` (`cargo xtask docs --serve`) has the details: the
//! byte format (`docs/src/format.md`), accuracy and the recommended recipes
//! (`docs/src/accuracy.md`), the device API (`docs/src/device-api.md`), the CPU backend's
//! benchmarks (`docs/src/cpu.md`) and the GPU kernels (`docs/src/gpu.md`).
//!
//! # Example
//!
//! ```
//! use rotkv::{Backend, CacheConfig, CacheShape, KvCache};
//!
//! // SmolLM2-135M's attention shape: 3 KV heads, 9 query heads, head_dim 64.
//! let config = CacheConfig::k2v2(64);
//! let shape = CacheShape { layers: 2, num_kv_heads: 3, num_q_heads: 9, max_seqs: 4, max_tokens: 1024, num_blocks: None };
//! let mut cache = KvCache::new(config, shape, Backend::auto())?;
//! let seq = cache.add_sequence()?;
//!
//! // Prefill 300 tokens ([token][kv_head][head_dim]; f32, f16 or bf16), then one more.
//! let k: Vec<f32> = (0..301 * 3 * 64).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
//! let v: Vec<f32> = k.iter().map(|x| 0.5 * x).collect();
//! for layer in 0..2 {
//!     cache.append(layer, seq, 300, &k[..300 * 192], &v[..300 * 192])?;
//!     cache.append(layer, seq, 1, &k[300 * 192..], &v[300 * 192..])?;
//! }
//!
//! // Decode one query token per sequence: q and out are [seqs][q_heads][head_dim].
//! let q = vec![0.1f32; 9 * 64];
//! let mut out = vec![0f32; 9 * 64];
//! cache.decode(1, &[seq], &q, &mut out)?;
//! assert!(out.iter().all(|x| x.is_finite()));
//! assert_eq!(cache.len(1, seq)?, 301);
//! cache.free_sequence(seq)?;
//! # Ok::<(), rotkv::Error>(())
//! ```

pub mod backend;
pub mod cache;
#[cfg(feature = "candle")]
pub mod candle;
pub mod config;
#[cfg(any(feature = "sim", feature = "cuda"))]
pub mod device;
pub mod error;
#[cfg(feature = "eval")]
pub mod eval;
pub mod launch;
#[cfg(feature = "model")]
pub mod model;
pub mod paged;

#[cfg(feature = "cuda")]
pub use backend::cuda;
#[cfg(feature = "sim")]
pub use backend::sim;
pub use backend::{cpu, reference};

pub use cache::{CacheShape, KvCache, SeqId};
pub use config::{CacheConfig, HeadRotation, LayerCalibration, Rotation};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use rotkv_kernels::layout::Format;
pub use rotkv_kernels::{CONFIGS as SUPPORTED, FORMAT_VERSION};

/// Where append and decode run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The scalar f64 reference (slow; the oracle).
    Reference,
    /// The fast multi-threaded CPU implementation.
    Cpu,
    /// The device kernels run by the SIMT emulator (feature `sim`; slow, for tests).
    #[cfg(feature = "sim")]
    Sim,
    /// The device kernels on an NVIDIA GPU over host buffers (feature `cuda`; needs a
    /// driver and a device at run time, see [`Backend::available`]). Every call uploads
    /// the pool and side stores and downloads the result: for conformance tests only,
    /// never chosen by [`Backend::auto`]. Serving on a GPU uses `rotkv::device`.
    #[cfg(feature = "cuda")]
    Cuda,
}

impl Backend {
    /// The backend for [`KvCache`] and [`paged`] on host buffers: always
    /// [`Backend::Cpu`]. `Backend::Cuda` (feature `cuda`) on host buffers uploads the whole pool per
    /// call (a conformance-test path, chosen only by name); the GPU API is
    /// `rotkv::device` (features `sim`/`cuda`), whose cache stays in device memory.
    pub fn auto() -> Self {
        Backend::Cpu
    }
    /// Whether this backend can run here (only `cuda` can be missing: no driver or no
    /// device).
    pub fn available(self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            Backend::Cuda => cuda::available(),
            _ => true,
        }
    }
    /// Every backend this build has (see [`Backend::available`] for which can run here).
    pub fn all() -> &'static [Backend] {
        &[
            Backend::Reference,
            Backend::Cpu,
            #[cfg(feature = "sim")]
            Backend::Sim,
            #[cfg(feature = "cuda")]
            Backend::Cuda,
        ]
    }
    /// Short name: `reference`, `cpu`, `sim`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Reference => "reference",
            Backend::Cpu => "cpu",
            #[cfg(feature = "sim")]
            Backend::Sim => "sim",
            #[cfg(feature = "cuda")]
            Backend::Cuda => "cuda",
        }
    }
    /// Parses a name of [`Backend::name`], or `auto`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(Self::auto()),
            "reference" => Ok(Backend::Reference),
            "cpu" => Ok(Backend::Cpu),
            #[cfg(feature = "sim")]
            "sim" => Ok(Backend::Sim),
            #[cfg(feature = "cuda")]
            "cuda" => Ok(Backend::Cuda),
            other => Err(Error::Backend(format!(
                "{other:?} (this build has: auto, {})",
                Backend::all().iter().map(|b| b.name()).collect::<Vec<_>>().join(", ")
            ))),
        }
    }
}

/// The seal of [`KvElement`]: the fast paths read an element by its `DTYPE`, so only the
/// three types whose layout that code names may implement it.
mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An input element type: f32, f16 or bf16 (sealed: the backends read elements by their
/// `DTYPE`, so no other type may claim one).
pub trait KvElement: bytemuck::Pod + Send + Sync + sealed::Sealed {
    /// The `DTYPE_*` code the device kernels read it by.
    const DTYPE: u32;
    /// The value as f32.
    fn to_f32(self) -> f32;
    /// `dst = src` as f32 (same length); batched where the type allows.
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}

impl KvElement for f32 {
    const DTYPE: u32 = rotkv_kernels::params::DTYPE_F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}
impl KvElement for f16 {
    const DTYPE: u32 = rotkv_kernels::params::DTYPE_F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}
impl KvElement for bf16 {
    const DTYPE: u32 = rotkv_kernels::params::DTYPE_BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// An element type the device decode writes its output in: f32, f16 or bf16 (rounded to
/// nearest even from the f32 result).
pub trait OutputElement: bytemuck::Pod {
    /// The `decode_merge` flag that selects it (`FLAG_OUTPUT_*`, 0 for f32).
    const FLAG: u32;
}
impl OutputElement for f32 {
    const FLAG: u32 = 0;
}
impl OutputElement for f16 {
    const FLAG: u32 = rotkv_kernels::params::FLAG_OUTPUT_F16;
}
impl OutputElement for bf16 {
    const FLAG: u32 = rotkv_kernels::params::FLAG_OUTPUT_BF16;
}

/// Both output-type flags of `decode_merge` (the device backends set them).
#[cfg(any(feature = "sim", feature = "cuda"))]
pub(crate) const OUTPUT_FLAGS: u32 = rotkv_kernels::params::FLAG_OUTPUT_F16 | rotkv_kernels::params::FLAG_OUTPUT_BF16;
