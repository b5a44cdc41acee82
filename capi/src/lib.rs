//! The C API of rotkv (header `include/rotkv.h`, generated from this file by cbindgen:
//! `cargo xtask header`): a device handle, device buffers, configuration helpers, and the
//! raw entry points of `rotkv::device::raw` (append flush, append tokens, the batched
//! append of a serving step, decode, merge)
//! on device addresses, with the `#[repr(C)]` parameter blocks of the kernels.
//!
//! Every function returns a [`RotkvStatus`] (or a handle that is null on failure); the
//! message of the last failure on the calling thread is [`rotkv_last_error`]. A Rust panic
//! never crosses into C: it is caught and reported as [`RotkvStatus::Panic`].
//!
//! What has run: everything here on the emulated device (`rotkv_device_sim`), from C in
//! CI (`capi/tests/smoke.c`). `rotkv_device_cuda` (feature `cuda`) is compiled and
//! clippy-checked in CI but has not run on a GPU.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use rotkv::device::raw::{self, AppendBatchParams, AppendParams, DecodeParams, Format, MergeParams};
use rotkv::device::{Device, DeviceBuffer};
use rotkv::paged::LayerShape;
use rotkv::{CacheConfig, Error, Rotation};
use rotkv_kernels::params as rotkv_kernels_params;

/// `input_dtype` / `q_dtype`: f32.
pub const ROTKV_DTYPE_F32: u32 = 0;
/// `input_dtype` / `q_dtype`: f16.
pub const ROTKV_DTYPE_F16: u32 = 1;
/// `input_dtype` / `q_dtype`: bf16.
pub const ROTKV_DTYPE_BF16: u32 = 2;
/// `flags`: keys rotated by the Hadamard transform.
pub const ROTKV_FLAG_ROTATE_KEYS: u32 = 1;
/// `flags`: values rotated by the Hadamard transform.
pub const ROTKV_FLAG_ROTATE_VALUES: u32 = 2;
/// `flags` of the merge: f16 output.
pub const ROTKV_FLAG_OUTPUT_F16: u32 = 4;
/// `flags`: learned key rotations.
pub const ROTKV_FLAG_DENSE_KEYS: u32 = 8;
/// `flags`: learned value rotations.
pub const ROTKV_FLAG_DENSE_VALUES: u32 = 16;
/// `flags` of the merge: bf16 output.
pub const ROTKV_FLAG_OUTPUT_BF16: u32 = 32;

// The header's literals are the kernels' values.
#[allow(dead_code)]
const CHECKED: () = {
    use rotkv::device::raw::{DTYPE_BF16, DTYPE_F16, DTYPE_F32};
    use rotkv_kernels_params as k;
    assert!(ROTKV_DTYPE_F32 == DTYPE_F32 && ROTKV_DTYPE_F16 == DTYPE_F16 && ROTKV_DTYPE_BF16 == DTYPE_BF16);
    assert!(ROTKV_FLAG_ROTATE_KEYS == k::FLAG_ROTATE_KEYS && ROTKV_FLAG_ROTATE_VALUES == k::FLAG_ROTATE_VALUES);
    assert!(ROTKV_FLAG_OUTPUT_F16 == k::FLAG_OUTPUT_F16 && ROTKV_FLAG_OUTPUT_BF16 == k::FLAG_OUTPUT_BF16);
    assert!(ROTKV_FLAG_DENSE_KEYS == k::FLAG_DENSE_KEYS && ROTKV_FLAG_DENSE_VALUES == k::FLAG_DENSE_VALUES);
};

/// What a call returned.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotkvStatus {
    /// Success.
    Ok = 0,
    /// A configuration outside the instantiated set.
    Unsupported = 1,
    /// A size, shape, alignment or address that does not fit.
    Shape = 2,
    /// A value out of range.
    Value = 3,
    /// No room (an allocation the device refused).
    Capacity = 4,
    /// No such backend or device, or a driver failure.
    Backend = 5,
    /// A buffer of another device.
    Device = 6,
    /// Any other error of the library.
    Other = 7,
    /// A panic inside rotkv (a bug: please report it). (A null pointer where one is
    /// required is a `Shape` error.)
    Panic = 9,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // (`try_with`: nothing to record into while the thread's locals are torn down.)
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

