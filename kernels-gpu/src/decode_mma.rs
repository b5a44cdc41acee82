//! `decode_mma`: split-K decode attention on tensor cores, straight from the packed cache.
//!
//! One block of [`WARPS`] warps per (KV head, sequence, split x row tile). A row tile is
//! up to 16 query rows of one KV head: GQA heads x query tokens (row `i * G + h` is query
//! token `i`, head `h` of the group), padded to 16, in the M dimension of
//! `mma.sync.m16n8k16` (f16 inputs, f32 accumulation). Each packed token is unpacked once
//! for all of them.
//!
//! **Scores** `S = Q K^T`: key codes go straight into B fragments. A 32-bit word of codes
//! holds a low and a high 16-bit half; one `and` with the mask `(2^b - 1) * 0x0001_0001`
//! shifted by `b * j` takes code `j` of both halves into the two f16 lanes of a register,
//! as the f16 bit patterns `code * 2^(b j) * 2^-24` (subnormals, exact). That works while
//! the code stays inside the 10 mantissa bits (`j < 10 / b`); the remaining codes come from
//! the word shifted right once. The power of two of each code position, and of the
//! channel order this unpacking implies, is folded into the query fragments (prepared
//! once per block in shared memory), so the tensor cores see `sum q_c * code_c` exactly as
//! the CUDA-core kernel would, up to the f16 rounding of the query. Per token and group
//! the score is `scale * acc + zero * sum(q over the group)`, applied on the accumulators.
//!
//! **Values** `O = P' V`: `P = f16(p)` packed from the score accumulators without leaving
//! registers, `P' = P * scale` per token and group in f16x2 (the A fragment), value codes
//! of two tokens joined into one register (`low half` of token a, `high half` of token b)
//! and unpacked by the same masks into B. One more MMA per tile, `P` times a B whose
//! columns are the value zeros per group or ones, sums `p * zero` per group and the
//! weights `p` over the tile's tokens for every row at once.
//!
//! **f16 rows** (sinks, the recent window, protected positions) run first through the
//! same tiles with plain f16 fragments (the query in natural channel order), so the online
//! softmax sees one stream. Quantized tokens are walked in tiles of 16 (two n-tiles of 8
//! for the scores, one k-step for the values). The steady state is an unmasked loop over
//! chunks of [`chunk_tiles`] tiles (16 to 64 tokens) with one online-softmax update per
//! chunk, chunk `k` by warp `k mod WARPS`. Where [`ring_stages`] allows (every entry
//! point but head_dim 64 with 2-bit values), each warp streams its chunks through a
//! `cp.async` ring of three stages (two where three do not fit) in the block's area of
//! shared memory (idle between the setup and the merge), two chunks (one) in flight
//! while one is computed, and takes the codes into fragments with `ldmatrix`; elsewhere
//! the next chunk's register loads are issued while the current one is computed. Tiles that need a mask (a split's ends, causal limits of multi-token
//! queries, sliding-window starts, protected positions) go one at a time through a second, masked loop. The
//! warps merge their `(m, l, o)` in shared memory at the end, in passes of
//! [`merge_channels`] output channels (all of them up to head_dim 128, 64 at 256).
//!
//! Head_dim 256 holds 128 f32 output accumulators per lane (32 n-tiles): one 16-token tile
//! per chunk, the ring sized to the 48 KiB default, and a few spilled loop invariants
//! (docs/src/sass.md: the only decode entry points with local memory, within a budget the static
//! gate enforces).
//!
//! Only what the hot loop needs is a runtime value; head_dim, code widths, groups per head
//! and the fragment counts are compile-time constants of each entry point
//! (`for_each_decode_mma!`).

// Loops index the fragment arrays by register position on purpose (rows g / g + 8,
// n-tiles), mirroring the layouts in the docs.
#![allow(clippy::needless_range_loop)]

use crate::ctx::{Ctx, WARP};
use crate::fwht::{dense_warp, fwht_warp, permute_warp};
use crate::math::{exp2_neg, fma, h2f, hmul2, pack_f16x2};
use crate::params::{DecodeParams, FLAG_DENSE_KEYS, FLAG_ROTATE_KEYS, load_elem};

/// Warps per block.
pub const WARPS: u32 = 4;
/// Threads per block.
pub const THREADS: u32 = WARPS * WARP;
/// Query rows per block (the M dimension of one MMA).
pub const ROWS: u32 = 16;
/// Tokens per tile.
pub const TILE: u32 = 16;

const LOG2E: f32 = core::f32::consts::LOG2_E;

/// Codes of a 16-bit half that one mask takes straight into f16 mantissa bits.
const fn direct(bits: u32) -> u32 {
    10 / bits
}

/// Codes per 16-bit half.
const fn per_half(bits: u32) -> u32 {
    16 / bits
}

/// log2 of the power of two code `j` of a half carries after [`extract`].
const fn factor_log2(bits: u32, j: u32) -> u32 {
    if j < direct(bits) { bits * j } else { bits * (j - direct(bits)) }
}

/// `i`, or `n - 1` past the end: an index the compiler sees in bounds (no trap path in
/// device code) that is `i` whenever the caller's arithmetic is right.
#[inline(always)]
const fn clamp_idx(i: usize, n: usize) -> usize {
    if i < n { i } else { n - 1 }
}

/// `2^e` for a small integer exponent, exactly.
#[inline(always)]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((127 + e) as u32) << 23)
}

/// Code `j` of both 16-bit halves of `w` as two f16 bit patterns `code * 2^factor_log2`
/// times `2^-24`; `x` is `w >> (bits * direct(bits))`.
#[inline(always)]
fn extract(bits: u32, w: u32, x: u32, j: u32) -> u32 {
    let m = ((1u32 << bits) - 1) * 0x0001_0001;
    if j < direct(bits) { w & (m << (bits * j)) } else { x & (m << (bits * (j - direct(bits)))) }
}

/// Token of a 16-token tile that score n-tile `nt` (0 or 1) column `n` holds: lane `t`'s
/// accumulator columns `2t, 2t + 1` of both n-tiles are then tokens `4t .. 4t + 4`.
#[inline(always)]
const fn tile_token(nt: u32, n: u32) -> u32 {
    2 * n - (n & 1) + 2 * nt
}

/// Dynamic shared memory of `decode_mma` for a head dimension, key and value bits and
/// groups per head: the block's area (the rotated queries during setup, the warps'
/// `cp.async` rings during the loop, the merge at the end; [`area_bytes`]), the query
/// fragments and the per-group query sums. At most 48 KiB, the default a kernel may use
/// without opting in.
pub const fn mma_shared_bytes(head_dim: u32, key_bits: u32, value_bits: u32, groups: u32) -> u32 {
    area_bytes(head_dim, key_bits, value_bits, groups) + fixed_bytes(head_dim, groups)
}

/// Dynamic shared memory a kernel may use without opting in.
const SHARED_DEFAULT_MAX: u32 = 48 * 1024;

/// Whether the natural-order query fragments (read only by the f16 rows, section 3 of
/// [`decode_mma`]) live in the area, after the setup's rotated queries, rather than
/// beside the quantized-order ones: at head_dim 256, where their 8 KiB buy the rings'
/// room (a barrier after section 3 keeps the rings' copies after their last read).
pub const fn natural_frags_in_area(head_dim: u32) -> bool {
    head_dim > 128
}

/// The shared memory outside the area: the query fragments kept through the loop (both
/// sets, or the quantized-order set alone) and the query sums.
const fn fixed_bytes(head_dim: u32, groups: u32) -> u32 {
    let sets = if natural_frags_in_area(head_dim) { 1 } else { 2 };
    sets * frag_bytes(head_dim) + ROWS * groups * 4
}

/// Bytes of the area the setup uses: the rotated queries and row maxima (`ROWS x (D +
/// 1)` f32), then the natural-order fragments where they live in the area.
const fn setup_bytes(head_dim: u32) -> u32 {
    let q = ROWS * (head_dim + 1) * 4;
    if natural_frags_in_area(head_dim) { q + frag_bytes(head_dim) } else { q }
}

/// Output channels the warps merge per pass (section 6 of [`decode_mma`]): all of them
/// up to head_dim 128; 64 at head_dim 256, where all at once (66 KB) would not fit the
/// 48 KiB beside the fragments.
pub const fn merge_channels(head_dim: u32) -> u32 {
    if head_dim > 128 { 64 } else { head_dim }
}

/// One merge pass: every warp's `[ROWS][merge_channels]` values, maxima and sums.
const fn merge_bytes(head_dim: u32) -> u32 {
    WARPS * ROWS * (merge_channels(head_dim) + 2) * 4
}

/// The block's area at the start of its shared memory, used in turn by the setup's
/// rotated queries (`ROWS x (D + 1)` f32; at head_dim 256 followed by the natural-order
/// fragments, [`natural_frags_in_area`]), the warps' rings and the merge: the largest of
/// the three. Where the rings fit in the merge area (and without a ring) this is the
/// merge area; elsewhere it grows to the rings ([`ring_stages`]).
pub const fn area_bytes(head_dim: u32, key_bits: u32, value_bits: u32, groups: u32) -> u32 {
    let ring = WARPS
        * ring_stages(head_dim, key_bits, value_bits, groups)
        * chunk_bytes(head_dim, key_bits, value_bits, groups);
    let setup = setup_bytes(head_dim);
    let m = if merge_bytes(head_dim) > setup { merge_bytes(head_dim) } else { setup };
    if ring > m { ring } else { m }
}

const fn frag_bytes(head_dim: u32) -> u32 {
    head_dim / 16 * WARP * 16
}

/// Where the lane's four score columns (tokens `4t .. 4t + 4` of a tile) live.
#[derive(Clone, Copy)]
struct Tok {
    /// Positions (for the causal mask).
    pos: [u32; 4],
    /// Whether each counts (inside the split and its phase).
    ok: [bool; 4],
}

/// One quantized tile's raw bytes for one lane: key code words `[n-tile][block]`, value
/// code words `[half-word set][token pair]`, and per group the key and value scale and
/// zero words of tokens `4t .. 4t + 4` (two f16 per word). Sized for the largest
/// configuration; smaller ones leave entries unused (and the compiler drops them).
#[derive(Clone, Copy)]
struct Raw<const NG: usize> {
    kw: [[u32; 8]; 2],
    vw: [[u32; 2]; 8],
    ks: [[u32; 4]; NG],
    vs: [[u32; 4]; NG],
}

impl<const NG: usize> Default for Raw<NG> {
    fn default() -> Self {
        Self { kw: [[0; 8]; 2], vw: [[0; 2]; 8], ks: [[0; 4]; NG], vs: [[0; 4]; NG] }
    }
}

