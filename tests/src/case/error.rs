//! Why a case file cannot be checked: each error names the tensor or metadata key at fault, in
//! one line. Numerical disagreement is never an error (it is a verdict).

use thiserror::Error;

/// An unreadable or inconsistent case file.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CaseError {
    /// The file could not be read.
    #[error("cannot read the file: {reason}")]
    Io {
        /// The operating system's message.
        reason: String,
    },
    /// The safetensors header is malformed, truncated or too large.
    #[error("bad safetensors header: {reason}")]
    Header {
        /// What is wrong.
        reason: String,
    },
    /// A required tensor is absent.
    #[error("missing tensor `{name}`: {why}")]
    MissingTensor {
        /// Its name.
        name: String,
        /// Why it is needed (every case needs `q`, `k`, `v`; a gradient needs `do`).
        why: String,
    },
    /// A tensor is malformed or inconsistent with the others or with the metadata.
    #[error("tensor `{name}`: {reason}")]
    Tensor {
        /// Its name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A metadata key is missing, malformed or inconsistent.
    #[error("metadata `{key}`: {reason}")]
    Key {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}
