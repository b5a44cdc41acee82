//! GPU benchmark (feature `cuda`; run by the GPU bundle's `run.sh`) on the device API:
//! decode steps, batched appends and a prefill chunk from the packed cache, each case
//! named as in `kernels-gpu/perf-gate.toml` so its modeled figure (`cargo xtask sass`)
//! can be printed beside the measured one.
//!
//! Method (for every case):
//! - Each sample runs once with a cold L2: a 256 MiB memset before the timed work
//!   evicts the cache and keeps the stream busy while the host enqueues, so neither the
//!   launch latency nor a warm L2 is inside the number. The medians of `SAMPLES` samples
//!   between two CUDA events are reported.
//! - A decode step is captured once into a CUDA graph and the samples replay it. Before
//!   timing, the graph is replayed after every sequence grew and must give the same bytes
//!   as a plain `run` (the plan reads the lengths on the device, so one graph serves a
//!   growing batch).
//! - Bytes: the packed cache read (decode), K/V in plus packed pages out (append); a
//!   device-to-device copy of the same bytes is timed the same way in the same run (a
//!   copy reads and writes: it moves 2x its size).
//!
//! Arguments: `--seconds N` stops starting new cases after N seconds (the cases run in
//! order of value: the gated decode cases first) and lists those left out;
//! `--modeled FILE` reads `cargo xtask sass` output and prints its modeled step time
//! beside each case of the same name; `--only A,B` runs the cases whose names contain A
//! or B (for a profiler run); `--compare FILE` runs every case a second time on the
//! device code of FILE (a `cargo xtask ptx` output of another revision with this
//! build's entry points: the same lend measures both, side by side). Prints `SKIPPED` without a CUDA device, and the table
//! last.

use std::sync::Arc;

use rotkv::cuda::cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use rotkv::cuda::cudarc::driver::{CudaSlice, CudaStream};
use rotkv::device::{DecodePlan, Device, DeviceLayer, LayerSize, PlanShape, StepBatch};
use rotkv::paged::LayerShape;
use rotkv::{Backend, CacheConfig, LayerCalibration, SeqId, f16};

/// Timed samples per case (median reported).
const SAMPLES: usize = 15;
/// Bytes the memset before each sample writes (over 4x the H200's 60 MB L2).
const FLUSH_BYTES: usize = 256 << 20;

#[derive(Clone, Copy)]
enum Kind {
    /// Decode steps of `q_len` query tokens per sequence.
    Decode { q_len: usize, protect: bool },
    /// `chunk` new tokens for each of `batch` sequences in one `append_batch`.
    Append { chunk: usize },
    /// One sequence: a chunk of `q_len` prompt tokens attending to `context` cached ones
    /// and causally to itself (`DecodePlan::run_batch`).
    Prefill { q_len: usize },
}

struct Case {
    name: String,
    preset: &'static str,
    d: usize,
    hkv: usize,
    gqa: usize,
    batch: usize,
    context: usize,
    kind: Kind,
    /// A change to the preset's configuration (group size, window, protected room).
    tweak: Option<fn(&mut CacheConfig)>,
}

impl Case {
    fn config(&self) -> rotkv::Result<CacheConfig> {
        let mut config = CacheConfig::preset(self.preset, self.d)?;
        if let Some(t) = self.tweak {
            t(&mut config);
        }
        Ok(config)
    }
}

struct Row {
    name: String,
    us: f64,
    bytes: usize,
    /// Tensor-core work (prefill), FLOP.
    flop: f64,
    copy_us: f64,
}

fn decode(name: &str, preset: &'static str, d: usize, hkv: usize, gqa: usize, batch: usize, ctx: usize) -> Case {
    Case {
        name: name.into(),
        preset,
        d,
        hkv,
        gqa,
        batch,
        context: ctx,
        kind: Kind::Decode { q_len: 1, protect: false },
        tweak: None,
    }
}

