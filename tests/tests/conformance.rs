//! The conformance suite: one body per property, run on every backend of this build
//! against the f64 reference (`Backend::all()`: cpu, and sim, the device kernels on the
//! SIMT emulator, which gets the smaller cases; cuda joins when it exists).
//!
//! Tolerances (each justified where it is used):
//! - bytes written by append: equal to the reference's, except where the f32 rotation of
//!   a backend and the f64 rotation of the reference round to different f16 values,
//!   which may only happen when the exact value sits at an f16 rounding tie (checked).
//! - decode outputs: `||out - ref|| / ||ref||` below `DECODE_TOL` on the same bytes
//!   (`DECODE_TOL_DENSE` with learned dense rotations).

use rotkv::paged::LayerShape;
use rotkv::reference;
use rotkv::{Backend, CacheConfig, Format, HeadRotation, Rotation, f16};
use rotkv_kernels::layout::Place;
use rotkv_kernels::params::DecodeParams;
use rotkv_tests::{
    Data, Rng, Store, backends, emulated, learned_calibration, random_calibration, rel_err, rows, small_config,
};

/// f32 accumulation (unit roundoff 6e-8) over at most 4097 tokens x 256 channels with
/// a polynomial exp of relative error 2e-7, against f64: the largest error observed over
/// this suite is 1.5e-5 (4-bit keys, g32, GQA 7); the bound leaves a 3x margin.
const DECODE_TOL: f64 = 5e-5;

/// With learned (dense) rotations the query and the output are rotated by D-term f32 dot
/// products instead of the FWHT's log2(D) butterflies: each logit's error grows by up
/// to `D * 6e-8 * |q| |k|`, which softmax passes on. Largest observed over this suite:
/// 5.2e-5 (D 256, 4-bit keys, huge outliers); the bound leaves a 3x margin.
const DECODE_TOL_DENSE: f64 = 1.5e-4;

/// The tensor-core kernel (`decode_mma`, chosen by the launch planning for the device
/// backends) feeds the tensor cores f16: the rotated query (relative rounding 2^-12, so a
/// logit moves by up to about `2^-12 * |q| |k|`) and the softmax weights times the value
/// scales (2^-12 each, averaging out over tokens). The largest error observed over this
/// suite is printed by `decode_case` (`--nocapture`); see docs/src/gpu.md.
const DECODE_TOL_MMA: f64 = 3e-3;

/// The tolerance of a decode on `backend` against the f64 reference.
fn decode_tol(backend: Backend, config: &CacheConfig, dense: bool) -> f64 {
    let fmt = config.format().unwrap();
    let mma = matches!(rotkv::launch::decode_kernel(&fmt), rotkv::launch::DecodeKernel::Mma { .. });
    if !matches!(backend, Backend::Reference | Backend::Cpu) && mma {
        DECODE_TOL_MMA
    } else if dense {
        DECODE_TOL_DENSE
    } else {
        DECODE_TOL
    }
}

fn fast_backends() -> impl Iterator<Item = Backend> {
    backends().into_iter().filter(|&b| b != Backend::Reference)
}

/// Checks that a backend's f16 row may differ from the reference's only at rounding ties
/// of the exact value; returns whether the rows are identical. "At a tie" means within
/// the f32 rotation's absolute error of the midpoint between the two f16 values: for the
/// FWHT, log2(D) butterfly levels of unit roundoff 6e-8 on values bounded by the row's
/// norm, so `1e-6 * ||x||` with a 2x margin for D = 256; for a dense rotation, a
/// D-term f32 dot product with a unit column, at most `D * 6e-8 * ||x||`.
fn check_rows(exact: &[f64], reference: &[f16], backend: &[f16], dense: bool) -> bool {
    let norm = exact.iter().map(|x| x * x).sum::<f64>().sqrt();
    let tie = if dense { exact.len() as f64 * 6e-8 } else { 1e-6 } * norm;
    let mut same = true;
    for ((&x, &r), &b) in exact.iter().zip(reference).zip(backend) {
        if r != b {
            same = false;
            let mid = (r.to_f64() + b.to_f64()) / 2.0;
            assert!(
                (x - mid).abs() <= tie,
                "f16 rows differ away from a tie: exact {x}, reference {r}, backend {b}, row norm {norm}"
            );
        }
    }
    same
}

/// Compares the bytes two backends appended, token by token and head by head.
/// Every f16 row a backend stores for `k`, `v` (`[token][kv_head][K|V][d]`), read back
/// from a cache whose window holds them all (nothing is quantized).
fn backend_rows(backend: Backend, like: &Store, k: &[f32], v: &[f32]) -> Vec<f16> {
    let d = like.config.head_dim;
    let hkv = like.shape.num_kv_heads;
    let n = k.len() / (hkv * d);
    let config = CacheConfig { sinks: 0, window: n.next_multiple_of(16), ..like.config };
    let mut st = Store::new(config, like.shape, n, None);
    st.calib = like.calib.clone();
    st.append(backend, k, v).unwrap();
    let fmt = config.format().unwrap();
    let mut out = Vec::with_capacity(n * hkv * 2 * d);
    for pos in 0..n as u32 {
        for h in 0..hkv as u32 {
            for value in [false, true] {
                let at = fmt.side_row_at(h, value, fmt.window_row(pos));
                out.extend_from_slice(&st.side[at..at + d]);
            }
        }
    }
    out
}

