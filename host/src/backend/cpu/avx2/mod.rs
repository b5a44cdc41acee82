//! AVX2 + FMA micro-kernels, register-blocked over up to 4 query heads: key scores
//! of packed codes with tokens in lanes (2 to 6 sets of 8 tokens per pass), value
//! accumulation with channels in lanes (2 or 4 slices of 8 channels per pass), and
//! the same over f32 rows (f16 sinks and window: 2 tokens or 16 channels).
use super::avx512::Avx512;
use super::{CHUNK, CODES_T_COLS, DTYPE_BF16, DTYPE_F16, DTYPE_F32, IntQuery, Kernels, KeyAffine};
use crate::KvElement;
use half::f16;
use std::arch::x86_64::*;

use super::lanes::{self, W256};

pub(crate) use decode::*;
pub(crate) use quantize::*;
pub(crate) use rotate::*;

/// Proof that the processor supports AVX2, FMA and F16C: only [`Avx2::detect`]
/// makes one. Where the processor also has AVX-512 F, the decode kernels over packed
/// codes, the append's one-pass staging and quantizer and the FWHT run with 512-bit
/// registers ([`Avx512`]: the same bits, half the instructions) unless
/// `set_avx512(false)` or `ROTKV_CPU_ISA=avx2` turned them off (and the tests'
/// `narrow`).
#[derive(Clone, Copy)]
pub(crate) struct Avx2 {
    zmm: Option<Avx512>,
}

impl Avx2 {
    /// `Some` when AVX2, FMA and F16C are available.
    pub(crate) fn detect() -> Option<Self> {
        (std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c"))
        .then(|| Avx2 { zmm: Avx512::detect().filter(|_| !super::isa_is_avx2()) })
    }

    /// The same kernels with 256-bit registers only.
    #[cfg(test)]
    pub(crate) fn narrow(self) -> Self {
        Avx2 { zmm: None }
    }

    /// The packed codes of one group as the quantizer writes them with this kernel
    /// set (for the tests).
    #[cfg(test)]
    pub(crate) fn group_codes(self, x: &[f16], th: &[f32], bits: u32, out: &mut [u8]) {
        if !self.zmm.is_some_and(|z| z.group_codes(x, th, bits, out)) {
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe { group_codes(x, th, bits, out) }
        }
    }

    /// Whether the 512-bit kernels run (decode's packed-code kernels, append's staging
    /// and codes, the FWHT).
    pub(crate) fn is_wide(self) -> bool {
        self.zmm.is_some()
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let n8 = src.len() / 8 * 8;
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= n8 <= len of both slices.
        unsafe { _mm256_storeu_ps(dp.add(i), _mm256_cvtph_ps(_mm_loadu_si128(sp.add(i).cast()))) };
    }
    for i in n8..src.len() {
        dst[i] = src[i].to_f32();
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len());
    let n8 = src.len() / 8 * 8;
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= n8 <= len of both slices.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(sp.add(i)));
            _mm_storeu_si128(dp.add(i).cast(), h)
        };
    }
    for i in n8..src.len() {
        dst[i] = f16::from_f32(src[i]);
    }
}

/// Smallest of the eight lanes (the largest of their negations, negated).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hmin(v: __m256) -> f32 {
    -hmax(_mm256_sub_ps(_mm256_setzero_ps(), v))
}

/// Largest of the eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
    _mm_cvtss_f32(m)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// An address in each cache line that `bytes` touches, from the line its first byte
/// is in: a slice that does not start a line (an input row a token stride from the
/// last, a page of a pool that is not 64-byte aligned) touches one line more than
/// its length in lines, and a prefetch of every 64th byte from its start leaves that
/// last line out.
#[inline(always)]
pub(super) fn lines(bytes: &[u8]) -> impl Iterator<Item = *const u8> {
    let p = bytes.as_ptr();
    let skew = p as usize % 64;
    let n = if bytes.is_empty() { 0 } else { skew + bytes.len() };
    (0..n).step_by(64).map(move |at| p.wrapping_sub(skew).wrapping_add(at))
}

