//! `cargo xtask sass`: a static performance gate for a project with no GPU.
//!
//! Assembles the committed PTX for sm_80 and sm_90, disassembles the cubins with
//! `nvdisasm -bbcfg` (the SASS control-flow graph, one node per basic block with its
//! instructions), and prints per entry point the resources, the instruction mix and the
//! resident warps per SM; for the decode entry points the steady-state warp-instructions
//! per (token, KV head) read from the loops of the CFG; and for the `gpu_decode` cases of
//! the gate file ([`GATE_FILE`]) a modeled step time. Everything is a model (a static
//! SASS proxy), not a measurement: the GPU bundle measures the truth. The method and the
//! constants are written down in `docs/src/sass.md`.
//!
//! The gate file drives everything that depends on how a kernel is written (block size,
//! tokens per loop iteration, bytes in flight, the cases, the floors); the constants here
//! describe the hardware, each with its source.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::{Step, Usage, parse_ptxas, root, wheel_tool};

/// The gate file, beside the kernels.
pub const GATE_FILE: &str = "kernels-gpu/perf-gate.toml";

/// nvdisasm ships on PyPI only as CUDA 13 wheels (`nvidia/cu13/bin/nvdisasm`).
const NVDISASM_WHEEL: &str = "nvidia-cuda-nvdisasm==13.2.86";
/// The ptxas of the same CUDA release: nvdisasm 13 cannot run its flow analysis (so prints
/// no CFG) on a cubin from the CUDA 12 ptxas ("Disassembling Std Elf to Old format ...
/// not supported"), so this step assembles with the matching CUDA 13.2 ptxas.
const NVCC13_WHEEL: &str = "nvidia-cuda-nvcc==13.2.86";

// ---------------------------------------------------------------------------------------
// Hardware constants.

/// Per-architecture occupancy limits, from the CUDA C++ Programming Guide, "Compute
/// Capabilities", table "Technical Specifications per Compute Capability" (8.0 and 9.0).
#[derive(Debug, Clone, Copy)]
pub struct Arch {
    pub name: &'static str,
    /// Maximum resident warps per SM: 64 for 8.0 and 9.0.
    pub max_warps: u32,
    /// Maximum resident blocks per SM: 32 for 8.0 and 9.0.
    pub max_blocks: u32,
    /// 32-bit registers per SM: 64K for 8.0 and 9.0.
    pub registers: u32,
    /// Register allocation unit: 256 registers per warp (8 per thread).
    pub reg_unit_per_warp: u32,
    /// Shared memory per SM: 164 KiB (8.0), 228 KiB (9.0).
    pub shared: u32,
    /// Shared memory the driver reserves per block: 1 KiB (8.0 and later; Programming
    /// Guide, "Shared Memory" in the 8.x and 9.0 sections).
    pub shared_reserved_per_block: u32,
    /// Results per SM per clock of each pipe class ([`Pipes`]), from the CUDA C++
    /// Programming Guide's table "Throughput of Native Arithmetic Instructions" (compute
    /// capability 8.0 and 9.0 columns): 32-bit floating-point add, multiply, multiply-add
    /// 64 (8.0) and 128 (9.0); 16-bit (half2 counts two) 256; 32-bit integer add,
    /// shift, compare, min/max and bitwise 64; 32-bit integer multiply and multiply-add
    /// 64; reciprocal, exp2, log2 and "all other type conversions" 16.
    pub fp32_rate: f64,
    pub fp16x2_rate: f64,
    pub alu_rate: f64,
    pub imad_rate: f64,
    pub xu_rate: f64,
    /// Shared-memory bytes per SM per clock: 32 banks of 4 bytes (Programming Guide,
    /// "Shared Memory", 5.x and later).
    pub shared_bytes_per_clk: f64,
    /// `mma.sync.m16n8k16` (4096 FLOPs) per SM per clock at the dense FP16 tensor peak
    /// with FP32 accumulation: 0.5 on A100 (312 TFLOPS = 108 SMs x 1.41 GHz x 2048; A100
    /// datasheet), 1 on H100/H200 SXM ([`Gpu::hmma_per_clk`]).
    pub hmma_per_clk: f64,
}

pub const SM80: Arch = Arch {
    name: "sm_80",
    max_warps: 64,
    max_blocks: 32,
    registers: 65536,
    reg_unit_per_warp: 256,
    shared: 164 * 1024,
    shared_reserved_per_block: 1024,
    fp32_rate: 64.0,
    fp16x2_rate: 128.0,
    alu_rate: 64.0,
    imad_rate: 64.0,
    xu_rate: 16.0,
    shared_bytes_per_clk: 128.0,
    hmma_per_clk: 0.5,
};
pub const SM90: Arch = Arch {
    name: "sm_90",
    max_warps: 64,
    max_blocks: 32,
    registers: 65536,
    reg_unit_per_warp: 256,
    shared: 228 * 1024,
    shared_reserved_per_block: 1024,
    fp32_rate: 128.0,
    fp16x2_rate: 128.0,
    alu_rate: 64.0,
    imad_rate: 64.0,
    xu_rate: 16.0,
    shared_bytes_per_clk: 128.0,
    hmma_per_clk: 1.0,
};
const ARCHS: [Arch; 2] = [SM80, SM90];

/// A GPU of the model.
#[derive(Debug, Clone, Copy)]
pub struct Gpu {
    pub name: &'static str,
    pub arch: Arch,
    /// SMs: 132 on H100 SXM5 and H200 SXM (the same GH100 configuration; NVIDIA H100
    /// Tensor Core GPU Architecture whitepaper, H100 SXM5 column).
    pub sms: f64,
    /// SM clock: 1.98 GHz maximum boost (H100/H200 SXM; NVIDIA H100 datasheet, and the
    /// max SM clock `nvidia-smi -q -d CLOCK` reports on both).
    pub clock_hz: f64,
    /// Warp schedulers per SM, each issuing one warp-instruction per clock: 4 (Hopper
    /// whitepaper, "H100 SM architecture": four processing blocks, one warp scheduler and
    /// dispatch unit each; Hopper tuning guide).
    pub schedulers: f64,
    /// Peak DRAM bandwidth, bytes/s: H200 4.8 TB/s HBM3e (NVIDIA H200 datasheet), H100
    /// SXM5 3.35 TB/s HBM3 (NVIDIA H100 datasheet).
    pub peak_bw: f64,
    /// Achievable fraction of the peak: 0.90, an assumption (a streaming copy commonly
    /// reaches ~90% of the datasheet figure; the GPU bundle's copy column measures it).
    pub achievable: f64,
    /// DRAM latency under load, seconds: ~700 ns, an assumption (microbenchmarks, e.g.
    /// Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture",
    /// arXiv:2402.13499, measure the unloaded global-memory latency in the hundreds of
    /// cycles; queueing at full bandwidth raises it).
    pub dram_latency_s: f64,
    /// `mma.sync.m16n8k16` (f16 inputs, f32 accumulators: 4096 FLOPs) per SM per clock at
    /// the dense FP16 tensor peak: 1 on H100/H200 SXM (989.4 TFLOPS dense FP16/BF16 with
    /// FP32 accumulation, NVIDIA H100 and H200 datasheets, = 132 SMs x 1.83 GHz x 4096).
    /// An optimistic assumption for `mma.sync`: Hopper reaches that peak with `wgmma`, so
    /// the tensor bound below is a lower bound on time.
    pub hmma_per_clk: f64,
    /// Warp-instructions a scheduler issues per clock in the decode kernel's steady
    /// state, measured: 0.36 (Nsight Compute on an H200, `decode_mma` d128 k2v2 g128,
    /// batch 8 x 32K: issued instructions per scheduler per active cycle, with 0.45
    /// eligible warps; stalls on fixed-latency dependencies, the long scoreboard and
    /// shared memory; docs/src/gpu.md). The step-level issue bound divides by it; a kernel
    /// change that raises it (fewer dependent stalls) is not seen by this static model
    /// until it is measured again.
    pub issue_efficiency: f64,
    /// Fixed time of a decode step, seconds: 30 us, measured (H200, d128 k2v2 gqa4 batch 8,
    /// docs/results/gpu-h200.json): a straight line through the 32K (119.9 us) and 128K
    /// (387.0 us) steps meets zero context at 30.9 us, and the 1K step took 33.0 us. Two
    /// launches and their gap, each block's setup, the f16 window and sinks read
    /// unpipelined, the ring's prologue and masked edge tiles, and the split merge (6-8
    /// us in the profile): none of it scales with the context.
    pub step_fixed_s: f64,
    /// One round of the fixed charges ([`FixedCharges`]: a tile of f16 rows, a protected
    /// chunk, a ring restart), seconds: 1.43 us, measured (H200, docs/results/gpu-h200.json):
    /// the step without a recent window took 114.2 us against 119.9 us with it, 5.7 us for
    /// the 4 rounds the window adds to the slowest block (6 in the last split against the
    /// first split's 2), about twice the loaded DRAM latency assumed above.
    pub round_trip_s: f64,
}

pub const H200: Gpu = Gpu {
    name: "H200",
    arch: SM90,
    sms: 132.0,
    clock_hz: 1.98e9,
    schedulers: 4.0,
    peak_bw: 4.8e12,
    achievable: 0.90,
    dram_latency_s: 700e-9,
    hmma_per_clk: 1.0,
    issue_efficiency: 0.36,
    step_fixed_s: 30e-6,
    round_trip_s: 1.43e-6,
};
pub const H100: Gpu = Gpu { name: "H100", peak_bw: 3.35e12, ..H200 };

fn gpu_named(name: &str) -> Option<Gpu> {
    [H200, H100].into_iter().find(|g| g.name.eq_ignore_ascii_case(name))
}

// ---------------------------------------------------------------------------------------
// Occupancy.

/// Resident blocks and warps per SM, and what limits them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Occupancy {
    pub blocks: u32,
    pub warps: u32,
    pub limiter: &'static str,
}

/// The documented occupancy rules: registers per thread rounded up to the allocation unit
/// (256 per warp, i.e. 8 per thread), whole warps per block from the register file, the
/// warp and block limits, and shared memory (static + dynamic + the 1 KiB the driver
/// reserves per block).
pub fn occupancy(arch: &Arch, regs_per_thread: u32, warps_per_block: u32, shared_per_block: u32) -> Occupancy {
    let wpb = warps_per_block.max(1);
    let regs_per_warp = (regs_per_thread.max(1) * 32).div_ceil(arch.reg_unit_per_warp) * arch.reg_unit_per_warp;
    let by_regs = (arch.registers / regs_per_warp) / wpb;
    let by_warps = arch.max_warps / wpb;
    let by_shared = arch.shared / (shared_per_block + arch.shared_reserved_per_block);
    let mut best = (arch.max_blocks, "blocks");
    for cand in [(by_warps, "warps"), (by_regs, "registers"), (by_shared, "shared memory")] {
        if cand.0 < best.0 {
            best = cand;
        }
    }
    Occupancy { blocks: best.0, warps: best.0 * wpb, limiter: best.1 }
}

// ---------------------------------------------------------------------------------------
// The gate file: a small TOML subset.

/// A value of the gate file.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(String),
    Num(f64),
    Bool(bool),
    Array(Vec<Value>),
}

/// One `[[name]]` table (the keys before the first header form a table named "").
#[derive(Debug)]
pub struct Table {
    pub name: String,
    pub line: usize,
    pub keys: BTreeMap<String, Value>,
}

/// Parses the TOML subset the gate file uses: `# comments`, `[[array-of-tables]]`
/// headers, `key = value` with basic strings, numbers (`_` separators allowed), booleans
/// and one-line arrays of those. Anything else is an error that names the line, never a
/// silent misreading.
pub fn parse_toml(text: &str) -> Result<Vec<Table>, String> {
    let mut out = vec![Table { name: String::new(), line: 0, keys: BTreeMap::new() }];
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = strip_comment(raw).trim();
        if line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix("[[").and_then(|l| l.strip_suffix("]]")) {
            out.push(Table { name: name.trim().to_string(), line: n, keys: BTreeMap::new() });
            continue;
        }
        if line.starts_with('[') {
            return Err(format!("line {n}: only [[array]] table headers are supported: {line}"));
        }
        let (k, v) = line.split_once('=').ok_or_else(|| format!("line {n}: expected `key = value`: {line}"))?;
        let k = k.trim();
        if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(format!("line {n}: bad key {k:?}"));
        }
        let v = parse_value(v.trim()).map_err(|e| format!("line {n}: {e}"))?;
        let t = out.last_mut().expect("a table");
        if t.keys.insert(k.to_string(), v).is_some() {
            return Err(format!("line {n}: key {k} given twice"));
        }
    }
    Ok(out)
}

fn strip_comment(line: &str) -> &str {
    let (mut in_str, mut escaped) = (false, false);
    for (i, c) in line.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_str => escaped = true,
            '"' => in_str = !in_str,
            '#' if !in_str => return &line[..i],
            _ => {}
        }
    }
    line
}

