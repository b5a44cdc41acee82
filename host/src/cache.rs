//! [`KvCache`]: the paged cache a serving stack holds, one page pool per layer, block
//! tables shared by all layers of a sequence.

use crate::config::{CacheConfig, LayerCalibration};
use crate::error::{Error, Result};
use crate::paged::{self, DecodeOptions, LayerShape, try_zeroed};
use crate::reference::SeqRef;
use crate::{Backend, KvElement};
use half::f16;
use rotkv_kernels::layout::Format;

/// Sizes of a [`KvCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Query heads per layer (a multiple of `num_kv_heads`).
    pub num_q_heads: usize,
    /// Sequences that can be live at once.
    pub max_seqs: usize,
    /// Tokens one sequence may hold.
    pub max_tokens: usize,
    /// Physical blocks in each layer's pool; `None` gives every sequence room for
    /// `max_tokens` tokens.
    pub num_blocks: Option<usize>,
}

/// Identifies a live sequence of a [`KvCache`]: its slot, the slot's generation (which
/// grows each time the slot is reused) and the cache that made it. A freed id (even once
/// its slot is reused) and an id of another cache are [`Error::UnknownSequence`].
///
/// A `rotkv::device::DeviceLayer` (features `sim`, `cuda`) hands out ids of the same kind (slot, generation, the
/// layer's identity) and refuses stale and foreign ones the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqId {
    slot: usize,
    generation: u64,
    cache: u64,
}

impl SeqId {
    /// An id that names slot `slot` only (generation 0, no cache): no [`KvCache`] or
    /// `DeviceLayer` accepts it (their generations start at 1); for tests of refusals.
    pub const fn from_slot(slot: usize) -> Self {
        Self { slot, generation: 0, cache: 0 }
    }
    /// An id of generation `generation` of slot `slot` in the cache or layer `owner`.
    #[cfg(any(feature = "sim", feature = "cuda"))]
    pub(crate) const fn new(slot: usize, generation: u64, owner: u64) -> Self {
        Self { slot, generation, cache: owner }
    }
    /// The sequence's slot (its index among the cache's `max_seqs`).
    pub const fn slot(self) -> usize {
        self.slot
    }
    /// How many times the slot had been taken when this id was made (from 1 in a
    /// [`KvCache`]; 0 for [`SeqId::from_slot`]).
    pub const fn generation(self) -> u64 {
        self.generation
    }
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.slot)
    }
}

/// The most bytes a [`KvCache`] may ask for (the 128 TiB of a 48-bit address space).
pub(crate) const MAX_CACHE_BYTES: usize = 1 << 47;

/// Identities of caches: a [`SeqId`] carries its cache's, so ids of other caches are refused.
static NEXT_CACHE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// `v` repeated `n` times, or [`Error::Capacity`] when the allocator refuses the vector.
fn try_repeat<T: Clone>(v: T, n: usize, what: &str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|e| Error::Capacity(format!("could not allocate {what} for {n} entries: {e}")))?;
    out.resize(n, v);
    Ok(out)
}

#[derive(Clone, Debug)]
struct Seq {
    block_table: Vec<u32>,
    lens: Vec<usize>,
    /// Per layer: this sequence's own key mean `[kv_heads][head_dim]`, replacing the
    /// layer calibration's at append.
    key_means: Vec<Option<Vec<f32>>>,
    /// Per layer: the protected positions (ascending).
    protected: Vec<Vec<u32>>,
}

/// A paged, quantized KV cache for `layers` layers and up to `max_seqs` sequences.
///
/// Append tokens per layer and sequence ([`KvCache::append`]), then decode one query
/// token per sequence ([`KvCache::decode`]) or several ([`KvCache::decode_tokens`]:
/// speculative decoding's verification rows, a chunk of new tokens). Blocks come from a shared free list when a
/// sequence's window flushes a page and go back when the sequence is freed.
#[derive(Debug)]
pub struct KvCache {
    config: CacheConfig,
    format: Format,
    shape: CacheShape,
    backend: Backend,
    calib: Vec<LayerCalibration>,
    pools: Vec<paged::PoolBuffer>,
    sides: Vec<Vec<f16>>,
    seqs: Vec<Option<Seq>>,
    /// Per slot: the generation of its live (or last) sequence.
    generations: Vec<u64>,
    free_blocks: Vec<u32>,
    sm_scale: Option<f32>,
    key_scores: paged::KeyScores,
    /// Per layer: its sliding window ([`KvCache::set_window_left`]).
    windows: Vec<Option<usize>>,
    /// This cache's identity, carried by its [`SeqId`]s.
    id: u64,
}

