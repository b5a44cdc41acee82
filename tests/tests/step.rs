//! A whole serving step on the device (`rotkv::device`), on the emulated device (and on
//! GPU 0 with `ROTKV_TEST_DEVICE=cuda`, as the GPU bundle runs it): the
//! batched append against per-sequence appends (bit for bit), one plan shared by every
//! layer, the step's launch list fixed across steps, and what the host and the device
//! refuse.

use rotkv::device::{BatchErrors, DecodePlan, Device, DeviceBuffer, DeviceLayer, LayerSize, PlanShape, StepBatch};
use rotkv::paged::LayerShape;
use rotkv::{Backend, CacheConfig, CacheShape, Error, KvCache, LayerCalibration, SeqId, f16};

use rotkv_tests::uniform as rows;

/// The device these tests run on: the emulated device, or with `ROTKV_TEST_DEVICE=cuda`
/// (the GPU bundle's second run of this binary) a new stream on GPU 0.
fn test_device() -> Device {
    if std::env::var("ROTKV_TEST_DEVICE").as_deref() == Ok("cuda") {
        let ctx = rotkv::cuda::cudarc::driver::CudaContext::new(0).expect("ROTKV_TEST_DEVICE=cuda needs GPU 0");
        return Device::cuda(ctx.new_stream().expect("a stream")).expect("the device API on GPU 0");
    }
    Device::sim()
}

/// A small random generator for the schedules (xorshift).
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Small pages and window so that a few dozen tokens cross page flushes.
fn small(config: CacheConfig) -> CacheConfig {
    CacheConfig { page_size: 16, window: 16, sinks: 2, ..config }
}

/// The batched append writes the same bytes as one append per sequence: pool, side
/// stores (sinks, window ring, protected copies) and lengths, over random steps with
/// arrivals, chunks that cross page flushes and several pages at once, single-token
/// steps, idle sequences and finishes; head_dim 64, 128 and 256; k2v2, k4v2 and k4v4;
/// f32 and f16 inputs at a padded row stride.
#[test]
fn batched_append_equals_per_sequence_appends() {
    let cases = [
        (CacheConfig { protected: 2, ..small(CacheConfig::k2v2(64)) }, false, 11),
        (small(CacheConfig::k4v2(128)), true, 12),
        (small(CacheConfig::k4v4(256)), false, 13),
    ];
    for (config, half, seed) in cases {
        let d = config.head_dim;
        let (hkv, slots, max_rows, max_tokens) = (2, 4, 48, 160);
        let dev = test_device();
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: 2 * hkv };
        let size = LayerSize { max_seqs: slots, max_tokens, num_blocks: None };
        let calib = LayerCalibration::identity(hkv, d);
        let mut batched = DeviceLayer::new(&dev, config, shape, calib.clone(), size).unwrap();
        let mut single = DeviceLayer::new(&dev, config, shape, calib, size).unwrap();
        let mut batch = StepBatch::new(&dev, slots, max_rows).unwrap();
        let stride = hkv * d + 8;
        let mut rng = Rng(seed);
        let mut ids: Vec<Option<(SeqId, SeqId)>> = vec![None; slots];
        for step in 0..14u64 {
            // Finishes and arrivals.
            for id in ids.iter_mut() {
                if let Some((a, b)) = *id
                    && (batched.len(a).unwrap() + max_rows > max_tokens || rng.below(8) == 0)
                {
                    batched.free_sequence(a).unwrap();
                    single.free_sequence(b).unwrap();
                    *id = None;
                }
            }
            while ids.iter().any(Option::is_none) && rng.below(2) == 0 {
                let (a, b) = (batched.add_sequence().unwrap(), single.add_sequence().unwrap());
                assert_eq!(a.slot(), b.slot());
                if config.protected > 0 {
                    batched.protect(a, &[5, 30]).unwrap();
                    single.protect(b, &[5, 30]).unwrap();
                }
                ids[a.slot()] = Some((a, b));
            }
            // This step's tokens: a prompt chunk, one token, or none, within max_rows.
            let mut steps = Vec::new();
            let mut left = max_rows;
            for (a, b) in ids.iter().flatten().copied() {
                let n = match rng.below(4) {
                    0 => 0,
                    1 => 1 + rng.below(left.min(40)),
                    _ => 1,
                }
                .min(left);
                left -= n;
                let len = batched.len(a).unwrap();
                // Both layers take the same blocks, in the same order.
                batched.reserve(a, len + n).unwrap();
                single.reserve(b, len + n).unwrap();
                steps.push((a, b, n));
            }
            let kh = rows(max_rows * stride, 100 + step);
            let vh = rows(max_rows * stride, 200 + step);
            batch.set(&batched, &steps.iter().map(|&(a, _, n)| (a, n)).collect::<Vec<_>>()).unwrap();
            if half {
                let k = dev.upload(&kh.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()).unwrap();
                let v = dev.upload(&vh.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()).unwrap();
                let before = dev.counters();
                batched.append_batch(&batch, &k, stride, &v, stride).unwrap();
                let after = dev.counters();
                assert_eq!(after.launches - before.launches, 2);
                assert_eq!(after.uploads + after.allocations, before.uploads + before.allocations);
                for &(a, b, n) in &steps {
                    let r = batch.first_row(a.slot()).unwrap_or(0);
                    let (ks, vs) = (k.slice(r * stride..).unwrap(), v.slice(r * stride..).unwrap());
                    single.append(b, n, &ks, &vs, stride).unwrap();
                }
            } else {
                let (k, v) = (dev.upload(&kh).unwrap(), dev.upload(&vh).unwrap());
                let before = dev.counters();
                batched.append_batch(&batch, &k, stride, &v, stride).unwrap();
                let after = dev.counters();
                assert_eq!(after.launches - before.launches, 2);
                assert_eq!(after.uploads + after.allocations, before.uploads + before.allocations);
                for &(a, b, n) in &steps {
                    let r = batch.first_row(a.slot()).unwrap_or(0);
                    let (ks, vs) = (k.slice(r * stride..).unwrap(), v.slice(r * stride..).unwrap());
                    single.append(b, n, &ks, &vs, stride).unwrap();
                }
            }
            for &(a, b, _) in &steps {
                assert_eq!(batched.len(a).unwrap(), single.len(b).unwrap());
            }
            assert_eq!(batched.read_cache().unwrap(), single.read_cache().unwrap(), "{config:?} step {step}");
        }
        assert_eq!(batch.errors().unwrap(), BatchErrors::default());
        // The lengths the kernels keep on the device drive decode: both layers decode alike.
        let lens: Vec<usize> = (0..slots).map(|s| batched.slot_len(s).unwrap_or(0)).collect();
        assert!(lens.iter().any(|&l| l > 40), "the schedule grew a sequence past a few pages: {lens:?}");
    }
}

