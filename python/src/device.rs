//! The device API (`rotkv::device`): a layer's cache in device memory, appends and decodes
//! through a fixed decode plan, the batched append and step decode of a serving step, on
//! the emulated GPU (`Device.sim()`) or on a CUDA GPU (`Device.cuda()`, on the caller's
//! stream). On the emulator device addresses are host addresses, so numpy arrays are the
//! device buffers: C-contiguous inputs are read in place and `out` is written in place
//! (other layouts of an input are copied first; `out` must be C-contiguous). On a GPU the
//! inputs and `out` are CUDA tensors by address ([`crate::devmem`]). The kernels run with
//! the GIL released.

use std::sync::{Mutex, MutexGuard, TryLockError};

use numpy::PyArrayMethods;
use pyo3::prelude::*;

use rotkv_lib::device::{self as dv, DeviceSlice, DeviceSliceMut};
use rotkv_lib::paged::LayerShape;

use crate::devmem::{DevElems, DevIn, DevOut, Dtype, dev_input, dev_output};
use crate::{Calibration, Config, Elems, OrPy, Seq, shape_err, to_py};

/// `m` locked, waited for with the GIL released: another thread may hold the lock for a
/// long call (an append or decode runs without the GIL), and waiting for it with the GIL
/// would stall every Python thread meanwhile.
fn lock<'a, T: Send>(py: Python<'_>, m: &'a Mutex<T>) -> PyResult<MutexGuard<'a, T>> {
    loop {
        match m.try_lock() {
            Ok(g) => return Ok(g),
            Err(TryLockError::WouldBlock) => py.detach(|| drop(m.lock())),
            Err(TryLockError::Poisoned(_)) => return Err(to_py(py, poisoned())),
        }
    }
}

/// `m` locked (inside a call that already released the GIL).
fn locked_in<T>(m: &Mutex<T>) -> rotkv_lib::Result<MutexGuard<'_, T>> {
    m.lock().map_err(|_| poisoned())
}

fn poisoned() -> rotkv_lib::Error {
    rotkv_lib::Error::Backend("an earlier call on this object panicked".into())
}

/// A device: the emulated GPU (`Device.sim()`), whose kernels are the CUDA kernels run
/// on the CPU by rotkv's SIMT emulator (slow: for tests and for checking a stack's use of
/// the device API without a GPU), or a CUDA GPU (`Device.cuda()`).
#[pyclass(name = "Device", module = "rotkv", frozen)]
pub struct PyDevice(pub(crate) dv::Device, pub(crate) Option<usize>);

#[pymethods]
impl PyDevice {
    /// The emulated GPU.
    #[staticmethod]
    fn sim() -> Self {
        PyDevice(dv::Device::sim(), None)
    }
    /// GPU `device` (its primary context, which torch uses too), launching on `stream`: a
    /// `CUstream` handle as an int (`torch.cuda.current_stream().cuda_stream`), or `None`
    /// for a new stream of rotkv's own. The stream must outlive the Device and everything
    /// made on it; tensors passed to calls must stay alive until the work enqueued on the
    /// stream is done (torch's caching allocator orders reuse on the stream a tensor was
    /// made on: pass that stream). Raises `RotkvError` without a CUDA driver or device.
    #[staticmethod]
    #[pyo3(signature = (device = 0, stream = None))]
    fn cuda(py: Python<'_>, device: usize, stream: Option<u64>) -> PyResult<Self> {
        use rotkv_lib::cuda::cudarc::driver::{CudaContext, sys};
        let err = |e: String| to_py(py, rotkv_lib::Error::Backend(e));
        // SAFETY: only probes whether the driver library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(err("no CUDA driver library on this machine".into()));
        }
        let ctx = CudaContext::new(device).map_err(|e| err(format!("CUDA device {device}: {e:?}")))?;
        let s = match stream {
            // SAFETY: the caller's handle of a live stream of this device's primary context,
            // which it keeps alive (the documented contract); the wrapper does not destroy it.
            Some(h) => unsafe { ctx.wrap_borrowed_stream(h as usize as sys::CUstream) },
            None => ctx.new_stream().map_err(|e| err(format!("a stream on device {device}: {e:?}")))?,
        };
        Ok(PyDevice(dv::Device::cuda(s).or_py(py)?, Some(device)))
    }
    /// "sim" or "cuda".
    #[getter]
    fn name(&self) -> &'static str {
        self.0.name()
    }
    /// Kernel launches enqueued on this device so far.
    #[getter]
    fn launches(&self) -> u64 {
        self.0.counters().launches as u64
    }
    fn __repr__(&self) -> String {
        match self.1 {
            Some(d) => format!("Device(cuda:{d})"),
            None => format!("Device({})", self.0.name()),
        }
    }
}

