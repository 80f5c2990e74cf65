//! Any TOML a user can write: a config that validates, or an error naming a key. Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mcp_ratelimit::Config;
use mcp_ratelimit::mcp::tools::catalogue;

fuzz_target!(|data: &[u8]| {
    let Ok(toml) = std::str::from_utf8(data) else { return };
    match Config::from_toml(toml, &catalogue()) {
        // A valid config can be shown and used to build the limits' policy.
        Ok(config) => {
            let _ = config.limits_table();
            let _ = mcp_ratelimit::guard::Policy::new(&config.limiting);
        }
        Err(error) => assert!(!error.to_string().is_empty()),
    }
});
