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
