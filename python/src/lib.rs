//! The `rotkv` Python module: [`rotkv_lib::KvCache`] over numpy arrays (and anything numpy
//! reads through DLPack, such as CPU `torch.Tensor`s).
//!
//! Inputs (keys, values, queries) may be float32, float16 or bfloat16 (`ml_dtypes`'
//! `bfloat16`); a C-contiguous array is read in place, any other layout is copied first.
//! A misaligned array is copied too, and one of non-native byte order refused.
//! Outputs are float32: returned as new arrays, or written into a caller's `out=` array,
//! which must be float32, C-contiguous, aligned, writeable, of the exact shape, and must
//! not share memory with an input (`numpy.may_share_memory`; refused otherwise). Every call validates before it
//! changes anything; a failed call raises a `rotkv.RotkvError` (a `ValueError` or
//! `MemoryError` subclass where that fits) carrying the Rust library's message, and the
//! cache is unchanged. Appends and decodes run with the GIL released.
//!
//! The device API on the emulated GPU or a CUDA GPU (`Device`, `DeviceLayer`, `StepBatch`,
//! `DecodePlan`) is in [`device`].

mod device;
mod devmem;

use std::borrow::Cow;
use std::sync::{Mutex, MutexGuard};

use half::{bf16, f16};
use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyType};

/// The exception classes, made in Python at import (a class with two built-in bases
/// cannot be declared from Rust).
const ERRORS_PY: &std::ffi::CStr = cr#"
class RotkvError(Exception):
    """Base of every error rotkv raises; the message is the Rust library's."""

class RotkvValueError(RotkvError, ValueError):
    """A bad shape, dtype, layout, value, sequence id, layer or calibration."""

class RotkvMemoryError(RotkvError, MemoryError):
    """The cache, or a sequence, has no room left (rotkv's capacity errors)."""
"#;

struct Errors {
    base: Py<PyType>,
    value: Py<PyType>,
    memory: Py<PyType>,
}

static ERRORS: PyOnceLock<Errors> = PyOnceLock::new();

fn errors(py: Python<'_>) -> PyResult<&Errors> {
    ERRORS.get_or_try_init(py, || {
        let m = PyModule::from_code(py, ERRORS_PY, c"rotkv_errors.py", c"rotkv._errors")?;
        let get = |name: &str| -> PyResult<Py<PyType>> {
            let t = m.getattr(name)?.cast_into::<PyType>()?;
            t.setattr("__module__", "rotkv")?;
            Ok(t.unbind())
        };
        Ok(Errors { base: get("RotkvError")?, value: get("RotkvValueError")?, memory: get("RotkvMemoryError")? })
    })
}

/// The Python exception for a Rust error: capacity errors are `MemoryError`s, errors
/// about the call's arguments `ValueError`s, the rest (a backend, a device, a file)
/// plain `RotkvError`s; the message is the Rust error's.
fn to_py(py: Python<'_>, e: rotkv_lib::Error) -> PyErr {
    use rotkv_lib::Error as E;
    let errs = match errors(py) {
        Ok(errs) => errs,
        Err(e) => return e,
    };
    let ty = match e {
        E::Capacity(_) => &errs.memory,
        E::Unsupported(_)
        | E::Shape(_)
        | E::Value(_)
        | E::UnknownSequence(_)
        | E::Layer { .. }
        | E::BlockTable { .. }
        | E::AliasedBlock { .. }
        | E::Calibration(_) => &errs.value,
        E::Backend(_) | E::Device(_) | E::Input(_) => &errs.base,
    };
    PyErr::from_type(ty.bind(py).clone(), e.to_string())
}

/// `rotkv_lib::Error::Shape(msg)` as a Python exception.
fn shape_err(py: Python<'_>, msg: String) -> PyErr {
    to_py(py, rotkv_lib::Error::Shape(msg))
}