impl KvCache {
    /// Allocates the pools and side stores; every layer starts with identity calibration.
    ///
    /// Every size product (blocks, pool and side-store bytes, layers) is checked: one past
    /// the format's index space or the address space is [`Error::Capacity`], and so is an
    /// allocation the system refuses (nothing is aborted).
    pub fn new(config: CacheConfig, shape: CacheShape, backend: Backend) -> Result<Self> {
        let format = config.format()?;
        let layer = LayerShape { num_kv_heads: shape.num_kv_heads, num_q_heads: shape.num_q_heads };
        layer.check()?;
        if shape.layers == 0 || shape.max_seqs == 0 || shape.max_tokens == 0 {
            return Err(Error::Shape(format!("layers, max_seqs and max_tokens must be positive: {shape:?}")));
        }
        if shape.max_tokens > u32::MAX as usize / 2 {
            return Err(Error::Capacity(format!("max_tokens {} is past the format's limit", shape.max_tokens)));
        }
        let too_big = |what: &str| Error::Capacity(format!("{what} of {shape:?} overflows the address space"));
        let per_seq = format.pages_for(shape.max_tokens as u32) as usize;
        let num_blocks = match shape.num_blocks {
            Some(n) => n,
            None => per_seq.checked_mul(shape.max_seqs).ok_or_else(|| too_big("the blocks"))?,
        };
        crate::launch::check_pool_blocks(&format, num_blocks)?;
        let pool = paged::pool_bytes(&config, &layer, num_blocks)?;
        let side = paged::side_elems(&config, &layer)?;
        let sides = side.checked_mul(shape.max_seqs).ok_or_else(|| too_big("the side stores"))?;
        let calib = LayerCalibration::identity(shape.num_kv_heads, config.head_dim);
        // All layers' pools, side stores and calibrations, and the per-sequence
        // bookkeeping, in bytes: past the 128 TiB of a 48-bit address space no
        // allocation can succeed.
        let layer_overhead = 8 * shape.num_kv_heads * config.head_dim
            + size_of::<LayerCalibration>()
            + size_of::<paged::PoolBuffer>()
            + size_of::<Vec<f16>>();
        let per_layer = sides.checked_mul(2).and_then(|b| b.checked_add(pool)?.checked_add(layer_overhead));
        per_layer
            .and_then(|b| b.checked_mul(shape.layers))
            .and_then(|b| b.checked_add(shape.max_seqs.checked_mul(size_of::<Option<Seq>>() + 8)?))
            .filter(|&b| b <= MAX_CACHE_BYTES)
            .ok_or_else(|| too_big("the pools and side stores"))?;
        let mut pools = Vec::new();
        let mut side_stores = Vec::new();
        pools.try_reserve_exact(shape.layers).map_err(|_| too_big("the layer list"))?;
        side_stores.try_reserve_exact(shape.layers).map_err(|_| too_big("the layer list"))?;
        for _ in 0..shape.layers {
            pools.push(paged::PoolBuffer::try_new(pool)?);
            side_stores.push(try_zeroed::<f16>(sides, "a layer's side stores")?);
        }
        Ok(Self {
            config,
            format,
            shape,
            backend,
            calib: try_repeat(calib, shape.layers, "the layer calibrations")?,
            pools,
            sides: side_stores,
            seqs: try_repeat(None, shape.max_seqs, "the sequence slots")?,
            generations: try_zeroed(shape.max_seqs, "the sequence generations")?,
            free_blocks: (0..num_blocks as u32).rev().collect(),
            sm_scale: None,
            key_scores: paged::KeyScores::default(),
            windows: try_repeat(None, shape.layers, "the layer windows")?,
            id: NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// The cache's configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }
    /// The cache's sizes.
    pub fn shape(&self) -> &CacheShape {
        &self.shape
    }
    /// The backend that runs append and decode.
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// Bytes held by the pools and side stores of all layers.
    pub fn memory_bytes(&self) -> usize {
        self.pools.iter().map(|p| p.bytes().len()).sum::<usize>()
            + self.sides.iter().map(|s| s.len() * 2).sum::<usize>()
    }
    /// Blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free_blocks.len()
    }
    /// A layer's page pool and side stores (`[max_seqs]` of [`paged::side_elems`]), as
    /// stored: for checks that compare backends byte for byte, and for debugging.
    pub fn layer_bytes(&self, layer: usize) -> Result<(&[u8], &[f16])> {
        self.check_layer(layer)?;
        Ok((self.pools[layer].bytes(), &self.sides[layer]))
    }

    /// Sets the softmax scale of decode (default `1 / sqrt(head_dim)`).
    pub fn set_softmax_scale(&mut self, scale: f32) -> Result<()> {
        if !scale.is_finite() || scale <= 0.0 {
            return Err(Error::Value(format!("softmax scale {scale} must be finite and positive")));
        }
        self.sm_scale = Some(scale);
        Ok(())
    }

    /// Makes `layer` a sliding-window layer: its decodes attend only to the `window_left + 1`
    /// newest positions up to each query's own ([`DecodeOptions::window_left`]: FlashInfer's
    /// `window_left`; a Hugging Face `sliding_window = n` is `Some(n - 1)`); `None` (the
    /// default) attends to every position. Sinks and protected positions outside the
    /// window are not attended either. Only decode changes: the cache keeps every page
    /// (its blocks serve all layers of a sequence; a serving stack that frees pages
    /// outside a window uses [`paged::decode`] with its own block tables). A window whose
    /// key count does not fit `u32` is [`Error::Value`], and changes nothing.
    pub fn set_window_left(&mut self, layer: usize, window_left: Option<usize>) -> Result<()> {
        self.check_layer(layer)?;
        paged::attn_window(window_left)?;
        self.windows[layer] = window_left;
        Ok(())
    }

    /// The sliding window of `layer` ([`KvCache::set_window_left`]).
    pub fn window_left(&self, layer: usize) -> Result<Option<usize>> {
        self.check_layer(layer)?;
        Ok(self.windows[layer])
    }

    /// Sets how the CPU backend scores quantized keys ([`paged::KeyScores`]).
    pub fn set_key_scores(&mut self, key_scores: paged::KeyScores) {
        self.key_scores = key_scores;
    }

    /// Sets a layer's calibration (key means, learned rotations, channel permutations;
    /// checked with [`LayerCalibration::check_orthogonal`]). Only allowed
    /// while no sequence holds tokens of that layer, since stored tokens were rotated
    /// with the old one.
    pub fn set_calibration(&mut self, layer: usize, calib: LayerCalibration) -> Result<()> {
        self.check_layer(layer)?;
        calib.check_orthogonal(self.shape.num_kv_heads, self.config.head_dim)?;
        if self.seqs.iter().flatten().any(|s| s.lens[layer] > 0) {
            return Err(Error::Calibration(format!("layer {layer} holds tokens; set calibration before appending")));
        }
        self.calib[layer] = calib;
        Ok(())
    }

    /// Gives `seq` its own key mean in `layer` (`[num_kv_heads][head_dim]`, finite), used
    /// instead of the layer calibration's when its keys are appended: online centering
    /// from the sequence's own tokens (a prompt's keys, say) for users without a
    /// calibration file. Decode needs nothing: a per-sequence shift of every key leaves
    /// attention unchanged. Only allowed while the sequence holds no token of the layer.
    pub fn set_sequence_key_mean(&mut self, layer: usize, seq: SeqId, mean: &[f32]) -> Result<()> {
        self.check_layer(layer)?;
        let n = self.shape.num_kv_heads * self.config.head_dim;
        if mean.len() != n {
            return Err(Error::Shape(format!("key mean has {} entries, expected {n}", mean.len())));
        }
        if let Some(i) = mean.iter().position(|x| !x.is_finite()) {
            return Err(Error::Value(format!("key mean entry {i} is not finite")));
        }
        if self.seq(seq)?.lens[layer] > 0 {
            return Err(Error::Calibration(format!(
                "sequence {seq} holds tokens of layer {layer}; set its mean first"
            )));
        }
        self.seqs[seq.slot()].as_mut().expect("checked above").key_means[layer] = Some(mean.to_vec());
        Ok(())
    }

    /// Protects `positions` of `seq` in `layer` (detected attention sinks beyond the
    /// configured leading sinks): their f16 rows are kept, and decode reads them instead
    /// of the quantized page once they leave the window. `positions` must ascend, come
    /// after any already protected, not be among the leading sinks, and not be quantized
    /// yet (still in the window, or not yet appended); at most
    /// [`CacheConfig::protected`] per sequence and layer in all.
    pub fn protect(&mut self, layer: usize, seq: SeqId, positions: &[u32]) -> Result<()> {
        self.check_layer(layer)?;
        let shape = self.layer_shape();
        self.seq(seq)?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= self.shape.max_tokens) {
            return Err(Error::Value(format!(
                "position {p} can never be appended: the cache holds at most {} tokens per sequence",
                self.shape.max_tokens
            )));
        }
        let slot = seq.slot();
        let s = self.seqs[slot].as_ref().expect("checked above");
        let old = &s.protected[layer];
        let new: Vec<u32> = old.iter().chain(positions).copied().collect();
        let se = self.side_elems();
        let side = &mut self.sides[layer][slot * se..(slot + 1) * se];
        paged::protect(&self.config, &shape, side, s.lens[layer], old, &new)?;
        self.seqs[slot].as_mut().expect("checked above").protected[layer] = new;
        Ok(())
    }

    /// The protected positions of `seq` in `layer`.
    pub fn protected(&self, layer: usize, seq: SeqId) -> Result<&[u32]> {
        self.check_layer(layer)?;
        Ok(&self.seq(seq)?.protected[layer])
    }

    /// Starts a new, empty sequence in the lowest free slot, with a new generation.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let slot = self
            .seqs
            .iter()
            .position(Option::is_none)
            .ok_or_else(|| Error::Capacity(format!("all {} sequence slots are live", self.shape.max_seqs)))?;
        self.seqs[slot] = Some(Seq {
            block_table: Vec::new(),
            lens: vec![0; self.shape.layers],
            key_means: vec![None; self.shape.layers],
            protected: vec![Vec::new(); self.shape.layers],
        });
        self.generations[slot] += 1;
        Ok(SeqId { slot, generation: self.generations[slot], cache: self.id })
    }

