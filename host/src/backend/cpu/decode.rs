//! Decode: the per-head softmax state over chunks, the chunk walk, the split-K decode
//! and its merge, and the f16 baseline.

use super::*;

/// The split count the CPU backend uses when the caller does not choose: enough
/// `(sequence, KV head, split)` tasks to keep every thread busy, never splits shorter
/// than 512 tokens, at most 64.
pub fn default_splits(max_len: usize, num_seqs: usize, num_kv_heads: usize, threads: usize) -> u32 {
    let tasks = (num_seqs * num_kv_heads).max(1);
    let want = (4 * threads).div_ceil(tasks);
    let cap = max_len.div_ceil(512).max(1);
    want.clamp(1, cap.min(64)) as u32
}

/// One block of consecutive tokens of one KV head.
#[derive(Clone, Copy)]
pub(crate) enum Chunk<'a> {
    /// `n` f16 key rows and `n` f16 value rows, `[n][head_dim]` each, stored order.
    F16 { k: &'a [f16], v: &'a [f16] },
    /// Slots `[slot, slot + n)` of a head-page.
    Quant { page: &'a [u8], slot: u32, n: u32 },
}

/// Sum of `x` with `LANES` independent accumulators (vectorizes; f32 addition order
/// differs from a serial sum by rounding only).
#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
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
pub(super) fn max(x: &[f32]) -> f32 {
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
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
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
pub(super) const RESCALE_THRESHOLD: f32 = 20.0;

/// Scratch of [`HeadState`] for variance-normalized pages.
pub(super) struct NormScratch {
    key_scales: Vec<f32>,
    value_scales: Vec<f32>,
    qk: Vec<f32>,
    qt: Vec<f32>,
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
    /// The same in stored order, channel `c` scaled by `2^-code_shift(c)`
    /// ([`shifted_query`], for [`Kernels::key_dots`]).
    qt: Vec<f32>,
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
    /// The smallest causal limit: chunks ending at or before it (and starting at or past
    /// `mask_to`) need no mask.
    mask_from: u32,
    /// The largest sliding-window start (0 without a window).
    mask_to: u32,
    /// Per row, the end (exclusive) of the positions it attends to.
    limits: Vec<u32>,
    /// Per row, the first position it attends to (empty without a window).
    starts: Vec<u32>,
    pub(super) s: Vec<f32>,
    w: Vec<f32>,
    /// Partial key scores per group, `[groups][g][CHUNK]`.
    tmp: Vec<f32>,
    /// A chunk's key codes transposed for [`Kernels::key_dots`].
    codes_t: Vec<u32>,
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
        let qt = q.iter().enumerate().map(|(i, &x)| shifted_query(x, i % d, fmt.key_bits)).collect();
        Self {
            g,
            d,
            q: q.to_vec(),
            qk,
            qt,
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
                qt: vec![0.0; g * d],
                qsum: vec![0.0; g * groups],
                ov: vec![0.0; g * d],
                zsum: vec![0.0; g * groups],
            }),
            int_q: None,
            pos: 0,
            mask_from: u32::MAX,
            mask_to: 0,
            limits: Vec::new(),
            starts: Vec::new(),
            s: vec![0.0; g * CHUNK],
            w: vec![0.0; g * CHUNK],
            tmp: vec![0.0; groups * g * CHUNK],
            codes_t: vec![0; fmt.key_code_bytes() as usize / 4 * CODES_T_COLS],
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

    /// Gives every row a sliding-window start as well: row `r` only sees positions at or
    /// past `starts[r]` (its scores before it are masked).
    pub(crate) fn window(mut self, starts: Vec<u32>) -> Self {
        debug_assert_eq!(starts.len(), self.g);
        self.mask_to = starts.iter().copied().max().unwrap_or(0);
        self.starts = starts;
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
    /// causal limit or before its sliding-window start (only chunks that reach past the
    /// smallest limit or start before the largest start have any).
    #[inline(always)]
    fn mask(&mut self, n: usize) {
        if self.pos + n as u32 <= self.mask_from && self.pos >= self.mask_to {
            return;
        }
        for (h, &limit) in self.limits.iter().enumerate() {
            let keep = limit.saturating_sub(self.pos).min(n as u32) as usize;
            self.s[h * CHUNK + keep..h * CHUNK + n].fill(f32::NEG_INFINITY);
        }
        for (h, &start) in self.starts.iter().enumerate() {
            let drop = start.saturating_sub(self.pos).min(n as u32) as usize;
            self.s[h * CHUNK..h * CHUNK + drop].fill(f32::NEG_INFINITY);
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
    fn softmax<K: Kernels>(&mut self, kern: K, n: usize) {
        self.rescale(n);
        for h in 0..self.g {
            let m = self.m[h];
            let s = &mut self.s[h * CHUNK..h * CHUNK + n];
            if m == f32::NEG_INFINITY {
                // Every score of the row so far is masked: no weight (not -inf - -inf).
                s.fill(0.0);
                continue;
            }
            self.l[h] += kern.exp_sum(s, m);
        }
    }

    /// The first half of [`HeadState::softmax`]: moves each row's reference max `m` where
    /// a score of the chunk exceeds it by the threshold, rescaling the running sums.
    #[inline(always)]
    fn rescale(&mut self, n: usize) {
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
    }

    /// Raw scores `s[h][t] = q'[h] . khat[t]` of slots `[slot, slot + n)` of a page (no
    /// mask, no softmax), by the f32 or the integer path; the lines of `pf` are prefetched
    /// into L2 (by the kernel, spread out, where it does that).
    #[inline(always)]
    pub(super) fn key_scores<K: Kernels>(
        &mut self,
        kern: K,
        fmt: &Format,
        page: &[u8],
        slot: u32,
        n: usize,
        pf: &[u8],
    ) {
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
                    let x = self.q[h * d + c] * nm.key_scales[c];
                    nm.qk[h * d + unpack_position(c, fmt.key_bits)] = x;
                    nm.qt[h * d + c] = shifted_query(x, c, fmt.key_bits);
                }
                for j in 0..groups {
                    nm.qsum[h * groups + j] =
                        (j * gs..(j + 1) * gs).map(|c| self.q[h * d + c] * nm.key_scales[c]).sum();
                }
            }
        }
        self.load_params(kern, fmt, page, false, slot, n);
        let (qk, qt, qsum) = match &self.norm {
            Some(nm) => (&nm.qk, &nm.qt, &nm.qsum),
            None => (&self.qk, &self.qt, &self.qsum),
        };
        let kc = fmt.key_codes_at(slot) as usize;
        let kcodes = &page[kc..kc + n * fmt.key_code_bytes() as usize];
        if self.int_q.is_none()
            && kern.key_scores(
                qt,
                g,
                d,
                kcodes,
                fmt.key_bits,
                gs,
                n,
                &self.scales,
                &self.zeros,
                qsum,
                &mut self.s,
                &mut self.codes_t,
                pf,
            )
        {
            return;
        }
        kern.prefetch(pf);
        if self.int_q.is_none() {
            // Every group's partial scores at once, `tmp` as `[groups][g][CHUNK]`.
            kern.key_dots(qk, qt, g, d, kcodes, fmt.key_bits, gs, n, &mut self.tmp, &mut self.rows, &mut self.codes_t);
        }
        for j in 0..groups {
            // The integer path scores one group at a time into `tmp[0]`.
            let at = if let Some(iq) = &self.int_q {
                kern.dots_int(iq, g, j, kcodes, fmt.key_code_bytes() as usize, n, &mut self.tmp);
                0
            } else {
                j * g * CHUNK
            };
            let (scales, zeros) = (&self.scales[j * CHUNK..j * CHUNK + n], &self.zeros[j * CHUNK..j * CHUNK + n]);
            for h in 0..g {
                let qs = qsum[h * groups + j];
                let s = &mut self.s[h * CHUNK..h * CHUNK + n];
                let tmp = &self.tmp[at + h * CHUNK..at + h * CHUNK + n];
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
    ///
    /// `next` is the next chunk's head-page (or empty), prefetched into L2 in three
    /// parts spread over this chunk's work: issued at once, its 72 lines (head_dim 128)
    /// filled the miss buffers and the prefetches stalled; into L1, they took more time
    /// than they saved (in-process A/B, 2026-12-03: L2 instead of L1 decoded 11-17%
    /// faster at head_dim 128).
    #[inline(always)]
    pub(crate) fn step<K: Kernels>(&mut self, kern: K, fmt: &Format, chunk: Chunk<'_>, next: &[u8]) {
        let (g, d) = (self.g, self.d);
        // The next chunk in the same page (pages of 128 or 256 tokens, or a page split at
        // a protected position) has nothing to prefetch.
        let next = match chunk {
            Chunk::Quant { page, .. } if std::ptr::eq(page.as_ptr(), next.as_ptr()) => &[][..],
            _ => next,
        };
        // Three line-aligned parts of `next`.
        let third = next.len().div_ceil(3).next_multiple_of(64);
        let part = |i: usize| &next[(i * third).min(next.len())..((i + 1) * third).min(next.len())];
        match chunk {
            Chunk::F16 { k, v } => {
                kern.prefetch(next);
                let n = k.len() / d;
                kern.to_f32(k, &mut self.rows[..n * d]);
                kern.dots(&self.q, g, d, &self.rows, n, 0, d, &mut self.s);
                self.mask(n);
                self.softmax(kern, n);
                kern.to_f32(v, &mut self.rows[..n * d]);
                kern.accumulate(&mut self.o, &self.s, g, d, &self.rows, n, 0, d);
                self.pos += n as u32;
            }
            Chunk::Quant { page, slot, n } => {
                let n = n as usize;
                let gs = fmt.group_size as usize;
                let groups = d / gs;
                // The first third of the next page: prefetched by the key kernel, a line per
                // code position, where it does that (in-process A/B, 2026-12-03: 1-8% faster
                // at head_dim 64, -4% to +13% at 128), else at once.
                if kern.spreads_prefetch() {
                    self.key_scores(kern, fmt, page, slot, n, part(0));
                } else {
                    kern.prefetch(part(0));
                    self.key_scores(kern, fmt, page, slot, n, &[]);
                }
                // With one value group, the weights are scaled in the softmax's pass.
                let fused = groups == 1;
                // The rest of the next page is prefetched by the value kernel, a line per
                // token, where it does that (in-process A/B, 2026-12-03, 512-bit kernels:
                // 1-5% faster than two bursts; the bursts waited for free miss buffers).
                let spread = fused && kern.spreads_prefetch();
                if !spread {
                    kern.prefetch(part(1));
                }
                self.mask(n);
                if fused {
                    self.rescale(n);
                } else {
                    self.softmax(kern, n);
                }
                if !spread {
                    kern.prefetch(part(2));
                }
                // The next page's scales and zeros (and channel scales), read first, into L1.
                if let Some(params) = next.get(fmt.scale_at(false, 0, 0) as usize..) {
                    kern.prefetch_l1(params);
                }
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
                if fused {
                    // One group: `zsum` is `[g]`.
                    for (h, zs) in zsum.iter_mut().enumerate().take(g) {
                        let m = self.m[h];
                        let (s, w) = (&mut self.s[h * CHUNK..h * CHUNK + n], &mut self.w[h * CHUNK..h * CHUNK + n]);
                        if m == f32::NEG_INFINITY {
                            // Every score of the row so far is masked: no weight.
                            w.fill(0.0);
                            continue;
                        }
                        let (l, z) = kern.exp_weights(s, m, &self.scales[..n], &self.zeros[..n], w);
                        self.l[h] += l;
                        *zs += z;
                    }
                    let pf = if spread { &next[third.min(next.len())..] } else { &[][..] };
                    kern.accumulate_codes_prefetching(
                        ov,
                        &self.w,
                        g,
                        d,
                        vcodes,
                        fmt.value_bits,
                        n,
                        0,
                        d,
                        &mut self.rows,
                        pf,
                    );
                }
                for j in (0..groups).filter(|_| !fused) {
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
///
/// The head-pages of one KV head lie `num_kv_heads` pages apart in the pool (or wherever
/// the block table puts them), so each one starts cold for the hardware prefetchers:
/// the next chunk's page bytes are prefetched while the current chunk is computed.
#[inline(always)]
pub(super) fn run_chunks<'a, K: Kernels>(
    kern: K,
    st: &mut HeadState,
    fmt: &Format,
    chunks: impl Iterator<Item = Chunk<'a>>,
) {
    let mut chunks = chunks.peekable();
    while let Some(c) = chunks.next() {
        let next = match chunks.peek() {
            Some(Chunk::Quant { page, .. }) => page,
            _ => &[][..],
        };
        st.step(kern, fmt, c, next);
    }
    st.finish();
}

with_best_kernels! {
    /// [`run_chunks`] with the best kernels this processor supports.
    pub(super) fn run_chunks_best<'a>(
        st: &mut HeadState,
        fmt: &Format,
        chunks: impl Iterator<Item = Chunk<'a>>,
    ) = run_chunks;
}

/// The chunks of positions `[begin, end)` of a sequence, in position order: sink rows,
/// then page slots (a protected position as a one-row f16 chunk of its protected row),
/// then window rows, none crossing a page, a protected position, the end of the sinks
/// or the wrap of the window ring, none longer than 64 tokens.
pub(super) fn chunks<'a>(
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
pub(super) fn group_queries(
    p: &DecodeParams,
    calib: &LayerCalibration,
    q: &[f32],
    seq: usize,
    kv_head: usize,
) -> Vec<f32> {
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
/// which only the split's last `q_len - 1` positions can be; with a sliding window, the
/// splits cover the visible positions only and the rows before their window's start are
/// masked, which only the split's first `q_len - 1` positions can be), then the
/// log-sum-exp merge
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
            if p.attn_window > 0 {
                st = st.window((0..q_len * g).map(|r| p.row_start(len, (r / g) as u32)).collect());
            }
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
pub(super) fn merge_into(parts: &[Option<HeadState>], i: usize, d: usize, x: &mut [f32]) {
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
