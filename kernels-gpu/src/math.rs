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

/// `2^x` for `x <= 0` (0 for `-inf`, NaN for NaN): `ex2.approx.ftz.f32` on the device
/// (about 2 ulp), [`exp_neg`] elsewhere with the instruction's special values (PTX ISA,
/// `ex2`: `ex2(NaN) = NaN`, `ex2(-Inf) = +0`), so that a NaN score propagates on the
/// emulator as on a GPU.
#[inline(always)]
pub fn exp2_neg(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: a pure arithmetic instruction.
        unsafe {
            core::arch::asm!("ex2.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack))
        };
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        if x.is_nan() { x } else { exp_neg(x * core::f32::consts::LN_2) }
    }
}

/// The softmax weight `exp(s - m)` of a score `s` against the running max `m`, with
/// non-finite inputs kept visible: a NaN or `+Inf` score (a non-finite query or key)
/// gives NaN, which then reaches the row's sum and output; `-Inf` (a masked position)
/// gives 0, also when `m` is `-Inf` (an empty range).
#[inline(always)]
pub fn softmax_weight(s: f32, m: f32) -> f32 {
    if s.is_nan() || s == f32::INFINITY { f32::NAN } else { exp_neg(s - m) }
}

/// `a * b + c`: one `fma.rn.f32` on the device (Rust does not contract `a * b + c`);
/// the product and the sum rounded separately elsewhere.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: a pure arithmetic instruction.
        unsafe {
            core::arch::asm!("fma.rn.f32 {r}, {a}, {b}, {c};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, c = in(reg32) c, options(pure, nomem, nostack))
        };
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        a * b + c
    }
}

/// Two f32 rounded to f16 (to nearest even) in one `u32`, `lo` in the low half: one
/// `cvt.rn.f16x2.f32` on the device.
#[inline(always)]
pub fn pack_f16x2(lo: f32, hi: f32) -> u32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: u32;
        // SAFETY: a pure conversion instruction (sm_80+); the first source goes to the
        // upper half.
        unsafe {
            core::arch::asm!("cvt.rn.f16x2.f32 {r}, {hi}, {lo};", r = out(reg32) r, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack))
        };
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        f32_to_f16(lo) as u32 | (f32_to_f16(hi) as u32) << 16
    }
}

/// Two f16 products in one `u32` (`a * b` per 16-bit half, rounded once to nearest
/// even): one `mul.rn.f16x2` on the device; elsewhere the exact f32 product (11 x 11
/// significand bits fit in 24) rounded to f16, which is the same value.
#[inline(always)]
pub fn hmul2(a: u32, b: u32) -> u32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: u32;
        // SAFETY: a pure arithmetic instruction (sm_53+).
        unsafe {
            core::arch::asm!("mul.rn.f16x2 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, options(pure, nomem, nostack))
        };
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        let h = |w: u32, hi: bool| f16_to_f32(if hi { (w >> 16) as u16 } else { w as u16 });
        pack_f16x2(h(a, false) * h(b, false), h(a, true) * h(b, true))
    }
}

/// IEEE binary16 bits to f32: one `cvt.f32.f16` on the device, [`f16_to_f32`] elsewhere.
#[inline(always)]
pub fn h2f(h: u16) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: a pure conversion instruction.
        unsafe {
            core::arch::asm!("cvt.f32.f16 {r}, {h};", r = out(reg32) r, h = in(reg16) h, options(pure, nomem, nostack))
        };
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        f16_to_f32(h)
    }
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

/// Rounds a finite f64 to IEEE binary16 bits, to nearest with ties to even (overflow
/// gives infinity). Exact for the quantizer's inputs, which are differences of f16 values
/// divided by 3 or 15 and f16 values themselves.
#[inline(always)]
pub fn f64_to_f16(x: f64) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 48) & 0x8000) as u16;
    let exp = ((b >> 52) & 0x7ff) as i64;
    let man = b & ((1u64 << 52) - 1);
    if exp == 0x7ff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 1023 + 15;
    if e >= 31 {
        return sign | 0x7c00;
    }
    // Significand with the implicit bit (53 bits), and how far to shift it right.
    let (m, shift) = if e > 0 { (man | (1u64 << 52), 42u32) } else { (man | (1u64 << 52), (42 + 1 - e) as u32) };
    if exp == 0 || shift > 63 {
        return sign;
    }
    let kept = m >> shift;
    let rest = m & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    let up = (rest > half || (rest == half && kept & 1 == 1)) as u64;
    let bits = if e > 0 { ((e as u64) << 10) + (kept & 0x3ff) + up } else { kept + up };
    sign | bits as u16
}

