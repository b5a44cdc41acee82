//! The AVX2 decode kernels: softmax weights, scores and value sums over f32 rows and
//! packed codes, and the integer key scores.

use super::*;

/// [`lanes::exp`] at eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn exp8(x: __m256) -> __m256 {
    // SAFETY: this function is compiled for AVX2, FMA and F16C.
    lanes::exp(unsafe { W256::assume() }, x)
}

/// [`super::super::Kernels::exp_sum`] with [`exp8`], eight weights at a time.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn exp_sum(s: &mut [f32], m: f32) -> f32 {
    let n8 = s.len() / 8 * 8;
    let (p, mv) = (s.as_mut_ptr(), _mm256_set1_ps(m));
    let mut acc = _mm256_setzero_ps();
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= n8 <= s.len().
        unsafe {
            let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
            _mm256_storeu_ps(p.add(i), y);
            acc = _mm256_add_ps(acc, y);
        }
    }
    let rest = s.len() - n8;
    if rest > 0 {
        let mut tail = [f32::NEG_INFINITY; 8];
        tail[..rest].copy_from_slice(&s[n8..]);
        // SAFETY: `tail` holds 8 floats.
        let y = exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(tail.as_ptr()) }, mv));
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(tail.as_mut_ptr(), y) };
        s[n8..].copy_from_slice(&tail[..rest]);
        acc = _mm256_add_ps(acc, y);
    }
    hsum(acc)
}

/// [`super::super::Kernels::exp_weights`] in one pass, eight tokens at a time: the weights
/// of [`exp_sum`] (the same bits, and the same sum), each times its scale, and the
/// zero sum by FMAs into eight lanes.
/// With `zmm`, the whole 16-token blocks go through [`Avx512::exp_weights16`] (the
/// same bits).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn exp_weights(
    zmm: Option<Avx512>,
    s: &[f32],
    m: f32,
    scales: &[f32],
    zeros: &[f32],
    w: &mut [f32],
) -> (f32, f32) {
    let n = s.len();
    assert!(scales.len() >= n && zeros.len() >= n && w.len() >= n);
    let n8 = n / 8 * 8;
    let (sp, scp, zp, wp, mv) = (s.as_ptr(), scales.as_ptr(), zeros.as_ptr(), w.as_mut_ptr(), _mm256_set1_ps(m));
    let (mut acc, mut zacc, done) = match zmm {
        Some(z) => z.exp_weights16(s, m, scales, zeros, w),
        None => (_mm256_setzero_ps(), _mm256_setzero_ps(), 0),
    };
    for i in (done..n8).step_by(8) {
        // SAFETY: i + 8 <= n8 <= n, and every slice holds n or more (asserted).
        unsafe {
            let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(i)), mv));
            acc = _mm256_add_ps(acc, y);
            _mm256_storeu_ps(wp.add(i), _mm256_mul_ps(y, _mm256_loadu_ps(scp.add(i))));
            zacc = _mm256_fmadd_ps(y, _mm256_loadu_ps(zp.add(i)), zacc);
        }
    }
    let rest = n - n8;
    if rest > 0 {
        let (mut ts, mut tsc, mut tz, mut tw) = ([f32::NEG_INFINITY; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
        ts[..rest].copy_from_slice(&s[n8..]);
        tsc[..rest].copy_from_slice(&scales[n8..n]);
        tz[..rest].copy_from_slice(&zeros[n8..n]);
        // SAFETY: the four arrays hold 8 floats each.
        unsafe {
            let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(ts.as_ptr()), mv));
            acc = _mm256_add_ps(acc, y);
            _mm256_storeu_ps(tw.as_mut_ptr(), _mm256_mul_ps(y, _mm256_loadu_ps(tsc.as_ptr())));
            zacc = _mm256_fmadd_ps(y, _mm256_loadu_ps(tz.as_ptr()), zacc);
        }
        w[n8..n].copy_from_slice(&tw[..rest]);
    }
    (hsum(acc), hsum(zacc))
}

