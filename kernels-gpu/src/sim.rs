//! The SIMT emulator (feature `sim`): runs a kernel body on the CPU, each GPU thread a
//! stackful coroutine (`corosensei`) on the launching OS thread, so the device code is
//! tested without a GPU through the same launch geometry the CUDA backend uses.
//!
//! - Blocks run one after another; the threads of a block are interleaved at their
//!   barriers and warp operations: a thread that waits yields to the next (a switch
//!   costs nanoseconds, against microseconds for the futex wake-up and context switch of
//!   the one-OS-thread-per-GPU-thread scheme this replaced, which on two cores spent
//!   most of the test suite's time in the kernel). Under Miri (no stack switching) each
//!   GPU thread is an OS thread, as before, with the same barriers.
//! - A launch where every waiting thread waits for threads that never come (a
//!   deadlock, for example half a warp at a shuffle and the other half at
//!   `sync_threads`) is an error, not a hang: the waiters panic out of their barrier.
//! - `sync_threads` is a real barrier. Every thread of the block must pass the same
//!   barriers: a thread that finishes releases the barrier it would have held up (no
//!   hang), and the launch then reports a divergent barrier (threads that passed
//!   different numbers of barriers).
//! - Warp operations (shuffles, `mma_m16n8k16`) exchange through a per-warp slot array
//!   at a warp barrier, so every lane of the warp must take part (full-warp semantics):
//!   a lane that skips one, or runs a different one, is reported as a divergent barrier.
//! - `mma_m16n8k16` is computed from the PTX ISA fragment layout in one exchange (f32
//!   products and sums); `load16` of a misaligned address is a launch error, as are
//!   `load_shared16` / `load_shared8` of one or of bytes outside the block's shared memory.
//! - `cp_async16` copies are deferred to the `cp_async_wait` that retires their group, and
//!   the destination is filled with NaN when the copy is issued, so a kernel that reads
//!   it without waiting sees NaN (a refilled buffer too).
//! - `ldmatrix` (`x2`/`x4`, plain and `.trans`) exchanges the row addresses in one warp
//!   operation; every lane checks every row (aligned, inside the block's shared memory)
//!   and the ordering of the `cp.async` copies it reads: each 16-byte unit of shared
//!   memory records its last copy (thread, landed or not, the thread's barrier counts) and
//!   its last `ldmatrix` reader. Reading another thread's copy that is still in flight, or
//!   that landed with no barrier since (a `sync_warp` within a warp, a `sync_threads`
//!   across warps), is a launch error, and so is a copy into a unit an `ldmatrix` read
//!   with no barrier since (only the last reader is kept: a read by another warp earlier
//!   in the same interval is not seen). Plain loads of shared memory are not checked this
//!   way (a read before the copy's wait sees NaN).
//! - Dynamic shared memory ([`SimCtx::shared`]) is filled with `0xFF` bytes (NaN as f32
//!   and f16) before each block, so reading what no thread wrote shows up.

use crate::ctx::{Ctx, WARP, ldmatrix_fragment};
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::boxed::Box;
use std::cell::{RefCell, UnsafeCell};
use std::collections::VecDeque;
use std::format;
use std::string::{String, ToString};
use std::sync::OnceLock;
use std::thread::Thread;
use std::vec::Vec;

/// What a waiting emulated thread suspends to: the coroutine scheduler of its launch
/// (`None` when each emulated thread is an OS thread, which parks instead).
type Yield<'a> = Option<&'a corosensei::Yielder<(), ()>>;

std::thread_local! {
    /// Barrier openings and passages on this OS thread: the coroutine scheduler's
    /// measure of progress (a round of resumptions that moves nothing is a deadlock).
    static PROGRESS: core::cell::Cell<u64> = const { core::cell::Cell::new(0) };
    /// Set by the scheduler when it found a deadlock: every waiter then panics.
    static DEADLOCK: core::cell::Cell<bool> = const { core::cell::Cell::new(false) };
}

fn progress() {
    PROGRESS.with(|p| p.set(p.get().wrapping_add(1)));
}

/// Why a launch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimError(pub String);

impl core::fmt::Display for SimError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

/// A barrier that knows how many threads are still running, for the `members` of a block
/// or a warp (the OS threads that serve them).
///
/// Arrivals and departures update one atomic word. A waiter yields its core a few times
/// (enough when the members advance in step: the ones it waits for run meanwhile), then
/// parks; the thread that opens the barrier (the last to arrive, or a finishing thread,
/// [`SimBarrier::leave`]) unparks the members. Yielding forever instead of parking wastes
/// the cores when many more emulated threads than cores wait on a few (a warp's shuffles
/// while the other warps of a 128-thread block wait at `sync_threads`); parking at once
/// costs a futex wake-up per member per barrier when they do advance in step.
#[derive(Debug)]
struct SimBarrier {
    /// Bits 0..16: threads arrived at the current generation; bits 16..32: threads still
    /// running; bits 32..64: the generation, bumped each time the barrier opens.
    state: AtomicU64,
}

const ARRIVED: u64 = 0xffff;
const ONE_RUNNING: u64 = 1 << 16;
const ONE_GENERATION: u64 = 1 << 32;

/// Times a waiter yields (re-checking the barrier word) before it parks.
const YIELDS: u32 = 8;

impl SimBarrier {
    fn new(n: u32) -> Self {
        Self { state: AtomicU64::new(u64::from(n) * ONE_RUNNING) }
    }

    /// The state after `s` with `arrived` threads arrived and `running` running: the
    /// barrier opens (next generation, none arrived) when every running thread arrived.
    fn next(s: u64, arrived: u64, running: u64) -> (u64, bool) {
        let generation = s & !(ONE_GENERATION - 1);
        if arrived > 0 && arrived == running {
            (generation.wrapping_add(ONE_GENERATION) | (running * ONE_RUNNING), true)
        } else {
            (generation | (running * ONE_RUNNING) | arrived, false)
        }
    }

    /// Applies `f` (arrived, running -> arrived, running) atomically; returns the state
    /// before and whether the barrier opened.
    fn update(&self, f: impl Fn(u64, u64) -> (u64, u64)) -> (u64, bool) {
        let mut s = self.state.load(Ordering::SeqCst);
        loop {
            let (arrived, running) = f(s & ARRIVED, (s >> 16) & ARRIVED);
            let (new, opened) = Self::next(s, arrived, running);
            match self.state.compare_exchange_weak(s, new, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return (s, opened),
                Err(now) => s = now,
            }
        }
    }

    /// Unparks every member but `me` (a member not parked keeps the token, and its next
    /// `park` returns at once: waiters re-check the barrier word).
    fn open(members: &[OnceLock<Thread>], me: usize) {
        for (i, m) in members.iter().enumerate() {
            if i != me
                && let Some(t) = m.get()
            {
                t.unpark();
            }
        }
    }

    /// Waits until every running member arrived; `me` is the caller's index in `members`.
    /// A coroutine (`yielder`) suspends until then; an OS thread yields, then parks.
    fn wait(&self, members: &[OnceLock<Thread>], me: usize, yielder: Yield<'_>) {
        let (s, opened) = self.update(|arrived, running| (arrived + 1, running));
        if opened {
            progress();
            Self::open(members, me);
            return;
        }
        let generation = s >> 32;
        let closed = || self.state.load(Ordering::SeqCst) >> 32 == generation;
        if let Some(y) = yielder {
            loop {
                if !closed() {
                    progress();
                    return;
                }
                if DEADLOCK.with(|d| d.get()) {
                    panic!(
                        "deadlock: every waiting thread of the block waits at a barrier the others never reach \
                         (a divergent sync_threads or warp operation)"
                    );
                }
                y.suspend(());
            }
        }
        for _ in 0..YIELDS {
            if !closed() {
                return;
            }
            std::thread::yield_now();
        }
        while closed() {
            std::thread::park();
        }
    }

    /// A member finished (normally or not): it no longer holds up the barrier.
    fn leave(&self, members: &[OnceLock<Thread>], me: usize) {
        let (_, opened) = self.update(|arrived, running| (arrived, running - 1));
        if opened {
            progress();
            Self::open(members, me);
        }
    }
}

