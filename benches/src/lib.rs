//! Shared helpers of the rotkv benchmarks: deterministic synthetic KV rows.

/// A decode benchmark shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Name in the benchmark id.
    pub name: &'static str,
    /// KV heads.
    pub hkv: usize,
    /// Query heads.
    pub hq: usize,
    /// Head dimension.
    pub d: usize,
}

/// `rows` rows of `d` values with a fixed seed: roughly normal values plus one large
/// outlier channel per row (as real keys have), never all zero.
pub fn synthetic_rows(rows: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut out = Vec::with_capacity(rows * d);
    for _ in 0..rows {
        for c in 0..d {
            let u = (next() + next() + next() + next() - 2.0) * 1.7;
            out.push(if c == 5 { u + 8.0 } else { u });
        }
    }
    out
}

/// The bytes of an f16 slice.
pub fn as_bytes(x: &[half::f16]) -> &[u8] {
    // f16 is two plain bytes; half's bytemuck feature provides the Pod impl.
    bytemuck::cast_slice(x)
}
