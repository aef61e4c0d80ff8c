//! Wake on request without a proxy (`wake_on = "socket"`): the server keeps
//! its port, and the agent looks at that port's sockets in the server's
//! network namespace through the kernel's sock_diag (`gpusnap-sockwatch`).
//!
//! - `decide`: what a look means against the one before (pure);
//! - `watch`: the loop per service that looks, feeds the connections into
//!   the service's books (the same idle rule as the proxy's), and asks for
//!   the service back when a request comes for it while it is suspended.

pub mod decide;
mod watch;

pub use watch::spawn;