fn status_of(e: &Error) -> RotkvStatus {
    match e {
        Error::Unsupported(_) => RotkvStatus::Unsupported,
        Error::Shape(_) | Error::Layer { .. } | Error::BlockTable { .. } | Error::AliasedBlock { .. } => {
            RotkvStatus::Shape
        }
        Error::Value(_) | Error::Calibration(_) => RotkvStatus::Value,
        Error::Capacity(_) => RotkvStatus::Capacity,
        Error::Backend(_) => RotkvStatus::Backend,
        Error::Device(_) => RotkvStatus::Device,
        _ => RotkvStatus::Other,
    }
}

/// Runs `f`, turning an error or a panic into a status and the thread's last error.
fn guard(f: impl FnOnce() -> Result<(), Error>) -> RotkvStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => RotkvStatus::Ok,
        Ok(Err(e)) => {
            set_error(e.to_string());
            status_of(&e)
        }
        Err(_) => {
            set_error("a panic inside rotkv".into());
            RotkvStatus::Panic
        }
    }
}

/// `ptr` as a reference, or a shape error naming `what`.
///
/// # Safety
/// `ptr` is null or valid for reads of a `T` for the returned lifetime.
unsafe fn arg<'a, T>(ptr: *const T, what: &str) -> Result<&'a T, Error> {
    // SAFETY: forwarded contract.
    unsafe { ptr.as_ref() }.ok_or_else(|| Error::Shape(format!("{what} is a null pointer")))
}

/// The message of the last failed call on this thread ("" if none): valid until the next
/// rotkv call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn rotkv_last_error() -> *const c_char {
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}

/// A device: where buffers live and kernels run, with its stream.
pub struct RotkvDevice(Device);

/// A device allocation of bytes (16-byte aligned, zeroed when made). Devices may be
/// shared between threads; a buffer may not be used by two calls at once when one of
/// them writes it (an upload, or a kernel whose output it is).
pub struct RotkvBuffer(DeviceBuffer<u8>);

/// The emulated GPU: the device kernels run on the CPU by the SIMT emulator, device
/// addresses are host addresses. Never null. Free with [`rotkv_device_free`].
#[unsafe(no_mangle)]
pub extern "C" fn rotkv_device_sim() -> *mut RotkvDevice {
    Box::into_raw(Box::new(RotkvDevice(Device::sim())))
}

/// GPU `ordinal` on a new stream of its primary context; null on failure (no driver, no
/// such GPU: see [`rotkv_last_error`]). Feature `cuda` of the crate. Not run on a GPU yet.
#[cfg(feature = "cuda")]
#[unsafe(no_mangle)]
pub extern "C" fn rotkv_device_cuda(ordinal: usize) -> *mut RotkvDevice {
    let mut dev = None;
    let status = guard(|| {
        let ctx = rotkv::cuda::cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| Error::Backend(format!("GPU {ordinal}: {e:?}")))?;
        let stream = ctx.new_stream().map_err(|e| Error::Backend(format!("a stream: {e:?}")))?;
        dev = Some(Device::cuda(stream)?);
        Ok(())
    });
    match (status, dev) {
        (RotkvStatus::Ok, Some(d)) => Box::into_raw(Box::new(RotkvDevice(d))),
        _ => std::ptr::null_mut(),
    }
}

/// Frees a device handle (null is ignored). Buffers made on it stay valid until freed.
///
/// # Safety
/// `dev` is null or a handle of [`rotkv_device_sim`] or `rotkv_device_cuda` not freed
/// before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_device_free(dev: *mut RotkvDevice) {
    if !dev.is_null() {
        // SAFETY: a handle made by `Box::into_raw`, freed once (the contract).
        drop(unsafe { Box::from_raw(dev) });
    }
}

/// Waits for the device's stream.
///
/// # Safety
/// `dev` is null or a live device handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_synchronize(dev: *const RotkvDevice) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        unsafe { arg(dev, "dev") }?.0.synchronize()
    })
}

