//! What one fuzz input does, shared by the stable mutation fuzzer (`tests/tests/fuzz.rs`)
//! and the cargo-fuzz targets (`fuzz/fuzz_targets/*.rs`), which both include this file
//! with `#[path]` (no crate dependency: the fuzz crate depends on `rotkv` alone, with
//! the `model` feature). Every function takes arbitrary bytes and must return: a panic,
//! an out-of-bounds access (AddressSanitizer under cargo-fuzz) or a broken invariant
//! (an `assert!` here) is a finding.
//!
//! - [`gguf`]: the GGUF reader, the tokenizer, the llama loader and a 3-token forward pass.
//! - [`calibration`]: the calibration-file reader and its validation.
//! - [`pool`]: the bytes as one layer's page pool, side stores, block tables, lengths and
//!   protected lists (the FORMAT's parsing) through `paged::decode` on the reference and
//!   cpu backends: both return `Ok` or both the same kind of `Err`.
//! - [`paged_ops`]: the bytes as a sequence of `KvCache` operations (add, free, append,
//!   protect, decode) run on a reference and a cpu cache side by side, compared as
//!   `tests/properties.rs` compares them: the same outcome, a failed call changes
//!   nothing, pools and live side-store rows byte-identical, decode within 5e-5.

use rotkv::model::calibrate::Calibration;
use rotkv::model::gguf::Gguf;
use rotkv::model::llama::{ExactAttention, Llama, Row, WeightStorage};
use rotkv::model::tokenizer::Tokenizer;
use rotkv::paged::{self, DecodeOptions, LayerShape, PoolBuffer};
use rotkv::reference::SeqRef;
use rotkv::{Backend, CacheConfig, CacheShape, Error, KvCache, LayerCalibration, SeqId, f16};
use rotkv_kernels::layout::Place;

/// The fuzz input read front to back; zeros once it is used up.
pub struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Input(bytes)
    }
    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    /// `n` bytes (fewer when the input ends).
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The GGUF reader, then the tokenizer and the llama loader on whatever parses, and a
/// forward pass over 3 tokens on whatever loads.
pub fn gguf(bytes: &[u8]) {
    let Ok(g) = Gguf::parse(bytes.to_vec()) else { return };
    if let Ok(tok) = Tokenizer::from_gguf(&g)
        && let Ok(ids) = tok.encode("abc ab 12 cab")
    {
        let _ = tok.decode(&ids);
    }
    if let Ok(m) = Llama::from_gguf(&g) {
        // Its sizes come from tensors that fit the file: 3 tokens inside the vocabulary.
        let tokens = [0u32, 1, 2];
        let rows: Vec<Row> = (0..3).map(|p| Row { seq: 0, pos: p }).collect();
        let f32_out = m.forward(&tokens, &rows, &mut ExactAttention::new(&m.config), None, 1);
        // The weights kept as stored load from the same files and give the same hidden
        // states bit for bit.
        let q = Llama::from_gguf_with(&g, WeightStorage::Quantized).expect("loads as stored where it loads in f32");
        let q_out = q.forward(&tokens, &rows, &mut ExactAttention::new(&q.config), None, 1);
        if let (Ok(a), Ok(b)) = (&f32_out, &q_out) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "stored weights differ from f32");
        }
        assert_eq!(f32_out.is_ok(), q_out.is_ok(), "one storage failed where the other ran");
    } else {
        assert!(Llama::from_gguf_with(&g, WeightStorage::Quantized).is_err(), "loads as stored, not in f32");
    }
}

/// The calibration-file reader and both checks of every layer it returns.
pub fn calibration(bytes: &[u8]) {
    if let Ok(c) = Calibration::from_safetensors(bytes) {
        for l in &c.layers {
            let _ = l.validate(c.kv_heads, c.head_dim);
            let _ = l.check_orthogonal(c.kv_heads, c.head_dim);
        }
    }
}

/// One of the presets with a 16-token window and pages (so a few blocks hold a sequence).
pub fn small_config(x: u8) -> CacheConfig {
    let base = match x % 3 {
        0 => CacheConfig::k2v2(64),
        1 => CacheConfig::k4v2(64),
        _ => CacheConfig::k4v4(64),
    };
    CacheConfig { window: 16, page_size: 16, protected: (x as usize / 3) % 3, ..base }
}