/// Rounds an f32 to binary16 bits (see [`f64_to_f16`]; every f32 is an f64).
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    f64_to_f16(x as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulator's `ex2.approx.ftz.f32` keeps the instruction's special values (PTX
    /// ISA: `ex2(NaN) = NaN`, `ex2(-Inf) = +0`, `ex2(+-0) = 1`), and the softmax weight
    /// keeps a non-finite score visible while a masked one weighs nothing.
    #[test]
    fn special_values_of_the_exponentials() {
        assert!(exp2_neg(f32::NAN).is_nan());
        assert_eq!(exp2_neg(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(exp2_neg(0.0), 1.0);
        assert_eq!(exp2_neg(-0.0), 1.0);
        assert!((exp2_neg(-1.0) - 0.5).abs() < 1e-7);
        // Below the f32 range the result flushes to +0, as `.ftz` does.
        assert_eq!(exp2_neg(-200.0).to_bits(), 0);
        assert!(softmax_weight(f32::NAN, 1.0).is_nan());
        assert!(softmax_weight(f32::INFINITY, 1.0).is_nan());
        assert!(softmax_weight(f32::INFINITY, f32::INFINITY).is_nan());
        assert_eq!(softmax_weight(f32::NEG_INFINITY, 0.0), 0.0);
        assert_eq!(softmax_weight(f32::NEG_INFINITY, f32::NEG_INFINITY), 0.0);
        assert!((softmax_weight(1.0, 2.0) - (-1.0f32).exp()).abs() < 1e-7);
        // `max.f32` / `min.f32` (PTX ISA: NaN only when both inputs are NaN) are Rust's
        // `f32::max` / `min`, which the kernels use on both targets.
        assert_eq!(f32::NAN.max(1.0), 1.0);
        assert_eq!(1.0f32.min(f32::NAN), 1.0);
        assert!(f32::NAN.max(f32::NAN).is_nan());
        // `cvt.rn.f16.f32` of infinities and NaN: infinities, and a NaN (the kernels'
        // software rounding gives what the instruction gives, up to the NaN payload).
        assert_eq!(f32_to_f16(f32::INFINITY), 0x7c00);
        assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
        assert_eq!(f32_to_f16(1e6), 0x7c00, "overflow rounds to infinity");
        let n = f32_to_f16(f32::NAN);
        assert!(n & 0x7c00 == 0x7c00 && n & 0x3ff != 0, "{n:#x}");
        assert!(f16_to_f32(n).is_nan() && h2f(n).is_nan());
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    }

    #[test]
    fn f16_rounding_is_to_nearest_even() {
        for h in 0..0x7c00u16 {
            for sign in [0u16, 0x8000] {
                let bits = h | sign;
                let x = half::f16::from_bits(bits).to_f64();
                assert_eq!(f64_to_f16(x), bits, "{x:e}");
                if h == 0x7bff {
                    continue; // the next value is infinity
                }
                // Next value away from zero and the midpoint between the two.
                let next = half::f16::from_bits(bits + 1).to_f64();
                let mid = (x + next) / 2.0;
                let even = if bits & 1 == 0 { bits } else { bits + 1 };
                assert_eq!(f64_to_f16(mid), even, "mid {mid:e}");
                assert_eq!(f64_to_f16(mid * (1.0 + 1e-9)), bits + 1, "above {mid:e}");
                if mid * (1.0 - 1e-9) != 0.0 {
                    assert_eq!(f64_to_f16(mid * (1.0 - 1e-9)), bits, "below {mid:e}");
                }
                // f32 inputs: half's correctly rounded conversion is the oracle.
                for p in [x as f32, mid as f32, (mid * (1.0 + 1e-7)) as f32, (mid * (1.0 - 1e-7)) as f32] {
                    assert_eq!(f32_to_f16(p), half::f16::from_f32(p).to_bits(), "{p:e}");
                }
            }
        }
        assert_eq!(f64_to_f16(1e6), 0x7c00);
        assert_eq!(f64_to_f16(-1e6), 0xfc00);
        assert_eq!(f64_to_f16(1e-30), 0);
    }

    #[test]
    fn hmul2_rounds_each_half_product_once() {
        let vals: std::vec::Vec<u16> = (0..0x7c00u16).step_by(97).chain([0x0001, 0x03ff, 0x3c00, 0x7bff]).collect();
        for (i, &a) in vals.iter().enumerate() {
            let b = vals[(i * 7 + 3) % vals.len()];
            let c = vals[(i * 13 + 5) % vals.len()] | 0x8000;
            let want = |x: u16, y: u16| {
                half::f16::from_f64(half::f16::from_bits(x).to_f64() * half::f16::from_bits(y).to_f64()).to_bits()
            };
            let r = hmul2(a as u32 | (c as u32) << 16, b as u32 | (b as u32) << 16);
            assert_eq!(r as u16, want(a, b), "{a:#06x} * {b:#06x}");
            assert_eq!((r >> 16) as u16, want(c, b), "{c:#06x} * {b:#06x}");
        }
    }

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
