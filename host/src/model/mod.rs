//! A real model end to end (feature `model`): a GGUF reader, the GGUF's tokenizer (built
//! with Hugging Face `tokenizers`), a llama / qwen2 / qwen3 / gemma3 forward pass on the CPU whose
//! attention runs through the rotkv cache, perplexity (with KL divergence against the f16
//! cache) measured decode-faithfully, and capture of KV tensors.

pub mod calibrate;
pub mod gguf;
pub mod inject;
pub mod llama;
pub mod math;
pub mod optr;
pub mod passkey;
pub mod prerope;
pub mod sinks;
pub mod tokenizer;

use crate::config::{CacheConfig, Rotation};
use crate::error::{Error, Result};
use crate::{Backend, CacheShape, KvCache};
use llama::{CacheAttention, ExactAttention, LayerActivations, Llama, Row};
use std::collections::BTreeMap;
use tokenizer::Tokenizer;

/// Where `cargo xtask fetch` puts the model and the texts: `$ROTKV_CACHE`, else
/// `$XDG_CACHE_HOME/rotkv`, else `~/.cache/rotkv`.
pub fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(d) = std::env::var_os("ROTKV_CACHE") {
        return Some(d.into());
    }
    std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .map(|d| d.join("rotkv"))
}

/// The fetched SmolLM2-135M-Instruct GGUF, relative to [`cache_dir`].
pub const SMOLLM2: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The fetched Gemma 3 270M GGUF (base model, Q4_K_M; gemma3 architecture: head_dim
/// 256, one KV head, sliding-window layers), relative to [`cache_dir`].
pub const GEMMA3_270M: &str = "models/gemma-3-270m-q4_k_m.gguf";

/// A file fetched by `cargo xtask fetch` ([`SMOLLM2`], [`GEMMA3_270M`],
/// `text/alice29.txt`, `text/lcet10.txt`), if it is there.
pub fn fetched(relative: &str) -> Option<std::path::PathBuf> {
    cache_dir().map(|d| d.join(relative)).filter(|p| p.exists())
}

/// Loads a model and its tokenizer from a GGUF file, every weight dequantized to f32.
pub fn load(path: &std::path::Path) -> Result<(Llama, Tokenizer)> {
    load_with(path, llama::WeightStorage::F32)
}

/// [`load`] with the weight matrices kept as `storage` says: `Quantized` holds them as
/// the file stores them (a 7B Q4_K_M model in about 4.7 GB instead of 30 GB of f32), with
/// bit-identical products.
pub fn load_with(path: &std::path::Path, storage: llama::WeightStorage) -> Result<(Llama, Tokenizer)> {
    let g = gguf::Gguf::open(path)?;
    Ok((Llama::from_gguf_with(&g, storage)?, Tokenizer::from_gguf(&g)?))
}

/// Reads a UTF-8 text file with Python's universal newlines (`\r\n` and lone `\r`
/// become `\n`), as the reference measurements read their texts: the Canterbury files
/// have CRLF line ends.
pub fn read_text(path: &std::path::Path) -> Result<String> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::Input(format!("reading {}: {e}", path.display())))?;
    Ok(s.replace("\r\n", "\n").replace('\r', "\n"))
}

/// The first tokens of a text file ([`text_tokens`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextPrefix {
    /// The first `n` text tokens (no BOS), or every token of a shorter text.
    pub ids: Vec<u32>,
    /// Bytes of the file read and tokenized to find them.
    pub bytes: usize,
    /// Whether the whole file was read (then `ids` are all its tokens, if fewer than `n`).
    pub whole: bool,
}

/// The first `n` text tokens of a UTF-8 text file, read as [`read_text`] reads it, from
/// a prefix of the file: `8 n + 4096` bytes first, doubled until the prefix holds `n`
/// tokens or the file ends, so the work and memory follow `n`, not the file's size. A
/// prefix ends at a line start between two non-space bytes (`x\nY`), where no
/// pre-tokenizer's piece spans the cut, so its tokens are the whole text's (for
/// SentencePiece too unless the vocabulary merges a newline with its neighbours); a file
/// without such a line start is read whole. Only the prefix must be UTF-8.
pub fn text_tokens(tok: &Tokenizer, path: &std::path::Path, n: usize) -> Result<TextPrefix> {
    use std::io::Read;
    let err = |e: String| Error::Input(format!("reading {}: {e}", path.display()));
    let mut file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mut raw = Vec::new();
    let mut want = n.saturating_mul(8).saturating_add(4096);
    let mut tried = 0;
    loop {
        let more = want.saturating_sub(raw.len()) as u64;
        let got = (&mut file).take(more).read_to_end(&mut raw).map_err(|e| err(e.to_string()))?;
        let whole = (got as u64) < more;
        let cut = if whole { Some(raw.len()) } else { last_line_start(&raw) };
        if let Some(cut) = cut.filter(|&c| c > tried) {
            tried = cut;
            let text =
                std::str::from_utf8(&raw[..cut]).map_err(|e| err(format!("not UTF-8 at byte {}", e.valid_up_to())))?;
            let mut ids = tok.encode(&text.replace("\r\n", "\n").replace('\r', "\n"))?;
            if ids.len() >= n || whole {
                ids.truncate(n);
                return Ok(TextPrefix { ids, bytes: cut, whole });
            }
        }
        want = want.saturating_mul(2);
    }
}

