//! The fast CPU backend: the same bytes as [`crate::reference`], computed in f32 with
//! threads (rayon) over sequences, KV heads and splits, and inner loops written so the
//! compiler vectorizes them (lane-parallel accumulators, lookup tables that unpack a
//! byte of codes at once). On x86-64 with AVX2 the hot loops are compiled a second time
//! for AVX2 and picked at run time.
//!
//! Scores never dequantize a key: for a group with scale `s` and zero `z`,
//! `q'.khat = s * (q'.codes) + z * sum(q')`, and `sum(q')` per group is computed once
//! per query.

use crate::config::{HeadRotation, LayerCalibration};
use crate::reference;
use crate::reference::SeqRef;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use rotkv_kernels::layout::{Format, NO_CLIP, Place, clip_range};
pub use rotkv_kernels::math::exp_neg;
use rotkv_kernels::math::f64_to_f16;
use rotkv_kernels::params::{AppendParams, DecodeParams};

/// Tokens scored per softmax step (one max and one rescale per chunk).
const CHUNK: usize = 64;

/// In-place orthonormal FWHT in f32 (same definition as [`crate::reference::fwht`]).
/// Rows of 8 to 256 values run an AVX2 kernel where the processor has it (the same
/// additions in the same order, so bit for bit the portable result).
pub fn fwht(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect()
        && avx2::fwht(kern, x)
    {
        return;
    }
    fwht_portable(x)
}