/// `rotkv_lib::Result` to `PyResult`, the error as its Python exception ([`to_py`]).
trait OrPy<T> {
    fn or_py(self, py: Python<'_>) -> PyResult<T>;
}
impl<T> OrPy<T> for rotkv_lib::Result<T> {
    fn or_py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// An input array, borrowed read-only from numpy (numpy's borrow tracking refuses a
/// writeable borrow of the same memory while this lives).
enum Held<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    F16(PyReadonlyArrayDyn<'py, f16>),
    Bf16(PyReadonlyArrayDyn<'py, bf16>),
}

/// An input's elements in C order: borrowed when the array is C-contiguous, else copied.
enum Elems<'a> {
    F32(Cow<'a, [f32]>),
    F16(Cow<'a, [f16]>),
    Bf16(Cow<'a, [bf16]>),
}

fn elems<'a, T: numpy::Element + Copy>(a: &'a PyReadonlyArrayDyn<'_, T>) -> Cow<'a, [T]> {
    // (`as_slice` also accepts Fortran order, whose memory order is not C order.)
    match a.as_slice() {
        Ok(s) if a.is_c_contiguous() => Cow::Borrowed(s),
        _ => Cow::Owned(a.as_array().iter().copied().collect()),
    }
}

impl Held<'_> {
    fn shape(&self) -> &[usize] {
        match self {
            Held::F32(a) => a.shape(),
            Held::F16(a) => a.shape(),
            Held::Bf16(a) => a.shape(),
        }
    }
    fn dtype(&self) -> &'static str {
        match self {
            Held::F32(_) => "float32",
            Held::F16(_) => "float16",
            Held::Bf16(_) => "bfloat16",
        }
    }
    /// The array itself (for `numpy.may_share_memory`).
    fn array(&self) -> &Bound<'_, PyAny> {
        match self {
            Held::F32(a) => a.as_any(),
            Held::F16(a) => a.as_any(),
            Held::Bf16(a) => a.as_any(),
        }
    }
    fn elems(&self) -> Elems<'_> {
        match self {
            Held::F32(a) => Elems::F32(elems(a)),
            Held::F16(a) => Elems::F16(elems(a)),
            Held::Bf16(a) => Elems::Bf16(elems(a)),
        }
    }
}

/// `obj` as a numpy array: itself, or `numpy.from_dlpack(obj)` for an object with
/// `__dlpack__` (a CPU `torch.Tensor`: shares its memory).
fn ndarray<'py>(py: Python<'py>, what: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyUntypedArray>> {
    if let Ok(a) = obj.cast::<PyUntypedArray>() {
        return Ok(a.clone());
    }
    if obj.hasattr("__dlpack__")? {
        let np = py.import("numpy")?;
        // torch's bfloat16 has no numpy dtype: its bits are read through DLPack as int16
        // and viewed as ml_dtypes' bfloat16 (no copy).
        if obj.hasattr("dtype")? && obj.getattr("dtype")?.str()?.to_cow()? == "torch.bfloat16" {
            let Ok(ml) = py.import("ml_dtypes") else {
                return Err(shape_err(py, format!("{what}: a torch bfloat16 tensor needs the ml_dtypes package")));
            };
            let bits = obj.call_method1("view", (py.import("torch")?.getattr("int16")?,))?;
            return match np.call_method1("from_dlpack", (bits,)) {
                Ok(a) => Ok(a.call_method1("view", (ml.getattr("bfloat16")?,))?.cast_into::<PyUntypedArray>()?),
                Err(e) => Err(shape_err(py, format!("{what}: numpy cannot read it through DLPack: {e}"))),
            };
        }
        return match np.call_method1("from_dlpack", (obj,)) {
            Ok(a) => Ok(a.cast_into::<PyUntypedArray>()?),
            Err(e) => Err(shape_err(py, format!("{what}: numpy cannot read it through DLPack: {e}"))),
        };
    }
    Err(shape_err(
        py,
        format!(
            "{what} must be a numpy array or a DLPack tensor (a CPU torch.Tensor), not {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ),
    ))
}

/// An input of `ndim` dimensions and dtype float32, float16 or bfloat16.
fn input<'py>(py: Python<'py>, what: &str, obj: &Bound<'py, PyAny>, ndim: usize) -> PyResult<Held<'py>> {
    let a = ndarray(py, what, obj)?;
    if a.ndim() != ndim {
        return Err(shape_err(py, format!("{what} has {} dimensions {:?}, expected {ndim}", a.ndim(), a.shape())));
    }
    let dtype = a.dtype();
    if !dtype.getattr("isnative")?.extract::<bool>()? {
        return Err(shape_err(
            py,
            format!("{what} is not in native byte order: pass a.astype(a.dtype.newbyteorder('='))"),
        ));
    }
    // A misaligned array (numpy.frombuffer at an odd offset) is copied into an aligned,
    // C-contiguous one, which the borrow below keeps alive for the call.
    let a = if a.getattr("flags")?.getattr("aligned")?.extract::<bool>()? {
        a
    } else {
        py.import("numpy")?.call_method1("require", (a, py.None(), "CA"))?.cast_into::<PyUntypedArray>()?
    };
    let name: String = dtype.getattr("name")?.extract()?;
    let held = match name.as_str() {
        "float32" => Held::F32(a.cast::<PyArrayDyn<f32>>()?.try_readonly().map_err(|e| borrow_err(py, what, e))?),
        "float16" => Held::F16(a.cast::<PyArrayDyn<f16>>()?.try_readonly().map_err(|e| borrow_err(py, what, e))?),
        // ml_dtypes' bfloat16 (registered with numpy when ml_dtypes is imported, which it
        // must have been for an array of it to exist).
        "bfloat16" if dtype.itemsize() == 2 => {
            Held::Bf16(a.cast::<PyArrayDyn<bf16>>()?.try_readonly().map_err(|e| borrow_err(py, what, e))?)
        }
        other => {
            return Err(shape_err(py, format!("{what} has dtype {other}; expected float32, float16 or bfloat16")));
        }
    };
    Ok(held)
}

fn borrow_err(py: Python<'_>, what: &str, e: numpy::BorrowError) -> PyErr {
    shape_err(py, format!("{what}: {e} (is it also the output?)"))
}

/// The output: `out` checked (float32, C-contiguous, aligned, writeable, `shape`, no
/// memory shared with `inputs`) or a new zeroed array.
fn output<'py>(
    py: Python<'py>,
    out: Option<&Bound<'py, PyAny>>,
    shape: &[usize],
    inputs: &[&Held<'_>],
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let Some(out) = out else {
        return Ok(PyArrayDyn::<f32>::zeros(py, shape, false));
    };
    let a = out.cast::<PyUntypedArray>().map_err(|_| shape_err(py, "out must be a numpy array of float32".into()))?;
    let dtype: String = a.dtype().getattr("name")?.extract()?;
    if dtype != "float32" {
        return Err(shape_err(py, format!("out has dtype {dtype}; it must be float32")));
    }
    if a.shape() != shape {
        return Err(shape_err(py, format!("out has shape {:?}, expected {shape:?}", a.shape())));
    }
    if !a.is_c_contiguous() {
        return Err(shape_err(py, "out must be C-contiguous (results are written in place)".into()));
    }
    if !a.getattr("flags")?.getattr("aligned")?.extract::<bool>()? {
        return Err(shape_err(py, "out must be aligned for float32".into()));
    }
    // numpy's borrow tracking sees shared memory only between arrays of one base object;
    // two views of one torch tensor or one file have different bases.
    let np = py.import("numpy")?;
    for h in inputs {
        if np.call_method1("may_share_memory", (a, h.array()))?.extract::<bool>()? {
            return Err(shape_err(py, "out shares memory with an input: pass a separate array".into()));
        }
    }
    Ok(a.cast::<PyArrayDyn<f32>>()?.clone())
}

/// Runs `f` on the cache with the GIL released; the cache's lock is taken inside, so a
/// thread waiting for it does not hold the GIL.
fn locked<R: Send>(
    py: Python<'_>,
    cache: &Mutex<rotkv_lib::KvCache>,
    f: impl FnOnce(&mut rotkv_lib::KvCache) -> rotkv_lib::Result<R> + Send,
) -> PyResult<R> {
    py.detach(|| {
        let mut guard: MutexGuard<'_, rotkv_lib::KvCache> = cache.lock().map_err(|_| {
            rotkv_lib::Error::Backend("an earlier call on this cache panicked; make a new cache".into())
        })?;
        f(&mut guard)
    })
    .or_py(py)
}