/// Scores of heads `[h0, h0 + H)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn dots_block<const H: usize>(
    q: &[f32],
    h0: usize,
    d: usize,
    rows: &[f32],
    n: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    assert!((h0 + H) * d <= q.len() && n * d <= rows.len() && c1 <= d && c0 <= c1 && (c1 - c0).is_multiple_of(8));
    assert!((h0 + H - 1) * CHUNK + n <= out.len());
    let (qp, rp) = (q.as_ptr(), rows.as_ptr());
    let mut t = 0;
    while t < n {
        let two = t + 1 < n;
        let r1 = if two { t + 1 } else { t };
        let mut a0 = [_mm256_setzero_ps(); H];
        let mut a1 = [_mm256_setzero_ps(); H];
        let mut c = c0;
        while c < c1 {
            // SAFETY: rows t and r1 are < n and c + 8 <= c1 <= d, so both 8-float
            // loads are inside `rows` (asserted above); likewise the query loads.
            unsafe {
                let x0 = _mm256_loadu_ps(rp.add(t * d + c));
                let x1 = _mm256_loadu_ps(rp.add(r1 * d + c));
                for hh in 0..H {
                    let qv = _mm256_loadu_ps(qp.add((h0 + hh) * d + c));
                    a0[hh] = _mm256_fmadd_ps(qv, x0, a0[hh]);
                    a1[hh] = _mm256_fmadd_ps(qv, x1, a1[hh]);
                }
            }
            c += 8;
        }
        for hh in 0..H {
            out[(h0 + hh) * CHUNK + t] = hsum(a0[hh]);
            if two {
                out[(h0 + hh) * CHUNK + t + 1] = hsum(a1[hh]);
            }
        }
        t += 2;
    }
}

/// Value accumulation of heads `[h0, h0 + H)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn accumulate_block<const H: usize>(
    o: &mut [f32],
    w: &[f32],
    h0: usize,
    d: usize,
    rows: &[f32],
    n: usize,
    c0: usize,
    c1: usize,
) {
    assert!((h0 + H) * d <= o.len() && n * d <= rows.len() && c1 <= d && c0 <= c1 && (c1 - c0).is_multiple_of(16));
    assert!(n == 0 || (h0 + H - 1) * CHUNK + n <= w.len());
    let (op, rp) = (o.as_mut_ptr(), rows.as_ptr());
    let mut c = c0;
    while c < c1 {
        let mut a0 = [_mm256_setzero_ps(); H];
        let mut a1 = [_mm256_setzero_ps(); H];
        for t in 0..n {
            // SAFETY: t < n and c + 16 <= c1 <= d: both loads are inside `rows`.
            let (x0, x1) = unsafe { (_mm256_loadu_ps(rp.add(t * d + c)), _mm256_loadu_ps(rp.add(t * d + c + 8))) };
            for hh in 0..H {
                let wv = _mm256_set1_ps(w[(h0 + hh) * CHUNK + t]);
                a0[hh] = _mm256_fmadd_ps(wv, x0, a0[hh]);
                a1[hh] = _mm256_fmadd_ps(wv, x1, a1[hh]);
            }
        }
        for hh in 0..H {
            // SAFETY: (h0 + hh) * d + c + 16 <= (h0 + H) * d <= o.len() (asserted).
            unsafe {
                let p = op.add((h0 + hh) * d + c);
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), a0[hh]));
                _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), a1[hh]));
            }
        }
        c += 16;
    }
}

/// Transposes a chunk's key codes, `n <= CHUNK` rows of `cb` bytes (a multiple of
/// 16), into `out[w][t]`: dword `w` of token `t`'s row, zero for `n <= t <
/// CODES_T_COLS`. Four rows at a time, 4 x 4 dword transposes in SSE registers.
pub(crate) fn transpose_codes(_proof: Avx2, codes: &[u8], cb: usize, n: usize, out: &mut [u32]) {
    assert!(cb.is_multiple_of(16) && n <= CHUNK && n * cb <= codes.len());
    let words = cb / 4;
    assert!(out.len() >= words * CODES_T_COLS);
    let (cp, op) = (codes.as_ptr(), out.as_mut_ptr());
    let mut t = 0;
    while t < n {
        for blk in 0..cb / 16 {
            // SAFETY: row t + i < n (or a zero row), bytes blk * 16 .. + 16 <= cb: inside
            // `codes` (asserted); the stores go to words 4 blk .. + 4 < words, columns
            // t .. t + 4 <= CHUNK < CODES_T_COLS: inside `out` (asserted).
            unsafe {
                let row = |i: usize| {
                    if t + i < n {
                        _mm_loadu_si128(cp.add((t + i) * cb + blk * 16).cast())
                    } else {
                        _mm_setzero_si128()
                    }
                };
                let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
                let (l01, h01) = (_mm_unpacklo_epi32(r0, r1), _mm_unpackhi_epi32(r0, r1));
                let (l23, h23) = (_mm_unpacklo_epi32(r2, r3), _mm_unpackhi_epi32(r2, r3));
                let w = op.add(blk * 4 * CODES_T_COLS + t);
                _mm_storeu_si128(w.cast(), _mm_unpacklo_epi64(l01, l23));
                _mm_storeu_si128(w.add(CODES_T_COLS).cast(), _mm_unpackhi_epi64(l01, l23));
                _mm_storeu_si128(w.add(2 * CODES_T_COLS).cast(), _mm_unpacklo_epi64(h01, h23));
                _mm_storeu_si128(w.add(3 * CODES_T_COLS).cast(), _mm_unpackhi_epi64(h01, h23));
            }
        }
        t += 4;
    }
    for w in 0..words {
        out[w * CODES_T_COLS + t..(w + 1) * CODES_T_COLS].fill(0);
    }
}

