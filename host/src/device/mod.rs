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

pub mod raw;

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

/// `len` elements of `T` in a [`Device`]'s memory, 16-byte aligned, zeroed when made.
pub struct DeviceBuffer<T> {
    mem: Mem,
    len: usize,
    /// The address of element 0, taken once at allocation (no driver call per step).
    addr: u64,
    device: u64,
    _t: PhantomData<T>,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer<{}>({} elements at {:#x})", std::any::type_name::<T>(), self.len, self.addr())
    }
}

impl<T> DeviceBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address of element 0 (a `CUdeviceptr` on a GPU; a host address on the
    /// emulator), for the [`raw`] entry points.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// The device address of element `i`.
    fn addr_at(&self, i: usize) -> u64 {
        self.addr() + (i * size_of::<T>()) as u64
    }
}

impl<T> DeviceBuffer<T> {
    /// The whole buffer as a borrowed view (what [`DeviceLayer::append`] and
    /// [`DecodePlan::run`] read).
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice { addr: self.addr, len: self.len, device: self.device, _t: PhantomData }
    }
    /// The whole buffer as a borrowed writable view (what [`DecodePlan::run`] writes).
    pub fn as_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        DeviceSliceMut { addr: self.addr, len: self.len, device: self.device, _t: PhantomData }
    }
    /// Elements `range` of the buffer as a borrowed view (row `i` of a packed batch,
    /// say); [`Error::Shape`] for a range outside the buffer.
    pub fn slice(&self, range: impl std::ops::RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        self.as_slice().slice(range)
    }
    /// Elements `range` of the buffer as a borrowed writable view; [`Error::Shape`] for a
    /// range outside the buffer.
    pub fn slice_mut(&mut self, range: impl std::ops::RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (start, end) = sub_range(self.len, range)?;
        Ok(DeviceSliceMut {
            addr: self.addr + (start * size_of::<T>()) as u64,
            len: end - start,
            device: self.device,
            _t: PhantomData,
        })
    }
}

/// `range` of `len` elements as `(start, end)`, or [`Error::Shape`] when it is not inside.
fn sub_range(len: usize, range: impl std::ops::RangeBounds<usize>) -> Result<(usize, usize)> {
    use std::ops::Bound;
    let start = match range.start_bound() {
        Bound::Included(&a) => Some(a),
        Bound::Excluded(&a) => a.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&b) => b.checked_add(1),
        Bound::Excluded(&b) => Some(b),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(a), Some(b)) if a <= b && b <= len => Ok((a, b)),
        _ => Err(Error::Shape(format!(
            "elements {:?} .. {:?} of a device view of {len}",
            range.start_bound(),
            range.end_bound()
        ))),
    }
}

/// `len` elements of `T` in a [`Device`]'s memory, borrowed for `'a`: a [`DeviceBuffer`]
/// ([`DeviceBuffer::as_slice`]) or memory a stack owns ([`DeviceSlice::from_raw`]; a
/// candle tensor's storage, see `rotkv::candle`). Read by the kernels; cheap to copy.
pub struct DeviceSlice<'a, T> {
    addr: u64,
    len: usize,
    device: u64,
    _t: PhantomData<&'a [T]>,
}

impl<T> Clone for DeviceSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DeviceSlice<'_, T> {}

/// `len` elements of `T` in a [`Device`]'s memory, borrowed exclusively for `'a`: a
/// [`DeviceBuffer`] ([`DeviceBuffer::as_slice_mut`]) or memory a stack owns
/// ([`DeviceSliceMut::from_raw`]). Written by the kernels.
pub struct DeviceSliceMut<'a, T> {
    addr: u64,
    len: usize,
    device: u64,
    _t: PhantomData<&'a mut [T]>,
}

/// Checks what [`DeviceSlice::from_raw`] can check: a non-null address aligned for `T`
/// and a byte length that fits the address space.
fn check_raw<T>(addr: u64, len: usize) -> Result<()> {
    if addr == 0 {
        return Err(Error::Shape("a device view at address 0".into()));
    }
    if !addr.is_multiple_of(align_of::<T>() as u64) {
        return Err(Error::Shape(format!(
            "a device view of {} at {addr:#x}: not aligned to {} bytes",
            std::any::type_name::<T>(),
            align_of::<T>()
        )));
    }
    let bytes = len.checked_mul(size_of::<T>()).and_then(|b| u64::try_from(b).ok());
    if bytes.is_none_or(|b| addr.checked_add(b).is_none()) {
        return Err(Error::Capacity(format!("a device view of {len} elements at {addr:#x}")));
    }
    Ok(())
}

impl<'a, T> DeviceSlice<'a, T> {
    /// A view of `len` elements of `T` at device address `addr` of `device` (a
    /// `CUdeviceptr` on a GPU; a host address, as `ptr.expose_provenance()` gives, on
    /// the emulator).
    ///
    /// # Errors
    ///
    /// [`Error::Shape`] for address 0 or an address not aligned to `align_of::<T>()`
    /// (the kernels read K, V and queries element by element, so element alignment is
    /// what they need; the 16-byte alignment of the pool and side stores concerns only
    /// the layer's own buffers); [`Error::Capacity`] for a length past the address space.
    ///
    /// # Safety
    ///
    /// For all of `'a`: `addr .. addr + len * size_of::<T>()` lies in one live allocation
    /// of `device` (of its CUDA context on a GPU; on the emulator, host memory that is
    /// valid for reads), holds initialized `T`s, and nothing writes it while work that
    /// reads this view may run (on a GPU: until that work on the device's stream is done,
    /// which the caller orders against its own streams).
    pub unsafe fn from_raw(device: &Device, addr: u64, len: usize) -> Result<Self> {
        check_raw::<T>(addr, len)?;
        Ok(Self { addr, len, device: device.0.id, _t: PhantomData })
    }
    /// Elements `range` of this view; [`Error::Shape`] for a range outside it.
    pub fn slice(&self, range: impl std::ops::RangeBounds<usize>) -> Result<DeviceSlice<'a, T>> {
        let (start, end) = sub_range(self.len, range)?;
        Ok(DeviceSlice {
            addr: self.addr + (start * size_of::<T>()) as u64,
            len: end - start,
            device: self.device,
            _t: PhantomData,
        })
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address of element 0.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// The identity of the device handle it belongs to (read by the candle adapter).
    #[cfg(feature = "candle")]
    pub(crate) fn device_id(&self) -> u64 {
        self.device
    }
}

impl<'a, T> DeviceSliceMut<'a, T> {
    /// A writable view of `len` elements of `T` at device address `addr` of `device`
    /// (as [`DeviceSlice::from_raw`]).
    ///
    /// # Errors
    ///
    /// As [`DeviceSlice::from_raw`].
    ///
    /// # Safety
    ///
    /// As [`DeviceSlice::from_raw`], and the memory is valid for writes, and nothing else
    /// reads or writes it while work that writes this view may run.
    pub unsafe fn from_raw(device: &Device, addr: u64, len: usize) -> Result<Self> {
        check_raw::<T>(addr, len)?;
        Ok(Self { addr, len, device: device.0.id, _t: PhantomData })
    }
    /// Elements `range` of this view, borrowed from it; [`Error::Shape`] for a range
    /// outside it.
    pub fn slice_mut(&mut self, range: impl std::ops::RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (start, end) = sub_range(self.len, range)?;
        Ok(DeviceSliceMut {
            addr: self.addr + (start * size_of::<T>()) as u64,
            len: end - start,
            device: self.device,
            _t: PhantomData,
        })
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address of element 0.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// A read-only view of the same elements, borrowing this one.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice { addr: self.addr, len: self.len, device: self.device, _t: PhantomData }
    }
}

impl<T> std::fmt::Debug for DeviceSlice<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceSlice<{}>({} elements at {:#x})", std::any::type_name::<T>(), self.len, self.addr)
    }
}

impl<T> std::fmt::Debug for DeviceSliceMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceSliceMut<{}>({} elements at {:#x})", std::any::type_name::<T>(), self.len, self.addr)
    }
}

/// What [`DeviceLayer::append`] and [`DecodePlan::run`] read: a [`DeviceBuffer`], a
/// [`DeviceSlice`] or a [`DeviceSliceMut`].
pub trait AsDeviceSlice {
    /// The element type.
    type Elem;
    /// The elements as a view.
    fn device_slice(&self) -> DeviceSlice<'_, Self::Elem>;
}

/// What [`DecodePlan::run`] writes: a [`DeviceBuffer`] or a [`DeviceSliceMut`].
pub trait AsDeviceSliceMut {
    /// The element type.
    type Elem;
    /// The elements as a writable view.
    fn device_slice_mut(&mut self) -> DeviceSliceMut<'_, Self::Elem>;
}

impl<T> AsDeviceSlice for DeviceBuffer<T> {
    type Elem = T;
    fn device_slice(&self) -> DeviceSlice<'_, T> {
        self.as_slice()
    }
}

impl<T> AsDeviceSlice for DeviceSlice<'_, T> {
    type Elem = T;
    fn device_slice(&self) -> DeviceSlice<'_, T> {
        *self
    }
}

impl<T> AsDeviceSlice for DeviceSliceMut<'_, T> {
    type Elem = T;
    fn device_slice(&self) -> DeviceSlice<'_, T> {
        self.as_slice()
    }
}

impl<T> AsDeviceSliceMut for DeviceBuffer<T> {
    type Elem = T;
    fn device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        self.as_slice_mut()
    }
}