/// A cache configuration: what fixes the byte format of a layer (see the presets
/// `CacheConfig.k2v2`, `k4v2`, `k4v4`). Fields may be changed before a cache is made.
#[pyclass(name = "CacheConfig", module = "rotkv")]
#[derive(Clone)]
struct Config {
    #[pyo3(get, set)]
    head_dim: usize,
    #[pyo3(get, set)]
    key_bits: u32,
    #[pyo3(get, set)]
    value_bits: u32,
    #[pyo3(get, set)]
    group_size: usize,
    #[pyo3(get, set)]
    page_size: usize,
    #[pyo3(get, set)]
    sinks: usize,
    #[pyo3(get, set)]
    window: usize,
    /// "hadamard" or "none".
    #[pyo3(get, set)]
    key_rotation: String,
    /// "hadamard" or "none".
    #[pyo3(get, set)]
    value_rotation: String,
    #[pyo3(get, set)]
    key_clip: f32,
    #[pyo3(get, set)]
    value_clip: f32,
    #[pyo3(get, set)]
    protected: usize,
    #[pyo3(get, set)]
    channel_norm: u32,
}

fn rotation_name(r: rotkv_lib::Rotation) -> String {
    match r {
        rotkv_lib::Rotation::None => "none".into(),
        rotkv_lib::Rotation::Hadamard => "hadamard".into(),
    }
}

impl Config {
    fn from_rust(c: rotkv_lib::CacheConfig) -> Self {
        Self {
            head_dim: c.head_dim,
            key_bits: c.key_bits,
            value_bits: c.value_bits,
            group_size: c.group_size,
            page_size: c.page_size,
            sinks: c.sinks,
            window: c.window,
            key_rotation: rotation_name(c.key_rotation),
            value_rotation: rotation_name(c.value_rotation),
            key_clip: c.key_clip,
            value_clip: c.value_clip,
            protected: c.protected,
            channel_norm: c.channel_norm,
        }
    }
    /// The Rust configuration, checked (`CacheConfig::format`).
    fn to_rust(&self) -> rotkv_lib::Result<rotkv_lib::CacheConfig> {
        let rotation = |what: &str, r: &str| match r {
            "none" => Ok(rotkv_lib::Rotation::None),
            "hadamard" => Ok(rotkv_lib::Rotation::Hadamard),
            other => Err(rotkv_lib::Error::Unsupported(format!("{what} {other:?} (\"hadamard\" or \"none\")"))),
        };
        let c = rotkv_lib::CacheConfig {
            head_dim: self.head_dim,
            key_bits: self.key_bits,
            value_bits: self.value_bits,
            group_size: self.group_size,
            page_size: self.page_size,
            sinks: self.sinks,
            window: self.window,
            key_rotation: rotation("key_rotation", &self.key_rotation)?,
            value_rotation: rotation("value_rotation", &self.value_rotation)?,
            key_clip: self.key_clip,
            value_clip: self.value_clip,
            protected: self.protected,
            channel_norm: self.channel_norm,
        };
        c.format()?;
        Ok(c)
    }
}

