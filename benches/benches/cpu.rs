//! CPU benchmarks: decode (k2v2 and k4v2, each with the exact f32 and the integer key
//! paths, against an f16 baseline and a memcpy of the f16 cache's size, all in one run),
//! append (Hadamard and learned dense rotations), FWHT against FFHT, and the extra
//! per-cached-key work a pre-RoPE key cache would add to decode (`prerope/...`: inverse
//! FWHT and RoPE of every key, beside the k2v2 decode of the same token-heads).
//!
//! `cargo bench -p rotkv-benches --bench cpu` (all) or with a filter, e.g.
//! `cargo bench -p rotkv-benches --bench cpu -- decode/d64`. Set `ROTKV_BENCH_MAX_CTX`
//! to cap the context (default 32768). Throughput is bytes of cache read per step.

use criterion::measurement::Measurement;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rotkv::paged::KeyScores;
use rotkv::{CacheConfig, f16};
use rotkv_benches::{
    AppendInput, BATCH, DECODE_SHAPES as SHAPES, Shape, append_prefill, f16_cache, filled_cache, synthetic_rows,
    warm_append_cache,
};
use std::hint::black_box;

fn max_ctx() -> usize {
    std::env::var("ROTKV_BENCH_MAX_CTX").ok().and_then(|s| s.parse().ok()).unwrap_or(32 * 1024)
}

fn bench_decode<M: Measurement>(c: &mut Criterion<M>, prefix: &str, shape: Shape) {
    let mut group = c.benchmark_group(format!("{prefix}/{}", shape.name));
    group.sample_size(10);
    group.warm_up_time(std::time::Duration::from_millis(500));
    group.measurement_time(std::time::Duration::from_secs(2));
    let ctxs: Vec<usize> = [1024, 4096, 16384, 32768].into_iter().filter(|&c| c <= max_ctx()).collect();
    for &ctx in &ctxs {
        let Shape { hkv, hq, d, .. } = shape;
        let q = synthetic_rows(BATCH * hq, d, 77);
        let mut out = vec![0f32; BATCH * hq * d];
        // The quantized caches, each with its exact and integer key paths.
        for (name, config) in [("k2v2", CacheConfig::k2v2(d)), ("k4v2", CacheConfig::k4v2(d))] {
            let (mut cache, seqs) = filled_cache(config, shape, ctx);
            let quant_bytes = BATCH * hkv * ctx * config.bytes_per_token().expect("config");
            group.throughput(Throughput::Bytes(quant_bytes as u64));
            for (path, keys) in [("", KeyScores::Exact), ("_int8", KeyScores::Int8), ("_int8x2", KeyScores::Int8x2)] {
                cache.set_key_scores(keys);
                group.bench_with_input(BenchmarkId::new(format!("{name}{path}"), ctx), &ctx, |bch, _| {
                    bch.iter(|| cache.decode(0, &seqs, black_box(&q), &mut out).expect("decode"))
                });
            }
        }
        // f16 baseline layout: [seq][kv_head][ctx][d].
        let (k16, v16) = f16_cache(shape, ctx);
        let f16_bytes = BATCH * hkv * ctx * d * 4;
        let splits = rotkv::cpu::default_splits(ctx, BATCH, hkv, rayon::current_num_threads()) as usize;
        group.throughput(Throughput::Bytes(f16_bytes as u64));
        group.bench_with_input(BenchmarkId::new("f16", ctx), &ctx, |bch, _| {
            bch.iter(|| rotkv::cpu::decode_f16_baseline(&k16, &v16, ctx, hkv, hq, d, splits, black_box(&q), &mut out))
        });
        // memcpy of the f16 cache's size: the machine's copy bandwidth in this run.
        let src: Vec<u8> = bytemuck_bytes(&k16).iter().chain(bytemuck_bytes(&v16)).copied().collect();
        drop((k16, v16));
        let mut dst = vec![0u8; src.len()];
        group.bench_with_input(BenchmarkId::new("memcpy_f16_size", ctx), &ctx, |bch, _| {
            bch.iter(|| dst.copy_from_slice(black_box(&src)))
        });
    }
    group.finish();
}

fn bytemuck_bytes(x: &[f16]) -> &[u8] {
    rotkv_benches::as_bytes(x)
}