impl<T> AsDeviceSliceMut for DeviceSliceMut<'_, T> {
    type Elem = T;
    fn device_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        DeviceSliceMut { addr: self.addr, len: self.len, device: self.device, _t: PhantomData }
    }
}

/// Sizes of a [`DeviceLayer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSize {
    /// Sequence slots (sequences live at once).
    pub max_seqs: usize,
    /// Tokens one sequence may hold.
    pub max_tokens: usize,
    /// Blocks in the page pool; `None` gives every slot room for `max_tokens`.
    pub num_blocks: Option<usize>,
}

#[derive(Clone, Debug)]
struct SeqState {
    id: SeqId,
    table: Vec<u32>,
    len: usize,
    protected: Vec<u32>,
}

/// One layer's cache, or one tensor-parallel shard of it, in device memory (see the
/// module documentation).
pub struct DeviceLayer {
    device: Device,
    config: CacheConfig,
    fmt: Format,
    shape: LayerShape,
    calib: LayerCalibration,
    size: LayerSize,
    max_blocks: usize,
    pool: DeviceBuffer<u8>,
    sides: DeviceBuffer<u16>,
    tables: DeviceBuffer<u32>,
    lens: DeviceBuffer<u32>,
    protected: DeviceBuffer<u32>,
    key_mean: DeviceBuffer<f32>,
    key_scale: DeviceBuffer<f32>,
    key_perm: DeviceBuffer<u16>,
    value_perm: DeviceBuffer<u16>,
    vperm_inv: DeviceBuffer<u16>,
    key_rot: DeviceBuffer<f32>,
    value_rot: DeviceBuffer<f32>,
    num_blocks: usize,
    seqs: Vec<Option<SeqState>>,
    generations: Vec<u64>,
    free_blocks: Vec<u32>,
    id: u64,
}

impl std::fmt::Debug for DeviceLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLayer")
            .field("device", &self.device)
            .field("shape", &self.shape)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl DeviceLayer {
    /// Allocates a layer (or shard: `shape` has the shard's heads) on `device` with the
    /// calibration `calib` (`[num_kv_heads]` of the shard). Everything is allocated here.
    pub fn new(
        device: &Device,
        config: CacheConfig,
        shape: LayerShape,
        calib: LayerCalibration,
        size: LayerSize,
    ) -> Result<Self> {
        let fmt = config.format()?;
        launch::check_format(&fmt)?;
        shape.check()?;
        let (hkv, hq, d) = (shape.num_kv_heads, shape.num_q_heads, config.head_dim);
        if hq / hkv > MAX_GROUP {
            return Err(Error::Unsupported(format!(
                "{hq} query heads for {hkv} KV heads on the device kernels (at most {MAX_GROUP} per KV head)"
            )));
        }
        calib.check_orthogonal(hkv, d)?;
        if size.max_seqs == 0 || size.max_tokens == 0 {
            return Err(Error::Shape(format!("max_seqs and max_tokens must be positive: {size:?}")));
        }
        if size.max_seqs > launch::MAX_GRID_YZ as usize {
            return Err(Error::Capacity(format!(
                "{} sequence slots (the grid allows {})",
                size.max_seqs,
                launch::MAX_GRID_YZ
            )));
        }
        if size.max_tokens > u32::MAX as usize / 2 {
            return Err(Error::Capacity(format!("max_tokens {} is past the format's limit", size.max_tokens)));
        }
        let max_blocks = fmt.pages_for(size.max_tokens as u32) as usize;
        let num_blocks = size.num_blocks.unwrap_or(max_blocks.saturating_mul(size.max_seqs));
        launch::check_pool_blocks(&fmt, num_blocks)?;
        let np = (fmt.protected as usize).max(1);
        let too_big = |what: &str| Error::Capacity(format!("the layer's {what} for {size:?} overflows usize"));
        let pool_bytes = num_blocks
            .checked_mul(hkv)
            .and_then(|x| x.checked_mul(fmt.page_bytes() as usize))
            .ok_or_else(|| too_big("page pool"))?;
        let side = fmt.side_elems(hkv as u32);
        let sides_len = size.max_seqs.checked_mul(side).ok_or_else(|| too_big("side stores"))?;
        let tables_len = size.max_seqs.checked_mul(max_blocks.max(1)).ok_or_else(|| too_big("block tables"))?;
        let rot = |r: &Option<Vec<f32>>| device.upload(r.as_deref().unwrap_or(&[0.0]));
        Ok(Self {
            pool: device.alloc(pool_bytes)?,
            sides: device.alloc(sides_len)?,
            tables: device.alloc(tables_len)?,
            lens: device.alloc(size.max_seqs)?,
            protected: device.upload(&vec![u32::MAX; size.max_seqs * np])?,
            key_mean: device.upload(&calib.key_mean)?,
            key_scale: device.upload(&calib.key_scale)?,
            key_perm: device.upload(&calib.key_perm)?,
            value_perm: device.upload(&calib.value_perm)?,
            vperm_inv: device.upload(&calib.value_perm_inverse(d))?,
            key_rot: rot(&calib.key_rotation)?,
            value_rot: rot(&calib.value_rotation)?,
            num_blocks,
            device: device.clone(),
            config,
            fmt,
            shape,
            calib,
            size,
            max_blocks,
            seqs: vec![None; size.max_seqs],
            generations: vec![0; size.max_seqs],
            free_blocks: (0..num_blocks as u32).rev().collect(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Its configuration (head_dim, bits, format).
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }
    /// The layer's (shard's) heads.
    pub fn shape(&self) -> LayerShape {
        self.shape
    }
    /// Its sizes.
    pub fn size(&self) -> LayerSize {
        self.size
    }
    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free_blocks.len()
    }

    /// Starts an empty sequence in the lowest free slot (`SeqId::slot`, its row block
    /// in a decode plan's batch). The id also carries the slot's generation and this
    /// layer's identity: once the sequence is freed, or on another layer, it is refused
    /// with [`Error::UnknownSequence`].
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let slot = self
            .seqs
            .iter()
            .position(Option::is_none)
            .ok_or_else(|| Error::Capacity(format!("all {} sequence slots are live", self.size.max_seqs)))?;
        self.generations[slot] += 1;
        let id = SeqId::new(slot, self.generations[slot], LAYER_ID_TAG | self.id);
        self.seqs[slot] = Some(SeqState { id, table: Vec::new(), len: 0, protected: Vec::new() });
        Ok(id)
    }

    /// Tokens of the sequence in slot `slot`, or `None` for a free slot (the batch's
    /// bookkeeping: which rows of a plan's output belong to a live sequence).
    pub fn slot_len(&self, slot: usize) -> Option<usize> {
        self.seqs.get(slot).and_then(Option::as_ref).map(|s| s.len)
    }

    /// Frees a sequence: its blocks go back to the pool and its slot's length becomes 0
    /// on the device (a 4-byte write, plus its protected list when it had one).
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seq(seq)?;
        let seq = seq.slot();
        let had_protected = !s.protected.is_empty();
        let was_empty = s.len == 0;
        if !was_empty {
            self.device.write(&mut self.lens, seq, &[0])?;
        }
        if had_protected {
            let np = self.fmt.protected as usize;
            self.device.write(&mut self.protected, seq * np, &vec![u32::MAX; np])?;
        }
        let s = self.seqs[seq].take().expect("checked above");
        self.free_blocks.extend(s.table.iter().rev());
        Ok(())
    }

    /// Tokens of `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// The layer's cache as stored, copied to the host: the page pool's bytes (blocks in
    /// pool order, as `docs/src/format.md` lays them out) and every slot's f16 side store (sinks,
    /// window ring, protected rows; `max_seqs` slots in slot order). Two downloads and a
    /// wait for the device: for inspection and tests, not for a serving step.
    pub fn read_cache(&self) -> Result<(Vec<u8>, Vec<half::f16>)> {
        let mut pool = vec![0u8; self.pool.len()];
        self.device.read(&self.pool, &mut pool)?;
        let mut sides = vec![0u16; self.sides.len()];
        self.device.read(&self.sides, &mut sides)?;
        Ok((pool, sides.into_iter().map(half::f16::from_bits).collect()))
    }

    /// Protects `positions` of `seq` (as [`crate::KvCache::protect`]): the ascending list
    /// extends the sequence's; a position already appended must still be in the f16
    /// window (its rows are copied to the protected rows on the device, a few
    /// device-to-device copies), a later one is stored there when it arrives. Refused
    /// with an error, changing nothing, as `KvCache::protect` refuses.
    pub fn protect(&mut self, seq: SeqId, positions: &[u32]) -> Result<()> {
        let s = self.seq(seq)?;
        let seq = seq.slot();
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= self.size.max_tokens) {
            return Err(Error::Value(format!(
                "position {p} can never be appended: the layer holds at most {} tokens per sequence",
                self.size.max_tokens
            )));
        }
        let new: Vec<u32> = s.protected.iter().chain(positions).copied().collect();
        // The host checks (ascending, not a sink, room, not quantized yet) on a scratch
        // side store.
        let mut scratch = vec![half::f16::ZERO; self.fmt.side_elems(self.shape.num_kv_heads as u32)];
        crate::paged::protect(&self.config, &self.shape, &mut scratch, s.len, &s.protected, &new)?;
        let (old, len) = (s.protected.len(), s.len);
        let np = self.fmt.protected as usize;
        let mut row = vec![u32::MAX; np];
        row[..new.len()].copy_from_slice(&new);
        let dev = self.device.clone();
        let base = seq * self.fmt.side_elems(self.shape.num_kv_heads as u32);
        let d = self.fmt.head_dim as usize;
        for (i, &pos) in new.iter().enumerate().skip(old).filter(|&(_, &p)| (p as usize) < len) {
            for h in 0..self.shape.num_kv_heads as u32 {
                for value in [false, true] {
                    let from = base + self.fmt.side_row_at(h, value, self.fmt.window_row(pos));
                    let to = base + self.fmt.side_row_at(h, value, self.fmt.protected_row(i as u32));
                    dev.copy_within(&mut self.sides, from, to, d)?;
                }
            }
        }
        self.device.write(&mut self.protected, seq * np, &row)?;
        self.seqs[seq].as_mut().expect("checked above").protected = new;
        Ok(())
    }

    fn seq(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs
            .get(seq.slot())
            .and_then(Option::as_ref)
            .filter(|s| s.id == seq)
            .ok_or(Error::UnknownSequence(seq.slot()))
    }

    /// Appends `tokens` tokens to `seq` from device buffers `k` and `v` (f32, f16 or
    /// bf16): token `t`, KV head `h`, channel `c` at element `t * token_stride + h *
    /// head_dim + c` of each (`token_stride >= num_kv_heads * head_dim`; a fused QKV
    /// buffer's row, say). Returns the new length. Checks everything the host knows
    /// first. [`DeviceLayer::append_strided`] with `token_stride` for both; use that for
    /// K and V at different row strides.
    pub fn append<T: KvElement>(
        &mut self,
        seq: SeqId,
        tokens: usize,
        k: &impl AsDeviceSlice<Elem = T>,
        v: &impl AsDeviceSlice<Elem = T>,
        token_stride: usize,
    ) -> Result<usize> {
        self.append_strided(seq, tokens, k, token_stride, v, token_stride)
    }

    /// Appends `tokens` tokens to `seq` from device buffers `k` and `v` (f32, f16 or
    /// bf16), each at its own row stride: token `t`, KV head `h`, channel `c` at element
    /// `t * k_stride + h * head_dim + c` of `k` and `t * v_stride + h * head_dim + c` of
    /// `v` (each stride `>= num_kv_heads * head_dim`): K a view of a fused QKV
    /// projection's rows and V a contiguous tensor, say, without a copy. Returns the new
    /// length. Checks everything the host knows first ([`Error::Shape`] naming `k` or
    /// `v` for a stride below a row or past `u32::MAX`, or a buffer too short for
    /// `tokens` rows at its stride); on error nothing is enqueued and the layer is
    /// unchanged.
    pub fn append_strided<T: KvElement>(
        &mut self,
        seq: SeqId,
        tokens: usize,
        k: &impl AsDeviceSlice<Elem = T>,
        k_stride: usize,
        v: &impl AsDeviceSlice<Elem = T>,
        v_stride: usize,
    ) -> Result<usize> {
        let (k, v) = (k.device_slice(), v.device_slice());
        let s = self.seq(seq)?;
        let seq = seq.slot();
        let (hkv, d) = (self.shape.num_kv_heads, self.config.head_dim);
        let len = s.len;
        // The buffers are checked whatever the count: a zero-token append with a buffer
        // of another device or a bad stride is the same mistake as a longer one.
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            self.check_kv_input(what, b.device, b.len(), stride, 0)?;
        }
        if tokens == 0 {
            return Ok(len);
        }
        let Some(new_len) = len.checked_add(tokens).filter(|&n| n <= self.size.max_tokens) else {
            return Err(Error::Capacity(format!(
                "sequence {seq} holds {len} tokens; {tokens} more are past max_tokens {}",
                self.size.max_tokens
            )));
        };
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            self.check_kv_input(what, b.device, b.len(), stride, tokens)?;
        }
        let have = s.table.len();
        let pages = self.fmt.pages_for(new_len as u32) as usize;
        let fresh = pages.saturating_sub(have);
        if fresh > self.free_blocks.len() {
            return Err(Error::Capacity(format!(
                "sequence {seq} needs {fresh} more blocks, {} are free",
                self.free_blocks.len()
            )));
        }
        let mut table = s.table.clone();
        table.extend(self.free_blocks[self.free_blocks.len() - fresh..].iter().rev());
        let p = AppendParams {
            format: self.fmt,
            num_kv_heads: hkv as u32,
            start: len as u32,
            count: tokens as u32,
            new_len: new_len as u32,
            num_blocks: self.num_blocks as u32,
            flags: self.config.flags() | self.calib.flags(),
            token_stride: k_stride as u32,
            v_token_stride: v_stride as u32,
            head_stride: d as u32,
            input_dtype: T::DTYPE,
        };
        // Nothing fails past this point but the device itself.
        let dev = self.device.clone();
        if fresh > 0 {
            dev.write(&mut self.tables, seq * self.max_blocks + have, &table[have..])?;
        }
        let np = self.fmt.protected as usize;
        let side = self.sides.addr_at(seq * self.fmt.side_elems(hkv as u32));
        let block_table = self.tables.addr_at(seq * self.max_blocks);
        // SAFETY: every address is a live buffer of this device with the sizes the
        // kernels' contracts ask: the table row holds every block of `table` (taken from
        // the pool's free list, written above), the protected row is the slot's padded
        // list, the side store and the length are the slot's, k was checked for `tokens`
        // rows at `k_stride` and v for `tokens` rows at `v_stride`.
        unsafe {
            raw::append_flush(&dev, &p, &FlushPtrs { block_table, side, pool: self.pool.addr() })?;
            raw::append_tokens(
                &dev,
                &p,
                &AppendPtrs {
                    k: k.addr(),
                    v: v.addr(),
                    key_mean: self.key_mean.addr(),
                    key_scale: self.key_scale.addr(),
                    key_perm: self.key_perm.addr(),
                    value_perm: self.value_perm.addr(),
                    key_rot: self.key_rot.addr(),
                    value_rot: self.value_rot.addr(),
                    block_table,
                    protected: self.protected.addr_at(seq * np),
                    pool: self.pool.addr(),
                    side,
                    seq_len: self.lens.addr_at(seq),
                },
            )?;
        }
        self.free_blocks.truncate(self.free_blocks.len() - fresh);
        let s = self.seqs[seq].as_mut().expect("checked above");
        s.table = table;
        s.len = new_len;
        Ok(new_len)
    }
}

