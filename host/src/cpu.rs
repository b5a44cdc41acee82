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

/// Query heads are processed in blocks of this many (register accumulators).
const HEAD_BLOCK: usize = 4;
/// Channels per accumulator (one AVX2 register of f32).
const LANES: usize = 8;
/// Largest key lookup table (floats) built per task: 2-bit keys score through it.
const MAX_LUT: usize = 1 << 17;


/// `out[h][t] = sum_{c in [c0, c1)} q[h][c] * rows[t][c]` for `h < gp`, `t < n`
/// (`out` is `[gp][CHUNK]`, `q` is `[gp][d]`, `rows` is `[n][d]`).
#[inline(always)]
fn dots(q: &[f32], gp: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize, out: &mut [f32]) {
    for t in 0..n {
        let row = &rows[t * d..(t + 1) * d];
        for h0 in (0..gp).step_by(HEAD_BLOCK) {
            let mut acc = [[0f32; LANES]; HEAD_BLOCK];
            for cb in (c0..c1).step_by(LANES) {
                let r: &[f32; LANES] = row[cb..cb + LANES].try_into().expect("LANES channels");
                for (hh, acc) in acc.iter_mut().enumerate() {
                    let qv: &[f32; LANES] = q[(h0 + hh) * d + cb..][..LANES].try_into().expect("LANES channels");
                    for l in 0..LANES {
                        acc[l] += qv[l] * r[l];
                    }
                }
            }
            for (hh, acc) in acc.iter().enumerate() {
                out[(h0 + hh) * CHUNK + t] = acc.iter().sum();
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

/// `o[h][c] += sum_t w[h][t] * rows[t][c]` for `h < gp`, `c in [c0, c1)`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn accumulate(o: &mut [f32], w: &[f32], gp: usize, d: usize, rows: &[f32], n: usize, c0: usize, c1: usize) {
    for cb in (c0..c1).step_by(LANES) {
        for h0 in (0..gp).step_by(HEAD_BLOCK) {
            let mut acc = [[0f32; LANES]; HEAD_BLOCK];
            for t in 0..n {
                let r: &[f32; LANES] = rows[t * d + cb..][..LANES].try_into().expect("LANES channels");
                for (hh, acc) in acc.iter_mut().enumerate() {
                    let wt = w[(h0 + hh) * CHUNK + t];
                    for l in 0..LANES {
                        acc[l] += wt * r[l];
                    }
                }
            }
            for (hh, acc) in acc.iter().enumerate() {
                let dst = &mut o[(h0 + hh) * d + cb..][..LANES];
                for l in 0..LANES {
                    dst[l] += acc[l];
                }
            }
        }
    }
}

/// Running online-softmax state of one KV head's query group, and its scratch.
pub(crate) struct HeadState {
    /// Query heads in the group, and that rounded up to a multiple of `HEAD_BLOCK`
    /// (padding heads have zero queries and zero weights).
    g: usize,
    gp: usize,
    d: usize,
    /// Rotated, scaled queries `[gp][d]`.
    q: Vec<f32>,
    /// `sum(q')` per quantization group: `[gp][groups]`.
    qsum: Vec<f32>,
    /// For 2-bit keys: `lut[i][b][h]` = score contribution of code byte `b` at byte
    /// position `i` for head `h` (`[d / 4][256][gp]`); empty otherwise.
    lut: Vec<f32>,
    /// Max logit per head.
    pub m: Vec<f32>,
    /// Sum of `exp(logit - m)` per head.
    pub l: Vec<f32>,
    /// Weighted value sum `[gp][d]` (stored value order).
    pub o: Vec<f32>,
    s: Vec<f32>,
    w: Vec<f32>,
    tmp: Vec<f32>,
    rows: Vec<f32>,
    par: Vec<f32>,
}

impl HeadState {
    /// `q` is the group's `[g][d]` rotated queries with the softmax scale folded in;
    /// `key_lut` builds the lookup table that scores 2-bit keys.
    pub(crate) fn new(fmt: &Format, q: &[f32], g: usize, key_lut: bool) -> Self {
        let d = fmt.head_dim as usize;
        let gs = fmt.group_size as usize;
        let groups = d / gs;
        let gp = g.div_ceil(HEAD_BLOCK) * HEAD_BLOCK;
        let mut qp = vec![0f32; gp * d];
        qp[..g * d].copy_from_slice(q);
        let qsum = qp.chunks_exact(gs).map(|c| c.iter().sum()).collect();
        let mut lut = Vec::new();
        if key_lut && fmt.key_bits == 2 && d / 4 * 256 * gp <= MAX_LUT {
            lut = vec![0f32; d / 4 * 256 * gp];
            for i in 0..d / 4 {
                for b in 0..256 {
                    for h in 0..g {
                        let qh = &qp[h * d + 4 * i..h * d + 4 * i + 4];
                        lut[(i * 256 + b) * gp + h] = (0..4).map(|j| qh[j] * ((b >> (2 * j)) & 3) as f32).sum();
                    }
                }
            }
        }
        Self {
            g,
            gp,
            d,
            q: qp,
            qsum,
            lut,
            m: vec![f32::NEG_INFINITY; gp],
            l: vec![0.0; gp],
            o: vec![0.0; gp * d],
            s: vec![0.0; gp * CHUNK],
            w: vec![0.0; gp * CHUNK],
            tmp: vec![0.0; gp * CHUNK],
            rows: vec![0.0; CHUNK * d],
            par: vec![0.0; CHUNK * groups * 2],
        }
    }

    /// Scores a chunk of quantized keys into `s`.
    #[inline(always)]
    fn score_quant(&mut self, fmt: &Format, page: &[u8], slot: usize, n: usize) {
        let (gp, d) = (self.gp, self.d);
        let gs = fmt.group_size as usize;
        let groups = d / gs;
        let cb = fmt.key_code_bytes() as usize;
        let codes = &page[fmt.key_codes_at(slot as u32) as usize..][..n * cb];
        let pb = &page[fmt.key_params_at(slot as u32) as usize..][..n * groups * 4];
        let par = &mut self.par[..n * groups * 2];
        bytemuck::cast_slice::<u8, f16>(pb).convert_to_f32_slice(par);
        if !self.lut.is_empty() {
            let per_group = gs / 4;
            for t in 0..n {
                let code = &codes[t * cb..(t + 1) * cb];
                for h0 in (0..gp).step_by(HEAD_BLOCK) {
                    let mut total = [0f32; HEAD_BLOCK];
                    for j in 0..groups {
                        // Four independent chains of adds, so latency does not serialize.
                        let mut acc = [[0f32; HEAD_BLOCK]; 4];
                        for (i, &b) in code[j * per_group..(j + 1) * per_group].iter().enumerate() {
                            let at = ((j * per_group + i) * 256 + b as usize) * gp + h0;
                            let e: &[f32; HEAD_BLOCK] = self.lut[at..at + HEAD_BLOCK].try_into().expect("head block");
                            for hh in 0..HEAD_BLOCK {
                                acc[i % 4][hh] += e[hh];
                            }
                        }
                        let (scale, zero) = (par[(t * groups + j) * 2], par[(t * groups + j) * 2 + 1]);
                        for hh in 0..HEAD_BLOCK {
                            let dot = (acc[0][hh] + acc[1][hh]) + (acc[2][hh] + acc[3][hh]);
                            total[hh] += scale * dot + zero * self.qsum[(h0 + hh) * groups + j];
                        }
                    }
                    for hh in 0..HEAD_BLOCK {
                        self.s[(h0 + hh) * CHUNK + t] = total[hh];
                    }
                }
            }
            return;
        }
        let rows = &mut self.rows[..n * d];
        for (t, r) in rows.chunks_exact_mut(d).enumerate() {
            unpack(&codes[t * cb..(t + 1) * cb], fmt.key_bits, r);
        }
        for h in 0..gp {
            self.s[h * CHUNK..h * CHUNK + n].fill(0.0);
        }
        for j in 0..groups {
            dots(&self.q, gp, d, &self.rows, n, j * gs, (j + 1) * gs, &mut self.tmp);
            for h in 0..gp {
                for t in 0..n {
                    let (scale, zero) = (self.par[(t * groups + j) * 2], self.par[(t * groups + j) * 2 + 1]);
                    self.s[h * CHUNK + t] += scale * self.tmp[h * CHUNK + t] + zero * self.qsum[h * groups + j];
                }
            }
        }
    }

    /// Turns the scores of `n` tokens into probabilities relative to the updated max and
    /// rescales the running sums.
    #[inline(always)]
    fn softmax(&mut self, n: usize) {
        let d = self.d;
        for h in 0..self.g {
            let s = &mut self.s[h * CHUNK..h * CHUNK + n];
            let local = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let m = self.m[h].max(local);
            let c = exp_neg(self.m[h] - m);
            for x in s.iter_mut() {
                *x = exp_neg(*x - m);
            }
            self.l[h] = self.l[h] * c + sum(s);
            self.m[h] = m;
            if c != 1.0 {
                self.o[h * d..(h + 1) * d].iter_mut().for_each(|o| *o *= c);
            }
        }
    }

    /// Scores the chunk, updates the softmax state and accumulates its values.
    #[inline(always)]
    pub(crate) fn step(&mut self, fmt: &Format, chunk: Chunk<'_>) {
        let (g, gp, d) = (self.g, self.gp, self.d);
        match chunk {
            Chunk::F16 { k, v } => {
                let n = k.len() / d;
                k.convert_to_f32_slice(&mut self.rows[..n * d]);
                dots(&self.q, gp, d, &self.rows, n, 0, d, &mut self.s);
                self.softmax(n);
                v.convert_to_f32_slice(&mut self.rows[..n * d]);
                for h in 0..g {
                    self.w[h * CHUNK..h * CHUNK + n].copy_from_slice(&self.s[h * CHUNK..h * CHUNK + n]);
                }
                accumulate(&mut self.o, &self.w, gp, d, &self.rows, n, 0, d);
            }
            Chunk::Quant { page, slot, n } => {
                let (slot, n) = (slot as usize, n as usize);
                self.score_quant(fmt, page, slot, n);
                self.softmax(n);
                let gs = fmt.group_size as usize;
                let groups = d / gs;
                let cb = fmt.value_code_bytes() as usize;
                let codes = &page[fmt.value_codes_at(slot as u32) as usize..][..n * cb];
                let pb = &page[fmt.value_params_at(slot as u32) as usize..][..n * groups * 4];
                bytemuck::cast_slice::<u8, f16>(pb).convert_to_f32_slice(&mut self.par[..n * groups * 2]);
                for (t, r) in self.rows[..n * d].chunks_exact_mut(d).enumerate() {
                    unpack(&codes[t * cb..(t + 1) * cb], fmt.value_bits, r);
                }
                for j in 0..groups {
                    for h in 0..g {
                        for t in 0..n {
                            let p = self.s[h * CHUNK + t];
                            self.w[h * CHUNK + t] = p * self.par[(t * groups + j) * 2];
                            self.tmp[t] = p * self.par[(t * groups + j) * 2 + 1];
                        }
                        let bias = sum(&self.tmp[..n]);
                        self.o[h * d + j * gs..h * d + (j + 1) * gs].iter_mut().for_each(|o| *o += bias);
                    }
                    accumulate(&mut self.o, &self.w, gp, d, &self.rows, n, j * gs, (j + 1) * gs);
                }
            }
        }
    }
}

/// Runs every chunk of `chunks` through `st`.
#[inline(always)]
fn run_chunks<'a>(st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    for c in chunks {
        st.step(fmt, c);
    }
}

/// [`run_chunks`] compiled for AVX2 and FMA.
///
/// # Safety
/// The processor must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_chunks_avx2<'a>(st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    run_chunks(st, fmt, chunks)
}

/// [`run_chunks`] in the widest instruction set this processor has.
fn run_chunks_best<'a>(st: &mut HeadState, fmt: &Format, chunks: impl Iterator<Item = Chunk<'a>>) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA support was just checked.
        return unsafe { run_chunks_avx2(st, fmt, chunks) };
    }
    run_chunks(st, fmt, chunks)
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
            let mut st = HeadState::new(&fmt, &group_queries(p, calib, q, s, h), g, true);
            run_chunks_best(&mut st, &fmt, chunks(&fmt, hkv, pool, &seqs[s], h, b, e));
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
            let qs: Vec<f32> = q[at..at + g * d].iter().map(|x| x / (d as f32).sqrt()).collect();
            let mut st = HeadState::new(&fmt, &qs, g, false);
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
