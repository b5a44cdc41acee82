//! The real-model harness: the forward pass against a plain f64 implementation on a small
//! random model (exact attention and through the cache), a GGUF written here read back
//! (llama q/k permutation undone), the tokenizer; and on SmolLM2-135M when
//! `cargo xtask fetch` has run (SKIPPED otherwise): token ids of alice29.txt equal to
//! those of the shared capture, greedy "Paris", capture equal to the bundled tile and
//! within 1% of the shared file, and (ignored by default, run by `cargo xtask ci`)
//! the presets and the recommended recipes' perplexity on 2 windows of 512 tokens.

use rotkv::model::calibrate::Smooth;
use rotkv::model::gguf::Gguf;
use rotkv::model::llama::{CacheAttention, ExactAttention, LayerWeights, Llama, LlamaConfig, Row, WeightStorage};
use rotkv::model::math::{Matrix, Weight};
use rotkv::model::tokenizer::{Pre, Tokenizer};
use rotkv::model::{self, KvMethod, PplOptions};
use rotkv::{Backend, CacheShape, KvCache};
use rotkv_tests::gguf_writer::{Meta, gguf_bytes};
use rotkv_tests::{Rng, rel_err, repo_data, shared_data};

fn matrix(rng: &mut Rng, rows: usize, cols: usize, scale: f32) -> Weight {
    Weight::F32(Matrix { rows, cols, data: (0..rows * cols).map(|_| rng.normal() * scale).collect() })
}

/// The f32 matrix of a weight built by [`matrix`].
fn f32s(w: &Weight) -> &Matrix {
    match w {
        Weight::F32(m) => m,
        Weight::Blocks(_) => panic!("the random models hold f32 weights"),
    }
}

/// A 2-layer llama with random weights: 4 query heads, 2 KV heads of 64 channels.
fn random_model(seed: u64, bias: bool) -> Llama {
    let mut r = Rng::new(seed);
    let config = LlamaConfig {
        arch: if bias { "qwen2" } else { "llama" }.into(),
        vocab: 300,
        dim: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        ffn: 96,
        eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: Default::default(),
        sliding: None,
        embed_scale: 1.0,
        act: Default::default(),
        attn_scale: 1.0 / 8.0,
    };
    let gain = |r: &mut Rng, n: usize| (0..n).map(|_| 1.0 + 0.2 * r.normal()).collect::<Vec<f32>>();
    let layers = (0..config.layers)
        .map(|_| LayerWeights {
            attn_norm: gain(&mut r, 256),
            wq: matrix(&mut r, 256, 256, 0.15),
            wk: matrix(&mut r, 128, 256, 0.15),
            wv: matrix(&mut r, 128, 256, 0.1),
            bias: bias.then(|| [gain(&mut r, 256), gain(&mut r, 128), gain(&mut r, 128)]),
            qk_norm: None,
            post_norms: None,
            wo: matrix(&mut r, 256, 256, 0.05),
            ffn_norm: gain(&mut r, 256),
            gate: matrix(&mut r, 96, 256, 0.1),
            up: matrix(&mut r, 96, 256, 0.1),
            down: matrix(&mut r, 256, 96, 0.1),
        })
        .collect();
    Llama { embed: matrix(&mut r, 300, 256, 1.0), norm: gain(&mut r, 256), output: None, layers, config }
}

/// Plain f64 forward of one sequence: logits `[T][vocab]`.
fn forward_f64(m: &Llama, tokens: &[u32]) -> Vec<f64> {
    let c = &m.config;
    let (d, n) = (c.head_dim, tokens.len());
    let mv = |w: &Weight, x: &[f64]| -> Vec<f64> {
        let w = f32s(w);
        (0..w.rows).map(|o| (0..w.cols).map(|i| w.data[o * w.cols + i] as f64 * x[i]).sum()).collect()
    };
    let norm = |x: &[f64], g: &[f32]| -> Vec<f64> {
        let s = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + c.eps as f64).sqrt();
        x.iter().zip(g).map(|(v, &gg)| v * s * gg as f64).collect()
    };
    let rope = |x: &mut [f64], pos: usize| {
        for i in 0..d / 2 {
            let inv = 1.0 / (c.rope_theta as f64).powf(2.0 * i as f64 / d as f64);
            let (s, co) = (pos as f64 * inv).sin_cos();
            let (a, b) = (x[i], x[i + d / 2]);
            x[i] = a * co - b * s;
            x[i + d / 2] = b * co + a * s;
        }
    };
    let mut xs: Vec<Vec<f64>> =
        tokens.iter().map(|&t| f32s(&m.embed).row(t as usize).iter().map(|&v| v as f64).collect()).collect();
    for w in &m.layers {
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (p, x) in xs.iter().enumerate() {
            let h = norm(x, &w.attn_norm);
            let (mut q, mut k, mut v) = (mv(&w.wq, &h), mv(&w.wk, &h), mv(&w.wv, &h));
            if let Some([bq, bk, bv]) = &w.bias {
                q.iter_mut().zip(bq).for_each(|(a, &b)| *a += b as f64);
                k.iter_mut().zip(bk).for_each(|(a, &b)| *a += b as f64);
                v.iter_mut().zip(bv).for_each(|(a, &b)| *a += b as f64);
            }
            q.chunks_mut(d).for_each(|hd| rope(hd, p));
            k.chunks_mut(d).for_each(|hd| rope(hd, p));
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for p in 0..n {
            let mut att = vec![0f64; c.dim];
            for h in 0..c.heads {
                let kh = h / (c.heads / c.kv_heads);
                let q = &qs[p][h * d..(h + 1) * d];
                let s: Vec<f64> = (0..=p)
                    .map(|t| q.iter().zip(&ks[t][kh * d..]).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for (t, et) in e.iter().enumerate() {
                    for j in 0..d {
                        att[h * d + j] += et / z * vs[t][kh * d + j];
                    }
                }
            }
            let o = mv(&w.wo, &att);
            xs[p].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = norm(&xs[p], &w.ffn_norm);
            let (g, u) = (mv(&w.gate, &h), mv(&w.up, &h));
            let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let o = mv(&w.down, &a);
            xs[p].iter_mut().zip(&o).for_each(|(x, y)| *x += y);
        }
    }
    xs.iter().flat_map(|x| mv(&m.embed, &norm(x, &m.norm))).collect()
}

fn rel(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, y)| (x as f64 - y).powi(2)).sum();
    (num / b.iter().map(|y| y * y).sum::<f64>()).sqrt()
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.below(300) as u32).collect()
}

#[test]
fn forward_matches_f64_with_exact_attention() {
    for bias in [false, true] {
        let m = random_model(1 + bias as u64, bias);
        let t = tokens(37, 3);
        let rows: Vec<Row> = (0..t.len()).map(|p| Row { seq: 0, pos: p }).collect();
        let mut attn = ExactAttention::new(&m.config);
        let hidden = m.forward(&t, &rows, &mut attn, None, 2).unwrap();
        let err = rel(&m.logits(&hidden), &forward_f64(&m, &t));
        // f32 accumulation over at most 256 terms per product, two layers: 1e-5 is typical.
        assert!(err < 1e-4, "bias {bias}: rel err {err}");
    }
}

#[test]
fn forward_through_the_cache_matches_f64() {
    let m = random_model(4, false);
    let t = tokens(150, 5);
    let want = forward_f64(&m, &t);
    let shape =
        CacheShape { layers: 2, num_kv_heads: 2, num_q_heads: 4, max_seqs: 1, max_tokens: 150, num_blocks: None };
    let run = |name: &str, backend: Backend| -> Vec<f32> {
        let method = KvMethod::parse(name, 64, 150).unwrap();
        let mut cache = KvCache::new(method.config, shape, backend).unwrap();
        let id = cache.add_sequence().unwrap();
        let mut attn = CacheAttention::new(&m.config, vec![cache], vec![(0, id)]).unwrap();
        let mut got = Vec::new();
        for (p, &tok) in t.iter().enumerate() {
            let h = m.forward(&[tok], &[Row { seq: 0, pos: p }], &mut attn, None, 2).unwrap();
            got.extend(m.logits(&h));
        }
        assert_eq!(attn.caches[0].len(1, id).unwrap(), 150);
        got
    };
    // f16: every token kept in f16, so the error is the f16 rounding of keys and values
    // (2^-11 relative) carried through two layers.
    let f16 = rel(&run("f16", Backend::Cpu), &want);
    assert!(f16 < 2e-3, "f16: rel err {f16}");
    // k4v4 with 16-token pages and window: most tokens come from 4-bit pages. The CPU
    // backend and the f64 reference write the same codes except at rounding ties of the
    // f32 vs f64 rotation (a tie moves a code by one step, and layer 1 sees the change),
    // then decode in f32 vs f64: measured 1.9e-3; quantization itself costs far more.
    let (cpu, reference) = (run("k4v4-w16-p16", Backend::Cpu), run("k4v4-w16-p16", Backend::Reference));
    let backends = rel_err(&cpu, &reference);
    let quant = rel(&cpu, &want);
    assert!(backends < 1e-2, "cpu vs reference backend: {backends}");
    assert!(quant > 10.0 * f16, "k4v4 {quant} vs f16 {f16}: the pages were read");
}