/// A query value from one byte: a multiple of 1/16 in [-8, 8), or NaN for 0x80.
fn q_value(b: u8) -> f32 {
    if b == 0x80 { f32::NAN } else { b as i8 as f32 / 16.0 }
}

/// The FORMAT's parsing: the input is a layer's shape, its page pool's bytes, and per
/// sequence a length, a block table, a side store and a protected list (sizes mostly
/// right, sometimes off), decoded by `paged::decode` on the reference and cpu backends.
/// Returns whether the decode succeeded.
pub fn pool(bytes: &[u8]) -> bool {
    let mut r = Input::new(bytes);
    let config = small_config(r.u8());
    let d = config.head_dim;
    let heads = r.u8();
    let hkv = 1 + (heads & 1) as usize;
    let hq = hkv * (1 + (heads >> 1 & 3) as usize);
    let shape = LayerShape { num_kv_heads: hkv, num_q_heads: hq };
    let layout = r.u8();
    let blocks = (layout % 6) as usize;
    let Ok(pool_len) = paged::pool_bytes(&config, &shape, blocks) else { return false };
    // Now and then a pool that is not a whole number of blocks, or not aligned.
    let pool_len = if layout & 0x30 == 0x30 { pool_len + 1 + (layout >> 6) as usize } else { pool_len };
    let misaligned = layout & 0x08 != 0 && layout & 0x30 == 0x20;
    let mut buffer = PoolBuffer::new(pool_len + 16);
    let start = if misaligned { 1 } else { 0 };
    let pool = &mut buffer.bytes_mut()[start..start + pool_len];
    let fill = r.take(pool_len);
    pool[..fill.len()].copy_from_slice(fill);
    let pool = &*pool;

    let Ok(side_len) = paged::side_elems(&config, &shape) else { return false };
    struct Seq {
        table: Vec<u32>,
        side: Vec<f16>,
        len: usize,
        protected: Vec<u32>,
    }
    let num_seqs = (r.u8() % 4) as usize;
    let mut seqs = Vec::new();
    for _ in 0..num_seqs {
        let flags = r.u8();
        let len = match flags & 3 {
            0 => r.u8() as usize,
            1 | 2 => r.u16() as usize % (blocks * config.page_size + 24),
            _ => r.u32() as usize,
        };
        let table_len = match flags >> 2 & 3 {
            3 => (r.u8() % 8) as usize,
            _ => paged::blocks_for(&config, len).unwrap_or(0).min(8),
        };
        let table: Vec<u32> =
            (0..table_len).map(|_| if flags & 0x10 != 0 { r.u32() } else { (r.u8() % 8) as u32 }).collect();
        let side_len = match flags >> 5 {
            0 => side_len.saturating_sub(1),
            1 => side_len + 1,
            _ => side_len,
        };
        let side: Vec<f16> = (0..side_len).map(|_| f16::from_bits(r.u16())).collect();
        let protected: Vec<u32> = (0..r.u8() % 3).map(|_| r.u8() as u32).collect();
        seqs.push(Seq { table, side, len, protected });
    }
    let refs: Vec<SeqRef> = seqs
        .iter()
        .map(|s| SeqRef { block_table: &s.table, side: &s.side, len: s.len, protected: &s.protected })
        .collect();
    let opts = r.u8();
    let q_len = if opts & 7 == 7 { 1 + (opts >> 3 & 3) as usize } else { 1 };
    let num_splits = match opts >> 5 {
        0 => Some(0),
        1 => Some(2000),
        2 | 3 => Some(1 + (r.u8() % 8) as u32),
        _ => None,
    };
    let rows = num_seqs * q_len * hq * d;
    let q: Vec<f32> = (0..rows + usize::from(opts == 0x1f)).map(|_| q_value(r.u8())).collect();
    let calib = LayerCalibration::identity(hkv, d);
    // A sliding window (none when the input has ended), including one too large for u32.
    let w = r.u8();
    let window_left = match w >> 6 {
        0 => None,
        1 => Some(usize::MAX),
        _ => Some((w & 63) as usize),
    };
    let options = DecodeOptions { num_splits, q_len, window_left, ..DecodeOptions::default() };
    let mut outcomes = Vec::new();
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut out = vec![0f32; rows];
        let r = paged::decode(backend, &config, &calib, &shape, pool, &refs, &q, &mut out, options);
        outcomes.push(r.map_err(|e| std::mem::discriminant(&e)));
    }
    assert_eq!(outcomes[0], outcomes[1], "reference and cpu disagree on the same pool");
    outcomes[0].is_ok()
}