/// Every case, the most valuable first (the gated decode cases, then cliffs, shapes,
/// append and prefill).
fn cases() -> Vec<Case> {
    let k = 1024;
    let q = |mut c: Case, q_len: usize| {
        c.kind = Kind::Decode { q_len, protect: false };
        c
    };
    let mut v = vec![
        decode("mma d128 k2v2 gqa4 b8 32K q1", "k2v2", 128, 8, 4, 8, 32 * k),
        q(decode("mma d128 k2v2 gqa4 b8 32K q4", "k2v2", 128, 8, 4, 8, 32 * k), 4),
        decode("mma d128 k4v2 gqa4 b8 32K q1", "k4v2", 128, 8, 4, 8, 32 * k),
        decode("mma d128 k2v2 gqa8 b8 32K q1", "k2v2", 128, 8, 8, 8, 32 * k),
        decode("mma d64 k2v2 gqa3 b8 32K q1", "k2v2", 64, 3, 3, 8, 32 * k),
        decode("mma d256 k2v2 gqa2 b8 32K q1", "k2v2", 256, 8, 2, 8, 32 * k),
        decode("mma d256 k4v2 gqa2 b8 32K q1", "k4v2", 256, 8, 2, 8, 32 * k),
        decode("mma d128 k4v2 gqa8 b8 32K q1", "k4v2", 128, 8, 8, 8, 32 * k),
    ];
    let mut p = decode("mma d128 k2v2 gqa4 b8 32K q1 8 protected", "k2v2", 128, 8, 4, 8, 32 * k);
    p.kind = Kind::Decode { q_len: 1, protect: true };
    p.tweak = Some(|c| c.protected = PROTECTED.len());
    v.push(p);
    let mut w = decode("mma d128 k2v2 gqa4 b8 32K q1 window 0", "k2v2", 128, 8, 4, 8, 32 * k);
    w.tweak = Some(|c| c.window = 0);
    v.push(w);
    let mut g = decode("d128 k2v2 g32 gqa4 b8 32K q1", "k2v2", 128, 8, 4, 8, 32 * k);
    g.tweak = Some(|c| c.group_size = 32);
    v.push(g);
    v.push(q(decode("mma d128 k2v2 gqa8 b8 32K q4 (2 row tiles)", "k2v2", 128, 8, 8, 8, 32 * k), 4));
    v.push(q(decode("mma d128 k4v2 gqa8 b8 32K q4 (2 row tiles)", "k4v2", 128, 8, 8, 8, 32 * k), 4));
    v.push(decode("d128 k2v2 gqa4 b1 32K q1", "k2v2", 128, 8, 4, 1, 32 * k));
    v.push(decode("d128 k2v2 gqa4 b64 8K q1", "k2v2", 128, 8, 4, 64, 8 * k));
    v.push(decode("d128 k2v2 gqa4 b8 128K q1", "k2v2", 128, 8, 4, 8, 128 * k));
    v.push(decode("d128 k2v2 gqa4 b8 1K q1", "k2v2", 128, 8, 4, 8, k));
    for (chunk, batch) in [(2048, 8), (1, 64)] {
        v.push(Case {
            name: format!("append d128 k2v2 {batch} seqs x {chunk} tokens"),
            preset: "k2v2",
            d: 128,
            hkv: 8,
            gqa: 4,
            batch,
            context: 4 * k,
            kind: Kind::Append { chunk },
            tweak: None,
        });
    }
    v.push(Case {
        name: "mma d128 k2v2 gqa4 4K chunk over 32K".into(),
        preset: "k2v2",
        d: 128,
        hkv: 8,
        gqa: 4,
        batch: 1,
        context: 32 * k,
        kind: Kind::Prefill { q_len: 4 * k },
        tweak: None,
    });
    v
}

/// CUDA events around `f`, after a memset of `flush` that evicts the L2; seconds.
struct Timer {
    stream: Arc<CudaStream>,
    flush: CudaSlice<u8>,
}

fn backend<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> rotkv::Error {
    move |e| rotkv::Error::Backend(format!("{what}: {e:?}"))
}