/// Online-softmax state of the lane's two rows (`g` and `g + 8`), log2 domain: the running
/// max `m` and the lane's part of the f16 rows' weight sum `l` (the quantized tiles sum
/// their weights on the tensor cores, in the `zl` accumulator of [`values`]).
struct Soft {
    m: [f32; 2],
    l: [f32; 2],
}

/// Masks the lane's scores `s[nt][c]` (tokens `4t + 2 nt + c % 2`, rows `c / 2`): `-inf`
/// where the token does not count or lies outside the row's visible positions: the
/// `keys` ([`DecodeParams::window_keys`]) positions below its causal limit `lim`.
#[inline(always)]
fn mask(s: &mut [[f32; 4]; 2], tok: &Tok, lim: [u32; 2], keys: u32) {
    // Visible: `[lim - span, lim)`. Derived here rather than kept from the setup, where
    // two more live registers per row spill at head_dim 128.
    let span = lim.map(|l| l.min(keys));
    for nt in 0..2 {
        for c in 0..4 {
            let k = 2 * nt + (c & 1);
            // One unsigned compare for both ends: a position below the row's start wraps
            // past its span.
            if !tok.ok[k] || tok.pos[k].wrapping_sub(lim[c / 2] - span[c / 2]) >= span[c / 2] {
                s[nt][c] = f32::NEG_INFINITY;
            }
        }
    }
}

/// One online-softmax update over `U` tiles of 16 tokens: the scores are `s * scale`
/// (`scale > 0`, a power of two); the running max per row over the warp, the rescaling of
/// `o`, `zl` and `l` when it grows, and `s` replaced by `p = 2^(s * scale - m)`.
/// `masked`: some scores may be `-inf` (a row may have no token yet); `add_l`: add the
/// weights to `st.l` (the f16 rows; quantized tiles sum them on the tensor cores).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn softmax<C: Ctx, const U: usize, const NVT: usize>(
    ctx: &C,
    st: &mut Soft,
    s: &mut [[[f32; 4]; 2]; U],
    scale: f32,
    masked: bool,
    add_l: bool,
    o: &mut [[f32; 4]; NVT],
    zl: &mut [f32; 4],
) {
    for r in 0..2 {
        let mut mx = f32::NEG_INFINITY;
        for su in s.iter() {
            mx = mx.max(su[0][2 * r].max(su[0][2 * r + 1]).max(su[1][2 * r].max(su[1][2 * r + 1])));
        }
        mx = mx.max(ctx.shfl_xor(mx, 1));
        mx = mx.max(ctx.shfl_xor(mx, 2));
        let mn = st.m[r].max(mx * scale);
        if mn > st.m[r] {
            let corr = exp2_neg(st.m[r] - mn);
            st.l[r] *= corr;
            for ot in o.iter_mut() {
                ot[2 * r] *= corr;
                ot[2 * r + 1] *= corr;
            }
            zl[2 * r] *= corr;
            zl[2 * r + 1] *= corr;
            st.m[r] = mn;
        }
        // A finite score makes the max finite, so only masked tiles need the guard.
        let base = if masked && st.m[r] == f32::NEG_INFINITY { 0.0 } else { st.m[r] };
        for su in s.iter_mut() {
            for sn in su.iter_mut() {
                sn[2 * r] = exp2_neg(fma(sn[2 * r], scale, -base));
                sn[2 * r + 1] = exp2_neg(fma(sn[2 * r + 1], scale, -base));
                if add_l {
                    st.l[r] += sn[2 * r] + sn[2 * r + 1];
                }
            }
        }
    }
}

/// Scores of `U` quantized tiles in query units (`* 2^(24 - k)` gives the log2-domain
/// logits): per k-step the query fragment is read once from shared memory for every tile
/// and n-tile; per token and group `scale * acc + zero * qsum'` on the accumulators, with
/// `qsum'` the query sums in the same units.
#[inline(always)]
fn scores<C: Ctx, const U: usize, const KB: u32, const NG: usize, const NKS: usize>(
    ctx: &C,
    aq: *const u32,
    raw: &[Raw<NG>; U],
    qsp: &[[f32; NG]; 2],
) -> [[[f32; 4]; 2]; U] {
    let lane = ctx.lane() as usize;
    let ks_per_block = (per_half(KB) / 2) as usize;
    let gsize = NKS * 16 / NG;
    // 16-byte blocks of a token's key codes per group (`128 / KB` channels a block).
    let bpg = gsize * KB as usize / 128;
    let mut s = [[[0f32; 4]; 2]; U];
    // Group by group, each folded into `s` as soon as its k-steps are done: one set of
    // group accumulators is live at a time.
    for gi in 0..NG {
        let mut sg = [[[0f32; 4]; 2]; U];
        for b in gi * bpg..(gi + 1) * bpg {
            let w: [[u32; 2]; U] = core::array::from_fn(|u| [raw[u].kw[0][b & 7], raw[u].kw[1][b & 7]]);
            let x: [[u32; 2]; U] = core::array::from_fn(|u| w[u].map(|wv| wv >> (KB * direct(KB))));
            for st in 0..ks_per_block {
                let ks = clamp_idx(b * ks_per_block + st, NKS);
                // SAFETY: the fragment area (shared memory, 16-byte aligned, written before
                // the loop's barrier) holds NKS x 32 lanes x 4 words.
                let a: [u32; 4] = unsafe { ctx.load_shared16(aq.add((ks * WARP as usize + lane) * 4)) };
                let j = 2 * st as u32;
                for u in 0..U {
                    for nt in 0..2 {
                        let bf = [extract(KB, w[u][nt], x[u][nt], j), extract(KB, w[u][nt], x[u][nt], j + 1)];
                        sg[u][nt] = ctx.mma_m16n8k16(a, bf, sg[u][nt]);
                    }
                }
            }
        }
        for u in 0..U {
            let ksc = f16x4([raw[u].ks[gi][0], raw[u].ks[gi][1]]);
            let kz = f16x4([raw[u].ks[gi][2], raw[u].ks[gi][3]]);
            for nt in 0..2 {
                for c in 0..4 {
                    let tk = 2 * nt + (c & 1);
                    let acc = if gi == 0 { kz[tk] * qsp[c / 2][gi] } else { fma(kz[tk], qsp[c / 2][gi], s[u][nt][c]) };
                    s[u][nt][c] = fma(sg[u][nt][c], ksc[tk], acc);
                }
            }
        }
    }
    s
}

/// Four f16 (two words) to f32.
#[inline(always)]
fn f16x4(w: [u32; 2]) -> [f32; 4] {
    [h2f(w[0] as u16), h2f((w[0] >> 16) as u16), h2f(w[1] as u16), h2f((w[1] >> 16) as u16)]
}

/// f16 one, twice.
const ONES_F16X2: u32 = 0x3c00_3c00;

/// `P' V` of one quantized tile from its weights `p` (score layout): `P = f16(p)` once,
/// `P' = P * scale` per group in f16x2, value codes of tokens (4t, 4t+1) and (4t+2, 4t+3)
/// joined per 16-bit half into B. One more MMA sums the weights and the weights times the
/// value zeros: `zl`'s B column `n` is the zeros of group `n % 2^ceil(log2(NG + 1))` below
/// `NG`, ones (the weight sum `l`) at and above it; see [`zl_parts`].
#[inline(always)]
fn values<C: Ctx, const VB: u32, const NG: usize, const NVT: usize>(
    ctx: &C,
    p: &[[f32; 4]; 2],
    raw: &Raw<NG>,
    o: &mut [[f32; 4]; NVT],
    zl: &mut [f32; 4],
) {
    let g = ctx.lane() as usize / 4;
    let pa = [
        pack_f16x2(p[0][0], p[0][1]),
        pack_f16x2(p[0][2], p[0][3]),
        pack_f16x2(p[1][0], p[1][1]),
        pack_f16x2(p[1][2], p[1][3]),
    ];
    let col = g % zl_period(NG);
    let mut bz = [ONES_F16X2; 2];
    for (gi, v) in raw.vs.iter().enumerate() {
        if col == gi {
            bz = [v[2], v[3]];
        }
    }
    *zl = ctx.mma_m16n8k16(pa, bz, *zl);
    let a: [[u32; 4]; NG] = core::array::from_fn(|gi| {
        let v = &raw.vs[gi];
        [hmul2(pa[0], v[0]), hmul2(pa[1], v[0]), hmul2(pa[2], v[1]), hmul2(pa[3], v[1])]
    });
    let cph_v = per_half(VB) as usize;
    let nh = NVT / cph_v;
    let gsize = NVT * 8 / NG;
    for h in 0..nh {
        let [wa, wb] = raw.vw[h & 7];
        let (xa, xb) = (wa >> (VB * direct(VB)), wb >> (VB * direct(VB)));
        let gi = clamp_idx(h * (128 / VB as usize) / gsize, NG);
        for ev in 0..cph_v {
            let bf = [extract(VB, wa, xa, ev as u32), extract(VB, wb, xb, ev as u32)];
            let n = clamp_idx(h * cph_v + ev, NVT);
            o[n] = ctx.mma_m16n8k16(a[gi], bf, o[n]);
        }
    }
}

/// Columns per period of the `zl` accumulator: `NG` zero columns then weight-sum
/// columns, a power of two so that lane `t`'s columns `2t, 2t + 1` fall on one pattern.
const fn zl_period(ng: usize) -> usize {
    if ng < 2 { 2 } else { 4 }
}

/// From the `zl` accumulator: per row (`g`, `g + 8`) the weights times the value zeros
/// per group and the weight sum, for every lane (a shuffle with lane `t ^ 1` where a
/// lane's two columns do not hold all of them).
#[inline(always)]
fn zl_parts<C: Ctx, const NG: usize>(ctx: &C, zl: &[f32; 4]) -> ([[f32; NG]; 2], [f32; 2]) {
    let t = ctx.lane() % 4;
    let mut z = [[0f32; NG]; 2];
    let mut l = [0f32; 2];
    for r in 0..2 {
        let (x0, x1) = (zl[2 * r], zl[2 * r + 1]);
        if NG < 2 {
            z[r][0] = x0;
            l[r] = x1;
        } else {
            // Period 4: columns z0, z1, l, l; lanes t even hold z0, z1, odd l, l.
            let (y0, y1) = (ctx.shfl_xor(x0, 1), ctx.shfl_xor(x1, 1));
            let even = t & 1 == 0;
            z[r][0] = if even { x0 } else { y0 };
            z[r][clamp_idx(1, NG)] = if even { x1 } else { y1 };
            l[r] = if even { y0 } else { x0 };
        }
    }
    (z, l)
}

