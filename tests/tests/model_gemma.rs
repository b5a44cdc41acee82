//! Gemma 3 270M, a real gemma3 GGUF (head_dim 256, 4 query heads on one KV head, five of
//! every six layers a 512-position sliding window), when `cargo xtask fetch` has run
//! (SKIPPED otherwise): its configuration as read, the exact forward pass against the
//! per-position negative log-likelihoods of an independent numpy implementation
//! (`tests/scripts/reference_forward.py --nll`, float64, weights dequantized by gguf-py),
//! committed in `tests/reference/gemma3_lcet10_640.txt` with the token ids it scored;
//! the tokenizer against Hugging Face `transformers`' GGUF tokenizer for Gemma on both
//! Canterbury texts; and (ignored by default, run by `cargo xtask ci`) perplexity through
//! the cache, bare and with the calibrated recipes.

use rotkv::Backend;
use rotkv::model::llama::{Activation, ExactAttention, Llama, Row, WeightStorage};
use rotkv::model::math::Weight;
use rotkv::model::tokenizer::Tokenizer;
use rotkv::model::{self, KvMethod, PplOptions};

/// Tokens of the reference window: BOS and the first 639 tokens of lcet10.txt, past the
/// 512-position sliding window.
const CTX: usize = 640;

fn gemma() -> Option<(Llama, Tokenizer, String)> {
    let (Some(path), Some(text)) = (model::fetched(model::GEMMA3_270M), model::fetched("text/lcet10.txt")) else {
        eprintln!("SKIPPED: {} or text/lcet10.txt not fetched (run `cargo xtask fetch`)", model::GEMMA3_270M);
        return None;
    };
    let (m, tok) = model::load(&path).unwrap();
    Some((m, tok, model::read_text(&text).unwrap()))
}

fn reference_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("reference/gemma3_lcet10_640.txt")
}

/// The window: BOS, then the text's first `CTX - 1` tokens (as `rotkv ppl` builds one).
fn window(tok: &Tokenizer, text: &str) -> Vec<u32> {
    // The first 8 KB of the text hold more than 640 tokens.
    let body = tok.encode(&text[..8192]).unwrap();
    let mut ids = tok.bos_prefix();
    ids.extend_from_slice(&body[..CTX - ids.len()]);
    ids
}

/// Every scored position the exact-forward test compares (the logits over Gemma's 262,144
/// tokens are most of the cost): every seventh, 92 of 639, 18 past the 512-position window.
fn compared() -> Vec<usize> {
    (0..CTX - 1).step_by(7).collect()
}

/// Next-token negative log-likelihoods of `tokens` at `positions` with exact attention.
fn nll(m: &Llama, tokens: &[u32], positions: &[usize]) -> Vec<f64> {
    let (n, dim) = (tokens.len() - 1, m.config.dim);
    let rows: Vec<Row> = (0..n).map(|p| Row { seq: 0, pos: p }).collect();
    let h = m.forward(&tokens[..n], &rows, &mut ExactAttention::new(&m.config), None, m.config.layers).unwrap();
    let picked: Vec<f32> = positions.iter().flat_map(|&p| h[p * dim..(p + 1) * dim].iter().copied()).collect();
    let logits = m.logits(&picked);
    logits
        .chunks_exact(m.config.vocab)
        .zip(positions)
        .map(|(l, &p)| {
            let mx = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            mx + l.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln() - l[tokens[p + 1] as usize] as f64
        })
        .collect()
}

