//! The fast CPU backend: the same bytes as [`crate::reference`], computed in f32 with
//! threads (rayon) over sequences, KV heads and splits, and inner loops written so the
//! compiler vectorizes them (lane-parallel accumulators, lookup tables that unpack a
//! byte of codes at once). On x86-64 with AVX2 the hot loops are compiled a second time
//! for AVX2 and picked at run time.
//!
//! Scores never dequantize a key: for a group with scale `s` and zero `z`,
//! `q'.khat = s * (q'.codes) + z * sum(q')`, and `sum(q')` per group is computed once
//! per query.

use crate::config::LayerCalibration;
use crate::reference::SeqRef;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use rotkv_kernels::layout::{Format, Place};
use rotkv_kernels::params::{DecodeParams, FLAG_ROTATE_KEYS, FLAG_ROTATE_VALUES};

/// Tokens scored per softmax step (one max and one rescale per chunk).
const CHUNK: usize = 64;

/// In-place orthonormal FWHT in f32 (same definition as [`crate::reference::fwht`]).
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
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

/// Rotates `x` (in place through `tmp`) into stored order: `out[j] = (x H)[perm[j]]`.
fn rotate_into(x: &mut [f32], hadamard: bool, perm: &[u16], out: &mut [f32]) {
    if hadamard {
        fwht(x);
    }
    for (o, &p) in out.iter_mut().zip(perm) {
        *o = x[p as usize];
    }
}