/// The portable [`fwht`].
fn fwht_portable(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    if n >= 8 {
        // The three short strides inside each block of 8, in registers (the same additions
        // in the same order as the loop below would do them).
        for b in x.chunks_exact_mut(8) {
            let a: [f32; 8] = b.try_into().expect("8 values");
            let s = [
                a[0] + a[1],
                a[0] - a[1],
                a[2] + a[3],
                a[2] - a[3],
                a[4] + a[5],
                a[4] - a[5],
                a[6] + a[7],
                a[6] - a[7],
            ];
            let t = [
                s[0] + s[2],
                s[1] + s[3],
                s[0] - s[2],
                s[1] - s[3],
                s[4] + s[6],
                s[5] + s[7],
                s[4] - s[6],
                s[5] - s[7],
            ];
            let u = [
                t[0] + t[4],
                t[1] + t[5],
                t[2] + t[6],
                t[3] + t[7],
                t[0] - t[4],
                t[1] - t[5],
                t[2] - t[6],
                t[3] - t[7],
            ];
            b.copy_from_slice(&u);
        }
        h = 8;
    }
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

/// `out = x R` for a row-major `d x d` matrix (row by row, so the inner loop is a
/// vectorizable axpy).
fn dense_rotate(x: &[f32], r: &[f32], out: &mut [f32]) {
    let d = x.len();
    out.fill(0.0);
    for (&xi, row) in x.iter().zip(r.chunks_exact(d)) {
        out.iter_mut().zip(row).for_each(|(o, &m)| *o += xi * m);
    }
}

/// Rotates `x` (in place) into stored order in `out`: `out[j] = (x R)[perm[j]]`.
fn rotate_into(x: &mut [f32], rot: HeadRotation<'_>, perm: &[u16], out: &mut [f32]) {
    match rot {
        HeadRotation::None => {}
        HeadRotation::Hadamard => fwht(x),
        HeadRotation::Dense(r) => {
            dense_rotate(x, r, out);
            x.copy_from_slice(out);
        }
    }
    for (o, &p) in out.iter_mut().zip(perm) {
        *o = x[p as usize];
    }
}

/// Inverse of [`rotate_into`]: `out = unpermute(y) R^T`; `t` is scratch of the row's
/// length.
fn unrotate_into(y: &[f32], rot: HeadRotation<'_>, perm: &[u16], t: &mut [f32], out: &mut [f32]) {
    for (&yj, &pj) in y.iter().zip(perm) {
        t[pj as usize] = yj;
    }
    match rot {
        HeadRotation::None => out.copy_from_slice(t),
        HeadRotation::Hadamard => {
            out.copy_from_slice(t);
            fwht(out);
        }
        HeadRotation::Dense(r) => {
            for (o, row) in out.iter_mut().zip(r.chunks_exact(t.len())) {
                *o = dot(row, t);
            }
        }
    }
}

/// Rotates one input row (minus `mean`, where given) into stored order and rounds it
/// to f16, as the CPU append stores it; `x` and `y` are scratch of the row's length.
#[inline]
fn stage_row(
    src: &[f32],
    mean: Option<(&[f32], &[f32])>,
    rot: HeadRotation<'_>,
    perm: &[u16],
    x: &mut [f32],
    y: &mut [f32],
    dst: &mut [f16],
) {
    match mean {
        Some((m, s)) => x.iter_mut().zip(src.iter().zip(m).zip(s)).for_each(|(x, ((a, m), s))| *x = (a - m) / s),
        None => x.copy_from_slice(src),
    }
    rotate_into(x, rot, perm, y);
    dst.convert_from_f32_slice(y);
}

/// The f16 row the CPU backend stores for an input row (the f32 twin of
/// [`crate::reference::stored_key`] / [`crate::reference::stored_value`]).
/// `mean`: the key's `(mean, scale)`, the row becoming `(src - mean) / scale`.
pub fn stored_row(src: &[f32], mean: Option<(&[f32], &[f32])>, rot: HeadRotation<'_>, perm: &[u16]) -> Vec<f16> {
    let n = src.len();
    let mut out = vec![f16::ZERO; n];
    stage_row(src, mean, rot, perm, &mut vec![0.0; n], &mut vec![0.0; n], &mut out);
    out
}

/// [`quantize_row`] compiled for AVX2 where the processor has it: `f64::round` becomes an
/// inline SSE4.1 sequence (`roundsd` toward zero of `x + copysign(0.49999999999999994,
/// x)`, the same result) instead of a libm call per code, and the f16 conversions F16C.
fn quantize_row_best(row: &[f16], bits: u32, group: usize, clip_q16: u32, codes: &mut [u8], params: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if Avx2::detect().is_some() {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn quantize_row_avx2(row: &[f16], bits: u32, group: usize, clip: u32, codes: &mut [u8], params: &mut [u8]) {
            quantize_row(row, bits, group, clip, codes, params)
        }
        // SAFETY: AVX2, FMA and F16C were detected, the callee's target features.
        return unsafe { quantize_row_avx2(row, bits, group, clip_q16, codes, params) };
    }
    quantize_row(row, bits, group, clip_q16, codes, params)
}

/// Quantizes one stored f16 row into packed codes and `(scale, zero)` pairs, bit for bit
/// as [`crate::reference::quantize_row`] does for the same row (scale, zero and the
/// code division are computed in f64, as there).
#[inline(always)]
fn quantize_row(row: &[f16], bits: u32, group: usize, clip_q16: u32, codes: &mut [u8], params: &mut [u8]) {
    let levels = ((1u32 << bits) - 1) as f64;
    codes.fill(0);
    let per_byte = 8 / bits as usize;
    for (j, chunk) in row.chunks_exact(group).enumerate() {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for x in chunk {
            let x = x.to_f32();
            lo = lo.min(x);
            hi = hi.max(x);
        }
        let (lo, hi) = clip_range(lo as f64, hi as f64, clip_q16);
        let scale = f16::from_bits(f64_to_f16((hi - lo) / levels));
        let zero = f16::from_bits(f64_to_f16(lo));
        params[4 * j..4 * j + 2].copy_from_slice(&scale.to_le_bytes());
        params[4 * j + 2..4 * j + 4].copy_from_slice(&zero.to_le_bytes());
        let (s, z) = (scale.to_f64(), zero.to_f64());
        if s == 0.0 {
            continue;
        }
        for (i, x) in chunk.iter().enumerate() {
            let c = j * group + i;
            let code = ((x.to_f64() - z) / s).round().clamp(0.0, levels) as u8;
            codes[c / per_byte] |= code << ((c % per_byte) * bits as usize);
        }
    }
}

/// Appends `p.count` new tokens (f32, strides in `p`) to a sequence of `p.start` tokens:
/// rotates every row once, quantizes the pages that fill (from old window rows or new
/// rows), then writes the new sink, window and protected rows. Produces the bytes of
/// [`crate::reference::append`].
#[allow(clippy::too_many_arguments)]
pub fn append(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    protected: &[u32],
    k: &[f32],
    v: &[f32],
) {
    let fmt = &p.format;
    let flags = p.flags;
    let d = fmt.head_dim as usize;
    let hkv = p.num_kv_heads as usize;
    let (n, len) = (p.count as usize, p.start as usize);
    // Stored rows of the new tokens: [token][kv_head][K|V][d].
    let mut staged = vec![f16::ZERO; n * hkv * 2 * d];
    staged.par_chunks_mut(2 * d).enumerate().for_each_init(
        || (vec![0f32; d], vec![0f32; d]),
        |(x, y), (i, dst)| {
            let h = i % hkv;
            let (mean, kperm, vperm) = calib.head(h, d);
            let src = (i / hkv) * p.token_stride as usize + h * p.head_stride as usize;
            let (dk, dv) = dst.split_at_mut(d);
            let km = Some((mean, calib.head_key_scale(h, d)));
            stage_row(&k[src..src + d], km, calib.rotation(false, h, d, flags), kperm, x, y, dk);
            stage_row(&v[src..src + d], None, calib.rotation(true, h, d, flags), vperm, x, y, dv);
        },
    );
    let new_len = (len + n) as u32;
    let row_of = |pos: u32, h: u32, value: bool| -> &[f16] {
        if (pos as usize) < len {
            // Old tokens being quantized now are in the window (sinks never are).
            let at = fmt.side_row_at(h, value, fmt.window_row(pos));
            &side[at..at + d]
        } else {
            let at = (((pos as usize - len) * hkv + h as usize) * 2 + value as usize) * d;
            &staged[at..at + d]
        }
    };
    // Quantize the pages that fill during this append, one (page, head) per task.
    let (p0, p1) = (fmt.pages_for(len as u32), fmt.pages_for(new_len));
    let pb = fmt.page_bytes() as usize;
    let g = fmt.group_size as usize;
    let pages: Vec<(u32, u32, Vec<u8>)> = (p0..p1)
        .flat_map(|p| (0..hkv as u32).map(move |h| (p, h)))
        .par_bridge()
        .map(|(page, h)| {
            let mut bytes = vec![0u8; pb];
            let pos = |slot: u32| fmt.sinks + page * fmt.page_size + slot;
            if fmt.channel_norm > 0 {
                // Variance normalization needs the whole page's rows at once (f64, as the
                // reference quantizes them: the same function, so the same bytes).
                for value in [false, true] {
                    let rows: Vec<f64> =
                        (0..fmt.page_size).flat_map(|s| row_of(pos(s), h, value).iter().map(|x| x.to_f64())).collect();
                    reference::quantize_page(fmt, &rows, value, &mut bytes);
                }
                return (page, h, bytes);
            }
            let mut params = vec![0u8; fmt.param_bytes() as usize];
            for slot in 0..fmt.page_size {
                for value in [false, true] {
                    let c = fmt.codes_at(value, slot) as usize;
                    let codes = &mut bytes[c..c + fmt.code_bytes(value) as usize];
                    quantize_row_best(
                        row_of(pos(slot), h, value),
                        fmt.bits(value),
                        g,
                        fmt.clip(value),
                        codes,
                        &mut params,
                    );
                    reference::set_page_params(fmt, &mut bytes, value, slot, &params);
                }
            }
            (page, h, bytes)
        })
        .collect();
    for (page, h, bytes) in pages {
        let at = fmt.page_offset(block_table[page as usize], h, hkv as u32);
        pool[at..at + pb].copy_from_slice(&bytes);
    }
    // New tokens that stay in f16.
    crate::launch::store_f16_rows(p, side, bytemuck::cast_slice(&staged), protected);
}

/// The split count the CPU backend uses when the caller does not choose: enough
/// `(sequence, KV head, split)` tasks to keep every thread busy, never splits shorter
/// than 512 tokens, at most 64.
pub fn default_splits(max_len: usize, num_seqs: usize, num_kv_heads: usize, threads: usize) -> u32 {
    let tasks = (num_seqs * num_kv_heads).max(1);
    let want = (4 * threads).div_ceil(tasks);
    let cap = max_len.div_ceil(512).max(1);
    want.clamp(1, cap.min(64)) as u32
}

/// Position of channel `c` in a row unpacked by [`unpack`] ("unpack order"): within
/// each block of 8 code bytes (`8 * 8 / bits` channels), channel `c` sits at
/// `(c % per_byte) * 8 + (c / per_byte) % 8`, so the unpack is 8 lanes wide per shift.
/// The order permutes channels only inside 16- or 32-channel blocks, so every
/// quantization group keeps its channels.
fn unpack_position(c: usize, bits: u32) -> usize {
    let per_byte = 8 / bits as usize;
    let block = 8 * per_byte;
    c / block * block + (c % per_byte) * 8 + (c / per_byte) % 8
}

/// Unpacks one token's codes to f32 in unpack order (see [`unpack_position`]).
#[inline(always)]
fn unpack_bits<const BITS: u32>(bytes: &[u8], out: &mut [f32]) {
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
fn unpack(bytes: &[u8], bits: u32, out: &mut [f32]) {
    if bits == 2 { unpack_bits::<2>(bytes, out) } else { unpack_bits::<4>(bytes, out) }
}

/// `exp(x)` for `x <= RESCALE_THRESHOLD` (the lazily rescaled softmax weights).
#[inline(always)]
fn exp_shifted(x: f32) -> f32 {
    exp_neg(x - RESCALE_THRESHOLD) * RESCALE_EXP
}

/// `e^RESCALE_THRESHOLD`.
const RESCALE_EXP: f32 = 485_165_200.0;

/// One block of consecutive tokens of one KV head.
#[derive(Clone, Copy)]
pub(crate) enum Chunk<'a> {
    /// `n` f16 key rows and `n` f16 value rows, `[n][head_dim]` each, stored order.
    F16 { k: &'a [f16], v: &'a [f16] },
    /// Slots `[slot, slot + n)` of a head-page.
    Quant { page: &'a [u8], slot: u32, n: u32 },
}

/// Query heads per register block of the portable kernels.
const HEAD_BLOCK: usize = 4;
/// Channels per accumulator (one AVX2 register of f32).
const LANES: usize = 8;

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

/// Unpacks channels `[c0, c1)` (whole 8-byte code blocks) of `n` tokens' codes into
/// `rows` (`[n][d]`, unpack order).
#[inline(always)]
fn unpack_range(codes: &[u8], bits: u32, n: usize, d: usize, c0: usize, c1: usize, rows: &mut [f32]) {
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
    per_byte: usize,
    group_bytes: usize,
    groups: usize,
    /// 32-byte chunks per group.
    chunks: usize,
    /// 1 (`hi`) or 2 (`hi`, `lo`).
    terms: usize,
    /// `[g][groups][terms][chunks][per_byte][32]`.
    q: Vec<i8>,
    /// `[g][groups]`: `a` for one term, `a / 254` for two (the scale of `254 hi + lo`).
    scale: Vec<f32>,
}

/// The weight of `hi` against `lo` in a two-term [`IntQuery`].
const LO_STEPS: i32 = 254;

impl IntQuery {
    /// Quantizes `q` (`[g][d]`, stored channel order) to `terms` (1 or 2) int8 terms.
    fn new(fmt: &Format, q: &[f32], g: usize, terms: usize) -> Self {
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
    fn group(&self, h: usize, j: usize) -> &[i8] {
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

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA micro-kernels: register-blocked over up to 4 query heads and 2 tokens
    //! (scores) or 16 channels (values).
    use super::{CHUNK, IntQuery, Kernels};
    use half::f16;
    use std::arch::x86_64::*;

    /// Proof that the processor supports AVX2, FMA and F16C: only [`Avx2::detect`]
    /// makes one.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2(());

    impl Avx2 {
        /// `Some` when AVX2, FMA and F16C are available.
        pub(crate) fn detect() -> Option<Self> {
            (std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c"))
            .then_some(Avx2(()))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
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
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Scores of heads `[h0, h0 + H)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn dots_block<const H: usize>(
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
    fn accumulate_block<const H: usize>(
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

    /// Scores of heads `[h0, h0 + H)` straight from packed codes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn dots_codes_block<const H: usize, const BITS: u32>(
        q: &[f32],
        h0: usize,
        d: usize,
        codes: &[u8],
        n: usize,
        c0: usize,
        c1: usize,
        out: &mut [f32],
    ) {
        let cb = d * BITS as usize / 8;
        let cpb = 64 / BITS as usize;
        let shifts = 8 / BITS as i32;
        assert!((h0 + H) * d <= q.len() && n * cb <= codes.len() && c1 <= d && c0 <= c1);
        assert!(c0.is_multiple_of(cpb) && c1.is_multiple_of(cpb) && (h0 + H - 1) * CHUNK + n <= out.len());
        let (qp, cp) = (q.as_ptr(), codes.as_ptr());
        let mask = _mm256_set1_epi32((1 << BITS) - 1);
        let mut t = 0;
        while t < n {
            let two = t + 1 < n;
            let r1 = if two { t + 1 } else { t };
            let mut a0 = [_mm256_setzero_ps(); H];
            let mut a1 = [_mm256_setzero_ps(); H];
            for blk in c0 / cpb..c1 / cpb {
                // SAFETY: blk < d / cpb, so the 8 bytes at t * cb + blk * 8 lie inside
                // token t's cb bytes (likewise for r1 < n), inside `codes` (asserted).
                let (raw0, raw1) = unsafe {
                    (
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp.add(t * cb + blk * 8).cast())),
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp.add(r1 * cb + blk * 8).cast())),
                    )
                };
                for s in 0..shifts {
                    let cnt = _mm_cvtsi32_si128(s * BITS as i32);
                    let x0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(raw0, cnt), mask));
                    let x1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(raw1, cnt), mask));
                    let c = blk * cpb + s as usize * 8;
                    for hh in 0..H {
                        // SAFETY: c + 8 <= d and h0 + hh < h0 + H: inside `q` (asserted).
                        let qv = unsafe { _mm256_loadu_ps(qp.add((h0 + hh) * d + c)) };
                        a0[hh] = _mm256_fmadd_ps(qv, x0, a0[hh]);
                        a1[hh] = _mm256_fmadd_ps(qv, x1, a1[hh]);
                    }
                }
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

    /// Value accumulation of heads `[h0, h0 + H)` straight from packed codes.
    #[target_feature(enable = "avx2,fma,f16c")]
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
    ) {
        let cb = d * BITS as usize / 8;
        let cpb = 64 / BITS as usize;
        let shifts = 8 / BITS as i32;
        assert!((h0 + H) * d <= o.len() && n * cb <= codes.len() && c1 <= d && c0 <= c1);
        assert!(c0.is_multiple_of(cpb) && c1.is_multiple_of(cpb) && (n == 0 || (h0 + H - 1) * CHUNK + n <= w.len()));
        let (op, cp) = (o.as_mut_ptr(), codes.as_ptr());
        let mask = _mm256_set1_epi32((1 << BITS) - 1);
        for blk in c0 / cpb..c1 / cpb {
            for sp in (0..shifts).step_by(2) {
                let cnt0 = _mm_cvtsi32_si128(sp * BITS as i32);
                let cnt1 = _mm_cvtsi32_si128((sp + 1) * BITS as i32);
                let mut a0 = [_mm256_setzero_ps(); H];
                let mut a1 = [_mm256_setzero_ps(); H];
                for t in 0..n {
                    // SAFETY: blk < d / cpb and t < n: 8 bytes inside token t's codes.
                    let raw = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(cp.add(t * cb + blk * 8).cast())) };
                    let x0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(raw, cnt0), mask));
                    let x1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(raw, cnt1), mask));
                    for hh in 0..H {
                        let wv = _mm256_set1_ps(w[(h0 + hh) * CHUNK + t]);
                        a0[hh] = _mm256_fmadd_ps(wv, x0, a0[hh]);
                        a1[hh] = _mm256_fmadd_ps(wv, x1, a1[hh]);
                    }
                }
                let c = blk * cpb + sp as usize * 8;
                for hh in 0..H {
                    // SAFETY: c + 16 <= d and h0 + hh < h0 + H: inside `o` (asserted).
                    unsafe {
                        let p = op.add((h0 + hh) * d + c);
                        _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), a0[hh]));
                        _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), a1[hh]));
                    }
                }
            }
        }
    }

    /// In-register FWHT butterflies of `8 * R` floats at `p` (strides 1, 2 and 4 inside
    /// each register by a lane swap and a multiply-add with +-1, exact since
    /// `x * -1 + y` rounds once like `y - x`; strides 8 and up between registers), then
    /// a multiplication by `scale` where given.
    ///
    /// # Safety
    /// `p` is valid for reads and writes of `8 * R` floats, and AVX2 and FMA are present.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fwht_regs<const R: usize>(p: *mut f32, scale: Option<f32>) {
        let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
        let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
        let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
        let mut v = [_mm256_setzero_ps(); R];
        for (r, v) in v.iter_mut().enumerate() {
            // SAFETY: r < R: the 8 floats at 8 * r are inside the caller's 8 * R.
            let a = unsafe { _mm256_loadu_ps(p.add(8 * r)) };
            let a = _mm256_fmadd_ps(a, s1, _mm256_permute_ps::<0xB1>(a));
            let a = _mm256_fmadd_ps(a, s2, _mm256_permute_ps::<0x4E>(a));
            *v = _mm256_fmadd_ps(a, s4, _mm256_permute2f128_ps::<1>(a, a));
        }
        let mut h = 1;
        while h < R {
            for blk in (0..R).step_by(2 * h) {
                for i in blk..blk + h {
                    let (a, b) = (v[i], v[i + h]);
                    v[i] = _mm256_add_ps(a, b);
                    v[i + h] = _mm256_sub_ps(a, b);
                }
            }
            h *= 2;
        }
        for (r, v) in v.iter().enumerate() {
            let v = match scale {
                Some(s) => _mm256_mul_ps(*v, _mm256_set1_ps(s)),
                None => *v,
            };
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(p.add(8 * r), v) };
        }
    }

    /// A row of 256 floats: two halves of 128 in registers (16 registers each, no
    /// spills), then the stride-128 butterflies with the scale.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fwht_256(x: &mut [f32]) {
        assert_eq!(x.len(), 256);
        let p = x.as_mut_ptr();
        let s = _mm256_set1_ps(1.0 / 16.0);
        // SAFETY: both halves are 128 floats inside `x` (asserted length).
        unsafe {
            fwht_regs::<16>(p, None);
            fwht_regs::<16>(p.add(128), None);
        }
        for i in (0..128).step_by(8) {
            // SAFETY: i + 128 + 8 <= 256.
            unsafe {
                let (a, b) = (_mm256_loadu_ps(p.add(i)), _mm256_loadu_ps(p.add(i + 128)));
                _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_add_ps(a, b), s));
                _mm256_storeu_ps(p.add(i + 128), _mm256_mul_ps(_mm256_sub_ps(a, b), s));
            }
        }
    }

    /// [`super::fwht`] for rows of 8 to 256 floats; `false` (nothing done) for others.
    #[inline(always)]
    pub(crate) fn fwht(_proof: Avx2, x: &mut [f32]) -> bool {
        // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
        unsafe {
            let p = x.as_mut_ptr();
            // SAFETY (pointers): each arm's row length is exactly 8 * R floats of `x`.
            match x.len() {
                8 => fwht_regs::<1>(p, Some(1.0 / 8f32.sqrt())),
                16 => fwht_regs::<2>(p, Some(1.0 / 16f32.sqrt())),
                32 => fwht_regs::<4>(p, Some(1.0 / 32f32.sqrt())),
                64 => fwht_regs::<8>(p, Some(1.0 / 64f32.sqrt())),
                128 => fwht_regs::<16>(p, Some(1.0 / 128f32.sqrt())),
                256 => fwht_256(x),
                _ => return false,
            }
        }
        true
    }

    /// Sum of the eight i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum_epi32(v: __m256i) -> i32 {
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
    unsafe fn load_codes(p: *const u8, len: usize) -> __m256i {
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

    /// Integer key scores of heads `[h0, h0 + H)` for group `j` (see
    /// [`Kernels::dots_int`]): `vpmaddubsw` of unsigned codes and signed query bytes,
    /// summed in i16 over the group's shifts and chunks (at most 8 terms of at most
    /// 2 * 15 * 127 = 3810, below 2^15), then `vpmaddwd` to i32 (by 254 for the `hi`
    /// term of two, by 1 else) and a horizontal sum. One term: two tokens at a time; two
    /// terms: one token, its `hi` and `lo` sums side by side.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn dots_int_block<const H: usize, const BITS: u32>(
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
        assert!(q.per_byte == pb && (j + 1) * gb <= cb && n * cb <= codes.len() && (gb == 8 || gb.is_multiple_of(16)));
        assert!(q.chunks * pb <= 8 && (h0 + H - 1) * CHUNK + n <= out.len());
        let per_term = q.chunks * pb * 32;
        let qg: [&[i8]; H] = std::array::from_fn(|hh| q.group(h0 + hh, j));
        assert!(qg.iter().all(|x| x.len() == q.terms * per_term));
        let cp = codes.as_ptr();
        let mask = _mm256_set1_epi8(((1u32 << BITS) - 1) as i8);
        let ones = _mm256_set1_epi16(1);
        let hi_weight = _mm256_set1_epi16(if two_terms { super::LO_STEPS as i16 } else { 1 });
        let mut t = 0;
        while t < n {
            // Second accumulator: the next token (one term) or this token's `lo` term.
            let second = two_terms || t + 1 < n;
            let r1 = if two_terms || t + 1 >= n { t } else { t + 1 };
            let mut a0 = [_mm256_setzero_si256(); H];
            let mut a1 = [_mm256_setzero_si256(); H];
            for k in 0..q.chunks {
                let len = gb - 32 * k;
                // SAFETY: the group's bytes [j * gb, (j + 1) * gb) lie in each token's cb
                // bytes (asserted), and load_codes reads at most the len left of them.
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
                        // SAFETY: 32 bytes at `at` (and at `per_term + at` with two terms)
                        // are inside the group's query (length asserted).
                        let qv = unsafe { _mm256_loadu_si256(qg[hh].as_ptr().add(at).cast()) };
                        a0[hh] = _mm256_add_epi16(a0[hh], _mm256_maddubs_epi16(u0, qv));
                        if two_terms {
                            // SAFETY: as above.
                            let lo = unsafe { _mm256_loadu_si256(qg[hh].as_ptr().add(per_term + at).cast()) };
                            a1[hh] = _mm256_add_epi16(a1[hh], _mm256_maddubs_epi16(u0, lo));
                        } else {
                            a1[hh] = _mm256_add_epi16(a1[hh], _mm256_maddubs_epi16(u1, qv));
                        }
                    }
                }
            }
            for hh in 0..H {
                let a = q.scale[(h0 + hh) * q.groups + j];
                let x0 = _mm256_madd_epi16(a0[hh], hi_weight);
                let x1 = _mm256_madd_epi16(a1[hh], ones);
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

    macro_rules! by_head_blocks {
        ($g:expr, $h0:ident, $f:ident, ($($arg:expr),*) $(, $bits:literal)?) => {{
            let mut $h0 = 0;
            while $h0 < $g {
                let hn = ($g - $h0).min(4);
                // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
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

    impl Kernels for Avx2 {
        #[inline(always)]
        fn to_f32(self, src: &[f16], dst: &mut [f32]) {
            // SAFETY: an `Avx2` value exists only after AVX2, FMA and F16C were detected.
            unsafe { f16_to_f32(src, dst) }
        }
        #[inline(always)]
        fn dots(self, q: &[f32], g: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]) {
            by_head_blocks!(g, h0, dots_block, (q, h0, d, rows, n, c0, c1, out));
        }
        #[inline(always)]
        fn accumulate(
            self,
            o: &mut [f32],
            w: &[f32],
            g: usize,
            d: usize,
            rows: &[f32],
            n: usize,
            c0: usize,
            c1: usize,
        ) {
            by_head_blocks!(g, h0, accumulate_block, (o, w, h0, d, rows, n, c0, c1));
        }
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
            _scratch: &mut [f32],
        ) {
            if bits == 2 {
                by_head_blocks!(g, h0, dots_codes_block, (q, h0, d, codes, n, c0, c1, out), 2);
            } else {
                by_head_blocks!(g, h0, dots_codes_block, (q, h0, d, codes, n, c0, c1, out), 4);
            }
        }
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        fn dots_int(self, q: &IntQuery, g: usize, j: usize, codes: &[u8], cb: usize, n: usize, out: &mut [f32]) {
            if q.per_byte == 4 {
                by_head_blocks!(g, h0, dots_int_block, (q, h0, j, codes, cb, n, out), 2);
            } else {
                by_head_blocks!(g, h0, dots_int_block, (q, h0, j, codes, cb, n, out), 4);
            }
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
            if bits == 2 {
                by_head_blocks!(g, h0, accumulate_codes_block, (o, w, h0, d, codes, n, c0, c1), 2);
            } else {
                by_head_blocks!(g, h0, accumulate_codes_block, (o, w, h0, d, codes, n, c0, c1), 4);
            }
        }
    }
}

/// Sum of `x` with `LANES` independent accumulators (vectorizes; f32 addition order
/// differs from a serial sum by rounding only).
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

/// Max of `x` (not NaN-aware: scores are finite) with `LANES` accumulators.
#[inline(always)]
fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    acc.iter().chain(it.remainder()).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// `sum(a * b)` with `LANES` independent accumulators.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A chunk's max logit may exceed the running reference max by this much before the
/// state is rescaled (lazy rescaling: weights up to `e^20` stay far from f32 overflow).
const RESCALE_THRESHOLD: f32 = 20.0;

/// Scratch of [`HeadState`] for variance-normalized pages.
struct NormScratch {
    key_scales: Vec<f32>,
    value_scales: Vec<f32>,
    qk: Vec<f32>,
    qsum: Vec<f32>,
    ov: Vec<f32>,
    zsum: Vec<f32>,
}

/// Running online-softmax state of one KV head's query rows, and its scratch.
///
/// The rows are the group's query heads, for every query token of a multi-token decode
/// (`[token][head]`); each row may have its own causal limit ([`HeadState::causal`]),
/// past which its scores are masked. Weights are `exp(logit - m)` against a reference
/// max `m` that only moves when a chunk's max exceeds it by [`RESCALE_THRESHOLD`]; value
/// zeros are accumulated per quantization group in `zsum` and added to `o` when `m` moves
/// and at the end ([`HeadState::finish`]).
pub(crate) struct HeadState {
    /// Query rows (heads of the group, times query tokens).
    g: usize,
    d: usize,
    /// Rotated, scaled queries `[g][d]`.
    q: Vec<f32>,
    /// The same in the unpack order of the key codes.
    qk: Vec<f32>,
    /// `sum(q')` per quantization group: `[g][groups]`.
    qsum: Vec<f32>,
    /// Sum of `weight * zero` per head and value group `[g][groups]`.
    zsum: Vec<f32>,
    /// Reference max logit per head.
    pub m: Vec<f32>,
    /// Sum of `exp(logit - m)` per head.
    pub l: Vec<f32>,
    /// Weighted value sum `[g][d]` (stored value order), complete after `finish`.
    pub o: Vec<f32>,
    /// Weighted sum of quantized values `[g][d]` in the unpack order of value codes.
    ov: Vec<f32>,
    /// Code bits of keys and values (for the unpack orders).
    bits: (u32, u32),
    /// Variance-normalized pages (empty without): the page's key and value channel
    /// scales `[d]`, the queries times the key scales in unpack order `[g][d]` with their
    /// group sums `[g][groups]`, and one chunk's weighted value codes `[g][d]` and zero
    /// sums `[g][groups]` before the value scales are applied.
    norm: Option<NormScratch>,
    /// The queries in int8 where key scores are integer ([`HeadState::int_keys`]).
    int_q: Option<IntQuery>,
    /// Position of the next chunk's first token.
    pos: u32,
    /// The smallest causal limit: chunks ending at or before it need no mask.
    mask_from: u32,
    /// Per row, the end (exclusive) of the positions it attends to.
    limits: Vec<u32>,
    s: Vec<f32>,
    w: Vec<f32>,
    tmp: Vec<f32>,
    rows: Vec<f32>,
    scales: Vec<f32>,
    zeros: Vec<f32>,
}

impl HeadState {
    /// `q` is the `[g][d]` rotated query rows with the softmax scale folded in; every
    /// row attends to every token given (see [`HeadState::causal`]).
    pub(crate) fn new(fmt: &Format, q: &[f32], g: usize) -> Self {
        let d = fmt.head_dim as usize;
        let gs = fmt.group_size as usize;
        let groups = d / gs;
        let mut qk = vec![0f32; g * d];
        for (qh, kh) in q.chunks_exact(d).zip(qk.chunks_exact_mut(d)) {
            for (c, &x) in qh.iter().enumerate() {
                kh[unpack_position(c, fmt.key_bits)] = x;
            }
        }
        Self {
            g,
            d,
            q: q.to_vec(),
            qk,
            qsum: q.chunks_exact(gs).map(|c| c.iter().sum()).collect(),
            zsum: vec![0.0; g * groups],
            m: vec![f32::NEG_INFINITY; g],
            l: vec![0.0; g],
            o: vec![0.0; g * d],
            ov: vec![0.0; g * d],
            bits: (fmt.key_bits, fmt.value_bits),
            norm: (fmt.channel_norm > 0).then(|| NormScratch {
                key_scales: vec![0.0; d],
                value_scales: vec![0.0; d],
                qk: vec![0.0; g * d],
                qsum: vec![0.0; g * groups],
                ov: vec![0.0; g * d],
                zsum: vec![0.0; g * groups],
            }),
            int_q: None,
            pos: 0,
            mask_from: u32::MAX,
            limits: Vec::new(),
            s: vec![0.0; g * CHUNK],
            w: vec![0.0; g * CHUNK],
            tmp: vec![0.0; g * CHUNK],
            rows: vec![0.0; CHUNK * d],
            scales: vec![0.0; CHUNK * groups],
            zeros: vec![0.0; CHUNK * groups],
        }
    }

    /// Gives every row a causal limit: the chunks start at position `begin`, and row `r`
    /// only sees positions below `limits[r]` (its scores past it are masked; a row that
    /// sees none of the chunks stays empty, `m = -inf, l = 0, o = 0`).
    pub(crate) fn causal(mut self, begin: u32, limits: Vec<u32>) -> Self {
        debug_assert_eq!(limits.len(), self.g);
        self.pos = begin;
        self.mask_from = limits.iter().copied().min().unwrap_or(u32::MAX);
        self.limits = limits;
        self
    }

    /// Scores quantized keys with int8 queries and integer dot products
    /// ([`KeyScores::Int8`]; pages with variance normalization keep the f32 path).
    pub(crate) fn int_keys(mut self, fmt: &Format, terms: usize) -> Self {
        if fmt.channel_norm == 0 {
            self.int_q = Some(IntQuery::new(fmt, &self.q, self.g, terms));
        }
        self
    }

    /// Masks the scores of the `n` tokens of the current chunk that lie past their row's
    /// causal limit (only chunks that reach past the smallest limit have any).
    #[inline(always)]
    fn mask(&mut self, n: usize) {
        if self.pos + n as u32 <= self.mask_from {
            return;
        }
        for (h, &limit) in self.limits.iter().enumerate() {
            let keep = limit.saturating_sub(self.pos).min(n as u32) as usize;
            self.s[h * CHUNK + keep..h * CHUNK + n].fill(f32::NEG_INFINITY);
        }
    }

    /// Converts the scales and zeros of slots `[slot, slot + n)` into `scales` and
    /// `zeros` (`[groups][CHUNK]`; contiguous runs in the page's planar layout).
    #[inline(always)]
    fn load_params<K: Kernels>(&mut self, kern: K, fmt: &Format, page: &[u8], value: bool, slot: u32, n: usize) {
        for j in 0..fmt.groups() {
            let (s, z) = (fmt.scale_at(value, j, slot) as usize, fmt.zero_at(value, j, slot) as usize);
            let j = j as usize;
            let scales = bytemuck::cast_slice::<u8, f16>(&page[s..s + 2 * n]);
            kern.to_f32(scales, &mut self.scales[j * CHUNK..j * CHUNK + n]);
            let zeros = bytemuck::cast_slice::<u8, f16>(&page[z..z + 2 * n]);
            kern.to_f32(zeros, &mut self.zeros[j * CHUNK..j * CHUNK + n]);
        }
    }

    /// Adds the zero sums into `o`.
    #[inline(always)]
    fn flush(&mut self) {
        let d = self.d;
        let groups = self.zsum.len() / self.g;
        let gs = d / groups;
        for h in 0..self.g {
            for j in 0..groups {
                let z = std::mem::take(&mut self.zsum[h * groups + j]);
                if z != 0.0 {
                    self.o[h * d + j * gs..h * d + (j + 1) * gs].iter_mut().for_each(|o| *o += z);
                }
            }
        }
    }

    /// Turns the scores of `n` tokens into weights `exp(s - m)`, moving `m` (and
    /// rescaling the running sums) only when a score exceeds it by the threshold.
    #[inline(always)]
    fn softmax(&mut self, n: usize) {
        let d = self.d;
        let mut moved = false;
        for h in 0..self.g {
            let local = max(&self.s[h * CHUNK..h * CHUNK + n]);
            if local > self.m[h] + RESCALE_THRESHOLD {
                if !moved {
                    self.flush();
                    moved = true;
                }
                let c = exp_neg(self.m[h] - local);
                self.m[h] = local;
                self.l[h] *= c;
                self.o[h * d..(h + 1) * d].iter_mut().for_each(|o| *o *= c);
                self.ov[h * d..(h + 1) * d].iter_mut().for_each(|o| *o *= c);
            }
        }
        for h in 0..self.g {
            let m = self.m[h];
            let s = &mut self.s[h * CHUNK..h * CHUNK + n];
            if m == f32::NEG_INFINITY {
                // Every score of the row so far is masked: no weight (not -inf - -inf).
                s.fill(0.0);
                continue;
            }
            for x in s.iter_mut() {
                *x = exp_shifted(*x - m);
            }
            self.l[h] += sum(s);
        }
    }

    /// Raw scores `s[h][t] = q'[h] . khat[t]` of slots `[slot, slot + n)` of a page (no
    /// mask, no softmax), by the f32 or the integer path.
    #[inline(always)]
    fn key_scores<K: Kernels>(&mut self, kern: K, fmt: &Format, page: &[u8], slot: u32, n: usize) {
        let (g, d) = (self.g, self.d);
        let gs = fmt.group_size as usize;
        let groups = d / gs;
        // A variance-normalized page: the queries times its key channel scales.
        if let Some(nm) = self.norm.as_mut() {
            for value in [false, true] {
                let at = fmt.channel_scale_at(value, 0) as usize;
                let src = bytemuck::cast_slice::<u8, f16>(&page[at..at + 2 * d]);
                kern.to_f32(src, if value { &mut nm.value_scales } else { &mut nm.key_scales });
            }
            for h in 0..g {
                for c in 0..d {
                    nm.qk[h * d + unpack_position(c, fmt.key_bits)] = self.q[h * d + c] * nm.key_scales[c];
                }
                for j in 0..groups {
                    nm.qsum[h * groups + j] =
                        (j * gs..(j + 1) * gs).map(|c| self.q[h * d + c] * nm.key_scales[c]).sum();
                }
            }
        }
        self.load_params(kern, fmt, page, false, slot, n);
        let (qk, qsum) = match &self.norm {
            Some(nm) => (&nm.qk, &nm.qsum),
            None => (&self.qk, &self.qsum),
        };
        let kc = fmt.key_codes_at(slot) as usize;
        let kcodes = &page[kc..kc + n * fmt.key_code_bytes() as usize];
        for j in 0..groups {
            let (c0, c1) = (j * gs, (j + 1) * gs);
            match &self.int_q {
                Some(iq) => kern.dots_int(iq, g, j, kcodes, fmt.key_code_bytes() as usize, n, &mut self.tmp),
                None => kern.dots_codes(qk, g, d, kcodes, fmt.key_bits, n, c0, c1, &mut self.tmp, &mut self.rows),
            }
            let (scales, zeros) = (&self.scales[j * CHUNK..j * CHUNK + n], &self.zeros[j * CHUNK..j * CHUNK + n]);
            for h in 0..g {
                let qs = qsum[h * groups + j];
                let (s, tmp) = (&mut self.s[h * CHUNK..h * CHUNK + n], &self.tmp[h * CHUNK..h * CHUNK + n]);
                if j == 0 {
                    for t in 0..n {
                        s[t] = scales[t] * tmp[t] + zeros[t] * qs;
                    }
                } else {
                    for t in 0..n {
                        s[t] += scales[t] * tmp[t] + zeros[t] * qs;
                    }
                }
            }
        }
    }

    /// Scores the chunk, updates the softmax state and accumulates its values.
    #[inline(always)]
    pub(crate) fn step<K: Kernels>(&mut self, kern: K, fmt: &Format, chunk: Chunk<'_>) {
        let (g, d) = (self.g, self.d);
        match chunk {
            Chunk::F16 { k, v } => {
                let n = k.len() / d;
                kern.to_f32(k, &mut self.rows[..n * d]);
                kern.dots(&self.q, g, d, &self.rows, n, 0, d, &mut self.s);
                self.mask(n);
                self.softmax(n);
                kern.to_f32(v, &mut self.rows[..n * d]);
                kern.accumulate(&mut self.o, &self.s, g, d, &self.rows, n, 0, d);
                self.pos += n as u32;
            }
            Chunk::Quant { page, slot, n } => {
                let n = n as usize;
                let gs = fmt.group_size as usize;
                let groups = d / gs;
                self.key_scores(kern, fmt, page, slot, n);
                self.mask(n);
                self.softmax(n);
                let vc = fmt.value_codes_at(slot) as usize;
                let vcodes = &page[vc..vc + n * fmt.value_code_bytes() as usize];
                self.load_params(kern, fmt, page, true, slot, n);
                // Normalized pages accumulate the chunk apart, then apply the value scales.
                let (ov, zsum) = match self.norm.as_mut() {
                    Some(nm) => {
                        nm.ov.fill(0.0);
                        nm.zsum.fill(0.0);
                        (&mut nm.ov, &mut nm.zsum)
                    }
                    None => (&mut self.ov, &mut self.zsum),
                };
                for j in 0..groups {
                    let (scales, zeros) =
                        (&self.scales[j * CHUNK..j * CHUNK + n], &self.zeros[j * CHUNK..j * CHUNK + n]);
                    for h in 0..g {
                        let (p, w) = (&self.s[h * CHUNK..h * CHUNK + n], &mut self.w[h * CHUNK..h * CHUNK + n]);
                        for t in 0..n {
                            w[t] = p[t] * scales[t];
                        }
                        zsum[h * groups + j] += dot(p, zeros);
                    }
                    let (c0, c1) = (j * gs, (j + 1) * gs);
                    kern.accumulate_codes(ov, &self.w, g, d, vcodes, fmt.value_bits, n, c0, c1, &mut self.rows);
                }
                if let Some(nm) = &self.norm {
                    for h in 0..g {
                        for c in 0..d {
                            let x = nm.ov[h * d + unpack_position(c, fmt.value_bits)] + nm.zsum[h * groups + c / gs];
                            self.o[h * d + c] += nm.value_scales[c] * x;
                        }
                    }
                }
                self.pos += n as u32;
            }
        }
    }

    /// Completes `o` (call once after the last chunk).
    pub(crate) fn finish(&mut self) {
        self.flush();
        let d = self.d;
        for (o, ov) in self.o.chunks_exact_mut(d).zip(self.ov.chunks_exact(d)) {
            for (c, o) in o.iter_mut().enumerate() {
                *o += ov[unpack_position(c, self.bits.1)];
            }
        }
    }
}

/// Runs every chunk of `chunks` through `st`, then completes it.
#[inline(always)]
fn run_chunks<'a, K: Kernels>(kern: K, st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    for c in chunks {
        st.step(kern, fmt, c);
    }
    st.finish();
}

/// [`run_chunks`] with the AVX2 kernels, compiled for AVX2 (and FMA, F16C) so
/// everything inlines.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn run_chunks_avx2<'a>(kern: Avx2, st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    run_chunks(kern, st, fmt, chunks)
}

/// [`run_chunks`] with the best kernels this processor supports.
fn run_chunks_best<'a>(st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = Avx2::detect() {
        // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target features.
        return unsafe { run_chunks_avx2(kern, st, fmt, chunks) };
    }
    run_chunks(Portable, st, fmt, chunks)
}

/// The chunks of positions `[begin, end)` of a sequence, in position order: sink rows,
/// then page slots (a protected position as a one-row f16 chunk of its protected row),
/// then window rows, none crossing a page, a protected position, the end of the sinks
/// or the wrap of the window ring, none longer than 64 tokens.
fn chunks<'a>(
    fmt: &Format,
    num_kv_heads: usize,
    pool: &'a [u8],
    seq: &SeqRef<'a>,
    kv_head: usize,
    begin: u32,
    end: u32,
) -> impl Iterator<Item = Chunk<'a>> + use<'a> {
    let fmt = *fmt;
    let len = seq.len as u32;
    let seq = *seq;
    let d = fmt.head_dim as usize;
    let mut pos = begin;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let h = kv_head as u32;
        let (chunk, n) = match fmt.place(pos, len) {
            Place::Sink { index: row } | Place::Window { slot: row } => {
                let limit = if pos < fmt.sinks { fmt.sinks } else { fmt.sinks + fmt.window_capacity() };
                let n = (end - pos).min(limit - row).min(CHUNK as u32);
                let k = fmt.side_row_at(h, false, row);
                let v = fmt.side_row_at(h, true, row);
                let c = n as usize * d;
                (Chunk::F16 { k: &seq.side[k..k + c], v: &seq.side[v..v + c] }, n)
            }
            Place::Page { page, slot } => {
                // A protected position is read from its f16 row; a page chunk stops before
                // the next one.
                let next = seq.protected.partition_point(|&x| x < pos);
                match seq.protected.get(next) {
                    Some(&p) if p == pos => {
                        let row = fmt.protected_row(next as u32);
                        let (k, v) = (fmt.side_row_at(h, false, row), fmt.side_row_at(h, true, row));
                        (Chunk::F16 { k: &seq.side[k..k + d], v: &seq.side[v..v + d] }, 1)
                    }
                    upcoming => {
                        let stop = upcoming.map_or(end, |&p| p.min(end));
                        let n = (stop - pos).min(fmt.page_size - slot).min(CHUNK as u32);
                        let at = fmt.page_offset(seq.block_table[page as usize], h, num_kv_heads as u32);
                        let page = &pool[at..at + fmt.page_bytes() as usize];
                        (Chunk::Quant { page, slot, n }, n)
                    }
                }
            }
        };
        pos += n;
        Some(chunk)
    })
}