/// Tiles per chunk of the unmasked steady-state loop (one online-softmax update per
/// chunk): as many as ptxas keeps in registers without spilling (measured with `cargo
/// xtask sass`): four (64 tokens) at head_dim 64 with 2-bit values, two (32 tokens) for
/// most of head_dim 128, one for 4-bit values at head_dim 64 or with two groups per head
/// at 128, and at head_dim 256.
pub const fn chunk_tiles(head_dim: u32, value_bits: u32, groups: u32) -> u32 {
    if head_dim > 128 || (value_bits == 4 && (head_dim == 64 || groups > 1)) {
        1
    } else if head_dim == 64 {
        4
    } else {
        2
    }
}

/// The unmasked steady state (section 4a of [`decode_mma`]): chunks `w, w + WARPS, ...`
/// below `nchunks` of `U` tiles each, chunk `c` starting at tile `f0 + U c`, with `w` the
/// warp's place counted from warp `rot` (a run of chunks after another starts where the
/// other left off, so the warps share the chunks evenly over the runs). Each
/// iteration computes the chunk's scores, issues the next chunk's loads (tile by tile as
/// the registers of the current one free up; the last chunk reloads itself, so there is
/// no branch), runs one softmax update for all `U` tiles and their `P' V`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fast_chunks<
    C: Ctx,
    const KB: u32,
    const VB: u32,
    const NG: usize,
    const NKS: usize,
    const NVT: usize,
    const U: usize,
>(
    (ctx, aq, qsp, unscale_q): (&C, *const u32, &[[f32; NG]; 2], f32),
    load: &impl Fn(u32) -> Raw<NG>,
    f0: u32,
    nchunks: u32,
    rot: u32,
    st: &mut Soft,
    o: &mut [[f32; 4]; NVT],
    zl: &mut [f32; 4],
) {
    let mut c = (ctx.thread_idx() / WARP + WARPS - rot) % WARPS;
    if c >= nchunks {
        return;
    }
    let rel = |c: u32, u: usize| (f0 + U as u32 * c + u as u32) * TILE;
    let mut cur: [Raw<NG>; U] = core::array::from_fn(|u| load(rel(c, u)));
    while c < nchunks {
        let mut s = scores::<C, U, KB, NG, NKS>(ctx, aq, &cur, qsp);
        let cn = (c + WARPS).min(nchunks - 1);
        let mut ahead = [Raw::<NG>::default(); U];
        ahead[0] = load(rel(cn, 0));
        softmax::<C, U, NVT>(ctx, st, &mut s, unscale_q, false, false, o, zl);
        for u in 0..U {
            values::<C, VB, NG, NVT>(ctx, &s[u], &cur[u], o, zl);
            if u + 1 < U {
                ahead[clamp_idx(u + 1, U)] = load(rel(cn, u + 1));
            }
        }
        cur = ahead;
        c += WARPS;
    }
}

/// Per-lane byte offsets of [`read_tile`], the same for every tile: key codes of token
/// `tile_token(0, g)` word `t`, value codes of token `4t` at half-word `g`, scales and
/// zeros of tokens `4t .. 4t + 4`.
#[derive(Clone, Copy)]
struct LaneOff {
    k: usize,
    v: usize,
    s: usize,
}

/// Where one quantized tile's bytes lie: `k` the key codes of its token 0 (`D * KB / 8`
/// bytes a token), `v` its value codes (`D * VB / 8` a token), `s` its first scale; the
/// `4 * NG` f16 arrays (key scales, key zeros, value scales, value zeros, `NG` groups
/// each) lie `sstride` bytes apart, token `i` at `+ 2 i`. In the pool `sstride` is two
/// bytes per slot of a page; in a ring stage the arrays are packed (32 bytes).
#[derive(Clone, Copy)]
struct TilePtr {
    k: *const u8,
    v: *const u8,
    s: *const u8,
    sstride: usize,
}

/// Bytes of one quantized tile (16 tokens) in a ring stage: key codes, value codes, then
/// the `4 * groups` arrays of 16 f16 scales or zeros.
pub const fn tile_bytes(head_dim: u32, key_bits: u32, value_bits: u32, groups: u32) -> u32 {
    2 * head_dim * (key_bits + value_bits) + 4 * groups * 32
}

/// Stages of a warp's ring when the steady-state loop copies its chunks into shared
/// memory with `cp.async`.
const RING: u32 = 3;

/// Bytes of one chunk of the steady-state loop in a ring stage.
const fn chunk_bytes(head_dim: u32, key_bits: u32, value_bits: u32, groups: u32) -> u32 {
    chunk_tiles(head_dim, value_bits, groups) * tile_bytes(head_dim, key_bits, value_bits, groups)
}

/// Stages of the steady-state loop's per-warp `cp.async` ring (`ring_chunks`), or 0
/// where the loop prefetches one chunk into registers instead (`fast_chunks`).
///
/// 3 (two chunks in flight while a third is computed) where the four warps' rings fit in
/// the merge area, which is idle during the loop (no extra shared memory: head_dim 128
/// with 2-bit keys and values, the one-tile entry points at head_dim 64 and 128). Else
/// the block's area grows to hold the rings within the 48 KiB default: 3 stages where
/// they fit (head_dim 128 k2v4 and k4v2 with groups of 128, head_dim 256 k2v2, k2v4 and
/// k4v2), else 2 (one chunk in flight while one is computed: head_dim 128 k4v4 with
/// groups of 128 and k4v2 with groups of 64, head_dim 256 k4v4). None for the 64-token chunks
/// of head_dim 64 with 2-bit values: a ring there measured 724 instructions per chunk
/// against the register prefetch's 700 (its loads are cheap at constant offsets, the
/// ring's copy and stage reads are not).
pub const fn ring_stages(head_dim: u32, key_bits: u32, value_bits: u32, groups: u32) -> u32 {
    let chunk = chunk_bytes(head_dim, key_bits, value_bits, groups);
    if chunk_tiles(head_dim, value_bits, groups) > 2 {
        return 0;
    }
    if WARPS * RING * chunk <= merge_bytes(head_dim) {
        return RING;
    }
    let room = SHARED_DEFAULT_MAX - fixed_bytes(head_dim, groups);
    if WARPS * RING * chunk <= room {
        RING
    } else if WARPS * 2 * chunk <= room {
        2
    } else {
        0
    }
}

/// One tile's raw bytes for this lane from `tp` (the pool or a ring stage), whose
/// pointers already carry the lane's [`LaneOff`].
///
/// # Safety
/// `tp` minus the lane's offsets addresses a whole tile of the layout [`TilePtr`]
/// describes.
#[inline(always)]
unsafe fn read_tile<C: Ctx, const D: usize, const KB: u32, const VB: u32, const NG: usize>(
    ctx: &C,
    tp: TilePtr,
) -> Raw<NG> {
    let kcb = D * KB as usize / 8;
    let vcb = D * VB as usize / 8;
    let nbk = D * KB as usize / 128;
    let nh = D * VB as usize / 128;
    let mut r = Raw::<NG>::default();
    // SAFETY (every access): inside the tile, by the caller's contract.
    let kp = tp.k;
    for nt in 0..2 {
        for b in 0..nbk {
            r.kw[nt][b & 7] = unsafe { *kp.add(2 * nt * kcb + 16 * b).cast::<u32>() };
        }
    }
    unsafe {
        read_scales::<_, NG, false>(ctx, &mut r, tp.s, tp.sstride, false);
        read_scales::<_, NG, false>(ctx, &mut r, tp.s, tp.sstride, true);
    }
    let vp = tp.v;
    for h in 0..nh {
        let hw = |j: usize| -> u32 { unsafe { *vp.add(j * vcb + 16 * h).cast::<u16>() as u32 } };
        r.vw[h & 7] = [hw(0) | hw(1) << 16, hw(2) | hw(3) << 16];
    }
    r
}

/// The key (`values == false`) or value scales and zeros of tokens `4t .. 4t + 4` (8
/// bytes, 8-byte aligned, per array) into `r`, from `s` (the first array, with the lane's
/// offset) and the arrays `sstride` bytes apart, as in [`TilePtr`].
///
/// # Safety
/// The `4 * NG` arrays lie there, as in [`read_tile`].
#[inline(always)]
unsafe fn read_scales<C: Ctx, const NG: usize, const SHARED: bool>(
    ctx: &C,
    r: &mut Raw<NG>,
    s: *const u8,
    sstride: usize,
    values: bool,
) {
    let ld2 = |a: usize| -> [u32; 2] {
        // SAFETY: inside the tile, by the caller's contract (with `SHARED`, a ring stage
        // in shared memory: a shared load).
        if SHARED {
            unsafe { ctx.load_shared8(s.add(a * sstride).cast::<u32>()) }
        } else {
            let x = unsafe { *s.add(a * sstride).cast::<u64>() };
            [x as u32, (x >> 32) as u32]
        }
    };
    let first = if values { 2 * NG } else { 0 };
    for gi in 0..NG {
        let (a, b) = (ld2(first + gi), ld2(first + NG + gi));
        let w = [a[0], a[1], b[0], b[1]];
        if values {
            r.vs[gi] = w;
        } else {
            r.ks[gi] = w;
        }
    }
}

/// The layout of a ring stage's key or value section, with `pieces` 16-byte pieces of
/// codes per token: the piece of the tile's codes (`token * pieces + piece`, the pool's
/// order) that unit `u` (16 bytes) of the section holds. The section is `2 * pieces` 8 x 8
/// `ldmatrix` matrices one after another, matrix `m` (units `8 m .. 8 m + 8`) holding in
/// row `r` piece `m % pieces` of token `tile_token(m / pieces, r)`. A matrix is thus 128
/// contiguous bytes, its 8 rows on the 8 different groups of four banks (no bank
/// conflict), and lane `L` of an `x4` addresses row `L % 8` of matrix `4 c + L / 8`: unit
/// `32 c + L`.
#[inline(always)]
const fn source_piece(u: usize, pieces: usize) -> usize {
    let (m, r) = (u / 8, u % 8);
    tile_token((m / pieces) as u32, r as u32) as usize * pieces + m % pieces
}