/// Allocates `bytes` bytes on `dev` (16-byte aligned, zeroed) into `*out` (null on
/// failure).
///
/// # Safety
/// `dev` is a live device handle; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_alloc(dev: *const RotkvDevice, bytes: usize, out: *mut *mut RotkvBuffer) -> RotkvStatus {
    guard(|| {
        if out.is_null() {
            return Err(Error::Shape("out is a null pointer".into()));
        }
        // SAFETY: `out` is valid for a write (the contract): null until there is a buffer.
        unsafe { *out = std::ptr::null_mut() };
        // SAFETY: forwarded contract.
        let dev = unsafe { arg(dev, "dev") }?;
        let buf = dev.0.alloc::<u8>(bytes)?;
        // SAFETY: `out` is valid for a write (the contract).
        unsafe { *out = Box::into_raw(Box::new(RotkvBuffer(buf))) };
        Ok(())
    })
}

/// Frees a buffer (null is ignored).
///
/// # Safety
/// `buf` is null or a buffer of [`rotkv_alloc`] not freed before, and no enqueued work
/// still uses it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_buffer_free(buf: *mut RotkvBuffer) {
    if !buf.is_null() {
        // SAFETY: a handle made by `Box::into_raw`, freed once (the contract).
        drop(unsafe { Box::from_raw(buf) });
    }
}

/// The buffer's device address (0 for null): what the `*Ptrs` structs hold.
///
/// # Safety
/// `buf` is null or a live buffer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_buffer_addr(buf: *const RotkvBuffer) -> u64 {
    // SAFETY: forwarded contract.
    unsafe { buf.as_ref() }.map_or(0, |b| b.0.addr())
}

/// Copies `bytes` bytes from host memory `src` to `buf` at byte `offset`.
///
/// # Safety
/// `dev` and `buf` are live handles, `buf` made on `dev` and used by no other call
/// meanwhile; `src` is valid for reads of `bytes` bytes and does not overlap `buf`'s
/// memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_upload(
    dev: *const RotkvDevice,
    buf: *mut RotkvBuffer,
    offset: usize,
    src: *const c_void,
    bytes: usize,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let dev = unsafe { arg(dev, "dev") }?;
        // SAFETY: forwarded contract.
        let buf = unsafe { buf.as_mut() }.ok_or_else(|| Error::Shape("buf is a null pointer".into()))?;
        if src.is_null() && bytes > 0 {
            return Err(Error::Shape("src is a null pointer".into()));
        }
        // SAFETY: `src` is valid for `bytes` bytes (the contract); a null `src` only with 0.
        let host = if bytes == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(src.cast::<u8>(), bytes) } };
        dev.0.write(&mut buf.0, offset, host)
    })
}

/// Copies `bytes` bytes of `buf` from byte `offset` into host memory `dst` (waits for the
/// stream's work first).
///
/// # Safety
/// `dev` and `buf` are live handles, `buf` made on `dev`; `dst` is valid for writes of
/// `bytes` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_download(
    dev: *const RotkvDevice,
    buf: *const RotkvBuffer,
    offset: usize,
    dst: *mut c_void,
    bytes: usize,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let (dev, buf) = unsafe { (arg(dev, "dev")?, arg(buf, "buf")?) };
        let end = offset.checked_add(bytes).filter(|&e| e <= buf.0.len());
        if end.is_none() {
            return Err(Error::Shape(format!("{bytes} bytes at {offset} from a buffer of {}", buf.0.len())));
        }
        if dst.is_null() && bytes > 0 {
            return Err(Error::Shape("dst is a null pointer".into()));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `dst` is valid for writes of `bytes` bytes (the contract), not null.
        let host = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), bytes) };
        dev.0.read_at(&buf.0, offset, host)
    })
}

