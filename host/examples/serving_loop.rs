//! A serving loop on the device API: one layer's cache stays in device memory; sequences
//! arrive (prefill), decode token by token through one `DecodePlan`, and leave; the batch
//! changes between steps. Runs on the emulated device (`--features sim`); with a GPU,
//! `Device::cuda(stream)` on a stream of your own is the only change.
//!
//! ```sh
//! cargo run -p rotkv --features sim --release --example serving_loop
//! ```
//!
//! Each decode step asserts that it allocated, copied and waited for nothing.

use rotkv::device::{Counters, DecodePlan, Device, DeviceLayer, LayerSize, PlanShape};
use rotkv::paged::LayerShape;
use rotkv::{CacheConfig, LayerCalibration, f16};

fn main() -> rotkv::Result<()> {
    let (hkv, hq, d, slots) = (2, 8, 64, 3);
    let dev = Device::sim();
    let size = LayerSize { max_seqs: slots, max_tokens: 256, num_blocks: None };
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let mut layer = DeviceLayer::new(&dev, CacheConfig::k2v2(d), shape, LayerCalibration::identity(hkv, d), size)?;
    let mut plan = DecodePlan::new(
        &layer,
        PlanShape {
            max_seqs: slots,
            max_q_len: 1,
            max_context: 256,
            sm_count: None,
            blocks_per_sm: None,
            sm_scale: None,
        },
    )?;
    // Step buffers, made once: this step's K/V (one token per slot), queries, output. A
    // model writes them on the device; here the host fills them once.
    let row = hkv * d;
    let synth = |n: usize, seed: usize| -> Vec<f16> {
        (0..n).map(|i| f16::from_f32((((i * 31 + seed * 17) % 97) as f32 - 48.0) / 24.0)).collect()
    };
    let step_k = dev.upload(&synth(row, 1))?;
    let step_v = dev.upload(&synth(row, 2))?;
    let q = dev.upload(&synth(slots * hq * d, 3).iter().map(|x| x.to_f32()).collect::<Vec<_>>())?;
    let mut out = dev.alloc::<f16>(slots * hq * d)?;
    let prompt_k = dev.upload(&synth(120 * row, 4))?;
    let prompt_v = dev.upload(&synth(120 * row, 5))?;

    // (arrival step, prompt tokens, tokens to generate)
    let requests = [(0, 100, 6), (0, 40, 3), (2, 120, 5), (4, 10, 4), (6, 60, 2)];
    let mut live: Vec<(rotkv::SeqId, usize)> = Vec::new(); // (sequence, tokens left)
    println!("step  live  lens                 allocs  uploads  downloads  syncs  launches (this decode)");
    for step in 0..10 {
        for &(_, prompt, generate) in requests.iter().filter(|r| r.0 == step) {
            let s = layer.add_sequence()?;
            layer.append(s, prompt, &prompt_k, &prompt_v, row)?;
            live.push((s, generate));
        }
        if live.is_empty() {
            break;
        }
        for &(s, _) in &live {
            layer.append(s, 1, &step_k, &step_v, row)?;
        }
        let before = dev.counters();
        plan.run(&layer, 1, &q, &mut out)?;
        let after = dev.counters();
        let d = Counters {
            allocations: after.allocations - before.allocations,
            uploads: after.uploads - before.uploads,
            downloads: after.downloads - before.downloads,
            synchronizations: after.synchronizations - before.synchronizations,
            launches: after.launches - before.launches,
            device_copies: after.device_copies - before.device_copies,
        };
        assert_eq!(d, Counters { launches: 2, ..Counters::default() }, "a decode step only launches");
        let lens: Vec<String> = (0..slots).map(|s| layer.slot_len(s).map_or("-".into(), |l| l.to_string())).collect();
        println!(
            "{step:>4}  {:>4}  {:<20} {:>6}  {:>7}  {:>9}  {:>5}  {:>8}",
            live.len(),
            lens.join(" "),
            d.allocations,
            d.uploads,
            d.downloads,
            d.synchronizations,
            d.launches
        );
        for entry in &mut live {
            entry.1 -= 1;
        }
        for &(s, _) in live.iter().filter(|e| e.1 == 0) {
            layer.free_sequence(s)?;
        }
        live.retain(|e| e.1 > 0);
    }
    let mut host = vec![f16::ZERO; out.len()];
    dev.read(&out, &mut host)?;
    assert!(host.iter().all(|x| x.to_f32().is_finite()));
    println!("device totals: {:?}", dev.counters());
    Ok(())
}
