//! The decode kernels over packed codes, the append's one-pass staging and quantizer, and the
//! FWHT, with 512-bit registers (AVX-512 F; the 2-bit codes also use BMI2's `pdep`, where
//! it is present).
//!
//! The same arithmetic as the AVX2 kernels they stand in for, lane for lane: each lane
//! runs the same chain of f32 multiply-adds in the same order, so the results are the
//! same bits (the tests run both and compare them bit for bit). What changes is the
//! instruction count: one instruction covers 16 lanes instead of 8, so the front end
//! issues half as many for the same work, and 32 registers hold a whole chunk's
//! accumulators.
//!
//! One condition: the floating-point environment is the default one. A process that
//! sets flush-to-zero or denormals-are-zero (some fast-math builds and frameworks do)
//! can see other bits for 1 or 2 heads per KV head, whose AVX2 value kernel shifts the
//! top code of each byte down where this one masks it in place and scales the sum back
//! by a power of two (exact, unless a product is subnormal and flushed).
//!
//! Why: the AVX2 kernels issue 4-5 instructions per cycle (loads, masks, conversions and
//! broadcasts beside the multiply-adds) and ran at 1.2-1.5x their FMA floor hot in L1;
//! on Zen 4, which runs a 512-bit multiply-add as two 256-bit halves, the FMA floor is
//! the same and the rest halves. On processors with two 512-bit FMA units the floor
//! itself halves.

use super::avx2::{lines, loadable};
use super::lanes::{self, W512};
use super::{CHUNK, CODES_T_COLS, KeyAffine};
use crate::KvElement;
use half::f16;
use std::arch::x86_64::*;

/// Proof that the processor supports AVX-512 F (with AVX2, FMA and F16C): only
/// [`Avx512::detect`] makes one. It also records whether BMI2 is there (the 2-bit codes'
/// `pdep`; every processor with AVX-512 F known has it, but a virtual machine may hide it).
#[derive(Clone, Copy)]
pub(crate) struct Avx512 {
    bmi2: bool,
}

impl Avx512 {
    /// `Some` when AVX-512 F, AVX2, FMA and F16C are available.
    pub(crate) fn detect() -> Option<Self> {
        (std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c"))
        .then(|| Avx512 { bmi2: std::is_x86_feature_detected!("bmi2") })
    }

    /// Whether [`Avx512::accumulate_codes`] takes channels `[c0, c1)` of `bits`-bit
    /// codes: whole pairs of 8-byte code blocks (64 channels at 2 bits, 32 at 4).
    pub(crate) fn takes_values(bits: u32, c0: usize, c1: usize) -> bool {
        let pair = 2 * 64 / bits as usize;
        c0.is_multiple_of(pair) && c1.is_multiple_of(pair)
    }

    /// Value accumulation from packed codes, `o[h][c] += sum_t w[h][t] code[t][c]` for
    /// heads `h < g` (in blocks of up to 4) and channels `[c0, c1)` (see
    /// [`Avx512::takes_values`]): the AVX2 `accumulate_codes_block`'s sums, bit for bit.
    /// The lines of `pf` (the next page's, or empty) are prefetched into L2 along the way:
    /// one per token of the first head block's first pass, the rest after it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn accumulate_codes(
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
        pf: &[u8],
    ) {
        assert!(Self::takes_values(bits, c0, c1));
        let mut pf = pf;
        let mut h0 = 0;
        while h0 < g {
            let hn = (g - h0).min(4);
            macro_rules! go {
                ($b:literal) => {
                    // SAFETY: an `Avx512` value exists only after AVX-512 F, AVX2, FMA and
                    // F16C were detected.
                    unsafe {
                        match hn {
                            4 => accumulate_codes_block::<4, $b>(o, w, h0, d, codes, n, c0, c1, pf),
                            3 => accumulate_codes_block::<3, $b>(o, w, h0, d, codes, n, c0, c1, pf),
                            2 => accumulate_codes_block::<2, $b>(o, w, h0, d, codes, n, c0, c1, pf),
                            _ => accumulate_codes_block::<1, $b>(o, w, h0, d, codes, n, c0, c1, pf),
                        }
                    }
                };
            }
            if bits == 2 {
                go!(2)
            } else {
                go!(4)
            }
            pf = &[];
            h0 += hn;
        }
    }