#[test]
fn prefill_through_the_cache_is_exact_and_decode_follows() {
    let m = random_model(6, false);
    let t = tokens(40, 7);
    let rows: Vec<Row> = (0..30).map(|p| Row { seq: 0, pos: p }).collect();
    let shape =
        CacheShape { layers: 2, num_kv_heads: 2, num_q_heads: 4, max_seqs: 1, max_tokens: 40, num_blocks: None };
    let mut cache = KvCache::new(KvMethod::parse("f16", 64, 40).unwrap().config, shape, Backend::Cpu).unwrap();
    let id = cache.add_sequence().unwrap();
    let mut cached = CacheAttention::new(&m.config, vec![cache], vec![(0, id)]).unwrap();
    let mut exact = ExactAttention::new(&m.config);
    let a = m.forward(&t[..30], &rows, &mut cached, None, 2).unwrap();
    let b = m.forward(&t[..30], &rows, &mut exact, None, 2).unwrap();
    assert_eq!(a, b, "a prefill attends exactly");
    // A second prefill into the same sequence is refused and changes nothing.
    let more: Vec<Row> = (30..32).map(|p| Row { seq: 0, pos: p }).collect();
    assert!(m.forward(&t[30..32], &more, &mut cached, None, 2).is_err());
    assert_eq!(cached.caches[0].len(0, id).unwrap(), 30);
    for (p, &tok) in t.iter().enumerate().skip(30) {
        let a = m.forward(&[tok], &[Row { seq: 0, pos: p }], &mut cached, None, 2).unwrap();
        let b = m.forward(&[tok], &[Row { seq: 0, pos: p }], &mut exact, None, 2).unwrap();
        assert!(rel_err(&a, &b) < 2e-3, "step {p}");
    }
    // Rows out of order, unknown tokens and unknown sequences are errors.
    assert!(m.forward(&[t[0]], &[Row { seq: 0, pos: 7 }], &mut exact, None, 2).is_err());
    assert!(m.forward(&[300], &[Row { seq: 0, pos: 40 }], &mut exact, None, 2).is_err());
    assert!(m.forward(&[1], &[Row { seq: 3, pos: 0 }], &mut cached, None, 2).is_err());
}

/// `perplexity` with `chunk` tokens per step (appended, then one multi-token decode)
/// against token by token, compared by the mean NLL (this random model's is ~84.5 nats per
/// token). Where nothing is quantized (f16, or a window longer than the text) each token
/// sees the same f16 rows either way, so only f32 rounding differs (the CPU backend's lane
/// sums over a split whose last chunk holds masked tokens): measured at most 2.9e-7
/// relative, bound 1e-6. With quantized pages the rows of a pass (8 rows: half the
/// 16-token window) are decoded after the whole pass was appended, so a page that the
/// pass's later tokens pushed out of the window is read quantized by its earlier rows
/// too: a real difference, measured up to 2.2e-3 relative (this model's attention is very
/// sharp), bound 1e-2. One append per 64-token chunk (every row sees the chunk's final
/// quantization, its own early tokens included) measured 3.1e-3 / 3.3e-3, further from
/// token by token than the passes (7.5e-4 / 2.2e-3).
#[test]
fn chunked_decode_matches_token_by_token() {
    let m = random_model(21, false);
    let windows = vec![tokens(70, 22), tokens(70, 23)];
    let methods: Vec<KvMethod> = ["f16", "k2v2-w128", "k2v2-s2-w16-p16", "k4v4-w16-p16"]
        .iter()
        .map(|n| KvMethod::parse(n, 64, 70).unwrap())
        .collect();
    let run_passes = |chunk: usize, pass_rows: Option<usize>| {
        let opts = PplOptions { backend: Backend::Cpu, calibration: None, chunk, pre_calibration: None, pass_rows };
        let mut steps = Vec::new();
        let r = model::perplexity(&m, &windows, &methods, &opts, &mut |done, of| steps.push((done, of))).unwrap();
        assert_eq!(steps.last(), Some(&(69, 69)), "chunk {chunk}: progress");
        assert_eq!(steps.len(), 69usize.div_ceil(chunk));
        r
    };
    let run = |chunk: usize| run_passes(chunk, None);
    let one = run(1);
    // KL(f16 || method) and top-1 agreement: exactly 0 and 1 for f16 itself; for k2v2 with
    // a window longer than the text (nothing quantized; rotated keys and values rounded to
    // f16, so not bit-equal) measured 1.9e-6 nats, bound 1e-4; the quantized caches far
    // above it (measured k4v4 3.6e-3 with top-1 100%, k2v2 9.2e-2 with 99.3%; bound 1e-3)
    // and k2v2 above k4v4.
    for r in &one {
        let (kl, top1) = (r.kl.unwrap(), r.top1.unwrap());
        eprintln!("{:<16} kl {kl:.3e} top-1 {top1:.3}", r.method.name);
        match r.method.name.as_str() {
            "f16" => assert!(kl == 0.0 && top1 == 1.0, "f16: kl {kl} top-1 {top1}"),
            "k2v2-w128" => assert!((0.0..1e-4).contains(&kl) && top1 == 1.0, "k2v2-w128: kl {kl} top-1 {top1}"),
            name => assert!(kl > 1e-3 && kl.is_finite() && top1 <= 1.0, "{name}: kl {kl} top-1 {top1}"),
        }
    }
    assert!(one[2].kl > one[3].kl && one[2].top1 < Some(1.0), "k2v2 drifts further than k4v4");
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: None, chunk: 8, pre_calibration: None, pass_rows: None };
    let no_f16 = model::perplexity(&m, &windows, &methods[1..2], &opts, &mut |_, _| {}).unwrap();
    assert_eq!((no_f16[0].kl, no_f16[0].top1), (None, None), "no unquantized method, no KL");
    for chunk in [4, 7, 64] {
        for (a, b) in run(chunk).iter().zip(&one) {
            let d = (a.nll / b.nll - 1.0).abs();
            eprintln!("{:<16} chunk {chunk}: nll {:.9} vs {:.9} token by token ({d:.1e})", a.method.name, a.nll, b.nll);
            assert_eq!(a.tokens, b.tokens);
            let bound = if a.method.name.contains("-p16") { 1e-2 } else { 1e-6 };
            assert!(d < bound, "{} chunk {chunk}: nll {} vs {}", a.method.name, a.nll, b.nll);
        }
    }
    // Chunks of 64 tokens in passes of 8 rows (half the 16-token window) against one
    // append per chunk: the passes keep each row's own chunk in f16, so they stay closer
    // to token by token (measured in the comment above).
    let (passes, whole) = (run(64), run_passes(64, Some(64)));
    for ((p, w), b) in passes.iter().zip(&whole).zip(&one).filter(|x| x.0.0.method.name.contains("-p16")) {
        let (dp, dw) = ((p.nll / b.nll - 1.0).abs(), (w.nll / b.nll - 1.0).abs());
        eprintln!("{:<16} chunk 64: passes of 8 {dp:.1e}, one pass {dw:.1e} from token by token", p.method.name);
        assert!(dp < dw, "{}: passes {dp} vs one pass {dw}", p.method.name);
    }
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: None, chunk: 0, pre_calibration: None, pass_rows: None };
    assert!(model::perplexity(&m, &windows, &methods, &opts, &mut |_, _| {}).is_err());
    let opts = PplOptions { chunk: rotkv::paged::MAX_Q_LEN + 1, ..opts };
    assert!(model::perplexity(&m, &windows, &methods, &opts, &mut |_, _| {}).is_err());
}

