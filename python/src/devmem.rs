//! What the device API reads and writes: host arrays (numpy, CPU DLPack tensors) on the
//! emulated device, whose memory is host memory; device tensors by address on a CUDA
//! device (a torch CUDA tensor through `data_ptr()`, or any object with
//! `__cuda_array_interface__`, such as a CuPy array).
//!
//! A device tensor must be C-contiguous, of float32, float16 or bfloat16 (the output
//! float32), and on the Device's GPU (checked for torch tensors through `.device.index`;
//! `__cuda_array_interface__` carries no device, so that is the caller's). On the emulated
//! device an object with `__cuda_array_interface__` is taken only when it is host memory
//! (it also has `__array_interface__` at the same address: a test double); a torch CUDA
//! tensor is refused there, as a host array is on a CUDA device.

use numpy::{PyArrayDyn, PyUntypedArray};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{Elems, Held, input, output, shape_err, to_py};

/// Element type of a device tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::F16 => "float16",
            Dtype::Bf16 => "bfloat16",
        }
    }
    fn size(self) -> usize {
        if self == Dtype::F32 { 4 } else { 2 }
    }
}

/// A device tensor by address, its Python object held for the call.
pub(crate) struct Ptr<'py> {
    _obj: Bound<'py, PyAny>,
    pub(crate) addr: u64,
    /// Elements.
    pub(crate) len: usize,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    writable: bool,
}

impl Ptr<'_> {
    /// The bytes it covers.
    fn range(&self) -> (u64, u64) {
        (self.addr, self.addr + (self.len * self.dtype.size()) as u64)
    }
}

/// An input of the device API.
pub(crate) enum DevIn<'py> {
    Host(Held<'py>),
    Ptr(Ptr<'py>),
}

/// Its elements: the host array's (in C order), or the device tensor's address.
pub(crate) enum DevElems<'a> {
    Host(Elems<'a>),
    Ptr(u64, usize, Dtype),
}

impl DevIn<'_> {
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            DevIn::Host(h) => h.shape(),
            DevIn::Ptr(p) => &p.shape,
        }
    }
    pub(crate) fn dtype(&self) -> &'static str {
        match self {
            DevIn::Host(h) => h.dtype(),
            DevIn::Ptr(p) => p.dtype.name(),
        }
    }
    pub(crate) fn elems(&self) -> DevElems<'_> {
        match self {
            DevIn::Host(h) => DevElems::Host(h.elems()),
            DevIn::Ptr(p) => DevElems::Ptr(p.addr, p.len, p.dtype),
        }
    }
}

/// The output: a host array (returned) or a device tensor (written; `out` is returned).
pub(crate) enum DevOut<'py> {
    Host(Bound<'py, PyArrayDyn<f32>>),
    Ptr(Ptr<'py>, Bound<'py, PyAny>),
}

/// `obj` as a device tensor, or `None` for a host array. `ordinal`: the Device's GPU, or
/// `None` for the emulated device.
fn device_tensor<'py>(
    py: Python<'py>,
    what: &str,
    obj: &Bound<'py, PyAny>,
    ordinal: Option<usize>,
) -> PyResult<Option<Ptr<'py>>> {
    if obj.cast::<PyUntypedArray>().is_ok() {
        return Ok(None);
    }
    let err = |msg: String| Err(shape_err(py, format!("{what}: {msg}")));
    let dev_err = |msg: String| Err(to_py(py, rotkv_lib::Error::Device(format!("{what}: {msg}"))));
    // A torch tensor on a GPU.
    if obj.hasattr("is_cuda")? && obj.getattr("is_cuda")?.extract::<bool>().unwrap_or(false) {
        let Some(ordinal) = ordinal else {
            return dev_err("a CUDA tensor on the emulated device (pass host arrays to Device.sim())".into());
        };
        let index: Option<usize> = obj.getattr("device")?.getattr("index")?.extract()?;
        if index != Some(ordinal) {
            return dev_err(format!("a tensor on cuda:{index:?}, the Device is cuda:{ordinal}"));
        }
        let dtype = match obj.getattr("dtype")?.str()?.to_cow()?.as_ref() {
            "torch.float32" => Dtype::F32,
            "torch.float16" => Dtype::F16,
            "torch.bfloat16" => Dtype::Bf16,
            other => return err(format!("dtype {other}; expected float32, float16 or bfloat16")),
        };
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return err("a non-contiguous CUDA tensor: pass t.contiguous()".into());
        }
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        return Ok(Some(Ptr {
            addr: obj.call_method0("data_ptr")?.extract()?,
            len: obj.call_method0("numel")?.extract()?,
            dtype,
            shape,
            writable: true,
            _obj: obj.clone(),
        }));
    }
    if !obj.hasattr("__cuda_array_interface__")? {
        return Ok(None);
    }
    let cai = obj.getattr("__cuda_array_interface__")?;
    let cai =
        cai.cast::<PyDict>().map_err(|_| shape_err(py, format!("{what}: __cuda_array_interface__ is no dict")))?;
    let get = |k: &str| -> PyResult<Bound<'py, PyAny>> {
        cai.get_item(k)?.ok_or_else(|| shape_err(py, format!("{what}: __cuda_array_interface__ has no {k:?}")))
    };
    let shape: Vec<usize> = get("shape")?.extract()?;
    let dtype = match get("typestr")?.extract::<String>()?.as_str() {
        "<f4" => Dtype::F32,
        "<f2" => Dtype::F16,
        other => return err(format!("typestr {other:?}; expected \"<f4\" or \"<f2\"")),
    };
    let (addr, readonly): (u64, bool) = get("data")?.extract()?;
    let len: usize = shape.iter().product();
    if let Some(strides) = cai.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<usize> = strides.extract()?;
        let mut want = vec![0usize; shape.len()];
        let mut step = dtype.size();
        for i in (0..shape.len()).rev() {
            want[i] = step;
            step *= shape[i];
        }
        // Strides of a dimension of one element are irrelevant.
        if strides.len() != shape.len() || strides.iter().zip(&want).zip(&shape).any(|((s, w), &n)| n > 1 && s != w) {
            return err(format!("strides {strides:?} are not C-contiguous for shape {shape:?}"));
        }
    }
    if ordinal.is_none() {
        // The emulated device reads host memory: only an object that says it is.
        let host = obj.hasattr("__array_interface__")?
            && obj.getattr("__array_interface__")?.get_item("data")?.get_item(0)?.extract::<u64>()? == addr;
        if !host {
            return dev_err("device memory on the emulated device (pass host arrays to Device.sim())".into());
        }
    }
    if len > 0 && addr == 0 {
        return err("a null data pointer".into());
    }
    Ok(Some(Ptr { addr, len, dtype, shape, writable: !readonly, _obj: obj.clone() }))
}

