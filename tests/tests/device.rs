//! The device path on the emulated backend: append over the GPU grid limit, the slot
//! mapping's capacity check.

use rotkv::paged::{self, LayerShape};
use rotkv::{Backend, CacheConfig, CacheShape, Error, KvCache, LayerCalibration, SeqId};

use rotkv_tests::uniform as rows;

/// An append of more tokens than a GPU grid's y dimension (65,535) is cut into launches
/// that each fit; the bytes equal the CPU backend's. Slow on the emulator (65,605
/// one-warp blocks, minutes on two cores): `cargo test --test device -- --ignored`. The
/// chunking itself is unit-tested in `rotkv::launch`.
#[test]
#[ignore = "slow on the emulator (minutes); run with --ignored"]
fn sim_append_past_the_grid_limit() {
    let config = CacheConfig::k2v2(64);
    let shape = LayerShape { num_kv_heads: 1, num_q_heads: 1 };
    let calib = LayerCalibration::identity(1, 64);
    let tokens = 65_535 + 70;
    let blocks = paged::blocks_for(&config, tokens).unwrap();
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let (k, v) = (rows(tokens * 64, 1), rows(tokens * 64, 2));
    let mut out = Vec::new();
    for backend in [Backend::Cpu, Backend::Sim] {
        let mut pool = paged::PoolBuffer::new(paged::pool_bytes(&config, &shape, blocks).unwrap());
        let mut side = vec![rotkv::f16::ZERO; paged::side_elems(&config, &shape).unwrap()];
        paged::append(backend, &config, &calib, &shape, pool.bytes_mut(), &table, &mut side, &[], 0, tokens, &k, &v)
            .unwrap();
        out.push((pool, side));
    }
    let diff = out[0].0.bytes().iter().zip(out[1].0.bytes()).filter(|(a, b)| a != b).count();
    // Codes may differ only at float rounding ties of the f32 rotation (a handful of bytes).
    assert!(diff * 10_000 < out[0].0.bytes().len(), "{diff} bytes differ");
    assert_eq!(out[0].1, out[1].1);
}

/// A pool past what u32 block-table entries address is refused before anything is
/// allocated or written (the kernels compute pool offsets in 64 bits, so there is no
/// smaller limit).
#[test]
fn pool_past_the_block_index_space_is_refused() {
    let config = CacheConfig::k2v2(64);
    let fmt = config.format().unwrap();
    let max = rotkv::launch::max_pool_blocks(&fmt);
    assert_eq!(max, u32::MAX as usize);
    let shape =
        |n| CacheShape { layers: 1, num_kv_heads: 1, num_q_heads: 1, max_seqs: 1, max_tokens: 64, num_blocks: Some(n) };
    assert!(matches!(KvCache::new(config, shape(max + 1), Backend::Cpu), Err(Error::Capacity(_))));
    assert!(matches!(KvCache::new(config, shape(usize::MAX / 4), Backend::Cpu), Err(Error::Capacity(_))));
}

// ---------------------------------------------------------------------------------------
// The device API on the emulated device.

use rotkv::device::{Counters, DecodePlan, Device, DeviceBuffer, DeviceLayer, LayerSize, PlanShape};
use rotkv::{bf16, f16};

/// The device these tests run on: the emulated device, or with `ROTKV_TEST_DEVICE=cuda`
/// (the GPU bundle's second run of this binary) a new stream on GPU 0; the tests then
/// run the same device API on the GPU (the counters count on both).
fn test_device() -> Device {
    if std::env::var("ROTKV_TEST_DEVICE").as_deref() == Ok("cuda") {
        let ctx = rotkv::cuda::cudarc::driver::CudaContext::new(0).expect("ROTKV_TEST_DEVICE=cuda needs GPU 0");
        return Device::cuda(ctx.new_stream().expect("a stream")).expect("the device API on GPU 0");
    }
    Device::sim()
}

/// Device tolerance of the tensor-core decode kernel against the f64 reference (as in
/// conformance.rs: f32 accumulation, f16 probabilities in the MMA).
const DEVICE_TOL: f64 = 3e-3;

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

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

const D: usize = 64;

/// A device layer and the reference cache fed the same tokens, step by step.
struct Twin {
    dev: Device,
    layer: DeviceLayer,
    host: KvCache,
    hkv: usize,
    hq: usize,
    seed: u64,
    /// The host cache's id of each slot's live sequence.
    host_ids: Vec<Option<SeqId>>,
    /// The device layer's id of each slot's live sequence.
    dev_ids: Vec<Option<SeqId>>,
}

impl Twin {
    fn new(hkv: usize, hq: usize, max_seqs: usize) -> Self {
        Self::with_config(CacheConfig::k2v2(D), hkv, hq, max_seqs)
    }
    fn with_config(config: CacheConfig, hkv: usize, hq: usize, max_seqs: usize) -> Self {
        let dev = test_device();
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
        let size = LayerSize { max_seqs, max_tokens: 256, num_blocks: None };
        let layer = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, D), size).unwrap();
        let cs =
            CacheShape { layers: 1, num_kv_heads: hkv, num_q_heads: hq, max_seqs, max_tokens: 256, num_blocks: None };
        let host = KvCache::new(config, cs, Backend::Reference).unwrap();
        Twin { dev, layer, host, hkv, hq, seed: 7, host_ids: vec![None; max_seqs], dev_ids: vec![None; max_seqs] }
    }
    fn add(&mut self) -> usize {
        let a = self.layer.add_sequence().unwrap();
        let h = self.host.add_sequence().unwrap();
        assert_eq!(h.slot(), a.slot());
        self.host_ids[a.slot()] = Some(h);
        self.dev_ids[a.slot()] = Some(a);
        a.slot()
    }
    /// The device layer's id of slot `seq`.
    fn did(&self, seq: usize) -> SeqId {
        self.dev_ids[seq].expect("a live slot")
    }
    /// The host cache's id of slot `seq`.
    fn hid(&self, seq: usize) -> SeqId {
        self.host_ids[seq].expect("a live slot")
    }
    fn free(&mut self, seq: usize) {
        self.layer.free_sequence(self.dev_ids[seq].take().expect("a live slot")).unwrap();
        self.host.free_sequence(self.host_ids[seq].take().expect("a live slot")).unwrap();
    }
    /// Appends `n` random tokens, f32 or f16 on the device, with a padded token stride.
    fn append(&mut self, seq: usize, n: usize, half: bool) {
        self.seed += 1;
        let stride = self.hkv * D + 8;
        let k = rows(n * stride, self.seed);
        let v = rows(n * stride, self.seed + 1000);
        let dense = |x: &[f32]| -> Vec<f32> {
            (0..n).flat_map(|t| x[t * stride..t * stride + self.hkv * D].to_vec()).collect()
        };
        if half {
            let (kh, vh): (Vec<f16>, Vec<f16>) =
                (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
            let (kd, vd) = (self.dev.upload(&kh).unwrap(), self.dev.upload(&vh).unwrap());
            self.layer.append(self.did(seq), n, &kd, &vd, stride).unwrap();
            let to16 = |x: Vec<f32>| x.into_iter().map(f16::from_f32).collect::<Vec<_>>();
            self.host.append(0, self.hid(seq), n, &to16(dense(&k)), &to16(dense(&v))).unwrap();
        } else {
            let (kd, vd) = (self.dev.upload(&k).unwrap(), self.dev.upload(&v).unwrap());
            self.layer.append(self.did(seq), n, &kd, &vd, stride).unwrap();
            self.host.append(0, self.hid(seq), n, &dense(&k), &dense(&v)).unwrap();
        }
        assert_eq!(self.layer.len(self.did(seq)).unwrap(), self.host.len(0, self.hid(seq)).unwrap());
    }
    fn queries(&mut self, slots: usize, q_len: usize) -> Vec<f32> {
        self.seed += 1;
        rows(slots * q_len * self.hq * D, self.seed)
    }
    /// The reference output for every slot (zeros for free or empty slots).
    fn reference(&self, slots: usize, q_len: usize, q: &[f32]) -> Vec<f32> {
        let row = q_len * self.hq * D;
        let mut want = vec![0f32; slots * row];
        for s in 0..slots {
            let Some(id) = self.host_ids[s] else { continue };
            if self.host.len(0, id).is_ok_and(|l| l > 0) {
                let out = &mut want[s * row..(s + 1) * row];
                self.host.decode_tokens(0, &[id], q_len, &q[s * row..(s + 1) * row], out).unwrap();
            }
        }
        want
    }
}

