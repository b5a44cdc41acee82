//! Append: the input check, the staging of new rows (one pass where the kernels allow),
//! the page fill and the append entry points.

use super::*;

/// The first row `i` of `x` (`[rows][d]`, row `i` of head `i % heads`) for which
/// `exact_bad(i, row)` holds, asking it only about rows that fail a fast test: the
/// row's squared L2 norm as stored, `(x - mean) / scale` (`mean`: `[heads][d]` each), in f32 (with AVX2
/// where present), below `bound2`. Rows are scanned in parallel. (The caller picks
/// `bound2` below its exact limit by more than the f32 sum's error; an infinity or NaN
/// anywhere fails the fast test.)
pub(crate) fn first_bad_row<T: KvElement>(
    x: &[T],
    heads: usize,
    d: usize,
    mean: Option<(&[f32], &[f32])>,
    bound2: f32,
    exact_bad: impl Fn(usize, &[T]) -> bool + Sync,
) -> Option<usize> {
    const ROWS: usize = 64;
    #[inline(always)]
    fn norm2<K: Kernels, T: KvElement>(kern: K, row: &[T], mean: Option<(&[f32], &[f32])>, buf: &mut [f32]) -> f32 {
        let affine = mean.map_or(KeyAffine::None, |(m, s)| KeyAffine::Full(m, s));
        load_affine(kern, row, affine, buf)
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn scan<K: Kernels, T: KvElement>(
        kern: K,
        block: &[T],
        first: usize,
        heads: usize,
        d: usize,
        mean: Option<(&[f32], &[f32])>,
        bound2: f32,
        exact_bad: &(impl Fn(usize, &[T]) -> bool + Sync),
    ) -> Option<usize> {
        let mut buf = [0f32; 256];
        for (r, row) in block.chunks_exact(d).enumerate() {
            let i = first + r;
            let hd = i % heads * d..(i % heads + 1) * d;
            let m = mean.map(|(m, s)| (&m[hd.clone()], &s[hd]));
            let n2 = norm2(kern, row, m, &mut buf[..d]);
            if (n2.is_nan() || n2 >= bound2) && exact_bad(i, row) {
                return Some(i);
            }
        }
        None
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn scan_avx2<T: KvElement>(
        kern: Avx2,
        block: &[T],
        first: usize,
        heads: usize,
        d: usize,
        mean: Option<(&[f32], &[f32])>,
        bound2: f32,
        exact_bad: &(impl Fn(usize, &[T]) -> bool + Sync),
    ) -> Option<usize> {
        scan(kern, block, first, heads, d, mean, bound2, exact_bad)
    }
    assert!(d <= 256 && d.is_multiple_of(LANES));
    #[cfg(target_arch = "x86_64")]
    let avx = Avx2::detect();
    x.par_chunks(ROWS * d).enumerate().find_map_first(|(b, block)| {
        #[cfg(target_arch = "x86_64")]
        if let Some(kern) = avx {
            // SAFETY: `kern` proves AVX2, FMA and F16C support, the callee's target features.
            return unsafe { scan_avx2(kern, block, b * ROWS, heads, d, mean, bound2, &exact_bad) };
        }
        scan(Portable, block, b * ROWS, heads, d, mean, bound2, &exact_bad)
    })
}

/// Scratch rows of the fused append (one set per worker thread): `x`, `y` and `row` of
/// one row, `page` the stored f16 rows of a head-page (keys, then values), `ranges` the
/// min and max of each of their groups and `params` their row-local scales and zeros.
pub(super) struct AppendScratch {
    x: Vec<f32>,
    y: Vec<f32>,
    row: Vec<f16>,
    page: Vec<f16>,
    ranges: Vec<(f32, f32)>,
    params: Vec<u8>,
    /// A page's new rows before and after a learned rotation (`[page_size][d]` and
    /// `[2][page_size][d]`, keys then values); empty until a learned rotation needs them.
    dense_in: Vec<f32>,
    dense_out: Vec<f32>,
}

impl AppendScratch {
    /// For rows of `d` and pages of `page_size` tokens, `groups` per row.
    fn new(d: usize, page_size: usize, groups: usize) -> Self {
        let mut s = Self {
            x: vec![],
            y: vec![],
            row: vec![],
            page: vec![],
            ranges: vec![],
            params: vec![],
            dense_in: vec![],
            dense_out: vec![],
        };
        s.fit(d, page_size, groups);
        s
    }

    /// Rows of exactly `d`, and room for pages of `page_size` tokens, `groups` per row.
    fn fit(&mut self, d: usize, page_size: usize, groups: usize) {
        self.x.resize(d, 0.0);
        self.y.resize(d, 0.0);
        self.row.resize(d, f16::ZERO);
        let rows = 2 * page_size;
        self.page.resize(self.page.len().max(rows * d), f16::ZERO);
        self.ranges.resize(self.ranges.len().max(rows * groups), (0.0, 0.0));
        self.params.resize(self.params.len().max(4 * rows * groups), 0);
    }
}

thread_local! {
    /// The calling thread's append scratch, kept between tasks and calls (a head-page's
    /// rows are tens of KiB: allocating and zeroing them per task showed in profiles).
    static SCRATCH: std::cell::RefCell<AppendScratch> = std::cell::RefCell::new(AppendScratch::new(0, 0, 0));
}

/// Runs `f` with this thread's append scratch fitted to the format's rows and pages (a
/// fresh one if it is in use further up this thread's stack).
pub(super) fn with_scratch<R>(fmt: &Format, f: impl FnOnce(&mut AppendScratch) -> R) -> R {
    let (d, ps, groups) = (fmt.head_dim as usize, fmt.page_size as usize, fmt.groups() as usize);
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => {
            s.fit(d, ps, groups);
            f(&mut s)
        }
        Err(_) => f(&mut AppendScratch::new(d, ps, groups)),
    })
}

