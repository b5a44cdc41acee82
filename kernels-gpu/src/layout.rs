//! Byte layout of the cache (format v1, see `docs/src/format.md`).
//!
//! All sizes are in bytes unless a name says `elems` or `tokens`. These functions do no
//! validation: the host checks a [`Format`] once (see `rotkv::CacheConfig`) before any
//! of them is used.

/// `a / b`, and 0 when `b` is 0. Every divisor here is a format field the host validated
/// as non-zero; spelling the division this way leaves device code without a trap path
/// (a panicking division would need `core`'s panic machinery, which PTX does not link).
#[inline]
pub const fn div(a: u32, b: u32) -> u32 {
    match a.checked_div(b) {
        Some(q) => q,
        None => 0,
    }
}

/// `a % b`, and 0 when `b` is 0 (see [`div`]).
#[inline]
pub const fn rem(a: u32, b: u32) -> u32 {
    match a.checked_rem(b) {
        Some(r) => r,
        None => 0,
    }
}

/// [`Format::locate`]'s page of a side-store row.
pub const SIDE_PAGE: u32 = u32::MAX;

/// Where a token of a sequence lives, by its position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// An f16 row of the side store: row `index` of the sink part for the leading
    /// positions, and (as decode resolves protected positions, see
    /// [`Format::protected_row`]) a protected row.
    Sink { index: u32 },
    /// A quantized token: slot `slot` of logical page `page` (through the block table).
    Page { page: u32, slot: u32 },
    /// A recent token: f16 row `slot` of the window ring of the side store.
    Window { slot: u32 },
}

/// The shape of one cache layer: what every kernel needs to find a byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Format {
    /// Channels per head (64, 128 or 256).
    pub head_dim: u32,
    /// Bits per key code (2 or 4).
    pub key_bits: u32,
    /// Bits per value code (2 or 4).
    pub value_bits: u32,
    /// Channels per quantization group.
    pub group_size: u32,
    /// Tokens per page (a power of two).
    pub page_size: u32,
    /// Number of leading tokens kept in f16 forever (attention sinks).
    pub sinks: u32,
    /// Number of newest tokens that are always in f16 (the recent window).
    pub window: u32,
    /// Range kept by the key quantizer, Q16 fixed point ([`NO_CLIP`] = 65536: the group's
    /// whole min..max; below it the range shrinks about its midpoint, see [`clip_range`]).
    /// Only append reads it: decoding is the same for every value.
    pub key_clip: u32,
    /// The same for values.
    pub value_clip: u32,
    /// Protected positions a sequence may hold (detected attention sinks beyond the
    /// leading `sinks`): each keeps a copy of its f16 rows in the side store, and decode
    /// reads that copy instead of the page once the position is quantized. 0 to
    /// [`crate::MAX_PROTECTED`].
    pub protected: u32,
    /// Variance normalization (KVarN): 0 for none, else the Sinkhorn iterations that
    /// compute each head-page's f16 channel scales for keys and for values (stored after
    /// the zeros, see [`Format::channel_scale_at`]); channels are divided by them before
    /// quantization and multiplied back when read.
    pub channel_norm: u32,
}

/// [`Format::key_clip`] that keeps the whole range (the DESIGN.md quantizer).
pub const NO_CLIP: u32 = 1 << 16;

/// The quantization range of a group with min `lo` and max `hi` for a Q16 clip ratio:
/// `(lo, hi)` itself at [`NO_CLIP`] or above, else the range shrunk about its midpoint to
/// `ratio * (hi - lo)`. Values outside it get code 0 or the top code. Every backend calls
/// this one function in f64, so they agree bit for bit.
#[inline]
pub fn clip_range(lo: f64, hi: f64, clip_q16: u32) -> (f64, f64) {
    if clip_q16 >= NO_CLIP {
        return (lo, hi);
    }
    let half = 0.5 * (hi - lo) * (clip_q16 as f64 / NO_CLIP as f64);
    let mid = 0.5 * (lo + hi);
    (mid - half, mid + half)
}

