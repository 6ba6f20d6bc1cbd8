//! Theorems of PISA tail (E22-E24): block means and deviations, the first-order tail in one softmax, the error bound, the covariance-aware score.
