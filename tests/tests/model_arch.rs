//! The architectures of the forward pass against an independent implementation: small
//! random GGUF files (llama with llama-3 RoPE frequency factors, qwen2 with biases and
//! linear RoPE scaling, qwen3 with per-head q/k RMSNorm and head_dim apart from
//! `dim / heads`, gemma3 with post-norms, GeGLU, scaled embeddings and a sliding-window
//! layer) are loaded by rotkv and run with exact attention; their logits are
//! compared with `tests/scripts/reference_forward.py` (numpy, float64, its own GGUF
//! reader), run when `python3` with numpy is there (SKIPPED otherwise), and with the
//! logits that script wrote once, committed in `tests/reference/` (always).

use rotkv::model::gguf::Gguf;
use rotkv::model::llama::{CacheAttention, ExactAttention, Llama, RopeScaling, Row};
use rotkv::model::{self, KvMethod, PplOptions};
use rotkv::{Backend, CacheShape, KvCache};
use rotkv_tests::Rng;
use rotkv_tests::gguf_writer::{Meta, Tensor, gguf_bytes};
use std::path::PathBuf;

const VOCAB: usize = 64;
const TOKENS: usize = 20;

struct Spec {
    name: &'static str,
    arch: &'static str,
    dim: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    bias: bool,
    qk_norm: bool,
    /// llama-3 RoPE frequency factors (factor, low, high, original context).
    llama3: Option<(f32, f32, f32, f32)>,
    linear: Option<f32>,
    tied: bool,
    /// gemma3: post-norms, GeGLU, scaled embeddings, and sliding layers (window 8,
    /// every second layer global through `attention.sliding_window_pattern`).
    gemma: bool,
}

const SPECS: [Spec; 4] = [
    Spec {
        name: "llama3",
        arch: "llama",
        dim: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        bias: false,
        qk_norm: false,
        llama3: Some((8.0, 1.0, 4.0, 16.0)),
        linear: None,
        tied: false,
        gemma: false,
    },
    Spec {
        name: "qwen2",
        arch: "qwen2",
        dim: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        bias: true,
        qk_norm: false,
        llama3: None,
        linear: Some(2.0),
        tied: true,
        gemma: false,
    },
    Spec {
        name: "qwen3",
        arch: "qwen3",
        dim: 96,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        bias: false,
        qk_norm: true,
        llama3: None,
        linear: None,
        tied: true,
        gemma: false,
    },
    // Linear RoPE scaling applies to the global layers only.
    Spec {
        name: "gemma3",
        arch: "gemma3",
        dim: 96,
        heads: 4,
        kv_heads: 1,
        head_dim: 64,
        bias: false,
        qk_norm: true,
        llama3: None,
        linear: Some(2.0),
        tied: true,
        gemma: true,
    },
];

/// Hugging Face's llama-3 frequency scaling as llama.cpp's conversion writes it: one
/// factor per frequency, the inverse frequency divided by it.
fn llama3_factors(d: usize, theta: f32, (factor, low, high, original): (f32, f32, f32, f32)) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    (0..d / 2)
        .map(|i| {
            let inv = 1.0 / (theta as f64).powf(2.0 * i as f64 / d as f64);
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            if wavelen < high_wavelen as f64 {
                1.0
            } else if wavelen > low_wavelen as f64 {
                factor
            } else {
                let smooth = (original as f64 / wavelen - low as f64) / (high as f64 - low as f64);
                (1.0 / ((1.0 - smooth) / factor as f64 + smooth)) as f32
            }
        })
        .collect()
}

