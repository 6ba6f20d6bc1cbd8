//! A case file as a [`Candidate`]: the outputs are read from the file, the recipe is the one the file names, so that
//! an external kernel's forward is judged by the same runners as the reference schedules and the GPU kernels.
//!
//! The `check` binary (`crate::case::check`) remains the full path for case files (MPFR, block-sparse lists, LSE in
//! base 2, gradients, diagnosis of a failure); the seam covers what a dense candidate offers: a forward in bf16 or
//! f16 with a natural-log LSE on the file's own inputs. Everything else is [`CandidateError::Unsupported`].

use ndarray::ArrayD;

use attnproof_oracle::AttentionSpec;
use attnproof_proofs::flash_bound::FlashRecipe;

use super::format::{CaseFile, LseBase};
use super::safetensors::Dtype;
use crate::candidate::{Candidate, CandidateError, ForwardRun, Gradients, Storage};
use crate::flash::Case;
use crate::recipes::BackwardRecipe;

/// A loaded case file offered to the verifier as a candidate.
#[derive(Clone, Copy, Debug)]
pub struct CaseFileCandidate<'a> {
    /// The file.
    pub file: &'a CaseFile,
}

impl CaseFileCandidate<'_> {
    fn unsupported(&self, what: impl Into<String>) -> CandidateError {
        CandidateError::Unsupported { candidate: self.name(), what: what.into() }
    }

    /// Fails unless `T` is the file's storage type.
    fn check_storage<T: Storage>(&self) -> Result<(), CandidateError> {
        let name = match self.file.storage {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            other => return Err(self.unsupported(format!("storage type {}", other.name()))),
        };
        if name != <T as attnproof_gpu::GpuElement>::NAME {
            return Err(
                self.unsupported(format!("reading {name} outputs as {}", <T as attnproof_gpu::GpuElement>::NAME))
            );
        }
        Ok(())
    }

    /// The file's problem and inputs in storage type `T` (exact: the file holds values of that type).
    pub fn case<T: Storage>(&self) -> Result<Case<T>, CandidateError> {
        self.check_storage::<T>()?;
        let narrow = |t: &ArrayD<f64>| t.mapv(|x| T::from_f32(x as f32));
        Ok(Case {
            spec: self.file.spec.clone(),
            q: narrow(&self.file.q),
            k: narrow(&self.file.k),
            v: narrow(&self.file.v),
        })
    }

    fn output(&self, name: &str) -> Result<&ArrayD<f64>, CandidateError> {
        self.file.outputs.get(name).ok_or_else(|| self.unsupported(format!("output `{name}` (not in the file)")))
    }
}

impl Candidate for CaseFileCandidate<'_> {
    type Strategy = ();

    fn name(&self) -> String {
        format!("case file ({}, recipe {})", self.file.kernel, self.file.recipe.name)
    }

    fn forward_recipe<T: Storage>(&self, _spec: &AttentionSpec) -> Result<FlashRecipe, CandidateError> {
        Ok(self.file.recipe.flash)
    }

    fn backward_recipe<T: Storage>(&self, _spec: &AttentionSpec) -> Result<BackwardRecipe, CandidateError> {
        if !self.file.recipe.has_backward_model() {
            return Err(self.unsupported("a backward model for this recipe"));
        }
        Ok(BackwardRecipe { recipe: self.file.recipe.flash, q_tile: self.file.recipe.q_tile })
    }

    fn strategies(&self) -> Vec<()> {
        vec![()]
    }

    fn is_deterministic(&self, _strategy: ()) -> bool {
        true
    }

    fn keeps_state(&self) -> bool {
        false
    }

    fn forward<T: Storage>(&self, case: &Case<T>) -> Result<ForwardRun<T>, CandidateError> {
        self.check_storage::<T>()?;
        if self.file.sparsity.is_some() {
            return Err(self.unsupported("block or token lists (the `check` binary judges them)"));
        }
        if self.file.lse_base != LseBase::E {
            return Err(self.unsupported("an LSE in base 2 (the `check` binary judges it)"));
        }
        let same = |a: &ArrayD<T>, b: &ArrayD<f64>| {
            a.shape() == b.shape() && a.iter().zip(b).all(|(x, y)| x.to_f32() as f64 == *y)
        };
        if !(same(&case.q, &self.file.q) && same(&case.k, &self.file.k) && same(&case.v, &self.file.v)) {
            return Err(self.unsupported("inputs other than the file's own"));
        }
        let o = self.output("o")?.mapv(|x| T::from_f32(x as f32));
        let lse = self.output("lse")?.mapv(|x| x as f32);
        Ok(ForwardRun { o, lse })
    }

    fn backward<T: Storage>(
        &self,
        _strategy: (),
        _case: &Case<T>,
        _forward: &ForwardRun<T>,
        _d_out: &ArrayD<T>,
    ) -> Result<Gradients<T>, CandidateError> {
        // The verifier also judges the preprocess D, which a case file does not carry.
        Err(self.unsupported("a backward (case files carry no D; the `check` binary judges their gradients)"))
    }
}
