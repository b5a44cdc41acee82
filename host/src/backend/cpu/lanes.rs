//! The kernels that are one algorithm at two widths, written once: a [`Lanes`] width
//! (eight f32 lanes in a 256-bit register, [`W256`], or sixteen in a 512-bit one,
//! [`W512`]), whose methods are the lane operations (each one instruction, or the short
//! sequence the width needs), and bodies written over it, as the `pulp` and `std::simd`
//! crates shape them: generic `#[inline(always)]` functions where the body has no
//! closures ([`exp`], [`pow2`]), macros where it holds a row in an array of registers
//! (see the note before [`fwht_in_regs!`]). Either way the body lands inside a function
//! compiled for its width's target features (`avx2::rotate`, `avx2::decode`, `avx512`),
//! where every lane operation inlines. Each lane runs the same chain of f32 operations
//! at either width, so the two widths give the same bits lane for lane, as the
//! hand-written pairs did.
//!
//! Written once here: the FWHT butterflies of a row held in registers and the FWHT of
//! such a row in memory, the fused append's one-pass staging of a new row (load,
//! center and scale, the butterflies, the scale, rounding to f16, the groups' ranges,
//! the squared norm) and the fast `e^x` of the softmax. The other AVX-512 kernels are
//! other algorithms than their AVX2 twins (mask registers, `pdep`, rounding modes,
//! 16-byte loads that cover two code blocks, the score combine inside the kernel), so
//! they stay written per width.

use super::avx2::{hmax, hmin, hsum};
use super::{DTYPE_F16, DTYPE_F32};
use crate::KvElement;
use half::f16;
use std::arch::x86_64::*;

/// A width of f32 vector registers, with the operations the generic kernels use. A
/// value is the proof that the processor has the width's target features: only
/// [`W256::assume`] and [`W512::assume`] make one, so the safe methods may execute the
/// width's instructions.
pub(crate) trait Lanes: Copy {
    /// f32 lanes per register.
    const N: usize;
    /// One register of `N` f32.
    type V: Copy;