/// The GGUF bytes of a random model of `spec` (ggml dims `[in, out]`, F32).
fn model_gguf(spec: &Spec, seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed);
    let (dim, d, ffn, layers) = (spec.dim, spec.head_dim, 80usize, 2usize);
    let (qd, kvd) = (spec.heads * d, spec.kv_heads * d);
    // gemma3's global layers get another base than its sliding layers' 10,000.
    let theta = if spec.gemma { 1e6f32 } else { 10000.0 };
    let mut mat = |rows: usize, cols: usize, scale: f32| -> (Vec<u64>, Vec<f32>) {
        (vec![cols as u64, rows as u64], (0..rows * cols).map(|_| r.normal() * scale).collect())
    };
    let mut tensors: Vec<Tensor> = Vec::new();
    let mut push = |name: String, (dims, data): (Vec<u64>, Vec<f32>)| tensors.push((name, dims, data));
    push("token_embd.weight".into(), mat(VOCAB, dim, 1.0));
    if !spec.tied {
        push("output.weight".into(), mat(VOCAB, dim, 0.2));
    }
    let gain = |n: usize, r: &mut Rng| (vec![n as u64], (0..n).map(|_| 1.0 + 0.2 * r.normal()).collect::<Vec<_>>());
    let mut r2 = Rng::new(seed + 1000);
    push("output_norm.weight".into(), gain(dim, &mut r2));
    for l in 0..layers {
        let n = |s: &str| format!("blk.{l}.{s}");
        push(n("attn_norm.weight"), gain(dim, &mut r2));
        push(n("attn_q.weight"), mat(qd, dim, 0.15));
        push(n("attn_k.weight"), mat(kvd, dim, 0.15));
        push(n("attn_v.weight"), mat(kvd, dim, 0.1));
        if spec.bias {
            push(n("attn_q.bias"), gain(qd, &mut r2));
            push(n("attn_k.bias"), gain(kvd, &mut r2));
            push(n("attn_v.bias"), gain(kvd, &mut r2));
        }
        if spec.qk_norm {
            push(n("attn_q_norm.weight"), gain(d, &mut r2));
            push(n("attn_k_norm.weight"), gain(d, &mut r2));
        }
        push(n("attn_output.weight"), mat(dim, qd, 0.05));
        push(n("ffn_norm.weight"), gain(dim, &mut r2));
        push(n("ffn_gate.weight"), mat(ffn, dim, 0.1));
        push(n("ffn_up.weight"), mat(ffn, dim, 0.1));
        push(n("ffn_down.weight"), mat(dim, ffn, 0.1));
        if spec.gemma {
            push(n("post_attention_norm.weight"), gain(dim, &mut r2));
            push(n("post_ffw_norm.weight"), gain(dim, &mut r2));
        }
    }
    if let Some(p) = spec.llama3 {
        let f = llama3_factors(d, theta, p);
        push("rope_freqs.weight".into(), (vec![f.len() as u64], f));
    }
    let a = spec.arch;
    let k = |s: &str| format!("{a}.{s}");
    let mut meta = vec![
        ("general.architecture".to_string(), Meta::Str(a.into())),
        (k("embedding_length"), Meta::U32(dim as u32)),
        (k("block_count"), Meta::U32(layers as u32)),
        (k("attention.head_count"), Meta::U32(spec.heads as u32)),
        (k("attention.head_count_kv"), Meta::U32(spec.kv_heads as u32)),
        (k("attention.key_length"), Meta::U32(d as u32)),
        (k("attention.value_length"), Meta::U32(d as u32)),
        (k("rope.dimension_count"), Meta::U32(d as u32)),
        (k("feed_forward_length"), Meta::U32(ffn as u32)),
        (k("rope.freq_base"), Meta::F32(theta)),
        (k("attention.layer_norm_rms_epsilon"), Meta::F32(1e-6)),
    ];
    if spec.gemma {
        meta.push((k("attention.sliding_window"), Meta::U32(8)));
        meta.push((k("attention.sliding_window_pattern"), Meta::U32(2)));
    }
    if let Some(f) = spec.linear {
        meta.push((k("rope.scaling.type"), Meta::Str("linear".into())));
        meta.push((k("rope.scaling.factor"), Meta::F32(f)));
    }
    let meta: Vec<(&str, Meta)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    gguf_bytes(&meta, &tensors)
}

fn tokens(seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..TOKENS).map(|_| r.below(VOCAB) as u32).collect()
}

fn rel(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(&x, y)| (x as f64 - y).powi(2)).sum();
    (num / b.iter().map(|y| y * y).sum::<f64>()).sqrt()
}

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("reference")
}

fn read_f64(bytes: &[u8]) -> Vec<f64> {
    bytes.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect()
}

fn numpy_available() -> bool {
    std::process::Command::new("python3").args(["-c", "import numpy"]).output().is_ok_and(|o| o.status.success())
}

