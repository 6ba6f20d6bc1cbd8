//! Verifying E30's block masses from the GPU (`attnproof_gpu::pisa::diagnostics`) against the oracle: per query block,
//! the oracle's per-query `pyramid::diagnostics` masses of every row that sees a key, averaged over the rows, within
//! the bound of `attnproof_proofs::pyramid_bound::mass_relative_bound` (the kernel's and the oracle's f64 evaluations
//! each within `r` of the exact masses, so within `2r / (1 − r)` of each other, plus a few units of `2^-1074` per term
//! where a probability underflows). Entries with no visible key (past a sequence's leaves, past its query blocks, a
//! block that sees nothing, leaves that start after the block's last visible key) must be exactly zero, and a block
//! that sees a key must have masses that sum to one within the same bound.

use attnproof_gpu::pisa::block_position;
use attnproof_gpu::pisa::diagnostics::{MassConfig, masses_shape};
use attnproof_oracle::pyramid::{Pyramid, PyramidConfig, PyramidQuery, Scoring, diagnostics};
use attnproof_oracle::{AttentionSpec, Sequence};
use attnproof_proofs::pyramid_bound::{item_score_bound, mass_relative_bound};
use attnproof_reference::Element;
use ndarray::{Array2, ArrayView4, Axis};

use crate::flash::{Case, HarnessError};

/// What [`verify_block_masses`] found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MassVerdict {
    /// Query blocks that see a key (their masses compared with the oracle's).
    pub blocks: usize,
    /// The largest `|GPU − oracle| / tolerance` over the compared masses (at most 1 when every mass passes).
    pub worst_ratio: f64,
    /// The largest relative bound `r` of a compared block.
    pub worst_bound: f64,
    /// Every failure, named by its place.
    pub failures: Vec<String>,
}

