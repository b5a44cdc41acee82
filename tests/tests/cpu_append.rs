//! The CPU backend's fused append reads the caller's elements as they are (f32, f16,
//! bf16: no f32 copy of the input). The same values given as f16 or bf16 must write the
//! same bytes as given in f32, for appends of awkward sizes (one token, one past a page,
//! a page of sinks and window at once), with sinks, a window, protected positions,
//! clipping, 4-bit codes, no rotation, learned rotations and variance normalization;
//! the f32 bytes themselves are checked against the reference by `conformance.rs`.
//! Invalid input is refused the same way whatever the element type, changing nothing.

use rotkv::{Backend, CacheConfig, CacheShape, KvCache, LayerCalibration, Rotation, bf16, f16};
use rotkv_tests::Rng;

/// Random rows `[tokens][heads][d]` exactly representable in f16 and bf16 (multiples
/// of 1/16 below 16 in magnitude, 8 significant bits), with an outlier channel.
fn rows(rng: &mut Rng, tokens: usize, heads: usize, d: usize) -> Vec<f32> {
    (0..tokens * heads * d)
        .map(|i| {
            let x = (rng.uniform() * 2.0 - 1.0) * 15.0;
            let x = (x * 16.0).round() / 16.0;
            if i % d == 5 { x * 8.0 } else { x }
        })
        .collect()
}

fn caches(config: CacheConfig, hkv: usize, calib: Option<&LayerCalibration>) -> [KvCache; 3] {
    let shape = CacheShape {
        layers: 1,
        num_kv_heads: hkv,
        num_q_heads: 2 * hkv,
        max_seqs: 2,
        max_tokens: 700,
        num_blocks: None,
    };
    std::array::from_fn(|_| {
        let mut c = KvCache::new(config, shape, Backend::Cpu).unwrap();
        if let Some(calib) = calib {
            c.set_calibration(0, calib.clone()).unwrap();
        }
        c
    })
}