#[pymethods]
impl Config {
    /// `CacheConfig(preset="k2v2", head_dim=128, **fields)`: a preset with some fields
    /// changed (any field name of this class).
    #[new]
    #[pyo3(signature = (preset = "k2v2", head_dim = 128, **fields))]
    fn new(py: Python<'_>, preset: &str, head_dim: usize, fields: Option<&Bound<'_, PyDict>>) -> PyResult<Py<Self>> {
        let c = Py::new(py, Self::from_rust(rotkv_lib::CacheConfig::preset(preset, head_dim).or_py(py)?))?;
        if let Some(fields) = fields {
            let bound = c.bind(py);
            for (k, v) in fields.iter() {
                let name: String = k.extract()?;
                if name.starts_with('_') || !bound.hasattr(name.as_str())? {
                    return Err(to_py(py, rotkv_lib::Error::Unsupported(format!("CacheConfig has no field {name:?}"))));
                }
                bound.setattr(name.as_str(), v)?;
            }
        }
        Ok(c)
    }
    /// The k2v2 preset: 2-bit keys and values (the default).
    #[staticmethod]
    fn k2v2(head_dim: usize) -> Self {
        Self::from_rust(rotkv_lib::CacheConfig::k2v2(head_dim))
    }
    /// The k4v2 preset: 4-bit keys, 2-bit values.
    #[staticmethod]
    fn k4v2(head_dim: usize) -> Self {
        Self::from_rust(rotkv_lib::CacheConfig::k4v2(head_dim))
    }
    /// The k4v4 preset: 4-bit keys and values.
    #[staticmethod]
    fn k4v4(head_dim: usize) -> Self {
        Self::from_rust(rotkv_lib::CacheConfig::k4v4(head_dim))
    }
    /// A preset by name: "k2v2", "k4v2" or "k4v4".
    #[staticmethod]
    fn preset(py: Python<'_>, name: &str, head_dim: usize) -> PyResult<Self> {
        Ok(Self::from_rust(rotkv_lib::CacheConfig::preset(name, head_dim).or_py(py)?))
    }
    /// Raises unless the configuration is supported.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.to_rust().or_py(py).map(drop)
    }
    /// Bytes per quantized token per KV head (codes, scales and zeros of K and V).
    fn bytes_per_token(&self, py: Python<'_>) -> PyResult<usize> {
        self.to_rust().and_then(|c| c.bytes_per_token()).or_py(py)
    }
    /// Storage bits per cached element, averaged over keys and values.
    fn bits_per_element(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.to_rust().or_py(py)?.bits_per_element())
    }
    /// Rows of a sequence per pass of a multi-token step (`StepBatch(pass_rows=...)`):
    /// half the window, at least 1.
    fn pass_rows(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.to_rust().or_py(py)?.pass_rows())
    }
    fn __eq__(&self, other: &Self) -> bool {
        self.to_rust().ok().zip(other.to_rust().ok()).is_some_and(|(a, b)| a == b)
    }
    fn __repr__(&self) -> String {
        format!(
            "CacheConfig(head_dim={}, key_bits={}, value_bits={}, group_size={}, page_size={}, sinks={}, window={}, \
             key_rotation={:?}, value_rotation={:?}, key_clip={}, value_clip={}, protected={}, channel_norm={})",
            self.head_dim,
            self.key_bits,
            self.value_bits,
            self.group_size,
            self.page_size,
            self.sinks,
            self.window,
            self.key_rotation,
            self.value_rotation,
            self.key_clip,
            self.value_clip,
            self.protected,
            self.channel_norm
        )
    }
}

/// A live sequence of a `KvCache` (its slot and the slot's generation). A freed id, or
/// one of another cache, is refused.
#[pyclass(name = "SeqId", module = "rotkv", frozen, eq, hash)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Seq(rotkv_lib::SeqId);

#[pymethods]
impl Seq {
    /// The sequence's slot (its index among the cache's `max_seqs`).
    #[getter]
    fn slot(&self) -> usize {
        self.0.slot()
    }
    /// How many times the slot had been taken when this id was made.
    #[getter]
    fn generation(&self) -> u64 {
        self.0.generation()
    }
    fn __repr__(&self) -> String {
        format!("SeqId(slot={}, generation={})", self.0.slot(), self.0.generation())
    }
}

/// One layer's calibration: per KV head a key mean and key scales (smoothing), key and
/// value channel permutations, optional learned rotations.
#[pyclass(name = "Calibration", module = "rotkv", frozen)]
#[derive(Clone)]
struct Calibration {
    inner: rotkv_lib::LayerCalibration,
    num_kv_heads: usize,
    head_dim: usize,
}

/// `obj` as a C-ordered f32 vector of shape `shape` (any real dtype numpy converts).
fn f32_vec(py: Python<'_>, what: &str, obj: &Bound<'_, PyAny>, shape: &[usize]) -> PyResult<Vec<f32>> {
    let np = py.import("numpy")?;
    let a = np.call_method1("asarray", (obj, "float32"))?;
    let a = a.cast::<PyArrayDyn<f32>>()?;
    if a.shape() != shape {
        return Err(shape_err(py, format!("{what} has shape {:?}, expected {shape:?}", a.shape())));
    }
    Ok(a.readonly().as_array().iter().copied().collect())
}

/// `obj` as a C-ordered u16 vector of shape `shape` (integers from 0 to 65535).
fn u16_vec(py: Python<'_>, what: &str, obj: &Bound<'_, PyAny>, shape: &[usize]) -> PyResult<Vec<u16>> {
    let np = py.import("numpy")?;
    let a = np.call_method1("asarray", (obj, "int64"))?;
    let a = a.cast::<PyArrayDyn<i64>>()?;
    if a.shape() != shape {
        return Err(shape_err(py, format!("{what} has shape {:?}, expected {shape:?}", a.shape())));
    }
    a.readonly()
        .as_array()
        .iter()
        .map(|&x| {
            u16::try_from(x)
                .map_err(|_| to_py(py, rotkv_lib::Error::Calibration(format!("{what} entry {x} is not a channel"))))
        })
        .collect()
}

