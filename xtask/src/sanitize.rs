//! The reliability steps of `cargo xtask ci` (all of them, with the stable mutation
//! fuzzer first, as `cargo xtask sanitize`): the cargo-fuzz targets (also `cargo xtask
//! fuzz`), Miri over the unsafe-relevant unit tests, and AddressSanitizer over the unit
//! tests and the cache, device, conformance, property and reliability suites. Each prints
//! its wall time; a step whose toolchain component cannot be installed says SKIPPED and
//! the rest run.
//!
//! Budgets (measured on the 2-core CI machine, see docs/src/reliability.md):
//! - fuzz (`cargo xtask sanitize` only; the suite itself runs the same loop at a tenth of
//!   this): [`FUZZ_ITERS`] mutated calibration files and ten times as many GGUF files
//!   (read, tokenizer, model load, a forward pass), reusing the suite's test binary.
//! - cargo-fuzz (nightly, libFuzzer, AddressSanitizer): `cargo install --locked
//!   cargo-fuzz` when missing, the four targets of `fuzz/` built once with `cargo fuzz
//!   build`, then each binary run for [`CARGO_FUZZ_SECONDS`] from a scratch copy of its
//!   committed corpus (`fuzz/corpus/<target>/`, so git stays clean); a crash fails the
//!   step and names the input libFuzzer wrote under `fuzz/artifacts/<target>/`.
//! - Miri (nightly, Tree Borrows, leaks of rayon's pool threads ignored; in `ci` it runs
//!   on a thread of its own alongside PTX freshness, ptxas and the SASS gate, each of
//!   them mostly one core, its output printed after the gate: [`miri_captured`]): the kernel
//!   crate's layout and emulator unit tests, and the host's buffer, slot-mapping,
//!   split-count, unpack-order and small-cache tests (append and decode on the
//!   reference and the portable cpu path) ([`MIRI_KERNEL_TESTS`], [`MIRI_HOST_TESTS`]).
//!   Not under Miri: the AVX2 kernels (runtime detection finds no AVX2 under Miri, so
//!   the portable path runs), the integration suites (hours when interpreted), the
//!   CUDA backend (a foreign library).
//! - ASan (nightly, `-Zsanitizer=address`, std as shipped, its own target directory):
//!   the kernel and host crates' unit tests and the integration suites [`ASAN_SUITES`] (cache and
//!   paged API, device API, conformance, properties with [`ASAN_PROPTEST_CASES`] random
//!   cases, reliability) on reference, cpu and the emulated device kernels; the
//!   emulator's coroutine stack switches are announced to
//!   ASan (feature `rotkv-kernels/sim-asan`). Under Miri the emulator runs each GPU
//!   thread as an OS thread instead (Miri cannot switch stacks).

use crate::{Step, cargo, nightly, offline_or, root, tally};
use std::path::Path;
use std::time::Instant;

/// `ROTKV_FUZZ_ITERS` of `cargo xtask sanitize`: mutated calibration files (GGUF files:
/// ten times as many).
pub const FUZZ_ITERS: &str = "20000";
/// Kernel-crate unit tests (name filters) run under Miri.
pub const MIRI_KERNEL_TESTS: &[&str] = &[
    "layout::",
    "sim::tests::misaligned_load16_is_an_error",
    "sim::tests::indices_barriers_and_shuffles",
    "sim::tests::shfl_idx_u32_moves_raw_bits",
    "sim::tests::ldmatrix_gives_the_ptx_fragments_from_scattered_rows",
];
/// Host unit tests (name filters) run under Miri.
pub const MIRI_HOST_TESTS: &[&str] =
    &["cache::tests", "paged::tests", "launch::tests", "cpu::tests::unpack_order_is_a_permutation_within_groups"];