/// Key scores of heads `[h0, h0 + H)` over the dwords `[w0, w1)` of the key code
/// rows (one quantization group), tokens in lanes: `out[h][t] = sum_c qt[h][c] *
/// (code[t][c] << p_c)`, where `codes_t` is [`transpose_codes`]' output and `qt` the
/// query rows in stored channel order, each channel scaled by `2^-p_c` (see
/// [`super::super::code_shift`]), so a code is isolated by one mask and no shift (the
/// product is exact either way, hence the sum's bits are those of unshifted codes).
/// `TS` sets of 8 tokens share each broadcast query value; `TS * H` accumulator
/// chains hide the FMA latency. Scores tokens `[t_begin, n)` (`t_begin` a multiple of
/// 8), writing whole 8-token vectors (lanes past `n` hold garbage).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn dots_codes_t<const H: usize, const BITS: u32, const TS: usize>(
    qt: &[f32],
    h0: usize,
    d: usize,
    codes_t: &[u32],
    t_begin: usize,
    n: usize,
    w0: usize,
    w1: usize,
    out: &mut [f32],
) {
    let per_byte = 8 / BITS as usize;
    let per_word = 4 * per_byte;
    assert!((h0 + H) * d <= qt.len() && w0 <= w1 && w1 * per_word <= d && n <= CHUNK);
    assert!(codes_t.len() >= w1 * CODES_T_COLS && (h0 + H - 1) * CHUNK + n <= out.len());
    let sets = n.saturating_sub(t_begin).div_ceil(8 * TS);
    assert!(t_begin.is_multiple_of(8) && t_begin + sets * 8 * TS <= CODES_T_COLS);
    let (qp, cp) = (qt.as_ptr(), codes_t.as_ptr());
    let m = (1i32 << BITS) - 1;
    // Slot k = b * per_byte + s of a word masks bits p(b, s) of the (for b = 3,
    // shifted) word.
    let masks: [[i32; 8]; 16] = std::array::from_fn(|k| {
        let (b, s) = (k / per_byte, k % per_byte);
        let p = if b < 3 { 8 * b + s * BITS as usize } else { s * BITS as usize };
        [if k < per_word { m << p } else { 0 }; 8]
    });
    let mut t0 = t_begin;
    while t0 < n {
        let mut acc = [[_mm256_setzero_ps(); H]; TS];
        for w in w0..w1 {
            // The masks are read from memory as operands: held in registers (16 of
            // them), they pushed the accumulators to the stack.
            let mp = std::hint::black_box(masks.as_ptr());
            let mut raw = [_mm256_setzero_si256(); TS];
            // SAFETY: w < w1 and t0 + 8 TS <= CODES_T_COLS (asserted): inside `codes_t`.
            unrolled::<TS>(|i| raw[i] = unsafe { _mm256_loadu_si256(cp.add(w * CODES_T_COLS + t0 + 8 * i).cast()) });
            unrolled::<4>(|b| {
                if b == 3 {
                    unrolled::<TS>(|i| raw[i] = _mm256_srli_epi32::<24>(raw[i]));
                }
                for s in 0..per_byte {
                    // SAFETY: b * per_byte + s < per_word <= 16 entries of `masks`.
                    let mask = unsafe { _mm256_loadu_si256(mp.add(b * per_byte + s).cast()) };
                    let c = w * per_word + b * per_byte + s;
                    let mut qb = [_mm256_setzero_ps(); H];
                    // SAFETY: c < w1 * per_word <= d and h0 + hh < h0 + H: inside `qt`.
                    unrolled::<H>(|hh| qb[hh] = unsafe { _mm256_broadcast_ss(&*qp.add((h0 + hh) * d + c)) });
                    unrolled::<TS>(|i| {
                        let x = _mm256_cvtepi32_ps(_mm256_and_si256(raw[i], mask));
                        unrolled::<H>(|hh| acc[i][hh] = _mm256_fmadd_ps(qb[hh], x, acc[i][hh]));
                    });
                }
            });
        }
        for (i, a) in acc.iter().enumerate() {
            let t = t0 + 8 * i;
            if t < n {
                for (hh, &v) in a.iter().enumerate() {
                    let at = (h0 + hh) * CHUNK + t;
                    // t < n <= CHUNK and both multiples of 8: t + 8 <= CHUNK, inside
                    // head h0 + hh's row of `out`.
                    assert!(at + 8 <= out.len());
                    // SAFETY: at + 8 <= out.len() (asserted just above).
                    unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at), v) };
                }
            }
        }
        t0 += 8 * TS;
    }
}

