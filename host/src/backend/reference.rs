//! The scalar f64 reference: the oracle every other backend is tested against.
//!
//! Obviously correct before fast: no unsafe, no threads, no lookup tables, one token at
//! a time, every number in f64 except the values the format stores (f16 rows, f16
//! scales and zeros, packed codes). It reads and writes the same bytes as every other
//! backend (layout in `docs/src/format.md`, offsets from [`rotkv_kernels::layout::Format`]).
//!
//! The functions here trust their arguments: shapes, block tables and values are
//! checked once by [`crate::paged`] before any backend runs.

use crate::config::{HeadRotation, LayerCalibration};
use half::f16;
use rotkv_kernels::layout::{Format, NO_CLIP, Place, clip_range};
use rotkv_kernels::math::f64_to_f16;
use rotkv_kernels::params::{AppendParams, DecodeParams};

/// In-place orthonormal fast Walsh-Hadamard transform: `x -> x H_n`, with `H_n` the
/// Sylvester Hadamard matrix in natural order divided by `sqrt(n)`. `n` must be a power
/// of two (or zero: nothing to do). The transform is its own inverse.
///
/// # Panics
///
/// When the length is not a power of two (in release builds too: the butterflies would
/// index past the end). Head dimensions reach it only after
/// [`crate::config::check_head_dim`].
pub fn fwht(x: &mut [f64]) {
    let n = x.len();
    if n == 0 {
        return;
    }
    assert!(n.is_power_of_two(), "fwht of {n} values: the length must be a power of two");
    let mut h = 1;
    while h < n {
        for start in (0..n).step_by(2 * h) {
            for j in start..start + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f64).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

/// Forward rotation into the stored channel order: `y[j] = (x R)[perm[j]]` with `R` the
/// Hadamard matrix, a dense learned rotation, or the identity.
pub fn rotate(x: &[f64], rot: HeadRotation<'_>, perm: &[u16]) -> Vec<f64> {
    let t = match rot {
        HeadRotation::None => x.to_vec(),
        HeadRotation::Hadamard => {
            let mut t = x.to_vec();
            fwht(&mut t);
            t
        }
        HeadRotation::Dense(r) => {
            let d = x.len();
            (0..d).map(|j| (0..d).map(|i| x[i] * r[i * d + j] as f64).sum()).collect()
        }
    };
    perm.iter().map(|&p| t[p as usize]).collect()
}

/// Inverse of [`rotate`]: un-permute, then `y R^T` (the FWHT is its own inverse).
pub fn unrotate(y: &[f64], rot: HeadRotation<'_>, perm: &[u16]) -> Vec<f64> {
    let mut t = vec![0.0; y.len()];
    for (j, &p) in perm.iter().enumerate() {
        t[p as usize] = y[j];
    }
    match rot {
        HeadRotation::None => t,
        HeadRotation::Hadamard => {
            fwht(&mut t);
            t
        }
        HeadRotation::Dense(r) => {
            let d = t.len();
            (0..d).map(|i| (0..d).map(|j| t[j] * r[i * d + j] as f64).sum()).collect()
        }
    }
}

/// One quantized group: f16 scale and zero and one code per channel.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantGroup {
    /// `(max - min) / (2^bits - 1)`, rounded to f16.
    pub scale: f16,
    /// `min`, rounded to f16.
    pub zero: f16,
    /// `clamp(round((x - zero) / scale), 0, 2^bits - 1)` against the stored scale and zero
    /// (0 where the stored scale is 0). Rounding is half away from zero.
    pub codes: Vec<u8>,
}

/// Asymmetric round-to-nearest quantization of one group (see DESIGN.md).
pub fn quantize_group(x: &[f64], bits: u32) -> QuantGroup {
    quantize_group_clipped(x, bits, NO_CLIP)
}

/// [`quantize_group`] over the range [`clip_range`] keeps for a Q16 clip ratio (the
/// whole range at [`NO_CLIP`]); values outside it get code 0 or the top code. Scale and
/// zero are rounded to f16 directly from f64 (`half`'s `from_f64` rounds through f32
/// and differs in rare double-rounding cases).
pub fn quantize_group_clipped(x: &[f64], bits: u32, clip_q16: u32) -> QuantGroup {
    let (lo, hi) = group_range(x);
    let (lo, hi) = clip_range(lo, hi, clip_q16);
    let levels = ((1u32 << bits) - 1) as f64;
    let scale = f16::from_bits(f64_to_f16((hi - lo) / levels));
    let zero = f16::from_bits(f64_to_f16(lo));
    let (s, z) = (scale.to_f64(), zero.to_f64());
    let codes = x.iter().map(|&v| if s == 0.0 { 0 } else { ((v - z) / s).round().clamp(0.0, levels) as u8 }).collect();
    QuantGroup { scale, zero, codes }
}

/// `(min, max)` of a group, folded left to right with `f64::min` / `f64::max`. Which
/// zero wins between `-0.0` and `0.0` is what these functions do on this target; one
/// non-inlined copy of this code decides it for the reference and for the CPU backend's
/// quantizers alike (they call it whenever the minimum or maximum is a zero).
#[inline(never)]
pub fn group_range(x: &[f64]) -> (f64, f64) {
    let lo = x.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// `code * scale + zero` for every code of a group.
pub fn dequantize_group(g: &QuantGroup) -> Vec<f64> {
    let (s, z) = (g.scale.to_f64(), g.zero.to_f64());
    g.codes.iter().map(|&c| c as f64 * s + z).collect()
}

/// Packs codes of `bits` bits: channel `c` sits in byte `c * bits / 8` at bit
/// `(c * bits) % 8` (little-endian, low bits first), so 32-bit word `w` of a token holds
/// channels `[w * 32 / bits, (w + 1) * 32 / bits)` in order.
pub fn pack_codes(codes: &[u8], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; codes.len() * bits as usize / 8];
    for (c, &code) in codes.iter().enumerate() {
        let bit = c * bits as usize;
        out[bit / 8] |= code << (bit % 8);
    }
    out
}

/// Inverse of [`pack_codes`] for `n` channels.
pub fn unpack_codes(bytes: &[u8], bits: u32, n: usize) -> Vec<u8> {
    let mask = ((1u32 << bits) - 1) as u8;
    (0..n)
        .map(|c| {
            let bit = c * bits as usize;
            (bytes[bit / 8] >> (bit % 8)) & mask
        })
        .collect()
}

/// Quantizes one stored-order row into packed codes and `(scale, zero)` f16 pairs.
pub fn quantize_row(row: &[f64], bits: u32, group: usize, clip_q16: u32, codes: &mut [u8], params: &mut [u8]) {
    let mut all = Vec::with_capacity(row.len());
    for (j, chunk) in row.chunks_exact(group).enumerate() {
        let q = quantize_group_clipped(chunk, bits, clip_q16);
        params[4 * j..4 * j + 2].copy_from_slice(&q.scale.to_le_bytes());
        params[4 * j + 2..4 * j + 4].copy_from_slice(&q.zero.to_le_bytes());
        all.extend_from_slice(&q.codes);
    }
    codes.copy_from_slice(&pack_codes(&all, bits));
}

/// Dequantizes one packed row.
pub fn dequantize_row(codes: &[u8], params: &[u8], bits: u32, group: usize, n: usize) -> Vec<f64> {
    let all = unpack_codes(codes, bits, n);
    all.chunks_exact(group)
        .enumerate()
        .flat_map(|(j, c)| {
            let scale = f16::from_le_bytes([params[4 * j], params[4 * j + 1]]);
            let zero = f16::from_le_bytes([params[4 * j + 2], params[4 * j + 3]]);
            dequantize_group(&QuantGroup { scale, zero, codes: c.to_vec() })
        })
        .collect()
}

/// The rotated, centered and smoothed key row of one token and head as the format
/// stores it in f16 (sinks, window) and as the quantizer sees it:
/// `rotate((k - mean) / scale)`.
pub fn stored_key(k: &[f32], mean: &[f32], scale: &[f32], rot: HeadRotation<'_>, perm: &[u16]) -> Vec<f16> {
    let x: Vec<f64> = k.iter().zip(mean).zip(scale).map(|((&a, &m), &s)| (a as f64 - m as f64) / s as f64).collect();
    rotate(&x, rot, perm).into_iter().map(f16::from_f64).collect()
}

/// The rotated value row of one token and head as the format stores it in f16.
pub fn stored_value(v: &[f32], rot: HeadRotation<'_>, perm: &[u16]) -> Vec<f16> {
    let x: Vec<f64> = v.iter().map(|&a| a as f64).collect();
    rotate(&x, rot, perm).into_iter().map(f16::from_f64).collect()
}

/// Appends `p.count` tokens (`k[t * p.token_stride + h * p.head_stride + c]`,
/// `v[t * p.v_token_stride + h * p.head_stride + c]`) to a sequence of `p.start` tokens, one token at a time: each goes to a sink row
/// or the window ring (and, when its position is in `protected`, to its protected row
/// too); when the window reaches `window + page_size` tokens its oldest page is
/// quantized into the page `block_table[page]`.
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
    let d = fmt.head_dim as usize;
    let hkv = p.num_kv_heads as usize;
    for i in 0..p.count as usize {
        let pos = p.start + i as u32;
        for h in 0..hkv {
            let (mean, kperm, vperm) = calib.head(h, d);
            let x = i * p.token_stride as usize + h * p.head_stride as usize;
            let y = i * p.v_token_stride as usize + h * p.head_stride as usize;
            let rows = [
                stored_key(&k[x..x + d], mean, calib.head_key_scale(h, d), calib.rotation(false, h, d, p.flags), kperm),
                stored_value(&v[y..y + d], calib.rotation(true, h, d, p.flags), vperm),
            ];
            // A new token enters the sinks or the window (and may be flushed just below);
            // a protected one is copied to its protected row as well.
            let row = if pos < fmt.sinks { pos } else { fmt.window_row(pos) };
            let copy = protected_index(protected, pos).map(|i| fmt.protected_row(i));
            for dest in std::iter::once(row).chain(copy) {
                for (which, r) in rows.iter().enumerate() {
                    let at = fmt.side_row_at(h as u32, which == 1, dest);
                    side[at..at + d].copy_from_slice(r);
                }
            }
        }
        if fmt.quantized_len(pos + 1) > fmt.quantized_len(pos) {
            flush_page(fmt, hkv, pool, block_table, side, pos + 1);
        }
    }
}

