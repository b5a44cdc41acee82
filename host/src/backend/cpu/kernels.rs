//! The micro-kernel interface ([`Kernels`]) with its portable implementation, the code
//! unpacking helpers and the integer query of the int key scores.

use super::*;

/// Position of channel `c` in a row unpacked by [`unpack`] ("unpack order"): within
/// each block of 8 code bytes (`8 * 8 / bits` channels), channel `c` sits at
/// `(c % per_byte) * 8 + (c / per_byte) % 8`, so the unpack is 8 lanes wide per shift.
/// The order permutes channels only inside 16- or 32-channel blocks, so every
/// quantization group keeps its channels.
pub(super) fn unpack_position(c: usize, bits: u32) -> usize {
    let per_byte = 8 / bits as usize;
    let block = 8 * per_byte;
    c / block * block + (c % per_byte) * 8 + (c / per_byte) % 8
}

/// The bit position at which the transposed key kernel (`avx2::dots_codes_t`) masks
/// stored channel `c`'s code inside its row's 32-bit word: `8 b + s * bits` for code `s`
/// of byte `b < 3`, `s * bits` for byte 3 (whose word is shifted down by 24 first).
pub(super) fn code_shift(c: usize, bits: u32) -> u32 {
    let per_byte = 8 / bits as usize;
    let (b, s) = ((c / per_byte) % 4, c % per_byte);
    (if b < 3 { 8 * b } else { 0 } + s * bits as usize) as u32
}

/// `x * 2^-code_shift(c)`: exact (a power-of-two scale) unless the result is subnormal,
/// below `2^-126`, far under any query value that moves a score.
pub(super) fn shifted_query(x: f32, c: usize, bits: u32) -> f32 {
    x * f32::from_bits((127 - code_shift(c, bits)) << 23)
}

/// Unpacks one token's codes to f32 in unpack order (see [`unpack_position`]).
#[inline(always)]
pub(super) fn unpack_bits<const BITS: u32>(bytes: &[u8], out: &mut [f32]) {
    let per_byte = (8 / BITS) as usize;
    let mask = (1u32 << BITS) - 1;
    for (blk, o) in bytes.chunks_exact(8).zip(out.chunks_exact_mut(8 * per_byte)) {
        let b: [i32; 8] = std::array::from_fn(|i| blk[i] as i32);
        for (s, o8) in o.chunks_exact_mut(8).enumerate() {
            let shift = s as u32 * BITS;
            for i in 0..8 {
                // i32 (not u32) so the conversion is one vector instruction.
                o8[i] = ((b[i] >> shift) & mask as i32) as f32;
            }
        }
    }
}

#[inline(always)]
pub(super) fn unpack(bytes: &[u8], bits: u32, out: &mut [f32]) {
    if bits == 2 { unpack_bits::<2>(bytes, out) } else { unpack_bits::<4>(bytes, out) }
}

/// `exp(x)` for `x <= RESCALE_THRESHOLD` (the lazily rescaled softmax weights).
#[inline(always)]
pub(super) fn exp_shifted(x: f32) -> f32 {
    exp_neg(x - RESCALE_THRESHOLD) * RESCALE_EXP
}

/// `e^RESCALE_THRESHOLD`.
pub(super) const RESCALE_EXP: f32 = 485_165_200.0;

/// Query heads per register block of the portable kernels.
pub(super) const HEAD_BLOCK: usize = 4;
/// Channels per accumulator (one AVX2 register of f32).
pub(super) const LANES: usize = 8;