/// [`dots_codes_t`] for `g` heads in blocks of up to 4: as many sets of 8 tokens per
/// pass as keep 8 or more accumulator chains in 16 registers (2, 3, 4 and 6 sets for
/// 4, 3, 2 and 1 heads), and the tokens past the last whole pass in passes of 2 sets
/// (a chunk of 64 tokens with 3 heads: 48 + 16 lanes, not 72).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dots_codes_t_heads(
    _proof: Avx2,
    qt: &[f32],
    g: usize,
    d: usize,
    codes_t: &[u32],
    bits: u32,
    n: usize,
    w0: usize,
    w1: usize,
    out: &mut [f32],
) {
    let mut h0 = 0;
    while h0 < g {
        let hn = (g - h0).min(4);
        macro_rules! sets {
            ($h:literal, $b:literal, $ts:literal) => {{
                let main = n / (8 * $ts) * (8 * $ts);
                // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were
                // detected.
                unsafe {
                    dots_codes_t::<$h, $b, $ts>(qt, h0, d, codes_t, 0, main, w0, w1, out);
                    dots_codes_t::<$h, $b, 2>(qt, h0, d, codes_t, main, n, w0, w1, out);
                }
            }};
        }
        match (bits, hn) {
            (2, 4) => sets!(4, 2, 2),
            (2, 3) => sets!(3, 2, 3),
            (2, 2) => sets!(2, 2, 4),
            (2, _) => sets!(1, 2, 6),
            (_, 4) => sets!(4, 4, 2),
            (_, 3) => sets!(3, 4, 3),
            (_, 2) => sets!(2, 4, 4),
            _ => sets!(1, 4, 6),
        }
        h0 += hn;
    }
}

/// `2^e` in every lane (`-126 <= e <= 127`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn pow2(e: i32) -> __m256 {
    // SAFETY: this function is compiled for AVX2, FMA and F16C.
    lanes::pow2(unsafe { W256::assume() }, e)
}

