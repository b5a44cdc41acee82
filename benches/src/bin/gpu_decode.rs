//! GPU decode benchmark (feature `cuda`; run by the GPU bundle's `run.sh`) on the device
//! API: a `DeviceLayer` filled by device appends, one `DecodePlan` per case, q_len 1 and
//! 4; median step time by CUDA events, bytes of packed cache read and GB/s, against a
//! device-to-device copy of the same bytes measured in the same run (a copy reads and
//! writes: it moves 2x its size). Each step is captured once into a CUDA graph and the
//! timed steps replay it; before timing, the graph is replayed after every sequence grew
//! by a few tokens and must give the same bytes as a plain `run` (the plan reads the
//! lengths on the device, so one graph serves a growing batch). Prints `SKIPPED` without
//! a CUDA device, and the table last.

use rotkv::cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use rotkv::device::{DecodePlan, Device, DeviceLayer, LayerSize, PlanShape};
use rotkv::paged::LayerShape;
use rotkv::{Backend, CacheConfig, LayerCalibration, f16};

/// Tokens each sequence grows by between a graph's capture and its replay, over both
/// q_len cases (GB/s counts the tokens actually read).
const GROW: usize = 3;

struct Row {
    d: usize,
    preset: &'static str,
    batch: usize,
    context: usize,
    q_len: usize,
    step_s: f64,
    gbs: f64,
    copy_gbs: f64,
}

#[allow(clippy::too_many_arguments)]
fn case(
    dev: &Device,
    config: CacheConfig,
    hkv: usize,
    hq: usize,
    batch: usize,
    context: usize,
    iters: usize,
) -> rotkv::Result<Vec<(usize, usize, f64)>> {
    let d = config.head_dim;
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let size = LayerSize { max_seqs: batch, max_tokens: context + GROW, num_blocks: None };
    let mut layer = DeviceLayer::new(dev, config, shape, LayerCalibration::identity(hkv, d), size)?;
    let rows: Vec<f16> = (0..context * hkv * d)
        .map(|i| f16::from_f32(((i.wrapping_mul(2_654_435_761) >> 7) % 2000) as f32 / 500.0 - 2.0))
        .collect();
    let kv = dev.upload(&rows)?;
    let mut seqs = Vec::new();
    for _ in 0..batch {
        let s = layer.add_sequence()?;
        layer.append(s, context, &kv, &kv, hkv * d)?;
        seqs.push(s);
    }
    drop(kv);
    let shape = PlanShape {
        max_seqs: batch,
        max_q_len: 4,
        max_context: context + GROW,
        sm_count: None,
        blocks_per_sm: None,
        sm_scale: None,
    };
    let mut plan = DecodePlan::new(&layer, shape)?;
    let stream = dev.stream().expect("a cuda device").clone();
    let cuda = |what: &'static str| move |e| rotkv::Error::Backend(format!("{what}: {e:?}"));
    let mut out = Vec::new();
    for q_len in [1, 4] {
        let n = batch * q_len * hq * d;
        let q = dev.upload(&(0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect::<Vec<f32>>())?;
        let mut o = dev.alloc::<f16>(n)?;
        // One step captured into a graph (no sync, allocation or copy may happen inside).
        plan.run(&layer, q_len, &q, &mut o)?;
        dev.synchronize()?;
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda("begin_capture"))?;
        let captured = plan.run(&layer, q_len, &q, &mut o);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(cuda("end_capture"))?;
        captured?;
        let graph = graph.ok_or_else(|| rotkv::Error::Backend("end_capture gave no graph".into()))?;
        // The sequences grow; the same graph must decode the new lengths.
        let grow = if q_len == 1 { 1 } else { GROW - 1 };
        let extra = dev.upload(&vec![f16::from_f32(0.25); grow * hkv * d])?;
        for &s in &seqs {
            layer.append(s, grow, &extra, &extra, hkv * d)?;
        }
        graph.launch().map_err(cuda("graph launch"))?;
        let mut replayed = vec![f16::ZERO; n];
        dev.read(&o, &mut replayed)?;
        plan.run(&layer, q_len, &q, &mut o)?;
        let mut plain = vec![f16::ZERO; n];
        dev.read(&o, &mut plain)?;
        if replayed.iter().zip(&plain).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(rotkv::Error::Backend(format!("q_len {q_len}: the replayed graph differs from a plain run")));
        }
        let tokens = layer.len(seqs[0])?;
        out.push((q_len, tokens, dev.time(3, iters, || graph.launch().map_err(cuda("graph launch")))?));
    }
    Ok(out)
}

fn main() -> std::process::ExitCode {
    if !Backend::Cuda.available() {
        println!("SKIPPED: gpu_decode (no CUDA driver or device on this machine)");
        return std::process::ExitCode::SUCCESS;
    }
    let dev = rotkv::cuda::cudarc::driver::CudaContext::new(0)
        .and_then(|ctx| ctx.new_stream())
        .map_err(|e| rotkv::Error::Backend(format!("{e:?}")))
        .and_then(Device::cuda);
    let dev = match dev {
        Ok(d) => d,
        Err(e) => {
            println!("gpu_decode: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // Keep the device pool under ~6 GB per case.
    let limit = 6usize << 30;
    let mut table = Vec::new();
    let mut failed = false;
    for (d, hkv, hq) in [(64, 3, 9), (128, 8, 32), (256, 8, 16)] {
        for preset in ["k2v2", "k4v2"] {
            let config = CacheConfig::preset(preset, d).expect("known preset");
            let per_token = config.bytes_per_token().expect("supported") * hkv;
            for batch in [1, 8, 64] {
                for context in [1024, 8192, 32768, 131072] {
                    let bytes = batch * context * per_token;
                    if bytes > limit {
                        continue;
                    }
                    let copy = dev.alloc::<u8>(bytes).and_then(|a| {
                        let mut b = dev.alloc::<u8>(bytes)?;
                        dev.time(3, 20, || dev.copy(&a, &mut b))
                    });
                    match (case(&dev, config, hkv, hq, batch, context, 20), copy) {
                        (Ok(steps), Ok(copy_s)) => {
                            for (q_len, tokens, step_s) in steps {
                                let read = batch * tokens * per_token;
                                let row = Row {
                                    d,
                                    preset,
                                    batch,
                                    context,
                                    q_len,
                                    step_s,
                                    gbs: read as f64 / step_s / 1e9,
                                    copy_gbs: 2.0 * bytes as f64 / copy_s / 1e9,
                                };
                                println!(
                                    "D {d} {preset} batch {batch} context {context} q_len {q_len}: {:.3} ms",
                                    step_s * 1e3
                                );
                                table.push(row);
                            }
                        }
                        (Err(e), _) | (_, Err(e)) => {
                            println!("D {d} {preset} batch {batch} context {context}: error: {e}");
                            failed = true;
                        }
                    }
                }
            }
        }
    }
    println!();
    println!(
        "{:>4} {:>5} {:>6} {:>7} {:>5} {:>9} {:>9} {:>9} {:>7}",
        "D", "bits", "batch", "context", "q_len", "ms/step", "GB/s", "copy GB/s", "ratio"
    );
    for r in &table {
        println!(
            "{:>4} {:>5} {:>6} {:>7} {:>5} {:>9.3} {:>9.1} {:>9.1} {:>7.2}",
            r.d,
            r.preset,
            r.batch,
            r.context,
            r.q_len,
            r.step_s * 1e3,
            r.gbs,
            r.copy_gbs,
            r.gbs / r.copy_gbs
        );
    }
    if failed { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS }
}
