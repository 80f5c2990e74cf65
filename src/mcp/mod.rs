//! The MCP face of the server: the rmcp handler every transport serves, and the tools. The
//! guarded router and the results it builds are the library's (`mcp-ratelimit-rmcp`),
//! re-exported here.

pub mod server;
pub mod stdio;
pub mod tools;

pub use mcp_ratelimit_rmcp::{limited, raw, results, trace};

pub use limited::LimitedRouter;
pub use server::{McpServer, Transport};
