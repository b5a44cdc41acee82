//! Builds FFHT (the fast Walsh-Hadamard transform of Andoni et al., the C library the
//! `fwht` benchmark compares rotkv's FWHT with) from `../shared/third_party/ffht` when that
//! folder exists, and sets `cfg(ffht)`. Its sources are never copied into this repository;
//! without them the benchmark prints `SKIPPED: FFHT sources not found`.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ffht)");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let dir = manifest.join("../../shared/third_party/ffht");
    println!("cargo::rerun-if-changed={}", dir.display());
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    // FFHT's fast path is AVX assembly: it is built (with the flags its ORIGIN.md gives)
    // for x86-64 only.
    if arch != "x86_64" || !dir.join("fht.c").exists() || !dir.join("fast_copy.c").exists() {
        return;
    }
    for f in ["fht.c", "fht.h", "fht_impl.h", "fht_avx.c", "fht_sse.c", "fast_copy.c", "fast_copy.h"] {
        println!("cargo::rerun-if-changed={}", dir.join(f).display());
    }
    cc::Build::new()
        .file(dir.join("fht.c"))
        .file(dir.join("fast_copy.c"))
        .include(&dir)
        .opt_level(3)
        .flag("-mavx2")
        .flag("-mfma")
        .warnings(false)
        .compile("ffht");
    println!("cargo::rustc-cfg=ffht");
}