/// The last position `p` of `raw` with `raw[p - 1] == b'\n'` between two bytes that are
/// not ASCII whitespace.
fn last_line_start(raw: &[u8]) -> Option<usize> {
    (2..raw.len())
        .rev()
        .find(|&p| raw[p - 1] == b'\n' && !raw[p - 2].is_ascii_whitespace() && !raw[p].is_ascii_whitespace())
}

/// A KV-cache method of the perplexity harness.
#[derive(Clone, Debug, PartialEq)]
pub struct KvMethod {
    /// The name it was given (`f16`, `k2v2-g32-w256`, ...).
    pub name: String,
    /// The cache configuration (for `f16`: a window as long as the context, no rotation,
    /// so nothing is quantized).
    pub config: CacheConfig,
    /// Whether tokens are quantized at all.
    pub quantized: bool,
    /// Which parts of a calibration file the method uses (`-c`: key centering, `-r`:
    /// channel reordering, `-l`: learned rotations, `-a<alpha %>`: key smoothing).
    pub calib: calibrate::Use,
    /// Online key centering (`-o<N>`): each sequence's key mean from its own first N
    /// tokens (see [`perplexity`]).
    pub online: Option<usize>,
    /// Detected sinks (`-da<k>`, `-dk<k>`, `-dh<k>`): per layer, the `k` positions of each
    /// window's first [`DETECT_PREFILL`] tokens that the detector ranks highest are
    /// protected (kept in f16) before the window is fed.
    pub detect: Option<(sinks::Detector, usize)>,
    /// `-pre`: keys quantized before RoPE (RotateKV), RoPE re-applied to each dequantized
    /// key; simulated in the harness ([`prerope`]), with the pre-RoPE calibration of
    /// [`PplOptions::pre_calibration`] for `-c` and `-a`.
    pub pre_rope: bool,
    /// Run through the harness simulation of [`prerope`] instead of a rotkv cache: set by
    /// `-pre`, and by `-sim` (post-RoPE keys, the control of `-pre`), and by `kivi2`,
    /// `kivi4`.
    pub simulated: bool,
    /// KIVI's quantizer, simulated (`kivi2`, `kivi4`: the anchor from the literature):
    /// no rotation, keys per channel over blocks of 32 tokens, values per token in groups
    /// of 32 channels, the same sinks, window and pages as the presets
    /// ([`prerope::SimMethod::kivi`]).
    pub kivi: bool,
}

/// Tokens of the exact prefill that sink detection looks at (each window's first ones,
/// a prompt; all of a shorter window).
pub const DETECT_PREFILL: usize = 128;