/// The pre-RoPE simulation (`-pre`, `rotkv::model::prerope`) and its post-RoPE control
/// (`-sim`) on a random model, with 16-token windows and pages so that pages are
/// quantized: the control reproduces the real cache's perplexity (same quantizer, same
/// sinks, window and pages; exact rows rounded to f16 unrotated rather than rotated, so
/// a 2-bit code can move on a tie: measured nll 82.839 vs 82.862 at chunk 1, 82.614 vs
/// 82.635 at chunk 8, 2.8e-4 relative; bound 1e-2), the pre-RoPE method with nothing to
/// quantize (`-w128`) is f16 up to rounding (measured KL 1.1e-12, bound 1e-4), and
/// quantized it drifts from f16 (measured KL 0.15 / 0.14 for k2v2, 3.7e-3 / 4.7e-2 for
/// k4v2; bound above 1e-3).
#[test]
fn pre_rope_simulation_against_the_cache() {
    let m = random_model(31, false);
    let windows = vec![tokens(70, 32), tokens(70, 33)];
    let names =
        ["f16", "k2v2-s2-w16-p16", "k2v2-s2-w16-p16-sim", "k2v2-s2-w16-p16-pre", "k2v2-w128-pre", "k4v2-w16-p16-pre"];
    let methods: Vec<KvMethod> = names.iter().map(|n| KvMethod::parse(n, 64, 70).unwrap()).collect();
    for chunk in [1, 8] {
        let opts =
            PplOptions { backend: Backend::Cpu, calibration: None, chunk, pre_calibration: None, pass_rows: None };
        let r = model::perplexity(&m, &windows, &methods, &opts, &mut |_, _| {}).unwrap();
        for x in &r {
            eprintln!("chunk {chunk} {:<22} nll {:.6} kl {:.3e}", x.method.name, x.nll, x.kl.unwrap());
        }
        let d = (r[2].nll / r[1].nll - 1.0).abs();
        assert!(d < 1e-2, "chunk {chunk}: -sim nll {} vs the cache's {} ({d:.1e})", r[2].nll, r[1].nll);
        assert!(r[4].kl.unwrap() < 1e-4, "chunk {chunk}: unquantized -pre kl {:?}", r[4].kl);
        for i in [3, 5] {
            assert!(r[i].kl.unwrap() > 1e-3 && r[i].nll.is_finite(), "chunk {chunk}: {} kl {:?}", names[i], r[i].kl);
        }
    }
    // A -pre method with -c needs the pre-RoPE calibration.
    let c = KvMethod::parse("k2v2-c-pre", 64, 70).unwrap();
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: None, chunk: 1, pre_calibration: None, pass_rows: None };
    assert!(model::perplexity(&m, &windows, &[c], &opts, &mut |_, _| {}).is_err());
}

/// `CacheAttention::multi_token_decode`: several rows of one sequence, into a sequence
/// that already holds tokens, are appended and decoded together; with an f16 cache that
/// is the token-by-token result up to f32 rounding. Logits measured 1.0e-5 apart: the
/// random model's attention logits are large (perplexity ~1e36), so the decode's f32
/// rounding (about 1e-7 relative) moves its softmax weights by ~1e-5; bound 1e-4.
#[test]
fn multi_token_rows_through_the_cache() {
    let m = random_model(24, false);
    let t = tokens(30, 25);
    let shape =
        CacheShape { layers: 2, num_kv_heads: 2, num_q_heads: 4, max_seqs: 2, max_tokens: 30, num_blocks: None };
    let config = KvMethod::parse("f16", 64, 30).unwrap().config;
    let new = |multi: bool| {
        let mut cache = KvCache::new(config, shape, Backend::Cpu).unwrap();
        let ids = [cache.add_sequence().unwrap(), cache.add_sequence().unwrap()];
        let mut attn = CacheAttention::new(&m.config, vec![cache], vec![(0, ids[0]), (0, ids[1])]).unwrap();
        attn.multi_token_decode = multi;
        attn
    };
    let (mut single, mut multi) = (new(false), new(true));
    let mut want = Vec::new();
    for (p, &tok) in t.iter().enumerate() {
        want.extend(m.forward(&[tok], &[Row { seq: 0, pos: p }], &mut single, None, 2).unwrap());
    }
    // Chunks of 1, 5, 3 and 21 rows; the second sequence gets the same rows in reverse
    // chunk order of its own (batch rows of several sequences and chunk sizes at once).
    let mut got = Vec::new();
    let mut at = 0;
    for n in [1, 5, 3, 21] {
        let rows: Vec<Row> = (at..at + n).map(|p| Row { seq: 0, pos: p }).collect();
        got.extend(m.forward(&t[at..at + n], &rows, &mut multi, None, 2).unwrap());
        at += n;
    }
    let e = rel_err(&m.logits(&got), &m.logits(&want));
    assert!(e < 1e-4, "multi-token rows vs token by token: {e:.2e}");
    // Two sequences with different row counts in one batch: the second sequence's first
    // three tokens (one decode of 3 rows) beside a row of the first past its end.
    let rows = [Row { seq: 1, pos: 0 }, Row { seq: 1, pos: 1 }, Row { seq: 1, pos: 2 }];
    let h = m.forward(&t[..3], &rows, &mut multi, None, 2).unwrap();
    let e = rel_err(&m.logits(&h), &m.logits(&want[..3 * 256]));
    assert!(e < 1e-4, "second sequence: {e:.2e}");
    let rows = [Row { seq: 1, pos: 3 }, Row { seq: 1, pos: 4 }, Row { seq: 0, pos: 30 }];
    assert!(m.forward(&t[3..6], &rows, &mut multi, None, 2).is_err(), "sequence 0 is full");
}

/// The GGUF byte-level vocabulary: the 256 byte characters, then merged tokens.
fn byte_vocab() -> (Vec<String>, Vec<String>) {
    let mut chars = Vec::new();
    let mut extra = 0;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        chars.push(if printable {
            char::from_u32(b).unwrap()
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap()
        });
    }
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "1 2"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    (tokens, merges.iter().map(|s| s.to_string()).collect())
}

#[test]
fn gguf_written_here_loads_with_llama_rows_unpermuted() {
    let m = random_model(8, false);
    let c = &m.config;
    // llama.cpp's conversion: GGUF row 2i + h of a head is Hugging Face row h * d/2 + i.
    let permute = |w: &Weight, heads: usize| -> Vec<f32> {
        let w = f32s(w);
        let d = w.rows / heads;
        let mut out = vec![0f32; w.data.len()];
        for hd in 0..heads {
            for i in 0..d / 2 {
                for h in 0..2 {
                    out[(hd * d + 2 * i + h) * w.cols..][..w.cols].copy_from_slice(w.row(hd * d + h * d / 2 + i));
                }
            }
        }
        out
    };
    let dims = |w: &Weight| vec![w.cols() as u64, w.rows() as u64];
    let mut tensors = vec![
        ("token_embd.weight".to_string(), dims(&m.embed), f32s(&m.embed).data.clone()),
        ("output_norm.weight".to_string(), vec![256], m.norm.clone()),
    ];
    for (l, w) in m.layers.iter().enumerate() {
        let n = |s: &str| format!("blk.{l}.{s}");
        tensors.push((n("attn_norm.weight"), vec![256], w.attn_norm.clone()));
        tensors.push((n("attn_q.weight"), dims(&w.wq), permute(&w.wq, 4)));
        tensors.push((n("attn_k.weight"), dims(&w.wk), permute(&w.wk, 2)));
        for (name, x) in [
            ("attn_v.weight", &w.wv),
            ("attn_output.weight", &w.wo),
            ("ffn_gate.weight", &w.gate),
            ("ffn_up.weight", &w.up),
            ("ffn_down.weight", &w.down),
        ] {
            tensors.push((n(name), dims(x), f32s(x).data.clone()));
        }
        tensors.push((n("ffn_norm.weight"), vec![256], w.ffn_norm.clone()));
    }
    let (mut vocab, merges) = byte_vocab();
    vocab.resize(300, "<pad>".into());
    let meta = [
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.embedding_length", Meta::U32(256)),
        ("llama.block_count", Meta::U32(2)),
        ("llama.attention.head_count", Meta::U32(4)),
        ("llama.attention.head_count_kv", Meta::U32(2)),
        ("llama.feed_forward_length", Meta::U32(96)),
        ("llama.rope.freq_base", Meta::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("smollm".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(vocab)),
        ("tokenizer.ggml.merges", Meta::Strs(merges)),
    ];
    let bytes = gguf_bytes(&meta, &tensors);
    let g = Gguf::parse(bytes.clone()).unwrap();
    let loaded = Llama::from_gguf(&g).unwrap();
    assert_eq!(&loaded.config, c);
    for (a, b) in loaded.layers.iter().zip(&m.layers) {
        assert_eq!(a.wq, b.wq);
        assert_eq!(a.wk, b.wk);
        assert_eq!(a.down, b.down);
    }
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let text = "the and then 1234 x\n\n  a";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), text);
    // Merged: "he" (257), "Ġthe" (258), "Ġa" (260), "Ġand" (262); digits one by one ("12",
    // 263, is never formed); the space before them is a piece of its own; "\n\n  a" keeps
    // one space for "Ġa".
    assert_eq!(ids, [116, 257, 262, 258, 110, 32, 49, 50, 51, 52, 32, 120, 10, 10, 32, 260]);
    // A truncated file, a wrong shape and a missing tensor are errors.
    assert!(Gguf::parse(bytes[..bytes.len() - 100].to_vec()).is_err());
    tensors.retain(|t| t.0 != "blk.1.ffn_up.weight");
    let g = Gguf::parse(gguf_bytes(&meta, &tensors)).unwrap();
    assert!(Llama::from_gguf(&g).unwrap_err().to_string().contains("blk.1.ffn_up.weight"));
    // An empty feed-forward layer is refused by name, whatever the storage (it once
    // divided by zero in the product over stored blocks).
    let mut zero = meta.clone();
    zero[5].1 = Meta::U32(0);
    let g = Gguf::parse(gguf_bytes(&zero, &tensors)).unwrap();
    for s in [WeightStorage::F32, WeightStorage::Quantized, WeightStorage::Auto] {
        assert!(Llama::from_gguf_with(&g, s).unwrap_err().to_string().contains("feed-forward length 0"), "{s:?}");
    }
}

