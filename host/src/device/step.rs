//! The new tokens of a serving step ([`StepBatch`]).

use super::*;

/// The new tokens of one serving step, in device memory: which sequence slot each input
/// row of the step's K/V belongs to, and each slot's length before the step and count
/// of new tokens (`rotkv_kernels::params::AppendBatchParams` gives the layout). One
/// batch serves every layer of a model ([`DeviceLayer::append_batch`]); it is set once
/// per step ([`StepBatch::set`], one upload, before the step's launches or a graph
/// replay) and also holds the device-side error counters of the batched append
/// ([`StepBatch::errors`]).
pub struct StepBatch {
    pub(super) device: Device,
    pub(super) max_seqs: usize,
    pub(super) max_rows: usize,
    /// Most rows of one sequence in one pass of [`DecodePlan::run_step`].
    pub(super) pass_rows: usize,
    /// Passes of [`DecodePlan::run_step`] (fixed: the launch list does not depend on
    /// the step).
    pub(super) passes: usize,
    /// The whole step's batch, then (with more than one pass) each pass's batch, each
    /// [`rotkv_kernels::params::batch_meta_len`] entries.
    pub(super) meta: DeviceBuffer<u32>,
    pub(super) errors: DeviceBuffer<u32>,
    /// The host's copy of the whole step's batch (the first part of `meta`).
    pub(super) host: Vec<u32>,
}

impl std::fmt::Debug for StepBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepBatch")
            .field("max_seqs", &self.max_seqs)
            .field("max_rows", &self.max_rows)
            .field("pass_rows", &self.pass_rows)
            .field("passes", &self.passes)
            .field("entries", &self.entries().collect::<Vec<_>>())
            .finish()
    }
}

/// What the batched append met on the device ([`StepBatch::errors`]): what it skipped
/// (nothing was read or written out of bounds; both zero for any batch the host API set
/// and checked) and the non-finite input rows it stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchErrors {
    /// (token, KV head) rows the step batch did not describe consistently (a slot past
    /// the layer's, a row outside its slot's rows, a length past the block table).
    pub batch_rows: u32,
    /// K or V rows whose block-table entry is at or past the pool's blocks.
    pub bad_blocks: u32,
    /// K or V input rows (token, KV head) with a NaN or infinity: stored as they came, so
    /// the rows that attend to them decode to NaN; counted so that a stack can find a bad
    /// step without reading its K/V on the host (a warp OR and one atomic per such row).
    pub non_finite_rows: u32,
}

impl StepBatch {
    /// A batch for steps of at most `max_rows` new tokens over slots `0 .. max_seqs`
    /// (at most 32,767 slots and 65,535 rows: the GPU's grid limits). Starts empty.
    pub fn new(device: &Device, max_seqs: usize, max_rows: usize) -> Result<Self> {
        Self::with_passes(device, max_seqs, max_rows, max_rows, 1)
    }