/// Rotated query rows of one KV head's group, `[q_len][g][d]`, with the softmax scale
/// folded in.
fn group_queries(p: &DecodeParams, calib: &LayerCalibration, q: &[f32], seq: usize, kv_head: usize) -> Vec<f32> {
    let d = p.format.head_dim as usize;
    let hq = p.num_q_heads as usize;
    let g = hq / p.num_kv_heads as usize;
    let (_, kperm, _) = calib.head(kv_head, d);
    let ks = calib.head_key_scale(kv_head, d);
    let mut out = vec![0f32; p.q_len as usize * g * d];
    let mut x = vec![0f32; d];
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        let (row, i) = (r / g, r % g);
        let at = seq * p.q_seq_stride as usize + row * p.q_token_stride as usize + (kv_head * g + i) * d;
        x.iter_mut().zip(q[at..at + d].iter().zip(ks)).for_each(|(x, (q, s))| *x = q * s * p.sm_scale);
        rotate_into(&mut x, calib.rotation(false, kv_head, d, p.flags), kperm, o);
    }
    out
}

/// Decode attention for `p.q_len` query tokens per sequence (see
/// [`crate::reference::decode`] for the definition): tasks over `(sequence, KV head,
/// split)` in parallel, each scoring the `q_len * g` query rows of its KV head's group
/// in one pass over the split's keys and values (rows past their causal limit masked,
/// which only the split's last `q_len - 1` positions can be), then the log-sum-exp merge
/// and the inverse value rotation per query row and head. The rows share each chunk's
/// loads and conversions: the portable kernels unpack a chunk's codes once for all rows,
/// the AVX2 kernels once per register block of 4 rows.
pub fn decode(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
    out: &mut [f32],
    key_scores: KeyScores,
) {
    let fmt = p.format;
    let d = fmt.head_dim as usize;
    let (hq, hkv) = (p.num_q_heads as usize, p.num_kv_heads as usize);
    let g = hq / hkv;
    let q_len = p.q_len as usize;
    let ns = p.num_splits as usize;
    let tasks: Vec<(usize, usize, u32)> =
        (0..seqs.len()).flat_map(|s| (0..hkv).flat_map(move |h| (0..ns as u32).map(move |i| (s, h, i)))).collect();
    let partials: Vec<Option<HeadState>> = tasks
        .par_iter()
        .map(|&(s, h, split)| {
            let len = seqs[s].len as u32;
            let (b, e) = p.split_range(split, len);
            if b >= e {
                return None;
            }
            let limits = (0..q_len * g).map(|r| p.row_len(len, (r / g) as u32)).collect();
            let mut st = HeadState::new(&fmt, &group_queries(p, calib, q, s, h), q_len * g).causal(b, limits);
            match key_scores {
                KeyScores::Exact => {}
                KeyScores::Int8 => st = st.int_keys(&fmt, 1),
                KeyScores::Int8x2 => st = st.int_keys(&fmt, 2),
            }
            run_chunks_best(&mut st, &fmt, chunks(&fmt, hkv, pool, &seqs[s], h, b, e));
            Some(st)
        })
        .collect();
    out.par_chunks_mut(p.q_seq_stride as usize).zip(partials.par_chunks(hkv * ns)).for_each(|(out, parts)| {
        let (mut x, mut t) = (vec![0f32; d], vec![0f32; d]);
        for row in 0..q_len {
            for qh in 0..hq {
                let (h, i) = (qh / g, qh % g);
                merge_into(&parts[h * ns..(h + 1) * ns], row * g + i, d, &mut x);
                let (_, _, vperm) = calib.head(h, d);
                let o = &mut out[(row * hq + qh) * d..(row * hq + qh + 1) * d];
                unrotate_into(&x, calib.rotation(true, h, d, p.flags), vperm, &mut t, o);
            }
        }
    });
}