/// A cache configuration (`rotkv::CacheConfig`), plain data.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RotkvConfig {
    /// Channels per head: 64, 128 or 256.
    pub head_dim: u32,
    /// Bits per key code: 2 or 4.
    pub key_bits: u32,
    /// Bits per value code: 2 or 4.
    pub value_bits: u32,
    /// Channels per quantization group.
    pub group_size: u32,
    /// Tokens per page (a power of two from 16 to 256).
    pub page_size: u32,
    /// Leading tokens kept in f16.
    pub sinks: u32,
    /// Newest tokens kept in f16.
    pub window: u32,
    /// 1: Hadamard rotation of the keys; 0: none.
    pub rotate_keys: u32,
    /// 1: Hadamard rotation of the values; 0: none.
    pub rotate_values: u32,
    /// Fraction of each key group's range the quantizer spans (0.5 to 1).
    pub key_clip: f32,
    /// The same for values.
    pub value_clip: f32,
    /// Protected positions per sequence (0 to 32).
    pub protected: u32,
    /// KVarN iterations (0; the device kernels refuse others).
    pub channel_norm: u32,
}

impl RotkvConfig {
    fn from_rust(c: &CacheConfig) -> Self {
        Self {
            head_dim: c.head_dim as u32,
            key_bits: c.key_bits,
            value_bits: c.value_bits,
            group_size: c.group_size as u32,
            page_size: c.page_size as u32,
            sinks: c.sinks as u32,
            window: c.window as u32,
            rotate_keys: (c.key_rotation == Rotation::Hadamard) as u32,
            rotate_values: (c.value_rotation == Rotation::Hadamard) as u32,
            key_clip: c.key_clip,
            value_clip: c.value_clip,
            protected: c.protected as u32,
            channel_norm: c.channel_norm,
        }
    }
    fn to_rust(self) -> Result<CacheConfig, Error> {
        let rotation = |what: &str, r: u32| match r {
            0 => Ok(Rotation::None),
            1 => Ok(Rotation::Hadamard),
            other => Err(Error::Value(format!("{what} {other} (0 or 1)"))),
        };
        let c = CacheConfig {
            head_dim: self.head_dim as usize,
            key_bits: self.key_bits,
            value_bits: self.value_bits,
            group_size: self.group_size as usize,
            page_size: self.page_size as usize,
            sinks: self.sinks as usize,
            window: self.window as usize,
            key_rotation: rotation("rotate_keys", self.rotate_keys)?,
            value_rotation: rotation("rotate_values", self.rotate_values)?,
            key_clip: self.key_clip,
            value_clip: self.value_clip,
            protected: self.protected as usize,
            channel_norm: self.channel_norm,
        };
        // What the device kernels support (they do not run KVarN's normalization).
        rotkv::launch::check_format(&c.format()?)?;
        Ok(c)
    }
}

/// A preset by name ("k2v2", "k4v2", "k4v4") for `head_dim` into `*out`.
///
/// # Safety
/// `name` is a NUL-terminated string; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_config_preset(name: *const c_char, head_dim: u32, out: *mut RotkvConfig) -> RotkvStatus {
    guard(|| {
        if name.is_null() || out.is_null() {
            return Err(Error::Shape("name and out must not be null".into()));
        }
        // SAFETY: a NUL-terminated string (the contract).
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let c = CacheConfig::preset(&name, head_dim as usize)?;
        // SAFETY: `out` is valid for a write (the contract).
        unsafe { *out = RotkvConfig::from_rust(&c) };
        Ok(())
    })
}

/// Checks `config` and writes its device format (what every parameter block holds) and
/// its kernel flags (`FLAG_ROTATE_*`: the `flags` of the parameter blocks, with an
/// identity calibration).
///
/// # Safety
/// `config` is valid for a read; `format` and `flags` are valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_config_format(
    config: *const RotkvConfig,
    format: *mut Format,
    flags: *mut u32,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { arg(config, "config") }?.to_rust()?;
        if format.is_null() || flags.is_null() {
            return Err(Error::Shape("format and flags must not be null".into()));
        }
        // SAFETY: both are valid for writes (the contract).
        unsafe {
            *format = c.format()?;
            *flags = c.flags();
        }
        Ok(())
    })
}