/// One plan, many length sets and batches (sequences added and freed, f32 and f16 K/V,
/// q_len 1, 3 and 4): each step equals the reference decode within the device
/// tolerance, and a decode step allocates, copies and waits for nothing.
#[test]
fn one_plan_many_steps_match_the_reference() {
    let slots = 3;
    let mut t = Twin::new(2, 6, slots);
    let shape = PlanShape {
        max_seqs: slots,
        max_q_len: 4,
        max_context: 256,
        sm_count: None,
        blocks_per_sm: None,
        sm_scale: None,
    };
    let mut plan = DecodePlan::new(&t.layer, shape).unwrap();
    let grids: Vec<_> = (1..=4).map(|q| plan.grid(&t.layer, q)).collect();
    let mut outs: Vec<DeviceBuffer<f32>> = (1..=4).map(|q| t.dev.alloc(slots * q * 6 * D).unwrap()).collect();
    let mut qs: Vec<DeviceBuffer<f32>> = (1..=4).map(|q| t.dev.alloc(slots * q * 6 * D).unwrap()).collect();
    let (a, b) = (t.add(), t.add());
    t.append(a, 150, false);
    t.append(b, 40, true);
    type Step = Box<dyn Fn(&mut Twin) -> usize>;
    let steps: Vec<Step> = vec![
        Box::new(|_| 1),
        Box::new(|t| {
            t.append(0, 1, false);
            t.append(1, 1, true);
            1
        }),
        Box::new(|t| {
            let c = t.add();
            t.append(c, 205, false);
            for s in 0..3 {
                t.append(s, 3, s == 1);
            }
            3
        }),
        Box::new(|t| {
            t.free(0);
            let c = t.add();
            assert_eq!(c, 0);
            t.append(c, 5, true);
            t.append(2, 1, false);
            4
        }),
        Box::new(|t| {
            t.free(1);
            t.append(2, 4, false);
            4
        }),
    ];
    for (i, step) in steps.iter().enumerate() {
        let q_len = step(&mut t);
        let q = t.queries(slots, q_len);
        t.dev.write(&mut qs[q_len - 1], 0, &q).unwrap();
        let before = t.dev.counters();
        plan.run(&t.layer, q_len, &qs[q_len - 1], &mut outs[q_len - 1]).unwrap();
        let d = delta(before, t.dev.counters());
        assert_eq!(d, Counters { launches: 2, ..Counters::default() }, "step {i}: a decode step only launches");
        assert_eq!(plan.grid(&t.layer, q_len), grids[q_len - 1]);
        let mut got = vec![0f32; q.len()];
        t.dev.read(&outs[q_len - 1], &mut got).unwrap();
        let want = t.reference(slots, q_len, &q);
        let err = rel_err(&got, &want);
        assert!(err < DEVICE_TOL, "step {i} (q_len {q_len}): relative error {err}");
        // Free slots' rows are zero.
        let row = q_len * 6 * D;
        for s in 0..slots {
            if t.layer.slot_len(s).is_none_or(|l| l == 0) {
                assert!(got[s * row..(s + 1) * row].iter().all(|&x| x == 0.0), "step {i}: free slot {s}");
            }
        }
    }
}

