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
        if fmt.channel_norm > 0 {
            for c in 0..fmt.head_dim {
                let at = fmt.channel_scale_at(value, c) as usize;
                page[at..at + 2].copy_from_slice(&f16::from_f32(0.5 + (c % 5) as f32 * 0.25).to_le_bytes());
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

/// The AVX2 kernels with 256-bit registers only, and with 512-bit ones where the
/// processor has AVX-512 F (else a `SKIPPED` line).
#[cfg(target_arch = "x86_64")]
fn kernel_sets(avx: Avx2) -> Vec<(Avx2, &'static str)> {
    let mut v = vec![(avx.narrow(), "avx2")];
    if avx.is_wide() {
        v.push((avx, "avx512"));
    } else {
        eprintln!("SKIPPED: the 512-bit kernels (this processor has no AVX-512 F)");
    }
    v
}

/// Runs `$check(kernels, exact, name)` with the portable kernels (`exact` false) and
/// with each kernel set of [`kernel_sets`] (`exact` true; a `SKIPPED` line where the
/// processor has no AVX2).
macro_rules! check_kernel_sets {
    ($check:ident) => {{
        $check(Portable, false, "portable");
        #[cfg(target_arch = "x86_64")]
        match Avx2::detect() {
            Some(avx) => kernel_sets(avx).into_iter().for_each(|(kern, what)| $check(kern, true, what)),
            None => eprintln!("SKIPPED: avx2 part (this processor has no AVX2/FMA/F16C)"),
        }
    }};
}

#[test]
fn avx2_kernels_match_portable_kernels() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(avx) = Avx2::detect() else {
            eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
            return;
        };
        // Pages of 16 and 64 tokens (a whole chunk through `HeadState::step`), and
        // variance-normalized pages (their own shifted queries).
        for (d, kb, vb, gs, page_size, channel_norm) in [
            (64, 2, 2, 64, 16, 0),
            (128, 4, 2, 32, 16, 0),
            (256, 2, 4, 128, 16, 0),
            (128, 4, 4, 128, 16, 0),
            (64, 2, 2, 32, 16, 0),
            (256, 4, 2, 256, 16, 0),
            (128, 2, 2, 128, 64, 0),
            (64, 4, 2, 32, 64, 0),
            (128, 2, 2, 64, 64, 2),
            (64, 4, 4, 64, 16, 2),
        ] {
            let fmt = Format {
                head_dim: d,
                key_bits: kb,
                value_bits: vb,
                group_size: gs,
                page_size,
                sinks: 0,
                window: 0,
                key_clip: NO_CLIP,
                value_clip: NO_CLIP,
                protected: 0,
                channel_norm,
            };
            for g in [1, 2, 3, 6, 7, 8] {
                for terms in [0, 1, 2] {
                    let (m0, l0, o0) = run_both(Portable, &fmt, g, terms);
                    let mut first: Option<Vec<u32>> = None;
                    for (kern, what) in kernel_sets(avx) {
                        let (m1, l1, o1) = run_both(kern, &fmt, g, terms);
                        for (a, b) in m0.iter().zip(&m1).chain(l0.iter().zip(&l1)).chain(o0.iter().zip(&o1)) {
                            assert!(
                                (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                                "{a} vs {b} ({what} {d} {kb} {vb} {gs} g{g} terms {terms})"
                            );
                        }
                        // The 512-bit kernels give the 256-bit ones' bits.
                        let bits: Vec<u32> = m1.iter().chain(&l1).chain(&o1).map(|x| x.to_bits()).collect();
                        match &first {
                            None => first = Some(bits),
                            Some(f) => assert!(*f == bits, "{what} bits ({d} {kb} {vb} {gs} g{g} terms {terms})"),
                        }
                    }
                }
            }
        }
    }
}

/// Random bytes (xorshift64) for the packed-code kernel tests.
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut next = xorshift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..n).map(|_| (next() >> 24) as u8).collect()
}

/// The xorshift64 stream from `state` (non-zero).
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// Code of stored channel `c` in a row of packed codes.
fn code_of(row: &[u8], c: usize, bits: u32) -> u32 {
    let per = 8 / bits as usize;
    ((row[c / per] >> ((c % per) as u32 * bits)) & ((1 << bits) - 1)) as u32
}

/// Every supported (head_dim, code bits, group size), and head_dim 96 (rows of 24
/// bytes at 2 bits: the AVX2 key kernel's fallback).
fn code_shapes() -> Vec<(usize, u32, usize)> {
    let mut v = vec![(96, 2, 32), (96, 4, 32)];
    for d in [64, 128, 256] {
        for bits in [2, 4] {
            for gs in [32, 64, 128, 256].into_iter().filter(|&gs| gs <= d) {
                v.push((d, bits, gs));
            }
        }
    }
    v
}