/// Words one lane publishes for a warp operation: a tag (the operation's number and
/// kind), then the payload (a shuffle uses one word, an mma the four A and two B words).
const SLOT_WORDS: usize = 7;
/// Operation kinds in a slot's tag (its low [`OP_BITS`] bits).
const OP_SHFL: u32 = 0;
const OP_MMA: u32 = 1;
/// `ldmatrix`: plus 1 for `.trans`, plus 2 for `x4` (else `x2`).
const OP_LDMATRIX: u32 = 2;
const OP_SYNC_WARP: u32 = 6;
const OP_BITS: u32 = 3;

/// What a warp operation of tag `t` was, for messages.
fn op_name(t: u32) -> &'static str {
    match t & ((1 << OP_BITS) - 1) {
        OP_SHFL => "a shuffle",
        OP_MMA => "an mma",
        2 => "an ldmatrix x2",
        3 => "an ldmatrix x2.trans",
        4 => "an ldmatrix x4",
        5 => "an ldmatrix x4.trans",
        _ => "a sync_warp",
    }
}

/// One warp's exchange: its barrier and two slot arrays, one slot per lane, used
/// alternately by successive warp operations (shuffles and mma).
struct Warp {
    barrier: SimBarrier,
    slots: [[[AtomicU32; SLOT_WORDS]; WARP as usize]; 2],
}

/// State shared by the threads of one block.
struct Block {
    barrier: SimBarrier,
    warps: Vec<Warp>,
    shared: Box<[UnsafeCell<u128>]>,
    /// Per thread: block barriers and warp barriers passed.
    passed: Vec<(AtomicU32, AtomicU32)>,
    /// Per thread: `sync_warp`s passed.
    warp_syncs: Vec<AtomicU32>,
    /// Per 16-byte unit of shared memory: the last `cp.async` copy into it ([`Access`]).
    copies: Box<[AtomicU64]>,
    /// Per 16-byte unit: the last `ldmatrix` read of it ([`Access`], `landed` unset).
    reads: Box<[AtomicU64]>,
}

/// Who wrote (a `cp.async` copy) or read (an `ldmatrix` row) a unit of shared memory, and
/// when: the thread, whether the copy has landed (its group retired), and the thread's
/// barrier counts then (block barriers; block barriers plus `sync_warp`s). Packed into a
/// `u64`, 0 for none.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Access {
    thread: u32,
    landed: bool,
    block: u32,
    all: u32,
}

impl Access {
    fn pack(self) -> u64 {
        u64::from(self.thread + 1)
            | u64::from(self.landed) << 11
            | u64::from(self.block & 0xf_ffff) << 12
            | u64::from(self.all) << 32
    }
    fn unpack(x: u64) -> Option<Self> {
        (x != 0).then(|| Self {
            thread: (x & 0x7ff) as u32 - 1,
            landed: x >> 11 & 1 == 1,
            block: (x >> 12 & 0xf_ffff) as u32,
            all: (x >> 32) as u32,
        })
    }
    /// Whether a barrier both threads passed separates this access from `other`'s
    /// (`other` happening now, in a thread with the counts `other.block`, `other.all`):
    /// within a warp any barrier (`sync_warp` or `sync_threads`), across warps a
    /// `sync_threads`. The counts only grow, so "passed one since" is "differs" (which
    /// also holds when the 20-bit block count wraps).
    fn ordered_before(self, other: Access) -> bool {
        if self.thread / WARP == other.thread / WARP { other.all != self.all } else { other.block != self.block }
    }
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
                .map(|_| Warp {
                    barrier: SimBarrier::new(WARP),
                    slots: core::array::from_fn(|_| {
                        core::array::from_fn(|_| core::array::from_fn(|_| AtomicU32::new(u32::MAX)))
                    }),
                })
                .collect(),
            shared: (0..shared_bytes.div_ceil(16)).map(|_| UnsafeCell::new(u128::MAX)).collect(),
            passed: (0..threads).map(|_| (AtomicU32::new(0), AtomicU32::new(0))).collect(),
            warp_syncs: (0..threads).map(|_| AtomicU32::new(0)).collect(),
            copies: (0..shared_bytes.div_ceil(16)).map(|_| AtomicU64::new(0)).collect(),
            reads: (0..shared_bytes.div_ceil(16)).map(|_| AtomicU64::new(0)).collect(),
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

/// A thread's cp.async copies (destination, source) not yet performed: the open group
/// and the committed groups, oldest first.
#[derive(Default)]
struct CpAsync {
    open: Vec<(*mut u8, *const u8)>,
    committed: VecDeque<Vec<(*mut u8, *const u8)>>,
}

/// One emulated GPU thread.
pub struct SimCtx<'a> {
    thread: u32,
    block_idx: [u32; 3],
    block_dim: u32,
    grid_dim: [u32; 3],
    block: &'a Block,
    /// The OS threads serving the block's threads, by thread index (for unparking; unset
    /// when the threads are coroutines).
    members: &'a [OnceLock<Thread>],
    /// The coroutine scheduler to suspend to at a barrier (`None`: an OS thread).
    yielder: Yield<'a>,
    cp_async: RefCell<CpAsync>,
}

type Slots = [[AtomicU32; SLOT_WORDS]; WARP as usize];

impl SimCtx<'_> {
    /// One warp operation: publishes `words` in the lane's slot, tagged with the lane's
    /// operation number and `kind`, and waits at the warp barrier. Returns the slot array
    /// every lane of the warp wrote for this operation and the tag each must carry.
    ///
    /// One barrier per operation: successive operations alternate between two slot
    /// arrays, and a lane can only write an array again after every lane has passed the
    /// next barrier, that is, after every lane has read it. Counts as warp participation
    /// for the convergence check.
    fn warp_exchange(&self, kind: u32, words: &[u32]) -> (&Slots, u32) {
        let n = self.block.passed[self.thread as usize].1.fetch_add(1, Ordering::SeqCst);
        let warp = &self.block.warps[(self.thread / WARP) as usize];
        let slots = &warp.slots[(n % 2) as usize];
        let mine = &slots[self.lane() as usize];
        for (w, &v) in mine[1..].iter().zip(words) {
            w.store(v, Ordering::SeqCst);
        }
        let tag = n.wrapping_shl(OP_BITS) | kind;
        mine[0].store(tag, Ordering::SeqCst);
        let base = (self.thread / WARP * WARP) as usize;
        warp.barrier.wait(&self.members[base..base + WARP as usize], self.lane() as usize, self.yielder);
        (slots, tag)
    }

    /// Panics (a launch error) unless lane `src` took part in the same warp operation.
    fn check_lane(&self, slots: &Slots, src: u32, tag: u32) {
        let got = slots[src as usize][0].load(Ordering::SeqCst);
        if got != tag {
            let what = op_name;
            let warp_base = self.thread / WARP * WARP;
            if got >> OP_BITS == tag >> OP_BITS {
                panic!(
                    "divergent barrier: in warp operation {} lane {} ran {} while thread {} ran {}",
                    tag >> OP_BITS,
                    warp_base + src,
                    what(got),
                    self.thread,
                    what(tag)
                );
            }
            panic!(
                "divergent barrier: thread {} did not take part in warp operation {} ({}) of thread {}",
                warp_base + src,
                tag >> OP_BITS,
                what(tag),
                self.thread
            );
        }
    }

    /// `ldmatrix` of `N` matrices (see [`Ctx::ldmatrix_x4`]): the lanes' row addresses in
    /// one exchange, each of the `8 N` that are read checked by every lane.
    ///
    /// # Safety
    /// Nobody writes the rows during the call.
    unsafe fn ldmatrix<const N: usize>(&self, row: *const u8, trans: bool) -> [u32; N] {
        let a = row.addr() as u64;
        let kind = OP_LDMATRIX + u32::from(trans) + if N == 4 { 2 } else { 0 };
        let (slots, tag) = self.warp_exchange(kind, &[a as u32, (a >> 32) as u32]);
        let shared = self.shared().cast_const();
        let (base, end) = (shared.addr(), shared.addr() + self.block.shared.len() * 16);
        let rows: [*const u8; 32] = core::array::from_fn(|src| {
            let src = src as u32;
            if src >= 8 * N as u32 {
                return shared;
            }
            self.check_lane(slots, src, tag);
            let word = |w: usize| slots[src as usize][1 + w].load(Ordering::SeqCst) as u64;
            let at = (word(0) | word(1) << 32) as usize;
            assert!(
                at.is_multiple_of(16) && at >= base && at + 16 <= end,
                "ldmatrix row {at:#x} of lane {src} misaligned or outside the block's shared memory"
            );
            shared.with_addr(at)
        });
        // Every lane checks every row read, so that all of them report a race alike.
        let now = self.now(false);
        for &row in &rows[..8 * N] {
            let u = self.unit(row);
            if let Some(c) = Access::unpack(self.block.copies[u].load(Ordering::SeqCst)) {
                assert!(
                    c.landed || c.thread == self.thread,
                    "ldmatrix reads shared memory (unit {u}) that a cp.async of thread {} is still copying (its group not retired)",
                    c.thread
                );
                assert!(
                    c.thread == self.thread || c.ordered_before(now),
                    "ldmatrix reads a cp.async copy of thread {} (unit {u}) with no barrier since it landed: \
                     cp.async.wait_group makes a copy visible to its own thread only; a sync_warp or \
                     sync_threads of both must follow",
                    c.thread
                );
            }
            self.block.reads[u].store(now.pack(), Ordering::SeqCst);
        }
        // SAFETY: rows checked inside the shared memory.
        unsafe { ldmatrix_fragment(self.lane(), trans, |i, r| rows[(8 * i + r) as usize]) }
    }

    /// This thread now, for the records of [`Block::copies`] and [`Block::reads`].
    fn now(&self, landed: bool) -> Access {
        let t = self.thread as usize;
        let block = self.block.passed[t].0.load(Ordering::SeqCst);
        let all = block + self.block.warp_syncs[t].load(Ordering::SeqCst);
        // The packed record keeps 20 bits of the block count (a million barriers).
        Access { thread: self.thread, landed, block: block & 0xf_ffff, all }
    }

    /// The 16-byte unit of shared memory at `p` (inside it: checked by the callers).
    fn unit(&self, p: *const u8) -> usize {
        (p.addr() - self.shared().addr()) / 16
    }

    fn shuffle(&self, v: u32, src_lane: u32) -> u32 {
        let src = src_lane % WARP;
        let (slots, tag) = self.warp_exchange(OP_SHFL, &[v]);
        self.check_lane(slots, src, tag);
        slots[src as usize][1].load(Ordering::SeqCst)
    }
}