/// A windowed plan (`DecodePlan::new_windowed`): the same grid every step, each step
/// equal to the reference cache's decode with the same window within the device
/// tolerance (q_len 1 and 3, lengths around and past pages and the window), and fewer
/// splits than the unwindowed plan for the same shape (the splits cut the visible
/// positions only). A window that does not fit u32 is refused.
#[test]
fn windowed_plan_matches_the_reference() {
    let slots = 2;
    let config = CacheConfig { window: 32, page_size: 16, sinks: 3, ..CacheConfig::k2v2(D) };
    let mut t = Twin::with_config(config, 1, 4, slots);
    let window_left = 40;
    t.host.set_window_left(0, Some(window_left)).unwrap();
    let shape = PlanShape {
        max_seqs: slots,
        max_q_len: 3,
        max_context: 256,
        sm_count: Some(132),
        blocks_per_sm: Some(1),
        sm_scale: None,
    };
    let mut plan = DecodePlan::new_windowed(&t.layer, shape, Some(window_left)).unwrap();
    assert_eq!(plan.window_left(), Some(window_left));
    assert!(matches!(DecodePlan::new_windowed(&t.layer, shape, Some(u32::MAX as usize)), Err(Error::Value(_))));
    // Split counts on a layer of 8192-token sequences: 32 splits of 256 for the whole
    // context, 1 for the 43 positions a window of 41 keys and 3 rows see.
    let big = DeviceLayer::new(
        &t.dev,
        config,
        LayerShape { num_kv_heads: 1, num_q_heads: 4 },
        LayerCalibration::identity(1, D),
        LayerSize { max_seqs: 1, max_tokens: 8192, num_blocks: None },
    )
    .unwrap();
    let big_shape = PlanShape { max_seqs: 1, max_context: 8192, ..shape };
    let full = DecodePlan::new(&big, big_shape).unwrap();
    let windowed = DecodePlan::new_windowed(&big, big_shape, Some(window_left)).unwrap();
    assert_eq!((full.window_left(), full.num_splits(), windowed.num_splits()), (None, 32, 1));
    let grids: Vec<_> = (1..=3).map(|q| plan.grid(&t.layer, q)).collect();
    let (a, b) = (t.add(), t.add());
    t.append(a, 150, false);
    t.append(b, 20, true);
    for (i, (grow, q_len)) in [(1, 1), (2, 3), (37, 1), (60, 3)].into_iter().enumerate() {
        for s in [a, b] {
            t.append(s, grow, s == b);
        }
        let q = t.queries(slots, q_len);
        let mut qb: DeviceBuffer<f32> = t.dev.alloc(q.len()).unwrap();
        let mut out: DeviceBuffer<f32> = t.dev.alloc(q.len()).unwrap();
        t.dev.write(&mut qb, 0, &q).unwrap();
        plan.run(&t.layer, q_len, &qb, &mut out).unwrap();
        assert_eq!(plan.grid(&t.layer, q_len), grids[q_len - 1]);
        let mut got = vec![0f32; q.len()];
        t.dev.read(&out, &mut got).unwrap();
        let want = t.reference(slots, q_len, &q);
        let err = rel_err(&got, &want);
        assert!(err < DEVICE_TOL, "step {i} (q_len {q_len}): relative error {err}");
    }
}

/// Steady-state appends of one token allocate, download and wait for nothing, and
/// upload nothing but the block-table entry of a page the sequence takes: the kernels
/// place each token from the tables on the device and store the new length there (which
/// the next decode reads).
#[test]
fn steady_state_appends_upload_only_new_table_entries() {
    let config = CacheConfig { window: 16, ..CacheConfig::k2v2(D) };
    let mut t = Twin::with_config(config, 2, 4, 2);
    let slots = 2;
    let (a, b) = (t.add(), t.add());
    t.append(b, 30, false);
    let shape = PlanShape {
        max_seqs: slots,
        max_q_len: 1,
        max_context: 256,
        sm_count: None,
        blocks_per_sm: None,
        sm_scale: None,
    };
    let mut plan = DecodePlan::new(&t.layer, shape).unwrap();
    let fmt = config.format().unwrap();
    let stride = 2 * D;
    let mut took = 0;
    for i in 0..200 {
        let (k, v) = (rows(stride, 500 + i), rows(stride, 900 + i));
        let (kd, vd) = (t.dev.upload(&k).unwrap(), t.dev.upload(&v).unwrap());
        let len = t.layer.len(t.did(a)).unwrap() as u32;
        let before = t.dev.counters();
        t.layer.append(t.did(a), 1, &kd, &vd, stride).unwrap();
        let d = delta(before, t.dev.counters());
        let new_page = fmt.pages_for(len + 1) > fmt.pages_for(len);
        took += new_page as usize;
        assert_eq!(
            (d.allocations, d.downloads, d.synchronizations, d.uploads),
            (0, 0, 0, new_page as usize),
            "append at {len}: {d:?}"
        );
        t.host.append(0, t.hid(a), 1, &k, &v).unwrap();
    }
    assert!(took >= 2, "the appends crossed {took} page boundaries");
    let q = t.queries(slots, 1);
    let qd = t.dev.upload(&q).unwrap();
    let mut out = t.dev.alloc::<f32>(q.len()).unwrap();
    plan.run(&t.layer, 1, &qd, &mut out).unwrap();
    let mut got = vec![0f32; q.len()];
    t.dev.read(&out, &mut got).unwrap();
    let err = rel_err(&got, &t.reference(slots, 1, &q));
    assert!(err < DEVICE_TOL, "after single-token appends: relative error {err}");
}

/// f16 output equals the f32 output rounded to f16 (the merge writes what it computed).
#[test]
fn f16_output() {
    let mut t = Twin::new(1, 4, 2);
    let s = t.add();
    t.append(s, 70, false);
    let shape = PlanShape {
        max_seqs: 2,
        max_q_len: 2,
        max_context: 100,
        sm_count: Some(8),
        blocks_per_sm: None,
        sm_scale: None,
    };
    let mut plan = DecodePlan::new(&t.layer, shape).unwrap();
    let q = t.queries(2, 2);
    let qd = t.dev.upload(&q).unwrap();
    let mut o32 = t.dev.alloc::<f32>(q.len()).unwrap();
    let mut o16 = t.dev.alloc::<f16>(q.len()).unwrap();
    plan.run(&t.layer, 2, &qd, &mut o32).unwrap();
    plan.run(&t.layer, 2, &qd, &mut o16).unwrap();
    let (mut a, mut b) = (vec![0f32; q.len()], vec![f16::ZERO; q.len()]);
    t.dev.read(&o32, &mut a).unwrap();
    t.dev.read(&o16, &mut b).unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| f16::from_f32(*x) == *y));
    assert!(rel_err(&a, &t.reference(2, 2, &q)) < DEVICE_TOL);
    // The bench helpers: a timed step, a device-to-device copy.
    assert!(t.dev.time(0, 1, || plan.run(&t.layer, 2, &qd, &mut o32)).unwrap() > 0.0);
    let mut copy = t.dev.alloc::<f32>(q.len()).unwrap();
    t.dev.copy(&o32, &mut copy).unwrap();
    let mut c = vec![0f32; q.len()];
    t.dev.read(&copy, &mut c).unwrap();
    assert_eq!(c, a);
}

