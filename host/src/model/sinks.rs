//! Sink detection at prefill: which positions beyond the fixed leading sinks a model
//! treats as attention sinks, so that a cache keeps their keys and values in f16
//! ([`crate::KvCache::protect`]). Three detectors, each ranking the prefill's positions
//! per layer:
//!
//! - [`Detector::Attention`]: the mean attention a position receives from the prefill's
//!   queries at least [`ATTENTION_LAG`] positions later, summed over query heads (what
//!   sink protection is for; it needs the prefill's attention probabilities, which an
//!   exact prefill has);
//! - [`Detector::KeyNorm`]: the norm of the position's post-RoPE keys, summed over KV
//!   heads (available to a cache at append, with no attention at all);
//! - [`Detector::Hidden`]: the norm of the residual stream entering the layer (massive
//!   activations, as RotateKV detects sinks).

use super::llama::{ExactAttention, LayerActivations, Llama, Row};
use crate::error::{Error, Result};

/// How [`detect`] ranks positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detector {
    /// Mean attention received from later queries of the prefill.
    Attention,
    /// Post-RoPE key norm.
    KeyNorm,
    /// Norm of the layer's input hidden state.
    Hidden,
}

/// [`Detector::Attention`] averages over queries at least this many positions after the
/// key (a query's attention to its own recent neighbours says nothing about sinks).
pub const ATTENTION_LAG: usize = 16;

/// Per layer, the `k` positions in `skip..tokens.len()` that `how` ranks highest (ties to
/// the earlier position), ascending, from an exact-attention forward pass over `tokens`.
/// With [`Detector::Attention`] only positions with a query [`ATTENTION_LAG`] positions
/// later are ranked.
pub fn detect(model: &Llama, tokens: &[u32], k: usize, skip: usize, how: Detector) -> Result<Vec<Vec<u32>>> {
    let c = &model.config;
    let n = tokens.len();
    let last = if how == Detector::Attention { n.saturating_sub(ATTENTION_LAG) } else { n };
    if last <= skip || last - skip < k {
        return Err(Error::Shape(format!(
            "{n} prefill tokens leave {} positions after the first {skip} to pick {k} sinks from",
            last.saturating_sub(skip)
        )));
    }
    let (d, hq, hkv) = (c.head_dim, c.heads, c.kv_heads);
    let mut scores: Vec<Vec<f64>> = vec![vec![0.0; n]; c.layers];
    let mut keep = |a: &LayerActivations<'_>| {
        let s = &mut scores[a.layer];
        match how {
            Detector::KeyNorm => {
                for (p, row) in a.k.chunks_exact(hkv * d).enumerate() {
                    s[p] = row.chunks_exact(d).map(norm).sum();
                }
            }
            Detector::Hidden => {
                for (p, row) in a.hidden.chunks_exact(c.dim).enumerate() {
                    s[p] = norm(row);
                }
            }
            Detector::Attention => {
                let scale = c.attn_scale as f64;
                let mut probs = vec![0f64; n];
                for h in 0..hq {
                    let kvh = h / (hq / hkv);
                    for t in ATTENTION_LAG..n {
                        let q = &a.q[(t * hq + h) * d..][..d];
                        for (i, p) in probs[..=t].iter_mut().enumerate() {
                            let key = &a.k[(i * hkv + kvh) * d..][..d];
                            *p = scale * q.iter().zip(key).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>();
                        }
                        let m = probs[..=t].iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let sum: f64 = probs[..=t]
                            .iter_mut()
                            .map(|p| {
                                *p = (*p - m).exp();
                                *p
                            })
                            .sum();
                        // Key i is seen by the n - (i + LAG) queries t >= i + LAG.
                        for (i, p) in probs[..=t - ATTENTION_LAG].iter().enumerate() {
                            s[i] += p / sum / (n - i - ATTENTION_LAG) as f64;
                        }
                    }
                }
            }
        }
    };
    let rows: Vec<Row> = (0..n).map(|p| Row { seq: 0, pos: p }).collect();
    model.forward(tokens, &rows, &mut ExactAttention::new(c), Some(&mut keep), c.layers)?;
    Ok(scores.iter().map(|s| top(&s[skip..last], k).into_iter().map(|i| (i + skip) as u32).collect()).collect())
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt()
}

/// Indices of the `k` largest scores (ties to the lower index), ascending.
fn top(scores: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut picked = order[..k.min(order.len())].to_vec();
    picked.sort_unstable();
    picked
}

#[cfg(test)]
mod tests {
    use super::top;

    #[test]
    fn top_picks_the_largest_in_order() {
        assert_eq!(top(&[0.1, 5.0, 0.3, 5.0, 2.0], 3), vec![1, 3, 4]);
        assert_eq!(top(&[1.0, 1.0, 1.0], 2), vec![0, 1]);
        assert_eq!(top(&[1.0], 0), Vec::<usize>::new());
    }
}