fn parse_value(v: &str) -> Result<Value, String> {
    if let Some(inner) = v.strip_prefix('[') {
        let inner = inner.strip_suffix(']').ok_or_else(|| format!("unterminated array: {v}"))?;
        let mut items = Vec::new();
        let (mut start, mut in_str, mut escaped) = (0, false, false);
        for (i, c) in inner.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if in_str => escaped = true,
                '"' => in_str = !in_str,
                '[' if !in_str => return Err("nested arrays are not supported".into()),
                ',' if !in_str => {
                    items.push(parse_value(inner[start..i].trim())?);
                    start = i + 1;
                }
                _ => {}
            }
        }
        let last = inner[start..].trim();
        if !last.is_empty() {
            items.push(parse_value(last)?);
        }
        return Ok(Value::Array(items));
    }
    if let Some(rest) = v.strip_prefix('"') {
        let mut s = String::new();
        let mut chars = rest.chars();
        while let Some(c) = chars.next() {
            match c {
                '"' => {
                    let tail: String = chars.collect();
                    if !tail.trim().is_empty() {
                        return Err(format!("text after a string: {tail:?}"));
                    }
                    return Ok(Value::Str(s));
                }
                '\\' => match chars.next() {
                    Some('n') => s.push('\n'),
                    Some('t') => s.push('\t'),
                    Some(c @ ('"' | '\\')) => s.push(c),
                    other => return Err(format!("unsupported escape \\{other:?}")),
                },
                c => s.push(c),
            }
        }
        return Err(format!("unterminated string: {v}"));
    }
    match v {
        "true" => return Ok(Value::Bool(true)),
        "false" => return Ok(Value::Bool(false)),
        _ => {}
    }
    let digits: String = v.chars().filter(|&c| c != '_').collect();
    match digits.parse::<f64>() {
        Ok(x) if x.is_finite() && !digits.is_empty() => Ok(Value::Num(x)),
        _ => Err(format!("cannot read the value {v:?} (string, number, boolean or array)")),
    }
}

/// Reads typed keys out of a table and complains about the ones left over (typos).
struct Reader {
    what: String,
    keys: BTreeMap<String, Value>,
}

impl Reader {
    fn new(t: Table) -> Self {
        let what = format!("{GATE_FILE} line {} [[{}]]", t.line, t.name);
        Reader { what, keys: t.keys }
    }
    fn err(&self, key: &str, want: &str) -> String {
        format!("{}: `{key}` must be {want}", self.what)
    }
    fn opt_str(&mut self, key: &str) -> Result<Option<String>, String> {
        match self.keys.remove(key) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s)),
            Some(_) => Err(self.err(key, "a string")),
        }
    }
    fn str(&mut self, key: &str) -> Result<String, String> {
        self.opt_str(key)?.ok_or_else(|| format!("{}: `{key}` is missing", self.what))
    }
    fn opt_num(&mut self, key: &str) -> Result<Option<f64>, String> {
        match self.keys.remove(key) {
            None => Ok(None),
            Some(Value::Num(x)) => Ok(Some(x)),
            Some(_) => Err(self.err(key, "a number")),
        }
    }
    fn num(&mut self, key: &str) -> Result<f64, String> {
        self.opt_num(key)?.ok_or_else(|| format!("{}: `{key}` is missing", self.what))
    }
    fn opt_count(&mut self, key: &str) -> Result<Option<u64>, String> {
        match self.opt_num(key)? {
            None => Ok(None),
            Some(x) if x >= 0.0 && x.fract() == 0.0 && x < 1e15 => Ok(Some(x as u64)),
            Some(_) => Err(self.err(key, "a whole number >= 0")),
        }
    }
    fn count(&mut self, key: &str) -> Result<u64, String> {
        self.opt_count(key)?.ok_or_else(|| format!("{}: `{key}` is missing", self.what))
    }
    fn opt_bool(&mut self, key: &str) -> Result<Option<bool>, String> {
        match self.keys.remove(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(self.err(key, "true or false")),
        }
    }
    /// A positive number or an array of positive numbers.
    fn opt_nums(&mut self, key: &str) -> Result<Option<Vec<f64>>, String> {
        let v = match self.keys.remove(key) {
            None => return Ok(None),
            Some(Value::Num(x)) => vec![x],
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|v| if let Value::Num(x) = v { Ok(x) } else { Err(()) })
                .collect::<Result<_, _>>()
                .map_err(|()| self.err(key, "a positive number or an array of them"))?,
            Some(_) => return Err(self.err(key, "a positive number or an array of them")),
        };
        if v.is_empty() || v.iter().any(|&x| x <= 0.0) {
            return Err(self.err(key, "a positive number or an array of them"));
        }
        Ok(Some(v))
    }
    /// `loop_tokens = ["1.2=0", "1.3=16"]`: tokens per iteration (>= 0) by loop path.
    fn loop_tokens(&mut self) -> Result<Option<Vec<(String, f64)>>, String> {
        let want = "an array of \"<loop path>=<tokens per iteration>\" strings, e.g. [\"1.2=0\", \"1.3=16\"]";
        let items = match self.keys.remove("loop_tokens") {
            None => return Ok(None),
            Some(Value::Array(a)) => a,
            Some(_) => return Err(self.err("loop_tokens", want)),
        };
        let mut out = Vec::new();
        for v in items {
            let Value::Str(s) = v else { return Err(self.err("loop_tokens", want)) };
            let (path, t) = s.split_once('=').ok_or_else(|| self.err("loop_tokens", want))?;
            let path = path.trim();
            let ok_path = path.split('.').all(|p| p.parse::<u32>().is_ok_and(|n| n >= 1)) && path.starts_with("1");
            match t.trim().parse::<f64>() {
                Ok(t) if ok_path && t >= 0.0 && t.is_finite() => out.push((path.to_string(), t)),
                _ => return Err(self.err("loop_tokens", want)),
            }
        }
        Ok(Some(out))
    }
    fn finish(self) -> Result<(), String> {
        match self.keys.keys().next() {
            None => Ok(()),
            Some(k) => Err(format!("{}: unknown key `{k}`", self.what)),
        }
    }
}

/// How many times the hot loop nest runs per KV head and token: once per 16-row tile of
/// the KV head's query rows (GQA x q_len; each tile reads the pages), once per query
/// head, or once per query row (query head x query token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoopPer {
    KvHead,
    QueryHead,
    QueryRow,
}

/// A kernel family: the entry points whose name matches `pattern` (`*` wildcards; the
/// first matching family wins).
#[derive(Debug, Clone)]
pub struct Family {
    pub pattern: String,
    /// Decode entry points get the loop analysis, the model and the gate.
    pub decode: bool,
    pub warps_per_block: u32,
    /// Dynamic shared memory per block, bytes (static shared memory comes from ptxas).
    pub dynamic_shared_bytes: u32,
    /// Tokens one iteration of each hot-nest loop covers per warp (`tokens_per_iteration`
    /// by depth, `loop_tokens` by loop path).
    pub tokens: Tokens,
    pub loop_per: LoopPer,
    /// Bytes of KV cache one warp has in flight (issued before the first use) per hot-loop
    /// iteration.
    pub bytes_in_flight_per_warp: f64,
    /// Fail when the entry point has local memory (LDL/STL or a stack frame).
    pub no_local_memory: bool,
    /// With `no_local_memory`: the spill bytes (ptxas's spill stores plus loads) and
    /// stack frame it may have, each at most this; 0 (the default) allows none.
    pub max_spill_bytes: u64,
    /// With `max_spill_bytes`: the local loads and stores (LDL + STL) the hot loop may
    /// hold per iteration (default 0).
    pub max_hot_local: u64,
}

/// A `gpu_decode` case to model.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub entry: String,
    pub gpu: Gpu,
    pub head_dim: u64,
    pub batch: u64,
    pub kv_heads: u64,
    pub gqa: u64,
    pub q_len: u64,
    pub context: u64,
    pub bytes_per_token_head: f64,
    /// Thread blocks the launch has (when it fills less than the device, fewer warps are
    /// resident than occupancy allows); absent: a full wave at the occupancy limit.
    pub grid_blocks: Option<u64>,
    /// Overrides the family's dynamic shared memory.
    pub dynamic_shared_bytes: Option<u32>,
    /// Overrides of the family's `tokens_per_iteration` (replaced) and `loop_tokens`
    /// (these paths win, the family's others stay), e.g. for an inner loop that runs once
    /// per query head: 32 / heads tokens per iteration of a 32-token tile.
    pub tokens_per_iteration: Option<Vec<f64>>,
    pub loop_tokens: Option<Vec<(String, f64)>>,
    /// Overrides the family's bytes in flight per warp.
    pub bytes_in_flight_per_warp: Option<f64>,
    /// The least modeled % of achievable bandwidth (decode cases: of the step-level
    /// figure; prefill cases: % of the tensor-core peak).
    pub floor_pct: f64,
    /// The step's time measured on a GPU (us), printed beside the model; absent when
    /// not measured.
    pub measured_us: Option<f64>,
    /// Fail below the floor (false: report only).
    pub enforce: bool,
    /// The cache's recent window (tokens; default 128, the presets'), leading sinks
    /// (default 4), page size (default 64) and protected positions per sequence, all in
    /// the first split (default 0; the recipe protects 8 detected sinks): the f16 rows
    /// and protected chunks of [`FixedCharges`].
    pub window: u64,
    pub sinks: u64,
    pub page: u64,
    pub protected: u64,
}

/// The per-block latencies of a step that depend on the case (tensor-core kernel
/// `decode_mma` only), on the critical path of the slowest block, in rounds of
/// [`Gpu::round_trip_s`] (measured):
/// - f16 rows: the first split reads the sinks and the protected positions' rows, the
///   last split the window (on average `window + page / 2` rows: the window holds up to a
///   page more before it is quantized), in 16-row tiles spread over the block's warps,
///   two rounds per tile (keys, then values after the scores);
/// - protected positions: each sends its chunk through the masked loop (one round:
///   the chunk's tiles spread over the warps) and restarts the ring (one: its prologue).
///
/// The measured fixed time of a step ([`Gpu::step_fixed_s`]) includes these charges for
/// the measured case (window 128, 4 sinks, no protected position); a case's fixed time
/// is the measured one less that case's charges plus its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FixedCharges {
    pub first_split_s: f64,
    pub last_split_s: f64,
}

impl FixedCharges {
    pub fn of(window: u64, sinks: u64, page: u64, protected: u64, warps: u64, latency_s: f64) -> Self {
        let rounds = |rows: u64| rows.div_ceil(16).div_ceil(warps.max(1)) as f64;
        let last_rows = if window > 0 { window + page / 2 } else { 0 };
        FixedCharges {
            first_split_s: (2.0 * rounds(sinks + protected) + 2.0 * protected as f64) * latency_s,
            last_split_s: 2.0 * rounds(last_rows) * latency_s,
        }
    }
    /// The slower of the two splits' extra time (one critical path).
    pub fn s(&self) -> f64 {
        self.first_split_s.max(self.last_split_s)
    }
}

#[derive(Debug)]
pub struct Gate {
    pub families: Vec<Family>,
    pub cases: Vec<Case>,
    /// Compute-bound prefill cases (`[[prefill]]`): the fields of a case, the floor in %
    /// of the tensor-core peak.
    pub prefills: Vec<Case>,
}

impl Gate {
    pub fn family(&self, entry: &str) -> Option<&Family> {
        self.families.iter().find(|f| glob(&f.pattern, entry))
    }
}

/// The spill bytes the gate file allows each entry point (its family's `max_spill_bytes`;
/// 0 where it has none): the budget `cargo xtask ptxas` checks spills against.
pub fn spill_budgets() -> Result<impl Fn(&str) -> u64, Step> {
    let text =
        std::fs::read_to_string(root().join(GATE_FILE)).map_err(|e| Step::Failed(format!("{GATE_FILE}: {e}")))?;
    let gate = parse_gate(&text).map_err(Step::Failed)?;
    Ok(move |entry: &str| gate.family(entry).filter(|f| f.no_local_memory).map_or(0, |f| f.max_spill_bytes))
}

pub fn parse_gate(text: &str) -> Result<Gate, String> {
    let mut gate = Gate { families: Vec::new(), cases: Vec::new(), prefills: Vec::new() };
    for t in parse_toml(text)? {
        let name = t.name.clone();
        let mut r = Reader::new(t);
        match name.as_str() {
            "" => {}
            "family" => {
                let kind = r.opt_str("kind")?.unwrap_or_else(|| "other".into());
                let decode = match kind.as_str() {
                    "decode" => true,
                    "other" => false,
                    _ => return Err(r.err("kind", "\"decode\" or \"other\"")),
                };
                let loop_per = match r.opt_str("loop_per")?.as_deref() {
                    None | Some("kv_head") => LoopPer::KvHead,
                    Some("query_head") => LoopPer::QueryHead,
                    Some("query_row") => LoopPer::QueryRow,
                    Some(_) => return Err(r.err("loop_per", "\"kv_head\", \"query_head\" or \"query_row\"")),
                };
                let f = Family {
                    pattern: r.str("pattern")?,
                    decode,
                    warps_per_block: r.count("warps_per_block")?.clamp(1, 32) as u32,
                    dynamic_shared_bytes: r.opt_count("dynamic_shared_bytes")?.unwrap_or(0) as u32,
                    tokens: Tokens {
                        by_depth: r.opt_nums("tokens_per_iteration")?.unwrap_or_else(|| vec![1.0]),
                        by_path: r.loop_tokens()?.unwrap_or_default(),
                        hot: r.opt_count("hot_loop")?.map(|k| k as usize),
                    },
                    loop_per,
                    bytes_in_flight_per_warp: r.opt_num("bytes_in_flight_per_warp")?.unwrap_or(0.0),
                    no_local_memory: r.opt_bool("no_local_memory")?.unwrap_or(false),
                    max_spill_bytes: r.opt_count("max_spill_bytes")?.unwrap_or(0),
                    max_hot_local: r.opt_count("max_hot_local")?.unwrap_or(0),
                };
                r.finish()?;
                gate.families.push(f);
            }
            "case" | "prefill" => {
                let gpu_name = r.opt_str("gpu")?.unwrap_or_else(|| "H200".into());
                let gpu = gpu_named(&gpu_name).ok_or_else(|| r.err("gpu", "\"H200\" or \"H100\""))?;
                let c = Case {
                    name: r.str("name")?,
                    entry: r.str("entry")?,
                    gpu,
                    head_dim: r.count("head_dim")?,
                    batch: r.count("batch")?,
                    kv_heads: r.count("kv_heads")?,
                    gqa: r.count("gqa")?,
                    q_len: r.opt_count("q_len")?.unwrap_or(1),
                    context: r.count("context")?,
                    bytes_per_token_head: r.num("bytes_per_token_head")?,
                    grid_blocks: r.opt_count("grid_blocks")?,
                    dynamic_shared_bytes: r.opt_count("dynamic_shared_bytes")?.map(|x| x as u32),
                    tokens_per_iteration: r.opt_nums("tokens_per_iteration")?,
                    loop_tokens: r.loop_tokens()?,
                    bytes_in_flight_per_warp: r.opt_num("bytes_in_flight_per_warp")?,
                    floor_pct: r.num("floor_pct")?,
                    measured_us: r.opt_num("measured_us")?,
                    enforce: r.opt_bool("enforce")?.unwrap_or(true),
                    window: r.opt_count("window")?.unwrap_or(128),
                    sinks: r.opt_count("sinks")?.unwrap_or(4),
                    page: r.opt_count("page")?.unwrap_or(64),
                    protected: r.opt_count("protected")?.unwrap_or(0),
                };
                r.finish()?;
                if name == "case" { gate.cases.push(c) } else { gate.prefills.push(c) }
            }
            other => return Err(format!("{}: unknown table [[{other}]] (family, case or prefill)", r.what)),
        }
    }
    Ok(gate)
}