/// A model of several layers runs a step as one fixed launch list: the batched append
/// and the decode of every layer through one shared plan. Steps 2..N enqueue exactly
/// the launch list of step 1 (kernels, grids, parameters, addresses) across arrivals,
/// finishes, page flushes and sequences that take no token, with no allocation,
/// download or synchronization (the only upload is the step batch and the step's own
/// K/V/Q, which a stack writes into the same buffers), and every layer's output equals
/// the CPU backend's `KvCache` fed the same tokens.
#[test]
fn whole_model_step_is_one_fixed_launch_list() {
    let (d, hkv, hq, layers, slots, max_rows, max_tokens) = (64, 1, 3, 3, 3, 48, 200);
    let config = small(CacheConfig::k2v2(d));
    let dev = test_device();
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let size = LayerSize { max_seqs: slots, max_tokens, num_blocks: None };
    let mut model: Vec<DeviceLayer> = (0..layers)
        .map(|_| DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap())
        .collect();
    let cs = CacheShape { layers, num_kv_heads: hkv, num_q_heads: hq, max_seqs: slots, max_tokens, num_blocks: None };
    let mut host = KvCache::new(config, cs, Backend::Cpu).unwrap();
    let plan_shape = PlanShape {
        max_seqs: slots,
        max_q_len: 1,
        max_context: max_tokens,
        sm_count: None,
        blocks_per_sm: None,
        sm_scale: None,
    };
    let mut plan = DecodePlan::new(&model[0], plan_shape).unwrap();
    let mut batch = StepBatch::new(&dev, slots, max_rows).unwrap();
    let row = hkv * d;
    let qrow = hq * d;
    // The step's buffers, allocated once: K/V rows of every layer, queries, outputs.
    let mut k: Vec<DeviceBuffer<f32>> = (0..layers).map(|_| dev.alloc(max_rows * row).unwrap()).collect();
    let mut v: Vec<DeviceBuffer<f32>> = (0..layers).map(|_| dev.alloc(max_rows * row).unwrap()).collect();
    let mut q: Vec<DeviceBuffer<f32>> = (0..layers).map(|_| dev.alloc(slots * qrow).unwrap()).collect();
    let mut out: Vec<DeviceBuffer<f32>> = (0..layers).map(|_| dev.alloc(slots * qrow).unwrap()).collect();
    dev.record_launches(true);
    let mut first: Option<Vec<rotkv::device::LaunchRecord>> = None;
    let mut ids: Vec<Option<(Vec<SeqId>, SeqId)>> = vec![None; slots];
    // Arrivals (step, prompt tokens) and finishes (step, slot): the slots are reused.
    let arrivals = [(0usize, 30usize), (0, 3), (2, 40), (6, 9), (10, 1)];
    let finishes = [(5usize, 1usize), (9, 0)];
    for step in 0..12usize {
        for &(_, slot) in finishes.iter().filter(|f| f.0 == step) {
            let (dids, hid) = ids[slot].take().expect("a live slot");
            for (l, id) in model.iter_mut().zip(dids) {
                l.free_sequence(id).unwrap();
            }
            host.free_sequence(hid).unwrap();
        }
        // Arrivals reserve their whole life (prompt + 16 generated) on admission.
        let mut prompts = vec![0usize; slots];
        for &(_, prompt) in arrivals.iter().filter(|a| a.0 == step) {
            let dids: Vec<SeqId> = model.iter_mut().map(|l| l.add_sequence().unwrap()).collect();
            let hid = host.add_sequence().unwrap();
            let slot = dids[0].slot();
            assert!(dids.iter().all(|x| x.slot() == slot) && hid.slot() == slot);
            for (l, id) in model.iter_mut().zip(&dids) {
                l.reserve(*id, prompt + 16).unwrap();
            }
            prompts[slot] = prompt;
            ids[slot] = Some((dids, hid));
        }
        // Who takes tokens: new prompts all at once, others one token, slot 2 idles on
        // odd steps.
        let mut steps: Vec<(usize, usize)> = Vec::new();
        for (slot, e) in ids.iter().enumerate() {
            if e.is_some() {
                let n = if prompts[slot] > 0 {
                    prompts[slot]
                } else if slot == 2 && step % 2 == 1 {
                    0
                } else {
                    1
                };
                steps.push((slot, n));
            }
        }
        let dids0: Vec<(SeqId, usize)> = steps.iter().map(|&(s, n)| (ids[s].as_ref().unwrap().0[0], n)).collect();
        batch.set(&model[0], &dids0).unwrap();
        // The step's inputs (a stack writes its projections into the same buffers).
        let total: usize = steps.iter().map(|s| s.1).sum();
        let mut want = Vec::new();
        for l in 0..layers {
            let seed = (step * 10 + l) as u64;
            let (kh, vh) = (rows(max_rows * row, seed), rows(max_rows * row, seed + 500));
            let qh = rows(slots * qrow, seed + 900);
            dev.write(&mut k[l], 0, &kh).unwrap();
            dev.write(&mut v[l], 0, &vh).unwrap();
            dev.write(&mut q[l], 0, &qh).unwrap();
            // The CPU backend, fed the same rows.
            let mut r = 0;
            for &(slot, n) in &steps {
                let hid = ids[slot].as_ref().unwrap().1;
                host.append(l, hid, n, &kh[r * row..(r + n) * row], &vh[r * row..(r + n) * row]).unwrap();
                r += n;
            }
            assert_eq!(r, total);
            let mut w = vec![0f32; slots * qrow];
            for slot in 0..slots {
                if let Some((_, hid)) = &ids[slot] {
                    let out = &mut w[slot * qrow..(slot + 1) * qrow];
                    host.decode(l, &[*hid], &qh[slot * qrow..(slot + 1) * qrow], out).unwrap();
                }
            }
            want.push(w);
        }
        // The step: append and decode, every layer; nothing else is enqueued.
        let before = dev.counters();
        for l in 0..layers {
            model[l].append_batch(&batch, &k[l], row, &v[l], row).unwrap();
            plan.run(&model[l], 1, &q[l], &mut out[l]).unwrap();
        }
        let c = dev.counters();
        assert_eq!(c.launches - before.launches, 4 * layers, "step {step}");
        assert_eq!(
            (c.allocations, c.uploads, c.downloads, c.synchronizations),
            (before.allocations, before.uploads, before.downloads, before.synchronizations),
            "step {step}"
        );
        let list = dev.take_launches();
        let step_list = list[list.len() - 4 * layers..].to_vec();
        match &first {
            None => first = Some(step_list),
            Some(f) => assert_eq!(f, &step_list, "step {step} enqueued another launch list"),
        }
        for l in 0..layers {
            let mut got = vec![0f32; slots * qrow];
            dev.read(&out[l], &mut got).unwrap();
            for slot in 0..slots {
                let (g, w) = (&got[slot * qrow..(slot + 1) * qrow], &want[l][slot * qrow..(slot + 1) * qrow]);
                if ids[slot].is_none() {
                    assert!(g.iter().all(|&x| x == 0.0), "a free slot's rows are zero");
                } else {
                    let e = rel_err(g, w);
                    assert!(e < 3e-3, "step {step} layer {l} slot {slot}: {e}");
                }
            }
        }
    }
    assert_eq!(batch.errors().unwrap(), BatchErrors::default());
    let _ = &mut q;
}

/// What the host can see is an error before anything is enqueued, and changes nothing:
/// a batch from before the last step, a sequence without reserved blocks, K/V shorter
/// than the batch's rows, a buffer or batch of another device, a slot named twice or
/// past the batch, too many rows, a plan for a layer of another format.
#[test]
fn step_refusals_enqueue_nothing() {
    let (d, hkv) = (64, 1);
    let config = small(CacheConfig::k2v2(d));
    let dev = test_device();
    let other = Device::sim();
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: 2 };
    let size = LayerSize { max_seqs: 2, max_tokens: 100, num_blocks: None };
    let mut layer = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap();
    let a = layer.add_sequence().unwrap();
    let mut batch = StepBatch::new(&dev, 2, 8).unwrap();
    let k = dev.upload(&rows(8 * d, 1)).unwrap();
    let v = dev.upload(&rows(8 * d, 2)).unwrap();
    // Batch construction.
    assert!(matches!(batch.set_slots(&[(0, 0, 5), (0, 0, 1)]), Err(Error::Shape(_))));
    assert!(matches!(batch.set_slots(&[(2, 0, 1)]), Err(Error::Shape(_))));
    assert!(matches!(batch.set_slots(&[(0, 0, 5), (1, 0, 4)]), Err(Error::Capacity(_))));
    assert!(matches!(StepBatch::new(&dev, 0, 8), Err(Error::Shape(_))));
    assert!(matches!(StepBatch::new(&dev, 2, 70_000), Err(Error::Capacity(_))));
    assert_eq!(batch.rows(), 0, "a refused set changes nothing");
    batch.set(&layer, &[(a, 5)]).unwrap();
    // Five tokens need no block (2 sinks and a 16-token window hold them).
    let before = dev.counters();
    let short = dev.upload(&rows(7 * d, 3)).unwrap();
    assert!(matches!(layer.append_batch(&batch, &short, d, &v, d), Err(Error::Shape(_))));
    assert!(matches!(layer.append_batch(&batch, &k, d - 1, &v, d), Err(Error::Shape(_))));
    let k_other = other.upload(&rows(8 * d, 4)).unwrap();
    assert!(matches!(layer.append_batch(&batch, &k_other, d, &v, d), Err(Error::Device(_))));
    let foreign = StepBatch::new(&other, 2, 8).unwrap();
    assert!(matches!(layer.append_batch(&foreign, &k, d, &v, d), Err(Error::Device(_))));
    assert_eq!(dev.counters().launches, before.launches);
    layer.append_batch(&batch, &k, d, &v, d).unwrap();
    assert_eq!(layer.len(a).unwrap(), 5);
    // The same batch again: its start (0) is no longer the sequence's length.
    let cache = layer.read_cache().unwrap();
    let before = dev.counters();
    assert!(matches!(layer.append_batch(&batch, &k, d, &v, d), Err(Error::Shape(_))));
    assert!(matches!(layer.advance(&batch), Err(Error::Shape(_))));
    assert_eq!(dev.counters().launches, before.launches);
    assert_eq!(layer.read_cache().unwrap(), cache);
    // Up to 29 tokens no page is needed; 37 tokens need the first (the quantized length
    // is 16 once a sequence holds 2 + 16 + 16 tokens): refused until it is reserved.
    for _ in 0..3 {
        batch.set(&layer, &[(a, 8)]).unwrap();
        layer.append_batch(&batch, &k, d, &v, d).unwrap();
    }
    assert_eq!(layer.len(a).unwrap(), 29);
    batch.set(&layer, &[(a, 8)]).unwrap();
    let before = dev.counters();
    assert!(matches!(layer.append_batch(&batch, &k, d, &v, d), Err(Error::Capacity(_))));
    assert_eq!(dev.counters().launches, before.launches);
    assert_eq!(layer.len(a).unwrap(), 29);
    layer.reserve(a, 37).unwrap();
    assert!(layer.reserved(a).unwrap() >= 37);
    layer.append_batch(&batch, &k, d, &v, d).unwrap();
    assert_eq!(layer.len(a).unwrap(), 37);
    // A freed slot named by a batch set earlier.
    batch.set(&layer, &[(a, 1)]).unwrap();
    layer.free_sequence(a).unwrap();
    assert!(matches!(layer.append_batch(&batch, &k, d, &v, d), Err(Error::UnknownSequence(0))));
    // Reserving past max_tokens or the pool.
    let b = layer.add_sequence().unwrap();
    assert!(matches!(layer.reserve(b, 101), Err(Error::Capacity(_))));
    // A plan is shared by layers of the same format and heads, refused for others.
    let plan_shape =
        PlanShape { max_seqs: 2, max_q_len: 1, max_context: 100, sm_count: None, blocks_per_sm: None, sm_scale: None };
    let plan = DecodePlan::new(&layer, plan_shape).unwrap();
    let twin = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap();
    let k4 =
        DeviceLayer::new(&dev, small(CacheConfig::k4v2(d)), shape, LayerCalibration::identity(hkv, d), size).unwrap();
    let fewer =
        DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), LayerSize { max_seqs: 1, ..size })
            .unwrap();
    let q = dev.alloc::<f32>(2 * 2 * d).unwrap();
    let mut out = dev.alloc::<f32>(2 * 2 * d).unwrap();
    let mut plan = plan;
    plan.run(&twin, 1, &q, &mut out).unwrap();
    assert!(matches!(plan.run(&k4, 1, &q, &mut out), Err(Error::Shape(_))));
    assert!(matches!(plan.run(&fewer, 1, &q, &mut out), Err(Error::Capacity(_))));
    assert!(matches!(plan.run(&layer, 2, &q, &mut out), Err(Error::Shape(_))));
    let far = other.alloc::<f32>(2 * 2 * d).unwrap();
    assert!(matches!(plan.run(&layer, 1, &far, &mut out), Err(Error::Device(_))));
    // Larger buffers than the step needs are fine.
    let big = dev.alloc::<f32>(3 * 2 * d).unwrap();
    let mut big_out = dev.alloc::<f32>(3 * 2 * d).unwrap();
    plan.run(&layer, 1, &big, &mut big_out).unwrap();
    // Zero-token appends check their buffers like any other.
    assert!(matches!(layer.append(b, 0, &k_other, &v, d), Err(Error::Device(_))));
    assert!(matches!(layer.append(b, 0, &k, &v, d - 1), Err(Error::Shape(_))));
    assert_eq!(layer.append(b, 0, &k, &v, d).unwrap(), 0);
}