/// How a key row becomes `(k - mean) / scale` before its rotation, per KV head: the
/// same f32 operations as [`stage_row`], with the ones that change no bit left out
/// (`x - 0.0 == x` and `x / 1.0 == x` for every finite `x`, signed zeros included).
#[derive(Clone, Copy)]
pub(crate) enum KeyAffine<'a> {
    /// Mean `+0.0` and scale 1 everywhere: the row as it is.
    None,
    /// Scale 1 everywhere: `x - mean`.
    Center(&'a [f32]),
    /// `(x - mean) / scale`.
    Full(&'a [f32], &'a [f32]),
}

impl<'a> KeyAffine<'a> {
    fn of(mean: &'a [f32], scale: &'a [f32]) -> Self {
        match (mean.iter().all(|m| m.to_bits() == 0), scale.iter().all(|&s| s == 1.0)) {
            (true, true) => Self::None,
            (false, true) => Self::Center(mean),
            _ => Self::Full(mean, scale),
        }
    }
}

/// Loads an input row into `x` as f32 and centers and scales it (keys) as
/// [`stage_row`] does; returns its squared L2 norm in f32, eight partial sums (NaN or
/// infinite when a value is not finite): the fast test of [`first_bad_row`] and of the
/// fused append.
#[inline(always)]
pub(super) fn load_affine<K: Kernels, T: KvElement>(kern: K, src: &[T], affine: KeyAffine<'_>, x: &mut [f32]) -> f32 {
    load_row(kern, src, x);
    match affine {
        KeyAffine::None => {}
        KeyAffine::Center(m) => x.iter_mut().zip(m).for_each(|(x, m)| *x -= m),
        KeyAffine::Full(m, s) => x.iter_mut().zip(m.iter().zip(s)).for_each(|(x, (m, s))| *x = (*x - m) / s),
    }
    let mut acc = [0f32; LANES];
    for x8 in x.chunks_exact(LANES) {
        for l in 0..LANES {
            acc[l] += x8[l] * x8[l];
        }
    }
    acc.iter().sum()
}

/// [`stage_row`] for an input row of any element type into `dst`, with the kernel
/// set's FWHT and f16 conversions (the same bits as [`stage_row`]: the same f32
/// operations, conversions rounding to nearest even). Returns [`load_affine`]'s squared
/// norm, so that the fused append checks each row as it reads it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn stage_input<K: Kernels, T: KvElement>(
    kern: K,
    src: &[T],
    mean: KeyAffine<'_>,
    rot: HeadRotation<'_>,
    perm: Option<&[u16]>,
    x: &mut [f32],
    y: &mut [f32],
    row: &mut [f16],
) -> f32 {
    let norm2 = load_affine(kern, src, mean, x);
    match rot {
        HeadRotation::None => {}
        HeadRotation::Hadamard => kern.fwht(x),
        HeadRotation::Dense(r) => {
            kern.dense_rotate(x, r, y);
            x.copy_from_slice(y);
        }
    }
    permute_round(kern, x, perm, y, row);
    norm2
}