/// The two inner products of attention over a chunk of `n <= CHUNK` tokens whose rows
/// are in f32 (`rows` is `[n][d]`), restricted to channels `[c0, c1)` (a multiple of 16
/// channels): scores `out[h][t] = sum_c q[h][c] * rows[t][c]` and value accumulation
/// `o[h][c] += sum_t w[h][t] * rows[t][c]`, for heads `h < g` (`out` and `w` are
/// `[g][CHUNK]`).
pub(crate) trait Kernels: Copy {
    /// Scores.
    #[allow(clippy::too_many_arguments)]
    fn dots(self, q: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]);
    /// Value accumulation.
    #[allow(clippy::too_many_arguments)]
    fn accumulate(self, o: &mut [f32], w: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize);

    /// `dst = src` as f32 (same length).
    #[inline(always)]
    fn to_f32(self, src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    /// `dst = src` rounded to f16, to nearest even (same length).
    #[inline(always)]
    fn round_to_f16(self, src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    /// [`fwht`] (the same bits).
    #[inline(always)]
    fn fwht(self, x: &mut [f32]) {
        fwht_portable(x)
    }

    /// [`dense_rotate`] (the same bits): `out = x R`, each output the products
    /// `x[i] * R[i][j]` rounded and added in order of `i`.
    #[inline(always)]
    fn dense_rotate(self, x: &[f32], r: &[f32], out: &mut [f32]) {
        dense_rotate(x, r, out)
    }

    /// [`Kernels::dense_rotate`] of every row of `x` (`[n][d]`, `r` is `d x d`) into
    /// `out` (the same bits, row by row).
    #[inline(always)]
    fn dense_rotate_rows(self, x: &[f32], r: &[f32], d: usize, out: &mut [f32]) {
        for (xr, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            self.dense_rotate(xr, r, o);
        }
    }

    /// A hint that `bytes` will be read in a few thousand cycles: into the second-level
    /// cache (nothing in portable code).
    #[inline(always)]
    fn prefetch(self, bytes: &[u8]) {
        let _ = bytes;
    }

    /// A hint that `bytes` will be read next: into the first-level cache (nothing in
    /// portable code).
    #[inline(always)]
    fn prefetch_l1(self, bytes: &[u8]) {
        let _ = bytes;
    }

    /// Softmax weights in place, `s[i] = exp(s[i] - m)` for `s[i] - m <= RESCALE_THRESHOLD`
    /// (`-inf` scores give 0), and their sum.
    #[inline(always)]
    fn exp_sum(self, s: &mut [f32], m: f32) -> f32 {
        for x in s.iter_mut() {
            *x = exp_shifted(*x - m);
        }
        sum(s)
    }

    /// The softmax weights of one head over a chunk whose values are one quantization
    /// group, with that group's value scales and zeros applied in the same pass:
    /// `w[i] = p[i] scales[i]` for `p[i] = exp(s[i] - m)` (as [`Kernels::exp_sum`]), and
    /// returns `(sum p, sum p zeros)`. `s` is left as it was or holds `p`.
    #[inline(always)]
    fn exp_weights(self, s: &mut [f32], m: f32, scales: &[f32], zeros: &[f32], w: &mut [f32]) -> (f32, f32) {
        let l = self.exp_sum(s, m);
        for ((w, p), sc) in w.iter_mut().zip(s.iter()).zip(scales) {
            *w = p * sc;
        }
        (l, dot(s, zeros))
    }

    /// The min and max of each group of `g` values of a stored f16 row (see
    /// [`group_ranges_portable`]).
    #[inline(always)]
    fn group_ranges(self, row: &[f16], g: usize, ranges: &mut [(f32, f32)]) {
        group_ranges_portable(row, g, ranges)
    }

    /// [`Kernels::stage_hadamard`] of a new token's key row (with its `affine`) and value
    /// row in one call, the same bytes as two calls, for kernel sets that gain from
    /// working on both rows at once; `None`, with nothing written, where the kernel set
    /// has no such pass (then stage the rows one at a time).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn stage_hadamard_pair<T: KvElement>(
        self,
        k: &[T],
        affine: KeyAffine<'_>,
        v: &[T],
        g: usize,
        key: (&mut [f16], &mut [(f32, f32)]),
        value: (&mut [f16], &mut [(f32, f32)]),
    ) -> Option<(f32, f32)> {
        let _ = (k, affine, v, g, key, value);
        None
    }

    /// Stages a new input row of a Hadamard-rotated head with no channel permutation in
    /// one pass ([`stage_input`]'s f16 row into `dst`, the same bits, and its groups'
    /// ranges as [`Kernels::group_ranges`] finds them), returning [`load_affine`]'s
    /// squared norm (up to f32 rounding: it only decides which rows get the exact test),
    /// or `None`, with nothing written, where the kernel set has no such pass.
    #[inline(always)]
    fn stage_hadamard<T: KvElement>(
        self,
        src: &[T],
        affine: KeyAffine<'_>,
        g: usize,
        dst: &mut [f16],
        ranges: &mut [(f32, f32)],
    ) -> Option<f32> {
        let _ = (src, affine, g, dst, ranges);
        None
    }

    /// Quantizes stored f16 rows (`rows`: `[n][d]`, `d <= 256`, finite values; `ranges`:
    /// `[n][d / g]`, each group's min and max as [`Kernels::group_ranges`] finds them) into
    /// `codes` (`[n][d * bits / 8]`) and `params` (`[n][4 * d / g]`), each row as
    /// [`quantize_row_portable`] does (the same bytes).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn quantize_rows(
        self,
        rows: &[f16],
        d: usize,
        bits: u32,
        g: usize,
        clip_q16: u32,
        ranges: &[(f32, f32)],
        codes: &mut [u8],
        params: &mut [u8],
    ) {
        let (cb, pb) = (d * bits as usize / 8, 4 * (d / g));
        let rows = rows.chunks_exact(d).zip(ranges.chunks_exact(d / g));
        for ((row, ranges), (c, p)) in rows.zip(codes.chunks_exact_mut(cb).zip(params.chunks_exact_mut(pb))) {
            quantize_row_portable(row, bits, g, clip_q16, ranges, c, p)
        }
    }

    /// [`Kernels::dots`] over packed `bits`-bit codes (`[n][d * bits / 8]` bytes) instead
    /// of f32 rows, with `q` in unpack order; `scratch` is `[CHUNK][d]` f32.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn dots_codes(
        self,
        q: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        n: usize,
        c0: usize,
        c1: usize,
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        unpack_range(codes, bits, n, d, c0, c1, scratch);
        self.dots(q, g, d, scratch, n, c0, c1, out);
    }

    /// The exact key scores of a chunk straight into `s` (`[g][CHUNK]`), every group's
    /// scale and zero applied (`s[h][t] = sum_j scales[j][t] dot_j[h][t] + zeros[j][t]
    /// qsum[h][j]`; `scales`, `zeros` `[groups][CHUNK]`, `qsum` `[g][groups]`), where this
    /// kernel set has that in one pass (the 512-bit kernels); `false` (nothing written)
    /// where it has not, and the caller takes [`Kernels::key_dots`] and applies them. The
    /// lines of `pf` are prefetched into L2 along the way (see
    /// [`Kernels::spreads_prefetch`]).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn key_scores(
        self,
        _qt: &[f32],
        _g: usize,
        _d: usize,
        _codes: &[u8],
        _bits: u32,
        _gs: usize,
        _n: usize,
        _scales: &[f32],
        _zeros: &[f32],
        _qsum: &[f32],
        _s: &mut [f32],
        _codes_t: &mut [u32],
        _pf: &[u8],
    ) -> bool {
        false
    }

    /// The key scores of a chunk of packed codes for every quantization group of
    /// `gs` channels: `out[j][h][t]` (`[groups][g][CHUNK]`) is group `j`'s
    /// `sum_c q[h][c] * code[t][c]`. `q` is the query twice: `qk` in the unpack order of
    /// the codes (for kernels that unpack rows, as [`Kernels::dots_codes`]) and `qt` in
    /// stored order with each channel scaled by `2^-code_shift(c)` (see [`shifted_query`];
    /// for the transposed AVX2 kernel). `rows` and `codes_t` are scratch.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn key_dots(
        self,
        qk: &[f32],
        _qt: &[f32],
        g: usize,
        d: usize,
        codes: &[u8],
        bits: u32,
        gs: usize,
        n: usize,
        out: &mut [f32],
        rows: &mut [f32],
        _codes_t: &mut [u32],
    ) {
        key_dots_by_group(self, qk, g, d, codes, bits, gs, n, out, rows);
    }

    /// Integer key scores of group `j` (see [`IntQuery`]): `out[h][t] = scale[h][j] *
    /// sum_c qi[h][c] * code[t][c]` over the group's channels (`qi = 254 hi + lo` with two
    /// terms), the products summed exactly in integers (so every kernel set gives the
    /// same bits). `codes` is `[n][cb]` bytes.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn dots_int(self, q: &IntQuery, g: usize, j: usize, codes: &[u8], cb: usize, n: usize, out: &mut [f32]) {
        let (pb, bits) = (q.per_byte, 8 / q.per_byte as u32);
        let mask = (1u8 << bits) - 1;
        for t in 0..n {
            let bytes = &codes[t * cb + j * q.group_bytes..t * cb + (j + 1) * q.group_bytes];
            for h in 0..g {
                let qh = q.group(h, j);
                let per_term = qh.len() / q.terms;
                let mut acc = 0i32;
                for (i, qt) in qh.chunks_exact(per_term).enumerate() {
                    let mut sum = 0i32;
                    for (b, &byte) in bytes.iter().enumerate() {
                        for s in 0..pb {
                            let code = (byte >> (s as u32 * bits)) & mask;
                            sum += code as i32 * qt[(b / 32 * pb + s) * 32 + b % 32] as i32;
                        }
                    }
                    acc += if q.terms == 2 && i == 0 { sum * LO_STEPS } else { sum };
                }
                out[h * CHUNK + t] = acc as f32 * q.scale[h * q.groups + j];
            }
        }
    }

    /// Whether [`Kernels::accumulate_codes_prefetching`] and [`Kernels::key_scores`]
    /// spread their prefetches over their work (else `key_scores` is not given any, and
    /// `accumulate_codes_prefetching` issues them at once, first).
    #[inline(always)]
    fn spreads_prefetch(self) -> bool {
        false
    }

    /// [`Kernels::accumulate_codes`], prefetching the lines of `pf` into L2 along the way
    /// (here all at once first; the 512-bit kernel spreads them over its tokens).
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
        self.prefetch(pf);
        self.accumulate_codes(o, w, g, d, codes, bits, n, c0, c1, scratch)
    }

    /// [`Kernels::accumulate`] over packed codes, `o` in unpack order.
    #[allow(clippy::too_many_arguments)]
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
        scratch: &mut [f32],
    ) {
        unpack_range(codes, bits, n, d, c0, c1, scratch);
        self.accumulate(o, w, g, d, scratch, n, c0, c1);
    }
}

