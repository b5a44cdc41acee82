//! Property tests of the cache invariants: random sequences of add, append, protect,
//! decode and free (valid and invalid: stale ids, bad layers, NaN inputs, full pools,
//! positions that can never come) run on every backend side by side. After every
//! operation all backends agree on success or the error's kind; a failed operation
//! leaves every cache byte for byte unchanged; the pools and the live side-store rows
//! of every backend hold the same bytes as the reference's; decode outputs agree with the
//! reference's within the conformance tolerance of the kernel that ran.
//!
//! Inputs are small dyadic values (multiples of 1/8), so every rotation and scale is
//! exact in f32 and f64 and the backends must write identical bytes. Cases: 12 by
//! default (about 20 s with the emulator); `PROPTEST_CASES=n` runs more.

use proptest::prelude::*;
use rotkv::{Backend, CacheConfig, CacheShape, Error, KvCache, SeqId};
use rotkv_tests::{Rng, backends, rel_err};

const D: usize = 64;
const HKV: usize = 1;
const HQ: usize = 4;
const LAYERS: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    Add,
    /// Frees the `n`th id ever handed out (live, freed or stale).
    Free(usize),
    Append {
        id: usize,
        layer: usize,
        tokens: usize,
        seed: u64,
        nan: bool,
    },
    Protect {
        id: usize,
        layer: usize,
        pos: u32,
    },
    Decode {
        ids: Vec<usize>,
        layer: usize,
        splits: Option<u32>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let layer = prop_oneof![8 => 0..LAYERS, 1 => Just(LAYERS)];
    prop_oneof![
        3 => Just(Op::Add),
        1 => (0..8usize).prop_map(Op::Free),
        6 => (0..8usize, layer.clone(), prop_oneof![4 => 0..24usize, 1 => 24..120usize], any::<u64>(), prop::bool::weighted(0.1))
            .prop_map(|(id, layer, tokens, seed, nan)| Op::Append { id, layer, tokens, seed, nan }),
        1 => (0..8usize, layer.clone(), prop_oneof![0..100u32, Just(u32::MAX)])
            .prop_map(|(id, layer, pos)| Op::Protect { id, layer, pos }),
        3 => (prop::collection::vec(0..8usize, 1..4), layer, prop_oneof![Just(None), Just(Some(0)), Just(Some(3)), Just(Some(2000))])
            .prop_map(|(ids, layer, splits)| Op::Decode { ids, layer, splits }),
    ]
}

// `snapshot` (everything a failed call must leave alone) and `live_rows` (the side-store
// rows decode reads) are the fuzz harness's, shared with tests/fuzz.rs and cargo-fuzz.
#[path = "../src/fuzz_harness.rs"]
#[allow(dead_code)]
mod harness;
use harness::{live_rows, snapshot};

/// Dyadic inputs: `n` values in [-2, 2] in steps of 1/8.
fn dyadic(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.below(33) as f32 - 16.0) / 8.0).collect()
}