/// The 512-bit fused key scores (`Kernels::key_scores`: the transposed kernel with
/// each group's scale and zero applied as it stores) against `key_dots` and the
/// combine loop of `HeadState::key_scores` (the AVX2 path), bit for bit over the
/// chunk's tokens: every code shape, 1 to 16 heads (every head block), chunks of 1 to
/// 64 tokens (1 to 4 sets of 16), the scratch stale. The 256-bit kernels have no fused
/// path, nor rows that are not whole 16-byte blocks.
#[test]
fn fused_key_scores_match_key_dots_and_the_combine() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(avx) = Avx2::detect() else {
            eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
            return;
        };
        if !avx.is_wide() {
            eprintln!("SKIPPED: the 512-bit fused key scores (this processor has no AVX-512 F)");
            return;
        }
        let mut seed = 5000u32;
        for (d, bits, gs) in code_shapes() {
            let cb = d * bits as usize / 8;
            let groups = d / gs;
            let mut rows = vec![0f32; CHUNK * d];
            let mut ct = vec![u32::MAX; cb / 4 * CODES_T_COLS];
            for g in [1, 2, 3, 4, 5, 6, 7, 8, 11, 16] {
                for n in [1, 7, 8, 9, 16, 17, 23, 24, 25, 31, 32, 33, 47, 48, 49, 50, 63, 64] {
                    seed += 4;
                    let q: Vec<f32> = values(g * d, seed).iter().map(|x| x * 3.0).collect();
                    let codes = random_bytes(n * cb, seed as u64);
                    let mut qk = vec![0f32; g * d];
                    for h in 0..g {
                        for c in 0..d {
                            qk[h * d + unpack_position(c, bits)] = q[h * d + c];
                        }
                    }
                    let qt: Vec<f32> = q.iter().enumerate().map(|(i, &x)| shifted_query(x, i % d, bits)).collect();
                    let scales: Vec<f32> = values(groups * CHUNK, seed + 1).iter().map(|x| x.abs() + 0.01).collect();
                    let zeros = values(groups * CHUNK, seed + 2);
                    let qsum = values(g * groups, seed + 3);
                    let mut s = vec![f32::NAN; g * CHUNK];
                    let args = (&scales[..], &zeros[..], &qsum[..]);
                    assert!(!avx.narrow().key_scores(
                        &qt,
                        g,
                        d,
                        &codes,
                        bits,
                        gs,
                        n,
                        args.0,
                        args.1,
                        args.2,
                        &mut s,
                        &mut ct,
                        &[]
                    ));
                    let fused =
                        avx.key_scores(&qt, g, d, &codes, bits, gs, n, args.0, args.1, args.2, &mut s, &mut ct, &[]);
                    assert_eq!(fused, cb.is_multiple_of(16), "d{d} b{bits}");
                    if !fused {
                        continue;
                    }
                    let mut tmp = vec![f32::NAN; groups * g * CHUNK];
                    avx.narrow().key_dots(&qk, &qt, g, d, &codes, bits, gs, n, &mut tmp, &mut rows, &mut ct);
                    for h in 0..g {
                        for t in 0..n {
                            let mut want = 0f32;
                            for j in 0..groups {
                                let x = scales[j * CHUNK + t] * tmp[(j * g + h) * CHUNK + t]
                                    + zeros[j * CHUNK + t] * qsum[h * groups + j];
                                want = if j == 0 { x } else { want + x };
                            }
                            assert_eq!(
                                s[h * CHUNK + t].to_bits(),
                                want.to_bits(),
                                "d{d} b{bits} gs{gs} g{g} n{n} head {h} token {t}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The key scores of every group of a chunk (`Kernels::key_dots`: AVX2's transposed
/// kernel with its passes of 2 to 6 token sets and the 2-set remainder, and the
/// portable unpacking one) for every code shape, 1 to 16 heads (every head block),
/// chunks of 1 to 64 tokens, the scratch reused with stale contents: the portable
/// kernel within 1e-6 of an f64 sum, the AVX2 one bit for bit an f32 FMA chain over
/// the group's channels in stored order (what its doc promises: the masked, shifted
/// codes and the `2^-p` queries give the unshifted products).
#[test]
fn key_scores_of_all_groups_match_f64_and_the_fma_chain() {
    fn check<K: Kernels>(kern: K, exact_chain: bool, what: &str) {
        let mut seed = 1;
        for (d, bits, gs) in code_shapes() {
            let cb = d * bits as usize / 8;
            let groups = d / gs;
            let mut rows = vec![0f32; CHUNK * d];
            let mut ct = vec![u32::MAX; cb / 4 * CODES_T_COLS];
            for g in [1, 2, 3, 4, 5, 6, 7, 8, 11, 16] {
                for n in [1, 7, 8, 9, 16, 17, 23, 24, 25, 47, 48, 49, 50, 63, 64] {
                    seed += 1;
                    let q: Vec<f32> = values(g * d, seed as u32).iter().map(|x| x * 3.0).collect();
                    let codes = random_bytes(n * cb, seed);
                    let mut qk = vec![0f32; g * d];
                    for h in 0..g {
                        for c in 0..d {
                            qk[h * d + unpack_position(c, bits)] = q[h * d + c];
                        }
                    }
                    let qt: Vec<f32> = q.iter().enumerate().map(|(i, &x)| shifted_query(x, i % d, bits)).collect();
                    let mut out = vec![f32::NAN; groups * g * CHUNK];
                    kern.key_dots(&qk, &qt, g, d, &codes, bits, gs, n, &mut out, &mut rows, &mut ct);
                    for j in 0..groups {
                        for h in 0..g {
                            for t in 0..n {
                                let row = &codes[t * cb..(t + 1) * cb];
                                let (mut exact, mut mag, mut chain) = (0f64, 0f64, 0f32);
                                for c in j * gs..(j + 1) * gs {
                                    let code = code_of(row, c, bits);
                                    let x = q[h * d + c] as f64 * code as f64;
                                    exact += x;
                                    mag += x.abs();
                                    chain = q[h * d + c].mul_add(code as f32, chain);
                                }
                                let got = out[(j * g + h) * CHUNK + t];
                                let at = format!(
                                    "{what}: d {d} bits {bits} gs {gs} g {g} n {n}: group {j} head {h} token {t}"
                                );
                                assert!((got as f64 - exact).abs() <= 1e-6 * mag + 1e-9, "{at}: {got} vs {exact}");
                                if exact_chain && cb.is_multiple_of(16) {
                                    assert_eq!(got.to_bits(), chain.to_bits(), "{at}: {got} vs the chain's {chain}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    check_kernel_sets!(check);
}

/// Value accumulation from packed codes (`Kernels::accumulate_codes`: AVX2's
/// two-slice kernel for 3 and 4 heads, the four-slice one for 1 and 2, codes masked
/// in place and scaled back) for every code shape, 1 to 16 heads and chunks of 1 to 64
/// tokens, added to what `o` held: the portable kernel within 1e-6 of an f64 sum, the
/// AVX2 ones bit for bit `o + (an f32 FMA chain over the tokens)`, as the shifted
/// codes gave before the masks (the power-of-two scale-back is exact).
#[test]
fn value_accumulation_from_codes_matches_f64_and_the_fma_chain() {
    fn check<K: Kernels>(kern: K, exact_chain: bool, what: &str) {
        let mut seed = 1000;
        for (d, bits, gs) in code_shapes() {
            let cb = d * bits as usize / 8;
            let mut rows = vec![0f32; CHUNK * d];
            for g in [1, 2, 3, 4, 5, 6, 7, 8, 11, 16] {
                for n in [1, 2, 7, 16, 33, 64] {
                    seed += 1;
                    let w: Vec<f32> = values(g * CHUNK, seed as u32).iter().map(|x| x * 0.5).collect();
                    let codes = random_bytes(n * cb, seed);
                    let o0: Vec<f32> = values(g * d, seed as u32 + 7).iter().map(|x| x * 5.0).collect();
                    let mut o = o0.clone();
                    for j in 0..d / gs {
                        kern.accumulate_codes(&mut o, &w, g, d, &codes, bits, n, j * gs, (j + 1) * gs, &mut rows);
                    }
                    for h in 0..g {
                        for c in 0..d {
                            let u = unpack_position(c, bits);
                            let (mut exact, mut mag, mut chain) = (o0[h * d + u] as f64, 0f64, 0f32);
                            mag += exact.abs();
                            for t in 0..n {
                                let code = code_of(&codes[t * cb..(t + 1) * cb], c, bits);
                                let x = w[h * CHUNK + t] as f64 * code as f64;
                                exact += x;
                                mag += x.abs();
                                chain = w[h * CHUNK + t].mul_add(code as f32, chain);
                            }
                            let got = o[h * d + u];
                            let at = format!("{what}: d {d} bits {bits} gs {gs} g {g} n {n}: head {h} channel {c}");
                            assert!((got as f64 - exact).abs() <= 1e-6 * mag + 1e-9, "{at}: {got} vs {exact}");
                            if exact_chain {
                                let want = o0[h * d + u] + chain;
                                assert_eq!(got.to_bits(), want.to_bits(), "{at}: {got} vs {want}");
                            }
                        }
                    }
                }
            }
        }
    }
    check_kernel_sets!(check);
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
            // Each kernel set (`fwht` above takes the widest).
            #[cfg(target_arch = "x86_64")]
            if let Some(avx) = Avx2::detect() {
                for (kern, name) in kernel_sets(avx) {
                    let mut c = row.to_vec();
                    kern.fwht(&mut c);
                    assert_eq!(
                        c.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{name}, n {n}"
                    );
                }
            }
            // And the definition (f64 reference).
            let mut r: Vec<f64> = row.iter().map(|&v| v as f64).collect();
            reference::fwht(&mut r);
            for (a, r) in a.iter().zip(&r) {
                assert!((*a as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()), "n {n}: {a} vs {r}");
            }
        }
    }
}

/// Integer scores bit for bit equal between the portable, AVX2 and AVX-512 VNNI kernels (integer
/// sums are exact), on random codes for every code width and group size.
#[test]
fn int_scores_match_between_kernels() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(avx) = Avx2::detect() else {
            eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
            return;
        };
        let vnni = avx2::Vnni::detect();
        if vnni.is_none() {
            eprintln!("SKIPPED: the VNNI integer scores (this processor has no AVX-512 VNNI and VL)");
        }
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
            // Head blocks of 1, 2, 3 and 4 (and 4 + 1, 4 + 2, 4 + 4).
            for (g, terms) in [1, 2, 3, 5, 6, 8].into_iter().flat_map(|g| [(g, 1), (g, 2)]) {
                let iq = IntQuery::new(&fmt, &values(g * d as usize, 6), g, terms);
                for n in [1, 2, 7, CHUNK] {
                    let (mut a, mut b) = (vec![0f32; g * CHUNK], vec![0f32; g * CHUNK]);
                    for j in 0..iq.groups {
                        Portable.dots_int(&iq, g, j, &codes, cb, n, &mut a);
                        avx.dots_int_with(None, &iq, g, j, &codes, cb, n, &mut b);
                        assert_eq!(a, b, "d{d} k{kb} g{gs} rows {g} terms {terms} n {n} group {j}");
                        if let Some(vnni) = vnni {
                            b.fill(0.0);
                            avx.dots_int_with(Some(vnni), &iq, g, j, &codes, cb, n, &mut b);
                            assert_eq!(a, b, "VNNI: d{d} k{kb} g{gs} rows {g} terms {terms} n {n} group {j}");
                        }
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
            exact.key_scores(Portable, &fmt, bytes, 0, n, &[]);
            let mut int = HeadState::new(&fmt, &qr, g).int_keys(&fmt, terms);
            int.key_scores(Portable, &fmt, bytes, 0, n, &[]);
            for slot in 0..n as u32 {
                let kc = fmt.key_codes_at(slot) as usize;
                let khat: Vec<f64> = (0..d)
                    .map(|c| {
                        let j = (c / fmt.group_size as usize) as u32;
                        let f = |o: u32| f16::from_le_bytes([bytes[o as usize], bytes[o as usize + 1]]).to_f64();
                        let per_byte = 8 / fmt.key_bits as usize;
                        let code = (bytes[kc + c / per_byte] as u32 >> ((c % per_byte) as u32 * fmt.key_bits)) & mask;
                        code as f64 * f(fmt.scale_at(false, j, slot)) + f(fmt.zero_at(false, j, slot))
                    })
                    .collect();
                for r in 0..g {
                    let want: f64 = q64[r * d..(r + 1) * d].iter().zip(&khat).map(|(a, b)| a * b).sum();
                    let (a, b) = (exact.s[r * CHUNK + slot as usize] as f64, int.s[r * CHUNK + slot as usize] as f64);
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

/// Rows that exercise the threshold quantizer: random values, a coarse grid (whose
/// values sit exactly on rounding ties `z + (k + 1/2) s` again and again), constant
/// groups, huge outliers, the ends of the f16 range, subnormals and signed zeros.
fn awkward_rows(d: usize, seed: u32) -> Vec<Vec<f16>> {
    let r = values(16 * d, seed);
    let mut rows: Vec<Vec<f16>> = Vec::new();
    rows.push(r[..d].iter().map(|&x| f16::from_f32(x)).collect());
    rows.push(r[d..2 * d].iter().map(|&x| f16::from_f32((x * 6.0).round() / 4.0)).collect());
    rows.push(r[2 * d..3 * d].iter().map(|&x| f16::from_f32((x * 8.0).round() * 0.375 - 3.0)).collect());
    rows.push(vec![f16::from_f32(-1.25); d]);
    rows.push((0..d).map(|c| f16::from_f32(if c % 37 == 5 { 3000.0 } else { r[3 * d + c] })).collect());
    rows.push((0..d).map(|c| if c % 2 == 0 { f16::MAX } else { f16::MIN }).collect());
    rows.push((0..d).map(|c| f16::from_bits((r[4 * d + c].to_bits() & 0x83ff) as u16)).collect());
    rows.push((0..d).map(|c| if c % 3 == 0 { f16::NEG_ZERO } else { f16::from_f32(r[5 * d + c] * 1e-3) }).collect());
    rows.push((0..d).map(|c| f16::from_f32((c % 4) as f32)).collect());
    // Zeros of both signs: as the extremes of a group, and as a whole group.
    rows.push((0..d).map(|c| if c % 2 == 0 { f16::NEG_ZERO } else { f16::ZERO }).collect());
    rows.push(
        (0..d)
            .map(|c| {
                if c % 5 == 1 {
                    f16::ZERO
                } else if c % 5 == 2 {
                    f16::NEG_ZERO
                } else {
                    f16::from_f32(r[6 * d + c].abs() + 0.1)
                }
            })
            .collect(),
    );
    rows.push(
        (0..d)
            .map(|c| {
                if c % 3 == 1 {
                    f16::NEG_ZERO
                } else if c % 3 == 2 {
                    f16::ZERO
                } else {
                    f16::from_f32(-r[7 * d + c].abs() - 0.1)
                }
            })
            .collect(),
    );
    rows
}

/// The one-pass staging of a Hadamard row ([`Kernels::stage_hadamard`], AVX2) writes
/// the f16 row of [`stage_input`] bit for bit (f32, f16 and bf16 input; keys as they
/// are, centered, centered and scaled; head_dim 64 and 128; groups of 32 to 128), the
/// ranges [`Kernels::group_ranges`] finds in it, and the squared norm of
/// [`load_affine`] to f32 rounding (1e-5 relative; it only picks the rows for the exact
/// test). A row with a huge outlier is among them. The pair pass
/// ([`Kernels::stage_hadamard_pair`], where the kernel set has one) writes what two
/// calls write, norms included.
#[test]
fn one_pass_staging_writes_the_staged_row() {
    #[cfg(target_arch = "x86_64")]
    fn run<T: KvElement>(avx: Avx2, conv: impl Fn(f32) -> T, pairs: &mut usize) {
        // The 512-bit pass also takes rows of 256.
        let dims: &[usize] = if avx.is_wide() { &[64, 128, 256] } else { &[64, 128] };
        for &d in dims {
            let mean = values(d, 7);
            let scale: Vec<f32> = values(d, 8).iter().map(|v| 1.0 + v.abs()).collect();
            for (a, affine) in
                [KeyAffine::None, KeyAffine::Center(&mean), KeyAffine::Full(&mean, &scale)].into_iter().enumerate()
            {
                for (i, mut row) in (0..6).map(|i| (i, values(d, 100 + i as u32))) {
                    if i == 5 {
                        row[d / 3] = 3.0e4;
                    }
                    let src: Vec<T> = row.iter().map(|&v| conv(v)).collect();
                    let (mut x, mut y, mut want) = (vec![0f32; d], vec![0f32; d], vec![f16::ZERO; d]);
                    // The expected row from the portable kernels (the FWHT of neither set).
                    let norm =
                        stage_input(Portable, &src, affine, HeadRotation::Hadamard, None, &mut x, &mut y, &mut want);
                    for g in [32usize, 64, 128, 256].into_iter().filter(|&g| g <= d) {
                        let mut got = vec![f16::ONE; d];
                        let mut ranges = vec![(f32::NAN, f32::NAN); d / g];
                        let fast = avx.stage_hadamard(&src, affine, g, &mut got, &mut ranges).expect("one pass");
                        let what =
                            format!("{} d{d} affine {a} row {i} g{g}", if avx.is_wide() { "avx512" } else { "avx2" });
                        assert_eq!(
                            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "{what}"
                        );
                        let mut found = vec![(0f32, 0f32); d / g];
                        avx.group_ranges(&want, g, &mut found);
                        assert_eq!(ranges, found, "{what}");
                        assert!((fast - norm).abs() <= 1e-5 * norm, "{what}: {fast} vs {norm}");
                        // The pair pass: the same bytes and norms as two calls (the
                        // value row without an affine), where the kernel set has one.
                        let vsrc: Vec<T> = values(d, 200 + i as u32).iter().map(|&v| conv(v)).collect();
                        let (mut vwant, mut vranges) = (vec![f16::ONE; d], vec![(f32::NAN, f32::NAN); d / g]);
                        let vnorm =
                            avx.stage_hadamard(&vsrc, KeyAffine::None, g, &mut vwant, &mut vranges).expect("one pass");
                        let (mut pk, mut pv) = (vec![f16::ZERO; d], vec![f16::ZERO; d]);
                        let (mut pkr, mut pvr) = (vec![(0f32, 0f32); d / g], vec![(0f32, 0f32); d / g]);
                        let bits = |r: &[f16]| r.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        match avx.stage_hadamard_pair(&src, affine, &vsrc, g, (&mut pk, &mut pkr), (&mut pv, &mut pvr))
                        {
                            Some((nk, nv)) => {
                                assert_eq!((bits(&pk), &pkr), (bits(&got), &ranges), "{what}: pair, key");
                                assert_eq!((bits(&pv), &pvr), (bits(&vwant), &vranges), "{what}: pair, value");
                                assert_eq!((nk.to_bits(), nv.to_bits()), (fast.to_bits(), vnorm.to_bits()), "{what}");
                                *pairs += 1;
                            }
                            None => assert!(d == 256, "{what}: no pair pass"),
                        }
                    }
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(avx) = Avx2::detect() {
        let mut pairs = 0;
        for (avx, _) in kernel_sets(avx) {
            run::<f32>(avx, |v| v, &mut pairs);
            run::<f16>(avx, f16::from_f32, &mut pairs);
            run::<half::bf16>(avx, half::bf16::from_f32, &mut pairs);
        }
        assert!(pairs > 0, "the pair pass never ran");
        return;
    }
    println!("SKIPPED: no AVX2, FMA and F16C on this processor");
}

/// Both kernel sets' page quantizers (`Kernels::quantize_rows`; the 512-bit one where
/// the processor has it) write the portable quantizer's bytes on every branch they
/// have: item counts that leave a short last block (13 rows of 1, 3 or 8 groups),
/// constant groups, groups whose range ends at a zero of either sign (the scalar
/// parameters), made-up ranges past the f16 range or infinite (thresholds that are
/// not finite: the row goes to the portable quantizer, whose divisions give the codes
/// the compares would give, so that branch only keeps the pass total), and rows
/// holding an infinity or a NaN whose range ends at a zero (the portable quantizer
/// from the scalar branch; it fails when that row is left to the compares). The
/// ranges given are always ordered (`lo <= hi`), as the quantizers require.
#[test]
#[cfg(target_arch = "x86_64")]
fn page_quantizers_match_portable_on_every_branch() {
    let Some(avx) = Avx2::detect() else {
        println!("SKIPPED: no AVX2, FMA and F16C on this processor");
        return;
    };
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let made_up = [f32::NEG_INFINITY, -70000.0, -65520.0, -65504.0, 0.5, 65504.0, 65520.0, 70000.0, f32::INFINITY];
    let mut cases = 0;
    for (d, g) in [(128usize, 128usize), (96, 32), (256, 32), (128, 64)] {
        let groups = d / g;
        for bits in [2u32, 4] {
            for clip in [NO_CLIP, 52_429] {
                for round in 0..12 {
                    let n = 13;
                    let mut rows: Vec<f16> = (0..n * d)
                        .map(|_| f16::from_bits((next() % 0x7800) as u16 | (next() as u16 & 0x8000)))
                        .collect();
                    let mut ranges = vec![(0f32, 0f32); n * groups];
                    for (i, x) in rows.chunks_exact_mut(g).enumerate() {
                        match (i + round) % 7 {
                            // A constant group.
                            1 => x.fill(f16::from_f32(1.5)),
                            // Non-negative, with an exact zero as its min; non-positive
                            // with a negative zero as its max.
                            2 => x.iter_mut().enumerate().for_each(|(c, v)| {
                                *v = if c == 3 { f16::ZERO } else { f16::from_bits(v.to_bits() & 0x7fff) }
                            }),
                            3 => x.iter_mut().enumerate().for_each(|(c, v)| {
                                *v = if c == 5 { f16::NEG_ZERO } else { f16::from_bits(v.to_bits() | 0x8000) }
                            }),
                            _ => {}
                        }
                        group_ranges_portable(x, g, std::slice::from_mut(&mut ranges[i]));
                        match (i + 2 * round) % 11 {
                            // A made-up ordered range, often past f16 or infinite.
                            4 | 9 => {
                                let (a, b) = (made_up[next() as usize % 9], made_up[next() as usize % 9]);
                                ranges[i] = (a.min(b), a.max(b));
                            }
                            // A value that is not finite, and a range ending at zero.
                            6 => {
                                x[next() as usize % g] =
                                    [f16::INFINITY, f16::NEG_INFINITY, f16::NAN][next() as usize % 3];
                                ranges[i] = if next() & 1 == 0 { (0.0, 7.0) } else { (-7.0, -0.0) };
                            }
                            _ => {}
                        }
                    }
                    let (cb, pb) = (d * bits as usize / 8, 4 * groups);
                    let (mut want_c, mut want_p) = (vec![0u8; n * cb], vec![0u8; n * pb]);
                    for r in 0..n {
                        quantize_row_portable(
                            &rows[r * d..(r + 1) * d],
                            bits,
                            g,
                            clip,
                            &ranges[r * groups..(r + 1) * groups],
                            &mut want_c[r * cb..(r + 1) * cb],
                            &mut want_p[r * pb..(r + 1) * pb],
                        );
                    }
                    for (kern, name) in kernel_sets(avx) {
                        let (mut c, mut p) = (vec![0xa5u8; n * cb], vec![0x5au8; n * pb]);
                        kern.quantize_rows(&rows, d, bits, g, clip, &ranges, &mut c, &mut p);
                        let what = format!("{name} d{d} g{g} bits {bits} clip {clip} round {round}");
                        for r in 0..n {
                            assert_eq!(
                                (&c[r * cb..(r + 1) * cb], &p[r * pb..(r + 1) * pb]),
                                (&want_c[r * cb..(r + 1) * cb], &want_p[r * pb..(r + 1) * pb]),
                                "{what}, row {r}, ranges {:?}",
                                &ranges[r * groups..(r + 1) * groups]
                            );
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(cases >= 192, "{cases} cases");
}

/// Both kernel sets' codes equal the count of thresholds at or below each value,
/// packed as `pack_into` packs them, for crafted thresholds: equal ones (ties after
/// rounding), `+inf` tails, all `+inf` (a constant group), values exactly on a
/// threshold, zeros of both signs; every group size, both code widths.
#[test]
#[cfg(target_arch = "x86_64")]
fn codes_match_the_threshold_count_on_crafted_thresholds() {
    let Some(avx) = Avx2::detect() else {
        println!("SKIPPED: no AVX2, FMA and F16C on this processor");
        return;
    };
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    let mut cases = 0;
    for bits in [2u32, 4] {
        let levels = (1usize << bits) - 1;
        for g in [32usize, 64, 128, 256] {
            for case in 0..200 {
                // A few distinct f16 values that the thresholds and the group share.
                let grid: Vec<f32> = (0..6).map(|_| f16::from_bits((next() % 0x7c00) as u16).to_f32()).collect();
                let pick = |r: u64| {
                    let v = grid[r as usize % grid.len()];
                    if r >> 8 & 1 == 1 { -v } else { v }
                };
                let mut th: Vec<f32> = (0..levels).map(|_| pick(next())).collect();
                th.sort_by(f32::total_cmp);
                match case % 4 {
                    // A +inf tail, or all +inf (a constant group's thresholds).
                    1 => th.iter_mut().skip(levels / 2).for_each(|t| *t = f32::INFINITY),
                    2 => th.fill(f32::INFINITY),
                    // All equal.
                    3 => {
                        let t = th[levels / 2];
                        th.fill(t);
                    }
                    _ => {}
                }
                let x: Vec<f16> = (0..g)
                    .map(|i| match next() % 4 {
                        0 => f16::from_f32(th[i % levels]),
                        1 => f16::from_bits((next() % 0x7c00) as u16 | (next() as u16 & 0x8000)),
                        2 => {
                            if i % 2 == 0 {
                                f16::ZERO
                            } else {
                                f16::NEG_ZERO
                            }
                        }
                        _ => f16::from_f32(pick(next())),
                    })
                    .filter(|v| v.is_finite())
                    .chain(std::iter::repeat(f16::ONE))
                    .take(g)
                    .collect();
                let count: Vec<u8> = x.iter().map(|v| th.iter().filter(|&&t| t <= v.to_f32()).count() as u8).collect();
                let mut want = vec![0u8; g * bits as usize / 8];
                pack_into(&count, bits, &mut want);
                for (kern, name) in kernel_sets(avx) {
                    let mut got = vec![0x5au8; want.len()];
                    kern.group_codes(&x, &th, bits, &mut got);
                    assert_eq!(got, want, "{name}: {bits}-bit, g {g}, case {case}, thresholds {th:?}");
                }
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 1600);
}

/// The prefetches reach every cache line a slice touches, from the line its first
/// byte is in, whatever the slice's offset in its line and its length (a page of a
/// 16-byte aligned pool, an input row a token stride from the last), and no other.
#[test]
#[cfg(target_arch = "x86_64")]
fn prefetches_cover_every_line_a_slice_touches() {
    let buf = vec![0u8; 1024];
    for start in 0..130 {
        for len in [0, 1, 15, 16, 48, 63, 64, 65, 127, 128, 129, 256, 300, 640] {
            let s = &buf[start..start + len];
            let got: Vec<usize> = avx2::lines(s).map(|p| p as usize / 64).collect();
            let a = s.as_ptr() as usize;
            let want: Vec<usize> = if len == 0 { vec![] } else { (a / 64..=(a + len - 1) / 64).collect() };
            assert_eq!(got, want, "offset {start}, {len} bytes");
        }
    }
}

/// The AVX2 and 512-bit quantizers' vector roundings agree with the scalar ones for
/// every kind of input: f64 to f16 to nearest even (`f64x4_to_f16` against [`f64_to_f16`]) and f64
/// up to f32 (`f64x4_up_to_f32` against `as f32` and `next_up`): random values over
/// the f16 range and beyond, exact f16 midpoints and their f64 neighbours, f16 and f32
/// subnormals, zeros of both signs, values past f16 and f32 overflow.
#[test]
#[cfg(target_arch = "x86_64")]
fn vector_roundings_match_scalar() {
    use std::arch::x86_64::*;
    let Some(_) = Avx2::detect() else {
        println!("SKIPPED: no AVX2, FMA and F16C on this processor");
        return;
    };
    let mut xs = vec![0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e300, -1e300, 3.0e38, 4.0e38];
    xs.extend([f64::INFINITY, f64::NEG_INFINITY, f64::NAN]);
    xs.extend([f64::MIN_POSITIVE, 5e-324, 2f64.powi(-24), 2f64.powi(-25), 2f64.powi(-25) * 1.0000001, 2f64.powi(-26)]);
    for b in (0..0x7c00u16).step_by(7) {
        // Each f16 and the midpoint above it, exactly and one f64 step off either way.
        let (a, c) = (f16::from_bits(b).to_f64(), f16::from_bits(b + 1).to_f64());
        let mid = (a + c) / 2.0;
        for x in [a, mid, mid.next_up(), mid.next_down(), (mid as f32) as f64] {
            xs.extend([x, -x]);
        }
    }
    let mut seed = 0x2545_f491u64;
    for _ in 0..20_000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let e = (seed >> 52) as i32 % 60 - 40;
        xs.push(
            f64::from_bits(seed >> 12 | 0x3ff0_0000_0000_0000) * 2f64.powi(e) * if seed & 1 == 0 { 1.0 } else { -1.0 },
        );
    }
    xs.truncate(xs.len() / 4 * 4);
    for x in xs.chunks_exact(4) {
        // SAFETY: AVX2, FMA and F16C were detected above; four f64 read.
        let (h, up) = unsafe {
            let v = _mm256_loadu_pd(x.as_ptr());
            let mut up = [0f32; 4];
            _mm_storeu_ps(up.as_mut_ptr(), avx2::f64x4_up_to_f32(v));
            (avx2::f64x4_to_f16(v), up)
        };
        for l in 0..4 {
            assert_eq!(h[l], f64_to_f16(x[l]), "f16 of {:e} ({:#x})", x[l], x[l].to_bits());
            let mut want = x[l] as f32;
            if (want as f64) < x[l] {
                want = want.next_up();
            }
            assert_eq!(up[l].to_bits(), want.to_bits(), "f32 up of {:e}", x[l]);
        }
    }
    // The 512-bit quantizer's roundings (rounding modes of the conversion itself).
    let Some(z) = avx512::Avx512::detect().filter(|_| !isa_is_avx2()) else {
        println!("SKIPPED: the 512-bit roundings (no AVX-512 F, or ROTKV_CPU_ISA=avx2)");
        return;
    };
    xs.truncate(xs.len() / 8 * 8);
    for x in xs.chunks_exact(8) {
        let (h, up) = z.roundings(x.try_into().expect("eight"));
        for l in 0..8 {
            assert_eq!(h[l], f64_to_f16(x[l]), "512-bit f16 of {:e} ({:#x})", x[l], x[l].to_bits());
            let mut want = x[l] as f32;
            if (want as f64) < x[l] {
                want = want.next_up();
            }
            assert_eq!(up[l].to_bits(), want.to_bits(), "512-bit f32 up of {:e}", x[l]);
        }
    }
}

/// [`quantize_into_page`] on `rows` at slots `slot..`, with the ranges the kernel set
/// finds.
fn quantize_rows_into<K: Kernels>(kern: K, fmt: &Format, rows: &[Vec<f16>], value: bool, slot: u32, bytes: &mut [u8]) {
    let g = fmt.group_size as usize;
    let flat: Vec<f16> = rows.concat();
    let mut ranges = vec![(0f32, 0f32); rows.len() * fmt.groups() as usize];
    for (row, rg) in flat.chunks_exact(fmt.head_dim as usize).zip(ranges.chunks_exact_mut(fmt.groups() as usize)) {
        kern.group_ranges(row, g, rg);
    }
    let mut params = vec![0u8; rows.len() * fmt.param_bytes() as usize];
    quantize_into_page(kern, fmt, &flat, &ranges, value, slot, bytes, &mut params);
}

/// The fused append's quantizer (threshold comparisons, [`group_codes`]) writes the
/// bytes of the reference's f64 division quantizer for every row, exact ties
/// included (the test counts them: it must meet some), with both kernel sets, a row
/// at a time and a page at a time (pages of 64 rows: four of the AVX2 quantizer's
/// blocks of 16, the awkward rows spread over all of them, and a partial page).
#[test]
fn threshold_quantizer_matches_reference_bit_for_bit() {
    let mut ties = 0;
    for (d, kb, vb, gs, clip) in [
        (64, 2, 4, 32, NO_CLIP),
        (128, 2, 2, 128, 52_429),
        (128, 4, 2, 64, NO_CLIP),
        (256, 4, 4, 256, 40_000),
        (256, 2, 4, 32, NO_CLIP),
        (128, 4, 4, 128, NO_CLIP),
        (256, 2, 2, 256, 52_429),
    ] {
        let fmt = Format {
            head_dim: d,
            key_bits: kb,
            value_bits: vb,
            group_size: gs,
            page_size: 64,
            sinks: 0,
            window: 0,
            key_clip: clip,
            value_clip: NO_CLIP,
            protected: 0,
            channel_norm: 0,
        };
        let d = d as usize;
        let rows = awkward_rows(d, d as u32 + kb + gs);
        for (i, row) in rows.iter().enumerate() {
            let x: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
            for value in [false, true] {
                let bits = fmt.bits(value);
                let slot = (i % 64) as u32;
                let (mut codes, mut params) =
                    (vec![0u8; fmt.code_bytes(value) as usize], vec![0u8; fmt.param_bytes() as usize]);
                reference::quantize_row(&x, bits, gs as usize, fmt.clip(value), &mut codes, &mut params);
                for (j, g) in x.chunks_exact(gs as usize).enumerate() {
                    let s = f16::from_le_bytes([params[4 * j], params[4 * j + 1]]).to_f64();
                    let z = f16::from_le_bytes([params[4 * j + 2], params[4 * j + 3]]).to_f64();
                    ties += g.iter().filter(|&&v| s > 0.0 && ((v - z) / s).fract().abs() == 0.5).count();
                }
                let check = |bytes: &[u8], kernels: &str| {
                    let c = fmt.codes_at(value, slot) as usize;
                    assert_eq!(
                        &bytes[c..c + codes.len()],
                        &codes[..],
                        "{kernels} codes, d{d} k{kb} v{vb} g{gs} row {i} value {value}"
                    );
                    assert_eq!(reference::page_params(&fmt, bytes, value, slot), params, "{kernels} params");
                };
                let one = std::slice::from_ref(row);
                let mut bytes = vec![0xAAu8; fmt.page_bytes() as usize];
                quantize_rows_into(Portable, &fmt, one, value, slot, &mut bytes);
                check(&bytes, "portable");
                #[cfg(target_arch = "x86_64")]
                if let Some(avx) = Avx2::detect() {
                    for (avx, name) in kernel_sets(avx) {
                        let mut bytes = vec![0x55u8; fmt.page_bytes() as usize];
                        quantize_rows_into(avx, &fmt, one, value, slot, &mut bytes);
                        check(&bytes, name);
                    }
                }
            }
        }
        // A page at a time: every slot's bytes as the same kernel set writes them a
        // row at a time (so, by the loop above, the reference's).
        for value in [false, true] {
            // 104 rows: the awkward ones, each also with its channels rotated.
            let many: Vec<Vec<f16>> = (0..104)
                .map(|i| {
                    let mut r = rows[i % rows.len()].clone();
                    r.rotate_left(i / rows.len() * 7 % d);
                    r
                })
                .collect();
            for page in many.chunks(64) {
                let slot = (64 - page.len()) as u32;
                let mut one_by_one = vec![0x33u8; fmt.page_bytes() as usize];
                for (i, row) in page.iter().enumerate() {
                    quantize_rows_into(
                        Portable,
                        &fmt,
                        std::slice::from_ref(row),
                        value,
                        slot + i as u32,
                        &mut one_by_one,
                    );
                }
                let mut bytes = vec![0x33u8; fmt.page_bytes() as usize];
                quantize_rows_into(Portable, &fmt, page, value, slot, &mut bytes);
                assert_eq!(bytes, one_by_one, "portable page, d{d} k{kb} v{vb} g{gs} value {value}");
                #[cfg(target_arch = "x86_64")]
                if let Some(avx) = Avx2::detect() {
                    for (avx, name) in kernel_sets(avx) {
                        let mut bytes = vec![0x33u8; fmt.page_bytes() as usize];
                        quantize_rows_into(avx, &fmt, page, value, slot, &mut bytes);
                        assert_eq!(bytes, one_by_one, "{name} page, d{d} k{kb} v{vb} g{gs} value {value}");
                    }
                }
            }
        }
    }
    assert!(ties > 100, "only {ties} exact ties met");
}

/// The AVX2 dense rotation (learned rotations' `x R`), one row and many rows at a
/// time, gives the scalar loop's bits for every shape the blocks meet (64- and
/// 8-output blocks and a scalar rest for one row; four rows against 16 outputs and the
/// rows left over for many), signed zeros and a zero row included.
#[test]
fn dense_rotation_matches_scalar_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(avx) = Avx2::detect() else {
            eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
            return;
        };
        for (seed, d) in [1usize, 5, 8, 24, 64, 72, 100, 128, 136, 256].into_iter().enumerate() {
            let r = values(d * d, 40 + seed as u32);
            let mut rows = vec![values(d, 80 + seed as u32), vec![0.0; d], vec![-0.0; d]];
            // Large and small magnitudes, so that the order of the additions shows.
            rows.push(
                values(d, 90 + seed as u32).iter().enumerate().map(|(i, v)| v * 8f32.powi(i as i32 % 9 - 4)).collect(),
            );
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for x in &rows {
                let (mut a, mut b) = (vec![f32::NAN; d], vec![f32::NAN; d]);
                dense_rotate(x, &r, &mut a);
                avx.dense_rotate(x, &r, &mut b);
                assert_eq!(bits(&a), bits(&b), "d {d}");
            }
            // Many rows at once (four at a time, then the rest), against row by row.
            for n in [1, 3, 4, 5, 8, 11] {
                let x: Vec<f32> =
                    (0..n).flat_map(|i| rows[i % rows.len()].iter().map(move |v| v * (i + 1) as f32)).collect();
                let mut a = vec![f32::NAN; n * d];
                for (xr, o) in x.chunks_exact(d).zip(a.chunks_exact_mut(d)) {
                    dense_rotate(xr, &r, o);
                }
                let mut b = vec![f32::NAN; n * d];
                avx.dense_rotate_rows(&x, &r, d, &mut b);
                assert_eq!(bits(&a), bits(&b), "d {d}, {n} rows");
            }
        }
    }
}

/// The fused softmax weights ([`Kernels::exp_weights`]: AVX2, and AVX-512 where the
/// processor has it) for every length from 0 to 70 (whole 16- and 8-token blocks and
/// tails), masked scores included: the weights bit for bit `exp_sum`'s `p` times the
/// scale, the sum `exp_sum`'s bits, the zero sum within 1e-6 of f64, and the 512-bit
/// kernels' bits those of the 256-bit ones.
#[test]
fn fused_softmax_weights_match_exp_sum() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(avx) = Avx2::detect() else {
            eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
            return;
        };
        for n in 0..=70usize {
            let mut scores: Vec<f32> = values(n, 7 + n as u32).iter().map(|x| x * 6.0).collect();
            if n > 5 {
                scores[n / 2] = f32::NEG_INFINITY;
            }
            let m = scores.iter().copied().fold(-1.0f32, f32::max) + 0.25;
            let scales: Vec<f32> = values(n, 300 + n as u32).iter().map(|x| x.abs() + 0.01).collect();
            let zeros = values(n, 600 + n as u32);
            let mut p = scores.clone();
            let l_want = avx.narrow().exp_sum(&mut p, m);
            let mut first: Option<(Vec<u32>, u32, u32)> = None;
            for (kern, what) in kernel_sets(avx) {
                let mut s = scores.clone();
                let mut w = vec![f32::NAN; n];
                let (l, z) = kern.exp_weights(&mut s, m, &scales, &zeros, &mut w);
                assert_eq!(l.to_bits(), l_want.to_bits(), "{what} n {n}: sum");
                for i in 0..n {
                    assert_eq!(w[i].to_bits(), (p[i] * scales[i]).to_bits(), "{what} n {n}: weight {i}");
                }
                let z_want: f64 = p.iter().zip(&zeros).map(|(&p, &z)| p as f64 * z as f64).sum();
                let mag: f64 = p.iter().zip(&zeros).map(|(&p, &z)| (p as f64 * z as f64).abs()).sum();
                assert!((z as f64 - z_want).abs() <= 1e-6 * mag + 1e-30, "{what} n {n}: zero sum {z} vs {z_want}");
                let bits = (w.iter().map(|x| x.to_bits()).collect(), l.to_bits(), z.to_bits());
                match &first {
                    None => first = Some(bits),
                    Some(f) => assert!(*f == bits, "{what} n {n}: bits differ from avx2"),
                }
            }
        }
    }
}

/// The AVX2 softmax exponential ([`avx2::exp8`]): relative error at most 2.5e-7
/// against f64 over `[-87, 20]` (measured 1.8e-7 in an f32 emulation of the same
/// steps; the softmax needs about 1e-6), 0 below -87 and for `-inf`, and
/// `exp_sum`'s weights and sum over awkward lengths agree with the portable kernel.
#[test]
fn fast_exp_is_accurate() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(avx) = Avx2::detect() else {
            eprintln!("SKIPPED: this processor has no AVX2/FMA/F16C");
            return;
        };
        let xs: Vec<f32> = (0..=1_070_000).map(|i| -87.0 + i as f32 * 1e-4).chain([0.0, -0.0, 20.0]).collect();
        let mut worst = 0f64;
        for c in xs.chunks(8) {
            let mut y = c.to_vec();
            let sum = avx.exp_sum(&mut y, 0.0);
            let mut want_sum = 0f64;
            for (&x, &y) in c.iter().zip(&y) {
                let want = (x as f64).exp();
                want_sum += want;
                worst = worst.max((y as f64 - want).abs() / want);
            }
            assert!((sum as f64 - want_sum).abs() <= 1e-6 * want_sum, "sum {sum} vs {want_sum}");
        }
        assert!(worst <= 2.5e-7, "worst relative error {worst}");
        let mut y = [f32::NEG_INFINITY, -87.5, -1000.0, f32::MIN, -0.5];
        let sum = avx.exp_sum(&mut y, 0.0);
        assert_eq!(&y[..4], &[0.0; 4]);
        assert!((sum - (-0.5f32).exp()).abs() < 1e-7);
        // Both kernel sets over lengths that leave tails, with a shifted max. The portable
        // kernel computes `exp(x - 20) * e^20`, and rounding `x - 20` costs it up to
        // `|x - 20| * 6e-8` relative: that (plus 5e-7) is the tolerance here.
        for n in [1, 7, 8, 9, 63, 64] {
            let s: Vec<f32> = values(n, n as u32).iter().map(|x| x * 10.0 + 3.0).collect();
            let (mut a, mut b) = (s.clone(), s.clone());
            let (sa, sb) = (Portable.exp_sum(&mut a, 5.0), avx.exp_sum(&mut b, 5.0));
            assert!((sa - sb).abs() <= 2e-6 * sa, "n {n}: {sa} vs {sb}");
            for ((x, y), arg) in a.iter().zip(&b).zip(&s) {
                let tol = ((arg - 5.0 - 20.0).abs() * 6e-8 + 5e-7) * x;
                assert!((x - y).abs() <= tol, "n {n}: {x} vs {y}");
            }
        }
        eprintln!("fast exp: worst relative error {worst:.2e} over [-87, 20]");
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