/// Log-sum-exp merge of query row `i` of the partials of one KV head (empty splits are
/// `None`, rows masked out of a whole split have `m = -inf`: neither contributes; all
/// empty gives zeros).
fn merge_into(parts: &[Option<HeadState>], i: usize, d: usize, x: &mut [f32]) {
    let live = || parts.iter().flatten().filter(|s| s.m[i] > f32::NEG_INFINITY);
    let m = live().map(|s| s.m[i]).fold(f32::NEG_INFINITY, f32::max);
    x.fill(0.0);
    let mut l = 0.0;
    for s in live() {
        let c = exp_neg(s.m[i] - m);
        l += s.l[i] * c;
        x.iter_mut().zip(&s.o[i * d..(i + 1) * d]).for_each(|(a, b)| *a += b * c);
    }
    if l > 0.0 {
        x.iter_mut().for_each(|a| *a /= l);
    }
}

/// The f16 baseline used by the benchmarks: decode attention over a plain f16 cache
/// (`[seq][kv_head][len][head_dim]` for K and V, no rotation, no quantization), with
/// the same threading, chunking and online softmax as [`decode`]. `q` and `out` are
/// `[seq][q_head][head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn decode_f16_baseline(
    k: &[f16],
    v: &[f16],
    len: usize,
    num_kv_heads: usize,
    num_q_heads: usize,
    head_dim: usize,
    splits: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let d = head_dim;
    let g = num_q_heads / num_kv_heads;
    let seqs = q.len() / (num_q_heads * d);
    let fmt = Format {
        head_dim: d as u32,
        key_bits: 2,
        value_bits: 2,
        group_size: d as u32,
        page_size: CHUNK as u32,
        sinks: 0,
        window: 0,
        key_clip: NO_CLIP,
        value_clip: NO_CLIP,
        protected: 0,
        channel_norm: 0,
    };
    let per = len.div_ceil(splits);
    let tasks: Vec<(usize, usize, usize)> =
        (0..seqs).flat_map(|s| (0..num_kv_heads).flat_map(move |h| (0..splits).map(move |i| (s, h, i)))).collect();
    let partials: Vec<Option<HeadState>> = tasks
        .par_iter()
        .map(|&(s, h, i)| {
            let (b, e) = ((i * per).min(len), ((i + 1) * per).min(len));
            if b >= e {
                return None;
            }
            let at = (s * num_q_heads + h * g) * d;
            let qs: Vec<f32> = q[at..at + g * d].iter().map(|x| x / (d as f32).sqrt()).collect();
            let mut st = HeadState::new(&fmt, &qs, g);
            let base = (s * num_kv_heads + h) * len * d;
            let rows = (b..e).step_by(CHUNK).map(|t| {
                let r = base + t * d..base + (t + CHUNK).min(e) * d;
                Chunk::F16 { k: &k[r.clone()], v: &v[r] }
            });
            run_chunks_best(&mut st, &fmt, rows);
            Some(st)
        })
        .collect();
    out.par_chunks_mut(num_q_heads * d).zip(partials.par_chunks(num_kv_heads * splits)).for_each(|(out, parts)| {
        for qh in 0..num_q_heads {
            let (h, i) = (qh / g, qh % g);
            merge_into(&parts[h * splits..(h + 1) * splits], i, d, &mut out[qh * d..(qh + 1) * d]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-2, 2).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 8) as f32 / (1 << 22) as f32 - 2.0
            })
            .collect()
    }

    /// Runs the same chunks (f16 rows and quantized pages) through two kernel sets.
    fn run_both<K: Kernels>(kern: K, fmt: &Format, g: usize, terms: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = fmt.head_dim as usize;
        let n = 50;
        let q = values(g * d, 1);
        let rows: Vec<f16> = values(2 * n * d, 2).iter().map(|&x| f16::from_f32(x)).collect();
        let page: Vec<u8> = values(fmt.page_bytes() as usize, 3).iter().map(|&x| (x * 1000.0) as i32 as u8).collect();
        // Valid f16 scales and zeros in the page's params.
        let mut page = page;
        for value in [false, true] {
            for j in 0..fmt.groups() {
                for slot in 0..fmt.page_size {
                    let s = fmt.scale_at(value, j, slot) as usize;
                    let z = fmt.zero_at(value, j, slot) as usize;
                    page[s..s + 2].copy_from_slice(&f16::from_f32(0.01 + (slot % 7) as f32 * 0.03).to_le_bytes());
                    page[z..z + 2].copy_from_slice(&f16::from_f32(-0.2 - (j as f32) * 0.1).to_le_bytes());
                }
            }
        }
        let mut st = HeadState::new(fmt, &q, g);
        if terms > 0 {
            st = st.int_keys(fmt, terms);
        }
        let chunks = [
            Chunk::F16 { k: &rows[..n * d], v: &rows[n * d..] },
            Chunk::Quant { page: &page, slot: 3, n: 13 },
            Chunk::Quant { page: &page, slot: 0, n: fmt.page_size },
        ];
        run_chunks(kern, &mut st, fmt, chunks.into_iter());
        (st.m[..g].to_vec(), st.l[..g].to_vec(), st.o[..g * d].to_vec())
    }

    #[test]
    fn avx2_kernels_match_portable_kernels() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            for (d, kb, vb, gs) in
                [(64, 2, 2, 64), (128, 4, 2, 32), (256, 2, 4, 128), (128, 4, 4, 128), (64, 2, 2, 32), (256, 4, 2, 256)]
            {
                let fmt = Format {
                    head_dim: d,
                    key_bits: kb,
                    value_bits: vb,
                    group_size: gs,
                    page_size: 16,
                    sinks: 0,
                    window: 0,
                    key_clip: NO_CLIP,
                    value_clip: NO_CLIP,
                    protected: 0,
                    channel_norm: 0,
                };
                for g in [1, 3, 7, 8] {
                    for terms in [0, 1, 2] {
                        let (m0, l0, o0) = run_both(Portable, &fmt, g, terms);
                        let (m1, l1, o1) = run_both(avx, &fmt, g, terms);
                        for (a, b) in m0.iter().zip(&m1).chain(l0.iter().zip(&l1)).chain(o0.iter().zip(&o1)) {
                            assert!(
                                (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                                "{a} vs {b} ({d} {kb} {vb} {gs} g{g} terms {terms})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn fwht_kernels_match_portable_bit_for_bit() {
        for n in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] {
            let x = values(n * 3, n as u32);
            for row in x.chunks_exact(n) {
                let (mut a, mut b) = (row.to_vec(), row.to_vec());
                fwht(&mut a);
                fwht_portable(&mut b);
                assert_eq!(
                    a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                // And the definition (f64 reference).
                let mut r: Vec<f64> = row.iter().map(|&v| v as f64).collect();
                reference::fwht(&mut r);
                for (a, r) in a.iter().zip(&r) {
                    assert!((*a as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()), "n {n}: {a} vs {r}");
                }
            }
        }
    }

    /// Integer scores bit for bit equal between the portable and AVX2 kernels (integer
    /// sums are exact), on random codes for every code width and group size.
    #[test]
    fn int_scores_match_between_kernels() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(avx) = Avx2::detect() else {
                eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
                return;
            };
            for (d, kb, gs) in [(64, 2, 32), (64, 2, 64), (128, 4, 32), (128, 2, 128), (256, 4, 256), (256, 2, 256)] {
                let fmt = Format {
                    head_dim: d,
                    key_bits: kb,
                    value_bits: 2,
                    group_size: gs,
                    page_size: 16,
                    sinks: 0,
                    window: 0,
                    key_clip: NO_CLIP,
                    value_clip: NO_CLIP,
                    protected: 0,
                    channel_norm: 0,
                };
                let cb = fmt.key_code_bytes() as usize;
                let codes: Vec<u8> = values(CHUNK * cb, 5).iter().map(|&x| (x * 1000.0) as i32 as u8).collect();
                for (g, terms) in [1, 3, 5, 8].into_iter().flat_map(|g| [(g, 1), (g, 2)]) {
                    let iq = IntQuery::new(&fmt, &values(g * d as usize, 6), g, terms);
                    for n in [1, 2, 7, CHUNK] {
                        let (mut a, mut b) = (vec![0f32; g * CHUNK], vec![0f32; g * CHUNK]);
                        for j in 0..iq.groups {
                            Portable.dots_int(&iq, g, j, &codes, cb, n, &mut a);
                            avx.dots_int(&iq, g, j, &codes, cb, n, &mut b);
                            assert_eq!(a, b, "d{d} k{kb} g{gs} rows {g} terms {terms} n {n} group {j}");
                        }
                    }
                }
            }
        }
    }

    /// Key scores of the f32 and integer (`terms` int8 terms) paths against f64 on the
    /// same stored pages: `(relative error f32, relative error integer, max |logit
    /// error| integer / logit RMS)`.
    fn score_errors(
        config: crate::CacheConfig,
        hkv: usize,
        k: &[f32],
        q: &[f32],
        sm_scale: f32,
        terms: usize,
    ) -> (f64, f64, f64) {
        use crate::paged::{self, LayerShape};
        let d = config.head_dim;
        let fmt = config.format().unwrap();
        let t = k.len() / (hkv * d);
        let hq = q.len() / d;
        let g = hq / hkv;
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
        let blocks = paged::blocks_for(&config, t).unwrap();
        let mut pool = paged::PoolBuffer::new(paged::pool_bytes(&config, &shape, blocks).unwrap());
        let mut side = vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
        let table: Vec<u32> = (0..blocks as u32).collect();
        let calib = LayerCalibration::identity(hkv, d);
        let backend = crate::Backend::Reference;
        paged::append(backend, &config, &calib, &shape, pool.bytes_mut(), &table, &mut side, &[], 0, t, k, k).unwrap();
        let pool = pool.bytes();
        let (mut e32, mut e8, mut r2, mut worst, mut n_all) = (0f64, 0f64, 0f64, 0f64, 0usize);
        let mask = (1u32 << fmt.key_bits) - 1;
        for h in 0..hkv {
            // Rotated queries with the softmax scale, f32 (as decode makes them) and f64.
            let q32: Vec<f32> = q[h * g * d..(h + 1) * g * d].iter().map(|x| x * sm_scale).collect();
            let mut qr = q32.clone();
            qr.chunks_exact_mut(d).for_each(fwht);
            let mut q64: Vec<f64> = q32.iter().map(|&x| x as f64).collect();
            q64.chunks_exact_mut(d).for_each(reference::fwht);
            for page in 0..fmt.pages_for(t as u32) {
                let at = fmt.page_offset(page, h as u32, hkv as u32);
                let bytes = &pool[at..at + fmt.page_bytes() as usize];
                let n = fmt.page_size as usize;
                let mut exact = HeadState::new(&fmt, &qr, g);
                exact.key_scores(Portable, &fmt, bytes, 0, n);
                let mut int = HeadState::new(&fmt, &qr, g).int_keys(&fmt, terms);
                int.key_scores(Portable, &fmt, bytes, 0, n);
                for slot in 0..n as u32 {
                    let kc = fmt.key_codes_at(slot) as usize;
                    let khat: Vec<f64> = (0..d)
                        .map(|c| {
                            let j = (c / fmt.group_size as usize) as u32;
                            let f = |o: u32| f16::from_le_bytes([bytes[o as usize], bytes[o as usize + 1]]).to_f64();
                            let per_byte = 8 / fmt.key_bits as usize;
                            let code =
                                (bytes[kc + c / per_byte] as u32 >> ((c % per_byte) as u32 * fmt.key_bits)) & mask;
                            code as f64 * f(fmt.scale_at(false, j, slot)) + f(fmt.zero_at(false, j, slot))
                        })
                        .collect();
                    for r in 0..g {
                        let want: f64 = q64[r * d..(r + 1) * d].iter().zip(&khat).map(|(a, b)| a * b).sum();
                        let (a, b) =
                            (exact.s[r * CHUNK + slot as usize] as f64, int.s[r * CHUNK + slot as usize] as f64);
                        e32 += (a - want).powi(2);
                        e8 += (b - want).powi(2);
                        r2 += want * want;
                        worst = worst.max((b - want).abs());
                        n_all += 1;
                    }
                }
            }
        }
        let rms = (r2 / n_all as f64).sqrt();
        ((e32 / r2).sqrt(), (e8 / r2).sqrt(), worst / rms)
    }

    /// The integer key paths' added score error, stated and bounded (random keys with
    /// an outlier channel and a bias; the real SmolLM2 tile where the `eval` feature can
    /// read it). The int8 query has a per-(row, group) scale `a = max|q| / 127`; its
    /// rounding error is uniform in `+-a/2` per channel, so the score error is about
    /// `a / sqrt(12) * ||khat||`: measured 0.6-1.2% of the scores' norm on the real tile
    /// and 1.0-2.6% on random keys (whose scores are small next to `||q|| ||khat||`), the
    /// largest single logit error 2-7% of the logits' RMS. Bounds: 4e-2 and 0.15. Two
    /// int8 terms (`Int8x2`) cut the query's rounding 254-fold: bounds 4e-4 and 2e-3.
    /// The f32 path: 1e-5 (accumulation order only).
    #[test]
    fn int_key_scores_error_against_f64() {
        let check = |name: &str, config: crate::CacheConfig, hkv: usize, k: &[f32], q: &[f32], sm: f32| {
            for (terms, tol, tol_worst) in [(1, 4e-2, 0.15), (2, 4e-4, 2e-3)] {
                let (e32, e8, worst) = score_errors(config, hkv, k, q, sm, terms);
                eprintln!(
                    "{name}: score rel err f32 {e32:.2e}, int8 x{terms} {e8:.2e}, max |logit err| / logit RMS {worst:.2e}"
                );
                assert!(e32 < 1e-5, "{name}: f32 path {e32}");
                assert!(e8 < tol, "{name}: int8 x{terms} path {e8}");
                assert!(worst < tol_worst, "{name}: int8 x{terms} worst logit {worst}");
            }
        };
        for (d, config) in [
            (64, crate::CacheConfig::k2v2(64)),
            (128, crate::CacheConfig { group_size: 32, ..crate::CacheConfig::k4v2(128) }),
            (256, crate::CacheConfig::k2v2(256)),
            (256, crate::CacheConfig { group_size: 256, ..crate::CacheConfig::k4v2(256) }),
        ] {
            let (hkv, g, t) = (3, 3, 4 + 128 + 2 * 64 + 1);
            let mut k = values(t * hkv * d, 11);
            k.iter_mut().enumerate().for_each(|(i, x)| *x += if i % d == 7 { 6.0 } else { 0.5 });
            let q = values(hkv * g * d, 12);
            check(
                &format!("random d{d} k{} g{}", config.key_bits, config.group_size),
                config,
                hkv,
                &k,
                &q,
                1.0 / (d as f32).sqrt(),
            );
        }
        #[cfg(feature = "eval")]
        {
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            let files = [
                root.join("data/smollm2-alice-kv-l0-l5.safetensors"),
                root.join("../shared/data/smollm2-alice-kv.safetensors"),
            ];
            for file in files.iter().filter(|f| f.exists()) {
                let tile = crate::eval::Tile::load(file).unwrap();
                for l in &tile.layers {
                    let (hkv, hq, d) = (l.num_kv_heads, l.num_q_heads, l.head_dim);
                    let t = l.tokens.min(1024);
                    let q = &l.q[(t - 1) * hq * d..t * hq * d];
                    for config in [crate::CacheConfig::k2v2(d), crate::CacheConfig::k4v2(d)] {
                        let name = format!("tile layer {} k{}", l.layer, config.key_bits);
                        check(&name, config, hkv, &l.k[..t * hkv * d], q, tile.attn_scaling as f32);
                    }
                }
            }
        }
    }

    #[test]
    fn exp_neg_is_accurate() {
        for i in 0..=19_000 {
            let x = -(i as f32) * 0.0045;
            let (a, b) = (exp_neg(x) as f64, (x as f64).exp());
            assert!((a - b).abs() <= 3e-7 * b, "exp({x}) = {a}, want {b}");
        }
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(-100.0), 0.0);
        assert!((exp_shifted(20.0) / 485_165_195.4 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn unpack_order_is_a_permutation_within_groups() {
        for bits in [2, 4] {
            let mut seen = vec![false; 256];
            for c in 0..256 {
                let u = unpack_position(c, bits);
                assert!(!seen[u] && u / 32 == c / 32);
                seen[u] = true;
            }
            // unpack() puts channel c's code at unpack_position(c).
            let codes: Vec<u8> = (0..64).map(|c| (c % (1 << bits)) as u8).collect();
            let packed = reference::pack_codes(&codes, bits);
            let mut out = vec![0f32; 64];
            unpack(&packed, bits, &mut out);
            for (c, &code) in codes.iter().enumerate() {
                assert_eq!(out[unpack_position(c, bits)], code as f32);
            }
        }
    }

    #[test]
    fn default_splits_keep_threads_busy_and_splits_long() {
        assert_eq!(default_splits(100, 1, 1, 2), 1);
        assert_eq!(default_splits(32768, 8, 8, 2), 1);
        assert_eq!(default_splits(32768, 1, 1, 16), 64);
        assert_eq!(default_splits(4096, 1, 2, 4), 8);
        assert!(default_splits(1 << 20, 1, 1, 1) <= 64);
    }
}
