//! The decode plan ([`DecodePlan`]): a fixed launch for a batch shape, and the whole
//! serving step in passes.

use super::*;

/// The batch shape a [`DecodePlan`] is made for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanShape {
    /// Sequence slots decoded every step (slots `0 .. max_seqs`).
    pub max_seqs: usize,
    /// Most query tokens per sequence ([`DecodePlan::run`] takes 1 to this many).
    pub max_q_len: usize,
    /// Longest sequence the plan decodes (drives the split count).
    pub max_context: usize,
    /// Multiprocessors to fill; `None` takes [`Device::sm_count`].
    pub sm_count: Option<usize>,
    /// Decode blocks one multiprocessor holds at once; `None` takes
    /// [`Device::resident_blocks`] (the driver's occupancy calculation on a GPU). The
    /// split count is sized to waves of `sm_count * blocks_per_sm` blocks
    /// ([`launch::wave_splits`]).
    pub blocks_per_sm: Option<usize>,
    /// Softmax scale; `None` means `1 / sqrt(head_dim)`.
    pub sm_scale: Option<f32>,
}

/// A decode launch fixed for a batch shape: split count, grid and partials workspace
/// chosen and allocated once ([`DecodePlan::new`]); [`DecodePlan::run`] enqueues the same
/// two launches every step.
#[derive(Debug)]
pub struct DecodePlan {
    pub(super) shape: PlanShape,
    /// What a layer must share with the one the plan was made for to run it.
    pub(super) fmt: Format,
    pub(super) layer_shape: LayerShape,
    pub(super) device: u64,
    pub(super) num_splits: u32,
    pub(super) sm_scale: f32,
    /// [`DecodeParams::attn_window`]: 0, or the sliding window's keys per row.
    pub(super) attn_window: u32,
    pub(super) m: DeviceBuffer<f32>,
    pub(super) l: DeviceBuffer<f32>,
    pub(super) o: DeviceBuffer<f32>,
}

impl DecodePlan {
    /// A plan for decoding `layer`'s slots `0 .. shape.max_seqs`, and those of every
    /// other layer of the same format and heads with at least `max_seqs` slots and
    /// `max_context` tokens per sequence: one plan (and one workspace) serves every layer
    /// of a model, [`DecodePlan::run`] taking the layer each time (the runs are ordered on
    /// the device's stream, so they share the workspace).
    pub fn new(layer: &DeviceLayer, shape: PlanShape) -> Result<Self> {
        Self::new_windowed(layer, shape, None)
    }