impl KvMethod {
    /// Parses a method: a base, `f16`, `k2v2`, `k4v2`, `k4v4` (the presets of
    /// [`CacheConfig`], Hadamard-rotated) or `naive2`, `naive4` (no rotation, 2 or 4 bits,
    /// whole ranges) or `kivi2`, `kivi4` (KIVI's per-channel keys, simulated:
    /// [`KvMethod::kivi`]; with `-g -s -w -p` only), then optional modifiers
    /// `-g<group>`, `-s<sinks>`, `-w<window>`, `-p<page size>`, `-x<percent>` and
    /// `-y<percent>` (key and value quantizers span that share of each group's range,
    /// [`CacheConfig::key_clip`]), `-v<iterations>` (KVarN variance normalization,
    /// [`CacheConfig::channel_norm`]), `-o<N>` (online key centering: each sequence's mean
    /// from its own first N tokens), `-da<k>`, `-dk<k>`, `-dh<k>` (protect `k` detected
    /// sinks per layer, ranked by attention mass, key norm or hidden-state norm over the
    /// first [`DETECT_PREFILL`] tokens, see [`sinks`]), and `-c` (subtract the
    /// calibrated key means), `-r` (apply the calibrated channel permutations), `-l`
    /// (rotate by the calibrated OptR rotations instead of the Hadamard transform; not
    /// with `-r`), `-a<percent>` (smooth the keys: divide each centered key channel by the
    /// calibrated channel standard deviation raised to alpha = percent / 100, normalized
    /// to mean 1, and multiply the query by the same; `-a50` is alpha 0.5; see
    /// [`calibrate::smoothing_scales`]), `-aa` (the same with alpha 0.5 on the KV heads
    /// whose keys have outlier channels, none on the others: [`calibrate::Smooth::Auto`]),
    /// `-m` (per layer and KV head the exponent `rotkv calibrate` measured best for the
    /// method's key bits: [`calibrate::Smooth::Measured`]), `-raw` (nothing: spells a
    /// bare preset that [`KvMethod::parse_calibrated`] would read as the recipe). `-pre` quantizes the keys before RoPE and
    /// re-applies RoPE to each dequantized key at its position (RotateKV's recipe), and
    /// `-sim` runs the post-RoPE method through the same harness simulation (its control):
    /// both only on the Hadamard presets, with `-g -s -w -p -x -y -c -a` (see [`prerope`]:
    /// a simulation, not a cache option). `ctx` sizes the window of `f16`.
    pub fn parse(name: &str, head_dim: usize, ctx: usize) -> Result<Self> {
        let mut parts = name.split('-');
        let base = parts.next().unwrap_or("");
        let (mut config, quantized) = match base {
            "f16" => (
                CacheConfig {
                    window: ctx,
                    key_rotation: Rotation::None,
                    value_rotation: Rotation::None,
                    ..CacheConfig::k4v4(head_dim)
                },
                false,
            ),
            "kivi2" | "kivi4" => {
                let bits = if base == "kivi2" { 2 } else { 4 };
                let c = CacheConfig {
                    key_bits: bits,
                    value_bits: bits,
                    group_size: 32,
                    key_rotation: Rotation::None,
                    value_rotation: Rotation::None,
                    key_clip: 1.0,
                    ..CacheConfig::k2v2(head_dim)
                };
                (c, true)
            }
            "naive2" | "naive4" => {
                let bits = if base == "naive2" { 2 } else { 4 };
                let c = CacheConfig {
                    key_bits: bits,
                    value_bits: bits,
                    key_rotation: Rotation::None,
                    value_rotation: Rotation::None,
                    key_clip: 1.0,
                    ..CacheConfig::k2v2(head_dim)
                };
                (c, true)
            }
            other => (CacheConfig::preset(other, head_dim).map_err(|_| unknown(name))?, true),
        };
        let mut calib = calibrate::Use::default();
        let mut online = None;
        let mut detect = None;
        let kivi = base == "kivi2" || base == "kivi4";
        let (mut pre_rope, mut simulated) = (false, kivi);
        for m in parts {
            if quantized && !kivi && base != "naive2" && base != "naive4" && (m == "pre" || m == "sim") {
                pre_rope |= m == "pre";
                simulated = true;
                continue;
            }
            if let Some(rest) = m.strip_prefix('d').filter(|_| quantized) {
                let how = match rest.chars().next() {
                    Some('a') => sinks::Detector::Attention,
                    Some('k') => sinks::Detector::KeyNorm,
                    Some('h') => sinks::Detector::Hidden,
                    _ => return Err(unknown(name)),
                };
                let k: usize = rest[1..].parse().map_err(|_| unknown(name))?;
                config.protected = k;
                detect = Some((how, k));
                continue;
            }
            match m {
                "c" if quantized => {
                    calib.center = true;
                    continue;
                }
                "r" if quantized => {
                    calib.reorder = true;
                    continue;
                }
                "l" if quantized => {
                    calib.learned = true;
                    continue;
                }
                "aa" if quantized => {
                    calib.smooth = Some(calibrate::Smooth::Auto);
                    continue;
                }
                "m" if quantized => {
                    calib.smooth = Some(calibrate::Smooth::Measured(config.key_bits));
                    continue;
                }
                "raw" => continue,
                _ => {}
            }
            let (key, num) = m.split_at(m.chars().next().map_or(0, char::len_utf8));
            let n: usize = num.parse().map_err(|_| unknown(name))?;
            match key {
                "g" => config.group_size = n,
                "s" => config.sinks = n,
                "w" if quantized => config.window = n,
                "p" => config.page_size = n,
                "o" if quantized && n > calibrate::SKIP_POSITIONS => online = Some(n),
                "x" if quantized => config.key_clip = n as f32 / 100.0,
                "y" if quantized => config.value_clip = n as f32 / 100.0,
                "v" if quantized => config.channel_norm = n as u32,
                "a" if quantized && n <= 400 => calib.smooth = Some(calibrate::Smooth::Alpha(n as u32)),
                _ => return Err(unknown(name)),
            }
        }
        config.format()?;
        if online.is_some() && calib.center {
            return Err(Error::Value(format!("{name}: -c and -o both set a key mean")));
        }
        if calib.learned && calib.reorder {
            // The calibrated permutations sort Hadamard-rotated channels; a learned rotation
            // already chooses which directions share a group.
            return Err(Error::Value(format!("{name}: -l (learned rotations) and -r (reordering) do not combine")));
        }
        if calib.smooth.is_some() && (calib.learned || calib.reorder) {
            // Both are calibrated on the centered keys without smoothing: the permutation
            // sorts their rotated channels, the learned rotations are trained on them.
            return Err(Error::Value(format!(
                "{name}: -a (key smoothing) does not combine with -r or -l (calibrated on unsmoothed keys)"
            )));
        }
        if simulated
            && (online.is_some() || detect.is_some() || calib.reorder || calib.learned || config.channel_norm > 0)
        {
            return Err(Error::Value(format!(
                "{name}: -pre and -sim (the harness simulation) take -g -s -w -p -x -y -c -a only"
            )));
        }
        if kivi && (calib != calibrate::Use::default() || config.key_clip != 1.0 || config.value_clip != 1.0) {
            return Err(Error::Value(format!("{name}: kivi2 and kivi4 take -g -s -w -p only")));
        }
        Ok(Self { name: name.to_string(), config, quantized, calib, online, detect, pre_rope, simulated, kivi })
    }