/// Quantizes one stored f16 row into packed codes and `(scale, zero)` pairs, bit for bit
/// as [`crate::reference::quantize_row`] does for the same row (scale, zero and the
/// code division are computed in f64, as there).
fn quantize_row(row: &[f16], bits: u32, group: usize, codes: &mut [u8], params: &mut [u8]) {
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
        let scale = f16::from_f64((hi as f64 - lo as f64) / levels);
        let zero = f16::from_f64(lo as f64);
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

/// Appends new tokens (`[token][kv_head][head_dim]` f32) to a sequence of `len` tokens:
/// rotates every row once, quantizes the pages that fill (from old window rows or new
/// rows), then writes the new sink and window rows. Produces the bytes of
/// [`crate::reference::append`].
#[allow(clippy::too_many_arguments)]
pub fn append(
    fmt: &Format,
    flags: u32,
    calib: &LayerCalibration,
    num_kv_heads: usize,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    len: usize,
    k: &[f32],
    v: &[f32],
) {
    let d = fmt.head_dim as usize;
    let hkv = num_kv_heads;
    let n = k.len() / (hkv * d);
    // Stored rows of the new tokens: [token][kv_head][K|V][d].
    let mut staged = vec![f16::ZERO; n * hkv * 2 * d];
    staged.par_chunks_mut(2 * d).enumerate().for_each_init(
        || (vec![0f32; d], vec![0f32; d]),
        |(x, y), (i, dst)| {
            let h = i % hkv;
            let (mean, kperm, vperm) = calib.head(h, d);
            let src = i * d;
            for (x, (a, m)) in x.iter_mut().zip(k[src..src + d].iter().zip(mean)) {
                *x = a - m;
            }
            rotate_into(x, flags & FLAG_ROTATE_KEYS != 0, kperm, y);
            dst[..d].convert_from_f32_slice(y);
            x.copy_from_slice(&v[src..src + d]);
            rotate_into(x, flags & FLAG_ROTATE_VALUES != 0, vperm, y);
            dst[d..].convert_from_f32_slice(y);
        },
    );
    let new_len = (len + n) as u32;
    let row_of = |pos: u32, h: u32, value: bool| -> &[f16] {
        if (pos as usize) < len {
            let (Place::Sink { index: row } | Place::Window { slot: row }) = fmt.place(pos, len as u32) else {
                unreachable!("an unflushed old token is in the sinks or the window")
            };
            let at = fmt.side_row_at(h, value, row);
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
            for slot in 0..fmt.page_size {
                let pos = fmt.sinks + page * fmt.page_size + slot;
                for value in [false, true] {
                    let (bits, c, cb, pa) = if value {
                        (fmt.value_bits, fmt.value_codes_at(slot), fmt.value_code_bytes(), fmt.value_params_at(slot))
                    } else {
                        (fmt.key_bits, fmt.key_codes_at(slot), fmt.key_code_bytes(), fmt.key_params_at(slot))
                    };
                    let (c, pa) = (c as usize, pa as usize);
                    let (codes, rest) = bytes[c..].split_at_mut(cb as usize);
                    let params_off = pa - c - cb as usize;
                    let params = &mut rest[params_off..params_off + fmt.param_bytes() as usize];
                    quantize_row(row_of(pos, h, value), bits, g, codes, params);
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
    for pos in len as u32..new_len {
        let row = match fmt.place(pos, new_len) {
            Place::Sink { index } => index,
            Place::Window { slot } => slot,
            Place::Page { .. } => continue,
        };
        for h in 0..hkv as u32 {
            for value in [false, true] {
                let at = fmt.side_row_at(h, value, row);
                let src = (((pos as usize - len) * hkv + h as usize) * 2 + value as usize) * d;
                side[at..at + d].copy_from_slice(&staged[src..src + d]);
            }
        }
    }
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

/// `[byte] -> the 4 two-bit codes it holds, as f32`.
static LUT2: [[f32; 4]; 256] = {
    let mut t = [[0f32; 4]; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 4 {
            t[b][j] = ((b >> (2 * j)) & 3) as f32;
            j += 1;
        }
        b += 1;
    }
    t
};

/// `[byte] -> the 2 four-bit codes it holds, as f32`.
static LUT4: [[f32; 2]; 256] = {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b][0] = (b & 15) as f32;
        t[b][1] = (b >> 4) as f32;
        b += 1;
    }
    t
};

#[inline(always)]
fn unpack(bytes: &[u8], bits: u32, out: &mut [f32]) {
    if bits == 2 {
        for (o, &b) in out.chunks_exact_mut(4).zip(bytes) {
            o.copy_from_slice(&LUT2[b as usize]);
        }
    } else {
        for (o, &b) in out.chunks_exact_mut(2).zip(bytes) {
            o.copy_from_slice(&LUT4[b as usize]);
        }
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = 0.0;
    for a in acc {
        s += a;
    }
    s
}

/// `exp(x)` for `x <= 0` in f32, branch-free so loops over it vectorize: Cody-Waite
/// range reduction and a degree-6 polynomial (relative error below 2e-7 on
/// `[-87, 0]`); returns 0 below -87 (and for `-inf`).
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    let x = x.max(-87.0);
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0 + r * (0.5 + r * (0.166_666_67 + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    let y = p * scale;
    if x <= -87.0 { 0.0 } else { y }
}

/// One block of consecutive tokens of one KV head.
#[derive(Clone, Copy)]
pub(crate) enum Chunk<'a> {
    /// `n` f16 key rows and `n` f16 value rows, `[n][head_dim]` each, stored order.
    F16 { k: &'a [f16], v: &'a [f16] },
    /// Slots `[slot, slot + n)` of a head-page.
    Quant { page: &'a [u8], slot: u32, n: u32 },
}

/// Running online-softmax state of one KV head's query group.
pub(crate) struct HeadState {
    g: usize,
    d: usize,
    /// Rotated, scaled queries `[g][d]`.
    q: Vec<f32>,
    /// Per query head and quantization group, `sum(q')` over the group's channels.
    qsum: Vec<f32>,
    /// Partial results: max logit, sum of exp, weighted value sum `[g][d]`.
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub o: Vec<f32>,
    scores: Vec<f32>,
    krows: Vec<f32>,
    codes: Vec<f32>,
}

impl HeadState {
    /// `q` is the group's `[g][d]` rotated queries with the softmax scale folded in.
    pub(crate) fn new(q: Vec<f32>, g: usize, d: usize, group_size: usize) -> Self {
        let qsum = q.chunks_exact(group_size).map(|c| c.iter().sum()).collect();
        Self {
            g,
            d,
            q,
            qsum,
            m: vec![f32::NEG_INFINITY; g],
            l: vec![0.0; g],
            o: vec![0.0; g * d],
            scores: vec![0.0; g * CHUNK],
            krows: vec![0.0; CHUNK * d],
            codes: vec![0.0; d],
        }
    }

    /// Scores the chunk, updates the softmax state and accumulates its values.
    #[inline(always)]
    pub(crate) fn step(&mut self, fmt: &Format, chunk: Chunk<'_>) {
        let (g, d) = (self.g, self.d);
        let gs = fmt.group_size as usize;
        let n = match chunk {
            Chunk::F16 { k, .. } => k.len() / d,
            Chunk::Quant { n, .. } => n as usize,
        };
        debug_assert!(n <= CHUNK);
        // Scores.
        match chunk {
            Chunk::F16 { k, .. } => {
                k.convert_to_f32_slice(&mut self.krows[..n * d]);
                for t in 0..n {
                    let row = &self.krows[t * d..(t + 1) * d];
                    for h in 0..g {
                        self.scores[h * CHUNK + t] = dot(&self.q[h * d..(h + 1) * d], row);
                    }
                }
            }
            Chunk::Quant { page, slot, .. } => {
                let cb = fmt.key_code_bytes() as usize;
                let pbytes = fmt.param_bytes() as usize;
                for t in 0..n {
                    let s = slot as usize + t;
                    let c0 = fmt.key_codes_at(0) as usize + s * cb;
                    unpack(&page[c0..c0 + cb], fmt.key_bits, &mut self.codes);
                    let p0 = fmt.key_params_at(0) as usize + s * pbytes;
                    let params = &page[p0..p0 + pbytes];
                    for h in 0..g {
                        let qh = &self.q[h * d..(h + 1) * d];
                        let mut acc = 0.0;
                        for (j, pr) in params.chunks_exact(4).enumerate() {
                            let scale = f16::from_le_bytes([pr[0], pr[1]]).to_f32();
                            let zero = f16::from_le_bytes([pr[2], pr[3]]).to_f32();
                            let r = j * gs..(j + 1) * gs;
                            acc += scale * dot(&qh[r.clone()], &self.codes[r]) + zero * self.qsum[h * (d / gs) + j];
                        }
                        self.scores[h * CHUNK + t] = acc;
                    }
                }
            }
        }
        // Online softmax: scores become probabilities relative to the new max.
        for h in 0..g {
            let s = &mut self.scores[h * CHUNK..h * CHUNK + n];
            let local = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let m = self.m[h].max(local);
            let c = exp_neg(self.m[h] - m);
            let mut sum = 0.0;
            for x in s.iter_mut() {
                *x = exp_neg(*x - m);
                sum += *x;
            }
            self.l[h] = self.l[h] * c + sum;
            self.m[h] = m;
            if c != 1.0 {
                self.o[h * d..(h + 1) * d].iter_mut().for_each(|o| *o *= c);
            }
        }
        // Values.
        match chunk {
            Chunk::F16 { v, .. } => {
                v.convert_to_f32_slice(&mut self.krows[..n * d]);
                for t in 0..n {
                    let row = &self.krows[t * d..(t + 1) * d];
                    for h in 0..g {
                        let p = self.scores[h * CHUNK + t];
                        for (o, x) in self.o[h * d..(h + 1) * d].iter_mut().zip(row) {
                            *o += p * x;
                        }
                    }
                }
            }
            Chunk::Quant { page, slot, .. } => {
                let cb = fmt.value_code_bytes() as usize;
                let pbytes = fmt.param_bytes() as usize;
                for t in 0..n {
                    let s = slot as usize + t;
                    let c0 = fmt.value_codes_at(0) as usize + s * cb;
                    unpack(&page[c0..c0 + cb], fmt.value_bits, &mut self.codes);
                    let p0 = fmt.value_params_at(0) as usize + s * pbytes;
                    let params = &page[p0..p0 + pbytes];
                    for h in 0..g {
                        let p = self.scores[h * CHUNK + t];
                        let o = &mut self.o[h * d..(h + 1) * d];
                        for (j, pr) in params.chunks_exact(4).enumerate() {
                            let w = p * f16::from_le_bytes([pr[0], pr[1]]).to_f32();
                            let b = p * f16::from_le_bytes([pr[2], pr[3]]).to_f32();
                            let r = j * gs..(j + 1) * gs;
                            for (o, c) in o[r.clone()].iter_mut().zip(&self.codes[r]) {
                                *o += w * c + b;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Runs `f` on `state`, compiled for AVX2 when the processor has it.
#[inline(always)]
pub(crate) fn with_simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the processor was just checked to support AVX2 and FMA, the only
            // requirement of calling a function compiled with those target features.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// The chunks of positions `[begin, end)` of a sequence, in position order: sink rows,
/// then page slots, then window rows, none crossing a page, the end of the sinks or
/// the wrap of the window ring, none longer than 64 tokens.
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
                let limit = if pos < fmt.sinks { fmt.sinks } else { fmt.side_rows() };
                let n = (end - pos).min(limit - row).min(CHUNK as u32);
                let k = fmt.side_row_at(h, false, row);
                let v = fmt.side_row_at(h, true, row);
                let c = n as usize * d;
                (Chunk::F16 { k: &seq.side[k..k + c], v: &seq.side[v..v + c] }, n)
            }
            Place::Page { page, slot } => {
                let n = (end - pos).min(fmt.page_size - slot).min(CHUNK as u32);
                let at = fmt.page_offset(seq.block_table[page as usize], h, num_kv_heads as u32);
                let page = &pool[at..at + fmt.page_bytes() as usize];
                (Chunk::Quant { page, slot, n }, n)
            }
        };
        pos += n;
        Some(chunk)
    })
}

/// Rotated queries of one KV head's group, `[g][d]`, with the softmax scale folded in.
fn group_queries(p: &DecodeParams, calib: &LayerCalibration, q: &[f32], seq: usize, kv_head: usize) -> Vec<f32> {
    let d = p.format.head_dim as usize;
    let g = (p.num_q_heads / p.num_kv_heads) as usize;
    let (_, kperm, _) = calib.head(kv_head, d);
    let mut out = vec![0f32; g * d];
    let mut x = vec![0f32; d];
    for (i, o) in out.chunks_exact_mut(d).enumerate() {
        let at = seq * p.q_seq_stride as usize + (kv_head * g + i) * d;
        x.iter_mut().zip(&q[at..at + d]).for_each(|(x, q)| *x = q * p.sm_scale);
        rotate_into(&mut x, p.flags & FLAG_ROTATE_KEYS != 0, kperm, o);
    }
    out
}

/// Decode attention for one query token per sequence (see [`crate::reference::decode`]
/// for the definition): tasks over `(sequence, KV head, split)` in parallel, then the
/// log-sum-exp merge and the inverse value rotation per query head.
pub fn decode(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
    out: &mut [f32],
) {
    let fmt = p.format;
    let d = fmt.head_dim as usize;
    let hkv = p.num_kv_heads as usize;
    let g = (p.num_q_heads / p.num_kv_heads) as usize;
    let ns = p.num_splits as usize;
    let tasks: Vec<(usize, usize, u32)> =
        (0..seqs.len()).flat_map(|s| (0..hkv).flat_map(move |h| (0..ns as u32).map(move |i| (s, h, i)))).collect();
    let partials: Vec<Option<HeadState>> = tasks
        .par_iter()
        .map(|&(s, h, split)| {
            let (b, e) = p.split_range(split, seqs[s].len as u32);
            if b >= e {
                return None;
            }
            let mut st = HeadState::new(group_queries(p, calib, q, s, h), g, d, fmt.group_size as usize);
            with_simd(|| {
                for c in chunks(&fmt, hkv, pool, &seqs[s], h, b, e) {
                    st.step(&fmt, c);
                }
            });
            Some(st)
        })
        .collect();
    out.par_chunks_mut(p.q_seq_stride as usize).zip(partials.par_chunks(hkv * ns)).enumerate().for_each(
        |(_, (out, parts))| {
            let mut x = vec![0f32; d];
            for qh in 0..p.num_q_heads as usize {
                let (h, i) = (qh / g, qh % g);
                merge_into(&parts[h * ns..(h + 1) * ns], i, d, &mut x);
                let (_, _, vperm) = calib.head(h, d);
                let o = &mut out[qh * d..(qh + 1) * d];
                for (j, &pj) in vperm.iter().enumerate() {
                    o[pj as usize] = x[j];
                }
                if p.flags & FLAG_ROTATE_VALUES != 0 {
                    fwht(o);
                }
            }
        },
    );
}

/// Log-sum-exp merge of query head `i` of the partials of one KV head (empty splits are
/// `None` and contribute nothing).
fn merge_into(parts: &[Option<HeadState>], i: usize, d: usize, x: &mut [f32]) {
    let m = parts.iter().flatten().map(|s| s.m[i]).fold(f32::NEG_INFINITY, f32::max);
    x.fill(0.0);
    let mut l = 0.0;
    for s in parts.iter().flatten() {
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
            let qs = q[at..at + g * d].iter().map(|x| x / (d as f32).sqrt()).collect();
            let mut st = HeadState::new(qs, g, d, d);
            let base = (s * num_kv_heads + h) * len * d;
            with_simd(|| {
                let mut t = b;
                while t < e {
                    let n = (e - t).min(CHUNK);
                    let r = base + t * d..base + (t + n) * d;
                    st.step(&fmt, Chunk::F16 { k: &k[r.clone()], v: &v[r] });
                    t += n;
                }
            });
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