/// `*` matches any run of characters; everything else matches itself.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && p[pi] != '*' && p[pi] == n[ni] {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

// ---------------------------------------------------------------------------------------
// The SASS control-flow graph (`nvdisasm -bbcfg`, graphviz text).

/// A basic block: its instructions (without the trailing `;`) and successors.
#[derive(Debug, Clone)]
pub struct Block {
    pub name: String,
    /// Position in nvdisasm's listing (address order).
    pub pos: usize,
    pub instrs: Vec<String>,
    pub succs: Vec<usize>,
}

/// A function of the cubin; `blocks[0]` is its entry.
#[derive(Debug, Clone)]
pub struct Function {
    pub name: String,
    pub blocks: Vec<Block>,
}

/// Reads `nvdisasm -bbcfg` output: `subgraph "cluster_<function>" {` per function, a node
/// per basic block (`"<name>"` then `[label="{<entry>...\l...|<exit0>...}"]`, instructions
/// separated by `\l`), and edges `"<from>":port -> "<to>":entry:n`.
pub fn parse_cfg(dot: &str) -> Result<Vec<Function>, String> {
    let mut funcs: Vec<Function> = Vec::new();
    let mut index: BTreeMap<String, usize> = BTreeMap::new();
    let mut pending: Option<usize> = None;
    for (i, line) in dot.lines().enumerate() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("subgraph \"cluster_") {
            let name = rest.split('"').next().unwrap_or_default().to_string();
            funcs.push(Function { name, blocks: Vec::new() });
            index.clear();
            pending = None;
            continue;
        }
        let Some(f) = funcs.last_mut() else { continue };
        let mut block_of = |name: &str, f: &mut Function| -> usize {
            *index.entry(name.to_string()).or_insert_with(|| {
                f.blocks.push(Block { name: name.to_string(), pos: usize::MAX, instrs: Vec::new(), succs: Vec::new() });
                f.blocks.len() - 1
            })
        };
        if let Some((from, to)) = t.split_once(" -> ") {
            let (Some(a), Some(b)) = (quoted(from), quoted(to)) else {
                return Err(format!("nvdisasm CFG line {}: cannot read the edge {t:?}", i + 1));
            };
            let (a, b) = (block_of(a, f), block_of(b, f));
            if !f.blocks[a].succs.contains(&b) {
                f.blocks[a].succs.push(b);
            }
        } else if t.starts_with('"') {
            let name = quoted(t).ok_or_else(|| format!("nvdisasm CFG line {}: bad node {t:?}", i + 1))?;
            let b = block_of(name, f);
            f.blocks[b].pos = i;
            pending = Some(b);
            if let Some(label) = t.split_once("[label=\"").map(|x| x.1) {
                f.blocks[b].instrs = label_instructions(label);
                pending = None;
            }
        } else if let Some(label) = t.strip_prefix("[label=\"") {
            let b = pending.take().ok_or_else(|| format!("nvdisasm CFG line {}: a label without a node", i + 1))?;
            f.blocks[b].instrs = label_instructions(label);
        }
    }
    Ok(funcs)
}

fn quoted(s: &str) -> Option<&str> {
    let start = s.find('"')? + 1;
    let len = s[start..].find('"')?;
    Some(&s[start..start + len])
}

/// The instructions of a record label (text after `label="`): `\l` ends a line, `\x` is
/// a literal x, unescaped `{ } |` are record syntax and `<port>` a port name; a line
/// ending in `;` is an instruction, the rest (directives, labels) is dropped.
fn label_instructions(label: &str) -> Vec<String> {
    let mut lines = vec![String::new()];
    let mut chars = label.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('l' | 'n' | 'r') => lines.push(String::new()),
                Some(x) => lines.last_mut().expect("a line").push(x),
                None => break,
            },
            '"' => break,
            '{' | '}' | '|' => {}
            '<' => {
                for x in chars.by_ref() {
                    if x == '>' {
                        break;
                    }
                }
            }
            c => lines.last_mut().expect("a line").push(c),
        }
    }
    lines.iter().filter_map(|l| l.trim().strip_suffix(';').map(|s| s.trim().to_string())).collect()
}

/// The opcode of an instruction with its modifiers (`LDG.E.128`), past a predicate.
pub fn opcode(instr: &str) -> &str {
    instr.split_whitespace().find(|t| !t.starts_with('@')).unwrap_or("")
}

/// Instruction mix of some instructions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mix {
    /// All instructions but NOP.
    pub total: u64,
    pub ldl: u64,
    pub stl: u64,
    pub hmma: u64,
    pub ffma: u64,
    /// f16 <-> f32 conversions: F2F, F2FP (pack) and HADD2.F32 (ptxas's f16 -> f32
    /// conversion on sm_80 and later).
    pub cvt: u64,
    /// Per pipe class ([`Pipes`]).
    pub pipes: Pipes,
}

/// Instructions (shared memory: bytes) per pipe class, the classes of the Programming
/// Guide's throughput table ([`Arch`]); what a class's instructions cost is
/// `count x 32 / rate` SM clocks. Classes (by SASS opcode; an assumption where the guide
/// names an operation, not an opcode): `alu` integer add, shift, compare, min/max,
/// select, bitwise and byte permute (IADD3, VIADD, LEA, SHF, ISETP, IMNMX, SEL, LOP3,
/// PLOP3, PRMT, FSETP, FMNMX, FSEL, F2FP: the ALU pipe of Nsight Compute's pipe list,
/// which on sm_80 and later also packs f32 to f16); `fp32` FADD, FMUL, FFMA; `fp16x2`
/// HADD2, HMUL2, HFMA2; `imad` IMAD, IMUL (the FMA pipe's integer half); `xu` MUFU, I2F,
/// F2I, F2F, FRND, POPC, FLO, BREV; `shared_bytes` what LDS, STS, LDSM and LDGSTS move
/// through shared memory per warp (LDGSTS writes its bytes there). Moves, branches,
/// barriers and the rest are charged to dispatch only.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pipes {
    pub alu: f64,
    pub fp32: f64,
    pub fp16x2: f64,
    pub imad: f64,
    pub xu: f64,
    pub shared_bytes: f64,
    pub hmma: f64,
}