/// Calls `f(0)`, `f(1)`, ..., `f(N - 1)` written out (for N of 4, 8 and 16), so that
/// each index is a constant once `f` is inlined: arrays of registers indexed by it stay
/// in registers, where LLVM leaves a loop over them rolled, with the array in memory.
#[inline(always)]
pub(super) fn unrolled<const N: usize>(mut f: impl FnMut(usize)) {
    macro_rules! calls {
        ($($i:literal)*) => {{ $( f($i); )* }};
    }
    match N {
        1 => calls!(0),
        2 => calls!(0 1),
        3 => calls!(0 1 2),
        4 => calls!(0 1 2 3),
        6 => calls!(0 1 2 3 4 5),
        8 => calls!(0 1 2 3 4 5 6 7),
        16 => calls!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15),
        _ => (0..N).for_each(f),
    }
}

macro_rules! by_head_blocks {
    ($g:expr, $h0:ident, $f:ident, ($($arg:expr),*) $(, $bits:literal)?) => {{
        let mut $h0 = 0;
        while $h0 < $g {
            let hn = ($g - $h0).min(4);
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were
            // detected; the VNNI kernels are called only with a `Vnni` value, which
            // exists only after AVX-512 F, VNNI and VL were detected too.
            unsafe {
                match hn {
                    4 => $f::<4 $(, $bits)?>($($arg,)* ),
                    3 => $f::<3 $(, $bits)?>($($arg,)* ),
                    2 => $f::<2 $(, $bits)?>($($arg,)* ),
                    _ => $f::<1 $(, $bits)?>($($arg,)* ),
                }
            }
            $h0 += hn;
        }
    }};
}

/// Proof that the processor also has AVX-512 VNNI and AVX-512 VL, so `vpdpbusd` on
/// 256-bit registers: only [`Vnni::detect`] makes one. (The VEX form of AVX-VNNI
/// alone, on client cores without AVX-512, is not used: no machine this was built on
/// had it to test it.)
#[derive(Clone, Copy)]
pub(crate) struct Vnni(());

impl Vnni {
    /// `Some` when AVX2, FMA, F16C, AVX-512 F, AVX-512 VNNI and AVX-512 VL are
    /// available (the compiler takes VNNI and VL to imply F, so F is checked too).
    pub(crate) fn detect() -> Option<Self> {
        (Avx2::detect().is_some()
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512vnni")
            && std::is_x86_feature_detected!("avx512vl"))
        .then_some(Vnni(()))
    }
}

impl Avx2 {
    /// [`Kernels::dots_int`] with `vpdpbusd` when `vnni` is given, `vpmaddubsw` else
    /// (the same bits).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn dots_int_with(
        self,
        vnni: Option<Vnni>,
        q: &IntQuery,
        g: usize,
        j: usize,
        codes: &[u8],
        cb: usize,
        n: usize,
        out: &mut [f32],
    ) {
        match (vnni, q.per_byte) {
            (Some(_), 4) => by_head_blocks!(g, h0, dots_int_block_vnni, (q, h0, j, codes, cb, n, out), 2),
            (Some(_), _) => by_head_blocks!(g, h0, dots_int_block_vnni, (q, h0, j, codes, cb, n, out), 4),
            (None, 4) => by_head_blocks!(g, h0, dots_int_block, (q, h0, j, codes, cb, n, out), 2),
            (None, _) => by_head_blocks!(g, h0, dots_int_block, (q, h0, j, codes, cb, n, out), 4),
        }
    }
}

