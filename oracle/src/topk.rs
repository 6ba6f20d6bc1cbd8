//! Top-k selection with the workspace conventions: ties break to the lower index, forced
//! entries first, results as `i32` lists sorted ascending and padded with `−1`; and the
//! validation of such lists (E14 convention).

use std::cmp::Ordering;

use ndarray::Array2;

use crate::error::OracleError;
use crate::real::Real;

/// The `k` best indices among those `eligible`, best first: larger score first, equal scores
/// to the lower index. Indices in `forced` (eligible or not) are always kept and come first, in
/// the order given, duplicates removed; they count towards `k`, and if there are more than `k` of
/// them, all are kept. NaN scores are never selected.
pub fn top_k<S: Real>(scores: &[S], k: usize, eligible: impl Fn(usize) -> bool, forced: &[usize]) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::with_capacity(k.max(forced.len()));
    for &f in forced {
        if !chosen.contains(&f) {
            chosen.push(f);
        }
    }
    let mut rest: Vec<usize> =
        (0..scores.len()).filter(|&j| eligible(j) && !chosen.contains(&j) && !scores[j].is_nan()).collect();
    // Stable sort by descending score keeps equal scores in ascending index order.
    rest.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).expect("NaN filtered out"));
    let room = k.saturating_sub(chosen.len());
    chosen.extend(rest.into_iter().take(room));
    chosen
}

/// `indices` sorted ascending as `i32`, padded with `−1` to `width` (which must hold them all).
pub fn padded_ascending(indices: &[usize], width: usize) -> Vec<i32> {
    assert!(indices.len() <= width, "padded_ascending: {} indices do not fit in width {width}", indices.len());
    let mut v: Vec<i32> = indices.iter().map(|&i| i32::try_from(i).expect("index fits in i32")).collect();
    v.sort_unstable();
    v.resize(width, -1);
    v
}

/// `[n_rows, width]` index lists, row `r` holding `row(r)` as [`padded_ascending`] writes it: the shape every
/// selector (DSA's top-k, NSA's blocks, HiLS's chunks) returns.
pub fn padded_rows(n_rows: usize, width: usize, row: impl FnMut(usize) -> Vec<usize>) -> Array2<i32> {
    let flat: Vec<i32> = (0..n_rows).map(row).flat_map(|indices| padded_ascending(&indices, width)).collect();
    Array2::from_shape_vec((n_rows, width), flat).expect("padded_ascending writes `width` entries per row")
}

/// Checks one row of an index list against the convention: valid entries in `0..bound`,
/// ascending, no duplicates, then only `−1` pads. Returns the valid prefix.
pub fn validate_index_row(
    argument: &'static str,
    row_index: usize,
    row: &[i32],
    bound: usize,
) -> Result<Vec<usize>, OracleError> {
    let err =
        |slot: usize, reason: String| OracleError::IndexList { argument, position: vec![row_index, slot], reason };
    let valid = row.iter().position(|&x| x == -1).unwrap_or(row.len());
    for (slot, &x) in row.iter().enumerate() {
        if slot >= valid {
            if x != -1 {
                return Err(err(slot, format!("index {x} after a -1 pad")));
            }
            continue;
        }
        if x < 0 || x as usize >= bound {
            return Err(err(slot, format!("index {x} out of range 0..{bound}")));
        }
        if slot > 0 {
            let prev = row[slot - 1];
            match x.cmp(&prev) {
                Ordering::Equal => return Err(err(slot, format!("index {x} duplicated"))),
                Ordering::Less => return Err(err(slot, format!("index {x} after {prev}: not ascending"))),
                Ordering::Greater => {}
            }
        }
    }
    Ok(row[..valid].iter().map(|&x| x as usize).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_break_to_the_lower_index_and_forced_come_first() {
        let s = [1.0, 3.0, 3.0, 2.0, 3.0];
        assert_eq!(top_k(&s, 3, |_| true, &[]), vec![1, 2, 4]);
        assert_eq!(top_k(&s, 3, |j| j != 2, &[0]), vec![0, 1, 4]);
        assert_eq!(padded_ascending(&[4, 1], 4), vec![1, 4, -1, -1]);
    }

    #[test]
    fn index_rows_are_validated() {
        assert_eq!(validate_index_row("l", 0, &[0, 2, -1], 3), Ok(vec![0, 2]));
        for bad in [&[0, 3, -1][..], &[2, 1, -1], &[1, 1, -1], &[0, -1, 2], &[-2, -1, -1]] {
            assert!(
                matches!(validate_index_row("l", 0, bad, 3), Err(OracleError::IndexList { argument: "l", .. })),
                "{bad:?}"
            );
        }
    }
}
