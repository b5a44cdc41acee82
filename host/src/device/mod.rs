//! Device-resident storage and decode (features `sim`, `cuda`): the API a serving stack
//! on a GPU uses.
//!
//! - [`Device`]: where buffers live and kernels run: `Device::sim` (feature `sim`: the SIMT emulator,
//!   its "device memory" host memory behind the same types; it counts every allocation,
//!   copy, synchronization and launch, see [`Device::counters`]) or `Device::cuda` (a
//!   caller-made `Arc<CudaStream>` of cudarc 0.19; the PTX is loaded once per device
//!   handle, in that stream's context).
//! - [`DeviceBuffer`]: a typed device allocation (16-byte aligned).
//! - [`DeviceSlice`] / [`DeviceSliceMut`]: borrowed views of device memory, lent by a
//!   [`DeviceBuffer`] (`as_slice`, `as_slice_mut`) or made from a raw address of memory
//!   a stack owns (`unsafe fn from_raw`; `rotkv::candle` makes them from candle tensors).
//!   The ops take either ([`AsDeviceSlice`], [`AsDeviceSliceMut`]).
//! - [`DeviceLayer`]: one layer's cache (or one tensor-parallel shard of it: the shard's
//!   KV and query heads) in device memory, allocated once: the page pool, one side-store
//!   slot per sequence slot, the block tables, the sequence lengths, the protected lists
//!   and the calibration. [`DeviceLayer::append`] reads K/V from device buffers or views
//!   at a row stride; [`DeviceLayer::append_strided`] gives K and V each their own row
//!   stride (K in a fused QKV row, V contiguous: no copy).
//! - [`DecodePlan`]: a decode launch fixed for a batch shape (sequence slots, most query
//!   tokens, longest context, multiprocessors): grid, split count and partials workspace
//!   are chosen once, and one plan serves every layer of the same format and heads;
//!   [`DecodePlan::run`] (every slot the same number of rows) and
//!   [`DecodePlan::run_batch`] (each sequence its rows of a step) read the current
//!   lengths on the device and launch the same grid every step, with no allocation,
//!   copy or synchronization.
//! - [`StepBatch`]: the new tokens of one serving step (which slot each input row belongs
//!   to, each slot's start and count), set once per step and read on the device by
//!   [`DeviceLayer::append_batch`] (every sequence's tokens in two launches, blocks
//!   reserved ahead with [`DeviceLayer::reserve`]) and [`DecodePlan::run_batch`] of every
//!   layer, or by [`DecodePlan::run_step`], which does both in the batch's passes
//!   ([`StepBatch::with_passes`]: a prompt chunk of any length sees its own earlier
//!   tokens in f16): a whole step is a fixed launch list (decode tokens, prompt chunks
//!   and idle sequences alike), which a CUDA graph can capture.
//! - [`raw`]: the same operations on raw device addresses, `unsafe`, for stacks that
//!   own their buffers.
//!
//! # The batch
//!
//! A sequence of a layer lives in slot `SeqId::slot` (the lowest free slot when it is
//! added; its id also carries the slot's generation, so a freed id is refused). A plan
//! for `max_seqs` sequences decodes slots `0 .. max_seqs` every step: for
//! [`DecodePlan::run`], queries and outputs are `[max_seqs][q_len][num_q_heads][head_dim]`,
//! row block `s` belonging to slot `s`, a free slot's rows zero; for
//! [`DecodePlan::run_batch`], one row per input row of the step batch. A changing batch
//! is sequences added and freed between steps. The layers of a model add and free their
//! sequences in the same order, so a request has the same slot in each.
//!
//! # What is checked where
//!
//! Everything the host knows is checked before anything is enqueued, with an [`Error`]:
//! shapes, buffer sizes, capacities (pool blocks, sequence slots, tokens per sequence,
//! the plan's slots and context against every live sequence), sequence ids, strides,
//! the step batch against each layer's lengths. What only the device holds (the values of
//! K, V and queries) is not checked: a NaN or infinity there makes every output row that
//! can see it NaN (never a finite wrong row), and what the device alone could get wrong
//! (a block-table entry past the pool, a step batch that contradicts itself, through the
//! raw entry points) is clamped or skipped and counted ([`StepBatch::errors`]), never an
//! access outside the buffers.
//!
//! # Copies
//!
//! A step ([`DeviceLayer::append_batch`] and [`DecodePlan::run_batch`] per layer)
//! launches four kernels per layer and nothing else; its only upload, before it, is the
//! step batch ([`StepBatch::set`], one for all layers). The per-sequence
//! [`DeviceLayer::append`] launches `append_flush` (when a page of the window fills) and
//! `append_tokens`; the kernels find every token's place from the block table and
//! protected list already on the device and store the new length there, so its only
//! upload is the block-table entry of a page the sequence takes (4 bytes, once per
//! `page_size` tokens, none for reserved pages), on the same stream, with no
//! synchronization.