/// `rows` are the other backend's stored rows ([`backend_rows`]).
fn compare_appends(fmt: &Format, refs: &Store, other: &Store, k: &[f32], v: &[f32], rows: &[f16]) {
    let d = fmt.head_dim as usize;
    let hkv = refs.shape.num_kv_heads;
    let len = refs.len as u32;
    let flags = refs.config.flags() | refs.calib.flags();
    for pos in 0..len {
        for h in 0..hkv {
            let (mean, kperm, vperm) = refs.calib.head(h, d);
            let scale = refs.calib.head_key_scale(h, d);
            let at = (pos as usize * hkv + h) * d;
            for value in [false, true] {
                let (src, perm) = if value { (&v[at..at + d], vperm) } else { (&k[at..at + d], kperm) };
                let rot = refs.calib.rotation(value, h, d, flags);
                let centered: Vec<f64> = if value {
                    src.iter().map(|&x| x as f64).collect()
                } else {
                    src.iter().zip(mean).zip(scale).map(|((&x, &m), &s)| (x as f64 - m as f64) / s as f64).collect()
                };
                let exact = reference::rotate(&centered, rot, perm);
                let r = if value {
                    reference::stored_value(src, rot, perm)
                } else {
                    reference::stored_key(src, mean, scale, rot, perm)
                };
                let row = ((pos as usize * hkv + h) * 2 + value as usize) * d;
                let b = &rows[row..row + d];
                let same = check_rows(&exact, &r, b, matches!(rot, HeadRotation::Dense(_)));
                match fmt.place(pos, len) {
                    Place::Sink { index: row } | Place::Window { slot: row } => {
                        let s = fmt.side_row_at(h as u32, value, row);
                        assert_eq!(&refs.side[s..s + d], &r[..], "reference side row, pos {pos}");
                        assert_eq!(&other.side[s..s + d], b, "backend side row, pos {pos}");
                    }
                    Place::Page { page, slot } => {
                        let read = |st: &Store| {
                            reference::read_row(fmt, hkv, st.pool.bytes(), &st.seq(), h, pos as usize, value)
                        };
                        let bytes = |st: &Store| {
                            let base = fmt.page_offset(st.table[page as usize], h as u32, hkv as u32);
                            let head_page = &st.pool.bytes()[base..base + fmt.page_bytes() as usize];
                            let c = fmt.codes_at(value, slot) as usize;
                            (
                                head_page[c..c + fmt.code_bytes(value) as usize].to_vec(),
                                reference::page_params(fmt, head_page, value, slot),
                            )
                        };
                        if same {
                            assert_eq!(bytes(refs), bytes(other), "page bytes, pos {pos} head {h} value {value}");
                        } else {
                            // Inputs differ by one f16 ulp somewhere: the dequantized rows
                            // may then differ by at most one quantization step.
                            let (a, b) = (read(refs), read(other));
                            let (pa, pb) = (bytes(refs).1, bytes(other).1);
                            let gs = fmt.group_size as usize;
                            for (c, (x, y)) in a.iter().zip(&b).enumerate() {
                                let j = 4 * (c / gs);
                                let scale = |p: &[u8]| f16::from_le_bytes([p[j], p[j + 1]]).to_f64();
                                let step = scale(&pa).max(scale(&pb));
                                assert!((x - y).abs() <= step * 1.001 + 1e-3, "pos {pos}: {x} vs {y}, step {step}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn append_bytes_match_reference_for_every_config() {
    for (i, &(d, kb, vb, g)) in rotkv::SUPPORTED.iter().enumerate() {
        // Sinks and window vary too, down to none at all (every full page quantized).
        let config = CacheConfig {
            key_rotation: if i % 5 == 4 { Rotation::None } else { Rotation::Hadamard },
            sinks: [3, 0, 1][i % 3],
            window: [32, 0, 16][i % 3],
            // Clipped ranges too (append reads them; codes then saturate at the ends).
            key_clip: [1.0, 0.8, 0.65, 1.0][i % 4],
            value_clip: [1.0, 1.0, 0.9, 0.75][i % 4],
            ..small_config(d, kb, vb, g)
        };
        let shape = LayerShape { num_kv_heads: 2, num_q_heads: 2 };
        let n = 100;
        let k = rows(Data::Keys, n * 2, d as usize, 10 + i as u64);
        let v = rows(Data::Normal, n * 2, d as usize, 20 + i as u64);
        // Every other config with learned (dense) rotations instead of the Hadamard; every
        // fourth with the channels in their own order (key mean and scales kept, or, every
        // eighth, the mean only).
        let calib = if i % 2 == 1 {
            learned_calibration(2, d as usize, i as u64)
        } else {
            let mut c = random_calibration(2, d as usize, i as u64);
            if i % 4 == 0 {
                for perm in [&mut c.key_perm, &mut c.value_perm] {
                    perm.iter_mut().enumerate().for_each(|(j, p)| *p = (j % d as usize) as u16);
                }
            }
            if i % 8 == 0 {
                c.key_scale.fill(1.0);
            }
            c
        };
        for backend in fast_backends() {
            // Pages of 64 where the calibration keeps the channel order (the cpu backend's
            // one-pass staging and its page-at-a-time quantizer, four blocks of 16 rows),
            // except on the emulator, whose 60 tokens would not fill one.
            let config = CacheConfig { page_size: if i % 4 == 0 && !emulated(backend) { 64 } else { 16 }, ..config };
            let mut a = Store::new(config, shape, n, Some(i as u64));
            let mut b = a.clone();
            a.calib = calib.clone();
            b.calib = calib.clone();
            let row = 2 * d as usize;
            // The emulator takes 60 tokens: still past every config's first flush.
            let chunks: &[usize] = if emulated(backend) { &[1, 30, 1, 1, 27] } else { &[1, 40, 1, 1, 57] };
            let n = chunks.iter().sum::<usize>();
            let (k, v) = (&k[..n * row], &v[..n * row]);
            let mut at = 0;
            for &chunk in chunks {
                let r = at * row..(at + chunk) * row;
                a.append(Backend::Reference, &k[r.clone()], &v[r.clone()]).unwrap();
                b.append(backend, &k[r.clone()], &v[r]).unwrap();
                at += chunk;
            }
            let rows = backend_rows(backend, &b, k, v);
            compare_appends(&config.format().unwrap(), &a, &b, k, v, &rows);
        }
    }
}

#[test]
fn chunking_of_appends_is_invisible() {
    let config = CacheConfig { sinks: 4, window: 64, page_size: 16, ..CacheConfig::k2v2(64) };
    let fmt = config.format().unwrap();
    let shape = LayerShape { num_kv_heads: 3, num_q_heads: 9 };
    let n = 1000;
    let k = rows(Data::Keys, n * 3, 64, 1);
    let v = rows(Data::Normal, n * 3, 64, 2);
    let row = 3 * 64;
    for backend in backends() {
        // The emulator appends the first 300 tokens (still 4 sinks, 14 pages, a window).
        let n = if emulated(backend) { 300 } else { n };
        let (k, v) = (&k[..n * row], &v[..n * row]);
        let mut whole = Store::new(config, shape, n, None);
        whole.append(backend, k, v).unwrap();
        let mut pieces = Store::new(config, shape, n, None);
        let mut r = Rng::new(5);
        let mut at = 0;
        while at < n {
            let c = (1 + r.below(90)).min(n - at);
            pieces.append(backend, &k[at * row..(at + c) * row], &v[at * row..(at + c) * row]).unwrap();
            at += c;
        }
        assert_eq!(whole.pool, pieces.pool, "{backend:?}: pages differ");
        for pos in 0..n as u32 {
            if let Place::Sink { index: row } | Place::Window { slot: row } = fmt.place(pos, n as u32) {
                for h in 0..3 {
                    for value in [false, true] {
                        let s = fmt.side_row_at(h, value, row);
                        assert_eq!(whole.side[s..s + 64], pieces.side[s..s + 64], "{backend:?}: pos {pos}");
                    }
                }
            }
        }
    }
}

/// Every backend's append reads V at its own token stride (`AppendParams::v_token_stride`;
/// the paged API passes one stride for both, the device API may not): K inside a wider
/// fused row with V dense, and K dense with V inside a wider row, write the bytes of the
/// same tokens given dense at one stride, on the reference, the cpu backend and the
/// emulated kernels, for 37 tokens then 160 (one past the first page boundary: a page
/// quantized from window rows and new rows).
#[test]
fn append_reads_v_at_its_own_token_stride_on_every_backend() {
    use rotkv::paged::{self, PoolBuffer};
    use rotkv_kernels::params::{AppendParams, DTYPE_F32};
    let config = CacheConfig::k2v2(64);
    let fmt = config.format().unwrap();
    let (hkv, d) = (2, 64);
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: 4 };
    let calib = rotkv::LayerCalibration::identity(hkv, d);
    let row = hkv * d;
    let wide = 3 * row + 8;
    let counts = [37, 160];
    assert_eq!(fmt.pages_for(37 + 160), 1);
    let n: usize = counts.iter().sum();
    let (k, v) = (rows(Data::Keys, n * hkv, d, 31), rows(Data::Normal, n * hkv, d, 32));
    // The same rows inside wider rows (at element 5 of each), garbage around them.
    let widen = |x: &[f32]| -> Vec<f32> {
        let mut out = rows(Data::Normal, n * wide / d + 1, d, 33);
        for t in 0..n {
            out[t * wide + 5..t * wide + 5 + row].copy_from_slice(&x[t * row..(t + 1) * row]);
        }
        out
    };
    let (kw, vw) = (widen(&k), widen(&v));
    // (K input, K stride, V input, V stride): dense, K wide, V wide.
    let inputs: [(&[f32], usize, &[f32], usize); 3] =
        [(&k, row, &v, row), (&kw[5..], wide, &v, row), (&k, row, &vw[5..], wide)];
    for backend in ["reference", "cpu", "sim"] {
        let mut stored = Vec::new();
        for &(ki, ks, vi, vs) in &inputs {
            let mut pool = PoolBuffer::new(paged::pool_bytes(&config, &shape, 1).unwrap());
            let mut side = vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
            let mut start = 0;
            for &count in &counts {
                let p = AppendParams {
                    format: fmt,
                    num_kv_heads: hkv as u32,
                    start: start as u32,
                    count: count as u32,
                    new_len: (start + count) as u32,
                    num_blocks: 1,
                    flags: config.flags() | calib.flags(),
                    token_stride: ks as u32,
                    v_token_stride: vs as u32,
                    head_stride: d as u32,
                    input_dtype: DTYPE_F32,
                };
                let (ki, vi) = (&ki[start * ks..], &vi[start * vs..]);
                let (pool, side) = (pool.bytes_mut(), &mut side[..]);
                match backend {
                    "reference" => reference::append(&p, &calib, pool, &[0], side, &[], ki, vi),
                    "cpu" => rotkv::cpu::append(&p, &calib, pool, &[0], side, &[], ki, vi),
                    _ => {
                        let (kb, vb) = (f32_bytes(ki), f32_bytes(vi));
                        rotkv::sim::append_sim(&p, &calib, pool, &[0], side, &[], kb, vb).unwrap()
                    }
                }
                start += count;
            }
            assert!(pool.bytes().iter().any(|&b| b != 0), "{backend}: no page was written");
            stored.push((pool.bytes().to_vec(), side.iter().map(|x| x.to_bits()).collect::<Vec<_>>()));
        }
        assert!(stored[1] == stored[0], "{backend}: K at its own stride changed the bytes");
        assert!(stored[2] == stored[0], "{backend}: V at its own stride changed the bytes");
    }
}

/// The emulated append's raw entry point (`rotkv::sim::append_sim`, public and safe, its
/// kernels on raw addresses) checks its buffers itself: V too short at its own stride, a
/// block-table entry past the pool, a pool that is not whole blocks, a short side store,
/// an inconsistent length are errors, and nothing is written.
#[test]
fn raw_sim_append_checks_its_buffers() {
    use rotkv::paged::{self, PoolBuffer};
    use rotkv_kernels::params::{AppendParams, DTYPE_F32};
    let config = CacheConfig::k2v2(64);
    let fmt = config.format().unwrap();
    let (hkv, d, count) = (2, 64, 197);
    assert_eq!(fmt.pages_for(count as u32), 1);
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: 4 };
    let calib = rotkv::LayerCalibration::identity(hkv, d);
    let (k, v) = (rows(Data::Keys, count * hkv, d, 41), rows(Data::Normal, count * hkv, d, 42));
    let p = AppendParams {
        format: fmt,
        num_kv_heads: hkv as u32,
        start: 0,
        count: count as u32,
        new_len: count as u32,
        num_blocks: 1,
        flags: config.flags() | calib.flags(),
        token_stride: (hkv * d) as u32,
        v_token_stride: (hkv * d) as u32,
        head_stride: d as u32,
        input_dtype: DTYPE_F32,
    };
    let mut pool = PoolBuffer::new(paged::pool_bytes(&config, &shape, 1).unwrap());
    let mut side = vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
    let (kb, vb) = (f32_bytes(&k), f32_bytes(&v));
    let wide_v = AppendParams { v_token_stride: (2 * hkv * d) as u32, ..p };
    // (what, params, block table, pool bytes, side elements, v input)
    type Case<'a> = (&'a str, AppendParams, &'a [u32], usize, usize, &'a [u8]);
    let cases: [Case<'_>; 5] = [
        ("v short at its stride", wide_v, &[0], pool.bytes().len(), side.len(), vb),
        ("block past the pool", p, &[1], pool.bytes().len(), side.len(), vb),
        ("pool not whole blocks", p, &[0], pool.bytes().len() - 1, side.len(), vb),
        ("short side store", p, &[0], pool.bytes().len(), side.len() - 1, vb),
        ("length", AppendParams { new_len: count as u32 + 1, ..p }, &[0], pool.bytes().len(), side.len(), vb),
    ];
    for (what, p, table, pool_len, side_len, v) in cases {
        let e = rotkv::sim::append_sim(
            &p,
            &calib,
            &mut pool.bytes_mut()[..pool_len],
            table,
            &mut side[..side_len],
            &[],
            kb,
            v,
        );
        assert!(e.is_err(), "{what}: accepted");
        assert!(pool.bytes().iter().all(|&b| b == 0) && side.iter().all(|x| x.to_bits() == 0), "{what}: wrote");
    }
    rotkv::sim::append_sim(&p, &calib, pool.bytes_mut(), &[0], &mut side, &[], kb, vb).unwrap();
    assert!(pool.bytes().iter().any(|&b| b != 0) || side.iter().any(|x| x.to_bits() != 0));
}

/// `x`'s bytes (native order), as the emulated kernels read an f32 input.
fn f32_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: any f32 slice is a valid byte slice of 4x its length (no padding, u8 has
    // alignment 1), borrowed for `x`'s lifetime.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// Fills a store through the reference and decodes one query on every backend.
/// `emulate`: also on the SIMT emulator (else only the fast backends). The calibration
/// is random (key mean, permutations); every seed divisible by 3 also has learned
/// (dense) key and value rotations.
#[allow(clippy::too_many_arguments)]
fn decode_case(
    config: CacheConfig,
    hkv: usize,
    gqa: usize,
    len: usize,
    data: Data,
    seed: u64,
    splits: &[Option<u32>],
    emulate: bool,
) {
    let d = config.head_dim;
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hkv * gqa };
    let mut st = Store::new(config, shape, len, Some(seed));
    st.calib =
        if seed.is_multiple_of(3) { learned_calibration(hkv, d, seed) } else { random_calibration(hkv, d, seed) };
    let k = rows(data, len * hkv, d, seed);
    let v = rows(if data == Data::Keys { Data::Normal } else { data }, len * hkv, d, seed + 1);
    st.append(Backend::Reference, &k, &v).unwrap();
    let q = rows(Data::Normal, hkv * gqa, d, seed + 2);
    let want = st.decode(Backend::Reference, &q, Some(1)).unwrap();
    assert!(want.iter().all(|x| x.is_finite()));
    for backend in fast_backends().filter(|&b| emulate || !emulated(b)) {
        for &s in splits {
            let got = st.decode(backend, &q, s).unwrap();
            let e = rel_err(&got, &want);
            let tol = decode_tol(backend, &config, st.calib.key_rotation.is_some());
            if tol == DECODE_TOL_MMA {
                eprintln!(
                    "decode_mma rel err {e:.2e}: d {} gqa {gqa} len {len} {data:?} splits {s:?}",
                    config.head_dim
                );
            }
            assert!(e <= tol, "{backend:?} {config:?} gqa {gqa} len {len} {data:?} splits {s:?}: rel err {e:.2e}");
        }
    }
}

#[test]
fn decode_matches_reference_for_every_config() {
    let gqa = [1, 3, 7, 8];
    let data = [Data::Keys, Data::AllEqual, Data::ConstantGroups, Data::HugeOutliers];
    for (i, &(d, kb, vb, g)) in rotkv::SUPPORTED.iter().enumerate() {
        let config = CacheConfig { sinks: [3, 0][i % 2], window: [32, 0][i % 2], ..small_config(d, kb, vb, g) };
        // Sinks, 2 or more pages and window tokens: every kind of place is read.
        decode_case(config, 2, gqa[i % 4], 75, data[(i / 4) % 4], 100 + i as u64, &[None, Some(4)], true);
    }
}

#[test]
fn decode_matches_reference_at_boundary_and_long_lengths() {
    let configs = [
        CacheConfig::k2v2(64),
        CacheConfig { group_size: 32, ..CacheConfig::k4v2(128) },
        CacheConfig { key_bits: 2, value_bits: 4, group_size: 256, ..CacheConfig::k2v2(256) },
    ];
    for (i, config) in configs.into_iter().enumerate() {
        for len in [1, 63, 64, 65, 132, 133, 196, 197, 1000, 4097] {
            let gqa = if i == 1 { 3 } else { 8 };
            // The emulator takes every length up to 200 (the tensor-core kernel's 128
            // emulated threads per block make the long lengths too slow for CI).
            let emulate = len <= 200;
            let seed = len as u64 * 7 + i as u64;
            decode_case(config, 1 + i % 2, gqa, len, Data::Keys, seed, &[None, Some(1), Some(3)], emulate);
        }
    }
}

/// The tensor-core kernel's `cp.async` ring (`decode_mma::ring_stages`: every entry point
/// but head_dim 64 with 2-bit values; 3 stages or 2) on the emulator with one split,
/// so that each of the block's 4 warps takes 5 or more chunks and refills every stage of
/// its ring at least once; page size 16, so the 32-token chunks span two pages. The
/// emulator reports a read of another lane's copy without a barrier, a copy into a stage
/// another lane still reads, and a read before the wait (NaN).
#[test]
fn decode_ring_refills_every_stage() {
    // (head_dim, key bits, value bits, group, tokens per chunk)
    for (i, &(d, kb, vb, g, chunk)) in [
        (128, 2, 2, 128, 32),
        (128, 2, 2, 64, 32),
        (128, 4, 4, 64, 16),
        (64, 2, 4, 64, 16),
        // 3 stages with 4-bit keys; 2 stages of two tiles.
        (128, 4, 2, 128, 32),
        (128, 4, 4, 128, 32),
        (128, 4, 2, 64, 32),
        // head_dim 256: 3 stages (k2v2, k4v2, k2v4: 16 value matrices per tile) and 2
        // (k4v4); the natural-order fragments share the area with the rings.
        (256, 2, 2, 128, 16),
        (256, 4, 2, 128, 16),
        (256, 2, 4, 128, 16),
        (256, 4, 4, 128, 16),
    ]
    .iter()
    .enumerate()
    {
        let config = small_config(d, kb, vb, g);
        let len = 3 + 4 * 5 * chunk + 17 + 32;
        decode_case(config, 1, 4, len, Data::Keys, 900 + i as u64, &[Some(1)], true);
    }
}

#[test]
fn split_partials_merge_to_the_unsplit_result() {
    let config = small_config(64, 2, 2, 32);
    let fmt = config.format().unwrap();
    let shape = LayerShape { num_kv_heads: 2, num_q_heads: 6 };
    for len in [1usize, 17, 65] {
        let mut st = Store::new(config, shape, len, None);
        let k = rows(Data::Keys, len * 2, 64, 3);
        let v = rows(Data::Normal, len * 2, 64, 4);
        st.append(Backend::Reference, &k, &v).unwrap();
        let q = rows(Data::Normal, 6, 64, 5);
        let params = |splits: u32| DecodeParams {
            format: fmt,
            num_seqs: 1,
            num_q_heads: 6,
            num_kv_heads: 2,
            num_splits: splits,
            block_table_stride: st.table.len() as u32,
            flags: config.flags(),
            sm_scale: 0.125,
            q_seq_stride: 6 * 64,
            q_token_stride: 6 * 64,
            q_dtype: rotkv_kernels::params::DTYPE_F32,
            num_blocks: u32::MAX,
            max_len: u32::MAX,
            q_len: 1,
            attn_window: 0,
            batch_rows: 0,
            batch_seqs: 0,
        };
        let one = reference::decode_partials(&params(1), &st.calib, st.pool.bytes(), &[st.seq()], &q);
        for splits in 1..=70u32 {
            let parts = reference::decode_partials(&params(splits), &st.calib, st.pool.bytes(), &[st.seq()], &q);
            let empty = parts.iter().filter(|p| p.m == f64::NEG_INFINITY).count();
            if splits as usize > len {
                assert!(empty > 0, "{splits} splits of {len} tokens must leave some empty");
            }
            for h in 0..6 {
                let merged = reference::merge(&parts[h * splits as usize..(h + 1) * splits as usize]);
                let whole = reference::merge(&one[h..h + 1]);
                for (a, b) in merged.iter().zip(&whole) {
                    assert!(a.is_finite() && (a - b).abs() <= 1e-12 * b.abs().max(1.0), "len {len} splits {splits}");
                }
            }
        }
        let base = st.decode(Backend::Reference, &q, Some(1)).unwrap();
        for backend in fast_backends() {
            let counts: Vec<u32> = if emulated(backend) { vec![1, 2, 3, 7, 18, 64] } else { (1..=64).collect() };
            for splits in counts {
                let got = st.decode(backend, &q, Some(splits)).unwrap();
                assert!(rel_err(&got, &base) <= DECODE_TOL, "{backend:?} len {len} splits {splits}");
            }
        }
    }
    assert_eq!(reference::merge(&[reference::Partial { m: f64::NEG_INFINITY, l: 0.0, o: vec![0.0; 4] }]), vec![0.0; 4]);
}

/// With the window covering every token nothing is quantized: decode must then equal
/// plain softmax attention on the original keys and values up to f16 rounding of the
/// rotated rows (relative 2^-11 per element), whatever the mean, key scales (smoothing) and
/// permutations.
#[test]
fn rotation_bookkeeping_is_exact_without_quantization() {
    for (d, rot, learned) in [
        (64, Rotation::Hadamard, false),
        (128, Rotation::None, false),
        (256, Rotation::Hadamard, false),
        (64, Rotation::Hadamard, true),
    ] {
        let (hkv, gqa, len) = (2, 3, 50);
        let config = CacheConfig {
            window: 64,
            sinks: 2,
            key_rotation: rot,
            value_rotation: rot,
            page_size: 16,
            ..CacheConfig::k2v2(d)
        };
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hkv * gqa };
        let mut st = Store::new(config, shape, len, None);
        st.calib = if learned { learned_calibration(hkv, d, 7) } else { random_calibration(hkv, d, d as u64) };
        // Centered and smoothed keys (scales 0.5 to 2): attention must not see either.
        assert!(st.calib.key_scale.iter().any(|&s| s < 0.7) && st.calib.key_scale.iter().any(|&s| s > 1.5));
        let k = rows(Data::Keys, len * hkv, d, 1);
        let v = rows(Data::Normal, len * hkv, d, 2);
        st.append(Backend::Reference, &k, &v).unwrap();
        let q = rows(Data::Normal, hkv * gqa, d, 3);
        let scale = 1.0 / (d as f64).sqrt();
        let mut exact = vec![0f32; hkv * gqa * d];
        for qh in 0..hkv * gqa {
            let h = qh / gqa;
            let logits: Vec<f64> = (0..len)
                .map(|t| {
                    let kr = &k[(t * hkv + h) * d..(t * hkv + h + 1) * d];
                    scale * q[qh * d..(qh + 1) * d].iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                })
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for c in 0..d {
                exact[qh * d + c] =
                    (0..len).map(|t| w[t] * v[(t * hkv + h) * d + c] as f64).sum::<f64>() as f32 / sum as f32;
            }
        }
        for backend in backends() {
            let got = st.decode(backend, &q, None).unwrap();
            let e = rel_err(&got, &exact);
            assert!(e < 2e-3, "{backend:?} d {d} {rot:?} learned {learned}: {e:.2e}");
        }
    }
}

#[test]
fn quantizer_definitions() {
    // A constant group round-trips exactly and gives no NaN.
    for bits in [2, 4] {
        let g = reference::quantize_group(&[1.5; 32], bits);
        assert_eq!(g.scale.to_f64(), 0.0);
        assert_eq!(reference::dequantize_group(&g), vec![1.5; 32]);
        let g = reference::quantize_group(&[-3.25; 32], bits);
        assert_eq!(reference::dequantize_group(&g), vec![-3.25; 32]);
    }
    // Codes stay in range and the error is at most half a step (plus f16 rounding of
    // the scale and zero) inside the group's range.
    let mut r = Rng::new(9);
    for bits in [2, 4] {
        for _ in 0..200 {
            let x: Vec<f64> = (0..64).map(|_| r.normal() as f64 * 3.0).collect();
            let g = reference::quantize_group(&x, bits);
            assert!(g.codes.iter().all(|&c| (c as u32) < (1 << bits)));
            let y = reference::dequantize_group(&g);
            let s = g.scale.to_f64();
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= 0.5 * s + 2e-3 * a.abs().max(1.0), "{a} {b} step {s}");
            }
        }
        // Packing: channel c in byte c*bits/8 at bit (c*bits)%8, and back.
        let codes: Vec<u8> = (0..128).map(|_| r.below(1 << bits) as u8).collect();
        let packed = reference::pack_codes(&codes, bits);
        assert_eq!(packed.len(), 128 * bits as usize / 8);
        assert_eq!(reference::unpack_codes(&packed, bits, 128), codes);
        let c5 = (packed[5 * bits as usize / 8] >> ((5 * bits) % 8)) & ((1 << bits) - 1) as u8;
        assert_eq!(c5, codes[5]);
    }
    // The worked example of docs/src/format.md.
    let row: Vec<f64> = (0..32).map(|c| [0.0, 1.0, 2.0, 3.0][c % 4] * 0.5 - 0.25).collect();
    let g = reference::quantize_group(&row, 2);
    assert_eq!((g.scale.to_f64(), g.zero.to_f64()), (0.5, -0.25));
    assert_eq!(reference::pack_codes(&g.codes, 2)[0], 0b1110_0100);
}

#[test]
fn clipped_quantizer() {
    let q16 = |r: f64| (r * 65536.0).round() as u32;
    // 0..31 at half the range: [7.75, 23.25], scale 15.5 / 3 rounded to f16.
    let x: Vec<f64> = (0..32).map(f64::from).collect();
    let g = reference::quantize_group_clipped(&x, 2, q16(0.5));
    assert_eq!(g.zero.to_f64(), 7.75);
    assert_eq!(g.scale, rotkv::f16::from_f64(15.5 / 3.0));
    assert!(g.codes[..8].iter().all(|&c| c == 0) && g.codes[24..].iter().all(|&c| c == 3));
    // The whole range is the unclipped quantizer, bit for bit; constants stay exact.
    assert_eq!(reference::quantize_group_clipped(&x, 4, 65536), reference::quantize_group(&x, 4));
    for clip in [0.5, 0.8] {
        let g = reference::quantize_group_clipped(&[-3.25; 32], 2, q16(clip));
        assert_eq!(reference::dequantize_group(&g), vec![-3.25; 32]);
    }
    // On Gaussian groups of 64 at 2 bits, 0.8 of the range has a lower mean squared
    // error than the whole range (the extremes are rare; the inner levels get finer).
    let mut r = Rng::new(21);
    let (mut full, mut clipped) = (0.0, 0.0);
    for _ in 0..500 {
        let x: Vec<f64> = (0..64).map(|_| r.normal() as f64).collect();
        let err = |g: &reference::QuantGroup| -> f64 {
            reference::dequantize_group(g).iter().zip(&x).map(|(a, b)| (a - b).powi(2)).sum()
        };
        full += err(&reference::quantize_group(&x, 2));
        clipped += err(&reference::quantize_group_clipped(&x, 2, q16(0.8)));
    }
    assert!(clipped < 0.9 * full, "clipped {clipped} vs full {full}");
    // Out of range clip fractions are refused by the configuration.
    for bad in [0.4f32, 1.01, f32::NAN] {
        assert!(CacheConfig { key_clip: bad, ..CacheConfig::k2v2(64) }.format().is_err());
    }
}

#[test]
fn fwht_is_orthonormal_and_self_inverse() {
    let mut r = Rng::new(1);
    for n in [1, 2, 64, 128, 256] {
        let x: Vec<f64> = (0..n).map(|_| r.normal() as f64).collect();
        let mut y = x.clone();
        reference::fwht(&mut y);
        let (nx, ny) = (x.iter().map(|a| a * a).sum::<f64>(), y.iter().map(|a| a * a).sum::<f64>());
        assert!((nx - ny).abs() <= 1e-12 * nx.max(1.0));
        reference::fwht(&mut y);
        x.iter().zip(&y).for_each(|(a, b)| assert!((a - b).abs() < 1e-12));
        let mut f: Vec<f32> = x.iter().map(|&a| a as f32).collect();
        rotkv::cpu::fwht(&mut f);
        let mut e = x.clone();
        reference::fwht(&mut e);
        f.iter().zip(&e).for_each(|(a, b)| assert!((*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs())));
    }
    // H_2 in natural order: [1, 1; 1, -1] / sqrt(2).
    let mut e = vec![1.0, 0.0];
    reference::fwht(&mut e);
    assert!((e[0] - 0.5f64.sqrt()).abs() < 1e-15 && (e[1] - 0.5f64.sqrt()).abs() < 1e-15);
}

#[test]
fn scores_need_no_dequantized_keys() {
    // q'.khat = scale * (q'.codes) + zero * sum(q'), the identity the kernels use.
    let mut r = Rng::new(4);
    let x: Vec<f64> = (0..64).map(|_| r.normal() as f64).collect();
    let q: Vec<f64> = (0..64).map(|_| r.normal() as f64).collect();
    let g = reference::quantize_group(&x, 2);
    let direct: f64 = q.iter().zip(reference::dequantize_group(&g)).map(|(a, b)| a * b).sum();
    let codes: f64 = q.iter().zip(&g.codes).map(|(a, &c)| a * c as f64).sum();
    let trick = g.scale.to_f64() * codes + g.zero.to_f64() * q.iter().sum::<f64>();
    assert!((direct - trick).abs() < 1e-12);
    // and the rotated query scores like the original one, also with key scales
    // (smoothing): the query times s against the key divided by s.
    let perm: Vec<u16> = (0..64).rev().collect();
    let dense = rotkv_tests::random_rotation(64, 3);
    let scale: Vec<f32> = (0..64).map(|c| 0.25 + (c % 9) as f32 * 0.5).collect();
    let smoothed: Vec<f64> = x.iter().zip(&scale).map(|(a, &s)| a / s as f64).collect();
    for rot in [HeadRotation::Hadamard, HeadRotation::Dense(&dense)] {
        let q32 = q.iter().map(|&v| v as f32).collect::<Vec<_>>();
        let a = reference::rotate_query(&q32, &vec![1.0; 64], rot, &perm);
        let b = reference::rotate(&x, rot, &perm);
        let (a2, b2) = (reference::rotate_query(&q32, &scale, rot, &perm), reference::rotate(&smoothed, rot, &perm));
        let smooth: f64 = a2.iter().zip(&b2).map(|(a, b)| a * b).sum();
        let rotated: f64 = a.iter().zip(&b).map(|(a, b)| a * b).sum();
        let plain: f64 = q.iter().map(|&v| v as f32 as f64).zip(&x).map(|(a, b)| a * b).sum();
        // (The dense matrix is orthogonal to f32 rounding: 1e-7 relative.)
        assert!((rotated - plain).abs() < 1e-5, "{rot:?}: {rotated} vs {plain}");
        assert!((smooth - plain).abs() < 1e-5, "{rot:?} smoothed: {smooth} vs {plain}");
        assert!(reference::unrotate(&b, rot, &perm).iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-5));
    }
}

/// Protected positions (detected attention sinks): set before they arrive and while they
/// are in the window, across chunked appends and page flushes. Every backend writes the
/// reference's bytes (pages and side store, protected rows included: no rotation and no
/// mean, so the stored rows are the inputs rounded to f16 on every backend), quantized
/// protected positions read back as their exact f16 rows, and decode matches the
/// reference.
#[test]
fn protected_positions_stay_f16_on_every_backend() {
    let config = CacheConfig {
        key_rotation: Rotation::None,
        value_rotation: Rotation::None,
        protected: 6,
        ..small_config(64, 2, 2, 32)
    };
    let fmt = config.format().unwrap();
    let shape = LayerShape { num_kv_heads: 2, num_q_heads: 6 };
    let n = 120;
    let k = rows(Data::Keys, n * 2, 64, 41);
    let v = rows(Data::Normal, n * 2, 64, 42);
    let row = 2 * 64;
    // (chunk of tokens, then positions protected after it): 4 and 9 before they arrive,
    // 20 while in the window, 50 and 101 later; 36 is a page boundary's neighbour.
    let steps: [(usize, &[u32]); 4] = [(0, &[4, 9]), (25, &[20, 36]), (40, &[50]), (55, &[101])];
    for backend in backends() {
        let mut st = Store::new(config, shape, n, Some(7));
        let mut at = 0;
        for &(chunk, more) in &steps {
            st.append(backend, &k[at * row..(at + chunk) * row], &v[at * row..(at + chunk) * row]).unwrap();
            at += chunk;
            st.protect(more).unwrap();
        }
        assert_eq!(at, n);
        if backend == Backend::Reference {
            // Quantized protected positions read back exactly (their f16 rows).
            let seq = st.seq();
            let quantized: Vec<u32> = st
                .protected
                .iter()
                .copied()
                .filter(|&p| matches!(fmt.place(p, n as u32), Place::Page { .. }))
                .collect();
            assert_eq!(quantized, [4, 9, 20, 36, 50], "(101 is still in the window)");
            for &pos in &quantized {
                for h in 0..2 {
                    for value in [false, true] {
                        let src = if value { &v } else { &k };
                        let x = &src[(pos as usize * 2 + h) * 64..][..64];
                        let want: Vec<f64> = x.iter().map(|&a| f16::from_f32(a).to_f64()).collect();
                        let got = reference::read_row(&fmt, 2, st.pool.bytes(), &seq, h, pos as usize, value);
                        assert_eq!(got, want, "pos {pos} head {h} value {value}");
                    }
                }
            }
        }
        let mut refs = Store::new(config, shape, n, Some(7));
        let mut at = 0;
        for &(chunk, more) in &steps {
            refs.append(Backend::Reference, &k[at * row..(at + chunk) * row], &v[at * row..(at + chunk) * row])
                .unwrap();
            at += chunk;
            refs.protect(more).unwrap();
        }
        assert_eq!(st.pool, refs.pool, "{backend:?}: pages");
        // The live side rows: sinks, window and protected rows (ring rows of tokens that
        // went straight to a page hold whatever a backend left there).
        let mut live: Vec<u32> = (0..n as u32)
            .filter_map(|pos| match fmt.place(pos, n as u32) {
                Place::Sink { index: r } | Place::Window { slot: r } => Some(r),
                Place::Page { .. } => None,
            })
            .collect();
        live.extend((0..st.protected.len() as u32).map(|i| fmt.protected_row(i)));
        for h in 0..2 {
            for value in [false, true] {
                for &r in &live {
                    let at = fmt.side_row_at(h, value, r);
                    assert_eq!(st.side[at..at + 64], refs.side[at..at + 64], "{backend:?}: side row {r}");
                }
            }
        }
    }
    // Decode with rotations, a random calibration and splits on every backend.
    let config = CacheConfig { protected: 5, ..small_config(128, 4, 2, 64) };
    let mut st = Store::new(config, shape, n, Some(3));
    st.calib = random_calibration(2, 128, 3);
    st.protect(&[3, 17, 18, 60, 90]).unwrap();
    let k = rows(Data::Keys, n * 2, 128, 43);
    let v = rows(Data::Normal, n * 2, 128, 44);
    st.append(Backend::Reference, &k, &v).unwrap();
    let q = rows(Data::Normal, 6, 128, 45);
    let want = st.decode(Backend::Reference, &q, Some(1)).unwrap();
    let mut plain = st.clone();
    plain.protected.clear();
    let unprotected = plain.decode(Backend::Reference, &q, Some(1)).unwrap();
    assert!(rel_err(&unprotected, &want) > 1e-4, "protection should change the result");
    for backend in fast_backends() {
        for splits in [None, Some(1), Some(4)] {
            let got = st.decode(backend, &q, splits).unwrap();
            let e = rel_err(&got, &want);
            let tol = decode_tol(backend, &config, false);
            assert!(e <= tol, "{backend:?} splits {splits:?}: {e:.2e}");
        }
    }
}

#[test]
fn protecting_checks_its_positions_and_changes_nothing_on_error() {
    let config = CacheConfig { protected: 3, ..small_config(64, 2, 2, 32) };
    let shape = LayerShape { num_kv_heads: 2, num_q_heads: 2 };
    let mut st = Store::new(config, shape, 200, None);
    let k = rows(Data::Keys, 100 * 2, 64, 1);
    st.append(Backend::Cpu, &k, &k).unwrap();
    // 3 sinks, 16-token pages, a 32-token window: 100 tokens leave 64 quantized.
    let before = st.clone();
    for bad in [&[60u32][..], &[1], &[90, 80], &[80, 90, 95, 99], &[80, 80]] {
        assert!(st.protect(bad).is_err(), "{bad:?}");
        assert_eq!(st, before, "{bad:?} changed the store");
    }
    st.protect(&[80]).unwrap();
    // The list only grows at its end.
    assert!(st.protect(&[70]).is_err());
    st.protect(&[150, 160]).unwrap();
    assert!(st.protect(&[170]).is_err());
    // A list that does not fit the configuration is refused by append and decode too.
    st.protected = vec![80, 150, 160, 170];
    assert!(st.append(Backend::Cpu, &k[..128], &k[..128]).is_err());
    assert!(st.decode(Backend::Cpu, &rows(Data::Normal, 2, 64, 2), None).is_err());
    // Without room in the configuration nothing can be protected.
    let mut none = Store::new(small_config(64, 2, 2, 32), shape, 200, None);
    assert!(none.protect(&[10]).is_err());
}

/// KVarN variance normalization: per head-page f16 channel scales from a few Sinkhorn
/// iterations, channels divided by them before quantization. The cpu backend writes the
/// reference's bytes (no rotation or mean here, so the stored rows are the same f16
/// values on both) and decodes within `DECODE_TOL`; degenerate pages stay finite; the
/// device kernels refuse it.
#[test]
fn variance_normalization_on_reference_and_cpu() {
    let shape = LayerShape { num_kv_heads: 2, num_q_heads: 6 };
    let n = 150;
    for (i, (d, kb, vb, g, iters)) in
        [(64, 2, 2, 32, 3), (128, 4, 2, 64, 1), (256, 2, 4, 256, 2)].into_iter().enumerate()
    {
        let config = CacheConfig {
            key_rotation: Rotation::None,
            value_rotation: Rotation::None,
            channel_norm: iters,
            ..small_config(d, kb, vb, g)
        };
        let fmt = config.format().unwrap();
        let row = 2 * d as usize;
        for data in [Data::Keys, Data::AllEqual, Data::ConstantGroups, Data::HugeOutliers] {
            let k = rows(data, n * 2, d as usize, 60 + i as u64);
            let v = rows(if data == Data::Keys { Data::Normal } else { data }, n * 2, d as usize, 70 + i as u64);
            let mut a = Store::new(config, shape, n, Some(i as u64));
            let mut b = a.clone();
            for (at, chunk) in [(0, 1), (1, 70), (71, 1), (72, 78)] {
                let r = at * row..(at + chunk) * row;
                a.append(Backend::Reference, &k[r.clone()], &v[r.clone()]).unwrap();
                b.append(Backend::Cpu, &k[r.clone()], &v[r]).unwrap();
            }
            assert_eq!(a.pool, b.pool, "d {d} {data:?}: pages");
            // Channel scales: positive f16 with an RMS near 1 (exactly 1 before rounding
            // and flooring).
            let at = fmt.page_offset(a.table[0], 0, 2);
            let page = &a.pool.bytes()[at..at + fmt.page_bytes() as usize];
            for value in [false, true] {
                let sc = reference::page_channel_scales(&fmt, page, value);
                assert!(sc.iter().all(|&s| s > 0.0 && s.is_finite()), "{data:?}: {sc:?}");
                let rms = (sc.iter().map(|s| s * s).sum::<f64>() / sc.len() as f64).sqrt();
                assert!((0.99..1.01).contains(&rms), "{data:?}: rms {rms}");
            }
            let q = rows(Data::Normal, 6, d as usize, 80 + i as u64);
            let want = a.decode(Backend::Reference, &q, Some(1)).unwrap();
            assert!(want.iter().all(|x| x.is_finite()), "d {d} {data:?}");
            for splits in [None, Some(3)] {
                let got = a.decode(Backend::Cpu, &q, splits).unwrap();
                let e = rel_err(&got, &want);
                assert!(e <= DECODE_TOL, "d {d} {data:?} splits {splits:?}: {e:.2e}");
            }
        }
    }
    // With rotations, a random calibration and protected positions too.
    let config = CacheConfig { channel_norm: 2, protected: 2, ..small_config(128, 2, 2, 32) };
    let mut st = Store::new(config, shape, n, Some(9));
    st.calib = random_calibration(2, 128, 9);
    st.protect(&[10, 40]).unwrap();
    st.append(Backend::Reference, &rows(Data::Keys, n * 2, 128, 90), &rows(Data::Normal, n * 2, 128, 91)).unwrap();
    let q = rows(Data::Normal, 6, 128, 92);
    let want = st.decode(Backend::Reference, &q, Some(1)).unwrap();
    let e = rel_err(&st.decode(Backend::Cpu, &q, None).unwrap(), &want);
    assert!(e <= DECODE_TOL, "rotated: {e:.2e}");
    // The device kernels refuse it, before writing anything.
    for backend in fast_backends().filter(|&b| b != Backend::Cpu) {
        let before = st.clone();
        let err = st.append(backend, &rows(Data::Keys, 2, 128, 93), &rows(Data::Normal, 2, 128, 94)).unwrap_err();
        assert!(matches!(err, rotkv::Error::Unsupported(_)), "{backend:?}: {err}");
        assert_eq!(st, before);
        assert!(matches!(st.decode(backend, &q, None), Err(rotkv::Error::Unsupported(_))));
    }
}

/// What variance normalization buys: a page whose channels have very different ranges
/// (after no rotation) is quantized with a much smaller error in its small channels.
#[test]
fn variance_normalization_equalizes_channel_ranges() {
    let d = 64;
    let mut r = Rng::new(12);
    let scale: Vec<f64> = (0..d).map(|c| if c % 8 == 0 { 20.0 } else { 0.5 }).collect();
    let rows: Vec<f64> = (0..16 * d).map(|i| f16::from_f64(r.normal() as f64 * scale[i % d]).to_f64()).collect();
    let mut err = [0.0; 2];
    for (e, iters) in err.iter_mut().zip([0, 3]) {
        let fmt = CacheConfig { channel_norm: iters, ..small_config(64, 2, 2, 64) }.format().unwrap();
        let mut page = vec![0u8; fmt.page_bytes() as usize];
        reference::quantize_page(&fmt, &rows, false, &mut page);
        let sc = if iters > 0 { reference::page_channel_scales(&fmt, &page, false) } else { vec![1.0; d] };
        for slot in 0..16 {
            let c = fmt.codes_at(false, slot) as usize;
            let params = reference::page_params(&fmt, &page, false, slot);
            let x = reference::dequantize_row(&page[c..c + 16], &params, 2, 64, d);
            for ch in (0..d).filter(|c| c % 8 != 0) {
                *e += (x[ch] * sc[ch] - rows[slot as usize * d + ch]).powi(2);
            }
        }
    }
    assert!(err[1] < 0.2 * err[0], "small channels: normalized {} vs plain {}", err[1], err[0]);
}

/// Whether a device backend refused a multi-token decode (`q_len > 1`) with a clear error
/// instead of computing it: allowed only while the device kernels decode one token per
/// sequence (said SKIPPED, never a silent pass). The CPU backend must compute it.
fn device_refuses_rows(backend: Backend, q_len: usize, result: &rotkv::Result<Vec<f32>>) -> bool {
    let refused = q_len > 1
        && !matches!(backend, Backend::Reference | Backend::Cpu)
        && matches!(result, Err(rotkv::Error::Shape(_) | rotkv::Error::Unsupported(_)));
    if refused {
        eprintln!("SKIPPED: {} backend refuses q_len {q_len}: {}", backend.name(), result.as_ref().unwrap_err());
    }
    refused
}

/// One multi-token decode case: a sequence of `len` tokens (appended at once through the
/// reference into a shuffled block table, with `protect` positions protected first)
/// decoded with `q_len` query rows.
/// - every fast backend (the emulator only with `emulate`) matches the f64 reference
///   within the suite's tolerance, for each split count of `splits`;
/// - row `i` equals a one-token decode of the same tokens appended one at a time and
///   stopped at `len - q_len + i + 1` (the position row `i` is), bit for bit on the
///   reference (one split: the same positions in the same order) and within the tolerance
///   on the fast backends, wherever no page of the window was quantized between that
///   length and `len` (a flush changes what the later cache holds: covered by the first
///   check).
///
/// A device backend that refuses `q_len > 1` is said SKIPPED ([`device_refuses_rows`]).
#[allow(clippy::too_many_arguments)]
fn rows_case(
    config: CacheConfig,
    gqa: usize,
    len: usize,
    q_len: usize,
    protect: &[u32],
    seed: u64,
    splits: &[Option<u32>],
    emulate: bool,
) {
    let d = config.head_dim;
    let hkv = 2;
    let hq = hkv * gqa;
    let fmt = config.format().unwrap();
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let mut st = Store::new(config, shape, len, Some(seed));
    st.calib =
        if seed.is_multiple_of(3) { learned_calibration(hkv, d, seed) } else { random_calibration(hkv, d, seed) };
    let mut inc = st.clone();
    st.protect(protect).unwrap();
    inc.protect(protect).unwrap();
    let k = rows(Data::Keys, len * hkv, d, seed);
    let v = rows(Data::Normal, len * hkv, d, seed + 1);
    st.append(Backend::Reference, &k, &v).unwrap();
    let q = rows(Data::Normal, q_len * hq, d, seed + 2);
    let what = format!("{config:?} gqa {gqa} len {len} q_len {q_len} protected {protect:?}");
    let want = st.decode_rows(Backend::Reference, &q, q_len, Some(1)).unwrap();
    assert!(want.iter().all(|x| x.is_finite()), "{what}");
    let dense = st.calib.key_rotation.is_some();
    let fast: Vec<Backend> = fast_backends().filter(|&b| emulate || !emulated(b)).collect();
    let mut skip = Vec::new();
    for &backend in &fast {
        // The emulator takes the first two split counts only.
        for &s in splits.iter().take(if emulated(backend) { 2 } else { splits.len() }) {
            let got = st.decode_rows(backend, &q, q_len, s);
            if device_refuses_rows(backend, q_len, &got) {
                skip.push(backend);
                break;
            }
            let e = rel_err(&got.unwrap(), &want);
            let tol = decode_tol(backend, &config, dense);
            assert!(e <= tol, "{backend:?} {what} splits {s:?}: rel err {e:.2e}");
        }
    }
    // Row i against a one-token decode right after its own token's append.
    let row = hkv * d;
    let flushed = fmt.quantized_len(len as u32);
    for t in 0..len {
        inc.append(Backend::Reference, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row]).unwrap();
        let Some(i) = (t + q_len).checked_sub(len) else { continue };
        if fmt.quantized_len(t as u32 + 1) != flushed {
            continue;
        }
        let (qi, wi) = (&q[i * hq * d..(i + 1) * hq * d], &want[i * hq * d..(i + 1) * hq * d]);
        let one = inc.decode(Backend::Reference, qi, Some(1)).unwrap();
        assert_eq!(one, wi, "reference {what}: row {i} vs a one-token decode");
        for &backend in fast.iter().filter(|b| !skip.contains(b)) {
            let got = st.decode_rows(backend, &q, q_len, None).unwrap();
            let e = rel_err(&got[i * hq * d..(i + 1) * hq * d], &inc.decode(backend, qi, None).unwrap());
            // Both sides on the device kernels: twice the one-sided tolerance.
            let tol = 2.0 * decode_tol(backend, &config, dense);
            assert!(e <= tol, "{backend:?} {what}: row {i} vs a one-token decode: rel err {e:.2e}");
        }
    }
}