/// The integration suites run under ASan (with the host crate's unit tests): the cache
/// and paged APIs, the device API, the conformance suite and the reliability findings, on
/// reference, cpu and sim.
pub const ASAN_SUITES: &[&str] = &["api", "device", "conformance", "properties", "reliability"];
/// Random operation sequences of the property test under ASan.
pub const ASAN_PROPTEST_CASES: &str = "4";
/// Seconds each cargo-fuzz target runs in CI (`cargo xtask fuzz --seconds N` for longer).
pub const CARGO_FUZZ_SECONDS: u64 = 10;
/// The triple the cargo-fuzz targets are built for (libFuzzer with AddressSanitizer).
const FUZZ_TRIPLE: &str = "x86_64-unknown-linux-gnu";
/// The cargo-fuzz targets (`fuzz/fuzz_targets/<name>.rs`).
pub const CARGO_FUZZ_TARGETS: &[&str] = &["gguf", "calibration", "pool", "paged_ops"];

type StepFn = fn() -> Result<(), Step>;

/// Runs the steps, recording failures and skips as `ci` does; returns the seconds each
/// took. `stable_fuzz`: the long stable mutation run first (`cargo xtask sanitize`; CI
/// leaves it to the suite's shorter run and cargo-fuzz).
/// `ci` runs Miri on its own (`miri_captured`, alongside the PTX steps): `with_miri` false
/// leaves it out here.
pub fn steps(
    stable_fuzz: bool,
    with_miri: bool,
    failed: &mut Vec<&'static str>,
    skipped: &mut Vec<&'static str>,
) -> Vec<(&'static str, f64)> {
    let mut times = Vec::new();
    let all: [(&'static str, StepFn); 4] = [
        ("fuzz", fuzz),
        ("cargo-fuzz", || cargo_fuzz(CARGO_FUZZ_SECONDS)),
        ("miri", || miri(&mut status)),
        ("asan", asan),
    ];
    let all = all.into_iter().filter(|(name, _)| (stable_fuzz || *name != "fuzz") && (with_miri || *name != "miri"));
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
    let times = steps(true, true, &mut failed, &mut skipped);
    for (name, secs) in times {
        println!("{name:>6}: {secs:>5.0} s");
    }
    if !skipped.is_empty() {
        println!("SKIPPED steps: {}", skipped.join(", "));
    }
    if failed.is_empty() { Ok(()) } else { Err(format!("failed steps: {}", failed.join(", "))) }
}

pub(crate) fn status(mut c: std::process::Command) -> Result<(), Step> {
    println!("{c:?}");
    match c.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(Step::Failed(format!("{c:?} exited with {s}"))),
        Err(e) => Err(Step::Skipped(format!("cannot start {c:?}: {e}"))),
    }
}

/// The fuzz targets of `tests/fuzz.rs` with the CI budget (same features as the suite's
/// `cargo test --workspace --features <ci_features>`, so nothing is rebuilt).
fn fuzz() -> Result<(), Step> {
    let features = crate::ci_features().map_err(Step::Failed)?;
    let mut c = cargo();
    c.args(["test", "--workspace", "--features", &features, "--test", "fuzz", "--", "--nocapture"]);
    c.env("ROTKV_FUZZ_ITERS", FUZZ_ITERS);
    status(c)
}