impl Kernels for Avx2 {
    #[inline(always)]
    fn to_f32(self, src: &[f16], dst: &mut [f32]) {
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe { f16_to_f32(src, dst) }
    }
    #[inline(always)]
    fn round_to_f16(self, src: &[f32], dst: &mut [f16]) {
        // SAFETY: as above.
        unsafe { f32_to_f16(src, dst) }
    }
    #[inline(always)]
    fn fwht(self, x: &mut [f32]) {
        if !fwht(self, x) {
            super::fwht_portable(x)
        }
    }
    #[inline(always)]
    fn dense_rotate(self, x: &[f32], r: &[f32], out: &mut [f32]) {
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe { dense_rotate(x, r, out) }
    }
    #[inline(always)]
    fn dense_rotate_rows(self, x: &[f32], r: &[f32], d: usize, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { dense_rotate_rows(x, r, d, out) }
    }
    #[inline(always)]
    fn prefetch(self, bytes: &[u8]) {
        for line in lines(bytes) {
            // SAFETY: a prefetch is a hint and does not fault.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.cast()) };
        }
    }
    #[inline(always)]
    fn prefetch_l1(self, bytes: &[u8]) {
        for line in lines(bytes) {
            // SAFETY: a prefetch is a hint and does not fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.cast()) };
        }
    }
    #[inline(always)]
    fn exp_sum(self, s: &mut [f32], m: f32) -> f32 {
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe { exp_sum(s, m) }
    }
    #[inline(always)]
    fn exp_weights(self, s: &mut [f32], m: f32, scales: &[f32], zeros: &[f32], w: &mut [f32]) -> (f32, f32) {
        // SAFETY: as above.
        unsafe { exp_weights(self.zmm, s, m, scales, zeros, w) }
    }
    #[inline(always)]
    fn group_ranges(self, row: &[f16], g: usize, ranges: &mut [(f32, f32)]) {
        for (x, range) in row.chunks_exact(g).zip(ranges.iter_mut()) {
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            *range = unsafe { group_range(x) };
        }
    }
    #[inline(always)]
    fn stage_hadamard_pair<T: KvElement>(
        self,
        k: &[T],
        affine: KeyAffine<'_>,
        v: &[T],
        g: usize,
        key: (&mut [f16], &mut [(f32, f32)]),
        value: (&mut [f16], &mut [(f32, f32)]),
    ) -> Option<(f32, f32)> {
        if let Some(z) = self.zmm {
            return z.stage_hadamard_pair(k, affine, v, g, key, value);
        }
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe {
            match (k.len(), g) {
                (64, 32) => stage_pair::<T, 8, 4>(k, affine, v, key, value),
                (64, 64) => stage_pair::<T, 8, 8>(k, affine, v, key, value),
                (128, 32) => stage_pair::<T, 16, 4>(k, affine, v, key, value),
                (128, 64) => stage_pair::<T, 16, 8>(k, affine, v, key, value),
                (128, 128) => stage_pair::<T, 16, 16>(k, affine, v, key, value),
                _ => None,
            }
        }
    }
    #[inline(always)]
    fn stage_hadamard<T: KvElement>(
        self,
        src: &[T],
        affine: KeyAffine<'_>,
        g: usize,
        dst: &mut [f16],
        ranges: &mut [(f32, f32)],
    ) -> Option<f32> {
        if let Some(z) = self.zmm {
            return z.stage_hadamard(src, affine, g, dst, ranges);
        }
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe {
            match (src.len(), g) {
                (64, 32) => stage_hadamard::<T, 8, 4>(src, affine, dst, ranges),
                (64, 64) => stage_hadamard::<T, 8, 8>(src, affine, dst, ranges),
                (128, 32) => stage_hadamard::<T, 16, 4>(src, affine, dst, ranges),
                (128, 64) => stage_hadamard::<T, 16, 8>(src, affine, dst, ranges),
                (128, 128) => stage_hadamard::<T, 16, 16>(src, affine, dst, ranges),
                _ => None,
            }
        }
    }
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn quantize_rows(
        self,
        rows: &[f16],
        d: usize,
        bits: u32,
        g: usize,
        clip: u32,
        ranges: &[(f32, f32)],
        codes: &mut [u8],
        params: &mut [u8],
    ) {
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe { quantize_rows(self.zmm, rows, d, bits, g, clip, ranges, codes, params) }
    }
    #[inline(always)]
    fn dots(self, q: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]) {
        by_head_blocks!(g, h0, dots_block, (q, h0, d, rows, n, c0, c1, out));
    }
    #[inline(always)]
    fn accumulate(self, o: &mut [f32], w: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize) {
        by_head_blocks!(g, h0, accumulate_block, (o, w, h0, d, rows, n, c0, c1));
    }
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn key_dots(
        self,
        qk: &[f32],
        qt: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        gs: usize,
        n: usize,
        out: &mut [f32],
        rows: &mut [f32],
        codes_t: &mut [u32],
    ) {
        let cb = d * bits as usize / 8;
        if !cb.is_multiple_of(16) {
            // Rows that are not whole 16-byte blocks (head_dim 96 at 2 bits, which the
            // cache does not accept; the kernels do).
            return super::key_dots_by_group(self, qk, g, d, codes, bits, gs, n, out, rows);
        }
        // The 256-bit kernels: with the 512-bit ones, decode's exact path takes
        // `key_scores` instead, and no chunk reaches this.
        transpose_codes(self, codes, cb, n, codes_t);
        // Every group is whole 32-bit words: groups of 32 or more channels.
        let words = gs * bits as usize / 32;
        for j in 0..d / gs {
            let o = &mut out[j * g * CHUNK..(j + 1) * g * CHUNK];
            dots_codes_t_heads(self, qt, g, d, codes_t, bits, n, j * words, (j + 1) * words, o);
        }
    }
    #[inline(always)]
    fn spreads_prefetch(self) -> bool {
        self.zmm.is_some()
    }
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn accumulate_codes_prefetching(
        self,
        o: &mut [f32],
        w: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        n: usize,
        c0: usize,
        c1: usize,
        scratch: &mut [f32],
        pf: &[u8],
    ) {
        match self.zmm.filter(|_| Avx512::takes_values(bits, c0, c1)) {
            Some(z) => z.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, pf),
            None => {
                self.prefetch(pf);
                self.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, scratch)
            }
        }
    }
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn key_scores(
        self,
        qt: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        gs: usize,
        n: usize,
        scales: &[f32],
        zeros: &[f32],
        qsum: &[f32],
        s: &mut [f32],
        codes_t: &mut [u32],
        pf: &[u8],
    ) -> bool {
        match self.zmm {
            Some(z) if (d * bits as usize / 8).is_multiple_of(16) => {
                z.key_scores(qt, g, d, codes, bits, gs, n, scales, zeros, qsum, s, codes_t, pf);
                true
            }
            _ => false,
        }
    }
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn dots_int(self, q: &IntQuery, g: usize, j: usize, codes: &[u8], cb: usize, n: usize, out: &mut [f32]) {
        self.dots_int_with(Vnni::detect(), q, g, j, codes, cb, n, out)
    }
    #[inline(always)]
    fn accumulate_codes(
        self,
        o: &mut [f32],
        w: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        n: usize,
        c0: usize,
        c1: usize,
        _scratch: &mut [f32],
    ) {
        if let Some(z) = self.zmm.filter(|_| Avx512::takes_values(bits, c0, c1)) {
            return z.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, &[]);
        }
        let mut h0 = 0;
        while h0 < g {
            let hn = (g - h0).min(4);
            macro_rules! go {
                ($b:literal) => {
                    // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were
                    // detected.
                    unsafe {
                        match hn {
                            4 => accumulate_codes_block::<4, $b>(o, w, h0, d, codes, n, c0, c1),
                            3 => accumulate_codes_block::<3, $b>(o, w, h0, d, codes, n, c0, c1),
                            2 => accumulate_codes_wide::<2, $b>(o, w, h0, d, codes, n, c0, c1),
                            _ => accumulate_codes_wide::<1, $b>(o, w, h0, d, codes, n, c0, c1),
                        }
                    }
                };
            }
            if bits == 2 {
                go!(2)
            } else {
                go!(4)
            }
            h0 += hn;
        }
    }
}

mod decode;
mod quantize;
mod rotate;
