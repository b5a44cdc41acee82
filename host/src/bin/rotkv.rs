//! `rotkv`: demo, metrics on captured KV tensors, and the supported-configs table.

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rotkv::eval::{self, LayerReport, Tile};
use rotkv::{Backend, CacheConfig, CacheShape, KvCache, f16, model};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// The bundled real KV tile: layers 0 and 5 of SmolLM2-135M-Instruct on the first 2048
/// tokens of alice29.txt (q, k, v in f16; see data/README.md).
static TILE: &[u8] = include_bytes!("../../../data/smollm2-alice-kv-l0-l5.safetensors");

#[derive(Parser)]
#[command(name = "rotkv", version, about = "2-bit KV cache with Hadamard rotations: demo and metrics")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How a model's weight matrices are kept in memory: f32 (dequantized at load),
    /// quantized (as the GGUF stores them, dequantized a block of rows at a time inside
    /// each product; the same results bit for bit, a fraction of the memory) or auto
    /// (quantized when the f32 weights would take more than half the available memory).
    #[arg(long, global = true, default_value = "auto", value_parser = ["f32", "quantized", "auto"])]
    weights: String,
    /// A stress test: at load, scale COUNT RoPE channel pairs of each KV head's keys in
    /// every layer by SCALE and the same pairs of the group's queries by 1 / SCALE
    /// (pairs drawn with SEED), so the model computes the same function while its keys
    /// get outlier channels (rotkv::model::inject). SEED,COUNT,SCALE, e.g. 1,4,16.
    #[arg(long, global = true, value_name = "SEED,COUNT,SCALE")]
    inject_key_outliers: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Quantize the bundled SmolLM2 KV tile with every method, show the memory saved and
    /// measure CPU decode throughput. No download needed.
    Demo,
    /// The metrics table for a captured KV file (layer{L}.q/.k/.v tensors).
    Eval {
        /// safetensors file with layer{L}.q [T,Hq,D], layer{L}.k and layer{L}.v [T,Hkv,D].
        #[arg(long)]
        input: PathBuf,
        /// Print one JSON object instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Every supported (head_dim, key bits, value bits, group) with its bytes per token.
    Configs,
    /// Perplexity of a GGUF model on a text with each KV method, decode-faithful (token
    /// by token through the cache, or --chunk tokens per decode step).
    Ppl {
        /// A llama, qwen2, qwen3 or gemma3 GGUF file (`cargo xtask fetch` gets SmolLM2-135M and Gemma 3 270M).
        #[arg(long)]
        model: PathBuf,
        /// A UTF-8 text file.
        #[arg(long)]
        text: PathBuf,
        /// Tokens per window.
        #[arg(long, default_value_t = 1024)]
        ctx: usize,
        /// Non-overlapping windows from the start of the text.
        #[arg(long, default_value_t = 8)]
        windows: usize,
        /// KV methods: f16, naive2, naive4, kivi2, kivi4 (KIVI's per-channel keys,
        /// simulated), k2v2, k4v2, k4v4 (with --calib a bare k2v2,
        /// k4v2 or k4v4 is the recommended recipe, e.g. k2v2 = k2v2-c-m-dh8), each with optional
        /// -g<group> -s<sinks> -w<window> -p<page> -x<key clip %> -y<value clip %>
        /// -v<iterations> (KVarN) -o<N> (online key mean) -da<k> -dk<k> -dh<k> (detected
        /// sinks), and -c (key centering) -r (reordering) -l (learned rotations)
        /// -a<alpha %> (key smoothing, e.g. -a50 for alpha 0.5; -aa: alpha 0.5 on the KV
        /// heads with outlier key channels only; -m: per layer and KV head the alpha
        /// `rotkv calibrate` measured best for the method's key bits; -raw: nothing,
        /// k2v2-raw is the bare preset) from --calib (e.g.
        /// k2v2-c-g32-x80, k2v2-c-l-dh8, k2v2-c-a50). -pre quantizes the keys before RoPE
        /// and re-applies RoPE to each dequantized key (RotateKV; a harness simulation, not
        /// a cache option; its -c and -a use --pre-calib), -sim runs the post-RoPE method
        /// through the same simulation (the control): e.g. k2v2-c-sim, k2v2-c-pre.
        #[arg(long, value_delimiter = ',', default_value = "f16,naive2,k2v2,k4v2")]
        kv: Vec<String>,
        /// cpu, sim, cuda, reference or auto.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// A calibration file from `rotkv calibrate`, for the methods with -c, -r, -l or -a.
        #[arg(long)]
        calib: Option<PathBuf>,
        /// A calibration of the pre-RoPE keys (`rotkv calibrate --methods prerope,...`), for
        /// the -pre methods with -c or -a.
        #[arg(long)]
        pre_calib: Option<PathBuf>,
        /// Tokens per decode step (1 to 4096): each step appends this many tokens and decodes
        /// them (causal rows), as a serving step prefills a prompt chunk; 1 is token by
        /// token. A step runs in passes of --pass-rows rows (append, then decode), so its
        /// rows see the step's earlier tokens in f16 however long the chunk; its earlier
        /// rows also read the pages its pass pushed out of the window (a little:
        /// docs/src/device-api.md).
        #[arg(long, default_value_t = 1)]
        chunk: usize,
        /// Rows per pass of a step (default: half each method's window, 64 with the
        /// presets, as a serving step runs it); --pass-rows N with N >= --chunk appends
        /// the whole step before decoding it (its early rows then see their own chunk
        /// quantized when it is longer than the window).
        #[arg(long)]
        pass_rows: Option<usize>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Calibrate key means and channel permutations per layer and KV head from a text.
    Calibrate {
        /// A llama, qwen2, qwen3 or gemma3 GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// A UTF-8 text file (calibrate on one text, evaluate on another).
        #[arg(long)]
        text: PathBuf,
        /// Tokens from the start of the text.
        #[arg(long, default_value_t = 2048)]
        tokens: usize,
        /// What to calibrate: center (key means), reorder (channel permutations), smooth
        /// (key channel standard deviations, for the smoothing of `-a<alpha %>`), optr
        /// (learned key and value rotations, trained on the centered, unsmoothed keys);
        /// prerope: the statistics of the keys before RoPE instead (for `ppl --pre-calib`;
        /// with center and smooth only).
        #[arg(long, value_delimiter = ',', default_value = "center,reorder,smooth")]
        methods: Vec<String>,
        /// The KV method (as for `ppl`) whose quantizer the optr rotations are trained
        /// for: its bits, group size, clip ratios, sinks and window.
        #[arg(long, default_value = "k2v2")]
        optr_for: String,
        /// Adam steps per optr rotation.
        #[arg(long, default_value_t = 64)]
        optr_steps: usize,
        /// Query positions per query head in the optr loss.
        #[arg(long, default_value_t = 48)]
        optr_queries: usize,
        /// The loss the per-head key smoothing is chosen by: kl (the attention
        /// distribution's KL divergence, the recipe) or output (the attention output's
        /// error through the output projection; an experiment).
        #[arg(long, default_value = "kl", value_parser = ["kl", "output"])]
        smooth_loss: String,
        /// Output file (safetensors).
        #[arg(long)]
        out: PathBuf,
    },
    /// Capture post-RoPE q, k, v and pre-RoPE k of some layers to a safetensors file
    /// (f16, Hugging Face channel order), from an exact f32 forward pass.
    Capture {
        /// A llama, qwen2, qwen3 or gemma3 GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// A UTF-8 text file.
        #[arg(long)]
        text: PathBuf,
        /// Tokens from the start of the text.
        #[arg(long, default_value_t = 2048)]
        tokens: usize,
        /// Layers to keep.
        #[arg(long, value_delimiter = ',', default_value = "0,5")]
        layers: Vec<usize>,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Passkey retrieval: a number hidden in filler text at several depths, the haystack
    /// prefilled into each method's cache, the question and the greedy answer decoded
    /// through it; prints the accuracy per method and depth.
    Passkey {
        /// A llama, qwen2, qwen3 or gemma3 GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// Prompt length in tokens (at most).
        #[arg(long, default_value_t = 2048)]
        tokens: usize,
        /// Needle depths in percent of the filler.
        #[arg(long, value_delimiter = ',', default_value = "0,25,50,75,100")]
        depths: Vec<u32>,
        /// Keys tried at each depth.
        #[arg(long, default_value_t = 2)]
        trials: usize,
        /// Seed of the keys.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// KV methods (as for `ppl`; no -o or -d..).
        #[arg(long, value_delimiter = ',', default_value = "f16,k2v2,k4v2")]
        kv: Vec<String>,
        /// cpu, sim, cuda, reference or auto.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// A calibration file from `rotkv calibrate`, for the methods with -c, -r, -l or -a.
        #[arg(long)]
        calib: Option<PathBuf>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Greedy continuation of a prompt, decoding from the rotkv cache.
    Generate {
        /// A llama, qwen2, qwen3 or gemma3 GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// The prompt.
        #[arg(long)]
        prompt: String,
        /// New tokens.
        #[arg(long, default_value_t = 16)]
        tokens: usize,
        /// KV method (as for `ppl`).
        #[arg(long, default_value = "k2v2")]
        kv: String,
        /// cpu, sim, cuda, reference or auto.
        #[arg(long, default_value = "auto")]
        backend: String,
    },
}

/// What can stop the program: a library error, or stdout going away.
#[derive(Debug)]
enum CliError {
    Lib(rotkv::Error),
    Io(std::io::Error),
}

impl From<rotkv::Error> for CliError {
    fn from(e: rotkv::Error) -> Self {
        CliError::Lib(e)
    }
}
impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::Io(e)
    }
}

type Out<'a> = std::io::StdoutLock<'a>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = std::io::stdout().lock();
    let storage = match model::llama::WeightStorage::parse(&cli.weights) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    WEIGHTS.set(storage).expect("set once");
    let injection = match cli.inject_key_outliers.as_deref().map(model::inject::Injection::parse).transpose() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    INJECT.set(injection).expect("set once");
    let result = match cli.command {
        Command::Demo => demo(&mut out),
        Command::Eval { input, json } => eval_file(&mut out, &input, json),
        Command::Configs => print_configs(&mut out),
        Command::Ppl { model, text, ctx, windows, kv, backend, calib, pre_calib, chunk, pass_rows, json } => {
            let calibs = (calib.as_deref(), pre_calib.as_deref());
            ppl(&mut out, &model, &text, (ctx, windows, chunk, pass_rows), &kv, &backend, calibs, json)
        }
        Command::Calibrate {
            model,
            text,
            tokens,
            methods,
            optr_for,
            optr_steps,
            optr_queries,
            smooth_loss,
            out: path,
        } => {
            let loss = if smooth_loss == "kl" {
                model::calibrate::SmoothLoss::AttentionKl
            } else {
                model::calibrate::SmoothLoss::Output
            };
            let optr = (optr_for.as_str(), optr_steps, optr_queries);
            calibrate(&mut out, &model, &text, tokens, (&methods, loss), optr, &path)
        }
        Command::Capture { model, text, tokens, layers, out: path } => {
            capture(&mut out, &model, &text, tokens, &layers, &path)
        }
        Command::Passkey { model, tokens, depths, trials, seed, kv, backend, calib, json } => {
            let run = PasskeyRun { tokens, depths, trials, seed };
            passkey(&mut out, &model, &run, &kv, &backend, calib.as_deref(), json)
        }
        Command::Generate { model, prompt, tokens, kv, backend } => {
            generate(&mut out, &model, &prompt, tokens, &kv, &backend)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`rotkv configs | head`) is the reader's choice, not a failure.
        Err(CliError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(CliError::Io(e)) => {
            eprintln!("error: writing output: {e}");
            ExitCode::FAILURE
        }
        Err(CliError::Lib(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn progress(len: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}").expect("valid template"));
    bar.set_message(what.to_string());
    bar
}

fn evaluate(tile: &Tile, label: &str) -> Result<Vec<LayerReport>, CliError> {
    let methods = eval::standard_methods(tile.layers[0].head_dim);
    let bar = progress(methods.len() * tile.layers.len(), label);
    let mut reports = Vec::new();
    for layer in &tile.layers {
        reports.push(eval::evaluate_layer(layer, &methods, tile.attn_scaling, &|| bar.inc(1))?);
    }
    bar.finish_and_clear();
    Ok(reports)
}

fn print_table(out: &mut Out, report: &LayerReport) -> std::io::Result<()> {
    writeln!(out, "layer {}", report.layer)?;
    writeln!(
        out,
        "  {:<16} {:>9} {:>9} {:>10} {:>9} {:>11}",
        "method", "k rel err", "v rel err", "attn rel", "bits/elem", "B/token/head"
    )?;
    for m in &report.methods {
        writeln!(
            out,
            "  {:<16} {:>9.4} {:>9.4} {:>10.4} {:>9.2} {:>11}",
            m.name, m.k_rel_err, m.v_rel_err, m.attn_rel_err, m.bits_per_element, m.bytes_per_token
        )?;
    }
    Ok(())
}

fn eval_file(out: &mut Out, path: &std::path::Path, json: bool) -> Result<(), CliError> {
    let tile = Tile::load(path)?;
    let reports = evaluate(&tile, "quantizing")?;
    if json {
        writeln!(out, "{}", eval::report_json(&file_name(path), tile.attn_scaling, &reports))?;
    } else {
        for r in &reports {
            print_table(out, r)?;
        }
    }
    Ok(())
}

fn print_configs(out: &mut Out) -> Result<(), CliError> {
    writeln!(
        out,
        "{:>8} {:>8} {:>10} {:>6} {:>13} {:>10}",
        "head_dim", "key bits", "value bits", "group", "B/token/head", "vs bf16"
    )?;
    for &(d, kb, vb, g) in rotkv::SUPPORTED {
        let c = CacheConfig { key_bits: kb, value_bits: vb, group_size: g as usize, ..CacheConfig::k2v2(d as usize) };
        let b = c.bytes_per_token().expect("every listed config is supported");
        writeln!(out, "{d:>8} {kb:>8} {vb:>10} {g:>6} {b:>13} {:>9.1}x", (4 * d) as f64 / b as f64)?;
    }
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn demo(out: &mut Out) -> Result<(), CliError> {
    let tile = Tile::from_bytes(TILE)?;
    let l0 = &tile.layers[0];
    let d = l0.head_dim;
    writeln!(
        out,
        "rotkv demo: real KV tensors of SmolLM2-135M-Instruct (alice29.txt, {} tokens, {} query / {} KV heads, head_dim {d})\n",
        l0.tokens, l0.num_q_heads, l0.num_kv_heads
    )?;
    let c128 = CacheConfig::k2v2(128);
    writeln!(
        out,
        "format: head_dim 128, k2v2, group 128 -> {} B per token per KV head (bf16: {} B, {:.1}x less)\n",
        c128.bytes_per_token()?,
        4 * 128,
        512.0 / c128.bytes_per_token()? as f64
    )?;
    for r in evaluate(&tile, "quantizing")? {
        print_table(out, &r)?;
    }
    writeln!(
        out,
        "  (naive/had*: every token quantized; k*v*_s4_w128: the cache, 4 sinks and >= 128 newest tokens in f16)\n"
    )?;

    // Memory of a 32K-token cache for the model: 30 layers, 3 KV heads, head_dim 64.
    let tokens = 32 * 1024;
    let (layers, hkv, hq) = (30, l0.num_kv_heads, l0.num_q_heads);
    let f16_bytes = tokens * layers * hkv * d * 2 * 2;
    let config = CacheConfig::k2v2(d);
    let shape =
        CacheShape { layers, num_kv_heads: hkv, num_q_heads: hq, max_seqs: 1, max_tokens: tokens, num_blocks: None };
    let cache = KvCache::new(config, shape, Backend::Cpu)?;
    writeln!(
        out,
        "32K-token cache for SmolLM2-135M (30 layers x 3 KV heads x 64): f16 {:.1} MiB, k2v2 {:.1} MiB allocated ({:.1}x less)\n",
        mib(f16_bytes),
        mib(cache.memory_bytes()),
        f16_bytes as f64 / cache.memory_bytes() as f64
    )?;
    drop(cache);
    decode_throughput(out, l0)
}

/// Decode throughput of one layer, batch 8, 8K context built from the tile's real keys
/// and values, against the f16 baseline on the same data in the same run.
fn decode_throughput(out: &mut Out, l0: &eval::LayerTile) -> Result<(), CliError> {
    let (t, hkv, hq, d) = (l0.tokens, l0.num_kv_heads, l0.num_q_heads, l0.head_dim);
    let (batch, ctx, steps) = (8, 8192, 30);
    let config = CacheConfig::k2v2(d);
    let shape = CacheShape {
        layers: 1,
        num_kv_heads: hkv,
        num_q_heads: hq,
        max_seqs: batch,
        max_tokens: ctx,
        num_blocks: None,
    };
    let mut cache = KvCache::new(config, shape, Backend::Cpu)?;
    let row = hkv * d;
    let bar = progress(batch, "filling 8 x 8K cache");
    let mut k16 = vec![f16::ZERO; batch * hkv * ctx * d];
    let mut v16 = k16.clone();
    let mut seqs = Vec::with_capacity(batch);
    for b in 0..batch {
        let s = cache.add_sequence()?;
        seqs.push(s);
        let order: Vec<usize> = (0..ctx).map(|i| (i + 97 * b) % t).collect();
        let k: Vec<f32> = order.iter().flat_map(|&p| l0.k[p * row..(p + 1) * row].iter().copied()).collect();
        let v: Vec<f32> = order.iter().flat_map(|&p| l0.v[p * row..(p + 1) * row].iter().copied()).collect();
        cache.append(0, s, ctx, &k, &v)?;
        for (i, (kk, vv)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let (tok, h) = (i / hkv, i % hkv);
            let at = ((b * hkv + h) * ctx + tok) * d;
            k16[at..at + d].iter_mut().zip(kk).for_each(|(o, x)| *o = f16::from_f32(*x));
            v16[at..at + d].iter_mut().zip(vv).for_each(|(o, x)| *o = f16::from_f32(*x));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let q: Vec<f32> = (0..batch).flat_map(|b| l0.q[(t - 1 - b) * hq * d..(t - b) * hq * d].iter().copied()).collect();
    let mut attn = vec![0f32; batch * hq * d];
    let mut attn16 = attn.clone();
    let threads = rayon::current_num_threads();
    let splits = rotkv::cpu::default_splits(ctx, batch, hkv, threads) as usize;
    let mut t_q = Vec::new();
    let mut t_f = Vec::new();
    let bar = progress(steps, "timing decode");
    for _ in 0..steps {
        let s = Instant::now();
        cache.decode(0, &seqs, &q, &mut attn)?;
        t_q.push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        rotkv::cpu::decode_f16_baseline(&k16, &v16, ctx, hkv, hq, d, splits, &q, &mut attn16);
        t_f.push(s.elapsed().as_secs_f64());
        bar.inc(1);
    }
    bar.finish_and_clear();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mq, mf) = (median(&mut t_q), median(&mut t_f));
    let quant_bytes = batch * hkv * ctx * config.bytes_per_token()?;
    let f16_bytes = batch * hkv * ctx * d * 4;
    let err: f64 = attn.iter().zip(&attn16).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt()
        / attn16.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
    writeln!(out, "CPU decode, one layer, batch {batch}, {ctx}-token context, {threads} threads (median of {steps}):")?;
    writeln!(
        out,
        "  k2v2 cache:    {:>7.3} ms/step  ({:.1} GB/s of packed cache)",
        mq * 1e3,
        quant_bytes as f64 / mq / 1e9
    )?;
    writeln!(
        out,
        "  f16 baseline:  {:>7.3} ms/step  ({:.1} GB/s of f16 cache)",
        mf * 1e3,
        f16_bytes as f64 / mf / 1e9
    )?;
    writeln!(out, "  speedup {:.2}x; output relative difference k2v2 vs f16: {err:.3}", mf / mq)?;
    Ok(())
}

/// A path's file name, for tables and metadata.
fn file_name(p: &std::path::Path) -> String {
    p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// The model, and the first `tokens` token ids of a text: BOS first when the model's
/// tokenizer asks for one ([`model::tokenizer::Tokenizer::add_bos`]), then text tokens.
fn model_and_tokens(
    model_path: &std::path::Path,
    text: &std::path::Path,
    tokens: usize,
) -> Result<(model::llama::Llama, Vec<u32>), CliError> {
    let (llama, tok) = load_model(model_path)?;
    let mut ids = tok.bos_prefix();
    // Only the prefix of the text that holds the tokens asked for is read and tokenized.
    let body = model::text_tokens(&tok, text, tokens.saturating_sub(ids.len()))?.ids;
    if ids.len() + body.len() < tokens {
        let why = format!("{} has {} tokens, {tokens} asked", text.display(), ids.len() + body.len());
        return Err(CliError::Lib(rotkv::Error::Shape(why)));
    }
    ids.extend_from_slice(&body);
    ids.truncate(tokens);
    Ok((llama, ids))
}

fn load_model(path: &std::path::Path) -> Result<(model::llama::Llama, model::tokenizer::Tokenizer), CliError> {
    let started = Instant::now();
    let storage = WEIGHTS.get().copied().unwrap_or_default();
    let mut m = model::load_with(path, storage)?;
    if let Some(inj) = INJECT.get().copied().flatten() {
        model::inject::inject_key_outliers(&mut m.0, &inj)?;
        eprintln!(
            "injected key outliers: {} RoPE pair(s) per KV head and layer scaled by {} (seed {}), queries by 1/{}",
            inj.count, inj.scale, inj.seed, inj.scale
        );
    }
    eprintln!(
        "loaded {} in {:.1} s (weights {}: {:.1} MiB)",
        path.display(),
        started.elapsed().as_secs_f64(),
        if m.0.weights_as_stored() { "as stored" } else { "in f32" },
        m.0.weight_bytes() as f64 / (1u64 << 20) as f64
    );
    Ok(m)
}

/// `--weights`, set once from the command line.
static WEIGHTS: std::sync::OnceLock<model::llama::WeightStorage> = std::sync::OnceLock::new();

/// `--inject-key-outliers`, set once from the command line.
static INJECT: std::sync::OnceLock<Option<model::inject::Injection>> = std::sync::OnceLock::new();

#[allow(clippy::too_many_arguments)]
fn ppl(
    out: &mut Out,
    model_path: &std::path::Path,
    text: &std::path::Path,
    (ctx, windows, chunk, pass_rows): (usize, usize, usize, Option<usize>),
    kv: &[String],
    backend: &str,
    (calib, pre_calib): (Option<&std::path::Path>, Option<&std::path::Path>),
    json: bool,
) -> Result<(), CliError> {
    let backend = Backend::parse(backend)?;
    let calibration = calib.map(model::calibrate::Calibration::load).transpose()?;
    let pre_calibration = pre_calib.map(model::calibrate::Calibration::load).transpose()?;
    if ctx < 2 || windows == 0 {
        return Err(CliError::Lib(rotkv::Error::Shape(format!("{windows} windows of {ctx} tokens"))));
    }
    if !(1..=rotkv::paged::MAX_Q_LEN).contains(&chunk) {
        let max = rotkv::paged::MAX_Q_LEN;
        return Err(CliError::Lib(rotkv::Error::Value(format!("--chunk {chunk}: 1 to {max} tokens per decode step"))));
    }
    if pass_rows == Some(0) {
        return Err(CliError::Lib(rotkv::Error::Value("--pass-rows 0: at least 1 row per pass".into())));
    }
    if ctx.checked_mul(windows).is_none() {
        let why = format!("{windows} windows of {ctx} tokens: too many tokens to count");
        return Err(CliError::Lib(rotkv::Error::Capacity(why)));
    }
    let (llama, tok) = load_model(model_path)?;
    let bos = tok.bos_prefix();
    if ctx <= bos.len() {
        return Err(CliError::Lib(rotkv::Error::Shape(format!("--ctx {ctx}: no room for text after the BOS token"))));
    }
    // Each window: BOS (when the model asks for one), then the next ctx - 1 text tokens.
    let per = ctx - bos.len();
    // Only the prefix of the text that the windows use is read and tokenized.
    let body = model::text_tokens(&tok, text, per * windows)?.ids;
    if body.len() < per * windows {
        let why = format!("{} has {} tokens, {windows} windows of {per} asked", text.display(), body.len());
        return Err(CliError::Lib(rotkv::Error::Shape(why)));
    }
    let wins: Vec<Vec<u32>> = body.chunks_exact(per).take(windows).map(|c| [&bos[..], c].concat()).collect();
    let methods = kv
        .iter()
        .map(|m| model::KvMethod::parse_calibrated(m, llama.config.head_dim, ctx, calibration.is_some()))
        .collect::<rotkv::Result<Vec<_>>>()?;
    let bar = progress(ctx - 1, &format!("{} x {} windows, {backend:?}", methods.len(), windows));
    let started = Instant::now();
    let opts = model::PplOptions { backend, calibration, chunk, pre_calibration, pass_rows };
    let results = model::perplexity(&llama, &wins, &methods, &opts, &mut |i, _| bar.set_position(i as u64))?;
    bar.finish_and_clear();
    let base = results.iter().find(|r| !r.method.quantized).map(|r| r.ppl);
    if json {
        let rows: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "method": r.method.name, "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens,
                    "vs_f16": base.map(|b| r.ppl / b - 1.0), "bits_per_element": r.method.bits_per_element(),
                    "recipe": calib.and(model::KvMethod::recipe_name(&r.method.name)),
                    "kv_bytes": r.kv_bytes, "kl_vs_f16": r.kl, "top1_vs_f16": r.top1,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "model": file_name(model_path), "text": file_name(text), "ctx": ctx, "windows": windows, "chunk": chunk,
            "pass_rows": pass_rows, "backend": backend.name(), "calib": calib.map(file_name), "pre_calib": pre_calib.map(file_name),
            "results": rows,
        });
        writeln!(out, "{doc}")?;
        return Ok(());
    }
    writeln!(
        out,
        "{} on {}: {windows} x {ctx} tokens ({} scored), {chunk} per decode step{}, backend {}, {:.0} s",
        file_name(model_path),
        file_name(text),
        results[0].tokens,
        pass_rows.map_or(String::new(), |n| format!(" in passes of {n}")),
        backend.name(),
        started.elapsed().as_secs_f64()
    )?;
    writeln!(
        out,
        "{:<16} {:>10} {:>9} {:>10} {:>7} {:>10} {:>12}",
        "method", "perplexity", "vs f16", "KL nats", "top-1", "bits/elem", "KV MiB/seq"
    )?;
    for r in &results {
        let delta = base.map_or_else(|| "-".to_string(), |b| format!("{:+.2}%", 100.0 * (r.ppl / b - 1.0)));
        let kl = r.kl.map_or_else(|| "-".to_string(), |k| format!("{k:.4}"));
        let top1 = r.top1.map_or_else(|| "-".to_string(), |a| format!("{:.1}%", 100.0 * a));
        writeln!(
            out,
            "{:<16} {:>10.3} {:>9} {:>10} {:>7} {:>10.2} {:>12.2}",
            r.method.name,
            r.ppl,
            delta,
            kl,
            top1,
            r.method.bits_per_element(),
            mib(r.kv_bytes)
        )?;
    }
    if base.is_some() {
        writeln!(
            out,
            "(KL: mean KL(f16 || method) of the next-token distribution per scored token; top-1: agreement with f16's most likely token)"
        )?;
    }
    if calib.is_some() {
        for m in &methods {
            if let Some(full) = model::KvMethod::recipe_name(&m.name) {
                writeln!(out, "({} with --calib is the recommended recipe, {full})", m.name)?;
            }
        }
    }
    Ok(())
}

fn capture(
    out: &mut Out,
    model_path: &std::path::Path,
    text: &std::path::Path,
    tokens: usize,
    layers: &[usize],
    path: &std::path::Path,
) -> Result<(), CliError> {
    let (llama, ids) = model_and_tokens(model_path, text, tokens)?;
    let started = Instant::now();
    let cap = model::capture(&llama, &ids, layers)?;
    let c = &llama.config;
    let meta: std::collections::BTreeMap<String, String> = [
        ("model", file_name(model_path)),
        ("text_file", file_name(text)),
        ("tokens", tokens.to_string()),
        ("token_ids", format!("{ids:?}")),
        ("layers", format!("{layers:?}")),
        ("rope_theta", format!("{:?}", c.rope_theta as f64)),
        ("head_dim", c.head_dim.to_string()),
        ("n_q_heads", c.heads.to_string()),
        ("n_kv_heads", c.kv_heads.to_string()),
        ("n_layers", c.layers.to_string()),
        ("attn_scaling", format!("{:?}", c.attn_scale as f64)),
        // Per captured layer: its RoPE base and sliding window (gemma3's sliding layers
        // differ from `rope_theta`; `none`: the layer sees every position).
        (
            "layer_rope_theta",
            format!(
                "{:?}",
                layers
                    .iter()
                    .map(|&l| c
                        .sliding
                        .as_ref()
                        .filter(|_| c.window_left(l).is_some())
                        .map_or(c.rope_theta, |s| s.rope_theta) as f64)
                    .collect::<Vec<_>>()
            ),
        ),
        ("layer_window_left", format!("{:?}", layers.iter().map(|&l| c.window_left(l)).collect::<Vec<_>>())),
        ("rope_convention", "HF rotate_half (non-interleaved: channel i pairs with i+D/2)".into()),
        ("layout", "[T, H, D]; q and k post-RoPE, v, k_pre_rope = k before RoPE".into()),
        ("dtype", "float16 (computed in fp32)".into()),
        ("captured_with", format!("rotkv capture {}", env!("CARGO_PKG_VERSION"))),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let bytes = cap.to_safetensors(meta)?;
    std::fs::write(path, &bytes)
        .map_err(|e| CliError::Lib(rotkv::Error::Input(format!("writing {}: {e}", path.display()))))?;
    writeln!(
        out,
        "wrote {} ({:.1} MiB): layers {layers:?}, {tokens} tokens, {:.1} s",
        path.display(),
        mib(bytes.len()),
        started.elapsed().as_secs_f64()
    )?;
    Ok(())
}

fn generate(
    out: &mut Out,
    model_path: &std::path::Path,
    prompt: &str,
    tokens: usize,
    kv: &str,
    backend: &str,
) -> Result<(), CliError> {
    let backend = Backend::parse(backend)?;
    let (llama, tok) = load_model(model_path)?;
    let mut ids = tok.bos_prefix();
    ids.extend(tok.encode(prompt)?);
    let total = ids.len().checked_add(tokens).ok_or_else(|| {
        let why = format!("{} prompt tokens and --tokens {tokens}: too many tokens to count", ids.len());
        CliError::Lib(rotkv::Error::Capacity(why))
    })?;
    let method = model::KvMethod::parse(kv, llama.config.head_dim, total)?;
    let new = model::generate(&llama, &ids, tokens, method.config, backend)?;
    writeln!(out, "{prompt}{}", tok.decode(&new)?)?;
    Ok(())
}

/// `rotkv passkey`'s prompt set.
struct PasskeyRun {
    tokens: usize,
    depths: Vec<u32>,
    trials: usize,
    seed: u64,
}

fn passkey(
    out: &mut Out,
    model_path: &std::path::Path,
    run: &PasskeyRun,
    kv: &[String],
    backend: &str,
    calib: Option<&std::path::Path>,
    json: bool,
) -> Result<(), CliError> {
    use model::passkey::{PasskeyOptions, passkey};
    let backend = Backend::parse(backend)?;
    let calibration = calib.map(model::calibrate::Calibration::load).transpose()?;
    let (llama, tok) = load_model(model_path)?;
    let methods = kv
        .iter()
        .map(|m| model::KvMethod::parse(m, llama.config.head_dim, run.tokens + model::passkey::ANSWER_TOKENS))
        .collect::<rotkv::Result<Vec<_>>>()?;
    let opts = PasskeyOptions {
        backend,
        calibration,
        tokens: run.tokens,
        depths: run.depths.clone(),
        trials: run.trials,
        seed: run.seed,
    };
    let bar = progress(methods.len() * run.depths.len() * run.trials, "passkey prompts");
    let started = Instant::now();
    let results = passkey(&llama, &tok, &methods, &opts, &mut |i, _| bar.set_position(i as u64))?;
    bar.finish_and_clear();
    let correct = |m: &str, d: Option<u32>| {
        let hits = results.iter().filter(|r| r.method == m && d.is_none_or(|d| r.depth == d));
        let (n, ok) = hits.fold((0, 0), |(n, ok), r| (n + 1, ok + r.correct as usize));
        (ok, n)
    };
    if json {
        let rows: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "method": r.method, "depth": r.depth, "key": r.key, "prompt_tokens": r.prompt_tokens,
                    "answer": r.answer, "correct": r.correct,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "model": file_name(model_path), "tokens": run.tokens, "depths": run.depths, "trials": run.trials,
            "seed": run.seed, "backend": backend.name(), "calib": calib.map(file_name), "results": rows,
        });
        writeln!(out, "{doc}")?;
        return Ok(());
    }
    let longest = results.iter().map(|r| r.prompt_tokens).max().unwrap_or(0);
    writeln!(
        out,
        "{}: passkey, prompts of at most {longest} tokens, {} keys per depth, backend {}, {:.0} s",
        file_name(model_path),
        run.trials,
        backend.name(),
        started.elapsed().as_secs_f64()
    )?;
    write!(out, "{:<16}", "method")?;
    for d in &run.depths {
        write!(out, " {:>7}", format!("{d}%"))?;
    }
    writeln!(out, " {:>9}", "all")?;
    for m in &methods {
        write!(out, "{:<16}", m.name)?;
        for &d in &run.depths {
            let (ok, n) = correct(&m.name, Some(d));
            write!(out, " {:>7}", format!("{ok}/{n}"))?;
        }
        let (ok, n) = correct(&m.name, None);
        writeln!(out, " {:>9}", format!("{ok}/{n}"))?;
    }
    Ok(())
}

fn calibrate(
    out: &mut Out,
    model_path: &std::path::Path,
    text: &std::path::Path,
    tokens: usize,
    (methods, loss): (&[String], model::calibrate::SmoothLoss),
    (optr_for, optr_steps, optr_queries): (&str, usize, usize),
    path: &std::path::Path,
) -> Result<(), CliError> {
    let mut what = model::calibrate::Use::default();
    // The key channel standard deviations are kept as they are (a cache turns them into
    // scales with the alpha of its method, `-a<percent>`).
    let mut keep_std = false;
    let mut pre_rope = false;
    for m in methods {
        match m.as_str() {
            "prerope" => pre_rope = true,
            "center" => what.center = true,
            "reorder" => what.reorder = true,
            "optr" => what.learned = true,
            "smooth" => keep_std = true,
            "sinks" => {
                return Err(CliError::Lib(rotkv::Error::Unsupported(
                    "calibration method \"sinks\": detected sinks are positions of each sequence, found at its prefill \
                     (rotkv::model::sinks::detect, KvCache::protect; rotkv ppl -dh<k>), not a per-model calibration"
                        .into(),
                )));
            }
            other => {
                return Err(CliError::Lib(rotkv::Error::Unsupported(format!(
                    "calibration method {other:?} (this build calibrates: center, reorder, smooth, optr, prerope)"
                ))));
            }
        }
    }
    let (llama, ids) = model_and_tokens(model_path, text, tokens)?;
    let optr = if what.learned {
        let method = model::KvMethod::parse(optr_for, llama.config.head_dim, tokens)?;
        if !method.quantized {
            return Err(CliError::Lib(rotkv::Error::Value(format!("--optr-for {optr_for}: not a quantized method"))));
        }
        let base = model::optr::OptrOptions::for_config(&method.config);
        Some(model::optr::OptrOptions { steps: optr_steps, queries: optr_queries, ..base })
    } else {
        None
    };
    let started = Instant::now();
    let bar = progress(if optr.is_some() { llama.config.layers } else { 0 }, "optr rotations (layers)");
    if pre_rope && (what.reorder || what.learned) {
        return Err(CliError::Lib(rotkv::Error::Unsupported(
            "calibration method prerope goes with center and smooth only".into(),
        )));
    }
    let mut cal = if pre_rope {
        model::prerope::pre_rope_calibration(&llama, &ids)?
    } else {
        use model::calibrate::{CalibrateOptions, calibrate_with, smoothing_min_tokens};
        let mut opts =
            CalibrateOptions { optr: optr.as_ref(), loss, ..CalibrateOptions::presets(llama.config.head_dim) };
        opts.smooth_for.retain(|cfg| ids.len() >= smoothing_min_tokens(cfg));
        calibrate_with(&llama, &ids, &opts, &mut |_| bar.inc(1))?
    };
    bar.finish_and_clear();
    cal.layers = (0..cal.layers.len())
        .map(|l| rotkv::LayerCalibration {
            key_scale: if keep_std { cal.layers[l].key_scale.clone() } else { vec![1.0; cal.kv_heads * cal.head_dim] },
            ..cal.layer(l, what)
        })
        .collect();
    let mut facts = vec![
        ("model", file_name(model_path)),
        ("text_file", file_name(text)),
        ("tokens", tokens.to_string()),
        ("methods", methods.join(",")),
        ("skipped_positions", model::calibrate::SKIP_POSITIONS.to_string()),
    ];
    if let Some(o) = &optr {
        facts.push(("optr_for", optr_for.to_string()));
        facts.push(("optr_options", format!("{o:?}")));
    }
    if !keep_std || !what.center {
        // The measured choice applies to centered keys smoothed by these deviations.
        cal.key_smoothing.clear();
    }
    cal.metadata.extend(facts.into_iter().map(|(k, v)| (k.to_string(), v)));
    let bytes = cal.to_safetensors()?;
    std::fs::write(path, &bytes)
        .map_err(|e| CliError::Lib(rotkv::Error::Input(format!("writing {}: {e}", path.display()))))?;
    writeln!(
        out,
        "wrote {}: {} layers x {} KV heads ({}), from {tokens} tokens of {}, {:.1} s",
        path.display(),
        cal.layers.len(),
        cal.kv_heads,
        methods.join(", "),
        file_name(text),
        started.elapsed().as_secs_f64()
    )?;
    if let Some(r) = cal.metadata.get("optr.mean_loss_ratio") {
        writeln!(out, "optr: {r}")?;
    }
    if keep_std {
        // What `-aa` will decide per KV head from this file.
        let mut r: Vec<f64> =
            cal.layers.iter().flat_map(|l| model::calibrate::outlier_ratios(&l.key_scale, cal.head_dim)).collect();
        r.sort_by(f64::total_cmp);
        let limit = model::calibrate::AUTO_SMOOTH_RATIO;
        if let (Some(lo), Some(hi)) = (r.first(), r.last()) {
            writeln!(
                out,
                "key channel std, largest / mean per KV head: min {lo:.2}, median {:.2}, max {hi:.2}; \
                 -aa smooths {} of {} heads (ratio >= {limit})",
                r[r.len() / 2],
                r.iter().filter(|&&x| x >= limit).count(),
                r.len()
            )?;
        }
    }
    print_smoothing_choice(out, &cal)?;
    Ok(())
}

/// The smoothing the calibration chose per layer and KV head, per key bit width.
fn print_smoothing_choice(out: &mut Out, cal: &model::calibrate::Calibration) -> std::io::Result<()> {
    for (bits, layers) in &cal.key_smoothing {
        let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
        layers.iter().flatten().for_each(|c| *counts.entry(c.to_string()).or_default() += 1);
        let counts: Vec<String> = counts.iter().map(|(c, n)| format!("{c}: {n}")).collect();
        writeln!(
            out,
            "smoothing for {bits}-bit keys (the recipe of k{bits}v*), chosen per KV head by the error it measured \
             (alpha, kN: knee at N x the median channel): heads per choice {}",
            counts.join(", ")
        )?;
        if let Some(summary) = cal.metadata.get(&format!("smooth.k{bits}")) {
            writeln!(out, "  {summary}")?;
        }
        let per_layer: Vec<String> = layers
            .iter()
            .enumerate()
            .map(|(l, heads)| format!("L{l} {}", heads.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("/")))
            .collect();
        for chunk in per_layer.chunks(6) {
            writeln!(out, "  {}", chunk.join("  "))?;
        }
    }
    Ok(())
}