    /// [`KvMethod::parse`], except that with a calibration (`calibrated`) a bare preset
    /// name (`k2v2`, `k4v2`, `k4v4`) means the recommended recipe for it,
    /// [`KvMethod::recipe_name`] (`k2v2` is `k2v2-c-m-dh8`), keeping the bare name. A name
    /// with modifiers means exactly what they say (`k2v2-raw` is the preset alone).
    pub fn parse_calibrated(name: &str, head_dim: usize, ctx: usize, calibrated: bool) -> Result<Self> {
        match Self::recipe_name(name) {
            Some(full) if calibrated => Ok(Self { name: name.to_string(), ..Self::parse(&full, head_dim, ctx)? }),
            _ => Self::parse(name, head_dim, ctx),
        }
    }

    /// The recommended recipe of a preset, spelled out: key centering (`-c`), the
    /// smoothing measured per layer and KV head for its key bits (`-m`) and
    /// [`calibrate::RECIPE_SINKS`] detected sinks per layer (`-dh8`); `None` for a name
    /// that is not a bare preset.
    pub fn recipe_name(preset: &str) -> Option<String> {
        matches!(preset, "k2v2" | "k4v2" | "k4v4").then(|| format!("{preset}-c-m-dh{}", calibrate::RECIPE_SINKS))
    }

    /// Bits per element of the quantized tokens, scales and zeros included (16 for f16).
    pub fn bits_per_element(&self) -> f64 {
        if self.quantized { self.config.bits_per_element() } else { 16.0 }
    }

    /// KV bytes one sequence of `len` tokens holds over `layers` layers of `kv_heads`
    /// heads: quantized tokens at the format's bytes per token (and pages' channel
    /// scales), sinks and window in f16, and the f16 copies of detected sinks.
    pub fn kv_bytes(&self, len: usize, layers: usize, kv_heads: usize) -> Result<usize> {
        let d = self.config.head_dim;
        let q = if self.quantized { self.config.format()?.quantized_len(len as u32) as usize } else { 0 };
        let copies = self.detect.map_or(0, |(_, k)| k.min(q));
        let fmt = self.config.format()?;
        let channel_scales = q / fmt.page_size as usize * fmt.channel_scale_bytes() as usize;
        let per_head = q * self.config.bytes_per_token()? + channel_scales + (len - q + copies) * 4 * d;
        Ok(per_head * layers * kv_heads)
    }
}

fn unknown(name: &str) -> Error {
    Error::Value(format!(
        "unknown KV method {name:?}: f16, naive2, naive4, kivi2, kivi4, k2v2, k4v2 or k4v4, then -g<group> -s<sinks> -w<window> -p<page> -x<key clip %> -y<value clip %> -v<iterations> -o<N> -da<k> -dk<k> -dh<k> -c -r -l -a<alpha %> -aa -m -raw -pre -sim"
    ))
}

/// The perplexity of one method.
#[derive(Clone, Debug, PartialEq)]
pub struct PplResult {
    /// The method.
    pub method: KvMethod,
    /// exp(mean negative log-likelihood).
    pub ppl: f64,
    /// Mean negative log-likelihood in nats per token.
    pub nll: f64,
    /// Scored tokens.
    pub tokens: usize,
    /// KV bytes of one window at full length (all layers).
    pub kv_bytes: usize,
    /// Mean KL divergence `KL(f16 || method)` in nats per scored token, of this method's
    /// next-token distribution from the first unquantized method's (`f16`) at the same
    /// position; `None` when no unquantized method ran beside it.
    pub kl: Option<f64>,
    /// Share of scored positions whose most likely next token is the unquantized method's
    /// (`None` as for `kl`).
    pub top1: Option<f64>,
}