    /// Frees a sequence and returns its blocks to the pool.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.seq(seq)?;
        let s = self.seqs[seq.slot()].take().expect("checked above");
        self.free_blocks.extend(s.block_table.iter().rev());
        Ok(())
    }

    /// Tokens of `seq` in `layer`.
    pub fn len(&self, layer: usize, seq: SeqId) -> Result<usize> {
        self.check_layer(layer)?;
        Ok(self.seq(seq)?.lens[layer])
    }

    /// Whether `seq` holds no token in any layer.
    pub fn is_empty(&self, seq: SeqId) -> Result<bool> {
        Ok(self.seq(seq)?.lens.iter().all(|&l| l == 0))
    }

    /// Appends `tokens` tokens to `seq` in `layer`. `k` and `v` are
    /// `[tokens][num_kv_heads][head_dim]` (f32, f16 or bf16). On error nothing changes.
    pub fn append<T: KvElement>(&mut self, layer: usize, seq: SeqId, tokens: usize, k: &[T], v: &[T]) -> Result<()> {
        self.check_layer(layer)?;
        let len = self.seq(seq)?.lens[layer];
        let new_len = len.saturating_add(tokens);
        if new_len > self.shape.max_tokens {
            return Err(Error::Capacity(format!(
                "sequence {seq} would hold {new_len} tokens in layer {layer}; max_tokens is {}",
                self.shape.max_tokens
            )));
        }
        let have = self.seq(seq)?.block_table.len();
        let need = (self.format.pages_for(new_len as u32) as usize).saturating_sub(have);
        if need > self.free_blocks.len() {
            return Err(Error::Capacity(format!(
                "sequence {seq} needs {need} more blocks, {} are free",
                self.free_blocks.len()
            )));
        }
        let fresh = self.free_blocks.split_off(self.free_blocks.len() - need);
        let mut table = self.seq(seq)?.block_table.clone();
        table.extend(fresh.iter().rev());
        let slot = seq.slot();
        let se = self.side_elems();
        let own;
        let calib = match &self.seq(seq)?.key_means[layer] {
            Some(mean) => {
                own = LayerCalibration { key_mean: mean.clone(), ..self.calib[layer].clone() };
                &own
            }
            None => &self.calib[layer],
        };
        let protected = &self.seqs[slot].as_ref().expect("checked above").protected[layer];
        let result = paged::append(
            self.backend,
            &self.config,
            calib,
            &self.layer_shape(),
            self.pools[layer].bytes_mut(),
            &table,
            &mut self.sides[layer][slot * se..(slot + 1) * se],
            protected,
            len,
            tokens,
            k,
            v,
        );
        match result {
            Ok(n) => {
                let s = self.seqs[slot].as_mut().expect("checked above");
                s.block_table = table;
                s.lens[layer] = n;
                Ok(())
            }
            Err(e) => {
                self.free_blocks.extend(fresh);
                Err(e)
            }
        }
    }

    /// Decode attention in `layer` for one query token per sequence of `seqs`: `q` and
    /// `out` are `[seqs.len()][num_q_heads][head_dim]`. Splits are chosen by the backend.
    pub fn decode<T: KvElement>(&self, layer: usize, seqs: &[SeqId], q: &[T], out: &mut [f32]) -> Result<()> {
        self.decode_with(layer, seqs, q, out, None)
    }

    /// [`KvCache::decode`] with an explicit split count (1 to 1024).
    pub fn decode_with<T>(
        &self,
        layer: usize,
        seqs: &[SeqId],
        q: &[T],
        out: &mut [f32],
        num_splits: Option<u32>,
    ) -> Result<()>
    where
        T: KvElement,
    {
        self.decode_tokens_with(layer, seqs, 1, q, out, num_splits)
    }

    /// Decode attention in `layer` for the last `q_len` tokens (1 to
    /// [`paged::MAX_Q_LEN`]) of every sequence of `seqs`, appended beforehand: the
    /// verification rows of speculative decoding, or a chunk of new tokens decoded at
    /// once. `q` and `out` are `[seqs.len()][q_len][num_q_heads][head_dim]`; row `i` of a
    /// sequence of `len` tokens is the token at position `len - q_len + i` and attends to
    /// positions `0 ..= len - q_len + i`: the positions a one-token [`KvCache::decode`]
    /// right after that token's append would see (read as the cache holds them now: the
    /// tokens appended since may have pushed a page of the window into quantization), cut
    /// to the layer's sliding window if it has one ([`KvCache::set_window_left`]).
    /// Every sequence must hold at least `q_len` tokens. Splits are chosen by the
    /// backend. On error `out` is untouched.
    ///
    /// ```
    /// use rotkv::{Backend, CacheConfig, CacheShape, KvCache};
    /// let (num_kv_heads, num_q_heads) = (1, 2);
    /// let shape = CacheShape { layers: 1, num_kv_heads, num_q_heads, max_seqs: 1, max_tokens: 64, num_blocks: None };
    /// let mut cache = KvCache::new(CacheConfig::k2v2(64), shape, Backend::Cpu)?;
    /// let seq = cache.add_sequence()?;
    /// let kv: Vec<f32> = (0..10 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
    /// cache.append(0, seq, 7, &kv[..7 * 64], &kv[3 * 64..])?; // the context
    /// cache.append(0, seq, 3, &kv[7 * 64..], &kv[..3 * 64])?; // 3 draft tokens
    /// let q: Vec<f32> = (0..3 * 2 * 64).map(|i| (i as f32 * 0.11).cos()).collect();
    /// let mut out = vec![0f32; 3 * 2 * 64]; // [1 sequence][3 tokens][2 heads][64]
    /// cache.decode_tokens(0, &[seq], 3, &q, &mut out)?; // rows at positions 7, 8 and 9
    /// assert!(out.iter().all(|x| x.is_finite()));
    /// // A sequence shorter than q_len is refused.
    /// assert!(cache.decode_tokens(0, &[seq], 11, &[0f32; 11 * 2 * 64], &mut [0f32; 11 * 2 * 64]).is_err());
    /// # Ok::<(), rotkv::Error>(())
    /// ```
    pub fn decode_tokens<T: KvElement>(
        &self,
        layer: usize,
        seqs: &[SeqId],
        q_len: usize,
        q: &[T],
        out: &mut [f32],
    ) -> Result<()> {
        self.decode_tokens_with(layer, seqs, q_len, q, out, None)
    }

    /// [`KvCache::decode_tokens`] with an explicit split count (1 to 1024).
    pub fn decode_tokens_with<T: KvElement>(
        &self,
        layer: usize,
        seqs: &[SeqId],
        q_len: usize,
        q: &[T],
        out: &mut [f32],
        num_splits: Option<u32>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        if let Some((i, s)) = seqs.iter().enumerate().find(|&(i, s)| seqs[..i].contains(s)) {
            return Err(Error::Shape(format!("sequence {s} appears twice in the batch (entry {i})")));
        }
        let se = self.side_elems();
        let refs = seqs
            .iter()
            .map(|&id| {
                let s = self.seq(id)?;
                Ok(SeqRef {
                    block_table: &s.block_table,
                    side: &self.sides[layer][id.slot() * se..(id.slot() + 1) * se],
                    len: s.lens[layer],
                    protected: &s.protected[layer],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        paged::decode(
            self.backend,
            &self.config,
            &self.calib[layer],
            &self.layer_shape(),
            self.pools[layer].bytes(),
            &refs,
            q,
            out,
            DecodeOptions {
                sm_scale: self.sm_scale,
                num_splits,
                q_len,
                key_scores: self.key_scores,
                window_left: self.windows[layer],
            },
        )
    }

    /// A multi-token step of `layer` for the sequences of `seqs`: appends `q_len` new
    /// tokens to each (`k`, `v` `[seqs.len()][q_len][num_kv_heads][head_dim]`) and
    /// decodes them (`q`, `out` `[seqs.len()][q_len][num_q_heads][head_dim]`), in passes
    /// of at most `pass_rows` rows: pass `i` appends rows `i * pass_rows ..` of every
    /// sequence, then decodes them with [`KvCache::decode_tokens`]. Each row reads the
    /// cache as the append of its own pass leaves it, so with
    /// [`CacheConfig::pass_rows`] (half the window) every row of a long prompt chunk sees
    /// its chunk's earlier tokens in f16, as token-by-token decode does; `pass_rows >=
    /// q_len` is one append then one decode. The CPU twin of
    /// [`crate::device::DecodePlan::run_step`] (same rows, same passes).
    ///
    /// # Errors
    /// Checked before anything changes: [`Error::Layer`], [`Error::UnknownSequence`],
    /// [`Error::Shape`] for a sequence named twice, `q_len` outside `1 ..=`
    /// [`paged::MAX_Q_LEN`], `pass_rows` 0 or buffers of other sizes; [`Error::Capacity`]
    /// past `max_tokens` or the free blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn append_decode<T: KvElement>(
        &mut self,
        layer: usize,
        seqs: &[SeqId],
        q_len: usize,
        pass_rows: usize,
        (k, v): (&[T], &[T]),
        q: &[T],
        out: &mut [f32],
    ) -> Result<()> {
        self.check_layer(layer)?;
        if !(1..=paged::MAX_Q_LEN).contains(&q_len) || pass_rows == 0 {
            return Err(Error::Shape(format!(
                "a step of {q_len} rows in passes of {pass_rows} (1 to {} rows, passes of at least 1)",
                paged::MAX_Q_LEN
            )));
        }
        if let Some((i, s)) = seqs.iter().enumerate().find(|&(i, s)| seqs[..i].contains(s)) {
            return Err(Error::Shape(format!("sequence {s} appears twice in the batch (entry {i})")));
        }
        let (row, qrow) =
            (self.shape.num_kv_heads * self.config.head_dim, self.shape.num_q_heads * self.config.head_dim);
        let n = seqs.len();
        for (what, len, want) in [
            ("k", k.len(), n * q_len * row),
            ("v", v.len(), n * q_len * row),
            ("q", q.len(), n * q_len * qrow),
            ("out", out.len(), n * q_len * qrow),
        ] {
            if len != want {
                return Err(Error::Shape(format!(
                    "{what} has {len} elements; {n} sequences x {q_len} rows need {want}"
                )));
            }
        }
        let mut blocks = 0usize;
        for &s in seqs {
            let seq = self.seq(s)?;
            let new_len = seq.lens[layer] + q_len;
            if new_len > self.shape.max_tokens {
                return Err(Error::Capacity(format!(
                    "sequence {s} would hold {new_len} tokens in layer {layer}; max_tokens is {}",
                    self.shape.max_tokens
                )));
            }
            blocks += (self.format.pages_for(new_len as u32) as usize).saturating_sub(seq.block_table.len());
        }
        if blocks > self.free_blocks.len() {
            return Err(Error::Capacity(format!(
                "the step needs {blocks} more blocks, {} are free",
                self.free_blocks.len()
            )));
        }
        let mut lo = 0;
        while lo < q_len {
            let m = pass_rows.min(q_len - lo);
            for (i, &s) in seqs.iter().enumerate() {
                let at = (i * q_len + lo) * row..(i * q_len + lo + m) * row;
                self.append(layer, s, m, &k[at.clone()], &v[at])?;
            }
            let rows = |x: usize, w: usize| (x * q_len + lo) * w..(x * q_len + lo + m) * w;
            let qp: Vec<T> = (0..n).flat_map(|i| q[rows(i, qrow)].iter().copied()).collect();
            let mut op = vec![0f32; n * m * qrow];
            self.decode_tokens(layer, seqs, m, &qp, &mut op)?;
            for i in 0..n {
                out[rows(i, qrow)].copy_from_slice(&op[i * m * qrow..(i + 1) * m * qrow]);
            }
            lo += m;
        }
        Ok(())
    }

    fn layer_shape(&self) -> LayerShape {
        LayerShape { num_kv_heads: self.shape.num_kv_heads, num_q_heads: self.shape.num_q_heads }
    }
    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.shape.layers {
            return Err(Error::Layer { layer, layers: self.shape.layers });
        }
        Ok(())
    }
    /// The live sequence `seq` names: of this cache, its slot live, of that slot's
    /// current generation.
    fn seq(&self, seq: SeqId) -> Result<&Seq> {
        let live = seq.cache == self.id && self.generations.get(seq.slot) == Some(&seq.generation);
        live.then(|| self.seqs[seq.slot].as_ref()).flatten().ok_or(Error::UnknownSequence(seq.slot))
    }
    /// f16 elements of one sequence's side store in one layer (checked in `new`).
    fn side_elems(&self) -> usize {
        self.format.side_elems(self.shape.num_kv_heads as u32)
    }
}

#[cfg(test)]
mod tests {
    //! Small enough for Miri (`cargo xtask ci` runs these under it).
    use super::*;

    #[test]
    fn zeroed_buffers_are_aligned_zero_and_fallible() {
        let p = paged::PoolBuffer::try_new(100).unwrap();
        assert_eq!(p.bytes().len(), 112);
        assert!(p.bytes().iter().all(|&b| b == 0));
        assert!((p.bytes().as_ptr() as usize).is_multiple_of(paged::POOL_ALIGN));
        let v: Vec<f16> = try_zeroed(7, "test").unwrap();
        assert_eq!(v, vec![f16::ZERO; 7]);
        assert!(try_zeroed::<f16>(0, "test").unwrap().is_empty());
        assert!(matches!(try_zeroed::<u128>(usize::MAX / 8, "test"), Err(Error::Capacity(_))));
        assert!(matches!(try_repeat(0u64, usize::MAX / 4, "test"), Err(Error::Capacity(_))));
    }

    #[test]
    fn small_cache_round_trip_with_stale_ids() {
        let config = CacheConfig { window: 16, page_size: 16, ..CacheConfig::k2v2(64) };
        let shape =
            CacheShape { layers: 1, num_kv_heads: 1, num_q_heads: 2, max_seqs: 2, max_tokens: 48, num_blocks: None };
        let kv: Vec<f32> = (0..40 * 64).map(|i| ((i * 7 % 33) as f32 - 16.0) / 8.0).collect();
        let q: Vec<f32> = (0..2 * 64).map(|i| ((i * 5 % 17) as f32 - 8.0) / 8.0).collect();
        let mut outs = Vec::new();
        for backend in [Backend::Reference, Backend::Cpu] {
            let mut cache = KvCache::new(config, shape, backend).unwrap();
            let a = cache.add_sequence().unwrap();
            cache.free_sequence(a).unwrap();
            let b = cache.add_sequence().unwrap();
            assert_eq!((a.slot(), a.generation(), b.generation()), (b.slot(), 1, 2));
            assert_eq!(cache.append(0, a, 1, &kv[..64], &kv[..64]), Err(Error::UnknownSequence(0)));
            cache.append(0, b, 40, &kv, &kv).unwrap();
            let mut out = vec![0f32; q.len()];
            cache.decode_with(0, &[b], &q, &mut out, Some(3)).unwrap();
            assert!(out.iter().all(|x| x.is_finite()));
            outs.push(out);
        }
        let err = outs[0].iter().zip(&outs[1]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-3, "cpu and reference differ by {err}");
    }
}
