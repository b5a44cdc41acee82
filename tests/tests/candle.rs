//! `rotkv::candle` (feature `candle` of this crate): candle CPU tensors through a
//! `KvCache` give bit for bit what the same slices give through the cache directly, for
//! every dtype and layout (contiguous, row-strided, transposed views); every bad input is
//! an `Error` and changes nothing. The `candle_attention` example runs here too.
#![cfg(feature = "candle")]

use candle_core::{DType, Device, Tensor, WithDType};
use rotkv::{Backend, CacheConfig, CacheShape, Error, KvCache, KvElement, SeqId, bf16, f16};
use rotkv_tests::{Data, rows};

#[path = "../../host/examples/candle_attention.rs"]
mod candle_attention;

const HKV: usize = 2;
const HQ: usize = 6;
const D: usize = 64;

fn cache(config: CacheConfig) -> KvCache {
    let shape =
        CacheShape { layers: 2, num_kv_heads: HKV, num_q_heads: HQ, max_seqs: 3, max_tokens: 400, num_blocks: None };
    KvCache::new(config, shape, Backend::Cpu).unwrap()
}

fn tensor(v: &[f32], shape: (usize, usize, usize)) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap()
}

/// Elements as bits (through f64, exact and one-to-one for f32, f16 and bf16).
fn bits<T: WithDType>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// A tensor's elements as bits; it must have `T`'s dtype.
fn tensor_bits<T: WithDType>(t: &Tensor) -> Vec<u64> {
    assert_eq!(t.dtype(), T::DTYPE);
    bits(&t.flatten_all().unwrap().to_vec1::<T>().unwrap())
}

/// A tensor of `T` from f32 data, and the same elements as a `Vec<T>`.
fn both<T: WithDType>(v: &[f32], shape: (usize, usize, usize)) -> (Tensor, Vec<T>) {
    let t = tensor(v, shape).to_dtype(T::DTYPE).unwrap();
    let elems = t.flatten_all().unwrap().to_vec1::<T>().unwrap();
    (t, elems)
}

/// Direct decode with `T` slices; the output rounded to `T` as `rotkv::candle` returns it.
fn direct_decode<T: WithDType + KvElement>(
    c: &KvCache,
    layer: usize,
    seqs: &[SeqId],
    q_len: usize,
    q: &[T],
) -> Vec<u64> {
    let mut out = vec![0f32; q.len()];
    c.decode_tokens(layer, seqs, q_len, q, &mut out).unwrap();
    // Rounded from f32 by candle's own conversion (correctly rounded, as rotkv::candle's
    // `f16::from_f32` / `bf16::from_f32`), not through f64: half 2.x's `bf16::from_f64`
    // rounds some values below a tie down (seen: 2.851564 = 0x40368006 gives 0x4036,
    // `from_f32` 0x4037; 2,639 of 50 million random f32s differ).
    let n = out.len();
    tensor_bits::<T>(&Tensor::from_vec(out, n, &Device::Cpu).unwrap().to_dtype(<T as WithDType>::DTYPE).unwrap())
}

/// The same appends and decodes through tensors of `T` and through the cache directly
/// with the same `T` slices: identical bytes out.
fn round_trip<T: WithDType + KvElement>() {
    for config in [CacheConfig::k2v2(D), CacheConfig::k4v4(D)] {
        let (mut via, mut direct) = (cache(config), cache(config));
        // Each cache's own ids (an id names its cache); the same slots.
        let seqs = [via.add_sequence().unwrap(), via.add_sequence().unwrap()];
        let dseqs = [direct.add_sequence().unwrap(), direct.add_sequence().unwrap()];
        assert_eq!(dseqs.map(SeqId::slot), seqs.map(SeqId::slot));
        // Prompts of 300 and 150 tokens, then 3 single tokens each: pages flush.
        for (i, ((&seq, &dseq), n)) in seqs.iter().zip(&dseqs).zip([300, 150]).enumerate() {
            let (kt, k) = both::<T>(&rows(Data::Keys, n * HKV, D, 10 + i as u64), (n, HKV, D));
            let (vt, v) = both::<T>(&rows(Data::Normal, n * HKV, D, 20 + i as u64), (n, HKV, D));
            for layer in 0..2 {
                rotkv::candle::append(&mut via, layer, seq, &kt, &vt).unwrap();
                direct.append(layer, dseq, n, &k, &v).unwrap();
            }
        }
        for step in 0..3u64 {
            for (&seq, &dseq) in seqs.iter().zip(&dseqs) {
                let (kt, k) = both::<T>(&rows(Data::Keys, HKV, D, 30 + step), (1, HKV, D));
                let (vt, v) = both::<T>(&rows(Data::Normal, HKV, D, 40 + step), (1, HKV, D));
                rotkv::candle::append(&mut via, 1, seq, &kt, &vt).unwrap();
                direct.append(1, dseq, 1, &k, &v).unwrap();
            }
            let (qt, q) = both::<T>(&rows(Data::Normal, 2 * HQ, D, 50 + step), (2, HQ, D));
            let out = rotkv::candle::decode(&via, 1, &seqs, &qt).unwrap();
            assert_eq!(out.dims(), &[2, HQ, D]);
            assert_eq!(
                tensor_bits::<T>(&out),
                direct_decode(&direct, 1, &dseqs, 1, &q),
                "{:?}",
                <T as WithDType>::DTYPE
            );
        }
        // Multi-token decode: the last 4 tokens of both sequences, in layer 0.
        let (qt, q) = both::<T>(&rows(Data::Normal, 8 * HQ, D, 60), (8, HQ, D));
        let out = rotkv::candle::decode_tokens(&via, 0, &[seqs[1], seqs[0]], 4, &qt).unwrap();
        assert_eq!(tensor_bits::<T>(&out), direct_decode(&direct, 0, &[dseqs[1], dseqs[0]], 4, &q));
        // Both caches hold the same tokens: equal decodes in every layer with f32 queries.
        let q = rows(Data::Normal, 2 * HQ, D, 70);
        for layer in 0..2 {
            assert_eq!(direct_decode(&via, layer, &seqs, 1, &q), direct_decode(&direct, layer, &dseqs, 1, &q));
        }
        assert_eq!(via.free_blocks(), direct.free_blocks());
    }
}