#[test]
fn tokenizer_digits_and_fallback() {
    let (vocab, merges) = byte_vocab();
    let merges: Vec<&str> = merges.iter().map(String::as_str).collect();
    let single = Tokenizer::new(vocab.clone(), &merges, Pre::SingleDigits, [None, None, None]).unwrap();
    let pattern = Tokenizer::new(vocab, &merges, Pre::Gpt2, [None, None, None]).unwrap();
    // "12" merges only when digits are left to the GPT-2 pattern.
    assert_eq!(single.encode("12").unwrap().len(), 2);
    assert_eq!(pattern.encode("12").unwrap().len(), 1);
    for text in ["", "héllo wörld ✓", "tabs\tand\r\nlines", "x  y   z"] {
        assert_eq!(single.decode(&single.encode(text).unwrap()).unwrap(), text);
    }
}

#[test]
fn kv_methods_parse_and_size() {
    let m = KvMethod::parse("k2v2-g32-w256-s0", 64, 1024).unwrap();
    assert_eq!((m.config.group_size, m.config.window, m.config.sinks), (32, 256, 0));
    assert!(KvMethod::parse("f16", 64, 1024).unwrap().config.window >= 1024);
    assert_eq!(KvMethod::parse("f16", 64, 1024).unwrap().bits_per_element(), 16.0);
    assert_eq!(KvMethod::parse("k2v2-o64-x80", 64, 1024).unwrap().online, Some(64));
    assert_eq!(KvMethod::parse("k2v2-o64-x80", 64, 1024).unwrap().config.key_clip, 0.8);
    let m = KvMethod::parse("k2v2-c-l-dh8-v3", 64, 1024).unwrap();
    assert!(m.calib.center && m.calib.learned && !m.calib.reorder);
    assert_eq!(
        (m.detect, m.config.protected, m.config.channel_norm),
        (Some((model::sinks::Detector::Hidden, 8)), 8, 3)
    );
    let m = KvMethod::parse("k2v2-c-a50", 64, 1024).unwrap();
    assert!(m.calib.center && m.calib.smooth == Some(Smooth::Alpha(50)));
    assert_eq!(KvMethod::parse("k4v2-a100-g32", 64, 1024).unwrap().calib.smooth, Some(Smooth::Alpha(100)));
    assert_eq!(KvMethod::parse("k2v2-c-aa-dh8", 64, 1024).unwrap().calib.smooth, Some(Smooth::Auto));
    assert_eq!(KvMethod::parse("k2v2-c", 64, 1024).unwrap().calib.smooth, None);
    assert_eq!(KvMethod::parse("k2v2-da4", 64, 1024).unwrap().detect, Some((model::sinks::Detector::Attention, 4)));
    assert_eq!(KvMethod::parse("k2v2-dk2", 64, 1024).unwrap().detect, Some((model::sinks::Detector::KeyNorm, 2)));
    for bad in [
        "k3v2",
        "k2v2-q5",
        "k2v2-g48",
        "f16-w8",
        "k2v2-gx",
        "k2v2-c-o64",
        "k2v2-o2",
        "k2v2-x40",
        "f16-c",
        "k2v2-c-r-l",
        "k2v2-dx4",
        "k2v2-dh",
        "k2v2-dh40",
        "k2v2-v9",
        "f16-dh4",
        "f16-l",
        "f16-a50",
        "k2v2-a",
        "k2v2-a500",
        "k2v2-c-r-a50",
        "k2v2-c-l-a50",
        "k2v2-c-r-aa",
        "f16-aa",
        "k2v2-ab",
    ] {
        assert!(KvMethod::parse(bad, 64, 1024).is_err(), "{bad}");
    }
    // k2v2, d64, g64: a quantized token is 2 x (16 B codes + 4 B scale and zero); an f16
    // one (sinks, window) 2 x 128 B.
    let k = KvMethod::parse("k2v2", 64, 1024).unwrap();
    let q = k.config.format().unwrap().quantized_len(1024) as usize;
    assert_eq!(k.kv_bytes(1024, 1, 1).unwrap(), q * 40 + (1024 - q) * 256);
    // Detected sinks add their f16 copies; variance normalization 2 x 64 f16 channel
    // scales per 64-token page.
    let k = KvMethod::parse("k2v2-dh8-v2", 64, 1024).unwrap();
    assert_eq!(k.kv_bytes(1024, 1, 1).unwrap(), q * 40 + q / 64 * 256 + (1024 - q + 8) * 256);
    assert_eq!(k.bits_per_element(), 2.5 + 0.25);
}

// ---- SmolLM2-135M (after `cargo xtask fetch`) ----------------------------------------

fn real() -> Option<(Llama, Tokenizer)> {
    match model::fetched(model::SMOLLM2) {
        Some(p) => Some(model::load(&p).unwrap()),
        None => {
            eprintln!("SKIPPED: {} not fetched (run `cargo xtask fetch`)", model::SMOLLM2);
            None
        }
    }
}

fn text(name: &str) -> Option<String> {
    let p = model::fetched(&format!("text/{name}"));
    if p.is_none() {
        eprintln!("SKIPPED: text/{name} not fetched (run `cargo xtask fetch`)");
    }
    p.map(|p| model::read_text(&p).unwrap())
}