#[test]
fn multi_token_decode_matches_reference_and_one_token_decodes() {
    // 16-token pages, 3 sinks, a 32-token window: the first page is quantized at 51
    // tokens, the second at 67.
    let configs = [
        small_config(64, 2, 2, 32),
        CacheConfig { protected: 3, ..small_config(128, 4, 2, 64) },
        CacheConfig { sinks: 0, window: 0, ..small_config(256, 2, 4, 128) },
    ];
    let gqa = [1, 3, 8];
    for q_len in 1..=8usize {
        for (j, len) in [q_len, q_len + 1, 50, 51, 52, 66 + q_len / 2, 100].into_iter().enumerate() {
            let i = q_len + j;
            let config = configs[i % 3];
            // Protected positions (where the config has room): one in each of the first
            // pages and one near the end, protected before the tokens arrive.
            let mut protect: Vec<u32> = [5, 30, len.saturating_sub(2) as u32]
                .into_iter()
                .filter(|&p| config.protected > 0 && p >= 3 && p < len as u32)
                .collect();
            protect.sort_unstable();
            protect.dedup();
            // The emulator takes a few short cases (it runs every GPU thread in turn).
            let emulate = matches!((q_len, len), (1, 2) | (2, 3) | (5, 52) | (8, 8));
            let splits = [None, Some(1), Some(3), Some(len as u32)];
            rows_case(config, gqa[i % 3], len, q_len, &protect, 1000 + 10 * q_len as u64 + j as u64, &splits, emulate);
        }
    }
}

