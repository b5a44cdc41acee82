//! Work and memory bounded by the input: a counting allocator measures the largest
//! single allocation of a call and the peak of live bytes. (Its own test binary: the
//! allocator counts for every thread of the process, so the tests take one lock and
//! nothing else runs beside a measured call.)

use rotkv::{Backend, CacheConfig, CacheShape, KvCache};
use rotkv_tests::{Data, rows};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);
/// Bytes allocated and not yet freed, and their peak since the last reset.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// One measured test at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn grew(by: usize) {
    LARGEST.fetch_max(by, Ordering::Relaxed);
    let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: forwards every call to the system allocator unchanged; it only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The largest single allocation `f` makes.
fn largest(f: impl FnOnce()) -> usize {
    LARGEST.store(0, Ordering::Relaxed);
    f();
    LARGEST.load(Ordering::Relaxed)
}

/// The peak of live bytes while `f` runs, above those live when it starts, and `f`'s
/// result.
fn peak<R>(f: impl FnOnce() -> R) -> (usize, R) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = f();
    (PEAK.load(Ordering::Relaxed).saturating_sub(base), r)
}

#[test]
fn explicit_split_counts_are_cut_to_what_the_length_can_use() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let config = CacheConfig::k2v2(64);
    let shape =
        CacheShape { layers: 1, num_kv_heads: 2, num_q_heads: 8, max_seqs: 2, max_tokens: 64, num_blocks: None };
    let (k, v) = (rows(Data::Keys, 20 * 2, 64, 1), rows(Data::Normal, 20 * 2, 64, 2));
    let q = rows(Data::Normal, 2 * 8, 64, 3);
    // The cut is made in `paged::decode`, before any backend; the emulated kernels
    // (minutes for 20 splits here) take the same count.
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut cache = KvCache::new(config, shape, backend).unwrap();
        let seqs: Vec<_> = (0..2).map(|_| cache.add_sequence().unwrap()).collect();
        for &s in &seqs {
            cache.append(0, s, 20, &k, &v).unwrap();
        }
        let mut want = vec![0f32; q.len()];
        let mut out = vec![0f32; q.len()];
        let fit = largest(|| cache.decode_with(0, &seqs, &q, &mut want, Some(20)).unwrap());
        let huge = largest(|| cache.decode_with(0, &seqs, &q, &mut out, Some(1024)).unwrap());
        assert_eq!(out, want, "{backend:?}: 1024 splits of 20 tokens are 20 splits");
        // 1024 splits' partials would be 2 x 8 x 1024 x 66 floats (4.3 MB).
        assert!(
            huge <= fit.max(1 << 16) * 2,
            "{backend:?}: largest allocation {huge} bytes with 1024 splits, {fit} with 20"
        );
    }
}

/// A broadcast (stride-0) K/V over 512 bytes of storage standing for 2^22 tokens (2 GiB
/// of f32 rows): the capacity error comes before the copy a strided tensor gets.
#[cfg(feature = "candle")]
#[test]
fn candle_append_refuses_a_broadcast_past_capacity_before_copying_it() {
    use candle_core::{Device, Tensor};
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let shape =
        CacheShape { layers: 1, num_kv_heads: 2, num_q_heads: 2, max_seqs: 1, max_tokens: 256, num_blocks: None };
    let mut cache = KvCache::new(CacheConfig::k2v2(64), shape, Backend::Cpu).unwrap();
    let s = cache.add_sequence().unwrap();
    let row = Tensor::from_vec(rows(Data::Keys, 2, 64, 1), (1, 2, 64), &Device::Cpu).unwrap();
    let huge = row.broadcast_as((1 << 22, 2, 64)).unwrap();
    assert!(!huge.is_contiguous());
    let (bytes, r) = peak(|| rotkv::candle::append(&mut cache, 0, s, &huge, &huge));
    assert!(matches!(r, Err(rotkv::Error::Capacity(_))), "{r:?}");
    assert!(bytes < 1 << 20, "a refused append of a broadcast took {bytes} bytes");
    // Out of blocks rather than out of max_tokens: refused before the copy too.
    let pool = CacheShape { max_tokens: 1 << 23, num_blocks: Some(2), ..shape };
    let mut cache = KvCache::new(CacheConfig::k2v2(64), pool, Backend::Cpu).unwrap();
    let s = cache.add_sequence().unwrap();
    let (bytes, r) = peak(|| rotkv::candle::append(&mut cache, 0, s, &huge, &huge));
    assert!(matches!(r, Err(rotkv::Error::Capacity(ref e)) if e.contains("blocks")), "{r:?}");
    assert!(bytes < 1 << 20, "a refused append of a broadcast took {bytes} bytes");
    // A broadcast that fits is appended (copied), as any strided tensor.
    let fits = row.broadcast_as((100, 2, 64)).unwrap();
    rotkv::candle::append(&mut cache, 0, s, &fits, &fits).unwrap();
    assert_eq!(cache.len(0, s), Ok(100));
    // A broadcast query of a q_len past the limit is refused before its copy.
    let q = row.broadcast_as((1 << 22, 2, 64)).unwrap();
    let (bytes, r) = peak(|| rotkv::candle::decode_tokens(&cache, 0, &[s], 1 << 22, &q));
    assert!(matches!(r, Err(rotkv::Error::Shape(_))), "{r:?}");
    assert!(bytes < 1 << 20, "a refused decode of a broadcast took {bytes} bytes");
}

/// A SentencePiece vocabulary of nested tokens `a`, `aa`, ..., `a` x k: every split of
/// every token is a merge, so the merges' text grows with k^3 (2000 tokens: 1.3 GB, 2.3
/// GB of memory and 20 s before the setup bound). Within the bound the merges are all
/// kept; past it setup stops at the bound with an error.
#[test]
fn sentencepiece_setup_of_nested_tokens_is_bounded() {
    use rotkv::model::tokenizer::{Tokenizer, sentencepiece_merge_budget};
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let nested = |k: usize| -> (Vec<String>, Vec<f64>) {
        ((1..=k).map(|n| "a".repeat(n)).collect(), (0..k).map(|i| -(i as f64)).collect())
    };
    let (tokens, scores) = nested(300);
    let tok = Tokenizer::sentencepiece(tokens, &scores, &[], false, [None; 3]).unwrap();
    assert_eq!(tok.merge_count(), 300 * 299 / 2, "every split of a nested token is a merge");
    let vocab_bytes = 300 * 301 / 2;
    assert!(tok.setup_bytes() <= sentencepiece_merge_budget(vocab_bytes));
    let text = "a".repeat(1000);
    assert_eq!(tok.decode(&tok.encode(&text).unwrap()).unwrap(), text);
    // 2000 nested tokens (2 MB of vocabulary).
    let (tokens, scores) = nested(2000);
    let budget = sentencepiece_merge_budget(2000 * 2001 / 2);
    let (bytes, r) = peak(|| Tokenizer::sentencepiece(tokens, &scores, &[], false, [None; 3]));
    match r {
        Err(e @ rotkv::Error::Input(_)) => assert!(e.to_string().contains("past the setup bound"), "{e}"),
        other => panic!("{:?}", other.map(|t| t.merge_count())),
    }
    // The merges' text (at most the budget, 80 MB here), their entries and the vocabulary.
    assert!(bytes < budget + (64 << 20), "setup of 2000 nested tokens peaked at {bytes} bytes (budget {budget})");
}
