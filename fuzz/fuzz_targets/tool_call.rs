//! A tool call's arguments, as any client can send them, checked as our tools check them, then
//! through the one guarded call: refused as invalid, refused by the guard with a wait, or
//! admitted; never a panic, and a refusal always says how long to wait or why.
#![no_main]

use std::sync::{Arc, LazyLock};

use libfuzzer_sys::fuzz_target;
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::guard::{Call, Called, Guard, Plain, Worked};
use mcp_ratelimit::identity::Caller;
use mcp_ratelimit::mcp::tools::{catalogue, validate_arguments};
use mcp_ratelimit::ops::metrics::Metrics;
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
    let Ok(serde_json::Value::Object(args)) = serde_json::from_slice::<serde_json::Value>(json) else { return };
    // Checked as `serve` checks our tools' arguments, before anything is charged.
    let args = match validate_arguments(tool, Some(&args)) {
        Ok(serde_json::Value::Object(checked)) => checked,
        Ok(other) => panic!("checked arguments are an object: {other}"),
        Err(refusal) => return assert_eq!(refusal.code.as_str(), "invalid_arguments", "{refusal:?}"),
    };
    let caller = Caller::from_token(&format!("fuzz-{}", pick % 4));
    let mut call = Call::new(tool, &caller, &args);
    // Half the inputs claim to resume a round nobody was given: charged as a call of their own.
    if pick & 0x80 != 0 {
        call.resumes = Some("a made-up request state");
    }
    world.runtime.block_on(async {
        match world.guard.call(&Plain, None, call, |_, _| std::future::ready(Worked::Answer(()))).await {
            Called::Refused(refusal) => {
                assert!(!refusal.message.is_empty());
                assert!(refusal.retry_after_ms.is_some() || refusal.code.as_str() == "busy", "{refusal:?}");
            }
            Called::Answered { .. } => {}
            other => panic!("{other:?}"),
        }
    });
});
