//! Device memory: typed buffers and borrowed views ([`DeviceBuffer`], [`DeviceSlice`],
//! [`DeviceSliceMut`]).

use super::*;

/// `len` elements of `T` in a [`Device`]'s memory, 16-byte aligned, zeroed when made.
pub struct DeviceBuffer<T> {
    pub(super) mem: Mem,
    pub(super) len: usize,
    /// The address of element 0, taken once at allocation (no driver call per step).
    pub(super) addr: u64,
    pub(super) device: u64,
    pub(super) _t: PhantomData<T>,
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
    pub(super) fn addr_at(&self, i: usize) -> u64 {
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
    pub(super) addr: u64,
    pub(super) len: usize,
    pub(super) device: u64,
    pub(super) _t: PhantomData<&'a [T]>,
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
    pub(super) addr: u64,
    pub(super) len: usize,
    pub(super) device: u64,
    pub(super) _t: PhantomData<&'a mut [T]>,
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