fn decode(c: &mut Criterion) {
    SHAPES.into_iter().for_each(|s| bench_decode(c, "decode", s));
}

/// The decode benchmarks again in process CPU time (`decode_cputime/...`), only when
/// `ROTKV_BENCH_CPU_TIME` is set: on a shared machine whose other jobs take the cores,
/// wall time measures the scheduler, CPU time the kernels.
fn decode_cputime(c: &mut Criterion<cputime::CpuTime>) {
    if std::env::var_os("ROTKV_BENCH_CPU_TIME").is_some() {
        SHAPES.into_iter().for_each(|s| bench_decode(c, "decode_cputime", s));
    }
}

mod cputime {
    //! A criterion measurement of the process's CPU time (all threads), in nanoseconds.
    use criterion::Throughput;
    use criterion::measurement::{Measurement, ValueFormatter};

    pub struct CpuTime;

    fn now_ns() -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the
        // kernel knows.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    impl Measurement for CpuTime {
        type Intermediate = u64;
        type Value = u64;
        fn start(&self) -> u64 {
            now_ns()
        }
        fn end(&self, i: u64) -> u64 {
            now_ns() - i
        }
        fn add(&self, a: &u64, b: &u64) -> u64 {
            a + b
        }
        fn zero(&self) -> u64 {
            0
        }
        fn to_f64(&self, v: &u64) -> f64 {
            *v as f64
        }
        fn formatter(&self) -> &dyn ValueFormatter {
            &CpuTimeFormatter
        }
    }

    struct CpuTimeFormatter;

    impl ValueFormatter for CpuTimeFormatter {
        fn scale_values(&self, _typical: f64, values: &mut [f64]) -> &'static str {
            values.iter_mut().for_each(|v| *v /= 1e6);
            "ms (cpu)"
        }
        fn scale_throughputs(&self, _typical: f64, throughput: &Throughput, values: &mut [f64]) -> &'static str {
            let per = match *throughput {
                Throughput::Bytes(n) | Throughput::BytesDecimal(n) => n as f64,
                Throughput::Elements(n) => n as f64,
                Throughput::Bits(n) => n as f64 / 8.0,
                _ => 1.0,
            };
            values.iter_mut().for_each(|v| *v = per / *v);
            "GB/s (cpu)"
        }
        fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
            "ns"
        }
    }
}

fn append(c: &mut Criterion) {
    bench_append(c, "append");
}

/// The append benchmarks again in process CPU time (`append_cputime/...`), only when
/// `ROTKV_BENCH_CPU_TIME` is set (see [`decode_cputime`]). Append runs on both threads
/// and the memcpy on one, so in CPU time the ratio compares total work.
fn append_cputime(c: &mut Criterion<cputime::CpuTime>) {
    if std::env::var_os("ROTKV_BENCH_CPU_TIME").is_some() {
        bench_append(c, "append_cputime");
    }
}