#[test]
fn multi_token_decode_at_long_lengths_and_page_boundaries() {
    let config = CacheConfig::k2v2(64);
    let fmt = config.format().unwrap();
    // k2v2: 64-token pages, 4 sinks, a 128-token window: pages are quantized at 196, 260...
    assert_eq!((fmt.quantized_len(195), fmt.quantized_len(196)), (0, 64));
    for (i, (len, q_len)) in
        [(196, 1), (197, 2), (200, 5), (260, 8), (1000, 7), (4097, 16), (1500, 64)].into_iter().enumerate()
    {
        let splits = [None, Some(3), Some(17)];
        rows_case(config, [8, 3, 1][i % 3], len, q_len, &[], 7000 + i as u64, &splits, false);
    }
}

/// The split-K contract with query rows: partials ordered `[seq][row][q_head][split]`,
/// splits cut from the whole length, a split a row's causal limit leaves empty is
/// exactly the empty partial, and every split count merges to the unsplit result.
#[test]
fn row_partials_mask_causally_and_merge_to_the_unsplit_result() {
    let config = small_config(64, 2, 2, 32);
    let fmt = config.format().unwrap();
    let shape = LayerShape { num_kv_heads: 2, num_q_heads: 6 };
    let (len, q_len) = (9usize, 4usize);
    let mut st = Store::new(config, shape, len, None);
    st.append(Backend::Reference, &rows(Data::Keys, len * 2, 64, 3), &rows(Data::Normal, len * 2, 64, 4)).unwrap();
    let q = rows(Data::Normal, q_len * 6, 64, 5);
    let params = |splits: u32| DecodeParams {
        format: fmt,
        num_seqs: 1,
        num_q_heads: 6,
        num_kv_heads: 2,
        num_splits: splits,
        block_table_stride: st.table.len() as u32,
        flags: config.flags(),
        sm_scale: 0.125,
        q_seq_stride: (q_len * 6 * 64) as u32,
        q_token_stride: 6 * 64,
        q_dtype: rotkv_kernels::params::DTYPE_F32,
        num_blocks: u32::MAX,
        max_len: u32::MAX,
        q_len: q_len as u32,
        attn_window: 0,
        batch_rows: 0,
        batch_seqs: 0,
    };
    let one = reference::decode_partials(&params(1), &st.calib, st.pool.bytes(), &[st.seq()], &q);
    assert_eq!(one.len(), q_len * 6);
    for splits in 1..=12u32 {
        let p = params(splits);
        let parts = reference::decode_partials(&p, &st.calib, st.pool.bytes(), &[st.seq()], &q);
        assert_eq!(parts.len(), q_len * 6 * splits as usize);
        for (n, part) in parts.iter().enumerate() {
            let (row, split) = (n / (6 * splits as usize), n as u32 % splits);
            let (b, e) = p.split_range(split, len as u32);
            let limit = p.row_len(len as u32, row as u32);
            assert_eq!(limit as usize, len - q_len + row + 1);
            if b >= e.min(limit) {
                assert_eq!(*part, reference::Partial { m: f64::NEG_INFINITY, l: 0.0, o: vec![0.0; 64] });
            } else {
                assert!(part.m.is_finite() && part.l >= 1.0, "row {row} split {split}");
            }
        }
        assert_splits_merge_to(&parts, &one, splits);
    }
}