#[test]
fn tensor_round_trip_equals_the_cache_directly_f32() {
    round_trip::<f32>();
}

#[test]
fn tensor_round_trip_equals_the_cache_directly_f16() {
    round_trip::<f16>();
}

#[test]
fn tensor_round_trip_equals_the_cache_directly_bf16() {
    round_trip::<bf16>();
}

/// Views of a fused `[tokens, heads, D]` projection (row-strided), transposed and
/// offset views read the same elements as contiguous tensors.
#[test]
fn strided_and_offset_views_equal_contiguous_tensors() {
    let n = 200;
    let fused = rows(Data::Keys, n * (HQ + 2 * HKV), D, 1);
    let fused = tensor(&fused, (n, HQ + 2 * HKV, D));
    let k = fused.narrow(1, HQ, HKV).unwrap(); // row stride (HQ + 2 HKV) D
    let v = fused.narrow(1, HQ + HKV, HKV).unwrap();
    assert!(!k.is_contiguous() && !v.is_contiguous());
    let (mut a, mut b) = (cache(CacheConfig::k2v2(D)), cache(CacheConfig::k2v2(D)));
    let (sa, sb) = (a.add_sequence().unwrap(), b.add_sequence().unwrap());
    rotkv::candle::append(&mut a, 0, sa, &k, &v).unwrap();
    let (kc, vc) = (k.contiguous().unwrap(), v.contiguous().unwrap());
    rotkv::candle::append(&mut b, 0, sb, &kc, &vc).unwrap();
    // An offset, contiguous slice (read in place) and a token-by-token append.
    let k1 = kc.narrow(0, 150, 50).unwrap();
    let v1 = vc.narrow(0, 150, 50).unwrap();
    rotkv::candle::append(&mut a, 1, sa, &kc.narrow(0, 0, 150).unwrap(), &vc.narrow(0, 0, 150).unwrap()).unwrap();
    rotkv::candle::append(&mut a, 1, sa, &k1, &v1).unwrap();
    for t in 0..n {
        rotkv::candle::append(&mut b, 1, sb, &k.narrow(0, t, 1).unwrap(), &v.narrow(0, t, 1).unwrap()).unwrap();
    }
    // Queries for the last 2 tokens: row-strided, and a transposed (heads, tokens) view
    // made [tokens, heads, D].
    let qf = tensor(&rows(Data::Normal, 3 * (HQ + 2 * HKV), D, 2), (3, HQ + 2 * HKV, D));
    let q = qf.narrow(1, 0, HQ).unwrap().narrow(0, 1, 2).unwrap();
    let qt = q.contiguous().unwrap().transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    assert!(!q.is_contiguous() && !qt.is_contiguous());
    let qc = q.contiguous().unwrap();
    for layer in 0..2 {
        let want = tensor_bits::<f32>(&rotkv::candle::decode_tokens(&b, layer, &[sb], 2, &qc).unwrap());
        assert_eq!(tensor_bits::<f32>(&rotkv::candle::decode_tokens(&a, layer, &[sa], 2, &q).unwrap()), want);
        assert_eq!(tensor_bits::<f32>(&rotkv::candle::decode_tokens(&a, layer, &[sa], 2, &qt).unwrap()), want);
    }
    // A transposed K/V view ([heads, tokens, D] storage seen as [tokens, heads, D]).
    let kt = kc.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    let vt = vc.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    assert!(!kt.is_contiguous());
    let (mut c, mut e) = (cache(CacheConfig::k4v4(D)), cache(CacheConfig::k4v4(D)));
    let (sc, se) = (c.add_sequence().unwrap(), e.add_sequence().unwrap());
    rotkv::candle::append(&mut c, 0, sc, &kt, &vt).unwrap();
    rotkv::candle::append(&mut e, 0, se, &kc, &vc).unwrap();
    let q = qc.narrow(0, 0, 1).unwrap();
    let (x, y) = (rotkv::candle::decode(&c, 0, &[sc], &q).unwrap(), rotkv::candle::decode(&e, 0, &[se], &q).unwrap());
    assert_eq!(tensor_bits::<f32>(&x), tensor_bits::<f32>(&y));
}

/// Which kind of `Error` a bad input must give.
type Kind = fn(&Error) -> bool;

fn is_shape(e: &Error) -> bool {
    matches!(e, Error::Shape(_))
}
fn is_unsupported(e: &Error) -> bool {
    matches!(e, Error::Unsupported(_))
}