/// The `(scale, zero)` pairs of one slot's key or value, gathered from the page's planar
/// params into the row-local layout [`quantize_row`] writes (`[group][scale, zero]`).
pub fn page_params(fmt: &Format, page: &[u8], value: bool, slot: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(fmt.param_bytes() as usize);
    for j in 0..fmt.groups() {
        for at in [fmt.scale_at(value, j, slot), fmt.zero_at(value, j, slot)] {
            out.extend_from_slice(&page[at as usize..at as usize + 2]);
        }
    }
    out
}

/// Scatters row-local `(scale, zero)` pairs (as [`quantize_row`] writes them) into the
/// page's planar params.
pub fn set_page_params(fmt: &Format, page: &mut [u8], value: bool, slot: u32, params: &[u8]) {
    for j in 0..fmt.groups() {
        let (s, z) = (fmt.scale_at(value, j, slot) as usize, fmt.zero_at(value, j, slot) as usize);
        let p = 4 * j as usize;
        page[s..s + 2].copy_from_slice(&params[p..p + 2]);
        page[z..z + 2].copy_from_slice(&params[p + 2..p + 4]);
    }
}

/// Quantizes the newest page of a sequence that just reached `len` tokens from its
/// window rows.
fn flush_page(fmt: &Format, num_kv_heads: usize, pool: &mut [u8], block_table: &[u32], side: &[f16], len: u32) {
    let d = fmt.head_dim as usize;
    let page = fmt.pages_for(len) - 1;
    let block = block_table[page as usize];
    for h in 0..num_kv_heads as u32 {
        let base = fmt.page_offset(block, h, num_kv_heads as u32);
        let head_page = &mut pool[base..base + fmt.page_bytes() as usize];
        for value in [false, true] {
            let rows: Vec<f64> = (0..fmt.page_size)
                .flat_map(|slot| {
                    let at = fmt.side_row_at(h, value, fmt.window_row(fmt.sinks + page * fmt.page_size + slot));
                    side[at..at + d].iter().map(|v| v.to_f64())
                })
                .collect();
            quantize_page(fmt, &rows, value, head_page);
        }
    }
}

