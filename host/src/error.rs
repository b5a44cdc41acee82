//! The error type of every fallible rotkv call.

/// What was wrong with a call. A call that returns an error has changed nothing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A configuration outside the instantiated set (see `rotkv::SUPPORTED`).
    #[error("unsupported configuration: {0}")]
    Unsupported(String),
    /// An argument with the wrong size or shape.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A non-finite input, or one too large for the f16 storage.
    #[error("invalid value: {0}")]
    Value(String),
    /// The cache or the sequence has no room left.
    #[error("capacity exceeded: {0}")]
    Capacity(String),
    /// A sequence id that is not live: never handed out, freed (its slot may hold a
    /// newer sequence), or from another cache. Holds the id's slot.
    #[error("unknown sequence {0}")]
    UnknownSequence(usize),
    /// A layer index past the cache's layers.
    #[error("layer {layer} out of range (cache has {layers} layers)")]
    Layer {
        /// The layer asked for.
        layer: usize,
        /// Layers in the cache.
        layers: usize,
    },
    /// A block-table entry that points outside the page pool.
    #[error("block table entry {index} is {block}, but the pool has {num_blocks} blocks")]
    BlockTable {
        /// Position in the block table.
        index: usize,
        /// The entry.
        block: u32,
        /// Blocks in the pool.
        num_blocks: usize,
    },
    /// A block used twice by the block tables of one call: repeated in one table, or
    /// held by two sequences of a batch (see the contract in [`crate::paged`]).
    #[error("block table entry {index} is block {block}, which is used {detail}")]
    AliasedBlock {
        /// Position in the block table.
        index: usize,
        /// The block.
        block: u32,
        /// Where else it is used.
        detail: String,
    },
    /// Bad calibration data (a permutation that is not one, a non-finite mean).
    #[error("invalid calibration: {0}")]
    Calibration(String),
    /// A backend that is not available on this machine, or a failure reported by the
    /// device's driver.
    #[error("backend unavailable: {0}")]
    Backend(String),
    /// A buffer, view, stream or plan that belongs to another device handle (or, for
    /// candle tensors, another device, context or stream) than the call's.
    #[error("wrong device: {0}")]
    Device(String),
    /// A file that could not be read or parsed (eval and CLI).
    #[error("input error: {0}")]
    Input(String),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