fn tile_metadata(path: &std::path::Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

#[test]
fn smollm2_tokens_and_greedy_paris() {
    let (Some((m, tok)), Some(alice)) = (real(), text("alice29.txt")) else { return };
    let ids = tok.encode(&alice).unwrap();
    let meta = tile_metadata(&repo_data().join("smollm2-alice-kv-l0-l5.safetensors"));
    let want: Vec<u32> = serde_json::from_str(&meta["token_ids"]).unwrap();
    assert_eq!(&ids[..want.len()], &want[..], "token ids of the first {} tokens of alice29.txt", want.len());
    assert_eq!(tok.decode(&ids).unwrap(), alice, "decoding the ids gives the text back");
    assert!(!tok.add_bos, "SmolLM2's GGUF says add_bos_token = false");
    let prompt = tok.encode("The capital of France is").unwrap();
    let out = model::generate(&m, &prompt, 8, rotkv::CacheConfig::k2v2(64), Backend::Cpu).unwrap();
    let continuation = tok.decode(&out).unwrap();
    eprintln!("greedy (k2v2 cache): The capital of France is{continuation}");
    assert!(continuation.contains("Paris"), "{continuation:?}");
}

#[test]
fn smollm2_capture_reproduces_the_tiles() {
    let (Some((m, tok)), Some(alice)) = (real(), text("alice29.txt")) else { return };
    // The files hold 2048 tokens; attention is causal, so the first 512 tokens' keys and
    // values depend on those 512 alone: the capture of the prefix is compared with the
    // files' first 512 rows (a quarter of the tokens; 6.8 s of CPU here).
    const PREFIX: usize = 512;
    let ids = &tok.encode(&alice).unwrap()[..PREFIX];
    let cap = model::capture(&m, ids, &[0, 5]).unwrap();
    let check = |path: &std::path::Path, bound: f64| {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, (shape, x)) in &cap.tensors {
            let t = st.tensor(name).unwrap();
            assert_eq!((t.shape()[0], &t.shape()[1..]), (2048, &shape[1..]), "{name}");
            assert_eq!(shape[0], PREFIX, "{name}");
            let y: Vec<f32> = t.data()[..2 * x.len()]
                .chunks_exact(2)
                .map(|b| rotkv::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect();
            let err = rel_err(x, &y);
            eprintln!("{} {name}: relative difference {err:.2e}", path.file_name().unwrap().to_string_lossy());
            assert!(err < bound, "{name}: {err}");
        }
    };
    // The bundled tile was written by `rotkv capture`: equal up to its f16 rounding.
    check(&repo_data().join("smollm2-alice-kv-l0-l5.safetensors"), 1e-3);
    match shared_data() {
        // Computed in fp32 by independent code (Hugging Face transformers): within 1%.
        Some(dir) => check(&dir.join("smollm2-alice-kv.safetensors"), 0.01),
        None => eprintln!("SKIPPED: ../shared/data not present (capture vs the shared file)"),
    }
}

/// Slow (40 s on two cores; run by `cargo xtask ci` with `--ignored`): the presets and the recommended
/// recipes on SmolLM2. Calibrated on the first 1024 tokens of alice29.txt (the smoothing
/// measured for the presets' key quantizers, 64 queries per head), evaluated on 2
/// windows of 512 tokens of lcet10.txt, 16 tokens per decode step.
#[test]
#[ignore = "slow: SmolLM2 calibration and perplexity; cargo xtask ci runs it"]
fn smollm2_recipe_perplexity_2x512() {
    let (Some((m, tok)), Some(cal_text), Some(text)) = (real(), text("alice29.txt"), text("lcet10.txt")) else {
        return;
    };
    let cal_ids: Vec<u32> = [tok.bos_prefix(), tok.encode(&cal_text).unwrap()].concat()[..1024].to_vec();
    let opts = model::calibrate::CalibrateOptions { queries: 64, ..model::calibrate::CalibrateOptions::presets(64) };
    let cal = model::calibrate::calibrate_with(&m, &cal_ids, &opts, &mut |_| ()).unwrap();
    assert!(cal.has_smoothing_choice(2) && cal.has_smoothing_choice(4));
    let ids = tok.encode(&text).unwrap();
    let windows: Vec<Vec<u32>> = ids.chunks_exact(512).take(2).map(<[u32]>::to_vec).collect();
    let methods: Vec<KvMethod> = ["f16", "k4v2-raw", "k2v2-raw", "k4v2", "k2v2"]
        .iter()
        .map(|n| KvMethod::parse_calibrated(n, 64, 512, true).unwrap())
        .collect();
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: Some(cal), chunk: 16, pre_calibration: None, pass_rows: None };
    let r = model::perplexity(&m, &windows, &methods, &opts, &mut |_, _| {}).unwrap();
    for x in &r {
        let (kl, top1) = (x.kl.unwrap(), x.top1.unwrap());
        eprintln!("{:<8} ppl {:.3} KL {kl:.4} top-1 {top1:.3} over {} tokens", x.method.name, x.ppl, x.tokens);
    }
    assert_eq!(r[0].tokens, 2 * 511);
    let f16 = r[0].ppl;
    assert!(r[0].kl == Some(0.0) && f16 > 5.0 && f16 < 100.0, "f16 perplexity {f16}");
    let change = |i: usize| r[i].ppl / f16 - 1.0;
    // Measured (f16 38.189): k4v2-raw +0.61% (KL 0.0036), k2v2-raw +4.95% (0.0514), the
    // recipes k4v2 +0.18% (0.0019) and k2v2 +2.11% (0.0143). The recipes must stay within the
    // targets (k4v2 1.5%, k2v2 5%) and below the bare presets' KL; the bounds leave room
    // for other CPUs' f32 rounding, not for a regression of the recipe.
    assert!(change(3) < 0.015 && change(4) < 0.05, "recipes: k4v2 {:+.4}, k2v2 {:+.4}", change(3), change(4));
    assert!(r[3].kl < r[1].kl && r[4].kl < r[2].kl, "the recipes below the bare presets' KL");
    assert!(r[3].kl < r[4].kl, "4-bit keys below 2-bit keys");
}

#[test]
fn calibration_feeds_the_perplexity_harness() {
    let m = random_model(10, false);
    // Means, permutations and (a few Adam steps of) learned rotations for the methods'
    // quantizer.
    let base = KvMethod::parse("k2v2-s2-w16-p16", 64, 64).unwrap().config;
    let optr = model::optr::OptrOptions { steps: 3, queries: 6, ..model::optr::OptrOptions::for_config(&base) };
    let mut layers_done = Vec::new();
    let cal = model::calibrate::calibrate(&m, &tokens(64, 11), Some(&optr), &mut |l| layers_done.push(l)).unwrap();
    assert_eq!(layers_done, [0, 1]);
    assert_eq!((cal.layers.len(), cal.kv_heads, cal.head_dim), (2, 2, 64));
    assert!(cal.has_learned_rotations() && cal.metadata.contains_key("optr.mean_loss_ratio"));
    let back = model::calibrate::Calibration::from_safetensors(&cal.to_safetensors().unwrap()).unwrap();
    assert_eq!(back.layers, cal.layers);
    let windows = vec![tokens(48, 12), tokens(48, 13)];
    let methods: Vec<KvMethod> = [
        "f16",
        "k2v2-s2-w16-p16",
        "k2v2-s2-w16-p16-c-r-g32-x80",
        "k2v2-s2-w16-p16-o20",
        "k2v2-s2-w16-p16-c-l",
        "k2v2-s2-w16-p16-dh3",
        "k2v2-s2-w16-p16-c-a50",
    ]
    .iter()
    .map(|n| KvMethod::parse(n, 64, 48).unwrap())
    .collect();
    // A method that asks for calibration without one is an error, not a silent identity.
    let none =
        PplOptions { backend: Backend::Cpu, calibration: None, chunk: 1, pre_calibration: None, pass_rows: None };
    let err = model::perplexity(&m, &windows, &methods, &none, &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("calibration"), "{err}");
    // Calibrated, on the CPU and on the emulated GPU kernels: the same perplexities up to
    // rounding. The emulated decode runs on tensor cores (f16 query and probabilities,
    // within 3e-3 of the reference), so the mean NLL per token (here ~80 nats: random
    // weights) is compared, to 2e-2 nats (seen: 2e-3 for f16, 6e-3 for k2v2).
    let mut results = Vec::new();
    for backend in [Backend::Cpu, Backend::Sim] {
        let opts =
            PplOptions { backend, calibration: Some(cal.clone()), chunk: 1, pre_calibration: None, pass_rows: None };
        results.push(model::perplexity(&m, &windows, &methods, &opts, &mut |_, _| {}).unwrap());
    }
    for (a, b) in results[0].iter().zip(&results[1]) {
        assert!(a.ppl.is_finite() && a.ppl > 1.0, "{}: {}", a.method.name, a.ppl);
        assert!((a.ppl.ln() - b.ppl.ln()).abs() < 2e-2, "{}: cpu {} sim {}", a.method.name, a.ppl, b.ppl);
    }
    // The calibration changes what the quantized cache holds, so the perplexity moves;
    // so do learned rotations and protected sinks.
    assert_ne!(results[0][1].ppl, results[0][2].ppl);
    assert_ne!(results[0][1].ppl, results[0][4].ppl);
    assert_ne!(results[0][1].ppl, results[0][5].ppl);
    assert!(cal.has_key_std());
    assert_ne!(results[0][1].ppl, results[0][6].ppl);
    // -a without key_std in the file is an error, not a silent identity.
    let mut no_std = cal.clone();
    no_std.layers.iter_mut().for_each(|l| l.key_scale.fill(1.0));
    let opts = PplOptions {
        backend: Backend::Cpu,
        calibration: Some(no_std),
        chunk: 1,
        pre_calibration: None,
        pass_rows: None,
    };
    let err = model::perplexity(&m, &windows, &methods[6..7], &opts, &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("key_std"), "{err}");
    // -l with -r does not combine; -l without rotations in the file is an error.
    assert!(KvMethod::parse("k2v2-c-r-l", 64, 48).is_err());
    let plain = model::calibrate::calibrate(&m, &tokens(64, 11), None, &mut |_| ()).unwrap();
    let opts = PplOptions {
        backend: Backend::Cpu,
        calibration: Some(plain),
        chunk: 1,
        pre_calibration: None,
        pass_rows: None,
    };
    assert!(model::perplexity(&m, &windows, &methods[4..5], &opts, &mut |_, _| {}).is_err());
}

#[test]
fn sink_detectors_pick_positions_after_the_prefix() {
    use model::sinks::{Detector, detect};
    let m = random_model(14, false);
    let t = tokens(40, 15);
    for how in [Detector::Attention, Detector::KeyNorm, Detector::Hidden] {
        let found = detect(&m, &t, 3, 4, how).unwrap();
        assert_eq!(found.len(), 2, "{how:?}: one list per layer");
        for p in &found {
            assert_eq!(p.len(), 3);
            assert!(p.windows(2).all(|w| w[0] < w[1]) && p[0] >= 4, "{how:?}: {p:?}");
            let last = if how == Detector::Attention { 40 - model::sinks::ATTENTION_LAG } else { 40 };
            assert!((p[2] as usize) < last, "{how:?}: {p:?}");
        }
        // The hidden state of layer 0 is the embedding: its norms decide alone.
        if how == Detector::Hidden {
            let norms: Vec<f64> = t
                .iter()
                .map(|&id| f32s(&m.embed).row(id as usize).iter().map(|&x| x as f64 * x as f64).sum::<f64>())
                .collect();
            let mut order: Vec<usize> = (4..40).collect();
            order.sort_by(|&a, &b| norms[b].total_cmp(&norms[a]).then(a.cmp(&b)));
            let mut want: Vec<u32> = order[..3].iter().map(|&i| i as u32).collect();
            want.sort_unstable();
            assert_eq!(found[0], want);
        }
        assert!(detect(&m, &t[..20], 30, 4, how).is_err(), "{how:?}: too few positions");
    }
}