/// Every bad input is an `Error` of the right kind, and leaves the cache unchanged.
#[test]
fn every_bad_input_is_an_error_and_changes_nothing() {
    let mut c = cache(CacheConfig::k2v2(D));
    let seq = c.add_sequence().unwrap();
    let good = tensor(&rows(Data::Keys, 10 * HKV, D, 1), (10, HKV, D));
    rotkv::candle::append(&mut c, 0, seq, &good, &good).unwrap();
    let free = c.free_blocks();
    let dev = &Device::Cpu;
    let zeros = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, dev).unwrap();

    let bad_appends: Vec<(&str, Tensor, Tensor, Kind)> = vec![
        ("k f64", good.to_dtype(DType::F64).unwrap(), good.clone(), is_unsupported),
        ("both f64", good.to_dtype(DType::F64).unwrap(), good.to_dtype(DType::F64).unwrap(), is_unsupported),
        ("both u32", zeros(&[10, HKV, D], DType::U32), zeros(&[10, HKV, D], DType::U32), is_unsupported),
        ("both u8", zeros(&[10, HKV, D], DType::U8), zeros(&[10, HKV, D], DType::U8), is_unsupported),
        ("k f16, v f32", good.to_dtype(DType::F16).unwrap(), good.clone(), is_unsupported),
        ("k f32, v bf16", good.clone(), good.to_dtype(DType::BF16).unwrap(), is_unsupported),
        ("rank 2", good.reshape((10, HKV * D)).unwrap(), good.reshape((10, HKV * D)).unwrap(), is_shape),
        ("rank 4", good.reshape((1, 10, HKV, D)).unwrap(), good.reshape((1, 10, HKV, D)).unwrap(), is_shape),
        ("rank 1", good.flatten_all().unwrap(), good.flatten_all().unwrap(), is_shape),
        ("kv heads", zeros(&[10, HKV + 1, D], DType::F32), zeros(&[10, HKV + 1, D], DType::F32), is_shape),
        ("head_dim", zeros(&[10, HKV, 32], DType::F32), zeros(&[10, HKV, 32], DType::F32), is_shape),
        ("v tokens", good.clone(), good.narrow(0, 0, 9).unwrap(), is_shape),
        ("v heads", good.clone(), zeros(&[10, 1, D], DType::F32), is_shape),
        ("v rank", good.clone(), good.reshape((10, HKV * D)).unwrap(), is_shape),
    ];
    for (what, k, v, kind) in bad_appends {
        let e = rotkv::candle::append(&mut c, 0, seq, &k, &v).unwrap_err();
        assert!(kind(&e), "{what}: {e}");
        assert_eq!((c.len(0, seq).unwrap(), c.free_blocks()), (10, free), "{what} changed the cache");
    }
    // Errors of the cache itself come through unchanged.
    let e = rotkv::candle::append(&mut c, 2, seq, &good, &good).unwrap_err();
    assert_eq!(e, Error::Layer { layer: 2, layers: 2 });
    assert_eq!(
        rotkv::candle::append(&mut c, 0, SeqId::from_slot(7), &good, &good).unwrap_err(),
        Error::UnknownSequence(7)
    );
    let big = zeros(&[400, HKV, D], DType::F32);
    assert!(matches!(rotkv::candle::append(&mut c, 0, seq, &big, &big).unwrap_err(), Error::Capacity(_)));
    let nan = (good.clone() * f64::NAN).unwrap();
    assert!(matches!(rotkv::candle::append(&mut c, 0, seq, &nan, &good).unwrap_err(), Error::Value(_)));
    assert_eq!((c.len(0, seq).unwrap(), c.free_blocks()), (10, free));

    let q = tensor(&rows(Data::Normal, HQ, D, 2), (1, HQ, D));
    let bad_queries: Vec<(&str, Tensor, Kind)> = vec![
        ("f64", q.to_dtype(DType::F64).unwrap(), is_unsupported),
        ("i64", zeros(&[1, HQ, D], DType::I64), is_unsupported),
        ("rank 2", q.reshape((1, HQ * D)).unwrap(), is_shape),
        ("rank 4", q.reshape((1, 1, HQ, D)).unwrap(), is_shape),
        ("q heads", zeros(&[1, HKV, D], DType::F32), is_shape),
        ("head_dim", zeros(&[1, HQ, 32], DType::F32), is_shape),
        ("rows", zeros(&[2, HQ, D], DType::F32), is_shape),
        ("no rows", zeros(&[0, HQ, D], DType::F32), is_shape),
    ];
    for (what, q, kind) in bad_queries {
        let e = rotkv::candle::decode(&c, 0, &[seq], &q).unwrap_err();
        assert!(kind(&e), "{what}: {e}");
    }
    // q_len: rows must be seqs * q_len, then the cache's own checks.
    let q3 = zeros(&[3, HQ, D], DType::F32);
    assert!(is_shape(&rotkv::candle::decode_tokens(&c, 0, &[seq], 2, &q3).unwrap_err()));
    assert!(is_shape(&rotkv::candle::decode_tokens(&c, 0, &[seq], usize::MAX, &q3).unwrap_err()));
    let q11 = zeros(&[11, HQ, D], DType::F32);
    assert!(rotkv::candle::decode_tokens(&c, 0, &[seq], 11, &q11).is_err(), "longer than the sequence");
    assert_eq!(rotkv::candle::decode(&c, 0, &[SeqId::from_slot(5)], &q).unwrap_err(), Error::UnknownSequence(5));
    assert_eq!(rotkv::candle::decode(&c, 3, &[seq], &q).unwrap_err(), Error::Layer { layer: 3, layers: 2 });
    // And the good call still works after all that.
    assert_eq!(rotkv::candle::decode(&c, 0, &[seq], &q).unwrap().dims(), &[1, HQ, D]);
    assert_eq!(c.len(0, seq).unwrap(), 10);
}

/// The example: one attention layer of a decoder on candle tensors, checked against
/// candle's f32 attention and rotkv's reference backend.
#[test]
fn candle_attention_example_runs() {
    candle_attention::main().unwrap();
}

// ---------------------------------------------------------------------------------------
// The device path (`device_append`, `device_decode`, `with_tensor_view`) on the emulated
// device: CPU tensors are views of its (host) memory, so everything but the extraction
// of candle's `CudaSlice` runs here.

use rotkv::LayerCalibration;
use rotkv::device::{Counters, DecodePlan, DeviceBuffer, DeviceLayer, LayerSize, PlanShape};
use rotkv::paged::LayerShape;