impl Timer {
    /// Median of `samples` timed calls of `f` (no warm-up: the caller's).
    fn median(&mut self, samples: usize, mut f: impl FnMut() -> rotkv::Result<()>) -> rotkv::Result<f64> {
        let mut t = Vec::with_capacity(samples);
        for _ in 0..samples {
            self.stream.memset_zeros(&mut self.flush).map_err(backend("memset"))?;
            let start = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(backend("event"))?;
            f()?;
            let end = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(backend("event"))?;
            end.synchronize().map_err(backend("event"))?;
            t.push(start.elapsed_ms(&end).map_err(backend("elapsed"))? as f64 / 1e3);
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    }
}

/// Rows of f16 keys/values, different for every sequence `seed` (a hash, so a sequence
/// indexing bug cannot hide behind equal data).
fn rows(n: usize, seed: usize) -> Vec<f16> {
    (0..n)
        .map(|i| {
            let h = (i ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(2_654_435_761) >> 7;
            f16::from_f32((h % 2000) as f32 / 500.0 - 2.0)
        })
        .collect()
}

/// The protected positions of a decode case that asks for them: 8, as the recommended
/// recipe's detected sinks, early in the sequence (all in the first split).
const PROTECTED: [u32; 8] = [8, 16, 32, 64, 128, 256, 512, 1024];

/// A layer of `batch` sequences holding `context` tokens each (capacity `extra` more),
/// with [`PROTECTED`] for a decode case that asks for them.
fn layer(dev: &Device, c: &Case, extra: usize) -> rotkv::Result<(DeviceLayer, Vec<SeqId>)> {
    let config = c.config()?;
    let shape = LayerShape { num_kv_heads: c.hkv, num_q_heads: c.hkv * c.gqa };
    let size = LayerSize { max_seqs: c.batch, max_tokens: c.context + extra, num_blocks: None };
    let mut layer = DeviceLayer::new(dev, config, shape, LayerCalibration::identity(c.hkv, c.d), size)?;
    let mut seqs = Vec::new();
    // Sequences share uploads in groups of 8 (distinct data within a group).
    let kv: Vec<_> =
        (0..c.batch.min(8)).map(|i| dev.upload(&rows(c.context * c.hkv * c.d, i))).collect::<Result<_, _>>()?;
    for i in 0..c.batch {
        let s = layer.add_sequence()?;
        if let Kind::Decode { protect: true, .. } = c.kind {
            layer.protect(s, &PROTECTED)?;
        }
        layer.append(s, c.context, &kv[i % kv.len()], &kv[(i + 1) % kv.len()], c.hkv * c.d)?;
        seqs.push(s);
    }
    Ok((layer, seqs))
}

/// Seconds per step (cold L2), bytes moved, FLOP.
fn run_case(dev: &Device, timer: &mut Timer, c: &Case) -> rotkv::Result<(f64, usize, f64)> {
    let config = c.config()?;
    let per_token = config.bytes_per_token()? * c.hkv;
    let hq = c.hkv * c.gqa;
    match c.kind {
        Kind::Decode { q_len, .. } => {
            let grow = 2;
            let (mut layer, seqs) = layer(dev, c, grow)?;
            let shape = PlanShape {
                max_seqs: c.batch,
                max_q_len: q_len,
                max_context: c.context + grow,
                sm_count: None,
                blocks_per_sm: None,
                sm_scale: None,
            };
            let mut plan = DecodePlan::new(&layer, shape)?;
            let n = c.batch * q_len * hq * c.d;
            let q = dev.upload(&(0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect::<Vec<f32>>())?;
            let mut o = dev.alloc::<f16>(n)?;
            plan.run(&layer, q_len, &q, &mut o)?;
            dev.synchronize()?;
            let stream = timer.stream.clone();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(backend("capture"))?;
            let captured = plan.run(&layer, q_len, &q, &mut o);
            let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(backend("end_capture"))?;
            captured?;
            let graph = graph.ok_or_else(|| rotkv::Error::Backend("end_capture gave no graph".into()))?;
            let extra = dev.upload(&rows(grow * c.hkv * c.d, 99))?;
            for &s in &seqs {
                layer.append(s, grow, &extra, &extra, c.hkv * c.d)?;
            }
            graph.launch().map_err(backend("graph launch"))?;
            let mut replayed = vec![f16::ZERO; n];
            dev.read(&o, &mut replayed)?;
            plan.run(&layer, q_len, &q, &mut o)?;
            let mut plain = vec![f16::ZERO; n];
            dev.read(&o, &mut plain)?;
            if replayed.iter().zip(&plain).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(rotkv::Error::Backend("the replayed graph differs from a plain run".into()));
            }
            if plain.iter().any(|x| !x.is_finite()) {
                return Err(rotkv::Error::Backend("non-finite output".into()));
            }
            let t = timer.median(SAMPLES, || graph.launch().map_err(backend("graph launch")))?;
            Ok((t, c.batch * (c.context + grow) * per_token, 0.0))
        }
        Kind::Append { chunk } => {
            let steps = SAMPLES + 2;
            let (mut layer, seqs) = layer(dev, c, steps * chunk)?;
            for &s in &seqs {
                layer.reserve(s, c.context + steps * chunk)?;
            }
            let mut batch = StepBatch::new(dev, c.batch, c.batch * chunk)?;
            let kv = dev.upload(&rows(c.batch * chunk * c.hkv * c.d, 7))?;
            let stride = c.hkv * c.d;
            let list: Vec<(SeqId, usize)> = seqs.iter().map(|&s| (s, chunk)).collect();
            // Each sample appends one more chunk: the batch is set (an upload) before
            // the timed range; the first two are warm-ups.
            let mut times = Vec::new();
            for _ in 0..steps {
                batch.set(&layer, &list)?;
                times.push(timer.median(1, || layer.append_batch(&batch, &kv, stride, &kv, stride))?);
            }
            let e = batch.errors()?;
            if e != rotkv::device::BatchErrors::default() {
                return Err(rotkv::Error::Backend(format!("append_batch counted errors: {e:?}")));
            }
            let mut timed = times[2..].to_vec();
            timed.sort_by(f64::total_cmp);
            let input = 2 * c.batch * chunk * stride * 2;
            Ok((timed[timed.len() / 2], input + c.batch * chunk * per_token, 0.0))
        }
        Kind::Prefill { q_len } => {
            let (mut layer, seqs) = layer(dev, c, q_len)?;
            layer.reserve(seqs[0], c.context + q_len)?;
            let mut batch = StepBatch::new(dev, 1, q_len)?;
            batch.set(&layer, &[(seqs[0], q_len)])?;
            let stride = c.hkv * c.d;
            let kv = dev.upload(&rows(q_len * stride, 5))?;
            layer.append_batch(&batch, &kv, stride, &kv, stride)?;
            let shape = PlanShape {
                max_seqs: 1,
                max_q_len: q_len,
                max_context: c.context + q_len,
                sm_count: None,
                blocks_per_sm: None,
                sm_scale: None,
            };
            let mut plan = DecodePlan::new(&layer, shape)?;
            let n = q_len * hq * c.d;
            let q =
                dev.upload(&(0..n).map(|i| f16::from_f32(((i * 37 % 101) as f32 - 50.0) / 50.0)).collect::<Vec<_>>())?;
            let mut o = dev.alloc::<f16>(n)?;
            plan.run_batch(&layer, &batch, &q, hq * c.d, &mut o, hq * c.d)?;
            let t = timer.median(SAMPLES.min(7), || plan.run_batch(&layer, &batch, &q, hq * c.d, &mut o, hq * c.d))?;
            let mut out = vec![f16::ZERO; n];
            dev.read(&o, &mut out)?;
            if out.iter().any(|x| !x.is_finite()) {
                return Err(rotkv::Error::Backend("non-finite output".into()));
            }
            // QK^T and PV: 2 x 2 x D FLOP per (query head, query token, key token); the
            // chunk's own tokens causally (half of them on average).
            let keys = c.context as f64 + q_len as f64 / 2.0;
            let flop = 4.0 * (hq * c.d) as f64 * q_len as f64 * keys;
            Ok((t, (c.context + q_len) * per_token, flop))
        }
    }
}

/// `cargo xtask sass` table rows: case name -> modeled microseconds (decode cases: the
/// step level, which charges the measured fixed time and issue rate; prefill cases: the
/// largest bound).
fn modeled(path: &str) -> Vec<(String, f64)> {
    std::fs::read_to_string(path).map(|text| modeled_rows(&text)).unwrap_or_default()
}

/// [`modeled`] of the text of `cargo xtask sass`.
fn modeled_rows(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 10 || cells[1] != "H200" {
            continue;
        }
        let num = |s: &str| s.trim_end_matches('%').parse::<f64>().ok();
        // Decode rows (16 cells): the step-level us (cell 10); prefill rows (14 cells):
        // issue, tensor and DRAM us (cells 6-8), the largest bounds.
        let us = match cells.len() {
            16 => num(cells[10]),
            14 => [6, 7, 8].iter().filter_map(|&i| num(cells[i])).reduce(f64::max),
            _ => None,
        };
        if let Some(us) = us {
            out.push((cells[0].to_string(), us));
        }
    }
    out
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let budget = arg("--seconds").and_then(|s| s.parse::<f64>().ok()).unwrap_or(f64::INFINITY);
    let modeled = arg("--modeled").map(|p| modeled(&p)).unwrap_or_default();
    let only = arg("--only");
    let compare = match arg("--compare").map(|p| std::fs::read_to_string(&p).map(|t| (p, t))).transpose() {
        Ok(c) => c,
        Err(e) => {
            println!("gpu_decode: --compare: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if !Backend::Cuda.available() {
        println!("SKIPPED: gpu_decode (no CUDA driver or device on this machine)");
        return std::process::ExitCode::SUCCESS;
    }
    let setup = rotkv::cuda::cudarc::driver::CudaContext::new(0)
        .and_then(|ctx| ctx.new_stream())
        .map_err(|e| rotkv::Error::Backend(format!("{e:?}")))
        .and_then(|stream| {
            let flush = stream.alloc_zeros::<u8>(FLUSH_BYTES).map_err(backend("alloc"))?;
            let mut devices = vec![(String::new(), Device::cuda(stream.clone())?)];
            if let Some((path, text)) = &compare {
                let stem = std::path::Path::new(path).file_stem().map_or(path.clone(), |s| s.to_string_lossy().into());
                // SAFETY: the caller names a `cargo xtask ptx` output with this build's
                // entry points (the option's contract).
                devices.push((format!(" [{stem}]"), unsafe { Device::cuda_with_ptx(stream.clone(), text)? }));
            }
            Ok((devices, Timer { stream, flush }))
        });
    let (devices, mut timer) = match setup {
        Ok(d) => d,
        Err(e) => {
            println!("gpu_decode: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let start = std::time::Instant::now();
    let mut table = Vec::new();
    let mut failed = false;
    let mut left = Vec::new();
    for c in cases() {
        if only.as_deref().is_some_and(|o| !o.split(',').any(|w| c.name.contains(w))) {
            continue;
        }
        if start.elapsed().as_secs_f64() > budget {
            left.push(c.name);
            continue;
        }
        for (label, dev) in &devices {
            let t0 = std::time::Instant::now();
            let name = format!("{}{label}", c.name);
            let result = run_case(dev, &mut timer, &c).and_then(|(s, bytes, flop)| {
                let a = dev.alloc::<u8>(bytes.max(1))?;
                let mut b = dev.alloc::<u8>(bytes.max(1))?;
                dev.copy(&a, &mut b)?;
                let copy = timer.median(SAMPLES, || dev.copy(&a, &mut b))?;
                Ok(Row { name: name.clone(), us: s * 1e6, bytes, flop, copy_us: copy * 1e6 })
            });
            match result {
                Ok(r) => {
                    println!("{name}: {:.1} us ({:.1} s)", r.us, t0.elapsed().as_secs_f64());
                    table.push(r);
                }
                Err(e) => {
                    println!("{name}: error: {e}");
                    failed = true;
                }
            }
        }
    }
    if !left.is_empty() {
        println!("SKIPPED (--seconds {budget} spent): {}", left.join("; "));
    }
    println!();
    println!(
        "Measured on {} (cold L2, medians of {SAMPLES}); modeled = cargo xtask sass (static SASS proxy).",
        devices[0].1.name()
    );
    println!("| case | us | MB | GB/s | copy GB/s | of copy | modeled us | measured / modeled | TFLOP/s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &table {
        let gbs = r.bytes as f64 / r.us / 1e3;
        let copy = 2.0 * r.bytes as f64 / r.copy_us / 1e3;
        let m = modeled.iter().find(|(n, _)| *n == r.name).map(|&(_, us)| us);
        let (mus, ratio) = m.map_or(("-".into(), "-".into()), |m| (format!("{m:.1}"), format!("{:.2}", r.us / m)));
        let tf = if r.flop > 0.0 { format!("{:.1}", r.flop / r.us / 1e6) } else { "-".into() };
        println!(
            "| {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0}% | {mus} | {ratio} | {tf} |",
            r.name,
            r.us,
            r.bytes as f64 / 1e6,
            gbs,
            copy,
            100.0 * gbs / copy
        );
    }
    if failed { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS }
}

#[cfg(test)]
mod tests {
    /// Rows as `cargo xtask sass` prints them: the decode row's step level, the prefill
    /// row's largest bound; other tables and the H100 are skipped.
    #[test]
    fn modeled_rows_read_the_step_level() {
        let text = "\
| mma d128 k2v2 gqa4 b8 32K q1 | H200 | rotkv_decode_mma_d128_k2v2_g128 | 151.0 MB | 35.0 | 35.0 | 22.4 | 7.8 | issue | 99.9% | 127.2 | fixed + issue | 27.5% | 119.9 | 26% | yes |
| x (H100) | H100 | e | 151.0 MB | 50.1 | 35.0 | 22.4 | 7.8 | issue | 99.9% | 140.0 | fixed + issue | 30.0% | - | 26% | yes |
| mma d128 k2v2 gqa4 4K chunk over 32K | H200 | rotkv_decode_mma_d128_k2v2_g128 | 1024 | 2.20 | 2.06 | 4477 | 2118 | 4 | 19.3 GB | issue | 45.9% | 40% | yes |
| entry | sm_90 | 234 | 0 | 0 | 0 | 0 | 131 | 1 | 2 | 5201 | 4 | 8 (regs) |
";
        let rows = super::modeled_rows(text);
        assert_eq!(
            rows,
            vec![
                ("mma d128 k2v2 gqa4 b8 32K q1".to_string(), 127.2),
                ("mma d128 k2v2 gqa4 4K chunk over 32K".to_string(), 4477.0)
            ]
        );
    }
}