impl DeviceLayer {
    /// Makes room for `seq` to grow to `len` tokens without taking blocks in an append:
    /// the pages a sequence of `len` tokens uses are taken from the pool now and their
    /// block-table entries written (one upload, only of new entries), so that the
    /// appends of later steps ([`DeviceLayer::append_batch`], which takes no blocks)
    /// need no host work. Between steps, not inside a captured one: on admission (the
    /// prompt plus the most tokens the request may generate), or a page at a time ahead
    /// of the sequence. Reserving less than the sequence holds does nothing; the blocks
    /// go back to the pool with [`DeviceLayer::free_sequence`]. Returns the blocks the
    /// sequence now holds.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::Capacity`] for `len` past `max_tokens` or more
    /// blocks than are free (nothing is taken).
    pub fn reserve(&mut self, seq: SeqId, len: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        let slot = seq.slot();
        if len > self.size.max_tokens {
            return Err(Error::Capacity(format!(
                "reserving {len} tokens for sequence {slot}: the layer holds at most {} per sequence",
                self.size.max_tokens
            )));
        }
        let have = s.table.len();
        let fresh = (self.fmt.pages_for(len as u32) as usize).saturating_sub(have);
        if fresh == 0 {
            return Ok(have);
        }
        if fresh > self.free_blocks.len() {
            return Err(Error::Capacity(format!(
                "sequence {slot} needs {fresh} more blocks for {len} tokens, {} are free",
                self.free_blocks.len()
            )));
        }
        let new: Vec<u32> = self.free_blocks[self.free_blocks.len() - fresh..].iter().rev().copied().collect();
        self.device.write(&mut self.tables, slot * self.max_blocks + have, &new)?;
        self.free_blocks.truncate(self.free_blocks.len() - fresh);
        let s = self.seqs[slot].as_mut().expect("checked above");
        s.table.extend(new);
        Ok(s.table.len())
    }

    /// Tokens `seq` can grow to without taking blocks: what [`DeviceLayer::reserve`] (or
    /// earlier appends) gave it, up to `max_tokens`.
    pub fn reserved(&self, seq: SeqId) -> Result<usize> {
        let s = self.seq(seq)?;
        Ok(self.tokens_for_pages(s.table.len()))
    }

    /// The longest sequence `pages` pages hold (sinks, quantized pages, a full window).
    fn tokens_for_pages(&self, pages: usize) -> usize {
        let f = &self.fmt;
        let most = f.sinks as usize + (pages + 1) * f.page_size as usize + f.window as usize - 1;
        most.min(self.size.max_tokens)
    }