    /// The exact key scores of a chunk, every group, straight into the scores `s`
    /// (`[g][CHUNK]`; lanes from `n` up to the next multiple of 16 are written too, from
    /// zero codes and whatever `scales` and `zeros` hold there, and are not scores):
    /// `s[h][t] = sum_j (scales[j][t] dot_j[h][t] + zeros[j][t] qsum[h][j])` with `scales` and `zeros` `[groups][CHUNK]` and `qsum` `[g][groups]`,
    /// the group sums in order, the same operations as the AVX2 path (its dot products,
    /// then `HeadState::key_scores`' f32 multiplies and adds), so the same bits.
    /// `codes` are `n` rows of `cb` bytes, a multiple of 16; groups of `gs` channels are
    /// whole dwords. The lines of `pf` (part of the next page, or empty) are prefetched
    /// into L2 along the first group's pass, one per code position.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn key_scores(
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
    ) {
        let cb = d * bits as usize / 8;
        self.transpose_codes(codes, cb, n, codes_t);
        let (groups, words) = (d / gs, gs * bits as usize / 32);
        for j in 0..groups {
            let combine = Combine {
                scales: &scales[j * CHUNK..(j + 1) * CHUNK],
                zeros: &zeros[j * CHUNK..(j + 1) * CHUNK],
                qsum,
                groups,
                j,
            };
            let pf = if j == 0 { pf } else { &[][..] };
            self.dots_codes_t_heads(qt, g, d, codes_t, bits, n, j * words, (j + 1) * words, s, combine, pf);
        }
    }

    /// One group's scores for the `g` heads over dwords `[w0, w1)` of the transposed key
    /// codes, tokens in lanes: one pass of up to 4 sets of 16 tokens per block of up to
    /// 4 heads (the first block prefetches `pf`).
    #[allow(clippy::too_many_arguments)]
    fn dots_codes_t_heads(
        self,
        qt: &[f32],
        g: usize,
        d: usize,
        codes_t: &[u32],
        bits: u32,
        n: usize,
        w0: usize,
        w1: usize,
        out: &mut [f32],
        combine: Combine<'_>,
        pf: &[u8],
    ) {
        let mut pf = pf;
        let mut h0 = 0;
        while h0 < g {
            let hn = (g - h0).min(4);
            macro_rules! sets {
                ($b:literal, $h:literal) => {
                    // SAFETY: an `Avx512` value exists only after AVX-512 F, AVX2, FMA and
                    // F16C were detected.
                    unsafe {
                        match n.div_ceil(16) {
                            0 => {}
                            1 => dots_codes_t::<$h, $b, 1>(qt, h0, d, codes_t, n, w0, w1, out, combine, pf),
                            2 => dots_codes_t::<$h, $b, 2>(qt, h0, d, codes_t, n, w0, w1, out, combine, pf),
                            3 => dots_codes_t::<$h, $b, 3>(qt, h0, d, codes_t, n, w0, w1, out, combine, pf),
                            _ => dots_codes_t::<$h, $b, 4>(qt, h0, d, codes_t, n, w0, w1, out, combine, pf),
                        }
                    }
                };
            }
            match (bits, hn) {
                (2, 4) => sets!(2, 4),
                (2, 3) => sets!(2, 3),
                (2, 2) => sets!(2, 2),
                (2, _) => sets!(2, 1),
                (_, 4) => sets!(4, 4),
                (_, 3) => sets!(4, 3),
                (_, 2) => sets!(4, 2),
                _ => sets!(4, 1),
            }
            pf = &[];
            h0 += hn;
        }
    }
}

impl Avx512 {
    /// The AVX2 `transpose_codes` for [`Avx512::dots_codes_t_heads`]: a chunk's key codes,
    /// `n <= CHUNK` rows of `cb` bytes (a multiple of 16), into `out[w][t]` (dword `w` of
    /// token `t`'s row), for the tokens `t < n` rounded up to a multiple of 16, the rows
    /// past `n` as zeros (the columns after those are not written: the 512-bit kernel
    /// does not read them).
    pub(crate) fn transpose_codes(self, codes: &[u8], cb: usize, n: usize, out: &mut [u32]) {
        // SAFETY: an `Avx512` value exists only after AVX-512 F, AVX2, FMA and F16C were
        // detected.
        unsafe { transpose_codes(codes, cb, n, out) }
    }
}

/// Sixteen rows at a time, per 16-byte block of the rows: four registers of four rows
/// each (rows `i, i + 4, i + 8, i + 12` in register `i`), then the 4 x 4 dword
/// transpose of SSE in each 128-bit lane, which leaves dword `k` of the block of rows
/// `t .. t + 16` in order in register `k`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn transpose_codes(codes: &[u8], cb: usize, n: usize, out: &mut [u32]) {
    assert!(cb.is_multiple_of(16) && n <= CHUNK && n * cb <= codes.len());
    let words = cb / 4;
    assert!(out.len() >= words * CODES_T_COLS && CHUNK <= CODES_T_COLS);
    let (cp, op) = (codes.as_ptr(), out.as_mut_ptr());
    let mut t = 0;
    while t < n {
        let whole = t + 16 <= n;
        for blk in 0..cb / 16 {
            // SAFETY: row t + r < n (else a zero row), bytes blk * 16 .. + 16 <= cb: inside
            // `codes` (asserted); the stores go to words 4 blk .. + 4 < words, columns t ..
            // t + 16 <= CHUNK <= CODES_T_COLS: inside `out` (asserted).
            unsafe {
                let row = |r: usize| {
                    if whole || t + r < n {
                        _mm_loadu_si128(cp.add((t + r) * cb + blk * 16).cast())
                    } else {
                        _mm_setzero_si128()
                    }
                };
                let reg = |i: usize| {
                    let v = _mm512_castsi128_si512(row(i));
                    let v = _mm512_inserti32x4::<1>(v, row(i + 4));
                    let v = _mm512_inserti32x4::<2>(v, row(i + 8));
                    _mm512_inserti32x4::<3>(v, row(i + 12))
                };
                let (r0, r1, r2, r3) = (reg(0), reg(1), reg(2), reg(3));
                let (l01, h01) = (_mm512_unpacklo_epi32(r0, r1), _mm512_unpackhi_epi32(r0, r1));
                let (l23, h23) = (_mm512_unpacklo_epi32(r2, r3), _mm512_unpackhi_epi32(r2, r3));
                let w = op.add(blk * 4 * CODES_T_COLS + t);
                _mm512_storeu_si512(w.cast(), _mm512_unpacklo_epi64(l01, l23));
                _mm512_storeu_si512(w.add(CODES_T_COLS).cast(), _mm512_unpackhi_epi64(l01, l23));
                _mm512_storeu_si512(w.add(2 * CODES_T_COLS).cast(), _mm512_unpacklo_epi64(h01, h23));
                _mm512_storeu_si512(w.add(3 * CODES_T_COLS).cast(), _mm512_unpackhi_epi64(h01, h23));
            }
        }
        t += 16;
    }
}

/// [`lanes::exp`] at sixteen lanes: the AVX2 `exp8`'s operations in the same order, so
/// the same bits in every lane.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn exp16(x: __m512) -> __m512 {
    // SAFETY: this function is compiled for AVX-512 F, AVX2, FMA and F16C.
    lanes::exp(unsafe { W512::assume() }, x)
}

