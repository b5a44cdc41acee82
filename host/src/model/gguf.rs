//! A reader for GGUF files (versions 2 and 3): metadata, tensor directory, and
//! dequantization to f32 of the tensor types llama-family files use (F32, F16, BF16,
//! Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), checked against gguf-py's dequantization
//! (`data/ggml_blocks.json`). Other types are reported as
//! [`Error::Unsupported`] when a tensor of that type is read.
//!
//! Hand-written rather than candle-core's `quantized` module (`gguf_file`, `QMatMul`):
//! the harness needs products over the weights that are exact in f32, because its
//! forward pass is checked against numpy in float64 and its perplexities must not depend
//! on how the weights are stored. candle's `QMatMul` quantizes the activations to 8-bit
//! blocks first: 5e-3 to 6e-3 relative error on Gemma 3's Q4_K, Q5_0, Q6_K and Q8_0
//! matrices, against 2e-7 to 3e-7 for [`super::math::matmul`] over the same blocks
//! (`tests/tests/candle.rs`, `candle_qmatmul_quantizes_activations_where_rotkv_does_not`).
//! The reader itself is small, bounds-checked for hostile files (fuzzed), and needs no
//! candle dependency for the `model` feature.

use crate::error::{Error, Result};
use half::{bf16, f16};
use std::collections::HashMap;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The value as booleans, if it is an array of booleans.
    pub fn as_bool_array(&self) -> Option<Vec<bool>> {
        match self {
            Value::Array(a) => a.iter().map(|v| if let Value::Bool(b) = v { Some(*b) } else { None }).collect(),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// ggml dimensions, fastest-varying first (`[in, out]` for a weight matrix).
    pub dims: Vec<u64>,
    /// ggml type id.
    pub kind: u32,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }
}

/// A parsed GGUF file held in memory.
pub struct Gguf {
    /// Metadata key/value pairs.
    pub metadata: HashMap<String, Value>,
    /// Tensor directory by name.
    pub tensors: HashMap<String, TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf").field("metadata", &self.metadata.len()).field("tensors", &self.tensors.len()).finish()
    }
}

/// ggml type ids and block geometry: `(block elements, block bytes)`.
pub(crate) fn block_geometry(kind: u32) -> Option<(usize, usize)> {
    Some(match kind {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0: f16 d, 16 B nibbles
        3 => (32, 20),    // Q4_1: f16 d, f16 m, 16 B nibbles
        6 => (32, 22),    // Q5_0: f16 d, 4 B high bits, 16 B nibbles
        7 => (32, 24),    // Q5_1: f16 d, f16 m, 4 B high bits, 16 B nibbles
        8 => (32, 34),    // Q8_0: f16 d, 32 i8
        12 => (256, 144), // Q4_K: f16 d, f16 dmin, 12 B of 6-bit scales and mins, 128 B nibbles
        14 => (256, 210), // Q6_K: 128 B low nibbles, 64 B high 2 bits, 16 i8 scales, f16 d
        30 => (1, 2),     // BF16
        _ => return None,
    })
}

/// The ggml name of a type id (for messages).
pub fn type_name(kind: u32) -> &'static str {
    match kind {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        30 => "BF16",
        _ => "unknown",
    }
}

/// Most metadata array elements a file may hold in all (each takes a [`Value`] of 32
/// bytes in memory, whatever its size in the file): 4 Mi, several times the arrays of the
/// largest vocabularies (256k tokens with scores, types and merges), so parsed metadata
/// stays within 128 MiB plus its strings.
pub const MAX_METADATA_ELEMENTS: usize = 1 << 22;

/// Most top-level metadata keys a file may declare: 64 Ki (files hold about 20 to 60).
/// Each key costs about 100 bytes in memory (its string, its [`Value`], its map slot),
/// whatever its few bytes in the file, so the count is checked before the map is built.
/// Every key also takes one element of [`MAX_METADATA_ELEMENTS`].
pub const MAX_METADATA_KEYS: usize = 1 << 16;

