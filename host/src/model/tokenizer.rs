//! The tokenizer of a GGUF file, built with Hugging Face's `tokenizers` crate from the
//! file's vocabulary, merges, token types and pre-tokenizer name, the way llama.cpp
//! tokenizes the same file.
//!
//! - `tokenizer.ggml.model = gpt2` (byte-level BPE): a BPE model over the file's
//!   byte-level token strings and merges, split first by the pre-tokenizer that
//!   `tokenizer.ggml.pre` names ([`Pre`]: llama.cpp's regexes for that name, as
//!   `tokenizers` pre-tokenizers), then byte-level mapped; decoded by the byte-level
//!   decoder. llama-3's pre-tokenizers also take a whole pre-token that is in the
//!   vocabulary as one token before merging (`ignore_merges`, as llama.cpp and the
//!   model's `tokenizer.json` do).
//! - `tokenizer.ggml.model = llama` (SentencePiece BPE, Llama 1/2, Mistral): a BPE model
//!   whose merges are derived from the tokens' scores (a pair merges with the rank of
//!   its merged token's score, highest first: llama.cpp's SentencePiece merge order, and
//!   transformers' conversion), bytes missing from the vocabulary as `<0xNN>` byte
//!   tokens, spaces as `▁` and a `▁` in front when `tokenizer.ggml.add_space_prefix`
//!   (default on) says so.
//!
//! Control tokens (type 3, `<|im_start|>`) are never recognized in text: text is encoded
//! as plain text (as llama.cpp does without `parse_special`, and as the perplexity and
//! capture harnesses want); user-defined tokens (type 4) are. Unicode normalization is
//! not applied (llama.cpp does none; a Qwen2 `tokenizer.json` asks for NFC, which changes
//! nothing on ASCII text).
//!
//! `tokenizers` is built without default features: the `fancy-regex` backend (pure
//! Rust) instead of the onig C library, no esaxx C++ build, no progress bars or hub
//! downloads. candle-core 0.11 depends on it with the same features, so a build with the
//! `candle` feature compiles it once for both.

use super::gguf::Gguf;
use crate::error::{Error, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// llama.cpp's llama-3 pattern (`LLAMA_VOCAB_PRE_TYPE_LLAMA3`): case-insensitive
/// contractions, a letter run with one leading non-letter, digits in runs of up to three.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's Qwen2 pattern (`LLAMA_VOCAB_PRE_TYPE_QWEN2`): llama-3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's patterns for a byte-level BPE file whose pre-tokenizer is `default`,
/// applied one after the other.
const DEFAULT: [&str; 4] = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// How a byte-level BPE file's text is split before merging (`tokenizer.ggml.pre`, the
/// names llama.cpp knows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pre {
    /// The GPT-2 pattern (`gpt-2`, `phi-2`, `mpt`, `olmo`, `jais`, ...).
    Gpt2,
    /// Every numeric character a piece of its own, then the GPT-2 pattern (`smollm`,
    /// `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`, `minerva-7b`).
    SingleDigits,
    /// The llama-3 pattern, whole in-vocabulary pre-tokens first (`llama-bpe`, `llama3`,
    /// `llama-v3`, `falcon3`, `pixtral`).
    Llama3,
    /// The llama-3 pattern with merges only (`dbrx`, `smaug-bpe`).
    Llama3Merges,
    /// The Qwen2 pattern (`qwen2`, `deepseek-r1-qwen`, `stablelm2`, `megrez`).
    Qwen2,
    /// llama.cpp's four default patterns (`default` or no name).
    Default,
}