/// Value accumulation of heads `[h0, h0 + H)` straight from packed codes.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn accumulate_codes_block<const H: usize, const BITS: u32>(
    o: &mut [f32],
    w: &[f32],
    h0: usize,
    d: usize,
    codes: &[u8],
    n: usize,
    c0: usize,
    c1: usize,
) {
    let cb = d * BITS as usize / 8;
    let cpb = 64 / BITS as usize;
    let shifts = 8 / BITS as i32;
    assert!((h0 + H) * d <= o.len() && n * cb <= codes.len() && c1 <= d && c0 <= c1);
    assert!(c0.is_multiple_of(cpb) && c1.is_multiple_of(cpb) && (n == 0 || (h0 + H - 1) * CHUNK + n <= w.len()));
    let (op, cp) = (o.as_mut_ptr(), codes.as_ptr());
    let m = (1i32 << BITS) - 1;
    for blk in c0 / cpb..c1 / cpb {
        for sp in (0..shifts).step_by(2) {
            // Code `s` of each byte is masked in place, so the sums are `2^(s BITS)`
            // times the codes' and are scaled back (exactly: a power of two) at the end;
            // the bits are those of shifted codes, one instruction fewer per 8 codes.
            let (p0, p1) = (sp * BITS as i32, (sp + 1) * BITS as i32);
            let (mask0, mask1) = (_mm256_set1_epi32(m << p0), _mm256_set1_epi32(m << p1));
            let mut a0 = [_mm256_setzero_ps(); H];
            let mut a1 = [_mm256_setzero_ps(); H];
            for t in 0..n {
                // SAFETY: blk < d / cpb and t < n: 8 bytes inside token t's codes.
                let raw = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp.add(t * cb + blk * 8).cast())) };
                let x0 = _mm256_cvtepi32_ps(_mm256_and_si256(raw, mask0));
                let x1 = _mm256_cvtepi32_ps(_mm256_and_si256(raw, mask1));
                for hh in 0..H {
                    // SAFETY: (h0 + H - 1) * CHUNK + n <= w.len() (asserted), t < n.
                    // (Indexed, the bounds checks were a third of the loop's instructions.)
                    let wv = _mm256_set1_ps(unsafe { *w.get_unchecked((h0 + hh) * CHUNK + t) });
                    a0[hh] = _mm256_fmadd_ps(wv, x0, a0[hh]);
                    a1[hh] = _mm256_fmadd_ps(wv, x1, a1[hh]);
                }
            }
            let (u0, u1) = (pow2(-p0), pow2(-p1));
            let c = blk * cpb + sp as usize * 8;
            for hh in 0..H {
                // SAFETY: c + 16 <= d and h0 + hh < h0 + H: inside `o` (asserted).
                unsafe {
                    let p = op.add((h0 + hh) * d + c);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(a0[hh], u0)));
                    _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), _mm256_mul_ps(a1[hh], u1)));
                }
            }
        }
    }
}

/// `_mm256_broadcast_ss(*p)` as an instruction LLVM may not merge with an equal one:
/// merged, the broadcast values stay in registers and the accumulators that need
/// them go to the stack; loaded again, each costs a load-port slot only.
///
/// # Safety
/// `p` is valid for reading an `f32`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn broadcast_again(p: *const f32) -> __m256 {
    let y: __m256;
    // SAFETY: reads 4 bytes at `p` (the caller's contract), no stack, no flags.
    unsafe {
        std::arch::asm!(
            "vbroadcastss {y}, dword ptr [{p}]",
            p = in(reg) p,
            y = lateout(ymm_reg) y,
            options(readonly, nostack, preserves_flags)
        )
    };
    y
}

/// [`accumulate_codes_block`] for 1 or 2 heads: passes of 32 channels (four slices
/// of 8: one 8-byte block of 2-bit codes, two of 4-bit codes) so that `4 H`
/// accumulator chains hide the FMA latency (two slices give 2 or 4 chains:
/// latency-bound). Each slice broadcasts its weights again ([`broadcast_again`])
/// rather than keep them in registers. Measured hot in L1 (2026-12-03, Zen 4, head_dim
/// 128, 2-bit): 1.45x the FMA floor for 2 heads against 1.80x, 2.0x for one against
/// 3.2x; for 3 heads (12 chains) it was no faster than the two-slice kernel (1.36x
/// against 1.35x: its 12 broadcasts per token fill the load ports), so 3 and 4 heads
/// keep that one. Channels `[c0, c1)` are whole passes.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn accumulate_codes_wide<const H: usize, const BITS: u32>(
    o: &mut [f32],
    w: &[f32],
    h0: usize,
    d: usize,
    codes: &[u8],
    n: usize,
    c0: usize,
    c1: usize,
) {
    let cb = d * BITS as usize / 8;
    let shifts = 8 / BITS as usize;
    assert!((h0 + H) * d <= o.len() && n * cb <= codes.len() && c1 <= d && c0 <= c1);
    assert!(c0.is_multiple_of(32) && c1.is_multiple_of(32) && (n == 0 || (h0 + H - 1) * CHUNK + n <= w.len()));
    let (op, cp, wp) = (o.as_mut_ptr(), codes.as_ptr(), w.as_ptr());
    let m = (1i32 << BITS) - 1;
    for pass in c0 / 32..c1 / 32 {
        let mut acc = [[_mm256_setzero_ps(); H]; 4];
        for t in 0..n {
            // SAFETY: the pass's 32 channels are 4 BITS bytes at pass * 4 BITS < cb, of
            // token t < n: inside `codes` (asserted).
            let (ra, rb) = unsafe {
                let at = cp.add(t * cb + pass * 4 * BITS as usize);
                let ra = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at.cast()));
                (ra, if BITS == 4 { _mm256_cvtepu8_epi32(_mm_loadl_epi64(at.add(8).cast())) } else { ra })
            };
            unrolled::<4>(|k| {
                let (raw, s) = if k < shifts { (ra, k) } else { (rb, k - shifts) };
                // The top code of a byte needs no mask (nor a mask register).
                let code = if s + 1 == shifts {
                    _mm256_srl_epi32(raw, _mm_cvtsi32_si128(8 - BITS as i32))
                } else {
                    _mm256_and_si256(raw, _mm256_set1_epi32(m << (s as u32 * BITS)))
                };
                let x = _mm256_cvtepi32_ps(code);
                unrolled::<H>(|hh| {
                    // SAFETY: (h0 + H - 1) * CHUNK + n <= w.len() (asserted), t < n.
                    let wv = unsafe { broadcast_again(wp.add((h0 + hh) * CHUNK + t)) };
                    acc[k][hh] = _mm256_fmadd_ps(wv, x, acc[k][hh]);
                });
            });
        }
        // Slice k holds channels pass * 32 + 8 k .. + 8 (unpack order), its codes
        // masked in place at bit s BITS (but the top one): scaled back by
        // 2^-(s BITS), exactly.
        for (k, a) in acc.iter().enumerate() {
            let s = k % shifts;
            let u = pow2(if s + 1 == shifts { 0 } else { -(s as i32 * BITS as i32) });
            for (hh, &v) in a.iter().enumerate() {
                // SAFETY: pass * 32 + 8 k + 8 <= c1 <= d, h0 + hh < h0 + H: inside `o`.
                unsafe {
                    let p = op.add((h0 + hh) * d + pass * 32 + 8 * k);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(v, u)));
                }
            }
        }
    }
}