impl SimCtx<'_> {
    /// `n` bytes at `p`, `n`-byte aligned, inside the block's shared memory (else a
    /// launch error naming `what`).
    fn check_shared(&self, what: &str, p: *const u8, n: usize) {
        assert!(p.addr().is_multiple_of(n), "{what} of a misaligned address {p:p} ({n}-byte alignment required)");
        let base = self.shared().addr();
        let end = base + self.block.shared.len() * 16;
        assert!(p.addr() >= base && p.addr() + n <= end, "{what} at {p:p}: outside the block's shared memory");
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
        self.block.barrier.wait(self.members, self.thread as usize, self.yielder);
    }
    fn shfl_xor(&self, v: f32, mask: u32) -> f32 {
        f32::from_bits(self.shuffle(v.to_bits(), self.lane() ^ mask))
    }
    fn shfl_idx(&self, v: f32, src_lane: u32) -> f32 {
        f32::from_bits(self.shuffle(v.to_bits(), src_lane))
    }
    fn shfl_idx_u32(&self, v: u32, src_lane: u32) -> u32 {
        self.shuffle(v, src_lane)
    }
    /// A warp barrier (every lane must take part) that also counts, for the emulator's
    /// check that a lane reads another lane's `cp.async` copy only after a barrier.
    fn sync_warp(&self) {
        let (slots, tag) = self.warp_exchange(OP_SYNC_WARP, &[]);
        for src in 0..WARP {
            self.check_lane(slots, src, tag);
        }
        self.block.warp_syncs[self.thread as usize].fetch_add(1, Ordering::SeqCst);
    }
    /// From the PTX ISA fragment layout (see [`Ctx::mma_m16n8k16`]): every lane publishes
    /// its A and B words, then computes its four outputs from the whole warp's. Products
    /// and sums in f32, `k` ascending from `c` (the hardware's order and internal
    /// precision are unspecified; tests use exactly representable sums).
    fn mma_m16n8k16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        let (slots, tag) = self.warp_exchange(OP_MMA, &[a[0], a[1], a[2], a[3], b[0], b[1]]);
        for src in 0..WARP {
            self.check_lane(slots, src, tag);
        }
        let word = |lane: u32, w: usize| slots[lane as usize][1 + w].load(Ordering::SeqCst);
        let half = |w: u32, k: u32| crate::math::f16_to_f32((w >> (16 * (k % 2))) as u16);
        // A[row][k]: lane 4 * (row % 8) + k % 8 / 2, register (row >= 8) + 2 * (k >= 8).
        let a_at = |row: u32, k: u32| half(word(4 * (row % 8) + k % 8 / 2, ((row / 8) + 2 * (k / 8)) as usize), k);
        // B[k][col]: lane 4 * col + k % 8 / 2, register k >= 8 (after A's four).
        let b_at = |k: u32, col: u32| half(word(4 * col + k % 8 / 2, 4 + (k / 8) as usize), k);
        let (g, t) = (self.lane() / 4, self.lane() % 4);
        core::array::from_fn(|i| {
            let (row, col) = (g + 8 * (i as u32 / 2), 2 * t + i as u32 % 2);
            (0..16).fold(c[i], |acc, k| acc + a_at(row, k) * b_at(k, col))
        })
    }
    /// Deferred: the copy happens in the [`Ctx::cp_async_wait`] that retires its group
    /// (the source is read then), so reading the destination before that wait sees the
    /// NaN fill. Panics (a launch error) on a misaligned address or a destination outside
    /// the block's shared memory.
    unsafe fn cp_async16(&self, dst_shared: *mut u8, src_global: *const u8) {
        assert!(
            dst_shared.addr().is_multiple_of(16) && src_global.addr().is_multiple_of(16),
            "cp_async16 of a misaligned address ({dst_shared:p} <- {src_global:p}; 16-byte alignment required)"
        );
        let base = self.shared().addr();
        let end = base + self.block.shared.len() * 16;
        assert!(
            dst_shared.addr() >= base && dst_shared.addr() + 16 <= end,
            "cp_async16 destination {dst_shared:p} outside the block's shared memory"
        );
        let u = self.unit(dst_shared);
        let now = self.now(false);
        // An ldmatrix row goes to other lanes: whoever read it last, this lane included, a
        // barrier must separate the read from the new copy.
        if let Some(r) = Access::unpack(self.block.reads[u].load(Ordering::SeqCst)) {
            assert!(
                r.ordered_before(now),
                "cp_async16 into shared memory (unit {u}) that thread {} read with ldmatrix with no barrier since",
                r.thread
            );
        }
        self.block.copies[u].store(now.pack(), Ordering::SeqCst);
        // The destination reads as NaN until the copy lands, a refilled buffer too, so a
        // plain load that does not wait for it shows.
        // SAFETY: 16 bytes of this block's shared memory (checked above).
        unsafe { core::ptr::write_bytes(dst_shared, 0xff, 16) };
        self.cp_async.borrow_mut().open.push((dst_shared, src_global));
    }
    fn cp_async_commit(&self) {
        let mut cp = self.cp_async.borrow_mut();
        let group = core::mem::take(&mut cp.open);
        cp.committed.push_back(group);
    }
    fn cp_async_wait(&self, n: u32) {
        let mut cp = self.cp_async.borrow_mut();
        while cp.committed.len() > n as usize {
            for (dst, src) in cp.committed.pop_front().unwrap_or_default() {
                // SAFETY: the `cp_async16` contract: both valid for 16 bytes, `dst` in
                // this block's shared memory (checked), `src` not written.
                unsafe { core::ptr::copy_nonoverlapping(src, dst, 16) };
                self.block.copies[self.unit(dst)].store(self.now(true).pack(), Ordering::SeqCst);
            }
        }
    }
    /// One warp exchange of the row addresses; every lane checks all of them (16-byte
    /// aligned, inside the block's shared memory: else a launch error, reported by every
    /// lane alike) and reads its elements as the PTX ISA lays them out.
    unsafe fn ldmatrix_x4(&self, row: *const u8, trans: bool) -> [u32; 4] {
        // SAFETY: forwarded contract; the addresses are checked.
        unsafe { self.ldmatrix(row, trans) }
    }
    /// As `ldmatrix_x4`, with lanes 0-15's addresses.
    unsafe fn ldmatrix_x2(&self, row: *const u8, trans: bool) -> [u32; 2] {
        // SAFETY: as above.
        unsafe { self.ldmatrix(row, trans) }
    }
    /// Panics (a launch error) unless `p` is 16-byte aligned, as the device would fault.
    unsafe fn load16(&self, p: *const u8) -> [u32; 4] {
        assert!(p.addr().is_multiple_of(16), "load16 of a misaligned address {p:p} (16-byte alignment required)");
        // SAFETY: forwarded contract; alignment checked above.
        unsafe { *p.cast::<[u32; 4]>() }
    }
    /// Panics (a launch error) unless `p` is 16-byte aligned and its 16 bytes lie in the
    /// block's shared memory, as `ld.shared` requires.
    unsafe fn load_shared16(&self, p: *const u32) -> [u32; 4] {
        self.check_shared("load_shared16", p.cast(), 16);
        // SAFETY: forwarded contract; alignment and bounds checked above.
        unsafe { *p.cast::<[u32; 4]>() }
    }
    /// As `load_shared16`, 8 bytes.
    unsafe fn load_shared8(&self, p: *const u32) -> [u32; 2] {
        self.check_shared("load_shared8", p.cast(), 8);
        // SAFETY: as above.
        unsafe { *p.cast::<[u32; 2]>() }
    }
    /// Filled with `0xFF` (NaN as f32 and f16) before the block starts.
    fn shared(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.block.shared.as_ptr()).cast()
    }
}

