//! The reliability steps of `cargo xtask ci` (also `cargo xtask sanitize`): mutation
//! fuzzing on stable, the cargo-fuzz targets (also `cargo xtask fuzz`), Miri over the
//! unsafe-relevant unit tests, and AddressSanitizer over the cache API and property tests. Each prints its wall time;
//! a step whose toolchain component cannot be installed says SKIPPED and the rest run.
//!
//! Budgets (measured on the 2-core CI machine, see README "Reliability"):
//! - fuzz: [`FUZZ_ITERS`] mutated calibration files and ten times as many GGUF files
//!   (read, tokenizer, model load, a forward pass), reusing the test binary the suite
//!   just built.
//! - cargo-fuzz (nightly, libFuzzer, AddressSanitizer): `cargo install --locked
//!   cargo-fuzz` when missing, the four targets of `fuzz/` built once, then each run for
//!   [`CARGO_FUZZ_SECONDS`] from a scratch copy of its committed corpus
//!   (`fuzz/corpus/<target>/`, so git stays clean); a crash fails the step and names the
//!   input libFuzzer wrote under `fuzz/artifacts/<target>/`.
//! - Miri (nightly, Tree Borrows, leaks of rayon's pool threads ignored): the kernel
//!   crate's layout and emulator unit tests, and the host's buffer, slot-mapping,
//!   split-count, unpack-order and small-cache tests (append and decode on the
//!   reference and the portable cpu path) ([`MIRI_KERNEL_TESTS`], [`MIRI_HOST_TESTS`]).
//!   Not under Miri: the AVX2 kernels (runtime detection finds no AVX2 under Miri, so
//!   the portable path runs), the integration suites (hours when interpreted), the
//!   CUDA backend (a foreign library).
//! - ASan (nightly, `-Zsanitizer=address -Zbuild-std`, its own target directory): the
//!   host crate's unit tests (AVX2 against portable cpu kernels, a small cache on
//!   reference and cpu, slot mappings, the emulator's launches). With
//!   `ROTKV_ASAN_SUITES=1`: `tests/api.rs` and `tests/properties.rs` (reference, cpu and
//!   the emulated device kernels, [`ASAN_PROPTEST_CASES`] random cases) instead, which
//!   is far past the CI budget on two cores.

use crate::{Step, cargo, nightly, root, tally};
use std::path::Path;
use std::time::Instant;

/// `ROTKV_FUZZ_ITERS` in CI: mutated calibration files (GGUF files: ten times as many).
pub const FUZZ_ITERS: &str = "20000";
/// Kernel-crate unit tests (name filters) run under Miri.
pub const MIRI_KERNEL_TESTS: &[&str] = &[
    "layout::",
    "sim::tests::misaligned_load16_is_an_error",
    "sim::tests::indices_barriers_and_shuffles",
    "sim::tests::shfl_idx_u32_moves_raw_bits",
];
/// Host unit tests (name filters) run under Miri.
pub const MIRI_HOST_TESTS: &[&str] =
    &["cache::tests", "paged::tests", "launch::tests", "cpu::tests::unpack_order_is_a_permutation_within_groups"];
/// Random operation sequences of the property test under ASan.
pub const ASAN_PROPTEST_CASES: &str = "4";
/// Seconds each cargo-fuzz target runs in CI (`cargo xtask fuzz --seconds N` for longer).
pub const CARGO_FUZZ_SECONDS: u64 = 10;
/// The cargo-fuzz targets (`fuzz/fuzz_targets/<name>.rs`).
pub const CARGO_FUZZ_TARGETS: &[&str] = &["gguf", "calibration", "pool", "paged_ops"];

type StepFn = fn() -> Result<(), Step>;