/// A read-only device view of an input (its elements in C order: the array itself when
/// C-contiguous, else the copy `elems` holds).
///
/// # Safety
/// The returned view borrows `e`'s memory: use it only while `e` lives and nothing writes
/// it (the caller holds numpy's read borrow of the array).
unsafe fn view<'a, T>(dev: &dv::Device, e: &'a [T]) -> rotkv_lib::Result<DeviceSlice<'a, T>> {
    // SAFETY: on the emulator a device address is a host address; `e` is a live, initialized
    // slice for `'a` that nothing writes meanwhile (the contract).
    unsafe { DeviceSlice::from_raw(dev, e.as_ptr().expose_provenance() as u64, e.len()) }
}

/// A read-only device view of a device tensor at `addr` of `len` elements of `T`.
///
/// # Safety
/// The tensor (held for the call by its Python object) lies there, on this device, and
/// nothing writes it while the view is used.
unsafe fn ptr_view<'a, T>(dev: &dv::Device, addr: u64, len: usize) -> rotkv_lib::Result<DeviceSlice<'a, T>> {
    // SAFETY: forwarded contract.
    unsafe { DeviceSlice::from_raw(dev, addr, len) }
}

/// `$body` over a device view `$v` of an input's elements ([`DevElems`]).
macro_rules! with_view {
    ($dev:expr, $elems:expr, |$v:ident| $body:expr) => {
        match $elems {
            // SAFETY (all arms): the views live only inside this call, while the arrays or
            // tensors are held.
            DevElems::Host(Elems::F32(x)) => {
                let $v = unsafe { view($dev, &x[..]) }?;
                $body
            }
            DevElems::Host(Elems::F16(x)) => {
                let $v = unsafe { view($dev, &x[..]) }?;
                $body
            }
            DevElems::Host(Elems::Bf16(x)) => {
                let $v = unsafe { view($dev, &x[..]) }?;
                $body
            }
            DevElems::Ptr(a, n, Dtype::F32) => {
                let $v = unsafe { ptr_view::<f32>($dev, *a, *n) }?;
                $body
            }
            DevElems::Ptr(a, n, Dtype::F16) => {
                let $v = unsafe { ptr_view::<half::f16>($dev, *a, *n) }?;
                $body
            }
            DevElems::Ptr(a, n, Dtype::Bf16) => {
                let $v = unsafe { ptr_view::<half::bf16>($dev, *a, *n) }?;
                $body
            }
        }
    };
}

/// `$body` over device views `$k`, `$v` of K and V elements of one dtype (`Error::Shape`
/// for two dtypes, `$kd` and `$vd` their names).
macro_rules! with_kv_views {
    ($dev:expr, ($ke:expr, $kd:expr), ($ve:expr, $vd:expr), |$k:ident, $v:ident| $body:expr) => {
        match ($ke, $ve) {
            // SAFETY (all arms): the views borrow the held arrays or tensors for this call
            // only.
            (DevElems::Host(Elems::F32(k)), DevElems::Host(Elems::F32(v))) => {
                let ($k, $v) = unsafe { (view($dev, &k[..])?, view($dev, &v[..])?) };
                $body
            }
            (DevElems::Host(Elems::F16(k)), DevElems::Host(Elems::F16(v))) => {
                let ($k, $v) = unsafe { (view($dev, &k[..])?, view($dev, &v[..])?) };
                $body
            }
            (DevElems::Host(Elems::Bf16(k)), DevElems::Host(Elems::Bf16(v))) => {
                let ($k, $v) = unsafe { (view($dev, &k[..])?, view($dev, &v[..])?) };
                $body
            }
            (DevElems::Ptr(ka, kn, Dtype::F32), DevElems::Ptr(va, vn, Dtype::F32)) => {
                let ($k, $v) = unsafe { (ptr_view::<f32>($dev, *ka, *kn)?, ptr_view::<f32>($dev, *va, *vn)?) };
                $body
            }
            (DevElems::Ptr(ka, kn, Dtype::F16), DevElems::Ptr(va, vn, Dtype::F16)) => {
                let ($k, $v) =
                    unsafe { (ptr_view::<half::f16>($dev, *ka, *kn)?, ptr_view::<half::f16>($dev, *va, *vn)?) };
                $body
            }
            (DevElems::Ptr(ka, kn, Dtype::Bf16), DevElems::Ptr(va, vn, Dtype::Bf16)) => {
                let ($k, $v) =
                    unsafe { (ptr_view::<half::bf16>($dev, *ka, *kn)?, ptr_view::<half::bf16>($dev, *va, *vn)?) };
                $body
            }
            _ => Err(rotkv_lib::Error::Shape(format!(
                "k is {} but v is {} (one dtype, both host or both device)",
                $kd, $vd
            ))),
        }
    };
}

