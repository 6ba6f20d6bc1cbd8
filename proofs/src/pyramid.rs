//! Theorems of Pyramid Top-K (E25-E30): the mean-pooled hierarchy, coarse-to-fine LSE descent, PISA-1/PISA-2 truncations, BSA scoring, causal eligibility, forced blocks, and diagnostics.