    /// [`DecodePlan::new`] for a sliding-window layer: every run attends only to the
    /// `window_left + 1` newest positions up to each query row's own
    /// ([`crate::paged::DecodeOptions::window_left`], FlashInfer's `window_left`; Hugging
    /// Face's `sliding_window = n` is `Some(n - 1)`). The window is fixed in the plan, so
    /// every step launches the same grid (CUDA-graph friendly); the split count is chosen
    /// for the visible positions (at most `window_left + max_q_len`), not `max_context`,
    /// and pages before the window are not read.
    pub fn new_windowed(layer: &DeviceLayer, shape: PlanShape, window_left: Option<usize>) -> Result<Self> {
        let attn_window = crate::paged::attn_window(window_left)?;
        if shape.max_seqs == 0 || shape.max_seqs > layer.size.max_seqs {
            return Err(Error::Capacity(format!(
                "a plan for {} sequences on a layer of {} slots",
                shape.max_seqs, layer.size.max_seqs
            )));
        }
        if !(1..=MAX_Q_LEN).contains(&shape.max_q_len) {
            return Err(Error::Shape(format!("max_q_len {}: 1 to {MAX_Q_LEN}", shape.max_q_len)));
        }
        if shape.max_context == 0 || shape.max_context > layer.size.max_tokens {
            return Err(Error::Capacity(format!(
                "max_context {} (the layer holds up to {} tokens per sequence)",
                shape.max_context, layer.size.max_tokens
            )));
        }
        let d = layer.config.head_dim;
        let sm_scale = shape.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
        if !sm_scale.is_finite() || sm_scale <= 0.0 {
            return Err(Error::Value(format!("softmax scale {sm_scale} must be finite and positive")));
        }
        let hq = layer.shape.num_q_heads;
        let sms = shape.sm_count.unwrap_or(layer.device.sm_count()).max(1);
        // A wave of resident blocks: the q_len-1 launch's blocks per split, the
        // kernel's occupancy on this device.
        let one = launch::decode_launch(&Self::params(layer, shape.max_seqs, 1, sm_scale, 1, attn_window));
        let per_sm = match shape.blocks_per_sm {
            Some(n) => n,
            None => layer.device.resident_blocks(&layer.fmt, &one)?,
        }
        .max(1);
        let per_split = one.grid.iter().map(|&x| x as usize).product::<usize>();
        // The most positions a sequence's rows attend to together.
        let visible = crate::paged::visible_range(shape.max_context, shape.max_q_len, attn_window);
        let num_splits = launch::wave_splits(visible.1 - visible.0, per_split, sms * per_sm);
        for q_len in 1..=shape.max_q_len {
            let p = Self::params(layer, shape.max_seqs, num_splits, sm_scale, q_len, attn_window);
            let z = launch::decode_launch(&p).grid[2];
            if z > launch::MAX_GRID_YZ || shape.max_seqs * q_len > launch::MAX_GRID_YZ as usize {
                return Err(Error::Capacity(format!("{q_len} query tokens x {num_splits} splits exceed the grid")));
            }
        }
        let parts = shape.max_seqs * shape.max_q_len * hq * num_splits as usize;
        let dev = &layer.device;
        Ok(Self {
            shape,
            fmt: layer.fmt,
            layer_shape: layer.shape,
            device: layer.device.0.id,
            num_splits,
            sm_scale,
            attn_window,
            m: dev.alloc(parts)?,
            l: dev.alloc(parts)?,
            o: dev.alloc(parts * d)?,
        })
    }

    pub(super) fn params(
        layer: &DeviceLayer,
        seqs: usize,
        num_splits: u32,
        sm_scale: f32,
        q_len: usize,
        attn_window: u32,
    ) -> DecodeParams {
        let (hq, d) = (layer.shape.num_q_heads, layer.config.head_dim);
        DecodeParams {
            format: layer.fmt,
            num_seqs: seqs as u32,
            num_q_heads: hq as u32,
            num_kv_heads: layer.shape.num_kv_heads as u32,
            num_splits,
            block_table_stride: layer.max_blocks.max(1) as u32,
            flags: layer.config.flags() | layer.calib.flags(),
            sm_scale,
            q_seq_stride: (q_len * hq * d) as u32,
            q_token_stride: (hq * d) as u32,
            q_dtype: rotkv_kernels::params::DTYPE_F32,
            num_blocks: layer.num_blocks as u32,
            max_len: layer.size.max_tokens as u32,
            q_len: q_len as u32,
            attn_window,
            batch_rows: 0,
            batch_seqs: 0,
        }
    }

    /// The plan's shape.
    pub fn shape(&self) -> PlanShape {
        self.shape
    }
    /// Splits per sequence (fixed).
    pub fn num_splits(&self) -> u32 {
        self.num_splits
    }
    /// The plan's sliding window ([`DecodePlan::new_windowed`]; `None`: none).
    pub fn window_left(&self) -> Option<usize> {
        self.attn_window.checked_sub(1).map(|w| w as usize)
    }
    /// The decode kernel's grid for `q_len` query tokens (the same every step).
    pub fn grid(&self, layer: &DeviceLayer, q_len: usize) -> [u32; 3] {
        let p = Self::params(layer, self.shape.max_seqs, self.num_splits, self.sm_scale, q_len, self.attn_window);
        launch::decode_launch(&p).grid
    }