#[pymethods]
impl Calibration {
    /// `Calibration(key_mean, key_scale=None, key_perm=None, value_perm=None,
    /// key_rotation=None, value_rotation=None)`: arrays of shape
    /// `[num_kv_heads, head_dim]` (rotations `[num_kv_heads, head_dim, head_dim]`,
    /// orthogonal); a missing one is the identity (scales of one, identity permutations,
    /// the configured rotation). Checked here (permutations, finite means, positive
    /// scales, orthogonality).
    #[new]
    #[pyo3(signature = (key_mean, key_scale = None, key_perm = None, value_perm = None, key_rotation = None, value_rotation = None))]
    fn new(
        py: Python<'_>,
        key_mean: &Bound<'_, PyAny>,
        key_scale: Option<&Bound<'_, PyAny>>,
        key_perm: Option<&Bound<'_, PyAny>>,
        value_perm: Option<&Bound<'_, PyAny>>,
        key_rotation: Option<&Bound<'_, PyAny>>,
        value_rotation: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let np = py.import("numpy")?;
        let shape: Vec<usize> = np.call_method1("shape", (key_mean,))?.extract()?;
        let [hkv, d] = shape[..] else {
            return Err(shape_err(py, format!("key_mean has shape {shape:?}, expected [num_kv_heads, head_dim]")));
        };
        rotkv_lib::config::check_head_dim(d).or_py(py)?;
        let mut c = rotkv_lib::LayerCalibration::identity(hkv, d);
        c.key_mean = f32_vec(py, "key_mean", key_mean, &[hkv, d])?;
        if let Some(s) = key_scale {
            c.key_scale = f32_vec(py, "key_scale", s, &[hkv, d])?;
        }
        if let Some(p) = key_perm {
            c.key_perm = u16_vec(py, "key_perm", p, &[hkv, d])?;
        }
        if let Some(p) = value_perm {
            c.value_perm = u16_vec(py, "value_perm", p, &[hkv, d])?;
        }
        if let Some(r) = key_rotation {
            c.key_rotation = Some(f32_vec(py, "key_rotation", r, &[hkv, d, d])?);
        }
        if let Some(r) = value_rotation {
            c.value_rotation = Some(f32_vec(py, "value_rotation", r, &[hkv, d, d])?);
        }
        c.check_orthogonal(hkv, d).or_py(py)?;
        Ok(Self { inner: c, num_kv_heads: hkv, head_dim: d })
    }
    /// The recommended recipe of `config`'s preset from a calibration file written by
    /// `rotkv calibrate` (`cargo rotkv calibrate --model M --text T --out F`), one
    /// `Calibration` per layer: the key centering and the per-KV-head key smoothing the
    /// calibration measured best for `config`'s key bits (the recipe's detected sinks are
    /// positions of each sequence, found at its prefill: `KvCache.protect`). Raises
    /// `RotkvValueError` for a file without a measured choice for those keys (an older
    /// file: calibrate again) or of another head_dim, `RotkvError` for an unreadable file.
    #[staticmethod]
    fn load(py: Python<'_>, path: std::path::PathBuf, config: &Config) -> PyResult<Vec<Self>> {
        let config = config.to_rust().or_py(py)?;
        let cal = py.detach(|| rotkv_lib::model::calibrate::Calibration::load(&path)).or_py(py)?;
        if cal.head_dim != config.head_dim {
            let why = format!("the calibration is for head_dim {}, the config's is {}", cal.head_dim, config.head_dim);
            return Err(to_py(py, rotkv_lib::Error::Calibration(why)));
        }
        (0..cal.layers.len())
            .map(|l| {
                let inner = cal.recipe_layer(l, &config).or_py(py)?;
                Ok(Self { inner, num_kv_heads: cal.kv_heads, head_dim: cal.head_dim })
            })
            .collect()
    }
    /// Zero means, unit scales, identity permutations, the configured rotations.
    #[staticmethod]
    fn identity(py: Python<'_>, num_kv_heads: usize, head_dim: usize) -> PyResult<Self> {
        rotkv_lib::config::check_head_dim(head_dim).or_py(py)?;
        if num_kv_heads == 0 || num_kv_heads > 1 << 16 {
            return Err(shape_err(py, format!("{num_kv_heads} KV heads (1 to 65536)")));
        }
        Ok(Self { inner: rotkv_lib::LayerCalibration::identity(num_kv_heads, head_dim), num_kv_heads, head_dim })
    }
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// `[num_kv_heads, head_dim]` float32 (a copy).
    #[getter]
    fn key_mean<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyArray1::from_slice(py, &self.inner.key_mean).reshape([self.num_kv_heads, self.head_dim]).map(Bound::into_any)
    }
    /// `[num_kv_heads, head_dim]` float32 (a copy).
    #[getter]
    fn key_scale<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyArray1::from_slice(py, &self.inner.key_scale).reshape([self.num_kv_heads, self.head_dim]).map(Bound::into_any)
    }
    /// `[num_kv_heads, head_dim]` uint16 (a copy).
    #[getter]
    fn key_perm<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyArray1::from_slice(py, &self.inner.key_perm).reshape([self.num_kv_heads, self.head_dim]).map(Bound::into_any)
    }
    /// `[num_kv_heads, head_dim]` uint16 (a copy).
    #[getter]
    fn value_perm<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyArray1::from_slice(py, &self.inner.value_perm)
            .reshape([self.num_kv_heads, self.head_dim])
            .map(Bound::into_any)
    }
    fn __repr__(&self) -> String {
        format!(
            "Calibration(num_kv_heads={}, head_dim={}, key_rotation={}, value_rotation={})",
            self.num_kv_heads,
            self.head_dim,
            if self.inner.key_rotation.is_some() { "learned" } else { "configured" },
            if self.inner.value_rotation.is_some() { "learned" } else { "configured" },
        )
    }
}

/// A paged, quantized KV cache of `layers` layers for up to `max_seqs` sequences (see
/// the module docs for arrays, dtypes and errors).
#[pyclass(name = "KvCache", module = "rotkv", frozen)]
struct Cache {
    inner: Mutex<rotkv_lib::KvCache>,
    config: rotkv_lib::CacheConfig,
    shape: rotkv_lib::CacheShape,
}

