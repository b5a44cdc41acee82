//! One attention layer of a small decoder on candle CPU tensors, its KV cache in rotkv.
//!
//! Random weights from a fixed seed; two sequences (prompts of 400 and 260 tokens). Per
//! token: `x -> qkv` (one fused projection with candle ops; q, k and v are views of it,
//! so v reaches rotkv with a row stride), RoPE on q and k, k and v appended to the rotkv
//! cache (`rotkv::candle::append`), decode attention from the packed cache
//! (`rotkv::candle::decode`, both sequences in one call; after the prompts also
//! `decode_tokens` for the last 4 prompt tokens, causal), then the output projection.
//! The same tokens also go through the device path (`rotkv::candle::device_append` and
//! `device_decode` on a `rotkv::device::DeviceLayer`): on GPU 0 with CUDA tensors when
//! built with the feature `candle-cuda` and a GPU is there (the GPU bundle's
//! `bin/candle_cuda`), else on the emulated GPU (`Device::sim()`) with the CPU tensors.
//! Either way the tensors are read in place as device views, k contiguous and v at the
//! fused projection's row stride, with no copy (`to_device` keeps the layout). Each output is compared with
//! candle's own f32 softmax attention over the unquantized keys and values, and with the same layer on rotkv's f64 reference backend:
//!
//! - cpu backend vs reference backend: the same quantized cache, so they agree to
//!   rounding (asserted below [`BACKEND_BOUND`]);
//! - the device path vs the reference backend: the tensor-core decode kernel (f16
//!   probabilities), asserted below [`DEVICE_BOUND`];
//! - rotkv vs exact f32 attention: the quantization error, asserted below a bound per
//!   configuration ([`K4V4_BOUND`], [`K2V2_BOUND`]), and the reference's own error must
//!   be the same size (so the bound measures the format, not a bug of the fast path).
//!
//! ```sh
//! cargo run -p rotkv --features candle,sim --release --example candle_attention
//! ```
//!
//! The test suite runs this file too (`tests/tests/candle.rs`).

use candle_core::{D, DType, Device, Tensor};
use rotkv::device::{DecodePlan, DeviceLayer, LayerSize, PlanShape};
use rotkv::paged::LayerShape;
use rotkv::{Backend, CacheConfig, CacheShape, KvCache, LayerCalibration};

const HIDDEN: usize = 256;
const HQ: usize = 8;
const HKV: usize = 2;
const HEAD_DIM: usize = 64;
const PROMPTS: [usize; 2] = [400, 260];
const STEPS: usize = 6;
const SPEC: usize = 4;

/// cpu backend vs the f64 reference backend (relative L2 over all outputs).
pub const BACKEND_BOUND: f64 = 3e-3;
/// The device path (emulated GPU, or GPU 0) vs the f64 reference backend: the device
/// tolerance of tests/tests/device.rs (f32 accumulation, f16 probabilities in the MMA).
pub const DEVICE_BOUND: f64 = 3e-3;
/// k4v4 vs exact f32 attention (relative L2 of the layer output; measured 0.090).
///
/// The random projections give i.i.d. Gaussian-like K/V channels, the hardest case for
/// a per-group quantizer: a group of 64 spans about 4.8 standard deviations, so 4 bits
/// (15 steps) leave an rms error of about 4.8 / 15 / sqrt(12) = 0.09 of the signal per
/// element, and averaging over tokens shrinks signal and error alike. Real models' K/V
/// do better (`docs/src/accuracy.md`).
pub const K4V4_BOUND: f64 = 0.11;
/// k2v2 vs exact f32 attention (relative L2 of the layer output; measured 0.395: 2 bits
/// are 3 steps over 0.8 of the key range, the most recent 128 tokens and 4 sinks in f16).
pub const K2V2_BOUND: f64 = 0.45;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// xorshift64* with Box-Muller normals: fixed-seed weights without candle's CPU rng.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (a, b) = (self.uniform(), self.uniform());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }
    fn tensor(&mut self, rows: usize, cols: usize, std: f32) -> Res<Tensor> {
        let v: Vec<f32> = (0..rows * cols).map(|_| self.normal() * std).collect();
        Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
    }
}

