"""2-bit KV-cache quantization with Hadamard rotations, and decode attention that reads
the packed cache (the Rust library rotkv, CPU backends).

Arrays: keys, values and queries may be float32, float16 or bfloat16 (ml_dtypes), as
numpy arrays or anything numpy reads through DLPack (a CPU torch.Tensor). C-contiguous
inputs are read in place; other layouts and misaligned arrays are copied first, and
non-native byte order is refused. Outputs are float32, returned or written into `out=`
(float32, C-contiguous, aligned, writeable, the exact shape, not sharing memory with an
input). The GIL is released during appends and decodes: while such a call runs, do not
write to its inputs, read or write its `out`, or resize or free their memory from
another thread (`ndarray.resize(refcheck=False)`, `torch.Tensor.resize_` on a tensor
passed through DLPack).

Errors: every failed call raises a RotkvError (RotkvValueError for arguments,
RotkvMemoryError for capacity) with the Rust library's message, and changes nothing.
"""

from typing import Any, Optional, Sequence

import numpy as np
import numpy.typing as npt

__version__: str
FORMAT_VERSION: int

class RotkvError(Exception):
    """Base of every error rotkv raises; the message is the Rust library's."""

class RotkvValueError(RotkvError, ValueError):
    """A bad shape, dtype, layout, value, sequence id, layer or calibration."""

class RotkvMemoryError(RotkvError, MemoryError):
    """The cache, or a sequence, has no room left."""

def calibrate(model: str, text: str, out: str, tokens: int = 2048) -> int:
    """Calibrates a GGUF model on the first `tokens` tokens of a text file (as `rotkv
    calibrate --methods center,reorder,smooth`) and writes the file `out`; returns the
    number of layers. `Calibration.load(out, config)` reads it as a preset's recipe."""

def configs() -> list[dict[str, int]]:
    """The instantiated (head_dim, key_bits, value_bits, group_size) combinations."""

class CacheConfig:
    """What fixes the byte format of a cache layer. Fields may be changed before a cache
    is made; `KvCache` checks them."""

    head_dim: int
    key_bits: int
    value_bits: int
    group_size: int
    page_size: int
    sinks: int
    window: int
    key_rotation: str
    """"hadamard" or "none"."""
    value_rotation: str
    """"hadamard" or "none"."""
    key_clip: float
    value_clip: float
    protected: int
    channel_norm: int
    def __init__(self, preset: str = "k2v2", head_dim: int = 128, **fields: Any) -> None:
        """A preset ("k2v2", "k4v2", "k4v4") with some fields changed."""
    @staticmethod
    def k2v2(head_dim: int) -> CacheConfig:
        """2-bit keys and values (the default)."""
    @staticmethod
    def k4v2(head_dim: int) -> CacheConfig:
        """4-bit keys, 2-bit values."""
    @staticmethod
    def k4v4(head_dim: int) -> CacheConfig:
        """4-bit keys and values."""
    @staticmethod
    def preset(name: str, head_dim: int) -> CacheConfig: ...
    def validate(self) -> None:
        """Raises RotkvValueError unless the configuration is supported."""
    def bytes_per_token(self) -> int:
        """Bytes per quantized token per KV head (codes, scales and zeros of K and V)."""
    def bits_per_element(self) -> float:
        """Storage bits per cached element, averaged over keys and values."""
    def pass_rows(self) -> int:
        """Rows per pass of a multi-token step (StepBatch(pass_rows=...)): half the window."""

class SeqId:
    """A live sequence of a KvCache. A freed id, or one of another cache, is refused."""

    @property
    def slot(self) -> int: ...
    @property
    def generation(self) -> int: ...
    def __hash__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...

class Calibration:
    """One layer's calibration: per KV head a key mean, key scales (smoothing), key and
    value channel permutations, optional learned orthogonal rotations."""

    def __init__(
        self,
        key_mean: npt.ArrayLike,
        key_scale: Optional[npt.ArrayLike] = None,
        key_perm: Optional[npt.ArrayLike] = None,
        value_perm: Optional[npt.ArrayLike] = None,
        key_rotation: Optional[npt.ArrayLike] = None,
        value_rotation: Optional[npt.ArrayLike] = None,
    ) -> None:
        """Arrays of shape [num_kv_heads, head_dim] (rotations [num_kv_heads, head_dim,
        head_dim]); a missing one is the identity. Checked here."""
    @staticmethod
    def load(path: str, config: CacheConfig) -> list[Calibration]:
        """The recommended recipe of config's preset from a `rotkv calibrate` file, one per
        layer (key centering and the per-KV-head smoothing measured for its key bits)."""
    @staticmethod
    def identity(num_kv_heads: int, head_dim: int) -> Calibration: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def key_mean(self) -> npt.NDArray[np.float32]: ...
    @property
    def key_scale(self) -> npt.NDArray[np.float32]: ...
    @property
    def key_perm(self) -> npt.NDArray[np.uint16]: ...
    @property
    def value_perm(self) -> npt.NDArray[np.uint16]: ...