/// Most tensor entries a file may declare: 64 Ki (the largest models hold a few
/// thousand). Each costs about 150 bytes in memory, checked as [`MAX_METADATA_KEYS`].
pub const MAX_TENSORS: usize = 1 << 16;

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
    /// Array elements still allowed ([`MAX_METADATA_ELEMENTS`] in all).
    elements_left: usize,
}

/// Fewest bytes an element of GGUF metadata type `kind` takes in the file.
fn min_size(kind: u32) -> usize {
    match kind {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
            Error::Input(format!("GGUF truncated: {n} bytes wanted at offset {} of {}", self.at, self.b.len()))
        })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn count(&mut self, what: &str) -> Result<usize> {
        let n = self.u64()?;
        // Every counted item takes at least one byte: a larger count is a corrupt file.
        if n > (self.b.len() - self.at) as u64 {
            return Err(Error::Input(format!("GGUF {what} count {n} is larger than the file")));
        }
        Ok(n as usize)
    }
    /// Takes `n` elements of the metadata budget ([`MAX_METADATA_ELEMENTS`]: array
    /// elements and top-level keys).
    fn charge(&mut self, n: usize) -> Result<()> {
        if n > self.elements_left {
            return Err(Error::Input(format!(
                "GGUF metadata holds more than {MAX_METADATA_ELEMENTS} elements in all (keys and array elements; \
                 {n} more asked)"
            )));
        }
        self.elements_left -= n;
        Ok(())
    }
    fn string(&mut self) -> Result<String> {
        let n = self.count("string length")?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| Error::Input("GGUF string is not UTF-8".into()))
    }
    fn value(&mut self, kind: u32, depth: usize) -> Result<Value> {
        let b = |c: &mut Self, n| c.take(n).map(|s| s.to_vec());
        Ok(match kind {
            0 => Value::U64(b(self, 1)?[0] as u64),
            1 => Value::I64(b(self, 1)?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(b(self, 2)?.try_into().expect("2")) as u64),
            3 => Value::I64(i16::from_le_bytes(b(self, 2)?.try_into().expect("2")) as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(b(self, 1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(Error::Input("GGUF arrays nested too deeply".into()));
                }
                let inner = self.u32()?;
                let n = self.u64()?;
                // Checked against the bytes left before anything is allocated, and
                // against the element budget (1-byte booleans become 32-byte values).
                let left = (self.b.len() - self.at) as u64;
                if n.checked_mul(min_size(inner) as u64).is_none_or(|bytes| bytes > left) {
                    return Err(Error::Input(format!(
                        "GGUF array of {n} elements of type {inner} at offset {} is larger than the rest of the file ({left} bytes)",
                        self.at
                    )));
                }
                let n = n as usize;
                self.charge(n)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(inner, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(Error::Input(format!("GGUF metadata type {other} is unknown"))),
        })
    }
}

impl Gguf {
    /// Reads and parses a GGUF file.
    pub fn open(path: &std::path::Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::Input(format!("reading {}: {e}", path.display())))?;
        Self::parse(bytes)
    }

    /// The magic, version, tensor count and metadata of a GGUF header.
    fn header(c: &mut Cursor<'_>) -> Result<(usize, HashMap<String, Value>)> {
        if c.take(4)? != b"GGUF" {
            return Err(Error::Input("not a GGUF file (magic bytes differ)".into()));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::Unsupported(format!("GGUF version {version} (2 and 3 are read)")));
        }
        let n_tensors = c.count("tensor")?;
        let n_kv = c.count("metadata")?;
        // Checked before anything is read or allocated: a file of millions of tiny
        // entries would take about 100 times its size in memory.
        if n_tensors > MAX_TENSORS {
            return Err(Error::Input(format!(
                "GGUF file declares {n_tensors} tensors; at most {MAX_TENSORS} are read"
            )));
        }
        if n_kv > MAX_METADATA_KEYS {
            return Err(Error::Input(format!(
                "GGUF file declares {n_kv} metadata keys; at most {MAX_METADATA_KEYS} are read"
            )));
        }
        // Every key is one element of the budget, as each array element is.
        c.charge(n_kv)?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let kind = c.u32()?;
            let value = c.value(kind, 0)?;
            if metadata.contains_key(&key) {
                return Err(Error::Input(format!("GGUF metadata key {key} appears twice")));
            }
            metadata.insert(key, value);
        }
        Ok((n_tensors, metadata))
    }

    /// Parses only the metadata of a GGUF header, no tensors: enough for the tokenizer
    /// ([`super::tokenizer::Tokenizer::from_gguf`]) and the hyper-parameters, and it reads
    /// the first chunk of a file split into parts. The result has no tensors.
    pub fn parse_metadata(mut bytes: Vec<u8>) -> Result<Self> {
        let mut c = Cursor { b: &bytes, at: 0, elements_left: MAX_METADATA_ELEMENTS };
        let (_, metadata) = Self::header(&mut c)?;
        // Nothing past the metadata is kept; `data_start` is the metadata's end, with no
        // tensor data behind it.
        let data_start = c.at;
        bytes.truncate(data_start);
        bytes.shrink_to_fit();
        Ok(Self { metadata, tensors: HashMap::new(), bytes, data_start })
    }

    /// Parses a GGUF file held in memory.
    pub fn parse(bytes: Vec<u8>) -> Result<Self> {
        let mut c = Cursor { b: &bytes, at: 0, elements_left: MAX_METADATA_ELEMENTS };
        let (n_tensors, metadata) = Self::header(&mut c)?;
        let mut tensors = HashMap::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims > 4 {
                return Err(Error::Input(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
            let kind = c.u32()?;
            let offset = c.u64()?;
            if tensors.contains_key(&name) {
                return Err(Error::Input(format!("GGUF tensor {name} appears twice")));
            }
            tensors.insert(name, TensorInfo { dims, kind, offset });
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| Error::Input(format!("GGUF general.alignment {v:?} is not a power of two")))?,
        };
        let data_start = usize::try_from(align)
            .ok()
            .and_then(|a| c.at.div_ceil(a).checked_mul(a))
            .ok_or_else(|| Error::Input(format!("GGUF alignment {align} puts the data past the end of the file")))?;
        let file = Self { metadata, tensors, bytes, data_start };
        // Every tensor of a known type must be aligned and lie inside the file.
        for (name, t) in &file.tensors {
            if !t.offset.is_multiple_of(align) {
                return Err(Error::Input(format!(
                    "tensor {name} at offset {} is not aligned to {align} bytes",
                    t.offset
                )));
            }
            if let Some(range) = file.data_range(t)?
                && range.end > file.bytes.len()
            {
                return Err(Error::Input(format!("tensor {name} runs past the end of the file")));
            }
        }
        Ok(file)
    }

    fn data_range(&self, t: &TensorInfo) -> Result<Option<std::ops::Range<usize>>> {
        let Some((block, bytes)) = block_geometry(t.kind) else { return Ok(None) };
        let n = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let n = n.filter(|n| n % block as u64 == 0 && *n < (1 << 40)).ok_or_else(|| {
            Error::Input(format!("tensor of {:?} elements does not fit {} blocks", t.dims, type_name(t.kind)))
        })? as usize;
        let start = usize::try_from(t.offset).ok().and_then(|o| self.data_start.checked_add(o));
        let range = start.and_then(|s| Some(s..s.checked_add(n / block * bytes)?));
        range.map(Some).ok_or_else(|| Error::Input(format!("tensor offset {} is past any file", t.offset)))
    }

    /// A metadata value, or an error naming the missing key.
    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata.get(key).ok_or_else(|| Error::Input(format!("GGUF metadata has no {key}")))
    }

    /// A metadata integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)?.as_u64().ok_or_else(|| Error::Input(format!("GGUF metadata {key} is not an integer")))
    }

    /// A metadata number.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)?.as_f64().ok_or_else(|| Error::Input(format!("GGUF metadata {key} is not a number")))
    }

    /// A metadata array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>> {
        match self.get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| v.as_str().ok_or_else(|| Error::Input(format!("GGUF metadata {key} holds a non-string"))))
                .collect(),
            _ => Err(Error::Input(format!("GGUF metadata {key} is not an array"))),
        }
    }

    /// A tensor's ggml type, stored bytes and dims (ggml order), as in the file.
    pub fn tensor_bytes(&self, name: &str) -> Result<(u32, &[u8], Vec<u64>)> {
        let t = self.tensors.get(name).ok_or_else(|| Error::Input(format!("GGUF has no tensor {name}")))?;
        let range = self
            .data_range(t)?
            .ok_or_else(|| Error::Unsupported(format!("tensor {name} has type {} ({})", type_name(t.kind), t.kind)))?;
        Ok((t.kind, &self.bytes[range], t.dims.clone()))
    }

    /// A tensor dequantized to f32, in ggml order (fastest dimension first), with its dims.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<u64>)> {
        let (kind, bytes, dims) = self.tensor_bytes(name)?;
        Ok((dequantize(kind, bytes)?, dims))
    }
}

