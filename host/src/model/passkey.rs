//! Passkey retrieval: can the model still find a number hidden in a long filler text
//! when it reads that text from a quantized cache?
//!
//! The prompt (the test of Mohtashami and Jaggi's landmark-attention paper, as long-
//! context work uses it): an instruction, a filler paragraph repeated up to the asked
//! length, the sentence "The pass key is N. Remember it. N is the pass key." inserted
//! at a depth (0% = right after the instruction, 100% = at the end of the filler), then
//! "What is the pass key? The pass key is". The instruction and filler (the haystack)
//! are an exact-attention prefill appended to the method's cache; the question tokens
//! and the answer are decode steps through the cache, so every token that must find the
//! number reads the haystack as the method stores it (sinks and the recent window in
//! f16, the rest quantized). The answer is the first run of digits in the greedy
//! continuation; it is correct when it equals N.

use super::llama::Llama;
use super::tokenizer::Tokenizer;
use super::{KvMethod, calibrate, generate_in, method_cache};
use crate::error::{Error, Result};
use crate::{Backend, CacheShape};

/// The instruction at the start of every prompt.
pub const INSTRUCTION: &str = "There is an important piece of information hidden inside a lot of irrelevant text. \
     Find it and memorize it. I will quiz you about the important information there.";
/// The filler paragraph, repeated.
pub const FILLER: &str = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
/// The question after the haystack.
pub const QUESTION: &str = "\nWhat is the pass key? The pass key is";
/// Greedy tokens generated for the answer (a five-digit number and some slack).
pub const ANSWER_TOKENS: usize = 8;

/// What [`passkey`] runs.
#[derive(Clone, Debug)]
pub struct PasskeyOptions {
    /// The cache backend.
    pub backend: Backend,
    /// The calibration for methods with `-c`, `-r`, `-l` or `-a`.
    pub calibration: Option<calibrate::Calibration>,
    /// Prompt length to aim for, in tokens (the filler is repeated while the whole
    /// prompt, question included, stays at most this long).
    pub tokens: usize,
    /// Needle depths in percent of the filler (0 to 100).
    pub depths: Vec<u32>,
    /// Keys (numbers) tried at each depth.
    pub trials: usize,
    /// Seed of the keys.
    pub seed: u64,
}

/// One prompt's outcome for one method.
#[derive(Clone, Debug, PartialEq)]
pub struct PasskeyResult {
    /// The method's name.
    pub method: String,
    /// The needle's depth in percent.
    pub depth: u32,
    /// The hidden number.
    pub key: u32,
    /// Prompt tokens (BOS, haystack and question).
    pub prompt_tokens: usize,
    /// The greedy continuation.
    pub answer: String,
    /// Whether the continuation's first number is the key.
    pub correct: bool,
}

/// A prompt: the prefilled haystack and the question fed through the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PasskeyPrompt {
    /// BOS (when the model asks for one), instruction and filler with the needle.
    pub haystack: Vec<u32>,
    /// [`QUESTION`]'s tokens.
    pub question: Vec<u32>,
}

/// The needle sentence for `key`.
pub fn needle(key: u32) -> String {
    format!(" The pass key is {key}. Remember it. {key} is the pass key.")
}