/// One layer's cache in device memory (`rotkv::device::DeviceLayer`).
#[pyclass(name = "DeviceLayer", module = "rotkv", frozen)]
pub struct PyLayer {
    inner: Mutex<dv::DeviceLayer>,
    device: dv::Device,
    /// The Device's GPU, or `None` on the emulated device.
    ordinal: Option<usize>,
    num_kv_heads: usize,
    num_q_heads: usize,
    head_dim: usize,
}

impl PyLayer {
    fn kv_rows<'py>(&self, py: Python<'py>, what: &str, a: &Bound<'py, PyAny>) -> PyResult<DevIn<'py>> {
        let held = dev_input(py, self.ordinal, what, a, 3)?;
        let want = [held.shape()[0], self.num_kv_heads, self.head_dim];
        if held.shape() != want {
            return Err(shape_err(py, format!("{what} has shape {:?}, expected {want:?}", held.shape())));
        }
        Ok(held)
    }
}

#[pymethods]
impl PyLayer {
    /// `DeviceLayer(device, config, num_kv_heads, num_q_heads, max_seqs, max_tokens,
    /// calibration=None, num_blocks=None)`.
    #[new]
    #[pyo3(signature = (device, config, num_kv_heads, num_q_heads, max_seqs, max_tokens, calibration = None, num_blocks = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: &PyDevice,
        config: &Config,
        num_kv_heads: usize,
        num_q_heads: usize,
        max_seqs: usize,
        max_tokens: usize,
        calibration: Option<&Calibration>,
        num_blocks: Option<usize>,
    ) -> PyResult<Self> {
        let config = config.to_rust().or_py(py)?;
        let shape = LayerShape { num_kv_heads, num_q_heads };
        if num_kv_heads == 0 || config.head_dim == 0 {
            return Err(shape_err(py, "num_kv_heads must be positive".into()));
        }
        let calib = match calibration {
            Some(c) => c.inner.clone(),
            None => rotkv_lib::LayerCalibration::identity(num_kv_heads, config.head_dim),
        };
        let size = dv::LayerSize { max_seqs, max_tokens, num_blocks };
        let dev = device.0.clone();
        let layer = py.detach(|| dv::DeviceLayer::new(&dev, config, shape, calib, size)).or_py(py)?;
        Ok(Self {
            inner: Mutex::new(layer),
            device: dev,
            ordinal: device.1,
            num_kv_heads,
            num_q_heads,
            head_dim: config.head_dim,
        })
    }
    /// Starts a new sequence in the lowest free slot.
    fn add_sequence(&self, py: Python<'_>) -> PyResult<Seq> {
        lock(py, &self.inner)?.add_sequence().or_py(py).map(Seq)
    }
    /// Frees a sequence and its blocks.
    fn free_sequence(&self, py: Python<'_>, seq: Seq) -> PyResult<()> {
        lock(py, &self.inner)?.free_sequence(seq.0).or_py(py)
    }
    /// Tokens of `seq`.
    fn len(&self, py: Python<'_>, seq: Seq) -> PyResult<usize> {
        lock(py, &self.inner)?.len(seq.0).or_py(py)
    }
    /// Blocks not held by any sequence.
    #[getter]
    fn free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(py, &self.inner)?.free_blocks())
    }
    /// Takes blocks so that `seq` can hold `len` tokens (before a batched append).
    fn reserve(&self, py: Python<'_>, seq: Seq, len: usize) -> PyResult<usize> {
        lock(py, &self.inner)?.reserve(seq.0, len).or_py(py)
    }
    /// Protects positions of `seq` (as `KvCache.protect`).
    fn protect(&self, py: Python<'_>, seq: Seq, positions: Vec<u32>) -> PyResult<()> {
        lock(py, &self.inner)?.protect(seq.0, &positions).or_py(py)
    }
    /// Appends tokens to `seq`: `k`, `v` `[tokens, num_kv_heads, head_dim]`, one dtype.
    fn append(&self, py: Python<'_>, seq: Seq, k: &Bound<'_, PyAny>, v: &Bound<'_, PyAny>) -> PyResult<usize> {
        let (kh, vh) = (self.kv_rows(py, "k", k)?, self.kv_rows(py, "v", v)?);
        if kh.shape()[0] != vh.shape()[0] {
            return Err(shape_err(py, format!("k has {} tokens, v {}", kh.shape()[0], vh.shape()[0])));
        }
        let tokens = kh.shape()[0];
        let (ke, ve) = (kh.elems(), vh.elems());
        let (kd, vd) = (kh.dtype(), vh.dtype());
        let dev = &self.device;
        let row = self.num_kv_heads * self.head_dim;
        py.detach(|| -> rotkv_lib::Result<usize> {
            let mut layer = locked_in(&self.inner)?;
            with_kv_views!(dev, (&ke, kd), (&ve, vd), |k, v| layer.append_strided(seq.0, tokens, &k, row, &v, row))
        })
        .or_py(py)
    }
    /// The batched append of a serving step: the rows `batch` describes, from `k` and `v`
    /// `[batch.max_rows, num_kv_heads, head_dim]`; every slot's length moves on by its
    /// count (reserve the blocks first).
    fn append_batch(
        &self,
        py: Python<'_>,
        batch: &PyStepBatch,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (kh, vh) = (self.kv_rows(py, "k", k)?, self.kv_rows(py, "v", v)?);
        let (ke, ve) = (kh.elems(), vh.elems());
        let (kd, vd) = (kh.dtype(), vh.dtype());
        let dev = &self.device;
        let row = self.num_kv_heads * self.head_dim;
        py.detach(|| -> rotkv_lib::Result<()> {
            let mut layer = locked_in(&self.inner)?;
            let batch = locked_in(&batch.inner)?;
            with_kv_views!(dev, (&ke, kd), (&ve, vd), |k, v| layer.append_batch(&batch, &k, row, &v, row))
        })
        .or_py(py)
    }
    /// The host's side of `append_batch` without enqueuing anything (the checks, then every
    /// slot's length moved on by its count): for a step whose launches a captured CUDA
    /// graph replays (`rotkv::device::DeviceLayer::advance`).
    fn advance(&self, py: Python<'_>, batch: &PyStepBatch) -> PyResult<()> {
        let b = lock(py, &batch.inner)?;
        lock(py, &self.inner)?.advance(&b).or_py(py)
    }
    /// The pool (bytes) and side stores (uint16 bit patterns of f16) as stored.
    fn read_cache<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, pyo3::types::PyBytes>, Bound<'py, PyAny>)> {
        let (pool, sides) = lock(py, &self.inner)?.read_cache().or_py(py)?;
        let sides: Vec<u16> = sides.iter().map(|x| x.to_bits()).collect();
        Ok((pyo3::types::PyBytes::new(py, &pool), numpy::PyArray1::from_vec(py, sides).into_any()))
    }
}

