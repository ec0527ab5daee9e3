//! The run-manager's two modes, one file each.

pub mod join;
pub mod local;