struct Weights {
    /// `[(HQ + 2 HKV) * HEAD_DIM, HIDDEN]`: q, k and v rows stacked.
    wqkv: Tensor,
    /// `[HIDDEN, HQ * HEAD_DIM]`.
    wo: Tensor,
}

/// q `[n, HQ, D]` and k `[n, HKV, D]` with RoPE at `positions`, v `[n, HKV, D]` (a
/// strided view of the fused projection).
fn qkv(w: &Weights, x: &Tensor, positions: &[usize]) -> Res<(Tensor, Tensor, Tensor)> {
    let n = x.dim(0)?;
    let fused = x.matmul(&w.wqkv.t()?)?.reshape((n, HQ + 2 * HKV, HEAD_DIM))?;
    let q = rope(&fused.narrow(1, 0, HQ)?, positions)?;
    let k = rope(&fused.narrow(1, HQ, HKV)?, positions)?;
    let v = fused.narrow(1, HQ + HKV, HKV)?;
    Ok((q, k, v))
}

/// Rotary embedding (the "rotate half" form, base 10000) of `x` `[n, heads, D]`, row `i`
/// at position `positions[i]`.
fn rope(x: &Tensor, positions: &[usize]) -> Res<Tensor> {
    let half = HEAD_DIM / 2;
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for i in 0..half {
            let theta = p as f64 / 10000f64.powf(2.0 * i as f64 / HEAD_DIM as f64);
            cos.push(theta.cos() as f32);
            sin.push(theta.sin() as f32);
        }
    }
    let cos = Tensor::from_vec(cos, (positions.len(), 1, half), &Device::Cpu)?;
    let sin = Tensor::from_vec(sin, (positions.len(), 1, half), &Device::Cpu)?;
    let (x1, x2) = (x.narrow(D::Minus1, 0, half)?, x.narrow(D::Minus1, half, half)?);
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
    Ok(Tensor::cat(&[a, b], D::Minus1)?)
}

/// candle's f32 softmax attention of one query row `q` `[HQ, D]` over `k`, `v`
/// `[n, HKV, D]` (grouped-query: query head `h` reads KV head `h / (HQ / HKV)`).
fn exact_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Res<Tensor> {
    let g = HQ / HKV;
    let q = q.reshape((HKV, g, HEAD_DIM))?;
    let k = k.transpose(0, 1)?.contiguous()?; // [HKV, n, D]
    let v = v.transpose(0, 1)?.contiguous()?;
    let scores = (q.matmul(&k.t()?)? * (1.0 / (HEAD_DIM as f64).sqrt()))?; // [HKV, g, n]
    let e = scores.broadcast_sub(&scores.max_keepdim(D::Minus1)?)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    Ok(p.matmul(&v)?.reshape((HQ, HEAD_DIM))?)
}

/// The output projection of attention rows `[n, HQ, D]`: `[n, HIDDEN]`.
fn project_out(w: &Weights, attn: &Tensor) -> Res<Tensor> {
    let n = attn.dim(0)?;
    Ok(attn.reshape((n, HQ * HEAD_DIM))?.matmul(&w.wo.t()?)?)
}

