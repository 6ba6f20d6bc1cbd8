//! The ring attention step driver (E11), shared by the CPU reference ring (`attnproof-reference`) and the GPU ring
//! (`attnproof-gpu`): the one step schedule every backend runs ([`run_device`], over a [`RingTransport`] and a
//! [`RingWorker`]), the faults it reports ([`RingFault`]), and how a ring cuts sequences among its devices
//! ([`RingSplit`]). It depends on the oracle only, so that neither backend depends on the other.

mod driver;
mod layout;

pub use driver::{DeviceRun, RingFault, RingPosition, RingTransport, RingWorker, Travel, run_device};
pub use layout::{RingLayout, RingSplit};