    /// Appends a serving step's new tokens, every sequence of `batch` at once, in two
    /// launches (`append_batch_flush`, `append_batch_tokens`) whatever the step holds:
    /// the device-side twin of vLLM's reshape-and-cache. Input row `r` of `k` and `v`
    /// (token `t`, KV head `h`, channel `c` at element `r * stride + h * head_dim + c`)
    /// is the token the batch gives row `r` ([`StepBatch::set`]); the window rows whose
    /// page fills and every token's place are decided on the device from the batch's
    /// starts and counts and the block tables already there, and each slot's new length
    /// is stored on the device. No allocation, upload or synchronization: the same launch
    /// list every step, so a step can be captured in a CUDA graph and replayed (see
    /// [`DeviceLayer::advance`]).
    ///
    /// Every layer of a model appends the same batch: a request has the same slot in
    /// every layer when the layers add and free their sequences in the same order.
    ///
    /// # Errors
    /// Checked before anything is enqueued, nothing changed on error: [`Error::Device`]
    /// for a batch or buffer of another device; [`Error::Shape`] for a stride below a row
    /// or past `u32`, `k` or `v` shorter than `batch.max_rows()` rows at their strides, a
    /// batch over more slots than the layer has, or a batch whose start for a slot is not
    /// this layer's length of it (a batch set before the last step; set it again after
    /// every step); [`Error::UnknownSequence`] for a slot with tokens and no live
    /// sequence; [`Error::Capacity`] for a sequence that would pass `max_tokens` or the
    /// blocks it holds ([`DeviceLayer::reserve`] them first).
    pub fn append_batch<T: KvElement>(
        &mut self,
        batch: &StepBatch,
        k: &impl AsDeviceSlice<Elem = T>,
        k_stride: usize,
        v: &impl AsDeviceSlice<Elem = T>,
        v_stride: usize,
    ) -> Result<()> {
        let (k, v) = (k.device_slice(), v.device_slice());
        self.check_batch(batch)?;
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            self.check_kv_input(what, b.device, b.len(), stride, batch.max_rows)?;
        }
        // SAFETY: the batch and k, v checked above; the batch's meta is its own buffer.
        unsafe { self.enqueue_append::<T>(batch, batch.meta.addr(), (k.addr(), k_stride), (v.addr(), v_stride))? };
        self.commit_batch(batch);
        Ok(())
    }

    /// The two launches of a batched append of the step batch at `meta` (the whole
    /// step's, or one pass's of `batch`), K and V at `(address, row stride)`.
    ///
    /// # Safety
    /// `batch` passed [`DeviceLayer::check_batch`] against this layer's lengths as they
    /// stand when the launches run (for a pass: after the passes before it); `k` and `v`
    /// passed [`DeviceLayer::check_kv_input`] for `batch.max_rows` rows of `T`; `meta` is
    /// one of `batch`'s step batches.
    unsafe fn enqueue_append<T: KvElement>(
        &self,
        batch: &StepBatch,
        meta: u64,
        (k, k_stride): (u64, usize),
        (v, v_stride): (u64, usize),
    ) -> Result<()> {
        let (hkv, d) = (self.shape.num_kv_heads, self.config.head_dim);
        let np = self.fmt.protected as usize;
        let bp = rotkv_kernels::params::AppendBatchParams {
            append: AppendParams {
                format: self.fmt,
                num_kv_heads: hkv as u32,
                start: 0,
                count: 0,
                new_len: 0,
                num_blocks: self.num_blocks as u32,
                flags: self.config.flags() | self.calib.flags(),
                token_stride: k_stride as u32,
                v_token_stride: v_stride as u32,
                head_stride: d as u32,
                input_dtype: T::DTYPE,
            },
            max_seqs: batch.max_seqs as u32,
            max_rows: batch.max_rows as u32,
            table_stride: self.max_blocks.max(1) as u32,
            protected_stride: np as u32,
        };
        // SAFETY: the layer's buffers have the sizes the kernels ask for `bp` (tables of
        // `max_blocks` entries, side stores, protected lists and lengths for `max_seqs
        // >= batch.max_seqs` slots; the pool of `num_blocks` blocks); every slot with
        // tokens holds a live sequence whose length is its start and whose table holds
        // the pages of its new length (check_batch), blocks no other slot holds; k and v
        // were checked for `max_rows` rows at their strides; the batch's meta and error
        // words are its own buffers of this device.
        unsafe {
            raw::append_batch(
                &self.device,
                &bp,
                &launch::BatchPtrs {
                    meta,
                    k,
                    v,
                    key_mean: self.key_mean.addr(),
                    key_scale: self.key_scale.addr(),
                    key_perm: self.key_perm.addr(),
                    value_perm: self.value_perm.addr(),
                    key_rot: self.key_rot.addr(),
                    value_rot: self.value_rot.addr(),
                    tables: self.tables.addr(),
                    protected: self.protected.addr(),
                    pool: self.pool.addr(),
                    sides: self.sides.addr(),
                    lens: self.lens.addr(),
                    errors: batch.errors.addr(),
                },
            )
        }
    }

    /// The host's side of [`DeviceLayer::append_batch`] without enqueuing anything: the
    /// check, then every slot's length advanced by its count. For a step replayed from a
    /// captured CUDA graph (the graph runs the kernels; the layer's bookkeeping, which the
    /// next step's checks read, must follow): per replay, [`StepBatch::set`], then
    /// [`DecodePlan::check_batch`] and `advance` on every layer, then the graph's launch.
    /// Errors as [`DeviceLayer::append_batch`]'s for the batch itself.
    ///
    /// Capturing: the `append_batch` and [`DecodePlan::run_batch`] calls made while a
    /// stream captures run their checks and advance the host's lengths as for a launch,
    /// though the kernels run only when the graph is launched: launch the captured graph
    /// once for the batch it was captured with (or capture with a batch of no tokens)
    /// before any `advance`.
    pub fn advance(&mut self, batch: &StepBatch) -> Result<()> {
        self.check_batch(batch)?;
        self.commit_batch(batch);
        Ok(())
    }

    /// A K or V input of `len` elements on device handle `device`: this device, a row
    /// stride of at least a row and at most `u32::MAX`, and (for `rows > 0`) `rows` rows
    /// at that stride ([`Error::Device`], [`Error::Shape`] naming `what`).
    fn check_kv_input(&self, what: &str, device: u64, len: usize, stride: usize, rows: usize) -> Result<()> {
        let (hkv, d) = (self.shape.num_kv_heads, self.config.head_dim);
        self.device.check_view(device, what)?;
        if stride < hkv * d || stride > u32::MAX as usize {
            return Err(Error::Shape(format!(
                "{what}: row stride {stride} (at least {hkv} heads x {d}, at most {})",
                u32::MAX
            )));
        }
        if rows > 0 {
            // rows < 2^31 (max_tokens or a step batch's rows) and stride < 2^32: no
            // overflow in u64.
            let need = (rows - 1) as u64 * stride as u64 + (hkv * d) as u64;
            if (len as u64) < need {
                return Err(Error::Shape(format!(
                    "{what} has {len} elements; {rows} rows at stride {stride} need {need}"
                )));
            }
        }
        Ok(())
    }

    fn check_batch(&self, batch: &StepBatch) -> Result<()> {
        if batch.device.0.id != self.device.0.id {
            return Err(Error::Device("the step batch belongs to another device handle".into()));
        }
        if batch.max_seqs > self.size.max_seqs {
            return Err(Error::Shape(format!(
                "a step batch over {} slots for a layer of {}",
                batch.max_seqs, self.size.max_seqs
            )));
        }
        for (slot, start, count) in batch.entries() {
            let Some(s) = self.seqs[slot].as_ref() else {
                return Err(Error::UnknownSequence(slot));
            };
            if s.len != start {
                return Err(Error::Shape(format!(
                    "the step batch says slot {slot} holds {start} tokens; this layer's sequence there holds {} (set \
                     the batch again after every step)",
                    s.len
                )));
            }
            let new_len = start + count;
            if new_len > self.size.max_tokens {
                return Err(Error::Capacity(format!(
                    "sequence {slot} holds {start} tokens; {count} more are past max_tokens {}",
                    self.size.max_tokens
                )));
            }
            let pages = self.fmt.pages_for(new_len as u32) as usize;
            if pages > s.table.len() {
                return Err(Error::Capacity(format!(
                    "sequence {slot} at {new_len} tokens needs {pages} blocks and holds {}: reserve them first \
                     (DeviceLayer::reserve)",
                    s.table.len()
                )));
            }
        }
        Ok(())
    }

    fn commit_batch(&mut self, batch: &StepBatch) {
        for (slot, start, count) in batch.entries() {
            let s = self.seqs[slot].as_mut().expect("checked by check_batch");
            s.len = start + count;
        }
    }
}

/// The new tokens of one serving step, in device memory: which sequence slot each input
/// row of the step's K/V belongs to, and each slot's length before the step and count
/// of new tokens (`rotkv_kernels::params::AppendBatchParams` gives the layout). One
/// batch serves every layer of a model ([`DeviceLayer::append_batch`]); it is set once
/// per step ([`StepBatch::set`], one upload, before the step's launches or a graph
/// replay) and also holds the device-side error counters of the batched append
/// ([`StepBatch::errors`]).
pub struct StepBatch {
    device: Device,
    max_seqs: usize,
    max_rows: usize,
    /// Most rows of one sequence in one pass of [`DecodePlan::run_step`].
    pass_rows: usize,
    /// Passes of [`DecodePlan::run_step`] (fixed: the launch list does not depend on
    /// the step).
    passes: usize,
    /// The whole step's batch, then (with more than one pass) each pass's batch, each
    /// [`rotkv_kernels::params::batch_meta_len`] entries.
    meta: DeviceBuffer<u32>,
    errors: DeviceBuffer<u32>,
    /// The host's copy of the whole step's batch (the first part of `meta`).
    host: Vec<u32>,
}

impl std::fmt::Debug for StepBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepBatch")
            .field("max_seqs", &self.max_seqs)
            .field("max_rows", &self.max_rows)
            .field("pass_rows", &self.pass_rows)
            .field("passes", &self.passes)
            .field("entries", &self.entries().collect::<Vec<_>>())
            .finish()
    }
}