impl Format {
    /// Quantization groups per head.
    #[inline]
    pub const fn groups(&self) -> u32 {
        div(self.head_dim, self.group_size)
    }
    /// Bytes of key codes per token and head.
    #[inline]
    pub const fn key_code_bytes(&self) -> u32 {
        self.head_dim * self.key_bits / 8
    }
    /// Bytes of value codes per token and head.
    #[inline]
    pub const fn value_code_bytes(&self) -> u32 {
        self.head_dim * self.value_bits / 8
    }
    /// Bytes of scale/zero pairs per token and head (for keys, and again for values).
    #[inline]
    pub const fn param_bytes(&self) -> u32 {
        self.groups() * crate::GROUP_PARAM_BYTES
    }
    /// Bytes per quantized token and KV head: codes plus scales and zeros, K and V.
    #[inline]
    pub const fn bytes_per_token(&self) -> u32 {
        self.key_code_bytes() + self.value_code_bytes() + 2 * self.param_bytes()
    }
    /// Bytes of the channel scales of a head-page: `head_dim` f16 for keys and as many
    /// for values with variance normalization, else none.
    #[inline]
    pub const fn channel_scale_bytes(&self) -> u32 {
        if self.channel_norm > 0 { 4 * self.head_dim } else { 0 }
    }
    /// Bytes of one head-page (`page_size` tokens of one KV head, and its channel scales).
    #[inline]
    pub const fn page_bytes(&self) -> u32 {
        self.page_size * self.bytes_per_token() + self.channel_scale_bytes()
    }
    /// Offset of the f16 channel scale of channel `c` of the keys (`value == false`) or
    /// values inside a head-page (only with [`Format::channel_norm`]): after the value
    /// zeros, keys then values.
    #[inline]
    pub const fn channel_scale_at(&self, value: bool, c: u32) -> u32 {
        self.page_size * self.bytes_per_token() + 2 * (if value { self.head_dim } else { 0 } + c)
    }
    /// Offset of the key codes of `slot` inside a head-page.
    #[inline]
    pub const fn key_codes_at(&self, slot: u32) -> u32 {
        slot * self.key_code_bytes()
    }
    /// Offset of the value codes of `slot` inside a head-page.
    #[inline]
    pub const fn value_codes_at(&self, slot: u32) -> u32 {
        self.page_size * self.key_code_bytes() + slot * self.value_code_bytes()
    }
    /// Bits of the key (`value == false`) or value codes.
    #[inline]
    pub const fn bits(&self, value: bool) -> u32 {
        if value { self.value_bits } else { self.key_bits }
    }
    /// The Q16 clip ratio of the key (`value == false`) or value quantizer.
    #[inline]
    pub const fn clip(&self, value: bool) -> u32 {
        if value { self.value_clip } else { self.key_clip }
    }
    /// Bytes of one token's key or value codes.
    #[inline]
    pub const fn code_bytes(&self, value: bool) -> u32 {
        if value { self.value_code_bytes() } else { self.key_code_bytes() }
    }
    /// Offset of the key or value codes of `slot` inside a head-page.
    #[inline]
    pub const fn codes_at(&self, value: bool, slot: u32) -> u32 {
        if value { self.value_codes_at(slot) } else { self.key_codes_at(slot) }
    }
    /// Offset of the f16 scale of group `group` of the key or value of `slot` inside a
    /// head-page. Scales and zeros are planar and group-major: for keys, then values,
    /// `scales[group][slot]` then `zeros[group][slot]`, so consecutive tokens' scales of
    /// one group are contiguous.
    #[inline]
    pub const fn scale_at(&self, value: bool, group: u32, slot: u32) -> u32 {
        let base = self.page_size * (self.key_code_bytes() + self.value_code_bytes())
            + if value { self.page_size * self.param_bytes() } else { 0 };
        base + 2 * (group * self.page_size + slot)
    }
    /// Offset of the f16 zero of group `group` of the key or value of `slot`.
    #[inline]
    pub const fn zero_at(&self, value: bool, group: u32, slot: u32) -> u32 {
        self.scale_at(value, group + self.groups(), slot)
    }
    /// Offset of the head-page of `kv_head` in physical block `block` of a layer's pool
    /// (pool layout `[block][kv_head][page_bytes]`).
    #[inline]
    pub const fn page_offset(&self, block: u32, kv_head: u32, num_kv_heads: u32) -> usize {
        (block as usize * num_kv_heads as usize + kv_head as usize) * self.page_bytes() as usize
    }