/// Options of [`perplexity`].
#[derive(Clone, Debug)]
pub struct PplOptions {
    /// Where the cache's append and decode run.
    pub backend: Backend,
    /// The calibration that methods with `-c` or `-r` use.
    pub calibration: Option<calibrate::Calibration>,
    /// Tokens per step (1 to [`crate::paged::MAX_Q_LEN`]): each step appends this many
    /// tokens of every window and decodes them with one multi-token decode
    /// ([`crate::KvCache::decode_tokens`]); 1 is token-by-token decode. Every token sees
    /// the same positions either way, and the same stored rows unless a later token of its
    /// step pushed a page of the window into quantization (its earlier rows then read
    /// that page quantized, as a speculative decoder's verification rows would).
    pub chunk: usize,
    /// Rows per pass of a step's multi-token decode ([`crate::KvCache::append_decode`]):
    /// `None` takes each method's [`crate::CacheConfig::pass_rows`] (half its window: what
    /// a serving step with [`crate::device::StepBatch::with_passes`] runs), so that a
    /// step's rows see its earlier tokens in f16 however long the chunk; `Some(n)` with
    /// `n >= chunk` appends the whole step before decoding it.
    pub pass_rows: Option<usize>,
    /// The calibration of the pre-RoPE keys ([`prerope::pre_rope_calibration`]) that `-pre`
    /// methods with `-c` or `-a` use.
    pub pre_calibration: Option<calibrate::Calibration>,
}

