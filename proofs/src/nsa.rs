//! Theorems of NSA (E18-E20): compression windows, compressed attention, the Eq. 9 remap, group sums, forced top-n, selection and window branches, gates, and the CSR transpose.