/// Sub-slices of device buffers are checked: inside the buffer, or [`Error::Shape`].
#[test]
fn device_buffer_slices_are_checked() {
    let dev = Device::sim();
    let mut b = dev.upload(&[1u32, 2, 3, 4, 5]).unwrap();
    let s = b.slice(1..4).unwrap();
    assert_eq!((s.len(), s.addr()), (3, b.addr() + 4));
    assert_eq!(s.slice(2..).unwrap().len(), 1);
    assert!(s.slice(2..5).is_err());
    assert_eq!(b.slice(..=4).unwrap().len(), 5);
    let (hi, lo) = (3, 2);
    assert!(matches!(b.slice(hi..lo), Err(Error::Shape(_))));
    assert!(matches!(b.slice(..6), Err(Error::Shape(_))));
    assert!(matches!(b.slice(..=usize::MAX), Err(Error::Shape(_))));
    let mut m = b.slice_mut(4..).unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m.slice_mut(1..).unwrap().len(), 0);
    assert!(m.slice_mut(0..2).is_err());
}

/// One layer on the device beside the CPU backend, stepped through a schedule of new
/// tokens per slot: the step tests' fixture. `passes`: `run_step` in that many passes of
/// `CacheConfig::pass_rows` rows (against the CPU backend's `append_decode`), else
/// `append_batch` then `run_batch` (against `append` then `decode_tokens`).
struct StepRig {
    config: CacheConfig,
    dev: Device,
    layer: DeviceLayer,
    host: KvCache,
    plan: DecodePlan,
    batch: StepBatch,
    k: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
    q: DeviceBuffer<f32>,
    out: DeviceBuffer<f32>,
    ids: Vec<Option<(SeqId, SeqId)>>,
    passes: Option<usize>,
    first: Option<Vec<rotkv::device::LaunchRecord>>,
}

impl StepRig {
    const HKV: usize = 2;
    const HQ: usize = 6;
    const SLOTS: usize = 3;
    const MAX_TOKENS: usize = 200;

    fn new(config: CacheConfig, max_q_len: usize, max_rows: usize, passes: Option<usize>) -> Self {
        let (d, hkv, hq, slots, max_tokens) = (config.head_dim, Self::HKV, Self::HQ, Self::SLOTS, Self::MAX_TOKENS);
        let dev = test_device();
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
        let size = LayerSize { max_seqs: slots, max_tokens, num_blocks: None };
        let layer = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap();
        let cs =
            CacheShape { layers: 1, num_kv_heads: hkv, num_q_heads: hq, max_seqs: slots, max_tokens, num_blocks: None };
        let ps = PlanShape {
            max_seqs: slots,
            max_q_len,
            max_context: max_tokens,
            sm_count: None,
            blocks_per_sm: None,
            sm_scale: None,
        };
        let batch = match passes {
            Some(n) => StepBatch::with_passes(&dev, slots, max_rows, config.pass_rows(), n).unwrap(),
            None => StepBatch::new(&dev, slots, max_rows).unwrap(),
        };
        let (row, qrow) = (hkv * d, hq * d);
        dev.record_launches(true);
        Self {
            plan: DecodePlan::new(&layer, ps).unwrap(),
            host: KvCache::new(config, cs, Backend::Cpu).unwrap(),
            k: dev.alloc(max_rows * row).unwrap(),
            v: dev.alloc(max_rows * row).unwrap(),
            q: dev.alloc(max_rows * qrow).unwrap(),
            out: dev.alloc(max_rows * qrow).unwrap(),
            ids: vec![None; slots],
            first: None,
            config,
            dev,
            layer,
            batch,
            passes,
        }
    }

    /// One step: `counts[slot]` new tokens (0: idle; a slot arrives at its first nonzero
    /// count), random inputs from `seed`; asserts the launch list, no allocation or copy,
    /// each sequence's rows against the CPU backend and zeros elsewhere.
    fn step(&mut self, counts: &[usize], seed: u64) {
        let (d, max_rows) = (self.config.head_dim, self.batch.max_rows());
        let (row, qrow) = (Self::HKV * d, Self::HQ * d);
        let mut steps = Vec::new();
        for (slot, &n) in counts.iter().enumerate() {
            if self.ids[slot].is_none() && n > 0 {
                let (a, b) = (self.layer.add_sequence().unwrap(), self.host.add_sequence().unwrap());
                assert_eq!((a.slot(), b.slot()), (slot, slot));
                self.layer.reserve(a, Self::MAX_TOKENS).unwrap();
                self.ids[slot] = Some((a, b));
            }
            if let Some((a, b)) = self.ids[slot] {
                steps.push((a, b, n));
            }
        }
        self.batch.set(&self.layer, &steps.iter().map(|&(a, _, n)| (a, n)).collect::<Vec<_>>()).unwrap();
        let (kh, vh, qh) =
            (rows(max_rows * row, seed), rows(max_rows * row, seed + 1), rows(max_rows * qrow, seed + 2));
        self.dev.write(&mut self.k, 0, &kh).unwrap();
        self.dev.write(&mut self.v, 0, &vh).unwrap();
        self.dev.write(&mut self.q, 0, &qh).unwrap();
        // Stale rows from the last step must not leak into rows without a token.
        self.dev.write(&mut self.out, 0, &vec![9.0f32; max_rows * qrow]).unwrap();
        self.dev.take_launches();
        let before = self.dev.counters();
        let launches = match self.passes {
            Some(n) => {
                let (k, v) = ((&self.k, row), (&self.v, row));
                self.plan.run_step(&mut self.layer, &self.batch, k, v, &self.q, qrow, &mut self.out, qrow).unwrap();
                3 * n + 1
            }
            None => {
                self.layer.append_batch(&self.batch, &self.k, row, &self.v, row).unwrap();
                self.plan.run_batch(&self.layer, &self.batch, &self.q, qrow, &mut self.out, qrow).unwrap();
                4
            }
        };
        let c = self.dev.counters();
        assert_eq!(
            (c.launches - before.launches, c.uploads, c.allocations, c.downloads),
            (launches, before.uploads, before.allocations, before.downloads)
        );
        let list = self.dev.take_launches();
        match &self.first {
            None => self.first = Some(list),
            Some(f) => assert_eq!(f, &list, "{:?} seed {seed}: another launch list", self.config),
        }
        let mut got = vec![0f32; max_rows * qrow];
        self.dev.read(&self.out, &mut got).unwrap();
        let mut r = 0;
        for &(a, b, n) in &steps {
            let (kr, vr, qr) =
                (&kh[r * row..(r + n) * row], &vh[r * row..(r + n) * row], &qh[r * qrow..(r + n) * qrow]);
            let mut want = vec![0f32; n * qrow];
            match self.passes {
                Some(_) if n > 0 => {
                    let pass = self.config.pass_rows();
                    self.host.append_decode(0, &[b], n, pass, (kr, vr), qr, &mut want).unwrap();
                }
                _ => {
                    self.host.append(0, b, n, kr, vr).unwrap();
                    if n > 0 {
                        self.host.decode_tokens(0, &[b], n, qr, &mut want).unwrap();
                    }
                }
            }
            assert_eq!(self.layer.len(a).unwrap(), self.host.len(0, b).unwrap());
            if n > 0 {
                let e = rel_err(&got[r * qrow..(r + n) * qrow], &want);
                assert!(e < 3e-3, "{:?} seed {seed} slot {}: {n} rows, error {e}", self.config, b.slot());
            }
            r += n;
        }
        assert!(got[r * qrow..].iter().all(|&x| x == 0.0), "rows without a token are zero");
    }
}

/// The fixture's configurations: the tensor-core kernel (d64 k2v2, d128 k4v2) and the
/// CUDA-core kernel (groups of 32), with small pages and window.
fn step_configs() -> [CacheConfig; 3] {
    [
        small(CacheConfig::k2v2(64)),
        small(CacheConfig::k4v2(128)),
        CacheConfig { group_size: 32, ..small(CacheConfig::k2v2(64)) },
    ]
}