/// `ldmatrix` calls that read the `2 * pieces` matrices of a stage section laid out as
/// [`source_piece`] says: lane `(g, t)` receives word `t` of piece `m % pieces` of its token
/// `tile_token(m / pieces, g)` (keys: the [`Raw::kw`] words), or read transposed,
/// half-word `g` of that piece of tokens `tile_token(m / pieces, 2t)` and `.. 2t + 1`,
/// that is `4t + 2 (m / pieces)` and the next (values: the [`Raw::vw`] pairs). One `x2`
/// for two matrices, else `x4`s.
#[derive(Clone, Copy)]
struct StageLoads {
    /// This lane's row address per call, from the section's start.
    off: [usize; 4],
    /// Matrices (2, 4, 8 or 16).
    n: usize,
}

impl StageLoads {
    /// The rows this lane addresses, for `pieces` pieces per token.
    #[inline(always)]
    fn new(lane: u32, pieces: usize) -> Self {
        let n = 2 * pieces;
        let lane = lane as usize;
        let off = core::array::from_fn(|c| if n == 2 { 16 * (lane % 16) } else { 16 * (32 * c + lane) });
        Self { off, n }
    }

    /// Matrix `m`'s register for this lane, `m` in `0 .. n`, from the section at `base`.
    ///
    /// # Safety
    /// `base` is a ring stage's section of whole tokens (16-byte aligned), retired and
    /// made visible to the warp.
    #[inline(always)]
    unsafe fn load<C: Ctx>(&self, ctx: &C, base: *const u8, trans: bool) -> [u32; 16] {
        let mut w = [0u32; 16];
        // SAFETY: the caller's contract; rows inside the section.
        unsafe {
            if self.n == 2 {
                let x = ctx.ldmatrix_x2(base.add(self.off[0]), trans);
                w[..2].copy_from_slice(&x);
            } else {
                for c in 0..self.n / 4 {
                    let x = ctx.ldmatrix_x4(base.add(self.off[clamp_idx(c, 4)]), trans);
                    w[4 * c..4 * c + 4].copy_from_slice(&x);
                }
            }
        }
        w
    }
}

/// Starts copying one tile from the pool into a ring stage at `dst` with `cp.async`
/// (the lane's share of its [`tile_bytes`] / 16 pieces of 16 bytes): key codes and value
/// codes, each section laid out as [`source_piece`] says, then the scale and zero arrays packed
/// 32 bytes apart. Lane `L` fills stage units `L, L + 32, ...` (each `cp.async` writes 512
/// contiguous bytes: every bank group four times, no conflict) from the pieces
/// [`source_piece`] names (each still reads whole 512-byte runs of the pool, in another
/// order).
///
/// # Safety
/// `src` addresses a whole tile of the pool (16-byte aligned, as docs/src/format.md's page layout
/// makes every tile's sections); `dst` (a byte offset into the block's dynamic shared
/// memory) is 16-byte aligned, with [`tile_bytes`] of shared memory that no one touches
/// until the copy's group is retired.
#[inline(always)]
unsafe fn copy_tile<C: Ctx, const D: usize, const KB: u32, const VB: u32, const NG: usize>(
    ctx: &C,
    src: TilePtr,
    dst: u32,
) {
    // Pieces: 16 tokens x D * KB / 8 bytes of key codes is D * KB / 8 pieces.
    let nk = D * KB as usize / 8;
    let nv = D * VB as usize / 8;
    let (pk, pv) = (nk / 16, nv / 16);
    let ns = 8 * NG;
    let lane = ctx.lane() as usize;
    if pk >= 2 && pv >= 2 {
        // Each section a whole number of rounds of 32 pieces: round `r` of a section with
        // `p >= 2` pieces per token reads `source_piece(L + 32 r, p)`, which is
        // `source_piece(L, p) + source_piece(32 r, p)` (test `source_piece_splits_by_rounds`), so every
        // copy's source is one per-lane pointer per section plus a constant: no address
        // arithmetic per copy beyond the tile's base.
        // SAFETY (every copy): the caller's contract; a piece of both.
        let kb = unsafe { src.k.add(16 * source_piece(lane, pk)) };
        for r in 0..nk / WARP as usize {
            let from = unsafe { kb.add(16 * source_piece(WARP as usize * r, pk)) };
            unsafe { ctx.cp_async16_at(dst + 16 * (lane + WARP as usize * r) as u32, from) };
        }
        let vb = unsafe { src.v.add(16 * source_piece(lane, pv)) };
        let vdst = dst + 16 * nk as u32;
        for r in 0..nv / WARP as usize {
            let from = unsafe { vb.add(16 * source_piece(WARP as usize * r, pv)) };
            unsafe { ctx.cp_async16_at(vdst + 16 * (lane + WARP as usize * r) as u32, from) };
        }
        // Scale piece `j = L + 32 r`: array `j / 2 = L / 2 + 16 r`, half `j % 2 = L % 2`.
        let sb = unsafe { src.s.add(lane / 2 * src.sstride + 16 * (lane % 2)) };
        let sdst = dst + 16 * (nk + nv) as u32;
        for r in 0..ns.div_ceil(WARP as usize) {
            if lane + WARP as usize * r < ns {
                let from = unsafe { sb.add(16 * r * src.sstride) };
                unsafe { ctx.cp_async16_at(sdst + 16 * (lane + WARP as usize * r) as u32, from) };
            }
        }
        return;
    }
    // A section of 16 pieces (one per token) shares a round with the next one.
    let total = nk + nv + ns;
    for r in 0..total.div_ceil(WARP as usize) {
        let i = lane + WARP as usize * r;
        if i < total {
            let from = if i < nk {
                unsafe { src.k.add(16 * source_piece(i, pk)) }
            } else if i < nk + nv {
                unsafe { src.v.add(16 * source_piece(i - nk, pv)) }
            } else {
                let j = i - nk - nv;
                unsafe { src.s.add(j / 2 * src.sstride + 16 * (j % 2)) }
            };
            // SAFETY: the caller's contract; a piece of both.
            unsafe { ctx.cp_async16_at(dst + 16 * i as u32, from) };
        }
    }
}

/// The steady state with a `cp.async` ring (section 4a of [`decode_mma`] where
/// [`ring_stages`] is non-zero): the warp's chunks `w, w + WARPS, ...` below `nchunks`
/// (`w` counted from warp `rot`, as in [`fast_chunks`]), its `k`-th in stage `k mod R` of
/// its ring of `R` stages (2 or 3). Each iteration waits for its chunk's copies (and the
/// warp's lanes for each other's), starts the copy of the chunk `R - 1` ahead into the
/// stage the previous iteration read, then reads its own stage into registers and
/// computes as [`fast_chunks`]: `R - 1` chunks' bytes are in flight while one is
/// computed, without the registers a prefetch needs.
/// `entry` reads the block-table entry of a tile's page and `tile_at` places the tile in
/// the pool from it; each chunk's entries are read one iteration before its copies are
/// issued (profiled on an H200, a table read right before the copies it addresses left
/// the warp waiting on it every chunk). `slane` is the lane's scale offset
/// ([`LaneOff::s`]), `ring` the warp's ring as a byte offset into shared memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn ring_chunks<
    C: Ctx,
    const D: usize,
    const KB: u32,
    const VB: u32,
    const NG: usize,
    const NKS: usize,
    const NVT: usize,
    const U: usize,
    const R: u32,
>(
    (ctx, aq, qsp, unscale_q): (&C, *const u32, &[[f32; NG]; 2], f32),
    (entry, tile_at, slane, ring): (&impl Fn(u32) -> u32, &impl Fn(u32, u32) -> TilePtr, usize, u32),
    f0: u32,
    nchunks: u32,
    rot: u32,
    st: &mut Soft,
    o: &mut [[f32; 4]; NVT],
    zl: &mut [f32; 4],
) {
    let w = (ctx.thread_idx() / WARP + WARPS - rot) % WARPS;
    if w >= nchunks {
        return;
    }
    let mine = (nchunks - w).div_ceil(WARPS);
    let kcb = D * KB as usize / 8;
    let vcb = D * VB as usize / 8;
    let tb = tile_bytes(D as u32, KB, VB, NG as u32);
    let (nbk, nh) = (D * KB as usize / 128, D * VB as usize / 128);
    let kl = StageLoads::new(ctx.lane(), nbk);
    let vl = StageLoads::new(ctx.lane(), nh);
    // Stage `slot`'s tile `u`: its byte offset in shared memory (for the copies) and its
    // address (for the reads).
    let stage_off = |slot: u32, u: usize| ring + (slot * U as u32 + u as u32) * tb;
    let sh = ctx.shared();
    let stage = |slot: u32, u: usize| unsafe { sh.add(stage_off(slot, u) as usize) };
    // The block-table entries of chunk k's tiles (none past the warp's last chunk).
    let rel = |k: u32, u: usize| (f0 + U as u32 * (w + k * WARPS) + u as u32) * TILE;
    let entries = |k: u32| -> [u32; U] { if k < mine { core::array::from_fn(|u| entry(rel(k, u))) } else { [0; U] } };
    // Chunk k of this warp into stage `slot`, from its entries; past the warp's last
    // chunk an empty group, so that every iteration retires exactly one.
    let issue = |k: u32, slot: u32, e: [u32; U]| {
        if k < mine {
            for u in 0..U {
                // SAFETY: a tile of the split's quantized range; the stage is this warp's
                // and was last read before the `sync_warp` that precedes this call.
                unsafe { copy_tile::<C, D, KB, VB, NG>(ctx, tile_at(rel(k, u), e[u]), stage_off(slot, u)) };
            }
        }
        ctx.cp_async_commit();
    };
    // The ring may have been read by the warp's previous segment (section 4a of
    // [`decode_mma`]): every lane is past those reads before the first copy lands.
    ctx.sync_warp();
    for k in 0..R - 1 {
        issue(k, k, entries(k));
    }
    let mut ahead = entries(R - 1);
    let mut slot = 0u32;
    let mut k = 0u32;
    while k < mine {
        ctx.cp_async_wait(R - 2);
        ctx.sync_warp();
        issue(k + R - 1, if slot == 0 { R - 1 } else { slot - 1 }, ahead);
        // The next iteration's entries now: their latency hides behind this chunk.
        ahead = entries(k + R);
        // The keys' half of the chunk, its scores, then the values' half (read from the
        // stage only now: fewer registers live across the scores).
        let mut cur = [Raw::<NG>::default(); U];
        for (u, r) in cur.iter_mut().enumerate() {
            let p = stage(slot, u).cast_const();
            // SAFETY: the stage holds chunk k's tile u (its group retired and made visible
            // to the warp above).
            unsafe {
                let kw = kl.load(ctx, p, false);
                for m in 0..2 * nbk {
                    r.kw[m / nbk][(m % nbk) & 7] = kw[m];
                }
                read_scales::<C, NG, true>(ctx, r, p.add(16 * (kcb + vcb) + slane), 32, false);
            }
        }
        let mut s = scores::<C, U, KB, NG, NKS>(ctx, aq, &cur, qsp);
        for (u, r) in cur.iter_mut().enumerate() {
            let p = stage(slot, u).cast_const();
            // SAFETY: as above.
            unsafe {
                let vw = vl.load(ctx, p.add(16 * kcb), true);
                for m in 0..2 * nh {
                    r.vw[(m % nh) & 7][m / nh] = vw[m];
                }
                read_scales::<C, NG, true>(ctx, r, p.add(16 * (kcb + vcb) + slane), 32, true);
            }
        }
        softmax::<C, U, NVT>(ctx, st, &mut s, unscale_q, false, false, o, zl);
        for u in 0..U {
            values::<C, VB, NG, NVT>(ctx, &s[u], &cur[u], o, zl);
        }
        slot = if slot + 1 == R { 0 } else { slot + 1 };
        k += 1;
    }
    // Nothing may land in the area after its next use (the merge, section 6).
    ctx.cp_async_wait(0);
}