/// The rotated row `x` permuted into stored order (`y` is scratch of its length) and
/// rounded to f16 into `row`: the last steps of [`stage_input`].
#[inline(always)]
pub(super) fn permute_round<K: Kernels>(kern: K, x: &[f32], perm: Option<&[u16]>, y: &mut [f32], row: &mut [f16]) {
    match perm {
        Some(perm) => {
            for (o, &p) in y.iter_mut().zip(perm) {
                *o = x[p as usize];
            }
            kern.round_to_f16(y, row);
        }
        None => kern.round_to_f16(x, row),
    }
}

/// `Some(perm)` unless it is the identity.
pub(super) fn non_identity(perm: &[u16]) -> Option<&[u16]> {
    (!perm.iter().enumerate().all(|(i, &p)| p as usize == i)).then_some(perm)
}

/// Element of new token `t`, KV head `h` of the K input (`p.token_stride` apart).
#[inline(always)]
pub(super) fn k_src(p: &AppendParams, t: u32, h: usize) -> usize {
    t as usize * p.token_stride as usize + h * p.head_stride as usize
}

/// Element of new token `t`, KV head `h` of the V input (`p.v_token_stride` apart).
#[inline(always)]
pub(super) fn v_src(p: &AppendParams, t: u32, h: usize) -> usize {
    t as usize * p.v_token_stride as usize + h * p.head_stride as usize
}

/// The exact test of an append's input row: `(value, token, kv_head, row)`, true when
/// the row is bad.
pub(crate) type ExactRowTest<'a, T> = dyn Fn(bool, usize, usize, &[T]) -> bool + Sync + 'a;

/// The input check of an append, made by the CPU backend's fused pass on the rows it
/// reads anyway (the test of [`crate::paged::check_rows`]: finite values and an L2 norm as
/// stored within the f16 range), so the input crosses memory once.
pub(crate) struct RowCheck<'a, T> {
    /// Rows whose f32 squared norm (eight partial sums) is below this pass without the
    /// exact test (the caller sets it below the exact limit by more than the f32 sum's
    /// error; a NaN or infinite norm fails it).
    pub fast_limit: f32,
    /// The exact test of a row that fails the fast one: `(value, token, kv_head, row)`,
    /// true when the row is bad.
    pub exact_bad: &'a ExactRowTest<'a, T>,
}

impl<T> RowCheck<'_, T> {
    /// Whether the row of `(value, token, kv_head)` with fast squared norm `norm2` is bad.
    #[inline(always)]
    fn bad(&self, norm2: f32, value: bool, token: usize, h: usize, row: &[T]) -> bool {
        // A NaN norm is not below the limit: it goes to the exact test.
        let fast_ok = norm2 < self.fast_limit;
        !fast_ok && (self.exact_bad)(value, token, h, row)
    }
}

/// A KV head's key and value permutations (`None`: the identity).
pub(super) type HeadPerms<'a> = (Option<&'a [u16]>, Option<&'a [u16]>);

/// Everything one head-page of an append reads: the format, the calibration, the old
/// window rows and the new input rows, and the check the new rows must pass.
pub(super) struct PageInputs<'a, T> {
    p: &'a AppendParams,
    calib: &'a LayerCalibration,
    /// Per KV head: how its key rows are centered and scaled.
    affine: &'a [KeyAffine<'a>],
    /// Per KV head: its key and value permutations (`None`: the identity).
    perms: &'a [HeadPerms<'a>],
    side: &'a [f16],
    k: &'a [T],
    v: &'a [T],
    check: Option<&'a RowCheck<'a, T>>,
}

/// Where [`fill_page`] found the stored f16 row of a slot.
pub(super) enum Staged {
    /// Row `at` of the side store (an old window row).
    Side(usize),
    /// A new input row, staged into the row given; `true` when its groups' ranges were
    /// found too.
    Scratch(bool),
    /// A new input row that fails the check: nothing more is written.
    Bad,
}

