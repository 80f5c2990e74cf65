-- adjust.lua: the entry point that adjusts budgets after the fact (Limiter::adjust in Rust): an
-- operator's refund, or a call's price settled from what it used. A refund gives units back,
-- never beyond the capacity; a charge takes what the key can still admit, capped at the units
-- (a settlement saturates at empty, never below). A key without state, or with another
-- algorithm's, is as good as full: a refund leaves it alone, a charge starts from a fresh state.
-- In-flight slots are work, not a price: a charge leaves them alone.
--
-- A settlement is sent again when its answer is lost (a timeout, a connection dropped), and the
-- lost one may have been applied: so it carries a mark, set here with the adjustment in one
-- step, and an adjustment whose mark is already set changes nothing. Applied exactly once,
-- however often it is sent while the mark lives.
--
-- KEYS: the budgets' keys (one call's keys share a hash tag), then the mark's key when ARGV[4]
-- is above 0 (under the same hash tag).
-- ARGV[1]: now in epoch microseconds, or "" to use Redis's TIME. ARGV[2]: "refund" or "charge".
-- ARGV[3]: units. ARGV[4]: how long the mark lives, in ms (0: no mark). ARGV[5..]: three per
-- budget: algorithm name, capacity, span (ns; see the prelude).
-- Returns each budget's level after it as decide.lua answers a cost-0 check: five integers per
-- budget, allowed (1), limit, remaining, retry_after (ns), reset_after (ns).

if redis.replicate_commands then
  redis.replicate_commands()
end

local now_us = read_now(ARGV[1])
local charge = ARGV[2] == 'charge'
local mark_ms = tonumber(ARGV[4]) or 0
local budgets = mark_ms > 0 and #KEYS - 1 or #KEYS
local FIRST = 5
-- Every algorithm named is known before anything is written (an error reply keeps writes).
for i = 1, budgets do
  local name = ARGV[FIRST + (i - 1) * 3]
  if not algorithms[name] then
    return redis.error_reply('unknown limiter algorithm "' .. tostring(name) .. '"')
  end
end

-- Sent before, and applied then: this time only the levels.
local again = mark_ms > 0 and not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'PX', mark_ms)

local reply = {}
for i = 1, budgets do
  local at = FIRST + (i - 1) * 3
  local name = ARGV[at]
  local algorithm = algorithms[name]
  local limiter = { capacity = tonumber(ARGV[at + 1]), span = tonumber(ARGV[at + 2]), lease = 0, lease_us = 0 }
  local units = math.min(tonumber(ARGV[3]), limiter.capacity)

  local state = nil
  local raw = redis.call('GET', KEYS[i])
  if raw then
    local stored, fields = decode(raw)
    state = stored == name and algorithm.load(fields) or nil
  end
  if again then
    -- (the levels as they stand)
  elseif charge and limiter.span > 0 then
    state = state or algorithm.fresh(limiter, now_us)
    local left = algorithm.acquire(limiter, state, now_us, 0).remaining
    local _, charged = algorithm.acquire(limiter, state, now_us, math.min(units, left))
    if charged then
      state = charged
      write_state(KEYS[i], name, limiter, state, now_us)
    end
  elseif not charge and state then
    state = algorithm.refund(limiter, state, now_us, units)
    write_state(KEYS[i], name, limiter, state, now_us)
  end

  local decision = algorithm.acquire(limiter, state or algorithm.fresh(limiter, now_us), now_us, 0)
  append_decision(reply, decision)
end
return reply