fn device_layer(dev: &rotkv::device::Device, config: CacheConfig) -> DeviceLayer {
    let shape = LayerShape { num_kv_heads: HKV, num_q_heads: HQ };
    let size = LayerSize { max_seqs: 3, max_tokens: 200, num_blocks: None };
    DeviceLayer::new(dev, config, shape, LayerCalibration::identity(HKV, D), size).unwrap()
}

fn plan(layer: &DeviceLayer, max_seqs: usize) -> DecodePlan {
    let shape =
        PlanShape { max_seqs, max_q_len: 2, max_context: 200, sm_count: None, blocks_per_sm: None, sm_scale: None };
    DecodePlan::new(layer, shape).unwrap()
}

/// `b - a`, field by field.
fn delta(a: Counters, b: Counters) -> Counters {
    Counters {
        allocations: b.allocations - a.allocations,
        uploads: b.uploads - a.uploads,
        downloads: b.downloads - a.downloads,
        synchronizations: b.synchronizations - a.synchronizations,
        launches: b.launches - a.launches,
        device_copies: b.device_copies - a.device_copies,
    }
}

/// A fused projection `[n, HQ + 2 HKV, D]` of `T`: its q, k and v parts as row-strided,
/// offset views (strides `[(HQ + 2 HKV) D, D, 1]`, start offsets 0, `HQ D`, `(HQ + HKV)
/// D`), as a model's QKV matmul leaves them.
fn fused<T: WithDType>(n: usize, seed: u64) -> (Tensor, Tensor, Tensor) {
    let w = HQ + 2 * HKV;
    let mut data = rows(Data::Keys, n * w, D, seed);
    // Queries and values from another distribution than keys.
    for (i, x) in rows(Data::Normal, n * w, D, seed + 1).into_iter().enumerate() {
        let head = (i / D) % w;
        if !(HQ..HQ + HKV).contains(&head) {
            data[i] = x;
        }
    }
    let t = tensor(&data, (n, w, D)).to_dtype(T::DTYPE).unwrap();
    let (q, k, v) = (t.narrow(1, 0, HQ).unwrap(), t.narrow(1, HQ, HKV).unwrap(), t.narrow(1, HQ + HKV, HKV).unwrap());
    // (One row is contiguous whatever its stride, for candle and for the kernels.)
    assert!(n == 1 || (!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous()));
    (q, k, v)
}

/// A tensor's elements, contiguous, as a `Vec<T>`.
fn elems<T: WithDType>(t: &Tensor) -> Vec<T> {
    t.flatten_all().unwrap().to_vec1::<T>().unwrap()
}

/// Relative L2 error of `got` against `want`.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f64 = want.iter().map(|b| b.powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The device path over row-strided tensors equals, bit for bit, the same kernels over
/// `DeviceBuffer`s holding contiguous copies (the views are read in place, at the
/// tensors' row stride and start offset), and the reference backend within the device
/// tolerance; the steady-state step costs what the device API costs: no allocation,
/// upload or synchronization, the launches alone.
fn device_path_equals_device_buffers<T: WithDType + KvElement + rotkv::OutputElement>(tol: f64) {
    let config = CacheConfig::k2v2(D);
    let (via_dev, buf_dev) = (rotkv::device::Device::sim(), rotkv::device::Device::sim());
    let (mut via, mut bufs) = (device_layer(&via_dev, config), device_layer(&buf_dev, config));
    let cs =
        CacheShape { layers: 1, num_kv_heads: HKV, num_q_heads: HQ, max_seqs: 3, max_tokens: 200, num_blocks: None };
    let mut reference = KvCache::new(config, cs, Backend::Reference).unwrap();
    let seqs = [via.add_sequence().unwrap(), via.add_sequence().unwrap()];
    let bseqs = [bufs.add_sequence().unwrap(), bufs.add_sequence().unwrap()];
    let rseqs = [reference.add_sequence().unwrap(), reference.add_sequence().unwrap()];
    // Prompts of 65 and 130 tokens (one and two past a 64-token page), then single
    // tokens.
    let append = |via: &mut DeviceLayer, bufs: &mut DeviceLayer, reference: &mut KvCache, i: usize, n, seed| {
        let (_, k, v) = fused::<T>(n, seed);
        assert_eq!(rotkv::candle::device_append(via, seqs[i], &k, &v).unwrap(), via.len(seqs[i]).unwrap());
        let (ke, ve) = (elems::<T>(&k), elems::<T>(&v));
        let (kb, vb) = (buf_dev.upload(&ke).unwrap(), buf_dev.upload(&ve).unwrap());
        bufs.append(bseqs[i], n, &kb, &vb, HKV * D).unwrap();
        reference.append(0, rseqs[i], n, &ke, &ve).unwrap();
    };
    append(&mut via, &mut bufs, &mut reference, 0, 65, 1);
    append(&mut via, &mut bufs, &mut reference, 1, 130, 3);
    let mut p = plan(&via, 2);
    let mut bp = plan(&bufs, 2);
    for step in 0..3u64 {
        // One token each (sequence 1 crosses no page: no upload, as asserted below).
        let before = via_dev.counters();
        for i in 0..2 {
            append(&mut via, &mut bufs, &mut reference, i, 1, 10 + 2 * step + i as u64);
        }
        let c = delta(before, via_dev.counters());
        // No sequence takes a new page (66..68 and 131..133 tokens): no upload at all.
        assert_eq!(Counters { launches: 0, ..c }, Counters::default(), "{c:?}");
        assert!(c.launches >= 2, "{c:?}");
        for q_len in [1, 2] {
            let (q, _, _) = fused::<T>(2 * q_len, 20 + step);
            let before = via_dev.counters();
            let out = rotkv::candle::device_decode(&mut p, &via, q_len, &q).unwrap();
            let c = delta(before, via_dev.counters());
            assert_eq!(c, Counters { launches: 2, ..Counters::default() }, "a decode step is two launches");
            assert_eq!(out.dims(), &[2 * q_len, HQ, D]);
            assert_eq!(out.dtype(), <T as WithDType>::DTYPE);
            assert!(out.is_contiguous());
            let qb = buf_dev.upload(&elems::<T>(&q)).unwrap();
            let mut ob: DeviceBuffer<T> = buf_dev.alloc(2 * q_len * HQ * D).unwrap();
            bp.run(&bufs, q_len, &qb, &mut ob).unwrap();
            let mut want = vec![T::from_f64(0.0); ob.len()];
            buf_dev.read(&ob, &mut want).unwrap();
            assert_eq!(tensor_bits::<T>(&out), bits(&want), "{:?} q_len {q_len}", <T as WithDType>::DTYPE);
            // The reference backend in f64 with the same (rounded) queries.
            let mut r = vec![0f32; want.len()];
            reference.decode_tokens(0, &rseqs, q_len, &elems::<T>(&q), &mut r).unwrap();
            let got: Vec<f64> = elems::<T>(&out).iter().map(|x| x.to_f64()).collect();
            let r: Vec<f64> = r.iter().map(|&x| x as f64).collect();
            let e = rel_err(&got, &r);
            assert!(e < tol, "{:?} q_len {q_len}: relative error {e} against the reference", <T as WithDType>::DTYPE);
        }
    }
}

