//! A serving loop on the device API: a model of several layers whose caches stay in
//! device memory; requests arrive, their prompts are prefilled in chunks of up to 192
//! tokens that attend to the packed cache, they decode token by token and leave, all
//! through one step batch and one decode plan shared by every layer. Every step enqueues
//! the same launch list (each layer: `DecodePlan::run_step`, the batched append and the
//! decode in three passes of 64 rows, then the merge), so a stack can capture it in a
//! CUDA graph once and replay it while sequences come and go.
//!
//! ```sh
//! cargo run -p rotkv --features sim --release --example serving_loop
//! ```
//!
//! Runs on the emulated device; with `ROTKV_DEVICE=cuda` (and the `cuda` feature) on
//! GPU 0. Each step asserts that it allocated, copied and waited for nothing and that
//! its launch list is the first step's; the only host work is the scheduler's: one
//! upload of the step batch before the step, and block reservations on admission.

use rotkv::device::{DecodePlan, Device, DeviceLayer, LaunchRecord, LayerSize, PlanShape, StepBatch};
use rotkv::paged::LayerShape;
use rotkv::{CacheConfig, LayerCalibration, SeqId, f16};

/// A request: arrival step, prompt tokens, tokens to generate.
const REQUESTS: [(usize, usize, usize); 6] =
    [(0, 400, 6), (0, 40, 3), (1, 300, 5), (3, 10, 4), (5, 150, 2), (6, 20, 3)];

struct Live {
    /// The request's sequence in every layer (the same slot in each).
    ids: Vec<SeqId>,
    prompt_left: usize,
    generate_left: usize,
}

fn device() -> rotkv::Result<Device> {
    #[cfg(feature = "cuda")]
    if std::env::var("ROTKV_DEVICE").as_deref() == Ok("cuda") {
        let ctx = rotkv::cuda::cudarc::driver::CudaContext::new(0)
            .map_err(|e| rotkv::Error::Backend(format!("GPU 0: {e:?}")))?;
        let stream = ctx.new_stream().map_err(|e| rotkv::Error::Backend(format!("a stream: {e:?}")))?;
        return Device::cuda(stream);
    }
    Ok(Device::sim())
}