impl Pipes {
    fn add(&mut self, op: &str) {
        let base = op.split('.').next().unwrap_or("");
        let width = |default: f64| -> f64 {
            op.split('.')
                .find_map(|p| match p {
                    "128" => Some(16.0),
                    "64" => Some(8.0),
                    "32" => Some(4.0),
                    "U16" | "S16" => Some(2.0),
                    "U8" | "S8" => Some(1.0),
                    _ => None,
                })
                .unwrap_or(default)
        };
        match base {
            "IADD3" | "IADD" | "VIADD" | "LEA" | "SHF" | "SHL" | "SHR" | "ISETP" | "IMNMX" | "VIMNMX" | "SEL"
            | "LOP3" | "LOP" | "PLOP3" | "PRMT" | "FSETP" | "FMNMX" | "FSEL" | "F2FP" | "IABS" | "BMSK" | "SGXT" => {
                self.alu += 1.0
            }
            "FADD" | "FMUL" | "FFMA" => self.fp32 += 1.0,
            "HADD2" | "HMUL2" | "HFMA2" => self.fp16x2 += 1.0,
            "IMAD" | "IMUL" => self.imad += 1.0,
            "MUFU" | "I2F" | "F2I" | "F2F" | "FRND" | "POPC" | "FLO" | "BREV" => self.xu += 1.0,
            "LDS" | "STS" => self.shared_bytes += 32.0 * width(4.0),
            // ldmatrix: .x1, .x2, .x4 matrices of 8 x 16 bytes (`LDSM.16.M88.4`).
            "LDSM" => {
                self.shared_bytes += 128.0 * op.rsplit('.').next().and_then(|n| n.parse::<f64>().ok()).unwrap_or(1.0)
            }
            "LDGSTS" => self.shared_bytes += 32.0 * width(4.0),
            "HMMA" => self.hmma += 1.0,
            _ => {}
        }
    }
    fn scaled(&self, k: f64) -> Self {
        Pipes {
            alu: self.alu * k,
            fp32: self.fp32 * k,
            fp16x2: self.fp16x2 * k,
            imad: self.imad * k,
            xu: self.xu * k,
            shared_bytes: self.shared_bytes * k,
            hmma: self.hmma * k,
        }
    }
    fn plus(&self, o: &Pipes) -> Self {
        Pipes {
            alu: self.alu + o.alu,
            fp32: self.fp32 + o.fp32,
            fp16x2: self.fp16x2 + o.fp16x2,
            imad: self.imad + o.imad,
            xu: self.xu + o.xu,
            shared_bytes: self.shared_bytes + o.shared_bytes,
            hmma: self.hmma + o.hmma,
        }
    }
    /// SM clocks each pipe needs for these instructions (all of an SM's schedulers'
    /// warps together): ALU, FMA (FP32, FP16x2 and integer multiply share it), XU, shared
    /// memory, tensor.
    pub fn clocks(&self, arch: &Arch) -> [(f64, &'static str); 5] {
        [
            (self.alu * 32.0 / arch.alu_rate, "ALU"),
            (
                self.fp32 * 32.0 / arch.fp32_rate
                    + self.fp16x2 * 32.0 / arch.fp16x2_rate
                    + self.imad * 32.0 / arch.imad_rate,
                "FMA",
            ),
            (self.xu * 32.0 / arch.xu_rate, "XU"),
            (self.shared_bytes / arch.shared_bytes_per_clk, "shared"),
            (self.hmma / arch.hmma_per_clk, "tensor"),
        ]
    }
}

impl Mix {
    pub fn add(&mut self, instr: &str) {
        let op = opcode(instr);
        let base = op.split('.').next().unwrap_or("");
        if base == "NOP" || base.is_empty() {
            return;
        }
        self.total += 1;
        self.pipes.add(op);
        match base {
            "LDL" => self.ldl += 1,
            "STL" => self.stl += 1,
            "HMMA" => self.hmma += 1,
            "FFMA" => self.ffma += 1,
            "F2F" | "F2FP" => self.cvt += 1,
            "HADD2" if op.starts_with("HADD2.F32") => self.cvt += 1,
            _ => {}
        }
    }
}

pub fn block_mix(b: &Block) -> Mix {
    let mut m = Mix::default();
    for i in &b.instrs {
        m.add(i);
    }
    m
}

// ---------------------------------------------------------------------------------------
// Loops.

/// A natural loop: its header, its blocks (sorted, header included), its nesting depth
/// (1 = outermost) and the loop that contains it.
#[derive(Debug, Clone, PartialEq)]
pub struct Loop {
    pub header: usize,
    pub body: Vec<usize>,
    pub depth: usize,
    pub parent: Option<usize>,
}

/// Natural loops of a function: dominators over the blocks reachable from the entry, a
/// back edge `u -> h` wherever `h` dominates `u`, the loop of `h` the blocks that reach a
/// back-edge source without passing `h` (loops that share a header are one loop), nested
/// by containment. Returns the loops sorted by header and the number of retreating edges
/// that are not back edges (irreducible flow, 0 for compiler output in practice).
pub fn find_loops(f: &Function) -> (Vec<Loop>, usize) {
    let n = f.blocks.len();
    if n == 0 {
        return (Vec::new(), 0);
    }
    // Reverse postorder of the reachable blocks (iterative DFS).
    let mut order = Vec::with_capacity(n);
    let mut seen = vec![false; n];
    let mut stack = vec![(0usize, 0usize)];
    seen[0] = true;
    while let Some(&mut (b, ref mut k)) = stack.last_mut() {
        if let Some(&s) = f.blocks[b].succs.get(*k) {
            *k += 1;
            if !seen[s] {
                seen[s] = true;
                stack.push((s, 0));
            }
        } else {
            order.push(b);
            stack.pop();
        }
    }
    order.reverse();
    let mut rpo = vec![usize::MAX; n];
    for (i, &b) in order.iter().enumerate() {
        rpo[b] = i;
    }
    let mut preds = vec![Vec::new(); n];
    for &b in &order {
        for &s in &f.blocks[b].succs {
            preds[s].push(b);
        }
    }
    // Immediate dominators (Cooper, Harvey and Kennedy, "A Simple, Fast Dominance
    // Algorithm").
    let mut idom = vec![usize::MAX; n];
    idom[0] = 0;
    let intersect = |idom: &[usize], mut a: usize, mut b: usize| {
        while a != b {
            while rpo[a] > rpo[b] {
                a = idom[a];
            }
            while rpo[b] > rpo[a] {
                b = idom[b];
            }
        }
        a
    };
    let mut changed = true;
    while changed {
        changed = false;
        for &b in order.iter().skip(1) {
            let mut new = usize::MAX;
            for &p in &preds[b] {
                if idom[p] != usize::MAX {
                    new = if new == usize::MAX { p } else { intersect(&idom, p, new) };
                }
            }
            if new != idom[b] {
                idom[b] = new;
                changed = true;
            }
        }
    }
    let dominates = |h: usize, mut u: usize| loop {
        if u == h {
            return true;
        }
        if u == 0 {
            return false;
        }
        u = idom[u];
    };
    let mut bodies: BTreeMap<usize, Vec<bool>> = BTreeMap::new();
    let mut irreducible = 0;
    for &u in &order {
        for &h in &f.blocks[u].succs {
            if rpo[h] > rpo[u] {
                continue;
            }
            if !dominates(h, u) {
                irreducible += 1;
                continue;
            }
            let body = bodies.entry(h).or_insert_with(|| vec![false; n]);
            body[h] = true;
            let mut work = vec![u];
            while let Some(b) = work.pop() {
                if !body[b] {
                    body[b] = true;
                    work.extend(preds[b].iter().copied());
                }
            }
        }
    }
    let mut loops: Vec<Loop> = bodies
        .into_iter()
        .map(|(header, body)| Loop { header, body: (0..n).filter(|&b| body[b]).collect(), depth: 1, parent: None })
        .collect();
    // The parent is the smallest other loop holding the header.
    for i in 0..loops.len() {
        let h = loops[i].header;
        loops[i].parent = (0..loops.len())
            .filter(|&j| j != i && loops[j].body.binary_search(&h).is_ok())
            .min_by_key(|&j| loops[j].body.len());
    }
    for i in 0..loops.len() {
        let (mut d, mut p) = (1, loops[i].parent);
        while let Some(j) = p {
            d += 1;
            p = loops[j].parent;
        }
        loops[i].depth = d;
    }
    (loops, irreducible)
}

/// The innermost loop holding each block (`None` outside every loop).
pub fn innermost_loop(loops: &[Loop], blocks: usize) -> Vec<Option<usize>> {
    let mut inner: Vec<Option<usize>> = vec![None; blocks];
    for (i, l) in loops.iter().enumerate() {
        for &b in &l.body {
            if inner[b].is_none_or(|j| loops[j].depth < l.depth) {
                inner[b] = Some(i);
            }
        }
    }
    inner
}

/// How many tokens one iteration of each loop of the hot nest covers, per warp.
#[derive(Debug, Clone, PartialEq)]
pub struct Tokens {
    /// By depth inside the nest (outermost first; deeper loops use the last entry).
    pub by_depth: Vec<f64>,
    /// Overrides for single loops by path ("1" the nest, "1.2" its second inner loop by
    /// address, ...); 0 marks a loop that does not run in the steady state (not charged).
    pub by_path: Vec<(String, f64)>,
    /// Which outermost loop is the steady state (`hot_loop` in the gate file: the k-th by
    /// address, from 1); `None`: by signature, the one with the most `cp.async` copies,
    /// then the most HMMA, then the most instructions ([`hot_loop`]).
    pub hot: Option<usize>,
}

impl Tokens {
    pub fn of(&self, path: &str, depth: usize) -> f64 {
        if let Some((_, t)) = self.by_path.iter().find(|(p, _)| p == path) {
            return *t;
        }
        self.by_depth.get(depth).or(self.by_depth.last()).copied().unwrap_or(1.0)
    }
}

/// The hot loop nest of a decode kernel and its steady-state cost.
#[derive(Debug, Clone, PartialEq)]
pub struct HotLoop {
    /// Index (into the loops) of the nest's outermost loop.
    pub root: usize,
    /// Path of each loop of the nest, by loop index.
    pub paths: BTreeMap<usize, String>,
    /// Instructions of every block of the nest (all paths; upper bound of one iteration).
    pub instrs: u64,
    /// Warp-instructions per token: each block's instructions divided by the tokens per
    /// iteration of the innermost loop holding it.
    pub per_token: f64,
    /// Tensor-core instructions (HMMA) per token, counted the same way.
    pub hmma_per_token: f64,
    /// Per pipe class per token, counted the same way.
    pub pipes_per_token: Pipes,
}

/// Paths of the loops of the nest rooted at `root`: "1" for the root, "1.k" for its k-th
/// inner loop in address order, "1.k.j" below that.
pub fn loop_paths(f: &Function, loops: &[Loop], root: usize) -> BTreeMap<usize, String> {
    let mut paths = BTreeMap::new();
    let mut work = vec![(root, "1".to_string())];
    while let Some((i, path)) = work.pop() {
        let mut kids: Vec<usize> = (0..loops.len()).filter(|&j| loops[j].parent == Some(i)).collect();
        kids.sort_by_key(|&j| f.blocks[loops[j].header].pos);
        for (k, &j) in kids.iter().enumerate() {
            work.push((j, format!("{path}.{}", k + 1)));
        }
        paths.insert(i, path);
    }
    paths
}

/// The hot nest: the outermost loop with the most instructions in its blocks. Its cost
/// per token charges each block `instructions / tokens`, with the tokens per iteration of
/// the innermost loop holding the block ([`Tokens::of`]). With one loop and `[T]` this is
/// "loop instructions / T"; for a tile loop of T tokens around a per-token loop, `[T, 1]`
/// gives tile work / T + per-token work.
pub fn hot_loop(f: &Function, loops: &[Loop], tokens: &Tokens) -> Option<HotLoop> {
    let size = |l: &Loop| l.body.iter().map(|&b| block_mix(&f.blocks[b]).total).sum::<u64>();
    let hmma = |l: &Loop| l.body.iter().map(|&b| block_mix(&f.blocks[b]).hmma).sum::<u64>();
    let copies =
        |l: &Loop| l.body.iter().flat_map(|&b| &f.blocks[b].instrs).filter(|i| opcode(i).starts_with("LDGSTS")).count();
    let root = match tokens.hot {
        Some(k) => {
            let mut outer: Vec<usize> = (0..loops.len()).filter(|&i| loops[i].depth == 1).collect();
            outer.sort_by_key(|&i| f.blocks[loops[i].header].pos);
            *outer.get(k.checked_sub(1)?)?
        }
        // By signature: the outermost loop that issues the most `cp.async` copies (the
        // tensor-core kernel's ring loop: no other loop copies), else the one with the
        // most HMMA (the register-prefetch chunk loop holds more tiles than the masked
        // tile loop and the f16 window's loop), else the most instructions (the CUDA-core
        // kernel has no HMMA).
        None => (0..loops.len())
            .filter(|&i| loops[i].depth == 1)
            .max_by_key(|&i| (copies(&loops[i]), hmma(&loops[i]), size(&loops[i]), usize::MAX - i))?,
    };
    let inner = innermost_loop(loops, f.blocks.len());
    // By signature, a loop around the steady state is not it: while the chosen loop's
    // own blocks (those no inner loop holds) have no HMMA and an inner loop does, the
    // steady state is that inner loop (the tensor-core kernel runs its chunk loop once
    // per run of chunks between protected positions; the loop over those runs only
    // sets each one up).
    let mut root = root;
    if tokens.hot.is_none() {
        let own_hmma = |i: usize| {
            loops[i].body.iter().filter(|&&b| inner[b] == Some(i)).map(|&b| block_mix(&f.blocks[b]).hmma).sum::<u64>()
        };
        while own_hmma(root) == 0 {
            let Some(kid) = (0..loops.len())
                .filter(|&j| loops[j].parent == Some(root) && hmma(&loops[j]) > 0)
                .max_by_key(|&j| (copies(&loops[j]), hmma(&loops[j]), size(&loops[j]), usize::MAX - j))
            else {
                break;
            };
            root = kid;
        }
    }
    let paths = loop_paths(f, loops, root);
    let (mut per_token, mut hmma_per_token, mut pipes_per_token) = (0.0, 0.0, Pipes::default());
    for &b in &loops[root].body {
        let j = inner[b].unwrap_or(root);
        let t = tokens.of(&paths[&j], loops[j].depth - loops[root].depth);
        if t > 0.0 {
            let mix = block_mix(&f.blocks[b]);
            per_token += mix.total as f64 / t;
            hmma_per_token += mix.hmma as f64 / t;
            pipes_per_token = pipes_per_token.plus(&mix.pipes.scaled(1.0 / t));
        }
    }
    Some(HotLoop { root, paths, instrs: size(&loops[root]), per_token, hmma_per_token, pipes_per_token })
}

// ---------------------------------------------------------------------------------------
// The model.

/// A case's modeled step time (seconds) under each bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Model {
    /// The cache's bytes (each read once: what the % of achievable bandwidth measures).
    pub bytes: f64,
    pub warp_instrs: f64,
    /// The bytes moved (every row tile reads the pages) over the achievable bandwidth.
    pub bandwidth_s: f64,
    /// The cache's bytes once over the achievable bandwidth.
    pub useful_s: f64,
    pub issue_s: f64,
    pub latency_s: f64,
    /// Resident warps per SM the latency bound used.
    pub warps_per_sm: f64,
    /// The step-level charges: the fixed time ([`Gpu::step_fixed_s`]) and the issue
    /// bound at the measured issue rate ([`Gpu::issue_efficiency`]).
    pub fixed_s: f64,
    pub measured_issue_s: f64,
    /// The busiest pipe's time ([`Pipes::clocks`]: each pipe at its full rate, every SM
    /// busy) and its name.
    pub pipe_s: f64,
    pub pipe: &'static str,
    /// Each pipe's share of the dispatch time (the issue bound), by [`Pipes::clocks`]'s
    /// order.
    pub pipe_shares: [f64; 5],
    /// Bytes in flight per SM (Little's law's numerator) and the DRAM latency up to which
    /// they sustain the achievable bandwidth.
    pub in_flight_per_sm: f64,
    pub full_bw_latency_s: f64,
    /// The case's f16-row and protected-position charges ([`FixedCharges`]; `None` when
    /// the family is not the tensor-core kernel's: its fixed time is the measured one).
    pub charges: Option<FixedCharges>,
}

impl Model {
    /// The whole step: the fixed time plus the slowest of the bandwidth, the issue bound
    /// at the measured issue rate, the busiest pipe and the latency bound.
    pub fn step_level_s(&self) -> f64 {
        self.fixed_s + self.bandwidth_s.max(self.measured_issue_s).max(self.pipe_s).max(self.latency_s)
    }
    /// What bounds the step-level figure's variable part.
    pub fn step_bound(&self) -> &'static str {
        binding([
            (self.bandwidth_s, "fixed + bandwidth"),
            (self.measured_issue_s, "fixed + issue"),
            (self.pipe_s, "fixed + pipe"),
            (self.latency_s, "fixed + latency"),
        ])
    }
    /// Loop-level % of the achievable bandwidth with the DRAM latency at `latency_s`
    /// (Little's law: the bytes in flight per SM over that latency cap the bandwidth).
    pub fn pct_at_latency(&self, latency_s: f64, gpu: &Gpu) -> f64 {
        let rate = gpu.sms * self.in_flight_per_sm / latency_s;
        let latency = if rate > 0.0 { self.bandwidth_s * gpu.peak_bw * gpu.achievable / rate } else { f64::INFINITY };
        100.0 * self.useful_s / self.bandwidth_s.max(self.issue_s).max(self.pipe_s).max(latency)
    }
    /// Step-level modeled % of the achievable bandwidth (what the gate's floors apply to).
    pub fn step_pct(&self) -> f64 {
        100.0 * self.useful_s / self.step_level_s()
    }
    pub fn step_s(&self) -> f64 {
        self.bandwidth_s.max(self.issue_s).max(self.pipe_s).max(self.latency_s)
    }
    pub fn bound(&self) -> &'static str {
        binding([
            (self.bandwidth_s, "bandwidth"),
            (self.issue_s, "issue"),
            (self.pipe_s, "pipe"),
            (self.latency_s, "latency"),
        ])
    }
    /// Modeled % of the achievable bandwidth.
    pub fn pct(&self) -> f64 {
        100.0 * self.useful_s / self.step_s()
    }
}