/// Tensor parallelism: two shards of a layer's heads (one KV head and its three query
/// heads each) give the unsharded layer's output.
#[test]
fn two_shards_equal_the_whole_layer() {
    let (hkv, hq, n) = (2, 6, 90);
    let config = CacheConfig::k2v2(D);
    let dev = test_device();
    let size = LayerSize { max_seqs: 1, max_tokens: 128, num_blocks: None };
    let make = |hkv, hq| {
        DeviceLayer::new(
            &dev,
            config,
            LayerShape { num_kv_heads: hkv, num_q_heads: hq },
            LayerCalibration::identity(hkv, D),
            size,
        )
        .unwrap()
    };
    let (k, v, q) = (rows(n * hkv * D, 1), rows(n * hkv * D, 2), rows(hq * D, 3));
    let shape =
        PlanShape { max_seqs: 1, max_q_len: 1, max_context: 128, sm_count: None, blocks_per_sm: None, sm_scale: None };
    let run = |layer: &mut DeviceLayer, k: &[f32], v: &[f32], q: &[f32]| {
        let s = layer.add_sequence().unwrap();
        let (kd, vd) = (dev.upload(k).unwrap(), dev.upload(v).unwrap());
        layer.append(s, n, &kd, &vd, k.len() / n).unwrap();
        let mut plan = DecodePlan::new(layer, shape).unwrap();
        let qd = dev.upload(q).unwrap();
        let mut out = dev.alloc::<f32>(q.len()).unwrap();
        plan.run(layer, 1, &qd, &mut out).unwrap();
        let mut host = vec![0f32; q.len()];
        dev.read(&out, &mut host).unwrap();
        host
    };
    let whole = run(&mut make(hkv, hq), &k, &v, &q);
    let per = hq / hkv;
    for j in 0..hkv {
        let pick = |x: &[f32]| -> Vec<f32> { x.chunks(hkv * D).flat_map(|t| t[j * D..(j + 1) * D].to_vec()).collect() };
        let qj = q[j * per * D..(j + 1) * per * D].to_vec();
        let part = run(&mut make(1, per), &pick(&k), &pick(&v), &qj);
        assert!(rel_err(&part, &whole[j * per * D..(j + 1) * per * D]) < 1e-6, "shard {j}");
    }
}

/// Bad input is refused with an error before anything is enqueued.
#[test]
fn device_errors() {
    let mut t = Twin::new(1, 4, 3);
    let dev = t.dev.clone();
    let other = Device::sim();
    let bad_plan = |max_seqs, max_q_len, max_context| PlanShape {
        max_seqs,
        max_q_len,
        max_context,
        sm_count: None,
        blocks_per_sm: None,
        sm_scale: None,
    };
    assert!(matches!(DecodePlan::new(&t.layer, bad_plan(4, 1, 100)), Err(Error::Capacity(_))));
    assert!(matches!(DecodePlan::new(&t.layer, bad_plan(1, 0, 100)), Err(Error::Shape(_))));
    assert!(matches!(DecodePlan::new(&t.layer, bad_plan(1, 1, 257)), Err(Error::Capacity(_))));
    let s0 = t.add();
    let s1 = t.add();
    let (k, v) = (dev.upload(&rows(40 * D, 1)).unwrap(), dev.upload(&rows(40 * D, 2)).unwrap());
    // Inputs too short for the tokens and stride; a stride below a token's size; a
    // buffer of another device; too many tokens; an unknown sequence.
    assert!(matches!(t.layer.append(t.did(s0), 41, &k, &v, D), Err(Error::Shape(_))));
    assert!(matches!(t.layer.append(t.did(s0), 30, &k, &v, 2 * D + 1), Err(Error::Shape(_))));
    assert!(matches!(t.layer.append(t.did(s0), 2, &k, &v, D - 1), Err(Error::Shape(_))));
    let k_other = other.upload(&rows(40 * D, 1)).unwrap();
    assert!(t.layer.append(t.did(s0), 2, &k_other, &v, D).is_err());
    assert!(matches!(t.layer.append(SeqId::from_slot(7), 2, &k, &v, D), Err(Error::UnknownSequence(7))));
    let before = dev.counters();
    assert!(matches!(
        t.layer.append(t.did(s0), 300, &dev.alloc::<f32>(300 * D).unwrap(), &dev.alloc::<f32>(300 * D).unwrap(), D),
        Err(Error::Capacity(_))
    ));
    assert_eq!(dev.counters().launches, before.launches);
    t.layer.append(t.did(s0), 40, &k, &v, D).unwrap();
    t.layer.append(t.did(s1), 3, &k, &v, D).unwrap();
    // A plan too small for the batch (slot 1 is live), lengths beyond the plan, q_len
    // beyond the plan or a sequence, wrong sizes, another layer.
    let q = dev.alloc::<f32>(3 * 4 * 4 * D).unwrap();
    let mut out = dev.alloc::<f32>(3 * 4 * 4 * D).unwrap();
    let mut small = DecodePlan::new(&t.layer, bad_plan(1, 1, 100)).unwrap();
    let q1 = dev.alloc::<f32>(4 * D).unwrap();
    let mut o1 = dev.alloc::<f32>(4 * D).unwrap();
    let before = dev.counters();
    assert!(matches!(small.run(&t.layer, 1, &q1, &mut o1), Err(Error::Capacity(_))));
    let mut short = DecodePlan::new(&t.layer, bad_plan(3, 4, 30)).unwrap();
    let mut q3 = dev.alloc::<f32>(3 * 4 * D).unwrap();
    let mut o3 = dev.alloc::<f32>(3 * 4 * D).unwrap();
    assert!(matches!(short.run(&t.layer, 1, &q3, &mut o3), Err(Error::Capacity(_))));
    let mut plan = DecodePlan::new(&t.layer, bad_plan(3, 4, 100)).unwrap();
    assert!(matches!(plan.run(&t.layer, 5, &q, &mut out), Err(Error::Shape(_))));
    assert!(matches!(plan.run(&t.layer, 4, &q, &mut out), Err(Error::Shape(_)))); // s1 has 3 tokens
    assert!(matches!(plan.run(&t.layer, 2, &q3, &mut o3), Err(Error::Shape(_)))); // too small for q_len 2
    let q_other = other.alloc::<f32>(3 * 4 * D).unwrap();
    assert!(plan.run(&t.layer, 1, &q_other, &mut o3).is_err());
    // A layer on another device handle (layers of the same device, format and heads
    // share a plan: tests/tests/step.rs).
    let twin = Twin::new(1, 4, 3);
    assert!(matches!(plan.run(&twin.layer, 1, &q3, &mut o3), Err(Error::Device(_))));
    assert_eq!(dev.counters().launches, before.launches, "nothing was enqueued");
    dev.write(&mut q3, 0, &rows(3 * 4 * D, 5)).unwrap();
    plan.run(&t.layer, 1, &q3, &mut o3).unwrap();
    // k2v2 keeps no protected positions: refused, appended or not.
    assert!(matches!(t.layer.protect(t.did(s0), &[10]), Err(Error::Capacity(_))));
    assert!(matches!(t.layer.protect(t.did(s0), &[45]), Err(Error::Capacity(_))));
}