impl Avx512 {
    /// The AVX2 `exp_weights` over the whole 16-token blocks of `s` (the first `n16`
    /// tokens, `s.len()` rounded down to a multiple of 16): writes `w[..n16]` and returns
    /// the running sums of `p` and of `p zeros` in eight lanes, and `n16`. They are added
    /// in the AVX2 kernel's order (the low eight tokens of each block, then the high
    /// eight), so the caller's finish gives the same bits.
    pub(crate) fn exp_weights16(
        self,
        s: &[f32],
        m: f32,
        scales: &[f32],
        zeros: &[f32],
        w: &mut [f32],
    ) -> (__m256, __m256, usize) {
        // SAFETY: an `Avx512` value exists only after AVX-512 F, AVX2, FMA and F16C were
        // detected.
        unsafe { exp_weights16(s, m, scales, zeros, w) }
    }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn exp_weights16(s: &[f32], m: f32, scales: &[f32], zeros: &[f32], w: &mut [f32]) -> (__m256, __m256, usize) {
    let n = s.len();
    assert!(scales.len() >= n && zeros.len() >= n && w.len() >= n);
    let n16 = n / 16 * 16;
    let (sp, scp, zp, wp, mv) = (s.as_ptr(), scales.as_ptr(), zeros.as_ptr(), w.as_mut_ptr(), _mm512_set1_ps(m));
    let (mut acc, mut zacc) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 <= n16 <= n, and every slice holds n or more (asserted).
        unsafe {
            let y = exp16(_mm512_sub_ps(_mm512_loadu_ps(sp.add(i)), mv));
            _mm512_storeu_ps(wp.add(i), _mm512_mul_ps(y, _mm512_loadu_ps(scp.add(i))));
            let (lo, hi) =
                (_mm512_castps512_ps256(y), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(y))));
            acc = _mm256_add_ps(acc, lo);
            zacc = _mm256_fmadd_ps(lo, _mm256_loadu_ps(zp.add(i)), zacc);
            acc = _mm256_add_ps(acc, hi);
            zacc = _mm256_fmadd_ps(hi, _mm256_loadu_ps(zp.add(i + 8)), zacc);
        }
    }
    (acc, zacc, n16)
}

/// `2^e` in every lane (`-126 <= e <= 127`).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn pow2(e: i32) -> __m512 {
    // SAFETY: this function is compiled for AVX-512 F, AVX2, FMA and F16C.
    lanes::pow2(unsafe { W512::assume() }, e)
}

/// Value accumulation of heads `[h0, h0 + H)`: each 16-byte load covers two 8-byte code
/// blocks (lanes 0-7 the first, 8-15 the second, as `vpmovzxbd` widens them), every code
/// position of a byte is one slice of 16 channels masked in place, and all of them (4
/// at 2 bits, 2 at 4) are summed in one pass over the tokens: `4 H` or `2 H`
/// accumulator chains. Lane for lane the AVX2 kernel's chain: `fma(w[t], code << p,
/// acc)` over `t` in order from zero, then `o += acc * 2^-p`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn accumulate_codes_block<const H: usize, const BITS: u32>(
    o: &mut [f32],
    w: &[f32],
    h0: usize,
    d: usize,
    codes: &[u8],
    n: usize,
    c0: usize,
    c1: usize,
    pf: &[u8],
) {
    let cb = d * BITS as usize / 8;
    let cpb = 64 / BITS as usize;
    let shifts = 8 / BITS as usize;
    // One line of `pf` per token of the first pass (the rest after it).
    let mut pf = SpreadPrefetch::new(pf);
    assert!((h0 + H) * d <= o.len() && n * cb <= codes.len() && c1 <= d && c0 <= c1);
    assert!(c0.is_multiple_of(2 * cpb) && c1.is_multiple_of(2 * cpb));
    assert!(n == 0 || (h0 + H - 1) * CHUNK + n <= w.len());
    let (op, cp, wp) = (o.as_mut_ptr(), codes.as_ptr(), w.as_ptr());
    let m = (1i32 << BITS) - 1;
    let masks: [__m512i; 4] = std::array::from_fn(|s| _mm512_set1_epi32(m << (s * BITS as usize)));
    for blk in (c0 / cpb..c1 / cpb).step_by(2) {
        let mut acc = [[_mm512_setzero_ps(); H]; 4];
        for t in 0..n {
            pf.one();
            // SAFETY: blk + 1 < d / cpb and t < n: 16 bytes inside token t's codes.
            let raw = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(cp.add(t * cb + blk * 8).cast())) };
            let mut x = [_mm512_setzero_ps(); 4];
            for s in 0..shifts {
                x[s] = _mm512_cvtepi32_ps(_mm512_and_si512(raw, masks[s]));
            }
            #[allow(clippy::needless_range_loop)]
            for hh in 0..H {
                // SAFETY: (h0 + H - 1) * CHUNK + n <= w.len() (asserted), t < n.
                let wv = _mm512_set1_ps(unsafe { *wp.add((h0 + hh) * CHUNK + t) });
                for s in 0..shifts {
                    acc[s][hh] = _mm512_fmadd_ps(wv, x[s], acc[s][hh]);
                }
            }
        }
        for (s, acc) in acc.iter().enumerate().take(shifts) {
            let u = pow2(-((s * BITS as usize) as i32));
            for (hh, &a) in acc.iter().enumerate() {
                let v = _mm512_mul_ps(a, u);
                let (lo, hi) =
                    (_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))));
                // SAFETY: channels blk * cpb + s * 8 .. + 8 and (blk + 1) * cpb + s * 8 .. + 8
                // are below c1 <= d, and h0 + hh < h0 + H: inside `o` (asserted).
                unsafe {
                    let p = op.add((h0 + hh) * d + blk * cpb + s * 8);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), lo));
                    let p = p.add(cpb);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), hi));
                }
            }
        }
    }
    pf.rest();
}

