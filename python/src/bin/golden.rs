//! `rotkv-golden <dir>`: runs one fixed scenario through the Rust API (`rotkv_lib::KvCache`
//! on the cpu backend) and writes every result as raw little-endian bytes into `<dir>`;
//! `tests/test_golden.py` runs the same scenario through the Python module and compares
//! bit for bit. The inputs are exact formulas both sides compute identically in f32
//! (small integers divided by 50), converted to f16 and bf16 with round-to-nearest-even.

use rotkv_lib::{Backend, CacheConfig, CacheShape, KvCache, LayerCalibration, bf16, f16};
use std::path::Path;

/// `n` inputs: `((i * 37 + seed * 101) % 211 - 105) / 50` in f32.
fn inputs(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 37 + seed * 101) % 211) as f32 - 105.0) / 50.0).collect()
}

fn write<T: bytemuck_free::Le>(dir: &Path, name: &str, xs: &[T]) -> std::io::Result<()> {
    let bytes: Vec<u8> = xs.iter().flat_map(|x| x.le()).collect();
    std::fs::write(dir.join(format!("{name}.bin")), bytes)
}

/// Little-endian bytes without a bytemuck dependency.
mod bytemuck_free {
    pub trait Le {
        fn le(&self) -> Vec<u8>;
    }
    impl Le for f32 {
        fn le(&self) -> Vec<u8> {
            self.to_le_bytes().to_vec()
        }
    }
    impl Le for u8 {
        fn le(&self) -> Vec<u8> {
            vec![*self]
        }
    }
    impl Le for u16 {
        fn le(&self) -> Vec<u8> {
            self.to_le_bytes().to_vec()
        }
    }
    impl Le for rotkv_lib::f16 {
        fn le(&self) -> Vec<u8> {
            self.to_le_bytes().to_vec()
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: rotkv-golden <dir>")?;
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir)?;
    let (hkv, hq, d) = (2, 4, 64);
    let row = hkv * d;
    let config = CacheConfig { page_size: 16, window: 16, sinks: 2, protected: 2, ..CacheConfig::k2v2(d) };
    let shape =
        CacheShape { layers: 2, num_kv_heads: hkv, num_q_heads: hq, max_seqs: 3, max_tokens: 256, num_blocks: None };
    let mut cache = KvCache::new(config, shape, Backend::Cpu)?;
    let mut calib = LayerCalibration::identity(hkv, d);
    calib.key_mean = inputs(row, 7);
    calib.key_scale = (0..row).map(|i| 1.0 + (i % 3) as f32 / 4.0).collect();
    calib.key_perm = (0..row).map(|i| (d - 1 - i % d) as u16).collect();
    calib.value_perm = (0..row).map(|i| ((i % d) * 5 % d) as u16).collect();
    cache.set_calibration(1, calib)?;
    let a = cache.add_sequence()?;
    let b = cache.add_sequence()?;
    cache.append(0, a, 50, &inputs(50 * row, 1), &inputs(50 * row, 2))?;
    cache.protect(0, a, &[45])?;
    let h = |x: Vec<f32>| x.into_iter().map(f16::from_f32).collect::<Vec<_>>();
    let bh = |x: Vec<f32>| x.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    cache.append(0, a, 30, &h(inputs(30 * row, 3)), &h(inputs(30 * row, 4)))?;
    cache.append(0, b, 7, &bh(inputs(7 * row, 5)), &bh(inputs(7 * row, 6)))?;
    cache.append(1, a, 80, &inputs(80 * row, 8), &inputs(80 * row, 1))?;
    let qrow = hq * d;
    let mut out0 = vec![0f32; 2 * qrow];
    cache.decode(0, &[a, b], &inputs(2 * qrow, 9), &mut out0)?;
    let mut out1 = vec![0f32; 2 * qrow];
    cache.decode_with(0, &[b, a], &h(inputs(2 * qrow, 10)), &mut out1, Some(3))?;
    let mut out2 = vec![0f32; 3 * qrow];
    cache.decode_tokens(0, &[a], 3, &bh(inputs(3 * qrow, 11)), &mut out2)?;
    cache.set_window_left(1, Some(20))?;
    cache.set_softmax_scale(0.2)?;
    let mut out3 = vec![0f32; qrow];
    cache.decode(1, &[a], &inputs(qrow, 12), &mut out3)?;
    for (name, out) in [("out0", &out0), ("out1", &out1), ("out2", &out2), ("out3", &out3)] {
        write(dir, name, out)?;
    }
    for layer in 0..2 {
        let (pool, sides) = cache.layer_bytes(layer)?;
        write(dir, &format!("pool{layer}"), pool)?;
        write(dir, &format!("sides{layer}"), sides)?;
    }
    calibration_file(dir)?;
    println!("wrote the golden results into {}", dir.display());
    Ok(())
}

/// A calibration file as `rotkv calibrate` writes it (two layers, two KV heads, the key
/// channel standard deviations and a measured smoothing choice per head for 2- and 4-bit
/// keys), and the recipe's layer calibrations for k2v2 and k4v2 from it; also a file
/// without the measured choice (an older file).
fn calibration_file(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    use rotkv_lib::model::calibrate::{Calibration, SmoothChoice};
    let (hkv, d) = (2, 64);
    let row = hkv * d;
    let layers: Vec<LayerCalibration> = (0..2)
        .map(|l| {
            let mut c = LayerCalibration::identity(hkv, d);
            c.key_mean = inputs(row, 20 + l);
            c.key_scale = (0..row).map(|i| 0.5 + ((i * 7 + l) % 13) as f32 / 4.0).collect();
            c.key_perm = (0..row).map(|i| ((i % d) * 3 % d) as u16).collect();
            c
        })
        .collect();
    let choice = |alpha, knee| SmoothChoice { alpha, knee };
    let mut key_smoothing = std::collections::BTreeMap::new();
    key_smoothing.insert(2, vec![vec![choice(50, 0), choice(25, 2)], vec![choice(0, 0), choice(100, 0)]]);
    key_smoothing.insert(4, vec![vec![choice(75, 0), choice(0, 2)], vec![choice(25, 0), choice(50, 2)]]);
    let cal = Calibration { layers, kv_heads: hkv, head_dim: d, metadata: Default::default(), key_smoothing };
    std::fs::write(dir.join("cal.safetensors"), cal.to_safetensors()?)?;
    for (name, config) in [("k2v2", CacheConfig::k2v2(d)), ("k4v2", CacheConfig::k4v2(d))] {
        for l in 0..2 {
            let r = cal.recipe_layer(l, &config)?;
            write(dir, &format!("cal_{name}_{l}_mean"), &r.key_mean)?;
            write(dir, &format!("cal_{name}_{l}_scale"), &r.key_scale)?;
            write(dir, &format!("cal_{name}_{l}_perm"), &r.key_perm)?;
        }
    }
    let old = Calibration { key_smoothing: Default::default(), ..cal };
    std::fs::write(dir.join("cal_old.safetensors"), old.to_safetensors()?)?;
    Ok(())
}