/// Perplexity of `model` on `windows` (token windows of equal length) for each method,
/// decode-faithfully: every window is fed `opts.chunk` tokens at a time (token by token
/// at 1), each step appends the tokens' keys and values to the method's cache and
/// decodes their queries from the cache (one multi-token decode, each row causal), so
/// the logits at position `t` see what the decode kernel sees (sinks and the recent
/// window in f16, older tokens quantized). All methods and windows run as one batch.
/// Token `t + 1` of a window is scored from the logits of position `t`. When an
/// unquantized method (`f16`) is among `methods`, each method's next-token distribution
/// is also compared with the first such method's at every scored position (mean KL
/// divergence and top-1 agreement, [`PplResult::kl`]).
/// `progress(done, positions)` is called after each step with the positions fed so far.
pub fn perplexity(
    model: &Llama,
    windows: &[Vec<u32>],
    methods: &[KvMethod],
    opts: &PplOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<PplResult>> {
    let c = &model.config;
    let ctx = windows.first().map_or(0, Vec::len);
    if ctx < 2 || windows.iter().any(|w| w.len() != ctx) {
        return Err(Error::Shape("windows must share one length of at least 2 tokens".into()));
    }
    if methods.is_empty() {
        return Err(Error::Value("no KV method given".into()));
    }
    let chunk = opts.chunk;
    if !(1..=crate::paged::MAX_Q_LEN).contains(&chunk) {
        return Err(Error::Value(format!("chunk of {chunk} tokens (1 to {})", crate::paged::MAX_Q_LEN)));
    }
    let shape = CacheShape {
        layers: c.layers,
        num_kv_heads: c.kv_heads,
        num_q_heads: c.heads,
        max_seqs: windows.len(),
        max_tokens: ctx,
        num_blocks: None,
    };
    let mut caches = Vec::new();
    let mut slots = Vec::new();
    for (m, method) in methods.iter().enumerate() {
        // A simulated method's cache is never used (its rows go to the simulation).
        let plain;
        let method = if method.simulated {
            plain = KvMethod { calib: calibrate::Use::default(), ..method.clone() };
            &plain
        } else {
            method
        };
        let mut cache = method_cache(c, method, shape, opts.backend, opts.calibration.as_ref())?;
        for _ in windows {
            slots.push((m, cache.add_sequence()?));
        }
        caches.push(cache);
    }
    // Online centering: each window's key mean per layer from an exact prefill of its
    // own first N tokens (what a serving stack has at prefill), set before any append.
    for (m, method) in methods.iter().enumerate() {
        let Some(n) = method.online else { continue };
        if n > ctx {
            return Err(Error::Value(format!("{}: online mean over {n} tokens of {ctx}-token windows", method.name)));
        }
        for (w, window) in windows.iter().enumerate() {
            let means = online_key_means(model, &window[..n])?;
            for (l, mean) in means.iter().enumerate() {
                caches[m].set_sequence_key_mean(l, slots[m * windows.len() + w].1, mean)?;
            }
        }
    }
    // Detected sinks: each window's per-layer positions from an exact prefill of its first
    // tokens, protected before any append.
    for (m, method) in methods.iter().enumerate() {
        let Some((how, k)) = method.detect else { continue };
        for (w, window) in windows.iter().enumerate() {
            let prefill = &window[..DETECT_PREFILL.min(ctx)];
            let found = sinks::detect(model, prefill, k, method.config.sinks, how)?;
            for (l, positions) in found.iter().enumerate() {
                caches[m].protect(l, slots[m * windows.len() + w].1, positions)?;
            }
        }
    }
    let mut attn = CacheAttention::new(c, caches, slots)?;
    attn.multi_token_decode = true;
    attn.pass_rows = opts.pass_rows;
    // Simulated methods (`-pre`, `-sim`): their sequences go to the harness simulation.
    let mut sims = Vec::new();
    let mut seq_method = Vec::new();
    for method in methods {
        let id = if method.simulated {
            let cal = if method.pre_rope { opts.pre_calibration.as_ref() } else { opts.calibration.as_ref() };
            sims.push(prerope::SimMethod {
                config: method.config,
                pre_rope: method.pre_rope,
                key_stats: sim_key_stats(c, method, cal)?,
                kivi: method.kivi,
            });
            Some(sims.len() - 1)
        } else {
            None
        };
        seq_method.extend(std::iter::repeat_n(id, windows.len()));
    }
    let mut split = prerope::Split {
        simulated: seq_method.iter().map(Option::is_some).collect(),
        sim: prerope::SimAttention::new(c, sims, seq_method)?,
        rest: &mut attn,
    };
    let n = methods.len() * windows.len();
    let mut nll = vec![0f64; methods.len()];
    // KL(f16 || method) and top-1 agreement against the first unquantized method.
    let reference = methods.iter().position(|m| !m.quantized);
    let (mut kl, mut agree) = (vec![0f64; methods.len()], vec![0usize; methods.len()]);
    let mut t = 0;
    while t < ctx - 1 {
        // Rows `[sequence][token]`: positions t .. t + step of every window of every method.
        let step = chunk.min(ctx - 1 - t);
        let rows: Vec<Row> = (0..n * step).map(|r| Row { seq: r / step, pos: t + r % step }).collect();
        let tokens: Vec<u32> = rows.iter().map(|r| windows[r.seq % windows.len()][r.pos]).collect();
        let hidden = model.forward(&tokens, &rows, &mut split, None, c.layers)?;
        let logits = model.logits(&hidden);
        for (r, l) in rows.iter().zip(logits.chunks_exact(c.vocab)) {
            nll[r.seq / windows.len()] += neg_log_softmax(l, windows[r.seq % windows.len()][r.pos + 1] as usize);
        }
        if let Some(m0) = reference {
            // Row of sequence s at position p: (s * step + p - t); the reference method's
            // sequence of window w is m0 * windows + w.
            let rows_of = |s: usize| (s * step..(s + 1) * step).map(|i| &logits[i * c.vocab..(i + 1) * c.vocab]);
            for w in 0..windows.len() {
                let refs: Vec<(Vec<f64>, usize)> = rows_of(m0 * windows.len() + w).map(log_softmax).collect();
                for m in 0..methods.len() {
                    for ((lp, best), l) in refs.iter().zip(rows_of(m * windows.len() + w)) {
                        let (lq, mine) = log_softmax(l);
                        kl[m] += lp.iter().zip(&lq).map(|(&a, &b)| a.exp() * (a - b)).sum::<f64>();
                        agree[m] += usize::from(mine == *best);
                    }
                }
            }
        }
        t += step;
        progress(t, ctx - 1);
    }
    let scored = windows.len() * (ctx - 1);
    methods
        .iter()
        .zip(nll)
        .enumerate()
        .map(|(i, (m, total))| {
            let mean = total / scored as f64;
            Ok(PplResult {
                method: m.clone(),
                ppl: mean.exp(),
                nll: mean,
                tokens: scored,
                kv_bytes: m.kv_bytes(ctx, c.layers, c.kv_heads)?,
                kl: reference.map(|_| kl[i] / scored as f64),
                top1: reference.map(|_| agree[i] as f64 / scored as f64),
            })
        })
        .collect()
}

/// Per layer, the key mean and key scale `[kv_heads][head_dim]` a simulated method uses:
/// from `cal` (post-RoPE or pre-RoPE statistics, as the method's keys) where it centers
/// or smooths, zeros and ones otherwise.
fn sim_key_stats(
    c: &llama::LlamaConfig,
    method: &KvMethod,
    cal: Option<&calibrate::Calibration>,
) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    let n = c.kv_heads * c.head_dim;
    if method.calib == calibrate::Use::default() {
        return Ok(vec![(vec![0.0; n], vec![1.0; n]); c.layers]);
    }
    let which = if method.pre_rope { "pre-RoPE (--pre-calib)" } else { "post-RoPE (--calib)" };
    let cal = cal.ok_or_else(|| Error::Calibration(format!("method {} needs a {which} calibration", method.name)))?;
    if cal.layers.len() != c.layers || cal.kv_heads != c.kv_heads || cal.head_dim != c.head_dim {
        return Err(Error::Calibration(format!("the {which} calibration does not fit the model")));
    }
    if method.calib.smooth.is_some() && !cal.has_key_std() {
        return Err(Error::Calibration(format!(
            "method {} smooths; the {which} calibration has no key_std",
            method.name
        )));
    }
    check_measured(method, cal)?;
    Ok((0..c.layers)
        .map(|l| {
            let lc = cal.layer(l, method.calib);
            (lc.key_mean, lc.key_scale)
        })
        .collect())
}