/// What the batched append met on the device ([`StepBatch::errors`]): what it skipped
/// (nothing was read or written out of bounds; both zero for any batch the host API set
/// and checked) and the non-finite input rows it stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchErrors {
    /// (token, KV head) rows the step batch did not describe consistently (a slot past
    /// the layer's, a row outside its slot's rows, a length past the block table).
    pub batch_rows: u32,
    /// K or V rows whose block-table entry is at or past the pool's blocks.
    pub bad_blocks: u32,
    /// K or V input rows (token, KV head) with a NaN or infinity: stored as they came, so
    /// the rows that attend to them decode to NaN; counted so that a stack can find a bad
    /// step without reading its K/V on the host (a warp OR and one atomic per such row).
    pub non_finite_rows: u32,
}

impl StepBatch {
    /// A batch for steps of at most `max_rows` new tokens over slots `0 .. max_seqs`
    /// (at most 32,767 slots and 65,535 rows: the GPU's grid limits). Starts empty.
    pub fn new(device: &Device, max_seqs: usize, max_rows: usize) -> Result<Self> {
        Self::with_passes(device, max_seqs, max_rows, max_rows, 1)
    }

    /// A batch whose steps [`DecodePlan::run_step`] runs in `passes` passes of at most
    /// `pass_rows` rows per sequence: pass `i` appends rows `i * pass_rows ..` of every
    /// sequence's new tokens and decodes them, so that every row of a long prompt chunk
    /// sees the chunk's earlier tokens in f16 (from the window), as token-by-token decode
    /// does, however long the chunk. [`CacheConfig::pass_rows`] gives the recommended
    /// `pass_rows` (half the window: 64 with the presets); `passes` is fixed, so that the
    /// launch list is the same every step: a sequence may take at most `pass_rows *
    /// passes` tokens in one step. ([`StepBatch::new`] is one pass of up to `max_rows`.)
    ///
    /// # Errors
    /// [`Error::Shape`] for zero slots, rows, pass rows or passes; [`Error::Capacity`]
    /// past the grid limits of [`StepBatch::new`] or more than 64 passes.
    pub fn with_passes(
        device: &Device,
        max_seqs: usize,
        max_rows: usize,
        pass_rows: usize,
        passes: usize,
    ) -> Result<Self> {
        if max_seqs == 0 || max_rows == 0 || pass_rows == 0 || passes == 0 {
            return Err(Error::Shape(format!(
                "a step batch of {max_seqs} slots, {max_rows} rows and {passes} passes of {pass_rows} rows"
            )));
        }
        if passes > MAX_PASSES {
            return Err(Error::Capacity(format!("{passes} passes of a step (at most {MAX_PASSES})")));
        }
        if max_rows > launch::MAX_GRID_YZ as usize || 2 * max_seqs > launch::MAX_GRID_YZ as usize {
            return Err(Error::Capacity(format!(
                "a step batch of {max_seqs} slots and {max_rows} rows (at most {} slots and {} rows)",
                launch::MAX_GRID_YZ / 2,
                launch::MAX_GRID_YZ
            )));
        }
        let n = rotkv_kernels::params::batch_meta_len(max_rows as u32, max_seqs as u32);
        let mut host = vec![0u32; n];
        host[..max_rows].fill(rotkv_kernels::params::BATCH_NO_SLOT);
        let parts = if passes > 1 { 1 + passes } else { 1 };
        let all: Vec<u32> = (0..parts).flat_map(|_| host.iter().copied()).collect();
        Ok(Self {
            meta: device.upload(&all)?,
            errors: device.alloc(rotkv_kernels::params::BATCH_ERRORS)?,
            device: device.clone(),
            max_seqs,
            max_rows,
            pass_rows: pass_rows.min(max_rows),
            passes,
            host,
        })
    }

    /// Passes of [`DecodePlan::run_step`] (1 for [`StepBatch::new`]).
    pub fn passes(&self) -> usize {
        self.passes
    }
    /// Most rows of one sequence per pass ([`StepBatch::with_passes`]).
    pub fn pass_rows(&self) -> usize {
        self.pass_rows
    }

    /// The device address of pass `pass`'s batch (the whole step's with one pass).
    fn pass_meta(&self, pass: usize) -> u64 {
        let n = self.host.len() as u64 * 4;
        if self.passes == 1 { self.meta.addr() } else { self.meta.addr() + (1 + pass as u64) * n }
    }

    /// Slots the batch may name.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }
    /// Input rows of a step (what `k` and `v` hold).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }
    /// Rows this step uses (the new tokens of all its sequences).
    pub fn rows(&self) -> usize {
        self.entries().map(|(_, _, n)| n).sum()
    }
    /// `(slot, start, count)` of every slot with new tokens this step, in slot order; its
    /// rows are `first_row(slot) ..` [`StepBatch::first_row`].
    pub fn entries(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let (r, s) = (self.max_rows, self.max_seqs);
        (0..s)
            .filter(move |&i| self.host[r + s + i] > 0)
            .map(move |i| (i, self.host[r + i] as usize, self.host[r + s + i] as usize))
    }
    /// The input row of `slot`'s first new token this step (`None` when it has none).
    pub fn first_row(&self, slot: usize) -> Option<usize> {
        let (r, s) = (self.max_rows, self.max_seqs);
        (slot < s && self.host[r + s + slot] > 0).then(|| self.host[r + 2 * s + slot] as usize)
    }

    /// Sets the step: `(sequence, new tokens)` of every sequence that takes tokens, their
    /// rows in that order (the first sequence's tokens are rows `0 .. n0`, the next
    /// one's follow). Each sequence's start is its length in `layer` (any layer of the
    /// model: all hold the same lengths). One upload; nothing else is enqueued.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`] for a sequence not live in `layer`; [`Error::Shape`]
    /// for a slot at or past `max_seqs` or named twice; [`Error::Capacity`] for more
    /// than `max_rows` tokens in all. On error the batch is unchanged.
    pub fn set(&mut self, layer: &DeviceLayer, steps: &[(SeqId, usize)]) -> Result<()> {
        let mut slots = Vec::with_capacity(steps.len());
        for &(seq, count) in steps {
            slots.push((seq.slot(), layer.len(seq)?, count));
        }
        self.set_slots(&slots)
    }

    /// [`StepBatch::set`] by slot: `(slot, start, count)` with `start` the slot's length
    /// before the step, as a stack that keeps its own lengths has them.
    pub fn set_slots(&mut self, steps: &[(usize, usize, usize)]) -> Result<()> {
        let (r, s) = (self.max_rows, self.max_seqs);
        let mut host = vec![0u32; self.host.len()];
        host[..r].fill(rotkv_kernels::params::BATCH_NO_SLOT);
        let mut row = 0usize;
        let mut named = vec![false; s];
        for &(slot, start, count) in steps {
            if slot >= s {
                return Err(Error::Shape(format!("slot {slot} in a step batch of {s} slots")));
            }
            if std::mem::replace(&mut named[slot], true) {
                return Err(Error::Shape(format!("slot {slot} is named twice in one step")));
            }
            if start > u32::MAX as usize / 2 || count > r {
                return Err(Error::Capacity(format!("slot {slot}: {count} tokens after {start}")));
            }
            if count > self.pass_rows * self.passes {
                return Err(Error::Capacity(format!(
                    "slot {slot}: {count} tokens in one step; the batch takes {} passes of {} rows",
                    self.passes, self.pass_rows
                )));
            }
            if count == 0 {
                continue;
            }
            let Some(end) = row.checked_add(count).filter(|&e| e <= r) else {
                return Err(Error::Capacity(format!("more than the batch's {r} rows in one step")));
            };
            host[row..end].fill(slot as u32);
            host[r + slot] = start as u32;
            host[r + s + slot] = count as u32;
            host[r + 2 * s + slot] = row as u32;
            row = end;
        }
        let mut all = host.clone();
        if self.passes > 1 {
            // Pass `i`: rows `i * pass_rows ..` of each slot's, at its start plus that
            // many; the other rows carry no token in it.
            for i in 0..self.passes {
                let mut part = vec![0u32; host.len()];
                part[..r].fill(rotkv_kernels::params::BATCH_NO_SLOT);
                for slot in 0..s {
                    let (start, count, first) = (host[r + slot], host[r + s + slot], host[r + 2 * s + slot]);
                    let lo = (i * self.pass_rows) as u32;
                    let hi = count.min(lo + self.pass_rows as u32);
                    if lo < hi {
                        part[(first + lo) as usize..(first + hi) as usize].fill(slot as u32);
                        part[r + slot] = start + lo;
                        part[r + s + slot] = hi - lo;
                        part[r + 2 * s + slot] = first + lo;
                    }
                }
                all.extend_from_slice(&part);
            }
        }
        self.device.write(&mut self.meta, 0, &all)?;
        self.host = host;
        Ok(())
    }

    /// The device-side error counters, read back (a download and a wait for the stream:
    /// after a step, not inside one).
    pub fn errors(&self) -> Result<BatchErrors> {
        let mut e = [0u32; rotkv_kernels::params::BATCH_ERRORS];
        self.device.read(&self.errors, &mut e)?;
        Ok(BatchErrors {
            batch_rows: e[rotkv_kernels::params::BATCH_ERROR_BATCH],
            bad_blocks: e[rotkv_kernels::params::BATCH_ERROR_BLOCK],
            non_finite_rows: e[rotkv_kernels::params::BATCH_ERROR_NONFINITE],
        })
    }

    /// Zeroes the error counters (one upload).
    pub fn clear_errors(&mut self) -> Result<()> {
        self.device.write(&mut self.errors, 0, &[0; rotkv_kernels::params::BATCH_ERRORS])
    }

