//! Every door a call comes in by, and what an attacker can do at it: the HTTP layers (together and
//! alone), stdio, the proxy in front of other MCP servers, other clients (Python's SDK, both eras,
//! a library user's router), cancellation, who a caller is (OAuth access tokens too), made-up keys and hostile input,
//! and what requests held open may cost (HTTP/2 streams, subscriptions).
//!
//! One test binary of modules (one per subject), so the crate is linked once for all of them.

// The shared helpers, one copy each in this binary.
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/oauth.rs"]
mod oauth;
#[path = "../common/otlp.rs"]
mod otlp;
#[path = "../common/process.rs"]
mod process;
#[path = "../common/python.rs"]
mod python;
#[path = "../common/slow_link.rs"]
mod slow_link;
#[path = "../common/redis.rs"]
mod test_redis;

mod cancellation;
mod clients;
mod hostile_input;
mod http_layer;
mod identity;
mod layers_alone;
mod made_up_keys;
mod oauth_tokens;
mod proxy;
mod proxy_lane;
mod proxy_rounds;
mod stdio;
mod subscriptions;