/// Device tolerance of the tensor-core decode against the f64 reference (tests/device.rs:
/// f32 accumulation, f16 probabilities in the MMA), plus the output's rounding to `T`
/// (at most 2^-11 relative for f16, 2^-8 for bf16).
const DEVICE_TOL: f64 = 3e-3;

#[test]
fn device_path_equals_device_buffers_f32() {
    device_path_equals_device_buffers::<f32>(DEVICE_TOL);
}

#[test]
fn device_path_equals_device_buffers_f16() {
    device_path_equals_device_buffers::<f16>(DEVICE_TOL + 1.0 / 2048.0);
}

#[test]
fn device_path_equals_device_buffers_bf16() {
    device_path_equals_device_buffers::<bf16>(DEVICE_TOL + 1.0 / 256.0);
}

/// `with_tensor_view` lends a tensor's rows in place: the view's address is the storage's
/// element at the start offset, its length the rows' span, the stride the row stride; a
/// decode into a buffer the stack keeps (no allocation per step) equals `device_decode`.
#[test]
fn tensor_views_are_the_storage_in_place() {
    let dev = rotkv::device::Device::sim();
    let (q, k, _) = fused::<f32>(3, 5);
    let w = HQ + 2 * HKV;
    let (base, len) = {
        let (storage, layout) = k.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else { panic!("a CPU tensor") };
        let all = cpu.as_slice::<f32>().unwrap();
        (all.as_ptr() as u64 + (layout.start_offset() * 4) as u64, all.len())
    };
    assert_eq!(len, 3 * w * D);
    let (addr, n, stride) =
        rotkv::candle::with_tensor_view::<f32, _>(&dev, "k", &k, |v, s| Ok((v.addr(), v.len(), s))).unwrap();
    assert_eq!((addr, n, stride), (base, 2 * w * D + HKV * D, w * D));
    // One row: its stride is the row's size whatever the tensor's.
    let one = k.narrow(0, 2, 1).unwrap();
    let (n1, s1) = rotkv::candle::with_tensor_view::<f32, _>(&dev, "k", &one, |v, s| Ok((v.len(), s))).unwrap();
    assert_eq!((n1, s1), (HKV * D, HKV * D));
    // The wrong element type is an error.
    let e = rotkv::candle::with_tensor_view::<f16, _>(&dev, "k", &k, |_, _| Ok(())).unwrap_err();
    assert!(is_unsupported(&e), "{e}");

    // Decode into a kept buffer through the view.
    let mut layer = device_layer(&dev, CacheConfig::k2v2(D));
    let seq = layer.add_sequence().unwrap();
    let (_, k, v) = fused::<f32>(70, 6);
    rotkv::candle::device_append(&mut layer, seq, &k, &v).unwrap();
    let mut p = plan(&layer, 1);
    let q = q.narrow(0, 0, 1).unwrap();
    let mut out: DeviceBuffer<f32> = dev.alloc(HQ * D).unwrap();
    let before = dev.counters();
    rotkv::candle::with_tensor_view::<f32, _>(&dev, "q", &q, |qv, qs| {
        p.run_strided(&layer, 1, &qv, qs, &mut out, HQ * D)
    })
    .unwrap();
    assert_eq!(delta(before, dev.counters()), Counters { launches: 2, ..Counters::default() });
    let mut kept = vec![0f32; HQ * D];
    dev.read(&out, &mut kept).unwrap();
    let fresh = rotkv::candle::device_decode(&mut p, &layer, 1, &q).unwrap();
    assert_eq!(tensor_bits::<f32>(&fresh), bits(&kept));
}