/// Bad query-row counts and sizes are refused before anything is written.
#[test]
fn multi_token_decode_checks_its_rows() {
    let config = small_config(64, 2, 2, 32);
    let shape = LayerShape { num_kv_heads: 1, num_q_heads: 3 };
    let mut st = Store::new(config, shape, 80, None);
    st.append(Backend::Cpu, &rows(Data::Keys, 5, 64, 1), &rows(Data::Normal, 5, 64, 2)).unwrap();
    let q = rows(Data::Normal, 70 * 3, 64, 3);
    for backend in backends() {
        let call = |q_len: usize, q_rows: usize, out_rows: usize| {
            let mut out = vec![7.5f32; out_rows * 3 * 64];
            let r = rotkv::paged::decode(
                backend,
                &st.config,
                &st.calib,
                &st.shape,
                st.pool.bytes(),
                &[st.seq()],
                &q[..q_rows * 3 * 64],
                &mut out,
                rotkv::paged::DecodeOptions { q_len, ..Default::default() },
            );
            (r, out.iter().all(|&x| x == 7.5))
        };
        for (q_len, q_rows, out_rows, why) in [
            (0, 0, 0, "q_len 0"),
            (0, 1, 1, "q_len 0"),
            (6, 6, 6, "q_len above the sequence's 5 tokens"),
            (65, 65, 65, "q_len above 64"),
            (3, 2, 3, "q one row short"),
            (3, 3, 4, "out one row long"),
            (1, 3, 1, "q of 3 rows for q_len 1"),
        ] {
            let (r, untouched) = call(q_len, q_rows, out_rows);
            assert!(r.is_err(), "{backend:?}: {why} accepted");
            assert!(untouched, "{backend:?}: {why} wrote to out");
        }
        // The whole sequence as query rows is fine.
        let (r, _) = call(5, 5, 5);
        if backend == Backend::Reference || backend == Backend::Cpu {
            r.unwrap();
        }
    }
    assert_eq!(rotkv::paged::DecodeOptions::default().q_len, 1);
}

