//! One layer's cache in device memory ([`DeviceLayer`]).

use super::*;

/// Sizes of a [`DeviceLayer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSize {
    /// Sequence slots (sequences live at once).
    pub max_seqs: usize,
    /// Tokens one sequence may hold.
    pub max_tokens: usize,
    /// Blocks in the page pool; `None` gives every slot room for `max_tokens`.
    pub num_blocks: Option<usize>,
}

#[derive(Clone, Debug)]
pub(super) struct SeqState {
    id: SeqId,
    pub(super) table: Vec<u32>,
    pub(super) len: usize,
    protected: Vec<u32>,
}

/// One layer's cache, or one tensor-parallel shard of it, in device memory (see the
/// module documentation).
pub struct DeviceLayer {
    pub(super) device: Device,
    pub(super) config: CacheConfig,
    pub(super) fmt: Format,
    pub(super) shape: LayerShape,
    pub(super) calib: LayerCalibration,
    pub(super) size: LayerSize,
    pub(super) max_blocks: usize,
    pub(super) pool: DeviceBuffer<u8>,
    pub(super) sides: DeviceBuffer<u16>,
    pub(super) tables: DeviceBuffer<u32>,
    pub(super) lens: DeviceBuffer<u32>,
    pub(super) protected: DeviceBuffer<u32>,
    pub(super) key_mean: DeviceBuffer<f32>,
    pub(super) key_scale: DeviceBuffer<f32>,
    pub(super) key_perm: DeviceBuffer<u16>,
    pub(super) value_perm: DeviceBuffer<u16>,
    pub(super) vperm_inv: DeviceBuffer<u16>,
    pub(super) key_rot: DeviceBuffer<f32>,
    pub(super) value_rot: DeviceBuffer<f32>,
    pub(super) num_blocks: usize,
    pub(super) seqs: Vec<Option<SeqState>>,
    pub(super) generations: Vec<u64>,
    pub(super) free_blocks: Vec<u32>,
    pub(super) id: u64,
}

