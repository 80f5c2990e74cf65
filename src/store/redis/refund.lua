-- refund.lua: the entry point that gives `units` back to the budget under one key (an
-- operator's refund, Limiter::refund in Rust), never beyond its capacity. A key without state,
-- or with another algorithm's, is as good as full and is left alone.
--
-- KEYS[1]: the key. ARGV[1]: now in epoch microseconds, or "" to use Redis's TIME.
-- ARGV[2..5]: algorithm name, capacity, span (ns; see the prelude), units.
-- Returns the level after it as decide.lua answers a cost-0 check: allowed (1), limit,
-- remaining, retry_after (ns), reset_after (ns).

if redis.replicate_commands then
  redis.replicate_commands()
end

local now_us = read_now(ARGV[1])
local name = ARGV[2]
local algorithm = algorithms[name]
if not algorithm then
  return redis.error_reply('unknown limiter algorithm "' .. tostring(name) .. '"')
end
local limiter = { capacity = tonumber(ARGV[3]), span = tonumber(ARGV[4]), lease = 0, lease_us = 0 }
local units = math.min(tonumber(ARGV[5]), limiter.capacity)

local state = algorithm.fresh(limiter, now_us)
local raw = redis.call('GET', KEYS[1])
if raw then
  local stored, fields = decode(raw)
  local loaded = stored == name and algorithm.load(fields)
  if loaded then
    state = algorithm.refund(limiter, loaded, now_us, units)
    write_state(KEYS[1], name, limiter, state, now_us)
  end
end

local decision = algorithm.acquire(limiter, state, now_us, 0)
return { decision.allowed and 1 or 0, decision.limit, decision.remaining, decision.retry_after, decision.reset_after }