// Sliding-window decode (`DecodeOptions::window_left`, FlashInfer's `window_left`): the
// query row at position `q` attends to positions `q - w ..= q` (clipped at 0).

/// Windowed attention of one sequence straight from the stored rows, in f64: row `i`
/// (position `q = len - q_len + i`) over positions `max(0, q - w) ..= q`, one softmax per
/// row and head. Independent of the split/partial machinery and of `DecodeParams`'s
/// helpers: the convention written out once more.
fn windowed_oracle(st: &Store, q: &[f32], q_len: usize, window_left: Option<usize>) -> Vec<f32> {
    let fmt = st.config.format().unwrap();
    let d = st.config.head_dim;
    let (hkv, hq) = (st.shape.num_kv_heads, st.shape.num_q_heads);
    let flags = st.config.flags() | st.calib.flags();
    let seq = st.seq();
    let sm_scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f32; q_len * hq * d];
    for i in 0..q_len {
        let qp = st.len - q_len + i;
        let first = window_left.map_or(0, |w| qp.saturating_sub(w));
        for h in 0..hq {
            let kvh = h / (hq / hkv);
            let (_, kperm, vperm) = st.calib.head(kvh, d);
            let at = (i * hq + h) * d;
            let qr = reference::rotate_query(
                &q[at..at + d],
                st.calib.head_key_scale(kvh, d),
                st.calib.rotation(false, kvh, d, flags),
                kperm,
            );
            let row = |pos: usize, value: bool| reference::read_row(&fmt, hkv, st.pool.bytes(), &seq, kvh, pos, value);
            let logits: Vec<f64> = (first..=qp)
                .map(|pos| sm_scale * qr.iter().zip(row(pos, false)).map(|(a, b)| a * b).sum::<f64>())
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let (mut o, mut l) = (vec![0f64; d], 0f64);
            for (pos, lg) in (first..=qp).zip(&logits) {
                let w = (lg - m).exp();
                l += w;
                o.iter_mut().zip(row(pos, true)).for_each(|(a, v)| *a += w * v);
            }
            o.iter_mut().for_each(|a| *a /= l);
            let o = reference::unrotate(&o, st.calib.rotation(true, kvh, d, flags), vperm);
            out[at..at + d].iter_mut().zip(o).for_each(|(a, b)| *a = b as f32);
        }
    }
    out
}

/// `paged::decode` of the store's sequence with `table` as its block table.
fn decode_window(
    backend: Backend,
    st: &Store,
    table: &[u32],
    q: &[f32],
    q_len: usize,
    splits: Option<u32>,
    window_left: Option<usize>,
) -> rotkv::Result<Vec<f32>> {
    let mut out = vec![0f32; q.len()];
    let seq = reference::SeqRef { block_table: table, side: &st.side, len: st.len, protected: &st.protected };
    rotkv::paged::decode(
        backend,
        &st.config,
        &st.calib,
        &st.shape,
        st.pool.bytes(),
        &[seq],
        q,
        &mut out,
        rotkv::paged::DecodeOptions { num_splits: splits, q_len, window_left, ..Default::default() },
    )?;
    Ok(out)
}

/// Pages of the store's sequence wholly before the first query row's window: the entries
/// decode may not read. Written out from the layout: page `j` holds positions
/// `sinks + 16 j .. sinks + 16 (j + 1)` (the small configs' 16-token pages).
fn pages_outside(st: &Store, q_len: usize, window_left: usize) -> usize {
    let fmt = st.config.format().unwrap();
    let first = (st.len - q_len).saturating_sub(window_left);
    let pages = fmt.pages_for(st.len as u32) as usize;
    (0..pages).take_while(|&j| fmt.sinks as usize + fmt.page_size as usize * (j + 1) <= first).count()
}