impl std::fmt::Debug for DeviceLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLayer")
            .field("device", &self.device)
            .field("shape", &self.shape)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl DeviceLayer {
    /// Allocates a layer (or shard: `shape` has the shard's heads) on `device` with the
    /// calibration `calib` (`[num_kv_heads]` of the shard). Everything is allocated here.
    pub fn new(
        device: &Device,
        config: CacheConfig,
        shape: LayerShape,
        calib: LayerCalibration,
        size: LayerSize,
    ) -> Result<Self> {
        let fmt = config.format()?;
        launch::check_format(&fmt)?;
        shape.check()?;
        let (hkv, hq, d) = (shape.num_kv_heads, shape.num_q_heads, config.head_dim);
        if hq / hkv > MAX_GROUP {
            return Err(Error::Unsupported(format!(
                "{hq} query heads for {hkv} KV heads on the device kernels (at most {MAX_GROUP} per KV head)"
            )));
        }
        calib.check_orthogonal(hkv, d)?;
        if size.max_seqs == 0 || size.max_tokens == 0 {
            return Err(Error::Shape(format!("max_seqs and max_tokens must be positive: {size:?}")));
        }
        if size.max_seqs > launch::MAX_GRID_YZ as usize {
            return Err(Error::Capacity(format!(
                "{} sequence slots (the grid allows {})",
                size.max_seqs,
                launch::MAX_GRID_YZ
            )));
        }
        if size.max_tokens > u32::MAX as usize / 2 {
            return Err(Error::Capacity(format!("max_tokens {} is past the format's limit", size.max_tokens)));
        }
        let max_blocks = fmt.pages_for(size.max_tokens as u32) as usize;
        let num_blocks = size.num_blocks.unwrap_or(max_blocks.saturating_mul(size.max_seqs));
        launch::check_pool_blocks(&fmt, num_blocks)?;
        let np = (fmt.protected as usize).max(1);
        let too_big = |what: &str| Error::Capacity(format!("the layer's {what} for {size:?} overflows usize"));
        let pool_bytes = num_blocks
            .checked_mul(hkv)
            .and_then(|x| x.checked_mul(fmt.page_bytes() as usize))
            .ok_or_else(|| too_big("page pool"))?;
        let side = fmt.side_elems(hkv as u32);
        let sides_len = size.max_seqs.checked_mul(side).ok_or_else(|| too_big("side stores"))?;
        let tables_len = size.max_seqs.checked_mul(max_blocks.max(1)).ok_or_else(|| too_big("block tables"))?;
        let rot = |r: &Option<Vec<f32>>| device.upload(r.as_deref().unwrap_or(&[0.0]));
        Ok(Self {
            pool: device.alloc(pool_bytes)?,
            sides: device.alloc(sides_len)?,
            tables: device.alloc(tables_len)?,
            lens: device.alloc(size.max_seqs)?,
            protected: device.upload(&vec![u32::MAX; size.max_seqs * np])?,
            key_mean: device.upload(&calib.key_mean)?,
            key_scale: device.upload(&calib.key_scale)?,
            key_perm: device.upload(&calib.key_perm)?,
            value_perm: device.upload(&calib.value_perm)?,
            vperm_inv: device.upload(&calib.value_perm_inverse(d))?,
            key_rot: rot(&calib.key_rotation)?,
            value_rot: rot(&calib.value_rotation)?,
            num_blocks,
            device: device.clone(),
            config,
            fmt,
            shape,
            calib,
            size,
            max_blocks,
            seqs: vec![None; size.max_seqs],
            generations: vec![0; size.max_seqs],
            free_blocks: (0..num_blocks as u32).rev().collect(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Its configuration (head_dim, bits, format).
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }
    /// The layer's (shard's) heads.
    pub fn shape(&self) -> LayerShape {
        self.shape
    }
    /// Its sizes.
    pub fn size(&self) -> LayerSize {
        self.size
    }
    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free_blocks.len()
    }

    /// Starts an empty sequence in the lowest free slot (`SeqId::slot`, its row block
    /// in a decode plan's batch). The id also carries the slot's generation and this
    /// layer's identity: once the sequence is freed, or on another layer, it is refused
    /// with [`Error::UnknownSequence`].
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let slot = self
            .seqs
            .iter()
            .position(Option::is_none)
            .ok_or_else(|| Error::Capacity(format!("all {} sequence slots are live", self.size.max_seqs)))?;
        self.generations[slot] += 1;
        let id = SeqId::new(slot, self.generations[slot], LAYER_ID_TAG | self.id);
        self.seqs[slot] = Some(SeqState { id, table: Vec::new(), len: 0, protected: Vec::new() });
        Ok(id)
    }

    /// Tokens of the sequence in slot `slot`, or `None` for a free slot (the batch's
    /// bookkeeping: which rows of a plan's output belong to a live sequence).
    pub fn slot_len(&self, slot: usize) -> Option<usize> {
        self.seqs.get(slot).and_then(Option::as_ref).map(|s| s.len)
    }

    /// Frees a sequence: its blocks go back to the pool and its slot's length becomes 0
    /// on the device (a 4-byte write, plus its protected list when it had one).
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seq(seq)?;
        let seq = seq.slot();
        let had_protected = !s.protected.is_empty();
        let was_empty = s.len == 0;
        if !was_empty {
            self.device.write(&mut self.lens, seq, &[0])?;
        }
        if had_protected {
            let np = self.fmt.protected as usize;
            self.device.write(&mut self.protected, seq * np, &vec![u32::MAX; np])?;
        }
        let s = self.seqs[seq].take().expect("checked above");
        self.free_blocks.extend(s.table.iter().rev());
        Ok(())
    }

    /// Tokens of `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// The layer's cache as stored, copied to the host: the page pool's bytes (blocks in
    /// pool order, as `docs/src/format.md` lays them out) and every slot's f16 side store (sinks,
    /// window ring, protected rows; `max_seqs` slots in slot order). Two downloads and a
    /// wait for the device: for inspection and tests, not for a serving step.
    pub fn read_cache(&self) -> Result<(Vec<u8>, Vec<half::f16>)> {
        let mut pool = vec![0u8; self.pool.len()];
        self.device.read(&self.pool, &mut pool)?;
        let mut sides = vec![0u16; self.sides.len()];
        self.device.read(&self.sides, &mut sides)?;
        Ok((pool, sides.into_iter().map(half::f16::from_bits).collect()))
    }

    /// Protects `positions` of `seq` (as [`crate::KvCache::protect`]): the ascending list
    /// extends the sequence's; a position already appended must still be in the f16
    /// window (its rows are copied to the protected rows on the device, a few
    /// device-to-device copies), a later one is stored there when it arrives. Refused
    /// with an error, changing nothing, as `KvCache::protect` refuses.
    pub fn protect(&mut self, seq: SeqId, positions: &[u32]) -> Result<()> {
        let s = self.seq(seq)?;
        let seq = seq.slot();
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= self.size.max_tokens) {
            return Err(Error::Value(format!(
                "position {p} can never be appended: the layer holds at most {} tokens per sequence",
                self.size.max_tokens
            )));
        }
        let new: Vec<u32> = s.protected.iter().chain(positions).copied().collect();
        // The host checks (ascending, not a sink, room, not quantized yet) on a scratch
        // side store.
        let mut scratch = vec![half::f16::ZERO; self.fmt.side_elems(self.shape.num_kv_heads as u32)];
        crate::paged::protect(&self.config, &self.shape, &mut scratch, s.len, &s.protected, &new)?;
        let (old, len) = (s.protected.len(), s.len);
        let np = self.fmt.protected as usize;
        let mut row = vec![u32::MAX; np];
        row[..new.len()].copy_from_slice(&new);
        let dev = self.device.clone();
        let base = seq * self.fmt.side_elems(self.shape.num_kv_heads as u32);
        let d = self.fmt.head_dim as usize;
        for (i, &pos) in new.iter().enumerate().skip(old).filter(|&(_, &p)| (p as usize) < len) {
            for h in 0..self.shape.num_kv_heads as u32 {
                for value in [false, true] {
                    let from = base + self.fmt.side_row_at(h, value, self.fmt.window_row(pos));
                    let to = base + self.fmt.side_row_at(h, value, self.fmt.protected_row(i as u32));
                    dev.copy_within(&mut self.sides, from, to, d)?;
                }
            }
        }
        self.device.write(&mut self.protected, seq * np, &row)?;
        self.seqs[seq].as_mut().expect("checked above").protected = new;
        Ok(())
    }

    pub(super) fn seq(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs
            .get(seq.slot())
            .and_then(Option::as_ref)
            .filter(|s| s.id == seq)
            .ok_or(Error::UnknownSequence(seq.slot()))
    }

    /// Appends `tokens` tokens to `seq` from device buffers `k` and `v` (f32, f16 or
    /// bf16): token `t`, KV head `h`, channel `c` at element `t * token_stride + h *
    /// head_dim + c` of each (`token_stride >= num_kv_heads * head_dim`; a fused QKV
    /// buffer's row, say). Returns the new length. Checks everything the host knows
    /// first. [`DeviceLayer::append_strided`] with `token_stride` for both; use that for
    /// K and V at different row strides.
    pub fn append<T: KvElement>(
        &mut self,
        seq: SeqId,
        tokens: usize,
        k: &impl AsDeviceSlice<Elem = T>,
        v: &impl AsDeviceSlice<Elem = T>,
        token_stride: usize,
    ) -> Result<usize> {
        self.append_strided(seq, tokens, k, token_stride, v, token_stride)
    }

    /// Appends `tokens` tokens to `seq` from device buffers `k` and `v` (f32, f16 or
    /// bf16), each at its own row stride: token `t`, KV head `h`, channel `c` at element
    /// `t * k_stride + h * head_dim + c` of `k` and `t * v_stride + h * head_dim + c` of
    /// `v` (each stride `>= num_kv_heads * head_dim`): K a view of a fused QKV
    /// projection's rows and V a contiguous tensor, say, without a copy. Returns the new
    /// length. Checks everything the host knows first ([`Error::Shape`] naming `k` or
    /// `v` for a stride below a row or past `u32::MAX`, or a buffer too short for
    /// `tokens` rows at its stride); on error nothing is enqueued and the layer is
    /// unchanged.
    pub fn append_strided<T: KvElement>(
        &mut self,
        seq: SeqId,
        tokens: usize,
        k: &impl AsDeviceSlice<Elem = T>,
        k_stride: usize,
        v: &impl AsDeviceSlice<Elem = T>,
        v_stride: usize,
    ) -> Result<usize> {
        let (k, v) = (k.device_slice(), v.device_slice());
        let s = self.seq(seq)?;
        let seq = seq.slot();
        let (hkv, d) = (self.shape.num_kv_heads, self.config.head_dim);
        let len = s.len;
        // The buffers are checked whatever the count: a zero-token append with a buffer
        // of another device or a bad stride is the same mistake as a longer one.
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            self.check_kv_input(what, b.device, b.len(), stride, 0)?;
        }
        if tokens == 0 {
            return Ok(len);
        }
        let Some(new_len) = len.checked_add(tokens).filter(|&n| n <= self.size.max_tokens) else {
            return Err(Error::Capacity(format!(
                "sequence {seq} holds {len} tokens; {tokens} more are past max_tokens {}",
                self.size.max_tokens
            )));
        };
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            self.check_kv_input(what, b.device, b.len(), stride, tokens)?;
        }
        let have = s.table.len();
        let pages = self.fmt.pages_for(new_len as u32) as usize;
        let fresh = pages.saturating_sub(have);
        if fresh > self.free_blocks.len() {
            return Err(Error::Capacity(format!(
                "sequence {seq} needs {fresh} more blocks, {} are free",
                self.free_blocks.len()
            )));
        }
        let mut table = s.table.clone();
        table.extend(self.free_blocks[self.free_blocks.len() - fresh..].iter().rev());
        let p = AppendParams {
            format: self.fmt,
            num_kv_heads: hkv as u32,
            start: len as u32,
            count: tokens as u32,
            new_len: new_len as u32,
            num_blocks: self.num_blocks as u32,
            flags: self.config.flags() | self.calib.flags(),
            token_stride: k_stride as u32,
            v_token_stride: v_stride as u32,
            head_stride: d as u32,
            input_dtype: T::DTYPE,
        };
        // Nothing fails past this point but the device itself.
        let dev = self.device.clone();
        if fresh > 0 {
            dev.write(&mut self.tables, seq * self.max_blocks + have, &table[have..])?;
        }
        let np = self.fmt.protected as usize;
        let side = self.sides.addr_at(seq * self.fmt.side_elems(hkv as u32));
        let block_table = self.tables.addr_at(seq * self.max_blocks);
        // SAFETY: every address is a live buffer of this device with the sizes the
        // kernels' contracts ask: the table row holds every block of `table` (taken from
        // the pool's free list, written above), the protected row is the slot's padded
        // list, the side store and the length are the slot's, k was checked for `tokens`
        // rows at `k_stride` and v for `tokens` rows at `v_stride`.
        unsafe {
            raw::append_flush(&dev, &p, &FlushPtrs { block_table, side, pool: self.pool.addr() })?;
            raw::append_tokens(
                &dev,
                &p,
                &AppendPtrs {
                    k: k.addr(),
                    v: v.addr(),
                    key_mean: self.key_mean.addr(),
                    key_scale: self.key_scale.addr(),
                    key_perm: self.key_perm.addr(),
                    value_perm: self.value_perm.addr(),
                    key_rot: self.key_rot.addr(),
                    value_rot: self.value_rot.addr(),
                    block_table,
                    protected: self.protected.addr_at(seq * np),
                    pool: self.pool.addr(),
                    side,
                    seq_len: self.lens.addr_at(seq),
                },
            )?;
        }
        self.free_blocks.truncate(self.free_blocks.len() - fresh);
        let s = self.seqs[seq].as_mut().expect("checked above");
        s.table = table;
        s.len = new_len;
        Ok(new_len)
    }
}

