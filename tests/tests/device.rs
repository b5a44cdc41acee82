//! The device path on the emulated backend: append over the GPU grid limit, the slot
//! mapping's capacity check.

use rotkv::paged::{self, LayerShape};
use rotkv::{Backend, CacheConfig, CacheShape, Error, KvCache, LayerCalibration};

fn rows(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0) as f32
        })
        .collect()
}

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

/// A pool past the 2^31 token slots the append slot mapping addresses is refused before
/// anything is allocated or written.
#[test]
fn pool_past_the_slot_index_space_is_refused() {
    let config = CacheConfig::k2v2(64);
    let fmt = config.format().unwrap();
    let max = rotkv::launch::max_pool_blocks(&fmt);
    assert_eq!(max * fmt.page_size as usize, 1 << 31);
    let shape =
        |n| CacheShape { layers: 1, num_kv_heads: 1, num_q_heads: 1, max_seqs: 1, max_tokens: 64, num_blocks: Some(n) };
    assert!(matches!(KvCache::new(config, shape(max + 1), Backend::Cpu), Err(Error::Capacity(_))));
    assert!(matches!(KvCache::new(config, shape(usize::MAX / 4), Backend::Cpu), Err(Error::Capacity(_))));
}