/// Leaves the block's barriers when a thread ends, however it ends.
struct Leave<'a>(&'a Block, &'a [OnceLock<Thread>], u32);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let Self(block, members, thread) = *self;
        let base = (thread / WARP * WARP) as usize;
        block.warps[(thread / WARP) as usize]
            .barrier
            .leave(&members[base..base + WARP as usize], (thread % WARP) as usize);
        block.barrier.leave(members, thread as usize);
    }
}

/// Dynamic shared memory a kernel may use without opting in: 48 KiB.
pub const SHARED_DEFAULT_MAX: u32 = 48 << 10;
/// The opt-in maximum of dynamic shared memory per block on sm_80 (A100): 163 KiB.
pub const SHARED_OPTIN_MAX_SM80: u32 = 163 << 10;
/// The opt-in maximum of dynamic shared memory per block on sm_90 (H100, H200): 227 KiB.
pub const SHARED_OPTIN_MAX_SM90: u32 = 227 << 10;
/// `gridDim.x` at most 2^31 - 1.
pub const GRID_X_MAX: u32 = (1 << 31) - 1;
/// `gridDim.y` and `gridDim.z` at most 65535.
pub const GRID_YZ_MAX: u32 = 65535;

/// Runs `kernel` on a `grid` of blocks of `block_dim` threads (a multiple of 32, at most
/// 1024) with `shared_bytes` of dynamic shared memory per block, at most
/// [`SHARED_DEFAULT_MAX`] (48 KiB; see [`launch_with`] to opt in to more). `block_dim`
/// coroutines (OS threads under Miri) serve every block in turn (thread `t` of each
/// block), so blocks overlap in time without sharing state; a panic in one block is
/// reported, and its thread still visits the other blocks, so no barrier waits for it
/// forever.
///
/// The device's launch limits are errors here too: a grid dimension of 0, `gridDim.x`
/// above [`GRID_X_MAX`], `gridDim.y` or `.z` above [`GRID_YZ_MAX`].
pub fn launch<F>(grid: [u32; 3], block_dim: u32, shared_bytes: usize, kernel: F) -> Result<(), SimError>
where
    F: Fn(&SimCtx<'_>) + Sync,
{
    launch_with(grid, block_dim, shared_bytes, SHARED_DEFAULT_MAX, kernel)
}

/// [`launch`] for a kernel that opts in to `max_dynamic_shared` bytes of dynamic shared
/// memory (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`, which the CUDA backend must
/// set to the same value): `shared_bytes` may be up to it, and it may be up to
/// [`SHARED_OPTIN_MAX_SM90`] (227 KiB; an sm_80 GPU allows [`SHARED_OPTIN_MAX_SM80`],
/// 163 KiB, so a kernel meant for both stays under that).
pub fn launch_with<F>(
    grid: [u32; 3],
    block_dim: u32,
    shared_bytes: usize,
    max_dynamic_shared: u32,
    kernel: F,
) -> Result<(), SimError>
where
    F: Fn(&SimCtx<'_>) + Sync,
{
    if block_dim == 0 || !block_dim.is_multiple_of(WARP) || block_dim > 1024 {
        return Err(SimError(format!("block of {block_dim} threads (a multiple of 32, at most 1024)")));
    }
    let [x, y, z] = grid;
    if x == 0 || y == 0 || z == 0 || x > GRID_X_MAX || y > GRID_YZ_MAX || z > GRID_YZ_MAX {
        return Err(SimError(format!(
            "grid ({x}, {y}, {z}): each dimension at least 1, x at most {GRID_X_MAX}, y and z at most {GRID_YZ_MAX}"
        )));
    }
    if max_dynamic_shared > SHARED_OPTIN_MAX_SM90 {
        return Err(SimError(format!(
            "opt-in of {max_dynamic_shared} bytes of dynamic shared memory: no GPU allows more than \
             {SHARED_OPTIN_MAX_SM90} (227 KiB on sm_90, 163 KiB on sm_80)"
        )));
    }
    if shared_bytes > max_dynamic_shared as usize {
        return Err(SimError(if max_dynamic_shared == SHARED_DEFAULT_MAX {
            format!(
                "{shared_bytes} bytes of dynamic shared memory: more than {SHARED_DEFAULT_MAX} (48 KiB) needs an \
                 opt-in (launch_with)"
            )
        } else {
            format!(
                "{shared_bytes} bytes of dynamic shared memory: more than the kernel's opt-in of {max_dynamic_shared}"
            )
        }));
    }
    let indices: Vec<[u32; 3]> =
        (0..grid[2]).flat_map(|z| (0..grid[1]).flat_map(move |y| (0..grid[0]).map(move |x| [x, y, z]))).collect();
    let blocks: Vec<Block> = indices.iter().map(|_| Block::new(block_dim, shared_bytes)).collect();
    let members: Vec<OnceLock<Thread>> = (0..block_dim).map(|_| OnceLock::new()).collect();
    // Thread `thread` of every block in turn; the failures (block, message).
    let lane = |thread: u32, yielder: Yield<'_>| -> Vec<(usize, String)> {
        let mut failed = Vec::new();
        for (b, block) in blocks.iter().enumerate() {
            let _leave = Leave(block, &members, thread);
            let ctx = SimCtx {
                thread,
                block_idx: indices[b],
                block_dim,
                grid_dim: grid,
                block,
                members: &members,
                yielder,
                cp_async: RefCell::default(),
            };
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
    };
    #[cfg(not(miri))]
    let failures: Vec<(usize, String)> = fibers::run(block_dim as usize, |t, y| lane(t as u32, Some(y)))
        .map_err(SimError)?
        .into_iter()
        .flatten()
        .collect();
    #[cfg(miri)]
    let failures: Vec<(usize, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..block_dim)
            .map(|thread| {
                let (lane, members) = (&lane, &members[..]);
                std::thread::Builder::new().stack_size(STACK_BYTES).spawn_scoped(s, move || {
                    let _ = members[thread as usize].set(std::thread::current());
                    lane(thread, None)
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

/// Stack of one emulated thread (a coroutine's, or an OS thread's under Miri).
const STACK_BYTES: usize = 256 << 10;

/// The emulated threads of a launch as stackful coroutines on the calling OS thread.
#[cfg(not(miri))]
mod fibers {
    use super::{DEADLOCK, PROGRESS, STACK_BYTES};
    use corosensei::stack::DefaultStack;
    use corosensei::{CoroutineResult, ScopedCoroutine, ScopedCoroutineRef, Yielder};
    use std::cell::RefCell;
    use std::format;
    use std::string::String;
    use std::vec::Vec;

    type Lane<'a, R> = ScopedCoroutine<'a, (), (), R, &'a mut DefaultStack>;
    type LaneRef<'s, 'a, R> = ScopedCoroutineRef<'s, (), (), R, &'a mut DefaultStack>;

    std::thread_local! {
        /// Coroutine stacks kept between launches on this OS thread (mapping a fresh
        /// stack per emulated thread per launch costs three system calls).
        static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
    }

    /// Runs `body(t, yielder)` for `t` in `0..n`, each in its own coroutine, resuming
    /// them in turn until all return (a body suspends at a barrier it must wait at).
    /// A round of resumptions in which no barrier opens or passes and no body returns
    /// is a deadlock: [`DEADLOCK`] is raised, so the waiters panic out of their barriers
    /// (their bodies catch it as a launch failure) and the bodies still return.
    pub(super) fn run<R>(n: usize, body: impl Fn(usize, &Yielder<(), ()>) -> R) -> Result<Vec<R>, String> {
        let mut stacks = STACKS.with(|s| {
            let mut s = s.borrow_mut();
            let keep = s.len().saturating_sub(n);
            s.split_off(keep)
        });
        while stacks.len() < n {
            stacks.push(DefaultStack::new(STACK_BYTES).map_err(|e| format!("cannot map a thread stack: {e}"))?);
        }
        let body = &body;
        let lanes: Vec<Lane<'_, R>> = stacks
            .iter_mut()
            .enumerate()
            .rev()
            .map(|(t, stack)| ScopedCoroutine::with_stack(stack, move |y: &Yielder<(), ()>, ()| body(t, y)))
            .collect();
        DEADLOCK.with(|d| d.set(false));
        let out = nest(lanes, Vec::new());
        DEADLOCK.with(|d| d.set(false));
        STACKS.with(|s| s.borrow_mut().append(&mut stacks));
        Ok(out)
    }

    /// Opens the scope of each coroutine in `lanes` (last first), then schedules them all.
    fn nest<'a, R>(mut lanes: Vec<Lane<'a, R>>, refs: Vec<LaneRef<'_, 'a, R>>) -> Vec<R> {
        match lanes.pop() {
            None => schedule(refs),
            Some(lane) => lane.scope(|r| {
                let mut refs = refs;
                refs.push(r);
                nest(lanes, refs)
            }),
        }
    }

    fn schedule<R>(mut lanes: Vec<LaneRef<'_, '_, R>>) -> Vec<R> {
        let mut out: Vec<Option<R>> = lanes.iter().map(|_| None).collect();
        let mut left = lanes.len();
        while left > 0 {
            let before = PROGRESS.with(|p| p.get());
            let mut returned = false;
            for (lane, out) in lanes.iter_mut().zip(out.iter_mut()) {
                if out.is_some() {
                    continue;
                }
                if let CoroutineResult::Return(r) = lane.resume(()) {
                    *out = Some(r);
                    left -= 1;
                    returned = true;
                }
            }
            if !returned && PROGRESS.with(|p| p.get()) == before {
                DEADLOCK.with(|d| d.set(true));
            }
        }
        out.into_iter().map(|r| r.expect("every lane returned")).collect()
    }
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

    /// Deterministic xorshift64* generator.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// A random permutation of `lo..lo + n`.
        fn perm(&mut self, lo: i64, n: usize) -> Vec<i64> {
            let mut v: Vec<i64> = (lo..lo + n as i64).collect();
            for i in (1..n).rev() {
                v.swap(i, self.below(i as u64 + 1) as usize);
            }
            v
        }
        fn sign(&mut self) -> f64 {
            if self.next() & 1 == 0 { 1.0 } else { -1.0 }
        }
    }

    /// Bits of `x`, which must be exactly representable as f16.
    fn f16_bits(x: f64) -> u16 {
        let h = half::f16::from_f64(x);
        assert_eq!(h.to_f64(), x, "test value not exact in f16");
        h.to_bits()
    }

    /// One warp's mma operands as matrices (A 16 x 16, B 16 x 8, C 16 x 8).
    #[derive(Clone)]
    struct Mats {
        a: Vec<[f64; 16]>,
        b: Vec<[f64; 8]>,
        c: Vec<[f64; 8]>,
    }

    impl Mats {
        /// Every element distinct in magnitude (a permutation of small integers), random
        /// signs and power-of-two scales: a swapped row, column, half or register changes
        /// the result, and every f32 sum of the product is exact.
        fn random(rng: &mut Rng) -> Self {
            let pa = rng.perm(1, 256);
            let pb = rng.perm(1, 128);
            let pc = rng.perm(1, 128);
            let mut a = std::vec![[0.0; 16]; 16];
            let mut b = std::vec![[0.0; 8]; 16];
            let mut c = std::vec![[0.0; 8]; 16];
            for r in 0..16 {
                for k in 0..16 {
                    a[r][k] = rng.sign() * pa[r * 16 + k] as f64 * [0.5, 1.0][rng.below(2) as usize];
                }
            }
            for k in 0..16 {
                for n in 0..8 {
                    b[k][n] = rng.sign() * pb[k * 8 + n] as f64 * [0.25, 0.5, 1.0][rng.below(3) as usize];
                }
            }
            for r in 0..16 {
                for n in 0..8 {
                    c[r][n] = rng.sign() * pc[r * 8 + n] as f64 * 0.125;
                }
            }
            Self { a, b, c }
        }

        /// D = A * B + C in f64, checked to be exact in f32.
        fn product(&self) -> Vec<[f64; 8]> {
            let mut d = self.c.clone();
            for (r, row) in d.iter_mut().enumerate() {
                for (n, v) in row.iter_mut().enumerate() {
                    *v += (0..16).map(|k| self.a[r][k] * self.b[k][n]).sum::<f64>();
                    assert_eq!(*v as f32 as f64, *v, "test sum not exact in f32");
                }
            }
            d
        }

        /// Lane `lane`'s fragments, packed as documented on `Ctx::mma_m16n8k16`.
        fn fragments(&self, lane: u32) -> ([u32; 4], [u32; 2], [f32; 4]) {
            let (g, t) = ((lane / 4) as usize, (lane % 4) as usize);
            let pair = |lo: f64, hi: f64| f16_bits(lo) as u32 | (f16_bits(hi) as u32) << 16;
            let a = [
                pair(self.a[g][2 * t], self.a[g][2 * t + 1]),
                pair(self.a[g + 8][2 * t], self.a[g + 8][2 * t + 1]),
                pair(self.a[g][2 * t + 8], self.a[g][2 * t + 9]),
                pair(self.a[g + 8][2 * t + 8], self.a[g + 8][2 * t + 9]),
            ];
            let b = [pair(self.b[2 * t][g], self.b[2 * t + 1][g]), pair(self.b[2 * t + 8][g], self.b[2 * t + 9][g])];
            let c = [self.c[g][2 * t], self.c[g][2 * t + 1], self.c[g + 8][2 * t], self.c[g + 8][2 * t + 1]];
            (a, b, c.map(|v| v as f32))
        }

        /// Checks lane outputs (`[lane][4]`) against `d`, element by element, exactly.
        fn check(d: &[[f64; 8]], out: &[[f32; 4]], what: &str) {
            for (lane, o) in out.iter().enumerate() {
                let (g, t) = (lane / 4, lane % 4);
                let want = [d[g][2 * t], d[g][2 * t + 1], d[g + 8][2 * t], d[g + 8][2 * t + 1]];
                for i in 0..4 {
                    assert_eq!(o[i] as f64, want[i], "{what}: lane {lane} output {i}");
                }
            }
        }
    }

    /// Forwards the required methods and `shfl_idx_u32` only, so the trait's default bodies
    /// of `mma_m16n8k16` and the `cp_async` methods run.
    struct DefaultBodies<'a, 'b>(&'a SimCtx<'b>);

    impl Ctx for DefaultBodies<'_, '_> {
        fn thread_idx(&self) -> u32 {
            self.0.thread_idx()
        }
        fn block_dim(&self) -> u32 {
            self.0.block_dim()
        }
        fn block_idx(&self) -> [u32; 3] {
            self.0.block_idx()
        }
        fn grid_dim(&self) -> [u32; 3] {
            self.0.grid_dim()
        }
        fn sync_threads(&self) {
            self.0.sync_threads()
        }
        fn shfl_xor(&self, v: f32, mask: u32) -> f32 {
            self.0.shfl_xor(v, mask)
        }
        fn shfl_idx(&self, v: f32, src_lane: u32) -> f32 {
            self.0.shfl_idx(v, src_lane)
        }
        fn shfl_idx_u32(&self, v: u32, src_lane: u32) -> u32 {
            self.0.shfl_idx_u32(v, src_lane)
        }
        fn shared(&self) -> *mut u8 {
            self.0.shared()
        }
    }

    /// Runs, per warp `w` of a 2-block, 64-thread launch, `D = A2 * B2 + (A1 * B1 + C)`
    /// with the emulator's mma and with the default body (a shuffle in between, so the
    /// exchange slots are reused across operation kinds), and returns both as `[block *
    /// 2 + w][lane][4]`.
    fn run_mma(first: &[Mats], second: &[Mats]) -> (Vec<[f32; 4]>, Vec<[f32; 4]>) {
        let n = first.len() * 32;
        let fast: Vec<[AtomicU32; 4]> = (0..n).map(|_| core::array::from_fn(|_| AtomicU32::new(0))).collect();
        let slow: Vec<[AtomicU32; 4]> = (0..n).map(|_| core::array::from_fn(|_| AtomicU32::new(0))).collect();
        launch([2, 1, 1], 64, 0, |ctx| {
            let w = (ctx.block_idx()[0] * 2 + ctx.thread_idx() / 32) as usize;
            let lane = ctx.lane();
            let (a1, b1, c) = first[w].fragments(lane);
            let (a2, b2, _) = second[w].fragments(lane);
            let d = ctx.mma_m16n8k16(a1, b1, c);
            let x = ctx.shfl_xor(lane as f32, 5);
            assert_eq!(x, (lane ^ 5) as f32);
            let d = ctx.mma_m16n8k16(a2, b2, d);
            let plain = DefaultBodies(ctx);
            let e = plain.mma_m16n8k16(a2, b2, plain.mma_m16n8k16(a1, b1, c));
            for i in 0..4 {
                fast[w * 32 + lane as usize][i].store(d[i].to_bits(), Ordering::SeqCst);
                slow[w * 32 + lane as usize][i].store(e[i].to_bits(), Ordering::SeqCst);
            }
        })
        .unwrap();
        let read = |v: &[[AtomicU32; 4]]| {
            v.iter().map(|o| o.each_ref().map(|x| f32::from_bits(x.load(Ordering::SeqCst)))).collect()
        };
        (read(&fast), read(&slow))
    }

    #[test]
    fn mma_matches_a_plain_matrix_product_exactly() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let first: Vec<Mats> = (0..4).map(|_| Mats::random(&mut rng)).collect();
        let second: Vec<Mats> = (0..4).map(|_| Mats::random(&mut rng)).collect();
        let (fast, slow) = run_mma(&first, &second);
        for w in 0..4 {
            let mut chained = second[w].clone();
            chained.c = first[w].product();
            let d = chained.product();
            Mats::check(&d, &fast[w * 32..(w + 1) * 32], &std::format!("SimCtx mma, warp {w}"));
            Mats::check(&d, &slow[w * 32..(w + 1) * 32], &std::format!("default mma, warp {w}"));
        }
        assert_eq!(fast, slow);
    }

    #[test]
    fn mma_with_subnormal_b_is_exact() {
        let mut rng = Rng(12345);
        let mk = |rng: &mut Rng| {
            let mut m = Mats::random(rng);
            let codes = rng.perm(1, 1023);
            let pa = rng.perm(1, 256);
            for r in 0..16 {
                for k in 0..16 {
                    m.a[r][k] = rng.sign() * pa[r * 16 + k] as f64;
                }
            }
            for k in 0..16 {
                for n in 0..8 {
                    // f16 subnormals: code * 2^-24, code < 1024.
                    m.b[k][n] = rng.sign() * codes[k * 8 + n] as f64 * 2f64.powi(-24);
                    assert_eq!(f16_bits(m.b[k][n].abs()) >> 10, 0);
                }
            }
            for r in 0..16 {
                for n in 0..8 {
                    m.c[r][n] = rng.sign() * rng.below(1000) as f64 * 2f64.powi(-24);
                }
            }
            m
        };
        let first: Vec<Mats> = (0..4).map(|_| mk(&mut rng)).collect();
        let second: Vec<Mats> = (0..4).map(|_| mk(&mut rng)).collect();
        let (fast, slow) = run_mma(&first, &second);
        for w in 0..4 {
            let mut chained = second[w].clone();
            chained.c = first[w].product();
            let d = chained.product();
            Mats::check(&d, &fast[w * 32..(w + 1) * 32], "SimCtx mma, subnormal B");
            Mats::check(&d, &slow[w * 32..(w + 1) * 32], "default mma, subnormal B");
        }
    }

    #[test]
    fn divergent_mma_is_an_error_not_a_hang() {
        // A lane that skips the mma.
        let r = launch([1, 1, 1], 64, 0, |c| {
            if c.thread_idx() != 37 {
                c.mma_m16n8k16([0; 4], [0; 2], [0.0; 4]);
            }
        });
        assert!(r.unwrap_err().0.contains("divergent barrier"));
        // A lane that shuffles while the others run an mma (same number of warp
        // operations, so only the operation kinds tell).
        let r = launch([1, 1, 1], 32, 0, |c| {
            if c.lane() == 3 {
                c.shfl_xor(1.0, 1);
            } else {
                c.mma_m16n8k16([0; 4], [0; 2], [0.0; 4]);
            }
        });
        let e = r.unwrap_err().0;
        assert!(e.contains("divergent barrier") && e.contains("an mma") && e.contains("a shuffle"), "{e}");
    }

    #[test]
    fn misaligned_load16_is_an_error() {
        let data = [7u128; 3];
        let base = data.as_ptr().cast::<u8>().addr();
        let at = |off: usize| data.as_ptr().cast::<u8>().with_addr(base + off);
        let got = AtomicU32::new(0);
        launch([1, 1, 1], 32, 0, |c| {
            // SAFETY: 16-byte aligned, inside `data`, which nobody writes.
            let v = unsafe { c.load16(at(16)) };
            got.fetch_add(v[0], Ordering::SeqCst);
        })
        .unwrap();
        assert_eq!(got.load(Ordering::SeqCst), 32 * 7);
        for off in [4, 8, 20] {
            let r = launch([1, 1, 1], 32, 0, |c| {
                // SAFETY: inside `data` (the emulator panics before reading: misaligned).
                unsafe { c.load16(at(off)) };
            });
            assert!(r.unwrap_err().0.contains("misaligned"), "offset {off}");
        }
    }

    /// `load_shared16` / `load_shared8` read the block's shared memory at aligned
    /// addresses; a misaligned one or one outside it is a launch error.
    #[test]
    fn shared_loads_are_checked() {
        let got = AtomicU32::new(0);
        launch([1, 1, 1], 32, 64, |c| {
            let sh = c.shared();
            if c.lane() == 0 {
                // SAFETY: 64 bytes of this block's shared memory.
                unsafe { sh.cast::<u32>().add(4).write(5) };
            }
            c.sync_threads();
            // SAFETY: aligned, inside the block's 64 bytes, not written after the barrier.
            let (a, b) = unsafe { (c.load_shared16(sh.cast::<u32>().add(4)), c.load_shared8(sh.cast::<u32>().add(4))) };
            got.fetch_add(a[0] + b[0], Ordering::SeqCst);
        })
        .unwrap();
        assert_eq!(got.load(Ordering::SeqCst), 32 * 10);
        for (off, n) in [(4usize, 16usize), (8, 16), (4, 8), (56, 16), (64, 8)] {
            let r = launch([1, 1, 1], 32, 64, |c| {
                let p = c.shared().cast::<u32>().wrapping_byte_add(off);
                // SAFETY: none needed: the emulator rejects the address before reading.
                unsafe {
                    if n == 16 {
                        c.load_shared16(p);
                    } else {
                        c.load_shared8(p);
                    }
                }
            });
            let e = r.unwrap_err().0;
            assert!(e.contains("misaligned") || e.contains("outside the block's shared memory"), "{off} {n}: {e}");
        }
    }

    #[test]
    fn grid_limits_are_enforced() {
        let ran = AtomicU32::new(0);
        let count = |_: &SimCtx<'_>| {
            ran.fetch_add(1, Ordering::SeqCst);
        };
        // The largest y and z run (one block thread per block: cheap enough at 32
        // threads, 65535 blocks).
        launch([1, GRID_YZ_MAX, 1], 32, 0, count).unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 32 * GRID_YZ_MAX);
        for grid in [[1, 65536, 1], [1, 1, 65536], [1 << 31, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 0]] {
            let e = launch(grid, 32, 0, count).unwrap_err();
            assert!(e.0.contains("grid"), "{grid:?}: {e}");
        }
        assert_eq!(ran.load(Ordering::SeqCst), 32 * GRID_YZ_MAX, "a rejected launch ran");
    }

    #[test]
    fn dynamic_shared_memory_above_48k_needs_an_opt_in() {
        let last = |c: &SimCtx<'_>, bytes: usize| {
            // SAFETY: the block has `bytes` of shared memory; each thread writes its own
            // f32 at the end and reads it back.
            unsafe {
                let p = c.shared().add(bytes - 4 * (c.thread_idx() as usize + 1)).cast::<f32>();
                *p = 1.5;
                assert_eq!(*p, 1.5);
            }
        };
        launch([1, 1, 1], 32, 48 << 10, |c| last(c, 48 << 10)).unwrap();
        let e = launch([1, 1, 1], 32, 49 << 10, |c| last(c, 49 << 10)).unwrap_err();
        assert!(e.0.contains("opt-in"), "{e}");
        launch_with([1, 1, 1], 32, 49 << 10, 64 << 10, |c| last(c, 49 << 10)).unwrap();
        let big = SHARED_OPTIN_MAX_SM90 as usize;
        launch_with([1, 1, 1], 32, big, SHARED_OPTIN_MAX_SM90, |c| last(c, big)).unwrap();
        assert!(launch_with([1, 1, 1], 32, 65 << 10, 64 << 10, |_| {}).is_err());
        assert!(launch_with([1, 1, 1], 32, 0, SHARED_OPTIN_MAX_SM90 + 1, |_| {}).is_err());
        assert_eq!(SHARED_OPTIN_MAX_SM80, 166_912);
    }

    /// 16-byte aligned source data: chunk `i` holds f32 `i * 4 .. i * 4 + 4`.
    fn chunks(n: usize) -> Vec<[f32; 4]> {
        (0..n).map(|i| core::array::from_fn(|j| (i * 4 + j) as f32)).collect()
    }

    /// The f32 at `i` of shared memory.
    fn sh(c: &SimCtx<'_>, i: usize) -> f32 {
        // SAFETY: callers index inside the launch's shared memory.
        unsafe { *c.shared().cast::<f32>().add(i) }
    }

    #[test]
    fn cp_async_data_is_visible_after_the_wait() {
        let src = chunks(64);
        let ok = AtomicU32::new(0);
        launch([2, 1, 1], 64, 64 * 16, |c| {
            let t = c.thread_idx() as usize;
            // SAFETY: chunk t of `src` and of the 1 KiB shared memory, both aligned.
            unsafe { c.cp_async16(c.shared().add(16 * t), src[t].as_ptr().cast()) };
            c.cp_async_commit();
            c.cp_async_wait(0);
            c.sync_threads();
            let other = (t + 17) % 64;
            if (0..4).all(|j| sh(c, other * 4 + j) == (other * 4 + j) as f32) {
                ok.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert_eq!(ok.load(Ordering::SeqCst), 128);
    }

    #[test]
    fn cp_async_without_the_wait_reads_nan() {
        let src = chunks(32);
        let nan = AtomicU32::new(0);
        launch([1, 1, 1], 32, 32 * 16, |c| {
            let t = c.thread_idx() as usize;
            // SAFETY: as above.
            unsafe { c.cp_async16(c.shared().add(16 * t), src[t].as_ptr().cast()) };
            c.cp_async_commit();
            c.sync_threads(); // Forgot cp_async_wait.
            if (0..4).all(|j| sh(c, ((t + 1) % 32) * 4 + j).is_nan()) {
                nan.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert_eq!(nan.load(Ordering::SeqCst), 32);
    }

    #[test]
    fn cp_async_of_another_lane_is_visible_after_the_wait_and_a_warp_sync() {
        let src = chunks(64);
        let ok = AtomicU32::new(0);
        // Two warps, each reading what its lane t ^ 5 copied: a warp-private buffer.
        launch([1, 1, 1], 64, 64 * 16, |c| {
            let t = c.thread_idx() as usize;
            // SAFETY: chunk t of `src` and of the 1 KiB shared memory, both aligned.
            unsafe { c.cp_async16(c.shared().add(16 * t), src[t].as_ptr().cast()) };
            c.cp_async_commit();
            c.cp_async_wait(0);
            c.sync_warp();
            let other = t ^ 5;
            if (0..4).all(|j| sh(c, other * 4 + j) == (other * 4 + j) as f32) {
                ok.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert_eq!(ok.load(Ordering::SeqCst), 64);
    }

    #[test]
    fn cp_async_of_another_lane_without_a_warp_sync_reads_nan() {
        let src = chunks(32);
        let nan = AtomicU32::new(0);
        launch([1, 1, 1], 32, 32 * 16, |c| {
            let t = c.thread_idx() as usize;
            // SAFETY: as above.
            unsafe { c.cp_async16(c.shared().add(16 * t), src[t].as_ptr().cast()) };
            c.cp_async_commit();
            c.cp_async_wait(0); // Retires this lane's copy only; forgot sync_warp.
            // Lane 0 runs first and reads before lane 1 has waited for its copy.
            if t == 0 && (0..4).all(|j| sh(c, 4 + j).is_nan()) {
                nan.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert_eq!(nan.load(Ordering::SeqCst), 1);
    }

    /// Element `(m, r, c)` of the test matrices: a distinct 16-bit value.
    fn el(m: u32, r: u32, c: u32) -> u32 {
        0x1000 * m + 0x100 * r + c
    }

    #[test]
    fn ldmatrix_gives_the_ptx_fragments_from_scattered_rows() {
        let ok = AtomicU32::new(0);
        // Row r of matrix m in 16-byte slot (8 m + r) * 5 mod 32: rows need not be
        // contiguous, and each lane gives its own row's address.
        let slot = |m: u32, r: u32| ((8 * m + r) * 5 % 32) as usize;
        launch([1, 1, 1], 32, 32 * 16, |c| {
            let lane = c.lane();
            let (m, r) = (lane / 8, lane % 8);
            for col in 0..8 {
                // SAFETY: slot `slot(m, r)` of the 512-byte shared memory, this lane's.
                unsafe { *c.shared().add(16 * slot(m, r) + 2 * col as usize).cast::<u16>() = el(m, r, col) as u16 };
            }
            c.sync_threads();
            // SAFETY: aligned rows of shared memory, not written from here on.
            let row = unsafe { c.shared().add(16 * slot(m, r)).cast_const() };
            let (x4, x4t, x2, x2t) = unsafe {
                (
                    c.ldmatrix_x4(row, false),
                    c.ldmatrix_x4(row, true),
                    c.ldmatrix_x2(row, false),
                    c.ldmatrix_x2(row, true),
                )
            };
            // The trait's default bodies (addresses by shuffles) agree.
            let plain = DefaultBodies(c);
            let same = unsafe {
                plain.ldmatrix_x4(row, false) == x4
                    && plain.ldmatrix_x4(row, true) == x4t
                    && plain.ldmatrix_x2(row, false) == x2
                    && plain.ldmatrix_x2(row, true) == x2t
            };
            let (g, t) = (lane / 4, lane % 4);
            let pair = |a: u32, b: u32| a | b << 16;
            let good = (0..4).all(|i| {
                let (i, iu) = (i as usize, i as u32);
                x4[i] == pair(el(iu, g, 2 * t), el(iu, g, 2 * t + 1))
                    && x4t[i] == pair(el(iu, 2 * t, g), el(iu, 2 * t + 1, g))
                    && (i >= 2
                        || (x2[i] == pair(el(iu, g, 2 * t), el(iu, g, 2 * t + 1))
                            && x2t[i] == pair(el(iu, 2 * t, g), el(iu, 2 * t + 1, g))))
            });
            if good && same {
                ok.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert_eq!(ok.load(Ordering::SeqCst), 32);
    }

    /// A lane's `cp.async` copy read by another lane's `ldmatrix`: an error without a
    /// barrier after the wait, or while the copy is in flight; and a copy into a row
    /// another lane read, with no barrier between.
    #[test]
    fn ldmatrix_and_cp_async_races_between_lanes_are_errors() {
        let src = chunks(32);
        let run = |barrier: bool, early_read: bool, refill: bool, refill_after_barrier: bool| {
            launch([1, 1, 1], 32, 32 * 16, |c| {
                let t = c.thread_idx() as usize;
                // SAFETY: chunk t of `src` and of the 512-byte shared memory.
                unsafe { c.cp_async16(c.shared().add(16 * t), src[t].as_ptr().cast()) };
                c.cp_async_commit();
                if !early_read {
                    c.cp_async_wait(0);
                }
                if barrier {
                    c.sync_warp();
                }
                // Lane L reads row L (written by lane L), but each row is read by 4
                // lanes (x4, non-trans: row g by lanes 4g .. 4g + 4).
                // SAFETY: aligned rows of the shared memory.
                unsafe { c.ldmatrix_x4(c.shared().add(16 * t).cast_const(), false) };
                if refill {
                    // Every lane's reads done (a shuffle orders execution, not memory),
                    // then lane t copies into row (t + 1) % 32, which other lanes read.
                    c.shfl_xor(0.0, 1);
                    if refill_after_barrier {
                        c.sync_warp();
                    }
                    // SAFETY: as above.
                    unsafe { c.cp_async16(c.shared().add(16 * ((t + 1) % 32)), src[t].as_ptr().cast()) };
                }
                c.cp_async_wait(0);
            })
        };
        run(true, false, false, false).unwrap();
        run(true, false, true, true).unwrap();
        let e = run(false, false, false, false).unwrap_err().0;
        assert!(e.contains("no barrier since it landed"), "{e}");
        let e = run(true, true, false, false).unwrap_err().0;
        assert!(e.contains("still copying"), "{e}");
        let e = run(true, false, true, false).unwrap_err().0;
        assert!(e.contains("read with ldmatrix with no barrier since"), "{e}");
    }

    #[test]
    fn ldmatrix_rows_must_be_aligned_shared_memory() {
        for (bad_lane, off) in [(3u32, 4usize), (9, 32 * 16), (0, 8)] {
            let r = launch([1, 1, 1], 32, 32 * 16, |c| {
                let lane = c.lane();
                let at = if lane == bad_lane { off } else { 16 * lane as usize };
                // SAFETY: none for the bad lane: the emulator rejects it before reading.
                unsafe { c.ldmatrix_x2(c.shared().wrapping_add(at).cast_const(), false) };
            });
            let e = r.unwrap_err().0;
            assert!(e.contains("ldmatrix") && e.contains("outside"), "lane {bad_lane} offset {off}: {e}");
        }
        // Lanes 16-31 give no address to an x2.
        launch([1, 1, 1], 32, 32 * 16, |c| {
            let lane = c.lane();
            let at = if lane >= 16 { 3 } else { 16 * lane as usize };
            // SAFETY: lanes 0-15 give aligned rows; the others' addresses are not read.
            unsafe { c.ldmatrix_x2(c.shared().wrapping_add(at).cast_const(), true) };
        })
        .unwrap();
    }

    #[test]
    fn cp_async_groups_retire_in_order() {
        let src = chunks(5);
        let steps = AtomicU32::new(0);
        launch([1, 1, 1], 32, 5 * 16, |c| {
            if c.thread_idx() != 0 {
                return;
            }
            let copy = |i: usize| {
                // SAFETY: chunk i of `src` and of the 80 bytes of shared memory.
                unsafe { c.cp_async16(c.shared().add(16 * i), src[i].as_ptr().cast()) }
            };
            // Visible chunks as a bit mask.
            let seen = || (0..5).filter(|&i| sh(c, 4 * i) == (4 * i) as f32).fold(0u32, |m, i| m | 1 << i);
            copy(0);
            copy(1);
            c.cp_async_commit(); // Group {0, 1}.
            c.cp_async_commit(); // An empty group.
            copy(2);
            c.cp_async_commit(); // Group {2}.
            copy(3);
            c.cp_async_commit(); // Group {3}.
            copy(4); // Not committed.
            assert_eq!(seen(), 0);
            c.cp_async_wait(3);
            assert_eq!(seen(), 0b00011);
            c.cp_async_wait(2); // The empty group.
            assert_eq!(seen(), 0b00011);
            c.cp_async_wait(1);
            assert_eq!(seen(), 0b00111);
            c.cp_async_wait(0);
            assert_eq!(seen(), 0b01111, "an uncommitted copy is not waited for");
            c.cp_async_commit();
            c.cp_async_wait(7);
            assert_eq!(seen(), 0b01111);
            c.cp_async_wait(0);
            assert_eq!(seen(), 0b11111);
            steps.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        assert_eq!(steps.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn cp_async_default_body_copies_at_once_and_bad_addresses_are_errors() {
        let src = chunks(33);
        let ok = AtomicU32::new(0);
        launch([1, 1, 1], 32, 32 * 16, |c| {
            let t = c.thread_idx() as usize;
            let plain = DefaultBodies(c);
            // SAFETY: as above.
            unsafe { plain.cp_async16(c.shared().add(16 * t), src[t].as_ptr().cast()) };
            if sh(c, 4 * t) == (4 * t) as f32 {
                ok.fetch_add(1, Ordering::SeqCst);
            }
            plain.cp_async_commit();
            plain.cp_async_wait(0);
        })
        .unwrap();
        assert_eq!(ok.load(Ordering::SeqCst), 32);
        let r = launch([1, 1, 1], 32, 32 * 16, |c| {
            // SAFETY: none: the emulator rejects the misaligned source before copying.
            unsafe { c.cp_async16(c.shared(), src[1].as_ptr().cast::<u8>().wrapping_add(4)) };
        });
        assert!(r.unwrap_err().0.contains("misaligned"));
        let r = launch([1, 1, 1], 32, 32 * 16, |c| {
            // SAFETY: none: the emulator rejects a destination past the shared memory.
            unsafe { c.cp_async16(c.shared().wrapping_add(32 * 16), src[0].as_ptr().cast()) };
        });
        assert!(r.unwrap_err().0.contains("outside"));
    }

    #[test]
    fn shfl_idx_u32_moves_raw_bits() {
        let bad = AtomicU32::new(0);
        let bits = |lane: u32| [0xffff_ffff, 0x7fc0_1234, 0xff80_0001, 0x0000_0001][lane as usize % 4] ^ (lane << 8);
        launch([1, 1, 1], 64, 0, |c| {
            let src = (c.lane() * 7 + 3) % 32;
            if c.shfl_idx_u32(bits(c.lane()), src) != bits(src) {
                bad.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
        assert_eq!(bad.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn bad_block_sizes_are_rejected() {
        assert!(launch([1, 1, 1], 48, 0, |_| {}).is_err());
        assert!(launch([1, 1, 1], 2048, 0, |_| {}).is_err());
    }
}