/// Split-K decode partials on tensor cores for one (KV head, sequence, split, row tile).
///
/// # Safety
/// As `decode_split` (crate::decode), with the query rows of [`DecodeParams`]
/// (`p.q_dtype`; `p.q_seq_stride` between sequences, `p.q_token_stride` between query
/// tokens, heads `D` apart) and the partials `[seq][q_len][q_head][split]`;
/// as there, each block-table entry read (those of pages holding a position at or past
/// [`DecodeParams::visible_start`]) is clamped below `p.num_blocks`
/// ([`DecodeParams::block`]: a wrong entry reads a wrong page, never outside the pool);
/// additionally `D == p.format.head_dim == 32 * V == 16 * NKS == 8 * NVT`, key and value
/// bits `KB`, `VB`, `NG == D / p.format.group_size` groups with
/// `group_size >= 128 / min(KB, VB)`, the sequences' lengths `>= p.q_len`, the page size
/// a power of two `>= 16`, the pool, side stores and every head-page section 16-byte
/// aligned (docs/src/format.md). Grid `(Hkv, S, N * ceil(G * q_len / 16))` with `G` the GQA group,
/// [`THREADS`] threads, [`mma_shared_bytes`]`(D, KB, VB, NG)` of dynamic shared memory.
///
/// # Parameters
/// Outputs per `[seq][q_len][q_head][split]`: `part_m` the max logit (natural log units;
/// `-inf` for an empty split), `part_l` the sum of `exp(logit - m)`, `part_o` (`[..][D]`)
/// the sum of `exp(logit - m) * v'` in stored value order: the input of `decode_merge`
/// (run with `num_seqs * q_len` sequences).
///
/// With a step batch (`p.batch_rows > 0`, `meta` its [`crate::params::batch_meta_len`]
/// u32), sequence `s` decodes its rows of the step ([`DecodeParams::seq_rows`]): its
/// count of new tokens (at most `p.q_len`), queries and partials at its first input row;
/// row tiles past its rows leave at once. `meta` is unused (may be null) otherwise.
///
/// # Thread mapping
/// Setup: warp `w` scales (key scales) and rotates query rows `w, w + 4, w + 8, w + 12`
/// of the tile (lane `i` owns channels `[i * V, (i + 1) * V)`, as `decode_split`), then the block writes the
/// two sets of A fragments to shared memory and each lane keeps the quantized set in
/// registers. Main loop: warp `w` takes tiles `w, w + 4, ...` of the f16 rows, then
/// chunks `w, w + 4, ...` of the quantized pages' unmasked range, then tiles `w, w + 4,
/// ...` of the rest; lane `(g, t) = (lane / 4, lane % 4)` loads key codes of tokens
/// `tile_token(0, g)` and `tile_token(1, g)` (32-bit words `t, t + 4, ...`), value codes,
/// scales and zeros of tokens `4t .. 4t + 4`, and holds rows `g` and `g + 8` of the score
/// and output accumulators. End: the warps' partials merge in shared memory in passes of
/// [`merge_channels`] channels; in each, thread `i` merges and writes elements `i, i +
/// 128, ...` of the pass's `[16 rows][channels]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn decode_mma<
    C: Ctx,
    const D: usize,
    const V: usize,
    const KB: u32,
    const VB: u32,
    const NG: usize,
    const NKS: usize,
    const NVT: usize,