/// `cargo xtask fuzz [--seconds N]` and CI's cargo-fuzz step: installs cargo-fuzz when
/// missing, builds the targets (AddressSanitizer), runs each for `seconds` from a scratch
/// copy of its committed corpus; Failed on a crash with the input's path, Skipped where
/// the nightly or cargo-fuzz cannot be had.
pub fn cargo_fuzz(seconds: u64) -> Result<(), Step> {
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        return Err(Step::Skipped(format!("the cargo-fuzz step is set up for {FUZZ_TRIPLE}")));
    }
    if !runs(&["rustc", "--version"]) {
        return Err(Step::Skipped("no nightly toolchain (cargo-fuzz needs one)".into()));
    }
    if !runs(&["cargo", "fuzz", "--version"]) {
        let mut c = cargo();
        c.args(["install", "--locked", "cargo-fuzz"]);
        status(c).map_err(|e| offline_or("index.crates.io", format!("cargo-fuzz cannot be installed: {e}")))?;
        if !runs(&["cargo", "fuzz", "--version"]) {
            return Err(Step::Skipped("cargo-fuzz was installed but `cargo +nightly fuzz` does not run".into()));
        }
    }
    // Every target of fuzz/Cargo.toml (the ones listed below), for the host triple, into
    // `$CARGO_TARGET_DIR` when it is set (made absolute, so that cargo-fuzz's cargo and
    // this lookup agree), else `fuzz/target`.
    let env = std::env::var_os("CARGO_TARGET_DIR");
    let out_dir = fuzz_target_dir(&root(), env.as_deref());
    let mut build = nightly(&["cargo", "fuzz", "build", "--target", FUZZ_TRIPLE]);
    if env.is_some_and(|v| !v.is_empty()) {
        build.env("CARGO_TARGET_DIR", &out_dir);
    }
    status(build)?;
    let fuzz_dir = root().join("fuzz");
    let mut outcomes = Vec::new();
    for target in CARGO_FUZZ_TARGETS {
        let scratch = out_dir.join("corpus").join(target);
        let artifacts = fuzz_dir.join("artifacts").join(target);
        for dir in [&scratch, &artifacts] {
            let _ = std::fs::remove_dir_all(dir);
            std::fs::create_dir_all(dir).map_err(|e| Step::Failed(format!("{}: {e}", dir.display())))?;
        }
        copy_files(&fuzz_dir.join("corpus").join(target), &scratch)?;
        // The binary `cargo fuzz build` just made, run directly (as `cargo fuzz run`
        // would, without a second cargo invocation per target).
        let binary = fuzz_binary(&out_dir, target);
        if !binary.is_file() {
            outcomes.push((*target, Fuzzed::Broken(format!("`cargo fuzz build` made no {}", binary.display()))));
            continue;
        }
        let mut c = std::process::Command::new(&binary);
        c.arg(&scratch).args([
            format!("-max_total_time={seconds}"),
            "-timeout=20".into(),
            "-print_final_stats=1".into(),
            format!("-artifact_prefix={}/", artifacts.display()),
        ]);
        let outcome = match status(c) {
            Ok(()) => Fuzzed::Passed,
            Err(e) => {
                let inputs: Vec<String> = std::fs::read_dir(&artifacts)
                    .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path().display().to_string()).collect())
                    .unwrap_or_default();
                println!("cargo-fuzz {target} failed ({e}); input(s): {}", inputs.join(", "));
                if inputs.is_empty() { Fuzzed::Broken(e.to_string()) } else { Fuzzed::Crashed(inputs) }
            }
        };
        outcomes.push((*target, outcome));
    }
    fuzz_verdict(&outcomes)
}

/// Where `cargo fuzz build` puts its target directory: `$CARGO_TARGET_DIR` (`env`,
/// relative to the workspace root) when set, else `fuzz/target`.
fn fuzz_target_dir(root: &Path, env: Option<&std::ffi::OsStr>) -> std::path::PathBuf {
    match env.filter(|v| !v.is_empty()) {
        Some(t) => root.join(t),
        None => root.join("fuzz").join("target"),
    }
}

/// The binary of fuzz target `target` in `cargo fuzz build`'s target directory.
fn fuzz_binary(target_dir: &Path, target: &str) -> std::path::PathBuf {
    target_dir.join(FUZZ_TRIPLE).join("release").join(target)
}

/// How one cargo-fuzz target's run ended.
#[derive(Debug)]
enum Fuzzed {
    Passed,
    /// libFuzzer wrote these inputs: a crash, a leak or a timeout.
    Crashed(Vec<String>),
    /// The target did not run or ended without an input (no binary, cannot start, killed).
    Broken(String),
}