/// One windowed decode case: a store of `len` tokens (shuffled table, random
/// calibration, `protected` positions protected before the append), `q_len` query rows.
/// Checks the reference against [`windowed_oracle`], every backend against the reference
/// within the suite's tolerance for each split count, and that the pages outside the
/// window are never read: with their entries set to [`rotkv::paged::FREED_BLOCK`], or
/// their blocks overwritten with garbage (0xff bytes: NaN scales), the output is bit for
/// bit the same.
#[allow(clippy::too_many_arguments)]
fn window_case(
    config: CacheConfig,
    hkv: usize,
    gqa: usize,
    len: usize,
    q_len: usize,
    window_left: usize,
    protected: &[u32],
    seed: u64,
) -> usize {
    let d = config.head_dim;
    let config = CacheConfig { protected: protected.len(), ..config };
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hkv * gqa };
    let mut st = Store::new(config, shape, len, Some(seed));
    st.calib = random_calibration(hkv, d, seed);
    st.protect(protected).unwrap();
    let k = rows(Data::Keys, len * hkv, d, seed);
    let v = rows(Data::Normal, len * hkv, d, seed + 1);
    st.append(Backend::Cpu, &k, &v).unwrap();
    let q = rows(Data::Normal, q_len * hkv * gqa, d, seed + 2);
    let w = Some(window_left);
    let what = format!("d {d} g {} gqa {gqa} len {len} q_len {q_len} window_left {window_left}", config.group_size);

    let want = decode_window(Backend::Reference, &st, &st.table, &q, q_len, Some(1), w).unwrap();
    let oracle = windowed_oracle(&st, &q, q_len, w);
    // Both in f64 (summed in different orders), then rounded to f32 outputs: a few f32
    // roundings (6e-8 relative each) apart at most.
    let e = rel_err(&want, &oracle);
    assert!(e <= 1e-6, "{what}: reference vs the windowed oracle: {e:.2e}");
    // The window changes the result (every case leaves positions out for some row).
    let all = decode_window(Backend::Reference, &st, &st.table, &q, q_len, Some(1), None).unwrap();
    assert!(rel_err(&all, &want) > 1e-6, "{what}: the window changed nothing");

    // The pages wholly outside the window freed in the table, or their blocks (every KV
    // head's head-page) overwritten with 0xff bytes (NaN scales and zeros).
    let outside = pages_outside(&st, q_len, window_left);
    let mut freed = st.table.clone();
    freed[..outside].fill(rotkv::paged::FREED_BLOCK);
    let mut garbage = st.clone();
    let block_bytes = garbage.pool.bytes().len() / (st.table.len() + 3);
    for &b in &st.table[..outside] {
        garbage.pool.bytes_mut()[b as usize * block_bytes..][..block_bytes].fill(0xff);
    }

    for backend in backends() {
        let splits: &[Option<u32>] =
            if emulated(backend) { &[None, Some(3)] } else { &[None, Some(1), Some(2), Some(5), Some(64)] };
        for &s in splits {
            let got = decode_window(backend, &st, &st.table, &q, q_len, s, w).unwrap();
            let e = rel_err(&got, &want);
            let tol = decode_tol(backend, &config, false);
            assert!(e <= tol, "{backend:?} {what} splits {s:?}: rel err {e:.2e}");
            let f = decode_window(backend, &st, &freed, &q, q_len, s, w).unwrap();
            assert!(f == got, "{backend:?} {what} splits {s:?}: freed entries outside the window changed the output");
            let g = decode_window(backend, &garbage, &garbage.table, &q, q_len, s, w).unwrap();
            assert!(g == got, "{backend:?} {what} splits {s:?}: pages outside the window were read");
        }
    }
    outside
}

/// The window's sizes against pages, the recent f16 rows, sinks and protected rows, on
/// both device kernels (`decode_split` at groups of 32, `decode_mma` at 64 and 128): small
/// configs have 3 sinks, a 32-token recent window and 16-token pages, so positions
/// `3 .. 3 + quantized_len` are paged.
#[test]
fn window_decode_matches_reference_and_skips_pages_outside() {
    let split = small_config(64, 2, 2, 32);
    let mma = small_config(64, 2, 2, 64);
    let mma128 = small_config(128, 4, 2, 128);
    for (i, config) in [split, mma].into_iter().enumerate() {
        let seed = 9100 + 100 * i as u64;
        // window_left 0: each row sees its own key only (f16 recent rows).
        assert_eq!(window_case(config, 1, 3, 100, 1, 0, &[], seed), 4);
        // A window smaller than a page, across the recent rows, two rows.
        assert_eq!(window_case(config, 2, 4, 100, 2, 5, &[], seed + 1), 4);
        // A window ending mid-page (first visible position 94, page 5 holds 83 .. 99),
        // three rows, GQA 8 on one KV head.
        assert_eq!(window_case(config, 1, 8, 137, 3, 40, &[], seed + 2), 5);
        // Sinks in the window for row 0 only (positions 0 ..= 62, then 1 ..= 63).
        assert_eq!(window_case(config, 3, 1, 64, 2, 62, &[], seed + 3), 0);
        // A window as long as the sequence for row 0 (all f16 rows: no page yet); the last
        // row leaves out positions 0 and 1, two of the sinks.
        assert_eq!(window_case(config, 2, 2, 20, 4, 17, &[], seed + 4), 0);
        // Protected positions: 20 outside every row's window (first visible positions 67
        // to 73), 100 inside, 70 inside for rows 0 to 3 only; 7 rows.
        assert_eq!(window_case(config, 2, 3, 150, 7, 76, &[20, 70, 100], seed + 5), 4);
    }
    // A long sequence on the d128 tensor-core instantiation: 3 of 17 pages visible.
    assert_eq!(window_case(mma128, 2, 4, 310, 2, 80, &[], 9400), 14);
}

/// A window that covers every position of every row gives bit for bit the output of no
/// window, for each backend and split count (the same splits, the same order).
#[test]
fn window_covering_everything_is_no_window() {
    for (i, config) in [small_config(64, 2, 2, 32), small_config(64, 4, 2, 64)].into_iter().enumerate() {
        let shape = LayerShape { num_kv_heads: 2, num_q_heads: 6 };
        let (len, q_len) = (120usize, 3usize);
        let mut st = Store::new(config, shape, len, Some(9500 + i as u64));
        st.calib = random_calibration(2, 64, 77);
        st.append(Backend::Cpu, &rows(Data::Keys, len * 2, 64, 11), &rows(Data::Normal, len * 2, 64, 12)).unwrap();
        let q = rows(Data::Normal, q_len * 6, 64, 13);
        for backend in backends() {
            let splits: &[Option<u32>] = if emulated(backend) { &[Some(2)] } else { &[None, Some(1), Some(7)] };
            for &s in splits {
                let none = decode_window(backend, &st, &st.table, &q, q_len, s, None).unwrap();
                // The last row (position len - 1) sees position 0 from window_left len - 1 on.
                for w in [len - 1, len, u32::MAX as usize - 1] {
                    let got = decode_window(backend, &st, &st.table, &q, q_len, s, Some(w)).unwrap();
                    assert!(
                        got == none,
                        "{backend:?} splits {s:?} window_left {w}: not the unwindowed output ({:.2e})",
                        rel_err(&got, &none)
                    );
                }
                // One position fewer for the last row is a different result.
                let cut = decode_window(backend, &st, &st.table, &q, q_len, s, Some(len - 2)).unwrap();
                assert!(cut != none, "{backend:?} splits {s:?}: window_left {} left nothing out", len - 2);
            }
        }
    }
}

/// With a window the splits cut the visible positions only: a long context with a small
/// window has no empty split as long as there are visible positions for each, and the
/// partials of every split count merge to the unsplit result (empty ones included).
#[test]
fn window_splits_cover_the_visible_positions_only() {
    let config = small_config(64, 2, 2, 32);
    let fmt = config.format().unwrap();
    let params = |splits: u32, q_len: u32, attn_window: u32| DecodeParams {
        format: fmt,
        num_seqs: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        num_splits: splits,
        block_table_stride: 0,
        flags: config.flags(),
        sm_scale: 0.125,
        q_seq_stride: q_len * 2 * 64,
        q_token_stride: 2 * 64,
        q_dtype: rotkv_kernels::params::DTYPE_F32,
        num_blocks: u32::MAX,
        max_len: u32::MAX,
        q_len,
        attn_window,
        batch_rows: 0,
        batch_seqs: 0,
    };
    // A million tokens, 4 rows, a 4096-key window: 4099 visible positions in 16 splits.
    let (len, q_len, window) = (1_000_000u32, 4u32, 4096u32);
    let p = params(16, q_len, window);
    let first = len - q_len + 1 - window;
    assert_eq!((p.visible_start(len), p.row_start(len, 3), p.row_len(len, 3)), (first, len - window, len));
    let mut next = first;
    for split in 0..16 {
        let (b, e) = p.split_range(split, len);
        assert!(b == next && e > b, "split {split}: [{b}, {e})");
        next = e;
    }
    assert_eq!(next, len);
    // No window: unchanged (from 0, ceil(len / n) each).
    assert_eq!(params(16, q_len, 0).split_range(1, len), (62_500, 125_000));
    // A window longer than the sequence: from 0.
    assert_eq!(params(3, 1, 50).split_range(0, 20), (0, 7));

    // Merging: every split count of a windowed decode gives the unsplit result.
    let shape = LayerShape { num_kv_heads: 1, num_q_heads: 2 };
    let (len, q_len) = (90usize, 3u32);
    let mut st = Store::new(config, shape, len, None);
    st.append(Backend::Reference, &rows(Data::Keys, len, 64, 21), &rows(Data::Normal, len, 64, 22)).unwrap();
    let q = rows(Data::Normal, q_len as usize * 2, 64, 23);
    let one = reference::decode_partials(&params(1, q_len, 10), &st.calib, st.pool.bytes(), &[st.seq()], &q);
    for splits in 1..=14u32 {
        let p = params(splits, q_len, 10);
        let parts = reference::decode_partials(&p, &st.calib, st.pool.bytes(), &[st.seq()], &q);
        for (n, part) in parts.iter().enumerate() {
            let (row, split) = (n as u32 / (2 * splits), n as u32 % splits);
            let (b, e) = p.split_range(split, len as u32);
            let (lo, hi) = (b.max(p.row_start(len as u32, row)), e.min(p.row_len(len as u32, row)));
            if lo >= hi {
                assert_eq!(*part, reference::Partial { m: f64::NEG_INFINITY, l: 0.0, o: vec![0.0; 64] });
            } else {
                assert!(part.m.is_finite() && part.l >= 1.0, "splits {splits} row {row} split {split}");
            }
        }
        assert_splits_merge_to(&parts, &one, splits);
    }
}

/// Each row's `splits` partials (`parts`, row-major) merge to the row's unsplit partial
/// (`one`) within 1e-12 relative.
fn assert_splits_merge_to(parts: &[reference::Partial], one: &[reference::Partial], splits: u32) {
    for (r, chunk) in parts.chunks_exact(splits as usize).enumerate() {
        let (merged, whole) = (reference::merge(chunk), reference::merge(&one[r..r + 1]));
        for (a, b) in merged.iter().zip(&whole) {
            assert!(a.is_finite() && (a - b).abs() <= 1e-12 * b.abs().max(1.0), "splits {splits} row {r}");
        }
    }
}