/// One step mixes prefill chunks, single tokens, speculative rows and idle sequences:
/// [`DecodePlan::run_batch`] decodes exactly the rows the batch appended, each sequence
/// its own count (causal within the step, the rest from the packed pages, sinks and f16
/// window), in the same two launches every step; each sequence's rows equal the CPU
/// backend's `decode_tokens` of the same cache (device tolerance 3e-3), and rows that
/// carry no token are zero. On the tensor-core kernel (d64 k2v2, d128 k4v2) and on the
/// CUDA-core kernel (groups of 32).
#[test]
fn step_decode_mixes_prefill_chunks_single_tokens_and_idle_sequences() {
    for config in step_configs() {
        let max_q_len = 20;
        let mut rig = StepRig::new(config, max_q_len, 40, None);
        let schedule: [[usize; 3]; 7] =
            [[18, 5, 0], [1, 12, 20], [1, 1, 1], [7, 0, 1], [1, 20, 1], [16, 1, 3], [1, 1, 1]];
        for (step, counts) in schedule.iter().enumerate() {
            rig.step(counts, 1000 + step as u64);
        }
        assert_eq!(rig.batch.errors().unwrap(), BatchErrors::default());
        let StepRig { dev, layer, plan, batch, q, out, ids, .. } = &mut rig;
        let qrow = StepRig::HQ * config.head_dim;
        // The run refuses a batch it would decode wrongly, before enqueuing anything.
        let (a, _) = ids[0].unwrap();
        batch.set(layer, &[(a, 1)]).unwrap();
        let before = dev.counters();
        assert!(matches!(plan.run_batch(layer, batch, q, qrow, out, qrow), Err(Error::Shape(_))));
        // The replay check takes a batch before or after its append, not one the launch
        // would decode wrongly.
        plan.check_batch(layer, batch).unwrap();
        batch.set_slots(&[(0, layer.len(a).unwrap(), max_q_len + 1)]).unwrap();
        assert!(matches!(plan.run_batch(layer, batch, q, qrow, out, qrow), Err(Error::Shape(_))));
        assert!(matches!(plan.check_batch(layer, batch), Err(Error::Shape(_))));
        assert_eq!(dev.counters().launches, before.launches);
    }
}

/// A step in passes ([`DecodePlan::run_step`] over [`StepBatch::with_passes`]): prompt
/// chunks up to five passes long, single tokens and idle sequences in one step, each
/// sequence's rows equal to the CPU backend's [`KvCache::append_decode`] with the same
/// passes (device tolerance 3e-3), rows without a token zero, and the same `3 * passes +
/// 1` launches every step with no allocation or copy; on both decode kernels. What the
/// host sees is refused before anything is enqueued.
#[test]
fn run_step_in_passes_equals_the_cpu_backend() {
    for config in step_configs() {
        let pass = config.pass_rows();
        assert_eq!(pass, 8, "half the small window");
        let (passes, max_rows) = (5, 60);
        let max_q_len = pass * passes;
        let mut rig = StepRig::new(config, max_q_len, max_rows, Some(passes));
        assert_eq!((rig.batch.passes(), rig.batch.pass_rows()), (passes, pass));
        let schedule: [[usize; 3]; 6] = [[40, 5, 0], [1, 33, 20], [1, 1, 1], [17, 0, 1], [1, 40, 1], [9, 1, 3]];
        for (step, counts) in schedule.iter().enumerate() {
            rig.step(counts, 2000 + step as u64);
        }
        assert_eq!(rig.batch.errors().unwrap(), BatchErrors::default());
        let StepRig { dev, layer, plan, batch, k, v, q, ids, .. } = &mut rig;
        let (row, qrow) = (StepRig::HKV * config.head_dim, StepRig::HQ * config.head_dim);
        let (k, v, q) = (&*k, &*v, &*q);
        let (a, _) = ids[1].unwrap();

        // Refusals: nothing enqueued, nothing changed.
        let other = Device::sim();
        assert!(matches!(StepBatch::with_passes(dev, 2, 8, 0, 1), Err(Error::Shape(_))));
        assert!(matches!(StepBatch::with_passes(dev, 2, 8, 4, 0), Err(Error::Shape(_))));
        assert!(matches!(StepBatch::with_passes(dev, 2, 8, 4, 65), Err(Error::Capacity(_))));
        let len0 = layer.len(a).unwrap();
        assert!(matches!(batch.set(layer, &[(a, max_q_len + 1)]), Err(Error::Capacity(_))));
        batch.set(layer, &[(a, 3)]).unwrap();
        let cache = layer.read_cache().unwrap();
        let before = dev.counters();
        let short = dev.alloc::<f32>(2 * row).unwrap();
        let far = other.alloc::<f32>(max_rows * qrow).unwrap();
        let r = |res: rotkv::Result<()>| res.unwrap_err();
        let mut out2 = dev.alloc::<f32>(max_rows * qrow).unwrap();
        assert!(matches!(
            r(plan.run_step(layer, batch, (&short, row), (v, row), q, qrow, &mut out2, qrow)),
            Error::Shape(_)
        ));
        assert!(matches!(
            r(plan.run_step(layer, batch, (k, row), (v, row), &far, qrow, &mut out2, qrow)),
            Error::Device(_)
        ));
        assert!(matches!(
            r(plan.run_step(layer, batch, (k, row), (v, row), q, qrow - 1, &mut out2, qrow)),
            Error::Shape(_)
        ));
        let foreign = StepBatch::with_passes(&other, StepRig::SLOTS, max_rows, pass, passes).unwrap();
        assert!(matches!(
            r(plan.run_step(layer, &foreign, (k, row), (v, row), q, qrow, &mut out2, qrow)),
            Error::Device(_)
        ));
        assert_eq!(dev.counters().launches, before.launches);
        assert_eq!((layer.len(a).unwrap(), layer.read_cache().unwrap()), (len0, cache.clone()));
        // After its append the batch's start is stale: refused, as append_batch refuses it.
        plan.run_step(layer, batch, (k, row), (v, row), q, qrow, &mut out2, qrow).unwrap();
        let cache = layer.read_cache().unwrap();
        let before = dev.counters();
        assert!(matches!(
            r(plan.run_step(layer, batch, (k, row), (v, row), q, qrow, &mut out2, qrow)),
            Error::Shape(_)
        ));
        assert_eq!(dev.counters().launches, before.launches);
        assert_eq!((layer.len(a).unwrap(), layer.read_cache().unwrap()), (len0 + 3, cache));
    }
}

/// [`KvCache::append_decode`] refuses what it cannot do before anything changes, and in
/// one pass equals an append then [`KvCache::decode_tokens`] (bit for bit).
#[test]
fn cpu_append_decode_checks_first() {
    let (d, hkv, hq) = (64, 1, 2);
    let config = small(CacheConfig::k2v2(d));
    let cs =
        CacheShape { layers: 1, num_kv_heads: hkv, num_q_heads: hq, max_seqs: 2, max_tokens: 40, num_blocks: None };
    let mut c = KvCache::new(config, cs, Backend::Cpu).unwrap();
    let (a, b) = (c.add_sequence().unwrap(), c.add_sequence().unwrap());
    let (row, qrow) = (hkv * d, hq * d);
    let (k, v, q) = (rows(60 * row, 1), rows(60 * row, 2), rows(60 * qrow, 3));
    let mut out = vec![0f32; 60 * qrow];
    let n = 30;
    let kv = (&k[..2 * n * row], &v[..2 * n * row]);
    let (qs, os) = (&q[..2 * n * qrow], &mut out[..2 * n * qrow]);
    assert!(matches!(c.append_decode(0, &[a, a], n, 8, kv, qs, os), Err(Error::Shape(_))));
    assert!(matches!(c.append_decode(0, &[a, b], n, 0, kv, qs, os), Err(Error::Shape(_))));
    assert!(matches!(c.append_decode(1, &[a, b], n, 8, kv, qs, os), Err(Error::Layer { .. })));
    assert!(matches!(c.append_decode(0, &[a, b], n + 1, 8, kv, qs, os), Err(Error::Shape(_))));
    assert!(matches!(
        c.append_decode(0, &[a, b], 0, 8, (&[0f32; 0], &[0f32; 0]), &[0f32; 0], &mut []),
        Err(Error::Shape(_))
    ));
    // 30 tokens each fit; 50 pass max_tokens (refused before the first pass appends).
    let (k2, v2, q2) = (rows(2 * 50 * row, 4), rows(2 * 50 * row, 5), rows(2 * 50 * qrow, 6));
    let mut o2 = vec![0f32; 2 * 50 * qrow];
    assert!(matches!(c.append_decode(0, &[a, b], 50, 8, (&k2, &v2), &q2, &mut o2), Err(Error::Capacity(_))));
    assert_eq!((c.len(0, a).unwrap(), c.len(0, b).unwrap()), (0, 0), "nothing appended");
    // One pass: append, then decode_tokens.
    let mut twin = KvCache::new(config, cs, Backend::Cpu).unwrap();
    let (ta, tb) = (twin.add_sequence().unwrap(), twin.add_sequence().unwrap());
    c.append_decode(0, &[a, b], n, n, kv, qs, os).unwrap();
    twin.append(0, ta, n, &k[..n * row], &v[..n * row]).unwrap();
    twin.append(0, tb, n, &k[n * row..2 * n * row], &v[n * row..2 * n * row]).unwrap();
    let mut want = vec![0f32; 2 * n * qrow];
    twin.decode_tokens(0, &[ta, tb], n, qs, &mut want).unwrap();
    assert_eq!(os.to_vec(), want);
}

