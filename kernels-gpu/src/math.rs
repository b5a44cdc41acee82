//! Arithmetic shared by the device kernels and the host (no `std`, no libm).

/// `exp(x)` for `x <= 0` in f32, branch-free: Cody-Waite range reduction and a degree-6
/// polynomial (relative error below 3e-7 on `[-87, 0]`); returns 0 below -87, for
/// `-inf` and for NaN.
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.max(-87.0);
    let t = x * core::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0 + r * (0.5 + r * (0.166_666_67 + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    // The low mantissa bits of t hold n (two's complement): 2^n without a float-to-int
    // conversion, so loops over this function stay vectorized.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23);
    let y = p * scale;
    if x <= -87.0 { 0.0 } else { y }
}

/// `1 / sqrt(d)` for the supported head dimensions (the FWHT normalization).
#[inline]
pub const fn inv_sqrt_head_dim(d: u32) -> f32 {
    match d {
        64 => 0.125,
        128 => 0.088_388_35,
        256 => 0.0625,
        _ => 0.0,
    }
}

/// IEEE binary16 bits to f32 (exact; subnormals, infinities and NaN included).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: value = man * 2^-24, exactly representable in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 31 {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let got = f16_to_f32(h);
            // Reference: decode by the definition in f64.
            let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
            let (e, m) = (((h >> 10) & 0x1f) as i32, (h & 0x3ff) as f64);
            let want = match e {
                0 => sign * m * 2f64.powi(-24),
                31 if m == 0.0 => sign * f64::INFINITY,
                31 => f64::NAN,
                _ => sign * (1.0 + m / 1024.0) * 2f64.powi(e - 15),
            };
            if want.is_nan() {
                assert!(got.is_nan());
            } else {
                assert_eq!(got as f64, want, "{h:#06x}");
            }
        }
    }
}