/// Bytes of a page pool of `num_blocks` blocks for `num_kv_heads` KV heads (into
/// `*bytes`) and f16 elements of one sequence's side store (into `*side_elems`).
///
/// # Safety
/// `config` is valid for a read; `bytes` and `side_elems` are valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_layer_sizes(
    config: *const RotkvConfig,
    num_kv_heads: u32,
    num_blocks: u32,
    bytes: *mut usize,
    side_elems: *mut usize,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { arg(config, "config") }?.to_rust()?;
        if bytes.is_null() || side_elems.is_null() {
            return Err(Error::Shape("bytes and side_elems must not be null".into()));
        }
        let shape = LayerShape { num_kv_heads: num_kv_heads as usize, num_q_heads: num_kv_heads as usize };
        if num_kv_heads == 0 {
            return Err(Error::Shape("num_kv_heads must be positive".into()));
        }
        let (b, s) =
            (rotkv::paged::pool_bytes(&c, &shape, num_blocks as usize)?, rotkv::paged::side_elems(&c, &shape)?);
        // SAFETY: both are valid for writes (the contract).
        unsafe {
            *bytes = b;
            *side_elems = s;
        }
        Ok(())
    })
}

/// Pages (block-table entries) a sequence of `len` tokens uses; 0 for a null `format`
/// or one no configuration gives.
///
/// # Safety
/// `format` is valid for a read (a format of [`rotkv_config_format`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_pages_for(format: *const Format, len: u32) -> u32 {
    // SAFETY: forwarded contract.
    let Some(f) = (unsafe { format.as_ref() }) else { return 0 };
    // A format no configuration gives (page size not a power of two from 16, sinks plus
    // window past u32) has no page count: 0, never a panic across the boundary.
    let sane = f.page_size >= 16 && f.page_size.is_power_of_two() && f.sinks.checked_add(f.window).is_some();
    if sane { catch_unwind(|| f.pages_for(len)).unwrap_or(0) } else { 0 }
}

/// Device addresses of `append_tokens`' buffers (`rotkv::launch::AppendPtrs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RotkvAppendPtrs {
    /// Keys, `[token][kv_head][head_dim]` of `input_dtype`, `token_stride` apart.
    pub k: u64,
    /// Values, as `k` but `v_token_stride` apart.
    pub v: u64,
    /// Key mean, f32 `[kv_head][head_dim]`.
    pub key_mean: u64,
    /// Key scales, f32 `[kv_head][head_dim]` (finite, > 0).
    pub key_scale: u64,
    /// Key permutations, u16 `[kv_head][head_dim]`.
    pub key_perm: u64,
    /// Value permutations, u16 `[kv_head][head_dim]`.
    pub value_perm: u64,
    /// Learned key rotations (read only with `FLAG_DENSE_KEYS`).
    pub key_rot: u64,
    /// Learned value rotations (read only with `FLAG_DENSE_VALUES`).
    pub value_rot: u64,
    /// The sequence's block-table row, u32 (at least `pages_for(new_len)` entries).
    pub block_table: u64,
    /// The sequence's protected positions, u32 `[format.protected]`, padded with
    /// `UINT32_MAX`.
    pub protected_: u64,
    /// The page pool (16-byte aligned).
    pub pool: u64,
    /// The sequence's side store, f16 (16-byte aligned).
    pub side: u64,
    /// One u32 the launch writes the new length to, or 0.
    pub seq_len: u64,
}

/// Device addresses of `append_flush`'s buffers (`rotkv::launch::FlushPtrs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RotkvFlushPtrs {
    /// The sequence's block-table row, u32.
    pub block_table: u64,
    /// The sequence's side store, f16 (16-byte aligned).
    pub side: u64,
    /// The page pool (16-byte aligned).
    pub pool: u64,
}

/// Device addresses of a decode kernel's buffers (`rotkv::launch::DecodePtrs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RotkvDecodePtrs {
    /// Queries, `[seq][q_len][q_head][head_dim]` of `q_dtype`.
    pub q: u64,
    /// The page pool (16-byte aligned).
    pub pool: u64,
    /// Block tables, u32 `[seq][block_table_stride]`.
    pub tables: u64,
    /// Sequence lengths, u32 `[seq]`.
    pub lens: u64,
    /// Side stores, f16 `[seq][side_elems]` (16-byte aligned).
    pub sides: u64,
    /// Protected positions, u32 `[seq][format.protected]`.
    pub protected_: u64,
    /// Key scales, f32 `[kv_head][head_dim]`.
    pub key_scale: u64,
    /// Key permutations, u16 `[kv_head][head_dim]`.
    pub key_perm: u64,
    /// Learned key rotations (read only with `FLAG_DENSE_KEYS`).
    pub key_rot: u64,
    /// Partial maxima, f32 `[seq][q_len][q_head][split]`.
    pub m: u64,
    /// Partial sums, as `m`.
    pub l: u64,
    /// Partial outputs, f32 `[seq][q_len][q_head][split][head_dim]`.
    pub o: u64,
    /// A step batch (with `batch_rows > 0`), or 0.
    pub meta: u64,
}

