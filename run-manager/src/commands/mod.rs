//! The run-manager's two modes, one file each, and the hidden single-upload command the
//! artifact benchmark drives (`upload`).

pub mod join;
pub mod local;
pub mod upload;
