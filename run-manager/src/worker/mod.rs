//! The worker as the run-manager sees it: a child process (`process`: spawn,
//! log relay, signals) with the environment it may have (`environment`),
//! several local ranks supervised as one (`ranks`), or a container (`docker`),
//! the mode decided once per attempt (`launch`); what it says on stdout
//! (`events`) and the job directory it is handed (`jobdir`).

pub mod docker;
pub mod environment;
pub mod events;
pub mod jobdir;
pub mod launch;
pub mod process;
pub mod ranks;