/// Every bad input of the device path is an `Error` of the right kind, enqueues nothing
/// (the device's counters do not move) and leaves the layer unchanged.
#[test]
fn device_path_bad_inputs_are_errors_and_enqueue_nothing() {
    let dev = rotkv::device::Device::sim();
    let mut layer = device_layer(&dev, CacheConfig::k2v2(D));
    let seq = layer.add_sequence().unwrap();
    let (q, k, v) = fused::<f32>(10, 7);
    rotkv::candle::device_append(&mut layer, seq, &k, &v).unwrap();
    let mut p = plan(&layer, 1);
    let free = layer.free_blocks();
    let (kc, vc) = (k.contiguous().unwrap(), v.contiguous().unwrap());
    let zeros = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, &Device::Cpu).unwrap();
    // [tokens, heads, D] storage seen through a transpose: rows are not contiguous.
    let kt = kc.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    let vt = vc.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    // A stride inside the row (every other channel of a [10, HKV, 2D] tensor).
    let wide = zeros(&[10, HKV, 2 * D], DType::F32);
    let gappy = wide.reshape((10, HKV, D, 2)).unwrap().narrow(3, 0, 1).unwrap().squeeze(3).unwrap();
    assert_eq!(gappy.dims(), &[10, HKV, D]);
    let bad_appends: Vec<(&str, Tensor, Tensor, Kind)> = vec![
        ("k f64", k.to_dtype(DType::F64).unwrap(), v.clone(), is_unsupported),
        ("both u8", zeros(&[10, HKV, D], DType::U8), zeros(&[10, HKV, D], DType::U8), is_unsupported),
        ("k f16, v f32", k.to_dtype(DType::F16).unwrap(), v.clone(), is_unsupported),
        ("rank 2", kc.reshape((10, HKV * D)).unwrap(), vc.reshape((10, HKV * D)).unwrap(), is_shape),
        ("kv heads", zeros(&[10, HKV + 1, D], DType::F32), zeros(&[10, HKV + 1, D], DType::F32), is_shape),
        ("head_dim", zeros(&[10, HKV, 32], DType::F32), zeros(&[10, HKV, 32], DType::F32), is_shape),
        ("v tokens", k.clone(), v.narrow(0, 0, 9).unwrap(), is_shape),
        ("transposed k", kt.clone(), vc.clone(), is_shape),
        ("channel stride", gappy.clone(), gappy.clone(), is_shape),
        ("transposed v (k at another row stride)", k.clone(), vt, is_shape),
    ];
    for (what, k, v, kind) in bad_appends {
        let before = dev.counters();
        let e = rotkv::candle::device_append(&mut layer, seq, &k, &v).unwrap_err();
        assert!(kind(&e), "{what}: {e}");
        assert_eq!(dev.counters(), before, "{what} enqueued work");
        assert_eq!((layer.len(seq).unwrap(), layer.free_blocks()), (10, free), "{what} changed the layer");
    }
    // The layer's own checks come through, before anything is enqueued.
    let stale = {
        let mut other = device_layer(&dev, CacheConfig::k2v2(D));
        other.add_sequence().unwrap()
    };
    let before = dev.counters();
    let big = zeros(&[200, HKV, D], DType::F32);
    assert!(matches!(rotkv::candle::device_append(&mut layer, seq, &big, &big).unwrap_err(), Error::Capacity(_)));
    assert!(matches!(rotkv::candle::device_append(&mut layer, stale, &kc, &vc), Err(Error::UnknownSequence(_))));
    // A tensor of no tokens changes nothing (and still checks the sequence).
    let none = kc.narrow(0, 0, 0).unwrap();
    assert_eq!(rotkv::candle::device_append(&mut layer, seq, &none, &none).unwrap(), 10);
    assert!(rotkv::candle::device_append(&mut layer, stale, &none, &none).is_err());
    assert_eq!(dev.counters(), before);
    assert_eq!(layer.len(seq).unwrap(), 10);

    let q1 = q.narrow(0, 0, 1).unwrap();
    let qt = q1.contiguous().unwrap().transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
    assert!(!qt.is_contiguous() && qt.dims() == [1, HQ, D]);
    let bad_queries: Vec<(&str, Tensor, usize, Kind)> = vec![
        ("f64", q1.to_dtype(DType::F64).unwrap(), 1, is_unsupported),
        ("i64", zeros(&[1, HQ, D], DType::I64), 1, is_unsupported),
        ("rank 2", q1.contiguous().unwrap().reshape((1, HQ * D)).unwrap(), 1, is_shape),
        ("q heads", zeros(&[1, HKV, D], DType::F32), 1, is_shape),
        ("head_dim", zeros(&[1, HQ, 32], DType::F32), 1, is_shape),
        ("rows for the plan's one slot", q.narrow(0, 0, 2).unwrap(), 1, is_shape),
        ("no rows", zeros(&[0, HQ, D], DType::F32), 1, is_shape),
        ("channels strided", qt, 1, is_shape),
        ("q_len 0", q.narrow(0, 0, 0).unwrap(), 0, |e| matches!(e, Error::Shape(_))),
        ("q_len past the plan", q.narrow(0, 0, 3).unwrap(), 3, |e| matches!(e, Error::Shape(_))),
    ];
    for (what, q, q_len, kind) in bad_queries {
        let before = dev.counters();
        let e = rotkv::candle::device_decode(&mut p, &layer, q_len, &q).unwrap_err();
        assert!(kind(&e), "{what}: {e}");
        assert_eq!(dev.counters(), before, "{what} enqueued work");
    }
    // A plan of a layer of another format (a plan serves every layer of the same format
    // and heads, not others); a plan whose max_context the sequence has outgrown (a
    // check against the live sequences, still before anything is allocated or enqueued).
    let other = device_layer(&dev, CacheConfig::k4v2(D));
    let mut foreign = plan(&other, 1);
    let short =
        PlanShape { max_seqs: 1, max_q_len: 1, max_context: 5, sm_count: None, blocks_per_sm: None, sm_scale: None };
    let mut short = DecodePlan::new(&layer, short).unwrap();
    let before = dev.counters();
    assert!(matches!(rotkv::candle::device_decode(&mut foreign, &layer, 1, &q1), Err(Error::Shape(_))));
    assert!(matches!(rotkv::candle::device_decode(&mut short, &layer, 1, &q1), Err(Error::Capacity(_))));
    assert_eq!(dev.counters(), before);
    // The good calls still work.
    assert_eq!(rotkv::candle::device_decode(&mut p, &layer, 1, &q1).unwrap().dims(), &[1, HQ, D]);
    assert_eq!(rotkv::candle::device_append(&mut layer, seq, &k, &v).unwrap(), 20);
}