#[test]
fn f16_and_bf16_input_write_the_bytes_of_f32_input() {
    let mut rng = Rng::new(31);
    let d64 = CacheConfig { sinks: 3, window: 40, protected: 4, ..CacheConfig::k2v2(64) };
    let d128 = CacheConfig { key_clip: 0.8, page_size: 32, ..CacheConfig::k4v2(128) };
    let d256 = CacheConfig { group_size: 32, window: 16, key_rotation: Rotation::None, ..CacheConfig::k4v4(256) };
    let norm = CacheConfig { channel_norm: 2, ..CacheConfig::k2v2(64) };
    let learned = {
        let mut c = LayerCalibration::identity(2, 64);
        // An orthogonal matrix that is not the Hadamard one: a signed permutation.
        let r: Vec<f32> = (0..2 * 64 * 64)
            .map(|i| {
                let (row, col) = ((i / 64) % 64, i % 64);
                if col == (row * 5 + 3) % 64 { if row % 3 == 0 { -1.0 } else { 1.0 } } else { 0.0 }
            })
            .collect();
        c.key_rotation = Some(r.clone());
        c.value_rotation = Some(r);
        c.key_perm = (0..2).flat_map(|_| (0..64u16).rev()).collect();
        c
    };
    let cases: [(CacheConfig, usize, Option<&LayerCalibration>); 5] =
        [(d64, 3, None), (d128, 2, None), (d256, 1, None), (norm, 2, None), (CacheConfig::k2v2(64), 2, Some(&learned))];
    for (config, hkv, calib) in cases {
        let d = config.head_dim;
        let [mut a, mut b, mut c] = caches(config, hkv, calib);
        let (sa, sb, sc) = (a.add_sequence().unwrap(), b.add_sequence().unwrap(), c.add_sequence().unwrap());
        if config.protected > 0 {
            for (cache, s) in [(&mut a, sa), (&mut b, sb), (&mut c, sc)] {
                cache.protect(0, s, &[5, 70, 71, 300]).unwrap();
            }
        }
        // Lengths that cross pages, sinks and the window in every way.
        for n in [1, 2, config.page_size - 1, config.page_size + 1, 1, 3 * config.page_size, 77, 130] {
            let k = rows(&mut rng, n, hkv, d);
            let v = rows(&mut rng, n, hkv, d);
            let (k16, v16): (Vec<f16>, Vec<f16>) =
                (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
            let (kb, vb): (Vec<bf16>, Vec<bf16>) =
                (k.iter().map(|&x| bf16::from_f32(x)).collect(), v.iter().map(|&x| bf16::from_f32(x)).collect());
            assert!(
                k16.iter().zip(&k).all(|(h, &x)| h.to_f32() == x) && kb.iter().zip(&k).all(|(h, &x)| h.to_f32() == x)
            );
            a.append(0, sa, n, &k, &v).unwrap();
            b.append(0, sb, n, &k16, &v16).unwrap();
            c.append(0, sc, n, &kb, &vb).unwrap();
            let (pa, ra) = a.layer_bytes(0).unwrap();
            let (pb, rb) = b.layer_bytes(0).unwrap();
            let (pc, rc) = c.layer_bytes(0).unwrap();
            let len = a.len(0, sa).unwrap();
            assert!(pa == pb && ra == rb, "f16 input: d{d} after {len} tokens");
            assert!(pa == pc && ra == rc, "bf16 input: d{d} after {len} tokens");
        }
        assert!(a.len(0, sa).unwrap() > 3 * config.page_size, "pages were quantized");
    }
}

#[test]
fn invalid_input_is_refused_alike_for_every_element_type() {
    let config = CacheConfig::k2v2(64);
    let [mut a, mut b, _] = caches(config, 2, None);
    let (sa, sb) = (a.add_sequence().unwrap(), b.add_sequence().unwrap());
    let mut rng = Rng::new(5);
    let n = 150;
    let k = rows(&mut rng, n, 2, 64);
    let v = rows(&mut rng, n, 2, 64);
    a.append(0, sa, n, &k, &v).unwrap();
    let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
    let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
    b.append(0, sb, n, &k16, &v16).unwrap();
    let before = a.layer_bytes(0).unwrap().0.to_vec();
    // A non-finite value in the last row of the values, then a key row past the f16
    // range (norm 8 * 65504 > 65504), each among valid rows.
    let mut bad_v = v16.clone();
    *bad_v.last_mut().unwrap() = f16::INFINITY;
    let mut bad_k = k.clone();
    bad_k[64 * 7..64 * 8].fill(65504.0);
    let bad_k16: Vec<f16> = bad_k.iter().map(|&x| f16::from_f32(x)).collect();
    let e1 = b.append(0, sb, n, &k16, &bad_v).unwrap_err().to_string();
    assert!(e1.contains("v[token 149][head 1][63]"), "{e1}");
    let e2 = a.append(0, sa, n, &bad_k, &v).unwrap_err().to_string();
    let e3 = b.append(0, sb, n, &bad_k16, &v16).unwrap_err().to_string();
    assert_eq!(e2, e3);
    assert!(e2.contains("k[token 3][head 1] has norm"), "{e2}");
    assert_eq!(a.layer_bytes(0).unwrap().0, &before[..]);
    assert_eq!(b.layer_bytes(0).unwrap().0, &before[..]);
    assert_eq!((a.len(0, sa).unwrap(), b.len(0, sb).unwrap()), (n, n));
}

/// The fused append checks each row as it reads it and restores the pool blocks it wrote
/// when one fails: whichever row is bad (in the first, a middle or the last page that
/// fills, among the sinks, in the window), the cpu backend gives the reference backend's
/// error and leaves every byte of the pool and the side store as it was; a valid append
/// afterwards writes what it would have written without the failed one.
#[test]
fn a_bad_row_anywhere_restores_every_byte_and_names_the_first_bad_row() {
    let d = 64;
    let hkv = 3;
    let config = CacheConfig { sinks: 4, window: 40, page_size: 16, ..CacheConfig::k2v2(d) };
    let shape =
        CacheShape { layers: 1, num_kv_heads: hkv, num_q_heads: hkv, max_seqs: 2, max_tokens: 400, num_blocks: None };
    // Centered and scaled keys: a key row can fail only as stored, `(k - mean) / scale`.
    let mut calib = LayerCalibration::identity(hkv, d);
    calib.key_mean = (0..hkv * d).map(|i| (i % 7) as f32 - 3.0).collect();
    calib.key_scale = (0..hkv * d).map(|i| if i % d == 9 { 1e-3 } else { 1.0 }).collect();
    let mut rng = Rng::new(77);
    for (start, n) in [(0usize, 1usize), (0, 200), (30, 150), (45, 3)] {
        let k = rows(&mut rng, n, hkv, d);
        let v = rows(&mut rng, n, hkv, d);
        let warm_k = rows(&mut rng, start.max(1), hkv, d);
        let warm_v = rows(&mut rng, start.max(1), hkv, d);
        // (token, head, is value, element, value): a value too large or not finite.
        let bads = [
            (0, 0, false, 3, f32::NAN),
            (n / 2, 1, true, 0, f32::INFINITY),
            (n - 1, 2, false, 9, 70.0), // 70 / 1e-3 as stored: far past the f16 range
            (n / 3, 2, true, 63, f32::NEG_INFINITY),
            (n - 1, 0, true, 1, 65504.0),
        ];
        for (t, h, value, c, x) in bads {
            let fresh = |backend| {
                let mut cache = KvCache::new(config, shape, backend).unwrap();
                cache.set_calibration(0, calib.clone()).unwrap();
                let s = cache.add_sequence().unwrap();
                if start > 0 {
                    cache.append(0, s, start, &warm_k[..start * hkv * d], &warm_v[..start * hkv * d]).unwrap();
                }
                (cache, s)
            };
            let (mut cpu, s) = fresh(Backend::Cpu);
            let (mut reference, r) = fresh(Backend::Reference);
            let (mut bk, mut bv) = (k.clone(), v.clone());
            let at = (t * hkv + h) * d + c;
            if value {
                bv[at] = x
            } else {
                bk[at] = x
            };
            // A second bad row after the first: the error names the first.
            if t + 1 < n {
                bk[((t + 1) * hkv) * d] = f32::NAN;
            }
            let (pool, side) = {
                let (p, s) = cpu.layer_bytes(0).unwrap();
                (p.to_vec(), s.to_vec())
            };
            let e_cpu = cpu.append(0, s, n, &bk, &bv).unwrap_err().to_string();
            let e_ref = reference.append(0, r, n, &bk, &bv).unwrap_err().to_string();
            assert_eq!(e_cpu, e_ref, "start {start}, {n} tokens, bad row ({t}, {h}, value {value})");
            let (p, sd) = cpu.layer_bytes(0).unwrap();
            assert!(p == &pool[..] && sd == &side[..], "bytes changed: start {start}, {n} tokens, row ({t}, {h})");
            assert_eq!(cpu.len(0, s).unwrap(), start);
            // The same input made valid: the bytes of a cache that never saw the failure.
            cpu.append(0, s, n, &k, &v).unwrap();
            let (mut clean, c2) = fresh(Backend::Cpu);
            clean.append(0, c2, n, &k, &v).unwrap();
            assert!(cpu.layer_bytes(0).unwrap() == clean.layer_bytes(0).unwrap());
        }
    }
}

/// Appends made from inside rayon tasks, as a stack working on several caches (or layers)
/// in parallel makes them: each append runs its own parallel pass and keeps its saved
/// pool blocks per calling thread (taken out of the thread-local for the call, so that a
/// worker picking up another append while it waits cannot trip over the first one's; that
/// interleaving is up to rayon's scheduler and was not seen in this test's runs). The
/// bytes equal those of one-by-one appends.
#[test]
fn appends_from_inside_rayon_tasks_write_what_sequential_appends_write() {
    use rayon::prelude::*;
    let (d, hkv) = (64, 2);
    let config = CacheConfig { page_size: 16, window: 16, ..CacheConfig::k2v2(d) };
    let shape =
        CacheShape { layers: 1, num_kv_heads: hkv, num_q_heads: hkv, max_seqs: 1, max_tokens: 600, num_blocks: None };
    let mut rng = Rng::new(404);
    let inputs: Vec<(Vec<f32>, Vec<f32>)> =
        (0..12).map(|_| (rows(&mut rng, 300, hkv, d), rows(&mut rng, 300, hkv, d))).collect();
    let run = |parallel: bool| -> Vec<Vec<u8>> {
        let mut caches: Vec<KvCache> =
            (0..inputs.len()).map(|_| KvCache::new(config, shape, Backend::Cpu).unwrap()).collect();
        let one = |(cache, (k, v)): (&mut KvCache, &(Vec<f32>, Vec<f32>))| {
            let s = cache.add_sequence().unwrap();
            // Three appends, the middle one refused (a NaN key): every call saves blocks.
            cache.append(0, s, 150, &k[..150 * hkv * d], &v[..150 * hkv * d]).unwrap();
            let mut bad = k[150 * hkv * d..].to_vec();
            bad[100 * hkv * d + 7] = f32::NAN;
            assert!(cache.append(0, s, 150, &bad, &v[150 * hkv * d..]).is_err());
            cache.append(0, s, 150, &k[150 * hkv * d..], &v[150 * hkv * d..]).unwrap();
        };
        if parallel {
            caches.par_iter_mut().zip(inputs.par_iter()).for_each(one);
        } else {
            caches.iter_mut().zip(inputs.iter()).for_each(one);
        }
        caches.iter().map(|c| c.layer_bytes(0).unwrap().0.to_vec()).collect()
    };
    assert_eq!(run(true), run(false));
}

/// The fused check on the paths the first test leaves out: pages quantized with variance
/// normalization (`channel_norm`), protected positions (their extra f16 copies), f16
/// input, learned rotations; and two bad inputs at once (a NaN key and values of the
/// wrong length), where the error must be the one the reference backend gives first.
#[test]
fn the_fused_check_covers_normalized_pages_protected_rows_and_mixed_errors() {
    let (d, hkv) = (64, 2);
    let shape =
        CacheShape { layers: 1, num_kv_heads: hkv, num_q_heads: hkv, max_seqs: 1, max_tokens: 300, num_blocks: None };
    let mut learned = LayerCalibration::identity(hkv, d);
    let r: Vec<f32> = (0..hkv * d * d).map(|i| if (i / d) % d == (i % d + 7) % d { -1.0 } else { 0.0 }).collect();
    (learned.key_rotation, learned.value_rotation) = (Some(r.clone()), Some(r));
    // Dense random rotations too (every output a sum of d products), keys and values
    // different: the page-at-a-time rotation's check must still come first.
    let mut dense = LayerCalibration::identity(hkv, d);
    let rot = |seed| (0..hkv as u64).flat_map(|h| rotkv_tests::random_rotation(d, seed + h)).collect::<Vec<f32>>();
    (dense.key_rotation, dense.value_rotation) = (Some(rot(5)), Some(rot(50)));
    let norm = CacheConfig { channel_norm: 2, page_size: 16, window: 16, ..CacheConfig::k2v2(d) };
    let prot = CacheConfig { protected: 4, page_size: 16, window: 16, ..CacheConfig::k2v2(d) };
    let mut rng = Rng::new(9);
    for (config, calib) in
        [(norm, None), (prot, None), (prot, Some(&learned)), (prot, Some(&dense)), (norm, Some(&dense))]
    {
        let n = 100;
        let k = rows(&mut rng, n, hkv, d);
        let v = rows(&mut rng, n, hkv, d);
        // Token 40 is protected (a page row with an f16 copy), token 95 stays in the window.
        for (t, value) in [(40, false), (95, true), (20, true)] {
            let fresh = |backend| {
                let mut cache = KvCache::new(config, shape, backend).unwrap();
                if let Some(c) = calib {
                    cache.set_calibration(0, c.clone()).unwrap();
                }
                let s = cache.add_sequence().unwrap();
                if config.protected > 0 {
                    cache.protect(0, s, &[40, 95]).unwrap();
                }
                (cache, s)
            };
            let (mut cpu, s) = fresh(Backend::Cpu);
            let (mut reference, r) = fresh(Backend::Reference);
            let (mut bk, mut bv) = (k.clone(), v.clone());
            let at = (t * hkv + 1) * d + 2;
            if value {
                bv[at] = f32::INFINITY
            } else {
                bk[at] = 1e9
            };
            let (bk16, bv16): (Vec<f16>, Vec<f16>) =
                (bk.iter().map(|&x| f16::from_f32(x)).collect(), bv.iter().map(|&x| f16::from_f32(x)).collect());
            let before = cpu.layer_bytes(0).unwrap().0.to_vec();
            let e_ref = reference.append(0, r, n, &bk, &bv).unwrap_err().to_string();
            assert_eq!(cpu.append(0, s, n, &bk, &bv).unwrap_err().to_string(), e_ref, "{config:?}");
            let e16 = cpu.append(0, s, n, &bk16, &bv16).unwrap_err().to_string();
            let e16_ref = reference.append(0, r, n, &bk16, &bv16).unwrap_err().to_string();
            assert_eq!(e16, e16_ref);
            assert_eq!(cpu.layer_bytes(0).unwrap().0, &before[..]);
            // A NaN key and values one row short: the key's value error comes first.
            let mut nan_k = k.clone();
            nan_k[3] = f32::NAN;
            let short = &v[..v.len() - d];
            let e_ref = reference.append(0, r, n, &nan_k, short).unwrap_err().to_string();
            assert_eq!(cpu.append(0, s, n, &nan_k, short).unwrap_err().to_string(), e_ref);
            assert!(e_ref.contains("k[token 0][head 0][3] is NaN"), "{e_ref}");
            assert_eq!(cpu.layer_bytes(0).unwrap().0, &before[..]);
            cpu.append(0, s, n, &k, &v).unwrap();
            reference.append(0, r, n, &k, &v).unwrap();
        }
    }
}