/// The cache of [`paged_ops`]: k2v2 at head_dim 64, one KV head, 4 query heads.
const D: usize = 64;
const HKV: usize = 1;
const HQ: usize = 4;
const LAYERS: usize = 2;

/// Everything a failed call must leave alone (also used by `tests/properties.rs`).
#[derive(Debug, PartialEq)]
pub struct Snapshot {
    bytes: Vec<(Vec<u8>, Vec<u16>)>,
    lens: Vec<Option<Vec<usize>>>,
    protected: Vec<Option<Vec<Vec<u32>>>>,
    free_blocks: usize,
}

/// The snapshot of `cache` as seen through the ids handed out so far.
pub fn snapshot(cache: &KvCache, ids: &[SeqId]) -> Snapshot {
    let layers = cache.shape().layers;
    let bytes = (0..layers)
        .map(|l| {
            let (pool, side) = cache.layer_bytes(l).unwrap();
            (pool.to_vec(), side.iter().map(|x| x.to_bits()).collect())
        })
        .collect();
    let lens = ids.iter().map(|&s| (0..layers).map(|l| cache.len(l, s)).collect::<Result<Vec<_>, _>>().ok()).collect();
    let protected = ids
        .iter()
        .map(|&s| (0..layers).map(|l| cache.protected(l, s).map(<[u32]>::to_vec)).collect::<Result<Vec<_>, _>>().ok())
        .collect();
    Snapshot { bytes, lens, protected, free_blocks: cache.free_blocks() }
}

/// The f16 bits of the side-store rows decode reads (sinks, window, protected rows of
/// positions appended) of every live sequence of `layer`: rows of tokens that were
/// quantized since are dead, and a backend need not have written them.
pub fn live_rows(cache: &KvCache, ids: &[SeqId], layer: usize) -> Vec<(usize, Vec<u16>)> {
    let fmt = cache.config().format().unwrap();
    let (hkv, d) = (cache.shape().num_kv_heads, cache.config().head_dim);
    let se = fmt.side_elems(hkv as u32);
    let side = cache.layer_bytes(layer).unwrap().1;
    let mut out = Vec::new();
    for &s in ids {
        let (Ok(len), Ok(protected)) = (cache.len(layer, s), cache.protected(layer, s)) else { continue };
        let store = &side[s.slot() * se..(s.slot() + 1) * se];
        let mut rows: Vec<u32> = Vec::new();
        for pos in 0..len as u32 {
            match fmt.place(pos, len as u32) {
                Place::Sink { index } => rows.push(index),
                Place::Window { slot } => rows.push(slot),
                Place::Page { .. } => {}
            }
        }
        rows.extend(
            (0..protected.len() as u32)
                .filter(|&i| (protected[i as usize] as usize) < len)
                .map(|i| fmt.protected_row(i)),
        );
        for h in 0..hkv as u32 {
            for value in [false, true] {
                for &row in &rows {
                    let at = fmt.side_row_at(h, value, row);
                    let bits = store[at..at + d].iter().map(|x| x.to_bits()).collect();
                    out.push((s.slot(), bits));
                }
            }
        }
    }
    out
}

/// Dyadic inputs: `n` values in [-2, 2] in steps of 1/8 (exact in f32 and f64, so both
/// backends must write the same bytes), from a xorshift stream seeded by `seed`.
fn dyadic(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 32) % 33) as f32 / 8.0 - 2.0
        })
        .collect()
}