/// A prompt prefilled in chunks attends to the packed cache, and its rows read the cache
/// as the chunk's append leaves it: where that append moved older window rows into
/// pages, a row sees them quantized where token-by-token decode saw them in f16 (a chunk
/// of `c` tokens leaves its first row an f16 window of `window - c` tokens instead of
/// `window`). On real keys, values and queries (SmolLM2-135M layers 0 and 5 on
/// alice29.txt, the bundled tile; k2v2, no calibration), a 2,000-token prompt in chunks
/// of one page (64 tokens) on the CPU backend: the rows whose visible tokens are stored
/// alike after their own token and after the whole chunk (the same quantized length;
/// 1,913 of 2,000) equal token-by-token decode within float reordering (1e-4); the other
/// 87, the first rows of a chunk whose append flushed a page, differ by the 2-bit error
/// of that page (measured mean 0.032 / 0.058, worst 0.38 / 0.40 relative on layers 0 /
/// 5; bounds 0.1 and 0.6). Larger chunks flush more pages under more rows: 256-token
/// chunks with the default 128-token window measured a mean of 0.07 / 0.23 over all rows.
/// On the device (sim), a 300-token prompt in chunks of 48 through `run_batch` equals the
/// CPU backend's chunked outputs (3e-3, the device tolerance).
#[test]
fn chunked_prefill_matches_token_by_token_up_to_the_flush_rule() {
    let tile = rotkv::eval::Tile::load(&rotkv_tests::repo_data().join("smollm2-alice-kv-l0-l5.safetensors")).unwrap();
    for layer in &tile.layers {
        let (d, hkv, hq) = (layer.head_dim, layer.num_kv_heads, layer.num_q_heads);
        let config = CacheConfig::k2v2(d);
        let fmt = config.format().unwrap();
        let (row, qrow) = (hkv * d, hq * d);
        // One sequence of `n` tokens in chunks, each appended and decoded in passes of
        // `pass` rows (`pass >= chunk`: one append, then one decode of the chunk).
        let run_passes = |n: usize, chunk: usize, pass: usize| -> Vec<f32> {
            let cs = CacheShape {
                layers: 1,
                num_kv_heads: hkv,
                num_q_heads: hq,
                max_seqs: 1,
                max_tokens: n,
                num_blocks: None,
            };
            let mut c = KvCache::new(config, cs, Backend::Cpu).unwrap();
            let s = c.add_sequence().unwrap();
            let mut out = vec![0f32; n * qrow];
            let mut at = 0;
            while at < n {
                let m = chunk.min(n - at);
                let kv = (&layer.k[at * row..(at + m) * row], &layer.v[at * row..(at + m) * row]);
                let q = &layer.q[at * qrow..(at + m) * qrow];
                c.append_decode(0, &[s], m, pass, kv, q, &mut out[at * qrow..(at + m) * qrow]).unwrap();
                at += m;
            }
            out
        };
        let run = |n: usize, chunk: usize| run_passes(n, chunk, chunk);
        let (n, chunk) = (2000, fmt.page_size as usize);
        let (one, chunked) = (run(n, 1), run(n, chunk));
        let (mut same, mut errs) = (0, Vec::new());
        for i in 0..n {
            let chunk_end = ((i / chunk + 1) * chunk).min(n);
            let e = rel_err(&chunked[i * qrow..(i + 1) * qrow], &one[i * qrow..(i + 1) * qrow]);
            if fmt.quantized_len(i as u32 + 1) == fmt.quantized_len(chunk_end as u32) {
                same += 1;
                assert!(e < 1e-4, "layer {} row {i}: stored alike, error {e}", layer.layer);
            } else {
                errs.push(e);
            }
        }
        errs.sort_by(f64::total_cmp);
        let mean = errs.iter().sum::<f64>() / errs.len() as f64;
        eprintln!(
            "layer {}: {same} rows stored alike, {} past a flush: mean {mean:.4}, worst {:.4}",
            layer.layer,
            errs.len(),
            errs[errs.len() - 1]
        );
        assert!(same > 1000 && errs.len() > 50, "both kinds of rows occur: {same} same, {} flushed", errs.len());
        let worst = errs[errs.len() - 1];
        assert!(mean < 0.1 && worst < 0.6, "layer {}: mean {mean}, worst {worst}", layer.layer);
        assert!(worst > 1e-4, "the flush rule is visible");

        // The device: a 300-token prompt in chunks of 48 through one plan and batch.
        let n = 300;
        let chunk = 48;
        let want = run(n, chunk);
        let dev = test_device();
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
        let size = LayerSize { max_seqs: 1, max_tokens: n, num_blocks: None };
        let mut dl = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap();
        let ps = PlanShape {
            max_seqs: 1,
            max_q_len: chunk,
            max_context: n,
            sm_count: None,
            blocks_per_sm: None,
            sm_scale: None,
        };
        let mut plan = DecodePlan::new(&dl, ps).unwrap();
        let mut batch = StepBatch::new(&dev, 1, chunk).unwrap();
        let s = dl.add_sequence().unwrap();
        dl.reserve(s, n).unwrap();
        let mut out = dev.alloc::<f32>(chunk * qrow).unwrap();
        let mut at = 0;
        while at < n {
            let m = chunk.min(n - at);
            let pad = |x: &[f32], w: usize| {
                let mut p = x.to_vec();
                p.resize(chunk * w, 0.0);
                p
            };
            let kd = dev.upload(&pad(&layer.k[at * row..(at + m) * row], row)).unwrap();
            let vd = dev.upload(&pad(&layer.v[at * row..(at + m) * row], row)).unwrap();
            let qd = dev.upload(&pad(&layer.q[at * qrow..(at + m) * qrow], qrow)).unwrap();
            batch.set(&dl, &[(s, m)]).unwrap();
            dl.append_batch(&batch, &kd, row, &vd, row).unwrap();
            plan.run_batch(&dl, &batch, &qd, qrow, &mut out, qrow).unwrap();
            let mut got = vec![0f32; chunk * qrow];
            dev.read(&out, &mut got).unwrap();
            let e = rel_err(&got[..m * qrow], &want[at * qrow..(at + m) * qrow]);
            assert!(e < 3e-3, "layer {} chunk at {at}: {e}", layer.layer);
            at += m;
        }

        // In passes (the serving step's rule, `CacheConfig::pass_rows`: half the window,
        // one page here): 256-token chunks give the one-page chunks' outputs bit for bit,
        // the same rows within the flush rule of token-by-token decode as above, where
        // one append per chunk measured a mean of 0.07 / 0.23.
        let pass = config.pass_rows();
        assert_eq!(pass, fmt.page_size as usize);
        let passes = |n: usize, chunk: usize| run_passes(n, chunk, pass);
        assert!(passes(2000, 256) == chunked, "layer {}: 256-token chunks in passes of 64", layer.layer);
        // On the device: a 300-token prompt in chunks of 100, passes of 64, through
        // run_step, against the CPU backend's passes.
        let (n, chunk) = (300, 100);
        let want = passes(n, chunk);
        let size = LayerSize { max_seqs: 1, max_tokens: n, num_blocks: None };
        let mut dl = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap();
        let ps = PlanShape { max_q_len: chunk, ..ps };
        let mut plan = DecodePlan::new(&dl, ps).unwrap();
        let mut batch = StepBatch::with_passes(&dev, 1, chunk, pass, chunk.div_ceil(pass)).unwrap();
        let s = dl.add_sequence().unwrap();
        dl.reserve(s, n).unwrap();
        let mut out = dev.alloc::<f32>(chunk * qrow).unwrap();
        let mut at = 0;
        while at < n {
            let m = chunk.min(n - at);
            let kd = dev.upload(&layer.k[at * row..(at + m) * row]).unwrap();
            let vd = dev.upload(&layer.v[at * row..(at + m) * row]).unwrap();
            let qd = dev.upload(&layer.q[at * qrow..(at + m) * qrow]).unwrap();
            batch.set(&dl, &[(s, m)]).unwrap();
            plan.run_step(&mut dl, &batch, (&kd, row), (&vd, row), &qd, qrow, &mut out, qrow).unwrap();
            let mut got = vec![0f32; chunk * qrow];
            dev.read(&out, &mut got).unwrap();
            let e = rel_err(&got[..m * qrow], &want[at * qrow..(at + m) * qrow]);
            assert!(e < 3e-3, "layer {} chunk at {at} in passes: {e}", layer.layer);
            at += m;
        }
    }
}

/// One sequence of 60 tokens (k2v2 head_dim 64, pages of 16: two pages, in blocks 0 and
/// 1 of a two-block pool; one KV head, 4 query heads) appended on the CPU backend and
/// uploaded to `dev` with what a raw decode reads: the raw entry points' fixture.
struct RawSeq {
    config: CacheConfig,
    fmt: rotkv_kernels::layout::Format,
    calib: LayerCalibration,
    pool: DeviceBuffer<u8>,
    side: DeviceBuffer<u16>,
    lens: DeviceBuffer<u32>,
    protected: DeviceBuffer<u32>,
    key_scale: DeviceBuffer<f32>,
    key_perm: DeviceBuffer<u16>,
    /// `q_rows` query rows.
    q: DeviceBuffer<f32>,
}

impl RawSeq {
    const D: usize = 64;
    const HQ: usize = 4;
    const LEN: usize = 60;