    /// Rows in the window ring: `window + page_size`, so that a full page can be flushed
    /// while at least `window` newest tokens stay in f16.
    #[inline]
    pub const fn window_capacity(&self) -> u32 {
        self.window + self.page_size
    }
    /// f16 rows per head in the side store: sinks, the window ring, then the protected
    /// rows.
    #[inline]
    pub const fn side_rows(&self) -> u32 {
        self.sinks + self.window_capacity() + self.protected
    }
    /// The side row holding the copy of a sequence's protected position number `index`
    /// (its place in the sequence's ascending list of protected positions).
    #[inline]
    pub const fn protected_row(&self, index: u32) -> u32 {
        self.sinks + self.window_capacity() + index
    }
    /// f16 elements of one sequence's side store for one layer:
    /// `[kv_head][K|V][side_rows][head_dim]`.
    #[inline]
    pub const fn side_elems(&self, num_kv_heads: u32) -> usize {
        num_kv_heads as usize * 2 * self.side_rows() as usize * self.head_dim as usize
    }
    /// Element offset of row `row` of the keys (`value == false`) or values of
    /// `kv_head` in a side store.
    #[inline]
    pub const fn side_row_at(&self, kv_head: u32, value: bool, row: u32) -> usize {
        ((kv_head as usize * 2 + value as usize) * self.side_rows() as usize + row as usize) * self.head_dim as usize
    }

    /// Number of quantized tokens in a sequence of `len` tokens.
    ///
    /// Tokens after the sinks enter the window; whenever the window holds
    /// `window + page_size` tokens, its oldest `page_size` tokens are quantized into the
    /// next page. So the quantized count is the largest multiple of `page_size` that
    /// leaves at least `window` tokens in the window.
    #[inline]
    pub const fn quantized_len(&self, len: u32) -> u32 {
        if len <= self.sinks + self.window {
            0
        } else {
            div(len - self.sinks - self.window, self.page_size) * self.page_size
        }
    }
    /// Pages a sequence of `len` tokens uses.
    #[inline]
    pub const fn pages_for(&self, len: u32) -> u32 {
        div(self.quantized_len(len), self.page_size)
    }
    /// The window-ring row of position `pos` (`pos >= sinks`) while it is in the window.
    #[inline]
    pub const fn window_row(&self, pos: u32) -> u32 {
        self.sinks + rem(pos - self.sinks, self.window_capacity())
    }
    /// Where the token at position `pos` of a sequence of `len` tokens lives.
    #[inline]
    pub const fn place(&self, pos: u32, len: u32) -> Place {
        let (page, row) = self.locate(pos, len);
        if page != SIDE_PAGE {
            Place::Page { page, slot: row }
        } else if pos < self.sinks {
            Place::Sink { index: row }
        } else {
            Place::Window { slot: row }
        }
    }
    /// [`Format::place`] as two scalars `(page, row)`: slot `row` of logical page `page`,
    /// or side-store row `row` (a sink index or a window slot) when `page ==`
    /// [`SIDE_PAGE`]. Device code uses this form: an enum can end up in local memory.
    #[inline(always)]
    pub const fn locate(&self, pos: u32, len: u32) -> (u32, u32) {
        if pos < self.sinks {
            return (SIDE_PAGE, pos);
        }
        let rel = pos - self.sinks;
        if rel < self.quantized_len(len) {
            (div(rel, self.page_size), rem(rel, self.page_size))
        } else {
            (SIDE_PAGE, self.window_row(pos))
        }
    }
}