/// Dequantizes whole blocks of ggml type `kind` to f32 (the ggml definitions).
pub fn dequantize(kind: u32, data: &[u8]) -> Result<Vec<f32>> {
    let (block, bytes) = block_geometry(kind).ok_or_else(|| Error::Unsupported(format!("ggml type {kind}")))?;
    let mut out = vec![0f32; data.len() / bytes * block];
    dequantize_into(kind, data, &mut out)?;
    Ok(out)
}

/// [`dequantize`] into `out`, which must hold exactly the values of `data`'s blocks.
pub fn dequantize_into(kind: u32, data: &[u8], out: &mut [f32]) -> Result<()> {
    let (block, bytes) = block_geometry(kind).ok_or_else(|| Error::Unsupported(format!("ggml type {kind}")))?;
    if !data.len().is_multiple_of(bytes) {
        return Err(Error::Shape(format!("{} bytes is not a whole number of {} blocks", data.len(), type_name(kind))));
    }
    if out.len() != data.len() / bytes * block {
        return Err(Error::Shape(format!("{} values for {} blocks of {block}", out.len(), data.len() / bytes)));
    }
    let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    for (b, y) in data.chunks_exact(bytes).zip(out.chunks_exact_mut(block)) {
        match kind {
            0 => y[0] = f32::from_le_bytes(b.try_into().expect("4 bytes")),
            1 => y[0] = h(b, 0),
            30 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            // Q4_0: x = d * (q - 8); low nibbles are elements 0..16, high nibbles 16..32.
            2 => {
                let d = h(b, 0);
                y.iter_mut().enumerate().for_each(|(i, o)| *o = d * (nibble(&b[2..], i) as f32 - 8.0));
            }
            // Q4_1: x = d * q + m.
            3 => {
                let (d, m) = (h(b, 0), h(b, 2));
                y.iter_mut().enumerate().for_each(|(i, o)| *o = d * nibble(&b[4..], i) as f32 + m);
            }
            // Q5_0: x = d * (q - 16), the fifth bit of element i in bit i of qh.
            6 => {
                let d = h(b, 0);
                let qh = u32::from_le_bytes(b[2..6].try_into().expect("4 bytes"));
                y.iter_mut()
                    .enumerate()
                    .for_each(|(i, o)| *o = d * ((nibble(&b[6..], i) | (((qh >> i) & 1) << 4) as u8) as f32 - 16.0));
            }
            // Q5_1: x = d * q + m.
            7 => {
                let (d, m) = (h(b, 0), h(b, 2));
                let qh = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
                y.iter_mut()
                    .enumerate()
                    .for_each(|(i, o)| *o = d * (nibble(&b[8..], i) | (((qh >> i) & 1) << 4) as u8) as f32 + m);
            }
            // Q8_0: x = d * q.
            8 => {
                let d = h(b, 0);
                y.iter_mut().zip(&b[2..34]).for_each(|(o, &q)| *o = d * q as i8 as f32);
            }
            12 => dequantize_q4_k(b, y),
            14 => dequantize_q6_k(b, y),
            _ => unreachable!("block_geometry covers the same kinds"),
        }
    }
    Ok(())
}