impl DeviceLayer {
    /// Makes room for `seq` to grow to `len` tokens without taking blocks in an append:
    /// the pages a sequence of `len` tokens uses are taken from the pool now and their
    /// block-table entries written (one upload, only of new entries), so that the
    /// appends of later steps ([`DeviceLayer::append_batch`], which takes no blocks)
    /// need no host work. Between steps, not inside a captured one: on admission (the
    /// prompt plus the most tokens the request may generate), or a page at a time ahead
    /// of the sequence. Reserving less than the sequence holds does nothing; the blocks
    /// go back to the pool with [`DeviceLayer::free_sequence`]. Returns the blocks the
    /// sequence now holds.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::Capacity`] for `len` past `max_tokens` or more
    /// blocks than are free (nothing is taken).
    pub fn reserve(&mut self, seq: SeqId, len: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        let slot = seq.slot();
        if len > self.size.max_tokens {
            return Err(Error::Capacity(format!(
                "reserving {len} tokens for sequence {slot}: the layer holds at most {} per sequence",
                self.size.max_tokens
            )));
        }
        let have = s.table.len();
        let fresh = (self.fmt.pages_for(len as u32) as usize).saturating_sub(have);
        if fresh == 0 {
            return Ok(have);
        }
        if fresh > self.free_blocks.len() {
            return Err(Error::Capacity(format!(
                "sequence {slot} needs {fresh} more blocks for {len} tokens, {} are free",
                self.free_blocks.len()
            )));
        }
        let new: Vec<u32> = self.free_blocks[self.free_blocks.len() - fresh..].iter().rev().copied().collect();
        self.device.write(&mut self.tables, slot * self.max_blocks + have, &new)?;
        self.free_blocks.truncate(self.free_blocks.len() - fresh);
        let s = self.seqs[slot].as_mut().expect("checked above");
        s.table.extend(new);
        Ok(s.table.len())
    }

