//! The fast CPU backend: the same bytes as [`crate::reference`], computed in f32 with
//! threads (rayon) over sequences, KV heads and splits, and inner loops written so the
//! compiler vectorizes them (lane-parallel accumulators, lookup tables that unpack a
//! byte of codes at once). On x86-64 with AVX2 the hot loops are compiled a second time
//! for AVX2 and picked at run time.
//!
//! Scores never dequantize a key: for a group with scale `s` and zero `z`,
//! `q'.khat = s * (q'.codes) + z * sum(q')`, and `sum(q')` per group is computed once
//! per query.

use crate::KvElement;
use crate::config::{HeadRotation, LayerCalibration};
use crate::reference;
use crate::reference::SeqRef;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use rotkv_kernels::layout::{Format, NO_CLIP, Place, clip_range};
pub use rotkv_kernels::math::exp_neg;
use rotkv_kernels::math::f64_to_f16;
use rotkv_kernels::params::{AppendParams, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DecodeParams};

/// Tokens scored per softmax step (one max and one rescale per chunk).
const CHUNK: usize = 64;

/// Token columns of a chunk's transposed key codes (`avx2::transpose_codes`): a chunk
/// rounded up to whole token sets of every `avx2::dots_codes_t` instance (16, 24, 32 or
/// 48 tokens). The AVX2 transposition zeroes the columns past the chunk; the 512-bit
/// one (`avx512::transpose_codes`) writes the chunk rounded up to 16 tokens only (its
/// kernel reads no further), so the columns after those hold what an earlier chunk left.
const CODES_T_COLS: usize = 96;

/// Defines `$best`, which runs the function `$generic` (generic over [`Kernels`], taking
/// them first) with the best kernels this processor supports: on x86-64 with AVX2, FMA
/// and F16C a copy of it compiled for them (so that the kernels inline), else with the
/// portable kernels.
macro_rules! with_best_kernels {
    (
        $(#[$meta:meta])*
        $vis:vis fn $best:ident<$($lt:lifetime),+>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $generic:ident;
    ) => {
        with_best_kernels!(@ [$($lt),+] $(#[$meta])* $vis $best($($arg: $ty),*) $(-> $ret)? = $generic);
    };
    (
        $(#[$meta:meta])*
        $vis:vis fn $best:ident<$($t:ident: $bound:path),*>($($arg:ident: $ty:ty),* $(,)?)
            $(-> $ret:ty)? = $generic:ident;
    ) => {
        with_best_kernels!(@ [$($t: $bound),*] $(#[$meta])* $vis $best($($arg: $ty),*) $(-> $ret)? = $generic);
    };
    (
        @ [$($gen:tt)*] $(#[$meta:meta])* $vis:vis $best:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?
            = $generic:ident
    ) => {
        $(#[$meta])*
        $vis fn $best<$($gen)*>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            if let Some(kern) = Avx2::detect() {
                #[target_feature(enable = "avx2,fma,f16c")]
                #[allow(clippy::too_many_arguments)]
                fn avx2<$($gen)*>(kern: Avx2, $($arg: $ty),*) $(-> $ret)? {
                    $generic(kern, $($arg),*)
                }
                // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target
                // features.
                return unsafe { avx2(kern, $($arg),*) };
            }
            $generic(Portable, $($arg),*)
        }
    };
}

mod append;
mod decode;
mod kernels;
mod quantize;
mod rotate;
#[cfg(test)]
mod tests;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod lanes;

pub use append::append;
pub use decode::{decode, decode_f16_baseline, default_splits};
pub use kernels::KeyScores;
pub use rotate::{fwht, stored_row};

pub(crate) use append::*;
pub(crate) use decode::*;
pub(crate) use kernels::*;
use quantize::*;
pub(crate) use rotate::*;

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::Avx2;

/// [`set_avx512`]'s choice: 0 none yet (then `ROTKV_CPU_ISA`), 1 on, 2 off.
static AVX512_CHOICE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether the 256-bit kernels only were asked for: by [`set_avx512`]`(false)`, or, if it
/// was never called, by `ROTKV_CPU_ISA=avx2` in the environment (read once).
fn isa_is_avx2() -> bool {
    static ENV_AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match AVX512_CHOICE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => *ENV_AVX2.get_or_init(|| std::env::var("ROTKV_CPU_ISA").is_ok_and(|v| v.eq_ignore_ascii_case("avx2"))),
    }
}

/// Turns the CPU backend's 512-bit kernels (decode's packed-code kernels, append's
/// one-pass staging and quantizer, the FWHT) on or off for this process, from the next call
/// on (on by default where the processor has AVX-512 F, unless `ROTKV_CPU_ISA=avx2` is
/// set). The results are the same bits either way; off is for
/// side-by-side benchmarks and for processors that lower their clock for 512-bit
/// instructions. Without AVX-512 F, `true` changes nothing. See [`kernels`].
pub fn set_avx512(enabled: bool) {
    AVX512_CHOICE.store(if enabled { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
}

/// The kernel set the CPU backend's decode and append use on this processor: `"avx512"`
/// (AVX2, FMA and F16C, and decode's packed-code kernels, append's staging and codes and
/// the FWHT with 512-bit registers: AVX-512 F; the 2-bit codes also BMI2 where present),
/// `"avx2"` (AVX2, FMA and F16C; also where [`set_avx512`]`(false)` or
/// `ROTKV_CPU_ISA=avx2` turned the 512-bit kernels off) or `"portable"`. Benchmarks
/// print it beside their numbers.
pub fn kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect() {
        return if kern.is_wide() { "avx512" } else { "avx2" };
    }
    "portable"
}