impl Cache {
    fn seq_ids(seqs: &[Seq]) -> Vec<rotkv_lib::SeqId> {
        seqs.iter().map(|s| s.0).collect()
    }
    /// Shared by `decode` and `decode_tokens`: `q` of `[seqs, (q_len,) q_heads, head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn decode_impl<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        seqs: Vec<Seq>,
        q: &Bound<'py, PyAny>,
        q_len: Option<usize>,
        out: Option<&Bound<'py, PyAny>>,
        num_splits: Option<u32>,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let ndim = if q_len.is_some() { 4 } else { 3 };
        let held = input(py, "q", q, ndim)?;
        let (hq, d) = (self.shape.num_q_heads, self.config.head_dim);
        let mut shape = vec![seqs.len()];
        let ql = match q_len {
            Some(_) => {
                let ql = held.shape()[1];
                shape.push(ql);
                ql
            }
            None => 1,
        };
        shape.extend([hq, d]);
        if held.shape() != shape.as_slice() {
            return Err(shape_err(
                py,
                format!("q has shape {:?}, expected {shape:?} ([seqs, {}q_heads, head_dim])", held.shape(), {
                    if q_len.is_some() { "q_len, " } else { "" }
                }),
            ));
        }
        let out = output(py, out, &shape, &[&held])?;
        let mut w =
            out.try_readwrite().map_err(|e| shape_err(py, format!("out: {e} (does it share memory with q?)")))?;
        let o = w.as_slice_mut().map_err(|e| shape_err(py, format!("out: {e}")))?;
        let ids = Self::seq_ids(&seqs);
        let q = held.elems();
        locked(py, &self.inner, |c| match &q {
            Elems::F32(q) => c.decode_tokens_with(layer, &ids, ql, q, o, num_splits),
            Elems::F16(q) => c.decode_tokens_with(layer, &ids, ql, q, o, num_splits),
            Elems::Bf16(q) => c.decode_tokens_with(layer, &ids, ql, q, o, num_splits),
        })?;
        drop(w);
        Ok(out)
    }
}