impl Pre {
    /// The pre-tokenizer of a `tokenizer.ggml.pre` name.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "jina-es" | "jina-de" | "jina-v2-es"
            | "jina-v2-de" | "jina-v2-code" | "gigachat" | "roberta-bpe" => Pre::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
                Pre::SingleDigits
            }
            "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "pixtral" => Pre::Llama3,
            "dbrx" | "smaug-bpe" => Pre::Llama3Merges,
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => Pre::Qwen2,
            "default" | "" => Pre::Default,
            other => {
                return Err(Error::Unsupported(format!(
                    "pre-tokenizer {other:?} (supported: gpt-2, smollm, starcoder, llama-bpe, qwen2, \
                     deepseek-r1-qwen, dbrx, default and their aliases)"
                )));
            }
        })
    }

    /// llama.cpp's default for `tokenizer.ggml.add_bos_token` when the file does not say:
    /// on for llama-3's pre-tokenizers, off for the other byte-level ones.
    pub fn adds_bos(self) -> bool {
        self == Pre::Llama3
    }

    fn wrapper(self) -> Result<PreTokenizerWrapper> {
        let split = |p: &str| -> Result<PreTokenizerWrapper> {
            Split::new(SplitPattern::Regex(p.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map(Into::into)
                .map_err(|e| Error::Input(format!("pre-tokenizer pattern {p:?}: {e}")))
        };
        let bytes = |regex: bool| PreTokenizerWrapper::from(ByteLevel::new(false, false, regex));
        let mut steps = match self {
            // ByteLevel's own pattern is GPT-2's:
            // `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
            Pre::Gpt2 => return Ok(bytes(true)),
            Pre::SingleDigits => return Ok(Sequence::new(vec![Digits::new(true).into(), bytes(true)]).into()),
            Pre::Llama3 | Pre::Llama3Merges => vec![split(LLAMA3)?],
            Pre::Qwen2 => vec![split(QWEN2)?],
            Pre::Default => DEFAULT.iter().map(|p| split(p)).collect::<Result<Vec<_>>>()?,
        };
        steps.push(bytes(false));
        Ok(Sequence::new(steps).into())
    }
}

/// How a tokenizer's text becomes pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Byte-level BPE (`tokenizer.ggml.model = gpt2`) with its pre-tokenizer.
    ByteLevel(Pre),
    /// SentencePiece BPE (`tokenizer.ggml.model = llama`); `true`: a `▁` is put in front
    /// of the text.
    SentencePiece(bool),
}

/// The most bytes of token text a SentencePiece vocabulary of `vocab_bytes` bytes may
/// cost to derive its merges ([`Tokenizer::setup_bytes`]): 8 per vocabulary byte plus 64
/// MiB, so setup is linear in the vocabulary's size. It bounds both the hashing and the
/// merges' text kept until the BPE model is built; the merge entries themselves number
/// at most one per character of the vocabulary. Real vocabularies stay far below it
/// (a 256k-token vocabulary of tokens up to 100 bytes looks up a few MB); a vocabulary
/// past it is refused with [`Error::Input`].
pub const fn sentencepiece_merge_budget(vocab_bytes: usize) -> usize {
    vocab_bytes.saturating_mul(8).saturating_add(64 << 20)
}

/// GGUF token types (`tokenizer.ggml.token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// A GGUF file's tokenizer.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab: usize,
    merges: usize,
    setup_bytes: usize,
    /// What kind of tokenizer it is.
    pub kind: Kind,
    /// The beginning-of-sequence token, if the file names one.
    pub bos: Option<u32>,
    /// The end-of-sequence token, if the file names one.
    pub eos: Option<u32>,
    /// The token of bytes the vocabulary lacks, if the file names one.
    pub unk: Option<u32>,
    /// Whether a sequence starts with [`Tokenizer::bos`] (`tokenizer.ggml.add_bos_token`,
    /// else llama.cpp's default for the tokenizer: on for SentencePiece and llama-3, off
    /// for other byte-level BPE files). [`Tokenizer::encode`] never adds it: callers that
    /// start a sequence do ([`Tokenizer::bos_prefix`]).
    pub add_bos: bool,
}

/// GPT-2's reversible map from bytes to printable characters.
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        *slot = if printable {
            char::from_u32(b as u32).expect("latin-1")
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("valid")
        };
    }
    out
}