/// The lines of a slice (part of the next page) prefetched into L2 one at a time over a
/// kernel's loop, so that they do not wait for free miss buffers all at once.
struct SpreadPrefetch<I> {
    /// An address in each line left to prefetch.
    lines: I,
}

impl SpreadPrefetch<()> {
    /// Every line `bytes` touches (`avx2::lines`).
    fn new(bytes: &[u8]) -> SpreadPrefetch<impl Iterator<Item = *const u8>> {
        SpreadPrefetch { lines: lines(bytes) }
    }
}

impl<I: Iterator<Item = *const u8>> SpreadPrefetch<I> {
    /// The next line, if any is left.
    #[inline(always)]
    fn one(&mut self) {
        if let Some(line) = self.lines.next() {
            // SAFETY: a prefetch is a hint and does not fault.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.cast()) };
        }
    }

    /// Every line left.
    #[inline(always)]
    fn rest(&mut self) {
        for line in self.lines.by_ref() {
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.cast()) };
        }
    }
}

/// Key scores of heads `[h0, h0 + H)` over dwords `[w0, w1)`, tokens `[0, 16 TS)` in
/// lanes (`n <= 16 TS`; whole 16-token vectors are written, lanes past `n` hold the
/// scores of the zero codes `transpose_codes` pads with). Lane for lane the AVX2
/// `dots_codes_t`'s chain.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn dots_codes_t<const H: usize, const BITS: u32, const TS: usize>(
    qt: &[f32],
    h0: usize,
    d: usize,
    codes_t: &[u32],
    n: usize,
    w0: usize,
    w1: usize,
    out: &mut [f32],
    c: Combine<'_>,
    pf: &[u8],
) {
    let per_byte = 8 / BITS as usize;
    // One line of `pf` per code position (the rest after the pass).
    let mut pf = SpreadPrefetch::new(pf);
    let per_word = 4 * per_byte;
    assert!((h0 + H) * d <= qt.len() && w0 <= w1 && w1 * per_word <= d && n <= 16 * TS && 16 * TS <= CHUNK);
    assert!(codes_t.len() >= w1 * CODES_T_COLS && (h0 + H - 1) * CHUNK + 16 * TS <= out.len());
    assert!(c.scales.len() >= 16 * TS && c.zeros.len() >= 16 * TS && c.qsum.len() >= (h0 + H) * c.groups);
    let (qp, cp) = (qt.as_ptr(), codes_t.as_ptr());
    let m = (1i32 << BITS) - 1;
    // Slot k = b * per_byte + s of a word masks bits p(b, s) of the (for b = 3, shifted)
    // word.
    let masks: [i32; 16] = std::array::from_fn(|k| {
        let (b, s) = (k / per_byte, k % per_byte);
        let p = if b < 3 { 8 * b + s * BITS as usize } else { s * BITS as usize };
        if k < per_word { m << p } else { 0 }
    });
    let mut acc = [[_mm512_setzero_ps(); H]; TS];
    for w in w0..w1 {
        // The masks are broadcast from memory as operands, as in the AVX2 kernel.
        let mp = std::hint::black_box(masks.as_ptr());
        let mut raw = [_mm512_setzero_si512(); TS];
        for (i, r) in raw.iter_mut().enumerate() {
            // SAFETY: w < w1 and 16 TS <= CHUNK < CODES_T_COLS: inside `codes_t` (asserted).
            *r = unsafe { _mm512_loadu_si512(cp.add(w * CODES_T_COLS + 16 * i).cast()) };
        }
        for b in 0..4 {
            if b == 3 {
                for r in raw.iter_mut() {
                    *r = _mm512_srli_epi32::<24>(*r);
                }
            }
            for s in 0..per_byte {
                pf.one();
                // SAFETY: b * per_byte + s < per_word <= 16 entries of `masks`.
                let mask = _mm512_set1_epi32(unsafe { *mp.add(b * per_byte + s) });
                let c = w * per_word + b * per_byte + s;
                let mut qb = [_mm512_setzero_ps(); H];
                for (hh, q) in qb.iter_mut().enumerate() {
                    // SAFETY: c < w1 * per_word <= d and h0 + hh < h0 + H: inside `qt`.
                    *q = _mm512_set1_ps(unsafe { *qp.add((h0 + hh) * d + c) });
                }
                for (r, a) in raw.iter().zip(acc.iter_mut()) {
                    let x = _mm512_cvtepi32_ps(_mm512_and_si512(*r, mask));
                    for (a, q) in a.iter_mut().zip(&qb) {
                        *a = _mm512_fmadd_ps(*q, x, *a);
                    }
                }
            }
        }
    }
    pf.rest();
    for (i, a) in acc.iter().enumerate() {
        for (hh, &v) in a.iter().enumerate() {
            // SAFETY: (h0 + hh) * CHUNK + 16 i + 16 <= (h0 + H - 1) * CHUNK + 16 TS <=
            // out.len() (asserted); the scales and zeros hold 16 TS (asserted).
            unsafe {
                let p = out.as_mut_ptr().add((h0 + hh) * CHUNK + 16 * i);
                // `scales[t] * dot + zeros[t] * qsum`, added to the earlier groups'.
                let qs = _mm512_set1_ps(c.qsum[(h0 + hh) * c.groups + c.j]);
                let sc = _mm512_loadu_ps(c.scales.as_ptr().add(16 * i));
                let z = _mm512_loadu_ps(c.zeros.as_ptr().add(16 * i));
                let x = _mm512_add_ps(_mm512_mul_ps(sc, v), _mm512_mul_ps(z, qs));
                _mm512_storeu_ps(p, if c.j == 0 { x } else { _mm512_add_ps(_mm512_loadu_ps(p), x) })
            }
        }
    }
}