/// The name of the largest of the bounds (the first of equal ones).
fn binding<const N: usize>(bounds: [(f64, &'static str); N]) -> &'static str {
    let t = bounds.iter().map(|b| b.0).fold(f64::NEG_INFINITY, f64::max);
    bounds.iter().find(|b| b.0 == t).map_or("", |b| b.1)
}

/// The model of one case: `bytes = batch x KV heads x context x bytes per token-head`;
/// bandwidth bound `bytes / (peak x achievable)`; issue bound `warp-instructions / (SMs x
/// schedulers x clock)` with `warp-instructions = per (token, KV head) x batch x KV heads
/// x context x runs` (runs: 1, GQA or GQA x q_len, per the family's `loop_per`); latency
/// bound `bytes / (SMs x bytes in flight per SM / DRAM latency)` with bytes in flight per
/// SM = per warp x resident warps per SM (the occupancy, or fewer when the grid is
/// smaller than a full wave). Those three are the loop-level figure (the steady state at
/// one instruction per scheduler and clock). The step-level figure adds what the H200
/// measured: the fixed time of a step and the steady state's issue rate
/// ([`Model::step_level_s`]).
pub fn model(case: &Case, fam: &Family, per_token: f64, pipes_per_token: &Pipes, occupancy_warps: u32) -> Model {
    let g = &case.gpu;
    let token_heads = (case.batch * case.kv_heads * case.context) as f64;
    let bytes = token_heads * case.bytes_per_token_head;
    let runs = match fam.loop_per {
        // One pass per 16-row tile of the group's query rows (the tensor-core kernel's
        // row tiles run as separate blocks, each streaming the context).
        LoopPer::KvHead => (case.gqa * case.q_len).div_ceil(16) as f64,
        LoopPer::QueryHead => case.gqa as f64,
        LoopPer::QueryRow => (case.gqa * case.q_len) as f64,
    };
    let warp_instrs = per_token * token_heads * runs;
    // Every row tile reads the pages: from DRAM, since a second tile's blocks run a wave
    // later, when the first tile's reads have left L2 (an assumption the H200 agrees with:
    // GQA 8 x q_len 4, two tiles, measured 1.9x the one-tile step).
    let moved = if fam.loop_per == LoopPer::KvHead { bytes * runs } else { bytes };
    let mut warps_per_sm = occupancy_warps as f64;
    if let Some(blocks) = case.grid_blocks {
        warps_per_sm = warps_per_sm.min(blocks as f64 * fam.warps_per_block as f64 / g.sms);
    }
    let in_flight_per_sm = fam.bytes_in_flight_per_warp * warps_per_sm;
    let latency_s =
        if in_flight_per_sm > 0.0 { moved / (g.sms * in_flight_per_sm / g.dram_latency_s) } else { f64::INFINITY };
    let issue_s = warp_instrs / (g.sms * g.schedulers * g.clock_hz);
    let clocks = pipes_per_token.scaled(token_heads * runs).clocks(&g.arch);
    let (pipe_clocks, pipe) = clocks.iter().fold((0.0, "none"), |a, &(c, n)| if c > a.0 { (c, n) } else { a });
    let pipe_s = pipe_clocks / (g.sms * g.clock_hz);
    // The measured case: `decode_mma` (4 warps per block), window 128, 4 sinks, 64-token
    // pages, no protected position.
    let measured_charges = FixedCharges::of(128, 4, 64, 0, 4, g.round_trip_s);
    let charges = case.entry.contains("_decode_mma_").then(|| {
        let warps = fam.warps_per_block as u64;
        FixedCharges::of(case.window, case.sinks, case.page, case.protected, warps, g.round_trip_s)
    });
    let pipe_shares = clocks.map(|(c, _)| if issue_s > 0.0 { c / (g.sms * g.clock_hz) / issue_s } else { 0.0 });
    Model {
        bytes,
        warp_instrs,
        bandwidth_s: moved / (g.peak_bw * g.achievable),
        useful_s: bytes / (g.peak_bw * g.achievable),
        issue_s,
        latency_s,
        warps_per_sm,
        fixed_s: g.step_fixed_s - measured_charges.s() + charges.map_or(measured_charges.s(), |c| c.s()),
        measured_issue_s: issue_s / g.issue_efficiency,
        pipe_s,
        pipe,
        pipe_shares,
        in_flight_per_sm,
        full_bw_latency_s: g.sms * in_flight_per_sm / (g.peak_bw * g.achievable),
        charges,
    }
}

/// The model of a prefill case: `q_len` query tokens of each of `batch` sequences
/// (a chunk of a prompt) over `context` cached tokens, on `decode_mma`, whose 16-row
/// tiles (`ceil(gqa x q_len / 16)` per KV head) each stream the whole context through
/// the hot loop. Charged: the hot loop's instructions (issue bound) and its HMMAs (tensor
/// bound at [`Gpu::hmma_per_clk`]) for every tile, and the cache's bytes read once from
/// DRAM. Not charged, and stated: the tiles' re-reads from L2 (`l2_bytes`), per-tile setup
/// and the causal edge (every row is charged the whole context).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillModel {
    /// Useful FLOPs: `4 x rows x context x head_dim` (q.k and p.v, 2 FLOPs a multiply-add).
    pub flops: f64,
    pub warp_instrs: f64,
    pub hmma: f64,
    pub dram_bytes: f64,
    pub l2_bytes: f64,
    pub issue_s: f64,
    pub tensor_s: f64,
    pub dram_s: f64,
    /// The dense tensor peak's time for `flops`.
    pub peak_s: f64,
}

impl PrefillModel {
    pub fn step_s(&self) -> f64 {
        self.issue_s.max(self.tensor_s).max(self.dram_s)
    }
    pub fn bound(&self) -> &'static str {
        binding([(self.issue_s, "issue"), (self.tensor_s, "tensor"), (self.dram_s, "bandwidth")])
    }
    /// Modeled % of the dense FP16 tensor peak.
    pub fn pct(&self) -> f64 {
        100.0 * self.peak_s / self.step_s()
    }
}

pub fn prefill_model(case: &Case, per_token: f64, hmma_per_token: f64) -> PrefillModel {
    let g = &case.gpu;
    let rows_per_kv_head = case.gqa * case.q_len;
    let tiles = rows_per_kv_head.div_ceil(16) as f64;
    let token_heads = (case.batch * case.kv_heads * case.context) as f64;
    let flops = 4.0 * (case.batch * case.kv_heads * rows_per_kv_head * case.context * case.head_dim) as f64;
    let hmma = hmma_per_token * token_heads * tiles;
    let warp_instrs = per_token * token_heads * tiles;
    let dram_bytes = token_heads * case.bytes_per_token_head;
    let hmma_rate = g.sms * g.hmma_per_clk * g.clock_hz;
    PrefillModel {
        flops,
        warp_instrs,
        hmma,
        dram_bytes,
        l2_bytes: dram_bytes * (tiles - 1.0),
        issue_s: warp_instrs / (g.sms * g.schedulers * g.clock_hz),
        tensor_s: hmma / hmma_rate,
        dram_s: dram_bytes / (g.peak_bw * g.achievable),
        peak_s: flops / (hmma_rate * 4096.0),
    }
}

// ---------------------------------------------------------------------------------------
// The command.

/// One entry point on one architecture.
struct EntryReport {
    usage: Usage,
    func: Function,
    mix: Mix,
    occ: Option<Occupancy>,
    loops: Vec<Loop>,
    /// Per loop: instructions of all its blocks, and of the blocks outside its inner loops.
    sizes: Vec<(u64, u64)>,
    hot: Option<HotLoop>,
    irreducible: usize,
}

impl EntryReport {
    fn new(usage: Usage, func: Function, fam: Option<&Family>, arch: &Arch) -> Self {
        let mut mix = Mix::default();
        for b in &func.blocks {
            for i in &b.instrs {
                mix.add(i);
            }
        }
        let occ =
            fam.map(|fam| occupancy(arch, usage.registers, fam.warps_per_block, usage.smem + fam.dynamic_shared_bytes));
        let (loops, irreducible) = find_loops(&func);
        let inner = innermost_loop(&loops, func.blocks.len());
        let size = |b: usize| block_mix(&func.blocks[b]).total;
        let sizes = loops
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let all = l.body.iter().map(|&b| size(b)).sum();
                let own = l.body.iter().filter(|&&b| inner[b] == Some(i)).map(|&b| size(b)).sum();
                (all, own)
            })
            .collect();
        let hot = fam.filter(|f| f.decode).and_then(|f| hot_loop(&func, &loops, &f.tokens));
        EntryReport { usage, func, mix, occ, loops, sizes, hot, irreducible }
    }
}

fn assemble(ptxas: &Path, nvdisasm: &Path, arch: &Arch) -> Result<(Vec<Usage>, Vec<Function>), Step> {
    let dir = crate::target_dir().join("sass");
    std::fs::create_dir_all(&dir).map_err(|e| Step::Failed(format!("{}: {e}", dir.display())))?;
    let cubin = dir.join(format!("rotkv_{}.cubin", arch.name));
    let out = Command::new(ptxas)
        .args(["-v", "-arch", arch.name, "-o"])
        .arg(&cubin)
        .arg(root().join(crate::PTX_FILE))
        .output()
        .map_err(|e| Step::Skipped(format!("cannot run ptxas: {e}")))?;
    let log = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(Step::Failed(format!("ptxas -arch {} rejected {}:\n{log}", arch.name, crate::PTX_FILE)));
    }
    let out = Command::new(nvdisasm)
        .arg("-bbcfg")
        .arg(&cubin)
        .output()
        .map_err(|e| Step::Skipped(format!("cannot run nvdisasm: {e}")))?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || err.contains("error") {
        return Err(Step::Failed(format!("nvdisasm -bbcfg {} failed: {}", cubin.display(), err.trim())));
    }
    let dot = String::from_utf8_lossy(&out.stdout);
    std::fs::write(dir.join(format!("rotkv_{}.dot", arch.name)), dot.as_bytes())
        .map_err(|e| Step::Failed(e.to_string()))?;
    let funcs = parse_cfg(&dot).map_err(Step::Failed)?;
    Ok((parse_ptxas(&log), funcs))
}