fn lib_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Input(format!("tokenizer: {what}: {e}"))
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let model = g.get("tokenizer.ggml.model")?.as_str().unwrap_or("");
        if model != "gpt2" && model != "llama" {
            return Err(Error::Unsupported(format!(
                "tokenizer model {model:?} (read: gpt2, byte-level BPE; llama, SentencePiece BPE)"
            )));
        }
        let flag = |key: &str| match g.metadata.get(key) {
            Some(super::gguf::Value::Bool(b)) => Some(*b),
            _ => None,
        };
        let tokens: Vec<String> = g.get_strings("tokenizer.ggml.tokens")?.into_iter().map(String::from).collect();
        let types: Vec<i64> = match g.metadata.get("tokenizer.ggml.token_type") {
            Some(super::gguf::Value::Array(a)) => a
                .iter()
                .map(|v| match *v {
                    super::gguf::Value::I64(x) => Ok(x),
                    super::gguf::Value::U64(x) => Ok(x as i64),
                    _ => Err(Error::Input("tokenizer.ggml.token_type holds a non-integer".into())),
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(Error::Input("tokenizer.ggml.token_type is not an array".into())),
            None => Vec::new(),
        };
        let id = |key: &str| g.metadata.get(key).and_then(|v| v.as_u64()).map(|v| v as u32);
        let ids = ["bos", "eos", "unknown"].map(|t| id(&format!("tokenizer.ggml.{t}_token_id")));
        let mut tok = match model {
            "gpt2" => {
                let pre = g.metadata.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
                let pre = Pre::from_name(pre)?;
                let merges = g.get_strings("tokenizer.ggml.merges")?;
                Self::new(tokens, &merges, pre, ids)?
            }
            // "llama", checked above.
            _ => {
                let scores: Vec<f64> = match g.metadata.get("tokenizer.ggml.scores") {
                    Some(super::gguf::Value::Array(a)) => a
                        .iter()
                        .map(|v| v.as_f64().ok_or_else(|| Error::Input("tokenizer.ggml.scores: not a number".into())))
                        .collect::<Result<_>>()?,
                    _ => return Err(Error::Input("SentencePiece tokenizer without tokenizer.ggml.scores".into())),
                };
                let prefix = flag("tokenizer.ggml.add_space_prefix").unwrap_or(true);
                Self::sentencepiece(tokens, &scores, &types, prefix, ids)?
            }
        };
        tok.add_typed_tokens(&types)?;
        if let Some(b) = flag("tokenizer.ggml.add_bos_token") {
            tok.add_bos = b;
        }
        if tok.add_bos && tok.bos.is_none_or(|b| b as usize >= tok.vocab) {
            return Err(Error::Input(
                "sequences start with a BOS token (tokenizer.ggml.add_bos_token, or llama.cpp's default for this \
                 tokenizer) and the file names none in the vocabulary (tokenizer.ggml.bos_token_id)"
                    .into(),
            ));
        }
        Ok(tok)
    }

    /// A byte-level BPE tokenizer from byte-level token strings, merges (`"left right"`)
    /// and a pre-tokenizer; `[bos, eos, unk]` ids. Bytes whose token is missing from the
    /// vocabulary become `unk` (or are dropped when there is none).
    pub fn new(tokens: Vec<String>, merges: &[&str], pre: Pre, [bos, eos, unk]: [Option<u32>; 3]) -> Result<Self> {
        let vocab_len = tokens.len();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Input(format!("merge {m:?} has no space")))
            })
            .collect::<Result<Vec<_>>>()?;
        let unk_text = unk.and_then(|u| tokens.get(u as usize).cloned());
        let (merge_count, setup_bytes) = (merges.len(), merges.iter().map(|(a, b)| a.len() + b.len()).sum());
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.into_iter().enumerate().map(|(i, t)| (t, i as u32)).collect();
        let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).ignore_merges(pre == Pre::Llama3);
        if let Some(u) = unk_text {
            bpe = bpe.unk_token(u);
        }
        let bpe = bpe.build().map_err(|e| lib_err("BPE model", e))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre.wrapper()?));
        inner.with_decoder(Some(ByteLevel::default()));
        Ok(Self {
            inner,
            vocab: vocab_len,
            merges: merge_count,
            setup_bytes,
            kind: Kind::ByteLevel(pre),
            bos,
            eos,
            unk,
            add_bos: pre.adds_bos(),
        })
    }

    /// A SentencePiece BPE tokenizer from its tokens, their scores and types (`<0xNN>`
    /// byte tokens for bytes the vocabulary lacks). A pair merges with the rank of the
    /// merged token's score, highest first, ties in id order of the merged token and then
    /// of the left part.
    pub fn sentencepiece(
        tokens: Vec<String>,
        scores: &[f64],
        types: &[i64],
        space_prefix: bool,
        [bos, eos, unk]: [Option<u32>; 3],
    ) -> Result<Self> {
        if scores.len() != tokens.len() {
            return Err(Error::Input(format!("{} tokens and {} scores", tokens.len(), scores.len())));
        }
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        // Merges: every split of a normal token into two tokens of the vocabulary. A split
        // is looked up only where both halves have the byte length of some token (a set
        // of at most `longest + 1` flags), so a very long token costs one pass over its
        // characters, not a hash of every prefix. Each looked-up split costs the token's
        // bytes (hashing both halves, and the merge's text if kept), charged against
        // [`sentencepiece_merge_budget`]: a vocabulary of nested tokens (`a`, `aa`, `aaa`,
        // ...: cubic in its length) is refused instead of taking gigabytes.
        let vocab_bytes: usize = tokens.iter().map(String::len).sum();
        let budget = sentencepiece_merge_budget(vocab_bytes);
        let longest = tokens.iter().map(String::len).max().unwrap_or(0);
        let mut is_len = vec![false; longest + 1];
        for t in &tokens {
            is_len[t.len()] = true;
        }
        let mut work = 0usize;
        let mut found: Vec<(f64, u32, u32, String, String)> = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            if types.get(i).is_some_and(|&ty| ty != 1) {
                continue;
            }
            for (at, _) in t.char_indices().skip(1) {
                if !(is_len[at] && is_len[t.len() - at]) {
                    continue;
                }
                work += t.len();
                if work > budget {
                    return Err(Error::Input(format!(
                        "SentencePiece vocabulary of {} tokens ({vocab_bytes} bytes): its merges need more than \
                         {budget} bytes of token text (8 per vocabulary byte plus 64 MiB), past the setup bound \
                         (nested tokens such as a, aa, aaa, ... grow it with the cube of their length)",
                        tokens.len()
                    )));
                }
                let (a, b) = t.split_at(at);
                if let (Some(&ia), Some(_)) = (vocab.get(a), vocab.get(b)) {
                    found.push((scores[i], i as u32, ia, a.to_string(), b.to_string()));
                }
            }
        }
        found.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        let merge_count = found.len();
        let merges = found.into_iter().map(|(_, _, _, a, b)| (a, b)).collect();
        let unk_text = unk.and_then(|u| tokens.get(u as usize).cloned());
        let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
        if let Some(u) = unk_text {
            bpe = bpe.unk_token(u);
        }
        let bpe = bpe.build().map_err(|e| lib_err("BPE model", e))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let replace = Replace::new(" ", "▁").map_err(|e| lib_err("normalizer", e))?;
        let normalizer: tokenizers::NormalizerWrapper = if space_prefix {
            NormalizerSequence::new(vec![Prepend::new("▁".into()).into(), replace.into()]).into()
        } else {
            replace.into()
        };
        inner.with_normalizer(Some(normalizer)).map_err(|e| lib_err("normalizer", e))?;
        let mut decoders = vec![
            tokenizers::decoders::DecoderWrapper::from(Replace::new("▁", " ").map_err(|e| lib_err("decoder", e))?),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if space_prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        inner.with_decoder(Some(DecoderSequence::new(decoders)));
        let vocab = tokens.len();
        Ok(Self {
            inner,
            vocab,
            merges: merge_count,
            setup_bytes: work,
            kind: Kind::SentencePiece(space_prefix),
            bos,
            eos,
            unk,
            add_bos: true,
        })
    }

    /// Control tokens become special tokens, never matched in text (plain-text
    /// encoding); user-defined tokens are matched (as their text: byte-level tokens are
    /// mapped back to their bytes).
    fn add_typed_tokens(&mut self, types: &[i64]) -> Result<()> {
        let byte_of: std::collections::HashMap<char, u8> =
            byte_chars().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let mut added = Vec::new();
        for (i, &ty) in types.iter().enumerate() {
            let Some(text) = self.inner.id_to_token(i as u32) else { continue };
            match ty {
                TYPE_CONTROL => added.push(AddedToken::from(text, true)),
                TYPE_USER_DEFINED => {
                    let content = match self.kind {
                        Kind::ByteLevel(_) => {
                            match text.chars().map(|c| byte_of.get(&c).copied()).collect::<Option<Vec<u8>>>() {
                                Some(b) => String::from_utf8_lossy(&b).into_owned(),
                                None => text,
                            }
                        }
                        Kind::SentencePiece(_) => text.replace('▁', " "),
                    };
                    if !content.is_empty() {
                        added.push(AddedToken::from(content, false).normalized(false));
                    }
                }
                _ => {}
            }
        }
        // Control tokens are added as special tokens so that decoding knows them; they
        // are not recognized in text.
        let (special, user): (Vec<_>, Vec<_>) = added.into_iter().partition(|t| t.special);
        self.inner.add_special_tokens(special).map_err(|e| lib_err("control tokens", e))?;
        self.inner.add_tokens(user).map_err(|e| lib_err("user-defined tokens", e))?;
        self.inner.set_encode_special_tokens(true);
        Ok(())
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Number of merge rules of the BPE model (given for byte-level BPE, derived from
    /// the vocabulary for SentencePiece).
    pub fn merge_count(&self) -> usize {
        self.merges
    }

    /// Bytes of token text the setup went through to find the merges: the merges' own
    /// bytes for byte-level BPE; for SentencePiece, each split looked up charges its
    /// token's bytes, at most [`sentencepiece_merge_budget`] of the vocabulary's bytes.
    pub fn setup_bytes(&self) -> usize {
        self.setup_bytes
    }

    /// Token ids of `text` (no BOS added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let e = self.inner.encode_fast(text, false).map_err(|e| lib_err("encoding", e))?;
        Ok(e.get_ids().to_vec())
    }

    /// The pieces the pre-tokenizer cuts `text` into (each merged on its own); the whole
    /// text for SentencePiece.
    pub fn pre_tokens<'a>(&self, text: &'a str) -> Result<Vec<&'a str>> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut p = PreTokenizedString::from(text);
        if let Some(pt) = self.inner.get_pre_tokenizer() {
            pt.pre_tokenize(&mut p).map_err(|e| lib_err("pre-tokenizing", e))?;
        }
        let splits = p.get_splits(OffsetReferential::Original, OffsetType::Byte);
        splits
            .into_iter()
            .map(|(_, (a, b), _)| text.get(a..b).ok_or_else(|| lib_err("pre-tokenizing", "offsets")))
            .collect()
    }

    /// `[bos]` when sequences start with one ([`Tokenizer::add_bos`]), else empty.
    pub fn bos_prefix(&self) -> Vec<u32> {
        self.bos.filter(|_| self.add_bos).into_iter().collect()
    }

    /// The text of token ids (bytes that are not UTF-8 become U+FFFD); control tokens are
    /// written as they are, unknown ids skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| lib_err("decoding", e))
    }
}