/// f16 and bf16 queries, bf16 output, and query/output rows with gaps (a fused QKV
/// row, an output with other columns): the same attention as dense f32 rows of the same
/// (rounded) queries, and the gaps of the output untouched.
#[test]
fn query_and_output_types_and_row_strides() {
    let mut t = Twin::new(2, 6, 2);
    let (a, b) = (t.add(), t.add());
    t.append(a, 90, false);
    t.append(b, 33, true);
    let shape = PlanShape {
        max_seqs: 2,
        max_q_len: 3,
        max_context: 100,
        sm_count: Some(8),
        blocks_per_sm: None,
        sm_scale: None,
    };
    let mut plan = DecodePlan::new(&t.layer, shape).unwrap();
    let q_len = 3;
    let row = 6 * D;
    let rows_n = 2 * q_len;
    let q = t.queries(2, q_len);
    // Queries rounded to f16 (and to bf16): the reference gets the rounded values.
    let q16: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
    let qb: Vec<bf16> = q.iter().map(|&x| bf16::from_f32(x)).collect();
    let want16 = t.reference(2, q_len, &q16.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
    let wantb = t.reference(2, q_len, &qb.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
    // Strided: each query row inside a wider row (as a fused QKV projection writes it),
    // each output row inside a wider row prefilled with a sentinel.
    let (qs, os) = (row + 2 * 2 * D + 8, row + 40);
    let mut wide = vec![f16::from_f32(7.0); (rows_n - 1) * qs + row];
    for r in 0..rows_n {
        wide[r * qs..r * qs + row].copy_from_slice(&q16[r * row..(r + 1) * row]);
    }
    let qd16 = t.dev.upload(&wide).unwrap();
    let sentinel = bf16::from_f32(-3.5);
    let mut ob = t.dev.upload(&vec![sentinel; (rows_n - 1) * os + row]).unwrap();
    plan.run_strided(&t.layer, q_len, &qd16, qs, &mut ob, os).unwrap();
    let mut got = vec![bf16::ZERO; ob.len()];
    t.dev.read(&ob, &mut got).unwrap();
    let mut dense = Vec::new();
    for r in 0..rows_n {
        dense.extend(got[r * os..r * os + row].iter().map(|x| x.to_f32()));
        if r + 1 < rows_n {
            assert!(got[r * os + row..(r + 1) * os].iter().all(|&x| x == sentinel), "row {r}: gap written");
        }
    }
    // bf16 output: 2^-8 relative rounding on top of the kernel's error.
    let err = rel_err(&dense, &want16);
    assert!(err < DEVICE_TOL + 4e-3, "f16 strided queries, bf16 strided output: {err}");
    // bf16 queries, dense f32 output.
    let qdb = t.dev.upload(&qb).unwrap();
    let mut o32 = t.dev.alloc::<f32>(q.len()).unwrap();
    plan.run(&t.layer, q_len, &qdb, &mut o32).unwrap();
    let mut g32 = vec![0f32; q.len()];
    t.dev.read(&o32, &mut g32).unwrap();
    let err = rel_err(&g32, &wantb);
    assert!(err < DEVICE_TOL, "bf16 queries: {err}");
    // Bad strides and short buffers are refused before anything is enqueued.
    let before = t.dev.counters().launches;
    assert!(matches!(plan.run_strided(&t.layer, q_len, &qd16, row - 1, &mut ob, os), Err(Error::Shape(_))));
    assert!(matches!(plan.run_strided(&t.layer, q_len, &qd16, qs + 1, &mut ob, os), Err(Error::Shape(_))));
    assert!(matches!(plan.run_strided(&t.layer, q_len, &qd16, qs, &mut ob, os + 1), Err(Error::Shape(_))));
    assert!(matches!(plan.run_strided(&t.layer, q_len, &qd16, usize::MAX / 2, &mut ob, os), Err(Error::Shape(_))));
    assert_eq!(t.dev.counters().launches, before);
}

/// `Device::read_at`: a range of a buffer, an empty read at the end, errors past it and
/// for another device's buffer.
#[test]
fn read_at_reads_a_range_and_refuses_one_past_the_end() {
    let dev = test_device();
    let data: Vec<u32> = (0..100).map(|i| i * 7 + 1).collect();
    let buf = dev.upload(&data).unwrap();
    let mut got = vec![0u32; 10];
    dev.read_at(&buf, 37, &mut got).unwrap();
    assert_eq!(got, data[37..47]);
    dev.read_at(&buf, 100, &mut []).unwrap();
    for at in [91, 101, usize::MAX] {
        assert!(matches!(dev.read_at(&buf, at, &mut got), Err(Error::Shape(_))), "{at}");
    }
    let other = Device::sim().upload(&data).unwrap();
    assert!(matches!(dev.read_at(&other, 0, &mut got), Err(Error::Device(_))));
}

/// Views: `DeviceBuffer::as_slice` / `as_slice_mut` and sub-ranges made with the `unsafe`
/// raw constructors feed the same ops as the buffers (the same bytes and outputs); the
/// raw constructors refuse address 0, a misaligned address and a length past the address
/// space; a view of another device handle is refused by the ops before anything is
/// enqueued.
#[test]
fn device_views_equal_buffers() {
    use rotkv::device::{DeviceSlice, DeviceSliceMut};
    let mut t = Twin::new(2, 4, 2);
    let (a, b) = (t.add(), t.add());
    let dev = t.dev.clone();
    // Sequence a through the buffers, b through views of the tokens 3.. of wider buffers.
    let (n, row) = (70, 2 * D);
    let (k, v) = (rows((n + 3) * row, 11), rows((n + 3) * row, 12));
    let (kb, vb) = (dev.upload(&k[3 * row..]).unwrap(), dev.upload(&v[3 * row..]).unwrap());
    t.layer.append(t.did(a), n, &kb, &vb, row).unwrap();
    let (kw, vw) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let at = |buf: &DeviceBuffer<f32>| buf.as_slice().addr() + (3 * row * 4) as u64;
    // SAFETY: tokens 3 .. n + 3 of the live buffers `kw` and `vw` of `dev`, which outlive
    // the views and are not written.
    let (kv, vv) = unsafe {
        (
            DeviceSlice::<f32>::from_raw(&dev, at(&kw), n * row).unwrap(),
            DeviceSlice::<f32>::from_raw(&dev, at(&vw), n * row).unwrap(),
        )
    };
    assert_eq!((kv.len(), kb.as_slice().len()), (n * row, n * row));
    t.layer.append(t.did(b), n, &kv, &vv, row).unwrap();
    // Both slots hold the same tokens: the same output rows, through buffers and views.
    let mut plan = DecodePlan::new(
        &t.layer,
        PlanShape { max_seqs: 2, max_q_len: 1, max_context: 100, sm_count: None, blocks_per_sm: None, sm_scale: None },
    )
    .unwrap();
    let one = rows(4 * D, 13);
    let q = dev.upload(&[one.clone(), one].concat()).unwrap();
    let mut out = dev.alloc::<f32>(2 * 4 * D).unwrap();
    plan.run(&t.layer, 1, &q.as_slice(), &mut out.as_slice_mut()).unwrap();
    let mut got = vec![0f32; 2 * 4 * D];
    dev.read(&out, &mut got).unwrap();
    assert_eq!(got[..4 * D], got[4 * D..]);
    let mut again = dev.alloc::<f32>(2 * 4 * D).unwrap();
    plan.run(&t.layer, 1, &q, &mut again).unwrap();
    let mut got2 = vec![0f32; 2 * 4 * D];
    dev.read(&again, &mut got2).unwrap();
    assert_eq!(got, got2);
    // The raw constructors' checks.
    let base = q.as_slice().addr();
    // SAFETY: none of these views is made (each is refused) or used.
    unsafe {
        assert!(matches!(DeviceSlice::<f32>::from_raw(&dev, 0, 1), Err(Error::Shape(_))));
        assert!(matches!(DeviceSlice::<f32>::from_raw(&dev, base + 2, 1), Err(Error::Shape(_))));
        assert!(matches!(DeviceSliceMut::<u16>::from_raw(&dev, base + 1, 1), Err(Error::Shape(_))));
        assert!(matches!(DeviceSlice::<f32>::from_raw(&dev, base, usize::MAX / 2), Err(Error::Capacity(_))));
        assert!(matches!(DeviceSliceMut::<f32>::from_raw(&dev, u64::MAX - 7, 4), Err(Error::Capacity(_))));
    }
    // A view made for another device handle (the same memory) is refused by the ops.
    let other = Device::sim();
    // SAFETY: `q` is live, of `2 * 4 * D` f32, and not written; the view is only refused.
    let foreign = unsafe { DeviceSlice::<f32>::from_raw(&other, base, 2 * 4 * D).unwrap() };
    let before = dev.counters();
    assert!(matches!(plan.run(&t.layer, 1, &foreign, &mut out), Err(Error::Device(_))));
    assert!(matches!(t.layer.append(t.did(a), 1, &foreign, &foreign, row), Err(Error::Device(_))));
    assert_eq!(dev.counters(), before);
}

/// A freed sequence's id (also once its slot is taken again), another layer's id and a
/// bare slot are refused with `UnknownSequence`, changing nothing.
#[test]
fn stale_and_foreign_sequence_ids_are_refused() {
    let mut t = Twin::new(1, 4, 2);
    let mut u = Twin::new(1, 4, 2);
    let a = t.add();
    t.append(a, 5, false);
    let old = t.did(a);
    t.free(a);
    assert_eq!(t.add(), a, "the slot is reused");
    let foreign = {
        let s = u.add();
        u.did(s)
    };
    assert_eq!(foreign.slot(), a);
    let (k, v) = (t.dev.upload(&rows(4 * D, 1)).unwrap(), t.dev.upload(&rows(4 * D, 2)).unwrap());
    let before = t.dev.counters();
    for id in [old, foreign, SeqId::from_slot(a)] {
        assert!(matches!(t.layer.append(id, 1, &k, &v, D), Err(Error::UnknownSequence(_))), "{id:?}");
        assert!(matches!(t.layer.len(id), Err(Error::UnknownSequence(_))));
        assert!(matches!(t.layer.protect(id, &[]), Err(Error::UnknownSequence(_))));
        assert!(matches!(t.layer.free_sequence(id), Err(Error::UnknownSequence(_))));
    }
    assert_eq!(t.dev.counters(), before, "nothing was enqueued");
    assert_eq!(t.layer.len(t.did(a)).unwrap(), 0);
    assert_eq!(t.layer.slot_len(a), Some(0));
    assert_eq!(t.layer.slot_len(1), None);
}

/// Protected positions (detected sinks) on the device: protected before they arrive, or
/// after, while still in the f16 window (rows copied on the device); read from their f16
/// rows once their page is quantized. A quantized position is refused.
#[test]
fn protected_positions_match_the_reference() {
    let config = CacheConfig { protected: 4, ..CacheConfig::k2v2(D) };
    let mut t = Twin::with_config(config, 2, 4, 2);
    let s = t.add();
    t.layer.protect(t.did(s), &[10]).unwrap();
    t.host.protect(0, t.hid(s), &[10]).unwrap();
    t.append(s, 40, false);
    let before = t.dev.counters();
    t.layer.protect(t.did(s), &[30, 50]).unwrap();
    let d = delta(before, t.dev.counters());
    // Position 30 is appended: its K and V rows of both heads are copied on the device.
    assert_eq!((d.device_copies, d.uploads, d.downloads, d.launches), (4, 1, 0, 0), "{d:?}");
    t.host.protect(0, t.hid(s), &[30, 50]).unwrap();
    t.append(s, 180, true);
    assert!(matches!(t.layer.protect(t.did(s), &[60]), Err(Error::Value(_))), "position 60 is quantized");
    // A position past the layer's max_tokens can never come: refused, nothing taken.
    assert!(matches!(t.layer.protect(t.did(s), &[256]), Err(Error::Value(_))));
    assert!(matches!(t.layer.protect(t.did(s), &[u32::MAX]), Err(Error::Value(_))));
    assert_eq!(t.host.protected(0, t.hid(s)).unwrap(), &[10, 30, 50]);
    let shape =
        PlanShape { max_seqs: 2, max_q_len: 1, max_context: 256, sm_count: None, blocks_per_sm: None, sm_scale: None };
    let mut plan = DecodePlan::new(&t.layer, shape).unwrap();
    let q = t.queries(2, 1);
    let qd = t.dev.upload(&q).unwrap();
    let mut out = t.dev.alloc::<f32>(q.len()).unwrap();
    plan.run(&t.layer, 1, &qd, &mut out).unwrap();
    let mut got = vec![0f32; q.len()];
    t.dev.read(&out, &mut got).unwrap();
    let err = rel_err(&got, &t.reference(2, 1, &q));
    assert!(err < DEVICE_TOL, "{err}");
}

/// The host packing of the GPU bundle's MMA self-test, checked through the emulator's
/// `mma_m16n8k16` (the same kernel body, fragments as documented): exact.
#[test]
fn mma_selftest_packing_on_the_emulator() {
    use rotkv::launch::{MmaCase, mma_selftest_check, mma_selftest_inputs};
    let cases: Vec<MmaCase> = (0..8).map(MmaCase::new).collect();
    assert!(
        cases[0].b.iter().any(|x| x.to_bits() & 0x7c00 == 0 && x.to_bits() & 0x3ff != 0),
        "the case has f16 subnormals"
    );
    let (a, b, c) = mma_selftest_inputs(&cases);
    let run = |b: &[u32]| {
        let mut d = vec![f32::NAN; c.len()];
        let (ap, bp, cp, dp) = (a.as_ptr() as usize, b.as_ptr() as usize, c.as_ptr() as usize, d.as_mut_ptr() as usize);
        rotkv_kernels::sim::launch([2, 1, 1], 128, 0, |ctx| {
            // SAFETY: 8 warps, each with its 32 lanes' fragments in a, b, c and d.
            unsafe {
                rotkv_kernels::selftest::mma_selftest(
                    ctx,
                    ap as *const u32,
                    bp as *const u32,
                    cp as *const f32,
                    dp as *mut f32,
                )
            }
        })
        .unwrap();
        d
    };
    mma_selftest_check(&cases, &run(&b)).unwrap();
    // A wrong packing is caught: B's rows k and k + 8 swapped in every lane.
    let swapped: Vec<u32> = b.chunks(2).flat_map(|p| [p[1], p[0]]).collect();
    assert!(mma_selftest_check(&cases, &run(&swapped)).is_err());
}

/// The GPU bundle's ldmatrix self-test on the emulator: the kernel body's registers pass
/// the host's check of the PTX ISA layout, and a wrong input does not.
#[test]
fn ldmatrix_selftest_on_the_emulator() {
    use rotkv::launch::{ldmatrix_selftest_check, ldmatrix_selftest_rows};
    use rotkv_kernels::selftest::{LDMATRIX_ROWS, LDMATRIX_WORDS, ldmatrix_selftest};
    let run = |rows: &[u8]| {
        // 16-byte aligned rows, as cp.async needs.
        let mut aligned = vec![0u128; LDMATRIX_ROWS];
        for (a, r) in aligned.iter_mut().zip(rows.chunks(16)) {
            *a = u128::from_le_bytes(r.try_into().unwrap());
        }
        let mut out = vec![0u32; 32 * LDMATRIX_WORDS];
        let (rp, op) = (aligned.as_ptr() as usize, out.as_mut_ptr() as usize);
        rotkv_kernels::sim::launch([1, 1, 1], 32, LDMATRIX_ROWS * 16, |ctx| {
            // SAFETY: 512 aligned bytes of rows, 32 * 12 words of output, one warp with
            // 512 bytes of shared memory.
            unsafe { ldmatrix_selftest(ctx, rp as *const u8, op as *mut u32) }
        })
        .unwrap();
        out
    };
    let rows = ldmatrix_selftest_rows();
    ldmatrix_selftest_check(&run(&rows)).unwrap();
    // Rows 1 and 2 of matrix 0 swapped: caught.
    let mut swapped = rows.clone();
    swapped[16..48].rotate_left(16);
    let e = ldmatrix_selftest_check(&run(&swapped)).unwrap_err().to_string();
    assert!(e.contains("ldmatrix self-test"), "{e}");
}

/// Appends `counts` tokens to a fresh sequence of `strided` with K and V each at its own
/// row stride (`append_strided`), and the same tokens to a fresh sequence of `dense` as
/// contiguous rows at one stride (`append`). `k_fused`: K is a head range of a fused QKV
/// row (`[t][HQ + 2 hkv][D]`, K's heads after the `HQ` query heads) and V contiguous;
/// otherwise K is contiguous and V the fused row's last heads.
fn strided_against_contiguous<T: rotkv::KvElement>(
    strided: &mut DeviceLayer,
    dense: &mut DeviceLayer,
    counts: &[usize],
    k_fused: bool,
    seed: u64,
    conv: fn(f32) -> T,
) {
    let dev = strided.device().clone();
    let hkv = strided.shape().num_kv_heads;
    let (hq, row) = (strided.shape().num_q_heads, hkv * D);
    let fused_row = (hq + 2 * hkv) * D;
    let (a, b) = (strided.add_sequence().unwrap(), dense.add_sequence().unwrap());
    for (i, &n) in counts.iter().enumerate() {
        let seed = seed + 10 * i as u64;
        let fused: Vec<T> = rows(n * fused_row, seed).into_iter().map(conv).collect();
        let other: Vec<T> = rows(n * row, seed + 1).into_iter().map(conv).collect();
        // The fused input's K (heads hq..hq + hkv) or V (the last hkv heads): the buffer
        // starts at that head range of token 0 and keeps the fused row stride.
        let at = if k_fused { hq * D } else { (hq + hkv) * D };
        let fused_part = dev.upload(&fused[at..]).unwrap();
        let contiguous = dev.upload(&other).unwrap();
        // The same tokens as dense rows.
        let dense_part: Vec<T> = (0..n).flat_map(|t| fused[at + t * fused_row..][..row].to_vec()).collect();
        let dense_part = dev.upload(&dense_part).unwrap();
        let len = if k_fused {
            strided.append_strided(a, n, &fused_part, fused_row, &contiguous, row).unwrap();
            dense.append(b, n, &dense_part, &contiguous, row).unwrap()
        } else {
            strided.append_strided(a, n, &contiguous, row, &fused_part, fused_row).unwrap();
            dense.append(b, n, &contiguous, &dense_part, row).unwrap()
        };
        assert_eq!(strided.len(a).unwrap(), len);
    }
}

/// K and V at different row strides (`DeviceLayer::append_strided`: K inside a wider
/// fused QKV row with V contiguous, and the other way round; f32 and f16) store exactly
/// the bytes of the same tokens appended contiguously: the pool and every side store are
/// equal byte for byte, after appends of 1 token, 37 tokens, up to one past the first
/// page boundary (a page quantized from window rows and new rows at once) and one
/// more, and after one append of 197 tokens (one past the page boundary) at once.
#[test]
fn k_and_v_at_their_own_row_strides_equal_contiguous_appends() {
    let dev = test_device();
    let (hkv, hq) = (2, 4);
    let config = CacheConfig::k2v2(D);
    let fmt = config.format().unwrap();
    // The first page is quantized when the sequence reaches sinks + window + page + 1.
    let boundary = (fmt.sinks + fmt.window + fmt.page_size) as usize;
    assert_eq!(boundary, 196);
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let size = LayerSize { max_seqs: 4, max_tokens: 256, num_blocks: None };
    let new = || DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, D), size).unwrap();
    let (mut strided, mut dense) = (new(), new());
    let stepwise = [1, 37, boundary + 1 - 38, 1];
    strided_against_contiguous(&mut strided, &mut dense, &stepwise, true, 100, |x| x);
    strided_against_contiguous(&mut strided, &mut dense, &stepwise, false, 200, f16::from_f32);
    strided_against_contiguous(&mut strided, &mut dense, &[boundary + 1], true, 300, f16::from_f32);
    strided_against_contiguous(&mut strided, &mut dense, &[boundary + 1, 2], false, 400, |x| x);
    let (pool, sides) = strided.read_cache().unwrap();
    let (want_pool, want_sides) = dense.read_cache().unwrap();
    // Every sequence quantized its one page (max_tokens 256 gives each slot one block):
    // the pools hold real codes.
    assert_eq!((strided.free_blocks(), dense.free_blocks()), (0, 0));
    assert!(pool.iter().any(|&b| b != 0));
    let differ = pool.iter().zip(&want_pool).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} pool bytes differ");
    assert!(sides.iter().zip(&want_sides).all(|(a, b)| a.to_bits() == b.to_bits()), "side stores differ");
}

