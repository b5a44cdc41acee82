//! The SIMT emulator (feature `sim`): runs a kernel body on the CPU with one OS thread per
//! GPU thread, so the device code is tested without a GPU through the same launch
//! geometry the CUDA backend uses.
//!
//! - Blocks run one after another; the threads of a block run concurrently.
//! - `sync_threads` is a real barrier. Every thread of the block must pass the same
//!   barriers: a thread that finishes releases the barrier it would have held up (no
//!   hang), and the launch then reports a divergent barrier (threads that passed
//!   different numbers of barriers).
//! - Shuffles exchange through a per-warp slot array between two warp barriers, so every
//!   lane of the warp must take part (full-warp semantics).
//! - Dynamic shared memory ([`SimCtx::shared`]) is filled with `0xFF` bytes (NaN as f32
//!   and f16) before each block, so reading what no thread wrote shows up.

use crate::ctx::{Ctx, WARP};
use core::sync::atomic::{AtomicU32, Ordering};
use std::boxed::Box;
use std::cell::UnsafeCell;
use std::format;
use std::string::{String, ToString};
use std::sync::{Mutex, MutexGuard};
use std::vec::Vec;

/// Why a launch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimError(pub String);

impl core::fmt::Display for SimError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

/// A barrier that knows how many threads are still running. Waiters spin on the
/// generation counter with `yield_now` (much cheaper than a condition variable when 32
/// threads meet at every shuffle).
#[derive(Debug)]
struct SimBarrier {
    /// Low 32 bits: threads arrived; high 32 bits: threads still running.
    state: Mutex<(u32, u32)>,
    generation: AtomicU32,
}

impl SimBarrier {
    fn new(n: u32) -> Self {
        Self { state: Mutex::new((0, n)), generation: AtomicU32::new(0) }
    }