/// Quantizes the `page_size` stored rows `rows` (`[slot][head_dim]`) of one head-page's
/// keys (`value == false`) or values into it: with variance normalization
/// ([`Format::channel_norm`]) its channel scales first ([`channel_scales`]), each row
/// divided by them, then [`quantize_row`] per slot.
pub fn quantize_page(fmt: &Format, rows: &[f64], value: bool, head_page: &mut [u8]) {
    let d = fmt.head_dim as usize;
    let scales = (fmt.channel_norm > 0).then(|| channel_scales(rows, d, fmt.channel_norm));
    if let Some(sc) = &scales {
        for (c, s) in sc.iter().enumerate() {
            let at = fmt.channel_scale_at(value, c as u32) as usize;
            head_page[at..at + 2].copy_from_slice(&s.to_le_bytes());
        }
    }
    let mut params = vec![0u8; fmt.param_bytes() as usize];
    for (slot, row) in rows.chunks_exact(d).enumerate() {
        let slot = slot as u32;
        let x: Vec<f64> = match &scales {
            Some(sc) => row.iter().zip(sc).map(|(x, s)| x / s.to_f64()).collect(),
            None => row.to_vec(),
        };
        let c = fmt.codes_at(value, slot) as usize;
        let codes = &mut head_page[c..c + fmt.code_bytes(value) as usize];
        quantize_row(&x, fmt.bits(value), fmt.group_size as usize, fmt.clip(value), codes, &mut params);
        set_page_params(fmt, head_page, value, slot, &params);
    }
}