impl MassVerdict {
    /// True when every mass passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// `x ≤ bound`, false for NaN (a NaN mass fails).
fn within(x: f64, bound: f64) -> bool {
    x <= bound
}

/// The row's last visible key: the selectors' block convention with blocks of one row, `None` when it sees none.
fn row_position(spec: &AttentionSpec, seq: &Sequence, row: usize) -> Option<usize> {
    block_position(spec, seq, 1, row).map(|(_, position)| position)
}

/// Verifies `masses` (`[B, Hkv, query blocks, leaves]`) as the block masses of `case` under `config`.
pub fn verify_block_masses<T: Element>(
    case: &Case<T>,
    config: &MassConfig,
    masses: ArrayView4<'_, f64>,
) -> Result<MassVerdict, HarnessError> {
    let spec = &case.spec;
    let shape = masses_shape(spec, config);
    if masses.shape() != shape {
        return Err(HarnessError::CandidateShape {
            argument: "masses",
            expected: shape.to_vec(),
            actual: masses.shape().to_vec(),
        });
    }
    let [q, k, _] = case.widened();
    let group = spec.group_size();
    let d = spec.head_dim;
    let alpha = 1.0 / (d as f64).sqrt();
    let pyramid_config = PyramidConfig { leaf_size: config.leaf_size, branching: 2, keep: 1, scoring: Scoring::Lse };
    let mut verdict = MassVerdict::default();
    for seq in spec.sequences() {
        for kv in 0..spec.n_heads_kv {
            let keys = spec.head_rows(k.view(), &seq, kv, true);
            let pyramid = if keys.nrows() == 0 { None } else { Some(Pyramid::build(keys, &pyramid_config, ())?) };
            for a in 0..shape[2] {
                let at = format!("sequence {}, KV head {kv}, query block {a}", seq.index);
                let got = masses.index_axis(Axis(0), seq.index);
                let got = got.index_axis(Axis(0), kv);
                let got = got.index_axis(Axis(0), a);
                let (Some(pyramid), Some((rows, block_end))) =
                    (&pyramid, block_position(spec, &seq, config.q_block, a))
                else {
                    if got.iter().any(|&m| m != 0.0) {
                        verdict.failures.push(format!("{at} sees no key, but its masses are {got}"));
                    }
                    continue;
                };
                verdict.blocks += 1;
                let row0 = a * config.q_block;
                let mut expected = vec![0.0; shape[3]];
                let (mut seeing, mut item_error, mut range, mut most_keys) = (0usize, 0.0f64, 0.0f64, 0usize);
                for r in row0..row0 + rows {
                    let Some(position) = row_position(spec, &seq, r) else { continue };
                    seeing += 1;
                    let mut heads = Array2::zeros((group, d));
                    for h in 0..group {
                        heads.row_mut(h).assign(&spec.head_rows(q.view(), &seq, kv * group + h, false).row(r));
                    }
                    let query = PyramidQuery { heads: heads.view(), position };
                    let row_masses = diagnostics(pyramid, &query, &[], 1)?.block_mass;
                    for (b, m) in row_masses.into_iter().enumerate() {
                        expected[b] += m;
                    }
                    // The bound's inputs: every visible score's magnitude and the range of every head's scores.
                    most_keys = most_keys.max(position + 1);
                    for h in 0..group {
                        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
                        for j in 0..=position {
                            let (x, magnitude) = heads
                                .row(h)
                                .iter()
                                .zip(keys.row(j))
                                .fold((0.0, 0.0), |(x, m), (a, b)| (x + a * b, m + (a * b).abs()));
                            item_error = item_error.max(item_score_bound(alpha * magnitude, 0, 0, d));
                            (lo, hi) = (lo.min(alpha * x), hi.max(alpha * x));
                        }
                        range = range.max(hi - lo);
                    }
                }
                let r = mass_relative_bound(
                    item_error,
                    range + 2.0 * item_error,
                    most_keys,
                    seeing * group * config.leaf_size,
                );
                verdict.worst_bound = verdict.worst_bound.max(r);
                let tolerance = 2.0 * r / (1.0 - r);
                // Below f64's normal range the relative model gives way to absolute units: each of the `T` terms (and
                // the few operations on it) may be off by a few units of 2^-1074 where it underflows.
                let terms = seeing * group * config.leaf_size;
                let underflow = 8.0 * terms as f64 * f64::from_bits(1);
                let mut total = 0.0;
                for (b, (&m, e)) in got.iter().zip(&expected).enumerate() {
                    let e = e / seeing as f64;
                    total += m;
                    if b >= pyramid.n_leaves() || b * config.leaf_size > block_end {
                        if m != 0.0 {
                            verdict.failures.push(format!("{at}, leaf {b}: mass {m:e} where no key is visible"));
                        }
                        continue;
                    }
                    let allowed = tolerance * e + underflow;
                    let error = (m - e).abs();
                    verdict.worst_ratio = verdict.worst_ratio.max(error / allowed);
                    if !within(error, allowed) {
                        verdict.failures.push(format!(
                            "{at}, leaf {b}: mass {m:e}, oracle {e:e}: error {error:e} exceeds the bound {allowed:e}"
                        ));
                    }
                }
                if !within((total - 1.0).abs(), tolerance) {
                    verdict.failures.push(format!("{at}: the masses sum to {total}, not 1 within {tolerance:e}"));
                }
            }
        }
    }
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{Distribution, ValueProfile, make_case};
    use attnproof_oracle::{Layout, Mask};
    use half::bf16;
    use ndarray::Array4;

    fn profile() -> ValueProfile {
        ValueProfile { distribution: Distribution::Gaussian, logit_scale: 4.0, value_mean: 0.0 }
    }

    /// The oracle's own masses, laid out as the GPU's: what a correct kernel returns up to rounding.
    fn oracle_masses(case: &Case<bf16>, config: &MassConfig) -> Array4<f64> {
        let spec = &case.spec;
        let [q, k, _] = case.widened();
        let shape = masses_shape(spec, config);
        let mut out = Array4::zeros(shape);
        let pyramid_config =
            PyramidConfig { leaf_size: config.leaf_size, branching: 2, keep: 1, scoring: Scoring::Lse };
        for seq in spec.sequences() {
            for kv in 0..spec.n_heads_kv {
                let keys = spec.head_rows(k.view(), &seq, kv, true);
                if keys.nrows() == 0 {
                    continue;
                }
                let pyramid = Pyramid::build(keys, &pyramid_config, ()).unwrap();
                for a in 0..shape[2] {
                    let Some((rows, _)) = block_position(spec, &seq, config.q_block, a) else { continue };
                    let mut seeing = 0;
                    for r in a * config.q_block..a * config.q_block + rows {
                        let Some(position) = row_position(spec, &seq, r) else { continue };
                        seeing += 1;
                        let heads = Array2::from_shape_fn((spec.group_size(), spec.head_dim), |(h, c)| {
                            spec.head_rows(q.view(), &seq, kv * spec.group_size() + h, false)[[r, c]]
                        });
                        let query = PyramidQuery { heads: heads.view(), position };
                        for (b, m) in diagnostics(&pyramid, &query, &[], 1).unwrap().block_mass.into_iter().enumerate()
                        {
                            out[[seq.index, kv, a, b]] += m;
                        }
                    }
                    for b in 0..shape[3] {
                        out[[seq.index, kv, a, b]] /= seeing as f64;
                    }
                }
            }
        }
        out
    }

    fn varlen_case() -> Case<bf16> {
        // Sequence 0 has more queries than keys (its first query block sees nothing under the causal mask),
        // sequence 1 no queries, sequence 2 keys past a partial last leaf; a GQA group of 3.
        let spec = AttentionSpec {
            layout: Layout::Varlen { cu_seqlens_q: vec![0, 150, 150, 250], cu_seqlens_k: vec![0, 70, 200, 390] },
            ..AttentionSpec::dense(1, 6, 2, 1, 1, 16, 16)
        }
        .with_mask(Mask::Causal);
        make_case::<bf16>(&spec, profile(), 5)
    }

    /// The oracle's masses pass; each kind of wrong mass fails: one leaf's mass moved by 10 bounds, a mass where no
    /// key is visible, a block's masses scaled (they no longer sum to one), a head's share dropped.
    #[test]
    fn correct_masses_pass_and_wrong_ones_fail() {
        let case = varlen_case();
        let config = MassConfig { q_block: 64, leaf_size: 64 };
        let good = oracle_masses(&case, &config);
        let verdict = verify_block_masses(&case, &config, good.view()).unwrap();
        assert!(verdict.passed(), "{:?}", verdict.failures);
        // Sequence 0: blocks 1 and 2 see keys (block 0's rows 0..63 see nothing: 150 queries over 70 keys);
        // sequence 2: blocks 0 and 1, per KV head.
        assert_eq!(verdict.blocks, 2 * (2 + 2));
        assert!(verdict.worst_bound > 0.0 && verdict.worst_bound < 1e-11, "{}", verdict.worst_bound);
        assert!(verdict.worst_ratio < 1.0);

        let nudged = |at: [usize; 4], by: f64| {
            let mut m = good.clone();
            m[at] += by;
            verify_block_masses(&case, &config, m.view()).unwrap()
        };
        // 10 bounds on a mass of sequence 2's last block.
        let at = [2, 1, 1, 1];
        let v = nudged(at, 10.0 * 2.0 * verdict.worst_bound * good[at]);
        assert!(!v.passed() && v.worst_ratio > 1.0, "{v:?}");
        // Sequence 0 (150 queries over 70 keys): block 0 sees nothing, block 1's last key is 47 (leaf 1 unseen), leaf
        // 2 is past its keys; sequence 1 has no query block.
        // The nudge is a few subnormal units, below the underflow allowance of a visible leaf: only the exact-zero
        // rule catches it.
        for at in [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 2], [1, 0, 0, 0]] {
            let v = nudged(at, 1e-320);
            assert!(!v.passed(), "{at:?}: {v:?}");
        }
        // Every mass of a block scaled by 1 + 1e-9, far beyond the bound: the masses and their sum fail.
        let mut scaled = good.clone();
        for b in 0..good.shape()[3] {
            scaled[[2, 0, 1, b]] *= 1.0 + 1e-9;
        }
        let v = verify_block_masses(&case, &config, scaled.view()).unwrap();
        assert!(v.failures.iter().any(|f| f.contains("sum to")), "{v:?}");
        // The wrong shape is an error, not a verdict.
        let short = Array4::zeros([3, 2, 3, 2]);
        assert!(matches!(
            verify_block_masses(&case, &config, short.view()),
            Err(HarnessError::CandidateShape { argument: "masses", .. })
        ));
    }