mod buffer;
mod layer;
mod plan;
pub mod raw;
mod step;

pub use buffer::{AsDeviceSlice, AsDeviceSliceMut, DeviceBuffer, DeviceSlice, DeviceSliceMut};
pub use layer::{DeviceLayer, LayerSize};
pub use plan::{DecodePlan, PlanShape};
pub use step::{BatchErrors, StepBatch};

use crate::config::{CacheConfig, LayerCalibration};
use crate::error::{Error, Result};
use crate::launch::{self, AppendPtrs, DecodePtrs, FlushPtrs, MergePtrs};
use crate::paged::{LayerShape, MAX_Q_LEN};

/// Most passes of one step ([`StepBatch::with_passes`]).
pub const MAX_PASSES: usize = 64;
use crate::{KvElement, OutputElement, SeqId};
use bytemuck::Pod;
use rotkv_kernels::decode::MAX_GROUP;
use rotkv_kernels::layout::Format;
use rotkv_kernels::params::{AppendParams, DecodeParams, MergeParams};
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// What a [`Device`] has done since it was made: the test of "nothing per step".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Device allocations.
    pub allocations: usize,
    /// Host-to-device copies.
    pub uploads: usize,
    /// Device-to-host copies.
    pub downloads: usize,
    /// Host waits for the stream.
    pub synchronizations: usize,
    /// Kernel launches.
    pub launches: usize,
    /// Device-to-device copies ([`Device::copy`]).
    pub device_copies: usize,
}

#[derive(Default)]
struct Stats {
    allocations: AtomicUsize,
    uploads: AtomicUsize,
    downloads: AtomicUsize,
    synchronizations: AtomicUsize,
    launches: AtomicUsize,
    device_copies: AtomicUsize,
}

fn bump(c: &AtomicUsize) {
    c.fetch_add(1, Ordering::Relaxed);
}

enum Kind {
    #[cfg(feature = "sim")]
    Sim,
    #[cfg(feature = "cuda")]
    Cuda { stream: Arc<cudarc::driver::CudaStream>, kernels: crate::cuda::Kernels, sms: usize },
}

struct Inner {
    kind: Kind,
    stats: Stats,
    id: u64,
    /// The launches enqueued while recording ([`Device::record_launches`]).
    log: std::sync::Mutex<Option<Vec<LaunchRecord>>>,
}

/// One kernel launch as a [`Device`] enqueued it: what a captured CUDA graph replays.
/// Recorded while [`Device::record_launches`] is on (sim and cuda alike), so a test can
/// check that every step of a serving loop enqueues the same list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchRecord {
    /// The PTX entry point.
    pub kernel: &'static str,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// The kernel's arguments: its parameter block as 32-bit words, then every device
    /// address it gets.
    pub args: Vec<u64>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Set in the owner field of a [`DeviceLayer`]'s [`SeqId`]s, so that no id of a
/// `KvCache` (whose identities count from 1 without it) names a device layer.
const LAYER_ID_TAG: u64 = 1 << 63;

/// A device and the stream its work is enqueued on (cheap to clone: a shared handle).
#[derive(Clone)]
pub struct Device(Arc<Inner>);

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("kind", &self.name()).field("counters", &self.counters()).finish()
    }
}