#[test]
fn per_sequence_key_means() {
    // Sinks and window hold everything (f16): a per-sequence shift of all keys must leave
    // attention unchanged up to f16 rounding, on every backend.
    let config = rotkv::CacheConfig { window: 256, ..rotkv::CacheConfig::k2v2(64) };
    let shape =
        CacheShape { layers: 1, num_kv_heads: 2, num_q_heads: 6, max_seqs: 2, max_tokens: 200, num_blocks: None };
    let mut r = Rng::new(30);
    let k: Vec<f32> = (0..200 * 128).map(|i| r.normal() + if i % 64 == 3 { 6.0 } else { 0.0 }).collect();
    let v: Vec<f32> = (0..200 * 128).map(|_| r.normal()).collect();
    let q: Vec<f32> = (0..2 * 6 * 64).map(|_| r.normal()).collect();
    let mean: Vec<f32> = (0..128).map(|i| if i % 64 == 3 { 6.0 } else { 0.1 * (i % 5) as f32 }).collect();
    for backend in rotkv_tests::backends() {
        let mut cache = KvCache::new(config, shape, backend).unwrap();
        let (a, b) = (cache.add_sequence().unwrap(), cache.add_sequence().unwrap());
        assert!(matches!(cache.set_sequence_key_mean(0, a, &mean[..127]), Err(rotkv::Error::Shape(_))));
        let mut nan = mean.clone();
        nan[9] = f32::NAN;
        assert!(matches!(cache.set_sequence_key_mean(0, a, &nan), Err(rotkv::Error::Value(_))));
        assert!(cache.set_sequence_key_mean(1, a, &mean).is_err());
        assert!(cache.set_sequence_key_mean(0, rotkv::SeqId::from_slot(7), &mean).is_err());
        cache.set_sequence_key_mean(0, a, &mean).unwrap();
        let n = if rotkv_tests::emulated(backend) { 40 } else { 200 };
        for s in [a, b] {
            cache.append(0, s, n, &k[..n * 128], &v[..n * 128]).unwrap();
        }
        assert!(matches!(cache.set_sequence_key_mean(0, a, &mean), Err(rotkv::Error::Calibration(_))));
        let mut out = vec![0f32; q.len()];
        cache.decode(0, &[a, b], &q, &mut out).unwrap();
        let (oa, ob) = out.split_at(6 * 64);
        let mut out_b = vec![0f32; 6 * 64];
        cache.decode(0, &[b], &q[..6 * 64], &mut out_b).unwrap();
        assert!(rel_err(oa, &out_b) < 2e-3, "{backend:?}: {}", rel_err(oa, &out_b));
        assert!(ob.iter().all(|x| x.is_finite()));
    }
}