/// Relative L2 error of `a` against `b`.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The `KvCache` API driven by the input as up to 48 operations, on the reference and
/// the cpu backend side by side. Per operation: one byte picks the kind, the next
/// bytes its arguments (sequence ids index the ids handed out so far, live or not; layer
/// 2 does not exist; up to 255 tokens against a 100-token capacity).
pub fn paged_ops(bytes: &[u8]) {
    let config = CacheConfig { window: 16, page_size: 16, protected: 2, ..CacheConfig::k2v2(D) };
    let shape = CacheShape {
        layers: LAYERS,
        num_kv_heads: HKV,
        num_q_heads: HQ,
        max_seqs: 3,
        max_tokens: 100,
        num_blocks: Some(9),
    };
    let backends = [Backend::Reference, Backend::Cpu];
    let mut caches: Vec<KvCache> = backends.iter().map(|&b| KvCache::new(config, shape, b).unwrap()).collect();
    let mut ids: Vec<Vec<SeqId>> = vec![Vec::new(); caches.len()];
    let pick = |ids: &[SeqId], n: u8| {
        if ids.is_empty() { SeqId::from_slot(n as usize % 3) } else { ids[n as usize % ids.len()] }
    };
    let layer_of = |b: u8| if b % 8 == 7 { LAYERS } else { (b % 2) as usize };
    let mut r = Input::new(bytes);
    for step in 0..48 {
        if r.is_empty() {
            break;
        }
        let kind = r.u8();
        let (a, b, c, seed) = (r.u8(), r.u8(), r.u8(), r.u32() as u64);
        let mut outcomes: Vec<Result<Option<Vec<f32>>, Error>> = Vec::new();
        for (i, cache) in caches.iter_mut().enumerate() {
            let before = snapshot(cache, &ids[i]);
            let id = pick(&ids[i], a);
            let result = match kind % 8 {
                0 | 1 => cache.add_sequence().map(|s| {
                    ids[i].push(s);
                    None
                }),
                2 => cache.free_sequence(id).map(|()| None),
                3 | 4 => {
                    let tokens = if c & 0xc0 == 0xc0 { c as usize } else { (c % 40) as usize };
                    let mut k = dyadic(tokens * HKV * D, seed);
                    let v = dyadic(tokens * HKV * D, seed ^ 0x9e37_79b9);
                    if c & 0x20 != 0 && c & 0xc0 == 0x40 && !k.is_empty() {
                        let mid = k.len() / 2;
                        k[mid] = f32::NAN;
                    }
                    cache.append(layer_of(b), id, tokens, &k, &v).map(|()| None)
                }
                5 => {
                    let pos = if c == 0xff { u32::MAX } else { c as u32 % 100 };
                    cache.protect(layer_of(b), id, &[pos]).map(|()| None)
                }
                _ => {
                    let seqs: Vec<SeqId> =
                        (0..1 + c % 3).map(|j| pick(&ids[i], a.wrapping_add(j.wrapping_mul(b | 1)))).collect();
                    let splits = match c >> 2 & 3 {
                        0 => None,
                        1 => Some(0),
                        2 => Some(1 + (seed % 4) as u32),
                        _ => Some(2000),
                    };
                    let q = dyadic(seqs.len() * HQ * D, 99 + step as u64);
                    let mut out = vec![0f32; q.len()];
                    cache.decode_with(layer_of(b), &seqs, &q, &mut out, splits).map(|()| Some(out))
                }
            };
            if result.is_err() {
                assert!(
                    snapshot(cache, &ids[i]) == before,
                    "step {step} on {:?}: a failed call changed the cache",
                    backends[i]
                );
            }
            outcomes.push(result);
        }
        match (&outcomes[0], &outcomes[1]) {
            (Err(a), Err(e)) => {
                assert_eq!(std::mem::discriminant(a), std::mem::discriminant(e), "step {step}: {a} / {e}")
            }
            (Ok(Some(want)), Ok(Some(got))) => {
                // The cpu backend's conformance tolerance (f32 accumulation against f64).
                let e = rel_err(got, want);
                assert!(e < 5e-5, "step {step}: cpu decode differs from the reference by {e:.2e}");
            }
            (Ok(_), Ok(_)) => {}
            (want, got) => panic!("step {step}: reference {want:?}, cpu {got:?}"),
        }
        for l in 0..LAYERS {
            let (want, got) = (caches[0].layer_bytes(l).unwrap(), caches[1].layer_bytes(l).unwrap());
            assert!(want.0 == got.0, "step {step}: layer {l} pool bytes differ from the reference");
            let (wr, gr) = (live_rows(&caches[0], &ids[0], l), live_rows(&caches[1], &ids[1], l));
            assert!(wr == gr, "step {step}: layer {l} live side-store rows differ from the reference");
        }
    }
}