impl Device {
    fn new(kind: Kind) -> Self {
        Device(Arc::new(Inner {
            kind,
            stats: Stats::default(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            log: std::sync::Mutex::new(None),
        }))
    }

    /// The emulated device: buffers in host memory, kernels on the SIMT emulator,
    /// [`crate::sim::SIM_SMS`] multiprocessors.
    #[cfg(feature = "sim")]
    pub fn sim() -> Self {
        Self::new(Kind::Sim)
    }

    /// The GPU of `stream`'s context; everything is enqueued on `stream`. Loads the PTX
    /// into that context (once per `Device`; make one per context and share it).
    #[cfg(feature = "cuda")]
    pub fn cuda(stream: Arc<cudarc::driver::CudaStream>) -> Result<Self> {
        // SAFETY: the built-in PTX is this build's device code.
        unsafe { Self::cuda_with_ptx(stream, crate::cuda::PTX) }
    }

    /// [`Device::cuda`] with other device code than the built-in [`crate::cuda::PTX`]:
    /// for side-by-side benchmarks of kernel revisions in one process (`gpu_decode
    /// --ptx`). The PTX must come from `cargo xtask ptx` of a revision with this build's
    /// entry points and parameter blocks; anything else is undefined behaviour on the
    /// device, which is why the built-in code is what [`Device::cuda`] loads.
    ///
    /// # Safety
    /// `ptx` declares this build's entry points with this build's parameter lists and
    /// honours their contracts (the PTX of `cargo xtask ptx` at a revision whose
    /// `rotkv_kernels::params` and kernel signatures equal this build's).
    #[cfg(feature = "cuda")]
    pub unsafe fn cuda_with_ptx(stream: Arc<cudarc::driver::CudaStream>, ptx: &str) -> Result<Self> {
        let ctx = stream.context();
        let kernels = crate::cuda::Kernels::load_ptx(ctx, ptx)?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| Error::Backend(format!("cuda: multiprocessor count: {e:?}")))?
            .max(1) as usize;
        Ok(Self::new(Kind::Cuda { stream, kernels, sms }))
    }

    /// Whether this is the emulated device (its addresses are host addresses).
    pub fn is_sim(&self) -> bool {
        match &self.0.kind {
            #[cfg(feature = "sim")]
            Kind::Sim => true,
            #[cfg(feature = "cuda")]
            Kind::Cuda { .. } => false,
        }
    }