/// [`Kernels::key_dots`] one group at a time through [`Kernels::dots_codes`] (the trait's
/// default, and AVX2's path for rows that are not whole 16-byte blocks).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn key_dots_by_group<K: Kernels>(
    kern: K,
    qk: &[f32],
    g: usize,
    d: usize,
    codes: &[u8],
    bits: u32,
    gs: usize,
    n: usize,
    out: &mut [f32],
    rows: &mut [f32],
) {
    for j in 0..d / gs {
        let o = &mut out[j * g * CHUNK..(j + 1) * g * CHUNK];
        kern.dots_codes(qk, g, d, codes, bits, n, j * gs, (j + 1) * gs, o, rows);
    }
}

/// Unpacks channels `[c0, c1)` (whole 8-byte code blocks) of `n` tokens' codes into
/// `rows` (`[n][d]`, unpack order).
#[inline(always)]
pub(super) fn unpack_range(codes: &[u8], bits: u32, n: usize, d: usize, c0: usize, c1: usize, rows: &mut [f32]) {
    let cb = d * bits as usize / 8;
    let (b0, b1) = (c0 * bits as usize / 8, c1 * bits as usize / 8);
    for t in 0..n {
        unpack(&codes[t * cb + b0..t * cb + b1], bits, &mut rows[t * d + c0..t * d + c1]);
    }
}

