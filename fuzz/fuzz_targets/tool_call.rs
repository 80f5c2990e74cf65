//! A tool call's arguments, as any client can send them: through the tools' validation and then
//! the guard. Validation answers a value or a refusal; the guard admits or refuses with a wait;
//! neither panics, and a refusal always says how long to wait or why.
#![no_main]

use std::sync::{Arc, LazyLock};

use libfuzzer_sys::fuzz_target;
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::guard::{Guard, ToolCall};
use mcp_ratelimit::identity::Caller;
use mcp_ratelimit::mcp::tools::{catalogue, validate_arguments};
use mcp_ratelimit::metrics::Metrics;
use mcp_ratelimit::store::MemoryStore;
use mcp_ratelimit::Config;

struct World {
    runtime: tokio::runtime::Runtime,
    guard: Guard,
    tools: Vec<String>,
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let tools = catalogue();
    let config = Config::defaults(&tools).expect("defaults");
    let clock = ManualClock::new();
    let guard = Guard::new(Arc::new(MemoryStore::on(clock.clone())), clock, &config.limiting, Arc::new(Metrics::new(&tools)));
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    World { runtime, guard, tools: tools.names().map(str::to_owned).collect() }
});

fuzz_target!(|data: &[u8]| {
    let Some((&pick, json)) = data.split_first() else { return };
    let world = &*WORLD;
    let tool = &world.tools[usize::from(pick) % world.tools.len()];
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(json) else { return };
    let args = value.as_object();
    let canonical = match validate_arguments(tool, args) {
        Ok(canonical) => canonical,
        Err(refusal) => {
            assert_eq!(refusal.code.as_str(), "invalid_arguments");
            return;
        }
    };
    let caller = Caller::from_token(&format!("fuzz-{}", pick % 4));
    let call = ToolCall { tool, args: &canonical, starts_job: catalogue().holds_slots(tool), loop_exempt: false };
    world.runtime.block_on(async {
        if let Err(refusal) = world.guard.admit(&caller, &call).await {
            assert!(!refusal.message.is_empty());
            assert!(refusal.retry_after_ms.is_some() || refusal.code.as_str() == "busy", "{refusal:?}");
        }
    });
});
