//! # minisgl-cpu-service
//!
//! The CPU control plane of minisgl as one Rust process (`MINISGL_CPU_BACKEND=rust_service`):
//! request ingress from the Python API server, tokenization and chat templates, scheduling
//! (`minisgl-cpu-core`), incremental detokenization with stop strings, health and metrics.
//! Python workers only run the model and sample. No Python in this process.

pub mod engine;
pub mod metrics;
pub mod replay;
pub mod router;
pub mod service;
pub mod text;
pub mod wire;