#[test]
fn gemma3_configuration_as_read() {
    let Some((m, tok, _)) = gemma() else { return };
    let c = &m.config;
    assert_eq!((c.arch.as_str(), c.layers, c.dim, c.heads, c.kv_heads, c.head_dim), ("gemma3", 18, 640, 4, 1, 256));
    assert_eq!((c.vocab, c.ffn, c.act), (262_144, 2048, Activation::GeluTanh));
    assert_eq!(c.embed_scale, (640f32).sqrt());
    assert_eq!(c.attn_scale, 1.0 / 16.0);
    // Layers 5, 11 and 17 see everything; the others the newest 512 positions.
    let windows: Vec<Option<usize>> = (0..18).map(|l| c.window_left(l)).collect();
    for (l, w) in windows.iter().enumerate() {
        assert_eq!(*w, if l % 6 == 5 { None } else { Some(511) }, "layer {l}");
    }
    assert!(m.layers.iter().all(|w| w.qk_norm.is_some() && w.post_norms.is_some()));
    assert!(m.output.is_none(), "tied output");
    assert!(tok.add_bos && tok.bos == Some(2));
    // Gemma's tokenizer adds no space in front (`add_space_prefix` false).
    let ids = tok.encode("Hello world").unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), "Hello world");
}

/// Both texts tokenize as Hugging Face `transformers` 5.24.0's GGUF tokenizer builder
/// (`integrations/gguf`, fed the file's metadata by gguf-py 0.19.0) does once the file's
/// all-space user-defined pieces match whole, longest first, as SentencePiece and
/// llama.cpp match user-defined pieces (`tests/scripts/gguf_tokenizer_reference.py`;
/// transformers' builder alone splits runs of 32 or more spaces differently, 2 tokens
/// more on each text): token counts and FNV-1a hashes of its id sequences.
#[test]
fn gemma3_tokenizer_matches_transformers() {
    let Some((_, tok, lcet10)) = gemma() else { return };
    let Some(alice) = model::fetched("text/alice29.txt") else { return };
    let alice = model::read_text(&alice).unwrap();
    let mut got = Vec::new();
    for (name, text) in [("alice29", &alice), ("lcet10", &lcet10)] {
        let ids = tok.encode(text).unwrap();
        if let Some(dir) = std::env::var_os("ROTKV_DUMP_IDS") {
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            std::fs::write(std::path::Path::new(&dir).join(format!("{name}.ids")), list.join(",")).unwrap();
        }
        got.push((ids.len(), rotkv_tests::fnv_ids(&ids)));
    }
    assert_eq!(got, [(39_705, 0xd42e_ab9b_0338_fb09u64), (90_269, 0xa8ba_9787_1b53_0084)], "token counts and hashes");
}

/// rotkv's f32 forward (exact attention, sliding windows) against numpy in float64 with
/// gguf-py's dequantization, at every seventh scored position. Measured over all 639:
/// perplexity 23.8208 both, mean |difference| 2.0e-6 nats, max 4.4e-5 (bounds 1e-4 and
/// 1e-3 per position); with the sliding windows opened (same RoPE bases) the mean NLL of
/// the compared positions from 520 on moves from 1.31 to 1.88 nats, so the windows are
/// what is compared.
#[test]
fn gemma3_exact_forward_matches_the_numpy_reference() {
    let Some((m, tok, text)) = gemma() else { return };
    let ids = window(&tok, &text);
    let at = compared();
    let got = nll(&m, &ids, &at);
    let path = reference_path();
    if std::env::var_os("ROTKV_WRITE_GEMMA_TOKENS").is_some() {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        std::fs::write(std::env::temp_dir().join("gemma3_tokens.txt"), list.join(",")).unwrap();
    }
    let reference = std::fs::read_to_string(&path).unwrap();
    let mut lines = reference.lines().filter(|l| !l.starts_with('#'));
    let want_ids: Vec<u32> = lines.next().unwrap().split(',').map(|s| s.parse().unwrap()).collect();
    let all: Vec<f64> = lines.next().unwrap().split(',').map(|s| s.parse().unwrap()).collect();
    assert_eq!(ids, want_ids, "the tokenizer no longer gives the reference's token ids");
    assert_eq!(all.len(), CTX - 1);
    let want: Vec<f64> = at.iter().map(|&p| all[p]).collect();
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let diff: Vec<f64> = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).collect();
    let (ppl, ppl_ref) = (mean(&got).exp(), mean(&want).exp());
    eprintln!(
        "gemma3 exact forward vs numpy at {} positions: ppl {ppl:.4} vs {ppl_ref:.4}, mean |dNLL| {:.2e}, max {:.2e}",
        at.len(),
        mean(&diff),
        diff.iter().copied().fold(0.0, f64::max)
    );
    assert!((ppl / ppl_ref - 1.0).abs() < 1e-4, "ppl {ppl} vs {ppl_ref}");
    assert!(mean(&diff) < 1e-4 && diff.iter().all(|&d| d < 1e-3), "per-position NLL differs");
    // With the windows opened (same layers, same RoPE bases) the positions past 512 see
    // other keys.
    let mut m = m;
    m.config.sliding.as_mut().unwrap().window = usize::MAX;
    let late: Vec<usize> = at.iter().copied().filter(|&p| p >= 520).collect();
    let without = mean(&nll(&m, &ids, &late));
    let (with, reference) = (mean(&got[at.len() - late.len()..]), mean(&want[at.len() - late.len()..]));
    eprintln!("positions 520..: NLL {with:.4} with the windows, {without:.4} without, {reference:.4} in numpy");
    assert!((without - reference).abs() > 10.0 * (with - reference).abs().max(1e-4));
}

