//! The backends behind the paged API (`crate::paged`, `crate::KvCache`), on **host
//! memory**: the paged layer validates every call, then hands host buffers (pool, block
//! tables, side stores) to one of these.
//!
//! - [`reference`](mod@reference): the scalar f64 oracle;
//! - [`cpu`]: the fast CPU implementation of the same format;
//! - `sim` (feature `sim`): the device kernels run by the SIMT emulator over these host
//!   buffers, and the raw emulated launches the device API uses;
//! - `cuda` (feature `cuda`): the PTX loaded through cudarc (`cuda::Kernels`, the raw
//!   launches the device API uses) and a test path that uploads host buffers per call.
//!
//! Device memory (a layer's cache living on the GPU, the caller's stream, decode plans)
//! is `crate::device`; the launch planning both device backends share (grids, shared
//! memory, kernel choice) is `crate::launch`. Each backend module is also reachable at
//! the crate root (`rotkv::cpu`, `rotkv::reference`, ...).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;
#[cfg(feature = "sim")]
pub mod sim;
