//! The byte-level BPE tokenizer of GGUF files with `tokenizer.ggml.model = gpt2`, built
//! from the file's vocabulary and merges.
//!
//! Pre-tokenization follows the file's `tokenizer.ggml.pre`: every numeric character is
//! its own piece for `smollm` (and the other pre-tokenizers llama.cpp runs that way:
//! `starcoder`, `refact`, `command-r`, ...), then the GPT-2 pattern
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, which `gpt-2`
//! uses alone. Other pre-tokenizers (`qwen2`, `llama-bpe`: different patterns) are
//! [`Error::Unsupported`]. Text is encoded as plain text: control tokens such as
//! `<|im_start|>` written in the text are not recognized (the perplexity and capture
//! harnesses feed plain files).

use super::gguf::Gguf;
use crate::error::{Error, Result};
use std::collections::HashMap;

/// How digits are split before the GPT-2 pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Digits {
    /// Every numeric character is a piece of its own.
    Single,
    /// Digits are left to the GPT-2 pattern.
    Pattern,
}

/// A byte-level BPE tokenizer.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    vocab: HashMap<String, u32>,
    tokens: Vec<String>,
    /// Merge rank by left part, then right part (looked up without allocating).
    ranks: HashMap<String, HashMap<String, u32>>,
    byte_char: [char; 256],
    char_byte: HashMap<char, u8>,
    digits: Digits,
    /// The beginning-of-sequence token, if the file names one.
    pub bos: Option<u32>,
    /// The end-of-sequence token, if the file names one.
    pub eos: Option<u32>,
    /// The token of bytes the vocabulary lacks, if the file names one.
    pub unk: Option<u32>,
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

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let model = g.get("tokenizer.ggml.model")?.as_str().unwrap_or("");
        if model != "gpt2" {
            return Err(Error::Unsupported(format!("tokenizer model {model:?} (byte-level BPE, gpt2, is read)")));
        }
        let pre = g.metadata.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
        // The pre-tokenizers llama.cpp runs as the GPT-2 pattern, with or without every
        // digit split off first. Others (qwen2, llama-bpe, ...) use other patterns.
        let digits = match pre {
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => Digits::Single,
            "gpt-2" | "gpt2" | "default" | "phi-2" => Digits::Pattern,
            other => {
                return Err(Error::Unsupported(format!(
                    "pre-tokenizer {other:?} (supported: the GPT-2 pattern, alone or after single digits: gpt-2, smollm, starcoder, ...)"
                )));
            }
        };
        let tokens: Vec<String> = g.get_strings("tokenizer.ggml.tokens")?.into_iter().map(String::from).collect();
        let merges = g.get_strings("tokenizer.ggml.merges")?;
        let id = |key: &str| g.metadata.get(key).and_then(|v| v.as_u64()).map(|v| v as u32);
        let ids = ["bos", "eos", "unknown"].map(|t| id(&format!("tokenizer.ggml.{t}_token_id")));
        Self::new(tokens, &merges, digits, ids)
    }

    /// Builds a tokenizer from byte-level token strings and merges (`"left right"`).
    /// Bytes whose token is missing from the vocabulary become `unk` (or are dropped
    /// when there is none).
    pub fn new(
        tokens: Vec<String>,
        merges: &[&str],
        digits: Digits,
        [bos, eos, unk]: [Option<u32>; 3],
    ) -> Result<Self> {
        let vocab: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut ranks: HashMap<String, HashMap<String, u32>> = HashMap::new();
        for (rank, m) in merges.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| Error::Input(format!("merge {m:?} has no space")))?;
            ranks.entry(a.to_string()).or_default().entry(b.to_string()).or_insert(rank as u32);
        }
        let byte_char = byte_chars();
        let char_byte = byte_char.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        Ok(Self { vocab, tokens, ranks, byte_char, char_byte, digits, bos, eos, unk })
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Token ids of `text` (no BOS added).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut cache: HashMap<&str, Vec<u32>> = HashMap::new();
        for piece in self.pieces(text) {
            if let Some(ids) = cache.get(piece) {
                out.extend_from_slice(ids);
                continue;
            }
            let ids = self.bpe(piece);
            out.extend_from_slice(&ids);
            cache.insert(piece, ids);
        }
        out
    }

    /// The text of token ids (bytes that are not UTF-8 become U+FFFD); unknown ids are
    /// skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(t) = self.tokens.get(id as usize) {
                match t.chars().map(|c| self.char_byte.get(&c).copied()).collect::<Option<Vec<u8>>>() {
                    Some(b) => bytes.extend(b),
                    // Control tokens (`<|im_start|>`) are written as they are.
                    None => bytes.extend_from_slice(t.as_bytes()),
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Byte-pair merges of one pre-token: the pair of lowest rank first, the leftmost of
    /// equal ranks first (as Hugging Face's `tokenizers` and llama.cpp merge), with a
    /// heap of candidate pairs over a linked list of parts: `O(n log n)` in the piece's
    /// length (a 64 KB word is milliseconds, not seconds).
    fn bpe(&self, piece: &str) -> Vec<u32> {
        use std::cmp::Reverse;
        let mut parts: Vec<String> = piece.bytes().map(|b| self.byte_char[b as usize].to_string()).collect();
        let n = parts.len();
        let rank = |a: &str, b: &str| self.ranks.get(a).and_then(|m| m.get(b)).copied();
        // Part `i` is followed by `next[i]` (`n`: none) and preceded by `prev[i]`
        // (`usize::MAX`: none); merged-away parts are dead.
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = std::collections::BinaryHeap::new();
        for i in 1..n {
            if let Some(r) = rank(&parts[i - 1], &parts[i]) {
                heap.push(Reverse((r, i - 1, i)));
            }
        }
        while let Some(Reverse((r, i, j))) = heap.pop() {
            // Stale when either part merged since the pair was pushed.
            if !alive[i] || next[i] != j || !alive[j] || rank(&parts[i], &parts[j]) != Some(r) {
                continue;
            }
            let right = std::mem::take(&mut parts[j]);
            parts[i].push_str(&right);
            alive[j] = false;
            next[i] = next[j];
            if next[i] < n {
                prev[next[i]] = i;
            }
            if prev[i] != usize::MAX
                && let Some(r) = rank(&parts[prev[i]], &parts[i])
            {
                heap.push(Reverse((r, prev[i], i)));
            }
            if next[i] < n
                && let Some(r) = rank(&parts[i], &parts[next[i]])
            {
                heap.push(Reverse((r, i, next[i])));
            }
        }
        let parts: Vec<String> = parts.into_iter().zip(alive).filter_map(|(p, a)| a.then_some(p)).collect();
        // A part missing from the vocabulary falls back to its bytes, and a byte missing
        // too to the unknown token.
        parts
            .iter()
            .flat_map(|p| match self.vocab.get(p) {
                Some(&id) => vec![id],
                None => p.chars().filter_map(|c| self.vocab.get(&c.to_string()).copied().or(self.unk)).collect(),
            })
            .collect()
    }

    /// Splits text into pre-tokens: digits first (as `self.digits` says), then the GPT-2
    /// pattern on the rest.
    fn pieces<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut out = Vec::new();
        let mut rest_start = 0;
        let idx: Vec<(usize, char)> = text.char_indices().collect();
        let mut i = 0;
        while i < idx.len() {
            let (at, c) = idx[i];
            if self.digits == Digits::Single && c.is_numeric() {
                let j = i + 1;
                gpt2_split(&text[rest_start..at], &mut out);
                let end = idx.get(j).map_or(text.len(), |x| x.0);
                out.push(&text[at..end]);
                rest_start = end;
                i = j;
            } else {
                i += 1;
            }
        }
        gpt2_split(&text[rest_start..], &mut out);
        out
    }
}