/// `append_strided` checks K's and V's strides and sizes each on its own: a V too short
/// for its own stride (K fine at another), a V stride below a row or past u32, and a K
/// stride below a row are `Error::Shape`s naming the input, enqueue nothing and change
/// nothing (length, blocks, stored bytes); the same V at a stride it fits works.
#[test]
fn append_strided_checks_each_input_and_changes_nothing_on_error() {
    let mut t = Twin::new(2, 4, 2);
    let s = t.add();
    t.append(s, 70, false);
    let dev = t.dev.clone();
    let row = 2 * D;
    let n = 5;
    let k = dev.upload(&rows(n * 3 * row, 1)).unwrap();
    // Room for 5 rows at stride `row`, not at `2 * row`.
    let v = dev.upload(&rows(n * row, 2)).unwrap();
    let names = |e: &Error, what: &str| matches!(e, Error::Shape(m) if m.starts_with(what));
    let (len, free, (pool, sides)) =
        (t.layer.len(t.did(s)).unwrap(), t.layer.free_blocks(), t.layer.read_cache().unwrap());
    let cases: [(&str, usize, usize, &str); 4] = [
        ("v too short for its stride", 3 * row, 2 * row, "v has"),
        ("v stride below a row", 3 * row, row - 1, "v: row stride"),
        ("v stride past u32", 3 * row, u32::MAX as usize + 1, "v: row stride"),
        ("k stride below a row", row - D, row, "k: row stride"),
    ];
    let before = dev.counters();
    for (what, ks, vs, msg) in cases {
        let e = t.layer.append_strided(t.did(s), n, &k, ks, &v, vs).unwrap_err();
        assert!(names(&e, msg), "{what}: {e}");
    }
    assert_eq!(dev.counters(), before, "an error enqueued work");
    assert_eq!((t.layer.len(t.did(s)).unwrap(), t.layer.free_blocks()), (len, free));
    let (pool2, sides2) = t.layer.read_cache().unwrap();
    assert!(pool2 == pool && sides2.iter().zip(&sides).all(|(a, b)| a.to_bits() == b.to_bits()), "bytes changed");
    // The same buffers at strides they fit: appended (K every third row, V dense).
    assert_eq!(t.layer.append_strided(t.did(s), n, &k, 3 * row, &v, row).unwrap(), 75);
}