>(
    ctx: &C,
    p: &DecodeParams,
    q: *const u8,
    pool: *const u8,
    block_tables: *const u32,
    seq_lens: *const u32,
    sides: *const u16,
    protected: *const u32,
    key_scale: *const f32,
    key_perm: *const u16,
    key_rot: *const f32,
    part_m: *mut f32,
    part_l: *mut f32,
    part_o: *mut f32,
    meta: *const u32,
) {
    let tid = ctx.thread_idx();
    let (warp, lane) = (tid / WARP, tid % WARP);
    let (g, t) = (lane / 4, lane % 4);
    let [kvh, seq, z] = ctx.block_idx();
    // SAFETY: the step batch (contract).
    let (pb, q_base, row_base) = unsafe { p.seq_rows(meta, seq) };
    let p = &pb;
    let fmt = p.format;
    let nsplit = p.num_splits.max(1);
    let (split, rt) = (z % nsplit, z / nsplit);
    let hq = p.num_q_heads;
    let gqa = (hq / p.num_kv_heads.max(1)).max(1);
    let rows_total = gqa * p.q_len;
    let r0 = rt * ROWS;
    // A row tile past the sequence's rows (a step batch gives each sequence its own
    // count) has nothing to do: the whole block leaves before its first barrier.
    if r0 >= rows_total {
        return;
    }
    let gsize = D as u32 / NG as u32;
    // SAFETY (every raw access below): inside the sizes of the `# Safety` contract.
    let len = p.clamp_len(unsafe { *seq_lens.add(seq as usize) });
    let table = unsafe { block_tables.add(seq as usize * p.block_table_stride as usize) };
    let side = unsafe { sides.add(seq as usize * fmt.side_elems(p.num_kv_heads)) };
    let prot = unsafe { protected.add(seq as usize * fmt.protected as usize) };

    // Shared memory: merge area (rotated queries during setup), row maxima, fragments,
    // query sums.
    let sh = ctx.shared();
    let qf = sh.cast::<f32>();
    let rowmax = unsafe { qf.add(ROWS as usize * D) };
    let aq_sh = unsafe { sh.add(area_bytes(D as u32, KB, VB, NG as u32) as usize).cast::<u32>() };
    let frags_in_area = const { natural_frags_in_area(D as u32) };
    let (ah_sh, qsum_sh) = if frags_in_area {
        // After the rotated queries and row maxima (`ROWS x (D + 1)` f32, a multiple of
        // 16 bytes).
        let ah = unsafe { sh.add(ROWS as usize * (D + 1) * 4).cast::<u32>() };
        (ah, unsafe { aq_sh.add(NKS * WARP as usize * 4).cast::<f32>() })
    } else {
        let ah = unsafe { aq_sh.add(NKS * WARP as usize * 4) };
        (ah, unsafe { ah.add(NKS * WARP as usize * 4).cast::<f32>() })
    };

    // 1. Rotated, permuted queries of the tile's rows: times the key scales (`q * s`), then
    //    sm_scale * log2(e).
    for rr in 0..(ROWS / WARPS) {
        let r = warp + WARPS * rr;
        let row = r0 + r;
        let valid = row < rows_total;
        let (i, h) = (row / gqa, row % gqa);
        let src = q_base + i as usize * p.q_token_stride as usize + ((kvh * gqa + h) as usize) * D + lane as usize * V;
        let scale = p.sm_scale * LOG2E;
        let ks = unsafe { key_scale.add(kvh as usize * D + lane as usize * V) };
        let mut x: [f32; V] = core::array::from_fn(|v| {
            if valid { (unsafe { load_elem(q, p.q_dtype, src + v) * *ks.add(v) }) * scale } else { 0.0 }
        });
        if p.flags & FLAG_DENSE_KEYS != 0 {
            x = unsafe { dense_warp::<C, V, false>(ctx, &x, key_rot.add(kvh as usize * D * D)) };
        } else if p.flags & FLAG_ROTATE_KEYS != 0 {
            fwht_warp(ctx, &mut x);
        }
        let y = unsafe { permute_warp(ctx, &x, key_perm.add(kvh as usize * D)) };
        let mut amax = 0f32;
        let mut part = 0f32;
        for (v, &yv) in y.iter().enumerate() {
            unsafe { *qf.add(r as usize * D + lane as usize * V + v) = yv };
            amax = amax.max(yv.abs());
            part += yv;
        }
        let mut mask = 1;
        while mask < WARP {
            amax = amax.max(ctx.shfl_xor(amax, mask));
            mask *= 2;
        }
        // Per-group sums (a lane's channels lie in one group: group_size >= 32 >= V).
        let my_group = lane * V as u32 / gsize;
        for gi in 0..NG {
            let mut sum = if my_group == gi as u32 { part } else { 0.0 };
            let mut mask = 1;
            while mask < WARP {
                sum += ctx.shfl_xor(sum, mask);
                mask *= 2;
            }
            if lane == 0 {
                unsafe { *qsum_sh.add(r as usize * NG + gi) = sum };
            }
        }
        if lane == 0 {
            unsafe { *rowmax.add(r as usize) = amax };
        }
    }
    ctx.sync_threads();

    // 2. One power of two for the whole tile keeps every f16 query in range:
    //    |q| * 2^k < 2^15.
    let mut mx = 0f32;
    for r in 0..ROWS as usize {
        mx = mx.max(unsafe { *rowmax.add(r) });
    }
    let k = (140 - ((mx.to_bits() >> 23) & 0xff) as i32).clamp(-90, 100);
    let qscale = pow2(k);
    // A fragments: quantized order (with each code position's power of two divided out)
    // and natural order (f16 rows).
    let ks_per_block = (per_half(KB) / 2) as usize;
    let cpw = (32 / KB) as usize;
    let mut e = tid as usize;
    while e < NKS * WARP as usize * 4 {
        let (ks, ln, r4) = (e / (WARP as usize * 4), e / 4 % WARP as usize, e % 4);
        let (fg, ft) = (ln / 4, ln % 4);
        let row = fg + 8 * (r4 & 1);
        let hi_k = r4 >> 1;
        // Quantized: k-step block b, step s; lane ft's word 4b + ft, extraction 2s + hi_k.
        let (b, s) = (ks / ks_per_block, ks % ks_per_block);
        let j = (2 * s + hi_k) as u32;
        let wbase = (4 * b + ft) * cpw;
        let f = pow2(k - factor_log2(KB, j) as i32);
        let c_lo = wbase + j as usize;
        let c_hi = wbase + per_half(KB) as usize + j as usize;
        let (a, bq) = unsafe { (*qf.add(row * D + c_lo), *qf.add(row * D + c_hi)) };
        unsafe { *aq_sh.add(e) = pack_f16x2(a * f, bq * f) };
        // Natural order: k-step ks covers channels 16 ks .. 16 ks + 16.
        let c = 16 * ks + 2 * ft + 8 * hi_k;
        let (a, bn) = unsafe { (*qf.add(row * D + c), *qf.add(row * D + c + 1)) };
        unsafe { *ah_sh.add(e) = pack_f16x2(a * qscale, bn * qscale) };
        e += THREADS as usize;
    }
    ctx.sync_threads();
    let qs: [[f32; NG]; 2] =
        core::array::from_fn(|r| core::array::from_fn(|gi| unsafe { *qsum_sh.add((g as usize + 8 * r) * NG + gi) }));
    // Causal limit of the lane's two rows: positions below it (and, with a sliding
    // window, at or past `lim - window_keys`) are visible.
    let lim: [u32; 2] = core::array::from_fn(|r| {
        let row = r0 + g + 8 * r as u32;
        if row < rows_total { p.row_len(len, row / gqa) } else { len }
    });
    let keys = p.window_keys();
    let unscale_h = pow2(-k);
    // Quantized scores come in query units: `* unscale_q` is the log2-domain logit; the
    // query sums are taken into the same units (exact powers of two).
    let unscale_q = pow2(24 - k);
    let qsp: [[f32; NG]; 2] = qs.map(|r| r.map(|x| x * pow2(k - 24)));

    // The split, from the tile's first visible position on (its first row's window
    // start): nothing below it is read, block-table entries included.
    let (begin, end) = p.split_range(split, len);
    let begin = begin.max(p.row_start(len, r0 / gqa)).min(end);
    let (sinks, nq) = (fmt.sinks, fmt.quantized_len(len));
    let (qbeg, qend) = (fmt.sinks, fmt.sinks + nq);
    // Protected positions inside this split's quantized range: list entries [p_lo, p_hi).
    let (lo_pos, hi_pos) = (begin.max(qbeg), end.min(qend));
    let (mut p_lo, mut p_hi) = (0u32, 0u32);
    for jp in 0..fmt.protected {
        let pp = unsafe { *prot.add(jp as usize) };
        if pp < lo_pos {
            p_lo = jp + 1;
        }
        if pp < hi_pos {
            p_hi = jp + 1;
        }
    }
    let p_hi = p_hi.max(p_lo);
    let n_s = sinks.min(end).saturating_sub(begin);
    let n_p = p_hi - p_lo;
    let w_begin = begin.max(qend);
    let n_w = end.saturating_sub(w_begin);
    let n_f = n_s + n_p + n_w;

    let mut st = Soft { m: [f32::NEG_INFINITY; 2], l: [0.0; 2] };
    let mut o = [[0f32; 4]; NVT];
    let mut zl = [0f32; 4];
    let cph_v = per_half(VB) as usize;

    // 3. f16 rows: sinks, protected positions, window.
    let f16_row = |f: u32| -> (u32, u32, bool) {
        if f >= n_f {
            (0, 0, false)
        } else if f < n_s {
            (begin + f, begin + f, true)
        } else if f < n_s + n_p {
            let jp = p_lo + f - n_s;
            (unsafe { *prot.add(jp as usize) }, fmt.protected_row(jp), true)
        } else {
            let pos = w_begin + f - n_s - n_p;
            (pos, fmt.window_row(pos), true)
        }
    };
    let mut tile = warp;
    while tile * TILE < n_f {
        let f0 = tile * TILE;
        let mut s = [[0f32; 4]; 2];
        for (nt, sn) in s.iter_mut().enumerate() {
            let (_, row, ok) = f16_row(f0 + tile_token(nt as u32, g));
            let krow = unsafe { side.add(fmt.side_row_at(kvh, false, row)) };
            for ks in 0..NKS {
                // SAFETY: the natural-order fragments (shared memory, 16-byte aligned,
                // written before the barrier above) hold NKS x 32 lanes x 4 words.
                let a: [u32; 4] = unsafe { ctx.load_shared16(ah_sh.add((ks * WARP as usize + lane as usize) * 4)) };
                let c = 16 * ks + 2 * t as usize;
                let b =
                    if ok { unsafe { [*krow.add(c).cast::<u32>(), *krow.add(c + 8).cast::<u32>()] } } else { [0, 0] };
                *sn = ctx.mma_m16n8k16(a, b, *sn);
            }
        }
        let toks: [(u32, u32, bool); 4] = core::array::from_fn(|j| f16_row(f0 + 4 * t + j as u32));
        let tok = Tok { pos: toks.map(|x| x.0), ok: toks.map(|x| x.2) };
        mask(&mut s, &tok, lim, keys);
        let mut su = [s];
        softmax::<C, 1, NVT>(ctx, &mut st, &mut su, unscale_h, true, true, &mut o, &mut zl);
        let [s] = su;
        let a = [
            pack_f16x2(s[0][0], s[0][1]),
            pack_f16x2(s[0][2], s[0][3]),
            pack_f16x2(s[1][0], s[1][1]),
            pack_f16x2(s[1][2], s[1][3]),
        ];
        let vrows: [*const u16; 4] =
            core::array::from_fn(|j| unsafe { side.add(fmt.side_row_at(kvh, true, toks[j].1)) });
        for h in 0..NVT / cph_v {
            // n-tiles `h cph_v + ev` take channel `(8 h + g) cph_v + ev` of the lane's four
            // tokens: the `cph_v` channels of a token are one vector load (16 bytes for
            // 2-bit values, 8 for 4-bit; aligned, as rows and the side store are), two
            // f16 per word.
            let words: [[u32; 4]; 4] = core::array::from_fn(|j| {
                let at = unsafe { vrows[j].add((8 * h + g as usize) * cph_v) }.cast::<u8>();
                if !toks[j].2 {
                    [0; 4]
                } else if cph_v == 8 {
                    // SAFETY: 16 bytes of the token's value row, 16-byte aligned.
                    unsafe { ctx.load16(at) }
                } else {
                    // SAFETY: 8 bytes of the row, 8-byte aligned.
                    let x = unsafe { *at.cast::<u64>() };
                    [x as u32, (x >> 32) as u32, 0, 0]
                }
            });
            for ev in 0..cph_v {
                let half = |j: usize| (words[j][clamp_idx(ev / 2, 4)] >> (16 * (ev % 2))) & 0xffff;
                let b = [half(0) | half(1) << 16, half(2) | half(3) << 16];
                let n = clamp_idx(h * cph_v + ev, NVT);
                o[n] = ctx.mma_m16n8k16(a, b, o[n]);
            }
        }
        tile += WARPS;
    }
    if frags_in_area {
        // The rings below overwrite the natural-order fragments: every warp is done with
        // its f16 rows.
        ctx.sync_threads();
    }
    // From here on the value accumulators hold code-scaled sums: convert what the f16
    // rows left there into the same units (exact powers of two).
    for (n, on) in o.iter_mut().enumerate() {
        let f = pow2(factor_log2(VB, (n % cph_v) as u32) as i32 - 24);
        on.iter_mut().for_each(|x| *x *= f);
    }

    // 4. Quantized pages, tiles of 16 tokens aligned to the first quantized position.
    // Per-lane byte offsets inside a head-page that do not depend on the tile, computed
    // once; code widths are constants, so a tile's loads sit at constant offsets from
    // three pointers.
    let page_shift = fmt.page_size.trailing_zeros();
    let psz = fmt.page_size as usize;
    let kcb = D * KB as usize / 8;
    let vcb = D * VB as usize / 8;
    let page_bytes = fmt.page_bytes() as usize;
    let head_stride = p.num_kv_heads as usize * page_bytes;
    let pool_h = unsafe { pool.add(kvh as usize * page_bytes) };
    let lo = LaneOff {
        k: tile_token(0, g) as usize * kcb + 4 * t as usize,
        v: 4 * t as usize * vcb + 2 * g as usize,
        s: 8 * t as usize,
    };
    // The tile starting at quantized position `rel`: its block's head-page and slot.
    // Scales and zeros (docs/src/format.md): key scales, key zeros, value scales, value zeros, NG
    // groups each, one f16 array of the page's slots apiece.
    let tile_base = |rel: u32| -> (*const u8, usize) {
        // Clamped below the pool's blocks (`DecodeParams::block`): a stale or corrupt
        // entry reads a wrong page of the pool, never memory outside it.
        let blk = p.block(unsafe { *table.add((rel >> page_shift) as usize) });
        (unsafe { pool_h.add(blk as usize * head_stride) }, (rel & (fmt.page_size - 1)) as usize)
    };
    // The whole tile, for the ring's copies: its page's raw block-table entry read
    // apart (`ring_chunks` reads it an iteration early), then placed.
    let tile_entry = |rel: u32| -> u32 { unsafe { *table.add((rel >> page_shift) as usize) } };
    let tile_at = |rel: u32, entry: u32| -> TilePtr {
        // Clamped as in `tile_base`.
        let pb = unsafe { pool_h.add(p.block(entry) as usize * head_stride) };
        let slot0 = (rel & (fmt.page_size - 1)) as usize;
        unsafe {
            TilePtr {
                k: pb.add(slot0 * kcb),
                v: pb.add(psz * kcb + slot0 * vcb),
                s: pb.add(psz * (kcb + vcb) + 2 * slot0),
                sstride: 2 * psz,
            }
        }
    };
    // One tile's raw bytes for this lane, straight from the pool (the lane's offsets
    // folded into one per section, computed once).
    let (gk, gv, gs) = (lo.k, psz * kcb + lo.v, psz * (kcb + vcb) + lo.s);
    let load = |rel: u32| -> Raw<NG> {
        let (pb, slot0) = tile_base(rel);
        unsafe {
            let tp = TilePtr {
                k: pb.add(slot0 * kcb + gk),
                v: pb.add(slot0 * vcb + gv),
                s: pb.add(2 * slot0 + gs),
                sstride: 2 * psz,
            };
            read_tile::<C, D, KB, VB, NG>(ctx, tp)
        }
    };
    if lo_pos < hi_pos {
        let first = (lo_pos - qbeg) / TILE;
        let last = (hi_pos - qbeg).div_ceil(TILE);
        // 4a. The steady state: chunks of `ut` tiles (one softmax update; see
        // [`chunk_tiles`]) that need no mask: inside the split, inside every row's
        // window (below the smallest causal limit, at or past the largest window start),
        // and holding no protected position. The chunks of [f0, f1) run in segments
        // between the chunks that hold one (those go through the masked loop below), so
        // a protected position costs its own chunk, not the split. Chunk `c` of a segment
        // is tiles `a + ut c ..`, taken by warp `(rot + c) mod WARPS` with `rot` the chunks
        // of the segments before it (so the warps share them evenly). Block-uniform: the
        // smallest causal limit of the tile's rows is that of its first row, the largest
        // start that of its last.
        let min_lim = p.row_len(len, r0 / gqa);
        let max_start = p.row_start(len, ((r0 + ROWS).min(rows_total) - 1) / gqa);
        let fast_end = hi_pos.min(min_lim);
        let ut = const { chunk_tiles(D as u32, VB, NG as u32) };
        let f0 = (lo_pos.max(max_start) - qbeg).div_ceil(ut * TILE) * ut;
        let f1 = if fast_end > qbeg { (fast_end - qbeg) / (ut * TILE) * ut } else { 0 };
        let (f0, f1) = if f1 > f0 { (f0, f1) } else { (last, last) };
        // The first tile of the chunk holding protected position number `jp` of the list
        // (`p_lo <= jp < p_hi`: inside the split's quantized range).
        let chunk_of = |jp: u32| (unsafe { *prot.add(jp as usize) } - qbeg) / (ut * TILE) * ut;
        let cur_args = (ctx, aq_sh.cast_const(), &qsp, unscale_q);
        let stages = const { ring_stages(D as u32, KB, VB, NG as u32) };
        // The warp's ring, a byte offset into the area (idle from the fragments' barrier in
        // section 2 to the first merge pass's barrier in section 6).
        let ring = warp * stages * ut * tile_bytes(D as u32, KB, VB, NG as u32);
        let src = (&tile_entry, &tile_at, lo.s, ring);
        let (mut a, mut jp, mut rot) = (f0, p_lo, 0u32);
        while a < f1 {
            // The segment [a, b): up to the next chunk holding a protected position.
            let mut b = f1;
            while jp < p_hi {
                let c = chunk_of(jp);
                if c >= a {
                    b = c.min(f1);
                    break;
                }
                jp += 1;
            }
            let nchunks = (b - a) / ut;
            if stages == RING && ut == 2 {
                ring_chunks::<C, D, KB, VB, NG, NKS, NVT, 2, RING>(
                    cur_args, src, a, nchunks, rot, &mut st, &mut o, &mut zl,
                );
            } else if stages == RING && ut == 1 {
                ring_chunks::<C, D, KB, VB, NG, NKS, NVT, 1, RING>(
                    cur_args, src, a, nchunks, rot, &mut st, &mut o, &mut zl,
                );
            } else if stages == 2 && ut == 2 {
                ring_chunks::<C, D, KB, VB, NG, NKS, NVT, 2, 2>(
                    cur_args, src, a, nchunks, rot, &mut st, &mut o, &mut zl,
                );
            } else if stages == 2 && ut == 1 {
                ring_chunks::<C, D, KB, VB, NG, NKS, NVT, 1, 2>(
                    cur_args, src, a, nchunks, rot, &mut st, &mut o, &mut zl,
                );
            } else if ut == 4 {
                fast_chunks::<C, KB, VB, NG, NKS, NVT, 4>(cur_args, &load, a, nchunks, rot, &mut st, &mut o, &mut zl);
            } else if ut == 2 {
                fast_chunks::<C, KB, VB, NG, NKS, NVT, 2>(cur_args, &load, a, nchunks, rot, &mut st, &mut o, &mut zl);
            } else {
                fast_chunks::<C, KB, VB, NG, NKS, NVT, 1>(cur_args, &load, a, nchunks, rot, &mut st, &mut o, &mut zl);
            }
            rot = (rot + nchunks) % WARPS;
            a = b + ut;
        }
        // 4b. Every other tile (the split's ends, tiles under a causal limit, the chunks
        // of [f0, f1) that hold a protected position, a split too short for a chunk), one
        // at a time with masks: tiles [first, f0), then those chunks' tiles, then [f1,
        // last) (ascending, so each warp walks the protected list forward); tile i of them
        // by warp i mod WARPS.
        let mut n_pc = 0u32;
        let mut prev = u32::MAX;
        for jp in p_lo..p_hi {
            let c = chunk_of(jp);
            if c >= f0 && c < f1 && c != prev {
                n_pc += 1;
                prev = c;
            }
        }
        let n_head = f0 - first;
        let n_mid = n_pc * ut;
        let n_masked = n_head + n_mid + (last - f1);
        let tile_of = |i: u32| -> u32 {
            if i < n_head {
                first + i
            } else if i < n_head + n_mid {
                // Tile `u` of the `k`-th protected chunk (a short walk of the list: the
                // masked loop is not the hot one).
                let (k, u) = ((i - n_head) / ut, (i - n_head) % ut);
                let (mut seen, mut prev, mut at) = (0u32, u32::MAX, f0);
                for jp in p_lo..p_hi {
                    let c = chunk_of(jp);
                    if c >= f0 && c < f1 && c != prev {
                        if seen == k {
                            at = c;
                            break;
                        }
                        seen += 1;
                        prev = c;
                    }
                }
                at + u
            } else {
                f1 + i - n_head - n_mid
            }
        };
        let mut pn = p_lo;
        let mut i = warp;
        while i < n_masked {
            let tile = tile_of(i);
            let raw = load(tile * TILE);
            let t0 = qbeg + tile * TILE;
            // Protected positions of this tile (read as f16 rows above).
            while pn < p_hi && unsafe { *prot.add(pn as usize) } < t0 {
                pn += 1;
            }
            let mut pmask = 0u32;
            let mut jp = pn;
            while jp < p_hi {
                let pp = unsafe { *prot.add(jp as usize) };
                if pp >= t0 + TILE {
                    break;
                }
                pmask |= 1 << (pp - t0);
                jp += 1;
            }
            let [mut s] = scores::<C, 1, KB, NG, NKS>(ctx, aq_sh, &[raw], &qsp);
            let tok = Tok {
                pos: core::array::from_fn(|j| t0 + 4 * t + j as u32),
                ok: core::array::from_fn(|j| {
                    let pos = t0 + 4 * t + j as u32;
                    pos >= lo_pos && pos < hi_pos && pmask & (1 << (4 * t + j as u32)) == 0
                }),
            };
            mask(&mut s, &tok, lim, keys);
            let mut su = [s];
            softmax::<C, 1, NVT>(ctx, &mut st, &mut su, unscale_q, true, false, &mut o, &mut zl);
            values::<C, VB, NG, NVT>(ctx, &su[0], &raw, &mut o, &mut zl);
            i += WARPS;
        }
    }

    // 5. The warp's partials: the f16 rows' weight sums over the row's four lanes, plus
    // the quantized tiles' (already summed over the row by the MMA), values back to units.
    let (zs, lq) = zl_parts::<C, NG>(ctx, &zl);
    for r in 0..2 {
        st.l[r] += ctx.shfl_xor(st.l[r], 1);
        st.l[r] += ctx.shfl_xor(st.l[r], 2);
        st.l[r] += lq[r];
    }
    // 6. Merge the warps and write the split's partials, `mc` channels per pass (all of
    // them up to head_dim 128): each warp's values of the pass, then the merge.
    let mc = merge_channels(D as u32) as usize;
    let mo = qf;
    let mm = unsafe { mo.add(WARPS as usize * ROWS as usize * mc) };
    let ml = unsafe { mm.add(WARPS as usize * ROWS as usize) };
    for pass in 0..D / mc {
        // Everyone is done with the query area (or the ring), or the previous pass.
        ctx.sync_threads();
        for (n, on) in o.iter().enumerate() {
            let (h, ev) = (n / cph_v, n % cph_v);
            // n-tiles `h cph_v ..` hold channels `8 h cph_v .. 8 (h + 1) cph_v`, within
            // one pass (`mc` is a multiple of 32).
            if 8 * h * cph_v / mc != pass {
                continue;
            }
            let f = pow2(24 - factor_log2(VB, ev as u32) as i32);
            let gi = clamp_idx(h * (128 / VB as usize) / gsize as usize, NG);
            for (c, &x) in on.iter().enumerate() {
                let row = g as usize + 8 * (c / 2);
                let col = 2 * t as usize + (c & 1);
                let ch = (8 * h + col) * cph_v + ev - pass * mc;
                unsafe { *mo.add((warp as usize * ROWS as usize + row) * mc + ch) = x * f + zs[c / 2][gi] };
            }
        }
        if pass == 0 && t == 0 {
            for r in 0..2 {
                let row = warp as usize * ROWS as usize + g as usize + 8 * r;
                unsafe {
                    *mm.add(row) = st.m[r];
                    *ml.add(row) = st.l[r];
                }
            }
        }
        ctx.sync_threads();

        let mut e = tid as usize;
        while e < ROWS as usize * mc {
            let (r, c) = (e / mc, e % mc);
            let row = r0 + r as u32;
            if row < rows_total {
                let mut m = f32::NEG_INFINITY;
                for w in 0..WARPS as usize {
                    m = m.max(unsafe { *mm.add(w * ROWS as usize + r) });
                }
                let (mut l, mut acc) = (0f32, 0f32);
                for w in 0..WARPS as usize {
                    let mw = unsafe { *mm.add(w * ROWS as usize + r) };
                    let (lw, ow) =
                        unsafe { (*ml.add(w * ROWS as usize + r), *mo.add((w * ROWS as usize + r) * mc + c)) };
                    if m != f32::NEG_INFINITY && mw != f32::NEG_INFINITY {
                        let cw = exp2_neg(mw - m);
                        l += cw * lw;
                        acc += cw * ow;
                    } else if mw == f32::NEG_INFINITY && lw.is_nan() {
                        // A warp whose scores were all NaN (a non-finite query) keeps
                        // its NaN, so the row stays NaN; an empty range adds nothing.
                        l += lw;
                        acc += ow;
                    }
                }
                let (i, h) = (row / gqa, row % gqa);
                let out_row = ((row_base + i) * hq + kvh * gqa + h) as usize * nsplit as usize + split as usize;
                let ch = pass * mc + c;
                unsafe { *part_o.add(out_row * D + ch) = acc };
                if ch == 0 {
                    unsafe {
                        *part_m.add(out_row) = m * core::f32::consts::LN_2;
                        *part_l.add(out_row) = l;
                    }
                }
            }
            e += THREADS as usize;
        }
    }
}