/// KVarN channel scales of a page's rows `[tokens][d]`: `iters` Sinkhorn iterations,
/// each setting every channel's scale to its RMS over the tokens (with tokens divided by
/// their scales) and then every token's scale to its RMS over the channels (divided by
/// the channel scales); all-zero channels and tokens get scale 1. The channel scales are
/// normalized to an RMS of 1 (the per-token scale and zero of the quantizer carry the
/// token scales, which are not stored), floored so that no row value divided by them
/// exceeds 32768 in magnitude (and at the smallest normal f16), and rounded to f16.
pub fn channel_scales(rows: &[f64], d: usize, iters: u32) -> Vec<f16> {
    let n = rows.len() / d;
    let rms = |it: &mut dyn Iterator<Item = f64>, count: usize| -> f64 {
        let r = (it.map(|v| v * v).sum::<f64>() / count as f64).sqrt();
        if r > 0.0 { r } else { 1.0 }
    };
    let (mut tok, mut ch) = (vec![1f64; n], vec![1f64; d]);
    for _ in 0..iters {
        for (c, s) in ch.iter_mut().enumerate() {
            *s = rms(&mut (0..n).map(|t| rows[t * d + c] / tok[t]), n);
        }
        for (t, s) in tok.iter_mut().enumerate() {
            *s = rms(&mut (0..d).map(|c| rows[t * d + c] / ch[c]), d);
        }
    }
    let norm = rms(&mut ch.iter().copied(), d);
    (0..d)
        .map(|c| {
            let peak = (0..n).map(|t| rows[t * d + c].abs()).fold(0.0, f64::max);
            let floor = (peak / 32768.0).max(f16::MIN_POSITIVE.to_f64());
            f16::from_bits(f64_to_f16((ch[c] / norm).max(floor)))
        })
        .collect()
}

/// The channel scales of a head-page's keys or values as f64 (variance normalization).
pub fn page_channel_scales(fmt: &Format, head_page: &[u8], value: bool) -> Vec<f64> {
    (0..fmt.head_dim)
        .map(|c| {
            let at = fmt.channel_scale_at(value, c) as usize;
            f16::from_le_bytes([head_page[at], head_page[at + 1]]).to_f64()
        })
        .collect()
}