/// Device addresses of `decode_merge`'s buffers (`rotkv::launch::MergePtrs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RotkvMergePtrs {
    /// Partial maxima (as the decode's).
    pub m: u64,
    /// Partial sums.
    pub l: u64,
    /// Partial outputs.
    pub o: u64,
    /// Inverse value permutations, u16 `[kv_head][head_dim]`.
    pub vperm_inv: u64,
    /// Learned value rotations (read only with `FLAG_DENSE_VALUES`).
    pub value_rot: u64,
    /// Output rows, f32 (or f16/bf16 by the flags) `[rows][q_head][head_dim]`.
    pub out: u64,
    /// A step batch, or 0.
    pub meta: u64,
}

/// Device addresses of the batched append's buffers (`rotkv::launch::BatchPtrs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RotkvBatchPtrs {
    /// The step batch, u32 `[max_rows + 3 * max_seqs]`: each input row's slot
    /// (`UINT32_MAX`: none), then per slot its length before the step, its new tokens and
    /// the input row of its first new token (`max_seqs` entries each).
    pub meta: u64,
    /// Keys, `[row][kv_head][head_dim]` of `input_dtype`, `token_stride` apart.
    pub k: u64,
    /// Values, as `k` but `v_token_stride` apart.
    pub v: u64,
    /// Key mean, f32 `[kv_head][head_dim]`.
    pub key_mean: u64,
    /// Key scales, f32 `[kv_head][head_dim]`.
    pub key_scale: u64,
    /// Key permutations, u16 `[kv_head][head_dim]`.
    pub key_perm: u64,
    /// Value permutations, u16 `[kv_head][head_dim]`.
    pub value_perm: u64,
    /// Learned key rotations (read only with `FLAG_DENSE_KEYS`).
    pub key_rot: u64,
    /// Learned value rotations (read only with `FLAG_DENSE_VALUES`).
    pub value_rot: u64,
    /// Block tables, u32 `[max_seqs][table_stride]`.
    pub tables: u64,
    /// Protected lists, u32 `[max_seqs][protected_stride]`.
    pub protected_: u64,
    /// The page pool (16-byte aligned).
    pub pool: u64,
    /// Side stores, f16 `[max_seqs][side_elems]` (16-byte aligned).
    pub sides: u64,
    /// Sequence lengths, u32 `[max_seqs]` (the slots with new tokens get their new length).
    pub lens: u64,
    /// Error counters, u32 `[3]` (batch, block, non-finite), or 0.
    pub errors: u64,
}

/// Enqueues the batched append of a serving step (`append_batch_flush` then
/// `append_batch_tokens`): every slot's new rows as the step batch at `ptrs.meta` says.
///
/// # Safety
/// `dev`, `p` and `ptrs` are valid for reads; every address is a live allocation of `dev`
/// as `rotkv::device::raw::append_batch` asks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_append_batch(
    dev: *const RotkvDevice,
    p: *const AppendBatchParams,
    ptrs: *const RotkvBatchPtrs,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let (dev, p, a) = unsafe { (arg(dev, "dev")?, arg(p, "p")?, arg(ptrs, "ptrs")?) };
        let ptrs = raw::BatchPtrs {
            meta: a.meta,
            k: a.k,
            v: a.v,
            key_mean: a.key_mean,
            key_scale: a.key_scale,
            key_perm: a.key_perm,
            value_perm: a.value_perm,
            key_rot: a.key_rot,
            value_rot: a.value_rot,
            tables: a.tables,
            protected: a.protected_,
            pool: a.pool,
            sides: a.sides,
            lens: a.lens,
            errors: a.errors,
        };
        // SAFETY: forwarded contract.
        unsafe { raw::append_batch(&dev.0, p, &ptrs) }
    })
}