/// The rows of one serving step (`rotkv::device::StepBatch`): which slots take how many
/// new tokens.
#[pyclass(name = "StepBatch", module = "rotkv", frozen)]
pub struct PyStepBatch {
    inner: Mutex<dv::StepBatch>,
}

#[pymethods]
impl PyStepBatch {
    /// `StepBatch(device, max_seqs, max_rows, pass_rows=None, passes=1)`: with
    /// `pass_rows`, `DecodePlan.run_step` runs each step in `passes` passes of at most
    /// `pass_rows` rows per sequence (`Config.pass_rows`: half the window).
    #[new]
    #[pyo3(signature = (device, max_seqs, max_rows, pass_rows = None, passes = 1))]
    fn new(
        py: Python<'_>,
        device: &PyDevice,
        max_seqs: usize,
        max_rows: usize,
        pass_rows: Option<usize>,
        passes: usize,
    ) -> PyResult<Self> {
        let b = dv::StepBatch::with_passes(&device.0, max_seqs, max_rows, pass_rows.unwrap_or(max_rows), passes);
        Ok(Self { inner: Mutex::new(b.or_py(py)?) })
    }
    /// Passes of `DecodePlan.run_step`.
    #[getter]
    fn passes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(py, &self.inner)?.passes())
    }
    /// Most rows of one sequence per pass.
    #[getter]
    fn pass_rows(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(py, &self.inner)?.pass_rows())
    }
    /// Sets the step: `steps` is a list of `(seq, tokens)`; rows are laid out in that
    /// order (uploaded now).
    fn set(&self, py: Python<'_>, layer: &PyLayer, steps: Vec<(Seq, usize)>) -> PyResult<()> {
        let steps: Vec<_> = steps.into_iter().map(|(s, n)| (s.0, n)).collect();
        let layer = lock(py, &layer.inner)?;
        lock(py, &self.inner)?.set(&layer, &steps).or_py(py)
    }
    /// Rows this step uses.
    #[getter]
    fn rows(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(py, &self.inner)?.rows())
    }
    #[getter]
    fn max_rows(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(py, &self.inner)?.max_rows())
    }
}