/// The GPT-2 pre-tokenizer pattern
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, with
/// `char::is_alphabetic` for `\p{L}` and `char::is_numeric` for `\p{N}`.
fn gpt2_split<'a>(s: &'a str, out: &mut Vec<&'a str>) {
    let c: Vec<(usize, char)> = s.char_indices().collect();
    let end_of = |j: usize| c.get(j).map_or(s.len(), |x| x.0);
    let letter = |ch: char| ch.is_alphabetic();
    let number = |ch: char| ch.is_numeric();
    let other = |ch: char| !ch.is_whitespace() && !ch.is_alphabetic() && !ch.is_numeric();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i].1;
        let next = c.get(i + 1).map(|x| x.1);
        // Contractions.
        if ch == '\'' {
            let rest = &s[c[i].0..];
            if let Some(len) = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
                .iter()
                .find(|p| rest.starts_with(**p))
                .map(|p| p.chars().count())
            {
                out.push(&s[c[i].0..end_of(i + len)]);
                i += len;
                continue;
            }
        }
        // An optional space, then a run of one class.
        let (start, class) = if ch == ' ' { (i + 1, next) } else { (i, Some(ch)) };
        let run = |pred: &dyn Fn(char) -> bool| {
            let mut j = start;
            while j < c.len() && pred(c[j].1) {
                j += 1;
            }
            j
        };
        if let Some(first) = class {
            let j = if letter(first) {
                run(&letter)
            } else if number(first) {
                run(&number)
            } else if other(first) {
                run(&other)
            } else {
                start
            };
            if j > start {
                out.push(&s[c[i].0..end_of(j)]);
                i = j;
                continue;
            }
        }
        // Whitespace: the run, less its last character when a non-space follows and the
        // run is longer than one.
        let mut j = i;
        while j < c.len() && c[j].1.is_whitespace() {
            j += 1;
        }
        let j = if j < c.len() && j - i > 1 { j - 1 } else { j.max(i + 1) };
        out.push(&s[c[i].0..end_of(j)]);
        i = j;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        let mut v = Vec::new();
        gpt2_split(s, &mut v);
        v
    }

    #[test]
    fn gpt2_pattern() {
        assert_eq!(split("Hello world"), ["Hello", " world"]);
        assert_eq!(split("it's  fine!\n\nOK"), ["it", "'s", " ", " fine", "!", "\n", "\n", "OK"]);
        assert_eq!(split("a  \n"), ["a", "  \n"]);
        assert_eq!(split("x ;; 'ab"), ["x", " ;;", " '", "ab"]);
        assert_eq!(split("'sun"), ["'s", "un"]);
    }
}