    /// Decodes the last `q_len` tokens of every sequence in slots `0 .. max_seqs` of
    /// `layer`: `q` (f32, f16 or bf16) and `out` (f32, f16 or bf16) are dense
    /// `[max_seqs][q_len][num_q_heads][head_dim]` (rows as [`crate::paged::decode`]; a
    /// free slot's rows are zero), at least that many elements each (a buffer sized for
    /// `max_q_len` serves every `q_len`). Enqueues two launches; allocates, copies and
    /// waits for nothing. [`DecodePlan::run_strided`] takes rows with gaps.
    ///
    /// The `q_len` rows of a sequence are its last `q_len` tokens, already appended:
    /// row `i` attends causally to positions `0 ..= len - q_len + i`, and every row reads
    /// the cache as it holds them now. When the append of those tokens moved older
    /// window rows into pages (a page of the window filled), the earlier rows see those
    /// positions quantized, where `q_len` single-token steps would have seen some in f16:
    /// a multi-token step (speculative verification, a chunk of a prompt) is not bit for
    /// bit a run of single-token steps, by the quantization error of at most one page.
    ///
    /// # Errors
    /// Before anything is enqueued: [`Error::Device`] for a layer or buffer of another
    /// device handle; [`Error::Shape`] for a layer of another format or heads than the
    /// plan's, `q_len` outside `1 ..= max_q_len`, a sequence shorter than `q_len`, or
    /// buffers too small; [`Error::Capacity`] for a layer with fewer slots or tokens than
    /// the plan, or a live sequence outside the plan's slots or past its `max_context`.
    pub fn run<Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &DeviceLayer,
        q_len: usize,
        q: &impl AsDeviceSlice<Elem = Q>,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
    ) -> Result<()> {
        let (q, mut out) = (q.device_slice(), out.device_slice_mut());
        let row = layer.shape.num_q_heads * layer.config.head_dim;
        let n = self.shape.max_seqs * q_len * row;
        if (1..=self.shape.max_q_len).contains(&q_len) && (q.len() < n || out.len() < n) {
            return Err(Error::Shape(format!(
                "q has {} and out {} elements, at least {} slots x {q_len} tokens x {row} = {n} needed",
                q.len(),
                out.len(),
                self.shape.max_seqs
            )));
        }
        self.run_strided(layer, q_len, &q, row, &mut out, row)
    }

    /// Every check of [`DecodePlan::run_strided`] (plan and layer, `q_len`, owners,
    /// strides and sizes of q and out as `(device handle, elements, row stride)`, the
    /// live sequences against the plan), nothing enqueued.
    pub(crate) fn check_run(
        &self,
        layer: &DeviceLayer,
        q_len: usize,
        q: (u64, usize, usize),
        out: (u64, usize, usize),
    ) -> Result<()> {
        self.check_layer(layer)?;
        if !(1..=self.shape.max_q_len).contains(&q_len) {
            return Err(Error::Shape(format!("q_len {q_len}: the plan takes 1 to {}", self.shape.max_q_len)));
        }
        let (hq, d) = (layer.shape.num_q_heads, layer.config.head_dim);
        let rows = self.shape.max_seqs * q_len;
        let dev = &layer.device;
        dev.check_view(q.0, "q")?;
        dev.check_view(out.0, "out")?;
        for (what, (_, len, stride)) in [("q", q), ("out", out)] {
            if stride < hq * d || stride.checked_mul(q_len).is_none_or(|x| x > u32::MAX as usize) {
                return Err(Error::Shape(format!(
                    "{what} row stride {stride}: at least {hq} heads x {d}, and {q_len} rows of it within u32"
                )));
            }
            let need = (rows - 1) * stride + hq * d;
            if len < need {
                return Err(Error::Shape(format!(
                    "{what} has {len} elements; {} slots x {q_len} tokens at row stride {stride} need {need}",
                    self.shape.max_seqs
                )));
            }
        }
        self.check_live(layer)?;
        for (slot, s) in layer.seqs.iter().enumerate() {
            if let Some(s) = s
                && s.len > 0
                && s.len < q_len
            {
                return Err(Error::Shape(format!("sequence {slot} holds {} tokens, fewer than q_len {q_len}", s.len)));
            }
        }
        Ok(())
    }

    /// The layer is one the plan runs: the same device, format and heads, enough slots
    /// and tokens per sequence.
    pub(super) fn check_layer(&self, layer: &DeviceLayer) -> Result<()> {
        if layer.device.0.id != self.device {
            return Err(Error::Device("the plan was made on another device handle".into()));
        }
        if layer.fmt != self.fmt || layer.shape != self.layer_shape {
            return Err(Error::Shape(format!(
                "the plan was made for a layer of another format or heads ({:?}, {:?}; this layer: {:?}, {:?})",
                self.fmt, self.layer_shape, layer.fmt, layer.shape
            )));
        }
        if self.shape.max_seqs > layer.size.max_seqs || self.shape.max_context > layer.size.max_tokens {
            return Err(Error::Capacity(format!(
                "the plan decodes {} slots of up to {} tokens; this layer has {} slots of {}",
                self.shape.max_seqs, self.shape.max_context, layer.size.max_seqs, layer.size.max_tokens
            )));
        }
        Ok(())
    }

    /// Every live sequence with tokens lies in the plan's slots and context.
    pub(super) fn check_live(&self, layer: &DeviceLayer) -> Result<()> {
        for (slot, s) in layer.seqs.iter().enumerate() {
            let Some(s) = s else { continue };
            if s.len == 0 {
                continue;
            }
            if slot >= self.shape.max_seqs {
                return Err(Error::Capacity(format!(
                    "sequence {slot} is live but the plan decodes slots 0 .. {}",
                    self.shape.max_seqs
                )));
            }
            if s.len > self.shape.max_context {
                return Err(Error::Capacity(format!(
                    "sequence {slot} holds {} tokens; the plan's max_context is {}",
                    s.len, self.shape.max_context
                )));
            }
        }
        Ok(())
    }

    /// [`DecodePlan::run`] with query and output rows (one query token of one slot:
    /// `num_q_heads` heads of `head_dim`, contiguous) `q_row_stride` and
    /// `out_row_stride` elements apart: row `s * q_len + t` for token `t` of slot `s`,
    /// as a fused QKV projection or an attention output with other columns lays them
    /// out. Each buffer must hold `(max_seqs * q_len - 1) * stride + num_q_heads *
    /// head_dim` elements or more.
    #[allow(clippy::too_many_arguments)]
    pub fn run_strided<Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &DeviceLayer,
        q_len: usize,
        q: &impl AsDeviceSlice<Elem = Q>,
        q_row_stride: usize,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
        out_row_stride: usize,
    ) -> Result<()> {
        let (q, out) = (q.device_slice(), out.device_slice_mut());
        self.check_run(layer, q_len, (q.device, q.len(), q_row_stride), (out.device, out.len(), out_row_stride))?;
        let p = DecodeParams {
            q_seq_stride: (q_len * q_row_stride) as u32,
            q_token_stride: q_row_stride as u32,
            q_dtype: Q::DTYPE,
            ..Self::params(layer, self.shape.max_seqs, self.num_splits, self.sm_scale, q_len, self.attn_window)
        };
        // SAFETY: all buffers belong to this device and have the kernels' sizes: the
        // layer's were allocated for `max_seqs >= p.num_seqs` slots, block tables of
        // `block_table_stride` entries that hold valid blocks for every live length
        // (free slots have length 0 and are never read), partials for the plan's most
        // query tokens, q and out checked above.
        unsafe { self.enqueue::<O>(layer, &p, p.num_seqs * p.q_len, q.addr(), out.addr(), out_row_stride, 0) }
    }

    /// Decodes the new tokens of a serving step, every sequence's own number of them:
    /// the rows of `batch` ([`StepBatch::set`], already appended to `layer` with
    /// [`DeviceLayer::append_batch`]), `q` and `out` having one row per input row of the
    /// batch (`batch.max_rows()` rows of `num_q_heads * head_dim` elements, `q_row_stride`
    /// and `out_row_stride` apart; f32, f16 or bf16). Row `r` of `out` is the attention
    /// output of the token of input row `r` (its query row `r` of `q`), over the
    /// sequence's cache up to that token, causal within the step; rows that carry no
    /// token are written as zeros. The same two launches every step, whatever the batch
    /// holds: one-token decode steps, a chunk of a long prompt (chunked prefill: the
    /// chunk's rows attend to every earlier token from the packed pages, the sinks and
    /// the f16 window, and causally to each other), speculative verification rows and
    /// idle sequences, mixed in one step, as long as no sequence has more rows than the
    /// plan's `max_q_len`. Rows read the cache as it holds them after the step's append
    /// (see [`DecodePlan::run`] on multi-token steps): a chunk longer than the window has
    /// its own early tokens quantized before its rows attend to them (measured in
    /// `docs/src/device-api.md`); [`DecodePlan::run_step`] appends and decodes a step in
    /// passes instead, so that every row sees its chunk's earlier tokens in f16.
    ///
    /// # Errors
    /// Before anything is enqueued: as [`DecodePlan::run`] for the plan, the layer and the
    /// buffers; [`Error::Device`] for a batch of another device; [`Error::Shape`] for a
    /// slot at or past the plan's `max_seqs`, more rows for a sequence than `max_q_len`,
    /// more batch rows than the plan's workspace holds (`max_seqs * max_q_len`), or a
    /// batch not yet appended to this layer (a slot whose length is not its start plus
    /// its count).
    #[allow(clippy::too_many_arguments)]
    pub fn run_batch<Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &DeviceLayer,
        batch: &StepBatch,
        q: &impl AsDeviceSlice<Elem = Q>,
        q_row_stride: usize,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
        out_row_stride: usize,
    ) -> Result<()> {
        let (q, out) = (q.device_slice(), out.device_slice_mut());
        self.check_steps(layer, batch, true)?;
        Self::check_rows(layer, batch, (q.device, q.len(), q_row_stride), (out.device, out.len(), out_row_stride))?;
        let p = self.batch_params::<Q>(layer, batch, q_row_stride);
        // SAFETY: as in `run_strided`, with the step batch's rows: every slot with rows
        // holds a live sequence of at least its count (its length is its start plus its
        // count), at most `max_q_len` rows each, the batch's rows within the partials
        // (`max_rows <= max_seqs * max_q_len`) and within q and out (checked above); the
        // batch's meta is its own buffer of this device.
        unsafe {
            self.enqueue::<O>(layer, &p, batch.max_rows as u32, q.addr(), out.addr(), out_row_stride, batch.meta.addr())
        }
    }

    /// A whole serving step of one layer: appends the new tokens of `batch` (K and V as
    /// [`DeviceLayer::append_batch`] takes them) and decodes them (`q` and `out` as
    /// [`DecodePlan::run_batch`] takes them), in the batch's passes
    /// ([`StepBatch::with_passes`]): pass `i` appends rows `i * pass_rows ..` of every
    /// sequence's new tokens, then decodes those rows, and one merge writes every row.
    /// Row `r` of `out` is the attention output of the token of input row `r` over its
    /// sequence up to that token, causal within the step, reading the cache as the
    /// append of its own pass leaves it: a row sees every earlier token of its pass in
    /// f16 (from the window), and at least `window - pass_rows` tokens before the pass
    /// too. With [`CacheConfig::pass_rows`] (half the window) a prompt chunk of any
    /// length gives the outputs chunks of `pass_rows` tokens would, which stay within a
    /// page-flush of token-by-token decode (`docs/src/device-api.md` measures both).
    /// With one pass this is [`DeviceLayer::append_batch`] then [`DecodePlan::run_batch`].
    ///
    /// Enqueues `3 * passes + 1` launches (each pass's flush, tokens and decode, then the
    /// merge), the same every step whatever the batch holds; allocates, copies and waits
    /// for nothing. A pass no sequence has rows in costs its launches' fixed time only.
    ///
    /// # Errors
    /// Before anything is enqueued, nothing changed: every error of
    /// [`DeviceLayer::append_batch`] (with the layer holding the batch's starts) and of
    /// [`DecodePlan::run_batch`] for the plan, the batch and `q`, `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_step<T: KvElement, Q: KvElement, O: OutputElement>(
        &mut self,
        layer: &mut DeviceLayer,
        batch: &StepBatch,
        (k, k_stride): (&impl AsDeviceSlice<Elem = T>, usize),
        (v, v_stride): (&impl AsDeviceSlice<Elem = T>, usize),
        q: &impl AsDeviceSlice<Elem = Q>,
        q_row_stride: usize,
        out: &mut impl AsDeviceSliceMut<Elem = O>,
        out_row_stride: usize,
    ) -> Result<()> {
        let (k, v, q, out) = (k.device_slice(), v.device_slice(), q.device_slice(), out.device_slice_mut());
        layer.check_batch(batch)?;
        for (what, b, stride) in [("k", k, k_stride), ("v", v, v_stride)] {
            layer.check_kv_input(what, b.device, b.len(), stride, batch.max_rows)?;
        }
        self.check_steps(layer, batch, false)?;
        Self::check_rows(layer, batch, (q.device, q.len(), q_row_stride), (out.device, out.len(), out_row_stride))?;
        let p = self.batch_params::<Q>(layer, batch, q_row_stride);
        for pass in 0..batch.passes {
            let meta = batch.pass_meta(pass);
            // SAFETY: the batch, k and v checked against the layer's lengths, which are
            // the batch's starts; pass `i`'s starts are those plus the rows of the passes
            // before it, which the launches before it appended (one stream). The decode:
            // as in `run_batch`, over the rows of this pass, whose slots' device lengths
            // its append set; partials of other rows are not written.
            unsafe {
                layer.enqueue_append::<T>(batch, meta, (k.addr(), k_stride), (v.addr(), v_stride))?;
                self.enqueue_decode(layer, &p, q.addr(), meta)?;
            }
        }
        // SAFETY: every row of the step had its partials written by its pass; the merge
        // reads the whole step's batch (its rows' slots, counts and first rows), out
        // checked above.
        unsafe {
            self.enqueue_merge::<O>(layer, &p, batch.max_rows as u32, out.addr(), out_row_stride, batch.meta.addr())?
        };
        layer.commit_batch(batch);
        Ok(())
    }

    /// The decode parameters of a step batch's rows (queries `q_row_stride` apart, of
    /// type `Q`).
    pub(super) fn batch_params<Q: KvElement>(
        &self,
        layer: &DeviceLayer,
        batch: &StepBatch,
        q_row_stride: usize,
    ) -> DecodeParams {
        DecodeParams {
            q_seq_stride: 0,
            q_token_stride: q_row_stride as u32,
            q_dtype: Q::DTYPE,
            batch_rows: batch.max_rows as u32,
            batch_seqs: batch.max_seqs as u32,
            ..Self::params(
                layer,
                self.shape.max_seqs,
                self.num_splits,
                self.sm_scale,
                self.shape.max_q_len,
                self.attn_window,
            )
        }
    }

    /// `q` and `out` of a step batch's rows: `(device, elements, row stride)` each, of
    /// this device, strides of at least a row within `u32`, `batch.max_rows()` rows.
    pub(super) fn check_rows(
        layer: &DeviceLayer,
        batch: &StepBatch,
        q: (u64, usize, usize),
        out: (u64, usize, usize),
    ) -> Result<()> {
        let dev = &layer.device;
        let (hq, d) = (layer.shape.num_q_heads, layer.config.head_dim);
        dev.check_view(q.0, "q")?;
        dev.check_view(out.0, "out")?;
        for (what, (_, len, stride)) in [("q", q), ("out", out)] {
            if stride < hq * d || stride > u32::MAX as usize {
                return Err(Error::Shape(format!("{what} row stride {stride}: at least {hq} heads x {d}, within u32")));
            }
            let need = (batch.max_rows - 1) * stride + hq * d;
            if len < need {
                return Err(Error::Shape(format!(
                    "{what} has {len} elements; the batch's {} rows at row stride {stride} need {need}",
                    batch.max_rows
                )));
            }
        }
        Ok(())
    }

    /// Every check of [`DecodePlan::run_batch`] that concerns the plan, the layer and the
    /// batch (not the query and output buffers), nothing enqueued: what a stack runs
    /// before replaying a captured step, whose launches skip the host (with
    /// [`DeviceLayer::advance`] for the append's side). A batch that fails it must not be
    /// replayed: the kernels would leave a slot with more rows than `max_q_len` undecoded
    /// (its rows written as zeros), never read out of bounds.
    /// The layer's lengths may be the batch's starts (before the step's
    /// [`DeviceLayer::advance`]) or its starts plus counts (after it).
    pub fn check_batch(&self, layer: &DeviceLayer, batch: &StepBatch) -> Result<()> {
        self.check_steps(layer, batch, false)
    }

    /// [`DecodePlan::check_batch`]; `appended`: the layer must hold the batch's tokens
    /// already (what a launch reads).
    pub(super) fn check_steps(&self, layer: &DeviceLayer, batch: &StepBatch, appended: bool) -> Result<()> {
        self.check_layer(layer)?;
        if batch.device.0.id != layer.device.0.id {
            return Err(Error::Device("the step batch belongs to another device handle".into()));
        }
        let workspace_rows = self.shape.max_seqs * self.shape.max_q_len;
        if batch.max_rows > workspace_rows {
            return Err(Error::Shape(format!(
                "a step batch of {} rows; the plan's workspace holds {workspace_rows} (max_seqs x max_q_len)",
                batch.max_rows
            )));
        }
        for (slot, start, count) in batch.entries() {
            if slot >= self.shape.max_seqs {
                return Err(Error::Shape(format!(
                    "slot {slot} of the batch: the plan decodes 0 .. {}",
                    self.shape.max_seqs
                )));
            }
            if count > self.shape.max_q_len {
                return Err(Error::Shape(format!(
                    "slot {slot} has {count} rows this step; the plan takes at most {} per sequence",
                    self.shape.max_q_len
                )));
            }
            let len = layer.seqs[slot].as_ref().map_or(0, |s| s.len);
            if len != start + count && (appended || len != start) {
                return Err(Error::Shape(format!(
                    "slot {slot} holds {len} tokens, not the {} of the batch's append: append the batch to this layer \
                     first (DeviceLayer::append_batch)",
                    start + count
                )));
            }
        }
        self.check_live(layer)
    }

    /// The decode and merge launches of `p` (`rows` output rows), `meta` the step batch
    /// or 0.
    ///
    /// # Safety
    /// The kernels' contracts for `p` over the layer's and the plan's buffers, `q` and
    /// `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn enqueue<O: OutputElement>(
        &self,
        layer: &DeviceLayer,
        p: &DecodeParams,
        rows: u32,
        q: u64,
        out: u64,
        out_row_stride: usize,
        meta: u64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe {
            self.enqueue_decode(layer, p, q, meta)?;
            self.enqueue_merge::<O>(layer, p, rows, out, out_row_stride, meta)
        }
    }

    /// The decode launch of [`DecodePlan::enqueue`].
    ///
    /// # Safety
    /// As [`DecodePlan::enqueue`].
    pub(super) unsafe fn enqueue_decode(&self, layer: &DeviceLayer, p: &DecodeParams, q: u64, meta: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe {
            raw::decode(
                &layer.device,
                p,
                &DecodePtrs {
                    q,
                    pool: layer.pool.addr(),
                    tables: layer.tables.addr(),
                    lens: layer.lens.addr(),
                    sides: layer.sides.addr(),
                    protected: layer.protected.addr(),
                    key_scale: layer.key_scale.addr(),
                    key_perm: layer.key_perm.addr(),
                    key_rot: layer.key_rot.addr(),
                    m: self.m.addr(),
                    l: self.l.addr(),
                    o: self.o.addr(),
                    meta,
                },
            )
        }
    }

    /// The merge launch of [`DecodePlan::enqueue`].
    ///
    /// # Safety
    /// As [`DecodePlan::enqueue`], the partials of every row written.
    pub(super) unsafe fn enqueue_merge<O: OutputElement>(
        &self,
        layer: &DeviceLayer,
        p: &DecodeParams,
        rows: u32,
        out: u64,
        out_row_stride: usize,
        meta: u64,
    ) -> Result<()> {
        let mp = MergeParams {
            num_seqs: rows,
            num_q_heads: p.num_q_heads,
            num_kv_heads: p.num_kv_heads,
            head_dim: p.format.head_dim,
            num_splits: p.num_splits,
            flags: (p.flags & !crate::OUTPUT_FLAGS) | O::FLAG,
            out_row_stride: out_row_stride as u32,
            batch_seqs: p.batch_seqs,
            q_len: p.q_len,
        };
        // SAFETY: forwarded contract.
        unsafe {
            raw::merge(
                &layer.device,
                &mp,
                &MergePtrs {
                    m: self.m.addr(),
                    l: self.l.addr(),
                    o: self.o.addr(),
                    vperm_inv: layer.vperm_inv.addr(),
                    value_rot: layer.value_rot.addr(),
                    out,
                    meta,
                },
            )
        }
    }
}