/// What [`Avx512::key_scores`] applies to a group's dot products before it stores them:
/// the group's scale and zero per token (`[CHUNK]`), the query sums `qsum[h][j]`
/// (`[g][groups]`), and the group `j` (0: the first, stored; else added).
#[derive(Clone, Copy)]
struct Combine<'a> {
    scales: &'a [f32],
    zeros: &'a [f32],
    qsum: &'a [f32],
    groups: usize,
    j: usize,
}

// The append's kernels: the one-pass staging of a new row and the codes of a group.

impl Avx512 {
    /// The AVX2 `stage_hadamard` (the fused append's one-pass staging of a new row of a
    /// Hadamard-rotated head with no channel permutation) in 512-bit registers, for rows
    /// of 64, 128 and 256 channels and groups of 32 channels and up: the same f32
    /// operations lane for lane (load, center and scale, the FWHT butterflies, the
    /// scale, rounding to f16), so the same stored row, and the same ranges; the squared
    /// norm in another order (it only picks the rows for the exact test). A row of 128 is
    /// 8 registers instead of 16, so it stays in registers with the constants beside it
    /// (the AVX2 pass spills a few). `None`, with nothing written, for other shapes.
    pub(crate) fn stage_hadamard<T: KvElement>(
        self,
        src: &[T],
        affine: KeyAffine<'_>,
        g: usize,
        dst: &mut [f16],
        ranges: &mut [(f32, f32)],
    ) -> Option<f32> {
        // SAFETY: an `Avx512` value exists only after AVX-512 F, AVX2, FMA and F16C were
        // detected.
        unsafe {
            match (src.len(), g) {
                (64, 32) => stage_hadamard::<T, 4, 2>(src, affine, dst, ranges),
                (64, 64) => stage_hadamard::<T, 4, 4>(src, affine, dst, ranges),
                (128, 32) => stage_hadamard::<T, 8, 2>(src, affine, dst, ranges),
                (128, 64) => stage_hadamard::<T, 8, 4>(src, affine, dst, ranges),
                (128, 128) => stage_hadamard::<T, 8, 8>(src, affine, dst, ranges),
                (256, 32) => stage_hadamard::<T, 16, 2>(src, affine, dst, ranges),
                (256, 64) => stage_hadamard::<T, 16, 4>(src, affine, dst, ranges),
                (256, 128) => stage_hadamard::<T, 16, 8>(src, affine, dst, ranges),
                (256, 256) => stage_hadamard::<T, 16, 16>(src, affine, dst, ranges),
                _ => None,
            }
        }
    }

    /// [`super::fwht`] of a row of 16 to 256 floats in 512-bit registers (the same bits:
    /// the butterflies of [`lanes::fwht_in_regs!`], then the scale); `false`, with nothing done,
    /// for other lengths.
    pub(crate) fn fwht(self, x: &mut [f32]) -> bool {
        let p = x.as_mut_ptr();
        // SAFETY: as in `stage_hadamard`; each arm's row is exactly `16 * R` floats of `x`.
        unsafe {
            match x.len() {
                16 => fwht_regs::<1>(p, 1.0 / 16f32.sqrt()),
                32 => fwht_regs::<2>(p, 1.0 / 32f32.sqrt()),
                64 => fwht_regs::<4>(p, 1.0 / 64f32.sqrt()),
                128 => fwht_regs::<8>(p, 1.0 / 128f32.sqrt()),
                256 => fwht_regs::<16>(p, 1.0 / 256f32.sqrt()),
                _ => return false,
            }
        }
        true
    }

    /// The AVX2 `group_codes`' bytes (the packed `bits`-bit codes of a group of f16
    /// values against its ascending thresholds `th`, a code being the count of
    /// thresholds at or below its value), 16 values per step: 2-bit codes from the three
    /// comparison masks (bit 1 is `v >= t1`; bit 0 the parity of the count, the XOR of
    /// the three masks, since the thresholds ascend and so do the masks' sets), spread
    /// into place by `pdep`; 4-bit codes by a binary search over the thresholds held in
    /// one register (four compares instead of fifteen), joined into nibbles by a
    /// multiply-add. `x.len()` a multiple of 32; `out` is `x.len() * bits / 8` bytes; the
    /// thresholds ascend (not strictly: equal ones are fine), as the quantizer makes them
    /// (out of order, the count and these codes would differ). `false`, with nothing
    /// written, for 2-bit codes without BMI2.
    pub(crate) fn group_codes(self, x: &[f16], th: &[f32], bits: u32, out: &mut [u8]) -> bool {
        let g = x.len();
        assert!(g.is_multiple_of(32) && (bits == 2 || bits == 4));
        assert!(out.len() == g * bits as usize / 8 && th.len() == (1 << bits) - 1);
        debug_assert!(th.windows(2).all(|w| w[0] <= w[1]), "thresholds out of order: {th:?}");
        // SAFETY: as in `stage_hadamard` (and BMI2 was detected for `group_codes2`); the
        // lengths are asserted.
        unsafe {
            if bits == 4 {
                group_codes4(x, th, out)
            } else if self.bmi2 {
                group_codes2(x, th, out)
            } else {
                return false;
            }
        }
        true
    }
}

/// See [`Avx512::stage_hadamard`]: [`lanes::stage_hadamard!`] at sixteen lanes, a row of
/// `16 * R` channels in `R` registers, groups of `16 * PER` channels.
///
/// # Safety
/// AVX-512 F, AVX2, FMA and F16C are present.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn stage_hadamard<T: KvElement, const R: usize, const PER: usize>(
    src: &[T],
    affine: KeyAffine<'_>,
    dst: &mut [f16],
    ranges: &mut [(f32, f32)],
) -> Option<f32> {
    // SAFETY: this function is compiled for AVX-512 F, AVX2, FMA and F16C.
    let l = unsafe { W512::assume() };
    lanes::stage_hadamard!(l: W512, T, R, PER, src, affine, dst, ranges)
}