#[pymethods]
impl Cache {
    /// `KvCache(config, layers, num_kv_heads, num_q_heads, max_seqs, max_tokens,
    /// num_blocks=None, backend="cpu")`. `num_blocks` (per layer) defaults to room for
    /// `max_tokens` tokens in every sequence; `backend` is "cpu" (the fast CPU backend),
    /// "reference" (the scalar f64 oracle) or "auto" (= "cpu").
    #[new]
    #[pyo3(signature = (config, layers, num_kv_heads, num_q_heads, max_seqs, max_tokens, num_blocks = None, backend = "cpu"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config: &Config,
        layers: usize,
        num_kv_heads: usize,
        num_q_heads: usize,
        max_seqs: usize,
        max_tokens: usize,
        num_blocks: Option<usize>,
        backend: &str,
    ) -> PyResult<Self> {
        let config = config.to_rust().or_py(py)?;
        // An unknown name is a bad argument (a ValueError), not a missing backend.
        let backend = rotkv_lib::Backend::parse(backend)
            .map_err(|e| to_py(py, rotkv_lib::Error::Unsupported(format!("backend: {e}"))))?;
        let shape = rotkv_lib::CacheShape { layers, num_kv_heads, num_q_heads, max_seqs, max_tokens, num_blocks };
        let cache = py.detach(|| rotkv_lib::KvCache::new(config, shape, backend)).or_py(py)?;
        Ok(Self { inner: Mutex::new(cache), config, shape })
    }

    /// The configuration (a copy).
    #[getter]
    fn config(&self) -> Config {
        Config::from_rust(self.config)
    }
    #[getter]
    fn layers(&self) -> usize {
        self.shape.layers
    }
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.shape.num_kv_heads
    }
    #[getter]
    fn num_q_heads(&self) -> usize {
        self.shape.num_q_heads
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.config.head_dim
    }
    #[getter]
    fn max_seqs(&self) -> usize {
        self.shape.max_seqs
    }
    #[getter]
    fn max_tokens(&self) -> usize {
        self.shape.max_tokens
    }
    /// "cpu" or "reference".
    #[getter]
    fn backend(&self, py: Python<'_>) -> PyResult<&'static str> {
        locked(py, &self.inner, |c| Ok(c.backend().name()))
    }
    /// Bytes held by the pools and side stores of all layers.
    #[getter]
    fn memory_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        locked(py, &self.inner, |c| Ok(c.memory_bytes()))
    }
    /// Blocks not held by any sequence.
    #[getter]
    fn free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        locked(py, &self.inner, |c| Ok(c.free_blocks()))
    }

    /// Starts a new, empty sequence; `MemoryError` when every slot is live.
    fn add_sequence(&self, py: Python<'_>) -> PyResult<Seq> {
        locked(py, &self.inner, |c| c.add_sequence()).map(Seq)
    }
    /// Frees a sequence and returns its blocks.
    fn free_sequence(&self, py: Python<'_>, seq: Seq) -> PyResult<()> {
        locked(py, &self.inner, |c| c.free_sequence(seq.0))
    }
    /// Tokens of `seq` in `layer`.
    fn len(&self, py: Python<'_>, layer: usize, seq: Seq) -> PyResult<usize> {
        locked(py, &self.inner, |c| c.len(layer, seq.0))
    }
    /// Whether `seq` holds no token in any layer.
    fn is_empty(&self, py: Python<'_>, seq: Seq) -> PyResult<bool> {
        locked(py, &self.inner, |c| c.is_empty(seq.0))
    }

    /// Appends tokens to `seq` in `layer`: `k` and `v` are `[tokens, num_kv_heads,
    /// head_dim]` of one dtype (float32, float16 or bfloat16). Runs without the GIL.
    fn append(
        &self,
        py: Python<'_>,
        layer: usize,
        seq: Seq,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (k, v) = (input(py, "k", k, 3)?, input(py, "v", v, 3)?);
        let tokens = k.shape()[0];
        let want = [tokens, self.shape.num_kv_heads, self.config.head_dim];
        for (what, a) in [("k", &k), ("v", &v)] {
            if a.shape() != want {
                return Err(shape_err(
                    py,
                    format!("{what} has shape {:?}, expected {want:?} ([tokens, num_kv_heads, head_dim])", a.shape()),
                ));
            }
        }
        let (ke, ve) = (k.elems(), v.elems());
        let s = seq.0;
        match (&ke, &ve) {
            (Elems::F32(k), Elems::F32(v)) => locked(py, &self.inner, |c| c.append(layer, s, tokens, k, v)),
            (Elems::F16(k), Elems::F16(v)) => locked(py, &self.inner, |c| c.append(layer, s, tokens, k, v)),
            (Elems::Bf16(k), Elems::Bf16(v)) => locked(py, &self.inner, |c| c.append(layer, s, tokens, k, v)),
            _ => Err(shape_err(py, format!("k is {} but v is {}: give both one dtype", k.dtype(), v.dtype()))),
        }
    }

    /// Decode attention in `layer`, one query token per sequence of `seqs`: `q` is
    /// `[len(seqs), num_q_heads, head_dim]` (float32, float16 or bfloat16); returns (or
    /// writes into `out`) float32 of the same shape. `num_splits` (1 to 1024) fixes the
    /// split-K count (default: the backend's choice). Runs without the GIL.
    #[pyo3(signature = (layer, seqs, q, out = None, num_splits = None))]
    fn decode<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        seqs: Vec<Seq>,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        num_splits: Option<u32>,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        self.decode_impl(py, layer, seqs, q, None, out, num_splits)
    }

    /// Decode attention for the last `q_len` tokens of every sequence of `seqs` (appended
    /// beforehand; speculative decoding's verification rows): `q` is `[len(seqs), q_len,
    /// num_q_heads, head_dim]`; row `i` attends causally to positions up to `len - q_len
    /// + i`. Returns (or writes into `out`) float32 of `q`'s shape. Runs without the GIL.
    #[pyo3(signature = (layer, seqs, q, out = None, num_splits = None))]
    fn decode_tokens<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        seqs: Vec<Seq>,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        num_splits: Option<u32>,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        self.decode_impl(py, layer, seqs, q, Some(0), out, num_splits)
    }

    /// Sets a layer's calibration; only while no sequence holds tokens of that layer.
    fn set_calibration(&self, py: Python<'_>, layer: usize, calibration: &Calibration) -> PyResult<()> {
        let calib = calibration.inner.clone();
        locked(py, &self.inner, |c| c.set_calibration(layer, calib))
    }
    /// Gives `seq` its own key mean in `layer` (`[num_kv_heads, head_dim]`), before any
    /// of its tokens of that layer.
    fn set_sequence_key_mean(&self, py: Python<'_>, layer: usize, seq: Seq, mean: &Bound<'_, PyAny>) -> PyResult<()> {
        let mean = f32_vec(py, "mean", mean, &[self.shape.num_kv_heads, self.config.head_dim])?;
        locked(py, &self.inner, |c| c.set_sequence_key_mean(layer, seq.0, &mean))
    }
    /// Protects `positions` of `seq` in `layer` (ascending, after any protected before,
    /// not among the sinks, not yet quantized; at most `config.protected` in all).
    fn protect(&self, py: Python<'_>, layer: usize, seq: Seq, positions: Vec<u32>) -> PyResult<()> {
        locked(py, &self.inner, |c| c.protect(layer, seq.0, &positions))
    }
    /// The protected positions of `seq` in `layer`.
    fn protected(&self, py: Python<'_>, layer: usize, seq: Seq) -> PyResult<Vec<u32>> {
        locked(py, &self.inner, |c| c.protected(layer, seq.0).map(<[u32]>::to_vec))
    }
    /// Sets the softmax scale of decode (default `1 / sqrt(head_dim)`).
    fn set_softmax_scale(&self, py: Python<'_>, scale: f32) -> PyResult<()> {
        locked(py, &self.inner, |c| c.set_softmax_scale(scale))
    }
    /// Makes `layer` a sliding-window layer (FlashInfer's `window_left`; None: attend to
    /// every position).
    #[pyo3(signature = (layer, window_left))]
    fn set_window_left(&self, py: Python<'_>, layer: usize, window_left: Option<usize>) -> PyResult<()> {
        locked(py, &self.inner, |c| c.set_window_left(layer, window_left))
    }
    /// The sliding window of `layer`.
    fn window_left(&self, py: Python<'_>, layer: usize) -> PyResult<Option<usize>> {
        locked(py, &self.inner, |c| c.window_left(layer))
    }
    /// A layer's page pool (bytes) and side stores (float16 array), as stored: for
    /// byte-for-byte comparisons and debugging (copies).
    fn layer_bytes<'py>(&self, py: Python<'py>, layer: usize) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyAny>)> {
        let (pool, sides) = locked(py, &self.inner, |c| c.layer_bytes(layer).map(|(p, s)| (p.to_vec(), s.to_vec())))?;
        Ok((PyBytes::new(py, &pool), PyArray1::from_slice(py, &sides).into_any()))
    }
    /// Times `iters` calls of the Rust `KvCache::decode` on these inputs from inside
    /// Rust (no Python in the loop): each call's seconds, to compare with the same
    /// decode called from Python (the call overhead; see examples/overhead.py).
    fn _time_decode(
        &self,
        py: Python<'_>,
        layer: usize,
        seqs: Vec<Seq>,
        q: &Bound<'_, PyAny>,
        iters: usize,
    ) -> PyResult<Vec<f64>> {
        let held = input(py, "q", q, 3)?;
        let n = held.shape().iter().product();
        let ids = Self::seq_ids(&seqs);
        let q = held.elems();
        locked(py, &self.inner, |c| {
            let mut out = vec![0f32; n];
            let mut times = Vec::with_capacity(iters);
            for _ in 0..iters {
                let t = std::time::Instant::now();
                match &q {
                    Elems::F32(q) => c.decode(layer, &ids, q, &mut out)?,
                    Elems::F16(q) => c.decode(layer, &ids, q, &mut out)?,
                    Elems::Bf16(q) => c.decode(layer, &ids, q, &mut out)?,
                }
                times.push(t.elapsed().as_secs_f64());
            }
            Ok(times)
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "KvCache(head_dim={}, key_bits={}, value_bits={}, layers={}, num_kv_heads={}, num_q_heads={}, max_seqs={}, \
             max_tokens={})",
            self.config.head_dim,
            self.config.key_bits,
            self.config.value_bits,
            self.shape.layers,
            self.shape.num_kv_heads,
            self.shape.num_q_heads,
            self.shape.max_seqs,
            self.shape.max_tokens
        )
    }
}

