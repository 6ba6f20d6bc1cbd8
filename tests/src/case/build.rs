//! Writing case files from Rust (tests, fuzzing, and anyone checking a Rust kernel through the
//! same path as an external one): tensors given as f64 are rounded to the stated type.

use std::collections::BTreeMap;

use ndarray::ArrayD;

use super::safetensors::{self, Dtype, RawTensor};

/// The little-endian bytes of `values` rounded to `dtype` (integers truncate toward zero).
pub fn encode(dtype: Dtype, values: impl Iterator<Item = f64>) -> Vec<u8> {
    let mut out = Vec::new();
    for x in values {
        match dtype {
            Dtype::Bf16 => out.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
            Dtype::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            Dtype::F64 => out.extend_from_slice(&x.to_le_bytes()),
            Dtype::I32 => out.extend_from_slice(&(x as i32).to_le_bytes()),
            Dtype::I64 => out.extend_from_slice(&(x as i64).to_le_bytes()),
            Dtype::U8 | Dtype::Bool => out.push(x as u8),
        }
    }
    out
}

/// A case file under construction.
#[derive(Clone, Debug, Default)]
pub struct CaseBuilder {
    tensors: Vec<(String, RawTensor)>,
    metadata: BTreeMap<String, String>,
}

impl CaseBuilder {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) tensor `name`, rounded to `dtype`.
    pub fn tensor(self, name: &str, dtype: Dtype, values: &ArrayD<f64>) -> Self {
        let bytes = encode(dtype, values.iter().copied());
        self.raw(name, RawTensor { dtype, shape: values.shape().to_vec(), bytes })
    }

    /// Adds (or replaces) a tensor as given.
    pub fn raw(mut self, name: &str, tensor: RawTensor) -> Self {
        self.tensors.retain(|(n, _)| n != name);
        self.tensors.push((name.to_string(), tensor));
        self
    }

    /// Removes tensor `name`.
    pub fn without(mut self, name: &str) -> Self {
        self.tensors.retain(|(n, _)| n != name);
        self
    }

    /// Sets metadata `key`.
    pub fn meta(mut self, key: &str, value: &str) -> Self {
        self.metadata.insert(key.to_string(), value.to_string());
        self
    }

    /// Removes metadata `key`.
    pub fn without_meta(mut self, key: &str) -> Self {
        self.metadata.remove(key);
        self
    }

    /// The file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let refs: Vec<(&str, &RawTensor)> = self.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        safetensors::write(&refs, &self.metadata)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_and_tensors_are_added_replaced_and_removed() {
        let b = CaseBuilder::new().meta("a", "1").meta("b", "2").meta("a", "3").without_meta("b");
        assert_eq!(b.metadata, BTreeMap::from([("a".to_owned(), "3".to_owned())]));
        let t = ndarray::arr1(&[1.0, -2.5]).into_dyn();
        let b = b.tensor("x", Dtype::F32, &t).tensor("y", Dtype::F64, &t).tensor("x", Dtype::Bf16, &t).without("y");
        assert_eq!(b.tensors.len(), 1);
        assert_eq!(b.tensors[0].1.dtype, Dtype::Bf16);
        assert_eq!(b.tensors[0].1.bytes, encode(Dtype::Bf16, [1.0, -2.5].into_iter()));
    }

    #[test]
    fn encoding_rounds_to_the_stated_type() {
        assert_eq!(encode(Dtype::F16, [1.0].into_iter()), 0x3c00u16.to_le_bytes());
        assert_eq!(encode(Dtype::Bf16, [1.0].into_iter()), 0x3f80u16.to_le_bytes());
        assert_eq!(encode(Dtype::I32, [-2.9].into_iter()), (-2i32).to_le_bytes(), "integers truncate toward zero");
        assert_eq!(encode(Dtype::I64, [7.9].into_iter()), 7i64.to_le_bytes());
        assert_eq!(encode(Dtype::U8, [3.0].into_iter()), [3]);
        assert_eq!(encode(Dtype::F64, [0.1].into_iter()), 0.1f64.to_le_bytes());
    }
}