/// The raw entry points refuse a pool or side-store base that is not 16-byte aligned
/// (the kernels read both with 16-byte loads and `cp.async`) with `Error::Shape`, before
/// anything is enqueued.
#[test]
fn raw_entry_points_refuse_misaligned_pool_and_side_stores() {
    use rotkv::device::raw;
    use rotkv::launch::{AppendPtrs, DecodePtrs, FlushPtrs};
    use rotkv_kernels::params::{AppendParams, DTYPE_F32, DecodeParams};
    let dev = Device::sim();
    let fmt = CacheConfig::k2v2(128).format().unwrap();
    let dp = DecodeParams {
        format: fmt,
        num_seqs: 1,
        num_q_heads: 4,
        num_kv_heads: 1,
        num_splits: 1,
        block_table_stride: 1,
        flags: 0,
        sm_scale: 0.125,
        q_seq_stride: 4 * 128,
        q_token_stride: 4 * 128,
        q_dtype: DTYPE_F32,
        num_blocks: 1,
        max_len: 1,
        q_len: 1,
        attn_window: 0,
        batch_rows: 0,
        batch_seqs: 0,
    };
    let ap = AppendParams {
        format: fmt,
        num_kv_heads: 1,
        start: 0,
        count: 1,
        new_len: 1,
        num_blocks: 1,
        flags: 0,
        token_stride: 128,
        v_token_stride: 128,
        head_stride: 128,
        input_dtype: DTYPE_F32,
    };
    let before = dev.counters();
    for (pool, side) in [(8u64, 16u64), (16, 4)] {
        let dptrs = DecodePtrs {
            q: 16,
            pool,
            tables: 16,
            lens: 16,
            sides: side,
            protected: 16,
            key_scale: 16,
            key_perm: 16,
            key_rot: 16,
            m: 16,
            l: 16,
            o: 16,
            meta: 0,
        };
        let fptrs = FlushPtrs { block_table: 16, side, pool };
        let aptrs = AppendPtrs {
            k: 16,
            v: 16,
            block_table: 16,
            protected: 16,
            side,
            pool,
            key_mean: 16,
            key_scale: 16,
            key_perm: 16,
            value_perm: 16,
            key_rot: 16,
            value_rot: 16,
            seq_len: 0,
        };
        // SAFETY: every call is refused for its misaligned base before any address is
        // used.
        unsafe {
            assert!(matches!(raw::decode(&dev, &dp, &dptrs), Err(Error::Shape(_))), "{pool} {side}");
            assert!(matches!(raw::append_flush(&dev, &ap, &fptrs), Err(Error::Shape(_))), "{pool} {side}");
            assert!(matches!(raw::append_tokens(&dev, &ap, &aptrs), Err(Error::Shape(_))), "{pool} {side}");
        }
    }
    assert_eq!(dev.counters(), before);
}