/// Quantizes head-page `(page, h)` into `bytes`: first every stored f16 row of the page
/// into the scratch (`scr.page`, with each group's min and max): an old window row copied
/// from its f16 side row, a new row checked, rotated and rounded to f16 as it is read (in
/// one pass in registers where the kernel set can, [`Kernels::stage_hadamard`]: a Hadamard
/// rotation and no channel permutation; else [`stage_input`]); then the keys and the
/// values quantized a page at a time ([`quantize_into_page`]). Variance-normalized pages
/// (which need the whole page's rows first) go through
/// [`crate::reference::quantize_page`] on the same rows. False when a new row fails the
/// check (then nothing of a regular page has been written, but a variance-normalized
/// page's key half may have been).
#[inline(always)]
pub(super) fn fill_page<K: Kernels, T: KvElement>(
    kern: K,
    inp: &PageInputs<'_, T>,
    page: u32,
    h: u32,
    bytes: &mut [u8],
    scr: &mut AppendScratch,
) -> bool {
    let p = inp.p;
    let fmt = &p.format;
    let d = fmt.head_dim as usize;
    let hu = h as usize;
    let len = p.start;
    let (kperm, vperm) = inp.perms[hu];
    let (krot, vrot) = (inp.calib.rotation(false, hu, d, p.flags), inp.calib.rotation(true, hu, d, p.flags));
    let pos = |slot: u32| fmt.sinks + page * fmt.page_size + slot;
    let g = fmt.group_size as usize;
    let groups = fmt.groups() as usize;
    let AppendScratch { x, y, row: scr_row, page: staged, ranges, params, dense_in, dense_out } = scr;
    // New rows under a learned rotation are loaded and checked first, then rotated a
    // page at a time (`Kernels::dense_rotate_rows`, the same bits as row by row); `stage`
    // takes them from `dense_out` (keys, then values, `[page_size][d]` each).
    let ps = fmt.page_size as usize;
    let first_new = (0..fmt.page_size).find(|&slot| pos(slot) >= len).unwrap_or(fmt.page_size) as usize;
    let mut dense = [false; 2];
    for (vi, rot) in [krot, vrot].into_iter().enumerate() {
        let HeadRotation::Dense(r) = rot else { continue };
        if first_new == ps {
            continue;
        }
        let value = vi == 1;
        dense_in.resize(dense_in.len().max(ps * d), 0.0);
        dense_out.resize(dense_out.len().max(2 * ps * d), 0.0);
        for slot in first_new..ps {
            let at = pos(slot as u32);
            let (row, affine) = if value {
                (&inp.v[v_src(p, at - len, hu)..][..d], KeyAffine::None)
            } else {
                (&inp.k[k_src(p, at - len, hu)..][..d], inp.affine[hu])
            };
            let norm2 = load_affine(kern, row, affine, &mut dense_in[slot * d..][..d]);
            if inp.check.is_some_and(|c| c.bad(norm2, value, (at - len) as usize, hu, row)) {
                return false;
            }
        }
        let out = &mut dense_out[(vi * ps + first_new) * d..(vi + 1) * ps * d];
        kern.dense_rotate_rows(&dense_in[first_new * d..ps * d], r, d, out);
        dense[vi] = true;
    }
    let dense_out = &dense_out[..];
    // The stored f16 row of (slot, value): from the side store, or staged into `dst` (with
    // its groups' ranges into `rg` where the kernel set stages it in one pass).
    let stage = |slot: u32, value: bool, x: &mut [f32], y: &mut [f32], dst: &mut [f16], rg: &mut [(f32, f32)]| {
        let at = pos(slot);
        if at < len {
            return Staged::Side(fmt.side_row_at(h, value, fmt.window_row(at)));
        }
        let t = (at - len) as usize;
        let (row, affine, rot, perm) = if value {
            (&inp.v[v_src(p, at - len, hu)..][..d], KeyAffine::None, vrot, vperm)
        } else {
            (&inp.k[k_src(p, at - len, hu)..][..d], inp.affine[hu], krot, kperm)
        };
        if dense[value as usize] {
            // Rotated (and checked) above.
            permute_round(kern, &dense_out[(value as usize * ps + slot as usize) * d..][..d], perm, y, dst);
            return Staged::Scratch(false);
        }
        let fused = match (rot, perm) {
            (HeadRotation::Hadamard, None) => kern.stage_hadamard(row, affine, g, dst, rg),
            _ => None,
        };
        let (norm2, ranged) = match fused {
            Some(norm2) => (norm2, true),
            None => (stage_input(kern, row, affine, rot, perm, x, y, dst), false),
        };
        match inp.check {
            Some(c) if c.bad(norm2, value, t, hu, row) => Staged::Bad,
            _ => Staged::Scratch(ranged),
        }
    };
    if fmt.channel_norm > 0 {
        for value in [false, true] {
            let mut rows = Vec::with_capacity(fmt.page_size as usize * d);
            for slot in 0..fmt.page_size {
                let row = match stage(slot, value, x, y, scr_row, &mut ranges[..groups]) {
                    Staged::Side(at) => &inp.side[at..at + d],
                    Staged::Scratch(_) => &scr_row[..],
                    Staged::Bad => return false,
                };
                rows.extend(row.iter().map(|x| x.to_f64()));
            }
            reference::quantize_page(fmt, &rows, value, bytes);
        }
        return true;
    }
    // New rows of one head are a token stride apart (a new memory page every row or two
    // at head_dim 128 and up, which hardware prefetchers do not cross): ask for them
    // PREFETCH slots ahead.
    const PREFETCH: u32 = 4;
    let prefetch = |slot: u32| {
        let at = pos(slot);
        if slot < fmt.page_size && at >= len {
            let (ks, vs) = (k_src(p, at - len, hu), v_src(p, at - len, hu));
            kern.prefetch_l1(bytemuck::cast_slice(&inp.k[ks..ks + d]));
            kern.prefetch_l1(bytemuck::cast_slice(&inp.v[vs..vs + d]));
        }
    };
    (0..PREFETCH).for_each(prefetch);
    // Every stored row of the page first (keys, then values, in `staged`), then the page
    // quantized in two calls, so that the quantizer works on many rows at once.
    let ps = fmt.page_size as usize;
    let (keys, values) = staged[..2 * ps * d].split_at_mut(ps * d);
    let (key_ranges, value_ranges) = ranges[..2 * ps * groups].split_at_mut(ps * groups);
    let slots = keys.chunks_exact_mut(d).zip(key_ranges.chunks_exact_mut(groups));
    let slots = slots.zip(values.chunks_exact_mut(d).zip(value_ranges.chunks_exact_mut(groups)));
    // Where both halves take the one-pass staging, a new token's key and value rows are
    // staged in one call (`Kernels::stage_hadamard_pair`: the two rows' work side by side).
    let pair = !dense[0]
        && !dense[1]
        && matches!((krot, kperm, vrot, vperm), (HeadRotation::Hadamard, None, HeadRotation::Hadamard, None));
    for (slot, (k, v)) in slots.enumerate() {
        let slot = slot as u32;
        prefetch(slot + PREFETCH);
        if pair && slot as usize >= first_new {
            let at = pos(slot);
            let (kr, vr) = (&inp.k[k_src(p, at - len, hu)..][..d], &inp.v[v_src(p, at - len, hu)..][..d]);
            if let Some((nk, nv)) =
                kern.stage_hadamard_pair(kr, inp.affine[hu], vr, g, (&mut *k.0, &mut *k.1), (&mut *v.0, &mut *v.1))
            {
                let t = (at - len) as usize;
                if inp.check.is_some_and(|c| c.bad(nk, false, t, hu, kr) || c.bad(nv, true, t, hu, vr)) {
                    return false;
                }
                continue;
            }
        }
        for (value, (dst, rg)) in [(false, k), (true, v)] {
            match stage(slot, value, x, y, dst, rg) {
                Staged::Side(at) => {
                    dst.copy_from_slice(&inp.side[at..at + d]);
                    kern.group_ranges(dst, g, rg);
                }
                Staged::Scratch(true) => {}
                Staged::Scratch(false) => kern.group_ranges(dst, g, rg),
                Staged::Bad => return false,
            }
        }
    }
    quantize_into_page(kern, fmt, keys, key_ranges, false, 0, bytes, params);
    quantize_into_page(kern, fmt, values, value_ranges, true, 0, bytes, params);
    true
}