fn run(ops: &[Op]) {
    let config = CacheConfig { window: 16, page_size: 16, protected: 2, ..CacheConfig::k2v2(D) };
    let shape = CacheShape {
        layers: LAYERS,
        num_kv_heads: HKV,
        num_q_heads: HQ,
        max_seqs: 3,
        max_tokens: 100,
        num_blocks: Some(9),
    };
    // The reference first: the oracle the others are compared with (also when
    // ROTKV_TEST_BACKENDS leaves it out).
    let mut backends = backends();
    backends.retain(|&b| b != Backend::Reference);
    backends.insert(0, Backend::Reference);
    let mut caches: Vec<KvCache> = backends.iter().map(|&b| KvCache::new(config, shape, b).unwrap()).collect();
    // Per backend, every id handed out so far (the same slots and generations).
    let mut ids: Vec<Vec<SeqId>> = vec![Vec::new(); caches.len()];
    let pick = |ids: &[SeqId], n: usize| if ids.is_empty() { SeqId::from_slot(n % 3) } else { ids[n % ids.len()] };
    for (step, op) in ops.iter().enumerate() {
        let mut outcomes: Vec<Result<Option<Vec<f32>>, Error>> = Vec::new();
        for (c, cache) in caches.iter_mut().enumerate() {
            let before = snapshot(cache, &ids[c]);
            let r = match op {
                Op::Add => cache.add_sequence().map(|s| {
                    ids[c].push(s);
                    None
                }),
                Op::Free(n) => cache.free_sequence(pick(&ids[c], *n)).map(|()| None),
                Op::Append { id, layer, tokens, seed, nan } => {
                    let mut k = dyadic(tokens * HKV * D, *seed);
                    let v = dyadic(tokens * HKV * D, seed.wrapping_add(1));
                    if *nan && !k.is_empty() {
                        let mid = k.len() / 2;
                        k[mid] = f32::NAN;
                    }
                    cache.append(*layer, pick(&ids[c], *id), *tokens, &k, &v).map(|()| None)
                }
                Op::Protect { id, layer, pos } => cache.protect(*layer, pick(&ids[c], *id), &[*pos]).map(|()| None),
                Op::Decode { ids: which, layer, splits } => {
                    let seqs: Vec<SeqId> = which.iter().map(|&n| pick(&ids[c], n)).collect();
                    let q = dyadic(seqs.len() * HQ * D, 99 + step as u64);
                    let mut out = vec![0f32; q.len()];
                    cache.decode_with(*layer, &seqs, &q, &mut out, *splits).map(|()| Some(out))
                }
            };
            if r.is_err() {
                let after = snapshot(cache, &ids[c]);
                assert!(after == before, "step {step} {op:?} on {:?}: a failed call changed the cache", backends[c]);
            }
            outcomes.push(r);
        }
        let reference = &outcomes[0];
        for (c, r) in outcomes.iter().enumerate().skip(1) {
            let b = backends[c];
            match (reference, r) {
                (Err(a), Err(e)) => {
                    assert_eq!(
                        std::mem::discriminant(a),
                        std::mem::discriminant(e),
                        "step {step} {op:?} {b:?}: {a} / {e}"
                    )
                }
                (Ok(Some(want)), Ok(Some(got))) => {
                    // The conformance tolerances: f32 CUDA-core kernels, and the
                    // emulated device kernels (which may pick the f16 tensor-core one).
                    let tol = if b == Backend::Cpu { 5e-5 } else { 3e-3 };
                    let e = rel_err(got, want);
                    assert!(e < tol, "step {step} {op:?} {b:?}: decode differs from the reference by {e:.2e}");
                }
                (Ok(_), Ok(_)) => {}
                _ => panic!("step {step} {op:?}: reference {reference:?}, {b:?} {r:?}"),
            }
            for l in 0..LAYERS {
                let (want, got) = (caches[0].layer_bytes(l).unwrap(), caches[c].layer_bytes(l).unwrap());
                assert!(want.0 == got.0, "step {step} {op:?} {b:?}: layer {l} pool bytes differ from the reference");
                let (wr, gr) = (live_rows(&caches[0], &ids[0], l), live_rows(&caches[c], &ids[c], l));
                assert!(wr == gr, "step {step} {op:?} {b:?}: layer {l} live side-store rows differ from the reference");
            }
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(12)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_the_cache_invariants(ops in prop::collection::vec(op(), 1..24)) {
        run(&ops);
    }
}

/// A fixed sequence through every kind of error, so that the properties above are
/// exercised even when the random cases happen to miss one.
#[test]
fn a_fixed_sequence_through_every_error() {
    use Op::*;
    run(&[
        Add,
        Append { id: 0, layer: 0, tokens: 40, seed: 1, nan: false },
        Append { id: 0, layer: 2, tokens: 1, seed: 2, nan: false },
        Append { id: 0, layer: 1, tokens: 5, seed: 3, nan: true },
        Protect { id: 0, layer: 0, pos: u32::MAX },
        Protect { id: 0, layer: 0, pos: 45 },
        Decode { ids: vec![0], layer: 0, splits: Some(2000) },
        Decode { ids: vec![0], layer: 0, splits: Some(0) },
        Decode { ids: vec![0], layer: 1, splits: None },
        Add,
        Append { id: 1, layer: 0, tokens: 100, seed: 4, nan: false },
        Append { id: 1, layer: 0, tokens: 60, seed: 5, nan: false },
        Decode { ids: vec![0, 1], layer: 0, splits: Some(3) },
        Decode { ids: vec![0, 0], layer: 0, splits: None },
        Free(0),
        Free(0),
        Add,
        Append { id: 0, layer: 0, tokens: 2, seed: 6, nan: false },
        Append { id: 2, layer: 0, tokens: 30, seed: 7, nan: false },
        Decode { ids: vec![1, 2], layer: 0, splits: Some(3) },
    ]);
}
