//! Theorems of DSA (E16): the lightning indexer, exact causal top-k, the teacher distribution and KL loss, token-sparse attention.