    fn lock(&self) -> MutexGuard<'_, (u32, u32)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait(&self) {
        let generation = self.generation.load(Ordering::SeqCst);
        {
            let mut s = self.lock();
            s.0 += 1;
            if s.0 == s.1 {
                s.0 = 0;
                self.generation.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        while self.generation.load(Ordering::SeqCst) == generation {
            std::thread::yield_now();
        }
    }

    /// A thread finished (normally or not): it no longer holds up the barrier.
    fn leave(&self) {
        let mut s = self.lock();
        s.1 -= 1;
        if s.0 > 0 && s.0 == s.1 {
            s.0 = 0;
            self.generation.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// State shared by the threads of one block.
struct Block {
    barrier: SimBarrier,
    /// Per warp: its barrier and two slot arrays used alternately by successive shuffles.
    warps: Vec<(SimBarrier, [[AtomicU32; WARP as usize]; 2])>,
    shared: Box<[UnsafeCell<u128>]>,
    /// Per thread: block barriers and warp barriers passed.
    passed: Vec<(AtomicU32, AtomicU32)>,
}

// SAFETY: the barriers and atomics are Sync; the shared-memory cells are only reached
// through raw pointers by kernel code, which synchronizes with `sync_threads` exactly as
// device code must (the emulator's purpose is to run that code as the GPU would).
unsafe impl Sync for Block {}

impl Block {
    fn new(threads: u32, shared_bytes: usize) -> Self {
        Self {
            barrier: SimBarrier::new(threads),
            warps: (0..threads / WARP)
                .map(|_| (SimBarrier::new(WARP), core::array::from_fn(|_| core::array::from_fn(|_| AtomicU32::new(0)))))
                .collect(),
            shared: (0..shared_bytes.div_ceil(16)).map(|_| UnsafeCell::new(u128::MAX)).collect(),
            passed: (0..threads).map(|_| (AtomicU32::new(0), AtomicU32::new(0))).collect(),
        }
    }

    /// Every thread must have passed the same block barriers, and every lane of a warp
    /// the same warp barriers.
    fn check_convergence(&self) -> Result<(), String> {
        let counts: Vec<(u32, u32)> =
            self.passed.iter().map(|(b, w)| (b.load(Ordering::SeqCst), w.load(Ordering::SeqCst))).collect();
        for (t, &(b, w)) in counts.iter().enumerate() {
            if b != counts[0].0 {
                return Err(format!(
                    "divergent barrier: thread {t} passed {b} sync_threads, thread 0 passed {}",
                    counts[0].0
                ));
            }
            let first = counts[t / WARP as usize * WARP as usize].1;
            if w != first {
                return Err(format!(
                    "divergent barrier: lane {t} took part in {w} shuffles, its warp's lane 0 in {first}"
                ));
            }
        }
        Ok(())
    }
}

/// One emulated GPU thread.
pub struct SimCtx<'a> {
    thread: u32,
    block_idx: [u32; 3],
    block_dim: u32,
    grid_dim: [u32; 3],
    block: &'a Block,
}

impl SimCtx<'_> {
    /// One barrier per shuffle: successive shuffles alternate between two slot arrays,
    /// and a lane can only write an array again after every lane has passed the next
    /// barrier, that is, after every lane has read it.
    fn shuffle(&self, v: f32, src_lane: u32) -> f32 {
        let n = self.block.passed[self.thread as usize].1.fetch_add(1, Ordering::SeqCst);
        let (barrier, slots) = &self.block.warps[(self.thread / WARP) as usize];
        let slots = &slots[(n % 2) as usize];
        slots[self.lane() as usize].store(v.to_bits(), Ordering::SeqCst);
        barrier.wait();
        f32::from_bits(slots[(src_lane % WARP) as usize].load(Ordering::SeqCst))
    }
}

impl Ctx for SimCtx<'_> {
    fn thread_idx(&self) -> u32 {
        self.thread
    }
    fn block_dim(&self) -> u32 {
        self.block_dim
    }
    fn block_idx(&self) -> [u32; 3] {
        self.block_idx
    }
    fn grid_dim(&self) -> [u32; 3] {
        self.grid_dim
    }
    fn sync_threads(&self) {
        self.block.passed[self.thread as usize].0.fetch_add(1, Ordering::SeqCst);
        self.block.barrier.wait();
    }
    fn shfl_xor(&self, v: f32, mask: u32) -> f32 {
        self.shuffle(v, self.lane() ^ mask)
    }
    fn shfl_idx(&self, v: f32, src_lane: u32) -> f32 {
        self.shuffle(v, src_lane)
    }
    /// Filled with `0xFF` (NaN as f32 and f16) before the block starts.
    fn shared(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.block.shared.as_ptr()).cast()
    }
}

/// Leaves the block's barriers when a thread ends, however it ends.
struct Leave<'a>(&'a Block, u32);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.warps[(self.1 / WARP) as usize].0.leave();
        self.0.barrier.leave();
    }
}