/// Per layer, the mean post-RoPE key `[kv_heads][head_dim]` of `tokens` (positions before
/// [`calibrate::SKIP_POSITIONS`] left out), from an exact-attention forward pass.
pub fn online_key_means(model: &Llama, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    let c = &model.config;
    let kvd = c.kv_heads * c.head_dim;
    if tokens.len() <= calibrate::SKIP_POSITIONS {
        return Err(Error::Shape(format!("{} tokens for an online mean", tokens.len())));
    }
    let used = (tokens.len() - calibrate::SKIP_POSITIONS) as f64;
    let mut means = vec![vec![0f64; kvd]; c.layers];
    let mut keep = |a: &LayerActivations<'_>| {
        for (p, k) in a.k.chunks_exact(kvd).enumerate().skip(calibrate::SKIP_POSITIONS) {
            debug_assert_eq!(a.rows[p].pos, p);
            means[a.layer].iter_mut().zip(k).for_each(|(m, &x)| *m += x as f64 / used);
        }
    };
    let rows: Vec<Row> = (0..tokens.len()).map(|p| Row { seq: 0, pos: p }).collect();
    model.forward(tokens, &rows, &mut ExactAttention::new(c), Some(&mut keep), c.layers)?;
    Ok(means.into_iter().map(|m| m.into_iter().map(|x| x as f32).collect()).collect())
}

/// `log softmax(logits)` in f64, and the index of the largest logit (the first of equals).
fn log_softmax(logits: &[f32]) -> (Vec<f64>, usize) {
    let (best, m) =
        logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
    let m = m as f64;
    let lse = m + logits.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    (logits.iter().map(|&x| x as f64 - lse).collect(), best)
}

/// `-log softmax(logits)[target]`, in f64.
fn neg_log_softmax(logits: &[f32], target: usize) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - m).exp()).sum();
    m + sum.ln() - logits[target] as f64
}

/// A cache for `method` of `shape` on `backend`, with the method's part of
/// `calibration` set on every layer (an error when the method needs a calibration that
/// is missing or does not fit the model).
pub(crate) fn method_cache(
    c: &llama::LlamaConfig,
    method: &KvMethod,
    shape: CacheShape,
    backend: Backend,
    calibration: Option<&calibrate::Calibration>,
) -> Result<KvCache> {
    if method.config.head_dim != c.head_dim {
        return Err(Error::Shape(format!("method {} has head_dim {}", method.name, method.config.head_dim)));
    }
    let mut cache = KvCache::new(method.config, shape, backend)?;
    if method.calib != calibrate::Use::default() {
        let cal = calibration.ok_or_else(|| {
            Error::Calibration(format!("method {} uses a calibration and none was given", method.name))
        })?;
        if cal.layers.len() != c.layers || cal.kv_heads != c.kv_heads || cal.head_dim != c.head_dim {
            return Err(Error::Calibration(format!(
                "calibration for {} layers x {} KV heads x {} channels; the model has {} x {} x {}",
                cal.layers.len(),
                cal.kv_heads,
                cal.head_dim,
                c.layers,
                c.kv_heads,
                c.head_dim
            )));
        }
        if method.calib.learned && !cal.has_learned_rotations() {
            return Err(Error::Calibration(format!(
                "method {} uses learned rotations; the calibration has none (rotkv calibrate --methods optr)",
                method.name
            )));
        }
        if method.calib.smooth.is_some() && !cal.has_key_std() {
            return Err(Error::Calibration(format!(
                "method {} smooths the keys; the calibration has no key_std (rotkv calibrate --methods smooth)",
                method.name
            )));
        }
        check_measured(method, cal)?;
        for l in 0..c.layers {
            cache.set_calibration(l, cal.layer(l, method.calib))?;
        }
    }
    Ok(cache)
}

/// An error where `method` uses the measured smoothing (`-m`, the recipe) and `cal` has
/// no choice for its key bits.
fn check_measured(method: &KvMethod, cal: &calibrate::Calibration) -> Result<()> {
    match method.calib.smooth {
        Some(calibrate::Smooth::Measured(bits)) if !cal.has_smoothing_choice(bits) => Err(Error::Calibration(format!(
            "method {} uses the smoothing measured for {bits}-bit keys; the calibration has none (written by an \
                 older rotkv calibrate, without `smooth`, or from too few tokens): run rotkv calibrate again",
            method.name
        ))),
        _ => Ok(()),
    }
}