/// A fixed decode launch for a batch shape (`rotkv::device::DecodePlan`).
#[pyclass(name = "DecodePlan", module = "rotkv", frozen)]
pub struct PyPlan {
    inner: Mutex<dv::DecodePlan>,
    max_seqs: usize,
}

#[pymethods]
impl PyPlan {
    /// `DecodePlan(layer, max_seqs, max_q_len, max_context, sm_scale=None,
    /// window_left=None)`.
    #[new]
    #[pyo3(signature = (layer, max_seqs, max_q_len, max_context, sm_scale = None, window_left = None))]
    fn new(
        py: Python<'_>,
        layer: &PyLayer,
        max_seqs: usize,
        max_q_len: usize,
        max_context: usize,
        sm_scale: Option<f32>,
        window_left: Option<usize>,
    ) -> PyResult<Self> {
        let shape = dv::PlanShape { max_seqs, max_q_len, max_context, sm_count: None, blocks_per_sm: None, sm_scale };
        let l = lock(py, &layer.inner)?;
        let plan = dv::DecodePlan::new_windowed(&l, shape, window_left).or_py(py)?;
        Ok(Self { inner: Mutex::new(plan), max_seqs })
    }
    /// Every check of `run_batch` on the plan, the layer and the batch, nothing
    /// enqueued: what a stack runs before replaying a captured step (with
    /// `DeviceLayer.advance`).
    fn check_batch(&self, py: Python<'_>, layer: &PyLayer, batch: &PyStepBatch) -> PyResult<()> {
        let (b, l) = (lock(py, &batch.inner)?, lock(py, &layer.inner)?);
        lock(py, &self.inner)?.check_batch(&l, &b).or_py(py)
    }
    /// The split-K count chosen.
    #[getter]
    fn num_splits(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(lock(py, &self.inner)?.num_splits())
    }
    /// Decodes slots `0 .. max_seqs` of `layer`, `q_len` rows each: `q` is `[max_seqs,
    /// q_len, num_q_heads, head_dim]`; returns (or writes into `out`) float32 of that
    /// shape. An empty slot's rows are zeros.
    #[pyo3(signature = (layer, q, out = None))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        layer: &PyLayer,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let held = dev_input(py, layer.ordinal, "q", q, 4)?;
        let s = held.shape().to_vec();
        let want = [self.max_seqs, s[1], layer.num_q_heads, layer.head_dim];
        if s != want {
            return Err(shape_err(
                py,
                format!("q has shape {s:?}, expected {want:?} ([max_seqs, q_len, q_heads, head_dim])"),
            ));
        }
        let q_len = s[1];
        self.decode_into(py, layer, None, held, out, |plan, l, _, q, ov| {
            let dev = &layer.device;
            with_view!(dev, q, |qv| plan.run(l, q_len, &qv, ov))
        })
    }
    /// The step decode: the rows of `batch` (appended with `layer.append_batch` first),
    /// `q` `[batch.max_rows, num_q_heads, head_dim]`; returns (or writes into `out`)
    /// float32 of that shape (rows the step does not use are zeros).
    #[pyo3(signature = (layer, batch, q, out = None))]
    fn run_batch<'py>(
        &self,
        py: Python<'py>,
        layer: &PyLayer,
        batch: &PyStepBatch,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let row = layer.num_q_heads * layer.head_dim;
        let held = step_rows(py, layer, q)?;
        self.decode_into(py, layer, Some(batch), held, out, |plan, l, b, q, ov| {
            let (dev, b) = (&layer.device, b.expect("a batch"));
            with_view!(dev, q, |qv| plan.run_batch(l, b, &qv, row, ov, row))
        })
    }
    /// A whole step of `layer` in the batch's passes (`rotkv::device::DecodePlan::
    /// run_step`): appends the rows of `batch` from `k` and `v` `[batch.max_rows,
    /// num_kv_heads, head_dim]` and decodes them, `q` `[batch.max_rows, num_q_heads,
    /// head_dim]`; returns (or writes into `out`) float32 of `q`'s shape (rows the step
    /// does not use are zeros). Each row sees the earlier rows of its pass in f16.
    #[pyo3(signature = (layer, batch, k, v, q, out = None))]
    #[allow(clippy::too_many_arguments)]
    fn run_step<'py>(
        &self,
        py: Python<'py>,
        layer: &PyLayer,
        batch: &PyStepBatch,
        k: &Bound<'py, PyAny>,
        v: &Bound<'py, PyAny>,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (kh, vh) = (layer.kv_rows(py, "k", k)?, layer.kv_rows(py, "v", v)?);
        let (ke, ve) = (kh.elems(), vh.elems());
        let (kd, vd) = (kh.dtype(), vh.dtype());
        let (row, qrow) = (layer.num_kv_heads * layer.head_dim, layer.num_q_heads * layer.head_dim);
        let held = step_rows(py, layer, q)?;
        self.decode_into(py, layer, Some(batch), held, out, |plan, l, b, q, ov| {
            let (dev, b) = (&layer.device, b.expect("a batch"));
            with_kv_views!(dev, (&ke, kd), (&ve, vd), |k, v| {
                with_view!(dev, q, |qv| plan.run_step(l, b, (&k, row), (&v, row), &qv, qrow, ov, qrow))
            })
        })
    }
}

