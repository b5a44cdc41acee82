//! CPU append speed on a busy machine: the best call of many, in one process.
//!
//! The criterion append benchmark (`cargo bench --bench cpu -- append`) reports medians,
//! which on a shared two-core machine move by 20-40% with the neighbours' load. This
//! binary builds the same warm caches (k2v2, one layer, a 4096-token prefill by default;
//! head_dim 64 with 3 KV heads and head_dim 128 with 8), and one at head_dim 256 with 4
//! KV heads (Gemma 3's head size; not in the criterion benchmark), then alternates, round
//! after round, a few memcpys of the input and a few appends of each input type, and
//! reports the best call of each (and the median): side by side in one run, the append's
//! share of the memcpy's speed on the same bytes (best against best). Where the processor
//! has AVX-512 F, each append is timed with the 512-bit kernels and with the 256-bit
//! ones, alternating in the same rounds (`rotkv::cpu::set_avx512`), one row each.
//!
//! `cargo run --release -p rotkv-benches --bin cpu_append_best -- [rounds] [shape] [tokens]`
//! (default 50 rounds, every shape, 4096 tokens; a shape is picked by a part of its name,
//! as `d128` or `d128_prefill4096`, or `all`; a length needs a shape before it). Other
//! prefill lengths show how the append's time and the memcpy's scale with the input's
//! size: the memcpy of a 4096-token input at head_dim 128 (16.8 MB, 33.6 MB with its
//! copy) is about the 32 MiB L3 of the machines measured, and longer ones run from DRAM.
//! The last column is the append's wall time times its threads per row quantized into a
//! page (the rows of whole pages past the sinks and the window; `-` where no page fills):
//! flat across lengths where the append is bound by its instructions rather than by
//! memory (an upper bound on CPU time: a thread that waits is counted too).

use rotkv::CacheConfig;
use rotkv_benches::{AppendInput, append_prefill, warm_append_cache};
use std::hint::black_box;
use std::time::Instant;

/// Timed calls of each kind per round.
const CALLS: usize = 3;
/// Tokens of the prefill, by default.
const TOKENS: usize = 4096;

fn main() {
    let rounds = match std::env::args().nth(1) {
        None => 50,
        Some(s) => match s.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("rounds: expected a positive integer, got {s:?}");
                std::process::exit(2)
            }
        },
    };
    let tokens = match std::env::args().nth(3) {
        None => TOKENS,
        Some(s) => match s.parse::<u32>() {
            Ok(n) if n > 0 => n as usize,
            _ => {
                eprintln!("tokens: expected a positive integer below 2^32, got {s:?}");
                std::process::exit(2)
            }
        },
    };
    let kernels = rotkv::cpu::kernels();
    let both = kernels == "avx512";
    let sets: &[(bool, &str)] = if both { &[(true, "avx512"), (false, "avx2")] } else { &[(false, kernels)] };
    println!(
        "best of {} calls each (k2v2, {tokens}-token prefill into a warm cache, {} threads, kernels: {})",
        rounds * CALLS,
        rayon::current_num_threads(),
        sets.iter().map(|s| s.1).collect::<Vec<_>>().join(", ")
    );
    println!(
        "| shape | input | kernels | memcpy of the input ms | append ms | median ms | GB/s of input | vs memcpy | ns per paged row x threads |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    let only = std::env::args().nth(2).filter(|o| o != "all");
    let mut matched = false;
    for (name, hkv, d) in [("d64", 3usize, 64usize), ("d128", 8, 128), ("d256", 4, 256)] {
        let name = format!("{name}_prefill{tokens}");
        if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        matched = true;
        let config = CacheConfig::k2v2(d);
        // Rows quantized into pages (keys and values): whole pages of the tokens past the
        // sinks and the window (the rest stays in the f16 side store).
        let paged_tokens = config.format().expect("the k2v2 preset's format").quantized_len(tokens as u32);
        let paged_rows = 2 * hkv * paged_tokens as usize;
        let input = AppendInput::new(tokens, hkv, d);
        // A warm cache, as in the criterion benchmark: its pool written once before.
        let mut cache = warm_append_cache(config, hkv, tokens, None, &input);
        // The input's bytes: f16, f32.
        let bytes = [tokens * hkv * d * 2 * 2, tokens * hkv * d * 2 * 4];
        let (src, mut dst) = (vec![1u8; bytes[1]], vec![0u8; bytes[1]]);
        let time = |times: &mut Vec<f64>, f: &mut dyn FnMut()| {
            let t0 = Instant::now();
            f();
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        };
        let mut memcpy = [Vec::new(), Vec::new()];
        // [kernel set][f16 input, f32 input]: every call's ms.
        let mut calls = vec![[Vec::new(), Vec::new()]; sets.len()];
        for _ in 0..rounds {
            for (times, &n) in memcpy.iter_mut().zip(&bytes) {
                for _ in 0..CALLS {
                    time(times, &mut || dst[..n].copy_from_slice(black_box(&src[..n])));
                }
            }
            for (set, &(wide, _)) in sets.iter().enumerate() {
                if both {
                    rotkv::cpu::set_avx512(wide);
                }
                for (i, times) in calls[set].iter_mut().enumerate() {
                    for _ in 0..CALLS {
                        time(times, &mut || append_prefill(&mut cache, tokens, &input, i == 0));
                    }
                }
            }
        }
        if both {
            rotkv::cpu::set_avx512(true);
        }
        let best = |t: &[f64]| t.iter().copied().fold(f64::INFINITY, f64::min);
        let median = |t: &[f64]| {
            let mut t = t.to_vec();
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        for (&(_, set), c) in sets.iter().zip(&calls) {
            for (i, input) in ["f16", "f32"].iter().enumerate() {
                let (ms, copy) = (best(&c[i]), best(&memcpy[i]));
                // Wall time times threads per paged row; none where no page fills.
                let per_row = match paged_rows {
                    0 => "-".to_string(),
                    n => format!("{:.0}", ms * 1e6 * rayon::current_num_threads() as f64 / n as f64),
                };
                println!(
                    "| {name} | {input} | {set} | {copy:.3} | {ms:.3} | {:.3} | {:.2} | {:.0}% | {per_row} |",
                    median(&c[i]),
                    bytes[i] as f64 / ms / 1e6,
                    100.0 * copy / ms,
                );
            }
        }
    }
    if !matched {
        let o = only.unwrap_or_default();
        eprintln!(
            "shape: no shape's name contains {o:?} (d64_prefill{tokens}, d128_prefill{tokens}, d256_prefill{tokens}, or all)"
        );
        std::process::exit(2)
    }
}