/// The orthonormal FWHT of the `16 * R` floats at `p`, in registers
/// ([`lanes::fwht_regs!`] at sixteen lanes).
///
/// # Safety
/// `p` is valid for reads and writes of `16 * R` floats, and AVX-512 F is present.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn fwht_regs<const R: usize>(p: *mut f32, scale: f32) {
    // SAFETY: this function is compiled for AVX-512 F, AVX2, FMA and F16C.
    let l = unsafe { W512::assume() };
    // SAFETY (in the macro): `p` as the caller vouches.
    lanes::fwht_regs!(l: W512, R, p, Some(scale))
}

/// 2-bit codes of [`Avx512::group_codes`].
///
/// # Safety
/// AVX-512 F, F16C and BMI2 are present; `x.len()` is a multiple of 16 and `out` holds
/// `x.len() / 4` bytes; `th` holds 3 thresholds.
#[target_feature(enable = "avx512f,avx2,fma,f16c,bmi2")]
unsafe fn group_codes2(x: &[f16], th: &[f32], out: &mut [u8]) {
    let (t0, t1, t2) = (_mm512_set1_ps(th[0]), _mm512_set1_ps(th[1]), _mm512_set1_ps(th[2]));
    let (p, op) = (x.as_ptr(), out.as_mut_ptr());
    for b in 0..x.len() / 16 {
        // SAFETY: 16 * b + 16 <= x.len(), and 4 * b + 4 <= x.len() / 4 = out.len().
        unsafe {
            let v = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(16 * b).cast()));
            let m0 = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, t0);
            let m1 = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, t1);
            let m2 = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, t2);
            // Channel c's code in bits 2c and 2c + 1 of the little-endian word.
            let word = _pdep_u32((m0 ^ m1 ^ m2) as u32, 0x5555_5555) | _pdep_u32(m1 as u32, 0xAAAA_AAAA);
            op.add(4 * b).cast::<u32>().write_unaligned(word.to_le());
        }
    }
}

/// 4-bit codes of [`Avx512::group_codes`].
///
/// # Safety
/// AVX-512 F, AVX2 and F16C are present; `x.len()` is a multiple of 16 and `out` holds
/// `x.len() / 2` bytes; `th` holds 15 ascending thresholds.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn group_codes4(x: &[f16], th: &[f32], out: &mut [u8]) {
    let mut t = [f32::INFINITY; 16];
    t[..15].copy_from_slice(th);
    // SAFETY: 16 floats.
    let table = unsafe { _mm512_loadu_ps(t.as_ptr()) };
    let (p, op) = (x.as_ptr(), out.as_mut_ptr());
    let nibbles = _mm_set1_epi16(0x1001);
    for b in 0..x.len() / 16 {
        // SAFETY: 16 * b + 16 <= x.len().
        let v = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.add(16 * b).cast())) };
        // The count of thresholds at or below v, bit by bit from the top: `v >= t[c + step
        // - 1]` (ascending thresholds: the count is at least c + step) adds the step.
        let mut c = _mm512_setzero_si512();
        for step in [8, 4, 2, 1] {
            let t = _mm512_permutexvar_ps(_mm512_add_epi32(c, _mm512_set1_epi32(step - 1)), table);
            let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, t);
            c = _mm512_mask_add_epi32(c, m, c, _mm512_set1_epi32(step));
        }
        // Bytes, then channel 2i in the low nibble of byte i and 2i + 1 in the high one.
        let pairs = _mm_maddubs_epi16(_mm512_cvtepi32_epi8(c), nibbles);
        // SAFETY: 8 * b + 8 <= x.len() / 2 = out.len().
        unsafe { _mm_storel_epi64(op.add(8 * b).cast(), _mm_packus_epi16(pairs, pairs)) };
    }
}

impl Avx512 {
    /// The AVX2 `quantize_rows` (stored f16 rows with their groups' ranges into packed
    /// codes and `(scale, zero)` pairs, bit for bit the reference's) with eight groups'
    /// parameters per step in f64x8 registers, where the rounding modes of AVX-512 do in
    /// one instruction what AVX2 needs a few for: f64 to f16 by rounding to f32 toward
    /// zero with the last bit set where inexact (rounding to odd, then F16C to nearest:
    /// the same as rounding to nearest once), and the thresholds `z + (k + 1/2) s` rounded
    /// up to f32 directly. Then each group's codes right after, as
    /// [`Avx512::group_codes`] finds them. A group whose range ends at a zero takes the
    /// scalar `group_params` (which decides the zero's sign), a row with a threshold that
    /// is not finite the portable quantizer, as in the AVX2 pass. Every range must be
    /// ordered (`lo <= hi`, the group's min and max; out of order, the 4-bit search would
    /// meet descending thresholds). `false`, with nothing written, without BMI2 (the
    /// 2-bit codes' `pdep`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn quantize_rows(
        self,
        rows: &[f16],
        d: usize,
        bits: u32,
        g: usize,
        clip: u32,
        ranges: &[(f32, f32)],
        codes: &mut [u8],
        params: &mut [u8],
    ) -> bool {
        if !self.bmi2 {
            return false;
        }
        assert!(d <= 256 && g.is_multiple_of(32) && d.is_multiple_of(g) && (bits == 2 || bits == 4));
        // Out of order, the 4-bit search would meet descending thresholds.
        debug_assert!(ranges.iter().all(|&(lo, hi)| lo <= hi || lo.is_nan() || hi.is_nan()), "a range with lo > hi");
        let items = rows.len() / g;
        assert!(rows.len() == items * g && ranges.len() == items && codes.len() == items * g * bits as usize / 8);
        assert!(params.len() == 4 * items && rows.len().is_multiple_of(d));
        // SAFETY: AVX-512 F, AVX2, FMA, F16C (an `Avx512` value) and BMI2 (checked) are
        // present; the lengths are asserted.
        unsafe { quantize_rows(rows, d, bits, g, clip, ranges, codes, params) };
        true
    }
}