    /// Tokens `seq` can grow to without taking blocks: what [`DeviceLayer::reserve`] (or
    /// earlier appends) gave it, up to `max_tokens`.
    pub fn reserved(&self, seq: SeqId) -> Result<usize> {
        let s = self.seq(seq)?;
        Ok(self.tokens_for_pages(s.table.len()))
    }

    /// The longest sequence `pages` pages hold (sinks, quantized pages, a full window).
    pub(super) fn tokens_for_pages(&self, pages: usize) -> usize {
        let f = &self.fmt;
        let most = f.sinks as usize + (pages + 1) * f.page_size as usize + f.window as usize - 1;
        most.min(self.size.max_tokens)
    }

    /// Appends a serving step's new tokens, every sequence of `batch` at once, in two
    /// launches (`append_batch_flush`, `append_batch_tokens`) whatever the step holds:
    /// the device-side twin of vLLM's reshape-and-cache. Input row `r` of `k` and `v`
    /// (token `t`, KV head `h`, channel `c` at element `r * stride + h * head_dim + c`)
    /// is the token the batch gives row `r` ([`StepBatch::set`]); the window rows whose
    /// page fills and every token's place are decided on the device from the batch's
    /// starts and counts and the block tables already there, and each slot's new length
    /// is stored on the device. No allocation, upload or synchronization: the same launch
    /// list every step, so a step can be captured in a CUDA graph and replayed (see
    /// [`DeviceLayer::advance`]).
    ///
    /// Every layer of a model appends the same batch: a request has the same slot in
    /// every layer when the layers add and free their sequences in the same order.
    ///
    /// # Errors
    /// Checked before anything is enqueued, nothing changed on error: [`Error::Device`]
    /// for a batch or buffer of another device; [`Error::Shape`] for a stride below a row
    /// or past `u32`, `k` or `v` shorter than `batch.max_rows()` rows at their strides, a
    /// batch over more slots than the layer has, or a batch whose start for a slot is not
    /// this layer's length of it (a batch set before the last step; set it again after
    /// every step); [`Error::UnknownSequence`] for a slot with tokens and no live
    /// sequence; [`Error::Capacity`] for a sequence that would pass `max_tokens` or the
    /// blocks it holds ([`DeviceLayer::reserve`] them first).
    pub fn append_batch<T: KvElement>(
        &mut self,
        batch: &StepBatch,
        k: &impl AsDeviceSlice<Elem = T>,
        k_stride: usize,
        v: &impl AsDeviceSlice<Elem = T>,
        v_stride: usize,
    ) -> Result<()> {
        let (k, v) = (k.device_slice(), v.device_slice());
        self.check_batch(batch)?;
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            self.check_kv_input(what, b.device, b.len(), stride, batch.max_rows)?;
        }
        // SAFETY: the batch and k, v checked above; the batch's meta is its own buffer.
        unsafe { self.enqueue_append::<T>(batch, batch.meta.addr(), (k.addr(), k_stride), (v.addr(), v_stride))? };
        self.commit_batch(batch);
        Ok(())
    }

    /// The two launches of a batched append of the step batch at `meta` (the whole
    /// step's, or one pass's of `batch`), K and V at `(address, row stride)`.
    ///
    /// # Safety
    /// `batch` passed [`DeviceLayer::check_batch`] against this layer's lengths as they
    /// stand when the launches run (for a pass: after the passes before it); `k` and `v`
    /// passed [`DeviceLayer::check_kv_input`] for `batch.max_rows` rows of `T`; `meta` is
    /// one of `batch`'s step batches.
    pub(super) unsafe fn enqueue_append<T: KvElement>(
        &self,
        batch: &StepBatch,
        meta: u64,
        (k, k_stride): (u64, usize),
        (v, v_stride): (u64, usize),
    ) -> Result<()> {
        let (hkv, d) = (self.shape.num_kv_heads, self.config.head_dim);
        let np = self.fmt.protected as usize;
        let bp = rotkv_kernels::params::AppendBatchParams {
            append: AppendParams {
                format: self.fmt,
                num_kv_heads: hkv as u32,
                start: 0,
                count: 0,
                new_len: 0,
                num_blocks: self.num_blocks as u32,
                flags: self.config.flags() | self.calib.flags(),
                token_stride: k_stride as u32,
                v_token_stride: v_stride as u32,
                head_stride: d as u32,
                input_dtype: T::DTYPE,
            },
            max_seqs: batch.max_seqs as u32,
            max_rows: batch.max_rows as u32,
            table_stride: self.max_blocks.max(1) as u32,
            protected_stride: np as u32,
        };
        // SAFETY: the layer's buffers have the sizes the kernels ask for `bp` (tables of
        // `max_blocks` entries, side stores, protected lists and lengths for `max_seqs
        // >= batch.max_seqs` slots; the pool of `num_blocks` blocks); every slot with
        // tokens holds a live sequence whose length is its start and whose table holds
        // the pages of its new length (check_batch), blocks no other slot holds; k and v
        // were checked for `max_rows` rows at their strides; the batch's meta and error
        // words are its own buffers of this device.
        unsafe {
            raw::append_batch(
                &self.device,
                &bp,
                &launch::BatchPtrs {
                    meta,
                    k,
                    v,
                    key_mean: self.key_mean.addr(),
                    key_scale: self.key_scale.addr(),
                    key_perm: self.key_perm.addr(),
                    value_perm: self.value_perm.addr(),
                    key_rot: self.key_rot.addr(),
                    value_rot: self.value_rot.addr(),
                    tables: self.tables.addr(),
                    protected: self.protected.addr(),
                    pool: self.pool.addr(),
                    sides: self.sides.addr(),
                    lens: self.lens.addr(),
                    errors: batch.errors.addr(),
                },
            )
        }
    }

    /// The host's side of [`DeviceLayer::append_batch`] without enqueuing anything: the
    /// check, then every slot's length advanced by its count. For a step replayed from a
    /// captured CUDA graph (the graph runs the kernels; the layer's bookkeeping, which the
    /// next step's checks read, must follow): per replay, [`StepBatch::set`], then
    /// [`DecodePlan::check_batch`] and `advance` on every layer, then the graph's launch.
    /// Errors as [`DeviceLayer::append_batch`]'s for the batch itself.
    ///
    /// Capturing: the `append_batch` and [`DecodePlan::run_batch`] calls made while a
    /// stream captures run their checks and advance the host's lengths as for a launch,
    /// though the kernels run only when the graph is launched: launch the captured graph
    /// once for the batch it was captured with (or capture with a batch of no tokens)
    /// before any `advance`.
    pub fn advance(&mut self, batch: &StepBatch) -> Result<()> {
        self.check_batch(batch)?;
        self.commit_batch(batch);
        Ok(())
    }

    /// A K or V input of `len` elements on device handle `device`: this device, a row
    /// stride of at least a row and at most `u32::MAX`, and (for `rows > 0`) `rows` rows
    /// at that stride ([`Error::Device`], [`Error::Shape`] naming `what`).
    pub(super) fn check_kv_input(&self, what: &str, device: u64, len: usize, stride: usize, rows: usize) -> Result<()> {
        let (hkv, d) = (self.shape.num_kv_heads, self.config.head_dim);
        self.device.check_view(device, what)?;
        if stride < hkv * d || stride > u32::MAX as usize {
            return Err(Error::Shape(format!(
                "{what}: row stride {stride} (at least {hkv} heads x {d}, at most {})",
                u32::MAX
            )));
        }
        if rows > 0 {
            // rows < 2^31 (max_tokens or a step batch's rows) and stride < 2^32: no
            // overflow in u64.
            let need = (rows - 1) as u64 * stride as u64 + (hkv * d) as u64;
            if (len as u64) < need {
                return Err(Error::Shape(format!(
                    "{what} has {len} elements; {rows} rows at stride {stride} need {need}"
                )));
            }
        }
        Ok(())
    }

    pub(super) fn check_batch(&self, batch: &StepBatch) -> Result<()> {
        if batch.device.0.id != self.device.0.id {
            return Err(Error::Device("the step batch belongs to another device handle".into()));
        }
        if batch.max_seqs > self.size.max_seqs {
            return Err(Error::Shape(format!(
                "a step batch over {} slots for a layer of {}",
                batch.max_seqs, self.size.max_seqs
            )));
        }
        for (slot, start, count) in batch.entries() {
            let Some(s) = self.seqs[slot].as_ref() else {
                return Err(Error::UnknownSequence(slot));
            };
            if s.len != start {
                return Err(Error::Shape(format!(
                    "the step batch says slot {slot} holds {start} tokens; this layer's sequence there holds {} (set \
                     the batch again after every step)",
                    s.len
                )));
            }
            let new_len = start + count;
            if new_len > self.size.max_tokens {
                return Err(Error::Capacity(format!(
                    "sequence {slot} holds {start} tokens; {count} more are past max_tokens {}",
                    self.size.max_tokens
                )));
            }
            let pages = self.fmt.pages_for(new_len as u32) as usize;
            if pages > s.table.len() {
                return Err(Error::Capacity(format!(
                    "sequence {slot} at {new_len} tokens needs {pages} blocks and holds {}: reserve them first \
                     (DeviceLayer::reserve)",
                    s.table.len()
                )));
            }
        }
        Ok(())
    }

    pub(super) fn commit_batch(&mut self, batch: &StepBatch) {
        for (slot, start, count) in batch.entries() {
            let s = self.seqs[slot].as_mut().expect("checked by check_batch");
            s.len = start + count;
        }
    }
}