    fn new(dev: &Device, q_rows: usize) -> Self {
        let (d, len) = (Self::D, Self::LEN);
        let config = small(CacheConfig::k2v2(d));
        let fmt = config.format().unwrap();
        let shape = LayerShape { num_kv_heads: 1, num_q_heads: Self::HQ };
        let calib = LayerCalibration::identity(1, d);
        let mut pool = rotkv::paged::PoolBuffer::new(rotkv::paged::pool_bytes(&config, &shape, 2).unwrap());
        let mut side = vec![f16::ZERO; rotkv::paged::side_elems(&config, &shape).unwrap()];
        let (k, v) = (rows(len * d, 1), rows(len * d, 2));
        let (p, s) = (pool.bytes_mut(), &mut side);
        rotkv::paged::append(Backend::Cpu, &config, &calib, &shape, p, &[0, 1], s, &[], 0, len, &k, &v).unwrap();
        assert_eq!(fmt.pages_for(len as u32), 2);
        Self {
            config,
            fmt,
            pool: dev.upload(pool.bytes()).unwrap(),
            side: dev.upload(&side.iter().map(|x| x.to_bits()).collect::<Vec<u16>>()).unwrap(),
            lens: dev.upload(&[len as u32]).unwrap(),
            protected: dev.upload(&[u32::MAX]).unwrap(),
            key_scale: dev.upload(&calib.key_scale).unwrap(),
            key_perm: dev.upload(&calib.key_perm).unwrap(),
            q: dev.upload(&rows(q_rows * Self::HQ * d, 3)).unwrap(),
            calib,
        }
    }
}

/// The tensor-core decode kernel clamps block-table entries below the pool's blocks, as
/// the CUDA-core kernel does: a stale or corrupt entry (`u32::MAX`, raw entry points)
/// reads the last block of the pool, never memory outside it. Through `raw::decode` on
/// the emulator (whose loads are host loads: an unclamped entry would read gigabytes
/// past the pool): a table `[1, u32::MAX]` gives exactly the partials of `[1, 1]`.
#[test]
fn decode_mma_clamps_block_table_entries() {
    use rotkv::device::raw::{self, DTYPE_F32, DecodeParams, DecodePtrs};
    let dev = test_device();
    let f = RawSeq::new(&dev, 1);
    let (config, fmt, calib, hq, d, len, blocks) = (f.config, f.fmt, &f.calib, RawSeq::HQ, RawSeq::D, RawSeq::LEN, 2);
    assert!(rotkv::launch::mma_instantiated(&fmt), "the tensor-core kernel runs this format");
    let (q, lens, protected) = (&f.q, &f.lens, &f.protected);
    let (key_scale, key_perm, pool_d, side_d) = (&f.key_scale, &f.key_perm, &f.pool, &f.side);
    let p = DecodeParams {
        format: fmt,
        num_seqs: 1,
        num_q_heads: hq as u32,
        num_kv_heads: 1,
        num_splits: 2,
        block_table_stride: 2,
        flags: config.flags() | calib.flags(),
        sm_scale: 0.125,
        q_seq_stride: (hq * d) as u32,
        q_token_stride: (hq * d) as u32,
        q_dtype: DTYPE_F32,
        num_blocks: blocks as u32,
        max_len: len as u32,
        q_len: 1,
        attn_window: 0,
        batch_rows: 0,
        batch_seqs: 0,
    };
    let partials = |table: [u32; 2]| -> Vec<f32> {
        let tables = dev.upload(&table).unwrap();
        let (m, l, o) = (
            dev.alloc::<f32>(hq * 2).unwrap(),
            dev.alloc::<f32>(hq * 2).unwrap(),
            dev.alloc::<f32>(hq * 2 * d).unwrap(),
        );
        let ptrs = DecodePtrs {
            q: q.addr(),
            pool: pool_d.addr(),
            tables: tables.addr(),
            lens: lens.addr(),
            sides: side_d.addr(),
            protected: protected.addr(),
            key_scale: key_scale.addr(),
            key_perm: key_perm.addr(),
            key_rot: key_scale.addr(),
            m: m.addr(),
            l: l.addr(),
            o: o.addr(),
            meta: 0,
        };
        // SAFETY: every buffer is a live allocation of `dev` of the kernel's sizes for
        // `p` (one sequence of 60 tokens, 2 splits, 4 query heads); the table entries
        // past the pool are what the test is about (the kernel clamps them).
        unsafe { raw::decode(&dev, &p, &ptrs).unwrap() };
        let mut all = vec![0f32; hq * 2 * (d + 2)];
        dev.read(&m, &mut all[..hq * 2]).unwrap();
        dev.read(&l, &mut all[hq * 2..hq * 4]).unwrap();
        dev.read(&o, &mut all[hq * 4..]).unwrap();
        all
    };
    let clamped = partials([1, u32::MAX]);
    assert!(clamped.iter().all(|x| x.is_finite()));
    assert_eq!(clamped, partials([1, 1]));
    assert_ne!(clamped, partials([0, 1]), "the clamped page is the last block, not the right one");
}

/// One rule for non-finite input. What the host sees (the CPU backends' `KvCache`) it
/// refuses with `Error::Value`; on the device, where the host cannot see the data, a NaN,
/// `+Inf` or `-Inf` in a query, a key or a value makes every output row that can see it
/// NaN, never a finite wrong row, and leaves the other rows as they were: a key or value
/// of KV head 0 of sequence A (in a quantized page or in the f16 window) reaches the
/// query heads of that KV head in sequence A; a query reaches its own row.
#[test]
fn non_finite_inputs_make_the_rows_that_see_them_nan() {
    // The tensor-core kernel, and the CUDA-core one (groups of 32).
    for config in [small(CacheConfig::k2v2(64)), CacheConfig { group_size: 32, ..small(CacheConfig::k2v2(64)) }] {
        non_finite_rule(config);
    }
}

fn non_finite_rule(config: CacheConfig) {
    let (d, hkv, hq, n) = (64, 2, 4, 40);
    let (row, qrow) = (hkv * d, hq * d);
    // Host-visible input is refused.
    for backend in [Backend::Reference, Backend::Cpu] {
        let cs =
            CacheShape { layers: 1, num_kv_heads: hkv, num_q_heads: hq, max_seqs: 1, max_tokens: 64, num_blocks: None };
        let mut c = KvCache::new(config, cs, backend).unwrap();
        let s = c.add_sequence().unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut k = rows(row, 1);
            k[3] = bad;
            assert!(matches!(c.append(0, s, 1, &k, &rows(row, 2)), Err(Error::Value(_))), "{backend:?} {bad}");
            assert!(matches!(c.append(0, s, 1, &rows(row, 2), &k), Err(Error::Value(_))), "{backend:?} {bad}");
        }
        c.append(0, s, 1, &rows(row, 1), &rows(row, 2)).unwrap();
        let mut q = rows(qrow, 3);
        q[70] = f32::NAN;
        assert!(matches!(c.decode(0, &[s], &q, &mut vec![0.0; qrow]), Err(Error::Value(_))), "{backend:?}");
    }
    // The device: (what, position or query head, bad value).
    #[derive(Clone, Copy, Debug)]
    enum At {
        Key(usize),
        Value(usize),
        Query(usize),
    }
    let dev = test_device();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        // Position 5 is in a quantized page once the sequences hold 41 tokens, 35 in the
        // f16 window.
        for at in [At::Key(5), At::Key(35), At::Value(5), At::Value(35), At::Query(1)] {
            let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
            let size = LayerSize { max_seqs: 2, max_tokens: 64, num_blocks: None };
            let mut layer = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap();
            let (a, b) = (layer.add_sequence().unwrap(), layer.add_sequence().unwrap());
            layer.reserve(a, 64).unwrap();
            layer.reserve(b, 64).unwrap();
            let mut batch = StepBatch::new(&dev, 2, 2 * n).unwrap();
            let (mut k, mut v) = (rows(2 * n * row, 11), rows(2 * n * row, 12));
            // Sequence A's rows are 0 .. n; KV head 0 is the first `d` of each row.
            match at {
                At::Key(p) => k[p * row + 7] = bad,
                At::Value(p) => v[p * row + 7] = bad,
                At::Query(_) => {}
            }
            batch.set(&layer, &[(a, n), (b, n)]).unwrap();
            layer.append_batch(&batch, &dev.upload(&k).unwrap(), row, &dev.upload(&v).unwrap(), row).unwrap();
            // The step's counters name the one bad K or V row (token, head).
            let e = batch.errors().unwrap();
            let want = if matches!(at, At::Query(_)) { 0 } else { 1 };
            assert_eq!((e.batch_rows, e.bad_blocks, e.non_finite_rows), (0, 0, want), "{bad} at {at:?}");
            batch.set(&layer, &[(a, 1), (b, 1)]).unwrap();
            let (k1, v1) = (dev.upload(&rows(2 * n * row, 13)).unwrap(), dev.upload(&rows(2 * n * row, 14)).unwrap());
            layer.append_batch(&batch, &k1, row, &v1, row).unwrap();
            let mut q = rows(2 * qrow, 15);
            if let At::Query(h) = at {
                q[h * d + 9] = bad;
            }
            let ps = PlanShape {
                max_seqs: 2,
                max_q_len: 1,
                max_context: 64,
                sm_count: None,
                blocks_per_sm: None,
                sm_scale: None,
            };
            let mut plan = DecodePlan::new(&layer, ps).unwrap();
            let mut out = dev.alloc::<f32>(2 * qrow).unwrap();
            plan.run(&layer, 1, &dev.upload(&q).unwrap(), &mut out).unwrap();
            let mut got = vec![0f32; 2 * qrow];
            dev.read(&out, &mut got).unwrap();
            for (r, head) in got.chunks(d).enumerate() {
                let (seq, h) = (r / hq, r % hq);
                let sees = seq == 0
                    && match at {
                        At::Key(_) | At::Value(_) => h / (hq / hkv) == 0,
                        At::Query(qh) => h == qh,
                    };
                if sees {
                    assert!(
                        head.iter().any(|x| x.is_nan()),
                        "{config:?} {bad} at {at:?}: seq {seq} head {h} is not NaN"
                    );
                } else {
                    assert!(head.iter().all(|x| x.is_finite()), "{config:?} {bad} at {at:?}: seq {seq} head {h}");
                }
            }
        }
    }
}