/// Query rows quantized to int8 for integer key scores ([`KeyScores::Int8`],
/// [`KeyScores::Int8x2`]): per row and quantization group a scale `a = max|q| / 127`
/// and codes `hi = round(q / a)` in `[-127, 127]`; with two terms also
/// `lo = round(254 * (q / a - hi))`, so `q = a * (hi + lo / 254)` to about 1 / 64516 of
/// `max|q|`. Laid out in the order the key code bytes unpack: for group `j`, term `i`,
/// 32-byte chunk `k` of its code bytes and shift `s` (`per_byte` codes per byte), lane
/// `b` holds the channel of code `s` of byte `j * group_bytes + 32 k + b`, i.e. channel
/// `(j * group_bytes + 32 k + b) * per_byte + s` (zero past the group's bytes). So one
/// 32-byte load of codes, a shift and a mask meet 32 query bytes with no reordering.
pub(crate) struct IntQuery {
    pub(super) per_byte: usize,
    pub(super) group_bytes: usize,
    pub(super) groups: usize,
    /// 32-byte chunks per group.
    pub(super) chunks: usize,
    /// 1 (`hi`) or 2 (`hi`, `lo`).
    pub(super) terms: usize,
    /// `[g][groups][terms][chunks][per_byte][32]`.
    pub(super) q: Vec<i8>,
    /// `[g][groups]`: `a` for one term, `a / 254` for two (the scale of `254 hi + lo`).
    pub(super) scale: Vec<f32>,
}

