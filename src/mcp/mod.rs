//! The MCP face of the server: the rmcp handler every transport serves, and the tools.

pub mod limited;
pub mod results;
pub mod server;
pub mod stdio;
pub mod tools;

pub use limited::LimitedRouter;
pub use server::{McpServer, Transport};
