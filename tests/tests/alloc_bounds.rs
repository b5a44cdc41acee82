//! Work and memory bounded by the input: a counting allocator measures the largest
//! single allocation of a call. (Its own test binary: the allocator counts for every
//! thread of the process, so nothing else may run beside it.)

use rotkv::{Backend, CacheConfig, CacheShape, KvCache};
use rotkv_tests::{Data, rows};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; it only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
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

#[test]
fn explicit_split_counts_are_cut_to_what_the_length_can_use() {
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
