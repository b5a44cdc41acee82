//! CPU decode speed on a busy machine: the best step of many, in one process.
//!
//! Criterion's medians (`cargo bench --bench cpu`) include whatever else the machine
//! runs; on a shared two-core machine its neighbouring cells differ by 10-40%. This
//! binary builds the same caches as the criterion decode benchmarks (batch 8, one layer,
//! the rayon pool's threads), then alternates, round after round, a few steps of the f16
//! baseline and of each packed cache over the same tokens, and reports the best step of
//! each: what each path costs when nothing disturbs it, side by side in one run.
//!
//! `cargo run --release -p rotkv-benches --bin cpu_decode_best -- [context] [rounds]`
//! (defaults 32768 and 5). Where the processor has AVX-512 F, the packed caches are timed
//! with the 512-bit kernels and with the 256-bit ones, alternating in the same rounds
//! (`rotkv::cpu::set_avx512`), one row each.

use rotkv::CacheConfig;
use rotkv_benches::{BATCH, DECODE_SHAPES, f16_cache, filled_cache, synthetic_rows};
use std::hint::black_box;
use std::time::Instant;

/// f16 baseline steps per round.
const F16_STEPS: usize = 3;
/// Steps of each packed cache per round.
const PACKED_STEPS: usize = 5;

fn main() {
    let mut args = std::env::args().skip(1);
    let parse = |a: Option<String>, default: usize, what: &str| match a {
        None => default,
        Some(s) => s.parse().unwrap_or_else(|_| {
            eprintln!("{what}: expected a positive integer, got {s:?}");
            std::process::exit(2)
        }),
    };
    let ctx = parse(args.next(), 32768, "context");
    let rounds = parse(args.next(), 5, "rounds");
    if ctx == 0 || rounds == 0 {
        eprintln!("context and rounds must be positive");
        std::process::exit(2);
    }
    let kernels = rotkv::cpu::kernels();
    // Where the 512-bit kernels run, the 256-bit ones are timed too, alternating in the
    // same rounds (`rotkv::cpu::set_avx512`).
    let both = kernels == "avx512";
    let sets: &[(bool, &str)] = if both { &[(true, "avx512"), (false, "avx2")] } else { &[(false, kernels)] };
    println!(
        "best of {} f16 and {} packed steps (batch {BATCH}, {} threads, context {ctx}, kernels: {})",
        rounds * F16_STEPS,
        rounds * PACKED_STEPS,
        rayon::current_num_threads(),
        sets.iter().map(|s| s.1).collect::<Vec<_>>().join(", ")
    );
    println!("| shape | kernels | f16 ms | k2v2 ms | k2v2 vs f16 | k4v2 ms | k4v2 vs f16 |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for shape in DECODE_SHAPES {
        let (hkv, hq, d) = (shape.hkv, shape.hq, shape.d);
        let q = synthetic_rows(BATCH * hq, d, 77);
        let mut out = vec![0f32; BATCH * hq * d];
        let (k16, v16) = f16_cache(shape, ctx);
        let splits = rotkv::cpu::default_splits(ctx, BATCH, hkv, rayon::current_num_threads()) as usize;
        let mut packed: Vec<_> =
            [CacheConfig::k2v2(d), CacheConfig::k4v2(d)].into_iter().map(|c| filled_cache(c, shape, ctx)).collect();
        let mut f16_best = f64::INFINITY;
        // [kernel set][k2v2, k4v2]
        let mut best = vec![[f64::INFINITY; 2]; sets.len()];
        let time = |best: &mut f64, f: &mut dyn FnMut()| {
            let t0 = Instant::now();
            f();
            *best = best.min(t0.elapsed().as_secs_f64() * 1e3);
        };
        for _ in 0..rounds {
            for _ in 0..F16_STEPS {
                time(&mut f16_best, &mut || {
                    rotkv::cpu::decode_f16_baseline(&k16, &v16, ctx, hkv, hq, d, splits, black_box(&q), &mut out)
                });
            }
            for (set, &(wide, _)) in sets.iter().enumerate() {
                // With one kernel set, the process's own choice stands (`ROTKV_CPU_ISA`).
                if both {
                    rotkv::cpu::set_avx512(wide);
                }
                for (i, (cache, seqs)) in packed.iter_mut().enumerate() {
                    for _ in 0..PACKED_STEPS {
                        time(&mut best[set][i], &mut || {
                            cache.decode(0, seqs, black_box(&q), &mut out).expect("decode")
                        });
                    }
                }
            }
        }
        if both {
            rotkv::cpu::set_avx512(true);
        }
        for (&(_, name), b) in sets.iter().zip(&best) {
            println!(
                "| {} | {name} | {:.2} | {:.2} | {:.2}x | {:.2} | {:.2}x |",
                shape.name,
                f16_best,
                b[0],
                f16_best / b[0],
                b[1],
                f16_best / b[1]
            );
        }
    }
}