/// `q` of a step's rows, `[max_rows, q_heads, head_dim]`, held for the call.
fn step_rows<'py>(py: Python<'py>, layer: &PyLayer, q: &Bound<'py, PyAny>) -> PyResult<DevIn<'py>> {
    let held = dev_input(py, layer.ordinal, "q", q, 3)?;
    let s = held.shape();
    if s[1..] != [layer.num_q_heads, layer.head_dim] {
        return Err(shape_err(py, format!("q has shape {s:?}, expected [max_rows, q_heads, head_dim]")));
    }
    Ok(held)
}

impl PyPlan {
    /// The shared part of `run`, `run_batch` and `run_step`: the output made (or `out`
    /// checked) for `q`'s shape, then `run` with the GIL released and the plan, layer and
    /// batch locked, over the query's elements and the output's view.
    fn decode_into<'py>(
        &self,
        py: Python<'py>,
        layer: &PyLayer,
        batch: Option<&PyStepBatch>,
        held: DevIn<'py>,
        out: Option<&Bound<'py, PyAny>>,
        run: impl FnOnce(
            &mut dv::DecodePlan,
            &mut dv::DeviceLayer,
            Option<&dv::StepBatch>,
            &DevElems,
            &mut DeviceSliceMut<'_, f32>,
        ) -> rotkv_lib::Result<()>
        + Send,
    ) -> PyResult<Bound<'py, PyAny>> {
        let out = dev_output(py, layer.ordinal, out, held.shape(), &[&held])?;
        let q = held.elems();
        let dev = &layer.device;
        let go = |addr: u64, len: usize| {
            py.detach(|| -> rotkv_lib::Result<()> {
                let mut plan = locked_in(&self.inner)?;
                let mut l = locked_in(&layer.inner)?;
                let b = batch.map(|b| locked_in(&b.inner)).transpose()?;
                // SAFETY: `addr` is the held, writeable, C-contiguous output of `len` f32 of
                // this device, for this call only.
                let mut ov: DeviceSliceMut<'_, f32> = unsafe { DeviceSliceMut::from_raw(dev, addr, len) }?;
                run(&mut plan, &mut l, b.as_deref(), &q, &mut ov)
            })
            .or_py(py)
        };
        match out {
            DevOut::Host(a) => {
                let mut w = a.try_readwrite().map_err(|e| shape_err(py, format!("out: {e}")))?;
                let o = w.as_slice_mut().map_err(|e| shape_err(py, format!("out: {e}")))?;
                go(o.as_mut_ptr().expose_provenance() as u64, o.len())?;
                drop(w);
                Ok(a.into_any())
            }
            DevOut::Ptr(p, obj) => {
                go(p.addr, p.len)?;
                Ok(obj)
            }
        }
    }
}