/// Builds the prompt for `key` at `depth` percent, at most `tokens` tokens long: as many
/// filler repetitions as fit, the needle after `round(depth * reps / 100)` of them.
pub fn prompt(tok: &Tokenizer, tokens: usize, depth: u32, key: u32) -> Result<PasskeyPrompt> {
    if depth > 100 {
        return Err(Error::Value(format!("passkey depth {depth}%: 0 to 100")));
    }
    let bos = tok.bos_prefix();
    let question = tok.encode(QUESTION)?;
    let fixed = bos.len() + tok.encode(INSTRUCTION)?.len() + tok.encode(&needle(key))?.len() + question.len();
    let per = tok.encode(FILLER)?.len().max(1);
    // Tokens of the concatenated text can differ from the sum of the parts' at the
    // seams; shrink until the real count fits.
    let mut reps = tokens.saturating_sub(fixed) / per;
    loop {
        if reps == 0 {
            return Err(Error::Shape(format!(
                "a passkey prompt of at most {tokens} tokens has no room for filler ({fixed} tokens without it)"
            )));
        }
        let at = (depth as usize * reps + 50) / 100;
        let text = format!("{INSTRUCTION}{}{}{}", FILLER.repeat(at), needle(key), FILLER.repeat(reps - at));
        let mut haystack = bos.clone();
        haystack.extend(tok.encode(&text)?);
        if haystack.len() + question.len() <= tokens {
            return Ok(PasskeyPrompt { haystack, question });
        }
        reps -= 1;
    }
}

/// The first run of ASCII digits in `text`, as a number (`None` without one, or past
/// `u32`).
pub fn first_number(text: &str) -> Option<u32> {
    let start = text.find(|c: char| c.is_ascii_digit())?;
    let digits: String = text[start..].chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// The keys of `trials` prompts: five-digit numbers from `seed` (splitmix64).
pub fn keys(seed: u64, trials: usize) -> Vec<u32> {
    let mut x = seed;
    (0..trials)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            10_000 + (z % 90_000) as u32
        })
        .collect()
}

/// Runs every (depth, key) prompt with every method. Methods with online centering
/// (`-o`) or detected sinks (`-d..`) are refused (they need a per-window prefill this
/// test does not model).
pub fn passkey(
    model: &Llama,
    tok: &Tokenizer,
    methods: &[KvMethod],
    opts: &PasskeyOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<PasskeyResult>> {
    if methods.is_empty() || opts.depths.is_empty() || opts.trials == 0 {
        return Err(Error::Value("passkey needs at least one method, one depth and one trial".into()));
    }
    if let Some(m) = methods.iter().find(|m| m.online.is_some() || m.detect.is_some()) {
        return Err(Error::Unsupported(format!(
            "method {}: online centering and detected sinks are not run by the passkey test",
            m.name
        )));
    }
    let c = &model.config;
    let keys = keys(opts.seed, opts.trials);
    let mut prompts = Vec::new();
    for &depth in &opts.depths {
        for &key in &keys {
            prompts.push((depth, key, prompt(tok, opts.tokens, depth, key)?));
        }
    }
    let total = prompts.len() * methods.len();
    let mut out = Vec::with_capacity(total);
    for (depth, key, p) in &prompts {
        let len = p.haystack.len() + p.question.len();
        let shape = CacheShape {
            layers: c.layers,
            num_kv_heads: c.kv_heads,
            num_q_heads: c.heads,
            max_seqs: 1,
            max_tokens: len + ANSWER_TOKENS,
            num_blocks: None,
        };
        for method in methods {
            let cache = method_cache(c, method, shape, opts.backend, opts.calibration.as_ref())?;
            let ids = generate_in(model, cache, &p.haystack, &p.question, ANSWER_TOKENS)?;
            let answer = tok.decode(&ids)?;
            out.push(PasskeyResult {
                method: method.name.clone(),
                depth: *depth,
                key: *key,
                prompt_tokens: len,
                correct: first_number(&answer) == Some(*key),
                answer,
            });
            progress(out.len(), total);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_number_takes_the_first_digit_run() {
        assert_eq!(first_number(" 68220. Remember"), Some(68220));
        assert_eq!(first_number("is 12 and 34"), Some(12));
        assert_eq!(first_number("no digits"), None);
        assert_eq!(first_number("99999999999"), None);
    }

    #[test]
    fn keys_are_five_digit_and_seeded() {
        let a = keys(7, 20);
        assert_eq!(a, keys(7, 20));
        assert_ne!(a, keys(8, 20));
        assert!(a.iter().all(|k| (10_000..100_000).contains(k)), "{a:?}");
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 15);
    }
}