fn main() -> rotkv::Result<()> {
    // SmolLM2-135M's attention shape, 4 of its 30 layers.
    let (layers, hkv, hq, d) = (4, 3, 9, 64);
    let (slots, max_tokens, chunk, max_rows) = (4, 512, 192, 256);
    let dev = device()?;
    let config = CacheConfig::k2v2(d);
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let size = LayerSize { max_seqs: slots, max_tokens, num_blocks: None };
    let mut model = (0..layers)
        .map(|_| DeviceLayer::new(&dev, config, shape, LayerCalibration::identity(hkv, d), size))
        .collect::<rotkv::Result<Vec<_>>>()?;
    // One plan for every layer: up to `chunk` rows per sequence per step.
    let plan_shape = PlanShape {
        max_seqs: slots,
        max_q_len: chunk,
        max_context: max_tokens,
        sm_count: None,
        blocks_per_sm: None,
        sm_scale: None,
    };
    let mut plan = DecodePlan::new(&model[0], plan_shape)?;
    // Steps in passes of half the window (64 rows per sequence): every row of a
    // 192-token chunk sees the chunk's earlier tokens in f16.
    let pass = config.pass_rows();
    let mut batch = StepBatch::with_passes(&dev, slots, max_rows, pass, chunk.div_ceil(pass))?;
    let per_layer = 3 * batch.passes() + 1;
    // The step's buffers, made once: each layer's new K/V rows, queries and outputs (a
    // model writes its projections here on the device; this loop fills them once).
    let (row, qrow) = (hkv * d, hq * d);
    let synth = |n: usize, seed: usize| -> Vec<f16> {
        (0..n).map(|i| f16::from_f32((((i * 31 + seed * 17) % 97) as f32 - 48.0) / 24.0)).collect()
    };
    let k = (0..layers).map(|l| dev.upload(&synth(max_rows * row, 10 * l + 1))).collect::<rotkv::Result<Vec<_>>>()?;
    let v = (0..layers).map(|l| dev.upload(&synth(max_rows * row, 10 * l + 2))).collect::<rotkv::Result<Vec<_>>>()?;
    let q = (0..layers).map(|l| dev.upload(&synth(max_rows * qrow, 10 * l + 3))).collect::<rotkv::Result<Vec<_>>>()?;
    let mut out = (0..layers).map(|_| dev.alloc::<f16>(max_rows * qrow)).collect::<rotkv::Result<Vec<_>>>()?;

    let mut live: Vec<Live> = Vec::new();
    // Requests that arrived while every slot was taken: (prompt, generate).
    let mut waiting: Vec<(usize, usize)> = Vec::new();
    let mut first_list: Option<Vec<LaunchRecord>> = None;
    dev.record_launches(true);
    println!("step  rows  (slot: prefill/decode tokens)            lens                  launches  step time");
    for step in 0.. {
        // The scheduler, between steps: admissions reserve their whole life on every
        // layer (no block is taken inside a step), then this step's rows are chosen
        // within the batch's budget: prompt chunks first come first, one token each for
        // the decoding sequences.
        waiting.extend(REQUESTS.iter().filter(|r| r.0 == step).map(|r| (r.1, r.2)));
        while live.len() < slots && !waiting.is_empty() {
            let (prompt, generate) = waiting.remove(0);
            let ids = model.iter_mut().map(|l| l.add_sequence()).collect::<rotkv::Result<Vec<_>>>()?;
            for (l, &id) in model.iter_mut().zip(&ids) {
                l.reserve(id, prompt + generate)?;
            }
            live.push(Live { ids, prompt_left: prompt, generate_left: generate });
        }
        if live.is_empty() && waiting.is_empty() && step > REQUESTS.iter().map(|r| r.0).max().unwrap_or(0) {
            break;
        }
        let mut budget = max_rows;
        let mut steps = Vec::new();
        let mut shown = Vec::new();
        for s in &live {
            let n = if s.prompt_left > 0 { s.prompt_left.min(chunk) } else { 1 }.min(budget);
            budget -= n;
            steps.push((s.ids[0], n));
            shown.push(format!("{}:{}{n}", s.ids[0].slot(), if s.prompt_left > 0 { "p" } else { "d" }));
        }
        batch.set(&model[0], &steps)?;

        // The step: the same launches whatever the batch holds.
        let before = dev.counters();
        let t = dev.time(0, 1, || {
            for l in 0..layers {
                plan.run_step(&mut model[l], &batch, (&k[l], row), (&v[l], row), &q[l], qrow, &mut out[l], qrow)?;
            }
            Ok(())
        })?;
        let c = dev.counters();
        assert_eq!(c.launches - before.launches, per_layer * layers);
        assert_eq!(
            (c.allocations, c.uploads, c.downloads, c.device_copies),
            (before.allocations, before.uploads, before.downloads, before.device_copies),
            "a step allocates and copies nothing"
        );
        let list: Vec<LaunchRecord> = dev.take_launches();
        match &first_list {
            None => first_list = Some(list),
            Some(f) => assert_eq!(f, &list, "step {step} enqueued another launch list"),
        }
        let lens: Vec<String> =
            live.iter().map(|s| model[0].len(s.ids[0]).map(|n| n.to_string())).collect::<rotkv::Result<_>>()?;
        println!(
            "{step:>4}  {:>4}  {:<40}  {:<20}  {:>8}  {:>7.2} ms",
            batch.rows(),
            shown.join(" "),
            lens.join(","),
            c.launches - before.launches,
            t * 1e3
        );

        // Progress; finished requests leave every layer.
        for (s, &(_, n)) in live.iter_mut().zip(&steps) {
            if s.prompt_left > 0 {
                s.prompt_left -= n;
            } else if n > 0 {
                s.generate_left -= 1;
            }
        }
        let mut i = 0;
        while i < live.len() {
            if live[i].prompt_left == 0 && live[i].generate_left == 0 {
                let s = live.remove(i);
                for (l, id) in model.iter_mut().zip(s.ids) {
                    l.free_sequence(id)?;
                }
            } else {
                i += 1;
            }
        }
    }
    assert_eq!(batch.errors()?, Default::default(), "the device skipped nothing");
    println!("every step: {} launches, the same list; the device reported no skipped rows", per_layer * layers);
    Ok(())
}
