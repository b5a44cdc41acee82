//! GPU decode benchmark (feature `cuda`; run by the GPU bundle's `run.sh`): time per
//! decode step, bytes of packed cache read and GB/s, against a device-to-device copy
//! measured in the same run. Prints `SKIPPED` without a CUDA device.

use rotkv::{Backend, CacheConfig};

fn main() -> std::process::ExitCode {
    if !Backend::Cuda.available() {
        println!("SKIPPED: gpu_decode (no CUDA driver or device on this machine)");
        return std::process::ExitCode::SUCCESS;
    }
    // Keep the device pool under ~6 GB per case.
    let limit = 6usize << 30;
    println!(
        "{:>4} {:>5} {:>6} {:>7} {:>9} {:>9} {:>9} {:>7}",
        "D", "bits", "batch", "context", "ms/step", "GB/s", "copy GB/s", "ratio"
    );
    let mut failed = false;
    for (d, hkv, hq) in [(64, 3, 9), (128, 8, 32)] {
        for preset in ["k2v2", "k4v2"] {
            let config = CacheConfig::preset(preset, d).expect("known preset");
            let per_token = config.bytes_per_token().expect("supported") * hkv;
            for batch in [1, 8, 64] {
                for context in [1024, 8192, 32768, 131072] {
                    if batch * context * per_token > limit {
                        continue;
                    }
                    match rotkv::cuda::time_decode(&config, hkv, hq, batch, context, 20) {
                        Ok(t) => {
                            let gbs = t.cache_bytes as f64 / t.decode_s / 1e9;
                            let copy = t.copy_bytes as f64 / t.copy_s / 1e9;
                            println!(
                                "{d:>4} {preset:>5} {batch:>6} {context:>7} {:>9.3} {gbs:>9.1} {copy:>9.1} {:>7.2}",
                                t.decode_s * 1e3,
                                gbs / copy
                            );
                        }
                        Err(e) => {
                            println!("{d:>4} {preset:>5} {batch:>6} {context:>7} error: {e}");
                            failed = true;
                        }
                    }
                }
            }
        }
    }
    if failed { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS }
}