/// Squared-error accumulator for a relative L2 error.
#[derive(Default)]
struct Err2 {
    diff: f64,
    norm: f64,
}
impl Err2 {
    fn add(&mut self, got: &Tensor, want: &Tensor) -> Res<()> {
        let (g, w) = (got.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
        for (a, b) in g.iter().zip(&w) {
            self.diff += f64::from(a - b).powi(2);
            self.norm += f64::from(*b).powi(2);
        }
        Ok(())
    }
    fn rel(&self) -> f64 {
        (self.diff / self.norm.max(f64::MIN_POSITIVE)).sqrt()
    }
}

/// Where the device path runs: GPU 0 through candle when built with `candle-cuda` and a
/// GPU is present, else the emulated GPU with CPU tensors; its name for the output.
fn device_path() -> Res<(rotkv::device::Device, Device, &'static str)> {
    #[cfg(feature = "candle-cuda")]
    if let Ok(cuda) = Device::new_cuda(0) {
        return Ok((rotkv::candle::cuda_device(&cuda)?, cuda, "GPU 0"));
    }
    Ok((rotkv::device::Device::sim(), Device::Cpu, "emulated GPU"))
}

/// Relative errors of one configuration: (cpu vs exact, reference vs exact, cpu vs
/// reference, device path vs reference).
fn run_config(name: &str, config: CacheConfig, w: &Weights, rng: &mut Rng) -> Res<(f64, f64, f64, f64)> {
    let total = PROMPTS.iter().max().copied().unwrap_or(0) + STEPS;
    let shape =
        CacheShape { layers: 1, num_kv_heads: HKV, num_q_heads: HQ, max_seqs: 2, max_tokens: total, num_blocks: None };
    let mut caches = [KvCache::new(config, shape, Backend::Cpu)?, KvCache::new(config, shape, Backend::Reference)?];
    // Each cache's own ids of the two sequences (an id names its cache).
    let mut ids = Vec::new();
    for c in &mut caches {
        ids.push([c.add_sequence()?, c.add_sequence()?]);
    }
    // The device path: one layer, one plan for both sequences; `on` moves a tensor to
    // its device (a no-op on the emulator).
    let (dev, tdev, place) = device_path()?;
    let on = |t: &Tensor| t.to_device(&tdev);
    let back = |t: Tensor| t.to_device(&Device::Cpu);
    let mut layer = DeviceLayer::new(
        &dev,
        config,
        LayerShape { num_kv_heads: HKV, num_q_heads: HQ },
        LayerCalibration::identity(HKV, HEAD_DIM),
        LayerSize { max_seqs: 2, max_tokens: total, num_blocks: None },
    )?;
    let dids = [layer.add_sequence()?, layer.add_sequence()?];
    let mut plan = DecodePlan::new(
        &layer,
        PlanShape {
            max_seqs: 2,
            max_q_len: SPEC,
            max_context: total,
            sm_count: None,
            blocks_per_sm: None,
            sm_scale: None,
        },
    )?;
    let (mut cpu_exact, mut ref_exact, mut cpu_ref) = (Err2::default(), Err2::default(), Err2::default());
    let mut dev_ref = Err2::default();
    // The unquantized history candle attends over: per sequence, k and v `[n, HKV, D]`.
    let mut hist: Vec<(Tensor, Tensor)> = Vec::new();
    // Prefill: append each prompt, keep the last SPEC query rows for a causal multi-token
    // decode of both sequences at once.
    let mut spec_q = Vec::new();
    let mut spec_exact = Vec::new();
    for (s, &n) in PROMPTS.iter().enumerate() {
        let x = rng.tensor(n, HIDDEN, 1.0)?;
        let (q, k, v) = qkv(w, &x, &(0..n).collect::<Vec<_>>())?;
        for (c, id) in caches.iter_mut().zip(&ids) {
            rotkv::candle::append(c, 0, id[s], &k, &v)?;
        }
        // RoPE made k a new contiguous tensor; v is still a view of the fused projection
        // (rows 768 elements apart): the device append reads each at its own token
        // stride, in place.
        rotkv::candle::device_append(&mut layer, dids[s], &on(&k)?, &on(&v)?)?;
        for i in n - SPEC..n {
            let row = q.get(i)?;
            spec_exact.push(exact_attention(&row, &k.narrow(0, 0, i + 1)?, &v.narrow(0, 0, i + 1)?)?);
        }
        spec_q.push(q.narrow(0, n - SPEC, SPEC)?);
        hist.push((k, v));
    }
    let q = Tensor::cat(&spec_q, 0)?; // [2 * SPEC, HQ, D], seqs[0]'s rows first
    let outs: Vec<Tensor> = caches
        .iter()
        .zip(&ids)
        .map(|(c, id)| project_out(w, &rotkv::candle::decode_tokens(c, 0, id, SPEC, &q)?))
        .collect::<Res<_>>()?;
    // The plan's rows are slot s's q_len rows at s * q_len: the same order.
    let out = back(rotkv::candle::device_decode(&mut plan, &layer, SPEC, &on(&q)?)?)?;
    dev_ref.add(&project_out(w, &out)?, &outs[1])?;
    let exact = project_out(w, &Tensor::stack(&spec_exact, 0)?)?;
    cpu_exact.add(&outs[0], &exact)?;
    ref_exact.add(&outs[1], &exact)?;
    cpu_ref.add(&outs[0], &outs[1])?;

    // Generation: one new token per sequence per step, both decoded in one call.
    for step in 0..STEPS {
        let positions: Vec<usize> = PROMPTS.iter().map(|&p| p + step).collect();
        let x = rng.tensor(2, HIDDEN, 1.0)?;
        let (q, k, v) = qkv(w, &x, &positions)?;
        for i in 0..2 {
            let (ki, vi) = (k.narrow(0, i, 1)?, v.narrow(0, i, 1)?);
            for (c, id) in caches.iter_mut().zip(&ids) {
                rotkv::candle::append(c, 0, id[i], &ki, &vi)?;
            }
            rotkv::candle::device_append(&mut layer, dids[i], &on(&ki)?, &on(&vi)?)?;
            let grown = (Tensor::cat(&[&hist[i].0, &ki], 0)?, Tensor::cat(&[&hist[i].1, &vi], 0)?);
            hist[i] = grown;
        }
        let outs: Vec<Tensor> = caches
            .iter()
            .zip(&ids)
            .map(|(c, id)| project_out(w, &rotkv::candle::decode(c, 0, id, &q)?))
            .collect::<Res<_>>()?;
        let rows: Vec<Tensor> =
            (0..2).map(|i| exact_attention(&q.get(i)?, &hist[i].0, &hist[i].1)).collect::<Res<_>>()?;
        let exact = project_out(w, &Tensor::stack(&rows, 0)?)?;
        cpu_exact.add(&outs[0], &exact)?;
        ref_exact.add(&outs[1], &exact)?;
        cpu_ref.add(&outs[0], &outs[1])?;
        let out = back(rotkv::candle::device_decode(&mut plan, &layer, 1, &on(&q)?)?)?;
        dev_ref.add(&project_out(w, &out)?, &outs[1])?;
    }
    let lens: Vec<usize> = ids[0].iter().map(|&s| caches[0].len(0, s)).collect::<rotkv::Result<_>>()?;
    println!(
        "{name}: lens {lens:?}, {} query rows; rel. L2 error vs exact f32 attention: cpu {:.4}, reference {:.4}; \
         cpu vs reference {:.2e}; device path ({place}) vs reference {:.2e}",
        2 * (SPEC + STEPS),
        cpu_exact.rel(),
        ref_exact.rel(),
        cpu_ref.rel(),
        dev_ref.rel()
    );
    Ok((cpu_exact.rel(), ref_exact.rel(), cpu_ref.rel(), dev_ref.rel()))
}

/// Runs both configurations and asserts the bounds.
pub fn main() -> Res<()> {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let w = Weights {
        wqkv: rng.tensor((HQ + 2 * HKV) * HEAD_DIM, HIDDEN, 1.0 / (HIDDEN as f32).sqrt())?,
        wo: rng.tensor(HIDDEN, HQ * HEAD_DIM, 1.0 / ((HQ * HEAD_DIM) as f32).sqrt())?,
    };
    assert_eq!(w.wqkv.dtype(), DType::F32);
    for (name, config, bound) in
        [("k4v4", CacheConfig::k4v4(HEAD_DIM), K4V4_BOUND), ("k2v2", CacheConfig::k2v2(HEAD_DIM), K2V2_BOUND)]
    {
        let (cpu, reference, backends, device) = run_config(name, config, &w, &mut rng)?;
        assert!(backends < BACKEND_BOUND, "{name}: cpu vs reference {backends:.2e} >= {BACKEND_BOUND:.0e}");
        assert!(device < DEVICE_BOUND, "{name}: device path vs reference {device:.2e} >= {DEVICE_BOUND:.0e}");
        assert!(cpu < bound, "{name}: error vs exact attention {cpu:.4} >= {bound}");
        assert!(
            (cpu - reference).abs() < 0.1 * reference,
            "{name}: cpu error {cpu:.4} and reference error {reference:.4} should be the same size"
        );
    }
    println!(
        "ok (bounds: k4v4 {K4V4_BOUND}, k2v2 {K2V2_BOUND}, cpu vs reference {BACKEND_BOUND:.0e}, device path vs \
         reference {DEVICE_BOUND:.0e})"
    );
    Ok(())
}