/// Bad windows and bad entries are refused before anything is written: a window whose key
/// count does not fit u32, a freed or out-of-pool entry of a page the window reads, a
/// freed entry without a window, and for append a freed entry of the page it fills (the
/// pages full before it may be freed: the same bytes as with their blocks kept).
#[test]
fn window_checks_its_inputs_and_changes_nothing_on_error() {
    let config = small_config(64, 2, 2, 32);
    let shape = LayerShape { num_kv_heads: 1, num_q_heads: 2 };
    let len = 150;
    // Room for 200 tokens: the table has entries past the 7 pages of 150 tokens.
    let mut st = Store::new(config, shape, 200, None);
    st.append(Backend::Cpu, &rows(Data::Keys, len, 64, 31), &rows(Data::Normal, len, 64, 32)).unwrap();
    let q = rows(Data::Normal, 2, 64, 33);
    // 7 pages (positions 3 .. 115); window_left 60 from position 149 starts at 89: pages
    // 0 .. 5 are wholly outside, page 5 (83 .. 99) is read.
    assert_eq!(pages_outside(&st, 1, 60), 5);
    for backend in backends() {
        let call = |table: &[u32], w: Option<usize>| {
            let mut out = vec![7.5f32; 2 * 64];
            let seq = reference::SeqRef { block_table: table, side: &st.side, len, protected: &[] };
            let r = rotkv::paged::decode(
                backend,
                &st.config,
                &st.calib,
                &st.shape,
                st.pool.bytes(),
                &[seq],
                &q,
                &mut out,
                rotkv::paged::DecodeOptions { window_left: w, ..Default::default() },
            );
            (r, out.iter().all(|&x| x == 7.5))
        };
        for w in [u32::MAX as usize, usize::MAX] {
            let (r, untouched) = call(&st.table, Some(w));
            assert!(matches!(r, Err(rotkv::Error::Value(_))) && untouched, "{backend:?}: window_left {w}: {r:?}");
        }
        let with = |j: usize, entry: u32| {
            let mut t = st.table.clone();
            t[j] = entry;
            t
        };
        let freed = rotkv::paged::FREED_BLOCK;
        for (table, w, why) in [
            (with(5, freed), Some(60), "a freed page inside the window"),
            (with(6, freed), Some(60), "a freed last page"),
            (with(0, freed), None, "a freed page without a window"),
            (with(0, 1000), Some(60), "an out-of-pool entry outside the window"),
        ] {
            let (r, untouched) = call(&table, w);
            assert!(matches!(r, Err(rotkv::Error::BlockTable { .. })) && untouched, "{backend:?}: {why}: {r:?}");
        }
        // Outside the window freed entries are fine; a block that is not FREED_BLOCK is
        // checked there too (a block handed to another page must leave the old entry).
        let mut t = st.table.clone();
        t[..5].fill(freed);
        call(&t, Some(60)).0.unwrap();
        t[4] = t[6];
        let (r, untouched) = call(&t, Some(60));
        assert!(matches!(r, Err(rotkv::Error::AliasedBlock { .. })) && untouched, "{backend:?}: {r:?}");
        // Append: the pages full before the call may be freed; the page it fills (16 more
        // tokens fill page 7) may not, and the refused call writes nothing.
        let (k, v) = (rows(Data::Keys, 16, 64, 34), rows(Data::Normal, 16, 64, 35));
        let mut t = st.table.clone();
        t[7] = freed;
        let mut refused = st.clone();
        refused.table = t;
        let r = refused.append(backend, &k, &v);
        assert!(matches!(r, Err(rotkv::Error::BlockTable { index: 7, .. })), "{backend:?}: {r:?}");
        assert!(refused.pool == st.pool && refused.side == st.side && refused.len == len, "{backend:?}");
        let mut freed_full = st.clone();
        freed_full.table[..7].fill(freed);
        freed_full.append(backend, &k, &v).unwrap();
        let mut kept = st.clone();
        kept.append(backend, &k, &v).unwrap();
        assert!(freed_full.pool == kept.pool && freed_full.side == kept.side, "{backend:?}: freed full pages");
    }
    // The cache's per-layer setting: checked, unchanged on error.
    let cshape =
        rotkv::CacheShape { layers: 2, num_kv_heads: 1, num_q_heads: 2, max_seqs: 1, max_tokens: 64, num_blocks: None };
    let mut cache = rotkv::KvCache::new(config, cshape, Backend::Cpu).unwrap();
    cache.set_window_left(1, Some(7)).unwrap();
    assert!(matches!(cache.set_window_left(1, Some(u32::MAX as usize)), Err(rotkv::Error::Value(_))));
    assert!(cache.set_window_left(2, None).is_err());
    assert_eq!((cache.window_left(0).unwrap(), cache.window_left(1).unwrap()), (None, Some(7)));
}

/// `KvCache::set_window_left` makes a layer's decodes windowed, on every backend, as the
/// paged API with the same window does; other layers are unchanged.
#[test]
fn cache_layers_decode_with_their_window() {
    let config = small_config(64, 2, 2, 64);
    let cshape = rotkv::CacheShape {
        layers: 2,
        num_kv_heads: 2,
        num_q_heads: 4,
        max_seqs: 2,
        max_tokens: 200,
        num_blocks: None,
    };
    let len = 130;
    let (k, v) = (rows(Data::Keys, len * 2, 64, 41), rows(Data::Normal, len * 2, 64, 42));
    let q = rows(Data::Normal, 2 * 4, 64, 43);
    let mut want = None;
    for backend in backends() {
        let mut cache = rotkv::KvCache::new(config, cshape, backend).unwrap();
        let seq = cache.add_sequence().unwrap();
        for layer in 0..2 {
            cache.append(layer, seq, len, &k, &v).unwrap();
        }
        cache.set_window_left(1, Some(45)).unwrap();
        let mut outs = [vec![0f32; 2 * 4 * 64], vec![0f32; 2 * 4 * 64]];
        for (layer, out) in outs.iter_mut().enumerate() {
            cache.decode_tokens(layer, &[seq], 2, &q, out).unwrap();
        }
        let [full, windowed] = outs;
        let (want_full, want_windowed) = want.get_or_insert_with(|| (full.clone(), windowed.clone()));
        let tol = decode_tol(backend, &config, false);
        let (e_full, e_win) = (rel_err(&full, want_full), rel_err(&windowed, want_windowed));
        assert!(e_full <= tol && e_win <= tol, "{backend:?}: {e_full:.2e} {e_win:.2e}");
        assert!(rel_err(&windowed, &full) > 1e-3, "{backend:?}: the window changed nothing");
    }
}

/// A serving loop over a sliding window with a pool too small for the whole sequence:
/// after each append, the pages wholly before the next decode's window go back to a free
/// list (their entries set to `FREED_BLOCK`), appends take blocks from it. Every decode
/// is within the tolerance of the reference's decode of the same bytes, and those equal
/// the reference's decode of a cache that kept every page, appended at once by the same
/// backend (appends' bytes do not depend on their chunking).
#[test]
fn freed_pages_outside_the_window_are_reused() {
    let config = small_config(64, 2, 2, 64);
    let fmt = config.format().unwrap();
    let shape = LayerShape { num_kv_heads: 2, num_q_heads: 4 };
    let (total, window_left) = (260usize, 40usize);
    let calib = random_calibration(2, 64, 53);
    let k = rows(Data::Keys, total * 2, 64, 51);
    let v = rows(Data::Normal, total * 2, 64, 52);
    for backend in backends() {
        // 6 blocks for a sequence that needs 14 pages.
        let pool_blocks = 6usize;
        let mut pool = rotkv::paged::PoolBuffer::new(rotkv::paged::pool_bytes(&config, &shape, pool_blocks).unwrap());
        let mut side = vec![f16::ZERO; rotkv::paged::side_elems(&config, &shape).unwrap()];
        let mut free: Vec<u32> = (0..pool_blocks as u32).rev().collect();
        let mut table: Vec<u32> = Vec::new();
        let mut len = 0usize;
        let step = if emulated(backend) { 37 } else { 13 };
        let mut checked = 0;
        while len < total {
            let n = step.min(total - len);
            let need = fmt.pages_for((len + n) as u32) as usize;
            while table.len() < need {
                table.push(free.pop().expect("the window's pages fit the pool"));
            }
            let (kk, vv) = (&k[len * 128..(len + n) * 128], &v[len * 128..(len + n) * 128]);
            len = rotkv::paged::append(
                backend,
                &config,
                &calib,
                &shape,
                pool.bytes_mut(),
                &table,
                &mut side,
                &[],
                len,
                n,
                kk,
                vv,
            )
            .unwrap();
            // The decode of the last token sees `len - 1 - window_left ..`: free what lies
            // wholly before it.
            let first = (len - 1).saturating_sub(window_left);
            for (j, entry) in table.iter_mut().enumerate() {
                let whole_before = fmt.sinks as usize + fmt.page_size as usize * (j + 1) <= first;
                if whole_before && *entry != rotkv::paged::FREED_BLOCK {
                    free.push(std::mem::replace(entry, rotkv::paged::FREED_BLOCK));
                }
            }
            let q = rows(Data::Normal, 4, 64, 60 + len as u64);
            let mut got = vec![0f32; 4 * 64];
            let seq = reference::SeqRef { block_table: &table, side: &side, len, protected: &[] };
            let options = rotkv::paged::DecodeOptions { window_left: Some(window_left), ..Default::default() };
            rotkv::paged::decode(backend, &config, &calib, &shape, pool.bytes(), &[seq], &q, &mut got, options)
                .unwrap();
            let mut want = vec![0f32; 4 * 64];
            let options = rotkv::paged::DecodeOptions { num_splits: Some(1), ..options };
            rotkv::paged::decode(
                Backend::Reference,
                &config,
                &calib,
                &shape,
                pool.bytes(),
                &[seq],
                &q,
                &mut want,
                options,
            )
            .unwrap();
            let mut kept = Store::new(config, shape, len, None);
            kept.calib = calib.clone();
            kept.append(backend, &k[..len * 128], &v[..len * 128]).unwrap();
            let whole =
                decode_window(Backend::Reference, &kept, &kept.table, &q, 1, Some(1), Some(window_left)).unwrap();
            assert!(whole == want, "{backend:?} len {len}: the reused blocks do not hold the kept cache's bytes");
            let e = rel_err(&got, &want);
            assert!(e <= decode_tol(backend, &config, false), "{backend:?} len {len}: {e:.2e}");
            checked += 1;
        }
        assert!(checked >= 7 && table.iter().filter(|&&b| b == rotkv::paged::FREED_BLOCK).count() >= 8);
    }
}

/// Protected positions in the middle of a long split: the chunks that hold one go
/// through the masked loop and the runs between them through the steady state (the
/// emulator runs the device kernels: the `cp.async` rings at head_dim 128 and 256, the
/// register pipeline at 64). Two positions in one chunk, neighbouring chunks, the first
/// and the last chunk of the steady range, one position in the split's masked head; one
/// and two splits, one and three query rows. Every case against the f64 reference.
#[test]
fn protected_positions_inside_a_long_split_match_the_reference() {
    let k2v2 = |d| CacheConfig { protected: 8, ..CacheConfig::k2v2(d) };
    // 4 sinks, a 128-token window, 64-token pages: 700 tokens leave positions 4..516
    // quantized (chunks of 32 tokens at head_dim 128 with 2-bit values, 64 at 64, 16 at
    // 256 and with 4-bit values or two groups at 128).
    let protect = [10u32, 100, 101, 130, 165, 300, 350, 511];
    let configs = [
        k2v2(128),
        k2v2(64),
        CacheConfig { protected: 8, ..CacheConfig::k4v2(128) },
        k2v2(256),
        // A two-stage ring (k4v4), and one-tile chunks of a three-stage ring (4-bit
        // values in groups of 64).
        CacheConfig { protected: 8, ..CacheConfig::k4v4(128) },
        CacheConfig { protected: 8, value_bits: 4, group_size: 64, ..CacheConfig::k2v2(128) },
    ];
    for (i, config) in configs.into_iter().enumerate() {
        let q_len = if i % 2 == 0 { 1 } else { 3 };
        rows_case(config, [4, 2, 8, 1, 4, 2][i], 700, q_len, &protect, 9100 + i as u64, &[Some(1), Some(2)], true);
    }
    // No window, eight query tokens of GQA 2 (one row tile): the rows' causal limits fall
    // in the quantized range, the last tiles go through the masked tail, with protected
    // positions there too (523, 526) and in the pipelined range.
    let config = CacheConfig { protected: 8, window: 0, ..CacheConfig::k2v2(128) };
    rows_case(config, 2, 530, 8, &[20, 200, 390, 523, 526], 9200, &[Some(1), Some(3)], true);
}