/// An input of `ndim` dimensions for a Device (`ordinal`: its GPU; `None` the emulated
/// device).
pub(crate) fn dev_input<'py>(
    py: Python<'py>,
    ordinal: Option<usize>,
    what: &str,
    obj: &Bound<'py, PyAny>,
    ndim: usize,
) -> PyResult<DevIn<'py>> {
    match device_tensor(py, what, obj, ordinal)? {
        Some(p) if p.shape.len() != ndim => {
            Err(shape_err(py, format!("{what} has {} dimensions {:?}, expected {ndim}", p.shape.len(), p.shape)))
        }
        Some(p) => Ok(DevIn::Ptr(p)),
        None if ordinal.is_some() => Err(to_py(
            py,
            rotkv_lib::Error::Device(format!(
                "{what}: host memory on a CUDA device (pass a CUDA tensor: torch's, or one with __cuda_array_interface__)"
            )),
        )),
        None => Ok(DevIn::Host(input(py, what, obj, ndim)?)),
    }
}

/// The output of `shape` (float32): `out` checked (see [`output`] for host arrays; a
/// device tensor: float32, C-contiguous, writeable, not overlapping `inputs`), or a new
/// host array on the emulated device (`out` is required on a CUDA device).
pub(crate) fn dev_output<'py>(
    py: Python<'py>,
    ordinal: Option<usize>,
    out: Option<&Bound<'py, PyAny>>,
    shape: &[usize],
    inputs: &[&DevIn<'py>],
) -> PyResult<DevOut<'py>> {
    let host: Vec<&Held<'_>> = inputs
        .iter()
        .filter_map(|i| match i {
            DevIn::Host(h) => Some(h),
            DevIn::Ptr(_) => None,
        })
        .collect();
    let Some(o) = out else {
        if ordinal.is_some() {
            return Err(shape_err(py, "out= is required on a CUDA device (a float32 CUDA tensor)".into()));
        }
        return Ok(DevOut::Host(output(py, None, shape, &host)?));
    };
    match device_tensor(py, "out", o, ordinal)? {
        Some(p) => {
            if p.dtype != Dtype::F32 || p.shape != shape || !p.writable {
                return Err(shape_err(
                    py,
                    format!(
                        "out is a {}{} tensor of shape {:?}; expected a writeable float32 one of {shape:?}",
                        if p.writable { "" } else { "read-only " },
                        p.dtype.name(),
                        p.shape
                    ),
                ));
            }
            let (a, b) = p.range();
            for i in inputs {
                if let DevIn::Ptr(q) = i {
                    let (c, d) = q.range();
                    if a < d && c < b {
                        return Err(shape_err(py, "out shares memory with an input: pass a separate tensor".into()));
                    }
                }
            }
            Ok(DevOut::Ptr(p, o.clone()))
        }
        None if ordinal.is_some() => Err(to_py(
            py,
            rotkv_lib::Error::Device("out: host memory on a CUDA device (pass a float32 CUDA tensor)".into()),
        )),
        None => Ok(DevOut::Host(output(py, Some(o), shape, &host)?)),
    }
}
