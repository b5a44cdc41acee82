//! The CUDA backend on this machine: present, or reported SKIPPED (every conformance test
//! runs it when present, through `backends()`). `Backend::auto` never selects it (it
//! uploads the pool per call); the GPU API is `rotkv::device`.

use rotkv::{Backend, CacheConfig, CacheShape, KvCache};

/// First on a GPU: one `mma.sync` per warp on host-packed fragments (small integers and
/// f16 subnormals) equals the f32 product exactly, so the fragment layout the decode
/// kernel relies on is the hardware's.
#[test]
fn a_mma_selftest() {
    if !Backend::Cuda.available() {
        eprintln!("SKIPPED: mma self-test (no CUDA driver or device on this machine)");
        return;
    }
    let ctx = rotkv::cuda::cudarc::driver::CudaContext::new(0).unwrap();
    rotkv::cuda::mma_selftest(&ctx.new_stream().unwrap()).unwrap();
    eprintln!("mma self-test: exact");
}

/// Also first: `cp.async` into shared memory, its wait and `bar.warp.sync`, and `ldmatrix`
/// `x4`/`x2`, plain and transposed, give every lane the registers of the PTX ISA layout
/// the decode kernel's ring relies on.
#[test]
fn a_ldmatrix_selftest() {
    if !Backend::Cuda.available() {
        eprintln!("SKIPPED: ldmatrix self-test (no CUDA driver or device on this machine)");
        return;
    }
    let ctx = rotkv::cuda::cudarc::driver::CudaContext::new(0).unwrap();
    rotkv::cuda::ldmatrix_selftest(&ctx.new_stream().unwrap()).unwrap();
    eprintln!("ldmatrix self-test: exact");
}

#[test]
fn cuda_backend_is_used_when_present_or_reported_skipped() {
    if !Backend::Cuda.available() {
        eprintln!("SKIPPED: cuda backend (no CUDA driver or device on this machine)");
        assert_eq!(Backend::auto(), Backend::Cpu);
        // Selecting it explicitly gives an error, not a crash.
        let shape =
            CacheShape { layers: 1, num_kv_heads: 1, num_q_heads: 1, max_seqs: 1, max_tokens: 100, num_blocks: None };
        let mut cache = KvCache::new(CacheConfig::k2v2(64), shape, Backend::Cuda).unwrap();
        let s = cache.add_sequence().unwrap();
        let k = vec![0.5f32; 100 * 64];
        let e = cache.append(0, s, 100, &k, &k).unwrap_err();
        assert!(e.to_string().contains("cuda"), "{e}");
        assert_eq!(cache.len(0, s).unwrap(), 0);
        return;
    }
    assert_eq!(Backend::auto(), Backend::Cpu);
    assert!(rotkv::cuda::PTX.contains(".entry rotkv_decode_split_d128_k2v2"));
}
