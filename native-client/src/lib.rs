//! dflash-native-client: the worker launcher for native mode.
//!
//! The only crate of the workspace that links libpython (pyo3): `run-manager`
//! builds without a Python and starts this binary as its worker.
//! - [`python_env`] finds the provider's Python environment and names the exit
//!   codes (no Python needed to test it);
//! - [`embed`] runs `dflash_worker.job.main` in the embedded interpreter and
//!   maps Python exceptions to those exit codes.

pub mod embed;
pub mod python_env;
