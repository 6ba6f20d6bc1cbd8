//! Tiled CPU reference schedules that compute attention in the order the GPU kernels will
//! (tiles, f32 accumulation, bf16/f16 inputs). The schedules arrive with the reference-schedule
//! issue; this crate exists now so that the workspace layout of DESIGN.md is complete and the
//! dependency rule (reference → oracle spec types only) is fixed from the start.
#![forbid(unsafe_code)]

pub use attnproof_oracle::spec::{AttentionSpec, Layout, Mask};