    /// Rows that see no key are not averaged in: a block whose first rows see nothing divides by the rows that see.
    #[test]
    fn rows_that_see_nothing_are_not_counted() {
        // 100 queries over 40 keys, causal: block 1 (rows 64..99) has rows 64..99 seeing keys 4..39; block 0's rows
        // 60..63 see keys 0..3 and rows 0..59 nothing.
        let spec = AttentionSpec::dense(1, 1, 1, 100, 40, 8, 8).with_mask(Mask::Causal);
        let case = make_case::<bf16>(&spec, profile(), 9);
        let config = MassConfig { q_block: 64, leaf_size: 64 };
        let good = oracle_masses(&case, &config);
        assert!((good[[0, 0, 0, 0]] - 1.0).abs() < 1e-12, "one leaf holds all the mass of the 4 rows that see");
        assert!(verify_block_masses(&case, &config, good.view()).unwrap().passed());
        // Averaging over all 64 rows would give 4/64.
        let mut diluted = good.clone();
        diluted[[0, 0, 0, 0]] = 4.0 / 64.0;
        assert!(!verify_block_masses(&case, &config, diluted.view()).unwrap().passed());
    }

    /// The bound of an unmasked one-block case equals the derivation evaluated here from the definitions (every row
    /// sees all 100 keys), and the tolerance is `2r / (1 − r)`: a mass moved by 1.9 r of itself passes, by 2.1 r fails.
    #[test]
    fn the_bound_is_the_derived_one() {
        let spec = AttentionSpec::dense(1, 2, 1, 50, 100, 8, 8).with_mask(Mask::None);
        let case = make_case::<bf16>(&spec, profile(), 13);
        let config = MassConfig { q_block: 64, leaf_size: 64 };
        let good = oracle_masses(&case, &config);
        let verdict = verify_block_masses(&case, &config, good.view()).unwrap();
        assert!(verdict.passed(), "{:?}", verdict.failures);
        assert_eq!(verdict.blocks, 1);
        let [q, k, _] = case.widened();
        let alpha = 1.0 / 8f64.sqrt();
        let (mut e, mut range) = (0.0f64, 0.0f64);
        for h in 0..2 {
            for r in 0..50 {
                let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
                for j in 0..100 {
                    let (mut x, mut magnitude) = (0.0, 0.0);
                    for c in 0..8 {
                        let p = q[[0, h, r, c]] * k[[0, 0, j, c]];
                        x += p;
                        magnitude += p.abs();
                    }
                    e = e.max(item_score_bound(alpha * magnitude, 0, 0, 8));
                    (lo, hi) = (lo.min(alpha * x), hi.max(alpha * x));
                }
                range = range.max(hi - lo);
            }
        }
        let r = mass_relative_bound(e, range + 2.0 * e, 100, 50 * 2 * 64);
        assert!((verdict.worst_bound - r).abs() <= 1e-12 * r, "{} vs {r}", verdict.worst_bound);
        for (factor, passes) in [(1.9, true), (2.1, false)] {
            let mut moved = good.clone();
            moved[[0, 0, 0, 0]] *= 1.0 + factor * r;
            let v = verify_block_masses(&case, &config, moved.view()).unwrap();
            assert_eq!(v.passed(), passes, "moved by {factor} r: {v:?}");
        }
    }

