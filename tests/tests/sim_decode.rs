//! The `decode_split` device kernel, run by the SIMT emulator, against the reference's
//! split-K partials on the same bytes, and merged by the emulated `decode_merge` against
//! the reference decode. Sizes stay small: the emulator runs every GPU thread in
//! turn, switching at each barrier and shuffle.

use rotkv::paged::{self, LayerShape};
use rotkv::reference::{self, SeqRef};
use rotkv::{Backend, CacheConfig, Rotation, f16};
use rotkv_kernels::params::{DecodeParams, MergeParams};
use rotkv_tests::{Data, Rng, learned_calibration, random_calibration, rel_err, rows};

#[test]
fn sim_decode_split_and_merge_match_the_reference() {
    // (head_dim, key bits, value bits, group, GQA, length, splits, query tokens): both
    // kernels (decode_mma for groups of 64+ channels and 3+ rows), two groups per head,
    // two row tiles (GQA 8 x 3 query tokens), protected positions in quantized tiles.
    let cases = [
        (64, 2, 2, 32, 3, 90, 3, 1),
        (64, 4, 2, 64, 1, 1, 4, 1),
        (128, 2, 4, 128, 8, 70, 2, 1),
        (256, 4, 4, 64, 2, 53, 1, 1),
        (128, 4, 2, 32, 7, 40, 5, 1),
        (64, 4, 4, 64, 3, 61, 2, 1),
        (128, 4, 2, 64, 4, 75, 1, 2),
        (128, 2, 2, 64, 8, 66, 3, 3),
        (64, 2, 4, 64, 1, 45, 2, 4),
        // head_dim 256 on tensor cores: the merge in passes of 64 channels, two row
        // tiles, 2-3 query tokens (the protected positions send most tiles through the
        // masked loop; `decode_ring_refills_every_stage` runs the rings).
        (256, 2, 2, 128, 4, 70, 2, 2),
        (256, 4, 2, 128, 8, 45, 3, 3),
        (256, 2, 4, 128, 2, 60, 1, 1),
    ];
    for (i, &(d, kb, vb, g, gqa, len, splits, q_len)) in cases.iter().enumerate() {
        let config = CacheConfig {
            head_dim: d,
            key_bits: kb,
            value_bits: vb,
            group_size: g,
            page_size: 16,
            sinks: 2,
            window: 16,
            key_rotation: if i == 3 { Rotation::None } else { Rotation::Hadamard },
            value_rotation: Rotation::Hadamard,
            key_clip: 1.0,
            value_clip: 1.0,
            protected: 3,
            channel_norm: 0,
        };
        let hkv = 2;
        let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hkv * gqa };
        // Two sequences (len + 20 and len tokens) in one pool, pages shuffled.
        let lens = [len + 20, len];
        let need: Vec<usize> = lens.iter().map(|&n| paged::blocks_for(&config, n).unwrap()).collect();
        let total = need.iter().sum::<usize>() + 2;
        let mut order: Vec<u32> = (0..total as u32).collect();
        let mut r = Rng::new(i as u64);
        for x in (1..order.len()).rev() {
            order.swap(x, r.below(x + 1));
        }
        let tables = [order[..need[0]].to_vec(), order[need[0]..need[0] + need[1]].to_vec()];
        let mut pool = paged::PoolBuffer::new(paged::pool_bytes(&config, &shape, total).unwrap());
        let mut sides = vec![vec![f16::ZERO; paged::side_elems(&config, &shape).unwrap()]; 2];
        // Every other case with learned (dense) rotations.
        let calib =
            if i % 2 == 1 { learned_calibration(hkv, d, i as u64) } else { random_calibration(hkv, d, i as u64) };
        // Protected positions (some quantized by the end, some not, some past the end).
        let protected = [vec![3u32, 9, 40], vec![5u32, 30]];
        for (si, &n) in lens.iter().enumerate() {
            let k = rows(Data::Keys, n * hkv, d, 10 + i as u64 + si as u64);
            let v = rows(Data::Normal, n * hkv, d, 20 + i as u64 + si as u64);
            let (table, side) = (&tables[si], &mut sides[si]);
            let prot = &protected[si];
            paged::append(
                Backend::Reference,
                &config,
                &calib,
                &shape,
                pool.bytes_mut(),
                table,
                side,
                prot,
                0,
                n,
                &k,
                &v,
            )
            .unwrap();
        }
        let q = rows(Data::Normal, 2 * q_len * hkv * gqa, d, 30 + i as u64);
        let fmt = config.format().unwrap();
        let hq = hkv * gqa;
        let p = DecodeParams {
            format: fmt,
            num_seqs: 2,
            num_q_heads: hq as u32,
            num_kv_heads: hkv as u32,
            num_splits: splits,
            block_table_stride: 0,
            flags: config.flags() | calib.flags(),
            sm_scale: 1.0 / (d as f32).sqrt(),
            q_seq_stride: (q_len * hq * d) as u32,
            q_token_stride: (hq * d) as u32,
            q_dtype: rotkv_kernels::params::DTYPE_F32,
            num_blocks: u32::MAX,
            max_len: u32::MAX,
            q_len: q_len as u32,
            attn_window: 0,
            batch_rows: 0,
            batch_seqs: 0,
        };
        let seqs: Vec<SeqRef<'_>> = (0..2)
            .map(|si| SeqRef { block_table: &tables[si], side: &sides[si], len: lens[si], protected: &protected[si] })
            .collect();
        // The tensor-core kernel rounds the rotated query and the softmax weights (times
        // the value scales) to f16 (relative error up to 2^-11 each): its partials are
        // compared at 3e-3, the CUDA-core kernel's (f32 throughout) at f32 precision.
        let mma = matches!(rotkv::launch::decode_kernel(&fmt), rotkv::launch::DecodeKernel::Mma { .. });
        let (tol_m, tol_o) = if mma { (3e-3, 3e-3) } else { (1e-5, 2e-5) };
        let want = reference::decode_partials(&p, &calib, pool.bytes(), &seqs, &q);
        let (m, l, o) = rotkv::sim::decode_split_sim(&p, &calib, pool.bytes(), &seqs, &q).unwrap();
        for (j, w) in want.iter().enumerate() {
            if w.m == f64::NEG_INFINITY {
                assert_eq!(m[j], f32::NEG_INFINITY, "case {i} partial {j}");
                continue;
            }
            // f32 against f64 over at most 110 tokens: a few ulps.
            assert!((m[j] as f64 - w.m).abs() <= tol_m * (1.0 + w.m.abs()), "case {i} m[{j}]: {} vs {}", m[j], w.m);
            assert!((l[j] as f64 - w.l).abs() <= tol_m * w.l, "case {i} l[{j}]: {} vs {}", l[j], w.l);
            let got = &o[j * d..(j + 1) * d];
            let wo: Vec<f32> = w.o.iter().map(|&x| x as f32).collect();
            let e = rel_err(got, &wo);
            assert!(e <= tol_o, "case {i} o[{j}]: {e:.2e}");
        }
        // Merged by the emulated merge kernel: the reference decode.
        let inv = calib.value_perm_inverse(d);
        let mp = MergeParams {
            num_seqs: 2 * q_len as u32,
            num_q_heads: hq as u32,
            num_kv_heads: hkv as u32,
            head_dim: d as u32,
            num_splits: splits,
            flags: config.flags() | calib.flags(),
            out_row_stride: (hq * d) as u32,
            batch_seqs: 0,
            q_len: 1,
        };
        let mut out = vec![0f32; 2 * q_len * hq * d];
        rotkv::sim::decode_merge_sim(&mp, &m, &l, &o, &inv, calib.value_rotation.as_deref(), &mut out).unwrap();
        let mut expect = vec![0f32; 2 * q_len * hq * d];
        reference::decode(&p, &calib, pool.bytes(), &seqs, &q, &mut expect);
        let e = rel_err(&out, &expect);
        eprintln!("case {i} ({}): merged rel err {e:.2e}", if mma { "decode_mma" } else { "decode_split" });
        assert!(e <= tol_o, "case {i}: merged {e:.2e}");
    }
}