/// The weight of `hi` against `lo` in a two-term [`IntQuery`].
pub(super) const LO_STEPS: i32 = 254;

impl IntQuery {
    /// Quantizes `q` (`[g][d]`, stored channel order) to `terms` (1 or 2) int8 terms.
    pub(super) fn new(fmt: &Format, q: &[f32], g: usize, terms: usize) -> Self {
        let d = fmt.head_dim as usize;
        let (bits, gs) = (fmt.key_bits as usize, fmt.group_size as usize);
        let (per_byte, group_bytes, groups) = (8 / bits, gs * bits / 8, d / gs);
        let chunks = group_bytes.div_ceil(32);
        let per_term = chunks * per_byte * 32;
        let mut out = IntQuery {
            per_byte,
            group_bytes,
            groups,
            chunks,
            terms,
            q: vec![0; g * groups * terms * per_term],
            scale: vec![0.0; g * groups],
        };
        for h in 0..g {
            for j in 0..groups {
                let src = &q[h * d + j * gs..h * d + (j + 1) * gs];
                let amax = src.iter().fold(0f32, |m, x| m.max(x.abs()));
                let a = amax / 127.0;
                if a == 0.0 || !a.is_finite() {
                    continue;
                }
                out.scale[h * groups + j] = if terms == 2 { a / LO_STEPS as f32 } else { a };
                let at = (h * groups + j) * terms * per_term;
                let dst = &mut out.q[at..at + terms * per_term];
                for b in 0..group_bytes {
                    for s in 0..per_byte {
                        let x = src[b * per_byte + s] / a;
                        let hi = x.round().clamp(-127.0, 127.0);
                        let i = (b / 32 * per_byte + s) * 32 + b % 32;
                        dst[i] = hi as i8;
                        if terms == 2 {
                            dst[per_term + i] = ((x - hi) * LO_STEPS as f32).round().clamp(-127.0, 127.0) as i8;
                        }
                    }
                }
            }
        }
        out
    }

    /// Row `h`'s codes of group `j`, term after term.
    #[inline(always)]
    pub(super) fn group(&self, h: usize, j: usize) -> &[i8] {
        let per_group = self.terms * self.chunks * self.per_byte * 32;
        &self.q[(h * self.groups + j) * per_group..(h * self.groups + j + 1) * per_group]
    }
}

/// How the CPU backend scores keys stored as codes (see [`crate::paged::KeyScores`]).
pub use crate::paged::KeyScores;

/// Plain Rust written so the compiler vectorizes it for any target.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Kernels for Portable {
    #[inline(always)]
    fn dots(self, q: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]) {
        for t in 0..n {
            let row = &rows[t * d..(t + 1) * d];
            for h in 0..g {
                let qh = &q[h * d..(h + 1) * d];
                let mut acc = [0f32; LANES];
                for cb in (c0..c1).step_by(LANES) {
                    for l in 0..LANES {
                        acc[l] += qh[cb + l] * row[cb + l];
                    }
                }
                out[h * CHUNK + t] = acc.iter().sum();
            }
        }
    }

    #[inline(always)]
    fn accumulate(self, o: &mut [f32], w: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize) {
        for cb in (c0..c1).step_by(LANES) {
            for h0 in (0..g).step_by(HEAD_BLOCK) {
                let hn = (g - h0).min(HEAD_BLOCK);
                let mut acc = [[0f32; LANES]; HEAD_BLOCK];
                for t in 0..n {
                    let r = &rows[t * d + cb..t * d + cb + LANES];
                    for (hh, acc) in acc.iter_mut().enumerate().take(hn) {
                        let wt = w[(h0 + hh) * CHUNK + t];
                        for l in 0..LANES {
                            acc[l] += wt * r[l];
                        }
                    }
                }
                for (hh, acc) in acc.iter().enumerate().take(hn) {
                    let dst = &mut o[(h0 + hh) * d + cb..(h0 + hh) * d + cb + LANES];
                    for l in 0..LANES {
                        dst[l] += acc[l];
                    }
                }
            }
        }
    }
}