    /// Zero in every lane.
    fn zero(self) -> Self::V;
    /// `x` in every lane.
    fn splat(self, x: f32) -> Self::V;
    /// `N` floats at `p`.
    ///
    /// # Safety
    /// `p` is valid for reads of `N` floats.
    unsafe fn load(self, p: *const f32) -> Self::V;
    /// `v` into the `N` floats at `p`.
    ///
    /// # Safety
    /// `p` is valid for writes of `N` floats.
    unsafe fn store(self, p: *mut f32, v: Self::V);
    /// `N` elements of an input row at `p` as f32 (exact: f16 by F16C, bf16 by a shift
    /// into the high half).
    ///
    /// # Safety
    /// `p` is valid for reads of `N` elements, and `T` is f32, f16 or bf16 (its `DTYPE`,
    /// with the size of that type: `loadable`).
    unsafe fn load_elems<T: KvElement>(self, p: *const T) -> Self::V;
    /// `v` rounded to f16 (to nearest, ties to even) into the `N` halves at `p`.
    ///
    /// # Safety
    /// `p` is valid for writes of `N` halves.
    unsafe fn store_f16(self, p: *mut f16, v: Self::V);
    /// `v` rounded to f16 and back.
    fn round_f16(self, v: Self::V) -> Self::V;
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    fn div(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, rounded once.
    fn fmadd(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    fn min(self, a: Self::V, b: Self::V) -> Self::V;
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// Each lane rounded to the nearest integer (ties to even).
    fn round(self, v: Self::V) -> Self::V;
    /// `2^n` in each lane for the integral `n` in it (`-126 <= n <= 127`), built in the
    /// exponent bits.
    fn exp2i(self, n: Self::V) -> Self::V;
    /// `y` where `x >= floor` (ordered), zero elsewhere.
    fn zero_unless_ge(self, x: Self::V, floor: Self::V, y: Self::V) -> Self::V;
    /// Smallest lane.
    fn hmin(self, v: Self::V) -> f32;
    /// Largest lane.
    fn hmax(self, v: Self::V) -> f32;
    /// Sum of the lanes (in the width's own order).
    fn hsum(self, v: Self::V) -> f32;
    /// The unscaled FWHT butterflies of strides `1, 2, .., N / 2` inside one register, in
    /// the order of the portable FWHT: per stride, a lane swap and a multiply-add with
    /// `+-1` (exact, since `x * -1 + y` rounds once like `y - x`).
    fn butterflies(self, v: Self::V) -> Self::V;
}

/// The [`Lanes`] methods that are one intrinsic at either width, from the intrinsics'
/// names (`$v` the register type); a `SAFETY` comment at each use.
macro_rules! one_intrinsic_ops {
    (
        $v:ty; zero $zero:ident, splat $splat:ident, load $load:ident, store $store:ident, add $add:ident,
        sub $sub:ident, mul $mul:ident, div $div:ident, fmadd $fmadd:ident, min $min:ident, max $max:ident,
        hmin $hmin:ident, hmax $hmax:ident, hsum $hsum:ident
    ) => {
        #[inline(always)]
        fn zero(self) -> $v {
            unsafe { $zero() }
        }
        #[inline(always)]
        fn splat(self, x: f32) -> $v {
            unsafe { $splat(x) }
        }
        #[inline(always)]
        unsafe fn load(self, p: *const f32) -> $v {
            unsafe { $load(p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32, v: $v) {
            unsafe { $store(p, v) }
        }
        #[inline(always)]
        fn add(self, a: $v, b: $v) -> $v {
            unsafe { $add(a, b) }
        }
        #[inline(always)]
        fn sub(self, a: $v, b: $v) -> $v {
            unsafe { $sub(a, b) }
        }
        #[inline(always)]
        fn mul(self, a: $v, b: $v) -> $v {
            unsafe { $mul(a, b) }
        }
        #[inline(always)]
        fn div(self, a: $v, b: $v) -> $v {
            unsafe { $div(a, b) }
        }
        #[inline(always)]
        fn fmadd(self, a: $v, b: $v, c: $v) -> $v {
            unsafe { $fmadd(a, b, c) }
        }
        #[inline(always)]
        fn min(self, a: $v, b: $v) -> $v {
            unsafe { $min(a, b) }
        }
        #[inline(always)]
        fn max(self, a: $v, b: $v) -> $v {
            unsafe { $max(a, b) }
        }
        #[inline(always)]
        fn hmin(self, v: $v) -> f32 {
            unsafe { $hmin(v) }
        }
        #[inline(always)]
        fn hmax(self, v: $v) -> f32 {
            unsafe { $hmax(v) }
        }
        #[inline(always)]
        fn hsum(self, v: $v) -> f32 {
            unsafe { $hsum(v) }
        }
    };
}

/// Eight f32 lanes in a 256-bit register (AVX2, FMA, F16C).
#[derive(Clone, Copy)]
pub(crate) struct W256(());

impl W256 {
    /// The width's token.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present (the caller is compiled for them with
    /// `#[target_feature]`, or holds an `Avx2`).
    #[inline(always)]
    pub(crate) unsafe fn assume() -> Self {
        W256(())
    }
}

// SAFETY (every `unsafe` block of this impl): a `W256` exists only where AVX2, FMA and
// F16C are present (`W256::assume`); the pointer methods pass on their callers' contracts.
impl Lanes for W256 {
    const N: usize = 8;
    type V = __m256;

    one_intrinsic_ops!(
        __m256; zero _mm256_setzero_ps, splat _mm256_set1_ps, load _mm256_loadu_ps, store _mm256_storeu_ps,
        add _mm256_add_ps, sub _mm256_sub_ps, mul _mm256_mul_ps, div _mm256_div_ps, fmadd _mm256_fmadd_ps,
        min _mm256_min_ps, max _mm256_max_ps, hmin hmin, hmax hmax, hsum hsum
    );
    #[inline(always)]
    unsafe fn load_elems<T: KvElement>(self, p: *const T) -> __m256 {
        unsafe {
            if T::DTYPE == DTYPE_F32 {
                _mm256_loadu_ps(p.cast())
            } else if T::DTYPE == DTYPE_F16 {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            } else {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
            }
        }
    }
    #[inline(always)]
    unsafe fn store_f16(self, p: *mut f16, v: __m256) {
        unsafe { _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }
    #[inline(always)]
    fn round_f16(self, v: __m256) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }
    #[inline(always)]
    fn round(self, v: __m256) -> __m256 {
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
    }
    #[inline(always)]
    fn exp2i(self, n: __m256) -> __m256 {
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            )))
        }
    }
    #[inline(always)]
    fn zero_unless_ge(self, x: __m256, floor: __m256, y: __m256) -> __m256 {
        unsafe { _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_GE_OQ>(x, floor)) }
    }
    #[inline(always)]
    fn butterflies(self, a: __m256) -> __m256 {
        unsafe {
            let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
            let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
            let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
            let a = _mm256_fmadd_ps(a, s1, _mm256_permute_ps::<0xB1>(a));
            let a = _mm256_fmadd_ps(a, s2, _mm256_permute_ps::<0x4E>(a));
            _mm256_fmadd_ps(a, s4, _mm256_permute2f128_ps::<1>(a, a))
        }
    }
}