/// One sequence as decode sees it: its block table, its side store, its length and its
/// protected positions.
#[derive(Clone, Copy, Debug)]
pub struct SeqRef<'a> {
    /// Logical page -> physical block.
    pub block_table: &'a [u32],
    /// The sequence's f16 side store for this layer (sinks, window, protected rows).
    pub side: &'a [f16],
    /// Tokens in the sequence.
    pub len: usize,
    /// The sequence's protected positions (detected attention sinks), ascending: position
    /// `protected[i]` keeps its f16 rows in protected row `i` of the side store
    /// ([`Format::protected_row`]). Empty for none.
    pub protected: &'a [u32],
}

/// Index of `pos` in an ascending list of protected positions.
#[inline]
pub fn protected_index(protected: &[u32], pos: u32) -> Option<u32> {
    protected.binary_search(&pos).ok().map(|i| i as u32)
}

/// Where decode reads position `pos` of `seq`: [`Format::place`], except that a
/// protected position whose place is a page is read from its protected row.
pub fn decode_place(fmt: &Format, seq: &SeqRef<'_>, pos: u32) -> Place {
    let place = fmt.place(pos, seq.len as u32);
    if let Place::Page { .. } = place
        && let Some(i) = protected_index(seq.protected, pos)
    {
        return Place::Sink { index: fmt.protected_row(i) };
    }
    place
}

/// The stored-order key (`value == false`) or value row of position `pos`, as decode
/// reads it: the f16 row for sinks, window and protected positions, the dequantized row
/// for pages.
pub fn read_row(
    fmt: &Format,
    num_kv_heads: usize,
    pool: &[u8],
    seq: &SeqRef<'_>,
    kv_head: usize,
    pos: usize,
    value: bool,
) -> Vec<f64> {
    let d = fmt.head_dim as usize;
    let h = kv_head as u32;
    match decode_place(fmt, seq, pos as u32) {
        Place::Sink { index: row } | Place::Window { slot: row } => {
            let at = fmt.side_row_at(h, value, row);
            seq.side[at..at + d].iter().map(|x| x.to_f64()).collect()
        }
        Place::Page { page, slot } => {
            let base = fmt.page_offset(seq.block_table[page as usize], h, num_kv_heads as u32);
            let head_page = &pool[base..base + fmt.page_bytes() as usize];
            let c = fmt.codes_at(value, slot) as usize;
            let params = page_params(fmt, head_page, value, slot);
            let codes = &head_page[c..c + fmt.code_bytes(value) as usize];
            let row = dequantize_row(codes, &params, fmt.bits(value), fmt.group_size as usize, d);
            if fmt.channel_norm == 0 {
                return row;
            }
            row.iter().zip(page_channel_scales(fmt, head_page, value)).map(|(x, s)| x * s).collect()
        }
    }
}

/// A split-K partial: running max logit `m`, sum of `exp(logit - m)` `l`, and the
/// unnormalized weighted sum of stored-order values `o`. An empty split has
/// `m = -inf, l = 0, o = 0`.
#[derive(Clone, Debug, PartialEq)]
pub struct Partial {
    /// Max logit of the split.
    pub m: f64,
    /// Sum of `exp(logit - m)`.
    pub l: f64,
    /// Sum of `exp(logit - m) * value`.
    pub o: Vec<f64>,
}

/// The query of one head scaled by the key scales and rotated into the key's stored
/// order: `((q * scale) R)[key_perm]`.
pub fn rotate_query(q: &[f32], scale: &[f32], rot: HeadRotation<'_>, key_perm: &[u16]) -> Vec<f64> {
    let x: Vec<f64> = q.iter().zip(scale).map(|(&a, &s)| a as f64 * s as f64).collect();
    rotate(&x, rot, key_perm)
}