/// Calls `$m!` with every `decode_mma` instantiation: `(entry point, head_dim, channels
/// per lane, key bits, value bits, groups per head, score k-steps, value n-tiles)`.
/// Group sizes of at least 64 channels, at head_dim 256 groups of 128; other
/// configurations run `decode_split`.
#[macro_export]
macro_rules! for_each_decode_mma {
    ($m:ident) => {
        $m! {
            (rotkv_decode_mma_d64_k2v2_g64, 64, 2, 2, 2, 1, 4, 8),
            (rotkv_decode_mma_d64_k2v4_g64, 64, 2, 2, 4, 1, 4, 8),
            (rotkv_decode_mma_d64_k4v2_g64, 64, 2, 4, 2, 1, 4, 8),
            (rotkv_decode_mma_d64_k4v4_g64, 64, 2, 4, 4, 1, 4, 8),
            (rotkv_decode_mma_d128_k2v2_g128, 128, 4, 2, 2, 1, 8, 16),
            (rotkv_decode_mma_d128_k2v4_g128, 128, 4, 2, 4, 1, 8, 16),
            (rotkv_decode_mma_d128_k4v2_g128, 128, 4, 4, 2, 1, 8, 16),
            (rotkv_decode_mma_d128_k4v4_g128, 128, 4, 4, 4, 1, 8, 16),
            (rotkv_decode_mma_d128_k2v2_g64, 128, 4, 2, 2, 2, 8, 16),
            (rotkv_decode_mma_d128_k2v4_g64, 128, 4, 2, 4, 2, 8, 16),
            (rotkv_decode_mma_d128_k4v2_g64, 128, 4, 4, 2, 2, 8, 16),
            (rotkv_decode_mma_d128_k4v4_g64, 128, 4, 4, 4, 2, 8, 16),
            (rotkv_decode_mma_d256_k2v2_g128, 256, 8, 2, 2, 2, 16, 32),
            (rotkv_decode_mma_d256_k2v4_g128, 256, 8, 2, 4, 2, 16, 32),
            (rotkv_decode_mma_d256_k4v2_g128, 256, 8, 4, 2, 2, 16, 32),
            (rotkv_decode_mma_d256_k4v4_g128, 256, 8, 4, 4, 2, 16, 32)
        }
    };
}

