//! Theorems of HiLS (E21): landmark distributions, slope keys, entropy intercepts, router scores, surrogate masses and the factorized output.