/// Calibrates a GGUF model (llama, qwen2, qwen3 or gemma3 architecture) on the first
/// `tokens` tokens of a text file and writes the calibration to `out`, as `rotkv
/// calibrate --methods center,reorder,smooth` does: per layer the key means, the key and
/// value channel orders, the key channel standard deviations, and per KV head the key
/// smoothing measured best for 2- and 4-bit keys (`Calibration.load` reads it as a
/// preset's recipe). The model runs on the CPU with the GIL released (tens of seconds
/// for a small model). Returns the number of layers.
#[pyfunction]
#[pyo3(signature = (model, text, out, tokens = 2048))]
fn calibrate(
    py: Python<'_>,
    model: std::path::PathBuf,
    text: std::path::PathBuf,
    out: std::path::PathBuf,
    tokens: usize,
) -> PyResult<usize> {
    use rotkv_lib::model;
    py.detach(|| -> rotkv_lib::Result<usize> {
        let (llama, tok) = model::load_with(&model, model::llama::WeightStorage::F32)?;
        let mut ids = tok.bos_prefix();
        let body = model::text_tokens(&tok, &text, tokens.saturating_sub(ids.len()))?.ids;
        if ids.len() + body.len() < tokens {
            return Err(rotkv_lib::Error::Shape(format!(
                "{} has {} tokens, {tokens} asked",
                text.display(),
                ids.len() + body.len()
            )));
        }
        ids.extend_from_slice(&body);
        ids.truncate(tokens);
        let mut cal = model::calibrate::calibrate(&llama, &ids, None, &mut |_| {})?;
        let name = |p: &std::path::Path| p.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
        for (k, v) in [
            ("model", name(&model)),
            ("text_file", name(&text)),
            ("tokens", tokens.to_string()),
            ("methods", "center,reorder,smooth".to_string()),
            ("skipped_positions", model::calibrate::SKIP_POSITIONS.to_string()),
        ] {
            cal.metadata.insert(k.to_string(), v);
        }
        std::fs::write(&out, cal.to_safetensors()?)
            .map_err(|e| rotkv_lib::Error::Input(format!("writing {}: {e}", out.display())))?;
        Ok(cal.layers.len())
    })
    .or_py(py)
}

/// The instantiated configurations: dicts of `head_dim`, `key_bits`, `value_bits`,
/// `group_size`.
#[pyfunction]
fn configs(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    rotkv_lib::SUPPORTED
        .iter()
        .map(|&(d, kb, vb, g)| {
            let dict = PyDict::new(py);
            dict.set_item("head_dim", d)?;
            dict.set_item("key_bits", kb)?;
            dict.set_item("value_bits", vb)?;
            dict.set_item("group_size", g)?;
            Ok(dict)
        })
        .collect()
}

/// 2-bit KV-cache quantization with Hadamard rotations, and decode attention that reads
/// the packed cache (the Rust library rotkv, on the CPU).
#[pymodule]
fn rotkv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let errs = errors(py)?;
    m.add("RotkvError", errs.base.bind(py))?;
    m.add("RotkvValueError", errs.value.bind(py))?;
    m.add("RotkvMemoryError", errs.memory.bind(py))?;
    m.add_class::<Config>()?;
    m.add_class::<Seq>()?;
    m.add_class::<Calibration>()?;
    m.add_class::<Cache>()?;
    m.add_class::<device::PyDevice>()?;
    m.add_class::<device::PyLayer>()?;
    m.add_class::<device::PyStepBatch>()?;
    m.add_class::<device::PyPlan>()?;
    m.add_function(wrap_pyfunction!(configs, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate, m)?)?;
    m.add("FORMAT_VERSION", rotkv_lib::FORMAT_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