/// The weights kept as the file stores them (Q4_K_M: Q4_K, Q6_K and other blocks,
/// dequantized a block of rows at a time inside each product) give the f32 weights'
/// logits bit for bit, in under a quarter of the memory (235 MiB against 1,022 MiB).
#[test]
fn gemma3_weights_kept_as_stored_give_the_same_logits() {
    let Some((m, tok, text)) = gemma() else { return };
    let path = model::fetched(model::GEMMA3_270M).unwrap();
    let (q, _) = model::load_with(&path, WeightStorage::Quantized).unwrap();
    assert!(matches!(q.layers[0].wq, Weight::Blocks(_)) && matches!(q.embed, Weight::Blocks(_)));
    let (fb, qb) = (m.weight_bytes(), q.weight_bytes());
    eprintln!("gemma3 weights: {:.1} MiB in f32, {:.1} MiB as stored", fb as f64 / 1048576.0, qb as f64 / 1048576.0);
    assert!(qb * 4 < fb, "{qb} bytes as stored against {fb} in f32");
    let ids = &window(&tok, &text)[..40];
    let rows: Vec<Row> = (0..ids.len()).map(|pos| Row { seq: 0, pos }).collect();
    let logits = |m: &Llama| {
        let h = m.forward(ids, &rows, &mut ExactAttention::new(&m.config), None, m.config.layers).unwrap();
        m.logits(&h)
    };
    let (a, b) = (logits(&m), logits(&q));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "logits differ");
}