/// On a GPU: a whole step of four layers (the batched append and the step decode of
/// each) is captured once in a CUDA graph and replayed while sequences grow, cross page
/// flushes, take prompt chunks or idle: each replay (after `StepBatch::set` and the
/// step's inputs, written before it, and `DeviceLayer::advance` for the host's
/// bookkeeping) gives bit for bit the outputs of the same step launched directly on a
/// twin model. SKIPPED on the emulated device (no graphs there).
#[test]
fn a_whole_step_replays_as_a_cuda_graph() {
    let dev = test_device();
    let Some(stream) = dev.stream().cloned() else {
        eprintln!("SKIPPED: CUDA graph capture of a step (the emulated device has no graphs; ROTKV_TEST_DEVICE=cuda)");
        return;
    };
    let (layers, d, hkv, hq, slots, max_rows, max_tokens) = (4, 128, 2, 8, 3, 40, 256);
    let config = small(CacheConfig::k2v2(d));
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let size = LayerSize { max_seqs: slots, max_tokens, num_blocks: None };
    let make = || -> Vec<DeviceLayer> {
        (0..layers)
            .map(|_| DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap())
            .collect()
    };
    let (mut graphed, mut direct) = (make(), make());
    let ps = PlanShape {
        max_seqs: slots,
        max_q_len: 20,
        max_context: max_tokens,
        sm_count: None,
        blocks_per_sm: None,
        sm_scale: None,
    };
    let (mut plan_g, mut plan_d) =
        (DecodePlan::new(&graphed[0], ps).unwrap(), DecodePlan::new(&direct[0], ps).unwrap());
    let (mut batch_g, mut batch_d) =
        (StepBatch::new(&dev, slots, max_rows).unwrap(), StepBatch::new(&dev, slots, max_rows).unwrap());
    let (row, qrow) = (hkv * d, hq * d);
    let alloc = |n| (0..layers).map(|_| dev.alloc::<f32>(n).unwrap()).collect::<Vec<_>>();
    let (mut k, mut v, mut q) = (alloc(max_rows * row), alloc(max_rows * row), alloc(max_rows * qrow));
    let (mut out_g, mut out_d) = (alloc(max_rows * qrow), alloc(max_rows * qrow));
    let ids: Vec<(Vec<SeqId>, Vec<SeqId>)> = (0..slots)
        .map(|_| {
            let g: Vec<SeqId> = graphed.iter_mut().map(|l| l.add_sequence().unwrap()).collect();
            let dd: Vec<SeqId> = direct.iter_mut().map(|l| l.add_sequence().unwrap()).collect();
            for ((lg, ld), (&a, &b)) in graphed.iter_mut().zip(direct.iter_mut()).zip(g.iter().zip(&dd)) {
                lg.reserve(a, max_tokens).unwrap();
                ld.reserve(b, max_tokens).unwrap();
            }
            (g, dd)
        })
        .collect();
    // Tokens per slot per step: prompt chunks, single tokens, idling.
    let schedule: [[usize; 3]; 6] = [[20, 5, 0], [1, 15, 20], [1, 1, 1], [16, 0, 1], [1, 1, 18], [1, 20, 1]];
    let mut graph = None;
    for (step, counts) in schedule.iter().enumerate() {
        let steps_g: Vec<(SeqId, usize)> = (0..slots).map(|s| (ids[s].0[0], counts[s])).collect();
        let steps_d: Vec<(SeqId, usize)> = (0..slots).map(|s| (ids[s].1[0], counts[s])).collect();
        batch_g.set(&graphed[0], &steps_g).unwrap();
        batch_d.set(&direct[0], &steps_d).unwrap();
        for l in 0..layers {
            let seed = (100 * step + l) as u64;
            dev.write(&mut k[l], 0, &rows(max_rows * row, seed)).unwrap();
            dev.write(&mut v[l], 0, &rows(max_rows * row, seed + 1)).unwrap();
            dev.write(&mut q[l], 0, &rows(max_rows * qrow, seed + 2)).unwrap();
        }
        // The twin, launched directly.
        for l in 0..layers {
            direct[l].append_batch(&batch_d, &k[l], row, &v[l], row).unwrap();
            plan_d.run_batch(&direct[l], &batch_d, &q[l], qrow, &mut out_d[l], qrow).unwrap();
        }
        // The graphed model: captured on the first step, replayed after.
        match &graph {
            None => {
                stream
                    .begin_capture(
                        rotkv::cuda::cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                    )
                    .unwrap();
                for l in 0..layers {
                    graphed[l].append_batch(&batch_g, &k[l], row, &v[l], row).unwrap();
                    plan_g.run_batch(&graphed[l], &batch_g, &q[l], qrow, &mut out_g[l], qrow).unwrap();
                }
                let g = stream.end_capture(rotkv::cuda::cudarc::driver::sys::CUgraphInstantiate_flags(0)).unwrap();
                let g = g.expect("a captured graph");
                g.launch().unwrap();
                graph = Some(g);
            }
            Some(g) => {
                for l in graphed.iter_mut() {
                    plan_g.check_batch(l, &batch_g).unwrap();
                    l.advance(&batch_g).unwrap();
                }
                g.launch().unwrap();
            }
        }
        dev.synchronize().unwrap();
        for l in 0..layers {
            let (mut a, mut b) = (vec![0f32; max_rows * qrow], vec![0f32; max_rows * qrow]);
            dev.read(&out_g[l], &mut a).unwrap();
            dev.read(&out_d[l], &mut b).unwrap();
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "step {step} layer {l}");
        }
        for (s, (g, dd)) in ids.iter().enumerate() {
            assert_eq!(graphed[0].len(g[0]).unwrap(), direct[0].len(dd[0]).unwrap(), "slot {s}");
        }
    }
    assert_eq!(batch_g.errors().unwrap(), BatchErrors::default());
}

/// What only the device can see in a batched append through the raw entry point is
/// skipped and counted, never read or written out of bounds: input rows naming a slot
/// past the batch's, or lying outside their slot's rows, count in `batch_rows` (one per
/// KV head); tokens whose page's block-table entry is past the pool count in
/// `bad_blocks` (their K and V rows), and the pool stays untouched.
#[test]
fn raw_batched_append_counts_what_only_the_device_sees() {
    use rotkv::device::raw::{self, AppendBatchParams, AppendParams, BatchPtrs, DTYPE_F32, batch_meta_len};
    let config = small(CacheConfig::k2v2(64));
    let fmt = config.format().unwrap();
    let (d, seqs, rows_n, stride) = (64usize, 2usize, 44usize, 4usize);
    let calib = LayerCalibration::identity(1, d);
    let dev = Device::sim();
    let pool = dev.alloc::<u8>(2 * fmt.page_bytes() as usize).unwrap();
    let sides = dev.alloc::<u16>(seqs * fmt.side_elems(1)).unwrap();
    let lens = dev.alloc::<u32>(seqs).unwrap();
    let protected = dev.upload(&[u32::MAX; 2]).unwrap();
    // Slot 0's first page points past the pool's two blocks.
    let tables = dev.upload(&[u32::MAX, 1, 0, 0, 0, 0, 0, 0]).unwrap();
    let (km, ks) = (dev.upload(&calib.key_mean).unwrap(), dev.upload(&calib.key_scale).unwrap());
    let (kp, vp) = (dev.upload(&calib.key_perm).unwrap(), dev.upload(&calib.value_perm).unwrap());
    let errors = dev.alloc::<u32>(raw::BATCH_ERRORS).unwrap();
    let (k, v) = (dev.upload(&rows(rows_n * d, 1)).unwrap(), dev.upload(&rows(rows_n * d, 2)).unwrap());
    // Rows 0..40: slot 0 (40 tokens from 0: positions 2..18 go to page 0); rows 40, 41:
    // slot 5, past the batch; row 42: slot 1, which has no tokens this step; row 43: unused.
    let mut meta = vec![0u32; batch_meta_len(rows_n as u32, seqs as u32)];
    meta[40] = 5;
    meta[41] = 5;
    meta[42] = 1;
    meta[43] = raw::BATCH_NO_SLOT;
    let (r, s) = (rows_n, seqs);
    meta[r + s] = 40; // slot 0's count
    let meta = dev.upload(&meta).unwrap();
    let bp = AppendBatchParams {
        append: AppendParams {
            format: fmt,
            num_kv_heads: 1,
            start: 0,
            count: 0,
            new_len: 0,
            num_blocks: 2,
            flags: config.flags() | calib.flags(),
            token_stride: d as u32,
            v_token_stride: d as u32,
            head_stride: d as u32,
            input_dtype: DTYPE_F32,
        },
        max_seqs: seqs as u32,
        max_rows: rows_n as u32,
        table_stride: stride as u32,
        protected_stride: 1,
    };
    let ptrs = BatchPtrs {
        meta: meta.addr(),
        k: k.addr(),
        v: v.addr(),
        key_mean: km.addr(),
        key_scale: ks.addr(),
        key_perm: kp.addr(),
        value_perm: vp.addr(),
        key_rot: km.addr(),
        value_rot: km.addr(),
        tables: tables.addr(),
        protected: protected.addr(),
        pool: pool.addr(),
        sides: sides.addr(),
        lens: lens.addr(),
        errors: errors.addr(),
    };
    // SAFETY: every buffer is a live allocation of `dev` of the sizes the kernels ask
    // for `bp` (2 slots, 44 rows, tables of 4 entries); the inconsistent rows and the
    // table entry past the pool are what the test is about.
    unsafe { raw::append_batch(&dev, &bp, &ptrs).unwrap() };
    let mut e = [0u32; raw::BATCH_ERRORS];
    dev.read(&errors, &mut e).unwrap();
    assert_eq!(fmt.quantized_len(40), 16);
    assert_eq!(e, [3, 2 * 16, 0], "(batch rows, bad-block K/V rows, non-finite rows)");
    let mut p = vec![1u8; pool.len()];
    dev.read(&pool, &mut p).unwrap();
    assert!(p.iter().all(|&b| b == 0), "nothing was written into the pool");
    let mut l = [9u32; 2];
    dev.read(&lens, &mut l).unwrap();
    assert_eq!(l, [40, 0]);
}