/// Sixteen f32 lanes in a 512-bit register (AVX-512 F, with AVX2, FMA and F16C).
#[derive(Clone, Copy)]
pub(crate) struct W512(());

impl W512 {
    /// The width's token.
    ///
    /// # Safety
    /// AVX-512 F, AVX2, FMA and F16C are present (the caller is compiled for them with
    /// `#[target_feature]`, or holds an `Avx512`).
    #[inline(always)]
    pub(crate) unsafe fn assume() -> Self {
        W512(())
    }
}

// SAFETY (every `unsafe` block of this impl): a `W512` exists only where AVX-512 F,
// AVX2, FMA and F16C are present (`W512::assume`); the pointer methods pass on their
// callers' contracts.
impl Lanes for W512 {
    const N: usize = 16;
    type V = __m512;

    one_intrinsic_ops!(
        __m512; zero _mm512_setzero_ps, splat _mm512_set1_ps, load _mm512_loadu_ps, store _mm512_storeu_ps,
        add _mm512_add_ps, sub _mm512_sub_ps, mul _mm512_mul_ps, div _mm512_div_ps, fmadd _mm512_fmadd_ps,
        min _mm512_min_ps, max _mm512_max_ps, hmin _mm512_reduce_min_ps, hmax _mm512_reduce_max_ps,
        hsum _mm512_reduce_add_ps
    );
    #[inline(always)]
    unsafe fn load_elems<T: KvElement>(self, p: *const T) -> __m512 {
        unsafe {
            if T::DTYPE == DTYPE_F32 {
                _mm512_loadu_ps(p.cast())
            } else if T::DTYPE == DTYPE_F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
            }
        }
    }
    #[inline(always)]
    unsafe fn store_f16(self, p: *mut f16, v: __m512) {
        unsafe { _mm256_storeu_si256(p.cast(), _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }
    #[inline(always)]
    fn round_f16(self, v: __m512) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }
    #[inline(always)]
    fn round(self, v: __m512) -> __m512 {
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
    }
    #[inline(always)]
    fn exp2i(self, n: __m512) -> __m512 {
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            )))
        }
    }
    #[inline(always)]
    fn zero_unless_ge(self, x: __m512, floor: __m512, y: __m512) -> __m512 {
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, floor), y) }
    }
    /// Strides 1 and 2 inside each 128-bit lane, 4 and 8 across them.
    #[inline(always)]
    fn butterflies(self, a: __m512) -> __m512 {
        unsafe {
            let (p, m) = (1.0f32, -1.0f32);
            let s1 = _mm512_setr_ps(p, m, p, m, p, m, p, m, p, m, p, m, p, m, p, m);
            let s2 = _mm512_setr_ps(p, p, m, m, p, p, m, m, p, p, m, m, p, p, m, m);
            let s4 = _mm512_setr_ps(p, p, p, p, m, m, m, m, p, p, p, p, m, m, m, m);
            let s8 = _mm512_setr_ps(p, p, p, p, p, p, p, p, m, m, m, m, m, m, m, m);
            let a = _mm512_fmadd_ps(a, s1, _mm512_permute_ps::<0xB1>(a));
            let a = _mm512_fmadd_ps(a, s2, _mm512_permute_ps::<0x4E>(a));
            // 128-bit lanes [1, 0, 3, 2], then [2, 3, 0, 1].
            let a = _mm512_fmadd_ps(a, s4, _mm512_shuffle_f32x4::<0xB1>(a, a));
            _mm512_fmadd_ps(a, s8, _mm512_shuffle_f32x4::<0x4E>(a, a))
        }
    }
}

