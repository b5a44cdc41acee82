//! rotkv device code.
//!
//! This crate is `#![no_std]` and compiles both for the host (as an rlib: the format
//! constants, the page layout arithmetic, the `#[repr(C)]` kernel parameter structs and
//! the kernel bodies, which the SIMT emulator of the `sim` feature runs) and for
//! `nvptx64-nvidia-cuda` (`cargo xtask ptx`: the same bodies behind `extern
//! "ptx-kernel"` entry points). Nothing here validates user input: every check and every
//! `Result` lives in the host crate `rotkv`.
//!
//! The byte format is specified in `docs/src/format.md` (the book's format chapter); the
//! functions in [`layout`] are the single source of truth for every offset in it.
#![no_std]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, link_llvm_intrinsics),
    allow(internal_features)
)]

#[cfg(feature = "sim")]
extern crate std;

pub mod append;
pub mod ctx;
pub mod decode;
pub mod decode_mma;
pub mod fwht;
pub mod layout;
pub mod math;
pub mod merge;
pub mod params;
pub mod selftest;
#[cfg(feature = "sim")]
pub mod sim;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // Kernels index only inside what the host validated; a panic is a bug. Trap so the
    // launch fails with an error instead of hanging.
    // SAFETY: `trap` aborts the kernel; it has no other effect.
    unsafe { core::arch::asm!("trap;") };
    loop {}
}

/// Version of the cache byte format described in `docs/src/format.md`.
pub const FORMAT_VERSION: u32 = 1;

/// Supported head dimensions.
pub const HEAD_DIMS: [u32; 3] = [64, 128, 256];
/// Supported code widths, for keys and values independently.
pub const CODE_BITS: [u32; 2] = [2, 4];
/// Supported quantization group sizes (must also be `<= head_dim`).
pub const GROUP_SIZES: [u32; 4] = [32, 64, 128, 256];
/// Smallest and largest page size in tokens (powers of two in between).
pub const MIN_PAGE_SIZE: u32 = 16;
/// Largest page size in tokens.
pub const MAX_PAGE_SIZE: u32 = 256;
/// Most protected positions (detected attention sinks) a sequence may hold per layer.
pub const MAX_PROTECTED: u32 = 32;
/// Bytes of side information per quantization group: an f16 scale and an f16 zero.
pub const GROUP_PARAM_BYTES: u32 = 4;

/// Calls `$m!` with the list of every instantiated `(head_dim, key_bits, value_bits,
/// group_size)` configuration.
///
/// This one list drives host dispatch, the conformance tests, the supported-configs
/// table (`docs/src/format.md`, README) and (with the device kernels) the PTX entry points.
#[macro_export]
macro_rules! for_each_config {
    ($m:ident) => {
        $m! {
            (64, 2, 2, 32), (64, 2, 2, 64), (64, 2, 4, 32), (64, 2, 4, 64),
            (64, 4, 2, 32), (64, 4, 2, 64), (64, 4, 4, 32), (64, 4, 4, 64),
            (128, 2, 2, 32), (128, 2, 2, 64), (128, 2, 2, 128),
            (128, 2, 4, 32), (128, 2, 4, 64), (128, 2, 4, 128),
            (128, 4, 2, 32), (128, 4, 2, 64), (128, 4, 2, 128),
            (128, 4, 4, 32), (128, 4, 4, 64), (128, 4, 4, 128),
            (256, 2, 2, 32), (256, 2, 2, 64), (256, 2, 2, 128), (256, 2, 2, 256),
            (256, 2, 4, 32), (256, 2, 4, 64), (256, 2, 4, 128), (256, 2, 4, 256),
            (256, 4, 2, 32), (256, 4, 2, 64), (256, 4, 2, 128), (256, 4, 2, 256),
            (256, 4, 4, 32), (256, 4, 4, 64), (256, 4, 4, 128), (256, 4, 4, 256)
        }
    };
}

macro_rules! config_array {
    ($(($d:expr, $kb:expr, $vb:expr, $g:expr)),* $(,)?) => {
        /// Every instantiated `(head_dim, key_bits, value_bits, group_size)`, from
        /// [`for_each_config!`].
        pub const CONFIGS: &[(u32, u32, u32, u32)] = &[$(($d, $kb, $vb, $g)),*];
    };
}
for_each_config!(config_array);

/// Whether `(head_dim, key_bits, value_bits, group_size)` is in [`CONFIGS`].
#[inline]
pub const fn is_instantiated(head_dim: u32, key_bits: u32, value_bits: u32, group: u32) -> bool {
    let mut i = 0;
    while i < CONFIGS.len() {
        let c = CONFIGS[i];
        if c.0 == head_dim && c.1 == key_bits && c.2 == value_bits && c.3 == group {
            return true;
        }
        i += 1;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_list_is_the_full_cross_product() {
        let mut n = 0;
        for d in HEAD_DIMS {
            for kb in CODE_BITS {
                for vb in CODE_BITS {
                    for g in GROUP_SIZES {
                        let expect = g <= d;
                        assert_eq!(is_instantiated(d, kb, vb, g), expect, "{d} {kb} {vb} {g}");
                        n += expect as usize;
                    }
                }
            }
        }
        assert_eq!(n, CONFIGS.len());
    }
}