/// The other half of the non-finite rule: a row that cannot see a bad token stays
/// finite, also where a kernel loads the token and masks it (a 16-token tile that
/// straddles a causal limit or a sliding window's start: the tensor-core kernel
/// multiplies masked tokens' values by a zero weight, so a NaN value stored as it came
/// would leak). A bad key or value is stored as a NaN key and a finite value. Checked on
/// both decode kernels: a 4-row step whose last token is bad (rows 0-2 finite, row 3
/// NaN), and a sliding window that starts two tokens after a bad one.
#[test]
fn non_finite_inputs_stay_out_of_rows_that_cannot_see_them() {
    for config in [small(CacheConfig::k2v2(64)), CacheConfig { group_size: 32, ..small(CacheConfig::k2v2(64)) }] {
        let (d, hkv, hq) = (64, 2, 4);
        let (row, qrow) = (hkv * d, hq * d);
        let dev = test_device();
        for bad_value in [false, true] {
            let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
            let size = LayerSize { max_seqs: 1, max_tokens: 64, num_blocks: None };
            let mut layer = DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size).unwrap();
            let a = layer.add_sequence().unwrap();
            layer.reserve(a, 64).unwrap();
            let mut batch = StepBatch::new(&dev, 1, 40).unwrap();
            batch.set(&layer, &[(a, 40)]).unwrap();
            let (mut k, mut v) = (rows(40 * row, 21), rows(40 * row, 22));
            // Position 18: before the window below, in the f16 rows.
            if bad_value {
                v[18 * row + 3] = f32::NAN
            } else {
                k[18 * row + 3] = f32::NAN
            }
            layer.append_batch(&batch, &dev.upload(&k).unwrap(), row, &dev.upload(&v).unwrap(), row).unwrap();
            // A step of 4 rows (positions 40..44) whose last token (43) is bad.
            let (mut k4, mut v4) = (rows(40 * row, 23), rows(40 * row, 24));
            if bad_value {
                v4[3 * row + 5] = f32::INFINITY
            } else {
                k4[3 * row + 5] = f32::INFINITY
            }
            batch.set(&layer, &[(a, 4)]).unwrap();
            layer.append_batch(&batch, &dev.upload(&k4).unwrap(), row, &dev.upload(&v4).unwrap(), row).unwrap();
            let q = dev.upload(&rows(40 * qrow, 25)).unwrap();
            let mut out = dev.alloc::<f32>(40 * qrow).unwrap();
            // A sliding window of 20 keys: position 43's rows see 24 ..= 43, not 18; the
            // earlier rows see neither bad token except row 3 its own.
            let ps = PlanShape {
                max_seqs: 1,
                max_q_len: 40,
                max_context: 64,
                sm_count: None,
                blocks_per_sm: None,
                sm_scale: None,
            };
            let mut plan = DecodePlan::new_windowed(&layer, ps, Some(19)).unwrap();
            plan.run_batch(&layer, &batch, &q, qrow, &mut out, qrow).unwrap();
            let mut all = vec![0f32; 40 * qrow];
            dev.read(&out, &mut all).unwrap();
            for r in 0..4 {
                for h in 0..hq {
                    let head = &all[(r * hq + h) * d..(r * hq + h + 1) * d];
                    if r == 3 && h < hq / hkv {
                        assert!(head.iter().any(|x| x.is_nan()), "{config:?} value {bad_value}: row {r} head {h}");
                    } else {
                        assert!(head.iter().all(|x| x.is_finite()), "{config:?} value {bad_value}: row {r} head {h}");
                    }
                }
            }
            // Without the window, every row sees position 18: head 0's group is NaN.
            let mut plan = DecodePlan::new(&layer, ps).unwrap();
            plan.run_batch(&layer, &batch, &q, qrow, &mut out, qrow).unwrap();
            dev.read(&out, &mut all).unwrap();
            for r in 0..4 {
                for h in 0..hq {
                    let head = &all[(r * hq + h) * d..(r * hq + h + 1) * d];
                    assert_eq!(
                        head.iter().any(|x| x.is_nan()),
                        h < hq / hkv,
                        "{config:?} value {bad_value}: row {r} head {h}"
                    );
                }
            }
        }
    }
}

/// A step batch whose slot has more rows than the decode launch covers (reachable on
/// a graph replay, where the host's plan check does not run) gets no rows at all, never
/// rows with another token's causal limit, and the merge writes those rows as zeros, not
/// last step's partials. Through `raw::decode` and `raw::merge` on the emulator.
#[test]
fn step_rows_past_the_launch_are_zeros_not_stale() {
    use rotkv::device::raw::{self, DTYPE_F32, DecodeParams, DecodePtrs, MergeParams, MergePtrs};
    let dev = Device::sim();
    let f = RawSeq::new(&dev, 4);
    let (config, fmt, calib, hq, d, len) = (f.config, f.fmt, &f.calib, RawSeq::HQ, RawSeq::D, RawSeq::LEN);
    let (q, lens, protected, pool_d, side_d) = (&f.q, &f.lens, &f.protected, &f.pool, &f.side);
    let tables = dev.upload(&[0u32, 1]).unwrap();
    let (ks, kp, inv) = (&f.key_scale, &f.key_perm, dev.upload(&calib.value_perm_inverse(d)).unwrap());
    let (splits, rows_n) = (2u32, 4u32);
    let (m, l, o) = (
        dev.alloc::<f32>(4 * hq * 2).unwrap(),
        dev.alloc::<f32>(4 * hq * 2).unwrap(),
        dev.alloc::<f32>(4 * hq * 2 * d).unwrap(),
    );
    let run = |count: u32| -> Vec<f32> {
        // Rows 0 .. count are the slot's (its last `count` tokens), the rest unused.
        let mut meta = vec![raw::BATCH_NO_SLOT; 4];
        meta[..count as usize].fill(0);
        meta.extend([len as u32 - count, count, 0]);
        let meta = dev.upload(&meta).unwrap();
        let p = DecodeParams {
            format: fmt,
            num_seqs: 1,
            num_q_heads: hq as u32,
            num_kv_heads: 1,
            num_splits: splits,
            block_table_stride: 2,
            flags: config.flags() | calib.flags(),
            sm_scale: 0.125,
            q_seq_stride: 0,
            q_token_stride: (hq * d) as u32,
            q_dtype: DTYPE_F32,
            num_blocks: 2,
            max_len: len as u32,
            q_len: 2,
            attn_window: 0,
            batch_rows: rows_n,
            batch_seqs: 1,
        };
        let mp = MergeParams {
            num_seqs: rows_n,
            num_q_heads: hq as u32,
            num_kv_heads: 1,
            head_dim: d as u32,
            num_splits: splits,
            flags: config.flags() & rotkv_kernels::params::FLAG_ROTATE_VALUES,
            out_row_stride: (hq * d) as u32,
            batch_seqs: 1,
            q_len: 2,
        };
        let out = dev.upload(&vec![9.0f32; 4 * hq * d]).unwrap();
        let ptrs = DecodePtrs {
            q: q.addr(),
            pool: pool_d.addr(),
            tables: tables.addr(),
            lens: lens.addr(),
            sides: side_d.addr(),
            protected: protected.addr(),
            key_scale: ks.addr(),
            key_perm: kp.addr(),
            key_rot: ks.addr(),
            m: m.addr(),
            l: l.addr(),
            o: o.addr(),
            meta: meta.addr(),
        };
        let mptrs = MergePtrs {
            m: m.addr(),
            l: l.addr(),
            o: o.addr(),
            vperm_inv: inv.addr(),
            value_rot: ks.addr(),
            out: out.addr(),
            meta: meta.addr(),
        };
        // SAFETY: every buffer is a live allocation of `dev` of the kernels' sizes for a
        // step batch of 4 rows over 1 slot, 2 splits, 4 query heads.
        unsafe {
            raw::decode(&dev, &p, &ptrs).unwrap();
            raw::merge(&dev, &mp, &mptrs).unwrap();
        }
        let mut got = vec![0f32; 4 * hq * d];
        dev.read(&out, &mut got).unwrap();
        got
    };
    let two = run(2);
    let row = hq * d;
    assert!(two[..2 * row].iter().all(|x| x.is_finite() && *x != 9.0) && two[..2 * row].iter().any(|&x| x != 0.0));
    assert!(two[2 * row..].iter().all(|&x| x == 0.0), "rows without a token are zeros");
    // Three rows for a launch of two: none decoded, all written as zeros (the partials
    // still hold the two rows of the run above).
    let three = run(3);
    assert!(three.iter().all(|&x| x == 0.0), "rows past the launch are zeros, not stale");
}
