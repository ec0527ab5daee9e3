//! What moves between a job directory and the coordinator's artifact store:
//! artifacts a worker announced, verified (`verify`) and uploaded in order
//! (`upload`); checkpoints and the files they list (`checkpoint`); downloads
//! (`fetch`) of the resume checkpoint (`resume`) and of a graph job's inputs
//! (`inputs`); and what uploads and downloads share, the RPCs behind one trait,
//! the lease clock and the retry decision (`transfer`).

pub mod checkpoint;
pub mod fetch;
pub mod inputs;
pub mod resume;
pub mod transfer;
pub mod upload;
pub mod verify;