/// Split-K partials for every `(sequence, query row, query head, split)`, in that order.
/// `q` is `[num_seqs][q_len][num_q_heads][head_dim]` (sequence stride `p.q_seq_stride`).
/// Row `i` of a sequence of `len` tokens is the query at position `len - q_len + i` and
/// attends to positions up to its own, or with a sliding window (`p.attn_window = W > 0`)
/// to the `W` newest of them: splits are cut from the sequence's visible positions
/// ([`DecodeParams::split_range`]), and each row leaves out the positions of a split
/// outside its own window (a split with none left is an empty partial).
pub fn decode_partials(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
) -> Vec<Partial> {
    let fmt = &p.format;
    let d = fmt.head_dim as usize;
    let (hq, hkv) = (p.num_q_heads as usize, p.num_kv_heads as usize);
    let group = hq / hkv;
    let q_len = p.q_len as usize;
    let mut out = Vec::with_capacity(seqs.len() * q_len * hq * p.num_splits as usize);
    for (s, seq) in seqs.iter().enumerate() {
        for row in 0..q_len {
            // The row's query position and the positions it attends to: `first ..= q_pos`.
            let q_pos = seq.len - p.q_len as usize + row;
            let first = if p.attn_window == 0 { 0 } else { (q_pos + 1).saturating_sub(p.attn_window as usize) };
            for qh in 0..hq {
                let kvh = qh / group;
                let (_, kperm, _) = calib.head(kvh, d);
                let qo = s * p.q_seq_stride as usize + row * p.q_token_stride as usize + qh * d;
                let scale = calib.head_key_scale(kvh, d);
                let qr = rotate_query(&q[qo..qo + d], scale, calib.rotation(false, kvh, d, p.flags), kperm);
                for split in 0..p.num_splits {
                    let (b, e) = p.split_range(split, seq.len as u32);
                    let mut part = Partial { m: f64::NEG_INFINITY, l: 0.0, o: vec![0.0; d] };
                    for pos in (b as usize).max(first)..(e as usize).min(q_pos + 1) {
                        let k = read_row(fmt, hkv, pool, seq, kvh, pos, false);
                        let logit = p.sm_scale as f64 * qr.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>();
                        let v = read_row(fmt, hkv, pool, seq, kvh, pos, true);
                        let m = part.m.max(logit);
                        let c = (part.m - m).exp();
                        let w = (logit - m).exp();
                        part.l = part.l * c + w;
                        part.o.iter_mut().zip(&v).for_each(|(o, v)| *o = *o * c + w * v);
                        part.m = m;
                    }
                    out.push(part);
                }
            }
        }
    }
    out
}

/// Log-sum-exp merge of the partials of one `(sequence, query head)`: the normalized
/// attention output in stored value order. Empty partials (`m = -inf`) contribute
/// nothing; if every partial is empty the result is zeros.
pub fn merge(parts: &[Partial]) -> Vec<f64> {
    let d = parts.first().map_or(0, |p| p.o.len());
    let m = parts.iter().map(|p| p.m).fold(f64::NEG_INFINITY, f64::max);
    let mut o = vec![0.0; d];
    if m == f64::NEG_INFINITY {
        return o;
    }
    let mut l = 0.0;
    for p in parts.iter().filter(|p| p.m != f64::NEG_INFINITY) {
        let c = (p.m - m).exp();
        l += p.l * c;
        o.iter_mut().zip(&p.o).for_each(|(a, b)| *a += b * c);
    }
    o.iter_mut().for_each(|a| *a /= l);
    o
}

/// Decode attention for `p.q_len` query tokens per sequence: `q` and `out` are
/// `[num_seqs][q_len][num_q_heads][head_dim]` (sequence stride `p.q_seq_stride`), row `i`
/// attending causally to positions `p.row_start(len, i) .. p.row_len(len, i)` (from 0
/// without a sliding window); `out` is in the original
/// (unrotated) value channels.
pub fn decode(
    p: &DecodeParams,
    calib: &LayerCalibration,
    pool: &[u8],
    seqs: &[SeqRef<'_>],
    q: &[f32],
    out: &mut [f32],
) {
    let d = p.format.head_dim as usize;
    let (hq, hkv) = (p.num_q_heads as usize, p.num_kv_heads as usize);
    let ns = p.num_splits as usize;
    let rows = p.q_len as usize;
    let parts = decode_partials(p, calib, pool, seqs, q);
    for (i, chunk) in parts.chunks_exact(ns).enumerate() {
        let qh = i % hq;
        let (s, row) = (i / hq / rows, i / hq % rows);
        let kvh = qh / (hq / hkv);
        let (_, _, vperm) = calib.head(kvh, d);
        let o = unrotate(&merge(chunk), calib.rotation(true, kvh, d, p.flags), vperm);
        let at = s * p.q_seq_stride as usize + (row * hq + qh) * d;
        out[at..at + d].iter_mut().zip(o).for_each(|(a, b)| *a = b as f32);
    }
}