/// How [`device_append_k_and_v_at_different_row_strides`] hands K or V over.
#[derive(Clone, Copy, Debug)]
enum Input {
    /// A new contiguous tensor (rows `HKV * D` apart), as RoPE leaves k.
    Contiguous,
    /// The view of the fused projection (rows `(HQ + 2 HKV) * D` apart).
    Fused,
    /// A view of a `[n, 3 HKV, D]` tensor's middle heads (rows `3 HKV * D` apart).
    Wide,
}

/// `device_append` with K and V at different row strides, both read in place: a
/// contiguous k next to a v narrowed from the fused projection (37 tokens, then 160: one
/// past the first page boundary, so a page is quantized from window rows and new rows),
/// a fused k next to a contiguous v (197 tokens at once), a fused k next to a v of
/// another projection width (1 token, then 60). The layer's pool and side stores equal,
/// byte for byte, those of the same tokens appended as contiguous tensors.
fn device_append_k_and_v_at_different_row_strides<T: WithDType>() {
    let dev = rotkv::device::Device::sim();
    let config = CacheConfig::k2v2(D);
    let fmt = config.format().unwrap();
    assert_eq!((fmt.sinks + fmt.window + fmt.page_size) as usize, 196);
    let (mut mixed, mut dense) = (device_layer(&dev, config), device_layer(&dev, config));
    let cases: [(&[usize], Input, Input); 3] = [
        (&[37, 160], Input::Contiguous, Input::Fused),
        (&[197], Input::Fused, Input::Contiguous),
        (&[1, 60], Input::Fused, Input::Wide),
    ];
    let mut seed = 50;
    for (counts, kin, vin) in cases {
        let (a, b) = (mixed.add_sequence().unwrap(), dense.add_sequence().unwrap());
        for &n in counts {
            seed += 2;
            let (_, kf, vf) = fused::<T>(n, seed);
            let wide = tensor(&rows(Data::Normal, n * 3 * HKV, D, seed + 1), (n, 3 * HKV, D));
            let wide = wide.to_dtype(<T as WithDType>::DTYPE).unwrap().narrow(1, HKV, HKV).unwrap();
            let pick = |input, f: &Tensor| match input {
                Input::Contiguous => f.contiguous().unwrap(),
                Input::Fused => f.clone(),
                Input::Wide => wide.clone(),
            };
            let (k, v) = (pick(kin, &kf), pick(vin, &vf));
            if n > 1 {
                assert_ne!(k.stride()[0], v.stride()[0], "{kin:?} k, {vin:?} v");
            }
            let len = rotkv::candle::device_append(&mut mixed, a, &k, &v).unwrap();
            let want = rotkv::candle::device_append(&mut dense, b, &k.contiguous().unwrap(), &v.contiguous().unwrap());
            assert_eq!(len, want.unwrap());
        }
    }
    // Two sequences quantized their page (the layer's three blocks hold one each).
    assert_eq!((mixed.free_blocks(), dense.free_blocks()), (1, 1));
    let ((pool, sides), (want_pool, want_sides)) = (mixed.read_cache().unwrap(), dense.read_cache().unwrap());
    assert!(pool.iter().any(|&x| x != 0));
    assert!(pool == want_pool, "pool bytes differ");
    assert!(sides.iter().zip(&want_sides).all(|(x, y)| x.to_bits() == y.to_bits()), "side stores differ");
}

#[test]
fn device_append_k_and_v_at_different_row_strides_f32() {
    device_append_k_and_v_at_different_row_strides::<f32>();
}

#[test]
fn device_append_k_and_v_at_different_row_strides_bf16() {
    device_append_k_and_v_at_different_row_strides::<bf16>();
}

/// CUDA tensors on a cuda layer (feature `candle-cuda`; GPU 0): the same appends and
/// decodes as CPU tensors on a sim layer, within the device tolerance; a tensor on
/// another stream of the same GPU and a CPU tensor on the cuda layer are errors. Says
/// SKIPPED without a CUDA device.
#[cfg(feature = "candle-cuda")]
#[test]
fn cuda_tensors_on_a_cuda_layer() {
    let cdev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("SKIPPED: candle CUDA tensors on a cuda layer: no CUDA device ({e})");
            return;
        }
    };
    let gpu = rotkv::candle::cuda_device(&cdev).unwrap();
    let sim = rotkv::device::Device::sim();
    let config = CacheConfig::k2v2(D);
    let (mut on_gpu, mut on_sim) = (device_layer(&gpu, config), device_layer(&sim, config));
    let (gs, ss) = (on_gpu.add_sequence().unwrap(), on_sim.add_sequence().unwrap());
    let (q, k, v) = fused::<f16>(130, 9);
    let (qg, kg, vg) = (q.to_device(&cdev).unwrap(), k.to_device(&cdev).unwrap(), v.to_device(&cdev).unwrap());
    // `to_device` copies the storage and keeps the layout: the same row-strided views.
    rotkv::candle::device_append(&mut on_gpu, gs, &kg.narrow(0, 0, 129).unwrap(), &vg.narrow(0, 0, 129).unwrap())
        .unwrap();
    rotkv::candle::device_append(&mut on_sim, ss, &k.narrow(0, 0, 129).unwrap(), &v.narrow(0, 0, 129).unwrap())
        .unwrap();
    let (mut pg, mut ps) = (plan(&on_gpu, 1), plan(&on_sim, 1));
    let got = rotkv::candle::device_decode(&mut pg, &on_gpu, 1, &qg.narrow(0, 0, 1).unwrap()).unwrap();
    assert!(got.device().is_cuda());
    let want = rotkv::candle::device_decode(&mut ps, &on_sim, 1, &q.narrow(0, 0, 1).unwrap()).unwrap();
    let got: Vec<f64> = elems::<f16>(&got.to_device(&Device::Cpu).unwrap()).iter().map(|x| x.to_f64()).collect();
    let want: Vec<f64> = elems::<f16>(&want).iter().map(|x| x.to_f64()).collect();
    let e = rel_err(&got, &want);
    assert!(e < DEVICE_TOL, "GPU against the emulator: {e}");
    // The device mismatches.
    let e = rotkv::candle::device_append(&mut on_gpu, gs, &k, &v).unwrap_err();
    assert!(is_unsupported(&e), "CPU tensors on a cuda layer: {e}");
    let e = rotkv::candle::device_append(&mut on_sim, ss, &kg, &vg).unwrap_err();
    assert!(is_unsupported(&e), "CUDA tensors on a sim layer: {e}");
    let stream = cdev.as_cuda_device().unwrap().cuda_stream().context().new_stream().unwrap();
    let mut other = device_layer(&rotkv::device::Device::cuda(stream).unwrap(), config);
    let os = other.add_sequence().unwrap();
    let e = rotkv::candle::device_append(&mut other, os, &kg, &vg).unwrap_err();
    assert!(matches!(&e, Error::Device(m) if m.contains("stream")), "{e}");
    assert_eq!(other.len(os).unwrap(), 0);
}