/// Eight f64 rounded to f16 bits as `f64_to_f16` rounds them (see
/// [`Avx512::quantize_rows`]).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn f64x8_to_f16(x: __m512d) -> __m128i {
    let r = _mm512_cvt_roundpd_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
    let inexact = _mm512_cmp_pd_mask::<_CMP_NEQ_UQ>(_mm512_cvtps_pd(r), x);
    let r = _mm512_castsi256_si512(_mm256_castps_si256(r));
    let odd = _mm512_mask_or_epi32(r, inexact as __mmask16, r, _mm512_set1_epi32(1));
    _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_castsi256_ps(_mm512_castsi512_si256(odd)))
}

/// Eight f64 rounded up to f32 (the least f32 at or above each), as
/// `super::threshold` rounds a threshold.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn f64x8_up_to_f32(t: __m512d) -> __m256 {
    _mm512_cvt_roundpd_ps::<{ _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC }>(t)
}

#[cfg(test)]
impl Avx512 {
    /// The quantizer's two roundings of eight f64, for the tests: to f16 bits (as
    /// `f64_to_f16`) and up to f32 (as a threshold).
    pub(crate) fn roundings(self, x: [f64; 8]) -> ([u16; 8], [f32; 8]) {
        let (mut h, mut up) = ([0u16; 8], [0f32; 8]);
        // SAFETY: an `Avx512` value exists only after AVX-512 F, AVX2, FMA and F16C were
        // detected; the stores write the arrays' 16 and 32 bytes.
        unsafe {
            let v = _mm512_loadu_pd(x.as_ptr());
            _mm_storeu_si128(h.as_mut_ptr().cast(), f64x8_to_f16(v));
            _mm256_storeu_ps(up.as_mut_ptr(), f64x8_up_to_f32(v));
        }
        (h, up)
    }
}

/// See [`Avx512::quantize_rows`].
///
/// # Safety
/// AVX-512 F, AVX2, FMA, F16C and BMI2 are present; `rows` holds whole rows of `d`, `g`
/// is a multiple of 32 dividing `d`, `ranges` one range per group, `codes` and `params`
/// their bytes.
#[target_feature(enable = "avx512f,avx2,fma,f16c,bmi2")]
#[allow(clippy::too_many_arguments)]
unsafe fn quantize_rows(
    rows: &[f16],
    d: usize,
    bits: u32,
    g: usize,
    clip: u32,
    ranges: &[(f32, f32)],
    codes: &mut [u8],
    params: &mut [u8],
) {
    let items = ranges.len();
    let levels = (1usize << bits) - 1;
    let gb = g * bits as usize / 8;
    // Rows with a threshold that is not finite (none for finite rows, see the AVX2 pass):
    // redone by the portable quantizer at the end.
    let mut portable: Vec<usize> = Vec::new();
    // The eight groups' ranges, lo in lanes 0-7 and hi in 8-15 after the permutation.
    let split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    let ratio = _mm512_set1_pd(clip as f64 / super::NO_CLIP as f64);
    let half = _mm512_set1_pd(0.5);
    let inf = _mm512_set1_pd(f64::INFINITY);
    for i0 in (0..items).step_by(8) {
        let m = 8.min(items - i0);
        let lanes = ((1u32 << m) - 1) as __mmask8;
        // A range's lo and hi as two f32, in that order, 8 bytes per item.
        const { assert!(size_of::<(f32, f32)>() == 8 && std::mem::offset_of!((f32, f32), 1) == 4) };
        // SAFETY: 2 * m floats of `ranges` from item i0 (pairs of f32).
        let pairs = unsafe {
            _mm512_maskz_loadu_ps(((1u32 << (2 * m)) - 1) as __mmask16, ranges.as_ptr().add(i0).cast::<f32>())
        };
        let pairs = _mm512_permutexvar_ps(split, pairs);
        let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(pairs));
        let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(pairs))));
        let zero_end = (_mm512_cmp_pd_mask::<_CMP_EQ_OQ>(lo, _mm512_setzero_pd())
            | _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(hi, _mm512_setzero_pd()))
            & lanes;
        // The operations of `clip_range`, in its order.
        let (lo, hi) = if clip >= super::NO_CLIP {
            (lo, hi)
        } else {
            let h = _mm512_mul_pd(_mm512_mul_pd(half, _mm512_sub_pd(hi, lo)), ratio);
            let mid = _mm512_mul_pd(half, _mm512_add_pd(lo, hi));
            (_mm512_sub_pd(mid, h), _mm512_add_pd(mid, h))
        };
        let scale = f64x8_to_f16(_mm512_div_pd(_mm512_sub_pd(hi, lo), _mm512_set1_pd(levels as f64)));
        let zero = f64x8_to_f16(lo);
        // Item i's (scale, zero) at params[4 i..4 i + 4].
        let pz = _mm256_set_m128i(_mm_unpackhi_epi16(scale, zero), _mm_unpacklo_epi16(scale, zero));
        // SAFETY: 4 * m bytes of `params` from byte 4 * i0.
        unsafe {
            _mm512_mask_storeu_epi32(
                params.as_mut_ptr().add(4 * i0).cast(),
                lanes as __mmask16,
                _mm512_castsi256_si512(pz),
            )
        };
        let (s, z) = (_mm512_cvtps_pd(_mm256_cvtph_ps(scale)), _mm512_cvtps_pd(_mm256_cvtph_ps(zero)));
        let constant = _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(s, _mm512_setzero_pd());
        let mut finite = lanes;
        // Thresholds by level, then group: `th[k][l]`.
        let mut th = [[0f32; 8]; 15];
        for (k, out) in th.iter_mut().enumerate().take(levels) {
            let t = _mm512_add_pd(z, _mm512_mul_pd(_mm512_set1_pd(k as f64 + 0.5), s));
            finite &= _mm512_cmp_pd_mask::<_CMP_LT_OQ>(_mm512_abs_pd(t), inf);
            let r = _mm512_mask_blend_ps(
                constant as __mmask16,
                _mm512_castps256_ps512(f64x8_up_to_f32(t)),
                _mm512_set1_ps(f32::INFINITY),
            );
            // SAFETY: eight f32.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps256(r)) };
        }
        // Not finite and not constant: the row goes to the portable quantizer.
        let nonfinite = lanes & !finite & !constant;
        // `l` indexes the lanes of the masks, of `th` and (from i0) the groups.
        #[allow(clippy::needless_range_loop)]
        for l in 0..m {
            let i = i0 + l;
            let x = &rows[i * g..(i + 1) * g];
            let mut t = [0f32; 15];
            if zero_end >> l & 1 == 1 {
                // A range that ends at a zero: the scalar path decides its sign.
                if !super::zero_end_params(x, ranges[i], bits, clip, &mut params[4 * i..4 * i + 4], &mut t) {
                    portable.push(i * g / d);
                }
            } else {
                if nonfinite >> l & 1 == 1 {
                    portable.push(i * g / d);
                }
                for (k, t) in t.iter_mut().enumerate().take(levels) {
                    *t = th[k][l];
                }
            }
            let out = &mut codes[i * gb..(i + 1) * gb];
            // SAFETY: the features are enabled; `x` is g values, `out` g * bits / 8 bytes,
            // g a multiple of 16; `t` has 15 thresholds.
            unsafe { if bits == 2 { group_codes2(x, &t, out) } else { group_codes4(x, &t[..15], out) } }
        }
    }
    let (cb, pb, groups) = (d * bits as usize / 8, 4 * (d / g), d / g);
    portable.dedup();
    for r in portable {
        let row = &rows[r * d..(r + 1) * d];
        super::quantize_row_portable(
            row,
            bits,
            g,
            clip,
            &ranges[r * groups..(r + 1) * groups],
            &mut codes[r * cb..(r + 1) * cb],
            &mut params[r * pb..(r + 1) * pb],
        );
    }
}

