//! Memory stays bounded: a million callers cost at most 128 bytes each while live, and an
//! idle sweep gives the memory back. Measured with a counting allocator, so the figure is
//! exact and independent of the system allocator. (The only test in this binary, so nothing
//! else allocates while it measures.)

// A counting allocator wraps the system's: the one place the workspace allows `unsafe`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::{Gcra, Limiter, TokenBucket};
use mcp_ratelimit::store::{Check, MemoryStore};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const CALLERS: usize = 1_000_000;
const SEC: u64 = 1_000_000_000;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

#[test]
fn a_million_callers_fit_in_128_bytes_each_and_sweep_gives_it_back() {
    let store = MemoryStore::new();
    let mut key = String::with_capacity(32);
    for limiter in [Limiter::TokenBucket(TokenBucket::new(60, 1.0)), Limiter::Gcra(Gcra::new(60, 1.0))] {
        let baseline = live();
        for i in 0..CALLERS {
            key.clear();
            use std::fmt::Write;
            let _ = write!(key, "caller:tok:{i:016x}");
            assert!(
                store.decide_one(&Check { key: &key, limiter: &limiter, cost: 1, shadow: false }, Nanos::ZERO).allowed
            );
        }
        assert_eq!(store.len(), CALLERS);
        let per_key = (live() - baseline) as f64 / CALLERS as f64;
        println!("{}: {per_key:.1} bytes per live key at {CALLERS} keys", limiter.algorithm());
        assert!(per_key <= 128.0, "{}: {per_key:.1} bytes per key", limiter.algorithm());

        // One token's refill later every bucket is full again: indistinguishable from new.
        assert_eq!(store.sweep_at(Nanos::new(SEC)), CALLERS);
        assert!(store.is_empty());
        let left = live() - baseline;
        println!("{}: {left} bytes left after the sweep", limiter.algorithm());
        assert!(left < 64 * 1024, "sweep must give memory back, {left} bytes still held");
    }
}