fn gguf_tokenizer(pre: &str, extra: &[(&'static str, Meta)]) -> rotkv::Result<Tokenizer> {
    let (vocab, merges) = byte_vocab();
    let mut meta = vec![
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str(pre.into())),
        ("tokenizer.ggml.tokens", Meta::Strs(vocab)),
        ("tokenizer.ggml.merges", Meta::Strs(merges)),
    ];
    meta.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
    Tokenizer::from_gguf(&Gguf::parse(gguf_bytes(&meta, &[])).unwrap())
}

#[test]
fn unknown_pre_tokenizers_are_refused_by_name() {
    for (pre, ok) in [
        ("smollm", true),
        ("gpt-2", true),
        ("qwen2", true),
        ("llama-bpe", true),
        ("deepseek-r1-qwen", true),
        ("default", true),
        ("tekken", false),
        ("chameleon", false),
    ] {
        match gguf_tokenizer(pre, &[("tokenizer.ggml.bos_token_id", Meta::U32(3))]) {
            Ok(_) => assert!(ok, "{pre}"),
            Err(e) => assert!(!ok && e.to_string().contains(pre), "{pre}: {e}"),
        }
    }
    let g = Gguf::parse(gguf_bytes(&[("tokenizer.ggml.model", Meta::Str("t5".into()))], &[])).unwrap();
    assert!(matches!(Tokenizer::from_gguf(&g), Err(rotkv::Error::Unsupported(_))));
}

/// The pieces of each pre-tokenizer on text that tells them apart, derived by hand from
/// llama.cpp's patterns: llama-3 keeps digits in runs of up to three, Qwen2 splits every
/// digit; both take a letter run with one leading non-letter (`.x`), contractions in any
/// case (`'S`) and newlines apart from the spaces after them; GPT-2 (after SmolLM2's
/// single digits) keeps newlines with the spaces that follow.
#[test]
fn pre_tokenizers_split_as_llama_cpp() {
    let text = "Hello world 12345 IT'S.x\n\n  y";
    let cases: [(&str, &[&str]); 4] = [
        ("llama-bpe", &["Hello", " world", " ", "123", "45", " IT", "'S", ".x", "\n\n", " ", " y"]),
        ("qwen2", &["Hello", " world", " ", "1", "2", "3", "4", "5", " IT", "'S", ".x", "\n\n", " ", " y"]),
        ("smollm", &["Hello", " world", " ", "1", "2", "3", "4", "5", " IT", "'", "S", ".", "x", "\n\n ", " y"]),
        ("gpt-2", &["Hello", " world", " 12345", " IT", "'", "S", ".", "x", "\n\n ", " y"]),
    ];
    for (pre, want) in cases {
        let tok = gguf_tokenizer(pre, &[("tokenizer.ggml.bos_token_id", Meta::U32(3))]).unwrap();
        assert_eq!(tok.pre_tokens(text).unwrap(), want, "{pre}");
        assert_eq!(tok.decode(&tok.encode(text).unwrap()).unwrap(), text, "{pre}");
    }
    // llama-3 takes a whole pre-token found in the vocabulary (ignore_merges): with the
    // merge "Ġa n" ranked after "Ġt he", " an" is one token either way; a token whose
    // merges are missing is found only by llama-3's whole-word lookup.
    let (mut vocab, merges) = byte_vocab();
    vocab.push("Ġxyz".into());
    let merges: Vec<&str> = merges.iter().map(String::as_str).collect();
    let llama3 = Tokenizer::new(vocab.clone(), &merges, Pre::Llama3, [None; 3]).unwrap();
    let qwen2 = Tokenizer::new(vocab, &merges, Pre::Qwen2, [None; 3]).unwrap();
    assert_eq!(llama3.encode(" xyz").unwrap(), [264]);
    assert_eq!(qwen2.encode(" xyz").unwrap().len(), 4);
}

/// BOS: `tokenizer.ggml.add_bos_token` decides; without it llama.cpp's default (on for
/// llama-3, off for other byte-level files); asked for without a BOS id is an error.
#[test]
fn bos_follows_the_file() {
    let bos = ("tokenizer.ggml.bos_token_id", Meta::U32(3));
    let t = gguf_tokenizer("llama-bpe", std::slice::from_ref(&bos)).unwrap();
    assert_eq!((t.add_bos, t.bos_prefix()), (true, vec![3]));
    let t = gguf_tokenizer("qwen2", std::slice::from_ref(&bos)).unwrap();
    assert_eq!((t.add_bos, t.bos_prefix()), (false, vec![]));
    let t = gguf_tokenizer("qwen2", &[bos.clone(), ("tokenizer.ggml.add_bos_token", Meta::Bool(true))]).unwrap();
    assert_eq!(t.bos_prefix(), [3]);
    let t = gguf_tokenizer("llama-bpe", &[bos, ("tokenizer.ggml.add_bos_token", Meta::Bool(false))]).unwrap();
    assert!(t.bos_prefix().is_empty());
    assert!(gguf_tokenizer("llama-bpe", &[]).is_err(), "BOS asked for, none named");
}

/// SentencePiece BPE (`tokenizer.ggml.model = llama`): merges by the merged token's score,
/// `▁` for spaces and in front, bytes the vocabulary lacks as `<0xNN>` tokens.
#[test]
fn sentencepiece_merges_by_score_with_byte_fallback() {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    tokens.extend((0..256).map(|b| format!("<0x{b:02X}>")));
    let pieces = ["▁", "a", "b", "c", "ab", "bc", "▁a", "▁ab", "abc"];
    tokens.extend(pieces.iter().map(|p| p.to_string()));
    let mut types = vec![2i64, 3, 3];
    types.extend([6i64; 256]);
    types.extend([1i64; 9]);
    // Scores: "▁a" merges first, then "bc" before "▁ab" and "ab".
    let score = |p: &str| match p {
        "▁a" => -1.0,
        "bc" => -2.0,
        "▁ab" => -3.0,
        "ab" => -4.0,
        "abc" => -5.0,
        _ => -100.0,
    };
    let scores: Vec<f64> = tokens.iter().map(|t| score(t)).collect();
    let id = |p: &str| tokens.iter().position(|t| t == p).unwrap() as u32;
    let ids = [Some(1), Some(2), Some(0)];
    let tok = Tokenizer::sentencepiece(tokens.clone(), &scores, &types, true, ids).unwrap();
    // "▁abc": ▁a first (-1), then b+c (-2): [▁a, bc].
    assert_eq!(tok.encode("abc").unwrap(), [id("▁a"), id("bc")]);
    // "é" is not in the vocabulary: its two UTF-8 bytes.
    assert_eq!(tok.encode("ab é").unwrap(), [id("▁ab"), id("▁"), 3 + 0xC3, 3 + 0xA9]);
    for text in ["abc", "ab é", "a  b\nc"] {
        assert_eq!(tok.decode(&tok.encode(text).unwrap()).unwrap(), text);
    }
    assert!(tok.add_bos && tok.bos_prefix() == [1]);
}

#[test]
fn smollm2_passkey_prompts_and_a_short_retrieval() {
    use rotkv::model::passkey::{self, PasskeyOptions};
    let Some((m, tok)) = real() else { return };
    // The needle moves back with the depth; every prompt fits the budget.
    let mut at = Vec::new();
    for depth in [0, 50, 100] {
        let p = passkey::prompt(&tok, 300, depth, 12345).unwrap();
        assert!(p.haystack.len() + p.question.len() <= 300);
        assert!(p.haystack.len() + p.question.len() > 300 - 40, "filler fills the budget");
        assert_eq!(p.question, tok.encode(passkey::QUESTION).unwrap());
        let text = tok.decode(&p.haystack).unwrap();
        assert!(text.starts_with(passkey::INSTRUCTION), "{text:?}");
        at.push(text.find(&passkey::needle(12345)).expect("the needle is in the haystack"));
    }
    assert!(at[0] < at[1] && at[1] < at[2], "{at:?}");
    assert!(passkey::prompt(&tok, 300, 101, 1).is_err());
    assert!(passkey::prompt(&tok, 40, 50, 1).is_err(), "no room for filler");
    // One short retrieval: the f16 cache finds the key (measured: it does at 400 tokens,
    // depth 50, seed 1; so does k2v2, which is printed, not asserted).
    let methods: Vec<_> = ["f16", "k2v2"].iter().map(|s| KvMethod::parse(s, 64, 420).unwrap()).collect();
    let opts =
        PasskeyOptions { backend: Backend::Cpu, calibration: None, tokens: 400, depths: vec![50], trials: 1, seed: 1 };
    let r = passkey::passkey(&m, &tok, &methods, &opts, &mut |_, _| {}).unwrap();
    eprintln!("{r:?}");
    assert_eq!(r.len(), 2);
    assert!(r[0].correct, "{:?}", r[0]);
    // Methods that need a per-window prefill are refused.
    let online = [KvMethod::parse("k2v2-o16", 64, 420).unwrap()];
    assert!(passkey::passkey(&m, &tok, &online, &opts, &mut |_, _| {}).is_err());
    assert!(passkey::passkey(&m, &tok, &[], &opts, &mut |_, _| {}).is_err());
}

/// `--inject-key-outliers`: the model's function is unchanged (f32 rounding aside) while
/// the chosen RoPE pairs of every KV head's keys are `s` times larger, with and without
/// q/k biases, and through per-head q/k norms (their gains scaled instead).
#[test]
fn injected_key_outliers_keep_the_model_function() {
    use rotkv::model::inject::{Injection, inject_key_outliers};
    let t = tokens(40, 22);
    let rows: Vec<Row> = (0..t.len()).map(|p| Row { seq: 0, pos: p }).collect();
    let spec = Injection::parse("5,3,16").unwrap();
    assert_eq!(spec, Injection { seed: 5, count: 3, scale: 16.0 });
    for (bias, norm) in [(false, false), (true, false), (false, true)] {
        let mut m = random_model(21, bias);
        if norm {
            let mut r = Rng::new(4);
            for w in &mut m.layers {
                let g = |r: &mut Rng| (0..64).map(|_| 1.0 + 0.3 * r.normal()).collect::<Vec<f32>>();
                w.qk_norm = Some([g(&mut r), g(&mut r)]);
            }
        }
        let mut inj = m.clone();
        let pairs = inject_key_outliers(&mut inj, &spec).unwrap();
        assert_eq!(pairs.len(), 2);
        for layer in &pairs {
            assert_eq!(layer.len(), 2);
            for p in layer {
                assert!(p.len() == 3 && p.windows(2).all(|w| w[0] < w[1]) && p[2] < 32, "{p:?}");
            }
            if norm {
                assert_eq!(layer[0], layer[1], "shared norm gains: the same pairs on every head");
            }
        }
        let exact = |m: &Llama| m.forward(&t, &rows, &mut ExactAttention::new(&m.config), None, 2).unwrap();
        let (h0, h1) = (exact(&m), exact(&inj));
        let h0f: Vec<f64> = h0.iter().map(|&x| x as f64).collect();
        assert!(rel(&h1, &h0f) < 1e-5, "bias {bias} norm {norm}: hidden states moved by {}", rel(&h1, &h0f));
        for (l, layer) in pairs.iter().enumerate() {
            let key = |m: &Llama| model::capture(m, &t, &[l]).unwrap().tensors[&format!("layer{l}.k")].1.clone();
            let (k0, k1) = (key(&m), key(&inj));
            for (i, (&a, &b)) in k0.iter().zip(&k1).enumerate() {
                let (h, ch) = ((i / 64) % 2, i % 64);
                let f = if layer[h].contains(&(ch % 32)) { 16.0 } else { 1.0 };
                assert!((b - f * a).abs() <= 1e-4 * (1.0 + (f * a).abs()), "layer {l} head {h} channel {ch}: {a} {b}");
            }
        }
    }
    for bad in ["1,2", "1,2,0", "1,2,x", "a,2,3", "1,2,inf"] {
        assert!(Injection::parse(bad).is_err(), "{bad}");
    }
    let mut m = random_model(21, false);
    assert!(inject_key_outliers(&mut m, &Injection { seed: 1, count: 33, scale: 2.0 }).is_err());
}

/// The smoothing choice: measured per layer and KV head on the calibration tokens, kept
/// in the file, used by `-m` and by a bare preset with a calibration (the recipe); files
/// without it load, and a method that needs it says so.
#[test]
fn measured_smoothing_is_chosen_per_head_and_feeds_the_recipe() {
    use rotkv::model::calibrate::{self, CalibrateOptions, Calibration, SmoothChoice, Use};
    use rotkv::model::inject::{Injection, inject_key_outliers};
    let mut m = random_model(23, false);
    // Key outlier channels on every head (the function unchanged): smoothing must pay.
    inject_key_outliers(&mut m, &Injection { seed: 3, count: 2, scale: 32.0 }).unwrap();
    let small = |name: &str| KvMethod::parse(name, 64, 96).unwrap().config;
    let opts = CalibrateOptions {
        optr: None,
        smooth_for: vec![small("k2v2-s2-w16-p16"), small("k4v2-s2-w16-p16")],
        queries: 32,
        protect: Some((calibrate::RECIPE_DETECTOR, 3)),
        loss: calibrate::SmoothLoss::Output,
    };
    let t = tokens(96, 24);
    let kl_opts = CalibrateOptions { loss: calibrate::SmoothLoss::AttentionKl, ..opts.clone() };
    let by_kl = calibrate::calibrate_with(&m, &t, &kl_opts, &mut |_| ()).unwrap();
    let cal = calibrate::calibrate_with(&m, &t, &opts, &mut |_| ()).unwrap();
    assert_eq!(by_kl.layers, cal.layers, "the loss changes the smoothing choice only");
    let choices = calibrate::smooth_choices();
    for (cal, what) in [(&by_kl, "attention KL"), (&cal, "output error")] {
        assert!(cal.metadata["smooth.k2"].starts_with(&format!("mean {what} over KV heads")));
        for bits in [2, 4] {
            let chosen = &cal.key_smoothing[&bits];
            assert!(chosen.len() == 2 && chosen.iter().all(|l| l.len() == 2), "{chosen:?}");
            // 32x outlier channels: no head is left unsmoothed, and the chosen loss is the
            // smallest measured, far below no smoothing.
            assert!(chosen.iter().flatten().all(|c| *c != SmoothChoice::default()), "{what} {bits}: {chosen:?}");
            let loss = &cal.metadata[&format!("smooth.k{bits}.loss")];
            for (head, losses) in loss.split(' ').enumerate() {
                let x: Vec<f64> = losses.split('/').map(|v| v.parse().unwrap()).collect();
                let best = x.iter().copied().fold(f64::INFINITY, f64::min);
                assert_eq!(choices[calibrate::best_choice(&x)], chosen[head / 2][head % 2]);
                assert!(best < 0.5 * x[0], "{what}, {bits}-bit keys, head {head}: {x:?}");
            }
        }
    }
    // The output loss's metric is the squared norm of the head's output through the
    // projection (and a post-attention norm's gains), against the projection applied to
    // the head's block of a zero-padded attention output.
    let wo = m.layers[1].wo.to_matrix();
    let (heads, d) = (m.config.heads, m.config.head_dim);
    let gains: Vec<f32> = (0..wo.rows).map(|r| 0.5 + (r % 7) as f32 / 4.0).collect();
    for gain in [None, Some(&gains[..])] {
        let metric = calibrate::output_metric(&wo, gain, heads, d);
        assert_eq!((metric.len(), metric[0].len()), (heads, d * d));
        for qh in [0, heads - 1] {
            let x: Vec<f64> = (0..d).map(|a| ((a * 7 + qh) % 11) as f64 / 5.0 - 1.0).collect();
            let want: f64 = (0..wo.rows)
                .map(|r| {
                    let y: f64 = (0..d).map(|a| wo.row(r)[qh * d + a] as f64 * x[a]).sum();
                    (gain.map_or(1.0, |g| g[r] as f64) * y).powi(2)
                })
                .sum();
            let got: f64 = (0..d).map(|a| x[a] * (0..d).map(|b| metric[qh][a * d + b] * x[b]).sum::<f64>()).sum();
            assert!((got - want).abs() <= 1e-9 * want, "head {qh}: {got} vs {want}");
        }
    }
    // The file round trip, and the scales a cache gets.
    let back = Calibration::from_safetensors(&cal.to_safetensors().unwrap()).unwrap();
    assert_eq!((&back.layers, &back.key_smoothing), (&cal.layers, &cal.key_smoothing));
    assert!(back.has_smoothing_choice(2) && back.has_smoothing_choice(4) && !back.has_smoothing_choice(3));
    let c = cal.key_smoothing[&2][1][0];
    let want = calibrate::smoothing_scales_knee(&cal.layers[1].key_scale[..64], 64, c.alpha as f64 / 100.0, c.knee);
    assert_eq!(&back.layer(1, Use::recipe(2)).key_scale[..64], &want[..]);
    let cfg = small("k2v2-s2-w16-p16");
    assert_eq!(back.recipe_layer(1, &cfg).unwrap(), back.layer(1, Use::recipe(2)));
    // Broken choices are refused: a value off the grid, a layer without one.
    let mut bad = cal.clone();
    bad.key_smoothing.get_mut(&2).unwrap()[1][0].alpha = 30;
    assert!(Calibration::from_safetensors(&bad.to_safetensors().unwrap()).is_err());
    bad.key_smoothing.get_mut(&2).unwrap()[1].clear();
    assert!(Calibration::from_safetensors(&bad.to_safetensors().unwrap()).is_err());
    // A bare preset with a calibration is the recipe; with modifiers, what they say.
    let r = KvMethod::parse_calibrated("k2v2", 64, 1024, true).unwrap();
    assert_eq!((r.name.as_str(), r.calib, r.detect), ("k2v2", Use::recipe(2), Some((calibrate::RECIPE_DETECTOR, 8))));
    assert_eq!(KvMethod::parse_calibrated("k4v4", 64, 1024, true).unwrap().calib, Use::recipe(4));
    assert_eq!(
        KvMethod::parse_calibrated("k2v2", 64, 1024, false).unwrap(),
        KvMethod::parse("k2v2", 64, 1024).unwrap()
    );
    let raw = KvMethod::parse_calibrated("k2v2-raw", 64, 1024, true).unwrap();
    assert_eq!(
        (raw.calib, raw.detect, raw.config),
        (Use::default(), None, KvMethod::parse("k2v2", 64, 1024).unwrap().config)
    );
    assert_eq!(KvMethod::parse("k2v2-c-m", 64, 1024).unwrap().calib, Use::recipe(2));
    // Through the harness: the measured smoothing beats none on these keys.
    let windows = vec![tokens(96, 25), tokens(96, 26)];
    let methods: Vec<KvMethod> = ["f16", "k2v2-s2-w16-p16-c-dh3", "k2v2-s2-w16-p16-c-m-dh3"]
        .iter()
        .map(|n| KvMethod::parse(n, 64, 96).unwrap())
        .collect();
    let opts = PplOptions {
        backend: Backend::Cpu,
        calibration: Some(cal.clone()),
        chunk: 4,
        pre_calibration: None,
        pass_rows: None,
    };
    let r = model::perplexity(&m, &windows, &methods, &opts, &mut |_, _| {}).unwrap();
    let (plain, smoothed) = (r[1].kl.unwrap(), r[2].kl.unwrap());
    assert!(smoothed < 0.5 * plain, "KL vs f16: measured smoothing {smoothed}, none {plain}");
    // A file without the choice (an older one): an error that says what to do.
    let mut old = cal.clone();
    old.key_smoothing.clear();
    let old = Calibration::from_safetensors(&old.to_safetensors().unwrap()).unwrap();
    assert!(old.key_smoothing.is_empty() && old.has_key_std());
    let opts = PplOptions {
        backend: Backend::Cpu,
        calibration: Some(old.clone()),
        chunk: 4,
        pre_calibration: None,
        pass_rows: None,
    };
    let e = model::perplexity(&m, &windows, &methods[2..], &opts, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("rotkv calibrate again"), "{e}");
    assert!(old.recipe_layer(0, &cfg).unwrap_err().to_string().contains("rotkv calibrate again"));
    // Too few tokens to measure, or two configurations for one key width: errors.
    assert!(calibrate::calibrate_with(&m, &t[..40], &opts_for(&cfg), &mut |_| ()).is_err());
    let two = CalibrateOptions { smooth_for: vec![cfg, cfg], ..opts_for(&cfg) };
    assert!(calibrate::calibrate_with(&m, &t, &two, &mut |_| ()).is_err());
    // The default calibration of a text too short for the presets stores no choice.
    assert!(calibrate::calibrate(&m, &t, None, &mut |_| ()).unwrap().key_smoothing.is_empty());
}

fn opts_for(cfg: &rotkv::CacheConfig) -> rotkv::model::calibrate::CalibrateOptions<'static> {
    rotkv::model::calibrate::CalibrateOptions {
        optr: None,
        smooth_for: vec![*cfg],
        queries: 8,
        protect: None,
        loss: rotkv::model::calibrate::SmoothLoss::AttentionKl,
    }
}