    /// A batch whose steps [`DecodePlan::run_step`] runs in `passes` passes of at most
    /// `pass_rows` rows per sequence: pass `i` appends rows `i * pass_rows ..` of every
    /// sequence's new tokens and decodes them, so that every row of a long prompt chunk
    /// sees the chunk's earlier tokens in f16 (from the window), as token-by-token decode
    /// does, however long the chunk. [`CacheConfig::pass_rows`] gives the recommended
    /// `pass_rows` (half the window: 64 with the presets); `passes` is fixed, so that the
    /// launch list is the same every step: a sequence may take at most `pass_rows *
    /// passes` tokens in one step. ([`StepBatch::new`] is one pass of up to `max_rows`.)
    ///
    /// # Errors
    /// [`Error::Shape`] for zero slots, rows, pass rows or passes; [`Error::Capacity`]
    /// past the grid limits of [`StepBatch::new`] or more than 64 passes.
    pub fn with_passes(
        device: &Device,
        max_seqs: usize,
        max_rows: usize,
        pass_rows: usize,
        passes: usize,
    ) -> Result<Self> {
        if max_seqs == 0 || max_rows == 0 || pass_rows == 0 || passes == 0 {
            return Err(Error::Shape(format!(
                "a step batch of {max_seqs} slots, {max_rows} rows and {passes} passes of {pass_rows} rows"
            )));
        }
        if passes > MAX_PASSES {
            return Err(Error::Capacity(format!("{passes} passes of a step (at most {MAX_PASSES})")));
        }
        if max_rows > launch::MAX_GRID_YZ as usize || 2 * max_seqs > launch::MAX_GRID_YZ as usize {
            return Err(Error::Capacity(format!(
                "a step batch of {max_seqs} slots and {max_rows} rows (at most {} slots and {} rows)",
                launch::MAX_GRID_YZ / 2,
                launch::MAX_GRID_YZ
            )));
        }
        let n = rotkv_kernels::params::batch_meta_len(max_rows as u32, max_seqs as u32);
        let mut host = vec![0u32; n];
        host[..max_rows].fill(rotkv_kernels::params::BATCH_NO_SLOT);
        let parts = if passes > 1 { 1 + passes } else { 1 };
        let all: Vec<u32> = (0..parts).flat_map(|_| host.iter().copied()).collect();
        Ok(Self {
            meta: device.upload(&all)?,
            errors: device.alloc(rotkv_kernels::params::BATCH_ERRORS)?,
            device: device.clone(),
            max_seqs,
            max_rows,
            pass_rows: pass_rows.min(max_rows),
            passes,
            host,
        })
    }

    /// Passes of [`DecodePlan::run_step`] (1 for [`StepBatch::new`]).
    pub fn passes(&self) -> usize {
        self.passes
    }
    /// Most rows of one sequence per pass ([`StepBatch::with_passes`]).
    pub fn pass_rows(&self) -> usize {
        self.pass_rows
    }

    /// The device address of pass `pass`'s batch (the whole step's with one pass).
    pub(super) fn pass_meta(&self, pass: usize) -> u64 {
        let n = self.host.len() as u64 * 4;
        if self.passes == 1 { self.meta.addr() } else { self.meta.addr() + (1 + pass as u64) * n }
    }

    /// Slots the batch may name.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }
    /// Input rows of a step (what `k` and `v` hold).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }
    /// Rows this step uses (the new tokens of all its sequences).
    pub fn rows(&self) -> usize {
        self.entries().map(|(_, _, n)| n).sum()
    }
    /// `(slot, start, count)` of every slot with new tokens this step, in slot order; its
    /// rows are `first_row(slot) ..` [`StepBatch::first_row`].
    pub fn entries(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let (r, s) = (self.max_rows, self.max_seqs);
        (0..s)
            .filter(move |&i| self.host[r + s + i] > 0)
            .map(move |i| (i, self.host[r + i] as usize, self.host[r + s + i] as usize))
    }
    /// The input row of `slot`'s first new token this step (`None` when it has none).
    pub fn first_row(&self, slot: usize) -> Option<usize> {
        let (r, s) = (self.max_rows, self.max_seqs);
        (slot < s && self.host[r + s + slot] > 0).then(|| self.host[r + 2 * s + slot] as usize)
    }

    /// Sets the step: `(sequence, new tokens)` of every sequence that takes tokens, their
    /// rows in that order (the first sequence's tokens are rows `0 .. n0`, the next
    /// one's follow). Each sequence's start is its length in `layer` (any layer of the
    /// model: all hold the same lengths). One upload; nothing else is enqueued.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`] for a sequence not live in `layer`; [`Error::Shape`]
    /// for a slot at or past `max_seqs` or named twice; [`Error::Capacity`] for more
    /// than `max_rows` tokens in all. On error the batch is unchanged.
    pub fn set(&mut self, layer: &DeviceLayer, steps: &[(SeqId, usize)]) -> Result<()> {
        let mut slots = Vec::with_capacity(steps.len());
        for &(seq, count) in steps {
            slots.push((seq.slot(), layer.len(seq)?, count));
        }
        self.set_slots(&slots)
    }