/// Greedy continuation of `prompt` for `steps` tokens through a rotkv cache with
/// `config`: the prompt is a prefill (exact attention among its tokens, then appended
/// to the cache), every new token a decode step (append, then decode from the cache).
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    steps: usize,
    config: CacheConfig,
    backend: Backend,
) -> Result<Vec<u32>> {
    let c = &model.config;
    if prompt.is_empty() {
        return Err(Error::Shape("empty prompt".into()));
    }
    let shape = CacheShape {
        layers: c.layers,
        num_kv_heads: c.kv_heads,
        num_q_heads: c.heads,
        max_seqs: 1,
        max_tokens: prompt.len().checked_add(steps).ok_or_else(|| {
            Error::Capacity(format!("{} prompt tokens and {steps} steps: too many tokens to count", prompt.len()))
        })?,
        num_blocks: None,
    };
    generate_in(model, KvCache::new(config, shape, backend)?, prompt, &[], steps)
}

/// Greedy continuation in `cache` (one layer per model layer, empty): `prefill` runs as
/// an exact-attention prefill appended to the cache, then each token of `fed` and each
/// of the `steps` new tokens is a decode step through the cache (so the first new token
/// already reads the quantized prefill when `fed` is not empty).
pub(crate) fn generate_in(
    model: &Llama,
    mut cache: KvCache,
    prefill: &[u32],
    fed: &[u32],
    steps: usize,
) -> Result<Vec<u32>> {
    let c = &model.config;
    if prefill.is_empty() {
        return Err(Error::Shape("empty prompt".into()));
    }
    let id = cache.add_sequence()?;
    let mut attn = CacheAttention::new(c, vec![cache], vec![(0, id)])?;
    let rows: Vec<Row> = (0..prefill.len()).map(|p| Row { seq: 0, pos: p }).collect();
    let hidden = model.forward(prefill, &rows, &mut attn, None, c.layers)?;
    let mut last = hidden[(prefill.len() - 1) * c.dim..].to_vec();
    let mut pos = prefill.len();
    for &t in fed {
        last = model.forward(&[t], &[Row { seq: 0, pos }], &mut attn, None, c.layers)?;
        pos += 1;
    }
    let mut out = Vec::new();
    for s in 0..steps {
        let logits = model.logits(&last);
        let next =
            logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
        out.push(next.0 as u32);
        if s + 1 == steps {
            break;
        }
        last = model.forward(&[next.0 as u32], &[Row { seq: 0, pos }], &mut attn, None, c.layers)?;
        pos += 1;
    }
    Ok(out)
}

/// Captured activations of some layers: per layer, q post-RoPE `[T][heads][D]`, k
/// post-RoPE, v and k before RoPE `[T][kv_heads][D]`, all f32, in Hugging Face channel
/// order.
#[derive(Clone, Debug, Default)]
pub struct Capture {
    /// `layer{L}.{q,k,v,k_pre_rope}` -> (shape, values).
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

/// Runs `tokens` as one exact-attention prefill and keeps q, k, v and pre-RoPE k of
/// `layers` (layers past the last one asked for are not run).
pub fn capture(model: &Llama, tokens: &[u32], layers: &[usize]) -> Result<Capture> {
    let c = &model.config;
    if let Some(&l) = layers.iter().find(|&&l| l >= c.layers) {
        return Err(Error::Layer { layer: l, layers: c.layers });
    }
    let rows: Vec<Row> = (0..tokens.len()).map(|p| Row { seq: 0, pos: p }).collect();
    let mut cap = Capture::default();
    let t = tokens.len();
    let mut keep = |a: &LayerActivations<'_>| {
        if layers.contains(&a.layer) {
            let l = a.layer;
            for (name, x, heads) in [
                ("q", a.q, c.heads),
                ("k", a.k, c.kv_heads),
                ("v", a.v, c.kv_heads),
                ("k_pre_rope", a.k_pre, c.kv_heads),
            ] {
                cap.tensors.insert(format!("layer{l}.{name}"), (vec![t, heads, c.head_dim], x.to_vec()));
            }
        }
    };
    let last = layers.iter().max().map_or(0, |&l| l + 1);
    let mut attn = ExactAttention::new(c);
    model.forward(tokens, &rows, &mut attn, Some(&mut keep), last)?;
    Ok(cap)
}

impl Capture {
    /// The safetensors bytes (f16 tensors) with `metadata`.
    pub fn to_safetensors(&self, metadata: BTreeMap<String, String>) -> Result<Vec<u8>> {
        use safetensors::tensor::{Dtype, TensorView};
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = self
            .tensors
            .iter()
            .map(|(k, (shape, x))| {
                let b = x.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
                (k.clone(), shape.clone(), b)
            })
            .collect();
        let views = bytes
            .iter()
            .map(|(k, s, b)| {
                TensorView::new(Dtype::F16, s.clone(), b)
                    .map(|v| (k.clone(), v))
                    .map_err(|e| Error::Input(format!("tensor {k}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta: std::collections::HashMap<String, String> = metadata.into_iter().collect();
        safetensors::serialize(views, Some(meta)).map_err(|e| Error::Input(format!("safetensors: {e}")))
    }
}