/// `kivi2`, `kivi4`: KIVI's quantizer simulated in the harness (the anchor): nothing
/// quantized while the window holds everything, 4 bits closer to f16 than 2 bits, and
/// only the modifiers that fit it.
#[test]
fn kivi_anchor_in_the_harness() {
    let k = KvMethod::parse("kivi2", 64, 1024).unwrap();
    assert!(k.kivi && k.simulated && k.quantized && k.config.group_size == 32 && k.config.key_bits == 2);
    assert_eq!(k.bits_per_element(), 3.0);
    for bad in ["kivi2-c", "kivi2-x80", "kivi2-dh8", "kivi2-sim", "kivi4-a50"] {
        assert!(KvMethod::parse(bad, 64, 1024).is_err(), "{bad}");
    }
    let m = random_model(31, false);
    let windows = vec![tokens(96, 32), tokens(96, 33)];
    let methods: Vec<KvMethod> = ["f16", "kivi2-w256", "kivi2-s2-w16-p32", "kivi4-s2-w16-p32"]
        .iter()
        .map(|n| KvMethod::parse(n, 64, 96).unwrap())
        .collect();
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: None, chunk: 4, pre_calibration: None, pass_rows: None };
    let r = model::perplexity(&m, &windows, &methods, &opts, &mut |_, _| {}).unwrap();
    // The whole window in f16 (rounded as the cache rounds): f16's perplexity.
    assert!((r[1].nll - r[0].nll).abs() < 1e-3, "{} vs {}", r[1].nll, r[0].nll);
    let (k2, k4) = (r[2].kl.unwrap(), r[3].kl.unwrap());
    assert!(k2 > 1e-4 && k4 < 0.5 * k2, "KL vs f16: kivi2 {k2}, kivi4 {k4}");
}