    /// The step batch in device memory (`u32`, for [`raw::append_batch`]).
    pub fn meta(&self) -> &DeviceBuffer<u32> {
        &self.meta
    }
    /// The error counters in device memory (`u32` x `BATCH_ERRORS`).
    pub fn error_words(&self) -> &DeviceBuffer<u32> {
        &self.errors
    }
}

/// The batch shape a [`DecodePlan`] is made for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanShape {
    /// Sequence slots decoded every step (slots `0 .. max_seqs`).
    pub max_seqs: usize,
    /// Most query tokens per sequence ([`DecodePlan::run`] takes 1 to this many).
    pub max_q_len: usize,
    /// Longest sequence the plan decodes (drives the split count).
    pub max_context: usize,
    /// Multiprocessors to fill; `None` takes [`Device::sm_count`].
    pub sm_count: Option<usize>,
    /// Decode blocks one multiprocessor holds at once; `None` takes
    /// [`Device::resident_blocks`] (the driver's occupancy calculation on a GPU). The
    /// split count is sized to waves of `sm_count * blocks_per_sm` blocks
    /// ([`launch::wave_splits`]).
    pub blocks_per_sm: Option<usize>,
    /// Softmax scale; `None` means `1 / sqrt(head_dim)`.
    pub sm_scale: Option<f32>,
}

/// A decode launch fixed for a batch shape: split count, grid and partials workspace
/// chosen and allocated once ([`DecodePlan::new`]); [`DecodePlan::run`] enqueues the same
/// two launches every step.
#[derive(Debug)]
pub struct DecodePlan {
    shape: PlanShape,
    /// What a layer must share with the one the plan was made for to run it.
    fmt: Format,
    layer_shape: LayerShape,
    device: u64,
    num_splits: u32,
    sm_scale: f32,
    /// [`DecodeParams::attn_window`]: 0, or the sliding window's keys per row.
    attn_window: u32,
    m: DeviceBuffer<f32>,
    l: DeviceBuffer<f32>,
    o: DeviceBuffer<f32>,
}

impl DecodePlan {
    /// A plan for decoding `layer`'s slots `0 .. shape.max_seqs`, and those of every
    /// other layer of the same format and heads with at least `max_seqs` slots and
    /// `max_context` tokens per sequence: one plan (and one workspace) serves every layer
    /// of a model, [`DecodePlan::run`] taking the layer each time (the runs are ordered on
    /// the device's stream, so they share the workspace).
    pub fn new(layer: &DeviceLayer, shape: PlanShape) -> Result<Self> {
        Self::new_windowed(layer, shape, None)
    }

    /// [`DecodePlan::new`] for a sliding-window layer: every run attends only to the
    /// `window_left + 1` newest positions up to each query row's own
    /// ([`crate::paged::DecodeOptions::window_left`], FlashInfer's `window_left`; Hugging
    /// Face's `sliding_window = n` is `Some(n - 1)`). The window is fixed in the plan, so
    /// every step launches the same grid (CUDA-graph friendly); the split count is chosen
    /// for the visible positions (at most `window_left + max_q_len`), not `max_context`,
    /// and pages before the window are not read.
    pub fn new_windowed(layer: &DeviceLayer, shape: PlanShape, window_left: Option<usize>) -> Result<Self> {
        let attn_window = crate::paged::attn_window(window_left)?;
        if shape.max_seqs == 0 || shape.max_seqs > layer.size.max_seqs {
            return Err(Error::Capacity(format!(
                "a plan for {} sequences on a layer of {} slots",
                shape.max_seqs, layer.size.max_seqs
            )));
        }
        if !(1..=MAX_Q_LEN).contains(&shape.max_q_len) {
            return Err(Error::Shape(format!("max_q_len {}: 1 to {MAX_Q_LEN}", shape.max_q_len)));
        }
        if shape.max_context == 0 || shape.max_context > layer.size.max_tokens {
            return Err(Error::Capacity(format!(
                "max_context {} (the layer holds up to {} tokens per sequence)",
                shape.max_context, layer.size.max_tokens
            )));
        }
        let d = layer.config.head_dim;
        let sm_scale = shape.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
        if !sm_scale.is_finite() || sm_scale <= 0.0 {
            return Err(Error::Value(format!("softmax scale {sm_scale} must be finite and positive")));
        }
        let hq = layer.shape.num_q_heads;
        let sms = shape.sm_count.unwrap_or(layer.device.sm_count()).max(1);
        // A wave of resident blocks: the q_len-1 launch's blocks per split, the
        // kernel's occupancy on this device.
        let one = launch::decode_launch(&Self::params(layer, shape.max_seqs, 1, sm_scale, 1, attn_window));
        let per_sm = match shape.blocks_per_sm {
            Some(n) => n,
            None => layer.device.resident_blocks(&layer.fmt, &one)?,
        }
        .max(1);
        let per_split = one.grid.iter().map(|&x| x as usize).product::<usize>();
        // The most positions a sequence's rows attend to together.
        let visible = crate::paged::visible_range(shape.max_context, shape.max_q_len, attn_window);
        let num_splits = launch::wave_splits(visible.1 - visible.0, per_split, sms * per_sm);
        for q_len in 1..=shape.max_q_len {
            let p = Self::params(layer, shape.max_seqs, num_splits, sm_scale, q_len, attn_window);
            let z = launch::decode_launch(&p).grid[2];
            if z > launch::MAX_GRID_YZ || shape.max_seqs * q_len > launch::MAX_GRID_YZ as usize {
                return Err(Error::Capacity(format!("{q_len} query tokens x {num_splits} splits exceed the grid")));
            }
        }
        let parts = shape.max_seqs * shape.max_q_len * hq * num_splits as usize;
        let dev = &layer.device;
        Ok(Self {
            shape,
            fmt: layer.fmt,
            layer_shape: layer.shape,
            device: layer.device.0.id,
            num_splits,
            sm_scale,
            attn_window,
            m: dev.alloc(parts)?,
            l: dev.alloc(parts)?,
            o: dev.alloc(parts * d)?,
        })
    }

    fn params(
        layer: &DeviceLayer,
        seqs: usize,
        num_splits: u32,
        sm_scale: f32,
        q_len: usize,
        attn_window: u32,
    ) -> DecodeParams {
        let (hq, d) = (layer.shape.num_q_heads, layer.config.head_dim);
        DecodeParams {
            format: layer.fmt,
            num_seqs: seqs as u32,
            num_q_heads: hq as u32,
            num_kv_heads: layer.shape.num_kv_heads as u32,
            num_splits,
            block_table_stride: layer.max_blocks.max(1) as u32,
            flags: layer.config.flags() | layer.calib.flags(),
            sm_scale,
            q_seq_stride: (q_len * hq * d) as u32,
            q_token_stride: (hq * d) as u32,
            q_dtype: rotkv_kernels::params::DTYPE_F32,
            num_blocks: layer.num_blocks as u32,
            max_len: layer.size.max_tokens as u32,
            q_len: q_len as u32,
            attn_window,
            batch_rows: 0,
            batch_seqs: 0,
        }
    }

    /// The plan's shape.
    pub fn shape(&self) -> PlanShape {
        self.shape
    }
    /// Splits per sequence (fixed).
    pub fn num_splits(&self) -> u32 {
        self.num_splits
    }
    /// The plan's sliding window ([`DecodePlan::new_windowed`]; `None`: none).
    pub fn window_left(&self) -> Option<usize> {
        self.attn_window.checked_sub(1).map(|w| w as usize)
    }
    /// The decode kernel's grid for `q_len` query tokens (the same every step).
    pub fn grid(&self, layer: &DeviceLayer, q_len: usize) -> [u32; 3] {
        let p = Self::params(layer, self.shape.max_seqs, self.num_splits, self.sm_scale, q_len, self.attn_window);
        launch::decode_launch(&p).grid
    }