/// Slow (about two minutes on two cores): run by `cargo xtask ci` with `--ignored`. The
/// reference window through the cache, 16 tokens per decode step (one multi-token decode
/// each, causal rows; token by token reads Gemma's 640 MiB output matrix 639 times): the
/// f16 cache within f16 rounding of the numpy reference's exact perplexity, k4v2 within
/// 3% (two methods only: each costs about a minute in CI; k2v2 is in the book's Gemma table, docs/src/real-models.md).
#[test]
#[ignore = "slow: Gemma 3 perplexity through the cache; cargo xtask ci runs it"]
fn gemma3_perplexity_through_the_cache() {
    let Some((m, tok, text)) = gemma() else { return };
    let ids = window(&tok, &text);
    let reference = std::fs::read_to_string(reference_path()).unwrap();
    let all: Vec<f64> = reference
        .lines()
        .filter(|l| !l.starts_with('#'))
        .nth(1)
        .unwrap()
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let exact = (all.iter().sum::<f64>() / all.len() as f64).exp();
    let methods: Vec<KvMethod> = ["f16", "k4v2"].iter().map(|n| KvMethod::parse(n, 256, CTX).unwrap()).collect();
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: None, chunk: 16, pre_calibration: None, pass_rows: None };
    let r = model::perplexity(&m, std::slice::from_ref(&ids), &methods, &opts, &mut |_, _| {}).unwrap();
    for x in &r {
        eprintln!("{:<6} ppl {:.3} KL {:.4} top-1 {:.3}", x.method.name, x.ppl, x.kl.unwrap(), x.top1.unwrap());
    }
    eprintln!("exact attention (numpy): ppl {exact:.3}");
    let (f16, k4v2) = (r[0].ppl, r[1].ppl);
    assert!((f16 / exact - 1.0).abs() < 2e-3, "f16 cache {f16} vs exact {exact}");
    // Measured, 16 tokens per step: f16 23.820 against numpy's exact 23.821, k4v2 24.253
    // (+1.8%), k2v2 44.926 (+89%); token by token: 23.820, 24.201, 45.316. Gemma's keys have outlier channels,
    // which the uncalibrated presets do not handle (the calibrated recipe,
    // docs/src/accuracy.md, does).
    assert!((k4v2 / f16 - 1.0).abs() < 0.03, "k4v2 {k4v2} vs f16 {f16}");
}

/// Slow (run by `cargo xtask ci` with `--ignored`): the recommended recipes on Gemma 3,
/// a model with outlier key channels and head_dim 256. Calibrated on the first 1024 tokens
/// of alice29.txt (the smoothing measured for the presets' key quantizers, 64 queries per
/// head), evaluated on the reference window of lcet10.txt (640 tokens, past the sliding
/// window), 16 tokens per decode step.
#[test]
#[ignore = "slow: Gemma 3 calibration and perplexity; cargo xtask ci runs it"]
fn gemma3_recipe_perplexity() {
    let Some((m, tok, text)) = gemma() else { return };
    let Some(cal_path) = model::fetched("text/alice29.txt") else {
        eprintln!("SKIPPED: text/alice29.txt not fetched (run `cargo xtask fetch`)");
        return;
    };
    let cal_text = model::read_text(&cal_path).unwrap();
    let cal_ids: Vec<u32> = [tok.bos_prefix(), tok.encode(&cal_text[..16384]).unwrap()].concat()[..1024].to_vec();
    let opts = model::calibrate::CalibrateOptions { queries: 64, ..model::calibrate::CalibrateOptions::presets(256) };
    let cal = model::calibrate::calibrate_with(&m, &cal_ids, &opts, &mut |_| ()).unwrap();
    assert!(cal.has_smoothing_choice(2) && cal.has_smoothing_choice(4));
    let ids = window(&tok, &text);
    let methods: Vec<KvMethod> =
        ["f16", "k4v2", "k2v2"].iter().map(|n| KvMethod::parse_calibrated(n, 256, CTX, true).unwrap()).collect();
    let opts =
        PplOptions { backend: Backend::Cpu, calibration: Some(cal), chunk: 16, pre_calibration: None, pass_rows: None };
    let r = model::perplexity(&m, std::slice::from_ref(&ids), &methods, &opts, &mut |_, _| {}).unwrap();
    for x in &r {
        eprintln!("{:<6} ppl {:.3} KL {:.4} top-1 {:.3}", x.method.name, x.ppl, x.kl.unwrap(), x.top1.unwrap());
    }
    let change = |i: usize| r[i].ppl / r[0].ppl - 1.0;
    // Measured (f16 23.821): k4v2 23.952 (+0.55%, KL 0.0035), k2v2 24.113 (+1.22%, KL
    // 0.0133); the bare presets were +1.8% and +89% (above). The recipes must stay within
    // the targets (k4v2 1.5%, k2v2 5%).
    assert!(change(1) < 0.015 && change(2) < 0.05, "recipes: k4v2 {:+.4}, k2v2 {:+.4}", change(1), change(2));
}