#[cfg(target_arch = "nvptx64")]
mod entry {
    use super::decode_mma;
    use crate::ctx::Nvptx;
    use crate::params::DecodeParams;

    macro_rules! mma_entries {
        ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal, $ng:literal, $nks:literal, $nvt:literal)),* $(,)?) => {$(
            /// PTX entry point of [`decode_mma`] for one (head_dim, key bits, value bits,
            /// groups per head).
            ///
            /// # Safety
            /// See [`decode_mma`].
            #[unsafe(no_mangle)]
            pub unsafe extern "ptx-kernel" fn $name(
                p: DecodeParams,
                q: *const u8,
                pool: *const u8,
                block_tables: *const u32,
                seq_lens: *const u32,
                sides: *const u16,
                protected: *const u32,
                key_scale: *const f32,
                key_perm: *const u16,
                key_rot: *const f32,
                part_m: *mut f32,
                part_l: *mut f32,
                part_o: *mut f32,
                meta: *const u32,
            ) {
                // SAFETY: forwarded contract of `decode_mma`.
                unsafe {
                    decode_mma::<_, $d, $v, $kb, $vb, $ng, $nks, $nvt>(
                        &Nvptx, &p, q, pool, block_tables, seq_lens, sides, protected, key_scale, key_perm, key_rot,
                        part_m, part_l, part_o, meta,
                    )
                }
            }
        )*};
    }
    crate::for_each_decode_mma!(mma_entries);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extraction_covers_every_code_once_with_its_power_of_two() {
        for bits in [2u32, 4] {
            let n = per_half(bits);
            // A word whose code j of the low half is j % 2^b + 1 (clamped), high half
            // reversed, so any mix-up shows.
            let mask = (1u32 << bits) - 1;
            let lo: [u32; 8] = core::array::from_fn(|j| (j as u32 * 7 + 1) & mask);
            let hi: [u32; 8] = core::array::from_fn(|j| (j as u32 * 5 + 2) & mask);
            let mut w = 0u32;
            for j in 0..n {
                w |= lo[j as usize] << (bits * j) | hi[j as usize] << (16 + bits * j);
            }
            let x = w >> (bits * direct(bits));
            for j in 0..n {
                let r = extract(bits, w, x, j);
                let f = 1u32 << factor_log2(bits, j);
                // As f16 bit patterns below 2^10: mantissa bits only, value code * f.
                assert_eq!(r & 0xffff, lo[j as usize] * f, "bits {bits} j {j}");
                assert_eq!(r >> 16, hi[j as usize] * f, "bits {bits} j {j}");
                assert!((r & 0xffff) < 1024 && (r >> 16) < 1024);
            }
        }
    }

    #[test]
    fn rings_fit_the_area_of_the_entry_points_that_have_them() {
        macro_rules! entries {
            ($(($name:ident, $d:literal, $v:literal, $kb:literal, $vb:literal, $ng:literal, $nks:literal, $nvt:literal)),* $(,)?) => {
                [$((stringify!($name), $d, $kb, $vb, $ng)),*]
            };
        }
        let all: [(&str, u32, u32, u32, u32); 16] = crate::for_each_decode_mma!(entries);
        let (mut rings, mut n) = ([("", 0); 16], 0);
        for (name, d, kb, vb, ng) in all {
            // A tile is whole 16-byte pieces: 16 tokens of codes, 4 NG arrays of 16 f16.
            assert_eq!(tile_bytes(d, kb, vb, ng), 16 * (d * kb / 8 + d * vb / 8 + 8 * ng), "{name}");
            // Everything within the 48 KiB a kernel may use without opting in; the setup's
            // queries and one merge pass within the area.
            let area = area_bytes(d, kb, vb, ng);
            assert!(mma_shared_bytes(d, kb, vb, ng) <= 48 * 1024, "{name}");
            assert!(setup_bytes(d) <= area && merge_bytes(d) <= area, "{name}");
            // The natural-order fragments, where they live in the area, start 16-byte
            // aligned after the rotated queries and row maxima.
            assert_eq!(ROWS * (d + 1) * 4 % 16, 0);
            assert_eq!(d % merge_channels(d), 0);
            let stages = ring_stages(d, kb, vb, ng);
            if stages > 0 {
                assert!(WARPS * stages * chunk_tiles(d, vb, ng) * tile_bytes(d, kb, vb, ng) <= area, "{name}");
                rings[n] = (name, stages);
                n += 1;
            }
            // Without a ring (head_dim 64 with 64-token chunks) the area is the merge
            // area.
            if stages == 0 && d <= 128 {
                assert_eq!(area, merge_bytes(d), "{name}");
            }
        }
        assert_eq!(
            rings[..n],
            [
                ("rotkv_decode_mma_d64_k2v4_g64", 3),
                ("rotkv_decode_mma_d64_k4v4_g64", 3),
                ("rotkv_decode_mma_d128_k2v2_g128", 3),
                ("rotkv_decode_mma_d128_k2v4_g128", 3),
                ("rotkv_decode_mma_d128_k4v2_g128", 3),
                ("rotkv_decode_mma_d128_k4v4_g128", 2),
                ("rotkv_decode_mma_d128_k2v2_g64", 3),
                ("rotkv_decode_mma_d128_k2v4_g64", 3),
                ("rotkv_decode_mma_d128_k4v2_g64", 2),
                ("rotkv_decode_mma_d128_k4v4_g64", 3),
                ("rotkv_decode_mma_d256_k2v2_g128", 3),
                ("rotkv_decode_mma_d256_k2v4_g128", 3),
                ("rotkv_decode_mma_d256_k4v2_g128", 3),
                ("rotkv_decode_mma_d256_k4v4_g128", 2),
            ]
        );
    }

    #[test]
    fn source_piece_splits_by_rounds() {
        // What `copy_tile`'s per-section rounds rely on: with at least two pieces per
        // token, lane L's piece of round r is its piece of round 0 plus a constant.
        for pieces in [2usize, 4, 8] {
            for r in 0..16 * pieces / 32 {
                for lane in 0..32 {
                    let at = lane + 32 * r;
                    assert_eq!(
                        source_piece(at, pieces),
                        source_piece(lane, pieces) + source_piece(32 * r, pieces),
                        "pieces {pieces} round {r} lane {lane}"
                    );
                }
            }
        }
    }

    /// Where piece `b` of token `j` lies in a stage section: `source_piece`'s inverse,
    /// written from `tile_token` (`nt` = bit 1 of `j`, `r = 2 (j / 4) + j % 2`).
    fn stage_piece(j: usize, b: usize, pieces: usize) -> usize {
        (((j >> 1) & 1) * pieces + b) * 8 + 2 * (j >> 2) + (j & 1)
    }

    #[test]
    fn stage_pieces_are_a_permutation_with_each_matrix_on_all_bank_groups() {
        for pieces in [1usize, 2, 4, 8] {
            let mut seen = [false; 128];
            for j in 0..16 {
                for b in 0..pieces {
                    let at = stage_piece(j, b, pieces);
                    assert!(at < 16 * pieces && !seen[at], "pieces {pieces} token {j} piece {b}");
                    seen[at] = true;
                    assert_eq!(source_piece(at, pieces), j * pieces + b);
                }
            }
            // Row r of matrix (nt, b): token tile_token(nt, r), piece b, at unit 8 m + r.
            for nt in 0..2 {
                for b in 0..pieces {
                    for r in 0..8 {
                        let j = tile_token(nt as u32, r as u32) as usize;
                        assert_eq!(stage_piece(j, b, pieces), 8 * (nt * pieces + b) + r);
                    }
                }
            }
        }
    }

    #[test]
    fn tile_tokens_are_a_permutation_and_lane_columns_are_contiguous() {
        let mut seen = [false; 16];
        for nt in 0..2 {
            for n in 0..8 {
                let tk = tile_token(nt, n) as usize;
                assert!(!seen[tk]);
                seen[tk] = true;
            }
        }
        for t in 0..4 {
            assert_eq!(
                [tile_token(0, 2 * t), tile_token(0, 2 * t + 1), tile_token(1, 2 * t), tile_token(1, 2 * t + 1)],
                [4 * t, 4 * t + 1, 4 * t + 2, 4 * t + 3]
            );
        }
    }
}