/// The cargo-fuzz step's verdict: crashes only where inputs were written, other failures
/// by their cause, never an empty list reported as crashes.
fn fuzz_verdict(outcomes: &[(&str, Fuzzed)]) -> Result<(), Step> {
    let mut problems = Vec::new();
    let crashes: Vec<String> = outcomes
        .iter()
        .filter_map(|(t, o)| match o {
            Fuzzed::Crashed(inputs) if !inputs.is_empty() => Some(format!("{t}: {}", inputs.join(", "))),
            _ => None,
        })
        .collect();
    if !crashes.is_empty() {
        problems.push(format!("cargo-fuzz found crashes: {}", crashes.join("; ")));
    }
    let broken: Vec<String> = outcomes
        .iter()
        .filter_map(|(t, o)| match o {
            Fuzzed::Broken(why) => Some(format!("{t}: {why}")),
            Fuzzed::Crashed(inputs) if inputs.is_empty() => Some(format!("{t}: failed without an input")),
            _ => None,
        })
        .collect();
    if !broken.is_empty() {
        problems.push(format!("cargo-fuzz targets did not run to the end: {}", broken.join("; ")));
    }
    if problems.is_empty() { Ok(()) } else { Err(Step::Failed(problems.join(". "))) }
}

/// The nightly components of `ci`'s parallel lanes (rust-src for the PTX build and
/// Miri's sysroot, miri itself), installed one at a time before the lanes start: two
/// rustup installs at once conflict. Errors are left to the steps, which check again.
pub fn install_nightly_components() {
    let have = |c: &str| {
        nightly(&["rustup", "component", "list", "--installed"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.starts_with(c)))
    };
    for component in ["rust-src", "miri"] {
        if let Err(e) = nightly_component(component, || have(component)) {
            println!("{e}");
        }
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
        Err(offline_or("static.rust-lang.org", format!("the nightly {component} component cannot be installed here")))
    }
}

/// Whether a nightly command runs and succeeds.
fn runs(args: &[&str]) -> bool {
    nightly(args).output().map(|o| o.status.success()).unwrap_or(false)
}

/// Miri's commands, each run by `run` (`status`, or `captured` for `miri_captured`).
fn miri(run: &mut dyn FnMut(std::process::Command) -> Result<(), Step>) -> Result<(), Step> {
    nightly_component("miri", || runs(&["cargo", "miri", "--version"]))?;
    // rayon's global pool threads never exit (by design): their leak is not checked.
    let flags = "-Zmiri-tree-borrows -Zmiri-ignore-leaks";
    let mut setup = nightly(&["cargo", "miri", "setup"]);
    setup.env("MIRIFLAGS", flags);
    run(setup).map_err(|e| offline_or("index.crates.io", format!("cargo miri setup: {e}")))?;
    for (package, tests) in [("rotkv-kernels", MIRI_KERNEL_TESTS), ("rotkv", MIRI_HOST_TESTS)] {
        let mut c = nightly(&["cargo", "miri", "test", "-p", package, "--features", "sim", "--lib", "--"]);
        c.args(tests).env("MIRIFLAGS", flags);
        run(c)?;
    }
    Ok(())
}

/// The Miri step with its output (stdout and stderr of every command, merged in order)
/// returned instead of printed, and its wall seconds: `ci` runs it on a thread alongside
/// PTX freshness, ptxas and the SASS gate, and prints the output when both are done. The
/// Miri interpreter runs on one core, and so do the nvptx build of `core`, ptxas and
/// nvdisasm for the most part: on CI's two cores the two lanes overlap instead of queuing.
pub fn miri_captured() -> (Result<(), Step>, String, f64) {
    let started = Instant::now();
    let mut log = String::new();
    let result = miri(&mut |c| captured(c, &mut log));
    (result, log, started.elapsed().as_secs_f64())
}

/// As `status`, with the command line and its merged output appended to `log`.
fn captured(mut c: std::process::Command, log: &mut String) -> Result<(), Step> {
    use std::io::Read;
    let line = format!("{c:?}");
    log.push_str(&line);
    log.push('\n');
    let (mut reader, writer) = std::io::pipe().map_err(|e| Step::Skipped(format!("cannot make a pipe: {e}")))?;
    let writer2 = writer.try_clone().map_err(|e| Step::Skipped(format!("cannot make a pipe: {e}")))?;
    c.stdout(writer).stderr(writer2);
    let mut child = c.spawn().map_err(|e| Step::Skipped(format!("cannot start {c:?}: {e}")))?;
    // The pipe's write ends are held by the child alone from here, so that the read ends
    // at its exit.
    drop(c);
    let mut bytes = Vec::new();
    let _ = reader.read_to_end(&mut bytes);
    log.push_str(&String::from_utf8_lossy(&bytes));
    match child.wait() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(Step::Failed(format!("{line} exited with {s}"))),
        Err(e) => Err(Step::Failed(format!("cannot wait for {line}: {e}"))),
    }
}