/// Append of a 4096-token prefill into a warm cache (f32 input with Hadamard and with
/// learned dense rotations, f16 input), and a memcpy of the input in the same run; and,
/// f16 input only, a 16384-token prefill at head_dim 128: 67 MB of input, past the L3 of
/// the machines measured, so that its memcpy runs from DRAM (the 4096-token input, 16.8
/// MB, and its copy are about a 32 MiB L3, and its memcpy's speed moves with what other
/// processes hold there; docs/src/cpu.md, "Append against the input's size").
fn bench_append<M: Measurement>(c: &mut Criterion<M>, name: &str) {
    let mut group = c.benchmark_group(name);
    group.sample_size(10);
    let shapes = [
        ("d64_prefill4096", 3, 64, 4096, true),
        ("d128_prefill4096", 8, 128, 4096, true),
        ("d128_prefill16384", 8, 128, 16384, false),
    ];
    for (name, hkv, d, tokens, every_input) in shapes {
        let input = AppendInput::new(tokens, hkv, d);
        // "learned": the same append with dense D x D rotations (OptR's form; the Hadamard
        // matrix itself serves as the orthogonal matrix, the cost does not depend on it).
        let dense: Vec<f32> = (0..hkv)
            .flat_map(|_| {
                (0..d * d).map(move |ij| {
                    let s = 1.0 / (d as f32).sqrt();
                    if ((ij / d) & (ij % d)).count_ones().is_multiple_of(2) { s } else { -s }
                })
            })
            .collect();
        let mut learned = rotkv::LayerCalibration::identity(hkv, d);
        (learned.key_rotation, learned.value_rotation) = (Some(dense.clone()), Some(dense));
        // A warm cache (its pool written once before); each iteration adds a sequence,
        // appends the prefill and frees the sequence again.
        for (variant, calib, f16_input) in
            [("f32_input", None, false), ("f32_input_learned", Some(&learned), false), ("f16_input", None, true)]
        {
            if !every_input && !f16_input {
                continue;
            }
            let elem = if f16_input { 2 } else { 4 };
            group.throughput(Throughput::Bytes((tokens * hkv * d * 2 * elem) as u64));
            let mut cache = warm_append_cache(CacheConfig::k2v2(d), hkv, tokens, calib, &input);
            group.bench_function(BenchmarkId::new(variant, name), |b| {
                b.iter(|| append_prefill(&mut cache, tokens, &input, f16_input))
            });
        }
        // A memcpy of the keys and values given (f32 and f16), in the same run.
        for (variant, bytes) in
            [("memcpy_f32_input", tokens * hkv * d * 2 * 4), ("memcpy_f16_input", tokens * hkv * d * 2 * 2)]
        {
            if !every_input && variant == "memcpy_f32_input" {
                continue;
            }
            let src = vec![1u8; bytes];
            let mut dst = vec![0u8; bytes];
            group.throughput(Throughput::Bytes(bytes as u64));
            group.bench_function(BenchmarkId::new(variant, name), |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
        }
    }
    group.finish();
}

#[cfg(ffht)]
mod ffht {
    unsafe extern "C" {
        /// FFHT's in-place, unnormalized transform of `2^log_n` floats (0 on success).
        fn fht_float(buf: *mut f32, log_n: std::ffi::c_int) -> std::ffi::c_int;
    }

    /// FFHT on every row of `x` (rows of `d` floats).
    pub fn rows(x: &mut [f32], d: usize) {
        let log_n = d.trailing_zeros() as std::ffi::c_int;
        for row in x.chunks_exact_mut(d) {
            // SAFETY: `row` holds exactly 2^log_n floats, the buffer `fht_float`
            // transforms in place; it keeps no pointer past the call.
            let rc = unsafe { fht_float(row.as_mut_ptr(), log_n) };
            assert_eq!(rc, 0, "fht_float({log_n})");
        }
    }
}

/// rotkv's FWHT (orthonormal: it also scales by `1/sqrt(d)`) against FFHT
/// (unnormalized), row by row over 4096 rows per call, as append uses it; side by side.
fn fwht(c: &mut Criterion) {
    let mut group = c.benchmark_group("fwht");
    group.warm_up_time(std::time::Duration::from_millis(500));
    group.measurement_time(std::time::Duration::from_secs(2));
    #[cfg(not(ffht))]
    println!("SKIPPED: FFHT sources not found (../shared/third_party/ffht): rotkv's FWHT only");
    for d in [64, 128, 256] {
        let rows = 4096;
        let x = synthetic_rows(rows, d, 9);
        group.throughput(Throughput::Bytes((rows * d * 4) as u64));
        // A fresh copy per batch (not timed): FFHT's unnormalized output grows by sqrt(d)
        // per pass, so transforming the same buffer over and over would overflow.
        let fresh = || x.clone();
        let batch = criterion::BatchSize::LargeInput;
        group.bench_with_input(BenchmarkId::new("rotkv", d), &d, |b, &d| {
            b.iter_batched_ref(fresh, |x| x.chunks_exact_mut(d).for_each(rotkv::cpu::fwht), batch)
        });
        #[cfg(ffht)]
        {
            // Same values up to the scale (checked once, so the comparison is fair).
            let (mut a, mut f) = (synthetic_rows(2, d, 3), synthetic_rows(2, d, 3));
            a.chunks_exact_mut(d).for_each(rotkv::cpu::fwht);
            ffht::rows(&mut f, d);
            let s = (d as f32).sqrt();
            assert!(a.iter().zip(&f).all(|(a, f)| (a * s - f).abs() <= 1e-4 * (1.0 + f.abs())), "FFHT differs");
            group.bench_with_input(BenchmarkId::new("ffht", d), &d, |b, &d| {
                b.iter_batched_ref(fresh, |x| ffht::rows(x, d), batch)
            });
        }
    }
    group.finish();
}

/// The cost a pre-RoPE key cache (RotateKV: keys quantized before RoPE, RoPE
/// re-applied at decode) adds per cached key and decode step, beside the k2v2 decode of
/// the same token-heads in one run: `unrotate_rope` runs rotkv's FWHT (the inverse
/// Hadamard rotation) and RoPE (cos/sin tables precomputed per position, the cheapest
/// form) on 8 x 4096 dequantized key rows per KV head, single-threaded; `decode_k2v2`
/// is the CPU backend's decode of a batch of 8 sequences of 4096 tokens (all threads). Both
/// over `8 * 4096 * kv_heads` token-heads (the throughput's elements), so time / elements
/// is ns per token and KV head. Shapes: d64 (SmolLM2: 3 KV / 9 query heads), d128
/// (Llama 8B: 8 / 32), d256 (Gemma 3 270M: 1 / 4).
fn bench_prerope<M: Measurement>(c: &mut Criterion<M>, name: &str) {
    const CTX: usize = 4096;
    let shapes = [
        Shape { name: "d64", hkv: 3, hq: 9, d: 64 },
        Shape { name: "d128", hkv: 8, hq: 32, d: 128 },
        Shape { name: "d256", hkv: 1, hq: 4, d: 256 },
    ];
    for shape in shapes {
        let Shape { name: sname, hkv, hq, d } = shape;
        let mut group = c.benchmark_group(format!("{name}/{sname}"));
        group.sample_size(10);
        group.warm_up_time(std::time::Duration::from_millis(500));
        group.measurement_time(std::time::Duration::from_secs(2));
        let token_heads = BATCH * CTX * hkv;
        group.throughput(Throughput::Elements(token_heads as u64));
        let (cache, seqs) = filled_cache(CacheConfig::k2v2(d), shape, CTX);
        let q = synthetic_rows(BATCH * hq, d, 77);
        let mut out = vec![0f32; BATCH * hq * d];
        group.bench_function(BenchmarkId::new("decode_k2v2", CTX), |b| {
            b.iter(|| cache.decode(0, &seqs, black_box(&q), &mut out).expect("decode"))
        });
        drop(cache);
        // RoPE tables [pos][d / 2] (base 10,000), and the dequantized rows, [seq][pos][head].
        let half = d / 2;
        let (mut cos, mut sin) = (vec![0f32; CTX * half], vec![0f32; CTX * half]);
        for p in 0..CTX {
            for i in 0..half {
                let a = p as f32 / 10000f32.powf(2.0 * i as f32 / d as f32);
                (cos[p * half + i], sin[p * half + i]) = (a.cos(), a.sin());
            }
        }
        let mut rows = synthetic_rows(token_heads, d, 5);
        group.bench_function(BenchmarkId::new("unrotate_rope", CTX), |b| {
            b.iter(|| {
                for (i, row) in rows.chunks_exact_mut(d).enumerate() {
                    let p = i / hkv % CTX;
                    rotkv::cpu::fwht(row);
                    let (cs, sn) = (&cos[p * half..][..half], &sin[p * half..][..half]);
                    let (lo, hi) = row.split_at_mut(half);
                    for j in 0..half {
                        let (a, bb) = (lo[j], hi[j]);
                        lo[j] = a * cs[j] - bb * sn[j];
                        hi[j] = bb * cs[j] + a * sn[j];
                    }
                }
                black_box(&mut rows);
            })
        });
        group.finish();
    }
}

fn prerope(c: &mut Criterion) {
    bench_prerope(c, "prerope");
}

/// [`bench_prerope`] in process CPU time, only when `ROTKV_BENCH_CPU_TIME` is set (the
/// decode runs on every thread, the extra work on one: CPU time compares total work).
fn prerope_cputime(c: &mut Criterion<cputime::CpuTime>) {
    if std::env::var_os("ROTKV_BENCH_CPU_TIME").is_some() {
        bench_prerope(c, "prerope_cputime");
    }
}

criterion_group!(benches, decode, append, fwht, prerope);
criterion_group! {
    name = cpu_time;
    config = Criterion::default().with_measurement(cputime::CpuTime);
    targets = decode_cputime, append_cputime, prerope_cputime
}
criterion_main!(benches, cpu_time);