    /// [`StepBatch::set`] by slot: `(slot, start, count)` with `start` the slot's length
    /// before the step, as a stack that keeps its own lengths has them.
    pub fn set_slots(&mut self, steps: &[(usize, usize, usize)]) -> Result<()> {
        let (r, s) = (self.max_rows, self.max_seqs);
        let mut host = vec![0u32; self.host.len()];
        host[..r].fill(rotkv_kernels::params::BATCH_NO_SLOT);
        let mut row = 0usize;
        let mut named = vec![false; s];
        for &(slot, start, count) in steps {
            if slot >= s {
                return Err(Error::Shape(format!("slot {slot} in a step batch of {s} slots")));
            }
            if std::mem::replace(&mut named[slot], true) {
                return Err(Error::Shape(format!("slot {slot} is named twice in one step")));
            }
            if start > u32::MAX as usize / 2 || count > r {
                return Err(Error::Capacity(format!("slot {slot}: {count} tokens after {start}")));
            }
            if count > self.pass_rows * self.passes {
                return Err(Error::Capacity(format!(
                    "slot {slot}: {count} tokens in one step; the batch takes {} passes of {} rows",
                    self.passes, self.pass_rows
                )));
            }
            if count == 0 {
                continue;
            }
            let Some(end) = row.checked_add(count).filter(|&e| e <= r) else {
                return Err(Error::Capacity(format!("more than the batch's {r} rows in one step")));
            };
            host[row..end].fill(slot as u32);
            host[r + slot] = start as u32;
            host[r + s + slot] = count as u32;
            host[r + 2 * s + slot] = row as u32;
            row = end;
        }
        let mut all = host.clone();
        if self.passes > 1 {
            // Pass `i`: rows `i * pass_rows ..` of each slot's, at its start plus that
            // many; the other rows carry no token in it.
            for i in 0..self.passes {
                let mut part = vec![0u32; host.len()];
                part[..r].fill(rotkv_kernels::params::BATCH_NO_SLOT);
                for slot in 0..s {
                    let (start, count, first) = (host[r + slot], host[r + s + slot], host[r + 2 * s + slot]);
                    let lo = (i * self.pass_rows) as u32;
                    let hi = count.min(lo + self.pass_rows as u32);
                    if lo < hi {
                        part[(first + lo) as usize..(first + hi) as usize].fill(slot as u32);
                        part[r + slot] = start + lo;
                        part[r + s + slot] = hi - lo;
                        part[r + 2 * s + slot] = first + lo;
                    }
                }
                all.extend_from_slice(&part);
            }
        }
        self.device.write(&mut self.meta, 0, &all)?;
        self.host = host;
        Ok(())
    }

    /// The device-side error counters, read back (a download and a wait for the stream:
    /// after a step, not inside one).
    pub fn errors(&self) -> Result<BatchErrors> {
        let mut e = [0u32; rotkv_kernels::params::BATCH_ERRORS];
        self.device.read(&self.errors, &mut e)?;
        Ok(BatchErrors {
            batch_rows: e[rotkv_kernels::params::BATCH_ERROR_BATCH],
            bad_blocks: e[rotkv_kernels::params::BATCH_ERROR_BLOCK],
            non_finite_rows: e[rotkv_kernels::params::BATCH_ERROR_NONFINITE],
        })
    }

    /// Zeroes the error counters (one upload).
    pub fn clear_errors(&mut self) -> Result<()> {
        self.device.write(&mut self.errors, 0, &[0; rotkv_kernels::params::BATCH_ERRORS])
    }

    /// The step batch in device memory (`u32`, for [`raw::append_batch`]).
    pub fn meta(&self) -> &DeviceBuffer<u32> {
        &self.meta
    }
    /// The error counters in device memory (`u32` x `BATCH_ERRORS`).
    pub fn error_words(&self) -> &DeviceBuffer<u32> {
        &self.errors
    }
}