/// `cargo xtask sass [--dump <entry>]`: see the module docs. `--dump` also prints the
/// sm_90 SASS of that entry point's hot nest, loop by loop.
pub fn sass(dump: Option<&str>) -> Result<(), Step> {
    let text =
        std::fs::read_to_string(root().join(GATE_FILE)).map_err(|e| Step::Failed(format!("{GATE_FILE}: {e}")))?;
    let gate = parse_gate(&text).map_err(Step::Failed)?;
    let ptxas = wheel_tool(NVCC13_WHEEL, "nvcc-13.2.86", "nvidia/cu13/bin/ptxas")?;
    let nvdisasm = wheel_tool(NVDISASM_WHEEL, "nvdisasm-13.2.86", "nvidia/cu13/bin/nvdisasm")?;

    let mut reports: Vec<EntryReport> = Vec::new();
    // Both architectures assembled at once (two cores), read back in order.
    for (arch, assembled) in ARCHS.iter().zip(crate::in_parallel(&ARCHS, |arch| assemble(&ptxas, &nvdisasm, arch))) {
        let (usages, funcs) = assembled?;
        for usage in usages {
            let f = funcs.iter().find(|f| f.name == usage.kernel).ok_or_else(|| {
                Step::Failed(format!("nvdisasm printed no CFG for {} on {}", usage.kernel, arch.name))
            })?;
            let fam = gate.family(&usage.kernel);
            reports.push(EntryReport::new(usage, f.clone(), fam, arch));
        }
    }
    if reports.is_empty() {
        return Err(Step::Failed("ptxas reported no entry function".into()));
    }
    let decode = |r: &EntryReport| gate.family(&r.usage.kernel).filter(|f| f.decode);

    println!("All figures below are modeled (static SASS proxy), not measured: {} assembled by", crate::PTX_FILE);
    println!("ptxas 13.2 and read back with nvdisasm 13.2 -bbcfg. Method and constants: docs/src/sass.md.");
    println!();
    println!(
        "| entry | arch | regs | stack B | spill B | LDL | STL | HMMA | FFMA | F2F/HADD2.F32 | instrs | warps/block | resident warps/SM (limit) |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in &reports {
        let u = &r.usage;
        let (wpb, occ) = match (gate.family(&u.kernel), r.occ) {
            (Some(f), Some(o)) => (f.warps_per_block.to_string(), format!("{} ({})", o.warps, o.limiter)),
            _ => ("-".into(), "- (no family in the gate file)".into()),
        };
        let m = &r.mix;
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {wpb} | {occ} |",
            u.kernel, u.arch, u.registers, u.stack, u.spill, m.ldl, m.stl, m.hmma, m.ffma, m.cvt, m.total
        );
    }

    println!();
    println!("Hot loop nest of each decode entry point on sm_90 (natural loops of the SASS CFG; path 1 = the");
    println!("outermost loop with the most instructions, 1.k its k-th inner loop by address; `all` = instructions");
    println!("of every block of the loop, `own` = of the blocks outside its inner loops; tokens = tokens per");
    println!("iteration from the gate file, 0 = not charged; charged = own / tokens):");
    println!();
    println!("| entry | loop path | header | blocks | all | own | tokens | charged per token |");
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    for r in reports.iter().filter(|r| r.usage.arch == "sm_90") {
        let (Some(fam), Some(hot)) = (decode(r), &r.hot) else { continue };
        let mut nest: Vec<(&String, usize)> = hot.paths.iter().map(|(&i, p)| (p, i)).collect();
        nest.sort_by_key(|a| path_key(a.0));
        for (path, i) in nest {
            let l = &r.loops[i];
            let (all, own) = r.sizes[i];
            let t = fam.tokens.of(path, l.depth - r.loops[hot.root].depth);
            let charged = if t > 0.0 { own as f64 / t } else { 0.0 };
            println!(
                "| {} | {path} | {} | {} | {all} | {own} | {t} | {charged:.1} |",
                r.usage.kernel,
                r.func.blocks[l.header].name,
                l.body.len()
            );
        }
    }

    println!();
    println!("Steady state of the decode entry points (modeled, static SASS proxy):");
    println!();
    println!("| entry | arch | loops | hot nest loops | hot nest instrs | warp-instructions per (token, KV head) |");
    println!("|---|---|---:|---:|---:|---:|");
    for r in &reports {
        if decode(r).is_none() {
            continue;
        }
        let extra =
            if r.irreducible > 0 { format!(" ({} irreducible edges ignored)", r.irreducible) } else { String::new() };
        match &r.hot {
            Some(h) => println!(
                "| {} | {} | {}{extra} | {} | {} | {:.1} |",
                r.usage.kernel,
                r.usage.arch,
                r.loops.len(),
                h.paths.len(),
                h.instrs,
                h.per_token
            ),
            None => println!("| {} | {} | 0{extra} | - | - | no loop found |", r.usage.kernel, r.usage.arch),
        }
    }

    if let Some(entry) = dump {
        let r = reports
            .iter()
            .find(|r| r.usage.arch == "sm_90" && r.usage.kernel == entry)
            .ok_or_else(|| Step::Failed(format!("--dump: no entry point {entry}")))?;
        let hot = r.hot.as_ref().ok_or_else(|| Step::Failed(format!("--dump: {entry} has no hot loop nest")))?;
        let inner = innermost_loop(&r.loops, r.func.blocks.len());
        // The outermost loops by address (the candidates of `hot_loop`).
        let mut outer: Vec<usize> = (0..r.loops.len()).filter(|&i| r.loops[i].depth == 1).collect();
        outer.sort_by_key(|&i| r.func.blocks[r.loops[i].header].pos);
        println!();
        println!("Outermost loops of {entry} on sm_90 by address (hot_loop = k picks the k-th):");
        for (k, &i) in outer.iter().enumerate() {
            let l = &r.loops[i];
            let instrs: u64 = l.body.iter().map(|&b| block_mix(&r.func.blocks[b]).total).sum();
            let hmma: u64 = l.body.iter().map(|&b| block_mix(&r.func.blocks[b]).hmma).sum();
            println!(
                "  {}: header {}, {} blocks, {instrs} instructions, {hmma} HMMA",
                k + 1,
                r.func.blocks[l.header].name,
                l.body.len()
            );
        }
        let mut blocks = r.loops[hot.root].body.clone();
        blocks.sort_by_key(|&b| r.func.blocks[b].pos);
        println!();
        println!("SASS of the hot nest of {entry} on sm_90, by block (loop path of the innermost loop holding it):");
        for b in blocks {
            let path = inner[b].and_then(|j| hot.paths.get(&j)).map_or("?", String::as_str);
            let blk = &r.func.blocks[b];
            println!("\n  {} (loop {path}, {} instructions)", blk.name, block_mix(blk).total);
            for i in &blk.instrs {
                println!("      {i}");
            }
        }
    }

    let mut failures = Vec::new();
    println!();
    for r in &reports {
        let Some(fam) = decode(r) else { continue };
        if r.mix.ldl + r.mix.stl > 0 || r.usage.stack > 0 {
            let what = format!(
                "{} on {} uses local memory ({} LDL, {} STL, {} B stack frame)",
                r.usage.kernel, r.usage.arch, r.mix.ldl, r.mix.stl, r.usage.stack
            );
            let budget = fam.max_spill_bytes;
            // Local loads and stores in the hot loop's blocks (per iteration).
            let hot_local: u64 = r.hot.as_ref().map_or(0, |h| {
                r.loops[h.root].body.iter().map(|&b| block_mix(&r.func.blocks[b])).map(|m| m.ldl + m.stl).sum()
            });
            let within = budget > 0
                && u64::from(r.usage.spill) <= budget
                && u64::from(r.usage.stack) <= budget
                && hot_local <= fam.max_hot_local;
            if fam.no_local_memory && within {
                println!(
                    "within budget (max_spill_bytes = {budget}, max_hot_local = {} in {GATE_FILE}): {what}, {} spill bytes, {hot_local} in the hot loop",
                    fam.max_hot_local, r.usage.spill
                );
            } else if fam.no_local_memory {
                println!("FAILED: {what}");
                failures.push(what);
            } else {
                println!("not enforced (no_local_memory = false in {GATE_FILE}): {what}");
            }
        }
    }

    println!();
    println!("Modeled decode step per gpu_decode case: modeled (static SASS proxy), not measured. Loop level: the");
    println!("steady state at one instruction per scheduler and clock. Step level (gated): plus the measured");
    println!(
        "fixed time of a step ({:.0} us) and the measured issue rate ({:.2} per scheduler and clock); measured us:",
        H200.step_fixed_s * 1e6,
        H200.issue_efficiency
    );
    println!("the H200's time for the case (`measured_us` in the gate file), where there is one.");
    println!();
    println!(
        "| case | GPU | entry | bytes | bandwidth us | issue us | latency us | warps/SM | loop-level bound | loop-level % | step-level us | step-level bound | step-level % of achievable BW | measured us | floor | enforced |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---|");
    let mut notes = Vec::new();
    let mut pipe_rows = Vec::new();
    for c in &gate.cases {
        let row =
            reports.iter().find(|r| r.usage.kernel == c.entry && r.usage.arch == c.gpu.arch.name).ok_or_else(|| {
                Step::Failed(format!(
                    "{GATE_FILE}: case {:?}: {} is no entry point on {}",
                    c.name, c.entry, c.gpu.arch.name
                ))
            })?;
        let fam = decode(row).ok_or_else(|| {
            Step::Failed(format!("{GATE_FILE}: case {:?}: {} matches no decode family", c.name, c.entry))
        })?;
        if !c.entry.contains(&format!("_d{}", c.head_dim)) {
            return Err(Step::Failed(format!(
                "{GATE_FILE}: case {:?}: head_dim {} does not match {}",
                c.name, c.head_dim, c.entry
            )));
        }
        let tokens = Tokens {
            by_depth: c.tokens_per_iteration.clone().unwrap_or_else(|| fam.tokens.by_depth.clone()),
            // The case's loop paths first: they win over the family's.
            by_path: c.loop_tokens.iter().flatten().chain(&fam.tokens.by_path).cloned().collect(),
            hot: fam.tokens.hot,
        };
        let (per_token, pipes) = hot_loop(&row.func, &row.loops, &tokens)
            .map(|h| (h.per_token, h.pipes_per_token))
            .ok_or_else(|| Step::Failed(format!("{}: no loop in the SASS CFG", c.entry)))?;
        let occ = occupancy(
            &c.gpu.arch,
            row.usage.registers,
            fam.warps_per_block,
            row.usage.smem + c.dynamic_shared_bytes.unwrap_or(fam.dynamic_shared_bytes),
        );
        let mut fam = fam.clone();
        if let Some(b) = c.bytes_in_flight_per_warp {
            fam.bytes_in_flight_per_warp = b;
        }
        let m = model(c, &fam, per_token, &pipes, occ.warps);
        pipe_rows.push((c.name.clone(), c.entry.clone(), c.gpu, m));
        println!(
            "| {} | {} | {} | {:.1} MB | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.1}% | {:.1} | {} | {:.1}% | {} | {:.0}% | {} |",
            c.name,
            c.gpu.name,
            c.entry,
            m.bytes / 1e6,
            m.bandwidth_s * 1e6,
            m.issue_s * 1e6,
            m.latency_s * 1e6,
            m.warps_per_sm,
            m.bound(),
            m.pct(),
            m.step_level_s() * 1e6,
            m.step_bound(),
            m.step_pct(),
            c.measured_us.map_or("-".into(), |t| format!("{t:.1}")),
            c.floor_pct,
            if c.enforce { "yes" } else { "no" }
        );
        let what = "achievable bandwidth (step level)";
        check_floor(&format!("case {:?}", c.name), what, m.step_pct(), c, &mut notes, &mut failures);
    }
    if !pipe_rows.is_empty() {
        println!();
        println!(
            "Fixed charges, pipes and bytes in flight per gpu_decode case (modeled, static SASS proxy): the first and \
             last split's f16 rows and protected chunks at 1.43 us a round (measured), and the fixed time they leave (the \
             measured 30 us less the measured case's charges plus the case's); each pipe's time for the steady state \
             at its full rate, as a share of the dispatch time (the issue bound at one instruction per scheduler and \
             clock; rates and classes: docs/src/sass.md); Little's law: the bytes in flight per SM, the DRAM latency up \
             to which they hold the achievable bandwidth, and the loop-level % at 0.7, 1.0 and 1.4 us."
        );
        println!();
        println!(
            "| case | entry | arch | first split us | last split us | fixed us | ALU | FMA | XU | shared | tensor | busiest pipe | in flight per SM | full BW up to | % at 0.7 us | % at 1.0 us | % at 1.4 us |"
        );
        println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|");
        for (name, entry, gpu, m) in &pipe_rows {
            let s = m.pipe_shares.map(|x| format!("{:.0}%", 100.0 * x));
            println!(
                "| {name} | {entry} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {:.1} KiB | {:.2} us | {:.0}% | {:.0}% | {:.0}% |",
                gpu.arch.name,
                m.charges.map_or("-".into(), |c| format!("{:.1}", c.first_split_s * 1e6)),
                m.charges.map_or("-".into(), |c| format!("{:.1}", c.last_split_s * 1e6)),
                m.fixed_s * 1e6,
                s[0],
                s[1],
                s[2],
                s[3],
                s[4],
                m.pipe,
                m.in_flight_per_sm / 1024.0,
                m.full_bw_latency_s * 1e6,
                m.pct_at_latency(0.7e-6, gpu),
                m.pct_at_latency(1.0e-6, gpu),
                m.pct_at_latency(1.4e-6, gpu),
            );
        }
    }
    if !gate.prefills.is_empty() {
        println!();
        println!(
            "Modeled prefill chunk from the packed cache (compute-bound): modeled (static SASS proxy), not measured; \
             L2 re-reads, per-tile setup and the causal edge not charged."
        );
        println!();
        println!(
            "| case | GPU | entry | row tiles per KV head | TFLOP | HMMA per token-head per tile | issue us | tensor us | DRAM us | L2 re-reads | bound | modeled % of dense FP16 tensor peak | floor | enforced |"
        );
        println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|");
    }
    for c in &gate.prefills {
        let row = reports
            .iter()
            .find(|r| r.usage.kernel == c.entry && r.usage.arch == c.gpu.arch.name)
            .ok_or_else(|| Step::Failed(format!("{GATE_FILE}: prefill {:?}: {} is no entry point", c.name, c.entry)))?;
        let fam = decode(row).ok_or_else(|| {
            Step::Failed(format!("{GATE_FILE}: prefill {:?}: {} matches no decode family", c.name, c.entry))
        })?;
        let h = hot_loop(&row.func, &row.loops, &fam.tokens)
            .ok_or_else(|| Step::Failed(format!("{}: no loop in the SASS CFG", c.entry)))?;
        let m = prefill_model(c, h.per_token, h.hmma_per_token);
        println!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.0} | {:.0} | {:.0} | {:.1} GB | {} | {:.1}% | {:.0}% | {} |",
            c.name,
            c.gpu.name,
            c.entry,
            (c.gqa * c.q_len).div_ceil(16),
            m.flops / 1e12,
            h.hmma_per_token,
            m.issue_s * 1e6,
            m.tensor_s * 1e6,
            m.dram_s * 1e6,
            m.l2_bytes / 1e9,
            m.bound(),
            m.pct(),
            c.floor_pct,
            if c.enforce { "yes" } else { "no" }
        );
        check_floor(&format!("prefill {:?}", c.name), "the tensor-core peak", m.pct(), c, &mut notes, &mut failures);
    }
    append_table(&reports);
    if !notes.is_empty() {
        println!();
        for n in notes {
            println!("{n}");
        }
    }
    if !failures.is_empty() {
        return Err(Step::Failed(format!("static performance gate (modeled): {}", failures.join("; "))));
    }
    Ok(())
}