/// Runs `kernel` on a `grid` of blocks of `block_dim` threads (a multiple of 32, at most
/// 1024) with `shared_bytes` of dynamic shared memory per block. `block_dim` OS threads
/// serve every block in turn (thread `t` of each block), so blocks overlap in time
/// without sharing state; a panic in one block is reported, and its thread still visits
/// the other blocks, so no barrier waits for it forever.
pub fn launch<F>(grid: [u32; 3], block_dim: u32, shared_bytes: usize, kernel: F) -> Result<(), SimError>
where
    F: Fn(&SimCtx<'_>) + Sync,
{
    if block_dim == 0 || !block_dim.is_multiple_of(WARP) || block_dim > 1024 {
        return Err(SimError(format!("block of {block_dim} threads (a multiple of 32, at most 1024)")));
    }
    let indices: Vec<[u32; 3]> =
        (0..grid[2]).flat_map(|z| (0..grid[1]).flat_map(move |y| (0..grid[0]).map(move |x| [x, y, z]))).collect();
    let blocks: Vec<Block> = indices.iter().map(|_| Block::new(block_dim, shared_bytes)).collect();
    let failures: Vec<(usize, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..block_dim)
            .map(|thread| {
                let (blocks, indices, kernel) = (&blocks, &indices, &kernel);
                std::thread::Builder::new().stack_size(256 << 10).spawn_scoped(s, move || {
                    let mut failed = Vec::new();
                    for (b, block) in blocks.iter().enumerate() {
                        let _leave = Leave(block, thread);
                        let ctx = SimCtx { thread, block_idx: indices[b], block_dim, grid_dim: grid, block };
                        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| kernel(&ctx))) {
                            let msg = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "a thread panicked".into());
                            failed.push((b, msg));
                        }
                    }
                    failed
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h {
                Err(e) => std::vec![(0, format!("cannot start a thread: {e}"))],
                Ok(h) => h.join().unwrap_or_else(|_| std::vec![(0, "a thread died".into())]),
            })
            .collect()
    });
    if let Some((b, msg)) = failures.iter().min_by_key(|f| f.0) {
        let [x, y, z] = indices[*b];
        return Err(SimError(format!("block ({x}, {y}, {z}): {msg}")));
    }
    for (b, block) in blocks.iter().enumerate() {
        let [x, y, z] = indices[b];
        block.check_convergence().map_err(|e| SimError(format!("block ({x}, {y}, {z}): {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_barriers_and_shuffles() {
        let out: Vec<AtomicU32> = (0..2 * 64).map(|_| AtomicU32::new(0)).collect();
        launch([2, 1, 1], 64, 64 * 4, |c| {
            let t = c.thread_idx();
            let sh = c.shared().cast::<f32>();
            // SAFETY: t < 64 and the block has 64 f32 of shared memory.
            unsafe { *sh.add(t as usize) = t as f32 };
            c.sync_threads();
            // SAFETY: as above; every thread wrote its slot before the barrier.
            let neighbour = unsafe { *sh.add(((t + 1) % 64) as usize) };
            let x = c.shfl_xor(t as f32, 1) + c.shfl_idx(100.0 * c.lane() as f32, 3);
            let v = neighbour as u32 * 1000 + x as u32 + c.block_idx()[0] * 1_000_000;
            out[(c.block_idx()[0] * 64 + t) as usize].store(v, Ordering::SeqCst);
        })
        .unwrap();
        for b in 0..2u32 {
            for t in 0..64u32 {
                let want = ((t + 1) % 64) * 1000 + (t ^ 1) + 300 + b * 1_000_000;
                assert_eq!(out[(b * 64 + t) as usize].load(Ordering::SeqCst), want);
            }
        }
    }

    #[test]
    fn unwritten_shared_memory_reads_as_nan() {
        let seen = AtomicU32::new(0);
        launch([1, 1, 1], 32, 128, |c| {
            // SAFETY: 128 bytes = 32 f32; nobody writes them.
            let v = unsafe { *c.shared().cast::<f32>().add(c.thread_idx() as usize) };
            if v.is_nan() {
                seen.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 32);
    }

    #[test]
    fn divergent_barrier_is_an_error_not_a_hang() {
        let r = launch([1, 1, 1], 64, 0, |c| {
            if c.thread_idx() < 40 {
                c.sync_threads();
            }
        });
        assert!(r.unwrap_err().0.contains("divergent barrier"));
        let r = launch([1, 1, 1], 32, 0, |c| {
            if c.lane() != 7 {
                c.shfl_xor(1.0, 1);
            }
        });
        assert!(r.unwrap_err().0.contains("divergent barrier"));
    }

    #[test]
    fn bad_block_sizes_are_rejected() {
        assert!(launch([1, 1, 1], 48, 0, |_| {}).is_err());
        assert!(launch([1, 1, 1], 2048, 0, |_| {}).is_err());
    }
}