fn asan() -> Result<(), Step> {
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        return Err(Step::Skipped("AddressSanitizer runs on x86_64 Linux".into()));
    }
    // Our code instrumented, std as shipped (no `-Zbuild-std`: it rebuilt std for about a
    // minute): ASan still sees every access our code makes, to heap memory std allocated
    // too (its allocator calls are intercepted); what it does not see are accesses made
    // inside std's own code.
    // `sim-asan`: the emulator's coroutine stack switches announced to ASan.
    let mut c =
        nightly(&["cargo", "test", "--target", FUZZ_TRIPLE, "-p", "rotkv", "-p", "rotkv-tests", "-p", "rotkv-kernels"]);
    c.args(["--features", "rotkv-kernels/sim-asan", "--lib"]);
    for suite in ASAN_SUITES {
        c.args(["--test", suite]);
    }
    c.env("RUSTFLAGS", "-Zsanitizer=address")
        // Some tests ask for allocations past any memory and expect a `Capacity` error:
        // ASan's allocator must return null for them as the system's does, not abort.
        // No stack-use-after-return detection: with it, ASan gave the emulator's
        // coroutines fake stacks that were never released (the conformance suite grew to
        // 23 GB and was killed; without it, 0.9 GB at most).
        .env("ASAN_OPTIONS", "allocator_may_return_null=1:detect_stack_use_after_return=0")
        .env("CARGO_TARGET_DIR", crate::target_dir().join("asan"))
        .env("PROPTEST_CASES", ASAN_PROPTEST_CASES);
    status(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn fuzz_binaries_are_looked_up_under_cargo_target_dir() {
        let root = Path::new("/work/repo");
        let at = |env: Option<&str>| fuzz_binary(&fuzz_target_dir(root, env.map(OsStr::new)), "gguf");
        let triple = FUZZ_TRIPLE;
        assert_eq!(at(None), Path::new(&format!("/work/repo/fuzz/target/{triple}/release/gguf")));
        assert_eq!(at(Some("")), at(None), "an empty CARGO_TARGET_DIR is unset");
        assert_eq!(at(Some("/tmp/ct")), Path::new(&format!("/tmp/ct/{triple}/release/gguf")));
        assert_eq!(at(Some("build/t")), Path::new(&format!("/work/repo/build/t/{triple}/release/gguf")));
        // The workspace's own target directory follows the same rule.
        assert_eq!(crate::target_dir_in(root, Some(OsStr::new("/tmp/ct"))), Path::new("/tmp/ct"));
        assert_eq!(crate::target_dir_in(root, None), Path::new("/work/repo/target"));
    }

    #[test]
    fn an_empty_crash_list_is_never_reported_as_crashes() {
        assert!(fuzz_verdict(&[("gguf", Fuzzed::Passed), ("pool", Fuzzed::Passed)]).is_ok());
        assert!(fuzz_verdict(&[]).is_ok());
        // Binaries that could not start (the CARGO_TARGET_DIR case): failed, by cause.
        let broken = [("gguf", Fuzzed::Broken("cannot start".into())), ("calibration", Fuzzed::Crashed(Vec::new()))];
        let Err(Step::Failed(why)) = fuzz_verdict(&broken) else { panic!("not a failure") };
        assert!(!why.contains("crashes"), "{why}");
        assert!(why.contains("gguf: cannot start") && why.contains("calibration: failed without an input"), "{why}");
        // A real crash names its input.
        let crashed = [("gguf", Fuzzed::Passed), ("pool", Fuzzed::Crashed(vec!["artifacts/pool/crash-1".into()]))];
        let Err(Step::Failed(why)) = fuzz_verdict(&crashed) else { panic!("not a failure") };
        assert_eq!(why, "cargo-fuzz found crashes: pool: artifacts/pool/crash-1");
    }
}