/// One Q4_K block (256 values): eight sub-blocks of 32, each `d * scale_j * q - dmin *
/// min_j` with 6-bit `scale_j`, `min_j` packed in 12 bytes; nibbles of 32 bytes give two
/// sub-blocks (low nibbles first).
fn dequantize_q4_k(b: &[u8], out: &mut [f32]) {
    let h = |i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    let (d, dmin) = (h(0), h(2));
    let sc = &b[4..16];
    let qs = &b[16..144];
    // Scale and min of sub-block j.
    let scale_min = |j: usize| -> (f32, f32) {
        if j < 4 {
            ((sc[j] & 63) as f32, (sc[j + 4] & 63) as f32)
        } else {
            (((sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4)) as f32, ((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)) as f32)
        }
    };
    for chunk in 0..4 {
        let q = &qs[32 * chunk..32 * (chunk + 1)];
        let (s1, m1) = scale_min(2 * chunk);
        let (s2, m2) = scale_min(2 * chunk + 1);
        let (lo, hi) = out[64 * chunk..64 * (chunk + 1)].split_at_mut(32);
        lo.iter_mut().zip(q).for_each(|(o, &x)| *o = d * s1 * (x & 0x0f) as f32 - dmin * m1);
        hi.iter_mut().zip(q).for_each(|(o, &x)| *o = d * s2 * (x >> 4) as f32 - dmin * m2);
    }
}