    /// `sim` or `cuda`.
    pub fn name(&self) -> &'static str {
        match &self.0.kind {
            #[cfg(feature = "sim")]
            Kind::Sim => "sim",
            #[cfg(feature = "cuda")]
            Kind::Cuda { .. } => "cuda",
        }
    }

    /// Multiprocessors (what a [`DecodePlan`] fills by default).
    pub fn sm_count(&self) -> usize {
        match &self.0.kind {
            #[cfg(feature = "sim")]
            Kind::Sim => crate::sim::SIM_SMS,
            #[cfg(feature = "cuda")]
            Kind::Cuda { sms, .. } => *sms,
        }
    }

    /// Blocks of the decode launch `l` that one multiprocessor holds at once: the
    /// driver's occupancy calculation for the entry point on a GPU (registers, shared
    /// memory, block size); on the emulator `rotkv::sim::SIM_RESIDENT_BLOCKS`.
    pub fn resident_blocks(&self, fmt: &Format, l: &launch::DecodeLaunch) -> Result<usize> {
        match &self.0.kind {
            #[cfg(feature = "sim")]
            Kind::Sim => {
                let _ = (fmt, l);
                Ok(crate::sim::SIM_RESIDENT_BLOCKS)
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda { kernels, .. } => {
                kernels.resident_blocks(launch::decode_entry(fmt, l.kernel)?, l.block, l.shared)
            }
        }
    }

    /// The stream (cuda only).
    #[cfg(feature = "cuda")]
    pub fn stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.0.kind {
            Kind::Cuda { stream, .. } => Some(stream),
            #[cfg(feature = "sim")]
            Kind::Sim => None,
        }
    }

    /// Starts (`true`, with an empty list) or stops recording every kernel launch this
    /// handle enqueues ([`LaunchRecord`]): the check that a step's launch list is fixed
    /// (what a CUDA graph captures) before capturing it.
    pub fn record_launches(&self, on: bool) {
        let mut log = self.0.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *log = on.then(Vec::new);
    }

    /// The launches recorded since the last call (or since recording started); recording
    /// goes on. Empty when not recording.
    pub fn take_launches(&self) -> Vec<LaunchRecord> {
        let mut log = self.0.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn log_launch(&self, kernel: &'static str, grid: [u32; 3], args: Vec<u64>) {
        let mut log = self.0.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(l) = log.as_mut() {
            l.push(LaunchRecord { kernel, grid, args });
        }
    }

    /// What this device has done so far.
    pub fn counters(&self) -> Counters {
        let s = &self.0.stats;
        let get = |c: &AtomicUsize| c.load(Ordering::Relaxed);
        Counters {
            allocations: get(&s.allocations),
            uploads: get(&s.uploads),
            downloads: get(&s.downloads),
            synchronizations: get(&s.synchronizations),
            launches: get(&s.launches),
            device_copies: get(&s.device_copies),
        }
    }

    /// A zeroed buffer of `len` elements.
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::Capacity(format!("a buffer of {len} elements")))?
            .max(1);
        bump(&self.0.stats.allocations);
        let mem = match &self.0.kind {
            #[cfg(feature = "sim")]
            Kind::Sim => Mem::Host(host_zeroed(bytes.div_ceil(16))?),
            #[cfg(feature = "cuda")]
            Kind::Cuda { stream, .. } => {
                Mem::Cuda(stream.alloc_zeros::<u8>(bytes).map_err(|e| Error::Backend(format!("cuda alloc: {e:?}")))?)
            }
        };
        let addr = match &mem {
            #[cfg(feature = "sim")]
            Mem::Host(m) => crate::sim::addr(m.as_ptr()),
            #[cfg(feature = "cuda")]
            Mem::Cuda(m) => {
                use cudarc::driver::DevicePtr;
                m.device_ptr(m.stream()).0
            }
        };
        Ok(DeviceBuffer { mem, len, addr, device: self.0.id, _t: PhantomData })
    }

    /// A buffer holding a copy of `host`.
    pub fn upload<T: Pod>(&self, host: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = self.alloc(host.len())?;
        self.write(&mut b, 0, host)?;
        Ok(b)
    }

    fn check_buffer<T>(&self, b: &DeviceBuffer<T>, what: &str) -> Result<()> {
        if b.device != self.0.id {
            return Err(Error::Device(format!("{what} belongs to another device handle")));
        }
        Ok(())
    }

    fn check_view(&self, device: u64, what: &str) -> Result<()> {
        if device != self.0.id {
            return Err(Error::Device(format!("{what} belongs to another device handle")));
        }
        Ok(())
    }

    /// Copies `host` into `buf` from element `at` on (enqueued on the stream; `host` is
    /// read before this returns).
    pub fn write<T: Pod>(&self, buf: &mut DeviceBuffer<T>, at: usize, host: &[T]) -> Result<()> {
        self.check_buffer(buf, "the buffer")?;
        if at.checked_add(host.len()).is_none_or(|end| end > buf.len) {
            return Err(Error::Shape(format!("{} elements at {at} into a buffer of {}", host.len(), buf.len)));
        }
        if host.is_empty() {
            return Ok(());
        }
        bump(&self.0.stats.uploads);
        let src: &[u8] = bytemuck::cast_slice(host);
        let start = at * size_of::<T>();
        match (&self.0.kind, &mut buf.mem) {
            #[cfg(feature = "sim")]
            (Kind::Sim, Mem::Host(m)) => {
                bytemuck::cast_slice_mut::<u128, u8>(m)[start..start + src.len()].copy_from_slice(src);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Kind::Cuda { stream, .. }, Mem::Cuda(m)) => stream
                .memcpy_htod(src, &mut m.slice_mut(start..start + src.len()))
                .map_err(|e| Error::Backend(format!("cuda upload: {e:?}"))),
            #[allow(unreachable_patterns)]
            _ => Err(Error::Device("buffer of another kind of device".into())),
        }
    }

    /// Copies elements `at .. at + host.len()` of `buf` into `host` and waits for it.
    ///
    /// # Errors
    /// [`Error::Device`] for a buffer of another device; [`Error::Shape`] for a range past
    /// the buffer's end.
    pub fn read_at<T: Pod>(&self, buf: &DeviceBuffer<T>, at: usize, host: &mut [T]) -> Result<()> {
        self.check_buffer(buf, "the buffer")?;
        let end = at.checked_add(host.len()).filter(|&e| e <= buf.len);
        let Some(end) = end else {
            return Err(Error::Shape(format!("reading {} elements at {at} from {}", host.len(), buf.len)));
        };
        if host.is_empty() {
            return Ok(());
        }
        bump(&self.0.stats.downloads);
        let dst: &mut [u8] = bytemuck::cast_slice_mut(host);
        let (start, stop) = (at * size_of::<T>(), end * size_of::<T>());
        match (&self.0.kind, &buf.mem) {
            #[cfg(feature = "sim")]
            (Kind::Sim, Mem::Host(m)) => {
                dst.copy_from_slice(&bytemuck::cast_slice::<u128, u8>(m)[start..stop]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Kind::Cuda { stream, .. }, Mem::Cuda(m)) => {
                stream
                    .memcpy_dtoh(&m.slice(start..stop), dst)
                    .map_err(|e| Error::Backend(format!("cuda download: {e:?}")))?;
                self.synchronize()
            }
            #[allow(unreachable_patterns)]
            _ => Err(Error::Device("buffer of another kind of device".into())),
        }
    }

    /// Copies `buf` into `host` (same length) and waits for it.
    pub fn read<T: Pod>(&self, buf: &DeviceBuffer<T>, host: &mut [T]) -> Result<()> {
        self.check_buffer(buf, "the buffer")?;
        if host.len() != buf.len {
            return Err(Error::Shape(format!("reading {} elements into {}", buf.len, host.len())));
        }
        bump(&self.0.stats.downloads);
        let dst: &mut [u8] = bytemuck::cast_slice_mut(host);
        match (&self.0.kind, &buf.mem) {
            #[cfg(feature = "sim")]
            (Kind::Sim, Mem::Host(m)) => {
                dst.copy_from_slice(&bytemuck::cast_slice::<u128, u8>(m)[..dst.len()]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Kind::Cuda { stream, .. }, Mem::Cuda(m)) => {
                let n = dst.len();
                stream.memcpy_dtoh(&m.slice(..n), dst).map_err(|e| Error::Backend(format!("cuda download: {e:?}")))?;
                self.synchronize()
            }
            #[allow(unreachable_patterns)]
            _ => Err(Error::Device("buffer of another kind of device".into())),
        }
    }

    /// Copies `src` into `dst` on the device (same length).
    pub fn copy<T: Pod>(&self, src: &DeviceBuffer<T>, dst: &mut DeviceBuffer<T>) -> Result<()> {
        self.check_buffer(src, "the source")?;
        self.check_buffer(dst, "the destination")?;
        if src.len != dst.len {
            return Err(Error::Shape(format!("copying {} elements into {}", src.len, dst.len)));
        }
        bump(&self.0.stats.device_copies);
        let n = src.len * size_of::<T>();
        match (&self.0.kind, &src.mem, &mut dst.mem) {
            #[cfg(feature = "sim")]
            (Kind::Sim, Mem::Host(a), Mem::Host(b)) => {
                let a = &bytemuck::cast_slice::<u128, u8>(a)[..n];
                bytemuck::cast_slice_mut::<u128, u8>(b)[..n].copy_from_slice(a);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Kind::Cuda { stream, .. }, Mem::Cuda(a), Mem::Cuda(b)) => stream
                .memcpy_dtod(&a.slice(..n), &mut b.slice_mut(..n))
                .map_err(|e| Error::Backend(format!("cuda copy: {e:?}"))),
            #[allow(unreachable_patterns)]
            _ => Err(Error::Device("buffer of another kind of device".into())),
        }
    }

    /// Copies elements `[from, from + n)` of `buf` to `[to, to + n)` on the device (the
    /// ranges must not overlap).
    fn copy_within<T: Pod>(&self, buf: &mut DeviceBuffer<T>, from: usize, to: usize, n: usize) -> Result<()> {
        self.check_buffer(buf, "the buffer")?;
        let inside = |a: usize| a.checked_add(n).is_some_and(|e| e <= buf.len);
        if !inside(from) || !inside(to) || from.abs_diff(to) < n {
            return Err(Error::Shape(format!("copying {n} elements from {from} to {to} in a buffer of {}", buf.len)));
        }
        bump(&self.0.stats.device_copies);
        let bytes = n * size_of::<T>();
        match &self.0.kind {
            #[cfg(feature = "sim")]
            Kind::Sim => {
                // (Irrefutable when the crate is built without `cuda`.)
                #[allow(irrefutable_let_patterns)]
                let Mem::Host(m) = &mut buf.mem else { return Err(Error::Device("buffer of another kind".into())) };
                let b = bytemuck::cast_slice_mut::<u128, u8>(m);
                let (f, t) = (from * size_of::<T>(), to * size_of::<T>());
                b.copy_within(f..f + bytes, t);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            // SAFETY: both ranges are inside `buf` (checked above), a live allocation of
            // this device's context; the copy is ordered on its stream.
            Kind::Cuda { stream, .. } => unsafe {
                cudarc::driver::result::memcpy_dtod_async(buf.addr_at(to), buf.addr_at(from), bytes, stream.cu_stream())
            }
            .map_err(|e| Error::Backend(format!("cuda copy: {e:?}"))),
        }
    }

    /// Median seconds per call of `f` (which enqueues work) over `iters` calls after
    /// `warmup`: timed on the stream with CUDA events on a GPU (each call between two
    /// events), by the wall clock on the emulator.
    pub fn time(&self, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        for _ in 0..warmup {
            f()?;
        }
        let mut times = Vec::with_capacity(iters.max(1));
        for _ in 0..iters.max(1) {
            match &self.0.kind {
                #[cfg(feature = "sim")]
                Kind::Sim => {
                    let t = std::time::Instant::now();
                    f()?;
                    times.push(t.elapsed().as_secs_f64());
                }
                #[cfg(feature = "cuda")]
                Kind::Cuda { stream, .. } => {
                    let e = |e| Error::Backend(format!("cuda event: {e:?}"));
                    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                    let start = stream.record_event(timing).map_err(e)?;
                    f()?;
                    let end = stream.record_event(timing).map_err(e)?;
                    end.synchronize().map_err(e)?;
                    times.push(start.elapsed_ms(&end).map_err(e)? as f64 / 1e3);
                }
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Waits for the stream's work.
    pub fn synchronize(&self) -> Result<()> {
        bump(&self.0.stats.synchronizations);
        match &self.0.kind {
            #[cfg(feature = "sim")]
            Kind::Sim => Ok(()),
            #[cfg(feature = "cuda")]
            Kind::Cuda { stream, .. } => {
                stream.synchronize().map_err(|e| Error::Backend(format!("cuda synchronize: {e:?}")))
            }
        }
    }
}

/// `n` zeroed `u128` in host memory (the emulator's device memory), fallibly: a size
/// the allocator refuses is [`Error::Capacity`], not an abort. Zeroed pages are mapped
/// lazily, as `cudaMalloc`'s are.
#[cfg(feature = "sim")]
fn host_zeroed(n: usize) -> Result<Vec<u128>> {
    let refused = || Error::Capacity(format!("{n} x 16 bytes of emulated device memory"));
    let layout = std::alloc::Layout::array::<u128>(n.max(1)).map_err(|_| refused())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u128>();
    if ptr.is_null() {
        return Err(refused());
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `[u128;
    // n.max(1)]` (the layout a Vec of that capacity has), and all of it is initialized
    // (zero is a valid u128).
    Ok(unsafe { Vec::from_raw_parts(ptr, n.max(1), n.max(1)) })
}

enum Mem {
    #[cfg(feature = "sim")]
    Host(Vec<u128>),
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaSlice<u8>),
}