/// The append model: a long prompt's tokens going straight to the pages through
/// `append_batch_tokens` (one warp per token and KV head; the window's tokens are staged
/// in f16 and quantized later by `append_batch_flush`, not charged here). Per token-head:
/// the K and V rows in (f16) and the packed k2v2 token out (groups of min(D, 128)). The
/// instructions: the entry point's every path, its biggest loop (values, then keys: two
/// trips) counted twice and every other loop once: an estimate from above for one path's
/// work (a path takes only part of the code; the other loops run a few trips). Printed
/// beside it: the most instructions per token-head that would still reach 50% of the
/// achievable bandwidth, at one instruction per scheduler and clock and at the decode
/// kernel's measured 0.36.
fn append_table(reports: &[EntryReport]) {
    let g = H200;
    let token_heads = 32768.0 * 8.0;
    let rows: Vec<_> = [64u32, 128, 256]
        .iter()
        .filter_map(|&d| {
            let name = format!("rotkv_append_batch_tokens_d{d}");
            reports.iter().find(|r| r.usage.arch == "sm_90" && r.usage.kernel == name).map(|r| (d, r))
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    println!();
    println!(
        "Modeled append of a 32K-token prompt, 8 KV heads, k2v2, H200 (modeled, static SASS proxy): the K and V rows \
         in (f16) and the packed token out per token-head; warp-instructions per token-head estimated from above \
         (every path, the value/key loop twice); the budget for 50% of the achievable bandwidth."
    );
    println!();
    println!(
        "| entry | bytes in + out per token-head | instrs (all paths) | in the value/key loop | estimate per token-head | bandwidth us | issue us at the estimate | modeled % | budget for 50% (issue 1 / 0.36) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (d, r) in rows {
        // The value/key loop holds most of the code where it is a loop (head_dim 64 has it
        // unrolled: both halves are in the entry point's paths already).
        let kv_loop = r.sizes.iter().map(|s| s.0).max().filter(|&n| 2 * n > r.mix.total).unwrap_or(0);
        let estimate = (r.mix.total + kv_loop) as f64;
        let d = d as f64;
        let out = 2.0 * (d / 4.0 + 4.0 * (d / d.min(128.0)));
        let bytes = 2.0 * d * 2.0 + out;
        let bw = token_heads * bytes / (g.peak_bw * g.achievable);
        let rate = g.sms * g.schedulers * g.clock_hz;
        let issue = token_heads * estimate / rate;
        let budget = 2.0 * bw * rate / token_heads;
        println!(
            "| {} | {} + {} B | {} | {kv_loop} | {estimate} | {:.1} | {:.1} | {:.1}% | {:.0} / {:.0} |",
            r.usage.kernel,
            4.0 * d,
            out,
            r.mix.total,
            bw * 1e6,
            issue * 1e6,
            100.0 * bw / bw.max(issue),
            budget,
            budget * g.issue_efficiency
        );
    }
}

/// A case's modeled `pct` (% of `of`) against its floor: below it, a note, and a failure
/// when the case is enforced.
fn check_floor(name: &str, of: &str, pct: f64, c: &Case, notes: &mut Vec<String>, failures: &mut Vec<String>) {
    if pct < c.floor_pct {
        let what = format!("{name}: modeled {pct:.1}% of {of}, below the floor of {:.0}%", c.floor_pct);
        if c.enforce {
            notes.push(format!("FAILED: {what}"));
            failures.push(what);
        } else {
            notes.push(format!("not enforced (enforce = false in {GATE_FILE}): {what}"));
        }
    }
}

/// Sorts loop paths numerically ("1.10" after "1.9").
fn path_key(path: &str) -> Vec<u32> {
    path.split('.').filter_map(|p| p.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nvdisasm -bbcfg` of `testdata/nest.ptx` (a nested loop with an f16 load, an FFMA
    /// and a local array) assembled by ptxas 13.2 for sm_90: a real run, committed.
    const NEST_DOT: &str = include_str!("testdata/nest_sm90.dot");

    fn nest() -> Function {
        let funcs = parse_cfg(NEST_DOT).expect("the fixture parses");
        assert_eq!(funcs.len(), 1);
        funcs.into_iter().next().expect("one function")
    }

    fn block<'a>(f: &'a Function, name: &str) -> &'a Block {
        f.blocks.iter().find(|b| b.name == name).expect("the block exists")
    }

    fn index(f: &Function, name: &str) -> usize {
        f.blocks.iter().position(|b| b.name == name).expect("the block exists")
    }

    #[test]
    fn cfg_blocks_instructions_and_edges() {
        let f = nest();
        assert_eq!(f.name, "nest");
        let names: Vec<&str> = f.blocks.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["nest", ".L_x_3", ".L_x_0", "BB0", ".L_x_1", ".L_x_2", "BB1", "BB2"]);
        // Address order is the order of the node declarations, not of first mention.
        let mut by_pos = f.blocks.clone();
        by_pos.sort_by_key(|b| b.pos);
        let order: Vec<&str> = by_pos.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(order, ["nest", ".L_x_3", "BB0", ".L_x_1", ".L_x_0", "BB1", ".L_x_2", "BB2"]);
        // Directives and labels are dropped, escapes undone, the exit port's branch kept.
        assert_eq!(
            block(&f, "nest").instrs,
            ["LDC R1, c[0x0][0x28]", "IADD3 R1, R1, -0x40, RZ", "CS2R R2, SRZ", "ULDC.64 UR4, c[0x0][0x208]"]
        );
        let inner = block(&f, ".L_x_1");
        assert_eq!(inner.instrs.len(), 22);
        assert_eq!(inner.instrs.last().map(String::as_str), Some("@!P1 BRA `(.L_x_1)"));
        assert_eq!(block(&f, "BB2").instrs[2], "LDL R5, [R0]");
        assert_eq!(opcode("@!P0 LDG.E.U16 R6, desc[UR4][R6.64]"), "LDG.E.U16");
        // Edges: the inner loop's back edge and its exit.
        let (l1, l0) = (index(&f, ".L_x_1"), index(&f, ".L_x_0"));
        assert_eq!(f.blocks[l1].succs, [l1, l0]);
        assert!(f.blocks[index(&f, "BB2")].succs.is_empty());
    }

    #[test]
    fn instruction_mix() {
        let f = nest();
        let m = block_mix(block(&f, ".L_x_1"));
        assert_eq!((m.total, m.ldl, m.stl, m.hmma, m.ffma, m.cvt), (22, 0, 0, 0, 4, 4));
        let mut all = Mix::default();
        f.blocks.iter().flat_map(|b| &b.instrs).for_each(|i| all.add(i));
        assert_eq!((all.ldl, all.stl, all.ffma, all.cvt, all.total), (1, 1, 8, 8, 76));
        let mut m = Mix::default();
        for i in [
            "NOP",
            "F2F.F16.F32 R1, R2",
            "F2FP.F16.F32.PACK_AB R1, R2, R3",
            "HADD2 R1, R2, R3",
            "HMMA.16816.F32 R4, R8, R12, R4",
        ] {
            m.add(i);
        }
        assert_eq!((m.total, m.cvt, m.hmma), (4, 2, 1));
    }

    #[test]
    fn loops_of_the_fixture() {
        let f = nest();
        let (loops, irreducible) = find_loops(&f);
        assert_eq!(irreducible, 0);
        assert_eq!(loops.len(), 2);
        let outer = loops.iter().position(|l| f.blocks[l.header].name == ".L_x_3").expect("outer loop");
        let inner = loops.iter().position(|l| f.blocks[l.header].name == ".L_x_1").expect("inner loop");
        let mut body: Vec<&str> = loops[outer].body.iter().map(|&b| f.blocks[b].name.as_str()).collect();
        body.sort();
        assert_eq!(body, [".L_x_0", ".L_x_1", ".L_x_2", ".L_x_3", "BB0", "BB1"]);
        assert_eq!((loops[outer].depth, loops[outer].parent), (1, None));
        assert_eq!(loops[inner].body, [index(&f, ".L_x_1")]);
        assert_eq!((loops[inner].depth, loops[inner].parent), (2, Some(outer)));

        // Outer blocks: 13 + 3 + 4 + 12 + 12 = 44 instructions; the inner loop 22.
        let by_depth = |d: &[f64]| Tokens { by_depth: d.to_vec(), by_path: Vec::new(), hot: None };
        let hot = hot_loop(&f, &loops, &by_depth(&[1.0])).expect("a hot loop");
        assert_eq!((hot.root, hot.instrs), (outer, 66));
        assert_eq!(hot.paths[&outer], "1");
        assert_eq!(hot.paths[&inner], "1.1");
        assert_eq!(hot.per_token, 66.0);
        // The inner loop covers 4 tokens per iteration (it is unrolled 4 times).
        assert_eq!(hot_loop(&f, &loops, &by_depth(&[1.0, 4.0])).expect("hot").per_token, 44.0 + 22.0 / 4.0);
        assert_eq!(hot_loop(&f, &loops, &by_depth(&[2.0])).expect("hot").per_token, 33.0);
        // By path; 0 leaves a loop uncharged.
        let t = Tokens { by_depth: vec![1.0], by_path: vec![("1.1".into(), 0.0)], hot: None };
        assert_eq!(hot_loop(&f, &loops, &t).expect("hot").per_token, 44.0);
    }

    #[test]
    fn loop_free_and_self_loop_functions() {
        let mk = |succs: &[&[usize]]| Function {
            name: "f".into(),
            blocks: succs
                .iter()
                .enumerate()
                .map(|(i, s)| Block {
                    name: format!("b{i}"),
                    pos: i,
                    instrs: vec!["FFMA R1, R2, R3, R1".into()],
                    succs: s.to_vec(),
                })
                .collect(),
        };
        assert!(find_loops(&mk(&[&[1], &[2], &[]])).0.is_empty());
        // A diamond inside a loop, and an unreachable self loop (ignored).
        let f = mk(&[&[1], &[2, 3], &[4], &[4], &[1, 5], &[], &[6]]);
        let (loops, irr) = find_loops(&f);
        assert_eq!(irr, 0);
        assert_eq!(loops.len(), 1);
        assert_eq!(loops[0].header, 1);
        assert_eq!(loops[0].body, [1, 2, 3, 4]);
        // Irreducible: two entries into a cycle.
        let (loops, irr) = find_loops(&mk(&[&[1, 2], &[2], &[1, 3], &[]]));
        assert!(loops.is_empty());
        assert_eq!(irr, 1);
    }

    /// The steady state by signature: three self-loops, the biggest without HMMA (a setup
    /// loop), one with HMMA, one with fewer HMMA and fewer instructions but `cp.async`
    /// copies (a ring loop): the copies win, then HMMA, then size.
    #[test]
    fn hot_loop_by_signature() {
        let blk = |i: usize, instrs: &[&str]| Block {
            name: format!("b{i}"),
            pos: i,
            instrs: instrs.iter().map(|s| s.to_string()).collect(),
            succs: vec![i, i + 1],
        };
        let setup = ["FFMA R1, R2, R3, R1"; 9];
        let hmma = ["HMMA.16816.F32 R4, R8, R12, R4", "HMMA.16816.F32 R4, R8, R12, R4", "FFMA R1, R2, R3, R1"];
        let ring = ["LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", "HMMA.16816.F32 R4, R8, R12, R4"];
        let mut blocks = vec![blk(0, &setup), blk(1, &hmma), blk(2, &ring)];
        blocks.push(Block { name: "end".into(), pos: 3, instrs: vec!["EXIT".into()], succs: vec![] });
        let f = Function { name: "f".into(), blocks };
        let (loops, _) = find_loops(&f);
        let t = Tokens { by_depth: vec![1.0], by_path: Vec::new(), hot: None };
        let pick = |f: &Function, loops: &[Loop]| {
            f.blocks[loops[hot_loop(f, loops, &t).expect("a loop").root].header].name.clone()
        };
        assert_eq!(pick(&f, &loops), "b2");
        // Without the copies: the HMMA loop; without HMMA either: the biggest.
        let mut g = f.clone();
        g.blocks[2].instrs = vec!["FFMA R1, R2, R3, R1".into()];
        assert_eq!(pick(&g, &loops), "b1");
        g.blocks[1].instrs = vec!["FFMA R1, R2, R3, R1".into()];
        assert_eq!(pick(&g, &loops), "b0");
        // A loop around the ring loop (runs of chunks between protected positions) whose
        // own blocks copy (the ring's prologue) but hold no HMMA: the ring loop inside.
        let copy = ["LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]"; 4];
        let mut blocks = vec![blk(0, &setup)];
        blocks.push(Block {
            name: "seg".into(),
            pos: 1,
            instrs: copy.iter().map(|s| s.to_string()).collect(),
            succs: vec![2],
        });
        blocks.push(blk(2, &ring));
        blocks.push(Block { name: "latch".into(), pos: 3, instrs: vec!["ISETP R1, R2".into()], succs: vec![1, 4] });
        blocks.push(Block { name: "end".into(), pos: 4, instrs: vec!["EXIT".into()], succs: vec![] });
        let f = Function { name: "f".into(), blocks };
        let (loops, _) = find_loops(&f);
        assert!(loops.iter().any(|l| l.depth == 2), "{loops:?}");
        assert_eq!(pick(&f, &loops), "b2");
        // With HMMA of its own the outer loop is the steady state.
        let mut g = f.clone();
        g.blocks[1].instrs.push("HMMA.16816.F32 R4, R8, R12, R4".into());
        assert_eq!(pick(&g, &loops), "seg");
    }

    #[test]
    fn occupancy_rules() {
        // 128 registers x 128 threads: 4096 registers per warp, 16 warps, 4 blocks.
        assert_eq!(occupancy(&SM90, 128, 4, 0), Occupancy { blocks: 4, warps: 16, limiter: "registers" });
        // 72 registers (2304 per warp): 28 warps of one-warp blocks.
        assert_eq!(occupancy(&SM90, 72, 1, 4224), Occupancy { blocks: 28, warps: 28, limiter: "registers" });
        // 65 registers round up to 72 (the 256-per-warp unit); 93 to 96.
        assert_eq!(occupancy(&SM90, 65, 1, 0).warps, 28);
        assert_eq!(occupancy(&SM80, 93, 1, 0).warps, 21);
        // Shared memory: 100 KiB + 1 KiB reserved per block.
        assert_eq!(occupancy(&SM90, 32, 1, 100 << 10), Occupancy { blocks: 2, warps: 2, limiter: "shared memory" });
        assert_eq!(occupancy(&SM80, 32, 1, 100 << 10).blocks, 1);
        // The block limit, then the warp limit.
        assert_eq!(occupancy(&SM90, 16, 1, 0), Occupancy { blocks: 32, warps: 32, limiter: "blocks" });
        assert_eq!(occupancy(&SM90, 32, 4, 0), Occupancy { blocks: 16, warps: 64, limiter: "warps" });
    }

    fn case() -> (Case, Family) {
        let gate = parse_gate(
            r#"
[[family]]
pattern = "rotkv_decode_split_d128_*"
kind = "decode"
warps_per_block = 4
tokens_per_iteration = 64
bytes_in_flight_per_warp = 4608
[[case]]
name = "d128 k2v2"
entry = "rotkv_decode_split_d128_k2v2"
head_dim = 128
batch = 8
kv_heads = 8
gqa = 4
context = 32_768
bytes_per_token_head = 72
floor_pct = 80
"#,
        )
        .expect("parses");
        (gate.cases[0].clone(), gate.families[0].clone())
    }

    #[test]
    fn model_arithmetic() {
        let (c, fam) = case();
        // 16 warp-instructions per (token, KV head) is about the H200's bandwidth budget.
        let m = model(&c, &fam, 16.0, &Pipes::default(), 64);
        assert_eq!(m.bytes, 8.0 * 8.0 * 32768.0 * 72.0);
        assert!((m.bandwidth_s * 1e6 - 34.95).abs() < 0.01, "{}", m.bandwidth_s);
        assert!((m.issue_s * 1e6 - 32.10).abs() < 0.01, "{}", m.issue_s);
        // 64 warps x 4608 B = 288 KiB in flight per SM: 132 x 288 KiB / 700 ns = 55.6 TB/s.
        assert!((m.latency_s * 1e6 - 2.715).abs() < 0.001, "{}", m.latency_s);
        assert_eq!((m.bound(), m.pct()), ("bandwidth", 100.0));
        let m = model(&c, &fam, 32.0, &Pipes::default(), 64);
        assert_eq!(m.bound(), "issue");
        assert!((m.pct() - 54.4).abs() < 0.1, "{}", m.pct());
        // A grid of 132 four-warp blocks: 4 warps per SM, 18 KiB in flight.
        let small = Case { grid_blocks: Some(132), ..c.clone() };
        let m = model(&small, &fam, 16.0, &Pipes::default(), 64);
        assert_eq!(m.warps_per_sm, 4.0);
        assert_eq!(m.bound(), "latency");
        // H100: the same bytes over 3.35 TB/s.
        let h100 = Case { gpu: H100, ..c.clone() };
        assert!((model(&h100, &fam, 16.0, &Pipes::default(), 64).bandwidth_s * 1e6 - 50.08).abs() < 0.01);
        // The step level: 30 us fixed plus the issue bound at 0.36 per scheduler and clock
        // (32.10 / 0.36 = 89.16 us, above the 34.95 us of bandwidth): 119.16 us, 29.3%.
        let m = model(&c, &fam, 16.0, &Pipes::default(), 64);
        assert!((m.step_level_s() * 1e6 - 119.16).abs() < 0.01, "{}", m.step_level_s());
        assert_eq!(m.step_bound(), "fixed + issue");
        assert!((m.step_pct() - 100.0 * 34.95 / 119.16).abs() < 0.01, "{}", m.step_pct());
        // GQA 8 x q_len 4: two row tiles, each streaming the context (twice the
        // instructions and the bytes moved; the % counts the cache's bytes once).
        let two = model(&Case { gqa: 8, q_len: 4, ..c.clone() }, &fam, 16.0, &Pipes::default(), 64);
        assert_eq!(
            (two.warp_instrs, two.bandwidth_s, two.useful_s),
            (2.0 * m.warp_instrs, 2.0 * m.bandwidth_s, m.bandwidth_s)
        );
        assert!((two.pct() - 50.0).abs() < 1e-9, "{}", two.pct());
        // Few instructions: the step is the fixed time plus the bandwidth.
        let m = model(&c, &fam, 4.0, &Pipes::default(), 64);
        assert_eq!(m.step_bound(), "fixed + bandwidth");
        assert!((m.step_level_s() - (30e-6 + m.bandwidth_s)).abs() < 1e-12);
    }

    /// Pipe classes by opcode and their clocks at the guide's rates; the busiest pipe
    /// bounds the step when it is slower than dispatch; Little's law's latency range.
    #[test]
    fn pipes_and_bytes_in_flight() {
        let mut m = Mix::default();
        for i in [
            "LOP3.LUT R1, R2, 0x3, RZ, 0xc0, !PT",
            "IADD3 R1, R2, R3, RZ",
            "FMUL R1, R2, R3",
            "FFMA R1, R2, R3, R4",
            "IMAD.MOV.U32 R1, RZ, RZ, R2",
            "HADD2.F32 R1, -RZ, R2.H0_H0",
            "MUFU.EX2 R1, R2",
            "LDS.128 R4, [R2]",
            "LDSM.16.M88.4 R4, [R2]",
            "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
            "HMMA.16816.F32 R4, R8, R12, R4",
            "MOV R1, R2",
            "@P0 BRA `(.L_x_1)",
        ] {
            m.add(i);
        }
        let p = m.pipes;
        assert_eq!((p.alu, p.fp32, p.fp16x2, p.imad, p.xu, p.hmma), (2.0, 2.0, 1.0, 1.0, 1.0, 1.0));
        assert_eq!(p.shared_bytes, 512.0 * 3.0);
        // sm_90: ALU 2 x 32 / 64 = 1; FMA 2 x 32 / 128 + 32 / 128 + 32 / 64 = 1.25;
        // XU 32 / 16 = 2; shared 1536 / 128 = 12; tensor 1.
        let c: Vec<f64> = p.clocks(&SM90).iter().map(|x| x.0).collect();
        assert_eq!(c, [1.0, 1.25, 2.0, 12.0, 1.0]);
        // sm_80: FP32 at half the rate, the tensor pipe at half.
        let c: Vec<f64> = p.clocks(&SM80).iter().map(|x| x.0).collect();
        assert_eq!(c, [1.0, 1.75, 2.0, 12.0, 2.0]);

        let (c, fam) = case();
        // 16 instructions per token-head, all ALU: the ALU needs twice the dispatch time.
        let alu = Pipes { alu: 16.0, ..Pipes::default() };
        let m = model(&c, &fam, 16.0, &alu, 64);
        assert_eq!((m.pipe, m.bound()), ("ALU", "pipe"));
        assert!((m.pipe_s / m.issue_s - 2.0).abs() < 1e-12);
        assert!((m.pipe_shares[0] - 2.0).abs() < 1e-12);
        // At the step level the measured issue rate (0.36: 2.8x the dispatch time) is
        // slower still; a pipe at a quarter of the dispatch rate or less binds there (XU:
        // 16 per token-head is 8x).
        assert_eq!(m.step_bound(), "fixed + issue");
        let xu = Pipes { xu: 16.0, ..Pipes::default() };
        let m = model(&c, &fam, 16.0, &xu, 64);
        assert_eq!((m.pipe, m.step_bound()), ("XU", "fixed + pipe"));
        assert!((m.step_level_s() - (30e-6 + 8.0 * m.issue_s)).abs() < 1e-12);
        // Half of them ALU: under dispatch at the loop level, and under the measured issue
        // rate at the step level.
        let half = Pipes { alu: 8.0, ..Pipes::default() };
        let m = model(&c, &fam, 16.0, &half, 64);
        assert_eq!(m.bound(), "bandwidth");
        assert_eq!(m.step_bound(), "fixed + issue");
        // 288 KiB in flight per SM hold the bandwidth up to 132 x 288 KiB / 4.32 TB/s.
        let l = 132.0 * 64.0 * 4608.0 / (4.8e12 * 0.9);
        assert!((m.full_bw_latency_s - l).abs() < 1e-15, "{}", m.full_bw_latency_s);
        assert_eq!(m.pct_at_latency(l, &H200), 100.0);
        assert!((m.pct_at_latency(2.0 * l, &H200) - 50.0).abs() < 1e-9);
    }

    /// The f16 rows' and protected positions' round trips, and the fixed time they leave.
    #[test]
    fn fixed_charges() {
        let l = H200.round_trip_s;
        // The measured case: 160 window rows on average (10 tiles, 3 rounds of 4 warps) at
        // two round trips each; 4 sinks, one tile.
        let m = FixedCharges::of(128, 4, 64, 0, 4, l);
        assert!((m.last_split_s - 6.0 * l).abs() < 1e-15 && (m.first_split_s - 2.0 * l).abs() < 1e-15);
        // 8 protected positions: 12 f16 rows (one tile) and two round trips each.
        let p = FixedCharges::of(128, 4, 64, 8, 4, l);
        assert!((p.first_split_s - 18.0 * l).abs() < 1e-15, "{p:?}");
        assert_eq!(p.s(), p.first_split_s);
        let (c, fam) = case();
        let c = Case { entry: "rotkv_decode_mma_d128_k2v2_g128".into(), ..c };
        let base = model(&c, &fam, 16.0, &Pipes::default(), 64);
        assert!((base.fixed_s - 30e-6).abs() < 1e-15);
        let none = model(&Case { window: 0, ..c.clone() }, &fam, 16.0, &Pipes::default(), 64);
        assert!((none.fixed_s - (30e-6 - 4.0 * l)).abs() < 1e-15, "{}", none.fixed_s);
        let prot = model(&Case { protected: 8, ..c.clone() }, &fam, 16.0, &Pipes::default(), 64);
        assert!((prot.fixed_s - (30e-6 + 12.0 * l)).abs() < 1e-15, "{}", prot.fixed_s);
        // Another kernel keeps the measured fixed time.
        let other = model(
            &Case { protected: 8, entry: "rotkv_decode_split_d128_k2v2".into(), ..c },
            &fam,
            16.0,
            &Pipes::default(),
            64,
        );
        assert!((other.fixed_s - 30e-6).abs() < 1e-15 && other.charges.is_none(), "{}", other.fixed_s);
    }

    #[test]
    fn prefill_model_arithmetic() {
        let (c, _) = case();
        // One sequence, 8 KV heads x GQA 4 x 4096 rows over 32K: 1024 tiles per KV head.
        let p = Case { batch: 1, q_len: 4096, gqa: 4, ..c };
        let m = prefill_model(&p, 17.0, 2.0);
        assert_eq!(m.flops, 4.0 * 8.0 * 4.0 * 4096.0 * 32768.0 * 128.0);
        let token_tiles = 8.0 * 32768.0 * 1024.0;
        assert_eq!((m.warp_instrs, m.hmma), (17.0 * token_tiles, 2.0 * token_tiles));
        // 2 HMMA per token-head and tile are exactly the useful work (16 rows x 128
        // channels, q.k and p.v): the tensor bound is the peak's time.
        assert!((m.tensor_s / m.peak_s - 1.0).abs() < 1e-12);
        // 17 instructions over 4 schedulers against 2 HMMA at one per clock: issue-bound
        // at 8 / 17 of the peak.
        assert_eq!(m.bound(), "issue");
        assert!((m.pct() - 100.0 * 8.0 / 17.0).abs() < 1e-9, "{}", m.pct());
        assert_eq!(m.l2_bytes, 1023.0 * 8.0 * 32768.0 * 72.0);
        let g = parse_gate("[[prefill]]\nname = \"p\"\nentry = \"e\"\nhead_dim = 64\nbatch = 1\nkv_heads = 1\ngqa = 1\nq_len = 64\ncontext = 64\nbytes_per_token_head = 40\nfloor_pct = 10")
            .expect("parses");
        assert_eq!((g.prefills.len(), g.cases.len(), g.prefills[0].q_len), (1, 0, 64));
    }

    #[test]
    fn gate_file_subset_of_toml() {
        let (c, fam) = case();
        assert_eq!((c.gpu.name, c.q_len, c.enforce, c.context), ("H200", 1, true, 32768));
        assert_eq!(
            (fam.loop_per, fam.no_local_memory, fam.tokens.by_depth.as_slice()),
            (LoopPer::KvHead, false, &[64.0][..])
        );
        let t = parse_toml("a = \"x # y\" # c\nb = [1, 2.5, \"z\",]\n[[t]]\nc = true\n").expect("parses");
        assert_eq!(t[0].keys["a"], Value::Str("x # y".into()));
        assert_eq!(t[0].keys["b"], Value::Array(vec![Value::Num(1.0), Value::Num(2.5), Value::Str("z".into())]));
        assert_eq!((t[1].name.as_str(), &t[1].keys["c"]), ("t", &Value::Bool(true)));
        for bad in ["[t]", "a = 1\na = 2", "a = [[1]]", "a = \"x", "a = 1 2", "a =", "= 1"] {
            assert!(parse_toml(bad).is_err(), "{bad}");
        }
        // Typos and wrong types are errors, not defaults.
        for bad in [
            "[[family]]\npattern = \"x\"\nwarps_per_block = 1\nwarp_per_block = 2",
            "[[family]]\npattern = \"x\"\nwarps_per_block = 1.5",
            "[[family]]\npattern = \"x\"\nwarps_per_block = 1\nkind = \"decod\"",
            "[[family]]\npattern = \"x\"\nwarps_per_block = 1\nloop_tokens = [\"2.1=4\"]",
            "[[family]]\npattern = \"x\"\nwarps_per_block = 1\ntokens_per_iteration = [0]",
            "[[famly]]",
        ] {
            assert!(parse_gate(bad).is_err(), "{bad}");
        }
        let g =
            parse_gate("[[family]]\npattern = \"x\"\nwarps_per_block = 1\nloop_tokens = [\"1.3.1=0.25\", \"1=32\"]")
                .expect("parses");
        assert_eq!(g.families[0].tokens.by_path, [("1.3.1".to_string(), 0.25), ("1".to_string(), 32.0)]);
        assert_eq!(g.families[0].tokens.of("1.3.1", 2), 0.25);
        assert_eq!(g.families[0].tokens.of("1.2", 1), 1.0);
    }

    #[test]
    fn committed_gate_file_parses_and_covers_every_decode_entry() {
        let gate =
            parse_gate(include_str!("../../kernels-gpu/perf-gate.toml")).expect("the committed gate file parses");
        let ptx = include_str!("../../host/ptx/rotkv.ptx");
        let entries: Vec<&str> =
            ptx.lines().filter_map(|l| l.split(".entry ").nth(1)).map(|l| l.trim_end_matches('(').trim()).collect();
        assert!(!entries.is_empty());
        for e in &entries {
            assert!(gate.family(e).is_some(), "{e} matches no family of the gate file");
        }
        assert!(!gate.prefills.is_empty(), "the gate has a compute-bound prefill case");
        for c in gate.cases.iter().chain(&gate.prefills) {
            assert!(entries.contains(&c.entry.as_str()), "case {} names {}, not an entry point", c.name, c.entry);
            assert!(gate.family(&c.entry).is_some_and(|f| f.decode), "case {}: {} is no decode entry", c.name, c.entry);
        }
    }

    #[test]
    fn globs() {
        assert!(glob("rotkv_decode_split_*", "rotkv_decode_split_d64_k2v2"));
        assert!(glob("*_k2*", "rotkv_decode_split_d64_k2v4"));
        assert!(glob("*", ""));
        assert!(!glob("rotkv_decode_split_d64_*", "rotkv_decode_split_d128_k2v2"));
        assert!(!glob("a*b", "acbd"));
        assert!(glob("a*b*", "acbd"));
    }

    #[test]
    fn ptxas_stack_frame() {
        let log = "ptxas info    : Compiling entry function 'k' for 'sm_90'\n\
ptxas info    : Function properties for k\n\
    256 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 72 registers, used 1 barriers, 256 bytes cumulative stack size, 16 bytes smem\n";
        let u = &parse_ptxas(log)[0];
        assert_eq!(
            (u.kernel.as_str(), u.arch.as_str(), u.registers, u.stack, u.spill, u.smem),
            ("k", "sm_90", 72, 256, 12, 16)
        );
    }
}