with_best_kernels! {
    /// [`fill_page`] with the best kernels this processor supports.
    pub(super) fn fill_page_best<T: KvElement>(
        inp: &PageInputs<'_, T>,
        page: u32,
        h: u32,
        bytes: &mut [u8],
        scr: &mut AppendScratch,
    ) -> bool = fill_page;
}

/// Bytes of saved pool blocks a thread keeps for its next append (a larger buffer is
/// freed after its call).
pub(super) const SAVE_KEEP: usize = 16 << 20;

thread_local! {
    /// The calling thread's buffer for the pool blocks an append overwrites (restored when
    /// a row fails the check), kept between calls up to [`SAVE_KEEP`] bytes so that a
    /// steady stream of appends does not fault in fresh pages every call.
    static SAVED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Appends `p.count` new tokens (`k[t * p.token_stride + h * p.head_stride + c]`,
/// `v[t * p.v_token_stride + h * p.head_stride + c]`, f32, f16 or bf16) to a sequence
/// of `p.start` tokens, producing the bytes of [`crate::reference::append`] (f16 rows may
/// differ only at rounding ties of the f32 rotation, and codes then by one step).
///
/// With `check`, every new row is checked as it is read, and `false` is returned, with
/// nothing changed, when one fails: the rows that go to the side store (sinks, window)
/// first, then the pages that fill, one head-page per task, each task saving its pool
/// block before writing it (`fill_page`: each new row read once, checked, rotated and
/// rounded to f16 into the task's scratch, old window rows alike, then the page's rows
/// quantized and packed); a bad row there restores every block. Then the new sink, window and protected
/// rows (after, since the pages read the old window rows that the new ones may
/// overwrite). Without `check` the rows must have been validated.
#[allow(clippy::too_many_arguments)]
pub(crate) fn append_checked<T: KvElement>(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    protected: &[u32],
    k: &[T],
    v: &[T],
    check: Option<&RowCheck<'_, T>>,
) -> bool {
    let fmt = &p.format;
    let d = fmt.head_dim as usize;
    let hkv = p.num_kv_heads as usize;
    let (len, new_len) = (p.start, p.start + p.count);
    let affine: Vec<KeyAffine<'_>> =
        (0..hkv).map(|h| KeyAffine::of(calib.head(h, d).0, calib.head_key_scale(h, d))).collect();
    // The new rows that stay in f16 only (sinks, window): checked before anything is written.
    if let Some(c) = check {
        let mut buf = [0f32; 256];
        for pos in len..new_len {
            if matches!(fmt.place(pos, new_len), Place::Page { .. }) {
                continue;
            }
            let t = (pos - len) as usize;
            for h in 0..hkv {
                let kr = &k[k_src(p, pos - len, h)..][..d];
                let vr = &v[v_src(p, pos - len, h)..][..d];
                if c.bad(row_norm2_best(kr, affine[h], &mut buf[..d]), false, t, h, kr)
                    || c.bad(row_norm2_best(vr, KeyAffine::None, &mut buf[..d]), true, t, h, vr)
                {
                    return false;
                }
            }
        }
    }
    let perms: Vec<HeadPerms<'_>> = (0..hkv)
        .map(|h| {
            let (_, kperm, vperm) = calib.head(h, d);
            (non_identity(kperm), non_identity(vperm))
        })
        .collect();
    let (p0, p1) = (fmt.pages_for(len), fmt.pages_for(new_len));
    if p1 > p0 {
        let pb = fmt.page_bytes() as usize;
        // Each head-page's bytes, by (block, head); the block table's entries are distinct.
        let mut blocks: Vec<Option<&mut [u8]>> = pool.chunks_exact_mut(pb).map(Some).collect();
        let mut tasks = Vec::with_capacity((p1 - p0) as usize * hkv);
        for page in p0..p1 {
            for h in 0..hkv {
                let bytes = blocks[block_table[page as usize] as usize * hkv + h].take();
                tasks.push((page, h as u32, bytes.expect("distinct blocks in the block table")));
            }
        }
        let inp = PageInputs { p, calib, affine: &affine, perms: &perms, side: &*side, k, v, check };
        let ok = match check {
            None => {
                tasks.into_par_iter().for_each(|(page, h, bytes)| {
                    with_scratch(fmt, |scr| fill_page_best(&inp, page, h, bytes, scr));
                });
                true
            }
            Some(_) => {
                // Taken out of the thread-local for the call (not borrowed): a rayon worker
                // that runs another append while this one waits for its tasks finds it
                // empty and allocates its own.
                let size = tasks.len() * pb;
                let mut saved = SAVED.take();
                saved.resize(size.max(saved.len()), 0);
                let bad = std::sync::atomic::AtomicBool::new(false);
                tasks.par_iter_mut().zip(saved[..size].par_chunks_mut(pb)).for_each(|((page, h, bytes), save)| {
                    save.copy_from_slice(bytes);
                    if !bad.load(std::sync::atomic::Ordering::Relaxed)
                        && !with_scratch(fmt, |scr| fill_page_best(&inp, *page, *h, bytes, scr))
                    {
                        bad.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                let bad = bad.into_inner();
                if bad {
                    for ((_, _, bytes), save) in tasks.iter_mut().zip(saved.chunks_exact(pb)) {
                        bytes.copy_from_slice(save);
                    }
                }
                if saved.len() <= SAVE_KEEP {
                    SAVED.set(saved);
                }
                !bad
            }
        };
        if !ok {
            return false;
        }
    }
    // New tokens that stay in f16: sink and window rows, and protected rows.
    with_scratch(fmt, |scr| {
        for pos in len..new_len {
            let row = match fmt.place(pos, new_len) {
                Place::Sink { index } => Some(index),
                Place::Window { slot } => Some(slot),
                Place::Page { .. } => None,
            };
            let copy = reference::protected_index(protected, pos).map(|i| fmt.protected_row(i));
            if row.is_none() && copy.is_none() {
                continue;
            }
            for (h, (&key_affine, &(kperm, vperm))) in affine.iter().zip(&perms).enumerate() {
                let (ks, vs) = (k_src(p, pos - len, h), v_src(p, pos - len, h));
                for value in [false, true] {
                    let rot = calib.rotation(value, h, d, p.flags);
                    stage_input_best(&k[ks..ks + d], &v[vs..vs + d], value, key_affine, rot, kperm, vperm, scr);
                    for r in row.into_iter().chain(copy) {
                        let at = fmt.side_row_at(h as u32, value, r);
                        side[at..at + d].copy_from_slice(&scr.row);
                    }
                }
            }
        }
    });
    true
}

/// Appends `p.count` new tokens (`k[t * p.token_stride + h * p.head_stride + c]`,
/// `v[t * p.v_token_stride + h * p.head_stride + c]`, f32, f16 or bf16, already
/// validated: finite, each row's norm as stored within the f16 range) to a sequence of
/// `p.start` tokens, producing the bytes of [`crate::reference::append`] (f16 rows may
/// differ only at rounding ties of the f32 rotation, and codes then by one step): the
/// pages that fill first, one head-page per task written straight into its pool block
/// (each new row read once, rotated and rounded to f16 into the task's scratch, old window
/// rows alike, then the page's rows quantized and packed), then the new sink, window and
/// protected rows.
/// [`crate::paged::append`] on the cpu backend runs the same pass with the input check
/// fused into it, restoring the pool blocks it wrote when a row fails.
#[allow(clippy::too_many_arguments)]
pub fn append<T: KvElement>(
    p: &AppendParams,
    calib: &LayerCalibration,
    pool: &mut [u8],
    block_table: &[u32],
    side: &mut [f16],
    protected: &[u32],
    k: &[T],
    v: &[T],
) {
    append_checked(p, calib, pool, block_table, side, protected, k, v, None);
}

with_best_kernels! {
    /// The row's squared norm as stored before its rotation (see [`stage_input`]), with the
    /// best kernels; `buf` is scratch of the row's length.
    pub(super) fn row_norm2_best<T: KvElement>(row: &[T], affine: KeyAffine<'_>, buf: &mut [f32]) -> f32 = load_affine;
}

/// [`stage_input`] of the key (`value == false`) or value row into the scratch's `row`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn stage_key_or_value<K: Kernels, T: KvElement>(
    kern: K,
    k: &[T],
    v: &[T],
    value: bool,
    affine: KeyAffine<'_>,
    rot: HeadRotation<'_>,
    kperm: Option<&[u16]>,
    vperm: Option<&[u16]>,
    scr: &mut AppendScratch,
) {
    let AppendScratch { x, y, row, .. } = scr;
    if value {
        stage_input(kern, v, KeyAffine::None, rot, vperm, x, y, row);
    } else {
        stage_input(kern, k, affine, rot, kperm, x, y, row);
    }
}

with_best_kernels! {
    /// [`stage_input`] of the key (`value == false`) or value row with the best kernels.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage_input_best<T: KvElement>(
        k: &[T],
        v: &[T],
        value: bool,
        affine: KeyAffine<'_>,
        rot: HeadRotation<'_>,
        kperm: Option<&[u16]>,
        vperm: Option<&[u16]>,
        scr: &mut AppendScratch,
    ) = stage_key_or_value;
}