// The bodies below that hold a row in an array of registers are macros, expanded inside
// each width's `#[target_feature]` function: their closures (`unrolled`'s, which make
// every array index a constant so that the array stays in registers) then are compiled
// with the width's features, and every lane operation inlines into one instruction. As
// generic `#[inline(always)]` functions their closures were compiled without the features
// and LLVM left every operation a call (append 7 times slower).

/// The unscaled FWHT butterflies of a row of `N * R` floats held in the array `$v` (a
/// `&mut [L::V; R]`) with the width `$l: $L`: [`Lanes::butterflies`] in each register,
/// then strides `N` and up between registers (`h` registers apart), in the order of the
/// portable FWHT (each butterfly the same two operands, so the same bits).
macro_rules! fwht_in_regs {
    ($l:ident: $L:ty, $v:expr, $r:expr) => {{
        use $crate::backend::cpu::avx2::unrolled;
        use $crate::backend::cpu::lanes::Lanes as _;
        const { assert!($r <= 16, "up to 16 registers") };
        let (l, v): ($L, &mut [<$L as $crate::backend::cpu::lanes::Lanes>::V; $r]) = ($l, $v);
        unrolled::<$r>(|r| v[r] = l.butterflies(v[r]));
        // Stride h between registers, called with constants (so every index is one).
        let mut stage = |h: usize| {
            if h < $r {
                // Pair k of the stage: i = its block's start + k % h, with i + h.
                unrolled::<$r>(|k| {
                    if k < $r / 2 {
                        let i = k / h * 2 * h + k % h;
                        let (a, b) = (v[i], v[i + h]);
                        v[i] = l.add(a, b);
                        v[i + h] = l.sub(a, b);
                    }
                });
            }
        };
        stage(1);
        stage(2);
        stage(4);
        stage(8);
    }};
}
pub(crate) use fwht_in_regs;

/// The FWHT butterflies of the `N * R` floats at `$p` (a `*mut f32` valid for reads and
/// writes of them: the caller's `unsafe` block vouches) in registers, then a
/// multiplication by `$scale` (an `Option<f32>`) where given.
macro_rules! fwht_regs {
    ($l:ident: $L:ty, $r:expr, $p:expr, $scale:expr) => {{
        use $crate::backend::cpu::avx2::unrolled;
        use $crate::backend::cpu::lanes::Lanes as _;
        const N: usize = <$L as $crate::backend::cpu::lanes::Lanes>::N;
        let (l, p, scale): ($L, *mut f32, Option<f32>) = ($l, $p, $scale);
        let mut v = [l.zero(); $r];
        unrolled::<$r>(|r| {
            // SAFETY: N * r + N <= N * R, the caller's floats.
            v[r] = unsafe { l.load(p.add(N * r)) };
        });
        $crate::backend::cpu::lanes::fwht_in_regs!(l: $L, &mut v, $r);
        unrolled::<$r>(|r| {
            let y = match scale {
                Some(s) => l.mul(v[r], l.splat(s)),
                None => v[r],
            };
            // SAFETY: as for the loads.
            unsafe { l.store(p.add(N * r), y) };
        });
    }};
}
pub(crate) use fwht_regs;