/// Runs every step, recording failures and skips as `ci` does; returns the seconds each took.
pub fn steps(failed: &mut Vec<&'static str>, skipped: &mut Vec<&'static str>) -> Vec<(&'static str, f64)> {
    let mut times = Vec::new();
    let all: [(&'static str, StepFn); 4] =
        [("fuzz", fuzz), ("cargo-fuzz", || cargo_fuzz(CARGO_FUZZ_SECONDS)), ("miri", miri), ("asan", asan)];
    for (name, step) in all {
        println!("\n==> {name}");
        let started = Instant::now();
        tally(name, step(), failed, skipped);
        let secs = started.elapsed().as_secs_f64();
        println!("{name}: {secs:.0} s");
        times.push((name, secs));
    }
    times
}

/// `cargo xtask sanitize`: the steps alone.
pub fn run() -> Result<(), String> {
    let (mut failed, mut skipped) = (Vec::new(), Vec::new());
    let times = steps(&mut failed, &mut skipped);
    for (name, secs) in times {
        println!("{name:>6}: {secs:>5.0} s");
    }
    if !skipped.is_empty() {
        println!("SKIPPED steps: {}", skipped.join(", "));
    }
    if failed.is_empty() { Ok(()) } else { Err(format!("failed steps: {}", failed.join(", "))) }
}

fn status(mut c: std::process::Command) -> Result<(), Step> {
    println!("{c:?}");
    match c.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(Step::Failed(format!("{c:?} exited with {s}"))),
        Err(e) => Err(Step::Skipped(format!("cannot start {c:?}: {e}"))),
    }
}

/// The fuzz targets of `tests/fuzz.rs` with the CI budget (same features as the suite's
/// `cargo test --workspace --all-features`, so nothing is rebuilt).
fn fuzz() -> Result<(), Step> {
    let mut c = cargo();
    c.args(["test", "--workspace", "--all-features", "--test", "fuzz", "--", "--nocapture"]);
    c.env("ROTKV_FUZZ_ITERS", FUZZ_ITERS);
    status(c)
}

/// `cargo xtask fuzz [--seconds N]` and CI's cargo-fuzz step: installs cargo-fuzz when
/// missing, builds the targets (AddressSanitizer), runs each for `seconds` from a scratch
/// copy of its committed corpus; Failed on a crash with the input's path, Skipped where
/// the nightly or cargo-fuzz cannot be had.
pub fn cargo_fuzz(seconds: u64) -> Result<(), Step> {
    if !runs(&["rustc", "--version"]) {
        return Err(Step::Skipped("no nightly toolchain (cargo-fuzz needs one)".into()));
    }
    if !runs(&["cargo", "fuzz", "--version"]) {
        let mut c = cargo();
        c.args(["install", "--locked", "cargo-fuzz"]);
        status(c).map_err(|e| Step::Skipped(format!("cargo-fuzz cannot be installed: {e}")))?;
        if !runs(&["cargo", "fuzz", "--version"]) {
            return Err(Step::Skipped("cargo-fuzz was installed but `cargo +nightly fuzz` does not run".into()));
        }
    }
    // Every target of fuzz/Cargo.toml (the ones listed below).
    status(nightly(&["cargo", "fuzz", "build"]))?;
    let fuzz_dir = root().join("fuzz");
    let mut crashed = Vec::new();
    for target in CARGO_FUZZ_TARGETS {
        let scratch = fuzz_dir.join("target/corpus").join(target);
        let artifacts = fuzz_dir.join("artifacts").join(target);
        for dir in [&scratch, &artifacts] {
            let _ = std::fs::remove_dir_all(dir);
            std::fs::create_dir_all(dir).map_err(|e| Step::Failed(format!("{}: {e}", dir.display())))?;
        }
        copy_files(&fuzz_dir.join("corpus").join(target), &scratch)?;
        let mut c = nightly(&["cargo", "fuzz", "run", target]);
        c.arg(&scratch).arg("--").args([
            format!("-max_total_time={seconds}"),
            "-timeout=20".into(),
            "-print_final_stats=1".into(),
            format!("-artifact_prefix={}/", artifacts.display()),
        ]);
        if let Err(e) = status(c) {
            let inputs: Vec<String> = std::fs::read_dir(&artifacts)
                .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path().display().to_string()).collect())
                .unwrap_or_default();
            println!("cargo-fuzz {target} failed ({e}); input(s): {}", inputs.join(", "));
            crashed.push(format!("{target}: {}", inputs.join(", ")));
        }
    }
    if crashed.is_empty() {
        Ok(())
    } else {
        Err(Step::Failed(format!("cargo-fuzz found crashes: {}", crashed.join("; "))))
    }
}