/// Enqueues `append_flush` for the append `p` (the window rows whose page fills; nothing
/// when none does). Run it before the same append's [`rotkv_append_tokens`].
///
/// # Safety
/// `dev`, `p` and `ptrs` are valid for reads; every address is a live allocation of `dev`
/// as `rotkv::device::raw::append_flush` asks (the kernel's `# Safety`; nothing is
/// checked but the alignment of the pool and side store).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_append_flush(
    dev: *const RotkvDevice,
    p: *const AppendParams,
    ptrs: *const RotkvFlushPtrs,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let (dev, p, a) = unsafe { (arg(dev, "dev")?, arg(p, "p")?, arg(ptrs, "ptrs")?) };
        let ptrs = raw::FlushPtrs { block_table: a.block_table, side: a.side, pool: a.pool };
        // SAFETY: forwarded contract.
        unsafe { raw::append_flush(&dev.0, p, &ptrs) }
    })
}

/// Enqueues `append_tokens` for `p.count` tokens of one sequence.
///
/// # Safety
/// `dev`, `p` and `ptrs` are valid for reads; every address is a live allocation of `dev`
/// as `rotkv::device::raw::append_tokens` asks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_append_tokens(
    dev: *const RotkvDevice,
    p: *const AppendParams,
    ptrs: *const RotkvAppendPtrs,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let (dev, p, a) = unsafe { (arg(dev, "dev")?, arg(p, "p")?, arg(ptrs, "ptrs")?) };
        let ptrs = raw::AppendPtrs {
            k: a.k,
            v: a.v,
            key_mean: a.key_mean,
            key_scale: a.key_scale,
            key_perm: a.key_perm,
            value_perm: a.value_perm,
            key_rot: a.key_rot,
            value_rot: a.value_rot,
            block_table: a.block_table,
            protected: a.protected_,
            pool: a.pool,
            side: a.side,
            seq_len: a.seq_len,
        };
        // SAFETY: forwarded contract.
        unsafe { raw::append_tokens(&dev.0, p, &ptrs) }
    })
}

/// Enqueues the split-K decode kernel for `p` (writes the partials).
///
/// # Safety
/// `dev`, `p` and `ptrs` are valid for reads; every address is a live allocation of `dev`
/// as `rotkv::device::raw::decode` asks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_decode(
    dev: *const RotkvDevice,
    p: *const DecodeParams,
    ptrs: *const RotkvDecodePtrs,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let (dev, p, a) = unsafe { (arg(dev, "dev")?, arg(p, "p")?, arg(ptrs, "ptrs")?) };
        let ptrs = raw::DecodePtrs {
            q: a.q,
            pool: a.pool,
            tables: a.tables,
            lens: a.lens,
            sides: a.sides,
            protected: a.protected_,
            key_scale: a.key_scale,
            key_perm: a.key_perm,
            key_rot: a.key_rot,
            m: a.m,
            l: a.l,
            o: a.o,
            meta: a.meta,
        };
        // SAFETY: forwarded contract.
        unsafe { raw::decode(&dev.0, p, &ptrs) }
    })
}

/// Enqueues `decode_merge` for `p` (combines the partials into output rows).
///
/// # Safety
/// `dev`, `p` and `ptrs` are valid for reads; every address is a live allocation of `dev`
/// as `rotkv::device::raw::merge` asks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rotkv_merge(
    dev: *const RotkvDevice,
    p: *const MergeParams,
    ptrs: *const RotkvMergePtrs,
) -> RotkvStatus {
    guard(|| {
        // SAFETY: forwarded contract.
        let (dev, p, a) = unsafe { (arg(dev, "dev")?, arg(p, "p")?, arg(ptrs, "ptrs")?) };
        let ptrs = raw::MergePtrs {
            m: a.m,
            l: a.l,
            o: a.o,
            vperm_inv: a.vperm_inv,
            value_rot: a.value_rot,
            out: a.out,
            meta: a.meta,
        };
        // SAFETY: forwarded contract.
        unsafe { raw::merge(&dev.0, p, &ptrs) }
    })
}