/// Sum of the eight i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0x4E>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0xB1>(s));
    _mm_cvtsi128_si32(s)
}

/// `len` (8, 16 or at least 32) code bytes at `p` in a 256-bit register, zeros past
/// `len`.
///
/// # Safety
/// `p` is valid for reads of `min(len, 32)` bytes; AVX2 is present.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn load_codes(p: *const u8, len: usize) -> __m256i {
    // SAFETY: each arm reads exactly the bytes the caller vouches for.
    unsafe {
        if len >= 32 {
            _mm256_loadu_si256(p.cast())
        } else if len >= 16 {
            _mm256_zextsi128_si256(_mm_loadu_si128(p.cast()))
        } else {
            _mm256_zextsi128_si256(_mm_loadl_epi64(p.cast()))
        }
    }
}

/// Defines an integer key-score kernel for heads `[h0, h0 + H)` and group `j` (see
/// [`Kernels::dots_int`]): `$mac` adds the products of 32 unsigned code bytes `u`
/// and 32 signed query bytes `q` into the accumulator `a`, `$widen` turns the two
/// accumulators into i32 lanes (with the `hi` term of two weighted by 254). One term:
/// two tokens at a time; two terms: one token, its `hi` and `lo` sums side by side.
macro_rules! dots_int_kernel {
    (
        $(#[$doc:meta])* $name:ident, $features:literal,
        |$a:ident, $u:ident, $q:ident| $mac:expr,
        |$a0:ident, $a1:ident, $two:ident| $widen:expr
    ) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $name<const H: usize, const BITS: u32>(
            q: &IntQuery,
            h0: usize,
            j: usize,
            codes: &[u8],
            cb: usize,
            n: usize,
            out: &mut [f32],
        ) {
            let pb = 8 / BITS as usize;
            let gb = q.group_bytes;
            let two_terms = q.terms == 2;
            assert!(
                q.per_byte == pb && (j + 1) * gb <= cb && n * cb <= codes.len() && (gb == 8 || gb.is_multiple_of(16))
            );
            assert!(q.chunks * pb <= 8 && (h0 + H - 1) * CHUNK + n <= out.len());
            let per_term = q.chunks * pb * 32;
            let qg: [&[i8]; H] = std::array::from_fn(|hh| q.group(h0 + hh, j));
            assert!(qg.iter().all(|x| x.len() == q.terms * per_term));
            let cp = codes.as_ptr();
            let mask = _mm256_set1_epi8(((1u32 << BITS) - 1) as i8);
            let mut t = 0;
            while t < n {
                // Second accumulator: the next token (one term) or this token's `lo` term.
                let second = two_terms || t + 1 < n;
                let r1 = if two_terms || t + 1 >= n { t } else { t + 1 };
                let mut a0 = [_mm256_setzero_si256(); H];
                let mut a1 = [_mm256_setzero_si256(); H];
                for k in 0..q.chunks {
                    let len = gb - 32 * k;
                    // SAFETY: the group's bytes [j * gb, (j + 1) * gb) lie in each token's
                    // cb bytes (asserted), and load_codes reads at most the len left of them.
                    let (raw0, raw1) = unsafe {
                        (
                            load_codes(cp.add(t * cb + j * gb + 32 * k), len),
                            load_codes(cp.add(r1 * cb + j * gb + 32 * k), len),
                        )
                    };
                    for s in 0..pb {
                        let cnt = _mm_cvtsi32_si128((s as u32 * BITS) as i32);
                        let u0 = _mm256_and_si256(_mm256_srl_epi16(raw0, cnt), mask);
                        let u1 = _mm256_and_si256(_mm256_srl_epi16(raw1, cnt), mask);
                        let at = (k * pb + s) * 32;
                        for hh in 0..H {
                            // SAFETY: 32 bytes at `at` (and at `per_term + at` with two
                            // terms) are inside the group's query (length asserted).
                            let qv = unsafe { _mm256_loadu_si256(qg[hh].as_ptr().add(at).cast()) };
                            a0[hh] = {
                                let ($a, $u, $q) = (a0[hh], u0, qv);
                                $mac
                            };
                            if two_terms {
                                // SAFETY: as above.
                                let lo = unsafe { _mm256_loadu_si256(qg[hh].as_ptr().add(per_term + at).cast()) };
                                a1[hh] = {
                                    let ($a, $u, $q) = (a1[hh], u0, lo);
                                    $mac
                                };
                            } else {
                                a1[hh] = {
                                    let ($a, $u, $q) = (a1[hh], u1, qv);
                                    $mac
                                };
                            }
                        }
                    }
                }
                for hh in 0..H {
                    let a = q.scale[(h0 + hh) * q.groups + j];
                    let ($a0, $a1, $two) = (a0[hh], a1[hh], two_terms);
                    let (x0, x1): (__m256i, __m256i) = $widen;
                    if two_terms {
                        out[(h0 + hh) * CHUNK + t] = hsum_epi32(_mm256_add_epi32(x0, x1)) as f32 * a;
                    } else {
                        out[(h0 + hh) * CHUNK + t] = hsum_epi32(x0) as f32 * a;
                        if second {
                            out[(h0 + hh) * CHUNK + t + 1] = hsum_epi32(x1) as f32 * a;
                        }
                    }
                }
                t += if two_terms { 1 } else { 2 };
            }
        }
    };
}