/// The numpy reference's logits for a GGUF file, if python3 with numpy runs here.
fn numpy_logits(name: &str, gguf: &[u8], toks: &[u32]) -> Option<Vec<f64>> {
    let dir = std::env::temp_dir().join(format!("rotkv-model-arch-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (model, out) = (dir.join("model.gguf"), dir.join("logits.f64"));
    std::fs::write(&model, gguf).unwrap();
    let list: Vec<String> = toks.iter().map(u32::to_string).collect();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/reference_forward.py");
    let status =
        std::process::Command::new("python3").arg(&script).arg(&model).arg(list.join(",")).arg(&out).status().unwrap();
    assert!(status.success(), "{name}: reference_forward.py failed");
    let logits = read_f64(&std::fs::read(&out).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
    Some(logits)
}

/// f32 forward (f32 products over at most 256 terms, two layers) against float64:
/// measured below 3e-7 relative on these models; bound 1e-5.
#[test]
fn architectures_match_the_numpy_reference() {
    let numpy = numpy_available();
    if !numpy {
        eprintln!("SKIPPED: python3 with numpy is not available (the committed reference logits are still compared)");
    }
    for (i, spec) in SPECS.iter().enumerate() {
        let bytes = model_gguf(spec, 40 + i as u64);
        let m = Llama::from_gguf(&Gguf::parse(bytes.clone()).unwrap()).unwrap();
        let c = &m.config;
        assert_eq!((c.arch.as_str(), c.head_dim, c.q_dim()), (spec.arch, spec.head_dim, spec.heads * spec.head_dim));
        match (spec.llama3, spec.linear) {
            (Some(_), _) => assert!(matches!(c.rope_scaling, RopeScaling::FreqFactors(_))),
            (_, Some(f)) => assert_eq!(c.rope_scaling, RopeScaling::Linear(f)),
            _ => assert_eq!(c.rope_scaling, RopeScaling::None),
        }
        assert_eq!(m.layers[0].qk_norm.is_some(), spec.qk_norm);
        assert_eq!(m.layers[0].bias.is_some(), spec.bias);
        assert_eq!(m.layers[0].post_norms.is_some(), spec.gemma);
        let windows: Vec<Option<usize>> = (0..2).map(|l| c.window_left(l)).collect();
        assert_eq!(windows, if spec.gemma { vec![Some(7), None] } else { vec![None, None] });
        let toks = tokens(60 + i as u64);
        let rows: Vec<Row> = (0..TOKENS).map(|p| Row { seq: 0, pos: p }).collect();
        let hidden = m.forward(&toks, &rows, &mut ExactAttention::new(c), None, c.layers).unwrap();
        let got = m.logits(&hidden);
        let committed = reference_dir().join(format!("arch_{}.f64", spec.name));
        if numpy {
            let want = numpy_logits(spec.name, &bytes, &toks).unwrap();
            let e = rel(&got, &want);
            eprintln!("{}: rotkv vs numpy reference: relative difference {e:.2e}", spec.name);
            assert!(e < 1e-5, "{}: {e}", spec.name);
            if std::env::var_os("ROTKV_WRITE_REFERENCE").is_some() {
                let b: Vec<u8> = want.iter().flat_map(|x| x.to_le_bytes()).collect();
                std::fs::write(&committed, b).unwrap();
            }
        }
        let want = read_f64(&std::fs::read(&committed).unwrap());
        let e = rel(&got, &want);
        eprintln!("{}: rotkv vs committed reference: relative difference {e:.2e}", spec.name);
        assert!(e < 1e-5, "{}: {e} against {}", spec.name, committed.display());
    }
}

/// Without llama-3's factors (or with the linear scaling removed) the logits move far
/// beyond the bound above: the scalings are read, not ignored.
#[test]
fn rope_scaling_changes_the_logits() {
    for (i, spec) in SPECS.iter().enumerate().take(2) {
        let mut m = Llama::from_gguf(&Gguf::parse(model_gguf(spec, 40 + i as u64)).unwrap()).unwrap();
        let toks = tokens(60 + i as u64);
        let rows: Vec<Row> = (0..TOKENS).map(|p| Row { seq: 0, pos: p }).collect();
        let run = |m: &Llama| {
            let h = m.forward(&toks, &rows, &mut ExactAttention::new(&m.config), None, 2).unwrap();
            m.logits(&h)
        };
        let scaled = run(&m);
        m.config.rope_scaling = RopeScaling::None;
        let plain: Vec<f64> = run(&m).iter().map(|&x| x as f64).collect();
        let e = rel(&scaled, &plain);
        assert!(e > 1e-2, "{}: {e}", spec.name);
    }
}

/// Logits of `toks` fed token by token through an f16 rotkv cache (the model's 2 layers,
/// head_dim 64), with the windows and softmax scale `CacheAttention` sets.
fn f16_cache_logits(m: &Llama, toks: &[u32]) -> Vec<f32> {
    let c = &m.config;
    let shape = CacheShape {
        layers: 2,
        num_kv_heads: c.kv_heads,
        num_q_heads: c.heads,
        max_seqs: 1,
        max_tokens: TOKENS,
        num_blocks: None,
    };
    let mut cache = KvCache::new(KvMethod::parse("f16", 64, TOKENS).unwrap().config, shape, Backend::Cpu).unwrap();
    let id = cache.add_sequence().unwrap();
    let mut attn = CacheAttention::new(c, vec![cache], vec![(0, id)]).unwrap();
    let mut got = Vec::new();
    for (p, &t) in toks.iter().enumerate() {
        got.extend(m.logits(&m.forward(&[t], &[Row { seq: 0, pos: p }], &mut attn, None, 2).unwrap()));
    }
    got
}

/// qwen3 (head_dim 64, `heads * head_dim` = 256 query channels against a hidden size of
/// 96) through the rotkv cache: the f16 cache follows exact attention (f16 rounding of
/// keys and values: bound 2e-3), and `perplexity` runs with KL against f16.
#[test]
fn qwen3_runs_through_the_cache() {
    let m = Llama::from_gguf(&Gguf::parse(model_gguf(&SPECS[2], 42)).unwrap()).unwrap();
    let c = &m.config;
    let toks = tokens(62);
    let rows: Vec<Row> = (0..TOKENS).map(|p| Row { seq: 0, pos: p }).collect();
    let exact = m.logits(&m.forward(&toks, &rows, &mut ExactAttention::new(c), None, 2).unwrap());
    let e = rotkv_tests::rel_err(&f16_cache_logits(&m, &toks), &exact);
    assert!(e < 2e-3, "f16 cache vs exact: {e}");
    let methods: Vec<KvMethod> =
        ["f16", "k2v2-s2-w16-p16"].iter().map(|n| KvMethod::parse(n, 64, TOKENS).unwrap()).collect();
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: None, chunk: 1, pre_calibration: None, pass_rows: None };
    let r = model::perplexity(&m, std::slice::from_ref(&toks), &methods, &opts, &mut |_, _| {}).unwrap();
    assert!(r.iter().all(|x| x.ppl.is_finite() && x.kl.is_some_and(|k| k >= 0.0)));
}

/// Unsupported RoPE scalings and partial rotary dimensions are refused by name.
#[test]
fn unsupported_rope_variants_are_refused() {
    let base = model_gguf(&SPECS[1], 40);
    let g = Gguf::parse(base).unwrap();
    assert!(Llama::from_gguf(&g).is_ok());
    let mut meta = vec![
        ("general.architecture", Meta::Str("qwen2".into())),
        ("qwen2.embedding_length", Meta::U32(128)),
        ("qwen2.block_count", Meta::U32(0)),
        ("qwen2.attention.head_count", Meta::U32(4)),
        ("qwen2.feed_forward_length", Meta::U32(8)),
        ("qwen2.attention.layer_norm_rms_epsilon", Meta::F32(1e-6)),
    ];
    let embed: Tensor = ("token_embd.weight".into(), vec![128, 4], vec![0.5; 512]);
    let norm: Tensor = ("output_norm.weight".into(), vec![128], vec![1.0; 128]);
    let load = |meta: &[(&str, Meta)]| {
        Llama::from_gguf(&Gguf::parse(gguf_bytes(meta, &[embed.clone(), norm.clone()])).unwrap())
    };
    assert!(load(&meta).is_ok());
    meta.push(("qwen2.rope.scaling.type", Meta::Str("yarn".into())));
    let e = load(&meta).unwrap_err();
    assert!(matches!(e, rotkv::Error::Unsupported(_)) && e.to_string().contains("yarn"), "{e}");
    meta.pop();
    meta.push(("qwen2.rope.dimension_count", Meta::U32(16)));
    let e = load(&meta).unwrap_err();
    assert!(matches!(e, rotkv::Error::Unsupported(_)) && e.to_string().contains("RoPE dimensions"), "{e}");
    meta.pop();
    meta[0] = ("general.architecture", Meta::Str("gemma2".into()));
    let e = load(&meta).unwrap_err();
    assert!(matches!(e, rotkv::Error::Unsupported(_)) && e.to_string().contains("gemma2"), "{e}");
}

/// gemma3's sliding layer through the rotkv cache: token by token, the f16 cache (with
/// the window `CacheAttention` sets on the cache's layer 0) follows exact windowed
/// attention within f16 rounding (bound 2e-3), while exact attention without the window
/// is far off (the 20 tokens run past the window of 8).
#[test]
fn gemma3_sliding_window_runs_through_the_cache() {
    let spec = &SPECS[3];
    let m = Llama::from_gguf(&Gguf::parse(model_gguf(spec, 43)).unwrap()).unwrap();
    let c = &m.config;
    let toks = tokens(63);
    let rows: Vec<Row> = (0..TOKENS).map(|p| Row { seq: 0, pos: p }).collect();
    let exact = m.logits(&m.forward(&toks, &rows, &mut ExactAttention::new(c), None, 2).unwrap());
    // The window opened, nothing else changed (the sliding layer keeps its RoPE base).
    let mut full = m.clone();
    full.config.sliding.as_mut().unwrap().window = usize::MAX;
    let unwindowed = full.logits(&full.forward(&toks, &rows, &mut ExactAttention::new(&full.config), None, 2).unwrap());
    let e = rotkv_tests::rel_err(&unwindowed, &exact);
    assert!(e > 1e-2, "the window changes nothing: {e}");
    let e = rotkv_tests::rel_err(&f16_cache_logits(&m, &toks), &exact);
    assert!(e < 2e-3, "f16 cache vs exact windowed attention: {e}");
}