/// Copies the plain files of `from` into `to`.
fn copy_files(from: &Path, to: &Path) -> Result<(), Step> {
    let entries = std::fs::read_dir(from).map_err(|e| Step::Failed(format!("{}: {e}", from.display())))?;
    for entry in entries.filter_map(|e| e.ok()).filter(|e| e.path().is_file()) {
        std::fs::copy(entry.path(), to.join(entry.file_name()))
            .map_err(|e| Step::Failed(format!("{}: {e}", entry.path().display())))?;
    }
    Ok(())
}

/// Installs a nightly component when `present` says it is missing; Skipped when it
/// cannot be had.
fn nightly_component(component: &str, present: impl Fn() -> bool) -> Result<(), Step> {
    if present() {
        return Ok(());
    }
    println!("installing rustup component {component} (nightly)");
    let _ =
        std::process::Command::new("rustup").args(["component", "add", component, "--toolchain", "nightly"]).status();
    if present() {
        Ok(())
    } else {
        Err(Step::Skipped(format!("the nightly {component} component cannot be installed here")))
    }
}

/// Whether a nightly command runs and succeeds.
fn runs(args: &[&str]) -> bool {
    nightly(args).output().map(|o| o.status.success()).unwrap_or(false)
}

fn miri() -> Result<(), Step> {
    nightly_component("miri", || runs(&["cargo", "miri", "--version"]))?;
    // rayon's global pool threads never exit (by design): their leak is not checked.
    let flags = "-Zmiri-tree-borrows -Zmiri-ignore-leaks";
    let mut setup = nightly(&["cargo", "miri", "setup"]);
    setup.env("MIRIFLAGS", flags);
    status(setup).map_err(|e| Step::Skipped(format!("cargo miri setup: {e}")))?;
    for (package, tests) in [("rotkv-kernels", MIRI_KERNEL_TESTS), ("rotkv", MIRI_HOST_TESTS)] {
        let mut c = nightly(&["cargo", "miri", "test", "-p", package, "--features", "sim", "--lib", "--"]);
        c.args(tests).env("MIRIFLAGS", flags);
        status(c)?;
    }
    Ok(())
}

fn asan() -> Result<(), Step> {
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        return Err(Step::Skipped("AddressSanitizer runs on x86_64 Linux".into()));
    }
    let library = || {
        let sysroot = nightly(&["rustc", "--print", "sysroot"]).output().ok().filter(|o| o.status.success());
        sysroot.is_some_and(|o| {
            std::path::Path::new(String::from_utf8_lossy(&o.stdout).trim())
                .join("lib/rustlib/src/rust/library")
                .exists()
        })
    };
    nightly_component("rust-src", library)?;
    let target = "x86_64-unknown-linux-gnu";
    // The host's unit tests: the AVX2 and portable cpu kernels against each other,
    // append and decode through a small cache (reference, cpu), slot mappings, the
    // emulator's launch code. (The api and property suites under ASan need cudarc and
    // the whole test crate rebuilt instrumented: about 27 minutes here, past the budget;
    // run them by hand with `cargo xtask sanitize` after setting ROTKV_ASAN_SUITES=1.)
    let mut c = nightly(&["cargo", "test", "-Zbuild-std", "--target", target]);
    if std::env::var_os("ROTKV_ASAN_SUITES").is_some() {
        c.args(["-p", "rotkv-tests", "--test", "api", "--test", "properties"]);
    } else {
        c.args(["-p", "rotkv", "--features", "sim", "--lib"]);
    }
    c.env("RUSTFLAGS", "-Zsanitizer=address")
        .env("RUSTDOCFLAGS", "-Zsanitizer=address")
        .env("CARGO_TARGET_DIR", root().join("target/asan"))
        .env("PROPTEST_CASES", ASAN_PROPTEST_CASES);
    status(c)
}