dots_int_kernel!(
    /// Integer key scores with `vpmaddubsw` of unsigned codes and signed query bytes,
    /// summed in i16 over the group's shifts and chunks (at most 8 terms of at most
    /// 2 * 15 * 127 = 3810, below 2^15), then `vpmaddwd` to i32 (by 254 for the `hi`
    /// term of two, by 1 else) and a horizontal sum.
    dots_int_block, "avx2,fma,f16c",
    |a, u, q| _mm256_add_epi16(a, _mm256_maddubs_epi16(u, q)),
    |a0, a1, two| (
        _mm256_madd_epi16(a0, _mm256_set1_epi16(if two { super::super::LO_STEPS as i16 } else { 1 })),
        _mm256_madd_epi16(a1, _mm256_set1_epi16(1))
    )
);

dots_int_kernel!(
    /// [`dots_int_block`] with `vpdpbusd`: each 32-byte product of unsigned codes and
    /// signed query bytes is summed four bytes at a time straight into i32 lanes (no
    /// i16 partial sums, no `vpmaddwd`), the `hi` term of two then weighted by 254 in
    /// i32. The integer sums are exact either way (at most 256 * 15 * 127 * 255 <
    /// 2^31), so the scores are the same bits.
    dots_int_block_vnni, "avx2,fma,f16c,avx512f,avx512vnni,avx512vl",
    |a, u, q| _mm256_dpbusd_epi32(a, u, q),
    |a0, a1, two| (if two { _mm256_mullo_epi32(a0, _mm256_set1_epi32(super::super::LO_STEPS)) } else { a0 }, a1)
);