/// A new row of `N * R` channels of type `$t` (`$src`, of exactly that length, a type
/// that `loadable` takes: the caller has checked both) in `R` registers, as f32,
/// centered and scaled as `$affine` says (the same f32 operations as `load_affine`), and
/// two partial sums of its squares: the first steps of [`stage_hadamard!`]. Evaluates to
/// `(registers, partial sums)`.
macro_rules! load_row {
    ($l:ident: $L:ty, $t:ty, $r:expr, $src:expr, $affine:expr) => {{
        use $crate::backend::cpu::KeyAffine;
        use $crate::backend::cpu::avx2::unrolled;
        use $crate::backend::cpu::lanes::Lanes as _;
        const N: usize = <$L as $crate::backend::cpu::lanes::Lanes>::N;
        let (l, src, affine): ($L, &[$t], KeyAffine<'_>) = ($l, $src, $affine);
        let d = N * $r;
        let sp = src.as_ptr();
        let mut v = [l.zero(); $r];
        // One loop per case, each with a constant trip count and a short body (so that the
        // array stays in registers).
        match affine {
            KeyAffine::None => unrolled::<$r>(|r| {
                // SAFETY: N * r + N <= d = src.len(); the type is one of the three (both
                // checked by the caller).
                v[r] = unsafe { l.load_elems(sp.add(N * r)) };
            }),
            KeyAffine::Center(m) => {
                assert_eq!(m.len(), d);
                unrolled::<$r>(|r| {
                    // SAFETY: as above, and `m` has d floats.
                    v[r] = unsafe { l.sub(l.load_elems(sp.add(N * r)), l.load(m.as_ptr().add(N * r))) };
                });
            }
            KeyAffine::Full(m, sc) => {
                assert!(m.len() == d && sc.len() == d);
                unrolled::<$r>(|r| {
                    // SAFETY: as above, and `m` and `sc` have d floats.
                    v[r] = unsafe {
                        let (m, sc) = (l.load(m.as_ptr().add(N * r)), l.load(sc.as_ptr().add(N * r)));
                        l.div(l.sub(l.load_elems(sp.add(N * r)), m), sc)
                    };
                });
            }
        }
        let mut acc = [l.zero(); 2];
        unrolled::<$r>(|r| acc[r % 2] = l.fmadd(v[r], v[r], acc[r % 2]));
        (v, acc)
    }};
}
pub(crate) use load_row;

/// The last steps of [`stage_hadamard!`] on a rotated row `$v` of `R` registers (groups of
/// `PER` registers) with partial squares `$acc`: the scale, the f16 row into `$dst`, the
/// groups' ranges into `$ranges`; evaluates to the squared norm. The caller has checked
/// `$dst.len() == N * R`, and that `R / PER` groups of `PER` registers (at most 8) make
/// the row, one range each.
macro_rules! finish_row {
    ($l:ident: $L:ty, $r:expr, $per:expr, $v:expr, $acc:expr, $dst:expr, $ranges:expr) => {{
        use $crate::backend::cpu::avx2::unrolled;
        use $crate::backend::cpu::lanes::Lanes as _;
        type V = <$L as $crate::backend::cpu::lanes::Lanes>::V;
        const N: usize = <$L as $crate::backend::cpu::lanes::Lanes>::N;
        let (l, v, acc, dst, ranges): ($L, &[V; $r], [V; 2], &mut [half::f16], &mut [(f32, f32)]) =
            ($l, $v, $acc, $dst, $ranges);
        let d = N * $r;
        let scale = l.splat(1.0 / (d as f32).sqrt());
        let dp = dst.as_mut_ptr();
        let mut lo = [l.splat(f32::INFINITY); 8];
        let mut hi = [l.splat(f32::NEG_INFINITY); 8];
        unrolled::<$r>(|r| {
            let y = l.mul(v[r], scale);
            // SAFETY: N * r + N <= d = dst.len().
            unsafe { l.store_f16(dp.add(N * r), y) };
            lo[r / $per] = l.min(lo[r / $per], y);
            hi[r / $per] = l.max(hi[r / $per], y);
        });
        // Rounding to f16 is monotone, so the rounded min and max are the min and max of
        // the rounded row (up to the sign of a zero, which `group_params` decides).
        for (j, range) in ranges.iter_mut().enumerate() {
            *range = (l.hmin(l.round_f16(lo[j])), l.hmax(l.round_f16(hi[j])));
        }
        l.hsum(l.add(acc[0], acc[1]))
    }};
}
pub(crate) use finish_row;

/// The fused append's staging of one new row of `N * R` channels for a Hadamard
/// rotation with no channel permutation, in registers: the row loaded as f32, centered
/// and scaled (`affine`, the same f32 operations as `load_affine`), its squared norm
/// (the fast check's, in another order: FMAs into the lanes), the butterflies and the
/// scale (the same bits as the portable FWHT), rounding to f16 into `dst`, and the min
/// and max of each group of `N * PER` channels of the stored row into `ranges` (as the
/// quantizer's `group_range` finds them). Every loop has a constant trip count, so that
/// the row stays in registers. Evaluates to `None` (nothing written) for another element
/// type or row length, else `Some(squared norm)`.
macro_rules! stage_hadamard {
    ($l:ident: $L:ty, $t:ty, $r:expr, $per:expr, $src:expr, $affine:expr, $dst:expr, $ranges:expr) => {{
        use $crate::backend::cpu::avx2::loadable;
        use $crate::backend::cpu::lanes::{finish_row, fwht_in_regs, load_row};
        const N: usize = <$L as $crate::backend::cpu::lanes::Lanes>::N;
        let (src, dst, ranges): (&[$t], &mut [half::f16], &mut [(f32, f32)]) = ($src, $dst, $ranges);
        let d = N * $r;
        if !loadable::<$t>() || src.len() != d || dst.len() != d {
            None
        } else {
            assert!(N * $per >= 32 && $r % $per == 0 && $r / $per <= 8 && ranges.len() == $r / $per);
            let (mut v, acc) = load_row!($l: $L, $t, $r, src, $affine);
            fwht_in_regs!($l: $L, &mut v, $r);
            Some(finish_row!($l: $L, $r, $per, &v, acc, dst, ranges))
        }
    }};
}
pub(crate) use stage_hadamard;

/// `e^x` in each lane for `x <= 88` (0 below -87, and for `-inf`), to 2e-7 relative:
/// `x = n ln2 + r` (`n` rounded, `r` by two FMAs with ln2 split in a high part of 17
/// bits and the rest, so `r` is exact to 1e-10 for `|n| <= 126`), then
/// `e^r = 1 + r + r^2 (c2 + c3 r + c4 r^2 + c5 r^3)` on `|r| <= ln2 / 2` with
/// coefficients fitted for the least maximal relative error (1.05e-7 in exact
/// arithmetic; 1.8e-7 in f32 over `[-87, 20]`, see `fast_exp_is_accurate`), and
/// `2^n` built in the exponent bits. One degree and about ten instructions fewer
/// than [`super::exp_neg`]'s Taylor polynomial without FMA. The same operations in the
/// same order at either width, so the same bits in every lane.
#[inline(always)]
pub(crate) fn exp<L: Lanes>(l: L, x: L::V) -> L::V {
    let floor = l.splat(-87.0);
    let xc = l.max(x, floor);
    let n = l.round(l.mul(xc, l.splat(std::f32::consts::LOG2_E)));
    let r = l.fmadd(n, l.splat(-0.693_145_75), xc);
    let r = l.fmadd(n, l.splat(-1.428_606_8e-6), r);
    let p = l.fmadd(l.splat(8.312_525e-3), r, l.splat(4.189_011_5e-2));
    let p = l.fmadd(p, r, l.splat(0.166_671_14));
    let p = l.fmadd(p, r, l.splat(0.499_992_3));
    let y = l.add(l.fmadd(l.mul(r, r), p, r), l.splat(1.0));
    let y = l.mul(y, l.exp2i(n));
    l.zero_unless_ge(x, floor, y)
}

/// `2^e` in every lane (`-126 <= e <= 127`).
#[inline(always)]
pub(crate) fn pow2<L: Lanes>(l: L, e: i32) -> L::V {
    l.splat(f32::from_bits(((127 + e) as u32) << 23))
}