    /// A leaf that starts exactly at the block's last visible key is visible (one key): its mass is compared, not
    /// required to be zero.
    #[test]
    fn a_leaf_starting_at_the_last_visible_key_is_visible() {
        let spec = AttentionSpec::dense(1, 1, 1, 10, 65, 8, 8).with_mask(Mask::None);
        let case = make_case::<bf16>(&spec, profile(), 17);
        let config = MassConfig { q_block: 64, leaf_size: 64 };
        let good = oracle_masses(&case, &config);
        assert!(good[[0, 0, 0, 1]] > 0.0);
        let verdict = verify_block_masses(&case, &config, good.view()).unwrap();
        assert!(verdict.passed(), "{:?}", verdict.failures);
    }

    /// Where probabilities underflow the relative model gives way to units of 2^-1074, 8 per term: a leaf whose keys
    /// score 730 below the others has a subnormal mass (about e^-730); with 2 rows, 2 heads and leaves of 64 it sums
    /// 256 terms, so it may move by up to 2048 units (0.9 of that passes, 1.1 fails).
    #[test]
    fn subnormal_masses_are_allowed_a_few_units_per_term() {
        let spec = AttentionSpec::dense(1, 2, 1, 2, 128, 8, 8).with_mask(Mask::None);
        let mut case = make_case::<bf16>(&spec, profile(), 19);
        case.q.fill(bf16::ZERO);
        case.k.fill(bf16::ZERO);
        for h in 0..2 {
            for r in 0..2 {
                case.q[[0, h, r, 0]] = bf16::from_f64(32.25);
            }
        }
        for j in 0..128 {
            case.k[[0, 0, j, 0]] = bf16::from_f64(if j < 64 { 32.0 } else { -32.0 });
        }
        let config = MassConfig { q_block: 64, leaf_size: 64 };
        let good = oracle_masses(&case, &config);
        let tail = good[[0, 0, 0, 1]];
        assert!(tail > 0.0 && tail < f64::MIN_POSITIVE, "leaf 1's mass {tail:e} is not subnormal");
        let unit = f64::from_bits(1);
        for (units, passes) in [(3.0, true), (1843.0, true), (2253.0, false)] {
            let mut moved = good.clone();
            moved[[0, 0, 0, 1]] += units * unit;
            let v = verify_block_masses(&case, &config, moved.view()).unwrap();
            assert_eq!(v.passed(), passes, "moved by {units} units: {v:?}");
        }
    }
}