impl Avx512 {
    /// [`Avx512::stage_hadamard`] of a token's key row (with its `affine`) and value row
    /// in one pass, the two rows' loads and butterflies side by side (the same bits as
    /// two calls): two independent chains of dependent butterflies in one stretch of
    /// code, and no per-row dispatch of the fill loop between them (8-15% off append at
    /// head_dim 64 and 128; the 256-bit kernels' pair, two calls in a row, gains 8-19%
    /// from the dispatch alone). `None`, with nothing written, where `stage_hadamard` would
    /// decline or the rows' lengths differ; rows of 64 and 128 channels only (two rows of
    /// 256 would not fit in the 32 registers).
    pub(crate) fn stage_hadamard_pair<T: KvElement>(
        self,
        k: &[T],
        affine: KeyAffine<'_>,
        v: &[T],
        g: usize,
        (kdst, kranges): (&mut [f16], &mut [(f32, f32)]),
        (vdst, vranges): (&mut [f16], &mut [(f32, f32)]),
    ) -> Option<(f32, f32)> {
        if k.len() != v.len() || kdst.len() != k.len() || vdst.len() != v.len() {
            return None;
        }
        // SAFETY: an `Avx512` value exists only after AVX-512 F, AVX2, FMA and F16C were
        // detected; the lengths are checked here and in the callee.
        unsafe {
            match (k.len(), g) {
                (64, 32) => stage_pair::<T, 4, 2>(k, affine, v, kdst, kranges, vdst, vranges),
                (64, 64) => stage_pair::<T, 4, 4>(k, affine, v, kdst, kranges, vdst, vranges),
                (128, 32) => stage_pair::<T, 8, 2>(k, affine, v, kdst, kranges, vdst, vranges),
                (128, 64) => stage_pair::<T, 8, 4>(k, affine, v, kdst, kranges, vdst, vranges),
                (128, 128) => stage_pair::<T, 8, 8>(k, affine, v, kdst, kranges, vdst, vranges),
                _ => None,
            }
        }
    }
}

/// See [`Avx512::stage_hadamard_pair`].
///
/// # Safety
/// AVX-512 F, AVX2, FMA and F16C are present (the lengths are checked here).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn stage_pair<T: KvElement, const R: usize, const PER: usize>(
    k: &[T],
    affine: KeyAffine<'_>,
    v: &[T],
    kdst: &mut [f16],
    kranges: &mut [(f32, f32)],
    vdst: &mut [f16],
    vranges: &mut [(f32, f32)],
) -> Option<(f32, f32)> {
    let d = 16 * R;
    if !loadable::<T>() || k.len() != d || v.len() != d || kdst.len() != d || vdst.len() != d {
        return None;
    }
    let groups = R / PER;
    assert!(PER >= 2 && R.is_multiple_of(PER) && groups <= 8 && kranges.len() == groups && vranges.len() == groups);
    // SAFETY: this function is compiled for AVX-512 F, AVX2, FMA and F16C.
    let l = unsafe { W512::assume() };
    let (mut a, acc_a) = lanes::load_row!(l: W512, T, R, k, affine);
    let (mut b, acc_b) = lanes::load_row!(l: W512, T, R, v, KeyAffine::None);
    lanes::fwht_in_regs!(l: W512, &mut a, R);
    lanes::fwht_in_regs!(l: W512, &mut b, R);
    let nk = lanes::finish_row!(l: W512, R, PER, &a, acc_a, kdst, kranges);
    let nv = lanes::finish_row!(l: W512, R, PER, &b, acc_b, vdst, vranges);
    Some((nk, nv))
}