/// One Q6_K block (256 values): `d * scale[i / 16] * (q - 32)` with 6-bit `q` from a low
/// nibble and two high bits; two halves of 128 values.
fn dequantize_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16::from_le_bytes([b[208], b[209]]).to_f32();
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0x0f) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &qk) in q.iter().enumerate() {
                y[128 * half + l + 32 * k] = d * (sc[is + 2 * k] as i8) as f32 * (qk as i32 - 32) as f32;
            }
        }
    }
}

/// Element `i` (0..32) of a 16-byte nibble array: low nibbles first, then high nibbles.
fn nibble(q: &[u8], i: usize) -> u8 {
    if i < 16 { q[i] & 0x0f } else { q[i - 16] >> 4 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_and_q8_0_blocks() {
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let x = dequantize(3, &b).unwrap();
        assert_eq!(x[0], -1.0);
        assert_eq!(x[3], 0.5);
        assert_eq!(x[16], 6.5);
        let mut q8 = f16::from_f32(0.25).to_le_bytes().to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(8, &q8).unwrap();
        assert_eq!(y[0], -4.0);
        assert_eq!(y[31], 3.75);
        assert!(dequantize(3, &b[..19]).is_err());
        assert!(matches!(dequantize(13, &b), Err(Error::Unsupported(_))));
    }

    #[test]
    fn truncated_and_foreign_files_are_errors() {
        assert!(Gguf::parse(b"GGML\x03\0\0\0".to_vec()).is_err());
        assert!(Gguf::parse(b"GGUF\x03\0\0\0\x01".to_vec()).is_err());
        // A tensor whose offset points far past the end.
        let mut far = b"GGUF\x03\0\0\0".to_vec();
        far.extend_from_slice(&1u64.to_le_bytes());
        far.extend_from_slice(&0u64.to_le_bytes());
        far.extend_from_slice(&1u64.to_le_bytes());
        far.push(b'w');
        far.extend_from_slice(&1u32.to_le_bytes());
        far.extend_from_slice(&32u64.to_le_bytes());
        far.extend_from_slice(&0u32.to_le_bytes());
        far.extend_from_slice(&(u64::MAX - 8).to_le_bytes());
        assert!(Gguf::parse(far.clone()).is_err());
        // Its metadata alone (none here) reads, without tensors, as from a split file's
        // first part; a broken header is still an error.
        let meta = Gguf::parse_metadata(far).unwrap();
        assert!(meta.metadata.is_empty() && meta.tensors.is_empty());
        assert!(Gguf::parse_metadata(b"GGUF\x03\0\0\0\x01".to_vec()).is_err());
        let mut huge = b"GGUF\x03\0\0\0".to_vec();
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        huge.extend_from_slice(&0u64.to_le_bytes());
        assert!(Gguf::parse(huge).is_err());
    }
}
