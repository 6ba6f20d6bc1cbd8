//! Theorems of Block scores (E15): mean pooling against the exact block log-mass, its decomposition and second-order approximation.