/// Why the model harness keeps its own products over GGUF blocks instead of candle's
/// `QMatMul` (issue 12 item 1 asked for a measured reason): on the real Gemma 3 270M
/// weights (Q4_K, Q5_0, Q6_K and Q8_0 matrices of layer 0 and the embeddings), candle
/// quantizes the activations to 8 bits (Q8_K or Q8_0 blocks) before its integer dot
/// products: measured 5.1e-3 to 6.3e-3 relative error against the f64 product of the
/// dequantized weights, where rotkv's product (`rotkv::model::math::matmul`, blocks
/// dequantized to f32) stays within f32 rounding (1.7e-7 to 2.8e-7) and equals the f32
/// weights' product bit for bit, which the forward pass's check against numpy (1e-4
/// nats per position) and the storage-independent results need.
#[test]
fn candle_qmatmul_quantizes_activations_where_rotkv_does_not() {
    use candle_core::Module;
    use candle_core::quantized::{GgmlDType, QMatMul, ggml_file::qtensor_from_ggml};
    use rotkv::model::gguf::{Gguf, dequantize};
    use rotkv::model::math::{Blocks, Weight, matmul};
    let Some(path) = rotkv::model::fetched(rotkv::model::GEMMA3_270M) else {
        eprintln!("SKIPPED: {} not fetched (run `cargo xtask fetch`)", rotkv::model::GEMMA3_270M);
        return;
    };
    let g = Gguf::open(&path).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let mut names: Vec<&String> =
        g.tensors.keys().filter(|n| n.starts_with("blk.0.") && n.ends_with(".weight")).collect();
    names.sort();
    let mut rng = rotkv_tests::Rng::new(12);
    for name in names.into_iter().chain(g.tensors.keys().filter(|n| *n == "token_embd.weight")) {
        let (kind, bytes, dims) = g.tensor_bytes(name).unwrap();
        let dtype = match kind {
            2 => GgmlDType::Q4_0,
            3 => GgmlDType::Q4_1,
            6 => GgmlDType::Q5_0,
            8 => GgmlDType::Q8_0,
            12 => GgmlDType::Q4K,
            14 => GgmlDType::Q6K,
            _ => continue,
        };
        if dims.len() != 2 || !seen.insert(kind) {
            continue;
        }
        let (cols, rows) = (dims[0] as usize, dims[1] as usize);
        // At most 512 rows of the matrix (the embeddings have 262,144).
        let rows = rows.min(512);
        let row_bytes = bytes.len() / dims[1] as usize;
        let bytes = &bytes[..rows * row_bytes];
        let w = dequantize(kind, bytes).unwrap();
        let n = 4;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let exact: Vec<f64> = (0..n * rows)
            .map(|i| (0..cols).map(|c| x[i / rows * cols + c] as f64 * w[i % rows * cols + c] as f64).sum())
            .collect();
        let rel = |y: &[f32]| {
            let num: f64 = y.iter().zip(&exact).map(|(&a, &b)| (a as f64 - b).powi(2)).sum();
            (num / exact.iter().map(|b| b * b).sum::<f64>()).sqrt()
        };
        let mut ours = vec![0f32; n * rows];
        let blocks = Weight::Blocks(Blocks::new(kind, rows, cols, bytes.to_vec()).unwrap());
        matmul(&blocks, &x, n, &mut ours);
        let q = qtensor_from_ggml(dtype, bytes, vec![rows, cols], &Device::Cpu).unwrap();
        let mm = QMatMul::from_qtensor(q).unwrap();
        let xt = Tensor::from_slice(&x, (n, cols), &Device::Cpu).unwrap();
        let theirs: Vec<f32> = mm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let (e_ours, e_theirs) = (rel(&ours), rel(&theirs));
        eprintln!("{name} ({dtype:?}, {rows} x {cols}): rotkv {e_ours:.1e}, candle QMatMul {e_theirs:.1e} relative");
        assert!(e_ours < 1e-6, "{name}: rotkv's product {e_ours}");
        assert!(e_theirs > 10.0 * e_ours, "{name}: candle's product {e_theirs} against rotkv's {e_ours}");
    }
    assert!(seen.len() >= 3, "types compared: {seen:?}");
}