    /// Decodes the last `q_len` tokens of every sequence in slots `0 .. max_seqs` of
    /// `layer`: `q` (f32, f16 or bf16) and `out` (f32, f16 or bf16) are dense
    /// `[max_seqs][q_len][num_q_heads][head_dim]` (rows as [`crate::paged::decode`]; a
    /// free slot's rows are zero), at least that many elements each (a buffer sized for
    /// `max_q_len` serves every `q_len`). Enqueues two launches; allocates, copies and
    /// waits for nothing. [`DecodePlan::run_strided`] takes rows with gaps.
    ///
    /// The `q_len` rows of a sequence are its last `q_len` tokens, already appended:
    /// row `i` attends causally to positions `0 ..= len - q_len + i`, and every row reads
    /// the cache as it holds them now. When the append of those tokens moved older
    /// window rows into pages (a page of the window filled), the earlier rows see those
    /// positions quantized, where `q_len` single-token steps would have seen some in f16:
    /// a multi-token step (speculative verification, a chunk of a prompt) is not bit for
    /// bit a run of single-token steps, by the quantization error of at most one page.
    ///
    /// # Errors
    /// Before anything is enqueued: [`Error::Device`] for a layer or buffer of another
    /// device handle; [`Error::Shape`] for a layer of another format or heads than the
    /// plan's, `q_len` outside `1 ..= max_q_len`, a sequence shorter than `q_len`, or
    /// buffers too small; [`Error::Capacity`] for a layer with fewer slots or tokens than
    /// the plan, or a live sequence outside the plan's slots or past its `max_context`.
    pub fn run<Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &DeviceLayer,
        q_len: usize,
        q: &impl AsDeviceSlice<Elem = Q>,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
    ) -> Result<()> {
        let (q, mut out) = (q.device_slice(), out.device_slice_mut());
        let row = layer.shape.num_q_heads * layer.config.head_dim;
        let n = self.shape.max_seqs * q_len * row;
        if (1..=self.shape.max_q_len).contains(&q_len) && (q.len() < n || out.len() < n) {
            return Err(Error::Shape(format!(
                "q has {} and out {} elements, at least {} slots x {q_len} tokens x {row} = {n} needed",
                q.len(),
                out.len(),
                self.shape.max_seqs
            )));
        }
        self.run_strided(layer, q_len, &q, row, &mut out, row)
    }

    /// Every check of [`DecodePlan::run_strided`] (plan and layer, `q_len`, owners,
    /// strides and sizes of q and out as `(device handle, elements, row stride)`, the
    /// live sequences against the plan), nothing enqueued.
    pub(crate) fn check_run(
        &self,
        layer: &DeviceLayer,
        q_len: usize,
        q: (u64, usize, usize),
        out: (u64, usize, usize),
    ) -> Result<()> {
        self.check_layer(layer)?;
        if !(1..=self.shape.max_q_len).contains(&q_len) {
            return Err(Error::Shape(format!("q_len {q_len}: the plan takes 1 to {}", self.shape.max_q_len)));
        }
        let (hq, d) = (layer.shape.num_q_heads, layer.config.head_dim);
        let rows = self.shape.max_seqs * q_len;
        let dev = &layer.device;
        dev.check_view(q.0, "q")?;
        dev.check_view(out.0, "out")?;
        for (what, (_, len, stride)) in [("q", q), ("out", out)] {
            if stride < hq * d || stride.checked_mul(q_len).is_none_or(|x| x > u32::MAX as usize) {
                return Err(Error::Shape(format!(
                    "{what} row stride {stride}: at least {hq} heads x {d}, and {q_len} rows of it within u32"
                )));
            }
            let need = (rows - 1) * stride + hq * d;
            if len < need {
                return Err(Error::Shape(format!(
                    "{what} has {len} elements; {} slots x {q_len} tokens at row stride {stride} need {need}",
                    self.shape.max_seqs
                )));
            }
        }
        self.check_live(layer)?;
        for (slot, s) in layer.seqs.iter().enumerate() {
            if let Some(s) = s
                && s.len > 0
                && s.len < q_len
            {
                return Err(Error::Shape(format!("sequence {slot} holds {} tokens, fewer than q_len {q_len}", s.len)));
            }
        }
        Ok(())
    }

    /// The layer is one the plan runs: the same device, format and heads, enough slots
    /// and tokens per sequence.
    fn check_layer(&self, layer: &DeviceLayer) -> Result<()> {
        if layer.device.0.id != self.device {
            return Err(Error::Device("the plan was made on another device handle".into()));
        }
        if layer.fmt != self.fmt || layer.shape != self.layer_shape {
            return Err(Error::Shape(format!(
                "the plan was made for a layer of another format or heads ({:?}, {:?}; this layer: {:?}, {:?})",
                self.fmt, self.layer_shape, layer.fmt, layer.shape
            )));
        }
        if self.shape.max_seqs > layer.size.max_seqs || self.shape.max_context > layer.size.max_tokens {
            return Err(Error::Capacity(format!(
                "the plan decodes {} slots of up to {} tokens; this layer has {} slots of {}",
                self.shape.max_seqs, self.shape.max_context, layer.size.max_seqs, layer.size.max_tokens
            )));
        }
        Ok(())
    }

    /// Every live sequence with tokens lies in the plan's slots and context.
    fn check_live(&self, layer: &DeviceLayer) -> Result<()> {
        for (slot, s) in layer.seqs.iter().enumerate() {
            let Some(s) = s else { continue };
            if s.len == 0 {
                continue;
            }
            if slot >= self.shape.max_seqs {
                return Err(Error::Capacity(format!(
                    "sequence {slot} is live but the plan decodes slots 0 .. {}",
                    self.shape.max_seqs
                )));
            }
            if s.len > self.shape.max_context {
                return Err(Error::Capacity(format!(
                    "sequence {slot} holds {} tokens; the plan's max_context is {}",
                    s.len, self.shape.max_context
                )));
            }
        }
        Ok(())
    }

    /// [`DecodePlan::run`] with query and output rows (one query token of one slot:
    /// `num_q_heads` heads of `head_dim`, contiguous) `q_row_stride` and
    /// `out_row_stride` elements apart: row `s * q_len + t` for token `t` of slot `s`,
    /// as a fused QKV projection or an attention output with other columns lays them
    /// out. Each buffer must hold `(max_seqs * q_len - 1) * stride + num_q_heads *
    /// head_dim` elements or more.
    #[allow(clippy::too_many_arguments)]
    pub fn run_strided<Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &DeviceLayer,
        q_len: usize,
        q: &impl AsDeviceSlice<Elem = Q>,
        q_row_stride: usize,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
        out_row_stride: usize,
    ) -> Result<()> {
        let (q, out) = (q.device_slice(), out.device_slice_mut());
        self.check_run(layer, q_len, (q.device, q.len(), q_row_stride), (out.device, out.len(), out_row_stride))?;
        let p = DecodeParams {
            q_seq_stride: (q_len * q_row_stride) as u32,
            q_token_stride: q_row_stride as u32,
            q_dtype: Q::DTYPE,
            ..Self::params(layer, self.shape.max_seqs, self.num_splits, self.sm_scale, q_len, self.attn_window)
        };
        // SAFETY: all buffers belong to this device and have the kernels' sizes: the
        // layer's were allocated for `max_seqs >= p.num_seqs` slots, block tables of
        // `block_table_stride` entries that hold valid blocks for every live length
        // (free slots have length 0 and are never read), partials for the plan's most
        // query tokens, q and out checked above.
        unsafe { self.enqueue::<O>(layer, &p, p.num_seqs * p.q_len, q.addr(), out.addr(), out_row_stride, 0) }
    }

    /// Decodes the new tokens of a serving step, every sequence's own number of them:
    /// the rows of `batch` ([`StepBatch::set`], already appended to `layer` with
    /// [`DeviceLayer::append_batch`]), `q` and `out` having one row per input row of the
    /// batch (`batch.max_rows()` rows of `num_q_heads * head_dim` elements, `q_row_stride`
    /// and `out_row_stride` apart; f32, f16 or bf16). Row `r` of `out` is the attention
    /// output of the token of input row `r` (its query row `r` of `q`), over the
    /// sequence's cache up to that token, causal within the step; rows that carry no
    /// token are written as zeros. The same two launches every step, whatever the batch
    /// holds: one-token decode steps, a chunk of a long prompt (chunked prefill: the
    /// chunk's rows attend to every earlier token from the packed pages, the sinks and
    /// the f16 window, and causally to each other), speculative verification rows and
    /// idle sequences, mixed in one step, as long as no sequence has more rows than the
    /// plan's `max_q_len`. Rows read the cache as it holds them after the step's append
    /// (see [`DecodePlan::run`] on multi-token steps): a chunk longer than the window has
    /// its own early tokens quantized before its rows attend to them (measured in
    /// `docs/src/device-api.md`); [`DecodePlan::run_step`] appends and decodes a step in
    /// passes instead, so that every row sees its chunk's earlier tokens in f16.
    ///
    /// # Errors
    /// Before anything is enqueued: as [`DecodePlan::run`] for the plan, the layer and the
    /// buffers; [`Error::Device`] for a batch of another device; [`Error::Shape`] for a
    /// slot at or past the plan's `max_seqs`, more rows for a sequence than `max_q_len`,
    /// more batch rows than the plan's workspace holds (`max_seqs * max_q_len`), or a
    /// batch not yet appended to this layer (a slot whose length is not its start plus
    /// its count).
    #[allow(clippy::too_many_arguments)]
    pub fn run_batch<Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &DeviceLayer,
        batch: &StepBatch,
        q: &impl AsDeviceSlice<Elem = Q>,
        q_row_stride: usize,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
        out_row_stride: usize,
    ) -> Result<()> {
        let (q, out) = (q.device_slice(), out.device_slice_mut());
        self.check_steps(layer, batch, true)?;
        Self::check_rows(layer, batch, (q.device, q.len(), q_row_stride), (out.device, out.len(), out_row_stride))?;
        let p = self.batch_params::<Q>(layer, batch, q_row_stride);
        // SAFETY: as in `run_strided`, with the step batch's rows: every slot with rows
        // holds a live sequence of at least its count (its length is its start plus its
        // count), at most `max_q_len` rows each, the batch's rows within the partials
        // (`max_rows <= max_seqs * max_q_len`) and within q and out (checked above); the
        // batch's meta is its own buffer of this device.
        unsafe {
            self.enqueue::<O>(layer, &p, batch.max_rows as u32, q.addr(), out.addr(), out_row_stride, batch.meta.addr())
        }
    }

    /// A whole serving step of one layer: appends the new tokens of `batch` (K and V as
    /// [`DeviceLayer::append_batch`] takes them) and decodes them (`q` and `out` as
    /// [`DecodePlan::run_batch`] takes them), in the batch's passes
    /// ([`StepBatch::with_passes`]): pass `i` appends rows `i * pass_rows ..` of every
    /// sequence's new tokens, then decodes those rows, and one merge writes every row.
    /// Row `r` of `out` is the attention output of the token of input row `r` over its
    /// sequence up to that token, causal within the step, reading the cache as the
    /// append of its own pass leaves it: a row sees every earlier token of its pass in
    /// f16 (from the window), and at least `window - pass_rows` tokens before the pass
    /// too. With [`CacheConfig::pass_rows`] (half the window) a prompt chunk of any
    /// length gives the outputs chunks of `pass_rows` tokens would, which stay within a
    /// page-flush of token-by-token decode (`docs/src/device-api.md` measures both).
    /// With one pass this is [`DeviceLayer::append_batch`] then [`DecodePlan::run_batch`].
    ///
    /// Enqueues `3 * passes + 1` launches (each pass's flush, tokens and decode, then the
    /// merge), the same every step whatever the batch holds; allocates, copies and waits
    /// for nothing. A pass no sequence has rows in costs its launches' fixed time only.
    ///
    /// # Errors
    /// Before anything is enqueued, nothing changed: every error of
    /// [`DeviceLayer::append_batch`] (with the layer holding the batch's starts) and of
    /// [`DecodePlan::run_batch`] for the plan, the batch and `q`, `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_step<T: KvElement, Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &mut DeviceLayer,
        batch: &StepBatch,
        (k, k_stride): (&impl AsDeviceSlice<Elem = T>, usize),
        (v, v_stride): (&impl AsDeviceSlice<Elem = T>, usize),
        q: &impl AsDeviceSlice<Elem = Q>,
        q_row_stride: usize,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
        out_row_stride: usize,
    ) -> Result<()> {
        let (k, v, q, out) = (k.device_slice(), v.device_slice(), q.device_slice(), out.device_slice_mut());
        layer.check_batch(batch)?;
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            layer.check_kv_input(what, b.device, b.len(), stride, batch.max_rows)?;
        }
        self.check_steps(layer, batch, false)?;
        Self::check_rows(layer, batch, (q.device, q.len(), q_row_stride), (out.device, out.len(), out_row_stride))?;
        let p = self.batch_params::<Q>(layer, batch, q_row_stride);
        for pass in 0..batch.passes {
            let meta = batch.pass_meta(pass);
            // SAFETY: the batch, k and v checked against the layer's lengths, which are
            // the batch's starts; pass `i`'s starts are those plus the rows of the passes
            // before it, which the launches before it appended (one stream). The decode:
            // as in `run_batch`, over the rows of this pass, whose slots' device lengths
            // its append set; partials of other rows are not written.
            unsafe {
                layer.enqueue_append::<T>(batch, meta, (k.addr(), k_stride), (v.addr(), v_stride))?;
                self.enqueue_decode(layer, &p, q.addr(), meta)?;
            }
        }
        // SAFETY: every row of the step had its partials written by its pass; the merge
        // reads the whole step's batch (its rows' slots, counts and first rows), out
        // checked above.
        unsafe {
            self.enqueue_merge::<O>(layer, &p, batch.max_rows as u32, out.addr(), out_row_stride, batch.meta.addr())?
        };
        layer.commit_batch(batch);
        Ok(())
    }

    /// The decode parameters of a step batch's rows (queries `q_row_stride` apart, of
    /// type `Q`).
    fn batch_params<Q: KvElement>(&self, layer: &DeviceLayer, batch: &StepBatch, q_row_stride: usize) -> DecodeParams {
        DecodeParams {
            q_seq_stride: 0,
            q_token_stride: q_row_stride as u32,
            q_dtype: Q::DTYPE,
            batch_rows: batch.max_rows as u32,
            batch_seqs: batch.max_seqs as u32,
            ..Self::params(
                layer,
                self.shape.max_seqs,
                self.num_splits,
                self.sm_scale,
                self.shape.max_q_len,
                self.attn_window,
            )
        }
    }

    /// `q` and `out` of a step batch's rows: `(device, elements, row stride)` each, of
    /// this device, strides of at least a row within `u32`, `batch.max_rows()` rows.
    fn check_rows(
        layer: &DeviceLayer,
        batch: &StepBatch,
        q: (u64, usize, usize),
        out: (u64, usize, usize),
    ) -> Result<()> {
        let dev = &layer.device;
        let (hq, d) = (layer.shape.num_q_heads, layer.config.head_dim);
        dev.check_view(q.0, "q")?;
        dev.check_view(out.0, "out")?;
        for (what, (_, len, stride)) in [("q", q), ("out", out)] {
            if stride < hq * d || stride > u32::MAX as usize {
                return Err(Error::Shape(format!("{what} row stride {stride}: at least {hq} heads x {d}, within u32")));
            }
            let need = (batch.max_rows - 1) * stride + hq * d;
            if len < need {
                return Err(Error::Shape(format!(
                    "{what} has {len} elements; the batch's {} rows at row stride {stride} need {need}",
                    batch.max_rows
                )));
            }
        }
        Ok(())
    }

    /// Every check of [`DecodePlan::run_batch`] that concerns the plan, the layer and the
    /// batch (not the query and output buffers), nothing enqueued: what a stack runs
    /// before replaying a captured step, whose launches skip the host (with
    /// [`DeviceLayer::advance`] for the append's side). A batch that fails it must not be
    /// replayed: the kernels would leave a slot with more rows than `max_q_len` undecoded
    /// (its rows written as zeros), never read out of bounds.
    /// The layer's lengths may be the batch's starts (before the step's
    /// [`DeviceLayer::advance`]) or its starts plus counts (after it).
    pub fn check_batch(&self, layer: &DeviceLayer, batch: &StepBatch) -> Result<()> {
        self.check_steps(layer, batch, false)
    }

    /// [`DecodePlan::check_batch`]; `appended`: the layer must hold the batch's tokens
    /// already (what a launch reads).
    fn check_steps(&self, layer: &DeviceLayer, batch: &StepBatch, appended: bool) -> Result<()> {
        self.check_layer(layer)?;
        if batch.device.0.id != layer.device.0.id {
            return Err(Error::Device("the step batch belongs to another device handle".into()));
        }
        let workspace_rows = self.shape.max_seqs * self.shape.max_q_len;
        if batch.max_rows > workspace_rows {
            return Err(Error::Shape(format!(
                "a step batch of {} rows; the plan's workspace holds {workspace_rows} (max_seqs x max_q_len)",
                batch.max_rows
            )));
        }
        for (slot, start, count) in batch.entries() {
            if slot >= self.shape.max_seqs {
                return Err(Error::Shape(format!(
                    "slot {slot} of the batch: the plan decodes 0 .. {}",
                    self.shape.max_seqs
                )));
            }
            if count > self.shape.max_q_len {
                return Err(Error::Shape(format!(
                    "slot {slot} has {count} rows this step; the plan takes at most {} per sequence",
                    self.shape.max_q_len
                )));
            }
            let len = layer.seqs[slot].as_ref().map_or(0, |s| s.len);
            if len != start + count && (appended || len != start) {
                return Err(Error::Shape(format!(
                    "slot {slot} holds {len} tokens, not the {} of the batch's append: append the batch to this layer \
                     first (DeviceLayer::append_batch)",
                    start + count
                )));
            }
        }
        self.check_live(layer)
    }

    /// The decode and merge launches of `p` (`rows` output rows), `meta` the step batch
    /// or 0.
    ///
    /// # Safety
    /// The kernels' contracts for `p` over the layer's and the plan's buffers, `q` and
    /// `out`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue<O: OutputElement>(
        &self,
        layer: &DeviceLayer,
        p: &DecodeParams,
        rows: u32,
        q: u64,
        out: u64,
        out_row_stride: usize,
        meta: u64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe {
            self.enqueue_decode(layer, p, q, meta)?;
            self.enqueue_merge::<O>(layer, p, rows, out, out_row_stride, meta)
        }
    }

    /// The decode launch of [`DecodePlan::enqueue`].
    ///
    /// # Safety
    /// As [`DecodePlan::enqueue`].
    unsafe fn enqueue_decode(&self, layer: &DeviceLayer, p: &DecodeParams, q: u64, meta: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe {
            raw::decode(
                &layer.device,
                p,
                &DecodePtrs {
                    q,
                    pool: layer.pool.addr(),
                    tables: layer.tables.addr(),
                    lens: layer.lens.addr(),
                    sides: layer.sides.addr(),
                    protected: layer.protected.addr(),
                    key_scale: layer.key_scale.addr(),
                    key_perm: layer.key_perm.addr(),
                    key_rot: layer.key_rot.addr(),
                    m: self.m.addr(),
                    l: self.l.addr(),
                    o: self.o.addr(),
                    meta,
                },
            )
        }
    }

    /// The merge launch of [`DecodePlan::enqueue`].
    ///
    /// # Safety
    /// As [`DecodePlan::enqueue`], the partials of every row written.
    unsafe fn enqueue_merge<O: OutputElement>(
        &self,
        layer: &DeviceLayer,
        p: &DecodeParams,
        rows: u32,
        out: u64,
        out_row_stride: usize,
        meta: u64,
    ) -> Result<()> {
        let mp = MergeParams {
            num_seqs: rows,
            num_q_heads: p.num_q_heads,
            num_kv_heads: p.num_kv_heads,
            head_dim: p.format.head_dim,
            num_splits: p.num_splits,
            flags: (p.flags & !crate::OUTPUT_FLAGS) | O::FLAG,
            out_row_stride: out_row_stride as u32,
            batch_seqs: p.batch_seqs,
            q_len: p.q_len,
        };
        // SAFETY: forwarded contract.
        unsafe {
            raw::merge(
                &layer.device,
                &mp,
                &MergePtrs {
                    m: self.m.addr(),
                    l: self.l.addr(),
                    o: self.o.addr(),
                    vperm_inv: layer.vperm_inv.addr(),
                    value_rot: layer.value_rot.addr(),
                    out,
                    meta,
                },
            )
        }
    }
}
