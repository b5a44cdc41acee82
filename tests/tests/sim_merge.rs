//! The `decode_merge` device kernel, run by the SIMT emulator, against the reference's
//! log-sum-exp merge and inverse value rotation.

use rotkv::HeadRotation;
use rotkv::reference::{self, Partial};
use rotkv_kernels::params::{FLAG_DENSE_VALUES, FLAG_ROTATE_VALUES, MergeParams};
use rotkv_tests::{Rng, random_rotation};

/// How the merge rotates its output back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Back {
    None,
    Hadamard,
    Dense,
}

/// Random partials (some splits empty, some with very different maxima) for
/// `seqs x heads x splits`, in the kernel's layout and as reference partials.
fn partials(
    seqs: usize,
    heads: usize,
    splits: usize,
    d: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<Partial>) {
    let mut r = Rng::new(seed);
    let (mut m, mut l, mut o, mut parts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..seqs * heads {
        for i in 0..splits {
            let empty = splits > 1 && (r.below(4) == 0 || i == splits - 1);
            let (mi, li) = if empty { (f32::NEG_INFINITY, 0.0) } else { (r.normal() * 8.0, 1.0 + 5.0 * r.uniform()) };
            let oi: Vec<f32> = (0..d).map(|_| if empty { 0.0 } else { r.normal() * li }).collect();
            m.push(mi);
            l.push(li);
            o.extend_from_slice(&oi);
            parts.push(Partial { m: mi as f64, l: li as f64, o: oi.iter().map(|&x| x as f64).collect() });
        }
    }
    (m, l, o, parts)
}

#[test]
fn sim_decode_merge_matches_the_reference() {
    for (d, splits, hkv, gqa, back) in [
        (64, 1, 1, 1, Back::Hadamard),
        (64, 5, 3, 3, Back::Hadamard),
        (128, 7, 2, 4, Back::None),
        (256, 3, 1, 8, Back::Hadamard),
        (64, 4, 3, 3, Back::Dense),
        (128, 2, 2, 2, Back::Dense),
    ] {
        let (seqs, hq) = (2, hkv * gqa);
        let (m, l, o, parts) = partials(seqs, hq, splits, d, d as u64 + splits as u64);
        let mut r = Rng::new(9);
        let mut vperm: Vec<u16> = Vec::new();
        for _ in 0..hkv {
            let mut p: Vec<u16> = (0..d as u16).collect();
            for i in (1..d).rev() {
                p.swap(i, r.below(i + 1));
            }
            vperm.extend(p);
        }
        let mut inv = vec![0u16; vperm.len()];
        for (h, p) in vperm.chunks_exact(d).enumerate() {
            for (j, &c) in p.iter().enumerate() {
                inv[h * d + c as usize] = j as u16;
            }
        }
        let params = MergeParams {
            num_seqs: seqs as u32,
            num_q_heads: hq as u32,
            num_kv_heads: hkv as u32,
            head_dim: d as u32,
            num_splits: splits as u32,
            out_row_stride: (hq * d) as u32,
            batch_seqs: 0,
            q_len: 1,
            flags: match back {
                Back::None => 0,
                Back::Hadamard => FLAG_ROTATE_VALUES,
                Back::Dense => FLAG_ROTATE_VALUES | FLAG_DENSE_VALUES,
            },
        };
        let rots: Vec<f32> = (0..hkv).flat_map(|h| random_rotation(d, 50 + h as u64)).collect();
        let dense = (back == Back::Dense).then_some(&rots[..]);
        let mut out = vec![f32::NAN; seqs * hq * d];
        rotkv::sim::decode_merge_sim(&params, &m, &l, &o, &inv, dense, &mut out).unwrap();
        for (row, chunk) in parts.chunks_exact(splits).enumerate() {
            let kvh = (row % hq) / gqa;
            let rot = match back {
                Back::None => HeadRotation::None,
                Back::Hadamard => HeadRotation::Hadamard,
                Back::Dense => HeadRotation::Dense(&rots[kvh * d * d..(kvh + 1) * d * d]),
            };
            let want = reference::unrotate(&reference::merge(chunk), rot, &vperm[kvh * d..(kvh + 1) * d]);
            let got = &out[row * d..(row + 1) * d];
            // f32 merge and FWHT against f64: a few ulps of the row's scale; a dense
            // rotation sums D f32 products of a unit row: up to D ulps of the row's norm.
            let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs())).max(1e-6);
            let norm = want.iter().map(|x| x * x).sum::<f64>().sqrt();
            let tol = if back == Back::Dense { d as f64 * 6e-8 * norm } else { 2e-6 * scale };
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() <= tol, "d {d} splits {splits} {back:?} row {row}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn sim_decode_merge_writes_f16_when_asked() {
    let (m, l, o, _) = partials(1, 3, 4, 128, 5);
    let inv: Vec<u16> = (0..128).collect();
    let p = MergeParams {
        num_seqs: 1,
        num_q_heads: 3,
        num_kv_heads: 1,
        head_dim: 128,
        num_splits: 4,
        out_row_stride: 3 * 128,
        batch_seqs: 0,
        q_len: 1,
        flags: FLAG_ROTATE_VALUES,
    };
    let mut wide = vec![0f32; 3 * 128];
    rotkv::sim::decode_merge_sim(&p, &m, &l, &o, &inv, None, &mut wide).unwrap();
    let mut narrow = vec![rotkv::f16::ZERO; 3 * 128];
    rotkv::sim::decode_merge_sim(&p, &m, &l, &o, &inv, None, &mut narrow).unwrap();
    for (a, b) in wide.iter().zip(&narrow) {
        assert_eq!(rotkv::f16::from_f32(*a), *b);
    }
}

#[test]
fn sim_decode_merge_rejects_bad_sizes() {
    let p = MergeParams {
        num_seqs: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
        num_splits: 2,
        flags: 0,
        out_row_stride: 2 * 64,
        batch_seqs: 0,
        q_len: 1,
    };
    let mut out = vec![0f32; 128];
    let inv: Vec<u16> = (0..64).collect();
    assert!(rotkv::sim::decode_merge_sim(&p, &[0.0; 3], &[0.0; 4], &[0.0; 256], &inv, None, &mut out).is_err());
    assert!(rotkv::sim::decode_merge_sim(&p, &[0.0; 4], &[0.0; 4], &[0.0; 256], &inv[..10], None, &mut out).is_err());
    // Dense value rotations: the matrices must be given, with one per KV head.
    let pd = MergeParams { flags: FLAG_DENSE_VALUES, ..p };
    let rot = random_rotation(64, 1);
    assert!(rotkv::sim::decode_merge_sim(&pd, &[0.0; 4], &[0.0; 4], &[0.0; 256], &inv, None, &mut out).is_err());
    assert!(
        rotkv::sim::decode_merge_sim(&pd, &[0.0; 4], &[0.0; 4], &[0.0; 256], &inv, Some(&rot[..100]), &mut out)
            .is_err()
    );
    assert!(rotkv::sim::decode_merge_sim(&pd, &[0.0; 4], &[0.0; 4], &[0.0; 256], &inv, Some(&rot), &mut out).is_ok());
    let p96 = MergeParams { head_dim: 96, ..p };
    assert!(
        rotkv::sim::decode_merge_sim(&p96, &[0.0; 4], &[0.0; 4], &[0.0; 384], &[0; 96], None, &mut [0.0; 192]).is_err()
    );
}