class KvCache:
    """A paged, quantized KV cache of `layers` layers for up to `max_seqs` sequences.
    Thread-safe: calls on one cache from several threads run one at a time."""

    def __init__(
        self,
        config: CacheConfig,
        layers: int,
        num_kv_heads: int,
        num_q_heads: int,
        max_seqs: int,
        max_tokens: int,
        num_blocks: Optional[int] = None,
        backend: str = "cpu",
    ) -> None:
        """`backend`: "cpu" (the fast CPU backend), "reference" (the scalar f64 oracle)
        or "auto" (= "cpu"). `num_blocks` (per layer) defaults to room for `max_tokens`
        tokens in every sequence."""
    @property
    def config(self) -> CacheConfig: ...
    @property
    def layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def num_q_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_seqs(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...
    def add_sequence(self) -> SeqId:
        """A new, empty sequence; RotkvMemoryError when every slot is live."""
    def free_sequence(self, seq: SeqId) -> None: ...
    def len(self, layer: int, seq: SeqId) -> int: ...
    def is_empty(self, seq: SeqId) -> bool: ...
    def append(self, layer: int, seq: SeqId, k: Any, v: Any) -> None:
        """Appends tokens: k and v [tokens, num_kv_heads, head_dim], one dtype."""
    def decode(
        self,
        layer: int,
        seqs: Sequence[SeqId],
        q: Any,
        out: Optional[npt.NDArray[np.float32]] = None,
        num_splits: Optional[int] = None,
    ) -> npt.NDArray[np.float32]:
        """Attention of one query token per sequence: q [len(seqs), num_q_heads,
        head_dim]; the result (or `out`) has q's shape."""
    def decode_tokens(
        self,
        layer: int,
        seqs: Sequence[SeqId],
        q: Any,
        out: Optional[npt.NDArray[np.float32]] = None,
        num_splits: Optional[int] = None,
    ) -> npt.NDArray[np.float32]:
        """Attention of the last q_len tokens of every sequence (causal): q
        [len(seqs), q_len, num_q_heads, head_dim]; the result (or `out`) has q's shape."""
    def set_calibration(self, layer: int, calibration: Calibration) -> None:
        """Only while no sequence holds tokens of that layer."""
    def set_sequence_key_mean(self, layer: int, seq: SeqId, mean: npt.ArrayLike) -> None:
        """`seq`'s own key mean [num_kv_heads, head_dim], before its tokens of `layer`."""
    def protect(self, layer: int, seq: SeqId, positions: Sequence[int]) -> None:
        """Keeps `positions` in f16 (detected attention sinks); see the Rust docs."""
    def protected(self, layer: int, seq: SeqId) -> list[int]: ...
    def set_softmax_scale(self, scale: float) -> None: ...
    def set_window_left(self, layer: int, window_left: Optional[int]) -> None:
        """A sliding window (FlashInfer's window_left); None attends to everything."""
    def window_left(self, layer: int) -> Optional[int]: ...
    def layer_bytes(self, layer: int) -> tuple[bytes, npt.NDArray[np.float16]]:
        """A layer's page pool and side stores as stored (copies)."""
    def _time_decode(self, layer: int, seqs: Sequence[SeqId], q: Any, iters: int) -> list[float]:
        """Seconds of each of `iters` decodes called from inside Rust (for the overhead
        measurement of examples/overhead.py)."""

class Device:
    """A device of the device API: the emulated GPU (`Device.sim()`: the CUDA kernels run
    on the CPU by rotkv's SIMT emulator; device addresses are host addresses, so numpy
    arrays serve as device memory) or a CUDA GPU (`Device.cuda()`: inputs and `out` are
    CUDA tensors, torch's or any with `__cuda_array_interface__`, C-contiguous; `out=` is
    required)."""

    @staticmethod
    def sim() -> Device: ...
    @staticmethod
    def cuda(device: int = 0, stream: Optional[int] = None) -> Device:
        """GPU `device`'s primary context, launching on `stream` (a CUstream handle, e.g.
        `torch.cuda.current_stream().cuda_stream`; None: a new stream). The stream must
        outlive the Device; tensors must stay alive until the stream's work is done.
        Raises RotkvError without a CUDA driver or device. Has not run on a GPU."""
    @property
    def name(self) -> str: ...
    @property
    def launches(self) -> int:
        """Kernel launches enqueued so far."""

class DeviceLayer:
    """One layer's cache in device memory. On the emulated device inputs are numpy arrays
    (or CPU tensors) read in place when C-contiguous (copied otherwise); on a CUDA device
    they are C-contiguous CUDA tensors. The kernels run without the GIL."""

    def __init__(
        self,
        device: Device,
        config: CacheConfig,
        num_kv_heads: int,
        num_q_heads: int,
        max_seqs: int,
        max_tokens: int,
        calibration: Optional[Calibration] = None,
        num_blocks: Optional[int] = None,
    ) -> None: ...
    @property
    def free_blocks(self) -> int: ...
    def add_sequence(self) -> SeqId: ...
    def free_sequence(self, seq: SeqId) -> None: ...
    def len(self, seq: SeqId) -> int: ...
    def reserve(self, seq: SeqId, len: int) -> int:
        """Takes the blocks `seq` needs to hold `len` tokens (before append_batch)."""
    def protect(self, seq: SeqId, positions: Sequence[int]) -> None: ...
    def append(self, seq: SeqId, k: Any, v: Any) -> int:
        """Appends [tokens, num_kv_heads, head_dim] (one dtype); returns the new length."""
    def append_batch(self, batch: StepBatch, k: Any, v: Any) -> None:
        """The step's rows from k and v [batch.max_rows, num_kv_heads, head_dim]."""
    def advance(self, batch: StepBatch) -> None:
        """The checks and length bookkeeping of append_batch without a launch (for a step
        a captured CUDA graph replays)."""
    def read_cache(self) -> tuple[bytes, npt.NDArray[np.uint16]]:
        """The pool and the side stores (f16 bit patterns) as stored."""

class StepBatch:
    """The rows of one serving step: which sequences take how many new tokens."""

    def __init__(
        self, device: Device, max_seqs: int, max_rows: int, pass_rows: Optional[int] = None, passes: int = 1
    ) -> None:
        """With `pass_rows` (`CacheConfig.pass_rows()`), `DecodePlan.run_step` runs each
        step in `passes` passes of at most that many rows per sequence."""
    def set(self, layer: DeviceLayer, steps: Sequence[tuple[SeqId, int]]) -> None:
        """Rows in the order of `steps`; set again before every step."""
    @property
    def rows(self) -> int: ...
    @property
    def max_rows(self) -> int: ...
    @property
    def passes(self) -> int: ...
    @property
    def pass_rows(self) -> int: ...

class DecodePlan:
    """A decode launch fixed for a batch shape (split count and workspace made once)."""

    def __init__(
        self,
        layer: DeviceLayer,
        max_seqs: int,
        max_q_len: int,
        max_context: int,
        sm_scale: Optional[float] = None,
        window_left: Optional[int] = None,
    ) -> None: ...
    @property
    def num_splits(self) -> int: ...
    def check_batch(self, layer: DeviceLayer, batch: StepBatch) -> None:
        """run_batch's checks of the plan, layer and batch, nothing enqueued."""
    def run(self, layer: DeviceLayer, q: Any, out: Optional[Any] = None) -> Any:
        """Slots 0 .. max_seqs, q [max_seqs, q_len, num_q_heads, head_dim]."""
    def run_batch(self, layer: DeviceLayer, batch: StepBatch, q: Any, out: Optional[Any] = None) -> Any:
        """The step's rows (after layer.append_batch): q [batch.max_rows, num_q_heads,
        head_dim]; unused rows of the result are zeros."""
    def run_step(
        self,
        layer: DeviceLayer,
        batch: StepBatch,
        k: Any,
        v: Any,
        q: Any,
        out: Optional[Any] = None,
    ) -> Any:
        """A whole step in the batch's passes: appends k, v [batch.max_rows, num_kv_heads,
        head_dim] and decodes q [batch.max_rows, num_q_heads, head_dim]; each row sees the
        earlier rows of its pass in f16; unused rows of the result are zeros."""
